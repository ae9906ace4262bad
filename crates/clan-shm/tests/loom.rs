//! Model checks of the lock-free shared-memory algorithms.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p clan-shm --release --test loom`.
//! loom models `SeqCst` fences faithfully (not `SeqCst` accesses), which is exactly what the
//! algorithms rely on.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::thread;

use clan_shm::cam::{self, CamOwner};
use clan_shm::eq::{CamModel, EqModel, EqParams};
use clan_shm::ring::{Consumer, Producer, Taken};
use clan_shm::snoop::{self, Sink, Watch};
use clan_shm::sync::{Futex, ModelFutex};
use clan_shm::trip::{self, ACT_COUNTER, ARMED, Access, ON_WRITE, ONCE, WIDE};

const TAG: u64 = 7;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

fn tiny() -> EqParams {
    EqParams { nrings: 2, ring_cap: 4, trip_cap: 4, tripset_cap: 1 }
}

struct LoomSink {
    futex: ModelFutex,
    posts: AtomicU32,
}

impl LoomSink {
    fn new() -> Self {
        LoomSink { futex: ModelFutex::default(), posts: AtomicU32::new(0) }
    }
}

impl Sink for LoomSink {
    type F = ModelFutex;
    fn futex(&self) -> &ModelFutex {
        &self.futex
    }
    fn post(&self, _qindex: u32, _generation: u32, _access: Access) {
        self.posts.fetch_add(1, Ordering::Relaxed);
    }
}

fn add(eq: &EqModel, cam_m: &CamModel, owner: &mut CamOwner, index: u32, start: u64, end: u64, fl: u32) {
    let v = eq.view();
    let wide = if cam::is_wide(start, end) { WIDE } else { 0 };
    let cell = &v.table.cells[index as usize];
    let cv = cam_m.view();
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
    owner.insert(&cam_m.view(), index, start, end);
}

/// [`snoop::transfer`], or its quick form as `clan`'s window runs it (the whole transfer
/// when something near is watched, the rest of it when the index changed).
fn transfer_either(
    quick: bool,
    access: Access,
    watch: &Watch<'_>,
    sink: &LoomSink,
    off: u64,
    len: u64,
    mut mover: impl FnMut(u64, u64) -> Result<(), ()>,
) -> u32 {
    let mut scratch = Vec::new();
    if !quick {
        return snoop::transfer(access, watch, sink, off, len, &mut scratch, mover).unwrap();
    }
    match snoop::transfer_quick(watch, off, len, &mut mover).unwrap() {
        snoop::Quick::Done => 0,
        snoop::Quick::Finish(seen) | snoop::Quick::Fire { seen, .. } => {
            snoop::finish_transfer(access, watch, sink, off, len, seen, &mut scratch)
        }
        snoop::Quick::Watched => snoop::transfer(access, watch, sink, off, len, &mut scratch, mover).unwrap(),
    }
}

/// [`snoop::transfer_then_store`], or its quick form (as [`transfer_either`]).
#[allow(clippy::too_many_arguments)]
fn then_store_either(
    quick: bool,
    watch: &Watch<'_>,
    sink: &LoomSink,
    off: u64,
    len: u64,
    word_off: u64,
    mut mover: impl FnMut(u64, u64) -> Result<(), ()>,
    store: impl Fn(),
) -> u32 {
    let mut scratch = Vec::new();
    if !quick {
        return snoop::transfer_then_store(watch, sink, off, len, word_off, 8, &mut scratch, mover, store).unwrap();
    }
    match snoop::transfer_then_store_quick(watch, off, len, word_off, 8, &mut mover, &store).unwrap() {
        snoop::Quick::Done => 0,
        snoop::Quick::Finish(seen) => snoop::finish_store(watch, sink, off, len, word_off, 8, seen, &mut scratch),
        snoop::Quick::Fire { seen, armed } => {
            snoop::finish_store_armed(watch, sink, off, len, word_off, 8, seen, &armed, &mut scratch)
        }
        snoop::Quick::Watched => {
            snoop::transfer_then_store(watch, sink, off, len, word_off, 8, &mut scratch, mover, store).unwrap()
        }
    }
}

/// [`snoop::commit`], or its quick form (the whole commit when it cannot settle).
fn commit_either(quick: bool, access: Access, watch: &Watch<'_>, sink: &LoomSink, off: u64, len: u64) -> u32 {
    if quick && snoop::commit_quick(access, watch, off, len) {
        return 0;
    }
    snoop::commit(access, watch, sink, off, len, &mut Vec::new())
}

/// Two producer processes (rings 0 and 1) and a consumer that sleeps whenever it finds the
/// queue empty: every event is taken exactly once and the consumer is never left asleep.
#[test]
fn ring_no_lost_wakeup() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let futex = Arc::new(ModelFutex::default());
        let producers: Vec<_> = (0..2u64)
            .map(|r| {
                let eq = eq.clone();
                let futex = futex.clone();
                thread::spawn(move || {
                    let v = eq.view();
                    let mut p = Producer::new(r as usize);
                    assert!(p.post(&v.rings(), [r + 1, 0, 0, 0], &*futex).stored);
                })
            })
            .collect();
        let v = eq.view();
        let rings = v.rings();
        let mut c = Consumer::new(2);
        let mut got = Vec::new();
        while got.len() < 2 {
            match c.take(&rings) {
                Some(Taken::Event { words, .. }) => got.push(words[0]),
                Some(other) => panic!("unexpected {other:?}"),
                None => clan_shm::ring::sleep(&rings, &*futex, None),
            }
        }
        got.sort();
        assert_eq!(got, vec![1, 2]);
        for p in producers {
            p.join().unwrap();
        }
        assert_eq!(c.take(&rings), None);
    });
}

/// A consumer that armed its ring for its eventfd and later finds it still armed (nothing
/// woke it since) sleeps again without arming: a post racing with that look is never lost —
/// either the look sees it (not still armed), or the producer sees the armed bit and signals.
#[test]
fn ring_still_armed_never_misses_a_post() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let futex = Arc::new(ModelFutex::default());
        let producer = {
            let (eq, futex) = (eq.clone(), futex.clone());
            thread::spawn(move || {
                let v = eq.view();
                let mut p = Producer::new(0);
                p.post(&v.rings(), [7, 0, 0, 0], &*futex)
            })
        };
        let v = eq.view();
        let rings = v.rings();
        // Armed (the post may come before, between or after), then looked at again.
        let armed = clan_shm::ring::arm(&rings, clan_shm::ring::ARM_FD);
        let sleep_again = armed && clan_shm::ring::still_armed(&rings, clan_shm::ring::ARM_FD);
        let posted = producer.join().unwrap();
        assert!(posted.stored);
        if sleep_again {
            assert!(posted.signal_fd, "the consumer sleeps without arming: the post must signal it");
        }
        // Signalled once: the bit is gone, and the next look says so.
        if posted.signal_fd {
            assert!(!clan_shm::ring::still_armed(&rings, clan_shm::ring::ARM_FD));
        }
    });
}

/// One producer posting twice into one ring while the consumer drains and sleeps.
#[test]
fn ring_same_ring_order() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let futex = Arc::new(ModelFutex::default());
        let p = {
            let eq = eq.clone();
            let futex = futex.clone();
            thread::spawn(move || {
                let v = eq.view();
                let mut p = Producer::new(1);
                p.post(&v.rings(), [10, 0, 0, 0], &*futex);
                p.post(&v.rings(), [11, 0, 0, 0], &*futex);
            })
        };
        let v = eq.view();
        let rings = v.rings();
        let mut c = Consumer::new(2);
        let mut got = Vec::new();
        while got.len() < 2 {
            match c.take(&rings) {
                Some(Taken::Event { words, .. }) => got.push(words[0]),
                Some(other) => panic!("unexpected {other:?}"),
                None => clan_shm::ring::sleep(&rings, &*futex, None),
            }
        }
        assert_eq!(got, vec![10, 11], "FIFO within a ring");
        p.join().unwrap();
    });
}

/// Of two concurrent firers of a once-only tripwire, exactly one performs the actions.
#[test]
fn once_only_fires_exactly_once() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(64, 4));
        add(&eq, &cam_m, &mut CamOwner::new(), 0, 0, 8, ARMED | ONCE | ON_WRITE | ACT_COUNTER);
        let futex = Arc::new(ModelFutex::default());
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let (eq, futex) = (eq.clone(), futex.clone());
                thread::spawn(move || trip::fire(&eq.view().table, 0, 1, Access::Write, &*futex).fired())
            })
            .collect();
        let wins = ts.into_iter().map(|t| t.join().unwrap()).filter(|&w| w).count();
        assert_eq!(wins, 1);
        assert_eq!(eq.view().table.cells[0].count.load(Ordering::Relaxed), 1);
    });
}

/// A tripwire inserted into the index while a write to its range is in flight: either the
/// write fires it, or the arming side sees the written data (no lost wake-up).
#[test]
fn arm_by_insert_vs_write() {
    for quick in [false, true] {
        arm_by_insert_vs_write_with(quick);
    }
}

fn arm_by_insert_vs_write_with(quick: bool) {
    model(move || {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(256, 4));
        let data = Arc::new(AtomicU64::new(0));
        let sink = Arc::new(LoomSink::new());
        let writer = {
            let (eq, cam_m, data, sink) = (eq.clone(), cam_m.clone(), data.clone(), sink.clone());
            thread::spawn(move || {
                let v = eq.view();
                let cv = cam_m.view();
                let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                transfer_either(quick, Access::Write, &watch, &sink, 0, 8, |_, _| {
                    data.store(1, Ordering::Relaxed);
                    Ok(())
                })
            })
        };
        let mut owner = CamOwner::new();
        add(&eq, &cam_m, &mut owner, 0, 0, 8, ARMED | ON_WRITE | ACT_COUNTER);
        // `insert` ends with the epoch bump and fence: now re-check the data.
        let saw = data.load(Ordering::Relaxed) == 1;
        let fired = writer.join().unwrap();
        assert!(fired == 1 || saw, "lost wake-up: tripwire not fired and data not seen");
    });
}

/// Arming an indexed, disarmed tripwire while a write is in flight.
#[test]
fn arm_by_enable_vs_write() {
    for quick in [false, true] {
        arm_by_enable_vs_write_with(quick);
    }
}

fn arm_by_enable_vs_write_with(quick: bool) {
    model(move || {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(256, 4));
        let mut owner = CamOwner::new();
        add(&eq, &cam_m, &mut owner, 0, 0, 8, ON_WRITE | ACT_COUNTER);
        let data = Arc::new(AtomicU64::new(0));
        let sink = Arc::new(LoomSink::new());
        let writer = {
            let (eq, cam_m, data, sink) = (eq.clone(), cam_m.clone(), data.clone(), sink.clone());
            thread::spawn(move || {
                let v = eq.view();
                let cv = cam_m.view();
                let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                transfer_either(quick, Access::Write, &watch, &sink, 0, 8, |_, _| {
                    data.store(1, Ordering::Relaxed);
                    Ok(())
                })
            })
        };
        assert!(trip::set_armed(
            &cam_m.view().entries[0],
            cam_m.view().armed_count(),
            &eq.view().table.cells[0],
            0,
            1,
            true
        ));
        let saw = data.load(Ordering::Relaxed) == 1;
        let fired = writer.join().unwrap();
        assert!(fired == 1 || saw, "lost wake-up");
    });
}

/// The owner re-arms a once-only tripwire while an earlier claim fires it (and mirrors the
/// disarm) and another process writes: the writer looks at the mirror only. A late mirror of
/// the firing must not hide the re-arming: either the writer sees it armed and its claim fires
/// it, or the owner's re-check sees the data.
#[test]
fn once_fire_mirror_vs_rearm_vs_claimant() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(64, 4));
        add(&eq, &cam_m, &mut CamOwner::new(), 0, 0, 8, ARMED | ONCE | ON_WRITE | ACT_COUNTER);
        let data = Arc::new(AtomicU64::new(0));
        let futex = Arc::new(ModelFutex::default());
        // The owner's pump, serving an earlier claim.
        let pump = {
            let (eq, cam_m, futex) = (eq.clone(), cam_m.clone(), futex.clone());
            thread::spawn(move || {
                let v = eq.view();
                let f = trip::fire(&v.table, 0, 1, Access::Write, &*futex);
                if f.disarmed() {
                    trip::mirror(&cam_m.view().entries[0], cam_m.view().armed_count(), &v.table.cells[0], 0);
                }
            })
        };
        // Another process: store, fence, look at the mirror, claim (served by the owner).
        let writer = {
            let (eq, cam_m, data, futex) = (eq.clone(), cam_m.clone(), data.clone(), futex.clone());
            thread::spawn(move || {
                data.store(1, Ordering::Relaxed);
                loom::sync::atomic::fence(Ordering::SeqCst);
                if trip::would_fire(&cam_m.view().entries[0], 1, Access::Write) {
                    let v = eq.view();
                    let f = trip::fire(&v.table, 0, 1, Access::Write, &*futex);
                    if f.disarmed() {
                        trip::mirror(&cam_m.view().entries[0], cam_m.view().armed_count(), &v.table.cells[0], 0);
                    }
                }
            })
        };
        // The owner re-arms, then re-checks the data.
        let v = eq.view();
        assert!(trip::set_armed(&cam_m.view().entries[0], cam_m.view().armed_count(), &v.table.cells[0], 0, 1, true));
        let saw = data.load(Ordering::Relaxed) == 1;
        pump.join().unwrap();
        writer.join().unwrap();
        assert!(saw || !trip::is_armed(&v.table.cells[0], 1), "lost wake-up: re-armed, not fired, data unseen");
        // At rest the mirror is the cell.
        assert_eq!(
            cam_m.view().entries[0].state.load(Ordering::Relaxed),
            v.table.cells[0].state.load(Ordering::Relaxed),
            "mirror out of date"
        );
    });
}

/// A claim that names the entry of a retired tripwire whose cell was published again (for
/// another entry) does not write that cell's state into the old entry.
#[test]
fn stale_mirror_does_not_cross_entries() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(64, 4));
        add(&eq, &cam_m, &mut CamOwner::new(), 0, 0, 8, ARMED | ONCE | ON_WRITE);
        let late = {
            let (eq, cam_m) = (eq.clone(), cam_m.clone());
            thread::spawn(move || {
                let v = eq.view();
                trip::mirror(&cam_m.view().entries[0], cam_m.view().armed_count(), &v.table.cells[0], 0);
            })
        };
        // The owner retires entry 0 and publishes queue index 0 again, in entry 1.
        let v = eq.view();
        let cv = cam_m.view();
        let c0 = &v.table.cells[0];
        trip::retire(&cv.entries[0], cv.armed_count(), c0, 0);
        trip::publish(&cv.entries[1], cv.armed_count(), c0, 2, ARMED | ON_WRITE, 16, 24, TAG, 0, trip::NO_SOURCE);
        late.join().unwrap();
        let s0 = cv.entries[0].state.load(Ordering::Relaxed);
        assert_eq!(trip::generation(s0), 1, "entry 0 keeps its own generation");
        assert_eq!(trip::flags(s0) & trip::LIVE, 0, "entry 0 stays retired");
        assert_eq!(cv.entries[1].state.load(Ordering::Relaxed), c0.state.load(Ordering::Relaxed));
    });
}

/// A thread blocked on a tripwire is always woken by its firing.
#[test]
fn tripwire_wait_no_lost_wakeup() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(64, 4));
        add(&eq, &cam_m, &mut CamOwner::new(), 0, 0, 8, ARMED | ON_WRITE);
        let futex = Arc::new(ModelFutex::default());
        let firer = {
            let (eq, futex) = (eq.clone(), futex.clone());
            thread::spawn(move || {
                trip::fire(&eq.view().table, 0, 1, Access::Write, &*futex);
            })
        };
        let v = eq.view();
        let c = &v.table.cells[0];
        let ok = trip::wait_until(&c.seq, &c.waiters, std::time::Duration::ZERO, None, &*futex, || {
            c.seq.load(Ordering::Acquire) != 0
        });
        assert!(ok);
        firer.join().unwrap();
    });
}

/// A tripset waiter that links a member concurrently with its firing is always woken.
#[test]
fn tripset_link_vs_fire() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(64, 4));
        add(&eq, &cam_m, &mut CamOwner::new(), 0, 0, 8, ARMED | ON_WRITE);
        let futex = Arc::new(ModelFutex::default());
        let firer = {
            let (eq, futex) = (eq.clone(), futex.clone());
            thread::spawn(move || {
                trip::fire(&eq.view().table, 0, 1, Access::Write, &*futex);
            })
        };
        let v = eq.view();
        let ts = &v.table.tripsets[0];
        let c = &v.table.cells[0];
        // Link the member and record its sequence, then wait on the set's word.
        c.tripset.store(1, Ordering::Relaxed);
        let ok = trip::wait_until(&ts.seq, &ts.waiters, std::time::Duration::ZERO, None, &*futex, || {
            c.seq.load(Ordering::Acquire) != 0
        });
        assert!(ok);
        firer.join().unwrap();
    });
}

/// The owner unlinks entry A (head of a list) and reuses it elsewhere while a writer walks
/// the list towards entry B: the writer may be led astray, but the epoch makes it look again,
/// so B (armed before the write) still fires.
#[test]
fn relink_under_walker_still_fires() {
    for quick in [false, true] {
        relink_under_walker_still_fires_with(quick);
    }
}

fn relink_under_walker_still_fires_with(quick: bool) {
    model(move || {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(2048, 4));
        let mut owner = CamOwner::new();
        add(&eq, &cam_m, &mut owner, 1, 8, 16, ARMED | ON_WRITE | ACT_COUNTER); // B
        add(&eq, &cam_m, &mut owner, 0, 0, 8, ARMED | ON_WRITE | ACT_COUNTER); // A, head
        let sink = Arc::new(LoomSink::new());
        let writer = {
            let (eq, cam_m, sink) = (eq.clone(), cam_m.clone(), sink.clone());
            thread::spawn(move || {
                let v = eq.view();
                let cv = cam_m.view();
                let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                transfer_either(quick, Access::Write, &watch, &sink, 8, 8, |_, _| Ok(()));
            })
        };
        let cv = cam_m.view();
        let a = &cv.entries[0];
        let v = eq.view();
        let c0 = &v.table.cells[0];
        trip::retire(a, cv.armed_count(), c0, 0);
        owner.remove(&cv, 0, 0, 8);
        trip::publish(a, cv.armed_count(), c0, 2, ARMED | ON_WRITE, 1024, 1032, TAG, 0, trip::NO_SOURCE);
        owner.insert(&cv, 0, 1024, 1032);
        writer.join().unwrap();
        assert_eq!(eq.view().table.cells[1].count.load(Ordering::Relaxed), 1, "B must fire exactly once");
    });
}

/// A word stored atomically and then committed (one fence) against an insertion.
#[test]
fn arm_by_insert_vs_word_store_commit() {
    for quick in [false, true] {
        arm_by_insert_vs_word_store_commit_with(quick);
    }
}

fn arm_by_insert_vs_word_store_commit_with(quick: bool) {
    model(move || {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(256, 4));
        let data = Arc::new(AtomicU64::new(0));
        let sink = Arc::new(LoomSink::new());
        let writer = {
            let (eq, cam_m, data, sink) = (eq.clone(), cam_m.clone(), data.clone(), sink.clone());
            thread::spawn(move || {
                let v = eq.view();
                let cv = cam_m.view();
                let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                data.store(1, Ordering::Relaxed);
                commit_either(quick, Access::Write, &watch, &sink, 0, 8)
            })
        };
        let mut owner = CamOwner::new();
        add(&eq, &cam_m, &mut owner, 0, 0, 8, ARMED | ON_WRITE | ACT_COUNTER);
        let saw = data.load(Ordering::Relaxed) == 1;
        let fired = writer.join().unwrap();
        assert!(fired == 1 || saw, "lost wake-up");
    });
}

/// A consumer that settles stale summary bits before deciding to sleep never sleeps past
/// an event.
#[test]
fn settle_then_sleep_no_lost_wakeup() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let futex = Arc::new(ModelFutex::default());
        // One event already taken, leaving a stale summary bit, then a concurrent post.
        {
            let v = eq.view();
            let mut p = Producer::new(1);
            p.post(&v.rings(), [1, 0, 0, 0], &*futex);
        }
        let mut c = Consumer::new(2);
        {
            let v = eq.view();
            assert!(matches!(c.take(&v.rings()), Some(Taken::Event { .. })));
        }
        let producer = {
            let (eq, futex) = (eq.clone(), futex.clone());
            thread::spawn(move || {
                let v = eq.view();
                let mut p = Producer::resume(1, 1);
                p.post(&v.rings(), [2, 0, 0, 0], &*futex);
            })
        };
        let v = eq.view();
        let rings = v.rings();
        loop {
            if let Some(Taken::Event { words, .. }) = c.take(&rings) {
                assert_eq!(words[0], 2);
                break;
            }
            let seen = rings.words.wake.load(Ordering::Acquire);
            if !clan_shm::ring::arm(&rings, clan_shm::ring::ARM_FUTEX) {
                c.settle(&rings);
                if clan_shm::ring::maybe_nonempty(&rings) {
                    continue;
                }
            }
            futex.wait(&rings.words.wake, seen, None);
        }
        producer.join().unwrap();
    });
}

/// DMA doorbell: a producer publishes two requests and rings only when it finds the queue
/// idle; the engine services until empty, then goes idle and sleeps on its bell. No request
/// is ever left in an idle queue (the engine would sleep forever: loom reports the
/// deadlock), and the queue is never owned twice (on the list and/or being serviced).
#[test]
fn doorbell_no_lost_request() {
    use clan_shm::doorbell::{Bell, Schedule};
    struct S {
        sched: Schedule,
        tail: AtomicU64,
        tokens: AtomicU32,
        owners: AtomicU32,
        bell: Bell,
        futex: ModelFutex,
    }
    model(|| {
        let s = Arc::new(S {
            sched: Schedule::new(),
            tail: AtomicU64::new(0),
            tokens: AtomicU32::new(0),
            owners: AtomicU32::new(0),
            bell: Bell::new(),
            futex: ModelFutex::default(),
        });
        let p = {
            let s = s.clone();
            thread::spawn(move || {
                for _ in 0..2 {
                    // SYNC POINT: publishes the request to the engine's Acquire load of `tail`.
                    s.tail.fetch_add(1, Ordering::Release);
                    if s.sched.after_publish() {
                        assert_eq!(s.owners.fetch_add(1, Ordering::SeqCst), 0, "queue scheduled twice");
                        s.tokens.fetch_add(1, Ordering::SeqCst);
                        s.bell.ring(&s.futex);
                    }
                }
            })
        };
        let mut head = 0u64;
        while head < 2 {
            trip::wait_until(&s.bell.count, &s.bell.sleepers, std::time::Duration::ZERO, None, &s.futex, || {
                s.tokens.load(Ordering::SeqCst) > 0
            });
            s.tokens.fetch_sub(1, Ordering::SeqCst);
            loop {
                while head < s.tail.load(Ordering::Acquire) {
                    head += 1;
                }
                s.owners.fetch_sub(1, Ordering::SeqCst);
                if !s.sched.on_empty(|| head == s.tail.load(Ordering::Acquire)) {
                    break;
                }
                assert_eq!(s.owners.fetch_add(1, Ordering::SeqCst), 0, "queue scheduled twice");
            }
        }
        p.join().unwrap();
    });
}

/// A message then its flag with one fence (`transfer_then_store`), against a receiver that
/// arms a tripwire on the flag (enable) or on the message (insert) and re-checks: it sees
/// the store, or the tripwire fires.
#[test]
fn write_then_store_vs_arm() {
    for (on_flag, quick) in [(true, false), (false, false), (true, true), (false, true)] {
        model(move || {
            let eq = Arc::new(EqModel::new(tiny()));
            let cam_m = Arc::new(CamModel::new(256, 4));
            let mut owner = CamOwner::new();
            // The flag at 128..136, the message at 0..8.
            if on_flag {
                add(&eq, &cam_m, &mut owner, 0, 128, 136, ON_WRITE | ACT_COUNTER);
            }
            let (data, flag) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let sink = Arc::new(LoomSink::new());
            let writer = {
                let (eq, cam_m, data, flag, sink) =
                    (eq.clone(), cam_m.clone(), data.clone(), flag.clone(), sink.clone());
                thread::spawn(move || {
                    let v = eq.view();
                    let cv = cam_m.view();
                    let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                    then_store_either(
                        quick,
                        &watch,
                        &sink,
                        0,
                        8,
                        128,
                        |_, _| {
                            data.store(1, Ordering::Relaxed);
                            Ok(())
                        },
                        || flag.store(1, Ordering::Release),
                    )
                })
            };
            let saw = if on_flag {
                assert!(trip::set_armed(
                    &cam_m.view().entries[0],
                    cam_m.view().armed_count(),
                    &eq.view().table.cells[0],
                    0,
                    1,
                    true
                ));
                flag.load(Ordering::Acquire) == 1
            } else {
                add(&eq, &cam_m, &mut owner, 0, 0, 8, ARMED | ON_WRITE | ACT_COUNTER);
                data.load(Ordering::Relaxed) == 1
            };
            let fired = writer.join().unwrap();
            assert!(fired == 1 || saw, "lost wake-up (tripwire on the {})", if on_flag { "flag" } else { "message" });
        });
    }
}

/// The count of armed mirrors never drops below them, however an arming and a firing of
/// another entry race: entry A is armed throughout; entry B (once-only) is armed by one
/// thread while another's write fires it (its mirror disarmed and uncounted). A write to
/// A's word that reads the count after its fence must still find A to fire: had B's arming
/// counted itself after its mirror said armed, B's firing could uncount it first, and the
/// count read 0 with A armed.
#[test]
fn armed_count_never_below_the_armed_mirrors() {
    model(|| {
        let eq = Arc::new(EqModel::new(tiny()));
        let cam_m = Arc::new(CamModel::new(256, 4));
        let mut owner = CamOwner::new();
        add(&eq, &cam_m, &mut owner, 0, 128, 136, ARMED | ON_WRITE | ACT_COUNTER);
        add(&eq, &cam_m, &mut owner, 1, 0, 8, ONCE | ON_WRITE);
        let sink = Arc::new(LoomSink::new());
        let arm_b = {
            let (eq, cam_m) = (eq.clone(), cam_m.clone());
            thread::spawn(move || {
                let cv = cam_m.view();
                assert!(trip::set_armed(&cv.entries[1], cv.armed_count(), &eq.view().table.cells[1], 1, 1, true));
            })
        };
        let fire_b = {
            let (eq, cam_m, sink) = (eq.clone(), cam_m.clone(), sink.clone());
            thread::spawn(move || {
                let v = eq.view();
                let cv = cam_m.view();
                let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
                snoop::transfer(Access::Write, &watch, &*sink, 0, 8, &mut Vec::new(), |_, _| Ok::<(), ()>(())).unwrap();
            })
        };
        {
            let v = eq.view();
            let cv = cam_m.view();
            let watch = Watch { cam: &cv, table: &v.table, tag: TAG };
            then_store_either(true, &watch, &sink, 0, 0, 128, |_, _| Ok(()), || {});
        }
        arm_b.join().unwrap();
        fire_b.join().unwrap();
        assert_eq!(eq.view().table.cells[0].count.load(Ordering::Relaxed), 1, "A was armed: its word's write fires it");
    });
}

/// The engine parks a link while a thread drives; the driver then stops to sleep. Either
/// the engine did not park (it saw the driver gone) or the driver asks for the links back:
/// a sleeping thread is never left with parked links.
#[test]
fn handoff_park_vs_driver_going_to_sleep() {
    use clan_shm::handoff::Handoff;
    model(|| {
        let h = Arc::new(Handoff::default());
        h.begin();
        let asked = Arc::new(AtomicU32::new(0));
        let (h2, a2) = (h.clone(), asked.clone());
        let driver = thread::spawn(move || {
            if h2.end(true) {
                a2.store(1, Ordering::Relaxed);
            }
        });
        let parked = h.try_park();
        if !parked {
            h.unparked();
        }
        driver.join().unwrap();
        assert!(!parked || asked.load(Ordering::Relaxed) == 1, "links parked and nobody asked for them back");
    });
}

/// Links are parked for a driver; a thread that relies on the engine goes to sleep while
/// the driver stops (not to sleep). One of them asks for the links back.
#[test]
fn handoff_last_driver_vs_sleeper() {
    use clan_shm::handoff::Handoff;
    model(|| {
        let h = Arc::new(Handoff::default());
        h.begin();
        assert!(h.try_park(), "a driver is there: the engine parks");
        let asked = Arc::new(AtomicU32::new(0));
        let (h2, a2) = (h.clone(), asked.clone());
        let driver = thread::spawn(move || {
            if h2.end(false) {
                a2.fetch_add(1, Ordering::Relaxed);
            }
        });
        if h.sleep_begin() {
            asked.fetch_add(1, Ordering::Relaxed);
        }
        driver.join().unwrap();
        assert!(asked.load(Ordering::Relaxed) >= 1, "a sleeper relies on parked links with no driver left");
        h.sleep_end();
    });
}

/// A changer tells waiters only when `Waiters` counts some (`clan::conn`'s dials and the
/// connections that end under them): a waiter that looked before the change is told, one
/// that looks after sees it; never asleep for good.
#[test]
fn waiters_no_lost_wakeup() {
    use clan_shm::waiters::Waiters;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::{Condvar, Mutex};
    model(|| {
        let s = Arc::new((Mutex::new(()), Condvar::new(), AtomicBool::new(false), Waiters::new()));
        let s2 = s.clone();
        let waiter = thread::spawn(move || {
            let (lock, cv, done, waiters) = &*s2;
            waiters.enter();
            let mut g = lock.lock().unwrap();
            while !done.load(Ordering::Acquire) {
                g = cv.wait(g).unwrap();
            }
            drop(g);
            waiters.leave();
        });
        let (lock, cv, done, waiters) = &*s;
        done.store(true, Ordering::Release);
        if waiters.any_after_change() {
            drop(lock.lock().unwrap());
            cv.notify_all();
        }
        waiter.join().unwrap();
    });
}
