//! Connections between endpoints: the connect/accept hand-shake of `clan_wire::connect`
//! (carried by out-of-band messages, exchanging descriptors and a little private data), and
//! disconnect events.
//!
//! The hand-shake is the paper's use of OOB messages ("connection setup, tear down and
//! exceptional conditions"); the protocol and its bounds are in `clan_wire::connect`, this
//! module drives it. A client's [`Endpoint::connect`] waits for the answer with its own
//! deadline; [`Endpoint::accept`] only ever returns requests that can still be answered (a
//! client that gave up, expired or died is dropped from the backlog, never reported to
//! `accept`), and [`ConnectRequest::accept`] never waits for the client: the answer goes out
//! through the NIC's engine.
//!
//! A connection ends — and its endpoint's event queue receives
//! [`crate::Event::Disconnect`] with the connection's token — when the peer closes it, when
//! the peer's process dies (its control channel or link closes), or when the link to the
//! peer's host breaks (keepalive). Connecting again after that sets up a new link on demand.
//!
//! OOB payloads that begin with the two bytes `C1 A7` are reserved for this protocol; all
//! others reach the endpoint's OOB queue untouched.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use clan_wire::connect::{self, Answer, Event as HsEvent, Handshakes, Limits, Peer};

use crate::addr::{EndpointAddr, NicAddr, PeerIdentity};
use crate::descriptor::Descriptor;
use crate::endpoint::{Endpoint, EndpointInner, OobMessage};
use crate::error::OobError;
use crate::event_queue::Word;
use crate::lock;
use crate::nic::NicInner;
use crate::progress::{self, Deadline};

/// Most bytes of private data a connect or accept carries (as in RDMA CM).
pub const MAX_PRIVATE_DATA: usize = 256;
/// How long [`Endpoint::connect`] waits when given no timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// With manual progress, how long a thread waiting in a hand-shake naps before it looks
/// again when it has no eventfd to be told on (it sleeps until told otherwise).
const HANDSHAKE_NAP: Duration = Duration::from_micros(100);

/// Why connecting or accepting failed.
///
/// ```
/// use std::time::Duration;
/// use clan::ConnectError;
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let mine = client.export(4096)?;
/// // `server` never called `listen`: refused at once.
/// match client.connect(server.addr(), &mine.descriptor(), Some(Duration::from_secs(5))) {
///     Err(ConnectError::Refused(to)) => assert_eq!(to, server.addr()),
///     other => panic!("expected Refused, got {other:?}"),
/// }
/// server.listen();
/// assert!(matches!(server.accept(Some(Duration::from_millis(5))), Err(ConnectError::NoRequest)));
/// let too_much = [0u8; clan::MAX_PRIVATE_DATA + 1];
/// let r = client.connect_with_data(server.addr(), &mine.descriptor(), &too_much, None);
/// assert!(matches!(r, Err(ConnectError::DataTooLong(257))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The server refused, is not listening, or no such endpoint or NIC exists.
    #[error("{0} refused the connection")]
    Refused(EndpointAddr),
    /// No answer in time.
    #[error("no answer from {0} in time")]
    Timeout(EndpointAddr),
    /// No connection request arrived in time.
    #[error("no connection request arrived in time")]
    NoRequest,
    /// The server closed the connection before it was set up, or its process went away.
    #[error("{0} went away before the connection was set up")]
    PeerGone(EndpointAddr),
    /// The out-of-band messages could not be sent.
    #[error("sending the hand-shake failed: {0}")]
    Oob(#[from] OobError),
    /// The peer's descriptor was malformed.
    #[error("{0} sent a malformed descriptor")]
    BadDescriptor(EndpointAddr),
    /// More private data than a hand-shake carries.
    #[error("{0} bytes of private data: at most {MAX_PRIVATE_DATA} travel with a connect or accept")]
    DataTooLong(usize),
    /// Too many connects in progress on this endpoint.
    #[error("too many connects in progress on this endpoint")]
    TooMany,
    /// The endpoint is closed.
    #[error("the endpoint is closed")]
    Closed,
}

impl Peer for EndpointAddr {
    fn same_node(&self, other: &Self) -> bool {
        self.nic == other.nic
    }
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

/// The per-endpoint part: the hand-shake machine and a condition variable for its waiters.
#[derive(Debug)]
pub(crate) struct EndpointConns {
    pub state: Mutex<Handshakes<EndpointAddr, PeerIdentity>>,
    pub cv: Condvar,
    /// Dials of [`Endpoint::connect_importing`], by token: the import of the server's
    /// descriptor, begun by whichever thread takes the answer in (`on_message`), before the
    /// dialling thread is woken for it.
    prefetch: Mutex<HashMap<u64, Option<crate::peer::PendingImport>>>,
    /// Threads waiting in `connect` for their answer: a connection that ends
    /// ([`Conns::disconnect`]) wakes the waiters only if there are any (most end long after
    /// their dial, and a wake-up of an accepting thread for each would cost a context switch).
    dialling: clan_shm::waiters::Waiters,
}

impl Default for EndpointConns {
    fn default() -> Self {
        EndpointConns {
            state: Mutex::new(Handshakes::new(Limits::default())),
            cv: Condvar::new(),
            prefetch: Mutex::new(HashMap::new()),
            dialling: clan_shm::waiters::Waiters::new(),
        }
    }
}

impl EndpointConns {
    /// Wake the threads waiting on the hand-shakes, after a change made under `state`: those
    /// on the condition variable, and with manual progress those asleep on the links
    /// ([`crate::nic::LinkTable::park`]; every such thread of the NIC is woken, and looks
    /// again).
    pub fn notify(&self, nic: &NicInner) {
        self.cv.notify_all();
        if nic.manual_progress() {
            nic.links.kick_parked();
        }
    }
}

/// Whether an OOB payload belongs to this protocol.
pub(crate) fn is_handshake(payload: &[u8; connect::PAYLOAD]) -> bool {
    connect::is_handshake(payload)
}

/// The blob a CONNECT or ACCEPT carries: descriptor and private data.
fn blob(desc: &Descriptor, data: &[u8]) -> Vec<u8> {
    let d = desc.to_bytes();
    let mut b = Vec::with_capacity(2 + d.len() + data.len());
    b.extend_from_slice(&(d.len() as u16).to_le_bytes());
    b.extend_from_slice(&d);
    b.extend_from_slice(data);
    b
}

fn unblob(b: &[u8]) -> Option<(Descriptor, Vec<u8>)> {
    let n = usize::from(u16::from_le_bytes([*b.first()?, *b.get(1)?]));
    let d = b.get(2..2 + n)?;
    let data = b.get(2 + n..)?;
    if data.len() > MAX_PRIVATE_DATA {
        return None;
    }
    Some((Descriptor::from_bytes(d).ok()?, data.to_vec()))
}

/// Run what the machine produced: messages to send (through the engine: never waits) and
/// events to act on.
fn drive(ep: &EndpointInner, st: &mut Handshakes<EndpointAddr, PeerIdentity>) -> Vec<HsEvent<EndpointAddr>> {
    while let Some((to, p)) = st.poll_transmit() {
        ep.nic.outbox(ep.addr, to, p);
    }
    std::iter::from_fn(|| st.poll_event()).collect()
}

fn act(ep: &EndpointInner, events: Vec<HsEvent<EndpointAddr>>) {
    // (waiters sleep until told, with no period: a request or an answer wakes them here, a
    // close that ends a dial in `Conns::disconnect`)
    let mut wake = false;
    for e in events {
        match e {
            HsEvent::Request | HsEvent::Answered(_) => wake = true,
            HsEvent::Closed { from, token } => ep.nic.conns.disconnect(&ep.nic, ep.addr.port, token, Some(from)),
        }
    }
    if wake {
        ep.conns.notify(&ep.nic);
    }
}

/// A hand-shake message arrived for endpoint `ep` from `msg.from` (verified by the
/// transport it came through). Any thread; never blocks.
pub(crate) fn on_message(ep: &EndpointInner, msg: OobMessage, who: PeerIdentity) {
    let (events, imports) = {
        let mut st = lock(&ep.conns.state);
        st.handle_message_from(msg.from, who, &msg.payload, Instant::now());
        let events = drive(ep, &mut st);
        let imports = to_prefetch(ep, &st, &events);
        (events, imports)
    };
    // The import of an accepting server's descriptor goes out now (never waiting), its round
    // trip overlapping the dialling thread's wake-up: before `act` wakes it, so that it
    // finds the import begun. (Dropped, so abandoned, if the dial is over meanwhile.)
    for (token, desc) in imports {
        let p = crate::peer::try_begin_import(ep, &desc);
        if let Some(slot) = lock(&ep.conns.prefetch).get_mut(&token) {
            *slot = p;
        }
    }
    act(ep, events);
}

/// The dials answered by `events` whose server's descriptor is to be imported at once
/// ([`Endpoint::connect_importing`]): their tokens and those descriptors.
fn to_prefetch(
    ep: &EndpointInner,
    st: &Handshakes<EndpointAddr, PeerIdentity>,
    events: &[HsEvent<EndpointAddr>],
) -> Vec<(u64, Descriptor)> {
    let answered = || events.iter().filter_map(|e| if let HsEvent::Answered(t) = e { Some(*t) } else { None });
    if answered().next().is_none() {
        return Vec::new();
    }
    let wanted = lock(&ep.conns.prefetch);
    answered()
        .filter(|t| wanted.get(t).is_some_and(Option::is_none))
        .filter_map(|t| match st.peek_answer(t)? {
            Answer::Accepted { desc, .. } => Some((t, unblob(desc)?.0)),
            _ => None,
        })
        .collect()
}

impl ConnRegistry {
    fn insert(&self, port: u32, token: u64, peer: EndpointAddr) -> Arc<ConnShared> {
        let s = Arc::new(ConnShared { alive: AtomicBool::new(true) });
        lock(&self.map).insert((port, token), (peer, Arc::downgrade(&s)));
        s
    }

    fn set_peer(&self, port: u32, token: u64, peer: EndpointAddr) {
        if let Some(e) = lock(&self.map).get_mut(&(port, token)) {
            e.0 = peer;
        }
    }

    fn forget(&self, port: u32, token: u64) {
        lock(&self.map).remove(&(port, token));
    }

    /// End connection `(port, token)` (if `from` is given, only if it is on the peer's NIC:
    /// the token is the capability) and post the disconnect event.
    pub(crate) fn disconnect(&self, nic: &NicInner, port: u32, token: u64, from: Option<EndpointAddr>) {
        let e = {
            let mut m = lock(&self.map);
            match m.get(&(port, token)) {
                Some((peer, _)) if from.is_none_or(|f| f.nic == peer.nic) => m.remove(&(port, token)),
                _ => None,
            }
        };
        if let Some((peer, shared)) = e {
            if let Some(s) = shared.upgrade() {
                s.alive.store(false, Ordering::Release);
            }
            tracing::debug!(port, token, %peer, "connection ended");
            if let Some(ep) = nic.endpoint(port) {
                ep.queue.inner.post_local(Word::Disconnect { endpoint: port, token });
                // A `connect` still waiting for its answer looks at `alive` under the
                // hand-shakes' lock and sleeps until told: told if one is counted
                // (`clan_shm::waiters`: either it sees `alive` false, or it is counted here).
                // The lock is taken (never held by a caller of this) so that a dial that
                // looked before the store is asleep when told.
                if ep.conns.dialling.any_after_change() {
                    drop(lock(&ep.conns.state));
                    ep.conns.notify(nic);
                }
            }
        }
    }

    /// Connections of endpoint `from_port` with `peer`: a message to it could not be
    /// delivered, so they are over.
    pub(crate) fn unreachable(&self, nic: &NicInner, from_port: u32, peer: EndpointAddr) {
        let gone: Vec<u64> = lock(&self.map)
            .iter()
            .filter(|((p, _), (q, _))| *p == from_port && *q == peer)
            .map(|((_, t), _)| *t)
            .collect();
        for t in gone {
            self.disconnect(nic, from_port, t, None);
        }
    }
}

/// Every connection to NIC `peer` ends (its process died or the link broke), and every
/// endpoint forgets its hand-shakes with it.
pub(crate) fn peer_gone(nic: &NicInner, peer: NicAddr, endpoints: &[Arc<EndpointInner>]) {
    let gone: Vec<(u32, u64)> =
        lock(&nic.conns.map).iter().filter(|(_, (p, _))| p.nic == peer).map(|(k, _)| *k).collect();
    for (port, token) in gone {
        nic.conns.disconnect(nic, port, token, None);
    }
    for ep in endpoints {
        let events = {
            let mut st = lock(&ep.conns.state);
            st.peers_gone(|p| p.nic == peer);
            drive(ep, &mut st)
        };
        act(ep, events);
        ep.conns.notify(nic);
    }
}

fn random_token() -> u64 {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    u64::from_le_bytes(b) | 1
}

/// A connection request waiting to be accepted ([`Endpoint::accept`]).
///
/// ```
/// use std::time::Duration;
///
/// let nic = clan::Nic::open_default()?;
/// let server = nic.endpoint()?;
/// server.listen();
/// let (to, nic2) = (server.addr(), nic.clone());
/// let client = std::thread::spawn(move || -> std::io::Result<_> {
///     let ep = nic2.endpoint()?;
///     let mine = ep.export(4096)?;
///     let r = ep.connect_with_data(to, &mine.descriptor(), b"user=ann", Some(Duration::from_secs(5)));
///     Ok((ep.addr(), r.is_err()))
/// });
/// let req = server.accept(Some(Duration::from_secs(5)))?;
/// assert_eq!(req.data(), b"user=ann");
/// assert_eq!(req.descriptor().len(), 4096);
/// let from = req.from();
/// req.refuse(&server)?; // or `accept`
/// let (client_addr, refused) = client.join().unwrap()?;
/// assert_eq!(from, client_addr);
/// assert!(refused);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ConnectRequest {
    from: EndpointAddr,
    who: PeerIdentity,
    token: u64,
    descriptor: Descriptor,
    data: Vec<u8>,
}

impl std::fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("from", &self.from)
            .field("who", &self.who)
            .field("token", &self.token)
            .field("data_len", &self.data.len())
            .finish_non_exhaustive()
    }
}

impl ConnectRequest {
    /// The client endpoint.
    pub fn from(&self) -> EndpointAddr {
        self.from
    }
    /// Who the client is, as far as the NIC could prove it: a process of this host with its
    /// kernel credentials, or a NIC across a link. Example at [`PeerIdentity`].
    pub fn peer_identity(&self) -> PeerIdentity {
        self.who
    }
    /// The client's descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }
    /// The client's private data (empty unless it used [`Endpoint::connect_with_data`]).
    pub fn data(&self) -> &[u8] {
        &self.data
    }
    /// The connection's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Accept on endpoint `ep` (typically a fresh one for this connection), giving the client
    /// `local` (typically an aperture exported for it). Returns at once: the answer goes out
    /// through the NIC's engine; a client that went away meanwhile shows up as the
    /// connection's end ([`Connection::is_alive`], [`crate::Event::Disconnect`]).
    pub fn accept(self, ep: &Endpoint, local: &Descriptor) -> Result<Connection, ConnectError> {
        self.accept_with_data(ep, local, &[])
    }

    /// [`ConnectRequest::accept`], with private data for the client
    /// ([`Connection::peer_data`]; at most [`MAX_PRIVATE_DATA`] bytes).
    pub fn accept_with_data(self, ep: &Endpoint, local: &Descriptor, data: &[u8]) -> Result<Connection, ConnectError> {
        if data.len() > MAX_PRIVATE_DATA {
            return Err(ConnectError::DataTooLong(data.len()));
        }
        if ep.is_closed() {
            return Err(ConnectError::Closed);
        }
        let nic = &ep.inner.nic;
        let shared = nic.conns.insert(ep.port(), self.token, self.from);
        // The import the client asked for on accept, if it did: its grant goes before the
        // answer, so that it is there when the answer wakes the client.
        nic.grant_on_accept(self.from, self.token, local);
        nic.send_oneway(ep.addr(), self.from, &connect::encode_accept(self.token, &blob(local, data)));
        tracing::debug!(local = %ep.addr(), peer = %self.from, token = self.token, "connection accepted");
        Ok(Connection {
            nic: Arc::downgrade(nic),
            local: ep.addr(),
            peer: self.from,
            who: self.who,
            token: self.token,
            peer_desc: self.descriptor,
            peer_data: self.data,
            shared,
        })
    }

    /// Refuse (the client's connect fails with [`ConnectError::Refused`]). Never waits.
    pub fn refuse(self, ep: &Endpoint) -> Result<(), ConnectError> {
        ep.inner.nic.send_oneway(
            ep.addr(),
            self.from,
            &[connect::encode_refuse(self.token, connect::RefuseReason::Refused)],
        );
        Ok(())
    }
}

/// A connection between two endpoints, with the peer's descriptor. Dropping it closes it.
///
/// Each side exports an aperture and hands its descriptor over in the hand-shake; each then
/// imports the other's:
///
/// ```
/// use std::time::Duration;
///
/// let nic = clan::Nic::open_default()?;
/// let server = nic.endpoint()?;
/// server.listen();
/// let (to, nic2) = (server.addr(), nic.clone());
/// let client = std::thread::spawn(move || -> std::io::Result<_> {
///     let ep = nic2.endpoint()?;
///     let inbox = ep.export(4096)?;
///     let conn = ep.connect(to, &inbox.descriptor(), Some(Duration::from_secs(5)))?;
///     Ok((ep, inbox, conn))
/// });
/// let inbox = server.export(4096)?;
/// let conn = server.accept(Some(Duration::from_secs(5)))?.accept(&server, &inbox.descriptor())?;
/// let (_ep, client_inbox, client_conn) = client.join().unwrap()?;
/// assert_eq!((client_conn.peer(), conn.peer()), (server.addr(), client_conn.local()));
/// assert_eq!(conn.token(), client_conn.token());
/// server.import(conn.peer_descriptor())?.write(0, b"to the client")?;
/// let mut got = [0u8; 13];
/// client_inbox.read(0, &mut got)?;
/// assert_eq!(&got, b"to the client");
/// assert!(conn.is_alive());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Connection {
    nic: Weak<NicInner>,
    local: EndpointAddr,
    peer: EndpointAddr,
    who: PeerIdentity,
    token: u64,
    peer_desc: Descriptor,
    peer_data: Vec<u8>,
    shared: Arc<ConnShared>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.local)
            .field("peer", &self.peer)
            .field("token", &self.token)
            .field("alive", &self.is_alive())
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Our endpoint.
    pub fn local(&self) -> EndpointAddr {
        self.local
    }
    /// The peer endpoint (for a client: the endpoint that accepted, which may differ from
    /// the listening one it dialled).
    pub fn peer(&self) -> EndpointAddr {
        self.peer
    }
    /// Who the peer is, as far as the NIC could prove it (for a server, its client's; for a
    /// client, the process that accepted). Example at [`PeerIdentity`].
    pub fn peer_identity(&self) -> PeerIdentity {
        self.who
    }
    /// The token carried by this connection's [`crate::Event::Disconnect`].
    pub fn token(&self) -> u64 {
        self.token
    }
    /// The descriptor the peer gave.
    pub fn peer_descriptor(&self) -> &Descriptor {
        &self.peer_desc
    }
    /// The private data the peer gave.
    pub fn peer_data(&self) -> &[u8] {
        &self.peer_data
    }
    /// Whether the connection is up (false after the peer closed, died or its link broke);
    /// its end is also posted to the endpoint's event queue.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use clan::Event;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let q = nic.event_queue(clan::EventQueueConfig::default())?;
    /// let server = nic.endpoint_with(clan::EndpointConfig { queue: Some(q.clone()), ..Default::default() })?;
    /// server.listen();
    /// let (to, nic2) = (server.addr(), nic.clone());
    /// let client = std::thread::spawn(move || -> std::io::Result<_> {
    ///     let ep = nic2.endpoint()?;
    ///     let inbox = ep.export(4096)?;
    ///     Ok(ep.connect(to, &inbox.descriptor(), Some(Duration::from_secs(5)))?)
    /// });
    /// let inbox = server.export(4096)?;
    /// let conn = server.accept(Some(Duration::from_secs(5)))?.accept(&server, &inbox.descriptor())?;
    /// client.join().unwrap()?.close(); // the client hangs up
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// loop {
    ///     match q.wait(Some(deadline - Instant::now()))? {
    ///         Event::Disconnect { token, .. } if token == conn.token() => break,
    ///         _ => {} // connection requests arrive as OOB events
    ///     }
    /// }
    /// assert!(!conn.is_alive());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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
            // (nothing waits for it: the peer's streams end in their own memory)
            nic.send_oneway_lazy(self.local, self.peer, connect::encode_close(self.token));
        }
    }
}

fn send_error(to: EndpointAddr, e: OobError) -> ConnectError {
    match e {
        OobError::NoSuchEndpoint(_) | OobError::Unreachable(_) => ConnectError::Refused(to),
        OobError::Timeout => ConnectError::Timeout(to),
        OobError::Closed => ConnectError::Closed,
        other => ConnectError::Oob(other),
    }
}

impl Endpoint {
    /// Wait until `check` (run with the hand-shake state locked) finds something, or
    /// `deadline` passes. With manual progress, replies from other hosts only arrive if
    /// someone drives the links: this thread does.
    fn await_handshake<T>(
        &self,
        deadline: Deadline,
        check: impl FnMut(&mut MutexGuard<'_, Handshakes<EndpointAddr, PeerIdentity>>) -> Option<T>,
    ) -> Option<T> {
        let conns = &self.inner.conns;
        let nic = &self.inner.nic;
        let step = || nic.progress();
        // With manual progress the thread sleeps on the links (it must read them) and on
        // its eventfd, which whatever changes the hand-shakes signals (`Conns::notify`), as
        // does a link opening. Registered before the first check: a change after it leaves
        // the eventfd readable.
        let parked = nic.manual_progress().then(|| nic.links.park()).flatten();
        let park = |nap: Option<Duration>| match &parked {
            Some(p) => p.sleep(nic, nap),
            // No eventfd to be told on (none could be made): look again soon.
            None => std::thread::sleep(nap.map_or(HANDSHAKE_NAP, |n| n.min(HANDSHAKE_NAP))),
        };
        let drive = if nic.manual_progress() {
            progress::Drive::Itself { step: &step, park: Some(&park) }
        } else {
            progress::Drive::Others
        };
        // Without a period: every change a waiter looks for notifies the condition variable
        // (an event of the hand-shakes, `act`; a peer gone, `peer_gone`; the endpoint closed,
        // `EndpointInner::close`), so a thread blocked in `accept` sleeps until then.
        progress::wait_locked(&conns.state, &conns.cv, deadline, None, drive, check)
    }

    /// Accept connection requests from now on (they queue until [`Endpoint::accept`]).
    /// Requests that arrive while not listening are refused. (Examples at [`Connection`]
    /// and [`ConnectError`].)
    pub fn listen(&self) {
        lock(&self.inner.conns.state).listen(true);
    }

    /// Stop listening: queued requests are refused.
    pub fn unlisten(&self) {
        let events = {
            let mut st = lock(&self.inner.conns.state);
            st.listen(false);
            drive(&self.inner, &mut st)
        };
        act(&self.inner, events);
    }

    /// Connect to the listening endpoint `to`, giving it `local`; returns the connection and
    /// the server's descriptor. Waits at most `timeout` (default
    /// [`DEFAULT_CONNECT_TIMEOUT`]) in all. Example at [`Connection`].
    pub fn connect(
        &self,
        to: EndpointAddr,
        local: &Descriptor,
        timeout: Option<Duration>,
    ) -> Result<Connection, ConnectError> {
        self.connect_with_data(to, local, &[], timeout)
    }

    /// [`Endpoint::connect`], with private data for the server
    /// ([`ConnectRequest::data`]; at most [`MAX_PRIVATE_DATA`] bytes).
    pub fn connect_with_data(
        &self,
        to: EndpointAddr,
        local: &Descriptor,
        data: &[u8],
        timeout: Option<Duration>,
    ) -> Result<Connection, ConnectError> {
        self.connect_inner(to, local, data, timeout, false).map(|(c, _)| c)
    }

    /// [`Endpoint::connect_with_data`], importing the descriptor the server answers with as
    /// well: the request for it goes out as soon as the answer comes in, from the thread
    /// that takes it in (the NIC's, usually), before this one is woken, so that its round
    /// trip to the server's NIC overlaps that wake-up. The import is finished by
    /// [`crate::PendingImport::finish`], as for [`Endpoint::import_begin`] (if it could not be
    /// begun at once, as across a link, `finish` makes the whole import). Meant for
    /// protocols that always import the peer's side (every `clan-proto` connection does):
    /// a pending import dropped unfinished is given back.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let (a, b) = (clan::Nic::open_default()?, clan::Nic::open_default()?);
    /// let server = b.endpoint()?;
    /// server.listen();
    /// let to = server.addr();
    /// let inbox = server.export(4096)?;
    /// let accepting = std::thread::spawn(move || -> Result<_, clan::ConnectError> {
    ///     let req = server.accept(Some(Duration::from_secs(5)))?;
    ///     Ok((req.accept(&server, &inbox.descriptor())?, inbox, server))
    /// });
    /// let client = a.endpoint()?;
    /// let mine = client.export(4096)?;
    /// let (conn, pending) = client.connect_importing(to, &mine.descriptor(), &[], Some(Duration::from_secs(5)))?;
    /// let server_inbox = pending.finish(Duration::from_secs(5))?;
    /// server_inbox.store_u64(0, 7)?;
    /// let (_accepted, inbox, _server) = accepting.join().unwrap()?;
    /// assert_eq!((inbox.load_u64(0)?, conn.peer_descriptor()), (7, &inbox.descriptor()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn connect_importing(
        &self,
        to: EndpointAddr,
        local: &Descriptor,
        data: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(Connection, crate::PendingImport), ConnectError> {
        let (conn, begun) = self.connect_inner(to, local, data, timeout, true)?;
        let pending = match begun {
            // Asked on accept and not granted before the answer (the server did not take the
            // request, or refused): asked for now (the request given up: a late grant would
            // be given back).
            Some(p) if !p.answered_on_accept() => {
                drop(p);
                self.import_begin(conn.peer_descriptor())
            }
            Some(p) => crate::endpoint::PendingImport::begun(&self.inner, conn.peer_descriptor(), p),
            None => self.import_begin(conn.peer_descriptor()),
        };
        Ok((conn, pending))
    }

    fn connect_inner(
        &self,
        to: EndpointAddr,
        local: &Descriptor,
        data: &[u8],
        timeout: Option<Duration>,
        import: bool,
    ) -> Result<(Connection, Option<crate::peer::PendingImport>), ConnectError> {
        if data.len() > MAX_PRIVATE_DATA {
            return Err(ConnectError::DataTooLong(data.len()));
        }
        if self.is_closed() {
            return Err(ConnectError::Closed);
        }
        let timeout = timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        let _span = tracing::debug_span!("connect", local = %self.addr(), peer = %to).entered();
        let deadline = Instant::now() + timeout;
        let token = random_token();
        let conns = &self.inner.conns;
        let nic = &self.inner.nic;
        let msgs = lock(&conns.state).dial(to, token, &blob(local, data), timeout).ok_or(ConnectError::TooMany)?;
        if import {
            // The server's NIC is asked to grant the import as it accepts, on the connection
            // the request then goes on, just before it (`crate::onaccept`); failing that, the
            // import is begun as the answer comes in (`on_message`).
            let on_accept = crate::peer::try_begin_on_accept(&self.inner, to.nic, token);
            lock(&conns.prefetch).insert(token, on_accept);
        }
        // Whatever the outcome, the dial's import slot goes (an import begun for a dial that
        // failed is given back when dropped).
        // (the table's storage goes with its last dial: an endpoint dials once and then keeps
        // its connection, and thousands of them would each keep it)
        let take_import = || {
            if !import {
                return None;
            }
            let mut p = lock(&conns.prefetch);
            let taken = p.remove(&token).flatten();
            if p.is_empty() {
                p.shrink_to_fit();
            }
            taken
        };
        // Registered before the request goes out: a close that follows the answer at once is
        // never missed.
        let shared = nic.conns.insert(self.port(), token, to);
        let give_up = |send_close: bool| {
            let close = lock(&conns.state).cancel_dial(token);
            nic.conns.forget(self.port(), token);
            if let (Some((peer, p)), true) = (close, send_close) {
                nic.outbox(self.addr(), peer, p);
            }
        };
        // All the fragments at once. When a control connection to that NIC is up already,
        // one-way, without waiting for the delivery result (an undeliverable request is
        // refused by the server's NIC); otherwise one round trip, which also tells us at once
        // whether the NIC exists.
        if !nic.send_oneway_direct(self.addr(), to, &msgs) {
            if let Err(e) = self.send_oobs_until(to, &msgs, deadline) {
                give_up(msgs.len() > 1);
                take_import();
                tracing::debug!(local = %self.addr(), peer = %to, "connect failed: {e}");
                return Err(send_error(to, e));
            }
        }
        enum Outcome {
            Answer(Answer<EndpointAddr, PeerIdentity>),
            Gone,
            Closed,
        }
        // (counted before it looks at `alive`: `Conns::disconnect` tells it then)
        conns.dialling.enter();
        let outcome = self.await_handshake(Deadline::at(deadline), |st| {
            if let Some(a) = st.take_answer(token) {
                return Some(Outcome::Answer(a));
            }
            if !shared.alive.load(Ordering::Acquire) {
                return Some(Outcome::Gone);
            }
            self.is_closed().then_some(Outcome::Closed)
        });
        conns.dialling.leave();
        let begun = take_import();
        match outcome {
            Some(Outcome::Answer(Answer::Accepted { from, who, desc })) => match unblob(&desc) {
                Some((peer_desc, peer_data)) => {
                    nic.conns.set_peer(self.port(), token, from);
                    tracing::debug!(local = %self.addr(), peer = %from, token, "connected");
                    let conn = Connection {
                        nic: Arc::downgrade(nic),
                        local: self.addr(),
                        peer: from,
                        who,
                        token,
                        peer_desc,
                        peer_data,
                        shared,
                    };
                    Ok((conn, begun))
                }
                None => {
                    nic.conns.forget(self.port(), token);
                    nic.outbox(self.addr(), from, connect::encode_close(token));
                    Err(ConnectError::BadDescriptor(from))
                }
            },
            Some(Outcome::Answer(Answer::Refused(reason))) => {
                nic.conns.forget(self.port(), token);
                tracing::debug!(local = %self.addr(), peer = %to, ?reason, "connection refused");
                Err(ConnectError::Refused(to))
            }
            Some(Outcome::Answer(Answer::Closed)) => {
                nic.conns.forget(self.port(), token);
                Err(ConnectError::PeerGone(to))
            }
            Some(Outcome::Gone) => {
                give_up(false);
                Err(ConnectError::PeerGone(to))
            }
            Some(Outcome::Closed) => {
                give_up(true);
                Err(ConnectError::Closed)
            }
            None => {
                give_up(true);
                tracing::debug!(local = %self.addr(), peer = %to, "connect timed out");
                Err(ConnectError::Timeout(to))
            }
        }
    }

    /// Wait for a connection request (after [`Endpoint::listen`]). Only requests that can
    /// still be answered are returned: one whose client gave up, died or sent a malformed
    /// descriptor is dropped here, never reported. Example at [`ConnectRequest`].
    pub fn accept(&self, timeout: Option<Duration>) -> Result<ConnectRequest, ConnectError> {
        self.await_handshake(Deadline::after(timeout), |st| match self.pop_valid(st) {
            Some(r) => Some(Ok(r)),
            None => self.is_closed().then_some(Err(ConnectError::Closed)),
        })
        .unwrap_or(Err(ConnectError::NoRequest))
    }

    fn pop_valid(&self, st: &mut Handshakes<EndpointAddr, PeerIdentity>) -> Option<ConnectRequest> {
        while let Some(r) = st.pop_request(Instant::now()) {
            match unblob(&r.desc) {
                Some((descriptor, data)) => {
                    return Some(ConnectRequest { from: r.from, who: r.who, token: r.token, descriptor, data });
                }
                None => {
                    tracing::debug!(local = %self.addr(), peer = %r.from, "refused a request with a malformed descriptor");
                    self.inner.nic.outbox(
                        self.addr(),
                        r.from,
                        connect::encode_refuse(r.token, connect::RefuseReason::Refused),
                    );
                }
            }
        }
        None
    }

    /// A connection request, if one is waiting (never blocks).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let server = nic.endpoint()?;
    /// server.listen();
    /// assert!(server.try_accept().is_none());
    /// let (to, nic2) = (server.addr(), nic.clone());
    /// let client = std::thread::spawn(move || -> std::io::Result<bool> {
    ///     let ep = nic2.endpoint()?;
    ///     let inbox = ep.export(4096)?;
    ///     Ok(ep.connect(to, &inbox.descriptor(), Some(Duration::from_secs(5))).is_ok())
    /// });
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// let req = loop {
    ///     if let Some(r) = server.try_accept() {
    ///         break r;
    ///     }
    ///     assert!(Instant::now() < deadline, "no request came");
    ///     std::thread::sleep(Duration::from_millis(1)); // a real loop does other work here
    /// };
    /// let inbox = server.export(4096)?;
    /// let _conn = req.accept(&server, &inbox.descriptor())?;
    /// assert!(client.join().unwrap()?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_accept(&self) -> Option<ConnectRequest> {
        let mut st = lock(&self.inner.conns.state);
        self.pop_valid(&mut st)
    }
}
