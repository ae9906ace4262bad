//! Endpoints: (NIC address, port). Each owns an out-of-band message queue, its apertures and
//! tripwires, and reports to an event queue.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::addr::{EndpointAddr, PeerIdentity};
use crate::aperture::{Aperture, ApertureInner};
use crate::config::ExportConfig;
use crate::descriptor::Descriptor;
use crate::dma::{DEFAULT_DMA_QUEUE, DmaOptions, DmaQueue, DmaRequest, DmaStats, DmaTicket};
use crate::error::{DmaError, ExportError, ImportError, OobError, TripwireError};
use crate::event_queue::{EventQueue, Word};
use crate::lock;
use crate::mapping::{Keep, Mapping};
use crate::nic::NicInner;
use crate::tripset::Tripset;
use clan_wire::control::{Code, OOB_PAYLOAD};

/// Capacity of an endpoint's out-of-band queue.
pub const OOB_QUEUE: usize = 256;

/// An out-of-band message: a fixed 40-byte payload and its sender.
///
/// ```
/// use clan::{OobError, OOB_PAYLOAD};
///
/// let nic = clan::Nic::open_default()?;
/// let (a, b) = (nic.endpoint()?, nic.endpoint()?);
/// a.send_oob(b.addr(), b"hello")?;
/// let msg = b.recv_oob().expect("queued at once within the NIC");
/// assert_eq!(msg.from, a.addr());
/// assert_eq!(&msg.payload[..5], b"hello");
/// assert!(msg.payload[5..].iter().all(|&x| x == 0), "zero-padded to {OOB_PAYLOAD} bytes");
/// assert!(matches!(a.send_oob(b.addr(), &[0; 41]), Err(OobError::TooLong(41))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OobMessage {
    /// Sending endpoint.
    pub from: EndpointAddr,
    /// Payload (zero-padded).
    pub payload: [u8; OOB_PAYLOAD],
}

/// How an endpoint is created ([`crate::Nic::endpoint_with`]).
///
/// ```
/// use clan::{EndpointConfig, Nic};
///
/// let nic = Nic::open_default()?;
/// let q = nic.event_queue(clan::EventQueueConfig::default())?;
/// let cfg = EndpointConfig { port: Some(80), queue: Some(q.clone()), dma_queue: 16 };
/// let ep = nic.endpoint_with(cfg)?;
/// assert_eq!(ep.port(), 80);
/// assert_eq!(ep.event_queue().id(), q.id());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct EndpointConfig {
    /// Endpoint port; None picks a free one.
    pub port: Option<u32>,
    /// Event queue; None uses the NIC's default queue.
    pub queue: Option<EventQueue>,
    /// Requests the endpoint's DMA queue holds (0: [`crate::DEFAULT_DMA_QUEUE`]).
    pub dma_queue: usize,
}

#[derive(Debug)]
pub(crate) struct EndpointInner {
    pub nic: Arc<NicInner>,
    pub addr: EndpointAddr,
    pub queue: EventQueue,
    oob: Mutex<VecDeque<OobMessage>>,
    oob_cv: Condvar,
    pub(crate) closed: AtomicBool,
    apertures: Mutex<Vec<Weak<ApertureInner>>>,
    pub conns: crate::conn::EndpointConns,
    dma: OnceLock<Arc<DmaQueue>>,
    dma_capacity: usize,
}

impl EndpointInner {
    pub fn new(nic: Arc<NicInner>, addr: EndpointAddr, queue: EventQueue, dma_capacity: usize) -> EndpointInner {
        EndpointInner {
            nic,
            addr,
            queue,
            oob: Mutex::new(VecDeque::new()),
            oob_cv: Condvar::new(),
            closed: AtomicBool::new(false),
            apertures: Mutex::new(Vec::new()),
            conns: Default::default(),
            dma: OnceLock::new(),
            dma_capacity: if dma_capacity == 0 { DEFAULT_DMA_QUEUE } else { dma_capacity },
        }
    }

    /// The DMA queue, made (and the NIC's DMA engine started) on first use.
    fn dma_queue(&self) -> Result<&Arc<DmaQueue>, DmaError> {
        if let Some(q) = self.dma.get() {
            return Ok(q);
        }
        let engine = self.nic.dma_engine().map_err(|e| DmaError::Engine(e.to_string()))?;
        let q = Arc::new(DmaQueue::new(engine, self.addr.port, self.queue.clone(), self.dma_capacity));
        let _ = self.dma.set(q);
        if self.closed.load(Ordering::Acquire) {
            if let Some(q) = self.dma.get() {
                q.close();
            }
            return Err(DmaError::EndpointClosed);
        }
        self.dma.get().ok_or(DmaError::EndpointClosed)
    }

    /// Queue an out-of-band message and post its event. `msg.from` must be what the
    /// transport verified (the engine's host sessions, the link's authenticated peer, or an
    /// endpoint of this NIC).
    pub fn deliver_oob(&self, msg: OobMessage, who: PeerIdentity) -> Result<(), Code> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Code::NoSuchEndpoint);
        }
        if crate::conn::is_handshake(&msg.payload) {
            crate::conn::on_message(self, msg, who);
            self.queue.inner.post_local(Word::Oob { endpoint: self.addr.port });
            return Ok(());
        }
        {
            let mut q = lock(&self.oob);
            if q.len() >= OOB_QUEUE {
                return Err(Code::QueueFull);
            }
            q.push_back(msg);
        }
        self.oob_cv.notify_all();
        if self.nic.manual_progress() {
            self.nic.links.kick_parked();
        }
        self.queue.inner.post_local(Word::Oob { endpoint: self.addr.port });
        Ok(())
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(endpoint = %self.addr, "endpoint closed");
        // DMA first: what has not run is cancelled, not failed by the unexports below.
        if let Some(q) = self.dma.get() {
            q.close();
        }
        let aps = std::mem::take(&mut *lock(&self.apertures));
        for a in aps.iter().filter_map(Weak::upgrade) {
            a.unexport();
        }
        self.nic.endpoint_closed(self.addr.port);
        // (the lock: a waiter that looked at `closed` before the store is asleep when told)
        drop(lock(&self.oob));
        self.oob_cv.notify_all();
        if self.nic.manual_progress() {
            self.nic.links.kick_parked();
        }
        // (a thread waiting in `accept` or `connect` on this endpoint sleeps until told:
        // wake it to find the endpoint closed)
        drop(lock(&self.conns.state));
        self.conns.notify(&self.nic);
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        self.close();
    }
}

/// An endpoint. Dropping it (or [`Endpoint::close`]) unexports its apertures and frees its
/// port. `Send` and `Sync`: share it across threads with `Arc`.
///
/// ```
/// use clan::{ExportError, ImportError};
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = server.export(4096)?;
/// let m = client.import(&ap.descriptor())?;
/// m.write(0, b"ok")?;
/// server.close(); // unexports `ap` too
/// assert!(server.is_closed());
/// assert!(matches!(server.export(4096), Err(ExportError::EndpointClosed)));
/// assert!(m.write(0, b"late").is_err());
/// assert!(matches!(client.import(&ap.descriptor()), Err(ImportError::Revoked { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Endpoint {
    pub(crate) inner: Arc<EndpointInner>,
}

impl Endpoint {
    /// Its address.
    pub fn addr(&self) -> EndpointAddr {
        self.inner.addr
    }

    /// Its port.
    pub fn port(&self) -> u32 {
        self.inner.addr.port
    }

    /// The event queue it reports to.
    pub fn event_queue(&self) -> &EventQueue {
        &self.inner.queue
    }

    /// Export `len` bytes (rounded up to whole pages in memory; accesses are bounded by
    /// `len`), zero-filled, importable by anyone holding its descriptor.
    ///
    /// ```
    /// use clan::ExportError;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let ap = ep.export(100)?;
    /// assert_eq!(ap.len(), 100);
    /// assert_eq!(ap.load_u64(0)?, 0, "zero-filled");
    /// assert!(ap.write(96, &[0; 8]).is_err(), "bounded by its length, not the page");
    /// assert!(matches!(ep.export(0), Err(ExportError::Empty)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn export(&self, len: u64) -> Result<Aperture, ExportError> {
        self.export_with(len, ExportConfig::default())
    }

    /// Export with import restrictions.
    pub fn export_with(&self, len: u64, cfg: ExportConfig) -> Result<Aperture, ExportError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(ExportError::EndpointClosed);
        }
        let pooled = cfg.pooled_for;
        let ap = self.inner.nic.export(&self.inner, len, cfg)?;
        tracing::debug!(endpoint = %self.inner.addr, aperture = ap.id(), len, pooled_for = ?pooled, "exported");
        let mut aps = lock(&self.inner.apertures);
        aps.retain(|w| w.strong_count() > 0);
        aps.push(Arc::downgrade(&ap.inner));
        Ok(ap)
    }

    /// Whether the endpoint was closed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Import a descriptor: from this process, from another process of this host (the
    /// memory is mapped here), or from another host (over a link). Waits at most
    /// [`crate::NicConfig::request_timeout`] for the exporter.
    ///
    /// ```
    /// // Another NIC of this process stands for another process of the host.
    /// let (exporter_nic, importer_nic) = (clan::Nic::open_default()?, clan::Nic::open_default()?);
    /// let (server, client) = (exporter_nic.endpoint()?, importer_nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let desc: clan::Descriptor = ap.descriptor().to_string().parse()?; // as if sent as text
    /// let m = client.import(&desc)?;
    /// m.store_u64(0, 5)?; // a store into the exporter's memory, no copy in between
    /// assert_eq!(ap.load_u64(0)?, 5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn import(&self, desc: &Descriptor) -> Result<Mapping, ImportError> {
        self.import_timeout(desc, self.inner.nic.config.request_timeout)
    }

    /// [`Endpoint::import`], waiting at most `timeout` for the exporter (and for a link to
    /// be set up).
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::ImportError;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let gone = {
    ///     let other = clan::Nic::open_default()?; // closes at the end of this block
    ///     let other_ep = other.endpoint()?;
    ///     other_ep.export(4096)?.descriptor()
    /// };
    /// let r = ep.import_timeout(&gone, Duration::from_secs(1));
    /// assert!(matches!(r, Err(ImportError::Unreachable(nic)) if nic == gone.nic()), "{r:?}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn import_timeout(&self, desc: &Descriptor, timeout: Duration) -> Result<Mapping, ImportError> {
        import_timeout(&self.inner, desc, timeout)
    }

    /// Start importing `desc` without ever waiting: the request goes out now if a control
    /// connection to the exporter's NIC is up and has room; [`PendingImport::finish`] collects
    /// the answer (or, if nothing could be sent yet, makes the whole import). Meant for an
    /// import that may be needed soon, started where nothing may wait (a server accepting a
    /// connection), so that its round trip overlaps other work.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let (nic, other) = (clan::Nic::open_default()?, clan::Nic::open_default()?);
    /// let (server, client) = (other.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let pending = client.import_begin(&ap.descriptor()); // never waits
    /// // ... other work while the request travels ...
    /// let m = pending.finish(Duration::from_secs(5))?;
    /// m.write(0, b"late but ready")?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn import_begin(&self, desc: &Descriptor) -> PendingImport {
        let started = if desc.nic() != self.inner.nic.addr && !self.is_closed() {
            crate::peer::try_begin_import(&self.inner, desc)
        } else {
            None
        };
        PendingImport { ep: self.inner.clone(), desc: desc.clone(), started }
    }
}

/// An import started without waiting ([`Endpoint::import_begin`]).
///
/// ```
/// use std::time::Duration;
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = server.export(4096)?;
/// let pending = client.import_begin(&ap.descriptor());
/// assert!(!pending.is_started(), "an aperture of our own NIC needs no request");
/// let m = pending.finish(Duration::from_secs(1))?;
/// assert_eq!(m.len(), 4096);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PendingImport {
    ep: Arc<EndpointInner>,
    desc: Descriptor,
    started: Option<crate::peer::PendingImport>,
}

impl std::fmt::Debug for PendingImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingImport")
            .field("exporter", &format_args!("{}", self.desc.nic()))
            .field("started", &self.started.is_some())
            .finish()
    }
}

impl PendingImport {
    /// An import of `desc` for `ep` whose request went out already (`p`).
    pub(crate) fn begun(ep: &Arc<EndpointInner>, desc: &Descriptor, p: crate::peer::PendingImport) -> PendingImport {
        PendingImport { ep: ep.clone(), desc: desc.clone(), started: Some(p) }
    }

    /// Whether the request went out already.
    pub fn is_started(&self) -> bool {
        self.started.is_some()
    }

    /// The mapping: waits at most `timeout` for the answer (or for the whole import, if it
    /// could not be started without waiting).
    pub fn finish(self, timeout: Duration) -> Result<Mapping, ImportError> {
        match self.started {
            Some(p) => {
                let r = crate::peer::finish_import(&self.ep, &self.desc, p, Instant::now() + timeout, timeout);
                if let Err(e) = &r {
                    tracing::debug!(importer = %self.ep.addr, exporter = %self.desc.nic(), "import failed: {e}");
                }
                r
            }
            None => import_timeout(&self.ep, &self.desc, timeout),
        }
    }
}

fn import_timeout(inner: &Arc<EndpointInner>, desc: &Descriptor, timeout: Duration) -> Result<Mapping, ImportError> {
    if inner.closed.load(Ordering::Acquire) {
        return Err(ImportError::EndpointClosed);
    }
    let _span =
        tracing::debug_span!("import", importer = %inner.addr, exporter = %desc.nic(), aperture = desc.aperture())
            .entered();
    let nic = &inner.nic;
    if desc.nic() == nic.addr {
        return import_local(inner, desc);
    }
    let deadline = Instant::now() + timeout;
    let r = (|| {
        // A grant of part of an aperture is never served by handing over memory (the
        // aperture's memfd would reach beyond it): it goes through a link, mediated by the
        // exporter's NIC, on this host as across hosts.
        // So is a read-only grant of an aperture carved from a pool (`pool.rs`): the exporter
        // says so (`NeedsLink`).
        let mut mediated = desc.is_narrowed();
        if nic.config.local_transport == crate::config::LocalTransport::SharedMemory && !mediated {
            match crate::peer::import_remote(inner, desc, deadline, timeout) {
                Err(ImportError::Unreachable(_)) => {} // not on this host: use a link
                Err(ImportError::NeedsLink { .. }) => mediated = true,
                r => return r,
            }
        }
        if mediated && !nic.config.tcp {
            return Err(ImportError::NeedsLink { peer: desc.nic() });
        }
        crate::remote::import_over_link(inner, desc, deadline, timeout)
    })();
    if let Err(e) = &r {
        tracing::debug!(importer = %inner.addr, exporter = %desc.nic(), aperture = desc.aperture(), "import failed: {e}");
    }
    r
}

fn import_local(inner: &Arc<EndpointInner>, desc: &Descriptor) -> Result<Mapping, ImportError> {
    {
        let nic = &inner.nic;
        let me = crate::nic::own_cred();
        let who = clan_wire::grant::Importer::Process {
            uid: me.uid,
            pid: me.pid,
            endpoint: inner.addr.into(),
            verified_nic: Some(nic.addr.socket_addr()),
        };
        let ap = nic.check_import(desc, &who).map_err(|r| ImportError::refused(r, desc))?;
        let w = &ap.window;
        let window = crate::window::Window {
            data: clan_shm::segment::Segment::whole(&ap.mem().seg),
            data_base: 0,
            cam: w.cam.clone(),
            tag: w.tag,
            live: w.live,
            port: w.port.clone(),
            claim: None,
            peer_alive: None,
        };
        Ok(Mapping::new(inner, desc, crate::transport::Via::Mapped(window), Keep::Local(ap)))
    }
}

impl Endpoint {
    /// A tripset for tripwires of this endpoint (example at [`Tripset`]).
    pub fn tripset(&self) -> Result<Tripset, TripwireError> {
        Tripset::new(self.inner.queue.inner.clone(), self.inner.addr.port)
    }

    /// Send an out-of-band message (at most 40 bytes, zero-padded) to `to`. Returns once it is
    /// queued at the destination (or with the reason it could not be), waiting at most
    /// [`crate::NicConfig::request_timeout`].
    pub fn send_oob(&self, to: EndpointAddr, payload: &[u8]) -> Result<(), OobError> {
        self.send_oob_until(to, payload, Instant::now() + self.inner.nic.config.request_timeout)
    }

    /// [`Endpoint::send_oob`], giving up at `deadline` ([`OobError::Timeout`]).
    pub(crate) fn send_oob_until(&self, to: EndpointAddr, payload: &[u8], deadline: Instant) -> Result<(), OobError> {
        if payload.len() > OOB_PAYLOAD {
            return Err(OobError::TooLong(payload.len()));
        }
        let mut p = [0u8; OOB_PAYLOAD];
        p[..payload.len()].copy_from_slice(payload);
        self.send_oobs_until(to, &[p], deadline)
    }

    /// Several out-of-band messages to `to`, in order, sent at once (one round trip for all:
    /// a hand-shake's fragments); the first refusal is the result.
    pub(crate) fn send_oobs_until(
        &self,
        to: EndpointAddr,
        payloads: &[[u8; OOB_PAYLOAD]],
        deadline: Instant,
    ) -> Result<(), OobError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(OobError::Closed);
        }
        let nic = &self.inner.nic;
        let code = if to.nic == nic.addr {
            match payloads
                .iter()
                .map(|p| nic.deliver_oob(self.inner.addr, nic.own_identity(), to.port, *p))
                .find(Result::is_err)
            {
                None | Some(Ok(())) => return Ok(()),
                Some(Err(c)) => c,
            }
        } else {
            match nic.send_oob_host(self.inner.addr, to, payloads, deadline) {
                Some(Ok(())) => return Ok(()),
                Some(Err(HostOob::Code(c))) => c,
                Some(Err(HostOob::Failed(e))) => return Err(e),
                None => return crate::remote::oob_over_link(nic, self.inner.addr, to, payloads, deadline),
            }
        };
        Err(match code {
            Code::NoSuchEndpoint => OobError::NoSuchEndpoint(to),
            Code::QueueFull => OobError::QueueFull(to),
            other => OobError::Protocol { peer: to.nic, detail: format!("{other:?}") },
        })
    }

    /// Take one out-of-band message, if any (no system call).
    pub fn recv_oob(&self) -> Option<OobMessage> {
        lock(&self.inner.oob).pop_front()
    }

    /// Wait for an out-of-band message.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::OobError;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (a, b) = (nic.endpoint()?, nic.endpoint()?);
    /// let b_addr = b.addr();
    /// let t = std::thread::spawn(move || a.send_oob(b_addr, b"wake up"));
    /// let msg = b.wait_oob(Some(Duration::from_secs(5)))?;
    /// assert_eq!(&msg.payload[..7], b"wake up");
    /// t.join().unwrap()?;
    /// assert!(matches!(b.wait_oob(Some(Duration::from_millis(5))), Err(OobError::Timeout)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_oob(&self, timeout: Option<Duration>) -> Result<OobMessage, OobError> {
        let i = &self.inner;
        let nic = &i.nic;
        // With manual progress this thread reads the links (a message from another host
        // comes over one), and sleeps on them and on its eventfd, which a message delivered
        // by the engine signals (`deliver_oob`), as does a link opening. Registered before
        // the first look.
        let parked = nic.manual_progress().then(|| nic.links.park()).flatten();
        let step = || nic.progress();
        let park = |nap: Option<Duration>| match &parked {
            Some(p) => p.sleep(nic, nap),
            None => std::thread::sleep(nap.map_or(NAP, |n| n.min(NAP))),
        };
        const NAP: Duration = Duration::from_micros(100);
        let drive = if nic.manual_progress() {
            crate::progress::Drive::Itself { step: &step, park: Some(&park) }
        } else {
            crate::progress::Drive::Others
        };
        crate::progress::wait_locked(&i.oob, &i.oob_cv, crate::progress::Deadline::after(timeout), None, drive, |q| {
            match q.pop_front() {
                Some(m) => Some(Ok(m)),
                None => i.closed.load(Ordering::Acquire).then_some(Err(OobError::Closed)),
            }
        })
        .unwrap_or(Err(OobError::Timeout))
    }

    /// Queue a DMA write of `len` bytes of `src` (an aperture of this process) at `src_off`
    /// to `dst` at `dst_off`; returns at once. The range, rights and liveness are checked
    /// now; the engine moves the data (see [`crate::DmaTicket`] for completion, and an
    /// example).
    pub fn dma_write(
        &self,
        src: &Aperture,
        src_off: u64,
        dst: &Mapping,
        dst_off: u64,
        len: u64,
        opts: DmaOptions,
    ) -> Result<DmaTicket, DmaError> {
        self.check_open()?;
        let req = DmaRequest::write(src, src_off, dst, dst_off, len)?;
        self.inner.dma_queue()?.post(vec![req], opts)
    }

    /// Queue a DMA read (a remote fetch) of `len` bytes of `src` at `src_off` into `dst` (an
    /// aperture of this process) at `dst_off`; returns at once. `dst`'s write tripwires fire
    /// as the data lands.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::{DmaOptions, TripwireConfig};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (me, them) = (nic.endpoint()?, nic.endpoint()?);
    /// let remote = them.export(4096)?;
    /// remote.write(0, b"fetched by the engine")?;
    /// let local = me.export(4096)?;
    /// let landed = local.tripwire(TripwireConfig::writes(0..8))?;
    /// let src = me.import(&remote.descriptor())?;
    /// me.dma_read(&src, 0, &local, 0, 21, DmaOptions::new())?.wait(Some(Duration::from_secs(5)))?;
    /// let mut got = [0u8; 21];
    /// local.read(0, &mut got)?;
    /// assert_eq!(&got, b"fetched by the engine");
    /// assert_eq!(landed.count(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dma_read(
        &self,
        src: &Mapping,
        src_off: u64,
        dst: &Aperture,
        dst_off: u64,
        len: u64,
        opts: DmaOptions,
    ) -> Result<DmaTicket, DmaError> {
        self.check_open()?;
        let req = DmaRequest::read(src, src_off, dst, dst_off, len)?;
        self.inner.dma_queue()?.post(vec![req], opts)
    }

    /// Queue a chain: requests run in order, back to back, and complete together (one
    /// ticket, one event with `opts`); if one fails, the rest are not run and the chain
    /// reports the first failure. Posting a chain rings the doorbell at most once. Example at
    /// [`crate::DmaRequest`].
    pub fn dma_chain(&self, reqs: Vec<DmaRequest>, opts: DmaOptions) -> Result<DmaTicket, DmaError> {
        self.check_open()?;
        self.inner.dma_queue()?.post(reqs, opts)
    }

    /// A closed endpoint refuses DMA before anything else is looked at (its apertures were
    /// unexported by the close: `EndpointClosed` says why, `Revoked` would not).
    fn check_open(&self) -> Result<(), DmaError> {
        if self.inner.closed.load(Ordering::Acquire) { Err(DmaError::EndpointClosed) } else { Ok(()) }
    }

    /// Counters of the endpoint's DMA queue.
    pub fn dma_stats(&self) -> DmaStats {
        self.inner.dma.get().map(|q| q.stats()).unwrap_or_default()
    }

    /// Close the endpoint now (dropping its last handle does the same): its DMA requests
    /// that have not run are cancelled ([`crate::DmaFailure::Cancelled`]), its apertures
    /// are unexported and its port is freed. The handle stays, for threads still holding it
    /// (share an endpoint with `Arc`): from now on exporting, importing and posting DMA
    /// through it are refused with `EndpointClosed`. Closing twice does nothing.
    pub fn close(&self) {
        self.inner.close();
    }
}

/// Why a host-local out-of-band send failed.
pub(crate) enum HostOob {
    /// The destination NIC answered with this code.
    Code(Code),
    /// It could not be reached or answered nonsense.
    Failed(OobError),
}

pub(crate) fn oob_peer_error(to: EndpointAddr, e: crate::peer::PeerError) -> OobError {
    match e {
        crate::peer::PeerError::Unreachable => OobError::Unreachable(to.nic),
        crate::peer::PeerError::Timeout => OobError::Timeout,
        crate::peer::PeerError::Protocol(d) | crate::peer::PeerError::Closed(d) => {
            OobError::Protocol { peer: to.nic, detail: d }
        }
        crate::peer::PeerError::Io(e) => OobError::Protocol { peer: to.nic, detail: e.to_string() },
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &format_args!("{}", self.inner.addr))
            .field("queue", &self.inner.queue.inner.id)
            .field("closed", &self.is_closed())
            .finish()
    }
}
