//! Event queues: control events (connection management, asynchronous inserts, events the
//! application writes itself), each an event number and its bytes, errors apart (a read
//! while an error waits says so, `-FI_EAVAIL`). Safe Rust; `ffi` copies in and out.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// An event that failed (the fields of `fi_eq_err_entry` that carry meaning here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrEvent {
    /// The object it is about (`fid_t`, as an address).
    pub fid: usize,
    pub context: usize,
    pub data: u64,
    /// A positive `FI_E*` code.
    pub err: i32,
    pub prov_errno: i32,
}

/// Why a read returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    /// Nothing yet.
    Again,
    /// An error event is first.
    Avail,
    /// The caller's buffer is smaller than the next event (it stays queued).
    TooSmall,
}

#[derive(Debug, Default)]
struct State {
    events: VecDeque<(u32, Vec<u8>)>,
    errors: VecDeque<ErrEvent>,
}

#[derive(Debug)]
pub struct Eq {
    state: Mutex<State>,
    cv: Condvar,
    capacity: usize,
}

impl Eq {
    pub fn new(capacity: usize) -> Eq {
        Eq { state: Mutex::new(State::default()), cv: Condvar::new(), capacity: capacity.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue an event; false if the queue is full (the event is not taken).
    pub fn write(&self, event: u32, bytes: &[u8]) -> bool {
        let mut s = self.lock();
        if s.events.len() >= self.capacity {
            return false;
        }
        s.events.push_back((event, bytes.to_vec()));
        drop(s);
        self.cv.notify_all();
        true
    }

    pub fn write_err(&self, e: ErrEvent) {
        self.lock().errors.push_back(e);
        self.cv.notify_all();
    }

    /// The next event, if it fits in `room` bytes; `peek` leaves it queued.
    pub fn read(&self, room: usize, peek: bool) -> Result<(u32, Vec<u8>), ReadError> {
        Self::take(&mut self.lock(), room, peek)
    }

    fn take(s: &mut State, room: usize, peek: bool) -> Result<(u32, Vec<u8>), ReadError> {
        if !s.errors.is_empty() {
            return Err(ReadError::Avail);
        }
        let Some((_, bytes)) = s.events.front() else { return Err(ReadError::Again) };
        if bytes.len() > room {
            return Err(ReadError::TooSmall);
        }
        if peek {
            return s.events.front().cloned().ok_or(ReadError::Again);
        }
        s.events.pop_front().ok_or(ReadError::Again)
    }

    /// As [`Eq::read`], waiting up to `timeout` (None: forever).
    pub fn sread(&self, room: usize, peek: bool, timeout: Option<Duration>) -> Result<(u32, Vec<u8>), ReadError> {
        let end = timeout.map(|t| Instant::now() + t);
        let mut s = self.lock();
        loop {
            match Self::take(&mut s, room, peek) {
                Err(ReadError::Again) => {}
                r => return r,
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

    pub fn readerr(&self) -> Option<ErrEvent> {
        self.lock().errors.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_in_order_errors_first_sizes_checked() {
        let q = Eq::new(2);
        assert_eq!(q.read(64, false), Err(ReadError::Again));
        assert!(q.write(7, b"abc") && q.write(8, b"defgh") && !q.write(9, b""), "full at two");
        assert_eq!(q.read(2, false), Err(ReadError::TooSmall));
        assert_eq!(q.read(3, true).unwrap(), (7, b"abc".to_vec()));
        assert_eq!(q.read(3, false).unwrap(), (7, b"abc".to_vec()));
        q.write_err(ErrEvent { err: 5, ..ErrEvent::default() });
        assert_eq!(q.read(64, false), Err(ReadError::Avail));
        assert_eq!(q.readerr().map(|e| e.err), Some(5));
        assert_eq!(q.sread(64, false, Some(Duration::from_millis(5))).unwrap(), (8, b"defgh".to_vec()));
        assert_eq!(q.sread(64, false, Some(Duration::from_millis(5))), Err(ReadError::Again));
    }
}
