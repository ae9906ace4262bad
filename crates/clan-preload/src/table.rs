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

/// The connection of `fd`, if it is accelerated. In a child after `fork`, an inherited one
/// is first handed over by the parent (`crate::fork`), and is then the kernel's.
pub(crate) fn get(fd: c_int) -> Option<Arc<Conn>> {
    if !maybe(fd) {
        return None;
    }
    if forked() {
        crate::fork::inherited(fd);
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
    if forked() {
        // (never dropped in a child: see `take_inherited`)
        take_inherited(fd);
        return None;
    }
    let old = CONNS.write().unwrap_or_else(|e| e.into_inner()).remove(&fd);
    if old.is_some() {
        mark(fd, false);
    }
    old
}

/// Every descriptor of the connection at `conn`: they leave the table (it went over to the
/// kernel for good). The entries are returned, to be dropped by the caller outside any lock.
pub(crate) fn remove_conn(conn: *const Conn) -> Vec<(c_int, Arc<Conn>)> {
    let mut map = CONNS.write().unwrap_or_else(|e| e.into_inner());
    let fds: Vec<c_int> = map.iter().filter(|(_, c)| std::ptr::eq(Arc::as_ptr(c), conn)).map(|(fd, _)| *fd).collect();
    let mut out = Vec::with_capacity(fds.len());
    for fd in fds {
        if let Some(c) = map.remove(&fd) {
            mark(fd, false);
            out.push((fd, c));
        }
    }
    out
}

/// Every accelerated descriptor and its connection, as they are now.
pub(crate) fn snapshot() -> Vec<(c_int, Arc<Conn>)> {
    CONNS.read().unwrap_or_else(|e| e.into_inner()).iter().map(|(fd, c)| (*fd, c.clone())).collect()
}

/// Whether another descriptor than `fd` refers to the connection at `conn`.
pub(crate) fn others(fd: c_int, conn: *const Conn) -> bool {
    CONNS.read().unwrap_or_else(|e| e.into_inner()).iter().any(|(f, c)| *f != fd && std::ptr::eq(Arc::as_ptr(c), conn))
}

/// In a child after `fork`: the inherited entry of `fd`, taken out of the table without
/// being dropped (its clan state belongs to the parent, whose threads did not come along:
/// dropping it here would talk to an engine that is not there). None if `fd` was not
/// accelerated, or the table is held (by a thread that did not come along).
pub(crate) fn take_inherited(fd: c_int) -> Option<usize> {
    if !maybe(fd) {
        return None;
    }
    let mut map = CONNS.try_write().ok()?;
    let c = map.remove(&fd)?;
    mark(fd, false);
    let id = Arc::as_ptr(&c) as usize;
    std::mem::forget(c);
    Some(id)
}

/// In a child after `fork`: the descriptors still in the inherited table.
pub(crate) fn inherited_fds() -> Vec<c_int> {
    CONNS.try_read().map(|m| m.keys().copied().collect()).unwrap_or_default()
}
