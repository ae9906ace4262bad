//! Cross-process futex wait/wake on a word of shared memory.
//!
//! The flag `FUTEX_PRIVATE_FLAG` is deliberately absent: the kernel then keys the futex on the
//! backing page (memfd inode + offset), so processes that map the same memfd at different
//! addresses sleep and wake on the same futex.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleep while `*word == expected`, for at most `timeout`. Returns on wake-up, on a value
/// mismatch, on timeout or on a signal; callers always re-check their condition.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos().into(),
    });
    // Errors are EAGAIN (value changed), ETIMEDOUT and EINTR: all mean "re-check".
    let _ = futex::wait(word, futex::Flags::empty(), expected, ts.as_ref());
}

/// Wake every process and thread sleeping on `word`.
pub fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}
