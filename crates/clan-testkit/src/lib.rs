//! # clan-testkit — test hosts and faults
//!
//! - [`netns::TestNet`]: hosts made of network namespaces joined by veth pairs (and a
//!   bridge for three or more), with addresses in 10.77.0.0/16; removed on drop, and stale ones
//!   left by a crashed run are reaped on the next run.
//! - [`fault::FaultProxy`]: a TCP proxy to put in front of a NIC, that can delay traffic,
//!   fall silent, drop its connections or cut them in the middle of a frame.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fault;
pub mod netns;
