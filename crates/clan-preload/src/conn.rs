//! One accelerated connection: the clan stream that carries its bytes, the queue its
//! readiness tripwires post to, and the application's view (blocking or not).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clan::{EventQueue, Tripwire};
use clan_proto::stream::{Readiness, Stream};
use libc::c_int;

/// An accelerated connection (shared by every descriptor that refers to it: `dup`).
#[derive(Debug)]
pub(crate) struct Conn {
    pub stream: Stream,
    /// The queue the stream's endpoint reports to: one per connection, so that a waiter
    /// sleeps on exactly the connections it waits for.
    pub queue: EventQueue,
    data: Tripwire,
    space: Tripwire,
    /// `O_NONBLOCK` of the open file (shared by its duplicates, as the kernel's flag is).
    nonblock: AtomicBool,
}

/// What a read or a write call asked for, beyond the bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Flags {
    pub peek: bool,
    pub dontwait: bool,
    pub waitall: bool,
    pub nosignal: bool,
}

impl Flags {
    pub fn from_msg(flags: c_int) -> Flags {
        Flags {
            peek: flags & libc::MSG_PEEK != 0,
            dontwait: flags & libc::MSG_DONTWAIT != 0,
            waitall: flags & libc::MSG_WAITALL != 0,
            nosignal: flags & libc::MSG_NOSIGNAL != 0,
        }
    }
}

/// The `errno` for a stream error.
pub(crate) fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock | K::TimedOut => libc::EAGAIN,
        K::BrokenPipe => libc::EPIPE,
        K::ConnectionReset | K::ConnectionAborted | K::UnexpectedEof => libc::ECONNRESET,
        K::NotConnected => libc::ENOTCONN,
        K::InvalidInput => libc::EINVAL,
        K::Interrupted => libc::EINTR,
        _ => libc::EIO,
    }
}

impl Conn {
    pub fn new(stream: Stream, queue: EventQueue, nonblock: bool) -> io::Result<Conn> {
        let (data, space) = stream.readiness_tripwires(1, 2)?;
        stream.set_nonblocking(nonblock)?;
        Ok(Conn { stream, queue, data, space, nonblock: AtomicBool::new(nonblock) })
    }

    pub fn nonblocking(&self) -> bool {
        self.nonblock.load(Ordering::Acquire)
    }

    pub fn set_nonblocking(&self, on: bool) {
        self.nonblock.store(on, Ordering::Release);
        let _ = self.stream.set_nonblocking(on);
    }

    pub fn readiness(&self) -> Readiness {
        self.stream.readiness()
    }

    /// Arm the tripwires a waiter for reading and/or writing needs (once-only: they fire
    /// once, posting to `queue`). False if the connection is broken (nothing to wait for).
    pub fn arm(&self, read: bool, write: bool) -> bool {
        (!read || self.data.arm().is_ok()) && (!write || self.space.arm().is_ok())
    }

    /// Take every event the connection's queue holds (they only wake; readiness is read
    /// from the stream itself).
    pub fn drain(&self) {
        while self.queue.try_take().is_some() {}
    }

    /// Wait until a read (or a write) would not block, or `deadline`.
    fn wait(&self, read: bool, deadline: Option<Instant>) {
        let ready = |r: Readiness| if read { r.readable } else { r.writable };
        if ready(self.readiness()) {
            return;
        }
        let tw = if read { &self.data } else { &self.space };
        if tw.arm().is_err() || ready(self.readiness()) {
            return;
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let _ = tw.wait(left.or(Some(Duration::from_millis(200))));
        self.drain();
    }

    pub fn read(&self, buf: &mut [u8], f: Flags) -> Result<usize, c_int> {
        if buf.is_empty() {
            return Ok(0);
        }
        let nb = f.dontwait || self.nonblocking();
        if f.peek {
            loop {
                let n = self.stream.peek(buf).map_err(|e| errno_of(&e))?;
                if n > 0 {
                    return Ok(n);
                }
                let r = self.readiness();
                if r.eof {
                    return Ok(0);
                }
                if r.error {
                    return Err(libc::ECONNRESET);
                }
                if nb {
                    return Err(libc::EAGAIN);
                }
                self.wait(true, None);
            }
        }
        if f.dontwait && !self.nonblocking() && !self.readiness().readable {
            return Err(libc::EAGAIN);
        }
        let mut done = 0;
        loop {
            match (&self.stream).read(&mut buf[done..]) {
                Ok(0) => return Ok(done),
                Ok(n) => {
                    done += n;
                    if !f.waitall || done == buf.len() || nb {
                        return Ok(done);
                    }
                }
                Err(e) if done > 0 && e.kind() == io::ErrorKind::WouldBlock => return Ok(done),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return if done > 0 { Ok(done) } else { Err(errno_of(&e)) },
            }
        }
    }

    pub fn write(&self, buf: &[u8], f: Flags) -> Result<usize, c_int> {
        if f.dontwait && !self.nonblocking() && !self.readiness().writable {
            return Err(libc::EAGAIN);
        }
        match (&self.stream).write(buf) {
            Ok(n) => Ok(n),
            Err(e) => {
                let n = errno_of(&e);
                if n == libc::EPIPE && !f.nosignal {
                    crate::real::raise_sigpipe();
                }
                Err(n)
            }
        }
    }

    pub fn shutdown(&self, how: c_int) -> Result<(), c_int> {
        let how = match how {
            libc::SHUT_RD => Shutdown::Read,
            libc::SHUT_WR => Shutdown::Write,
            libc::SHUT_RDWR => Shutdown::Both,
            _ => return Err(libc::EINVAL),
        };
        match self.stream.shutdown(how) {
            Ok(()) => Ok(()),
            // Writing already shut down: as the kernel, a second shutdown is fine.
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
            Err(e) => Err(errno_of(&e)),
        }
    }

    pub fn available(&self) -> usize {
        self.stream.available().unwrap_or(0) as usize
    }
}
