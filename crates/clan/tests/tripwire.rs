//! Tripwires and tripsets within one process.

mod util;

use std::sync::Arc;
use std::time::Duration;

use clan::{Access, Actions, Event, EventQueueConfig, Nic, NicConfig, TripwireConfig, TripwireError};
use util::Watchdog;

fn nic() -> Nic {
    Nic::open(NicConfig::default()).expect("open NIC")
}

#[test]
fn fires_on_nic_traffic_not_on_local_stores() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let w = ap.tripwire(TripwireConfig::writes(100..108)).unwrap();
    let r = ap.tripwire(TripwireConfig::reads(200..208)).unwrap();
    let rw = ap.tripwire(TripwireConfig::accesses(300..400)).unwrap();
    ap.write(100, &[1; 8]).unwrap(); // local store: the NIC does not see it
    assert!(!w.fired() && w.count() == 0);
    m.write(104, &[1; 2]).unwrap();
    assert!(w.fired());
    assert_eq!(w.count(), 1);
    m.write(108, &[1; 8]).unwrap(); // just past the range
    assert_eq!(w.count(), 1);
    m.write(90, &[1; 11]).unwrap(); // overlaps the first byte
    assert_eq!(w.count(), 2);
    m.write(200, &[0; 8]).unwrap(); // a write does not fire a read tripwire
    assert_eq!(r.count(), 0);
    m.read(207, &mut [0; 1]).unwrap();
    assert_eq!(r.count(), 1);
    m.load_u64(200).unwrap();
    assert_eq!(r.count(), 2);
    m.store_u64(304, 5).unwrap();
    m.read(390, &mut [0; 20]).unwrap();
    assert_eq!(rw.count(), 2);
    assert!(w.clear());
    assert!(!w.fired());
}

#[test]
fn once_only_disarm_and_rearm() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).once()).unwrap();
    assert!(tw.is_armed());
    m.store_u64(0, 1).unwrap();
    m.store_u64(0, 2).unwrap();
    assert_eq!(tw.count(), 1);
    assert!(!tw.is_armed());
    tw.arm().unwrap();
    m.store_u64(0, 3).unwrap();
    assert_eq!(tw.count(), 2);
    let tw2 = ap.tripwire(TripwireConfig::writes(0..8).disarmed()).unwrap();
    m.store_u64(0, 4).unwrap();
    assert_eq!(tw2.count(), 0);
    tw2.arm().unwrap();
    m.store_u64(0, 5).unwrap();
    assert_eq!(tw2.count(), 1);
    tw2.disarm().unwrap();
    m.store_u64(0, 6).unwrap();
    assert_eq!(tw2.count(), 1);
}

#[test]
fn wait_wakes_on_a_write_from_another_thread() {
    let _wd = Watchdog::new("wait_wakes", Duration::from_secs(60));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    assert_eq!(tw.wait(Some(Duration::from_millis(20))), Err(TripwireError::Timeout));
    for round in 1..=200u64 {
        tw.arm().unwrap();
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.store_u64(0, round).unwrap());
        // Arm, re-check, wait: never misses the write.
        while ap.load_u64(0).unwrap() != round {
            tw.wait(None).unwrap();
        }
        t.join().unwrap();
    }
}

#[test]
fn mapping_tripwires_fire_after_outgoing_traffic_completes() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(8192).unwrap();
    let m = ep.import(&ap.descriptor().derive(4096, 4096, clan::Rights::READ_WRITE).unwrap()).unwrap();
    let out = m.tripwire(TripwireConfig::writes(0..4096).event(99)).unwrap();
    let inc = ap.tripwire(TripwireConfig::writes(4096..4104)).unwrap();
    m.write(0, &[3; 64]).unwrap();
    assert_eq!(out.count(), 1);
    assert_eq!(inc.count(), 1, "mapping offset 0 is aperture offset 4096");
    match ep.event_queue().try_take() {
        Some(Event::Tripwire { cookie: 99, access: Access::Write, id, .. }) => assert_eq!(id, out.id()),
        other => panic!("expected the outgoing tripwire's event, got {other:?}"),
    }
    assert!(matches!(m.tripwire(TripwireConfig::writes(0..4097)), Err(TripwireError::OutOfBounds { .. })));
}

#[test]
fn events_are_delivered_with_their_cookie_and_can_be_unregistered() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let a = ap.tripwire(TripwireConfig::writes(0..8).event(1)).unwrap();
    let b = ap.tripwire(TripwireConfig::writes(8..16).actions(Actions::NONE)).unwrap();
    q.register(&b, 2).unwrap();
    m.write(0, &[1; 16]).unwrap();
    let mut got = Vec::new();
    q.poll(&mut got, 10);
    let cookies: Vec<u64> = got
        .iter()
        .map(|e| match e {
            Event::Tripwire { cookie, endpoint, .. } => {
                assert_eq!(*endpoint, ep.port());
                *cookie
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(cookies, vec![1, 2], "in the order the write touched them");
    q.unregister(&a).unwrap();
    m.write(0, &[1; 16]).unwrap();
    got.clear();
    q.poll(&mut got, 10);
    assert_eq!(got.len(), 1);
    // A tripwire can only be registered with its own endpoint's queue.
    assert_eq!(nic.default_queue().register(&a, 5), Err(TripwireError::Foreign));
    assert!(q.stats().delivered >= 3);
}

#[test]
fn a_write_spanning_tripwires_fires_them_in_address_order() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(1 << 20).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let header = ap.tripwire(TripwireConfig::writes(0..8).event(1)).unwrap();
    let body = ap.tripwire(TripwireConfig::writes((1 << 20) - 8..1 << 20).event(2)).unwrap();
    m.write(0, &vec![5u8; 1 << 20]).unwrap();
    let q = ep.event_queue();
    let first = q.try_take();
    let second = q.try_take();
    assert!(matches!(first, Some(Event::Tripwire { cookie: 1, .. })), "{first:?}");
    assert!(matches!(second, Some(Event::Tripwire { cookie: 2, .. })), "{second:?}");
    drop((header, body));
}

#[test]
fn tripset_waits_for_any_member() {
    let _wd = Watchdog::new("tripset", Duration::from_secs(60));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let tws: Vec<_> = (0..4).map(|i| ap.tripwire(TripwireConfig::writes(i * 64..i * 64 + 8)).unwrap()).collect();
    let set = Arc::new(ep.tripset().unwrap());
    for t in &tws {
        set.add(t).unwrap();
    }
    assert_eq!(set.add(&tws[0]), Err(TripwireError::InTripset));
    assert_eq!(set.wait(Some(Duration::from_millis(10))), Err(TripwireError::Timeout));
    for round in 0..100u64 {
        let which = (round % 4) as usize;
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.store_u64(which as u64 * 64, round + 1).unwrap());
        let fired = set.wait(None).unwrap();
        assert_eq!(fired, vec![tws[which].id()]);
        t.join().unwrap();
    }
    // Another endpoint's tripwire cannot join.
    let other = nic.endpoint().unwrap();
    let ap2 = other.export(4096).unwrap();
    let foreign = ap2.tripwire(TripwireConfig::writes(0..8)).unwrap();
    assert_eq!(set.add(&foreign), Err(TripwireError::Foreign));
    assert!(set.remove(&tws[1]));
    m.store_u64(64, 1).unwrap();
    assert!(set.poll().is_empty());
}

#[test]
fn destroyed_tripwires_stop_firing_and_free_their_entry() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig { tripwires: 4, ..EventQueueConfig::default() }).unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let mut tws: Vec<_> =
        (0..4).map(|i| ap.tripwire(TripwireConfig::writes(i * 8..i * 8 + 8).event(i)).unwrap()).collect();
    assert!(matches!(ap.tripwire(TripwireConfig::writes(0..1)), Err(TripwireError::TableFull { capacity: 4 })));
    let gone = tws.remove(0);
    drop(gone);
    m.write(0, &[1; 8]).unwrap();
    assert_eq!(q.try_take(), None, "a destroyed tripwire must not report");
    let again = ap.tripwire(TripwireConfig::writes(0..8).event(7)).unwrap();
    m.write(0, &[1; 8]).unwrap();
    assert!(matches!(q.try_take(), Some(Event::Tripwire { cookie: 7, .. })));
    assert!(matches!(ap.tripwire(TripwireConfig::writes(8..8)), Err(TripwireError::EmptyRange)));
    assert!(matches!(ap.tripwire(TripwireConfig::writes(4090..4097)), Err(TripwireError::OutOfBounds { .. })));
    drop(again);
}

/// A million tripwires on one NIC; matching still finds exactly the right one.
#[test]
fn one_million_tripwires() {
    let _wd = Watchdog::new("one_million_tripwires", Duration::from_secs(600));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    const N: u64 = 1_000_000;
    let ap = ep.export(N * 8).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let tws: Vec<_> = (0..N).map(|i| ap.tripwire(TripwireConfig::writes(i * 8..i * 8 + 8)).unwrap()).collect();
    for &i in &[0u64, 1, 4242, 500_000, N - 1] {
        m.store_u64(i * 8, 1).unwrap();
        assert_eq!(tws[i as usize].count(), 1);
    }
    // A 64-byte write fires exactly the 8 tripwires under it.
    m.write(8 * 1000, &[0; 64]).unwrap();
    assert!((1000..1008).all(|i| tws[i].count() == 1));
    assert_eq!(tws[999].count(), 0);
    assert_eq!(tws[1008].count(), 0);
}

/// A message led by a word (the message queue's sealed slot) is whole once its lead word is
/// seen, even when tripwires on its header split the transfer into pieces: the lead is
/// stored with the last piece, not the first.
#[test]
fn a_led_message_is_whole_once_its_lead_is_seen_even_split_by_tripwires() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let _wd = Watchdog::new("led message whole", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = Arc::new(ep.export(8192).unwrap());
    let m = ep.import(&ap.descriptor()).unwrap();
    // Persistent tripwires inside the header: the transfer is cut at 16 and at 32.
    let _t1 = ap.tripwire(TripwireConfig::writes(8..16)).unwrap();
    let _t2 = ap.tripwire(TripwireConfig::writes(16..32)).unwrap();
    const N: u64 = 2000;
    let acked = Arc::new(AtomicU64::new(0));
    let reader = {
        let (ap, acked) = (ap.clone(), acked.clone());
        std::thread::spawn(move || {
            let mut body = vec![0u8; 4000];
            for k in 1..=N {
                while ap.load_u64(0).unwrap() != k {
                    std::hint::spin_loop();
                }
                ap.read(8, &mut body).unwrap();
                let bad = body.iter().position(|&b| b != k as u8);
                assert_eq!(bad, None, "message {k}: lead seen before its body");
                acked.store(k, Ordering::Release);
            }
        })
    };
    for k in 1..=N {
        m.write_led_then_store_u64(0, k, &vec![k as u8; 4000], 4096 + 8, k).unwrap();
        while acked.load(Ordering::Acquire) != k {
            assert!(!reader.is_finished(), "the reader stopped");
            std::thread::yield_now();
        }
    }
    reader.join().unwrap();
}
