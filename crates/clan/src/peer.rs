//! The client side of the control channel to another NIC of this host, and importing
//! descriptors exported there.
//!
//! One connection per pair of NICs, made by the first request and kept. Requests are made by
//! the calling (application) thread, one at a time per connection, each bounded by the
//! caller's own deadline: waiting for the connection to be free, connecting, sending and
//! receiving all stop at that deadline, and no lock shared with other peers is held
//! meanwhile. Replies carry their request's id, so a reply that comes after its requester
//! gave up is recognised and dropped (a late import grant is released at once). The engine
//! thread never makes requests here: what it sends to other NICs goes through its own
//! non-blocking channel (`crate::engine`).
//!
//! Everything the exporter sends is checked before it is used: the geometry it announces
//! against the descriptor and the memfds' real (sealed) sizes.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clan_shm::cam::CamLayout;
use clan_shm::eq::{CamMap, EqLayout, EqMap, EqParams};
use clan_shm::eventfd::EventFd;
use clan_shm::memfd::Memfd;
use clan_shm::ring::Producer;
use clan_shm::segment::{self, Access as SegAccess, Segment};
use clan_shm::seqpacket::SeqPacket;
use clan_wire::control::{Code, ImportGrant, MAX_MSG, Reply, Request};

use crate::addr::NicAddr;
use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::EndpointInner;
use crate::error::{Denial, ImportError};
use crate::event_queue::EqPort;
use crate::lock;
use crate::mapping::{Keep, Mapping};
use crate::window::Window;

/// Why a request failed.
#[derive(Debug)]
pub(crate) enum PeerError {
    /// No NIC listens at that address on this host.
    Unreachable,
    /// The caller's deadline passed.
    Timeout,
    /// The peer answered nonsense, or the connection broke.
    Protocol(String),
    /// A system call failed.
    Io(std::io::Error),
}

/// A gate that lets one caller at a time through, and never keeps a caller past its
/// deadline (a `Mutex` cannot be waited for with a time limit).
#[derive(Debug, Default)]
struct Gate {
    busy: Mutex<bool>,
    cv: Condvar,
}

struct GateGuard<'a>(&'a Gate);

impl Gate {
    fn enter(&self, deadline: Instant) -> Option<GateGuard<'_>> {
        let mut busy = lock(&self.busy);
        while *busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            busy = self.cv.wait_timeout(busy, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        *busy = true;
        Some(GateGuard(self))
    }
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.cv.notify_one();
    }
}

/// A connection to another NIC of this host.
pub(crate) struct PeerConn {
    pub addr: NicAddr,
    local: NicAddr,
    gate: Gate,
    /// The socket, once connected (non-blocking). Replaced only by the gate's holder.
    sock: Mutex<Option<Arc<SeqPacket>>>,
    broken: AtomicBool,
    next_id: AtomicU32,
    /// False once the peer NIC is known to be gone (its process died or its NIC closed):
    /// every mapping made through this connection fails from then on.
    pub alive: Arc<AtomicBool>,
    /// Event queues of that NIC we produce into, by queue id.
    pub eqs: Mutex<HashMap<u32, Arc<EqPort>>>,
    /// Told the engine to watch this peer's liveness.
    watched: AtomicBool,
}

impl std::fmt::Debug for PeerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerConn").field("addr", &self.addr).field("broken", &self.is_broken()).finish_non_exhaustive()
    }
}

fn poll_one(sock: &SeqPacket, flags: rustix::event::PollFlags, deadline: Instant) -> Result<(), PeerError> {
    use rustix::event::{PollFd, poll};
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(PeerError::Timeout);
        }
        let mut fds = [PollFd::new(sock, flags)];
        let ts = rustix::time::Timespec::try_from(left).unwrap_or(rustix::time::Timespec { tv_sec: 1, tv_nsec: 0 });
        match poll(&mut fds, Some(&ts)) {
            Ok(n) if n > 0 => return Ok(()),
            Ok(_) | Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(PeerError::Io(e.into())),
        }
    }
}

impl PeerConn {
    /// A connection to `addr`, made (and said hello on) by its first request.
    pub fn new(local: NicAddr, addr: NicAddr) -> PeerConn {
        PeerConn {
            addr,
            local,
            gate: Gate::default(),
            sock: Mutex::new(None),
            broken: AtomicBool::new(false),
            next_id: AtomicU32::new(1),
            alive: Arc::new(AtomicBool::new(true)),
            eqs: Mutex::new(HashMap::new()),
            watched: AtomicBool::new(false),
        }
    }

    /// Whether it can no longer be used (a fresh connection must be made).
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// The peer is gone: fail what depends on it.
    pub fn mark_gone(&self) {
        self.broken.store(true, Ordering::Release);
        // SYNC POINT: pairs with the Acquire load in `Window::check_live`.
        self.alive.store(false, Ordering::Release);
    }

    /// The connection is unusable: close it. The exporter then releases everything it
    /// granted through it (imports, producer rings), so the mappings made through it fail
    /// from now on.
    fn break_with(&self, why: impl Into<String>) -> PeerError {
        self.mark_gone();
        *lock(&self.sock) = None;
        PeerError::Protocol(why.into())
    }

    /// Whether the engine was asked to watch this peer (the first caller gets `false`).
    pub fn take_watch(&self) -> bool {
        self.watched.swap(true, Ordering::AcqRel)
    }

    /// One request at a time through this connection, until `deadline`.
    pub fn session(&self, deadline: Instant) -> Result<PeerSession<'_>, PeerError> {
        let g = self.gate.enter(deadline).ok_or(PeerError::Timeout)?;
        if self.is_broken() {
            return Err(PeerError::Protocol("the connection to the peer NIC broke".into()));
        }
        let s = PeerSession { conn: self, _gate: g };
        if lock(&self.sock).is_none() {
            s.connect(deadline)?;
        }
        Ok(s)
    }

    /// Send a one-way message at once if the connection is up and its socket has room:
    /// whether it went (one message, so it never interleaves with a request in progress).
    pub fn try_send_oneway(&self, req: &Request) -> bool {
        let Some(sock) = lock(&self.sock).clone() else { return false };
        !self.is_broken() && !req.wants_reply() && sock.send(&req.encode(0), &[]).is_ok()
    }

    /// Send a message that has no reply, without waiting (dropped if the socket is full).
    pub fn notify(&self, req: &Request) {
        let Some(sock) = lock(&self.sock).clone() else { return };
        if !self.is_broken() {
            let _ = sock.send(&req.encode(0), &[]);
        }
    }

    fn id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed).max(1)
    }
}

/// The holder of a connection's gate.
pub(crate) struct PeerSession<'a> {
    conn: &'a PeerConn,
    _gate: GateGuard<'a>,
}

impl PeerSession<'_> {
    fn connect(&self, deadline: Instant) -> Result<(), PeerError> {
        let c = self.conn;
        let name = c.addr.abstract_name();
        loop {
            let sock = loop {
                match SeqPacket::connect_abstract_nonblocking(&name) {
                    Ok(s) => break s,
                    Err(e) => match rustix::io::Errno::from_io_error(&e) {
                        Some(rustix::io::Errno::CONNREFUSED) | Some(rustix::io::Errno::NOENT) => {
                            return Err(PeerError::Unreachable);
                        }
                        Some(rustix::io::Errno::AGAIN) => {
                            // The listener's backlog is full: the peer is busy (or flooded).
                            if Instant::now() >= deadline {
                                return Err(PeerError::Timeout);
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        _ => return Err(PeerError::Io(e)),
                    },
                }
            };
            *lock(&c.sock) = Some(Arc::new(sock));
            let hello = Request::Hello { nic: c.local.socket_addr(), pid: std::process::id() };
            match self.request(&hello, deadline) {
                Ok((Reply::HelloOk { nic }, _)) if NicAddr::from(nic) == c.addr => return Ok(()),
                Ok((Reply::Err { code: Code::Unverified | Code::TooMany, detail }, _)) => {
                    // Refused for now (it could not verify us in time: its listener's backlog
                    // is flooded; or we hold too many connections): again, within our time.
                    *lock(&c.sock) = None;
                    if Instant::now() + Duration::from_millis(5) >= deadline {
                        return Err(PeerError::Protocol(format!("hello refused: {detail}")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok((Reply::Err { code, detail }, _)) => {
                    return Err(c.break_with(format!("hello refused: {code:?} {detail}")));
                }
                Ok((other, _)) => return Err(c.break_with(format!("unexpected answer to hello: {other:?}"))),
                Err(e) => {
                    *lock(&c.sock) = None;
                    return Err(e);
                }
            }
        }
    }

    /// Send a request and wait for its reply until `deadline`.
    pub fn request(&self, req: &Request, deadline: Instant) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        let mut r = self.request_many(std::slice::from_ref(req), deadline)?;
        r.pop().ok_or_else(|| PeerError::Protocol("no reply".into()))
    }

    /// Send several requests at once and wait for all their replies (in order) until
    /// `deadline`: one round trip for the lot.
    pub fn request_many(&self, reqs: &[Request], deadline: Instant) -> Result<Vec<(Reply, Vec<OwnedFd>)>, PeerError> {
        let c = self.conn;
        let sock = lock(&c.sock).clone().ok_or_else(|| PeerError::Protocol("not connected".into()))?;
        let mut ids = Vec::with_capacity(reqs.len());
        for req in reqs {
            let id = c.id();
            ids.push(id);
            let bytes = req.encode(id);
            loop {
                match sock.send(&bytes, &[]) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        poll_one(&sock, rustix::event::PollFlags::OUT, deadline)?;
                    }
                    Err(e) => return Err(c.break_with(format!("sending to {}: {e}", c.addr))),
                }
            }
        }
        let mut out = Vec::with_capacity(reqs.len());
        for id in ids {
            out.push(self.reply(&sock, id, deadline)?);
        }
        Ok(out)
    }

    fn reply(&self, sock: &SeqPacket, id: u32, deadline: Instant) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        let c = self.conn;
        let mut buf = [0u8; MAX_MSG];
        loop {
            let got = match sock.recv(&mut buf) {
                Ok(g) => g,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    poll_one(sock, rustix::event::PollFlags::IN, deadline)?;
                    continue;
                }
                Err(e) => return Err(c.break_with(format!("receiving from {}: {e}", c.addr))),
            };
            if got.len == 0 && got.fds.is_empty() {
                return Err(c.break_with(format!("{} closed the connection", c.addr)));
            }
            if got.truncated {
                return Err(c.break_with("reply or its descriptors truncated (out of file descriptors?)"));
            }
            let (rid, reply) =
                Reply::decode(&buf[..got.len]).map_err(|e| c.break_with(format!("malformed reply: {e}")))?;
            if rid != id {
                // The answer to a request whose caller gave up: a grant in it is released.
                if let Reply::ImportOk(g) = reply {
                    let _ = sock.send(&Request::Unimport { import_id: g.import_id }.encode(0), &[]);
                }
                continue;
            }
            return Ok((reply, got.fds));
        }
    }
}

/// Releases an import when the last clone of its mapping is gone (after the unmapping).
#[derive(Debug)]
pub(crate) struct ImportGuard {
    peer: Arc<PeerConn>,
    import_id: u64,
}

impl Drop for ImportGuard {
    fn drop(&mut self) {
        tracing::debug!(exporter = %self.peer.addr, import = self.import_id, "unimported");
        self.peer.notify(&Request::Unimport { import_id: self.import_id });
    }
}

fn protocol(peer: NicAddr, detail: impl Into<String>) -> ImportError {
    ImportError::Protocol { peer, detail: detail.into() }
}

pub(crate) fn peer_error(peer: NicAddr, e: PeerError, timeout: Duration) -> ImportError {
    match e {
        PeerError::Unreachable => ImportError::Unreachable(peer),
        PeerError::Timeout => ImportError::Timeout { peer, timeout },
        PeerError::Protocol(d) => ImportError::Protocol { peer, detail: d },
        PeerError::Io(source) => ImportError::Io { context: "talking to the exporting NIC", source },
    }
}

fn fd_err(e: std::io::Error, context: &'static str) -> ImportError {
    if e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error()) {
        ImportError::FdLimit
    } else {
        ImportError::Io { context, source: e }
    }
}

/// Import `desc`, exported by another NIC of this host, for endpoint `ep`, by `deadline`.
pub(crate) fn import_remote(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    deadline: Instant,
    timeout: Duration,
) -> Result<Mapping, ImportError> {
    let nic = &ep.nic;
    let peer = nic.peer(desc.nic());
    let session = peer.session(deadline).map_err(|e| peer_error(desc.nic(), e, timeout))?;
    // The engine watches the exporter: when its process dies, our mappings of it fail.
    nic.watch(&peer);
    let req = Request::Import { importer: ep.addr.into(), want_eq: false, desc: desc.to_bytes() };
    let (reply, mut fds) = session.request(&req, deadline).map_err(|e| peer_error(desc.nic(), e, timeout))?;
    let g = match reply {
        Reply::ImportOk(g) => g,
        Reply::Err { code, detail } => {
            return Err(match code {
                Code::Revoked => ImportError::Revoked { aperture: desc.aperture(), generation: desc.generation() },
                Code::BadKey => ImportError::BadKey,
                Code::DeniedUid => ImportError::Denied(Denial::Uid),
                Code::DeniedPid => ImportError::Denied(Denial::Pid),
                Code::DeniedEndpoint => ImportError::Denied(Denial::Endpoint),
                Code::TooManyProducers => ImportError::TooManyProducers,
                _ => protocol(desc.nic(), format!("{code:?}: {detail}")),
            });
        }
        other => return Err(protocol(desc.nic(), format!("unexpected reply {other:?}"))),
    };
    // From here on the exporter counts the import: release it on every error path.
    let guard = ImportGuard { peer: peer.clone(), import_id: g.import_id };
    let want_fds = if g.eq_fds { 3 } else { 1 };
    if fds.len() != want_fds {
        return Err(protocol(desc.nic(), format!("{} descriptors received, {want_fds} expected", fds.len())));
    }
    check_grant(desc, &g).map_err(|d| protocol(desc.nic(), d))?;
    let port = if g.eq_fds {
        let eventfd = fds.pop().ok_or_else(|| protocol(desc.nic(), "descriptor missing"))?;
        let eq_fd = fds.pop().ok_or_else(|| protocol(desc.nic(), "descriptor missing"))?;
        let port = Arc::new(map_eq(&g, eq_fd, eventfd).map_err(|e| match e {
            MapErr::Io(e, ctx) => fd_err(e, ctx),
            MapErr::Bad(d) => protocol(desc.nic(), d),
        })?);
        lock(&peer.eqs).insert(g.eq_id, port.clone());
        port
    } else {
        let eqs = lock(&peer.eqs);
        eqs.get(&g.eq_id).cloned().ok_or_else(|| protocol(desc.nic(), "event queue descriptors missing"))?
    };
    drop(session);
    if lock(&port.producer).ring() != g.ring as usize {
        return Err(protocol(desc.nic(), "producer ring changed"));
    }
    let ap_fd = fds.pop().ok_or_else(|| protocol(desc.nic(), "descriptor missing"))?;
    let index_len = segment::page_align(CamLayout::new(g.cap).size) as u64;
    let memfd =
        Memfd::adopt(ap_fd, g.cap + index_len).map_err(|e| protocol(desc.nic(), format!("aperture memfd: {e}")))?;
    let page = segment::page_size() as u64;
    let start = desc.offset() / page * page;
    let end = (desc.offset() + desc.len()).div_ceil(page) * page;
    let access = if g.read_only { SegAccess::ReadOnly } else { SegAccess::ReadWrite };
    let data =
        Segment::map(&memfd, start, (end - start) as usize, access).map_err(|e| fd_err(e, "mapping the aperture"))?;
    let cam_seg = Segment::map(&memfd, g.cap, index_len as usize, SegAccess::ReadOnly)
        .map_err(|e| fd_err(e, "mapping the aperture index"))?;
    let cam = CamMap::new(Arc::new(cam_seg), 0, g.cap).map_err(|e| protocol(desc.nic(), e.to_string()))?;
    drop(memfd); // the mappings keep the memory; the descriptor is no longer needed
    let window = Window {
        data: Arc::new(data),
        data_base: start,
        cam: Arc::new(cam),
        tag: g.tag,
        live: g.live,
        port,
        peer_alive: Some(peer.alive.clone()),
    };
    tracing::debug!(exporter = %desc.nic(), importer = %ep.addr, aperture = desc.aperture(), "imported from a NIC of this host");
    Ok(Mapping::new(ep, desc, crate::mapping::Via::Local(window), Keep::Remote(guard)))
}

fn check_grant(desc: &Descriptor, g: &ImportGrant) -> Result<(), String> {
    let page = segment::page_size() as u64;
    if g.aperture_len != desc.aperture_len() {
        return Err("aperture length differs from the descriptor's".into());
    }
    if g.cap % page != 0 || g.cap < g.aperture_len || g.cap > crate::aperture::MAX_APERTURE {
        return Err("bad aperture capacity".into());
    }
    if g.read_only == desc.rights().contains(Rights::WRITE) {
        return Err("granted access does not match the descriptor's rights".into());
    }
    let params = EqParams { nrings: g.nrings, ring_cap: g.ring_cap, trip_cap: g.trip_cap, tripset_cap: g.tripset_cap };
    if !params.is_valid() || g.ring == 0 || g.ring >= g.nrings {
        return Err("bad event queue geometry".into());
    }
    Ok(())
}

enum MapErr {
    Io(std::io::Error, &'static str),
    Bad(String),
}

fn map_eq(g: &ImportGrant, eq_fd: OwnedFd, eventfd: OwnedFd) -> Result<EqPort, MapErr> {
    let params = EqParams { nrings: g.nrings, ring_cap: g.ring_cap, trip_cap: g.trip_cap, tripset_cap: g.tripset_cap };
    let layout = EqLayout::new(params);
    let memfd = Memfd::adopt(eq_fd, layout.size as u64).map_err(|e| MapErr::Bad(format!("event queue memfd: {e}")))?;
    let seg = Segment::map(memfd.as_fd(), 0, layout.size, SegAccess::ReadWrite)
        .map_err(|e| MapErr::Io(e, "mapping the event queue"))?;
    let map = EqMap::new(Arc::new(seg), layout).map_err(|e| MapErr::Bad(e.to_string()))?;
    // Resume after whatever this process posted on the ring before (the ring is ours for the
    // life of the connection); a fresh ring reads 0.
    let head = map.view().ring_headers[g.ring as usize].head.load(Ordering::Acquire);
    Ok(EqPort {
        map,
        producer: Mutex::new(Producer::resume(g.ring as usize, head)),
        eventfd: Arc::new(EventFd::from_owned(eventfd)),
    })
}
