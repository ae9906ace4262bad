//! The event ring: one single-producer ring per producing process, many rings per queue.
//!
//! An event queue ([`crate::eq`]) holds up to [`MAX_RINGS`] rings. Ring 0 belongs to the
//! process that owns the queue; every other process that may post events into the queue
//! (because it imported an aperture whose tripwires report here) is given a ring of its own.
//! Within a process the producers of one ring serialise on a process-local lock, so each ring
//! has exactly one producer *process*. This is what makes the queue robust against a producer
//! killed at any instruction: a ring's only shared writes by its producer are the slot words
//! and then `head`, so a dead producer leaves either a published event or none, never a
//! half-claimed slot that would stall the consumer (as a shared multi-producer ring would).
//!
//! ## Fence protocol
//!
//! Only `SeqCst` *fences* carry the Dekker arguments below (never `SeqCst` accesses), which is
//! also what loom models faithfully.
//!
//! Producer (`Producer::post`):
//! 1. write the slot words (Relaxed);
//! 2. `head.store(h + 1, Release)` — SYNC POINT: pairs with the consumer's `head.load(Acquire)`;
//! 3. `summary.fetch_or(bit, AcqRel)` (always);
//! 4. `fence(SeqCst)`;
//! 5. `armed.load`; if non-zero, `armed.swap(0)` and wake the sleeper(s).
//!
//! Consumer, when a ring looks empty (`Consumer::take`): `summary.fetch_and(!bit, AcqRel)`,
//! then re-load `head`. The two read-modify-writes of `summary` are totally ordered: if the
//! producer's `fetch_or` comes last the bit stays set and the ring is visited again; if the
//! consumer's `fetch_and` comes last it reads from the producer's release, so the re-load of
//! `head` sees the event.
//!
//! Consumer, before sleeping (`arm`):
//! 1. `armed.fetch_or(mode)`; 2. `fence(SeqCst)`; 3. load `summary`.
//!
//! By the two fences, either the producer's step 5 sees `armed` (and wakes), or the
//! consumer's step 3 sees the bit of step 3 (and does not sleep). `tests/loom.rs` checks it.
//!
//! Everything the consumer reads from a ring is untrusted: a `head` that claims more than
//! `cap` events is treated as corruption (the ring is skipped to the claimed head and the loss
//! is reported), and event words are validated by the caller.

use crate::sync::{AtomicU32, AtomicU64, Futex, Ordering, fence};

/// Most rings (producer processes) per event queue.
pub const MAX_RINGS: usize = 256;
/// Words of the summary bitmap.
pub const SUMMARY_WORDS: usize = MAX_RINGS / 64;

/// `armed` bit: a thread sleeps on the futex word `wake`.
pub const ARM_FUTEX: u32 = 1;
/// `armed` bit: the queue's eventfd must be signalled.
pub const ARM_FD: u32 = 2;

/// Per-ring control words, each party's on its own cache line.
#[repr(C)]
#[derive(Debug)]
pub struct RingHeader {
    /// Producer: index of the next slot to write (monotonic, wraps at 2^64).
    pub head: AtomicU64,
    /// Producer: events dropped because the ring was full.
    pub overflow: AtomicU64,
    _p0: [AtomicU64; 6],
    /// Consumer: index of the next slot to read.
    pub tail: AtomicU64,
    _p1: [AtomicU64; 7],
}

impl RingHeader {
    /// A zeroed header (for models and tests; shared memory starts zeroed).
    pub fn new() -> RingHeader {
        RingHeader {
            head: AtomicU64::new(0),
            overflow: AtomicU64::new(0),
            _p0: std::array::from_fn(|_| AtomicU64::new(0)),
            tail: AtomicU64::new(0),
            _p1: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Default for RingHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// One event: four words, meaning defined by the NIC (see `clan::event`).
#[repr(C)]
#[derive(Debug)]
pub struct EventSlot {
    /// The event words.
    pub w: [AtomicU64; 4],
}

impl EventSlot {
    /// A zeroed slot.
    pub fn new() -> EventSlot {
        EventSlot { w: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl Default for EventSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// Queue-wide words shared by the consumer and all producers.
#[repr(C)]
#[derive(Debug)]
pub struct QueueWords {
    /// Consumer sets [`ARM_FUTEX`]/[`ARM_FD`] before sleeping; a producer that sees it
    /// non-zero swaps it to 0 and wakes.
    pub armed: AtomicU32,
    /// Futex word: producers increment it before `futex_wake`.
    pub wake: AtomicU32,
    _p0: [AtomicU32; 14],
    /// One bit per ring: "this ring may hold events".
    pub summary: [AtomicU64; SUMMARY_WORDS],
    _p1: [AtomicU64; 8 - SUMMARY_WORDS],
}

impl QueueWords {
    /// Zeroed words.
    pub fn new() -> QueueWords {
        QueueWords {
            armed: AtomicU32::new(0),
            wake: AtomicU32::new(0),
            _p0: std::array::from_fn(|_| AtomicU32::new(0)),
            summary: std::array::from_fn(|_| AtomicU64::new(0)),
            _p1: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Default for QueueWords {
    fn default() -> Self {
        Self::new()
    }
}

/// The rings of one queue as seen by one process.
#[derive(Clone, Copy)]
pub struct Rings<'a> {
    /// Queue-wide words.
    pub words: &'a QueueWords,
    /// Ring headers, indexed by ring.
    pub headers: &'a [&'a RingHeader],
    /// Slots of each ring (each of the same power-of-two length).
    pub slots: &'a [&'a [EventSlot]],
}

impl std::fmt::Debug for Rings<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rings").field("rings", &self.headers.len()).finish_non_exhaustive()
    }
}

/// What a post did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    /// False if the ring was full: the event was dropped and counted in `overflow`.
    pub stored: bool,
    /// The consumer asked for its eventfd to be signalled: the caller must do it.
    pub signal_fd: bool,
}

/// The producer side of one ring. Not `Sync`: the owner serialises posts (a process-local
/// lock) and keeps the only trusted copy of `head`.
#[derive(Debug)]
pub struct Producer {
    ring: usize,
    head: u64,
}

impl Producer {
    /// Producer for ring `ring`, whose header was reset to zero by the queue's owner.
    pub fn new(ring: usize) -> Producer {
        Producer { ring, head: 0 }
    }

    /// Producer for ring `ring` continuing at `head` (the owner's own ring after a restart).
    pub fn resume(ring: usize, head: u64) -> Producer {
        Producer { ring, head }
    }

    /// Ring index.
    pub fn ring(&self) -> usize {
        self.ring
    }

    /// Post one event. Never blocks. `futex` wakes a consumer sleeping on the futex word.
    pub fn post(&mut self, rings: &Rings<'_>, event: [u64; 4], futex: &impl Futex) -> Posted {
        let (Some(hdr), Some(slots)) = (rings.headers.get(self.ring), rings.slots.get(self.ring)) else {
            return Posted { stored: false, signal_fd: false };
        };
        let cap = slots.len() as u64;
        // SYNC POINT: pairs with the consumer's `tail.store(Release)` after it read a slot, so
        // we never overwrite a slot it is still reading. The value is untrusted: a tail
        // "ahead" of our head or more than `cap` behind is treated as a full ring.
        let tail = hdr.tail.load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        let stored = cap != 0 && used < cap;
        if stored {
            let slot = &slots[slot_of(self.head, cap)];
            for (w, v) in slot.w.iter().zip(event) {
                w.store(v, Ordering::Relaxed);
            }
            self.head = self.head.wrapping_add(1);
            // SYNC POINT: publishes the slot words; pairs with `Consumer::take`'s
            // `head.load(Acquire)`.
            hdr.head.store(self.head, Ordering::Release);
        } else {
            hdr.overflow.fetch_add(1, Ordering::Relaxed);
        }
        let word = &rings.words.summary[self.ring / 64];
        // SYNC POINT: the release half pairs with the consumer's `fetch_and` in `visit` (the
        // RMW chain orders our `head` store before its re-load of `head`).
        word.fetch_or(1u64 << (self.ring % 64), Ordering::AcqRel);
        // Dekker with `arm`'s "armed.fetch_or, fence, load summary".
        fence(Ordering::SeqCst);
        let mut signal_fd = false;
        if rings.words.armed.load(Ordering::Relaxed) != 0 {
            let armed = rings.words.armed.swap(0, Ordering::AcqRel);
            if armed & ARM_FUTEX != 0 {
                // SYNC POINT: the increment is what a futex sleeper compares against; pairs
                // with the `wake.load(Acquire)` the consumer made before arming.
                rings.words.wake.fetch_add(1, Ordering::Release);
                futex.wake(&rings.words.wake);
            }
            signal_fd = armed & ARM_FD != 0;
        }
        Posted { stored, signal_fd }
    }
}

/// What the consumer took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// An event's words, from `ring`.
    Event {
        /// Ring it came from.
        ring: usize,
        /// Its words (untrusted unless `ring` is the consumer's own).
        words: [u64; 4],
    },
    /// The producer of `ring` dropped `lost` events because the ring was full.
    Overflow {
        /// Ring that overflowed.
        ring: usize,
        /// How many events were dropped since the last report.
        lost: u64,
    },
    /// The ring's `head` was impossible (more than the ring's capacity ahead): the consumer
    /// skipped to it and lost up to `skipped` events.
    Corrupt {
        /// Ring concerned.
        ring: usize,
        /// Events skipped.
        skipped: u64,
    },
}

/// The consumer side of a queue. One per queue; callers serialise `take`.
#[derive(Debug)]
pub struct Consumer {
    tails: Vec<u64>,
    overflow_seen: Vec<u64>,
    cursor: usize,
}

impl Consumer {
    /// A consumer for `nrings` rings, all starting empty.
    pub fn new(nrings: usize) -> Consumer {
        Consumer { tails: vec![0; nrings], overflow_seen: vec![0; nrings], cursor: 0 }
    }

    /// Forget the state of ring `ring` after its owner reset it for a new producer.
    pub fn reset_ring(&mut self, ring: usize) {
        if let Some(t) = self.tails.get_mut(ring) {
            *t = 0;
            self.overflow_seen[ring] = 0;
        }
    }

    /// Our trusted tail of `ring`.
    pub fn tail(&self, ring: usize) -> u64 {
        self.tails.get(ring).copied().unwrap_or(0)
    }

    /// Take one event, O(1) in the number of events: scans at most [`SUMMARY_WORDS`] words
    /// of the summary bitmap, starting after the ring served last (round robin).
    pub fn take(&mut self, rings: &Rings<'_>) -> Option<Taken> {
        let n = self.tails.len().min(rings.headers.len()).min(rings.slots.len());
        if n == 0 {
            return None;
        }
        if n == 1 {
            // One ring (a private queue, a port): no scan, no division.
            if rings.words.summary[0].load(Ordering::Acquire) & 1 == 0 {
                return None;
            }
            return self.visit(rings, 0);
        }
        let nwords = n.div_ceil(64);
        let first = self.cursor % n;
        // Visit the rings in the order first, first+1, ..., n-1, 0, ..., first-1, one summary
        // word at a time: the first word is visited twice (high part, then low part).
        for pass in 0..=nwords {
            let w_idx = (first / 64 + pass) % nwords;
            let mut bits = rings.words.summary[w_idx].load(Ordering::Acquire);
            if w_idx == nwords - 1 && n % 64 != 0 {
                bits &= (1u64 << (n % 64)) - 1;
            }
            let split = first % 64;
            if pass == 0 {
                bits &= !0u64 << split;
            } else if pass == nwords {
                bits &= (1u64 << split).wrapping_sub(1);
            }
            while bits != 0 {
                let r = w_idx * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(t) = self.visit(rings, r) {
                    self.cursor = r + 1;
                    return Some(t);
                }
            }
        }
        None
    }

    fn visit(&mut self, rings: &Rings<'_>, r: usize) -> Option<Taken> {
        if let Some(t) = self.take_from(rings, r) {
            return Some(t);
        }
        // The ring looks empty: clear its bit, then look again (RMW chain with `post`).
        let word = &rings.words.summary[r / 64];
        let bit = 1u64 << (r % 64);
        // SYNC POINT: acquire half pairs with the producer's `fetch_or(AcqRel)`.
        word.fetch_and(!bit, Ordering::AcqRel);
        let t = self.take_from(rings, r)?;
        word.fetch_or(bit, Ordering::AcqRel);
        Some(t)
    }

    /// Clear the summary bits of rings found empty (stale "maybe" bits left after their last
    /// event was taken), so that [`maybe_nonempty`] becomes exact. Same protocol as `visit`:
    /// clear, then re-load `head`, and set the bit again if an event arrived meanwhile.
    pub fn settle(&mut self, rings: &Rings<'_>) {
        let n = self.tails.len().min(rings.headers.len());
        for (w_idx, word) in rings.words.summary.iter().enumerate() {
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let r = w_idx * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if r >= n {
                    continue;
                }
                let empty = |c: &Self| {
                    rings.headers[r].head.load(Ordering::Acquire) == c.tails[r]
                        && rings.headers[r].overflow.load(Ordering::Relaxed) == c.overflow_seen[r]
                };
                if empty(self) {
                    word.fetch_and(!(1u64 << (r % 64)), Ordering::AcqRel);
                    if !empty(self) {
                        word.fetch_or(1u64 << (r % 64), Ordering::AcqRel);
                    }
                }
            }
        }
    }

    fn take_from(&mut self, rings: &Rings<'_>, r: usize) -> Option<Taken> {
        let hdr = rings.headers[r];
        let slots = rings.slots[r];
        let cap = slots.len() as u64;
        let ov = hdr.overflow.load(Ordering::Relaxed);
        if ov != self.overflow_seen[r] {
            let lost = ov.wrapping_sub(self.overflow_seen[r]);
            self.overflow_seen[r] = ov;
            return Some(Taken::Overflow { ring: r, lost });
        }
        // SYNC POINT: pairs with `Producer::post`'s `head.store(Release)`: the slot words
        // written before it are visible below.
        let head = hdr.head.load(Ordering::Acquire);
        let tail = self.tails[r];
        let avail = head.wrapping_sub(tail);
        if avail == 0 {
            return None;
        }
        if avail > cap {
            self.tails[r] = head;
            hdr.tail.store(head, Ordering::Release);
            return Some(Taken::Corrupt { ring: r, skipped: avail });
        }
        let slot = &slots[slot_of(tail, cap)];
        let words = std::array::from_fn(|i| slot.w[i].load(Ordering::Relaxed));
        self.tails[r] = tail.wrapping_add(1);
        // SYNC POINT: pairs with the producer's `tail.load(Acquire)`: the slot is free only
        // after we have read it.
        hdr.tail.store(self.tails[r], Ordering::Release);
        Some(Taken::Event { ring: r, words })
    }
}

/// Whether any ring may hold events, by the summary bits (a set bit may be stale: "maybe").
pub fn maybe_nonempty(rings: &Rings<'_>) -> bool {
    rings.words.summary.iter().any(|w| w.load(Ordering::Acquire) != 0)
}

/// Announce that the consumer is about to sleep (`mode` is [`ARM_FUTEX`] and/or [`ARM_FD`]).
/// Returns `true` if the queue is empty and sleeping is safe: every event posted from now on
/// wakes the sleeper. Returns `false` if events may be pending.
pub fn arm(rings: &Rings<'_>, mode: u32) -> bool {
    rings.words.armed.fetch_or(mode, Ordering::AcqRel);
    // Dekker with `Producer::post`'s "summary.fetch_or, fence, load armed".
    fence(Ordering::SeqCst);
    !maybe_nonempty(rings)
}

/// Whether the consumer's last [`arm`] for `mode` still stands and the rings are empty, so
/// that it may sleep again without arming (nor resetting its eventfd: a producer that
/// signals clears `armed` first). False when a producer has woken it since, or events may be
/// pending: then [`arm`] again.
///
/// The same Dekker as [`arm`]'s, with the `armed` bit already set: a producer whose post
/// comes after our look at `summary` loads `armed` after its fence, and sees the bit (or a
/// producer before it cleared it, and woke us).
pub fn still_armed(rings: &Rings<'_>, mode: u32) -> bool {
    // (Acquire: pairs with nothing in particular; the fence below orders the look at summary)
    if rings.words.armed.load(Ordering::Acquire) & mode != mode {
        return false;
    }
    // Dekker with `Producer::post`'s "summary.fetch_or, fence, load armed".
    fence(Ordering::SeqCst);
    !maybe_nonempty(rings)
}

/// Block until an event may be present, `timeout` at most. Does not need the consumer, so
/// other threads can keep taking events while one sleeps.
pub fn sleep(rings: &Rings<'_>, futex: &impl Futex, timeout: Option<std::time::Duration>) {
    // SYNC POINT: read the wake word before arming, so that a producer's increment after our
    // arming makes `futex.wait` return at once (pairs with its `fetch_add(Release)`).
    let seen = rings.words.wake.load(Ordering::Acquire);
    if arm(rings, ARM_FUTEX) {
        futex.wait(&rings.words.wake, seen, timeout);
    }
}

/// The slot of sequence number `n` in a ring of `cap` slots (a power of two for every ring
/// made here: a mask, not a division; any other length still gets a valid index).
#[inline]
fn slot_of(n: u64, cap: u64) -> usize {
    if cap.is_power_of_two() { (n & (cap - 1)) as usize } else { (n % cap.max(1)) as usize }
}
