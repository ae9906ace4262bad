//! `clan bench paper`: every figure and table of the papers that clan can produce, each with
//! its same-run baselines, into a report folder (JSON and an SVG plot per figure, and an
//! index in Markdown and HTML with the papers' numbers beside ours).
//!
//! Each figure runs the corresponding `clan bench …` as a child process with `--json` (the
//! same code as when run by hand), so a figure's numbers are exactly what that command
//! prints. Figures that need root (test hosts in network namespaces) run when root and are
//! listed as skipped otherwise.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Result;
use super::asyncio::{TokioPoint, TokioReport};
use super::bandwidth::BandwidthReport;
use super::connect::ConnectReport;
use super::fabric::FabricReport;
use super::latency::LatencyReport;
use super::queue::{QueuePoint, QueueReport};
use super::rpc::RpcReport;
use super::run::RunReport;
use super::server::ServerReport;
use super::stream::StreamReport;
use super::vmmc::{BandwidthPoint, VmmcReport};
use crate::sys;

/// Arguments of `clan bench paper`.
#[derive(clap::Args, Debug, Clone)]
pub struct PaperArgs {
    /// Report folder (made if missing).
    #[arg(long, default_value = "clan-report")]
    pub out: PathBuf,
    /// Fewer sizes and repetitions: under a minute on 2 cores (the default takes about five
    /// minutes).
    #[arg(long, conflicts_with = "full")]
    pub quick: bool,
    /// About ten minutes: more sizes, repetitions and endpoints.
    #[arg(long)]
    pub full: bool,
    /// Tiny sizes only (for tests of the report itself: the numbers mean little).
    #[arg(long, hide = true)]
    pub smoke: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Profile {
    Smoke,
    Quick,
    Default,
    Full,
}

/// A figure's measurement.
type Step = fn(Profile) -> Result<Figure>;

/// A row of the index table: (what, ours, baseline, ratio).
type Row = (String, String, String, String);

/// One figure of the report.
struct Figure {
    id: &'static str,
    title: &'static str,
    /// The papers' result, as they state it.
    paper: &'static str,
    /// Our headline, one line.
    ours: String,
    /// Rows for the index table: (what, ours, baseline, ratio).
    rows: Vec<Row>,
    data: Value,
    /// Why it was not run, if it was not.
    skipped: Option<String>,
}

/// How long one `clan bench …` of the report may run before it is stopped: far above the
/// longest (`--full`'s server and fabric steps take a few minutes), so that a step that hangs
/// fails the report saying where, rather than holding it forever.
const STEP_LIMIT: Duration = Duration::from_secs(30 * 60);

/// Run `clan bench <args> --json` and parse its JSON. Its output goes to files (a process it
/// leaves behind cannot hold the report up by keeping a pipe open), and it is stopped, with
/// every process under it, after [`STEP_LIMIT`].
fn bench(args: &[String]) -> Result<Value> {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = std::env::temp_dir().join(format!("clan-bench-paper-{}-{n}", std::process::id()));
    let (out_path, err_path) = (base.with_extension("out"), base.with_extension("err"));
    let mut child = Command::new(std::env::current_exe()?)
        .arg("bench")
        .args(args)
        .arg("--json")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if start.elapsed() > STEP_LIMIT {
            for p in sys::descendants(child.id()) {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(p as i32).ok_or("pid 0")?,
                    rustix::process::Signal::KILL,
                );
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::process::Output {
        status: status.unwrap_or_default(),
        stdout: std::fs::read(&out_path).unwrap_or_default(),
        stderr: std::fs::read(&err_path).unwrap_or_default(),
    };
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    if status.is_none() {
        return Err(format!(
            "clan bench {} still running after {} s, stopped: {}",
            args.join(" "),
            STEP_LIMIT.as_secs(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    if !out.status.success() {
        return Err(
            format!("clan bench {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()).into()
        );
    }
    let text = String::from_utf8(out.stdout)?;
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or("no JSON printed")?;
    Ok(serde_json::from_str(line)?)
}

/// Run `clan bench ARGS --json` and read its report as the benchmark's own type: a field
/// renamed there does not compile here, one missing from the output fails the run.
fn bench_as<T: serde::Deserialize<'static>>(args: &[String]) -> Result<T> {
    let v = bench(args)?;
    // The reports' text fields borrow from their JSON: the text is kept for the run (a few
    // kilobytes per benchmark).
    let text: &'static str = Box::leak(v.to_string().into_boxed_str());
    serde_json::from_str(text)
        .map_err(|e| format!("clan bench {}: its report does not read as its type: {e}", args.join(" ")).into())
}

/// A report kept as JSON read back as its type (text fields borrow from the kept text).
fn typed<T: serde::Deserialize<'static>>(v: &Value) -> Result<T> {
    let text: &'static str = Box::leak(v.to_string().into_boxed_str());
    Ok(serde_json::from_str(text)?)
}

/// A nanosecond figure of a report.
fn nsu(v: u64) -> String {
    super::report::ns(v)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_owned()).collect()
}

fn mbit(v: f64) -> String {
    if v >= 10_000.0 { format!("{:.1} Gbit/s", v / 1000.0) } else { format!("{v:.0} Mbit/s") }
}

/// A ratio with two decimals, or two significant digits when it is below 0.1 (a ratio of
/// 0.004 is a figure, not "0.00").
fn r2(v: f64) -> String {
    if v != 0.0 && v.is_finite() && v.abs() < 0.1 {
        let decimals = (-v.abs().log10()).floor() as usize + 2;
        format!("{v:.decimals$}")
    } else {
        format!("{v:.2}")
    }
}

/// A ratio of rates with one decimal and its sign "×", keeping the digits of a small one
/// (a rate that collapsed on a loaded machine reads 0.043×, not 0.0×).
fn times(v: f64) -> String {
    if v != 0.0 && v.is_finite() && v.abs() < 0.1 { format!("{}×", r2(v)) } else { format!("{v:.1}×") }
}

pub fn run(a: &PaperArgs) -> Result<()> {
    let profile = if a.smoke {
        Profile::Smoke
    } else if a.quick {
        Profile::Quick
    } else if a.full {
        Profile::Full
    } else {
        Profile::Default
    };
    std::fs::create_dir_all(&a.out)?;
    let root = rustix::process::geteuid().is_root() && clan_testkit::netns::TestNet::new(2).is_ok();
    // Each step with its rough share of the run (so the ETA is about time, not steps).
    let steps: Vec<(&str, Step, u64)> = vec![
        ("shared-memory round trip", fig_rtt, 2),
        ("PIO and DMA bandwidth by size", fig_bandwidth, 3),
        ("event-driven server against endpoints", fig_server, 5),
        ("one-way bandwidth, one message at a time and streaming", fig_oneway_vmmc, 3),
        ("distributed queue streaming", fig_queue, 4),
        ("stream sockets", fig_stream, 4),
        ("tokio: concurrent clients", fig_tokio, 2),
        ("RPC", fig_rpc, 1),
        ("connection set-up", fig_connect, 1),
        ("unmodified applications under clan run", fig_run, 3),
        ("libfabric programs and MPI over the clan provider", fig_fabric, 8),
    ];
    let tcp_weight = 3;
    let total = steps.len() + 1;
    let started = Instant::now();
    // Progress with an ETA on a terminal (hidden otherwise); the lines below go to standard
    // error either way.
    let bar = indicatif::ProgressBar::new(steps.iter().map(|s| s.2).sum::<u64>() + tcp_weight);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {elapsed:>4} [{bar:30}] {percent:>3}%  ETA {eta}  {msg}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let say = |line: String| bar.suspend(|| eprintln!("{line}"));
    let mut figs = Vec::new();
    for (i, (name, step, weight)) in steps.into_iter().enumerate() {
        say(format!("[{}/{}] {name} …", i + 1, total));
        bar.set_message(name);
        let t = Instant::now();
        let fig = match step(profile) {
            Ok(f) => f,
            Err(e) => {
                bar.abandon();
                return Err(format!("{name}: {e}").into());
            }
        };
        say(format!("      {} ({:.0} s)", fig.ours, t.elapsed().as_secs_f64()));
        bar.inc(weight);
        figs.extend(split_vmmc(fig)?);
    }
    say(format!("[{total}/{total}] across hosts (TCP links between network namespaces) …"));
    bar.set_message("across hosts");
    let t = Instant::now();
    figs.push(if root {
        match fig_tcp(profile) {
            Ok(f) => f,
            Err(e) => {
                bar.abandon();
                return Err(e);
            }
        }
    } else {
        Figure {
            id: "links",
            title: "Across hosts: TCP links between test hosts",
            paper: "(the papers' networks: CLAN, Myrinet)",
            ours: "skipped".into(),
            rows: Vec::new(),
            data: Value::Null,
            skipped: Some("needs root to create the test hosts (network namespaces); run as root".into()),
        }
    });
    say(format!(
        "      {} ({:.0} s)",
        figs.last().map_or(String::new(), |f| f.ours.clone()),
        t.elapsed().as_secs_f64()
    ));
    bar.finish_and_clear();
    figs.push(not_reproduced());
    write_report(&a.out, &figs, profile, started.elapsed().as_secs_f64())?;
    println!(
        "clan bench paper: {} figures in {:.0} s → {}",
        figs.len(),
        started.elapsed().as_secs_f64(),
        a.out.join("index.md").display()
    );
    println!();
    print!("{}", table_md(&figs)?);
    Ok(())
}

// ---- figures ------------------------------------------------------------------------------

fn fig_rtt(p: Profile) -> Result<Figure> {
    let iters = match p {
        Profile::Smoke => "2000",
        Profile::Quick => "30000",
        Profile::Default => "300000",
        Profile::Full => "1000000",
    };
    let spin: LatencyReport = bench_as(&s(&["latency", "--sync", "spin", "--iters", iters]))?;
    let block: LatencyReport =
        bench_as(&s(&["latency", "--sync", "block", "--iters", &(iters.parse::<u64>()? / 10).to_string()]))?;
    let rows = vec![
        (
            "RTT, 8 B, spinning (p50)".into(),
            nsu(spin.rtt_p50_ns),
            format!("{} (shm-raw)", nsu(spin.baseline_rtt_p50_ns)),
            r2(spin.ratio_p50),
        ),
        (
            "RTT, 8 B, blocking on tripwires (p50)".into(),
            nsu(block.rtt_p50_ns),
            format!("{} (unix)", nsu(block.baseline_rtt_p50_ns)),
            r2(block.ratio_p50),
        ),
    ];
    Ok(Figure {
        id: "rtt",
        title: "Shared-memory round trip, one word",
        paper: "3.7 µs RTT, 1.9 µs one way (T §5.2); 1.5 µs app to app (CLAN page)",
        ours: format!("RTT {} (shm-raw {})", nsu(spin.rtt_p50_ns), nsu(spin.baseline_rtt_p50_ns)),
        rows,
        data: json!({ "spin": spin, "block": block }),
        skipped: None,
    })
}

fn fig_bandwidth(p: Profile) -> Result<Figure> {
    let sizes: &[u64] = match p {
        Profile::Smoke => &[4096, 65536],
        Profile::Quick => &[4096, 65536, 1 << 20],
        Profile::Default => &[1024, 4096, 16384, 65536, 262144, 1 << 20],
        Profile::Full => &[256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20],
    };
    let bytes: u64 = match p {
        Profile::Smoke => 16 << 20,
        Profile::Quick => 128 << 20,
        Profile::Default => 1 << 30,
        Profile::Full => 4 << 30,
    };
    let mut points = Vec::new();
    for &size in sizes {
        let iters = (bytes / size).max(1000).to_string();
        let pio: BandwidthReport =
            bench_as(&s(&["bandwidth", "--mode", "pio", "--size", &size.to_string(), "--iters", &iters]))?;
        let dma: BandwidthReport =
            bench_as(&s(&["bandwidth", "--mode", "dma", "--size", &size.to_string(), "--iters", &iters]))?;
        points.push((size, pio, dma));
    }
    let series = |f: fn(&(u64, BandwidthReport, BandwidthReport)) -> f64| -> Vec<(f64, f64)> {
        points.iter().map(|pt| (pt.0 as f64, f(pt))).collect()
    };
    let pio = series(|p| p.1.mbit_s);
    let dma = series(|p| p.2.mbit_s);
    let mem = series(|p| p.1.baseline_mbit_s);
    let at = |v: &[(f64, f64)], size: f64| v.iter().find(|(x, _)| *x == size).map_or(f64::NAN, |(_, y)| *y);
    let big = *sizes.last().unwrap_or(&(1 << 20)) as f64;
    let rows = vec![
        (
            format!("PIO, {} KiB", big as u64 >> 10),
            mbit(at(&pio, big)),
            format!("{} (memcpy)", mbit(at(&mem, big))),
            r2(at(&pio, big) / at(&mem, big)),
        ),
        (
            format!("DMA, {} KiB", big as u64 >> 10),
            mbit(at(&dma, big)),
            format!("{} (memcpy)", mbit(at(&mem, big))),
            r2(at(&dma, big) / at(&mem, big)),
        ),
    ];
    let data: Vec<Value> =
        points.iter().map(|(size, pio, dma)| json!({ "size": size, "pio": pio, "dma": dma })).collect();
    Ok(Figure {
        id: "bandwidth",
        title: "Raw bandwidth against size, PIO and DMA (T figure 7)",
        paper: "peak 910 Mbit/s (T fig 7); 960 Mbit/s (CLAN page)",
        ours: format!(
            "peak PIO {}, DMA {}",
            mbit(pio.iter().map(|p| p.1).fold(0.0, f64::max)),
            mbit(dma.iter().map(|p| p.1).fold(0.0, f64::max))
        ),
        rows,
        data: json!({ "series": { "pio": pio, "dma": dma, "memcpy": mem }, "raw": { "points": data } }),
        skipped: None,
    })
}

fn fig_server(p: Profile) -> Result<Figure> {
    let ns_list: &[usize] = match p {
        Profile::Smoke => &[1, 16, 32],
        Profile::Quick => &[1, 100, 1000],
        Profile::Default => &[1, 10, 100, 1000, 10000],
        Profile::Full => &[1, 10, 100, 1000, 3000, 10000],
    };
    let requests = match p {
        Profile::Smoke => "1000",
        Profile::Quick => "10000",
        Profile::Default => "100000",
        Profile::Full => "300000",
    };
    let mut busy: Vec<ServerReport> = Vec::new();
    for &n in ns_list {
        busy.push(bench_as(&s(&["server", "--endpoints", &n.to_string(), "--mode", "busy", "--requests", requests]))?);
    }
    let idle: ServerReport = bench_as(&s(&[
        "server",
        "--endpoints",
        "1",
        "--mode",
        "idle",
        "--requests",
        if p == Profile::Smoke { "300" } else { "5000" },
    ]))?;
    let wide = if p == Profile::Smoke { "16" } else { "1000" };
    let many: ServerReport =
        bench_as(&s(&["server", "--endpoints", wide, "--mode", "busy", "--inflight", "16", "--requests", requests]))?;
    // 16 in flight again at the largest scale, past `wide`: how requests/s hold up
    // (issue's target: at 10 000 endpoints ≥ 0.9× at 1 000).
    let widest = ns_list.last().copied().filter(|&n| n > wide.parse().unwrap_or(usize::MAX));
    let many_far: Option<ServerReport> = match widest {
        Some(n) => Some(bench_as(&s(&[
            "server",
            "--endpoints",
            &n.to_string(),
            "--mode",
            "busy",
            "--inflight",
            "16",
            "--requests",
            requests,
        ]))?),
        None => None,
    };
    let spin_rtt = |v: &ServerReport| v.spin.clan.rtt_p50_ns;
    let spread = busy.iter().map(spin_rtt).max().unwrap_or(0) as f64
        / busy.iter().map(spin_rtt).min().unwrap_or(0).max(1) as f64;
    let both = |v: &'static ServerReport| {
        [(&v.spin, "both spinning", "busy-polling"), (&v.block, "both blocking", "blocking")]
    };
    // RTT rows, both ways.
    let rtt_rows = |what: &str, v: &'static ServerReport| -> Vec<Row> {
        both(v)
            .into_iter()
            .map(|(c, how, base)| {
                (
                    format!("{what}, {how} (p50)"),
                    nsu(c.clan.rtt_p50_ns),
                    format!("{} (epoll-tcp, {base})", nsu(c.baseline.rtt_p50_ns)),
                    r2(c.ratio_rtt_p50),
                )
            })
            .collect()
    };
    // Requests/s rows, both ways, with the target.
    let rate_rows = |what: &str, v: &'static ServerReport| -> Vec<Row> {
        both(v)
            .into_iter()
            .map(|(c, how, base)| {
                (
                    format!("{what}, {how}"),
                    format!("{:.0}", c.clan.req_per_s),
                    format!("{:.0} (epoll-tcp, {base})", c.baseline.req_per_s),
                    format!(
                        "{} ({})",
                        times(c.ratio_req_per_s),
                        if c.target_met { "≥ 20×: met" } else { "≥ 20×: not met" }
                    ),
                )
            })
            .collect()
    };
    let raw_row = |v: &ServerReport| -> Row {
        (
            format!(
                "busy RTT, {} endpoint{}, both spinning, against the raw shm ping-pong (p50)",
                v.endpoints,
                if v.endpoints == 1 { "" } else { "s" }
            ),
            nsu(spin_rtt(v)),
            format!("{} (shm-raw, same run)", v.raw_shm_rtt_p50_ns.map_or("—".into(), nsu)),
            format!(
                "{} ({})",
                v.raw_shm_ratio.map_or("—".into(), r2),
                match v.raw_shm_target_met {
                    Some(true) => "≤ 2×: met",
                    Some(false) => "≤ 2×: not met",
                    None => "—",
                }
            ),
        )
    };
    // The reports live for the run (their text borrows from leaked JSON too).
    let (busy, idle, many): (&'static [ServerReport], &'static ServerReport, &'static ServerReport) =
        (Box::leak(busy.into_boxed_slice()), Box::leak(Box::new(idle)), Box::leak(Box::new(many)));
    let many_far: Option<&'static ServerReport> = many_far.map(|v| &*Box::leak(Box::new(v)));
    let at = |n: usize| busy.iter().find(|v| v.endpoints == n);
    let first = at(ns_list[0]).ok_or("no first point")?;
    let last = at(*ns_list.last().unwrap_or(&1)).ok_or("no last point")?;
    let mut rows = rtt_rows("busy RTT, 1 endpoint", first);
    rows.extend(rtt_rows(&format!("busy RTT, {} endpoints", last.endpoints), last));
    rows.push(raw_row(first));
    rows.push(raw_row(last));
    // How the round trip grows with the endpoints, against how the raw ping-pong grows when
    // it touches as many slots (a page each) at random: the machine's own floor at that scale.
    if last.endpoints > first.endpoints {
        let growth = super::report::ratio(spin_rtt(last) as f64, spin_rtt(first) as f64);
        // (both raw figures from the last run, alternating in its rounds)
        let floor = last
            .raw_slots_rtt_p50_ns
            .zip(last.raw_shm_rtt_p50_ns)
            .map(|(n, one)| super::report::ratio(n as f64, one as f64));
        rows.push((
            format!("busy RTT growth, both spinning: {} endpoints / {} (p50)", last.endpoints, first.endpoints),
            format!("{growth:.2}×"),
            match (floor, last.raw_slots_rtt_p50_ns) {
                (Some(f), Some(n)) => {
                    // (and over the slots packed on cache lines, as clan's pools carve small
                    // connection sides: the floor of that layout)
                    let packed = last.raw_packed_rtt_p50_ns.zip(last.raw_shm_rtt_p50_ns).map_or(String::new(), |(p, one)| {
                        format!("; {:.2}× packed on cache lines, {}", super::report::ratio(p as f64, one as f64), nsu(p))
                    });
                    format!(
                        "{f:.2}× (shm-raw over {} slots a page each, at random, {}{packed}; against one slot; same run)",
                        last.endpoints,
                        nsu(n)
                    )
                }
                _ => "—".into(),
            },
            format!("{} (≤ 1.15×: {})", r2(growth), if growth <= 1.15 { "met" } else { "not met" }),
        ));
    }
    rows.extend(rtt_rows("idle RTT, 1 endpoint", idle));
    rows.push((
        "idle RTT, 1 endpoint, clan as the paper runs it (polls 15 µs, then sleeps; p50)".into(),
        nsu(idle.rtt_p50_ns),
        "—".into(),
        "—".into(),
    ));
    rows.push(("RTT spread over endpoints, both spinning (max/min p50)".into(), r2(spread), "—".into(), "—".into()));
    if let Some(k) = at(1000) {
        rows.extend(rate_rows("requests/s, 1000 endpoints, 1 in flight", k));
    }
    rows.extend(rate_rows(&format!("requests/s, {wide} endpoints, 16 in flight"), many));
    if let Some(far) = many_far {
        rows.extend(rate_rows(&format!("requests/s, {} endpoints, 16 in flight", far.endpoints), far));
    }
    // How requests/s hold up from `wide` endpoints to the largest scale, each way, against
    // how the epoll TCP server's hold up in the same runs.
    let mut pairs: Vec<(&str, &ServerReport, &ServerReport)> = Vec::new();
    if let Some(k) = at(wide.parse().unwrap_or(0)).filter(|k| last.endpoints > k.endpoints) {
        pairs.push(("1 in flight", k, last));
    }
    if let Some(far) = many_far {
        pairs.push(("16 in flight", many, far));
    }
    for (flight, near, far) in pairs {
        for ((nc, how, base), (fc, _, _)) in both(near).into_iter().zip(both(far)) {
            let clan = super::report::ratio(fc.clan.req_per_s, nc.clan.req_per_s);
            let tcp = super::report::ratio(fc.baseline.req_per_s, nc.baseline.req_per_s);
            rows.push((
                format!("requests/s growth, {flight}, {how}: {} endpoints / {}", far.endpoints, near.endpoints),
                format!("{clan:.2}×"),
                format!("{tcp:.2}× (epoll-tcp, {base}, same runs)"),
                format!("{} (≥ 0.9×: {})", r2(clan), if clan >= 0.9 { "met" } else { "not met" }),
            ));
        }
    }
    Ok(Figure {
        id: "server",
        title: "Event-driven server: round trip and requests/s against endpoints (T §5.3, figures 8 and 9)",
        paper: "busy 7.9 µs, idle 16.8 µs RTT, flat in the endpoints; tends to 340 000 req/s (461 000 on the CLAN page); GbE TCP 21 184 req/s",
        ours: format!(
            "busy RTT spinning {} → {} over {}…{} endpoints (blocking {} → {}); idle {} as the paper runs it",
            nsu(spin_rtt(first)),
            nsu(spin_rtt(last)),
            ns_list[0],
            ns_list.last().unwrap_or(&1),
            nsu(first.block.clan.rtt_p50_ns),
            nsu(last.block.clan.rtt_p50_ns),
            nsu(idle.rtt_p50_ns)
        ),
        rows,
        data: json!({ "busy": busy, "idle": idle, "inflight16": many, "inflight16_widest": many_far }),
        skipped: None,
    })
}

/// The VMMC run gives several figures: one-way bandwidth (single vs streaming), send
/// overhead (M figure 4), fetch, notification, setup. Built here, split by `split_vmmc`.
fn fig_oneway_vmmc(p: Profile) -> Result<Figure> {
    let bytes = match p {
        Profile::Smoke => "4194304",
        Profile::Quick => "67108864",
        Profile::Default => "536870912",
        Profile::Full => "2147483648",
    };
    let iters = match p {
        Profile::Smoke => "300",
        Profile::Quick => "5000",
        Profile::Default => "50000",
        Profile::Full => "100000",
    };
    let r: VmmcReport = bench_as(&s(&["vmmc", "--bytes", bytes, "--iters", iters]))?;
    Ok(Figure {
        id: "vmmc",
        title: "VMMC",
        paper: "",
        ours: format!(
            "send_msg one way {}, notification {}",
            r.latency.first().map_or("—".into(), |l| nsu(l.one_way_p50_ns)),
            nsu(r.notification.wait_one_way_p50_ns)
        ),
        rows: Vec::new(),
        data: serde_json::to_value(&r)?,
        skipped: None,
    })
}

fn split_vmmc(fig: Figure) -> Result<Vec<Figure>> {
    if fig.id != "vmmc" {
        return Ok(vec![fig]);
    }
    let v: VmmcReport = typed(&fig.data)?;
    let bw = &v.bandwidth;
    let big = bw.last().ok_or("vmmc: no bandwidth point")?;
    let half = |f: fn(&BandwidthPoint) -> f64| -> String {
        let peak = bw.iter().map(f).fold(0.0, f64::max);
        bw.iter().find(|p| f(p) >= peak / 2.0).map_or("—".into(), |p| format!("{} B", p.size))
    };
    let oneway = Figure {
        id: "oneway",
        title: "One-way bandwidth: one message at a time (synchronous send) and streaming (asynchronous) (T figure 10)",
        paper: "streaming ≈ 900 Mbit/s with 6 µs setup; half bandwidth at ~750 B (T fig 10)",
        ours: format!("1 MiB: synchronous {}, streaming {}", mbit(big.sync_mbit_s), mbit(big.async_mbit_s)),
        rows: vec![
            (
                "one at a time, 1 MiB".into(),
                mbit(big.sync_mbit_s),
                format!("{} (memcpy)", mbit(big.baseline_mbit_s)),
                r2(big.sync_mbit_s / big.baseline_mbit_s),
            ),
            (
                "streaming, 1 MiB".into(),
                mbit(big.async_mbit_s),
                format!("{} (memcpy)", mbit(big.baseline_mbit_s)),
                r2(big.async_mbit_s / big.baseline_mbit_s),
            ),
            ("half of peak reached at (streaming)".into(), half(|p| p.async_mbit_s), "—".into(), "—".into()),
        ],
        data: json!({ "bandwidth": bw, "placement": v.placement }),
        skipped: None,
    };
    let ovh = bw.iter().find(|p| p.size == 65536).ok_or("vmmc: no 64 KiB point")?;
    let overhead = Figure {
        id: "send-overhead",
        title: "VMMC send overhead, synchronous and asynchronous, by size (M figure 4)",
        paper: "~3 µs for short sends; long asynchronous sends cheaper than synchronous (M fig 4)",
        ours: format!(
            "64 KiB: synchronous {}, asynchronous {}",
            nsu(ovh.sync_overhead_p50_ns),
            nsu(ovh.async_overhead_p50_ns)
        ),
        rows: vec![
            ("asynchronous send, 64 KiB (p50)".into(), nsu(ovh.async_overhead_p50_ns), "—".into(), "—".into()),
            ("synchronous send, 64 KiB (p50)".into(), nsu(ovh.sync_overhead_p50_ns), "—".into(), "—".into()),
            (
                "inline/DMA threshold".into(),
                format!("{} B", v.inline_max),
                v.crossover_bytes
                    .map_or("no crossover in the sizes measured".into(), |c| format!("crossover measured at {c} B")),
                "—".into(),
            ),
        ],
        data: json!({
            "bandwidth": bw, "inline_max": v.inline_max, "crossover_bytes": v.crossover_bytes,
            "placement": v.placement,
        }),
        skipped: None,
    };
    let lat0 = v.latency.first().ok_or("vmmc: no latency point")?;
    let fetch0 = v.fetch.first().ok_or("vmmc: no fetch point")?;
    let latency = Figure {
        id: "vmmc-latency",
        title: "VMMC one-way latency and remote fetch (M §5.3, NT figures 7 and 8)",
        paper: "9.8 µs one way, 108.4 MB/s = 98 % of the hardware (M §5.3); fetch measured (NT figs 7–8)",
        ours: format!("send_msg one way {}; fetch 8 B {}", nsu(lat0.one_way_p50_ns), nsu(fetch0.latency_p50_ns)),
        rows: vec![
            (
                "send_msg one way, 8 B (p50)".into(),
                nsu(lat0.one_way_p50_ns),
                format!("{} (shm-raw)", nsu(lat0.baseline_one_way_p50_ns)),
                r2(lat0.ratio),
            ),
            (
                "fetch 8 B (p50)".into(),
                nsu(fetch0.latency_p50_ns),
                format!("{} (memcpy)", nsu(fetch0.baseline_memcpy_p50_ns)),
                "—".into(),
            ),
        ],
        data: json!({ "latency": v.latency, "fetch": v.fetch, "placement": v.placement }),
        skipped: None,
    };
    let n = &v.notification;
    let per = |x: u64| r2(x as f64 / n.baseline_one_way_p50_ns as f64);
    let notif = Figure {
        id: "notification",
        title: "VMMC notification overhead (NT §5.3)",
        paper: "30 µs Linux, 52 µs NT (NT §5.3)",
        ours: format!(
            "{} (waiter spinning first), {} sleeping",
            nsu(n.wait_one_way_p50_ns),
            nsu(n.sleep_one_way_p50_ns)
        ),
        rows: vec![
            (
                "one way, waiting thread (p50)".into(),
                nsu(n.wait_one_way_p50_ns),
                format!("{} (unix)", nsu(n.baseline_one_way_p50_ns)),
                r2(n.ratio),
            ),
            (
                "one way, handler thread (p50)".into(),
                nsu(n.handler_one_way_p50_ns),
                format!("{} (unix)", nsu(n.baseline_one_way_p50_ns)),
                per(n.handler_one_way_p50_ns),
            ),
            (
                "one way, nobody spinning (p50)".into(),
                nsu(n.sleep_one_way_p50_ns),
                format!("{} (unix)", nsu(n.baseline_one_way_p50_ns)),
                per(n.sleep_one_way_p50_ns),
            ),
        ],
        data: json!({ "notification": n, "placement": v.placement }),
        skipped: None,
    };
    let st = &v.setup;
    let vs = |a: u64, b: u64| r2(a as f64 / b as f64);
    let setup = Figure {
        id: "setup",
        title: "Export and import cost (NT §5.1)",
        paper: "export 43 µs, import 68 µs (NT §5.1)",
        ours: format!(
            "export {}, import across processes {}",
            nsu(st.export_4k_fresh_ns),
            nsu(st.import_cross_process_ns)
        ),
        rows: vec![
            (
                "export 4 KiB, fresh".into(),
                nsu(st.export_4k_fresh_ns),
                format!("{} (memfd+mmap)", nsu(st.baseline_memfd_mmap_4k_ns)),
                vs(st.export_4k_fresh_ns, st.baseline_memfd_mmap_4k_ns),
            ),
            (
                "export 4 KiB, from the endpoint cache".into(),
                nsu(st.export_4k_cached_ns),
                format!("{} (memfd+mmap)", nsu(st.baseline_memfd_mmap_4k_ns)),
                vs(st.export_4k_cached_ns, st.baseline_memfd_mmap_4k_ns),
            ),
            (
                "import, another process".into(),
                nsu(st.import_cross_process_ns),
                format!("{} (unix request/response)", nsu(st.baseline_unix_rtt_ns)),
                vs(st.import_cross_process_ns, st.baseline_unix_rtt_ns),
            ),
        ],
        data: json!({ "setup": st, "placement": v.placement }),
        skipped: None,
    };
    Ok(vec![oneway, overhead, latency, notif, setup])
}

fn fig_queue(p: Profile) -> Result<Figure> {
    let rounds = match p {
        Profile::Smoke | Profile::Quick => "1",
        Profile::Default => "3",
        Profile::Full => "5",
    };
    let v: QueueReport = if p == Profile::Smoke {
        bench_as(&s(&["queue", "--rounds", rounds, "--size", "32768"]))?
    } else {
        bench_as(&s(&["queue", "--rounds", rounds]))?
    };
    let k32 = v.points.iter().find(|x| x.size == 32768).ok_or("queue: no 32 KiB point")?;
    let small = v.points.first().ok_or("queue: no point")?;
    let opt = |x: Option<f64>| x.map_or("—".into(), r2);
    let size_of = |x: Option<usize>| x.map_or("—".into(), |n| format!("{n} B"));
    let mut rows = vec![
        (
            "32 KiB transfers".into(),
            mbit(k32.mbit_s),
            format!("{} (memcpy in and out)", mbit(k32.baseline_mbit_s)),
            r2(k32.ratio),
        ),
        (
            "32 KiB transfers, against a hand-written ring".into(),
            mbit(k32.mbit_s),
            format!("{} (ring of the same size, no tripwires)", k32.ring_mbit_s.map_or("—".into(), mbit)),
            opt(k32.ring_ratio),
        ),
        (
            "32 KiB transfers, slot-based message queue (multi-part messages)".into(),
            mbit(k32.slot_mbit_s),
            format!("{} (memcpy in and out)", mbit(k32.baseline_mbit_s)),
            r2(k32.slot_ratio),
        ),
        (
            format!("{} B messages per second, slot-based message queue", small.size),
            format!("{:.0}", small.slot_msg_per_s),
            format!("{:.0} (the byte stream)", small.msg_per_s),
            r2(small.slot_msg_per_s / small.msg_per_s),
        ),
        ("peak".into(), mbit(v.peak_mbit_s), "—".into(), "—".into()),
        ("half of the peak reached at".into(), size_of(v.half_peak_size), "—".into(), "—".into()),
        (
            "half of the peak reached at, by the ring with one fence a publication (a tripwire's least)".into(),
            size_of(v.fenced_ring_half_peak_size),
            "—".into(),
            "—".into(),
        ),
        ("peak, slot-based message queue".into(), mbit(v.slot_peak_mbit_s), "—".into(), "—".into()),
        (
            "half of the peak reached at, slot-based message queue".into(),
            size_of(v.slot_half_peak_size),
            "—".into(),
            "—".into(),
        ),
        ("buffer per endpoint".into(), format!("{} KiB", v.buffer_bytes >> 10), "—".into(), "—".into()),
    ];
    if let Some(batch) = small.batch_msg_per_s {
        let size = small.size;
        rows.insert(
            4,
            (
                format!("{size} B messages per second, sent in batches (MsgSender::send_batch)"),
                format!("{batch:.0}"),
                match small.ucx_msg_per_s {
                    Some(u) => format!("{u:.0} (UCX tag_bw, shared memory)"),
                    None => "(UCX not installed)".into(),
                },
                opt(small.batch_vs_ucx),
            ),
        );
        rows.insert(
            5,
            (
                format!("{size} B messages, batched, against the hand-written ring"),
                mbit(batch * size as f64 * 8.0 / 1e6),
                format!("{} (ring)", small.ring_mbit_s.map_or("—".into(), mbit)),
                opt(small.batch_vs_ring),
            ),
        );
    }
    Ok(Figure {
        id: "queue",
        title: "Distributed queue streaming, copied into and out of the queue (CLAN page)",
        paper: "880 Mbit/s at 32 KB, half of it at 128 B transfers, 10 KB of buffer per endpoint",
        ours: format!(
            "{} at 32 KiB, half of the peak at {}, {} KiB per endpoint",
            mbit(k32.mbit_s),
            size_of(v.half_peak_size),
            v.buffer_bytes >> 10
        ),
        rows,
        data: serde_json::to_value(&v)?,
        skipped: None,
    })
}

fn fig_stream(p: Profile) -> Result<Figure> {
    let (bytes, iters) = match p {
        Profile::Smoke => ("8388608", "300"),
        Profile::Quick => ("268435456", "6000"),
        Profile::Default => ("2147483648", "60000"),
        Profile::Full => ("4294967296", "200000"),
    };
    let v: StreamReport = bench_as(&s(&["stream", "--bytes", bytes, "--iters", iters]))?;
    let mut rows = vec![
        (
            "RTT, 64 B, both spinning (p50)".into(),
            nsu(v.spin.clan_rtt_p50_ns),
            format!(
                "{} (unix), {} (tcp), non-blocking, polled",
                nsu(v.spin.unix_rtt_p50_ns),
                nsu(v.spin.tcp_rtt_p50_ns)
            ),
            r2(v.ratio_spin),
        ),
        (
            "RTT, 64 B, both blocking (p50)".into(),
            nsu(v.block.clan_rtt_p50_ns),
            format!("{} (unix), {} (tcp), blocking", nsu(v.block.unix_rtt_p50_ns), nsu(v.block.tcp_rtt_p50_ns)),
            r2(v.ratio_block),
        ),
        (
            "bandwidth, 64 KiB writes".into(),
            mbit(v.mbit_s),
            format!("{} (unix), {} (tcp)", mbit(v.unix_mbit_s), mbit(v.tcp_mbit_s)),
            r2(v.bw_ratio_vs_unix),
        ),
    ];
    for (l, how) in [(&v.link, "engine receiving"), (&v.link_manual, "manual progress")] {
        rows.push((
            format!("RTT, 64 B, over a TCP link ({how}), spinning / blocking (p50)"),
            format!("{} / {}", nsu(l.spin_rtt_p50_ns), nsu(l.block_rtt_p50_ns)),
            format!("{} / {} (kernel TCP over loopback)", nsu(l.tcp_spin_rtt_p50_ns), nsu(l.tcp_block_rtt_p50_ns)),
            format!("{} / {}", r2(l.ratio_spin_vs_tcp), r2(l.ratio_block_vs_tcp)),
        ));
        rows.push((
            format!("bandwidth over a TCP link ({how}), 64 KiB writes"),
            mbit(l.mbit_s),
            format!("{} (kernel TCP over loopback)", mbit(l.tcp_mbit_s)),
            r2(l.bw_ratio_vs_tcp),
        ));
    }
    if let Some(o) = &v.one_core {
        rows.insert(
            2,
            (
                "RTT, 64 B, both on one CPU, blocking (p50)".into(),
                nsu(o.clan_block_p50_ns),
                format!(
                    "{} (unix, blocking); clan with its defaults {}",
                    nsu(o.unix_p50_ns),
                    nsu(o.clan_default_p50_ns)
                ),
                r2(o.ratio_block),
            ),
        );
    }
    Ok(Figure {
        id: "stream",
        title: "Stream sockets (NT §4.1)",
        paper: "20 µs one way, > 84 MB/s peak (NT §4.1)",
        ours: format!(
            "one way {} spinning, {} blocking, {}; RTT ≤ 1× Unix met {}",
            nsu(v.spin.clan_rtt_p50_ns / 2),
            nsu(v.block.clan_rtt_p50_ns / 2),
            mbit(v.mbit_s),
            v.target_met
        ),
        rows,
        data: serde_json::to_value(&v)?,
        skipped: None,
    })
}

fn fig_tokio(p: Profile) -> Result<Figure> {
    let (clients, millis) = match p {
        Profile::Smoke => ("2,9", "100"),
        Profile::Quick => ("4,64", "500"),
        Profile::Default => ("1,4,16,64", "2000"),
        Profile::Full => ("1,4,16,64,256", "3000"),
    };
    let v: TokioReport = bench_as(&s(&["tokio", "--clients", clients, "--millis", millis]))?;
    let met = v.points.iter().all(|p| p.target_met);
    let last = v.points.last().ok_or("tokio: no point")?;
    Ok(Figure {
        id: "tokio",
        title: "tokio: concurrent request/response clients",
        paper: "(not in the papers: async Rust servers are what our users write)",
        ours: format!(
            "{:.0} req/s at {} clients: {}× tokio over Unix sockets; ≥ 1× at every count: {}",
            last.clan.requests_per_s,
            last.clients,
            r2(last.ratio_vs_unix),
            if met { "met" } else { "not met" }
        ),
        rows: v
            .points
            .iter()
            .flat_map(|p| {
                let n = p.clients;
                [
                    (
                        format!("req/s, {n} clients, reactors spinning then sleeping"),
                        format!("{:.0}", p.clan.requests_per_s),
                        format!(
                            "{:.0} (tokio over Unix), {:.0} (over TCP)",
                            p.unix.requests_per_s, p.tcp.requests_per_s
                        ),
                        r2(p.ratio_vs_unix),
                    ),
                    (
                        format!("req/s, {n} clients, reactors never spinning"),
                        format!("{:.0}", p.clan_no_spin.requests_per_s),
                        format!("{:.0} (tokio over Unix)", p.unix.requests_per_s),
                        r2(p.ratio_no_spin_vs_unix),
                    ),
                ]
            })
            .collect(),
        data: serde_json::to_value(&v)?,
        skipped: None,
    })
}

fn fig_rpc(p: Profile) -> Result<Figure> {
    let iters = match p {
        Profile::Smoke => "500",
        Profile::Quick => "20000",
        Profile::Default => "200000",
        Profile::Full => "500000",
    };
    let v: RpcReport = bench_as(&s(&["rpc", "--iters", iters]))?;
    Ok(Figure {
        id: "rpc",
        title: "RPC on flags and tripwires (T §4.1)",
        paper: "(the paper builds RPC this way; no figure)",
        ours: format!(
            "RTT {} spinning ({:.0} calls/s), {} blocking; RTT ≤ 1× Unix met {}",
            nsu(v.spin.clan.rtt_p50_ns),
            v.spin.clan.calls_per_s,
            nsu(v.block.clan.rtt_p50_ns),
            v.target_met
        ),
        rows: [(&v.spin, "both spinning", "non-blocking, polled"), (&v.block, "both blocking", "blocking")]
            .into_iter()
            .flat_map(|(c, how, base)| {
                [
                    (
                        format!("RTT, 64 B, {how} (p50)"),
                        nsu(c.clan.rtt_p50_ns),
                        format!("{} (unix, {base})", nsu(c.baseline.rtt_p50_ns)),
                        r2(c.ratio_rtt_p50),
                    ),
                    (
                        format!("calls/s, {how}"),
                        format!("{:.0}", c.clan.calls_per_s),
                        format!("{:.0} (unix, {base})", c.baseline.calls_per_s),
                        times(c.ratio_calls_per_s),
                    ),
                ]
            })
            .collect(),
        data: serde_json::to_value(&v)?,
        skipped: None,
    })
}

/// Connection set-up: a stream connected, a byte each way, closed, one after another (not
/// in the papers, whose connections were set up once; servers of short connections are what
/// many of our users run).
fn fig_connect(p: Profile) -> Result<Figure> {
    let (iters, rounds) = match p {
        Profile::Smoke => ("50", "1"),
        Profile::Quick => ("300", "2"),
        Profile::Default => ("1000", "4"),
        Profile::Full => ("2000", "6"),
    };
    let v: ConnectReport = bench_as(&s(&["connect", "--iters", iters, "--rounds", rounds]))?;
    Ok(Figure {
        id: "connect",
        title: "Connection set-up: connect, a byte each way, close",
        paper: "(not in the papers: their connections were made once; short connections are what many servers take)",
        ours: format!(
            "{} p50, {:.0} connections/s: {}× kernel TCP's p50",
            nsu(v.connect_p50_ns),
            v.conns_per_s,
            r2(v.ratio_p50_vs_tcp)
        ),
        rows: vec![
            (
                "connect and first byte echoed (p50)".into(),
                nsu(v.connect_p50_ns),
                format!("{} (tcp), {} (unix)", nsu(v.tcp_connect_p50_ns), nsu(v.unix_connect_p50_ns)),
                r2(v.ratio_p50_vs_tcp),
            ),
            (
                "connect and first byte echoed (p99)".into(),
                nsu(v.connect_p99_ns),
                format!("{} (tcp), {} (unix)", nsu(v.tcp_connect_p99_ns), nsu(v.unix_connect_p99_ns)),
                r2(v.connect_p99_ns as f64 / v.tcp_connect_p99_ns.max(1) as f64),
            ),
            (
                "connections/s, one at a time".into(),
                format!("{:.0}", v.conns_per_s),
                format!("{:.0} (tcp), {:.0} (unix)", v.tcp_conns_per_s, v.unix_conns_per_s),
                times(v.conns_per_s / v.tcp_conns_per_s.max(1.0)),
            ),
        ],
        data: serde_json::to_value(&v)?,
        skipped: None,
    })
}

fn fig_tcp(p: Profile) -> Result<Figure> {
    let iters = match p {
        Profile::Smoke => "500",
        Profile::Quick => "20000",
        Profile::Default => "100000",
        Profile::Full => "300000",
    };
    let lat: LatencyReport = bench_as(&s(&["latency", "--transport", "tcp", "--sync", "spin", "--iters", iters]))?;
    let bw_iters = match p {
        Profile::Smoke => "500",
        Profile::Quick => "4000",
        _ => "16000",
    };
    let bw: BandwidthReport =
        bench_as(&s(&["bandwidth", "--transport", "tcp", "--size", "65536", "--iters", bw_iters]))?;
    Ok(Figure {
        id: "links",
        title: "Across hosts: TCP links between test hosts (network namespaces, veth)",
        paper: "(the papers' networks: CLAN 1.5 µs app to app; Myrinet 9.8 µs)",
        ours: format!("RTT {}, {}", nsu(lat.rtt_p50_ns), mbit(bw.mbit_s)),
        rows: vec![
            (
                "RTT, 8 B, spinning (p50)".into(),
                nsu(lat.rtt_p50_ns),
                format!("{} (tcp)", nsu(lat.baseline_rtt_p50_ns)),
                r2(lat.ratio_p50),
            ),
            (
                "streaming PIO, 64 KiB".into(),
                mbit(bw.mbit_s),
                format!("{} (tcp stream)", mbit(bw.baseline_mbit_s)),
                r2(bw.ratio),
            ),
        ],
        data: json!({ "latency": lat, "bandwidth": bw }),
        skipped: None,
    })
}

/// Unmodified programs (sockperf, redis) under `clan run` against themselves over the kernel
/// (the tripwire paper ran unmodified applications over CLAN: §6).
fn fig_run(p: Profile) -> Result<Figure> {
    let (secs, requests, rounds) = match p {
        Profile::Smoke => ("1", "2000", "1"),
        Profile::Quick => ("2", "20000", "1"),
        Profile::Default => ("3", "50000", "2"),
        Profile::Full => ("5", "100000", "3"),
    };
    let v: RunReport = bench_as(&s(&["run", "--secs", secs, "--requests", requests, "--rounds", rounds]))?;
    let rows: Vec<Row> = v
        .rows
        .iter()
        .map(|r| program_row(r.program, &r.measure, r.clan, r.baseline, r.baseline_name, r.ratio))
        .collect();
    let skipped = &v.skipped;
    let ours = if rows.is_empty() {
        "skipped (sockperf and redis are not installed)".to_string()
    } else {
        rows.iter().map(|r| format!("{} {}", r.0, r.3)).collect::<Vec<_>>().join("; ")
    };
    Ok(Figure {
        id: "run",
        title: "Unmodified applications under clan run (T §6)",
        paper: "(the paper ran unmodified applications over CLAN sockets; no comparable figure)",
        ours,
        skipped: (rows.is_empty()).then(|| skipped.join("; ")),
        rows,
        data: serde_json::to_value(&v)?,
    })
}

/// A row of a program's measure against its baseline (`clan bench run`, `clan bench fabric`).
fn program_row(program: &str, measure: &str, clan: f64, baseline: f64, baseline_name: &str, ratio: f64) -> Row {
    let num = |x: f64| if x < 100.0 { format!("{x:.3}") } else { format!("{x:.0}") };
    (format!("{program}: {measure}"), num(clan), format!("{} ({baseline_name})", num(baseline)), r2(ratio))
}

/// libfabric's `fi_pingpong` and an MPI ping-pong over the clan provider against libfabric's
/// own providers and Open MPI's shared memory (`clan bench fabric`; the tripwire paper's MPI
/// row: §6.3).
fn fig_fabric(p: Profile) -> Result<Figure> {
    let (iters, rounds) = match p {
        Profile::Smoke => ("200", "1"),
        // (enough iterations that the connections made by the first one weigh little: that
        // cost has its own row)
        Profile::Quick => ("5000", "1"),
        // (three rounds: the median rides over a round that lands in one of this host's
        // slow phases, which single MPI runs here sometimes do, for either provider)
        Profile::Default => ("50000", "3"),
        Profile::Full => ("50000", "5"),
    };
    let v: FabricReport = bench_as(&s(&["fabric", "--iters", iters, "--rounds", rounds]))?;
    let rows: Vec<Row> = v
        .rows
        .iter()
        .map(|r| program_row(r.program, &r.measure, r.clan, r.baseline, r.baseline_name, r.ratio))
        .collect();
    let skipped = &v.skipped;
    let ours = if rows.is_empty() {
        "skipped (libfabric's fi_pingpong and Open MPI are not installed)".to_string()
    } else {
        rows.iter().map(|r| format!("{} {} ×{}", r.0, r.1, r.3)).collect::<Vec<_>>().join("; ")
    };
    Ok(Figure {
        id: "fabric",
        title: "libfabric programs and MPI over the clan provider (T §6.3)",
        paper: "MPI over CLAN: 16 µs round trip (T §6.3)",
        ours,
        skipped: (rows.is_empty()).then(|| skipped.join("; ")),
        rows,
        data: serde_json::to_value(&v)?,
    })
}

fn not_reproduced() -> Figure {
    Figure {
        id: "not-reproduced",
        title: "Not reproduced",
        paper: "IP over the network (T table 1: 100 µs RTT, 225 Mbit/s)",
        ours: "not built: clan has no IP device".into(),
        rows: Vec::new(),
        data: Value::Null,
        skipped: Some("clan does not implement IP over the network".into()),
    }
}

// ---- the report ---------------------------------------------------------------------------

/// The report's templates (`templates/`): the Markdown table (also printed at the end of
/// the run), `index.md` and `index.html` (escaped by minijinja for HTML).
fn templates() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.add_template("table.md", include_str!("templates/table.md")).expect("table.md parses");
    env.add_template("index.md", include_str!("templates/index.md")).expect("index.md parses");
    env.add_template("index.html", include_str!("templates/index.html")).expect("index.html parses");
    // A Markdown table cell: no pipe or line break may end it early.
    env.add_filter("cell", |v: String| v.replace('|', "\\|").replace('\n', " "));
    env
}

/// What the templates see of the figures.
fn figures_ctx(figs: &[Figure]) -> Vec<Value> {
    figs.iter()
        .map(|fig| {
            json!({
                "id": fig.id, "title": fig.title, "paper": fig.paper, "ours": fig.ours, "skipped": fig.skipped,
                "rows": fig.rows.iter().map(|(what, ours, base, ratio)| json!({
                    "what": what, "ours": ours, "base": base, "ratio": ratio,
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

fn table_md(figs: &[Figure]) -> Result<String> {
    Ok(templates().get_template("table.md")?.render(minijinja::context! { figures => figures_ctx(figs) })?)
}

fn write_report(dir: &Path, figs: &[Figure], profile: Profile, secs: f64) -> Result<()> {
    let m = sys::machine();
    for fig in figs {
        std::fs::write(
            dir.join(format!("{}.json", fig.id)),
            serde_json::to_string_pretty(&json!({
                "id": fig.id, "title": fig.title, "paper": fig.paper, "ours": fig.ours,
                "skipped": fig.skipped, "data": fig.data, "machine": &m,
            }))?,
        )?;
        if fig.skipped.is_none() {
            plot(dir, fig, &m)?;
        }
    }
    let env = templates();
    let ctx = minijinja::context! {
        machine => &m,
        profile => format!("{profile:?}"),
        secs => secs.round() as u64,
        figures => figures_ctx(figs),
    };
    std::fs::write(dir.join("index.md"), env.get_template("index.md")?.render(&ctx)?)?;
    std::fs::write(dir.join("index.html"), env.get_template("index.html")?.render(&ctx)?)?;
    Ok(())
}

/// The first `placement` the figure's benchmarks reported (how their processes sat on the
/// CPUs), for the plot's footer.
fn placement(v: &Value) -> Option<String> {
    match v {
        Value::Object(m) => {
            m.get("placement").and_then(Value::as_str).map(str::to_owned).or_else(|| m.values().find_map(placement))
        }
        Value::Array(a) => a.iter().find_map(placement),
        _ => None,
    }
}

/// The baseline's name in a row's baseline cell: "160 ns (shm-raw)" → "shm-raw".
fn baseline_name(cell: &str) -> String {
    match (cell.rfind('('), cell.rfind(')')) {
        (Some(a), Some(b)) if b > a + 1 => cell[a + 1..b].to_owned(),
        _ => "baseline".into(),
    }
}

/// One SVG per figure: curves when it has them, ratio bars of its rows otherwise.
fn plot(dir: &Path, fig: &Figure, m: &sys::Machine) -> Result<()> {
    use super::plot::{Axis, Lines, Ratios, Unit};
    let path = dir.join(format!("{}.svg", fig.id));
    let footer = format!(
        "Machine: {} × {}, Linux {}. Placement: {}",
        m.cpus,
        m.model,
        m.kernel,
        placement(&fig.data).unwrap_or_else(|| "as each benchmark states in the JSON".into())
    );
    let size = |label| Axis { label, unit: Unit::Bytes };
    let bandwidth = Axis { label: "bandwidth", unit: Unit::Mbits };
    let mut curves: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let (mut x, mut y) = (size("message size"), bandwidth);
    match fig.id {
        "bandwidth" => {
            for (k, name) in [
                ("pio", "PIO (stores into the mapping)"),
                ("dma", "DMA (the NIC's engine)"),
                ("memcpy", "memcpy (baseline)"),
            ] {
                let pts: Vec<(f64, f64)> = serde_json::from_value(fig.data["series"][k].clone()).unwrap_or_default();
                curves.push((name.into(), pts));
            }
        }
        "queue" => {
            x = size("transfer size");
            let r: QueueReport = typed(&fig.data)?;
            let curve = |f: fn(&QueuePoint) -> f64| -> Vec<(f64, f64)> {
                r.points.iter().map(|p| (p.size as f64, f(p))).collect()
            };
            curves.push(("clan byte queue".into(), curve(|p| p.mbit_s)));
            curves.push(("clan slot message queue".into(), curve(|p| p.slot_mbit_s)));
            curves.push(("memcpy in and out (baseline)".into(), curve(|p| p.baseline_mbit_s)));
            curves.push(("hand-written ring (baseline)".into(), curve(|p| p.ring_mbit_s.unwrap_or(f64::NAN))));
            curves.push((
                "hand-written ring, a fence a publication".into(),
                curve(|p| p.fenced_ring_mbit_s.unwrap_or(f64::NAN)),
            ));
        }
        "oneway" | "send-overhead" => {
            let pts: Vec<BandwidthPoint> = typed(&fig.data["bandwidth"])?;
            let curve = |f: fn(&BandwidthPoint) -> f64| -> Vec<(f64, f64)> {
                pts.iter().map(|p| (p.size as f64, f(p))).collect()
            };
            if fig.id == "oneway" {
                curves.push(("clan send_msg, one at a time".into(), curve(|p| p.sync_mbit_s)));
                curves.push(("clan send_msg, streaming".into(), curve(|p| p.async_mbit_s)));
                curves.push(("memcpy (baseline)".into(), curve(|p| p.baseline_mbit_s)));
            } else {
                y = Axis { label: "sender's time per send, p50", unit: Unit::Nanos };
                curves.push(("synchronous".into(), curve(|p| p.sync_overhead_p50_ns as f64)));
                curves.push(("asynchronous".into(), curve(|p| p.async_overhead_p50_ns as f64)));
                curves.push(("asynchronous, PIO forced".into(), curve(|p| p.pio_overhead_p50_ns as f64)));
                curves.push(("asynchronous, DMA forced".into(), curve(|p| p.dma_overhead_p50_ns as f64)));
            }
        }
        "tokio" => {
            let r: TokioReport = typed(&fig.data)?;
            x = Axis { label: "concurrent clients", unit: Unit::Count };
            y = Axis { label: "requests per second", unit: Unit::PerSec };
            let curve = |f: fn(&TokioPoint) -> f64| -> Vec<(f64, f64)> {
                r.points.iter().map(|p| (p.clients as f64, f(p))).collect()
            };
            curves.push(("clan, spinning then sleeping".into(), curve(|p| p.clan.requests_per_s)));
            curves.push(("clan, never spinning".into(), curve(|p| p.clan_no_spin.requests_per_s)));
            curves.push(("tokio over Unix sockets (baseline)".into(), curve(|p| p.unix.requests_per_s)));
            curves.push(("tokio over loopback TCP (baseline)".into(), curve(|p| p.tcp.requests_per_s)));
        }
        "server" => {
            let busy: Vec<ServerReport> = typed(&fig.data["busy"])?;
            x = Axis { label: "endpoints (connections)", unit: Unit::Count };
            y = Axis { label: "round trip, p50", unit: Unit::Nanos };
            let curve = |f: fn(&ServerReport) -> Option<u64>| -> Vec<(f64, f64)> {
                busy.iter().map(|p| (p.endpoints as f64, f(p).map_or(f64::NAN, |v| v as f64))).collect()
            };
            curves.push(("clan, spinning".into(), curve(|p| Some(p.spin.clan.rtt_p50_ns))));
            curves.push(("epoll TCP, busy-polling (baseline)".into(), curve(|p| Some(p.spin.baseline.rtt_p50_ns))));
            curves.push(("clan, blocking".into(), curve(|p| Some(p.block.clan.rtt_p50_ns))));
            curves.push(("epoll TCP, blocking (baseline)".into(), curve(|p| Some(p.block.baseline.rtt_p50_ns))));
            curves.push(("raw shared-memory ping-pong (baseline)".into(), curve(|p| p.raw_shm_rtt_p50_ns)));
        }
        _ => {}
    }
    let has_points =
        curves.iter().any(|(_, v)| v.iter().any(|(a, b)| a.is_finite() && b.is_finite() && *a > 0.0 && *b > 0.0));
    if has_points {
        return super::plot::lines(&path, &Lines { title: fig.title, footer: &footer, x, y, curves });
    }
    let bars: Vec<(String, String, f64)> = fig
        .rows
        .iter()
        .filter_map(|(what, _, base, r)| {
            r.trim_end_matches('×').trim().parse::<f64>().ok().map(|v| (what.clone(), baseline_name(base), v))
        })
        .collect();
    if bars.is_empty() {
        return Ok(());
    }
    super::plot::ratios(&path, &Ratios { title: fig.title, footer: &footer, bars })
}

#[cfg(test)]
mod tests {
    use super::{r2, times};

    #[test]
    fn small_ratios_keep_their_digits() {
        assert_eq!(r2(1.234), "1.23");
        assert_eq!(r2(0.5), "0.50");
        assert_eq!(r2(0.0043), "0.0043");
        assert_eq!(r2(0.043), "0.043");
        assert_eq!(r2(0.0), "0.00");
        assert_eq!(times(8.94), "8.9×");
        assert_eq!(times(0.043), "0.043×");
    }
}
