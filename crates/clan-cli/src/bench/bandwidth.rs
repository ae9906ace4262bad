//! `clan bench bandwidth`: one-way bandwidth of programmed I/O into another process's
//! aperture, against `memcpy` of the same sizes over a buffer of the same size in the same
//! run.
//!
//! The sender writes `size`-byte messages back to back into a ring of slots at the start of
//! the receiver's aperture (through a mapping: bounds, rights, revocation and tripwire checks
//! included), then one sequence word after the ring; the receiver checks the sequence word
//! and the last message. The baseline copies the same messages into a private ring of the
//! same size. Both rings are page-aligned, so both copies have the same alignment.

use std::time::{Duration, Instant};

use clan::{Nic, NicConfig};
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, arg};
use crate::sys;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The CPU writes through the mapping.
    Pio,
}

/// Arguments of `clan bench bandwidth`.
#[derive(clap::Args, Debug, Clone)]
pub struct BandwidthArgs {
    /// Where the peers are.
    #[arg(long, value_enum, default_value_t = super::latency::Transport::Shm)]
    pub transport: super::latency::Transport,
    /// Who moves the data.
    #[arg(long, value_enum, default_value_t = Mode::Pio)]
    pub mode: Mode,
    /// Message size in bytes.
    #[arg(long, default_value_t = 32768)]
    pub size: usize,
    /// Messages (default: 1 GiB worth, at least 1000).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct BandwidthReport {
    bench: &'static str,
    transport: &'static str,
    mode: &'static str,
    size: usize,
    iters: u64,
    ring_bytes: usize,
    mbit_s: f64,
    msg_p50_ns: u64,
    msg_p99_ns: u64,
    baseline: &'static str,
    baseline_mbit_s: f64,
    baseline_msg_p50_ns: u64,
    ratio: f64,
    placement: String,
    machine: sys::Machine,
}

fn ring_bytes(size: usize) -> usize {
    let slots = ((1usize << 20) / size.max(1)).max(4);
    slots * size
}

fn mbit(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64() / 1e6
}

/// Time `iters` messages written by `put(offset)` into a ring, in batches: returns the
/// total time and per-message samples.
fn run_ring(size: usize, iters: u64, mut put: impl FnMut(usize) -> Result<()>) -> Result<(Duration, Samples)> {
    let ring = ring_bytes(size);
    let slots = ring / size;
    // Warm the ring up: one pass.
    for s in 0..slots {
        put(s * size)?;
    }
    let batch = ((64 << 10) / size).clamp(1, 1024) as u64;
    let mut samples = Samples::new();
    let start = Instant::now();
    let mut i = 0u64;
    while i < iters {
        let n = batch.min(iters - i);
        let t0 = Instant::now();
        for k in 0..n {
            put(((i + k) as usize % slots) * size)?;
        }
        let per = t0.elapsed() / n as u32;
        for _ in 0..n.min(16) {
            samples.record(per);
        }
        i += n;
    }
    Ok((start.elapsed(), samples))
}

pub fn run(a: &BandwidthArgs) -> Result<()> {
    if a.size == 0 {
        return Err("--size must be positive".into());
    }
    if a.transport == super::latency::Transport::Tcp {
        return run_tcp(a);
    }
    let iters = a.iters.unwrap_or(((1u64 << 30) / a.size as u64).max(1000));
    let pinned = sys::pin(0);
    let ring = ring_bytes(a.size);
    let src: Vec<u8> = (0..a.size).map(|i| (i * 7 + 3) as u8).collect();

    // Baseline: memcpy into a private ring of the same size.
    // (page-aligned like an aperture: malloc'd memory is only 16-byte aligned)
    let mut buf = vec![0u8; ring + 4096];
    let base = buf.as_ptr().align_offset(4096).min(4096);
    let dst = &mut buf[base..base + ring];
    let (base_t, base_s) = run_ring(a.size, iters, |off| {
        dst[off..off + a.size].copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut *dst);
        Ok(())
    })?;

    // clan: PIO into the peer's aperture.
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    let mut peer = PeerProc::spawn("bw-clan", &[format!("size={}", a.size), "cpu=1".to_string()])?;
    let m = ep.import(&peer.recv()?.parse()?)?;
    let (t, s) = run_ring(a.size, iters, |off| {
        m.write(off as u64, &src)?;
        Ok(())
    })?;
    m.store_u64(ring as u64, iters)?;
    peer.send(format!("check {iters}"))?;
    let verdict = peer.recv()?;
    if verdict != "ok" {
        return Err(format!("receiver found bad data: {verdict}").into());
    }
    peer.finish()?;

    let bytes = iters * a.size as u64;
    let r = BandwidthReport {
        bench: "bandwidth",
        transport: "shm",
        mode: "pio",
        size: a.size,
        iters,
        ring_bytes: ring,
        mbit_s: mbit(bytes, t),
        msg_p50_ns: s.p(0.5),
        msg_p99_ns: s.p(0.99),
        baseline: "memcpy",
        baseline_mbit_s: mbit(bytes, base_t),
        baseline_msg_p50_ns: base_s.p(0.5),
        ratio: ratio(mbit(bytes, t), mbit(bytes, base_t)),
        placement: format!(
            "sender pinned to CPU {}, receiver process on CPU 1 (idle during the run)",
            pinned.map_or("-".into(), |c| c.to_string())
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench bandwidth: transport shm, mode pio, {} bytes × {} messages, ring {} KiB",
            r.size,
            r.iters,
            ring >> 10
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "clan PIO : {:>10.0} Mbit/s  (per message p50 {}, p99 {})",
            r.mbit_s,
            ns(r.msg_p50_ns),
            ns(r.msg_p99_ns)
        );
        println!("memcpy   : {:>10.0} Mbit/s  (per message p50 {})", r.baseline_mbit_s, ns(r.baseline_msg_p50_ns));
        println!("ratio clan/memcpy: {:.2}", r.ratio);
    });
    Ok(())
}

/// `--transport tcp`: PIO bursts over a link against a raw TCP stream, in alternating rounds.
fn run_tcp(a: &BandwidthArgs) -> Result<()> {
    let iters = a.iters.unwrap_or(((512u64 << 20) / a.size as u64).max(1000));
    let hosts = super::tcp::Hosts::new();
    let rounds = 3u32;
    let per = iters.div_ceil(u64::from(rounds));
    let (mut t, mut bt) = (Duration::ZERO, Duration::ZERO);
    let (mut s, mut bs) = (Samples::new(), Samples::new());
    for _ in 0..rounds {
        let (d, x) = super::tcp::raw_stream(&hosts, a.size, per)?;
        bt += d;
        bs.merge(&x);
        let (d, x) = super::tcp::clan_stream(&hosts, a.size, per)?;
        t += d;
        s.merge(&x);
    }
    let bytes = per * u64::from(rounds) * a.size as u64;
    let r = BandwidthReport {
        bench: "bandwidth",
        transport: "tcp",
        mode: "pio",
        size: a.size,
        iters: per * u64::from(rounds),
        ring_bytes: 0,
        mbit_s: mbit(bytes, t),
        msg_p50_ns: s.p(0.5),
        msg_p99_ns: s.p(0.99),
        baseline: "tcp-stream",
        baseline_mbit_s: mbit(bytes, bt),
        baseline_msg_p50_ns: bs.p(0.5),
        ratio: ratio(mbit(bytes, t), mbit(bytes, bt)),
        placement: format!(
            "{}; sender on CPU 0, receiver (and its NIC's engine) on CPU 1; {rounds} alternating rounds",
            hosts.describe()
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!("clan bench bandwidth: transport tcp, mode pio, {} bytes × {} messages", r.size, r.iters);
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!("clan PIO over a link: {:>10.0} Mbit/s  (per message p50 {})", r.mbit_s, ns(r.msg_p50_ns));
        println!(
            "raw TCP stream      : {:>10.0} Mbit/s  (per message p50 {})",
            r.baseline_mbit_s,
            ns(r.baseline_msg_p50_ns)
        );
        println!("ratio clan/tcp-stream: {:.2}", r.ratio);
    });
    Ok(())
}

/// The receiving peer.
pub fn peer(role: &str, args: &[String]) -> Result<()> {
    if role != "bw-clan" {
        return Err(format!("unknown role {role}").into());
    }
    let size: usize = arg(args, "size")?;
    sys::pin(arg(args, "cpu")?);
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    let ring = ring_bytes(size);
    let ap = ep.export(ring as u64 + 8)?;
    Link::say(ap.descriptor());
    let line = Link::hear()?;
    let iters: u64 = line.strip_prefix("check ").ok_or("expected check")?.parse()?;
    let seq = ap.load_u64(ring as u64)?;
    let slots = ring / size;
    let last = ((iters - 1) as usize % slots) * size;
    let mut got = vec![0u8; size];
    ap.read(last as u64, &mut got)?;
    let ok = seq == iters && got.iter().enumerate().all(|(i, &b)| b == (i * 7 + 3) as u8);
    Link::say(if ok { "ok".to_string() } else { format!("seq {seq}, expected {iters}") });
    let _ = Link::hear();
    Ok(())
}
