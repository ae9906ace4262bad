//! The benchmarks over links: `--transport tcp`.
//!
//! Both peers are child processes. As root they run on two test hosts (network namespaces
//! joined by a veth pair, addresses from 10.77.0.0/16); otherwise on two loopback NICs forced
//! to use links (`LocalTransport::Link`). The baselines use the same hosts and addresses:
//! a raw TCP ping-pong (`tcp`) and a raw TCP stream (`tcp-stream`).
//!
//! Placement: the pinger / sender on CPU 0, the ponger / receiver on CPU 1, each with its
//! NIC's engine thread on its own CPU. The latency peers use manual progress: the application
//! thread drives its link, as a raw TCP thread reads its socket. In `spin` mode both sides
//! busy-poll (clan: `Nic::progress` in the spin loop; raw TCP: non-blocking `recv`). In
//! `block` mode both sides sleep: clan in `EventQueue::wait`, which sleeps on the link socket
//! and the queue's descriptor together and is woken by the traffic itself; raw TCP in a
//! blocking `read`. The bandwidth receiver's link is processed by its NIC's engine thread.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use clan::{Aperture, EventQueue, LocalTransport, Nic, NicConfig, Progress, TripwireConfig};
use clan_testkit::netns::TestNet;

use super::report::{Samples, timed_batches};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);

/// Where the two peers run.
pub struct Hosts {
    net: Option<TestNet>,
}

impl Hosts {
    pub fn new() -> Hosts {
        Hosts { net: TestNet::new(2).ok() }
    }

    pub fn ip(&self, i: usize) -> IpAddr {
        match &self.net {
            Some(n) => IpAddr::V4(n.host(i).ip),
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
        }
    }

    pub fn command(&self, i: usize) -> Result<Command> {
        let exe = std::env::current_exe()?;
        Ok(match &self.net {
            Some(n) => n.command(i, exe),
            None => Command::new(exe),
        })
    }

    pub fn describe(&self) -> String {
        match &self.net {
            Some(n) => format!(
                "two test hosts (network namespaces {} and {} joined by a veth pair), {} and {}",
                n.host(0).ns,
                n.host(1).ns,
                n.host(0).ip,
                n.host(1).ip
            ),
            None => "two loopback NICs forced onto TCP links (not root: no test hosts)".into(),
        }
    }

    /// A peer on host `i` (and CPU `i`), told `args` and where it is.
    pub fn spawn<A: serde::Serialize>(&self, i: usize, role: Role, args: A) -> Result<PeerProc> {
        PeerProc::spawn_via(self.command(i)?, role, &OnHost { ip: self.ip(i), cpu: i, args })
    }
}

/// A peer's arguments with the host address and CPU it runs on.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct OnHost<A> {
    pub ip: IpAddr,
    pub cpu: usize,
    #[serde(flatten)]
    pub args: A,
}

/// What the latency peers are told.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LatArgs {
    spin: bool,
    size: usize,
    iters: u64,
    warmup: u64,
}

/// What the bandwidth peers are told.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct BwArgs {
    size: usize,
    iters: u64,
    /// The sender posts DMA (else it stores).
    dma: bool,
}

fn nic(ip: IpAddr, cpu: usize, progress: Progress) -> Result<Nic> {
    Ok(Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress,
        engine_cpu: Some(cpu),
        ..NicConfig::at(ip, 0)
    })?)
}

fn wait_word(nic: &Nic, ap: &Aperture, off: u64, v: u64, q: Option<&EventQueue>) -> Result<()> {
    let start = Instant::now();
    let mut n = 0u32;
    while ap.load_u64(off)? != v {
        match q {
            None => {
                if !nic.progress() {
                    std::hint::spin_loop();
                }
            }
            Some(q) => {
                q.wait_spin(Duration::ZERO, Some(LIMIT)).map_err(|_| "peer stopped answering")?;
            }
        }
        n = n.wrapping_add(1);
        if n % 1024 == 0 && start.elapsed() > LIMIT {
            return Err("peer stopped answering".into());
        }
    }
    if let Some(q) = q {
        while q.try_take().is_some() {}
    }
    Ok(())
}

/// One round of the clan ping-pong over a link; returns the pinger's samples.
pub fn clan_round(h: &Hosts, spin: bool, size: usize, total: u64, warmup: u64) -> Result<Samples> {
    let common = || LatArgs { spin, size, iters: total, warmup };
    let mut pong = h.spawn(1, Role::LatLinkPong, common())?;
    let mut ping = h.spawn(0, Role::LatLinkPing, common())?;
    let (dpong, dping) = (pong.recv()?, ping.recv()?);
    pong.send(&dping)?;
    ping.send(&dpong)?;
    let line = ping.recv()?;
    let s = Samples::from_line(line.strip_prefix("samples ").ok_or("bad samples")?).ok_or("bad samples")?;
    ping.send("done")?;
    pong.send("done")?;
    ping.finish()?;
    pong.finish()?;
    Ok(s)
}

/// One round of the raw TCP ping-pong between the same hosts.
pub fn raw_round(h: &Hosts, spin: bool, size: usize, total: u64, warmup: u64) -> Result<Samples> {
    let common = || LatArgs { spin, size, iters: total, warmup };
    let mut server = h.spawn(1, Role::LatTcpPong, common())?;
    let port = server.recv()?;
    let mut client = h.spawn(0, Role::LatTcpPing, common())?;
    client.send(format!("{}:{port}", h.ip(1)))?;
    let line = client.recv()?;
    let s = Samples::from_line(line.strip_prefix("samples ").ok_or("bad samples")?).ok_or("bad samples")?;
    client.finish()?;
    server.finish()?;
    Ok(s)
}

fn recv_nonblocking_exact(sock: &mut TcpStream, buf: &mut [u8], spin: bool) -> Result<()> {
    let start = Instant::now();
    let mut got = 0;
    while got < buf.len() {
        match sock.read(&mut buf[got..]) {
            Ok(0) => return Err("peer closed".into()),
            Ok(n) => got += n,
            Err(e) if spin && e.kind() == std::io::ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                if start.elapsed() > LIMIT {
                    return Err("peer stopped answering".into());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Peer roles of the link latency benchmarks.
pub fn latency_peer(role: Role, a: OnHost<LatArgs>) -> Result<()> {
    let OnHost { ip, cpu, args: LatArgs { spin, size, iters, warmup } } = a;
    sys::pin(cpu);
    match role {
        Role::LatLinkPing | Role::LatLinkPong => {
            // Manual progress in both modes: the thread that spins or sleeps drives the link
            // itself (in `block` mode it sleeps on the link's socket), as a raw TCP thread does.
            let nic = nic(ip, cpu, Progress::Manual)?;
            let ep = nic.endpoint()?;
            let ap = ep.export(size.max(64) as u64)?;
            let _tw = if spin { None } else { Some(ap.tripwire(TripwireConfig::writes(0..8).event(1))?) };
            let q = (!spin).then(|| ep.event_queue().clone());
            Link::say(ap.descriptor());
            let theirs = ep.import(&Link::hear()?.parse()?)?;
            let payload = vec![0x5au8; size - 8];
            let ping = role == Role::LatLinkPing;
            let mut s = Samples::new();
            for i in 1..=iters {
                let t0 = Instant::now();
                if !ping {
                    wait_word(&nic, &ap, 0, i, q.as_ref())?;
                }
                if size > 8 {
                    theirs.write(8, &payload)?;
                }
                theirs.store_u64(0, i)?;
                if ping {
                    wait_word(&nic, &ap, 0, i, q.as_ref())?;
                    if i > warmup {
                        s.record(t0.elapsed());
                    }
                }
            }
            if ping {
                Link::say(format!("samples {}", s.to_line()));
            }
            // Keep the NIC (and its link) up until the other side is done too.
            while Link::hear().is_ok_and(|l| l != "done") {}
        }
        Role::LatTcpPong => {
            let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
            Link::say(l.local_addr()?.port());
            let (mut sock, _) = l.accept()?;
            sock.set_nodelay(true)?;
            sock.set_nonblocking(spin)?;
            sock.set_read_timeout(Some(LIMIT))?;
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                recv_nonblocking_exact(&mut sock, &mut buf, spin)?;
                write_all_spin(&mut sock, &buf)?;
            }
        }
        Role::LatTcpPing => {
            let to: SocketAddr = Link::hear()?.parse()?;
            let mut sock = TcpStream::connect(to)?;
            sock.set_nodelay(true)?;
            sock.set_nonblocking(spin)?;
            sock.set_read_timeout(Some(LIMIT))?;
            let out = vec![0x5au8; size];
            let mut inp = vec![0u8; size];
            let mut s = Samples::new();
            for i in 1..=iters {
                let t0 = Instant::now();
                write_all_spin(&mut sock, &out)?;
                recv_nonblocking_exact(&mut sock, &mut inp, spin)?;
                if i > warmup {
                    s.record(t0.elapsed());
                }
            }
            Link::say(format!("samples {}", s.to_line()));
        }
        other => return Err(format!("not a role of this benchmark: {other:?}").into()),
    }
    Ok(())
}

fn write_all_spin(sock: &mut TcpStream, mut b: &[u8]) -> Result<()> {
    let start = Instant::now();
    while !b.is_empty() {
        match sock.write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() > LIMIT {
                    return Err("peer stopped reading".into());
                }
                std::thread::yield_now();
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Bandwidth: one round of clan PIO streaming over a link; returns (seconds, per-message samples).
pub fn clan_stream(h: &Hosts, size: usize, iters: u64, mode: super::bandwidth::Mode) -> Result<(Duration, Samples)> {
    let dma = mode == super::bandwidth::Mode::Dma;
    let common = || BwArgs { size, iters, dma };
    let mut recv = h.spawn(1, Role::BwLinkRecv, common())?;
    let mut send = h.spawn(0, Role::BwLinkSend, common())?;
    send.send(recv.recv()?)?;
    let line = send.recv()?;
    recv.send(format!("check {iters}"))?;
    let verdict = recv.recv()?;
    if verdict != "ok" {
        return Err(format!("receiver found bad data: {verdict}").into());
    }
    send.send("done")?;
    recv.send("done")?;
    send.finish()?;
    recv.finish()?;
    parse_result(&line)
}

/// Bandwidth baseline: a raw TCP stream of the same messages between the same hosts.
pub fn raw_stream(h: &Hosts, size: usize, iters: u64) -> Result<(Duration, Samples)> {
    let common = || BwArgs { size, iters, dma: false };
    let mut recv = h.spawn(1, Role::BwTcpRecv, common())?;
    let port = recv.recv()?;
    let mut send = h.spawn(0, Role::BwTcpSend, common())?;
    send.send(format!("{}:{port}", h.ip(1)))?;
    let line = send.recv()?;
    send.finish()?;
    recv.finish()?;
    parse_result(&line)
}

fn parse_result(line: &str) -> Result<(Duration, Samples)> {
    let rest = line.strip_prefix("result ").ok_or("bad result")?;
    let (secs, samples) = rest.split_once(' ').ok_or("bad result")?;
    Ok((Duration::from_secs_f64(secs.parse()?), Samples::from_line(samples).ok_or("bad samples")?))
}

fn ring(size: usize) -> usize {
    ((8usize << 20) / size.max(1)).clamp(4, 1 << 16) * size
}

/// Peer roles of the link bandwidth benchmarks.
pub fn bandwidth_peer(role: Role, a: OnHost<BwArgs>) -> Result<()> {
    let OnHost { ip, cpu, args: BwArgs { size, iters, dma } } = a;
    sys::pin(cpu);
    let src: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    let ring_bytes = ring(size);
    let slots = (ring_bytes / size) as u64;
    match role {
        Role::BwLinkRecv => {
            let nic = nic(ip, cpu, Progress::Engine)?;
            let ep = nic.endpoint()?;
            let ap = ep.export(ring_bytes as u64 + 8)?;
            Link::say(ap.descriptor());
            let line = Link::hear()?;
            let n: u64 = line.strip_prefix("check ").ok_or("expected check")?.parse()?;
            let last = ((n - 1) % slots) as usize * size;
            let mut got = vec![0u8; size];
            ap.read(last as u64, &mut got)?;
            let seq = ap.load_u64(ring_bytes as u64)?;
            Link::say(if seq == n && got == src { "ok".to_string() } else { format!("seq {seq}, expected {n}") });
            while Link::hear().is_ok_and(|l| l != "done") {}
        }
        Role::BwLinkSend if dma => {
            // The sender's DMA engine (on the sender's CPU) sends the bursts, straight from
            // the source aperture.
            let nic = Nic::open(NicConfig {
                local_transport: LocalTransport::Link,
                engine_cpu: Some(cpu),
                dma: clan::DmaConfig { cpu: Some(cpu), spin: Duration::ZERO, ..clan::DmaConfig::default() },
                ..NicConfig::at(ip, 0)
            })?;
            let ep = nic.endpoint_with(clan::EndpointConfig {
                dma_queue: super::bandwidth::DMA_DEPTH,
                ..clan::EndpointConfig::default()
            })?;
            let m = ep.import(&Link::hear()?.parse()?)?;
            let src_ap = ep.export(size as u64)?;
            src_ap.write(0, &src)?;
            // The engine shares this thread's CPU: wait without spinning.
            let _ = super::bandwidth::dma_stream(&ep, &src_ap, &m, size, slots, slots, Duration::ZERO)?;
            m.barrier()?;
            let start = Instant::now();
            let (_, s2) = super::bandwidth::dma_stream(&ep, &src_ap, &m, size, iters, slots, Duration::ZERO)?;
            m.store_u64(ring_bytes as u64, iters)?;
            m.barrier()?;
            let t = start.elapsed();
            Link::say(format!("result {} {}", t.as_secs_f64(), s2.to_line()));
            while Link::hear().is_ok_and(|l| l != "done") {}
        }
        Role::BwLinkSend => {
            let nic = nic(ip, cpu, Progress::Engine)?;
            let ep = nic.endpoint()?;
            let m = ep.import(&Link::hear()?.parse()?)?;
            // Warm up: one pass over the ring.
            for k in 0..slots {
                m.write(k * size as u64, &src)?;
            }
            m.barrier()?;
            let start = Instant::now();
            let s = timed_batches(iters, ((256 << 10) / size).clamp(1, 4096) as u64, |i| {
                Ok(m.write((i % slots) * size as u64, &src)?)
            })?;
            m.store_u64(ring_bytes as u64, iters)?;
            m.barrier()?;
            let t = start.elapsed();
            Link::say(format!("result {} {}", t.as_secs_f64(), s.to_line()));
            while Link::hear().is_ok_and(|l| l != "done") {}
        }
        Role::BwTcpRecv => {
            let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
            Link::say(l.local_addr()?.port());
            let (mut sock, _) = l.accept()?;
            sock.set_read_timeout(Some(LIMIT))?;
            // The messages land in a ring of the same size as clan's aperture (the same
            // memory footprint: a small buffer reused would stay in cache and flatter TCP).
            let mut buf = vec![0u8; ring_bytes];
            let warm = slots * size as u64;
            let total = warm + iters * size as u64;
            let mut got = 0u64;
            let mut acked_warmup = false;
            while got < total {
                if !acked_warmup && got >= warm {
                    sock.write_all(&[0])?;
                    acked_warmup = true;
                }
                let at = (got % ring_bytes as u64) as usize;
                let n = sock.read(&mut buf[at..])?;
                if n == 0 {
                    return Err("sender closed early".into());
                }
                got += n as u64;
            }
            sock.write_all(&[1])?;
        }
        Role::BwTcpSend => {
            let to: SocketAddr = Link::hear()?.parse()?;
            let mut sock = TcpStream::connect(to)?;
            sock.set_nodelay(true)?;
            sock.set_read_timeout(Some(LIMIT))?;
            for _ in 0..slots {
                sock.write_all(&src)?;
            }
            // Like clan's barrier: the warm-up has been received before the clock starts.
            let mut warm = [0u8; 1];
            sock.read_exact(&mut warm)?;
            let start = Instant::now();
            let s = timed_batches(iters, ((256 << 10) / size).clamp(1, 4096) as u64, |_| Ok(sock.write_all(&src)?))?;
            let mut ack = [0u8; 1];
            sock.read_exact(&mut ack)?;
            let t = start.elapsed();
            Link::say(format!("result {} {}", t.as_secs_f64(), s.to_line()));
        }
        other => return Err(format!("not a role of this benchmark: {other:?}").into()),
    }
    Ok(())
}
