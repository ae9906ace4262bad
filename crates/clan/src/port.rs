//! Ports: how another process reaches one of our event queues, and nothing else of it.
//!
//! Every other process that imports an aperture whose tripwires report to one of our queues
//! gets a *port* in that queue: a memfd of its own holding one event ring (`clan_shm::eq`
//! with one ring and no table), and an eventfd. The process is the unit, not its connections:
//! a process that opens many connections (or NICs) still has one port per queue, and a queue
//! gives at most [`crate::EventQueueConfig::producers`] ports, at most
//! [`crate::EventQueueConfig::producers_per_user`] of them to processes of one user.
//!
//! The importing process never maps anything else of the queue: its writes and reads of our
//! apertures find the tripwires to fire in the aperture's index (read-only to it), and it
//! posts a *claim* ([`Word::Claim`]) on its port for each; the queue's owner **pumps** the
//! ports ([`EqInner::pump`]) and fires the claimed tripwires itself, after checking that the
//! process holds a grant of that aperture with the rights the access needs. A claim is a
//! request, never a fact: a lying process can at most fire the tripwires of apertures it may
//! write (or read) anyway — spurious events, which every protocol tolerates — and can never
//! touch another process's port, another aperture's tripwires, or the queue's own state. A
//! port that overflows loses claims: the owner then fires every armed tripwire the process
//! could have fired (a spurious wake-up instead of a lost one) and reports the overflow.
//!
//! The importing side keeps one producer per port per process (a ring has exactly one
//! producer): [`attach`] shares it between every NIC of the process.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use clan_shm::eq::{EqLayout, EqMap, EqParams};
use clan_shm::eventfd::EventFd;
use clan_shm::memfd::Memfd;
use clan_shm::ring::{self, Consumer, Producer, Taken};
use clan_shm::segment::{Access as SegAccess, Segment};
use clan_shm::trip::{self, Access};
use clan_wire::grant::Refusal;

use crate::addr::NicAddr;
use crate::descriptor::Rights;
use crate::event_queue::{EqInner, EqPort, Word};
use crate::lock;

/// Words taken from one port in one pump, at most (a flooding process cannot hold the
/// consumer up).
const PUMP_BATCH: usize = 256;
/// Claims taken at once from a port, their lines asked for together (`pump_port`).
const PUMP_AHEAD: usize = 8;

/// Most ports a sleeper waits on with one `futex_waitv` (with its own word and the epoch);
/// a queue with more sleeps through its epoll descriptor (`crate::wake`).
pub(crate) const WAITV_PORTS: usize = clan_shm::futex::WAIT_ANY_MAX - 2;
/// Links a queue's sleeper drives itself at most (`EqInner::link_driver`): beyond, the
/// engine alone serves them while threads sleep. (A sleep costs the same whatever their
/// number: the set is synchronised when the links change, and a wake-up reads only the
/// sockets that woke it.)
const DRIVEN_LINKS: usize = 4096;

/// The geometry of a port of a queue whose rings hold `ring_cap` events.
pub(crate) fn port_layout(ring_cap: u32) -> EqLayout {
    EqLayout::new(EqParams { nrings: 1, ring_cap, trip_cap: 0, tripset_cap: 0 })
}

/// Our side of another process's port.
pub(crate) struct PortRec {
    pub id: u64,
    pub pid: u32,
    pub uid: u32,
    pub memfd: Memfd,
    pub eventfd: Arc<EventFd>,
    map: EqMap,
    /// The consumer side: taken while pumping (by one thread at a time).
    side: Mutex<PortSide>,
    /// Its connections that were given the port (it is retired with the last).
    conns: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for PortRec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortRec").field("id", &self.id).field("pid", &self.pid).field("uid", &self.uid).finish()
    }
}

/// The consumer's side of a port: its ring consumer, and what its process was granted,
/// under the one lock a pump takes anyway.
#[derive(Debug)]
struct PortSide {
    consumer: Consumer,
    grants: Grants,
}

/// The apertures a process was granted, with the union of its rights, indexed by aperture
/// id (dense: ids are slots of the NIC's aperture table). What a claim checks is packed in
/// one word per aperture (`checks`: 8 bytes, a thousand apertures in 8 KiB, which stay in
/// the cache); the rest, for the rarer paths, is beside it.
#[derive(Debug, Default)]
struct Grants {
    /// `generation << 8 | PRESENT | rights`; 0 for none.
    checks: Vec<u64>,
    rest: Vec<Option<Grant>>,
}

const PRESENT: u64 = 0x80;

/// What a process was granted of one aperture, beside its check word.
#[derive(Debug, Clone)]
struct Grant {
    rights: Rights,
    /// The aperture's index: mirroring a once-only firing (a claim names its entry); dropped
    /// when the aperture is unexported.
    cam: Arc<clan_shm::eq::CamMap>,
    /// For re-synchronising a port that lost claims (rare).
    watch: Weak<crate::tripwire::WatchOwner>,
}

impl Grants {
    fn check_word(generation: u32, rights: Rights) -> u64 {
        (u64::from(generation) << 8) | PRESENT | u64::from(rights.bits())
    }

    /// Whether aperture `(id, generation)` was granted with rights including `need`.
    #[inline]
    fn allows(&self, id: u32, generation: u32, need: Rights) -> bool {
        let want = u64::from(need.bits());
        self.checks
            .get(id as usize)
            .is_some_and(|&w| w & PRESENT != 0 && (w >> 8) as u32 == generation && w & want == want)
    }
}

/// The ports of one queue.
#[derive(Debug, Default)]
pub(crate) struct Ports {
    list: RwLock<Vec<Arc<PortRec>>>,
    next_id: std::sync::atomic::AtomicU64,
    /// `list.len()`, readable without the lock (the common case: no port at all).
    count: std::sync::atomic::AtomicUsize,
    /// Bumped (and woken) when a port is added: sleepers sleep on it too, and look again.
    epoch: AtomicU32,
}

impl EqInner {
    /// The port of process `pid` (of user `uid`), given to it through connection `conn`:
    /// its existing one, or a new one within the queue's limits.
    pub fn port_for(&self, pid: u32, uid: u32, conn: u64) -> Result<Arc<PortRec>, Refusal> {
        let mut list = self.ports.list.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = list.iter().find(|p| p.pid == pid && p.uid == uid) {
            lock(&p.conns).insert(conn);
            return Ok(p.clone());
        }
        let of_user = list.iter().filter(|p| p.uid == uid).count();
        if list.len() >= self.config.producers as usize || of_user >= self.config.producers_per_user as usize {
            tracing::info!(queue = self.id, pid, uid, ports = list.len(), of_user, "no port for another process");
            return Err(Refusal::TooManyProducers);
        }
        let layout = port_layout(self.layout.params.ring_cap);
        let memfd = Memfd::create("clan-port", layout.size as u64).map_err(|_| Refusal::TooMany)?;
        let seg = Segment::map(&memfd, 0, layout.size, SegAccess::ReadWrite).map_err(|_| Refusal::TooMany)?;
        let map = EqMap::new(Arc::new(seg), layout).map_err(|_| Refusal::TooMany)?;
        {
            let h = map.view().header;
            h.nrings.store(layout.params.nrings, Ordering::Relaxed);
            h.ring_cap.store(layout.params.ring_cap, Ordering::Relaxed);
            // SYNC POINT: pairs with the producer's Acquire load in `EqHeader::check` (in
            // `attach`), after the geometry above.
            h.magic.store(clan_shm::eq::EQ_MAGIC, Ordering::Release);
        }
        // Armed from the start: a sleeper that armed the ports before this one existed is
        // woken by its first post (one signal; later ones only while armed again).
        map.view().header.words.armed.store(ring::ARM_FD, Ordering::Relaxed);
        let eventfd = Arc::new(EventFd::new().map_err(|_| Refusal::TooMany)?);
        let id = self.ports.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        self.sleepers.watch(&eventfd, id).map_err(|_| Refusal::TooMany)?;
        let p = Arc::new(PortRec {
            id,
            pid,
            uid,
            memfd,
            eventfd,
            map,
            side: Mutex::new(PortSide { consumer: Consumer::new(1), grants: Grants::default() }),
            conns: Mutex::new(HashSet::from([conn])),
        });
        list.push(p.clone());
        self.ports.count.store(list.len(), Ordering::Release);
        drop(list);
        // Sleepers that took their list of ports before this one look again (they sleep on
        // the epoch too, read before the list): SYNC POINT, pairs with their Acquire load.
        self.ports.epoch.fetch_add(1, Ordering::Release);
        clan_shm::futex::wake_all(&self.ports.epoch);
        tracing::debug!(queue = self.id, pid, uid, port = id, "port given");
        Ok(p)
    }

    /// Record that the process of `port` was granted aperture `(id, generation)` with
    /// `rights`: its claims on it are honoured from now on.
    pub fn grant(&self, port: &PortRec, ap: &Arc<crate::aperture::ApertureInner>, rights: Rights) {
        let mut side = lock(&port.side);
        let g = &mut side.grants;
        let i = ap.id as usize;
        if g.checks.len() <= i {
            g.checks.resize(i + 1, 0);
            g.rest.resize(i + 1, None);
        }
        let same = g.checks[i] & PRESENT != 0 && (g.checks[i] >> 8) as u32 == ap.generation;
        match &mut g.rest[i] {
            // Another grant of the same aperture: the union of the rights.
            Some(x) if same => x.rights = x.rights | rights,
            // The first, or of a new generation of that id (the old aperture is gone).
            slot => *slot = Some(Grant { rights, cam: ap.watch.cam.clone(), watch: Arc::downgrade(&ap.watch) }),
        }
        let all = g.rest[i].as_ref().map_or(rights, |x| x.rights);
        g.checks[i] = Grants::check_word(ap.generation, all);
    }

    /// Aperture `(id, generation)` was unexported: no claim on it is honoured any more, and
    /// the ports let go of its index.
    pub fn revoke_grants(&self, id: u32, generation: u32) {
        if self.ports.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let list = self.ports.list.read().unwrap_or_else(|e| e.into_inner());
        for p in list.iter() {
            let mut side = lock(&p.side);
            let g = &mut side.grants;
            if let Some(w) = g.checks.get_mut(id as usize) {
                if *w & PRESENT != 0 && (*w >> 8) as u32 == generation {
                    *w = 0;
                    g.rest[id as usize] = None;
                }
            }
        }
    }

    /// Connection `conn` closed: a port none of whose connections is left is retired (what
    /// it published is applied first).
    pub fn release_conn(&self, conn: u64) {
        let gone: Vec<Arc<PortRec>> = {
            let mut list = self.ports.list.write().unwrap_or_else(|e| e.into_inner());
            let mut gone = Vec::new();
            list.retain(|p| {
                let mut c = lock(&p.conns);
                if c.remove(&conn) && c.is_empty() {
                    gone.push(p.clone());
                    false
                } else {
                    true
                }
            });
            self.ports.count.store(list.len(), Ordering::Release);
            gone
        };
        for p in gone {
            // A producer killed between publishing and setting its summary bit: set it.
            p.map.view().header.words.summary[0].fetch_or(1, Ordering::AcqRel);
            self.pump_port(&p, &mut lock(&p.side), None);
            self.sleepers.unwatch(&p.eventfd);
            tracing::debug!(queue = self.id, pid = p.pid, port = p.id, "port retired");
        }
    }

    /// Apply what the ports hold (claims fire their tripwires; events go to our ring).
    /// Returns whether anything was taken. Ports another thread is pumping are skipped.
    pub fn pump(&self) -> bool {
        self.pump_into(None)
    }

    /// [`EqInner::pump`], the first event for our ring going to `first` instead if given
    /// (and empty): the caller takes it without a round through the ring.
    pub fn pump_into(&self, mut first: Option<&mut Option<Word>>) -> bool {
        if self.ports.count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let list = self.ports.list.read().unwrap_or_else(|e| e.into_inner());
        let mut any = false;
        for p in list.iter() {
            // A plain load first: a quiet port costs no lock (its producer sets the summary
            // bit after every post, and only the consumer clears it).
            if !ring::maybe_nonempty(&p.map.view().rings()) {
                continue;
            }
            if let Ok(mut side) = p.side.try_lock() {
                any |= self.pump_port(p, &mut side, first.as_deref_mut());
            }
        }
        any
    }

    fn pump_port(&self, p: &PortRec, side: &mut PortSide, mut first: Option<&mut Option<Word>>) -> bool {
        let PortSide { consumer: c, grants } = side;
        let v = p.map.view();
        let rings = v.rings();
        let mut n = 0;
        // Taken a few at a time: the grant and tripwire cell of each claim of a batch are
        // asked for first, so that their cache misses overlap (at thousands of connections
        // each is a miss, and a server with many calls in flight finds several claims at
        // once). Applied in the order taken.
        while n < PUMP_BATCH {
            let Some(t0) = c.take(&rings) else { break };
            let Some(t1) = c.take(&rings) else {
                // One alone (the common case with one call in flight): nothing to overlap.
                self.apply_taken(grants, t0, first.as_deref_mut());
                n += 1;
                break;
            };
            let mut got = [None; PUMP_AHEAD];
            (got[0], got[1]) = (Some(t0), Some(t1));
            let mut k = 2;
            while k < PUMP_AHEAD && n + k < PUMP_BATCH {
                match c.take(&rings) {
                    Some(t) => {
                        got[k] = Some(t);
                        k += 1;
                    }
                    None => break,
                }
            }
            for t in got[..k].iter().flatten() {
                if let Taken::Event { words, .. } = t {
                    self.prefetch_claim(grants, *words);
                }
            }
            for t in got[..k].iter_mut().filter_map(Option::take) {
                self.apply_taken(grants, t, first.as_deref_mut());
            }
            n += k;
            if k < PUMP_AHEAD {
                break;
            }
        }
        n > 0
    }

    /// Ask for the lines a claim's check will read: its grant and its tripwire's cell.
    fn prefetch_claim(&self, grants: &Grants, words: [u64; 4]) {
        if let Some(Word::Claim { aperture, qindex, .. }) = Word::decode(words) {
            if let Some(w) = grants.checks.get(aperture as usize) {
                clan_shm::prefetch::value(w);
            }
            if let Some(c) = self.view().table.cell(qindex) {
                clan_shm::prefetch::value(c);
            }
        }
    }

    /// One thing taken from a port ([`EqInner::pump_port`]).
    fn apply_taken(&self, grants: &Grants, t: Taken, first: Option<&mut Option<Word>>) {
        match t {
            Taken::Event { words, .. } => {
                if let Some(w) = self.apply(grants, words) {
                    match first {
                        Some(slot) if slot.is_none() => *slot = Some(w),
                        _ => {
                            self.post_local(w);
                        }
                    }
                }
            }
            Taken::Overflow { lost, .. } => {
                self.lost.fetch_add(lost, Ordering::Relaxed);
                self.resync(grants);
                self.post_local(Word::Overflow { lost });
            }
            Taken::Corrupt { skipped, .. } => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                self.lost.fetch_add(skipped, Ordering::Relaxed);
                self.resync(grants);
                self.post_local(Word::Overflow { lost: skipped });
            }
        }
    }

    /// One word from a port whose process holds `grants`: only claims and notifications, on
    /// apertures it was granted. Returns the event it makes for our ring, if any.
    fn apply(&self, grants: &Grants, words: [u64; 4]) -> Option<Word> {
        let word = Word::decode(words);
        let need = match word {
            Some(Word::Claim { access: Access::Read, .. }) => Rights::READ,
            Some(Word::Claim { .. } | Word::Notification { .. }) => Rights::WRITE,
            _ => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        let (aperture, ap_generation) = match word {
            Some(Word::Claim { aperture, ap_generation, .. }) => (aperture, ap_generation),
            Some(Word::Notification { aperture, generation, .. }) => (aperture, generation),
            _ => return None,
        };
        if !grants.allows(aperture, ap_generation, need) {
            self.malformed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        match word {
            Some(Word::Claim { slot, generation, qindex, access, .. }) => {
                // The grant is the aperture's (its queue is this one: `grant`); an
                // unexported aperture's grants are gone (`revoke_grants`). The tripwire must
                // be one of that aperture (its cell's source) and of the claimed generation
                // (`fire` checks): a retired or reused one does not fire. Two independent
                // loads, the grant and the cell, both of this process's memory.
                let v = self.view();
                let Some(c) = v.table.cell(qindex) else {
                    self.stale.fetch_add(1, Ordering::Relaxed);
                    return None;
                };
                // SYNC POINT: the state first (pairs with `publish`'s Release store of it),
                // then the source (Acquire, pairs with `publish`'s Release store of it): the
                // source read is that of the generation seen, or of a later one, which the
                // state `fire` reads after it then shows too (and refuses).
                let _ = c.state.load(Ordering::Acquire);
                let source = c.source.load(Ordering::Acquire);
                if source == trip::NO_SOURCE || source != crate::tripwire::source_of(aperture, ap_generation) {
                    self.stale.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                let fired = trip::fire(&v.table, qindex, generation, access, &self.port.futex());
                if fired.disarmed() {
                    // A once-only tripwire: tell the claimants' snooping (off the common
                    // path: a claim names its entry, checked against the cell by `mirror`).
                    let cam = grants.rest.get(aperture as usize).and_then(Option::as_ref).map(|g| &g.cam);
                    if let Some(cam) = cam {
                        let cv = cam.view();
                        if let Some(e) = cv.entries.get(slot as usize) {
                            trip::mirror(e, cv.armed_count(), c, qindex);
                        }
                    }
                }
                match fired {
                    trip::Fired::PostEvent { qindex, .. } => Some(Word::Trip { index: qindex, generation, access }),
                    trip::Fired::Yes { .. } | trip::Fired::No => None,
                }
            }
            w => w,
        }
    }

    /// A port lost claims: fire every armed tripwire its process (holding `grants`) could
    /// have fired.
    fn resync(&self, grants: &Grants) {
        for g in grants.rest.iter().flatten() {
            if let Some(w) = g.watch.upgrade() {
                w.fire_all(g.rights);
            }
        }
    }

    /// Arm every port for `mode` (their producers then wake us); whether all are empty.
    pub fn arm_ports(&self, mode: u32) -> bool {
        if self.ports.count.load(Ordering::Acquire) == 0 {
            return true;
        }
        let list = self.ports.list.read().unwrap_or_else(|e| e.into_inner());
        let mut quiet = true;
        for p in list.iter() {
            let v = p.map.view();
            let rings = v.rings();
            if !ring::arm(&rings, mode) {
                if let Ok(mut side) = p.side.try_lock() {
                    side.consumer.settle(&rings);
                }
                quiet &= !ring::maybe_nonempty(&rings);
            }
        }
        quiet
    }

    /// Whether every port's ring is still armed for `mode` since our last arm (no producer
    /// woke us since) and empty ([`clan_shm::ring::still_armed`]).
    pub fn ports_still_armed(&self, mode: u32) -> bool {
        if self.ports.count.load(Ordering::Acquire) == 0 {
            return true;
        }
        let list = self.ports.list.read().unwrap_or_else(|e| e.into_inner());
        list.iter().all(|p| ring::still_armed(&p.map.view().rings(), mode))
    }

    /// Whether a sleeper of this queue may drive its NIC's links as the queue's leader
    /// ([`EqInner::sleep`]): some are open, and a few at most. A hint (Relaxed): a link
    /// opened meanwhile is served by the engine, or, with manual progress, seen at the
    /// sleeper's next look (`sleep` caps its nap then).
    pub(crate) fn drives_links_asleep(&self) -> bool {
        (1..=DRIVEN_LINKS).contains(&self.links_open.load(Ordering::Relaxed))
    }

    /// The NIC, if a sleeper of this queue should drive its links: engine or manual progress
    /// (a busy-polling engine needs no help), links open and at most [`DRIVEN_LINKS`] (the
    /// leader's set takes them, `wake.rs::sync_links`, which says no otherwise).
    fn link_driver(&self) -> Option<Arc<crate::nic::NicInner>> {
        if !self.drives_links_asleep() {
            return None;
        }
        self.nic.upgrade().filter(|n| !matches!(n.config.progress, crate::config::Progress::BusyPoll(_)))
    }

    /// Sleep while `word` holds `expected` (at most `timeout`), woken by this process's
    /// firings and posts (on `word`) and by the ports; the NIC whose links the caller is to
    /// drive (`NicInner::progress`): the sleep drove them and they woke it, or, with manual
    /// progress, it could not listen to them (it was short then). The caller registered as a waiter on
    /// `word` and re-checks (pumping) afterwards. Up to [`WAITV_PORTS`] ports, one
    /// `futex_waitv` on `word`, the ports' wake words (armed first: their producers wake
    /// them, `clan_shm::ring`) and the port epoch; beyond, as `crate::wake` says.
    pub fn sleep(
        &self,
        word: &AtomicU32,
        expected: u32,
        timeout: Option<Duration>,
    ) -> Option<Arc<crate::nic::NicInner>> {
        crate::wake::clear_woken_links();
        // SYNC POINT: read before the list (pairs with `port_for`'s Release increment).
        let epoch = self.ports.epoch.load(Ordering::Acquire);
        let ports: Vec<Arc<PortRec>> = if self.ports.count.load(Ordering::Acquire) == 0 {
            Vec::new()
        } else {
            self.ports.list.read().unwrap_or_else(|e| e.into_inner()).clone()
        };
        let asleep = || crate::progress::Sleeper::enter(&self.nic, &self.links_open);
        // A sleeper that can drive the NIC's links sleeps on their sockets too (as the leader).
        let driver = self.link_driver();
        // Manual progress, and links this sleep does not drive: nobody else reads them, so
        // look again soon, and have the caller drive them.
        let undriven = if driver.is_none() && self.links_open.load(Ordering::Relaxed) != 0 {
            self.nic.upgrade().filter(|n| n.manual_progress())
        } else {
            None
        };
        let timeout = if undriven.is_some() {
            Some(timeout.map_or(crate::progress::MANUAL_NAP, |t| t.min(crate::progress::MANUAL_NAP)))
        } else {
            timeout
        };
        if ports.len() > WAITV_PORTS || driver.is_some() {
            let driving = driver.as_ref().map(|nic| crate::wake::Driving { nic, most: DRIVEN_LINKS });
            let arm = || self.arm_ports(ring::ARM_FD);
            let drive = self.sleepers.sleep(word, expected, timeout, arm, |id| self.drain(id), driving, asleep);
            return if drive { driver.or(undriven) } else { undriven };
        }
        let _asleep = asleep();
        let mut words: Vec<(&AtomicU32, u32)> = Vec::with_capacity(ports.len() + 2);
        words.push((word, expected));
        words.push((&self.ports.epoch, epoch));
        let mut quiet = true;
        for p in &ports {
            let rings = p.map.view().rings();
            // SYNC POINT: as in `ring::sleep`: the wake word is read before arming, so a post
            // after our arming changes it (pairs with the producer's `fetch_add(Release)`).
            let seen = rings.words.wake.load(Ordering::Acquire);
            if !ring::arm(&rings, ring::ARM_FUTEX) {
                if let Ok(mut side) = p.side.try_lock() {
                    side.consumer.settle(&rings);
                }
                quiet &= !ring::maybe_nonempty(&rings);
            }
            words.push((&rings.words.wake, seen));
        }
        fence(Ordering::SeqCst);
        if quiet {
            clan_shm::futex::wait_any(&words, timeout);
        }
        undriven
    }

    /// Wait until `ready()` (a change of the futex word `seq`, whose sleepers `waiters`
    /// counts, or of something `seq` announces) or `until` passes; whether `ready()` held.
    /// The ports are pumped first each time round, while this thread is not counted in
    /// `waiters` (a firing it causes itself wakes nobody for nothing); then `trip`'s
    /// protocol: count, fence, re-check, sleep ([`EqInner::sleep`]).
    pub fn wait_word(
        &self,
        seq: &AtomicU32,
        waiters: &AtomicU32,
        until: Option<std::time::Instant>,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        loop {
            self.pump();
            if ready() {
                return true;
            }
            // SYNC POINT: pairs with `trip::fire`'s `seq.fetch_add(AcqRel)`.
            let seen = seq.load(Ordering::Acquire);
            waiters.fetch_add(1, Ordering::AcqRel);
            // Dekker with the firer's "seq += 1, fence, load waiters".
            fence(Ordering::SeqCst);
            if ready() {
                waiters.fetch_sub(1, Ordering::AcqRel);
                return true;
            }
            let left = match until {
                Some(d) => {
                    let l = d.saturating_duration_since(std::time::Instant::now());
                    if l.is_zero() {
                        waiters.fetch_sub(1, Ordering::AcqRel);
                        return false;
                    }
                    Some(l)
                }
                None => None,
            };
            let drive = self.sleep(seq, seen, left);
            waiters.fetch_sub(1, Ordering::AcqRel);
            // Uncounted now: a firing of `seq` by what the links brought wakes nobody.
            if let Some(nic) = drive {
                nic.progress_woken();
            }
        }
    }

    /// The eventfd with epoll data `id` (the queue's own, or a port's) was readable: reset
    /// it. The caller pumps afterwards.
    pub fn drain(&self, id: u64) {
        if id == crate::wake::OWN {
            self.sleepers.notify.drain();
            return;
        }
        let list = self.ports.list.read().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = list.iter().find(|p| p.id == id) {
            p.eventfd.drain();
        }
    }

    /// The ports given, for diagnostics.
    pub fn port_count(&self) -> usize {
        self.ports.count.load(Ordering::Relaxed)
    }
}

// ---- the importing side ------------------------------------------------------------------

type Key = (NicAddr, u32, u64);

/// The ports this process posts on, by exporter NIC, queue and port.
static ATTACHED: Mutex<Option<HashMap<Key, Weak<EqPort>>>> = Mutex::new(None);

/// Our producer for port `port` of queue `eq` of `exporter`, mapping it from the received
/// descriptors the first time (later copies are closed).
pub(crate) fn attach(
    exporter: NicAddr,
    eq: u32,
    port: u64,
    ring_cap: u32,
    memfd: OwnedFd,
    eventfd: OwnedFd,
) -> Result<Arc<EqPort>, String> {
    let key = (exporter, eq, port);
    let mut all = lock(&ATTACHED);
    let all = all.get_or_insert_with(HashMap::new);
    all.retain(|_, w| w.strong_count() > 0);
    if let Some(p) = all.get(&key).and_then(Weak::upgrade) {
        return Ok(p);
    }
    if !ring_cap.is_power_of_two() || ring_cap > clan_shm::eq::MAX_RING_CAP {
        return Err("bad port geometry".into());
    }
    let layout = port_layout(ring_cap);
    let memfd = Memfd::adopt(memfd, layout.size as u64).map_err(|e| format!("port memfd: {e}"))?;
    let seg = Segment::map(memfd.as_fd(), 0, layout.size, SegAccess::ReadWrite)
        .map_err(|e| format!("mapping the port: {e}"))?;
    let map = EqMap::new(Arc::new(seg), layout).map_err(|e| e.to_string())?;
    map.view().header.check(&layout.params)?;
    // Resume after whatever this process posted before (the port is ours for the life of
    // the process); a fresh port reads 0.
    let head = map.view().ring_headers[0].head.load(Ordering::Acquire);
    let p = Arc::new(EqPort {
        map,
        producer: Mutex::new(Producer::resume(0, head)),
        // (kept: above the floor, as a descriptor we make would be)
        eventfd: Arc::new(EventFd::from_owned(clan_shm::fdfloor::lift(eventfd))),
        sleepers: None,
    });
    all.insert(key, Arc::downgrade(&p));
    Ok(p)
}
