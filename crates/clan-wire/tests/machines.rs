//! The control-plane state machines under property tests: clean runs complete, and runs
//! with drops, duplicates, reordering, cuts, time jumps, peer death and garbage keep every
//! invariant (the harnesses of `clan_wire::fuzzing`, which assert them). The checked-in fuzz
//! corpus is replayed through the same harnesses.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clan_wire::connect::{self, Answer, Handshakes, Limits};
use clan_wire::fuzzing;
use clan_wire::handshake::{Handshake, HandshakeConfig, HandshakeEvent, Role};
use proptest::prelude::*;

fn cfg(local: SocketAddr, key: Option<[u8; 32]>) -> HandshakeConfig {
    HandshakeConfig {
        local,
        credit: 1 << 20,
        key,
        timeout: Duration::from_secs(5),
        hello_timeout: Duration::from_secs(2),
    }
}

/// Deliver `bytes` to `h` in pieces of the given sizes.
fn feed(h: &mut Handshake, bytes: &[u8], sizes: &[usize]) {
    let mut at = 0;
    let mut i = 0;
    while at < bytes.len() {
        let n = sizes.get(i % sizes.len().max(1)).copied().unwrap_or(bytes.len()).clamp(1, bytes.len() - at);
        h.handle_data(&bytes[at..at + n]);
        at += n;
        i += 1;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any chunking of a clean exchange brings both ends up, each with the other's address
    /// and window, with or without a (shared) key.
    #[test]
    fn clean_handshakes_come_up(
        keyed in any::<bool>(),
        key in any::<[u8; 32]>(),
        nd in any::<[u8; 16]>(),
        na in any::<[u8; 16]>(),
        sizes in prop::collection::vec(1usize..40, 1..8),
    ) {
        let key = keyed.then_some(key);
        let (da, aa): (SocketAddr, SocketAddr) = ("10.77.0.1:7000".parse().unwrap(), "10.77.0.2:7000".parse().unwrap());
        let now = Instant::now();
        let mut d = Handshake::new(Role::Dialler { expect: aa }, cfg(da, key), nd, now);
        let mut a = Handshake::new(Role::Acceptor, cfg(aa, key), na, now);
        let (mut d_ready, mut a_ready) = (None, None);
        for _ in 0..6 {
            let mut b = Vec::new();
            d.poll_transmit(&mut b);
            feed(&mut a, &b, &sizes);
            while let Some(e) = a.poll_event() {
                match e {
                    HandshakeEvent::Verified { peer } => { prop_assert_eq!(peer, da); a.decide(true); }
                    HandshakeEvent::Ready { peer, credit } => a_ready = Some((peer, credit)),
                    HandshakeEvent::Failed(f) => prop_assert!(false, "acceptor failed: {f}"),
                }
            }
            let mut b = Vec::new();
            a.poll_transmit(&mut b);
            feed(&mut d, &b, &sizes);
            while let Some(e) = d.poll_event() {
                match e {
                    HandshakeEvent::Ready { peer, credit } => d_ready = Some((peer, credit)),
                    HandshakeEvent::Failed(f) => prop_assert!(false, "dialler failed: {f}"),
                    HandshakeEvent::Verified { .. } => prop_assert!(false, "a dialler never decides"),
                }
            }
        }
        prop_assert_eq!(d_ready, Some((aa, 1 << 20)));
        prop_assert_eq!(a_ready, Some((da, 1 << 20)));
    }

    /// Two ends over a network that cuts, drops, duplicates and reorders frames and lets time
    /// pass: never ready with a stranger, never a panic.
    #[test]
    fn handshakes_under_interference(data in prop::collection::vec(any::<u8>(), 0..200)) {
        fuzzing::handshake_pair(&data);
    }

    /// One end fed garbage: without the key nobody is verified; bounded buffering.
    #[test]
    fn a_handshake_fed_garbage(data in prop::collection::vec(any::<u8>(), 0..600)) {
        fuzzing::handshake(&data);
    }

    /// The connect/accept machine under arbitrary operations and messages.
    #[test]
    fn connect_machine_keeps_its_invariants(data in prop::collection::vec(any::<u8>(), 0..800)) {
        fuzzing::connect(&data);
    }

    /// The serving side of the host control channel under arbitrary packets.
    #[test]
    fn control_sessions_keep_their_invariants(data in prop::collection::vec(any::<u8>(), 0..800)) {
        fuzzing::control(&data);
    }

    /// Requests from several clients, their fragments interleaved, duplicated and some
    /// withdrawn: each one popped is exactly one that was sent and not withdrawn; and a dial
    /// whose peer goes away is answered `Closed`.
    #[test]
    fn interleaved_requests_are_reassembled_exactly(
        descs in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 1..6),
        withdraw in prop::collection::vec(any::<bool>(), 6),
        seed in any::<u64>(),
    ) {
        let now = Instant::now();
        let mut s: Handshakes<u32> = Handshakes::new(Limits::default());
        s.listen(true);
        // Every message of every client, in a shuffled but per-client order.
        let mut queues: Vec<Vec<connect::Payload>> = descs
            .iter()
            .enumerate()
            .map(|(i, d)| connect::encode_connect(i as u64, Duration::from_secs(30), d))
            .collect();
        let mut x = seed | 1;
        let mut pick = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
        while queues.iter().any(|q| !q.is_empty()) {
            let i = (pick() as usize) % queues.len();
            if queues[i].is_empty() { continue; }
            let m = queues[i].remove(0);
            s.handle_message(i as u32, &m, now);
            if pick() % 5 == 0 { s.handle_message(i as u32, &m, now); } // duplicated
        }
        for (i, w) in withdraw.iter().enumerate().take(descs.len()) {
            if *w { s.handle_message(i as u32, &connect::encode_close(i as u64), now); }
        }
        let mut got = std::collections::HashSet::new();
        while let Some(r) = s.pop_request(now) {
            prop_assert!(!withdraw[r.from as usize], "a withdrawn request was popped");
            prop_assert_eq!(&r.desc, &descs[r.from as usize]);
            prop_assert!(got.insert(r.from), "a request popped twice");
        }
        prop_assert_eq!(got.len(), withdraw.iter().take(descs.len()).filter(|w| !**w).count());

        let mut c: Handshakes<u32> = Handshakes::new(Limits::default());
        c.dial(9, 1, &[1, 2, 3], Duration::from_secs(1)).unwrap();
        c.peers_gone(|p| *p == 9);
        prop_assert_eq!(c.take_answer(1), Some(Answer::Closed));
    }
}

/// The checked-in fuzz corpus (real messages and the fuzzers' finds) through the harnesses.
#[test]
fn fuzz_corpus_replays() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    type Harness = fn(&[u8]);
    let targets: [(&str, Harness); 4] = [
        ("control", fuzzing::control),
        ("connect", fuzzing::connect),
        ("handshake", fuzzing::handshake),
        ("handshake_pair", fuzzing::handshake_pair),
    ];
    for (name, f) in targets {
        let dir = root.join(name);
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten() {
            f(&std::fs::read(e.path()).unwrap());
            n += 1;
        }
        assert!(n > 0, "the {name} corpus is empty");
    }
}

/// Seeds for the corpora: real messages in the harnesses' formats. Regenerate with
/// `CLAN_WRITE_CORPUS=1 cargo test -p clan-wire --test machines seed_corpus`.
#[test]
fn seed_corpus() {
    use clan_wire::Frame;
    use clan_wire::control::{EndpointId, Request};
    if std::env::var_os("CLAN_WRITE_CORPUS").is_none() {
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let write = |target: &str, name: &str, bytes: Vec<u8>| {
        let d = root.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), bytes).unwrap();
    };
    let nic: SocketAddr = "10.77.0.1:7000".parse().unwrap();
    let ep = EndpointId { nic, port: 3 };
    // control: [ctl][len][packet]…
    let packet = |ctl: u8, p: Vec<u8>| {
        let mut b = vec![ctl, p.len() as u8];
        b.extend_from_slice(&p);
        b
    };
    let hello = Request::Hello { nic, pid: 7 }.encode(1);
    let import = Request::Import { importer: ep, desc: vec![0x43; 100] }.encode(2);
    let oob = Request::Oob { from: ep, to_port: 1, payload: [1; 40], reply: true }.encode(3);
    let forged = Request::Oob {
        from: EndpointId { nic: "10.77.0.9:1".parse().unwrap(), port: 1 },
        to_port: 1,
        payload: [2; 40],
        reply: false,
    }
    .encode(4);
    write(
        "control",
        "hello_import_oob",
        [packet(4, hello.clone()), packet(0, import.clone()), packet(0, oob.clone())].concat(),
    );
    write("control", "forged_sender", [packet(4, hello.clone()), packet(0, forged)].concat());
    write("control", "before_hello", [packet(0, oob), packet(0, import), packet(8 | 0xf0, hello.clone())].concat());
    write("control", "with_fds", [packet(1, hello.clone()), packet(2, hello)].concat());
    // connect: ops
    write("connect", "send_pop", vec![1, 1, 2, 0, 2, 1, 2, 0]);
    write("connect", "withdraw", vec![1, 1, 3, 6, 5, 1, 3, 2, 1, 3]);
    write("connect", "gone_expire", vec![1, 2, 4, 3, 3, 2, 4, 0, 200, 2, 2, 4]);
    let mut raw = vec![0, 1, 0];
    raw.extend_from_slice(&connect::encode_connect(5, Duration::from_secs(1), &[9; 10])[0]);
    raw.extend_from_slice(&[2, 1, 5]);
    write("connect", "raw_connect", raw);
    // handshake: [mode][ctl][len][bytes]…
    let frame = |f: Frame<'_>| {
        let mut b = Vec::new();
        f.encode(&mut b);
        b
    };
    let hello_frame = |flags| {
        frame(Frame::Hello(clan_wire::Hello {
            version: clan_wire::frame::VERSION,
            flags,
            nic: "10.77.0.2:7000".parse().unwrap(),
            nonce: [1; 16],
            credit: 1 << 20,
        }))
    };
    let chunk = |ctl: u8, b: Vec<u8>| {
        let mut v = vec![ctl, b.len() as u8];
        v.extend_from_slice(&b);
        v
    };
    write("handshake", "acceptor_hello", [vec![0], chunk(3, hello_frame(0)), chunk(2 | 8, vec![])].concat());
    write(
        "handshake",
        "keyed_acceptor",
        [vec![1], chunk(3, hello_frame(1)), chunk(3, frame(Frame::Auth([7; 32])))].concat(),
    );
    write("handshake", "dialler", [vec![2], chunk(3, hello_frame(0)), chunk(3, frame(Frame::Welcome))].concat());
    write(
        "handshake",
        "keyed_dialler",
        [vec![3], chunk(3, hello_frame(1)), chunk(3, frame(Frame::Auth([7; 32])))].concat(),
    );
    write(
        "handshake",
        "closed",
        [vec![2], chunk(3, frame(Frame::Close { status: clan_wire::Status::Duplicate }))].concat(),
    );
    // handshake_pair: [mode][ctl]…
    write("handshake_pair", "clean", vec![0; 16]);
    write("handshake_pair", "clean_keyed", [vec![1], vec![0; 16]].concat());
    write("handshake_pair", "dup_and_reorder", vec![1, 0x20, 0x21, 0x30, 0, 1, 0, 1, 0, 1]);
    write("handshake_pair", "cut", vec![0, 0, 0x40, 0, 1]);
}
