//! `clan bench tokio`: many concurrent request/response clients on one tokio runtime against
//! an echo server on another, clan's async streams against tokio over Unix sockets and over
//! loopback TCP, same run, same placement.
//!
//! Both processes run a current-thread runtime pinned to one CPU (client on CPU 0, server on
//! CPU 1), so a figure is the cost of the I/O path and not of work stealing. Each client
//! writes `size` bytes and reads them back, over and over; the requests completed in the
//! measured window give requests/s, and each one's time gives the round-trip percentiles.

use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use clan::{EndpointAddr, EventQueueConfig, Nic, NicConfig};
use clan_proto::stream::StreamConfig;
use clan_proto::tokio::Reactor;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::report::{Percentiles, Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

/// Requests/s of clan over tokio-over-Unix-sockets: the target (at least as many).
const TARGET_VS_UNIX: f64 = 1.0;
/// Requests before the measured window (per client).
const WARM: Duration = Duration::from_millis(200);
/// How long past its window a client may go on for its first request.
const STALLED: Duration = Duration::from_secs(10);

/// Arguments of `clan bench tokio`.
#[derive(clap::Args, Debug, Clone)]
pub struct TokioArgs {
    /// Concurrent clients, one run per count (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [4usize, 64])]
    pub clients: Vec<usize>,
    /// Request (and response) size (bytes; units accepted: 4KiB, 1MiB).
    #[arg(long, default_value = "64", value_parser = sys::size_usize)]
    pub size: usize,
    /// Measured time of each run, in milliseconds (after a 200 ms warm-up).
    #[arg(long, default_value_t = 2000)]
    pub millis: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One transport at one client count.
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy)]
pub struct TokioRun {
    pub requests_per_s: f64,
    pub rtt: Percentiles,
}

/// All transports at one client count.
#[derive(Serialize, serde::Deserialize, Debug)]
pub struct TokioPoint {
    pub clients: usize,
    /// Both reactors spin for `spin_us` before sleeping.
    pub clan: TokioRun,
    /// Both reactors sleep at once (no spinning anywhere).
    pub clan_no_spin: TokioRun,
    pub unix: TokioRun,
    pub tcp: TokioRun,
    /// clan's requests/s over tokio-over-Unix's.
    pub ratio_vs_unix: f64,
    /// clan's requests/s over tokio-over-Unix's, neither side spinning.
    pub ratio_no_spin_vs_unix: f64,
    /// clan's requests/s over tokio-over-TCP's.
    pub ratio_vs_tcp: f64,
    pub target_met: bool,
}

/// The report of `clan bench tokio`.
#[derive(Serialize, serde::Deserialize, Debug)]
pub struct TokioReport {
    pub machine: sys::Machine,
    pub placement: &'static str,
    pub size: usize,
    pub spin_us: u64,
    pub target_vs_unix: f64,
    pub points: Vec<TokioPoint>,
}

/// `clan bench tokio`.
pub fn run(a: &TokioArgs) -> Result<()> {
    if a.clients.is_empty() || a.clients.contains(&0) {
        return Err("--clients needs one or more counts above zero".into());
    }
    if a.size == 0 {
        return Err("--size must be above zero".into());
    }
    sys::pin(0);
    let window = Duration::from_millis(a.millis.max(1));
    let mut points = Vec::new();
    for &n in &a.clients {
        let [clan, clan_no_spin, unix, tcp] =
            ["clan", "clan-no-spin", "unix", "tcp"].map(|k| one_run(k, n, a.size, window));
        let (clan, clan_no_spin, unix, tcp) = (clan?, clan_no_spin?, unix?, tcp?);
        let r = ratio(clan.requests_per_s, unix.requests_per_s);
        points.push(TokioPoint {
            clients: n,
            ratio_vs_unix: r,
            ratio_no_spin_vs_unix: ratio(clan_no_spin.requests_per_s, unix.requests_per_s),
            ratio_vs_tcp: ratio(clan.requests_per_s, tcp.requests_per_s),
            target_met: r >= TARGET_VS_UNIX,
            clan,
            clan_no_spin,
            unix,
            tcp,
        });
        if !a.json {
            eprintln!("clan bench tokio: {n} clients done");
        }
    }
    let report = TokioReport {
        machine: sys::machine(),
        placement: "clients: one current-thread tokio runtime on CPU 0; echo server: one on CPU 1",
        size: a.size,
        spin_us: clan::default_spin().as_micros() as u64,
        target_vs_unix: TARGET_VS_UNIX,
        points,
    };
    emit(a.json, &report, || {
        println!("{}; {} B requests; clan spins {} µs (CLAN_SPIN_US)", report.placement, report.size, report.spin_us);
        println!(
            "{:>8} {:>12} {:>14} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7} {:>9} {:>7}",
            "clients",
            "clan req/s",
            "no-spin req/s",
            "unix req/s",
            "tcp req/s",
            "clan p50",
            "no-spin p50",
            "unix p50",
            "tcp p50",
            "/unix",
            "no-spin/u",
            "/tcp"
        );
        for p in &report.points {
            println!(
                "{:>8} {:>12.0} {:>14.0} {:>12.0} {:>12.0} {:>10} {:>10} {:>10} {:>10} {:>7.2} {:>9.2} {:>7.2}{}",
                p.clients,
                p.clan.requests_per_s,
                p.clan_no_spin.requests_per_s,
                p.unix.requests_per_s,
                p.tcp.requests_per_s,
                ns(p.clan.rtt.p50_ns),
                ns(p.clan_no_spin.rtt.p50_ns),
                ns(p.unix.rtt.p50_ns),
                ns(p.tcp.rtt.p50_ns),
                p.ratio_vs_unix,
                p.ratio_no_spin_vs_unix,
                p.ratio_vs_tcp,
                if p.target_met { "" } else { "  (goal ≥ 1.0× unix: not met)" }
            );
        }
    });
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// The reactor of a clan run: spinning as configured (`clan`) or not at all.
fn reactor(nic: &Nic, kind: &str) -> Result<Reactor> {
    let mut cfg = EventQueueConfig { ring_capacity: 1 << 14, ..EventQueueConfig::default() };
    if kind == "clan-no-spin" {
        cfg.spin = Duration::ZERO;
    }
    Ok(Reactor::with_queue(nic, cfg)?)
}

/// `n` clients of transport `kind` against a fresh echo server.
fn one_run(kind: &str, n: usize, size: usize, window: Duration) -> Result<TokioRun> {
    let mut peer = PeerProc::spawn(Role::TokEcho, &EchoArgs { kind: kind.to_owned(), clients: n, size, cpu: 1 })?;
    let addr = peer.recv()?;
    let rt = runtime()?;
    let (count, samples) = rt.block_on(async {
        let mut conns: Vec<Box<dyn Duplex>> = Vec::with_capacity(n);
        match kind {
            "clan" | "clan-no-spin" => {
                let nic = Nic::open(NicConfig::default())?;
                let reactor = reactor(&nic, kind)?;
                let to: EndpointAddr = addr.parse()?;
                for _ in 0..n {
                    conns.push(Box::new(reactor.connect(to, StreamConfig::default()).await?));
                }
            }
            "unix" => {
                for _ in 0..n {
                    let s = std::os::unix::net::UnixStream::connect_addr(
                        &std::os::unix::net::SocketAddr::from_abstract_name(addr.as_bytes())?,
                    )?;
                    s.set_nonblocking(true)?;
                    conns.push(Box::new(tokio::net::UnixStream::from_std(s)?));
                }
            }
            _ => {
                for _ in 0..n {
                    let s = tokio::net::TcpStream::connect(addr.as_str()).await?;
                    s.set_nodelay(true)?;
                    conns.push(Box::new(s));
                }
            }
        }
        let start = Instant::now() + WARM;
        let end = start + window;
        let tasks: Vec<_> = conns.into_iter().map(|c| tokio::spawn(client(c, size, start, end))).collect();
        let mut count = 0u64;
        let mut all = Samples::new();
        for t in tasks {
            let (c, s) = t.await??;
            count += c;
            all.merge(&s);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((count, all))
    })?;
    drop(rt);
    peer.finish()?;
    Ok(TokioRun { requests_per_s: count as f64 / window.as_secs_f64(), rtt: samples.summary() })
}

/// A byte stream tokio can drive.
trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// Requests until `end`; those completed between `start` and `end` are counted and timed
/// (and the first one started after `start` if none did: a machine busy with other work can
/// let a short window pass without a request completing in it).
async fn client(mut c: Box<dyn Duplex>, size: usize, start: Instant, end: Instant) -> Result<(u64, Samples)> {
    let req: Vec<u8> = (0..size).map(|i| (i * 7 + 1) as u8).collect();
    let mut resp = vec![0u8; size];
    let mut s = Samples::new();
    let mut count = 0u64;
    loop {
        let t0 = Instant::now();
        // (past the window only while it has no request of its own: on a loaded machine a
        // short window can pass without one, which is no figure; a request that never
        // comes back is an error)
        if t0 >= end && count > 0 {
            break;
        }
        if t0 >= end + STALLED {
            return Err(format!("no request of this client came back within {STALLED:?} after the window").into());
        }
        c.write_all(&req).await?;
        c.read_exact(&mut resp).await?;
        let t1 = Instant::now();
        if resp != req {
            return Err("the echo server returned other bytes".into());
        }
        if t0 >= start && (t1 <= end || count == 0) {
            count += 1;
            s.record(t1 - t0);
        }
    }
    c.shutdown().await?;
    Ok((count, s))
}

/// What the echo server is told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct EchoArgs {
    /// The transport: clan, clan-no-spin, unix or tcp.
    kind: String,
    clients: usize,
    size: usize,
    cpu: usize,
}

/// The echo server: accept `clients` connections, echo each until its end of stream.
pub fn peer(a: EchoArgs) -> Result<()> {
    sys::pin(a.cpu);
    let EchoArgs { kind, clients: n, size, .. } = a;
    let rt = runtime()?;
    rt.block_on(async move {
        let mut tasks = Vec::with_capacity(n);
        match kind.as_str() {
            "clan" | "clan-no-spin" => {
                let nic = Nic::open(NicConfig::default())?;
                let reactor = reactor(&nic, &kind)?;
                let l = reactor.bind(StreamConfig::default())?;
                Link::say(l.local_addr());
                for _ in 0..n {
                    let (s, _) = l.accept().await?;
                    tasks.push(tokio::spawn(echo(Box::new(s), size)));
                }
            }
            "unix" => {
                let name = format!("clan-bench-tokio-{}", std::process::id());
                let l = std::os::unix::net::UnixListener::bind_addr(
                    &std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?,
                )?;
                l.set_nonblocking(true)?;
                let l = tokio::net::UnixListener::from_std(l)?;
                Link::say(&name);
                for _ in 0..n {
                    let (s, _) = l.accept().await?;
                    tasks.push(tokio::spawn(echo(Box::new(s), size)));
                }
            }
            "tcp" => {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                Link::say(l.local_addr()?);
                for _ in 0..n {
                    let (s, _) = l.accept().await?;
                    s.set_nodelay(true)?;
                    tasks.push(tokio::spawn(echo(Box::new(s), size)));
                }
            }
            other => return Err(format!("unknown kind {other}").into()),
        }
        for t in tasks {
            t.await??;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
}

async fn echo(mut s: Box<dyn Duplex>, size: usize) -> Result<()> {
    let mut buf = vec![0u8; size];
    loop {
        match s.read_exact(&mut buf).await {
            Ok(_) => s.write_all(&buf).await?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}
