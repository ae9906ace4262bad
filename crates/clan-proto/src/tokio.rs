//! `tokio` integration (feature `tokio`): an async wait on event queues through their file
//! descriptor, and stream sockets with `AsyncRead` / `AsyncWrite`.
//!
//! A [`Reactor`] owns one event queue, registered with tokio through its file descriptor
//! (`AsyncFd`), and a task that takes its events and wakes the tasks waiting on them. Async
//! streams and listeners made with a reactor report to its queue: a stream sets two
//! tripwires that post events — on its incoming data counter and on its space counter —
//! arming them only when a read or write would block (so a busy stream costs nothing
//! extra), and the reactor wakes the reader or writer.
//!
//! The reactor spins, then sleeps, as the blocking waits do: for the queue's `spin`
//! ([`clan::default_spin`], `CLAN_SPIN_US`, unless [`Reactor::with_queue`] says otherwise)
//! after its last event, its task keeps taking events between the other tasks' turns and
//! leaves the queue unarmed, so a firing tripwire only posts to the ring; then it arms the
//! queue and sleeps on the queue's descriptor. After dispatching events it always yields
//! once before looking again, so that the tasks it woke run first: under load the queue is
//! rarely armed, even with no spin at all. `clan bench tokio` measures both.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use clan::{EndpointAddr, Event, EventQueue, EventQueueConfig, Nic, Tripwire};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::lock;
use crate::stream::{Listener, Stream, StreamConfig};

/// An event queue you can `await`.
///
/// ```
/// use std::time::Duration;
/// use clan::Event;
/// use clan_proto::tokio::AsyncEventQueue;
///
/// let nic = clan::Nic::open_default()?;
/// let q = nic.event_queue(clan::EventQueueConfig::default())?;
/// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// let ev = rt.block_on(async {
///     let aq = AsyncEventQueue::new(q.clone())?; // inside the runtime
///     std::thread::spawn(move || q.post_user(3)); // any poster: a tripwire, a peer, a thread
///     tokio::time::timeout(Duration::from_secs(5), aq.wait()).await?
/// })?;
/// assert_eq!(ev, Event::User(3));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct AsyncEventQueue {
    fd: AsyncFd<EventQueue>,
}

impl AsyncEventQueue {
    /// Register `queue` with the current tokio runtime.
    pub fn new(queue: EventQueue) -> io::Result<AsyncEventQueue> {
        // Deprecated upstream in favour of an `unsafe` constructor whose contract is that
        // `as_raw_fd` keeps naming the same open file for the life of the `AsyncFd`. An
        // event queue's descriptor is its eventfd, owned by the queue, opened when the queue
        // is made and closed when the last handle goes (this `AsyncFd` holds one): the
        // contract holds, and this crate stays free of `unsafe`.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(queue, tokio::io::Interest::READABLE)?;
        Ok(AsyncEventQueue { fd })
    }

    /// The queue.
    pub fn queue(&self) -> &EventQueue {
        self.fd.get_ref()
    }

    /// The next event: taken at once if there is one, else when the queue's descriptor
    /// becomes readable.
    pub async fn wait(&self) -> io::Result<Event> {
        loop {
            if let Some(ev) = self.queue().try_take() {
                return Ok(ev);
            }
            // Armed and empty: the descriptor becomes readable when an event is posted.
            if self.queue().arm() {
                let mut g = self.fd.readable().await?;
                g.clear_ready();
            }
        }
    }
}

#[derive(Debug, Default)]
struct Wakers {
    by_cookie: HashMap<u64, Waker>,
    /// Cookies of the streams of an endpoint (to wake them when it is disconnected).
    by_port: HashMap<u32, (u64, u64)>,
}

#[derive(Debug)]
struct Shared {
    queue: EventQueue,
    wakers: Mutex<Wakers>,
    next: AtomicU64,
}

impl Shared {
    fn register(&self, cookie: u64, w: &Waker) {
        lock(&self.wakers).by_cookie.insert(cookie, w.clone());
    }

    fn wake(&self, cookie: u64) {
        if let Some(w) = lock(&self.wakers).by_cookie.remove(&cookie) {
            w.wake();
        }
    }

    fn dispatch(&self, ev: Event) {
        match ev {
            Event::Tripwire { cookie, .. } => self.wake(cookie),
            Event::Oob { endpoint } | Event::Disconnect { endpoint, .. } => {
                let pair = lock(&self.wakers).by_port.get(&endpoint).copied();
                if let Some((a, b)) = pair {
                    self.wake(a);
                    self.wake(b);
                }
            }
            Event::Overflow { .. } => {
                // Lost events: wake everyone (they re-check their memory).
                let all: Vec<Waker> = lock(&self.wakers).by_cookie.drain().map(|(_, w)| w).collect();
                for w in all {
                    w.wake();
                }
            }
            _ => {}
        }
    }
}

/// One event queue for many async streams, and the task that serves it. Cheap to clone.
///
/// An echo over an async stream, on a current-thread runtime:
///
/// ```
/// use std::time::Duration;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// use clan_proto::{stream::StreamConfig, tokio::Reactor};
///
/// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// let echoed = rt.block_on(async {
///     let nic = clan::Nic::open_default()?;
///     let reactor = Reactor::new(&nic)?;
///     let listener = reactor.bind(StreamConfig::default())?;
///     let addr = listener.local_addr();
///     tokio::spawn(async move {
///         let (mut s, _peer) = listener.accept().await?;
///         let mut buf = [0u8; 4];
///         s.read_exact(&mut buf).await?;
///         s.write_all(&buf).await
///     });
///     let mut c = reactor.connect(addr, StreamConfig::default()).await?;
///     c.write_all(b"ping").await?;
///     let mut back = [0u8; 4];
///     tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut back)).await??;
///     Ok::<_, Box<dyn std::error::Error>>(back)
/// })?;
/// assert_eq!(&echoed, b"ping");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Reactor {
    nic: Nic,
    shared: Arc<Shared>,
}

impl Reactor {
    /// A reactor on `nic`, its task spawned on the current tokio runtime. Its queue holds
    /// 16384 events per producer and spins for [`clan::default_spin`] (`CLAN_SPIN_US`)
    /// before it sleeps.
    ///
    /// # Errors
    /// Outside a tokio runtime, an error of kind `Other` (not a panic); or the NIC's error
    /// making the queue.
    ///
    /// ```
    /// use clan_proto::tokio::Reactor;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let outside = Reactor::new(&nic).unwrap_err();
    /// assert_eq!(outside.kind(), std::io::ErrorKind::Other);
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    /// let _reactor = rt.block_on(async { Reactor::new(&nic) })?; // its task runs on `rt`
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(nic: &Nic) -> io::Result<Reactor> {
        Reactor::with_queue(nic, EventQueueConfig { ring_capacity: 1 << 14, ..EventQueueConfig::default() })
    }

    /// A reactor whose event queue is made with `cfg`. Its `spin` is how long the
    /// reactor's task keeps looking at the queue, between the other tasks' turns, after
    /// the last event before it sleeps on the queue's descriptor (zero: it sleeps at once,
    /// and every event that finds it asleep costs an eventfd write and an epoll wake-up).
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::EventQueueConfig;
    /// use clan_proto::tokio::Reactor;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    /// // A reactor that never spins (the runtime's thread has other work).
    /// let cfg = EventQueueConfig { spin: Duration::ZERO, ..EventQueueConfig::default() };
    /// let reactor = rt.block_on(async { Reactor::with_queue(&nic, cfg) })?;
    /// # drop(reactor);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_queue(nic: &Nic, cfg: EventQueueConfig) -> io::Result<Reactor> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other("clan_proto::tokio::Reactor must be made inside a tokio runtime"))?;
        let queue = nic.event_queue(cfg).map_err(io::Error::other)?;
        let shared = Arc::new(Shared { queue: queue.clone(), wakers: Mutex::default(), next: AtomicU64::new(1) });
        let aq = {
            let _in_runtime = runtime.enter();
            AsyncEventQueue::new(queue)?
        };
        let weak = Arc::downgrade(&shared);
        let spin = aq.queue().config().spin;
        runtime.spawn(async move {
            // Spin, then register, as the blocking waits do: while events came within the
            // last `spin`, the task looks at the queue between the other tasks' turns
            // (`yield_now`) and the queue stays unarmed, so a firing tripwire only posts to
            // the ring (no eventfd write, no epoll wake-up). After `spin` without an event it
            // arms the queue and sleeps on its descriptor.
            let mut idle_since = std::time::Instant::now();
            loop {
                let mut any = false;
                while let Some(ev) = aq.queue().try_take() {
                    let Some(s) = weak.upgrade() else { return };
                    s.dispatch(ev);
                    any = true;
                }
                if weak.strong_count() == 0 {
                    return;
                }
                if any {
                    idle_since = std::time::Instant::now();
                    tokio::task::yield_now().await;
                } else if idle_since.elapsed() < spin {
                    // What came from other hosts is applied here (once per empty look),
                    // rather than left to the NIC's engine thread, which would take the
                    // runtime's CPU for it. The spin is begun and ended at once: one held
                    // across an await would keep the engine away from the links while this
                    // task is not polled. Nothing without links.
                    aq.queue().spin_links().drive();
                    tokio::task::yield_now().await;
                } else {
                    let Ok(ev) = aq.wait().await else { return };
                    let Some(s) = weak.upgrade() else { return };
                    s.dispatch(ev);
                    idle_since = std::time::Instant::now();
                }
            }
        });
        Ok(Reactor { nic: nic.clone(), shared })
    }

    fn cookies(&self) -> (u64, u64) {
        let n = self.shared.next.fetch_add(2, Ordering::Relaxed);
        (n, n + 1)
    }

    /// Listen for async streams on a new endpoint (a free port: [`AsyncListener::local_addr`]
    /// says which).
    pub fn bind(&self, cfg: StreamConfig) -> io::Result<AsyncListener> {
        self.bind_on(None, cfg)
    }

    /// Listen for async streams on endpoint port `port` of the reactor's NIC, so that clients
    /// can be told the address in advance. A port already in use is
    /// [`io::ErrorKind::AddrInUse`].
    ///
    /// ```
    /// use clan_proto::{stream::StreamConfig, tokio::Reactor};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    /// rt.block_on(async {
    ///     let reactor = Reactor::new(&nic)?;
    ///     let listener = reactor.bind_port(8080, StreamConfig::default())?;
    ///     assert_eq!(listener.local_addr(), clan::EndpointAddr::new(nic.addr(), 8080));
    ///     let taken = reactor.bind_port(8080, StreamConfig::default()).unwrap_err();
    ///     assert_eq!(taken.kind(), std::io::ErrorKind::AddrInUse);
    ///     Ok::<(), std::io::Error>(())
    /// })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn bind_port(&self, port: u32, cfg: StreamConfig) -> io::Result<AsyncListener> {
        self.bind_on(Some(port), cfg)
    }

    fn bind_on(&self, port: Option<u32>, cfg: StreamConfig) -> io::Result<AsyncListener> {
        let l = Listener::bind_on(&self.nic, port, cfg, Some(self.shared.queue.clone()))?;
        let (c, _) = self.cookies();
        lock(&self.shared.wakers).by_port.insert(l.local_addr().port, (c, c));
        Ok(AsyncListener { l, reactor: self.clone(), cookie: c })
    }

    /// Connect an async stream to `addr`: anything that names endpoints
    /// ([`clan::ToEndpointAddrs`]: an [`EndpointAddr`], `"node7:7000/3"`, …), each address
    /// tried in turn. The host name lookup and the handshake run on a blocking thread.
    pub async fn connect<A>(&self, addr: A, cfg: StreamConfig) -> io::Result<AsyncStream>
    where
        A: clan::ToEndpointAddrs + Send + 'static,
    {
        let nic = self.nic.clone();
        let q = self.shared.queue.clone();
        let s = tokio::task::spawn_blocking(move || Stream::connect_on(&nic, &addr, &cfg, Some(&q)))
            .await
            .map_err(io::Error::other)??;
        AsyncStream::new(s, self)
    }
}

/// A listener for async streams ([`Reactor::bind`]; example at [`Reactor`]).
///
/// ```
/// use std::time::Duration;
/// use clan_proto::{stream::StreamConfig, tokio::Reactor};
///
/// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// rt.block_on(async {
///     let nic = clan::Nic::open_default()?;
///     let reactor = Reactor::new(&nic)?;
///     let listener = reactor.bind(StreamConfig::default())?;
///     let (addr, r2) = (listener.local_addr(), reactor.clone());
///     let client = tokio::spawn(async move { r2.connect(addr, StreamConfig::default()).await });
///     let (s, from) = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await??;
///     let c = client.await??;
///     let client_addr = c.get_ref().local_addr(); // the blocking stream underneath
///     assert_eq!((from, s.peer_addr()), (client_addr, client_addr));
///     Ok::<(), Box<dyn std::error::Error>>(())
/// })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct AsyncListener {
    l: Listener,
    reactor: Reactor,
    cookie: u64,
}

impl AsyncListener {
    /// Where peers connect.
    pub fn local_addr(&self) -> EndpointAddr {
        self.l.local_addr()
    }

    /// The next connection.
    pub async fn accept(&self) -> io::Result<(AsyncStream, EndpointAddr)> {
        self.l.set_nonblocking(true)?;
        std::future::poll_fn(|cx| {
            // Register before looking, so a request arriving in between wakes us.
            self.reactor.shared.register(self.cookie, cx.waker());
            match self.l.accept() {
                Ok((s, from)) => Poll::Ready(AsyncStream::new(s, &self.reactor).map(|s| (s, from))),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            }
        })
        .await
    }
}

/// A stream socket for tokio: `AsyncRead` and `AsyncWrite` (example at [`Reactor`]).
///
/// ```
/// use std::time::Duration;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// use clan_proto::{stream::StreamConfig, tokio::Reactor};
///
/// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// let got = rt.block_on(async {
///     let nic = clan::Nic::open_default()?;
///     let reactor = Reactor::new(&nic)?;
///     let listener = reactor.bind(StreamConfig::default())?;
///     let addr = listener.local_addr();
///     let server = tokio::spawn(async move {
///         let (mut s, _) = listener.accept().await?;
///         let mut all = Vec::new();
///         s.read_to_end(&mut all).await.map(|_| all) // until the client shuts down
///     });
///     let mut c = reactor.connect(addr, StreamConfig::default()).await?;
///     c.write_all(&[1u8; 100_000]).await?;
///     c.shutdown().await?; // end of stream
///     let all = tokio::time::timeout(Duration::from_secs(5), server).await???; // time, task, io
///     Ok::<_, Box<dyn std::error::Error>>(all)
/// })?;
/// assert_eq!(got.len(), 100_000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct AsyncStream {
    s: Stream,
    reactor: Reactor,
    data: Tripwire,
    space: Tripwire,
    cookies: (u64, u64),
}

impl AsyncStream {
    fn new(s: Stream, reactor: &Reactor) -> io::Result<AsyncStream> {
        s.set_nonblocking(true)?;
        let (rc, wc) = reactor.cookies();
        let (data, space) = s.readiness_tripwires(rc, wc)?;
        lock(&reactor.shared.wakers).by_port.insert(s.local_addr().port, (rc, wc));
        Ok(AsyncStream { s, reactor: reactor.clone(), data, space, cookies: (rc, wc) })
    }

    /// The blocking stream underneath (in non-blocking mode).
    pub fn get_ref(&self) -> &Stream {
        &self.s
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> EndpointAddr {
        self.s.peer_addr()
    }

    /// Who the peer is ([`Stream::peer_identity`]).
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.s.peer_identity()
    }
}

impl Drop for AsyncStream {
    fn drop(&mut self) {
        let mut w = lock(&self.reactor.shared.wakers);
        w.by_cookie.remove(&self.cookies.0);
        w.by_cookie.remove(&self.cookies.1);
        w.by_port.remove(&self.s.local_addr().port);
    }
}

impl AsyncRead for AsyncStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        for _ in 0..2 {
            match io::Read::read(&mut me.s, buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Register, arm, then look again: data that lands after the arm fires
                    // the tripwire (an event, a wake-up); data before it is seen now.
                    me.reactor.shared.register(me.cookies.0, cx.waker());
                    if me.data.arm().is_err() {
                        return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, "the stream is gone")));
                    }
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Pending
    }
}

impl AsyncWrite for AsyncStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        for _ in 0..2 {
            match io::Write::write(&mut me.s, data) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    me.reactor.shared.register(me.cookies.1, cx.waker());
                    if me.space.arm().is_err() {
                        return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "the stream is gone")));
                    }
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Pending
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written bytes are already in the peer's memory (or on the link).
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.s.shutdown(std::net::Shutdown::Write))
    }
}
