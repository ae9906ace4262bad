//! `clan bench stream`: stream-socket round-trip time, both sides spinning and both
//! blocking, both processes on one CPU, and bandwidth, against Unix sockets and kernel TCP
//! (loopback); the same over a TCP link.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use serde::Serialize;

use super::proto::*;
use super::report::{Samples, emit, ns, ratio, verdict};
use super::{Link, PeerProc, Result, Role};
use crate::sys;
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
#[derive(Serialize, serde::Deserialize, Debug)]
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
#[derive(Serialize, serde::Deserialize, Debug)]
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
#[derive(Serialize, serde::Deserialize, Debug)]
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

#[derive(Serialize, serde::Deserialize, Debug)]
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

#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
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
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Wait {
    /// Poll: clan streams and their NICs' queues poll 10 ms, sockets are non-blocking and
    /// polled.
    Spin,
    /// Sleep at once: clan polls for 0, sockets block.
    Block,
    /// clan's defaults (poll 15 µs, then sleep); sockets block.
    Default,
}

impl Wait {
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

/// What the stream benchmark's peers are told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct PeerArgs {
    kind: Kind,
    size: usize,
    ring: u64,
    wait: Wait,
    cpu: usize,
    /// Messages to take (the sink).
    n: u64,
}

fn stream_args(kind: Kind, size: usize, ring: u64, wait: Wait, cpu: usize) -> PeerArgs {
    PeerArgs { kind, size, ring, wait, cpu, n: 0 }
}

/// Round trips with the echoing peer on `peer_cpu` (the caller is on CPU 0).
fn stream_rtt(kind: Kind, size: usize, iters: u64, ring: u64, wait: Wait, peer_cpu: usize) -> Result<Samples> {
    let nic = wait.nic(kind.name())?;
    let mut peer = PeerProc::spawn(Role::PstEcho, &stream_args(kind, size, ring, wait, peer_cpu))?;
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
    let args = PeerArgs { n, ..stream_args(kind, size, ring, wait, 1) };
    let mut peer = PeerProc::spawn(Role::PstSink, &args)?;
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

pub fn run(a: &StreamArgs) -> Result<()> {
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
         (spinning: it polls the socket; blocking: it sleeps in epoll on the socket, its queue's kick and its ports, as its queue's leader), as a thread reading a TCP socket does",
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
pub fn peer(role: Role, a: PeerArgs) -> Result<()> {
    sys::pin(a.cpu);
    let PeerArgs { kind, size, wait, ring, n, .. } = a;
    let mut s = stream_accept(kind.name(), ring, wait)?;
    let mut buf = vec![0u8; size];
    match role {
        Role::PstEcho => loop {
            let got = if wait == Wait::Spin { read_exact_polling(&mut s, &mut buf) } else { s.read_exact(&mut buf) };
            match got {
                Ok(()) if wait == Wait::Spin => write_all_polling(&mut s, &buf)?,
                Ok(()) => s.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        },
        Role::PstSink => {
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
        other => Err(format!("not a role of bench stream: {other:?}").into()),
    }
}
