//! Who receives a NIC's link traffic: the engine's thread, or the application threads that
//! spin (or sleep) waiting for it and apply it themselves.
//!
//! While any application thread drives the links, the engine *parks* them: it stops
//! listening for their incoming bytes, because woken for them it would take the CPU from the
//! very thread about to apply them. It listens again when the drivers stop (see `clan`'s
//! `engine.rs` and `progress.rs`). This is the handshake, lock-free and model-checked
//! (`tests/loom.rs`): a thread that stops driving while others rely on the engine, or that
//! relies on it itself, learns whether links are parked (and asks the engine to listen); the
//! engine parks only if a driver was there to see it.
//!
//! - engine: `parked = 1`, fence(SeqCst), load `drivers` (park only if non-zero).
//! - a driver ending: `drivers -= 1`, fence(SeqCst), load `parked` (and `sleepers`).
//! - a sleeper (relies on the engine): `sleepers += 1`, fence(SeqCst), load `drivers` and
//!   `parked`.
//!
//! Either the engine sees the driver gone and does not park, or the driver (or sleeper) sees
//! the links parked and asks for them back. A spurious request is allowed; a lost one never.

use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// The drivers, sleepers and parked state of one NIC's links.
#[derive(Debug, Default)]
pub struct Handoff {
    /// Threads driving the links now.
    drivers: AtomicU32,
    /// Drives begun so far: the engine looks whether any began since its last look.
    begun: AtomicU64,
    /// Threads asleep in a wait that relies on the engine.
    sleepers: AtomicU32,
    /// Non-zero while the engine has links parked.
    parked: AtomicU32,
    /// Links parked so far (a statistic).
    parks: AtomicU64,
}

impl Handoff {
    /// A thread begins to drive the links.
    pub fn begin(&self) {
        // Relaxed: an engine that misses this receives as usual, which is always correct.
        self.drivers.fetch_add(1, Ordering::Relaxed);
        self.begun.fetch_add(1, Ordering::Relaxed);
    }

    /// A drive ends; true if the engine must be asked to listen again: links are parked,
    /// and this thread is going to sleep (`sleeping`), or was the last driver while others
    /// sleep.
    pub fn end(&self, sleeping: bool) -> bool {
        let left = self.drivers.fetch_sub(1, Ordering::Relaxed).wrapping_sub(1);
        // SYNC POINT: Dekker with `try_park`'s "parked = 1, fence, load drivers" and with
        // `sleep_begin`'s "sleepers += 1, fence, load drivers".
        fence(Ordering::SeqCst);
        (sleeping || (left == 0 && self.sleepers.load(Ordering::Relaxed) > 0))
            && self.parked.load(Ordering::Relaxed) != 0
    }

    /// A thread that relies on the engine goes to sleep; true if the engine must be asked
    /// to listen again (links parked, no driver left). Pair with [`Handoff::sleep_end`].
    pub fn sleep_begin(&self) -> bool {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        // SYNC POINT: Dekker with `end`'s "drivers -= 1, fence, load sleepers".
        fence(Ordering::SeqCst);
        self.drivers.load(Ordering::Relaxed) == 0 && self.parked.load(Ordering::Relaxed) != 0
    }

    /// The sleeper woke.
    pub fn sleep_end(&self) {
        // Relaxed: a sleeper counted a little longer only costs a spurious request.
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
    }

    /// The engine, about to park a link: true if a thread drives (park it); false if none
    /// does (receive as usual; call [`Handoff::unparked`] if no other link is parked).
    pub fn try_park(&self) -> bool {
        self.parked.store(1, Ordering::Relaxed);
        // SYNC POINT: Dekker with `end`'s "drivers -= 1, fence, load parked".
        fence(Ordering::SeqCst);
        self.drivers.load(Ordering::Relaxed) > 0
    }

    /// The engine parked a link (counted).
    pub fn parked_one(&self) {
        self.parks.fetch_add(1, Ordering::Relaxed);
    }

    /// Links parked so far.
    pub fn parks(&self) -> u64 {
        self.parks.load(Ordering::Relaxed)
    }

    /// The engine listens to all its links again.
    pub fn unparked(&self) {
        // Relaxed: a driver that still sees `parked` only makes a spurious request.
        self.parked.store(0, Ordering::Relaxed);
    }

    /// Whether no thread drives now; and the count of drives begun (to compare with the
    /// value at the engine's last look).
    pub fn idle(&self) -> (bool, u64) {
        (self.drivers.load(Ordering::Relaxed) == 0, self.begun.load(Ordering::Relaxed))
    }
}
