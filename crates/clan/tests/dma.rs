//! DMA queues: the engine moves data asynchronously, within a host (it copies) and across a
//! link (in one process over loopback TCP with `LocalTransport::Link`); completion words,
//! events and tripwires; chains; cancellation; fairness between endpoints; bad requests.

mod util;

use std::time::{Duration, Instant};

use clan::{
    AccessError, DmaError, DmaFailure, DmaOptions, DmaRequest, EndpointConfig, Event, EventQueueConfig, LocalTransport,
    Nic, NicConfig, Rights, TripwireConfig,
};
use util::Watchdog;

const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn linked() -> Nic {
    Nic::open(NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }).unwrap()
}

fn next_event(q: &clan::EventQueue) -> Event {
    loop {
        match q.wait(WAIT).expect("an event") {
            Event::Oob { .. } => continue,
            e => return e,
        }
    }
}

#[test]
fn write_and_read_within_a_host() {
    let _wd = Watchdog::new("dma local", Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    let (me, them) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
    let src = me.export(1 << 20).unwrap();
    let data = pattern(1 << 20, 1);
    src.write(0, &data).unwrap();
    let target = them.export(2 << 20).unwrap();
    let arrived = target.tripwire(TripwireConfig::writes((2 << 20) - 8..2 << 20).event(5)).unwrap();
    let m = me.import(&target.descriptor()).unwrap();

    // Write: the whole aperture, to an offset; an event with our tag.
    let t = me.dma_write(&src, 0, &m, 1 << 20, 1 << 20, DmaOptions::new().event(77)).unwrap();
    t.wait(WAIT).unwrap();
    assert!(t.is_complete());
    assert_eq!(t.result(), Some(Ok(())));
    let mut back = vec![0u8; 1 << 20];
    target.read(1 << 20, &mut back).unwrap();
    assert!(back == data, "DMA write moved the bytes");
    assert_eq!(arrived.count(), 1, "the destination's tripwire fired on the engine's write");
    let mut saw_dma = false;
    while let Some(e) = me.event_queue().try_take() {
        match e {
            Event::DmaComplete { endpoint, tag: 77, result: Ok(()) } if endpoint == me.port() => saw_dma = true,
            Event::Tripwire { cookie: 5, .. } => {}
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(saw_dma, "completion event posted");

    // Read (a fetch): from the mapping into a local aperture whose write tripwire fires.
    let dst = me.export(1 << 20).unwrap();
    let landed = dst.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let t = me.dma_read(&m, 1 << 20, &dst, 0, 1 << 20, DmaOptions::new()).unwrap();
    t.wait(WAIT).unwrap();
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == data, "DMA read fetched the bytes");
    assert_eq!(landed.count(), 1);
    let s = me.dma_stats();
    assert_eq!((s.posted, s.completed, s.failed, s.bytes), (2, 2, 0, 2 << 20));
}

#[test]
fn tripwires_on_source_and_mapping_fire_on_completion() {
    let _wd = Watchdog::new("dma tripwires", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let (me, them) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
    let src = me.export(256 << 10).unwrap();
    // The paper: a tripwire on the source range fires when the engine has read it.
    let read_out = src.tripwire(TripwireConfig::reads((256 << 10) - 64..256 << 10)).unwrap();
    let untouched = src.tripwire(TripwireConfig::reads(0..64)).unwrap();
    let target = them.export(256 << 10).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    let sent = m.tripwire(TripwireConfig::writes(0..256 << 10)).unwrap();
    read_out.arm().unwrap();
    let t = me.dma_write(&src, 4096, &m, 0, (256 << 10) - 4096, DmaOptions::new()).unwrap();
    read_out.wait(WAIT).unwrap();
    t.wait(WAIT).unwrap();
    assert_eq!(read_out.count(), 1, "source read tripwire fired once");
    assert_eq!(untouched.count(), 0, "bytes the engine did not read fire nothing");
    assert!(sent.count() >= 1, "outgoing tripwire on the mapping fired");
}

#[test]
fn chains_run_in_order_and_complete_once() {
    let _wd = Watchdog::new("dma chain", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let (me, them) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
    let src = me.export(64 << 10).unwrap();
    src.write(0, &pattern(64 << 10, 9)).unwrap();
    src.store_u64(0, 0xF1A6).unwrap();
    let target = them.export(128 << 10).unwrap();
    let flag = target.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    // Body in two pieces, then the flag word: the flag lands last.
    let chain = vec![
        DmaRequest::write(&src, 8, &m, 4096, 32 << 10).unwrap(),
        DmaRequest::write(&src, 8 + (32 << 10), &m, 4096 + (32 << 10), 16 << 10).unwrap(),
        DmaRequest::write(&src, 0, &m, 0, 8).unwrap(),
    ];
    let before = me.dma_stats().doorbells;
    flag.arm().unwrap();
    let t = me.dma_chain(chain, DmaOptions::new().event(3)).unwrap();
    while target.load_u64(0).unwrap() != 0xF1A6 {
        flag.wait(WAIT).unwrap();
    }
    // The flag is there, so the body is too (requests of a queue run in order).
    let mut body = vec![0u8; 48 << 10];
    target.read(4096, &mut body).unwrap();
    assert!(body == pattern(64 << 10, 9)[8..8 + (48 << 10)]);
    t.wait(WAIT).unwrap();
    assert!(me.dma_stats().doorbells - before <= 1, "a chain rings the doorbell at most once");
    assert!(matches!(next_event(me.event_queue()), Event::DmaComplete { tag: 3, result: Ok(()), .. }));
    assert!(me.event_queue().try_take().is_none(), "one event for the whole chain");
    // Zero-length requests are markers that complete in order.
    me.dma_write(&src, 0, &m, 0, 0, DmaOptions::new()).unwrap().wait(WAIT).unwrap();
}

#[test]
fn bad_requests_are_errors_at_post_time() {
    let nic = Nic::open_default().unwrap();
    let (me, them) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
    let src = me.export(4096).unwrap();
    let target = them.export(8192).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    let ro = me.import(&target.descriptor().derive(0, 4096, Rights::READ).unwrap()).unwrap();
    let o = DmaOptions::new();
    assert!(matches!(me.dma_write(&src, 1, &m, 0, 4096, o), Err(DmaError::Access(AccessError::OutOfBounds { .. }))));
    assert!(matches!(me.dma_write(&src, 0, &m, 8000, 4096, o), Err(DmaError::Access(AccessError::OutOfBounds { .. }))));
    assert!(matches!(
        me.dma_write(&src, 0, &m, u64::MAX, 2, o),
        Err(DmaError::Access(AccessError::OutOfBounds { .. }))
    ));
    assert_eq!(me.dma_write(&src, 0, &ro, 0, 8, o).unwrap_err(), DmaError::Access(AccessError::NotWritable));
    let wo = me.import(&target.descriptor().derive(0, 4096, Rights::WRITE).unwrap()).unwrap();
    assert_eq!(me.dma_read(&wo, 0, &src, 0, 8, o).unwrap_err(), DmaError::Access(AccessError::NotReadable));
    assert_eq!(me.dma_chain(Vec::new(), o).unwrap_err(), DmaError::EmptyChain);
    let small = nic.endpoint_with(EndpointConfig { dma_queue: 2, ..Default::default() }).unwrap();
    let reqs: Vec<_> = (0..3).map(|_| DmaRequest::write(&src, 0, &m, 0, 8).unwrap()).collect();
    assert!(matches!(small.dma_chain(reqs, o), Err(DmaError::ChainTooLong { len: 3, capacity: 2 })));
    // A revoked destination.
    drop(target);
    assert_eq!(me.dma_write(&src, 0, &m, 0, 8, o).unwrap_err(), DmaError::Access(AccessError::Revoked));
}

/// Closing an endpoint cancels its requests that have not run: they complete, in order,
/// with `Cancelled` (never a hang, never a success after a cancellation), and at least some
/// were cancelled (64 copies of 8 MiB cannot all have run by the time the posting thread
/// closes the endpoint, in at least one of three rounds). Afterwards the handle refuses
/// every new request with `EndpointClosed`.
#[test]
fn closing_an_endpoint_cancels_what_has_not_run() {
    let _wd = Watchdog::new("dma cancel", Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    let them = nic.endpoint().unwrap();
    let target = them.export(8 << 20).unwrap();
    let mut rounds_with_cancellations = 0;
    for _ in 0..3 {
        let me = nic.endpoint().unwrap();
        let src = me.export(8 << 20).unwrap();
        let m = me.import(&target.descriptor()).unwrap();
        let tickets: Vec<_> =
            (0..64).map(|_| me.dma_write(&src, 0, &m, 0, 8 << 20, DmaOptions::new()).unwrap()).collect();
        let again = tickets[0].clone();
        let late = DmaRequest::write(&src, 0, &m, 0, 8).unwrap();
        me.close();
        let mut cancelled = 0;
        for t in &tickets {
            match t.wait(WAIT) {
                Ok(()) => assert_eq!(cancelled, 0, "requests run in order: none completes after a cancelled one"),
                Err(DmaError::Failed(DmaFailure::Cancelled)) => cancelled += 1,
                Err(e) => panic!("unexpected result {e}"),
            }
        }
        assert!(again.is_complete());
        let st = me.dma_stats();
        assert_eq!(st.completed, 64, "every request completed, one way or the other: {st:?}");
        assert_eq!(st.failed, cancelled, "the cancelled ones are the failed ones: {st:?}");
        rounds_with_cancellations += u32::from(cancelled > 0);

        // Posting to the closed endpoint is refused, and so is everything else.
        assert_eq!(me.dma_write(&src, 0, &m, 0, 8, DmaOptions::new()).unwrap_err(), DmaError::EndpointClosed);
        assert_eq!(me.dma_read(&m, 0, &src, 0, 8, DmaOptions::new()).unwrap_err(), DmaError::EndpointClosed);
        assert_eq!(me.dma_chain(vec![late], DmaOptions::new()).unwrap_err(), DmaError::EndpointClosed);
        assert!(matches!(me.export(4096), Err(clan::ExportError::EndpointClosed)));
        assert!(matches!(me.import(&target.descriptor()), Err(clan::ImportError::EndpointClosed)));
        assert!(me.is_closed());
        me.close(); // twice: nothing happens
        drop(src);
    }
    assert!(rounds_with_cancellations > 0, "closing cancelled nothing in three rounds");
    // An endpoint that never used DMA before it was closed refuses it too (its queue is made
    // on first use).
    let fresh = nic.endpoint().unwrap();
    let src = fresh.export(4096).unwrap();
    let m = fresh.import(&target.descriptor()).unwrap();
    fresh.close();
    assert_eq!(fresh.dma_write(&src, 0, &m, 0, 8, DmaOptions::new()).unwrap_err(), DmaError::EndpointClosed);
    // Other endpoints are unaffected.
    let me = nic.endpoint().unwrap();
    let src = me.export(4096).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    me.dma_write(&src, 0, &m, 0, 8, DmaOptions::new()).unwrap().wait(WAIT).unwrap();
}

#[test]
fn a_dropped_source_fails_the_requests_that_still_need_it() {
    let _wd = Watchdog::new("dma revoked source", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let (me, them) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
    let target = them.export(4096).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    let src = me.export(4096).unwrap();
    let req = DmaRequest::write(&src, 0, &m, 0, 8).unwrap();
    drop(src); // unexported after the request was made, before it was posted
    let t = me.dma_chain(vec![req], DmaOptions::new()).unwrap();
    assert_eq!(t.wait(WAIT), Err(DmaError::Failed(DmaFailure::Revoked)));
}

/// Two endpoints with full queues get about half of the engine each: the engine services
/// non-empty queues round-robin, a quantum at a time, so their requests complete
/// interleaved. Completions are read, in the order the engine finished them, from one event
/// queue: no clock is involved.
#[test]
fn two_saturating_endpoints_share_the_engine() {
    let _wd = Watchdog::new("dma fairness", Duration::from_secs(240));
    let nic = Nic::open_default().unwrap();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let sink = nic.endpoint().unwrap();
    let target = sink.export(1 << 20).unwrap();
    const N: usize = 64;
    let eps: Vec<_> = (0..2)
        .map(|_| {
            nic.endpoint_with(EndpointConfig { queue: Some(q.clone()), dma_queue: N, ..Default::default() }).unwrap()
        })
        .collect();
    let srcs: Vec<_> = eps.iter().map(|e| e.export(1 << 20).unwrap()).collect();
    let maps: Vec<_> = eps.iter().map(|e| e.import(&target.descriptor()).unwrap()).collect();
    // Posted alternately (so that neither queue can run ahead for lack of the other's
    // requests).
    for i in 0..N {
        for k in 0..2 {
            eps[k].dma_write(&srcs[k], 0, &maps[k], 0, 1 << 20, DmaOptions::new().event(i as u64)).unwrap();
        }
    }
    let order = completion_order(&q, &eps, 2 * N);
    // While both queues were full (the first half of the completions), each got about half.
    let first_half = order[..N].iter().filter(|&&k| k == 1).count();
    assert!((N * 3 / 8..=N * 5 / 8).contains(&first_half), "unfair service order {order:?}");
    // And neither finished long before the other.
    let last = |k: usize| order.iter().rposition(|&x| x == k).unwrap();
    assert!(last(0).min(last(1)) >= 2 * N - 8, "one endpoint finished early: {order:?}");
    let bytes: Vec<u64> = eps.iter().map(|e| e.dma_stats().bytes).collect();
    assert_eq!(bytes, vec![(N as u64) << 20; 2]);
}

/// One endpoint's queue is filled first, then the other's: an engine serving requests in
/// the order they were posted (one global queue) would finish every request of the first
/// before any of the second; a round-robin engine starts serving the second as soon as it
/// has requests, so the two interleave and the first still has most of its requests to
/// run after the second's first completes.
#[test]
fn an_endpoint_posting_late_is_not_queued_behind_a_full_one() {
    let _wd = Watchdog::new("dma fairness late", Duration::from_secs(240));
    let nic = Nic::open_default().unwrap();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let sink = nic.endpoint().unwrap();
    const SIZE: u64 = 4 << 20;
    const N: usize = 32;
    let target = sink.export(SIZE).unwrap();
    let eps: Vec<_> = (0..2)
        .map(|_| {
            nic.endpoint_with(EndpointConfig { queue: Some(q.clone()), dma_queue: N, ..Default::default() }).unwrap()
        })
        .collect();
    let srcs: Vec<_> = eps.iter().map(|e| e.export(SIZE).unwrap()).collect();
    let maps: Vec<_> = eps.iter().map(|e| e.import(&target.descriptor()).unwrap()).collect();
    for k in 0..2 {
        for i in 0..N {
            eps[k].dma_write(&srcs[k], 0, &maps[k], 0, SIZE, DmaOptions::new().event(i as u64)).unwrap();
        }
    }
    let order = completion_order(&q, &eps, 2 * N);
    let first_of_second = order.iter().position(|&k| k == 1).unwrap();
    let first_after = order[first_of_second..].iter().filter(|&&k| k == 0).count();
    // Round-robin: about N minus what ran while the second was posting; FIFO: zero.
    assert!(first_after >= N / 4, "the late endpoint waited behind the full one: {order:?}");
    // Once both had requests, they alternated: no run of one endpoint's completions is long.
    let both = &order[first_of_second..first_of_second + 2 * first_after.min(N / 2)];
    let longest = both.chunk_by(|a, b| a == b).map(<[usize]>::len).max().unwrap_or(0);
    assert!(longest <= 3, "not interleaved while both queues were full: {order:?}");
    let bytes: Vec<u64> = eps.iter().map(|e| e.dma_stats().bytes).collect();
    assert_eq!(bytes, vec![N as u64 * SIZE; 2]);
}

/// Which endpoint (0 or 1) each of the next `n` DMA completions on `q` belongs to.
fn completion_order(q: &clan::EventQueue, eps: &[clan::Endpoint], n: usize) -> Vec<usize> {
    let mut order = Vec::new();
    while order.len() < n {
        match q.wait(WAIT).unwrap() {
            Event::DmaComplete { endpoint, result: Ok(()), .. } => order.push(usize::from(endpoint == eps[1].port())),
            other => panic!("unexpected {other:?}"),
        }
    }
    order
}

#[test]
fn events_report_failures_and_overflow_is_not_silent() {
    let _wd = Watchdog::new("dma events", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let q = nic.event_queue(EventQueueConfig { ring_capacity: 8, ..Default::default() }).unwrap();
    let me = nic.endpoint_with(EndpointConfig { queue: Some(q.clone()), ..Default::default() }).unwrap();
    let them = nic.endpoint().unwrap();
    let src = me.export(4096).unwrap();
    let target = them.export(4096).unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    let mut last = None;
    for i in 0..32 {
        last = Some(me.dma_write(&src, 0, &m, 0, 64, DmaOptions::new().event(i)).unwrap());
    }
    last.unwrap().wait(WAIT).unwrap();
    let (mut dma, mut lost) = (0u64, 0u64);
    while let Some(e) = q.try_take() {
        match e {
            Event::DmaComplete { result: Ok(()), .. } => dma += 1,
            Event::Overflow { lost: n } => lost += n,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(dma + lost, 32, "every completion is an event or counted as lost");
}

// ---- across a link ----------------------------------------------------------------------

#[test]
fn write_and_read_across_a_link() {
    let _wd = Watchdog::new("dma link", Duration::from_secs(120));
    let (a, b) = (linked(), linked());
    let exporter = a.endpoint().unwrap();
    let target = exporter.export(4 << 20).unwrap();
    let flag = target.tripwire(TripwireConfig::writes((4 << 20) - 8..4 << 20)).unwrap();
    let me = b.endpoint().unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    assert!(m.is_remote());
    let src = me.export(4 << 20).unwrap();
    let data = pattern(4 << 20, 3);
    src.write(0, &data).unwrap();
    flag.arm().unwrap();
    let t = me.dma_write(&src, 0, &m, 0, 4 << 20, DmaOptions::new().notify()).unwrap();
    t.wait(WAIT).unwrap();
    // The write completed on our side; the exporter sees the last word, then the
    // notification (it travels behind the data).
    flag.wait(WAIT).unwrap();
    let note = next_event(exporter.event_queue());
    let note = match note {
        Event::Tripwire { .. } => next_event(exporter.event_queue()),
        e => e,
    };
    assert_eq!(
        note,
        Event::Notification { aperture: target.id(), generation: target.generation(), offset: 0, len: 4 << 20 }
    );
    let mut back = vec![0u8; 4 << 20];
    target.read(0, &mut back).unwrap();
    assert!(back == data, "bytes intact across the link");
    // Fetch it back into another local aperture (several read requests, answered straight
    // into the aperture).
    let dst = me.export(4 << 20).unwrap();
    let landed = dst.tripwire(TripwireConfig::writes((4 << 20) - 8..4 << 20)).unwrap();
    me.dma_read(&m, 0, &dst, 0, 4 << 20, DmaOptions::new()).unwrap().wait(WAIT).unwrap();
    let mut got = vec![0u8; 4 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == data, "fetched intact");
    assert_eq!(landed.count(), 1);
}

/// A chain whose first request fails (the exporter unexported; the importer learns it from
/// the answer) reports that failure, and its later requests are not run.
#[test]
fn a_failed_request_aborts_the_rest_of_its_chain() {
    let _wd = Watchdog::new("dma chain failure", Duration::from_secs(60));
    let (a, b) = (linked(), linked());
    let exporter = a.endpoint().unwrap();
    let gone = exporter.export(4096).unwrap();
    let me = b.endpoint().unwrap();
    let neighbour = b.endpoint().unwrap();
    let local_target = neighbour.export(4096).unwrap();
    let m_gone = me.import(&gone.descriptor()).unwrap();
    let dst = me.export(4096).unwrap();
    let src = me.export(4096).unwrap();
    src.store_u64(0, 99).unwrap();
    let m_ok = me.import(&local_target.descriptor()).unwrap();
    drop(gone); // the importer does not know yet
    let t = me
        .dma_chain(
            vec![DmaRequest::read(&m_gone, 0, &dst, 0, 64).unwrap(), DmaRequest::write(&src, 0, &m_ok, 0, 8).unwrap()],
            DmaOptions::new(),
        )
        .unwrap();
    assert_eq!(t.wait(WAIT), Err(DmaError::Failed(DmaFailure::Revoked)));
    assert_eq!(local_target.load_u64(0).unwrap(), 0, "the request after the failure did not run");
    // The queue goes on.
    me.dma_write(&src, 0, &m_ok, 0, 8, DmaOptions::new()).unwrap().wait(WAIT).unwrap();
    assert_eq!(local_target.load_u64(0).unwrap(), 99);
}

/// A link that breaks under a DMA fails it (no hang): the path falls silent, keepalive
/// declares the link dead, the pending read is completed with a failure.
#[test]
fn a_broken_link_fails_pending_requests() {
    let _wd = Watchdog::new("dma link down", Duration::from_secs(120));
    let a = linked();
    let exporter = a.endpoint().unwrap();
    let target = exporter.export(1 << 20).unwrap();
    let proxy = clan_testkit::fault::FaultProxy::start(a.addr().socket_addr()).unwrap();
    let k = Duration::from_millis(100);
    let b = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        routes: vec![(a.addr(), proxy.addr())],
        link: clan::LinkConfig { keepalive: k, dead_after: k * 5, ..clan::LinkConfig::default() },
        ..NicConfig::default()
    })
    .unwrap();
    let me = b.endpoint().unwrap();
    let m = me.import(&target.descriptor()).unwrap();
    let dst = me.export(1 << 20).unwrap();
    me.dma_read(&m, 0, &dst, 0, 1 << 20, DmaOptions::new()).unwrap().wait(WAIT).unwrap();
    proxy.set_silent(true);
    let start = Instant::now();
    match me.dma_read(&m, 0, &dst, 0, 1 << 20, DmaOptions::new().event(8)) {
        Ok(t) => match t.wait(WAIT) {
            Err(DmaError::Failed(DmaFailure::Disconnected | DmaFailure::Timeout)) => {
                assert!(matches!(
                    next_event(me.event_queue()),
                    Event::DmaComplete { tag: 8, result: Err(DmaFailure::Disconnected | DmaFailure::Timeout), .. }
                ));
            }
            other => panic!("expected a link failure, got {other:?}"),
        },
        Err(DmaError::Access(AccessError::Disconnected)) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert!(start.elapsed() < Duration::from_secs(60));
}
