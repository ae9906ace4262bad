//! Links between NICs, in one process over loopback TCP (LocalTransport::Link makes two NICs
//! of this host talk exactly as two hosts would).

mod util;

use std::time::Duration;

use clan::{
    AccessError, Event, ImportError, LocalTransport, Nic, NicConfig, PeerIdentity, Progress, Rights, TripwireConfig,
};
use util::Watchdog;

fn nic() -> Nic {
    Nic::open(NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }).expect("open NIC")
}

#[test]
fn write_read_and_wake_across_a_link() {
    let _wd = Watchdog::new("link basic", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(1 << 16).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).event(7)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    tw.arm().unwrap();
    m.write(64, b"over the link").unwrap();
    m.store_u64(0, 42).unwrap();
    while ap.load_u64(0).unwrap() != 42 {
        tw.wait(Some(Duration::from_secs(30))).unwrap();
    }
    let mut buf = [0u8; 13];
    ap.read(64, &mut buf).unwrap();
    assert_eq!(&buf, b"over the link");
    assert!(matches!(ea.event_queue().wait(Some(Duration::from_secs(30))), Ok(Event::Tripwire { cookie: 7, .. })));
    // Reads are request/response.
    ap.write(1000, b"exporter data").unwrap();
    let mut r = [0u8; 13];
    m.read(1000, &mut r).unwrap();
    assert_eq!(&r, b"exporter data");
    assert_eq!(m.load_u64(0).unwrap(), 42);
    // Asynchronous read with a completion event.
    let p = m.read_async(1000, 13, Some((eb.event_queue(), 99))).unwrap();
    assert_eq!(p.wait(Some(Duration::from_secs(30))).unwrap(), b"exporter data");
    assert!(matches!(eb.event_queue().wait(Some(Duration::from_secs(30))), Ok(Event::ReadComplete { token: 99 })));
    // A large write, split into bursts, with a barrier.
    let big: Vec<u8> = (0..(1 << 16) - 4096).map(|i| (i * 31 % 251) as u8).collect();
    m.write(4096, &big).unwrap();
    m.barrier().unwrap();
    let mut back = vec![0u8; big.len()];
    ap.read(4096, &mut back).unwrap();
    assert!(back == big, "bulk data arrived intact");
}

#[test]
fn bounds_rights_and_stale_descriptors_across_a_link() {
    let _wd = Watchdog::new("link checks", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(8192).unwrap();
    let ro = eb.import(&ap.descriptor().derive(4096, 4096, Rights::READ).unwrap()).unwrap();
    assert_eq!(ro.write(0, b"x"), Err(AccessError::NotWritable));
    assert!(matches!(ro.write(4096, b"x"), Err(AccessError::NotWritable)));
    assert!(matches!(ro.read(4090, &mut [0; 8]), Err(AccessError::OutOfBounds { .. })));
    let mut bytes = ap.descriptor().derive(0, 4096, Rights::READ).unwrap().to_bytes();
    let at = bytes.len() - 17;
    bytes[at] = 3;
    let forged = clan::Descriptor::from_bytes(&bytes).unwrap();
    assert!(matches!(eb.import(&forged), Err(ImportError::BadKey)));
    let rw = eb.import(&ap.descriptor()).unwrap();
    rw.store_u64(0, 1).unwrap();
    rw.barrier().unwrap();
    let desc = ap.descriptor();
    drop(ap);
    // The next write is refused by the exporter; the refusal comes back; then the mapping is stale.
    let _ = rw.store_u64(0, 2);
    let _ = rw.barrier();
    assert_eq!(rw.store_u64(0, 3), Err(AccessError::Revoked));
    assert!(!rw.is_live());
    assert!(matches!(eb.import(&desc), Err(ImportError::Revoked { .. })));
}

#[test]
fn out_of_band_and_connections_across_a_link() {
    let _wd = Watchdog::new("link conns", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let server = a.endpoint().unwrap();
    let client = b.endpoint().unwrap();
    client.send_oob(server.addr(), b"hi there").unwrap();
    let m = server.wait_oob(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(m.from, client.addr());
    assert_eq!(&m.payload[..8], b"hi there");
    server.listen();
    let s_ap = server.export(4096).unwrap();
    let c_ap = client.export(4096).unwrap();
    let c_desc = c_ap.descriptor();
    let to = server.addr();
    let t = std::thread::spawn(move || client.connect(to, &c_desc, Some(Duration::from_secs(30))).map(|c| (c, client)));
    let req = server.accept(Some(Duration::from_secs(30))).unwrap();
    let conn = req.accept(&server, &s_ap.descriptor()).unwrap();
    let (cconn, client) = t.join().unwrap().unwrap();
    assert_eq!(cconn.peer_descriptor(), &s_ap.descriptor());
    assert_eq!(conn.peer(), client.addr());
    // Across a link, each side knows the other by its NIC only (no kernel credentials).
    let lo = std::net::IpAddr::from([127, 0, 0, 1]);
    assert_eq!(conn.peer_identity(), PeerIdentity::Remote { nic: b.addr(), source: lo });
    assert_eq!(cconn.peer_identity(), PeerIdentity::Remote { nic: a.addr(), source: lo });
    assert_eq!(conn.peer_identity().uid(), None);
    // The client closes: the server sees a disconnect event carrying the token.
    let token = conn.token();
    drop(cconn);
    loop {
        match server.event_queue().wait(Some(Duration::from_secs(30))).unwrap() {
            Event::Disconnect { token: t, .. } if t == token => break,
            _ => {}
        }
    }
    assert!(!conn.is_alive());
}

#[test]
fn manual_progress() {
    let _wd = Watchdog::new("manual progress", Duration::from_secs(60));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let b = nic();
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    // With manual progress the importer must drive its own link too while it waits.
    let m = eb.import(&ap.descriptor()).unwrap();
    m.store_u64(0, 5).unwrap();
    let start = std::time::Instant::now();
    while ap.load_u64(0).unwrap() != 5 {
        a.progress();
        assert!(start.elapsed() < Duration::from_secs(30));
    }
}

/// A spinning waiter applies what came over a link itself (`Tripwire::drive_links`), with
/// manual progress (nobody else would) — gathered bursts included: a write and the word
/// behind it, sent as one, land in order.
#[test]
fn a_spinning_waiter_drives_the_link_itself() {
    let _wd = Watchdog::new("drive_links", Duration::from_secs(60));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let b = nic();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = ea.export(8192).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    for round in 1..=50u64 {
        let body: Vec<u8> = (0..100 + round as usize).map(|i| (i as u64 * 3 + round) as u8).collect();
        m.write_then_store_u64(64, &body, 0, round).unwrap();
        let start = std::time::Instant::now();
        while ap.load_u64(0).unwrap() != round {
            tw.drive_links();
            assert!(start.elapsed() < Duration::from_secs(30), "round {round}: nothing applied");
        }
        // The word came after the body: the body is complete.
        let mut got = vec![0u8; body.len()];
        ap.read(64, &mut got).unwrap();
        assert_eq!(got, body, "round {round}");
    }
    // Without links to drive, nothing happens and nothing fails.
    let c = nic();
    let ce = c.endpoint().unwrap();
    let local = ce.export(4096).unwrap();
    let ltw = local.tripwire(TripwireConfig::writes(0..8)).unwrap();
    assert!(!ltw.drive_links());
}

/// The shapes the protocols send on every small write, a body and the word behind it (a
/// stream) and a body, its lead word and the word (a message-queue slot), come over a link as
/// separate bursts and are applied together, as the exporter's own write of that shape: the
/// memory ends as burst by burst, a tripwire inside the body and one on each word fire, and
/// a transfer to an aperture unexported meanwhile is refused as a lone burst is.
#[test]
fn a_body_and_its_words_land_together_with_their_tripwires() {
    let _wd = Watchdog::new("bodies and words over a link", Duration::from_secs(60));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let b = nic();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = ea.export(8192).unwrap();
    let in_body = ap.tripwire(TripwireConfig::writes(100..110).event(1)).unwrap();
    let flag = ap.tripwire(TripwireConfig::writes(0..8).event(2)).unwrap();
    let lead = ap.tripwire(TripwireConfig::writes(4096..4104).event(3)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    let spin_until = |what: &str, done: &dyn Fn() -> bool| {
        let start = std::time::Instant::now();
        while !done() {
            flag.drive_links();
            assert!(start.elapsed() < Duration::from_secs(30), "{what}: nothing applied");
        }
    };
    for round in 1..=40u64 {
        for tw in [&in_body, &flag, &lead] {
            tw.arm().unwrap();
        }
        let body: Vec<u8> = (0..64 + round as usize).map(|i| (i as u64 * 7 + round) as u8).collect();
        m.write_then_store_u64(64, &body, 0, round).unwrap();
        spin_until("body and word", &|| ap.load_u64(0).unwrap() == round);
        let mut got = vec![0u8; body.len()];
        ap.read(64, &mut got).unwrap();
        assert_eq!(got, body, "round {round}: the body is whole once its word is there");
        // A slot: lead word at 4096, body from 4104, then the word at 8.
        m.write_led_then_store_u64(4096, round << 8, &body, 8, round).unwrap();
        spin_until("slot", &|| ap.load_u64(8).unwrap() == round);
        assert_eq!(ap.load_u64(4096).unwrap(), round << 8, "round {round}: the lead is there");
        ap.read(4104, &mut got).unwrap();
        assert_eq!(got, body, "round {round}: the slot's body is whole");
        for tw in [&in_body, &flag, &lead] {
            assert!(tw.take_fired(), "round {round}: a tripwire over what came did not fire");
        }
    }
    // Refused once the aperture is gone, then stale, as a lone burst is.
    let other = ea.export(4096).unwrap();
    let m2 = eb.import(&other.descriptor()).unwrap();
    m2.write_then_store_u64(64, b"first", 0, 1).unwrap();
    spin_until("first", &|| other.load_u64(0).unwrap() == 1);
    drop(other);
    let _ = m2.write_then_store_u64(64, b"second", 0, 2);
    let start = std::time::Instant::now();
    while m2.write_then_store_u64(64, b"third", 0, 3) != Err(AccessError::Revoked) {
        flag.drive_links();
        assert!(start.elapsed() < Duration::from_secs(30), "the refusal never came back");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!m2.is_live());
}

/// Read tripwires across a link: the exporter's read tripwire fires when a remote importer
/// reads the watched bytes (they left through the exporter's NIC) — a PIO read and a DMA
/// read alike — and not when a read misses them. Both NICs busy-poll their links, and the
/// traffic keeps flowing after idle gaps longer than the busy window (the engine went back
/// to sleeping in epoll and woke again).
#[test]
fn read_tripwires_fire_across_a_link_with_busy_polling() {
    let _wd = Watchdog::new("read tripwire over a link", Duration::from_secs(120));
    let busy = || {
        Nic::open(NicConfig {
            local_transport: LocalTransport::Link,
            progress: Progress::BusyPoll(Duration::from_micros(300)),
            ..NicConfig::default()
        })
        .unwrap()
    };
    let (a, b) = (busy(), busy());
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = ea.export(8192).unwrap();
    ap.write(4096, b"watched!").unwrap();
    let reads = ap.tripwire(TripwireConfig::reads(4096..4104).event(3)).unwrap();
    let writes = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    let fired = |want: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while reads.count() < want {
            assert!(std::time::Instant::now() < deadline, "the read tripwire did not fire ({want})");
            std::thread::sleep(Duration::from_micros(200));
        }
    };

    // A read that misses the watched bytes fires nothing; one that covers part of them does.
    let mut buf = vec![0u8; 256];
    m.read(0, &mut buf).unwrap();
    m.read(4104, &mut buf).unwrap();
    m.read(4000, &mut buf).unwrap();
    assert_eq!(&buf[96..104], b"watched!");
    fired(1);
    // Reads never fire write tripwires, nor did anything fire twice.
    assert_eq!((reads.count(), writes.count()), (1, 0));
    let mut saw = 0;
    while let Some(e) = ea.event_queue().try_take() {
        if let Event::Tripwire { cookie: 3, .. } = e {
            saw += 1;
        }
    }
    assert_eq!(saw, 1, "one event for the one firing");

    // A DMA read from the remote mapping fires it too.
    let local = eb.export(8192).unwrap();
    eb.dma_read(&m, 4096, &local, 0, 8, clan::DmaOptions::new()).unwrap().wait(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(local.load_u64(0).unwrap(), u64::from_le_bytes(*b"watched!"));
    fired(2);

    // Ping-pong across idle gaps longer than the busy window: every store lands.
    let back = eb.export(4096).unwrap();
    let mb = ea.import(&back.descriptor()).unwrap();
    for round in 1..=50u64 {
        if round % 10 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        m.store_u64(0, round).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while ap.load_u64(0).unwrap() != round {
            assert!(std::time::Instant::now() < deadline, "store {round} never landed");
            std::hint::spin_loop();
        }
        mb.store_u64(0, round).unwrap();
        while back.load_u64(0).unwrap() != round {
            assert!(std::time::Instant::now() < deadline, "reply {round} never landed");
            std::hint::spin_loop();
        }
    }
    // The tripwire fires as the engine applies the store, and its count is raised just
    // after the data is visible: the 50th may still be on its way when the store is seen.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while writes.count() < 50 {
        assert!(std::time::Instant::now() < deadline, "write tripwire fired {} of 50", writes.count());
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(writes.count(), 50, "one firing per store");
    std::thread::sleep(Duration::from_millis(5));
    m.read(4096, &mut buf[..8]).unwrap();
    fired(3);
}

/// A thread that spins on a link with the engine's progress takes the link's traffic over
/// (`Tripwire::spin_links`): the engine parks the link rather than be woken for it, and
/// listens again when the spinning stops: at once when the spinner goes to sleep, else after
/// its periodic look (a thread that neither spins nor sleeps in a wait must still get what
/// arrives). A thread asleep in a wait drives the link itself. Nothing that arrives is ever
/// left unapplied.
#[test]
fn a_spinning_thread_takes_the_link_over_and_gives_it_back() {
    let _wd = Watchdog::new("link parking", Duration::from_secs(120));
    let (a, b) = (nic(), nic());
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = ea.export(8192).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    let mut round = 0u64;
    // Spin until the engine parks the link; every round arrives meanwhile.
    let spin_until_parked = |round: &mut u64| {
        let parks = a.stats().link_parks;
        let spin = tw.spin_links();
        let start = std::time::Instant::now();
        loop {
            *round += 1;
            m.write_then_store_u64(64, &round.to_le_bytes(), 0, *round).unwrap();
            while ap.load_u64(0).unwrap() != *round {
                spin.drive();
                assert!(start.elapsed() < Duration::from_secs(60), "round {round}: nothing applied");
            }
            let mut body = [0u8; 8];
            ap.read(64, &mut body).unwrap();
            assert_eq!(u64::from_le_bytes(body), *round);
            if a.stats().link_parks > parks {
                return spin;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "the engine never parked the link");
        }
    };
    // Arrives while this thread only looks at memory now and then.
    let arrives_unattended = |round: &mut u64| {
        *round += 1;
        m.store_u64(0, *round).unwrap();
        let start = std::time::Instant::now();
        while ap.load_u64(0).unwrap() != *round {
            std::thread::sleep(Duration::from_micros(100));
            assert!(start.elapsed() < Duration::from_secs(60), "round {round}: nothing applied");
        }
    };
    // 1. The spinner just stops (the thread computes): the engine's periodic look.
    drop(spin_until_parked(&mut round));
    arrives_unattended(&mut round);
    // 2. Parked again (so it had listened again), and the spinner says it goes to sleep.
    spin_until_parked(&mut round).sleep();
    arrives_unattended(&mut round);
    // 3. A thread asleep in a wait (no spinning) gets what arrives, over and over.
    drop(spin_until_parked(&mut round));
    for _ in 0..50 {
        tw.arm().unwrap();
        round += 1;
        m.store_u64(0, round).unwrap();
        while ap.load_u64(0).unwrap() != round {
            tw.wait_spin(Duration::ZERO, Some(Duration::from_secs(60))).expect("applied");
        }
    }
    arrives_unattended(&mut round);
    assert!(a.stats().link_parks >= 3);
}

/// Two threads asleep on one queue (one sleeps on the link's socket and applies what comes,
/// the other on its own word): each is woken for its own word, whichever comes first.
#[test]
fn threads_asleep_on_one_queue_are_woken_for_what_comes_over_a_link() {
    sleepers_on_one_queue(Progress::Engine);
}

/// The same with manual progress: the leader drives the link for both.
#[test]
fn threads_asleep_on_one_queue_are_woken_for_what_comes_over_a_link_with_manual_progress() {
    sleepers_on_one_queue(Progress::Manual);
}

fn sleepers_on_one_queue(progress: Progress) {
    let _wd = Watchdog::new("link sleepers", Duration::from_secs(120));
    let a = Nic::open(NicConfig { local_transport: LocalTransport::Link, progress, ..NicConfig::default() }).unwrap();
    let b = nic();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = std::sync::Arc::new(ea.export(8192).unwrap());
    let m = eb.import(&ap.descriptor()).unwrap();
    let rounds = 40u64;
    let waiter = |at: u64| {
        let ap = ap.clone();
        std::thread::spawn(move || {
            let tw = ap.tripwire(TripwireConfig::writes(at..at + 8)).unwrap();
            for r in 1..=rounds {
                tw.arm().unwrap();
                while ap.load_u64(at).unwrap() < r {
                    tw.wait_spin(Duration::ZERO, Some(Duration::from_secs(60))).expect("woken");
                }
            }
        })
    };
    let (w0, w1) = (waiter(0), waiter(1024));
    for r in 1..=rounds {
        // Both asleep (most of the time), then one word, then the other, in turns.
        std::thread::sleep(Duration::from_millis(2));
        let (first, second) = if r % 2 == 0 { (0, 1024) } else { (1024, 0) };
        m.store_u64(first, r).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        m.store_u64(second, r).unwrap();
    }
    w0.join().unwrap();
    w1.join().unwrap();
}

#[test]
fn a_remote_peer_is_known_by_where_its_link_comes_from_not_by_its_claim() {
    let _wd = Watchdog::new("link identity", Duration::from_secs(60));
    let server = nic();
    // A NIC that names itself 127.0.0.2 and dials from the kernel's choice of source.
    let client = Nic::open(NicConfig {
        ip: std::net::IpAddr::from([127, 0, 0, 2]),
        local_transport: LocalTransport::Link,
        ..NicConfig::default()
    })
    .unwrap();
    let listener = server.endpoint().unwrap();
    listener.listen();
    let ep = client.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let d = ap.descriptor();
    let to = listener.addr();
    let t = std::thread::spawn(move || ep.connect(to, &d, Some(Duration::from_secs(30))).map(|c| (c, ep)));
    let req = listener.accept(Some(Duration::from_secs(30))).unwrap();
    let PeerIdentity::Remote { nic, source } = req.peer_identity() else { panic!("{}", req.peer_identity()) };
    eprintln!("claimed {nic}, came from {source}");
    // (Loopback's preferred source address is 127.0.0.1: the kernel's word, not the claim.)
    assert_eq!((nic, source), (client.addr(), std::net::IpAddr::from([127, 0, 0, 1])));
    let sap = listener.export(4096).unwrap();
    let _conn = req.accept(&listener, &sap.descriptor()).unwrap();
    let (cconn, _ep) = t.join().unwrap().unwrap();
    assert_eq!(cconn.peer_identity(), PeerIdentity::Remote { nic: server.addr(), source: server.addr().ip() });
}

/// With manual progress and a link open, a thread blocked on a tripwire sleeps on the link's
/// socket and its queue's kick together (as the queue's leader): it does not wake to look
/// again (it napped a millisecond at a time), yet what comes over the link and a write by
/// another NIC of this host through shared memory wake it.
/// A thread blocked in `accept` with manual progress sleeps until something comes: first
/// with no link open (on its eventfd alone), then on the link a client opens meanwhile, and
/// it is woken both by a request over that link and by one from this host's engine.
#[test]
fn a_manual_progress_accept_sleeps_until_a_request_comes() {
    let _wd = Watchdog::new("manual accept", Duration::from_secs(120));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let server = a.endpoint().unwrap();
    server.listen();
    let to = server.addr();
    let (tx, rx) = std::sync::mpsc::channel();
    let acceptor = std::thread::spawn(move || {
        tx.send(rustix::thread::gettid().as_raw_nonzero().get()).unwrap();
        let inbox = server.export(4096).unwrap();
        let mut conns = Vec::new();
        for _ in 0..2 {
            let req = server.accept(Some(Duration::from_secs(60))).expect("a request");
            conns.push(req.accept(&server, &inbox.descriptor()).unwrap());
        }
        (conns, server)
    });
    let tid = rx.recv().unwrap();
    let status = || std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let asleep = || {
        // Bounded: the watchdog ends a test whose acceptor never sleeps.
        while !status().lines().any(|l| l.starts_with("State:") && l.contains("S (sleeping)")) {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let switches = || {
        status()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:").map(|v| v.trim().parse::<u64>().unwrap()))
            .unwrap()
    };
    let idle = |what: &str| {
        asleep();
        let before = switches();
        std::thread::sleep(Duration::from_millis(300));
        let woke = switches() - before;
        // A thread napping 100 µs at a time wakes about 3000 times here.
        assert!(woke <= 20, "the acceptor woke {woke} times in 300 ms with nothing to do ({what})");
    };
    idle("no link open");
    // A client across a link (its NIC reaches this host's NICs over TCP, as other hosts').
    let b = nic();
    let eb = b.endpoint().unwrap();
    let mine = eb.export(4096).unwrap();
    let over_link = eb.connect(to, &mine.descriptor(), Some(Duration::from_secs(60))).expect("connect over a link");
    std::thread::sleep(Duration::from_millis(20));
    idle("a link open");
    // A client of this host that reaches it through its engine, not over a link.
    let c = Nic::open_default().unwrap();
    let ec = c.endpoint().unwrap();
    let theirs = ec.export(4096).unwrap();
    let local = ec.connect(to, &theirs.descriptor(), Some(Duration::from_secs(60))).expect("connect from this host");
    let (conns, _server) = acceptor.join().unwrap();
    assert_eq!(conns.len(), 2);
    assert!(over_link.is_alive() && local.is_alive());
}

/// A waiter with manual progress and many links (more than the 16 a sleep used to listen
/// to) sleeps on all of them without napping, and is woken by a write over any.
#[test]
fn a_manual_progress_waiter_sleeps_on_many_links() {
    const LINKS: usize = 24;
    let _wd = Watchdog::new("manual sleeper, many links", Duration::from_secs(120));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let ea = a.endpoint().unwrap();
    let ap = std::sync::Arc::new(ea.export(4096).unwrap());
    // One link from each of as many NICs: each imports over its own.
    let peers: Vec<(Nic, clan::Mapping)> = (0..LINKS)
        .map(|_| {
            let n = nic();
            let m = n.endpoint().unwrap().import(&ap.descriptor()).unwrap();
            assert!(m.is_remote());
            (n, m)
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let w = {
        let ap = ap.clone();
        std::thread::spawn(move || {
            let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
            tx.send(rustix::thread::gettid().as_raw_nonzero().get()).unwrap();
            for want in 1..=2u64 {
                while ap.load_u64(0).unwrap() < want {
                    tw.wait_spin(Duration::ZERO, Some(Duration::from_secs(60))).expect("woken over a link");
                }
            }
        })
    };
    let tid = rx.recv().unwrap();
    let status = || std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let asleep = || {
        // Bounded: the watchdog ends a test whose waiter never sleeps.
        while !status().lines().any(|l| l.starts_with("State:") && l.contains("S (sleeping)")) {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let switches = || {
        status()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:").map(|v| v.trim().parse::<u64>().unwrap()))
            .unwrap()
    };
    asleep();
    let before = switches();
    std::thread::sleep(Duration::from_millis(300));
    let woke = switches() - before;
    // A thread napping a millisecond at a time wakes about 300 times here; the links'
    // keepalives (every 250 ms each, when nothing else moves) a few times (6-7 seen).
    assert!(woke <= 40, "the waiter woke {woke} times in 300 ms with nothing to do");
    // Over the last link, then over the first.
    peers[LINKS - 1].1.store_u64(0, 1).unwrap();
    while ap.load_u64(0).unwrap() < 1 {
        std::thread::sleep(Duration::from_millis(1));
    }
    asleep();
    peers[0].1.store_u64(0, 2).unwrap();
    w.join().unwrap();
}

/// A thread driving many links (`Nic::progress`, as every spinning wait does) asks which
/// have bytes and reads those only: polling quiet links costs no receive calls.
#[test]
fn driving_many_links_reads_only_those_with_bytes() {
    const LINKS: usize = 24;
    let _wd = Watchdog::new("driving many links", Duration::from_secs(120));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let ea = a.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    let peers: Vec<(Nic, clan::Mapping)> = (0..LINKS)
        .map(|_| {
            let n = nic();
            let m = n.endpoint().unwrap().import(&ap.descriptor()).unwrap();
            (n, m)
        })
        .collect();
    assert_eq!(a.stats().links, LINKS as u64);
    let before = a.stats().link_empty_receives;
    for _ in 0..1000 {
        a.progress();
    }
    let empty = a.stats().link_empty_receives - before;
    // One receive call per link per poll would be 24 000.
    assert!(empty <= 200, "{empty} receive calls found nothing in 1000 polls of {LINKS} quiet links");
    // What comes on any of them is still read.
    for (i, (_, m)) in peers.iter().enumerate().rev() {
        m.store_u64(0, i as u64 + 1).unwrap();
        while ap.load_u64(0).unwrap() != i as u64 + 1 {
            a.progress();
            std::thread::yield_now();
        }
    }
}

#[test]
fn a_manual_progress_waiter_sleeps_on_its_link_without_napping() {
    let _wd = Watchdog::new("manual sleeper", Duration::from_secs(120));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let b = nic();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = std::sync::Arc::new(ea.export(4096).unwrap());
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    let (tx, rx) = std::sync::mpsc::channel();
    let w = {
        let ap = ap.clone();
        std::thread::spawn(move || {
            let from_link = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
            let local = ap.tripwire(TripwireConfig::writes(8..16)).unwrap();
            tx.send(rustix::thread::gettid().as_raw_nonzero().get()).unwrap();
            while ap.load_u64(0).unwrap() == 0 {
                from_link.wait_spin(Duration::ZERO, Some(Duration::from_secs(60))).expect("woken by the link");
            }
            while ap.load_u64(8).unwrap() == 0 {
                local.wait_spin(Duration::ZERO, Some(Duration::from_secs(60))).expect("woken by a local firing");
            }
        })
    };
    let tid = rx.recv().unwrap();
    let status = || std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let asleep = || {
        // Bounded: the watchdog ends a test whose waiter never sleeps.
        while !status().lines().any(|l| l.starts_with("State:") && l.contains("S (sleeping)")) {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let switches = || {
        status()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:").map(|v| v.trim().parse::<u64>().unwrap()))
            .unwrap()
    };
    asleep();
    let before = switches();
    std::thread::sleep(Duration::from_millis(300));
    let woke = switches() - before;
    // A thread napping a millisecond at a time wakes about 300 times here.
    assert!(woke <= 20, "the waiter woke {woke} times in 300 ms with nothing to do");
    m.store_u64(0, 1).unwrap();
    // Its second wait, on a tripwire this process fires.
    while ap.load_u64(0).unwrap() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    asleep();
    // A write through shared memory by another NIC of this host (as another process's
    // would be): snooped there, and announced through its port of our queue.
    let c = Nic::open_default().unwrap();
    let local = c.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    assert!(!local.is_remote());
    local.store_u64(8, 1).unwrap();
    w.join().unwrap();
}

/// An OOB wait with manual progress reads the links itself (nobody else does), and sleeps
/// until a message comes: over a link, or from this host through the engine.
#[test]
fn a_manual_progress_oob_wait_reads_its_links_and_sleeps_between() {
    let _wd = Watchdog::new("manual oob", Duration::from_secs(120));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let ea = a.endpoint().unwrap();
    let to = ea.addr();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        tx.send(rustix::thread::gettid().as_raw_nonzero().get()).unwrap();
        let got: Vec<Vec<u8>> = (0..2)
            .map(|_| ea.wait_oob(Some(Duration::from_secs(60))).expect("a message").payload[..5].to_vec())
            .collect();
        got
    });
    let tid = rx.recv().unwrap();
    let status = || std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    while !status().lines().any(|l| l.starts_with("State:") && l.contains("S (sleeping)")) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let switches = || {
        status()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:").map(|v| v.trim().parse::<u64>().unwrap()))
            .unwrap()
    };
    let before = switches();
    std::thread::sleep(Duration::from_millis(300));
    let woke = switches() - before;
    assert!(woke <= 20, "the waiter woke {woke} times in 300 ms with nothing to do");
    // Over a link (its NIC reaches this host's NICs over TCP), then from this host.
    let b = nic();
    b.endpoint().unwrap().send_oob(to, b"link!").expect("sent over a link");
    let c = Nic::open_default().unwrap();
    c.endpoint().unwrap().send_oob(to, b"local").expect("sent from this host");
    let got = waiter.join().unwrap();
    assert!(got.contains(&b"link!".to_vec()) && got.contains(&b"local".to_vec()), "{got:?}");
}

/// A thread asleep on its queue as the leader, with one link and no ports, sleeps in the
/// link socket's own `recv` (`NicConfig::wake_signal`): the peer's bytes wake it with them,
/// a firing in this process ends the `recv` with the wake signal, and a port given to
/// another process's NIC meanwhile sends it back to epoll, where it hears that port.
#[test]
fn a_leader_asleep_in_its_links_recv_is_woken_from_the_link_and_from_here() {
    let _wd = Watchdog::new("leader asleep in recv", Duration::from_secs(120));
    let (a, b) = (nic(), nic());
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = std::sync::Arc::new(ea.export(4096).unwrap());
    let remote = eb.import(&ap.descriptor()).unwrap();
    assert!(remote.is_remote());
    // Another endpoint of this NIC: its stores are this process's, snooped here.
    let here = a.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    assert!(!here.is_remote());
    const ROUNDS: u64 = 6;
    let (tx, rx) = std::sync::mpsc::channel();
    let w = {
        let ap = ap.clone();
        std::thread::spawn(move || {
            tx.send(rustix::thread::gettid().as_raw_nonzero().get() as u64).unwrap();
            // Word 0 from the link, words 1..=ROUNDS from this process, the last from a port.
            for i in 0..=ROUNDS + 1 {
                let tw = ap.tripwire(TripwireConfig::writes(i * 8..i * 8 + 8)).unwrap();
                while ap.load_u64(i * 8).unwrap() == 0 {
                    tw.wait(Some(Duration::from_secs(60))).expect("woken");
                }
                tx.send(i).unwrap();
            }
        })
    };
    let tid = rx.recv().unwrap();
    let sleeping = || {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
            .unwrap()
            .lines()
            .any(|l| l.starts_with("State:") && l.contains("S (sleeping)"))
    };
    // Asleep in `recv` (a sleep counted since `since`, and the thread asleep now). Bounded
    // by the watchdog.
    let asleep_in_recv = |since: u64| {
        while a.stats().link_recv_sleeps <= since || !sleeping() {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    asleep_in_recv(0);
    remote.store_u64(0, 1).unwrap();
    assert_eq!(rx.recv().unwrap(), 0);
    let mut interrupts = Vec::new();
    for i in 1..=ROUNDS {
        asleep_in_recv(a.stats().link_recv_sleeps);
        let before = a.stats().link_recv_interrupts;
        here.store_u64(i * 8, 1).unwrap();
        assert_eq!(rx.recv().unwrap(), i);
        interrupts.push(a.stats().link_recv_interrupts - before);
    }
    // (a round whose wake landed between two sleeps is woken by its re-check instead)
    assert!(interrupts.iter().any(|n| *n > 0), "no local wake ended a sleep in recv: {interrupts:?}");
    // The interrupted sleeps left the socket blocking again: idle, the leader sleeps whole
    // receive timeouts (a second each here), not a `recv` that returns at once in a loop.
    asleep_in_recv(a.stats().link_recv_sleeps);
    let before = a.stats().link_recv_sleeps;
    std::thread::sleep(Duration::from_millis(300));
    let slept = a.stats().link_recv_sleeps - before;
    assert!(slept <= 10, "{slept} sleeps in recv in 300 ms of nothing: the socket stayed non-blocking");
    // A write through shared memory by another NIC of this host, as another process's would
    // be: announced through its port of our queue, which the leader now sleeps on in epoll.
    asleep_in_recv(a.stats().link_recv_sleeps);
    let c = Nic::open_default().unwrap();
    let other = c.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    assert!(!other.is_remote());
    other.store_u64((ROUNDS + 1) * 8, 1).unwrap();
    w.join().unwrap();
}

/// With `wake_signal` off, a leader never sleeps in a link's `recv`, and is woken all the same.
#[test]
fn without_the_wake_signal_a_leader_sleeps_in_epoll() {
    let _wd = Watchdog::new("leader in epoll", Duration::from_secs(60));
    let a = Nic::open(NicConfig { local_transport: LocalTransport::Link, wake_signal: false, ..NicConfig::default() })
        .unwrap();
    let b = nic();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let ap = ea.export(4096).unwrap();
    let remote = eb.import(&ap.descriptor()).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            remote.store_u64(0, 1).unwrap();
        });
        while ap.load_u64(0).unwrap() == 0 {
            tw.wait(Some(Duration::from_secs(30))).unwrap();
        }
    });
    assert_eq!(a.stats().link_recv_sleeps, 0);
}
