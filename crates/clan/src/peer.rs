//! The client side of the control channel to another NIC of this host, and importing
//! descriptors exported there.
//!
//! One connection per pair of NICs and direction, made on first use and cached. Requests are
//! synchronous (one in flight per connection), bounded by [`crate::NicConfig::request_timeout`].
//! Everything the exporter sends is checked before it is used: the geometry it announces
//! against the descriptor and the memfds' real (sealed) sizes.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clan_shm::cam::CamLayout;
use clan_shm::eq::{CamMap, EqLayout, EqMap, EqParams};
use clan_shm::eventfd::EventFd;
use clan_shm::memfd::Memfd;
use clan_shm::ring::Producer;
use clan_shm::segment::{self, Access as SegAccess, Segment};
use clan_shm::seqpacket::SeqPacket;

use crate::addr::NicAddr;
use crate::ctl::{self, Code, ImportGrant, Reply, Request};
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
    Unreachable,
    Timeout(Duration),
    Protocol(String),
    Io(std::io::Error),
}

/// A connection to another NIC of this host.
#[derive(Debug)]
pub(crate) struct PeerConn {
    sock: Mutex<SeqPacket>,
    broken: AtomicBool,
    timeout: Duration,
    /// Event queues of that NIC we produce into, by queue id.
    eqs: Mutex<HashMap<u32, Arc<EqPort>>>,
    /// Held for a whole import: the exporter sends a queue's descriptors with the first
    /// import from it only, so that import must have mapped them before the next one looks.
    importing: Mutex<()>,
}

impl PeerConn {
    pub fn connect(local: NicAddr, addr: NicAddr, timeout: Duration) -> Result<PeerConn, PeerError> {
        let sock = SeqPacket::connect_abstract(&addr.abstract_name()).map_err(|e| {
            match rustix::io::Errno::from_io_error(&e) {
                Some(rustix::io::Errno::CONNREFUSED) | Some(rustix::io::Errno::NOENT) => PeerError::Unreachable,
                _ => PeerError::Io(e),
            }
        })?;
        sock.set_timeouts(timeout).map_err(PeerError::Io)?;
        let conn = PeerConn {
            sock: Mutex::new(sock),
            broken: AtomicBool::new(false),
            timeout,
            eqs: Default::default(),
            importing: Mutex::new(()),
        };
        match conn.request(&Request::Hello { nic: local, pid: std::process::id() })? {
            (Reply::HelloOk { nic }, _) if nic == addr => Ok(conn),
            (other, _) => Err(PeerError::Protocol(format!("unexpected answer to hello: {other:?}"))),
        }
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn fail(&self, e: std::io::Error) -> PeerError {
        self.broken.store(true, Ordering::Release);
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => PeerError::Timeout(self.timeout),
            _ => PeerError::Io(e),
        }
    }

    /// Send a request and wait for its reply.
    pub fn request(&self, req: &Request) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        let sock = lock(&self.sock);
        if self.is_broken() {
            return Err(PeerError::Protocol("connection previously failed".into()));
        }
        sock.send(&req.encode(), &[]).map_err(|e| self.fail(e))?;
        let mut buf = [0u8; ctl::MAX_MSG];
        let got = sock.recv(&mut buf).map_err(|e| self.fail(e))?;
        if got.len == 0 && got.fds.is_empty() {
            self.broken.store(true, Ordering::Release);
            return Err(PeerError::Protocol("connection closed by the peer".into()));
        }
        if got.truncated {
            self.broken.store(true, Ordering::Release);
            return Err(PeerError::Protocol("reply or its descriptors truncated (out of file descriptors?)".into()));
        }
        let reply = Reply::decode(&buf[..got.len]).map_err(|_| {
            self.broken.store(true, Ordering::Release);
            PeerError::Protocol("malformed reply".into())
        })?;
        Ok((reply, got.fds))
    }

    /// Send a message that has no reply.
    pub fn notify(&self, req: &Request) {
        let sock = lock(&self.sock);
        if !self.is_broken() && sock.send(&req.encode(), &[]).is_err() {
            self.broken.store(true, Ordering::Release);
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
        self.peer.notify(&Request::Unimport { import_id: self.import_id });
    }
}

fn protocol(peer: NicAddr, detail: impl Into<String>) -> ImportError {
    ImportError::Protocol { peer, detail: detail.into() }
}

pub(crate) fn peer_error(peer: NicAddr, e: PeerError) -> ImportError {
    match e {
        PeerError::Unreachable => ImportError::Unreachable(peer),
        PeerError::Timeout(timeout) => ImportError::Timeout { peer, timeout },
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

/// Import `desc`, exported by another NIC of this host, for endpoint `ep`.
pub(crate) fn import_remote(ep: &Arc<EndpointInner>, desc: &Descriptor) -> Result<Mapping, ImportError> {
    let nic = &ep.nic;
    let peer = nic.peer(desc.nic()).map_err(|e| peer_error(desc.nic(), e))?;
    let _one_at_a_time = lock(&peer.importing);
    let req = Request::Import { importer: ep.addr, want_eq: false, desc: desc.to_bytes() };
    let (reply, mut fds) = peer.request(&req).map_err(|e| peer_error(desc.nic(), e))?;
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
        let eventfd = fds.pop().expect("checked count");
        let eq_fd = fds.pop().expect("checked count");
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
    if lock(&port.producer).ring() != g.ring as usize {
        return Err(protocol(desc.nic(), "producer ring changed"));
    }
    let ap_fd = fds.pop().expect("checked count");
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
    let window = Window { data: Arc::new(data), data_base: start, cam: Arc::new(cam), tag: g.tag, live: g.live, port };
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
