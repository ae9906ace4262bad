//! An eventfd: the file descriptor an event queue exposes to epoll, mio and tokio.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use rustix::event::EventfdFlags;

/// A non-blocking eventfd in counter mode.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new eventfd with count 0 (not readable).
    pub fn new() -> io::Result<EventFd> {
        let fd = crate::fdfloor::lift(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        Ok(EventFd { fd })
    }

    /// Wrap an eventfd received from another process.
    pub fn from_owned(fd: OwnedFd) -> EventFd {
        EventFd { fd }
    }

    /// Make the descriptor readable (add 1 to the count).
    pub fn signal(&self) {
        // EAGAIN only when the counter would overflow, in which case it is readable anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Reset the count to 0; returns whether it was readable.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 8];
        matches!(rustix::io::read(&self.fd, &mut buf), Ok(8))
    }

    /// Block until readable or until `timeout` (None: forever). Returns whether readable.
    pub fn wait_readable(&self, timeout: Option<std::time::Duration>) -> bool {
        use rustix::event::{PollFd, PollFlags, poll};
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        let ts = timeout.map(|d| rustix::time::Timespec {
            tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: d.subsec_nanos().into(),
        });
        matches!(poll(&mut fds, ts.as_ref()), Ok(n) if n > 0)
    }

    /// Duplicate for sending to another process.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
