//! Message transfer and RPC (Tripwire paper §4.1).
//!
//! **Message transfer** ([`ChannelSender`], [`ChannelReceiver`]): one buffer in the
//! receiver and two flags. The sender writes the message into the receiver's buffer, then
//! sets the receiver's `rx_ready`; the receiver processes the message in place, then sets
//! the sender's `tx_ready`, which lets the sender send the next one. Each side has one
//! tripwire, on the flag it waits for.
//!
//! **RPC** ([`RpcClient`], [`RpcServer`]): the client writes its request into the server's
//! buffer and sets the server's flag; the server processes it in place and writes the reply
//! into the client's buffer, setting the client's flag. Requests and replies alternate, so
//! two flags and two tripwires suffice. Both directions are zero-copy if the application
//! wants: [`RpcClient::call_with`] writes the request straight into the server's memory,
//! the server's handler reads it in place and writes its reply straight into the client's.
//!
//! The server is event-driven: one thread, one event queue (a file descriptor for epoll),
//! every connection's flag tripwire posting to it; [`RpcServer::run_once`] drains the queue,
//! polls it for a while ([`RpcConfig::spin`], the paper's 15 µs) and then sleeps.
//!
//! Layout of each party's buffer (a side aperture): the flag at `RX_WRITE` — the sequence
//! number of the last message in its high 32 bits, its length in the low 32 — `tx_ready` at
//! `CTL_READ`, the message at byte 192 (the line after the flag's: caches fetch lines in
//! aligned pairs). A client about to sleep for its reply leaves the server a token at
//! `CTL_ASLEEP` (on the flag's line, which the server loads anyway), and the server, taking
//! the request, stores it back into the client's `CTL_NUDGE`, which the client's flag
//! tripwire also watches: an early wake-up, as `crate::pipe` describes. A small message (up to 256 bytes, written in order) is
//! gathered and sent with its flag as one snooped transfer (one fence); a larger one goes
//! straight into the peer's buffer as it is written.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use clan::{
    AccessError, Endpoint, EndpointAddr, Event, EventQueue, EventQueueConfig, Mapping, Nic, Tripwire, TripwireConfig,
};

use crate::inplace::InPlace;
use crate::pipe::{CTL_NUDGE, CTL_READ, RX_WRITE};
use crate::side::{self, Geometry, SetupError, Sides};
use crate::wait::{SLICE, Spin, WaitError, wait_check, wait_check_with, wait_tripwire};

/// What went wrong.
///
/// ```
/// use std::time::Duration;
/// use clan_proto::rpc::{ChannelSender, RpcConfig, RpcError, RpcListener};
///
/// let nic = clan::Nic::open_default()?;
/// let listener = RpcListener::bind(&nic, RpcConfig { max_msg: 64, ..RpcConfig::default() })?;
/// let (addr, n2) = (listener.local_addr(), nic.clone());
/// let connecting = std::thread::spawn(move || ChannelSender::connect(&n2, addr, &RpcConfig::default()));
/// let mut rx = listener.accept_channel(Some(Duration::from_secs(5)))?;
/// let mut tx = connecting.join().unwrap()?;
/// match tx.send(&[0u8; 100], Some(Duration::from_secs(5))) {
///     Err(RpcError::TooLong { len, max }) => assert_eq!((len, max), (100, 64)),
///     other => panic!("expected TooLong, got {other:?}"),
/// }
/// assert!(matches!(rx.recv(Some(Duration::from_millis(5))), Err(RpcError::Timeout)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// Setting up the connection failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// An access failed (the peer unexported, the link broke).
    #[error(transparent)]
    Access(#[from] AccessError),
    /// The event queue failed.
    #[error(transparent)]
    EventQueue(#[from] clan::EventQueueError),
    /// The message does not fit the peer's buffer.
    #[error("a message of {len} bytes does not fit the peer's {max}-byte buffer")]
    TooLong {
        /// Its length.
        len: u64,
        /// The buffer's.
        max: u64,
    },
    /// The peer wrote something impossible into our memory.
    #[error("protocol violation by the peer: {0}")]
    Protocol(&'static str),
    /// The peer went away.
    #[error("the peer went away")]
    Disconnected,
    /// No answer in time.
    #[error("timed out")]
    Timeout,
}

impl From<RpcError> for std::io::Error {
    fn from(e: RpcError) -> std::io::Error {
        use std::io::ErrorKind as K;
        match e {
            RpcError::Setup(x) => x.into(),
            RpcError::Access(x) => x.into(),
            RpcError::EventQueue(x) => x.into(),
            RpcError::TooLong { .. } => std::io::Error::new(K::InvalidInput, e),
            RpcError::Protocol(_) => std::io::Error::new(K::InvalidData, e),
            RpcError::Disconnected => std::io::Error::new(K::ConnectionReset, e),
            RpcError::Timeout => std::io::Error::new(K::TimedOut, e),
        }
    }
}

fn wait_err(e: WaitError) -> RpcError {
    match e {
        WaitError::Timeout => RpcError::Timeout,
        WaitError::Dead => RpcError::Disconnected,
        WaitError::Stale => RpcError::Access(AccessError::Revoked),
    }
}

/// Settings.
///
/// ```
/// use std::time::Duration;
/// use clan_proto::rpc::{RpcConfig, RpcServer};
///
/// // Requests of up to 1 MiB; waits sleep at once instead of polling.
/// let cfg = RpcConfig { max_msg: 1 << 20, spin: Duration::ZERO, ..RpcConfig::default() };
/// let nic = clan::Nic::open_default()?;
/// let server = RpcServer::bind(&nic, cfg, 64)?;
/// assert_eq!(server.event_queue().config().spin, Duration::ZERO);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct RpcConfig {
    /// Largest message this party receives (its buffer).
    pub max_msg: u64,
    /// How long waits poll memory before they sleep; the server's queue polling time.
    /// Default: [`clan::default_spin`] (`CLAN_SPIN_US`, else 15 µs); zero: sleep at once,
    /// nothing polls.
    pub spin: Duration,
    /// Bound on connecting.
    pub connect_timeout: Duration,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig { max_msg: 64 << 10, spin: clan::default_spin(), connect_timeout: Duration::from_secs(10) }
    }
}

/// Bytes of a message gathered before it is sent with its flag.
const SMALL: usize = 256;
/// Where a message starts in a party's buffer: the line after the flag's (`RX_WRITE`, in the
/// line of bytes 128–191), the two an aligned pair that caches fetch together, and the
/// buffer's last control line. A small message and its flag then cost one page (one TLB
/// entry) and one fetch on each side, and the buffer is 192 bytes more than its largest
/// message, carved with others in a page of its pool — what keeps the round trip close to
/// flat when thousands of connections are used at random.
const MSG: u64 = 192;

/// Writes a message into the peer's buffer: a small one is gathered and goes out with its
/// flag; anything else goes straight into the peer's memory as it is written (no staging).
///
/// ```
/// # use std::time::{Duration, Instant};
/// # use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
/// # let nic = clan::Nic::open_default()?;
/// # let mut server = RpcServer::bind(&nic, RpcConfig::default(), 4)?;
/// # let addr = server.local_addr();
/// # let serving = std::thread::spawn(move || -> Result<u64, clan_proto::rpc::RpcError> {
/// #     let (mut answered, deadline) = (0, Instant::now() + Duration::from_secs(5));
/// #     while answered < 1 && Instant::now() < deadline {
/// #         answered += server.run_once(Some(Duration::from_millis(10)), &mut |_, req, reply| {
/// #             let _ = reply.write(&req.to_vec().to_ascii_uppercase());
/// #         })?;
/// #     }
/// #     Ok(answered)
/// # });
/// # let mut client = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
/// let reply = client.call_with(
///     Some(Duration::from_secs(5)),
///     |w| {
///         w.write_at(4, b"body")?; // a header at 0..4, filled in once the body is there
///         w.write_at(0, &4u32.to_le_bytes())?;
///         assert_eq!(w.len(), 8);
///         Ok(())
///     },
///     |reply| reply.to_vec(),
/// )?;
/// assert_eq!(&reply[4..], b"BODY");
/// # drop(client);
/// # assert_eq!(serving.join().unwrap()?, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Writer<'a> {
    peer: &'a Mapping,
    max: u64,
    len: u64,
    small: [u8; SMALL],
    /// Written straight to the peer already (the gathered bytes were flushed).
    direct: bool,
}

impl Writer<'_> {
    /// Write `data` at `off` of the message (the message's length is the highest byte
    /// written).
    pub fn write_at(&mut self, off: u64, data: &[u8]) -> Result<(), RpcError> {
        let end = off
            .checked_add(data.len() as u64)
            .filter(|&e| e <= self.max)
            .ok_or(RpcError::TooLong { len: off.saturating_add(data.len() as u64), max: self.max })?;
        if !self.direct && off == self.len && end as usize <= SMALL {
            self.small[off as usize..end as usize].copy_from_slice(data);
        } else {
            if !self.direct {
                self.direct = true;
                if self.len > 0 {
                    self.peer.write(MSG, &self.small[..self.len as usize])?;
                }
            }
            self.peer.write(MSG + off, data)?;
        }
        self.len = self.len.max(end);
        Ok(())
    }

    /// Append `data`.
    pub fn write(&mut self, data: &[u8]) -> Result<(), RpcError> {
        self.write_at(self.len, data)
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Send the message: its flag (sequence number and length), with the gathered bytes if
    /// they were not written yet.
    fn publish(self, seq: u64) -> Result<(), RpcError> {
        let flag = (seq << 32) | self.len;
        if self.direct || self.len == 0 {
            self.peer.store_u64(RX_WRITE, flag)?;
        } else {
            self.peer.write_then_store_u64(MSG, &self.small[..self.len as usize], RX_WRITE, flag)?;
        }
        Ok(())
    }
}

/// RPC parties alive in this process (clients and server connections): past
/// [`PREFETCH_FROM`] a call asks for its lines ahead ([`Party::prefetch`]).
static PARTIES: AtomicUsize = AtomicUsize::new(0);

/// Parties from which a call prefetches: their state and buffers then outgrow the caches,
/// and a connection chosen at random finds every line cold. Below, the lines are cached and
/// the prefetches cost (`clan bench server`, alternating builds, p50 medians: at 10 000
/// endpoints 1452 -> 1127 ns prefetching; at 1000, 430 -> 450 ns).
pub const PREFETCH_FROM: usize = 2048;

/// RPC parties alive in this process (clients, and the connections of servers): from
/// [`PREFETCH_FROM`] on, calls and [`RpcServer::handle_event`] prefetch.
pub fn live_parties() -> usize {
    PARTIES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Events an [`RpcServer`] with thousands of connections handles in one
/// [`RpcServer::handle_event`] (the one given, and those queued behind it), their
/// connections' lines asked for together.
pub const LOOK_AHEAD: usize = 8;

/// Counts a party in [`PARTIES`] while it lives.
#[derive(Debug)]
struct Counted;

impl Counted {
    fn new() -> Counted {
        // (Relaxed: a hint of the scale; nothing is published through it)
        PARTIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Counted
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        PARTIES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The connection an event of an [`RpcServer`]'s queue is about, if it is a request's.
fn conn_of(e: &Option<Event>) -> Option<usize> {
    match e {
        Some(Event::Tripwire { cookie, .. } | Event::User(cookie)) => usize::try_from(*cookie).ok(),
        _ => None,
    }
}

/// Whether this process holds parties enough that a call should prefetch.
fn many_parties() -> bool {
    PARTIES.load(std::sync::atomic::Ordering::Relaxed) >= PREFETCH_FROM
}

/// Both parties of a connection.
///
/// Laid out in order (`repr(C)`; the fields that drop in the order they are declared): what
/// a request or reply reads is one run of bytes, [`Party::HOT`] (five or six cache lines of
/// the party's ten), and the rest is outside it. At thousands of connections used at random
/// every line of a party is cold, and a call asks for those lines alone, so that the lines
/// of more parties stay in the caches.
#[derive(Debug)]
#[repr(C)]
struct Party {
    /// (its hot part at its end: [`Sides::HOT`])
    sides: Sides,
    /// The peer's side once imported, held here: a write follows one pointer fewer than
    /// through `sides.peer` (at thousands of connections, one cache miss fewer per call).
    peer: OnceLock<Mapping>,
    seq: u64,
    /// A server connection's: the client's last token answered.
    answered: u64,
    /// Fires when our flag is written (a client's: or its `CTL_NUDGE`).
    flag: Tripwire,
    spin: Duration,
    /// A client's: sleeps waiting for replies, whose tokens ask the server for an early
    /// wake-up (`crate::pipe`'s documentation); `None` for the other parties.
    sleeps: Option<std::sync::atomic::AtomicU64>,
    _counted: Counted,
}

impl Party {
    /// The bytes a request or reply reads, from `sides.mine` to `answered`.
    const HOT: std::ops::Range<usize> =
        std::mem::offset_of!(Party, sides) + Sides::HOT.start..std::mem::offset_of!(Party, flag);

    /// Ask for the hot lines of the party at `at` bytes into `whole` (a connection's state,
    /// whose own hot word is its first).
    fn prefetch_state<T>(whole: &T, at: usize) {
        let base = (whole as *const T).cast::<u8>();
        clan::prefetch::line(base);
        clan::prefetch::range(base.wrapping_add(at + Party::HOT.start), Party::HOT.len());
    }

    /// `early`: a client, whose waits ask for early wake-ups.
    fn new(sides: Sides, spin: Duration, event: Option<u64>, early: bool) -> Result<Party, RpcError> {
        let watched = if early { CTL_NUDGE } else { RX_WRITE };
        let cfg = TripwireConfig::writes(watched..RX_WRITE + 8);
        let cfg = match event {
            // Event-driven (the server): every flag write posts an event.
            Some(cookie) => cfg.actions(clan::Actions::NONE).event(cookie),
            None => cfg.once().disarmed().actions(clan::Actions::NONE),
        };
        let flag = sides.mine.tripwire(cfg).map_err(|_| AccessError::Revoked)?;
        let sleeps = early.then(|| std::sync::atomic::AtomicU64::new(0));
        Ok(Party { sides, peer: OnceLock::new(), flag, seq: 0, spin, sleeps, answered: 0, _counted: Counted::new() })
    }

    /// Ask for the lines a request or reply touches (ours: the flag's and the message's;
    /// the peer's: the same, with its index), all at once: at thousands of connections
    /// used at random each is a cache miss, and asked for together they overlap.
    fn prefetch(&self) {
        self.sides.mine.prefetch(RX_WRITE, MSG + 64 - RX_WRITE);
        if let Some(m) = self.peer.get() {
            m.prefetch(RX_WRITE, MSG + 64 - RX_WRITE);
        }
    }

    /// Our flag's sequence number.
    fn my_flag(&self) -> Result<u64, RpcError> {
        Ok(self.sides.mine.load_u64(RX_WRITE)? >> 32)
    }

    /// Wait for our flag to reach `v`.
    fn wait_flag(&self, v: u64, deadline: Option<Instant>) -> Result<(), RpcError> {
        wait_check_with(
            &self.flag,
            Spin::for_conn(self.spin, &self.sides.conn),
            deadline,
            SLICE,
            || match self.my_flag()? {
                f if f > v => Err(RpcError::Protocol("the peer's flag ran ahead")),
                f => Ok(f == v),
            },
            || !self.sides.conn.is_alive(),
            wait_err,
            || {
                if let Some(n) = &self.sleeps {
                    // (Relaxed: a count only this party's owner moves)
                    crate::wait::ask_nudge(&self.sides.peer, n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
                }
            },
        )
    }

    /// The message in our buffer (its length checked).
    fn message(&self) -> Result<InPlace<'_>, RpcError> {
        let len = self.sides.mine.load_u64(RX_WRITE)? & 0xffff_ffff;
        let max = self.sides.mine.len() - MSG;
        if len > max {
            return Err(RpcError::Protocol("a message longer than our buffer"));
        }
        Ok(InPlace::new(&self.sides.mine, MSG, len))
    }

    fn writer(&self) -> Result<Writer<'_>, RpcError> {
        let peer = match self.peer.get() {
            Some(m) => m,
            None => {
                let m = self.sides.peer.get()?.clone();
                self.peer.get_or_init(|| m)
            }
        };
        Ok(Writer { peer, max: self.sides.peer_cap.min(u64::from(u32::MAX)), len: 0, small: [0; SMALL], direct: false })
    }
}

/// Accepts connections for a message channel (and, with [`RpcServer`], RPC).
///
/// ```
/// use std::time::Duration;
/// use clan_proto::rpc::{ChannelSender, RpcConfig, RpcListener};
///
/// let nic = clan::Nic::open_default()?;
/// let listener = RpcListener::bind(&nic, RpcConfig::default())?;
/// let (addr, n2) = (listener.local_addr(), nic.clone());
/// let sender = std::thread::spawn(move || -> Result<ChannelSender, clan_proto::rpc::RpcError> {
///     let mut tx = ChannelSender::connect(&n2, addr, &RpcConfig::default())?;
///     for word in ["one", "two", "three"] {
///         tx.send(word.as_bytes(), Some(Duration::from_secs(5)))?; // waits for the previous one's turn
///     }
///     Ok(tx) // kept until the receiver is done (it acknowledges the last message too)
/// });
/// let mut rx = listener.accept_channel(Some(Duration::from_secs(5)))?;
/// for word in ["one", "two", "three"] {
///     assert_eq!(rx.recv(Some(Duration::from_secs(5)))?, word.as_bytes());
/// }
/// sender.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RpcListener {
    nic: Nic,
    ep: Endpoint,
    cfg: RpcConfig,
}

impl RpcListener {
    /// Listen on a new endpoint of `nic`.
    pub fn bind(nic: &Nic, cfg: RpcConfig) -> Result<RpcListener, RpcError> {
        let ep = nic.endpoint().map_err(SetupError::from)?;
        ep.listen();
        Ok(RpcListener { nic: nic.clone(), ep, cfg })
    }

    /// Where peers connect.
    pub fn local_addr(&self) -> EndpointAddr {
        self.ep.addr()
    }

    /// Accept a channel sender: the receiving end. No connection request within `timeout`
    /// is [`RpcError::Timeout`]. As with TCP, a sender that gives up, dies or misbehaves
    /// during the hand-shake is not reported here: its request is dropped and the next one
    /// taken. Errors are this side's own.
    pub fn accept_channel(&self, timeout: Option<Duration>) -> Result<ChannelReceiver, RpcError> {
        let g = Geometry::message(self.cfg.max_msg.max(2), MSG);
        let s = side::accept_next::<_, RpcError>(&self.ep, timeout, |req| {
            side::accept(&self.nic, None, req, g, self.cfg.connect_timeout)
        })?
        .ok_or(RpcError::Timeout)?;
        Ok(ChannelReceiver { p: Party::new(s, self.cfg.spin, None, false)? })
    }
}

/// The sending end of a message channel (more at [`RpcListener`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::rpc::{ChannelSender, RpcConfig, RpcListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = RpcListener::bind(&nic, RpcConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || ChannelSender::connect(&n2, addr, &RpcConfig::default()));
/// # let mut rx = listener.accept_channel(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// tx.send(b"first", Some(Duration::from_secs(5)))?;
/// // One message at a time: the next send waits until the receiver has processed this one.
/// let r = tx.send(b"second", Some(Duration::from_millis(5)));
/// assert!(matches!(r, Err(clan_proto::rpc::RpcError::Timeout)));
/// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?, b"first");
/// tx.send(b"second", Some(Duration::from_secs(5)))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ChannelSender {
    p: Party,
    tx_ready: Tripwire,
}

impl ChannelSender {
    /// Who the peer is, as far as the NIC could prove it (the receiver's process): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.p.sides.conn.peer_identity()
    }

    /// Connect to a receiver listening at `to` (anything that names endpoints:
    /// [`clan::ToEndpointAddrs`]).
    pub fn connect(nic: &Nic, to: impl clan::ToEndpointAddrs, cfg: &RpcConfig) -> Result<ChannelSender, RpcError> {
        let s = side::connect(nic, None, to, Geometry::message(2, MSG), cfg.connect_timeout)?;
        let tx_ready = wait_tripwire(&s.mine, CTL_READ..CTL_READ + 8)?;
        Ok(ChannelSender { p: Party::new(s, cfg.spin, None, false)?, tx_ready })
    }

    /// Send a message: wait until the receiver has processed the previous one (`tx_ready`),
    /// write this one with `fill`, then set the receiver's `rx_ready`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan_proto::rpc::{ChannelSender, RpcConfig, RpcListener};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let listener = RpcListener::bind(&nic, RpcConfig::default())?;
    /// let (addr, n2) = (listener.local_addr(), nic.clone());
    /// let connecting = std::thread::spawn(move || ChannelSender::connect(&n2, addr, &RpcConfig::default()));
    /// let mut rx = listener.accept_channel(Some(Duration::from_secs(5)))?;
    /// let mut tx = connecting.join().unwrap()?;
    /// // Serialise straight into the receiver's buffer, in pieces.
    /// tx.send_with(Some(Duration::from_secs(5)), |w| {
    ///     w.write(b"key=")?;
    ///     w.write(b"value")
    /// })?;
    /// // ... and process it where it landed.
    /// let n = rx.recv_with(Some(Duration::from_secs(5)), |m| m.len())?;
    /// assert_eq!(n, 9);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_with(
        &mut self,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut Writer<'_>) -> Result<(), RpcError>,
    ) -> Result<(), RpcError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let want = self.p.seq;
        let mine = &self.p.sides.mine;
        let conn = &self.p.sides.conn;
        wait_check(
            &self.tx_ready,
            Spin::for_conn(self.p.spin, conn),
            deadline,
            SLICE,
            || match mine.load_u64(CTL_READ)? {
                v if v > want => Err(RpcError::Protocol("tx_ready ran ahead")),
                v => Ok(v == want),
            },
            || !conn.is_alive(),
            wait_err,
        )?;
        let seq = self.p.seq + 1;
        let mut w = self.p.writer()?;
        fill(&mut w)?;
        w.publish(seq)?;
        self.p.seq = seq;
        Ok(())
    }

    /// Send `msg` (copied into the receiver's buffer).
    pub fn send(&mut self, msg: &[u8], timeout: Option<Duration>) -> Result<(), RpcError> {
        self.send_with(timeout, |w| w.write(msg))
    }
}

/// The receiving end of a message channel (more at [`RpcListener`] and
/// [`ChannelSender::send_with`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::rpc::{ChannelSender, RpcConfig, RpcListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = RpcListener::bind(&nic, RpcConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || ChannelSender::connect(&n2, addr, &RpcConfig::default()));
/// # let mut rx = listener.accept_channel(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// tx.send(&42u64.to_le_bytes(), Some(Duration::from_secs(5)))?;
/// // Processed where it landed; the sender may send again once this returns.
/// let v = rx.recv_with(Some(Duration::from_secs(5)), |m| {
///     let mut b = [0u8; 8];
///     m.read(0, &mut b).map(|()| u64::from_le_bytes(b))
/// })??;
/// assert_eq!(v, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ChannelReceiver {
    p: Party,
}

impl ChannelReceiver {
    /// Who the peer is, as far as the NIC could prove it (the sender's process): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.p.sides.conn.peer_identity()
    }

    /// Wait for the next message and process it in place; then tell the sender (`tx_ready`).
    pub fn recv_with<R>(&mut self, timeout: Option<Duration>, f: impl FnOnce(InPlace<'_>) -> R) -> Result<R, RpcError> {
        self.p.wait_flag(self.p.seq + 1, timeout.map(|t| Instant::now() + t))?;
        self.p.seq += 1;
        let r = f(self.p.message()?);
        // The message was taken whatever comes next: a sender that has gone meanwhile needs
        // no acknowledgement (the next receive reports it gone), so failing to write one
        // must not lose the message.
        if let Ok(peer) = self.p.sides.peer.get() {
            let _ = peer.store_u64(CTL_READ, self.p.seq);
        }
        Ok(r)
    }

    /// Receive the next message, copied.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, RpcError> {
        self.recv_with(timeout, |m| m.to_vec())
    }
}

/// An RPC client: one connection, one call at a time.
///
/// ```
/// use std::time::{Duration, Instant};
/// use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
///
/// let nic = clan::Nic::open_default()?;
/// let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
/// let addr = server.local_addr();
/// let serving = std::thread::spawn(move || -> Result<u64, clan_proto::rpc::RpcError> {
///     let (mut answered, deadline) = (0, Instant::now() + Duration::from_secs(5));
///     while answered < 2 && Instant::now() < deadline {
///         answered += server.run_once(Some(Duration::from_millis(10)), &mut |_conn, req, reply| {
///             let _ = reply.write(&req.to_vec().to_ascii_uppercase()); // in place, both ways
///         })?;
///     }
///     Ok(answered)
/// });
/// let mut client = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
/// let mut reply = Vec::new();
/// for word in ["hello", "rpc"] {
///     client.call(word.as_bytes(), &mut reply, Some(Duration::from_secs(5)))?;
///     assert_eq!(reply, word.to_ascii_uppercase().as_bytes());
/// }
/// assert_eq!(serving.join().unwrap()?, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[repr(C, align(64))]
pub struct RpcClient {
    /// (in the first line, with [`Party::HOT`] the lines a call reads)
    pending: bool,
    p: Party,
}

impl RpcClient {
    /// Who the peer is, as far as the NIC could prove it (the server's process): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.p.sides.conn.peer_identity()
    }

    /// Connect to the server at `to` (anything that names endpoints:
    /// [`clan::ToEndpointAddrs`]); `cfg.max_msg` is the largest reply we accept.
    pub fn connect(nic: &Nic, to: impl clan::ToEndpointAddrs, cfg: &RpcConfig) -> Result<RpcClient, RpcError> {
        let s = side::connect(nic, None, to, Geometry::message(cfg.max_msg.max(2), MSG), cfg.connect_timeout)?;
        Ok(RpcClient { p: Party::new(s, cfg.spin, None, true)?, pending: false })
    }

    /// Call: write the request straight into the server's buffer with `fill`, wait for the
    /// reply, lend it in place to `take`. Example at [`Writer`].
    pub fn call_with<R>(
        &mut self,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut Writer<'_>) -> Result<(), RpcError>,
        take: impl FnOnce(InPlace<'_>) -> R,
    ) -> Result<R, RpcError> {
        self.send_with(fill)?;
        self.wait_reply(timeout, take)
    }

    /// The first half of a call: send the request (without waiting). Many clients can each
    /// have a call in flight; collect the replies with [`RpcClient::try_reply`].
    ///
    /// ```
    /// # use std::time::{Duration, Instant};
    /// # use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
    /// # let nic = clan::Nic::open_default()?;
    /// # let mut server = RpcServer::bind(&nic, RpcConfig::default(), 4)?;
    /// # let addr = server.local_addr();
    /// # let serving = std::thread::spawn(move || -> Result<u64, clan_proto::rpc::RpcError> {
    /// #     let (mut answered, deadline) = (0, Instant::now() + Duration::from_secs(5));
    /// #     while answered < 1 && Instant::now() < deadline {
    /// #         answered += server.run_once(Some(Duration::from_millis(10)), &mut |_, req, reply| {
    /// #             let _ = reply.write(&req.to_vec().to_ascii_uppercase());
    /// #         })?;
    /// #     }
    /// #     Ok(answered)
    /// # });
    /// # let mut client = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
    /// client.send_with(|w| w.write(b"async"))?; // returns at once
    /// // ... other work; then collect the reply (or poll it with `try_reply`):
    /// let reply = client.wait_reply(Some(Duration::from_secs(5)), |r| r.to_vec())?;
    /// assert_eq!(reply, b"ASYNC");
    /// assert!(client.try_reply(|r| r.len()).is_err(), "no call in flight any more");
    /// # drop(client);
    /// # assert_eq!(serving.join().unwrap()?, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_with(&mut self, fill: impl FnOnce(&mut Writer<'_>) -> Result<(), RpcError>) -> Result<(), RpcError> {
        if many_parties() {
            // (this client's state and both buffers' lines asked for at once: among
            // thousands of connections each is cold)
            Party::prefetch_state(self, std::mem::offset_of!(RpcClient, p));
            self.p.prefetch();
        }
        if self.pending {
            return Err(RpcError::Protocol("a call is already in flight on this client"));
        }
        let seq = self.p.seq + 1;
        let mut w = self.p.writer()?;
        fill(&mut w)?;
        w.publish(seq)?;
        self.p.seq = seq;
        self.pending = true;
        Ok(())
    }

    /// The reply to the call in flight, if it has come (one memory load when it has not).
    /// A loop that polls this for a server on another host should apply the link's traffic
    /// itself every few polls ([`clan::Nic::spin_links`]), as [`RpcClient::wait_reply`]'s
    /// spin does; otherwise the NIC's engine thread does, when it gets a CPU.
    ///
    /// ```
    /// # use std::time::{Duration, Instant};
    /// # use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
    /// # let nic = clan::Nic::open_default()?;
    /// # let mut server = RpcServer::bind(&nic, RpcConfig::default(), 4)?;
    /// # let addr = server.local_addr();
    /// # let serving = std::thread::spawn(move || -> Result<u64, clan_proto::rpc::RpcError> {
    /// #     let (mut answered, deadline) = (0, Instant::now() + Duration::from_secs(5));
    /// #     while answered < 1 && Instant::now() < deadline {
    /// #         answered += server.run_once(Some(Duration::from_millis(10)), &mut |_, req, reply| {
    /// #             let _ = reply.write(&req.to_vec().to_ascii_uppercase());
    /// #         })?;
    /// #     }
    /// #     Ok(answered)
    /// # });
    /// # let mut client = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
    /// client.send_with(|w| w.write(b"poll me"))?;
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// let reply = loop {
    ///     if let Some(r) = client.try_reply(|r| r.to_vec())? {
    ///         break r;
    ///     }
    ///     assert!(Instant::now() < deadline, "no reply");
    ///     std::thread::yield_now(); // a real caller does other work here
    /// };
    /// assert_eq!(reply, b"POLL ME");
    /// # drop(client);
    /// # assert_eq!(serving.join().unwrap()?, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_reply<R>(&mut self, take: impl FnOnce(InPlace<'_>) -> R) -> Result<Option<R>, RpcError> {
        if !self.pending {
            return Err(RpcError::Protocol("no call in flight"));
        }
        let f = self.p.my_flag()?;
        if f != self.p.seq {
            if f > self.p.seq {
                return Err(RpcError::Protocol("the peer's flag ran ahead"));
            }
            return Ok(None);
        }
        self.pending = false;
        Ok(Some(take(self.p.message()?)))
    }

    /// Wait for the reply to the call in flight (spin, then block). Example at
    /// [`RpcClient::send_with`].
    pub fn wait_reply<R>(
        &mut self,
        timeout: Option<Duration>,
        take: impl FnOnce(InPlace<'_>) -> R,
    ) -> Result<R, RpcError> {
        if !self.pending {
            return Err(RpcError::Protocol("no call in flight"));
        }
        self.p.wait_flag(self.p.seq, timeout.map(|t| Instant::now() + t))?;
        self.pending = false;
        Ok(take(self.p.message()?))
    }

    /// Call with `req`; the reply is copied into `reply` (cleared first).
    pub fn call(&mut self, req: &[u8], reply: &mut Vec<u8>, timeout: Option<Duration>) -> Result<(), RpcError> {
        self.call_with(
            timeout,
            |w| w.write(req),
            |r| {
                reply.clear();
                reply.resize(r.len() as usize, 0);
                // In bounds by construction (`reply` has its length).
                let _ = r.copy_to(reply);
            },
        )
    }

    /// Our endpoint's address.
    pub fn local_addr(&self) -> EndpointAddr {
        self.p.sides.ep.addr()
    }
}

/// One connection of a server.
#[derive(Debug)]
#[repr(C, align(64))]
struct ServerConn {
    /// Requests answered (in the first line, with [`Party::HOT`] the lines serving a
    /// request reads).
    served: u64,
    p: Party,
    /// Whose quota it counts in ([`RpcServer::limit_per_user`]).
    user: User,
}

impl ServerConn {
    /// Ask for the lines serving a request reads.
    fn prefetch_state(&self) {
        Party::prefetch_state(self, std::mem::offset_of!(ServerConn, p));
    }
}

/// What [`RpcServer::limit_per_user`] counts connections by: a uid of this host (all its
/// processes together), or a host across a link (all its NICs together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum User {
    Uid(u32),
    Host(std::net::IpAddr),
}

impl User {
    fn of(who: clan::PeerIdentity) -> User {
        match who {
            clan::PeerIdentity::Remote { source, .. } => User::Host(source),
            // A process of this host (`PeerIdentity` is non-exhaustive: anything else
            // proven is a process's).
            other => User::Uid(other.uid().unwrap_or(u32::MAX)),
        }
    }
}

/// Identifies a connection of an [`RpcServer`] (given to its handler).
///
/// ```
/// use std::collections::HashSet;
/// use std::time::{Duration, Instant};
/// use clan_proto::rpc::{ConnId, RpcClient, RpcConfig, RpcServer};
///
/// let nic = clan::Nic::open_default()?;
/// let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
/// let addr = server.local_addr();
/// type Seen = (HashSet<ConnId>, Option<u64>);
/// let serving = std::thread::spawn(move || -> Result<Seen, clan_proto::rpc::RpcError> {
///     let (mut seen, deadline) = (HashSet::new(), Instant::now() + Duration::from_secs(5));
///     while seen.len() < 2 && Instant::now() < deadline {
///         server.run_once(Some(Duration::from_millis(10)), &mut |conn, _req, _reply| {
///             seen.insert(conn);
///         })?;
///     }
///     let first = *seen.iter().next().expect("a call");
///     Ok((seen, server.served(first)))
/// });
/// let mut a = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
/// let mut b = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
/// a.call(b"x", &mut Vec::new(), Some(Duration::from_secs(5)))?;
/// b.call(b"y", &mut Vec::new(), Some(Duration::from_secs(5)))?;
/// let (seen, served) = serving.join().unwrap()?;
/// assert_eq!((seen.len(), served), (2, Some(1)), "two connections, one call each");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(pub u64);

/// An event-driven RPC server: one thread, one event queue. More at [`RpcClient`]; with a
/// loop of your own, at [`crate::server::EventLoop`].
///
/// ```
/// use std::time::{Duration, Instant};
/// use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
///
/// let nic = clan::Nic::open_default()?;
/// let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
/// let (addr, n2) = (server.local_addr(), nic.clone());
/// let client = std::thread::spawn(move || -> Result<Vec<u8>, clan_proto::rpc::RpcError> {
///     let (mut c, mut reply) = (RpcClient::connect(&n2, addr, &RpcConfig::default())?, Vec::new());
///     c.call(&[20, 22], &mut reply, Some(Duration::from_secs(5)))?;
///     Ok(reply)
/// });
/// let deadline = Instant::now() + Duration::from_secs(5);
/// let mut answered = 0;
/// while answered == 0 && Instant::now() < deadline {
///     answered += server.run_once(Some(Duration::from_millis(10)), &mut |_conn, req, reply| {
///         let mut ab = [0u8; 2];
///         if req.read(0, &mut ab).is_ok() {
///             let _ = reply.write(&[ab[0] + ab[1]]); // straight into the client's memory
///         }
///     })?;
/// }
/// assert_eq!((client.join().unwrap()?, answered), (vec![42], 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RpcServer {
    nic: Nic,
    queue: EventQueue,
    listener: Endpoint,
    cfg: RpcConfig,
    /// Connections by id (ids are small and dense: a slot each; the index of a request's
    /// event is a direct array access).
    conns: Vec<Option<ServerConn>>,
    /// Slots of departed connections, reused (a stale event for a reused slot finds no
    /// request and does nothing).
    free: Vec<u64>,
    open: usize,
    by_port: HashMap<u32, u64>,
    next: u64,
    /// Clients cut off for breaking the protocol.
    cut_off: u64,
    /// Clients refused for a limit (`max_conns`, `max_per_user`).
    refused: u64,
    /// Connections held at most (more are refused).
    max_conns: u32,
    /// Connections one user holds at most ([`RpcServer::limit_per_user`]).
    max_per_user: u32,
    /// Connections held, by user (no entry at zero).
    per_user: HashMap<User, u32>,
}

impl RpcServer {
    /// Listen on a new endpoint of `nic`, with an event queue of its own sized for
    /// `max_conns` connections. With `max_conns` open, more clients are refused (their
    /// connects fail with `Refused`) until some go.
    ///
    /// Any process that can reach the NIC may connect, so one user could hold every one of
    /// the `max_conns` and keep the others out: a server shared by several users bounds
    /// each with [`RpcServer::limit_per_user`].
    pub fn bind(nic: &Nic, cfg: RpcConfig, max_conns: u32) -> Result<RpcServer, RpcError> {
        let queue = nic.event_queue(EventQueueConfig {
            spin: cfg.spin,
            tripwires: (max_conns.max(16) * 2).next_power_of_two(),
            ring_capacity: 4096.max((max_conns * 2).next_power_of_two()),
            ..EventQueueConfig::default()
        })?;
        let listener = nic
            .endpoint_with(clan::EndpointConfig { queue: Some(queue.clone()), ..clan::EndpointConfig::default() })
            .map_err(SetupError::from)?;
        listener.listen();
        Ok(RpcServer {
            nic: nic.clone(),
            queue,
            listener,
            cfg,
            conns: Vec::new(),
            free: Vec::new(),
            open: 0,
            by_port: HashMap::new(),
            next: 1,
            cut_off: 0,
            refused: 0,
            max_conns,
            max_per_user: max_conns,
            per_user: HashMap::new(),
        })
    }

    /// Let one user hold at most `n` connections at once (the default: `max_conns`, no
    /// bound of its own). A user is a uid of this host, all its processes together, as the
    /// kernel reports them ([`clan::PeerIdentity`]); or a host across a link, all its NICs
    /// together (its users cannot be told apart from here). A client over
    /// the bound is refused (its connect fails with `Refused`), and the others are served as
    /// before: one user that opens connections in a loop and keeps them takes at most `n`.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use clan_proto::rpc::{RpcClient, RpcConfig, RpcError, RpcServer};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let mut server = RpcServer::bind(&nic, RpcConfig::default(), 64)?;
    /// server.limit_per_user(2);
    /// let (addr, n2) = (server.local_addr(), nic.clone());
    /// // Three clients of one user (this process's): the third is refused.
    /// let clients = std::thread::spawn(move || {
    ///     (0..3).map(|_| RpcClient::connect(&n2, addr, &RpcConfig::default())).collect::<Vec<_>>()
    /// });
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// while !clients.is_finished() {
    ///     assert!(Instant::now() < deadline, "the clients hang");
    ///     server.accept_pending()?;
    ///     std::thread::sleep(Duration::from_millis(1));
    /// }
    /// let results = clients.join().unwrap();
    /// assert!(results[..2].iter().all(Result::is_ok));
    /// assert!(matches!(results[2], Err(RpcError::Setup(_))));
    /// assert_eq!((server.connections(), server.refused_clients()), (2, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn limit_per_user(&mut self, n: u32) {
        self.max_per_user = n;
    }

    /// Clients refused for a limit: `max_conns` open already, or their user's
    /// ([`RpcServer::limit_per_user`]).
    pub fn refused_clients(&self) -> u64 {
        self.refused
    }

    /// Who the client of connection `id` is ([`clan::PeerIdentity`]); `None` if it is not
    /// open.
    pub fn peer_identity(&self, id: ConnId) -> Option<clan::PeerIdentity> {
        Some(self.conns.get(id.0 as usize)?.as_ref()?.p.sides.conn.peer_identity())
    }

    /// Where clients connect.
    pub fn local_addr(&self) -> EndpointAddr {
        self.listener.addr()
    }

    /// The event queue: its file descriptor is readable while there is work (for epoll).
    pub fn event_queue(&self) -> &EventQueue {
        &self.queue
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.open
    }

    /// Accept every pending connection request now; returns how many.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
    /// let (addr, n2) = (server.local_addr(), nic.clone());
    /// let client = std::thread::spawn(move || RpcClient::connect(&n2, addr, &RpcConfig::default()));
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// while server.connections() == 0 {
    ///     assert!(Instant::now() < deadline, "no client came");
    ///     server.accept_pending()?; // never waits
    ///     std::thread::sleep(Duration::from_millis(1));
    /// }
    /// let _client = client.join().unwrap()?;
    /// assert_eq!(server.connections(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn accept_pending(&mut self) -> Result<usize, RpcError> {
        let mut n = 0;
        while let Some(req) = self.listener.try_accept() {
            let from = req.from();
            let who = req.peer_identity();
            let user = User::of(who);
            let held = self.per_user.get(&user).copied().unwrap_or(0);
            if self.open >= self.max_conns as usize || held >= self.max_per_user {
                tracing::debug!(peer = %from, %who, open = self.open, held, "refused an RPC connection: over a limit");
                self.refused += 1;
                let _ = req.refuse(&self.listener);
                continue;
            }
            let s = match side::accept(
                &self.nic,
                Some(&self.queue),
                req,
                Geometry::message(self.cfg.max_msg.max(2), MSG),
                self.cfg.connect_timeout,
            ) {
                Ok(s) => s,
                // As with TCP, a client that gives up, dies or misbehaves during the
                // hand-shake is not the server's error: its request is dropped.
                Err(e) if side::client_failed(&e) => {
                    tracing::debug!(peer = %from, "refused an RPC connection: {e}");
                    continue;
                }
                // This side's own (out of memory or descriptors).
                Err(e) => return Err(e.into()),
            };
            let id = match self.free.pop() {
                Some(id) => id,
                None => {
                    self.next += 1;
                    self.next - 1
                }
            };
            let port = s.ep.port();
            let p = match Party::new(s, self.cfg.spin, Some(id), false) {
                Ok(p) => p,
                Err(e) => {
                    self.free.push(id);
                    return Err(e);
                }
            };
            self.by_port.insert(port, id);
            let slot = id as usize;
            if self.conns.len() <= slot {
                self.conns.resize_with(slot + 1, || None);
            }
            self.conns[slot] = Some(ServerConn { p, served: 0, user });
            self.open += 1;
            *self.per_user.entry(user).or_insert(0) += 1;
            n += 1;
            // A request may have come before the tripwire existed.
            self.serve_conn_later(id);
        }
        Ok(n)
    }

    fn serve_conn_later(&mut self, id: u64) {
        // Post a user event for the connection so that `run_once` looks at it.
        let _ = self.queue.post_user(id);
    }

    /// Answer connection `id`'s request, if it made one. Whatever goes wrong here is that
    /// connection's alone (its client broke the protocol, or its side cannot be read or
    /// written any more): the connection is dropped and the server goes on. Returns whether
    /// a request was answered.
    fn serve(&mut self, id: u64, handler: &mut dyn FnMut(ConnId, InPlace<'_>, &mut Writer<'_>)) -> bool {
        let Some(Some(c)) = self.conns.get_mut(id as usize) else { return false };
        let flag = match c.p.my_flag() {
            Ok(f) => f,
            Err(_) => return false,
        };
        if flag != c.p.seq + 1 {
            if flag > c.p.seq + 1 {
                // A client that runs ahead of the protocol: drop it.
                self.cut_off(id, "the client's flag ran ahead");
            }
            return false;
        }
        c.p.seq = flag;
        // A client asleep for the reply is woken now, while the handler makes it.
        crate::wait::nudge(&c.p.sides.mine, &mut c.p.answered, &c.p.sides.peer);
        let (req, mut w) = match (c.p.message(), c.p.writer()) {
            (Ok(req), Ok(w)) => (req, w),
            (Err(RpcError::Protocol(why)), _) => {
                self.cut_off(id, why);
                return false;
            }
            (Err(e), _) | (_, Err(e)) => {
                // Its side is gone (the client died, or its memory was revoked).
                tracing::debug!(conn = id, "dropping an RPC connection: {e}");
                self.drop_conn(id);
                return false;
            }
        };
        handler(ConnId(id), req, &mut w);
        if w.publish(c.p.seq).is_err() {
            self.drop_conn(id);
            return false;
        }
        c.served += 1;
        true
    }

    /// Drop a client that broke the protocol, and count it.
    fn cut_off(&mut self, id: u64, why: &str) {
        tracing::debug!(conn = id, "cutting off an RPC client that broke the protocol: {why}");
        self.cut_off += 1;
        self.drop_conn(id);
    }

    /// Clients cut off for breaking the protocol: a request flag run ahead, a request
    /// longer than its buffer. (Each is dropped alone; the server goes on.)
    pub fn cut_off_clients(&self) -> u64 {
        self.cut_off
    }

    fn drop_conn(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(id as usize).and_then(Option::take) {
            self.open -= 1;
            self.free.push(id);
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.per_user.entry(c.user) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
            self.by_port.remove(&c.p.sides.ep.port());
        }
    }

    /// Handle what is ready: take events (waiting up to `timeout` for the first; then
    /// draining, then polling for [`RpcConfig::spin`] before returning), accept new
    /// connections, answer requests with `handler` (request in place, reply written
    /// straight into the client), drop connections whose client went away. Returns the
    /// number of requests answered.
    ///
    /// What one client does never fails the loop: a client that breaks the protocol (a
    /// request flag run ahead, a request longer than its buffer), dies, or fails its
    /// hand-shake is dropped alone ([`RpcServer::cut_off_clients`] counts the first kind).
    /// An error is this server's own (its event queue, out of memory or descriptors).
    pub fn run_once(
        &mut self,
        timeout: Option<Duration>,
        handler: &mut dyn FnMut(ConnId, InPlace<'_>, &mut Writer<'_>),
    ) -> Result<u64, RpcError> {
        let mut served = 0u64;
        let first = match self.queue.wait(timeout) {
            Ok(e) => Some(e),
            Err(clan::EventQueueError::Timeout) => None,
            Err(e) => return Err(e.into()),
        };
        let mut next = first;
        // When the queue was first found drained since the last event (the clock is read
        // only then, not per event).
        let mut idle_since = None;
        // Empty polls in a row (the clock is read at the first and every
        // `server::CLOCK_EVERY`th, not at each).
        let mut empty = 0u32;
        loop {
            let Some(ev) = next.take() else {
                // Drained: poll for a while before going back to sleep.
                if empty % crate::server::CLOCK_EVERY == 0
                    && idle_since.get_or_insert_with(Instant::now).elapsed() >= self.cfg.spin
                {
                    break;
                }
                empty = empty.wrapping_add(1);
                std::hint::spin_loop();
                // While it polls, this thread applies what comes from other hosts itself
                // (every `LINK_EVERY`th empty poll), rather than leave it to the NIC's engine
                // thread, which would take this thread's CPU for it. The spin is begun and
                // ended at once: one held across the handlers would keep the engine away
                // from the links while a handler runs. One load without links.
                if empty % crate::server::LINK_EVERY == 0 {
                    self.queue.spin_links().drive();
                }
                next = self.queue.try_take();
                continue;
            };
            served += self.handle_event(ev, handler)?;
            next = self.queue.try_take();
            idle_since = None;
            empty = 0;
        }
        Ok(served)
    }

    /// Handle one event of [`RpcServer::event_queue`] (for a loop of your own, such as
    /// [`crate::server::EventLoop`]): a request is answered with `handler`, a connection
    /// request accepted, a departed client dropped. Returns the requests answered.
    /// As for [`RpcServer::run_once`], what one client does never makes this fail.
    ///
    /// With thousands of connections, the events already queued behind `ev` (up to
    /// [`LOOK_AHEAD`] of them) are taken and handled in the same call, in order: the lines
    /// of all their connections are asked for first, so that their cache misses overlap.
    pub fn handle_event(
        &mut self,
        ev: Event,
        handler: &mut dyn FnMut(ConnId, InPlace<'_>, &mut Writer<'_>),
    ) -> Result<u64, RpcError> {
        if !many_parties() {
            return self.handle_one(ev, handler);
        }
        // This one first, its own lines asked for at once (a reply is not delayed by a look
        // for more); then those queued behind it.
        if let Some(Some(c)) = conn_of(&Some(ev)).and_then(|id| self.conns.get(id)) {
            c.prefetch_state();
            c.p.prefetch();
        }
        let first = self.handle_one(ev, handler);
        let mut batch = [None; LOOK_AHEAD];
        let mut n = 0;
        while n < LOOK_AHEAD {
            match self.queue.try_take() {
                Some(e) => {
                    batch[n] = Some(e);
                    n += 1;
                }
                None => break,
            }
        }
        // The connections' state first, all of it at once; then, once it is there (the
        // pointers to their buffers are in it), the buffers' and the indexes' lines.
        for id in batch[..n].iter().filter_map(conn_of) {
            if let Some(Some(c)) = self.conns.get(id) {
                c.prefetch_state();
            }
        }
        for id in batch[..n].iter().filter_map(conn_of) {
            if let Some(Some(c)) = self.conns.get(id) {
                c.p.prefetch();
            }
        }
        let (mut served, mut failed) = match first {
            Ok(k) => (k, None),
            Err(e) => (0, Some(e)),
        };
        for e in batch[..n].iter_mut().filter_map(Option::take) {
            // (every event taken is handled, an error or not: none is lost)
            match self.handle_one(e, handler) {
                Ok(k) => served += k,
                Err(err) => failed = failed.or(Some(err)),
            }
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(served),
        }
    }

    /// [`RpcServer::handle_event`] for `ev` alone.
    fn handle_one(
        &mut self,
        ev: Event,
        handler: &mut dyn FnMut(ConnId, InPlace<'_>, &mut Writer<'_>),
    ) -> Result<u64, RpcError> {
        let mut served = 0;
        match ev {
            Event::Tripwire { cookie, .. } | Event::User(cookie) => served += u64::from(self.serve(cookie, handler)),
            Event::Oob { .. } => {
                self.accept_pending()?;
            }
            Event::Disconnect { endpoint, .. } => {
                if let Some(id) = self.by_port.get(&endpoint).copied() {
                    self.drop_conn(id);
                }
            }
            Event::Overflow { .. } => {
                // Lost events: look at every connection.
                self.accept_pending()?;
                let ids: Vec<u64> =
                    self.conns.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| i as u64).collect();
                for id in ids {
                    served += u64::from(self.serve(id, handler));
                }
            }
            _ => {}
        }
        Ok(served)
    }

    /// Requests answered on a connection.
    pub fn served(&self, id: ConnId) -> Option<u64> {
        self.conns.get(id.0 as usize).and_then(Option::as_ref).map(|c| c.served)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// The lines a call asks for at thousands of connections ([`Party::HOT`] and the first
    /// line of its holder) hold every field it reads: a field moved out of the run would be
    /// read cold, after the others.
    #[test]
    fn a_calls_fields_are_in_the_lines_it_asks_for() {
        let hot = Party::HOT;
        let sides = offset_of!(Party, sides);
        let fields = [
            (offset_of!(Party, seq), size_of::<u64>()),
            (offset_of!(Party, answered), size_of::<u64>()),
            (offset_of!(Party, peer), size_of::<OnceLock<Mapping>>()),
            (sides + offset_of!(Sides, mine), size_of::<clan::Aperture>()),
            (sides + offset_of!(Sides, peer_cap), size_of::<u64>()),
        ];
        for (at, len) in fields {
            assert!(hot.start <= at && at + len <= hot.end, "a field at {at}..{} outside {hot:?}", at + len);
        }
        // The holders' own hot words lead their first line; with the run, at most 7 lines.
        let lines = |start: usize, len: usize| (start + len - 1) / 64 - start / 64 + 1;
        for (p, first_word, align) in [
            (offset_of!(RpcClient, p), offset_of!(RpcClient, pending), align_of::<RpcClient>()),
            (offset_of!(ServerConn, p), offset_of!(ServerConn, served), align_of::<ServerConn>()),
        ] {
            assert_eq!((align, first_word), (64, 0));
            let run = p + hot.start;
            assert!(run >= 64, "the run starts past the first line");
            let asked = 1 + lines(run, hot.len());
            assert!(asked <= 7, "{asked} lines");
        }
    }
}
