//! `clan bench latency`: ping-pong round-trip time between two processes.
//!
//! - `--sync spin`: each side polls the first word of its own aperture (local memory), the
//!   other side writes it through a mapping. Baseline: the same ping-pong over raw shared
//!   memory (a memfd both map, plain atomic stores and loads): `shm-raw`.
//! - `--sync block`: each side sleeps on a tripwire on that word, through its event queue
//!   (no spinning). Baseline: an AF_UNIX stream ping-pong between the same two processes:
//!   `unix`.
//!
//! A message is `size` bytes: `size - 8` bytes of payload written first, then the 8-byte
//! sequence word that the receiver watches. Both sides are pinned (parent on CPU 0, peer on
//! CPU 1 unless `--placement same`), for the clan run and its baseline alike.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use clan::{Aperture, EventQueue, Nic, NicConfig, TripwireConfig};
use clan_shm::segment::{Access, Segment};
use clan_shm::sync::AtomicU64;
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Processes of this host, through shared memory.
    Shm,
    /// Processes of two hosts, through a TCP link (test hosts in network namespaces when
    /// root, else two loopback NICs forced onto links).
    Tcp,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    /// Poll memory.
    Spin,
    /// Sleep on tripwires through the event queue.
    Block,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Parent on CPU 0, peer on CPU 1.
    Cross,
    /// Both on CPU 0.
    Same,
}

/// Arguments of `clan bench latency`.
#[derive(clap::Args, Debug, Clone)]
pub struct LatencyArgs {
    /// Where the peers are.
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    pub transport: Transport,
    /// How receivers wait.
    #[arg(long, value_enum, default_value_t = SyncMode::Spin)]
    pub sync: SyncMode,
    /// Message size (bytes; units accepted: 64KiB, 1MiB).(at least 8).
    #[arg(long, default_value = "8", value_parser = sys::size_usize)]
    pub size: usize,
    /// Measured round trips (plus 10% warm-up).
    #[arg(long, default_value_t = 100_000)]
    pub iters: u64,
    /// Thread placement.
    #[arg(long, value_enum, default_value_t = Placement::Cross)]
    pub placement: Placement,
    /// Alternate clan and baseline this many times (samples are merged), so that drift of a
    /// shared machine cannot favour either.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, serde::Deserialize)]
pub struct LatencyReport {
    pub bench: &'static str,
    pub transport: &'static str,
    pub sync: &'static str,
    pub size: usize,
    pub iters: u64,
    pub rtt_p50_ns: u64,
    pub rtt_p90_ns: u64,
    pub rtt_p99_ns: u64,
    pub rtt_p999_ns: u64,
    pub rtt_mean_ns: f64,
    pub one_way_p50_ns: u64,
    pub baseline: &'static str,
    pub baseline_rtt_p50_ns: u64,
    pub baseline_rtt_p99_ns: u64,
    pub baseline_rtt_mean_ns: f64,
    pub ratio_p50: f64,
    pub placement: String,
    pub machine: sys::Machine,
}

const LIMIT: Duration = Duration::from_secs(60);

fn placement_cpus(p: Placement) -> (usize, usize) {
    match p {
        Placement::Cross => (0, 1),
        Placement::Same => (0, 0),
    }
}

pub fn run(a: &LatencyArgs) -> Result<()> {
    if a.size < 8 {
        return Err("--size must be at least 8 (the sequence word)".into());
    }
    if a.iters == 0 {
        return Err("--iters must be positive".into());
    }
    let (cpu_parent, cpu_peer) = placement_cpus(a.placement);
    let pinned = sys::pin(cpu_parent);
    let placement = format!(
        "parent pinned to CPU {}, peer to CPU {} ({} CPUs){}",
        pinned.map_or("-".into(), |c| c.to_string()),
        cpu_peer,
        sys::machine().cpus,
        if a.sync == SyncMode::Spin { "; both sides spin" } else { "; both sides sleep" }
    );
    let rounds = a.rounds.max(1);
    let per_round = a.iters.div_ceil(u64::from(rounds));
    let warmup = (per_round / 10).max(100);
    let total = per_round + warmup;
    let hosts = (a.transport == Transport::Tcp).then(super::tcp::Hosts::new);
    let baseline = match (a.transport, a.sync) {
        (Transport::Tcp, _) => "tcp",
        (_, SyncMode::Spin) => "shm-raw",
        (_, SyncMode::Block) => "unix",
    };
    let (mut base, mut ours) = (Samples::new(), Samples::new());
    let spin = a.sync == SyncMode::Spin;
    for _ in 0..rounds {
        match &hosts {
            Some(h) => {
                base.merge(&super::tcp::raw_round(h, spin, a.size, total, warmup)?);
                ours.merge(&super::tcp::clan_round(h, spin, a.size, total, warmup)?);
            }
            None => {
                let b = match a.sync {
                    SyncMode::Spin => raw_shm(a.size, total, warmup, cpu_peer)?,
                    SyncMode::Block => unix(a.size, total, warmup, cpu_peer)?,
                };
                base.merge(&b);
                ours.merge(&clan_pingpong(a.sync, a.size, total, warmup, cpu_peer)?);
            }
        }
    }
    let placement = match &hosts {
        Some(h) => format!(
            "{}; pinger on CPU 0, ponger on CPU 1, each NIC's engine on its process's CPU; {}",
            h.describe(),
            if spin { "both sides busy-poll (clan: manual progress)" } else { "both sides sleep" }
        ),
        None => placement,
    };
    let (o, b) = (ours.summary(), base.summary());
    let r = LatencyReport {
        bench: "latency",
        transport: if a.transport == Transport::Tcp { "tcp" } else { "shm" },
        sync: match a.sync {
            SyncMode::Spin => "spin",
            SyncMode::Block => "block",
        },
        size: a.size,
        iters: a.iters,
        rtt_p50_ns: o.p50_ns,
        rtt_p90_ns: o.p90_ns,
        rtt_p99_ns: o.p99_ns,
        rtt_p999_ns: o.p999_ns,
        rtt_mean_ns: o.mean_ns,
        one_way_p50_ns: o.p50_ns / 2,
        baseline,
        baseline_rtt_p50_ns: b.p50_ns,
        baseline_rtt_p99_ns: b.p99_ns,
        baseline_rtt_mean_ns: b.mean_ns,
        ratio_p50: ratio(o.p50_ns as f64, b.p50_ns as f64),
        placement,
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench latency: transport {}, sync {}, {} bytes, {} round trips in {} interleaved rounds",
            r.transport, r.sync, r.size, r.iters, rounds
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!("{:<10} {:>10} {:>10} {:>10} {:>10} {:>10}", "", "p50", "p90", "p99", "p99.9", "mean");
        for (name, s) in [("clan", o), (baseline, b)] {
            println!(
                "{:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                name,
                ns(s.p50_ns),
                ns(s.p90_ns),
                ns(s.p99_ns),
                ns(s.p999_ns),
                ns(s.mean_ns as u64)
            );
        }
        println!("ratio clan/{baseline} at p50: {:.2}", r.ratio_p50);
    });
    Ok(())
}

fn aperture_len(size: usize) -> u64 {
    size.max(64) as u64
}

/// Wait until the sequence word of `ap` holds `v`, spinning or sleeping on the event queue.
fn wait_for(ap: &Aperture, v: u64, block: Option<&EventQueue>) -> Result<()> {
    let start = Instant::now();
    match block {
        None => {
            let mut n = 0u32;
            while ap.load_u64(0)? != v {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n % 4096 == 0 && start.elapsed() > LIMIT {
                    return Err("peer stopped answering".into());
                }
            }
        }
        Some(q) => {
            while ap.load_u64(0)? != v {
                q.wait_spin(Duration::ZERO, Some(LIMIT)).map_err(|_| "peer stopped answering")?;
            }
            while q.try_take().is_some() {}
        }
    }
    Ok(())
}

struct Side {
    _nic: Nic,
    queue: EventQueue,
    ap: Aperture,
    _tw: Option<clan::Tripwire>,
    ep: clan::Endpoint,
}

fn side(sync: SyncMode, size: usize) -> Result<Side> {
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    let ap = ep.export(aperture_len(size))?;
    let tw = match sync {
        SyncMode::Block => Some(ap.tripwire(TripwireConfig::writes(0..8).event(1))?),
        SyncMode::Spin => None,
    };
    Ok(Side { queue: ep.event_queue().clone(), _nic: nic, ap, _tw: tw, ep })
}

fn clan_pingpong(sync: SyncMode, size: usize, total: u64, warmup: u64, cpu_peer: usize) -> Result<Samples> {
    let me = side(sync, size)?;
    let mut peer = PeerProc::spawn(
        Role::LatClan,
        &PeerArgs { sync, size, iters: total, cpu: cpu_peer, place: String::new(), slots: 1, packed: false },
    )?;
    let theirs = me.ep.import(&peer.recv()?.parse()?)?;
    peer.send(me.ap.descriptor())?;
    if peer.recv()? != "ready" {
        return Err("peer not ready".into());
    }
    let payload = vec![0x5au8; size - 8];
    let block = (sync == SyncMode::Block).then_some(&me.queue);
    let mut s = Samples::new();
    for i in 1..=total {
        let t0 = Instant::now();
        if size > 8 {
            theirs.write(8, &payload)?;
        }
        theirs.store_u64(0, i)?;
        wait_for(&me.ap, i, block)?;
        if i > warmup {
            s.record(t0.elapsed());
        }
    }
    if peer.recv()? != "done" {
        return Err("peer did not finish".into());
    }
    peer.finish()?;
    Ok(s)
}

pub fn raw_shm(size: usize, total: u64, warmup: u64, cpu_peer: usize) -> Result<Samples> {
    let region = clan_shm::segment::page_align(size.max(64));
    let memfd = clan_shm::memfd::Memfd::create("clan-bench-raw", 2 * region as u64)?;
    let seg = Segment::map(&memfd, 0, 2 * region, Access::ReadWrite)?;
    let path = format!("/proc/{}/fd/{}", std::process::id(), memfd.as_fd_raw());
    let mut peer = PeerProc::spawn(
        Role::LatRaw,
        &PeerArgs { sync: SyncMode::Spin, size, iters: total, cpu: cpu_peer, place: path, slots: 1, packed: false },
    )?;
    if peer.recv()? != "ready" {
        return Err("peer not ready".into());
    }
    let payload = vec![0x5au8; size - 8];
    let (mine, theirs) = (seg.view::<AtomicU64>(0)?, seg.view::<AtomicU64>(region)?);
    let mut s = Samples::new();
    for i in 1..=total {
        let t0 = Instant::now();
        if size > 8 {
            seg.write(region + 8, &payload)?;
        }
        theirs.store(i, std::sync::atomic::Ordering::Release);
        spin_until(mine, i)?;
        if i > warmup {
            s.record(t0.elapsed());
        }
    }
    peer.finish()?;
    Ok(s)
}

/// The raw ping-pong over `slots` request/reply pairs, each a page of its own (as a
/// connection's flag and small message are), the client choosing a slot at random for each
/// round trip and naming it in a mailbox word the server polls (as clan's server learns the
/// connection from its event queue). What a round trip costs when each one touches memory
/// that `slots - 1` others left cold: the floor of a server's round trip at that many
/// endpoints on this machine (its caches and TLB).
///
/// Layout: region 0 the mailbox (`round << 32 | slot`), then per slot its request region and
/// its reply region, each led by its word (the round) with the payload behind it. A region is
/// a page, or with `packed` the size rounded to a cache line (how clan's pools carve small
/// connection sides, several to a page): the floor of a layout that touches as few pages.
pub fn raw_shm_slots(
    size: usize,
    slots: usize,
    packed: bool,
    total: u64,
    warmup: u64,
    cpu_peer: usize,
) -> Result<Samples> {
    let region = slot_region(size, packed);
    let slots = slots.clamp(1, u32::MAX as usize);
    let bytes = region * (1 + 2 * slots);
    let memfd = clan_shm::memfd::Memfd::create("clan-bench-raw-slots", bytes as u64)?;
    let seg = Segment::map(&memfd, 0, bytes, Access::ReadWrite)?;
    let path = format!("/proc/{}/fd/{}", std::process::id(), memfd.as_fd_raw());
    let mut peer = PeerProc::spawn(
        Role::LatRawSlots,
        &PeerArgs { sync: SyncMode::Spin, size, iters: total, cpu: cpu_peer, place: path, slots, packed },
    )?;
    if peer.recv()? != "ready" {
        return Err("peer not ready".into());
    }
    // Every page in place first (the peer's too: it faults them in before it says ready), so
    // that no round trip pays a page fault.
    seg.write(0, &vec![0u8; bytes])?;
    let payload = vec![0x5au8; size - 8];
    let mailbox = seg.view::<AtomicU64>(0)?;
    let mut reply = vec![0u8; size - 8];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut s = Samples::new();
    for i in 1..=total {
        // xorshift: a slot at random, the same sequence every run.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = (x % slots as u64) as usize;
        let (req, rep) = (region * (1 + 2 * k), region * (2 + 2 * k));
        let t0 = Instant::now();
        if size > 8 {
            seg.write(req + 8, &payload)?;
        }
        seg.view::<AtomicU64>(req)?.store(i, std::sync::atomic::Ordering::Release);
        mailbox.store((i << 32) | k as u64, std::sync::atomic::Ordering::Release);
        spin_until(seg.view::<AtomicU64>(rep)?, i)?;
        if size > 8 {
            seg.read(rep + 8, &mut reply)?;
        }
        if i > warmup {
            s.record(t0.elapsed());
        }
    }
    peer.finish()?;
    Ok(s)
}

/// Spin until the mailbox names round `v` (in its high 32 bits).
fn spin_until_round(w: &AtomicU64, v: u64) -> Result<()> {
    let start = Instant::now();
    let mut n = 0u32;
    while w.load(std::sync::atomic::Ordering::Acquire) >> 32 != v & 0xffff_ffff {
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n % 4096 == 0 && start.elapsed() > LIMIT {
            return Err("peer stopped asking".into());
        }
    }
    Ok(())
}

fn spin_until(w: &AtomicU64, v: u64) -> Result<()> {
    let start = Instant::now();
    let mut n = 0u32;
    while w.load(std::sync::atomic::Ordering::Acquire) != v {
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n % 4096 == 0 && start.elapsed() > LIMIT {
            return Err("peer stopped answering".into());
        }
    }
    Ok(())
}

pub fn unix(size: usize, total: u64, warmup: u64, cpu_peer: usize) -> Result<Samples> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let name = format!("clan-bench-unix-{}", std::process::id());
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    let peer = PeerProc::spawn(
        Role::LatUnix,
        &PeerArgs {
            sync: SyncMode::Block,
            size,
            iters: total,
            cpu: cpu_peer,
            place: name.clone(),
            slots: 1,
            packed: false,
        },
    )?;
    let (mut sock, _) = listener.accept()?;
    sock.set_read_timeout(Some(LIMIT))?;
    let out = vec![0x5au8; size];
    let mut inp = vec![0u8; size];
    let mut s = Samples::new();
    for i in 1..=total {
        let t0 = Instant::now();
        sock.write_all(&out)?;
        sock.read_exact(&mut inp)?;
        if i > warmup {
            s.record(t0.elapsed());
        }
    }
    peer.finish()?;
    Ok(s)
}

trait RawFdNum {
    fn as_fd_raw(&self) -> i32;
}

impl RawFdNum for clan_shm::memfd::Memfd {
    fn as_fd_raw(&self) -> i32 {
        std::os::fd::AsFd::as_fd(self).as_raw_fd()
    }
}

/// What the latency benchmark's peers are told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct PeerArgs {
    /// How the clan side waits.
    sync: SyncMode,
    size: usize,
    iters: u64,
    cpu: usize,
    /// Where to meet: the shared memfd's path (raw), the socket's abstract name (Unix).
    place: String,
    /// Request/reply slots of the raw ping-pong over many ([`raw_shm_slots`]).
    #[serde(default)]
    slots: usize,
    /// Those slots packed on cache lines instead of a page each.
    #[serde(default)]
    packed: bool,
}

/// Bytes of one request or reply region of the raw ping-pong over many slots: a page each,
/// or (`packed`) the size rounded to a cache line, as clan's pools carve small connection
/// sides.
fn slot_region(size: usize, packed: bool) -> usize {
    if packed { size.max(64).next_multiple_of(64) } else { clan_shm::segment::page_align(size.max(64)) }
}

/// The peer side of the latency benchmarks.
pub fn peer(role: Role, a: PeerArgs) -> Result<()> {
    let PeerArgs { sync, size, iters, cpu, place, slots, packed } = a;
    sys::pin(cpu);
    match role {
        Role::LatClan => {
            let me = side(sync, size)?;
            Link::say(me.ap.descriptor());
            let theirs = me.ep.import(&Link::hear()?.parse()?)?;
            Link::say("ready");
            let payload = vec![0xa5u8; size - 8];
            let block = (sync == SyncMode::Block).then_some(&me.queue);
            for i in 1..=iters {
                wait_for(&me.ap, i, block)?;
                if size > 8 {
                    theirs.write(8, &payload)?;
                }
                theirs.store_u64(0, i)?;
            }
            Link::say("done");
            let _ = Link::hear();
        }
        Role::LatRaw => {
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&place)?;
            let region = clan_shm::segment::page_align(size.max(64));
            let seg = Segment::map(&f, 0, 2 * region, Access::ReadWrite)?;
            let (theirs, mine) = (seg.view::<AtomicU64>(0)?, seg.view::<AtomicU64>(region)?);
            let payload = vec![0xa5u8; size - 8];
            Link::say("ready");
            for i in 1..=iters {
                spin_until(mine, i)?;
                if size > 8 {
                    seg.write(8, &payload)?;
                }
                theirs.store(i, std::sync::atomic::Ordering::Release);
            }
        }
        Role::LatRawSlots => {
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&place)?;
            let region = slot_region(size, packed);
            let slots = slots.max(1);
            let bytes = region * (1 + 2 * slots);
            let seg = Segment::map(&f, 0, bytes, Access::ReadWrite)?;
            // Every page mapped here, writable, before the first round trip.
            seg.write(0, &vec![0u8; bytes])?;
            let mailbox = seg.view::<AtomicU64>(0)?;
            let payload = vec![0xa5u8; size - 8];
            let mut request = vec![0u8; size - 8];
            Link::say("ready");
            for i in 1..=iters {
                spin_until_round(mailbox, i)?;
                let k = (mailbox.load(std::sync::atomic::Ordering::Acquire) & 0xffff_ffff) as usize;
                if k >= slots {
                    return Err(format!("slot {k} out of range").into());
                }
                let (req, rep) = (region * (1 + 2 * k), region * (2 + 2 * k));
                // The request word was stored before the mailbox: it holds the round.
                if seg.view::<AtomicU64>(req)?.load(std::sync::atomic::Ordering::Acquire) != i {
                    return Err("request word out of step".into());
                }
                if size > 8 {
                    // The server reads the request in place, as clan's server does.
                    seg.read(req + 8, &mut request)?;
                    seg.write(rep + 8, &payload)?;
                }
                seg.view::<AtomicU64>(rep)?.store(i, std::sync::atomic::Ordering::Release);
            }
        }
        Role::LatUnix => {
            use std::os::linux::net::SocketAddrExt;
            use std::os::unix::net::{SocketAddr, UnixStream};
            let mut sock = UnixStream::connect_addr(&SocketAddr::from_abstract_name(place.as_bytes())?)?;
            sock.set_read_timeout(Some(LIMIT))?;
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                sock.read_exact(&mut buf)?;
                sock.write_all(&buf)?;
            }
        }
        other => return Err(format!("not a role of bench latency: {other:?}").into()),
    }
    Ok(())
}
