//! Tripwire entries and the fire / wait protocols.
//!
//! A tripwire is one [`TripEntry`] in the index ([`crate::cam`]) of the aperture (or mapping)
//! it watches, linked into that index's lists, plus a bit in the fired bitmap and a tripset
//! word of the event queue it reports to ([`TripTable`], indexed by the entry's `qindex`). The
//! owner of the index allocates, arms and frees entries; whoever moves data through a watched
//! range *fires* them ([`fire`]) — the owner's process itself; another process only reads the
//! index and asks the owner to fire (`crate::snoop::Sink`).
//!
//! ## The `state` word: authoritative in the cell, mirrored in the entry
//!
//! `state = generation << 32 | version << 12 | flags`. The generation changes every time the
//! entry is reused, so a stale reference (an event, a candidate found in the index, a claim)
//! cannot fire or report a later tripwire. The version counts changes within a generation.
//!
//! The word that decides is the one in the tripwire's [`TripCell`] (the queue's table: memory
//! of the owner alone). The entry's `state` is a *mirror* of it for the processes that only
//! read the index: they look there whether a write of theirs would fire it, and ask the owner
//! (a claim, `clan::port`), who fires by the cell. The mirror is written by the owner after
//! each change of the cell ([`mirror`]) and only ever moves to a newer (generation, version):
//! a late copy of an older word never overwrites a newer one. So once an arming has been
//! mirrored, the mirror shows it armed or shows a later change (a firing that used it, a
//! disarm, a retirement), never an earlier disarmed word.
//!
//! Entry fields other than `state` are written by the owner only while the entry is not
//! [`LIVE`]; readers take them between two reads of the mirror and discard them if the
//! generation moved (a seqlock).
//!
//! ## No lost wake-up: arming against a concurrent write
//!
//! Arming side (the owner): set `ARMED` in the cell and mirror it (or index insertion
//! followed by `epoch.fetch_add(SeqCst)`), then `fence(SeqCst)`, then re-check the data it
//! waits for. Writing side ([`crate::snoop`]): store the data, `fence(SeqCst)`, then load the
//! mirror (or `epoch`). By the two fences, either the writer sees the arming (or a later word)
//! and fires it, directly or by a claim, or the arming side sees the data: a tripwire can
//! fire spuriously, never be missed.
//!
//! ## The armed count: nothing to walk when nothing is armed
//!
//! Each index counts, in its header ([`crate::cam::CamHeader::armed`]), the entries whose
//! mirror says armed; a writer that reads 0 after its fence walks no list
//! ([`crate::cam::CamView::armed_in`]). Every write of a mirror word keeps the count
//! ([`ArmedCount`]): a word that says armed is counted *before* it is written, and the armed
//! word it replaces is uncounted *after*. So the count is never below the number of armed
//! mirrors, whatever threads race (of two mirror writes, the second reads the first's word
//! with its compare-exchange, and so uncounts it only after the first counted it), and an
//! arming is counted before its fence, as its mirror is written before it: the writer's
//! fence either comes later, and its load sees the count, or earlier, and the owner's
//! re-check sees the data. A count above the truth costs a walk, as before; only a count
//! below it could lose a wake-up. The count lives in the index (the owner's memory, mapped
//! read-only by importers): a lying owner only keeps its own wake-ups from itself.
//!
//! ## Once-only
//!
//! A once-only tripwire fires by `compare_exchange(state, disarmed)` on the cell: of any
//! number of concurrent firers exactly one wins and performs the actions; it then mirrors the
//! disarmed word (a claimant's writes stop asking).
//!
//! ## Waiting
//!
//! Every firing increments `seq`, the futex word (in the tripwire's [`TripCell`]). A waiter
//! increments `waiters`, fences, and sleeps while `seq` still holds the value it saw; a firer
//! increments `seq`, fences, and wakes only if `waiters != 0` — so a firing costs no system
//! call unless someone sleeps.

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
/// The bits of a state word that are flags (the next 20 count versions).
pub const FLAG_MASK: u32 = (1 << VERSION_SHIFT) - 1;
const VERSION_SHIFT: u32 = 12;
const VERSION_MASK: u64 = 0xF_FFFF << VERSION_SHIFT;

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
    state as u32 & FLAG_MASK
}

/// Build a state word (version 0).
#[inline]
pub fn state_word(generation: u32, flags: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(flags & FLAG_MASK)
}

/// `s` with its flags replaced by `flags` and its version advanced.
#[inline]
fn next_word(s: u64, flags: u32) -> u64 {
    let version = (s & VERSION_MASK).wrapping_add(1 << VERSION_SHIFT) & VERSION_MASK;
    (s & !(VERSION_MASK | u64::from(FLAG_MASK))) | version | u64::from(flags & FLAG_MASK)
}

/// Whether state word `a` is newer than `b`: a later generation, or the same generation at a
/// later version (both compared with wrap-around: generations by half their range, versions
/// by half of 2^20 changes).
#[inline]
pub fn newer(a: u64, b: u64) -> bool {
    let (ga, gb) = (generation(a), generation(b));
    if ga != gb {
        return ga.wrapping_sub(gb) as i32 > 0;
    }
    let d = ((a & VERSION_MASK).wrapping_sub(b & VERSION_MASK) & VERSION_MASK) >> VERSION_SHIFT;
    d != 0 && d < 1 << 19
}

/// One tripwire, 64 bytes.
#[repr(C)]
#[derive(Debug)]
pub struct TripEntry {
    /// The mirror of the cell's state word (see the module documentation).
    pub state: AtomicU64,
    /// First watched byte (offset within the watched aperture or mapping).
    pub start: AtomicU64,
    /// One past the last watched byte.
    pub end: AtomicU64,
    /// Identity of the index the entry belongs to (see [`crate::cam::CamMeta::tag`]).
    pub tag: AtomicU64,
    /// Next entry on the same index list, as `index + 1`; 0 ends the list.
    pub next: AtomicU32,
    /// The entry's index in its event queue's table (its fired bit, its cell, its identity
    /// in events).
    pub qindex: AtomicU32,
    _r: [AtomicU32; 4],
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

/// A tripwire's state in its queue's table, memory of the queue's owner only (the only process
/// that fires): the authoritative state word, who may claim it, and what firing writes — all
/// on one line, so that a claim costs the owner one line it owns, and kept out of the entry,
/// which other processes read to snoop their writes.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct TripCell {
    /// The state word (`generation << 32 | version << 12 | flags`); the entry mirrors it.
    pub state: AtomicU64,
    /// Who may claim it (opaque to this crate: `clan` puts the watched aperture's identity;
    /// [`NO_SOURCE`] for none).
    pub source: AtomicU64,
    /// The counter action.
    pub count: AtomicU64,
    /// What the owner reports with its events (opaque here: `clan`'s registration cookie),
    /// on the line a firing touches anyway. Written before the state change that turns the
    /// event action on.
    pub cookie: AtomicU64,
    /// Firing sequence number; the futex word waiters sleep on.
    pub seq: AtomicU32,
    /// Number of threads sleeping on `seq`.
    pub waiters: AtomicU32,
    /// Tripset word to bump on firing, as `index + 1`; 0 for none.
    pub tripset: AtomicU32,
    /// As `cookie` (`clan`: the endpoint that owns the tripwire).
    pub owner: AtomicU32,
}

/// [`TripCell::source`] of a tripwire nobody else may claim.
pub const NO_SOURCE: u64 = u64::MAX;

impl TripCell {
    /// A zeroed cell.
    pub fn new() -> TripCell {
        TripCell {
            state: AtomicU64::new(0),
            source: AtomicU64::new(NO_SOURCE),
            count: AtomicU64::new(0),
            cookie: AtomicU64::new(0),
            seq: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            tripset: AtomicU32::new(0),
            owner: AtomicU32::new(0),
        }
    }
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<TripCell>() == 64);

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
    /// The tripwire did not fire (stale generation, disarmed, lost the once-only race, or
    /// does not watch this kind of access).
    No,
    /// It fired; no event to post.
    Yes {
        /// It was once-only and is now disarmed: the caller mirrors the cell ([`mirror`])
        /// if it can reach the entry ([`fire_entry`] does).
        disarmed: bool,
    },
    /// It fired and its event action is on: post a tripwire event for queue index `qindex`
    /// (of the generation fired).
    PostEvent {
        /// The tripwire's queue index.
        qindex: u32,
        /// As in [`Fired::Yes`].
        disarmed: bool,
    },
}

impl Fired {
    /// Whether it fired.
    pub fn fired(self) -> bool {
        self != Fired::No
    }

    /// Whether the firing disarmed a once-only tripwire (its mirror is to be updated).
    pub fn disarmed(self) -> bool {
        matches!(self, Fired::Yes { disarmed: true } | Fired::PostEvent { disarmed: true, .. })
    }
}

/// Whether state word `s` fires for generation `generation_` and `access`.
#[inline]
fn fires(s: u64, generation_: u32, access: Access) -> bool {
    let fl = flags(s);
    generation(s) == generation_ && fl & (LIVE | ARMED) == (LIVE | ARMED) && fl & access.flag() != 0
}

/// The count of armed mirrors of one index ([`crate::cam::CamHeader::armed`]), kept by every
/// write of a mirror word (module documentation).
#[derive(Debug, Clone, Copy)]
pub struct ArmedCount<'a>(pub &'a AtomicU32);

impl ArmedCount<'_> {
    /// Before writing the mirror word `new`: count it if it says armed. Returns what
    /// [`ArmedCount::after`] must be told.
    #[inline]
    fn before(self, new: u64) -> bool {
        let up = says_armed(new);
        if up {
            // SYNC POINT: before the mirror's write and the arming's fence(SeqCst): a
            // writer's fence that comes after that one sees it (`CamView::none_armed`).
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        up
    }

    /// After trying to write a mirror word counted by [`ArmedCount::before`] (`up`): `old`,
    /// the word it replaced (`Some`), or `None` if it was not written.
    #[inline]
    fn after(self, up: bool, old: Option<u64>) {
        let down = match old {
            Some(old) => says_armed(old),
            None => up,
        };
        if down {
            // (after the write that replaced an armed word, or undoing a count of a word
            // never written: never below the armed mirrors)
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Whether a mirror word says armed (live and armed, any generation).
#[inline]
fn says_armed(s: u64) -> bool {
    flags(s) & (LIVE | ARMED) == (LIVE | ARMED)
}

/// Whether entry `e` of generation `generation` would fire for `access` now (live, armed,
/// watching that access), by its mirror: the look of a process that may not fire it itself.
pub fn would_fire(e: &TripEntry, generation_: u32, access: Access) -> bool {
    fires(e.state.load(Ordering::Acquire), generation_, access)
}

/// Fire the tripwire of queue index `qindex` and generation `generation` for `access`, if its
/// cell in `table` says it is armed: the bitmap and counter actions, `seq` and the tripset word
/// bumped and their sleepers woken. Posting the event (if [`Fired::PostEvent`]) is left to the
/// caller, who holds the producer ring; so is mirroring a once-only disarm
/// ([`Fired::disarmed`]). A table without that cell fires nothing.
pub fn fire(table: &TripTable<'_>, qindex: u32, generation_: u32, access: Access, futex: &impl Futex) -> Fired {
    let Some(c) = table.cell(qindex) else {
        return Fired::No;
    };
    // SYNC POINT: pairs with the Release of `publish`/`set_armed`/`set_flags` on the cell.
    let mut s = c.state.load(Ordering::Acquire);
    let fl = loop {
        if !fires(s, generation_, access) {
            return Fired::No;
        }
        let fl = flags(s);
        if fl & ONCE == 0 {
            break fl;
        }
        // Exactly one of any number of concurrent firers wins the once-only tripwire.
        match c.state.compare_exchange(s, next_word(s, fl & !ARMED), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break fl,
            Err(now) => s = now,
        }
    };
    if fl & ACT_BITMAP != 0 {
        if let Some(w) = table.bitmap.get(qindex as usize / 64) {
            // SYNC POINT: pairs with `test_bit`'s Acquire load.
            w.fetch_or(1u64 << (qindex % 64), Ordering::Release);
        }
    }
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
    // Read the tripset link only after the fence: a tripset waiter that linked this tripwire
    // and then fenced either sees our `seq` above, or we see its link here.
    let ts = c.tripset.load(Ordering::Relaxed);
    if let Some(w) = if ts != 0 { table.tripsets.get(ts as usize - 1) } else { None } {
        // SYNC POINT: pairs with `wait_until`'s `seq.load(Acquire)` on the tripset word.
        w.seq.fetch_add(1, Ordering::AcqRel);
        fence(Ordering::SeqCst);
        if w.waiters.load(Ordering::Relaxed) != 0 {
            futex.wake(&w.seq);
        }
    }
    let disarmed = fl & ONCE != 0;
    if fl & ACT_EVENT != 0 { Fired::PostEvent { qindex, disarmed } } else { Fired::Yes { disarmed } }
}

/// [`fire`] the tripwire of entry `e` (its queue index read from the entry; a stale one
/// names a cell of another generation, which does not fire) and mirror a once-only disarm.
pub fn fire_entry(
    e: &TripEntry,
    armed: ArmedCount<'_>,
    generation_: u32,
    access: Access,
    table: &TripTable<'_>,
    futex: &impl Futex,
) -> Fired {
    let qindex = e.qindex.load(Ordering::Relaxed);
    let f = fire(table, qindex, generation_, access, futex);
    if f.disarmed() {
        if let Some(c) = table.cell(qindex) {
            mirror(e, armed, c, qindex);
        }
    }
    f
}

/// Owner: bring entry `e`'s mirror up to the cell `c` of queue index `qindex`, unless the
/// entry no longer belongs to that cell (it was retired and published again: `publish` writes
/// the mirror of a new generation itself) or already holds a newer word (another thread
/// mirrored a later change first). Call after every change of a live tripwire's cell.
///
/// Within a generation the mirror only moves forward ([`newer`]): of two threads mirroring
/// two changes, the later word stays, whichever thread writes last. Hence once a change has
/// been mirrored, the mirror shows it or a later one — what the arming protocol needs (module
/// documentation).
pub fn mirror(e: &TripEntry, armed: ArmedCount<'_>, c: &TripCell, qindex: u32) {
    // SYNC POINT: pairs with `publish`'s Release store of the mirror: seeing its word, we see
    // the entry's `qindex` it published.
    let mut m = e.state.load(Ordering::Acquire);
    loop {
        if e.qindex.load(Ordering::Relaxed) != qindex {
            return;
        }
        // SYNC POINT: pairs with the Release of the cell's change (ours, or another thread's
        // whose word we copy).
        let now = c.state.load(Ordering::Acquire);
        if generation(now) != generation(m) || !newer(now, m) {
            return;
        }
        let up = armed.before(now);
        // SYNC POINT: Release pairs with the readers' Acquire load of the mirror (`cam`'s
        // seqlock, `would_fire`), and with the next mirror write's compare-exchange, which
        // uncounts this word only after this thread counted it (`ArmedCount`).
        match e.state.compare_exchange(m, now, Ordering::AcqRel, Ordering::Acquire) {
            Ok(old) => {
                armed.after(up, Some(old));
                return;
            }
            Err(seen) => {
                armed.after(up, None);
                m = seen;
            }
        }
    }
}

/// Owner: make free entry `e` live as generation `generation` watching `[start, end)`, with
/// queue index `qindex` whose cell is `c` (claimable by `source`, or [`NO_SOURCE`]).
/// The fields are written while the entry is not live, then the cell's state publishes them,
/// then the mirror.
///
/// The leading `fence(Release)` is the seqlock writer's: a reader that sees any field value
/// written here and then executes its `fence(Acquire)` also sees everything the owner did
/// before — the retirement of the previous generation and the `epoch` bump of its unlinking.
/// Without it, a walker led astray by a reused entry's new `next` could read a stale `epoch`
/// after its transfer and skip the re-lookup that repairs the walk (found by loom:
/// `relink_under_walker_still_fires`).
#[allow(clippy::too_many_arguments)]
pub fn publish(
    e: &TripEntry,
    armed: ArmedCount<'_>,
    c: &TripCell,
    generation_: u32,
    flags_: u32,
    start: u64,
    end: u64,
    tag: u64,
    qindex: u32,
    source: u64,
) {
    fence(Ordering::Release);
    e.qindex.store(qindex, Ordering::Relaxed);
    e.start.store(start, Ordering::Relaxed);
    e.end.store(end, Ordering::Relaxed);
    e.tag.store(tag, Ordering::Relaxed);
    e.next.store(0, Ordering::Relaxed);
    c.source.store(source, Ordering::Relaxed);
    c.tripset.store(0, Ordering::Relaxed);
    let word = state_word(generation_, flags_ | LIVE);
    // SYNC POINT: pairs with `fire`'s and `mirror`'s Acquire loads of the cell.
    c.state.store(word, Ordering::Release);
    // SYNC POINT: pairs with the readers' Acquire load of the mirror (the seqlock in `cam`,
    // `mirror`). A new generation is written here, never by `mirror`; then catch up with a
    // change made to the cell since (a claim guessing the new generation). A swap, counted
    // as `mirror` counts its writes (`ArmedCount`: the word replaced is the retired one).
    let up = armed.before(word);
    let old = e.state.swap(word, Ordering::AcqRel);
    armed.after(up, Some(old));
    mirror(e, armed, c, qindex);
}

/// Owner: change the state of the tripwire in cell `c` of queue index `qindex` (entry `e`) of
/// generation `generation_` with `f(flags)`, and mirror it; false if it is not live in that
/// generation.
fn change(
    e: &TripEntry,
    armed: ArmedCount<'_>,
    c: &TripCell,
    qindex: u32,
    generation_: u32,
    f: impl Fn(u32) -> u32,
) -> bool {
    let mut s = c.state.load(Ordering::Relaxed);
    loop {
        if generation(s) != generation_ || flags(s) & LIVE == 0 {
            return false;
        }
        // SYNC POINT: Release pairs with `fire`'s and `mirror`'s Acquire loads of the cell.
        match c.state.compare_exchange_weak(s, next_word(s, f(flags(s))), Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => s = now,
        }
    }
    mirror(e, armed, c, qindex);
    true
}

/// Owner: retire a live tripwire (entry `e`, cell `c` of queue index `qindex`); it stops
/// firing and readers drop it. Its generation is kept (the next `publish` must use a new one).
pub fn retire(e: &TripEntry, armed: ArmedCount<'_>, c: &TripCell, qindex: u32) {
    let s = c.state.load(Ordering::Relaxed);
    change(e, armed, c, qindex, generation(s), |_| 0);
}

/// Owner: arm (`on`) or disarm the tripwire of entry `e`, cell `c` of queue index `qindex`,
/// of generation `generation_`, mirror it, and fence, so that a re-check of the watched data
/// made afterwards cannot miss a concurrent write. Returns false if it is not live in that
/// generation.
pub fn set_armed(e: &TripEntry, armed: ArmedCount<'_>, c: &TripCell, qindex: u32, generation_: u32, on: bool) -> bool {
    if !change(e, armed, c, qindex, generation_, |fl| if on { fl | ARMED } else { fl & !ARMED }) {
        return false;
    }
    // Dekker with the writers' "store data, fence, load the mirror" (`snoop`).
    fence(Ordering::SeqCst);
    true
}

/// Owner: switch action flags `mask` on or off (event registration and the like).
pub fn set_flags(
    e: &TripEntry,
    armed: ArmedCount<'_>,
    c: &TripCell,
    qindex: u32,
    generation_: u32,
    mask: u32,
    on: bool,
) -> bool {
    change(e, armed, c, qindex, generation_, |fl| if on { fl | mask } else { fl & !mask })
}

/// Whether the tripwire of cell `c` is armed in generation `generation_`.
pub fn is_armed(c: &TripCell, generation_: u32) -> bool {
    let s = c.state.load(Ordering::Acquire);
    generation(s) == generation_ && flags(s) & (LIVE | ARMED) == (LIVE | ARMED)
}

/// The state word of the tripwire of cell `c`, with the `cookie` and `owner` written before
/// it (a reader of an event: `None` unless the state word was the same before and after).
pub fn read_cell(c: &TripCell) -> Option<(u64, u64, u32)> {
    // SYNC POINT: pairs with the Release of the state change that followed the writes of
    // `cookie` and `owner` (`set_flags`); the second read, after the Acquire fence, tells
    // whether they changed in between (a seqlock).
    let s1 = c.state.load(Ordering::Acquire);
    let cookie = c.cookie.load(Ordering::Relaxed);
    let owner = c.owner.load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    let s2 = c.state.load(Ordering::Relaxed);
    (generation(s1) == generation(s2)).then_some((s2, cookie, owner))
}

/// Whether the tripwire of cell `c` is live in generation `generation_`.
pub fn is_live(c: &TripCell, generation_: u32) -> bool {
    let s = c.state.load(Ordering::Acquire);
    generation(s) == generation_ && flags(s) & LIVE != 0
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
