//! `clan bench rpc`: RPC round-trip time and calls per second (one call in flight) against
//! the same request/response over a Unix socket, both sides spinning (clan polls, the Unix
//! socket is non-blocking and polled) and both sides blocking (clan polls for 0).

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use clan::{EndpointAddr, Nic};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use serde::Serialize;

use super::proto::*;
use super::report::{Samples, emit, ns, ratio, verdict};
use super::{Link, PeerProc, Result, Role};
use crate::sys;
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
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy)]
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
#[derive(Serialize, serde::Deserialize, Debug)]
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

#[derive(Serialize, serde::Deserialize, Debug)]
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

pub fn run(a: &RpcArgs) -> Result<()> {
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
pub(super) fn clan_rpc(size: usize, total: u64, warm: u64, spin: bool) -> Result<(Samples, Duration)> {
    let mut peer = PeerProc::spawn(Role::PrpcServer, &PeerArgs { size, spin, iters: 0, name: String::new(), cpu: 1 })?;
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

/// Request/response over a Unix stream socket: non-blocking and polled on both sides
/// (`spin`), or blocking.
fn unix_rpc(size: usize, total: u64, warm: u64, spin: bool) -> Result<(Samples, Duration)> {
    let name = format!("clan-bench-rpc-{}", std::process::id());
    let l = std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    )?)?;
    let peer = PeerProc::spawn(Role::PrpcUnix, &PeerArgs { size, spin, iters: total, name: name.clone(), cpu: 1 })?;
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

/// What the RPC benchmark's peers are told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct PeerArgs {
    size: usize,
    /// Both sides spin (else both block).
    spin: bool,
    /// Calls to answer (the Unix server).
    iters: u64,
    /// The abstract name of the Unix socket (the Unix server).
    name: String,
    cpu: usize,
}

/// Peer roles of the RPC benchmark.
pub fn peer(role: Role, a: PeerArgs) -> Result<()> {
    sys::pin(a.cpu);
    let spin = a.spin;
    match role {
        Role::PrpcServer => {
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
        Role::PrpcUnix => {
            let PeerArgs { name, size, iters, .. } = a;
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
        other => return Err(format!("not a role of bench rpc: {other:?}").into()),
    }
    Ok(())
}
