//! Memory registrations (`fi_mr_reg`): which ranges of this process's memory peers may
//! write or read through remote memory access, under which key.
//!
//! An application's buffer is its own memory (heap, stack), not an aperture: it cannot be
//! handed to a peer to map. A registration therefore works as clan's link does for remote
//! apertures: the peer's `fi_write`/`fi_read` travels as a request on the endpoint's queue,
//! and this process's provider — the exporter's side — checks it against the registration
//! (the key, the range, the rights) and only then copies ([`crate::rdm`] carries the
//! request; `ffi` does the copy). Nothing a peer sends can reach memory outside a live
//! registration: a key is an unguessable 64-bit value, a range is checked with overflow in
//! mind, and a registration being closed waits for any copy into it to finish (its lock).
//! Safe Rust.

use std::collections::HashMap;
use std::sync::{RwLock, RwLockReadGuard};

use crate::rdm::RmaStatus;

/// Access a registration allows (libfabric's `FI_REMOTE_READ` / `FI_REMOTE_WRITE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rights {
    pub remote_read: bool,
    pub remote_write: bool,
}

/// One registration: `len` bytes from `base` (an address in this process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub base: u64,
    pub len: u64,
    pub rights: Rights,
    /// The domain it was registered in: only that domain's endpoints serve it.
    pub domain: usize,
}

/// Every registration of the process, by key.
#[derive(Debug, Default)]
pub struct Registry {
    map: RwLock<HashMap<u64, Region>>,
}

/// A checked access: the registrations stay as they are while it is held (a registration
/// cannot be closed, and its memory freed, in the middle of a copy into it).
#[derive(Debug)]
pub struct Access<'a> {
    _held: RwLockReadGuard<'a, HashMap<u64, Region>>,
    /// Where to copy (inside the registration).
    pub addr: u64,
}

impl Registry {
    /// The process's registry.
    pub fn get() -> &'static Registry {
        static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
        R.get_or_init(Registry::default)
    }

    /// Register `region`; its key (never 0, never one in use).
    pub fn register(&self, region: Region) -> u64 {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        loop {
            let key = fresh_key();
            if key != 0 && !map.contains_key(&key) {
                map.insert(key, region);
                return key;
            }
        }
    }

    /// Forget `key` (waits for any access in progress); whether it was registered.
    pub fn deregister(&self, key: u64) -> bool {
        self.map.write().unwrap_or_else(|p| p.into_inner()).remove(&key).is_some()
    }

    /// May an endpoint of `domain` let a peer `write` (or read) `len` bytes at `addr` under
    /// `key`? The access, held for the copy, or why not.
    pub fn check(&self, domain: usize, key: u64, addr: u64, len: u64, write: bool) -> Result<Access<'_>, RmaStatus> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let r = *map.get(&key).filter(|r| r.domain == domain).ok_or(RmaStatus::NoKey)?;
        if !(if write { r.rights.remote_write } else { r.rights.remote_read }) {
            return Err(RmaStatus::NoRights);
        }
        let end = addr.checked_add(len).ok_or(RmaStatus::OutOfRange)?;
        if addr < r.base || end > r.base + r.len {
            return Err(RmaStatus::OutOfRange);
        }
        Ok(Access { _held: map, addr })
    }
}

/// An unguessable key: SipHash under the process's random keys of a counter and the time.
fn fresh_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = SEED.get_or_init(std::collections::hash_map::RandomState::new).build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_ranges_rights_and_domains_are_checked() {
        let reg = Registry::default();
        let rw = Rights { remote_read: true, remote_write: true };
        let k = reg.register(Region { base: 4096, len: 100, rights: rw, domain: 1 });
        let ro = reg.register(Region {
            base: 8192,
            len: 10,
            rights: Rights { remote_read: true, remote_write: false },
            domain: 1,
        });
        assert_ne!(k, ro);
        assert_eq!(reg.check(1, k, 4096, 100, true).map(|a| a.addr).ok(), Some(4096));
        assert_eq!(reg.check(1, k, 4100, 0, false).map(|a| a.addr).ok(), Some(4100));
        assert_eq!(reg.check(1, k, 4097, 100, true).err(), Some(RmaStatus::OutOfRange));
        assert_eq!(reg.check(1, k, 4095, 1, true).err(), Some(RmaStatus::OutOfRange));
        assert_eq!(reg.check(1, k, u64::MAX, 2, true).err(), Some(RmaStatus::OutOfRange));
        assert_eq!(reg.check(1, k ^ 1, 4096, 1, true).err(), Some(RmaStatus::NoKey));
        assert_eq!(reg.check(2, k, 4096, 1, true).err(), Some(RmaStatus::NoKey), "another domain's");
        assert_eq!(reg.check(1, ro, 8192, 1, true).err(), Some(RmaStatus::NoRights));
        assert!(reg.check(1, ro, 8192, 10, false).is_ok());
        assert!(reg.deregister(k) && !reg.deregister(k));
        assert_eq!(reg.check(1, k, 4096, 1, true).err(), Some(RmaStatus::NoKey));
    }
}
