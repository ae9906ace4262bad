//! `clan bench connect`: how long it takes to set up a connection and get the first byte
//! echoed, and how many connections per second one client makes, against kernel TCP and
//! Unix sockets in the same run.
//!
//! A server process (pinned to CPU 1) listens on a clan stream listener, a TCP listener on
//! loopback and a Unix socket; for each connection it reads one byte, writes it back and
//! closes. The client (CPU 0) times `connect` + write one byte + read the echo, then drops
//! the connection; the three kinds alternate in rounds, so that each sees the same machine.
//! The clan client keeps one NIC for all its connections (as a process that connects more
//! than once does).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

/// Arguments of `clan bench connect`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Connections measured per kind.
    #[arg(long, default_value_t = 2000)]
    pub iters: u64,
    /// Rounds the kinds alternate in.
    #[arg(long, default_value_t = 4)]
    pub rounds: u64,
    /// Ring of each clan stream side (default: what `StreamConfig::default()` gives, the
    /// stream a user opens without configuring it).
    #[arg(long, default_value_t = StreamConfig::default().ring)]
    pub ring: u64,
    /// Post area of each clan stream side (where large writes are posted for the reader to
    /// fetch; default: `StreamConfig::default()`'s).
    #[arg(long, default_value_t = StreamConfig::default().post_area)]
    pub post_area: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct ConnectReport {
    pub bench: &'static str,
    pub iters: u64,
    pub connect_p50_ns: u64,
    pub connect_p99_ns: u64,
    pub conns_per_s: f64,
    pub tcp_connect_p50_ns: u64,
    pub tcp_connect_p99_ns: u64,
    pub tcp_conns_per_s: f64,
    pub unix_connect_p50_ns: u64,
    pub unix_connect_p99_ns: u64,
    pub unix_conns_per_s: f64,
    pub baseline: &'static str,
    pub ratio_p50_vs_tcp: f64,
    pub ratio_p50_vs_unix: f64,
    pub placement: String,
    pub machine: sys::Machine,
}

#[derive(Clone, Copy)]
enum Kind {
    Clan,
    Tcp,
    Unix,
}

struct Targets {
    clan: EndpointAddr,
    tcp: SocketAddr,
    unix: String,
}

fn once(kind: Kind, t: &Targets, nic: &Nic, cfg: &StreamConfig) -> Result<()> {
    let mut b = [7u8; 1];
    match kind {
        Kind::Clan => {
            let mut s = Stream::connect_with(nic, t.clan, cfg)?;
            s.write_all(&b)?;
            s.read_exact(&mut b)?;
        }
        Kind::Tcp => {
            let mut s = TcpStream::connect(t.tcp)?;
            s.set_nodelay(true)?;
            s.write_all(&b)?;
            s.read_exact(&mut b)?;
        }
        Kind::Unix => {
            let mut s =
                UnixStream::connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(t.unix.as_bytes())?)?;
            s.write_all(&b)?;
            s.read_exact(&mut b)?;
        }
    }
    Ok(())
}

pub fn run(a: &ConnectArgs) -> Result<()> {
    sys::pin(0);
    let unix = format!("clan-bench-connect-{}", std::process::id());
    let mut peer = PeerProc::spawn(
        Role::ConnServer,
        &ServerArgs { ring: a.ring, post_area: a.post_area, unix: unix.clone(), cpu: 1 },
    )?;
    let line = peer.recv()?;
    let mut it = line.split(' ');
    let t =
        Targets { clan: it.next().ok_or("no address")?.parse()?, tcp: it.next().ok_or("no address")?.parse()?, unix };
    let nic = Nic::open(NicConfig::default())?;
    let cfg = StreamConfig { ring: a.ring, post_area: a.post_area, ..StreamConfig::default() };
    let kinds = [Kind::Clan, Kind::Tcp, Kind::Unix];
    let mut samples = [Samples::new(), Samples::new(), Samples::new()];
    let mut spent = [Duration::ZERO; 3];
    // Warm up every path (the first clan connect also sets up the NICs' control channels).
    for k in kinds {
        for _ in 0..20 {
            once(k, &t, &nic, &cfg)?;
        }
    }
    let per = a.iters.div_ceil(a.rounds.max(1));
    for _ in 0..a.rounds.max(1) {
        for (i, k) in kinds.into_iter().enumerate() {
            let start = Instant::now();
            for _ in 0..per {
                let t0 = Instant::now();
                once(k, &t, &nic, &cfg)?;
                samples[i].record(t0.elapsed());
            }
            spent[i] += start.elapsed();
        }
    }
    peer.send("stop")?;
    peer.finish()?;
    let n = per * a.rounds.max(1);
    let rate = |i: usize| n as f64 / spent[i].as_secs_f64();
    let r = ConnectReport {
        bench: "connect",
        iters: n,
        connect_p50_ns: samples[0].p(0.5),
        connect_p99_ns: samples[0].p(0.99),
        conns_per_s: rate(0),
        tcp_connect_p50_ns: samples[1].p(0.5),
        tcp_connect_p99_ns: samples[1].p(0.99),
        tcp_conns_per_s: rate(1),
        unix_connect_p50_ns: samples[2].p(0.5),
        unix_connect_p99_ns: samples[2].p(0.99),
        unix_conns_per_s: rate(2),
        baseline: "tcp",
        ratio_p50_vs_tcp: ratio(samples[0].p(0.5) as f64, samples[1].p(0.5) as f64),
        ratio_p50_vs_unix: ratio(samples[0].p(0.5) as f64, samples[2].p(0.5) as f64),
        placement: format!(
            "client pinned to CPU 0, server process to CPU 1 (its NIC engine unpinned); one connection at a time: \
             connect, write 1 byte, read its echo, close; the kinds alternate in rounds; clan streams with {} KiB \
             rings and {} KiB post areas",
            a.ring >> 10,
            a.post_area >> 10
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!("clan bench connect: connect + first byte echoed, {} connections per kind", r.iters);
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!(
            "clan stream : p50 {}, p99 {}, {:.0} connections/s",
            ns(r.connect_p50_ns),
            ns(r.connect_p99_ns),
            r.conns_per_s
        );
        println!(
            "kernel TCP  : p50 {}, p99 {}, {:.0} connections/s",
            ns(r.tcp_connect_p50_ns),
            ns(r.tcp_connect_p99_ns),
            r.tcp_conns_per_s
        );
        println!(
            "unix socket : p50 {}, p99 {}, {:.0} connections/s",
            ns(r.unix_connect_p50_ns),
            ns(r.unix_connect_p99_ns),
            r.unix_conns_per_s
        );
        println!("ratio clan/tcp at p50: {:.2}; clan/unix: {:.2}", r.ratio_p50_vs_tcp, r.ratio_p50_vs_unix);
    });
    Ok(())
}

/// What the server is told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ServerArgs {
    /// Bytes of ring per clan stream.
    ring: u64,
    /// Bytes of post area per clan stream.
    post_area: u64,
    /// The abstract name of its Unix listener.
    unix: String,
    cpu: usize,
}

/// The server: three listeners, one thread each; every connection echoes one byte and closes.
pub fn peer(a: ServerArgs) -> Result<()> {
    sys::pin(a.cpu);
    let ServerArgs { ring, post_area, unix, .. } = a;
    let nic = Nic::open(NicConfig::default())?;
    let l = Listener::bind_with(&nic, None, StreamConfig { ring, post_area, ..StreamConfig::default() })?;
    let tcp = TcpListener::bind("127.0.0.1:0")?;
    let ul = UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(unix.as_bytes())?)?;
    Link::say(format!("{} {}", l.local_addr(), tcp.local_addr()?));
    fn echo(mut s: impl Read + Write) {
        let mut b = [0u8; 1];
        if s.read_exact(&mut b).is_ok() {
            let _ = s.write_all(&b);
        }
    }
    std::thread::spawn(move || {
        for s in l.incoming() {
            match s {
                Ok(s) => echo(s),
                Err(e) => eprintln!("clan bench connect: accept failed: {e}"),
            }
        }
    });
    std::thread::spawn(move || {
        for s in tcp.incoming().flatten() {
            let _ = s.set_nodelay(true);
            echo(s);
        }
    });
    std::thread::spawn(move || {
        for s in ul.incoming().flatten() {
            echo(s);
        }
    });
    let _ = Link::hear();
    Ok(())
}
