//! The NIC engine: the thread that serves the host control channel and drives links.
//!
//! It waits in epoll (through mio). Within a host it only serves other NICs' import,
//! unimport and out-of-band requests: data never passes through it. For links it accepts and
//! dials TCP connections and runs their handshake (hello, optional authentication, the
//! tie-break between simultaneous connections), then processes incoming frames (unless the
//! application drives progress itself), flushes queued control frames and runs the keepalive.
//!
//! Every request is validated before anything is touched; a host connection that sends
//! garbage gets an error reply and is dropped after [`MAX_BAD`] bad messages, and one whose
//! peer does not read its replies is dropped rather than allowed to stall the engine.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clan_shm::seqpacket::{PeerCred, SeqPacket};
use clan_wire::{Decoder, Frame, Hello, Item, LinkState, Status};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::addr::NicAddr;
use crate::config::Progress;
use crate::ctl::{self, Code, Reply, Request};
use crate::link::Link;
use crate::nic::{Cmd, NicInner};

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
const TCP_LISTENER: Token = Token(2);
/// Bad messages tolerated on one host connection.
pub const MAX_BAD: u32 = 8;
/// Bytes of incoming link traffic processed per link before looking at the others.
const BUDGET: usize = 1 << 20;

/// Server-side state of one host connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub sock: SeqPacket,
    pub cred: PeerCred,
    pub id: u64,
    pub hello: Option<NicAddr>,
    /// Whether `hello` was checked to be a NIC of the connecting process.
    pub verified: Option<bool>,
    pub imports: HashMap<u64, (u32, u32)>,
    pub eqs: HashSet<u32>,
    pub bad: u32,
}

/// A link being set up.
struct Handshake {
    sock: mio::net::TcpStream,
    /// The NIC we dialled, for outgoing connections.
    out: Option<NicAddr>,
    connected: bool,
    sent_hello: bool,
    nonce: [u8; 16],
    buf: Vec<u8>,
    peer: Option<Hello>,
    auth_sent: bool,
    auth_ok: bool,
    deadline: Instant,
    dead: Option<String>,
    /// Acceptor: the tie-break kept this connection (our hello may go out).
    accepted: bool,
    /// Refused as a duplicate by the peer: the winning connection is coming the other way.
    duplicate: bool,
}

enum Entry {
    Host(Conn),
    Handshake(Handshake),
    Link(Arc<Link>),
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
        cpu: Option<usize>,
    ) -> std::io::Result<(Engine, Arc<Waker>)> {
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        poll.registry().register(&mut SourceFd(&listener.as_raw_fd()), LISTENER, Interest::READABLE)?;
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
            Run { nic, listener, tcp, poll, stop: s, entries: HashMap::new(), next_token: 3 }.run()
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
}

fn random16() -> [u8; 16] {
    let mut b = [0u8; 16];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    b
}

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
            let mut next = now + Duration::from_secs(1);
            // Keepalive and handshake deadlines (and, in manual progress, a periodic look at
            // the links so that a silent application does not let them die).
            let manual = nic.manual_progress();
            let mut dead = Vec::new();
            for (t, e) in &self.entries {
                match e {
                    Entry::Link(l) => {
                        if manual {
                            l.progress(&nic);
                        }
                        next = next.min(l.handle_timeout(now));
                        if l.is_closed() {
                            dead.push(*t);
                        }
                    }
                    Entry::Handshake(h) => {
                        if now >= h.deadline || h.dead.is_some() {
                            dead.push(*t);
                        } else {
                            next = next.min(h.deadline);
                        }
                    }
                    Entry::Host(_) => {}
                }
            }
            for t in dead {
                self.drop_entry(&nic, t, "handshake timed out");
            }
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
                        nic.flush_outbox();
                    }
                    LISTENER => self.accept_host(&nic),
                    TCP_LISTENER => self.accept_tcp(&nic),
                    t => {
                        if self.service(&nic, t, readable, writable) {
                            more.push(t);
                        }
                        active = true;
                    }
                }
            }
            // Busy polling: keep looking at the links for a while after activity.
            if let Progress::BusyPoll(d) = nic.config.progress {
                for (t, e) in &self.entries {
                    if let Entry::Link(l) = e {
                        if l.engine_receive(&nic, BUDGET) {
                            more.push(*t);
                        }
                        if l.is_closed() {
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
                    Entry::Handshake(_) => {}
                }
            }
        }
    }

    fn drop_entry(&mut self, nic: &Arc<NicInner>, t: Token, why: &str) {
        match self.entries.remove(&t) {
            Some(Entry::Host(c)) => {
                let _ = self.poll.registry().deregister(&mut SourceFd(&c.sock.as_raw_fd()));
                let still = self.entries.values().any(|e| {
                    matches!(e, Entry::Host(o) if o.hello.is_some() && o.hello == c.hello && o.cred.pid == c.cred.pid)
                });
                nic.connection_closed(c, still);
            }
            Some(Entry::Handshake(mut h)) => {
                let _ = self.poll.registry().deregister(&mut h.sock);
                if let Some(x) = h.out {
                    let reason = h.dead.take().unwrap_or_else(|| why.to_string());
                    // Refused as a duplicate: the winning connection comes the other way, and
                    // waiters keep waiting for it (within their own deadline).
                    if !h.duplicate && !self.handshaking_with(x) {
                        nic.links.fail(x, reason);
                    }
                }
            }
            Some(Entry::Link(l)) => {
                let _ = self.poll.registry().deregister(&mut SourceFd(&l.sock.as_raw_fd()));
                nic.link_closed(&l);
            }
            None => {}
        }
    }

    fn handshaking_with(&self, x: NicAddr) -> bool {
        self.entries.values().any(|e| match e {
            Entry::Handshake(h) => {
                h.dead.is_none() && (h.out == Some(x) || h.peer.is_some_and(|p| NicAddr::from(p.nic) == x))
            }
            _ => false,
        })
    }

    fn commands(&mut self, nic: &Arc<NicInner>) {
        for cmd in nic.take_commands() {
            match cmd {
                Cmd::Connect(x) => {
                    // A connection from `x` is already up or being set up (it dialled us
                    // first): waiters get that one when its handshake completes. Dialling
                    // too would replace it and break what was sent over it.
                    if nic.links.ready(x).is_some() {
                        nic.links.notify();
                        continue;
                    }
                    if self.handshaking_with(x) {
                        continue;
                    }
                    let to = nic.route(x);
                    match mio::net::TcpStream::connect(to) {
                        Ok(mut sock) => {
                            let t = self.token();
                            let _ = sock.set_nodelay(true);
                            if self
                                .poll
                                .registry()
                                .register(&mut sock, t, Interest::READABLE | Interest::WRITABLE)
                                .is_err()
                            {
                                nic.links.fail(x, "could not register the connection".into());
                                continue;
                            }
                            self.entries.insert(t, Entry::Handshake(Handshake::new(sock, Some(x), nic)));
                        }
                        Err(e) => nic.links.fail(x, format!("connect to {to}: {e}")),
                    }
                }
            }
        }
    }

    fn accept_host(&mut self, nic: &Arc<NicInner>) {
        loop {
            match self.listener.accept() {
                Ok(Some(sock)) => {
                    let Ok(cred) = sock.peer_cred() else { continue };
                    if sock.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let token = self.token();
                    if self
                        .poll
                        .registry()
                        .register(&mut SourceFd(&sock.as_raw_fd()), token, Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    let id = nic.next_serial();
                    self.entries.insert(
                        token,
                        Entry::Host(Conn {
                            sock,
                            cred,
                            id,
                            hello: None,
                            verified: None,
                            imports: HashMap::new(),
                            eqs: HashSet::new(),
                            bad: 0,
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

    fn accept_tcp(&mut self, nic: &Arc<NicInner>) {
        let Some(l) = self.tcp.as_ref() else { return };
        let mut accepted = Vec::new();
        loop {
            match l.accept() {
                Ok((sock, _)) => accepted.push(sock),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("clan engine: tcp accept failed: {e}");
                    break;
                }
            }
        }
        for mut sock in accepted {
            let _ = sock.set_nodelay(true);
            let t = self.token();
            if self.poll.registry().register(&mut sock, t, Interest::READABLE | Interest::WRITABLE).is_ok() {
                let mut h = Handshake::new(sock, None, nic);
                h.connected = true;
                self.entries.insert(t, Entry::Handshake(h));
            }
        }
    }

    /// Returns true if the entry has more to do right away.
    fn service(&mut self, nic: &Arc<NicInner>, t: Token, readable: bool, writable: bool) -> bool {
        enum Next {
            Nothing,
            Close(&'static str),
            More,
            Decide(NicAddr),
            Ready(NicAddr, Hello, Vec<u8>),
        }
        let next = match self.entries.get_mut(&t) {
            None => Next::Nothing,
            Some(Entry::Host(c)) => {
                if serve(nic, c) {
                    Next::Close("closed")
                } else {
                    Next::Nothing
                }
            }
            Some(Entry::Link(l)) => {
                if writable {
                    l.try_flush();
                }
                let more = readable && !nic.manual_progress() && l.engine_receive(nic, BUDGET);
                if l.is_closed() {
                    Next::Close("link closed")
                } else if more {
                    Next::More
                } else {
                    Next::Nothing
                }
            }
            Some(Entry::Handshake(h)) => match h.step(nic) {
                HsStep::Pending => Next::Nothing,
                HsStep::Decide => Next::Decide(NicAddr::from(h.peer.expect("decide implies hello").nic)),
                HsStep::Failed => Next::Close("handshake failed"),
                HsStep::Ready => {
                    let hello = h.peer.expect("ready implies hello");
                    Next::Ready(NicAddr::from(hello.nic), hello, std::mem::take(&mut h.buf))
                }
            },
        };
        match next {
            Next::Nothing => false,
            Next::More => true,
            Next::Close(why) => {
                self.drop_entry(nic, t, why);
                false
            }
            Next::Decide(peer) => {
                if self.accept_link(nic, t, peer) {
                    // Our hello goes out now; the rest of the handshake continues.
                    self.service(nic, t, true, true)
                } else {
                    false
                }
            }
            Next::Ready(peer, hello, rest) => self.handshake_done(nic, t, peer, hello, rest),
        }
    }

    /// The tie-break, decided by the acceptor before it answers: one link per pair of NICs.
    /// Returns whether the incoming connection from `peer` is kept.
    fn accept_link(&mut self, nic: &Arc<NicInner>, t: Token, peer: NicAddr) -> bool {
        let ours_dialling = self
            .entries
            .iter()
            .any(|(k, e)| *k != t && matches!(e, Entry::Handshake(o) if o.out == Some(peer) && o.dead.is_none()));
        let keep = match nic.links.ready(peer) {
            // We dialled a link that the peer accepted, and we win the tie-break: keep ours.
            Some(l) if l.dialled && nic.addr < peer => false,
            // The peer dialled again while a link exists: it no longer trusts the old one (it
            // restarted, or the old one broke on its side).
            Some(l) => {
                l.close(Status::Duplicate, "replaced by a new connection from the peer");
                nic.link_closed(&l);
                true
            }
            None if ours_dialling => {
                if peer < nic.addr {
                    // Their connection wins; ours will be refused by them.
                    for e in self.entries.values_mut() {
                        if let Entry::Handshake(o) = e {
                            if o.out == Some(peer) {
                                o.dead = Some("superseded by the peer's connection".into());
                                o.duplicate = true;
                            }
                        }
                    }
                    true
                } else {
                    false
                }
            }
            None => true,
        };
        match self.entries.get_mut(&t) {
            Some(Entry::Handshake(h)) if keep => {
                h.accepted = true;
                true
            }
            Some(Entry::Handshake(h)) => {
                let mut b = Vec::new();
                Frame::Close { status: Status::Duplicate }.encode(&mut b);
                let _ = h.sock.write(&b);
                h.dead = Some("duplicate".into());
                self.drop_entry(nic, t, "duplicate");
                false
            }
            _ => false,
        }
    }

    fn handshake_done(&mut self, nic: &Arc<NicInner>, t: Token, peer: NicAddr, hello: Hello, rest: Vec<u8>) -> bool {
        let Some(Entry::Handshake(h)) = self.entries.remove(&t) else { return false };
        let Handshake { mut sock, out, .. } = h;
        if out.is_some() {
            // A link we dialled is up; a stale one (the peer restarted) goes.
            if let Some(old) = nic.links.ready(peer) {
                old.close(Status::Duplicate, "replaced by a new connection");
                nic.link_closed(&old);
            }
        }
        let _ = self.poll.registry().deregister(&mut sock);
        let mut state = LinkState::new(nic.config.link, Instant::now());
        state.on_credit(hello.credit);
        let link = Arc::new(Link::new(peer, nic.next_serial(), out.is_some(), sock, state, nic.config.request_timeout));
        link.preload(&rest);
        let fd = link.sock.as_raw_fd();
        let interest = if nic.manual_progress() { Interest::WRITABLE } else { Interest::READABLE | Interest::WRITABLE };
        if self.poll.registry().register(&mut SourceFd(&fd), t, interest).is_err() {
            link.close(Status::Other, "could not register the link");
            nic.links.fail(peer, "could not register the link".into());
            return false;
        }
        self.entries.insert(t, Entry::Link(link.clone()));
        nic.links.ready_now(peer, link);
        !rest.is_empty()
    }
}

enum HsStep {
    Pending,
    /// Acceptor: the peer said hello; keep the connection or refuse it.
    Decide,
    Ready,
    Failed,
}

impl Handshake {
    fn new(sock: mio::net::TcpStream, out: Option<NicAddr>, nic: &NicInner) -> Handshake {
        Handshake {
            sock,
            out,
            connected: false,
            sent_hello: false,
            nonce: random16(),
            buf: Vec::new(),
            peer: None,
            auth_sent: false,
            auth_ok: nic.config.cluster_key.is_none(),
            deadline: Instant::now() + nic.config.request_timeout,
            dead: None,
            accepted: false,
            duplicate: false,
        }
    }

    fn fail(&mut self, why: String) -> HsStep {
        self.dead = Some(why);
        HsStep::Failed
    }

    fn step(&mut self, nic: &NicInner) -> HsStep {
        if self.dead.is_some() {
            return HsStep::Failed;
        }
        if !self.connected {
            if let Ok(Some(e)) | Err(e) = self.sock.take_error() {
                return self.fail(format!("connect failed: {e}"));
            }
            match self.sock.peer_addr() {
                Ok(_) => self.connected = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotConnected => return HsStep::Pending,
                Err(e) => return self.fail(format!("connect failed: {e}")),
            }
        }
        let auth = nic.config.cluster_key;
        // The dialler speaks first; the acceptor answers only once it has decided to keep the
        // connection (`Run::accept_link`), so a dialler never starts using a connection that
        // loses the tie-break.
        if !self.sent_hello && (self.out.is_some() || self.accepted) {
            let mut b = Vec::new();
            Frame::Hello(Hello {
                version: clan_wire::frame::VERSION,
                flags: u16::from(auth.is_some()),
                nic: nic.addr.socket_addr(),
                nonce: self.nonce,
                credit: nic.config.link.credit,
            })
            .encode(&mut b);
            if self.sock.write_all(&b).is_err() {
                return self.fail("could not send hello".into());
            }
            self.sent_hello = true;
        }
        let mut tmp = [0u8; 1024];
        // End of stream is acted on only after what came before it is decoded: a refusal
        // (`Close`) is usually followed at once by the end of the connection.
        let mut eof = false;
        loop {
            match self.sock.read(&mut tmp) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    if self.buf.len() + n > 64 << 10 {
                        return self.fail("handshake flood".into());
                    }
                    self.buf.extend_from_slice(&tmp[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return self.fail(format!("handshake failed: {e}")),
            }
        }
        let mut dec = Decoder::new();
        loop {
            if self.peer.is_some() && self.out.is_none() && !self.accepted {
                return HsStep::Decide;
            }
            if self.peer.is_some() && self.auth_ok && self.sent_hello {
                return HsStep::Ready;
            }
            let (frame, used) = match dec.next(&self.buf) {
                Ok(Some((Item::Frame(f), used))) => (f, used),
                Ok(Some(_)) => return self.fail("data before the handshake finished".into()),
                Ok(None) if eof => return self.fail("connection closed during handshake".into()),
                Ok(None) => return HsStep::Pending,
                Err(e) => return self.fail(format!("bad handshake frame: {e}")),
            };
            let action = match frame {
                Frame::Hello(h) => {
                    if h.version != clan_wire::frame::VERSION {
                        Err(format!("peer speaks protocol version {}", h.version))
                    } else if self.out.is_some_and(|x| x.socket_addr() != h.nic) {
                        Err(format!("{} answered at the address of {:?}", h.nic, self.out))
                    } else if (h.flags & 1 != 0) != auth.is_some() {
                        Err("one side requires authentication, the other does not".into())
                    } else {
                        self.peer = Some(h);
                        Ok(())
                    }
                }
                Frame::Auth(proof) => match (auth, self.peer) {
                    (Some(key), Some(peer)) if proof == auth_proof(&key, &self.nonce, peer.nic) => {
                        self.auth_ok = true;
                        Ok(())
                    }
                    _ => Err("authentication failed".into()),
                },
                Frame::Close { status } => {
                    self.duplicate = status == Status::Duplicate;
                    Err(format!("refused by the peer: {status:?}"))
                }
                _ => Err("unexpected frame during the handshake".into()),
            };
            self.buf.drain(..used);
            if let Err(why) = action {
                return self.fail(why);
            }
            if let (Some(key), Some(peer), false) = (auth, self.peer, self.auth_sent) {
                let mut b = Vec::new();
                Frame::Auth(auth_proof(&key, &peer.nonce, nic.addr.socket_addr())).encode(&mut b);
                if self.sock.write_all(&b).is_err() {
                    return self.fail("could not send authentication".into());
                }
                self.auth_sent = true;
            }
        }
    }
}

/// Proof that the sender of `addr` holds the cluster key, bound to the receiver's nonce.
fn auth_proof(key: &[u8; 32], nonce: &[u8; 16], addr: std::net::SocketAddr) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"clan link auth v1");
    h.update(nonce);
    h.update(addr.to_string().as_bytes());
    *h.finalize().as_bytes()
}

/// Serve every pending message of a host connection. Returns true if it must be closed.
fn serve(nic: &Arc<NicInner>, c: &mut Conn) -> bool {
    let mut buf = [0u8; ctl::MAX_MSG];
    loop {
        let got = match c.sock.recv(&mut buf) {
            Ok(g) => g,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        };
        if got.len == 0 && got.fds.is_empty() {
            return true; // orderly close, or the process died
        }
        // Requests never carry descriptors: any that came are closed here.
        let req = if got.truncated || !got.fds.is_empty() { None } else { Request::decode(&buf[..got.len]).ok() };
        let (reply, fds): (Option<Reply>, Vec<OwnedFd>) = match req {
            None => {
                c.bad += 1;
                (Some(Reply::Err { code: Code::Malformed, detail: "malformed request".into() }), Vec::new())
            }
            Some(Request::Hello { nic: addr, pid }) => {
                if pid != c.cred.pid {
                    c.bad += 1;
                    (
                        Some(Reply::Err { code: Code::Malformed, detail: "pid does not match credentials".into() }),
                        Vec::new(),
                    )
                } else {
                    c.hello = Some(addr);
                    (Some(Reply::HelloOk { nic: nic.addr }), Vec::new())
                }
            }
            Some(_) if c.hello.is_none() => {
                c.bad += 1;
                (Some(Reply::Err { code: Code::NeedHello, detail: "hello first".into() }), Vec::new())
            }
            Some(Request::Import { importer, want_eq, desc }) => match nic.grant_import(c, importer, want_eq, &desc) {
                Ok((grant, fds)) => (Some(Reply::ImportOk(grant)), fds),
                Err((code, detail)) => (Some(Reply::Err { code, detail }), Vec::new()),
            },
            Some(Request::Unimport { import_id }) => {
                if let Some((ap, generation)) = c.imports.remove(&import_id) {
                    nic.remote_unref(ap, generation, c.id);
                }
                (None, Vec::new())
            }
            Some(Request::Oob { from, to_port, payload }) => {
                let r = match nic.deliver_oob(from, to_port, payload) {
                    Ok(()) => Reply::Ok,
                    Err(code) => Reply::Err { code, detail: String::new() },
                };
                (Some(r), Vec::new())
            }
        };
        if let Some(r) = reply {
            let borrowed: Vec<_> = fds.iter().map(std::os::fd::AsFd::as_fd).collect();
            if c.sock.send(&r.encode(), &borrowed).is_err() {
                return true; // the peer does not read: drop it rather than stall
            }
        }
        if c.bad >= MAX_BAD {
            tracing::warn!("clan engine: dropping connection from pid {} after {} bad messages", c.cred.pid, c.bad);
            return true;
        }
    }
}
