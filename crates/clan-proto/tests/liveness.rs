//! Liveness of the control plane, tested as users and attackers act: separate processes,
//! clients that come and go, exit without closing or are SIGKILLed at random points of the
//! hand-shake, a `?` accept loop, and hostile processes (an unprivileged uid when run as
//! root) and hostile link peers attacking while legitimate clients keep working.
//!
//! Every test has a watchdog. The assertions are functional: no legitimate connect fails
//! (with a connect timeout shorter than what any stall would cost), the server's accept loop
//! never sees an error, and its file descriptors come back to their baseline and its memory
//! stays bounded once the churn or the attack is over.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, LocalTransport, Nic, NicAddr, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use clan_shm::seqpacket::SeqPacket;
use clan_wire::control::{EndpointId, Request};
use util::{Peer, Watchdog, hear, say};

/// Bound on every legitimate connect: far below the request timeout (5 s) that a stall on a
/// silent peer would cost, so a client delayed by another peer's misbehaviour fails.
const CONNECT: Duration = Duration::from_secs(3);

fn stream_cfg() -> StreamConfig {
    StreamConfig { ring: 16 << 10, post_area: 0, connect_timeout: CONNECT, ..StreamConfig::default() }
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn env<T: std::str::FromStr>(k: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set")).parse().unwrap()
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    u64::from_le_bytes(b)
}

/// One connect, a one-byte echo, and the stream.
fn connect_echo(nic: &Nic, to: EndpointAddr) -> std::io::Result<Stream> {
    let mut s = Stream::connect_with(nic, to, &stream_cfg())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    if &b != b"x" {
        return Err(std::io::Error::other("wrong echo"));
    }
    Ok(s)
}

// ---- children ---------------------------------------------------------------------------

/// The child side: dispatch on the role.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "echo-server" => echo_server(),
        "clients" => clients(),
        "hostile-local" => hostile_local(),
        "hostile-link" => hostile_link(),
        other => panic!("unknown role {other}"),
    }
}

/// An echo server with a `?` accept loop, answering `stats` on stdin with its descriptor
/// count, resident memory and the number of connections served.
fn echo_server() {
    let link = std::env::var("CLAN_LINK").is_ok();
    let nic = Nic::open(NicConfig {
        // No cache of recycled apertures: every descriptor left after the churn is a leak.
        cache_bytes: 0,
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    })
    .unwrap();
    let l = Listener::bind_with(&nic, Some(7), stream_cfg()).unwrap();
    // An aperture a hostile link peer may import (to send read requests that are valid).
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(1 << 20).unwrap();
    say(format!("{} {}", l.local_addr(), ap.descriptor()));
    let served = Arc::new(AtomicU64::new(0));
    let s2 = served.clone();
    std::thread::spawn(move || {
        while let Some(line) = hear() {
            if line == "stats" {
                say(format!("{} {} {}", fd_count(), rss_kib(), s2.load(Ordering::Relaxed)));
            } else if line == "fds" {
                let unix = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
                for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
                    let target = std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default();
                    let extra = target
                        .strip_prefix("socket:[")
                        .and_then(|i| i.strip_suffix(']'))
                        .and_then(|i| unix.lines().find(|l| l.split_whitespace().nth(6) == Some(i)))
                        .unwrap_or("");
                    eprintln!("server fd {:?} -> {target} {extra}", e.file_name());
                }
            }
        }
        std::process::exit(0);
    });
    if let Err(e) = serve(&l, &served) {
        say(format!("ACCEPT-ERROR {e} ({:?})", e.kind()));
        std::process::exit(3);
    }
}

/// The accept loop a user writes: any error ends it.
fn serve(l: &Listener, served: &Arc<AtomicU64>) -> std::io::Result<()> {
    for s in l.incoming() {
        let s = s?;
        let served = served.clone();
        std::thread::spawn(move || {
            // Echo everything until the client goes (closes, exits, or is killed).
            let mut b = [0u8; 64];
            let mut first = true;
            while let Ok(n @ 1..) = (&s).read(&mut b) {
                if first {
                    // Counted before the echo: a client that has its echo has been counted.
                    served.fetch_add(1, Ordering::Relaxed);
                    first = false;
                }
                if (&s).write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
    }
    Ok(())
}

/// `CLAN_N` connects to `CLAN_SERVER` (`CLAN_MODE`: `normal`; `vanish`: exit without closing
/// anything after the last; `loop`: until killed).
fn clients() {
    let server: EndpointAddr = env("CLAN_SERVER");
    let n: u64 = env("CLAN_N");
    let mode: String = env("CLAN_MODE");
    let link = std::env::var("CLAN_LINK").is_ok();
    let nic = Nic::open(NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    })
    .unwrap();
    let (mut fails, mut worst) = (0u64, Duration::ZERO);
    let mut i = 0;
    loop {
        if mode != "loop" && i >= n {
            break;
        }
        i += 1;
        let t = Instant::now();
        match connect_echo(&nic, server) {
            Ok(s) => {
                if mode == "vanish" && i == n {
                    say("vanishing");
                    std::process::exit(0); // nothing closed, nothing dropped
                }
                drop(s);
            }
            Err(e) => {
                fails += 1;
                eprintln!("connect {i} failed after {:?}: {e} ({:?})", t.elapsed(), e.kind());
            }
        }
        worst = worst.max(t.elapsed());
    }
    say(format!("done {fails} {}", worst.as_micros()));
    while hear().is_some() {}
}

/// What an attacker saw of the server's defences (each must have happened).
#[derive(Default)]
struct Seen {
    /// Idle connections the server closed.
    idle_closed: AtomicU64,
    /// Garbage connections the server cut off.
    garbage_cut: AtomicU64,
    /// Forged hellos refused.
    forged_refused: AtomicU64,
    /// Non-reading connections cut off.
    nonreader_cut: AtomicU64,
}

impl Seen {
    fn line(&self) -> String {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "seen {} {} {} {}",
            l(&self.idle_closed),
            l(&self.garbage_cut),
            l(&self.forged_refused),
            l(&self.nonreader_cut)
        )
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// A squatter: an abstract name that looks like a NIC's, bound and never accepted from.
fn squatter() -> (NicAddr, SeqPacket) {
    for _ in 0..100 {
        let addr = NicAddr::localhost(20000 + (rand_u64() % 40000) as u16);
        if let Ok(l) = SeqPacket::listen_abstract(&addr.abstract_name()) {
            return (addr, l);
        }
    }
    panic!("no free name");
}

/// A control connection to `server` that said a verified hello for `me`.
fn hello(server: NicAddr, me: NicAddr) -> Option<SeqPacket> {
    let s = SeqPacket::connect_abstract(&server.abstract_name()).ok()?;
    s.set_timeouts(Duration::from_secs(2)).ok()?;
    s.send(&Request::Hello { nic: me.socket_addr(), pid: std::process::id() }.encode(1), &[]).ok()?;
    let mut b = [0u8; 512];
    s.recv(&mut b).ok()?;
    Some(s)
}

/// A hostile local process, attacking `CLAN_SERVER`'s NIC until its stdin closes: idle
/// connections by the hundred, garbage, forged hellos and senders, connection requests from
/// a NIC that never accepts, and requests whose replies it never reads.
fn hostile_local() {
    let server: EndpointAddr = env("CLAN_SERVER");
    let victim: NicAddr = env("CLAN_VICTIM");
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let name = server.nic.abstract_name();
    let mut threads = Vec::new();
    let only = std::env::var("CLAN_ATTACKS").unwrap_or_default();
    let on = |what: &str| only.is_empty() || only.split(',').any(|a| a == what);
    // 500 connections that never say anything, renewed as the server drops them.
    if on("idle") {
        let name = name.clone();
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<SeqPacket> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                held.retain(|s| {
                    let _ = s.set_nonblocking(true);
                    let mut b = [0u8; 8];
                    let closed = matches!(s.recv(&mut b), Ok(r) if r.len == 0 && r.fds.is_empty());
                    if closed {
                        bump(&seen.idle_closed);
                    }
                    !closed
                });
                while held.len() < 500 {
                    match SeqPacket::connect_abstract_nonblocking(&name) {
                        Ok(s) => held.push(s),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    // Garbage: random packets, oversized ones, packets carrying descriptors.
    if on("garbage") {
        let name = name.clone();
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            let devnull = std::fs::File::open("/dev/null").unwrap();
            while !stop.load(Ordering::Relaxed) {
                let Ok(s) = SeqPacket::connect_abstract(&name) else { continue };
                let _ = s.set_timeouts(Duration::from_millis(200));
                for i in 0..40u64 {
                    let n = 1 + (rand_u64() % 700) as usize;
                    let junk: Vec<u8> = (0..n).map(|_| rand_u64() as u8).collect();
                    let fds = if i % 3 == 0 { vec![std::os::fd::AsFd::as_fd(&devnull)] } else { vec![] };
                    if s.send(&junk, &fds).is_err() {
                        bump(&seen.garbage_cut);
                        break;
                    }
                    let mut b = [0u8; 512];
                    if matches!(s.recv(&mut b), Ok(r) if r.len == 0) {
                        bump(&seen.garbage_cut);
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }));
    }
    // Forged hellos: the victim's NIC, with our pid and with a made-up one; then hanging up.
    if on("forge") {
        let name = name.clone();
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for pid in [std::process::id(), 1] {
                    let Ok(s) = SeqPacket::connect_abstract(&name) else { continue };
                    let _ = s.set_timeouts(Duration::from_millis(500));
                    let _ = s.send(&Request::Hello { nic: victim.socket_addr(), pid }.encode(1), &[]);
                    let mut b = [0u8; 512];
                    if let Ok(r) = s.recv(&mut b) {
                        if let Ok((_, clan_wire::control::Reply::Err { .. })) =
                            clan_wire::control::Reply::decode(&b[..r.len])
                        {
                            bump(&seen.forged_refused);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }));
    }
    // A NIC name that is bound and never accepted from, connecting to the listener (the
    // server's answers go into a black hole), and sending as somebody else.
    if on("blackhole") {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let (fake, _squat) = squatter();
            // A real descriptor for the requests (from a NIC of ours).
            let nic = Nic::open_default().unwrap();
            let ep = nic.endpoint().unwrap();
            let ap = ep.export(64 << 10).unwrap();
            let d = ap.descriptor().to_bytes();
            let mut blob = (d.len() as u16).to_le_bytes().to_vec();
            blob.extend_from_slice(&d);
            for v in [0xC1A4_51DE_0000_0002u64, 16 << 10, 0, 0] {
                blob.extend_from_slice(&v.to_le_bytes());
            }
            while !stop.load(Ordering::Relaxed) {
                let Some(s) = hello(server.nic, fake) else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let _ = s.set_nonblocking(true);
                for _ in 0..4 {
                    for p in clan_wire::connect::encode_connect(rand_u64(), Duration::from_secs(60), &blob) {
                        let from = EndpointId { nic: fake.socket_addr(), port: 1 };
                        let req = Request::Oob { from, to_port: server.port, payload: p, reply: false };
                        let _ = s.send(&req.encode(0), &[]);
                    }
                }
                // Forged senders: the victim's endpoints.
                for port in 1..4 {
                    let from = EndpointId { nic: victim.socket_addr(), port };
                    let p = clan_wire::connect::encode_close(rand_u64());
                    let _ =
                        s.send(&Request::Oob { from, to_port: server.port, payload: p, reply: true }.encode(2), &[]);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    // Requests whose replies are never read.
    if on("nonread") {
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            let (fake, _squat) = squatter();
            while !stop.load(Ordering::Relaxed) {
                let Some(s) = hello(server.nic, fake) else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let _ = s.set_nonblocking(true);
                let importer = EndpointId { nic: fake.socket_addr(), port: 1 };
                let req = Request::Import { importer, desc: vec![0xAB; 100] }.encode(3);
                let started = Instant::now();
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(5) {
                    match s.send(&req, &[]) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        Err(_) => {
                            bump(&seen.nonreader_cut);
                            break;
                        }
                    }
                }
            }
        }));
    }
    say("attacking");
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    say(seen.line());
}

/// A hostile peer on the link port of `CLAN_SERVER`'s NIC, until its stdin closes: idle TCP
/// connections by the hundred, garbage, hellos claiming the victim's address while its link
/// is up, and a peer that imports, floods read requests and pings, and never reads.
fn hostile_link() {
    use clan_wire::{Frame, Hello, Import, ReadReq, Target};
    let server: EndpointAddr = env("CLAN_SERVER");
    let victim: NicAddr = env("CLAN_VICTIM");
    let desc: clan::Descriptor = env("CLAN_DESC");
    let at = server.nic.socket_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let mut threads = Vec::new();
    let enc = |f: Frame<'_>| {
        let mut b = Vec::new();
        f.encode(&mut b);
        b
    };
    let hello_from = move |nic: std::net::SocketAddr| {
        enc(Frame::Hello(Hello {
            version: clan_wire::frame::VERSION,
            flags: 0,
            nic,
            nonce: rand_u64().to_le_bytes().repeat(2).try_into().unwrap(),
            credit: 1 << 20,
        }))
    };
    {
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                held.retain(|s| {
                    let _ = s.set_nonblocking(true);
                    let mut b = [0u8; 64];
                    let closed = matches!((&*s).read(&mut b), Ok(0));
                    if closed {
                        bump(&seen.idle_closed);
                    }
                    !closed
                });
                while held.len() < 500 {
                    match TcpStream::connect(at) {
                        Ok(s) => held.push(s),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    {
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut s) = TcpStream::connect(at) {
                    let junk: Vec<u8> = (0..1 + (rand_u64() % 4000)).map(|_| rand_u64() as u8).collect();
                    let _ = s.write_all(&junk);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
                    let mut b = [0u8; 256];
                    // The server answers garbage by closing (it may say Close first).
                    while matches!(s.read(&mut b), Ok(n) if n > 0) {}
                    bump(&seen.garbage_cut);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }));
    }
    {
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut s) = TcpStream::connect(at) {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
                    let _ = s.write_all(&hello_from(victim.socket_addr()));
                    let mut got = Vec::new();
                    let mut b = [0u8; 256];
                    while let Ok(n @ 1..) = s.read(&mut b) {
                        got.extend_from_slice(&b[..n]);
                    }
                    // Refused: the victim's link answered the server's probe.
                    let mut dec = clan_wire::Decoder::new();
                    while let Ok(Some((item, used))) = dec.next(&got) {
                        if let clan_wire::Item::Frame(Frame::Close { status: clan_wire::Status::Duplicate }) = item {
                            bump(&seen.forged_refused);
                        }
                        got.drain(..used);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    {
        let stop = stop.clone();
        let seen = seen.clone();
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(at) else { continue };
                let me: std::net::SocketAddr = format!("127.0.0.1:{}", 20000 + rand_u64() % 40000).parse().unwrap();
                let _ = s.write_all(&hello_from(me));
                // Read the hello, the welcome and the import reply (a few hundred bytes), and
                // then never again.
                let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
                let d = desc.to_bytes();
                let _ =
                    s.write_all(&enc(Frame::Import(Import { id: 1, importer_nic: me, importer_port: 1, desc: &d })));
                let mut got = Vec::new();
                let mut dec = clan_wire::Decoder::new();
                let mut key = None;
                let mut b = [0u8; 512];
                let t = Instant::now();
                while key.is_none() && t.elapsed() < Duration::from_secs(3) {
                    match s.read(&mut b) {
                        Ok(n) if n > 0 => got.extend_from_slice(&b[..n]),
                        _ => break,
                    }
                    while let Ok(Some((item, used))) = dec.next(&got) {
                        if let clan_wire::Item::Frame(Frame::ImportReply(r)) = item {
                            key = Some(r.key);
                        }
                        got.drain(..used);
                    }
                }
                let Some(key) = key else { continue };
                let to = Target { aperture: desc.aperture(), generation: desc.generation(), key, offset: 0 };
                let mut flood = Vec::new();
                for i in 0..64 {
                    Frame::ReadReq(ReadReq { id: i, from: to, len: 1 << 20 }).encode(&mut flood);
                    Frame::Ping { token: i }.encode(&mut flood);
                    // Imports by the thousand: each granted one is a record the server keeps.
                    Frame::Import(Import { id: 100 + i, importer_nic: me, importer_port: 1, desc: &d })
                        .encode(&mut flood);
                }
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                let t = Instant::now();
                while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(8) {
                    match s.write_all(&flood) {
                        Ok(()) => {}
                        // Our socket is full: the server stopped reading us.
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        }
                        Err(_) => {
                            bump(&seen.nonreader_cut);
                            break;
                        }
                    }
                }
            }
        }));
    }
    say("attacking");
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    say(seen.line());
}

// ---- the parent's side ------------------------------------------------------------------

struct Server {
    peer: Peer,
    addr: EndpointAddr,
    desc: String,
}

impl Server {
    fn start(link: bool) -> Server {
        let env = if link { vec![("CLAN_LINK", "1".to_string())] } else { vec![] };
        let mut peer = Peer::spawn("child", "echo-server", &env);
        let line = peer.expect("address");
        let mut it = line.split(' ');
        let addr = it.next().unwrap().parse().unwrap();
        let desc = it.next().unwrap().to_string();
        Server { peer, addr, desc }
    }

    /// (descriptors, resident KiB, connections served)
    fn stats(&mut self) -> (usize, u64, u64) {
        self.peer.send("stats");
        let l = self.peer.expect("stats");
        assert!(!l.starts_with("ACCEPT-ERROR"), "the server's accept loop failed: {l}");
        let v: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
        (v[0] as usize, v[1], v[2])
    }

    /// Its descriptors once a client over a link came and went: what the server keeps for
    /// good after its first link (its queue's leader, which sleeps on the link sockets too,
    /// makes its epoll set and eventfd then, if it slept while the link was open), the base
    /// later clients must bring it back to.
    fn fds_after_a_first_link_client(&mut self) -> usize {
        let mut first = spawn_clients(self, 1, "normal", true);
        assert_eq!(expect_done(&mut first).0, 0);
        drop(first);
        let (fds, _, _) = self.stats();
        fds
    }

    /// Wait until the server's descriptors are back to `base` (connections of clients that
    /// went away are noticed and freed); panics with the count if they never are.
    fn settle_fds(&mut self, base: usize, what: &str) {
        let t = Instant::now();
        loop {
            let (fds, _, _) = self.stats();
            if fds <= base {
                return;
            }
            if t.elapsed() > Duration::from_secs(20) {
                self.peer.send("fds");
                std::thread::sleep(Duration::from_millis(500));
                panic!("{what}: the server holds {fds} descriptors, {base} before");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn spawn_clients(server: &Server, n: u64, mode: &str, link: bool) -> Peer {
    let mut env =
        vec![("CLAN_SERVER", server.addr.to_string()), ("CLAN_N", n.to_string()), ("CLAN_MODE", mode.to_string())];
    if link {
        env.push(("CLAN_LINK", "1".to_string()));
    }
    Peer::spawn("child", "clients", &env)
}

fn expect_done(p: &mut Peer) -> (u64, u64) {
    let l = p.expect("done");
    let v: Vec<&str> = l.split(' ').collect();
    assert_eq!(v[0], "done", "{l}");
    (v[1].parse().unwrap(), v[2].parse().unwrap())
}

/// `n` connects from this process (and more until `min` has passed), through a fresh NIC
/// every `fresh` connects.
fn legit_connects(server: EndpointAddr, n: u64, fresh: u64, link: bool, min: Duration) -> (u64, Duration) {
    let cfg = NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    };
    let mut nic = Nic::open(cfg.clone()).unwrap();
    let (mut fails, mut worst) = (0, Duration::ZERO);
    let start = Instant::now();
    let mut i = 0;
    while i < n || start.elapsed() < min {
        i += 1;
        if i % fresh == 0 {
            nic = Nic::open(cfg.clone()).unwrap();
        }
        let t = Instant::now();
        if let Err(e) = connect_echo(&nic, server) {
            fails += 1;
            eprintln!("legitimate connect {i} failed after {:?}: {e} ({:?})", t.elapsed(), e.kind());
        }
        worst = worst.max(t.elapsed());
        if min > Duration::ZERO {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    eprintln!("{i} legitimate connects");
    (fails, worst)
}

/// 50 bytes out and echoed back whole: the server still holds the connection.
fn round_trip(s: &Stream, what: &str) {
    let out: Vec<u8> = (0..50u8).collect();
    (&*s).write_all(&out).unwrap_or_else(|e| panic!("{what}: write failed: {e}"));
    let mut back = vec![0u8; 50];
    (&*s).read_exact(&mut back).unwrap_or_else(|e| panic!("{what}: no echo: {e}"));
    assert_eq!(back, out, "{what}");
}

/// The attacker's report: every defence was met at least once.
fn check_seen(line: Option<String>, what: &str) {
    let line = line.unwrap_or_default();
    let v: Vec<u64> = line
        .strip_prefix("seen ")
        .unwrap_or_else(|| panic!("{what}: no report ({line})"))
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    eprintln!(
        "{what}: idle connections closed {}, garbage cut off {}, forged hellos refused {}, non-readers cut off {}",
        v[0], v[1], v[2], v[3]
    );
    for (n, name) in
        v.iter().zip(["idle connections closed", "garbage cut off", "forged hellos refused", "non-readers cut off"])
    {
        assert!(*n > 0, "{what}: never saw {name}");
    }
}

#[test]
fn sequential_connects_from_fresh_and_old_clients_never_fail() {
    let _wd = Watchdog::new("sequential connects", Duration::from_secs(120));
    let mut server = Server::start(false);
    let (base, _, _) = server.stats();
    // 200 from one NIC, then 10 fresh NICs with 10 each.
    let (f1, w1) = legit_connects(server.addr, 200, 200, false, Duration::ZERO);
    let (f2, w2) = legit_connects(server.addr, 100, 10, false, Duration::ZERO);
    eprintln!("worst connect: {:?} (one NIC), {:?} (fresh NICs)", w1, w2);
    assert_eq!(f1 + f2, 0, "legitimate connects failed");
    let (_, _, served) = server.stats();
    assert_eq!(served, 300);
    server.settle_fds(base, "after 300 connects from clients that closed");
}

#[test]
fn concurrent_clients_and_clients_that_exit_without_closing() {
    let _wd = Watchdog::new("concurrent clients", Duration::from_secs(180));
    let mut server = Server::start(false);
    let (base, rss0, _) = server.stats();
    let mut peers: Vec<Peer> = (0..5).map(|_| spawn_clients(&server, 40, "normal", false)).collect();
    let mut vanishers: Vec<Peer> = (0..5).map(|_| spawn_clients(&server, 5, "vanish", false)).collect();
    for p in &mut peers {
        let (fails, worst) = expect_done(p);
        assert_eq!(fails, 0, "a concurrent client's connects failed (worst {worst} µs)");
    }
    for v in &mut vanishers {
        assert_eq!(v.expect("vanishing"), "vanishing");
    }
    drop(peers);
    drop(vanishers);
    let (_, rss1, served) = server.stats();
    assert_eq!(served, 5 * 40 + 5 * 5);
    assert!(rss1 < rss0 + 32 * 1024, "the churn grew the server from {rss0} to {rss1} KiB");
    // Clients that exited with connections open: the server notices, ends them, frees them.
    server.settle_fds(base, "after clients exited without closing");
}

#[test]
fn clients_killed_at_random_points_of_the_handshake_cost_nobody_else() {
    let _wd = Watchdog::new("killed clients", Duration::from_secs(180));
    let mut server = Server::start(false);
    let (base, _, _) = server.stats();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let addr = server.addr;
    let killer = std::thread::spawn(move || {
        let mut kills = 0;
        while !s2.load(Ordering::Relaxed) {
            let mut p = Peer::spawn(
                "child",
                "clients",
                &[("CLAN_SERVER", addr.to_string()), ("CLAN_N", "0".into()), ("CLAN_MODE", "loop".into())],
            );
            // Anywhere from NIC start-up to the middle of its tenth hand-shake.
            std::thread::sleep(Duration::from_micros(rand_u64() % 300_000));
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(p.pid() as i32).unwrap(),
                rustix::process::Signal::KILL,
            );
            p.kill();
            kills += 1;
        }
        kills
    });
    let (fails, worst) = legit_connects(server.addr, 150, 25, false, Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    let kills = killer.join().unwrap();
    eprintln!("{kills} clients killed; worst legitimate connect {worst:?}");
    assert_eq!(fails, 0, "legitimate connects failed while other clients were killed");
    assert!(kills > 0);
    server.settle_fds(base, "after clients were killed mid-hand-shake");
    server.stats(); // the accept loop is still running
}

#[test]
fn a_hostile_local_process_cannot_stall_or_lock_out_others() {
    let _wd = Watchdog::new("hostile local process", Duration::from_secs(240));
    let mut server = Server::start(false);
    let (base, rss0, _) = server.stats();
    // A long-lived legitimate stream, used throughout the attack.
    let nic = Nic::open_default().unwrap();
    let keep = connect_echo(&nic, server.addr).unwrap();
    let mut env = vec![("CLAN_SERVER", server.addr.to_string()), ("CLAN_VICTIM", nic.addr().to_string())];
    if let Ok(a) = std::env::var("CLAN_ATTACKS") {
        env.push(("CLAN_ATTACKS", a));
    }
    let mut hostile = hostile_peer("hostile-local", &env);
    assert_eq!(hostile.expect("attacking"), "attacking");
    let (fails, worst) = legit_connects(server.addr, 60, 10, false, Duration::from_secs(4));
    round_trip(&keep, "the long-lived stream (hellos claimed its NIC, senders forged its endpoints)");
    let (_, rss1, _) = server.stats();
    let report = hostile.finish();
    if std::env::var("CLAN_ATTACKS").is_err() {
        // (CLAN_ATTACKS picks some of the attacks, to study one at a time.)
        check_seen(report, "hostile local process");
    }
    drop(hostile);
    eprintln!("worst legitimate connect under attack {worst:?}; server memory {rss0} → {rss1} KiB");
    assert_eq!(fails, 0, "legitimate connects failed during the attack");
    assert!(rss1 < rss0 + 64 * 1024, "the attack grew the server from {rss0} to {rss1} KiB");
    drop(keep);
    drop(nic);
    server.settle_fds(base, "after the hostile process went");
}

#[test]
fn a_hostile_link_peer_cannot_stall_or_lock_out_others() {
    let _wd = Watchdog::new("hostile link peer", Duration::from_secs(240));
    let mut server = Server::start(true);
    let base = server.fds_after_a_first_link_client();
    let (_, rss0, _) = server.stats();
    let nic = Nic::open(NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }).unwrap();
    let keep = connect_echo(&nic, server.addr).unwrap();
    let env = vec![
        ("CLAN_SERVER", server.addr.to_string()),
        ("CLAN_VICTIM", nic.addr().to_string()),
        ("CLAN_DESC", server.desc.clone()),
    ];
    let mut hostile = hostile_peer("hostile-link", &env);
    assert_eq!(hostile.expect("attacking"), "attacking");
    let (fails, worst) = legit_connects(server.addr, 40, 10, true, Duration::from_secs(4));
    // The long-lived stream (and its link) survived hellos that claimed its NIC's address.
    round_trip(&keep, "the long-lived stream (hellos claimed its NIC's address)");
    let (_, rss1, _) = server.stats();
    check_seen(hostile.finish(), "hostile link peer");
    drop(hostile);
    eprintln!("worst legitimate connect under attack {worst:?}; server memory {rss0} → {rss1} KiB");
    assert_eq!(fails, 0, "legitimate connects over links failed during the attack");
    assert!(rss1 < rss0 + 64 * 1024, "the attack grew the server from {rss0} to {rss1} KiB");
    drop(keep);
    drop(nic);
    // (its queue's leader set may have come after the base: see the test below)
    server.settle_fds(base + LEADER_SET_FDS, "after the hostile link peer went");
}

#[test]
fn clients_over_links_that_come_and_go_leave_nothing_behind() {
    let _wd = Watchdog::new("link churn", Duration::from_secs(180));
    let mut server = Server::start(true);
    let base = server.fds_after_a_first_link_client();
    let mut peers: Vec<Peer> = (0..3).map(|_| spawn_clients(&server, 20, "normal", true)).collect();
    for p in &mut peers {
        assert_eq!(expect_done(p).0, 0);
    }
    drop(peers);
    let mut vanishers: Vec<Peer> = (0..3).map(|_| spawn_clients(&server, 3, "vanish", true)).collect();
    for v in &mut vanishers {
        assert_eq!(v.expect("vanishing"), "vanishing");
    }
    drop(vanishers);
    // The server's queue makes its leader's epoll set and eventfd (two descriptors, kept
    // for good) the first time its thread sleeps driving a link: after the first client
    // only if that client's link was still open when the server slept again, which a loaded
    // machine may not give (seen failing so before and after the leader learnt to sleep in
    // a link's `recv`). Leaks per connection, what this test is for, are many more.
    server.settle_fds(base + LEADER_SET_FDS, "after clients over links came and went");
}

/// The descriptors of a queue leader's set (`clan/src/wake.rs`: an epoll set and an eventfd).
const LEADER_SET_FDS: usize = 2;

/// A hostile child, as the unprivileged user `nobody` when we are root.
fn hostile_peer(role: &str, env: &[(&str, String)]) -> Peer {
    if rustix::process::geteuid().is_root() {
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]);
        cmd.arg(std::env::current_exe().unwrap());
        Peer::spawn_via(cmd, "child", role, env)
    } else {
        Peer::spawn("child", role, env)
    }
}
