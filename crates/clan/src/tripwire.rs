//! Tripwires: watches on address ranges of an aperture (traffic arriving) or of a mapping
//! (traffic leaving), fired by whoever moves the data.
//!
//! A tripwire fires when traffic *through the NIC* touches its range: writes or reads by
//! importers of the aperture (including this process through a mapping of its own
//! aperture) for an aperture tripwire, and this process's own writes or reads through the
//! mapping, once complete, for a mapping tripwire. The owner's plain loads and stores to its
//! own aperture are local memory accesses, invisible to the NIC, as in the hardware.
//!
//! Firing performs the tripwire's actions ([`Actions`]): post an [`crate::Event::Tripwire`]
//! to the event queue it is registered with, set its bit in the queue's fired bitmap
//! (tested with [`Tripwire::fired`] without a system call), and count. It also wakes the
//! threads blocked in [`Tripwire::wait`] or in a [`crate::Tripset`].
//!
//! ## Arm, then re-check
//!
//! A tripwire only catches traffic that starts after it was armed. The pattern that never
//! misses a wake-up is: arm, re-check the watched memory, and only then wait:
//!
//! ```
//! # use std::time::Duration;
//! # let nic = clan::Nic::open_default()?;
//! # let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
//! # let aperture = ep.export(4096)?;
//! # const FLAG: u64 = 0;
//! # let tw = aperture.tripwire(clan::TripwireConfig::writes(FLAG..FLAG + 8))?;
//! # let m = peer.import(&aperture.descriptor())?;
//! # let writer = std::thread::spawn(move || m.store_u64(FLAG, 1));
//! tw.arm()?;
//! while aperture.load_u64(FLAG)? == 0 {
//!     tw.wait(Some(Duration::from_secs(5)))?;
//! }
//! # writer.join().unwrap()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! `arm` fences after arming, and every writer fences between its data and its look at the
//! tripwire table, so either the writer fires the tripwire or the re-check sees the data
//! (`clan_shm::trip`; model-checked in `clan-shm/tests/loom.rs`).
//!
//! ## Cost
//!
//! Matching a write of `len` bytes costs `⌈len/4096⌉` word loads plus the tripwires that
//! start near it on that aperture (`clan_shm::cam`), whatever the number of tripwires on other
//! apertures; a table holds up to 2^24 tripwires per event queue (the NIC's default queue
//! holds 2^20).

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clan_shm::cam::{self, CamOwner};
use clan_shm::eq::CamMap;
use clan_shm::smallmap::SmallMap;
use clan_shm::trip::{self, ACT_BITMAP, ACT_COUNTER, ACT_EVENT, ARMED, ON_READ, ON_WRITE, ONCE, WIDE};

use crate::error::TripwireError;
use crate::event_queue::{EqInner, EventQueue, Word};
use crate::lock;
use crate::progress::{self, Deadline};

pub use clan_shm::trip::Access;

/// What a firing does.
///
/// ```
/// use clan::{Actions, TripwireConfig};
///
/// let nic = clan::Nic::open_default()?;
/// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = ep.export(4096)?;
/// let counted = ap.tripwire(TripwireConfig::writes(0..8).actions(Actions::COUNTER))?;
/// let flagged = ap.tripwire(TripwireConfig::writes(0..8).actions(Actions::BITMAP))?;
/// peer.import(&ap.descriptor())?.store_u64(0, 1)?;
/// assert_eq!((counted.count(), counted.fired()), (1, false));
/// assert_eq!((flagged.count(), flagged.fired()), (0, true));
/// assert!(Actions::default().contains(Actions::BITMAP | Actions::COUNTER));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Actions(u32);

impl Actions {
    /// Post an event to the registered event queue.
    pub const EVENT: Actions = Actions(ACT_EVENT);
    /// Set the tripwire's bit in the queue's fired bitmap.
    pub const BITMAP: Actions = Actions(ACT_BITMAP);
    /// Count firings ([`Tripwire::count`]).
    pub const COUNTER: Actions = Actions(ACT_COUNTER);
    /// None (only waiters and tripsets are woken).
    pub const NONE: Actions = Actions(0);

    /// Whether all of `o` is in `self`.
    pub fn contains(self, o: Actions) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for Actions {
    type Output = Actions;
    fn bitor(self, o: Actions) -> Actions {
        Actions(self.0 | o.0)
    }
}

impl Default for Actions {
    /// Bitmap and counter.
    fn default() -> Actions {
        Actions::BITMAP | Actions::COUNTER
    }
}

/// How a tripwire is set up: the range and the traffic it watches, then options.
///
/// ```
/// use clan::{Event, TripwireConfig};
///
/// let nic = clan::Nic::open_default()?;
/// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = ep.export(4096)?;
/// // Fires once, then disarms; posts an event with cookie 7 to `ep`'s queue.
/// let tw = ap.tripwire(TripwireConfig::reads(100..200).once().event(7))?;
/// let m = peer.import(&ap.descriptor())?;
/// m.write(100, b"x")?; // a write: not watched
/// m.read(150, &mut [0u8; 4])?;
/// m.read(150, &mut [0u8; 4])?; // disarmed by the first read
/// assert_eq!(tw.count(), 1);
/// assert!(!tw.is_armed());
/// assert!(matches!(ep.event_queue().try_take(), Some(Event::Tripwire { cookie: 7, .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TripwireConfig {
    range: Range<u64>,
    on: u32,
    once: bool,
    armed: bool,
    actions: Actions,
    cookie: Option<u64>,
}

impl TripwireConfig {
    /// Fire on writes to `range`.
    pub fn writes(range: Range<u64>) -> Self {
        TripwireConfig { range, on: ON_WRITE, once: false, armed: true, actions: Actions::default(), cookie: None }
    }
    /// Fire on reads of `range`.
    pub fn reads(range: Range<u64>) -> Self {
        TripwireConfig { on: ON_READ, ..Self::writes(range) }
    }
    /// Fire on reads and writes of `range`.
    pub fn accesses(range: Range<u64>) -> Self {
        TripwireConfig { on: ON_READ | ON_WRITE, ..Self::writes(range) }
    }
    /// Disarm on the first firing (re-arm with [`Tripwire::arm`]).
    pub fn once(mut self) -> Self {
        self.once = true;
        self
    }
    /// Create disarmed.
    pub fn disarmed(mut self) -> Self {
        self.armed = false;
        self
    }
    /// Set the actions (default: bitmap and counter).
    pub fn actions(mut self, a: Actions) -> Self {
        self.actions = a;
        self
    }
    /// Register with the owning endpoint's event queue, with `cookie` in its events.
    pub fn event(mut self, cookie: u64) -> Self {
        self.cookie = Some(cookie);
        self.actions = self.actions | Actions::EVENT;
        self
    }
}

/// Identity of a tripwire: queue, table index and generation.
///
/// ```
/// use clan::TripwireConfig;
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(4096)?;
/// let (a, b) = (ap.tripwire(TripwireConfig::writes(0..8))?, ap.tripwire(TripwireConfig::writes(8..16))?);
/// assert_ne!(a.id(), b.id());
/// assert_eq!(a.id().queue, ep.event_queue().id());
/// let id = a.id();
/// assert_eq!(id.to_string(), format!("tw{}.{}#{}", id.queue, id.index, id.generation));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TripwireId {
    /// Event queue id (within the NIC).
    pub queue: u32,
    /// Index in the queue's tripwire table (its bit in the fired bitmap).
    pub index: u32,
    /// Generation of the entry.
    pub generation: u32,
}

impl fmt::Display for TripwireId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tw{}.{}#{}", self.queue, self.index, self.generation)
    }
}

/// The claim source of aperture `(id, generation)`: what a claim naming that aperture must
/// match in the cell of the tripwire it asks to fire.
pub(crate) fn source_of(id: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(id)
}

#[derive(Debug, Clone, Copy)]
struct TripRecord {
    generation: u32,
    start: u64,
    end: u64,
    /// Its entry in the index.
    slot: u32,
}

#[derive(Debug, Default)]
struct OwnerState {
    cam: CamOwner,
    /// By queue index (indexes this queue handed out itself). Nearly every index holds one
    /// tripwire: a small map ([`clan_shm::smallmap`]), found in one comparison.
    trips: SmallMap<u32, TripRecord>,
    /// Entries of the index free for reuse (oldest first), and the first never used.
    slots_free: std::collections::VecDeque<u32>,
    slots_next: u32,
    /// Where this index's never-used entries start (then on, wrapping): indexes have the
    /// same layout, so without it the first entries of a thousand apertures would all sit
    /// at one page offset, in one set of the CPU's caches.
    colour: u32,
}

impl OwnerState {
    fn alloc_slot(&mut self, cap: u32) -> Option<u32> {
        // Reuse the oldest freed entry first, to keep stale references stale long.
        if self.slots_free.len() > 64 || self.slots_next >= cap {
            return self.slots_free.pop_front();
        }
        let k = self.slots_next;
        self.slots_next += 1;
        Some(((u64::from(k) + u64::from(self.colour)) % u64::from(cap)) as u32)
    }
}

/// The owner of one index (an aperture's, or a mapping's outgoing one) and its tripwires.
pub(crate) struct WatchOwner {
    pub eq: Arc<EqInner>,
    pub cam: Arc<CamMap>,
    pub tag: u64,
    /// Watched length.
    pub len: u64,
    /// Index coordinate of user offset 0 (user ranges are relative to the aperture or the
    /// mapping; a mapping's outgoing index uses the mapping's own coordinates, base 0).
    pub base: u64,
    pub endpoint: u32,
    /// Who may claim its tripwires ([`clan_shm::trip::TripCell::source`]): the aperture's
    /// identity ([`source_of`]); `NO_SOURCE` for a mapping's index, which nobody else reads.
    pub source: u64,
    state: Mutex<OwnerState>,
    /// Cleared ([`WatchOwner::clear`]): every tripwire removed, and none made from now on.
    /// Set under `state`'s lock. A tripwire leaves its owner's records only so or when it
    /// is dropped, so a live [`Tripwire`] is current exactly while this is unset: its
    /// check ([`Tripwire::arm`], every wait) is one load, no lock.
    dead: std::sync::atomic::AtomicBool,
    /// For a mapping's (outgoing) index: whether the mapping's exporter is still there (a
    /// wait on such a tripwire ends with an error once it is not).
    pub alive: Option<Box<dyn Fn() -> bool + Send + Sync>>,
}

impl std::fmt::Debug for WatchOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchOwner").field("tag", &self.tag).field("len", &self.len).finish_non_exhaustive()
    }
}

impl WatchOwner {
    pub fn new(
        eq: Arc<EqInner>,
        cam: Arc<CamMap>,
        tag: u64,
        len: u64,
        base: u64,
        endpoint: u32,
        source: u64,
    ) -> WatchOwner {
        // 64 colours of 64-byte entries: every offset within a page.
        let colour = ((tag as u32).wrapping_mul(0x9e37_79b1) >> 26) % (cam.view().entries.len().max(1) as u32);
        let state = OwnerState { colour, ..OwnerState::default() };
        WatchOwner {
            eq,
            cam,
            tag,
            len,
            base,
            endpoint,
            source,
            state: Mutex::new(state),
            dead: std::sync::atomic::AtomicBool::new(false),
            alive: None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OwnerState> {
        lock(&self.state)
    }

    /// Create a tripwire.
    pub fn add(self: &Arc<Self>, cfg: &TripwireConfig) -> Result<Tripwire, TripwireError> {
        let (s, e) = (cfg.range.start, cfg.range.end);
        if s >= e {
            return Err(TripwireError::EmptyRange);
        }
        if e > self.len {
            return Err(TripwireError::OutOfBounds { start: s, end: e, size: self.len });
        }
        let (start, end) = (s + self.base, e + self.base);
        let mut st = self.lock();
        // (set under the lock: no tripwire is made after `clear` took them all)
        if self.dead.load(Ordering::Relaxed) {
            return Err(TripwireError::Stale);
        }
        let cap = self.cam.view().entries.len() as u32;
        let slot = st.alloc_slot(cap).ok_or(TripwireError::TableFull { capacity: cap })?;
        let Some((index, generation)) = self.eq.alloc_trip(self.endpoint) else {
            st.slots_free.push_front(slot);
            return Err(TripwireError::TableFull { capacity: self.eq.layout.params.trip_cap });
        };
        let mut flags = cfg.on | cfg.actions.0;
        if cfg.once {
            flags |= ONCE;
        }
        if cfg.armed {
            flags |= ARMED;
        }
        if cam::is_wide(start, end) {
            flags |= WIDE;
        }
        // The event action only takes effect once registered (below).
        flags &= !ACT_EVENT;
        let v = self.eq.view();
        let cv = self.cam.view();
        let entry = &cv.entries[slot as usize];
        let cell = &v.table.cells[index as usize];
        let seq = cell.seq.load(Ordering::Acquire);
        cell.count.store(0, Ordering::Relaxed);
        trip::clear_bit(&v.table, index);
        trip::publish(entry, cv.armed_count(), cell, generation, flags, start, end, self.tag, index, self.source);
        st.cam.insert(cv, slot, start, end);
        st.trips.insert(index, TripRecord { generation, start, end, slot });
        drop(st);
        let tw = Tripwire {
            owner: self.clone(),
            id: crate::TripwireId { queue: self.eq.id, index, generation },
            slot,
            range: cfg.range.clone(),
            last_seen: AtomicU32::new(seq),
        };
        if let Some(cookie) = cfg.cookie {
            self.eq.set_registration(entry, cv.armed_count(), index, generation, Some(cookie));
        }
        Ok(tw)
    }

    fn remove_locked(&self, st: &mut OwnerState, index: u32, generation: u32) {
        if let Some(r) = st.trips.get(&index).copied().filter(|r| r.generation == generation) {
            st.trips.remove(&index);
            let cv = self.cam.view();
            // Order: retire, unlink (epoch bump), free; the next `publish` fences (trip.rs).
            let cell = &self.eq.view().table.cells[index as usize];
            trip::retire(&cv.entries[r.slot as usize], cv.armed_count(), cell, index);
            st.cam.remove(cv, r.slot, r.start, r.end);
            st.slots_free.push_back(r.slot);
            self.eq.free_trip(index);
        }
    }

    pub fn remove(&self, index: u32, generation: u32) {
        let mut st = self.lock();
        self.remove_locked(&mut st, index, generation);
    }

    /// Remove every tripwire; later creations fail with `Stale`.
    pub fn clear(&self) {
        let mut st = self.lock();
        // SYNC POINT: pairs with the Acquire load in `is_current`: a tripwire found current
        // was not yet taken by this clear (its later use finds its entry retired).
        self.dead.store(true, Ordering::Release);
        let all: Vec<(u32, u32)> = st.trips.iter().map(|(&i, r)| (i, r.generation)).collect();
        for (i, g) in all {
            self.remove_locked(&mut st, i, g);
        }
    }

    /// Fire the tripwire in entry `slot` (of `generation`) for `access`, if it is armed and
    /// watches that access, as another process's claim asks (`crate::port`); the event to
    /// post, if its event action is on.
    pub fn fire_claim(&self, slot: u32, generation: u32, access: Access) -> Option<Word> {
        let cv = self.cam.view();
        let e = cv.entries.get(slot as usize)?;
        let v = self.eq.view();
        match trip::fire_entry(e, cv.armed_count(), generation, access, &v.table, &self.eq.port.futex()) {
            trip::Fired::PostEvent { qindex, .. } => Some(Word::Trip { index: qindex, generation, access }),
            trip::Fired::Yes { .. } | trip::Fired::No => None,
        }
    }

    /// Fire every armed tripwire of the index watching an access that `rights` allow (a
    /// process lost claims: a spurious wake-up rather than a lost one).
    pub fn fire_all(&self, rights: crate::Rights) {
        let all: Vec<(u32, u32)> = self.lock().trips.values().map(|r| (r.slot, r.generation)).collect();
        for (slot, generation) in all {
            for (right, access) in [(crate::Rights::WRITE, Access::Write), (crate::Rights::READ, Access::Read)] {
                if rights.contains(right) {
                    if let Some(w) = self.fire_claim(slot, generation, access) {
                        self.eq.post_local(w);
                    }
                }
            }
        }
    }

    /// Whether the tripwire with queue index `index` of `generation`, which the caller
    /// holds (so it was not dropped), is still this owner's: unless `clear` took them all.
    fn is_current(&self, index: u32, generation: u32) -> bool {
        #[cfg(debug_assertions)]
        {
            // (under the lock `clear` holds: the records and the flag agree)
            let st = self.lock();
            let kept = st.trips.get(&index).is_some_and(|r| r.generation == generation);
            debug_assert!(
                kept || self.dead.load(Ordering::Relaxed),
                "a live tripwire missing from its owner's records"
            );
        }
        #[cfg(not(debug_assertions))]
        let _ = (index, generation);
        !self.dead.load(Ordering::Acquire)
    }
}

/// How often a wait on a mapping's tripwire looks whether the exporter is still there.
const ALIVE_SLICE: Duration = Duration::from_millis(50);

/// A tripwire. Dropping it destroys it. `Send` and `Sync`.
///
/// Made by [`crate::Aperture::tripwire`] (incoming traffic) or [`crate::Mapping::tripwire`]
/// (outgoing traffic). A thread waits for a write from another one:
///
/// ```
/// use std::time::Duration;
/// use clan::TripwireConfig;
///
/// let nic = clan::Nic::open_default()?;
/// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = ep.export(4096)?;
/// let flag = ap.tripwire(TripwireConfig::writes(0..8))?;
/// let m = peer.import(&ap.descriptor())?;
/// let writer = std::thread::spawn(move || m.write_then_store_u64(8, b"hello", 0, 1));
/// flag.arm()?; // arm, re-check, wait: never misses the write
/// while ap.load_u64(0)? == 0 {
///     flag.wait(Some(Duration::from_secs(5)))?;
/// }
/// writer.join().unwrap()?;
/// let mut body = [0u8; 5];
/// ap.read(8, &mut body)?;
/// assert_eq!(&body, b"hello");
/// assert!(flag.count() >= 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Tripwire {
    pub(crate) owner: Arc<WatchOwner>,
    pub(crate) id: TripwireId,
    /// Its entry in the owner's index.
    pub(crate) slot: u32,
    range: Range<u64>,
    /// The `seq` value the last `arm`/`wait`/`take_fired` observed.
    pub(crate) last_seen: AtomicU32,
}

impl std::fmt::Debug for Tripwire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tripwire")
            .field("id", &self.id)
            .field("range", &self.range)
            .field("armed", &self.is_armed())
            .finish()
    }
}

impl Tripwire {
    /// Its identity.
    pub fn id(&self) -> TripwireId {
        self.id
    }

    /// The watched range (relative to the aperture or mapping).
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    pub(crate) fn entry(&self) -> &clan_shm::trip::TripEntry {
        &self.owner.cam.view().entries[self.slot as usize]
    }

    /// The count of armed mirrors of the index its entry is in.
    fn armed_count(&self) -> clan_shm::trip::ArmedCount<'_> {
        self.owner.cam.view().armed_count()
    }

    /// Its firing state, in its queue's table.
    pub(crate) fn cell(&self) -> &clan_shm::trip::TripCell {
        &self.owner.eq.view().table.cells[self.id.index as usize]
    }

    fn check(&self) -> Result<(), TripwireError> {
        if self.owner.is_current(self.id.index, self.id.generation) { Ok(()) } else { Err(TripwireError::Stale) }
    }

    /// Arm: the tripwire fires on traffic that starts from now on. Afterwards, re-check the
    /// watched memory before waiting (module documentation). Also resets what
    /// [`Tripwire::wait`] and [`Tripwire::take_fired`] consider "already seen".
    pub fn arm(&self) -> Result<(), TripwireError> {
        self.check()?;
        let e = self.entry();
        self.last_seen.store(self.cell().seq.load(Ordering::Acquire), Ordering::Relaxed);
        if trip::set_armed(e, self.armed_count(), self.cell(), self.id.index, self.id.generation, true) {
            Ok(())
        } else {
            Err(TripwireError::Stale)
        }
    }

    /// Disarm.
    ///
    /// ```
    /// use clan::TripwireConfig;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = ep.export(4096)?;
    /// let m = peer.import(&ap.descriptor())?;
    /// let tw = ap.tripwire(TripwireConfig::writes(0..8).disarmed())?;
    /// m.store_u64(0, 1)?;
    /// assert_eq!(tw.count(), 0, "created disarmed");
    /// tw.arm()?;
    /// m.store_u64(0, 2)?;
    /// tw.disarm()?;
    /// m.store_u64(0, 3)?;
    /// assert_eq!(tw.count(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn disarm(&self) -> Result<(), TripwireError> {
        self.check()?;
        if trip::set_armed(self.entry(), self.armed_count(), self.cell(), self.id.index, self.id.generation, false) {
            Ok(())
        } else {
            Err(TripwireError::Stale)
        }
    }

    /// Whether it is armed (a once-only tripwire disarms when it fires).
    pub fn is_armed(&self) -> bool {
        trip::is_armed(self.cell(), self.id.generation)
    }

    /// Its bit in the fired bitmap (bitmap action): set by firings, cleared by
    /// [`Tripwire::clear`]. A plain memory load.
    pub fn fired(&self) -> bool {
        self.owner.eq.pump();
        trip::test_bit(&self.owner.eq.view().table, self.id.index)
    }

    /// Clear its bit in the fired bitmap; returns whether it was set.
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// # let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// # let ap = ep.export(4096)?;
    /// let tw = ap.tripwire(clan::TripwireConfig::writes(0..8))?;
    /// peer.import(&ap.descriptor())?.store_u64(0, 1)?;
    /// assert!(tw.fired());
    /// assert!(tw.clear());
    /// assert!(!tw.fired() && !tw.clear());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn clear(&self) -> bool {
        trip::clear_bit(&self.owner.eq.view().table, self.id.index)
    }

    /// Firings counted so far (counter action).
    pub fn count(&self) -> u64 {
        self.owner.eq.pump();
        self.cell().count.load(Ordering::Relaxed)
    }

    /// Whether it fired since the last `arm`, `wait` or `take_fired`; consumes the
    /// observation. A plain memory load when it has not.
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// # let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// # let ap = ep.export(4096)?;
    /// let tw = ap.tripwire(clan::TripwireConfig::writes(0..8))?;
    /// assert!(!tw.take_fired());
    /// peer.import(&ap.descriptor())?.store_u64(0, 1)?;
    /// assert!(tw.take_fired());
    /// assert!(!tw.take_fired(), "consumed");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn take_fired(&self) -> bool {
        // What other processes claimed is applied first (`crate::port`): one load if none.
        self.owner.eq.pump();
        let now = self.cell().seq.load(Ordering::Acquire);
        let seen = self.last_seen.swap(now, Ordering::AcqRel);
        now != seen
    }

    /// Process the incoming link traffic of this tripwire's NIC in the calling thread (what
    /// [`crate::Nic::progress`] does); returns whether there was any. For spin loops waiting
    /// for bytes that come over a link: the spinning thread applies them itself, rather than
    /// waiting for the engine's thread to be scheduled. Costs one load when the NIC has no
    /// link.
    pub fn drive_links(&self) -> bool {
        let eq = &self.owner.eq;
        // A hint (Relaxed: it orders nothing): without it, every call would take and drop
        // a reference to the NIC, atomic read-modify-writes that delay a spinning waiter's
        // next look at its memory.
        if eq.links_open.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return false;
        }
        eq.nic.upgrade().is_some_and(|n| n.progress())
    }

    /// Begin a spin on the bytes that come over this tripwire's NIC's links: the spinning
    /// thread applies them itself ([`crate::LinkSpin::drive`]), and the NIC's engine thread
    /// is not woken for them meanwhile. Costs one load when the NIC has no link.
    pub fn spin_links(&self) -> crate::LinkSpin {
        let eq = &self.owner.eq;
        // A hint (Relaxed, as in `drive_links`): a link that opens during the spin is
        // served by the engine.
        let nic = if eq.links_open.load(std::sync::atomic::Ordering::Relaxed) == 0 { None } else { eq.nic.upgrade() };
        crate::LinkSpin::begin(nic)
    }

    /// Block until it fires (if it already fired since the last `arm`, `wait` or
    /// `take_fired`, return at once). Spins for the queue's spin time first
    /// ([`crate::EventQueueConfig::spin`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::TripwireError;
    ///
    /// # let nic = clan::Nic::open_default()?;
    /// # let ep = nic.endpoint()?;
    /// # let ap = ep.export(4096)?;
    /// let tw = ap.tripwire(clan::TripwireConfig::writes(0..8))?;
    /// // Nobody writes: the wait ends with the timeout.
    /// assert_eq!(tw.wait(Some(Duration::from_millis(10))), Err(TripwireError::Timeout));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), TripwireError> {
        self.wait_spin(self.owner.eq.config.spin, timeout)
    }

    /// [`Tripwire::wait`], spinning for `spin` (instead of the queue's spin time) before it
    /// sleeps; zero sleeps at once. A caller that has already polled its own condition
    /// passes zero, so that a wait configured not to spin does not spin here either.
    pub fn wait_spin(&self, spin: Duration, timeout: Option<Duration>) -> Result<(), TripwireError> {
        self.check()?;
        let e = self.cell();
        let seen = self.last_seen.load(Ordering::Relaxed);
        let nic = progress::driver(self.owner.eq.nic.upgrade());
        let alive = self.owner.alive.as_deref();
        // Whether the last poll came after a sleep (only then is the exporter looked at).
        let slept = std::cell::Cell::new(false);
        let eq = &self.owner.eq;
        let links = progress::SpinLinks::new(&eq.nic, &eq.links_open, spin);
        // Manual progress with a few links: the queue's sleep drives them (below), woken by
        // what comes on them, and applies it as it wakes. A look that follows such a sleep,
        // or that would go straight to one (no spin), need not read the sockets first: one
        // receive call less each way, which would hear only EAGAIN.
        let sleep_drives = || nic.is_some() && eq.drives_links_asleep();
        let skip_drive = std::cell::Cell::new(spin.is_zero() && sleep_drives());
        let poll = || {
            if let Some(n) = &nic {
                if !skip_drive.replace(false) {
                    n.progress();
                }
            }
            links.poll();
            eq.pump();
            if e.seq.load(Ordering::Acquire) != seen {
                return Some(Ok(()));
            }
            // A mapping's tripwire: its exporter may go away, and nothing would fire then.
            if slept.replace(false) && alive.is_some_and(|alive| !alive()) {
                tracing::debug!(tripwire = ?self.id, "wait ended: the mapping's exporter is gone");
                return Some(Err(TripwireError::Disconnected));
            }
            None
        };
        // Sleep in slices to look at the exporter, if there is one to look at.
        let slice = alive.map(|_| ALIVE_SLICE);
        let deadline = Deadline::after(timeout);
        let sleep = |nap: Option<Duration>| {
            links.sleeping();
            slept.set(true);
            // Manual progress: drive the links while waiting. A few links are driven by the
            // queue's sleep below, as its leader, which local firings wake too; with more,
            // sleep on them all, looking again soon for local firings (nothing wakes this
            // sleep for them).
            if !eq.drives_links_asleep() && nic.as_ref().is_some_and(|n| progress::sleep_on_links(n, None, nap)) {
                return;
            }
            // (without slices the nap ends at the deadline: no clock read for it)
            let until = if slice.is_none() { deadline.instant() } else { nap.map(|n| Instant::now() + n) };
            skip_drive.set(sleep_drives());
            eq.wait_word(&e.seq, &e.waiters, until, || e.seq.load(Ordering::Acquire) != seen);
        };
        let r = progress::wait(spin, deadline, slice, poll, sleep).unwrap_or(Err(TripwireError::Timeout));
        if r.is_ok() {
            self.last_seen.store(e.seq.load(Ordering::Acquire), Ordering::Relaxed);
        }
        r
    }

    pub(crate) fn set_registration(&self, queue: &EventQueue, cookie: Option<u64>) -> Result<(), TripwireError> {
        if !Arc::ptr_eq(&queue.inner, &self.owner.eq) {
            return Err(TripwireError::Foreign);
        }
        self.check()?;
        if self.owner.eq.set_registration(self.entry(), self.armed_count(), self.id.index, self.id.generation, cookie) {
            Ok(())
        } else {
            Err(TripwireError::Stale)
        }
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.owner.remove(self.id.index, self.id.generation);
    }
}
