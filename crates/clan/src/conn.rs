//! Connections between endpoints: a connect/accept handshake carried by out-of-band messages
//! that exchanges descriptors, and disconnect events.
//!
//! The handshake is the paper's use of OOB messages ("connection setup, tear down and
//! exceptional conditions"). A client sends `CONNECT(token, its descriptor)`; a listening
//! endpoint queues the request; the server answers `ACCEPT(token, its descriptor)` or
//! `REFUSE(token)`. A descriptor is longer than one 40-byte payload, so it travels in
//! fragments. Either side may send `CLOSE(token)`.
//!
//! A connection ends — and its endpoint's event queue receives
//! [`crate::Event::Disconnect`] with the connection's token — when the peer closes it, when
//! the peer's process dies (its control channel or link closes), or when the link to the
//! peer's host breaks (keepalive). Connecting again after that sets up a new link on demand.
//!
//! OOB payloads that begin with the two bytes `C1 A7` are reserved for this protocol; all
//! others reach the endpoint's OOB queue untouched.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::addr::{EndpointAddr, NicAddr};
use crate::ctl::OOB_PAYLOAD;
use crate::descriptor::Descriptor;
use crate::endpoint::{Endpoint, EndpointInner, OobMessage};
use crate::error::OobError;
use crate::event_queue::EVENT_DISCONNECT;
use crate::lock;
use crate::nic::NicInner;

const MAGIC: [u8; 2] = [0xC1, 0xA7];
const T_CONNECT: u8 = 1;
const T_ACCEPT: u8 = 2;
const T_REFUSE: u8 = 3;
const T_CLOSE: u8 = 4;
const T_FRAG: u8 = 5;
const HEAD: usize = 11;
const FIRST: usize = OOB_PAYLOAD - HEAD - 2;
const FRAG: usize = OOB_PAYLOAD - HEAD - 1;
/// Handshakes being reassembled per endpoint, at most.
const MAX_PARTIAL: usize = 1024;
/// Connection requests queued per endpoint, at most (more are refused).
const MAX_REQUESTS: usize = 1024;

/// Why connecting or accepting failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The server refused (or is not listening).
    #[error("{0} refused the connection")]
    Refused(EndpointAddr),
    /// No answer in time.
    #[error("no answer from {0} in time")]
    Timeout(EndpointAddr),
    /// No connection request arrived in time.
    #[error("no connection request arrived in time")]
    NoRequest,
    /// The out-of-band messages could not be sent.
    #[error("sending the handshake failed: {0}")]
    Oob(#[from] OobError),
    /// The peer's descriptor was malformed.
    #[error("{0} sent a malformed descriptor")]
    BadDescriptor(EndpointAddr),
    /// The endpoint is closed.
    #[error("the endpoint is closed")]
    Closed,
}

/// Shared liveness of one connection.
#[derive(Debug, Default)]
pub(crate) struct ConnShared {
    alive: AtomicBool,
}

/// Live connections by (local endpoint port, token): the peer and the shared state.
type ConnMap = HashMap<(u32, u64), (EndpointAddr, Weak<ConnShared>)>;

/// The NIC's registry of live connections (to report disconnections).
#[derive(Debug, Default)]
pub(crate) struct ConnRegistry {
    map: Mutex<ConnMap>,
}

/// Per-endpoint handshake state.
#[derive(Debug, Default)]
pub(crate) struct Handshakes {
    partial: HashMap<(EndpointAddr, u64), (u8, usize, Vec<u8>)>,
    requests: VecDeque<ConnectRequest>,
    /// Tokens being waited for: `None` until the answer (`Some(None)`: refused).
    answers: HashMap<u64, Option<Option<Descriptor>>>,
    pub listening: bool,
}

/// The per-endpoint part: state and a condition variable.
#[derive(Debug, Default)]
pub(crate) struct EndpointConns {
    pub state: Mutex<Handshakes>,
    pub cv: Condvar,
}

/// Whether an OOB payload belongs to this protocol.
pub(crate) fn is_handshake(payload: &[u8; OOB_PAYLOAD]) -> bool {
    payload[..2] == MAGIC
}

fn header(kind: u8, token: u64) -> [u8; OOB_PAYLOAD] {
    let mut p = [0u8; OOB_PAYLOAD];
    p[..2].copy_from_slice(&MAGIC);
    p[2] = kind;
    p[3..11].copy_from_slice(&token.to_le_bytes());
    p
}

/// The messages carrying `desc` for a CONNECT or ACCEPT.
fn messages(kind: u8, token: u64, desc: &Descriptor) -> Vec<[u8; OOB_PAYLOAD]> {
    let bytes = desc.to_bytes();
    let mut out = Vec::new();
    let mut first = header(kind, token);
    first[HEAD..HEAD + 2].copy_from_slice(&(bytes.len() as u16).to_le_bytes());
    let n = bytes.len().min(FIRST);
    first[HEAD + 2..HEAD + 2 + n].copy_from_slice(&bytes[..n]);
    out.push(first);
    for (i, chunk) in bytes[n..].chunks(FRAG).enumerate() {
        let mut f = header(T_FRAG, token);
        f[HEAD] = (i + 1) as u8;
        f[HEAD + 1..HEAD + 1 + chunk.len()].copy_from_slice(chunk);
        out.push(f);
    }
    out
}

/// A handshake message arrived for endpoint `ep` (any thread; never blocks).
pub(crate) fn on_message(ep: &EndpointInner, msg: OobMessage) {
    let p = &msg.payload;
    let kind = p[2];
    let token = u64::from_le_bytes(p[3..11].try_into().unwrap_or([0; 8]));
    let conns = &ep.conns;
    let mut st = lock(&conns.state);
    let key = (msg.from, token);
    let complete = match kind {
        T_CONNECT | T_ACCEPT => {
            let total = u16::from_le_bytes([p[HEAD], p[HEAD + 1]]) as usize;
            if total > crate::descriptor::MAX_BYTES {
                return;
            }
            let n = total.min(FIRST);
            let data = p[HEAD + 2..HEAD + 2 + n].to_vec();
            if data.len() == total {
                Some((kind, data))
            } else {
                // Bounded: a peer cannot grow this without limit.
                if st.partial.len() >= MAX_PARTIAL {
                    st.partial.clear();
                }
                st.partial.insert(key, (kind, total, data));
                None
            }
        }
        T_FRAG => {
            let Some((k, total, mut data)) = st.partial.remove(&key) else { return };
            let n = (total - data.len()).min(FRAG);
            data.extend_from_slice(&p[HEAD + 1..HEAD + 1 + n]);
            if data.len() == total {
                Some((k, data))
            } else {
                st.partial.insert(key, (k, total, data));
                None
            }
        }
        T_REFUSE => {
            if let Some(a) = st.answers.get_mut(&token) {
                *a = Some(None);
                conns.cv.notify_all();
            }
            return;
        }
        T_CLOSE => {
            drop(st);
            ep.nic.conns.disconnect(&ep.nic, ep.addr.port, token, Some(msg.from));
            return;
        }
        _ => return,
    };
    let Some((kind, bytes)) = complete else { return };
    let Ok(desc) = Descriptor::from_bytes(&bytes) else { return };
    match kind {
        T_CONNECT => {
            if st.listening && st.requests.len() < MAX_REQUESTS {
                st.requests.push_back(ConnectRequest { from: msg.from, token, descriptor: desc });
                conns.cv.notify_all();
            } else {
                drop(st);
                ep.nic.outbox(ep.addr, msg.from, header(T_REFUSE, token));
            }
        }
        _ => {
            if let Some(a) = st.answers.get_mut(&token) {
                *a = Some(Some(desc));
                conns.cv.notify_all();
            }
        }
    }
}

impl ConnRegistry {
    fn insert(&self, port: u32, token: u64, peer: EndpointAddr) -> Arc<ConnShared> {
        let s = Arc::new(ConnShared { alive: AtomicBool::new(true) });
        lock(&self.map).insert((port, token), (peer, Arc::downgrade(&s)));
        s
    }

    /// End connection `(port, token)` (if `from` is given, only if it is the peer's) and
    /// post the disconnect event.
    pub(crate) fn disconnect(&self, nic: &NicInner, port: u32, token: u64, from: Option<EndpointAddr>) {
        let e = {
            let mut m = lock(&self.map);
            match m.get(&(port, token)) {
                Some((peer, _)) if from.is_none_or(|f| f == *peer) => m.remove(&(port, token)),
                _ => None,
            }
        };
        if let Some((_, shared)) = e {
            if let Some(s) = shared.upgrade() {
                s.alive.store(false, Ordering::Release);
            }
            if let Some(ep) = nic.endpoint(port) {
                ep.queue.inner.post_local(EVENT_DISCONNECT, u64::from(port), token);
            }
        }
    }
}

/// Every connection to NIC `peer` ends (its process died or the link broke).
pub(crate) fn peer_gone(nic: &NicInner, peer: NicAddr) {
    let gone: Vec<(u32, u64)> =
        lock(&nic.conns.map).iter().filter(|(_, (p, _))| p.nic == peer).map(|(k, _)| *k).collect();
    for (port, token) in gone {
        nic.conns.disconnect(nic, port, token, None);
    }
}

fn random_token() -> u64 {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    u64::from_le_bytes(b) | 1
}

/// A connection request waiting to be accepted.
#[derive(Debug, Clone)]
pub struct ConnectRequest {
    from: EndpointAddr,
    token: u64,
    descriptor: Descriptor,
}

impl ConnectRequest {
    /// The client endpoint.
    pub fn from(&self) -> EndpointAddr {
        self.from
    }
    /// The client's descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }
    /// The connection's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Accept, giving the client `local` (typically an aperture exported for it).
    pub fn accept(self, ep: &Endpoint, local: &Descriptor) -> Result<Connection, ConnectError> {
        let shared = ep.inner.nic.conns.insert(ep.port(), self.token, self.from);
        for m in messages(T_ACCEPT, self.token, local) {
            if let Err(e) = ep.send_oob(self.from, &m) {
                lock(&ep.inner.nic.conns.map).remove(&(ep.port(), self.token));
                return Err(e.into());
            }
        }
        Ok(Connection {
            nic: Arc::downgrade(&ep.inner.nic),
            local: ep.addr(),
            peer: self.from,
            token: self.token,
            peer_desc: self.descriptor,
            shared,
        })
    }

    /// Refuse.
    pub fn refuse(self, ep: &Endpoint) -> Result<(), ConnectError> {
        ep.send_oob(self.from, &header(T_REFUSE, self.token))?;
        Ok(())
    }
}

/// A connection between two endpoints, with the peer's descriptor. Dropping it closes it.
#[derive(Debug)]
pub struct Connection {
    nic: Weak<NicInner>,
    local: EndpointAddr,
    peer: EndpointAddr,
    token: u64,
    peer_desc: Descriptor,
    shared: Arc<ConnShared>,
}

impl Connection {
    /// Our endpoint.
    pub fn local(&self) -> EndpointAddr {
        self.local
    }
    /// The peer endpoint.
    pub fn peer(&self) -> EndpointAddr {
        self.peer
    }
    /// The token carried by this connection's [`crate::Event::Disconnect`].
    pub fn token(&self) -> u64 {
        self.token
    }
    /// The descriptor the peer gave.
    pub fn peer_descriptor(&self) -> &Descriptor {
        &self.peer_desc
    }
    /// Whether the connection is up (false after the peer closed, died or its link broke).
    pub fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::Acquire)
    }
    /// Close now (dropping does the same).
    pub fn close(self) {}
}

impl Drop for Connection {
    fn drop(&mut self) {
        let Some(nic) = self.nic.upgrade() else { return };
        let was = lock(&nic.conns.map).remove(&(self.local.port, self.token)).is_some();
        if was && self.is_alive() {
            nic.outbox(self.local, self.peer, header(T_CLOSE, self.token));
        }
    }
}

impl Endpoint {
    /// Release `st` until the handshake state may have changed, at most `left` (and at most
    /// 100 ms, so callers recheck their deadlines). With manual progress, replies only
    /// arrive if someone drives the links: this thread does.
    fn await_handshake<'a>(
        &'a self,
        st: std::sync::MutexGuard<'a, Handshakes>,
        left: Duration,
    ) -> std::sync::MutexGuard<'a, Handshakes> {
        let conns = &self.inner.conns;
        if self.inner.nic.manual_progress() {
            drop(st);
            if !self.inner.nic.progress() {
                std::thread::sleep(Duration::from_micros(100));
            }
            lock(&conns.state)
        } else {
            conns.cv.wait_timeout(st, left.min(Duration::from_millis(100))).unwrap_or_else(|e| e.into_inner()).0
        }
    }

    /// Accept connection requests from now on (they queue until [`Endpoint::accept`]).
    /// Requests that arrive while not listening are refused.
    pub fn listen(&self) {
        lock(&self.inner.conns.state).listening = true;
    }

    /// Connect to the listening endpoint `to`, giving it `local`; returns the connection and
    /// the server's descriptor.
    pub fn connect(
        &self,
        to: EndpointAddr,
        local: &Descriptor,
        timeout: Option<Duration>,
    ) -> Result<Connection, ConnectError> {
        let token = random_token();
        let conns = &self.inner.conns;
        lock(&conns.state).answers.insert(token, None);
        let forget = || {
            lock(&conns.state).answers.remove(&token);
        };
        for m in messages(T_CONNECT, token, local) {
            if let Err(e) = self.send_oob(to, &m) {
                forget();
                return Err(e.into());
            }
        }
        let deadline = Instant::now() + timeout.unwrap_or(Duration::from_secs(10));
        let mut st = lock(&conns.state);
        loop {
            if let Some(Some(a)) = st.answers.get(&token) {
                let a = a.clone();
                st.answers.remove(&token);
                return match a {
                    Some(desc) => {
                        drop(st);
                        let shared = self.inner.nic.conns.insert(self.port(), token, to);
                        Ok(Connection {
                            nic: Arc::downgrade(&self.inner.nic),
                            local: self.addr(),
                            peer: to,
                            token,
                            peer_desc: desc,
                            shared,
                        })
                    }
                    None => Err(ConnectError::Refused(to)),
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                st.answers.remove(&token);
                return Err(ConnectError::Timeout(to));
            }
            st = self.await_handshake(st, left);
        }
    }

    /// Wait for a connection request (after [`Endpoint::listen`]).
    pub fn accept(&self, timeout: Option<Duration>) -> Result<ConnectRequest, ConnectError> {
        let conns = &self.inner.conns;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&conns.state);
        loop {
            if let Some(r) = st.requests.pop_front() {
                return Ok(r);
            }
            let left = match deadline {
                Some(d) => {
                    let l = d.saturating_duration_since(Instant::now());
                    if l.is_zero() {
                        return Err(ConnectError::NoRequest);
                    }
                    l
                }
                None => Duration::from_millis(100),
            };
            st = self.await_handshake(st, left);
        }
    }

    /// A connection request, if one is waiting (never blocks).
    pub fn try_accept(&self) -> Option<ConnectRequest> {
        lock(&self.inner.conns.state).requests.pop_front()
    }
}
