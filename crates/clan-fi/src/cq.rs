//! Completion queues: completions waiting to be read, in order, errors apart (a read while
//! an error completion waits says so, `-FI_EAVAIL`, as libfabric specifies), and a blocking
//! read that a `signal` interrupts. Safe Rust; `ffi` writes the entries in the format the
//! queue was opened with.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// One completion (the fields of `fi_cq_tagged_entry`; smaller formats use a prefix).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub op_context: usize,
    pub flags: u64,
    pub len: usize,
    pub buf: usize,
    pub data: u64,
    pub tag: u64,
}

/// A failed operation (the fields of `fi_cq_err_entry` that carry meaning here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrEntry {
    pub entry: Entry,
    /// Bytes that did not fit (truncation).
    pub olen: usize,
    /// A positive `FI_E*` code.
    pub err: i32,
    /// The provider's own code (see [`strerror`]).
    pub prov_errno: i32,
}

/// Why a read returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    /// Nothing yet.
    Again,
    /// An error completion is first: read it with `readerr`.
    Avail,
    /// A blocking read was interrupted by `signal`.
    Canceled,
}

#[derive(Debug, Default)]
struct State {
    entries: VecDeque<Entry>,
    errors: VecDeque<ErrEntry>,
    signaled: bool,
}

/// The queue.
#[derive(Debug)]
pub struct Cq {
    state: Mutex<State>,
    cv: Condvar,
    /// Entries it holds at most (`fi_cq_attr::size`); beyond, an error completion says so.
    capacity: usize,
}

/// The provider's error codes, described by [`strerror`].
pub mod prov {
    pub const OVERRUN: i32 = 1;
    pub const PEER_GONE: i32 = 2;
    pub const TRUNCATED: i32 = 3;
}

/// The text of a provider error code.
pub fn strerror(prov_errno: i32) -> &'static str {
    match prov_errno {
        prov::OVERRUN => "the completion queue was full: completions were lost",
        prov::PEER_GONE => "the peer went away",
        prov::TRUNCATED => "the message was longer than the posted buffer",
        _ => "no provider error",
    }
}

impl Cq {
    pub fn new(capacity: usize) -> Cq {
        Cq { state: Mutex::new(State::default()), cv: Condvar::new(), capacity: capacity.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A completion. A full queue turns it into an overrun error (never lost silently).
    pub fn push(&self, e: Entry) {
        let mut s = self.lock();
        if s.entries.len() >= self.capacity {
            s.errors.push_back(ErrEntry { entry: e, olen: 0, err: libc::EOVERFLOW, prov_errno: prov::OVERRUN });
        } else {
            s.entries.push_back(e);
        }
        drop(s);
        self.cv.notify_all();
    }

    pub fn push_err(&self, e: ErrEntry) {
        self.lock().errors.push_back(e);
        self.cv.notify_all();
    }

    /// Up to `max` completions, oldest first.
    pub fn read(&self, max: usize) -> Result<Vec<Entry>, ReadError> {
        Self::take(&mut self.lock(), max)
    }

    fn take(s: &mut State, max: usize) -> Result<Vec<Entry>, ReadError> {
        if !s.errors.is_empty() {
            return Err(ReadError::Avail);
        }
        if s.entries.is_empty() || max == 0 {
            return Err(ReadError::Again);
        }
        let n = max.min(s.entries.len());
        Ok(s.entries.drain(..n).collect())
    }

    /// As [`Cq::read`], waiting up to `timeout` (None: forever) for at least one.
    pub fn sread(&self, max: usize, timeout: Option<Duration>) -> Result<Vec<Entry>, ReadError> {
        let end = timeout.map(|t| Instant::now() + t);
        let mut s = self.lock();
        loop {
            match Self::take(&mut s, max) {
                Err(ReadError::Again) => {}
                r => return r,
            }
            if std::mem::take(&mut s.signaled) {
                return Err(ReadError::Canceled);
            }
            s = match end {
                None => self.cv.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ReadError::Again);
                    }
                    self.cv.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
    }

    /// Whether a read would return something (a completion or an error).
    pub fn has_any(&self) -> bool {
        let s = self.lock();
        !s.entries.is_empty() || !s.errors.is_empty()
    }

    /// Whether `signal` was called since the last look (and forget it).
    pub fn take_signal(&self) -> bool {
        std::mem::take(&mut self.lock().signaled)
    }

    /// The first error completion.
    pub fn readerr(&self) -> Option<ErrEntry> {
        self.lock().errors.pop_front()
    }

    /// Wake a blocked [`Cq::sread`] (it returns [`ReadError::Canceled`]).
    pub fn signal(&self) {
        self.lock().signaled = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(c: usize) -> Entry {
        Entry { op_context: c, len: c, ..Entry::default() }
    }

    #[test]
    fn order_errors_overrun_and_blocking_reads() {
        let q = Cq::new(3);
        assert_eq!(q.read(4), Err(ReadError::Again));
        q.push(e(1));
        q.push(e(2));
        assert_eq!(q.read(1).unwrap(), [e(1)]);
        q.push(e(3));
        q.push(e(4));
        // Full: the next is an overrun error, and errors come first.
        q.push(e(5));
        assert_eq!(q.read(8), Err(ReadError::Avail));
        let err = q.readerr().unwrap();
        assert_eq!((err.entry, err.prov_errno), (e(5), prov::OVERRUN));
        assert!(!strerror(err.prov_errno).is_empty());
        assert_eq!(q.read(8).unwrap(), [e(2), e(3), e(4)]);
        assert_eq!(q.sread(1, Some(Duration::from_millis(20))), Err(ReadError::Again));
        // A blocked read wakes for a completion, and for a signal.
        let q = std::sync::Arc::new(Cq::new(8));
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.sread(4, Some(Duration::from_secs(30))));
        std::thread::sleep(Duration::from_millis(20));
        q.push(e(9));
        assert_eq!(t.join().unwrap().unwrap(), [e(9)]);
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.sread(4, None));
        std::thread::sleep(Duration::from_millis(20));
        q.signal();
        assert_eq!(t.join().unwrap(), Err(ReadError::Canceled));
    }
}
