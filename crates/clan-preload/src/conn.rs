//! One accelerated connection: the clan stream that carries its bytes, the queue its
//! readiness tripwires post to, and the application's view (blocking or not).
//!
//! A connection can go over to the kernel's TCP socket under it, for good: when this
//! process gives it up ([`Conn::hand_over`]: a child shares it after `fork`, `exec`, or
//! it is passed on) or when the peer did ([`Conn::over`] notices, and takes over: it sends
//! again over the kernel what the peer never read, and keeps what the peer wrote that was
//! not read here, to be read first). See `docs/design/clan-run.md`.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clan::{EventQueue, Tripwire};
use clan_proto::stream::{HandOver, Readiness, Stream, TakeOver};
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
    /// The application shut down writing while over clan (a hand-over ends the kernel's
    /// stream too).
    write_shut: AtomicBool,
    /// A child got it at `fork`: closing it here hands it over instead of ending it.
    pub shared: AtomicBool,
    /// It was added to an epoll set (whose waits then rely on its queue's wake-ups: whoever
    /// else takes one tells the sets, [`Conn::drain`]).
    pub epolled: AtomicBool,
    /// The kernel's socket carries the bytes now (set once, with Release, after `prefix`
    /// is in place and what had to go again went; pairs with the Acquire in `over`).
    kernel: AtomicBool,
    /// Bytes that came over clan and were not read when the connection went over.
    prefix: Mutex<VecDeque<u8>>,
    prefix_len: AtomicUsize,
    /// Serialises going over.
    switching: Mutex<()>,
    /// The claim of a connection this process made, while its answer has not come
    /// ([`Conn::await_claim`]): until then no byte goes either way.
    claim: Mutex<Option<crate::registry::Unanswered>>,
    /// `claim` holds one (set once before the connection is shared; cleared with Release once
    /// the answer was read, after `kernel` if it went to the kernel: pairs with the Acquire
    /// in `awaiting` / `over`).
    awaiting: AtomicBool,
    /// Handed to `answers.rs`'s thread (once).
    pub watched: AtomicBool,
    /// The server's listening address, on the connecting side: what the connection carried
    /// is told to `short.rs` when it ends (set before the connection is shared).
    pub client_of: Option<SocketAddr>,
    /// Writes that followed a read, the first write included (`short.rs`: a request and its
    /// reply are one turn). Counted with Relaxed loads and stores, not read-modify-writes: a
    /// count two threads' writes race on may lose one, and it only steers a heuristic.
    turns: AtomicU32,
    /// The last call that moved bytes was a read (true at first: the first write is a turn).
    read_last: AtomicBool,
    /// Bytes written (Relaxed, as `turns`).
    written: AtomicU64,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // What it carried, if it ended over clan on the connecting side (one that went over
        // to the kernel is no evidence either way; nor is a child's copy after `fork`, which
        // also makes no claims, and whose copy of the policy's lock another thread of the
        // parent may have held at the fork).
        if let Some(server) = self.client_of {
            if !*self.kernel.get_mut() && !crate::table::forked() {
                let read = self.stream.stats().read;
                let turns = *self.turns.get_mut();
                let bytes = self.written.get_mut().saturating_add(read);
                crate::short::ended(server, crate::short::Carried { turns, bytes });
            }
        }
        // Its queue serves the next connection (the stream and the tripwires on the queue go
        // right after this, with the other fields).
        crate::registry::recycle_queue(self.queue.clone());
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `MSG_*` flags for the kernel's socket.
fn msg_flags(f: Flags) -> c_int {
    let mut m = 0;
    if f.peek {
        m |= libc::MSG_PEEK;
    }
    if f.dontwait {
        m |= libc::MSG_DONTWAIT;
    }
    if f.waitall {
        m |= libc::MSG_WAITALL;
    }
    if f.nosignal {
        m |= libc::MSG_NOSIGNAL;
    }
    m
}

/// Send all of `bytes` on the kernel's socket (blocking or not: waits for room in slices),
/// within a bound; false if they did not all go.
fn send_all(fd: c_int, bytes: &[u8]) -> bool {
    let mut done = 0;
    let limit = Instant::now() + Duration::from_secs(10);
    while done < bytes.len() {
        match crate::real::send_from(fd, &bytes[done..], libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) {
            Ok(n) => done += n,
            Err(libc::EINTR) => {}
            Err(libc::EAGAIN) if Instant::now() < limit => {
                let mut p = [libc::pollfd { fd, events: libc::POLLOUT, revents: 0 }];
                let _ = crate::real::poll_fds(&mut p, 100);
            }
            Err(e) => {
                crate::say(format_args!("sending again what the peer had not read failed: errno {e}"));
                return false;
            }
        }
    }
    true
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
        Ok(Conn {
            stream,
            queue,
            data,
            space,
            nonblock: AtomicBool::new(nonblock),
            write_shut: AtomicBool::new(false),
            shared: AtomicBool::new(false),
            epolled: AtomicBool::new(false),
            kernel: AtomicBool::new(false),
            prefix: Mutex::new(VecDeque::new()),
            prefix_len: AtomicUsize::new(0),
            switching: Mutex::new(()),
            claim: Mutex::new(None),
            awaiting: AtomicBool::new(false),
            watched: AtomicBool::new(false),
            client_of: None,
            turns: AtomicU32::new(0),
            read_last: AtomicBool::new(true),
            written: AtomicU64::new(0),
        })
    }

    /// The connection waits for its claim's answer `u` before its first byte (called before
    /// it is shared).
    pub fn await_claim(&self, u: crate::registry::Unanswered) {
        *lock(&self.claim) = Some(u);
        self.awaiting.store(true, Ordering::Release);
    }

    /// Whether the claim's answer has not come yet (not looked for: [`Conn::settle_claim`]).
    pub fn awaiting(&self) -> bool {
        // SYNC POINT: pairs with the Release stores in `await_claim` / `settle_claim`.
        self.awaiting.load(Ordering::Acquire)
    }

    /// The descriptor the claim's answer comes on, while it has not come.
    pub fn claim_fd(&self) -> Option<c_int> {
        if !self.awaiting() {
            return None;
        }
        lock(&self.claim).as_ref().and_then(|u| u.channel_fd())
    }

    /// Read the claim's answer if it came (never blocks): the connection is then over clan,
    /// or the kernel's. True if it has come (now or before). With `wake`, whoever waits on
    /// the connection's queue is woken (`answers.rs`: an epoll set's waiter; the program's
    /// own calls need none, and a wake-up nobody waits for costs the next wait a spin of its
    /// own).
    pub fn settle_claim(&self, wake: bool) -> bool {
        if !self.awaiting() {
            return true;
        }
        // (a child after `fork` never reads the parent's channels: it asks the parent to hand
        // the connection over, `fork.rs`)
        if crate::table::forked() {
            return false;
        }
        let mut g = lock(&self.claim);
        let Some(answer) = g.as_mut().and_then(|u| u.try_answer()) else {
            return g.is_none();
        };
        *g = None;
        match answer {
            crate::registry::Answer::Taken => {
                crate::say(format_args!("a connection's claim was taken"));
                // (`went_over` posts one itself)
                if wake {
                    let _ = self.queue.post_user(0);
                }
            }
            crate::registry::Answer::Refused(why) => {
                // (nothing was sent or read over the stream: the kernel's socket as it is)
                let _g = lock(&self.switching);
                self.went_over(why);
            }
        }
        // SYNC POINT: Release, pairs with the Acquire in `awaiting` (after `kernel`'s store).
        self.awaiting.store(false, Ordering::Release);
        true
    }

    /// Whether the kernel's socket `fd` carries the bytes now. If the peer has handed the
    /// stream over, take it over first (one load of our own memory when it has not).
    pub fn over(&self, fd: c_int) -> bool {
        // SYNC POINT: pairs with the Release in `went_over`.
        if self.kernel.load(Ordering::Acquire) {
            return true;
        }
        // (while the claim's answer has not come: neither, the callers wait, `awaiting`)
        if self.awaiting() && !self.settle_claim(false) {
            return false;
        }
        // SYNC POINT: pairs with the Release in `went_over` (a refused claim).
        if self.kernel.load(Ordering::Acquire) {
            return true;
        }
        if !self.stream.peer_left() {
            return false;
        }
        let _g = lock(&self.switching);
        if !self.kernel.load(Ordering::Relaxed) {
            match self.stream.take_over() {
                Ok(t) => self.settle(fd, t),
                Err(e) => {
                    crate::say(format_args!("taking over from the peer failed ({e}): the kernel's socket as it is"))
                }
            }
            self.went_over("the peer handed the connection over");
        }
        true
    }

    /// Whether the connection is the kernel's alone now (went over, and nothing of clan's
    /// is left to read): it can leave the table.
    pub fn is_kernel_only(&self) -> bool {
        // SYNC POINT: pairs with the Release in `went_over` (the prefix length is stored
        // before it, and only ever shrinks after).
        self.kernel.load(Ordering::Acquire) && self.prefix_len.load(Ordering::Acquire) == 0
    }

    /// What a take-over found: send again what the peer never read, keep what it wrote.
    fn settle(&self, fd: c_int, t: TakeOver) {
        if !t.unread.is_empty() {
            let mut p = lock(&self.prefix);
            p.extend(t.unread.iter());
            self.prefix_len.store(p.len(), Ordering::Release);
        }
        if !t.resend.is_empty() {
            send_all(fd, &t.resend);
        }
        if t.write_shut {
            let _ = crate::real::shutdown_fd(fd, libc::SHUT_WR);
        }
    }

    fn went_over(&self, why: &str) {
        // SYNC POINT: Release, pairs with the Acquire in `over` / `is_kernel_only`.
        self.kernel.store(true, Ordering::Release);
        // Wake whoever sleeps on the queue: they look again and find the kernel's socket.
        let _ = self.queue.post_user(0);
        crate::say(format_args!("a connection went over to the kernel: {why}"));
    }

    /// Give the connection up to the kernel's socket `fd` (a child shares it, `exec`, or it
    /// is passed on). True when the peer will take back bytes from our memory: keep this
    /// connection until [`Conn::taken`].
    pub fn hand_over(&self, fd: c_int, why: &str) -> bool {
        let _g = lock(&self.switching);
        if self.kernel.load(Ordering::Relaxed) {
            return false;
        }
        let keep = match self.stream.hand_over() {
            Ok(HandOver::Left { .. }) => {
                if self.write_shut.load(Ordering::Acquire) {
                    let _ = crate::real::shutdown_fd(fd, libc::SHUT_WR);
                }
                true
            }
            Ok(HandOver::PeerLeftFirst(t)) => {
                self.settle(fd, t);
                false
            }
            Ok(_) => false,
            Err(e) => {
                crate::say(format_args!("handing over failed ({e}): the kernel's socket as it is"));
                false
            }
        };
        self.went_over(why);
        keep
    }

    /// After [`Conn::hand_over`]: the peer has what it needed from our memory (or is gone).
    pub fn taken(&self) -> bool {
        self.stream.taken()
    }

    /// A read from what came over clan before going over, then from the kernel's socket.
    fn kernel_read(&self, fd: c_int, buf: &mut [u8], f: Flags) -> Result<usize, c_int> {
        let mut n = 0;
        if self.prefix_len.load(Ordering::Acquire) > 0 {
            let mut p = lock(&self.prefix);
            n = p.len().min(buf.len());
            for (d, s) in buf[..n].iter_mut().zip(p.iter()) {
                *d = *s;
            }
            if !f.peek {
                p.drain(..n);
                self.prefix_len.store(p.len(), Ordering::Release);
            }
        }
        if n > 0 && (n == buf.len() || f.peek || !f.waitall) {
            return Ok(n);
        }
        match crate::real::recv_into(fd, &mut buf[n..], msg_flags(f)) {
            Ok(k) => Ok(n + k),
            Err(_) if n > 0 => Ok(n),
            Err(e) => Err(e),
        }
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

    /// The connection's readiness for a wait on `fd`; None when the kernel's socket is the
    /// whole story now (the caller waits on it as on any other, [`crate::ready::retire`]).
    pub fn state(&self, fd: c_int) -> Option<Readiness> {
        if !self.over(fd) {
            if self.awaiting() {
                return Some(Readiness::default());
            }
            return Some(self.stream.readiness());
        }
        if self.prefix_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut p = [libc::pollfd { fd, events: libc::POLLOUT, revents: 0 }];
        let writable = crate::real::poll_fds(&mut p, 0).is_ok_and(|n| n > 0 && p[0].revents & libc::POLLOUT != 0);
        Some(Readiness { readable: true, writable, ..Readiness::default() })
    }

    /// Arm the tripwires a waiter for reading and/or writing needs (once-only: they fire
    /// once, posting to `queue`). False if the connection is broken (nothing to wait for).
    pub fn arm(&self, read: bool, write: bool) -> bool {
        (!read || self.data.arm().is_ok()) && (!write || self.space.arm().is_ok())
    }

    /// Take every event the connection's queue holds (they only wake; readiness is read
    /// from the stream itself). The epoll sets it is in look at it at their next wait: the
    /// wake-up taken here may have been theirs.
    pub fn drain(&self) {
        self.drain_quiet();
        if self.epolled.load(Ordering::Relaxed) {
            crate::ready::touch(self);
        }
    }

    /// [`Conn::drain`], for an epoll wait that looks at the connection anyway.
    pub fn drain_quiet(&self) {
        while self.queue.try_take().is_some() {}
    }

    /// Wait until a read (or a write) would not block: spin a little, then arm the
    /// tripwire and sleep in the kernel on the connection's queue. `EINTR` when a signal
    /// with a handler installed without `SA_RESTART` interrupted the sleep; `EAGAIN` when the
    /// socket's `SO_RCVTIMEO` / `SO_SNDTIMEO` (set on the kernel socket `fd`) passed.
    fn block(&self, fd: c_int, read: bool, since: Instant) -> Result<(), c_int> {
        // Going over to the kernel counts as ready: the caller looks again.
        let ready = |r: Readiness| {
            (if read { r.readable } else { r.writable })
                || self.kernel.load(Ordering::Relaxed)
                || self.stream.peer_left()
        };
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

    /// Wait (a blocking call, the caller having just looked) until the claim's answer has
    /// come: sleeps on its channel, without spinning (it comes from another process's
    /// sleeping thread, and a spin takes the CPU that thread needs) or arming anything (one
    /// system call to sleep, one to read it). `EINTR` and `EAGAIN` as [`Conn::block`]'s.
    fn await_answer(&self, fd: c_int, read: bool, since: Instant) -> Result<(), c_int> {
        let limit = crate::real::with_fd(fd, |b| {
            let dir = if read { rustix::net::sockopt::Timeout::Recv } else { rustix::net::sockopt::Timeout::Send };
            rustix::net::sockopt::socket_timeout(b, dir).ok().flatten()
        });
        loop {
            let Some(chan) = self.claim_fd() else { return Ok(()) };
            // (10 ms at most: another thread may read the answer first, and the channel then
            // stays quiet; a number it closed meanwhile only wakes this early)
            let mut ms = 10;
            if let Some(l) = limit {
                let left = l.saturating_sub(since.elapsed());
                if left.is_zero() {
                    return Err(libc::EAGAIN);
                }
                ms = left.as_millis().clamp(1, 10) as c_int;
            }
            let mut p = [libc::pollfd { fd: chan, events: libc::POLLIN, revents: 0 }];
            match crate::real::poll_fds(&mut p, ms) {
                Ok(_) => {}
                Err(libc::EINTR) if crate::real::any_handler_without_restart() => return Err(libc::EINTR),
                Err(libc::EINTR) => {}
                Err(e) => return Err(e),
            }
            if self.settle_claim(false) {
                return Ok(());
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
            if self.over(fd) {
                if done > 0 {
                    return Ok(done);
                }
                let r = self.kernel_read(fd, buf, f);
                if self.is_kernel_only() {
                    crate::ready::retire(self);
                }
                return r;
            }
            if self.awaiting() {
                if nb {
                    return Err(libc::EAGAIN);
                }
                self.await_answer(fd, true, since)?;
                continue;
            }
            let r = if f.peek { self.stream.peek(&mut buf[done..]) } else { (&self.stream).read(&mut buf[done..]) };
            match r {
                Ok(0) if f.peek && !self.readiness().eof && !self.readiness().error => {}
                Ok(0) => return Ok(done),
                Ok(n) => {
                    done += n;
                    if !f.peek && !self.read_last.load(Ordering::Relaxed) {
                        self.read_last.store(true, Ordering::Relaxed);
                    }
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
            if self.over(fd) {
                if done > 0 {
                    return Ok(done);
                }
                let r = crate::real::send_from(fd, buf, msg_flags(f));
                if self.is_kernel_only() {
                    crate::ready::retire(self);
                }
                return r;
            }
            if self.awaiting() {
                if nb {
                    return Err(libc::EAGAIN);
                }
                self.await_answer(fd, false, since)?;
                continue;
            }
            match (&self.stream).write(&buf[done..]) {
                Ok(n) => {
                    done += n;
                    self.count_write(n);
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

    /// `n` bytes written over clan: a turn if a read came before (`short.rs`).
    fn count_write(&self, n: usize) {
        if n == 0 {
            return;
        }
        if self.read_last.load(Ordering::Relaxed) {
            self.read_last.store(false, Ordering::Relaxed);
            self.turns.store(self.turns.load(Ordering::Relaxed).saturating_add(1), Ordering::Relaxed);
        }
        let w = self.written.load(Ordering::Relaxed);
        self.written.store(w.saturating_add(n as u64), Ordering::Relaxed);
    }

    pub fn shutdown(&self, fd: c_int, how: c_int) -> Result<(), c_int> {
        // (the end-of-stream mark goes where the bytes go: known once the claim's answer
        // came, waited for here, as a blocking write would)
        while !self.over(fd) && self.awaiting() {
            self.await_answer(fd, false, Instant::now())?;
        }
        if self.over(fd) {
            return crate::real::shutdown_fd(fd, how);
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.write_shut.store(true, Ordering::Release);
        }
        let how = match how {
            libc::SHUT_RD => Shutdown::Read,
            libc::SHUT_WR => Shutdown::Write,
            libc::SHUT_RDWR => Shutdown::Both,
            _ => return Err(libc::EINVAL),
        };
        // As the kernel's: shutting down a connected socket succeeds, also when writing was
        // shut down already or the peer has gone meanwhile (the end-of-stream mark then has
        // nowhere to go, and the next write says EPIPE).
        if let Err(e) = self.stream.shutdown(how) {
            crate::say(format_args!("shutdown: the end-of-stream mark did not reach the peer ({e})"));
        }
        Ok(())
    }

    pub fn available(&self, fd: c_int) -> usize {
        if self.over(fd) {
            return self.prefix_len.load(Ordering::Acquire) + crate::real::fionread(fd);
        }
        if self.awaiting() {
            return 0;
        }
        self.stream.available().unwrap_or(0) as usize
    }
}
