//! Link set-up, sans-IO: the hand-shake that turns a fresh byte stream between two NICs into
//! a link, with optional authentication by a key shared by the NICs of a cluster.
//!
//! ```text
//!   dialler D                                   acceptor A
//!     Hello(D, nonce_d)            ──────────▶
//!                                  ◀──────────  Hello(A, nonce_a) [+ Auth(proof_A)]
//!     [verify proof_A]
//!     [Auth(proof_D)]              ──────────▶
//!                                               [verify proof_D]      → Verified: the driver
//!                                                                       decides (one link per
//!                                                                       pair of NICs)
//!                                  ◀──────────  Welcome   (keep)  |  Close(Duplicate)
//!     Ready                                     Ready
//! ```
//!
//! - The acceptor's `Hello` is a challenge, not a commitment: nothing is decided about a
//!   connection (no existing link replaced, no traffic served) before its peer is verified —
//!   by its `Hello` alone without a key, by its proof with one. The decision is the driver's
//!   ([`Handshake::decide`]); the dialler waits for it (`Welcome`) before it sends traffic, so
//!   a connection that loses the tie-break never carries anything.
//! - A proof is `BLAKE3-keyed(key, "clan link auth v2" ‖ role ‖ nonce_d ‖ nonce_a ‖ addr_d ‖
//!   addr_a)`: it binds both nonces (each side's freshness), both addresses and the direction
//!   (`role` is the prover's), so a proof seen in one hand-shake is worthless in any other —
//!   relayed to a third NIC, replayed later, or reflected back. Proofs are compared in
//!   constant time.
//! - Without a key a link trusts the address its peer claims in its `Hello`: anyone who can
//!   reach the port can claim to be any NIC. The driver still never lets a bare `Hello` tear
//!   down an established link (see `clan`'s engine: the old link is probed first).
//! - The key authenticates the hand-shake only; frames after it are not protected against a
//!   man in the middle. Run links over a private network (or a VPN) where that matters.
//!
//! Time is an input: the machine has one deadline, set when it is made, after which it fails.
//! Every byte it is given is untrusted; it keeps at most [`MAX_BUFFER`] bytes, and a frame
//! other than the ones above, in the wrong order, fails the hand-shake.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::WireError;
use crate::decoder::{Decoder, Item};
use crate::frame::{self, Frame, Hello, Status};

/// Most bytes buffered before the hand-shake completes (the acceptor's side only ever needs
/// a `Hello` and an `Auth`; the dialler's may hold the first traffic behind a `Welcome`).
pub const MAX_BUFFER: usize = 64 << 10;
/// Bit of `Hello::flags`: the sender requires authentication.
pub const FLAG_AUTH: u16 = 1;

/// What a NIC brings to a hand-shake.
#[derive(Clone, Copy)]
pub struct HandshakeConfig {
    /// Our address.
    pub local: SocketAddr,
    /// The window of unacknowledged write bytes we grant the peer.
    pub credit: u64,
    /// The cluster key, if links authenticate.
    pub key: Option<[u8; 32]>,
    /// How long the whole hand-shake may take.
    pub timeout: Duration,
    /// How long an acceptor waits for the peer's first hello (connections that say nothing
    /// go early).
    pub hello_timeout: Duration,
}

impl std::fmt::Debug for HandshakeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeConfig")
            .field("local", &self.local)
            .field("credit", &self.credit)
            .field("key", &self.key.map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .field("hello_timeout", &self.hello_timeout)
            .finish()
    }
}

/// Which end of the connection we are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// We dialled the NIC at `expect` (its `Hello` must say so).
    Dialler {
        /// The NIC we meant to reach.
        expect: SocketAddr,
    },
    /// We accepted the connection.
    Acceptor,
}

/// Why a hand-shake failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeError {
    /// It did not complete in time.
    Timeout,
    /// The connection closed.
    Closed,
    /// The peer speaks another protocol version.
    Version(u16),
    /// The dialled address answered with another NIC's address.
    WrongPeer {
        /// Whom we dialled.
        expected: SocketAddr,
        /// Who answered.
        got: SocketAddr,
    },
    /// One side requires authentication, the other does not.
    AuthMismatch,
    /// The peer's proof is wrong: it does not hold the key (or is not who it says).
    AuthFailed,
    /// The peer refused the connection.
    Refused(Status),
    /// We declined it (the driver's decision).
    Declined,
    /// A frame that has no place at this step.
    Unexpected(u8),
    /// Bytes that are not frames.
    Malformed(WireError),
    /// More bytes than a hand-shake needs.
    Flood,
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeError::Timeout => write!(f, "the hand-shake did not complete in time"),
            HandshakeError::Closed => write!(f, "the connection closed during the hand-shake"),
            HandshakeError::Version(v) => {
                write!(f, "the peer speaks protocol version {v}, we speak {}", frame::VERSION)
            }
            HandshakeError::WrongPeer { expected, got } => write!(f, "dialled {expected}, but {got} answered"),
            HandshakeError::AuthMismatch => {
                write!(f, "one side requires authentication (a cluster key), the other does not")
            }
            HandshakeError::AuthFailed => write!(f, "authentication failed: the peer does not hold the cluster key"),
            HandshakeError::Refused(Status::AuthFailed) => {
                write!(f, "the peer refused us: authentication failed (a missing or different cluster key)")
            }
            HandshakeError::Refused(s) => write!(f, "refused by the peer ({s:?})"),
            HandshakeError::Declined => write!(f, "declined (another link to that NIC is kept)"),
            HandshakeError::Unexpected(k) => write!(f, "unexpected frame of kind {k} during the hand-shake"),
            HandshakeError::Malformed(e) => write!(f, "malformed hand-shake: {e}"),
            HandshakeError::Flood => write!(f, "too many bytes during the hand-shake"),
        }
    }
}

impl std::error::Error for HandshakeError {}

/// What the hand-shake asks of its driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeEvent {
    /// (Acceptor.) The peer is verified as `peer`: decide whether to keep this connection
    /// ([`Handshake::decide`]).
    Verified {
        /// The peer NIC.
        peer: SocketAddr,
    },
    /// The link is up: `credit` is the window the peer granted us; what the peer sent behind
    /// the hand-shake is in [`Handshake::take_rest`].
    Ready {
        /// The peer NIC.
        peer: SocketAddr,
        /// Its window.
        credit: u64,
    },
    /// It failed; the connection must be closed.
    Failed(HandshakeError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Dialler: our hello is out; waiting for the acceptor's hello (and proof).
    AwaitHello,
    /// Dialler, keyed: have the acceptor's hello, waiting for its proof.
    AwaitProof,
    /// Dialler: waiting for the acceptor's decision.
    AwaitWelcome,
    /// Acceptor, keyed: our hello and proof are out; waiting for the dialler's proof.
    AwaitAuth,
    /// Acceptor: the peer is verified; waiting for the driver's decision.
    Deciding,
    Ready,
    Failed(HandshakeError),
}

/// One hand-shake (see the module documentation).
pub struct Handshake {
    role: Role,
    cfg: HandshakeConfig,
    nonce: [u8; 16],
    state: State,
    deadline: Instant,
    /// The acceptor's deadline for the first hello.
    hello_deadline: Option<Instant>,
    peer: Option<Hello>,
    buf: Vec<u8>,
    out: Vec<u8>,
    events: std::collections::VecDeque<HandshakeEvent>,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshake")
            .field("role", &self.role)
            .field("state", &self.state)
            .field("peer", &self.peer.map(|h| h.nic))
            .finish_non_exhaustive()
    }
}

/// The proof that the prover in `role` holds `key`, for the hand-shake between `dialler`
/// (with `nonce_d`) and `acceptor` (with `nonce_a`).
pub fn proof(
    key: &[u8; 32],
    role: Role,
    nonce_d: &[u8; 16],
    nonce_a: &[u8; 16],
    dialler: SocketAddr,
    acceptor: SocketAddr,
) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"clan link auth v2");
    h.update(match role {
        Role::Dialler { .. } => b"D",
        Role::Acceptor => b"A",
    });
    h.update(nonce_d);
    h.update(nonce_a);
    let mut a = Vec::with_capacity(38);
    frame::put_addr(&mut a, dialler);
    frame::put_addr(&mut a, acceptor);
    h.update(&a);
    *h.finalize().as_bytes()
}

impl Handshake {
    /// A hand-shake starting at `now` with our random `nonce` (the driver supplies the
    /// randomness: the machine does no I/O). A dialler's `Hello` is queued at once.
    pub fn new(role: Role, cfg: HandshakeConfig, nonce: [u8; 16], now: Instant) -> Handshake {
        let mut h = Handshake {
            role,
            cfg,
            nonce,
            state: match role {
                Role::Dialler { .. } => State::AwaitHello,
                Role::Acceptor => State::AwaitHello,
            },
            deadline: now + cfg.timeout,
            hello_deadline: (role == Role::Acceptor).then(|| now + cfg.hello_timeout.min(cfg.timeout)),
            peer: None,
            buf: Vec::new(),
            out: Vec::new(),
            events: Default::default(),
        };
        if matches!(role, Role::Dialler { .. }) {
            h.send_hello();
        }
        h
    }

    /// Our role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The peer's hello, once received.
    pub fn peer_hello(&self) -> Option<&Hello> {
        self.peer.as_ref()
    }

    /// Whether the hand-shake completed.
    pub fn is_ready(&self) -> bool {
        self.state == State::Ready
    }

    /// Whether it failed (and why).
    pub fn failure(&self) -> Option<HandshakeError> {
        match self.state {
            State::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// (Acceptor.) Whether it waits for [`Handshake::decide`].
    pub fn is_deciding(&self) -> bool {
        self.state == State::Deciding
    }

    fn keyed(&self) -> bool {
        self.cfg.key.is_some()
    }

    fn send(&mut self, f: Frame<'_>) {
        f.encode(&mut self.out);
    }

    fn send_hello(&mut self) {
        let flags = if self.keyed() { FLAG_AUTH } else { 0 };
        self.send(Frame::Hello(Hello {
            version: frame::VERSION,
            flags,
            nic: self.cfg.local,
            nonce: self.nonce,
            credit: self.cfg.credit,
        }));
    }

    fn fail(&mut self, e: HandshakeError) {
        if matches!(self.state, State::Failed(_) | State::Ready) {
            return;
        }
        self.state = State::Failed(e);
        self.events.push_back(HandshakeEvent::Failed(e));
    }

    /// Fail, telling the peer why (it then reports a refusal, not a broken connection).
    fn refuse(&mut self, e: HandshakeError) {
        if !matches!(self.state, State::Failed(_) | State::Ready) {
            let status = match e {
                HandshakeError::AuthFailed | HandshakeError::AuthMismatch => Status::AuthFailed,
                _ => Status::Malformed,
            };
            self.send(Frame::Close { status });
        }
        self.fail(e);
    }

    fn ready(&mut self) {
        let Some(p) = self.peer else { return };
        self.state = State::Ready;
        self.events.push_back(HandshakeEvent::Ready { peer: p.nic, credit: p.credit });
    }

    /// The (dialler, acceptor) nonces and addresses.
    fn parties(&self, peer: &Hello) -> ([u8; 16], [u8; 16], SocketAddr, SocketAddr) {
        match self.role {
            Role::Dialler { .. } => (self.nonce, peer.nonce, self.cfg.local, peer.nic),
            Role::Acceptor => (peer.nonce, self.nonce, peer.nic, self.cfg.local),
        }
    }

    fn our_proof(&self, key: &[u8; 32], peer: &Hello) -> [u8; 32] {
        let (nd, na, d, a) = self.parties(peer);
        proof(key, self.role, &nd, &na, d, a)
    }

    fn their_proof(&self, key: &[u8; 32], peer: &Hello) -> [u8; 32] {
        let (nd, na, d, a) = self.parties(peer);
        let theirs = match self.role {
            Role::Dialler { .. } => Role::Acceptor,
            Role::Acceptor => Role::Dialler { expect: a },
        };
        proof(key, theirs, &nd, &na, d, a)
    }

    /// Bytes arrived from the peer.
    pub fn handle_data(&mut self, bytes: &[u8]) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        if self.buf.len() + bytes.len() > MAX_BUFFER {
            self.fail(HandshakeError::Flood);
            return;
        }
        self.buf.extend_from_slice(bytes);
        self.process();
    }

    /// The connection reached its end (the peer closed it).
    pub fn handle_eof(&mut self) {
        self.process();
        if self.state != State::Ready {
            self.fail(HandshakeError::Closed);
        }
    }

    fn current_deadline(&self) -> Instant {
        match (self.peer, self.hello_deadline) {
            (None, Some(h)) => h,
            _ => self.deadline,
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.current_deadline() && !matches!(self.state, State::Ready | State::Failed(_)) {
            self.fail(HandshakeError::Timeout);
        }
    }

    /// When [`Handshake::handle_timeout`] must be called next (None once it is over).
    pub fn poll_timeout(&self) -> Option<Instant> {
        (!matches!(self.state, State::Ready | State::Failed(_))).then(|| self.current_deadline())
    }

    /// Bytes to send: appended to `out` (the machine forgets them).
    pub fn poll_transmit(&mut self, out: &mut Vec<u8>) -> bool {
        if self.out.is_empty() {
            return false;
        }
        out.append(&mut self.out);
        true
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<HandshakeEvent> {
        self.events.pop_front()
    }

    /// (Acceptor, after [`HandshakeEvent::Verified`].) Keep the connection (`Welcome`, the
    /// link is ready) or decline it (`Close(Duplicate)`).
    pub fn decide(&mut self, keep: bool) {
        if self.state != State::Deciding {
            return;
        }
        if keep {
            self.send(Frame::Welcome);
            self.ready();
        } else {
            self.send(Frame::Close { status: Status::Duplicate });
            self.fail(HandshakeError::Declined);
        }
    }

    /// What the peer sent behind the hand-shake (the link's first traffic), once ready.
    pub fn take_rest(&mut self) -> Vec<u8> {
        if self.state == State::Ready { std::mem::take(&mut self.buf) } else { Vec::new() }
    }

    fn process(&mut self) {
        let mut dec = Decoder::new();
        loop {
            if matches!(self.state, State::Ready | State::Failed(_) | State::Deciding) {
                // Nothing may arrive while we decide: the dialler waits for our answer.
                if self.state == State::Deciding && !self.buf.is_empty() {
                    self.fail(HandshakeError::Flood);
                }
                return;
            }
            let (frame, used) = match dec.next(&self.buf) {
                Ok(Some((Item::Frame(f), used))) => (OwnedFrame::from(f), used),
                Ok(Some((Item::WriteBegin { .. }, _))) => {
                    return self.fail(HandshakeError::Unexpected(frame::kind::WRITE));
                }
                Ok(Some(_)) => return self.fail(HandshakeError::Unexpected(frame::kind::READ_RESP)),
                Ok(None) => return,
                Err(e) => return self.fail(HandshakeError::Malformed(e)),
            };
            self.buf.drain(..used);
            self.step(frame);
        }
    }

    fn step(&mut self, f: OwnedFrame) {
        if let OwnedFrame::Close(status) = f {
            return self.fail(HandshakeError::Refused(status));
        }
        match (self.state, self.role, f) {
            (State::AwaitHello, role, OwnedFrame::Hello(h)) => {
                if h.version != frame::VERSION {
                    return self.refuse(HandshakeError::Version(h.version));
                }
                if let Role::Dialler { expect } = role {
                    if h.nic != expect {
                        return self.fail(HandshakeError::WrongPeer { expected: expect, got: h.nic });
                    }
                }
                if (h.flags & FLAG_AUTH != 0) != self.keyed() {
                    return self.refuse(HandshakeError::AuthMismatch);
                }
                self.peer = Some(h);
                match (role, self.cfg.key) {
                    (Role::Dialler { .. }, Some(_)) => self.state = State::AwaitProof,
                    (Role::Dialler { .. }, None) => self.state = State::AwaitWelcome,
                    (Role::Acceptor, Some(key)) => {
                        self.send_hello();
                        let p = self.our_proof(&key, &h);
                        self.send(Frame::Auth(p));
                        self.state = State::AwaitAuth;
                    }
                    (Role::Acceptor, None) => {
                        self.send_hello();
                        self.state = State::Deciding;
                        self.events.push_back(HandshakeEvent::Verified { peer: h.nic });
                    }
                }
            }
            (State::AwaitProof, _, OwnedFrame::Auth(p)) => {
                let (Some(key), Some(h)) = (self.cfg.key, self.peer) else {
                    return self.fail(HandshakeError::Unexpected(frame::kind::AUTH));
                };
                if !constant_time_eq(&p, &self.their_proof(&key, &h)) {
                    return self.refuse(HandshakeError::AuthFailed);
                }
                let mine = self.our_proof(&key, &h);
                self.send(Frame::Auth(mine));
                self.state = State::AwaitWelcome;
            }
            (State::AwaitAuth, _, OwnedFrame::Auth(p)) => {
                let (Some(key), Some(h)) = (self.cfg.key, self.peer) else {
                    return self.fail(HandshakeError::Unexpected(frame::kind::AUTH));
                };
                if !constant_time_eq(&p, &self.their_proof(&key, &h)) {
                    return self.refuse(HandshakeError::AuthFailed);
                }
                self.state = State::Deciding;
                self.events.push_back(HandshakeEvent::Verified { peer: h.nic });
            }
            (State::AwaitWelcome, _, OwnedFrame::Welcome) => self.ready(),
            (_, _, f) => self.fail(HandshakeError::Unexpected(f.kind())),
        }
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    blake3::Hash::from_bytes(*a) == blake3::Hash::from_bytes(*b)
}

/// The frames a hand-shake can see, owned.
#[derive(Debug, Clone, Copy)]
enum OwnedFrame {
    Hello(Hello),
    Auth([u8; 32]),
    Welcome,
    Close(Status),
    Other(u8),
}

impl OwnedFrame {
    fn kind(&self) -> u8 {
        match self {
            OwnedFrame::Hello(_) => frame::kind::HELLO,
            OwnedFrame::Auth(_) => frame::kind::AUTH,
            OwnedFrame::Welcome => frame::kind::WELCOME,
            OwnedFrame::Close(_) => frame::kind::CLOSE,
            OwnedFrame::Other(k) => *k,
        }
    }
}

impl From<Frame<'_>> for OwnedFrame {
    fn from(f: Frame<'_>) -> Self {
        match f {
            Frame::Hello(h) => OwnedFrame::Hello(h),
            Frame::Auth(p) => OwnedFrame::Auth(p),
            Frame::Welcome => OwnedFrame::Welcome,
            Frame::Close { status } => OwnedFrame::Close(status),
            other => {
                let mut b = Vec::new();
                other.encode(&mut b);
                OwnedFrame::Other(b.get(4).copied().unwrap_or(0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(local: &str, key: Option<[u8; 32]>) -> HandshakeConfig {
        HandshakeConfig {
            local: local.parse().unwrap(),
            credit: 1 << 20,
            key,
            timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(2),
        }
    }

    /// Run both machines against each other until quiet; the acceptor keeps the link.
    fn run(d: &mut Handshake, a: &mut Handshake) {
        for _ in 0..10 {
            let mut b = Vec::new();
            d.poll_transmit(&mut b);
            a.handle_data(&b);
            while let Some(e) = a.poll_event() {
                if let HandshakeEvent::Verified { .. } = e {
                    a.decide(true);
                }
            }
            let mut b = Vec::new();
            a.poll_transmit(&mut b);
            d.handle_data(&b);
        }
    }

    #[test]
    fn keyed_and_unkeyed_links_come_up() {
        for key in [None, Some([7u8; 32])] {
            let now = Instant::now();
            let mut d = Handshake::new(
                Role::Dialler { expect: "10.77.0.2:1".parse().unwrap() },
                cfg("10.77.0.1:1", key),
                [1; 16],
                now,
            );
            let mut a = Handshake::new(Role::Acceptor, cfg("10.77.0.2:1", key), [2; 16], now);
            run(&mut d, &mut a);
            assert!(d.is_ready() && a.is_ready(), "{d:?} {a:?}");
        }
    }

    #[test]
    fn a_wrong_key_is_refused_by_both() {
        let now = Instant::now();
        let mut d = Handshake::new(
            Role::Dialler { expect: "10.77.0.2:1".parse().unwrap() },
            cfg("10.77.0.1:1", Some([1; 32])),
            [1; 16],
            now,
        );
        let mut a = Handshake::new(Role::Acceptor, cfg("10.77.0.2:1", Some([2; 32])), [2; 16], now);
        run(&mut d, &mut a);
        assert_eq!(d.failure(), Some(HandshakeError::AuthFailed));
        assert!(!a.is_ready());
    }

    fn hello(nic: &str, nonce: [u8; 16], keyed: bool) -> Vec<u8> {
        let mut b = Vec::new();
        Frame::Hello(Hello {
            version: frame::VERSION,
            flags: if keyed { FLAG_AUTH } else { 0 },
            nic: nic.parse().unwrap(),
            nonce,
            credit: 1,
        })
        .encode(&mut b);
        b
    }

    fn auth(p: [u8; 32]) -> Vec<u8> {
        let mut b = Vec::new();
        Frame::Auth(p).encode(&mut b);
        b
    }

    /// The proof in an acceptor's answer.
    fn proof_in(bytes: &[u8]) -> [u8; 32] {
        let mut dec = Decoder::new();
        let mut at = 0;
        while let Ok(Some((item, used))) = dec.next(&bytes[at..]) {
            if let Item::Frame(Frame::Auth(p)) = item {
                return p;
            }
            at += used;
        }
        panic!("no proof");
    }

    /// An attacker without the key, claiming to be D at acceptor A, cannot use any proof it
    /// can get hold of: A's own (reflected), one from an earlier hand-shake (replayed), or a
    /// proof made for the other direction.
    #[test]
    fn proofs_from_elsewhere_are_refused() {
        let key = [9u8; 32];
        let (d, a) = ("10.77.0.1:1", "10.77.0.2:1");
        let now = Instant::now();
        let acceptor = |nonce| {
            let mut h = Handshake::new(Role::Acceptor, cfg(a, Some(key)), nonce, now);
            h.handle_data(&hello(d, [5; 16], true));
            let mut out = Vec::new();
            h.poll_transmit(&mut out);
            (h, out)
        };
        // Reflection: A's own proof sent back.
        let (mut h, out) = acceptor([1; 16]);
        h.handle_data(&auth(proof_in(&out)));
        assert_eq!(h.failure(), Some(HandshakeError::AuthFailed));
        // Replay: D's genuine proof from an earlier hand-shake with A (another nonce of A's).
        let earlier = proof(
            &key,
            Role::Dialler { expect: a.parse().unwrap() },
            &[5; 16],
            &[1; 16],
            d.parse().unwrap(),
            a.parse().unwrap(),
        );
        let (mut h, _) = acceptor([2; 16]);
        h.handle_data(&auth(earlier));
        assert_eq!(h.failure(), Some(HandshakeError::AuthFailed));
        // Direction: a proof made by an acceptor for the same nonces and addresses.
        let other_way = proof(&key, Role::Acceptor, &[5; 16], &[3; 16], d.parse().unwrap(), a.parse().unwrap());
        let (mut h, _) = acceptor([3; 16]);
        h.handle_data(&auth(other_way));
        assert_eq!(h.failure(), Some(HandshakeError::AuthFailed));
        // And the genuine one for this hand-shake is accepted.
        let right = proof(
            &key,
            Role::Dialler { expect: a.parse().unwrap() },
            &[5; 16],
            &[4; 16],
            d.parse().unwrap(),
            a.parse().unwrap(),
        );
        let (mut h, _) = acceptor([4; 16]);
        h.handle_data(&auth(right));
        assert_eq!(h.poll_event(), Some(HandshakeEvent::Verified { peer: d.parse().unwrap() }));
    }

    /// Nothing is decided before the peer is verified: an acceptor with a key raises no
    /// `Verified` on a hello alone, and a dialler sends no traffic before `Welcome`.
    #[test]
    fn no_decision_before_verification() {
        let key = [9u8; 32];
        let now = Instant::now();
        let mut a = Handshake::new(Role::Acceptor, cfg("10.77.0.2:1", Some(key)), [1; 16], now);
        a.handle_data(&hello("10.77.0.1:1", [5; 16], true));
        assert_eq!(a.poll_event(), None);
        assert!(!a.is_deciding());
        let mut unkeyed = Handshake::new(Role::Acceptor, cfg("10.77.0.2:1", None), [1; 16], now);
        unkeyed.handle_data(&hello("10.77.0.1:1", [5; 16], true));
        assert_eq!(unkeyed.failure(), Some(HandshakeError::AuthMismatch));
        let mut out = Vec::new();
        unkeyed.poll_transmit(&mut out);
        assert!(!out.is_empty(), "the refusal says why (Close)");
    }
}
