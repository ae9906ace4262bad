//! Telling waiters only when there are some.
//!
//! A thread that waits for a condition under a lock (check, then sleep on a condition
//! variable) is told by whoever changes the condition: take the lock, notify. When most
//! changes have nobody waiting for them (a connection that ends long after its `connect`
//! returned), taking the lock and notifying for each costs the changer a system call and
//! wakes unrelated sleepers of the same condition variable. [`Waiters`] counts the threads
//! about to wait, so that a changer tells only when one may be waiting.
//!
//! The protocol is a Dekker pair on `SeqCst` fences. The waiter counts itself in
//! ([`Waiters::enter`]: count, fence) *before* it first looks at the condition; the changer
//! stores the condition and then asks [`Waiters::any_after_change`] (fence, load the count).
//! Of the two stores, one is seen by the other side's load: either the waiter sees the new
//! condition, or the changer sees the waiter counted, and takes the lock and notifies. It
//! takes the lock before notifying so that a waiter that looked before the change is asleep
//! by then, not between its look and its sleep. Model-checked in `tests/loom.rs`
//! (`waiters_no_lost_wakeup`).
//!
//! ```
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use std::sync::{Arc, Condvar, Mutex};
//! use clan_shm::waiters::Waiters;
//!
//! let shared = Arc::new((Mutex::new(()), Condvar::new(), AtomicBool::new(false), Waiters::new()));
//! let s = shared.clone();
//! let waiter = std::thread::spawn(move || {
//!     let (lock, cv, done, waiters) = &*s;
//!     waiters.enter();
//!     let mut g = lock.lock().unwrap();
//!     while !done.load(Ordering::Acquire) {
//!         g = cv.wait(g).unwrap();
//!     }
//!     drop(g);
//!     waiters.leave();
//! });
//! let (lock, cv, done, waiters) = &*shared;
//! done.store(true, Ordering::Release);
//! if waiters.any_after_change() {
//!     drop(lock.lock().unwrap());
//!     cv.notify_all();
//! }
//! waiter.join().unwrap();
//! ```

use crate::sync::{AtomicU32, Ordering, fence};

/// How many threads are waiting (or about to) for a condition (module docs).
#[derive(Debug, Default)]
pub struct Waiters(AtomicU32);

impl Waiters {
    /// Nobody waiting.
    pub fn new() -> Waiters {
        Waiters(AtomicU32::new(0))
    }

    /// A thread is about to look at the condition and wait for it: counted first.
    pub fn enter(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
        // SYNC POINT: pairs with the fence in `any_after_change`.
        fence(Ordering::SeqCst);
    }

    /// The thread has stopped waiting.
    pub fn leave(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }

    /// The condition was just changed (stored before this call): whether a thread may be
    /// waiting for it (then take its lock and notify).
    pub fn any_after_change(&self) -> bool {
        // SYNC POINT: pairs with the fence in `enter`.
        fence(Ordering::SeqCst);
        self.0.load(Ordering::Relaxed) > 0
    }
}
