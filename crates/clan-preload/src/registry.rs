//! Deciding, before the first byte, whether a TCP connection is carried over clan.
//!
//! A clan-run process that listens on a TCP port registers the port under an abstract Unix
//! name (`clan-run/<ip>:<port>`, in its network namespace, gone when the process is) served
//! by a thread of this library, never by the application. A clan-run client connecting to
//! a local address looks the name up **before** its kernel `connect` and *claims* the
//! connection: it passes its socket itself (`SCM_RIGHTS`: proof of what it claims) with a
//! random token of its own, and learns the server's clan address from the answer. Then it
//! connects a clan stream to the server's runtime, the token in the stream's connect
//! hand-shake, and the kernel socket (on a channel kept from an earlier claim, the address is
//! known and the stream is connected while the server looks at the claim). The server's
//! `accept` finds the accepted connection's peer socket (its cookie, asked of the kernel)
//! among the claims, and takes the clan stream that brought that token, if it came from the
//! claimant's user, and was the first to bring it. Any failure on the
//! way leaves the connection to the kernel, on both sides, before a byte was sent; a plain
//! client (no claim) costs the server's `accept` nothing when no claim is pending.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, EventQueue, EventQueueConfig, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use clan_shm::eventfd::EventFd;
use clan_shm::seqpacket::SeqPacket;
use libc::c_int;

use crate::conn::Conn;
use crate::real;

/// Claims a listener holds at most (each is taken by `accept`, or withdrawn by its client;
/// only a client that died between its claim and its `connect` leaves one behind). A claim
/// has no deadline: a connection may wait in the listener's backlog as long as the server
/// likes, as a kernel one may (claims used to expire after 30 s; a connection accepted later
/// went to the kernel on the server's side while its client sent over clan, and both waited
/// for good).
const MAX_CLAIMS: usize = 65536;
/// How long `accept` waits for the clan stream of a claimed connection.
const ATTACH_WAIT: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's clan side: a NIC, and a stream listener whose thread takes the clan
/// streams of claimed connections.
pub(crate) struct Runtime {
    nic: Nic,
    addr: EndpointAddr,
    /// Streams that arrived with a token, until their connection is accepted.
    attached: Mutex<Filed>,
    cv: Condvar,
    /// Queues of closed connections ([`QUEUES_KEPT`] at most), for new ones.
    queues: Mutex<Vec<EventQueue>>,
}

enum Attach {
    /// (boxed: a stream holds its two sides, a few hundred bytes; a decline, nothing)
    Ready(Box<Stream>, EventQueue),
    Declined,
}

/// Streams filed by token (and tokens declined), at most [`MAX_CLAIMS`]: past that, the
/// oldest go first (a stream whose client died between its claim and its `connect`, or a
/// decline whose stream never came, is never taken; a burst of them costs the oldest
/// entries, not every stream filed).
#[derive(Default)]
struct Filed {
    /// By token: the entry, and when it was filed.
    map: HashMap<u64, (Attach, Instant)>,
    /// Tokens in the order they were filed (some taken since: skipped when met).
    order: std::collections::VecDeque<u64>,
    /// Filings since the last look for streams their clients closed.
    since_sweep: usize,
}

/// Filings between two looks for filed streams whose clients closed them (spares a client
/// let go unused, `spares.rs`; streams of clients that died before their `connect`); the
/// runtime's thread also looks whenever it has been quiet for a while.
const SWEEP_EVERY: usize = 64;
/// A stream filed this long ago at least, closed by its client and claimed by nobody, is
/// dropped (younger ones may be waiting for their claim, sent at the same time).
const SWEEP_AGE: Duration = Duration::from_secs(1);

impl Filed {
    fn insert(&mut self, token: u64, a: Attach) {
        if self.map.insert(token, (a, Instant::now())).is_none() {
            self.order.push_back(token);
        }
        self.since_sweep += 1;
        while self.map.len() > MAX_CLAIMS {
            let Some(t) = self.order.pop_front() else { break };
            self.map.remove(&t);
        }
        // (tokens taken leave the order list only when met: compact it now and then)
        if self.order.len() > 2 * MAX_CLAIMS {
            let map = &self.map;
            self.order.retain(|t| map.contains_key(t));
        }
    }

    fn remove(&mut self, token: &u64) -> Option<Attach> {
        self.map.remove(token).map(|(a, _)| a)
    }

    /// Drop the filed streams their clients closed, filed [`SWEEP_AGE`] ago at least, that
    /// no pending claim names (`claimed`): a claimed connection's stream stays however it
    /// ended, for its `accept` to read what it brought.
    fn sweep(&mut self, claimed: &std::collections::HashSet<u64>, now: Instant) {
        self.since_sweep = 0;
        self.map.retain(|token, (a, filed)| match a {
            Attach::Ready(s, _) if now.duration_since(*filed) >= SWEEP_AGE && !claimed.contains(token) => {
                let r = s.readiness();
                !(r.error || r.eof)
            }
            _ => true,
        });
    }

    fn is_vacant(&self, token: &u64) -> bool {
        !self.map.contains_key(token)
    }

    /// Whether a stream is filed (something a sweep could drop).
    fn has_streams(&self) -> bool {
        self.map.values().any(|(a, _)| matches!(a, Attach::Ready(..)))
    }
}

/// How long the runtime's thread waits for a stream before it sweeps, while streams are
/// filed; with none filed it waits [`IDLE_WAIT`] (a sweep would find nothing): an idle
/// process's thread sleeps.
const QUIET: Duration = Duration::from_millis(500);
const IDLE_WAIT: Duration = Duration::from_secs(60);

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("addr", &self.addr).finish_non_exhaustive()
    }
}

static RUNTIME: OnceLock<Option<Arc<Runtime>>> = OnceLock::new();

/// The runtime, started on first use (None: clan cannot run here; everything stays with the
/// kernel).
pub(crate) fn runtime() -> Option<&'static Arc<Runtime>> {
    RUNTIME
        .get_or_init(|| match real::with_signals_blocked(Runtime::start) {
            Ok(r) => Some(r),
            Err(e) => {
                crate::say(format_args!("clan is not available ({e}): every socket stays with the kernel"));
                None
            }
        })
        .as_ref()
}

/// Half the descriptor limit (at least 256, at most 65 536): out of the program's way.
/// Descriptors a connection over clan may need at once here (its queue, its side, a port):
/// kept free when deciding whether there is room for one.
const FD_PER_CONNECTION: i32 = 16;

/// Whether there is room for another connection's descriptors in clan's share of the
/// numbers: half of those between the floor and the limit (`fd`: any descriptor, to
/// duplicate there once and close). Without room, a new connection stays with the kernel
/// (one descriptor) rather than set up clan's (about six), which would fill the numbers
/// the program counts on and bring its `EMFILE` at a fraction of the connections the kernel
/// allows.
///
/// Asking costs three system calls (the limit, a duplicate, its close), and a short
/// connection was asking three times: an answer that found room for many connections lets
/// the next few ([`ROOM_CREDIT_MAX`] at most, a quarter of the room found) through without
/// asking again.
pub(crate) fn fd_room(fd: BorrowedFd<'_>) -> bool {
    let floor = clan_shm::fdfloor::get();
    if floor == 0 {
        return true;
    }
    // (Relaxed: a count of permissions, no memory published with it)
    if ROOM_CREDIT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1)).is_ok() {
        return true;
    }
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(1 << 20);
    let limit = i32::try_from(limit).unwrap_or(i32::MAX);
    let share_end = floor.saturating_add(limit.saturating_sub(floor) / 2);
    // (the lowest free number at or above the floor: where the next one of ours goes)
    match rustix::io::fcntl_dupfd_cloexec(fd, floor) {
        Ok(probe) => {
            use std::os::fd::AsRawFd;
            let room = share_end.saturating_sub(probe.as_raw_fd()) / FD_PER_CONNECTION;
            ROOM_CREDIT.store(u32::try_from(room / 4 - 1).unwrap_or(0).min(ROOM_CREDIT_MAX), Ordering::Relaxed);
            room >= 1
        }
        Err(_) => false,
    }
}

/// Connections [`fd_room`] lets through before it asks the kernel again.
static ROOM_CREDIT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// At most this many: each spends at most [`FD_PER_CONNECTION`] numbers, so a credit never
/// spends more than a quarter of the room its answer found.
const ROOM_CREDIT_MAX: u32 = 32;

fn fd_floor() -> i32 {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(1 << 20);
    (soft / 2).clamp(256, 1 << 16) as i32
}

/// Queues of connections that are gone, kept for the next ones: a queue is a memfd, an
/// eventfd and a mapping here, and a port (another memfd and eventfd) in each peer process
/// that posts to it; made and unmade per connection, they were much of a short connection's
/// cost.
const QUEUES_KEPT: usize = 32;

fn small_queue(nic: &Nic) -> io::Result<EventQueue> {
    nic.event_queue(EventQueueConfig { ring_capacity: 64, tripwires: 64, ..EventQueueConfig::default() })
        .map_err(io::Error::other)
}

impl Runtime {
    fn start() -> io::Result<Arc<Runtime>> {
        crate::hooks::on_fork_handlers();
        // Our descriptors go high: the program sizes its tables by the ones it expects.
        clan_shm::fdfloor::set(fd_floor());
        let nic = Nic::open(NicConfig { tcp: false, wake_signal: false, ..NicConfig::default() })
            .map_err(io::Error::other)?;
        let listener = Listener::bind(&nic)?;
        let rt = Arc::new(Runtime {
            addr: listener.local_addr(),
            nic,
            attached: Mutex::new(Filed::default()),
            cv: Condvar::new(),
            queues: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&rt);
        std::thread::Builder::new().name("clan-run-accept".into()).spawn(move || take_streams(weak, listener))?;
        Ok(rt)
    }

    /// A queue for a new connection: one a closed connection left (emptied: what its
    /// connection's last moments posted only wakes, and its next `arm` resets what is
    /// readable), or a new one.
    fn queue(&self) -> io::Result<EventQueue> {
        if let Some(q) = lock(&self.queues).pop() {
            while q.try_take().is_some() {}
            return Ok(q);
        }
        small_queue(&self.nic)
    }

    /// Wait for the clan stream that brings `token` (None: declined, or not in time).
    fn wait_attached(&self, token: u64) -> Option<(Stream, EventQueue)> {
        let deadline = Instant::now() + ATTACH_WAIT;
        let mut m = lock(&self.attached);
        loop {
            match m.remove(&token) {
                Some(Attach::Ready(s, q)) => return Some((*s, q)),
                Some(Attach::Declined) => return None,
                None => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            m = self.cv.wait_timeout(m, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// The claim of `token` is withdrawn: its stream, come or to come, is dropped, and an
    /// `accept` of its connection takes none.
    fn decline(&self, token: u64) {
        // (a stream that came already is dropped here: replaced)
        lock(&self.attached).insert(token, Attach::Declined);
        self.cv.notify_all();
    }

    /// The stream that brings `token` came: filed for `accept`, unless its claim was
    /// withdrawn meanwhile or another stream brought that token first (then dropped: a
    /// stream never replaces one filed, so one that comes late with a token it learned or
    /// guessed cannot take a connection over; `accept` also checks the stream's user).
    fn attach(&self, token: u64, s: Stream, q: EventQueue) {
        let mut m = lock(&self.attached);
        if m.is_vacant(&token) {
            m.insert(token, Attach::Ready(Box::new(s), q));
        }
        let sweep = m.since_sweep >= SWEEP_EVERY;
        drop(m);
        self.cv.notify_all();
        if sweep {
            self.sweep();
        }
    }

    /// Drop the filed streams their clients closed, unclaimed (`Filed::sweep`).
    fn sweep(&self) {
        // (the claims first, their locks let go: `accept` takes them before this one)
        let regs: Vec<Arc<Registered>> = lock(listeners()).values().cloned().collect();
        let claimed: std::collections::HashSet<u64> =
            regs.iter().flat_map(|r| lock(&r.pending).values().map(|c| c.token).collect::<Vec<_>>()).collect();
        lock(&self.attached).sweep(&claimed, Instant::now());
    }
}

/// The queue of a connection that is gone, for the next one (kept if there is room).
pub(crate) fn recycle_queue(q: EventQueue) {
    if let Some(Some(rt)) = RUNTIME.get() {
        let mut v = lock(&rt.queues);
        if v.len() < QUEUES_KEPT {
            v.push(q);
        }
    }
}

/// The runtime's thread: accept clan streams, each with its own queue, and file each under
/// the token its client connected with ([`Stream::connect_to_with_data`]: the token is in
/// the connect hand-shake, not in the stream). It never waits for a client: anyone may
/// connect to the runtime's listener, and a stream that brings no token is dropped at once.
fn take_streams(rt: Weak<Runtime>, listener: Listener) {
    let mut queue = None;
    loop {
        let Some(r) = rt.upgrade() else { return };
        if queue.is_none() {
            queue = r.queue().ok();
        }
        let Some(q) = queue.as_ref() else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let wait = if lock(&r.attached).has_streams() { QUIET } else { IDLE_WAIT };
        match listener.accept_to(q, wait) {
            Ok((stream, _)) => {
                let queue = queue.take().expect("a queue");
                if let Ok(token) = <[u8; 8]>::try_from(stream.peer_data()) {
                    r.attach(u64::from_le_bytes(token), stream, queue);
                }
            }
            // (quiet for a while: a look for streams whose clients closed them)
            Err(e) if e.kind() == io::ErrorKind::TimedOut => r.sweep(),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
        // (Streams wait for their connection's `accept` as long as its claim does; past as
        // many as a listener may hold claims, the oldest are forgotten: `Filed`.)
    }
}

/// A registered listening socket.
#[derive(Debug)]
pub(crate) struct Registered {
    /// Claims not yet accepted, by the claimant's socket's cookie ([`MAX_CLAIMS`]).
    pending: Mutex<HashMap<u64, Claim>>,
    closed: AtomicBool,
    /// The claim channels of clients, with the tokens each may still withdraw: served by the
    /// listener's thread, and by an `accept` that finds no claim for its connection (a claim
    /// on a kept channel is answered after its client's kernel `connect`, which may reach
    /// the `accept` first: the claim is in its channel by then, sent before the `connect`).
    channels: Mutex<Vec<(SeqPacket, Vec<u64>)>>,
    /// The registered name's socket, whose connections are the channels (None once the
    /// listener's thread ended: the name is free again). An `accept` that finds no claim
    /// takes new channels from it too: a client that knew the server's address sent its claim
    /// on a new channel before its `connect`, without waiting for an answer.
    listener: Mutex<Option<SeqPacket>>,
    /// The port its listeners share with others (`SO_REUSEPORT`; several of this process's
    /// listening sockets may then be registered under this one registration): a claim is
    /// taken only while every socket listening on the port is one of those
    /// ([`Registered::ours_alone`]).
    shared: Option<u16>,
    /// Wakes the listener's thread, which sleeps on its channels until a message comes: the
    /// registration closed, or an `accept` changed the channels it sleeps on (None: no
    /// eventfd could be made; the thread then looks again every [`CLAIMS_NAP`]).
    kick: Option<EventFd>,
}

/// How long the listener's thread sleeps at most when it has no eventfd to be woken by.
const CLAIMS_NAP: c_int = 200;

impl Registered {
    fn new(pending: HashMap<u64, Claim>, sock: SeqPacket, shared: Option<u16>) -> Registered {
        Registered {
            pending: Mutex::new(pending),
            closed: AtomicBool::new(false),
            channels: Mutex::new(Vec::new()),
            listener: Mutex::new(Some(sock)),
            shared,
            kick: EventFd::new().ok(),
        }
    }

    /// Close the registration: its thread lets the name go and ends. (No allocation and no
    /// lock: called in the parent at a `fork`.)
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.wake();
    }

    /// Wake the listener's thread (it looks at its channels again).
    fn wake(&self) {
        if let Some(k) = &self.kick {
            k.signal();
        }
    }

    /// Whether the kernel can hand a connection to the port only to a listener registered
    /// here (`shared`: some other socket, another process's, may have joined the port since;
    /// a claim accepted there would go over clan on its client's side only).
    fn ours_alone(&self) -> bool {
        let Some(port) = self.shared else { return true };
        let Some(on_port) = crate::procnet::listening_inodes(port) else { return false };
        let ours: Vec<u64> = lock(listeners())
            .iter()
            .filter(|(_, r)| std::ptr::eq(Arc::as_ptr(r), self))
            .filter_map(|(fd, _)| real::with_fd(*fd, |b| rustix::fs::fstat(b).ok()).map(|st| st.st_ino))
            .collect();
        on_port.iter().all(|i| ours.contains(i))
    }

    /// Whether a channel waits to be taken in (never blocks).
    fn new_channels(&self) -> bool {
        let Some(fd) = lock(&self.listener).as_ref().map(raw) else { return false };
        let mut p = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
        real::poll_fds(&mut p, 0).is_ok_and(|n| n > 0)
    }
}

/// A claim the registry took: the token its stream will bring, and the claimant's user (the
/// owner of the socket it passed), whose stream alone may carry the connection.
#[derive(Debug, Clone, Copy)]
struct Claim {
    token: u64,
    uid: u32,
    /// The claimant's socket's inode (for a kernel without `NETLINK_SOCK_DIAG`, whose
    /// tables give only that).
    inode: u64,
}

static LISTENERS: OnceLock<Mutex<HashMap<c_int, Arc<Registered>>>> = OnceLock::new();

fn listeners() -> &'static Mutex<HashMap<c_int, Arc<Registered>>> {
    LISTENERS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn name(addr: SocketAddr) -> Vec<u8> {
    format!("clan-run/{addr}").into_bytes()
}

/// Whether `fd` is a TCP socket, and its bound address.
fn tcp_local(fd: c_int) -> Option<SocketAddr> {
    real::with_fd(fd, |b| {
        if rustix::net::sockopt::socket_type(b).ok()? != rustix::net::SocketType::STREAM {
            return None;
        }
        let a = rustix::net::getsockname(b).ok()?;
        SocketAddr::try_from(a).ok()
    })
}

fn peer_of(fd: c_int) -> Option<SocketAddr> {
    real::with_fd(fd, |b| SocketAddr::try_from(rustix::net::getpeername(b).ok()??).ok())
}

/// `listen` succeeded on `fd`: register its port for clan-run clients.
pub(crate) fn on_listen(fd: c_int) {
    let Some(local) = tcp_local(fd) else { return };
    if lock(listeners()).contains_key(&fd) {
        return;
    }
    // A listener that shares its port (`SO_REUSEPORT`) may not be the one the kernel hands a
    // connection to: a claim made here would be accepted elsewhere (another process), where
    // it is a plain connection, while its client sends over clan. The listeners of this
    // process on that address share one registration, whose claims are taken only while
    // nobody else listens on the port (`Registered::ours_alone`).
    let shared = real::with_fd(fd, |b| rustix::net::sockopt::socket_reuseport(b).unwrap_or(true)).then(|| local.port());
    if shared.is_some() {
        let mut m = lock(listeners());
        let same = m.iter().find(|(l, r)| r.shared.is_some() && tcp_local(**l) == Some(local)).map(|(_, r)| r.clone());
        if let Some(r) = same {
            let old = m.insert(fd, r);
            drop(m);
            drop(old);
            crate::say(format_args!("listener {local} registered with the others of this process on its port"));
            return;
        }
    }
    let Some(rt) = runtime() else { return };
    let sock = match SeqPacket::listen_abstract(&name(local)) {
        Ok(s) => s,
        Err(e) => {
            crate::say(format_args!("listener {local} not registered (its connections stay with the kernel): {e}"));
            return;
        }
    };
    let reg = Arc::new(Registered::new(HashMap::new(), sock, shared));
    let old = lock(listeners()).insert(fd, reg.clone());
    drop(old);
    let rt = rt.clone();
    let _ = real::with_signals_blocked(|| {
        std::thread::Builder::new().name("clan-run-claims".into()).spawn(move || serve_claims(rt, reg))
    });
    crate::say(format_args!("listener {local} registered: connections from clan-run clients will be claimed"));
}

/// After a `fork` in the parent: no listener takes claims any more (a child may be the one
/// that accepts). The claims already made stay: whichever process accepts one of them gets it
/// (a child through the parent: [`hand_over_claimed`]).
pub(crate) fn stop_claims() {
    if let Some(m) = LISTENERS.get() {
        // (no allocation, no blocking: a lock that a thread of ours could hold at the fork
        // is only ever held briefly, and this runs in the parent, whose threads go on)
        if let Ok(m) = m.try_lock() {
            for r in m.values() {
                r.close();
            }
        }
    }
}

/// In a child after `fork`: the parent's registered listeners (their descriptors).
pub(crate) fn inherited_listeners() -> Vec<c_int> {
    LISTENERS.get().and_then(|m| m.try_lock().ok().map(|m| m.keys().copied().collect())).unwrap_or_default()
}

/// Never resume claims (a listener went on into an `exec`ed image, which could accept).
static PINNED: AtomicBool = AtomicBool::new(false);

/// A child's listener survives its `exec`: claims stay stopped for good.
pub(crate) fn pin_stop() {
    PINNED.store(true, Ordering::Release);
}

/// The children a `fork` made are all gone (or exec'ed without a listener): the listeners
/// still open take claims again, each under a new registration (the old one's thread, woken
/// by the stop, lets go of the name soon after; binding it is retried for a while).
pub(crate) fn resume_claims() {
    if PINNED.load(Ordering::Acquire) {
        return;
    }
    let Some(m) = LISTENERS.get() else { return };
    let stopped: Vec<(c_int, Arc<Registered>)> =
        lock(m).iter().filter(|(_, r)| r.closed.load(Ordering::Acquire)).map(|(fd, r)| (*fd, r.clone())).collect();
    // (listeners that shared a registration share the new one)
    let mut renewed: Vec<(Arc<Registered>, Arc<Registered>)> = Vec::new();
    for (fd, old) in stopped {
        if let Some((_, new)) = renewed.iter().find(|(o, _)| Arc::ptr_eq(o, &old)) {
            let replaced = lock(m).insert(fd, new.clone());
            drop(replaced); // (after the lock: see `on_close`)
            continue;
        }
        let listening = real::with_fd(fd, |b| rustix::net::sockopt::socket_acceptconn(b).unwrap_or(false));
        let Some(local) = tcp_local(fd).filter(|_| listening) else {
            let gone = lock(m).remove(&fd);
            drop(gone);
            continue;
        };
        let Some(rt) = runtime() else { return };
        let mut sock = None;
        for _ in 0..50 {
            match SeqPacket::listen_abstract(&name(local)) {
                Ok(s) => {
                    sock = Some(s);
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let Some(sock) = sock else {
            crate::say(format_args!("listener {local}: claims not resumed (its name stayed taken)"));
            continue;
        };
        // The claims made before the stop stay (a connection in the accept queue may be one).
        let pending = std::mem::take(&mut *lock(&old.pending));
        let reg = Arc::new(Registered::new(pending, sock, old.shared));
        let replaced = lock(m).insert(fd, reg.clone());
        drop(replaced);
        renewed.push((old, reg.clone()));
        let rt = rt.clone();
        let _ = real::with_signals_blocked(|| {
            std::thread::Builder::new().name("clan-run-claims".into()).spawn(move || serve_claims(rt, reg))
        });
        crate::say(format_args!("listener {local}: claims resumed (the children of the fork are gone)"));
    }
}

/// Whether this process has registered listeners or clan connections (a `fork` then makes
/// the pair its children ask through).
pub(crate) fn active() -> bool {
    RUNTIME.get().is_some_and(Option::is_some)
}

/// In a child after `fork`: `fd`, just accepted on the inherited listener `lfd`, may be a
/// connection a clan-run client claimed before the fork (its clan stream went to the
/// parent). Its token, if so.
pub(crate) fn claimed_token(lfd: c_int, fd: c_int) -> Option<u64> {
    let reg = LISTENERS.get()?.try_lock().ok()?.get(&lfd).cloned()?;
    let pending = reg.pending.try_lock().ok()?;
    if pending.is_empty() {
        return None;
    }
    let local = real::with_fd(fd, |b| SocketAddr::try_from(rustix::net::getsockname(b).ok()?).ok())?;
    let key = claim_key(&pending, crate::procnet::peer_socket(peer_of(fd)?, local)?)?;
    pending.get(&key).map(|c| c.token)
}

/// The key of the claim of the socket found at the other end of a connection, if it has
/// one: its cookie, or (the kernel's tables gave only its inode) the claim with that inode.
fn claim_key(pending: &HashMap<u64, Claim>, found: crate::procnet::Found) -> Option<u64> {
    match found {
        crate::procnet::Found::Cookie(c) => pending.contains_key(&c).then_some(c),
        crate::procnet::Found::Inode(i) => pending.iter().find(|(_, c)| c.inode == i).map(|(k, _)| *k),
    }
}

/// In the parent: a child accepted the claimed connection `token`: hand its clan stream over
/// (the client then sends everything over the kernel, where the child reads it).
pub(crate) fn hand_over_claimed(token: u64) {
    if let Some(m) = LISTENERS.get() {
        for r in lock(m).values() {
            lock(&r.pending).retain(|_, c| c.token != token);
        }
    }
    let Some(rt) = runtime() else { return };
    let Some((s, q)) = rt.wait_attached(token) else { return };
    match Conn::new(s, q, false) {
        Ok(c) => {
            let c = Arc::new(c);
            // (no kernel socket here: the child has it; nothing was shut down)
            if c.hand_over(-1, "a child accepted it") {
                crate::fork::bury(c);
            }
        }
        Err(e) => crate::say(format_args!("a claimed connection a child accepted could not be handed over ({e})")),
    }
}

/// The listening socket `fd` is being closed.
pub(crate) fn on_close(fd: c_int) {
    if let Some(m) = LISTENERS.get() {
        // The registration is let go of after the lock: its last reference drops its
        // eventfd, whose `close` comes back here.
        let removed = {
            let mut m = lock(m);
            let r = m.remove(&fd);
            // (the registration stays while another of its listeners is open)
            if let Some(r) = &r
                && !m.values().any(|o| Arc::ptr_eq(o, r))
            {
                r.close();
            }
            r
        };
        drop(removed);
    }
}

/// Tokens a claim channel may withdraw at most: its most recent claims'. (An older claim
/// withdrawn is not dropped at once: its connection, if accepted, waits for a stream that
/// never comes for [`ATTACH_WAIT`] and then is the kernel's.)
const TOKENS_PER_CHANNEL: usize = 4096;

/// Claims for one listener: `CLAIM` + the client's token (8 bytes) + the claimant's socket
/// (SCM_RIGHTS) → `OK` + our clan address, or `NO` (and a stream that brings the token is
/// dropped); `DECLINE` + token → the claim is dropped. A client keeps its channel for its
/// next claims.
fn serve_claims(rt: Arc<Runtime>, reg: Arc<Registered>) {
    if let Some(sock) = lock(&reg.listener).as_ref() {
        let _ = sock.set_timeouts(Duration::from_millis(200));
        let _ = sock.set_nonblocking(true);
    }
    while !reg.closed.load(Ordering::Acquire) {
        if !serve_channels(&rt, &reg, false) {
            // No claim in flight: sleep until a message, a new channel or a kick comes. The
            // set is rebuilt after every wake: an `accept` that takes in new channels or
            // drops closed ones (`on_accept`) kicks, and so does closing the registration.
            let mut fds: Vec<libc::pollfd> = reg
                .kick
                .as_ref()
                .map(|k| libc::pollfd { fd: k.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 })
                .into_iter()
                .collect();
            fds.extend(lock(&reg.listener).as_ref().map(|l| libc::pollfd {
                fd: raw(l),
                events: libc::POLLIN,
                revents: 0,
            }));
            fds.extend(lock(&reg.channels).iter().map(|(c, _)| libc::pollfd {
                fd: raw(c),
                events: libc::POLLIN,
                revents: 0,
            }));
            // (the registration may have closed between the look above and the set: its
            // kick is in the eventfd then, and the poll returns at once)
            let _ = real::poll_fds(&mut fds, if reg.kick.is_some() { -1 } else { CLAIMS_NAP });
            if let Some(k) = &reg.kick {
                k.drain();
            }
        }
    }
    // (the channels close: their clients claim no more here; and the name is let go)
    lock(&reg.channels).clear();
    *lock(&reg.listener) = None;
}

/// Take every message the claim channels hold (never waiting): answer the claims, take the
/// withdrawals, drop the channels their clients closed. Whether any message came. With
/// `wake`, the listener's thread is woken if the channels changed (it sleeps on their set).
fn serve_channels(rt: &Runtime, reg: &Registered, wake: bool) -> bool {
    let mut buf = [0u8; 256];
    let mut busy = false;
    let mut channels = lock(&reg.channels);
    let before = channels.len();
    let mut added = false;
    // (one look at the name's socket and every channel, then a call on those that have
    // something only: a pass that asked each of sixteen quiet channels cost sixteen calls)
    let ready = {
        let listener = lock(&reg.listener);
        let mut fds: Vec<libc::pollfd> = listener
            .iter()
            .map(raw)
            .chain(channels.iter().map(|(c, _)| raw(c)))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        // (a look that failed: every one is asked)
        let looked = real::poll_fds(&mut fds, 0).is_ok();
        let mut ready = fds.iter().map(|p| !looked || p.revents != 0);
        // (new channels first: a claim may wait in one, `Registered::listener`)
        if let Some(l) = listener.as_ref() {
            if ready.next().unwrap_or(true) {
                while let Ok(Some(c)) = l.accept() {
                    let _ = c.set_nonblocking(true);
                    channels.push((c, Vec::new()));
                    added = true;
                }
            }
        }
        ready.collect::<Vec<bool>>()
    };
    // (one message a channel a pass: a client that floods its channel holds up no other;
    // channels taken in just now were not looked at: asked)
    let mut i = 0;
    channels.retain_mut(|(c, tokens)| {
        let asked = ready.get(i).copied().unwrap_or(true);
        i += 1;
        if !asked {
            return true;
        }
        loop {
            // (the claimant's socket is looked at and closed at once: left where the kernel
            // put it)
            match c.try_recv_unlifted(&mut buf) {
                Ok(m) if m.len == 0 => break false,
                Ok(m) => {
                    busy = true;
                    let msg = &buf[..m.len];
                    if msg.len() == CLAIM_LEN && msg.starts_with(b"CLAIM") && m.fds.len() == 1 && !m.truncated {
                        let token = u64::from_le_bytes(msg[5..CLAIM_LEN].try_into().unwrap_or_default());
                        let reply = claim(rt, reg, &m.fds[0], c, token);
                        if let Some(t) = reply.1 {
                            // (a client keeps its channel for its next claims: the tokens it
                            // may still withdraw are its last ones)
                            if tokens.len() >= TOKENS_PER_CHANNEL {
                                tokens.drain(..TOKENS_PER_CHANNEL / 2);
                            }
                            tokens.push(t);
                        }
                        let _ = c.send(&reply.0, &[]);
                    } else if msg.starts_with(b"DECLINE") && msg.len() == 15 {
                        let t = u64::from_le_bytes(msg[7..15].try_into().unwrap_or_default());
                        if tokens.contains(&t) {
                            lock(&reg.pending).retain(|_, c| c.token != t);
                            rt.decline(t);
                        }
                    }
                    break true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        }
    });
    // (a channel dropped here closed a descriptor the thread may be polling)
    if wake && (added || channels.len() < before) {
        drop(channels);
        reg.wake();
    }
    busy
}

fn raw(s: &SeqPacket) -> c_int {
    use std::os::fd::{AsFd, AsRawFd};
    s.as_fd().as_raw_fd()
}

/// A claim: `CLAIM` and the client's token.
const CLAIM_LEN: usize = 13;

/// Answer one claim: verify the socket passed is what it says (its identity, its owner), record
/// it. A claim refused for our own reasons declines its token: the stream the client may
/// have sent already is dropped. (One refused because the claimant does not own the socket
/// declines nothing: a process that lies about its socket could otherwise fill the list of
/// declined tokens at the cost of a message each.)
fn claim(
    rt: &Runtime,
    reg: &Registered,
    sock: &std::os::fd::OwnedFd,
    from: &SeqPacket,
    token: u64,
) -> (Vec<u8>, Option<u64>) {
    let no = |decline: bool| {
        if decline {
            rt.decline(token);
        }
        (b"NO".to_vec(), None)
    };
    let Ok(st) = rustix::fs::fstat(sock) else { return no(false) };
    // (the socket's cookie: what `accept` finds it by, even once its client closed it, when
    // the kernel's tables no longer give its inode)
    let Ok(cookie) = rustix::net::sockopt::socket_cookie(sock) else { return no(false) };
    // The claimant must own the socket it passed: same user.
    match from.peer_cred() {
        Ok(c) if c.uid == st.st_uid => {}
        _ => return no(false),
    }
    // (no room for the stream's descriptors: the connection is the kernel's)
    if !fd_room(sock.as_fd()) {
        return no(true);
    }
    // (another process listens on the shared port too: its connections are the kernel's)
    if !reg.ours_alone() {
        return no(true);
    }
    let mut p = lock(&reg.pending);
    if p.len() >= MAX_CLAIMS {
        drop(p);
        return no(true);
    }
    #[allow(clippy::unnecessary_cast)]
    p.insert(cookie, Claim { token, uid: st.st_uid, inode: st.st_ino as u64 });
    let mut reply = b"OK".to_vec();
    reply.extend_from_slice(rt.addr.to_string().as_bytes());
    (reply, Some(token))
}

/// Whether `ip` is an address of this host (loopback, or one a socket can bind).
fn is_local(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    if let IpAddr::V6(v6) = ip {
        if let Some(v4) = v6.to_ipv4_mapped() {
            return is_local(IpAddr::V4(v4));
        }
    }
    let family = if ip.is_ipv4() { rustix::net::AddressFamily::INET } else { rustix::net::AddressFamily::INET6 };
    let Ok(s) = rustix::net::socket(family, rustix::net::SocketType::DGRAM, None) else { return false };
    rustix::net::bind(&s, &SocketAddr::new(ip, 0)).is_ok()
}

/// What `connect` should do after a claim: its clan stream, connected and carrying the
/// token already.
#[derive(Debug)]
pub(crate) struct Claimed {
    token: u64,
    dest: SocketAddr,
    chan: SeqPacket,
    server: EndpointAddr,
    stream: (Stream, EventQueue),
    /// The claim's answer was read (false: it is still in the channel, read by `attach`).
    answered: bool,
}

/// Before the kernel `connect` of `fd` to `dest`: claim the connection if a clan-run
/// process listens there, and connect its clan stream. None: a plain connection.
///
/// The stream comes first, so that it is in the server's hands by the time the server
/// accepts the kernel's connection: its `accept` then takes it without waiting (made after
/// the kernel's connection, the stream's whole set-up was spent in the server's `accept`, and
/// a single-threaded server took one connection at a time).
pub(crate) fn claim_before_connect(fd: c_int, dest: SocketAddr) -> Option<Claimed> {
    match claim_and_connect(fd, dest) {
        Ok(c) => Some(c),
        Err(why) => {
            crate::say(format_args!("connection to {dest} left to the kernel: {why}"));
            None
        }
    }
}

/// A token for a claim: random, so that nobody can bring it in a stream of their own
/// before ours (the server also takes only the first stream with a token, and only from
/// the claimant's user).
pub(crate) fn random_token() -> u64 {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    u64::from_le_bytes(b)
}

/// Our clan stream to the runtime at `server`, the token in its hand-shake.
pub(crate) fn connect_stream(rt: &Runtime, server: EndpointAddr, token: u64) -> Option<(Stream, EventQueue)> {
    let q = rt.queue().ok()?;
    let s = Stream::connect_to_with_data(&rt.nic, server, &StreamConfig::default(), &q, &token.to_le_bytes()).ok()?;
    Some((s, q))
}

/// How a claim was answered, when it was not taken.
enum NotTaken {
    /// The listener declined (it has forked, is full, or has no room for descriptors): it
    /// declined the token too (a stream that brings it is dropped). The channel is fine.
    Declined,
    /// The channel failed (its server went away, or answered nonsense): unfit for more.
    Broken(&'static str),
}

/// The answer to the claim just sent on `chan`: the server's clan address.
fn read_answer(chan: &SeqPacket) -> Result<EndpointAddr, NotTaken> {
    let mut buf = [0u8; 256];
    let m = chan.recv(&mut buf).map_err(|_| NotTaken::Broken("the listener's registry did not answer"))?;
    parse_answer(&buf[..m.len])
}

/// A claim's answer as received (empty: the channel's end).
fn parse_answer(r: &[u8]) -> Result<EndpointAddr, NotTaken> {
    if r.is_empty() {
        return Err(NotTaken::Broken("the listener's registry closed"));
    }
    if r == b"NO" {
        return Err(NotTaken::Declined);
    }
    r.strip_prefix(b"OK")
        .and_then(|a| std::str::from_utf8(a).ok())
        .and_then(|a| a.parse().ok())
        .ok_or(NotTaken::Broken("a malformed answer"))
}

/// Claim the connection of `fd` to `dest`, and connect its stream.
///
/// When the server's address is known (an earlier claim's answer gave it), the stream is
/// connected right after the claim is sent (or was made ahead, `spares.rs`), and the answer
/// is read after the kernel's `connect`, when it is in ([`Claimed::attach`]; else the
/// connection awaits it, [`Unanswered`]; the server's `accept`, if it comes first, takes the
/// claim from the channel itself), so a claim costs no round trip of its own. Else the
/// answer comes first, with the address.
fn claim_and_connect(fd: c_int, dest: SocketAddr) -> Result<Claimed, &'static str> {
    if !is_local(dest.ip()) {
        return Err("not an address of this host");
    }
    // (before the socket is looked at: a connection kept on the kernel costs no call more)
    if crate::short::keep_on_kernel(dest) {
        return Err("its connections are short (CLAN_RUN_MIN_TURNS)");
    }
    tcp_local(fd).ok_or("not a TCP socket")?;
    let rt = runtime().ok_or("clan is not available in this process")?;
    if !real::with_fd(fd, fd_room) {
        return Err("few descriptors left for clan (a connection holds about six)");
    }
    // (once a stream to the server known could not be made: that address is asked anew)
    let mut ask = false;
    loop {
        let (chan, known, kept) = channel(dest)?;
        let known = known.filter(|_| !ask);
        let claim = |token: u64| {
            let mut msg = [0u8; CLAIM_LEN];
            msg[..5].copy_from_slice(b"CLAIM");
            msg[5..].copy_from_slice(&token.to_le_bytes());
            real::with_fd(fd, |b| chan.send(&msg, &[b])).is_ok()
        };
        if let Some(server) = known {
            // The server known: its stream first (made ahead, `spares.rs`, or now), then the
            // claim, whose answer is read after the kernel's `connect`, then or later
            // (`attach`, `Unanswered`; the server's `accept` takes the claim from the channel
            // itself if it comes first). A claim is never sent for a stream that could not
            // be made: giving up on one whose stream the server may take would let the two
            // ends disagree.
            let (token, stream) = match crate::spares::take(rt, server) {
                Some(s) => {
                    crate::say(format_args!("connection to {dest}: its clan stream was made ahead"));
                    (s.token, s.stream)
                }
                None => {
                    let token = random_token();
                    match connect_stream(rt, server, token) {
                        Some(s) => (token, s),
                        None => {
                            // (that server gone, or not answering: the address asked again)
                            ask = true;
                            continue;
                        }
                    }
                }
            };
            if !claim(token) {
                // A kept channel whose listener went away (closed, or its process
                // restarted): a new one, to whoever listens there now.
                if kept {
                    continue;
                }
                return Err("the listener's registry did not take the claim");
            }
            // A repeat: the next connection's stream is made meanwhile.
            crate::spares::want(rt, server);
            return Ok(Claimed { token, dest, chan, server, stream, answered: false });
        }
        // The server not known: the claim, its answer (the address), then the stream. (No
        // stream exists before the answer: a claim not answered in time is withdrawn, and the
        // server, whenever it gets to it, finds it so, and its `accept` waits for nothing.)
        let token = random_token();
        if !claim(token) {
            if kept {
                continue;
            }
            return Err("the listener's registry did not take the claim");
        }
        let server = match read_answer(&chan) {
            Ok(server) => server,
            Err(NotTaken::Declined) => {
                return Err("the listener declined (it has forked, is full, or is short of descriptors)");
            }
            Err(NotTaken::Broken(why)) => {
                withdraw_unread(chan, token);
                if kept {
                    continue;
                }
                return Err(why);
            }
        };
        return match connect_stream(rt, server, token) {
            Some(stream) => Ok(Claimed { token, dest, chan, server, stream, answered: true }),
            None => {
                withdraw(dest, chan, server, token);
                Err("the clan stream failed")
            }
        };
    }
}

/// Claim channels not in use, by the address their claims were for, with the clan address of
/// the server that answered on them: a client that connects again to the same server claims
/// on one of these (a claim is then a message each way, not a socket, a connect and a close
/// on both sides, and the stream need not wait for the answer).
type KeptChannel = (SocketAddr, SeqPacket, EndpointAddr);
static CHANNELS: Mutex<Vec<KeptChannel>> = Mutex::new(Vec::new());
/// Claim channels kept at most (by all the addresses together).
const CHANNELS_KEPT: usize = 16;
/// The server that last answered for each address ([`KNOWN_KEPT`] addresses at most): a new
/// channel to it need not wait for an answer before the stream either (its kept channels may
/// all be in use by claims not answered yet, `Unanswered`). Wrong once another process
/// listens there: that claim's answer names another server, and its connection is the
/// kernel's.
static KNOWN: Mutex<Vec<(SocketAddr, EndpointAddr)>> = Mutex::new(Vec::new());
const KNOWN_KEPT: usize = 64;

fn known(dest: SocketAddr) -> Option<EndpointAddr> {
    lock(&KNOWN).iter().rev().find(|(d, _)| *d == dest).map(|(_, s)| *s)
}

fn learn(dest: SocketAddr, server: EndpointAddr) {
    let mut k = lock(&KNOWN);
    if let Some(i) = k.iter().position(|(d, _)| *d == dest) {
        k.remove(i);
    } else if k.len() >= KNOWN_KEPT {
        k.remove(0);
    }
    k.push((dest, server));
}

/// A claim channel to the registry of whoever listens at `dest`: one kept (true), or a new
/// one; with the server's address when known.
fn channel(dest: SocketAddr) -> Result<(SeqPacket, Option<EndpointAddr>, bool), &'static str> {
    let kept = {
        let mut v = lock(&CHANNELS);
        v.iter().rposition(|(d, _, _)| *d == dest).map(|i| v.swap_remove(i))
    };
    if let Some((_, c, server)) = kept {
        return Ok((c, Some(server), true));
    }
    let unspecified = match dest {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), dest.port()),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), dest.port()),
    };
    let mapped_any = SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), dest.port());
    let chan = [dest, unspecified, mapped_any]
        .into_iter()
        .find_map(|a| SeqPacket::connect_abstract(&name(a)).ok())
        .ok_or("no process under clan run listens there")?;
    let _ = chan.set_timeouts(Duration::from_secs(5));
    Ok((chan, known(dest), false))
}

/// A claim channel whose last exchange went as it should (its answers all read): kept for
/// the next claim to `dest` (with the server's address, once an answer gave it).
fn keep_channel(dest: SocketAddr, chan: SeqPacket, server: Option<EndpointAddr>) {
    let Some(server) = server else { return };
    learn(dest, server);
    let mut v = lock(&CHANNELS);
    if v.len() >= CHANNELS_KEPT {
        v.remove(0);
    }
    v.push((dest, chan, server));
}

fn decline_message(token: u64) -> Vec<u8> {
    let mut m = b"DECLINE".to_vec();
    m.extend_from_slice(&token.to_le_bytes());
    m
}

/// The connection will not be accelerated: tell the server now (its `accept` need not wait
/// for a stream, and drops the one that came).
fn withdraw(dest: SocketAddr, chan: SeqPacket, server: EndpointAddr, token: u64) {
    if chan.send(&decline_message(token), &[]).is_ok() {
        keep_channel(dest, chan, Some(server));
    }
}

/// A claim whose answer was not read yet: withdrawn without waiting for it (the server
/// takes the claim, then the withdrawal, in that order). The answer stays in the channel,
/// which is not kept.
fn withdraw_unread(chan: SeqPacket, token: u64) {
    let _ = chan.send(&decline_message(token), &[]);
}

/// A claim made on `connect` whose answer is read later (`conn.rs`: the connection waits for
/// it before its first byte, [`Conn::awaiting`]): by the program's next call on the
/// connection, or by the thread that watches such claims (`answers.rs`). No deadline: giving
/// up on the answer would let the two ends disagree on where the bytes go (the server files
/// the claim when it gets to it, and takes the stream), so the connection waits for the
/// server as a kernel one would wait for its reads.
#[derive(Debug)]
pub(crate) struct Unanswered {
    token: u64,
    dest: SocketAddr,
    server: EndpointAddr,
    /// (None once the answer was read)
    chan: Option<SeqPacket>,
}

/// What the server said to an [`Unanswered`] claim.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The connection goes over clan.
    Taken,
    /// The connection is the kernel's (why).
    Refused(&'static str),
}

impl Unanswered {
    fn new(token: u64, dest: SocketAddr, server: EndpointAddr, chan: SeqPacket) -> Unanswered {
        Unanswered { token, dest, server, chan: Some(chan) }
    }

    /// The channel's descriptor (to sleep on until the answer comes).
    pub(crate) fn channel_fd(&self) -> Option<c_int> {
        self.chan.as_ref().map(raw)
    }

    /// The answer, if it came (never blocks; once given, None after).
    pub(crate) fn try_answer(&mut self) -> Option<Answer> {
        let mut buf = [0u8; 256];
        let got = match self.chan.as_ref()?.try_recv(&mut buf) {
            Ok(m) => parse_answer(&buf[..m.len]),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => return None,
            Err(_) => Err(NotTaken::Broken("the listener's registry did not answer")),
        };
        let chan = self.chan.take()?;
        Some(match got {
            Ok(a) if a == self.server => {
                keep_channel(self.dest, chan, Some(self.server));
                Answer::Taken
            }
            // (another runtime answered: not the one our stream went to)
            Ok(_) => {
                withdraw(self.dest, chan, self.server, self.token);
                Answer::Refused("another process answered the claim")
            }
            Err(NotTaken::Declined) => {
                keep_channel(self.dest, chan, Some(self.server));
                Answer::Refused("the listener declined (it has forked, is full, or is short of descriptors)")
            }
            Err(NotTaken::Broken(why)) => Answer::Refused(why),
        })
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        // (its channel is kept if the answer is in; else it goes, with the answer to come.
        // Never in a child after `fork`: the channel is the parent's too, and the answer its)
        if !crate::table::forked() {
            let _ = self.try_answer();
        }
    }
}

impl Claimed {
    /// The kernel connection is up: the connection goes over the clan stream (awaiting its
    /// claim's answer if that is not in yet). None: the claim is withdrawn and the connection
    /// stays with the kernel.
    pub(crate) fn attach(self, fd: c_int, dest: SocketAddr, nonblock: bool) -> Option<Conn> {
        let Claimed { token, dest: claimed, chan, server, stream: (s, q), answered } = self;
        let c = if peer_of(fd) == Some(dest) { Conn::new(s, q, nonblock).ok() } else { None };
        let c = c.map(|mut c| {
            c.client_of = Some(claimed);
            c
        });
        match (c, answered) {
            (None, true) => {
                withdraw(claimed, chan, server, token);
                None
            }
            (None, false) => {
                withdraw_unread(chan, token);
                None
            }
            (Some(c), true) => {
                keep_channel(claimed, chan, Some(server));
                Some(c)
            }
            (Some(c), false) => {
                c.await_claim(Unanswered::new(token, claimed, server, chan));
                Some(c)
            }
        }
    }

    /// The connection will not be accelerated (its kernel `connect` failed): tell the
    /// server now, which drops the stream.
    pub(crate) fn withdraw(self) {
        if self.answered {
            withdraw(self.dest, self.chan, self.server, self.token);
        } else {
            withdraw_unread(self.chan, self.token);
        }
    }
}

/// `accept` returned `fd` on the listening socket `lfd`: take its clan stream if it was
/// claimed. None: a plain connection.
pub(crate) fn on_accept(lfd: c_int, fd: c_int, nonblock: bool) -> Option<Conn> {
    let reg = lock(listeners()).get(&lfd).cloned()?;
    // (claims come on channels: none, nothing to look for; a plain client costs nothing.
    // One lock at a time: the listener's thread takes `pending` under `channels`.)
    let no_claims = lock(&reg.pending).is_empty();
    if no_claims && lock(&reg.channels).is_empty() && !reg.new_channels() {
        return None;
    }
    let rt = runtime()?;
    if no_claims {
        // Channels open but no claim filed: a claim for this connection, if there is one,
        // was sent before its client's `connect`, so it is in a channel now; one look at
        // them (a `poll`) before the connection's own look-up (its addresses and a netlink
        // query: five calls), which a client whose connections stay with the kernel
        // (`short.rs`) would otherwise cost the server on every accept.
        let mut passes = 0;
        while lock(&reg.pending).is_empty() && !reg.closed.load(Ordering::Acquire) && passes < 16 {
            passes += 1;
            if !serve_channels(rt, &reg, true) {
                break;
            }
        }
        if lock(&reg.pending).is_empty() {
            return None;
        }
    }
    let local = real::with_fd(fd, |b| SocketAddr::try_from(rustix::net::getsockname(b).ok()?).ok())?;
    let peer = peer_of(fd)?;
    let found = crate::procnet::peer_socket(peer, local)?;
    let mut key = claim_key(&lock(&reg.pending), found);
    // Not (yet) taken by the listener's thread: a claim on a kept channel is answered after
    // its client's kernel `connect`, and that `connect` may come here first. The claim was
    // sent before it: it is in its channel, taken now.
    // (the listener's thread may be taking it: its pass holds the channels, so the claim is
    // in `pending` when this one gets them; looked for after every pass)
    let mut passes = 0;
    while key.is_none() && !reg.closed.load(Ordering::Acquire) && passes < 16 {
        let more = serve_channels(rt, &reg, true);
        key = claim_key(&lock(&reg.pending), found);
        passes += 1;
        if !more {
            break;
        }
    }
    let key = key?;
    // (the claim stays pending until its stream is taken: a stream a claim names is never
    // swept, `Filed::sweep`)
    let (token, uid) = lock(&reg.pending).get(&key).map(|c| (c.token, c.uid))?;
    let attached = rt.wait_attached(token);
    lock(&reg.pending).remove(&key);
    let (s, q) = attached?;
    // Only the claimant's user may carry the connection (a stream from anyone else that
    // brought the token is dropped, and the connection is the kernel's).
    if !matches!(s.peer_identity(), clan::PeerIdentity::Process { uid: u, .. } if u == uid) {
        crate::say(format_args!("a claimed connection's stream came from another user: the kernel's"));
        return None;
    }
    match Conn::new(s, q, nonblock) {
        Ok(c) => Some(c),
        Err(e) => {
            crate::say(format_args!("a claimed connection could not be set up ({e}): the kernel's"));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past `MAX_CLAIMS` entries, the oldest go, one for each new one; entries taken meanwhile
    /// are skipped, and the order list stays bounded.
    #[test]
    fn filed_streams_past_the_bound_lose_their_oldest_not_all() {
        let mut f = Filed::default();
        let n = MAX_CLAIMS as u64;
        for t in 0..n {
            f.insert(t, Attach::Declined);
        }
        // Some taken (as `accept` takes them).
        for t in (0..100).step_by(2) {
            assert!(f.remove(&t).is_some());
        }
        for t in n..n + 120 {
            f.insert(t, Attach::Declined);
        }
        assert_eq!(f.map.len(), MAX_CLAIMS);
        // 120 new over 50 free places: the 70 oldest still there went (the 50 odd tokens
        // below 100, then 100..120).
        assert!((0..120).all(|t| f.is_vacant(&t)));
        assert!((120..n + 120).all(|t| !f.is_vacant(&t)));
        // Taking and filing many times over keeps the order list bounded.
        for t in n + 120..4 * n {
            f.insert(t, Attach::Declined);
            f.remove(&t);
        }
        assert!(f.order.len() <= 2 * MAX_CLAIMS + 1, "{}", f.order.len());
        // (the first of those filings, over a full list, cost one old entry)
        assert_eq!(f.map.len(), MAX_CLAIMS - 1);
    }
}
