//! The NIC engine: the thread that serves the host control channel and drives links.
//!
//! It waits in epoll (through mio) and **never blocks on anything else**: not on a peer, a
//! link, a hand-shake, a lock held across I/O, or an application thread. Every socket it
//! owns is non-blocking; every protocol step is taken by a sans-IO machine of `clan_wire`
//! (the engine feeds it bytes and time, and does what it asks); every table it keeps is
//! bounded and every set-up has a deadline. What it owns:
//!
//! - **Host sessions** (`Entry::Host`): connections from other NICs of this host to ours. Each
//!   is a `clan_wire::control::Session`: a hello within a deadline, whose NIC address is
//!   verified to belong to the connecting process (a non-blocking connect to that NIC's
//!   listener, whose credentials must name the same pid), before anything is served; senders
//!   of out-of-band messages checked against it; bad messages counted. Connections per
//!   process, per user and in all are bounded (`clan_wire::control::Admission`). A reply that
//!   does not fit in the socket (the peer does not read) drops the connection.
//! - **Outgoing host channels** (`Entry::Out`): one non-blocking connection per NIC of this
//!   host we send to on our own behalf (out-of-band messages from the outbox: connection
//!   answers and closes) or import from. Messages are one-way and queued (bounded); the
//!   channel's end is how we learn that the peer's process died (`NicInner::peer_gone`).
//! - **Link set-ups** (`Entry::Setup`): TCP connections running `clan_wire::handshake`. The
//!   acceptor's decision (one link per pair of NICs) is made only after the peer is verified:
//!   the connection dialled by the smaller address wins a simultaneous dial, and an
//!   established link is never replaced on a peer's word: it is *probed* (a ping), and kept
//!   if it answers.
//! - **Links** (`Entry::Link`): frames received and processed here (unless the application
//!   drives progress itself), queued frames flushed, keepalive; a link whose peer stops
//!   reading stops being read, and ends (`clan_wire::Timeout::Stalled`).
//!
//! Messages the engine sends for others (`NicInner::outbox`) go through the host channel
//! within a host, or the link (parked while it is dialled, bounded, expiring) across hosts.
//! A message that cannot be delivered ends its sender's connections with that endpoint.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clan_shm::seqpacket::{PeerCred, SeqPacket};
use clan_wire::control::{Admission, AdmissionLimits, MAX_MSG, Reply, Request, Session, SessionLimits, Step};
use clan_wire::handshake::{Handshake, HandshakeConfig, HandshakeEvent, Role};
use clan_wire::{Frame, LinkState, Status};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::addr::{EndpointAddr, NicAddr, PeerIdentity};
use crate::config::{LocalTransport, Progress};
use crate::link::{Link, LinkError};
use crate::lock;
use crate::nic::{Cmd, NicInner};
use crate::onaccept::{Grantee, HostGrants};

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
const TCP_LISTENER: Token = Token(2);
/// The timer of the messages that may wait (`crate::lazy`).
const LAZY_TIMER: Token = Token(3);
/// Bytes of incoming link traffic processed per link before looking at the others.
const BUDGET: usize = 1 << 20;
/// Links being set up at once, at most: more connections are closed at once.
const MAX_SETUPS: usize = 4096;
/// Messages parked for one peer while its link is dialled.
const MAX_PARKED: usize = 1024;
/// Messages queued on one outgoing host channel.
const MAX_OUT_QUEUE: usize = 4096;
/// How often a connect to a host peer whose listener's backlog is full is retried.
const RETRY: Duration = Duration::from_millis(5);
/// While links are parked (left to spinning threads: `clan_shm::handoff`), how often the
/// engine first looks whether the spinning has stopped: links are listened to again after a
/// whole period in which no spin began. The period doubles while spins go on, up to
/// [`PARK_CHECK_MAX`] (each look takes the CPU from a spinner). Threads that go to sleep
/// unpark at once; this bounds the wait of a thread that neither spins nor sleeps.
const PARK_CHECK: Duration = Duration::from_micros(200);
/// Looks at a link whose receive lock a sleeping leader holds before the engine leaves it
/// to that leader ([`Engine::service_link`]): the leader reads whatever comes in any case.
const PARK_TRIES: u32 = 64;
const PARK_CHECK_MAX: Duration = Duration::from_millis(5);

/// Server-side state of one host connection.
#[derive(Debug)]
pub(crate) struct Conn {
    /// The only strong reference: requests filed to be granted on accept hold weak ones
    /// (`crate::onaccept`), so the socket closes when the engine drops the connection.
    pub sock: Arc<SeqPacket>,
    pub cred: PeerCred,
    pub id: u64,
    /// The peer NIC, once its hello is verified.
    pub hello: Option<NicAddr>,
    /// What was granted through it (shared with threads that grant on accept).
    pub grants: Arc<Mutex<HostGrants>>,
    session: Session,
    /// A hello whose NIC could not be verified yet (its listener's backlog was full): the
    /// NIC claimed and when to try again. Nothing more is read from the connection until
    /// it is settled.
    verify: Option<(NicAddr, Instant)>,
}

impl Conn {
    /// Who the connecting process is: its credentials, which the kernel recorded.
    fn identity(&self) -> PeerIdentity {
        PeerIdentity::Process { pid: self.cred.pid, uid: self.cred.uid }
    }

    /// Who what is granted through it goes to.
    pub fn grantee(&self) -> Grantee {
        Grantee { cred: self.cred, id: self.id, hello: self.hello }
    }
}

/// A link being set up.
struct Setup {
    sock: mio::net::TcpStream,
    hs: Handshake,
    /// Hand-shake bytes not written yet.
    out: Vec<u8>,
    connected: bool,
    /// The NIC we dialled (for outgoing connections).
    dialled: Option<NicAddr>,
    /// Our dial lost the tie-break to the peer's: the link comes the other way, and the end
    /// of this one is no failure.
    superseded: bool,
    /// Deciding while the existing link to the peer is probed: (link, ping token, deadline).
    probe: Option<(Arc<Link>, u64, Instant)>,
    /// A connect error, if the dial failed.
    error: Option<LinkError>,
}

/// An encoded one-way request, with the endpoints of the out-of-band message it carries.
type Queued = (Vec<u8>, Option<(EndpointAddr, EndpointAddr)>);

/// Our outgoing channel to another NIC of this host.
struct Out {
    peer: NicAddr,
    /// None while the peer's listener had no room (retried every [`RETRY`]).
    sock: Option<SeqPacket>,
    /// Encoded one-way requests, the hello first; with the endpoints of out-of-band messages.
    queue: VecDeque<Queued>,
    hello_ok: bool,
    /// Messages sent before the peer accepted our hello: if it refuses the hello it drops
    /// them, and they are sent again on the next connection.
    unconfirmed: Vec<Queued>,
    opened: Instant,
    /// When the queue last moved (or was empty).
    moved: Instant,
    retry_at: Option<Instant>,
}

enum Entry {
    Host(Conn),
    Out(Out),
    Setup(Box<Setup>),
    Link(Arc<Link>),
}

/// A message parked while the link to its destination is dialled.
struct Parked {
    from: EndpointAddr,
    to: EndpointAddr,
    payload: [u8; 40],
    expires: Instant,
}

#[derive(Debug)]
pub(crate) struct Engine {
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    pub fn start(
        nic: Weak<NicInner>,
        listener: SeqPacket,
        tcp: Option<std::net::TcpListener>,
        lazy_timer: std::os::fd::RawFd,
        cpu: Option<usize>,
        admission: AdmissionLimits,
    ) -> std::io::Result<(Engine, Arc<Waker>)> {
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        poll.registry().register(&mut SourceFd(&listener.as_raw_fd()), LISTENER, Interest::READABLE)?;
        poll.registry().register(&mut SourceFd(&lazy_timer), LAZY_TIMER, Interest::READABLE)?;
        let tcp = match tcp {
            Some(l) => {
                l.set_nonblocking(true)?;
                let mut l = mio::net::TcpListener::from_std(l);
                poll.registry().register(&mut l, TCP_LISTENER, Interest::READABLE)?;
                Some(l)
            }
            None => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new().name("clan-engine".into()).spawn(move || {
            if let Some(c) = cpu {
                let mut set = rustix::thread::CpuSet::new();
                set.set(c);
                let _ = rustix::thread::sched_setaffinity(None, &set);
            }
            Run {
                nic,
                listener,
                tcp,
                poll,
                stop: s,
                entries: HashMap::new(),
                next_token: 4,
                admission: Admission::new(admission),
                outs: HashMap::new(),
                parked: HashMap::new(),
                setups: 0,
                parked_links: HashSet::new(),
                park_mark: 0,
                park_check: Instant::now(),
                park_period: PARK_CHECK,
                unpark_asked: false,
            }
            .run()
        })?;
        Ok((Engine { waker: waker.clone(), stop, thread: Some(thread) }, waker))
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            // The last handle of the NIC may be dropped by the engine itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

struct Run {
    nic: Weak<NicInner>,
    listener: SeqPacket,
    tcp: Option<mio::net::TcpListener>,
    poll: Poll,
    stop: Arc<AtomicBool>,
    entries: HashMap<Token, Entry>,
    next_token: usize,
    admission: Admission,
    /// Outgoing host channels by peer.
    outs: HashMap<NicAddr, Token>,
    /// Messages waiting for a link, by peer.
    parked: HashMap<NicAddr, VecDeque<Parked>>,
    /// Link set-ups in progress.
    setups: usize,
    /// Links whose incoming traffic is left to the application threads spinning on it
    /// (registered for writability only), while they spin.
    parked_links: HashSet<Token>,
    /// The count of spins begun at the last look (`clan_shm::handoff::Handoff::idle`).
    park_mark: u64,
    /// When to look next, and the period.
    park_check: Instant,
    park_period: Duration,
    /// A spinner went to sleep, or stopped while others sleep (`Cmd::Unpark`).
    unpark_asked: bool,
}

fn random16() -> [u8; 16] {
    let mut b = [0u8; 16];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    b
}

/// What checking a hello's NIC found.
enum Probe {
    /// The NIC is the connecting process's.
    Yes,
    /// It is not (or nothing listens there).
    No,
    /// Its listener's backlog is full: try again shortly.
    Busy,
}

/// Whether `claimed` is a NIC of process `pid`: its listener's credentials (recorded by the
/// kernel when it started listening) must name that pid. Never blocks: a Unix socket
/// connects at once or not at all.
fn verify_nic(claimed: NicAddr, pid: u32, ours: NicAddr) -> Probe {
    if claimed == ours {
        return Probe::No;
    }
    match SeqPacket::connect_abstract_nonblocking(&claimed.abstract_name()) {
        Ok(s) if s.peer_cred().is_ok_and(|c| c.pid == pid) => Probe::Yes,
        Ok(_) => Probe::No,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Probe::Busy,
        Err(_) => Probe::No,
    }
}

/// Deliver out-of-band messages from a verified sender, in order; the reply (if wanted) is
/// the first refusal or `Ok`.
fn deliver(
    nic: &NicInner,
    from: EndpointAddr,
    who: PeerIdentity,
    to_port: u32,
    payloads: &[[u8; 40]],
    reply: bool,
) -> Option<Reply> {
    let mut r = Reply::Ok;
    for p in payloads {
        let d =
            if reply { nic.deliver_oob(from, who, to_port, *p) } else { nic.deliver_oneway(from, who, to_port, *p) };
        if let Err(code) = d {
            r = Reply::Err { code, detail: String::new() };
            break;
        }
    }
    if let (Reply::Err { code, .. }, false) = (&r, reply) {
        tracing::debug!(%from, to_port, ?code, "one-way out-of-band message refused");
    }
    reply.then_some(r)
}

/// The verdict on a hello: the session's answer.
fn settle_hello(c: &mut Conn, claimed: NicAddr, ok: bool, ours: NicAddr) -> Step {
    if ok {
        c.hello = Some(claimed);
        tracing::debug!(peer = %claimed, pid = c.cred.pid, "host connection verified");
    } else {
        tracing::warn!(claimed = %claimed, pid = c.cred.pid, "refused a hello: that NIC is not the connecting process's");
    }
    c.session.hello_verified(ok, ours.socket_addr())
}

fn oob_frame(from: EndpointAddr, to: EndpointAddr, payload: [u8; 40]) -> Frame<'static> {
    // Id 0: one-way (the receiver sends no result).
    Frame::Oob(clan_wire::Oob {
        id: 0,
        from_nic: from.nic.socket_addr(),
        from_port: from.port,
        to_port: to.port,
        payload,
    })
}

/// The longest the engine's thread sleeps when nothing is timed (a safety net: every
/// deadline it keeps is counted in `Run::timers`).
const IDLE_TICK: Duration = Duration::from_secs(30);
/// With manual progress, how often the engine reads the links itself at least (their
/// keepalives; the application's threads read them when they wait).
const MANUAL_LINK_TICK: Duration = Duration::from_secs(1);

impl Run {
    fn token(&mut self) -> Token {
        let t = Token(self.next_token);
        self.next_token += 1;
        t
    }

    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let mut busy_until: Option<Instant> = None;
        let mut more: Vec<Token> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let Some(nic) = self.nic.upgrade() else { break };
            let now = Instant::now();
            let next = self.timers(&nic, now, &mut more);
            let next = if self.parked_links.is_empty() { next } else { next.min(self.park_check) };
            let timeout = if !more.is_empty() || busy_until.is_some_and(|b| b > now) {
                Some(Duration::ZERO)
            } else {
                Some(next.saturating_duration_since(now))
            };
            drop(nic);
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!("clan engine: poll failed: {e}");
                break;
            }
            let Some(nic) = self.nic.upgrade() else { break };
            let mut active = false;
            let ready: Vec<(Token, bool, bool)> =
                events.iter().map(|e| (e.token(), e.is_readable() || e.is_read_closed(), e.is_writable())).collect();
            let pending_more = std::mem::take(&mut more);
            for (token, readable, writable) in
                ready.into_iter().chain(pending_more.into_iter().map(|t| (t, true, false)))
            {
                match token {
                    WAKER => {
                        self.commands(&nic);
                        self.route_outbox(&nic);
                    }
                    LISTENER => self.accept_host(&nic),
                    LAZY_TIMER => nic.flush_lazy(),
                    TCP_LISTENER => self.accept_tcp(&nic),
                    t => {
                        if self.service(&nic, t, readable, writable) {
                            more.push(t);
                        }
                        active = true;
                    }
                }
            }
            self.check_parked(&nic, &mut more);
            // Busy polling: keep looking at the links for a while after activity.
            if let Progress::BusyPoll(d) = nic.config.progress {
                for (t, e) in &self.entries {
                    if let Entry::Link(l) = e {
                        if l.engine_receive(&nic, BUDGET) == Some(true) || l.is_closed() {
                            more.push(*t);
                        }
                    }
                }
                if active {
                    busy_until = Some(Instant::now() + d);
                }
            } else {
                busy_until = None;
            }
            more.sort();
            more.dedup();
        }
        if let Some(nic) = self.nic.upgrade() {
            for (_, e) in self.entries.drain() {
                match e {
                    Entry::Host(c) => nic.connection_closed(c, false),
                    Entry::Link(l) => {
                        l.close(Status::Shutdown, "NIC closing");
                        nic.link_closed(&l);
                    }
                    Entry::Setup(_) | Entry::Out(_) => {}
                }
            }
        }
    }

    /// Every entry's timers; returns when to look again.
    fn timers(&mut self, nic: &Arc<NicInner>, now: Instant, more: &mut Vec<Token>) -> Instant {
        // Every deadline of the entries is counted below: with none, nothing is timed, and the
        // thread sleeps until told (the bound is a safety net, not a period).
        let mut next = now + IDLE_TICK;
        let manual = nic.manual_progress();
        let mut dead: Vec<(Token, &'static str)> = Vec::new();
        let mut probes: Vec<(Token, Option<bool>)> = Vec::new();
        let mut retry: Vec<Token> = Vec::new();
        let mut reverify: Vec<Token> = Vec::new();
        let mut out_dead: Vec<(Token, bool, &'static str)> = Vec::new();
        let timeout = nic.config.request_timeout;
        for (t, e) in self.entries.iter_mut() {
            match e {
                Entry::Link(l) => {
                    if manual {
                        // A silent application must not let its links die: their keepalives
                        // are read and answered here, every `MANUAL_LINK_TICK` at least.
                        l.progress(nic);
                        next = next.min(now + MANUAL_LINK_TICK);
                    }
                    next = next.min(l.handle_timeout(now));
                    if l.is_closed() {
                        dead.push((*t, "link closed"));
                    } else if l.take_resume() {
                        more.push(*t);
                    }
                }
                Entry::Setup(s) => {
                    s.hs.handle_timeout(now);
                    if let Some(d) = s.hs.poll_timeout() {
                        next = next.min(d);
                    }
                    if let Some((l, token, deadline)) = &s.probe {
                        if l.is_closed() {
                            probes.push((*t, Some(true)));
                        } else if l.probe_answered(*token) {
                            probes.push((*t, Some(false)));
                        } else if now >= *deadline {
                            probes.push((*t, None));
                        } else {
                            next = next.min(*deadline);
                        }
                    }
                    if s.hs.failure().is_some() {
                        dead.push((*t, "hand-shake failed"));
                    }
                }
                Entry::Host(c) => {
                    if c.session.handle_timeout(now) {
                        if c.verify.is_some() {
                            // Say why, so that the peer does not take it for our death.
                            let r = Reply::err(clan_wire::control::Code::Unverified, "could not verify in time");
                            let _ = c.sock.send(&r.encode(0), &[]);
                        }
                        dead.push((*t, "no verified hello in time"));
                    } else {
                        if let Some(d) = c.session.poll_timeout() {
                            next = next.min(d);
                        }
                        match c.verify {
                            Some((_, at)) if now >= at => reverify.push(*t),
                            Some((_, at)) => next = next.min(at),
                            None => {}
                        }
                    }
                }
                Entry::Out(o) => {
                    if o.sock.is_none() {
                        if now >= o.opened + timeout {
                            out_dead.push((*t, false, "its listener had no room"));
                        } else if o.retry_at.is_some_and(|r| now >= r) {
                            retry.push(*t);
                        } else if let Some(r) = o.retry_at {
                            next = next.min(r);
                        } else {
                            next = next.min(o.opened + timeout);
                        }
                    } else if !o.hello_ok && now >= o.opened + timeout {
                        out_dead.push((*t, true, "it did not answer our hello"));
                    } else if !o.queue.is_empty() && now >= o.moved + timeout {
                        out_dead.push((*t, true, "it does not read"));
                    } else {
                        if !o.hello_ok {
                            next = next.min(o.opened + timeout);
                        }
                        if !o.queue.is_empty() {
                            next = next.min(o.moved + timeout);
                        }
                    }
                }
            }
        }
        for (t, why) in dead {
            self.drop_entry(nic, t, why);
        }
        for (t, verdict) in probes {
            self.probe_result(nic, t, verdict, now);
        }
        for t in retry {
            self.retry_out(nic, t, now);
        }
        for t in reverify {
            if let Some(why) = self.verify_hello(nic, t) {
                self.drop_entry(nic, t, why);
            }
        }
        for (t, gone, why) in out_dead {
            self.close_out(nic, t, gone, why);
        }
        // Parked messages whose link did not come in time.
        let mut expired = Vec::new();
        for q in self.parked.values_mut() {
            while q.front().is_some_and(|p| p.expires <= now) {
                expired.extend(q.pop_front());
            }
            if let Some(p) = q.front() {
                next = next.min(p.expires);
            }
        }
        self.parked.retain(|_, q| !q.is_empty());
        for p in expired {
            tracing::debug!(from = %p.from, to = %p.to, "out-of-band message dropped: no link in time");
            nic.conns.unreachable(nic, p.from.port, p.to);
        }
        next
    }

    fn drop_entry(&mut self, nic: &Arc<NicInner>, t: Token, why: &str) {
        match self.entries.remove(&t) {
            Some(Entry::Host(c)) => {
                let _ = self.poll.registry().deregister(&mut SourceFd(&c.sock.as_raw_fd()));
                self.admission.release(c.cred.pid, c.cred.uid);
                let still = self.entries.values().any(|e| {
                    matches!(e, Entry::Host(o) if o.hello.is_some() && o.hello == c.hello && o.cred.pid == c.cred.pid)
                });
                if c.hello.is_some() {
                    tracing::debug!(peer = ?c.hello, pid = c.cred.pid, "host connection closed: {why}");
                }
                nic.connection_closed(c, still);
            }
            Some(Entry::Setup(mut s)) => {
                self.setups = self.setups.saturating_sub(1);
                let _ = self.poll.registry().deregister(&mut s.sock);
                if let Some((l, token, _)) = s.probe.take() {
                    l.forget_probe(token);
                }
                let reason = s.hs.failure().map_or_else(|| why.to_string(), |e| e.to_string());
                if let Some(x) = s.dialled {
                    if s.superseded
                        || s.hs.failure() == Some(clan_wire::handshake::HandshakeError::Refused(Status::Duplicate))
                    {
                        // The winning connection comes the other way: waiters keep waiting.
                        tracing::debug!(peer = %x, "our dial lost the tie-break: {reason}");
                    } else if !self.handshaking_with(x) {
                        tracing::info!(peer = %x, "link set-up failed: {reason}");
                        use clan_wire::handshake::HandshakeError as H;
                        let e = match (s.error.take(), s.hs.failure()) {
                            (Some(e), _) => e,
                            (
                                None,
                                Some(
                                    H::AuthFailed
                                    | H::AuthMismatch
                                    | H::Version(_)
                                    | H::WrongPeer { .. }
                                    | H::Refused(Status::AuthFailed),
                                ),
                            ) => LinkError::Refused(reason),
                            _ => LinkError::Down(reason),
                        };
                        self.drop_parked(nic, x);
                        nic.links.fail(x, e);
                    }
                } else if let Some(h) = s.hs.peer_hello() {
                    tracing::info!(peer = %h.nic, "incoming link set-up failed: {reason}");
                }
            }
            Some(Entry::Link(l)) => {
                if self.parked_links.remove(&t) {
                    if self.parked_links.is_empty() {
                        nic.spinners.unparked();
                    }
                } else {
                    let _ = self.poll.registry().deregister(&mut SourceFd(&l.sock.as_raw_fd()));
                }
                nic.link_closed(&l);
            }
            Some(Entry::Out(o)) => {
                self.entries.insert(t, Entry::Out(o));
                self.close_out(nic, t, false, "closed");
            }
            None => {}
        }
    }

    fn handshaking_with(&self, x: NicAddr) -> bool {
        self.entries.values().any(|e| match e {
            Entry::Setup(s) => {
                s.hs.failure().is_none()
                    && (s.dialled == Some(x) || s.hs.peer_hello().is_some_and(|p| NicAddr::from(p.nic) == x))
            }
            _ => false,
        })
    }

    fn commands(&mut self, nic: &Arc<NicInner>) {
        for cmd in nic.take_commands() {
            match cmd {
                Cmd::Connect(x) => self.dial(nic, x),
                Cmd::Watch(x) => {
                    if !self.outs.contains_key(&x) {
                        self.open_out(nic, x, true);
                    }
                }
                Cmd::Unpark => self.unpark_asked = true,
            }
        }
    }

    /// A link is readable while a thread may be spinning on it: leave its traffic to the
    /// spinner (stop listening for it) if one is; whether the link is parked.
    fn park(&mut self, nic: &Arc<NicInner>, t: Token, l: &Link) -> bool {
        if nic.config.progress != Progress::Engine {
            return false;
        }
        if !nic.spinners.try_park() {
            if self.parked_links.is_empty() {
                nic.spinners.unparked();
            }
            return false;
        }
        if self.parked_links.contains(&t) {
            return true;
        }
        // Out of the epoll set altogether: a socket in it costs every delivery a callback
        // into epoll, even for events nobody waits for (the spinner flushes what it queues).
        if self.poll.registry().deregister(&mut SourceFd(&l.sock.as_raw_fd())).is_err() {
            if self.parked_links.is_empty() {
                nic.spinners.unparked();
            }
            return false;
        }
        if self.parked_links.is_empty() {
            self.park_mark = nic.spinners.idle().1;
            self.park_period = PARK_CHECK;
            self.park_check = Instant::now() + PARK_CHECK;
        }
        self.parked_links.insert(t);
        nic.spinners.parked_one();
        true
    }

    /// Listen to the parked links again if their spinners have stopped: a whole period
    /// without a spin begun, or a spinner gone to sleep (or stopped while others sleep)
    /// with none left.
    fn check_parked(&mut self, nic: &Arc<NicInner>, more: &mut Vec<Token>) {
        let asked = std::mem::take(&mut self.unpark_asked);
        if self.parked_links.is_empty() {
            return;
        }
        let now = Instant::now();
        let (idle, mark) = nic.spinners.idle();
        let due = now >= self.park_check;
        if idle && (asked || (due && mark == self.park_mark)) {
            nic.spinners.unparked();
            for t in std::mem::take(&mut self.parked_links) {
                let Some(Entry::Link(l)) = self.entries.get(&t) else { continue };
                let fd = l.sock.as_raw_fd();
                let r = self.poll.registry().register(&mut SourceFd(&fd), t, Interest::READABLE | Interest::WRITABLE);
                if r.is_err() {
                    l.close(Status::Other, "could not register the link again");
                }
                // What arrived meanwhile (re-registering reports it too, but not at once).
                more.push(t);
            }
        } else if due {
            self.park_mark = mark;
            self.park_period = (self.park_period * 2).min(PARK_CHECK_MAX);
            self.park_check = now + self.park_period;
        }
    }

    fn dial(&mut self, nic: &Arc<NicInner>, x: NicAddr) {
        // A connection from `x` is already up or being set up (it dialled us first):
        // waiters get that one when its hand-shake completes. Dialling too would only be
        // refused.
        if nic.links.ready(x).is_some() {
            nic.links.notify();
            return;
        }
        if self.handshaking_with(x) {
            return;
        }
        if self.setups >= MAX_SETUPS {
            nic.links.fail(x, LinkError::Down("too many links being set up".into()));
            return;
        }
        let to = nic.route(x);
        match mio::net::TcpStream::connect(to) {
            Ok(mut sock) => {
                let t = self.token();
                let _ = sock.set_nodelay(true);
                if self.poll.registry().register(&mut sock, t, Interest::READABLE | Interest::WRITABLE).is_err() {
                    nic.links.fail(x, LinkError::Down("could not register the connection".into()));
                    return;
                }
                let hs = Handshake::new(
                    Role::Dialler { expect: x.socket_addr() },
                    hs_config(nic),
                    random16(),
                    Instant::now(),
                );
                self.setups += 1;
                self.entries.insert(
                    t,
                    Entry::Setup(Box::new(Setup {
                        sock,
                        hs,
                        out: Vec::new(),
                        connected: false,
                        dialled: Some(x),
                        superseded: false,
                        probe: None,
                        error: None,
                    })),
                );
            }
            Err(e) => {
                self.drop_parked(nic, x);
                nic.links.fail(x, LinkError::Unreachable(format!("connect to {to}: {e}")));
            }
        }
    }

    // ---- the host control channel, serving side -------------------------------------

    fn accept_host(&mut self, nic: &Arc<NicInner>) {
        loop {
            match self.listener.accept() {
                Ok(Some(sock)) => {
                    let Ok(cred) = sock.peer_cred() else { continue };
                    if !self.admission.admit(cred.pid, cred.uid) {
                        tracing::warn!(
                            pid = cred.pid,
                            uid = cred.uid,
                            "refused a host connection: too many from that process or user"
                        );
                        continue; // closed by the drop
                    }
                    if sock.set_nonblocking(true).is_err() {
                        self.admission.release(cred.pid, cred.uid);
                        continue;
                    }
                    let token = self.token();
                    if self
                        .poll
                        .registry()
                        .register(&mut SourceFd(&sock.as_raw_fd()), token, Interest::READABLE)
                        .is_err()
                    {
                        self.admission.release(cred.pid, cred.uid);
                        continue;
                    }
                    let id = nic.next_serial();
                    let session = Session::new(cred.pid, Instant::now(), SessionLimits::default());
                    self.entries.insert(
                        token,
                        Entry::Host(Conn {
                            sock: Arc::new(sock),
                            cred,
                            id,
                            hello: None,
                            grants: Arc::default(),
                            session,
                            verify: None,
                        }),
                    );
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("clan engine: accept failed: {e}");
                    break;
                }
            }
        }
    }

    // ---- links: set-up ----------------------------------------------------------------

    fn accept_tcp(&mut self, nic: &Arc<NicInner>) {
        let Some(l) = self.tcp.as_ref() else { return };
        let mut accepted = Vec::new();
        loop {
            match l.accept() {
                Ok((sock, from)) => accepted.push((sock, from)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("clan engine: tcp accept failed: {e}");
                    break;
                }
            }
        }
        for (mut sock, from) in accepted {
            if self.setups >= MAX_SETUPS {
                tracing::warn!(%from, "refused a link connection: too many set-ups in progress");
                continue;
            }
            let _ = sock.set_nodelay(true);
            let t = self.token();
            if self.poll.registry().register(&mut sock, t, Interest::READABLE | Interest::WRITABLE).is_ok() {
                let hs = Handshake::new(Role::Acceptor, hs_config(nic), random16(), Instant::now());
                self.setups += 1;
                self.entries.insert(
                    t,
                    Entry::Setup(Box::new(Setup {
                        sock,
                        hs,
                        out: Vec::new(),
                        connected: true,
                        dialled: None,
                        superseded: false,
                        probe: None,
                        error: None,
                    })),
                );
            }
        }
    }

    /// Drive one link set-up: connect, write, read, and act on what the hand-shake says.
    /// Returns whether the (new) link has traffic to process.
    fn service_setup(&mut self, nic: &Arc<NicInner>, t: Token, readable: bool) -> bool {
        let Some(Entry::Setup(s)) = self.entries.get_mut(&t) else { return false };
        if !s.connected {
            if let Ok(Some(e)) | Err(e) = s.sock.take_error() {
                s.error = Some(LinkError::Unreachable(format!("connect failed: {e}")));
                self.drop_entry(nic, t, "connect failed");
                return false;
            }
            match s.sock.peer_addr() {
                Ok(_) => s.connected = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotConnected => return false,
                Err(e) => {
                    s.error = Some(LinkError::Unreachable(format!("connect failed: {e}")));
                    self.drop_entry(nic, t, "connect failed");
                    return false;
                }
            }
        }
        if !flush_setup(s) {
            self.drop_entry(nic, t, "could not send the hand-shake");
            return false;
        }
        if readable {
            let mut tmp = [0u8; 4096];
            loop {
                if s.hs.is_ready() || s.hs.failure().is_some() {
                    break;
                }
                match s.sock.read(&mut tmp) {
                    Ok(0) => {
                        s.hs.handle_eof();
                        break;
                    }
                    Ok(n) => s.hs.handle_data(&tmp[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        s.hs.handle_eof();
                        break;
                    }
                }
            }
        }
        self.setup_events(nic, t)
    }

    fn setup_events(&mut self, nic: &Arc<NicInner>, t: Token) -> bool {
        loop {
            let Some(Entry::Setup(s)) = self.entries.get_mut(&t) else { return false };
            if !flush_setup(s) {
                self.drop_entry(nic, t, "could not send the hand-shake");
                return false;
            }
            match s.hs.poll_event() {
                None => return false,
                Some(HandshakeEvent::Verified { peer }) => self.decide(nic, t, NicAddr::from(peer)),
                Some(HandshakeEvent::Ready { peer, credit }) => {
                    return self.establish(nic, t, NicAddr::from(peer), credit);
                }
                Some(HandshakeEvent::Failed(_)) => {
                    self.drop_entry(nic, t, "hand-shake failed");
                    return false;
                }
            }
        }
    }

    /// The acceptor's decision, once the peer is verified: one link per pair of NICs.
    fn decide(&mut self, nic: &Arc<NicInner>, t: Token, peer: NicAddr) {
        if peer == nic.addr {
            return self.settle(nic, t, false);
        }
        if let Some(old) = nic.links.ready(peer) {
            // A link to that NIC is up. A hello alone never replaces it: if the old link still
            // answers, the new connection is refused; if it is dead (the peer restarted, the
            // path broke), the new one replaces it.
            let token = old.probe();
            let deadline = Instant::now() + nic.config.link.dead_after;
            tracing::debug!(%peer, "a second connection from a NIC with a link: probing the link");
            if let Some(Entry::Setup(s)) = self.entries.get_mut(&t) {
                s.probe = Some((old, token, deadline));
            }
            return;
        }
        let ours: Vec<Token> = self
            .entries
            .iter()
            .filter(|(k, e)| {
                **k != t && matches!(e, Entry::Setup(s) if s.dialled == Some(peer) && s.hs.failure().is_none())
            })
            .map(|(k, _)| *k)
            .collect();
        if ours.is_empty() {
            return self.settle(nic, t, true);
        }
        // Both dialled at once: the connection dialled by the smaller address wins.
        if peer < nic.addr {
            for k in ours {
                if let Some(Entry::Setup(s)) = self.entries.get_mut(&k) {
                    s.superseded = true;
                }
            }
            self.settle(nic, t, true);
        } else {
            self.settle(nic, t, false);
        }
    }

    fn probe_result(&mut self, nic: &Arc<NicInner>, t: Token, verdict: Option<bool>, _now: Instant) {
        let Some(Entry::Setup(s)) = self.entries.get_mut(&t) else { return };
        let Some((old, token, _)) = s.probe.take() else { return };
        match verdict {
            Some(false) => {
                tracing::info!(peer = %old.peer, "refused a second link from a NIC whose link answers");
                self.settle(nic, t, false);
            }
            Some(true) => self.settle(nic, t, true),
            None => {
                old.forget_probe(token);
                old.close(Status::Timeout, "did not answer a probe while the peer connected again");
                nic.link_closed(&old);
                self.settle(nic, t, true);
            }
        }
    }

    fn settle(&mut self, nic: &Arc<NicInner>, t: Token, keep: bool) {
        if let Some(Entry::Setup(s)) = self.entries.get_mut(&t) {
            s.hs.decide(keep);
        }
        if self.setup_events(nic, t) {
            // Its first traffic arrived behind the hand-shake.
            self.service_link(nic, t, true, false);
        }
    }

    fn establish(&mut self, nic: &Arc<NicInner>, t: Token, peer: NicAddr, credit: u64) -> bool {
        let Some(Entry::Setup(s)) = self.entries.remove(&t) else { return false };
        self.setups = self.setups.saturating_sub(1);
        let Setup { mut sock, mut hs, dialled, .. } = *s;
        let rest = hs.take_rest();
        if let Some(old) = nic.links.ready(peer) {
            // The peer welcomed (or we decided, after probing) this connection: the old link
            // is stale (its process restarted) and goes.
            old.close(Status::Duplicate, "replaced by a new link");
            nic.link_closed(&old);
        }
        let _ = self.poll.registry().deregister(&mut sock);
        let mut state = LinkState::new(nic.config.link, Instant::now());
        state.on_credit(credit);
        let link = Arc::new(Link::new(
            peer,
            nic.next_serial(),
            dialled.is_some(),
            sock,
            state,
            nic.config.request_timeout,
            nic.config.max_link_imports,
        ));
        link.preload(&rest);
        let fd = link.sock.as_raw_fd();
        let interest = if nic.manual_progress() { Interest::WRITABLE } else { Interest::READABLE | Interest::WRITABLE };
        if self.poll.registry().register(&mut SourceFd(&fd), t, interest).is_err() {
            link.close(Status::Other, "could not register the link");
            nic.links.fail(peer, LinkError::Down("could not register the link".into()));
            return false;
        }
        tracing::info!(%peer, dialled = dialled.is_some(), authenticated = nic.config.cluster_key.is_some(), "link up");
        self.entries.insert(t, Entry::Link(link.clone()));
        nic.links.ready_now(peer, link.clone());
        if let Some(q) = self.parked.remove(&peer) {
            for p in q {
                if !link.send_control_bounded(&oob_frame(p.from, p.to, p.payload)) {
                    nic.conns.unreachable(nic, p.from.port, p.to);
                }
            }
        }
        !rest.is_empty()
    }

    // ---- service --------------------------------------------------------------------

    /// Handle readiness of entry `t`; returns whether it has more to process at once.
    fn service(&mut self, nic: &Arc<NicInner>, t: Token, readable: bool, writable: bool) -> bool {
        match self.entries.get(&t) {
            None => false,
            Some(Entry::Host(_)) => {
                if let Some(why) = self.serve(nic, t) {
                    self.drop_entry(nic, t, why);
                }
                false
            }
            Some(Entry::Link(_)) => self.service_link(nic, t, readable, writable),
            Some(Entry::Setup(_)) => {
                let more = self.service_setup(nic, t, readable);
                if more {
                    return self.service_link(nic, t, true, false);
                }
                false
            }
            Some(Entry::Out(_)) => {
                self.service_out(nic, t, readable);
                false
            }
        }
    }

    fn service_link(&mut self, nic: &Arc<NicInner>, t: Token, readable: bool, writable: bool) -> bool {
        let Some(Entry::Link(l)) = self.entries.get(&t) else { return false };
        let l = l.clone();
        let mut more = false;
        if writable {
            l.try_flush();
            more |= l.take_resume();
        }
        if readable && !nic.manual_progress() && !self.park(nic, t, &l) {
            // A leader asleep in the socket's `recv` has the link (it counts as a spinner):
            // park it as for one. If it just left, its lock is free at the next look.
            for _ in 0..PARK_TRIES {
                match l.engine_receive(nic, BUDGET) {
                    Some(m) => {
                        more |= m;
                        break;
                    }
                    None if self.park(nic, t, &l) => break,
                    None => std::thread::yield_now(),
                }
            }
        }
        if l.is_closed() {
            self.drop_entry(nic, t, "link closed");
            return false;
        }
        more
    }

    /// Serve every pending message of a host connection: None, or why it must be closed.
    fn serve(&mut self, nic: &Arc<NicInner>, t: Token) -> Option<&'static str> {
        let Some(Entry::Host(c)) = self.entries.get_mut(&t) else { return None };
        if c.verify.is_some() {
            return None; // settled first (`verify_hello`)
        }
        let mut buf = [0u8; MAX_MSG];
        loop {
            let got = match c.sock.recv(&mut buf) {
                Ok(g) => g,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return Some("receive failed"),
            };
            // Requests never carry descriptors: any that came are closed with `got`.
            let step = c.session.handle_packet(&buf[..got.len], got.fds.len(), got.truncated);
            let step = match step {
                Step::Verify { nic: claimed } => {
                    let claimed = NicAddr::from(claimed);
                    match verify_nic(claimed, c.cred.pid, nic.addr) {
                        Probe::Busy => {
                            c.verify = Some((claimed, Instant::now() + RETRY));
                            return None;
                        }
                        p => settle_hello(c, claimed, matches!(p, Probe::Yes), nic.addr),
                    }
                }
                s => s,
            };
            let (reply, fds): (Option<(u32, Reply)>, Option<crate::nic::GrantFds>) = match step {
                Step::Verify { .. } | Step::Ignore => (None, None),
                Step::Reply(id, r) => {
                    if let Reply::Err { code, detail } = &r {
                        tracing::info!(pid = c.cred.pid, ?code, "host request refused: {detail}");
                    }
                    (Some((id, r)), None)
                }
                Step::Close(r, why) => {
                    if let Some((id, r)) = r {
                        let _ = c.sock.send(&r.encode(id), &[]);
                    }
                    if got.len == 0 && got.fds.is_empty() {
                        // An orderly end (a peer NIC closing, a probe of `verify_nic` done):
                        // nothing to warn of.
                        tracing::debug!(pid = c.cred.pid, "host connection ended by the peer");
                    } else {
                        tracing::warn!(pid = c.cred.pid, "dropping a host connection: {why}");
                    }
                    return Some(why);
                }
                Step::Serve(id, req) => match req {
                    Request::Import { importer, desc } => {
                        let mut g = lock(&c.grants);
                        match nic.grant_import(&c.grantee(), &mut g, EndpointAddr::from(importer), &desc) {
                            Ok((grant, fds)) => (Some((id, Reply::ImportOk(grant))), Some(fds)),
                            Err((code, detail)) => (Some((id, Reply::Err { code, detail })), None),
                        }
                    }
                    Request::Unimport { import_id } => {
                        let gone = lock(&c.grants).imports.remove(&import_id);
                        if let Some((ap, generation)) = gone {
                            nic.remote_unref(ap, generation, c.id);
                        }
                        (None, None)
                    }
                    // Granted (or not) by the thread that accepts that connect: no reply now.
                    Request::ImportOnAccept { importer, token } => {
                        nic.file_on_accept(c, EndpointAddr::from(importer), token, id);
                        (None, None)
                    }
                    // The session verified that `from` is on the NIC its hello named, which is
                    // the connecting process's: the kernel's credentials are its sender's.
                    Request::Oob { from, to_port, payload, reply } => (
                        deliver(nic, EndpointAddr::from(from), c.identity(), to_port, &[payload], reply)
                            .map(|r| (id, r)),
                        None,
                    ),
                    Request::OobBatch { from, to_port, payloads, reply } => (
                        deliver(nic, EndpointAddr::from(from), c.identity(), to_port, &payloads, reply)
                            .map(|r| (id, r)),
                        None,
                    ),
                    Request::Hello { .. } => (None, None),
                },
            };
            if let Some((id, r)) = reply {
                let borrowed = fds.as_ref().map(crate::nic::GrantFds::borrowed).unwrap_or_default();
                if c.sock.send(&r.encode(id), &borrowed).is_err() {
                    // The peer does not read its replies (or is gone): drop it rather than
                    // buffer for it.
                    return Some("the peer does not read its replies");
                }
            }
            if got.len == 0 && got.fds.is_empty() {
                return Some("closed by the peer");
            }
        }
    }

    /// Try again to verify the hello of host connection `t`; once settled, serve what came
    /// behind it. Returns why the connection must close, if it must.
    fn verify_hello(&mut self, nic: &Arc<NicInner>, t: Token) -> Option<&'static str> {
        let Some(Entry::Host(c)) = self.entries.get_mut(&t) else { return None };
        let (claimed, _) = c.verify?;
        let step = match verify_nic(claimed, c.cred.pid, nic.addr) {
            Probe::Busy => {
                c.verify = Some((claimed, Instant::now() + RETRY));
                return None;
            }
            p => settle_hello(c, claimed, matches!(p, Probe::Yes), nic.addr),
        };
        c.verify = None;
        match step {
            Step::Reply(id, r) if c.sock.send(&r.encode(id), &[]).is_err() => {
                return Some("the peer does not read its replies");
            }
            Step::Close(r, why) => {
                if let Some((id, r)) = r {
                    let _ = c.sock.send(&r.encode(id), &[]);
                }
                return Some(why);
            }
            _ => {}
        }
        self.serve(nic, t)
    }

    // ---- the host control channel, our outgoing side ---------------------------------

    /// Open our channel to `peer` (a NIC of this host): Some(token), or None if nothing
    /// listens at that name on this host. `watch`: a NIC we already spoke to over its name,
    /// to be watched for its death (nothing listening there means it is gone).
    fn open_out(&mut self, nic: &Arc<NicInner>, peer: NicAddr, watch: bool) -> Option<Token> {
        let hello = Request::Hello { nic: nic.addr.socket_addr(), pid: std::process::id() }.encode(0);
        let now = Instant::now();
        let mut o = Out {
            peer,
            sock: None,
            queue: VecDeque::from([(hello, None)]),
            hello_ok: false,
            unconfirmed: Vec::new(),
            opened: now,
            moved: now,
            retry_at: None,
        };
        match SeqPacket::connect_abstract_nonblocking(&peer.abstract_name()) {
            Ok(s) => o.sock = Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => o.retry_at = Some(now + RETRY),
            Err(e)
                if watch
                    && matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound) =>
            {
                // A NIC we imported from (or sent to) over its name, and nobody listens
                // there now: it is gone (its process died before we came to watch it, or
                // between an import's reply and this). As `retry_out` does: what depends on
                // it fails, and what was kept for it is let go — else a peer that died early
                // would hold its port and chunks here for good. (Without `watch`, a refusal
                // only says the NIC is not of this host: its messages take a link.)
                tracing::debug!(%peer, "host peer gone before we watched it: {e}");
                nic.peer_gone(peer);
                return None;
            }
            Err(_) => return None,
        }
        let t = self.token();
        if let Some(s) = &o.sock {
            if self
                .poll
                .registry()
                .register(&mut SourceFd(&s.as_raw_fd()), t, Interest::READABLE | Interest::WRITABLE)
                .is_err()
            {
                return None;
            }
        }
        self.entries.insert(t, Entry::Out(o));
        self.outs.insert(peer, t);
        self.flush_out(nic, t);
        Some(t)
    }

    fn retry_out(&mut self, nic: &Arc<NicInner>, t: Token, now: Instant) {
        let Some(Entry::Out(o)) = self.entries.get_mut(&t) else { return };
        match SeqPacket::connect_abstract_nonblocking(&o.peer.abstract_name()) {
            Ok(s) => {
                if self
                    .poll
                    .registry()
                    .register(&mut SourceFd(&s.as_raw_fd()), t, Interest::READABLE | Interest::WRITABLE)
                    .is_err()
                {
                    return self.close_out(nic, t, false, "could not register");
                }
                o.sock = Some(s);
                o.retry_at = None;
                self.flush_out(nic, t);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => o.retry_at = Some(now + RETRY),
            Err(_) => self.close_out(nic, t, true, "its listener is gone"),
        }
    }

    fn flush_out(&mut self, nic: &Arc<NicInner>, t: Token) {
        let Some(Entry::Out(o)) = self.entries.get_mut(&t) else { return };
        let Some(sock) = &o.sock else { return };
        while let Some((bytes, _)) = o.queue.front() {
            match sock.send(bytes, &[]) {
                Ok(()) => {
                    if let Some(q) = o.queue.pop_front() {
                        if !o.hello_ok && q.1.is_some() {
                            o.unconfirmed.push(q);
                        }
                    }
                    o.moved = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return self.close_out(nic, t, true, "its connection broke"),
            }
        }
    }

    fn service_out(&mut self, nic: &Arc<NicInner>, t: Token, readable: bool) {
        self.flush_out(nic, t);
        if !readable {
            return;
        }
        let Some(Entry::Out(o)) = self.entries.get_mut(&t) else { return };
        let Some(sock) = &o.sock else { return };
        let mut buf = [0u8; MAX_MSG];
        loop {
            match sock.recv(&mut buf) {
                Ok(g) if g.len == 0 && g.fds.is_empty() => {
                    return self.close_out(nic, t, true, "it closed our channel");
                }
                Ok(g) => match Reply::decode(&buf[..g.len]) {
                    Ok((_, Reply::HelloOk { nic: n })) if NicAddr::from(n) == o.peer => {
                        o.hello_ok = true;
                        o.unconfirmed.clear();
                    }
                    Ok((_, Reply::Err { code, detail })) if !o.hello_ok => {
                        // Our hello was refused (it could not verify us in time, or we hold too
                        // many connections): what we sent behind it was dropped. Try again on
                        // a new connection, within our deadline.
                        tracing::debug!(peer = %o.peer, ?code, "our hello was refused: {detail}");
                        return self.reopen_out(t);
                    }
                    Ok((_, Reply::Err { code, detail })) => {
                        tracing::debug!(peer = %o.peer, ?code, "our channel's message refused: {detail}")
                    }
                    _ => return self.close_out(nic, t, true, "it answered nonsense"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return self.close_out(nic, t, true, "its connection broke"),
            }
        }
    }

    /// Start our channel to a host peer again: its hello first, then what the peer dropped.
    fn reopen_out(&mut self, t: Token) {
        let Some(Entry::Out(o)) = self.entries.get_mut(&t) else { return };
        if let Some(s) = o.sock.take() {
            let _ = self.poll.registry().deregister(&mut SourceFd(&s.as_raw_fd()));
        }
        let hello = Request::Hello {
            nic: self.nic.upgrade().map_or(o.peer, |n| n.addr).socket_addr(),
            pid: std::process::id(),
        };
        let mut q: VecDeque<Queued> = std::mem::take(&mut o.unconfirmed).into();
        q.push_front((hello.encode(0), None));
        q.extend(o.queue.drain(..).filter(|m| m.1.is_some()));
        o.queue = q;
        o.retry_at = Some(Instant::now() + RETRY * 10);
    }

    /// Close our channel to a host peer; `gone`: the peer is dead or unusable, so everything
    /// that depends on it fails.
    fn close_out(&mut self, nic: &Arc<NicInner>, t: Token, gone: bool, why: &str) {
        let Some(Entry::Out(o)) = self.entries.remove(&t) else { return };
        if let Some(s) = &o.sock {
            let _ = self.poll.registry().deregister(&mut SourceFd(&s.as_raw_fd()));
        }
        if self.outs.get(&o.peer) == Some(&t) {
            self.outs.remove(&o.peer);
        }
        for (_, ends) in o.queue.into_iter().chain(o.unconfirmed) {
            if let Some((from, to)) = ends {
                nic.conns.unreachable(nic, from.port, to);
            }
        }
        if gone {
            tracing::debug!(peer = %o.peer, "host peer gone: {why}");
            nic.peer_gone(o.peer);
        }
    }

    // ---- the outbox -------------------------------------------------------------------

    fn route_outbox(&mut self, nic: &Arc<NicInner>) {
        // Consecutive messages between the same two endpoints travel as one batch.
        let mut batches: Vec<(EndpointAddr, EndpointAddr, Vec<[u8; 40]>)> = Vec::new();
        for (from, to, payload) in nic.take_outbox() {
            match batches.last_mut() {
                Some((f, t, ps)) if *f == from && *t == to && ps.len() < clan_wire::control::MAX_BATCH => {
                    ps.push(payload)
                }
                _ => batches.push((from, to, vec![payload])),
            }
        }
        for (from, to, payloads) in batches {
            if to.nic == nic.addr {
                if payloads.iter().any(|p| nic.deliver_oob(from, nic.own_identity(), to.port, *p).is_err()) {
                    nic.conns.unreachable(nic, from.port, to);
                }
                continue;
            }
            if nic.config.local_transport == LocalTransport::SharedMemory {
                let t = match self.outs.get(&to.nic) {
                    Some(t) => Some(*t),
                    None => self.open_out(nic, to.nic, false),
                };
                if let Some(t) = t {
                    if let Some(Entry::Out(o)) = self.entries.get_mut(&t) {
                        if o.queue.len() >= MAX_OUT_QUEUE {
                            tracing::warn!(peer = %to.nic, "out-of-band message dropped: the peer does not read");
                            nic.conns.unreachable(nic, from.port, to);
                        } else {
                            let req = Request::OobBatch { from: from.into(), to_port: to.port, payloads, reply: false };
                            o.queue.push_back((req.encode(0), Some((from, to))));
                        }
                    }
                    self.flush_out(nic, t);
                    continue;
                }
            }
            for p in payloads {
                self.send_over_link(nic, from, to, p);
            }
        }
    }

    fn send_over_link(&mut self, nic: &Arc<NicInner>, from: EndpointAddr, to: EndpointAddr, payload: [u8; 40]) {
        if !nic.config.tcp {
            nic.conns.unreachable(nic, from.port, to);
            return;
        }
        if let Some(l) = nic.links.ready(to.nic) {
            if !l.send_control_bounded(&oob_frame(from, to, payload)) {
                tracing::warn!(peer = %to.nic, "out-of-band message dropped: the peer does not read");
                nic.conns.unreachable(nic, from.port, to);
            }
            return;
        }
        let q = self.parked.entry(to.nic).or_default();
        if q.len() >= MAX_PARKED {
            nic.conns.unreachable(nic, from.port, to);
            return;
        }
        q.push_back(Parked { from, to, payload, expires: Instant::now() + nic.config.request_timeout });
        if !nic.links.connecting(to.nic) {
            nic.links.start_connecting(to.nic);
        }
        self.dial(nic, to.nic);
    }

    fn drop_parked(&mut self, nic: &Arc<NicInner>, peer: NicAddr) {
        for p in self.parked.remove(&peer).into_iter().flatten() {
            nic.conns.unreachable(nic, p.from.port, p.to);
        }
    }
}

/// Write what the hand-shake has to send, without blocking; false if the connection broke.
fn flush_setup(s: &mut Setup) -> bool {
    s.hs.poll_transmit(&mut s.out);
    while !s.out.is_empty() && s.connected {
        match s.sock.write(&s.out) {
            Ok(0) => return false,
            Ok(n) => {
                s.out.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

fn hs_config(nic: &NicInner) -> HandshakeConfig {
    HandshakeConfig {
        local: nic.addr.socket_addr(),
        credit: nic.config.link.credit,
        key: nic.config.cluster_key,
        timeout: nic.config.request_timeout,
        hello_timeout: SessionLimits::default().hello_timeout,
    }
}
