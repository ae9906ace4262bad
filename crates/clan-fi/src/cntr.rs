//! Counters (`fi_cntr_open`): a count of completed operations and one of failed ones, which
//! an endpoint bound to the counter increments. Waiting for a threshold sleeps on the
//! domain's event queue like a completion queue's blocking read ([`crate::cq::Cq::sleeping`]
//! explains the hand-off). Safe Rust.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A counter.
#[derive(Debug)]
pub struct Cntr {
    value: AtomicU64,
    errors: AtomicU64,
    sleepers: AtomicUsize,
    waker: Option<clan::EventQueue>,
}

impl Cntr {
    pub fn new(waker: Option<clan::EventQueue>) -> Cntr {
        Cntr { value: AtomicU64::new(0), errors: AtomicU64::new(0), sleepers: AtomicUsize::new(0), waker }
    }

    /// Completed operations.
    pub fn read(&self) -> u64 {
        // Pairs with the Release in `add`/`set`: a reader that sees the count sees the data
        // of the operations it counts (copied before the increment).
        self.value.load(Ordering::Acquire)
    }

    /// Failed operations.
    pub fn read_err(&self) -> u64 {
        // Pairs with the Release in `add_err`/`set_err`.
        self.errors.load(Ordering::Acquire)
    }

    pub fn add(&self, n: u64) {
        // Pairs with the Acquire in `read`.
        self.value.fetch_add(n, Ordering::Release);
        self.wake();
    }

    pub fn set(&self, n: u64) {
        // Pairs with the Acquire in `read`.
        self.value.store(n, Ordering::Release);
        self.wake();
    }

    pub fn add_err(&self, n: u64) {
        // Pairs with the Acquire in `read_err`.
        self.errors.fetch_add(n, Ordering::Release);
        self.wake();
    }

    pub fn set_err(&self, n: u64) {
        // Pairs with the Acquire in `read_err`.
        self.errors.store(n, Ordering::Release);
        self.wake();
    }

    /// Run `sleep` counted as a sleeper: a change meanwhile posts to the queue it sleeps on.
    /// `sleep` must look at the counts after it is counted (the SeqCst increment here and the
    /// SeqCst load in `wake` make one of the two see the other).
    pub fn sleeping<R>(&self, sleep: impl FnOnce() -> R) -> R {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let r = sleep();
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    fn wake(&self) {
        // Pairs with the increment in `sleeping` (both SeqCst, after the change).
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            if let Some(q) = &self.waker {
                q.post_user(0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_errors() {
        let c = Cntr::new(None);
        c.add(2);
        c.add(3);
        c.add_err(1);
        assert_eq!((c.read(), c.read_err()), (5, 1));
        c.set(1);
        c.set_err(0);
        assert_eq!((c.read(), c.read_err()), (1, 0));
        assert_eq!(c.sleeping(|| 7), 7);
    }
}
