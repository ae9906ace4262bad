//! `clan bench run`: unmodified programs with and without `clan run`, in the same run, with
//! the same placement (server on CPU 1, client on CPU 0, through `taskset`): sockperf's
//! ping-pong latency and redis-benchmark's request rate (connections kept, and a new one per
//! request), against kernel TCP (and, for redis with many clients, a Unix socket). Programs
//! that are not installed are skipped and said so.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::Result;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Seconds of each sockperf run.
    #[arg(long, default_value_t = 3)]
    pub secs: u64,
    /// Requests of each redis-benchmark run (1 client; 50 clients do 4×, pipelined 20×).
    #[arg(long, default_value_t = 50_000)]
    pub requests: u64,
    /// Rounds the variants alternate in (the figure is the median over rounds).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One line of the report.
#[derive(Serialize, serde::Deserialize, Debug, Clone)]
pub struct Row {
    pub program: &'static str,
    pub measure: String,
    pub clan: f64,
    pub baseline: f64,
    pub baseline_name: &'static str,
    /// clan / baseline.
    pub ratio: f64,
    pub goal: &'static str,
    pub met: bool,
}

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct RunReport {
    pub bench: &'static str,
    pub rows: Vec<Row>,
    pub skipped: Vec<String>,
    pub placement: &'static str,
}

const PLACEMENT: &str = "server pinned to CPU 1, client to CPU 0 (taskset); the same program with and without \
                         `clan run`, alternating in rounds; figures are medians over the rounds";

fn have(prog: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {prog}")]).output().is_ok_and(|o| o.status.success())
}

/// `clan` itself (for `clan run`).
fn clan() -> Result<PathBuf> {
    Ok(std::env::current_exe()?)
}

/// A command pinned to `cpu`, under `clan run` or not.
fn pinned(cpu: u32, clan_run: bool, prog: &str) -> Result<Command> {
    let mut c = Command::new("taskset");
    c.args(["-c", &cpu.to_string()]);
    if clan_run {
        c.arg(clan()?).args(["run", "--"]);
    }
    c.arg(prog);
    Ok(c)
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_port(port: u16) -> Result<()> {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("nothing listens on port {port} after 20 s").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// One sockperf ping-pong: (p50, p99) one-way latency in µs.
fn sockperf(clan_run: bool, secs: u64) -> Result<(f64, f64)> {
    let port = free_port()?.to_string();
    let _server = Server(
        pinned(1, clan_run, "sockperf")?
            .args(["server", "--tcp", "-i", "127.0.0.1", "-p", &port])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    wait_port(port.parse()?)?;
    let out = pinned(0, clan_run, "sockperf")?
        .args(["ping-pong", "--tcp", "-i", "127.0.0.1", "-p", &port, "-m", "64", "--mps", "5000000"])
        .args(["-t", &secs.to_string()])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let pct = |p: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.contains(&format!("percentile {p} =")))?;
        line.rsplit('=').next()?.trim().parse().ok()
    };
    match (pct("50.000"), pct("99.000")) {
        (Some(a), Some(b)) if out.status.success() => Ok((a, b)),
        _ => Err(format!("sockperf ping-pong (clan: {clan_run}) gave no percentiles: {text}").into()),
    }
}

/// How redis-benchmark's clients use their connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conns {
    /// Kept for every request.
    Kept,
    /// A new connection for every request (`-k 0`); under `clan run`, the library's default
    /// (short connections stay with the kernel, `crates/clan-preload/src/short.rs`).
    PerRequest,
    /// As `PerRequest`, every connection over clan however short (`CLAN_RUN_MIN_TURNS=0`).
    PerRequestAllClan,
}

/// One redis-benchmark GET run: requests/s. `unix`: over a Unix socket (no clan).
fn redis(clan_run: bool, unix: bool, conns: Conns, clients: u32, pipeline: u32, n: u64) -> Result<f64> {
    let port = free_port()?.to_string();
    let sock = std::env::temp_dir().join(format!("clan-bench-redis-{}-{port}.sock", std::process::id()));
    let mut server = pinned(1, clan_run, "redis-server")?;
    if conns == Conns::PerRequestAllClan {
        server.env("CLAN_RUN_MIN_TURNS", "0");
    }
    server.args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    if unix {
        server.arg("--unixsocket").arg(&sock);
    }
    let _server = Server(server.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?);
    wait_port(port.parse()?)?;
    let mut c = pinned(0, clan_run, "redis-benchmark")?;
    if unix {
        c.arg("-s").arg(&sock);
    } else {
        c.args(["-p", &port]);
    }
    if conns != Conns::Kept {
        c.args(["-k", "0"]);
    }
    if conns == Conns::PerRequestAllClan {
        c.env("CLAN_RUN_MIN_TURNS", "0");
    }
    let out = c
        .args(["-t", "get", "-q", "-n", &n.to_string(), "-c", &clients.to_string(), "-P", &pipeline.to_string()])
        .output()?;
    let _ = std::fs::remove_file(&sock);
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    let rps = text
        .lines()
        .filter_map(|l| l.split("GET: ").nth(1))
        .filter_map(|l| l.split(" requests per second").next())
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .next_back();
    rps.ok_or_else(|| format!("redis-benchmark (clan: {clan_run}) printed no rate: {text}").into())
}

pub fn run(a: &RunArgs) -> Result<()> {
    if !have("taskset") {
        return Err("taskset (util-linux) is needed to pin the programs".into());
    }
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let rounds = a.rounds.max(1);
    // Steps: sockperf and redis-benchmark, each round.
    let bar = super::report::progress(rounds as u64 * 2, a.json);
    let progress = |what: &str| {
        if !a.json {
            bar.suspend(|| eprintln!("clan bench run: {what}"));
        }
        bar.set_message(what.to_owned());
        bar.inc(1);
    };

    if have("sockperf") {
        let (mut c50, mut c99, mut t50, mut t99) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds {
            progress(&format!("sockperf ping-pong, round {}/{rounds}", r + 1));
            let (a50, a99) = sockperf(true, a.secs)?;
            let (b50, b99) = sockperf(false, a.secs)?;
            c50.push(a50);
            c99.push(a99);
            t50.push(b50);
            t99.push(b99);
        }
        let (c50, c99, t50, t99) = (median(c50), median(c99), median(t50), median(t99));
        rows.push(Row {
            program: "sockperf",
            measure: "ping-pong 64 B, one-way latency p50 (µs)".into(),
            clan: c50,
            baseline: t50,
            baseline_name: "kernel TCP",
            ratio: c50 / t50,
            goal: "≥ 10× lower than TCP",
            met: c50 * 10.0 <= t50,
        });
        rows.push(Row {
            program: "sockperf",
            measure: "ping-pong 64 B, one-way latency p99 (µs)".into(),
            clan: c99,
            baseline: t99,
            baseline_name: "kernel TCP",
            ratio: c99 / t99,
            goal: "—",
            met: true,
        });
    } else {
        skipped.push("sockperf (not installed)".into());
    }

    if have("redis-server") && have("redis-benchmark") {
        let mut one = (Vec::new(), Vec::new());
        let mut many = (Vec::new(), Vec::new(), Vec::new());
        let mut piped = (Vec::new(), Vec::new());
        // (clients 1 and 16: clan run's default, every connection over clan, kernel TCP)
        let mut short = [(Vec::new(), Vec::new(), Vec::new()), (Vec::new(), Vec::new(), Vec::new())];
        for r in 0..rounds {
            progress(&format!("redis-benchmark GET, round {}/{rounds}", r + 1));
            one.0.push(redis(true, false, Conns::Kept, 1, 1, a.requests)?);
            one.1.push(redis(false, false, Conns::Kept, 1, 1, a.requests)?);
            many.0.push(redis(true, false, Conns::Kept, 50, 1, a.requests * 4)?);
            many.1.push(redis(false, false, Conns::Kept, 50, 1, a.requests * 4)?);
            many.2.push(redis(false, true, Conns::Kept, 50, 1, a.requests * 4)?);
            // (16 in a pipeline go fast: 20× the requests, so that the run is not mostly set-up)
            piped.0.push(redis(true, false, Conns::Kept, 50, 16, a.requests * 20)?);
            piped.1.push(redis(false, false, Conns::Kept, 50, 16, a.requests * 20)?);
            // (a connection per request: a tenth of the requests)
            for (i, clients) in [1, 16].into_iter().enumerate() {
                short[i].0.push(redis(true, false, Conns::PerRequest, clients, 1, a.requests / 10)?);
                short[i].1.push(redis(true, false, Conns::PerRequestAllClan, clients, 1, a.requests / 10)?);
                short[i].2.push(redis(false, false, Conns::PerRequest, clients, 1, a.requests / 10)?);
            }
        }
        let (o_c, o_t) = (median(one.0), median(one.1));
        rows.push(Row {
            program: "redis",
            measure: "GET requests/s, 1 client".into(),
            clan: o_c,
            baseline: o_t,
            baseline_name: "kernel TCP",
            ratio: o_c / o_t,
            goal: "≥ 3× TCP",
            met: o_c >= 3.0 * o_t,
        });
        let (m_c, m_t, m_u) = (median(many.0), median(many.1), median(many.2));
        rows.push(Row {
            program: "redis",
            measure: "GET requests/s, 50 clients".into(),
            clan: m_c,
            baseline: m_u,
            baseline_name: "Unix socket",
            ratio: m_c / m_u,
            goal: "≥ 1.2× a Unix socket",
            met: m_c >= 1.2 * m_u,
        });
        rows.push(Row {
            program: "redis",
            measure: "GET requests/s, 50 clients".into(),
            clan: m_c,
            baseline: m_t,
            baseline_name: "kernel TCP",
            ratio: m_c / m_t,
            goal: "—",
            met: true,
        });
        let (p_c, p_t) = (median(piped.0), median(piped.1));
        rows.push(Row {
            program: "redis",
            measure: "GET requests/s, 50 clients, pipelined -P 16".into(),
            clan: p_c,
            baseline: p_t,
            baseline_name: "kernel TCP",
            ratio: p_c / p_t,
            goal: "no regression (≥ 1×)",
            met: p_c >= p_t,
        });
        for ([s_d, s_c, s_t], clients) in
            short.into_iter().map(|(d, c, t)| [median(d), median(c), median(t)]).zip([1, 16])
        {
            let plural = if clients == 1 { "" } else { "s" };
            rows.push(Row {
                program: "redis",
                measure: format!(
                    "GET requests/s, a new connection per request (-k 0), {clients} client{plural}: clan run's \
                     default (short connections stay with the kernel but for a probe now and then)"
                ),
                clan: s_d,
                baseline: s_t,
                baseline_name: "kernel TCP",
                ratio: s_d / s_t,
                goal: "no regression (≥ 0.9×)",
                met: s_d >= 0.9 * s_t,
            });
            rows.push(Row {
                program: "redis",
                measure: format!(
                    "GET requests/s, a new connection per request (-k 0), {clients} client{plural}: every \
                     connection over clan (CLAN_RUN_MIN_TURNS=0)"
                ),
                clan: s_c,
                baseline: s_t,
                baseline_name: "kernel TCP",
                ratio: s_c / s_t,
                goal: "—",
                met: true,
            });
        }
    } else {
        skipped.push("redis (redis-server or redis-benchmark not installed)".into());
    }

    bar.finish_and_clear();
    let report = RunReport { bench: "run", rows, skipped, placement: PLACEMENT };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!("Unmodified programs over clan (clan run) and over their baselines, same run.");
    println!("{PLACEMENT}\n");
    println!("| program | measure | clan | baseline | ratio | goal | met |");
    println!("|---|---|---|---|---|---|---|");
    for r in &report.rows {
        println!(
            "| {} | {} | {:.3} | {:.3} ({}) | {:.3} | {} | {} |",
            r.program,
            r.measure,
            r.clan,
            r.baseline,
            r.baseline_name,
            r.ratio,
            r.goal,
            if r.goal == "—" {
                ""
            } else if r.met {
                "yes"
            } else {
                "no"
            }
        );
    }
    for s in &report.skipped {
        println!("skipped: {s}");
    }
    Ok(())
}
