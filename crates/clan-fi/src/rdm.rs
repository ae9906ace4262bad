//! Reliable-datagram endpoints (`FI_EP_RDM`) over clan's distributed queue: each endpoint
//! listens for senders with a [`QueueListener`]; a send to an address connects a
//! [`MsgSender`] to that address's listener the first time (announcing its own address
//! first, so that receives can be directed by source) and puts the message in the
//! receiver's ring. Receiving matches arrivals against posted receives in order (tag and
//! source for tagged receives), keeping unmatched arrivals until a receive is posted.
//! Progress is made when the application reads or waits on a completion queue or a counter
//! (the provider's data progress is manual), and by a send that waits for room in its
//! peer's ring; a send that finds room makes none. Safe Rust: the bytes go to the
//! application's buffers in `ffi`, which owns the pointers.
//!
//! Waiting: every receiver's endpoint reports to one event queue (the domain's, whose
//! descriptor is the completion queues' `FI_WAIT_FD`). A waiter arms each receiver's
//! readiness tripwire, looks again ([`Rdm::prepare_wait`]), then sleeps on the queue; the
//! sender's store of its write counter, the end of a connection and a newly accepted sender
//! (posted by the acceptor thread) wake it. Nothing spins.
//!
//! A peer that goes away (its process killed, or its endpoint closed) is noticed when its
//! connection ends: what it sent is still delivered, then receives directed to it fail
//! ([`Done::Failed`]), as do sends to it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use clan::{EventQueue, Nic, Tripwire};
use clan_proto::InPlace;
use clan_proto::SetupError;
use clan_proto::queue::{MsgReceiver, MsgSender, QueueConfig, QueueError, QueueListener, Short};

use crate::av::Addr;
use crate::cq::Direct;

/// The process's NIC (one for every endpoint, and the one their event queues must come
/// from), configured from the environment
/// ([`nic_config`]).
pub fn nic() -> Result<&'static Nic, Error> {
    static NIC: OnceLock<Result<Nic, String>> = OnceLock::new();
    NIC.get_or_init(|| {
        log_init();
        nic_config(|k| std::env::var(k).ok()).and_then(|c| Nic::open(c).map_err(|e| e.to_string()))
    })
    .as_ref()
    .map_err(|e| Error::Nic(e.clone()))
}

/// `CLAN_LOG` (as `clan`'s: `CLAN_LOG=debug`, `CLAN_LOG=clan=debug,warn`): what the NIC
/// decides, on standard error with timestamps (connections, imports, links and their
/// failures). Unset, nothing is said. An application with a subscriber of its own keeps it.
fn log_init() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("CLAN_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    }
}

/// The NIC's configuration from the environment (`var` looks a variable up):
/// - `CLAN_FI_IP`: this host's address on the network to other hosts. When it is set, the
///   NIC takes and makes links over TCP there, and endpoints' addresses carry it, so that
///   processes of other hosts reach them. Unset: this host only (127.0.0.1).
/// - `CLAN_FI_PORT`: the NIC's port (default: any free one; the address says which).
/// - `CLAN_FI_KEY`: the cluster's key, 64 hex digits: links authenticate both ends with it
///   and refuse peers without it (every host must have the same).
pub fn nic_config(var: impl Fn(&str) -> Option<String>) -> Result<clan::NicConfig, String> {
    // The application owns its signals (MPI runtimes and their libraries use some).
    let mut c = clan::NicConfig { wake_signal: false, ..clan::NicConfig::default() };
    if let Some(ip) = var("CLAN_FI_IP") {
        c.ip = ip.trim().parse().map_err(|_| format!("CLAN_FI_IP={ip:?} is not an IP address"))?;
        c.tcp = true;
    }
    if let Some(port) = var("CLAN_FI_PORT") {
        c.port = port.trim().parse().map_err(|_| format!("CLAN_FI_PORT={port:?} is not a port number"))?;
    }
    if let Some(key) = var("CLAN_FI_KEY") {
        let hex = key.trim();
        let bad = || format!("CLAN_FI_KEY must be 64 hex digits (32 bytes), got {} characters", hex.len());
        if hex.len() != 64 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut k = [0u8; 32];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        c.cluster_key = Some(k);
    }
    Ok(c)
}

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("clan is not available: {0}")]
    Nic(String),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("the address is not a clan endpoint")]
    BadAddr,
    #[error("the message is longer than the endpoint takes ({0} bytes)")]
    TooLong(usize),
    #[error("the peer went away")]
    PeerGone,
}

/// Bytes before the payload of every message: flags, tag, remote CQ data.
const HEADER: usize = 24;
const F_TAGGED: u64 = 1;
const F_DATA: u64 = 2;
const F_HELLO: u64 = 4;
/// A remote write: tag word = request id, payload = key, address, bytes.
const F_WRITE: u64 = 8;
/// A remote read: tag word = request id, payload = key, address, length.
const F_READ: u64 = 16;
/// The answer to a remote write or read: tag word = request id, data word = status,
/// payload = the bytes read.
const F_REPLY: u64 = 32;
/// Connection management of connected endpoints: tag word = [`CmKind`], payload = the
/// caller's private data.
const F_CM: u64 = 64;

/// What a connection-management frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum CmKind {
    /// Connect to me (to a passive endpoint).
    Request = 1,
    /// Accepted: the sender is the endpoint that took the connection.
    Accept = 2,
    /// Refused.
    Reject = 3,
    /// The sender disconnects.
    Shutdown = 4,
}

/// Longest message.
pub const MAX_MSG: usize = 1 << 20;

/// The longest part buffer a receiver keeps between parts.
const KEEP_FRAME: usize = 64 << 10;

/// Every sender's ring: 31 slots of 16 KiB and a cache line (498 KiB, with its control
/// page within what the NIC pools, so a connection costs no descriptor of its own). Long
/// slots make long messages cheap (one header, one fence and one look at the tripwires per
/// 16 KiB: a 1 MiB message is 64 slots); a short message still takes one slot, so 30 are
/// in flight. The line more staggers the slots across the CPU's cache sets: slots 16 KiB
/// apart all began at one place in a page, so the lines a small message lives on (both
/// directions' rings: 62 of them) took turns in one set of 8 of the first-level cache,
/// and pushed out every other page-aligned word in it (a one-thread send-and-receive loop,
/// cachegrind: 2.3 first-level data misses per message before, none after).
fn config() -> QueueConfig {
    QueueConfig { slots: 31, slot_size: 16384 + 64, spin: Duration::ZERO, ..QueueConfig::default() }
}

/// A message's header: flags, then two words (their meaning depends on the flags).
#[inline]
fn header(flags: u64, w1: u64, w2: u64) -> [u8; HEADER] {
    let mut head = [0u8; HEADER];
    head[..8].copy_from_slice(&flags.to_le_bytes());
    head[8..16].copy_from_slice(&w1.to_le_bytes());
    head[16..].copy_from_slice(&w2.to_le_bytes());
    head
}

/// A receive the application posted (its buffer as an address: `ffi` writes into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    pub buf: usize,
    pub len: usize,
    pub context: usize,
    pub tagged: bool,
    pub tag: u64,
    pub ignore: u64,
    /// Only from this address (directed receive).
    pub from: Option<Addr>,
    /// Whether its success is reported in the completion queue (not so for receives
    /// posted without `FI_COMPLETION` under selective completion; failures always are).
    pub completion: bool,
}

/// A message that arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    pub data: Vec<u8>,
    pub tagged: bool,
    pub tag: u64,
    pub cq_data: Option<u64>,
    pub from: Option<Addr>,
}

/// A message that arrived, seen where it lies (an [`Arrival`] it is not yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landed<'a> {
    pub data: &'a [u8],
    pub tagged: bool,
    pub tag: u64,
    pub cq_data: Option<u64>,
    pub from: Option<Addr>,
}

impl Arrival {
    /// A view of it.
    pub fn landed(&self) -> Landed<'_> {
        Landed { data: &self.data, tagged: self.tagged, tag: self.tag, cq_data: self.cq_data, from: self.from }
    }
}

impl Landed<'_> {
    fn to_arrival(self) -> Arrival {
        Arrival { data: self.data.to_vec(), tagged: self.tagged, tag: self.tag, cq_data: self.cq_data, from: self.from }
    }
}

/// Where a message that matches a posted receive as it is taken in goes at once (set by
/// [`Rdm::set_land`]): `ffi` copies it into the receive's buffer as its parts come and
/// completes the receive when it is whole. Called with the endpoint's lock held: nothing
/// here may call back into the endpoint.
pub trait Land: Send + Sync {
    /// Bytes `at..at + data.len()` of the message for receive `p` (what lies past `p.len`
    /// is dropped: the message is truncated).
    fn part(&self, p: &Posted, at: usize, data: &[u8]);
    /// [`Land::part`] of `len` bytes that lie in a sender's ring at `from` in `src`, copied
    /// from there (once: the short path of a message of one slot).
    fn part_from(&self, p: &Posted, at: usize, src: &InPlace<'_>, from: u64, len: usize) {
        let mut data = vec![0u8; len];
        if src.read(from, &mut data).is_ok() {
            self.part(p, at, &data);
        }
    }
    /// The message for `p` is whole: `len` bytes in all, its header in `m` (whose `data` is
    /// empty: its bytes came by `part`). Its completion goes to `direct` if that is the
    /// reader of its queue ([`crate::cq::Cq::push_to`]).
    fn done(&self, p: &Posted, m: Landed<'_>, len: usize, direct: &mut Direct);
}

impl Posted {
    fn matches(&self, a: &Landed<'_>) -> bool {
        self.tagged == a.tagged
            && (!self.tagged || (self.tag ^ a.tag) & !self.ignore == 0)
            && self.from.is_none_or(|f| a.from == Some(f))
    }
}

/// What progress finished: a receive matched by an arrival, or a receive directed to a
/// peer that went away; or what it brought that `ffi` must serve: a peer's request for this
/// endpoint's registered memory, or the answer to one of ours.
#[derive(Debug)]
pub enum Done {
    Received(Posted, Arrival),
    Failed(Posted),
    Rma(RmaRequest),
    Reply(RmaReply),
    /// A connection-management frame from `from`, with its private data.
    Cm {
        from: Option<Addr>,
        kind: CmKind,
        data: Vec<u8>,
    },
}

/// What a remote memory request asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RmaKind {
    /// Write these bytes (and, with `cq_data`, report it in the target's receive queue).
    Write { data: Vec<u8>, cq_data: Option<u64> },
    /// Read this many bytes.
    Read { len: u64 },
}

/// A peer's request for this endpoint's registered memory: unchecked (`ffi` checks the
/// key, the range and the rights against its registrations before it touches memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmaRequest {
    /// Who asked (where the answer goes).
    pub from: Option<Addr>,
    pub id: u64,
    pub key: u64,
    pub addr: u64,
    pub kind: RmaKind,
}

/// The answer to a request of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmaReply {
    pub id: u64,
    /// [`RmaStatus`] as a word (anything unknown counts as refused).
    pub status: u64,
    /// The bytes read.
    pub data: Vec<u8>,
}

/// How a remote memory request ended, as the target answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum RmaStatus {
    Done = 0,
    /// No registration has this key.
    NoKey = 1,
    /// The range is not inside the registration.
    OutOfRange = 2,
    /// The registration does not allow this access.
    NoRights = 3,
    /// The request was malformed.
    Malformed = 4,
}

impl RmaStatus {
    /// From the word in an answer.
    pub fn from_word(w: u64) -> RmaStatus {
        match w {
            0 => RmaStatus::Done,
            1 => RmaStatus::NoKey,
            2 => RmaStatus::OutOfRange,
            3 => RmaStatus::NoRights,
            _ => RmaStatus::Malformed,
        }
    }
}

/// What a peek finds: a waiting message that a receive would match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peeked {
    pub len: usize,
    pub tag: u64,
    pub cq_data: Option<u64>,
}

/// A sender's queue into this endpoint.
struct Rx {
    rx: MsgReceiver,
    /// What its last part was read into (reused; at most a slot's payload).
    buf: Vec<u8>,
    /// The message whose parts are coming in.
    assembly: Option<Assembly>,
    /// Who it is (its hello says).
    from: Option<Addr>,
    /// Armed by a waiter: fires when the sender publishes.
    ready: Option<Tripwire>,
}

/// An address as a map key (its handle: hashed and compared as one word).
type Key = Addr;

/// Maps keyed by address on the data path: a fast hash (the keys are addresses the
/// application put in its address vector, or that our own senders announced; a peer that
/// announces many makes itself slower, nobody else).
type Fast<K, V> = HashMap<K, V, BuildHasherDefault<rustc_hash::FxHasher>>;

/// Where a message longer than a slot goes as its parts come in.
enum Assembly {
    /// Straight into the buffer of the posted receive its first part matched (its header:
    /// `m`, whose `data` is empty).
    Landing { p: Posted, tagged: bool, tag: u64, cq_data: Option<u64>, from: Option<Addr> },
    /// Into a buffer of ours (no receive for it yet, or not a message for a receive).
    Own(Vec<u8>),
}

#[derive(Default)]
struct State {
    /// Our queues to peers: `None` while a send that waits for room has it out (it never
    /// waits with the state's lock held); other sends to that peer wait for it to be put
    /// back, so that the peer's messages stay in order.
    senders: Fast<Key, Option<MsgSender>>,
    receivers: Vec<Rx>,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Arrival>,
    /// Peers whose connection to us ended (until they connect again).
    gone: HashSet<Key, BuildHasherDefault<rustc_hash::FxHasher>>,
    /// Finished while a send waited for room (handed out by the next `progress`).
    done: Vec<Done>,
    /// Messages claimed by a peek (`FI_CLAIM`), by the peek's context.
    claimed: HashMap<usize, Arrival>,
    /// Sleeps of the provider's own between their [`Rdm::prepare_wait`] and
    /// [`Rdm::end_wait`].
    sleepers: u32,
    /// A waiter that never says when its sleep ends armed the receivers
    /// ([`Sleeper::Theirs`]): they are left armed from then on.
    kept_armed: bool,
}

/// Who sleeps once [`Rdm::prepare_wait`] has armed the receivers.
///
/// An armed receiver costs its sender: each message it publishes finds the tripwire armed
/// and asks this process to fire it (a claim posted to our event queue, ~550 instructions
/// and the queue's lines), until this process takes the claim from its queue, which only a
/// sleeper does. A receiver left armed after its waiter woke would charge every message of
/// a peer that this process then polls for (an MPI rank after one idle moment) for nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sleeper {
    /// A sleep of the provider's own (a blocking read, the nap of an idle queue): it calls
    /// [`Rdm::end_wait`] once awake, and the last of them to wake disarms the receivers.
    Ours,
    /// One that never says when it ends: the application's, after `fi_trywait`, or the
    /// progress thread's, which sleeps again at once. The receivers stay armed from then
    /// on (each until it fires).
    Theirs,
}

/// The cookie of receivers' readiness events, and of the acceptor's wake-up.
const READY: u64 = 1;

/// An endpoint. A thread of its own takes in new senders (a sender's connect waits for
/// that, and must not wait for this application to look).
pub struct Rdm {
    shared: Arc<Shared>,
    me: Addr,
    land: OnceLock<Box<dyn Land>>,
}

struct Shared {
    listener: QueueListener,
    state: Mutex<State>,
    closed: std::sync::atomic::AtomicBool,
    /// Parts taken in so far (read without the lock: whether progress is being made, by a
    /// reader deciding that it is idle).
    taken: std::sync::atomic::AtomicU64,
    /// Where receivers report (the domain's queue).
    queue: EventQueue,
}

impl Drop for Rdm {
    fn drop(&mut self) {
        self.shared.closed.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn take_senders(shared: Arc<Shared>) {
    use std::sync::atomic::Ordering;
    while !shared.closed.load(Ordering::Acquire) {
        match shared.listener.accept_to(&shared.queue, Some(Duration::from_millis(100))) {
            Ok(rx) => {
                shared.state.lock().unwrap_or_else(|p| p.into_inner()).receivers.push(Rx {
                    rx,
                    buf: Vec::new(),
                    assembly: None,
                    from: None,
                    ready: None,
                });
                // A waiter that looked before this receiver was there looks again.
                shared.queue.post_user(READY);
            }
            Err(QueueError::Timeout) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

impl std::fmt::Debug for Rdm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rdm").field("addr", &self.me.text()).finish()
    }
}

impl Rdm {
    /// A new endpoint whose receivers report to `queue`.
    pub fn open(queue: &EventQueue) -> Result<Rdm, Error> {
        let listener = QueueListener::bind(nic()?, config())?;
        let me = Addr::of(listener.local_addr());
        let shared = Arc::new(Shared {
            listener,
            state: Mutex::new(State::default()),
            closed: std::sync::atomic::AtomicBool::new(false),
            taken: std::sync::atomic::AtomicU64::new(0),
            queue: queue.clone(),
        });
        let s2 = shared.clone();
        std::thread::Builder::new()
            .name("clan-fi-accept".into())
            .spawn(move || take_senders(s2))
            .map_err(|e| Error::Nic(e.to_string()))?;
        Ok(Rdm { shared, me, land: OnceLock::new() })
    }

    /// From now on, hand a message that matches a posted receive as it is taken in to
    /// `land` at once, instead of as a [`Done::Received`] from [`Rdm::progress`] (no copy of
    /// it is made on the way). Once only: a second call is ignored.
    pub fn set_land(&self, land: Box<dyn Land>) {
        let _ = self.land.set(land);
    }

    /// Its address (what `fi_getname` gives).
    pub fn addr(&self) -> Addr {
        self.me
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send `data` to `to` (copied out when this returns).
    pub fn send(&self, to: Addr, data: &[u8], tagged: bool, tag: u64, cq_data: Option<u64>) -> Result<(), Error> {
        if data.len() > MAX_MSG {
            return Err(Error::TooLong(MAX_MSG));
        }
        let flags = if tagged { F_TAGGED } else { 0 } | if cq_data.is_some() { F_DATA } else { 0 };
        let head = header(flags, tag, cq_data.unwrap_or(0));
        let all: [&[u8]; 2] = [&head, data];
        match self.send_now(to, &all) {
            Some(r) => r,
            None => self.send_waiting(to, &all),
        }
    }

    /// Ask `to` to write `data` at `addr` of its registration `key` (request `id`: its
    /// answer comes back as [`Done::Reply`]).
    pub fn write(
        &self,
        to: Addr,
        id: u64,
        key: u64,
        addr: u64,
        data: &[u8],
        cq_data: Option<u64>,
    ) -> Result<(), Error> {
        if data.len() > MAX_MSG {
            return Err(Error::TooLong(MAX_MSG));
        }
        let flags = F_WRITE | if cq_data.is_some() { F_DATA } else { 0 };
        self.send_frame(to, flags, id, cq_data.unwrap_or(0), &[&key.to_le_bytes(), &addr.to_le_bytes(), data])
    }

    /// Ask `to` for `len` bytes at `addr` of its registration `key` (request `id`).
    pub fn read(&self, to: Addr, id: u64, key: u64, addr: u64, len: usize) -> Result<(), Error> {
        if len > MAX_MSG {
            return Err(Error::TooLong(MAX_MSG));
        }
        let words = [key.to_le_bytes(), addr.to_le_bytes(), (len as u64).to_le_bytes()];
        self.send_frame(to, F_READ, id, 0, &[&words[0], &words[1], &words[2]])
    }

    /// A connection-management frame to `to`.
    pub fn cm(&self, to: Addr, kind: CmKind, data: &[u8]) -> Result<(), Error> {
        self.send_frame(to, F_CM, kind as u64, 0, &[data])
    }

    /// Answer request `id` of `to`.
    pub fn reply(&self, to: Addr, id: u64, status: RmaStatus, data: &[u8]) -> Result<(), Error> {
        self.send_frame(to, F_REPLY, id, status as u64, &[data])
    }

    fn send_frame(&self, to: Addr, flags: u64, tag: u64, word2: u64, parts: &[&[u8]]) -> Result<(), Error> {
        let head = header(flags, tag, word2);
        // The header, then the parts, as one message (no copy of them put together).
        let mut all: [&[u8]; 5] = [&[]; 5];
        all[0] = &head;
        for (slot, p) in all[1..].iter_mut().zip(parts) {
            *slot = p;
        }
        let all = &all[..1 + parts.len().min(4)];
        match self.send_now(to, all) {
            Some(r) => r,
            None => self.send_waiting(to, all),
        }
    }

    /// The short path: a small message to a peer we are connected to, with room in its ring
    /// now (`None`: none of that; nothing was sent), sent under the state's lock: one lock
    /// for the lookup and the send.
    #[inline]
    fn send_now(&self, to: Addr, all: &[&[u8]]) -> Option<Result<(), Error>> {
        let mut s = self.lock();
        let sent = match s.senders.get_mut(&to) {
            Some(Some(tx)) => tx.try_send_small(0, all),
            _ => Ok(false),
        };
        match sent {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => {
                s.senders.remove(&to);
                Some(Err(gone_or(e)))
            }
        }
    }

    /// The long path: connect first if need be, and wait for room. The sender is taken out
    /// of the state while it waits (the state's lock is not held: the receive side goes on,
    /// and this wait takes in what others send us), then put back.
    #[inline(never)]
    fn send_waiting(&self, to: Addr, all: &[&[u8]]) -> Result<(), Error> {
        let mut looked = 0u32;
        let mut tx = loop {
            let mut s = self.lock();
            match s.senders.get_mut(&to) {
                Some(t) => match t.take() {
                    Some(tx) => break tx,
                    None => {
                        // Another thread's send to this peer waits for room: take in
                        // meanwhile (the peer may be waiting for room in our rings), then
                        // look again.
                        self.take_in(&mut s);
                        drop(s);
                        // (yielding, then napping: that send may wait long)
                        looked += 1;
                        if looked < 64 {
                            std::thread::yield_now();
                        } else {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                },
                None => {
                    drop(s);
                    // (connecting without the lock: the peer's acceptor thread may be ours)
                    let tx = self.connect(to)?;
                    let mut s = self.lock();
                    if let std::collections::hash_map::Entry::Vacant(v) = s.senders.entry(to) {
                        v.insert(None);
                        break tx;
                    }
                    // (another thread connected meanwhile: its sender is the one used)
                }
            }
        };
        // Only this peer's sender is out while it waits for room (never the receive side).
        // While it waits, what others send us is taken in: the peer may be waiting for room
        // in our rings to finish a send to us before it reads ours.
        let r = tx.send_vectored_idling(0, all, &mut || {
            let mut s = self.lock();
            self.take_in(&mut s);
        });
        let mut s = self.lock();
        let back = matches!(s.senders.get(&to), Some(None));
        match r {
            // (put back, unless the peer was found gone meanwhile: then it is dropped, and
            // the next send connects again)
            Ok(()) if back => {
                s.senders.insert(to, Some(tx));
                Ok(())
            }
            Ok(()) => Ok(()),
            Err(e) => {
                if back {
                    s.senders.remove(&to);
                }
                Err(gone_or(e))
            }
        }
    }

    /// A new connection to `to`, announced by its hello.
    fn connect(&self, to: Addr) -> Result<MsgSender, Error> {
        let dest = to.endpoint().ok_or(Error::BadAddr)?;
        let mut tx = MsgSender::connect(nic()?, dest, &config()).map_err(|e| match e {
            QueueError::Setup(SetupError::Connect(_)) => Error::PeerGone,
            e => Error::Queue(e),
        })?;
        let mut hello = vec![0u8; HEADER];
        hello[..8].copy_from_slice(&F_HELLO.to_le_bytes());
        hello.extend_from_slice(self.me.bytes());
        tx.send(0, &hello)?;
        Ok(tx)
    }

    /// Post a receive: matched at once against what already arrived, if anything did; failed
    /// at once if it is directed to a peer that went away.
    pub fn post(&self, p: Posted) -> Option<Done> {
        let mut s = self.lock();
        if let Some(i) = s.unexpected.iter().position(|a| p.matches(&a.landed())) {
            let a = s.unexpected.remove(i)?;
            return Some(Done::Received(p, a));
        }
        if !s.gone.is_empty() && p.from.is_some_and(|f| s.gone.contains(&f)) {
            return Some(Done::Failed(p));
        }
        s.posted.push_back(p);
        None
    }

    /// Before sleeping on the queue: arm every receiver's readiness tripwire and look again.
    /// `true`: nothing has arrived and every sender is still there (sleep; a sender's next
    /// message wakes the queue); `false`: make progress first. A sleeper of
    /// [`Sleeper::Ours`] calls [`Rdm::end_wait`] afterwards, whatever this returned.
    pub fn prepare_wait(&self, who: Sleeper) -> bool {
        let mut s = self.lock();
        match who {
            Sleeper::Ours => s.sleepers = s.sleepers.saturating_add(1),
            Sleeper::Theirs => s.kept_armed = true,
        }
        for r in &mut s.receivers {
            if r.ready.is_none() {
                match r.rx.readiness_tripwire(READY) {
                    Ok(t) => r.ready = Some(t),
                    Err(_) => return false,
                }
            }
            if r.ready.as_ref().is_some_and(|t| t.arm().is_err()) {
                return false;
            }
        }
        // (after arming: a message published before the arm is seen here, one after it
        // fires the tripwire)
        s.receivers.iter().all(|r| r.rx.pending().is_ok_and(|n| n == 0) && r.rx.is_connected())
    }

    /// A sleep of [`Sleeper::Ours`] ended (or was not taken): the last such sleeper to wake
    /// disarms the receivers, unless one of [`Sleeper::Theirs`] has armed them. A receiver
    /// that fired meanwhile is disarmed already; a claim of it still in the queue then
    /// fires nothing when it is taken.
    pub fn end_wait(&self) {
        let mut s = self.lock();
        s.sleepers = s.sleepers.saturating_sub(1);
        if s.sleepers == 0 && !s.kept_armed {
            for r in &s.receivers {
                if let Some(t) = &r.ready {
                    // (a tripwire of this process's own aperture: stale only once the
                    // receiver is gone, when there is nothing to disarm)
                    let _ = t.disarm();
                }
            }
        }
    }

    /// [`take_in`], counted in [`Rdm::activity`].
    fn take_in(&self, s: &mut State) {
        self.take_in_to(s, &mut Direct::none());
    }

    /// [`Rdm::take_in`], the completions of messages landed going to `direct` when it reads
    /// their queue.
    fn take_in_to(&self, s: &mut State, direct: &mut Direct) {
        let n = take_in(s, self.land.get().map(|l| &**l), direct);
        if n > 0 {
            use std::sync::atomic::Ordering::Relaxed;
            // (under the state's lock: one writer at a time)
            self.shared.taken.store(self.shared.taken.load(Relaxed).wrapping_add(n), Relaxed);
        }
    }

    /// Parts of messages taken in so far: a count that moves while anything arrives, even
    /// the middle of a long message, which completes nothing yet.
    pub fn activity(&self) -> u64 {
        self.shared.taken.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Take in what arrived; the receives it completes (and those directed to peers that
    /// went away, which fail), and the remote memory requests and answers that came.
    pub fn progress(&self) -> Vec<Done> {
        self.progress_to(&mut Direct::none())
    }

    /// [`Rdm::progress`] for the reader of a completion queue: the completions of messages
    /// landed ([`Rdm::set_land`]) that belong in that queue go to `direct` while it has room
    /// and the queue holds nothing ([`crate::cq::Direct`]).
    pub fn progress_to(&self, direct: &mut Direct) -> Vec<Done> {
        // What came from other hosts is applied by this polling thread, as a TCP provider's
        // poll reads its sockets, rather than left to the engine's thread (which, woken on
        // this thread's CPU, would wait its turn: a round trip between two hosts took 3×
        // libfabric's tcp provider's). One load when the NIC has no link.
        if let Ok(n) = nic() {
            if n.has_links() {
                n.spin_links().drive();
            }
        }
        let mut s = self.lock();
        self.take_in_to(&mut s, direct);
        std::mem::take(&mut s.done)
    }

    /// Whether `peer` went away: its connection to us ended (and it has not connected
    /// again), or ours to it did.
    pub fn is_gone(&self, peer: Addr) -> bool {
        let s = self.lock();
        // (a sender out with a waiting send is found out by that send)
        s.gone.contains(&peer) || matches!(s.senders.get(&peer), Some(Some(tx)) if !tx.is_connected())
    }

    /// The first waiting message that `p` would match, without taking it; with `claim`,
    /// taken aside for the receive that names the same context ([`Rdm::claimed`]).
    pub fn peek(&self, p: &Posted, claim: bool) -> Option<Peeked> {
        let mut s = self.lock();
        self.take_in(&mut s);
        let i = s.unexpected.iter().position(|a| p.matches(&a.landed()))?;
        let a = &s.unexpected[i];
        let found = Peeked { len: a.data.len(), tag: a.tag, cq_data: a.cq_data };
        if claim {
            let a = s.unexpected.remove(i)?;
            s.claimed.insert(p.context, a);
        }
        Some(found)
    }

    /// The message a peek with this context claimed (taken: a second call finds nothing).
    pub fn claimed(&self, context: usize) -> Option<Arrival> {
        self.lock().claimed.remove(&context)
    }

    /// Cancel the posted receive with `context`; whether there was one.
    pub fn cancel(&self, context: usize) -> Option<Posted> {
        let mut s = self.lock();
        let i = s.posted.iter().position(|p| p.context == context)?;
        s.posted.remove(i)
    }
}

/// A send's error as the provider's: the connection ended (or its memory went), or another.
fn gone_or(e: QueueError) -> Error {
    match e {
        QueueError::Disconnected | QueueError::Access(_) => Error::PeerGone,
        e => Error::Queue(e),
    }
}

/// Take in what arrived into `s`: messages match posted receives (or wait as unexpected),
/// remote memory requests and answers are handed on, and receives directed to peers that
/// went away fail; what finished goes to `s.done`, in the order it came. Allocates nothing
/// when nothing came (the cost of a completion queue polled in a loop). Returns how many
/// parts it took.
fn take_in(s: &mut State, land: Option<&dyn Land>, direct: &mut Direct) -> u64 {
    let State { senders, receivers, posted, unexpected, gone, done, .. } = s;
    let mut taken = 0;
    let mut i = 0;
    while i < receivers.len() {
        let r = &mut receivers[i];
        // (looked at first: a sender that published and then went away has its last
        // messages taken before it counts as gone)
        let alive = r.rx.is_connected();
        let dead = loop {
            if let (Some(land), None) = (land, &r.assembly) {
                // The short path: a plain message of one slot for the oldest posted receive
                // is matched on its header where it lies and copied from the ring straight
                // into the receive's buffer. Anything else goes the whole way below.
                let from = r.from;
                match r.rx.try_recv_whole_with(|_, first, body| land_first(first, &body, from, land, posted, direct)) {
                    Ok(Short::Taken(())) => {
                        taken += 1;
                        continue;
                    }
                    Ok(Short::Nothing) => break !alive,
                    Ok(Short::Other) => {}
                    Err(_) => break true,
                }
            }
            // (never waiting: a message's parts come as its sender, which may be waiting
            // for us in turn, writes them; the parts taken wait in the receiver)
            let part = match r.rx.try_recv_part(&mut r.buf) {
                Ok(Some(part)) => {
                    taken += 1;
                    part
                }
                Ok(None) => break !alive,
                Err(_) => break true,
            };
            if part.at == 0 && part.last {
                // A message of one slot, whole.
                whole(&r.buf, &mut r.from, land, posted, unexpected, done, direct);
            } else if part.at == 0 {
                // The first part of a longer one: its header says where it goes.
                let body = part.total as usize - HEADER.min(part.total as usize);
                r.assembly = Some(match parse(&r.buf, &mut r.from) {
                    Some(Incoming::Msg(m)) if land.is_some() => match posted.iter().position(|p| p.matches(&m)) {
                        Some(k) => match (posted.remove(k), land) {
                            (Some(p), Some(land)) => {
                                land.part(&p, 0, m.data);
                                Assembly::Landing { p, tagged: m.tagged, tag: m.tag, cq_data: m.cq_data, from: m.from }
                            }
                            _ => Assembly::Own(own_start(&r.buf, body)),
                        },
                        None => Assembly::Own(own_start(&r.buf, body)),
                    },
                    _ => Assembly::Own(own_start(&r.buf, body)),
                });
            } else {
                match &mut r.assembly {
                    Some(Assembly::Landing { p, .. }) => {
                        if let Some(land) = land {
                            land.part(p, part.at as usize - HEADER, &r.buf);
                        }
                    }
                    Some(Assembly::Own(v)) => v.extend_from_slice(&r.buf),
                    // (the receiver would have refused a part without its first)
                    None => {}
                }
                if part.last {
                    match r.assembly.take() {
                        Some(Assembly::Landing { p, tagged, tag, cq_data, from }) => {
                            if let Some(land) = land {
                                let m = Landed { data: &[], tagged, tag, cq_data, from };
                                land.done(&p, m, part.total as usize - HEADER, direct);
                            }
                        }
                        Some(Assembly::Own(v)) => whole(&v, &mut r.from, land, posted, unexpected, done, direct),
                        None => {}
                    }
                }
            }
            if r.buf.capacity() > KEEP_FRAME {
                // (a long slot's buffer is not kept)
                r.buf = Vec::new();
            }
        };
        if dead {
            let r = receivers.swap_remove(i);
            if let Some(Assembly::Landing { p, .. }) = r.assembly {
                // Its message will never be whole: the receive waits for another.
                posted.push_front(p);
            }
            if let Some(f) = r.from {
                gone.insert(f);
                senders.remove(&f);
            }
        } else {
            i += 1;
        }
    }
    if gone.is_empty() {
        return taken;
    }
    // A peer that connected again is back.
    for r in receivers.iter() {
        if let Some(f) = r.from {
            gone.remove(&f);
        }
    }
    // Receives directed to a peer that went away can never complete.
    let mut k = 0;
    while k < posted.len() {
        if posted[k].from.is_some_and(|f| gone.contains(&f)) {
            if let Some(p) = posted.remove(k) {
                done.push(Done::Failed(p));
            }
        } else {
            k += 1;
        }
    }
    taken
}

/// A whole message `data` of the sender whose hello said `from`: to a posted receive it
/// matches (landed at once, with a place to land), kept as unexpected, or handed on.
fn whole(
    data: &[u8],
    from: &mut Option<Addr>,
    land: Option<&dyn Land>,
    posted: &mut VecDeque<Posted>,
    unexpected: &mut VecDeque<Arrival>,
    done: &mut Vec<Done>,
    direct: &mut Direct,
) {
    // (a plain message, the common case, without building the whole of `Incoming`)
    if let Some(a) = plain(data, *from) {
        return deliver(a, land, posted, unexpected, done, direct);
    }
    match parse(data, from) {
        Some(Incoming::Msg(a)) => deliver(a, land, posted, unexpected, done, direct),
        Some(Incoming::Done(d)) => done.push(d),
        None => {}
    }
}

/// A plain message of one slot, `body` where it lies in its sender's ring (`first`: its first
/// bytes, copied out with its header), landed for the oldest posted receive if that one
/// matches it (`None`: not so, nothing was done).
#[inline]
fn land_first(
    first: &[u8],
    body: &InPlace<'_>,
    from: Option<Addr>,
    land: &dyn Land,
    posted: &mut VecDeque<Posted>,
    direct: &mut Direct,
) -> Option<()> {
    let a = plain(first, from)?;
    let p = posted.front()?;
    if !p.matches(&a) {
        return None;
    }
    let len = body.len() as usize - HEADER;
    if a.data.len() == len {
        // (all of it came with the header)
        land.part(p, 0, a.data);
    } else {
        land.part_from(p, 0, body, HEADER as u64, len);
    }
    let a = Landed { data: &[], ..a };
    land.done(p, a, len, direct);
    posted.pop_front();
    Some(())
}

/// Message `a` to the first posted receive it matches (landed at once, with a place to
/// land), or kept as unexpected.
#[inline]
fn deliver(
    a: Landed<'_>,
    land: Option<&dyn Land>,
    posted: &mut VecDeque<Posted>,
    unexpected: &mut VecDeque<Arrival>,
    done: &mut Vec<Done>,
    direct: &mut Direct,
) {
    // (the oldest receive first, without an iterator: it is the one that matches when
    // receives are posted in the order their messages come)
    let k =
        if posted.front().is_some_and(|p| p.matches(&a)) { Some(0) } else { posted.iter().position(|p| p.matches(&a)) };
    match k {
        Some(k) => match land {
            Some(land) => {
                // (landed from where it is posted, then taken off: the receive is not
                // moved on the way)
                let p = &posted[k];
                land.part(p, 0, a.data);
                land.done(p, Landed { data: &[], ..a }, a.data.len(), direct);
                if k == 0 {
                    posted.pop_front();
                } else {
                    posted.remove(k);
                }
            }
            None => {
                if let Some(p) = posted.remove(k) {
                    done.push(Done::Received(p, a.to_arrival()));
                }
            }
        },
        None => unexpected.push_back(a.to_arrival()),
    }
}

/// Our buffer for a message of `body` bytes after its header, starting with `first` (its
/// first part, header included). (Reserved up to 1 MiB ahead: `body` is what the sender
/// says, and the parts grow the buffer as they come.)
fn own_start(first: &[u8], body: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + body.min(1 << 20));
    v.extend_from_slice(first);
    v
}

/// A message taken from a sender's ring.
enum Incoming<'a> {
    Msg(Landed<'a>),
    Done(Done),
}

/// [`parse`] of a plain message (a send, tagged or not, with or without its data word):
/// `None` for anything else, which `parse` takes.
#[inline]
fn plain(data: &[u8], from: Option<Addr>) -> Option<Landed<'_>> {
    let head = data.get(..HEADER)?;
    let word = |k: usize| u64::from_le_bytes(head[k * 8..k * 8 + 8].try_into().unwrap_or_default());
    let flags = word(0);
    if flags & !(F_TAGGED | F_DATA) != 0 {
        return None;
    }
    Some(Landed {
        data: &data[HEADER..],
        tagged: flags & F_TAGGED != 0,
        tag: word(1),
        cq_data: (flags & F_DATA != 0).then(|| word(2)),
        from,
    })
}

/// Parse one message of the sender whose hello said `from` (a hello sets it). Memory a peer
/// wrote: anything short or malformed is dropped (a malformed request is answered as such).
fn parse<'a>(data: &'a [u8], from: &mut Option<Addr>) -> Option<Incoming<'a>> {
    if data.len() < HEADER {
        return None;
    }
    let word = |d: &[u8], k: usize| u64::from_le_bytes(d[k * 8..k * 8 + 8].try_into().unwrap_or_default());
    let (flags, w1, w2) = (word(data, 0), word(data, 1), word(data, 2));
    let body = &data[HEADER..];
    if flags & F_HELLO != 0 {
        *from = Addr::from_bytes(body).ok();
        return None;
    }
    if flags & (F_WRITE | F_READ) != 0 {
        let bad = RmaRequest { from: *from, id: w1, key: 0, addr: 0, kind: RmaKind::Read { len: 0 } };
        let need = if flags & F_READ != 0 { 24 } else { 16 };
        if body.len() < need || flags & F_WRITE != 0 && flags & F_READ != 0 {
            // (key 0 is never a registration's: the answer says no such key)
            return Some(Incoming::Done(Done::Rma(bad)));
        }
        let (key, addr) = (word(body, 0), word(body, 1));
        let kind = if flags & F_READ != 0 {
            RmaKind::Read { len: word(body, 2) }
        } else {
            RmaKind::Write { data: body[16..].to_vec(), cq_data: (flags & F_DATA != 0).then_some(w2) }
        };
        return Some(Incoming::Done(Done::Rma(RmaRequest { from: *from, id: w1, key, addr, kind })));
    }
    if flags & F_CM != 0 {
        let kind = match w1 {
            1 => CmKind::Request,
            2 => CmKind::Accept,
            3 => CmKind::Reject,
            4 => CmKind::Shutdown,
            _ => return None,
        };
        return Some(Incoming::Done(Done::Cm { from: *from, kind, data: body.to_vec() }));
    }
    if flags & F_REPLY != 0 {
        return Some(Incoming::Done(Done::Reply(RmaReply { id: w1, status: w2, data: body.to_vec() })));
    }
    Some(Incoming::Msg(Landed {
        data: body,
        tagged: flags & F_TAGGED != 0,
        tag: w1,
        cq_data: (flags & F_DATA != 0).then_some(w2),
        from: *from,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn posted(ctx: usize, tagged: bool, tag: u64) -> Posted {
        Posted { buf: 0, len: 64, context: ctx, tagged, tag, ignore: 0, from: None, completion: true }
    }

    fn queue() -> EventQueue {
        nic().unwrap().event_queue(clan::EventQueueConfig::default()).unwrap()
    }

    fn received(d: Done) -> (Posted, Arrival) {
        match d {
            Done::Received(p, a) => (p, a),
            d => panic!("not a received message: {d:?}"),
        }
    }

    #[test]
    fn messages_match_posted_receives_in_order_by_tag_and_source() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        // Before anything is posted: kept.
        a.send(b.addr(), b"one", false, 0, None).unwrap();
        a.send(b.addr(), b"tagged 7", true, 7, Some(99)).unwrap();
        let mut got = Vec::new();
        for _ in 0..1000 {
            got.extend(b.progress());
            if b.lock().unexpected.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(got.is_empty());
        // A tagged receive for tag 7 takes the tagged one, not the first.
        let (p, m) = received(b.post(posted(1, true, 7)).expect("matched at once"));
        assert_eq!((p.context, m.data.as_slice(), m.cq_data, m.from), (1, &b"tagged 7"[..], Some(99), Some(a.addr())));
        let (_, m) = received(b.post(posted(2, false, 0)).unwrap());
        assert_eq!(m.data, b"one");
        // Directed: only from `a`; a receive from elsewhere waits.
        let c = Rdm::open(&q).unwrap();
        assert!(b.post(Posted { from: Some(c.addr()), ..posted(3, false, 0) }).is_none());
        assert!(b.post(Posted { from: Some(a.addr()), ..posted(4, false, 0) }).is_none());
        a.send(b.addr(), b"from a", false, 0, None).unwrap();
        let mut done = Vec::new();
        for _ in 0..1000 {
            done.extend(b.progress());
            if !done.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(done.len(), 1);
        let (p, m) = received(done.remove(0));
        assert_eq!((p.context, m.data.as_slice()), (4, &b"from a"[..]));
        assert_eq!(b.cancel(3).map(|p| p.context), Some(3));
        assert!(b.cancel(3).is_none());
    }

    /// With a place to land, a message that matches a posted receive as it is taken in
    /// goes there at once (not through `progress`); one that matches nothing waits, and is
    /// matched by the next post as before.
    /// The short path of a plain message reads it as `parse` does, and leaves everything
    /// else (hellos, remote memory requests and answers, connection frames, short ones) to it.
    #[test]
    fn plain_messages_read_as_parse_reads_them() {
        let from = Some(Addr::of("127.0.0.1:7000/3".parse().expect("an address")));
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for flags in 0..128u64 {
            for len in [0usize, 8, HEADER - 1, HEADER, HEADER + 1, HEADER + 40] {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut data: Vec<u8> = (0..len).map(|i| (state >> (i % 56)) as u8).collect();
                if len >= 8 {
                    data[..8].copy_from_slice(&flags.to_le_bytes());
                }
                let mut f = from;
                let parsed = parse(&data, &mut f);
                match plain(&data, from) {
                    Some(a) => assert!(
                        matches!(parsed, Some(Incoming::Msg(b)) if a == b),
                        "flags {flags:#x}, {len} bytes: the short path read it otherwise"
                    ),
                    None => assert!(
                        len < HEADER || flags & !(F_TAGGED | F_DATA) != 0,
                        "flags {flags:#x}, {len} bytes: a plain message left to parse"
                    ),
                }
            }
        }
    }

    #[test]
    fn messages_land_at_once_when_the_endpoint_has_a_place_for_them() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        let landed = Arc::new(Mutex::new(Vec::new()));
        b.set_land(Box::new(Keep(landed.clone(), Mutex::default())));
        assert!(b.post(posted(1, true, 7)).is_none());
        a.send(b.addr(), b"unexpected", false, 0, None).unwrap();
        a.send(b.addr(), b"tagged 7", true, 7, None).unwrap();
        until(|| {
            assert!(b.progress().is_empty(), "nothing through progress");
            (landed.lock().unwrap().len() == 1).then_some(())
        });
        assert_eq!(landed.lock().unwrap()[0], (1, b"tagged 7".to_vec(), 7, Some(a.addr())));
        let (p, m) = received(b.post(posted(2, false, 0)).expect("waited"));
        assert_eq!((p.context, m.data.as_slice()), (2, &b"unexpected"[..]));
        assert_eq!(landed.lock().unwrap().len(), 1);
    }

    /// A message longer than a slot lands part by part, in order, in the receive its first
    /// part matched; a receive shorter than the message gets its first bytes and the whole
    /// length (truncated).
    #[test]
    fn long_messages_land_part_by_part() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        let landed = Arc::new(Mutex::new(Vec::new()));
        b.set_land(Box::new(Keep(landed.clone(), Mutex::default())));
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        assert!(b.post(Posted { len: big.len(), ..posted(1, false, 0) }).is_none());
        assert!(b.post(Posted { len: 1000, ..posted(2, false, 0) }).is_none());
        a.send(b.addr(), &big, false, 0, None).unwrap();
        a.send(b.addr(), &big, false, 0, None).unwrap();
        until(|| {
            assert!(b.progress().is_empty());
            (landed.lock().unwrap().len() == 2).then_some(())
        });
        let got = landed.lock().unwrap();
        assert_eq!((got[0].0, got[0].1 == big, got[0].3), (1, true, Some(a.addr())));
        // (`Keep` records what `part` was given: the receive's buffer gets the first 1000)
        assert_eq!((got[1].0, got[1].1.len()), (2, big.len()));
    }

    /// A sender that goes away in the middle of a long message: the receive its first part
    /// matched is posted again (its message will never be whole).
    #[test]
    fn a_receive_whose_long_message_never_completes_is_posted_again() {
        let q = queue();
        let b = Rdm::open(&q).unwrap();
        let landed = Arc::new(Mutex::new(Vec::new()));
        b.set_land(Box::new(Keep(landed.clone(), Mutex::default())));
        assert!(b.post(Posted { len: MAX_MSG, ..posted(1, false, 0) }).is_none());
        // A sender that fills the ring with the first parts of a message longer than it, then
        // goes away.
        let mut tx = MsgSender::connect(nic().unwrap(), b.addr().endpoint().unwrap(), &config()).unwrap();
        let mut hello = vec![0u8; HEADER];
        hello[..8].copy_from_slice(&F_HELLO.to_le_bytes());
        hello.extend_from_slice(Addr::of(b.addr().endpoint().unwrap()).bytes());
        tx.send(0, &hello).unwrap();
        let big = vec![1u8; MAX_MSG];
        let r = tx.send_timeout(0, &[&[0u8; HEADER][..], &big].concat(), Some(Duration::from_millis(200)));
        assert!(matches!(r, Err(QueueError::Timeout)), "{r:?}");
        // Its first part matched the receive, which is no longer posted ...
        until(|| {
            b.progress();
            b.lock().posted.is_empty().then_some(())
        });
        drop(tx);
        until(|| {
            b.progress();
            b.cancel(1).map(|p| p.context)
        });
        assert!(landed.lock().unwrap().is_empty(), "nothing completed");
    }

    /// What a test's place to land was given: each whole message (receive, bytes, tag, from).
    struct Keep(Arc<Mutex<Vec<Kept>>>, Mutex<Vec<u8>>);

    /// A message a test's place to land was given: (receive, bytes, tag, from).
    type Kept = (usize, Vec<u8>, u64, Option<Addr>);

    impl Land for Keep {
        fn part(&self, p: &Posted, at: usize, data: &[u8]) {
            let mut b = self.1.lock().unwrap();
            assert_eq!(at, b.len(), "parts in order");
            assert!(p.context > 0);
            b.extend_from_slice(data);
        }
        fn done(&self, p: &Posted, m: Landed<'_>, len: usize, _direct: &mut Direct) {
            let b = std::mem::take(&mut *self.1.lock().unwrap());
            assert_eq!(b.len(), len);
            self.0.lock().unwrap().push((p.context, b, m.tag, m.from));
        }
    }

    /// A waiter sleeps on the queue (nothing pending) and is woken by a message; a peer that
    /// goes away fails the receives directed to it, after what it sent was delivered.
    #[test]
    fn waiting_wakes_for_messages_and_a_gone_peer_fails_directed_receives() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        a.send(b.addr(), b"first", false, 0, None).unwrap();
        // Until the message is taken, b must not sleep.
        let mut got = Vec::new();
        for _ in 0..2000 {
            got.extend(b.progress());
            if !b.lock().unexpected.is_empty() {
                break;
            }
            if b.prepare_wait(Sleeper::Theirs) {
                let _ = q.wait(Some(Duration::from_millis(50)));
            }
        }
        assert_eq!(b.lock().unexpected.len(), 1);
        assert!(b.prepare_wait(Sleeper::Theirs), "nothing pending: safe to sleep");
        while q.try_take().is_some() {}
        let t = std::thread::spawn({
            let to = b.addr();
            move || {
                std::thread::sleep(Duration::from_millis(30));
                a.send(to, b"second", false, 0, None).unwrap();
                a
            }
        });
        // Woken by the sender's store, not by a timeout.
        let woke = q.wait(Some(Duration::from_secs(20)));
        assert!(woke.is_ok(), "{woke:?}");
        let a = t.join().unwrap();
        // Directed receives from `a`: the next message, then `a` goes away.
        let from = Some(a.addr());
        let first = b.post(Posted { from, ..posted(1, false, 0) }).map(received).unwrap();
        assert_eq!(first.1.data, b"first");
        assert!(b.post(Posted { from, ..posted(5, false, 0) }).is_none());
        let mut done = Vec::new();
        for _ in 0..2000 {
            done.extend(b.progress().into_iter().map(received));
            if !done.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(done[0].1.data, b"second");
        assert!(b.post(Posted { from, ..posted(2, false, 0) }).is_none(), "waits for a live peer");
        drop(a);
        let mut failed = None;
        for _ in 0..2000 {
            if let Some(Done::Failed(p)) = b.progress().into_iter().next() {
                failed = Some(p.context);
                break;
            }
            if b.prepare_wait(Sleeper::Theirs) {
                let _ = q.wait(Some(Duration::from_millis(50)));
            }
        }
        assert_eq!(failed, Some(2), "the receive directed to the gone peer failed");
        assert!(
            matches!(b.post(Posted { from, ..posted(3, false, 0) }), Some(Done::Failed(_))),
            "and later ones at once"
        );
    }
    /// Whether each receiver of `r` has its readiness tripwire armed.
    fn armed(r: &Rdm) -> Vec<bool> {
        r.lock().receivers.iter().map(|x| x.ready.as_ref().is_some_and(|t| t.is_armed())).collect()
    }

    /// A sleep of the provider's own leaves no receiver armed once its last sleeper has
    /// woken, so that the sender's next messages find nothing to fire (an armed receiver
    /// charges each of them a firing); one of the application's (`fi_trywait`) keeps them
    /// armed, and the next message wakes its queue.
    #[test]
    fn receivers_are_disarmed_when_the_last_sleep_of_ours_ends() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        let mut messages = 0;
        let mut send = |a: &Rdm| {
            a.send(b.addr(), b"m", false, 0, None).unwrap();
            messages += 1;
            let n = messages;
            until(|| {
                b.progress();
                (b.lock().unexpected.len() == n).then_some(())
            });
        };
        send(&a);
        assert_eq!(armed(&b), [false], "nobody has slept yet");
        // Two sleepers of ours: the receiver stays armed until the second wakes.
        assert!(b.prepare_wait(Sleeper::Ours));
        assert!(b.prepare_wait(Sleeper::Ours));
        assert_eq!(armed(&b), [true]);
        b.end_wait();
        assert_eq!(armed(&b), [true], "one sleeper still sleeps");
        b.end_wait();
        assert_eq!(armed(&b), [false], "the last one woke");
        while q.try_take().is_some() {}
        send(&a);
        assert!(q.try_take().is_none(), "a message after the sleep fired nothing");
        // A look that finds something pending (no sleep follows) ends the same way.
        assert!(b.prepare_wait(Sleeper::Ours));
        a.send(b.addr(), b"m", false, 0, None).unwrap();
        until(|| (!b.prepare_wait(Sleeper::Ours)).then_some(()));
        b.end_wait();
        b.end_wait();
        assert_eq!(armed(&b), [false]);
        while q.try_take().is_some() {}
        // The application's sleep: armed from then on, and the next message wakes the queue.
        assert!(b.progress().is_empty());
        assert!(b.prepare_wait(Sleeper::Theirs));
        assert!(b.prepare_wait(Sleeper::Ours));
        b.end_wait();
        assert_eq!(armed(&b), [true], "the application may still sleep");
        a.send(b.addr(), b"m", false, 0, None).unwrap();
        assert!(q.wait(Some(Duration::from_secs(20))).is_ok(), "woken by the message");
    }

    fn until<T>(mut f: impl FnMut() -> Option<T>) -> T {
        for _ in 0..5000 {
            if let Some(x) = f() {
                return x;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("nothing came in 5 s");
    }

    /// Messages of one slot land where they lie (the short path) when the oldest posted
    /// receive matches them, bytes past the header's copy included; anything else (a receive
    /// further back, no receive, several slots) goes the whole way, and every message lands
    /// whole, in order, with its tag and sender.
    #[test]
    fn short_messages_land_from_the_ring_and_the_rest_the_whole_way() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        let landed = Arc::new(Mutex::new(Vec::new()));
        b.set_land(Box::new(Keep(landed.clone(), Mutex::default())));
        let long_short: Vec<u8> = (0..200u8).collect(); // one slot, past the header's copy
        let several = vec![9u8; 40_000]; // three slots
        // Posted oldest first: tags 1, 2, 3; then tags 5 and 6 behind tag 9, which nothing
        // matches.
        for (ctx, tag) in [(1, 1), (2, 2), (3, 3), (4, 9), (5, 5), (6, 6)] {
            assert!(b.post(Posted { len: 1 << 16, ..posted(ctx, true, tag) }).is_none());
        }
        let sent: [(u64, &[u8]); 6] =
            [(1, b""), (2, b"8 bytes!"), (3, &long_short), (5, b"behind"), (6, &several), (7, b"unexpected")];
        for (tag, data) in sent {
            a.send(b.addr(), data, true, tag, None).unwrap();
        }
        until(|| {
            b.progress();
            (landed.lock().unwrap().len() == 5 && b.lock().unexpected.len() == 1).then_some(())
        });
        let got = landed.lock().unwrap().clone();
        let want: Vec<Kept> = sent[..5]
            .iter()
            .zip(1..)
            .map(|(&(tag, d), ctx)| (ctx + usize::from(ctx > 3), d.to_vec(), tag, Some(a.addr())))
            .collect();
        assert_eq!(got, want);
        assert_eq!(b.lock().unexpected[0].data, b"unexpected");
        assert_eq!(b.lock().posted.iter().map(|p| p.context).collect::<Vec<_>>(), [4], "tag 9 still waits");
    }

    /// Remote memory requests reach the target's progress with who sent them; answers reach
    /// the requester's.
    #[test]
    fn remote_memory_requests_and_their_answers_travel() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        a.write(b.addr(), 7, 0xfeed, 4096, b"bytes", Some(3)).unwrap();
        a.read(b.addr(), 8, 0xfeed, 8192, 100).unwrap();
        let mut reqs = Vec::new();
        until(|| {
            reqs.extend(b.progress());
            (reqs.len() == 2).then_some(())
        });
        let want_w = RmaRequest {
            from: Some(a.addr()),
            id: 7,
            key: 0xfeed,
            addr: 4096,
            kind: RmaKind::Write { data: b"bytes".to_vec(), cq_data: Some(3) },
        };
        assert!(matches!(&reqs[0], Done::Rma(r) if *r == want_w), "{reqs:?}");
        assert!(matches!(&reqs[1], Done::Rma(r) if r.id == 8 && r.kind == RmaKind::Read { len: 100 }));
        b.reply(a.addr(), 8, RmaStatus::OutOfRange, b"").unwrap();
        let d = until(|| a.progress().pop());
        assert!(matches!(d, Done::Reply(RmaReply { id: 8, status: 2, .. })), "{d:?}");
        assert_eq!(RmaStatus::from_word(2), RmaStatus::OutOfRange);
        assert_eq!(RmaStatus::from_word(99), RmaStatus::Malformed);
    }

    /// A peek finds a waiting message without taking it; a claim takes it aside for the
    /// receive with the same context.
    #[test]
    fn peeks_find_and_claims_take_aside() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        assert_eq!(b.peek(&posted(1, true, 5), false), None);
        a.send(b.addr(), b"five", true, 5, None).unwrap();
        let found = until(|| b.peek(&posted(1, true, 5), false));
        assert_eq!((found.len, found.tag), (4, 5));
        assert_eq!(b.peek(&posted(1, true, 6), false), None, "another tag");
        assert!(b.peek(&posted(2, true, 5), true).is_some(), "claimed");
        assert_eq!(b.peek(&posted(3, true, 5), false), None, "a claimed message is not found again");
        assert!(b.post(posted(4, true, 5)).is_none(), "nor received");
        assert!(b.claimed(1).is_none());
        assert_eq!(b.claimed(2).map(|a| a.data), Some(b"five".to_vec()));
        assert!(b.claimed(2).is_none());
    }

    /// Two endpoints sending each other more than their rings hold at the same time both
    /// finish: a sender waiting for room takes in what is sent to it.
    #[test]
    fn two_peers_sending_each_other_more_than_a_ring_holds_both_finish() {
        let q = queue();
        let a = std::sync::Arc::new(Rdm::open(&q).unwrap());
        let b = std::sync::Arc::new(Rdm::open(&q).unwrap());
        let big = vec![0x5au8; MAX_MSG];
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        for (from, to) in [(a.clone(), b.addr()), (b.clone(), a.addr())] {
            let (big, done_tx) = (big.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let r = from.send(to, &big, false, 0, None);
                let _ = done_tx.send(r.is_ok());
            });
        }
        // Both sends are under way together; once one has finished, its side's application
        // goes on making progress (here, this thread) so that the other finishes too. (The
        // watchdog: a deadlock fails here instead of hanging.)
        // Until one has finished nobody else makes progress: each sender must take in the
        // other's message while it waits for room (or neither ever finishes).
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(60)), Ok(true), "neither send finished");
        let (mut finished, mut got) = (1, [None, None]);
        let start = std::time::Instant::now();
        while finished < 2 || got.iter().any(Option::is_none) {
            assert!(start.elapsed() < Duration::from_secs(60), "{finished} sends finished, received {got:?}");
            if let Ok(ok) = done_rx.recv_timeout(Duration::from_millis(1)) {
                assert!(ok, "a send failed");
                finished += 1;
            }
            for (k, r) in [&a, &b].into_iter().enumerate() {
                for d in r.progress() {
                    got[k] = Some(matches!(d, Done::Received(_, m) if m.data == big));
                }
                if got[k].is_none() {
                    let mut p = posted(9, false, 0);
                    p.len = MAX_MSG;
                    if let Some(Done::Received(_, m)) = r.post(p) {
                        got[k] = Some(m.data == big);
                    } else {
                        r.cancel(9);
                    }
                }
            }
        }
        assert_eq!(got, [Some(true), Some(true)]);
    }

    /// Threads sending to one peer at once, each more than its ring holds: one send waits
    /// for room with the sender out of the state, the others wait for it to be back; every
    /// message arrives, each thread's in the order it sent them.
    #[test]
    fn threads_sending_to_one_peer_at_once_all_arrive_in_their_order() {
        let q = queue();
        let a = std::sync::Arc::new(Rdm::open(&q).unwrap());
        let b = Rdm::open(&q).unwrap();
        let (threads, each) = (4u64, 200u64);
        let senders: Vec<_> = (0..threads)
            .map(|t| {
                let (a, to) = (a.clone(), b.addr());
                std::thread::spawn(move || {
                    for k in 0..each {
                        // (long ones too: they go part by part, waiting for room)
                        let len = if k % 10 == 0 { 40_000 } else { 16 };
                        let mut m = vec![t as u8; len];
                        m[..8].copy_from_slice(&k.to_le_bytes());
                        a.send(to, &m, true, t, None).unwrap();
                    }
                })
            })
            .collect();
        // (nothing received for a while: the ring fills, and the senders wait)
        std::thread::sleep(Duration::from_millis(300));
        let mut next = vec![0u64; threads as usize];
        let start = std::time::Instant::now();
        let mut ctx = 0;
        while next.iter().any(|&n| n < each) {
            assert!(start.elapsed() < Duration::from_secs(60), "received {next:?}");
            ctx += 1;
            let mut p = posted(ctx, true, 0);
            (p.len, p.ignore) = (40_000, !0);
            let got = match b.post(p) {
                Some(d) => vec![d],
                None => {
                    let mut got = b.progress();
                    if got.is_empty() {
                        b.cancel(ctx);
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    got.retain(|d| matches!(d, Done::Received(..)));
                    got
                }
            };
            for d in got {
                let (_, m) = received(d);
                let k = u64::from_le_bytes(m.data[..8].try_into().unwrap());
                let t = m.tag as usize;
                assert_eq!(k, next[t], "thread {t}'s messages out of order");
                assert!(m.data[8..].iter().all(|&x| x == t as u8));
                next[t] += 1;
            }
        }
        for s in senders {
            s.join().unwrap();
        }
    }

    #[test]
    fn the_nic_is_configured_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let c = nic_config(env(&[])).unwrap();
        assert!(c.ip.is_loopback(), "this host only by default");
        let c = nic_config(env(&[("CLAN_FI_IP", "10.77.1.2"), ("CLAN_FI_PORT", "7100")])).unwrap();
        assert!(c.tcp && c.ip.to_string() == "10.77.1.2" && c.port == 7100);
        let key = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let k = nic_config(move |n: &str| (n == "CLAN_FI_KEY").then(|| key.to_string())).unwrap().cluster_key.unwrap();
        assert_eq!((k[0], k[1], k[31]), (0x00, 0x11, 0xff));
        for bad in [
            &[("CLAN_FI_IP", "host.example")][..],
            &[("CLAN_FI_PORT", "70000")][..],
            &[("CLAN_FI_KEY", "abc")][..],
            &[("CLAN_FI_KEY", "zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff")][..],
        ] {
            let bad: &'static [(&'static str, &'static str)] = bad;
            assert!(nic_config(env(bad)).is_err(), "{bad:?}");
        }
    }
}
