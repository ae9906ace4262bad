//! Configuration, with defaults that suit a low-latency server.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::addr::{EndpointAddr, NicAddr};

pub use clan_wire::LinkConfig;
pub use clan_wire::control::AdmissionLimits;

/// The environment variable that sets how long waits spin before they sleep, in
/// microseconds ([`default_spin`]); `0` turns spinning off everywhere.
pub const SPIN_ENV: &str = "CLAN_SPIN_US";

/// How long a wait spins when `CLAN_SPIN_US` is not set: the paper's 15 µs.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(15);

/// Longest spin `CLAN_SPIN_US` may ask for (one second).
pub const MAX_SPIN: Duration = Duration::from_secs(1);

/// Why a value of `CLAN_SPIN_US` was refused.
///
/// ```
/// let e = clan::parse_spin("2000000").unwrap_err(); // two seconds: more than MAX_SPIN
/// assert_eq!(e.value, "2000000");
/// assert!(e.to_string().contains("from 0 to 1000000"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CLAN_SPIN_US={value:?}: expected whole microseconds from 0 to 1000000")]
pub struct SpinParseError {
    /// The value given.
    pub value: String,
}

/// Parse a `CLAN_SPIN_US` value: whole microseconds, `0` for no spinning at all, at most
/// [`MAX_SPIN`]. Surrounding blanks are ignored.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(clan::parse_spin("0"), Ok(Duration::ZERO));
/// assert_eq!(clan::parse_spin(" 40 "), Ok(Duration::from_micros(40)));
/// assert!(clan::parse_spin("fast").is_err());
/// ```
pub fn parse_spin(value: &str) -> Result<Duration, SpinParseError> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_micros)
        .filter(|d| *d <= MAX_SPIN)
        .ok_or_else(|| SpinParseError { value: value.to_owned() })
}

/// The spin every default configuration of clan starts from: the one setting that decides
/// whether waits poll memory before they sleep.
///
/// `CLAN_SPIN_US` when set (read once per process; `0`: every wait arms its tripwire and
/// sleeps at once, nothing polls), otherwise [`DEFAULT_SPIN`]. A value that does not parse is
/// reported once (a `tracing` warning) and ignored. Processes that share one CPU should not
/// spin (`CLAN_SPIN_US=0`): the peer they wait for needs that CPU.
///
/// [`EventQueueConfig`], [`DmaConfig`] and the protocols' configurations (streams, queues,
/// RPC, VMMC, the socket interposition and the libfabric provider) all take their default
/// from here; a value set explicitly in a configuration wins over it.
///
/// ```
/// use clan::{EventQueueConfig, default_spin};
///
/// assert!(default_spin() <= clan::MAX_SPIN);
/// assert_eq!(EventQueueConfig::default().spin, default_spin());
/// ```
pub fn default_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let Ok(v) = std::env::var(SPIN_ENV) else { return DEFAULT_SPIN };
        parse_spin(&v).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "ignored; waits spin {DEFAULT_SPIN:?}");
            DEFAULT_SPIN
        })
    })
}

/// Who processes incoming link traffic (writes, reads, messages from other hosts).
///
/// ```
/// use std::time::Duration;
/// use clan::{Nic, NicConfig, Progress};
///
/// assert_eq!(NicConfig::default().progress, Progress::Engine);
/// // An engine that polls its links for 50 µs after the last frame before it sleeps:
/// let cfg = NicConfig { progress: Progress::BusyPoll(Duration::from_micros(50)), ..NicConfig::default() };
/// let nic = Nic::open(cfg)?;
/// assert_eq!(nic.config().progress, Progress::BusyPoll(Duration::from_micros(50)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`Progress::Manual`] is shown at [`crate::Nic::progress`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The NIC's engine thread, woken by epoll (the default). Threads that wait for a link
    /// (a read, an import, a barrier) also process it themselves when they can.
    Engine,
    /// The engine thread, which keeps polling its links for this long after the last
    /// activity before it sleeps in epoll (lower latency, one core busy).
    BusyPoll(Duration),
    /// The application: nothing happens on links unless a thread calls
    /// [`crate::Nic::progress`] (as with UCX or libfabric in manual progress). Made for a
    /// thread that spins anyway, so that no second thread needs a core.
    Manual,
}

/// How this NIC reaches another NIC of the same host.
///
/// Two NICs of one process, linked over loopback TCP as NICs of two hosts are:
///
/// ```
/// use clan::{LocalTransport, Nic, NicConfig};
///
/// let cfg = || NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() };
/// let (here, there) = (Nic::open(cfg())?, Nic::open(cfg())?);
/// let (exporter, importer) = (there.endpoint()?, here.endpoint()?);
/// let buf = exporter.export(4096)?; // lives as long as `exporter` does
/// let m = importer.import(&buf.descriptor())?;
/// assert!(m.is_remote(), "through a link, not mapped memory");
/// m.write(0, b"over tcp")?;
/// m.barrier()?; // returns once the exporter has applied the write
/// let mut got = [0u8; 8];
/// buf.read(0, &mut got)?;
/// assert_eq!(&got, b"over tcp");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalTransport {
    /// Shared memory (the default): the other NIC's memory is mapped here.
    SharedMemory,
    /// A link, as if the other NIC were on another host (for tests and benchmarks).
    Link,
}

/// How a NIC is opened. (Its `Debug` never shows the cluster key.)
///
/// Start from the default and change what you need:
///
/// ```
/// use std::time::Duration;
/// use clan::{Nic, NicConfig};
///
/// let cfg = NicConfig {
///     request_timeout: Duration::from_secs(1),
///     cluster_key: Some([7; 32]),
///     ..NicConfig::default()
/// };
/// assert!(format!("{cfg:?}").contains("<secret>"), "the key is never printed");
/// let nic = Nic::open(cfg)?;
/// assert_eq!(nic.config().request_timeout, Duration::from_secs(1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct NicConfig {
    /// Host address of the NIC (default 127.0.0.1).
    pub ip: IpAddr,
    /// Port of the NIC; 0 (the default) picks a free one.
    pub port: u16,
    /// Geometry of the NIC's default event queue (shared by endpoints that name no other).
    pub default_queue: EventQueueConfig,
    /// Bound on every request to another NIC (import, out-of-band message) made without a
    /// timeout of its own, and on setting up a link.
    pub request_timeout: Duration,
    /// Recycle the memory of an unexported aperture that another process imported, once every
    /// importing process has unimported it or gone. Off by default: a process handed a
    /// descriptor can keep it (or pass it on) whatever it says, and would then reach the next
    /// aperture made from that memory. Turn on only when every importer is trusted (the same
    /// user's processes, which can `ptrace` one another anyway). Memory no other process
    /// received is always recycled.
    pub reuse_imported_apertures: bool,
    /// Most bytes of unexported aperture memory kept for reuse (the endpoint cache).
    pub cache_bytes: u64,
    /// Accept and make links to NICs of other hosts over TCP at `ip:port`.
    pub tcp: bool,
    /// Link parameters (window, keepalive).
    pub link: LinkConfig,
    /// Who processes incoming link traffic.
    pub progress: Progress,
    /// How to reach NICs of this host.
    pub local_transport: LocalTransport,
    /// A key shared by the NICs of a cluster: links authenticate both ends with it (and
    /// refuse a peer without it). Without one, a link trusts the address its peer claims in
    /// its hello: anyone who can reach the NIC's TCP port can pretend to be any NIC (though
    /// never replace a link that is up). The key authenticates the hand-shake, not the frames
    /// after it: use a private network or a VPN against a man in the middle.
    pub cluster_key: Option<[u8; 32]>,
    /// Reach these NICs at these socket addresses instead of their own (a proxy, NAT).
    pub routes: Vec<(NicAddr, SocketAddr)>,
    /// Pin the engine thread to this CPU (e.g. the CPU of the thread it wakes).
    pub engine_cpu: Option<usize>,
    /// The DMA engine.
    pub dma: DmaConfig,
    /// Imports one peer NIC may hold from us over a link.
    pub max_link_imports: usize,
    /// Control connections from the processes of this host: per process, per user, in all.
    pub admission: AdmissionLimits,
    /// Let a thread asleep on a queue as its leader, driving one link and no ports, sleep in
    /// the link socket's own `recv`, so that a byte from the other host wakes it with its
    /// data (one system call fewer per message than a sleep in epoll). Local events wake it
    /// with a real-time signal whose handler does nothing (`clan_shm::wakesig`: `SIGRTMAX - 3`,
    /// or `CLAN_WAKE_SIGNAL`; taken only if the program does not handle it). Default: on.
    /// `clan run` and the libfabric provider turn it off: the programs they serve own their
    /// signals.
    pub wake_signal: bool,
}

/// The DMA engine of a NIC (a thread started with the first DMA request).
///
/// ```
/// use std::time::Duration;
/// use clan::{DmaConfig, Nic, NicConfig};
///
/// // An engine that sleeps as soon as its queues are empty (it shares a CPU with others).
/// let dma = DmaConfig { spin: Duration::ZERO, ..DmaConfig::default() };
/// assert_eq!(dma.quantum, 65536);
/// let nic = Nic::open(NicConfig { dma, ..NicConfig::default() })?;
/// assert_eq!(nic.config().dma.spin, Duration::ZERO);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct DmaConfig {
    /// How long the engine polls for new requests after the last one before it sleeps
    /// (a request posted meanwhile starts without a wake-up). Default: [`default_spin`].
    pub spin: Duration,
    /// Bytes moved for one queue before the engine turns to the next non-empty queue
    /// (round-robin: the unit of fairness between endpoints).
    pub quantum: u64,
    /// Pin the engine thread to this CPU.
    pub cpu: Option<usize>,
}

impl Default for DmaConfig {
    fn default() -> Self {
        DmaConfig { spin: default_spin(), quantum: 65536, cpu: None }
    }
}

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            default_queue: EventQueueConfig { tripwires: 1 << 20, ..EventQueueConfig::default() },
            request_timeout: Duration::from_secs(5),
            reuse_imported_apertures: false,
            cache_bytes: 256 << 20,
            tcp: true,
            link: LinkConfig::default(),
            progress: Progress::Engine,
            local_transport: LocalTransport::SharedMemory,
            cluster_key: None,
            routes: Vec::new(),
            engine_cpu: None,
            dma: DmaConfig::default(),
            max_link_imports: 65536,
            admission: AdmissionLimits::default(),
            wake_signal: true,
        }
    }
}

impl std::fmt::Debug for NicConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NicConfig")
            .field("ip", &self.ip)
            .field("port", &self.port)
            .field("request_timeout", &self.request_timeout)
            .field("tcp", &self.tcp)
            .field("progress", &self.progress)
            .field("local_transport", &self.local_transport)
            .field("cluster_key", &self.cluster_key.map(|_| "<secret>"))
            .field("routes", &self.routes.len())
            .finish_non_exhaustive()
    }
}

impl NicConfig {
    /// Default configuration at `ip:port`.
    ///
    /// ```
    /// use clan::{Nic, NicConfig, NicError};
    ///
    /// let first = Nic::open_default()?;
    /// let taken = first.addr();
    /// // Another NIC at the same address is refused.
    /// match Nic::open(NicConfig::at(taken.ip(), taken.port())) {
    ///     Err(NicError::AddrInUse(a)) => assert_eq!(a, taken),
    ///     other => panic!("expected AddrInUse, got {other:?}"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn at(ip: IpAddr, port: u16) -> NicConfig {
        NicConfig { ip, port, ..NicConfig::default() }
    }
}

/// Geometry and behaviour of an event queue.
///
/// ```
/// use std::time::Duration;
/// use clan::{EventQueueConfig, EventQueueError, Nic};
///
/// let nic = Nic::open_default()?;
/// // A small queue whose waits sleep at once instead of spinning.
/// let small =
///     EventQueueConfig { ring_capacity: 64, tripwires: 64, spin: Duration::ZERO, ..EventQueueConfig::default() };
/// let q = nic.event_queue(small)?;
/// assert_eq!(q.config().ring_capacity, 64);
/// // The ring capacity must be a power of two.
/// let bad = nic.event_queue(EventQueueConfig { ring_capacity: 1000, ..EventQueueConfig::default() });
/// assert!(matches!(bad, Err(EventQueueError::Config(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct EventQueueConfig {
    /// Events each producer process can have outstanding before overflow (power of two).
    pub ring_capacity: u32,
    /// Other processes that may post into the queue (each gets a port: a ring of its own,
    /// `ring_capacity` events), at most [`crate::MAX_PRODUCERS`]; an import from a process
    /// beyond them is refused ([`crate::ImportError::TooManyProducers`]).
    pub producers: u32,
    /// Of the `producers`, at most this many processes of one user (uid): one user cannot
    /// take every port (at most `producers`).
    pub producers_per_user: u32,
    /// Tripwires of all endpoints using the queue.
    pub tripwires: u32,
    /// Tripsets of all endpoints using the queue.
    pub tripsets: u32,
    /// How long `wait` spins before it sleeps (default: [`default_spin`], the paper's
    /// server's 15 µs unless `CLAN_SPIN_US` says otherwise; zero: sleep at once).
    pub spin: Duration,
}

impl Default for EventQueueConfig {
    fn default() -> Self {
        EventQueueConfig {
            ring_capacity: 4096,
            producers: 1024,
            producers_per_user: 64,
            tripwires: 65536,
            tripsets: 1024,
            spin: default_spin(),
        }
    }
}

/// Who may import an aperture. Empty lists mean "anyone with the descriptor".
///
/// ```
/// use clan::{Denial, ExportConfig, ImportError, ImportPolicy, Nic};
///
/// let nic = Nic::open_default()?;
/// let (owner, friend, stranger) = (nic.endpoint()?, nic.endpoint()?, nic.endpoint()?);
/// let policy = ImportPolicy::anyone().endpoint(friend.addr());
/// let ap = owner.export_with(4096, ExportConfig { policy, ..ExportConfig::default() })?;
/// assert!(friend.import(&ap.descriptor()).is_ok());
/// assert!(matches!(stranger.import(&ap.descriptor()), Err(ImportError::Denied(Denial::Endpoint))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportPolicy {
    /// Allowed user ids of importing processes (checked with the kernel's peer credentials).
    pub uids: Vec<u32>,
    /// Allowed process ids of importing processes.
    pub pids: Vec<u32>,
    /// Allowed importing endpoints.
    pub endpoints: Vec<EndpointAddr>,
    /// Allowed importing NICs (any endpoint of them; verified as for endpoints).
    pub nics: Vec<NicAddr>,
}

impl ImportPolicy {
    /// No restriction.
    ///
    /// ```
    /// let p = clan::ImportPolicy::anyone().uid(1000).pid(4242);
    /// assert_eq!((p.uids, p.pids), (vec![1000], vec![4242]));
    /// assert!(clan::ImportPolicy::anyone().endpoints.is_empty());
    /// ```
    pub fn anyone() -> ImportPolicy {
        ImportPolicy::default()
    }
    /// Only processes of user `uid`.
    pub fn uid(mut self, uid: u32) -> Self {
        self.uids.push(uid);
        self
    }
    /// Only process `pid`.
    pub fn pid(mut self, pid: u32) -> Self {
        self.pids.push(pid);
        self
    }
    /// Only endpoint `ep`.
    pub fn endpoint(mut self, ep: EndpointAddr) -> Self {
        self.endpoints.push(ep);
        self
    }
    /// Only endpoints of NIC `nic`.
    pub fn nic(mut self, nic: NicAddr) -> Self {
        self.nics.push(nic);
        self
    }
}

/// How an aperture is exported.
///
/// ```
/// use clan::{ExportConfig, ImportPolicy, Nic};
///
/// let nic = Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let me = std::process::id();
/// let cfg = ExportConfig { policy: ImportPolicy::anyone().pid(me), ..ExportConfig::default() };
/// let ap = ep.export_with(4096, cfg)?;
/// assert!(ep.import(&ap.descriptor()).is_ok(), "this process may import it");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct ExportConfig {
    /// Import restrictions.
    pub policy: ImportPolicy,
    /// Export the aperture for one peer NIC: only that NIC may import it (added to
    /// `policy`), and its memory is carved from a pool shared by every aperture exported for
    /// that peer, so that thousands of them cost a few memfds and mappings instead of two
    /// each. The peer's process then reaches every aperture of the pool once it imports one:
    /// use it for apertures whose descriptors go to that peer anyway (a connection's buffers;
    /// `clan-proto` does for every connection). A read-only or narrowed descriptor of such an
    /// aperture is served through a link. Apertures larger than 512 KiB get memory of their own.
    /// One smaller than a page is carved on cache lines, several to a page, with an index of
    /// 8 tripwire entries (more are refused: `TripwireError::TableFull`): with thousands of
    /// connections used at random, fewer pages and lines are touched.
    pub pooled_for: Option<NicAddr>,
}

impl ExportConfig {
    /// An aperture for `peer` only, with pooled memory (the field `pooled_for`).
    ///
    /// ```
    /// use clan::{ExportConfig, ImportError, Nic};
    ///
    /// let (mine, peer, other) = (Nic::open_default()?, Nic::open_default()?, Nic::open_default()?);
    /// let ep = mine.endpoint()?;
    /// let cfg = ExportConfig::for_peer(peer.addr());
    /// assert_eq!(cfg.pooled_for, Some(peer.addr()));
    /// let aps = [ep.export_with(4096, cfg.clone())?, ep.export_with(4096, cfg)?];
    /// assert_eq!(mine.stats().pools, 1, "both carved from one pool");
    /// let m = peer.endpoint()?.import(&aps[1].descriptor())?;
    /// m.write(0, b"pooled")?;
    /// let refused = other.endpoint()?.import(&aps[0].descriptor());
    /// assert!(matches!(refused, Err(ImportError::Denied(_))), "only `peer` may import");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_peer(peer: NicAddr) -> ExportConfig {
        ExportConfig { pooled_for: Some(peer), ..ExportConfig::default() }
    }
}
