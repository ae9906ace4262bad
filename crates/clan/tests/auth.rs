//! Link authentication with a cluster key, between test hosts (network namespaces joined by
//! veth pairs; without root, NICs on loopback forced onto links — refused in CI, where the
//! test hosts must exist): the right key links, a wrong or a missing key is refused, and a
//! refused peer leaves no link and no harm behind.

mod util;

use std::time::Duration;

use clan::{LocalTransport, Nic, NicConfig};
use clan_testkit::netns::TestNet;
use util::{Peer, Watchdog, hear, say};

const KEY: [u8; 32] = [0x5a; 32];
const OTHER: [u8; 32] = [0xa5; 32];

fn key_hex(k: &[u8; 32]) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

fn key_from_env() -> Option<[u8; 32]> {
    let h = std::env::var("CLAN_KEY").ok()?;
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = u8::from_str_radix(&h[i * 2..i * 2 + 2], 16).unwrap();
    }
    Some(k)
}

fn nic_config() -> NicConfig {
    let ip = std::env::var("CLAN_IP").unwrap_or("127.0.0.1".into()).parse().unwrap();
    let port = std::env::var("CLAN_PORT").unwrap_or("0".into()).parse().unwrap();
    NicConfig { local_transport: LocalTransport::Link, cluster_key: key_from_env(), ..NicConfig::at(ip, port) }
}

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    let nic = Nic::open(nic_config()).unwrap();
    match role.as_str() {
        "server" => {
            let ep = nic.endpoint().unwrap();
            let ap = ep.export(4096).unwrap();
            say(ap.descriptor());
            while let Some(l) = hear() {
                if l == "links" {
                    say(nic.stats().links);
                } else if l == "read" {
                    say(ap.load_u64(0).unwrap());
                }
            }
        }
        "client" => {
            let desc: clan::Descriptor = std::env::var("CLAN_DESC").unwrap().parse().unwrap();
            let ep = nic.endpoint().unwrap();
            match ep.import_timeout(&desc, Duration::from_secs(10)) {
                Ok(m) => {
                    m.store_u64(0, 42).unwrap();
                    m.barrier().unwrap();
                    say("linked");
                }
                Err(e) => {
                    let msg = e.to_string();
                    say(format!("refused {:?} {msg}", std::io::Error::from(e).kind()));
                }
            }
            while hear().is_some() {}
        }
        other => panic!("unknown role {other}"),
    }
}

struct Hosts {
    net: Option<TestNet>,
}

impl Hosts {
    fn new() -> Hosts {
        match TestNet::new(3) {
            Ok(n) => Hosts { net: Some(n) },
            Err(why) => {
                assert!(std::env::var_os("CI").is_none(), "CI must run this between test hosts, but: {why}");
                eprintln!("auth: {why}; running over loopback links instead of test hosts");
                Hosts { net: None }
            }
        }
    }

    fn spawn(&self, host: usize, role: &str, key: Option<&[u8; 32]>, extra: &[(&str, String)]) -> Peer {
        let mut env: Vec<(&str, String)> = extra.to_vec();
        if let Some(k) = key {
            env.push(("CLAN_KEY", key_hex(k)));
        }
        match &self.net {
            Some(net) => {
                env.push(("CLAN_IP", net.host(host).ip.to_string()));
                env.push(("CLAN_PORT", "7000".to_string()));
                Peer::spawn_via(net.command(host, std::env::current_exe().unwrap()), "child", role, &env)
            }
            None => Peer::spawn("child", role, &env),
        }
    }
}

#[test]
fn keyed_links_come_up_and_wrong_or_missing_keys_are_refused() {
    let _wd = Watchdog::new("link authentication", Duration::from_secs(120));
    let hosts = Hosts::new();
    let mut server = hosts.spawn(0, "server", Some(&KEY), &[]);
    let desc = server.expect("descriptor");
    let env = [("CLAN_DESC", desc)];
    for (host, key, want) in [(2, Some(&OTHER), false), (1, None, false), (2, Some(&KEY), true)] {
        let mut c = hosts.spawn(host, "client", key, &env);
        let got = c.expect("result");
        eprintln!("client on host {host} with {}: {got}", if key.is_some() { "a key" } else { "no key" });
        if want {
            assert_eq!(got, "linked");
            server.send("links");
            assert_eq!(server.expect("links"), "1", "the keyed client is linked");
        } else {
            assert!(got.starts_with("refused PermissionDenied"), "{got}");
            assert!(got.contains("authentication"), "{got}");
            // The refused peer (still running) left no link behind on the server.
            server.send("links");
            assert_eq!(server.expect("links"), "0", "a refused peer holds a link");
        }
        drop(c);
    }
    server.send("read");
    assert_eq!(server.expect("value"), "42", "the keyed client's write landed");
}
