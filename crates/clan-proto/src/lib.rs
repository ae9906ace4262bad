//! # clan-proto — communication styles built on clan
//!
//! Layer: above `clan` (apertures, descriptors, mappings, tripwires, event queues, DMA),
//! built from nothing else. No unsafe code.
//!
//! - [`vmmc`]: the virtual memory-mapped communication model of Princeton's SHRIMP project —
//!   export/import of receive buffers with importer restrictions, deliberate update
//!   (`send_msg`, synchronous and asynchronous, short messages by programmed I/O and long
//!   ones by DMA), remote fetch, and notifications.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod queue;
pub mod rpc;
pub mod server;
pub mod stream;
pub mod vmmc;

#[cfg(feature = "tokio")]
pub mod tokio;

/// Lock `m`, taking the data of a poisoned lock as it is (a panic in another thread must not
/// make every later call on the same stream or buffer panic too).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

mod inplace;
mod pipe;
mod side;
mod wait;

pub use inplace::InPlace;
pub use pipe::Redirection;
pub use side::SetupError;
