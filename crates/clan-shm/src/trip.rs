//! Tripwire entries and the fire / wait protocols.
//!
//! A tripwire is one [`TripEntry`] in the index ([`crate::cam`]) of the aperture (or mapping)
//! it watches, linked into that index's lists, plus a bit in the fired bitmap and a tripset
//! word of the event queue it reports to ([`TripTable`], indexed by the entry's `qindex`). The
//! owner of the index allocates, arms and frees entries; whoever moves data through a watched
//! range *fires* them ([`fire`]) — the owner's process itself; another process only reads the
//! index and asks the owner to fire (`crate::snoop::Sink`).
//!
//! ## The `state` word
//!
//! `state = generation << 32 | flags`. The generation changes every time the entry is
//! reused, so a stale reference (an event, a candidate found in the index) cannot fire or
//! report a later tripwire. Entry fields other than `state` are written by the owner only
//! while the entry is not [`LIVE`]; readers take them between two reads of `state` and
//! discard them if the generation moved (a seqlock).
//!
//! ## No lost wake-up: arming against a concurrent write
//!
//! Arming side (the owner): `state.fetch_or(ARMED, SeqCst)` (or index insertion followed by
//! `epoch.fetch_add(SeqCst)`), then `fence(SeqCst)`, then re-check the data it waits for.
//! Writing side ([`crate::snoop`]): store the data, `fence(SeqCst)`, then load `state` (or
//! `epoch`). By the two fences, either the writer sees the tripwire armed and fires it, or the
//! arming side sees the data: a tripwire can fire spuriously, never be missed.
//!
//! ## Once-only
//!
//! A once-only tripwire fires by `compare_exchange(state, state & !ARMED)`: of any number of
//! concurrent writers exactly one wins and performs the actions.
//!
//! ## Waiting
//!
//! Every firing increments `seq`, the futex word (in the entry's [`TripCell`], in the queue's
//! table). A waiter increments `waiters`, fences, and
//! sleeps while `seq` still holds the value it saw; a firer increments `seq`, fences, and
//! wakes only if `waiters != 0` — so a firing costs no system call unless someone sleeps.

use crate::sync::{AtomicU32, AtomicU64, Futex, Ordering, fence};

/// The entry is allocated (its fields are valid for its generation).
pub const LIVE: u32 = 1 << 0;
/// The entry fires on matching traffic.
pub const ARMED: u32 = 1 << 1;
/// Disarm on first firing.
pub const ONCE: u32 = 1 << 2;
/// Fire on reads through the NIC.
pub const ON_READ: u32 = 1 << 3;
/// Fire on writes through the NIC.
pub const ON_WRITE: u32 = 1 << 4;
/// Action: post an event to the queue.
pub const ACT_EVENT: u32 = 1 << 5;
/// Action: set the entry's bit in the queue's fired bitmap.
pub const ACT_BITMAP: u32 = 1 << 6;
/// Action: count firings in `count`.
pub const ACT_COUNTER: u32 = 1 << 7;
/// The entry is on its index's wide list (it spans more than [`crate::cam::NARROW_LINES`]
/// lines).
pub const WIDE: u32 = 1 << 8;

/// The kind of traffic being snooped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A read through the NIC.
    Read,
    /// A write through the NIC.
    Write,
}

impl Access {
    /// The state flag matching this access.
    pub fn flag(self) -> u32 {
        match self {
            Access::Read => ON_READ,
            Access::Write => ON_WRITE,
        }
    }
}

/// Split a state word.
#[inline]
pub fn generation(state: u64) -> u32 {
    (state >> 32) as u32
}

/// Split a state word.
#[inline]
pub fn flags(state: u64) -> u32 {
    state as u32
}

/// Build a state word.
#[inline]
pub fn state_word(generation: u32, flags: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(flags)
}

/// One tripwire, 64 bytes.
#[repr(C)]
#[derive(Debug)]
pub struct TripEntry {
    /// `generation << 32 | flags`.
    pub state: AtomicU64,
    /// First watched byte (offset within the watched aperture or mapping).
    pub start: AtomicU64,
    /// One past the last watched byte.
    pub end: AtomicU64,
    /// Identity of the index the entry belongs to (see [`crate::cam::CamHeader::tag`]).
    pub tag: AtomicU64,
    /// Next entry on the same index list, as `index + 1`; 0 ends the list.
    pub next: AtomicU32,
    /// Tripset word to bump on firing, as `index + 1`; 0 for none.
    pub tripset: AtomicU32,
    /// The entry's index in its event queue's table (its fired bit, its cell, its identity
    /// in events).
    pub qindex: AtomicU32,
    _r: [AtomicU32; 3],
    _r2: [AtomicU64; 1],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<TripEntry>() == 64);

impl TripEntry {
    /// A free entry of generation 0.
    pub fn new() -> TripEntry {
        TripEntry {
            state: AtomicU64::new(0),
            start: AtomicU64::new(0),
            end: AtomicU64::new(0),
            tag: AtomicU64::new(0),
            next: AtomicU32::new(0),
            tripset: AtomicU32::new(0),
            qindex: AtomicU32::new(0),
            _r: std::array::from_fn(|_| AtomicU32::new(0)),
            _r2: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Default for TripEntry {
    fn default() -> Self {
        Self::new()
    }
}

/// What firing a tripwire writes, in its queue's table (memory of the queue's owner only,
/// the only process that fires): kept out of the entry, which other processes read to snoop
/// their writes, so that a firing never takes away a line another process reads next.
#[repr(C)]
#[derive(Debug)]
pub struct TripCell {
    /// Firing sequence number; the futex word waiters sleep on.
    pub seq: AtomicU32,
    /// Number of threads sleeping on `seq`.
    pub waiters: AtomicU32,
    /// The counter action.
    pub count: AtomicU64,
}

impl TripCell {
    /// A zeroed cell.
    pub fn new() -> TripCell {
        TripCell { seq: AtomicU32::new(0), waiters: AtomicU32::new(0), count: AtomicU64::new(0) }
    }
}

impl Default for TripCell {
    fn default() -> Self {
        Self::new()
    }
}

/// A tripset's wake word.
#[repr(C)]
#[derive(Debug)]
pub struct TripsetWord {
    /// Bumped by every firing of a member; futex word.
    pub seq: AtomicU32,
    /// Threads sleeping on `seq`.
    pub waiters: AtomicU32,
}

impl TripsetWord {
    /// A zeroed word.
    pub fn new() -> TripsetWord {
        TripsetWord { seq: AtomicU32::new(0), waiters: AtomicU32::new(0) }
    }
}

impl Default for TripsetWord {
    fn default() -> Self {
        Self::new()
    }
}

/// The event queue's part of its tripwires: the fired bitmap (one bit per queue index) and
/// the tripset wake words. Empty for a process that only reads an index (it never fires).
#[derive(Clone, Copy)]
pub struct TripTable<'a> {
    /// Fired bitmap, one bit per queue index.
    pub bitmap: &'a [AtomicU64],
    /// Tripset wake words.
    pub tripsets: &'a [TripsetWord],
    /// Firing state, one cell per queue index.
    pub cells: &'a [TripCell],
}

impl TripTable<'_> {
    /// A table with no bitmap, no tripsets and no cells.
    pub const EMPTY: TripTable<'static> = TripTable { bitmap: &[], tripsets: &[], cells: &[] };

    /// The cell of queue index `qindex`, if the table has it.
    pub fn cell(&self, qindex: u32) -> Option<&TripCell> {
        self.cells.get(qindex as usize)
    }
}

impl std::fmt::Debug for TripTable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TripTable")
            .field("bits", &(self.bitmap.len() * 64))
            .field("tripsets", &self.tripsets.len())
            .finish_non_exhaustive()
    }
}

/// What [`fire`] asks the caller to do after the in-memory actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fired {
    /// The entry did not fire (stale generation, disarmed, lost the once-only race, or
    /// does not watch this kind of access).
    No,
    /// It fired; no event to post.
    Yes,
    /// It fired and its event action is on: post a tripwire event for queue index `qindex`
    /// (of the generation fired).
    PostEvent {
        /// The entry's queue index.
        qindex: u32,
    },
}

/// Whether entry `e` of generation `generation` would fire for `access` now (live, armed,
/// watching that access): the look of a process that may not fire it itself.
pub fn would_fire(e: &TripEntry, generation_: u32, access: Access) -> bool {
    let s = e.state.load(Ordering::Acquire);
    let fl = flags(s);
    generation(s) == generation_ && fl & (LIVE | ARMED) == (LIVE | ARMED) && fl & access.flag() != 0
}

/// Fire entry `e` of generation `generation` for `access`, if it is armed, with the actions
/// that live in its queue's `table`.
///
/// Performs the bitmap and counter actions, bumps `seq` (in the entry's cell of `table`)
/// and the tripset word and wakes their sleepers. Posting the event (if [`Fired::PostEvent`]) is left to the caller, who holds the
/// producer ring.
pub fn fire(e: &TripEntry, generation_: u32, access: Access, table: &TripTable<'_>, futex: &impl Futex) -> Fired {
    let mut s = e.state.load(Ordering::Acquire);
    let fl = loop {
        let fl = flags(s);
        if generation(s) != generation_ || fl & (LIVE | ARMED) != (LIVE | ARMED) || fl & access.flag() == 0 {
            return Fired::No;
        }
        if fl & ONCE == 0 {
            break fl;
        }
        // Exactly one of any number of concurrent firers wins the once-only tripwire.
        match e.state.compare_exchange(s, s & !u64::from(ARMED), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break fl,
            Err(now) => s = now,
        }
    };
    // Written before the entry went live (`publish`), like the range.
    let qindex = e.qindex.load(Ordering::Relaxed);
    if fl & ACT_BITMAP != 0 {
        if let Some(w) = table.bitmap.get(qindex as usize / 64) {
            // SYNC POINT: pairs with `test_bit`'s Acquire load.
            w.fetch_or(1u64 << (qindex % 64), Ordering::Release);
        }
    }
    if let Some(c) = table.cell(qindex) {
        if fl & ACT_COUNTER != 0 {
            c.count.fetch_add(1, Ordering::Relaxed);
        }
        // SYNC POINT: pairs with the waiters' `seq.load(Acquire)` in `wait_until`.
        c.seq.fetch_add(1, Ordering::AcqRel);
        // Dekker with `wait_until`'s "waiters += 1, fence, check".
        fence(Ordering::SeqCst);
        if c.waiters.load(Ordering::Relaxed) != 0 {
            futex.wake(&c.seq);
        }
    } else {
        // No cell (a table without them): the tripset's fence below still orders.
        fence(Ordering::SeqCst);
    }
    // Read the tripset link only after the fence: a tripset waiter that linked this entry and
    // then fenced either sees our `seq` above, or we see its link here.
    let ts = e.tripset.load(Ordering::Relaxed);
    if let Some(w) = if ts != 0 { table.tripsets.get(ts as usize - 1) } else { None } {
        // SYNC POINT: pairs with `wait_until`'s `seq.load(Acquire)` on the tripset word.
        w.seq.fetch_add(1, Ordering::AcqRel);
        fence(Ordering::SeqCst);
        if w.waiters.load(Ordering::Relaxed) != 0 {
            futex.wake(&w.seq);
        }
    }
    if fl & ACT_EVENT != 0 { Fired::PostEvent { qindex } } else { Fired::Yes }
}

/// Owner: make free entry `e` live as generation `generation` watching `[start, end)`, with
/// queue index `qindex`.
/// The fields are written while the entry is not live, then `state` publishes them.
///
/// The leading `fence(Release)` is the seqlock writer's: a reader that sees any field value
/// written here and then executes its `fence(Acquire)` also sees everything the owner did
/// before — the retirement of the previous generation and the `epoch` bump of its unlinking.
/// Without it, a walker led astray by a reused entry's new `next` could read a stale `epoch`
/// after its transfer and skip the re-lookup that repairs the walk (found by loom:
/// `relink_under_walker_still_fires`).
pub fn publish(e: &TripEntry, generation_: u32, flags_: u32, start: u64, end: u64, tag: u64, qindex: u32) {
    fence(Ordering::Release);
    e.qindex.store(qindex, Ordering::Relaxed);
    e.start.store(start, Ordering::Relaxed);
    e.end.store(end, Ordering::Relaxed);
    e.tag.store(tag, Ordering::Relaxed);
    e.next.store(0, Ordering::Relaxed);
    e.tripset.store(0, Ordering::Relaxed);
    // SYNC POINT: pairs with the readers' Acquire load of `state` (the seqlock in `cam`).
    e.state.store(state_word(generation_, flags_ | LIVE), Ordering::Release);
}

/// Owner: retire a live entry; it stops firing and readers drop it. Its generation is kept
/// (the next `publish` must use a new one).
pub fn retire(e: &TripEntry) {
    let s = e.state.load(Ordering::Relaxed);
    e.state.store(state_word(generation(s), 0), Ordering::Release);
}

/// Owner: arm (`on`) or disarm an entry of generation `generation_`, and fence, so that
/// a re-check of the watched data made afterwards cannot miss a concurrent write.
/// Returns false if the entry is not live in that generation.
pub fn set_armed(e: &TripEntry, generation_: u32, on: bool) -> bool {
    let mut s = e.state.load(Ordering::Relaxed);
    loop {
        if generation(s) != generation_ || flags(s) & LIVE == 0 {
            return false;
        }
        let n = if on { s | u64::from(ARMED) } else { s & !u64::from(ARMED) };
        match e.state.compare_exchange_weak(s, n, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => s = now,
        }
    }
    // Dekker with the writers' "store data, fence, load state" (`snoop`).
    fence(Ordering::SeqCst);
    true
}

/// Owner: switch action flags `mask` on or off (event registration and the like).
pub fn set_flags(e: &TripEntry, generation_: u32, mask: u32, on: bool) -> bool {
    let mut s = e.state.load(Ordering::Relaxed);
    loop {
        if generation(s) != generation_ || flags(s) & LIVE == 0 {
            return false;
        }
        let n = if on { s | u64::from(mask) } else { s & !u64::from(mask) };
        match e.state.compare_exchange_weak(s, n, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => s = now,
        }
    }
}

/// Test the fired bit of `index` (no system call).
pub fn test_bit(table: &TripTable<'_>, index: u32) -> bool {
    table.bitmap.get(index as usize / 64).is_some_and(|w| w.load(Ordering::Acquire) & (1u64 << (index % 64)) != 0)
}

/// Clear the fired bit of `index`; returns whether it was set.
pub fn clear_bit(table: &TripTable<'_>, index: u32) -> bool {
    table
        .bitmap
        .get(index as usize / 64)
        .is_some_and(|w| w.fetch_and(!(1u64 << (index % 64)), Ordering::AcqRel) & (1u64 << (index % 64)) != 0)
}

/// Sleep on `seq` until `ready()` holds or `deadline` passes, spinning on `ready` for `spin`
/// first. Returns whether `ready()` held.
///
/// `ready` must become true no later than the `seq` increment of the firing it waits for
/// (it typically compares that same `seq`, or the `seq`s of a tripset's members).
/// Protocol: read `seq`, `waiters += 1`, `fence(SeqCst)`, check `ready`, then sleep while
/// `seq` holds the value read — against [`fire`]'s "seq += 1, fence, load waiters".
pub fn wait_until(
    seq: &AtomicU32,
    waiters: &AtomicU32,
    spin: std::time::Duration,
    deadline: Option<std::time::Instant>,
    futex: &impl Futex,
    mut ready: impl FnMut() -> bool,
) -> bool {
    if ready() {
        return true;
    }
    if !spin.is_zero() {
        let until = std::time::Instant::now() + spin;
        while std::time::Instant::now() < until {
            crate::sync::spin_hint();
            if ready() {
                return true;
            }
        }
    }
    loop {
        // SYNC POINT: pairs with `fire`'s `seq.fetch_add(AcqRel)`.
        let seen = seq.load(Ordering::Acquire);
        waiters.fetch_add(1, Ordering::AcqRel);
        fence(Ordering::SeqCst);
        if ready() {
            waiters.fetch_sub(1, Ordering::AcqRel);
            return true;
        }
        let timeout = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    waiters.fetch_sub(1, Ordering::AcqRel);
                    return false;
                }
                Some(left)
            }
            None => None,
        };
        futex.wait(seq, seen, timeout);
        waiters.fetch_sub(1, Ordering::AcqRel);
    }
}
