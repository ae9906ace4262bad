//! `clan bench vmmc`: the VMMC figures (Myrinet paper §5.3, NT paper §5) between two
//! processes of this host, each with its baseline measured in the same run:
//!
//! - one-way latency of `send_msg` (ping-pong / 2, receivers poll memory: VMMC has no
//!   receive operation) against a raw shared-memory ping-pong;
//! - one-way bandwidth of `send_msg`, synchronous and asynchronous, against `memcpy` into a
//!   ring of the same size;
//! - the sender's overhead of a synchronous and of an asynchronous send (figure 4), and the
//!   overhead of both transfer methods, which is where the inline threshold comes from;
//! - `fetch` latency and bandwidth against `memcpy`;
//! - notification overhead (ping-pong / 2 with notifications, the receiver waiting for its
//!   buffer's notification, and with a handler replying) against a Unix socketpair;
//! - export and import cost against the raw system calls.
//!
//! Placement: this process on CPU 0, the peer process on CPU 1; this process's DMA engine on
//! CPU 1 (the peer is idle while bandwidth is measured).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use clan::{DmaConfig, Nic, NicConfig};
use clan_proto::vmmc::{
    DEFAULT_INLINE_MAX, ExportOptions, ExportedBuffer, ImportedBuffer, Notification, Notify, SendBuffer, SendFlags,
    SendHandle, Vmmc, VmmcConfig,
};
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);
/// The peer's receive buffer: a ring for the bandwidth runs, flags at the start.
const RING: u64 = 8 << 20;
const FLAG: u64 = 0;
const DATA: u64 = 4096;
const BUF: u64 = DATA + RING;

/// Arguments of `clan bench vmmc`.
#[derive(clap::Args, Debug, Clone)]
pub struct VmmcArgs {
    /// Round trips per latency point.
    #[arg(long, default_value_t = 20_000)]
    pub iters: u64,
    /// Bytes moved per bandwidth point.
    #[arg(long, default_value = "256MiB", value_parser = sys::size)]
    pub bytes: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, serde::Deserialize, Debug, Default)]
pub struct LatencyPoint {
    pub size: u64,
    pub one_way_p50_ns: u64,
    pub one_way_p99_ns: u64,
    pub baseline_one_way_p50_ns: u64,
    pub ratio: f64,
}

#[derive(Serialize, serde::Deserialize, Debug, Default)]
pub struct BandwidthPoint {
    pub size: u64,
    pub sync_mbit_s: f64,
    pub async_mbit_s: f64,
    pub baseline_mbit_s: f64,
    /// The sender's cost of one call (p50).
    pub sync_overhead_p50_ns: u64,
    pub async_overhead_p50_ns: u64,
    /// Asynchronous overhead with each method forced (the threshold's evidence).
    pub pio_overhead_p50_ns: u64,
    pub dma_overhead_p50_ns: u64,
    pub method: &'static str,
}

#[derive(Serialize, serde::Deserialize, Debug, Default)]
pub struct FetchPoint {
    pub size: u64,
    pub latency_p50_ns: u64,
    pub mbit_s: f64,
    pub baseline_memcpy_p50_ns: u64,
    pub baseline_mbit_s: f64,
}

#[derive(Serialize, serde::Deserialize, Debug, Default)]
pub struct NotifyReport {
    pub wait_one_way_p50_ns: u64,
    pub wait_one_way_p99_ns: u64,
    pub handler_one_way_p50_ns: u64,
    pub handler_one_way_p99_ns: u64,
    /// Both sides sleep at once (no spinning), as the Unix baseline does.
    pub sleep_one_way_p50_ns: u64,
    pub sleep_one_way_p99_ns: u64,
    pub baseline: &'static str,
    pub baseline_one_way_p50_ns: u64,
    pub baseline_one_way_p99_ns: u64,
    pub ratio: f64,
}

#[derive(Serialize, serde::Deserialize, Debug, Default)]
pub struct SetupReport {
    pub export_4k_fresh_ns: u64,
    pub export_4k_cached_ns: u64,
    pub export_1m_fresh_ns: u64,
    pub export_1m_cached_ns: u64,
    pub baseline_memfd_mmap_4k_ns: u64,
    pub baseline_memfd_mmap_1m_ns: u64,
    pub import_local_ns: u64,
    pub import_cross_process_ns: u64,
    pub baseline_unix_rtt_ns: u64,
}

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct VmmcReport {
    pub bench: &'static str,
    pub inline_max: u64,
    pub crossover_bytes: Option<u64>,
    pub latency: Vec<LatencyPoint>,
    pub bandwidth: Vec<BandwidthPoint>,
    pub fetch: Vec<FetchPoint>,
    pub notification: NotifyReport,
    pub setup: SetupReport,
    pub placement: String,
    pub machine: sys::Machine,
}

/// This process's side.
struct Me {
    v: Vmmc,
    /// Our receive buffer (replies and notifications land here).
    buf: ExportedBuffer,
    src: SendBuffer,
    peer_buf: ImportedBuffer,
    peer_handler: ImportedBuffer,
    /// A second instance that never spins: its waits sleep at once.
    sleeper: Vmmc,
    sleeper_buf: ExportedBuffer,
    peer_sleeper: ImportedBuffer,
    peer: PeerProc,
}

fn nic() -> Result<Nic> {
    Ok(Nic::open(NicConfig { dma: DmaConfig { cpu: Some(1), ..DmaConfig::default() }, ..NicConfig::default() })?)
}

fn spin_word(buf: &ExportedBuffer, off: u64, v: u64) -> Result<()> {
    let start = Instant::now();
    let mut n = 0u32;
    while buf.load_u64(off)? != v {
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n % 4096 == 0 && start.elapsed() > LIMIT {
            return Err("peer stopped answering".into());
        }
    }
    Ok(())
}

fn setup(v: Vmmc) -> Result<Me> {
    let buf = v.export(BUF, ExportOptions { notify: Notify::Wait, ..ExportOptions::default() })?;
    let src = v.send_buffer(RING)?;
    let sleeper = Vmmc::with_config(&nic()?, VmmcConfig { spin: Duration::ZERO, ..VmmcConfig::default() })?;
    let sleeper_buf = sleeper.export(4096, ExportOptions { notify: Notify::Wait, ..ExportOptions::default() })?;
    let mut peer = PeerProc::spawn(Role::VmmcPeer, &PeerArgs { cpu: 1 })?;
    peer.send(buf.descriptor())?;
    peer.send(sleeper_buf.descriptor())?;
    let peer_buf = v.import(&peer.recv()?.parse()?)?;
    let peer_handler = v.import(&peer.recv()?.parse()?)?;
    let peer_sleeper = sleeper.import(&peer.recv()?.parse()?)?;
    Ok(Me { v, buf, src, peer_buf, peer_handler, sleeper, sleeper_buf, peer_sleeper, peer })
}

pub fn run(a: &VmmcArgs) -> Result<()> {
    let pinned = sys::pin(0);
    let mut me = setup(Vmmc::new(&nic()?)?)?;
    let warm = (a.iters / 10).max(100);

    // ---- latency -------------------------------------------------------------------------
    let mut latency = Vec::new();
    for size in [8u64, 64, 512, 4096] {
        let s = pingpong(&mut me, size, a.iters, warm)?;
        let b = super::latency::raw_shm(size as usize, a.iters + warm, warm, 1)?;
        latency.push(LatencyPoint {
            size,
            one_way_p50_ns: s.p(0.5) / 2,
            one_way_p99_ns: s.p(0.99) / 2,
            baseline_one_way_p50_ns: b.p(0.5) / 2,
            ratio: ratio(s.p(0.5) as f64, b.p(0.5) as f64),
        });
    }

    // ---- bandwidth and overhead ----------------------------------------------------------
    let pio = Vmmc::with_config(&nic()?, VmmcConfig { inline_max: u64::MAX, ..VmmcConfig::default() })?;
    let dma = Vmmc::with_config(&nic()?, VmmcConfig { inline_max: 0, ..VmmcConfig::default() })?;
    let (pio_dst, dma_dst) =
        (pio.import(me.peer_buf.mapping().descriptor())?, dma.import(me.peer_buf.mapping().descriptor())?);
    let (pio_src, dma_src) = (pio.send_buffer(RING)?, dma.send_buffer(RING)?);
    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    for b in [&me.src, &pio_src, &dma_src] {
        b.write(0, &pattern)?;
    }
    let mut bandwidth = Vec::new();
    for size in [64u64, 1024, 4096, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20] {
        let n = (a.bytes / size).clamp(64, 1 << 20);
        let (sync_t, sync_s) = stream(&me.v, &me.src, &me.peer_buf, size, n, false)?;
        let (async_t, async_s) = stream(&me.v, &me.src, &me.peer_buf, size, n, true)?;
        check_ring(&mut me, size, n)?;
        let (_, pio_s) = stream(&pio, &pio_src, &pio_dst, size, n.min(20_000), true)?;
        let (_, dma_s) = stream(&dma, &dma_src, &dma_dst, size, n.min(20_000), true)?;
        let base_t = memcpy_ring(size, n);
        let bytes = size * n;
        bandwidth.push(BandwidthPoint {
            size,
            sync_mbit_s: mbit(bytes, sync_t),
            async_mbit_s: mbit(bytes, async_t),
            baseline_mbit_s: mbit(bytes, base_t),
            sync_overhead_p50_ns: sync_s.p(0.5),
            async_overhead_p50_ns: async_s.p(0.5),
            pio_overhead_p50_ns: pio_s.p(0.5),
            dma_overhead_p50_ns: dma_s.p(0.5),
            method: if size <= DEFAULT_INLINE_MAX { "inline (PIO)" } else { "DMA" },
        });
    }
    let crossover_bytes = bandwidth.iter().find(|p| p.dma_overhead_p50_ns < p.pio_overhead_p50_ns).map(|p| p.size);

    // ---- fetch ---------------------------------------------------------------------------
    let mut fetch = Vec::new();
    let dst = me.v.send_buffer(RING)?;
    for size in [8u64, 64, 4096, 64 << 10, 1 << 20] {
        let n = (a.bytes / size).clamp(64, 200_000).min(a.iters);
        let mut s = Samples::new();
        for i in 0..n {
            let off = (i * size) % RING;
            let t0 = Instant::now();
            me.v.fetch(&me.peer_buf, DATA + off, &dst, off, size)?;
            s.record(t0.elapsed());
        }
        let nb = (a.bytes / size).clamp(64, 1 << 20);
        let t0 = Instant::now();
        let mut inflight = VecDeque::new();
        for i in 0..nb {
            let off = (i * size) % (RING - size + 1);
            inflight.push_back(me.v.fetch_async(&me.peer_buf, DATA + off, &dst, off, size)?);
            if inflight.len() >= 64 {
                if let Some(h) = inflight.pop_front() {
                    h.wait(Some(LIMIT))?;
                }
            }
        }
        for h in inflight {
            h.wait(Some(LIMIT))?;
        }
        let t = t0.elapsed();
        let (base_one, base_t) = memcpy_stats(size, nb);
        fetch.push(FetchPoint {
            size,
            latency_p50_ns: s.p(0.5),
            mbit_s: mbit(size * nb, t),
            baseline_memcpy_p50_ns: base_one,
            baseline_mbit_s: mbit(size * nb, base_t),
        });
    }

    // ---- notifications -------------------------------------------------------------------
    let wait = notify_pingpong(&mut me, a.iters, warm, Flavour::Wait)?;
    let handler = notify_pingpong(&mut me, a.iters, warm, Flavour::Handler)?;
    let sleeping = notify_pingpong(&mut me, a.iters / 4, warm / 4, Flavour::Sleep)?;
    let unix = super::latency::unix(8, a.iters + warm, warm, 1)?;
    let notification = NotifyReport {
        wait_one_way_p50_ns: wait.p(0.5) / 2,
        wait_one_way_p99_ns: wait.p(0.99) / 2,
        handler_one_way_p50_ns: handler.p(0.5) / 2,
        handler_one_way_p99_ns: handler.p(0.99) / 2,
        sleep_one_way_p50_ns: sleeping.p(0.5) / 2,
        sleep_one_way_p99_ns: sleeping.p(0.99) / 2,
        baseline: "unix",
        baseline_one_way_p50_ns: unix.p(0.5) / 2,
        baseline_one_way_p99_ns: unix.p(0.99) / 2,
        ratio: ratio(wait.p(0.5) as f64, unix.p(0.5) as f64),
    };

    // ---- setup costs ---------------------------------------------------------------------
    let setup = setup_costs(&mut me, a.iters.min(2000))?;
    me.peer.send("quit")?;
    let Me { peer, .. } = me;
    peer.finish()?;

    let r = VmmcReport {
        bench: "vmmc",
        inline_max: DEFAULT_INLINE_MAX,
        crossover_bytes,
        latency,
        bandwidth,
        fetch,
        notification,
        setup,
        placement: format!(
            "sender pinned to CPU {}, peer process on CPU 1, the sender's DMA engine on CPU 1; receivers poll memory \
             for latency, wait (spin 15 µs, then sleep) for notifications; the Unix baseline blocks in read",
            pinned.map_or("-".into(), |c| c.to_string())
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || print_report(&r));
    Ok(())
}

fn print_report(r: &VmmcReport) {
    println!("clan bench vmmc: two processes of this host");
    println!("placement: {}", r.placement);
    println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
    println!();
    println!("send_msg one-way latency (ping-pong / 2)        [paper: 9.8 µs for one word]");
    println!("{:>8}  {:>10} {:>10}  {:>14}  {:>6}", "size", "p50", "p99", "shm-raw p50", "ratio");
    for p in &r.latency {
        println!(
            "{:>8}  {:>10} {:>10}  {:>14}  {:>6.2}",
            p.size,
            ns(p.one_way_p50_ns),
            ns(p.one_way_p99_ns),
            ns(p.baseline_one_way_p50_ns),
            p.ratio
        );
    }
    println!();
    println!("send_msg one-way bandwidth and sender overhead [paper: 108.4 MB/s, 98 % of the hardware]");
    println!(
        "{:>8}  {:>12} {:>12} {:>12}  {:>10} {:>10}  {:>10} {:>10}  method",
        "size", "sync Mbit/s", "async Mbit/s", "memcpy", "sync ovh", "async ovh", "PIO ovh", "DMA ovh"
    );
    for p in &r.bandwidth {
        println!(
            "{:>8}  {:>12.0} {:>12.0} {:>12.0}  {:>10} {:>10}  {:>10} {:>10}  {}",
            p.size,
            p.sync_mbit_s,
            p.async_mbit_s,
            p.baseline_mbit_s,
            ns(p.sync_overhead_p50_ns),
            ns(p.async_overhead_p50_ns),
            ns(p.pio_overhead_p50_ns),
            ns(p.dma_overhead_p50_ns),
            p.method
        );
    }
    println!(
        "inline threshold: {} bytes; the asynchronous DMA overhead falls below the PIO one at {} (figure 4)",
        r.inline_max,
        r.crossover_bytes.map_or("no measured size".into(), |b| format!("{b} bytes"))
    );
    println!();
    println!("fetch (remote read into local memory)           [NT paper figures 7 and 8]");
    println!("{:>8}  {:>12} {:>14}  {:>12} {:>12}", "size", "latency p50", "memcpy p50", "Mbit/s", "memcpy");
    for p in &r.fetch {
        println!(
            "{:>8}  {:>12} {:>14}  {:>12.0} {:>12.0}",
            p.size,
            ns(p.latency_p50_ns),
            ns(p.baseline_memcpy_p50_ns),
            p.mbit_s,
            p.baseline_mbit_s
        );
    }
    println!();
    let n = &r.notification;
    println!("notification overhead, one way (ping-pong / 2)  [paper: 30 µs Linux, 52 µs NT]");
    println!("  wait on the buffer : p50 {}, p99 {}", ns(n.wait_one_way_p50_ns), ns(n.wait_one_way_p99_ns));
    println!("  handler thread     : p50 {}, p99 {}", ns(n.handler_one_way_p50_ns), ns(n.handler_one_way_p99_ns));
    println!("  wait, no spinning  : p50 {}, p99 {}", ns(n.sleep_one_way_p50_ns), ns(n.sleep_one_way_p99_ns));
    println!("  unix socketpair    : p50 {}, p99 {}", ns(n.baseline_one_way_p50_ns), ns(n.baseline_one_way_p99_ns));
    println!("  ratio wait/unix    : {:.2}", n.ratio);
    println!();
    let s = &r.setup;
    println!("setup                                           [NT paper: export 43 µs, import 68 µs]");
    println!(
        "  export 4 KiB : fresh {}, from the endpoint cache {}  (memfd+mmap {})",
        ns(s.export_4k_fresh_ns),
        ns(s.export_4k_cached_ns),
        ns(s.baseline_memfd_mmap_4k_ns)
    );
    println!(
        "  export 1 MiB : fresh {}, from the endpoint cache {}  (memfd+mmap {})",
        ns(s.export_1m_fresh_ns),
        ns(s.export_1m_cached_ns),
        ns(s.baseline_memfd_mmap_1m_ns)
    );
    println!(
        "  import       : same process {}, another process {}  (unix request/response {})",
        ns(s.import_local_ns),
        ns(s.import_cross_process_ns),
        ns(s.baseline_unix_rtt_ns)
    );
}

fn mbit(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64().max(1e-9) / 1e6
}

/// Ping-pong of `size`-byte messages: payload, then the sequence word (two sends when
/// `size` > 8, as the raw baseline stores its payload and then its flag).
fn pingpong(me: &mut Me, size: u64, iters: u64, warm: u64) -> Result<Samples> {
    me.buf.store_u64(FLAG, 0)?;
    me.peer.send(format!("lat {size} {}", iters + warm))?;
    me.peer.recv()?;
    let payload = vec![0x5au8; size.saturating_sub(8) as usize];
    me.src.write(0, &payload)?;
    let mut s = Samples::new();
    for i in 1..=iters + warm {
        let t0 = Instant::now();
        if size > 8 {
            me.v.send_msg(&me.src, 0, &me.peer_buf, DATA, size - 8, SendFlags::default())?;
        }
        me.v.send_bytes(&i.to_le_bytes(), &me.peer_buf, FLAG, SendFlags::default())?;
        spin_word(&me.buf, FLAG, i)?;
        if i > warm {
            s.record(t0.elapsed());
        }
    }
    me.peer.recv()?;
    Ok(s)
}

/// Stream `n` sends of `size` bytes into the peer's ring: returns the time and the
/// sender's cost per call.
fn stream(
    v: &Vmmc,
    src: &SendBuffer,
    dst: &ImportedBuffer,
    size: u64,
    n: u64,
    asynchronous: bool,
) -> Result<(Duration, Samples)> {
    let slots = (RING / size).max(1);
    let mut s = Samples::new();
    let mut inflight: VecDeque<SendHandle> = VecDeque::new();
    let start = Instant::now();
    for i in 0..n {
        let off = DATA + (i % slots) * size;
        // One source message, as the memcpy baseline copies one (it is never overwritten).
        let from = 0;
        let t0 = Instant::now();
        if asynchronous {
            let h = v.send_msg_async(src, from, dst, off, size, SendFlags::default())?;
            let dt = t0.elapsed();
            inflight.push_back(h);
            if inflight.len() >= 128 {
                inflight[64].wait(Some(LIMIT))?;
                while inflight.front().is_some_and(SendHandle::is_complete) {
                    inflight.pop_front();
                }
            }
            s.record(dt);
        } else {
            v.send_msg(src, from, dst, off, size, SendFlags::default())?;
            s.record(t0.elapsed());
        }
    }
    for h in inflight {
        h.wait(Some(LIMIT))?;
    }
    Ok((start.elapsed(), s))
}

/// The peer checks the last message of a stream (source slot contents are what we wrote).
fn check_ring(me: &mut Me, size: u64, n: u64) -> Result<()> {
    let slots = (RING / size).max(1);
    let last = n - 1;
    let off = DATA + (last % slots) * size;
    let from = 0;
    let mut want = vec![0u8; size as usize];
    me.src.read(from, &mut want)?;
    me.peer.send(format!("sum {off} {size}"))?;
    let got: u64 = me.peer.recv()?.parse()?;
    if got != checksum(&want) {
        return Err(format!("the peer's ring holds other bytes than were sent ({size}-byte messages)").into());
    }
    Ok(())
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// `memcpy` of `n` messages of `size` bytes into a private ring of the same size.
fn memcpy_ring(size: u64, n: u64) -> Duration {
    memcpy_stats(size, n).1
}

fn memcpy_stats(size: u64, n: u64) -> (u64, Duration) {
    let src = vec![0x5au8; size as usize];
    let mut ring = vec![0u8; (RING + 4096) as usize];
    let base = ring.as_ptr().align_offset(4096).min(4096);
    let slots = (RING / size).max(1);
    let mut s = Samples::new();
    let start = Instant::now();
    for i in 0..n {
        let off = base + ((i % slots) * size) as usize;
        let t0 = Instant::now();
        ring[off..off + size as usize].copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut ring);
        if i % 16 == 0 {
            s.record(t0.elapsed());
        }
    }
    (s.p(0.5), start.elapsed())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavour {
    /// The peer's thread waits for its buffer's notification (spinning first).
    Wait,
    /// The peer's handler answers.
    Handler,
    /// Both sides wait without spinning.
    Sleep,
}

/// Ping-pong of notified 8-byte messages: we wait for our buffer's notification; the peer
/// answers from its waiting thread, or from a handler.
fn notify_pingpong(me: &mut Me, iters: u64, warm: u64, how: Flavour) -> Result<Samples> {
    let (v, mine, dst, cmd) = match how {
        Flavour::Wait => (&me.v, &me.buf, &me.peer_buf, "notify"),
        Flavour::Handler => (&me.v, &me.buf, &me.peer_handler, "notify-handler"),
        Flavour::Sleep => (&me.sleeper, &me.sleeper_buf, &me.peer_sleeper, "notify-sleep"),
    };
    while mine.try_notification()?.is_some() {}
    me.peer.send(format!("{cmd} {}", iters + warm))?;
    me.peer.recv()?;
    let mut s = Samples::new();
    for i in 1..=iters + warm {
        let t0 = Instant::now();
        v.send_bytes(&i.to_le_bytes(), dst, FLAG, SendFlags::notify())?;
        match mine.wait_notification(Some(LIMIT))? {
            Notification::Landed { .. } => {}
            Notification::Lost => return Err("notifications were lost".into()),
        }
        if i > warm {
            s.record(t0.elapsed());
        }
    }
    me.peer.recv()?;
    Ok(s)
}

fn setup_costs(me: &mut Me, n: u64) -> Result<SetupReport> {
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<u64> {
        let mut s = Samples::new();
        for _ in 0..n {
            let t0 = Instant::now();
            f()?;
            s.record(t0.elapsed());
        }
        Ok(s.p(0.5))
    };
    // Fresh memory each time: keep them all (nothing returns to the endpoint cache).
    let fresh = |len: u64| -> Result<u64> {
        let nic = Nic::open(NicConfig { cache_bytes: 0, ..NicConfig::default() })?;
        let v = Vmmc::new(&nic)?;
        let mut keep = Vec::new();
        let mut s = Samples::new();
        for _ in 0..n.min(500) {
            let t0 = Instant::now();
            keep.push(v.export(len, ExportOptions::default())?);
            s.record(t0.elapsed());
        }
        Ok(s.p(0.5))
    };
    let export_4k_fresh_ns = fresh(4096)?;
    let export_1m_fresh_ns = fresh(1 << 20)?;
    let v = Vmmc::new(&nic()?)?;
    let export_4k_cached_ns = time(&mut || {
        v.export(4096, ExportOptions::default())?;
        Ok(())
    })?;
    let export_1m_cached_ns = time(&mut || {
        v.export(1 << 20, ExportOptions::default())?;
        Ok(())
    })?;
    let raw = |len: usize| -> Result<u64> {
        let mut s = Samples::new();
        for _ in 0..n.min(500) {
            let t0 = Instant::now();
            let fd = clan_shm::memfd::Memfd::create("clan-bench", len as u64)?;
            let seg = clan_shm::segment::Segment::map(&fd, 0, len, clan_shm::segment::Access::ReadWrite)?;
            std::hint::black_box(&seg);
            s.record(t0.elapsed());
        }
        Ok(s.p(0.5))
    };
    let baseline_memfd_mmap_4k_ns = raw(4096)?;
    let baseline_memfd_mmap_1m_ns = raw(1 << 20)?;
    let local = v.export(4096, ExportOptions::default())?;
    let other = Vmmc::new(&nic()?)?;
    let d = local.descriptor();
    let import_local_ns = time(&mut || {
        other.import(&d)?;
        Ok(())
    })?;
    let k = n.min(500);
    me.peer.send(format!("export-many {k}"))?;
    let descs: Vec<clan::Descriptor> =
        me.peer.recv()?.split_whitespace().map(str::parse).collect::<std::result::Result<_, _>>()?;
    let mut s = Samples::new();
    let mut keep = Vec::new();
    for d in &descs {
        let t0 = Instant::now();
        keep.push(me.v.import(d)?);
        s.record(t0.elapsed());
    }
    drop(keep);
    me.peer.send("drop")?;
    me.peer.recv()?;
    let unix = super::latency::unix(8, k + 10, 10, 1)?;
    Ok(SetupReport {
        export_4k_fresh_ns,
        export_4k_cached_ns,
        export_1m_fresh_ns,
        export_1m_cached_ns,
        baseline_memfd_mmap_4k_ns,
        baseline_memfd_mmap_1m_ns,
        import_local_ns,
        import_cross_process_ns: s.p(0.5),
        baseline_unix_rtt_ns: unix.p(0.5),
    })
}

/// What the peer process is told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct PeerArgs {
    cpu: usize,
}

/// The peer process.
pub fn peer(a: PeerArgs) -> Result<()> {
    sys::pin(a.cpu);
    let nic = Nic::open(NicConfig::default())?;
    let v = Vmmc::new(&nic)?;
    let buf = v.export(BUF, ExportOptions { notify: Notify::Wait, ..ExportOptions::default() })?;
    let theirs = v.import(&Link::hear()?.parse()?)?;
    let vs = Vmmc::with_config(&nic, VmmcConfig { spin: Duration::ZERO, ..VmmcConfig::default() })?;
    let sbuf = vs.export(4096, ExportOptions { notify: Notify::Wait, ..ExportOptions::default() })?;
    let theirs_sleeping = vs.import(&Link::hear()?.parse()?)?;
    // A buffer whose handler answers every notification with one of its own.
    let (v2, t2) = (v.clone(), theirs.clone());
    let reply = std::sync::Arc::new(move |n: Notification| {
        if let Notification::Landed { .. } = n {
            let _ = v2.send_bytes(&1u64.to_le_bytes(), &t2, FLAG, SendFlags::notify());
        }
    });
    // On an instance of its own: its notification thread must not stand between `buf` and
    // the thread waiting on it.
    let vh = Vmmc::new(&nic)?;
    let hbuf = vh.export(4096, ExportOptions { notify: Notify::Handler(reply), ..ExportOptions::default() })?;
    Link::say(buf.descriptor());
    Link::say(hbuf.descriptor());
    Link::say(sbuf.descriptor());
    let src = v.send_buffer(4096)?;
    src.fill(0, 4096, 0xa5)?;
    let mut exported: Vec<ExportedBuffer> = Vec::new();
    loop {
        let line = Link::hear()?;
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["lat", size, iters] => {
                let (size, iters): (u64, u64) = (size.parse()?, iters.parse()?);
                buf.store_u64(FLAG, 0)?;
                Link::say("ready");
                for i in 1..=iters {
                    spin_word(&buf, FLAG, i)?;
                    if size > 8 {
                        v.send_msg(&src, 0, &theirs, DATA, size - 8, SendFlags::default())?;
                    }
                    v.send_bytes(&i.to_le_bytes(), &theirs, FLAG, SendFlags::default())?;
                }
                Link::say("done");
            }
            ["notify", iters] => {
                let iters: u64 = iters.parse()?;
                while buf.try_notification()?.is_some() {}
                Link::say("ready");
                for _ in 0..iters {
                    buf.wait_notification(Some(LIMIT))?;
                    v.send_bytes(&1u64.to_le_bytes(), &theirs, FLAG, SendFlags::notify())?;
                }
                Link::say("done");
            }
            ["notify-sleep", iters] => {
                let iters: u64 = iters.parse()?;
                while sbuf.try_notification()?.is_some() {}
                Link::say("ready");
                for _ in 0..iters {
                    sbuf.wait_notification(Some(LIMIT))?;
                    vs.send_bytes(&1u64.to_le_bytes(), &theirs_sleeping, FLAG, SendFlags::notify())?;
                }
                Link::say("done");
            }
            ["notify-handler", _] => {
                // The handler does the work; nothing to do here but say so.
                Link::say("ready");
                Link::say("done");
            }
            ["sum", off, len] => {
                let (off, len): (u64, u64) = (off.parse()?, len.parse()?);
                let mut b = vec![0u8; len as usize];
                buf.read(off, &mut b)?;
                Link::say(checksum(&b));
            }
            ["export-many", k] => {
                let k: usize = k.parse()?;
                exported =
                    (0..k).map(|_| v.export(4096, ExportOptions::default())).collect::<std::result::Result<_, _>>()?;
                let descs: Vec<String> = exported.iter().map(|b| b.descriptor().to_string()).collect();
                Link::say(descs.join(" "));
            }
            ["drop"] => {
                exported.clear();
                Link::say("dropped");
            }
            ["quit"] => return Ok(()),
            _ => return Err(format!("unknown command {line}").into()),
        }
    }
}
