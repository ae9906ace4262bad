//! `clan bench queue`: streaming bandwidth of the distributed queue by transfer size, in
//! both its variants in the same run: unstructured (a byte stream with a small ring) and the
//! slot-based message queue (`clan_proto::queue`, slots of the message size in the same
//! buffer; longer messages go as multi-part messages), copying into and out of the queue as
//! the CLAN page measures it; messages per second; the size at which half of the peak is
//! reached; the buffer per endpoint. Baseline: `memcpy` (shm) or a raw TCP stream (tcp); on
//! shm also a hand-written ring between the same two processes (`ring`: the same copies in
//! and out through a buffer of the same size, with no tripwires, locks or checks), the
//! ceiling this machine puts on any queue between two CPUs; for small transfers UCX's
//! `ucx_perftest -t tag_bw`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clan::EndpointAddr;
use clan_proto::queue::{MsgReceiver, MsgSender, QueueConfig, QueueListener};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use serde::Serialize;

use super::latency::Transport;
use super::proto::*;
use super::report::{emit, ratio};
use super::rpc::clan_rpc;
use super::tcp::OnHost;
use super::{Link, PeerProc, Result, Role};
use crate::sys;
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

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct QueuePoint {
    pub size: usize,
    pub mbit_s: f64,
    pub baseline_mbit_s: f64,
    pub ratio: f64,
    /// The hand-written ring (shm only).
    pub ring_mbit_s: Option<f64>,
    pub ring_ratio: Option<f64>,
    /// The hand-written ring with one `fence(SeqCst)` after each publication, the least a
    /// writer whose stores can fire tripwires needs (shm only).
    pub fenced_ring_mbit_s: Option<f64>,
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

#[derive(Serialize, serde::Deserialize, Debug)]
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
    /// Where the fenced hand-written ring reaches half of the byte stream's peak (shm only).
    pub fenced_ring_half_peak_size: Option<usize>,
    pub placement: String,
    pub machine: sys::Machine,
}

fn queue_bytes(size: usize, tcp: bool) -> u64 {
    let cap: u64 = if tcp { 256 << 20 } else { 512 << 20 };
    (size as u64 * (1 << 20)).clamp(16 << 20, cap) / size as u64 * size as u64
}

pub fn run(a: &QueueArgs) -> Result<()> {
    let tcp = a.transport == Transport::Tcp;
    let buffer = a.buffer.unwrap_or(if tcp { 1 << 20 } else { 16 << 10 });
    let hosts = tcp.then(super::tcp::Hosts::new);
    let sizes: Vec<usize> = match a.size {
        Some(s) if s > 0 => vec![s],
        Some(_) => return Err("--size must be positive".into()),
        None => vec![64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
    };
    let mut points = Vec::new();
    let bar = super::report::progress(sizes.len() as u64 * u64::from(a.rounds.max(1)), a.json);
    for &size in &sizes {
        bar.set_message(format!("{size} B transfers"));
        // Alternating rounds, the median of each side: two processes streaming at each other
        // swing between rounds on this machine (where the host runs the two virtual CPUs),
        // and one round could catch either regime.
        let bytes = queue_bytes(size, tcp) / 2;
        let (mut o, mut q, mut b, mut g, mut f) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
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
                    g.push(ring_round(size, bytes, buffer, false)?);
                    f.push(ring_round(size, bytes, buffer, true)?);
                }
            }
            bar.inc(1);
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
        let fenced = median(&mut f).map(|d| mbit(bytes, d));
        let msgs = (bytes / size as u64) as f64;
        let geometry = slot_config(size, buffer);
        points.push(QueuePoint {
            size,
            mbit_s: mbit(bytes, ours),
            baseline_mbit_s: mbit(bytes, base),
            ratio: ratio(mbit(bytes, ours), mbit(bytes, base)),
            ring_mbit_s: ring,
            ring_ratio: ring.map(|r| ratio(mbit(bytes, ours), r)),
            fenced_ring_mbit_s: fenced,
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
            bar.suspend(|| {
                eprintln!(
                    "{:>6} bytes: stream {:>10.0} Mbit/s, slots {:>10.0} Mbit/s (baseline {:>10.0}{})",
                    size,
                    p.mbit_s,
                    p.slot_mbit_s,
                    p.baseline_mbit_s,
                    p.ring_mbit_s.map_or(String::new(), |r| format!(", ring {r:.0}"))
                )
            });
        }
    }
    bar.finish_and_clear();
    let peak_of = |f: fn(&QueuePoint) -> f64| {
        let peak = points.iter().map(f).fold(0.0, f64::max);
        (peak, points.iter().find(|p| f(p) >= peak / 2.0).map(|p| p.size))
    };
    let (peak, half) = peak_of(|p| p.mbit_s);
    let (slot_peak, slot_half) = peak_of(|p| p.slot_mbit_s);
    let fenced_half = points.iter().find(|p| p.fenced_ring_mbit_s.is_some_and(|f| f >= peak / 2.0)).map(|p| p.size);
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
        fenced_ring_half_peak_size: fenced_half,
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
                 (no tripwires, locks or checks); fenced: the same ring with one fence(SeqCst) after each \
                 publication, the least a writer whose stores may fire a tripwire needs (the arm/fire handshake)"
            );
        }
        let line = |l: String| println!("{}", l.trim_end());
        line(format!(
            "{:>8}  {:>23}  {:>29}  {:>12}  {:>6} {:>13} {:>6}",
            "",
            "byte stream",
            "slot message queue",
            "",
            "",
            if ring { "ring" } else { "" },
            if ring { "fenced" } else { "" }
        ));
        line(format!(
            "{:>8}  {:>10} {:>12}  {:>10} {:>12} {:>5}  {:>12}  {:>6} {:>6} {:>6} {:>6}",
            "size",
            "Mbit/s",
            "msg/s",
            "Mbit/s",
            "msg/s",
            "slot",
            r.baseline,
            "ratio",
            if ring { "Mbit/s" } else { "" },
            if ring { "ratio" } else { "" },
            if ring { "Mbit/s" } else { "" }
        ));
        for p in &r.points {
            line(format!(
                "{:>8}  {:>10.0} {:>12.0}  {:>10.0} {:>12.0} {:>5}  {:>12.0}  {:>6.2} {:>6} {:>6} {:>6}",
                p.size,
                p.mbit_s,
                p.msg_per_s,
                p.slot_mbit_s,
                p.slot_msg_per_s,
                p.slot_bytes,
                p.baseline_mbit_s,
                p.ratio,
                p.ring_mbit_s.map_or(String::new(), |g| format!("{g:.0}")),
                p.ring_ratio.map_or(String::new(), |g| format!("{g:.2}")),
                p.fenced_ring_mbit_s.map_or(String::new(), |g| format!("{g:.0}"))
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
        if ring {
            println!(
                "fenced ring: half of the byte stream's peak reached at {}",
                r.fenced_ring_half_peak_size.map_or("no measured size".into(), |s| format!("{s}-byte transfers"))
            );
        }
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueKind {
    /// The distributed queue's unstructured variant: a clan byte stream.
    Stream,
    /// The slot-based message queue.
    Slots,
    /// The slot-based message queue, sent in batches of [`BATCH`] (`MsgSender::send_batch`).
    Batch,
    /// A raw TCP stream (the baseline across hosts).
    Tcp,
}

/// What both sides of a queue run are told (with the host and CPU: [`OnHost`]).
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct QueuePeerArgs {
    size: usize,
    bytes: u64,
    buffer: u64,
    /// The NICs reach each other over links (test hosts), else by shared memory.
    link: bool,
    kind: QueueKind,
}

/// What both sides of the hand-written ring are told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct RingArgs {
    size: usize,
    bytes: u64,
    buffer: u64,
    /// The shared memfd, through `/proc`.
    path: String,
    cpu: usize,
    /// A `fence(SeqCst)` after each publication.
    fenced: bool,
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
    let common = || QueuePeerArgs { size, bytes, buffer, link: h.is_some(), kind };
    let spawn = |i: usize, role: Role| -> Result<PeerProc> {
        match h {
            Some(h) => h.spawn(i, role, common()),
            None => PeerProc::spawn(role, &OnHost { ip: Ipv4Addr::LOCALHOST.into(), cpu: i, args: common() }),
        }
    };
    let mut rx = spawn(1, Role::PqRecv)?;
    let addr = rx.recv()?;
    let mut tx = spawn(0, Role::PqSend)?;
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
/// publication, the read position mirrored every quarter), with a `fence(SeqCst)` after each
/// publication if `fenced`. Sender's time, as `queue_round`.
fn ring_round(size: usize, bytes: u64, buffer: u64, fenced: bool) -> Result<Duration> {
    let page = clan_shm::segment::page_size();
    let len = page + clan_shm::segment::page_align(buffer as usize);
    let memfd = clan_shm::memfd::Memfd::create("clan-bench-ring", len as u64)?;
    let path = format!("/proc/{}/fd/{}", std::process::id(), {
        use std::os::fd::{AsFd, AsRawFd};
        memfd.as_fd().as_raw_fd()
    });
    let spawn = |cpu: usize, role: Role| -> Result<PeerProc> {
        PeerProc::spawn(role, &RingArgs { size, bytes, buffer, path: path.clone(), cpu, fenced })
    };
    let mut rx = spawn(1, Role::PqRingRecv)?;
    if rx.recv()? != "ready" {
        return Err("ring receiver not ready".into());
    }
    let mut tx = spawn(0, Role::PqRingSend)?;
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
pub fn ring_peer(role: Role, a: RingArgs) -> Result<()> {
    use clan_shm::segment::{Access, Segment};
    use std::sync::atomic::{AtomicU64, Ordering};
    let RingArgs { size, bytes, buffer: cap, path, cpu, fenced } = a;
    sys::pin(cpu);
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
        Role::PqRingRecv => {
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
        Role::PqRingSend => {
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
                    if fenced {
                        // As a writer that fires tripwires: its stores, then a look at what
                        // is armed (here nothing is), ordered by this fence (no partner: the
                        // cost is what is measured).
                        std::sync::atomic::fence(Ordering::SeqCst);
                    }
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
        other => return Err(format!("not a role of bench queue: {other:?}").into()),
    }
    Ok(())
}

/// Peer roles of the queue benchmark: the same transfers over a clan stream with a small
/// ring, through the slot-based message queue, or over a raw TCP connection.
pub fn peer(role: Role, a: OnHost<QueuePeerArgs>) -> Result<()> {
    let OnHost { ip, cpu, args: QueuePeerArgs { size, bytes, buffer, link, kind } } = a;
    sys::pin(cpu);
    if matches!(kind, QueueKind::Slots | QueueKind::Batch) {
        return slot_peer(role, peer_nic(ip, link)?, size, bytes, buffer, kind == QueueKind::Batch);
    }
    let raw = kind == QueueKind::Tcp;
    let want = pattern(size);
    let n = bytes / size as u64;
    let warm = ((4 << 20) / size as u64).max(16);
    let cfg = StreamConfig { ring: buffer, post_area: 0, ..StreamConfig::default() };
    match role {
        Role::PqRecv => {
            let mut s = if raw {
                let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
                Link::say(l.local_addr()?);
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Tcp(s)
            } else {
                let nic = peer_nic(ip, link)?;
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
        Role::PqSend => {
            let to = Link::hear()?;
            let mut s = if raw {
                let s = TcpStream::connect(to.parse::<SocketAddr>()?)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(LIMIT))?;
                AnyStream::Tcp(s)
            } else {
                let nic = peer_nic(ip, link)?;
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
        other => return Err(format!("not a role of bench queue: {other:?}").into()),
    }
    Ok(())
}

/// The slot-queue variant of [`queue_peer`]: one message per transfer (its metadata word is
/// its number), copied out of the slot by the receiver. The acknowledgements go back through
/// a second, small message queue, whose address the sender sends as its first message.
fn slot_peer(role: Role, nic: clan::Nic, size: usize, bytes: u64, buffer: u64, batched: bool) -> Result<()> {
    let want = pattern(size);
    let n = bytes / size as u64;
    let warm = ((4 << 20) / size as u64).max(16);
    let cfg = slot_config(size, buffer);
    match role {
        Role::PqRecv => {
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
        Role::PqSend => {
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
        other => return Err(format!("not a role of bench queue: {other:?}").into()),
    }
    Ok(())
}
