//! The benchmarks run end to end (tiny sizes) and print the JSON fields they promise.
//! Speed is not asserted here: only that every benchmark works and reports its baseline.

use std::process::Command;

fn run(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_clan")).args(args).output().expect("run clan");
    assert!(out.status.success(), "clan {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("clan {args:?} printed no JSON ({e}): {text}"))
}

fn has(v: &serde_json::Value, keys: &[&str]) {
    for k in keys {
        assert!(v.get(k).is_some(), "missing field {k} in {v}");
    }
}

#[test]
fn latency_spin_and_block() {
    for sync in ["spin", "block"] {
        let v = run(&["bench", "latency", "--sync", sync, "--iters", "300", "--rounds", "1", "--json"]);
        has(
            &v,
            &[
                "bench",
                "transport",
                "sync",
                "size",
                "iters",
                "rtt_p50_ns",
                "rtt_p99_ns",
                "baseline",
                "baseline_rtt_p50_ns",
            ],
        );
    }
}

#[test]
fn bandwidth_pio_and_dma() {
    for mode in ["pio", "dma"] {
        let v = run(&["bench", "bandwidth", "--mode", mode, "--size", "65536", "--iters", "2000", "--json"]);
        has(&v, &["mbit_s", "baseline", "baseline_mbit_s"]);
        assert_eq!(v["mode"], mode);
        assert_eq!(v["baseline"], "memcpy");
    }
}

#[test]
fn vmmc_figures() {
    let v = run(&["bench", "vmmc", "--iters", "300", "--bytes", "1048576", "--json"]);
    has(&v, &["latency", "bandwidth", "fetch", "notification", "setup", "inline_max"]);
    assert!(v["bandwidth"].as_array().is_some_and(|a| a.len() >= 5));
    has(&v["notification"], &["wait_one_way_p50_ns", "baseline_one_way_p50_ns"]);
}

#[test]
fn protocol_benchmarks() {
    let v = run(&["bench", "queue", "--size", "4096", "--json"]);
    has(
        &v,
        &[
            "mbit_s",
            "baseline",
            "baseline_mbit_s",
            "ring_mbit_s",
            "ring_ratio",
            "buffer_bytes",
            "half_peak_size",
            "points",
        ],
    );
    let v = run(&["bench", "rpc", "--iters", "500", "--json"]);
    has(&v, &["rtt_p50_ns", "calls_per_s", "baseline", "baseline_rtt_p50_ns"]);
    let v = run(&["bench", "stream", "--iters", "300", "--bytes", "8388608", "--json"]);
    has(&v, &["rtt_p50_ns", "unix_rtt_p50_ns", "tcp_rtt_p50_ns", "mbit_s", "unix_mbit_s", "tcp_mbit_s"]);
}

#[test]
fn server_benchmark() {
    let v = run(&["bench", "server", "--endpoints", "20", "--requests", "500", "--json"]);
    has(&v, &["req_per_s", "baseline_req_per_s", "rtt_p50_ns", "baseline_rtt_p50_ns", "baseline"]);
    assert_eq!(v["baseline"], "epoll-tcp");
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
    has(&v, &["req_per_s", "baseline_req_per_s"]);
}

/// The main job writes its whole report (with tiny sizes here).
#[test]
fn paper_report() {
    let dir = std::env::temp_dir().join(format!("clan-report-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_clan"))
        .args(["bench", "paper", "--smoke", "--out"])
        .arg(&dir)
        .output()
        .expect("run clan");
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
    ] {
        let p = dir.join(f);
        assert!(p.metadata().is_ok_and(|m| m.len() > 100), "{} written", p.display());
    }
    let svg = std::fs::read_to_string(dir.join("bandwidth.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") || svg.contains("<path"), "a plot");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn grants_mediated_and_split() {
    let v = run(&["bench", "grants", "--imports", "20", "--iters", "500", "--splits", "3", "--json"]);
    has(&v, &["direct", "mediated", "split", "import_ratio", "write_read_ratio", "bandwidth_ratio"]);
    for kind in ["direct", "mediated"] {
        let g = &v[kind];
        for k in ["import", "write_read_64", "read_4k"] {
            let p50 = g[k]["p50_ns"].as_u64().unwrap_or(0);
            assert!(p50 > 0, "{kind}.{k}.p50_ns = {p50}");
        }
        let bw = g["write_mbit_s"].as_f64().unwrap_or(f64::NAN);
        assert!(bw.is_finite() && bw > 0.0, "{kind} bandwidth {bw}");
    }
    // The mediated importer holds no memory of the aperture; the split ones hold a
    // descriptor per chunk.
    assert_eq!(v["mediated"]["fds_held"], 0);
    let split = v["split"].as_array().unwrap();
    assert_eq!(split.len(), 3);
    assert_eq!(split[2]["fds_held"], 256);
}
