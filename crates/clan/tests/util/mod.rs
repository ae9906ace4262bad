//! Helpers shared by the integration tests: a watchdog, and child processes made by
//! re-executing the test binary (so cross-process behaviour is tested with real processes).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Aborts the whole test process if not dropped within `limit`: a deadlock fails loudly
/// instead of hanging CI. Children are killed with us (they watch their stdin).
pub struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    pub fn new(what: &'static str, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while start.elapsed() < limit {
                if d.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("WATCHDOG: {what} did not finish within {limit:?}; aborting");
            std::process::abort();
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

const ROLE: &str = "CLAN_TEST_ROLE";
const PREFIX: &str = "@@ ";

/// The role this process plays, if it is a child. A child is killed if its parent dies
/// (so that no child outlives a test, whatever happens to the test).
pub fn role() -> Option<String> {
    let r = std::env::var(ROLE).ok()?;
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    Some(r)
}

/// A child process running `role` (dispatched by the test named `entry` of this binary).
pub struct Peer {
    pub child: Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Peer {
    pub fn spawn(entry: &str, role: &str, env: &[(&str, String)]) -> Peer {
        Peer::spawn_via(Command::new(std::env::current_exe().expect("test binary path")), entry, role, env)
    }

    /// Spawn through a prepared command (e.g. `ip netns exec NS <this binary>`).
    pub fn spawn_via(mut cmd: Command, entry: &str, role: &str, env: &[(&str, String)]) -> Peer {
        cmd.args([entry, "--exact", "--nocapture", "--test-threads=1", "--include-ignored"])
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child");
        let input = child.stdin.take().expect("stdin");
        let output = BufReader::new(child.stdout.take().expect("stdout"));
        Peer { child, input: Some(input), output }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send one line to the child.
    pub fn send(&mut self, line: &str) {
        if let Some(i) = self.input.as_mut() {
            let _ = writeln!(i, "{line}");
            let _ = i.flush();
        }
    }

    /// The child's next protocol line (None at end of output).
    pub fn recv(&mut self) -> Option<String> {
        let mut l = String::new();
        loop {
            l.clear();
            if self.output.read_line(&mut l).ok()? == 0 {
                return None;
            }
            // libtest prints "test child ... " without a newline before the test runs, so the
            // first protocol line may follow it on the same line.
            if let Some(at) = l.find(PREFIX) {
                return Some(l[at + PREFIX.len()..].trim_end().to_owned());
            }
        }
    }

    pub fn expect(&mut self, what: &str) -> String {
        self.recv().unwrap_or_else(|| panic!("child ended before sending {what}"))
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Close the child's stdin (children end when it closes) and read its last line.
    pub fn finish(&mut self) -> Option<String> {
        self.input = None;
        self.recv()
    }

    pub fn wait_ok(mut self) {
        self.input = None;
        let st = self.child.wait().expect("wait child");
        assert!(st.success(), "child failed: {st}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In a child: send one protocol line to the parent.
pub fn say(line: impl std::fmt::Display) {
    println!("{PREFIX}{line}");
    let _ = std::io::stdout().flush();
}

/// In a child: read one line from the parent (None when the parent closed our stdin).
pub fn hear() -> Option<String> {
    let mut l = String::new();
    match std::io::stdin().read_line(&mut l) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(l.trim_end().to_owned()),
    }
}

/// In a child: exit when the parent goes away (stdin closes), so no child outlives a test.
pub fn die_with_parent() {
    std::thread::spawn(|| {
        let mut s = String::new();
        while std::io::stdin().read_line(&mut s).map(|n| n > 0).unwrap_or(false) {
            s.clear();
        }
        std::process::exit(0);
    });
}

/// A command that runs this test binary as an unprivileged user (`nobody`, through
/// `setpriv`), for protection tests: the kernel's checks that matter between processes
/// (inode modes, open modes) do not apply to root. None when we are not root ourselves (the
/// caller then skips); under `CI`, which runs as root, that is a failure.
pub fn unprivileged() -> Option<Command> {
    if !rustix::process::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root: protection tests cannot be skipped");
        eprintln!("not root: cannot run a child as another user; skipped");
        return None;
    }
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(std::env::current_exe().expect("test binary path"));
    Some(c)
}
