//! `clan bench fabric`: the libfabric provider against libfabric's own `shm` and `tcp`
//! providers (libfabric's `fi_pingpong`, reliable datagrams, 64 B and 1 MiB), and Open MPI
//! over it (`pml cm`, `mtl ofi`, provider clan) against Open MPI's own shared memory
//! (`pml ob1`, `btl vader,self`), with an MPI ping-pong of ours built with `mpicc` at run time.
//! Same run, same placement: the two sides on CPUs 1 and 0, and, oversubscribed, both on
//! CPU 0, where a rank that waits a second for its peer also has its CPU time measured. As
//! root, `fi_pingpong` also runs between two test hosts (network namespaces joined by a veth
//! pair), the clan provider over its links against libfabric's tcp provider. Message rates:
//! 8 B tagged injects streamed from one process to another through libfabric (`fi_rate.c`,
//! built with `cc` at run time), against the shm provider, and Open MPI's in windows of 64
//! (osu_mbw_mr's pattern, `mpi_pingpong.c rate`), against vader.
//! Programs that are not installed are skipped and said so.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Serialize;

use super::Result;

#[derive(clap::Args, Debug)]
pub struct FabricArgs {
    /// Ping-pong iterations of the 64 B and 8 B runs (1 MiB runs do a twentieth).
    #[arg(long, default_value_t = 50_000)]
    pub iters: u64,
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
pub struct FabricReport {
    pub bench: &'static str,
    pub rows: Vec<Row>,
    pub skipped: Vec<String>,
    pub placement: &'static str,
}

const PLACEMENT: &str = "fi_pingpong: server on CPU 1, client on CPU 0 (taskset); fi_rate: sender on CPU 0, receiver on \
                         CPU 1 (sched_setaffinity); MPI: 2 ranks bound to CPUs 0 \
                         and 1 (--bind-to hwthread --map-by hwthread, checked by the ranks' affinity), oversubscribed: \
                         both on CPU 0; the providers alternate in rounds; figures are medians over the rounds";

fn have(prog: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {prog}")]).output().is_ok_and(|o| o.status.success())
}

/// The directory that makes libfabric's loader find the provider: `libclan-fi.so` (the
/// name it looks for) linked to `libclan_fi.so`, which cargo builds next to this executable.
pub fn provider_dir() -> Result<PathBuf> {
    let dir = std::env::current_exe()?.parent().ok_or("the clan executable has no directory")?.to_path_buf();
    let lib = dir.join("libclan_fi.so");
    if !lib.is_file() {
        return Err(format!(
            "the provider {} is missing (build it with `cargo build -p clan-fi`; it needs libfabric-dev and libclang-dev)",
            lib.display()
        )
        .into());
    }
    let prov = dir.join("fabric-provider");
    std::fs::create_dir_all(&prov)?;
    let link = prov.join(clan_fi::FILE_NAME);
    if std::fs::read_link(&link).ok().as_deref() != Some(lib.as_path()) {
        // Made under a name of this process's and renamed over the link: two runs making it
        // at once (a test and a benchmark) both succeed, and a loader never finds it missing.
        let new = prov.join(format!(".{}.{}", clan_fi::FILE_NAME, std::process::id()));
        let _ = std::fs::remove_file(&new);
        std::os::unix::fs::symlink(&lib, &new)?;
        std::fs::rename(&new, &link)?;
    }
    Ok(prov)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// How long (seconds) one program's run of `iters` ping-pong iterations (or their share of
/// a message-rate run) may take before it is stopped and the bench fails saying so: a
/// minute, and more for long runs (a run takes a few seconds at most).
fn limit(iters: u64) -> u32 {
    (60 + iters / 500).min(300) as u32
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The cluster key the two test hosts' NICs share (`CLAN_FI_KEY`).
const HOSTS_KEY: &str = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2";

/// One fi_pingpong run with `prov`: (µs per transfer, MB/s) as it prints them. With `hosts`,
/// between its two test hosts (the server on the first, each NIC on its host's address),
/// else both on this host.
fn fi_pingpong(
    prov: &str,
    dir: &std::path::Path,
    size: u64,
    iters: u64,
    hosts: Option<&clan_testkit::netns::TestNet>,
) -> Result<(f64, f64)> {
    let port = free_port()?.to_string();
    let server_ip = hosts.map_or_else(|| "127.0.0.1".to_string(), |n| n.host(0).ip.to_string());
    let args = |cpu: &str, host: usize| {
        let mut c = match hosts {
            Some(n) => {
                let mut c = n.command(host, "taskset");
                c.env("CLAN_FI_IP", n.host(host).ip.to_string()).env("CLAN_FI_KEY", HOSTS_KEY);
                c
            }
            None => Command::new("taskset"),
        };
        c.args(["-c", cpu, "timeout", "-k", "10", &limit(iters).to_string(), "fi_pingpong", "-p", prov, "-e", "rdm"])
            .args(["-I", &iters.to_string(), "-S", &size.to_string()])
            .env("FI_PROVIDER_PATH", dir)
            .env_remove("FI_PROVIDER");
        c
    };
    let server = args("1", 0).args(["-B", &port]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    // The client again while the server is not listening yet (bounded).
    let mut out = args("0", 1).args(["-P", &port, &server_ip]).output()?;
    for _ in 0..100 {
        if out.status.success() || !String::from_utf8_lossy(&out.stderr).contains("Connection refused") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        out = args("0", 1).args(["-P", &port, &server_ip]).output()?;
    }
    let s = server.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
    let row = text
        .lines()
        // (the size column reads "64", "1m")
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()) && l.split_whitespace().count() >= 8)
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some((w.get(6)?.parse::<f64>().ok()?, w.get(5)?.parse::<f64>().ok()?))
        })
        .next_back();
    match row {
        Some(r) if out.status.success() => Ok(r),
        _ => Err(format!(
            "fi_pingpong -p {prov} -S {size} failed: {text}{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&s.stderr)
        )
        .into()),
    }
}

/// The bench's C programs are built into this directory (removed at the end of the run).
fn build_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("clan-bench-fabric-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Build the C program `name` (its source `text`) with the compiler `cc` and `libs`.
fn build_c(cc: &str, name: &str, text: &str, libs: &[&str]) -> Result<PathBuf> {
    let dir = build_dir()?;
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, text)?;
    let exe = dir.join(name);
    let out = Command::new(cc).args(["-O2", "-o"]).arg(&exe).arg(&src).args(libs).output()?;
    if !out.status.success() {
        return Err(format!("{cc} {name}.c: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(exe)
}

/// The MPI ping-pong, built once.
fn mpi_program() -> Result<PathBuf> {
    build_c("mpicc", "mpi_pingpong", include_str!("fabric/mpi_pingpong.c"), &[])
}

/// Messages a message-rate run streams for `iters` ping-pong iterations (2 000 000 for the
/// default 50 000: a second or so).
fn rate_count(iters: u64) -> u64 {
    (iters * 40).max(20_000)
}

/// One run of `fi_rate.c` over provider `prov` streaming `count` messages: messages/s.
fn fi_rate(exe: &std::path::Path, prov: &str, dir: &std::path::Path, count: u64) -> Result<f64> {
    let out = Command::new("timeout")
        .args(["-k", "10"])
        .arg(limit(count / 40).to_string())
        .arg(exe)
        .args([prov, &count.to_string()])
        .env("FI_PROVIDER_PATH", dir)
        .env_remove("FI_PROVIDER")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = text
        .lines()
        .find_map(|l| l.strip_prefix("rate msgs_per_s "))
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok());
    match rate {
        Some(r) if out.status.success() => Ok(r),
        _ => Err(format!("fi_rate {prov} failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into()),
    }
}

/// Runs of each message-rate measure per round, clan and its baseline alternating (one
/// run's figure moves by up to a half with the host's phases).
const RATE_RUNS: usize = 3;

/// Runs of the MPI 8 B ping-pong per round, clan and vader alternating.
const MPI_LAT_RUNS: usize = 5;

/// `mpirun` of the two ranks of `exe` (bounded by `limit` seconds), over the provider
/// (`clan`) or vader; `oversub`: both on CPU 0 (yielding when idle), else one CPU each.
fn mpirun(exe: &std::path::Path, dir: &std::path::Path, clan: bool, oversub: bool, limit: u32) -> Command {
    let mut c = Command::new("timeout");
    // (SIGTERM at the limit, SIGKILL 10 s later)
    c.args(["-k", "10"]).arg(limit.to_string()).args([
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "--mca",
        "plm",
        "isolated",
    ]);
    if oversub {
        c.args(["--cpu-set", "0", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]);
    } else {
        // (not with `--cpu-set 0,1`: Open MPI 4.1 then binds each rank to the whole set, both
        // CPUs, and says so only with --report-bindings; hardware threads, not cores: one CPU
        // each also where the CPUs are a core's threads; the ranks' affinity is checked below)
        c.args(["--bind-to", "hwthread", "--map-by", "hwthread"]);
    }
    if clan {
        c.args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "clan"])
            .args(["-x", "FI_PROVIDER_PATH"]);
    } else {
        c.args(["--mca", "pml", "ob1", "--mca", "btl", "vader,self"]);
    }
    c.arg(exe).env("FI_PROVIDER_PATH", dir).env_remove("FI_PROVIDER");
    c
}

/// Run the MPI program with `args` (see [`mpirun`]); the fields of its line that starts with
/// `line` (its first word), once the run succeeded and its ranks ran where they were asked to.
fn mpi_fields(
    exe: &std::path::Path,
    dir: &std::path::Path,
    clan: bool,
    oversub: bool,
    args: &[String],
    line: &str,
    iters: u64,
) -> Result<std::collections::HashMap<String, f64>> {
    let out = mpirun(exe, dir, clan, oversub, limit(iters)).args(args).output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let fields: std::collections::HashMap<String, f64> = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(line))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // (each word followed by a number names it)
            w.windows(2).filter_map(|kv| Some((kv[0].to_string(), kv[1].parse().ok()?))).collect()
        })
        .unwrap_or_default();
    // Where the ranks ran: one CPU each (0 and 1), or both on CPU 0 oversubscribed.
    let cpus: Vec<u64> = text
        .lines()
        .find_map(|l| l.strip_prefix("cpus "))
        .map(|l| l.split_whitespace().filter_map(|w| u64::from_str_radix(w, 16).ok()).collect())
        .unwrap_or_default();
    let one = |m: &u64| m.count_ones() == 1;
    let placed = cpus.len() == 2 && cpus.iter().all(one) && (cpus[0] == cpus[1]) == oversub;
    let who = if clan { "clan" } else { "vader" };
    if !out.status.success() || fields.is_empty() {
        return Err(format!("mpirun ({who}) failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    if !placed {
        return Err(format!(
            "mpirun ({who}) did not place the ranks as asked (CPU masks {cpus:x?}, wanted {}): {text}",
            if oversub { "both on one CPU" } else { "one CPU each, not the same" }
        )
        .into());
    }
    Ok(fields)
}

/// One MPI ping-pong: (one-way µs p50, Mbit/s). `clan`: over the provider, else vader.
fn mpi(
    exe: &std::path::Path,
    dir: &std::path::Path,
    clan: bool,
    oversub: bool,
    size: u64,
    iters: u64,
) -> Result<(f64, f64)> {
    let f = mpi_fields(exe, dir, clan, oversub, &[size.to_string(), iters.to_string()], "size", iters)?;
    match (f.get("one_way_us_p50"), f.get("mbit_s")) {
        (Some(&l), Some(&b)) => Ok((l, b)),
        _ => Err(format!("the MPI ping-pong printed no figures: {f:?}").into()),
    }
}

/// The MPI message rate of 8 B messages in windows of 64 (`mpi_pingpong.c`'s `rate`):
/// messages/s.
fn mpi_rate(exe: &std::path::Path, dir: &std::path::Path, clan: bool, count: u64) -> Result<f64> {
    let f = mpi_fields(exe, dir, clan, false, &["rate".into(), "8".into(), count.to_string()], "rate", count / 20)?;
    f.get("msgs_per_s").copied().ok_or_else(|| format!("the MPI message rate printed no figure: {f:?}").into())
}

/// A rank waiting 1 s in `MPI_Recv` (its peer sleeps before it sends), both ranks on CPU 0:
/// the CPU its process used over the wait, as a percentage of the wait.
fn mpi_idle(exe: &std::path::Path, dir: &std::path::Path, clan: bool) -> Result<f64> {
    let out = mpirun(exe, dir, clan, true, limit(0)).args(["idle", "1"]).output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |k: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with("waited_ms "))?;
        let mut w = line.split_whitespace();
        w.position(|x| x == k)?;
        w.next()?.parse().ok()
    };
    match (field("waited_ms"), field("cpu_ms"), field("value")) {
        (Some(w), Some(c), Some(v)) if out.status.success() && v == 42.0 && w > 0.0 => Ok(100.0 * c / w),
        _ => Err(format!(
            "mpirun idle ({}) failed: {text}{}",
            if clan { "clan" } else { "vader" },
            String::from_utf8_lossy(&out.stderr)
        )
        .into()),
    }
}

pub fn run(a: &FabricArgs) -> Result<()> {
    if !have("taskset") {
        return Err("taskset (util-linux) is needed to pin the programs".into());
    }
    let dir = provider_dir()?;
    let rounds = a.rounds.max(1);
    let iters = a.iters.max(100);
    let big_iters = (iters / 20).max(100);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    // Steps: fi_pingpong over three providers and between two hosts, MPI over two (and its
    // 8 B runs), each round.
    let bar = super::report::progress(rounds as u64 * (6 + 2 * MPI_LAT_RUNS as u64 + 4 * RATE_RUNS as u64), a.json);
    let progress = |what: &str| {
        if !a.json {
            bar.suspend(|| eprintln!("clan bench fabric: {what}"));
        }
        bar.set_message(what.to_owned());
        bar.inc(1);
    };

    if have("fi_pingpong") {
        let provs = ["clan", "shm", "tcp"];
        let mut lat = vec![Vec::new(); provs.len()];
        let mut bw = vec![Vec::new(); provs.len()];
        let mut first = vec![Vec::new(); provs.len()];
        for r in 0..rounds {
            for (k, p) in provs.iter().enumerate() {
                progress(&format!("fi_pingpong -p {p}, round {}/{rounds}", r + 1));
                lat[k].push(fi_pingpong(p, &dir, 64, iters, None)?.0);
                bw[k].push(fi_pingpong(p, &dir, 1 << 20, big_iters, None)?.1);
                // One iteration: its round trip includes making the connections (two
                // transfers: twice the time per transfer).
                first[k].push(2.0 * fi_pingpong(p, &dir, 64, 1, None)?.0);
            }
        }
        let lat: Vec<f64> = lat.into_iter().map(median).collect();
        let bw: Vec<f64> = bw.into_iter().map(median).collect();
        let first: Vec<f64> = first.into_iter().map(median).collect();
        for (k, name) in [(1, "libfabric shm provider"), (2, "libfabric tcp provider")] {
            rows.push(Row {
                program: "fi_pingpong",
                measure: "RDM 64 B, µs per transfer".into(),
                clan: lat[0],
                baseline: lat[k],
                baseline_name: name,
                ratio: lat[0] / lat[k],
                goal: if k == 1 { "≤ the shm provider's" } else { "—" },
                met: lat[0] <= lat[k],
            });
        }
        for (k, name) in [(1, "libfabric shm provider"), (2, "libfabric tcp provider")] {
            rows.push(Row {
                program: "fi_pingpong",
                measure: "RDM 64 B, first round trip (connections made on the way), µs".into(),
                clan: first[0],
                baseline: first[k],
                baseline_name: name,
                ratio: first[0] / first[k],
                goal: "—",
                met: true,
            });
        }
        for (k, name) in [(1, "libfabric shm provider"), (2, "libfabric tcp provider")] {
            rows.push(Row {
                program: "fi_pingpong",
                measure: "RDM 1 MiB, MB/s".into(),
                clan: bw[0],
                baseline: bw[k],
                baseline_name: name,
                ratio: bw[0] / bw[k],
                goal: "—",
                met: true,
            });
        }
        // Between two hosts (network namespaces joined by a veth pair; root only): the clan
        // provider over its TCP links against libfabric's tcp provider.
        match clan_testkit::netns::TestNet::new(2) {
            Ok(net) => {
                let (mut c, mut t) = (Vec::new(), Vec::new());
                for r in 0..rounds {
                    progress(&format!("fi_pingpong between two hosts, round {}/{rounds}", r + 1));
                    c.push(fi_pingpong("clan", &dir, 64, iters, Some(&net))?.0);
                    t.push(fi_pingpong("tcp", &dir, 64, iters, Some(&net))?.0);
                }
                let (c, t) = (median(c), median(t));
                rows.push(Row {
                    program: "fi_pingpong",
                    measure: "RDM 64 B between two hosts (network namespaces, veth), µs per transfer".into(),
                    clan: c,
                    baseline: t,
                    baseline_name: "libfabric tcp provider",
                    ratio: c / t,
                    goal: "—",
                    met: true,
                });
            }
            Err(why) => skipped.push(format!("fi_pingpong between two hosts ({why})")),
        }
    } else {
        skipped.push("fi_pingpong (libfabric-bin not installed)".into());
    }

    // The message rate through libfabric, against the shm provider.
    match have("cc").then(|| build_c("cc", "fi_rate", include_str!("fabric/fi_rate.c"), &["-lfabric"])) {
        Some(Ok(exe)) => {
            let provs = ["clan", "shm"];
            let mut got = vec![Vec::new(); provs.len()];
            for r in 0..rounds {
                for k in 0..RATE_RUNS {
                    for (i, p) in provs.iter().enumerate() {
                        progress(&format!("fi_rate -p {p}, round {}/{rounds}, run {}", r + 1, k + 1));
                        got[i].push(fi_rate(&exe, p, &dir, rate_count(iters))?);
                    }
                }
            }
            let [c, m] = [median(got[0].clone()), median(got[1].clone())];
            rows.push(Row {
                program: "fi_rate.c (ours)",
                measure: format!(
                    "RDM 8 B tagged injects from one process to another, messages/s (median of {} alternating runs)",
                    RATE_RUNS * rounds
                ),
                clan: c,
                baseline: m,
                baseline_name: "libfabric shm provider",
                ratio: c / m,
                goal: "—",
                met: true,
            });
        }
        Some(Err(why)) => skipped.push(format!("the message rate through libfabric ({why})")),
        None => skipped.push("the message rate through libfabric (no C compiler)".into()),
    }

    if have("mpicc") && have("mpirun") {
        let exe = mpi_program()?;
        let (mut l8, mut b1m, mut over, mut idle) =
            ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()], [Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        for r in 0..rounds {
            // The 8 B runs (a second each) alternate several times a round: from one run of
            // `mpirun` to the next, either figure moves by up to a half (the host's phases,
            // where the pages landed), and the median over many pairs is the typical one.
            for k in 0..MPI_LAT_RUNS {
                for (i, clan) in [true, false].into_iter().enumerate() {
                    let who = if clan { "clan" } else { "vader" };
                    progress(&format!("MPI ping-pong 8 B over {who}, round {}/{rounds}, run {}", r + 1, k + 1));
                    l8[i].push(mpi(&exe, &dir, clan, false, 8, iters)?.0);
                }
            }
            for (k, clan) in [true, false].into_iter().enumerate() {
                let who = if clan { "clan" } else { "vader" };
                progress(&format!("MPI ping-pong over {who}, round {}/{rounds}", r + 1));
                b1m[k].push(mpi(&exe, &dir, clan, false, 1 << 20, big_iters)?.1);
                over[k].push(mpi(&exe, &dir, clan, true, 8, (iters / 10).max(100))?.0);
                idle[k].push(mpi_idle(&exe, &dir, clan)?);
            }
        }
        let mut rate = [Vec::new(), Vec::new()];
        for r in 0..rounds {
            for k in 0..RATE_RUNS {
                for (i, clan) in [true, false].into_iter().enumerate() {
                    let who = if clan { "clan" } else { "vader" };
                    progress(&format!("MPI message rate 8 B over {who}, round {}/{rounds}, run {}", r + 1, k + 1));
                    rate[i].push(mpi_rate(&exe, &dir, clan, rate_count(iters) / 2)?);
                }
            }
        }
        let [rc, rv] = rate.map(median);
        let [lc, lv] = l8.map(median);
        let [bc, bv] = b1m.map(median);
        let [oc, ov] = over.map(median);
        let [ic, iv] = idle.map(median);
        let vader = "Open MPI shared memory (vader)";
        rows.push(Row {
            program: "Open MPI",
            measure: format!("ping-pong 8 B, one-way µs (p50; median of {} alternating runs)", MPI_LAT_RUNS * rounds),
            clan: lc,
            baseline: lv,
            baseline_name: vader,
            ratio: lc / lv,
            goal: "≤ 1.5× vader",
            met: lc <= 1.5 * lv,
        });
        rows.push(Row {
            program: "Open MPI",
            measure: "ping-pong 1 MiB, Mbit/s".into(),
            clan: bc,
            baseline: bv,
            baseline_name: vader,
            ratio: bc / bv,
            goal: "≥ 0.8× vader",
            met: bc >= 0.8 * bv,
        });
        rows.push(Row {
            program: "Open MPI",
            measure: format!(
                "message rate 8 B, windows of 64 (osu_mbw_mr's pattern, one pair), messages/s (median of {} alternating runs)",
                RATE_RUNS * rounds
            ),
            clan: rc,
            baseline: rv,
            baseline_name: vader,
            ratio: rc / rv,
            goal: "—",
            met: true,
        });
        rows.push(Row {
            program: "Open MPI",
            measure: "ping-pong 8 B, both ranks on one CPU, one-way µs (p50)".into(),
            clan: oc,
            baseline: ov,
            baseline_name: vader,
            ratio: oc / ov,
            goal: "≤ 10 µs",
            met: oc <= 10.0,
        });
        rows.push(Row {
            program: "Open MPI",
            measure: "a rank waiting 1 s in MPI_Recv, both ranks on one CPU: its CPU, % of the wait".into(),
            clan: ic,
            baseline: iv,
            baseline_name: vader,
            ratio: ic / iv,
            goal: "< 10 %",
            met: ic < 10.0,
        });
    } else {
        skipped.push("Open MPI (mpicc or mpirun not installed)".into());
    }

    bar.finish_and_clear();
    let _ = std::fs::remove_dir_all(build_dir()?);
    let report = FabricReport { bench: "fabric", rows, skipped, placement: PLACEMENT };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!("libfabric programs over the clan provider and over their baselines, same run.");
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
