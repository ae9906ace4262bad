//! # clan — a user-level network in software
//!
//! clan implements the CLAN network of AT&T Laboratories Cambridge — non-coherent
//! distributed shared memory with *tripwires* for synchronisation — with a software NIC
//! embedded in each process. Layer: the user API, above `clan-shm` (the unsafe core); this
//! crate has no `unsafe` code.
//!
//! - A [`Nic`] is opened in the process (no daemon) and addressed by a [`NicAddr`].
//! - An [`Endpoint`] (NIC address + port) exports [`Aperture`]s: regions of memory named by
//!   unforgeable, serialisable [`Descriptor`]s that can travel in any message, and narrowed
//!   (sub-range, fewer rights) by whoever holds them.
//! - Importing a descriptor gives a [`Mapping`]: within a host the exporter's memory is
//!   mapped and written with the CPU's own stores (programmed I/O, true zero copy).
//! - [`Tripwire`]s watch address ranges and fire when traffic through the NIC touches them —
//!   synchronisation orthogonal to data transfer. Firing posts to an [`EventQueue`] (a file
//!   descriptor for epoll/mio), sets a bit testable without a system call, counts, and wakes
//!   [`Tripwire::wait`] and [`Tripset`] waiters.
//! - Endpoints exchange fixed-size out-of-band messages ([`Endpoint::send_oob`]) for
//!   connection setup and exceptional conditions.
//!
//! ```
//! use std::time::Duration;
//! use clan::{Nic, NicConfig, TripwireConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nic = Nic::open(NicConfig::default())?;
//! let server = nic.endpoint()?;
//! let buf = server.export(4096)?;
//! let flag = buf.tripwire(TripwireConfig::writes(0..8))?;
//! let desc = buf.descriptor().to_string(); // send it anywhere
//!
//! // In the client (any process of the host, or this one):
//! let client = nic.endpoint()?;
//! let remote = client.import(&desc.parse()?)?;
//! remote.write(8, b"hello")?;      // the body first ...
//! remote.store_u64(0, 1)?;         // ... then the flag: fires the tripwire
//!
//! // Back in the server: arm, re-check, wait.
//! flag.arm()?;
//! while buf.load_u64(0)? == 0 {
//!     flag.wait(Some(Duration::from_secs(5)))?;
//! }
//! let mut body = [0u8; 5];
//! buf.read(8, &mut body)?;
//! assert_eq!(&body, b"hello");
//! # Ok(()) }
//! ```
//!
//! ## Threads
//!
//! Every public type is `Send` and `Sync`; every method takes `&self` and may be called
//! from any thread. Cheap handles ([`Nic`], [`EventQueue`], [`Mapping`]) are `Clone`.
//!
//! ## Panics
//!
//! No function panics on bad input: bad arguments, stale or forged descriptors, hostile
//! bytes from other processes and out-of-range accesses are typed errors.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod addr;
mod aperture;
mod config;
mod conn;
mod descriptor;
mod dma;
mod endpoint;
mod engine;
mod error;
mod event_queue;
mod lazy;
mod link;
mod mapping;
mod nic;
mod onaccept;
mod peer;
mod pool;
mod port;
mod progress;
mod remote;
mod transport;
mod tripset;
mod tripwire;
mod wake;
mod window;

/// Lock `m`, taking the data of a poisoned lock as it is: a panic elsewhere never leaves
/// the NIC's tables half-written in a way later users cannot handle (every update is one
/// insert, remove or push), and the NIC must keep serving the other threads.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub use addr::{AddrParseError, EndpointAddr, NicAddr, PeerIdentity, ToEndpointAddrs, each_endpoint_addr};
pub use aperture::{Aperture, MAX_APERTURE};
pub use clan_shm::prefetch;
pub use clan_shm::segment::RawRegion;
pub use config::{
    AdmissionLimits, DEFAULT_SPIN, DmaConfig, EventQueueConfig, ExportConfig, ImportPolicy, LinkConfig, LocalTransport,
    MAX_SPIN, NicConfig, Progress, SPIN_ENV, SpinParseError, default_spin, parse_spin,
};
pub use conn::{ConnectError, ConnectRequest, Connection, DEFAULT_CONNECT_TIMEOUT, MAX_PRIVATE_DATA};
pub use descriptor::{Descriptor, MAX_CAVEATS, Rights};
pub use dma::{DEFAULT_DMA_QUEUE, DmaOptions, DmaRequest, DmaStats, DmaTicket};
pub use endpoint::{Endpoint, EndpointConfig, OOB_QUEUE, OobMessage, PendingImport};
pub use error::{
    AccessError, Denial, DescriptorError, DmaError, DmaFailure, EndpointError, EventQueueError, ExportError,
    ImportError, NicError, OobError, TripwireError,
};
pub use event_queue::{Event, EventQueue, EventQueueStats, MAX_PRODUCERS};
pub use mapping::{Mapping, PendingRead};
pub use nic::{Nic, NicStats, fd_limit};
pub use pool::MAX_POOLED;
pub use progress::LinkSpin;
pub use tripset::Tripset;
pub use tripwire::{Access, Actions, Tripwire, TripwireConfig, TripwireId};

/// Fuzz harnesses (`fuzz/`): not part of the API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::descriptor::fuzz as descriptor;
}

/// Size of an out-of-band payload.
pub const OOB_PAYLOAD: usize = clan_wire::control::OOB_PAYLOAD;

/// Every public type is `Send` and `Sync`: checked at compile time, so that a field added
/// to one of them that is neither (an `Rc`, a `Cell`, a raw pointer) fails the build here
/// instead of surprising a user who shares a NIC, an endpoint or a mapping across threads.
const _: () = {
    const fn send_sync<T: Send + Sync + ?Sized>() {}
    send_sync::<AddrParseError>();
    send_sync::<SpinParseError>();
    send_sync::<EndpointAddr>();
    send_sync::<NicAddr>();
    send_sync::<PeerIdentity>();
    send_sync::<Aperture>();
    send_sync::<LinkSpin>();
    send_sync::<RawRegion<'static>>();
    send_sync::<AdmissionLimits>();
    send_sync::<DmaConfig>();
    send_sync::<EventQueueConfig>();
    send_sync::<ExportConfig>();
    send_sync::<ImportPolicy>();
    send_sync::<LinkConfig>();
    send_sync::<LocalTransport>();
    send_sync::<NicConfig>();
    send_sync::<Progress>();
    send_sync::<ConnectError>();
    send_sync::<ConnectRequest>();
    send_sync::<Connection>();
    send_sync::<Descriptor>();
    send_sync::<Rights>();
    send_sync::<DmaOptions>();
    send_sync::<DmaRequest>();
    send_sync::<DmaStats>();
    send_sync::<DmaTicket>();
    send_sync::<Endpoint>();
    send_sync::<EndpointConfig>();
    send_sync::<OobMessage>();
    send_sync::<PendingImport>();
    send_sync::<AccessError>();
    send_sync::<Denial>();
    send_sync::<DescriptorError>();
    send_sync::<DmaError>();
    send_sync::<DmaFailure>();
    send_sync::<EndpointError>();
    send_sync::<EventQueueError>();
    send_sync::<ExportError>();
    send_sync::<ImportError>();
    send_sync::<NicError>();
    send_sync::<OobError>();
    send_sync::<TripwireError>();
    send_sync::<Event>();
    send_sync::<EventQueue>();
    send_sync::<EventQueueStats>();
    send_sync::<Mapping>();
    send_sync::<PendingRead>();
    send_sync::<Nic>();
    send_sync::<NicStats>();
    send_sync::<Tripset>();
    send_sync::<Access>();
    send_sync::<Actions>();
    send_sync::<Tripwire>();
    send_sync::<TripwireConfig>();
    send_sync::<TripwireId>();
};
