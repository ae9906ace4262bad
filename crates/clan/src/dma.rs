//! DMA: asynchronous transfers moved by the NIC's DMA engine (Tripwire paper §3.4).
//!
//! Each endpoint has a DMA request queue shared with its NIC's DMA engine, a thread of the
//! NIC started with the first request. A request names a source region and a destination
//! (an aperture of this process and a mapping, either way round) and a length; requests can
//! be chained. Posting is a few stores into the queue; the application rings the engine's
//! doorbell only when it finds the queue idle (`clan_shm::doorbell`), and the engine then
//! services every non-empty queue round-robin, one quantum ([`crate::DmaConfig::quantum`])
//! at a time, until each is empty — so endpoints that saturate the engine share it evenly.
//!
//! Within a host the engine copies (from the source aperture's memory straight into the
//! exporter's, snooping the destination's tripwires exactly like programmed I/O); across
//! hosts it sends write bursts from the source memory (no copy) or issues read requests
//! whose responses land in the destination aperture.
//!
//! Completion is reported three ways: the request's completion word, which the application
//! can spin on without a system call ([`DmaTicket::is_complete`]); an optional event in the
//! endpoint's event queue ([`DmaOptions::event`]); and tripwires — a read tripwire on the
//! source range of a local aperture fires when the engine has read it (the buffer may be
//! reused), and a tripwire on the destination mapping fires when the write has completed.
//!
//! Requests of one queue are executed in order; a write request completes when its data has
//! been written into the destination memory (within a host) or handed to the link, in order
//! with every later write of this NIC to that host (across hosts: use
//! [`crate::Mapping::barrier`] to know it has been applied). Closing the endpoint cancels
//! what has not completed ([`DmaFailure::Cancelled`]).

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use clan_shm::doorbell::{Bell, Schedule};
use clan_shm::sync::{AtomicU32, AtomicU64, Ordering, SharedFutex, fence};
use clan_shm::trip::{self, Access};

use crate::aperture::{Aperture, ApertureInner};
use crate::config::DmaConfig;
use crate::error::{AccessError, DmaError, DmaFailure};
use crate::event_queue::{EventQueue, Word};
use crate::lock;
use crate::mapping::Mapping;
use crate::progress::{self, Deadline};
use crate::window::check_range;

/// Least bytes a turn moves over a link (whatever [`crate::DmaConfig::quantum`] says).
const LINK_QUANTUM: u64 = 1 << 20;

/// Requests an endpoint's DMA queue holds by default.
pub const DEFAULT_DMA_QUEUE: usize = 256;

/// Options of a DMA request (or of a chain: they apply to its completion).
///
/// ```
/// use std::time::Duration;
/// use clan::{DmaOptions, Event};
///
/// let nic = clan::Nic::open_default()?;
/// let q = nic.event_queue(clan::EventQueueConfig::default())?; // `me`'s queue alone
/// let them = nic.endpoint()?;
/// let me = nic.endpoint_with(clan::EndpointConfig { queue: Some(q.clone()), ..Default::default() })?;
/// let (src, target) = (me.export(4096)?, them.export(4096)?);
/// let dst = me.import(&target.descriptor())?;
/// me.dma_write(&src, 0, &dst, 0, 4096, DmaOptions::new().event(77))?;
/// // Completion as an event (a file descriptor for epoll), instead of the ticket:
/// match q.wait(Some(Duration::from_secs(5)))? {
///     Event::DmaComplete { endpoint, tag, result } => {
///         assert_eq!((endpoint, tag, result), (me.port(), 77, Ok(())));
///     }
///     other => panic!("unexpected {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DmaOptions {
    event: Option<u64>,
    notify: bool,
}

impl DmaOptions {
    /// No event, no notification: completion is seen through the ticket (or tripwires).
    pub fn new() -> DmaOptions {
        DmaOptions::default()
    }

    /// Post [`crate::Event::DmaComplete`] with `tag` to the endpoint's event queue when the
    /// request (or chain) completes, successfully or not.
    pub fn event(mut self, tag: u64) -> DmaOptions {
        self.event = Some(tag);
        self
    }

    /// After a write request's data, notify the exporter ([`crate::Mapping::notify`]): the
    /// exporter's queue gets [`crate::Event::Notification`] for the written range.
    pub fn notify(mut self) -> DmaOptions {
        self.notify = true;
        self
    }
}

const PENDING: u32 = 0;
const DONE_OK: u32 = 1;

fn failure_code(f: DmaFailure) -> u8 {
    match f {
        DmaFailure::Cancelled => 2,
        DmaFailure::Revoked => 3,
        DmaFailure::Disconnected => 4,
        DmaFailure::Timeout => 5,
        DmaFailure::ChainAborted => 6,
    }
}

/// The failure a completion code stands for (`None`: success or unknown).
pub(crate) fn failure_from_code(c: u8) -> Option<DmaFailure> {
    Some(match c {
        2 => DmaFailure::Cancelled,
        3 => DmaFailure::Revoked,
        4 => DmaFailure::Disconnected,
        5 => DmaFailure::Timeout,
        6 => DmaFailure::ChainAborted,
        _ => return None,
    })
}

fn access_failure(e: AccessError) -> DmaFailure {
    match e {
        AccessError::Disconnected => DmaFailure::Disconnected,
        AccessError::Timeout => DmaFailure::Timeout,
        _ => DmaFailure::Revoked,
    }
}

/// The completion word of a request (or chain) and its sleepers.
#[derive(Debug, Default)]
struct Completion {
    /// `PENDING`, `DONE_OK` or a failure code.
    word: AtomicU32,
    waiters: AtomicU32,
}

impl Completion {
    fn complete(&self, result: Result<(), DmaFailure>) {
        let code = match result {
            Ok(()) => DONE_OK,
            Err(f) => u32::from(failure_code(f)),
        };
        // SYNC POINT: pairs with `DmaTicket::is_complete`'s Acquire load: the moved data
        // (and the source's tripwire firings) happen before.
        self.word.store(code, Ordering::Release);
        // Completer's half of `trip::wait_until`'s protocol: store, fence, load waiters.
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::Relaxed) > 0 {
            clan_shm::sync::Futex::wake(&SharedFutex, &self.word);
        }
    }

    fn result(&self) -> Option<Result<(), DmaFailure>> {
        // SYNC POINT: pairs with `complete`'s Release store.
        match self.word.load(Ordering::Acquire) {
            PENDING => None,
            DONE_OK => Some(Ok(())),
            c => Some(Err(failure_from_code(c as u8).unwrap_or(DmaFailure::Cancelled))),
        }
    }
}

/// A handle on a posted request (or chain). Dropping it does not cancel anything.
/// `Send` and `Sync`; cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use clan::DmaOptions;
///
/// let nic = clan::Nic::open_default()?;
/// let (me, them) = (nic.endpoint()?, nic.endpoint()?);
/// let (src, target) = (me.export(1 << 20)?, them.export(1 << 20)?);
/// src.fill(0, 1 << 20, 0x5a)?;
/// let dst = me.import(&target.descriptor())?;
/// let ticket = me.dma_write(&src, 0, &dst, 0, 1 << 20, DmaOptions::new())?;
/// // ... the engine moves the megabyte while this thread goes on ...
/// ticket.wait(Some(Duration::from_secs(5)))?;
/// assert!(ticket.is_complete());
/// assert_eq!(ticket.result(), Some(Ok(())));
/// assert_eq!(target.load_u64((1 << 20) - 8)?, 0x5a5a_5a5a_5a5a_5a5a);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct DmaTicket {
    done: Arc<Completion>,
    spin: Duration,
}

impl std::fmt::Debug for DmaTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaTicket").field("complete", &self.is_complete()).finish_non_exhaustive()
    }
}

impl DmaTicket {
    /// Whether the request has completed: one load of its completion word, no system call
    /// (spin on it when a reply is expected within microseconds).
    #[inline]
    pub fn is_complete(&self) -> bool {
        self.done.word.load(Ordering::Acquire) != PENDING
    }

    /// How it ended, if it has.
    pub fn result(&self) -> Option<Result<(), DmaFailure>> {
        self.done.result()
    }

    /// Wait for completion: spin a little ([`crate::DmaConfig::spin`]), then sleep. `None`
    /// waits without limit.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), DmaError> {
        self.wait_spin(self.spin, timeout)
    }

    /// [`DmaTicket::wait`] with an explicit spin time (zero when the engine shares this
    /// thread's CPU: spinning would only delay it).
    pub fn wait_spin(&self, spin: Duration, timeout: Option<Duration>) -> Result<(), DmaError> {
        let poll = || self.is_complete().then_some(());
        let sleep = |nap: Option<Duration>| {
            let until = nap.map(|n| Instant::now() + n);
            trip::wait_until(&self.done.word, &self.done.waiters, Duration::ZERO, until, &SharedFutex, || {
                self.is_complete()
            });
        };
        progress::wait(spin, Deadline::after(timeout), None, poll, sleep);
        match self.result() {
            None => Err(DmaError::Timeout),
            Some(Ok(())) => Ok(()),
            Some(Err(f)) => Err(DmaError::Failed(f)),
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Local aperture → mapping.
    Write { src: Arc<ApertureInner>, src_off: u64, dst: Mapping, dst_off: u64 },
    /// Mapping → local aperture.
    Read { src: Mapping, src_off: u64, dst: Arc<ApertureInner>, dst_off: u64 },
}

/// One request of a chain ([`crate::Endpoint::dma_chain`]), checked when it is made.
///
/// ```
/// use std::time::Duration;
/// use clan::{AccessError, DmaError, DmaOptions, DmaRequest};
///
/// let nic = clan::Nic::open_default()?;
/// let (me, them) = (nic.endpoint()?, nic.endpoint()?);
/// let (src, target) = (me.export(4096)?, them.export(4096)?);
/// let dst = me.import(&target.descriptor())?;
/// src.write(8, b"body")?;
/// src.store_u64(0, 1)?;
/// // The body, then the flag: requests of a chain run in order.
/// let chain = vec![DmaRequest::write(&src, 8, &dst, 8, 4)?, DmaRequest::write(&src, 0, &dst, 0, 8)?];
/// assert_eq!(chain[0].len(), 4);
/// me.dma_chain(chain, DmaOptions::new())?.wait(Some(Duration::from_secs(5)))?;
/// assert_eq!(target.load_u64(0)?, 1);
/// // Checked when made: range and rights.
/// let bad = DmaRequest::write(&src, 4090, &dst, 0, 8);
/// assert!(matches!(bad, Err(DmaError::Access(AccessError::OutOfBounds { .. }))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct DmaRequest {
    op: Op,
    len: u64,
    notify: bool,
}

impl std::fmt::Debug for DmaRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.op {
            Op::Write { .. } => "write",
            _ => "read",
        };
        f.debug_struct("DmaRequest").field("op", &kind).field("len", &self.len).field("notify", &self.notify).finish()
    }
}

impl DmaRequest {
    /// Write `len` bytes of `src` at `src_off` to `dst` at `dst_off`.
    pub fn write(src: &Aperture, src_off: u64, dst: &Mapping, dst_off: u64, len: u64) -> Result<DmaRequest, DmaError> {
        check_local(&src.inner, src_off, len)?;
        dst.check_access(dst_off, len, crate::Rights::WRITE)?;
        Ok(DmaRequest {
            op: Op::Write { src: src.inner.clone(), src_off, dst: dst.clone(), dst_off },
            len,
            notify: false,
        })
    }

    /// Read `len` bytes of `src` at `src_off` into `dst` at `dst_off` (a remote fetch).
    pub fn read(src: &Mapping, src_off: u64, dst: &Aperture, dst_off: u64, len: u64) -> Result<DmaRequest, DmaError> {
        src.check_access(src_off, len, crate::Rights::READ)?;
        check_local(&dst.inner, dst_off, len)?;
        Ok(DmaRequest {
            op: Op::Read { src: src.clone(), src_off, dst: dst.inner.clone(), dst_off },
            len,
            notify: false,
        })
    }

    /// Notify the exporter after this (write) request's data.
    pub fn notify(mut self) -> DmaRequest {
        self.notify = true;
        self
    }

    /// Bytes moved.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it moves nothing (a zero-length request completes in order: a marker).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn check_local(ap: &ApertureInner, off: u64, len: u64) -> Result<(), DmaError> {
    check_range(off, len, ap.len)?;
    if ap.revoked.load(std::sync::atomic::Ordering::Acquire) {
        return Err(AccessError::Revoked.into());
    }
    Ok(())
}

#[derive(Debug)]
struct Job {
    req: DmaRequest,
    /// The last request of its chain: it completes the chain.
    last: bool,
    event: Option<u64>,
    done: Arc<Completion>,
}

/// Counters of an endpoint's DMA queue ([`crate::Endpoint::dma_stats`]).
///
/// ```
/// # use std::time::Duration;
/// # let nic = clan::Nic::open_default()?;
/// # let (me, them) = (nic.endpoint()?, nic.endpoint()?);
/// # let (src, target) = (me.export(4096)?, them.export(4096)?);
/// # let dst = me.import(&target.descriptor())?;
/// assert_eq!(me.dma_stats(), clan::DmaStats::default(), "no DMA yet");
/// me.dma_write(&src, 0, &dst, 0, 4096, clan::DmaOptions::new())?.wait(Some(Duration::from_secs(5)))?;
/// let s = me.dma_stats();
/// assert_eq!((s.posted, s.completed, s.failed, s.bytes), (1, 1, 0, 4096));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DmaStats {
    /// Requests posted.
    pub posted: u64,
    /// Requests completed (successfully or not).
    pub completed: u64,
    /// Requests that failed or were cancelled.
    pub failed: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Times the application rang the engine's doorbell (it only does when it finds the
    /// queue idle: far fewer than `posted` while the engine keeps up with a busy queue).
    pub doorbells: u64,
}

#[derive(Debug, Default)]
struct Cursor {
    job: Option<Job>,
    moved: u64,
    chain_failed: Option<DmaFailure>,
    /// A read over a link is in flight for `job`.
    waiting: bool,
}

/// One endpoint's DMA queue.
#[derive(Debug)]
pub(crate) struct DmaQueue {
    port: u32,
    events: EventQueue,
    jobs: ArrayQueue<Job>,
    post: Mutex<()>,
    sched: Schedule,
    closed: AtomicBool,
    /// Engine-private progress (a lock only for the rare closer and link callback).
    cursor: Mutex<Cursor>,
    /// Result of the link read the queue is parked on.
    parked: Mutex<Option<Result<u64, DmaFailure>>>,
    /// Rung whenever a request leaves the queue (posters waiting for room sleep on it).
    room: Bell,
    engine: Arc<Shared>,
    posted: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    doorbells: AtomicU64,
}

impl DmaQueue {
    pub fn new(engine: Arc<Shared>, port: u32, events: EventQueue, capacity: usize) -> DmaQueue {
        DmaQueue {
            port,
            events,
            jobs: ArrayQueue::new(capacity.max(1)),
            post: Mutex::new(()),
            sched: Schedule::new(),
            closed: AtomicBool::new(false),
            cursor: Mutex::new(Cursor::default()),
            parked: Mutex::new(None),
            room: Bell::new(),
            engine,
            posted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            doorbells: AtomicU64::new(0),
        }
    }

    pub fn stats(&self) -> DmaStats {
        DmaStats {
            posted: self.posted.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            doorbells: self.doorbells.load(Ordering::Relaxed),
        }
    }

    /// Post a chain (one request is a chain of one).
    pub fn post(self: &Arc<Self>, reqs: Vec<DmaRequest>, opts: DmaOptions) -> Result<DmaTicket, DmaError> {
        if reqs.is_empty() {
            return Err(DmaError::EmptyChain);
        }
        if reqs.len() > self.jobs.capacity() {
            return Err(DmaError::ChainTooLong { len: reqs.len(), capacity: self.jobs.capacity() });
        }
        let done = Arc::new(Completion::default());
        let n = reqs.len();
        let _g = lock(&self.post);
        for (i, mut req) in reqs.into_iter().enumerate() {
            let last = i + 1 == n;
            req.notify |= last && opts.notify;
            let mut job = Job { req, last, event: if last { opts.event } else { None }, done: done.clone() };
            loop {
                if self.closed.load(Ordering::Acquire) {
                    // Requests of this chain already queued are cancelled by the closer.
                    return Err(DmaError::EndpointClosed);
                }
                let seen = self.room.count.load(Ordering::Acquire);
                match self.jobs.push(job) {
                    Ok(()) => break,
                    Err(j) => {
                        job = j;
                        // Full: make sure the engine knows, then wait for room.
                        self.ring();
                        trip::wait_until(
                            &self.room.count,
                            &self.room.sleepers,
                            self.engine.spin,
                            Some(Instant::now() + Duration::from_millis(50)),
                            &SharedFutex,
                            || self.room.count.load(Ordering::Acquire) != seen || self.closed.load(Ordering::Acquire),
                        );
                    }
                }
            }
            self.posted.fetch_add(1, Ordering::Relaxed);
        }
        // The pushes above were the publishing stores (crossbeam's queue: Release). The
        // doorbell once, for the whole chain (unless it had to wait for room on the way).
        self.ring();
        Ok(DmaTicket { done, spin: self.engine.spin })
    }

    /// Ring the doorbell if the queue is idle.
    fn ring(self: &Arc<Self>) {
        if self.sched.after_publish() {
            self.doorbells.fetch_add(1, Ordering::Relaxed);
            self.engine.schedule(self.clone());
        }
    }

    /// Close: cancel what is pending (the engine does it, in order).
    pub fn close(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.sched.kick() {
            self.engine.schedule(self.clone());
        }
        self.room.ring(&SharedFutex);
    }

    fn is_empty(&self) -> bool {
        self.jobs.is_empty() && lock(&self.cursor).job.is_none()
    }

    fn finish(&self, c: &mut Cursor, result: Result<(), DmaFailure>) {
        let Some(job) = c.job.take() else { return };
        c.moved = 0;
        c.waiting = false;
        self.completed.fetch_add(1, Ordering::Relaxed);
        if let Err(f) = result {
            self.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(endpoint = self.port, failure = ?f, "DMA request failed");
        }
        if !job.last {
            if let Err(f) = result {
                c.chain_failed.get_or_insert(f);
            }
            return;
        }
        let result = match c.chain_failed.take() {
            Some(f) => Err(f),
            None => result,
        };
        // The event first: a thread that sees the completion word finds the event queued.
        if let Some(tag) = job.event {
            let failure = match result {
                Ok(()) => 0,
                Err(f) => failure_code(f),
            };
            self.events.inner.post_local(Word::Dma { endpoint: self.port, tag, failure });
        }
        job.done.complete(result);
    }
}

/// What a turn of service left the queue in.
enum Next {
    /// More to do: back to the end of the list.
    Again,
    /// Nothing left.
    Idle,
    /// Waiting for a link read; the link's callback puts it back on the list.
    Parked,
}

/// What the engine shares with the queues.
#[derive(Debug)]
pub(crate) struct Shared {
    active: Mutex<VecDeque<Arc<DmaQueue>>>,
    bell: Bell,
    stop: AtomicBool,
    spin: Duration,
    quantum: u64,
}

impl Shared {
    /// Put `q` (just moved from idle to scheduled) on the list and wake the engine.
    fn schedule(&self, q: Arc<DmaQueue>) {
        lock(&self.active).push_back(q);
        self.bell.ring(&SharedFutex);
    }
}

/// The DMA engine of a NIC: one thread, started with the first request.
#[derive(Debug)]
pub(crate) struct DmaEngine {
    pub shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DmaEngine {
    pub fn start(cfg: &DmaConfig) -> std::io::Result<DmaEngine> {
        let shared = Arc::new(Shared {
            active: Mutex::new(VecDeque::new()),
            bell: Bell::new(),
            stop: AtomicBool::new(false),
            spin: cfg.spin,
            quantum: cfg.quantum.max(4096),
        });
        let s = shared.clone();
        let cpu = cfg.cpu;
        let thread = std::thread::Builder::new().name("clan-dma".into()).spawn(move || {
            if let Some(c) = cpu {
                let mut set = rustix::thread::CpuSet::new();
                set.set(c);
                let _ = rustix::thread::sched_setaffinity(None, &set);
            }
            run(&s);
        })?;
        Ok(DmaEngine { shared, thread: Some(thread) })
    }

    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.bell.ring(&SharedFutex);
        if let Some(t) = self.thread.take() {
            // The last handle of the NIC may be dropped by the engine itself (a request held
            // the last reference to one of its objects).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn run(s: &Arc<Shared>) {
    loop {
        // SYNC POINT: pairs with `Bell::ring`'s AcqRel increment (read before the list, so a
        // ring after the look below is noticed by the sleep).
        let seen = s.bell.count.load(Ordering::Acquire);
        let next = lock(&s.active).pop_front();
        match next {
            Some(q) => match service(s, &q) {
                Next::Again => lock(&s.active).push_back(q),
                Next::Idle => {
                    if q.sched.on_empty(|| q.is_empty()) {
                        lock(&s.active).push_back(q);
                    }
                }
                Next::Parked => {}
            },
            None => {
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                trip::wait_until(
                    &s.bell.count,
                    &s.bell.sleepers,
                    s.spin,
                    Some(Instant::now() + Duration::from_millis(200)),
                    &SharedFutex,
                    || s.bell.count.load(Ordering::Acquire) != seen,
                );
            }
        }
    }
}

/// One turn: at most one quantum of the queue's current request.
fn service(s: &Shared, q: &Arc<DmaQueue>) -> Next {
    let mut c = lock(&q.cursor);
    if c.waiting {
        match lock(&q.parked).take() {
            None => return Next::Parked,
            Some(Ok(n)) => {
                c.waiting = false;
                c.moved += n;
                q.bytes.fetch_add(n, Ordering::Relaxed);
                if c.job.as_ref().is_some_and(|j| c.moved >= j.req.len) {
                    q.finish(&mut c, Ok(()));
                }
            }
            Some(Err(f)) => q.finish(&mut c, Err(f)),
        }
    }
    if c.job.is_none() {
        match q.jobs.pop() {
            Some(j) => {
                c.job = Some(j);
                c.moved = 0;
                q.room.ring(&SharedFutex);
            }
            None => return Next::Idle,
        }
    }
    // The engine stops only when the NIC's last handle goes, which every endpoint holds: by
    // then each endpoint was closed, so whatever is left is cancelled.
    if q.closed.load(Ordering::Acquire) || s.stop.load(Ordering::Acquire) {
        let why = DmaFailure::Cancelled;
        q.finish(&mut c, Err(why));
        while let Some(j) = q.jobs.pop() {
            c.job = Some(j);
            q.finish(&mut c, Err(why));
        }
        q.room.ring(&SharedFutex);
        return Next::Idle;
    }
    if c.chain_failed.is_some() {
        q.finish(&mut c, Err(DmaFailure::ChainAborted));
        return more(q, &c);
    }
    let Some(job) = c.job.as_ref() else { return Next::Idle };
    match step(q, job, c.moved, s.quantum) {
        Ok(Step::Moved(n)) => {
            c.moved += n;
            q.bytes.fetch_add(n, Ordering::Relaxed);
        }
        Ok(Step::Parked) => {
            c.waiting = true;
            return Next::Parked;
        }
        Err(f) => {
            // The endpoint closed under the request (its apertures are unexported as it
            // closes): the request was cancelled, whatever the access then met.
            let f = if q.closed.load(Ordering::Acquire) { DmaFailure::Cancelled } else { f };
            q.finish(&mut c, Err(f));
            return more(q, &c);
        }
    }
    if c.job.as_ref().is_some_and(|j| c.moved >= j.req.len) {
        let notify = c.job.as_ref().and_then(|j| match &j.req.op {
            Op::Write { dst, dst_off, .. } if j.req.notify => Some((dst.clone(), *dst_off, j.req.len)),
            _ => None,
        });
        let r = match notify {
            Some((m, off, len)) => m.notify(off, len).map_err(access_failure),
            None => Ok(()),
        };
        q.finish(&mut c, r);
    }
    more(q, &c)
}

fn more(q: &DmaQueue, c: &Cursor) -> Next {
    if c.job.is_some() || !q.jobs.is_empty() { Next::Again } else { Next::Idle }
}

enum Step {
    /// This many bytes were moved.
    Moved(u64),
    /// A read over a link is in flight.
    Parked,
}

/// Move the next bytes of `job`, `at` bytes in: at most `quantum` of them when the engine
/// moves them itself, up to a whole read request when another host does.
fn step(q: &Arc<DmaQueue>, job: &Job, at: u64, quantum: u64) -> Result<Step, DmaFailure> {
    let left = job.req.len - at;
    let over_link = match &job.req.op {
        Op::Write { dst, .. } => dst.is_remote(),
        Op::Read { src, .. } => src.is_remote(),
    };
    // A burst to a link costs a system call or more: move more per turn.
    let quantum = if over_link { quantum.max(LINK_QUANTUM) } else { quantum };
    let n = quantum.min(left);
    match &job.req.op {
        Op::Write { src, src_off, dst, dst_off } => {
            if src.revoked.load(std::sync::atomic::Ordering::Acquire) {
                return Err(DmaFailure::Revoked);
            }
            if n == 0 {
                return Ok(Step::Moved(0));
            }
            let s_abs = src_off + at;
            dst.write_from_segment(dst_off + at, &src.window.data, s_abs, n).map_err(access_failure)?;
            // The engine has read the source: its read tripwires fire.
            src.window.commit(s_abs, n, Access::Read);
            Ok(Step::Moved(n))
        }
        Op::Read { src, src_off, dst, dst_off } => {
            if dst.revoked.load(std::sync::atomic::Ordering::Acquire) {
                return Err(DmaFailure::Revoked);
            }
            if n == 0 {
                return Ok(Step::Moved(0));
            }
            match src.is_remote() {
                false => {
                    src.read_into_aperture(src_off + at, dst, dst_off + at, n).map_err(access_failure)?;
                    Ok(Step::Moved(n))
                }
                true => {
                    // The engine is not busy while the other host answers: ask for more.
                    let n = left.min(u64::from(crate::link::MAX_READ));
                    let qq = q.clone();
                    let m = src.clone();
                    let m_off = src_off + at;
                    src.read_into_aperture_async(
                        m_off,
                        dst.clone(),
                        dst_off + at,
                        n,
                        Box::new(move |r: Result<u64, AccessError>| {
                            if let Ok(got) = r {
                                m.fire_outgoing(Access::Read, m_off, got);
                            }
                            *lock(&qq.parked) = Some(r.map_err(access_failure));
                            let engine = qq.engine.clone();
                            engine.schedule(qq);
                        }),
                    )
                    .map_err(access_failure)?;
                    Ok(Step::Parked)
                }
            }
        }
    }
}
