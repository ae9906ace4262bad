//! Counters at the boundary: `fi_cntr_open` and the `fid_cntr` operations over
//! [`crate::cntr::Cntr`]. An endpoint bound to a counter (`fi_ep_bind` with `FI_SEND`,
//! `FI_RECV`, `FI_READ`, `FI_WRITE`, `FI_REMOTE_READ`, `FI_REMOTE_WRITE`) counts the
//! operations of those kinds that complete; reading or waiting on the counter makes the
//! progress of the endpoints bound to it (the provider's data progress is manual).

use std::ffi::{c_int, c_void};

use super::sys::*;
use super::{end_eps, err, prepare_eps, progress_eps};
use crate::rdm::Sleeper;

/// A counter (`fid_cntr` first).
#[repr(C)]
pub(super) struct CntrObj {
    fid: fid_cntr,
    pub(super) cntr: crate::cntr::Cntr,
    /// The endpoints bound to it (their addresses).
    pub(super) eps: std::sync::Mutex<Vec<usize>>,
    /// The queue waits sleep on (the domain's, or with automatic progress its own).
    queue: clan::EventQueue,
    /// Whether a waiter arms the bound endpoints' receivers (manual progress).
    arms: bool,
    /// Reads in a row that found the counts unchanged (`last`: the counts they found).
    polls: super::Polls,
    last: std::sync::atomic::AtomicU64,
}

static CNTR_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(cntr_close),
    bind: Some(super::fi_no_bind),
    control: Some(super::fi_no_control),
    ops_open: Some(super::fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static CNTR_OPS: fi_ops_cntr = fi_ops_cntr {
    size: size_of::<fi_ops_cntr>(),
    read: Some(cntr_read),
    readerr: Some(cntr_readerr),
    add: Some(cntr_add),
    set: Some(cntr_set),
    wait: Some(cntr_wait),
    adderr: Some(cntr_adderr),
    seterr: Some(cntr_seterr),
};

impl CntrObj {
    /// The bound endpoints, locked (as `CqObj::eps`).
    fn eps(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.eps.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn progress(&self) {
        progress_eps(&self.eps(), &mut crate::cq::Direct::none());
    }
}

unsafe fn cntr_of<'a>(c: *mut fid_cntr) -> Option<&'a CntrObj> {
    // SAFETY: null, or the `fid_cntr` at the start of a `CntrObj` leaked by `cntr_open`.
    unsafe { c.cast::<CntrObj>().as_ref() }
}

pub(super) unsafe extern "C" fn cntr_open(
    domain: *mut fid_domain,
    attr: *mut fi_cntr_attr,
    out: *mut *mut fid_cntr,
    context: *mut c_void,
) -> c_int {
    if domain.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: null (defaults) or the caller's attributes.
    if let Some(a) = unsafe { attr.as_ref() } {
        if a.events != fi_cntr_events_FI_CNTR_EVENTS_COMP || a.flags != 0 {
            return err(FI_ENOSYS);
        }
        match a.wait_obj {
            fi_wait_obj_FI_WAIT_NONE | fi_wait_obj_FI_WAIT_UNSPEC | fi_wait_obj_FI_WAIT_YIELD => {}
            _ => return err(FI_ENOSYS),
        }
    }
    // SAFETY: checked non-null: the `fid_domain` at the start of a `Domain` of ours.
    let Some((queue, arms)) = (unsafe { (*domain.cast::<super::Domain>()).wait_queue() }) else {
        return err(FI_ENODEV);
    };
    let c = Box::new(CntrObj {
        fid: fid_cntr {
            fid: fid { fclass: FI_CLASS_CNTR as usize, context, ops: (&raw const CNTR_FI_OPS).cast_mut() },
            ops: (&raw const CNTR_OPS).cast_mut(),
        },
        cntr: crate::cntr::Cntr::new(Some(queue.clone())),
        eps: std::sync::Mutex::new(Vec::new()),
        queue,
        arms,
        polls: super::Polls::default(),
        last: std::sync::atomic::AtomicU64::new(0),
    });
    // SAFETY: checked non-null; lives until `cntr_close`.
    unsafe { *out = &mut Box::leak(c).fid };
    0
}

unsafe extern "C" fn cntr_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `CntrObj`.
    if unsafe { !(*f.cast::<CntrObj>()).eps().is_empty() } {
        return err(FI_EBUSY);
    }
    // SAFETY: the `fid` at the start of a `CntrObj` leaked by `cntr_open`, closed once.
    drop(unsafe { Box::from_raw(f.cast::<CntrObj>()) });
    0
}

unsafe extern "C" fn cntr_read(c: *mut fid_cntr) -> u64 {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return 0 };
    c.progress();
    let n = c.cntr.read();
    let seen = n.wrapping_add(c.cntr.read_err().rotate_left(32));
    if c.last.swap(seen, std::sync::atomic::Ordering::Relaxed) == seen {
        // (a counter's reads never sleep: only a completion queue's do)
        c.polls.empty(false, 0);
    } else {
        c.polls.found();
    }
    n
}

unsafe extern "C" fn cntr_readerr(c: *mut fid_cntr) -> u64 {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return 0 };
    c.progress();
    c.cntr.read_err()
}

unsafe extern "C" fn cntr_add(c: *mut fid_cntr, v: u64) -> c_int {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return err(FI_EINVAL) };
    c.cntr.add(v);
    0
}

unsafe extern "C" fn cntr_set(c: *mut fid_cntr, v: u64) -> c_int {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return err(FI_EINVAL) };
    c.cntr.set(v);
    0
}

unsafe extern "C" fn cntr_adderr(c: *mut fid_cntr, v: u64) -> c_int {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return err(FI_EINVAL) };
    c.cntr.add_err(v);
    0
}

unsafe extern "C" fn cntr_seterr(c: *mut fid_cntr, v: u64) -> c_int {
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return err(FI_EINVAL) };
    c.cntr.set_err(v);
    0
}

/// Wait until the count reaches `threshold` (0), an operation fails meanwhile
/// (`-FI_EAVAIL`), or `timeout` ms pass (`-FI_ETIMEDOUT`; negative: no limit). Progress is
/// made on the way; after a short spin the thread sleeps on the domain's event queue.
unsafe extern "C" fn cntr_wait(c: *mut fid_cntr, threshold: u64, timeout: c_int) -> c_int {
    use std::time::{Duration, Instant};
    // SAFETY: as `cntr_of` requires.
    let Some(c) = (unsafe { cntr_of(c) }) else { return err(FI_EINVAL) };
    let end = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    let errors = c.cntr.read_err();
    let spin_end = Instant::now() + super::spin();
    loop {
        c.progress();
        if c.cntr.read() >= threshold {
            return 0;
        }
        if c.cntr.read_err() != errors {
            return err(FI_EAVAIL);
        }
        let now = Instant::now();
        if end.is_some_and(|e| now >= e) {
            return err(FI_ETIMEDOUT);
        }
        if now < spin_end {
            std::hint::spin_loop();
            continue;
        }
        let left = end.map(|e| e.saturating_duration_since(now));
        c.cntr.sleeping(|| {
            while c.queue.try_take().is_some() {}
            if (!c.arms || prepare_eps(&c.eps(), Sleeper::Ours))
                && c.cntr.read() < threshold
                && c.cntr.read_err() == errors
            {
                // (bounded: a wake-up taken by another thread sleeping on the same queue
                // costs at most this)
                let nap = Duration::from_millis(100);
                let _ = c.queue.wait(Some(left.map_or(nap, |l| l.min(nap))));
            }
            if c.arms {
                end_eps(&c.eps());
            }
        });
    }
}
