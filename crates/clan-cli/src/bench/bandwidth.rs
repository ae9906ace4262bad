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

use std::collections::VecDeque;

use clan::{Aperture, DmaConfig, DmaOptions, DmaTicket, Endpoint, EndpointConfig, Mapping, Nic, NicConfig};
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio, timed_batches};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The CPU writes through the mapping.
    Pio,
    /// The NIC's DMA engine moves the data (the sender only posts requests).
    Dma,
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
    /// Message size (bytes; units accepted: 64KiB, 1MiB).
    #[arg(long, default_value = "32KiB", value_parser = sys::size_usize)]
    pub size: usize,
    /// Messages (default: 1 GiB worth, at least 1000).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, serde::Deserialize)]
pub struct BandwidthReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub mode: &'static str,
    pub size: usize,
    pub iters: u64,
    pub ring_bytes: usize,
    pub mbit_s: f64,
    pub msg_p50_ns: u64,
    pub msg_p99_ns: u64,
    pub baseline: &'static str,
    pub baseline_mbit_s: f64,
    pub baseline_msg_p50_ns: u64,
    pub ratio: f64,
    pub placement: String,
    pub machine: sys::Machine,
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
    let start = Instant::now();
    let samples = timed_batches(iters, batch, |i| put((i as usize % slots) * size))?;
    Ok((start.elapsed(), samples))
}

/// Requests kept in flight by the DMA sender.
pub const DMA_DEPTH: usize = 128;

/// Stream `iters` DMA writes of `size` bytes from `src` (offset 0) into a ring of `slots`
/// slots of `m`, keeping up to [`DMA_DEPTH`] requests in flight; returns the time from the first
/// post to the last completion, and samples of the sender's cost per post.
pub fn dma_stream(
    ep: &Endpoint,
    src: &Aperture,
    m: &Mapping,
    size: usize,
    iters: u64,
    slots: u64,
    spin: Duration,
) -> Result<(Duration, Samples)> {
    let mut inflight: VecDeque<DmaTicket> = VecDeque::with_capacity(DMA_DEPTH);
    let post = |i: u64| ep.dma_write(src, 0, m, (i % slots) * size as u64, size as u64, DmaOptions::new());
    // Warm up: one pass over the ring.
    for i in 0..slots {
        inflight.push_back(post(i)?);
        if inflight.len() >= DMA_DEPTH {
            inflight.pop_front().ok_or("empty")?.wait(Some(LIMIT))?;
        }
    }
    while let Some(t) = inflight.pop_front() {
        t.wait(Some(LIMIT))?;
    }
    let mut samples = Samples::new();
    let start = Instant::now();
    for i in 0..iters {
        let t0 = Instant::now();
        let t = post(i)?;
        if i % 16 == 0 {
            samples.record(t0.elapsed());
        }
        inflight.push_back(t);
        if inflight.len() >= DMA_DEPTH {
            // Wait for half the window at once (one wake-up per DMA_DEPTH/2 completions,
            // not one per request: the engine pays for each wake-up it has to make).
            inflight[DMA_DEPTH / 2].wait_spin(spin, Some(LIMIT))?;
            while inflight.front().is_some_and(DmaTicket::is_complete) {
                inflight.pop_front().ok_or("empty")?.wait(Some(LIMIT))?;
            }
        }
    }
    while let Some(t) = inflight.pop_front() {
        t.wait(Some(LIMIT))?;
    }
    Ok((start.elapsed(), samples))
}

const LIMIT: Duration = Duration::from_secs(60);

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

    // clan: PIO (this thread writes) or DMA (the engine, on the other CPU, copies) into the
    // peer's aperture.
    let nic = Nic::open(NicConfig { dma: DmaConfig { cpu: Some(1), ..DmaConfig::default() }, ..NicConfig::default() })?;
    let ep = nic.endpoint_with(EndpointConfig { dma_queue: DMA_DEPTH, ..EndpointConfig::default() })?;
    let mut peer = PeerProc::spawn(Role::BwClan, &ReceiverArgs { size: a.size, cpu: 1 })?;
    let m = ep.import(&peer.recv()?.parse()?)?;
    let (t, s) = match a.mode {
        Mode::Pio => run_ring(a.size, iters, |off| {
            m.write(off as u64, &src)?;
            Ok(())
        })?,
        Mode::Dma => {
            let src_ap = ep.export(a.size as u64)?;
            src_ap.write(0, &src)?;
            // The engine has a CPU of its own: waiting may spin.
            dma_stream(&ep, &src_ap, &m, a.size, iters, (ring / a.size) as u64, Duration::from_micros(20))?
        }
    };
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
        mode: mode_name(a.mode),
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
            "sender pinned to CPU {}, receiver process on CPU 1 (idle during the run){}",
            pinned.map_or("-".into(), |c| c.to_string()),
            if a.mode == Mode::Dma {
                format!(
                    "; DMA engine thread pinned to CPU 1, {DMA_DEPTH} requests in flight; per-message time is the sender's cost of posting"
                )
            } else {
                String::new()
            }
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench bandwidth: transport shm, mode {}, {} bytes × {} messages, ring {} KiB",
            r.mode,
            r.size,
            r.iters,
            ring >> 10
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "clan {} : {:>10.0} Mbit/s  (per message p50 {}, p99 {})",
            r.mode.to_uppercase(),
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
    // Throughput over veth swings between rounds (where the kernel happens to run the
    // receive path): many short alternating rounds average that out for both sides.
    let rounds = 8u32;
    let per = iters.div_ceil(u64::from(rounds));
    let (mut t, mut bt) = (Duration::ZERO, Duration::ZERO);
    let (mut s, mut bs) = (Samples::new(), Samples::new());
    let round_bytes = per * a.size as u64;
    for r in 0..rounds {
        let (d, x) = super::tcp::raw_stream(&hosts, a.size, per)?;
        bt += d;
        bs.merge(&x);
        let (d2, x) = super::tcp::clan_stream(&hosts, a.size, per, a.mode)?;
        t += d2;
        s.merge(&x);
        if !a.json {
            eprintln!(
                "round {}: clan {:.0} Mbit/s, raw TCP stream {:.0} Mbit/s",
                r + 1,
                mbit(round_bytes, d2),
                mbit(round_bytes, d)
            );
        }
    }
    let bytes = per * u64::from(rounds) * a.size as u64;
    let r = BandwidthReport {
        bench: "bandwidth",
        transport: "tcp",
        mode: mode_name(a.mode),
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
            "{}; sender on CPU 0{}, receiver (and its NIC's engine) on CPU 1; {rounds} alternating rounds",
            hosts.describe(),
            if a.mode == Mode::Dma { " with its DMA engine thread" } else { "" }
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!("clan bench bandwidth: transport tcp, mode {}, {} bytes × {} messages", r.mode, r.size, r.iters);
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "clan {} over a link: {:>10.0} Mbit/s  (per message p50 {})",
            r.mode.to_uppercase(),
            r.mbit_s,
            ns(r.msg_p50_ns)
        );
        println!(
            "raw TCP stream      : {:>10.0} Mbit/s  (per message p50 {})",
            r.baseline_mbit_s,
            ns(r.baseline_msg_p50_ns)
        );
        println!("ratio clan/tcp-stream: {:.2}", r.ratio);
    });
    Ok(())
}

/// What the receiving peer is told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ReceiverArgs {
    size: usize,
    cpu: usize,
}

/// The receiving peer.
pub fn peer(a: ReceiverArgs) -> Result<()> {
    let size = a.size;
    sys::pin(a.cpu);
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

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Pio => "pio",
        Mode::Dma => "dma",
    }
}
