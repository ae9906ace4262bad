//! Connections between endpoints, sans-IO: the connect/accept hand-shake carried by
//! out-of-band messages, and the per-endpoint state that drives it.
//!
//! A client sends `CONNECT(token, timeout, its descriptor)`; a listening endpoint queues the
//! request (its *backlog*) until the application accepts it, then answers
//! `ACCEPT(token, its descriptor)`, or `REFUSE(token, reason)`. Either side may send
//! `CLOSE(token)`: before the answer it withdraws the request (a client that gave up), after
//! it ends the connection. A descriptor is longer than one 40-byte payload, so `CONNECT` and
//! `ACCEPT` carry its first bytes and `FRAG` messages the rest.
//!
//! ```text
//! payload (40 bytes):  C1 A7 | kind u8 | token u64 | …
//!   1 CONNECT  total u16, timeout_ms u32, first 23 descriptor bytes
//!   2 ACCEPT   total u16, first 27 descriptor bytes
//!   3 REFUSE   reason u8
//!   4 CLOSE
//!   5 FRAG     index u8 (1, 2, …), next 28 descriptor bytes
//! ```
//!
//! [`Handshakes`] is one endpoint's state. It keeps nothing unbounded and nothing forever:
//! partly received messages, queued requests and dials all have limits and expire
//! ([`Limits`]). A request withdrawn by its client, expired, or from a peer that went away
//! ([`Handshakes::peers_gone`]) never reaches the application: `accept` only ever sees
//! requests that can still be answered, and one client's failure is never reported to
//! another's `accept` (as in Linux). Messages may be lost, duplicated or reordered: a
//! duplicate of a queued request is ignored, a fragment without its head is dropped, and the
//! client's own deadline covers a lost answer.
//!
//! Peers are named by a type of the driver's ([`Peer`]), which must be what the transport
//! *verified* the message came from: the machine trusts it. A server may answer from another
//! endpoint than the one dialled (a fresh endpoint per connection), on the same node: that
//! endpoint is the connection's peer from then on ([`Answer::Accepted`]). An `ACCEPT` that
//! answers no dial (a client that gave up) is answered with `CLOSE`, so the server never keeps
//! a connection its client does not have.
//!
//! Each message may also carry *who* sent it, as far as the transport could prove it (a
//! second type of the driver's, [`Sender`]: a process's kernel credentials, say). A request
//! and an answer keep the identity their first message came with ([`Request::who`],
//! [`Answer::Accepted`]), and the limits that protect one client from another are kept per
//! user as well as per endpoint ([`Limits::backlog_per_user`]): a user with many endpoints
//! still cannot fill the backlog. A driver that proves nothing uses `()` (one user for all)
//! and [`Handshakes::handle_message`].

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Size of an out-of-band payload.
pub const PAYLOAD: usize = 40;
/// The first two bytes of every message of this protocol (other payloads are the
/// application's).
pub const MAGIC: [u8; 2] = [0xC1, 0xA7];
/// Longest descriptor a hand-shake carries.
pub const MAX_DESC: usize = 23 + 255 * 28;

const K_CONNECT: u8 = 1;
const K_ACCEPT: u8 = 2;
const K_REFUSE: u8 = 3;
const K_CLOSE: u8 = 4;
const K_FRAG: u8 = 5;
const HEAD: usize = 11;
const CONNECT_FIRST: usize = PAYLOAD - HEAD - 6;
const ACCEPT_FIRST: usize = PAYLOAD - HEAD - 2;
const FRAG_LEN: usize = PAYLOAD - HEAD - 1;

/// One out-of-band payload.
pub type Payload = [u8; PAYLOAD];

/// Whether `p` belongs to this protocol.
pub fn is_handshake(p: &Payload) -> bool {
    p[..2] == MAGIC
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefuseReason {
    /// The application refused it.
    Refused,
    /// The endpoint is not listening.
    NotListening,
    /// The backlog is full.
    BacklogFull,
    /// The server gave up on it (expired before it was accepted).
    Expired,
    /// A reason this version does not know.
    Other,
}

impl RefuseReason {
    fn from_u8(b: u8) -> RefuseReason {
        match b {
            1 => RefuseReason::Refused,
            2 => RefuseReason::NotListening,
            3 => RefuseReason::BacklogFull,
            4 => RefuseReason::Expired,
            _ => RefuseReason::Other,
        }
    }
    fn to_u8(self) -> u8 {
        match self {
            RefuseReason::Refused => 1,
            RefuseReason::NotListening => 2,
            RefuseReason::BacklogFull => 3,
            RefuseReason::Expired => 4,
            RefuseReason::Other => 255,
        }
    }
}

/// A decoded message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    /// A connection request (with the first bytes of the client's descriptor).
    Connect {
        /// The connection's token (chosen by the client).
        token: u64,
        /// Bytes of the descriptor in all.
        total: u16,
        /// How long the client waits for an answer.
        timeout_ms: u32,
        /// The first bytes.
        chunk: &'a [u8],
    },
    /// The answer (with the first bytes of the server's descriptor).
    Accept {
        /// The token.
        token: u64,
        /// Bytes of the descriptor in all.
        total: u16,
        /// The first bytes.
        chunk: &'a [u8],
    },
    /// More descriptor bytes.
    Frag {
        /// The token.
        token: u64,
        /// 1 for the first fragment after the head.
        index: u8,
        /// Bytes (the receiver takes what it still needs).
        chunk: &'a [u8],
    },
    /// A refusal.
    Refuse {
        /// The token.
        token: u64,
        /// Why.
        reason: RefuseReason,
    },
    /// Withdraw the request, or end the connection.
    Close {
        /// The token.
        token: u64,
    },
}

/// A payload that is not a message of this protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotHandshake;

impl std::fmt::Display for NotHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not a connection hand-shake message")
    }
}

impl std::error::Error for NotHandshake {}

impl Message<'_> {
    /// Decode one payload. Never panics.
    pub fn decode(p: &Payload) -> Result<Message<'_>, NotHandshake> {
        if !is_handshake(p) {
            return Err(NotHandshake);
        }
        let token = u64::from_le_bytes(p[3..11].try_into().map_err(|_| NotHandshake)?);
        let u16_at = |i: usize| u16::from_le_bytes([p[i], p[i + 1]]);
        Ok(match p[2] {
            K_CONNECT => Message::Connect {
                token,
                total: u16_at(HEAD),
                timeout_ms: u32::from_le_bytes([p[HEAD + 2], p[HEAD + 3], p[HEAD + 4], p[HEAD + 5]]),
                chunk: &p[HEAD + 6..],
            },
            K_ACCEPT => Message::Accept { token, total: u16_at(HEAD), chunk: &p[HEAD + 2..] },
            K_FRAG => Message::Frag { token, index: p[HEAD], chunk: &p[HEAD + 1..] },
            K_REFUSE => Message::Refuse { token, reason: RefuseReason::from_u8(p[HEAD]) },
            K_CLOSE => Message::Close { token },
            _ => return Err(NotHandshake),
        })
    }
}

fn header(kind: u8, token: u64) -> Payload {
    let mut p = [0u8; PAYLOAD];
    p[..2].copy_from_slice(&MAGIC);
    p[2] = kind;
    p[3..11].copy_from_slice(&token.to_le_bytes());
    p
}

fn with_desc(mut first: Payload, at: usize, room: usize, token: u64, desc: &[u8]) -> Vec<Payload> {
    let n = desc.len().min(room);
    first[at..at + n].copy_from_slice(&desc[..n]);
    let mut out = vec![first];
    for (i, c) in desc[n..].chunks(FRAG_LEN).enumerate() {
        let mut f = header(K_FRAG, token);
        f[HEAD] = (i + 1) as u8;
        f[HEAD + 1..HEAD + 1 + c.len()].copy_from_slice(c);
        out.push(f);
    }
    out
}

/// The messages of a `CONNECT` carrying `desc` (at most [`MAX_DESC`] bytes: longer is cut).
pub fn encode_connect(token: u64, timeout: Duration, desc: &[u8]) -> Vec<Payload> {
    let desc = &desc[..desc.len().min(MAX_DESC)];
    let mut p = header(K_CONNECT, token);
    p[HEAD..HEAD + 2].copy_from_slice(&(desc.len() as u16).to_le_bytes());
    let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    p[HEAD + 2..HEAD + 6].copy_from_slice(&ms.to_le_bytes());
    with_desc(p, HEAD + 6, CONNECT_FIRST, token, desc)
}

/// The messages of an `ACCEPT` carrying `desc`.
pub fn encode_accept(token: u64, desc: &[u8]) -> Vec<Payload> {
    let desc = &desc[..desc.len().min(MAX_DESC)];
    let mut p = header(K_ACCEPT, token);
    p[HEAD..HEAD + 2].copy_from_slice(&(desc.len() as u16).to_le_bytes());
    with_desc(p, HEAD + 2, ACCEPT_FIRST, token, desc)
}

/// A `REFUSE`.
pub fn encode_refuse(token: u64, reason: RefuseReason) -> Payload {
    let mut p = header(K_REFUSE, token);
    p[HEAD] = reason.to_u8();
    p
}

/// A `CLOSE`.
pub fn encode_close(token: u64) -> Payload {
    header(K_CLOSE, token)
}

/// How the driver names endpoints.
pub trait Peer: Copy + Eq + Hash + std::fmt::Debug {
    /// Whether the two are on the same node (NIC): an answer to a dial may come from any
    /// endpoint of the dialled node.
    fn same_node(&self, other: &Self) -> bool {
        self == other
    }
}

impl Peer for u32 {}

/// What the transport proved of a message's sender ([`Handshakes::handle_message_from`]).
pub trait Sender: Copy + std::fmt::Debug {
    /// Whether the two are the same user: their requests and partial messages share one
    /// bound ([`Limits::backlog_per_user`], [`Limits::max_partial_per_user`]).
    fn same_user(&self, other: &Self) -> bool;
}

/// Nothing proven: every sender is the same user.
impl Sender for () {
    fn same_user(&self, _: &()) -> bool {
        true
    }
}

/// A user id (for tests and simple drivers).
impl Sender for u32 {
    fn same_user(&self, other: &u32) -> bool {
        self == other
    }
}

/// Bounds of one endpoint's hand-shake state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Messages being reassembled, in all.
    pub max_partial: usize,
    /// Messages being reassembled from one peer.
    pub max_partial_per_peer: usize,
    /// Messages being reassembled from one user ([`Sender::same_user`]), all its endpoints
    /// together.
    pub max_partial_per_user: usize,
    /// A partial message not completed within this is dropped.
    pub partial_ttl: Duration,
    /// Requests queued for the application.
    pub backlog: usize,
    /// Requests queued from one peer.
    pub backlog_per_peer: usize,
    /// Requests queued from one user ([`Sender::same_user`]), all its endpoints together.
    pub backlog_per_user: usize,
    /// A queued request expires after the client's own timeout, but never later than this.
    pub max_request_ttl: Duration,
    /// Connections being dialled at once.
    pub max_dials: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_partial: 1024,
            max_partial_per_peer: 64,
            max_partial_per_user: 256,
            partial_ttl: Duration::from_secs(10),
            backlog: 1024,
            backlog_per_peer: 256,
            backlog_per_user: 512,
            max_request_ttl: Duration::from_secs(60),
            max_dials: 4096,
        }
    }
}

/// A complete connection request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<P, W = ()> {
    /// The client (as the transport verified it).
    pub from: P,
    /// Who sent it, as the transport proved it (with the request's first message).
    pub who: W,
    /// The connection's token.
    pub token: u64,
    /// The client's descriptor, in its binary form (not yet parsed).
    pub desc: Vec<u8>,
    /// When the client stops waiting.
    pub expires: Instant,
}

/// The server's answer to a dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer<P, W = ()> {
    /// Accepted by endpoint `from` (the connection's peer), with its descriptor (binary
    /// form, not yet parsed).
    Accepted {
        /// The server's endpoint for this connection.
        from: P,
        /// Who sent the answer, as the transport proved it.
        who: W,
        /// Its descriptor.
        desc: Vec<u8>,
    },
    /// Refused.
    Refused(RefuseReason),
    /// The server closed before answering, or went away.
    Closed,
}

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<P> {
    /// A request is waiting in the backlog (wake `accept`).
    Request,
    /// The dial with this token has its answer (wake `connect`).
    Answered(u64),
    /// The peer closed connection `token` (one the application holds, or held).
    Closed {
        /// The peer.
        from: P,
        /// The connection's token.
        token: u64,
    },
}

#[derive(Debug)]
struct Partial<W> {
    kind: u8,
    who: W,
    total: usize,
    next: u8,
    data: Vec<u8>,
    timeout_ms: u32,
    expires: Instant,
}

#[derive(Debug)]
struct Dial<P, W> {
    peer: P,
    answer: Option<Answer<P, W>>,
}

/// One endpoint's connection hand-shakes: its backlog (when listening) and its dials.
#[derive(Debug)]
pub struct Handshakes<P, W = ()> {
    limits: Limits,
    listening: bool,
    /// The tables, allocated while a hand-shake is under way and let go of once they are all
    /// empty again ([`Handshakes::let_go`]).
    t: Option<Box<Tables<P, W>>>,
}

/// What [`Handshakes`] holds while hand-shakes are under way.
#[derive(Debug)]
struct Tables<P, W> {
    partial: HashMap<(P, u64), Partial<W>>,
    backlog: VecDeque<Request<P, W>>,
    dials: HashMap<u64, Dial<P, W>>,
    out: VecDeque<(P, Payload)>,
    events: VecDeque<Event<P>>,
}

impl<P, W> Default for Tables<P, W> {
    fn default() -> Self {
        Tables {
            partial: HashMap::new(),
            backlog: VecDeque::new(),
            dials: HashMap::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
        }
    }
}

impl<P, W> Tables<P, W> {
    fn is_empty(&self) -> bool {
        self.partial.is_empty()
            && self.backlog.is_empty()
            && self.dials.is_empty()
            && self.out.is_empty()
            && self.events.is_empty()
    }
}

impl<P: Peer, W: Sender + Default> Handshakes<P, W> {
    /// A message of this protocol arrived from `from` (verified by the transport), which
    /// proved nothing more of its sender (`W::default()`).
    pub fn handle_message(&mut self, from: P, payload: &Payload, now: Instant) {
        self.handle_message_from(from, W::default(), payload, now);
    }
}

impl<P: Peer, W: Sender> Handshakes<P, W> {
    /// Empty state with `limits`, not listening.
    pub fn new(limits: Limits) -> Handshakes<P, W> {
        Handshakes { limits, listening: false, t: None }
    }

    /// The tables, allocated if need be (by whatever may add to them; [`Handshakes::let_go`]
    /// follows).
    fn t(&mut self) -> &mut Tables<P, W> {
        self.t.get_or_insert_with(Box::default)
    }

    /// Whether requests are queued (rather than refused).
    pub fn is_listening(&self) -> bool {
        self.listening
    }

    /// Start or stop listening; stopping refuses what the backlog holds.
    pub fn listen(&mut self, on: bool) {
        self.listening = on;
        if !on {
            if let Some(t) = self.t.as_deref_mut() {
                for r in std::mem::take(&mut t.backlog) {
                    t.out.push_back((r.from, encode_refuse(r.token, RefuseReason::NotListening)));
                }
            }
        }
    }

    /// Requests waiting.
    pub fn backlog_len(&self) -> usize {
        self.t.as_ref().map_or(0, |t| t.backlog.len())
    }

    /// Partial messages held.
    pub fn partial_len(&self) -> usize {
        self.t.as_ref().map_or(0, |t| t.partial.len())
    }

    /// Dials in progress.
    pub fn dials_len(&self) -> usize {
        self.t.as_ref().map_or(0, |t| t.dials.len())
    }

    /// Whether any storage is held (tables allocated): none once every hand-shake is over
    /// and its messages and events were taken.
    pub fn holds_storage(&self) -> bool {
        self.t.is_some()
    }

    /// A message of this protocol arrived from `from` (verified by the transport), sent by
    /// `who` (what the transport proved of its sender).
    pub fn handle_message_from(&mut self, from: P, who: W, payload: &Payload, now: Instant) {
        self.take_message(from, who, payload, now);
        self.let_go();
    }

    /// Let go of the storage of what is empty again. An endpoint makes a hand-shake or two
    /// and then keeps its connection for long: at thousands of connections, the tables a
    /// finished hand-shake left allocated were about 1 KiB of each client endpoint (`clan
    /// bench server`'s resident memory per endpoint), and the empty tables themselves a few
    /// hundred bytes more. Once all are empty, they go (one allocation fewer: the box);
    /// otherwise the empty ones shrink. A listener that goes on taking requests allocates
    /// them again for the next one: one allocation in a hand-shake of messages.
    fn let_go(&mut self) {
        let Some(t) = self.t.as_deref_mut() else { return };
        if t.is_empty() {
            self.t = None;
            return;
        }
        if t.partial.is_empty() && t.partial.capacity() > 0 {
            t.partial.shrink_to_fit();
        }
        if t.dials.is_empty() && t.dials.capacity() > 0 {
            t.dials.shrink_to_fit();
        }
        for q in [&mut t.out as &mut dyn Shrink, &mut t.events, &mut t.backlog] {
            q.shrink_if_empty();
        }
    }

    fn take_message(&mut self, from: P, who: W, payload: &Payload, now: Instant) {
        let Ok(m) = Message::decode(payload) else { return };
        match m {
            Message::Connect { token, total, timeout_ms, chunk } => {
                self.head(from, who, K_CONNECT, token, total, timeout_ms, chunk, now)
            }
            Message::Accept { token, total, chunk } => self.head(from, who, K_ACCEPT, token, total, 0, chunk, now),
            Message::Frag { token, index, chunk } => {
                let Some(t) = self.t.as_deref_mut() else { return };
                let Some(p) = t.partial.get_mut(&(from, token)) else { return };
                if index < p.next {
                    return; // a duplicate of a fragment we have
                }
                if index != p.next {
                    // One is missing (lost, or reordered): the message cannot be rebuilt.
                    t.partial.remove(&(from, token));
                    return;
                }
                let n = (p.total - p.data.len()).min(chunk.len());
                p.data.extend_from_slice(&chunk[..n]);
                p.next = p.next.wrapping_add(1);
                if p.data.len() == p.total {
                    if let Some(p) = t.partial.remove(&(from, token)) {
                        self.complete(from, p.who, token, p.kind, p.data, p.timeout_ms, now);
                    }
                }
            }
            Message::Refuse { token, reason } => self.answer(from, token, Answer::Refused(reason)),
            Message::Close { token } => {
                if let Some(t) = self.t.as_deref_mut() {
                    t.partial.remove(&(from, token));
                    let before = t.backlog.len();
                    t.backlog.retain(|r| !(r.from == from && r.token == token));
                    if t.backlog.len() != before {
                        return; // a request withdrawn before it was accepted
                    }
                }
                if self.answerable(from, token) {
                    return self.answer(from, token, Answer::Closed);
                }
                self.t().events.push_back(Event::Closed { from, token });
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn head(&mut self, from: P, who: W, kind: u8, token: u64, total: u16, timeout_ms: u32, chunk: &[u8], now: Instant) {
        let total = usize::from(total);
        if total == 0 || total > MAX_DESC {
            return;
        }
        if kind == K_ACCEPT && !self.answerable(from, token) {
            // An answer nobody waits for (a dial given up): the server must not keep it.
            let t = self.t();
            if !t.dials.contains_key(&token) {
                t.out.push_back((from, encode_close(token)));
            }
            return;
        }
        let n = total.min(chunk.len());
        if n == total {
            return self.complete(from, who, token, kind, chunk[..n].to_vec(), timeout_ms, now);
        }
        let limits = self.limits;
        let t = self.t();
        if t.partial.contains_key(&(from, token)) {
            return; // a duplicate head
        }
        t.partial.retain(|_, p| p.expires > now);
        let mine = t.partial.keys().filter(|(p, _)| *p == from).count();
        let users = t.partial.values().filter(|p| p.who.same_user(&who)).count();
        if t.partial.len() >= limits.max_partial
            || mine >= limits.max_partial_per_peer
            || users >= limits.max_partial_per_user
        {
            // Full: the new message is dropped (its sender's deadline covers it), never an
            // older one (a flood cannot push out other peers' hand-shakes).
            if kind == K_CONNECT {
                t.out.push_back((from, encode_refuse(token, RefuseReason::BacklogFull)));
            }
            return;
        }
        t.partial.insert(
            (from, token),
            Partial {
                kind,
                who,
                total,
                next: 1,
                data: chunk[..n].to_vec(),
                timeout_ms,
                expires: now + limits.partial_ttl,
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(&mut self, from: P, who: W, token: u64, kind: u8, desc: Vec<u8>, timeout_ms: u32, now: Instant) {
        if kind == K_ACCEPT {
            return self.answer(from, token, Answer::Accepted { from, who, desc });
        }
        if !self.listening {
            self.t().out.push_back((from, encode_refuse(token, RefuseReason::NotListening)));
            return;
        }
        let limits = self.limits;
        let t = self.t();
        if t.backlog.iter().any(|r| r.from == from && r.token == token) {
            return; // a duplicate
        }
        // A client waits no longer than its timeout: a request past it is dropped without
        // an answer (a refusal would reach nobody).
        t.backlog.retain(|r| r.expires > now);
        let mine = t.backlog.iter().filter(|r| r.from == from).count();
        let users = t.backlog.iter().filter(|r| r.who.same_user(&who)).count();
        if t.backlog.len() >= limits.backlog || mine >= limits.backlog_per_peer || users >= limits.backlog_per_user {
            t.out.push_back((from, encode_refuse(token, RefuseReason::BacklogFull)));
            return;
        }
        let ttl = Duration::from_millis(u64::from(timeout_ms)).min(limits.max_request_ttl);
        t.backlog.push_back(Request { from, who, token, desc, expires: now + ttl });
        t.events.push_back(Event::Request);
    }

    fn answerable(&self, from: P, token: u64) -> bool {
        self.t.as_ref().and_then(|t| t.dials.get(&token)).is_some_and(|d| d.peer.same_node(&from) && d.answer.is_none())
    }

    fn answer(&mut self, from: P, token: u64, a: Answer<P, W>) {
        if self.answerable(from, token) {
            let t = self.t();
            if let Some(d) = t.dials.get_mut(&token) {
                d.answer = Some(a);
                t.events.push_back(Event::Answered(token));
            }
        }
    }

    /// Drop what expired (partial messages, requests past their client's timeout).
    fn expire(&mut self, now: Instant) {
        if let Some(t) = self.t.as_deref_mut() {
            t.partial.retain(|_, p| p.expires > now);
            t.backlog.retain(|r| r.expires > now);
        }
    }

    /// The oldest request that can still be answered (expired ones are dropped).
    pub fn pop_request(&mut self, now: Instant) -> Option<Request<P, W>> {
        let t = self.t.as_deref_mut()?;
        t.backlog.retain(|r| r.expires > now);
        let r = t.backlog.pop_front();
        self.let_go();
        r
    }

    /// Start dialling `peer` with `token`; returns the messages to send, or None if too many
    /// dials are in progress or the token is taken.
    pub fn dial(&mut self, peer: P, token: u64, desc: &[u8], timeout: Duration) -> Option<Vec<Payload>> {
        if self.dials_len() >= self.limits.max_dials || self.t.as_ref().is_some_and(|t| t.dials.contains_key(&token)) {
            return None;
        }
        self.t().dials.insert(token, Dial { peer, answer: None });
        Some(encode_connect(token, timeout, desc))
    }

    /// The answer to dial `token`, if there is one yet, left in place.
    pub fn peek_answer(&self, token: u64) -> Option<&Answer<P, W>> {
        self.t.as_ref()?.dials.get(&token)?.answer.as_ref()
    }

    /// The answer to dial `token`, once there is one (the dial is then over).
    pub fn take_answer(&mut self, token: u64) -> Option<Answer<P, W>> {
        let t = self.t.as_deref_mut()?;
        if t.dials.get(&token)?.answer.is_some() {
            let a = t.dials.remove(&token).and_then(|d| d.answer);
            self.let_go();
            return a;
        }
        None
    }

    /// Give up dial `token`: returns the `CLOSE` that withdraws it (to send to the peer).
    pub fn cancel_dial(&mut self, token: u64) -> Option<(P, Payload)> {
        let d = self.t.as_deref_mut()?.dials.remove(&token)?;
        self.let_go();
        Some((d.peer, encode_close(token)))
    }

    /// The peers for which `gone` holds went away (a process died, a link broke): forget
    /// what they sent and fail the dials to them.
    pub fn peers_gone(&mut self, gone: impl Fn(&P) -> bool) {
        let Some(t) = self.t.as_deref_mut() else { return };
        t.partial.retain(|(p, _), _| !gone(p));
        t.backlog.retain(|r| !gone(&r.from));
        let tokens: Vec<(u64, P)> =
            t.dials.iter().filter(|(_, d)| gone(&d.peer) && d.answer.is_none()).map(|(t, d)| (*t, d.peer)).collect();
        for (t, p) in tokens {
            self.answer(p, t, Answer::Closed);
        }
        self.let_go();
    }

    /// Time passed: drop what expired.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.expire(now);
        self.let_go();
    }

    /// When [`Handshakes::handle_timeout`] has something to drop.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let t = self.t.as_ref()?;
        t.partial.values().map(|p| p.expires).chain(t.backlog.iter().map(|r| r.expires)).min()
    }

    /// A message to send.
    pub fn poll_transmit(&mut self) -> Option<(P, Payload)> {
        let m = self.t.as_deref_mut()?.out.pop_front();
        if m.is_none() {
            self.let_go();
        }
        m
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event<P>> {
        let e = self.t.as_deref_mut()?.events.pop_front();
        if e.is_none() {
            self.let_go();
        }
        e
    }
}

/// A queue whose storage an empty [`Handshakes`] lets go of.
trait Shrink {
    fn shrink_if_empty(&mut self);
}

impl<T> Shrink for VecDeque<T> {
    fn shrink_if_empty(&mut self) {
        if self.is_empty() && self.capacity() > 0 {
            self.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn connect_accept_round_trip_with_fragments() {
        let now = Instant::now();
        let mut server = Handshakes::<u32>::new(Limits::default());
        let mut client = Handshakes::<u32>::new(Limits::default());
        server.listen(true);
        for n in [1, 23, 24, 100, 124, 500] {
            let msgs = client.dial(2, n as u64, &desc(n), Duration::from_secs(1)).unwrap();
            for m in &msgs {
                server.handle_message(1, m, now);
            }
            let r = server.pop_request(now).unwrap();
            assert_eq!((r.from, r.token, r.desc), (1, n as u64, desc(n)));
            for m in encode_accept(r.token, &desc(n + 1)) {
                client.handle_message(2, &m, now);
            }
            assert_eq!(client.take_answer(n as u64), Some(Answer::Accepted { from: 2, who: (), desc: desc(n + 1) }));
        }
    }

    /// Both sides hold no storage once a hand-shake is over and its messages and events are
    /// taken: thousands of endpoints keep their connections, not their hand-shakes' tables.
    #[test]
    fn a_finished_hand_shake_holds_no_storage() {
        let now = Instant::now();
        let mut server = Handshakes::<u32>::new(Limits::default());
        let mut client = Handshakes::<u32>::new(Limits::default());
        server.listen(true);
        let empty = |h: &Handshakes<u32>| !h.holds_storage() && h.t.is_none();
        for round in 0..3u64 {
            // (a request in fragments: the server's partial table is used)
            let msgs = client.dial(2, round, &desc(300), Duration::from_secs(1)).unwrap();
            assert!(msgs.len() > 2);
            assert!(client.holds_storage());
            for m in &msgs {
                server.handle_message(1, m, now);
            }
            let r = server.pop_request(now).unwrap();
            for m in encode_accept(r.token, &desc(200)) {
                client.handle_message(2, &m, now);
            }
            while server.poll_transmit().is_some() || server.poll_event().is_some() {}
            while client.poll_event().is_some() || client.poll_transmit().is_some() {}
            assert!(matches!(client.take_answer(round), Some(Answer::Accepted { .. })));
            assert!(empty(&client) && empty(&server), "round {round}");
        }
        // A dial given up, a message from a peer that then went: nothing held either.
        let _ = client.dial(2, 9, &desc(10), Duration::from_secs(1)).unwrap();
        assert!(client.cancel_dial(9).is_some());
        let msgs = encode_connect(10, Duration::from_secs(1), &desc(300));
        server.handle_message(5, &msgs[0], now);
        assert!(server.holds_storage());
        server.peers_gone(|p| *p == 5);
        assert!(empty(&client) && empty(&server));
    }

    #[test]
    fn requests_and_answers_keep_the_identity_of_their_first_message() {
        let now = Instant::now();
        let mut server = Handshakes::<u32, u32>::new(Limits::default());
        let mut client = Handshakes::<u32, u32>::new(Limits::default());
        server.listen(true);
        let msgs = client.dial(2, 9, &desc(200), Duration::from_secs(1)).unwrap();
        assert!(msgs.len() > 2, "the request must be in fragments");
        // The head came with identity 70; its fragments cannot change who asked.
        server.handle_message_from(1, 70, &msgs[0], now);
        for m in &msgs[1..] {
            server.handle_message_from(1, 71, m, now);
        }
        let r = server.pop_request(now).unwrap();
        assert_eq!((r.from, r.who, r.token), (1, 70, 9));
        for m in encode_accept(9, &desc(3)) {
            client.handle_message_from(2, 80, &m, now);
        }
        assert_eq!(client.take_answer(9), Some(Answer::Accepted { from: 2, who: 80, desc: desc(3) }));
    }

    #[test]
    fn one_user_with_many_endpoints_cannot_fill_the_backlog() {
        let now = Instant::now();
        let limits = Limits { backlog: 8, backlog_per_peer: 2, backlog_per_user: 4, ..Limits::default() };
        let mut s = Handshakes::<u32, u32>::new(limits);
        s.listen(true);
        // User 66 from endpoints 1..=6, two requests each: four are queued, the rest refused.
        for (token, ep) in (0..12u64).map(|t| (t, 1 + (t / 2) as u32)) {
            for m in encode_connect(token, Duration::from_secs(10), &desc(10)) {
                s.handle_message_from(ep, 66, &m, now);
            }
        }
        assert_eq!(s.backlog_len(), 4);
        let refused = std::iter::from_fn(|| s.poll_transmit())
            .filter(|(_, m)| {
                matches!(Message::decode(m), Ok(Message::Refuse { reason: RefuseReason::BacklogFull, .. }))
            })
            .count();
        assert_eq!(refused, 8);
        // Another user still gets in, up to its own share.
        for m in encode_connect(100, Duration::from_secs(10), &desc(10)) {
            s.handle_message_from(50, 7, &m, now);
        }
        assert_eq!(s.backlog_len(), 5);
        assert_eq!(std::iter::from_fn(|| s.pop_request(now)).filter(|r| r.who == 7).count(), 1);
    }

    #[test]
    fn withdrawn_and_expired_requests_never_reach_accept() {
        let now = Instant::now();
        let mut s = Handshakes::<u32>::new(Limits::default());
        s.listen(true);
        for m in encode_connect(1, Duration::from_millis(100), &desc(10)) {
            s.handle_message(7, &m, now);
        }
        for m in encode_connect(2, Duration::from_secs(100), &desc(10)) {
            s.handle_message(7, &m, now);
        }
        s.handle_message(7, &encode_close(2), now);
        assert_eq!(s.pop_request(now + Duration::from_secs(1)), None);
    }
}
