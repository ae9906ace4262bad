//! tokio streams across processes: many concurrent clients against an echo server in another
//! process, with the reactors spinning and not; a client SIGKILLed mid-message; the
//! reactor's spin-then-sleep measured in CPU time; a reactor made outside a runtime.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::time::Duration;

use clan::{EndpointAddr, EventQueueConfig, Nic, NicConfig};
use clan_proto::stream::StreamConfig;
use clan_proto::tokio::Reactor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use util::{Peer, Watchdog, hear, say};

/// Concurrent clients of the many-clients test.
const CLIENTS: usize = 24;
/// Messages each of them sends.
const MESSAGES: usize = 60;
/// A small ring, so that writers fill it and wait for space.
const RING: u64 = 4096;
/// A long reactor spin (µs): most of each gap of the CPU test.
const LONG_SPIN_US: u64 = 2000;

fn env_u64(k: &str) -> u64 {
    std::env::var(k).unwrap().parse().unwrap()
}

fn stream_config() -> StreamConfig {
    StreamConfig { ring: RING, ..StreamConfig::default() }
}

fn reactor(nic: &Nic, spin_us: u64) -> Reactor {
    let cfg = EventQueueConfig {
        ring_capacity: 1 << 12,
        spin: Duration::from_micros(spin_us),
        ..EventQueueConfig::default()
    };
    Reactor::with_queue(nic, cfg).unwrap()
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "echo-server" => echo_server(),
        "doomed-client" => doomed_client(),
        "port-client" => port_client(),
        other => panic!("unknown role {other}"),
    }
}

/// Accept `CLAN_TEST_CONNS` connections on a reactor spinning `CLAN_TEST_SPIN_US`, echo each
/// until its end, and report per connection how it ended and the bytes echoed, then the CPU
/// time of the runtime's thread.
fn echo_server() {
    let conns = env_u64("CLAN_TEST_CONNS") as usize;
    let spin = env_u64("CLAN_TEST_SPIN_US");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, spin);
        let l = r.bind(stream_config()).unwrap();
        say(l.local_addr());
        let start = thread_cpu();
        let mut tasks = Vec::new();
        for _ in 0..conns {
            let (mut s, _) = l.accept().await.unwrap();
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 3000];
                let mut total = 0u64;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) => return format!("eof {total}"),
                        Ok(n) => {
                            if let Err(e) = s.write_all(&buf[..n]).await {
                                return format!("error {total} {e}");
                            }
                            total += n as u64;
                        }
                        Err(e) => return format!("error {total} {e}"),
                    }
                }
            }));
        }
        let mut ends = Vec::new();
        for t in tasks {
            ends.push(t.await.unwrap());
        }
        let used = thread_cpu() - start;
        for e in ends {
            say(format!("ended {e}"));
        }
        say(format!("cpu {}", used.as_micros()));
    });
    let _ = hear();
}

/// Connect, write part of a message, say so, then wait to be killed.
fn doomed_client() {
    let to: EndpointAddr = std::env::var("CLAN_TEST_TO").unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, 0);
        let mut s = r.connect(to, stream_config()).await.unwrap();
        s.write_all(&[7u8; 100]).await.unwrap();
        say("written");
        std::future::pending::<()>().await;
    });
}

fn server(conns: usize, spin_us: u64) -> (Peer, EndpointAddr) {
    let mut p = Peer::spawn(
        "child",
        "echo-server",
        &[("CLAN_TEST_CONNS", conns.to_string()), ("CLAN_TEST_SPIN_US", spin_us.to_string())],
    );
    let to = p.recv().expect("server address").parse().unwrap();
    (p, to)
}

/// The server's report: how each connection ended, and its CPU time (µs).
fn ends(p: &mut Peer, conns: usize) -> (Vec<String>, u128) {
    let ends: Vec<String> = (0..conns).map(|_| p.expect("ended")).collect();
    let cpu = p.expect("cpu").trim_start_matches("cpu ").parse().unwrap();
    p.send("bye");
    (ends, cpu)
}

/// Message `k` of client `c`: a length from 1 to about 9 KiB (more than the ring), its
/// bytes a function of both.
fn message(c: usize, k: usize) -> Vec<u8> {
    let len = 1 + (c * 131 + k * 977) % 9000;
    (0..len).map(|i| (i * 31 + c * 7 + k) as u8).collect()
}

fn many_clients(spin_us: u64) {
    let (mut p, to) = server(CLIENTS, spin_us);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let expected: u64 = (0..CLIENTS).flat_map(|c| (0..MESSAGES).map(move |k| message(c, k).len() as u64)).sum();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, spin_us);
        let mut tasks = Vec::new();
        for c in 0..CLIENTS {
            let s = r.connect(to, stream_config()).await.unwrap();
            tasks.push(tokio::spawn(async move {
                let (mut rd, mut wr) = tokio::io::split(s);
                // Write and read at once: a message longer than the ring only goes through
                // while its echo is being read.
                let writer = tokio::spawn(async move {
                    for k in 0..MESSAGES {
                        wr.write_all(&message(c, k)).await.unwrap();
                    }
                    wr.shutdown().await.unwrap();
                    wr
                });
                for k in 0..MESSAGES {
                    let want = message(c, k);
                    let mut got = vec![0u8; want.len()];
                    rd.read_exact(&mut got).await.unwrap();
                    assert!(got == want, "client {c} message {k}: other bytes came back");
                }
                let wr = writer.await.unwrap();
                drop(rd.unsplit(wr));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let (ends, _) = ends(&mut p, CLIENTS);
    let total: u64 = ends
        .iter()
        .map(|e| {
            let mut w = e.split_whitespace().skip(1);
            assert_eq!(w.next(), Some("eof"), "a connection ended badly: {e}");
            w.next().unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(total, expected, "every byte echoed once");
    p.wait_ok();
}

#[test]
fn many_async_clients_across_processes_with_the_reactors_spinning() {
    let _w = Watchdog::new("async clients, spinning", Duration::from_secs(120));
    many_clients(LONG_SPIN_US);
}

#[test]
fn many_async_clients_across_processes_with_the_reactors_sleeping_at_once() {
    let _w = Watchdog::new("async clients, not spinning", Duration::from_secs(120));
    many_clients(0);
}

#[test]
fn a_client_killed_mid_message_ends_its_server_task_and_no_other() {
    let _w = Watchdog::new("killed async client", Duration::from_secs(120));
    let (mut p, to) = server(2, 0);
    let mut doomed = Peer::spawn("child", "doomed-client", &[("CLAN_TEST_TO", to.to_string())]);
    doomed.expect("written");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, 0);
        let mut s = r.connect(to, stream_config()).await.unwrap();
        s.write_all(b"before").await.unwrap();
        let mut b = [0u8; 6];
        s.read_exact(&mut b).await.unwrap();
        doomed.kill();
        // The survivor still gets its echo after the other client is gone.
        s.write_all(b"after!").await.unwrap();
        s.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"after!");
        s.shutdown().await.unwrap();
    });
    let (ends, _) = ends(&mut p, 2);
    eprintln!("server tasks: {ends:?}");
    // The doomed one connected first: its task reports its death (as an end or an error,
    // after echoing what it had written), the survivor's an orderly end.
    assert!(ends[0].starts_with("ended eof 100") || ends[0].starts_with("ended error"), "{ends:?}");
    assert_eq!(ends[1], "ended eof 12", "{ends:?}");
    p.wait_ok();
}

/// One client writes a byte every few milliseconds; the server's reactor spins `spin_us`
/// after each event. Returns the server thread's CPU time (µs).
fn sparse_cpu(spin_us: u64) -> u128 {
    let (mut p, to) = server(1, spin_us);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, 0);
        let mut s = r.connect(to, stream_config()).await.unwrap();
        let mut b = [0u8; 1];
        for i in 0..150u8 {
            tokio::time::sleep(Duration::from_millis(3)).await;
            s.write_all(&[i]).await.unwrap();
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], i);
        }
        s.shutdown().await.unwrap();
    });
    let (ends, cpu) = ends(&mut p, 1);
    assert_eq!(ends, ["ended eof 150"]);
    p.wait_ok();
    cpu
}

#[test]
fn the_reactor_spins_then_sleeps_and_zero_means_it_sleeps_at_once() {
    let _w = Watchdog::new("reactor spin", Duration::from_secs(120));
    let zero = sparse_cpu(0);
    let long = sparse_cpu(LONG_SPIN_US);
    eprintln!("server CPU: reactor spin 0: {zero} µs; spin {LONG_SPIN_US} µs: {long} µs");
    // The long spin keeps looking at the queue for most of each gap; zero only wakes up.
    assert!(zero * 3 < long, "spin 0: {zero} µs vs spin {LONG_SPIN_US} µs: {long} µs");
}

#[test]
fn a_reactor_made_outside_a_runtime_is_an_error_not_a_panic() {
    let nic = Nic::open(NicConfig::default()).unwrap();
    let e = Reactor::new(&nic).unwrap_err();
    assert!(e.to_string().contains("tokio runtime"), "{e}");
}

/// Connect to the port we are told (`CLAN_TEST_PEER`), send one message, read its echo.
fn port_client() {
    let to: EndpointAddr = std::env::var("CLAN_TEST_PEER").unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, 0);
        let mut s = r.connect(to, stream_config()).await.unwrap();
        s.write_all(b"to a chosen port").await.unwrap();
        let mut back = [0u8; 16];
        s.read_exact(&mut back).await.unwrap();
        say(String::from_utf8_lossy(&back));
    });
}

/// A listener bound to a port chosen in advance: it is that port, a second bind of it is
/// `AddrInUse`, and a client in another process that was told only the address connects.
#[test]
fn a_listener_binds_the_port_it_is_given() {
    let _wd = Watchdog::new("chosen port", Duration::from_secs(60));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let nic = Nic::open(NicConfig::default()).unwrap();
        let r = reactor(&nic, 0);
        let port = 4242;
        let l = r.bind_port(port, stream_config()).unwrap();
        assert_eq!(l.local_addr().port, port);
        let again = r.bind_port(port, stream_config()).unwrap_err();
        assert_eq!(again.kind(), std::io::ErrorKind::AddrInUse);
        let to = EndpointAddr::new(nic.addr(), port);
        let mut c = Peer::spawn("child", "port-client", &[("CLAN_TEST_PEER", to.to_string())]);
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; 16];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(&buf).await.unwrap();
        assert_eq!(tokio::task::spawn_blocking(move || c.expect("echo")).await.unwrap(), "to a chosen port");
    });
}
