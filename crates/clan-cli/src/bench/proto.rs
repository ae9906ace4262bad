//! Benchmarks of the protocols built on clan (`clan-proto`), each against its same-run
//! baseline:
//!
//! - `clan bench queue`: streaming bandwidth of the distributed queue by transfer size, in
//!   both its variants in the same run: unstructured (a byte stream with a small ring) and
//!   the slot-based message queue (`clan_proto::queue`, slots of the message size in the
//!   same buffer; longer messages go as multi-part messages), copying into and out of the
//!   queue as the CLAN page measures it; messages per second; the size at which half of the
//!   peak is reached; the buffer per endpoint. Baseline: `memcpy` (shm) or a raw TCP stream
//!   (tcp); on shm also a hand-written ring between the same two processes (`ring`: the same
//!   copies in and out through a buffer of the same size, with no tripwires, locks or
//!   checks), the ceiling this machine puts on any queue between two CPUs.
//! - `clan bench rpc`: RPC round-trip time and calls per second (one call in flight) against
//!   the same request/response over a Unix socket, both sides spinning (clan polls, the Unix
//!   socket is non-blocking and polled) and both sides blocking (clan polls for 0).
//! - `clan bench stream`: stream-socket round-trip time, the same two ways, and bandwidth
//!   against Unix sockets and kernel TCP (loopback).
//!
//! Every measurement runs between two processes pinned to different CPUs (0 and 1).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use clan::{EndpointAddr, LocalTransport, Nic, NicConfig};
use clan_proto::queue::{MsgReceiver, MsgSender, QueueConfig, QueueListener};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use serde::Serialize;

use super::latency::Transport;
use super::report::{Samples, emit, ns, ratio, verdict};
use super::{Link, PeerProc, Result, arg};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);
/// How long a spinning side polls before it would sleep: far longer than any wait of a run,
/// so that it never sleeps while the run goes on.
const BUSY_POLL: Duration = Duration::from_millis(10);
/// RTT p50, clan over the Unix socket: the target, both ways (at most as slow).
const TARGET_RTT_VS_UNIX: f64 = 1.0;
/// Messages per `send_batch` in the batched slot queue of `bench queue`.
const BATCH: u64 = 64;
/// RPC calls per round of the message-rate table of `bench queue`.
const RATE_CALLS: u64 = 20_000;
/// Transfers up to this size also run batched and against UCX.
const RATE_SIZES: usize = 1024;
/// A stream over a TCP link: RTT p50 at most this times kernel TCP's.
const TARGET_LINK_RTT_VS_TCP: f64 = 1.1;
/// A stream over a TCP link: bandwidth at least this times kernel TCP's.
const TARGET_LINK_BW_VS_TCP: f64 = 0.9;
/// Oversubscribed (both on one CPU): RTT p50 at most this times a Unix socket's.
const TARGET_ONE_CORE_VS_UNIX: f64 = 2.0;

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
    /// Transfer size (bytes; units accepted: 4KiB; default: a sweep from 64 bytes to 32 KiB).
    #[arg(long, value_parser = sys::size_usize)]
    pub size: Option<usize>,
    /// Alternating rounds per size (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Bytes of receive buffer per endpoint (the queue's ring). Default: 16 KiB on shm (the
    /// CLAN page's point: a small buffer suffices at memory latencies), 1 MiB over tcp (a
    /// link's round trip needs a window).
    #[arg(long, value_parser = sys::size)]
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
    /// Transfers per second through the byte stream.
    pub msg_per_s: f64,
    /// The slot-based message queue: slots of this many bytes (header included).
    pub slot_bytes: u64,
    pub slots: u64,
    pub slot_mbit_s: f64,
    pub slot_msg_per_s: f64,
    /// Slot queue over the baseline.
    pub slot_ratio: f64,
    /// Slot queue over the byte stream.
    pub slot_vs_stream: f64,
    /// The slot queue sent in batches (`send_batch`), messages per second (small sizes).
    pub batch_msg_per_s: Option<f64>,
    /// UCX `ucx_perftest -t tag_bw` over shared memory (`UCX_TLS=sm,self`), same placement,
    /// messages per second (when installed).
    pub ucx_msg_per_s: Option<f64>,
    pub batch_vs_ucx: Option<f64>,
    /// Batched slot queue over the hand-written ring (bytes per second).
    pub batch_vs_ring: Option<f64>,
    /// RPC calls per second with requests and replies of this size, one call in flight,
    /// both sides spinning (small sizes, same host).
    pub rpc_calls_per_s: Option<f64>,
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
    pub msg_per_s: f64,
    /// The slot-based message queue at the last size.
    pub slot_mbit_s: f64,
    pub slot_msg_per_s: f64,
    pub slot_ratio: f64,
    pub slot_vs_stream: f64,
    pub points: Vec<QueuePoint>,
    /// The byte stream's peak and where half of it is reached.
    pub peak_mbit_s: f64,
    pub half_peak_size: Option<usize>,
    /// The slot queue's.
    pub slot_peak_mbit_s: f64,
    pub slot_half_peak_size: Option<usize>,
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
        let (mut o, mut q, mut b, mut g) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut qb, mut ucx, mut rpc) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.rounds.max(1) {
            o.push(queue_round(hosts.as_ref(), size, bytes, buffer, QueueKind::Stream)?);
            q.push(queue_round(hosts.as_ref(), size, bytes, buffer, QueueKind::Slots)?);
            if size <= RATE_SIZES {
                qb.push(queue_round(hosts.as_ref(), size, bytes, buffer, QueueKind::Batch)?);
                if hosts.is_none() {
                    if let Some(r) = ucx_tag_bw(size) {
                        ucx.push(r);
                    }
                    let (calls, warm) = (RATE_CALLS, RATE_CALLS / 10);
                    let (_, d) = clan_rpc(size, calls, warm, true)?;
                    rpc.push((calls - warm) as f64 / d.as_secs_f64().max(1e-9));
                }
            }
            match &hosts {
                Some(h) => b.push(queue_round(Some(h), size, bytes, buffer, QueueKind::Tcp)?),
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
        let slot = median(&mut q).ok_or("no rounds")?;
        let batch = median(&mut qb);
        ucx.sort_by(f64::total_cmp);
        let ucx = ucx.get(ucx.len() / 2).copied();
        rpc.sort_by(f64::total_cmp);
        let rpc = rpc.get(rpc.len() / 2).copied();
        let ring = median(&mut g).map(|d| mbit(bytes, d));
        let msgs = (bytes / size as u64) as f64;
        let geometry = slot_config(size, buffer);
        points.push(QueuePoint {
            size,
            mbit_s: mbit(bytes, ours),
            baseline_mbit_s: mbit(bytes, base),
            ratio: ratio(mbit(bytes, ours), mbit(bytes, base)),
            ring_mbit_s: ring,
            ring_ratio: ring.map(|r| ratio(mbit(bytes, ours), r)),
            msg_per_s: msgs / ours.as_secs_f64().max(1e-9),
            slot_bytes: geometry.slot_size,
            slots: geometry.slots,
            slot_mbit_s: mbit(bytes, slot),
            slot_msg_per_s: msgs / slot.as_secs_f64().max(1e-9),
            slot_ratio: ratio(mbit(bytes, slot), mbit(bytes, base)),
            slot_vs_stream: ratio(mbit(bytes, slot), mbit(bytes, ours)),
            batch_msg_per_s: batch.map(|d| msgs / d.as_secs_f64().max(1e-9)),
            ucx_msg_per_s: ucx,
            batch_vs_ucx: batch.zip(ucx).map(|(d, u)| ratio(msgs / d.as_secs_f64().max(1e-9), u)),
            batch_vs_ring: batch.zip(ring).map(|(d, r)| ratio(mbit(bytes, d), r)),
            rpc_calls_per_s: rpc,
        });
        if !a.json {
            let p = points.last().expect("pushed");
            eprintln!(
                "{:>6} bytes: stream {:>10.0} Mbit/s, slots {:>10.0} Mbit/s (baseline {:>10.0}{})",
                size,
                p.mbit_s,
                p.slot_mbit_s,
                p.baseline_mbit_s,
                p.ring_mbit_s.map_or(String::new(), |r| format!(", ring {r:.0}"))
            );
        }
    }
    let peak_of = |f: fn(&QueuePoint) -> f64| {
        let peak = points.iter().map(f).fold(0.0, f64::max);
        (peak, points.iter().find(|p| f(p) >= peak / 2.0).map(|p| p.size))
    };
    let (peak, half) = peak_of(|p| p.mbit_s);
    let (slot_peak, slot_half) = peak_of(|p| p.slot_mbit_s);
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
        msg_per_s: last.msg_per_s,
        slot_mbit_s: last.slot_mbit_s,
        slot_msg_per_s: last.slot_msg_per_s,
        slot_ratio: last.slot_ratio,
        slot_vs_stream: last.slot_vs_stream,
        points,
        peak_mbit_s: peak,
        half_peak_size: half,
        slot_peak_mbit_s: slot_peak,
        slot_half_peak_size: slot_half,
        placement: format!(
            "{}; sender process pinned to CPU 0, receiver to CPU 1; each transfer is copied into the queue by the \
             sender and out of it by the receiver; both variants wait the library's way (poll 15 µs, then sleep); \
             the slot queue's ring has the same bytes as the stream's, in slots of the transfer size plus its \
             32-byte header (at most a quarter of the ring: longer transfers go as multi-part messages)",
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
        }
        let line = |l: String| println!("{}", l.trim_end());
        line(format!(
            "{:>8}  {:>23}  {:>29}  {:>12}  {:>6} {:>13}",
            "",
            "byte stream",
            "slot message queue",
            "",
            "",
            if ring { "ring" } else { "" }
        ));
        line(format!(
            "{:>8}  {:>10} {:>12}  {:>10} {:>12} {:>5}  {:>12}  {:>6} {:>6} {:>6}",
            "size",
            "Mbit/s",
            "msg/s",
            "Mbit/s",
            "msg/s",
            "slot",
            r.baseline,
            "ratio",
            if ring { "Mbit/s" } else { "" },
            if ring { "ratio" } else { "" }
        ));
        for p in &r.points {
            line(format!(
                "{:>8}  {:>10.0} {:>12.0}  {:>10.0} {:>12.0} {:>5}  {:>12.0}  {:>6.2} {:>6} {:>6}",
                p.size,
                p.mbit_s,
                p.msg_per_s,
                p.slot_mbit_s,
                p.slot_msg_per_s,
                p.slot_bytes,
                p.baseline_mbit_s,
                p.ratio,
                p.ring_mbit_s.map_or(String::new(), |g| format!("{g:.0}")),
                p.ring_ratio.map_or(String::new(), |g| format!("{g:.2}"))
            ));
        }
        println!("ratio: the byte stream over {}; slot: bytes per slot, header included", r.baseline);
        if r.points.iter().any(|p| p.batch_msg_per_s.is_some()) {
            println!(
                "message rate (msg/s): one send per message (send, stream write) and batches of {BATCH} \
                 (MsgSender::send_batch), against UCX tag_bw over shared memory (ucx_perftest, UCX_TLS=sm,self, \
                 server CPU 1, client CPU 0) and the hand-written ring; RPC: calls/s with one call in flight, \
                 both sides spinning"
            );
            line(format!(
                "{:>8}  {:>12} {:>12} {:>12} {:>12} {:>8} {:>8} {:>12}",
                "size", "stream", "slots", "slots batch", "UCX tag_bw", "vs UCX", "vs ring", "RPC calls/s"
            ));
            for p in r.points.iter().filter(|p| p.batch_msg_per_s.is_some()) {
                let opt = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
                line(format!(
                    "{:>8}  {:>12.0} {:>12.0} {:>12} {:>12} {:>8} {:>8} {:>12}",
                    p.size,
                    p.msg_per_s,
                    p.slot_msg_per_s,
                    opt(p.batch_msg_per_s, 0),
                    opt(p.ucx_msg_per_s, 0),
                    opt(p.batch_vs_ucx, 2),
                    opt(p.batch_vs_ring, 2),
                    opt(p.rpc_calls_per_s, 0)
                ));
            }
        }
        println!(
            "byte stream: peak {:.0} Mbit/s, half of it reached at {}",
            r.peak_mbit_s,
            r.half_peak_size.map_or("no measured size".into(), |s| format!("{s}-byte transfers"))
        );
        println!(
            "slot queue : peak {:.0} Mbit/s, half of it reached at {}; at {} bytes {:.2}× the byte stream",
            r.slot_peak_mbit_s,
            r.slot_half_peak_size.map_or("no measured size".into(), |s| format!("{s}-byte transfers")),
            r.points.last().map_or(0, |p| p.size),
            r.slot_vs_stream
        );
    });
    Ok(())
}

/// What carries the transfers of a queue run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueKind {
    /// The distributed queue's unstructured variant: a clan byte stream.
    Stream,
    /// The slot-based message queue.
    Slots,
    /// The slot-based message queue, sent in batches of [`BATCH`] (`MsgSender::send_batch`).
    Batch,
    /// A raw TCP stream (the baseline across hosts).
    Tcp,
}

impl QueueKind {
    fn name(self) -> &'static str {
        match self {
            QueueKind::Batch => "batch",
            QueueKind::Stream => "stream",
            QueueKind::Slots => "slots",
            QueueKind::Tcp => "tcp",
        }
    }
}

/// The slot queue's geometry for `size`-byte transfers in `buffer` bytes: a slot holds one
/// transfer and its header, at most a quarter of the buffer (at least 4 slots; longer
/// transfers go as multi-part messages).
fn slot_config(size: usize, buffer: u64) -> QueueConfig {
    let header = clan_proto::queue::HEADER;
    let quarter = (buffer / 4) & !7;
    let slot_size = (size as u64 + header).next_multiple_of(8).min(quarter).max(header + 8);
    QueueConfig { slots: (buffer / slot_size).max(2), slot_size, ..QueueConfig::default() }
}

/// The queue that carries the acknowledgements of a slot-queue run back to the sender.
fn ack_config() -> QueueConfig {
    QueueConfig { slots: 4, slot_size: 64, ..QueueConfig::default() }
}

/// One run: the receiver peer reads `bytes` in `size` pieces, the sender peer writes them.
/// Returns the sender's time from its first write to the receiver's acknowledgement.
fn queue_round(
    h: Option<&super::tcp::Hosts>,
    size: usize,
    bytes: u64,
    buffer: u64,
    kind: QueueKind,
) -> Result<Duration> {
    let common = [
        format!("size={size}"),
        format!("bytes={bytes}"),
        format!("buffer={buffer}"),
        format!("link={}", h.is_some()),
        format!("kind={}", kind.name()),
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

/// UCX's tagged-message rate between two processes of this host (`ucx_perftest -t tag_bw`,
/// `UCX_TLS=sm,self`; server on CPU 1, client on CPU 0, as the queue's peers), messages per
/// second; None when `ucx_perftest` is not installed or did not run.
fn ucx_tag_bw(size: usize) -> Option<f64> {
    use std::process::{Command, Stdio};
    let exe = sys::which("ucx_perftest")?;
    let iters = (((256u64 << 20) / size as u64).clamp(100_000, 2_000_000)).to_string();
    for _ in 0..3 {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).ok()?.local_addr().ok()?.port().to_string();
        let mut server = Command::new("taskset")
            .args(["-c", "1"])
            .arg(&exe)
            .args(["-p", &port])
            .env("UCX_TLS", "sm,self")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        std::thread::sleep(Duration::from_millis(300));
        let out = Command::new("timeout")
            .args(["120", "taskset", "-c", "0"])
            .arg(&exe)
            .args(["127.0.0.1", "-p", &port, "-t", "tag_bw", "-s", &size.to_string(), "-n", &iters])
            .env("UCX_TLS", "sm,self")
            .stderr(Stdio::null())
            .output();
        let _ = server.kill();
        let _ = server.wait();
        let rate = out.ok().and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.trim_start().starts_with("Final:"))
                .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        });
        if rate.is_some() {
            return rate;
        }
    }
    None
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
/// ring, through the slot-based message queue, or over a raw TCP connection.
pub fn queue_peer(role: &str, args: &[String]) -> Result<()> {
    if role.starts_with("pq-ring-") {
        return ring_peer(role, args);
    }
    let size: usize = arg(args, "size")?;
    let bytes: u64 = arg(args, "bytes")?;
    let buffer: u64 = arg(args, "buffer")?;
    let kind: String = arg(args, "kind")?;
    sys::pin(arg(args, "cpu")?);
    if kind == "slots" || kind == "batch" {
        return slot_peer(role, args, size, bytes, buffer, kind == "batch");
    }
    let raw = kind == "tcp";
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
                let s = Stream::connect_with(&nic, to.parse::<clan::EndpointAddr>()?, &cfg)?;
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

/// The slot-queue variant of [`queue_peer`]: one message per transfer (its metadata word is
/// its number), copied out of the slot by the receiver. The acknowledgements go back through
/// a second, small message queue, whose address the sender sends as its first message.
fn slot_peer(role: &str, args: &[String], size: usize, bytes: u64, buffer: u64, batched: bool) -> Result<()> {
    let want = pattern(size);
    let n = bytes / size as u64;
    let warm = ((4 << 20) / size as u64).max(16);
    let cfg = slot_config(size, buffer);
    let nic = peer_nic(args)?;
    match role {
        "pq-recv" => {
            let l = QueueListener::bind(&nic, cfg)?;
            Link::say(l.local_addr());
            let mut rx: MsgReceiver = l.accept(Some(LIMIT))?;
            let back: EndpointAddr = String::from_utf8(rx.recv(Some(LIMIT))?.data)?.parse()?;
            let mut ack = MsgSender::connect(&nic, back, &ack_config())?;
            let single = size as u64 + clan_proto::queue::HEADER <= slot_config(size, buffer).slot_size;
            let mut buf = vec![0u8; size];
            let mut ok = true;
            for i in 0..warm + n {
                let meta = if single {
                    rx.recv_in_place(Some(LIMIT), |meta, m| {
                        let fits = m.len() == size as u64;
                        (meta, fits && m.read(0, &mut buf).is_ok())
                    })
                    .map(|(meta, fine)| {
                        ok &= fine;
                        meta
                    })?
                } else {
                    let m = rx.recv(Some(LIMIT))?;
                    ok &= m.data.len() == size;
                    if m.data.len() == size && (i == 0 || i == warm + n - 1) {
                        buf.copy_from_slice(&m.data);
                    }
                    m.meta
                };
                ok &= meta == i;
                if i == warm - 1 {
                    ack.send(0, &[0])?;
                }
                if i == 0 || i == warm + n - 1 {
                    ok &= buf == want;
                }
            }
            ack.send(1, &[1])?;
            // Stay until the sender has its acknowledgement (it says goodbye).
            let _ = rx.recv(Some(LIMIT));
            Link::say(if ok { "ok" } else { "data differs" });
        }
        "pq-send" => {
            let to: EndpointAddr = Link::hear()?.parse()?;
            let mut tx = MsgSender::connect(&nic, to, &cfg)?;
            let acks = QueueListener::bind(&nic, ack_config())?;
            tx.send(u64::MAX, acks.local_addr().to_string().as_bytes())?;
            let mut ack = acks.accept(Some(LIMIT))?;
            for i in 0..warm {
                tx.send(i, &want)?;
            }
            ack.recv(Some(LIMIT))?;
            let start = Instant::now();
            if batched {
                let mut i = warm;
                while i < warm + n {
                    let k = BATCH.min(warm + n - i);
                    let batch: Vec<(u64, &[u8])> = (i..i + k).map(|m| (m, &want[..])).collect();
                    tx.send_batch(&batch)?;
                    i += k;
                }
            } else {
                for i in warm..warm + n {
                    tx.send(i, &want)?;
                }
            }
            ack.recv(Some(LIMIT))?;
            let secs = start.elapsed().as_secs_f64();
            tx.send(u64::MAX, b"bye")?;
            Link::say(format!("secs {secs}"));
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

// ---- rpc -----------------------------------------------------------------------------------

/// Arguments of `clan bench rpc`.
#[derive(clap::Args, Debug, Clone)]
pub struct RpcArgs {
    /// Request (and reply) size (bytes; units accepted: 4KiB).
    #[arg(long, default_value = "64", value_parser = sys::size_usize)]
    pub size: usize,
    /// Calls measured.
    #[arg(long, default_value_t = 50_000)]
    pub iters: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One side's figures.
#[derive(Serialize, Debug, Clone, Copy)]
pub struct Calls {
    pub rtt_p50_ns: u64,
    pub rtt_p90_ns: u64,
    pub rtt_p99_ns: u64,
    pub calls_per_s: f64,
}

impl Calls {
    fn of(s: &Samples, measured: Duration) -> Calls {
        Calls {
            rtt_p50_ns: s.p(0.5),
            rtt_p90_ns: s.p(0.9),
            rtt_p99_ns: s.p(0.99),
            calls_per_s: s.summary().count as f64 / measured.as_secs_f64().max(1e-9),
        }
    }
}

/// clan RPC against the Unix socket, both sides waiting the same way.
#[derive(Serialize, Debug)]
pub struct RpcCompared {
    /// How both sides waited.
    pub how: &'static str,
    pub clan: Calls,
    pub baseline: Calls,
    /// RTT p50, clan / unix (below 1: clan answers sooner).
    pub ratio_rtt_p50: f64,
    /// Calls per second, clan / unix.
    pub ratio_calls_per_s: f64,
    /// `ratio_rtt_p50` ≤ the target.
    pub target_met: bool,
}

impl RpcCompared {
    fn new(how: &'static str, clan: Calls, baseline: Calls) -> RpcCompared {
        let r = ratio(clan.rtt_p50_ns as f64, baseline.rtt_p50_ns as f64);
        RpcCompared {
            how,
            clan,
            baseline,
            ratio_rtt_p50: r,
            ratio_calls_per_s: ratio(clan.calls_per_s, baseline.calls_per_s),
            target_met: r <= TARGET_RTT_VS_UNIX,
        }
    }
}

#[derive(Serialize, Debug)]
pub struct RpcReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub size: usize,
    pub iters: u64,
    pub baseline: &'static str,
    /// Both sides spinning.
    pub spin: RpcCompared,
    /// Both sides blocking.
    pub block: RpcCompared,
    /// RTT p50, clan / unix, both sides spinning.
    pub ratio_spin: f64,
    /// RTT p50, clan / unix, both sides blocking.
    pub ratio_block: f64,
    /// Calls per second, clan / unix, each way.
    pub calls_ratio_spin: f64,
    pub calls_ratio_block: f64,
    pub target: String,
    /// "both ways", "spinning only", "blocking only" or "neither".
    pub target_met: &'static str,
    pub placement: String,
    pub machine: sys::Machine,
}

/// How long a side polls: spinning, or not at all.
fn poll_time(spin: bool) -> Duration {
    if spin { BUSY_POLL } else { Duration::ZERO }
}

pub fn rpc(a: &RpcArgs) -> Result<()> {
    if a.size == 0 || a.iters == 0 {
        return Err("--size and --iters must be positive".into());
    }
    let pinned = sys::pin(0);
    let warm = (a.iters / 10).max(100);
    // Rounds, each way: clan, then its baseline (samples merged).
    let rounds = 3;
    let (per_round, warm) = (a.iters.div_ceil(rounds), warm.div_ceil(rounds).max(100));
    let total = per_round + warm;
    let mut m: [(Samples, Duration); 4] = Default::default();
    for _ in 0..rounds {
        for (i, (clan, spin)) in [(true, true), (false, true), (true, false), (false, false)].into_iter().enumerate() {
            let (s, d) = if clan { clan_rpc(a.size, total, warm, spin)? } else { unix_rpc(a.size, total, warm, spin)? };
            m[i].0.merge(&s);
            m[i].1 += d;
        }
    }
    let [clan_spin, unix_spin, clan_block, unix_block] = m.map(|(s, d)| Calls::of(&s, d));
    let spin = RpcCompared::new(
        "both sides spin: clan's client and event-driven server poll their flags and queue (RpcConfig::spin and \
         the NICs' queues 10 ms); the Unix socket is non-blocking on both sides, polled with recv in a loop",
        clan_spin,
        unix_spin,
    );
    let block = RpcCompared::new(
        "both sides block: clan's RpcConfig::spin and the NICs' queue spin are 0 (a wait arms its tripwire and \
         sleeps at once); the Unix socket is blocking on both sides",
        clan_block,
        unix_block,
    );
    let r = RpcReport {
        bench: "rpc",
        transport: "shm",
        size: a.size,
        iters: a.iters,
        baseline: "unix",
        ratio_spin: spin.ratio_rtt_p50,
        ratio_block: block.ratio_rtt_p50,
        calls_ratio_spin: spin.ratio_calls_per_s,
        calls_ratio_block: block.ratio_calls_per_s,
        target: format!("RTT p50 ≤ {TARGET_RTT_VS_UNIX}× the Unix socket's"),
        target_met: verdict(spin.target_met, block.target_met),
        spin,
        block,
        placement: format!(
            "client pinned to CPU {}, server process to CPU 1 ({} CPUs); one call in flight; the clan server is the \
             event-driven RpcServer, the Unix server reads and writes back; 3 rounds, clan and Unix alternating",
            pinned.map_or("-".into(), |c| c.to_string()),
            sys::machine().cpus
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench rpc: {}-byte requests and replies, {} calls each way     [paper: RPC on flags and tripwires]",
            r.size, r.iters
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!("{:<16} {:>10} {:>10} {:>10} {:>12}", "", "RTT p50", "p90", "p99", "calls/s");
        for (name, c) in [
            ("clan, spinning", &r.spin.clan),
            ("unix, spinning", &r.spin.baseline),
            ("clan, blocking", &r.block.clan),
            ("unix, blocking", &r.block.baseline),
        ] {
            println!(
                "{:<16} {:>10} {:>10} {:>10} {:>12.0}",
                name,
                ns(c.rtt_p50_ns),
                ns(c.rtt_p90_ns),
                ns(c.rtt_p99_ns),
                c.calls_per_s
            );
        }
        println!("spin : {}", r.spin.how);
        println!("block: {}", r.block.how);
        println!(
            "RTT p50 clan/unix: {:.3} spinning, {:.3} blocking; calls/s clan/unix: {:.2} spinning, {:.2} blocking",
            r.ratio_spin, r.ratio_block, r.calls_ratio_spin, r.calls_ratio_block
        );
        println!("target {}: met {}", r.target, r.target_met);
    });
    Ok(())
}

/// Calls to an event-driven RpcServer in a peer, both sides spinning or both blocking.
fn clan_rpc(size: usize, total: u64, warm: u64, spin: bool) -> Result<(Samples, Duration)> {
    let mut peer = PeerProc::spawn("prpc-server", &[format!("size={size}"), format!("spin={spin}"), "cpu=1".into()])?;
    let addr: EndpointAddr = peer.recv()?.parse()?;
    let nic = Nic::open(super::nic_config(poll_time(spin)))?;
    let cfg = RpcConfig { spin: poll_time(spin), ..RpcConfig::default() };
    let mut c = RpcClient::connect(&nic, addr, &cfg)?;
    let req = pattern(size);
    let mut reply = Vec::with_capacity(size);
    let mut s = Samples::new();
    let mut measured = Duration::ZERO;
    for i in 0..total {
        let t0 = Instant::now();
        c.call(&req, &mut reply, Some(LIMIT))?;
        if i >= warm {
            let d = t0.elapsed();
            s.record(d);
            measured += d;
        }
    }
    if reply != req {
        return Err("the server's reply differs from the request".into());
    }
    peer.send("stop")?;
    peer.finish()?;
    Ok((s, measured))
}

/// `read_exact` by polling: a non-blocking source is read again at once when it has
/// nothing.
fn read_exact_polling(s: &mut impl Read, buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::ErrorKind;
    let (start, mut n, mut got) = (Instant::now(), 0u32, 0usize);
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(k) => got += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n % 4096 == 0 && start.elapsed() > LIMIT {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` by polling (a non-blocking sink is written again at once when it is full).
fn write_all_polling(s: &mut impl Write, mut buf: &[u8]) -> std::io::Result<()> {
    use std::io::ErrorKind;
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(k) => buf = &buf[k..],
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Request/response over a Unix stream socket: non-blocking and polled on both sides
/// (`spin`), or blocking.
fn unix_rpc(size: usize, total: u64, warm: u64, spin: bool) -> Result<(Samples, Duration)> {
    let name = format!("clan-bench-rpc-{}", std::process::id());
    let l = std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    )?)?;
    let peer = PeerProc::spawn(
        "prpc-unix",
        &[
            format!("name={name}"),
            format!("size={size}"),
            format!("iters={total}"),
            format!("spin={spin}"),
            "cpu=1".into(),
        ],
    )?;
    let (mut s, _) = l.accept()?;
    s.set_read_timeout(Some(LIMIT))?;
    s.set_nonblocking(spin)?;
    let req = pattern(size);
    let mut reply = vec![0u8; size];
    let mut out = Samples::new();
    let mut measured = Duration::ZERO;
    for i in 0..total {
        let t0 = Instant::now();
        if spin {
            write_all_polling(&mut s, &req)?;
            read_exact_polling(&mut s, &mut reply)?;
        } else {
            s.write_all(&req)?;
            s.read_exact(&mut reply)?;
        }
        if i >= warm {
            let d = t0.elapsed();
            out.record(d);
            measured += d;
        }
    }
    if reply != req {
        return Err("the Unix server's reply differs from the request".into());
    }
    peer.finish()?;
    Ok((out, measured))
}

/// Peer roles of the RPC benchmark.
pub fn rpc_peer(role: &str, args: &[String]) -> Result<()> {
    sys::pin(arg(args, "cpu")?);
    let spin: bool = arg(args, "spin")?;
    match role {
        "prpc-server" => {
            let nic = Nic::open(super::nic_config(poll_time(spin)))?;
            let mut server = RpcServer::bind(&nic, RpcConfig { spin: poll_time(spin), ..RpcConfig::default() }, 16)?;
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
            s.set_nonblocking(spin)?;
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                if spin {
                    read_exact_polling(&mut s, &mut buf)?;
                    write_all_polling(&mut s, &buf)?;
                } else {
                    s.read_exact(&mut buf)?;
                    s.write_all(&buf)?;
                }
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
    #[arg(long, default_value = "64", value_parser = sys::size_usize)]
    pub size: usize,
    /// Write size of the bandwidth test.
    #[arg(long, default_value_t = 64 << 10)]
    pub bw_size: usize,
    /// Round trips measured.
    #[arg(long, default_value_t = 20_000)]
    pub iters: u64,
    /// Bytes streamed per bandwidth run.
    #[arg(long, default_value = "1GiB", value_parser = sys::size)]
    pub bytes: u64,
    /// Ring of each clan stream side (its receive buffer).
    #[arg(long, default_value_t = 1 << 20)]
    pub ring: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Round trips of the three kinds of stream, all waiting one way.
#[derive(Serialize, Debug)]
pub struct StreamRtt {
    /// How both sides waited.
    pub how: &'static str,
    pub clan_rtt_p50_ns: u64,
    pub clan_rtt_p99_ns: u64,
    pub unix_rtt_p50_ns: u64,
    pub unix_rtt_p99_ns: u64,
    pub tcp_rtt_p50_ns: u64,
    pub tcp_rtt_p99_ns: u64,
    /// RTT p50, clan / unix.
    pub ratio_vs_unix: f64,
    /// RTT p50, clan / tcp.
    pub ratio_vs_tcp: f64,
    /// `ratio_vs_unix` ≤ the target.
    pub target_met: bool,
}

impl StreamRtt {
    fn new(how: &'static str, c: &Samples, u: &Samples, t: &Samples) -> StreamRtt {
        let r = ratio(c.p(0.5) as f64, u.p(0.5) as f64);
        StreamRtt {
            how,
            clan_rtt_p50_ns: c.p(0.5),
            clan_rtt_p99_ns: c.p(0.99),
            unix_rtt_p50_ns: u.p(0.5),
            unix_rtt_p99_ns: u.p(0.99),
            tcp_rtt_p50_ns: t.p(0.5),
            tcp_rtt_p99_ns: t.p(0.99),
            ratio_vs_unix: r,
            ratio_vs_tcp: ratio(c.p(0.5) as f64, t.p(0.5) as f64),
            target_met: r <= TARGET_RTT_VS_UNIX,
        }
    }
}

/// Round trips with both processes on one CPU.
#[derive(Serialize, Debug)]
pub struct OneCore {
    pub how: &'static str,
    pub clan_block_p50_ns: u64,
    pub clan_default_p50_ns: u64,
    pub unix_p50_ns: u64,
    /// clan blocking / unix.
    pub ratio_block: f64,
    /// clan with its defaults / unix.
    pub ratio_default: f64,
    pub target: String,
    pub target_met: bool,
}

/// A clan stream over a TCP link against kernel TCP, same placement.
#[derive(Serialize, Debug)]
pub struct OverLink {
    pub how: &'static str,
    pub spin_rtt_p50_ns: u64,
    pub spin_rtt_p99_ns: u64,
    pub block_rtt_p50_ns: u64,
    pub block_rtt_p99_ns: u64,
    pub tcp_spin_rtt_p50_ns: u64,
    pub tcp_block_rtt_p50_ns: u64,
    /// RTT p50, clan over the link / kernel TCP, both spinning.
    pub ratio_spin_vs_tcp: f64,
    /// RTT p50, clan over the link / kernel TCP, both blocking.
    pub ratio_block_vs_tcp: f64,
    pub mbit_s: f64,
    pub tcp_mbit_s: f64,
    /// Bandwidth, clan over the link / kernel TCP.
    pub bw_ratio_vs_tcp: f64,
    pub target: String,
    /// "both ways", "spinning only", "blocking only" or "neither" for the RTT target.
    pub rtt_target_met: &'static str,
    pub bw_target_met: bool,
}

impl OverLink {
    /// From the round trips `[link spinning, link blocking, tcp spinning, tcp blocking]` and
    /// the bandwidths `[link, tcp]`.
    fn new(how: &'static str, rtt: [&Samples; 4], bw: [f64; 2], bw_size: usize) -> OverLink {
        let [ls, lb, ts, tb] = rtt;
        let [bl, bt] = bw;
        let (rs, rb) = (ratio(ls.p(0.5) as f64, ts.p(0.5) as f64), ratio(lb.p(0.5) as f64, tb.p(0.5) as f64));
        OverLink {
            how,
            spin_rtt_p50_ns: ls.p(0.5),
            spin_rtt_p99_ns: ls.p(0.99),
            block_rtt_p50_ns: lb.p(0.5),
            block_rtt_p99_ns: lb.p(0.99),
            tcp_spin_rtt_p50_ns: ts.p(0.5),
            tcp_block_rtt_p50_ns: tb.p(0.5),
            ratio_spin_vs_tcp: rs,
            ratio_block_vs_tcp: rb,
            mbit_s: bl,
            tcp_mbit_s: bt,
            bw_ratio_vs_tcp: ratio(bl, bt),
            target: format!(
                "RTT p50 ≤ {TARGET_LINK_RTT_VS_TCP}× kernel TCP's, bandwidth ≥ {TARGET_LINK_BW_VS_TCP}× at {} KiB writes",
                bw_size >> 10
            ),
            rtt_target_met: verdict(rs <= TARGET_LINK_RTT_VS_TCP, rb <= TARGET_LINK_RTT_VS_TCP),
            bw_target_met: ratio(bl, bt) >= TARGET_LINK_BW_VS_TCP,
        }
    }
}

#[derive(Serialize, Debug)]
pub struct StreamReport {
    pub bench: &'static str,
    /// A clan stream over a TCP link on loopback against kernel TCP.
    pub link: OverLink,
    /// The same with manual progress.
    pub link_manual: OverLink,
    /// Both processes on one CPU (when this process could pin itself).
    pub one_core: Option<OneCore>,
    pub transport: &'static str,
    pub size: usize,
    pub baseline: &'static str,
    /// Round trips, both sides spinning.
    pub spin: StreamRtt,
    /// Round trips, both sides blocking.
    pub block: StreamRtt,
    /// RTT p50, clan / unix, both sides spinning.
    pub ratio_spin: f64,
    /// RTT p50, clan / unix, both sides blocking.
    pub ratio_block: f64,
    pub target: String,
    /// "both ways", "spinning only", "blocking only" or "neither".
    pub target_met: &'static str,
    pub bw_size: usize,
    pub mbit_s: f64,
    pub unix_mbit_s: f64,
    pub tcp_mbit_s: f64,
    pub baseline_mbit_s: f64,
    pub bw_ratio_vs_unix: f64,
    /// How the bandwidth runs waited.
    pub bw_how: &'static str,
    pub placement: String,
    pub machine: sys::Machine,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Clan,
    /// A clan stream between two NICs of this host forced onto a TCP link over loopback,
    /// each NIC's engine thread receiving (`Progress::Auto`, the default).
    Link,
    /// The same with `Progress::Manual`: the application's threads receive from the link
    /// as they wait (as a thread reading a TCP socket does).
    LinkManual,
    Unix,
    Tcp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Clan => "clan",
            Kind::Link => "link",
            Kind::LinkManual => "link-manual",
            Kind::Unix => "unix",
            Kind::Tcp => "tcp",
        }
    }
}

/// How both sides of a stream run wait.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wait {
    /// Poll: clan streams and their NICs' queues poll 10 ms, sockets are non-blocking and
    /// polled.
    Spin,
    /// Sleep at once: clan polls for 0, sockets block.
    Block,
    /// clan's defaults (poll 15 µs, then sleep); sockets block.
    Default,
}

impl Wait {
    fn name(self) -> &'static str {
        match self {
            Wait::Spin => "spin",
            Wait::Block => "block",
            Wait::Default => "default",
        }
    }
    fn parse(s: &str) -> Result<Wait> {
        Ok(match s {
            "spin" => Wait::Spin,
            "block" => Wait::Block,
            "default" => Wait::Default,
            other => return Err(format!("unknown wait {other}").into()),
        })
    }
    /// The clan NIC of a side waiting this way (`link`: one that reaches the other
    /// processes of this host over TCP links, as it reaches other hosts).
    fn nic(self, kind: &str) -> Result<Nic> {
        let c = match self {
            Wait::Spin => super::nic_config(BUSY_POLL),
            Wait::Block => super::nic_config(Duration::ZERO),
            Wait::Default => NicConfig::default(),
        };
        let link = kind.starts_with("link");
        let local_transport = if link { LocalTransport::Link } else { c.local_transport };
        let progress = if kind == "link-manual" { clan::Progress::Manual } else { c.progress };
        Ok(Nic::open(NicConfig { local_transport, progress, ..c })?)
    }
    fn stream_config(self, ring: u64) -> StreamConfig {
        let d = StreamConfig::default();
        let spin = match self {
            Wait::Spin => BUSY_POLL,
            Wait::Block => Duration::ZERO,
            Wait::Default => d.spin,
        };
        StreamConfig { ring, spin, ..d }
    }
}

/// A connected stream of any kind, as `Read + Write`.
enum AnyStream {
    Clan(Stream),
    Unix(std::os::unix::net::UnixStream),
    Tcp(TcpStream),
}

impl AnyStream {
    /// Make a socket non-blocking (clan streams poll by their configuration instead).
    fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        match self {
            AnyStream::Clan(_) => Ok(()),
            AnyStream::Unix(s) => s.set_nonblocking(on),
            AnyStream::Tcp(s) => s.set_nonblocking(on),
        }
    }
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
fn stream_connect(kind: Kind, peer: &mut PeerProc, nic: &Nic, ring: u64, wait: Wait) -> Result<AnyStream> {
    let to = peer.recv()?;
    let s = match kind {
        Kind::Clan | Kind::Link | Kind::LinkManual => {
            AnyStream::Clan(Stream::connect_with(nic, to.parse::<clan::EndpointAddr>()?, &wait.stream_config(ring))?)
        }
        Kind::Unix => AnyStream::Unix(std::os::unix::net::UnixStream::connect_addr(
            &std::os::unix::net::SocketAddr::from_abstract_name(to.as_bytes())?,
        )?),
        Kind::Tcp => {
            let s = TcpStream::connect(to.parse::<SocketAddr>()?)?;
            s.set_nodelay(true)?;
            AnyStream::Tcp(s)
        }
    };
    s.set_nonblocking(wait == Wait::Spin)?;
    Ok(s)
}

fn stream_args(kind: Kind, size: usize, ring: u64, wait: Wait, cpu: usize) -> Vec<String> {
    vec![
        format!("kind={}", kind.name()),
        format!("size={size}"),
        format!("ring={ring}"),
        format!("wait={}", wait.name()),
        format!("cpu={cpu}"),
    ]
}

/// Round trips with the echoing peer on `peer_cpu` (the caller is on CPU 0).
fn stream_rtt(kind: Kind, size: usize, iters: u64, ring: u64, wait: Wait, peer_cpu: usize) -> Result<Samples> {
    let nic = wait.nic(kind.name())?;
    let mut peer = PeerProc::spawn("pst-echo", &stream_args(kind, size, ring, wait, peer_cpu))?;
    let mut s = stream_connect(kind, &mut peer, &nic, ring, wait)?;
    let msg = pattern(size);
    let mut back = vec![0u8; size];
    let warm = (iters / 10).max(100);
    let mut out = Samples::new();
    for i in 0..warm + iters {
        let t0 = Instant::now();
        if wait == Wait::Spin {
            write_all_polling(&mut s, &msg)?;
            read_exact_polling(&mut s, &mut back)?;
        } else {
            s.write_all(&msg)?;
            s.read_exact(&mut back)?;
        }
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

fn stream_bw(kind: Kind, size: usize, bytes: u64, ring: u64) -> Result<f64> {
    let n = (bytes / size as u64).max(1);
    let wait = Wait::Default;
    let nic = wait.nic(kind.name())?;
    let mut args = stream_args(kind, size, ring, wait, 1);
    args.push(format!("n={n}"));
    let mut peer = PeerProc::spawn("pst-sink", &args)?;
    let mut s = stream_connect(kind, &mut peer, &nic, ring, wait)?;
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
    if a.size == 0 || a.bw_size == 0 || a.iters == 0 {
        return Err("sizes and --iters must be positive".into());
    }
    let pinned = sys::pin(0);
    let kinds = [Kind::Clan, Kind::Unix, Kind::Tcp, Kind::Link, Kind::LinkManual];
    // Round trips: [spin, block] × [clan, unix, tcp, link, link with manual progress].
    let mut rtt: [[Samples; 5]; 2] = Default::default();
    // Both processes on CPU 0: [clan blocking, clan's defaults, unix blocking].
    let mut one: [Samples; 3] = Default::default();
    let (mut bc, mut bu, mut bt, mut bl, mut bm) = (0.0, 0.0, 0.0, 0.0, 0.0);
    let rounds = 3;
    let per_round = a.iters.div_ceil(rounds);
    for _ in 0..rounds {
        for (w, wait) in [Wait::Spin, Wait::Block].into_iter().enumerate() {
            for (k, kind) in kinds.into_iter().enumerate() {
                rtt[w][k].merge(&stream_rtt(kind, a.size, per_round, a.ring, wait, 1)?);
            }
        }
        if pinned.is_some() {
            let one_core = (per_round / 4).max(100);
            for (i, (kind, wait)) in [(Kind::Clan, Wait::Block), (Kind::Clan, Wait::Default), (Kind::Unix, Wait::Block)]
                .into_iter()
                .enumerate()
            {
                one[i].merge(&stream_rtt(kind, a.size, one_core, a.ring, wait, 0)?);
            }
        }
        bc += stream_bw(Kind::Clan, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bu += stream_bw(Kind::Unix, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bt += stream_bw(Kind::Tcp, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bl += stream_bw(Kind::Link, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
        bm += stream_bw(Kind::LinkManual, a.bw_size, a.bytes / rounds, a.ring)? / rounds as f64;
    }
    let [[cs, us, ts, ls, ms], [cb, ub, tb, lb, mb]] = &rtt;
    let link = OverLink::new(
        "a clan stream between two NICs of this host forced onto TCP links (LocalTransport::Link) over \
         loopback, each NIC's engine thread receiving (Progress::Auto, the default) on its process's CPU, \
         against kernel TCP over loopback (TCP_NODELAY), waiting the same ways",
        [ls, lb, ts, tb],
        [bl, bt],
        a.bw_size,
    );
    let link_manual = OverLink::new(
        "the same with Progress::Manual: the application's thread receives from the link while it waits \
         (spinning: it polls the socket; blocking: it sleeps in poll on it), as a thread reading a TCP socket does",
        [ms, mb, ts, tb],
        [bm, bt],
        a.bw_size,
    );

    let spin = StreamRtt::new(
        "both sides spin: clan streams and their NICs' queues poll 10 ms before they would sleep; Unix and TCP \
         sockets are non-blocking on both sides, polled in a loop",
        cs,
        us,
        ts,
    );
    let block = StreamRtt::new(
        "both sides block: clan's StreamConfig::spin and the NICs' queue spin are 0; Unix and TCP sockets block in \
         read",
        cb,
        ub,
        tb,
    );
    let [ob, od, ou] = &one;
    let one_core = pinned.is_some().then(|| OneCore {
        how: "both processes on CPU 0 (oversubscribed): clan blocking (spin 0 in its configs and its NICs' queues, \
              as CLAN_SPIN_US=0 sets), clan with its defaults (15 µs spin before each sleep), a Unix socket blocking \
              in read",
        clan_block_p50_ns: ob.p(0.5),
        clan_default_p50_ns: od.p(0.5),
        unix_p50_ns: ou.p(0.5),
        ratio_block: ratio(ob.p(0.5) as f64, ou.p(0.5) as f64),
        ratio_default: ratio(od.p(0.5) as f64, ou.p(0.5) as f64),
        target: format!("RTT p50 ≤ {TARGET_ONE_CORE_VS_UNIX}× the Unix socket's on one core"),
        target_met: ratio(ob.p(0.5) as f64, ou.p(0.5) as f64) <= TARGET_ONE_CORE_VS_UNIX,
    });
    let r = StreamReport {
        bench: "stream",
        link,
        link_manual,
        one_core,
        transport: "shm",
        size: a.size,
        baseline: "unix",
        ratio_spin: spin.ratio_vs_unix,
        ratio_block: block.ratio_vs_unix,
        target: format!("RTT p50 ≤ {TARGET_RTT_VS_UNIX}× the Unix socket's"),
        target_met: verdict(spin.target_met, block.target_met),
        spin,
        block,
        bw_size: a.bw_size,
        mbit_s: bc,
        unix_mbit_s: bu,
        tcp_mbit_s: bt,
        baseline_mbit_s: bu,
        bw_ratio_vs_unix: ratio(bc, bu),
        bw_how: "clan's defaults (waits poll 15 µs, then sleep); Unix and TCP block",
        placement: format!(
            "client pinned to CPU {}, peer process to CPU 1 ({} CPUs); clan streams with {} KiB rings; TCP over \
             loopback with TCP_NODELAY; {rounds} alternating rounds",
            pinned.map_or("-".into(), |c| c.to_string()),
            sys::machine().cpus,
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
        for (name, x) in [("spinning", &r.spin), ("blocking", &r.block)] {
            println!(
                "RTT ({} bytes) p50, {name}: clan {}  unix {}  tcp {}   (clan/unix {:.3}, clan/tcp {:.3}; p99 clan {}  \
                 unix {}  tcp {})",
                r.size,
                ns(x.clan_rtt_p50_ns),
                ns(x.unix_rtt_p50_ns),
                ns(x.tcp_rtt_p50_ns),
                x.ratio_vs_unix,
                x.ratio_vs_tcp,
                ns(x.clan_rtt_p99_ns),
                ns(x.unix_rtt_p99_ns),
                ns(x.tcp_rtt_p99_ns)
            );
        }
        println!("spin : {}", r.spin.how);
        println!("block: {}", r.block.how);
        println!("target {}: met {}", r.target, r.target_met);
        if let Some(o) = &r.one_core {
            println!(
                "RTT ({} bytes) p50, one core: clan blocking {}  clan defaults {}  unix {}   (clan/unix {:.3} blocking, \
             {:.3} defaults; target {} (blocking): {})",
                r.size,
                ns(o.clan_block_p50_ns),
                ns(o.clan_default_p50_ns),
                ns(o.unix_p50_ns),
                o.ratio_block,
                o.ratio_default,
                o.target,
                if o.target_met { "met" } else { "not met" }
            );
            println!("one core: {}", o.how);
        }
        println!(
            "bandwidth ({} KiB writes): clan {:.0} Mbit/s  unix {:.0}  tcp {:.0}   (clan/unix {:.2}; {})",
            r.bw_size >> 10,
            r.mbit_s,
            r.unix_mbit_s,
            r.tcp_mbit_s,
            r.bw_ratio_vs_unix,
            r.bw_how
        );
        for (name, l) in [("over a TCP link", &r.link), ("over a TCP link, manual progress", &r.link_manual)] {
            println!(
                "{name}: RTT p50 spinning {} (tcp {}, {:.2}×), blocking {} (tcp {}, {:.2}×); bandwidth {:.0} \
             Mbit/s (tcp {:.0}, {:.2}×); target {}: RTT met {}, bandwidth {}",
                ns(l.spin_rtt_p50_ns),
                ns(l.tcp_spin_rtt_p50_ns),
                l.ratio_spin_vs_tcp,
                ns(l.block_rtt_p50_ns),
                ns(l.tcp_block_rtt_p50_ns),
                l.ratio_block_vs_tcp,
                l.mbit_s,
                l.tcp_mbit_s,
                l.bw_ratio_vs_tcp,
                l.target,
                l.rtt_target_met,
                if l.bw_target_met { "met" } else { "not met" }
            );
            println!("  ({})", l.how);
        }
    });
    Ok(())
}

/// Listen with `kind` in a stream peer and say where.
fn stream_accept(kind: &str, ring: u64, wait: Wait) -> Result<AnyStream> {
    let s = match kind {
        "clan" | "link" | "link-manual" => {
            let nic = wait.nic(kind)?;
            let l = Listener::bind_with(&nic, None, wait.stream_config(ring))?;
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
    };
    s.set_nonblocking(wait == Wait::Spin)?;
    Ok(s)
}

/// Peer roles of the stream benchmark.
pub fn stream_peer(role: &str, args: &[String]) -> Result<()> {
    sys::pin(arg(args, "cpu")?);
    let kind: String = arg(args, "kind")?;
    let size: usize = arg(args, "size")?;
    let wait = Wait::parse(&arg::<String>(args, "wait")?)?;
    let mut s = stream_accept(&kind, arg(args, "ring")?, wait)?;
    let mut buf = vec![0u8; size];
    match role {
        "pst-echo" => loop {
            let got = if wait == Wait::Spin { read_exact_polling(&mut s, &mut buf) } else { s.read_exact(&mut buf) };
            match got {
                Ok(()) if wait == Wait::Spin => write_all_polling(&mut s, &buf)?,
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
