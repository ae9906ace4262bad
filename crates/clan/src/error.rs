//! Errors: one enum per family of operations. Every message says what was wrong and, where
//! there is one, what the caller can do about it.

use std::io;
use std::time::Duration;

use crate::addr::{EndpointAddr, NicAddr};

/// Opening a NIC.
///
/// ```
/// use clan::{Nic, NicConfig, NicError};
///
/// let first = Nic::open_default()?;
/// let same = NicConfig::at(first.addr().ip(), first.addr().port());
/// match Nic::open(same) {
///     Err(NicError::AddrInUse(a)) => assert_eq!(a, first.addr()),
///     other => panic!("expected AddrInUse, got {other:?}"),
/// }
/// // Every clan error converts into an `io::Error` of the kind `std::net` would use.
/// let e: std::io::Error = Nic::open(NicConfig::at(first.addr().ip(), first.addr().port())).unwrap_err().into();
/// assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    /// Another NIC on this host already uses the address.
    #[error("NIC address {0} is already in use on this host; choose another port or let clan pick one (port 0)")]
    AddrInUse(NicAddr),
    /// No free port was found for an automatically numbered NIC.
    #[error("no free NIC port found on this host")]
    NoFreePort,
    /// The configuration is inconsistent.
    #[error("invalid NIC configuration: {0}")]
    Config(String),
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What clan was doing.
        context: &'static str,
        /// The system error.
        #[source]
        source: io::Error,
    },
}

/// Creating, finding or closing endpoints.
///
/// ```
/// use clan::{EndpointConfig, EndpointError, Nic};
///
/// let (nic, other) = (Nic::open_default()?, Nic::open_default()?);
/// let zero = nic.endpoint_with(EndpointConfig { port: Some(0), ..EndpointConfig::default() });
/// assert!(matches!(zero, Err(EndpointError::ReservedPort)));
/// let foreign = EndpointConfig { queue: Some(other.default_queue().clone()), ..EndpointConfig::default() };
/// assert!(matches!(nic.endpoint_with(foreign), Err(EndpointError::ForeignQueue)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// The requested endpoint port is taken.
    #[error("endpoint port {0} is already in use on this NIC")]
    PortInUse(u32),
    /// Port 0 is reserved for "pick one".
    #[error("endpoint port 0 is reserved: pass None to have a port assigned")]
    ReservedPort,
    /// The endpoint was closed.
    #[error("the endpoint is closed")]
    Closed,
    /// The event queue belongs to another NIC.
    #[error("the event queue belongs to another NIC")]
    ForeignQueue,
}

/// Exporting apertures.
///
/// ```
/// use clan::{ExportError, MAX_APERTURE};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// assert!(matches!(ep.export(0), Err(ExportError::Empty)));
/// match ep.export(MAX_APERTURE + 1) {
///     Err(ExportError::TooLarge { len, max }) => assert_eq!((len, max), (MAX_APERTURE + 1, MAX_APERTURE)),
///     other => panic!("expected TooLarge, got {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// Zero-length apertures are meaningless.
    #[error("cannot export an aperture of 0 bytes")]
    Empty,
    /// Larger than supported.
    #[error("aperture of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Requested length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// Out of file descriptors (one memfd per aperture).
    #[error(
        "out of file descriptors ({limit} allowed): each aperture holds one memfd; raise RLIMIT_NOFILE (ulimit -n) or export fewer, larger apertures"
    )]
    FdLimit {
        /// The soft limit in force.
        limit: u64,
    },
    /// The endpoint was closed.
    #[error("the endpoint is closed")]
    EndpointClosed,
    /// Too many apertures on this NIC.
    #[error("too many apertures on this NIC")]
    TooMany,
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What clan was doing.
        context: &'static str,
        /// The system error.
        #[source]
        source: io::Error,
    },
}

/// Why an import was refused by the exporter ([`ImportError::Denied`]).
///
/// ```
/// use clan::{Denial, ExportConfig, ImportError, ImportPolicy};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let policy = ImportPolicy::anyone().uid(0xfffe); // a user this process does not run as
/// let ap = ep.export_with(4096, ExportConfig { policy, ..ExportConfig::default() })?;
/// assert!(matches!(ep.import(&ap.descriptor()), Err(ImportError::Denied(Denial::Uid))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Denial {
    /// The importer's user id is not allowed.
    Uid,
    /// The importer's process id is not allowed.
    Pid,
    /// The importing endpoint is not allowed.
    Endpoint,
    /// The exporter's policy excludes this importer (reported from another host, where user
    /// and process ids cannot be verified, so such restrictions always deny).
    Policy,
}

/// Importing descriptors.
///
/// ```
/// use clan::{ImportError, Rights};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(4096)?;
/// // Altering a descriptor (here: its rights byte, to undo a narrowing) breaks its tag.
/// let mut bytes = ap.descriptor().derive(0, 4096, Rights::READ)?.to_bytes();
/// let rights = bytes.len() - 17;
/// bytes[rights] = Rights::READ_WRITE.bits();
/// let forged = clan::Descriptor::from_bytes(&bytes)?;
/// assert!(matches!(ep.import(&forged), Err(ImportError::BadKey)));
/// let (id, desc) = (ap.id(), ap.descriptor());
/// drop(ap);
/// match ep.import(&desc) {
///     Err(ImportError::Revoked { aperture, .. }) => assert_eq!(aperture, id),
///     other => panic!("expected Revoked, got {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The aperture was unexported (or never existed): the descriptor is stale.
    #[error(
        "descriptor refers to aperture {aperture} generation {generation}, which is no longer exported: ask the exporter for a fresh descriptor"
    )]
    Revoked {
        /// Aperture id.
        aperture: u32,
        /// Generation in the descriptor.
        generation: u32,
    },
    /// The descriptor's key does not match: it was forged or altered.
    #[error("descriptor key does not match: the descriptor was forged or altered")]
    BadKey,
    /// The exporter's import restrictions exclude us.
    #[error("the exporter does not allow this importer ({0:?} restriction)")]
    Denied(Denial),
    /// No NIC answers at the descriptor's address.
    #[error("no NIC reachable at {0}")]
    Unreachable(NicAddr),
    /// The exporter has no room for another producer in the aperture's event queue.
    #[error("the exporter's event queue has no free producer ring (too many importing processes)")]
    TooManyProducers,
    /// The exporter holds as many imports from this NIC as it allows
    /// ([`crate::NicConfig::max_link_imports`]): release some first.
    #[error("{peer} holds as many imports from this NIC as it allows: release some first")]
    TooMany {
        /// The exporter.
        peer: NicAddr,
    },
    /// The descriptor grants less than its whole aperture, which a process of the exporter's
    /// host is only served through a link between the two NICs (so that it never holds memory
    /// beyond its grant), and links are disabled on one of them ([`crate::NicConfig::tcp`]).
    #[error(
        "the descriptor grants part of an aperture of {peer} (or reading only, of an aperture pooled for this NIC), which is served through a link only, and links are disabled (NicConfig::tcp)"
    )]
    NeedsLink {
        /// The exporter.
        peer: NicAddr,
    },
    /// Out of file descriptors.
    #[error("out of file descriptors while importing: raise RLIMIT_NOFILE (ulimit -n)")]
    FdLimit,
    /// No link to the exporter's host could be set up: the hand-shake refused it or was
    /// refused (a missing or wrong [`crate::NicConfig::cluster_key`], another protocol
    /// version).
    #[error("no link to {peer}: {detail}")]
    LinkRefused {
        /// The exporter.
        peer: NicAddr,
        /// Why.
        detail: String,
    },
    /// The endpoint was closed.
    #[error("the endpoint is closed")]
    EndpointClosed,
    /// The exporter answered something invalid.
    #[error("protocol error talking to {peer}: {detail}")]
    Protocol {
        /// The exporter.
        peer: NicAddr,
        /// What was wrong.
        detail: String,
    },
    /// The exporter did not answer in time.
    #[error("{peer} did not answer within {timeout:?}")]
    Timeout {
        /// The exporter.
        peer: NicAddr,
        /// The limit.
        timeout: Duration,
    },
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What clan was doing.
        context: &'static str,
        /// The system error.
        #[source]
        source: io::Error,
    },
}

impl ImportError {
    /// What the importer reports of the exporter's refusal (the one vocabulary of
    /// `clan_wire::grant`, whichever path the import took).
    pub(crate) fn refused(r: clan_wire::grant::Refusal, desc: &crate::Descriptor) -> ImportError {
        use clan_wire::grant::Refusal as R;
        let peer = desc.nic();
        match r {
            R::Revoked => ImportError::Revoked { aperture: desc.aperture(), generation: desc.generation() },
            R::BadKey => ImportError::BadKey,
            R::DeniedUid => ImportError::Denied(Denial::Uid),
            R::DeniedPid => ImportError::Denied(Denial::Pid),
            R::DeniedEndpoint => ImportError::Denied(Denial::Endpoint),
            R::DeniedCredentials => ImportError::Denied(Denial::Policy),
            R::TooManyProducers => ImportError::TooManyProducers,
            R::TooMany => ImportError::TooMany { peer },
            R::Narrowed => ImportError::NeedsLink { peer },
            R::Malformed | R::NotOurs | R::Internal => ImportError::Protocol { peer, detail: r.to_string() },
        }
    }
}

/// Programmed I/O through a mapping, and local access to an aperture.
///
/// ```
/// use clan::{AccessError, Rights};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(4096)?;
/// let m = ep.import(&ap.descriptor().derive(1000, 100, Rights::READ_WRITE)?)?;
/// assert_eq!(m.write(95, &[0; 6]), Err(AccessError::OutOfBounds { offset: 95, len: 6, size: 100 }));
/// assert_eq!(m.store_u64(4, 1), Err(AccessError::Misaligned { offset: 4, align: 8 }));
/// let e = m.write(100, b"x").unwrap_err();
/// assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::InvalidInput);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    /// The access does not lie within the region.
    #[error("access of {len} bytes at offset {offset} is outside the {size}-byte region")]
    OutOfBounds {
        /// Offset requested.
        offset: u64,
        /// Length requested.
        len: u64,
        /// Size of the region.
        size: u64,
    },
    /// A write through a descriptor without write rights.
    #[error("the descriptor does not grant write access")]
    NotWritable,
    /// A read through a descriptor without read rights.
    #[error("the descriptor does not grant read access")]
    NotReadable,
    /// Word accesses must be naturally aligned.
    #[error("word access at offset {offset} is not {align}-byte aligned")]
    Misaligned {
        /// Offset requested.
        offset: u64,
        /// Required alignment.
        align: u64,
    },
    /// The aperture was unexported.
    #[error("the aperture was unexported; the mapping is stale")]
    Revoked,
    /// The link to the exporter's host broke, or its process went away: import again.
    #[error(
        "the exporter is gone (its process died, its NIC closed, or the link to its host broke): import the descriptor again"
    )]
    Disconnected,
    /// The exporter did not answer in time.
    #[error("the exporter did not answer in time")]
    Timeout,
}

/// Tripwires and tripsets.
///
/// ```
/// use clan::{TripwireConfig, TripwireError};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(4096)?;
/// assert_eq!(ap.tripwire(TripwireConfig::writes(8..8)).unwrap_err(), TripwireError::EmptyRange);
/// match ap.tripwire(TripwireConfig::writes(4090..4097)) {
///     Err(TripwireError::OutOfBounds { end, size, .. }) => assert_eq!((end, size), (4097, 4096)),
///     other => panic!("expected OutOfBounds, got {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TripwireError {
    /// The range is empty.
    #[error("a tripwire must watch at least one byte")]
    EmptyRange,
    /// The range is outside the aperture or mapping.
    #[error("tripwire range {start}..{end} is outside the {size}-byte region")]
    OutOfBounds {
        /// Start requested.
        start: u64,
        /// End requested.
        end: u64,
        /// Size of the region.
        size: u64,
    },
    /// The event queue's tripwire table is full.
    #[error("the event queue's tripwire table is full ({capacity} entries): raise EventQueueConfig::tripwires")]
    TableFull {
        /// Capacity of the table.
        capacity: u32,
    },
    /// The tripwire belongs to another endpoint or queue.
    #[error("the tripwire belongs to another endpoint or event queue")]
    Foreign,
    /// The tripwire is already in a tripset.
    #[error("the tripwire is already a member of a tripset")]
    InTripset,
    /// No more tripsets in the queue.
    #[error("the event queue has no free tripset ({capacity} in use): raise EventQueueConfig::tripsets")]
    TripsetsFull {
        /// Capacity.
        capacity: u32,
    },
    /// The aperture or mapping it watched is gone.
    #[error("the watched aperture was unexported or the mapping dropped")]
    Stale,
    /// Waiting timed out.
    #[error("timed out waiting for the tripwire")]
    Timeout,
    /// The tripwire watches a mapping whose exporter is gone (its process died, its NIC
    /// closed, or the link to its host broke).
    #[error("the exporter of the watched mapping is gone")]
    Disconnected,
}

/// Event queues.
///
/// ```
/// use std::time::Duration;
/// use clan::{EventQueueConfig, EventQueueError};
///
/// let nic = clan::Nic::open_default()?;
/// let q = nic.event_queue(EventQueueConfig::default())?;
/// assert!(matches!(q.wait(Some(Duration::from_millis(1))), Err(EventQueueError::Timeout)));
/// let none = nic.event_queue(EventQueueConfig { producers: 0, ..EventQueueConfig::default() });
/// assert!(matches!(none, Err(EventQueueError::Config(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventQueueError {
    /// Waiting timed out.
    #[error("timed out waiting for an event")]
    Timeout,
    /// The configuration is invalid.
    #[error("invalid event queue configuration: {0}")]
    Config(String),
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What clan was doing.
        context: &'static str,
        /// The system error.
        #[source]
        source: io::Error,
    },
}

/// Out-of-band messages.
///
/// ```
/// use clan::{EndpointAddr, OobError};
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let nobody = EndpointAddr::new(nic.addr(), 999_999);
/// assert!(matches!(ep.send_oob(nobody, b"x"), Err(OobError::NoSuchEndpoint(e)) if e == nobody));
/// assert!(matches!(ep.send_oob(ep.addr(), &[0; 41]), Err(OobError::TooLong(41))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OobError {
    /// The payload is longer than the fixed 40 bytes.
    #[error("out-of-band payload of {0} bytes exceeds 40 bytes")]
    TooLong(usize),
    /// No such endpoint at the destination NIC.
    #[error("no endpoint {0}")]
    NoSuchEndpoint(EndpointAddr),
    /// The destination's OOB queue is full.
    #[error("the out-of-band queue of {0} is full; retry later")]
    QueueFull(EndpointAddr),
    /// No NIC answers at the destination.
    #[error("no NIC reachable at {0}")]
    Unreachable(NicAddr),
    /// Waiting timed out.
    #[error("timed out (waiting for an out-of-band message, or for the destination to take one)")]
    Timeout,
    /// The endpoint was closed.
    #[error("the endpoint is closed")]
    Closed,
    /// The destination answered something invalid or nothing in time.
    #[error("protocol error talking to {peer}: {detail}")]
    Protocol {
        /// The peer NIC.
        peer: NicAddr,
        /// What was wrong.
        detail: String,
    },
}

/// Parsing and deriving descriptors.
///
/// ```
/// use clan::{Descriptor, DescriptorError, Rights};
///
/// assert_eq!("hello".parse::<Descriptor>(), Err(DescriptorError::BadText));
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(4096)?;
/// let d = ap.descriptor();
/// match d.derive(4000, 200, Rights::READ) {
///     Err(DescriptorError::NotWithin { parent_len, .. }) => assert_eq!(parent_len, 4096),
///     other => panic!("expected NotWithin, got {other:?}"),
/// }
/// let deep = (0..4).try_fold(d, |d, _| d.derive(0, 8, Rights::READ))?;
/// assert_eq!(deep.derive(0, 8, Rights::READ), Err(DescriptorError::TooDeep(clan::MAX_CAVEATS)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// Not a clan descriptor (wrong magic or version).
    #[error("not a clan descriptor (bad magic or version)")]
    BadMagic,
    /// Truncated or with trailing bytes.
    #[error("descriptor has the wrong length")]
    BadLength,
    /// The text form is not valid.
    #[error("descriptor text is not valid: expected \"clan1.\" followed by base64url")]
    BadText,
    /// Unknown bits in the rights or address family.
    #[error("descriptor has invalid fields")]
    BadField,
    /// A derived range does not lie within its parent.
    #[error("derived range {offset}+{len} does not lie within the parent's {parent_len} bytes")]
    NotWithin {
        /// Relative offset requested.
        offset: u64,
        /// Length requested.
        len: u64,
        /// Parent's length.
        parent_len: u64,
    },
    /// Derived rights must be a subset of the parent's.
    #[error("derived rights must be a subset of the parent's")]
    RightsEscalation,
    /// Too many derivations.
    #[error("a descriptor can be narrowed at most {0} times")]
    TooDeep(usize),
}

/// How a DMA request that was accepted failed (reported by [`crate::DmaTicket`] and in
/// [`crate::Event::DmaComplete`]).
///
/// ```
/// use std::io::ErrorKind;
/// use std::time::Duration;
/// use clan::{DmaError, DmaFailure, DmaOptions};
///
/// # let nic = clan::Nic::open_default()?;
/// # let (me, them) = (nic.endpoint()?, nic.endpoint()?);
/// # let (src, target) = (me.export(4096)?, them.export(4096)?);
/// # let dst = me.import(&target.descriptor())?;
/// let ticket = me.dma_write(&src, 0, &dst, 0, 4096, DmaOptions::new())?;
/// match ticket.wait(Some(Duration::from_secs(5))) {
///     Ok(()) => {}
///     Err(DmaError::Failed(DmaFailure::Revoked)) => eprintln!("the target was unexported"),
///     Err(e) => return Err(e.into()),
/// }
/// assert_eq!(std::io::Error::from(DmaFailure::Cancelled).kind(), ErrorKind::Interrupted);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum DmaFailure {
    /// Its endpoint was closed before it ran (or while it ran: part of the data may have
    /// been moved).
    #[error("cancelled: the endpoint was closed before the request completed")]
    Cancelled,
    /// The remote aperture was unexported, or the local one was dropped.
    #[error("an aperture of the request was unexported")]
    Revoked,
    /// The link to the other host broke.
    #[error("the link to the other host went down")]
    Disconnected,
    /// The other host did not answer in time.
    #[error("the other host did not answer in time")]
    Timeout,
    /// An earlier request of its chain failed, so it was not run.
    #[error("an earlier request of the chain failed")]
    ChainAborted,
}

/// DMA: posting requests and waiting for them.
///
/// ```
/// use clan::{AccessError, DmaError, DmaOptions};
///
/// let nic = clan::Nic::open_default()?;
/// let (me, them) = (nic.endpoint()?, nic.endpoint()?);
/// let (src, target) = (me.export(4096)?, them.export(4096)?);
/// let dst = me.import(&target.descriptor())?;
/// let r = me.dma_write(&src, 0, &dst, 4000, 200, DmaOptions::new()); // past the end of `dst`
/// assert!(matches!(r, Err(DmaError::Access(AccessError::OutOfBounds { .. }))));
/// assert_eq!(me.dma_chain(Vec::new(), DmaOptions::new()).unwrap_err(), DmaError::EmptyChain);
/// me.close();
/// assert_eq!(me.dma_write(&src, 0, &dst, 0, 8, DmaOptions::new()).unwrap_err(), DmaError::EndpointClosed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DmaError {
    /// The request is invalid: out of range, missing rights, or an aperture already revoked.
    #[error("invalid DMA request: {0}")]
    Access(#[from] AccessError),
    /// The endpoint was closed.
    #[error("the endpoint is closed")]
    EndpointClosed,
    /// A chain without requests.
    #[error("a DMA chain must hold at least one request")]
    EmptyChain,
    /// A chain longer than the queue can hold at once.
    #[error("a chain of {len} requests does not fit in the endpoint's DMA queue of {capacity}")]
    ChainTooLong {
        /// Requests in the chain.
        len: usize,
        /// Queue capacity.
        capacity: usize,
    },
    /// The request ran and failed.
    #[error("the DMA failed: {0}")]
    Failed(DmaFailure),
    /// The wait timed out (the request is still pending).
    #[error("timed out waiting for the DMA")]
    Timeout,
    /// The NIC could not start its DMA engine thread.
    #[error("could not start the DMA engine: {0}")]
    Engine(String),
}

// ---- conversion into `std::io::Error` ---------------------------------------------------
//
// Every error converts into an `io::Error` whose kind says what a caller written against
// `std::net` expects (a refused connection is `ConnectionRefused`, a time-out `TimedOut`, a
// dead peer `ConnectionReset`, a bad argument `InvalidInput`, …); the clan error stays
// inside (`io::Error::get_ref`/`into_inner`), so nothing is lost.

use io::ErrorKind as K;

fn wrap<E: std::error::Error + Send + Sync + 'static>(kind: K, e: E) -> io::Error {
    io::Error::new(kind, e)
}

impl From<NicError> for io::Error {
    fn from(e: NicError) -> io::Error {
        let k = match &e {
            NicError::AddrInUse(_) => K::AddrInUse,
            NicError::NoFreePort => K::AddrNotAvailable,
            NicError::Config(_) => K::InvalidInput,
            NicError::Io { source, .. } => source.kind(),
        };
        wrap(k, e)
    }
}

impl From<EndpointError> for io::Error {
    fn from(e: EndpointError) -> io::Error {
        let k = match &e {
            EndpointError::PortInUse(_) => K::AddrInUse,
            EndpointError::ReservedPort | EndpointError::ForeignQueue => K::InvalidInput,
            EndpointError::Closed => K::NotConnected,
        };
        wrap(k, e)
    }
}

impl From<ExportError> for io::Error {
    fn from(e: ExportError) -> io::Error {
        let k = match &e {
            ExportError::Empty | ExportError::TooLarge { .. } => K::InvalidInput,
            ExportError::EndpointClosed => K::NotConnected,
            ExportError::FdLimit { .. } | ExportError::TooMany => K::Other,
            ExportError::Io { source, .. } => source.kind(),
        };
        wrap(k, e)
    }
}

impl From<ImportError> for io::Error {
    fn from(e: ImportError) -> io::Error {
        let k = match &e {
            ImportError::Revoked { .. } => K::NotFound,
            ImportError::BadKey | ImportError::Denied(_) | ImportError::LinkRefused { .. } => K::PermissionDenied,
            ImportError::Unreachable(_) => K::ConnectionRefused,
            ImportError::NeedsLink { .. } => K::Unsupported,
            ImportError::TooManyProducers | ImportError::TooMany { .. } => K::ResourceBusy,
            ImportError::FdLimit => K::Other,
            ImportError::EndpointClosed => K::NotConnected,
            ImportError::Protocol { .. } => K::InvalidData,
            ImportError::Timeout { .. } => K::TimedOut,
            ImportError::Io { source, .. } => source.kind(),
        };
        wrap(k, e)
    }
}

impl From<AccessError> for io::Error {
    fn from(e: AccessError) -> io::Error {
        let k = match &e {
            AccessError::OutOfBounds { .. } | AccessError::Misaligned { .. } => K::InvalidInput,
            AccessError::NotWritable | AccessError::NotReadable => K::PermissionDenied,
            AccessError::Revoked | AccessError::Disconnected => K::ConnectionReset,
            AccessError::Timeout => K::TimedOut,
        };
        wrap(k, e)
    }
}

impl From<TripwireError> for io::Error {
    fn from(e: TripwireError) -> io::Error {
        let k = match &e {
            TripwireError::EmptyRange
            | TripwireError::OutOfBounds { .. }
            | TripwireError::Foreign
            | TripwireError::InTripset => K::InvalidInput,
            TripwireError::TableFull { .. } | TripwireError::TripsetsFull { .. } => K::Other,
            TripwireError::Stale => K::NotConnected,
            TripwireError::Disconnected => K::ConnectionReset,
            TripwireError::Timeout => K::TimedOut,
        };
        wrap(k, e)
    }
}

impl From<EventQueueError> for io::Error {
    fn from(e: EventQueueError) -> io::Error {
        let k = match &e {
            EventQueueError::Timeout => K::TimedOut,
            EventQueueError::Config(_) => K::InvalidInput,
            EventQueueError::Io { source, .. } => source.kind(),
        };
        wrap(k, e)
    }
}

impl From<OobError> for io::Error {
    fn from(e: OobError) -> io::Error {
        let k = match &e {
            OobError::TooLong(_) => K::InvalidInput,
            OobError::NoSuchEndpoint(_) | OobError::Unreachable(_) => K::ConnectionRefused,
            OobError::QueueFull(_) => K::WouldBlock,
            OobError::Timeout => K::TimedOut,
            OobError::Closed => K::NotConnected,
            OobError::Protocol { .. } => K::InvalidData,
        };
        wrap(k, e)
    }
}

impl From<DescriptorError> for io::Error {
    fn from(e: DescriptorError) -> io::Error {
        wrap(K::InvalidInput, e)
    }
}

impl From<DmaFailure> for io::Error {
    fn from(e: DmaFailure) -> io::Error {
        let k = match &e {
            DmaFailure::Cancelled | DmaFailure::ChainAborted => K::Interrupted,
            DmaFailure::Revoked | DmaFailure::Disconnected => K::ConnectionReset,
            DmaFailure::Timeout => K::TimedOut,
        };
        wrap(k, e)
    }
}

impl From<DmaError> for io::Error {
    fn from(e: DmaError) -> io::Error {
        match e {
            DmaError::Access(a) => a.into(),
            DmaError::Failed(f) => f.into(),
            e => {
                let k = match &e {
                    DmaError::EndpointClosed => K::NotConnected,
                    DmaError::EmptyChain | DmaError::ChainTooLong { .. } => K::InvalidInput,
                    DmaError::Timeout => K::TimedOut,
                    _ => K::Other,
                };
                wrap(k, e)
            }
        }
    }
}

impl From<crate::conn::ConnectError> for io::Error {
    fn from(e: crate::conn::ConnectError) -> io::Error {
        use crate::conn::ConnectError as C;
        match e {
            C::Oob(o) => o.into(),
            e => {
                let k = match &e {
                    C::Refused(_) => K::ConnectionRefused,
                    C::Timeout(_) | C::NoRequest => K::TimedOut,
                    C::PeerGone(_) => K::ConnectionReset,
                    C::BadDescriptor(_) => K::InvalidData,
                    C::DataTooLong(_) => K::InvalidInput,
                    C::TooMany => K::ResourceBusy,
                    C::Closed => K::NotConnected,
                    C::Oob(_) => K::Other,
                };
                wrap(k, e)
            }
        }
    }
}

impl From<crate::addr::AddrParseError> for io::Error {
    fn from(e: crate::addr::AddrParseError) -> io::Error {
        wrap(K::InvalidInput, e)
    }
}
