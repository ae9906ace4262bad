//! Completion queues: completions waiting to be read, in order, errors apart (a read while
//! an error completion waits says so, `-FI_EAVAIL`, as libfabric specifies), and a `signal`
//! that interrupts a blocking read. Blocking reads sleep on the domain's event queue (`ffi`):
//! a completion pushed while a reader sleeps posts to it ([`Cq::sleeping`]). Safe Rust; `ffi`
//! writes the entries in the format the queue was opened with.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    /// Readers asleep on `waker`.
    sleepers: AtomicUsize,
    /// Completions and errors waiting (kept by every change, under the lock).
    waiting: AtomicUsize,
    /// Woken when a completion comes while a reader sleeps.
    waker: Option<clan::EventQueue>,
    /// Entries it holds at most (`fi_cq_attr::size`); beyond, an error completion says so.
    capacity: usize,
}

/// The provider's error codes, described by [`strerror`].
pub mod prov {
    pub const OVERRUN: i32 = 1;
    pub const PEER_GONE: i32 = 2;
    pub const TRUNCATED: i32 = 3;
    pub const RMA_NO_KEY: i32 = 4;
    pub const RMA_RANGE: i32 = 5;
    pub const RMA_RIGHTS: i32 = 6;
    pub const RMA_MALFORMED: i32 = 7;
}

/// The text of a provider error code.
pub fn strerror(prov_errno: i32) -> &'static str {
    match prov_errno {
        prov::OVERRUN => "the completion queue was full: completions were lost",
        prov::PEER_GONE => "the peer went away",
        prov::TRUNCATED => "the message was longer than the posted buffer",
        prov::RMA_NO_KEY => "the target has no registration with this key (in this domain)",
        prov::RMA_RANGE => "the range is not inside the target's registration",
        prov::RMA_RIGHTS => "the target's registration does not allow this access",
        prov::RMA_MALFORMED => "the remote memory request or its answer was malformed",
        _ => "no provider error",
    }
}

/// A completion handed to the reader whose progress made it, without passing through the
/// queue: a thread reading a queue whose progress takes in a message for it gets its
/// completion here, with no lock and no copy into the queue and out again (the short path of
/// every message a polling reader receives). One, the first: the rest, if that progress
/// lands more, are queued after it. Only while nothing waits in the queue itself, so that
/// order is kept: it was made after everything queued before the reader looked, and before
/// anything queued after it. Completions of other threads' progress have no order against
/// it (libfabric gives none).
#[derive(Debug)]
pub struct Direct {
    /// The queue it reads (its address; 0: none).
    cq: usize,
    got: Option<Entry>,
}

impl Direct {
    /// Reading no queue: every completion is queued.
    pub fn none() -> Direct {
        Direct { cq: 0, got: None }
    }

    /// The reader of `cq` (`room`: whether it has room for an entry).
    pub fn to(cq: &Cq, room: bool) -> Direct {
        Direct { cq: if room { cq as *const Cq as usize } else { 0 }, got: None }
    }

    /// What it was handed.
    pub fn got(&self) -> Option<&Entry> {
        self.got.as_ref()
    }
}

impl Cq {
    pub fn new(capacity: usize, waker: Option<clan::EventQueue>) -> Cq {
        Cq {
            state: Mutex::new(State::default()),
            sleepers: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            waker,
            capacity: capacity.max(1),
        }
    }

    /// Run `sleep` counted as a sleeping reader: a completion pushed meanwhile wakes the
    /// queue it sleeps on. `sleep` must look at [`Cq::has_any`] after it is counted (the
    /// SeqCst increment here and the SeqCst load in `wake` make one of the two see the other).
    pub fn sleeping<R>(&self, sleep: impl FnOnce() -> R) -> R {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let r = sleep();
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    fn wake(&self) {
        // Pairs with the increment in `sleeping` (both SeqCst, after the push's unlock).
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            if let Some(q) = &self.waker {
                q.post_user(0);
            }
        }
    }

    /// Publish how many completions and errors wait (after a change, under the lock).
    fn count(&self, s: &State) {
        // (Relaxed: a reader that sees a count then takes the lock, which orders the rest; a
        // reader that sees a stale zero looks again at its next poll)
        self.waiting.store(s.entries.len() + s.errors.len(), Ordering::Relaxed);
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
        self.count(&s);
        drop(s);
        self.wake();
    }

    /// [`Cq::push`], unless `direct` reads this queue, has room, and nothing is queued: then
    /// into `direct`.
    pub fn push_to(&self, e: Entry, direct: &mut Direct) {
        // (Relaxed, as in `count`: this thread's own pushes are seen in program order; a
        // push by another thread that this one does not see yet is concurrent with it, and
        // concurrent completions have no order)
        if direct.cq == self as *const Cq as usize && direct.got.is_none() && self.waiting.load(Ordering::Relaxed) == 0
        {
            direct.got = Some(e);
            return;
        }
        self.push(e);
    }

    pub fn push_err(&self, e: ErrEntry) {
        let mut s = self.lock();
        s.errors.push_back(e);
        self.count(&s);
        drop(s);
        self.wake();
    }

    /// Take up to `max` completions, in order, handing each to `each` with its index (no
    /// copy of them is made); how many. `Avail` while an error completion waits, `Again`
    /// when there is none.
    pub fn read(&self, max: usize, mut each: impl FnMut(usize, &Entry)) -> Result<usize, ReadError> {
        // (an empty queue polled in a loop costs no lock)
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return Err(ReadError::Again);
        }
        let mut s = self.lock();
        if !s.errors.is_empty() {
            return Err(ReadError::Avail);
        }
        if s.entries.is_empty() || max == 0 {
            return Err(ReadError::Again);
        }
        let n = max.min(s.entries.len());
        for (i, e) in s.entries.drain(..n).enumerate() {
            each(i, &e);
        }
        self.count(&s);
        Ok(n)
    }

    /// Whether a read would return something (a completion or an error).
    pub fn has_any(&self) -> bool {
        let s = self.lock();
        !s.entries.is_empty() || !s.errors.is_empty()
    }

    /// Whether `signal` was called and not yet taken.
    pub fn is_signaled(&self) -> bool {
        self.lock().signaled
    }

    /// Whether `signal` was called since the last look (and forget it).
    pub fn take_signal(&self) -> bool {
        std::mem::take(&mut self.lock().signaled)
    }

    /// The first error completion.
    pub fn readerr(&self) -> Option<ErrEntry> {
        let mut s = self.lock();
        let e = s.errors.pop_front();
        self.count(&s);
        e
    }

    /// Interrupt a blocking read (it returns [`ReadError::Canceled`]).
    pub fn signal(&self) {
        self.lock().signaled = true;
        self.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(c: usize) -> Entry {
        Entry { op_context: c, len: c, ..Entry::default() }
    }

    #[test]
    fn the_reader_takes_the_first_completion_of_its_progress_while_nothing_is_queued() {
        let (q, other) = (Cq::new(8, None), Cq::new(8, None));
        let mut d = Direct::to(&q, true);
        q.push_to(e(1), &mut d);
        q.push_to(e(2), &mut d);
        assert_eq!(d.got().map(|x| x.op_context), Some(1), "the first, straight");
        assert!(q.has_any(), "the second, queued");
        // A reader of another queue, or one without room, takes nothing of this one's.
        let (mut d2, mut d3) = (Direct::to(&other, true), Direct::to(&q, false));
        q.push_to(e(3), &mut d2);
        q.push_to(e(4), &mut d3);
        assert!(d2.got().is_none() && d3.got().is_none());
        // Something queued: the next reader takes nothing straight (order is kept).
        let mut d4 = Direct::to(&q, true);
        q.push_to(e(5), &mut d4);
        assert!(d4.got().is_none());
        let mut all = Vec::new();
        q.read(8, |_, x| all.push(x.op_context)).unwrap();
        assert_eq!(all, [2, 3, 4, 5]);
        // Empty again: straight once more.
        let mut d5 = Direct::to(&q, true);
        q.push_to(e(6), &mut d5);
        assert_eq!(d5.got().map(|x| x.op_context), Some(6));
        assert!(!q.has_any());
    }

    #[test]
    fn order_errors_overrun_and_signal() {
        let q = Cq::new(3, None);
        let read = |n: usize| {
            let mut v = Vec::new();
            q.read(n, |i, e| {
                assert_eq!(i, v.len());
                v.push(*e);
            })
            .map(|k| {
                assert_eq!(k, v.len());
                v
            })
        };
        assert_eq!(read(4), Err(ReadError::Again));
        q.push(e(1));
        q.push(e(2));
        assert_eq!(read(1).unwrap(), [e(1)]);
        q.push(e(3));
        q.push(e(4));
        // Full: the next is an overrun error, and errors come first.
        q.push(e(5));
        assert_eq!(read(8), Err(ReadError::Avail));
        let err = q.readerr().unwrap();
        assert_eq!((err.entry, err.prov_errno), (e(5), prov::OVERRUN));
        assert!(!strerror(err.prov_errno).is_empty());
        assert_eq!(read(8).unwrap(), [e(2), e(3), e(4)]);
        assert!(!q.has_any());
        q.signal();
        assert!(q.take_signal() && !q.take_signal());
    }
}
