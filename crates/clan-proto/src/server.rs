//! The event-driven server of the Tripwire paper (§5.3): one thread, an epoll loop in which a
//! clan event queue is one file descriptor among others, a callback per endpoint, and the
//! paper's policy for the queue: when its descriptor is readable, drain it, then keep polling
//! it for a while ([`EventLoop::new`]'s `poll_for`, 15 µs in the paper) before going back to
//! `epoll_wait` — a busy server never sleeps, an idle one costs nothing.
//!
//! ```no_run
//! // Not run as a test: the loop at the end serves forever (the runnable version, which
//! // stops after one call, is at `EventLoop`).
//! use clan::{Nic, NicConfig};
//! use clan_proto::rpc::{RpcConfig, RpcServer};
//! use clan_proto::server::EventLoop;
//! # fn main() -> std::io::Result<()> {
//! let nic = Nic::open(NicConfig::default()).map_err(std::io::Error::other)?;
//! let mut rpc = RpcServer::bind(&nic, RpcConfig::default(), 1024).map_err(std::io::Error::other)?;
//! let mut el = EventLoop::new(std::time::Duration::from_micros(15))?;
//! let q = rpc.event_queue().clone();
//! el.add_queue(&q, move |ev| {
//!     let _ = rpc.handle_event(ev, &mut |_conn, req, reply| {
//!         let _ = reply.write(&req.to_vec()); // echo, written straight into the client
//!     });
//! })?;
//! // ... and other descriptors: el.add_source(&mut listener, mio::Interest::READABLE, |ev| { ... })
//! loop {
//!     el.run_once(None)?;
//! }
//! # }
//! ```

use std::collections::HashMap;
use std::io;
use std::time::{Duration, Instant};

use clan::{Event, EventQueue};
use mio::{Events, Interest, Poll, Token};

/// Empty polls between two drives of the links (`LinkSpin::drive`: a receive call each when
/// links are open) in the polling loops here and in `crate::rpc`.
pub(crate) const LINK_EVERY: u32 = 8;

/// A spinning poll of drained queues reads the clock (for its time limit) once every this
/// many empty polls, and at the first.
pub(crate) const CLOCK_EVERY: u32 = 32;

type QueueHandler = Box<dyn FnMut(Event)>;
type FdHandler = Box<dyn FnMut(&mio::event::Event)>;

/// One thread's loop over clan event queues and other file descriptors.
///
/// Neither `Send` nor `Sync`: its callbacks may capture anything (an `Rc`, a `RefCell`) and
/// run on the thread that drives it. Make one per thread.
///
/// An RPC server driven by the loop, with a client on another thread:
///
/// ```
/// use std::{cell::Cell, rc::Rc, time::{Duration, Instant}};
/// use clan_proto::{rpc::{RpcClient, RpcConfig, RpcServer}, server::EventLoop};
///
/// let nic = clan::Nic::open_default()?;
/// let mut rpc = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
/// let (addr, n2) = (rpc.local_addr(), nic.clone());
/// let served = Rc::new(Cell::new(0)); // callbacks may hold an `Rc`: the loop stays here
/// let s2 = served.clone();
/// let mut el = EventLoop::new(Duration::from_micros(15))?;
/// el.add_queue(&rpc.event_queue().clone(), move |ev| {
///     let answered = rpc.handle_event(ev, &mut |_conn, req, reply| {
///         let _ = reply.write(&req.to_vec()); // echo
///     });
///     s2.set(s2.get() + answered.unwrap_or(0));
/// })?;
/// let client = std::thread::spawn(move || -> Result<Vec<u8>, clan_proto::rpc::RpcError> {
///     let (mut c, mut reply) = (RpcClient::connect(&n2, addr, &RpcConfig::default())?, Vec::new());
///     c.call(b"echo", &mut reply, Some(Duration::from_secs(5)))?;
///     Ok(reply)
/// });
/// let deadline = Instant::now() + Duration::from_secs(5);
/// while served.get() == 0 && Instant::now() < deadline {
///     el.run_once(Some(Duration::from_millis(10)))?;
/// }
/// assert_eq!(client.join().unwrap()?, b"echo");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct EventLoop {
    poll: Poll,
    events: Events,
    next: usize,
    queues: HashMap<Token, (EventQueue, QueueHandler)>,
    fds: HashMap<Token, FdHandler>,
    poll_for: Duration,
}

impl std::fmt::Debug for EventLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoop").field("queues", &self.queues.len()).field("fds", &self.fds.len()).finish()
    }
}

impl EventLoop {
    /// A loop that polls a drained queue for `poll_for` before sleeping.
    pub fn new(poll_for: Duration) -> io::Result<EventLoop> {
        Ok(EventLoop {
            poll: Poll::new()?,
            events: Events::with_capacity(1024),
            next: 1,
            queues: HashMap::new(),
            fds: HashMap::new(),
            poll_for,
        })
    }

    /// Serve a clan event queue: `handler` gets each of its events (dispatch by
    /// `Event::…::endpoint` or cookie for a callback per endpoint).
    pub fn add_queue(&mut self, q: &EventQueue, handler: impl FnMut(Event) + 'static) -> io::Result<Token> {
        let t = Token(self.next);
        self.next += 1;
        let mut q2 = q.clone();
        self.poll.registry().register(&mut q2, t, Interest::READABLE)?;
        self.queues.insert(t, (q2, Box::new(handler)));
        Ok(t)
    }

    /// Watch another descriptor (a TCP listener, a timer, a pipe…).
    ///
    /// ```
    /// use std::io::Write;
    /// use std::{cell::Cell, rc::Rc, time::Duration};
    ///
    /// let mut el = clan_proto::server::EventLoop::new(Duration::ZERO)?;
    /// let (mut a, mut b) = mio::net::UnixStream::pair()?;
    /// let readable = Rc::new(Cell::new(false));
    /// let r2 = readable.clone();
    /// el.add_source(&mut a, mio::Interest::READABLE, move |ev| r2.set(ev.is_readable()))?;
    /// b.write_all(b"x")?;
    /// el.run_once(Some(Duration::from_secs(5)))?;
    /// assert!(readable.get());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn add_source<S: mio::event::Source + ?Sized>(
        &mut self,
        src: &mut S,
        interest: Interest,
        handler: impl FnMut(&mio::event::Event) + 'static,
    ) -> io::Result<Token> {
        let t = Token(self.next);
        self.next += 1;
        self.poll.registry().register(src, t, interest)?;
        self.fds.insert(t, Box::new(handler));
        Ok(t)
    }

    /// Drain every queue, then poll them for `poll_for` after the last event; returns the
    /// events handled.
    fn serve_queues(&mut self) -> usize {
        let mut n = 0;
        // When the queues were first found drained since the last event (the clock is read
        // only then, not per round that handled events).
        let mut idle_since = None;
        // Empty polls in a row: the clock is read at the first and then every
        // `CLOCK_EVERY`th (a clock read costs more than a poll, and every poll of a drained
        // queue delays the next event by its length).
        let mut empty = 0u32;
        loop {
            let mut got = false;
            for (q, h) in self.queues.values_mut() {
                while let Some(ev) = q.try_take() {
                    h(ev);
                    n += 1;
                    got = true;
                }
            }
            if got {
                idle_since = None;
                empty = 0;
                continue;
            }
            if empty % CLOCK_EVERY == 0 && idle_since.get_or_insert_with(Instant::now).elapsed() >= self.poll_for {
                return n;
            }
            empty = empty.wrapping_add(1);
            std::hint::spin_loop();
            // While polling, what comes from other hosts is applied by this thread (every
            // `LINK_EVERY`th empty poll), not left to the engine thread of the first queue's
            // NIC (the NIC of nearly every loop), which would take this thread's CPU for it.
            // The spin is begun and ended at once: one held across the handlers would keep
            // the engine away from the links while a handler runs.
            if empty % LINK_EVERY == 0 {
                if let Some((q, _)) = self.queues.values().next() {
                    q.spin_links().drive();
                }
            }
        }
    }

    /// One round: sleep in `epoll_wait` (at most `timeout`) unless a queue has events, run
    /// the handlers of what is ready, drain and poll the queues. Returns the clan events
    /// handled.
    pub fn run_once(&mut self, timeout: Option<Duration>) -> io::Result<usize> {
        // Arm every queue's descriptor; one with events pending means no sleeping.
        let mut pending = false;
        for (q, _) in self.queues.values() {
            if !q.arm() {
                pending = true;
            }
        }
        let t = if pending { Some(Duration::ZERO) } else { timeout };
        match self.poll.poll(&mut self.events, t) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        let ready: Vec<mio::event::Event> = self.events.iter().cloned().collect();
        for ev in &ready {
            if let Some(h) = self.fds.get_mut(&ev.token()) {
                h(ev);
            }
        }
        Ok(self.serve_queues())
    }
}
