//! The data path: move bytes through the NIC while snooping their addresses.
//!
//! This is where the software NIC does what the CLAN hardware did with its CAM: every write
//! (or read) that goes through the NIC is matched against the tripwires of its target, and
//! each tripwire it touches is fired *after the watched bytes are visible and before the rest
//! of the transfer is done* — so a receiver watching an early word of a message is woken
//! while the body is still arriving (Tripwire paper §4.3).
//!
//! ## Algorithm of [`transfer`]
//!
//! 1. `e1 = epoch.load(Acquire)`.
//! 2. If the index says nothing near `[off, off+len)` is watched: move everything.
//!    Otherwise collect the candidate tripwires, sort them by where their overlap with the
//!    transfer ends, and for each one move the bytes up to that point, `fence(SeqCst)`, and
//!    fire it if it is armed; then move the rest.
//! 3. `fence(SeqCst)`; `e2 = epoch.load`. If the index changed during the transfer (a
//!    tripwire was armed, or an entry was unlinked under our walk), collect again and fire
//!    what was not fired yet; repeat while it keeps changing, at most [`MAX_REDO`] times.
//!
//! The fence of step 3 is the writer's half of the arm/fire protocol (see [`crate::trip`]):
//! a tripwire armed concurrently with a transfer either fires or its owner sees the data.
//!
//! ## Quick forms
//!
//! Nearly every transfer finds nothing watched near its data (a ring slot, a stream's bytes:
//! their tripwires watch the words that publish them). [`transfer_quick`],
//! [`transfer_then_store_quick`] and [`commit_quick`] do the same steps for that case with
//! no scratch list and no sink (nothing to collect, nothing to fire), and hand back what
//! they cannot settle: before moving anything when the data is watched, after the fence
//! when the index changed or an armed tripwire watches the word ([`finish_transfer`],
//! [`finish_store`]). Each is on the path of every message before its first store, so what
//! it leaves out is latency (a ping-pong's one way went from ~130 to ~110 ns). The word a
//! message is published by is nearly always watched, by its reader's tripwire, disarmed
//! while the reader polls: [`CamView::armed_in`] reads the index's count of armed mirrors
//! (nothing armed in the index: done, one load), else the mirrors of the entries over it,
//! and settles that case too, with no scratch list and no firing attempt. When the reader
//! sleeps, the same walk hands over the entries it found armed ([`Quick::Fire`]), and
//! [`finish_store_armed`] fires them without walking again (a second walk cost ~280
//! instructions of every write that wakes a reader). The loom models run both forms
//! (`write_then_store_vs_arm` fails if the walk misses an arming).

use crate::cam::{Armed, CamView, Candidate};
use crate::sync::{Futex, Ordering, fence};
use crate::trip::{self, Access, Fired, TripTable};

/// Bound on re-lookups while the index keeps changing under a transfer.
pub const MAX_REDO: u32 = 16;

/// The watched side of a transfer: an index (with its entries) and the table of the event
/// queue its tripwires report to.
#[derive(Debug, Clone, Copy)]
pub struct Watch<'a> {
    /// The index.
    pub cam: &'a CamView<'a>,
    /// The queue's bitmap and tripset words ([`TripTable::EMPTY`] for a process that does not
    /// fire the tripwires itself).
    pub table: &'a TripTable<'a>,
    /// Tag of the index (entries from elsewhere are ignored).
    pub tag: u64,
}

/// Where firings go.
pub trait Sink {
    /// Futex implementation.
    type F: Futex;
    /// The futex.
    fn futex(&self) -> &Self::F;
    /// Post a tripwire event for queue index `qindex` of generation `generation`.
    fn post(&self, qindex: u32, generation: u32, access: Access);
    /// Fire candidate `c` of `watch` for `access` (its watched bytes are in place and the
    /// caller has fenced); returns whether it fired. By default the entry is fired here
    /// ([`trip::fire_entry`]) and its event posted with [`Sink::post`]; a process that does not own
    /// the index instead tells the owner, which fires it (`clan`'s claims).
    fn fire(&self, watch: &Watch<'_>, c: &Candidate, access: Access) -> bool {
        fire_here(self, watch, c, access)
    }
}

/// The default [`Sink::fire`]: fire the entry here and post its event with `sink`.
pub fn fire_here<S: Sink + ?Sized>(sink: &S, watch: &Watch<'_>, c: &Candidate, access: Access) -> bool {
    let Some(e) = watch.cam.entries.get(c.index as usize) else {
        return false;
    };
    match trip::fire_entry(e, watch.cam.armed_count(), c.generation, access, watch.table, sink.futex()) {
        Fired::No => false,
        Fired::Yes { .. } => true,
        Fired::PostEvent { qindex, .. } => {
            sink.post(qindex, c.generation, access);
            true
        }
    }
}

/// Fire one candidate; returns 1 if it fired.
fn fire_one(watch: &Watch<'_>, sink: &impl Sink, c: &Candidate, access: Access) -> u32 {
    u32::from(sink.fire(watch, c, access))
}

/// Move `len` bytes at watched offset `off` with `mover(offset, len)`, firing the tripwires
/// of `watch` for `access` as described in the module documentation. Returns the number of
/// tripwires fired. `scratch` is reused between calls to avoid allocating.
pub fn transfer<E>(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    scratch: &mut Vec<Candidate>,
    mover: impl FnMut(u64, u64) -> Result<(), E>,
) -> Result<u32, E> {
    transfer_piece(access, watch, sink, off, len, off.saturating_add(len), scratch, mover)
}

/// Where a candidate's watched part of a write ending at `write_end` is complete.
#[inline]
fn stop(c: &Candidate, write_end: u64) -> u64 {
    c.end.min(write_end)
}

/// [`transfer`] for one piece `[off, off+len)` of a write that ends at `write_end` (a burst
/// arriving in several pieces): a tripwire fires in the piece where its watched part of the
/// *whole* write completes — never before all its watched bytes of the write are in place.
#[allow(clippy::too_many_arguments)]
pub fn transfer_piece<E>(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    write_end: u64,
    scratch: &mut Vec<Candidate>,
    mut mover: impl FnMut(u64, u64) -> Result<(), E>,
) -> Result<u32, E> {
    let end = off.saturating_add(len);
    let write_end = write_end.max(end);
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    let mut fired = move_firing(access, watch, sink, off, len, write_end, scratch, &mut mover)?;
    fired += recheck(access, watch, sink, off, end, write_end, e1, scratch);
    Ok(fired)
}

/// Step 2 of [`transfer`]: move `[off, off+len)` of a write ending at `write_end` with `mover`,
/// stopping where each watched tripwire's part of the write completes to fire it. Leaves
/// the candidates it looked at in `scratch` (the re-lookup fires only what is new).
#[inline]
#[allow(clippy::too_many_arguments)]
fn move_firing<E>(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    write_end: u64,
    scratch: &mut Vec<Candidate>,
    mover: &mut impl FnMut(u64, u64) -> Result<(), E>,
) -> Result<u32, E> {
    let end = off.saturating_add(len);
    let mut fired = 0;
    scratch.clear();
    if len == 0 {
        return Ok(0);
    }
    if !watch.cam.may_match(off, end) {
        mover(off, len)?;
        return Ok(0);
    }
    watch.cam.collect(watch.tag, off, end, access, scratch);
    scratch.sort_unstable_by_key(|c| stop(c, write_end));
    let mut cursor = off;
    for c in scratch.iter() {
        let upto = stop(c, write_end);
        if upto > end {
            break; // completes in a later piece (sorted: so do the rest)
        }
        if upto > cursor {
            mover(cursor, upto - cursor)?;
            cursor = upto;
        }
        // The watched bytes are in place: make them visible before the firing is.
        fence(Ordering::SeqCst);
        fired += fire_one(watch, sink, c, access);
    }
    if cursor < end {
        mover(cursor, end - cursor)?;
    }
    Ok(fired)
}

/// Fire every candidate of `watch` over `[off, end)` whose watched part of a write ending at
/// `write_end` is complete (the data is in place and the caller has fenced).
#[inline]
fn fire_complete(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    end: u64,
    write_end: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    scratch.clear();
    let mut fired = 0;
    if watch.cam.may_match(off, end) {
        watch.cam.collect(watch.tag, off, end, access, scratch);
        for c in scratch.iter() {
            if stop(c, write_end) <= end {
                fired += fire_one(watch, sink, c, access);
            }
        }
    }
    fired
}

/// The first point after `off` (at most `end`) where a tripwire's watched part of a write
/// ending at `write_end` completes: a receiver that moves bytes in pieces it does not
/// control (straight from a socket) stops its pieces there, so that [`commit_piece`] fires
/// each tripwire exactly when its watched bytes are in place.
pub fn next_stop(
    access: Access,
    watch: &Watch<'_>,
    off: u64,
    end: u64,
    write_end: u64,
    scratch: &mut Vec<Candidate>,
) -> u64 {
    if off >= end || !watch.cam.may_match(off, end) {
        return end;
    }
    scratch.clear();
    watch.cam.collect(watch.tag, off, end, access, scratch);
    scratch.iter().map(|c| stop(c, write_end.max(end))).filter(|&s| s > off).min().unwrap_or(end).min(end)
}

/// Step 3 of [`transfer`]: after the data is in place, fire what was armed meanwhile.
#[allow(clippy::too_many_arguments)]
fn recheck(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    end: u64,
    write_end: u64,
    seen_epoch: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    // Writer's half of the arm/fire Dekker: data stores above, fence, then the epoch load.
    fence(Ordering::SeqCst);
    redo(access, watch, sink, off, end, write_end, seen_epoch, scratch)
}

/// While the index keeps changing (bounded), collect again and fire what is new. The caller
/// has fenced since its data stores.
#[inline]
#[allow(clippy::too_many_arguments)]
fn redo(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    end: u64,
    write_end: u64,
    mut seen_epoch: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    let mut fired = 0;
    let mut epoch = watch.cam.header.epoch.load(Ordering::Acquire);
    let mut rounds = 0;
    while epoch != seen_epoch && rounds < MAX_REDO && off < end {
        rounds += 1;
        let done = scratch.len();
        watch.cam.collect(watch.tag, off, end, access, scratch);
        for c in &scratch[done..] {
            if stop(c, write_end) <= end {
                fired += fire_one(watch, sink, c, access);
            }
        }
        seen_epoch = epoch;
        fence(Ordering::SeqCst);
        epoch = watch.cam.header.epoch.load(Ordering::Acquire);
    }
    fired
}

/// Write a message, then its flag, with one fence: [`transfer`] of `[off, off+len)` by
/// `mover` (its tripwires fire as their watched bytes land), then `store()` — the atomic
/// store of the word at `[word_off, word_off+word_len)` that tells the receiver — then one
/// `fence(SeqCst)`, then the flag's tripwires fire, then what was armed meanwhile on either
/// range fires. Equivalent to `transfer` followed by [`commit`] of the flag, less one fence
/// and one look at the index: the protocols' "message, then flag" on every send.
///
/// The Dekker argument is unchanged: every store of the transfer (data and flag) comes
/// before the fence, every look at the index and at the armed states after it.
#[inline]
#[allow(clippy::too_many_arguments)]
pub fn transfer_then_store<E>(
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    word_off: u64,
    word_len: u64,
    scratch: &mut Vec<Candidate>,
    mut mover: impl FnMut(u64, u64) -> Result<(), E>,
    store: impl FnOnce(),
) -> Result<u32, E> {
    let access = Access::Write;
    let end = off.saturating_add(len);
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    let mut fired = move_firing(access, watch, sink, off, len, end, scratch, &mut mover)?;
    store();
    // Writer's half of the arm/fire Dekker, for the data and the flag at once.
    fence(Ordering::SeqCst);
    // Tripwires armed during the data transfer.
    fired += redo(access, watch, sink, off, end, end, e1, scratch);
    // The flag's tripwires, then any armed meanwhile.
    let wend = word_off.saturating_add(word_len);
    fired += fire_complete(access, watch, sink, word_off, wend, wend, scratch);
    fired += redo(access, watch, sink, word_off, wend, wend, e1, scratch);
    Ok(fired)
}

/// [`transfer`] without a scratch list, for the common case where nothing near the data is
/// watched: `e1`, the bits, the move, the fence, `e2`. [`Quick::Watched`]: nothing was
/// moved (do the whole `transfer`); [`Quick::Finish`]: moved and fenced, but the index
/// changed meanwhile (finish with [`finish_transfer`]). The Dekker argument is `transfer`'s.
#[inline]
pub fn transfer_quick<E>(
    watch: &Watch<'_>,
    off: u64,
    len: u64,
    mover: &mut impl FnMut(u64, u64) -> Result<(), E>,
) -> Result<Quick, E> {
    if len == 0 {
        return Ok(Quick::Done);
    }
    // SYNC POINT: pairs with the owner's SeqCst epoch bump after each change of the index.
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    if watch.cam.may_match(off, off.saturating_add(len)) {
        return Ok(Quick::Watched);
    }
    mover(off, len)?;
    // Writer's half of the arm/fire Dekker (its partner: the owner's fence between arming
    // and its look at the data, `crate::trip`).
    fence(Ordering::SeqCst);
    if watch.cam.header.epoch.load(Ordering::Acquire) == e1 {
        return Ok(Quick::Done);
    }
    Ok(Quick::Finish(e1))
}

/// The rest of [`transfer`] after [`transfer_quick`] said [`Quick::Finish`]: what was armed
/// over `[off, off+len)` meanwhile. Returns the number fired.
pub fn finish_transfer(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    seen_epoch: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    let end = off.saturating_add(len);
    scratch.clear();
    redo(access, watch, sink, off, end, end, seen_epoch, scratch)
}

/// [`commit`] without a scratch list: `e1`, the fence, then `true` if no armed tripwire
/// watches `[off, off+len)` for `access` and the index did not change (nothing to fire:
/// done); `false`: do the whole `commit` (which fences again).
#[inline]
pub fn commit_quick(access: Access, watch: &Watch<'_>, off: u64, len: u64) -> bool {
    // SYNC POINT: pairs with the owner's SeqCst epoch bump after each change of the index.
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    // The caller's half of the arm/fire Dekker: its data is in place before this fence,
    // every look at the index after it.
    fence(Ordering::SeqCst);
    watch.cam.header.epoch.load(Ordering::Acquire) == e1
        && !watch.cam.armed_over(watch.tag, off, off.saturating_add(len), access)
}

/// How [`transfer_then_store_quick`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quick {
    /// Something near the data is watched: nothing was moved or stored (do the whole
    /// [`transfer_then_store`]).
    Watched,
    /// Moved, stored and fenced, and nothing to fire.
    Done,
    /// Moved, stored and fenced, but the index changed meanwhile or an armed tripwire (or an
    /// index caught changing) watches the word:
    /// finish with [`finish_store`], given this epoch (the one seen before the move).
    Finish(u64),
    /// Moved, stored and fenced, the index unchanged, and the word watched by the armed
    /// tripwires `armed` ([`transfer_then_store_quick`] only): finish with
    /// [`finish_store_armed`], given the epoch seen before the move.
    Fire {
        /// The epoch seen before the move.
        seen: u64,
        /// What the walk after the fence found armed over the word.
        armed: Armed,
    },
}

/// [`transfer_then_store`] without a scratch list, for the common case where nothing near
/// the data is watched (a ring slot or a stream's bytes, whose tripwires watch the words
/// that publish them): `e1`, the index's bits over the data, the move, `store()`, the
/// fence, `e2` and the armed states over the word ([`CamView::armed_over`]), and nothing
/// else. Whatever it cannot settle it
/// hands back: [`Quick::Watched`] before touching anything, [`Quick::Finish`] after the
/// fence (then [`finish_store`] does what `transfer_then_store` does from there). The
/// Dekker argument is `transfer_then_store`'s: every store before the fence, every look at
/// the index that decides what fires after it (the bits over the data, looked at before,
/// decide only how the move is split; a tripwire linked over them since bumps the epoch).
#[inline]
pub fn transfer_then_store_quick<E>(
    watch: &Watch<'_>,
    off: u64,
    len: u64,
    word_off: u64,
    word_len: u64,
    mover: &mut impl FnMut(u64, u64) -> Result<(), E>,
    store: &impl Fn(),
) -> Result<Quick, E> {
    let end = off.saturating_add(len);
    // SYNC POINT: pairs with the owner's SeqCst epoch bump after each change of the index
    // (`CamOwner`): an index changed after this load shows a new epoch below.
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    if len > 0 {
        if watch.cam.may_match(off, end) {
            return Ok(Quick::Watched);
        }
        mover(off, len)?;
    }
    store();
    // Writer's half of the arm/fire Dekker, for the data and the word at once (its partner:
    // the fence between an owner's arming and its look at the data, `crate::trip`).
    fence(Ordering::SeqCst);
    let e2 = watch.cam.header.epoch.load(Ordering::Acquire);
    if e2 != e1 {
        return Ok(Quick::Finish(e1));
    }
    // (the word is typically watched by a disarmed tripwire: its reader's, armed only while
    // it sleeps; the mirrors say so without a scratch list or a firing attempt, and when
    // one is armed the walk that saw it hands it over, so that firing walks no more; with
    // nothing armed in the whole index, its count says so in one load and no list is built)
    if watch.cam.none_armed() {
        return Ok(Quick::Done);
    }
    match watch.cam.armed_in(watch.tag, word_off, word_off.saturating_add(word_len), Access::Write) {
        Some(armed) if armed.is_empty() => Ok(Quick::Done),
        Some(armed) => Ok(Quick::Fire { seen: e1, armed }),
        None => Ok(Quick::Finish(e1)),
    }
}

/// [`finish_store`] after [`transfer_then_store_quick`] said [`Quick::Fire`]: the same,
/// with the word's tripwires the ones its walk found armed (`armed`) instead of a second
/// walk to collect them. Returns the number fired.
#[allow(clippy::too_many_arguments)]
pub fn finish_store_armed(
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    word_off: u64,
    word_len: u64,
    seen_epoch: u64,
    armed: &Armed,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    let access = Access::Write;
    let end = off.saturating_add(len);
    scratch.clear();
    let mut fired = redo(access, watch, sink, off, end, end, seen_epoch, scratch);
    let wend = word_off.saturating_add(word_len);
    // As `fire_complete` does with what it collects: fire each, and keep them in `scratch`,
    // so that the look below at what was armed meanwhile fires no entry twice.
    scratch.clear();
    for c in armed.as_slice() {
        scratch.push(*c);
        if stop(c, wend) <= wend {
            fired += fire_one(watch, sink, c, access);
        }
    }
    fired += redo(access, watch, sink, word_off, wend, wend, seen_epoch, scratch);
    fired
}

/// The rest of [`transfer_then_store`] after [`transfer_then_store_quick`] said
/// [`Quick::Finish`]: what was armed over the data meanwhile, the word's tripwires, then
/// what was armed over the word meanwhile. Returns the number fired.
#[allow(clippy::too_many_arguments)]
pub fn finish_store(
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    word_off: u64,
    word_len: u64,
    seen_epoch: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    let access = Access::Write;
    let end = off.saturating_add(len);
    scratch.clear();
    let mut fired = redo(access, watch, sink, off, end, end, seen_epoch, scratch);
    let wend = word_off.saturating_add(word_len);
    fired += fire_complete(access, watch, sink, word_off, wend, wend, scratch);
    fired += redo(access, watch, sink, word_off, wend, wend, seen_epoch, scratch);
    fired
}

/// Fire every armed tripwire of `watch` overlapping `[off, off+len)` for data that is
/// already in place (a word stored atomically, raw stores being committed, or an outgoing
/// transfer that has completed). One fence in the common case: the epoch is read first, then
/// `fence(SeqCst)` orders the caller's stores before the look at the index, then the
/// candidates fire, and a changed epoch makes it look again.
pub fn commit(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    commit_piece(access, watch, sink, off, len, off.saturating_add(len), scratch)
}

/// [`commit`] for one piece of a write ending at `write_end`: fires the tripwires whose
/// watched part of the whole write completes within `[off, off+len)`.
pub fn commit_piece(
    access: Access,
    watch: &Watch<'_>,
    sink: &impl Sink,
    off: u64,
    len: u64,
    write_end: u64,
    scratch: &mut Vec<Candidate>,
) -> u32 {
    let end = off.saturating_add(len);
    let write_end = write_end.max(end);
    let e1 = watch.cam.header.epoch.load(Ordering::Acquire);
    fence(Ordering::SeqCst);
    let fired = fire_complete(access, watch, sink, off, end, write_end, scratch);
    fired + redo(access, watch, sink, off, end, write_end, e1, scratch)
}
