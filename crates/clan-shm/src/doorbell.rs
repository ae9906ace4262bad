//! Doorbells: a request queue tells its service that it has work only when it was idle.
//!
//! The Tripwire paper's DMA interface (§3.4): the application appends requests to a queue in
//! memory shared with the driver and "only need invoke the device driver if the queue empties
//! completely"; the driver services the non-empty queues round-robin until each is empty.
//! Here the service is the NIC's DMA engine and "invoking the driver" is ringing its
//! doorbell: putting the queue on the engine's list of scheduled queues and waking the engine
//! if it sleeps.
//!
//! The queue's [`Schedule`] word says whether the queue is *scheduled* (on the engine's list,
//! or being serviced) or *idle*. Exactly one party moves it from idle to scheduled, and that
//! party puts the queue on the list; so a queue is never on the list twice, and a request is
//! never left in an idle queue.
//!
//! ## Protocol
//!
//! - Producer ([`Schedule::after_publish`]): publish the request (its Release store), then
//!   `fence(SeqCst)`, then load the state; if idle, CAS idle → scheduled; the winner rings.
//! - Service ([`Schedule::on_empty`]), having found the queue empty: store idle, then
//!   `fence(SeqCst)`, then look at the queue again; if a request is there, CAS idle →
//!   scheduled; if that wins, keep servicing (the producer saw "scheduled" or lost the CAS).
//!
//! The two fences make it a Dekker pair: either the producer's load sees idle (and it or the
//! service wins the CAS: one of them schedules), or the service's re-check sees the request.
//! Model-checked in `tests/loom.rs::doorbell_no_lost_request`.
//!
//! The engine's own sleep uses the same shape with a bell counter: [`Bell::ring`] is
//! "count += 1, fence, wake if anyone sleeps", and the engine sleeps with
//! [`crate::trip::wait_until`] on that counter.

use crate::sync::{AtomicU32, Futex, Ordering, fence};

/// Not on the engine's list.
pub const IDLE: u32 = 0;
/// On the engine's list, or being serviced.
pub const SCHEDULED: u32 = 1;

/// The scheduling state of one request queue.
#[derive(Debug, Default)]
pub struct Schedule {
    state: AtomicU32,
}

impl Schedule {
    /// An idle queue.
    pub fn new() -> Schedule {
        Schedule { state: AtomicU32::new(IDLE) }
    }

    /// Producer side, after the Release store that published a request: returns true if the
    /// caller must ring the doorbell (put the queue on the service's list).
    pub fn after_publish(&self) -> bool {
        // Producer's half of the Dekker pair: the publishing store above, fence, state load.
        fence(Ordering::SeqCst);
        if self.state.load(Ordering::Relaxed) != IDLE {
            return false;
        }
        // SYNC POINT: the Acquire of a successful CAS pairs with `on_empty`'s Release store of
        // IDLE (the service is done with the queue's private state before we schedule it).
        self.state.compare_exchange(IDLE, SCHEDULED, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Service side, having found the queue empty: returns true if it must keep servicing
    /// the queue (a request arrived meanwhile and nobody else scheduled it). `is_empty` looks
    /// at the queue again.
    pub fn on_empty(&self, is_empty: impl Fn() -> bool) -> bool {
        // SYNC POINT: pairs with `after_publish`'s Acquire CAS.
        self.state.store(IDLE, Ordering::Release);
        // Service's half of the Dekker pair: state store, fence, re-check of the queue.
        fence(Ordering::SeqCst);
        if is_empty() {
            return false;
        }
        self.state.compare_exchange(IDLE, SCHEDULED, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Schedule the queue if it is idle (for a reason other than a new request, such as
    /// closing it): returns true if the caller must put it on the list.
    pub fn kick(&self) -> bool {
        self.state.compare_exchange(IDLE, SCHEDULED, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Whether the queue is scheduled.
    pub fn is_scheduled(&self) -> bool {
        self.state.load(Ordering::Acquire) == SCHEDULED
    }
}

/// The service's wake-up word: a counter bumped by every doorbell, and a count of sleepers.
#[derive(Debug, Default)]
pub struct Bell {
    /// Bumped by every ring; the service sleeps on it.
    pub count: AtomicU32,
    /// Threads asleep (or about to sleep) on `count`.
    pub sleepers: AtomicU32,
}

impl Bell {
    /// A silent bell.
    pub fn new() -> Bell {
        Bell { count: AtomicU32::new(0), sleepers: AtomicU32::new(0) }
    }

    /// Ring: the caller has just put work on the list (under its lock). Wakes the service
    /// only if it sleeps (one system call, and only then).
    pub fn ring(&self, futex: &impl Futex) {
        // SYNC POINT: pairs with the service's Acquire load of `count` in `wait_until`.
        self.count.fetch_add(1, Ordering::AcqRel);
        // Ringer's half of the sleep protocol of `trip::wait_until`: bump, fence, sleepers.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            futex.wake(&self.count);
        }
    }
}
