//! Test hosts in network namespaces.
//!
//! Needs root and iproute2. Traffic only ever flows inside the namespaces created here
//! (addresses from 10.77.0.0/16); every namespace is removed when the [`TestNet`] is dropped
//! (also when a test panics), and namespaces of test processes that died without cleaning up
//! are removed by the next [`TestNet::new`].

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

const PREFIX: &str = "clant";
static SERIAL: AtomicU32 = AtomicU32::new(0);

/// One test host: a network namespace and its address.
#[derive(Debug, Clone)]
pub struct Host {
    /// Namespace name.
    pub ns: String,
    /// Its address on the test network.
    pub ip: Ipv4Addr,
}

/// A set of test hosts on one network.
#[derive(Debug)]
pub struct TestNet {
    hosts: Vec<Host>,
    switch: Option<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn in_ns(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut a = vec!["netns", "exec", ns, "ip"];
    a.extend_from_slice(args);
    ip(&a)
}

/// Why test hosts cannot be made here, if they cannot.
pub fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("network namespaces need root".into());
    }
    if Command::new("ip").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        return Some("iproute2 (the ip command) is not installed".into());
    }
    None
}

/// Remove namespaces left by test processes that no longer exist.
fn reap() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl TestNet {
    /// `n` hosts (2 or more) on one network. Fails with the reason if namespaces cannot be
    /// made here (not root, no iproute2).
    pub fn new(n: usize) -> Result<TestNet, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        reap();
        let pid = std::process::id();
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let subnet = ((pid.wrapping_mul(7) + serial) % 250 + 1) as u8;
        let mut net = TestNet { hosts: Vec::new(), switch: None };
        let tag = format!("{:05}{:02}", pid % 100_000, serial % 100);
        for i in 0..n.max(2) {
            let host =
                Host { ns: format!("{PREFIX}{pid}-{serial}-h{i}"), ip: Ipv4Addr::new(10, 77, subnet, i as u8 + 1) };
            ip(&["netns", "add", &host.ns])?;
            net.hosts.push(host);
            in_ns(&net.hosts[i].ns, &["link", "set", "lo", "up"])?;
        }
        if n <= 2 {
            let (a, b) = (&net.hosts[0], &net.hosts[1]);
            let (va, vb) = (format!("cv{tag}a"), format!("cv{tag}b"));
            ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
            ip(&["link", "set", &va, "netns", &a.ns])?;
            ip(&["link", "set", &vb, "netns", &b.ns])?;
            for (h, v) in [(a, &va), (b, &vb)] {
                in_ns(&h.ns, &["addr", "add", &format!("{}/24", h.ip), "dev", v])?;
                in_ns(&h.ns, &["link", "set", v, "up"])?;
            }
        } else {
            let sw = format!("{PREFIX}{pid}-{serial}-sw");
            ip(&["netns", "add", &sw])?;
            net.switch = Some(sw.clone());
            in_ns(&sw, &["link", "add", "br0", "type", "bridge"])?;
            in_ns(&sw, &["link", "set", "br0", "up"])?;
            for (i, h) in net.hosts.iter().enumerate() {
                let (vh, vs) = (format!("cv{tag}{i}h"), format!("cv{tag}{i}s"));
                ip(&["link", "add", &vh, "type", "veth", "peer", "name", &vs])?;
                ip(&["link", "set", &vh, "netns", &h.ns])?;
                ip(&["link", "set", &vs, "netns", &sw])?;
                in_ns(&sw, &["link", "set", &vs, "master", "br0"])?;
                in_ns(&sw, &["link", "set", &vs, "up"])?;
                in_ns(&h.ns, &["addr", "add", &format!("{}/24", h.ip), "dev", &vh])?;
                in_ns(&h.ns, &["link", "set", &vh, "up"])?;
            }
        }
        Ok(net)
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are no hosts (never).
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// A command that runs `program` on host `i`.
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i].ns]).arg(program);
        c
    }

    /// Cut host `i` off the network (its link goes down) or reconnect it.
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let h = &self.hosts[i];
        let out = Command::new("ip")
            .args(["netns", "exec", &h.ns, "ip", "-o", "link", "show"])
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines() {
            let name = line.split(':').nth(1).map(|s| s.trim().split('@').next().unwrap_or("")).unwrap_or("");
            if name.starts_with("cv") {
                in_ns(&h.ns, &["link", "set", name, if up { "up" } else { "down" }])?;
            }
        }
        Ok(())
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        if let Some(sw) = &self.switch {
            let _ = ip(&["netns", "del", sw]);
        }
    }
}
