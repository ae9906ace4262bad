//! Event queues and out-of-band messages within one process.

mod util;

use std::os::fd::AsFd;
use std::time::Duration;

use clan::{
    EndpointAddr, EndpointConfig, Event, EventQueueConfig, EventQueueError, Nic, NicConfig, OobError, TripwireConfig,
};
use util::Watchdog;

fn nic() -> Nic {
    Nic::open(NicConfig::default()).expect("open NIC")
}

fn readable(q: &impl AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(q, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap() > 0
}

#[test]
fn take_poll_and_wait() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    assert_eq!(q.try_take(), None);
    assert!(q.post_user(1));
    assert!(q.post_user(2));
    assert_eq!(q.try_take(), Some(Event::User(1)));
    let mut v = Vec::new();
    assert_eq!(q.poll(&mut v, 8), 1);
    assert_eq!(v, vec![Event::User(2)]);
    assert!(matches!(q.wait(Some(Duration::from_millis(5))), Err(EventQueueError::Timeout)));
    let q2 = q.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        q2.post_user(3);
    });
    assert_eq!(q.wait(Some(Duration::from_secs(30))).unwrap(), Event::User(3));
    t.join().unwrap();
}

#[test]
fn overflow_is_reported_never_silent() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig { ring_capacity: 4, ..EventQueueConfig::default() }).unwrap();
    let ep = nic.endpoint_with(EndpointConfig { queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).event(5)).unwrap();
    for i in 0..10 {
        m.store_u64(0, i).unwrap();
    }
    let mut tripwire_events = 0;
    let mut lost = 0;
    while let Some(ev) = q.try_take() {
        match ev {
            Event::Tripwire { cookie: 5, .. } => tripwire_events += 1,
            Event::Overflow { lost: n } => lost += n,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((tripwire_events, lost), (4, 6));
    assert_eq!(q.stats().lost, 6);
    assert_eq!(tw.count(), 10, "the counter action is not subject to the ring");
}

#[test]
fn file_descriptor_is_readable_while_events_are_pending_after_arming() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    assert!(q.arm(), "empty queue: safe to sleep");
    assert!(!readable(&q));
    q.post_user(1);
    assert!(readable(&q));
    assert!(readable(&q), "stays readable until taken and re-armed");
    assert_eq!(q.try_take(), Some(Event::User(1)));
    assert!(q.arm());
    assert!(!readable(&q));
    // Arming with events pending reports it and leaves the descriptor readable.
    q.post_user(2);
    q.post_user(3);
    assert_eq!(q.try_take(), Some(Event::User(2)));
    assert!(!q.arm());
    assert!(readable(&q));
}

/// Arming again with nothing new since the last arm costs no reset (`EventQueue::arm`'s
/// quick path), and changes nothing a sleeper can see: the descriptor stays quiet, the next
/// post (ours, or a port's from another NIC) still makes it readable, and events found at
/// arming leave it readable however often it is armed.
#[test]
fn arming_again_with_nothing_new_keeps_every_wake_up() {
    let (a, b) = (nic(), nic());
    let q = a.event_queue(EventQueueConfig::default()).unwrap();
    let ep = a.endpoint_with(EndpointConfig { queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let _tw = ap.tripwire(TripwireConfig::writes(0..8).event(9)).unwrap();
    let m = b.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    for round in 0..3u64 {
        for _ in 0..3 {
            assert!(q.arm(), "round {round}: empty");
            assert!(!readable(&q), "round {round}: quiet");
        }
        // A port's post (the other NIC's write fires the tripwire), then ours.
        m.store_u64(0, round).unwrap();
        assert!(readable(&q), "round {round}: the port's post wakes");
        assert!(!q.arm());
        assert!(!q.arm(), "still pending");
        assert!(readable(&q), "left readable while pending");
        assert!(matches!(q.try_take(), Some(Event::Tripwire { cookie: 9, .. })));
        assert!(q.arm());
        assert!(!readable(&q), "reset once taken");
        assert!(q.arm());
        q.post_user(round);
        assert!(readable(&q), "round {round}: our post wakes");
        assert_eq!(q.try_take(), Some(Event::User(round)));
    }
}

#[test]
fn works_in_a_mio_loop() {
    let _wd = Watchdog::new("mio loop", Duration::from_secs(60));
    let nic = nic();
    let mut q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let mut poll = mio::Poll::new().unwrap();
    poll.registry().register(&mut q, mio::Token(7), mio::Interest::READABLE).unwrap();
    let q2 = q.clone();
    let t = std::thread::spawn(move || {
        for i in 0..100 {
            q2.post_user(i);
            if i % 10 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    });
    let mut events = mio::Events::with_capacity(8);
    let mut got = Vec::new();
    while got.len() < 100 {
        if q.arm() {
            poll.poll(&mut events, Some(Duration::from_secs(30))).unwrap();
            assert!(events.iter().any(|e| e.token() == mio::Token(7)), "poll timed out with events outstanding");
        }
        while let Some(Event::User(v)) = q.try_take() {
            got.push(v);
        }
    }
    assert_eq!(got, (0..100).collect::<Vec<_>>());
    t.join().unwrap();
}

#[test]
fn many_threads_consume_one_queue() {
    let _wd = Watchdog::new("many consumers", Duration::from_secs(60));
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig { ring_capacity: 1 << 16, ..EventQueueConfig::default() }).unwrap();
    let consumers: Vec<_> = (0..3)
        .map(|_| {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                loop {
                    match q.wait(Some(Duration::from_secs(30))).unwrap() {
                        Event::User(u64::MAX) => return got,
                        Event::User(v) => got.push(v),
                        other => panic!("unexpected {other:?}"),
                    }
                }
            })
        })
        .collect();
    for i in 0..30_000 {
        assert!(q.post_user(i));
    }
    for _ in 0..3 {
        q.post_user(u64::MAX);
    }
    let mut all: Vec<u64> = consumers.into_iter().flat_map(|c| c.join().unwrap()).collect();
    all.sort();
    assert_eq!(all, (0..30_000).collect::<Vec<_>>(), "every event exactly once");
}

#[test]
fn out_of_band_messages() {
    let _wd = Watchdog::new("oob", Duration::from_secs(60));
    let nic = nic();
    let a = nic.endpoint().unwrap();
    let b = nic.endpoint().unwrap();
    a.send_oob(b.addr(), b"connect please").unwrap();
    assert!(matches!(b.event_queue().try_take(), Some(Event::Oob { endpoint }) if endpoint == b.port()));
    let msg = b.recv_oob().unwrap();
    assert_eq!(msg.from, a.addr());
    assert_eq!(&msg.payload[..14], b"connect please");
    assert!(msg.payload[14..].iter().all(|&x| x == 0));
    assert_eq!(b.recv_oob(), None);
    assert!(matches!(a.send_oob(b.addr(), &[0; 41]), Err(OobError::TooLong(41))));
    let nobody = EndpointAddr::new(nic.addr(), 999_999);
    assert!(matches!(a.send_oob(nobody, b"x"), Err(OobError::NoSuchEndpoint(e)) if e == nobody));
    assert!(matches!(b.wait_oob(Some(Duration::from_millis(5))), Err(OobError::Timeout)));
    for i in 0..clan::OOB_QUEUE {
        a.send_oob(b.addr(), &[i as u8]).unwrap();
    }
    assert!(matches!(a.send_oob(b.addr(), b"one too many"), Err(OobError::QueueFull(_))));
    assert_eq!(b.wait_oob(None).unwrap().payload[0], 0);
    // Across two NICs (the host control channel).
    let other = Nic::open(NicConfig::default()).unwrap();
    let c = other.endpoint().unwrap();
    c.send_oob(a.addr(), b"hello from afar").unwrap();
    let m = a.wait_oob(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(m.from, c.addr());
    let gone = EndpointAddr::new(other.addr(), 12345);
    assert!(matches!(a.send_oob(gone, b"x"), Err(OobError::NoSuchEndpoint(_))));
    drop((c, other));
    let dead = EndpointAddr::new("127.0.0.1:1".parse().unwrap(), 1);
    assert!(matches!(a.send_oob(dead, b"x"), Err(OobError::Unreachable(_))));
}

#[test]
fn bad_queue_geometry_is_a_clear_error() {
    let nic = nic();
    let r = nic.event_queue(EventQueueConfig { ring_capacity: 1000, ..EventQueueConfig::default() });
    assert!(matches!(r, Err(EventQueueError::Config(_))));
    let r = nic.event_queue(EventQueueConfig { producers: 0, ..EventQueueConfig::default() });
    assert!(matches!(r, Err(EventQueueError::Config(_))));
}

/// An idle NIC's engine sleeps until something comes: no clock of its own wakes it (it
/// woke once a second to look at its timers).
#[test]
fn an_idle_engine_sleeps() {
    let _wd = Watchdog::new("idle engine", Duration::from_secs(60));
    let (a, b) = (Nic::open_default().unwrap(), Nic::open_default().unwrap());
    let ea = a.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    // A control connection between the two NICs, an import over it, a write.
    let m = b.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    m.store_u64(0, 1).unwrap();
    let engines = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?.path();
                let comm = std::fs::read_to_string(t.join("comm")).ok()?;
                (comm.trim() == "clan-engine").then(|| t.join("status").to_string_lossy().into_owned())
            })
            .collect()
    };
    let switches = |status: &[String]| -> u64 {
        status
            .iter()
            .filter_map(|s| std::fs::read_to_string(s).ok())
            .filter_map(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:").map(|v| v.trim().parse::<u64>().unwrap()))
            })
            .sum()
    };
    // (a thread takes its name once it first runs: on a loaded machine an engine may not
    // have yet)
    let named = std::time::Instant::now();
    let mut threads = engines();
    while threads.len() < 2 && named.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
        threads = engines();
    }
    assert!(threads.len() >= 2, "the engines' threads: {threads:?}");
    // Settled: what the set-up left to do later (a lazy message's 2 ms timer) is done.
    std::thread::sleep(Duration::from_millis(200));
    let before = switches(&threads);
    std::thread::sleep(Duration::from_millis(3500));
    let woke = switches(&threads) - before;
    // Two engines waking once a second each: 7 here.
    assert!(woke <= 2, "the idle engines woke {woke} times in 3.5 s");
    assert_eq!(ap.load_u64(0).unwrap(), 1);
    drop(m);
}
