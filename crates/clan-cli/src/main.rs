//! The `clan` command: benchmarks (each with its baseline measured in the same run) and
//! diagnostics.

#![forbid(unsafe_code)]

mod bench;
mod sys;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "clan", version, about = "CLAN user-level network in software: benchmarks and tools")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Print what this machine is and what a NIC opened here looks like.
    Info,
    /// Run an unmodified program with its TCP connections to other clan-run processes of
    /// this host carried over clan (every other socket stays with the kernel).
    ///
    /// The rules: a TCP connection between two processes of this host that both run under
    /// `clan run` (loopback or any local address) is decided before its first byte and
    /// carried over clan; a peer not under clan, another host, UDP, Unix sockets and raw
    /// sockets are the kernel's, untouched. A connection that another process comes to use
    /// (a child after fork touches it, it survives exec, it is passed with SCM_RIGHTS) goes
    /// over to the kernel's TCP connection under it, losing and doubling no byte; while the
    /// children of a fork live, the parent's listeners leave new connections to the kernel.
    /// A client whose connections to a server carry too little to repay their clan set-up
    /// (at most one of the last eight made 8 exchanges or moved 256 KiB: a connection per
    /// request) makes its next ones there over the kernel, but for a probe now and then.
    ///
    /// Environment: CLAN_LOG=debug says on standard error what was decided for each
    /// connection and why; CLAN_SPIN_US sets the spin before sleeping (default 15; 0: never
    /// spin); CLAN_RUN_MIN_TURNS the exchanges a connection must make (default 8; 0: every
    /// connection over clan, however short).
    ///
    /// Example: `clan run -- redis-server --port 6379` and, in another shell,
    /// `clan run -- redis-benchmark -p 6379 -t get`.
    #[command(verbatim_doc_comment)]
    Run(RunArgs),
    /// The libfabric provider (`libclan-fi.so`).
    #[command(subcommand)]
    Fabric(FabricCmd),
    /// Internal: the peer process of a benchmark.
    #[command(name = "__peer", hide = true)]
    Peer {
        #[arg(value_enum)]
        role: bench::Role,
        /// The role's arguments, as JSON.
        args: String,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Ping-pong round-trip time between two processes.
    Latency(bench::latency::LatencyArgs),
    /// One-way bandwidth into another process's aperture.
    Bandwidth(bench::bandwidth::BandwidthArgs),
    /// Cost of snooping writes, with and without tripwires elsewhere.
    Tripwires(bench::tripwires::TripwiresArgs),
    /// The VMMC figures: send_msg latency, bandwidth and overhead, fetch, notifications,
    /// export and import.
    Vmmc(bench::vmmc::VmmcArgs),
    /// Streaming bandwidth of the distributed queue by transfer size; half-peak size.
    Queue(bench::queue::QueueArgs),
    /// RPC round-trip time and calls per second.
    Rpc(bench::rpc::RpcArgs),
    /// Stream sockets against Unix sockets and kernel TCP.
    Stream(bench::stream::StreamArgs),
    /// tokio: N concurrent request/response clients over clan's async streams against
    /// tokio over Unix sockets and loopback TCP, same run, same pinning.
    Tokio(bench::asyncio::TokioArgs),
    /// The event-driven server: RTT and requests/s against N endpoints.
    Server(bench::server::ServerArgs),
    /// Connection set-up: connect + first echoed byte, and connections/s, against kernel TCP
    /// and Unix sockets.
    Connect(bench::connect::ConnectArgs),
    /// Unmodified programs (sockperf, redis) with and without `clan run`, same run, same
    /// pinning, against kernel TCP and a Unix socket.
    Run(bench::run::RunArgs),
    /// The libfabric provider: fi_pingpong against libfabric's shm and tcp providers, and
    /// an MPI ping-pong over Open MPI against its own shared memory (vader), same run.
    Fabric(bench::fabric::FabricArgs),
    /// What protecting a grant narrower than its aperture costs: mediated through the NIC
    /// (what clan does) against a direct mapping, and against splitting apertures into memfds.
    Grants(bench::grants::GrantsArgs),
    /// Every figure of the papers clan can produce, with baselines, into a report folder.
    Paper(bench::paper::PaperArgs),
}

fn main() {
    // The library's tracing events (connections, imports, grants, links, failures) on
    // standard error, filtered by `CLAN_LOG` (`CLAN_LOG=debug`, `CLAN_LOG=clan=debug,warn`);
    // silent without it.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("CLAN_LOG") {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(BenchCmd::Latency(a)) => bench::latency::run(&a),
        Cmd::Bench(BenchCmd::Bandwidth(a)) => bench::bandwidth::run(&a),
        Cmd::Bench(BenchCmd::Tripwires(a)) => bench::tripwires::run(&a),
        Cmd::Bench(BenchCmd::Vmmc(a)) => bench::vmmc::run(&a),
        Cmd::Bench(BenchCmd::Queue(a)) => bench::queue::run(&a),
        Cmd::Bench(BenchCmd::Rpc(a)) => bench::rpc::run(&a),
        Cmd::Bench(BenchCmd::Stream(a)) => bench::stream::run(&a),
        Cmd::Bench(BenchCmd::Tokio(a)) => bench::asyncio::run(&a),
        Cmd::Bench(BenchCmd::Server(a)) => bench::server::run(&a),
        Cmd::Bench(BenchCmd::Connect(a)) => bench::connect::run(&a),
        Cmd::Bench(BenchCmd::Run(a)) => bench::run::run(&a),
        Cmd::Bench(BenchCmd::Grants(a)) => bench::grants::run(&a),
        Cmd::Bench(BenchCmd::Fabric(a)) => bench::fabric::run(&a),
        Cmd::Bench(BenchCmd::Paper(a)) => bench::paper::run(&a),
        Cmd::Info => info(),
        Cmd::Run(a) => run(&a),
        Cmd::Fabric(FabricCmd::Env) => fabric_env(),
        Cmd::Peer { role, args } => bench::peer_main(role, &args),
    };
    if let Err(e) = r {
        eprintln!("clan: {e}");
        std::process::exit(1);
    }
}

#[derive(Subcommand, Debug)]
enum FabricCmd {
    /// Print the `export` lines that make libfabric find the clan provider:
    /// `eval "$(clan fabric env)"`, then `fi_info -p clan`.
    Env,
}

/// `clan fabric env`: a directory holding `libclan-fi.so` (the name libfabric's loader looks
/// for; cargo builds `libclan_fi.so` next to this executable), and the lines that put it on
/// `FI_PROVIDER_PATH`.
fn fabric_env() -> bench::Result<()> {
    let prov = bench::fabric::provider_dir()?;
    let path = match std::env::var("FI_PROVIDER_PATH") {
        Ok(old) if !old.is_empty() && !old.split(':').any(|p| std::path::Path::new(p) == prov) => {
            format!("{}:{old}", prov.display())
        }
        _ => prov.display().to_string(),
    };
    println!("export FI_PROVIDER_PATH='{path}'");
    Ok(())
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Spin this long (µs) on accelerated sockets before sleeping in poll/select/epoll
    /// (sets `CLAN_SPIN_US`; 0: never spin).
    #[arg(long)]
    spin_us: Option<u64>,
    /// Exchanges (writes after reads) a connection must make, or 256 KiB it must move, to
    /// repay its clan set-up; a client whose connections to a server mostly do not keeps its
    /// next ones there on the kernel (sets `CLAN_RUN_MIN_TURNS`; 0: every connection over
    /// clan, however short).
    #[arg(long)]
    min_turns: Option<u32>,
    /// The interposition library (default: `libclan_preload.so` next to this executable,
    /// or `CLAN_PRELOAD`).
    #[arg(long)]
    preload: Option<std::path::PathBuf>,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    cmd: Vec<std::ffi::OsString>,
}

/// Where the interposition library is.
fn preload_path(a: &RunArgs) -> bench::Result<std::path::PathBuf> {
    let p = match (&a.preload, std::env::var_os("CLAN_PRELOAD")) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => p.into(),
        (None, None) => {
            std::env::current_exe()?.parent().ok_or("the clan executable has no directory")?.join("libclan_preload.so")
        }
    };
    if !p.is_file() {
        return Err(format!(
            "the interposition library {} is missing (build it with `cargo build -p clan-preload`, or pass --preload)",
            p.display()
        )
        .into());
    }
    Ok(p.canonicalize()?)
}

fn run(a: &RunArgs) -> bench::Result<()> {
    use std::os::unix::process::CommandExt;
    let lib = preload_path(a)?;
    let mut preload = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let (prog, args) = a.cmd.split_first().ok_or("no program to run")?;
    let mut c = std::process::Command::new(prog);
    c.args(args).env("LD_PRELOAD", preload);
    if let Some(us) = a.spin_us {
        c.env("CLAN_SPIN_US", us.to_string());
    }
    if let Some(n) = a.min_turns {
        c.env("CLAN_RUN_MIN_TURNS", n.to_string());
    }
    // Replace this process: the program's exit status and signals are its own.
    let e = c.exec();
    Err(format!("running {}: {e}", prog.to_string_lossy()).into())
}

/// The programs benchmarks and tests drive, with what needs them.
const PROGRAMS: &[(&str, &str)] = &[
    ("sockperf", "clan bench run"),
    ("redis-server", "clan bench run"),
    ("redis-benchmark", "clan bench run"),
    ("nginx", "tests of clan run"),
    ("wrk", "tests of clan run"),
    ("curl", "tests of clan run"),
    ("fi_info", "clan fabric, tests"),
    ("fi_pingpong", "clan bench fabric"),
    ("mpirun", "clan bench fabric (Open MPI)"),
    ("mpicc", "clan bench fabric (Open MPI)"),
    ("ucx_perftest", "clan bench queue (UCX baseline)"),
];

/// `clan info`: the version, the machine, a NIC opened here (its addresses, limits and
/// defaults), and which optional parts and peer programs are installed.
fn info() -> bench::Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    // Written whole at the end: `clan info | head` is not an error.
    let mut out = String::new();
    macro_rules! wl {
        ($o:expr) => {{
            let _ = writeln!($o);
        }};
        ($o:expr, $($t:tt)*) => {{
            let _ = writeln!($o, $($t)*);
        }};
    }
    let m = sys::machine();
    wl!(out, "clan {}", env!("CARGO_PKG_VERSION"));
    wl!(out, "machine: {} × {}, {:.1} GiB, Linux {}", m.cpus, m.model, m.memory_gib, m.kernel);
    let cfg = clan::NicConfig::default();
    let nic = clan::Nic::open(cfg.clone())?;
    wl!(out);
    wl!(out, "NIC (defaults; CLAN_SPIN_US={:?})", std::env::var("CLAN_SPIN_US").ok());
    wl!(out, "  address:            {}", nic.addr());
    wl!(
        out,
        "  reached by:         processes of this host (abstract Unix socket named after the address){}",
        if cfg.tcp { ", other hosts (TCP link on that address)" } else { "" }
    );
    let q = nic.default_queue().config();
    wl!(
        out,
        "  default event queue: {} tripwires, {} producers ({} per user) × {} events, spin {:?}",
        q.tripwires,
        q.producers,
        q.producers_per_user,
        q.ring_capacity,
        q.spin
    );
    wl!(out);
    wl!(out, "limits");
    wl!(out, "  file descriptors:   {} (raised to the hard limit when the NIC opened)", clan::fd_limit());
    wl!(out, "  aperture size:      up to {} GiB", clan::MAX_APERTURE >> 30);
    wl!(
        out,
        "  pooled apertures:   up to {} KiB share their peer's pool (no fd, no mapping each)",
        clan::MAX_POOLED >> 10
    );
    wl!(out, "  event queue:        up to {} producers", clan::MAX_PRODUCERS);
    let a = cfg.admission;
    wl!(out, "  control connections: {} per process, {} per user, {} in all", a.per_pid, a.per_uid, a.total);
    wl!(out, "  link imports:       {} at once", cfg.max_link_imports);
    wl!(out, "  out-of-band data:   {} B per connect/accept", clan::MAX_PRIVATE_DATA);
    wl!(out);
    wl!(out, "optional parts (next to this executable)");
    let dir = std::env::current_exe()?.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    for (file, what) in [
        ("libclan_preload.so", "clan run (interposition library)"),
        ("libclan_fi.so", "the libfabric provider (clan fabric env)"),
    ] {
        let p = dir.join(file);
        wl!(out, "  {:<19} {}  {what}", file, if p.is_file() { "yes" } else { "missing" });
    }
    wl!(out);
    wl!(out, "peer programs (baselines and tests)");
    for (exe, what) in PROGRAMS {
        match sys::which(exe) {
            Some(p) => wl!(out, "  {exe:<19} {}  ({what})", p.display()),
            None => wl!(out, "  {exe:<19} not installed  ({what})"),
        }
    }
    let mpich = std::path::Path::new("/opt/clan-mpich/bin/mpiexec");
    wl!(
        out,
        "  {:<19} {}  (tests: MPICH from PyPI)",
        "mpich (PyPI)",
        if mpich.is_file() { mpich.display().to_string() } else { "not installed".into() }
    );
    match std::io::stdout().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
