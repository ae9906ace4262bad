//! Connection setup shared by the protocols: each party exports one *side* aperture, says its
//! geometry in the side's header, and the two exchange descriptors with clan's connect /
//! accept handshake (out-of-band messages).

use std::sync::Arc;
use std::time::Duration;

use clan::{
    Aperture, ConnectError, ConnectRequest, Connection, Endpoint, EndpointAddr, EndpointConfig, EventQueue, Mapping,
    Nic,
};

use crate::pipe;

/// Where a side says how big its ring and post area are (written once by its owner).
const SIDE_CAP: u64 = 192;
const SIDE_POST_CAP: u64 = 200;
const SIDE_MAGIC: u64 = 208;
/// Slot size of a message queue's ring (0: a byte ring).
const SIDE_SLOT: u64 = 216;
const MAGIC: u64 = 0xC1A4_51DE_0000_0001;

/// Most bytes a ring or post area may have.
pub const MAX_RING: u64 = 1 << 30;

/// Why setting up a connection failed.
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
}

/// Both ends of a connection, once set up.
#[derive(Debug)]
pub(crate) struct Sides {
    pub ep: Endpoint,
    pub conn: Connection,
    pub mine: Arc<Aperture>,
    pub peer: Mapping,
    /// The peer's ring and post area (what our writes go into).
    pub peer_cap: u64,
    pub peer_post_cap: u64,
    /// The peer's slot size (message queues; 0 for byte rings).
    pub peer_slot: u64,
}

/// The geometry of a side.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub cap: u64,
    pub post_cap: u64,
    pub slot: u64,
}

impl Geometry {
    pub fn bytes(cap: u64, post_cap: u64) -> Geometry {
        Geometry { cap, post_cap, slot: 0 }
    }
}

fn endpoint(nic: &Nic, queue: Option<&EventQueue>) -> Result<Endpoint, SetupError> {
    Ok(nic.endpoint_with(EndpointConfig { queue: queue.cloned(), ..EndpointConfig::default() })?)
}

fn export_side(ep: &Endpoint, g: Geometry) -> Result<Arc<Aperture>, SetupError> {
    if !(2..=MAX_RING).contains(&g.cap) || g.post_cap > MAX_RING {
        return Err(SetupError::BadConfig("ring between 2 bytes and 1 GiB, post area at most 1 GiB"));
    }
    let ap = ep.export(pipe::side_len(g.cap, g.post_cap))?;
    ap.store_u64(SIDE_CAP, g.cap)?;
    ap.store_u64(SIDE_POST_CAP, g.post_cap)?;
    ap.store_u64(SIDE_SLOT, g.slot)?;
    ap.store_u64(SIDE_MAGIC, MAGIC)?;
    Ok(Arc::new(ap))
}

fn import_side(ep: &Endpoint, conn: &Connection) -> Result<(Mapping, u64, u64, u64), SetupError> {
    let m = ep.import(conn.peer_descriptor())?;
    // One read of the peer's memory, at setup only: its geometry.
    if m.load_u64(SIDE_MAGIC)? != MAGIC {
        return Err(SetupError::BadPeer("no magic"));
    }
    let cap = m.load_u64(SIDE_CAP)?;
    let post_cap = m.load_u64(SIDE_POST_CAP)?;
    let slot = m.load_u64(SIDE_SLOT)?;
    if !(2..=MAX_RING).contains(&cap) || post_cap > MAX_RING || pipe::side_len(cap, post_cap) > m.len() {
        return Err(SetupError::BadPeer("sizes do not fit its aperture"));
    }
    if slot != 0 && (slot > cap || cap % slot != 0) {
        return Err(SetupError::BadPeer("its slots do not divide its ring"));
    }
    Ok((m, cap, post_cap, slot))
}

/// Connect from a fresh endpoint of `nic` to the listening endpoint `to`.
pub(crate) fn connect(
    nic: &Nic,
    queue: Option<&EventQueue>,
    to: EndpointAddr,
    g: Geometry,
    timeout: Duration,
) -> Result<Sides, SetupError> {
    let ep = endpoint(nic, queue)?;
    let mine = export_side(&ep, g)?;
    let conn = ep.connect(to, &mine.descriptor(), Some(timeout))?;
    let (peer, peer_cap, peer_post_cap, peer_slot) = import_side(&ep, &conn)?;
    Ok(Sides { ep, conn, mine, peer, peer_cap, peer_post_cap, peer_slot })
}

/// Accept `req` on a fresh endpoint of `nic`.
pub(crate) fn accept(
    nic: &Nic,
    queue: Option<&EventQueue>,
    req: ConnectRequest,
    g: Geometry,
) -> Result<Sides, SetupError> {
    let ep = endpoint(nic, queue)?;
    let mine = export_side(&ep, g)?;
    let conn = req.accept(&ep, &mine.descriptor())?;
    let (peer, peer_cap, peer_post_cap, peer_slot) = import_side(&ep, &conn)?;
    Ok(Sides { ep, conn, mine, peer, peer_cap, peer_post_cap, peer_slot })
}
