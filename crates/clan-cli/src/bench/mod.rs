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
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A benchmark peer: this executable re-run as `clan __peer <role> <args…>`, talking in
/// lines over its stdin and stdout.
pub struct PeerProc {
    child: Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl PeerProc {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn spawn(role: &str, args: &[String]) -> Result<PeerProc> {
        PeerProc::spawn_via(Command::new(std::env::current_exe()?), role, args)
    }

    /// Spawn through a prepared command (e.g. `ip netns exec NS <this executable>`).
    pub fn spawn_via(mut cmd: Command, role: &str, args: &[String]) -> Result<PeerProc> {
        let mut child = cmd
            .arg("__peer")
            .arg(role)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let input = child.stdin.take();
        let output = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        Ok(PeerProc { child, input, output })
    }

    pub fn send(&mut self, line: impl std::fmt::Display) -> Result<()> {
        let i = self.input.as_mut().ok_or("peer input closed")?;
        writeln!(i, "{line}")?;
        i.flush()?;
        Ok(())
    }

    pub fn recv(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.output.read_line(&mut l)? == 0 {
            return Err("benchmark peer exited early (see its error above)".into());
        }
        Ok(l.trim_end().to_owned())
    }

    pub fn finish(mut self) -> Result<()> {
        self.input = None;
        let st = self.child.wait()?;
        if !st.success() {
            return Err(format!("benchmark peer failed: {st}").into());
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
pub fn peer_main(role: &str, args: &[String]) -> Result<()> {
    // Die with the benchmark that started us.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    match role {
        r if r.starts_with("lat-link") || r.starts_with("lat-tcp") => tcp::latency_peer(r, args),
        r if r.starts_with("bw-link") || r.starts_with("bw-tcp") => tcp::bandwidth_peer(r, args),
        "vmmc-peer" => vmmc::peer(role, args),
        r if r.starts_with("srv-") => server::peer(r, args),
        r if r.starts_with("pq-") => queue::peer(r, args),
        r if r.starts_with("prpc-") => rpc::peer(r, args),
        r if r.starts_with("pst-") => stream::peer(r, args),
        "conn-server" => connect::peer(role, args),
        "grants-peer" => grants::peer(role, args),
        "tok-echo" => asyncio::peer(role, args),
        r if r.starts_with("lat-") => latency::peer(r, args),
        r if r.starts_with("bw-") => bandwidth::peer(r, args),
        other => Err(format!("unknown peer role {other}").into()),
    }
}

/// A NIC configuration whose default event queue polls for `spin` before a wait on one of
/// its tripwires sleeps (zero: such waits sleep at once), for the measurements that compare
/// both sides blocking or both sides spinning.
pub fn nic_config(spin: std::time::Duration) -> clan::NicConfig {
    let d = clan::NicConfig::default();
    clan::NicConfig { default_queue: clan::EventQueueConfig { spin, ..d.default_queue.clone() }, ..d }
}

/// `key=value` arguments.
pub fn arg<T: std::str::FromStr>(args: &[String], key: &str) -> Result<T> {
    args.iter()
        .find_map(|a| a.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or_else(|| format!("missing peer argument {key}"))?
        .parse()
        .map_err(|_| format!("bad peer argument {key}").into())
}
