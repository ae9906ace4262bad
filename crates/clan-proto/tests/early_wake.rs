//! Early wake-ups between two processes (`clan_proto::stream::StreamStats`): a reader that
//! sleeps for data leaves its peer a token, and the peer, taking data from it on another
//! CPU, wakes it at once; on the same CPU it does not. And a non-blocking reader whose bytes
//! come over a link receives them itself.
//!
//! The echoing peer is a child process pinned to a CPU; it waits until the request has
//! landed, then a few milliseconds more (so that the parent, blocked in `read` with no
//! spin, is asleep), then takes it and replies.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, LocalTransport, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use util::{Peer, Watchdog, hear, say};

/// Round trips per case.
const ROUNDS: u64 = 20;

fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).expect("pin");
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A NIC and stream configuration that never spin (every read that waits sleeps).
fn no_spin(link: bool) -> (NicConfig, StreamConfig) {
    let mut nc = NicConfig::default();
    nc.default_queue.spin = Duration::ZERO;
    if link {
        nc.local_transport = LocalTransport::Link;
    }
    (nc, StreamConfig { spin: Duration::ZERO, ..StreamConfig::default() })
}

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "echo" => echo(),
        "poller" => poller(),
        other => panic!("unknown role {other}"),
    }
}

/// Pinned to `CLAN_TEST_CPU`: echo `ROUNDS` bytes, each taken only after it landed and a
/// pause; then report the stream's counters.
fn echo() {
    pin(std::env::var("CLAN_TEST_CPU").unwrap().parse().unwrap());
    let (nc, cfg) = no_spin(false);
    let nic = Nic::open(nc).unwrap();
    let l = Listener::bind_with(&nic, None, cfg).unwrap();
    say(l.local_addr());
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 1];
    for i in 0..ROUNDS {
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.available().unwrap() == 0 {
            assert!(Instant::now() < deadline, "request {i} never landed");
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_millis(5));
        s.read_exact(&mut b).unwrap();
        assert_eq!(u64::from(b[0]), i);
        s.write_all(&b).unwrap();
    }
    let st = s.stats();
    say(format!("stats {} {}", st.early_wakeups, st.read));
    let _ = hear();
}

/// Run the round trips against an echoing child on `child_cpu` (this thread on CPU 0);
/// returns (the child's early wake-ups given, this side's sleeps).
fn round_trips(child_cpu: usize) -> (u64, u64) {
    pin(0);
    let mut p = Peer::spawn("child", "echo", &[("CLAN_TEST_CPU", child_cpu.to_string())]);
    let to: EndpointAddr = p.recv().expect("echo address").parse().unwrap();
    let (nc, cfg) = no_spin(false);
    let nic = Nic::open(nc).unwrap();
    let mut s = Stream::connect_with(&nic, to, &cfg).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 1];
    for i in 0..ROUNDS {
        s.write_all(&[i as u8]).unwrap();
        s.read_exact(&mut b).unwrap();
        assert_eq!(u64::from(b[0]), i, "echo");
    }
    let line = p.expect("stats");
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[1], ROUNDS, "bytes the child read");
    p.send("bye");
    p.wait_ok();
    let mine = s.stats();
    assert_eq!(mine.read, ROUNDS);
    (v[0], mine.read_sleeps)
}

#[test]
fn a_peer_on_another_cpu_wakes_the_sleeping_reader_when_it_takes_the_request() {
    let _w = Watchdog::new("early wake-up, two CPUs", Duration::from_secs(120));
    if cpus() < 2 {
        eprintln!("skipped: one CPU");
        return;
    }
    let (woken, sleeps) = round_trips(1);
    eprintln!("early wake-ups {woken} of {ROUNDS} round trips; reader sleeps {sleeps}");
    // Every request waits 5 ms after landing, so the reader is asleep by then unless the
    // machine stalls it that long: nearly always a wake-up per round trip.
    assert!(woken >= 1, "no early wake-up in {ROUNDS} round trips");
    assert!(woken <= sleeps, "{woken} wake-ups for {sleeps} sleeps");
    assert!(sleeps >= ROUNDS, "the reader slept {sleeps} times in {ROUNDS} blocking round trips");
}

#[test]
fn a_peer_on_the_same_cpu_leaves_the_reader_asleep() {
    let _w = Watchdog::new("early wake-up, one CPU", Duration::from_secs(120));
    let (woken, sleeps) = round_trips(0);
    assert_eq!(woken, 0, "a peer on the reader's own CPU gave early wake-ups");
    assert!(sleeps >= ROUNDS, "the reader slept {sleeps} times");
}

/// Over a forced link: read non-blocking (polling until `WouldBlock` ends), echo `ROUNDS`
/// messages of 64 bytes.
fn poller() {
    let (nc, cfg) = no_spin(true);
    let nic = Nic::open(nc).unwrap();
    let l = Listener::bind_with(&nic, None, cfg).unwrap();
    say(l.local_addr());
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 64];
    for _ in 0..ROUNDS {
        poll_exact(&mut s, &mut b);
        let mut w = &b[..];
        while !w.is_empty() {
            match s.write(w) {
                Ok(n) => w = &w[n..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("write: {e}"),
            }
        }
    }
    say("done");
    let _ = hear();
}

fn poll_exact(s: &mut Stream, b: &mut [u8]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = 0;
    while got < b.len() {
        match s.read(&mut b[got..]) {
            Ok(0) => panic!("end of stream"),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "nothing came");
                std::thread::yield_now();
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

#[test]
fn non_blocking_reads_over_a_link_receive_the_bytes_themselves() {
    let _w = Watchdog::new("non-blocking reads over a link", Duration::from_secs(120));
    let mut p = Peer::spawn("child", "poller", &[]);
    let to: EndpointAddr = p.recv().expect("poller address").parse().unwrap();
    let (nc, cfg) = no_spin(true);
    let nic = Nic::open(nc).unwrap();
    let mut s = Stream::connect_with(&nic, to, &cfg).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut back = [0u8; 64];
    for i in 0..ROUNDS {
        let msg: Vec<u8> = (0..64).map(|k| (i as u8).wrapping_mul(31).wrapping_add(k)).collect();
        s.write_all(&msg).unwrap();
        poll_exact(&mut s, &mut back);
        assert_eq!(&back[..], &msg[..], "round {i}");
    }
    assert!(nic.stats().links >= 1, "the stream went over a link");
    p.expect("done");
    p.send("bye");
    p.wait_ok();
}
