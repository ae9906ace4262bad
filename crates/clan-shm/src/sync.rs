//! The one place atomics come from.
//!
//! Under `cfg(loom)` every atomic, fence and the futex model switch to loom's, so the
//! shared-memory algorithms of this crate ([`crate::ring`], [`crate::trip`], [`crate::cam`],
//! [`crate::snoop`]) are model-checked exactly as they run (see `tests/loom.rs`).

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering, fence};

/// Hint to the processor that we are busy-waiting.
#[inline]
pub fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Sleeping on a 32-bit word in shared memory, and waking its sleepers.
///
/// Production code uses [`SharedFutex`] (the Linux `futex` system call without
/// `FUTEX_PRIVATE_FLAG`, so it works across processes that map the same memfd). The loom
/// tests use a model with the same semantics: `wait` returns at once if the word no longer
/// holds `expected`, otherwise it sleeps until a `wake` on that word (spurious returns allowed).
pub trait Futex {
    /// Sleep while `word == expected`, at most `timeout` (None: forever).
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<std::time::Duration>);
    /// Wake every sleeper on `word`.
    fn wake(&self, word: &AtomicU32);
}

/// The real, cross-process futex.
#[cfg(not(loom))]
#[derive(Debug, Clone, Copy, Default)]
pub struct SharedFutex;

#[cfg(not(loom))]
impl Futex for SharedFutex {
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<std::time::Duration>) {
        crate::futex::wait(word, expected, timeout);
    }
    fn wake(&self, word: &AtomicU32) {
        crate::futex::wake_all(word);
    }
}

/// A futex model for loom: a mutex-protected wake count and a condition variable.
#[cfg(loom)]
#[derive(Debug, Default)]
pub struct ModelFutex {
    lock: loom::sync::Mutex<u64>,
    cv: loom::sync::Condvar,
}

#[cfg(loom)]
impl Futex for ModelFutex {
    fn wait(&self, word: &AtomicU32, expected: u32, _timeout: Option<std::time::Duration>) {
        let guard = self.lock.lock().unwrap();
        // Checking the word under the lock that `wake` also takes gives the futex guarantee:
        // a wake that follows a change of the word cannot slip between check and sleep.
        if word.load(Ordering::SeqCst) != expected {
            return;
        }
        let _guard = self.cv.wait(guard).unwrap();
    }
    fn wake(&self, _word: &AtomicU32) {
        let mut guard = self.lock.lock().unwrap();
        *guard += 1;
        self.cv.notify_all();
    }
}
