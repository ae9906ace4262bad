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
    /// Internal: the peer process of a benchmark.
    #[command(name = "__peer", hide = true)]
    Peer {
        role: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
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
    Queue(bench::proto::QueueArgs),
    /// RPC round-trip time and calls per second.
    Rpc(bench::proto::RpcArgs),
    /// Stream sockets against Unix sockets and kernel TCP.
    Stream(bench::proto::StreamArgs),
    /// The event-driven server: RTT and requests/s against N endpoints.
    Server(bench::server::ServerArgs),
    /// Connection set-up: connect + first echoed byte, and connections/s, against kernel TCP
    /// and Unix sockets.
    Connect(bench::connect::ConnectArgs),
    /// What protecting a grant narrower than its aperture costs: mediated through the NIC
    /// (what clan does) against a direct mapping, and against splitting apertures into memfds.
    Grants(bench::grants::GrantsArgs),
    /// Every figure of the papers clan can produce, with baselines, into a report folder.
    Paper(bench::paper::PaperArgs),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(BenchCmd::Latency(a)) => bench::latency::run(&a),
        Cmd::Bench(BenchCmd::Bandwidth(a)) => bench::bandwidth::run(&a),
        Cmd::Bench(BenchCmd::Tripwires(a)) => bench::tripwires::run(&a),
        Cmd::Bench(BenchCmd::Vmmc(a)) => bench::vmmc::run(&a),
        Cmd::Bench(BenchCmd::Queue(a)) => bench::proto::queue(&a),
        Cmd::Bench(BenchCmd::Rpc(a)) => bench::proto::rpc(&a),
        Cmd::Bench(BenchCmd::Stream(a)) => bench::proto::stream(&a),
        Cmd::Bench(BenchCmd::Server(a)) => bench::server::run(&a),
        Cmd::Bench(BenchCmd::Connect(a)) => bench::connect::run(&a),
        Cmd::Bench(BenchCmd::Grants(a)) => bench::grants::run(&a),
        Cmd::Bench(BenchCmd::Paper(a)) => bench::paper::run(&a),
        Cmd::Info => info(),
        Cmd::Peer { role, args } => bench::peer_main(&role, &args),
    };
    if let Err(e) = r {
        eprintln!("clan: {e}");
        std::process::exit(1);
    }
}

fn info() -> bench::Result<()> {
    let m = sys::machine();
    println!("machine: {} × {}, Linux {}", m.cpus, m.model, m.kernel);
    let nic = clan::Nic::open(clan::NicConfig::default())?;
    println!("NIC address: {}", nic.addr());
    println!("file descriptor limit: {}", clan::fd_limit());
    let q = nic.default_queue().config();
    println!(
        "default event queue: {} tripwires, {} producer rings × {} events, spin {:?}",
        q.tripwires, q.producers, q.ring_capacity, q.spin
    );
    Ok(())
}
