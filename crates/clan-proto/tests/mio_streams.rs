//! Streams and listeners registered with mio (`StreamConfig::own_queue`): an echo server in
//! another process, one thread, one `mio::Poll`, non-blocking accepts, reads and writes
//! until `WouldBlock`; clients that push more than the rings hold (so both readable and
//! writable edges matter), and one client SIGKILLed mid-stream.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use clan::Nic;
use clan_proto::stream::{Listener, Stream, StreamConfig};
use mio::{Events, Interest, Poll, Token};
use util::Watchdog;

/// Small rings: a client's burst never fits, so the server's writes block and resume.
fn cfg() -> StreamConfig {
    StreamConfig { ring: 16 << 10, post_area: 0, own_queue: true, ..StreamConfig::default() }
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8).collect()
}

struct Conn {
    s: Stream,
    /// Bytes read and not yet echoed.
    pending: Vec<u8>,
    echoed: u64,
    done_reading: bool,
}

/// The echo server: serves until `expect` connections have ended (cleanly or not), then
/// reports "served <clean> <failed> <bytes>".
fn serve(expect: usize) {
    let nic = Nic::open_default().unwrap();
    let mut l = Listener::bind_with(&nic, None, cfg()).unwrap();
    let mut poll = Poll::new().unwrap();
    poll.registry().register(&mut l, Token(0), Interest::READABLE).unwrap();
    util::say(l.local_addr());
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut next = 1;
    let (mut clean, mut failed, mut bytes) = (0usize, 0usize, 0u64);
    let mut events = Events::with_capacity(64);
    let mut buf = vec![0u8; 8192];
    while clean + failed < expect {
        poll.poll(&mut events, Some(Duration::from_millis(500))).unwrap();
        let woken: Vec<Token> = events.iter().map(|e| e.token()).collect();
        for t in woken {
            if t == Token(0) {
                loop {
                    match l.accept() {
                        Ok((mut s, _)) => {
                            poll.registry()
                                .register(&mut s, Token(next), Interest::READABLE | Interest::WRITABLE)
                                .unwrap();
                            conns.insert(next, Conn { s, pending: Vec::new(), echoed: 0, done_reading: false });
                            next += 1;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) => panic!("accept: {e}"),
                    }
                }
                continue;
            }
            let Some(c) = conns.get_mut(&t.0) else { continue };
            // Whatever the event says, try both (a stream's readiness arrives as one kind).
            let mut broken = false;
            loop {
                // Echo what is pending first: reading more is pointless while it cannot go.
                while !c.pending.is_empty() {
                    match c.s.write(&c.pending) {
                        Ok(n) => {
                            c.pending.drain(..n);
                            c.echoed += n as u64;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(_) => {
                            broken = true;
                            break;
                        }
                    }
                }
                if broken || !c.pending.is_empty() || c.done_reading {
                    break;
                }
                match c.s.read(&mut buf) {
                    Ok(0) => c.done_reading = true,
                    Ok(n) => c.pending.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => broken = true,
                }
                if broken {
                    break;
                }
            }
            if broken {
                let mut c = conns.remove(&t.0).unwrap();
                poll.registry().deregister(&mut c.s).unwrap();
                failed += 1;
            } else if c.done_reading && c.pending.is_empty() {
                let mut c = conns.remove(&t.0).unwrap();
                bytes += c.echoed;
                poll.registry().deregister(&mut c.s).unwrap();
                clean += 1;
            }
        }
    }
    util::say(format!("served {clean} {failed} {bytes}"));
}

/// A client: writes `len` bytes while another thread reads the echo back; checks it.
fn client(nic: &Nic, addr: clan::EndpointAddr, seed: u32, len: usize) -> std::thread::JoinHandle<()> {
    let s = Stream::connect_with(nic, addr, &StreamConfig { ring: 16 << 10, ..StreamConfig::default() }).unwrap();
    std::thread::spawn(move || {
        let data = pattern(seed, len);
        let mut r = s.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::with_capacity(len);
            r.read_to_end(&mut got).unwrap();
            got
        });
        let mut w = s;
        for chunk in data.chunks(3000 + seed as usize * 1000) {
            w.write_all(chunk).unwrap();
        }
        w.shutdown(std::net::Shutdown::Write).unwrap();
        let got = reader.join().unwrap();
        assert_eq!(got.len(), data.len(), "client {seed}: echo length");
        assert!(got == data, "client {seed}: echo differs");
    })
}

/// A client of request/response turns: each request is written only after the previous
/// echo came back, so the server is woken by data landing alone (nothing of its own is
/// waiting to be written, and the reader's position moves too little to be mirrored).
fn turns(nic: &Nic, addr: clan::EndpointAddr, n: usize) -> std::thread::JoinHandle<()> {
    let mut s = Stream::connect(nic, addr).unwrap();
    std::thread::spawn(move || {
        let mut back = [0u8; 100];
        for i in 0..n {
            let req = pattern(100 + i as u32, 100);
            s.write_all(&req).unwrap();
            s.read_exact(&mut back).unwrap();
            assert_eq!(back[..], req[..], "turn {i}");
            if i % 20 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(s.read(&mut back).unwrap(), 0, "end of stream after the last turn");
    })
}

#[test]
fn child() {
    let Some(role) = util::role() else { return };
    match role.as_str() {
        "server" => serve(util::hear().unwrap().parse().unwrap()),
        "victim" => {
            // Connect, send part of a message, wait to be killed.
            let addr: clan::EndpointAddr = util::hear().unwrap().parse().unwrap();
            let nic = Nic::open_default().unwrap();
            let mut s = Stream::connect(&nic, addr).unwrap();
            s.write_all(&pattern(9, 5000)).unwrap();
            util::say("sent");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_mio_echo_server_in_another_process() {
    let _wd = Watchdog::new("mio echo server", Duration::from_secs(120));
    let mut server = util::Peer::spawn("child", "server", &[]);
    server.send("5");
    let addr: clan::EndpointAddr = server.expect("address").parse().unwrap();
    // One client dies mid-stream: the server sees its stream fail, serves the others.
    let mut victim = util::Peer::spawn("child", "victim", &[]);
    victim.send(&addr.to_string());
    assert_eq!(victim.expect("sent"), "sent");
    victim.kill();
    let nic = Nic::open_default().unwrap();
    let sizes = [1usize, 200_000, 1_500_000];
    let mut clients: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| client(&nic, addr, i as u32, n)).collect();
    clients.push(turns(&nic, addr, 200));
    for c in clients {
        c.join().unwrap();
    }
    let start = Instant::now();
    let report = server.expect("report");
    assert!(start.elapsed() < Duration::from_secs(60));
    let total: usize = sizes.iter().sum::<usize>() + 200 * 100;
    assert_eq!(report, format!("served 4 1 {total}"), "4 clean, 1 killed, every byte echoed");
}

/// Registering needs a queue of the stream's own; without one it is a clear error.
#[test]
fn registering_without_an_own_queue_is_refused() {
    let _wd = Watchdog::new("mio refusal", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let mut l = Listener::bind(&nic).unwrap();
    let poll = Poll::new().unwrap();
    let e = poll.registry().register(&mut l, Token(0), Interest::READABLE).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let addr = l.local_addr();
    let n2 = nic.clone();
    let t = std::thread::spawn(move || Stream::connect(&n2, addr).unwrap());
    let (mut s, _) = l.accept().unwrap();
    let _c = t.join().unwrap();
    let e = poll.registry().register(&mut s, Token(1), Interest::READABLE).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
}

/// An idle registered stream wakes its poller once (its first edge: writable), not again and
/// again; data that lands later wakes it once more.
#[test]
fn an_idle_stream_does_not_wake_its_poller() {
    let _wd = Watchdog::new("mio idle", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let l = Listener::bind_with(&nic, None, cfg()).unwrap();
    let addr = l.local_addr();
    let n2 = nic.clone();
    let t = std::thread::spawn(move || Stream::connect(&n2, addr).unwrap());
    let (mut s, _) = l.accept().unwrap();
    let mut c = t.join().unwrap();
    let mut poll = Poll::new().unwrap();
    poll.registry().register(&mut s, Token(7), Interest::READABLE | Interest::WRITABLE).unwrap();
    let mut events = Events::with_capacity(8);
    let mut wakes = 0;
    let mut buf = [0u8; 64];
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        poll.poll(&mut events, Some(Duration::from_millis(50))).unwrap();
        if !events.is_empty() {
            wakes += 1;
            // Handle it as a server would: read until WouldBlock (nothing to write).
            assert_eq!(s.read(&mut buf).unwrap_err().kind(), ErrorKind::WouldBlock);
        }
    }
    assert!(wakes <= 1, "an idle stream woke its poller {wakes} times");
    c.write_all(b"hello").unwrap();
    poll.poll(&mut events, Some(Duration::from_secs(10))).unwrap();
    assert!(events.iter().any(|e| e.token() == Token(7)), "data landing is reported");
    assert_eq!(s.read(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
}
