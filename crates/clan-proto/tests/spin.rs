//! Spinning is one setting: `CLAN_SPIN_US` (read once per process) is the default of every
//! configuration that spins, and zero means that nothing polls — not the protocol's wait,
//! not the event queue under it.
//!
//! Each case runs a reader in a child process (the environment variable is read once per
//! process) that blocks in `Stream::read` for bytes the parent writes every few
//! milliseconds, and reports the defaults it sees and the CPU time its thread used. A reader
//! that spins 2 ms before each sleep burns CPU for most of each gap; one that does not spin
//! only wakes up.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::io::{Read, Write};
use std::time::Duration;

use clan::{EndpointAddr, EventQueueConfig, Nic, NicConfig};
use clan_proto::queue::QueueConfig;
use clan_proto::rpc::RpcConfig;
use clan_proto::stream::{Listener, Stream, StreamConfig};
use util::{Peer, Watchdog, hear, say};

/// Bytes the parent writes, one at a time.
const BYTES: u32 = 150;
/// Pause between them.
const GAP: Duration = Duration::from_millis(3);
/// A long spin: most of each gap.
const LONG_SPIN_US: u64 = 2000;

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "reader" => reader(),
        other => panic!("unknown role {other}"),
    }
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Report the defaults, then read `BYTES` bytes one by one and report the CPU time spent.
/// `CLAN_TEST_QUEUE_SPIN_US` / `CLAN_TEST_STREAM_SPIN_US` set the NIC queue's and the
/// stream's spin explicitly (otherwise: the defaults).
fn reader() {
    let us = |k: &str| std::env::var(k).ok().map(|v| Duration::from_micros(v.parse().unwrap()));
    say(format!(
        "defaults {} {} {} {} {}",
        clan::default_spin().as_micros(),
        EventQueueConfig::default().spin.as_micros(),
        StreamConfig::default().spin.as_micros(),
        QueueConfig::default().spin.as_micros(),
        RpcConfig::default().spin.as_micros(),
    ));
    let mut nc = NicConfig::default();
    if let Some(s) = us("CLAN_TEST_QUEUE_SPIN_US") {
        nc.default_queue.spin = s;
    }
    let nic = Nic::open(nc).unwrap();
    let mut cfg = StreamConfig::default();
    if let Some(s) = us("CLAN_TEST_STREAM_SPIN_US") {
        cfg.spin = s;
    }
    let l = Listener::bind_with(&nic, None, cfg).unwrap();
    say(l.local_addr());
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 1];
    let start = thread_cpu();
    for i in 0..BYTES {
        s.read_exact(&mut b).unwrap();
        assert_eq!(b[0], i as u8);
    }
    let used = thread_cpu() - start;
    s.write_all(&[1]).unwrap();
    say(format!("cpu {}", used.as_micros()));
    let _ = hear();
}

/// Run one reader with `env`; returns its reported defaults and CPU time (µs).
fn run(env: &[(&str, String)]) -> (Vec<u128>, u128) {
    let mut p = Peer::spawn("child", "reader", env);
    let d = p.expect("defaults");
    let defaults: Vec<u128> = d.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect();
    let to: EndpointAddr = p.recv().expect("reader address").parse().unwrap();
    let nic = Nic::open(NicConfig::default()).unwrap();
    let mut s = Stream::connect_with(&nic, to, &StreamConfig::default()).unwrap();
    for i in 0..BYTES {
        std::thread::sleep(GAP);
        s.write_all(&[i as u8]).unwrap();
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).unwrap();
    let cpu: u128 = p.expect("cpu").trim_start_matches("cpu ").parse().unwrap();
    p.send("bye");
    p.wait_ok();
    (defaults, cpu)
}

#[test]
fn clan_spin_us_is_the_one_setting_and_zero_means_no_spinning() {
    let _w = Watchdog::new("spin", Duration::from_secs(120));
    let (d_zero, cpu_zero) = run(&[("CLAN_SPIN_US", "0".into())]);
    assert_eq!(d_zero, vec![0; 5], "CLAN_SPIN_US=0 is every default");
    let (d_long, cpu_long) = run(&[("CLAN_SPIN_US", LONG_SPIN_US.to_string())]);
    assert_eq!(d_long, vec![u128::from(LONG_SPIN_US); 5], "CLAN_SPIN_US is every default");
    // A stream told not to spin does not spin in the event queue under it either, however
    // long that queue's own spin is.
    let (_, cpu_stream_zero) =
        run(&[("CLAN_TEST_QUEUE_SPIN_US", LONG_SPIN_US.to_string()), ("CLAN_TEST_STREAM_SPIN_US", "0".into())]);
    // A value that does not parse is ignored: the built-in default (zero on one CPU).
    let (d_junk, _) = run(&[("CLAN_SPIN_US", "fast".into())]);
    assert!(
        d_junk.iter().all(|&v| v == clan::DEFAULT_SPIN.as_micros() || v == 0)
            && d_junk.windows(2).all(|w| w[0] == w[1]),
        "{d_junk:?}"
    );
    eprintln!(
        "reader CPU: spin 0: {cpu_zero} µs; spin {LONG_SPIN_US} µs: {cpu_long} µs; stream 0 over a spinning queue: {cpu_stream_zero} µs"
    );
    // The long spin burns most of every gap; the others only wake up.
    assert!(cpu_zero * 3 < cpu_long, "no spin {cpu_zero} µs vs long spin {cpu_long} µs");
    assert!(cpu_stream_zero * 3 < cpu_long, "stream spin 0 {cpu_stream_zero} µs vs long spin {cpu_long} µs");
}

#[test]
fn parse_spin_refuses_what_it_cannot_read() {
    assert_eq!(clan::parse_spin("0"), Ok(Duration::ZERO));
    assert_eq!(clan::parse_spin("1000000"), Ok(Duration::from_secs(1)));
    assert!(clan::parse_spin("1000001").is_err());
    assert!(clan::parse_spin("-1").is_err());
    assert!(clan::parse_spin("").is_err());
    assert!(clan::parse_spin("15us").is_err());
}
