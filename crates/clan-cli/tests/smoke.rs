//! The benchmarks run end to end (tiny sizes) and print the figures they promise: every
//! figure a finite, positive number, every baseline measured, every ratio positive.
//! Speed is not asserted here (a figure may be anything above zero on a loaded CI machine):
//! only that every benchmark works, measures what it says and reports its baseline.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long one benchmark of these tests may take before its watchdog stops it (the test
/// runner's own limit, 300 s, would kill the test without a word of where it stood).
const LIMIT: Duration = Duration::from_secs(240);

/// The processes descended from `pid` (children first found, then theirs), from `/proc`.
fn descendants(pid: u32) -> Vec<u32> {
    let parent = |p: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // pid (comm) state ppid …: the command may hold spaces and parentheses
        stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
    };
    let all: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        let children: Vec<u32> = all.iter().copied().filter(|&c| parent(c) == Some(p) && !found.contains(&c)).collect();
        found.extend(children);
        i += 1;
    }
    found.remove(0);
    found
}

/// Run `clan ARGS` with a watchdog: its output once it exits within `limit`. If it does
/// not, the test fails with what it printed on standard error so far (the benchmarks say
/// each step as they begin it) and the processes it had running (what each waits in), and
/// they are all killed.
fn clan_within(args: &[&str], limit: Duration) -> Output {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("clan-smoke-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the output");
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_clan"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("run clan");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for clan") {
            break s;
        }
        if start.elapsed() > limit {
            let below = descendants(child.id());
            let ps = Command::new("ps")
                .args(["-o", "pid,ppid,stat,etime,time,wchan:24,args", "-p"])
                .arg(
                    std::iter::once(child.id())
                        .chain(below.iter().copied())
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                )
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            for p in std::iter::once(child.id()).chain(below) {
                let _ = Command::new("kill").args(["-KILL", &p.to_string()]).status();
            }
            let _ = child.wait();
            let err = std::fs::read_to_string(&err_path).unwrap_or_default();
            let _ = std::fs::remove_dir_all(&dir);
            panic!("clan {args:?} still running after {limit:?}; its processes:\n{ps}\nits standard error:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = Output {
        status,
        stdout: std::fs::read(&out_path).unwrap_or_default(),
        stderr: std::fs::read(&err_path).unwrap_or_default(),
    };
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn run(args: &[&str]) -> Value {
    let out = clan_within(args, LIMIT);
    assert!(out.status.success(), "clan {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let v: Value =
        serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("clan {args:?} printed no JSON ({e}): {text}"));
    no_negative(&v, "");
    v
}

/// No number anywhere in a report is negative (JSON has no NaN or infinity: serde writes
/// them as null, which `positive` refuses where a figure is expected).
fn no_negative(v: &Value, at: &str) {
    match v {
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x >= 0.0, "{at} = {n}");
        }
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| no_negative(x, &format!("{at}/{i}"))),
        Value::Object(o) => o.iter().for_each(|(k, x)| no_negative(x, &format!("{at}/{k}"))),
        _ => {}
    }
}

/// Each JSON pointer (`/spin/clan/rtt_p50_ns`, or a plain key) names a finite number above
/// zero.
fn positive(v: &Value, pointers: &[&str]) {
    for p in pointers {
        let ptr = if p.starts_with('/') { (*p).to_owned() } else { format!("/{p}") };
        let x = v.pointer(&ptr).unwrap_or_else(|| panic!("missing field {ptr} in {v}"));
        let f = x.as_f64().unwrap_or(f64::NAN);
        assert!(f.is_finite() && f > 0.0, "{ptr} = {x} is not a finite positive number in {v}");
    }
}

/// Each key names a non-empty string.
fn named(v: &Value, keys: &[&str]) {
    for k in keys {
        let s = v.pointer(&format!("/{k}")).and_then(Value::as_str).unwrap_or("");
        assert!(!s.is_empty(), "missing text {k} in {v}");
    }
}

/// The verdict on a target measured both ways.
fn verdict(v: &Value) {
    let t = v["target_met"].as_str().unwrap_or("");
    assert!(["both ways", "spinning only", "blocking only", "neither"].contains(&t), "target_met = {t:?}");
    named(v, &["target"]);
}

#[test]
fn latency_spin_and_block() {
    for (sync, baseline) in [("spin", "shm-raw"), ("block", "unix")] {
        let v = run(&["bench", "latency", "--sync", sync, "--iters", "300", "--rounds", "1", "--json"]);
        positive(
            &v,
            &[
                "size",
                "iters",
                "rtt_p50_ns",
                "rtt_p90_ns",
                "rtt_p99_ns",
                "rtt_p999_ns",
                "rtt_mean_ns",
                "baseline_rtt_p50_ns",
                "baseline_rtt_p99_ns",
                "baseline_rtt_mean_ns",
                "ratio_p50",
            ],
        );
        assert_eq!(v["sync"], sync);
        assert_eq!(v["baseline"], baseline);
        named(&v, &["transport", "placement"]);
        assert!(v["rtt_p50_ns"].as_u64() <= v["rtt_p99_ns"].as_u64(), "p50 ≤ p99: {v}");
    }
}

#[test]
fn bandwidth_pio_and_dma() {
    for mode in ["pio", "dma"] {
        let v = run(&["bench", "bandwidth", "--mode", mode, "--size", "65536", "--iters", "2000", "--json"]);
        positive(&v, &["mbit_s", "baseline_mbit_s", "ratio", "msg_p50_ns"]);
        assert_eq!(v["mode"], mode);
        assert_eq!(v["baseline"], "memcpy");
    }
}

#[test]
fn vmmc_figures() {
    let v = run(&["bench", "vmmc", "--iters", "300", "--bytes", "1048576", "--json"]);
    positive(
        &v,
        &[
            "inline_max",
            "/notification/wait_one_way_p50_ns",
            "/notification/handler_one_way_p50_ns",
            "/notification/sleep_one_way_p50_ns",
            "/notification/baseline_one_way_p50_ns",
            "/notification/ratio",
            "/setup/export_4k_fresh_ns",
            "/setup/export_4k_cached_ns",
            "/setup/baseline_memfd_mmap_4k_ns",
            "/setup/import_cross_process_ns",
            "/setup/baseline_unix_rtt_ns",
        ],
    );
    let bw = v["bandwidth"].as_array().expect("bandwidth points");
    assert!(bw.len() >= 5, "bandwidth points: {bw:?}");
    for p in bw {
        positive(
            p,
            &[
                "size",
                "sync_mbit_s",
                "async_mbit_s",
                "baseline_mbit_s",
                "sync_overhead_p50_ns",
                "async_overhead_p50_ns",
            ],
        );
    }
    for p in v["latency"].as_array().expect("latency points") {
        positive(p, &["size", "one_way_p50_ns", "baseline_one_way_p50_ns", "ratio"]);
    }
    for p in v["fetch"].as_array().expect("fetch points") {
        positive(p, &["size", "latency_p50_ns", "mbit_s", "baseline_memcpy_p50_ns", "baseline_mbit_s"]);
    }
}

#[test]
fn queue_stream_and_slots() {
    let v = run(&["bench", "queue", "--size", "4096", "--rounds", "1", "--json"]);
    let both = [
        "mbit_s",
        "msg_per_s",
        "baseline_mbit_s",
        "ratio",
        "ring_mbit_s",
        "ring_ratio",
        "slot_mbit_s",
        "slot_msg_per_s",
        "slot_ratio",
        "slot_vs_stream",
    ];
    positive(&v, &both);
    positive(&v, &["buffer_bytes", "half_peak_size", "peak_mbit_s", "slot_peak_mbit_s", "slot_half_peak_size"]);
    assert_eq!(v["baseline"], "memcpy");
    let points = v["points"].as_array().expect("points");
    assert_eq!(points.len(), 1);
    positive(&points[0], &both);
    positive(&points[0], &["size", "slot_bytes", "slots", "fenced_ring_mbit_s"]);
    // The slot queue's ring holds the same bytes as the stream's.
    let ring = points[0]["slot_bytes"].as_u64().unwrap() * points[0]["slots"].as_u64().unwrap();
    assert!(ring <= v["buffer_bytes"].as_u64().unwrap(), "slot ring {ring} within the buffer: {v}");
    // (Messages longer than a slot, multi-part: `paper_report` runs 32 KiB transfers.)

    // Small messages also go batched, and against UCX's tagged messages when ucx_perftest
    // is installed (`.ci/run` installs it).
    let v = run(&["bench", "queue", "--size", "64", "--rounds", "1", "--json"]);
    let p = &v["points"][0];
    positive(p, &["batch_msg_per_s", "batch_vs_ring", "rpc_calls_per_s"]);
    let ucx = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join("ucx_perftest").is_file()));
    if ucx {
        positive(p, &["ucx_msg_per_s", "batch_vs_ucx"]);
    } else {
        eprintln!("ucx_perftest is not installed: the UCX baseline was not run");
    }
}

#[test]
fn rpc_spin_and_block() {
    let v = run(&["bench", "rpc", "--iters", "500", "--json"]);
    assert_eq!(v["baseline"], "unix");
    for way in ["spin", "block"] {
        let p = |k: &str| format!("/{way}/{k}");
        positive(
            &v,
            &[
                &p("clan/rtt_p50_ns"),
                &p("clan/rtt_p99_ns"),
                &p("clan/calls_per_s"),
                &p("baseline/rtt_p50_ns"),
                &p("baseline/rtt_p99_ns"),
                &p("baseline/calls_per_s"),
                &p("ratio_rtt_p50"),
                &p("ratio_calls_per_s"),
            ],
        );
        assert!(v[way]["target_met"].is_boolean());
        named(&v[way], &["how"]);
    }
    positive(&v, &["ratio_spin", "ratio_block", "calls_ratio_spin", "calls_ratio_block"]);
    verdict(&v);
}

#[test]
fn stream_spin_and_block() {
    let v = run(&["bench", "stream", "--iters", "300", "--bytes", "8388608", "--json"]);
    for way in ["spin", "block"] {
        let p = |k: &str| format!("/{way}/{k}");
        positive(
            &v,
            &[
                &p("clan_rtt_p50_ns"),
                &p("clan_rtt_p99_ns"),
                &p("unix_rtt_p50_ns"),
                &p("unix_rtt_p99_ns"),
                &p("tcp_rtt_p50_ns"),
                &p("tcp_rtt_p99_ns"),
                &p("ratio_vs_unix"),
                &p("ratio_vs_tcp"),
            ],
        );
        named(&v[way], &["how"]);
    }
    positive(&v, &["ratio_spin", "ratio_block", "mbit_s", "unix_mbit_s", "tcp_mbit_s", "bw_ratio_vs_unix"]);
    verdict(&v);
    // A stream over a TCP link, with the engine receiving and with manual progress.
    for l in ["link", "link_manual"] {
        positive(
            &v[l],
            &[
                "spin_rtt_p50_ns",
                "block_rtt_p50_ns",
                "tcp_spin_rtt_p50_ns",
                "tcp_block_rtt_p50_ns",
                "ratio_spin_vs_tcp",
                "ratio_block_vs_tcp",
                "mbit_s",
                "tcp_mbit_s",
                "bw_ratio_vs_tcp",
            ],
        );
        named(&v[l], &["how", "target", "rtt_target_met"]);
    }
}

#[test]
fn tokio_clients_against_unix_and_tcp() {
    let v = run(&["bench", "tokio", "--clients", "2,9", "--millis", "100", "--size", "100", "--json"]);
    named(&v, &["placement"]);
    positive(&v, &["size", "target_vs_unix"]);
    let points = v["points"].as_array().expect("points");
    assert_eq!(points.iter().map(|p| p["clients"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 9]);
    for p in points {
        for kind in ["clan", "clan_no_spin", "unix", "tcp"] {
            positive(&p[kind], &["requests_per_s", "/rtt/p50_ns", "/rtt/p99_ns", "/rtt/count"]);
        }
        positive(p, &["ratio_vs_unix", "ratio_no_spin_vs_unix", "ratio_vs_tcp"]);
        assert!(p["target_met"].is_boolean(), "{p}");
    }
}

fn server_both_ways(v: &Value) {
    assert_eq!(v["baseline"], "epoll-tcp");
    positive(v, &["rtt_p50_ns", "rtt_p99_ns", "req_per_s", "ratio_spin", "ratio_block", "rtt_ratio_spin"]);
    positive(v, &["rtt_ratio_block"]);
    for way in ["spin", "block"] {
        for side in ["clan", "baseline"] {
            for k in ["rtt_p50_ns", "rtt_p90_ns", "rtt_p99_ns", "req_per_s"] {
                positive(v, &[&format!("/{way}/{side}/{k}")]);
            }
        }
        positive(v, &[&format!("/{way}/ratio_req_per_s"), &format!("/{way}/ratio_rtt_p50")]);
        assert!(v[way]["target_met"].is_boolean());
        named(&v[way], &["how"]);
    }
    verdict(v);
}

#[test]
fn server_benchmark() {
    let v = run(&["bench", "server", "--endpoints", "20", "--requests", "500", "--json"]);
    server_both_ways(&v);
    // One in flight: the raw shared-memory ping-pong of the same run, and the ratio to it.
    positive(&v, &["raw_shm_rtt_p50_ns", "raw_shm_rtt_p99_ns", "raw_shm_ratio"]);
    assert!(v["raw_shm_target_met"].is_boolean());
    // And over as many slots as endpoints (the floor at that scale).
    positive(&v, &["raw_slots_rtt_p50_ns", "raw_slots_rtt_p99_ns", "raw_slots_ratio"]);
    // What the connections hold, from /proc: at least a descriptor each, some memory.
    positive(
        &v,
        &[
            "/footprint_clan/fds",
            "/footprint_clan/maps",
            "/footprint_clan/rss_kib",
            "/footprint_tcp/fds",
            "/per_endpoint_clan/fds",
            "/per_endpoint_tcp/fds",
        ],
    );
    assert!(v["per_endpoint_clan"]["fds"].as_f64().unwrap() >= 1.0, "a clan endpoint holds descriptors: {v}");
    named(&v, &["raw_shm_target"]);
    let v = run(&[
        "bench",
        "server",
        "--endpoints",
        "20",
        "--inflight",
        "4",
        "--mode",
        "busy",
        "--requests",
        "500",
        "--json",
    ]);
    server_both_ways(&v);
    assert!(v["raw_shm_ratio"].is_null(), "no ping-pong to compare with four in flight");
    assert!(v["raw_slots_ratio"].is_null(), "no ping-pong over slots with four in flight");
}

#[test]
fn connect_against_tcp_and_unix() {
    let v = run(&["bench", "connect", "--iters", "100", "--rounds", "1", "--json"]);
    positive(
        &v,
        &[
            "connect_p50_ns",
            "connect_p99_ns",
            "conns_per_s",
            "tcp_connect_p50_ns",
            "tcp_connect_p99_ns",
            "tcp_conns_per_s",
            "unix_connect_p50_ns",
            "unix_connect_p99_ns",
            "unix_conns_per_s",
            "ratio_p50_vs_tcp",
            "ratio_p50_vs_unix",
        ],
    );
    assert_eq!(v["baseline"], "tcp");
}

#[test]
fn tripwires_cost() {
    let v = run(&["bench", "tripwires", "--count", "10000", "--iters", "20000", "--json"]);
    positive(
        &v,
        &[
            "word_ns_no_tripwires",
            "word_ns_with_other_tripwires",
            "word_ns_watched",
            "write_ns_no_tripwires",
            "write_ns_with_other_tripwires",
            "write_ns_watched",
            "baseline_word_ns",
            "baseline_write_ns",
            "growth_word",
            "growth_write",
            "setup_ns_per_tripwire",
        ],
    );
    assert_eq!(v["baseline"], "raw");
}

/// The main job writes its whole report (with tiny sizes here).
#[test]
fn paper_report() {
    let dir = std::env::temp_dir().join(format!("clan-report-test-{}", std::process::id()));
    let out = clan_within(&["bench", "paper", "--smoke", "--out", dir.to_str().expect("a UTF-8 path")], LIMIT);
    assert!(out.status.success(), "clan bench paper failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("| figure | measure | clan |"), "the table is printed: {text}");
    for f in [
        "index.md",
        "index.html",
        "rtt.json",
        "rtt.svg",
        "bandwidth.svg",
        "server.json",
        "server.svg",
        "queue.svg",
        "notification.json",
        "rpc.json",
        "stream.json",
        "run.json",
        "run.svg",
        "fabric.json",
        "fabric.svg",
    ] {
        let p = dir.join(f);
        assert!(p.metadata().is_ok_and(|m| m.len() > 100), "{} written", p.display());
    }
    let svg = std::fs::read_to_string(dir.join("bandwidth.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") || svg.contains("<path"), "a plot");
    // Every ratio of the table is a positive number (or "—" where there is no baseline), and
    // the headline ratios are stated both ways.
    let md = std::fs::read_to_string(dir.join("index.md")).unwrap();
    let mut ratios = 0;
    for line in md.lines().filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.contains("| figure |")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | figure | measure | clan | baseline | ratio | papers |
        let Some(ratio) = cells.get(5) else { continue };
        if ["—", ""].contains(ratio) {
            continue;
        }
        let num: String = ratio.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        let x: f64 = num.parse().unwrap_or_else(|_| panic!("ratio {ratio:?} is not a number: {line}"));
        assert!(x.is_finite() && x > 0.0, "ratio {ratio} in {line}");
        ratios += 1;
    }
    assert!(ratios >= 10, "ratios in the table: {ratios}\n{md}");
    for both in ["both spinning", "both blocking"] {
        for fig in ["busy RTT, 1 endpoint", "requests/s", "RTT, 64 B"] {
            assert!(md.lines().any(|l| l.contains(fig) && l.contains(both)), "a row '{fig}, {both}' in\n{md}");
        }
    }
    assert!(md.contains("against the raw shm ping-pong"), "the server against the raw ping-pong:\n{md}");
    assert!(md.contains("slot-based message queue"), "the queue's slot variant:\n{md}");
    assert!(md.contains("Unmodified applications under clan run"), "the clan run section:\n{md}");
    assert!(md.contains("libfabric programs and MPI over the clan provider"), "the provider's section:\n{md}");
    // Each figure's JSON is the bench's own: the numbers are there.
    let server: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("server.json")).unwrap()).unwrap();
    for v in server["data"]["busy"].as_array().expect("busy points") {
        positive(v, &["/spin/clan/rtt_p50_ns", "/block/clan/rtt_p50_ns", "raw_shm_rtt_p50_ns"]);
    }
    // Requests/s at the largest scale against the wide one, 1 and 16 in flight, each way.
    positive(&server["data"]["inflight16_widest"], &["/spin/clan/req_per_s", "/block/clan/req_per_s"]);
    for flight in ["1 in flight", "16 in flight"] {
        for both in ["both spinning", "both blocking"] {
            let row = format!("requests/s growth, {flight}, {both}: 32 endpoints / 16");
            assert!(md.lines().any(|l| l.contains(&row) && l.contains("≥ 0.9×")), "a row '{row}' in\n{md}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn grants_mediated_and_split() {
    let v = run(&["bench", "grants", "--imports", "20", "--iters", "500", "--splits", "3", "--json"]);
    positive(&v, &["import_ratio", "write_read_ratio", "read_4k_ratio", "bandwidth_ratio"]);
    for kind in ["direct", "mediated"] {
        positive(&v[kind], &["/import/p50_ns", "/write_read_64/p50_ns", "/read_4k/p50_ns", "write_mbit_s"]);
    }
    // The mediated importer holds no memory of the aperture; the split ones hold a
    // descriptor per chunk.
    assert_eq!(v["mediated"]["fds_held"], 0);
    let split = v["split"].as_array().unwrap();
    assert_eq!(split.len(), 3);
    assert_eq!(split[2]["fds_held"], 256);
    for s in split {
        positive(s, &["chunk", "chunks", "/per_aperture/p50_ns"]);
    }
}

/// `clan bench run`: the unmodified programs CI installs (sockperf, redis) with and without
/// `clan run`; every row's figures finite and positive.
#[test]
fn unmodified_programs_with_and_without_clan() {
    let v = run(&["bench", "run", "--secs", "1", "--requests", "2000", "--rounds", "1", "--json"]);
    let rows = v["rows"].as_array().expect("rows");
    let skipped = v["skipped"].as_array().expect("skipped");
    if std::env::var_os("CI").is_some() {
        assert!(skipped.is_empty(), "CI installs sockperf and redis: {skipped:?}");
        assert_eq!(rows.len(), 10, "{v}");
        // (a new connection per request: with clan run's default, and every one over clan)
        for both in ["clan run's default", "every connection over clan"] {
            let n = rows.iter().filter(|r| r["measure"].as_str().is_some_and(|m| m.contains(both))).count();
            assert_eq!(n, 2, "{both}: {v}");
        }
    }
    for (i, _) in rows.iter().enumerate() {
        positive(&v, &[&format!("/rows/{i}/clan"), &format!("/rows/{i}/baseline"), &format!("/rows/{i}/ratio")]);
        named(&v, &[&format!("rows/{i}/measure"), &format!("rows/{i}/baseline_name"), &format!("rows/{i}/goal")]);
    }
}

/// `clan bench fabric`: fi_pingpong over clan, shm and tcp, the message rate through
/// libfabric over clan and shm, and Open MPI over clan and vader; every row's figures finite
/// and positive (CI installs libfabric-bin and Open MPI).
#[test]
fn fabric_programs_against_their_baselines() {
    if std::process::Command::new("sh").args(["-c", "command -v fi_info"]).output().is_ok_and(|o| !o.status.success())
        && std::env::var_os("CI").is_none()
    {
        eprintln!("skipped: libfabric is not installed");
        return;
    }
    let v = run(&["bench", "fabric", "--iters", "200", "--rounds", "1", "--json"]);
    let rows = v["rows"].as_array().expect("rows");
    let skipped = v["skipped"].as_array().expect("skipped");
    if std::env::var_os("CI").is_some() {
        assert!(skipped.is_empty(), "CI installs libfabric-bin and Open MPI: {skipped:?}");
        // (CI runs as root: the row between two test hosts is there)
        assert_eq!(rows.len(), 13, "{v}");
        assert!(
            rows.iter().any(|r| r["measure"].as_str().is_some_and(|m| m.contains("between two hosts"))),
            "the row between two hosts: {v}"
        );
    }
    for (i, _) in rows.iter().enumerate() {
        positive(&v, &[&format!("/rows/{i}/clan"), &format!("/rows/{i}/baseline"), &format!("/rows/{i}/ratio")]);
        named(&v, &[&format!("rows/{i}/measure"), &format!("rows/{i}/baseline_name"), &format!("rows/{i}/goal")]);
    }
}
