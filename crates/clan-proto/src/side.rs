//! Connection setup shared by the protocols: each party exports one *side* aperture, and the
//! two exchange descriptors and the sides' geometry (ring and post area sizes, as the
//! private data of clan's connect / accept hand-shake). No read of the peer's memory is
//! needed to set up, and the accepting side never waits for the client ([`PeerSide`]).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use clan::{
    AccessError, Aperture, ConnectError, ConnectRequest, Connection, Descriptor, Endpoint, EndpointAddr,
    EndpointConfig, EventQueue, Mapping, Nic,
};

use crate::lock;
use crate::pipe;

/// The first word of a side's geometry (the private data of the connect hand-shake).
const MAGIC: u64 = 0xC1A4_51DE_0000_0002;

/// Most bytes a ring or post area may have.
pub const MAX_RING: u64 = 1 << 30;

/// Why setting up a connection failed (inside [`crate::queue::QueueError::Setup`],
/// [`crate::rpc::RpcError::Setup`], and as an `io::Error` for streams).
///
/// ```
/// use std::time::Duration;
/// use clan_proto::SetupError;
/// use clan_proto::queue::{MsgSender, QueueConfig, QueueError};
///
/// let nic = clan::Nic::open_default()?;
/// let not_listening = nic.endpoint()?;
/// let cfg = QueueConfig { connect_timeout: Duration::from_secs(1), ..QueueConfig::default() };
/// match MsgSender::connect(&nic, not_listening.addr(), &cfg) {
///     Err(QueueError::Setup(SetupError::Connect(clan::ConnectError::Refused(to)))) => {
///         assert_eq!(to, not_listening.addr());
///     }
///     other => panic!("expected a refusal, got {other:?}"),
/// }
/// let bad = MsgSender::connect(&nic, "no address", &cfg);
/// assert!(matches!(bad, Err(QueueError::Setup(SetupError::Address(_)))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The handshake failed (refused, no answer, closed endpoint).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// Exporting our side failed.
    #[error(transparent)]
    Export(#[from] clan::ExportError),
    /// Importing the peer's side failed.
    #[error(transparent)]
    Import(#[from] clan::ImportError),
    /// Making an endpoint failed.
    #[error(transparent)]
    Endpoint(#[from] clan::EndpointError),
    /// Reading the peer's header failed.
    #[error(transparent)]
    Access(#[from] clan::AccessError),
    /// The peer is not speaking this protocol, or says impossible sizes.
    #[error("the peer's side is not a valid clan-proto side ({0})")]
    BadPeer(&'static str),
    /// A size outside what is allowed.
    #[error("invalid size: {0}")]
    BadConfig(&'static str),
    /// The address names no endpoint: a host name that cannot be looked up, or text that is
    /// not an address.
    #[error("resolving the address: {0}")]
    Address(#[from] std::io::Error),
}

/// Both ends of a connection, once set up.
///
/// Laid out in order (`repr(C)`; the fields that drop in the order they are declared): what
/// every message reads (`mine`, `peer_cap`) is [`Sides::HOT`], one run of bytes, so that a
/// user of thousands of connections asks for those lines alone (`rpc`'s parties).
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Sides {
    pub ep: Arc<Endpoint>,
    pub conn: Connection,
    /// Our side, held by value: a load of our own flag follows no pointer to reach it (at
    /// thousands of connections each pointer followed is a cache miss).
    pub mine: Aperture,
    /// The peer's ring and post area (what our writes go into).
    pub peer_cap: u64,
    /// The peer's side (imported when first used, on the accepting side).
    pub peer: Arc<PeerSide>,
    pub peer_post_cap: u64,
    /// The peer's slot size (message queues; 0 for byte rings).
    pub peer_slot: u64,
}

impl Sides {
    /// The bytes a message's send or receipt reads: `mine` and `peer_cap`.
    pub const HOT: std::ops::Range<usize> = std::mem::offset_of!(Sides, mine)..std::mem::offset_of!(Sides, peer);
}

/// The geometry of a side.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub cap: u64,
    pub post_cap: u64,
    pub slot: u64,
    /// Where the ring starts ([`pipe::RING`] for byte rings and queues, `rpc::MSG` for a
    /// message buffer): the protocol's, the same on both sides (not sent).
    pub base: u64,
}

impl Geometry {
    pub fn bytes(cap: u64, post_cap: u64) -> Geometry {
        Geometry { cap, post_cap, slot: 0, base: pipe::RING }
    }

    /// A buffer of `cap` bytes at `base`, after the control words of the first page (a
    /// side smaller than a page is carved from its pool with others in one page).
    pub fn message(cap: u64, base: u64) -> Geometry {
        Geometry { cap, post_cap: 0, slot: 0, base }
    }

    /// Bytes of a side of this geometry.
    pub fn side_len(&self) -> u64 {
        self.base + self.cap + self.post_cap
    }

    /// As private data of the connect hand-shake.
    fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        for (i, v) in [MAGIC, self.cap, self.post_cap, self.slot].into_iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The peer's geometry, checked against what its descriptor grants (`len` bytes); its
    /// ring starts at `base`, as ours. (After the geometry's 32 bytes, at most
    /// [`MAX_CONNECT_DATA`] of the caller's: [`user_data`].)
    fn decode(b: &[u8], len: u64, base: u64) -> Result<Geometry, SetupError> {
        if !(32..=32 + MAX_CONNECT_DATA).contains(&b.len()) {
            return Err(SetupError::BadPeer("not a clan-proto peer (no geometry)"));
        }
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        if w(0) != MAGIC {
            return Err(SetupError::BadPeer("no magic"));
        }
        let g = Geometry { cap: w(1), post_cap: w(2), slot: w(3), base };
        if !(2..=MAX_RING).contains(&g.cap) || g.post_cap > MAX_RING || g.side_len() > len {
            return Err(SetupError::BadPeer("sizes do not fit its aperture"));
        }
        if g.slot != 0 && (g.slot > g.cap || g.cap % g.slot != 0) {
            return Err(SetupError::BadPeer("its slots do not divide its ring"));
        }
        Ok(g)
    }
}

/// The peer's side aperture. The connecting side imports it before the connection is
/// returned; the accepting side imports it when first used (its first write, or the first
/// time its reader tells the peer where it is), so that `accept` never waits for a client:
/// a client that died or stalls after connecting costs only its own connection, whose first
/// use then fails.
pub(crate) struct PeerSide {
    ep: Arc<Endpoint>,
    /// The peer's NIC (what its descriptor names).
    nic: clan::NicAddr,
    timeout: Duration,
    map: OnceLock<Mapping>,
    failed: OnceLock<AccessError>,
    /// What the import needs, until it is made (`None` after, whichever way it ended).
    /// Boxed: it lives only until the first use, the side for the connection's life.
    importing: Mutex<Option<Box<ToImport>>>,
    /// Whether the peer is reached through a link (its connection says so from the start,
    /// before the import that would say it too).
    across_link: bool,
}

/// What a [`PeerSide`] needs to import the peer's side: its descriptor, and the import
/// itself if it was started at accept (its round trip then overlaps the client's own
/// set-up).
struct ToImport {
    desc: Descriptor,
    begun: Option<clan::PendingImport>,
}

impl std::fmt::Debug for PeerSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSide")
            .field("peer", &self.nic)
            .field("imported", &self.map.get().is_some())
            .finish_non_exhaustive()
    }
}

impl PeerSide {
    /// The mapping, importing it first if need be (an import that failed fails every time:
    /// the peer is gone).
    #[inline]
    pub fn get(&self) -> Result<&Mapping, AccessError> {
        match self.map.get() {
            Some(m) => Ok(m),
            None => self.import(),
        }
    }

    /// The mapping if imported already (never waits).
    #[inline]
    pub fn imported(&self) -> Option<&Mapping> {
        self.map.get()
    }

    /// Whether the peer is reached through a link (known from the connection: imported or
    /// not).
    #[inline]
    pub fn across_link(&self) -> bool {
        self.across_link
    }

    #[cold]
    fn import(&self) -> Result<&Mapping, AccessError> {
        let mut pending = lock(&self.importing);
        if let Some(m) = self.map.get() {
            return Ok(m);
        }
        if let Some(e) = self.failed.get() {
            return Err(e.clone());
        }
        let r = match pending.take().map(|b| *b) {
            Some(ToImport { begun: Some(p), .. }) => p.finish(self.timeout),
            Some(ToImport { desc, begun: None }) => self.ep.import_timeout(&desc, self.timeout),
            // (taken only here, under the lock, which sets `map` or `failed` before it lets
            // go: not met)
            None => return Err(self.failed.get_or_init(|| AccessError::Disconnected).clone()),
        };
        match r {
            Ok(m) => Ok(self.map.get_or_init(|| m)),
            Err(e) => {
                let a = match e {
                    clan::ImportError::Revoked { .. } => AccessError::Revoked,
                    clan::ImportError::Timeout { .. } => AccessError::Timeout,
                    _ => AccessError::Disconnected,
                };
                Err(self.failed.get_or_init(|| a).clone())
            }
        }
    }
}

fn endpoint(nic: &Nic, queue: Option<&EventQueue>) -> Result<Endpoint, SetupError> {
    Ok(nic.endpoint_with(EndpointConfig { queue: queue.cloned(), ..EndpointConfig::default() })?)
}

/// Our side, exported for the peer's NIC only: its memory comes from the pool of the
/// apertures made for that peer (`clan::ExportConfig::for_peer`), so that thousands of
/// connections between two processes share a few memfds and mappings.
fn export_side(ep: &Endpoint, g: Geometry, peer: clan::NicAddr) -> Result<Aperture, SetupError> {
    if !(2..=MAX_RING).contains(&g.cap) || g.post_cap > MAX_RING {
        return Err(SetupError::BadConfig("ring between 2 bytes and 1 GiB, post area at most 1 GiB"));
    }
    Ok(ep.export_with(g.side_len(), clan::ExportConfig::for_peer(peer))?)
}

/// Most bytes of the caller's own data a connect carries to the accepting side, after the
/// geometry (`Stream::peer_data` on the accepting side).
pub const MAX_CONNECT_DATA: usize = 64;

/// The caller's part of a hand-shake's private data (what follows the geometry): empty when
/// the peer gave none.
pub(crate) fn user_data(private: &[u8]) -> &[u8] {
    private.get(32..).unwrap_or(&[])
}

/// Connect from a fresh endpoint of `nic` to the listening endpoint `to`, within `timeout`
/// in all (hand-shake and import of the peer's side).
pub(crate) fn connect(
    nic: &Nic,
    queue: Option<&EventQueue>,
    to: impl clan::ToEndpointAddrs,
    g: Geometry,
    timeout: Duration,
) -> Result<Sides, SetupError> {
    connect_with_data(nic, queue, to, g, timeout, &[])
}

/// [`connect`], with `data` (at most [`MAX_CONNECT_DATA`] bytes) for the accepting side
/// ([`user_data`] of its request's data).
pub(crate) fn connect_with_data(
    nic: &Nic,
    queue: Option<&EventQueue>,
    to: impl clan::ToEndpointAddrs,
    g: Geometry,
    timeout: Duration,
    data: &[u8],
) -> Result<Sides, SetupError> {
    if data.len() > MAX_CONNECT_DATA {
        return Err(SetupError::BadConfig("at most 64 bytes of data travel with a connect"));
    }
    // Each address in turn (a host name may have several), as `std::net` does.
    clan::each_endpoint_addr(to, |a| connect_one(nic, queue, a, g, timeout, data))
}

fn connect_one(
    nic: &Nic,
    queue: Option<&EventQueue>,
    to: EndpointAddr,
    g: Geometry,
    timeout: Duration,
    data: &[u8],
) -> Result<Sides, SetupError> {
    let deadline = Instant::now() + timeout;
    let ep = Arc::new(endpoint(nic, queue)?);
    let mine = export_side(&ep, g, to.nic)?;
    let mut private = g.encode().to_vec();
    private.extend_from_slice(data);
    // The import of the server's side begins as its answer comes in (`connect_importing`).
    let (conn, pending) = ep.connect_importing(to, &mine.descriptor(), &private, Some(timeout))?;
    let pg = Geometry::decode(conn.peer_data(), conn.peer_descriptor().len(), g.base)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let m = match pending.finish(left) {
        Ok(m) => m,
        // The server accepted, then closed its side (or its process went) before we took
        // it: as a reset, not a stale descriptor of ours.
        Err(clan::ImportError::Revoked { .. }) => return Err(ConnectError::PeerGone(conn.peer()).into()),
        Err(clan::ImportError::Unreachable(n)) if n == conn.peer().nic => {
            return Err(ConnectError::PeerGone(conn.peer()).into());
        }
        Err(e) => return Err(e.into()),
    };
    let peer = Arc::new(PeerSide {
        ep: ep.clone(),
        nic: conn.peer_descriptor().nic(),
        timeout,
        map: OnceLock::from(m),
        failed: OnceLock::new(),
        importing: Mutex::new(None),
        across_link: matches!(conn.peer_identity(), clan::PeerIdentity::Remote { .. }),
    });
    Ok(Sides { ep, conn, mine, peer, peer_cap: pg.cap, peer_post_cap: pg.post_cap, peer_slot: pg.slot })
}

/// Accept `req` on a fresh endpoint of `nic`. Never waits for the client: its side is
/// imported when first used ([`PeerSide`]). Fails only for our own reasons (resources), or
/// with [`SetupError::BadPeer`] for a request that is not from a clan-proto peer (refused).
pub(crate) fn accept(
    nic: &Nic,
    queue: Option<&EventQueue>,
    req: ConnectRequest,
    g: Geometry,
    timeout: Duration,
) -> Result<Sides, SetupError> {
    let pg = match Geometry::decode(req.data(), req.descriptor().len(), g.base) {
        Ok(pg) => pg,
        Err(e) => {
            let ep = nic.endpoint()?;
            let _ = req.refuse(&ep);
            return Err(e);
        }
    };
    let ep = Arc::new(endpoint(nic, queue)?);
    let mine = export_side(&ep, g, req.from().nic)?;
    let desc = req.descriptor().clone();
    let conn = req.accept_with_data(&ep, &mine.descriptor(), &g.encode())?;
    let pending = ep.import_begin(&desc);
    let peer = Arc::new(PeerSide {
        ep: ep.clone(),
        nic: desc.nic(),
        timeout,
        map: OnceLock::new(),
        failed: OnceLock::new(),
        importing: Mutex::new(Some(Box::new(ToImport { desc, begun: Some(pending) }))),
        across_link: matches!(conn.peer_identity(), clan::PeerIdentity::Remote { .. }),
    });
    Ok(Sides { ep, conn, mine, peer, peer_cap: pg.cap, peer_post_cap: pg.post_cap, peer_slot: pg.slot })
}

/// Whether an accept's set-up failed for the client's sake (it gave up, died or misbehaved
/// during the hand-shake: its request is dropped and the next one taken, as TCP's accept
/// does) rather than ours (out of memory or descriptors, the endpoint closed).
pub(crate) fn client_failed(e: &SetupError) -> bool {
    matches!(e, SetupError::BadPeer(_) | SetupError::Connect(_) | SetupError::Import(_))
}

/// Take connection requests on `ep` until one is set up by `setup` (those whose client
/// fails are dropped), for at most `timeout`; `None` when none came in time.
pub(crate) fn accept_next<T, E: From<SetupError>>(
    ep: &Endpoint,
    timeout: Option<Duration>,
    mut setup: impl FnMut(ConnectRequest) -> Result<T, SetupError>,
) -> Result<Option<T>, E> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let req = match ep.accept(left) {
            Ok(req) => req,
            Err(ConnectError::NoRequest) => return Ok(None),
            Err(e) => return Err(SetupError::from(e).into()),
        };
        let from = req.from();
        match setup(req) {
            Ok(t) => return Ok(Some(t)),
            Err(e) if client_failed(&e) => tracing::debug!(peer = %from, "refused a connection: {e}"),
            Err(e) => return Err(e.into()),
        }
    }
}

impl From<SetupError> for std::io::Error {
    fn from(e: SetupError) -> std::io::Error {
        use std::io::ErrorKind as K;
        match e {
            SetupError::Connect(c) => c.into(),
            SetupError::Export(x) => x.into(),
            SetupError::Import(x) => x.into(),
            SetupError::Endpoint(x) => x.into(),
            SetupError::Access(x) => x.into(),
            SetupError::BadPeer(_) => std::io::Error::new(K::InvalidData, e),
            SetupError::BadConfig(_) => std::io::Error::new(K::InvalidInput, e),
            SetupError::Address(x) => x,
        }
    }
}
