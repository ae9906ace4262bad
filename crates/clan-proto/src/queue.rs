//! The distributed queue of the Tripwire paper (§4.2) for messages: fixed-size slots in the
//! receiver's memory, written by the sender.
//!
//! The sender owns `write_i` and mirrors it lazily into the receiver (`RX_WRITE` of its
//! side); the receiver owns `read_i` and mirrors it lazily into the sender (`CTL_READ`). The
//! queue is empty when they are equal and full with one free slot. Every access across the
//! network is a write; each party polls only its own memory, then blocks on a tripwire (spin
//! first: [`QueueConfig::spin`]).
//!
//! Variants of the paper's §4.3: each message carries a 64-bit **metadata** word; a message
//! longer than a slot travels as a **multi-part** message over consecutive slots (the
//! receiver frees each slot as it copies it, so a message may be longer than the whole
//! ring); the receiver may wait for a message's **header** to land while its body is still
//! arriving ([`MsgReceiver::wait_header`]). Unstructured byte streaming is the other variant
//! ([`crate::stream`]). The sender chooses programmed I/O or DMA per message
//! ([`MsgSender::send_from`]).
//!
//! ```text
//! slot: seq u64 | part_len u32 | flags u32 | meta u64 | total_len u64 | payload …
//! ```
//!
//! `seq` is the message's slot sequence number plus one (so a slot's stale contents from the
//! previous lap never look like a new header). A slot of at most 512 bytes of payload is
//! written whole and then its `seq` (one transfer, one fence) and says so in its flags
//! (sealed): the receiver takes it on that one cache line without waiting to see the write
//! counter (another line) cover it. Longer parts and DMA bodies land after their header; the
//! counter publishes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clan::{
    AccessError, Aperture, DmaOptions, DmaRequest, DmaTicket, Endpoint, EndpointAddr, EventQueue, Nic, Tripwire,
};

use crate::inplace::InPlace;
use crate::pipe::{CTL_READ, RING, RX_WRITE};
use crate::side::{self, Geometry, SetupError};
use crate::wait::{SLICE, Spin, WaitError, wait_check, wait_tripwire};

/// Bytes of a slot header.
pub const HEADER: u64 = 32;
/// Parts up to this long go in one transfer with their header (copied behind it first);
/// longer ones go as header, then body.
const SMALL_PART: u64 = 512;
/// Most messages [`MsgSender::send_batch`] publishes at once.
const MAX_RUN: u64 = 64;

/// A slot header after its sequence word: part length, flags, metadata, total length.
fn header_fields(part_len: u64, flags: u32, meta: u64, total: u64) -> [u8; (HEADER - 8) as usize] {
    let mut h = [0u8; (HEADER - 8) as usize];
    h[..4].copy_from_slice(&(part_len as u32).to_le_bytes());
    h[4..8].copy_from_slice(&flags.to_le_bytes());
    h[8..16].copy_from_slice(&meta.to_le_bytes());
    h[16..24].copy_from_slice(&total.to_le_bytes());
    h
}
const MORE: u32 = 1;
const FIRST: u32 = 2;
/// The slot was written whole before its sequence word (one transfer: header, body, then
/// the sequence word, [`clan::Mapping::write_led_then_store_u64`]): a receiver that sees the
/// sequence word may take the slot without looking at the write counter, one cache line
/// instead of two. Slots whose header goes first (long parts, DMA) do not carry it.
const SEALED: u32 = 4;
/// How long [`MsgSender::send_idling`] waits for room between calls of its `idle`.
const IDLE_EVERY: Duration = Duration::from_millis(1);

/// Geometry and behaviour of a message queue.
///
/// ```
/// use clan_proto::queue::{QueueConfig, QueueError, QueueListener, HEADER};
///
/// let nic = clan::Nic::open_default()?;
/// let cfg = QueueConfig { slots: 16, slot_size: 512, ..QueueConfig::default() };
/// assert_eq!(cfg.slot_size - HEADER, 480, "payload bytes per slot");
/// let _listener = QueueListener::bind(&nic, cfg)?;
/// let bad = QueueConfig { slot_size: 100, ..QueueConfig::default() }; // not a multiple of 8
/// assert!(matches!(QueueListener::bind(&nic, bad), Err(QueueError::BadConfig(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// Slots in the receiver's ring (one stays free).
    pub slots: u64,
    /// Bytes of a slot, header included (a multiple of 8, more than the header). An odd
    /// number of cache lines (the default: 2 KiB and a line) spreads consecutive slots over
    /// the CPU's cache sets; a multiple of 128 bytes puts them in few.
    pub slot_size: u64,
    /// How long a blocked send or receive polls before it sleeps.
    /// Default: [`clan::default_spin`] (`CLAN_SPIN_US`, else 15 µs); zero: sleep at once,
    /// nothing polls.
    pub spin: Duration,
    /// Messages longer than this go by DMA in [`MsgSender::send_from`].
    pub dma_threshold: u64,
    /// Bound on connecting.
    pub connect_timeout: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            slots: 64,
            // 2 KiB and a line: slots 2 KiB apart would begin at two places in a page only,
            // and their first lines (where a small message lives) take turns in two sets of
            // the CPU's first-level cache, pushing out what else shares them; a line more
            // walks them through every set (a slot size that is an odd number of lines).
            slot_size: 2048 + 64,
            spin: clan::default_spin(),
            dma_threshold: crate::vmmc::DEFAULT_INLINE_MAX,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl QueueConfig {
    fn check(&self) -> Result<(), QueueError> {
        if self.slots < 2 || self.slot_size <= HEADER || self.slot_size % 8 != 0 {
            return Err(QueueError::BadConfig("at least 2 slots of more than 32 bytes, a multiple of 8"));
        }
        if self.slots.checked_mul(self.slot_size).is_none_or(|b| b > side::MAX_RING) {
            return Err(QueueError::BadConfig("the ring may have at most 1 GiB"));
        }
        Ok(())
    }
}

/// What went wrong.
///
/// ```
/// use clan_proto::queue::QueueError;
/// # use std::time::Duration;
/// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
/// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// assert!(matches!(rx.recv(Some(Duration::from_millis(5))), Err(QueueError::Timeout)));
/// tx.send(1, b"last")?;
/// drop(tx); // the sender goes away: what it sent is still received
/// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.data, b"last");
/// assert!(matches!(rx.recv(Some(Duration::from_secs(5))), Err(QueueError::Disconnected)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// Setting up the connection failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// An access failed (the peer unexported, the link broke).
    #[error(transparent)]
    Access(#[from] AccessError),
    /// A DMA failed.
    #[error(transparent)]
    Dma(#[from] clan::DmaError),
    /// The peer wrote something impossible into our memory.
    #[error("protocol violation by the peer: {0}")]
    Protocol(&'static str),
    /// The peer went away.
    #[error("the peer went away")]
    Disconnected,
    /// Nothing came in time.
    #[error("timed out")]
    Timeout,
    /// A bad configuration.
    #[error("invalid queue configuration: {0}")]
    BadConfig(&'static str),
}

impl From<QueueError> for std::io::Error {
    fn from(e: QueueError) -> std::io::Error {
        use std::io::ErrorKind as K;
        match e {
            QueueError::Setup(x) => x.into(),
            QueueError::Access(x) => x.into(),
            QueueError::Dma(x) => x.into(),
            QueueError::Protocol(_) => std::io::Error::new(K::InvalidData, e),
            QueueError::Disconnected => std::io::Error::new(K::ConnectionReset, e),
            QueueError::Timeout => std::io::Error::new(K::TimedOut, e),
            QueueError::BadConfig(_) => std::io::Error::new(K::InvalidInput, e),
        }
    }
}

fn wait_err(e: WaitError) -> QueueError {
    match e {
        WaitError::Timeout => QueueError::Timeout,
        WaitError::Dead => QueueError::Disconnected,
        WaitError::Stale => QueueError::Access(AccessError::Revoked),
    }
}

/// A message header ([`MsgReceiver::wait_header`]).
///
/// ```
/// use clan_proto::queue::Header;
/// # use std::time::Duration;
/// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
/// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// tx.send(3, b"abc")?;
/// assert_eq!(rx.wait_header(Some(Duration::from_secs(5)))?, Header { meta: 3, len: 3 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message's metadata word.
    pub meta: u64,
    /// Its total length.
    pub len: u64,
}

/// One part of a message, as [`MsgReceiver::try_recv_part`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// The message's metadata word.
    pub meta: u64,
    /// The whole message's length.
    pub total: u64,
    /// Where this part's bytes go in the message.
    pub at: u64,
    /// Whether it is the message's last part (the message is now whole).
    pub last: bool,
}

/// How many of a short message's first bytes [`MsgReceiver::try_recv_whole_with`] copies out
/// with its header.
pub const SHORT_PREFIX: u64 = 64;

/// What [`MsgReceiver::try_recv_whole_with`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Short<R> {
    /// A message of one slot, taken: what the taker returned.
    Taken(R),
    /// Nothing has come.
    Nothing,
    /// Something has, left for another take.
    Other,
}

/// A received message ([`MsgReceiver::recv`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
/// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// tx.send(7, b"payload")?;
/// let m: clan_proto::queue::Message = rx.recv(Some(Duration::from_secs(5)))?;
/// assert_eq!((m.meta, &m.data[..]), (7, &b"payload"[..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its metadata word.
    pub meta: u64,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// Accepts senders: each connection is a queue from one [`MsgSender`] to one
/// [`MsgReceiver`].
///
/// ```
/// use std::time::Duration;
/// use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
///
/// let nic = clan::Nic::open_default()?;
/// let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// let (addr, n2) = (listener.local_addr(), nic.clone());
/// let sender = std::thread::spawn(move || -> Result<u64, clan_proto::queue::QueueError> {
///     let mut tx = MsgSender::connect(&n2, addr, &QueueConfig::default())?;
///     for i in 0..10u64 {
///         tx.send(i, &i.to_le_bytes())?; // a metadata word and the bytes
///     }
///     Ok(tx.sent())
/// });
/// let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// for i in 0..10u64 {
///     let m = rx.recv(Some(Duration::from_secs(5)))?;
///     assert_eq!((m.meta, m.data), (i, i.to_le_bytes().to_vec()));
/// }
/// assert_eq!(sender.join().unwrap()?, 10);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct QueueListener {
    nic: Nic,
    ep: Endpoint,
    cfg: QueueConfig,
}

impl QueueListener {
    /// Listen on a new endpoint of `nic`.
    pub fn bind(nic: &Nic, cfg: QueueConfig) -> Result<QueueListener, QueueError> {
        cfg.check()?;
        let ep = nic.endpoint().map_err(SetupError::from)?;
        ep.listen();
        Ok(QueueListener { nic: nic.clone(), ep, cfg })
    }

    /// Where senders connect.
    pub fn local_addr(&self) -> EndpointAddr {
        self.ep.addr()
    }

    /// Accept the next sender: the receiving end of its queue. No connection request
    /// within `timeout` is [`QueueError::Timeout`]. As with TCP, a sender that gives up,
    /// dies or misbehaves during the hand-shake is not reported here: its request is
    /// dropped and the next one taken. Errors are this side's own.
    pub fn accept(&self, timeout: Option<Duration>) -> Result<MsgReceiver, QueueError> {
        self.accept_on(None, timeout)
    }

    /// As [`QueueListener::accept`], the receiver's endpoint reporting to `queue`: its
    /// [`MsgReceiver::readiness_tripwire`] and the end of its connection
    /// ([`clan::Event::Disconnect`]) are posted there, so one queue (one descriptor) can
    /// wait for many receivers.
    pub fn accept_to(&self, queue: &EventQueue, timeout: Option<Duration>) -> Result<MsgReceiver, QueueError> {
        self.accept_on(Some(queue), timeout)
    }

    fn accept_on(&self, queue: Option<&EventQueue>, timeout: Option<Duration>) -> Result<MsgReceiver, QueueError> {
        let g = Geometry { slot: self.cfg.slot_size, ..Geometry::bytes(self.cfg.slots * self.cfg.slot_size, 0) };
        let s = side::accept_next::<_, QueueError>(&self.ep, timeout, |req| {
            side::accept(&self.nic, queue, req, g, self.cfg.connect_timeout)
        })?
        .ok_or(QueueError::Timeout)?;
        MsgReceiver::new(s, &self.cfg)
    }
}

/// Slots whose pages a connection faults in when it is set up ([`ring_pages`]).
const PREFAULT_SLOTS: u64 = 4;

/// What of a ring of `slots` slots of `slot` bytes a connection faults in when it is set up
/// (offsets and lengths): the first [`PREFAULT_SLOTS`] slots' worth of the ring when slots
/// are at most a page (one call), else the first page of each of the first
/// [`PREFAULT_SLOTS`] slots (where a message's header and a short message lie; the rest of a
/// long slot is faulted in by the first long message, whose copy costs more anyway). Only
/// the first few: the first messages take no page fault on their way, and a connection is
/// not held up faulting in a whole ring (each page a system call and a page allocation on
/// the set-up's path, on both sides: `fi_pingpong -I 1` took 700–960 µs per transfer faulting
/// all 31 slots of the provider's ring, 590–640 faulting none), of which a short exchange
/// uses one slot. The rest fault in as the first lap of messages reaches them.
fn ring_pages(slots: u64, slot: u64) -> impl Iterator<Item = (u64, u64)> {
    const PAGE: u64 = 4096;
    let first = slots.min(PREFAULT_SLOTS);
    let whole = slot <= PAGE;
    let n = if whole { 1 } else { first };
    (0..n).map(move |i| if whole { (RING, first * slot) } else { (RING + i * slot, PAGE) })
}

/// The sending end (connected with [`MsgSender::connect`]; more at [`QueueListener`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
/// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// assert_eq!(tx.slot_payload(), 2048 + 64 - clan_proto::queue::HEADER);
/// tx.send(1, b"one slot")?;
/// assert!(tx.is_connected());
/// assert_eq!(tx.sent(), 1);
/// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.data, b"one slot");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MsgSender {
    ep: Arc<Endpoint>,
    conn: clan::Connection,
    mine: Aperture,
    peer: Arc<crate::side::PeerSide>,
    slots: u64,
    slot: u64,
    write: u64,
    /// Where slot `write` is (kept as `write` moves: no division per message).
    write_at: u64,
    space: Tripwire,
    spin: Duration,
    dma_threshold: u64,
    /// The last DMA chain posted ([`MsgSender::send_from`]): it publishes its message with
    /// its last request, so no message sent by PIO may publish its own before it has.
    dma: Option<DmaTicket>,
    /// A small slot's header fields and body, put together to go in one transfer.
    staging: Vec<u8>,
    /// The receiver's read position as last loaded (re-loaded only when the ring looks full).
    read_seen: u64,
}

impl MsgSender {
    /// Who the peer is, as far as the NIC could prove it (the receiver's process): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.conn.peer_identity()
    }

    /// Connect to the receiver listening at `to` (anything that names endpoints:
    /// [`clan::ToEndpointAddrs`]).
    pub fn connect(nic: &Nic, to: impl clan::ToEndpointAddrs, cfg: &QueueConfig) -> Result<MsgSender, QueueError> {
        cfg.check()?;
        // Our side holds the counter mirrored by the receiver, and one staging word per slot
        // (the source of the counter updates that DMA chains write).
        let s = side::connect(nic, None, to, Geometry::bytes(cfg.slots.max(2) * 8, 0), cfg.connect_timeout)?;
        if s.peer_slot == 0 || s.peer_slot <= HEADER {
            return Err(QueueError::Protocol("the peer is not a message queue"));
        }
        let space = wait_tripwire(&s.mine, CTL_READ..CTL_READ + 8)?;
        let tx = MsgSender {
            slots: s.peer_cap / s.peer_slot,
            slot: s.peer_slot,
            ep: s.ep,
            conn: s.conn,
            mine: s.mine,
            peer: s.peer,
            write: 0,
            write_at: RING,
            space,
            spin: cfg.spin,
            dma_threshold: cfg.dma_threshold,
            dma: None,
            staging: Vec::with_capacity((HEADER + SMALL_PART) as usize),
            read_seen: 0,
        };
        // The pages our first messages land in, faulted in now rather than on the way.
        if let Ok(m) = tx.peer.get() {
            for (off, len) in ring_pages(tx.slots, tx.slot) {
                let _ = m.prefault(off, len);
            }
        }
        Ok(tx)
    }

    /// Payload bytes per slot.
    pub fn slot_payload(&self) -> u64 {
        self.slot - HEADER
    }

    fn read_pos(&self) -> Result<u64, QueueError> {
        let r = self.mine.load_u64(CTL_READ)?;
        if r > self.write {
            return Err(QueueError::Protocol("the receiver claims to have read more than was written"));
        }
        // (a slot is written only when the position last seen leaves room for it: one
        // further back than that went backwards)
        if self.write - r > self.slots - 1 {
            return Err(QueueError::Protocol("the receiver's read position went back"));
        }
        Ok(r)
    }

    fn free(&self) -> Result<u64, QueueError> {
        Ok(self.slots - 1 - (self.write - self.read_pos()?))
    }

    /// Whether a slot is free, looking at the receiver's position only when the one last
    /// seen says the ring is full (that word's line then stays with the receiver, which
    /// updates it, instead of moving on every send).
    fn has_room(&mut self) -> Result<bool, QueueError> {
        if self.slots - 1 > self.write - self.read_seen {
            return Ok(true);
        }
        self.read_seen = self.read_pos()?;
        Ok(self.slots - 1 > self.write - self.read_seen)
    }

    fn wait_free(&self, deadline: Option<Instant>) -> Result<(), QueueError> {
        wait_check(
            &self.space,
            Spin::for_conn(self.spin, &self.conn),
            deadline,
            SLICE,
            || Ok(self.free()? > 0),
            || !self.conn.is_alive(),
            wait_err,
        )
    }

    /// Write the header of the next slot at `at`: its fields, then its sequence word (an
    /// atomic store after them, so a reader that sees the new sequence sees the fields).
    fn write_header(&self, at: u64, part_len: u64, flags: u32, meta: u64, total: u64) -> Result<(), QueueError> {
        let h = header_fields(part_len, flags, meta, total);
        self.peer.get()?.write_then_store_u64(at + 8, &h, at, self.write + 1)?;
        Ok(())
    }

    #[inline]
    fn slot_off(&self, i: u64) -> u64 {
        if i == self.write { self.write_at } else { RING + (i % self.slots) * self.slot }
    }

    /// Move `write` to `w` (and where its slot is).
    #[inline]
    fn set_write(&mut self, w: u64) {
        self.write_at = if w == self.write + 1 && self.write_at + self.slot < RING + self.slots * self.slot {
            self.write_at + self.slot
        } else {
            RING + (w % self.slots) * self.slot
        };
        self.write = w;
    }

    /// Wait until the last DMA chain has run, before a message sent by PIO publishes its
    /// slot: the write counter covers every slot before it, so publishing earlier would
    /// publish the DMA message before its body, and the chain's own counter update, landing
    /// later, would move the counter back. Chains need no such wait: an endpoint's DMA
    /// requests run in order. A chain that failed fails every later send (its slot is
    /// counted but never published: the queue cannot go on).
    fn settle_dma(&mut self, deadline: Option<Instant>) -> Result<(), QueueError> {
        let Some(t) = &self.dma else { return Ok(()) };
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match t.wait(left) {
            Ok(()) => {
                self.dma = None;
                Ok(())
            }
            Err(clan::DmaError::Timeout) => Err(QueueError::Timeout),
            Err(e) => Err(e.into()),
        }
    }

    /// Send a message (any length: longer than a slot, it goes as a multi-part message),
    /// waiting for room as needed.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// let big = vec![9u8; 100_000]; // about 50 slots of the default 2 KiB, more than the ring holds
    /// let sending = std::thread::spawn(move || tx.send(1, &big).map(|()| tx));
    /// let m = rx.recv(Some(Duration::from_secs(5)))?;
    /// assert_eq!((m.meta, m.data.len()), (1, 100_000));
    /// let tx = sending.join().unwrap()?;
    /// assert!(tx.sent() > 1, "went as a multi-part message");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send(&mut self, meta: u64, data: &[u8]) -> Result<(), QueueError> {
        self.send_timeout(meta, data, None)
    }

    /// [`MsgSender::send`] with a time limit for each slot to free up.
    ///
    /// ```
    /// use clan_proto::queue::{MsgSender, QueueConfig, QueueError, QueueListener};
    /// # use std::time::Duration;
    /// # let nic = clan::Nic::open_default()?;
    /// let cfg = QueueConfig { slots: 4, ..QueueConfig::default() }; // 3 messages in flight
    /// # let listener = QueueListener::bind(&nic, cfg.clone())?;
    /// # let (addr, n2, c2) = (listener.local_addr(), nic.clone(), cfg.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2));
    /// # let _rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// for i in 0..3 {
    ///     tx.send_timeout(i, b"fits", Some(Duration::from_secs(5)))?;
    /// }
    /// // Nobody receives: the fourth finds no room in time.
    /// let r = tx.send_timeout(3, b"no room", Some(Duration::from_millis(5)));
    /// assert!(matches!(r, Err(QueueError::Timeout)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_timeout(&mut self, meta: u64, data: &[u8], timeout: Option<Duration>) -> Result<(), QueueError> {
        self.send_inner(meta, &[data], timeout, None)
    }

    /// [`MsgSender::send`] that, while it waits for room, calls `idle` every so often
    /// (about every millisecond of waiting): a sender whose receiver may itself be waiting
    /// to send to it takes in that receiver's messages there, so that two peers sending each
    /// other more than their rings hold do not wait for each other forever.
    pub fn send_idling(&mut self, meta: u64, data: &[u8], idle: &mut dyn FnMut()) -> Result<(), QueueError> {
        self.send_inner(meta, &[data], None, Some(idle))
    }

    /// [`MsgSender::send`] of the bytes of `parts` one after the other, as one message: what
    /// a caller with a header and a body sends without first copying them together.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// let body = vec![7u8; 10_000]; // several slots
    /// let sending = std::thread::spawn(move || tx.send_vectored(1, &[b"head:", &body]).map(|()| tx));
    /// let m = rx.recv(Some(Duration::from_secs(5)))?;
    /// assert_eq!((&m.data[..5], m.data.len()), (&b"head:"[..], 10_005));
    /// # sending.join().unwrap()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_vectored(&mut self, meta: u64, parts: &[&[u8]]) -> Result<(), QueueError> {
        self.send_inner(meta, parts, None, None)
    }

    /// Send a small message now if it can go at once: at most one slot's payload and 512
    /// bytes, the ring with room, no DMA in flight. `Ok(false)`: nothing was sent (send it
    /// with [`MsgSender::send_vectored`], which waits). The short path of a sender of small
    /// messages that never waits: the slot is put together on the stack and written in one
    /// transfer, as `send_vectored` writes it.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// assert!(tx.try_send_small(7, &[b"head ", b"and body"])?);
    /// assert!(!tx.try_send_small(8, &[&[0u8; 600]])?, "too long for the short path");
    /// let m = rx.recv(Some(Duration::from_secs(5)))?;
    /// assert_eq!((m.meta, &m.data[..]), (7, &b"head and body"[..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_send_small(&mut self, meta: u64, parts: &[&[u8]]) -> Result<bool, QueueError> {
        let n: usize = parts.iter().map(|p| p.len()).sum();
        if n as u64 > self.slot_payload().min(SMALL_PART) || self.dma.is_some() || !self.has_room()? {
            return Ok(false);
        }
        // (put together in the reused staging buffer: nothing to allocate or clear)
        self.staging.clear();
        self.staging.extend_from_slice(&header_fields(n as u64, FIRST | SEALED, meta, n as u64));
        for p in parts {
            self.staging.extend_from_slice(p);
        }
        let off = self.slot_off(self.write);
        self.set_write(self.write + 1);
        self.peer.get()?.write_led_then_store_u64(off, self.write, &self.staging, RX_WRITE, self.write)?;
        Ok(true)
    }

    /// [`MsgSender::send_vectored`] that calls `idle` while it waits for room, as
    /// [`MsgSender::send_idling`] does.
    pub fn send_vectored_idling(
        &mut self,
        meta: u64,
        parts: &[&[u8]],
        idle: &mut dyn FnMut(),
    ) -> Result<(), QueueError> {
        self.send_inner(meta, parts, None, Some(idle))
    }

    fn send_inner(
        &mut self,
        meta: u64,
        data: &[&[u8]],
        timeout: Option<Duration>,
        mut idle: Option<&mut dyn FnMut()>,
    ) -> Result<(), QueueError> {
        let payload = self.slot_payload();
        let total: u64 = data.iter().map(|d| d.len() as u64).sum();
        let mut done = 0u64;
        let mut first = true;
        // Where the next byte comes from: part `k`, at `within`.
        let (mut k, mut within) = (0usize, 0usize);
        self.settle_dma(timeout.map(|t| Instant::now() + t))?;
        loop {
            if !self.has_room()? {
                match idle.as_deref_mut() {
                    None => self.wait_free(timeout.map(|t| Instant::now() + t))?,
                    Some(idle) => loop {
                        idle();
                        match self.wait_free(Some(Instant::now() + IDLE_EVERY)) {
                            Ok(()) => break,
                            Err(QueueError::Timeout) => {}
                            Err(e) => return Err(e),
                        }
                    },
                }
            }
            let n = (total - done).min(payload);
            let flags = if first { FIRST } else { 0 } | if done + n < total { MORE } else { 0 };
            let at = self.slot_off(self.write);
            // The pieces of the parts that make this slot's `n` bytes.
            let mut pieces: [&[u8]; 4] = [&[]; 4];
            let mut npieces = 0;
            let mut left = n as usize;
            while left > 0 {
                let Some(part) = data.get(k) else { break };
                let take = (part.len() - within).min(left);
                if take > 0 {
                    if npieces == pieces.len() {
                        // (more pieces than fit one write each: the rest of this slot waits
                        // for the next; never happens with the header-and-body of callers)
                        break;
                    }
                    pieces[npieces] = &part[within..within + take];
                    npieces += 1;
                }
                within += take;
                left -= take;
                if within == part.len() {
                    k += 1;
                    within = 0;
                }
            }
            let n = n - left as u64;
            let flags = if left > 0 { flags | MORE } else { flags };
            let pieces = &pieces[..npieces];
            if n <= SMALL_PART {
                // The slot in one transfer with one fence: its header fields and body, its
                // sequence word once they are in place, then the counter.
                let fields = header_fields(n, flags | SEALED, meta, total);
                self.staging.clear();
                self.staging.extend_from_slice(&fields);
                for p in pieces {
                    self.staging.extend_from_slice(p);
                }
                self.set_write(self.write + 1);
                self.peer.get()?.write_led_then_store_u64(at, self.write, &self.staging, RX_WRITE, self.write)?;
            } else {
                // Header, then body, then the counter: a receiver watching the header wakes
                // while the body is still on its way.
                self.write_header(at, n, flags, meta, total)?;
                self.set_write(self.write + 1);
                let peer = self.peer.get()?;
                let mut off = at + HEADER;
                for (i, p) in pieces.iter().enumerate() {
                    if i + 1 == pieces.len() {
                        peer.write_then_store_u64(off, p, RX_WRITE, self.write)?;
                    } else {
                        peer.write(off, p)?;
                    }
                    off += p.len() as u64;
                }
            }
            done += n;
            first = false;
            if done >= total {
                return Ok(());
            }
        }
    }

    /// Send several messages, in order, as [`MsgSender::send`] would one by one, but with
    /// one publication for each run of them that fits the free slots: each run of small
    /// messages (one slot each, at most 512 bytes) is written in one transfer, and the
    /// receiver's counter moves once for the whole run (one fence instead of one per
    /// message: the message rate of small messages goes up several times). Longer messages
    /// in the batch go as `send` sends them. Waits for room as `send` does.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// let msgs: Vec<(u64, &[u8])> = (0..32u64).map(|i| (i, &b"tick"[..])).collect();
    /// let sending = std::thread::spawn(move || tx.send_batch(&msgs)); // more than the ring holds
    /// for i in 0..32 {
    ///     assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.meta, i);
    /// }
    /// sending.join().unwrap()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_batch(&mut self, msgs: &[(u64, &[u8])]) -> Result<(), QueueError> {
        let limit = self.slot_payload().min(SMALL_PART);
        let small = |m: &(u64, &[u8])| m.1.len() as u64 <= limit;
        let mut i = 0;
        while i < msgs.len() {
            if !small(&msgs[i]) {
                self.send_inner(msgs[i].0, &[msgs[i].1], None, None)?;
                i += 1;
                continue;
            }
            self.settle_dma(None)?;
            if !self.has_room()? {
                self.wait_free(None)?;
                self.read_seen = self.read_pos()?;
            }
            // The run: small messages, as many as there are free slots, up to the ring's end.
            let free = self.slots - 1 - (self.write - self.read_seen);
            let to_end = self.slots - self.write % self.slots;
            let max = free.min(to_end).min(MAX_RUN) as usize;
            let run = msgs[i..].iter().take(max).take_while(|m| small(m)).count();
            let mut staging = std::mem::take(&mut self.staging);
            staging.clear();
            for (meta, data) in &msgs[i..i + run] {
                let n = data.len() as u64;
                staging.extend_from_slice(&header_fields(n, FIRST | SEALED, *meta, n));
                staging.extend_from_slice(data);
            }
            let mut parts: Vec<(u64, &[u8])> = Vec::with_capacity(run);
            let mut at = 0usize;
            for (k, (_, data)) in msgs[i..i + run].iter().enumerate() {
                let n = (HEADER - 8) as usize + data.len();
                parts.push((self.write + k as u64 + 1, &staging[at..at + n]));
                at += n;
            }
            let first = self.slot_off(self.write);
            let end = self.write + run as u64;
            let sent = self.peer.get().map_err(QueueError::from).and_then(|p| {
                p.write_led_run_then_store_u64(first, self.slot, &parts, RX_WRITE, end).map_err(QueueError::from)
            });
            drop(parts);
            self.staging = staging;
            sent?;
            self.set_write(end);
            i += run;
        }
        Ok(())
    }

    /// Send `len` bytes of local aperture `src` at `off` (at most one slot's payload): by
    /// programmed I/O, or, above [`QueueConfig::dma_threshold`], by the DMA engine — the
    /// header is written now, the body and the counter update by a DMA chain, so the message
    /// appears whole and in order; the returned ticket says when `src` may be reused. A
    /// message sent by PIO after it ([`MsgSender::send`], or `send_from` at or below the
    /// threshold) first waits for the chain to run, so that it cannot publish this one early.
    ///
    /// ```
    /// use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # use std::time::Duration;
    /// # let nic = clan::Nic::open_default()?;
    /// let cfg = QueueConfig { slot_size: 64 << 10, slots: 4, dma_threshold: 4096, ..QueueConfig::default() };
    /// # let listener = QueueListener::bind(&nic, cfg.clone())?;
    /// # let (addr, n2, c2) = (listener.local_addr(), nic.clone(), cfg.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// let ep = nic.endpoint()?;
    /// let src = ep.export(32 << 10)?; // local memory the DMA engine reads
    /// src.fill(0, 32 << 10, 1)?;
    /// assert!(tx.send_from(1, &src, 0, 100)?.is_none(), "small: by programmed I/O");
    /// let ticket = tx.send_from(2, &src, 0, 32 << 10)?.expect("large: by DMA");
    /// ticket.wait(Some(Duration::from_secs(5)))?; // now `src` may be reused
    /// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.data.len(), 100);
    /// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.data.len(), 32 << 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_from(
        &mut self,
        meta: u64,
        src: &Aperture,
        off: u64,
        len: u64,
    ) -> Result<Option<DmaTicket>, QueueError> {
        if len > self.slot_payload() {
            return Err(QueueError::BadConfig("send_from sends at most one slot's payload"));
        }
        if self.free()? == 0 {
            self.wait_free(None)?;
        }
        let at = self.slot_off(self.write);
        self.write_header(at, len, FIRST, meta, len)?;
        if len <= self.dma_threshold {
            self.settle_dma(None)?;
            self.peer.get()?.write_from(at + HEADER, src, off, len)?;
            self.set_write(self.write + 1);
            self.peer.get()?.store_u64(RX_WRITE, self.write)?;
            return Ok(None);
        }
        self.set_write(self.write + 1);
        // The counter's value, staged in our own memory for the DMA engine to read (one word
        // per slot: it stays untouched until this slot is reused, i.e. long after).
        let staged = RING + (self.write % self.slots) * 8;
        self.mine.store_u64(staged, self.write)?;
        let chain = vec![
            DmaRequest::write(src, off, self.peer.get()?, at + HEADER, len)?,
            DmaRequest::write(&self.mine, staged, self.peer.get()?, RX_WRITE, 8)?,
        ];
        let t = self.ep.dma_chain(chain, DmaOptions::new())?;
        self.dma = Some(t.clone());
        Ok(Some(t))
    }

    /// Whether the receiver is still there (a send to a receiver that went away fails).
    pub fn is_connected(&self) -> bool {
        self.conn.is_alive()
    }

    /// Messages (slots) sent.
    pub fn sent(&self) -> u64 {
        self.write
    }
}

/// The receiving end (from [`QueueListener::accept`]; more there).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
/// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
/// # let mut tx = connecting.join().unwrap()?;
/// assert_eq!(rx.try_recv()?, None, "never waits");
/// tx.send(8, b"hi")?;
/// let m = rx.recv(Some(Duration::from_secs(5)))?;
/// assert_eq!((m.meta, &m.data[..], rx.received()), (8, &b"hi"[..], 1));
/// drop(tx);
/// # let deadline = std::time::Instant::now() + Duration::from_secs(5);
/// # while rx.is_connected() { assert!(std::time::Instant::now() < deadline); std::thread::yield_now(); }
/// assert!(!rx.is_connected(), "the sender went away");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MsgReceiver {
    _ep: Arc<Endpoint>,
    conn: clan::Connection,
    mine: Aperture,
    peer: Arc<crate::side::PeerSide>,
    slots: u64,
    slot: u64,
    read: u64,
    /// Where slot `read` is (kept as `read` moves: no division per message).
    read_at: u64,
    /// The `read` last mirrored into the sender.
    published: u64,
    /// The sender's counter as last loaded (every slot below it is published).
    written_seen: u64,
    /// Fires when the sender moves its counter: made by the first wait (a receiver that
    /// only polls has none, and senders' stores look at one tripwire less).
    data: std::sync::OnceLock<Tripwire>,
    spin: Duration,
    /// The message being taken in part by part (by [`MsgReceiver::try_recv`], or a `recv`
    /// that timed out): its metadata word, its length, its bytes so far.
    partial: Option<(u64, u64, Vec<u8>)>,
    /// The message being taken in part by part by [`MsgReceiver::try_recv_part`]: its
    /// metadata word, its length, its bytes handed out so far.
    parting: Option<(u64, u64, u64)>,
}

impl MsgReceiver {
    /// Who the peer is, as far as the NIC could prove it (the sender's process): a process of this host with
    /// its kernel credentials (pid, uid), or a NIC across a link. As `SO_PEERCRED` is for a
    /// Unix socket.
    pub fn peer_identity(&self) -> clan::PeerIdentity {
        self.conn.peer_identity()
    }

    fn new(s: side::Sides, cfg: &QueueConfig) -> Result<MsgReceiver, QueueError> {
        // The pages the first messages land in, faulted in now rather than on the way.
        for (off, len) in ring_pages(cfg.slots, cfg.slot_size) {
            let _ = s.mine.prefault(off, len);
        }
        Ok(MsgReceiver {
            _ep: s.ep,
            conn: s.conn,
            mine: s.mine,
            peer: s.peer,
            slots: cfg.slots,
            slot: cfg.slot_size,
            read: 0,
            read_at: RING,
            published: 0,
            written_seen: 0,
            data: std::sync::OnceLock::new(),
            spin: cfg.spin,
            partial: None,
            parting: None,
        })
    }

    fn written(&self) -> Result<u64, QueueError> {
        let w = self.mine.load_u64(RX_WRITE)?;
        // (behind `read` when sealed slots were taken before the counter's store that
        // covers them was seen: nothing more is published)
        let w = w.max(self.read);
        if w - self.read > self.slots - 1 {
            return Err(QueueError::Protocol("the sender's write counter is impossible"));
        }
        Ok(w)
    }

    /// Slots ready to be taken.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// assert_eq!(rx.pending()?, 0);
    /// tx.send(1, b"a")?;
    /// tx.send(2, b"b")?;
    /// assert_eq!(rx.pending()?, 2, "no waiting: one load of the receiver's own memory");
    /// assert_eq!(rx.try_recv()?.map(|m| m.meta), Some(1));
    /// assert_eq!(rx.received(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pending(&self) -> Result<u64, QueueError> {
        Ok(self.written()? - self.read)
    }

    /// Whether a slot is ready, looking at the sender's counter only once every slot seen
    /// published by its last look has been taken.
    fn has_published(&mut self) -> Result<bool, QueueError> {
        Ok(self.next_header()?.is_some())
    }

    /// The header of the next slot to take (part length, flags, metadata, total length) if
    /// it is published: sealed ([`SEALED`]: its sequence word, one cache line, says so), or
    /// covered by the write counter (looked at only when the slot has its sequence word but
    /// is not sealed).
    #[inline(always)]
    fn next_header(&mut self) -> Result<Option<(u64, u32, u64, u64)>, QueueError> {
        let i = self.read;
        let h = self.header_of(i)?;
        match h {
            Some((_, flags, _, _)) if flags & SEALED != 0 || self.written_seen > i => Ok(h),
            None if self.written_seen > i => Err(QueueError::Protocol("a published slot without its header")),
            // Every sender writes a slot's sequence word before the counter that covers it:
            // with no sequence word there is nothing to publish, and the counter's line is
            // left alone (a receiver polling it would take it from the sender storing it).
            None => Ok(None),
            Some(_) => {
                self.written_seen = self.written()?;
                Ok(if self.written_seen > i { h } else { None })
            }
        }
    }

    #[inline]
    fn slot_off(&self, i: u64) -> u64 {
        if i == self.read { self.read_at } else { RING + (i % self.slots) * self.slot }
    }

    /// Read and check the header of slot `i` (which must be published, unless `landed`).
    #[inline(always)]
    fn header_of(&self, i: u64) -> Result<Option<(u64, u32, u64, u64)>, QueueError> {
        // SYNC POINT: the Acquire load of the sequence word pairs with the sender's Release
        // store of it, which follows the fields.
        let seq = self.mine.load_u64(self.slot_off(i))?;
        if seq != i + 1 {
            return Ok(None);
        }
        let mut h = [0u8; HEADER as usize];
        self.mine.read(self.slot_off(i), &mut h)?;
        let word = |a: usize| u64::from_le_bytes(h[a..a + 8].try_into().unwrap_or([0; 8]));
        let part = u64::from(u32::from_le_bytes(h[8..12].try_into().unwrap_or([0; 4])));
        let flags = u32::from_le_bytes(h[12..16].try_into().unwrap_or([0; 4]));
        if part > self.slot - HEADER {
            return Err(QueueError::Protocol("a part longer than a slot"));
        }
        Ok(Some((part, flags, word(16), word(24))))
    }

    fn wait_published(&self, deadline: Option<Instant>) -> Result<(), QueueError> {
        let data = match self.data.get() {
            Some(t) => t,
            None => {
                let t = wait_tripwire(&self.mine, RX_WRITE..RX_WRITE + 8)?;
                self.data.get_or_init(|| t)
            }
        };
        // Ready when the counter covers the next slot. Its sequence word is written before
        // the counter: a counter without it is a lie (which would otherwise send `recv`
        // round between a take that finds nothing and a wait that finds something).
        let ready = || {
            if self.pending()? == 0 {
                return Ok(false);
            }
            match self.header_of(self.read)? {
                Some(_) => Ok(true),
                None => Err(QueueError::Protocol("a published slot without its header")),
            }
        };
        wait_check(
            data,
            Spin::for_conn(self.spin, &self.conn),
            deadline,
            SLICE,
            ready,
            || !self.conn.is_alive(),
            wait_err,
        )
    }

    fn consume(&mut self) -> Result<(), QueueError> {
        self.read += 1;
        self.read_at += self.slot;
        if self.read_at == RING + self.slots * self.slot {
            self.read_at = RING;
        }
        // Mirror read_i into the sender, lazily: every quarter of the slots. A sender waits
        // for a slot only when it saw `slots - 1` in use past the mirrored position; a
        // receiver that consumes them has consumed a quarter, so it has published before it
        // can wait for a message in turn. If the store fails the sender has gone (it may
        // well have, after its last message): what it sent is in our memory and is still
        // read; waiting for more notices the connection is down.
        if self.read - self.published >= (self.slots / 4).max(1) {
            self.published = self.read;
            let _ = self.peer.get().and_then(|m| m.store_u64(CTL_READ, self.read));
        }
        Ok(())
    }

    /// Receive the next message (waiting for it; its parts as they come). A timeout in
    /// the middle of a message keeps the parts taken: the next receive goes on from there.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Message, QueueError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(m) = self.take_parts()? {
                return Ok(m);
            }
            self.wait_published(deadline)?;
        }
    }

    /// Take the parts of the next message that are there without waiting: the message once
    /// its last part is taken, `None` until then (the parts taken are kept for the next
    /// call). A message longer than the ring comes in over several calls, as its sender
    /// frees room by them.
    ///
    /// A loop that polls this for a sender on another host should apply the link's traffic
    /// itself every few polls ([`clan::Nic::spin_links`]), as [`MsgReceiver::recv`]'s spin
    /// does; otherwise the NIC's engine thread does, when it gets a CPU.
    pub fn try_recv(&mut self) -> Result<Option<Message>, QueueError> {
        self.take_parts()
    }

    /// [`MsgReceiver::try_recv`] into `buf` (replacing what it held): the message's
    /// metadata word once its last part is taken (its bytes in `buf`), `None` until then. A
    /// message of one slot is read straight into `buf`, which is reused: a receiver taking
    /// small messages this way allocates nothing once `buf` has grown.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// let mut buf = Vec::with_capacity(256);
    /// assert_eq!(rx.try_recv_into(&mut buf)?, None);
    /// tx.send(3, b"one")?;
    /// tx.send(4, b"two")?;
    /// assert_eq!(rx.try_recv_into(&mut buf)?, Some(3));
    /// assert_eq!(buf, b"one");
    /// assert_eq!(rx.try_recv_into(&mut buf)?, Some(4));
    /// assert_eq!(buf, b"two");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_recv_into(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>, QueueError> {
        if !self.has_published()? {
            return Ok(None);
        }
        if self.partial.is_none() && self.parting.is_none() {
            let (part, flags, meta, total) =
                self.header_of(self.read)?.ok_or(QueueError::Protocol("a published slot without its header"))?;
            if flags & FIRST != 0 && flags & MORE == 0 {
                if part != total {
                    return Err(QueueError::Protocol("a message shorter than its header says"));
                }
                buf.clear();
                buf.resize(part as usize, 0);
                self.mine.read(self.slot_off(self.read) + HEADER, buf)?;
                self.consume()?;
                return Ok(Some(meta));
            }
        }
        Ok(self.take_parts()?.map(|m| {
            *buf = m.data;
            m.meta
        }))
    }

    /// Take the next part of a message without waiting, into `buf` (replacing what it held,
    /// at most one slot's payload: `buf` is reused and never grows past it): where it goes
    /// in its message, and whether the message is now whole. A receiver that puts a long
    /// message's parts where they belong as they come needs no buffer for the whole message.
    /// A message begun this way is finished this way (and one begun by
    /// [`MsgReceiver::recv`] or [`MsgReceiver::try_recv`] by those): mixing them in the
    /// middle of a message is an error.
    ///
    /// ```
    /// use clan_proto::queue::Part;
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// let cfg = QueueConfig { slot_size: 1024, ..QueueConfig::default() };
    /// # let listener = QueueListener::bind(&nic, cfg.clone())?;
    /// # let (addr, n2, c2) = (listener.local_addr(), nic.clone(), cfg.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// tx.send(9, &[1u8; 3000])?; // three slots' worth
    /// let (mut whole, mut buf) = (vec![0u8; 3000], Vec::new());
    /// loop {
    ///     let Some(p) = rx.try_recv_part(&mut buf)? else { continue };
    ///     assert_eq!((p.meta, p.total), (9, 3000));
    ///     whole[p.at as usize..p.at as usize + buf.len()].copy_from_slice(&buf);
    ///     if p.last {
    ///         break;
    ///     }
    /// }
    /// assert!(whole.iter().all(|&b| b == 1) && buf.len() < 1024);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_recv_part(&mut self, buf: &mut Vec<u8>) -> Result<Option<Part>, QueueError> {
        if self.partial.is_some() {
            return Err(QueueError::BadConfig("a message begun by recv or try_recv is finished by them"));
        }
        let Some((part, flags, m, total)) = self.next_header()? else { return Ok(None) };
        let (meta, total, at) = match self.parting.take() {
            None => {
                if flags & FIRST == 0 {
                    return Err(QueueError::Protocol("a message that does not start with its first part"));
                }
                if total > (1 << 32) {
                    return Err(QueueError::Protocol("a message of more than 4 GiB"));
                }
                (m, total, 0)
            }
            Some((meta, total, at)) => {
                if flags & FIRST != 0 || m != meta {
                    return Err(QueueError::Protocol("parts of different messages interleaved"));
                }
                (meta, total, at)
            }
        };
        if at + part > total {
            return Err(QueueError::Protocol("parts longer than the message"));
        }
        let last = flags & MORE == 0;
        if last && at + part != total {
            return Err(QueueError::Protocol("a message shorter than its header says"));
        }
        // (only what grows the buffer is zeroed first: it is reused, and overwritten)
        if buf.len() > part as usize {
            buf.truncate(part as usize);
        } else {
            buf.resize(part as usize, 0);
        }
        self.mine.read(self.slot_off(self.read) + HEADER, buf)?;
        self.consume()?;
        if !last {
            self.parting = Some((meta, total, at + part));
        }
        Ok(Some(Part { meta, total, at, last }))
    }

    /// The next message if it came whole in one slot, the short message's case, read where
    /// it lies: `take(meta, first, body)` gets its metadata word, its first bytes (up to
    /// [`SHORT_PREFIX`], copied out with its header in one read) and the whole of it in the
    /// ring ([`InPlace`], memory the sender writes: copy what you use), and says whether it
    /// took it. [`Short::Taken`]: the slot is consumed. [`Short::Other`]: the message stays
    /// for the next take, of any kind, as it does when it comes in several parts or one was
    /// begun part by part (take those with [`MsgReceiver::try_recv_part`], which also says
    /// what is wrong with a malformed one). [`Short::Nothing`]: nothing has come. A receiver
    /// that matches short messages to their destinations before copying them copies each
    /// once, from the ring to where it belongs.
    ///
    /// ```
    /// use clan_proto::queue::Short;
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// assert_eq!(rx.try_recv_whole_with(|_, _, _| Some(()))?, Short::Nothing);
    /// tx.send(1, b"not for me")?;
    /// tx.send(2, b"mine")?;
    /// # while rx.pending()? < 2 { std::thread::yield_now(); }
    /// // Left where it is: the next take sees it again.
    /// assert_eq!(rx.try_recv_whole_with(|meta, _, _| (meta == 2).then_some(()))?, Short::Other);
    /// assert_eq!(rx.try_recv()?.map(|m| m.data), Some(b"not for me".to_vec()));
    /// let took = rx.try_recv_whole_with(|meta, first, _| Some((meta, first.to_vec())))?;
    /// assert_eq!(took, Short::Taken((2, b"mine".to_vec())));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn try_recv_whole_with<R>(
        &mut self,
        take: impl FnOnce(u64, &[u8], InPlace<'_>) -> Option<R>,
    ) -> Result<Short<R>, QueueError> {
        if self.partial.is_some() || self.parting.is_some() {
            return Ok(Short::Other);
        }
        let i = self.read;
        let at = self.read_at;
        // SYNC POINT: the Acquire load of the sequence word pairs with the sender's Release
        // store of it, which follows the slot's fields and body (`header_of`'s, by hand).
        if self.mine.load_u64(at)? != i + 1 {
            // (with the counter past it, a slot without its sequence word: `next_header` says so)
            return Ok(if self.written_seen > i { Short::Other } else { Short::Nothing });
        }
        // The header and the body's first bytes, in one copy (what lies past the message in
        // the slot is read and never handed out).
        let mut h = [0u8; (HEADER + SHORT_PREFIX) as usize];
        let n = (HEADER + SHORT_PREFIX).min(self.slot) as usize;
        self.mine.read(at, &mut h[..n])?;
        let part = u64::from(u32::from_le_bytes([h[8], h[9], h[10], h[11]]));
        let flags = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        let word = |a: usize| u64::from_le_bytes(h[a..a + 8].try_into().unwrap_or([0; 8]));
        let (meta, total) = (word(16), word(24));
        // Sealed (its sequence word covers it), first and last, as long as it says, within a
        // slot; anything else the whole way.
        if flags & (SEALED | FIRST | MORE) != SEALED | FIRST || part != total || part > self.slot - HEADER {
            return Ok(Short::Other);
        }
        let first = &h[HEADER as usize..n.min((HEADER + part) as usize)];
        match take(meta, first, InPlace::new(&self.mine, at + HEADER, part)) {
            Some(r) => {
                self.consume()?;
                Ok(Short::Taken(r))
            }
            None => Ok(Short::Other),
        }
    }

    fn take_parts(&mut self) -> Result<Option<Message>, QueueError> {
        if self.parting.is_some() {
            return Err(QueueError::BadConfig("a message begun by try_recv_part is finished by it"));
        }
        while let Some((part, flags, m, total)) = self.next_header()? {
            let (meta, total, mut data) = match self.partial.take() {
                None => {
                    if flags & FIRST == 0 {
                        return Err(QueueError::Protocol("a message that does not start with its first part"));
                    }
                    if total > (1 << 32) {
                        return Err(QueueError::Protocol("a message of more than 4 GiB"));
                    }
                    // (reserved up to 1 MiB ahead: `total` is what the sender says; the
                    // parts grow the buffer as they come)
                    (m, total, Vec::with_capacity(total.min(1 << 20) as usize))
                }
                Some((meta, total, data)) => {
                    if flags & FIRST != 0 || m != meta {
                        return Err(QueueError::Protocol("parts of different messages interleaved"));
                    }
                    (meta, total, data)
                }
            };
            let at = data.len();
            if at as u64 + part > total {
                return Err(QueueError::Protocol("parts longer than the message"));
            }
            data.resize(at + part as usize, 0);
            self.mine.read(self.slot_off(self.read) + HEADER, &mut data[at..])?;
            self.consume()?;
            if flags & MORE == 0 {
                if data.len() as u64 != total {
                    return Err(QueueError::Protocol("a message shorter than its header says"));
                }
                return Ok(Some(Message { meta, data }));
            }
            self.partial = Some((meta, total, data));
        }
        Ok(None)
    }

    /// Take the next message if it fits one slot and lend it in place (no copy); a
    /// multi-part message is an error here (use [`MsgReceiver::recv`]).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// tx.send(5, b"zero copy")?;
    /// let (meta, first) = rx.recv_in_place(Some(Duration::from_secs(5)), |meta, data| {
    ///     let mut b = [0u8; 4];
    ///     data.read(0, &mut b).map(|()| (meta, b)) // read where it landed
    /// })??;
    /// assert_eq!((meta, &first), (5, b"zero"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn recv_in_place<R>(
        &mut self,
        timeout: Option<Duration>,
        f: impl FnOnce(u64, InPlace<'_>) -> R,
    ) -> Result<R, QueueError> {
        if !self.has_published()? {
            self.wait_published(timeout.map(|t| Instant::now() + t))?;
        }
        let (part, flags, meta, _) =
            self.header_of(self.read)?.ok_or(QueueError::Protocol("a published slot without its header"))?;
        if flags & MORE != 0 || flags & FIRST == 0 || self.partial.is_some() || self.parting.is_some() {
            return Err(QueueError::BadConfig("a multi-part message cannot be lent in place"));
        }
        let r = f(meta, InPlace::new(&self.mine, self.slot_off(self.read) + HEADER, part));
        self.consume()?;
        Ok(r)
    }

    /// Wait until the next message's header has landed — possibly while its body is still
    /// arriving — and return it (the message is not consumed). A tripwire on the header of
    /// the next slot fires when the sender writes it; the header is visible by then.
    ///
    /// ```
    /// use clan_proto::queue::Header;
    /// # use std::time::Duration;
    /// # use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    /// # let nic = clan::Nic::open_default()?;
    /// # let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// # let (addr, n2) = (listener.local_addr(), nic.clone());
    /// # let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// # let mut rx = listener.accept(Some(Duration::from_secs(5)))?;
    /// # let mut tx = connecting.join().unwrap()?;
    /// tx.send(42, &[0u8; 1500])?;
    /// let h = rx.wait_header(Some(Duration::from_secs(5)))?;
    /// assert_eq!(h, Header { meta: 42, len: 1500 });
    /// assert_eq!(rx.recv(Some(Duration::from_secs(5)))?.data.len(), 1500, "not consumed by the look");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_header(&self, timeout: Option<Duration>) -> Result<Header, QueueError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let at = self.slot_off(self.read);
        let tw = wait_tripwire(&self.mine, at..at + HEADER)?;
        let mut found = None;
        wait_check(
            &tw,
            Spin::for_conn(self.spin, &self.conn),
            deadline,
            Duration::from_millis(1),
            || {
                found = self.header_of(self.read)?.map(|(_, _, meta, total)| Header { meta, len: total });
                Ok(found.is_some())
            },
            || !self.conn.is_alive(),
            wait_err,
        )?;
        found.ok_or(QueueError::Timeout)
    }

    /// Slots taken so far.
    pub fn received(&self) -> u64 {
        self.read
    }

    /// Whether the sender is still there. Once it is gone, what it sent before is still
    /// received ([`MsgReceiver::pending`]); waiting for more fails.
    pub fn is_connected(&self) -> bool {
        self.conn.is_alive()
    }

    /// A once-only tripwire, disarmed, that posts an event with `cookie` to the queue of the
    /// receiver's endpoint ([`QueueListener::accept_to`]) when the sender publishes a
    /// message. Arm it, look at [`MsgReceiver::pending`] again, then wait on the queue: no
    /// wake-up is lost. A busy receiver never touches it (only a waiter arms it).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use clan::Event;
    /// use clan_proto::queue::{MsgSender, QueueConfig, QueueListener};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let q = nic.event_queue(clan::EventQueueConfig::default())?; // one queue, many receivers
    /// let listener = QueueListener::bind(&nic, QueueConfig::default())?;
    /// let (addr, n2) = (listener.local_addr(), nic.clone());
    /// let connecting = std::thread::spawn(move || MsgSender::connect(&n2, addr, &QueueConfig::default()));
    /// let mut rx = listener.accept_to(&q, Some(Duration::from_secs(5)))?;
    /// let mut tx = connecting.join().unwrap()?;
    /// let ready = rx.readiness_tripwire(9)?;
    /// ready.arm()?;
    /// assert_eq!(rx.pending()?, 0); // looked again after arming: now wait on the queue
    /// tx.send(1, b"wake")?;
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// while !matches!(q.wait(Some(deadline - Instant::now()))?, Event::Tripwire { cookie: 9, .. }) {}
    /// assert_eq!(rx.try_recv()?.map(|m| m.data), Some(b"wake".to_vec()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn readiness_tripwire(&self, cookie: u64) -> Result<Tripwire, QueueError> {
        self.mine
            .tripwire(
                clan::TripwireConfig::writes(RX_WRITE..RX_WRITE + 8)
                    .once()
                    .disarmed()
                    .actions(clan::Actions::NONE)
                    .event(cookie),
            )
            .map_err(|_| QueueError::Access(AccessError::Revoked))
    }
}
