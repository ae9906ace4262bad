//! `clan bench …`: every benchmark runs the real thing across real processes and measures
//! its baseline in the same run, with the same message sizes and the same placement.

pub mod asyncio;
pub mod bandwidth;
pub mod connect;
pub mod fabric;
pub mod grants;
pub mod latency;
pub mod paper;
pub mod plot;
pub mod proto;
pub mod queue;
pub mod report;
pub mod rpc;
pub mod run;
pub mod server;
pub mod stream;
pub mod tcp;
pub mod tripwires;
pub mod vmmc;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The part a benchmark peer plays: `clan __peer <role> <arguments>`, where the arguments
/// are the role's own typed struct (in its benchmark's module) as JSON. A role that does
/// not exist is refused by the command line, arguments that do not fit by serde.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// `bench latency`: the clan ping-pong's other side.
    LatClan,
    /// `bench latency`: the raw shared-memory ping-pong's other side.
    LatRaw,
    /// The raw ping-pong's peer over many slots chosen at random.
    LatRawSlots,
    /// `bench latency`: the Unix-socket ping-pong's other side.
    LatUnix,
    /// `bench bandwidth`: the receiving process.
    BwClan,
    /// `bench latency --transport tcp`: clan over a link, both sides.
    LatLinkPing,
    LatLinkPong,
    /// `bench latency --transport tcp`: raw TCP, both sides.
    LatTcpPing,
    LatTcpPong,
    /// `bench bandwidth --transport tcp`: clan over a link, both sides.
    BwLinkRecv,
    BwLinkSend,
    /// `bench bandwidth --transport tcp`: raw TCP, both sides.
    BwTcpRecv,
    BwTcpSend,
    /// `bench vmmc`: the other process.
    VmmcPeer,
    /// `bench server`: the clan server and the epoll TCP server.
    SrvClan,
    SrvTcp,
    /// `bench queue`: both sides of a streaming round, and of the hand-written ring.
    PqRecv,
    PqSend,
    PqRingRecv,
    PqRingSend,
    /// `bench rpc`: the clan server and the Unix-socket server.
    PrpcServer,
    PrpcUnix,
    /// `bench stream`: the echoing and the sinking side.
    PstEcho,
    PstSink,
    /// `bench connect`: the server.
    ConnServer,
    /// `bench grants`: the importing process.
    GrantsPeer,
    /// `bench tokio`: the echo server.
    TokEcho,
}

impl Role {
    /// Its name on the command line.
    fn name(self) -> String {
        use clap::ValueEnum as _;
        self.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default()
    }
}

/// A peer's arguments from their JSON.
pub fn args_of<T: serde::de::DeserializeOwned>(json: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|e| format!("peer arguments {json}: {e}").into())
}

/// How long a benchmark waits for a line from its peer, or for the peer to exit once told
/// to finish, before it stops the peer and fails saying so: far above any step of the
/// benchmarks (the longest, setting up 10 000 endpoints or moving a few GiB, take seconds),
/// so that only a peer that hangs reaches it.
pub const PEER_LIMIT: Duration = Duration::from_secs(300);

/// A benchmark peer: this executable re-run as `clan __peer <role> <arguments>`, talking in
/// lines over its stdin and stdout (read by a thread of its own, so that waiting for a line
/// has a limit: [`PEER_LIMIT`]).
pub struct PeerProc {
    child: Child,
    role: Role,
    input: Option<ChildStdin>,
    /// The peer's lines; closed when its stdout ends.
    lines: mpsc::Receiver<std::io::Result<String>>,
}

impl PeerProc {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn spawn(role: Role, args: &impl serde::Serialize) -> Result<PeerProc> {
        PeerProc::spawn_via(Command::new(std::env::current_exe()?), role, args)
    }

    /// Spawn through a prepared command (e.g. `ip netns exec NS <this executable>`).
    pub fn spawn_via(mut cmd: Command, role: Role, args: &impl serde::Serialize) -> Result<PeerProc> {
        let mut child = cmd
            .arg("__peer")
            .arg(role.name())
            .arg(serde_json::to_string(args)?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let input = child.stdin.take();
        let mut output = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new().name("clan-bench-peer".into()).spawn(move || {
            loop {
                let mut l = String::new();
                match output.read_line(&mut l) {
                    Ok(0) => break,
                    Ok(_) => {
                        if tx.send(Ok(l)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        break;
                    }
                }
            }
        })?;
        Ok(PeerProc { child, role, input, lines })
    }

    pub fn send(&mut self, line: impl std::fmt::Display) -> Result<()> {
        let i = self.input.as_mut().ok_or("peer input closed")?;
        writeln!(i, "{line}")?;
        i.flush()?;
        Ok(())
    }

    /// The peer's next line. Fails if it exits first, or says nothing for [`PEER_LIMIT`]
    /// (then it is stopped).
    pub fn recv(&mut self) -> Result<String> {
        match self.lines.recv_timeout(PEER_LIMIT) {
            Ok(l) => Ok(l?.trim_end().to_owned()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(format!("benchmark peer {} exited early (see its error above)", self.role.name()).into())
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                Err(format!("benchmark peer {} said nothing for {} s: stopped", self.role.name(), PEER_LIMIT.as_secs())
                    .into())
            }
        }
    }

    /// Close its input and wait for it to exit (at most [`PEER_LIMIT`]: then it is stopped):
    /// whether it succeeded.
    pub fn finish(mut self) -> Result<()> {
        self.input = None;
        let end = Instant::now() + PEER_LIMIT;
        let st = loop {
            if let Some(st) = self.child.try_wait()? {
                break st;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                return Err(format!(
                    "benchmark peer {} still running {} s after it was told to finish: stopped",
                    self.role.name(),
                    PEER_LIMIT.as_secs()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        if !st.success() {
            return Err(format!("benchmark peer {} failed: {st}", self.role.name()).into());
        }
        Ok(())
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        if self.input.is_some() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The peer side: line I/O on stdio.
pub struct Link;

impl Link {
    pub fn say(line: impl std::fmt::Display) {
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    pub fn hear() -> Result<String> {
        let mut l = String::new();
        if std::io::stdin().read_line(&mut l)? == 0 {
            return Err("benchmark parent went away".into());
        }
        Ok(l.trim_end().to_owned())
    }
}

/// Entry of `clan __peer`.
pub fn peer_main(role: Role, args: &str) -> Result<()> {
    // Die with the benchmark that started us.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    use Role as R;
    match role {
        R::LatLinkPing | R::LatLinkPong | R::LatTcpPing | R::LatTcpPong => tcp::latency_peer(role, args_of(args)?),
        R::BwLinkRecv | R::BwLinkSend | R::BwTcpRecv | R::BwTcpSend => tcp::bandwidth_peer(role, args_of(args)?),
        R::VmmcPeer => vmmc::peer(args_of(args)?),
        R::SrvClan | R::SrvTcp => server::peer(role, args_of(args)?),
        R::PqRecv | R::PqSend => queue::peer(role, args_of(args)?),
        R::PqRingRecv | R::PqRingSend => queue::ring_peer(role, args_of(args)?),
        R::PrpcServer | R::PrpcUnix => rpc::peer(role, args_of(args)?),
        R::PstEcho | R::PstSink => stream::peer(role, args_of(args)?),
        R::ConnServer => connect::peer(args_of(args)?),
        R::GrantsPeer => grants::peer(args_of(args)?),
        R::TokEcho => asyncio::peer(args_of(args)?),
        R::LatClan | R::LatRaw | R::LatRawSlots | R::LatUnix => latency::peer(role, args_of(args)?),
        R::BwClan => bandwidth::peer(args_of(args)?),
    }
}

/// A NIC configuration whose default event queue polls for `spin` before a wait on one of
/// its tripwires sleeps (zero: such waits sleep at once), for the measurements that compare
/// both sides blocking or both sides spinning.
pub fn nic_config(spin: std::time::Duration) -> clan::NicConfig {
    let d = clan::NicConfig::default();
    clan::NicConfig { default_queue: clan::EventQueueConfig { spin, ..d.default_queue.clone() }, ..d }
}
