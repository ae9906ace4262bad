//! Single-threaded tests of the shared-memory algorithms on heap models, with oracles.
#![cfg(not(loom))]

use std::cell::RefCell;

use clan_shm::cam::{self, CamOwner, Candidate};
use clan_shm::eq::{CamModel, EqModel, EqParams};
use clan_shm::ring::{Consumer, Producer, Taken};
use clan_shm::snoop::{self, Sink, Watch};
use clan_shm::sync::SharedFutex;
use clan_shm::trip::{self, ACT_BITMAP, ACT_COUNTER, ACT_EVENT, ARMED, Access, ON_READ, ON_WRITE, ONCE, WIDE};
use proptest::prelude::*;

const TAG: u64 = 0xfeed;

fn params() -> EqParams {
    EqParams { nrings: 4, ring_cap: 8, trip_cap: 256, tripset_cap: 8 }
}

struct RecSink<'a> {
    futex: SharedFutex,
    posted: RefCell<Vec<(u32, u32, Access)>>,
    on_post: Box<dyn Fn(u32) + 'a>,
}

impl<'a> RecSink<'a> {
    fn new(on_post: impl Fn(u32) + 'a) -> Self {
        RecSink { futex: SharedFutex, posted: RefCell::new(Vec::new()), on_post: Box::new(on_post) }
    }
}

impl Sink for RecSink<'_> {
    type F = SharedFutex;
    fn futex(&self) -> &SharedFutex {
        &self.futex
    }
    fn post(&self, index: u32, generation: u32, access: Access) {
        (self.on_post)(index);
        self.posted.borrow_mut().push((index, generation, access));
    }
}

/// Create tripwire `index` (generation 1) over `[start, end)` and index it.
fn add(eq: &EqModel, cam: &CamModel, owner: &mut CamOwner, index: u32, start: u64, end: u64, fl: u32) {
    let v = eq.view();
    let wide = if cam::is_wide(start, end) { WIDE } else { 0 };
    let cell = &v.table.cells[index as usize];
    let cv = cam.view();
    trip::publish(
        &cv.entries[index as usize],
        cv.armed_count(),
        cell,
        1,
        fl | wide,
        start,
        end,
        TAG,
        index,
        trip::NO_SOURCE,
    );
    owner.insert(&cam.view(), index, start, end);
}

#[test]
fn ring_round_robin_overflow_and_arm() {
    let eq = EqModel::new(params());
    let v = eq.view();
    let rings = v.rings();
    let mut p0 = Producer::new(0);
    let mut p2 = Producer::new(2);
    let mut c = Consumer::new(4);
    assert!(clan_shm::ring::arm(&rings, clan_shm::ring::ARM_FUTEX), "empty queue may sleep");
    let posted = p0.post(&rings, [1, 0, 0, 0], &SharedFutex);
    assert!(posted.stored);
    assert!(!clan_shm::ring::arm(&rings, clan_shm::ring::ARM_FUTEX), "pending event: must not sleep");
    p2.post(&rings, [2, 0, 0, 0], &SharedFutex);
    p0.post(&rings, [3, 0, 0, 0], &SharedFutex);
    let mut got = Vec::new();
    while let Some(t) = c.take(&rings) {
        got.push(t);
    }
    // Round robin: ring 0, then ring 2, then ring 0 again.
    let words: Vec<u64> = got
        .iter()
        .map(|t| match t {
            Taken::Event { words, .. } => words[0],
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(words, vec![1, 2, 3]);
    // Overflow: 8 slots, 10 posts.
    for i in 0..10 {
        let p = p2.post(&rings, [100 + i, 0, 0, 0], &SharedFutex);
        assert_eq!(p.stored, i < 8);
    }
    let mut events = 0;
    let mut lost = 0;
    while let Some(t) = c.take(&rings) {
        match t {
            Taken::Event { ring: 2, .. } => events += 1,
            Taken::Overflow { ring: 2, lost: l } => lost += l,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((events, lost), (8, 2));
    assert!(clan_shm::ring::arm(&rings, clan_shm::ring::ARM_FUTEX));
}

#[test]
fn ring_corrupt_head_is_reported_not_followed() {
    let eq = EqModel::new(params());
    let v = eq.view();
    let rings = v.rings();
    let mut c = Consumer::new(4);
    // A hostile producer claims a billion events and sets its summary bit.
    v.ring_headers[1].head.store(1_000_000_000, std::sync::atomic::Ordering::Relaxed);
    rings.words.summary[0].fetch_or(0b10, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(c.take(&rings), Some(Taken::Corrupt { ring: 1, skipped: 1_000_000_000 }));
    assert_eq!(c.take(&rings), None);
}

#[test]
fn watched_bytes_are_visible_first_then_the_rest() {
    let eq = EqModel::new(params());
    let cam_m = CamModel::new(4096, 64);
    let mut owner = CamOwner::new();
    // Tripwires on bytes [64, 72) and [1000, 1008); a 4 KiB write covering both.
    add(&eq, &cam_m, &mut owner, 3, 64, 72, ARMED | ON_WRITE | ACT_EVENT);
    add(&eq, &cam_m, &mut owner, 9, 1000, 1008, ARMED | ON_WRITE | ACT_EVENT);
    let mem = RefCell::new(vec![0u8; 4096]);
    let observed = RefCell::new(Vec::new());
    let sink = RecSink::new(|index| {
        let m = mem.borrow();
        // At fire time: how far has the write progressed?
        let written = m.iter().rposition(|&b| b == 0xab).map_or(0, |p| p + 1);
        observed.borrow_mut().push((index, written));
    });
    let v = eq.view();
    let cam_v = cam_m.view();
    let watch = Watch { cam: &cam_v, table: &v.table, tag: TAG };
    let mut scratch = Vec::new();
    let fired = snoop::transfer(Access::Write, &watch, &sink, 0, 4096, &mut scratch, |off, len| {
        mem.borrow_mut()[off as usize..(off + len) as usize].fill(0xab);
        Ok::<(), ()>(())
    })
    .unwrap();
    assert_eq!(fired, 2);
    // Tripwire 3 fired when exactly bytes [0, 72) were written, tripwire 9 at [0, 1008).
    assert_eq!(*observed.borrow(), vec![(3, 72), (9, 1008)]);
    assert!(mem.borrow().iter().all(|&b| b == 0xab));
}

#[test]
fn once_only_counter_bitmap_and_access_kinds() {
    let eq = EqModel::new(params());
    let cam_m = CamModel::new(8192, 64);
    let mut owner = CamOwner::new();
    add(&eq, &cam_m, &mut owner, 1, 0, 8, ARMED | ONCE | ON_WRITE | ACT_BITMAP | ACT_COUNTER);
    add(&eq, &cam_m, &mut owner, 2, 0, 8, ARMED | ON_READ | ACT_COUNTER);
    add(&eq, &cam_m, &mut owner, 5, 0, 8192, ARMED | ON_WRITE | ON_READ | ACT_COUNTER); // wide
    let v = eq.view();
    let cam_v = cam_m.view();
    let watch = Watch { cam: &cam_v, table: &v.table, tag: TAG };
    let sink = RecSink::new(|_| {});
    let mut scratch = Vec::new();
    let nop = |_: u64, _: u64| Ok::<(), ()>(());
    assert_eq!(snoop::transfer(Access::Write, &watch, &sink, 4, 2, &mut scratch, nop).unwrap(), 2);
    assert_eq!(snoop::transfer(Access::Write, &watch, &sink, 4, 2, &mut scratch, nop).unwrap(), 1, "once-only");
    assert_eq!(snoop::transfer(Access::Read, &watch, &sink, 0, 1, &mut scratch, nop).unwrap(), 2);
    assert_eq!(snoop::transfer(Access::Write, &watch, &sink, 8000, 8, &mut scratch, nop).unwrap(), 1, "wide only");
    let e = &cam_v.entries;
    // Entries were published with queue index = slot: their cells are the table's.
    let count = |i: usize| v.table.cells[i].count.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((count(1), count(2), count(5)), (1, 1, 4));
    assert!(trip::test_bit(&v.table, 1));
    assert!(trip::clear_bit(&v.table, 1));
    assert!(!trip::test_bit(&v.table, 1));
    assert!(!trip::test_bit(&v.table, 2), "no bitmap action");
    // Re-arm the once-only tripwire.
    let c = &v.table.cells;
    let armed = || cam_v.header.armed.load(std::sync::atomic::Ordering::Relaxed);
    assert!(!trip::would_fire(&e[1], 1, Access::Write), "the firing was mirrored");
    assert_eq!(armed(), 2, "the once-only tripwire's firing uncounted it");
    assert!(trip::set_armed(&e[1], cam_v.armed_count(), &c[1], 1, 1, true));
    assert!(trip::would_fire(&e[1], 1, Access::Write), "the arming was mirrored");
    assert_eq!(armed(), 3, "and counted");
    assert!(trip::set_armed(&e[1], cam_v.armed_count(), &c[1], 1, 1, true));
    assert_eq!(armed(), 3, "armed twice, counted once");
    assert_eq!(snoop::transfer(Access::Write, &watch, &sink, 0, 1, &mut scratch, nop).unwrap(), 2);
    assert_eq!(armed(), 2);
    // Stale generation cannot arm.
    assert!(!trip::set_armed(&e[1], cam_v.armed_count(), &c[1], 1, 2, true));
    assert_eq!(armed(), 2);
    // Disarmed and retired: uncounted once each.
    assert!(trip::set_armed(&e[2], cam_v.armed_count(), &c[2], 2, 1, false));
    assert!(trip::set_armed(&e[2], cam_v.armed_count(), &c[2], 2, 1, false));
    assert_eq!(armed(), 1);
    trip::retire(&e[5], cam_v.armed_count(), &c[5], 5);
    trip::retire(&e[2], cam_v.armed_count(), &c[2], 2);
    assert_eq!(armed(), 0, "nothing armed: writers walk nothing");
    assert!(!cam_v.armed_over(TAG, 0, 8192, Access::Write));
}

#[test]
fn corrupted_index_costs_time_not_safety() {
    let eq = EqModel::new(params());
    let cam_m = CamModel::new(4096, 64);
    let v = eq.view();
    let cv = cam_m.view();
    use std::sync::atomic::Ordering::Relaxed;
    // A cycle: entry 0 -> 1 -> 0, both claiming our tag, and garbage heads.
    let c = &v.table.cells;
    trip::publish(&cv.entries[0], cv.armed_count(), &c[0], 1, ARMED | ON_WRITE, 0, 8, TAG, 0, trip::NO_SOURCE);
    trip::publish(&cv.entries[1], cv.armed_count(), &c[1], 1, ARMED | ON_WRITE, 0, 8, TAG, 1, trip::NO_SOURCE);
    cv.entries[0].next.store(2, Relaxed);
    cv.entries[1].next.store(1, Relaxed);
    cv.heads[0].store(1, Relaxed);
    cv.heads[1].store(u32::MAX, Relaxed);
    cv.watch[0].store(u64::MAX, Relaxed);
    cv.wide[0].store(u64::MAX, Relaxed);
    cv.header.wide_head.store(77777, Relaxed);
    let mut out = Vec::new();
    let consistent = cv.collect(TAG, 0, 4096, Access::Write, &mut out);
    assert!(!consistent);
    let idx: Vec<u32> = out.iter().map(|c| c.index).collect();
    assert_eq!(idx, vec![0, 1], "each real entry reported once despite the cycle");
    // The quick paths hand a corrupt index over to the whole path.
    assert!(cv.armed_over(TAG, 0, 4096, Access::Write));
    assert!(cv.armed_over(TAG, 100, 108, Access::Read), "a garbage head is an inconsistency");
}

#[derive(Debug, Clone)]
struct Tw {
    start: u64,
    len: u64,
    armed: bool,
    write: bool,
}

fn tw_strategy(size: u64) -> impl Strategy<Value = Tw> {
    (0..size, prop_oneof![1u64..16, 1u64..600, 1u64..3000], any::<bool>(), any::<bool>())
        .prop_map(move |(start, len, armed, write)| Tw { start, len: len.min(size - start).max(1), armed, write })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// The index finds exactly the tripwires a brute-force scan finds, through insertions and
    /// removals, and the transfer fires each armed overlapping one exactly once.
    #[test]
    fn index_matches_brute_force(
        tws in prop::collection::vec(tw_strategy(8192), 1..60),
        removals in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
        writes in prop::collection::vec((0u64..8192, 1u64..5000), 1..20),
    ) {
        let eq = EqModel::new(EqParams { nrings: 1, ring_cap: 8, trip_cap: 64, tripset_cap: 1 });
        let cam_m = CamModel::new(8192, 64);
        let mut owner = CamOwner::new();
        let mut live: Vec<(u32, Tw)> = Vec::new();
        for (i, t) in tws.iter().enumerate() {
            let fl = (if t.armed { ARMED } else { 0 }) | if t.write { ON_WRITE } else { ON_READ };
            add(&eq, &cam_m, &mut owner, i as u32, t.start, t.start + t.len, fl);
            live.push((i as u32, t.clone()));
        }
        let v = eq.view();
        let cv = cam_m.view();
        for r in removals {
            if live.is_empty() { break; }
            let (i, t) = live.remove(r.index(live.len()));
            trip::retire(&cv.entries[i as usize], cv.armed_count(), &v.table.cells[i as usize], i);
            owner.remove(&cv, i, t.start, t.start + t.len);
        }
        prop_assert_eq!(owner.len(), live.len());
        // One thread: the count of armed mirrors is exact.
        let armed = live.iter().filter(|(_, t)| t.armed).count() as u32;
        prop_assert_eq!(cv.header.armed.load(std::sync::atomic::Ordering::Relaxed), armed);
        let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
        let sink = RecSink::new(|_| {});
        let mut scratch: Vec<Candidate> = Vec::new();
        for (off, len) in writes {
            let len = len.min(8192 - off).max(1);
            let mut expect: Vec<u32> = live.iter()
                .filter(|(_, t)| t.write && t.armed && t.start < off + len && off < t.start + t.len)
                .map(|(i, _)| *i).collect();
            expect.sort();
            let mut out = Vec::new();
            cv.collect(TAG, off, off + len, Access::Write, &mut out);
            let mut found: Vec<u32> = out.iter()
                .filter(|c| trip::flags(cv.entries[c.index as usize].state.load(std::sync::atomic::Ordering::Relaxed)) & ARMED != 0)
                .map(|c| c.index).collect();
            found.sort();
            prop_assert_eq!(&found, &expect);
            // The quick paths' question: anything armed to fire over the range?
            prop_assert_eq!(cv.armed_over(TAG, off, off + len, Access::Write), !expect.is_empty());
            // And what the then-store quick path fires without a second walk: exactly those,
            // or (more than it keeps) nothing, for the whole path to settle.
            match cv.armed_in(TAG, off, off + len, Access::Write) {
                Some(a) => {
                    let mut got: Vec<u32> = a.as_slice().iter().map(|c| c.index).collect();
                    got.sort();
                    prop_assert_eq!(&got, &expect);
                }
                None => prop_assert!(expect.len() > clan_shm::cam::ARMED_MAX, "a quiet index walks consistently"),
            }
            let fired = snoop::transfer(Access::Write, &watch, &sink, off, len, &mut scratch, |_, _| Ok::<(), ()>(())).unwrap();
            prop_assert_eq!(fired as usize, expect.len());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// A write delivered in arbitrary pieces (as from a socket) fires each armed overlapping
    /// tripwire exactly once, and only when all its watched bytes of the write are in place.
    #[test]
    fn pieces_fire_each_tripwire_once_when_complete(
        tws in prop::collection::vec(tw_strategy(8192), 1..30),
        start in 0u64..4096,
        len in 1u64..4096,
        cuts in prop::collection::vec(1u64..700, 0..12),
        use_next_stop in any::<bool>(),
    ) {
        let eq = EqModel::new(EqParams { nrings: 1, ring_cap: 64, trip_cap: 64, tripset_cap: 1 });
        let cam_m = CamModel::new(8192, 64);
        let mut owner = CamOwner::new();
        for (i, t) in tws.iter().enumerate() {
            add(&eq, &cam_m, &mut owner, i as u32, t.start, t.start + t.len, ARMED | ON_WRITE | ACT_EVENT);
        }
        let v = eq.view();
        let cv = cam_m.view();
        let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
        let end = start + len;
        let landed = RefCell::new(start);
        let fired = RefCell::new(Vec::<(u32, u64)>::new());
        let sink = RecSink::new(|i| fired.borrow_mut().push((i, *landed.borrow())));
        let mut scratch = Vec::new();
        let mut off = start;
        let mut ci = 0;
        while off < end {
            let mut piece = cuts.get(ci).copied().unwrap_or(1 << 20).min(end - off);
            ci += 1;
            if use_next_stop {
                // A receiver that cannot control what arrives stops its pieces at the stops
                // and commits after the bytes landed.
                let s = snoop::next_stop(Access::Write, &watch, off, off + piece, end, &mut scratch);
                piece = s - off;
                *landed.borrow_mut() = off + piece;
                snoop::commit_piece(Access::Write, &watch, &sink, off, piece, end, &mut scratch);
            } else {
                snoop::transfer_piece(Access::Write, &watch, &sink, off, piece, end, &mut scratch, |o, l| {
                    *landed.borrow_mut() = o + l;
                    Ok::<(), ()>(())
                }).unwrap();
            }
            off += piece;
        }
        drop(sink);
        let fired = fired.into_inner();
        for (i, t) in tws.iter().enumerate() {
            let overlaps = t.start < end && start < t.start + t.len;
            let n = fired.iter().filter(|(x, _)| *x == i as u32).count();
            prop_assert_eq!(n, usize::from(overlaps), "tripwire {} fired {} times", i, n);
            if let Some((_, at)) = fired.iter().find(|(x, _)| *x == i as u32) {
                let need = (t.start + t.len).min(end);
                prop_assert!(*at >= need, "tripwire {} fired with bytes up to {} in place, needs {}", i, at, need);
            }
        }
    }
}

/// What an access reads first of an index is in its first cache line: the header's hot
/// words, the wide bits and the first watch bits (up to 256 KiB watched), and for a
/// connection's side (up to 8 KiB) the heads of its first lines; the entries start on a line
/// of their own (for a small buffer the next one), and what identifies the index comes last.
#[test]
fn a_small_index_keeps_what_an_access_reads_first_in_one_line() {
    for len in [64u64, 256, 384, 4096, 8192, 65536, 256 << 10] {
        let l = cam::CamLayout::new(len, 32);
        assert_eq!(l.wide_off, std::mem::size_of::<cam::CamHeader>(), "{len}");
        assert!(l.wide_off + l.wide_words * 8 <= 64, "all wide bits in line 0 ({len})");
        assert!(l.watch_off + 8 <= 64, "the first watch word in line 0 ({len})");
        assert!(l.heads_off >= l.watch_off + l.watch_words * 8);
        assert!(l.entries_off >= l.heads_off + l.nlines as usize * 4 && l.entries_off % 64 == 0);
        assert!(l.meta_off == l.entries_off + 32 * 64 && l.size == l.meta_off + 24);
        if len <= 8192 {
            assert!(l.heads_off + 4 * 4 <= 64, "the heads of the first four lines in line 0 ({len})");
        }
        if len <= 384 {
            assert_eq!(l.entries_off, 64, "the first entries in line 1 ({len})");
        }
    }
}

/// An importer's first look at memory another process laid out: an index or a queue
/// without its magic word, or with another geometry than the import said, is refused.
#[test]
fn headers_of_foreign_memory_are_checked() {
    use std::sync::atomic::Ordering;

    let c = CamModel::new(8192, 16);
    let h = c.view().meta;
    assert!(h.check(8192).is_err(), "an uninitialised index (no magic) is refused");
    h.len.store(8192, Ordering::Relaxed);
    h.magic.store(cam::CAM_MAGIC ^ 1, Ordering::Release);
    assert!(h.check(8192).is_err(), "a wrong magic word is refused");
    h.magic.store(cam::CAM_MAGIC, Ordering::Release);
    assert_eq!(h.check(8192), Ok(()));
    assert!(h.check(4096).is_err(), "an index of another length is refused");

    let p = EqParams { nrings: 1, ring_cap: 64, trip_cap: 0, tripset_cap: 0 };
    let q = EqModel::new(p);
    let h = q.view().header;
    assert!(h.check(&p).is_err(), "an uninitialised queue (no magic) is refused");
    h.nrings.store(1, Ordering::Relaxed);
    h.ring_cap.store(64, Ordering::Relaxed);
    h.magic.store(clan_shm::eq::EQ_MAGIC, Ordering::Release);
    assert_eq!(h.check(&p), Ok(()));
    assert!(h.check(&EqParams { ring_cap: 128, ..p }).is_err(), "another ring size is refused");
    h.magic.store(0, Ordering::Release);
    assert!(h.check(&p).is_err());
}
