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

/// Most words one [`wait_any`] sleeps on (the kernel's `FUTEX_WAITV_MAX`).
pub const WAIT_ANY_MAX: usize = 128;

/// Sleep while every `(word, expected)` of `words` holds (at most [`WAIT_ANY_MAX`] of them),
/// at most `timeout`: `futex_waitv`, shared futexes (any process mapping a word wakes it with
/// [`wake_all`]). Returns on a wake-up of any word, a mismatch, timeout or signal; callers
/// re-check. Falls back to sleeping on the first word alone on a kernel without
/// `futex_waitv` (before 5.16), bounded by a millisecond so the others are looked at.
pub fn wait_any(words: &[(&AtomicU32, u32)], timeout: Option<Duration>) {
    use rustix::thread::futex::{Wait, WaitFlags, WaitPtr, WaitvFlags};
    let Some(&(first, first_expected)) = words.first() else {
        return;
    };
    if words.len() == 1 || words.len() > WAIT_ANY_MAX {
        wait(first, first_expected, timeout);
        return;
    }
    // (a kernel, or valgrind, without `futex_waitv` is asked once, not on every sleep)
    if NO_WAITV.load(std::sync::atomic::Ordering::Relaxed) {
        return wait_first(first, first_expected, timeout);
    }
    let mut w = [Wait::new(); WAIT_ANY_MAX];
    for (slot, (word, expected)) in w.iter_mut().zip(words) {
        slot.val = u64::from(*expected);
        slot.uaddr = WaitPtr::new(word.as_ptr().cast());
        slot.flags = WaitFlags::SIZE_U32;
    }
    // An absolute time on the monotonic clock.
    let ts = timeout.map(|d| {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let nsec = now.tv_nsec as u64 + u64::from(d.subsec_nanos());
        rustix::time::Timespec {
            tv_sec: now
                .tv_sec
                .saturating_add(d.as_secs().min(i64::MAX as u64 / 2) as i64 + (nsec / 1_000_000_000) as i64),
            tv_nsec: (nsec % 1_000_000_000) as _,
        }
    });
    // EAGAIN (a value differed), ETIMEDOUT, EINTR, or woken: all mean "re-check".
    if let Err(rustix::io::Errno::NOSYS) =
        futex::waitv(&w[..words.len()], WaitvFlags::empty(), ts.as_ref(), rustix::time::ClockId::Monotonic)
    {
        // (Relaxed: a flag that only saves a system call; a thread that misses it asks again)
        NO_WAITV.store(true, std::sync::atomic::Ordering::Relaxed);
        wait_first(first, first_expected, timeout);
    }
}

/// Whether `futex_waitv` answered `ENOSYS`.
static NO_WAITV: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// [`wait_any`] without `futex_waitv`: sleep on the first word alone, at most a millisecond
/// (then the caller looks at the others).
fn wait_first(first: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    wait(first, expected, Some(timeout.map_or(Duration::from_millis(1), |t| t.min(Duration::from_millis(1)))));
}
