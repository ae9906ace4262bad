//! Peers that lie from inside the memory they share with us: a process (an unprivileged uid
//! when run as root) connects streams, RPC clients and queue senders to a server process as
//! anyone may, then writes garbage over every shared mapping it holds (what it imported
//! from the server: the server's rings, control words and event port; and what it exported
//! itself) while it keeps sending, calling and reading. The lies are aimed at live state:
//! words that hold something are replaced by their neighbours, far-off values, all ones,
//! zero or noise.
//!
//! The server must take every lie as the typed error of the one connection that told it
//! (a stream's `InvalidData`, a queue's `Protocol`, an RPC client cut off), never a panic,
//! never an error of its accept or event loops, never a hang: honest clients in another
//! process keep every answer right throughout, and once the liar is gone the server's
//! threads and descriptors come back to where they were.
//!
//! Across a link the liar has no mapping of the server's memory to scribble over: it lies
//! with the public API instead, as a peer on another host would. It connects with a
//! geometry of its own, imports the server's side of each connection (every access then
//! travels as a link frame, checked and applied by the server's engine) and writes garbage
//! into it, and into its own side, which the server reads.
//!
//! Each attack lasts 4 s (`CLAN_LIE_SECS` sets another length, for a soak run by hand).

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, LocalTransport, Nic, NicConfig};
use clan_proto::queue::{MsgSender, QueueConfig, QueueError, QueueListener};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use util::{Peer, Watchdog, hear, say};

/// How long an attack lasts (`CLAN_LIE_SECS`, default 4 s).
fn attack_time() -> Duration {
    Duration::from_secs(std::env::var("CLAN_LIE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(4))
}

/// Bound on any one honest operation: only a hang comes near it.
const HONEST: Duration = Duration::from_secs(20);
/// What an honest queue message's metadata starts with (the liar never sends it).
const HONEST_META: u64 = 0xC1A4_0000_0000_0000;
const HONEST_MASK: u64 = 0xFFFF_0000_0000_0000;

/// The NIC of every process of a test: with `CLAN_LINK` set, processes of this host reach
/// one another through links (as hosts do), not shared memory.
fn nic_config() -> NicConfig {
    let local_transport =
        if std::env::var_os("CLAN_LINK").is_some() { LocalTransport::Link } else { LocalTransport::SharedMemory };
    NicConfig { cache_bytes: 0, local_transport, ..NicConfig::default() }
}

fn stream_cfg() -> StreamConfig {
    StreamConfig { ring: 16 << 10, connect_timeout: Duration::from_secs(5), ..StreamConfig::default() }
}

fn queue_cfg() -> QueueConfig {
    QueueConfig { slots: 16, slot_size: 256, connect_timeout: Duration::from_secs(5), ..QueueConfig::default() }
}

fn rpc_cfg() -> RpcConfig {
    RpcConfig { max_msg: 1024, connect_timeout: Duration::from_secs(5), ..RpcConfig::default() }
}

/// The size of the messages of the posting echo.
const POSTED: usize = 256;

/// The posting echo of one stream: post a buffer for the next [`POSTED`] bytes (the sender
/// redirects them straight into it), take it when complete, send it back.
fn posting_echo(s: &Stream) -> std::io::Result<()> {
    loop {
        s.post_recv(POSTED as u64)?;
        let data = s.recv_posted(|_, d| d.to_vec())?;
        if data.is_empty() {
            return Ok(());
        }
        (&*s).write_all(&data)?;
    }
}

/// Accept on `l` forever, each stream served by `serve` in a thread of its own, its end
/// (`Ok`: the peer closed) given to `ended`.
fn serve_streams(
    l: Listener,
    serve: fn(&Stream) -> std::io::Result<()>,
    ended: impl Fn(std::io::Result<()>) + Send + Sync + Clone + 'static,
) {
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let ended = ended.clone();
            std::thread::spawn(move || ended(serve(&s)));
        }
    });
}

/// The bytes of honest message `i` of length `n`.
fn pattern(i: u64, n: usize) -> Vec<u8> {
    (0..n).map(|k| (k as u64).wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) as u8).collect()
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let mut b = [0u8; 8];
        let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
        Rng(u64::from_le_bytes(b) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

// ---- children ---------------------------------------------------------------------------

#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "server" => server(),
        "liar" => liar(),
        "link-liar" => link_liar(),
        "link-liar-server" => link_liar_server(),
        "liar-server" => liar_server(),
        other => panic!("unknown role {other}"),
    }
}

/// What the server saw.
#[derive(Default)]
struct Seen {
    /// Streams ended by `InvalidData` (a protocol violation of the peer).
    stream_lies: AtomicU64,
    /// Streams ended by another error.
    stream_other: AtomicU64,
    /// Queue receivers ended by `QueueError::Protocol`.
    queue_lies: AtomicU64,
    /// Queue receivers ended by another error.
    queue_other: AtomicU64,
    /// Honest queue messages whose bytes were right, and wrong.
    honest_ok: AtomicU64,
    honest_bad: AtomicU64,
    /// Requests the RPC server answered.
    rpc_served: AtomicU64,
    /// RPC clients it cut off for breaking the protocol.
    rpc_lies: AtomicU64,
    /// The first error of a loop that a user's `?` would have ended (accept loops, the RPC
    /// server's `run_once`).
    fatal: Mutex<Option<String>>,
}

impl Seen {
    fn fatal(&self, what: &str, e: impl std::fmt::Display) {
        let mut f = self.fatal.lock().unwrap();
        if f.is_none() {
            *f = Some(format!("{what}: {e}"));
        }
    }
}

/// The server: a stream echo (a thread per connection), a queue receiver per sender (a
/// thread each, checking honest messages), and one event-driven RPC server echoing requests.
/// Answers `stats` on stdin.
fn server() {
    let nic = Nic::open(nic_config()).unwrap();
    let sl = Listener::bind_with(&nic, None, stream_cfg()).unwrap();
    let ql = QueueListener::bind(&nic, queue_cfg()).unwrap();
    let mut rpc = RpcServer::bind(&nic, rpc_cfg(), 1024).unwrap();
    let pl = Listener::bind_with(&nic, None, stream_cfg()).unwrap();
    let seen = Arc::new(Seen::default());
    let stop = Arc::new(AtomicBool::new(false));
    say(format!("{} {} {} {}", sl.local_addr(), ql.local_addr(), rpc.local_addr(), pl.local_addr()));
    let s2 = seen.clone();
    serve_streams(pl, posting_echo, move |r| match r {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => bump(&s2.stream_lies),
        Err(e) => {
            eprintln!("server: a posting stream ended: {e} ({:?})", e.kind());
            bump(&s2.stream_other);
        }
    });

    let s2 = seen.clone();
    std::thread::spawn(move || {
        for s in sl.incoming() {
            let s = match s {
                Ok(s) => s,
                Err(e) => return s2.fatal("the stream accept loop", e),
            };
            let seen = s2.clone();
            std::thread::spawn(move || {
                let mut b = [0u8; 512];
                loop {
                    let n = match (&s).read(&mut b) {
                        Ok(0) => return,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return bump(&seen.stream_lies),
                        Err(e) => {
                            eprintln!("server: a stream read ended: {e} ({:?})", e.kind());
                            return bump(&seen.stream_other);
                        }
                    };
                    match (&s).write_all(&b[..n]) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return bump(&seen.stream_lies),
                        Err(e) => {
                            eprintln!("server: a stream write ended: {e} ({:?})", e.kind());
                            return bump(&seen.stream_other);
                        }
                    }
                }
            });
        }
    });

    let (s2, st2) = (seen.clone(), stop.clone());
    std::thread::spawn(move || {
        while !st2.load(Ordering::Relaxed) {
            let mut rx = match ql.accept(Some(Duration::from_millis(200))) {
                Ok(rx) => rx,
                Err(QueueError::Timeout) => continue,
                Err(e) => return s2.fatal("the queue accept loop", e),
            };
            let seen = s2.clone();
            std::thread::spawn(move || {
                loop {
                    match rx.recv(None) {
                        Ok(m) if m.meta & HONEST_MASK == HONEST_META => {
                            let i = m.meta & !HONEST_MASK;
                            if m.data == pattern(i, m.data.len()) && m.data.len() == (i % 300) as usize {
                                bump(&seen.honest_ok);
                            } else {
                                bump(&seen.honest_bad);
                            }
                        }
                        Ok(_) => {}
                        Err(QueueError::Disconnected) => return,
                        Err(QueueError::Protocol(_)) => return bump(&seen.queue_lies),
                        Err(e) => {
                            eprintln!("server: a queue receiver ended: {e}");
                            return bump(&seen.queue_other);
                        }
                    }
                }
            });
        }
    });

    let (s2, st2) = (seen.clone(), stop.clone());
    std::thread::spawn(move || {
        while !st2.load(Ordering::Relaxed) {
            let r = rpc.run_once(Some(Duration::from_millis(100)), &mut |_, req, reply| {
                let mut b = vec![0u8; req.len() as usize];
                if req.copy_to(&mut b).is_ok() {
                    let _ = reply.write(&b);
                }
            });
            match r {
                Ok(n) => {
                    s2.rpc_served.fetch_add(n, Ordering::Relaxed);
                    s2.rpc_lies.store(rpc.cut_off_clients(), Ordering::Relaxed);
                }
                Err(e) => return s2.fatal("the RPC server's run_once", e),
            }
        }
    });

    while let Some(line) = hear() {
        if line == "dump" {
            // What is left (for the failure message): threads and descriptors.
            for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
                let p = t.path();
                let r = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default().trim().to_string();
                eprintln!(
                    "server thread {:?}: {} wchan {} syscall {}",
                    t.file_name(),
                    r("comm"),
                    r("wchan"),
                    r("syscall")
                );
            }
            for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
                eprintln!("server fd {:?} -> {:?}", e.file_name(), std::fs::read_link(e.path()).unwrap_or_default());
            }
            if std::env::var_os("CLAN_TEST_GDB").is_some() {
                let _ = std::process::Command::new("gdb")
                    .args(["-p", &std::process::id().to_string(), "-batch", "-ex", "thread apply all bt 25"])
                    .stdout(std::process::Stdio::from(std::io::stderr()))
                    .status();
            }
            say("dumped");
        } else if line == "stats" {
            let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let fatal = seen.fatal.lock().unwrap().clone().unwrap_or_else(|| "none".into());
            say(format!(
                "stats {} {} {} {} {} {} {} {} {} {} {}",
                count("/proc/self/task"),
                count("/proc/self/fd"),
                l(&seen.stream_lies),
                l(&seen.stream_other),
                l(&seen.queue_lies),
                l(&seen.queue_other),
                l(&seen.honest_ok),
                l(&seen.honest_bad),
                l(&seen.rpc_served),
                l(&seen.rpc_lies),
                fatal,
            ));
        }
    }
    stop.store(true, Ordering::Relaxed);
}

/// The shared mappings of this process that it may write: `(start, end, imported, port)`,
/// where `imported` is memory another process exported to us (we hold no descriptor of it:
/// an import keeps only its mapping) and `port` an event port another process gave us.
fn shared_writable() -> Vec<(u64, u64, bool, bool)> {
    use std::os::unix::fs::MetadataExt;
    let own: std::collections::HashSet<u64> = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.flatten().filter_map(|e| std::fs::metadata(e.path()).ok()).map(|m| m.ino()).collect())
        .unwrap_or_default();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines()
        .filter(|l| l.contains("memfd:clan-"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 5 || !f[1].starts_with("rw") {
                return None;
            }
            let (a, b) = f[0].split_once('-')?;
            let ino: u64 = f[4].parse().ok()?;
            let port = l.contains("memfd:clan-port");
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?, !own.contains(&ino), port))
        })
        .collect()
}

/// One round of lies: in every writable shared mapping (most in what the server exported
/// to us), words that hold something are replaced by a neighbour, a far-off value, all
/// ones, zero or noise; and some words anywhere. Written through `/proc/self/mem` (as a
/// debugger would), so that the liar's own code stays safe Rust. Returns the words
/// written.
fn lie(mem: &std::fs::File, rng: &mut Rng, everywhere: bool) -> u64 {
    let mut written = 0;
    for (start, end, imported, port) in shared_writable() {
        if !everywhere && (!imported || port) {
            continue;
        }
        let len = (end - start).min(4 << 20) as usize;
        let mut img = vec![0u8; len];
        if mem.read_exact_at(&mut img, start).is_err() {
            continue;
        }
        let word = |at: usize| u64::from_le_bytes(img[at..at + 8].try_into().unwrap());
        let live: Vec<usize> = (0..len / 8).map(|i| i * 8).filter(|&at| word(at) != 0).collect();
        // Words that look like positions, counters and flags (small numbers), rather than
        // bytes of data: the protocols' state.
        let counters: Vec<usize> = live.iter().copied().filter(|&at| word(at) < 1 << 48).collect();
        for k in 0..if imported { 400 } else { 40 } {
            let pick = |v: &Vec<usize>, rng: &mut Rng| v[rng.below(v.len() as u64) as usize];
            let at = match k % 4 {
                0 | 1 if !counters.is_empty() => pick(&counters, rng),
                0..=2 if !live.is_empty() => pick(&live, rng),
                _ => (rng.below(len as u64) as usize) & !7,
            };
            let v = word(at);
            let new = match rng.below(8) {
                0 => v.wrapping_add(1),
                1 => v.wrapping_sub(1),
                2 => v.wrapping_add(1 << rng.below(64)),
                3 => u64::MAX,
                4 => 0,
                5 => v | 1 << 63,
                6 => v ^ (1 << 32),
                _ => rng.next(),
            };
            if mem.write_all_at(&new.to_le_bytes(), start + at as u64).is_ok() {
                written += 1;
            }
        }
    }
    written
}

/// The liar: connections of every kind to `CLAN_SERVER_ADDRS`, used as the protocols say
/// (errors ignored, connections made again) while another thread lies in shared memory,
/// until stdin closes. Reports the words it wrote and the connections it made.
fn liar() {
    let addrs: Vec<EndpointAddr> =
        std::env::var("CLAN_SERVER_ADDRS").unwrap().split(' ').map(|a| a.parse().unwrap()).collect();
    let (stream_at, queue_at, rpc_at, posting_at) = (addrs[0], addrs[1], addrs[2], addrs[3]);
    // A panic anywhere in this process (the library reads what the server wrote, and what
    // this process scribbled over its own exports, as untrusted) is counted and reported.
    let panics = count_panics();
    let nic = Nic::open_default().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let lies = Arc::new(AtomicU64::new(0));
    let conns = Arc::new(AtomicU64::new(0));
    let mut threads = vec![start_lying(&stop, &lies, true)];
    for kind in 0..4 {
        for _ in 0..3 {
            let (nic, stop, conns) = (nic.clone(), stop.clone(), conns.clone());
            threads.push(std::thread::spawn(move || {
                let mut rng = Rng::new();
                let short = Some(Duration::from_millis(200));
                while !stop.load(Ordering::Relaxed) {
                    match kind {
                        0 => {
                            let Ok(s) = Stream::connect_with(&nic, stream_at, &stream_cfg()) else { continue };
                            bump(&conns);
                            let _ = s.set_read_timeout(short);
                            let _ = s.set_write_timeout(short);
                            for i in 0..200u64 {
                                let out = pattern(rng.next(), 1 + (i % 400) as usize);
                                let mut back = [0u8; 512];
                                if (&s).write_all(&out).is_err() || (&s).read(&mut back).is_err() {
                                    break;
                                }
                            }
                        }
                        1 => {
                            let Ok(mut tx) = MsgSender::connect(&nic, queue_at, &queue_cfg()) else { continue };
                            bump(&conns);
                            for i in 0..500u64 {
                                let data = pattern(rng.next(), (i % 700) as usize);
                                if tx.send_timeout(rng.next() & !HONEST_MASK, &data, short).is_err() {
                                    break;
                                }
                            }
                        }
                        3 => {
                            let Ok(s) = Stream::connect_with(&nic, posting_at, &stream_cfg()) else { continue };
                            bump(&conns);
                            let _ = s.set_read_timeout(short);
                            let _ = s.set_write_timeout(short);
                            let mut back = [0u8; POSTED];
                            for _ in 0..200u64 {
                                let out = pattern(rng.next(), POSTED);
                                if (&s).write_all(&out).is_err() || (&s).read_exact(&mut back).is_err() {
                                    break;
                                }
                            }
                        }
                        _ => {
                            let Ok(mut c) = RpcClient::connect(&nic, rpc_at, &rpc_cfg()) else { continue };
                            bump(&conns);
                            let mut reply = Vec::new();
                            for i in 0..300u64 {
                                let req = pattern(rng.next(), (i % 900) as usize);
                                if c.call(&req, &mut reply, short).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                }
            }));
        }
    }
    say("lying");
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    say(format!(
        "lied {} {} {}",
        lies.load(Ordering::Relaxed),
        conns.load(Ordering::Relaxed),
        panics.load(Ordering::Relaxed)
    ));
}

/// The liar across a link: connections made with the raw API (a geometry of its own in the
/// hand-shake), the server's side of each imported (through the link: every write a frame
/// the server's engine checks and applies) and written with garbage aimed at the words the
/// protocols keep in the first page (positions, counters, flags) and at the rings; its own
/// side (which the server reads through the link) too. A connection is left for a new one
/// once its writes fail or after a few hundred lies.
fn link_liar() {
    let addrs: Vec<EndpointAddr> =
        std::env::var("CLAN_SERVER_ADDRS").unwrap().split(' ').map(|a| a.parse().unwrap()).collect();
    let panics = count_panics();
    let nic = Nic::open(nic_config()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let lies = Arc::new(AtomicU64::new(0));
    let conns = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for (kind, to) in addrs.into_iter().enumerate() {
        for _ in 0..2 {
            let (nic, stop, lies, conns) = (nic.clone(), stop.clone(), lies.clone(), conns.clone());
            threads.push(std::thread::spawn(move || {
                let mut rng = Rng::new();
                while !stop.load(Ordering::Relaxed) {
                    let Ok(ep) = nic.endpoint() else { continue };
                    let Ok(mine) = ep.export(64 << 10) else { continue };
                    let timeout = Some(Duration::from_secs(2));
                    let Ok(conn) = ep.connect_with_data(to, &mine.descriptor(), &raw_geometry(kind), timeout) else {
                        continue;
                    };
                    let Ok(theirs) = ep.import(conn.peer_descriptor()) else { continue };
                    bump(&conns);
                    lie_through(&mine, &theirs, &mut rng, &stop, &lies);
                }
            }));
        }
    }
    say("lying");
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    say(format!(
        "lied {} {} {}",
        lies.load(Ordering::Relaxed),
        conns.load(Ordering::Relaxed),
        panics.load(Ordering::Relaxed)
    ));
}

/// Up to 300 lies, until `stop` or an access fails: garbage words in the peer's side of a
/// connection (`theirs`, through the link), mostly in its first page (positions, counters,
/// flags), and in our own (`mine`), which the peer reads.
fn lie_through(mine: &clan::Aperture, theirs: &clan::Mapping, rng: &mut Rng, stop: &AtomicBool, lies: &AtomicU64) {
    for _ in 0..300 {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let ours = rng.below(3) == 0;
        let len = if ours { mine.len() } else { theirs.len() };
        let span = if rng.below(4) == 0 { len } else { len.min(4096) };
        let off = rng.below(span / 8) * 8;
        let mut cur = [0u8; 8];
        let read = if ours { mine.read(off, &mut cur) } else { theirs.read(off, &mut cur) };
        if read.is_err() {
            return;
        }
        let v = u64::from_le_bytes(cur);
        let lie = match rng.below(7) {
            0 => v.wrapping_add(1 + rng.below(64)),
            1 => v.wrapping_sub(1 + rng.below(64)),
            2 => v.wrapping_add(1 << (20 + rng.below(40))),
            3 => u64::MAX,
            4 => 0,
            5 => v | 1 << 63,
            _ => rng.next(),
        };
        let w = if ours { mine.write(off, &lie.to_le_bytes()) } else { theirs.write(off, &lie.to_le_bytes()) };
        if w.is_err() {
            return;
        }
        bump(lies);
        if rng.below(8) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A side's geometry for the hand-shake's private data, as the protocol of listener `kind`
/// (stream, queue, RPC, posting stream) takes it: `[magic, ring, post area, slot]`.
fn raw_geometry(kind: usize) -> Vec<u8> {
    let (post, slot) = if kind == 1 { (0, 256) } else { (4096, 0) };
    [0xC1A4_51DE_0000_0002u64, 8192, post, slot].iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The lying server across a link: a raw listener per kind of service, which accepts with a
/// geometry of its own, imports its client's side (through the link) and lies in it and in
/// its own side, then drops the connection. Reports as `liar_server`.
fn link_liar_server() {
    let panics = count_panics();
    let nic = Nic::open(nic_config()).unwrap();
    let listeners: Vec<_> = (0..4).map(|_| nic.endpoint().unwrap()).collect();
    for l in &listeners {
        l.listen();
    }
    say(listeners.iter().map(|l| l.addr().to_string()).collect::<Vec<_>>().join(" "));
    let stop = Arc::new(AtomicBool::new(false));
    let lies = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for (kind, l) in listeners.into_iter().enumerate() {
        let (nic, stop, lies) = (nic.clone(), stop.clone(), lies.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(req) = l.accept(Some(Duration::from_millis(100))) else { continue };
                let (nic, stop, lies) = (nic.clone(), stop.clone(), lies.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng::new();
                    let Ok(ep) = nic.endpoint() else { return };
                    let Ok(mine) = ep.export(64 << 10) else { return };
                    let client = req.descriptor().clone();
                    let Ok(_conn) = req.accept_with_data(&ep, &mine.descriptor(), &raw_geometry(kind)) else {
                        return;
                    };
                    let Ok(theirs) = ep.import(&client) else { return };
                    lie_through(&mine, &theirs, &mut rng, &stop, &lies);
                });
            }
        }));
    }
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    say(format!("lied {} 0 {}", lies.load(Ordering::Relaxed), panics.load(Ordering::Relaxed)));
}

/// Count every panic of this process from now on (and print it as usual).
fn count_panics() -> &'static AtomicU64 {
    static PANICS: AtomicU64 = AtomicU64::new(0);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        default(info);
    }));
    &PANICS
}

/// A thread lying in this process's shared memory until `stop`, counting the words: in the
/// apertures it imported, and with `everywhere` also in what it exported itself and in the
/// event ports it was given.
fn start_lying(stop: &Arc<AtomicBool>, lies: &Arc<AtomicU64>, everywhere: bool) -> std::thread::JoinHandle<()> {
    let (stop, lies) = (stop.clone(), lies.clone());
    std::thread::spawn(move || {
        let mem = std::fs::OpenOptions::new().read(true).write(true).open("/proc/self/mem").unwrap();
        let mut rng = Rng::new();
        while !stop.load(Ordering::Relaxed) {
            lies.fetch_add(lie(&mem, &mut rng, everywhere), Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(2));
        }
    })
}

/// A lying server: a stream echo, queue receivers and an RPC echo, as `server` has, while
/// another thread lies in every shared mapping, until stdin closes. Reports the words it
/// wrote and its panics.
fn liar_server() {
    let panics = count_panics();
    let nic = Nic::open(NicConfig { cache_bytes: 0, ..NicConfig::default() }).unwrap();
    let sl = Listener::bind_with(&nic, None, stream_cfg()).unwrap();
    let ql = QueueListener::bind(&nic, queue_cfg()).unwrap();
    let mut rpc = RpcServer::bind(&nic, rpc_cfg(), 1024).unwrap();
    let pl = Listener::bind_with(&nic, None, stream_cfg()).unwrap();
    say(format!("{} {} {} {}", sl.local_addr(), ql.local_addr(), rpc.local_addr(), pl.local_addr()));
    serve_streams(
        pl,
        |s| {
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
            s.set_write_timeout(Some(Duration::from_millis(200)))?;
            posting_echo(s)
        },
        |_| {},
    );
    let stop = Arc::new(AtomicBool::new(false));
    let lies = Arc::new(AtomicU64::new(0));
    // (only in what its clients exported: its own listeners and its ports in their queues
    // stay sound, so that clients keep connecting and meet the lies; the other test lies
    // everywhere)
    let liar = start_lying(&stop, &lies, false);
    let short = Some(Duration::from_millis(200));
    std::thread::spawn(move || {
        for s in sl.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(short);
                let _ = s.set_write_timeout(short);
                let mut b = [0u8; 512];
                while let Ok(n @ 1..) = (&s).read(&mut b) {
                    if (&s).write_all(&b[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    let st = stop.clone();
    std::thread::spawn(move || {
        while !st.load(Ordering::Relaxed) {
            if let Ok(mut rx) = ql.accept(short) {
                std::thread::spawn(move || while matches!(rx.recv(short), Ok(_) | Err(QueueError::Timeout)) {});
            }
        }
    });
    let st = stop.clone();
    std::thread::spawn(move || {
        while !st.load(Ordering::Relaxed) {
            let _ = rpc.run_once(short, &mut |_, req, reply| {
                let mut b = vec![0u8; req.len() as usize];
                if req.copy_to(&mut b).is_ok() {
                    let _ = reply.write(&b);
                }
            });
        }
    });
    while hear().is_some() {}
    stop.store(true, Ordering::Relaxed);
    let _ = liar.join();
    say(format!("lied {} 0 {}", lies.load(Ordering::Relaxed), panics.load(Ordering::Relaxed)));
}

// ---- the parent's side ------------------------------------------------------------------

/// The server's `stats`: threads, descriptors, then (stream lies, other stream errors,
/// queue lies, other queue errors, honest messages right, wrong, RPC requests served, RPC
/// clients cut off), and the first fatal error ("none").
struct Stats {
    threads: usize,
    fds: usize,
    v: [u64; 8],
    fatal: String,
}

fn stats(server: &mut Peer) -> Stats {
    server.send("stats");
    let l = server.expect("stats");
    let mut it = l.strip_prefix("stats ").unwrap_or_else(|| panic!("not stats: {l}")).splitn(11, ' ');
    let mut n = || it.next().unwrap().parse::<u64>().unwrap();
    let (threads, fds) = (n() as usize, n() as usize);
    let v = [n(), n(), n(), n(), n(), n(), n(), n()];
    Stats { threads, fds, v, fatal: it.next().unwrap().to_string() }
}

fn liar_peer(role: &str, env: &[(&str, String)]) -> Peer {
    match util::unprivileged() {
        Some(cmd) => Peer::spawn_via(cmd, "child", role, env),
        None => Peer::spawn("child", role, env),
    }
}

/// Honest traffic of every kind, from this process, for `time`: every answer must be right.
/// Returns the honest queue messages sent, or what went wrong.
fn honest(addrs: &[EndpointAddr], time: Duration, nic: &Nic, sent: &mut u64) -> Result<(), String> {
    let (stream_at, queue_at, rpc_at, posting_at) = (addrs[0], addrs[1], addrs[2], addrs[3]);
    let start = Instant::now();
    let mut round = 0u64;
    let e = |what: &'static str| move |e: &dyn std::fmt::Display| format!("{what}: {e}");
    while start.elapsed() < time || round < 3 {
        // Fresh connections each round (connects must keep working under the attack).
        let s = Stream::connect_with(nic, stream_at, &stream_cfg()).map_err(|x| e("a stream connect")(&x))?;
        s.set_read_timeout(Some(HONEST)).unwrap();
        let mut tx = MsgSender::connect(nic, queue_at, &queue_cfg()).map_err(|x| e("a queue connect")(&x))?;
        let mut c = RpcClient::connect(nic, rpc_at, &rpc_cfg()).map_err(|x| e("an RPC connect")(&x))?;
        let p = Stream::connect_with(nic, posting_at, &stream_cfg()).map_err(|x| e("a posting stream connect")(&x))?;
        p.set_read_timeout(Some(HONEST)).unwrap();
        let mut reply = Vec::new();
        for i in 0..100u64 {
            let k = round * 100 + i;
            let out = pattern(k, 1 + (k % 500) as usize);
            (&s).write_all(&out).map_err(|x| e("a stream write")(&x))?;
            let mut back = vec![0u8; out.len()];
            (&s).read_exact(&mut back).map_err(|x| e("a stream echo")(&x))?;
            if back != out {
                return Err("a stream's echo was changed".into());
            }
            let data = pattern(*sent, (*sent % 300) as usize);
            tx.send_timeout(HONEST_META | *sent, &data, Some(HONEST)).map_err(|x| e("a queue send")(&x))?;
            *sent += 1;
            let req = pattern(k ^ 0x55, (k % 1000) as usize);
            c.call(&req, &mut reply, Some(HONEST)).map_err(|x| e("an RPC call")(&x))?;
            if reply != req {
                return Err("an RPC reply was changed".into());
            }
            let out = pattern(k ^ 0xAA, POSTED);
            (&p).write_all(&out).map_err(|x| e("a posting stream write")(&x))?;
            let mut back = vec![0u8; POSTED];
            (&p).read_exact(&mut back).map_err(|x| e("a posting stream echo")(&x))?;
            if back != out {
                return Err("a posting stream's echo was changed".into());
            }
        }
        round += 1;
    }
    eprintln!("{round} honest rounds, {sent} queue messages");
    Ok(())
}

#[test]
fn peers_that_lie_in_shared_memory_are_cut_off_alone() {
    lying_peers_are_cut_off_alone(false);
}

#[test]
fn peers_that_lie_across_a_link_are_cut_off_alone() {
    lying_peers_are_cut_off_alone(true);
}

/// The server, the honest clients (this process) and the liar, within the host (the liar
/// scribbling over its mappings) or across links (the liar writing through the API).
fn lying_peers_are_cut_off_alone(link: bool) {
    let _wd = Watchdog::new("lying peers", Duration::from_secs(240) + attack_time());
    let env: Vec<(&str, String)> = if link { vec![("CLAN_LINK", "1".into())] } else { vec![] };
    let mut server = Peer::spawn("child", "server", &env);
    let line = server.expect("addresses");
    let addrs: Vec<EndpointAddr> = line.split(' ').map(|a| a.parse().unwrap()).collect();
    let nic = Nic::open(NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    })
    .unwrap();
    // One honest round first: every service works, and what the server holds then (with
    // the honest connections closed again) is the baseline.
    let mut sent = 0;
    honest(&addrs, Duration::ZERO, &nic, &mut sent).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = stats(&mut server);
    assert_eq!(before.fatal, "none");

    let mut liar_env = env.clone();
    liar_env.push(("CLAN_SERVER_ADDRS", line.clone()));
    let mut liar = liar_peer(if link { "link-liar" } else { "liar" }, &liar_env);
    assert_eq!(liar.expect("lying"), "lying");
    // Honest traffic for 4 s, and on (up to 60 s: a loaded machine lies slowly) until the
    // server has noticed a lie.
    let start = Instant::now();
    let mut first = true;
    loop {
        let time = if first { attack_time() } else { Duration::ZERO };
        first = false;
        if let Err(e) = honest(&addrs, time, &nic, &mut sent) {
            let s = stats(&mut server);
            panic!(
                "honest traffic failed under the attack: {e} (the server: fatal {}, streams cut for lies {}, \
                 queues cut for lies {}, RPC requests served {})",
                s.fatal, s.v[0], s.v[2], s.v[6]
            );
        }
        let s = stats(&mut server);
        if s.v[0] + s.v[2] + s.v[7] > 0 || start.elapsed() > attack_time() + Duration::from_secs(60) {
            break;
        }
    }
    let report = liar.finish().unwrap_or_default();
    let lied = report.strip_prefix("lied ").unwrap_or_else(|| panic!("the liar did not report ({report})"));
    let lied: Vec<u64> = lied.split(' ').map(|x| x.parse().unwrap()).collect();
    eprintln!("the liar wrote {} words, made {} connections", lied[0], lied[1]);
    assert_eq!(lied[2], 0, "the liar's own library panicked on what it read (see its output above)");
    drop(liar);

    // The server noticed lies, on the liar's connections only, and its loops never failed.
    let t = Instant::now();
    let after = loop {
        let s = stats(&mut server);
        // Every honest message was taken (its receiver thread may still be at it).
        if s.v[4] + s.v[5] >= sent || t.elapsed() > HONEST {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!(
        "server: streams cut for lies {} (other errors {}), queues cut for lies {} (other {}), honest \
         messages right {} wrong {}, RPC requests served {}, RPC clients cut off {}",
        after.v[0], after.v[1], after.v[2], after.v[3], after.v[4], after.v[5], after.v[6], after.v[7]
    );
    assert_eq!(after.fatal, "none", "a lying peer made one of the server's loops fail");
    assert_eq!(after.v[5], 0, "honest queue messages arrived changed");
    assert_eq!(after.v[4], sent, "honest queue messages were lost");
    assert!(after.v[0] + after.v[2] + after.v[7] > 0, "the server never noticed a lie: the attack did not reach it");

    // Once the liar is gone, every thread and descriptor it cost the server is given back:
    // no thread of the server is stuck on what the liar left behind.
    let t = Instant::now();
    loop {
        let s = stats(&mut server);
        if s.threads <= before.threads && s.fds <= before.fds {
            break;
        }
        if t.elapsed() >= Duration::from_secs(30) {
            server.send("dump");
            server.expect("dumped");
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "after the liar went the server holds {} threads and {} descriptors ({} and {} before; \
             CLAN_TEST_GDB=1 prints the stacks of its threads)",
            s.threads,
            s.fds,
            before.threads,
            before.fds
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(stats(&mut server).fatal, "none");
}

/// What honest clients of a lying server saw.
#[derive(Default, Debug)]
struct Outcomes {
    ok: u64,
    /// Errors that name a protocol violation (`InvalidData`, `Protocol`).
    lies: u64,
    /// Other errors (time-outs, the server cutting us off).
    other: u64,
    /// The longest single operation.
    longest: Duration,
    /// Errors seen, by their text (the first few of each).
    seen: std::collections::BTreeMap<String, u64>,
}

impl Outcomes {
    fn note<T, E: std::fmt::Display>(&mut self, t: Instant, r: Result<T, E>, lie: impl Fn(&E) -> bool) -> bool {
        self.longest = self.longest.max(t.elapsed());
        match r {
            Ok(_) => {
                self.ok += 1;
                true
            }
            Err(e) => {
                let text: String = e.to_string().chars().filter(|c| !c.is_ascii_digit()).collect();
                *self.seen.entry(text).or_default() += 1;
                if lie(&e) {
                    self.lies += 1
                } else {
                    self.other += 1
                }
                false
            }
        }
    }
}

#[test]
fn clients_of_a_lying_server_get_errors_not_hangs() {
    clients_of_a_lying_server(false);
}

#[test]
fn clients_of_a_server_lying_across_a_link_get_errors_not_hangs() {
    clients_of_a_lying_server(true);
}

fn clients_of_a_lying_server(link: bool) {
    let _wd = Watchdog::new("clients of a lying server", Duration::from_secs(240) + attack_time());
    let panics = count_panics();
    let env: Vec<(&str, String)> = if link { vec![("CLAN_LINK", "1".into())] } else { vec![] };
    let nic = Nic::open(NicConfig {
        cache_bytes: 0,
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    })
    .unwrap();
    let role = if link { "link-liar-server" } else { "liar-server" };
    let mut server = match util::unprivileged() {
        Some(cmd) => Peer::spawn_via(cmd, "child", role, &env),
        None => Peer::spawn("child", role, &env),
    };
    let line = server.expect("addresses");
    let addrs: Vec<EndpointAddr> = line.split(' ').map(|a| a.parse().unwrap()).collect();
    let (threads0, fds0) = (count("/proc/self/task"), count("/proc/self/fd"));
    let limit = Duration::from_secs(2);
    let mut out = Outcomes::default();
    let invalid = |e: &std::io::Error| e.kind() == std::io::ErrorKind::InvalidData;
    let start = Instant::now();
    let mut k = 0u64;
    // 4 s, and on (up to 60 s: a loaded machine lies slowly) until a client noticed a lie.
    while start.elapsed() < attack_time() || out.lies == 0 && start.elapsed() < Duration::from_secs(60) {
        let t = Instant::now();
        if let Some(s) = Stream::connect_with(&nic, addrs[0], &stream_cfg())
            .ok()
            .filter(|_| out.note(t, Ok::<_, std::io::Error>(()), invalid))
        {
            s.set_read_timeout(Some(limit)).unwrap();
            s.set_write_timeout(Some(limit)).unwrap();
            for _ in 0..50 {
                k += 1;
                let msg = pattern(k, 1 + (k % 400) as usize);
                let mut back = vec![0u8; msg.len()];
                let t = Instant::now();
                let r = (&s).write_all(&msg).and_then(|()| (&s).read_exact(&mut back));
                if !out.note(t, r, invalid) {
                    break;
                }
            }
        }
        let t = Instant::now();
        let p = Stream::connect_with(&nic, addrs[3], &stream_cfg());
        if let Ok(p) = p {
            p.set_read_timeout(Some(limit)).unwrap();
            p.set_write_timeout(Some(limit)).unwrap();
            for _ in 0..50 {
                k += 1;
                let msg = pattern(k, POSTED);
                let mut back = vec![0u8; POSTED];
                let t = Instant::now();
                let r = (&p).write_all(&msg).and_then(|()| (&p).read_exact(&mut back));
                if !out.note(t, r, invalid) {
                    break;
                }
            }
        } else if let Err(e) = p {
            out.note(t, Err::<(), _>(format!("a posting stream connect: {e}")), |_| false);
        }
        let t = Instant::now();
        let tx = MsgSender::connect(&nic, addrs[1], &queue_cfg());
        if let Ok(mut tx) = tx {
            for _ in 0..100 {
                k += 1;
                let t = Instant::now();
                let r = tx.send_timeout(k, &pattern(k, (k % 600) as usize), Some(limit));
                if !out.note(t, r, |e| matches!(e, QueueError::Protocol(_))) {
                    break;
                }
            }
        } else if let Err(e) = tx {
            out.note(t, Err::<(), _>(format!("a queue connect: {e}")), |_| false);
        }
        let t = Instant::now();
        let c = RpcClient::connect(&nic, addrs[2], &rpc_cfg());
        if let Ok(mut c) = c {
            let mut reply = Vec::new();
            for _ in 0..50 {
                k += 1;
                let t = Instant::now();
                let r = c.call(&pattern(k, (k % 900) as usize), &mut reply, Some(limit));
                if !out.note(t, r, |e| matches!(e, clan_proto::rpc::RpcError::Protocol(_))) {
                    break;
                }
            }
        } else if let Err(e) = c {
            out.note(t, Err::<(), _>(format!("an RPC connect: {e}")), |_| false);
        }
    }
    eprintln!("honest clients of a lying server: {out:?}");
    let report = server.finish().unwrap_or_default();
    let lied: Vec<u64> = report
        .strip_prefix("lied ")
        .unwrap_or_else(|| panic!("the lying server did not report ({report})"))
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    eprintln!("the lying server wrote {} words", lied[0]);
    drop(server);
    assert_eq!(lied[2], 0, "the lying server's own library panicked (see its output above)");
    assert_eq!(panics.load(Ordering::Relaxed), 0, "the library panicked on what a lying server wrote");
    // A bound no time-out comes near (each is 2 s; connects 5 s): only a hang does.
    assert!(out.longest < Duration::from_secs(20), "an operation took {:?}", out.longest);
    assert!(out.ok > 0, "nothing worked, even before the lies");
    assert!(out.lies > 0, "no client noticed a lie: the attack did not reach them");
    // Our NIC still serves everyone else: an honest server, every kind of connection.
    let mut honest_server = Peer::spawn("child", "server", &env);
    let addrs: Vec<EndpointAddr> = honest_server.expect("addresses").split(' ').map(|a| a.parse().unwrap()).collect();
    honest(&addrs, Duration::ZERO, &nic, &mut 0).expect("our NIC, after the lying server, with an honest one");
    drop(honest_server);
    // The servers are gone: what our NIC held of their connections is given back.
    let t = Instant::now();
    while count("/proc/self/task") > threads0 || count("/proc/self/fd") > fds0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "after the lying server went we hold {} threads and {} descriptors ({threads0} and {fds0} before)",
            count("/proc/self/task"),
            count("/proc/self/fd")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
