//! A libfabric provider over clan: libfabric's dynamic provider loader finds it as
//! `libclan-fi.so` in a directory on `FI_PROVIDER_PATH` (`clan fabric env` prints the lines
//! that set it up) and calls `fi_prov_ini`.
//!
//! `fi_getinfo` (`fi_info -p clan`) lists reliable-datagram endpoints (`FI_EP_RDM`, with
//! `FI_MSG`, `FI_TAGGED`, `FI_RMA` and `FI_REMOTE_COMM`) and connected endpoints (`FI_EP_MSG`,
//! with passive endpoints and connection events), filtered by the caller's hints. Fabrics,
//! domains, address vectors ([`av`]), completion queues ([`cq`], with `FI_WAIT_FD`), counters
//! ([`cntr`]), event queues ([`eq`]), memory registrations ([`mr`]) and reliable-datagram
//! endpoints ([`rdm`], over clan's distributed queue) work; `fi_pingpong`, Open MPI and MPICH
//! run. Not built: atomics, shared contexts, more than one iovec (see `docs/ARCHITECTURE.md`);
//! those calls return `-FI_ENOSYS`.
//!
//! The unsafe code is confined to the `ffi` module, the thin `extern "C"` boundary (built when
//! libfabric's headers are installed): every pointer libfabric or the application passes is
//! checked there, and a bad argument gets the right `-FI_E*` value, never a crash. What is
//! decided (which endpoint types match the hints) is safe Rust ([`offer`]).
#![deny(unsafe_code)]

pub mod av;
pub mod cntr;
pub mod cq;
pub mod eq;
#[cfg(not(no_libfabric))]
pub mod ffi;
pub mod mr;
pub mod offer;
pub mod rdm;

/// The provider's name, as `fi_info -p` takes it.
pub const NAME: &str = "clan";

/// The file libfabric's loader looks for (`lib<name>-fi.so`).
pub const FILE_NAME: &str = "libclan-fi.so";
