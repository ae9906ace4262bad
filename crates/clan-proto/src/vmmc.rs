//! VMMC: virtual memory-mapped communication (Dubnicki et al., "Design and Implementation
//! of Virtual Memory-Mapped Communication on Myrinet", §2; "VMMC on Windows NT", §3.1).
//!
//! Data moves directly from the sender's memory into a receive buffer that the receiver
//! *exported* and the sender *imported*; there is no receive operation. The three sets of
//! primitives of the papers:
//!
//! - **Setup**: [`Vmmc::export`] (with importer restrictions, [`ExportOptions::policy`]) and
//!   dropping the [`ExportedBuffer`] (unexport); [`Vmmc::import`] and dropping the
//!   [`ImportedBuffer`] (unimport). Send buffers ([`Vmmc::send_buffer`]) are local memory
//!   registered with the NIC, the analogue of VMMC's pinned pages, so that the DMA engine
//!   may read them while the caller goes on.
//! - **Data transfer**: deliberate update [`Vmmc::send_msg`] (synchronous: returns when the
//!   send buffer may be reused) and [`Vmmc::send_msg_async`] (returns at once; check
//!   [`SendHandle::is_complete`] before reusing the buffer). Messages up to
//!   [`VmmcConfig::inline_max`] bytes go inline by programmed I/O (the caller's CPU copies,
//!   as Myrinet's short sends copy into the send queue); longer ones by the NIC's DMA
//!   engine — chosen transparently. [`Vmmc::fetch`] / [`Vmmc::fetch_async`] read from an
//!   imported buffer into local memory.
//! - **Notifications**: a message sent with [`SendFlags::notify`] raises a notification at
//!   the receiver after its data has landed: either a user handler runs on the notification
//!   thread ([`Notify::Handler`]), or a thread waits for the buffer's next notification
//!   ([`Notify::Wait`], [`ExportedBuffer::wait_notification`]).
//!
//! Everything works the same whether the other side is in this process, another process of
//! the host, or another host (through a link).
//!
//! ## Threads
//!
//! [`Vmmc`] is `Clone`, `Send` and `Sync`: share it between threads. [`ExportedBuffer`],
//! [`SendBuffer`] and [`ImportedBuffer`] are `Send` and `Sync` (an imported buffer is also
//! `Clone`); [`TransferHandle`] (`SendHandle`, `FetchHandle`) is `Send` and `Sync`. Handlers run on one
//! notification thread, one at a time, in arrival order; they must be `Send + Sync`.
//!
//! ## The inline threshold
//!
//! [`DEFAULT_INLINE_MAX`] comes from `clan bench vmmc`, which measures the caller's cost of
//! an asynchronous send both ways at every size (its "PIO ovh" and "DMA ovh" columns): a DMA
//! request costs the caller a roughly constant 100–250 ns, a programmed-I/O copy grows with
//! the size. On the machine we measured (2 × AMD EPYC vCPU) the PIO copy costs 110 ns at
//! 4 KiB against 230 ns for a DMA request, and both about 175 ns at 8 KiB; at 16 KiB the
//! copy costs 360 ns and the request 130 ns. Up to 8 KiB a synchronous send is also much
//! cheaper inline (180 ns) than by DMA (600 ns: the wait for the engine), so messages up to
//! 8 KiB go inline.

use crate::lock;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use clan::{
    AccessError, Aperture, Descriptor, DmaError, DmaOptions, DmaTicket, Endpoint, EndpointConfig, EndpointError, Event,
    EventQueue, EventQueueConfig, EventQueueError, ExportConfig, ExportError, ImportError, ImportPolicy, Mapping, Nic,
};

/// Messages up to this many bytes are sent inline (programmed I/O) by default.
pub const DEFAULT_INLINE_MAX: u64 = 8192;

/// A bad request is an access error whichever way it would have gone.
fn dma_error(e: DmaError) -> VmmcError {
    match e {
        DmaError::Access(a) => VmmcError::Access(a),
        other => VmmcError::Dma(other),
    }
}

/// What went wrong.
///
/// ```
/// use std::time::Duration;
/// use clan_proto::vmmc::{ExportOptions, Vmmc, VmmcError};
///
/// let nic = clan::Nic::open_default()?;
/// let v = Vmmc::new(&nic)?;
/// let quiet = v.export(4096, ExportOptions::default())?; // no `Notify::Wait`
/// assert!(matches!(quiet.wait_notification(Some(Duration::from_millis(5))), Err(VmmcError::NotWaitable)));
/// let desc = quiet.descriptor();
/// v.unexport(quiet);
/// assert!(matches!(v.import(&desc), Err(VmmcError::Import(clan::ImportError::Revoked { .. }))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VmmcError {
    /// Exporting failed.
    #[error(transparent)]
    Export(#[from] ExportError),
    /// Importing failed.
    #[error(transparent)]
    Import(#[from] ImportError),
    /// A bad access (range, rights, a revoked buffer, a broken link).
    #[error(transparent)]
    Access(#[from] AccessError),
    /// A DMA transfer failed.
    #[error(transparent)]
    Dma(#[from] DmaError),
    /// The VMMC endpoint could not be made.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The notification queue could not be made.
    #[error(transparent)]
    EventQueue(#[from] EventQueueError),
    /// The buffer was exported without [`Notify::Wait`].
    #[error("this buffer was not exported with Notify::Wait: nothing to wait for")]
    NotWaitable,
    /// No notification came in time.
    #[error("no notification within the timeout")]
    Timeout,
    /// The notification thread could not be started.
    #[error("could not start the notification thread: {0}")]
    Thread(String),
}

impl From<VmmcError> for std::io::Error {
    fn from(e: VmmcError) -> std::io::Error {
        use std::io::ErrorKind as K;
        match e {
            VmmcError::Export(x) => x.into(),
            VmmcError::Import(x) => x.into(),
            VmmcError::Access(x) => x.into(),
            VmmcError::Dma(x) => x.into(),
            VmmcError::Endpoint(x) => x.into(),
            VmmcError::EventQueue(x) => x.into(),
            VmmcError::NotWaitable => std::io::Error::new(K::InvalidInput, e),
            VmmcError::Timeout => std::io::Error::new(K::TimedOut, e),
            VmmcError::Thread(_) => std::io::Error::other(e),
        }
    }
}

/// Settings of a [`Vmmc`].
///
/// ```
/// use clan_proto::vmmc::{SendFlags, Vmmc, VmmcConfig};
///
/// let nic = clan::Nic::open_default()?;
/// // Everything above 1 KiB by DMA.
/// let v = Vmmc::with_config(&nic, VmmcConfig { inline_max: 1024, ..VmmcConfig::default() })?;
/// let rx = v.export(64 << 10, Default::default())?;
/// let (dst, src) = (v.import(&rx.descriptor())?, v.send_buffer(64 << 10)?);
/// v.send_msg(&src, 0, &dst, 0, 1024, SendFlags::default())?;
/// v.send_msg(&src, 0, &dst, 0, 1025, SendFlags::default())?;
/// let s = v.stats();
/// assert_eq!((s.inline_sends, s.dma_sends), (1, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct VmmcConfig {
    /// Largest message sent inline by programmed I/O; longer ones go by DMA.
    pub inline_max: u64,
    /// How long waits (for a notification, a DMA) spin before they sleep.
    /// Default: [`clan::default_spin`] (`CLAN_SPIN_US`, else 15 µs); zero: sleep at once,
    /// nothing polls.
    pub spin: Duration,
    /// Requests the DMA queue holds.
    pub dma_queue: usize,
    /// Notifications a buffer keeps for its waiters before it counts them as lost.
    pub mailbox: usize,
}

impl Default for VmmcConfig {
    fn default() -> Self {
        VmmcConfig { inline_max: DEFAULT_INLINE_MAX, spin: clan::default_spin(), dma_queue: 256, mailbox: 1024 }
    }
}

/// A notification: a sender says a message landed in the buffer (more at
/// [`ExportedBuffer::wait_notification`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::vmmc::{ExportOptions, Notification, Notify, SendFlags, Vmmc};
/// # let nic = clan::Nic::open_default()?;
/// # let (sender, receiver) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let rx = receiver.export(4096, ExportOptions { notify: Notify::Wait, ..Default::default() })?;
/// let dst = sender.import(&rx.descriptor())?;
/// sender.send_bytes(b"msg", &dst, 100, SendFlags::notify())?;
/// match rx.wait_notification(Some(Duration::from_secs(5)))? {
///     Notification::Landed { offset, len } => assert_eq!((offset, len), (100, 3)),
///     Notification::Lost => { /* re-check the whole buffer */ }
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notification {
    /// `len` bytes at `offset` (checked to lie within the buffer).
    Landed {
        /// Offset in the buffer.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Notifications were lost (a queue overflowed): re-check the buffer's contents.
    Lost,
}

/// The user handler of [`Notify::Handler`] (example there).
pub type Handler = Arc<dyn Fn(Notification) + Send + Sync>;

/// What happens when a notification for an exported buffer arrives.
///
/// A handler runs on the notification thread once the message's bytes are in place:
///
/// ```
/// use std::sync::{Arc, mpsc};
/// use std::time::Duration;
/// use clan_proto::vmmc::{ExportOptions, Notification, Notify, SendFlags, Vmmc};
///
/// let nic = clan::Nic::open_default()?;
/// let (sender, receiver) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let (tx, rx) = mpsc::channel();
/// let handler = Arc::new(move |n: Notification| {
///     let _ = tx.send(n);
/// });
/// let buf = receiver.export(4096, ExportOptions { notify: Notify::Handler(handler), ..Default::default() })?;
/// let dst = sender.import(&buf.descriptor())?;
/// sender.send_bytes(b"quiet", &dst, 0, SendFlags::default())?; // no notification
/// sender.send_bytes(b"loud", &dst, 64, SendFlags::notify())?;
/// let n = rx.recv_timeout(Duration::from_secs(5))?;
/// assert_eq!(n, Notification::Landed { offset: 64, len: 4 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub enum Notify {
    /// Nothing: a notification for this buffer is dropped, and counted in
    /// [`VmmcStats::dropped`], when this `Vmmc` next takes its queue's events (its handler
    /// thread, or a waiter on another buffer, does). Until then it waits in the queue, whose
    /// ring is bounded: with nobody taking events at all, the oldest are lost, never memory.
    #[default]
    None,
    /// Run the handler on the notification thread.
    Handler(Handler),
    /// Keep it for [`ExportedBuffer::wait_notification`].
    Wait,
}

impl std::fmt::Debug for Notify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Notify::None => "None",
            Notify::Handler(_) => "Handler",
            Notify::Wait => "Wait",
        })
    }
}

/// How a buffer is exported.
///
/// ```
/// use clan::ImportPolicy;
/// use clan_proto::vmmc::{ExportOptions, Notify, Vmmc};
///
/// let nic = clan::Nic::open_default()?;
/// let (owner, friend, stranger) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let opts = ExportOptions {
///     policy: ImportPolicy::anyone().endpoint(friend.endpoint().addr()),
///     notify: Notify::Wait,
/// };
/// let buf = owner.export(4096, opts)?;
/// assert!(friend.import(&buf.descriptor()).is_ok());
/// assert!(stranger.import(&buf.descriptor()).is_err(), "VMMC enforces the restriction at import");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// Who may import it (VMMC enforces the restrictions when an import is attempted).
    pub policy: ImportPolicy,
    /// What notifications do.
    pub notify: Notify,
}

/// Flags of a send (examples at [`Notify`] and [`ExportedBuffer::wait_notification`]).
///
/// ```
/// use clan_proto::vmmc::SendFlags;
///
/// assert!(SendFlags::notify().notify);
/// assert!(!SendFlags::default().notify);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendFlags {
    /// Raise a notification at the receiver once the message has landed.
    pub notify: bool,
}

impl SendFlags {
    /// Attach a notification.
    pub fn notify() -> SendFlags {
        SendFlags { notify: true }
    }
}

/// Counters ([`Vmmc::stats`]; more at [`VmmcConfig`]).
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::vmmc::{ExportOptions, Notify, SendFlags, Vmmc};
/// # let nic = clan::Nic::open_default()?;
/// # let (sender, receiver) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let rx = receiver.export(64 << 10, ExportOptions { notify: Notify::Wait, ..Default::default() })?;
/// let (dst, src) = (sender.import(&rx.descriptor())?, sender.send_buffer(64 << 10)?);
/// sender.send_bytes(b"x", &dst, 0, SendFlags::notify())?; // inline
/// sender.send_msg(&src, 0, &dst, 0, 64 << 10, SendFlags::default())?; // above 8 KiB: DMA
/// rx.wait_notification(Some(Duration::from_secs(5)))?;
/// let (s, r) = (sender.stats(), receiver.stats());
/// assert_eq!((s.inline_sends, s.dma_sends, r.notifications, r.dropped), (1, 1, 1, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmmcStats {
    /// Messages sent inline (programmed I/O).
    pub inline_sends: u64,
    /// Messages sent by DMA.
    pub dma_sends: u64,
    /// Notifications delivered (handlers run or waits served).
    pub notifications: u64,
    /// Notifications dropped: no such buffer, out of its range, or a full mailbox.
    pub dropped: u64,
}

type Key = (u32, u32);

struct Buf {
    len: u64,
    notify: Notify,
}

#[derive(Default)]
struct Hub {
    /// A thread is taking events from the queue (a waiter, or the notification thread).
    leader: bool,
    thread: bool,
    mailboxes: HashMap<Key, VecDeque<Notification>>,
}

struct Inner {
    ep: Endpoint,
    queue: EventQueue,
    cfg: VmmcConfig,
    buffers: RwLock<HashMap<Key, Buf>>,
    hub: Mutex<Hub>,
    cv: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    inline_sends: AtomicU64,
    dma_sends: AtomicU64,
    notifications: AtomicU64,
    dropped: AtomicU64,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vmmc").field("endpoint", &self.ep.addr()).finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.queue.post_user(0);
        if let Some(t) = lock(&self.thread).take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A VMMC instance: an endpoint of a NIC with its own notification queue. Cheap to clone.
///
/// Two instances, here of one process (the same across processes or hosts): the receiver
/// exports a buffer, the sender imports it and writes into it; there is no receive call.
///
/// ```
/// use std::time::Duration;
/// use clan_proto::vmmc::{ExportOptions, Notification, Notify, SendFlags, Vmmc};
///
/// let nic = clan::Nic::open_default()?;
/// let (sender, receiver) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let rx = receiver.export(64 << 10, ExportOptions { notify: Notify::Wait, ..Default::default() })?;
/// let dst = sender.import(&rx.descriptor())?; // the descriptor travels in any message
/// let src = sender.send_buffer(64 << 10)?;
/// src.write(0, b"deliberate update")?;
/// sender.send_msg(&src, 0, &dst, 128, 17, SendFlags::notify())?; // `src` reusable now
/// let n = rx.wait_notification(Some(Duration::from_secs(5)))?;
/// assert_eq!(n, Notification::Landed { offset: 128, len: 17 });
/// let mut got = [0u8; 17];
/// rx.read(128, &mut got)?; // the bytes are in place when the notification comes
/// assert_eq!(&got, b"deliberate update");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Vmmc {
    inner: Arc<Inner>,
}

/// Local memory registered with the NIC, the source of sends and destination of fetches.
///
/// Implemented by [`SendBuffer`], [`ExportedBuffer`] and [`clan::Aperture`]:
///
/// ```
/// use clan_proto::vmmc::{LocalBuffer, SendFlags, Vmmc};
///
/// let nic = clan::Nic::open_default()?;
/// let v = Vmmc::new(&nic)?;
/// let rx = v.export(4096, Default::default())?;
/// let dst = v.import(&rx.descriptor())?;
/// let plain = v.endpoint().export(4096)?; // any aperture of the instance's endpoint
/// plain.write(0, b"from an aperture")?;
/// assert_eq!(plain.aperture().len(), 4096);
/// v.send_msg(&plain, 0, &dst, 0, 16, SendFlags::default())?;
/// let mut got = [0u8; 16];
/// rx.read(0, &mut got)?;
/// assert_eq!(&got, b"from an aperture");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait LocalBuffer {
    /// The aperture holding it.
    fn aperture(&self) -> &Aperture;
}

impl LocalBuffer for Aperture {
    fn aperture(&self) -> &Aperture {
        self
    }
}

/// A receive buffer this process exported. Dropping it unexports it. It dereferences to its
/// [`clan::Aperture`] (local reads and writes, tripwires). More at [`Vmmc`].
///
/// ```
/// # use std::time::Duration;
/// # use clan_proto::vmmc::{ExportOptions, Notification, Notify, SendFlags, Vmmc};
/// # let nic = clan::Nic::open_default()?;
/// # let (sender, receiver) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let rx = receiver.export(4096, ExportOptions::default())?;
/// let arrived = rx.tripwire(clan::TripwireConfig::writes(0..8))?; // through `Deref`
/// let dst = sender.import(&rx.descriptor())?;
/// sender.send_bytes(&7u64.to_le_bytes(), &dst, 0, SendFlags::default())?;
/// assert_eq!((rx.load_u64(0)?, arrived.count()), (7, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ExportedBuffer {
    ap: Aperture,
    vmmc: Arc<Inner>,
    key: Key,
}

impl LocalBuffer for ExportedBuffer {
    fn aperture(&self) -> &Aperture {
        &self.ap
    }
}

impl std::ops::Deref for ExportedBuffer {
    type Target = Aperture;
    fn deref(&self) -> &Aperture {
        &self.ap
    }
}

impl ExportedBuffer {
    /// The descriptor importers need (narrow it with [`Descriptor::derive`] if they need less).
    pub fn descriptor(&self) -> Descriptor {
        self.ap.descriptor()
    }

    /// The next notification of this buffer (exported with [`Notify::Wait`]): spins a
    /// little, then sleeps. `None` waits without limit.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan_proto::vmmc::{ExportOptions, Notification, Notify, SendFlags, Vmmc, VmmcError};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (a, b) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
    /// let rx = b.export(4096, ExportOptions { notify: Notify::Wait, ..Default::default() })?;
    /// let dst = a.import(&rx.descriptor())?;
    /// assert!(matches!(rx.wait_notification(Some(Duration::from_millis(5))), Err(VmmcError::Timeout)));
    /// a.send_bytes(b"one", &dst, 0, SendFlags::notify())?;
    /// a.send_bytes(b"two", &dst, 8, SendFlags::notify())?;
    /// let first = rx.wait_notification(Some(Duration::from_secs(5)))?;
    /// assert_eq!(first, Notification::Landed { offset: 0, len: 3 });
    /// let second = rx.wait_notification(Some(Duration::from_secs(5)))?;
    /// assert_eq!(second, Notification::Landed { offset: 8, len: 3 });
    /// assert_eq!(rx.try_notification()?, None, "never blocks");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_notification(&self, timeout: Option<Duration>) -> Result<Notification, VmmcError> {
        self.vmmc.wait_for(self.key, timeout)
    }

    /// A notification if one is there (never blocks).
    pub fn try_notification(&self) -> Result<Option<Notification>, VmmcError> {
        match self.vmmc.wait_for(self.key, Some(Duration::ZERO)) {
            Ok(n) => Ok(Some(n)),
            Err(VmmcError::Timeout) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for ExportedBuffer {
    fn drop(&mut self) {
        self.vmmc.buffers.write().unwrap_or_else(|e| e.into_inner()).remove(&self.key);
        lock(&self.vmmc.hub).mailboxes.remove(&self.key);
    }
}

/// Local memory to send from (and fetch into). Not visible to anyone else. It dereferences to
/// its [`clan::Aperture`].
///
/// ```
/// let nic = clan::Nic::open_default()?;
/// let v = clan_proto::vmmc::Vmmc::new(&nic)?;
/// let src = v.send_buffer(4096)?;
/// src.write(0, b"staged")?;
/// let mut back = [0u8; 6];
/// src.read(0, &mut back)?;
/// assert_eq!(&back, b"staged");
/// assert!(v.endpoint().import(&src.descriptor()).is_err(), "importable by no one");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct SendBuffer {
    ap: Aperture,
}

impl LocalBuffer for SendBuffer {
    fn aperture(&self) -> &Aperture {
        &self.ap
    }
}

impl std::ops::Deref for SendBuffer {
    type Target = Aperture;
    fn deref(&self) -> &Aperture {
        &self.ap
    }
}

/// An imported receive buffer: the destination of sends (the papers' destination proxy).
/// Dropping the last clone unimports it.
///
/// ```
/// let nic = clan::Nic::open_default()?;
/// let (a, b) = (clan_proto::vmmc::Vmmc::new(&nic)?, clan_proto::vmmc::Vmmc::new(&nic)?);
/// let rx = b.export(8192, Default::default())?;
/// let dst = a.import(&rx.descriptor())?;
/// assert_eq!(dst.len(), 8192);
/// dst.mapping().store_u64(0, 1)?; // programmed I/O through the mapping underneath
/// assert_eq!(rx.load_u64(0)?, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ImportedBuffer {
    m: Mapping,
}

impl ImportedBuffer {
    /// Its length.
    pub fn len(&self) -> u64 {
        self.m.len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// The mapping underneath (programmed I/O, tripwires on outgoing traffic, barriers).
    pub fn mapping(&self) -> &Mapping {
        &self.m
    }
}

/// A transfer in flight: an asynchronous send ([`SendHandle`]: when complete, the send
/// buffer may be reused) or fetch ([`FetchHandle`]: when complete, the data is in place).
///
/// ```
/// use std::time::Duration;
/// use clan_proto::vmmc::{SendFlags, Vmmc};
///
/// let nic = clan::Nic::open_default()?;
/// let (a, b) = (Vmmc::new(&nic)?, Vmmc::new(&nic)?);
/// let rx = b.export(1 << 20, Default::default())?;
/// let dst = a.import(&rx.descriptor())?;
/// let src = a.send_buffer(1 << 20)?;
/// src.fill(0, 1 << 20, 0xee)?;
/// let h = a.send_msg_async(&src, 0, &dst, 0, 1 << 20, SendFlags::default())?; // by DMA
/// // ... other work while the engine moves the megabyte ...
/// h.wait(Some(Duration::from_secs(5)))?;
/// assert!(h.is_complete());
/// src.fill(0, 1 << 20, 0)?; // reusing the buffer cannot change what was sent
/// assert_eq!(rx.load_u64((1 << 20) - 8)?, u64::from_ne_bytes([0xee; 8]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TransferHandle {
    ticket: Option<DmaTicket>,
}

/// An asynchronous send in flight.
pub type SendHandle = TransferHandle;
/// An asynchronous fetch in flight.
pub type FetchHandle = TransferHandle;

impl TransferHandle {
    /// Whether the transfer has completed (one memory load).
    pub fn is_complete(&self) -> bool {
        self.ticket.as_ref().is_none_or(DmaTicket::is_complete)
    }

    /// Wait for completion; errors if the transfer failed.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), VmmcError> {
        match &self.ticket {
            None => Ok(()),
            Some(t) => Ok(t.wait(timeout)?),
        }
    }

    /// [`TransferHandle::wait`], spinning for `spin` before sleeping.
    pub fn wait_spin(&self, spin: Duration, timeout: Option<Duration>) -> Result<(), VmmcError> {
        match &self.ticket {
            None => Ok(()),
            Some(t) => Ok(t.wait_spin(spin, timeout)?),
        }
    }
}

impl Vmmc {
    /// A VMMC instance on `nic`, with default settings.
    pub fn new(nic: &Nic) -> Result<Vmmc, VmmcError> {
        Vmmc::with_config(nic, VmmcConfig::default())
    }

    /// A VMMC instance on `nic`.
    pub fn with_config(nic: &Nic, cfg: VmmcConfig) -> Result<Vmmc, VmmcError> {
        let queue =
            nic.event_queue(EventQueueConfig { spin: cfg.spin, tripwires: 1024, ..EventQueueConfig::default() })?;
        let ep = nic.endpoint_with(EndpointConfig {
            queue: Some(queue.clone()),
            dma_queue: cfg.dma_queue,
            ..EndpointConfig::default()
        })?;
        Ok(Vmmc {
            inner: Arc::new(Inner {
                ep,
                queue,
                cfg,
                buffers: RwLock::new(HashMap::new()),
                hub: Mutex::new(Hub::default()),
                cv: Condvar::new(),
                stop: AtomicBool::new(false),
                thread: Mutex::new(None),
                inline_sends: AtomicU64::new(0),
                dma_sends: AtomicU64::new(0),
                notifications: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
            }),
        })
    }

    /// The endpoint underneath (its address identifies this instance to peers).
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.ep
    }

    /// Counters.
    pub fn stats(&self) -> VmmcStats {
        let i = &self.inner;
        VmmcStats {
            inline_sends: i.inline_sends.load(Ordering::Relaxed),
            dma_sends: i.dma_sends.load(Ordering::Relaxed),
            notifications: i.notifications.load(Ordering::Relaxed),
            dropped: i.dropped.load(Ordering::Relaxed),
        }
    }

    /// Export a receive buffer of `len` bytes.
    pub fn export(&self, len: u64, opts: ExportOptions) -> Result<ExportedBuffer, VmmcError> {
        let ap = self.inner.ep.export_with(len, ExportConfig { policy: opts.policy, ..ExportConfig::default() })?;
        let key = (ap.id(), ap.generation());
        if matches!(opts.notify, Notify::Handler(_)) {
            self.start_thread()?;
        }
        if matches!(opts.notify, Notify::Wait) {
            lock(&self.inner.hub).mailboxes.insert(key, VecDeque::new());
        }
        self.inner.buffers.write().unwrap_or_else(|e| e.into_inner()).insert(key, Buf { len, notify: opts.notify });
        Ok(ExportedBuffer { ap, vmmc: self.inner.clone(), key })
    }

    /// Unexport (dropping the buffer does the same): later imports and accesses fail.
    pub fn unexport(&self, buf: ExportedBuffer) {
        drop(buf);
    }

    /// Local memory to send from and fetch into.
    pub fn send_buffer(&self, len: u64) -> Result<SendBuffer, VmmcError> {
        // Exported with a policy nobody satisfies: registered with the NIC, importable by no one.
        let nobody = ImportPolicy { pids: vec![0], ..ImportPolicy::default() };
        Ok(SendBuffer {
            ap: self.inner.ep.export_with(len, ExportConfig { policy: nobody, ..ExportConfig::default() })?,
        })
    }

    /// Import a receive buffer (of this process, another process, or another host).
    pub fn import(&self, desc: &Descriptor) -> Result<ImportedBuffer, VmmcError> {
        Ok(ImportedBuffer { m: self.inner.ep.import(desc)? })
    }

    /// Unimport (dropping the last clone does the same).
    pub fn unimport(&self, buf: ImportedBuffer) {
        drop(buf);
    }

    fn inline(&self, n: u64) -> bool {
        n <= self.inner.cfg.inline_max
    }

    fn dma_options(flags: SendFlags) -> DmaOptions {
        if flags.notify { DmaOptions::new().notify() } else { DmaOptions::new() }
    }

    /// Deliberate update, synchronous: send `n` bytes of `src` at `src_off` to `dst` at
    /// `dst_off`; returns when `src` may be reused. Example at [`Vmmc`].
    pub fn send_msg(
        &self,
        src: &impl LocalBuffer,
        src_off: u64,
        dst: &ImportedBuffer,
        dst_off: u64,
        n: u64,
        flags: SendFlags,
    ) -> Result<(), VmmcError> {
        let h = self.send_msg_async(src, src_off, dst, dst_off, n, flags)?;
        h.wait_spin(self.spin_for(n), None)
    }

    /// How long a synchronous wait for `n` bytes spins before it sleeps: the configured
    /// spin, plus the time the copy itself should take (at 10 GB/s). Waking a thread that
    /// slept costs tens of microseconds on an idle CPU: not worth it for a copy that ends
    /// sooner.
    fn spin_for(&self, n: u64) -> Duration {
        self.inner.cfg.spin + Duration::from_nanos(n / 10)
    }

    /// Deliberate update, asynchronous: returns at once; [`SendHandle::is_complete`] says
    /// when `src` may be reused. Inline sends are complete when this returns. Example at
    /// [`TransferHandle`].
    pub fn send_msg_async(
        &self,
        src: &impl LocalBuffer,
        src_off: u64,
        dst: &ImportedBuffer,
        dst_off: u64,
        n: u64,
        flags: SendFlags,
    ) -> Result<SendHandle, VmmcError> {
        if self.inline(n) {
            dst.m.write_from(dst_off, src.aperture(), src_off, n)?;
            if flags.notify {
                dst.m.notify(dst_off, n)?;
            }
            self.inner.inline_sends.fetch_add(1, Ordering::Relaxed);
            return Ok(TransferHandle { ticket: None });
        }
        let t = self
            .inner
            .ep
            .dma_write(src.aperture(), src_off, &dst.m, dst_off, n, Self::dma_options(flags))
            .map_err(dma_error)?;
        self.inner.dma_sends.fetch_add(1, Ordering::Relaxed);
        Ok(TransferHandle { ticket: Some(t) })
    }

    /// Send bytes from ordinary memory (always inline, synchronous). Example at
    /// [`ExportedBuffer::wait_notification`].
    pub fn send_bytes(
        &self,
        data: &[u8],
        dst: &ImportedBuffer,
        dst_off: u64,
        flags: SendFlags,
    ) -> Result<(), VmmcError> {
        dst.m.write(dst_off, data)?;
        if flags.notify {
            dst.m.notify(dst_off, data.len() as u64)?;
        }
        self.inner.inline_sends.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Remote fetch, synchronous: read `n` bytes of `src` at `src_off` into `dst` at `dst_off`.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (a, b) = (clan_proto::vmmc::Vmmc::new(&nic)?, clan_proto::vmmc::Vmmc::new(&nic)?);
    /// let remote = b.export(64 << 10, Default::default())?;
    /// remote.fill(0, 64 << 10, 0x11)?;
    /// remote.write(8, b"small")?;
    /// let (src, local) = (a.import(&remote.descriptor())?, a.send_buffer(64 << 10)?);
    /// a.fetch(&src, 8, &local, 0, 5)?; // small: inline, by this thread
    /// let mut got = [0u8; 5];
    /// local.read(0, &mut got)?;
    /// assert_eq!(&got, b"small");
    /// let h = a.fetch_async(&src, 0, &local, 0, 64 << 10)?; // large: the DMA engine
    /// h.wait(Some(Duration::from_secs(5)))?;
    /// assert_eq!(local.load_u64(1024)?, u64::from_ne_bytes([0x11; 8]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fetch(
        &self,
        src: &ImportedBuffer,
        src_off: u64,
        dst: &impl LocalBuffer,
        dst_off: u64,
        n: u64,
    ) -> Result<(), VmmcError> {
        let h = self.fetch_async(src, src_off, dst, dst_off, n)?;
        h.wait_spin(self.spin_for(n), None)
    }

    /// Remote fetch, asynchronous (example at [`Vmmc::fetch`]).
    pub fn fetch_async(
        &self,
        src: &ImportedBuffer,
        src_off: u64,
        dst: &impl LocalBuffer,
        dst_off: u64,
        n: u64,
    ) -> Result<FetchHandle, VmmcError> {
        if self.inline(n) {
            src.m.read_to(src_off, dst.aperture(), dst_off, n)?;
            return Ok(TransferHandle { ticket: None });
        }
        let t = self
            .inner
            .ep
            .dma_read(&src.m, src_off, dst.aperture(), dst_off, n, DmaOptions::new())
            .map_err(dma_error)?;
        Ok(TransferHandle { ticket: Some(t) })
    }

    fn start_thread(&self) -> Result<(), VmmcError> {
        let mut t = lock(&self.inner.thread);
        if t.is_some() {
            return Ok(());
        }
        {
            let mut hub = lock(&self.inner.hub);
            // Wait for a waiter that is leading to hand over (it leaves within its slice).
            while hub.leader {
                hub = self.inner.cv.wait_timeout(hub, Duration::from_millis(10)).unwrap_or_else(|e| e.into_inner()).0;
            }
            hub.leader = true;
            hub.thread = true;
        }
        let weak = Arc::downgrade(&self.inner);
        let handle = std::thread::Builder::new()
            .name("vmmc-notify".into())
            .spawn(move || notification_thread(weak))
            .map_err(|e| VmmcError::Thread(e.to_string()))?;
        *t = Some(handle);
        Ok(())
    }
}

fn notification_thread(weak: std::sync::Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let queue = inner.queue.clone();
        let spin = inner.cfg.spin;
        drop(inner);
        // Not holding the instance while asleep: dropping the last handle stops us.
        let first = queue.wait_spin(spin, Some(Duration::from_millis(100)));
        let Some(inner) = weak.upgrade() else { return };
        if let Ok(ev) = first {
            inner.dispatch(ev);
            while let Some(ev) = queue.try_take() {
                inner.dispatch(ev);
            }
        }
    }
}

impl Inner {
    /// Route one event: handlers run here (never under a lock), waits get their mailbox.
    fn dispatch(&self, ev: Event) {
        match ev {
            Event::Notification { aperture, generation, offset, len } => {
                let key = (aperture, generation);
                let target = {
                    let b = self.buffers.read().unwrap_or_else(|e| e.into_inner());
                    match b.get(&key) {
                        // The claim comes from the sender: it must lie within the buffer.
                        Some(buf) if offset.checked_add(len).is_some_and(|end| end <= buf.len) => {
                            Some(buf.notify.clone())
                        }
                        _ => None,
                    }
                };
                let n = Notification::Landed { offset, len };
                match target {
                    Some(Notify::Handler(h)) => {
                        h(n);
                        self.notifications.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Notify::Wait) => self.deliver(key, n),
                    _ => {
                        self.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Event::Overflow { .. } => {
                // Lost events may have been notifications of any buffer: tell them all.
                let targets: Vec<(Key, Notify)> = self
                    .buffers
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(k, b)| (*k, b.notify.clone()))
                    .collect();
                for (k, t) in targets {
                    match t {
                        Notify::Handler(h) => h(Notification::Lost),
                        Notify::Wait => self.deliver(k, Notification::Lost),
                        Notify::None => {}
                    }
                }
            }
            _ => {}
        }
    }

    fn deliver(&self, key: Key, n: Notification) {
        let mut hub = lock(&self.hub);
        let cap = self.cfg.mailbox.max(1);
        match hub.mailboxes.get_mut(&key) {
            Some(mb) if mb.len() < cap => {
                mb.push_back(n);
                self.notifications.fetch_add(1, Ordering::Relaxed);
            }
            Some(mb) => {
                // Full: the oldest entries give way to one `Lost`.
                if mb.back() != Some(&Notification::Lost) {
                    mb.pop_front();
                    mb.push_back(Notification::Lost);
                }
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(hub);
        self.cv.notify_all();
    }

    /// A waiter: take from the mailbox; if nobody is taking events from the queue, do it.
    /// `timeout` zero: look without blocking.
    fn wait_for(&self, key: Key, timeout: Option<Duration>) -> Result<Notification, VmmcError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut hub = lock(&self.hub);
        let mut looked = false;
        loop {
            match hub.mailboxes.get_mut(&key) {
                None => return Err(VmmcError::NotWaitable),
                Some(mb) => {
                    if let Some(n) = mb.pop_front() {
                        return Ok(n);
                    }
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) && (looked || hub.leader) {
                return Err(VmmcError::Timeout);
            }
            // At most this long before looking at the clock (and the leadership) again.
            let slice = left.unwrap_or(Duration::MAX).min(Duration::from_millis(50));
            if !hub.leader {
                // Lead: wait on the queue ourselves (the shortest path from the sender's
                // post to this thread), route what comes, hand over.
                hub.leader = true;
                drop(hub);
                let first = if slice.is_zero() {
                    self.queue.try_take()
                } else {
                    self.queue.wait_spin(self.cfg.spin, Some(slice)).ok()
                };
                if let Some(ev) = first {
                    self.dispatch(ev);
                    while let Some(ev) = self.queue.try_take() {
                        self.dispatch(ev);
                    }
                }
                hub = lock(&self.hub);
                hub.leader = false;
                looked = true;
                // Another waiter may take over.
                self.cv.notify_all();
                continue;
            }
            hub = self.cv.wait_timeout(hub, slice).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}
