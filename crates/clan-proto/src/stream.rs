//! Stream sockets (VMMC NT paper §4.1), shaped like `std::net`: a [`Listener`] bound to an
//! endpoint accepts [`Stream`]s; a `Stream` is a connection-oriented, bidirectional byte
//! stream with `std::io::Read` and `Write`, non-blocking mode, timeouts, shutdown, end of
//! stream when the peer closes and an error (never a hang) when it dies.
//!
//! Underneath, each direction is a distributed queue of unstructured bytes (`crate::pipe`):
//! the writer's CPU copies the bytes straight into the reader's ring (one copy within a
//! host; a write burst across hosts), and the reader copies them out — or lends them in place
//! ([`Stream::read_in_place`]), or has them placed directly into a buffer it posted before
//! they arrived (transfer redirection: [`Stream::post_recv`], [`Stream::recv_posted`]).
//!
//! Each stream has an endpoint of its own; accepting makes one per connection. `Stream` is
//! `Send` and `Sync` (reads and writes of one stream may run on two threads at once;
//! `Read` and `Write` are implemented for `&Stream` too); [`Stream::try_clone`] gives
//! another handle.

use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use clan::{ConnectError, Connection, Endpoint, EndpointAddr, EventQueue, Nic, ToEndpointAddrs};

use crate::inplace::InPlace;
use crate::lock;
use crate::pipe::{PipeError, PipeRx, PipeTx, Redirection};
pub use crate::side::MAX_CONNECT_DATA;
use crate::side::{self, SetupError};

/// How streams are made.
///
/// ```
/// use std::io::{Read, Write};
/// use std::time::Duration;
/// use clan_proto::stream::{Listener, Stream, StreamConfig};
///
/// // Small rings for many connections; no posted receives; sleep at once when blocked.
/// let cfg = StreamConfig { ring: 16 << 10, post_area: 0, spin: Duration::ZERO, ..StreamConfig::default() };
/// let nic = clan::Nic::open_default()?;
/// let listener = Listener::bind_with(&nic, None, cfg.clone())?;
/// let (addr, n2, c2) = (listener.local_addr(), nic.clone(), cfg.clone());
/// let connecting = std::thread::spawn(move || Stream::connect_with(&n2, addr, &c2));
/// let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// let mut client = connecting.join().unwrap()?;
/// let data = vec![7u8; 100_000]; // larger than the ring: the writer waits for the reader
/// let writer = std::thread::spawn(move || client.write_all(&data));
/// let mut got = vec![0u8; 100_000];
/// server.read_exact(&mut got)?;
/// writer.join().unwrap()?;
/// assert!(got.iter().all(|&b| b == 7));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Bytes of the ring each side receives into (the stream's buffering, per direction).
    /// The default, 1 MiB, streams at full speed (`clan bench stream --ring`: a 256 KiB ring
    /// gave two thirds of the bandwidth); lower it for thousands of connections.
    pub ring: u64,
    /// Bytes of the area posted receives are redirected into (0: no redirection).
    pub post_area: u64,
    /// How long a blocked read or write polls memory before it sleeps.
    /// Default: [`clan::default_spin`] (`CLAN_SPIN_US`, else 15 µs); zero: sleep at once,
    /// nothing polls.
    pub spin: Duration,
    /// Bound on connecting.
    pub connect_timeout: Duration,
    /// Give each stream (and the listener) an event queue of its own: a small one (64
    /// events, 64 tripwires), one more file descriptor each. A stream or listener with its
    /// own queue can be registered with mio (`mio::event::Source`). Off by default: streams
    /// report to their NIC's default queue.
    pub own_queue: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            ring: 1 << 20,
            post_area: 64 << 10,
            spin: clan::default_spin(),
            connect_timeout: Duration::from_secs(10),
            own_queue: false,
        }
    }
}

fn setup_error(e: SetupError) -> io::Error {
    e.into()
}

/// A read from `rx` (locked, or reached through the only handle): the bytes there, else the
/// end, else a wait for either (until the read timeout, or the connection's end). `None`:
/// the stream is non-blocking and nothing is there.
fn read_loop(
    rx: &mut PipeRx,
    buf: &mut [u8],
    conn: &Connection,
    nonblocking: &AtomicBool,
    read_timeout: &AtomicU64,
) -> io::Result<Option<usize>> {
    let mut deadline = None;
    loop {
        let n = rx.try_read(buf).map_err(pipe_error)?;
        if n > 0 {
            return Ok(Some(n));
        }
        if rx.at_end().map_err(pipe_error)? {
            return Ok(Some(0));
        }
        if !conn.is_alive() {
            return Err(pipe_error(PipeError::Dead));
        }
        if nonblocking.load(Ordering::Acquire) {
            if rx.drive_links() {
                // Bytes came over a link: look again.
                continue;
            }
            return Ok(None);
        }
        // (computed when it first has to wait: a read that finds its bytes at once never
        // reads the clock)
        let deadline = *deadline.get_or_insert_with(|| deadline_of(read_timeout));
        rx.wait_data(deadline, &mut || !conn.is_alive()).map_err(pipe_error)?;
    }
}

/// The deadline of a call starting now under timeout `t` (nanoseconds; 0: none).
fn deadline_of(t: &AtomicU64) -> Option<Instant> {
    match t.load(Ordering::Acquire) {
        0 => None,
        n => Some(Instant::now() + Duration::from_nanos(n)),
    }
}

/// A write into `tx` (locked, or the only handle's own) of what fits of `data` (at least a
/// byte, waiting for room), or of all of it (`all`; the write timeout counts from the last
/// progress). `None`: the stream is non-blocking and there is no room (for `all`, after
/// what was written: as `std`'s `write_all`, a `WouldBlock` does not say how much).
fn write_loop(
    tx: &mut PipeTx,
    mut data: &[u8],
    all: bool,
    conn: &Connection,
    nonblocking: &AtomicBool,
    write_timeout: &AtomicU64,
) -> io::Result<Option<usize>> {
    let mut deadline = None;
    let mut done = 0;
    loop {
        if !conn.is_alive() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the peer went away"));
        }
        let n = tx.try_write(data).map_err(write_error)?;
        if n > 0 {
            done += n;
            data = &data[n..];
            if !all || data.is_empty() {
                return Ok(Some(done));
            }
            deadline = None;
            continue;
        }
        if nonblocking.load(Ordering::Acquire) {
            return Ok(None);
        }
        // (computed when it first has to wait: a write that finds room never reads the clock)
        let deadline = *deadline.get_or_insert_with(|| deadline_of(write_timeout));
        tx.wait_space(deadline, &mut || !conn.is_alive()).map_err(pipe_error)?;
    }
}

/// The sending side is not where it should be (never: it is the only handle's, or shared).
fn tx_gone() -> io::Error {
    io::Error::other("the stream's sending side is gone")
}

fn rx_gone() -> io::Error {
    io::Error::other("the stream's receiving side is gone")
}

/// One side of a stream (`own`: the only handle's; `shared`: where every handle reaches it
/// once `moved`), shared for good: moved there first if it is still the handle's own.
fn shared<'a, T>(
    own: &Mutex<Option<T>>,
    shared: &'a Mutex<Option<T>>,
    moved: &AtomicBool,
) -> MutexGuard<'a, Option<T>> {
    // Acquire: pairs with the Release store below; the move (under the locks) is then seen
    // too, and `own` is not looked at again.
    if !moved.load(Ordering::Acquire) {
        let mut own = lock(own);
        if let Some(side) = own.take() {
            *lock(shared) = Some(side);
            // Release: pairs with the Acquire load above (another handle's).
            moved.store(true, Ordering::Release);
        }
    }
    lock(shared)
}

/// `f` on one side of a stream wherever it is ([`shared`]'s arguments), for a moment: the
/// only handle's own stays its own.
fn briefly<T, R>(
    own: &Mutex<Option<T>>,
    shared: &Mutex<Option<T>>,
    moved: &AtomicBool,
    f: impl FnOnce(&mut T) -> R,
) -> Option<R> {
    // Acquire: pairs with the Release store in `shared`.
    if !moved.load(Ordering::Acquire) {
        if let Some(side) = lock(own).as_mut() {
            return Some(f(side));
        }
    }
    lock(shared).as_mut().map(f)
}

/// A failed write: an access refused (revoked, disconnected) is the peer's close.
fn write_error(e: PipeError) -> io::Error {
    match e {
        PipeError::Access(_) => io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the connection"),
        other => pipe_error(other),
    }
}

pub(crate) fn pipe_error(e: PipeError) -> io::Error {
    match e {
        PipeError::Protocol(why) => {
            io::Error::new(io::ErrorKind::InvalidData, format!("protocol violation by the peer: {why}"))
        }
        PipeError::Access(clan::AccessError::Revoked) => {
            io::Error::new(io::ErrorKind::ConnectionReset, "the peer closed its end of the connection")
        }
        PipeError::Access(clan::AccessError::Disconnected) => {
            io::Error::new(io::ErrorKind::ConnectionReset, "the peer went away (its process, NIC or link)")
        }
        PipeError::Access(a) => a.into(),
        PipeError::Dead => io::Error::new(io::ErrorKind::ConnectionReset, "the peer went away"),
        PipeError::Timeout => io::Error::new(io::ErrorKind::TimedOut, "timed out"),
        PipeError::Shutdown => io::Error::new(io::ErrorKind::BrokenPipe, "the stream was shut down for writing"),
    }
}

/// A listening endpoint.
///
/// ```
/// use std::io::{Read, Write};
/// use std::time::Duration;
/// use clan_proto::stream::{Listener, Stream};
///
/// let nic = clan::Nic::open_default()?;
/// let listener = Listener::bind(&nic)?;
/// let addr = listener.local_addr(); // "ip:port/endpoint": give it to clients
/// let (n2, text) = (nic.clone(), addr.to_string());
/// let client = std::thread::spawn(move || -> std::io::Result<()> {
///     let mut s = Stream::connect(&n2, text.as_str())?; // any `ToEndpointAddrs`
///     s.write_all(b"ping")
/// });
/// let (mut stream, from) = listener.accept_timeout(Duration::from_secs(5))?;
/// assert_eq!(from, stream.peer_addr());
/// let mut got = [0u8; 4];
/// stream.read_exact(&mut got)?;
/// assert_eq!(&got, b"ping");
/// client.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Listener {
    nic: Nic,
    ep: Endpoint,
    cfg: StreamConfig,
    /// The queue the listening endpoint reports to, when not the NIC's default one.
    queue: Option<EventQueue>,
    /// Whether accepted streams report to `queue` too (else: each to its own, with
    /// `cfg.own_queue`, or to the NIC's default queue).
    share_queue: bool,
    nonblocking: AtomicBool,
    /// A request found by a readiness check (mio), for the next accept.
    stash: Mutex<Option<clan::ConnectRequest>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &format_args!("{}", self.ep.addr()))
            .field("nonblocking", &self.nonblocking.load(Ordering::Relaxed))
            .finish()
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inner;
        f.debug_struct("Stream")
            .field("local", &format_args!("{}", i.local))
            .field("peer", &format_args!("{}", i.peer))
            .field("alive", &i.alive())
            .field("nonblocking", &i.nonblocking.load(Ordering::Relaxed))
            .finish()
    }
}

impl Listener {
    /// Listen on a new endpoint of `nic` (a free port).
    pub fn bind(nic: &Nic) -> io::Result<Listener> {
        Listener::bind_with(nic, None, StreamConfig::default())
    }

    /// Listen on port `port` (None: a free one) with `cfg` for the streams accepted.
    pub fn bind_with(nic: &Nic, port: Option<u32>, cfg: StreamConfig) -> io::Result<Listener> {
        Listener::bind_on(nic, port, cfg, None)
    }

    pub(crate) fn bind_on(
        nic: &Nic,
        port: Option<u32>,
        cfg: StreamConfig,
        queue: Option<EventQueue>,
    ) -> io::Result<Listener> {
        let share_queue = queue.is_some();
        let queue = match queue {
            Some(q) => Some(q),
            None if cfg.own_queue => Some(own_queue(nic)?),
            None => None,
        };
        let ep = nic
            .endpoint_with(clan::EndpointConfig { port, queue: queue.clone(), ..clan::EndpointConfig::default() })
            .map_err(|e| match e {
                clan::EndpointError::PortInUse(_) => io::Error::new(io::ErrorKind::AddrInUse, e.to_string()),
                other => io::Error::other(other),
            })?;
        ep.listen();
        Ok(Listener {
            nic: nic.clone(),
            ep,
            cfg,
            queue,
            share_queue,
            nonblocking: AtomicBool::new(false),
            stash: Mutex::new(None),
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> EndpointAddr {
        self.ep.addr()
    }

    /// The listening endpoint (its event queue reports connection requests as OOB events).
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// Accept the next connection (blocking unless non-blocking mode is on). As with TCP, a
    /// client that gives up, dies or misbehaves during the hand-shake is never reported
    /// here: its request is dropped and the next one taken. Errors are this side's own
    /// (the listener closed, out of memory or descriptors).
    pub fn accept(&self) -> io::Result<(Stream, EndpointAddr)> {
        loop {
            let stashed = lock(&self.stash).take();
            let req = if let Some(r) = stashed {
                r
            } else if self.nonblocking.load(Ordering::Acquire) {
                match self.ep.try_accept() {
                    Some(r) => r,
                    None => {
                        self.mio_rearm();
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "no connection pending"));
                    }
                }
            } else {
                self.ep.accept(None).map_err(|e| setup_error(e.into()))?
            };
            if let Some(r) = self.finish(req)? {
                return Ok(r);
            }
        }
    }

    /// Accept with a time limit (`TimedOut` when none came in time).
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let listener = clan_proto::stream::Listener::bind(&nic)?;
    /// let e = listener.accept_timeout(Duration::from_millis(5)).unwrap_err();
    /// assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn accept_timeout(&self, timeout: Duration) -> io::Result<(Stream, EndpointAddr)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let req = self.ep.accept(Some(left)).map_err(|e| match e {
                ConnectError::NoRequest => io::Error::new(io::ErrorKind::TimedOut, "no connection within the timeout"),
                other => setup_error(other.into()),
            })?;
            if let Some(r) = self.finish(req)? {
                return Ok(r);
            }
        }
    }

    /// Accept the next connection (blocking, at most `timeout`), its stream's endpoint
    /// reporting to `queue` (its readiness tripwires post there: one queue per stream lets
    /// one waiter sleep on exactly the streams it waits for).
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan_proto::stream::{Listener, Stream, StreamConfig};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (mine, theirs) = (nic.event_queue(Default::default())?, nic.event_queue(Default::default())?);
    /// let listener = Listener::bind(&nic)?;
    /// let (addr, n2, q2) = (listener.local_addr(), nic.clone(), theirs.clone());
    /// let connecting = std::thread::spawn(move || Stream::connect_to(&n2, addr, &StreamConfig::default(), &q2));
    /// let (server, _) = listener.accept_to(&mine, Duration::from_secs(5))?;
    /// let client = connecting.join().unwrap()?;
    /// assert_eq!(server.endpoint().event_queue().id(), mine.id());
    /// assert_eq!(client.endpoint().event_queue().id(), theirs.id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn accept_to(&self, queue: &EventQueue, timeout: Duration) -> io::Result<(Stream, EndpointAddr)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let req = self.ep.accept(Some(left)).map_err(|e| match e {
                ConnectError::NoRequest => io::Error::new(io::ErrorKind::TimedOut, "no connection within the timeout"),
                other => setup_error(other.into()),
            })?;
            if let Some(r) = self.finish_on(req, Some(queue))? {
                return Ok(r);
            }
        }
    }

    /// Set up the stream of `req`: None if the request is the client's fault (dropped).
    fn finish(&self, req: clan::ConnectRequest) -> io::Result<Option<(Stream, EndpointAddr)>> {
        if self.share_queue { self.finish_on(req, self.queue.as_ref()) } else { self.finish_on(req, None) }
    }

    fn finish_on(
        &self,
        req: clan::ConnectRequest,
        queue: Option<&EventQueue>,
    ) -> io::Result<Option<(Stream, EndpointAddr)>> {
        let from = req.from();
        let g = side::Geometry::bytes(self.cfg.ring, self.cfg.post_area);
        let own = match queue {
            None if self.cfg.own_queue => Some(own_queue(&self.nic)?),
            _ => None,
        };
        let queue = queue.or(own.as_ref());
        match side::accept(&self.nic, queue, req, g, self.cfg.connect_timeout) {
            Ok(s) => Ok(Some((Stream::from_sides(s, &self.cfg, queue.cloned()).map_err(pipe_error)?, from))),
            Err(e) if side::client_failed(&e) => {
                tracing::debug!(peer = %from, "refused a connection: {e}");
                Ok(None)
            }
            Err(e) => Err(setup_error(e)),
        }
    }

    /// Make [`Listener::accept`] return `WouldBlock` instead of waiting.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let listener = clan_proto::stream::Listener::bind(&nic)?;
    /// listener.set_nonblocking(true)?;
    /// let e = listener.accept().unwrap_err();
    /// assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, Ordering::Release);
        Ok(())
    }

    /// After `accept` found nothing (mio): take what woke the queue, arm it, and look once
    /// more; a request that came meanwhile is kept for the next accept and makes the
    /// queue's descriptor readable, so the registration reports it (no wake-up is lost: a
    /// request arriving after the arm posts to the armed queue).
    fn mio_rearm(&self) {
        let Some(q) = self.queue.as_ref().filter(|_| !self.share_queue) else { return };
        while q.try_take().is_some() {}
        let empty = q.arm();
        if let Some(r) = self.ep.try_accept() {
            *lock(&self.stash) = Some(r);
            q.post_user(0);
        } else if !empty {
            q.post_user(0);
        }
    }

    /// Accepted streams, forever (an error is this side's own: see [`Listener::accept`]).
    ///
    /// ```
    /// use std::io::Write;
    /// use clan_proto::stream::{Listener, Stream};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let listener = Listener::bind(&nic)?;
    /// let (addr, n2) = (listener.local_addr(), nic.clone());
    /// let clients = std::thread::spawn(move || -> std::io::Result<()> {
    ///     for i in 0..3u8 {
    ///         Stream::connect(&n2, addr)?.write_all(&[i])?;
    ///     }
    ///     Ok(())
    /// });
    /// // Stops after three: `incoming` itself never ends.
    /// let served = listener.incoming().take(3).collect::<std::io::Result<Vec<Stream>>>()?;
    /// clients.join().unwrap()?;
    /// assert_eq!(served.len(), 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<Stream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }
}

#[derive(Debug)]
struct Inner {
    // Field order: the pipes (and their mappings) go before the connection and endpoint.
    /// The sending side once shared (`Stream::own_tx` until then; `tx_moved` says which).
    tx: Mutex<Option<PipeTx>>,
    /// The receiving side once shared (`Stream::own_rx` until then; `rx_moved` says which).
    rx: Mutex<Option<PipeRx>>,
    conn: Connection,
    side: Arc<clan::Aperture>,
    ep: Arc<Endpoint>,
    local: EndpointAddr,
    peer: EndpointAddr,
    nonblocking: AtomicBool,
    read_shut: AtomicBool,
    /// Handed over or taken over ([`Stream::hand_over`], [`Stream::take_over`]): no more
    /// reads or writes.
    handed: AtomicBool,
    /// The sending side has moved from the only handle into `tx`.
    tx_moved: AtomicBool,
    /// The receiving side has moved from the only handle into `rx`.
    rx_moved: AtomicBool,
    /// Nanoseconds; 0: none.
    read_timeout: AtomicU64,
    write_timeout: AtomicU64,
    /// The queue the stream's endpoint reports to, when not the NIC's default one.
    queue: Option<EventQueue>,
    /// Registered with mio: what the registration waits for.
    mio: Mutex<Option<MioReg>>,
}

/// A stream's registration with mio: its readiness tripwires (once-only, posting to the
/// stream's own queue), the interests they serve, and which directions wait for an edge (a
/// read or write returned `WouldBlock` since their readiness was last reported).
#[derive(Debug)]
struct MioReg {
    data: clan::Tripwire,
    space: clan::Tripwire,
    interests: mio::Interest,
    want_read: bool,
    want_write: bool,
}

impl Inner {
    fn alive(&self) -> bool {
        self.conn.is_alive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // End of stream for the peer; then the fields drop, the connection last but the
        // endpoint (the peer's reads drain what is in its ring first).
        if let Some(tx) = self.tx.get_mut().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.finish();
        }
    }
}

/// A connected byte stream. See the module documentation.
///
/// `&Stream` reads and writes too, so threads may share one. A `write_all` is whole with
/// respect to other threads' writes of the same stream: theirs come before or after it,
/// never inside it (a `write` is whole only for the bytes it returns).
///
/// A stream with one handle, read and written through `&mut Stream`, does without the locks
/// that sharing needs: a small write then has one instruction that waits for this CPU's
/// earlier stores to reach its cache (the tripwire's fence) instead of three (README's
/// notes), and a read none. Its writes stay so until it is cloned or written through
/// `&Stream`; its reads until it is cloned or read through `&Stream` (or waits in one of
/// its `&self` methods: [`Stream::read_in_place`] and the like).
///
/// ```
/// use std::io::{Read, Write};
/// use std::net::Shutdown;
/// use std::time::Duration;
/// use clan_proto::stream::{Listener, Stream};
///
/// let nic = clan::Nic::open_default()?;
/// let listener = Listener::bind(&nic)?;
/// let addr = listener.local_addr();
/// let echo = std::thread::spawn(move || -> std::io::Result<()> {
///     let (mut s, _) = listener.accept_timeout(Duration::from_secs(5))?;
///     s.set_read_timeout(Some(Duration::from_secs(5)))?;
///     let mut all = Vec::new();
///     s.read_to_end(&mut all)?; // until the client shuts down writing
///     s.write_all(&all)
/// });
/// let mut c = Stream::connect(&nic, addr)?;
/// c.set_read_timeout(Some(Duration::from_secs(5)))?;
/// c.write_all(b"hello, ")?;
/// c.write_all(b"stream")?;
/// c.shutdown(Shutdown::Write)?;
/// let mut back = String::new();
/// c.read_to_string(&mut back)?; // the echo, then end of stream
/// assert_eq!(back, "hello, stream");
/// echo.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Stream {
    inner: Arc<Inner>,
    /// The sending side while this is the only handle and nothing has reached it through
    /// `&self`: written through `&mut self` with no lock and no atomic read-modify-write.
    /// Moved into `Inner::tx` for good at the first clone or write through `&Stream`
    /// ([`Stream::tx`]); `None` after.
    own_tx: Mutex<Option<PipeTx>>,
    /// The receiving side, likewise (`Inner::rx` once moved, [`Stream::rx`]).
    own_rx: Mutex<Option<PipeRx>>,
}

impl Clone for Stream {
    fn clone(&self) -> Stream {
        // (both sides move to where every handle reaches them)
        drop(self.tx());
        drop(self.rx());
        Stream { inner: self.inner.clone(), own_tx: Mutex::new(None), own_rx: Mutex::new(None) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // The only handle's own sending side: end of stream for the peer (as `Inner`'s
        // drop does for the shared one), and gone before `Inner` (no clone exists: it goes
        // next), whose connection and endpoint outlive the pipes.
        if let Some(mut tx) = self.own_tx.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            let _ = tx.finish();
            drop(tx);
        }
        // (the receiving side too goes before `Inner`, as the shared one does in its drop)
        drop(self.own_rx.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take());
    }
}

impl Stream {
    /// Connect to the listener at `addr` with default settings. `addr` is anything that
    /// names endpoints ([`clan::ToEndpointAddrs`]): an [`EndpointAddr`], or text such as
    /// `"node7:7000/3"` whose host name is looked up; each address is tried in turn.
    pub fn connect(nic: &Nic, addr: impl ToEndpointAddrs) -> io::Result<Stream> {
        Stream::connect_with(nic, addr, &StreamConfig::default())
    }

    /// Connect with `cfg`.
    pub fn connect_with(nic: &Nic, addr: impl ToEndpointAddrs, cfg: &StreamConfig) -> io::Result<Stream> {
        Stream::connect_on(nic, addr, cfg, None)
    }

    /// Connect with `cfg`, the stream's endpoint reporting to `queue` (see
    /// [`Listener::accept_to`]).
    pub fn connect_to(
        nic: &Nic,
        addr: impl ToEndpointAddrs,
        cfg: &StreamConfig,
        queue: &EventQueue,
    ) -> io::Result<Stream> {
        Stream::connect_on(nic, addr, cfg, Some(queue))
    }

    /// [`Stream::connect_to`], with `data` for the accepting side to read before the stream
    /// carries a byte ([`Stream::peer_data`]; at most [`MAX_CONNECT_DATA`] bytes): a name, a
    /// ticket, what the server needs to know which stream this is, without waiting for it
    /// to be read.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan_proto::stream::{Listener, Stream, StreamConfig};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (mine, theirs) = (nic.event_queue(Default::default())?, nic.event_queue(Default::default())?);
    /// let listener = Listener::bind(&nic)?;
    /// let (addr, n2, q2) = (listener.local_addr(), nic.clone(), theirs.clone());
    /// let connecting = std::thread::spawn(move || {
    ///     Stream::connect_to_with_data(&n2, addr, &StreamConfig::default(), &q2, b"ticket 7")
    /// });
    /// let (server, _) = listener.accept_to(&mine, Duration::from_secs(5))?;
    /// assert_eq!(server.peer_data(), b"ticket 7");
    /// let client = connecting.join().unwrap()?;
    /// assert_eq!(client.peer_data(), b"", "the accepting side gives none");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn connect_to_with_data(
        nic: &Nic,
        addr: impl ToEndpointAddrs,
        cfg: &StreamConfig,
        queue: &EventQueue,
        data: &[u8],
    ) -> io::Result<Stream> {
        if data.len() > MAX_CONNECT_DATA {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} bytes of connect data: at most {MAX_CONNECT_DATA}", data.len()),
            ));
        }
        Stream::connect_on_with(nic, addr, cfg, Some(queue), data)
    }

    pub(crate) fn connect_on(
        nic: &Nic,
        addr: impl ToEndpointAddrs,
        cfg: &StreamConfig,
        queue: Option<&EventQueue>,
    ) -> io::Result<Stream> {
        Stream::connect_on_with(nic, addr, cfg, queue, &[])
    }

    fn connect_on_with(
        nic: &Nic,
        addr: impl ToEndpointAddrs,
        cfg: &StreamConfig,
        queue: Option<&EventQueue>,
        data: &[u8],
    ) -> io::Result<Stream> {
        let own = match queue {
            None if cfg.own_queue => Some(own_queue(nic)?),
            _ => None,
        };
        let queue = queue.or(own.as_ref());
        let g = side::Geometry::bytes(cfg.ring, cfg.post_area);
        let s = side::connect_with_data(nic, queue, addr, g, cfg.connect_timeout, data).map_err(setup_error)?;
        Stream::from_sides(s, cfg, queue.cloned()).map_err(pipe_error)
    }

    /// The data the connecting side gave with [`Stream::connect_to_with_data`] (empty if
    /// none, and always on the connecting side).
    pub fn peer_data(&self) -> &[u8] {
        side::user_data(self.inner.conn.peer_data())
    }

    fn from_sides(s: side::Sides, cfg: &StreamConfig, queue: Option<EventQueue>) -> Result<Stream, PipeError> {
        // (the two halves share our side)
        let mine = Arc::new(s.mine);
        let tx = PipeTx::new(mine.clone(), s.peer.clone(), s.peer_cap, s.peer_post_cap, cfg.spin)?;
        let rx = PipeRx::new(mine.clone(), s.peer.clone(), cfg.ring, cfg.post_area, cfg.spin)?;
        Ok(Stream {
            own_tx: Mutex::new(Some(tx)),
            own_rx: Mutex::new(Some(rx)),
            inner: Arc::new(Inner {
                tx: Mutex::new(None),
                tx_moved: AtomicBool::new(false),
                rx: Mutex::new(None),
                rx_moved: AtomicBool::new(false),
                local: s.ep.addr(),
                peer: s.conn.peer(),
                conn: s.conn,
                side: mine,
                ep: s.ep,
                nonblocking: AtomicBool::new(false),
                read_shut: AtomicBool::new(false),
                handed: AtomicBool::new(false),
                read_timeout: AtomicU64::new(0),
                write_timeout: AtomicU64::new(0),
                queue,
                mio: Mutex::new(None),
            }),
        })
    }

    /// Our endpoint's address.
    pub fn local_addr(&self) -> EndpointAddr {
        self.inner.local
    }

    /// The peer's endpoint address.
    pub fn peer_addr(&self) -> EndpointAddr {
        self.inner.peer
    }

    /// Who the peer is, as far as the NIC could prove it (for a server, its client's; for a client, the process that accepted): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.inner.conn.peer_identity()
    }

    /// Counters of the reading side: bytes read, sleeps waiting for data, early wake-ups
    /// given to the peer (see [`StreamStats`]).
    ///
    /// ```
    /// use std::io::{Read, Write};
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// client.write_all(b"ping")?;
    /// server.read_exact(&mut [0u8; 4])?;
    /// assert_eq!(server.stats().read, 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> StreamStats {
        let (read, read_sleeps, early_wakeups) = self.with_rx_briefly(|rx| rx.counts()).unwrap_or_default();
        StreamStats { read, read_sleeps, early_wakeups }
    }

    /// Our endpoint (its event queue; tripwires for event-driven use).
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.ep
    }

    /// Another handle on the same stream.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(self.clone())
    }

    /// Non-blocking mode: reads and writes that would wait return `WouldBlock`.
    ///
    /// ```
    /// use std::io::{ErrorKind, Read, Write};
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// server.set_nonblocking(true)?;
    /// let mut buf = [0u8; 8];
    /// assert_eq!(server.read(&mut buf).unwrap_err().kind(), ErrorKind::WouldBlock);
    /// client.write_all(b"now")?;
    /// assert_eq!(server.read(&mut buf)?, 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.inner.nonblocking.store(on, Ordering::Release);
        Ok(())
    }

    /// Bound blocking reads (`TimedOut` after it). `Some(0)` is invalid, as in `std`.
    ///
    /// ```
    /// use std::io::{ErrorKind, Read};
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// server.set_read_timeout(Some(Duration::from_millis(5)))?;
    /// assert_eq!(server.read(&mut [0u8; 8]).unwrap_err().kind(), ErrorKind::TimedOut);
    /// assert!(server.set_read_timeout(Some(Duration::ZERO)).is_err());
    /// # drop(client);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeout(&self.inner.read_timeout, t)
    }

    /// Bound blocking writes.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeout(&self.inner.write_timeout, t)
    }

    /// What a read and a write would do now, without waiting or consuming anything: for
    /// readiness (`poll`, `epoll`) on top of the stream. Arm the tripwires of
    /// [`Stream::readiness_tripwires`], look again, then wait on the queue.
    ///
    /// ```
    /// use std::io::Write;
    /// use std::net::Shutdown;
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// let r = server.readiness();
    /// assert!(!r.readable && r.writable && !r.eof && !r.error);
    /// client.write_all(b"x")?;
    /// client.shutdown(Shutdown::Write)?;
    /// let r = server.readiness();
    /// assert!(r.readable && !r.eof, "a byte to read before the end");
    /// assert_eq!(r.rx_landed, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn readiness(&self) -> Readiness {
        let mut r = Readiness::default();
        if !self.inner.alive() {
            r.error = true;
        }
        match self.with_rx_briefly(|rx| (rx.available(), rx.at_end(), rx.landed())) {
            Some((Ok(n), Ok(end), Ok(landed))) => {
                r.readable = n > 0 || end;
                r.eof = end;
                r.rx_landed = landed;
            }
            _ => r.error = true,
        }
        if self.inner.read_shut.load(Ordering::Acquire) {
            r.readable = true;
            r.eof = true;
        }
        match self.with_tx_briefly(|tx| if tx.is_finished() { Ok((true, 0)) } else { tx.poll_space() }) {
            Some(Ok((room, freed))) => {
                r.writable = room;
                r.tx_freed = freed;
            }
            Some(Err(_)) | None => r.error = true,
        }
        if r.error {
            // A read or a write returns an error at once.
            r.readable = true;
            r.writable = true;
        }
        r
    }

    /// Two once-only tripwires, disarmed, that post an event with the given cookie to the
    /// queue of the stream's endpoint: `data` when data (or end of stream) lands here,
    /// `space` when the peer frees room by reading. Arm one, look at
    /// [`Stream::readiness`] again, then wait on the queue: no wake-up is lost. A busy
    /// stream never touches them (they are armed only by a waiter).
    ///
    /// ```
    /// use std::io::Write;
    /// use std::time::{Duration, Instant};
    /// use clan::Event;
    /// use clan_proto::stream::{Listener, Stream, StreamConfig};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let cfg = StreamConfig { own_queue: true, ..StreamConfig::default() }; // a queue per stream
    /// let listener = Listener::bind_with(&nic, None, cfg.clone())?;
    /// let (addr, n2) = (listener.local_addr(), nic.clone());
    /// let connecting = std::thread::spawn(move || Stream::connect_with(&n2, addr, &cfg));
    /// let (server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// let mut client = connecting.join().unwrap()?;
    /// let (data, _space) = server.readiness_tripwires(1, 2)?;
    /// data.arm()?;
    /// assert!(!server.readiness().readable); // looked again after arming: now wait
    /// client.write_all(b"wake")?;
    /// let (q, deadline) = (server.endpoint().event_queue(), Instant::now() + Duration::from_secs(5));
    /// while !matches!(q.wait(Some(deadline - Instant::now()))?, Event::Tripwire { cookie: 1, .. }) {}
    /// assert!(server.readiness().readable);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn readiness_tripwires(
        &self,
        data_cookie: u64,
        space_cookie: u64,
    ) -> io::Result<(clan::Tripwire, clan::Tripwire)> {
        use crate::pipe::{CTL_READ, RX_FIN, RX_WRITE};
        let side = &self.inner.side;
        let tw = |range: std::ops::Range<u64>, cookie| {
            side.tripwire(
                clan::TripwireConfig::writes(range).once().disarmed().actions(clan::Actions::NONE).event(cookie),
            )
            .map_err(io::Error::other)
        };
        Ok((tw(RX_WRITE..RX_FIN + 8, data_cookie)?, tw(CTL_READ..CTL_READ + 8, space_cookie)?))
    }

    /// Copy up to `buf.len()` readable bytes into `buf` without consuming them and without
    /// waiting (`MSG_PEEK`): 0 when nothing is readable now.
    ///
    /// ```
    /// use std::io::{Read, Write};
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// assert_eq!(server.peek(&mut [0u8; 4])?, 0);
    /// client.write_all(b"GET /")?;
    /// let mut head = [0u8; 3];
    /// assert_eq!(server.peek(&mut head)?, 3);
    /// assert_eq!(&head, b"GET");
    /// assert_eq!(server.available()?, 5, "peeking consumed nothing");
    /// let mut all = [0u8; 5];
    /// server.read_exact(&mut all)?;
    /// assert_eq!(&all, b"GET /");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.with_rx_briefly(|rx| {
            let n = rx.available().map_err(pipe_error)?.min(buf.len() as u64) as usize;
            if n == 0 {
                return Ok(0);
            }
            rx.peek(0, &mut buf[..n]).map_err(pipe_error)
        })
        .unwrap_or_else(|| Err(rx_gone()))
    }

    /// Shut down reading, writing or both. Shutting down writing sends end of stream after
    /// the bytes already written.
    ///
    /// ```
    /// use std::io::{ErrorKind, Read, Write};
    /// use std::net::Shutdown;
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// client.write_all(b"last words")?;
    /// client.shutdown(Shutdown::Write)?;
    /// assert_eq!(client.write(b"more").unwrap_err().kind(), ErrorKind::BrokenPipe);
    /// let mut got = String::new();
    /// server.read_to_string(&mut got)?; // returns at the end of stream
    /// assert_eq!(got, "last words");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            self.with_tx_briefly(PipeTx::finish).ok_or_else(tx_gone)?.map_err(pipe_error)?;
        }
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.inner.read_shut.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Hand the stream over to another carrier of the same bytes (`clan run` uses this when
    /// a socket is shared with a child at `fork`, or passed on: the kernel's TCP
    /// connection under the stream carries them from then on). Writing ends here, as with
    /// [`Shutdown::Write`]; reading stops at once, and the peer learns at its next look
    /// ([`Stream::peer_left`]) where: it then takes back, with [`Stream::take_over`], what it
    /// wrote that we never read. Our side stays exported until it has
    /// ([`Stream::taken`]): keep this handle until then.
    ///
    /// If the peer had handed over first, we take over instead ([`HandOver::PeerLeftFirst`]).
    /// The two sides' checks are ordered like Dekker's (a store, a full fence, a load), so
    /// they never both miss each other; within a host, that is (a link gives no such order).
    ///
    /// ```
    /// use std::io::{ErrorKind, Read, Write};
    /// use clan_proto::stream::HandOver;
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// client.write_all(b"abc")?; // the server never reads it
    /// server.write_all(b"xyz")?; // the client never reads it
    /// let HandOver::Left { unread } = server.hand_over()? else { panic!("the server left first") };
    /// assert_eq!(unread, 3);
    /// assert!(client.peer_left());
    /// let t = client.take_over()?;
    /// assert_eq!((&t.resend[..], &t.unread[..]), (&b"abc"[..], &b"xyz"[..]));
    /// assert!(server.taken(), "the leaver may let go now");
    /// assert_eq!(server.read(&mut [0u8; 1]).unwrap_err().kind(), ErrorKind::NotConnected);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hand_over(&self) -> io::Result<HandOver> {
        let mut g = self.tx();
        let tx = g.as_mut().ok_or_else(tx_gone)?;
        if tx.peer_left().map_err(pipe_error)?.is_some() {
            drop(g);
            return self.take_over().map(HandOver::PeerLeftFirst);
        }
        let mut gr = self.rx();
        let rx = gr.as_mut().ok_or_else(rx_gone)?;
        let unread = rx.unread().map_err(pipe_error)?;
        rx.leave().map_err(pipe_error)?;
        drop(gr);
        // SeqCst: our CTL_LEFT store (above) against the peer's, each side loading the
        // other's after its own; pairs with the same fence in the peer's `hand_over`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if tx.peer_left().map_err(pipe_error)?.is_some() {
            // Both left: we saw the peer's, so we also take back what it will not read.
            drop(g);
            return self.take_over().map(HandOver::PeerLeftFirst);
        }
        tx.finish().map_err(pipe_error)?;
        self.inner.handed.store(true, Ordering::Release);
        Ok(HandOver::Left { unread })
    }

    /// Whether the peer has handed the stream over ([`Stream::hand_over`]): one load of our
    /// own memory. Then the stream must be taken over ([`Stream::take_over`]) before
    /// anything else is written.
    pub fn peer_left(&self) -> bool {
        self.inner.side.load_u64(crate::pipe::CTL_LEFT).is_ok_and(|v| v & crate::pipe::LEFT != 0)
    }

    /// The peer handed the stream over: take back from its memory what we wrote and it
    /// never read (to be sent again by the other carrier, before anything else), and take
    /// what it wrote and we have not read yet (all of it has landed: the peer wrote nothing
    /// after leaving). The stream is done after this.
    pub fn take_over(&self) -> io::Result<TakeOver> {
        let mut g = self.tx();
        let tx = g.as_mut().ok_or_else(tx_gone)?;
        let finished = tx.is_finished();
        let resend = tx.take_back().map_err(pipe_error)?;
        let mut gr = self.rx();
        let rx = gr.as_mut().ok_or_else(rx_gone)?;
        let mut unread = vec![0u8; rx.unread().map_err(pipe_error)? as usize];
        let mut got = 0;
        while got < unread.len() {
            match rx.try_read(&mut unread[got..]).map_err(pipe_error)? {
                0 => break,
                n => got += n,
            }
        }
        unread.truncate(got);
        self.inner.handed.store(true, Ordering::Release);
        Ok(TakeOver { resend, unread, write_shut: finished })
    }

    /// After [`Stream::hand_over`]: whether the peer has taken back what we left unread (the
    /// handle may then go), or can no longer (it is gone).
    pub fn taken(&self) -> bool {
        self.with_rx_briefly(|rx| rx.taken()).unwrap_or(false) || !self.inner.alive()
    }

    fn deadline(&self, t: &AtomicU64) -> Option<Instant> {
        deadline_of(t)
    }

    /// The deadline of a call that started at its first look, computed when it first has to
    /// wait (`slot` caches it): a call that finds its bytes or space at once never reads the
    /// clock.
    fn lazy_deadline(&self, t: &AtomicU64, slot: &mut Option<Option<Instant>>) -> Option<Instant> {
        *slot.get_or_insert_with(|| self.deadline(t))
    }

    /// Read what is there (waiting for at least one byte unless non-blocking). 0: end of
    /// stream.
    fn do_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if self.inner.handed.load(Ordering::Acquire) {
            return Err(handed());
        }
        if buf.is_empty() || self.inner.read_shut.load(Ordering::Acquire) {
            return Ok(0);
        }
        let mut g = self.rx();
        let rx = g.as_mut().ok_or_else(rx_gone)?;
        let i = &self.inner;
        match read_loop(rx, buf, &i.conn, &i.nonblocking, &i.read_timeout)? {
            Some(n) => Ok(n),
            None => {
                drop(g);
                self.mio_rearm(true, false);
                Err(io::ErrorKind::WouldBlock.into())
            }
        }
    }

    /// A write through the only handle on this stream (`&mut self`, nothing reached it
    /// through `&self`): its own sending side, with no lock and no atomic read-modify-write
    /// (each waits for this CPU's earlier stores to reach its cache, the last write's
    /// counter among them: as much as the copy of a small write), waits included. `None`
    /// when the sending side is shared, or the stream is handed over: the locked path
    /// ([`Stream::write_some`]) then does it all.
    #[inline]
    fn solo_write(&mut self, data: &[u8], all: bool) -> Option<io::Result<usize>> {
        let tx = self.own_tx.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut()?;
        let i = &self.inner;
        if data.is_empty() || i.handed.load(Ordering::Acquire) {
            return None;
        }
        // (not the locked path after a `WouldBlock`: part of `data` may be written)
        Some(match write_loop(tx, data, all, &i.conn, &i.nonblocking, &i.write_timeout) {
            Ok(Some(n)) => Ok(n),
            Ok(None) => {
                self.mio_rearm(false, true);
                Err(io::ErrorKind::WouldBlock.into())
            }
            Err(e) => Err(e),
        })
    }

    /// A read through the only handle on this stream, without the receiving side's lock
    /// (as [`Stream::solo_write`]), waiting as the locked path does; `None` when the handle
    /// is shared, or when a non-blocking read finds nothing: the locked path
    /// ([`Stream::do_read`]) then does it all (the `WouldBlock`, and the re-arm of mio's
    /// edge).
    #[inline]
    fn solo_read(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        let rx = self.own_rx.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut()?;
        let i = &self.inner;
        if buf.is_empty() || i.handed.load(Ordering::Acquire) || i.read_shut.load(Ordering::Acquire) {
            return None;
        }
        Some(match read_loop(rx, buf, &i.conn, &i.nonblocking, &i.read_timeout) {
            Ok(Some(n)) => Ok(n),
            Ok(None) => {
                // (here, not the locked path: that would share the side for good)
                self.mio_rearm(true, false);
                Err(io::ErrorKind::WouldBlock.into())
            }
            Err(e) => Err(e),
        })
    }

    fn do_write(&self, data: &[u8]) -> io::Result<usize> {
        self.write_some(data, false)
    }

    /// `write_all` with the sending side locked once for the whole of `data` (another
    /// thread's writes come before or after it, never inside), not once per piece. The
    /// write timeout counts from the last progress, as for a `write` per piece.
    fn do_write_all(&self, data: &[u8]) -> io::Result<()> {
        self.write_some(data, true).map(drop)
    }

    /// Write what fits of `data` (at least a byte unless it fails), or all of it (`all`).
    fn write_some(&self, data: &[u8], all: bool) -> io::Result<usize> {
        if self.inner.handed.load(Ordering::Acquire) {
            return Err(handed());
        }
        if data.is_empty() {
            return Ok(0);
        }
        let mut g = self.tx();
        let tx = g.as_mut().ok_or_else(tx_gone)?;
        let i = &self.inner;
        match write_loop(tx, data, all, &i.conn, &i.nonblocking, &i.write_timeout)? {
            Some(n) => Ok(n),
            None => {
                drop(g);
                self.mio_rearm(false, true);
                Err(io::ErrorKind::WouldBlock.into())
            }
        }
    }

    /// `f` on the sending side wherever it is, for a moment (no wait inside `f`): the only
    /// handle's own stays its own (`readiness`, `shutdown` do not share it).
    fn with_tx_briefly<R>(&self, f: impl FnOnce(&mut PipeTx) -> R) -> Option<R> {
        briefly(&self.own_tx, &self.inner.tx, &self.inner.tx_moved, f)
    }

    /// The sending side, shared by every handle: moved there first from the only handle's
    /// own (`own_tx`), for good (a handle reached through `&self` may have others).
    fn tx(&self) -> std::sync::MutexGuard<'_, Option<PipeTx>> {
        shared(&self.own_tx, &self.inner.tx, &self.inner.tx_moved)
    }

    /// `f` on the receiving side wherever it is, for a moment (no wait inside `f`): the only
    /// handle's own stays its own (`readiness`, `peek`, `stats` do not share it).
    fn with_rx_briefly<R>(&self, f: impl FnOnce(&mut PipeRx) -> R) -> Option<R> {
        briefly(&self.own_rx, &self.inner.rx, &self.inner.rx_moved, f)
    }

    /// The receiving side, shared by every handle: moved there first from the only handle's
    /// own (`own_rx`), for good (as [`Stream::tx`]). What may wait through `&self` takes it
    /// so: a clone made meanwhile then waits for nothing but the lock of the shared side.
    fn rx(&self) -> std::sync::MutexGuard<'_, Option<PipeRx>> {
        shared(&self.own_rx, &self.inner.rx, &self.inner.rx_moved)
    }

    /// Lend up to `max` received bytes in place (no copy into a buffer of ours): `f` reads
    /// them through [`InPlace`]; they are consumed when it returns. `Ok(None)` at end of
    /// stream. Blocks like `read`.
    ///
    /// ```
    /// use std::io::Write;
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// client.write_all(b"0123456789")?;
    /// // Parse a 4-byte header where it landed, without copying the rest.
    /// let header = server.read_in_place(4, |data| data.to_vec())?;
    /// assert_eq!(header.as_deref(), Some(&b"0123"[..]));
    /// let n = server.read_in_place(100, |data| data.len())?;
    /// assert_eq!(n, Some(6), "what was left");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_in_place<R>(&self, max: u64, f: impl FnOnce(InPlace<'_>) -> R) -> io::Result<Option<R>> {
        let mut deadline_slot = None;
        let mut g = self.rx();
        let rx = g.as_mut().ok_or_else(rx_gone)?;
        loop {
            if rx.available().map_err(pipe_error)? > 0 {
                let r = rx.read_in_place(max, |ap, off, len| f(InPlace::new(ap, off, len))).map_err(pipe_error)?;
                return Ok(r);
            }
            if rx.at_end().map_err(pipe_error)? || self.inner.read_shut.load(Ordering::Acquire) {
                return Ok(None);
            }
            if !self.inner.alive() {
                return Err(pipe_error(PipeError::Dead));
            }
            if self.inner.nonblocking.load(Ordering::Acquire) {
                if rx.drive_links() {
                    // Bytes came over a link: look again.
                    continue;
                }
                drop(g);
                self.mio_rearm(true, false);
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let deadline = self.lazy_deadline(&self.inner.read_timeout, &mut deadline_slot);
            rx.wait_data(deadline, &mut || !self.inner.alive()).map_err(pipe_error)?;
        }
    }

    /// Post a receive buffer for the next `len` bytes of the stream (transfer redirection):
    /// bytes the sender writes after it sees the post go straight into it; bytes already
    /// on their way land in the ring and are copied by [`Stream::recv_posted`]. Read
    /// nothing else until then. `len` at most [`StreamConfig::post_area`].
    ///
    /// ```
    /// use std::io::Write;
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// server.post_recv(40_000)?; // before the data: all of it is placed directly
    /// let data = vec![3u8; 40_000];
    /// client.write_all(&data)?;
    /// let (rep, got) = server.recv_posted(|rep, data| (rep, data.to_vec()))?;
    /// assert_eq!((rep.len, rep.direct, rep.copied), (40_000, 40_000, 0));
    /// assert!(got == data);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn post_recv(&self, len: u64) -> io::Result<()> {
        self.with_rx_briefly(|rx| {
            rx.post(len).map(|_| ()).map_err(|e| match e {
                PipeError::Protocol(why) => io::Error::new(io::ErrorKind::InvalidInput, why),
                other => pipe_error(other),
            })
        })
        .unwrap_or_else(|| Err(rx_gone()))
    }

    /// Wait until the posted buffer is complete (or the stream ended early), and lend it:
    /// `f` gets exactly what happened ([`Redirection`]: how many bytes were placed directly
    /// and how many were copied) and the data in place. Example at [`Stream::post_recv`].
    pub fn recv_posted<R>(&self, f: impl FnOnce(Redirection, InPlace<'_>) -> R) -> io::Result<R> {
        let deadline = self.deadline(&self.inner.read_timeout);
        let mut g = self.rx();
        let rx = g.as_mut().ok_or_else(rx_gone)?;
        let rep = rx.complete_post(deadline, &mut || !self.inner.alive()).map_err(|e| match e {
            PipeError::Protocol(why) if why == "no posted buffer" => io::Error::new(io::ErrorKind::InvalidInput, why),
            other => pipe_error(other),
        })?;
        let area = rx.post_area();
        Ok(f(rep, InPlace::new(rx.side(), area, rep.len)))
    }

    /// Wait until at least `n` more bytes than were read so far have landed (possibly still
    /// being published: the position tripwire of the paper), then copy them into `buf`
    /// without consuming them. For processing a header while the body is still arriving.
    ///
    /// ```
    /// use std::io::{Read, Write};
    /// # use std::time::Duration;
    /// # use clan_proto::stream::{Listener, Stream};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = Listener::bind(&nic)?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
    /// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
    /// # let mut client = connecting.join().unwrap()?;
    /// server.set_read_timeout(Some(Duration::from_secs(5)))?;
    /// client.write_all(b"LEN=5hello")?;
    /// let mut head = [0u8; 5];
    /// assert_eq!(server.peek_when_landed(5, &mut head)?, 5);
    /// assert_eq!(&head, b"LEN=5");
    /// let mut all = [0u8; 10];
    /// server.read_exact(&mut all)?; // still all there: nothing was consumed
    /// assert_eq!(&all, b"LEN=5hello");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peek_when_landed(&self, n: u64, buf: &mut [u8]) -> io::Result<usize> {
        let deadline = self.deadline(&self.inner.read_timeout);
        let mut g = self.rx();
        let rx = g.as_mut().ok_or_else(rx_gone)?;
        let pos = rx.consumed() + n;
        rx.wait_position(pos, deadline, &mut || !self.inner.alive()).map_err(pipe_error)?;
        let k = buf.len().min(n as usize);
        rx.peek(0, &mut buf[..k]).map_err(pipe_error)
    }

    /// Bytes that can be read without waiting.
    pub fn available(&self) -> io::Result<u64> {
        match self.with_rx_briefly(|rx| rx.available()) {
            Some(r) => r.map_err(pipe_error),
            None => Err(rx_gone()),
        }
    }
}

/// What [`Stream::hand_over`] did (more there).
///
/// Both sides handing over at once: the second one sees the first one's mark and takes
/// over instead.
///
/// ```
/// use std::io::Write;
/// use clan_proto::stream::HandOver;
/// # use std::time::Duration;
/// # use clan_proto::stream::{Listener, Stream};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = Listener::bind(&nic)?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
/// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// # let mut client = connecting.join().unwrap()?;
/// client.write_all(b"abc")?;
/// server.write_all(b"defg")?;
/// assert!(matches!(client.hand_over()?, HandOver::Left { unread: 4 }));
/// match server.hand_over()? {
///     HandOver::PeerLeftFirst(t) => assert_eq!((&t.resend[..], &t.unread[..]), (&b"defg"[..], &b"abc"[..])),
///     other => panic!("the server should take over: {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum HandOver {
    /// We left; the peer will take back `unread` bytes it wrote (and any it writes before
    /// it notices).
    Left {
        /// Bytes that had landed here and were not read.
        unread: u64,
    },
    /// The peer had left first: we took over instead.
    PeerLeftFirst(TakeOver),
}

/// What [`Stream::take_over`] found (more at [`Stream::hand_over`]).
///
/// ```
/// use std::net::Shutdown;
/// # use std::time::Duration;
/// # use clan_proto::stream::{Listener, Stream};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = Listener::bind(&nic)?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
/// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// # let mut client = connecting.join().unwrap()?;
/// client.shutdown(Shutdown::Write)?;
/// server.hand_over()?;
/// let t = client.take_over()?;
/// // Nothing to send again or to read, but the other carrier must end the stream too.
/// assert!(t.resend.is_empty() && t.unread.is_empty() && t.write_shut);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct TakeOver {
    /// Bytes we wrote that the peer never read: to be sent again, first.
    pub resend: Vec<u8>,
    /// Bytes the peer wrote that we had not read: to be read first.
    pub unread: Vec<u8>,
    /// Writing had been shut down here before (the other carrier must end the stream too).
    pub write_shut: bool,
}

fn handed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the stream was handed over to another carrier")
}

/// What [`Stream::readiness`] saw (more there).
///
/// ```
/// use std::io::Read;
/// use clan_proto::stream::Readiness;
/// # use std::time::Duration;
/// # use clan_proto::stream::{Listener, Stream};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = Listener::bind(&nic)?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
/// # let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// # let mut client = connecting.join().unwrap()?;
/// let fresh = client.readiness();
/// assert_eq!((fresh.readable, fresh.writable), (false, true));
/// drop(server); // the peer closes: end of stream
/// # let deadline = std::time::Instant::now() + Duration::from_secs(5);
/// # while !client.readiness().eof { assert!(std::time::Instant::now() < deadline); std::thread::yield_now(); }
/// let Readiness { readable, eof, .. } = client.readiness();
/// assert!(readable && eof);
/// assert_eq!(client.read(&mut [0u8; 8])?, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Readiness {
    /// A read returns at once: bytes are readable, or the stream ended, or it failed.
    pub readable: bool,
    /// A write returns at once: room for a byte, or writing was shut down, or it failed.
    pub writable: bool,
    /// End of stream here: the peer shut down writing and everything before was read (or
    /// reading was shut down here).
    pub eof: bool,
    /// The peer is gone (its process died, or the connection broke).
    pub error: bool,
    /// Bytes landed so far: moves whenever data arrives (an edge, for edge-triggered
    /// readiness).
    pub rx_landed: u64,
    /// The peer's read position as last seen: moves when room frees (an edge for writers).
    pub tx_freed: u64,
}

/// Store a timeout as nanoseconds (0: none). `Some(0)` is invalid, as in `std`.
fn set_timeout(slot: &AtomicU64, t: Option<Duration>) -> io::Result<()> {
    if t == Some(Duration::ZERO) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a zero timeout is not allowed"));
    }
    slot.store(t.map_or(0, |d| d.as_nanos().clamp(1, u128::from(u64::MAX)) as u64), Ordering::Release);
    Ok(())
}

impl io::Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.solo_read(buf) {
            Some(r) => r,
            None => self.do_read(buf),
        }
    }
}

impl io::Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.do_read(buf)
    }
}

impl io::Write for Stream {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self.solo_write(data, false) {
            Some(r) => r,
            None => self.do_write(data),
        }
    }
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self.solo_write(data, true) {
            Some(r) => r.map(drop),
            None => self.do_write_all(data),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl io::Write for &Stream {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.do_write(data)
    }
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.do_write_all(data)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A small event queue for one stream or listener (`StreamConfig::own_queue`).
fn own_queue(nic: &Nic) -> io::Result<EventQueue> {
    nic.event_queue(clan::EventQueueConfig { ring_capacity: 64, tripwires: 64, ..clan::EventQueueConfig::default() })
        .map_err(io::Error::other)
}

fn no_own_queue() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "register with mio a stream or listener made with StreamConfig::own_queue (its own event queue)",
    )
}

impl Stream {
    /// After a read (`read`) or a write (`write`) found nothing to do (non-blocking): if
    /// registered with mio, that direction now waits for an edge. Take what woke the
    /// stream's queue, arm the tripwires of the waiting directions and the queue, and look
    /// once more: readiness found now makes the queue's descriptor readable at once (and is
    /// reported once: the direction stops waiting); readiness that comes later fires an
    /// armed tripwire, which posts to the armed queue. Either way the registration reports
    /// it, and a direction nobody waits on reports nothing (a writable stream does not wake
    /// its poller again and again).
    fn mio_rearm(&self, read: bool, write: bool) {
        let mut reg = lock(&self.inner.mio);
        let (Some(reg), Some(q)) = (reg.as_mut(), self.inner.queue.as_ref()) else { return };
        reg.want_read |= read && reg.interests.is_readable();
        reg.want_write |= write && reg.interests.is_writable();
        while q.try_take().is_some() {}
        let armed = (!reg.want_read || reg.data.arm().is_ok()) && (!reg.want_write || reg.space.arm().is_ok());
        let empty = q.arm();
        let r = self.readiness();
        let (now_r, now_w) = (reg.want_read && r.readable, reg.want_write && r.writable);
        reg.want_read &= !now_r;
        reg.want_write &= !now_w;
        if !armed || !empty || now_r || now_w {
            q.post_user(0);
        }
    }

    fn mio_register(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
        interests: mio::Interest,
        new: bool,
    ) -> io::Result<()> {
        let mut q = self.inner.queue.clone().ok_or_else(no_own_queue)?;
        self.set_nonblocking(true)?;
        {
            let mut reg = lock(&self.inner.mio);
            match reg.as_mut() {
                Some(r) => r.interests = interests,
                None => {
                    let (data, space) = self.readiness_tripwires(0, 1)?;
                    *reg = Some(MioReg { data, space, interests, want_read: false, want_write: false });
                }
            }
        }
        // The queue's descriptor is readable when anything of the stream's is ready.
        if new {
            mio::event::Source::register(&mut q, registry, token, mio::Interest::READABLE)?;
        } else {
            mio::event::Source::reregister(&mut q, registry, token, mio::Interest::READABLE)?;
        }
        // The first edge: what is ready now is reported (as epoll does for a new socket).
        self.mio_rearm(true, true);
        Ok(())
    }
}

/// mio integration, for a stream made with [`StreamConfig::own_queue`] (else `register`
/// fails with `Unsupported`). Registering puts the stream in non-blocking mode; as with
/// mio's own sockets, the registration is edge-triggered: after an event, read (or write)
/// until `WouldBlock`, and an event comes when that direction is ready again (`READABLE`:
/// data, end of stream or an error, the peer gone; `WRITABLE`: room to write). A stream's
/// descriptor is its event queue's, so its events come as *readable* events whatever the
/// interest: on an event, try each direction you wait on until `WouldBlock` (events may also
/// be spurious, as mio allows).
///
/// ```
/// use std::io::{ErrorKind, Read, Write};
/// use std::time::Duration;
/// use clan_proto::stream::{Listener, Stream, StreamConfig};
///
/// let nic = clan::Nic::open_default()?;
/// let cfg = StreamConfig { own_queue: true, ..StreamConfig::default() };
/// let listener = Listener::bind_with(&nic, None, cfg.clone())?;
/// let (addr, n2) = (listener.local_addr(), nic.clone());
/// let connecting = std::thread::spawn(move || Stream::connect_with(&n2, addr, &cfg));
/// let (mut server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// let mut client = connecting.join().unwrap()?;
/// let mut poll = mio::Poll::new()?;
/// poll.registry().register(&mut server, mio::Token(1), mio::Interest::READABLE)?;
/// let mut buf = [0u8; 16];
/// assert_eq!(server.read(&mut buf).unwrap_err().kind(), ErrorKind::WouldBlock);
/// client.write_all(b"event")?;
/// let mut events = mio::Events::with_capacity(4);
/// poll.poll(&mut events, Some(Duration::from_secs(5)))?;
/// assert!(events.iter().any(|e| e.token() == mio::Token(1)));
/// assert_eq!(server.read(&mut buf)?, 5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
impl mio::event::Source for Stream {
    fn register(&mut self, registry: &mio::Registry, token: mio::Token, interests: mio::Interest) -> io::Result<()> {
        self.mio_register(registry, token, interests, true)
    }

    fn reregister(&mut self, registry: &mio::Registry, token: mio::Token, interests: mio::Interest) -> io::Result<()> {
        self.mio_register(registry, token, interests, false)
    }

    fn deregister(&mut self, registry: &mio::Registry) -> io::Result<()> {
        let mut q = self.inner.queue.clone().ok_or_else(no_own_queue)?;
        if let Some(r) = lock(&self.inner.mio).take() {
            let _ = r.data.disarm();
            let _ = r.space.disarm();
        }
        mio::event::Source::deregister(&mut q, registry)
    }
}

/// mio integration, for a listener made with [`StreamConfig::own_queue`] (else `register`
/// fails with `Unsupported`): `READABLE` when a connection can be accepted. Registering
/// puts the listener in non-blocking mode; accept until `WouldBlock`.
impl mio::event::Source for Listener {
    fn register(&mut self, registry: &mio::Registry, token: mio::Token, interests: mio::Interest) -> io::Result<()> {
        let mut q = self.queue.clone().filter(|_| !self.share_queue).ok_or_else(no_own_queue)?;
        self.set_nonblocking(true)?;
        mio::event::Source::register(&mut q, registry, token, interests)?;
        self.mio_rearm();
        Ok(())
    }

    fn reregister(&mut self, registry: &mio::Registry, token: mio::Token, interests: mio::Interest) -> io::Result<()> {
        let mut q = self.queue.clone().filter(|_| !self.share_queue).ok_or_else(no_own_queue)?;
        mio::event::Source::reregister(&mut q, registry, token, interests)?;
        self.mio_rearm();
        Ok(())
    }

    fn deregister(&mut self, registry: &mio::Registry) -> io::Result<()> {
        let mut q = self.queue.clone().filter(|_| !self.share_queue).ok_or_else(no_own_queue)?;
        mio::event::Source::deregister(&mut q, registry)
    }
}

/// Counters of a stream's reading side ([`Stream::stats`]).
///
/// **Early wake-ups.** A read that goes to sleep for data (after its spin) leaves the peer a
/// token; the peer, when it next takes data from us while on another CPU of this host,
/// wakes us at once rather than when its reply lands, as a Unix socket's reader is woken
/// when the peer takes what it wrote. In a request/response exchange the sleeper's CPU then
/// wakes while the reply is made. A wake-up with no reply behind it costs a re-check and
/// one more sleep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamStats {
    /// Bytes read (consumed).
    pub read: u64,
    /// Times a read slept waiting for data (each left the peer a token).
    pub read_sleeps: u64,
    /// Early wake-ups given to the peer: it slept waiting for our data, and we took data
    /// it had written.
    pub early_wakeups: u64,
}
