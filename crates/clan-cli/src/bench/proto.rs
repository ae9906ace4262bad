//! Benchmarks of the protocols built on clan (`clan-proto`), each against its same-run
//! baseline:
//!
//! - `clan bench queue`: streaming bandwidth of the distributed queue (its unstructured
//!   variant, a stream with a small ring) by transfer size, copying into and out of the queue
//!   as the CLAN page measures it; the size at which half of the peak is reached; the buffer
//!   per endpoint. Baseline: `memcpy` (shm) or a raw TCP stream (tcp); on shm also a
//!   hand-written ring between the same two processes (`ring`: the same copies in and out
//!   through a buffer of the same size, with no tripwires, locks or checks), the ceiling
//!   this machine puts on any queue between two CPUs.
//! - `clan bench rpc`: RPC round-trip time and calls per second (one call in flight) against
//!   the same request/response over a Unix socket.
//! - `clan bench stream`: stream-socket round-trip time and bandwidth against Unix sockets and
//!   kernel TCP (loopback).
//!
//! Every measurement runs between two processes pinned to different CPUs.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use clan::{EndpointAddr, LocalTransport, Nic, NicConfig};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use serde::Serialize;

use super::latency::Transport;
use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, arg};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);

fn mbit(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64().max(1e-9) / 1e6
}

fn peer_nic(args: &[String]) -> Result<Nic> {
    let ip: IpAddr = arg(args, "ip")?;
    let link: bool = arg(args, "link")?;
    Ok(Nic::open(NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::at(ip, 0)
    })?)
}

// ---- queue ---------------------------------------------------------------------------------

/// Arguments of `clan bench queue`.
#[derive(clap::Args, Debug, Clone)]
pub struct QueueArgs {
    /// Where the peers are.
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    pub transport: Transport,
    /// Transfer size in bytes (default: a sweep from 64 bytes to 32 KiB).
    #[arg(long)]
    pub size: Option<usize>,
    /// Alternating rounds per size (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Bytes of receive buffer per endpoint (the queue's ring). Default: 16 KiB on shm (the
    /// CLAN page's point: a small buffer suffices at memory latencies), 1 MiB over tcp (a
    /// link's round trip needs a window).
    #[arg(long)]
    pub buffer: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Debug)]
pub struct QueuePoint {
    pub size: usize,
    pub mbit_s: f64,
    pub baseline_mbit_s: f64,
    pub ratio: f64,
    /// The hand-written ring (shm only).
    pub ring_mbit_s: Option<f64>,
    pub ring_ratio: Option<f64>,
}

#[derive(Serialize, Debug)]
pub struct QueueReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub size: Option<usize>,
    pub buffer_bytes: u64,
    pub mbit_s: f64,
    pub baseline: &'static str,
    pub baseline_mbit_s: f64,
    pub ratio: f64,
    pub ring_mbit_s: Option<f64>,
    pub ring_ratio: Option<f64>,
    pub points: Vec<QueuePoint>,
    pub peak_mbit_s: f64,
    pub half_peak_size: Option<usize>,
    pub placement: String,
    pub machine: sys::Machine,
}

fn queue_bytes(size: usize, tcp: bool) -> u64 {
    let cap: u64 = if tcp { 256 << 20 } else { 512 << 20 };
    (size as u64 * (1 << 20)).clamp(16 << 20, cap) / size as u64 * size as u64
}

pub fn queue(a: &QueueArgs) -> Result<()> {
    let tcp = a.transport == Transport::Tcp;
    let buffer = a.buffer.unwrap_or(if tcp { 1 << 20 } else { 16 << 10 });
    let hosts = tcp.then(super::tcp::Hosts::new);
    let sizes: Vec<usize> = match a.size {
        Some(s) if s > 0 => vec![s],
        Some(_) => return Err("--size must be positive".into()),
        None => vec![64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
    };
    let mut points = Vec::new();
    for &size in &sizes {
        // Alternating rounds, the median of each side: two processes streaming at each other
        // swing between rounds on this machine (where the host runs the two virtual CPUs),
        // and one round could catch either regime.
        let bytes = queue_bytes(size, tcp) / 2;
        let (mut o, mut b, mut g) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.rounds.max(1) {
            o.push(queue_round(hosts.as_ref(), size, bytes, buffer, false)?);
            match &hosts {
                Some(h) => b.push(queue_round(Some(h), size, bytes, buffer, true)?),
                None => {
                    b.push(memcpy_transfers(size, bytes, buffer));
                    g.push(ring_round(size, bytes, buffer)?);
                }
            }
        }
        let median = |v: &mut Vec<Duration>| {
            v.sort();
            v.get(v.len() / 2).copied()
        };
        let (ours, base) = (median(&mut o).ok_or("no rounds")?, median(&mut b).ok_or("no rounds")?);
        let ring = median(&mut g).map(|d| mbit(bytes, d));
        points.push(QueuePoint {
            size,
            mbit_s: mbit(bytes, ours),
            baseline_mbit_s: mbit(bytes, base),
            ratio: ratio(mbit(bytes, ours), mbit(bytes, base)),
            ring_mbit_s: ring,
            ring_ratio: ring.map(|r| ratio(mbit(bytes, ours), r)),
        });
        if !a.json {
            let p = points.last().expect("pushed");
            eprintln!(
                "{:>6} bytes: {:>10.0} Mbit/s (baseline {:>10.0}{})",
                size,
                p.mbit_s,
                p.baseline_mbit_s,
                p.ring_mbit_s.map_or(String::new(), |r| format!(", ring {r:.0}"))
            );
        }
    }
    let peak = points.iter().map(|p| p.mbit_s).fold(0.0, f64::max);
    let half = points.iter().find(|p| p.mbit_s >= peak / 2.0).map(|p| p.size);
    let last = points.last().ok_or("no sizes")?;
    let r = QueueReport {
        bench: "queue",
        transport: if tcp { "tcp" } else { "shm" },
        size: a.size,
        buffer_bytes: buffer,
        mbit_s: last.mbit_s,
        baseline: if tcp { "tcp-stream" } else { "memcpy" },
        baseline_mbit_s: last.baseline_mbit_s,
        ratio: last.ratio,
        ring_mbit_s: last.ring_mbit_s,
        ring_ratio: last.ring_ratio,
        points,
        peak_mbit_s: peak,
        half_peak_size: half,
        placement: format!(
            "{}; sender process on CPU 0, receiver on CPU 1; each transfer is copied into the queue by the \
             sender and out of it by the receiver",
            hosts.as_ref().map_or("two processes of this host".into(), super::tcp::Hosts::describe)
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench queue: transport {}, {} bytes of buffer per endpoint     [CLAN: 880 Mbit/s at 32 KB, half at 128 B, 10 KB per endpoint]",
            r.transport, r.buffer_bytes
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        let ring = r.ring_mbit_s.is_some();
        if ring {
            println!(
                "ring: the same copies through a hand-written ring of the same size between the same two CPUs \
                 (no tripwires, locks or checks)"
            );
            println!(
                "{:>8}  {:>12}  {:>12}  {:>6}  {:>12}  {:>6}",
                "size", "Mbit/s", r.baseline, "ratio", "ring", "ratio"
            );
        } else {
            println!("{:>8}  {:>12}  {:>12}  {:>6}", "size", "Mbit/s", r.baseline, "ratio");
        }
        for p in &r.points {
            match (p.ring_mbit_s, p.ring_ratio) {
                (Some(g), Some(gr)) => println!(
                    "{:>8}  {:>12.0}  {:>12.0}  {:>6.2}  {:>12.0}  {:>6.2}",
                    p.size, p.mbit_s, p.baseline_mbit_s, p.ratio, g, gr
                ),
                _ => println!("{:>8}  {:>12.0}  {:>12.0}  {:>6.2}", p.size, p.mbit_s, p.baseline_mbit_s, p.ratio),
            }
        }
        println!(
            "peak {:.0} Mbit/s; half of it reached at {}",
            r.peak_mbit_s,
            r.half_peak_size.map_or("no measured size".into(), |s| format!("{s}-byte transfers"))
        );
    });
    Ok(())
}

/// One run: the receiver peer reads `bytes` in `size` pieces, the sender peer writes them.
/// Returns the sender's time from its first write to the receiver's acknowledgement.
fn queue_round(h: Option<&super::tcp::Hosts>, size: usize, bytes: u64, buffer: u64, raw_tcp: bool) -> Result<Duration> {
    let common = [
        format!("size={size}"),
        format!("bytes={bytes}"),
        format!("buffer={buffer}"),
        format!("link={}", h.is_some()),
        format!("raw={raw_tcp}"),
    ];
    let spawn = |i: usize, role: &str| -> Result<PeerProc> {
        match h {
            Some(h) => h.spawn(i, role, &common),
            None => {
                let mut a = common.to_vec();
                a.push("ip=127.0.0.1".into());
                a.push(format!("cpu={i}"));
                PeerProc::spawn(role, &a)
            }
        }
    };
    let mut rx = spawn(1, "pq-recv")?;
    let addr = rx.recv()?;
    let mut tx = spawn(0, "pq-send")?;
    tx.send(addr)?;
    let line = tx.recv()?;
    let verdict = rx.recv()?;
    if verdict != "ok" {
        return Err(format!("the receiver found bad data: {verdict}").into());
    }
    tx.finish()?;
    rx.finish()?;
    Ok(Duration::from_secs_f64(line.strip_prefix("secs ").ok_or("bad result")?.parse()?))
}

/// The same transfers by `memcpy`: into a ring of `buffer` bytes and out again.
fn memcpy_transfers(size: usize, bytes: u64, buffer: u64) -> Duration {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    let mut ring = vec![0u8; (buffer as usize).max(size)];
    let n = bytes / size as u64;
    let start = Instant::now();
    let mut at = 0usize;
    for _ in 0..n {
        // Into the ring and out of it, as the queue does (on two CPUs, though).
        let k = size.min(ring.len() - at);
        ring[at..at + k].copy_from_slice(std::hint::black_box(&src[..k]));
        ring[..size - k].copy_from_slice(&src[k..]);
        dst[..k].copy_from_slice(&ring[at..at + k]);
        dst[k..].copy_from_slice(&ring[..size - k]);
        std::hint::black_box(&mut dst);
        at = (at + size) % ring.len();
    }
    start.elapsed()
}

// The hand-written ring: a memfd both peers map. Words (each on its own line): the bytes
// written, the bytes read, the receiver's warm-up acknowledgement; the ring from one page on.
const RING_W: usize = 0;
const RING_R: usize = 64;
const RING_ACK: usize = 128;

/// The same transfers through a hand-written ring of `buffer` bytes between two pinned peer
/// processes, copied in and out in the same pieces as the queue (at most half the ring per
/// publication, the read position mirrored every quarter). Sender's time, as `queue_round`.
fn ring_round(size: usize, bytes: u64, buffer: u64) -> Result<Duration> {
    let page = clan_shm::segment::page_size();
    let len = page + clan_shm::segment::page_align(buffer as usize);
    let memfd = clan_shm::memfd::Memfd::create("clan-bench-ring", len as u64)?;
    let path = format!("/proc/{}/fd/{}", std::process::id(), {
        use std::os::fd::{AsFd, AsRawFd};
        memfd.as_fd().as_raw_fd()
    });
    let common = [format!("size={size}"), format!("bytes={bytes}"), format!("buffer={buffer}"), format!("path={path}")];
    let spawn = |cpu: usize, role: &str| -> Result<PeerProc> {
        let mut a = common.to_vec();
        a.push(format!("cpu={cpu}"));
        PeerProc::spawn(role, &a)
    };
    let mut rx = spawn(1, "pq-ring-recv")?;
    if rx.recv()? != "ready" {
        return Err("ring receiver not ready".into());
    }
    let mut tx = spawn(0, "pq-ring-send")?;
    let line = tx.recv()?;
    let verdict = rx.recv()?;
    if verdict != "ok" {
        return Err(format!("the ring receiver found bad data: {verdict}").into());
    }
    tx.finish()?;
    rx.finish()?;
    drop(memfd);
    Ok(Duration::from_secs_f64(line.strip_prefix("secs ").ok_or("bad result")?.parse()?))
}

/// Spin until `cond` holds, at most [`LIMIT`].
fn spin_on(mut cond: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    let mut n = 0u32;
    while !cond() {
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n % 4096 == 0 && start.elapsed() > LIMIT {
            return Err("the other side of the ring stopped".into());
        }
    }
    Ok(())
}

/// Peer roles of the hand-written ring.
fn ring_peer(role: &str, args: &[String]) -> Result<()> {
    use clan_shm::segment::{Access, Segment};
    use std::sync::atomic::{AtomicU64, Ordering};
    let size: usize = arg(args, "size")?;
    let bytes: u64 = arg(args, "bytes")?;
    let cap: u64 = arg(args, "buffer")?;
    let path: String = arg(args, "path")?;
    sys::pin(arg(args, "cpu")?);
    let page = clan_shm::segment::page_size();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let seg = Segment::map(&f, 0, page + clan_shm::segment::page_align(cap as usize), Access::ReadWrite)?;
    let (w_at, r_at, ack) =
        (seg.view::<AtomicU64>(RING_W)?, seg.view::<AtomicU64>(RING_R)?, seg.view::<AtomicU64>(RING_ACK)?);
    let n = bytes / size as u64;
    let warm = ((4 << 20) / size as u64).max(16);
    let chunk = (cap / 2).max(1);
    let want = pattern(size);
    match role {
        "pq-ring-recv" => {
            Link::say("ready");
            let mut buf = vec![0u8; size];
            let (mut r, mut published, mut seen) = (0u64, 0u64, 0u64);
            let mut ok = true;
            for i in 0..warm + n {
                let mut off = 0usize;
                while off < size {
                    if seen == r {
                        // Pairs with the sender's Release store of the written position.
                        spin_on(|| {
                            seen = w_at.load(Ordering::Acquire);
                            seen > r
                        })?;
                    }
                    let at = r % cap;
                    let k = (seen - r).min((size - off) as u64).min(cap - at) as usize;
                    seg.read(page + at as usize, &mut buf[off..off + k])?;
                    off += k;
                    r += k as u64;
                    if r - published >= cap / 4 {
                        published = r;
                        // Pairs with the sender's Acquire load of the read position.
                        r_at.store(r, Ordering::Release);
                    }
                }
                if i == warm - 1 {
                    ack.store(1, Ordering::Release);
                }
                if i == 0 || i == warm + n - 1 {
                    ok &= buf == want;
                }
            }
            ack.store(2, Ordering::Release);
            Link::say(if ok { "ok" } else { "data differs" });
        }
        "pq-ring-send" => {
            let (mut w, mut read_seen) = (0u64, 0u64);
            let mut send = |w: &mut u64| -> Result<()> {
                let mut off = 0usize;
                while off < size {
                    let want_room = ((size - off) as u64).min(chunk);
                    if (cap - 1) - (*w - read_seen) < want_room {
                        // Pairs with the receiver's Release store of its position.
                        read_seen = r_at.load(Ordering::Acquire);
                        if (cap - 1) - (*w - read_seen) == 0 {
                            spin_on(|| {
                                read_seen = r_at.load(Ordering::Acquire);
                                (cap - 1) - (*w - read_seen) > 0
                            })?;
                        }
                    }
                    let room = (cap - 1) - (*w - read_seen);
                    let at = *w % cap;
                    let k = ((size - off) as u64).min(room).min(cap - at).min(chunk) as usize;
                    seg.write(page + at as usize, &want[off..off + k])?;
                    off += k;
                    *w += k as u64;
                    // Pairs with the receiver's Acquire load: the bytes above are visible.
                    w_at.store(*w, Ordering::Release);
                }
                Ok(())
            };
            for _ in 0..warm {
                send(&mut w)?;
            }
            spin_on(|| ack.load(Ordering::Acquire) >= 1)?;
            let start = Instant::now();
            for _ in 0..n {
                send(&mut w)?;
            }
            spin_on(|| ack.load(Ordering::Acquire) == 2)?;
            Link::say(format!("secs {}", start.elapsed().as_secs_f64()));
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

/// Peer roles of the queue benchmark: the same transfers over a clan stream with a small
/// ring, or (`raw`) over a raw TCP connection.
pub fn queue_peer(role: &str, args: &[String]) -> Result<()> {
    if role.starts_with("pq-ring-") {
        return ring_peer(role, args);
    }
    let size: usize = arg(args, "size")?;
    let bytes: u64 = arg(args, "bytes")?;
    let buffer: u64 = arg(args, "buffer")?;
    let raw: bool = arg(args, "raw")?;
    sys::pin(arg(args, "cpu")?);
    let want = pattern(size);
    let n = bytes / size as u64;
    let warm = ((4 << 20) / size as u64).max(16);
    let cfg = StreamConfig { ring: buffer, post_area: 0, ..StreamConfig::default() };
    match role {
        "pq-recv" => {
            let mut s = if raw {
                let ip: IpAddr = arg(args, "ip")?;
                let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
                Link::say(l.local_addr()?);
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Tcp(s)
            } else {
                let nic = peer_nic(args)?;
                let l = Listener::bind_with(&nic, None, cfg)?;
                Link::say(l.local_addr());
                let (s, _) = l.accept()?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Clan(s)
            };
            let mut buf = vec![0u8; size];
            let mut ok = true;
            for i in 0..warm + n {
                s.read_exact(&mut buf)?;
                if i == warm - 1 {
                    s.write_all(&[0])?;
                }
                if i == 0 || i == warm + n - 1 {
                    ok &= buf == want;
                }
            }
            s.write_all(&[1])?;
            // Stay until the sender has its acknowledgement.
            let mut end = [0u8; 1];
            let _ = s.read(&mut end);
            Link::say(if ok { "ok" } else { "data differs" });
        }
        "pq-send" => {
            let to = Link::hear()?;
            let mut s = if raw {
                let s = TcpStream::connect(to.parse::<SocketAddr>()?)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Tcp(s)
            } else {
                let nic = peer_nic(args)?;
                let s = Stream::connect_with(&nic, to.parse()?, &cfg)?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Clan(s)
            };
            let mut ack = [0u8; 1];
            for _ in 0..warm {
                s.write_all(&want)?;
            }
            s.read_exact(&mut ack)?;
            let start = Instant::now();
            for _ in 0..n {
                s.write_all(&want)?;
            }
            s.read_exact(&mut ack)?;
            Link::say(format!("secs {}", start.elapsed().as_secs_f64()));
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

// ---- rpc -----------------------------------------------------------------------------------

/// Arguments of `clan bench rpc`.
#[derive(clap::Args, Debug, Clone)]
pub struct RpcArgs {
    /// Request (and reply) size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Calls measured.
    #[arg(long, default_value_t = 50_000)]
    pub iters: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Debug)]
pub struct RpcReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub size: usize,
    pub iters: u64,
    pub rtt_p50_ns: u64,
    pub rtt_p99_ns: u64,
    pub calls_per_s: f64,
    pub baseline: &'static str,
    pub baseline_rtt_p50_ns: u64,
    pub baseline_rtt_p99_ns: u64,
    pub baseline_calls_per_s: f64,
    pub ratio_p50: f64,
    pub placement: String,
    pub machine: sys::Machine,
}

pub fn rpc(a: &RpcArgs) -> Result<()> {
    if a.size == 0 {
        return Err("--size must be positive".into());
    }
    sys::pin(0);
    let warm = (a.iters / 10).max(100);
    // clan: an event-driven RpcServer in the peer.
    let mut peer = PeerProc::spawn("prpc-server", &[format!("size={}", a.size), "cpu=1".into()])?;
    let addr: EndpointAddr = peer.recv()?.parse()?;
    let nic = Nic::open(NicConfig::default())?;
    let mut c = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
    let req = pattern(a.size);
    let mut reply = Vec::with_capacity(a.size);
    let mut s = Samples::new();
    let start = Instant::now();
    let mut measured = Duration::ZERO;
    for i in 0..warm + a.iters {
        let t0 = Instant::now();
        c.call(&req, &mut reply, Some(LIMIT))?;
        if i >= warm {
            let d = t0.elapsed();
            s.record(d);
            measured += d;
        }
    }
    let _ = start;
    if reply != req {
        return Err("the server's reply differs from the request".into());
    }
    peer.send("stop")?;
    peer.finish()?;
    // Baseline: the same request/response over a Unix socket, a blocking server.
    let b = unix_rpc(a.size, a.iters + warm, warm)?;
    let r = RpcReport {
        bench: "rpc",
        transport: "shm",
        size: a.size,
        iters: a.iters,
        rtt_p50_ns: s.p(0.5),
        rtt_p99_ns: s.p(0.99),
        calls_per_s: a.iters as f64 / measured.as_secs_f64(),
        baseline: "unix",
        baseline_rtt_p50_ns: b.0.p(0.5),
        baseline_rtt_p99_ns: b.0.p(0.99),
        baseline_calls_per_s: a.iters as f64 / b.1.as_secs_f64(),
        ratio_p50: ratio(s.p(0.5) as f64, b.0.p(0.5) as f64),
        placement: "client pinned to CPU 0, server process on CPU 1; one call in flight; the clan server is the \
                    event-driven RpcServer (drains its queue, polls 15 µs, sleeps), the clan client spins 15 µs \
                    then sleeps; the Unix server blocks in read"
            .into(),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench rpc: {}-byte requests and replies, {} calls     [paper: RPC on flags and tripwires]",
            r.size, r.iters
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!("clan RPC : RTT p50 {}, p99 {}, {:.0} calls/s", ns(r.rtt_p50_ns), ns(r.rtt_p99_ns), r.calls_per_s);
        println!(
            "unix     : RTT p50 {}, p99 {}, {:.0} calls/s",
            ns(r.baseline_rtt_p50_ns),
            ns(r.baseline_rtt_p99_ns),
            r.baseline_calls_per_s
        );
        println!("ratio clan/unix at p50: {:.2}", r.ratio_p50);
    });
    Ok(())
}

/// Request/response over a Unix stream socket; returns samples and the measured time.
fn unix_rpc(size: usize, total: u64, warm: u64) -> Result<(Samples, Duration)> {
    let name = format!("clan-bench-rpc-{}", std::process::id());
    let l = std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    )?)?;
    let peer = PeerProc::spawn(
        "prpc-unix",
        &[format!("name={name}"), format!("size={size}"), format!("iters={total}"), "cpu=1".into()],
    )?;
    let (mut s, _) = l.accept()?;
    s.set_read_timeout(Some(LIMIT))?;
    let req = pattern(size);
    let mut reply = vec![0u8; size];
    let mut out = Samples::new();
    let mut measured = Duration::ZERO;
    for i in 0..total {
        let t0 = Instant::now();
        s.write_all(&req)?;
        s.read_exact(&mut reply)?;
        if i >= warm {
            let d = t0.elapsed();
            out.record(d);
            measured += d;
        }
    }
    peer.finish()?;
    Ok((out, measured))
}

/// Peer roles of the RPC benchmark.
pub fn rpc_peer(role: &str, args: &[String]) -> Result<()> {
    sys::pin(arg(args, "cpu")?);
    match role {
        "prpc-server" => {
            let nic = Nic::open(NicConfig::default())?;
            let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
            Link::say(server.local_addr());
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s2 = stop.clone();
            std::thread::spawn(move || {
                let _ = Link::hear();
                s2.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut buf = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                server.run_once(Some(Duration::from_millis(20)), &mut |_, req, reply| {
                    // Echo: the request read in place, the reply written into the client.
                    buf.resize(req.len() as usize, 0);
                    if req.copy_to(&mut buf).is_ok() {
                        let _ = reply.write(&buf);
                    }
                })?;
            }
        }
        "prpc-unix" => {
            let name: String = arg(args, "name")?;
            let size: usize = arg(args, "size")?;
            let iters: u64 = arg(args, "iters")?;
            let mut s = std::os::unix::net::UnixStream::connect_addr(
                &std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?,
            )?;
            s.set_read_timeout(Some(LIMIT))?;
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                s.read_exact(&mut buf)?;
                s.write_all(&buf)?;
            }
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

// ---- stream --------------------------------------------------------------------------------

/// Arguments of `clan bench stream`.
#[derive(clap::Args, Debug, Clone)]
pub struct StreamArgs {
    /// Message size of the round-trip test.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Write size of the bandwidth test.
    #[arg(long, default_value_t = 64 << 10)]
    pub bw_size: usize,
    /// Round trips measured.
    #[arg(long, default_value_t = 20_000)]
    pub iters: u64,
    /// Bytes streamed per bandwidth run.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Ring of each clan stream side (its receive buffer).
    #[arg(long, default_value_t = 1 << 20)]
    pub ring: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Debug)]
pub struct StreamReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub size: usize,
    pub rtt_p50_ns: u64,
    pub rtt_p99_ns: u64,
    pub unix_rtt_p50_ns: u64,
    pub tcp_rtt_p50_ns: u64,
    pub bw_size: usize,
    pub mbit_s: f64,
    pub unix_mbit_s: f64,
    pub tcp_mbit_s: f64,
    pub baseline: &'static str,
    pub baseline_rtt_p50_ns: u64,
    pub baseline_mbit_s: f64,
    pub rtt_ratio_vs_unix: f64,
    pub bw_ratio_vs_unix: f64,
    pub placement: String,
    pub machine: sys::Machine,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Clan,
    Unix,
    Tcp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Clan => "clan",
            Kind::Unix => "unix",
            Kind::Tcp => "tcp",
        }
    }
}

/// A connected stream of any kind, as `Read + Write`.
enum AnyStream {
    Clan(Stream),
    Unix(std::os::unix::net::UnixStream),
    Tcp(TcpStream),
}

impl Read for AnyStream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            AnyStream::Clan(s) => s.read(b),
            AnyStream::Unix(s) => s.read(b),
            AnyStream::Tcp(s) => s.read(b),
        }
    }
}

impl Write for AnyStream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            AnyStream::Clan(s) => s.write(b),
            AnyStream::Unix(s) => s.write(b),
            AnyStream::Tcp(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Connect to the stream peer: it listens (clan, Unix or TCP) and says where.
fn stream_connect(kind: Kind, peer: &mut PeerProc, nic: &Nic, ring: u64) -> Result<AnyStream> {
    let to = peer.recv()?;
    Ok(match kind {
        Kind::Clan => {
            AnyStream::Clan(Stream::connect_with(nic, to.parse()?, &StreamConfig { ring, ..StreamConfig::default() })?)
        }
        Kind::Unix => AnyStream::Unix(std::os::unix::net::UnixStream::connect_addr(
            &std::os::unix::net::SocketAddr::from_abstract_name(to.as_bytes())?,
        )?),
        Kind::Tcp => {
            let s = TcpStream::connect(to.parse::<SocketAddr>()?)?;
            s.set_nodelay(true)?;
            AnyStream::Tcp(s)
        }
    })
}

fn stream_rtt(kind: Kind, nic: &Nic, size: usize, iters: u64, ring: u64) -> Result<Samples> {
    let mut peer = PeerProc::spawn(
        "pst-echo",
        &[format!("kind={}", kind.name()), format!("size={size}"), format!("ring={ring}"), "cpu=1".into()],
    )?;
    let mut s = stream_connect(kind, &mut peer, nic, ring)?;
    let msg = pattern(size);
    let mut back = vec![0u8; size];
    let warm = (iters / 10).max(100);
    let mut out = Samples::new();
    for i in 0..warm + iters {
        let t0 = Instant::now();
        s.write_all(&msg)?;
        s.read_exact(&mut back)?;
        if i >= warm {
            out.record(t0.elapsed());
        }
    }
    if back != msg {
        return Err("the echo differs".into());
    }
    drop(s);
    peer.finish()?;
    Ok(out)
}

fn stream_bw(kind: Kind, nic: &Nic, size: usize, bytes: u64, ring: u64) -> Result<f64> {
    let n = (bytes / size as u64).max(1);
    let mut peer = PeerProc::spawn(
        "pst-sink",
        &[
            format!("kind={}", kind.name()),
            format!("size={size}"),
            format!("n={n}"),
            format!("ring={ring}"),
            "cpu=1".into(),
        ],
    )?;
    let mut s = stream_connect(kind, &mut peer, nic, ring)?;
    let msg = pattern(size);
    let mut ack = [0u8; 1];
    // Warm-up: 64 MiB, acknowledged.
    let warm = ((64u64 << 20) / size as u64).max(1);
    for _ in 0..warm {
        s.write_all(&msg)?;
    }
    s.read_exact(&mut ack)?;
    let start = Instant::now();
    for _ in 0..n {
        s.write_all(&msg)?;
    }
    s.read_exact(&mut ack)?;
    let t = start.elapsed();
    drop(s);
    if peer.recv()? != "ok" {
        return Err("the receiver found bad data".into());
    }
    peer.finish()?;
    Ok(mbit(n * size as u64, t))
}

pub fn stream(a: &StreamArgs) -> Result<()> {
    if a.size == 0 || a.bw_size == 0 {
        return Err("sizes must be positive".into());
    }
    sys::pin(0);
    let nic = Nic::open(NicConfig::default())?;
    let (mut rc, mut ru, mut rt) = (Samples::new(), Samples::new(), Samples::new());
    let (mut bc, mut bu, mut bt) = (0.0, 0.0, 0.0);
    let rounds = 3;
    for _ in 0..rounds {
        rc.merge(&stream_rtt(Kind::Clan, &nic, a.size, a.iters / rounds, a.ring)?);
        ru.merge(&stream_rtt(Kind::Unix, &nic, a.size, a.iters / rounds, a.ring)?);
        rt.merge(&stream_rtt(Kind::Tcp, &nic, a.size, a.iters / rounds, a.ring)?);
        bc += stream_bw(Kind::Clan, &nic, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bu += stream_bw(Kind::Unix, &nic, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bt += stream_bw(Kind::Tcp, &nic, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
    }
    let r = StreamReport {
        bench: "stream",
        transport: "shm",
        size: a.size,
        rtt_p50_ns: rc.p(0.5),
        rtt_p99_ns: rc.p(0.99),
        unix_rtt_p50_ns: ru.p(0.5),
        tcp_rtt_p50_ns: rt.p(0.5),
        bw_size: a.bw_size,
        mbit_s: bc,
        unix_mbit_s: bu,
        tcp_mbit_s: bt,
        baseline: "unix",
        baseline_rtt_p50_ns: ru.p(0.5),
        baseline_mbit_s: bu,
        rtt_ratio_vs_unix: ratio(rc.p(0.5) as f64, ru.p(0.5) as f64),
        bw_ratio_vs_unix: ratio(bc, bu),
        placement: format!(
            "client pinned to CPU 0, peer process on CPU 1; clan streams with {} KiB rings, waits spin 15 µs then \
             sleep; Unix and TCP (loopback, TCP_NODELAY) block in read; 3 alternating rounds",
            a.ring >> 10
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench stream: stream sockets between two processes     [VMMC sockets: 20 µs one way, > 84 MB/s]"
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "RTT ({} bytes) p50: clan {}  unix {}  tcp {}   (clan/unix {:.2})",
            r.size,
            ns(r.rtt_p50_ns),
            ns(r.unix_rtt_p50_ns),
            ns(r.tcp_rtt_p50_ns),
            r.rtt_ratio_vs_unix
        );
        println!(
            "bandwidth ({} KiB writes): clan {:.0} Mbit/s  unix {:.0}  tcp {:.0}   (clan/unix {:.2})",
            r.bw_size >> 10,
            r.mbit_s,
            r.unix_mbit_s,
            r.tcp_mbit_s,
            r.bw_ratio_vs_unix
        );
    });
    Ok(())
}

/// Listen with `kind` in a stream peer and say where.
fn stream_accept(kind: &str, ring: u64) -> Result<AnyStream> {
    Ok(match kind {
        "clan" => {
            let nic = Nic::open(NicConfig::default())?;
            let l = Listener::bind_with(&nic, None, StreamConfig { ring, ..StreamConfig::default() })?;
            Link::say(l.local_addr());
            let (s, _) = l.accept()?;
            // Keep the NIC alive with the stream (the stream holds it).
            AnyStream::Clan(s)
        }
        "unix" => {
            let name = format!("clan-bench-stream-{}", std::process::id());
            let l = std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
                name.as_bytes(),
            )?)?;
            Link::say(&name);
            AnyStream::Unix(l.accept()?.0)
        }
        "tcp" => {
            let l = TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))?;
            Link::say(l.local_addr()?);
            let (s, _) = l.accept()?;
            s.set_nodelay(true)?;
            AnyStream::Tcp(s)
        }
        other => return Err(format!("unknown kind {other}").into()),
    })
}

/// Peer roles of the stream benchmark.
pub fn stream_peer(role: &str, args: &[String]) -> Result<()> {
    sys::pin(arg(args, "cpu")?);
    let kind: String = arg(args, "kind")?;
    let size: usize = arg(args, "size")?;
    let mut s = stream_accept(&kind, arg(args, "ring")?)?;
    let mut buf = vec![0u8; size];
    match role {
        "pst-echo" => loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        },
        "pst-sink" => {
            let n: u64 = arg(args, "n")?;
            let warm = ((64u64 << 20) / size as u64).max(1);
            let want = pattern(size);
            let mut ok = true;
            for i in 0..warm + n {
                s.read_exact(&mut buf)?;
                if i == warm - 1 {
                    s.write_all(&[0])?;
                }
                if i == 0 || i == warm + n - 1 {
                    ok &= buf == want;
                }
            }
            s.write_all(&[1])?;
            Link::say(if ok { "ok" } else { "bad" });
            let mut end = [0u8; 1];
            let _ = s.read(&mut end);
            Ok(())
        }
        other => Err(format!("unknown role {other}").into()),
    }
}
