//! `clan bench server`: the Tripwire paper's event-driven server (§5.3, figures 8 and 9).
//!
//! The server process runs one thread: a clan [`clan_proto::server::EventLoop`] whose only
//! descriptor is the event queue of all its RPC connections (drained, then polled 15 µs,
//! then epoll). The client process opens N connections and sends requests on connections
//! chosen at random: one in flight, or K. `busy`: back to back; `idle`: a pause longer than
//! the server's polling time between requests, so that it goes to sleep each time.
//!
//! Baseline in the same run: an epoll (mio) TCP server, one thread, with the same N
//! connections (loopback), the same request size and the same client pattern.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, Nic, NicConfig};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::server::EventLoop;
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, arg};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);
/// The pause between requests in idle mode: longer than the server's 15 µs of polling.
const IDLE_GAP: Duration = Duration::from_micros(60);

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Requests back to back: the server never sleeps.
    Busy,
    /// A pause between requests: the server sleeps each time.
    Idle,
}

/// Arguments of `clan bench server`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Connections (endpoints) the client opens to the server.
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    /// Traffic pattern.
    #[arg(long, value_enum, default_value_t = Mode::Busy)]
    pub mode: Mode,
    /// Requests in flight at once (on distinct connections).
    #[arg(long, default_value_t = 1)]
    pub inflight: usize,
    /// Request (and reply) size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Requests measured.
    #[arg(long, default_value_t = 50_000)]
    pub requests: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Debug)]
pub struct ServerReport {
    pub bench: &'static str,
    pub endpoints: usize,
    pub mode: &'static str,
    pub inflight: usize,
    pub size: usize,
    pub requests: u64,
    pub rtt_p50_ns: u64,
    pub rtt_p99_ns: u64,
    pub req_per_s: f64,
    pub baseline: &'static str,
    pub baseline_rtt_p50_ns: u64,
    pub baseline_rtt_p99_ns: u64,
    pub baseline_req_per_s: f64,
    pub ratio_req_per_s: f64,
    pub setup_s: f64,
    pub placement: String,
    pub machine: sys::Machine,
}

/// What a client run measured.
struct Run {
    rtt: Samples,
    req_per_s: f64,
    setup: Duration,
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

pub fn run(a: &ServerArgs) -> Result<()> {
    if a.endpoints == 0 || a.size < 8 || a.inflight == 0 || a.inflight > a.endpoints {
        return Err("need endpoints ≥ 1, size ≥ 8, 1 ≤ inflight ≤ endpoints".into());
    }
    clan_shm::memfd::raise_fd_limit();
    sys::pin(0);
    let ours = clan_run(a)?;
    let base = tcp_run(a)?;
    let r = ServerReport {
        bench: "server",
        endpoints: a.endpoints,
        mode: match a.mode {
            Mode::Busy => "busy",
            Mode::Idle => "idle",
        },
        inflight: a.inflight,
        size: a.size,
        requests: a.requests,
        rtt_p50_ns: ours.rtt.p(0.5),
        rtt_p99_ns: ours.rtt.p(0.99),
        req_per_s: ours.req_per_s,
        baseline: "epoll-tcp",
        baseline_rtt_p50_ns: base.rtt.p(0.5),
        baseline_rtt_p99_ns: base.rtt.p(0.99),
        baseline_req_per_s: base.req_per_s,
        ratio_req_per_s: ratio(ours.req_per_s, base.req_per_s),
        setup_s: ours.setup.as_secs_f64(),
        placement: format!(
            "client pinned to CPU 0, server process (one thread) on CPU 1; requests on connections chosen at random, \
             {} in flight{}; clan server: event loop draining its queue then polling 15 µs; baseline: mio (epoll) TCP \
             server over loopback",
            a.inflight,
            if a.mode == Mode::Idle {
                format!(", {} µs between requests", IDLE_GAP.as_micros())
            } else {
                String::new()
            }
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench server: {} endpoints, {} mode, {} in flight, {}-byte requests     [paper: busy 7.9 µs, idle 16.8 µs, 340 000 req/s; GbE TCP 21 184 req/s]",
            r.endpoints, r.mode, r.inflight, r.size
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "clan      : RTT p50 {}, p99 {}, {:.0} req/s (connections set up in {:.2} s)",
            ns(r.rtt_p50_ns),
            ns(r.rtt_p99_ns),
            r.req_per_s,
            r.setup_s
        );
        println!(
            "epoll-tcp : RTT p50 {}, p99 {}, {:.0} req/s",
            ns(r.baseline_rtt_p50_ns),
            ns(r.baseline_rtt_p99_ns),
            r.baseline_req_per_s
        );
        println!("requests/s clan/epoll-tcp: {:.1}", r.ratio_req_per_s);
    });
    Ok(())
}

fn clan_run(a: &ServerArgs) -> Result<Run> {
    let mut peer = PeerProc::spawn(
        "srv-clan",
        &[format!("endpoints={}", a.endpoints), format!("size={}", a.size), "cpu=1".into()],
    )?;
    let addr: EndpointAddr = peer.recv()?.parse()?;
    let nic = Nic::open(NicConfig::default())?;
    let cfg = RpcConfig { max_msg: (a.size as u64).max(64), ..RpcConfig::default() };
    let t0 = Instant::now();
    let mut conns = Vec::with_capacity(a.endpoints);
    for _ in 0..a.endpoints {
        conns.push(RpcClient::connect(&nic, addr, &cfg)?);
    }
    let setup = t0.elapsed();
    let req = vec![0x5au8; a.size];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let warm = (a.requests / 10).max(100);
    let mut rtt = Samples::new();
    let mut measured = 0u64;
    let mut start = Instant::now();
    let mut sent = 0u64;
    // Calls in flight: connection index → start time.
    let mut inflight: Vec<(usize, Instant)> = Vec::with_capacity(a.inflight);
    let mut busy = vec![false; a.endpoints];
    while sent < warm + a.requests || !inflight.is_empty() {
        while inflight.len() < a.inflight && sent < warm + a.requests {
            let mut k = (rng(&mut x) % a.endpoints as u64) as usize;
            while busy[k] {
                k = (k + 1) % a.endpoints;
            }
            busy[k] = true;
            conns[k].send_with(|w| w.write(&req))?;
            inflight.push((k, Instant::now()));
            sent += 1;
        }
        if a.inflight == 1 {
            let (k, t) = inflight.pop().ok_or("nothing in flight")?;
            conns[k].wait_reply(Some(LIMIT), |r| r.len())?;
            busy[k] = false;
            let d = t.elapsed();
            if sent > warm {
                rtt.record(d);
                measured += 1;
            } else if sent == warm {
                start = Instant::now();
            }
            if a.mode == Mode::Idle {
                spin_sleep(IDLE_GAP);
            }
            continue;
        }
        // Many in flight: poll them all.
        let mut i = 0;
        while i < inflight.len() {
            let (k, t) = inflight[i];
            if conns[k].try_reply(|r| r.len())?.is_some() {
                busy[k] = false;
                inflight.swap_remove(i);
                if sent > warm + a.inflight as u64 {
                    rtt.record(t.elapsed());
                    measured += 1;
                } else if measured == 0 {
                    start = Instant::now();
                }
            } else {
                i += 1;
            }
        }
        if t0.elapsed() > LIMIT * 5 {
            return Err("the server stopped answering".into());
        }
    }
    let elapsed = start.elapsed();
    peer.send("stop")?;
    peer.finish()?;
    let idle_time = if a.mode == Mode::Idle { IDLE_GAP * measured as u32 } else { Duration::ZERO };
    // In idle mode the pauses are the client's choice: requests/s counts the time the
    // requests took (round trips), as a busy client would see.
    let busy_time = elapsed.saturating_sub(idle_time).max(Duration::from_nanos(1));
    Ok(Run { rtt, req_per_s: measured as f64 / busy_time.as_secs_f64(), setup })
}

/// Sleep `d` without a system call's worth of oversleeping (a short pause, as a client
/// thinking between requests).
fn spin_sleep(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

fn tcp_run(a: &ServerArgs) -> Result<Run> {
    let mut peer = PeerProc::spawn(
        "srv-tcp",
        &[format!("endpoints={}", a.endpoints), format!("size={}", a.size), "cpu=1".into()],
    )?;
    let addr: SocketAddr = peer.recv()?.parse()?;
    let t0 = Instant::now();
    let mut conns = Vec::with_capacity(a.endpoints);
    for _ in 0..a.endpoints {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(LIMIT))?;
        conns.push(s);
    }
    let setup = t0.elapsed();
    if a.inflight > 1 {
        for c in &conns {
            c.set_nonblocking(true)?;
        }
    }
    let req = vec![0x5au8; a.size];
    let mut reply = vec![0u8; a.size];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let warm = (a.requests / 10).max(100);
    let mut rtt = Samples::new();
    let mut measured = 0u64;
    let mut start = Instant::now();
    let mut sent = 0u64;
    let mut inflight: Vec<(usize, Instant, usize)> = Vec::with_capacity(a.inflight);
    let mut busy = vec![false; a.endpoints];
    while sent < warm + a.requests || !inflight.is_empty() {
        while inflight.len() < a.inflight && sent < warm + a.requests {
            let mut k = (rng(&mut x) % a.endpoints as u64) as usize;
            while busy[k] {
                k = (k + 1) % a.endpoints;
            }
            busy[k] = true;
            write_all_nb(&mut conns[k], &req)?;
            inflight.push((k, Instant::now(), 0));
            sent += 1;
        }
        if a.inflight == 1 {
            let (k, t, _) = inflight.pop().ok_or("nothing in flight")?;
            conns[k].read_exact(&mut reply)?;
            busy[k] = false;
            if sent > warm {
                rtt.record(t.elapsed());
                measured += 1;
            } else if sent == warm {
                start = Instant::now();
            }
            if a.mode == Mode::Idle {
                spin_sleep(IDLE_GAP);
            }
            continue;
        }
        let mut i = 0;
        while i < inflight.len() {
            let (k, t, got) = inflight[i];
            match conns[k].read(&mut reply[got..]) {
                Ok(0) => return Err("the TCP server closed a connection".into()),
                Ok(n) if got + n == a.size => {
                    busy[k] = false;
                    inflight.swap_remove(i);
                    if sent > warm + a.inflight as u64 {
                        rtt.record(t.elapsed());
                        measured += 1;
                    } else if measured == 0 {
                        start = Instant::now();
                    }
                    continue;
                }
                Ok(n) => inflight[i].2 = got + n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
            i += 1;
        }
        if t0.elapsed() > LIMIT * 5 {
            return Err("the TCP server stopped answering".into());
        }
    }
    let elapsed = start.elapsed();
    // The server closes first: the TIME_WAIT states are then on its side, and the client's
    // ephemeral ports are free for the next run at once.
    peer.send("stop")?;
    peer.finish()?;
    drop(conns);
    let idle_time = if a.mode == Mode::Idle { IDLE_GAP * measured as u32 } else { Duration::ZERO };
    let busy_time = elapsed.saturating_sub(idle_time).max(Duration::from_nanos(1));
    Ok(Run { rtt, req_per_s: measured as f64 / busy_time.as_secs_f64(), setup })
}

fn write_all_nb(s: &mut TcpStream, mut b: &[u8]) -> Result<()> {
    while !b.is_empty() {
        match s.write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The server processes.
pub fn peer(role: &str, args: &[String]) -> Result<()> {
    sys::pin(arg(args, "cpu")?);
    clan_shm::memfd::raise_fd_limit();
    let endpoints: usize = arg(args, "endpoints")?;
    let size: usize = arg(args, "size")?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        let _ = Link::hear();
        s2.store(true, std::sync::atomic::Ordering::Release);
    });
    match role {
        "srv-clan" => {
            let nic = Nic::open(NicConfig::default())?;
            let cfg = RpcConfig { max_msg: (size as u64).max(64), ..RpcConfig::default() };
            let rpc = RpcServer::bind(&nic, cfg, endpoints as u32 + 16)?;
            Link::say(rpc.local_addr());
            let q = rpc.event_queue().clone();
            let rpc = std::rc::Rc::new(std::cell::RefCell::new(rpc));
            let r2 = rpc.clone();
            let mut el = EventLoop::new(Duration::from_micros(15))?;
            let mut buf = vec![0u8; size];
            el.add_queue(&q, move |ev| {
                let _ = r2.borrow_mut().handle_event(ev, &mut |_, req, reply| {
                    // The request in place; the reply written straight into the client.
                    let n = (req.len() as usize).min(buf.len());
                    if req.read(0, &mut buf[..n]).is_ok() {
                        let _ = reply.write(&buf[..n]);
                    }
                });
            })?;
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                el.run_once(Some(Duration::from_millis(20)))?;
            }
            drop(rpc);
        }
        "srv-tcp" => {
            use mio::net::TcpListener;
            use mio::{Events, Interest, Poll, Token};
            let mut l = TcpListener::bind("127.0.0.1:0".parse()?)?;
            Link::say(l.local_addr()?);
            let mut poll = Poll::new()?;
            poll.registry().register(&mut l, Token(0), Interest::READABLE)?;
            let mut events = Events::with_capacity(1024);
            let mut conns: HashMap<usize, (mio::net::TcpStream, Vec<u8>)> = HashMap::new();
            let mut next = 1usize;
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match poll.poll(&mut events, Some(Duration::from_millis(20))) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                }
                for ev in events.iter() {
                    if ev.token() == Token(0) {
                        while let Ok((mut s, _)) = l.accept() {
                            s.set_nodelay(true)?;
                            poll.registry().register(&mut s, Token(next), Interest::READABLE)?;
                            conns.insert(next, (s, Vec::with_capacity(size)));
                            next += 1;
                        }
                        continue;
                    }
                    let id = ev.token().0;
                    let mut gone = false;
                    if let Some((s, pending)) = conns.get_mut(&id) {
                        let mut buf = [0u8; 4096];
                        loop {
                            match s.read(&mut buf) {
                                Ok(0) => {
                                    gone = true;
                                    break;
                                }
                                Ok(n) => {
                                    pending.extend_from_slice(&buf[..n]);
                                    while pending.len() >= size {
                                        let reply: Vec<u8> = pending.drain(..size).collect();
                                        write_all_mio(s, &reply)?;
                                    }
                                }
                                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                                Err(_) => {
                                    gone = true;
                                    break;
                                }
                            }
                        }
                    }
                    if gone {
                        if let Some((mut s, _)) = conns.remove(&id) {
                            let _ = poll.registry().deregister(&mut s);
                        }
                    }
                }
            }
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

fn write_all_mio(s: &mut mio::net::TcpStream, mut b: &[u8]) -> Result<()> {
    while !b.is_empty() {
        match s.write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
