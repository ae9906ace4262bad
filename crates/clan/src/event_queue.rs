//! Event queues: tripwire, out-of-band, disconnect and user events.
//!
//! A queue is memory of this process only ([`clan_shm::eq`]): our ring, the fired bitmap and
//! the tripset words of the endpoints that use it. Other processes reach it through *ports*
//! (`crate::port`): one ring of their own each, which the queue pumps, checking what they
//! claim. Posting and taking are O(1) and need no system call; a consumer spins for
//! [`EventQueueConfig::spin`] and then sleeps (`crate::wake`), and the queue's descriptor
//! ([`EventQueue::as_fd`]) makes it a member of any epoll/mio/tokio loop.
//!
//! ## The file descriptor
//!
//! The descriptor is readable while the queue holds events posted after the consumer last
//! *armed* it ([`EventQueue::arm`]); `arm` returns `false` (and leaves the descriptor readable)
//! if events are already pending. An event loop therefore runs:
//!
//! ```text
//! loop {
//!     while let Some(ev) = queue.try_take() { handle(ev) }
//!     if queue.arm() { epoll_wait(...) }      // sleeps only if nothing is pending
//! }
//! ```
//!
//! Arming is what makes a busy consumer free of system calls: producers only signal the
//! descriptor (or the futex) of a consumer that announced it was going to sleep.
//!
//! ## Overflow
//!
//! A producer whose ring is full drops the event and counts it; the consumer reports the
//! count as [`Event::Overflow`] and in [`EventQueueStats::lost`], then should re-check the
//! state it watches (as after any spurious or missing event). Event words from other processes
//! are validated; malformed or stale ones are dropped and counted, never delivered.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use clan_shm::eq::{EQ_MAGIC, EqLayout, EqMap, EqParams, EqView};
use clan_shm::eventfd::EventFd;
use clan_shm::ring::{self, ARM_FD, ARM_FUTEX, Consumer, Producer, Taken};
use clan_shm::segment::Segment;
use clan_shm::snoop::Sink;
use clan_shm::trip::{self, Access};

use crate::config::EventQueueConfig;
use crate::error::EventQueueError;
use crate::lock;
use crate::nic::NicInner;
use crate::port::Ports;
use crate::progress::{self, Deadline};
use crate::tripwire::TripwireId;
use crate::wake::{QueueFutex, Sleepers};

const KIND_TRIP: u64 = 1;
const KIND_OOB: u64 = 2;
const KIND_DISCONNECT: u64 = 3;
const KIND_USER: u64 = 4;
const KIND_READ: u64 = 5;
const KIND_DMA: u64 = 6;
const KIND_NOTIFY: u64 = 7;
const KIND_CLAIM: u64 = 8;
const KIND_OVERFLOW: u64 = 9;

/// One event as it travels through a ring: four words, written here and read back here only
/// ([`Word::encode`], [`Word::decode`]). Words from another process's ring are untrusted:
/// `decode` rejects what is not well formed, and the consumer checks the rest (a tripwire's
/// generation, which kinds another process may post).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Word {
    /// A tripwire of the queue's table fired.
    Trip { index: u32, generation: u32, access: Access },
    /// Out-of-band mail for an endpoint (this process only).
    Oob { endpoint: u32 },
    /// An endpoint's peer went away (this process only).
    Disconnect { endpoint: u32, token: u64 },
    /// [`EventQueue::post_user`] (this process only).
    User(u64),
    /// An asynchronous read completed (this process only).
    ReadComplete { token: u64 },
    /// A DMA request completed; `failure` is [`crate::dma::failure_code`], 0 for success
    /// (this process only).
    Dma { endpoint: u32, tag: u64, failure: u8 },
    /// A writer says a message landed (a port's process, or this one).
    Notification { aperture: u32, generation: u32, offset: u64, len: u64 },
    /// Another process asks the owner to fire the tripwire of queue index `qindex` (of
    /// `generation`), in entry `slot` of aperture `(aperture, ap_generation)`'s index, for
    /// `access` (ports only: `crate::port`).
    Claim { aperture: u32, ap_generation: u32, slot: u32, generation: u32, qindex: u32, access: Access },
    /// A port lost `lost` events (this process only, relaying it).
    Overflow { lost: u64 },
}

impl Word {
    /// The ring words.
    pub fn encode(self) -> [u64; 4] {
        match self {
            Word::Trip { index, generation, access } => {
                let a = match access {
                    Access::Read => 1,
                    Access::Write => 2,
                };
                [KIND_TRIP | (a << 8), u64::from(index) | (u64::from(generation) << 32), 0, 0]
            }
            Word::Oob { endpoint } => [KIND_OOB, u64::from(endpoint), 0, 0],
            Word::Disconnect { endpoint, token } => [KIND_DISCONNECT, u64::from(endpoint), token, 0],
            Word::User(v) => [KIND_USER, v, 0, 0],
            Word::ReadComplete { token } => [KIND_READ, token, 0, 0],
            Word::Dma { endpoint, tag, failure } => [KIND_DMA | (u64::from(failure) << 8), u64::from(endpoint), tag, 0],
            Word::Notification { aperture, generation, offset, len } => {
                [KIND_NOTIFY, u64::from(aperture) | (u64::from(generation) << 32), offset, len]
            }
            Word::Claim { aperture, ap_generation, slot, generation, qindex, access } => {
                let a = match access {
                    Access::Read => 1,
                    Access::Write => 2,
                };
                [
                    KIND_CLAIM | (a << 8),
                    u64::from(aperture) | (u64::from(ap_generation) << 32),
                    u64::from(slot) | (u64::from(generation) << 32),
                    u64::from(qindex),
                ]
            }
            Word::Overflow { lost } => [KIND_OVERFLOW, lost, 0, 0],
        }
    }

    /// The event in ring words, if they are well formed.
    pub fn decode(w: [u64; 4]) -> Option<Word> {
        let sub = w[0] >> 8;
        Some(match w[0] & 0xff {
            KIND_TRIP => Word::Trip {
                index: w[1] as u32,
                generation: (w[1] >> 32) as u32,
                access: match sub {
                    1 => Access::Read,
                    2 => Access::Write,
                    _ => return None,
                },
            },
            KIND_OOB => Word::Oob { endpoint: u32::try_from(w[1]).ok()? },
            KIND_DISCONNECT => Word::Disconnect { endpoint: u32::try_from(w[1]).ok()?, token: w[2] },
            KIND_USER => Word::User(w[1]),
            KIND_READ => Word::ReadComplete { token: w[1] },
            KIND_DMA => Word::Dma { endpoint: u32::try_from(w[1]).ok()?, tag: w[2], failure: u8::try_from(sub).ok()? },
            KIND_NOTIFY => {
                Word::Notification { aperture: w[1] as u32, generation: (w[1] >> 32) as u32, offset: w[2], len: w[3] }
            }
            KIND_CLAIM => Word::Claim {
                aperture: w[1] as u32,
                ap_generation: (w[1] >> 32) as u32,
                slot: w[2] as u32,
                generation: (w[2] >> 32) as u32,
                qindex: u32::try_from(w[3]).ok()?,
                access: match sub {
                    1 => Access::Read,
                    2 => Access::Write,
                    _ => return None,
                },
            },
            KIND_OVERFLOW => Word::Overflow { lost: w[1] },
            _ => return None,
        })
    }
}

/// Something that happened.
///
/// ```
/// use clan::{Access, Event, TripwireConfig};
///
/// let nic = clan::Nic::open_default()?;
/// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = ep.export(4096)?;
/// let tw = ap.tripwire(TripwireConfig::writes(0..8).event(1))?;
/// peer.import(&ap.descriptor())?.store_u64(0, 1)?;
/// peer.send_oob(ep.addr(), b"knock knock")?;
/// let q = ep.event_queue(); // the NIC's default queue: `peer` reports there too
/// q.post_user(99);
/// let mut seen = Vec::new();
/// while let Some(ev) = q.try_take() {
///     match ev {
///         Event::Tripwire { id, cookie: 1, access: Access::Write, .. } => assert_eq!(id, tw.id()),
///         Event::Oob { endpoint } => assert_eq!(endpoint, ep.port()),
///         Event::User(v) => assert_eq!(v, 99),
///         other => panic!("unexpected {other:?}"),
///     }
///     seen.push(ev);
/// }
/// assert_eq!(seen.len(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A tripwire registered with the queue fired.
    Tripwire {
        /// Which tripwire.
        id: TripwireId,
        /// The value given when registering it.
        cookie: u64,
        /// Port of the endpoint that owns it.
        endpoint: u32,
        /// The traffic that fired it.
        access: Access,
    },
    /// An out-of-band message arrived for the endpoint with this port.
    Oob {
        /// Endpoint port.
        endpoint: u32,
    },
    /// The peer of an endpoint went away.
    Disconnect {
        /// Endpoint port.
        endpoint: u32,
        /// A value identifying the connection (the protocol layer's).
        token: u64,
    },
    /// Posted with [`EventQueue::post_user`].
    User(u64),
    /// An asynchronous read ([`crate::Mapping::read_async`]) completed.
    ReadComplete {
        /// The token given when starting it.
        token: u64,
    },
    /// A DMA request posted with an event tag completed ([`crate::DmaOptions::event`]).
    DmaComplete {
        /// Port of the endpoint whose DMA queue ran it.
        endpoint: u32,
        /// The tag given when posting it.
        tag: u64,
        /// How it ended.
        result: Result<(), crate::DmaFailure>,
    },
    /// A sender says a message landed in an aperture of this queue's endpoints
    /// ([`crate::Mapping::notify`], VMMC notifications): posted after the message's bytes, so
    /// they are in place when this event is taken. The claim comes from the writer (another
    /// process or host): the range is checked against the aperture's size by whoever
    /// serves it, and, as for every event, memory is the truth.
    Notification {
        /// Aperture id.
        aperture: u32,
        /// Aperture generation.
        generation: u32,
        /// Offset of the message in the aperture.
        offset: u64,
        /// Length of the message.
        len: u64,
    },
    /// Events were lost: a producer's ring overflowed (or was found corrupt). Re-check
    /// everything this queue watches.
    Overflow {
        /// How many events were lost.
        lost: u64,
    },
}

/// Counters of a queue ([`EventQueue::stats`]).
///
/// ```
/// let nic = clan::Nic::open_default()?;
/// let q = nic.event_queue(clan::EventQueueConfig::default())?;
/// q.post_user(1);
/// q.post_user(2);
/// while q.try_take().is_some() {}
/// let s = q.stats();
/// assert_eq!((s.delivered, s.lost, s.malformed), (2, 0, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventQueueStats {
    /// Events delivered.
    pub delivered: u64,
    /// Events lost to full rings (reported as [`Event::Overflow`]).
    pub lost: u64,
    /// Malformed event words dropped.
    pub malformed: u64,
    /// Events of tripwires destroyed or unregistered since, dropped.
    pub stale: u64,
    /// Other processes with a port in the queue (`EventQueueConfig::producers`).
    pub producers: u64,
}

/// Where this process posts events: ring 0 of one of its own queues, or its port in
/// another process's queue (`crate::port`).
#[derive(Debug)]
pub(crate) struct EqPort {
    pub map: EqMap,
    pub producer: Mutex<Producer>,
    pub eventfd: Arc<EventFd>,
    /// Our own queue's sleepers (None for a port in another process's queue).
    pub sleepers: Option<Arc<Sleepers>>,
}

impl EqPort {
    pub fn view(&self) -> &EqView<'_> {
        self.map.view()
    }

    /// The futex its posts (and our firings) wake sleepers with.
    pub fn futex(&self) -> QueueFutex<'_> {
        QueueFutex { sleepers: self.sleepers.as_deref() }
    }

    /// Post an event on our ring; signals the eventfd if the consumer asked for it.
    pub fn post(&self, word: Word) -> bool {
        let posted = {
            let mut p = lock(&self.producer);
            p.post(&self.view().rings(), word.encode(), &self.futex())
        };
        if posted.signal_fd {
            self.eventfd.signal();
        }
        posted.stored
    }

    /// Where the firings of an index go: fired here (`claim` None: the index is ours), or
    /// claimed from the owner of aperture `claim` (another process's aperture).
    pub fn sink(&self, claim: Option<ClaimTo>) -> PortSink<'_> {
        PortSink { port: self, claim, futex: self.futex() }
    }
}

/// The aperture a port's claims name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClaimTo {
    pub aperture: u32,
    pub generation: u32,
}

/// Posts tripwire firings into a queue, or claims them (see [`EqPort::sink`]).
pub(crate) struct PortSink<'a> {
    port: &'a EqPort,
    claim: Option<ClaimTo>,
    futex: QueueFutex<'a>,
}

impl<'a> Sink for PortSink<'a> {
    type F = QueueFutex<'a>;
    fn futex(&self) -> &QueueFutex<'a> {
        &self.futex
    }
    fn post(&self, index: u32, generation: u32, access: Access) {
        self.port.post(Word::Trip { index, generation, access });
    }
    fn fire(&self, watch: &clan_shm::snoop::Watch<'_>, c: &clan_shm::cam::Candidate, access: Access) -> bool {
        let Some(to) = self.claim else {
            return clan_shm::snoop::fire_here(self, watch, c, access);
        };
        let Some(e) = watch.cam.entries.get(c.index as usize) else {
            return false;
        };
        // The owner fires it: ask, if it would fire now.
        trip::would_fire(e, c.generation, access)
            && self.port.post(Word::Claim {
                aperture: to.aperture,
                ap_generation: to.generation,
                slot: c.index,
                generation: c.generation,
                // On the line of the state just read.
                qindex: e.qindex.load(std::sync::atomic::Ordering::Relaxed),
                access,
            })
    }
}

/// Private bookkeeping of one queue index (its registration is in its cell: `decode`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TripMeta {
    pub generation: u32,
    pub endpoint: u32,
    pub live: bool,
}

#[derive(Debug, Default)]
struct TripAlloc {
    next: u32,
    free: std::collections::VecDeque<u32>,
    tripsets_next: u32,
    tripsets_free: Vec<u32>,
}

/// One of our event queues: its ring (ring 0: this process's posts), its tripwires' bitmap and
/// tripset words — all private to this process — and the ports of other processes
/// (`crate::port`).
pub(crate) struct EqInner {
    pub id: u32,
    pub nic: Weak<NicInner>,
    /// The NIC's count of open links (`nic.rs`, `LinkTable::open`).
    pub links_open: Arc<std::sync::atomic::AtomicUsize>,
    pub config: EventQueueConfig,
    pub layout: EqLayout,
    pub port: Arc<EqPort>,
    pub sleepers: Arc<Sleepers>,
    pub ports: Ports,
    consumer: Mutex<Consumer>,
    trips: Mutex<TripAlloc>,
    meta: RwLock<Vec<TripMeta>>,
    pub delivered: AtomicU64,
    pub lost: AtomicU64,
    pub malformed: AtomicU64,
    pub stale: AtomicU64,
    /// [`EventQueue::arm`] found events and left the descriptor readable on purpose (the
    /// next one resets it).
    signalled: AtomicBool,
}

impl std::fmt::Debug for EqInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue").field("id", &self.id).field("layout", &self.layout).finish_non_exhaustive()
    }
}

pub(crate) fn params_of(config: &EventQueueConfig) -> Result<EqParams, EventQueueError> {
    let p = EqParams {
        nrings: 1,
        ring_cap: config.ring_capacity,
        trip_cap: config.tripwires,
        tripset_cap: config.tripsets,
    };
    if !p.is_valid()
        || !(1..=MAX_PRODUCERS).contains(&config.producers)
        || !(1..=config.producers).contains(&config.producers_per_user)
    {
        return Err(EventQueueError::Config(format!(
            "ring_capacity must be a power of two up to 2^20, tripwires and tripsets at most 2^24, producers \
             1..={MAX_PRODUCERS} and producers_per_user 1..=producers (got {config:?})"
        )));
    }
    Ok(p)
}

/// Most ports (producer processes) of one queue.
pub const MAX_PRODUCERS: u32 = 1 << 16;

impl EqInner {
    pub(crate) fn create(
        id: u32,
        nic: Weak<NicInner>,
        links_open: Arc<std::sync::atomic::AtomicUsize>,
        config: EventQueueConfig,
    ) -> Result<Arc<EqInner>, EventQueueError> {
        let params = params_of(&config)?;
        let layout = EqLayout::new(params);
        let io = |context: &'static str| move |source| EventQueueError::Io { context, source };
        // Private memory: no other process ever maps any of it (they post on ports).
        let seg = Arc::new(Segment::anonymous(layout.size).map_err(io("mapping the event queue"))?);
        let map = EqMap::new(seg, layout).map_err(|e| EventQueueError::Io {
            context: "laying out the event queue",
            source: std::io::Error::other(e),
        })?;
        {
            let h = map.view().header;
            h.nrings.store(params.nrings, Ordering::Relaxed);
            h.ring_cap.store(params.ring_cap, Ordering::Relaxed);
            h.trip_cap.store(params.trip_cap, Ordering::Relaxed);
            h.tripset_cap.store(params.tripset_cap, Ordering::Relaxed);
            h.magic.store(EQ_MAGIC, Ordering::Release);
        }
        let eventfd = Arc::new(EventFd::new().map_err(io("creating the event queue eventfd"))?);
        let sleepers = Arc::new(Sleepers::new(eventfd.clone()).map_err(io("creating the event queue's epoll"))?);
        let port =
            Arc::new(EqPort { map, producer: Mutex::new(Producer::new(0)), eventfd, sleepers: Some(sleepers.clone()) });
        Ok(Arc::new(EqInner {
            id,
            nic,
            links_open,
            config,
            layout,
            port,
            sleepers,
            ports: Ports::default(),
            consumer: Mutex::new(Consumer::new(1)),
            trips: Mutex::new(TripAlloc::default()),
            meta: RwLock::new(Vec::new()),
            delivered: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            signalled: AtomicBool::new(false),
        }))
    }

    pub fn view(&self) -> &EqView<'_> {
        self.port.view()
    }

    /// Allocate a tripwire entry for endpoint `endpoint`: `(index, generation)`.
    pub fn alloc_trip(&self, endpoint: u32) -> Option<(u32, u32)> {
        let mut t = lock(&self.trips);
        // Reuse the oldest freed entry first (FIFO) to keep stale references stale long.
        let index = if t.free.len() > 64 || t.next >= self.layout.params.trip_cap {
            t.free.pop_front()?
        } else {
            let i = t.next;
            t.next += 1;
            i
        };
        let mut meta = self.meta.write().unwrap_or_else(|e| e.into_inner());
        if meta.len() <= index as usize {
            meta.resize(index as usize + 1, TripMeta::default());
        }
        let m = &mut meta[index as usize];
        m.generation = m.generation.wrapping_add(1).max(1);
        m.endpoint = endpoint;
        m.live = true;
        Some((index, m.generation))
    }

    /// Return an entry (already retired and unlinked).
    pub fn free_trip(&self, index: u32) {
        if let Some(m) = self.meta.write().unwrap_or_else(|e| e.into_inner()).get_mut(index as usize) {
            m.live = false;
        }
        lock(&self.trips).free.push_back(index);
    }

    /// Register queue index `index` (whose entry is `entry`, in the index counting its armed
    /// mirrors with `armed`) for events with `cookie`, or unregister it.
    pub fn set_registration(
        &self,
        entry: &trip::TripEntry,
        armed: trip::ArmedCount<'_>,
        index: u32,
        generation: u32,
        cookie: Option<u64>,
    ) -> bool {
        let meta = self.meta.read().unwrap_or_else(|e| e.into_inner());
        match meta.get(index as usize) {
            Some(m) if m.live && m.generation == generation => {
                let endpoint = m.endpoint;
                drop(meta);
                let cells = &self.view().table.cells;
                cells.get(index as usize).is_some_and(|c| {
                    // What its events report, on the cell's line (`decode`), before the
                    // state change that publishes it.
                    c.cookie.store(cookie.unwrap_or(0), Ordering::Relaxed);
                    c.owner.store(endpoint, Ordering::Relaxed);
                    trip::set_flags(entry, armed, c, index, generation, trip::ACT_EVENT, cookie.is_some())
                })
            }
            _ => false,
        }
    }

    pub fn alloc_tripset(&self) -> Option<u32> {
        let mut t = lock(&self.trips);
        if let Some(s) = t.tripsets_free.pop() {
            return Some(s);
        }
        (t.tripsets_next < self.layout.params.tripset_cap).then(|| {
            t.tripsets_next += 1;
            t.tripsets_next - 1
        })
    }

    pub fn free_tripset(&self, slot: u32) {
        lock(&self.trips).tripsets_free.push(slot);
    }

    fn decode(&self, ring: usize, w: [u64; 4]) -> Option<Event> {
        let word = match Word::decode(w) {
            // Only our own process posts on our ring (ring 0); ports are pumped.
            Some(word) if ring == 0 => word,
            _ => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        Some(match word {
            Word::Trip { index, generation, access } => {
                // The cell its firing just touched: live, of this generation, registered
                // (event action on), and what the registration reports.
                let v = self.view();
                let Some(c) = v.table.cell(index) else {
                    self.malformed.fetch_add(1, Ordering::Relaxed);
                    return None;
                };
                match trip::read_cell(c) {
                    Some((s, cookie, endpoint))
                        if trip::generation(s) == generation
                            && trip::flags(s) & (trip::LIVE | trip::ACT_EVENT) == trip::LIVE | trip::ACT_EVENT =>
                    {
                        Event::Tripwire {
                            id: TripwireId { queue: self.id, index, generation },
                            cookie,
                            endpoint,
                            access,
                        }
                    }
                    _ => {
                        self.stale.fetch_add(1, Ordering::Relaxed);
                        return None;
                    }
                }
            }
            Word::Oob { endpoint } => Event::Oob { endpoint },
            Word::Disconnect { endpoint, token } => Event::Disconnect { endpoint, token },
            Word::User(v) => Event::User(v),
            Word::ReadComplete { token } => Event::ReadComplete { token },
            Word::Dma { endpoint, tag, failure } => {
                let result = match crate::dma::failure_from_code(failure) {
                    Some(f) => Err(f),
                    None => Ok(()),
                };
                Event::DmaComplete { endpoint, tag, result }
            }
            // Any producer may post these (a writer in another process): plain numbers,
            // checked by the consumer against its apertures.
            Word::Notification { aperture, generation, offset, len } => {
                Event::Notification { aperture, generation, offset, len }
            }
            Word::Overflow { lost } => Event::Overflow { lost },
            // Ports carry claims, applied when pumped (`crate::port`); never our ring.
            Word::Claim { .. } => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        })
    }

    /// Take one event: from our ring, else from what the ports hold (pumped into it).
    pub fn try_take(&self) -> Option<Event> {
        if let Some(ev) = self.take_own() {
            return Some(ev);
        }
        // The ports' events come straight to this thread (the first one: the others go on
        // our ring, for any consumer), without waking anyone for them.
        for _ in 0..4 {
            let mut first = None;
            let any = self.pump_into(Some(&mut first));
            if !any {
                break;
            }
            if let Some(ev) = first.and_then(|w| self.decode(0, w.encode())) {
                self.delivered.fetch_add(1, Ordering::Relaxed);
                return Some(ev);
            }
            // The rest went to our ring.
            if let Some(ev) = self.take_own() {
                return Some(ev);
            }
        }
        None
    }

    fn take_own(&self) -> Option<Event> {
        let v = self.view();
        let rings = v.rings();
        // A plain load first: an empty ring costs no lock (every post sets the summary bit,
        // only the consumer clears it).
        if !ring::maybe_nonempty(&rings) {
            return None;
        }
        let mut c = lock(&self.consumer);
        loop {
            match c.take(&rings)? {
                Taken::Event { ring, words } => {
                    if let Some(ev) = self.decode(ring, words) {
                        self.delivered.fetch_add(1, Ordering::Relaxed);
                        return Some(ev);
                    }
                }
                Taken::Overflow { lost, .. } => {
                    self.lost.fetch_add(lost, Ordering::Relaxed);
                    return Some(Event::Overflow { lost });
                }
                Taken::Corrupt { skipped, .. } => {
                    self.malformed.fetch_add(1, Ordering::Relaxed);
                    self.lost.fetch_add(skipped, Ordering::Relaxed);
                    return Some(Event::Overflow { lost: skipped });
                }
            }
        }
    }

    /// Arm our ring and the ports for `mode`; whether all are empty (exact for our ring:
    /// stale summary bits are settled before answering).
    pub fn arm(&self, mode: u32) -> bool {
        let own = self.arm_own(mode);
        self.arm_ports(mode) && own
    }

    /// Whether our ring and the ports' are all still armed for `mode` since the last arm,
    /// and empty ([`clan_shm::ring::still_armed`]).
    fn still_armed(&self, mode: u32) -> bool {
        let v = self.view();
        ring::still_armed(&v.rings(), mode) && self.ports_still_armed(mode)
    }

    /// Arm our ring for `mode`; whether it is empty.
    pub fn arm_own(&self, mode: u32) -> bool {
        let v = self.view();
        let rings = v.rings();
        ring::arm(&rings, mode) || {
            lock(&self.consumer).settle(&rings);
            !ring::maybe_nonempty(&rings)
        }
    }

    /// Post an event from this process (on our ring, ring 0 of our own queues).
    pub fn post_local(&self, word: Word) -> bool {
        self.port.post(word)
    }
}

/// An event queue. Cheap to clone (clones share the queue); `Send` and `Sync`: any thread may
/// take events, and several may wait at once.
///
/// ```
/// use std::time::Duration;
/// use clan::{Event, EventQueueError};
///
/// let nic = clan::Nic::open_default()?;
/// let q = nic.event_queue(clan::EventQueueConfig::default())?;
/// assert_eq!(q.try_take(), None);
/// let q2 = q.clone();
/// let t = std::thread::spawn(move || q2.post_user(7)); // wakes the waiter below
/// assert_eq!(q.wait(Some(Duration::from_secs(5)))?, Event::User(7));
/// t.join().unwrap();
/// assert!(matches!(q.wait(Some(Duration::from_millis(5))), Err(EventQueueError::Timeout)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct EventQueue {
    pub(crate) inner: Arc<EqInner>,
}

impl std::fmt::Debug for EventQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.inner.layout.params;
        f.debug_struct("EventQueue")
            .field("id", &self.inner.id)
            .field("producers", &p.nrings)
            .field("ring_capacity", &p.ring_cap)
            .field("tripwires", &p.trip_cap)
            .finish()
    }
}

impl EventQueue {
    /// Take one event if there is one: never blocks, never makes a system call.
    pub fn try_take(&self) -> Option<Event> {
        self.inner.try_take()
    }

    /// Begin a spin on the links of this queue's NIC ([`crate::LinkSpin`]): for a loop that
    /// polls this queue ([`EventQueue::try_take`]) for events that traffic from other hosts
    /// may cause, and applies that traffic itself ([`crate::LinkSpin::drive`], every few
    /// polls) rather than wait for the NIC's engine thread to be scheduled, on its own CPU
    /// perhaps. One load when the NIC has no link open.
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// let q = nic.event_queue(clan::EventQueueConfig::default())?;
    /// let links = q.spin_links();
    /// let mut polls = 0u32;
    /// let ev = loop {
    ///     if let Some(ev) = q.try_take() {
    ///         break Some(ev);
    ///     }
    ///     polls += 1;
    ///     if polls % 8 == 0 {
    ///         links.drive(); // no link here: nothing to do
    ///     }
    ///     if polls == 1000 {
    ///         break None;
    ///     }
    /// };
    /// assert!(ev.is_none());
    /// links.sleep(); // before sleeping on the queue: the engine listens again
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn spin_links(&self) -> crate::LinkSpin {
        // A hint (Relaxed): a link that opens during the spin is served by the engine.
        let open = self.inner.links_open.load(Ordering::Relaxed) != 0;
        crate::LinkSpin::begin(if open { self.inner.nic.upgrade() } else { None })
    }

    /// Take up to `max` events into `out`; returns how many.
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// # let q = nic.event_queue(clan::EventQueueConfig::default())?;
    /// for v in 0..5 {
    ///     q.post_user(v);
    /// }
    /// let mut batch = Vec::new();
    /// assert_eq!(q.poll(&mut batch, 3), 3);
    /// assert_eq!(batch, [clan::Event::User(0), clan::Event::User(1), clan::Event::User(2)]);
    /// assert_eq!(q.poll(&mut batch, 16), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn poll(&self, out: &mut Vec<Event>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            match self.try_take() {
                Some(ev) => {
                    out.push(ev);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Wait for an event: spin for the configured time, then sleep until one is posted or
    /// `timeout` passes (None: no limit).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Event, EventQueueError> {
        self.wait_spin(self.inner.config.spin, timeout)
    }

    /// [`EventQueue::wait`] with an explicit spin time.
    ///
    /// With [`crate::Progress::Manual`], the waiting thread drives its NIC's links: it
    /// processes their traffic while it spins, and sleeps on the links' sockets and the
    /// queue's descriptor together, so that traffic from another host wakes it directly (no
    /// second thread in between).
    pub fn wait_spin(&self, spin: Duration, timeout: Option<Duration>) -> Result<Event, EventQueueError> {
        let nic = progress::driver(self.inner.nic.upgrade());
        let links = progress::SpinLinks::new(&self.inner.nic, &self.inner.links_open, spin);
        let poll = || {
            if let Some(n) = &nic {
                n.progress();
            }
            links.poll();
            self.try_take()
        };
        let sleep = |nap: Option<Duration>| {
            links.sleeping();
            if let Some(n) = &nic {
                // Sleep on the links and the queue's descriptor together (armed first; not
                // at all if events are pending).
                if !self.arm() || progress::sleep_on_links(n, Some(self.as_fd()), nap) {
                    return;
                }
            }
            let i = &self.inner;
            let v = i.view();
            let words = &v.header.words;
            // SYNC POINT: read the wake word before arming, so that a post after our arming
            // makes the sleep return at once (pairs with the producer's `fetch_add(Release)`).
            let seen = words.wake.load(Ordering::Acquire);
            // The ports are armed by the sleep itself (as the leader).
            if i.arm_own(ARM_FUTEX) {
                if let Some(nic) = i.sleep(&words.wake, seen, nap) {
                    nic.progress_woken();
                }
            }
        };
        progress::wait(spin, Deadline::after(timeout), None, poll, sleep).ok_or(EventQueueError::Timeout)
    }

    /// Arm the file descriptor before sleeping on it in an epoll/mio/tokio loop. Returns
    /// `true` if the queue is empty (sleep: the descriptor becomes readable when an event is
    /// posted), `false` if events are pending (the descriptor is left readable: take them).
    ///
    /// The queue in a mio loop (the same with epoll or tokio):
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::Event;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let mut q = nic.event_queue(clan::EventQueueConfig::default())?;
    /// let mut poll = mio::Poll::new()?;
    /// poll.registry().register(&mut q, mio::Token(0), mio::Interest::READABLE)?;
    /// let q2 = q.clone();
    /// std::thread::spawn(move || q2.post_user(5));
    /// let mut events = mio::Events::with_capacity(4);
    /// let got = loop {
    ///     if let Some(ev) = q.try_take() {
    ///         break ev;
    ///     }
    ///     if q.arm() {
    ///         // Empty and armed: the descriptor turns readable when an event is posted.
    ///         poll.poll(&mut events, Some(Duration::from_secs(5)))?;
    ///     }
    /// };
    /// assert_eq!(got, Event::User(5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn arm(&self) -> bool {
        let i = &self.inner;
        // Nothing woke the descriptor since the last arm (every ring still armed for it: a
        // producer that signals disarms first; and not left readable by us), and nothing is
        // pending: it is as that arm left it, and stays armed. No system call: a program
        // that arms the queues of thousands of idle connections before each sleep (`clan
        // run` under an epoll loop) pays a load or two for each, not a reset.
        // (Relaxed: a stale `false` costs the full path below; a stale `true`, a wake-up.)
        if !i.signalled.load(Ordering::Relaxed) && i.still_armed(ARM_FD) {
            return true;
        }
        i.signalled.store(false, Ordering::Relaxed);
        // Reset what is readable (the queue's eventfd and the ports'), then arm everything.
        // (on the stack: arming allocates nothing)
        let mut events = [std::mem::MaybeUninit::<rustix::event::epoll::Event>::uninit(); 16];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        if let Ok((events, _)) = rustix::event::epoll::wait(i.sleepers.fd(), &mut events[..], Some(&zero)) {
            for ev in events.iter() {
                let id = ev.data.u64();
                i.drain(id);
            }
        }
        let empty = i.arm(ARM_FD);
        if !empty {
            i.signalled.store(true, Ordering::Relaxed);
            i.sleepers.notify.signal();
        }
        empty
    }

    /// Post [`Event::User`]`(value)`: wakes a sleeping consumer, e.g. from another thread.
    /// Returns false if the queue's own ring is full (the loss is reported as overflow).
    pub fn post_user(&self, value: u64) -> bool {
        self.inner.post_local(Word::User(value))
    }

    /// Counters.
    pub fn stats(&self) -> EventQueueStats {
        let i = &self.inner;
        EventQueueStats {
            delivered: i.delivered.load(Ordering::Relaxed),
            lost: i.lost.load(Ordering::Relaxed),
            malformed: i.malformed.load(Ordering::Relaxed),
            stale: i.stale.load(Ordering::Relaxed),
            producers: i.port_count() as u64,
        }
    }

    /// Identity of the queue within its NIC.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &EventQueueConfig {
        &self.inner.config
    }

    /// Register interest in `tripwire`: its firings are posted here as [`Event::Tripwire`]
    /// carrying `cookie`. The tripwire must belong to an endpoint using this queue.
    ///
    /// ```
    /// use clan::{Event, TripwireConfig};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = ep.export(4096)?;
    /// let m = peer.import(&ap.descriptor())?;
    /// let tw = ap.tripwire(TripwireConfig::writes(0..8))?; // no event yet
    /// let q = ep.event_queue();
    /// q.register(&tw, 42)?;
    /// m.store_u64(0, 1)?;
    /// assert!(matches!(q.try_take(), Some(Event::Tripwire { cookie: 42, .. })));
    /// q.unregister(&tw)?;
    /// m.store_u64(0, 2)?;
    /// assert_eq!(q.try_take(), None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register(&self, tripwire: &crate::Tripwire, cookie: u64) -> Result<(), crate::TripwireError> {
        tripwire.set_registration(self, Some(cookie))
    }

    /// Stop posting `tripwire`'s firings here (events already posted are dropped on taking).
    pub fn unregister(&self, tripwire: &crate::Tripwire) -> Result<(), crate::TripwireError> {
        tripwire.set_registration(self, None)
    }
}

impl AsFd for EventQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.sleepers.fd()
    }
}

impl AsRawFd for EventQueue {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.sleepers.fd().as_raw_fd()
    }
}

/// mio integration: registering arms the queue, so a poll that follows returns when an event
/// is (or already was) posted. After draining with `try_take`, call [`EventQueue::arm`]
/// before the next `poll`.
impl mio::event::Source for EventQueue {
    fn register(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
        interests: mio::Interest,
    ) -> std::io::Result<()> {
        self.arm();
        mio::unix::SourceFd(&self.as_raw_fd()).register(registry, token, interests)
    }
    fn reregister(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
        interests: mio::Interest,
    ) -> std::io::Result<()> {
        self.arm();
        mio::unix::SourceFd(&self.as_raw_fd()).reregister(registry, token, interests)
    }
    fn deregister(&mut self, registry: &mio::Registry) -> std::io::Result<()> {
        mio::unix::SourceFd(&self.as_raw_fd()).deregister(registry)
    }
}
