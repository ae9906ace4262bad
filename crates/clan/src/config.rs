//! Configuration, with defaults that suit a low-latency server.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::addr::EndpointAddr;

/// How a NIC is opened.
#[derive(Debug, Clone)]
pub struct NicConfig {
    /// Host address of the NIC (default 127.0.0.1).
    pub ip: IpAddr,
    /// Port of the NIC; 0 (the default) picks a free one.
    pub port: u16,
    /// Geometry of the NIC's default event queue (shared by endpoints that name no other).
    pub default_queue: EventQueueConfig,
    /// Bound on every request to another NIC (import, out-of-band message).
    pub request_timeout: Duration,
    /// Recycle the memory of an unexported aperture once every importing process has
    /// unimported it (default). If false, memory that another process ever mapped is only
    /// recycled after that process has gone, in case it does not honour its unimport.
    pub reuse_imported_apertures: bool,
    /// Most bytes of unexported aperture memory kept for reuse (the endpoint cache).
    pub cache_bytes: u64,
}

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            default_queue: EventQueueConfig {
                tripwires: 1 << 20,
                ..EventQueueConfig::default()
            },
            request_timeout: Duration::from_secs(5),
            reuse_imported_apertures: true,
            cache_bytes: 256 << 20,
        }
    }
}

impl NicConfig {
    /// Default configuration at `ip:port`.
    pub fn at(ip: IpAddr, port: u16) -> NicConfig {
        NicConfig {
            ip,
            port,
            ..NicConfig::default()
        }
    }
}

/// Geometry and behaviour of an event queue.
#[derive(Debug, Clone)]
pub struct EventQueueConfig {
    /// Events each producer process can have outstanding before overflow (power of two).
    pub ring_capacity: u32,
    /// Producer processes (rings), including this one; at most 256.
    pub producers: u32,
    /// Tripwires of all endpoints using the queue.
    pub tripwires: u32,
    /// Tripsets of all endpoints using the queue.
    pub tripsets: u32,
    /// How long `wait` spins before it sleeps (the paper's server: 15 µs).
    pub spin: Duration,
}

impl Default for EventQueueConfig {
    fn default() -> Self {
        EventQueueConfig {
            ring_capacity: 4096,
            producers: 64,
            tripwires: 65536,
            tripsets: 1024,
            spin: Duration::from_micros(15),
        }
    }
}

/// Who may import an aperture. Empty lists mean "anyone with the descriptor".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportPolicy {
    /// Allowed user ids of importing processes (checked with the kernel's peer credentials).
    pub uids: Vec<u32>,
    /// Allowed process ids of importing processes.
    pub pids: Vec<u32>,
    /// Allowed importing endpoints.
    pub endpoints: Vec<EndpointAddr>,
}

impl ImportPolicy {
    /// No restriction.
    pub fn anyone() -> ImportPolicy {
        ImportPolicy::default()
    }
    /// Only processes of user `uid`.
    pub fn uid(mut self, uid: u32) -> Self {
        self.uids.push(uid);
        self
    }
    /// Only process `pid`.
    pub fn pid(mut self, pid: u32) -> Self {
        self.pids.push(pid);
        self
    }
    /// Only endpoint `ep`.
    pub fn endpoint(mut self, ep: EndpointAddr) -> Self {
        self.endpoints.push(ep);
        self
    }
}

/// How an aperture is exported.
#[derive(Debug, Clone, Default)]
pub struct ExportConfig {
    /// Import restrictions.
    pub policy: ImportPolicy,
}
