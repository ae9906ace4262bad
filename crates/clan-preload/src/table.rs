//! Which descriptors are accelerated connections. A descriptor that is not costs one
//! atomic load (a bit per descriptor below 65 536, a count above).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, RwLock};

use libc::c_int;

use crate::conn::Conn;

const BITS: usize = 1 << 16;
static MARK: [AtomicU64; BITS / 64] = [const { AtomicU64::new(0) }; BITS / 64];
/// Accelerated descriptors at or above `BITS`.
static HIGH: AtomicUsize = AtomicUsize::new(0);
static CONNS: LazyLock<RwLock<HashMap<c_int, Arc<Conn>>>> = LazyLock::new(|| RwLock::new(HashMap::new()));

fn mark(fd: c_int, on: bool) {
    let i = fd as usize;
    if i < BITS {
        let bit = 1u64 << (i % 64);
        // Release/Acquire: pairs with `maybe`'s Acquire load; the map entry (inserted under
        // the lock before marking) is then visible to whoever sees the bit.
        if on {
            MARK[i / 64].fetch_or(bit, Ordering::Release);
        } else {
            MARK[i / 64].fetch_and(!bit, Ordering::Release);
        }
    } else if on {
        HIGH.fetch_add(1, Ordering::Release);
    } else {
        HIGH.fetch_sub(1, Ordering::Release);
    }
}

fn maybe(fd: c_int) -> bool {
    if fd < 0 {
        return false;
    }
    let i = fd as usize;
    if i < BITS {
        // SYNC POINT: pairs with `mark`'s Release.
        MARK[i / 64].load(Ordering::Acquire) & (1u64 << (i % 64)) != 0
    } else {
        HIGH.load(Ordering::Acquire) > 0
    }
}

/// Whether `fd` may be accelerated (no lock; false is certain).
pub(crate) fn is_marked(fd: c_int) -> bool {
    maybe(fd)
}

/// Set in a child after `fork`: the parent's clan state is not usable here (its threads
/// did not come along), so the child's sockets are all the kernel's.
pub(crate) static FORKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// The connection of `fd`, if it is accelerated.
pub(crate) fn get(fd: c_int) -> Option<Arc<Conn>> {
    if !maybe(fd) || forked() {
        return None;
    }
    CONNS.read().unwrap_or_else(|e| e.into_inner()).get(&fd).cloned()
}

/// `fd` is (now) the accelerated connection `c` (replacing whatever it was).
pub(crate) fn insert(fd: c_int, c: Arc<Conn>) {
    let old = CONNS.write().unwrap_or_else(|e| e.into_inner()).insert(fd, c);
    if old.is_none() {
        mark(fd, true);
    }
}

/// `fd` is closed (or reused): forget it.
pub(crate) fn remove(fd: c_int) -> Option<Arc<Conn>> {
    if !maybe(fd) {
        return None;
    }
    let old = CONNS.write().unwrap_or_else(|e| e.into_inner()).remove(&fd);
    if old.is_some() {
        mark(fd, false);
    }
    old
}
