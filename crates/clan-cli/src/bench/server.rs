//! `clan bench server`: the Tripwire paper's event-driven server (§5.3, figures 8 and 9).
//!
//! The server process runs one thread: a clan [`clan_proto::server::EventLoop`] whose only
//! descriptor is the event queue of all its RPC connections. The client process opens N
//! connections and sends requests on connections chosen at random: one in flight, or K.
//! `busy`: back to back; `idle`: a pause longer than the server's polling time between
//! requests, so that a server that sleeps when idle goes to sleep each time. A round trip is
//! timed from before the request is sent to its reply taken, as the raw baselines are.
//!
//! Baseline in the same run: an epoll (mio) TCP server, one thread, with the same N
//! connections (loopback), the same request size and the same client pattern.
//!
//! Every ratio is measured twice, like for like:
//!
//! - **spin**: both sides poll and never sleep. clan: the event loop drains its queue and
//!   keeps polling it, the client polls its reply flags; TCP: the server busy-polls
//!   `epoll_wait` with a timeout of 0, the client polls its sockets (`recv` with
//!   `MSG_DONTWAIT`).
//! - **block**: both sides sleep as soon as there is nothing to do. clan: the event loop polls
//!   for 0 (epoll on the queue's descriptor), the client sleeps on its reply tripwire at once;
//!   TCP: the server sleeps in `epoll_wait` (20 ms at a time), the client blocks in `read`.
//!
//! Then clan alone as the paper runs it (`policy`: the loop polls a drained queue 15 µs
//! before sleeping, the client polls 15 µs before sleeping), and, in the same run, the raw
//! shared-memory ping-pong of `clan bench latency --sync spin` with the request size: the
//! floor any round trip between these two CPUs meets (target: spinning busy RTT ≤ 2× it).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, EventQueue, Nic, NicConfig};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::server::EventLoop;
use serde::Serialize;

use super::report::{Samples, emit, ns, ratio, verdict};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

const LIMIT: Duration = Duration::from_secs(60);
/// The pause between requests in idle mode: longer than the server's 15 µs of polling.
const IDLE_GAP: Duration = Duration::from_micros(60);
/// How long a spinning clan event loop polls a drained queue: far longer than any gap
/// between two requests of a run, so that it never sleeps while the run goes on.
const BUSY_POLL: Duration = Duration::from_millis(10);
/// The paper's polling time (T §5.3).
const POLICY_POLL: Duration = Duration::from_micros(15);
/// Requests per second, clan over the epoll TCP server: the target, both ways.
const TARGET_REQ_RATIO: f64 = 20.0;
/// Busy round trip (both sides spinning) over the raw shared-memory ping-pong: the target.
const TARGET_RAW_SHM: f64 = 2.0;

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
    /// Request (and reply) size (bytes; units accepted: 4KiB).
    #[arg(long, default_value = "64", value_parser = sys::size_usize)]
    pub size: usize,
    /// Requests measured (per measurement: spin and block for clan and TCP, clan's policy,
    /// the raw ping-pong), split over the rounds.
    #[arg(long, default_value_t = 50_000)]
    pub requests: u64,
    /// Rounds: each measurement of one system alternates with the others of it this many
    /// times (samples merged), so that drift of a shared machine favours none.
    #[arg(long, default_value_t = 3)]
    pub rounds: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// How both sides of a measurement wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    /// Poll, never sleep.
    Spin,
    /// Sleep at once.
    Block,
    /// The paper's: poll 15 µs, then sleep (clan only).
    Policy,
}

impl Sync {
    fn name(self) -> &'static str {
        match self {
            Sync::Spin => "spin",
            Sync::Block => "block",
            Sync::Policy => "policy",
        }
    }
    fn code(self) -> u8 {
        match self {
            Sync::Spin => 1,
            Sync::Block => 2,
            Sync::Policy => 3,
        }
    }
    fn from_code(c: u8) -> Sync {
        match c {
            1 => Sync::Spin,
            3 => Sync::Policy,
            _ => Sync::Block,
        }
    }
}

/// One side's figures.
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy)]
pub struct Figures {
    pub rtt_p50_ns: u64,
    pub rtt_p90_ns: u64,
    pub rtt_p99_ns: u64,
    pub req_per_s: f64,
}

/// clan against the epoll TCP server, both waiting the same way.
#[derive(Serialize, serde::Deserialize, Debug)]
pub struct Compared {
    /// How both sides waited.
    pub how: &'static str,
    pub clan: Figures,
    pub baseline: Figures,
    /// Requests per second, clan / epoll-tcp (above 1: clan serves more).
    pub ratio_req_per_s: f64,
    /// RTT p50, clan / epoll-tcp (below 1: clan answers sooner).
    pub ratio_rtt_p50: f64,
    /// `ratio_req_per_s` ≥ the target.
    pub target_met: bool,
}

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct ServerReport {
    pub bench: &'static str,
    pub endpoints: usize,
    pub mode: &'static str,
    pub inflight: usize,
    pub size: usize,
    pub requests: u64,
    pub rounds: u64,
    /// clan as the paper runs it (policy: poll 15 µs, then sleep; no baseline waits that way).
    pub rtt_p50_ns: u64,
    pub rtt_p99_ns: u64,
    pub req_per_s: f64,
    pub policy: &'static str,
    pub baseline: &'static str,
    /// Both sides spinning.
    pub spin: Compared,
    /// Both sides blocking.
    pub block: Compared,
    /// Requests per second, clan / epoll-tcp, both sides spinning.
    pub ratio_spin: f64,
    /// Requests per second, clan / epoll-tcp, both sides blocking.
    pub ratio_block: f64,
    /// RTT p50, clan / epoll-tcp, both sides spinning.
    pub rtt_ratio_spin: f64,
    /// RTT p50, clan / epoll-tcp, both sides blocking.
    pub rtt_ratio_block: f64,
    pub target: String,
    /// "both ways", "spinning only", "blocking only" or "neither".
    pub target_met: &'static str,
    /// The raw shared-memory ping-pong (one in flight only).
    pub raw_shm_rtt_p50_ns: Option<u64>,
    pub raw_shm_rtt_p99_ns: Option<u64>,
    /// clan's spinning RTT p50 / the raw ping-pong's.
    pub raw_shm_ratio: Option<f64>,
    pub raw_shm_target: String,
    pub raw_shm_target_met: Option<bool>,
    /// The raw ping-pong over as many slots as endpoints, a page each, chosen at random (one
    /// in flight only): the floor of a round trip that touches cold memory as often.
    pub raw_slots_rtt_p50_ns: Option<u64>,
    pub raw_slots_rtt_p99_ns: Option<u64>,
    /// clan's spinning RTT p50 / the raw ping-pong's over as many slots.
    pub raw_slots_ratio: Option<f64>,
    /// The same over slots packed on cache lines (as clan's pools carve small connection
    /// sides): the floor of a layout that touches as few pages.
    pub raw_packed_rtt_p50_ns: Option<u64>,
    pub raw_packed_rtt_p99_ns: Option<u64>,
    pub raw_packed_ratio: Option<f64>,
    pub setup_s: f64,
    /// Descriptors, mappings and resident memory of both processes with every connection up.
    pub footprint_clan: Footprint,
    pub footprint_tcp: Footprint,
    pub per_endpoint_clan: PerEndpoint,
    pub per_endpoint_tcp: PerEndpoint,
    pub placement: String,
    pub machine: sys::Machine,
}

/// What a set of connections holds: descriptors, memory mappings and resident memory of the
/// client and the server process together, from `/proc`.
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy, Default)]
pub struct Footprint {
    pub fds: u64,
    pub maps: u64,
    pub rss_kib: u64,
}

impl Footprint {
    fn of(pid: u32) -> Footprint {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_or(0, |m| m.lines().count() as u64);
        let rss_kib = crate::sys::rss_bytes(pid) / 1024;
        Footprint { fds, maps, rss_kib }
    }

    fn of_both(server: u32) -> Footprint {
        let (a, b) = (Footprint::of(std::process::id()), Footprint::of(server));
        Footprint { fds: a.fds + b.fds, maps: a.maps + b.maps, rss_kib: a.rss_kib + b.rss_kib }
    }

    /// Per endpoint: the whole divided by the endpoints (fixed costs included).
    fn per(&self, n: usize) -> PerEndpoint {
        let n = n.max(1) as f64;
        PerEndpoint { fds: self.fds as f64 / n, maps: self.maps as f64 / n, rss_kib: self.rss_kib as f64 / n }
    }
}

#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy, Default)]
pub struct PerEndpoint {
    pub fds: f64,
    pub maps: f64,
    pub rss_kib: f64,
}

/// What client runs measured (merged over rounds).
#[derive(Default)]
struct Run {
    rtt: Samples,
    /// Requests measured and the time they took.
    measured: u64,
    busy: Duration,
}

impl Run {
    fn merge(&mut self, o: &Run) {
        self.rtt.merge(&o.rtt);
        self.measured += o.measured;
        self.busy += o.busy;
    }
    fn req_per_s(&self) -> f64 {
        self.measured as f64 / self.busy.as_secs_f64().max(1e-9)
    }
    fn figures(&self) -> Figures {
        Figures {
            rtt_p50_ns: self.rtt.p(0.5),
            rtt_p90_ns: self.rtt.p(0.9),
            rtt_p99_ns: self.rtt.p(0.99),
            req_per_s: self.req_per_s(),
        }
    }
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Requests measured per round, and the warm-up before them.
fn per_round(a: &ServerArgs) -> (u64, u64) {
    let n = a.requests.div_ceil(a.rounds.max(1));
    (n, (n / 10).max(100))
}

pub fn run(a: &ServerArgs) -> Result<()> {
    if a.endpoints == 0 || a.size < 8 || a.inflight == 0 || a.inflight > a.endpoints || a.requests == 0 {
        return Err("need endpoints ≥ 1, size ≥ 8, 1 ≤ inflight ≤ endpoints, requests ≥ 1".into());
    }
    clan_shm::memfd::raise_fd_limit();
    let pinned = sys::pin(0);
    let (n, warm) = per_round(a);
    // clan first, each way in rounds (with the raw ping-pong), then the TCP server each way
    // in rounds: one set of connections alive at a time (10 000 endpoints are 10 000
    // connections of each kind).
    let rounds = a.rounds.max(1);
    let bar = super::report::progress(2 + rounds * (3 + u64::from(a.inflight == 1) + 2), a.json);
    bar.set_message(format!("clan: {} connections", a.endpoints));
    let mut clan = ClanSide::start(a)?;
    bar.inc(1);
    let footprint_clan = Footprint::of_both(clan.peer.pid());
    let (mut clan_spin, mut clan_block, mut clan_policy) = (Run::default(), Run::default(), Run::default());
    let (mut raw, mut raw_slots, mut raw_packed): (Option<Samples>, Option<Samples>, Option<Samples>) =
        (None, None, None);
    for _ in 0..a.rounds.max(1) {
        bar.set_message("clan, both sides spinning");
        clan_spin.merge(&clan.measure(a, Sync::Spin)?);
        bar.inc(1);
        if a.inflight == 1 {
            // The clan server sleeps meanwhile (parked).
            bar.set_message("raw shared-memory ping-pong");
            raw.get_or_insert_with(Samples::new).merge(&super::latency::raw_shm(a.size, n + warm, warm, 1)?);
            if a.endpoints > 1 {
                bar.set_message(format!("raw shared-memory ping-pong over {} slots", a.endpoints));
                let slots = super::latency::raw_shm_slots(a.size, a.endpoints, false, n + warm, warm, 1)?;
                raw_slots.get_or_insert_with(Samples::new).merge(&slots);
                let packed = super::latency::raw_shm_slots(a.size, a.endpoints, true, n + warm, warm, 1)?;
                raw_packed.get_or_insert_with(Samples::new).merge(&packed);
            }
            bar.inc(1);
        }
        bar.set_message("clan, both sides blocking");
        clan_block.merge(&clan.measure(a, Sync::Block)?);
        bar.inc(1);
        bar.set_message("clan, as the paper runs it");
        clan_policy.merge(&clan.measure(a, Sync::Policy)?);
        bar.inc(1);
    }
    let setup = clan.setup;
    clan.stop()?;
    bar.set_message(format!("epoll TCP: {} connections", a.endpoints));
    let mut tcp = TcpSide::start(a)?;
    bar.inc(1);
    let footprint_tcp = Footprint::of_both(tcp.peer.pid());
    let (mut tcp_spin, mut tcp_block) = (Run::default(), Run::default());
    for _ in 0..a.rounds.max(1) {
        bar.set_message("epoll TCP, busy-polling");
        tcp_spin.merge(&tcp.measure(a, Sync::Spin)?);
        bar.inc(1);
        bar.set_message("epoll TCP, blocking");
        tcp_block.merge(&tcp.measure(a, Sync::Block)?);
        bar.inc(1);
    }
    tcp.stop()?;
    bar.finish_and_clear();
    let compare = |how, c: &Run, t: &Run| {
        let r = ratio(c.req_per_s(), t.req_per_s());
        Compared {
            how,
            clan: c.figures(),
            baseline: t.figures(),
            ratio_req_per_s: r,
            ratio_rtt_p50: ratio(c.rtt.p(0.5) as f64, t.rtt.p(0.5) as f64),
            target_met: r >= TARGET_REQ_RATIO,
        }
    };
    let spin = compare(
        "both sides spin: clan's event loop polls its queue and never sleeps, its client polls the reply flags; \
         the TCP server busy-polls epoll_wait with a timeout of 0, its client polls its sockets (MSG_DONTWAIT)",
        &clan_spin,
        &tcp_spin,
    );
    let block = compare(
        "both sides block: clan's event loop polls for 0 and sleeps in epoll on its queue's descriptor, its \
         client sleeps on the reply tripwire at once; the TCP server sleeps in epoll_wait, its client in read",
        &clan_block,
        &tcp_block,
    );
    let raw_p50 = raw.as_ref().map(|s| s.p(0.5));
    let raw_ratio = raw_p50.map(|b| ratio(clan_spin.rtt.p(0.5) as f64, b as f64));
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
        rounds: a.rounds.max(1),
        rtt_p50_ns: clan_policy.rtt.p(0.5),
        rtt_p99_ns: clan_policy.rtt.p(0.99),
        req_per_s: clan_policy.req_per_s(),
        policy: "clan as the paper runs it: the event loop polls a drained queue 15 µs, then sleeps; the client \
                 polls 15 µs, then sleeps",
        baseline: "epoll-tcp",
        ratio_spin: spin.ratio_req_per_s,
        ratio_block: block.ratio_req_per_s,
        rtt_ratio_spin: spin.ratio_rtt_p50,
        rtt_ratio_block: block.ratio_rtt_p50,
        target: format!("requests/s ≥ {TARGET_REQ_RATIO}× the epoll TCP server"),
        target_met: verdict(spin.target_met, block.target_met),
        spin,
        block,
        raw_shm_rtt_p50_ns: raw_p50,
        raw_shm_rtt_p99_ns: raw.as_ref().map(|s| s.p(0.99)),
        raw_shm_ratio: raw_ratio,
        raw_shm_target: format!(
            "RTT p50 with both sides spinning ≤ {TARGET_RAW_SHM}× the raw shared-memory ping-pong of the same size \
             (one request in flight)"
        ),
        raw_shm_target_met: raw_ratio.map(|r| r <= TARGET_RAW_SHM),
        raw_slots_rtt_p50_ns: raw_slots.as_ref().map(|s| s.p(0.5)),
        raw_slots_rtt_p99_ns: raw_slots.as_ref().map(|s| s.p(0.99)),
        raw_slots_ratio: raw_slots.as_ref().map(|s| ratio(clan_spin.rtt.p(0.5) as f64, s.p(0.5) as f64)),
        raw_packed_rtt_p50_ns: raw_packed.as_ref().map(|s| s.p(0.5)),
        raw_packed_rtt_p99_ns: raw_packed.as_ref().map(|s| s.p(0.99)),
        raw_packed_ratio: raw_packed.as_ref().map(|s| ratio(clan_spin.rtt.p(0.5) as f64, s.p(0.5) as f64)),
        setup_s: setup.as_secs_f64(),
        footprint_clan,
        footprint_tcp,
        per_endpoint_clan: footprint_clan.per(a.endpoints),
        per_endpoint_tcp: footprint_tcp.per(a.endpoints),
        placement: format!(
            "client pinned to CPU {}, server process (one thread) to CPU 1 ({} CPUs); requests on connections chosen \
             at random, {} in flight{}; clan: RPC over its event loop; baseline: mio (epoll) TCP server over \
             loopback; raw shm: the latency benchmark's ping-pong over a shared memfd, same CPUs (with more than one \
             endpoint, also over as many slots as endpoints, a page each and packed on cache lines, chosen as the client \
             chooses its connections); {} rounds, each \
             system's ways alternating (clan spinning with the raw ping-pong)",
            pinned.map_or("-".into(), |c| c.to_string()),
            sys::machine().cpus,
            a.inflight,
            if a.mode == Mode::Idle {
                format!(", {} µs between requests", IDLE_GAP.as_micros())
            } else {
                String::new()
            },
            a.rounds.max(1)
        ),
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench server: {} endpoint{}, {} mode, {} in flight, {}-byte requests, {} rounds     [paper: busy 7.9 µs, idle 16.8 µs, 340 000 req/s; GbE TCP 21 184 req/s]",
            r.endpoints,
            if r.endpoints == 1 { "" } else { "s" },
            r.mode,
            r.inflight,
            r.size,
            r.rounds
        );
        println!("placement: {}", r.placement);
        println!("machine: {} × {}, Linux {}", r.machine.cpus, r.machine.model, r.machine.kernel);
        println!("{:<22} {:>10} {:>10} {:>10} {:>12}", "", "RTT p50", "p90", "p99", "req/s");
        let line = |name: &str, f: &Figures| {
            println!(
                "{:<22} {:>10} {:>10} {:>10} {:>12.0}",
                name,
                ns(f.rtt_p50_ns),
                ns(f.rtt_p90_ns),
                ns(f.rtt_p99_ns),
                f.req_per_s
            );
        };
        line("clan, spinning", &r.spin.clan);
        line("epoll-tcp, spinning", &r.spin.baseline);
        line("clan, blocking", &r.block.clan);
        line("epoll-tcp, blocking", &r.block.baseline);
        println!(
            "{:<22} {:>10} {:>10} {:>10} {:>12.0}   (connections set up in {:.2} s)",
            "clan, paper's policy",
            ns(r.rtt_p50_ns),
            "",
            ns(r.rtt_p99_ns),
            r.req_per_s,
            r.setup_s
        );
        if let (Some(p50), Some(p99)) = (r.raw_shm_rtt_p50_ns, r.raw_shm_rtt_p99_ns) {
            println!("{:<22} {:>10} {:>10} {:>10}", "raw shm ping-pong", ns(p50), "", ns(p99));
        }
        if let (Some(p50), Some(p99)) = (r.raw_slots_rtt_p50_ns, r.raw_slots_rtt_p99_ns) {
            println!("{:<22} {:>10} {:>10} {:>10}", format!("raw shm, {} slots", r.endpoints), ns(p50), "", ns(p99));
        }
        if let (Some(p50), Some(p99)) = (r.raw_packed_rtt_p50_ns, r.raw_packed_rtt_p99_ns) {
            println!("{:<22} {:>10} {:>10} {:>10}", format!("raw shm, {} packed", r.endpoints), ns(p50), "", ns(p99));
        }
        let (c, t) = (&r.per_endpoint_clan, &r.per_endpoint_tcp);
        println!(
            "per endpoint (client and server together, fixed costs included): clan {:.1} fds, {:.1} mappings, \
             {:.0} KiB resident; epoll-tcp {:.1} fds, {:.1} mappings, {:.0} KiB",
            c.fds, c.maps, c.rss_kib, t.fds, t.maps, t.rss_kib
        );
        println!("spin : {}", r.spin.how);
        println!("block: {}", r.block.how);
        println!(
            "requests/s clan/epoll-tcp: {:.1} spinning, {:.1} blocking (RTT p50 ratio {:.3} spinning, {:.3} blocking)",
            r.ratio_spin, r.ratio_block, r.rtt_ratio_spin, r.rtt_ratio_block
        );
        println!("target {}: met {}", r.target, r.target_met);
        if let (Some(x), Some(met)) = (r.raw_shm_ratio, r.raw_shm_target_met) {
            println!(
                "RTT clan spinning / raw shm ping-pong: {x:.2}; target {}: {}",
                r.raw_shm_target,
                if met { "met" } else { "not met" }
            );
        }
        if let Some(x) = r.raw_slots_ratio {
            println!(
                "RTT clan spinning / raw shm ping-pong over {} slots (a page each, chosen at random, a mailbox word \
                 naming the slot): {x:.2}",
                r.endpoints
            );
        }
        if let Some(x) = r.raw_packed_ratio {
            println!(
                "RTT clan spinning / raw shm ping-pong over {} slots packed on cache lines (as clan's pools carve small \
                 connection sides): {x:.2}",
                r.endpoints
            );
        }
    });
    Ok(())
}

/// A client's connection: send a request, poll for its reply, or sleep until it comes.
trait Conn {
    fn send(&mut self, req: &[u8]) -> Result<()>;
    /// Whether the reply has come (never sleeps).
    fn poll(&mut self) -> Result<bool>;
    /// Sleep until the reply has come.
    fn wait(&mut self) -> Result<()>;
}

impl Conn for RpcClient {
    fn send(&mut self, req: &[u8]) -> Result<()> {
        self.send_with(|w| w.write(req))?;
        Ok(())
    }
    fn poll(&mut self) -> Result<bool> {
        Ok(self.try_reply(|r| r.len())?.is_some())
    }
    fn wait(&mut self) -> Result<()> {
        // The client's connections poll for 0: this arms the reply tripwire, re-checks and
        // sleeps.
        self.wait_reply(Some(LIMIT), |r| r.len())?;
        Ok(())
    }
}

/// A TCP connection of the client (a blocking socket: `poll` reads with `MSG_DONTWAIT`).
struct TcpConn {
    s: TcpStream,
    reply: Vec<u8>,
    got: usize,
}

impl Conn for TcpConn {
    fn send(&mut self, req: &[u8]) -> Result<()> {
        self.got = 0;
        self.s.write_all(req)?;
        Ok(())
    }
    fn poll(&mut self) -> Result<bool> {
        use rustix::io::Errno;
        use rustix::net::{RecvFlags, recv};
        while self.got < self.reply.len() {
            match recv(&self.s, &mut self.reply[self.got..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err("the TCP server closed a connection".into()),
                Ok((n, _)) => self.got += n,
                Err(Errno::AGAIN) => return Ok(false),
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(true)
    }
    fn wait(&mut self) -> Result<()> {
        let got = self.got;
        self.s.read_exact(&mut self.reply[got..])?;
        self.got = self.reply.len();
        Ok(())
    }
}

/// Wait for one reply the way `sync` says.
fn await_reply(c: &mut impl Conn, sync: Sync) -> Result<()> {
    let poll_for = match sync {
        Sync::Spin => LIMIT,
        Sync::Block => Duration::ZERO,
        Sync::Policy => POLICY_POLL,
    };
    if !poll_for.is_zero() {
        // The clock is first read after 64 polls: a reply that comes sooner costs no clock
        // read on the measured path (the polling time counts from there).
        let mut start = None;
        let mut n = 0u32;
        loop {
            if c.poll()? {
                return Ok(());
            }
            std::hint::spin_loop();
            n = n.wrapping_add(1);
            if n % 64 == 0 && start.get_or_insert_with(Instant::now).elapsed() >= poll_for {
                break;
            }
        }
        if sync == Sync::Spin {
            return Err("the server stopped answering".into());
        }
    }
    c.wait()
}

/// The client's requests over `conns`, waiting for replies as `sync` says.
fn drive(conns: &mut [impl Conn], a: &ServerArgs, sync: Sync) -> Result<Run> {
    let req = vec![0x5au8; a.size];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let (requests, warm) = per_round(a);
    // Every connection once first: the first use of a connection in a process (page faults
    // on both sides, its lines brought in) is set-up, not a round trip.
    for c in conns.iter_mut() {
        c.send(&req)?;
        await_reply(c, sync)?;
    }
    let mut rtt = Samples::new();
    let mut measured = 0u64;
    let t0 = Instant::now();
    let mut start = Instant::now();
    let mut sent = 0u64;
    // Calls in flight: connection index → start time.
    let mut inflight: Vec<(usize, Instant)> = Vec::with_capacity(a.inflight);
    let mut busy = vec![false; conns.len()];
    while sent < warm + requests || !inflight.is_empty() {
        while inflight.len() < a.inflight && sent < warm + requests {
            let mut k = (rng(&mut x) % conns.len() as u64) as usize;
            while busy[k] {
                k = (k + 1) % conns.len();
            }
            busy[k] = true;
            // (timed from before the send, as the baselines are: the request's cost, cold
            // lines of a connection chosen at random included, is part of the round trip)
            let t = Instant::now();
            conns[k].send(&req)?;
            inflight.push((k, t));
            sent += 1;
        }
        if a.inflight == 1 {
            let (k, t) = inflight.pop().ok_or("nothing in flight")?;
            await_reply(&mut conns[k], sync)?;
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
        // Many in flight: poll them all; a blocking client sleeps on the oldest when none
        // has its reply.
        let mut done: Vec<usize> = Vec::new();
        for (i, &(k, _)) in inflight.iter().enumerate() {
            if conns[k].poll()? {
                done.push(i);
            }
        }
        if done.is_empty() && sync == Sync::Block {
            let (i, &(k, _)) = inflight.iter().enumerate().min_by_key(|(_, (_, t))| *t).ok_or("nothing in flight")?;
            conns[k].wait()?;
            done.push(i);
        }
        for &i in done.iter().rev() {
            let (k, t) = inflight.swap_remove(i);
            busy[k] = false;
            if sent > warm + a.inflight as u64 {
                rtt.record(t.elapsed());
                measured += 1;
            } else if measured == 0 {
                start = Instant::now();
            }
        }
        if t0.elapsed() > LIMIT * 5 {
            return Err("the server stopped answering".into());
        }
    }
    let elapsed = start.elapsed();
    let idle_time = if a.mode == Mode::Idle { IDLE_GAP * measured as u32 } else { Duration::ZERO };
    // In idle mode the pauses are the client's choice: requests/s counts the time the
    // requests took (round trips), as a busy client would see.
    let busy = elapsed.saturating_sub(idle_time).max(Duration::from_nanos(1));
    Ok(Run { rtt, measured, busy })
}

/// Sleep `d` without a system call's worth of oversleeping (a short pause, as a client
/// thinking between requests).
fn spin_sleep(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Tell a server process how to wait, and wait until it does.
fn set_mode(peer: &mut PeerProc, sync: Sync) -> Result<()> {
    let say = format!("mode {}", sync.name());
    peer.send(&say)?;
    if peer.recv()? != say {
        return Err("the server did not change mode".into());
    }
    Ok(())
}

/// What the server processes are told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct PeerArgs {
    endpoints: usize,
    size: usize,
    cpu: usize,
}

fn server_args(a: &ServerArgs) -> PeerArgs {
    PeerArgs { endpoints: a.endpoints, size: a.size, cpu: 1 }
}

/// The clan server process and the client's connections to it.
struct ClanSide {
    peer: PeerProc,
    conns: Vec<RpcClient>,
    setup: Duration,
    _nic: Nic,
}

impl ClanSide {
    fn start(a: &ServerArgs) -> Result<ClanSide> {
        let mut peer = PeerProc::spawn(Role::SrvClan, &server_args(a))?;
        let addr: EndpointAddr = peer.recv()?.parse()?;
        // The client's waits poll for 0 (its connections and its NIC's queue, on which their
        // tripwires are): `await_reply` does the polling each way asks for.
        let nic = Nic::open(super::nic_config(Duration::ZERO))?;
        let cfg = RpcConfig { max_msg: (a.size as u64).max(64), spin: Duration::ZERO, ..RpcConfig::default() };
        let t0 = Instant::now();
        let mut conns = Vec::with_capacity(a.endpoints);
        for _ in 0..a.endpoints {
            conns.push(RpcClient::connect(&nic, addr, &cfg)?);
        }
        Ok(ClanSide { peer, conns, setup: t0.elapsed(), _nic: nic })
    }

    fn measure(&mut self, a: &ServerArgs, sync: Sync) -> Result<Run> {
        set_mode(&mut self.peer, sync)?;
        let r = drive(&mut self.conns, a, sync)?;
        // Parked: sleeping until the next measurement.
        set_mode(&mut self.peer, Sync::Block)?;
        Ok(r)
    }

    fn stop(mut self) -> Result<()> {
        self.peer.send("stop")?;
        self.peer.finish()
    }
}

/// The epoll TCP server process and the client's connections to it.
struct TcpSide {
    peer: PeerProc,
    conns: Vec<TcpConn>,
}

impl TcpSide {
    fn start(a: &ServerArgs) -> Result<TcpSide> {
        let mut peer = PeerProc::spawn(Role::SrvTcp, &server_args(a))?;
        let addr: SocketAddr = peer.recv()?.parse()?;
        let mut conns = Vec::with_capacity(a.endpoints);
        for _ in 0..a.endpoints {
            let s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(LIMIT))?;
            conns.push(TcpConn { s, reply: vec![0; a.size], got: 0 });
        }
        Ok(TcpSide { peer, conns })
    }

    fn measure(&mut self, a: &ServerArgs, sync: Sync) -> Result<Run> {
        set_mode(&mut self.peer, sync)?;
        let r = drive(&mut self.conns, a, sync)?;
        set_mode(&mut self.peer, Sync::Block)?;
        Ok(r)
    }

    fn stop(mut self) -> Result<()> {
        // The server closes first: the TIME_WAIT states are then on its side, and the
        // client's ephemeral ports are free for the next run at once.
        self.peer.send("stop")?;
        self.peer.finish()?;
        drop(self.conns);
        Ok(())
    }
}

/// A clan event loop serving the RPC server's queue, polling a drained queue `poll_for`.
fn clan_loop(
    rpc: &std::rc::Rc<std::cell::RefCell<RpcServer>>,
    q: &EventQueue,
    poll_for: Duration,
    size: usize,
) -> Result<EventLoop> {
    let mut el = EventLoop::new(poll_for)?;
    let r2 = rpc.clone();
    let mut buf = vec![0u8; size];
    el.add_queue(q, move |ev| {
        let _ = r2.borrow_mut().handle_event(ev, &mut |_, req, reply| {
            // The request in place; the reply written straight into the client.
            let n = (req.len() as usize).min(buf.len());
            if req.read(0, &mut buf[..n]).is_ok() {
                let _ = reply.write(&buf[..n]);
            }
        });
    })?;
    Ok(el)
}

/// The server processes. Lines on stdin: `mode spin|block|policy` (acknowledged by the same
/// line once the server waits that way), `stop`.
pub fn peer(role: Role, a: PeerArgs) -> Result<()> {
    sys::pin(a.cpu);
    clan_shm::memfd::raise_fd_limit();
    let PeerArgs { endpoints, size, .. } = a;
    let stop = Arc::new(AtomicBool::new(false));
    // The mode asked for last (low byte) and how many times one was asked for (above it):
    // every request is acknowledged, a change of mode or not.
    let mode = Arc::new(AtomicU32::new(u32::from(Sync::Block.code())));
    let (s2, m2) = (stop.clone(), mode.clone());
    std::thread::spawn(move || {
        while let Ok(l) = Link::hear() {
            let m = match l.strip_prefix("mode ") {
                Some("spin") => Sync::Spin,
                Some("policy") => Sync::Policy,
                Some(_) => Sync::Block,
                None => break,
            };
            let next = ((m2.load(Ordering::Acquire) >> 8) + 1) << 8 | u32::from(m.code());
            m2.store(next, Ordering::Release);
        }
        s2.store(true, Ordering::Release);
    });
    // The mode asked for, once it was asked for again since `seen` (then updated).
    let asked = |seen: &mut u32| {
        let v = mode.load(Ordering::Acquire);
        (v != *seen).then(|| {
            *seen = v;
            Sync::from_code(v as u8)
        })
    };
    let mut seen = mode.load(Ordering::Acquire);
    match role {
        Role::SrvClan => {
            let nic = Nic::open(NicConfig::default())?;
            let cfg = RpcConfig { max_msg: (size as u64).max(64), ..RpcConfig::default() };
            let rpc = RpcServer::bind(&nic, cfg, endpoints as u32 + 16)?;
            Link::say(rpc.local_addr());
            let q = rpc.event_queue().clone();
            let rpc = std::rc::Rc::new(std::cell::RefCell::new(rpc));
            let mut cur = Sync::Block;
            let mut el = clan_loop(&rpc, &q, Duration::ZERO, size)?;
            while !stop.load(Ordering::Acquire) {
                if let Some(m) = asked(&mut seen) {
                    let poll_for = match m {
                        Sync::Spin => BUSY_POLL,
                        Sync::Block => Duration::ZERO,
                        Sync::Policy => POLICY_POLL,
                    };
                    el = clan_loop(&rpc, &q, poll_for, size)?;
                    cur = m;
                    Link::say(format!("mode {}", m.name()));
                }
                // Spinning: epoll is only looked at (timeout 0) between polls of the queue.
                let timeout = if cur == Sync::Spin { Duration::ZERO } else { Duration::from_millis(20) };
                el.run_once(Some(timeout))?;
            }
            drop(el);
            drop(rpc);
        }
        Role::SrvTcp => {
            use mio::net::TcpListener;
            use mio::{Events, Interest, Poll, Token};
            use std::collections::HashMap;
            let mut l = TcpListener::bind("127.0.0.1:0".parse()?)?;
            Link::say(l.local_addr()?);
            let mut poll = Poll::new()?;
            poll.registry().register(&mut l, Token(0), Interest::READABLE)?;
            let mut events = Events::with_capacity(1024);
            let mut conns: HashMap<usize, (mio::net::TcpStream, Vec<u8>)> = HashMap::new();
            let mut next = 1usize;
            let mut cur = Sync::Block;
            while !stop.load(Ordering::Acquire) {
                if let Some(m) = asked(&mut seen) {
                    cur = m;
                    Link::say(format!("mode {}", m.name()));
                }
                // Spinning: epoll_wait with a timeout of 0, again and again.
                let timeout = if cur == Sync::Spin { Duration::ZERO } else { Duration::from_millis(20) };
                match poll.poll(&mut events, Some(timeout)) {
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
        other => return Err(format!("not a role of bench server: {other:?}").into()),
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
