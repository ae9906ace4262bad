//! One accelerated connection: the clan stream that carries its bytes, the queue its
//! readiness tripwires post to, and the application's view (blocking or not).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

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
        // The stream never blocks: waiting is done here, where a signal can interrupt it.
        stream.set_nonblocking(true)?;
        Ok(Conn { stream, queue, data, space, nonblock: AtomicBool::new(nonblock) })
    }

    pub fn nonblocking(&self) -> bool {
        self.nonblock.load(Ordering::Acquire)
    }

    pub fn set_nonblocking(&self, on: bool) {
        self.nonblock.store(on, Ordering::Release);
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

    /// Wait until a read (or a write) would not block: spin a little, then arm the
    /// tripwire and sleep in the kernel on the connection's queue. `EINTR` when a signal
    /// with a handler installed without `SA_RESTART` interrupted the sleep; `EAGAIN` when the
    /// socket's `SO_RCVTIMEO` / `SO_SNDTIMEO` (set on the kernel socket `fd`) passed.
    fn block(&self, fd: c_int, read: bool, since: Instant) -> Result<(), c_int> {
        let ready = |r: Readiness| if read { r.readable } else { r.writable };
        let spin_until = Instant::now() + crate::ready::spin();
        while Instant::now() < spin_until {
            if ready(self.readiness()) {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let limit = crate::real::with_fd(fd, |b| {
            let dir = if read { rustix::net::sockopt::Timeout::Recv } else { rustix::net::sockopt::Timeout::Send };
            rustix::net::sockopt::socket_timeout(b, dir).ok().flatten()
        });
        let tw = if read { &self.data } else { &self.space };
        loop {
            if !self.queue.arm() {
                self.drain();
                return Ok(());
            }
            if tw.arm().is_err() || ready(self.readiness()) {
                return Ok(());
            }
            let ms = match limit {
                None => -1,
                Some(l) => {
                    let left = l.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        return Err(libc::EAGAIN);
                    }
                    left.as_millis().clamp(1, c_int::MAX as u128) as c_int
                }
            };
            use std::os::fd::AsRawFd;
            let mut p = [libc::pollfd { fd: self.queue.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            match crate::real::poll_fds(&mut p, ms) {
                Ok(_) => {
                    self.drain();
                    return Ok(());
                }
                Err(libc::EINTR) if crate::real::any_handler_without_restart() => return Err(libc::EINTR),
                Err(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub fn read(&self, fd: c_int, buf: &mut [u8], f: Flags) -> Result<usize, c_int> {
        if buf.is_empty() {
            return Ok(0);
        }
        let nb = f.dontwait || self.nonblocking();
        let since = Instant::now();
        let mut done = 0;
        loop {
            let r = if f.peek { self.stream.peek(&mut buf[done..]) } else { (&self.stream).read(&mut buf[done..]) };
            match r {
                Ok(0) if f.peek && !self.readiness().eof && !self.readiness().error => {}
                Ok(0) => return Ok(done),
                Ok(n) => {
                    done += n;
                    if f.peek || !f.waitall || done == buf.len() {
                        return Ok(done);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return if done > 0 { Ok(done) } else { Err(errno_of(&e)) },
            }
            if nb {
                return if done > 0 { Ok(done) } else { Err(libc::EAGAIN) };
            }
            if let Err(e) = self.block(fd, true, since) {
                return if done > 0 { Ok(done) } else { Err(e) };
            }
        }
    }

    pub fn write(&self, fd: c_int, buf: &[u8], f: Flags) -> Result<usize, c_int> {
        // A blocking socket's send returns when everything was sent (as the kernel's does:
        // programs rely on it); a non-blocking one returns what fitted.
        let nb = f.dontwait || self.nonblocking();
        let since = Instant::now();
        let mut done = 0;
        loop {
            match (&self.stream).write(&buf[done..]) {
                Ok(n) => {
                    done += n;
                    if done == buf.len() || (nb && n > 0) {
                        return Ok(done);
                    }
                    if n > 0 {
                        continue;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) if done > 0 => return Ok(done),
                Err(e) => {
                    let n = errno_of(&e);
                    if n == libc::EPIPE && !f.nosignal {
                        crate::real::raise_sigpipe();
                    }
                    return Err(n);
                }
            }
            if nb {
                return if done > 0 { Ok(done) } else { Err(libc::EAGAIN) };
            }
            if let Err(e) = self.block(fd, false, since) {
                return if done > 0 { Ok(done) } else { Err(e) };
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
