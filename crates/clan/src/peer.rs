//! The client side of the control channel to another NIC of this host, and importing
//! descriptors exported there.
//!
//! One connection per pair of NICs, made (and said hello on) by the first request and kept.
//! Requests are made by the calling (application) threads, several at once if they like:
//! each carries an id, its reply carries the same, and whichever waiter reads the socket
//! hands the others their replies. Each waits at most until its own deadline; connecting,
//! sending and receiving all stop there, and no lock shared with other peers is held
//! meanwhile. A reply that comes after its requester gave up is recognised and dropped (a
//! late import grant is released as soon as it is read: by the next request on that
//! connection, or with the connection). The engine thread never makes requests here:
//! what it sends to other NICs goes through its own non-blocking channel (`crate::engine`).
//!
//! Everything the exporter sends is checked before it is used: the geometry it announces
//! against the descriptor and the memfds' real (sealed) sizes.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clan_shm::eq::CamMap;
use clan_shm::memfd::Memfd;
use clan_shm::segment::{self, Access as SegAccess, Segment};
use clan_shm::seqpacket::SeqPacket;
use clan_wire::control::{Code, ImportGrant, MAX_MSG, Reply, Request};

use crate::addr::NicAddr;
use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::EndpointInner;
use crate::error::ImportError;
use crate::lazy::Lazy;
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
    /// The peer closed or reset the connection (it went away, or is closing).
    Closed(String),
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
        let drive = crate::progress::Drive::Others;
        crate::progress::wait_locked(
            &self.busy,
            &self.cv,
            crate::progress::Deadline::at(deadline),
            None,
            drive,
            |busy| (!**busy).then(|| **busy = true),
        )?;
        Some(GateGuard(self))
    }
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.cv.notify_one();
    }
}

/// Replies waited for, and those that came.
#[derive(Default)]
struct Mail {
    waiting: HashSet<u32>,
    arrived: HashMap<u32, (Reply, Vec<OwnedFd>)>,
    /// A waiter is reading the socket (the others sleep on `cv`).
    reading: bool,
}

/// One connected socket and its mailbox.
struct Channel {
    sock: SeqPacket,
    mail: Mutex<Mail>,
    cv: Condvar,
}

/// A request sent whose reply has not been collected ([`PeerConn::finish`]).
pub(crate) struct Sent {
    chan: Arc<Channel>,
    id: u32,
}

/// A connection to another NIC of this host.
pub(crate) struct PeerConn {
    pub addr: NicAddr,
    local: NicAddr,
    /// Connecting and saying hello, one caller at a time.
    connecting: Gate,
    chan: Mutex<Option<Arc<Channel>>>,
    broken: AtomicBool,
    next_id: AtomicU32,
    /// False once the peer NIC is known to be gone (its process died or its NIC closed):
    /// every mapping made through this connection fails from then on.
    pub alive: Arc<AtomicBool>,
    /// Told the engine to watch this peer's liveness.
    watched: AtomicBool,
    /// Messages that may wait for the next one sent here, or the NIC's timer
    /// (`crate::lazy`), encoded; and how many (read without the lock).
    queue: Mutex<Vec<Vec<u8>>>,
    queued: AtomicUsize,
    lazy: Arc<Lazy>,
}

impl Drop for PeerConn {
    fn drop(&mut self) {
        // (what is still queued goes unsent: the connection closes with it)
        self.lazy.gone(self.queue.get_mut().map_or(0, |q| q.len()));
    }
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
    pub fn new(local: NicAddr, addr: NicAddr, lazy: Arc<Lazy>) -> PeerConn {
        PeerConn {
            queue: Mutex::new(Vec::new()),
            queued: AtomicUsize::new(0),
            lazy,
            addr,
            local,
            connecting: Gate::default(),
            chan: Mutex::new(None),
            broken: AtomicBool::new(false),
            next_id: AtomicU32::new(1),
            alive: Arc::new(AtomicBool::new(true)),
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
        if let Some(c) = lock(&self.chan).as_ref() {
            let _m = lock(&c.mail);
            c.cv.notify_all();
        }
    }

    /// The connection is unusable: close it. The exporter then releases everything it
    /// granted through it (imports, producer rings), so the mappings made through it fail
    /// from now on.
    fn break_with(&self, why: impl Into<String>) -> PeerError {
        self.mark_gone();
        *lock(&self.chan) = None;
        PeerError::Protocol(why.into())
    }

    /// [`Peer::break_with`] for a connection the peer closed or reset.
    fn closed_with(&self, why: String) -> PeerError {
        match self.break_with(why) {
            PeerError::Protocol(d) => PeerError::Closed(d),
            other => other,
        }
    }

    /// Whether the engine was asked to watch this peer (the first caller gets `false`).
    pub fn take_watch(&self) -> bool {
        self.watched.swap(true, Ordering::AcqRel)
    }

    fn id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed).max(1)
    }

    /// The connected channel, if there is one (never waits).
    fn connected(&self) -> Option<Arc<Channel>> {
        if self.is_broken() { None } else { lock(&self.chan).clone() }
    }

    /// The connected channel, connecting (and saying hello) first if need be, by `deadline`.
    fn channel(&self, deadline: Instant) -> Result<Arc<Channel>, PeerError> {
        if self.is_broken() {
            return Err(PeerError::Protocol("the connection to the peer NIC broke".into()));
        }
        if let Some(c) = self.connected() {
            return Ok(c);
        }
        let _g = self.connecting.enter(deadline).ok_or(PeerError::Timeout)?;
        if let Some(c) = self.connected() {
            return Ok(c);
        }
        if self.is_broken() {
            return Err(PeerError::Protocol("the connection to the peer NIC broke".into()));
        }
        let name = self.addr.abstract_name();
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
            let chan = Arc::new(Channel { sock, mail: Mutex::new(Mail::default()), cv: Condvar::new() });
            let hello = Request::Hello { nic: self.local.socket_addr(), pid: std::process::id() };
            let r = self.send(&chan, &hello, deadline).and_then(|s| self.finish(s, deadline));
            match r {
                Ok((Reply::HelloOk { nic }, _)) if NicAddr::from(nic) == self.addr => {
                    *lock(&self.chan) = Some(chan.clone());
                    return Ok(chan);
                }
                Ok((Reply::Err { code: Code::Unverified | Code::TooMany, detail }, _)) => {
                    // Refused for now (it could not verify us in time: its listener's backlog
                    // is flooded; or we hold too many connections): again, within our time.
                    if Instant::now() + Duration::from_millis(5) >= deadline {
                        return Err(PeerError::Protocol(format!("hello refused: {detail}")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok((Reply::Err { code, detail }, _)) => {
                    return Err(self.break_with(format!("hello refused: {code:?} {detail}")));
                }
                Ok((other, _)) => return Err(self.break_with(format!("unexpected answer to hello: {other:?}"))),
                // Its listener took our connection and the NIC then closed it unanswered: it is
                // going away (or already gone). Again, within our time: once its listener is
                // gone, the connect says so (`Unreachable`).
                Err(PeerError::Closed(detail)) => {
                    if Instant::now() + Duration::from_millis(5) >= deadline {
                        return Err(PeerError::Closed(detail));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn send(&self, chan: &Arc<Channel>, req: &Request, deadline: Instant) -> Result<Sent, PeerError> {
        self.flush_queued();
        let id = self.id();
        // Registered first: a reply faster than this thread is kept for it.
        lock(&chan.mail).waiting.insert(id);
        let bytes = req.encode(id);
        loop {
            match chan.sock.send(&bytes, &[]) {
                Ok(()) => return Ok(Sent { chan: chan.clone(), id }),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Err(e) = poll_one(&chan.sock, rustix::event::PollFlags::OUT, deadline) {
                        lock(&chan.mail).waiting.remove(&id);
                        return Err(e);
                    }
                }
                Err(e) => {
                    lock(&chan.mail).waiting.remove(&id);
                    return Err(self.closed_with(format!("sending to {}: {e}", self.addr)));
                }
            }
        }
    }

    /// Send `req` now (connecting first if need be, by `deadline`); collect the reply with
    /// [`PeerConn::finish`].
    pub fn begin(&self, req: &Request, deadline: Instant) -> Result<Sent, PeerError> {
        let chan = self.channel(deadline)?;
        self.send(&chan, req, deadline)
    }

    /// Send `req` only if that costs no wait at all (connected, room in the socket).
    pub fn try_begin(&self, req: &Request) -> Option<Sent> {
        self.flush_queued();
        let chan = self.connected()?;
        let id = self.id();
        lock(&chan.mail).waiting.insert(id);
        match chan.sock.send(&req.encode(id), &[]) {
            Ok(()) => Some(Sent { chan, id }),
            Err(_) => {
                lock(&chan.mail).waiting.remove(&id);
                None
            }
        }
    }

    /// The reply to `sent`, waiting until `deadline` at most (reading the socket for every
    /// waiter while no one else does).
    pub fn finish(&self, sent: Sent, deadline: Instant) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        let Sent { chan, id } = sent;
        let mut m = lock(&chan.mail);
        loop {
            if let Some(r) = m.arrived.remove(&id) {
                m.waiting.remove(&id);
                return Ok(r);
            }
            let give_up = |m: &mut Mail, e: PeerError| {
                m.waiting.remove(&id);
                Err(e)
            };
            if self.is_broken() {
                return give_up(&mut m, PeerError::Protocol(format!("the connection to {} broke", self.addr)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return give_up(&mut m, PeerError::Timeout);
            }
            if m.reading {
                m = chan.cv.wait_timeout(m, left).unwrap_or_else(|e| e.into_inner()).0;
                continue;
            }
            m.reading = true;
            drop(m);
            let r = self.read(&chan, deadline);
            m = lock(&chan.mail);
            m.reading = false;
            chan.cv.notify_all();
            if let Err(e) = r {
                return give_up(&mut m, e);
            }
        }
    }

    /// Whether the reply to `sent` is here, after taking in what the socket holds, never
    /// waiting: not if another thread is reading the socket (it may hold the reply).
    pub fn arrived(&self, sent: &Sent) -> bool {
        let chan = &sent.chan;
        let mut m = lock(&chan.mail);
        if m.arrived.contains_key(&sent.id) {
            return true;
        }
        if m.reading || self.is_broken() {
            return false;
        }
        m.reading = true;
        drop(m);
        let r = self.take_in(chan);
        let mut m = lock(&chan.mail);
        m.reading = false;
        chan.cv.notify_all();
        r.is_ok() && m.arrived.contains_key(&sent.id)
    }

    /// Wait for the socket to be readable (until `deadline`), then take every reply there is
    /// and hand it to its waiter.
    fn read(&self, chan: &Channel, deadline: Instant) -> Result<(), PeerError> {
        poll_one(&chan.sock, rustix::event::PollFlags::IN, deadline)?;
        self.take_in(chan)
    }

    /// Take every reply the socket holds (never waiting) and hand each to its waiter.
    fn take_in(&self, chan: &Channel) -> Result<(), PeerError> {
        let mut buf = [0u8; MAX_MSG];
        loop {
            // (descriptors unlifted: an import keeps few of them, and lifts those)
            let got = match chan.sock.recv_unlifted(&mut buf) {
                Ok(g) => g,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.closed_with(format!("receiving from {}: {e}", self.addr))),
            };
            if got.len == 0 && got.fds.is_empty() {
                return Err(self.closed_with(format!("{} closed the connection", self.addr)));
            }
            if got.truncated {
                return Err(self.break_with("reply or its descriptors truncated (out of file descriptors?)"));
            }
            let (rid, reply) =
                Reply::decode(&buf[..got.len]).map_err(|e| self.break_with(format!("malformed reply: {e}")))?;
            let mut m = lock(&chan.mail);
            if m.waiting.contains(&rid) {
                m.arrived.insert(rid, (reply, got.fds));
            } else if let Reply::ImportOk(g) = reply {
                // The answer to a request whose caller gave up: the grant is released.
                drop(m);
                let _ = chan.sock.send(&Request::Unimport { import_id: g.import_id }.encode(0), &[]);
            }
        }
    }

    /// Send several requests at once and wait for all their replies (in order) until
    /// `deadline`: one round trip for the lot.
    pub fn request_many(&self, reqs: &[Request], deadline: Instant) -> Result<Vec<(Reply, Vec<OwnedFd>)>, PeerError> {
        let chan = self.channel(deadline)?;
        let sent = reqs.iter().map(|r| self.send(&chan, r, deadline)).collect::<Result<Vec<_>, _>>()?;
        sent.into_iter().map(|s| self.finish(s, deadline)).collect()
    }

    /// Give up the reply to `sent`: forgotten if it came already, else dropped when it comes.
    /// A grant it brings is given back and its descriptors closed, as for a request whose
    /// caller's deadline passed.
    pub fn abandon(&self, sent: Sent) {
        let Sent { chan, id } = sent;
        let mut m = lock(&chan.mail);
        m.waiting.remove(&id);
        if let Some((Reply::ImportOk(g), _fds)) = m.arrived.remove(&id) {
            drop(m);
            let _ = chan.sock.send(&Request::Unimport { import_id: g.import_id }.encode(0), &[]);
        }
    }

    /// Send a one-way message at once if the connection is up and its socket has room:
    /// whether it went.
    pub fn try_send_oneway(&self, req: &Request) -> bool {
        self.flush_queued();
        let Some(chan) = self.connected() else { return false };
        !req.wants_reply() && chan.sock.send(&req.encode(0), &[]).is_ok()
    }

    /// Queue a message that has no reply and may wait (`crate::lazy`): it goes with the next
    /// message sent here, or when the NIC's timer fires. Whether it was queued (not: no
    /// connection is up, send it otherwise).
    pub fn queue(&self, req: &Request) -> bool {
        if req.wants_reply() || self.connected().is_none() {
            return false;
        }
        let n = {
            let mut q = lock(&self.queue);
            q.push(req.encode(0));
            self.queued.store(q.len(), Ordering::Relaxed);
            q.len()
        };
        self.lazy.queued(1);
        if n >= crate::lazy::MAX_QUEUED {
            self.flush_queued();
        }
        true
    }

    /// Send what is queued, never waiting: what the socket has no room for stays queued.
    /// Dropped if the connection is gone (its end releases what the messages would have).
    pub fn flush_queued(&self) {
        // (a load, on every send: the common case is an empty queue; a count missed here
        // is sent by the next flush, or the timer's: the queue itself is under its lock)
        if self.queued.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut q = lock(&self.queue);
        let went = match self.connected() {
            Some(chan) => q.iter().take_while(|m| chan.sock.send(m, &[]).is_ok()).count(),
            None => q.len(),
        };
        q.drain(..went);
        self.queued.store(q.len(), Ordering::Relaxed);
        drop(q);
        self.lazy.gone(went);
    }

    /// Send a message that has no reply, without waiting (dropped if the socket is full).
    pub fn notify(&self, req: &Request) {
        if let Some(chan) = self.connected() {
            let _ = chan.sock.send(&req.encode(0), &[]);
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
        let r = Request::Unimport { import_id: self.import_id };
        if !self.peer.queue(&r) {
            self.peer.notify(&r);
        }
    }
}

fn protocol(peer: NicAddr, detail: impl Into<String>) -> ImportError {
    ImportError::Protocol { peer, detail: detail.into() }
}

pub(crate) fn peer_error(peer: NicAddr, e: PeerError, timeout: Duration) -> ImportError {
    match e {
        PeerError::Unreachable => ImportError::Unreachable(peer),
        PeerError::Timeout => ImportError::Timeout { peer, timeout },
        PeerError::Protocol(d) | PeerError::Closed(d) => ImportError::Protocol { peer, detail: d },
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

/// An import from a NIC of this host whose request went out ([`begin_import`]).
pub(crate) struct PendingImport {
    peer: Arc<PeerConn>,
    /// Taken by [`finish_import`]; one never finished is abandoned when dropped.
    sent: Option<Sent>,
    /// Asked to be granted on accept ([`try_begin_on_accept`]): answered before the connect
    /// is, or never.
    on_accept: bool,
}

impl PendingImport {
    /// Whether it will complete without waiting on the exporter: always for an import
    /// requested as such; for one asked on accept, whether its reply came already (the
    /// exporter sends it before the connect's answer: once that came, a grant not here is
    /// not coming).
    pub(crate) fn answered_on_accept(&self) -> bool {
        !self.on_accept || self.sent.as_ref().is_some_and(|s| self.peer.arrived(s))
    }
}

impl Drop for PendingImport {
    fn drop(&mut self) {
        if let Some(s) = self.sent.take() {
            self.peer.abandon(s);
        }
    }
}

impl std::fmt::Debug for PendingImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingImport").field("exporter", &self.peer.addr).finish_non_exhaustive()
    }
}

fn request(ep: &EndpointInner, desc: &Descriptor) -> Request {
    Request::Import { importer: ep.addr.into(), desc: desc.to_bytes() }
}

/// Import `desc`, exported by another NIC of this host, for endpoint `ep`, by `deadline`.
pub(crate) fn import_remote(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    deadline: Instant,
    timeout: Duration,
) -> Result<Mapping, ImportError> {
    let p = begin_import(ep, desc, deadline).map_err(|e| peer_error(desc.nic(), e, timeout))?;
    finish_import(ep, desc, p, deadline, timeout)
}

/// Send the import request for `desc` (connecting first if need be, by `deadline`).
pub(crate) fn begin_import(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    deadline: Instant,
) -> Result<PendingImport, PeerError> {
    let peer = ep.nic.peer(desc.nic());
    let sent = peer.begin(&request(ep, desc), deadline)?;
    Ok(PendingImport { peer, sent: Some(sent), on_accept: false })
}

/// Send the import request for `desc` only if that needs no wait at all (a connection to
/// the exporter's NIC is up and has room): the start of an import that may never be needed,
/// made where nothing may wait (accepting a connection).
pub(crate) fn try_begin_import(ep: &EndpointInner, desc: &Descriptor) -> Option<PendingImport> {
    if ep.nic.config.local_transport != crate::config::LocalTransport::SharedMemory {
        return None;
    }
    let peer = lock(ep.nic.peers_table()).get(&desc.nic()).cloned()?;
    let sent = peer.try_begin(&request(ep, desc))?;
    Some(PendingImport { peer, sent: Some(sent), on_accept: false })
}

/// Ask NIC `to` of this host to grant endpoint `ep`, when it accepts our connect with
/// `token`, the import of what it accepts it with (`Request::ImportOnAccept`, see
/// `crate::onaccept`). Sent only if that needs no wait at all, on the connection the connect
/// then goes on (straight after, [`crate::nic::NicInner::send_oneway_direct`]).
pub(crate) fn try_begin_on_accept(ep: &EndpointInner, to: NicAddr, token: u64) -> Option<PendingImport> {
    if ep.nic.config.local_transport != crate::config::LocalTransport::SharedMemory || to == ep.nic.addr {
        return None;
    }
    let peer = lock(ep.nic.peers_table()).get(&to).cloned()?;
    let sent = peer.try_begin(&Request::ImportOnAccept { importer: ep.addr.into(), token })?;
    Some(PendingImport { peer, sent: Some(sent), on_accept: true })
}

/// The reply to an import request, checked and mapped.
pub(crate) fn finish_import(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    p: PendingImport,
    deadline: Instant,
    timeout: Duration,
) -> Result<Mapping, ImportError> {
    let nic = &ep.nic;
    let mut p = p;
    let peer = p.peer.clone();
    let sent = p.sent.take().expect("a pending import is finished once");
    drop(p);
    let (reply, fds) = peer.finish(sent, deadline).map_err(|e| peer_error(desc.nic(), e, timeout))?;
    // The engine watches the exporter: when its process dies, our mappings of it fail.
    nic.watch(&peer);
    let g = match reply {
        Reply::ImportOk(g) => g,
        Reply::Err { code, detail } => {
            return Err(match clan_wire::grant::Refusal::from_code(code) {
                Some(r) => ImportError::refused(r, desc),
                None => protocol(desc.nic(), format!("{code:?}: {detail}")),
            });
        }
        other => return Err(protocol(desc.nic(), format!("unexpected reply {other:?}"))),
    };
    // From here on the exporter counts the import: release it on every error path.
    let guard = ImportGuard { peer: peer.clone(), import_id: g.import_id };
    if fds.len() != 4 {
        return Err(protocol(desc.nic(), format!("{} descriptors received, 4 expected", fds.len())));
    }
    check_grant(desc, &g).map_err(|d| protocol(desc.nic(), d))?;
    let mut fds = fds.into_iter();
    let mut next = || fds.next().ok_or_else(|| protocol(desc.nic(), "descriptor missing"));
    let (ap_fd, index_fd, port_fd, eventfd) = (next()?, next()?, next()?, next()?);
    // Our port in the exporter's queue: mapped once per process (several imports, and
    // several NICs of this process, may bring its descriptors at once).
    let port = crate::port::attach(desc.nic(), g.eq_id, g.port, g.ring_cap, port_fd, eventfd)
        .map_err(|d| protocol(desc.nic(), d))?;
    let index_len = crate::aperture::index_len(g.cap, g.slots);
    // The aperture may be carved from a pool's chunk (`pool.rs`): its data and index start at
    // the grant's offsets, within memfds at least that long (checked by `check_grant` and
    // against the memfds' sealed sizes here). Only its own pages are mapped.
    let data_end = g.data_offset.checked_add(g.cap).ok_or_else(|| protocol(desc.nic(), "data offset overflows"))?;
    let index_end =
        g.index_offset.checked_add(index_len).ok_or_else(|| protocol(desc.nic(), "index offset overflows"))?;
    let memfd = Memfd::adopt(ap_fd, data_end).map_err(|e| protocol(desc.nic(), format!("aperture memfd: {e}")))?;
    let index_fd =
        Memfd::adopt(index_fd, index_end).map_err(|e| protocol(desc.nic(), format!("aperture index memfd: {e}")))?;
    let page = segment::page_size() as u64;
    let access = if g.read_only { SegAccess::ReadOnly } else { SegAccess::ReadWrite };
    // A pool's chunk (a memfd larger than the aperture, granted read-write) is mapped once
    // per process and shared by every aperture of it we import, each a part of that mapping
    // (small ones several to a page: their granted lines); an aperture of its own is mapped
    // alone, its granted pages only.
    let (data, start) = if !g.read_only && memfd.len() > g.cap {
        let start = desc.offset() / crate::pool::PART_ALIGN * crate::pool::PART_ALIGN;
        let end = (desc.offset() + desc.len()).next_multiple_of(crate::pool::PART_ALIGN).min(g.cap);
        (chunk_part(nic, &memfd, SegAccess::ReadWrite, g.data_offset + start, end - start), start)
    } else {
        let start = desc.offset() / page * page;
        let end = (desc.offset() + desc.len()).div_ceil(page) * page;
        (Segment::map(&memfd, g.data_offset + start, (end - start) as usize, access).map(|s| (s, None)), start)
    };
    let (data, data_chunk) = data.map_err(|e| fd_err(e, "mapping the aperture"))?;
    let (cam_seg, index_chunk) = if index_fd.len() > index_len {
        chunk_part(nic, &index_fd, SegAccess::ReadOnly, g.index_offset, index_len)
    } else {
        Segment::map(&index_fd, g.index_offset, index_len as usize, SegAccess::ReadOnly).map(|s| (s, None))
    }
    .map_err(|e| fd_err(e, "mapping the aperture index"))?;
    let cam = CamMap::new(Arc::new(cam_seg), 0, g.cap, g.slots).map_err(|e| protocol(desc.nic(), e.to_string()))?;
    cam.view().meta.check(g.cap).map_err(|e| protocol(desc.nic(), e))?;
    // The mappings keep the memory; the descriptors are no longer needed.
    drop((memfd, index_fd));
    // A pool's chunks and our port stay mapped for the next import from that NIC.
    if data_chunk.is_some() || index_chunk.is_some() {
        nic.keep_mapped(&peer, data_chunk, &port);
        if index_chunk.is_some() {
            nic.keep_mapped(&peer, index_chunk, &port);
        }
    }
    let window = Window {
        data: Segment::whole(&Arc::new(data)),
        data_base: start,
        cam: Arc::new(cam).handle(),
        tag: g.tag,
        live: g.live,
        port,
        claim: Some(crate::event_queue::ClaimTo { aperture: desc.aperture(), generation: desc.generation() }),
        peer_alive: Some(peer.alive.clone()),
    };
    tracing::debug!(exporter = %desc.nic(), importer = %ep.addr, aperture = desc.aperture(), "imported from a NIC of this host");
    Ok(Mapping::new(ep, desc, crate::transport::Via::Mapped(window), Keep::Remote(guard)))
}

/// Largest pool chunk mapped whole (the exporter's chunks are far smaller).
const MAX_CHUNK: u64 = 64 << 20;

/// `len` bytes at `off` of a pool's chunk `fd`: a part of the process's one mapping of the
/// chunk (made now if it has none: keyed by the file's identity, which cannot be reused
/// while the mapping keeps the file), and that whole mapping.
fn chunk_part(
    nic: &crate::nic::NicInner,
    fd: &Memfd,
    access: SegAccess,
    off: u64,
    len: u64,
) -> std::io::Result<(Segment, Option<Arc<Segment>>)> {
    let (dev, ino) = fd.identity()?;
    if fd.len() > MAX_CHUNK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a pool chunk larger than any exporter makes",
        ));
    }
    let key = (dev, ino, access == SegAccess::ReadWrite);
    let whole = {
        let mut m = lock(&nic.chunk_maps);
        match m.get(&key).and_then(std::sync::Weak::upgrade) {
            Some(seg) => seg,
            None => {
                let seg = Arc::new(Segment::map(fd, 0, fd.len() as usize, access)?);
                if m.len() >= 64 && m.len().is_power_of_two() {
                    m.retain(|_, w| w.strong_count() > 0);
                }
                m.insert(key, Arc::downgrade(&seg));
                seg
            }
        }
    };
    let part = Segment::sub(&whole, off as usize, len as usize)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    Ok((part, Some(whole)))
}

fn check_grant(desc: &Descriptor, g: &ImportGrant) -> Result<(), String> {
    if g.aperture_len != desc.aperture_len() {
        return Err("aperture length differs from the descriptor's".into());
    }
    let part = crate::pool::PART_ALIGN;
    if g.cap % part != 0 || g.cap < g.aperture_len || g.cap > crate::aperture::MAX_APERTURE {
        return Err("bad aperture capacity".into());
    }
    if g.slots == 0 || g.slots > crate::aperture::MAX_SLOTS {
        return Err("bad index geometry".into());
    }
    if g.data_offset % part != 0 || g.index_offset % part != 0 {
        return Err("the aperture's offsets in its memfds are not aligned to a cache line".into());
    }
    if g.read_only == desc.rights().contains(Rights::WRITE) {
        return Err("granted access does not match the descriptor's rights".into());
    }
    if !g.ring_cap.is_power_of_two() || g.ring_cap > clan_shm::eq::MAX_RING_CAP {
        return Err("bad port geometry".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(cap: u64, data_offset: u64, index_offset: u64) -> ImportGrant {
        ImportGrant {
            import_id: 1,
            aperture_len: 200,
            cap,
            data_offset,
            index_offset,
            slots: 8,
            eq_id: 0,
            port: 0,
            ring_cap: 64,
            tag: 0,
            live: 1,
            read_only: false,
        }
    }

    /// A grant is what an exporter says of the memory it hands over: untrusted. A small
    /// pooled aperture's grant has cache-line offsets and capacity; anything not on a cache
    /// line, or smaller than the descriptor's aperture, is refused before anything is mapped.
    #[test]
    fn a_grant_is_checked_against_the_descriptor_and_cache_line_alignment() {
        let d = Descriptor::root(crate::addr::NicAddr::localhost(9), 3, 1, 200, &[7; 32]);
        assert_eq!(check_grant(&d, &grant(256, 4096 + 320, 640)), Ok(()), "a small pooled aperture");
        assert_eq!(check_grant(&d, &grant(4096, 0, 0)), Ok(()), "an aperture of its own");
        for (g, why) in [
            (grant(200, 0, 0), "a capacity off a cache line"),
            (grant(192, 0, 0), "a capacity smaller than the aperture"),
            (grant(256, 32, 0), "a data offset off a cache line"),
            (grant(256, 0, 8), "an index offset off a cache line"),
            (ImportGrant { aperture_len: 100, ..grant(256, 0, 0) }, "another aperture length"),
            (ImportGrant { slots: 0, ..grant(256, 0, 0) }, "an index without entries"),
            (ImportGrant { read_only: true, ..grant(256, 0, 0) }, "rights other than the descriptor's"),
        ] {
            assert!(check_grant(&d, &g).is_err(), "{why} is refused");
        }
    }
}
