//! The NIC: embedded in the process, no daemon. Owns the endpoint and aperture tables, the
//! event queues, the connections to other NICs and the engine thread.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, RwLockReadGuard, Weak};
use std::time::Instant;

use clan_wire::{ImportReply, Status};

use clan_shm::cam::live_state;
use clan_shm::seqpacket::{PeerCred, SeqPacket};
use clan_shm::smallmap::SmallMap;
use clan_wire::control::{Code, ImportGrant, OOB_PAYLOAD, Reply};
use clan_wire::grant::{Importer, Refusal};

use crate::addr::{EndpointAddr, NicAddr, PeerIdentity};
use crate::aperture::{Aperture, ApertureInner, ApertureMem, MAX_APERTURE, aperture_tag};
use crate::config::{EventQueueConfig, ExportConfig, NicConfig};
use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::{Endpoint, EndpointConfig, EndpointInner, OobMessage};
use crate::engine::{Conn, Engine};
use crate::error::{EndpointError, EventQueueError, ExportError, NicError};
use crate::event_queue::{EqInner, EqPort, EventQueue};
use crate::link::{ExportRec, Link, LinkError};
use crate::lock;
use crate::onaccept::{Filed, Grantee, HostGrants};
use crate::peer::PeerConn;
use crate::tripwire::WatchOwner;
use crate::window::Window;

static FD_LIMIT: AtomicU64 = AtomicU64::new(0);

/// The soft file-descriptor limit in force (raised to the hard limit when a NIC opens).
///
/// ```
/// let _nic = clan::Nic::open_default()?;
/// assert!(clan::fd_limit() > 0, "known once a NIC has opened");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn fd_limit() -> u64 {
    FD_LIMIT.load(Ordering::Relaxed)
}

/// Our own credentials.
pub(crate) fn own_cred() -> PeerCred {
    static CRED: OnceLock<PeerCred> = OnceLock::new();
    *CRED.get_or_init(|| PeerCred {
        pid: std::process::id(),
        uid: rustix::process::getuid().as_raw(),
        gid: rustix::process::getgid().as_raw(),
    })
}

/// A request to the engine.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Dial the NIC at this address.
    Connect(NicAddr),
    /// Watch the liveness of this NIC of the host (we import from it).
    Watch(NicAddr),
    /// A thread that spun on the links goes to sleep: listen to parked links again
    /// (`clan_shm::handoff`).
    Unpark,
}

/// How long a failed dial is remembered (for the waiters of that dial).
const FAILURE_MEMORY: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug)]
enum Slot {
    Connecting,
    Ready(Arc<Link>),
    Failed(LinkError, Instant),
}

/// The links of a NIC, by peer.
#[derive(Debug, Default)]
pub(crate) struct LinkTable {
    map: Mutex<HashMap<NicAddr, Slot>>,
    cv: Condvar,
    list: RwLock<Vec<Arc<Link>>>,
    /// How many links `list` holds, readable without its lock (shared with the NIC's event
    /// queues, `EqInner::links_open`): spin loops ask it before they drive links
    /// (`NicInner::progress`), so that a NIC without links pays one load for the asking.
    open: Arc<AtomicUsize>,
    /// The eventfds of threads of a manual-progress NIC asleep in a hand-shake on the links
    /// and their own eventfd ([`LinkTable::park`]): signalled when a link opens (they must
    /// listen to it too) and when the hand-shakes change ([`LinkTable::kick_parked`]).
    parked: Mutex<Vec<Arc<clan_shm::eventfd::EventFd>>>,
    /// Bumped whenever `list` changes (under its write lock): a queue's leader that sleeps
    /// on the link sockets re-reads the list only when it moved (`wake.rs::sync_links`).
    generation: AtomicU64,
    /// An epoll set over the open links' sockets (level-triggered, data: the link's id)
    /// while there are [`READY_SET_FROM`] or more: a thread that drives them asks it once
    /// which have bytes ([`NicInner::progress`]) instead of calling receive on each. Made,
    /// changed and dropped only under `list`'s write lock, so that a holder of its read
    /// lock may use it. None: fewer links, or it could not be made or kept whole (then
    /// every link is read).
    ready: RwLock<Option<Arc<OwnedFd>>>,
}

/// Links from which a thread that drives them asks the readiness set which have bytes
/// ([`LinkTable::ready`]) instead of calling receive on each: one `epoll_wait` against two
/// receive calls or more.
const READY_SET_FROM: usize = 3;

thread_local! {
    /// Room for the ids `ready_links` finds, used again.
    static READY: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The ids of the links whose sockets the readiness set `ep` says are readable now (no
/// wait).
fn ready_links(ep: std::os::fd::BorrowedFd<'_>) -> Vec<u64> {
    use rustix::event::epoll;
    let mut ids = READY.with(|r| std::mem::take(&mut *r.borrow_mut()));
    ids.clear();
    let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 64];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    // (64 at most a call: the next call reads the others)
    if let Ok((got, _)) = epoll::wait(ep, &mut events[..], Some(&zero)) {
        ids.extend(got.iter().map(|e| e.data.u64()));
    }
    ids
}

fn give_back_ready(ids: Vec<u64>) {
    READY.with(|r| *r.borrow_mut() = ids);
}

thread_local! {
    /// The eventfd this thread sleeps on when parked ([`LinkTable::park`]), made at its
    /// first park (None: it could not be).
    static PARK_KICK: std::cell::OnceCell<Option<Arc<clan_shm::eventfd::EventFd>>> =
        const { std::cell::OnceCell::new() };
}

/// A thread registered as asleep on the links in a hand-shake ([`LinkTable::park`]): it
/// sleeps on the links and on its eventfd; dropping it ends the registration.
pub(crate) struct Parked<'a> {
    table: &'a LinkTable,
    kick: Arc<clan_shm::eventfd::EventFd>,
}

impl Parked<'_> {
    /// Sleep until a link or the eventfd is readable (the links' list is read now: a link
    /// opened since signals the eventfd), at most `nap`, then reset the eventfd. Whatever
    /// was told before the reset is looked at by the caller's next check; whatever is told
    /// after it leaves the eventfd readable for the next sleep.
    pub fn sleep(&self, nic: &NicInner, nap: Option<std::time::Duration>) {
        use std::os::fd::AsFd;
        if !nic.wait_links(Some(self.kick.as_fd()), nap) {
            self.kick.wait_readable(nap);
        }
        self.kick.drain();
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        // One entry (a thread parked in a wait within a wait is in the list twice).
        let mut parked = lock(&self.table.parked);
        if let Some(i) = parked.iter().position(|k| Arc::ptr_eq(k, &self.kick)) {
            parked.swap_remove(i);
        }
    }
}

impl LinkTable {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<NicAddr, Slot>> {
        lock(&self.map)
    }

    /// The open link to `peer`, if any.
    pub fn ready(&self, peer: NicAddr) -> Option<Arc<Link>> {
        match self.map().get(&peer) {
            Some(Slot::Ready(l)) if !l.is_closed() => Some(l.clone()),
            _ => None,
        }
    }

    /// A link to `peer` is open.
    pub fn ready_now(&self, peer: NicAddr, link: Arc<Link>) {
        {
            let mut l = self.list.write().unwrap_or_else(|e| e.into_inner());
            l.push(link.clone());
            // (in the set before it is counted: a driver that counts it finds its bytes)
            self.watch_ready(&l);
            self.open.store(l.len(), Ordering::Relaxed);
            // SYNC POINT: pairs with `generation()`'s Acquire load.
            self.generation.fetch_add(1, Ordering::Release);
        }
        self.map().insert(peer, Slot::Ready(link));
        self.cv.notify_all();
        // After the list's write lock: a parked thread either read the list after it (and
        // polls the new link) or registered before its read, so before this look.
        self.kick_parked();
    }

    /// Register this thread as asleep on the links in a hand-shake, for as long as the
    /// guard lives (its eventfd is the thread's, made at its first park). Register before
    /// the first check of what is awaited: what changes after it signals the eventfd. None
    /// if the eventfd cannot be made (the caller naps instead).
    pub fn park(&self) -> Option<Parked<'_>> {
        let kick =
            PARK_KICK.with(|k| k.get_or_init(|| clan_shm::eventfd::EventFd::new().ok().map(Arc::new)).clone())?;
        kick.drain();
        lock(&self.parked).push(kick.clone());
        Some(Parked { table: self, kick })
    }

    /// Wake the threads asleep on the links in a hand-shake: a link opened, or the
    /// hand-shakes changed (called after the change, under the hand-shakes' lock or after
    /// it).
    pub fn kick_parked(&self) {
        let parked = lock(&self.parked);
        if parked.is_empty() {
            return;
        }
        // Not the calling thread's own: it is awake, and looks again before it sleeps (a
        // waiter that took its own reply in would otherwise pay a write and a read).
        let own = PARK_KICK.with(|k| k.get().cloned().flatten());
        for k in parked.iter().filter(|k| !own.as_ref().is_some_and(|o| Arc::ptr_eq(o, k))) {
            k.signal();
        }
    }

    /// Wake the threads waiting for a link.
    pub fn notify(&self) {
        let _m = self.map();
        self.cv.notify_all();
    }

    /// Dialling `peer` failed.
    pub fn fail(&self, peer: NicAddr, e: LinkError) {
        let mut m = self.map();
        // Failures are kept only as long as a waiter could care (bounded by time).
        let now = Instant::now();
        m.retain(|_, s| !matches!(s, Slot::Failed(_, at) if now.duration_since(*at) > FAILURE_MEMORY));
        if matches!(m.get(&peer), Some(Slot::Connecting) | None) {
            m.insert(peer, Slot::Failed(e, Instant::now()));
        }
        self.cv.notify_all();
    }

    /// Whether a link to `peer` is being dialled (at the engine's request).
    pub fn connecting(&self, peer: NicAddr) -> bool {
        matches!(self.map().get(&peer), Some(Slot::Connecting))
    }

    /// The engine dials `peer` on its own behalf.
    pub fn start_connecting(&self, peer: NicAddr) {
        let mut m = self.map();
        if !matches!(m.get(&peer), Some(Slot::Ready(l)) if !l.is_closed()) {
            m.insert(peer, Slot::Connecting);
        }
    }

    fn remove(&self, link: &Arc<Link>) {
        {
            let mut l = self.list.write().unwrap_or_else(|e| e.into_inner());
            l.retain(|l| !Arc::ptr_eq(l, link));
            {
                let mut ready = self.ready.write().unwrap_or_else(|e| e.into_inner());
                if l.len() < READY_SET_FROM {
                    // (closed once the last user lets go)
                    *ready = None;
                } else if let Some(ep) = ready.as_ref() {
                    use std::os::fd::AsFd;
                    let _ = rustix::event::epoll::delete(&**ep, link.sock.as_fd());
                }
            }
            self.open.store(l.len(), Ordering::Relaxed);
            // SYNC POINT: pairs with `generation()`'s Acquire load.
            self.generation.fetch_add(1, Ordering::Release);
        }
        let mut m = self.map();
        if matches!(m.get(&link.peer), Some(Slot::Ready(l)) if Arc::ptr_eq(l, link)) {
            m.remove(&link.peer);
        }
        self.cv.notify_all();
    }

    /// The count of open links, shared.
    pub fn open(&self) -> &Arc<AtomicUsize> {
        &self.open
    }

    /// Keep the readiness set to the links `list` (just grown by its last): made with all
    /// of them once there are [`READY_SET_FROM`], then the newcomer added. A failure leaves
    /// no set (every link is read). Under `list`'s write lock.
    fn watch_ready(&self, list: &[Arc<Link>]) {
        use rustix::event::epoll;
        use std::os::fd::AsFd;
        if list.len() < READY_SET_FROM {
            return;
        }
        let mut ready = self.ready.write().unwrap_or_else(|e| e.into_inner());
        let add = |ep: &OwnedFd, l: &Link| {
            epoll::add(ep, l.sock.as_fd(), epoll::EventData::new_u64(l.id), epoll::EventFlags::IN).is_ok()
        };
        let ok = match ready.as_ref() {
            Some(ep) => list.last().is_none_or(|l| add(ep, l)),
            None => match epoll::create(epoll::CreateFlags::CLOEXEC) {
                Ok(ep) => {
                    let ep = clan_shm::fdfloor::lift(ep);
                    let ok = list.iter().all(|l| add(&ep, l));
                    *ready = Some(Arc::new(ep));
                    ok
                }
                Err(_) => false,
            },
        };
        if !ok {
            tracing::debug!("the links' readiness set could not be made or kept whole: every link is read");
            *ready = None;
        }
    }

    /// The readiness set, if there is one (see `ready`).
    fn ready_set(&self) -> Option<Arc<OwnedFd>> {
        self.ready.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes of the list so far: a reader that saw this value before reading the list
    /// has it as of then at least.
    pub fn generation(&self) -> u64 {
        // SYNC POINT: pairs with the Release increments of `ready_now` and `remove`.
        self.generation.load(Ordering::Acquire)
    }

    /// All open links.
    pub fn all(&self) -> RwLockReadGuard<'_, Vec<Arc<Link>>> {
        self.list.read().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug, Default)]
struct ApSlot {
    generation: u32,
    live: Weak<ApertureInner>,
    in_use: bool,
    exported: bool,
    /// Live imports per connection (small maps: nearly every aperture is imported through
    /// one connection; `clan_shm::smallmap`).
    remote: SmallMap<u64, u32>,
    /// Connections that ever imported this generation and are still connected.
    holders: SmallMap<u64, ()>,
    parked: Option<Arc<ApertureMem>>,
    /// Its memory is carved from a pool (reusable once its peer unimported it).
    pooled: bool,
}

#[derive(Debug, Default)]
struct ApertureTable {
    slots: Vec<ApSlot>,
    free: Vec<u32>,
}

#[derive(Debug, Default)]
struct Cache {
    by_cap: HashMap<u64, Vec<Arc<ApertureMem>>>,
    bytes: u64,
}

/// Counters of a NIC ([`Nic::stats`]).
///
/// ```
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let before = nic.stats();
/// let _ap = ep.export(4096)?;
/// let after = nic.stats();
/// assert_eq!(after.endpoints, 1);
/// assert_eq!(after.exports_fresh + after.exports_cached, before.exports_fresh + before.exports_cached + 1);
/// assert_eq!(after.links, 0, "nothing talked to another host");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicStats {
    /// Apertures exported with fresh memory.
    pub exports_fresh: u64,
    /// Apertures exported with memory from the cache.
    pub exports_cached: u64,
    /// Imports granted to other processes.
    pub imports_granted: u64,
    /// Imports refused (stale, forged, denied, malformed).
    pub imports_refused: u64,
    /// Of `imports_granted`: those granted as a connection was accepted, before the client
    /// asked (a connect with [`crate::Endpoint::connect_importing`] from a NIC of this host).
    pub imports_granted_on_accept: u64,
    /// Bytes of memory held in the cache.
    pub cached_bytes: u64,
    /// Open endpoints.
    pub endpoints: u64,
    /// Open links to NICs of other hosts.
    pub links: u64,
    /// Pools of aperture memory (one per peer NIC that apertures were exported for).
    pub pools: u64,
    /// Chunks in those pools: each is two memfds and two mappings, shared by its apertures.
    pub pool_chunks: u64,
    /// Times the engine left a link's incoming traffic to the threads spinning on it
    /// ([`crate::LinkSpin`]) instead of receiving it itself.
    pub link_parks: u64,
    /// Receive calls on the open links' sockets that found nothing (the cost of driving links
    /// that had no bytes: a thread that drives three links or more asks which have bytes
    /// first, and reads those only).
    pub link_empty_receives: u64,
    /// Sleeps of a queue's leader in a link socket's own `recv` (one link, no ports:
    /// [`crate::NicConfig::wake_signal`]): woken by the peer's bytes with them.
    pub link_recv_sleeps: u64,
    /// Of `link_recv_sleeps`: those a local wake ended with the wake signal.
    pub link_recv_interrupts: u64,
}

/// The four descriptors an import grant hands over, held open until the reply is sent: the
/// aperture's data (or a read-only open of it), a read-only open of its index, and the
/// importing process's port (memfd and eventfd).
pub(crate) struct GrantFds {
    mem: Arc<ApertureMem>,
    port: Arc<crate::port::PortRec>,
    data_ro: Option<OwnedFd>,
    /// An aperture's own index, opened read-only for this grant (a pool's chunk keeps one).
    index_ro: Option<OwnedFd>,
}

impl GrantFds {
    /// The descriptors, in the grant's order.
    pub fn borrowed(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        let (data, _, _, _) = self.mem.fds();
        let data = self.data_ro.as_ref().map_or(data.as_fd(), |f| f.as_fd());
        let index = match (&self.index_ro, self.mem.slice()) {
            (Some(f), _) => Some(f.as_fd()),
            (None, Some(s)) => s.chunk.index_read_only().ok(),
            (None, None) => None,
        };
        // (a pool's chunk opened its index when the grant was made: `index` is there)
        [Some(data), index, Some(self.port.memfd.as_fd()), Some(self.port.eventfd.as_fd())]
            .into_iter()
            .flatten()
            .collect()
    }
}

/// Mappings kept for one NIC of this host ([`NicInner::keep_mapped`]).
#[derive(Default)]
pub(crate) struct Kept {
    chunks: std::collections::VecDeque<Arc<clan_shm::segment::Segment>>,
    ports: std::collections::VecDeque<Arc<EqPort>>,
}

/// Pool chunks (data and index count apart) and ports kept mapped per NIC we import from.
pub(crate) const KEPT_PER_PEER: usize = 4;

pub(crate) struct NicInner {
    pub addr: NicAddr,
    pub config: NicConfig,
    pub(crate) secret: [u8; 32],
    serial: AtomicU64,
    apertures: Mutex<ApertureTable>,
    endpoints: Mutex<(HashMap<u32, Weak<EndpointInner>>, u32)>,
    next_queue: AtomicU32,
    default_queue: OnceLock<EventQueue>,
    /// Queues by id (those handed to other processes must be found when a connection ends).
    queues: Mutex<HashMap<u32, Weak<EqInner>>>,
    peers: Mutex<HashMap<NicAddr, Arc<PeerConn>>>,
    pub links: LinkTable,
    /// Threads spinning on the links' traffic (the engine leaves it to them meanwhile).
    pub spinners: clan_shm::handoff::Handoff,
    pub conns: crate::conn::ConnRegistry,
    /// Out-of-band messages for the engine to send (from contexts that must not wait).
    outbox: Mutex<Vec<(EndpointAddr, EndpointAddr, [u8; OOB_PAYLOAD])>>,
    cmds: Mutex<Vec<Cmd>>,
    waker: OnceLock<Arc<mio::Waker>>,
    cache: Mutex<Cache>,
    pub(crate) pools: crate::pool::Pools,
    /// Pool chunks of other processes mapped here, by (device, inode, writable): each
    /// mapped once, shared by the imports of its apertures (`peer.rs::chunk_part`).
    pub(crate) chunk_maps: Mutex<HashMap<(u64, u64, bool), Weak<clan_shm::segment::Segment>>>,
    /// The last pool chunks and ports of each NIC of this host we imported from, kept
    /// mapped after their imports are gone, until that NIC goes ([`NicInner::keep_mapped`]).
    pub(crate) kept: Mutex<HashMap<NicAddr, Kept>>,
    engine: Mutex<Option<Engine>>,
    dma: Mutex<Option<crate::dma::DmaEngine>>,
    exports_fresh: AtomicU64,
    exports_cached: AtomicU64,
    imports_granted: AtomicU64,
    imports_refused: AtomicU64,
    imports_granted_on_accept: AtomicU64,
    /// Imports to grant when the connects they name are accepted (`crate::onaccept`).
    on_accept: Mutex<crate::onaccept::OnAccept>,
    /// Messages to other NICs of this host that may wait (`crate::lazy`): their timer.
    pub(crate) lazy: Arc<crate::lazy::Lazy>,
}

impl std::fmt::Debug for NicInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Drop for NicInner {
    fn drop(&mut self) {
        tracing::info!(addr = %self.addr, "NIC closing");
        if let Some(mut d) = self.dma.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            d.stop();
        }
        if let Some(mut e) = self.engine.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            e.stop();
        }
    }
}

type Bound = (NicAddr, SeqPacket, Option<std::net::TcpListener>);

fn bind(config: &NicConfig) -> Result<Bound, NicError> {
    let io = |context| move |source| NicError::Io { context, source };
    if config.tcp {
        // The TCP port decides (port 0: the kernel picks); the host channel takes the same.
        for _ in 0..64 {
            let tcp = match std::net::TcpListener::bind(SocketAddr::new(config.ip, config.port)) {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    return Err(NicError::AddrInUse(NicAddr::new(config.ip, config.port)));
                }
                Err(e) => return Err(io("binding the NIC's TCP listener")(e)),
            };
            let port = tcp.local_addr().map_err(io("reading the TCP listener's address"))?.port();
            let addr = NicAddr::new(config.ip, port);
            match SeqPacket::listen_abstract(&addr.abstract_name()) {
                Ok(l) => return Ok((addr, l, Some(tcp))),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && config.port == 0 => continue,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(NicError::AddrInUse(addr)),
                Err(e) => return Err(io("binding the NIC's control socket")(e)),
            }
        }
        return Err(NicError::NoFreePort);
    }
    if config.port != 0 {
        let addr = NicAddr::new(config.ip, config.port);
        return match SeqPacket::listen_abstract(&addr.abstract_name()) {
            Ok(l) => Ok((addr, l, None)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(NicError::AddrInUse(addr)),
            Err(e) => Err(io("binding the NIC's control socket")(e)),
        };
    }
    let mut r = [0u8; 2];
    let _ = rustix::rand::getrandom(&mut r, rustix::rand::GetRandomFlags::empty());
    let start = 20000 + u16::from_le_bytes(r) as u32 % 40000;
    for i in 0..2000u32 {
        let port = (20000 + (start - 20000 + i) % 40000) as u16;
        let addr = NicAddr::new(config.ip, port);
        match SeqPacket::listen_abstract(&addr.abstract_name()) {
            Ok(l) => return Ok((addr, l, None)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => return Err(io("binding the NIC's control socket")(e)),
        }
    }
    Err(NicError::NoFreePort)
}

impl NicInner {
    /// The DMA engine, started on first use.
    pub fn dma_engine(&self) -> std::io::Result<Arc<crate::dma::Shared>> {
        let mut d = lock(&self.dma);
        if let Some(e) = d.as_ref() {
            return Ok(e.shared.clone());
        }
        let e = crate::dma::DmaEngine::start(&self.config.dma)?;
        let s = e.shared.clone();
        *d = Some(e);
        Ok(s)
    }

    pub fn manual_progress(&self) -> bool {
        self.config.progress == crate::config::Progress::Manual
    }

    pub fn take_commands(&self) -> Vec<Cmd> {
        std::mem::take(&mut *lock(&self.cmds))
    }

    /// Where to dial `peer`.
    pub fn route(&self, peer: NicAddr) -> SocketAddr {
        self.config.routes.iter().find(|(n, _)| *n == peer).map_or(peer.socket_addr(), |(_, s)| *s)
    }

    /// Ask the engine to do something (never waits).
    pub fn command(&self, cmd: Cmd) {
        lock(&self.cmds).push(cmd);
        if let Some(w) = self.waker.get() {
            let _ = w.wake();
        }
    }

    /// The link to `peer`, dialled on demand (by the engine), waiting until `deadline` at
    /// most. Called by application threads only: the engine never waits for a link.
    pub fn link(&self, peer: NicAddr, deadline: Instant) -> Result<Arc<Link>, LinkError> {
        if !self.config.tcp {
            return Err(LinkError::Unreachable("links are disabled on this NIC (NicConfig::tcp)".into()));
        }
        let start = Instant::now();
        let mut m = self.links.map();
        loop {
            match m.get(&peer) {
                Some(Slot::Ready(l)) if !l.is_closed() => return Ok(l.clone()),
                Some(Slot::Connecting) => {}
                Some(Slot::Failed(e, at)) if *at >= start => return Err(e.clone()),
                _ => {
                    m.insert(peer, Slot::Connecting);
                    drop(m);
                    self.command(Cmd::Connect(peer));
                    m = self.links.map();
                    continue;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The dial goes on in the engine (others may wait for it): only we give up.
                return Err(LinkError::Timeout);
            }
            m = self.links.cv.wait_timeout(m, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// With manual progress and open links: sleep until a link or `extra` is readable, at most
    /// `timeout` (the waits of threads that drive progress themselves). Returns false (at
    /// once) if there is no link to wait on.
    pub fn wait_links(&self, extra: Option<std::os::fd::BorrowedFd<'_>>, timeout: Option<std::time::Duration>) -> bool {
        use rustix::event::{PollFd, PollFlags, poll};
        let links = self.links.all().clone();
        if links.is_empty() {
            return false;
        }
        // Many links: their readiness set (readable when one is) in their stead. (Held: a
        // set dropped meanwhile stays open for this poll; a link opened meanwhile kicks
        // parked waiters.)
        let set = if links.len() >= READY_SET_FROM { self.links.ready_set() } else { None };
        let mut fds: Vec<PollFd<'_>> = match &set {
            Some(ep) => vec![PollFd::new(&**ep, PollFlags::IN)],
            None => links.iter().map(|l| PollFd::new(&l.sock, PollFlags::IN)).collect(),
        };
        if let Some(e) = &extra {
            fds.push(PollFd::from_borrowed_fd(*e, PollFlags::IN));
        }
        let ts = timeout.map(|d| rustix::time::Timespec {
            tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: d.subsec_nanos().into(),
        });
        let _ = poll(&mut fds, ts.as_ref());
        true
    }

    /// Process what came on the links whose sockets woke this thread's last sleep as its
    /// queue's leader (`wake.rs::Sleepers::sleep` notes them), or on every link if it noted
    /// none (a nap that did not listen to them). One receive call per link that has bytes,
    /// not per link open.
    pub fn progress_woken(&self) -> bool {
        let mut ids = crate::wake::take_woken_links();
        if ids.is_empty() {
            return self.progress();
        }
        let mut did = false;
        let mut closed = false;
        for l in self.links.all().iter().filter(|l| ids.contains(&l.id)) {
            did |= l.progress(self);
            closed |= l.is_closed();
        }
        if closed {
            // (as in `progress`: the engine tells the link's connections at once)
            if let Some(w) = self.waker.get() {
                let _ = w.wake();
            }
        }
        ids.clear();
        crate::wake::give_back_woken_links(ids);
        did
    }

    /// Process incoming link traffic in this thread (see [`crate::Nic::progress`]).
    pub fn progress(&self) -> bool {
        // A hint only (Relaxed: it orders nothing): a link that opens meanwhile is driven
        // by the next call, and by the engine's thread in any case.
        let open = self.links.open.load(Ordering::Relaxed);
        if open == 0 {
            return false;
        }
        let mut did = false;
        let mut closed = false;
        let links = self.links.all();
        // (the set changes only under the list's write lock, excluded while `links` is held:
        // no clone of it)
        let set = self.links.ready.read().unwrap_or_else(|e| e.into_inner());
        match set.as_ref().filter(|_| open >= READY_SET_FROM) {
            Some(ep) => {
                use std::os::fd::AsFd;
                // Ask which have bytes (or are closed: a closed socket is readable), and read
                // those only.
                let ready = ready_links(ep.as_fd());
                drop(set);
                for l in links.iter() {
                    if ready.contains(&l.id) {
                        did |= l.progress(self);
                    }
                    closed |= l.is_closed();
                }
                give_back_ready(ready);
            }
            None => {
                drop(set);
                for l in links.iter() {
                    did |= l.progress(self);
                    closed |= l.is_closed();
                }
            }
        }
        drop(links);
        if closed {
            // A link this thread found closed (or one the engine has not removed yet): the
            // engine tells its connections at once, rather than at its next timer (it does
            // not listen to a parked link's socket).
            if let Some(w) = self.waker.get() {
                let _ = w.wake();
            }
        }
        did
    }

    /// Keep `chunk` (a pool chunk of `peer`'s, mapped by an import) and `port` (our port in
    /// one of its queues) mapped after the imports that use them are gone, the last
    /// [`KEPT_PER_PEER`] of each, until `peer` goes ([`NicInner::peer_gone`]). The exporter
    /// keeps its pool's last chunk for us too (`pool.rs`): a client that connects and closes
    /// in a loop then maps nothing after its first connection. What is kept is memory that
    /// peer granted us, its pages holes once every aperture of it was given back.
    pub fn keep_mapped(
        &self,
        peer: &crate::peer::PeerConn,
        chunk: Option<Arc<clan_shm::segment::Segment>>,
        port: &Arc<EqPort>,
    ) {
        let mut all = lock(&self.kept);
        // Looked at under the lock `peer_gone` takes after marking the peer gone: a peer
        // found alive here has its keep let go by its `peer_gone`; one gone already (it died
        // while our import's reply was on its way) is not kept for.
        if peer.is_broken() {
            return;
        }
        let k = all.entry(peer.addr).or_default();
        if let Some(c) = chunk {
            if !k.chunks.iter().any(|x| Arc::ptr_eq(x, &c)) {
                if k.chunks.len() >= KEPT_PER_PEER {
                    k.chunks.pop_front();
                }
                k.chunks.push_back(c);
            }
        }
        if !k.ports.iter().any(|x| Arc::ptr_eq(x, port)) {
            if k.ports.len() >= KEPT_PER_PEER {
                k.ports.pop_front();
            }
            k.ports.push_back(port.clone());
        }
    }

    /// A link closed: forget it and tell the endpoints that had connections over it (once
    /// per link, however many times this is called).
    pub fn link_closed(&self, link: &Arc<Link>) {
        self.links.remove(link);
        lock(&link.exports).clear();
        if link.take_gone() {
            self.peer_gone(link.peer);
        }
    }

    /// Another NIC went away (its process died or its NIC closed, or the link to it
    /// broke): its connections end, the hand-shakes with it are forgotten, and the mappings
    /// imported from it fail from now on.
    pub fn peer_gone(&self, peer: NicAddr) {
        if let Some(p) = lock(&self.peers).remove(&peer) {
            p.mark_gone();
        }
        lock(&self.kept).remove(&peer);
        let eps: Vec<Arc<EndpointInner>> = lock(&self.endpoints).0.values().filter_map(Weak::upgrade).collect();
        tracing::debug!(%peer, "peer NIC gone");
        crate::conn::peer_gone(self, peer, &eps);
    }

    /// Serve an import request that arrived over `link`.
    pub fn grant_link_import(&self, link: &Link, importer: EndpointAddr, desc: &[u8], id: u64) -> ImportReply {
        let refuse = |r: Refusal| ImportReply {
            id,
            status: Status::from(r),
            key: 0,
            aperture_len: 0,
            offset: 0,
            len: 0,
            rights: 0,
        };
        let r = (|| {
            let desc = Descriptor::from_bytes(desc).map_err(|_| Refusal::Malformed)?;
            let who = Importer::Remote { endpoint: importer.into(), link_peer: link.peer.socket_addr() };
            let ap = self.check_import(&desc, &who)?;
            let mut exports = lock(&link.exports);
            if exports.len() >= link.max_imports {
                return Err(Refusal::TooMany);
            }
            let key = loop {
                let mut b = [0u8; 8];
                let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
                let k = u64::from_le_bytes(b);
                if k != 0 && !exports.contains_key(&k) {
                    break k;
                }
            };
            exports.insert(
                key,
                Arc::new(ExportRec {
                    ap: Arc::downgrade(&ap),
                    aperture: ap.id,
                    generation: ap.generation,
                    lo: desc.offset(),
                    hi: desc.offset() + desc.len(),
                    rights: desc.rights(),
                }),
            );
            Ok(ImportReply {
                id,
                status: Status::Ok,
                key,
                aperture_len: ap.len,
                offset: desc.offset(),
                len: desc.len(),
                rights: desc.rights().bits(),
            })
        })();
        match r {
            Ok(g) => {
                self.imports_granted.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%importer, link = %link.peer, "import granted over a link");
                g
            }
            Err(refusal) => {
                self.imports_refused.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%importer, link = %link.peer, "import over a link refused: {refusal}");
                refuse(refusal)
            }
        }
    }

    /// The one import policy, for every path: the descriptor names this NIC and a live
    /// aperture whose key verifies it, and the aperture's policy allows `who`.
    pub fn check_import(&self, desc: &Descriptor, who: &Importer) -> Result<Arc<ApertureInner>, Refusal> {
        if desc.nic() != self.addr {
            return Err(Refusal::NotOurs);
        }
        let ap = self.live_aperture(desc.aperture(), desc.generation()).ok_or(Refusal::Revoked)?;
        if !desc.verify(&ap.key()) || desc.aperture_len() != ap.len {
            return Err(Refusal::BadKey);
        }
        let p = &ap.policy;
        let endpoints: Vec<clan_wire::control::EndpointId> = p.endpoints.iter().map(|e| (*e).into()).collect();
        let nics: Vec<std::net::SocketAddr> = p.nics.iter().map(NicAddr::socket_addr).collect();
        let policy = clan_wire::grant::Policy { uids: &p.uids, pids: &p.pids, endpoints: &endpoints, nics: &nics };
        clan_wire::grant::decide(&policy, who)?;
        Ok(ap)
    }

    pub fn next_serial(&self) -> u64 {
        self.serial.fetch_add(1, Ordering::Relaxed)
    }

    /// The control connection to NIC `addr` of this host (made by its first request: no
    /// I/O here, and the table's lock is never held across any).
    pub fn peer(&self, addr: NicAddr) -> Arc<PeerConn> {
        let mut peers = lock(&self.peers);
        if let Some(p) = peers.get(&addr) {
            if !p.is_broken() {
                return p.clone();
            }
        }
        let p = Arc::new(PeerConn::new(self.addr, addr, self.lazy.clone()));
        peers.insert(addr, p.clone());
        p
    }

    /// The table of control connections to the NICs of this host.
    pub fn peers_table(&self) -> &Mutex<HashMap<NicAddr, Arc<PeerConn>>> {
        &self.peers
    }

    /// Have the engine watch `peer`'s liveness (once per connection to it).
    pub fn watch(&self, peer: &PeerConn) {
        if !peer.take_watch() {
            self.command(Cmd::Watch(peer.addr));
        }
    }

    // ---- endpoints -------------------------------------------------------------------

    pub fn endpoint_closed(&self, port: u32) {
        let mut eps = lock(&self.endpoints);
        // Gone, or closed while handles remain (`Endpoint::close`): either way the port is
        // free. (An endpoint that took the port since is open: it stays.)
        if eps.0.get(&port).is_some_and(|w| w.upgrade().is_none_or(|e| e.closed.load(Ordering::Acquire))) {
            eps.0.remove(&port);
        }
    }

    pub fn deliver_oob(
        &self,
        from: EndpointAddr,
        who: PeerIdentity,
        port: u32,
        payload: [u8; OOB_PAYLOAD],
    ) -> Result<(), Code> {
        self.endpoint(port).ok_or(Code::NoSuchEndpoint)?.deliver_oob(OobMessage { from, payload }, who)
    }

    /// Who this process is, to its own endpoints.
    pub fn own_identity(&self) -> PeerIdentity {
        let c = own_cred();
        PeerIdentity::Process { pid: c.pid, uid: c.uid }
    }

    /// Deliver a message whose sender does not wait for the result: a connection request
    /// that cannot be delivered is answered with a refusal (as a closed TCP port answers a
    /// SYN with a reset), so that its client does not wait for its timeout.
    pub fn deliver_oneway(
        &self,
        from: EndpointAddr,
        who: PeerIdentity,
        port: u32,
        payload: [u8; OOB_PAYLOAD],
    ) -> Result<(), Code> {
        let r = self.deliver_oob(from, who, port, payload);
        if r.is_err() {
            if let Ok(clan_wire::connect::Message::Connect { token, .. }) =
                clan_wire::connect::Message::decode(&payload)
            {
                let refuse = clan_wire::connect::encode_refuse(token, clan_wire::connect::RefuseReason::NotListening);
                self.outbox(EndpointAddr::new(self.addr, port), from, refuse);
            }
        }
        r
    }

    /// The open endpoint with this port.
    pub fn endpoint(&self, port: u32) -> Option<Arc<EndpointInner>> {
        let eps = lock(&self.endpoints);
        eps.0.get(&port).and_then(Weak::upgrade)
    }

    /// Send out-of-band messages (in order, one round trip for all) through the host channel
    /// if `to` is on this host, by `deadline`: `None` if it is not (or this NIC reaches its
    /// host's NICs through links). The first refusal is the result. Application threads only.
    pub fn send_oob_host(
        &self,
        from: EndpointAddr,
        to: EndpointAddr,
        payloads: &[[u8; OOB_PAYLOAD]],
        deadline: Instant,
    ) -> Option<Result<(), crate::endpoint::HostOob>> {
        use crate::endpoint::{HostOob, oob_peer_error};
        use clan_wire::control::{Reply, Request};
        if self.config.local_transport != crate::config::LocalTransport::SharedMemory {
            return None;
        }
        let peer = self.peer(to.nic);
        let reqs: Vec<Request> = payloads
            .chunks(clan_wire::control::MAX_BATCH)
            .map(|c| match c {
                [payload] => Request::Oob { from: from.into(), to_port: to.port, payload: *payload, reply: true },
                _ => Request::OobBatch { from: from.into(), to_port: to.port, payloads: c.to_vec(), reply: true },
            })
            .collect();
        let r = peer.request_many(&reqs, deadline);
        if matches!(r, Err(crate::peer::PeerError::Unreachable)) {
            return None;
        }
        self.watch(&peer);
        Some(match r {
            Ok(replies) => replies
                .into_iter()
                .map(|(r, _)| match r {
                    Reply::Ok => Ok(()),
                    Reply::Err { code, .. } => Err(HostOob::Code(code)),
                    other => Err(HostOob::Failed(crate::error::OobError::Protocol {
                        peer: to.nic,
                        detail: format!("unexpected reply {other:?}"),
                    })),
                })
                .find(Result::is_err)
                .unwrap_or(Ok(())),
            Err(e) => Err(HostOob::Failed(oob_peer_error(to, e))),
        })
    }

    /// Queue an out-of-band message for the engine to send (from contexts that must not
    /// wait: a receive path, a destructor, an answer to a peer that may not be listening).
    /// Delivery is best effort; if `to` turns out to be unreachable, the connections of
    /// `from` with `to` end.
    pub fn outbox(&self, from: EndpointAddr, to: EndpointAddr, payload: [u8; OOB_PAYLOAD]) {
        lock(&self.outbox).push((from, to, payload));
        if let Some(w) = self.waker.get() {
            let _ = w.wake();
        }
    }

    /// Send one-way out-of-band messages without ever waiting: straight on our control
    /// connection to `to`'s NIC when we have one and it takes them at once (no engine hop),
    /// else through the engine ([`NicInner::outbox`]).
    pub fn send_oneway(&self, from: EndpointAddr, to: EndpointAddr, payloads: &[[u8; OOB_PAYLOAD]]) {
        if !self.send_oneway_direct(from, to, payloads) {
            for p in payloads {
                self.outbox(from, to, *p);
            }
        }
    }

    /// Send a one-way message that may wait (`crate::lazy`: a connection's close): queued on
    /// our control connection to `to`'s NIC when one is up, to go with the next message sent
    /// there or within [`crate::lazy::DELAY`]; else as [`NicInner::send_oneway`].
    pub fn send_oneway_lazy(&self, from: EndpointAddr, to: EndpointAddr, payload: [u8; OOB_PAYLOAD]) {
        if to.nic != self.addr && self.config.local_transport == crate::config::LocalTransport::SharedMemory {
            if let Some(p) = lock(&self.peers).get(&to.nic).cloned() {
                let req = clan_wire::control::Request::OobBatch {
                    from: from.into(),
                    to_port: to.port,
                    payloads: vec![payload],
                    reply: false,
                };
                if p.queue(&req) {
                    return;
                }
            }
        }
        self.send_oneway(from, to, &[payload]);
    }

    /// The timer of the messages that may wait fired: send every queue (the engine).
    pub fn flush_lazy(&self) {
        self.lazy.fired();
        let peers: Vec<Arc<PeerConn>> = lock(&self.peers).values().cloned().collect();
        for p in peers {
            p.flush_queued();
        }
        self.lazy.still_queued();
    }

    /// Send one-way messages straight on our control connection to `to`'s NIC, if one is up
    /// and has room: whether they went.
    pub fn send_oneway_direct(&self, from: EndpointAddr, to: EndpointAddr, payloads: &[[u8; OOB_PAYLOAD]]) -> bool {
        if to.nic == self.addr
            || self.config.local_transport != crate::config::LocalTransport::SharedMemory
            || payloads.len() > clan_wire::control::MAX_BATCH
        {
            return false;
        }
        let Some(p) = lock(&self.peers).get(&to.nic).cloned() else { return false };
        let req = clan_wire::control::Request::OobBatch {
            from: from.into(),
            to_port: to.port,
            payloads: payloads.to_vec(),
            reply: false,
        };
        p.try_send_oneway(&req)
    }

    /// What the outbox holds (the engine takes it).
    pub fn take_outbox(&self) -> Vec<(EndpointAddr, EndpointAddr, [u8; OOB_PAYLOAD])> {
        std::mem::take(&mut *lock(&self.outbox))
    }

    // ---- apertures -------------------------------------------------------------------

    pub fn export(self: &Arc<Self>, ep: &EndpointInner, len: u64, cfg: ExportConfig) -> Result<Aperture, ExportError> {
        if len == 0 {
            return Err(ExportError::Empty);
        }
        if len > MAX_APERTURE {
            return Err(ExportError::TooLarge { len, max: MAX_APERTURE });
        }
        let cap = clan_shm::segment::page_align(len as usize) as u64;
        let mut policy = cfg.policy;
        let pooled = match cfg.pooled_for {
            Some(peer) => {
                // (room for this one only: a pooled export's policy names its peer alone)
                policy.nics.reserve_exact(1);
                policy.nics.push(peer);
                ApertureMem::pooled(&self.pools.for_peer(peer), len)?.map(Arc::new)
            }
            None => None,
        };
        let is_pooled = pooled.is_some();
        let cached = if pooled.is_some() {
            pooled
        } else {
            let mut c = lock(&self.cache);
            let m = c.by_cap.get_mut(&cap).and_then(Vec::pop);
            if m.is_some() {
                c.bytes -= cap;
            }
            m
        };
        let mem = match cached {
            Some(m) => {
                self.exports_cached.fetch_add(1, Ordering::Relaxed);
                m
            }
            None => {
                self.exports_fresh.fetch_add(1, Ordering::Relaxed);
                Arc::new(ApertureMem::create(cap)?)
            }
        };
        let (id, generation) = {
            let mut t = lock(&self.apertures);
            let id = match t.free.pop() {
                Some(id) => id,
                None => {
                    if t.slots.len() >= u32::MAX as usize {
                        return Err(ExportError::TooMany);
                    }
                    t.slots.push(ApSlot::default());
                    (t.slots.len() - 1) as u32
                }
            };
            let s = &mut t.slots[id as usize];
            s.generation = s.generation.wrapping_add(1).max(1);
            s.in_use = true;
            s.exported = true;
            s.remote = SmallMap::new();
            s.holders = SmallMap::new();
            s.pooled = is_pooled;
            (id, s.generation)
        };
        let tag = aperture_tag(id, generation);
        mem.init(generation, tag);
        let eq = ep.queue.inner.clone();
        let source = crate::tripwire::source_of(id, generation);
        let watch = Arc::new(WatchOwner::new(eq.clone(), mem.cam.clone(), tag, len, 0, ep.addr.port, source));
        let window = Window {
            data: clan_shm::segment::Segment::whole(&mem.seg),
            data_base: 0,
            cam: mem.cam.handle(),
            tag,
            live: live_state(generation),
            port: eq.port.clone(),
            claim: None,
            peer_alive: None,
        };
        let inner = Arc::new(ApertureInner {
            nic: self.clone(),
            id,
            generation,
            len,
            endpoint: ep.addr,
            mem: Some(mem),
            window,
            watch,
            policy,
            revoked: Default::default(),
        });
        {
            let mut t = lock(&self.apertures);
            t.slots[id as usize].live = Arc::downgrade(&inner);
        }
        Ok(Aperture::new(inner))
    }

    /// The live aperture `(id, generation)`, if it is exported.
    pub fn live_aperture(&self, id: u32, generation: u32) -> Option<Arc<ApertureInner>> {
        let t = lock(&self.apertures);
        let s = t.slots.get(id as usize)?;
        if s.generation != generation || !s.exported {
            return None;
        }
        s.live.upgrade()
    }

    pub fn aperture_unexported(&self, id: u32, generation: u32) {
        let mut t = lock(&self.apertures);
        if let Some(s) = t.slots.get_mut(id as usize).filter(|s| s.generation == generation) {
            s.exported = false;
        }
    }

    pub fn remote_refs(&self, id: u32, generation: u32) -> u32 {
        let t = lock(&self.apertures);
        t.slots.get(id as usize).filter(|s| s.generation == generation).map_or(0, |s| s.remote.values().sum())
    }

    fn releasable(&self, s: &ApSlot) -> bool {
        // Pooled memory can only ever reach its pool's peer, which the pool's next aperture
        // is for anyway: reusable once that peer unimported it (`pool.rs`).
        if self.config.reuse_imported_apertures || s.pooled {
            s.remote.values().all(|&n| n == 0)
        } else {
            s.holders.is_empty()
        }
    }

    /// The last local reference to an aperture is gone: recycle its memory, or park it until
    /// the last remote mapping is released.
    pub fn aperture_released(&self, id: u32, generation: u32, mem: Arc<ApertureMem>) {
        let recycle = {
            let mut t = lock(&self.apertures);
            let Some(s) = t.slots.get_mut(id as usize).filter(|s| s.generation == generation) else {
                return;
            };
            s.live = Weak::new();
            if self.releasable(s) {
                s.in_use = false;
                t.free.push(id);
                Some(mem)
            } else {
                s.parked = Some(mem);
                None
            }
        };
        if let Some(m) = recycle {
            self.recycle(m);
        }
    }

    fn recycle(&self, mem: Arc<ApertureMem>) {
        // Local mappings keep the aperture (and so its memory) alive: when the memory gets
        // here, none of ours can reach it, and remote ones were released (`releasable`).
        let Ok(mem) = Arc::try_unwrap(mem) else {
            return;
        };
        if mem.slice().is_some() {
            // Back to its pool (`pool.rs`: the slice's drop).
            return;
        }
        if mem.handed_out.load(Ordering::Relaxed) && !self.config.reuse_imported_apertures {
            // Tainted: another process may still hold its descriptors.
            return;
        }
        let cap = mem.cap;
        let mut c = lock(&self.cache);
        if c.bytes + cap > self.config.cache_bytes || mem.reset().is_err() {
            return;
        }
        c.bytes += cap;
        c.by_cap.entry(cap).or_default().push(Arc::new(mem));
    }

    fn after_remote_change(&self, t: &mut ApertureTable, id: u32) -> Option<Arc<ApertureMem>> {
        let s = &mut t.slots[id as usize];
        if s.parked.is_some() && s.live.strong_count() == 0 && self.releasable(s) {
            s.in_use = false;
            let m = s.parked.take();
            t.free.push(id);
            return m;
        }
        None
    }

    pub fn remote_unref(&self, id: u32, generation: u32, conn: u64) {
        let m = {
            let mut t = lock(&self.apertures);
            let Some(s) = t.slots.get_mut(id as usize).filter(|s| s.generation == generation) else {
                return;
            };
            if let Some(n) = s.remote.get_mut(&conn) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    s.remote.remove(&conn);
                }
            }
            self.after_remote_change(&mut t, id)
        };
        if let Some(m) = m {
            self.recycle(m);
        }
    }

    pub fn connection_closed(&self, c: Conn, still_connected: bool) {
        // The peer NIC's control channel to us closed: the NIC closed or its process died
        // (connections are kept for the NIC's life), unless the engine saw another channel
        // from the same NIC and process still open (`still_connected`).
        if let (Some(peer), false) = (c.hello, still_connected) {
            self.peer_gone(peer);
            // A later process on that address gets a pool of its own, never this memory.
            self.pools.retire(peer);
        }
        // No grant on accept is made through it from now on (one made before is released
        // below with the rest).
        let eqs = {
            let mut g = lock(&c.grants);
            g.closed = true;
            std::mem::take(&mut g.eqs)
        };
        let mut recycle = Vec::new();
        {
            let mut t = lock(&self.apertures);
            for id in 0..t.slots.len() as u32 {
                let s = &mut t.slots[id as usize];
                let touched = s.remote.remove(&c.id).is_some() | s.holders.remove(&c.id).is_some();
                if touched {
                    if let Some(m) = self.after_remote_change(&mut t, id) {
                        recycle.push(m);
                    }
                }
            }
        }
        for m in recycle {
            self.recycle(m);
        }
        // Retire the ports of that process (if this was its last connection) in every queue
        // it was given one.
        for a in self.all_queues(&eqs) {
            a.release_conn(c.id);
        }
    }

    fn all_queues(&self, ids: &HashSet<u32>) -> Vec<Arc<EqInner>> {
        let q = lock(&self.queues);
        ids.iter().filter_map(|id| q.get(id).and_then(Weak::upgrade)).collect()
    }

    /// Serve an import request from connection `c`.
    pub fn grant_import(
        &self,
        c: &Grantee,
        grants: &mut HostGrants,
        importer: EndpointAddr,
        desc: &[u8],
    ) -> Result<(ImportGrant, GrantFds), (Code, String)> {
        let r = self.grant_import_inner(c, grants, importer, desc);
        match &r {
            Ok((g, _)) => {
                self.imports_granted.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%importer, pid = c.cred.pid, import = g.import_id, "import granted");
            }
            Err((code, detail)) => {
                self.imports_refused.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%importer, pid = c.cred.pid, ?code, "import refused {detail}");
            }
        };
        r
    }

    fn grant_import_inner(
        &self,
        c: &Grantee,
        grants: &mut HostGrants,
        importer: EndpointAddr,
        desc: &[u8],
    ) -> Result<(ImportGrant, GrantFds), (Code, String)> {
        if grants.closed {
            return Err((Code::Internal, "the connection is closing".into()));
        }
        let refused = |r: Refusal| (Code::from(r), r.to_string());
        let desc = Descriptor::from_bytes(desc).map_err(|_| refused(Refusal::Malformed))?;
        // The importing endpoint's NIC is the one the connection's hello named, which the
        // engine verified to belong to the connecting process before serving anything.
        let who = Importer::Process {
            uid: c.cred.uid,
            pid: c.cred.pid,
            endpoint: importer.into(),
            verified_nic: c.hello.map(|h| h.socket_addr()),
        };
        let ap = self.check_import(&desc, &who).map_err(refused)?;
        if desc.is_narrowed() {
            // The process would receive the whole aperture's memory: it is served through a
            // link instead (the importer asks there itself; one that did not is refused).
            return Err(refused(Refusal::Narrowed));
        }
        let mem = ap.mem();
        let read_only = !desc.rights().contains(Rights::WRITE);
        if let Some(s) = mem.slice() {
            // The chunk holds the pool's other apertures: handed over to the pool's process
            // only, and for read-write grants only (a read-only one goes through a link, like
            // a narrowed one: a read-only open of the chunk would still read the others
            // read-only, and a later read-write grant would upgrade this one).
            if read_only {
                return Err(refused(Refusal::Narrowed));
            }
            s.pool.bind(c.cred.pid, c.cred.uid).map_err(refused)?;
        }
        let internal = |e: std::io::Error| (Code::Internal, e.to_string());
        let (data, index, data_offset, index_offset) = mem.fds();
        // Sent as they are where they may be (`SCM_RIGHTS` installs copies in the importer,
        // sharing their open file descriptions, as duplicates here would): read-only grants
        // get a read-only open of the data, and the index goes read-only always (a pool's
        // chunk opens it once).
        let data_ro = if read_only { Some(data.reopen_read_only().map_err(internal)?) } else { None };
        let index_ro = match mem.slice() {
            Some(s) => s.chunk.index_read_only().map(|_| None),
            None => index.reopen_read_only().map(Some),
        }
        .map_err(internal)?;
        mem.handed_out.store(true, Ordering::Relaxed);
        let eq = ap.watch.eq.clone();
        // The process's port in the aperture's queue (its ring; its claims are honoured on
        // this aperture from now on). Sent with every import: concurrent imports through one
        // connection never depend on each other's order; the importer keeps one mapping.
        let port = eq.port_for(c.cred.pid, c.cred.uid, c.id).map_err(refused)?;
        eq.grant(&port, &ap, desc.rights());
        let fds = GrantFds { mem: mem.clone(), port: port.clone(), data_ro, index_ro };
        grants.eqs.insert(eq.id);
        self.remember_queue(&eq);
        let import_id = self.next_serial();
        grants.imports.insert(import_id, (ap.id, ap.generation));
        {
            let mut t = lock(&self.apertures);
            if let Some(s) = t.slots.get_mut(ap.id as usize).filter(|s| s.generation == ap.generation) {
                *s.remote.get_or_insert_with(c.id, || 0) += 1;
                s.holders.insert(c.id, ());
            }
        }
        Ok((
            ImportGrant {
                import_id,
                aperture_len: ap.len,
                cap: mem.cap,
                data_offset,
                index_offset,
                slots: mem.slots,
                eq_id: eq.id,
                port: port.id,
                ring_cap: eq.layout.params.ring_cap,
                tag: ap.watch.tag,
                live: live_state(ap.generation),
                read_only,
            },
            fds,
        ))
    }

    /// File an `ImportOnAccept` that came on host connection `c` (`crate::onaccept`): the
    /// import, for `importer`, of what the connect with `token` from `c`'s NIC is accepted
    /// with. Request `id` is answered then, or never.
    pub fn file_on_accept(&self, c: &Conn, importer: EndpointAddr, token: u64, id: u32) {
        // (the session serves nothing before a verified hello)
        let Some(nic) = c.hello else { return };
        let f =
            Filed { sock: Arc::downgrade(&c.sock), grants: Arc::downgrade(&c.grants), who: c.grantee(), id, importer };
        lock(&self.on_accept).file(nic, token, f);
    }

    /// The connect with `token` from `from` is being accepted with `local`: if its client
    /// asked for that import on accept, grant it now and send the grant (or the refusal) on
    /// the control connection it asked on, before the answer to the connect goes out. Never
    /// waits; any failure leaves the client to import as usual.
    pub fn grant_on_accept(&self, from: EndpointAddr, token: u64, local: &Descriptor) {
        let Some(f) = lock(&self.on_accept).take(from.nic, token) else { return };
        let (Some(sock), Some(grants)) = (f.sock.upgrade(), f.grants.upgrade()) else { return };
        let mut g = lock(&grants);
        let (reply, fds) = match self.grant_import(&f.who, &mut g, f.importer, &local.to_bytes()) {
            Ok((grant, fds)) => (Reply::ImportOk(grant), Some(fds)),
            Err((code, detail)) => (Reply::Err { code, detail }, None),
        };
        let borrowed = fds.as_ref().map(GrantFds::borrowed).unwrap_or_default();
        if sock.send(&reply.encode(f.id), &borrowed).is_err() {
            // (its socket is full: the client does not read, or is gone) Not granted after
            // all; the client imports as usual if it is still there.
            if let Reply::ImportOk(grant) = reply {
                if let Some((ap, generation)) = g.imports.remove(&grant.import_id) {
                    drop(g);
                    self.remote_unref(ap, generation, f.who.id);
                }
            }
            return;
        }
        if matches!(reply, Reply::ImportOk(_)) {
            self.imports_granted_on_accept.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remember_queue(&self, eq: &Arc<EqInner>) {
        let mut q = lock(&self.queues);
        q.retain(|_, w| w.strong_count() > 0);
        q.insert(eq.id, Arc::downgrade(eq));
    }

    pub fn default_queue(&self) -> &EventQueue {
        self.default_queue.get().expect("set when the NIC opens")
    }

    pub fn new_queue(self: &Arc<Self>, config: EventQueueConfig) -> Result<EventQueue, EventQueueError> {
        let id = self.next_queue.fetch_add(1, Ordering::Relaxed);
        let inner = EqInner::create(id, Arc::downgrade(self), self.links.open().clone(), config)?;
        self.remember_queue(&inner);
        Ok(EventQueue { inner })
    }
}

/// A software NIC, embedded in this process. Cheap to clone (clones share the NIC);
/// `Send` and `Sync`. The NIC closes when the last clone and the last object made from it
/// (endpoint, aperture, mapping, queue) are gone.
///
/// One NIC can hold any number of endpoints; two of them talk to each other exactly as two
/// processes (or hosts) would:
///
/// ```
/// use clan::{Nic, NicConfig};
///
/// let nic = Nic::open(NicConfig::default())?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// assert_eq!(server.addr().nic, nic.addr());
/// assert_ne!(server.port(), client.port());
///
/// let buf = server.export(4096)?;
/// let remote = client.import(&buf.descriptor())?;
/// remote.write(0, b"hello")?;
/// let mut got = [0u8; 5];
/// buf.read(0, &mut got)?;
/// assert_eq!(&got, b"hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Nic {
    pub(crate) inner: Arc<NicInner>,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic")
            .field("addr", &format_args!("{}", self.inner.addr))
            .field("tcp", &self.inner.config.tcp)
            .field("links", &self.inner.links.all().len())
            .finish()
    }
}

impl Nic {
    /// Open a NIC: bind its address on this host, create its default event queue and start
    /// its engine thread. Raises the soft `RLIMIT_NOFILE` to the hard limit (each aperture
    /// holds one memfd).
    ///
    /// ```
    /// use clan::{Nic, NicConfig};
    ///
    /// // Host-local only (no TCP listener for links), on a free port.
    /// let nic = Nic::open(NicConfig { tcp: false, ..NicConfig::default() })?;
    /// assert!(nic.addr().ip().is_loopback());
    /// assert_ne!(nic.addr().port(), 0, "port 0 asked for a free one");
    /// assert!(!nic.config().tcp);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open(config: NicConfig) -> Result<Nic, NicError> {
        FD_LIMIT.store(clan_shm::memfd::raise_fd_limit(), Ordering::Relaxed);
        let (addr, listener, tcp) = bind(&config)?;
        let mut secret = [0u8; 32];
        rustix::rand::getrandom(&mut secret, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| NicError::Io { context: "reading random bytes for the NIC secret", source: e.into() })?;
        crate::event_queue::params_of(&config.default_queue).map_err(|e| NicError::Config(e.to_string()))?;
        let default_config = config.default_queue.clone();
        let lazy = Arc::new(
            crate::lazy::Lazy::new().map_err(|source| NicError::Io { context: "creating the NIC's timer", source })?,
        );
        let inner = Arc::new(NicInner {
            addr,
            config,
            secret,
            serial: AtomicU64::new(1),
            apertures: Mutex::new(ApertureTable::default()),
            endpoints: Mutex::new((HashMap::new(), 1)),
            next_queue: AtomicU32::new(1),
            default_queue: OnceLock::new(),
            queues: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            links: LinkTable::default(),
            spinners: Default::default(),
            conns: Default::default(),
            outbox: Mutex::new(Vec::new()),
            cmds: Mutex::new(Vec::new()),
            waker: OnceLock::new(),
            cache: Mutex::new(Cache::default()),
            pools: crate::pool::Pools::default(),
            chunk_maps: Mutex::new(HashMap::new()),
            kept: Mutex::new(HashMap::new()),
            engine: Mutex::new(None),
            dma: Mutex::new(None),
            exports_fresh: AtomicU64::new(0),
            exports_cached: AtomicU64::new(0),
            imports_granted: AtomicU64::new(0),
            imports_refused: AtomicU64::new(0),
            imports_granted_on_accept: AtomicU64::new(0),
            on_accept: Mutex::default(),
            lazy,
        });
        let q = EqInner::create(0, Arc::downgrade(&inner), inner.links.open().clone(), default_config)
            .map_err(|e| NicError::Config(format!("default event queue: {e}")))?;
        inner.remember_queue(&q);
        let _ = inner.default_queue.set(EventQueue { inner: q });
        let (engine, waker) = Engine::start(
            Arc::downgrade(&inner),
            listener,
            tcp,
            inner.lazy.fd(),
            inner.config.engine_cpu,
            inner.config.admission,
        )
        .map_err(|source| NicError::Io { context: "starting the NIC engine", source })?;
        tracing::info!(addr = %inner.addr, tcp = inner.config.tcp, "NIC open");
        let _ = inner.waker.set(waker);
        *lock(&inner.engine) = Some(engine);
        Ok(Nic { inner })
    }

    /// Open a NIC on 127.0.0.1 with a free port and default settings.
    ///
    /// ```
    /// let (a, b) = (clan::Nic::open_default()?, clan::Nic::open_default()?);
    /// assert_ne!(a.addr(), b.addr(), "each gets a port of its own");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_default() -> Result<Nic, NicError> {
        Nic::open(NicConfig::default())
    }

    /// Its address.
    pub fn addr(&self) -> NicAddr {
        self.inner.addr
    }

    /// Its configuration.
    pub fn config(&self) -> &NicConfig {
        &self.inner.config
    }

    /// The default event queue (used by endpoints created without one).
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// assert_eq!(ep.event_queue().id(), nic.default_queue().id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn default_queue(&self) -> &EventQueue {
        self.inner.default_queue()
    }

    /// A new event queue.
    ///
    /// ```
    /// use clan::{EndpointConfig, EventQueueConfig, Nic};
    ///
    /// let nic = Nic::open_default()?;
    /// let q = nic.event_queue(EventQueueConfig { ring_capacity: 256, ..EventQueueConfig::default() })?;
    /// assert_ne!(q.id(), nic.default_queue().id());
    /// // An endpoint that reports to it:
    /// let ep = nic.endpoint_with(EndpointConfig { queue: Some(q.clone()), ..EndpointConfig::default() })?;
    /// assert_eq!(ep.event_queue().id(), q.id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn event_queue(&self, config: EventQueueConfig) -> Result<EventQueue, EventQueueError> {
        self.inner.new_queue(config)
    }

    /// A new endpoint on a free port, reporting to the default queue.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// assert_ne!(ep.port(), 0);
    /// assert_eq!(nic.stats().endpoints, 1);
    /// drop(ep);
    /// assert_eq!(nic.stats().endpoints, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn endpoint(&self) -> Result<Endpoint, EndpointError> {
        self.endpoint_with(EndpointConfig::default())
    }

    /// A new endpoint.
    ///
    /// ```
    /// use clan::{EndpointAddr, EndpointConfig, EndpointError, Nic};
    ///
    /// let nic = Nic::open_default()?;
    /// // A well-known port, so that peers can be told the address in advance.
    /// let ep = nic.endpoint_with(EndpointConfig { port: Some(7), ..EndpointConfig::default() })?;
    /// assert_eq!(ep.addr(), EndpointAddr::new(nic.addr(), 7));
    /// let again = nic.endpoint_with(EndpointConfig { port: Some(7), ..EndpointConfig::default() });
    /// assert!(matches!(again, Err(EndpointError::PortInUse(7))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn endpoint_with(&self, cfg: EndpointConfig) -> Result<Endpoint, EndpointError> {
        let queue = cfg.queue.unwrap_or_else(|| self.inner.default_queue().clone());
        if queue.inner.nic.upgrade().is_none_or(|n| !Arc::ptr_eq(&n, &self.inner)) {
            return Err(EndpointError::ForeignQueue);
        }
        let mut eps = lock(&self.inner.endpoints);
        let port = match cfg.port {
            Some(0) => return Err(EndpointError::ReservedPort),
            Some(p) => {
                if eps.0.get(&p).is_some_and(|w| w.strong_count() > 0) {
                    return Err(EndpointError::PortInUse(p));
                }
                p
            }
            None => loop {
                let p = eps.1;
                eps.1 = eps.1.wrapping_add(1).max(1);
                if eps.0.get(&p).is_none_or(|w| w.strong_count() == 0) {
                    break p;
                }
            },
        };
        let inner = Arc::new(EndpointInner::new(
            self.inner.clone(),
            EndpointAddr::new(self.inner.addr, port),
            queue,
            cfg.dma_queue,
        ));
        eps.0.insert(port, Arc::downgrade(&inner));
        Ok(Endpoint { inner })
    }

    /// Process incoming link traffic in the calling thread; returns whether there was any.
    /// Required with [`crate::Progress::Manual`] (call it wherever the thread spins); harmless
    /// otherwise (it only does what the engine would have done a little later).
    ///
    /// ```
    /// use clan::{Nic, NicConfig, Progress};
    ///
    /// let nic = Nic::open(NicConfig { progress: Progress::Manual, ..NicConfig::default() })?;
    /// assert!(!nic.progress(), "no link to another host: nothing to process");
    /// // Within a host, data moves without any progress call at all:
    /// let (a, b) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = a.export(4096)?;
    /// b.import(&ap.descriptor())?.store_u64(0, 9)?;
    /// assert_eq!(ap.load_u64(0)?, 9);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn progress(&self) -> bool {
        self.inner.progress()
    }

    /// Whether a link to another host is open: a hint (one may open or close at any time),
    /// for a poll loop that calls [`Nic::spin_links`] only when there is something to drive.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// assert!(!nic.has_links(), "no other host yet");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn has_links(&self) -> bool {
        // A hint (Relaxed, as in `spin_links`).
        self.inner.links.open.load(Ordering::Relaxed) != 0
    }

    /// Begin a spin on this NIC's links: for a thread that polls for data that may come from
    /// other hosts (a completion queue read in a loop, a non-blocking read), which should
    /// apply those bytes itself ([`crate::LinkSpin::drive`]) rather than wait for the engine's
    /// thread to be scheduled, on its own CPU perhaps. While it spins the engine leaves the
    /// links' traffic to it. One load when no link is open (then `drive` does nothing).
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let spin = nic.spin_links();
    /// assert!(!spin.drive(), "no link: nothing to apply");
    /// drop(spin); // the spin ends (the engine listens again, if it had stopped)
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn spin_links(&self) -> crate::LinkSpin {
        // A hint (Relaxed, as in `NicInner::progress`): a link that opens meanwhile is
        // served by the engine.
        let open = self.inner.links.open.load(Ordering::Relaxed) != 0;
        crate::LinkSpin::begin(open.then(|| self.inner.clone()))
    }

    /// Counters (example at [`NicStats`]).
    pub fn stats(&self) -> NicStats {
        let i = &self.inner;
        NicStats {
            exports_fresh: i.exports_fresh.load(Ordering::Relaxed),
            exports_cached: i.exports_cached.load(Ordering::Relaxed),
            imports_granted: i.imports_granted.load(Ordering::Relaxed),
            imports_refused: i.imports_refused.load(Ordering::Relaxed),
            imports_granted_on_accept: i.imports_granted_on_accept.load(Ordering::Relaxed),
            cached_bytes: lock(&i.cache).bytes,
            pools: i.pools.counts().0,
            pool_chunks: i.pools.counts().1,
            link_parks: i.spinners.parks(),
            links: i.links.all().iter().filter(|l| !l.is_closed()).count() as u64,
            link_empty_receives: i.links.all().iter().map(|l| l.stats.empty_receives.load(Ordering::Relaxed)).sum(),
            link_recv_sleeps: i.links.all().iter().map(|l| l.stats.recv_sleeps.load(Ordering::Relaxed)).sum(),
            link_recv_interrupts: i.links.all().iter().map(|l| l.stats.recv_interrupts.load(Ordering::Relaxed)).sum(),
            endpoints: i
                .endpoints
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .0
                .values()
                .filter(|w| w.strong_count() > 0)
                .count() as u64,
        }
    }
}
