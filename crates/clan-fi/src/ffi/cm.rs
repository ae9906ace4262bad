//! Connected endpoints (`FI_EP_MSG`, the VIA-style interface): passive endpoints, connection
//! management through event queues, and the endpoint side of connecting.
//!
//! A connected endpoint is an endpoint of the reliable-datagram machinery ([`crate::rdm`])
//! with one peer: its sends go to the peer, whatever address they name, and flow control is
//! the queue's (a sender waits for room in the peer's ring). Connecting is a hand-shake of
//! frames on the same queues ([`CmKind`]):
//! - a passive endpoint (`fi_passive_ep`) listens with an endpoint of its own; its address
//!   (`fi_getname`) is what a client connects to;
//! - `fi_connect` sends a request, with the caller's private data, from the client's
//!   endpoint to the passive endpoint; the passive endpoint's event queue reports
//!   `FI_CONNREQ` with an `fi_info` whose `handle` stands for the request;
//! - `fi_endpoint` with that `fi_info` opens the endpoint that takes the connection;
//!   `fi_accept` on it sends "accepted" (from the new endpoint, so the client learns its
//!   address) and reports `FI_CONNECTED` on its event queue; the client reports
//!   `FI_CONNECTED` when "accepted" comes; `fi_reject` sends "refused", which the client
//!   reports as an error event `FI_ECONNREFUSED`;
//! - `fi_shutdown` tells the peer, which reports `FI_SHUTDOWN`; so does a peer's going away.
//!
//! Control progress is made when an event queue is read: reading it takes in what came to
//! the endpoints and passive endpoints bound to it.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use super::sys::*;
use super::{EpObj, err};
use crate::av::{ADDR_LEN, Addr};
use crate::rdm::CmKind;

/// Largest private data of a connection-management call (`cm_data_size`).
pub(super) const CM_DATA: usize = 256;

/// A passive endpoint (`fid_pep` first).
#[repr(C)]
pub(super) struct PepObj {
    fid: fid_pep,
    rdm: crate::rdm::Rdm,
    /// The event queue bound to it (`EqObj` address).
    eq: std::sync::atomic::AtomicUsize,
    /// The `fi_info` it was opened with: copied into every `FI_CONNREQ`.
    info: *mut fi_info,
}

/// A connection request (`fid` first: it is the `handle` of the `fi_info` of `FI_CONNREQ`),
/// until an endpoint takes it or it is rejected.
#[repr(C)]
struct ConnReq {
    fid: fid,
    /// Who asked (the client's endpoint).
    from: Addr,
}

static PEP_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(pep_close),
    bind: Some(pep_bind),
    control: Some(super::fi_no_control),
    ops_open: Some(super::fi_no_ops_open),
    tostr: None,
    ops_set: None,
};
static PEP_OPS: fi_ops_ep = super::stubs::EP_ENOSYS;
static PEP_CM_OPS: fi_ops_cm = fi_ops_cm {
    getname: Some(super::ep_getname),
    listen: Some(pep_listen),
    reject: Some(pep_reject),
    ..super::stubs::CM_ENOSYS
};
static CONNREQ_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(connreq_close),
    bind: Some(super::fi_no_bind),
    control: Some(super::fi_no_control),
    ops_open: Some(super::fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

/// `fi_passive_ep`.
pub(super) unsafe extern "C" fn passive_ep(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    out: *mut *mut fid_pep,
    context: *mut c_void,
) -> c_int {
    if fabric.is_null() || info.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null; an fi_info's attribute pointers are null or valid.
    if unsafe { (*info).ep_attr.as_ref() }.is_some_and(|a| a.type_ != fi_ep_type_FI_EP_MSG) {
        return err(FI_EINVAL);
    }
    let Ok(queue) = crate::rdm::nic().and_then(|n| {
        n.event_queue(clan::EventQueueConfig::default()).map_err(|e| crate::rdm::Error::Nic(e.to_string()))
    }) else {
        return err(FI_ENODEV);
    };
    let Ok(rdm) = crate::rdm::Rdm::open(&queue) else { return err(FI_ENODEV) };
    // SAFETY: the caller's valid fi_info.
    let copy = unsafe { fi_dupinfo(info) };
    if copy.is_null() {
        return err(FI_ENOMEM);
    }
    let pep = Box::new(PepObj {
        fid: fid_pep {
            fid: fid { fclass: FI_CLASS_PEP as usize, context, ops: (&raw const PEP_FI_OPS).cast_mut() },
            ops: (&raw const PEP_OPS).cast_mut(),
            cm: (&raw const PEP_CM_OPS).cast_mut(),
        },
        rdm,
        eq: std::sync::atomic::AtomicUsize::new(0),
        info: copy,
    });
    // SAFETY: checked non-null; lives until `pep_close`.
    unsafe { *out = &mut Box::leak(pep).fid };
    0
}

unsafe extern "C" fn pep_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `PepObj` leaked by `passive_ep`, closed once.
    let pep = unsafe { Box::from_raw(f.cast::<PepObj>()) };
    if let Some(eq) = super::eq_at(pep.eq.load(Ordering::Acquire)) {
        eq.unwatch(f as usize);
    }
    // SAFETY: our copy, freed once.
    unsafe { fi_freeinfo(pep.info) };
    0
}

unsafe extern "C" fn pep_bind(f: *mut fid, bfid: *mut fid, _flags: u64) -> c_int {
    if f.is_null() || bfid.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `PepObj`; `bfid` an object of ours.
    let (pep, class) = unsafe { (&*f.cast::<PepObj>(), (*bfid).fclass as u32) };
    if class != FI_CLASS_EQ {
        return err(FI_EINVAL);
    }
    pep.eq.store(bfid as usize, Ordering::Release);
    if let Some(eq) = super::eq_at(bfid as usize) {
        eq.watch(super::Watched::Pep(f as usize));
    }
    0
}

unsafe extern "C" fn pep_listen(pep: *mut fid_pep) -> c_int {
    // SAFETY: null or the `fid_pep` at the start of a `PepObj`.
    let Some(pep) = (unsafe { pep.cast::<PepObj>().as_ref() }) else { return err(FI_EINVAL) };
    // (it listens from the start; requests are reported once an event queue is bound)
    if pep.eq.load(Ordering::Acquire) == 0 {
        return err(FI_ENOEQ);
    }
    0
}

/// The private data of a call (at most [`CM_DATA`] bytes).
unsafe fn param<'a>(p: *const c_void, len: usize) -> Result<&'a [u8], c_int> {
    if len > CM_DATA || (p.is_null() && len > 0) {
        return Err(err(FI_EINVAL));
    }
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: the caller's `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

unsafe extern "C" fn pep_reject(pep: *mut fid_pep, handle: fid_t, p: *const c_void, len: usize) -> c_int {
    // SAFETY: null or the `fid_pep` at the start of a `PepObj`.
    let Some(pep) = (unsafe { pep.cast::<PepObj>().as_ref() }) else { return err(FI_EINVAL) };
    // SAFETY: the caller's private data.
    let data = match unsafe { param(p, len) } {
        Ok(d) => d,
        Err(e) => return e,
    };
    // (any handle: a request of ours is found, anything else refused)
    let Some(from) = take_request(handle) else { return err(FI_EINVAL) };
    match pep.rdm.cm(from, CmKind::Reject, data) {
        Ok(()) => 0,
        // (a client that went away needs no answer)
        Err(crate::rdm::Error::PeerGone) => 0,
        Err(_) => err(FI_EIO),
    }
}

unsafe extern "C" fn connreq_close(f: *mut fid) -> c_int {
    match take_request(f) {
        Some(_) => 0,
        None => err(FI_EINVAL),
    }
}

/// The connection requests handed out and not yet answered (their handles' addresses), and
/// the last answered ones, still allocated. A handle is looked up here before anything reads
/// it: one answered twice, closed after its answer or made up is refused (`FI_EINVAL`), and
/// never read or freed again; and an answered request's memory is not reused for the next
/// [`RETIRED`] requests, so a stale handle does not name a newer request meanwhile.
struct Requests {
    live: std::collections::BTreeSet<usize>,
    retired: std::collections::VecDeque<usize>,
}

/// Answered requests kept allocated (see [`Requests`]).
const RETIRED: usize = 64;

static REQUESTS: std::sync::Mutex<Requests> = std::sync::Mutex::new(Requests {
    live: std::collections::BTreeSet::new(),
    retired: std::collections::VecDeque::new(),
});

fn requests() -> std::sync::MutexGuard<'static, Requests> {
    REQUESTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Hand out `req` as a request handle (its `fid`), live until [`take_request`].
fn give_request(req: Box<ConnReq>) -> *mut fid {
    let handle = &mut Box::leak(req).fid as *mut fid;
    requests().live.insert(handle as usize);
    handle
}

/// Take the request behind `handle`: who asked. `None` for anything but a live request of
/// ours (any pointer may be given: nothing is read through one that is not).
fn take_request(handle: fid_t) -> Option<Addr> {
    let mut r = requests();
    if !r.live.remove(&(handle as usize)) {
        return None;
    }
    // SAFETY: a live request: the `ConnReq` (its `fid` first) that `give_request` leaked,
    // freed only once it has left `retired`, under this lock.
    let from = unsafe {
        let req = handle.cast::<ConnReq>();
        (*req).fid.fclass = FI_CLASS_UNSPEC as usize;
        (*req).from
    };
    r.retired.push_back(handle as usize);
    if r.retired.len() > RETIRED
        && let Some(old) = r.retired.pop_front()
    {
        // SAFETY: leaked by `give_request`, out of `live` and now of `retired`: nothing reads
        // it again (a handle of it is looked up, not read).
        drop(unsafe { Box::from_raw(old as *mut ConnReq) });
    }
    Some(from)
}

/// The event bytes of a connection-management event: `fi_eq_cm_entry` (the object, the
/// `fi_info`) and the private data.
fn cm_entry(fid: usize, info: *mut fi_info, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&fid.to_ne_bytes());
    b.extend_from_slice(&(info as usize).to_ne_bytes());
    b.extend_from_slice(data);
    b
}

impl PepObj {
    /// Take in connection requests and report them.
    pub(super) fn progress(&self) {
        let Some(eq) = super::eq_at(self.eq.load(Ordering::Acquire)) else { return };
        for d in self.rdm.progress() {
            let crate::rdm::Done::Cm { from: Some(from), kind: CmKind::Request, data } = d else { continue };
            // SAFETY: our own valid copy.
            let info = unsafe { fi_dupinfo(self.info) };
            if info.is_null() {
                continue;
            }
            let req = Box::new(ConnReq {
                fid: fid {
                    fclass: FI_CLASS_CONNREQ as usize,
                    context: std::ptr::null_mut(),
                    ops: (&raw const CONNREQ_FI_OPS).cast_mut(),
                },
                from,
            });
            let handle = give_request(req);
            // SAFETY: `info` was just allocated; its dest_addr (the client) is ours to set,
            // with the C allocator (fi_freeinfo frees it).
            unsafe {
                (*info).handle = handle;
                let dest = libc::calloc(1, ADDR_LEN).cast::<u8>();
                if !dest.is_null() {
                    std::ptr::copy_nonoverlapping(from.bytes().as_ptr(), dest, ADDR_LEN);
                    libc::free((*info).dest_addr);
                    (*info).dest_addr = dest.cast();
                    (*info).dest_addrlen = ADDR_LEN;
                }
            }
            if !eq.eq.write(FI_CONNREQ, &cm_entry(self as *const PepObj as usize, info, &data)) {
                // (the queue is full: the request is dropped, and the client's connect
                // waits for an answer it will not get until it gives up)
                // SAFETY: ours, just made.
                unsafe {
                    let _ = take_request(handle);
                    fi_freeinfo(info);
                }
            }
        }
    }
}

impl EpObj {
    /// A connection-management frame came to this (connected) endpoint.
    pub(super) fn on_cm(&self, from: Option<crate::av::Addr>, kind: CmKind, data: &[u8]) {
        let Some(eq) = super::eq_at(self.eq.load(Ordering::Acquire)) else { return };
        let me = self as *const EpObj as usize;
        match kind {
            CmKind::Accept => {
                let Some(from) = from else { return };
                *self.peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(from);
                self.cm_state.store(CM_CONNECTED, Ordering::Release);
                eq.eq.write(FI_CONNECTED, &cm_entry(me, std::ptr::null_mut(), data));
            }
            CmKind::Reject => {
                self.cm_state.store(CM_IDLE, Ordering::Release);
                eq.eq.write_err(crate::eq::ErrEvent {
                    fid: me,
                    context: self.fid.fid.context as usize,
                    err: FI_ECONNREFUSED as i32,
                    ..Default::default()
                });
            }
            CmKind::Shutdown => self.peer_shut(),
            CmKind::Request => {}
        }
    }

    /// The peer disconnected or went away: `FI_SHUTDOWN`, once.
    pub(super) fn peer_shut(&self) {
        if self.cm_state.swap(CM_SHUT, Ordering::AcqRel) != CM_CONNECTED {
            return;
        }
        if let Some(eq) = super::eq_at(self.eq.load(Ordering::Acquire)) {
            eq.eq.write(FI_SHUTDOWN, &cm_entry(self as *const EpObj as usize, std::ptr::null_mut(), &[]));
        }
    }

    /// A connected endpoint whose peer went away reports it.
    pub(super) fn watch_peer(&self) {
        if self.cm_state.load(Ordering::Acquire) != CM_CONNECTED {
            return;
        }
        let peer = *self.peer.lock().unwrap_or_else(|p| p.into_inner());
        if peer.is_some_and(|p| self.rdm.is_gone(p)) {
            self.peer_shut();
        }
    }
}

/// Connection states of a connected endpoint.
pub(super) const CM_IDLE: u8 = 0;
pub(super) const CM_CONNECTING: u8 = 1;
pub(super) const CM_CONNECTED: u8 = 2;
pub(super) const CM_SHUT: u8 = 3;

unsafe fn msg_ep<'a>(ep: *mut fid_ep) -> Result<&'a EpObj, c_int> {
    // SAFETY: as `ep_of` requires.
    let ep = unsafe { super::ep_of(ep) }.ok_or(err(FI_EINVAL))?;
    if !ep.msg {
        return Err(err(FI_EOPNOTSUPP));
    }
    if ep.eq.load(Ordering::Acquire) == 0 {
        return Err(err(FI_ENOEQ));
    }
    Ok(ep)
}

/// `fi_connect`: send the request; `FI_CONNECTED` (or an error event) follows on the
/// endpoint's event queue.
pub(super) unsafe extern "C" fn connect(ep: *mut fid_ep, addr: *const c_void, p: *const c_void, len: usize) -> c_int {
    // SAFETY: as `msg_ep` requires.
    let ep = match unsafe { msg_ep(ep) } {
        Ok(e) => e,
        Err(e) => return e,
    };
    if addr.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the caller's private data.
    let data = match unsafe { param(p, len) } {
        Ok(d) => d,
        Err(e) => return e,
    };
    // SAFETY: an address is ADDR_LEN bytes.
    let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), ADDR_LEN) };
    let Ok(to) = Addr::from_bytes(bytes) else { return err(FI_EINVAL) };
    if ep.cm_state.compare_exchange(CM_IDLE, CM_CONNECTING, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return err(FI_EISCONN);
    }
    match ep.rdm.cm(to, CmKind::Request, data) {
        Ok(()) => 0,
        Err(e) => {
            ep.cm_state.store(CM_IDLE, Ordering::Release);
            match e {
                crate::rdm::Error::PeerGone | crate::rdm::Error::BadAddr => err(FI_ECONNREFUSED),
                _ => err(FI_EIO),
            }
        }
    }
}

/// `fi_accept` on the endpoint opened for a request: tell the client, report `FI_CONNECTED`.
pub(super) unsafe extern "C" fn accept(ep: *mut fid_ep, p: *const c_void, len: usize) -> c_int {
    // SAFETY: as `msg_ep` requires.
    let ep = match unsafe { msg_ep(ep) } {
        Ok(e) => e,
        Err(e) => return e,
    };
    // SAFETY: the caller's private data.
    let data = match unsafe { param(p, len) } {
        Ok(d) => d,
        Err(e) => return e,
    };
    let Some(peer) = *ep.peer.lock().unwrap_or_else(|p| p.into_inner()) else { return err(FI_EINVAL) };
    if ep.cm_state.compare_exchange(CM_IDLE, CM_CONNECTED, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return err(FI_EISCONN);
    }
    if let Err(e) = ep.rdm.cm(peer, CmKind::Accept, data) {
        ep.cm_state.store(CM_IDLE, Ordering::Release);
        return match e {
            crate::rdm::Error::PeerGone => err(FI_ECONNABORTED),
            _ => err(FI_EIO),
        };
    }
    if let Some(eq) = super::eq_at(ep.eq.load(Ordering::Acquire)) {
        eq.eq.write(FI_CONNECTED, &cm_entry(ep as *const EpObj as usize, std::ptr::null_mut(), &[]));
    }
    0
}

/// `fi_shutdown`: tell the peer (it reports `FI_SHUTDOWN`); sends fail from now on.
pub(super) unsafe extern "C" fn shutdown(ep: *mut fid_ep, _flags: u64) -> c_int {
    // SAFETY: as `msg_ep` requires.
    let ep = match unsafe { msg_ep(ep) } {
        Ok(e) => e,
        Err(e) => return e,
    };
    if ep.cm_state.swap(CM_SHUT, Ordering::AcqRel) != CM_CONNECTED {
        return 0;
    }
    let peer = *ep.peer.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(peer) = peer {
        let _ = ep.rdm.cm(peer, CmKind::Shutdown, &[]);
    }
    0
}

/// `fi_getpeer`: the connected peer's address.
pub(super) unsafe extern "C" fn getpeer(ep: *mut fid_ep, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { super::ep_of(ep) }) else { return err(FI_EINVAL) };
    if addrlen.is_null() {
        return err(FI_EINVAL);
    }
    let Some(peer) = *ep.peer.lock().unwrap_or_else(|p| p.into_inner()) else { return err(FI_ENOTCONN) };
    // SAFETY: the caller's length slot.
    let room = unsafe { std::mem::replace(&mut *addrlen, ADDR_LEN) };
    if room < ADDR_LEN || addr.is_null() {
        return err(FI_ETOOSMALL);
    }
    // SAFETY: the caller's buffer of `room` ≥ ADDR_LEN bytes.
    unsafe { std::ptr::copy_nonoverlapping(peer.bytes().as_ptr(), addr.cast::<u8>(), ADDR_LEN) };
    0
}

/// The request an `fi_info` given to `fi_endpoint` stands for: taken by the endpoint.
pub(super) unsafe fn take_handle(info: *const fi_info) -> Option<Addr> {
    // SAFETY: the caller's valid fi_info.
    let h = unsafe { (*info).handle };
    take_request(h)
}

impl PepObj {
    /// Its address (what clients connect to).
    pub(super) fn addr(&self) -> Addr {
        self.rdm.addr()
    }
}
