//! # clan-shm — the unsafe core of clan
//!
//! Layer: platform and shared-memory building blocks, below the `clan` crate (which is
//! `#![forbid(unsafe_code)]`). Everything that touches raw memory or makes a system call with
//! raw pointers lives here, in small modules that explain themselves:
//!
//! | module | what |
//! |---|---|
//! | [`segment`] | a mapping of shared memory, accessed only by bounds-checked copies and atomic views |
//! | [`memfd`] | sealed memfds, the unit of protection between processes |
//! | [`futex`], [`eventfd`] | sleeping and waking across processes |
//! | [`wakesig`] | the signal that wakes a thread out of a blocking socket receive |
//! | [`seqpacket`] | abstract `SOCK_SEQPACKET` sockets with fd passing and peer credentials |
//! | [`ring`] | the per-producer event rings of an event queue (robust to a producer killed at any instruction) |
//! | [`trip`] | tripwire entries, firing (once-only, actions) and waiting |
//! | [`cam`] | the per-aperture index from addresses to tripwires (the software CAM) |
//! | [`snoop`] | the data path: move bytes, fire the tripwires they touch, in the right order |
//! | [`eq`] | the layout of an event queue's segment |
//! | [`doorbell`] | request queues that wake their service only when they were idle (the DMA doorbell) |
//! | [`smallmap`] | a map for the few entries most of them hold (the indexes' private records) |
//!
//! ## Guarantees
//!
//! - Shared memory is never reached through a Rust reference to plain data: bytes move with
//!   raw copies, control words are atomics ([`segment::Shared`]). Every offset, length and
//!   index read from shared memory is validated before use: memory written by another process
//!   is untrusted input.
//! - The lock-free algorithms ([`ring`], [`trip`], [`cam`], [`snoop`], [`doorbell`]) are written against
//!   the [`sync`] facade and model-checked with loom (`tests/loom.rs`,
//!   `RUSTFLAGS="--cfg loom" cargo test -p clan-shm --release --test loom`). Their fence
//!   protocols are documented where they live; every Release/Acquire pair is marked
//!   `SYNC POINT` and names its partner.
//!
//! ## Panics
//!
//! No function of this crate panics on any content of shared memory.

#![warn(missing_docs)]

pub mod cam;
pub mod doorbell;
pub mod eq;
pub mod handoff;
pub mod prefetch;
pub mod ring;
pub mod smallmap;
pub mod snoop;
pub mod sync;
pub mod trip;
pub mod waiters;

#[cfg(not(loom))]
pub mod eventfd;
#[cfg(not(loom))]
pub mod fdfloor;
#[cfg(not(loom))]
pub mod futex;
#[cfg(not(loom))]
pub mod memfd;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod seqpacket;
#[cfg(not(loom))]
pub mod wakesig;
