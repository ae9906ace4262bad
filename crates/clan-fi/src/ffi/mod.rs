//! The `extern "C"` boundary with libfabric: its ABI (generated from the installed headers by
//! `build.rs`), the entry point `fi_prov_ini`, and the provider's operations. Every pointer
//! received is checked before use; errors are returned as libfabric's negative `FI_E*` codes.
#![allow(unsafe_code)]
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, missing_debug_implementations)]
#![allow(clippy::all)]

/// libfabric's types and constants (bindgen).
#[allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
pub mod sys {
    include!(concat!(env!("OUT_DIR"), "/fabric.rs"));
}

mod auto;
mod cm;
mod cntr;
mod rma;
mod stubs;

use cntr::CntrObj;

use std::cell::UnsafeCell;
use std::ffi::{CStr, c_char, c_int, c_void};

use sys::*;

use crate::offer::{self, EpType, Hints};
use crate::rdm::Sleeper;

const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// The libfabric API version this provider is written against (Debian's 1.17).
pub const API_VERSION: u32 = fi_version(1, 17);
/// The provider's own version.
pub const PROVIDER_VERSION: u32 = fi_version(0, 1);

// The capability bits of `offer` are libfabric's.
const _: () = {
    use crate::offer::caps;
    assert!(caps::MSG == FI_MSG as u64 && caps::RMA == FI_RMA as u64 && caps::TAGGED == FI_TAGGED as u64);
    assert!(caps::READ == FI_READ as u64 && caps::WRITE == FI_WRITE as u64);
    assert!(caps::RECV == FI_RECV as u64 && caps::SEND == FI_SEND as u64);
    assert!(caps::REMOTE_READ == FI_REMOTE_READ as u64 && caps::REMOTE_WRITE == FI_REMOTE_WRITE as u64);
    assert!(caps::DIRECTED_RECV == FI_DIRECTED_RECV as u64 && caps::SOURCE == FI_SOURCE as u64);
    assert!(caps::LOCAL_COMM == FI_LOCAL_COMM as u64 && caps::REMOTE_COMM == FI_REMOTE_COMM as u64);
};

/// `FI_ADDR_NOTAVAIL` and `FI_ADDR_UNSPEC` (cast macros bindgen does not carry over).
const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;

/// libfabric's internal `fi_getinfo` flag for "core providers only" (`include/ofi.h`), set
/// when a utility provider looks for a provider to layer over.
const OFI_CORE_PROV_ONLY: u64 = 1 << 59;

/// A `-FI_E*` return value.
fn err(code: u32) -> c_int {
    -(code as c_int)
}

/// The provider structure libfabric keeps a pointer to (it may write its `context`).
struct Provider(UnsafeCell<fi_provider>);

// SAFETY: libfabric is the only writer (of `context`, while loading, single-threaded); we
// only hand out the pointer.
unsafe impl Sync for Provider {}

static PROVIDER: Provider = Provider(UnsafeCell::new(fi_provider {
    version: PROVIDER_VERSION,
    fi_version: API_VERSION,
    context: fi_context { internal: [std::ptr::null_mut(); 4] },
    name: c"clan".as_ptr(),
    getinfo: Some(getinfo),
    fabric: Some(fabric),
    cleanup: Some(cleanup),
}));

/// The entry point libfabric's loader calls.
#[unsafe(no_mangle)]
pub extern "C" fn fi_prov_ini() -> *mut fi_provider {
    PROVIDER.0.get()
}

unsafe extern "C" fn cleanup() {}

/// A C string from the application (None: null or not UTF-8).
unsafe fn c_str<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: libfabric passes NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// A copy of `s` owned by the C allocator (libfabric frees the strings of an `fi_info`).
fn strdup(s: &CStr) -> *mut c_char {
    // SAFETY: `s` is NUL-terminated.
    unsafe { libc::strdup(s.as_ptr()) }
}

/// The caller's hints, as far as matching goes.
unsafe fn hints_of(h: *const fi_info) -> Hints {
    // SAFETY: libfabric passes null or a valid fi_info whose attribute pointers are null or
    // valid.
    let Some(h) = (unsafe { h.as_ref() }) else { return Hints::default() };
    let mut out = Hints { caps: h.caps, ..Hints::default() };
    // SAFETY: as above.
    if let Some(ep) = unsafe { h.ep_attr.as_ref() } {
        out.ep_type = match ep.type_ {
            fi_ep_type_FI_EP_RDM => Some(EpType::Rdm),
            fi_ep_type_FI_EP_MSG => Some(EpType::Msg),
            fi_ep_type_FI_EP_UNSPEC => None,
            _ => {
                out.other_provider = true;
                None
            }
        };
    }
    // SAFETY: as above.
    if let Some(f) = unsafe { h.fabric_attr.as_ref() } {
        // SAFETY: null or NUL-terminated.
        if let Some(p) = unsafe { c_str(f.prov_name) } {
            out.other_provider |= !p.split(';').any(|x| x.eq_ignore_ascii_case(crate::NAME));
        }
        // SAFETY: as above.
        if let Some(n) = unsafe { c_str(f.name) } {
            out.other_fabric |= n != crate::NAME;
        }
    }
    out
}

/// `fi_getinfo` for this provider: one `fi_info` per matching offer, linked.
unsafe extern "C" fn getinfo(
    version: u32,
    _node: *const c_char,
    _service: *const c_char,
    flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> c_int {
    if info.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: `info` is a valid out-pointer (checked non-null).
    unsafe { *info = std::ptr::null_mut() };
    // libfabric asks this way when it would layer a utility provider over us (`ofi_rxm`
    // over our connected endpoints, to make reliable datagrams): we have those natively, and
    // a layered entry listed first would be taken instead of ours.
    if flags & OFI_CORE_PROV_ONLY != 0 {
        return err(FI_ENODATA);
    }
    if version > API_VERSION && version >> 16 != API_VERSION >> 16 {
        return err(FI_ENODATA);
    }
    // SAFETY: null or valid hints.
    let h = unsafe { hints_of(hints) };
    let offers = offer::matching(&h);
    // SAFETY: null or valid hints, whose attribute pointers are null or valid.
    let dom_hints = unsafe { hints.as_ref().and_then(|h| h.domain_attr.as_ref()) };
    if offers.is_empty() {
        return err(FI_ENODATA);
    }
    // Data progress is manual (the application's calls make it) unless the caller asks for
    // it automatic (a thread per domain makes it).
    let auto = dom_hints.is_some_and(|d| d.data_progress == fi_progress_FI_PROGRESS_AUTO);
    // Every threading level is met (the provider is thread-safe throughout): the one asked
    // for is the one reported (MPICH, for one, takes only what it asked for).
    let threading = dom_hints
        .map(|d| d.threading)
        .filter(|&t| t != fi_threading_FI_THREAD_UNSPEC)
        .unwrap_or(fi_threading_FI_THREAD_SAFE);
    let mut head: *mut fi_info = std::ptr::null_mut();
    for o in offers.iter().rev() {
        // SAFETY: libfabric's allocator of a zeroed fi_info with every attribute structure.
        let i = unsafe { fi_dupinfo(std::ptr::null()) };
        if i.is_null() {
            // SAFETY: frees what was built (null is fine).
            unsafe { fi_freeinfo(head) };
            return err(FI_ENOMEM);
        }
        // SAFETY: `i` was just allocated with all of its attribute structures.
        unsafe { fill(&mut *i, o, threading) };
        if auto {
            // SAFETY: `i` was just allocated with all of its attribute structures.
            unsafe { (*(*i).domain_attr).data_progress = fi_progress_FI_PROGRESS_AUTO };
        }
        // A destination the caller names (a connected endpoint's peer) is kept in the
        // answer, for `fi_connect`.
        // SAFETY: `i` was just allocated (its dest_addr is ours to set, with the C
        // allocator); the hints are null or valid, their dest_addr `dest_addrlen` bytes.
        unsafe {
            if let Some(h) = hints.as_ref() {
                if !h.dest_addr.is_null() && h.dest_addrlen == crate::av::ADDR_LEN {
                    let d = libc::malloc(crate::av::ADDR_LEN);
                    if !d.is_null() {
                        std::ptr::copy_nonoverlapping(h.dest_addr.cast::<u8>(), d.cast::<u8>(), crate::av::ADDR_LEN);
                        (*i).dest_addr = d;
                        (*i).dest_addrlen = crate::av::ADDR_LEN;
                    }
                }
            }
        }
        // The default flags of operations given without flags are the caller's (with
        // FI_SELECTIVE_COMPLETION, FI_COMPLETION among them says those report success).
        // SAFETY: `i` was just allocated with all of its attribute structures; the hints'
        // are null or valid.
        unsafe {
            if let Some(h) = hints.as_ref() {
                if let Some(t) = h.tx_attr.as_ref() {
                    (*(*i).tx_attr).op_flags = t.op_flags;
                }
                if let Some(r) = h.rx_attr.as_ref() {
                    (*(*i).rx_attr).op_flags = r.op_flags;
                }
            }
        }
        // SAFETY: as above.
        unsafe { (*i).next = head };
        head = i;
    }
    // SAFETY: checked non-null above.
    unsafe { *info = head };
    0
}

/// Fill a fresh `fi_info` (from `fi_dupinfo(NULL)`) for `o`.
unsafe fn fill(i: &mut fi_info, o: &offer::Offer, threading: fi_threading) {
    i.caps = o.caps;
    i.mode = 0;
    i.addr_format = FI_FORMAT_UNSPEC;
    // SAFETY: fi_dupinfo(NULL) allocates every attribute structure.
    let (tx, rx, ep, dom, fab) =
        unsafe { (&mut *i.tx_attr, &mut *i.rx_attr, &mut *i.ep_attr, &mut *i.domain_attr, &mut *i.fabric_attr) };
    tx.caps = o.caps;
    tx.msg_order = (FI_ORDER_SAS | FI_ORDER_RAW | FI_ORDER_WAW | FI_ORDER_WAR | FI_ORDER_RAR) as u64;
    tx.inject_size = o.inject_size as usize;
    tx.size = 1024;
    tx.iov_limit = 1;
    tx.rma_iov_limit = 1;
    rx.caps = o.caps;
    rx.msg_order = tx.msg_order;
    rx.size = 1024;
    rx.iov_limit = 1;
    ep.type_ = match o.ep_type {
        EpType::Rdm => fi_ep_type_FI_EP_RDM,
        EpType::Msg => fi_ep_type_FI_EP_MSG,
    };
    ep.protocol = FI_PROTO_UNSPEC;
    ep.protocol_version = 1;
    ep.max_msg_size = o.max_msg_size as usize;
    ep.mem_tag_format = if o.caps & offer::caps::TAGGED != 0 { u64::MAX >> 2 } else { 0 };
    ep.tx_ctx_cnt = 1;
    ep.rx_ctx_cnt = 1;
    dom.name = strdup(c"clan");
    dom.threading = threading;
    // (connections are taken in by a thread of the endpoint's own; data moves when the
    // application calls in)
    dom.control_progress = fi_progress_FI_PROGRESS_AUTO;
    dom.data_progress = fi_progress_FI_PROGRESS_MANUAL;
    dom.resource_mgmt = fi_resource_mgmt_FI_RM_ENABLED;
    dom.av_type = fi_av_type_FI_AV_UNSPEC;
    dom.mr_mode = (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED) as c_int;
    dom.mr_key_size = 8;
    dom.cq_data_size = 8;
    dom.cq_cnt = 1024;
    dom.ep_cnt = 1 << 16;
    dom.tx_ctx_cnt = 1;
    dom.rx_ctx_cnt = 1;
    dom.max_ep_tx_ctx = 1;
    dom.max_ep_rx_ctx = 1;
    dom.mr_iov_limit = 1;
    dom.caps = offer::caps::LOCAL_COMM | offer::caps::REMOTE_COMM;
    dom.mr_cnt = 1 << 16;
    fab.name = strdup(c"clan");
    fab.prov_version = PROVIDER_VERSION;
    fab.api_version = API_VERSION;
}

// ---- fabric ----------------------------------------------------------------------------------

/// A fabric: libfabric's `fid_fabric` first (applications and libfabric hold a pointer to
/// it), then ours.
#[repr(C)]
struct Fabric {
    fid: fid_fabric,
}

static FABRIC_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(fabric_close),
    bind: Some(fi_no_bind),
    control: Some(fi_no_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static FABRIC_OPS: fi_ops_fabric = fi_ops_fabric {
    size: size_of::<fi_ops_fabric>(),
    domain: Some(domain_open),
    passive_ep: Some(cm::passive_ep),
    eq_open: Some(eq_open),
    wait_open: Some(no_wait_open),
    trywait: Some(trywait),
    domain2: Some(no_domain2),
};

unsafe extern "C" fn fabric(attr: *mut fi_fabric_attr, out: *mut *mut fid_fabric, context: *mut c_void) -> c_int {
    if attr.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null; libfabric passes a valid attribute structure.
    let name = unsafe { c_str((*attr).name) };
    if name.is_some_and(|n| n != crate::NAME) {
        return err(FI_ENODATA);
    }
    let f = Box::new(Fabric {
        fid: fid_fabric {
            fid: fid { fclass: FI_CLASS_FABRIC as usize, context, ops: (&raw const FABRIC_FI_OPS).cast_mut() },
            ops: (&raw const FABRIC_OPS).cast_mut(),
            api_version: API_VERSION,
        },
    });
    // SAFETY: checked non-null; the fabric lives until `fabric_close`.
    unsafe { *out = &mut Box::leak(f).fid };
    0
}

unsafe extern "C" fn fabric_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: `f` is the `fid` at the start of a `Fabric` we leaked in `fabric` (repr(C),
    // first field of the first field), closed once by contract.
    drop(unsafe { Box::from_raw(f.cast::<Fabric>()) });
    0
}

unsafe extern "C" fn fi_no_bind(_: *mut fid, _: *mut fid, _: u64) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn fi_no_control(_: *mut fid, _: c_int, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn fi_no_ops_open(
    _: *mut fid,
    _: *const c_char,
    _: u64,
    _: *mut *mut c_void,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_domain2(
    _: *mut fid_fabric,
    _: *mut fi_info,
    _: *mut *mut fid_domain,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_wait_open(_: *mut fid_fabric, _: *mut fi_wait_attr, _: *mut *mut fid_wait) -> c_int {
    err(FI_ENOSYS)
}
/// `fi_trywait`: 0 when the application may block on the wait descriptors of `fids`
/// (completion queues opened with `FI_WAIT_FD`): nothing is there to read, every bound
/// endpoint's receivers are armed, and the descriptor becomes readable when anything
/// arrives. `-FI_EAGAIN`: read the queues first.
unsafe extern "C" fn trywait(fabric: *mut fid_fabric, fids: *mut *mut fid, count: c_int) -> c_int {
    if fabric.is_null() || (count > 0 && fids.is_null()) || count < 0 {
        return err(FI_EINVAL);
    }
    for i in 0..count as usize {
        // SAFETY: the caller's array of `count` object pointers.
        let f = unsafe { *fids.add(i) };
        if f.is_null() {
            return err(FI_EINVAL);
        }
        // SAFETY: an object of ours: its class says which.
        match unsafe { (*f).fclass } as u32 {
            FI_CLASS_CQ => {
                // SAFETY: the `fid` at the start of a `CqObj`.
                let q = unsafe { &*f.cast::<CqObj>() };
                if !q.wait_fd {
                    return err(FI_EINVAL);
                }
                q.progress();
                // (the application sleeps next, and never says when it wakes)
                if !q.prepare_wait(Sleeper::Theirs) || !q.queue.arm() {
                    return err(FI_EAGAIN);
                }
            }
            _ => return err(FI_ENOSYS),
        }
    }
    0
}

// ---- domain ----------------------------------------------------------------------------------

/// A domain (`fid_domain` first).
#[repr(C)]
struct Domain {
    fid: fid_domain,
    /// Where the domain's endpoints report arrivals: its descriptor is the completion
    /// queues' wait object (`FI_WAIT_FD`), unless progress is automatic.
    queue: clan::EventQueue,
    /// Automatic data progress: the thread that makes it (it sleeps on `queue`; completion
    /// queues and counters then wait on queues of their own).
    auto: Option<auto::Auto>,
    /// The application serializes its calls on the domain's objects: it asked for
    /// `FI_THREAD_DOMAIN` or `FI_THREAD_COMPLETION` (see [`CqObj::sole`]).
    serial: bool,
}

impl Domain {
    /// The queue a completion queue or counter of this domain sleeps on (and whose
    /// descriptor is its wait object), and whether its waits arm the endpoints' receivers
    /// themselves (manual progress) or only wait for what the progress thread pushes.
    fn wait_queue(&self) -> Option<(clan::EventQueue, bool)> {
        match &self.auto {
            None => Some((self.queue.clone(), true)),
            Some(_) => crate::rdm::nic().ok()?.event_queue(clan::EventQueueConfig::default()).ok().map(|q| (q, false)),
        }
    }
}

static DOMAIN_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(domain_close),
    bind: Some(fi_no_bind),
    control: Some(fi_no_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static DOMAIN_OPS: fi_ops_domain = fi_ops_domain {
    size: size_of::<fi_ops_domain>(),
    av_open: Some(av_open),
    cq_open: Some(cq_open),
    endpoint: Some(ep_open),
    scalable_ep: Some(no_endpoint),
    cntr_open: Some(cntr::cntr_open),
    poll_open: Some(no_poll_open),
    stx_ctx: Some(no_stx_ctx),
    srx_ctx: Some(no_srx_ctx),
    query_atomic: Some(no_query_atomic),
    query_collective: Some(no_query_collective),
    endpoint2: Some(no_endpoint2),
};

static MR_OPS: fi_ops_mr = fi_ops_mr {
    size: size_of::<fi_ops_mr>(),
    reg: Some(rma::mr_reg),
    regv: Some(rma::mr_regv),
    regattr: Some(rma::mr_regattr),
};

unsafe extern "C" fn domain_open(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    out: *mut *mut fid_domain,
    context: *mut c_void,
) -> c_int {
    if fabric.is_null() || info.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null; an fi_info's attribute pointers are null or valid.
    if let Some(d) = unsafe { (*info).domain_attr.as_ref() } {
        // SAFETY: null or NUL-terminated.
        if unsafe { c_str(d.name) }.is_some_and(|n| n != crate::NAME) {
            return err(FI_EINVAL);
        }
    }
    let queue = match crate::rdm::nic().map(|n| n.event_queue(clan::EventQueueConfig::default())) {
        Ok(Ok(q)) => q,
        _ => return err(FI_ENODEV),
    };
    // SAFETY: as above.
    let wants_auto =
        unsafe { (*info).domain_attr.as_ref() }.is_some_and(|d| d.data_progress == fi_progress_FI_PROGRESS_AUTO);
    // SAFETY: as above.
    let serial = unsafe { (*info).domain_attr.as_ref() }
        .is_some_and(|d| matches!(d.threading, fi_threading_FI_THREAD_DOMAIN | fi_threading_FI_THREAD_COMPLETION));
    let auto = if wants_auto {
        match auto::Auto::start(queue.clone()) {
            Ok(a) => Some(a),
            Err(_) => return err(FI_ENOMEM),
        }
    } else {
        None
    };
    let d = Box::new(Domain {
        fid: fid_domain {
            fid: fid { fclass: FI_CLASS_DOMAIN as usize, context, ops: (&raw const DOMAIN_FI_OPS).cast_mut() },
            ops: (&raw const DOMAIN_OPS).cast_mut(),
            mr: (&raw const MR_OPS).cast_mut(),
        },
        queue,
        auto,
        serial,
    });
    // SAFETY: checked non-null; the domain lives until `domain_close`.
    unsafe { *out = &mut Box::leak(d).fid };
    0
}

unsafe extern "C" fn domain_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `Domain`.
    if unsafe { (*f.cast::<Domain>()).auto.as_ref() }.is_some_and(|a| !a.is_empty()) {
        return err(FI_EBUSY);
    }
    // SAFETY: the `fid` at the start of a `Domain` leaked by `domain_open`, closed once (its
    // progress thread, if any, is stopped and joined).
    drop(unsafe { Box::from_raw(f.cast::<Domain>()) });
    0
}

unsafe extern "C" fn no_endpoint(_: *mut fid_domain, _: *mut fi_info, _: *mut *mut fid_ep, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_endpoint2(
    _: *mut fid_domain,
    _: *mut fi_info,
    _: *mut *mut fid_ep,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_poll_open(_: *mut fid_domain, _: *mut fi_poll_attr, _: *mut *mut fid_poll) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_stx_ctx(_: *mut fid_domain, _: *mut fi_tx_attr, _: *mut *mut fid_stx, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_srx_ctx(_: *mut fid_domain, _: *mut fi_rx_attr, _: *mut *mut fid_ep, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_query_atomic(
    _: *mut fid_domain,
    _: fi_datatype,
    _: fi_op,
    _: *mut fi_atomic_attr,
    _: u64,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_query_collective(
    _: *mut fid_domain,
    _: fi_collective_op,
    _: *mut fi_collective_attr,
    _: u64,
) -> c_int {
    err(FI_ENOSYS)
}

// ---- address vectors -------------------------------------------------------------------------

/// An address vector (`fid_av` first).
#[repr(C)]
struct Av {
    fid: fid_av,
    table: crate::av::Table,
}

static AV_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(av_close),
    bind: Some(fi_no_bind),
    control: Some(fi_no_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static AV_OPS: fi_ops_av = fi_ops_av {
    size: size_of::<fi_ops_av>(),
    insert: Some(av_insert),
    insertsvc: Some(no_av_insertsvc),
    insertsym: Some(no_av_insertsym),
    remove: Some(av_remove),
    lookup: Some(av_lookup),
    straddr: Some(av_straddr),
    av_set: Some(no_av_set),
};

/// The `Av` behind an `fid_av` we made.
unsafe fn av_of<'a>(av: *mut fid_av) -> Option<&'a Av> {
    // SAFETY: null, or the `fid_av` at the start of an `Av` leaked by `av_open`.
    unsafe { av.cast::<Av>().as_ref() }
}

unsafe extern "C" fn av_open(
    domain: *mut fid_domain,
    attr: *mut fi_av_attr,
    out: *mut *mut fid_av,
    context: *mut c_void,
) -> c_int {
    if domain.is_null() || attr.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null.
    let a = unsafe { &*attr };
    if a.type_ != fi_av_type_FI_AV_UNSPEC && a.type_ != fi_av_type_FI_AV_TABLE && a.type_ != fi_av_type_FI_AV_MAP {
        return err(FI_EINVAL);
    }
    if !a.name.is_null() || a.flags & (FI_EVENT as u64) != 0 {
        // Shared (named) address vectors and asynchronous inserts are not offered.
        return err(FI_ENOSYS);
    }
    let av = Box::new(Av {
        fid: fid_av {
            fid: fid { fclass: FI_CLASS_AV as usize, context, ops: (&raw const AV_FI_OPS).cast_mut() },
            ops: (&raw const AV_OPS).cast_mut(),
        },
        table: crate::av::Table::default(),
    });
    // SAFETY: checked non-null; lives until `av_close`.
    unsafe { *out = &mut Box::leak(av).fid };
    0
}

unsafe extern "C" fn av_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of an `Av` leaked by `av_open`, closed once.
    drop(unsafe { Box::from_raw(f.cast::<Av>()) });
    0
}

unsafe extern "C" fn av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    _context: *mut c_void,
) -> c_int {
    // SAFETY: as `av_of` requires.
    let Some(av) = (unsafe { av_of(av) }) else { return err(FI_EINVAL) };
    if flags & (FI_EVENT as u64) != 0 {
        return err(FI_EINVAL);
    }
    if count > 0 && addr.is_null() {
        return err(FI_EINVAL);
    }
    let mut done = 0;
    for i in 0..count {
        // SAFETY: the caller passes `count` addresses of the provider's address length.
        let bytes =
            unsafe { std::slice::from_raw_parts(addr.cast::<u8>().add(i * crate::av::ADDR_LEN), crate::av::ADDR_LEN) };
        let out = match crate::av::Addr::from_bytes(bytes).ok().and_then(|a| av.table.insert(a)) {
            Some(i) => {
                done += 1;
                i
            }
            None => FI_ADDR_NOTAVAIL,
        };
        if !fi_addr.is_null() {
            // SAFETY: the caller's array of `count` entries.
            unsafe { *fi_addr.add(i) = out };
        }
    }
    done as c_int
}

unsafe extern "C" fn av_remove(av: *mut fid_av, fi_addr: *mut fi_addr_t, count: usize, _flags: u64) -> c_int {
    // SAFETY: as `av_of` requires.
    let Some(av) = (unsafe { av_of(av) }) else { return err(FI_EINVAL) };
    if count > 0 && fi_addr.is_null() {
        return err(FI_EINVAL);
    }
    let mut all = true;
    for i in 0..count {
        // SAFETY: the caller's array of `count` entries.
        all &= av.table.remove(unsafe { *fi_addr.add(i) });
    }
    if all { 0 } else { err(FI_EINVAL) }
}

unsafe extern "C" fn av_lookup(av: *mut fid_av, fi_addr: fi_addr_t, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    // SAFETY: as `av_of` requires.
    let Some(av) = (unsafe { av_of(av) }) else { return err(FI_EINVAL) };
    if addrlen.is_null() {
        return err(FI_EINVAL);
    }
    let Some(a) = av.table.lookup(fi_addr) else { return err(FI_ENOENT) };
    // SAFETY: checked non-null: the caller's buffer length.
    let room = unsafe { *addrlen };
    if !addr.is_null() {
        let n = room.min(crate::av::ADDR_LEN);
        // SAFETY: the caller's buffer of `room` bytes (at least `n`).
        unsafe { std::ptr::copy_nonoverlapping(a.bytes().as_ptr(), addr.cast::<u8>(), n) };
    }
    // SAFETY: as above.
    unsafe { *addrlen = crate::av::ADDR_LEN };
    0
}

/// Text of an address: `clan://` and the endpoint address, truncated to the caller's buffer;
/// `*len` says how long the whole is (its NUL included).
unsafe extern "C" fn av_straddr(
    _av: *mut fid_av,
    addr: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    if addr.is_null() || len.is_null() {
        return buf;
    }
    // SAFETY: an address of the provider's length.
    let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), crate::av::ADDR_LEN) };
    let text = match crate::av::Addr::from_bytes(bytes) {
        Ok(a) => format!("clan://{}", a.text()),
        Err(_) => "clan://(invalid)".to_string(),
    };
    // SAFETY: checked non-null.
    let room = unsafe { *len };
    if !buf.is_null() && room > 0 {
        let n = text.len().min(room - 1);
        // SAFETY: the caller's buffer of `room` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    // SAFETY: as above.
    unsafe { *len = text.len() + 1 };
    buf
}

unsafe extern "C" fn no_av_insertsvc(
    _: *mut fid_av,
    _: *const c_char,
    _: *const c_char,
    _: *mut fi_addr_t,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_av_insertsym(
    _: *mut fid_av,
    _: *const c_char,
    _: usize,
    _: *const c_char,
    _: usize,
    _: *mut fi_addr_t,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_av_set(
    _: *mut fid_av,
    _: *mut fi_av_set_attr,
    _: *mut *mut fid_av_set,
    _: *mut c_void,
) -> c_int {
    err(FI_ENOSYS)
}

// ---- completion queues -----------------------------------------------------------------------

/// A completion queue (`fid_cq` first).
#[repr(C)]
struct CqObj {
    fid: fid_cq,
    cq: crate::cq::Cq,
    format: fi_cq_format,
    /// The endpoints bound to it (their addresses): reading the queue makes their progress.
    eps: std::sync::Mutex<Vec<usize>>,
    /// The queue blocking reads sleep on: the domain's (manual progress), or its own
    /// (automatic progress: the domain's thread sleeps on the domain's).
    queue: clan::EventQueue,
    wait_fd: bool,
    /// Whether a waiter arms the bound endpoints' receivers (manual progress).
    arms: bool,
    /// Reads in a row that found nothing.
    polls: Polls,
    /// In a serial domain, the endpoint bound here when there is exactly one (0: none, or
    /// several, or the domain is not serial): a read makes its progress without taking
    /// `eps`' lock. The application serializes every call on the queue with those on the
    /// endpoints bound to it (the threading model it asked for), so the endpoint is not
    /// closed while a read uses it: libfabric's own providers drop their locks in this
    /// model too. With two locked instructions fewer on every read of a polling loop, a
    /// ping-pong between two processes took about 25 ns less one way (`docs/ARCHITECTURE.md`,
    /// "Serial domains").
    sole: std::sync::atomic::AtomicUsize,
    /// Whether its domain is serial ([`Domain::serial`]).
    serial: bool,
}

impl CqObj {
    /// After `eps` changed (its lock held): what [`CqObj::sole`] says now.
    fn note_eps(&self, eps: &[usize]) {
        let sole = match eps {
            [only] if self.serial => *only,
            _ => 0,
        };
        // SYNC POINT: pairs with the Acquire load in `CqObj::progress_to` (the endpoint, whole,
        // before its address).
        self.sole.store(sole, std::sync::atomic::Ordering::Release);
    }

    /// The bound endpoints, locked: held while they make progress, so that an endpoint
    /// closing (which takes itself off the list first) waits for that to end.
    fn eps(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.eps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Progress of every endpoint bound here; their [`crate::rdm::Rdm::activity`], summed.
    fn progress(&self) -> u64 {
        self.progress_to(&mut crate::cq::Direct::none())
    }

    /// [`CqObj::progress`] by a reader of this queue that takes what lands for it in
    /// `direct` ([`crate::cq::Direct`]).
    #[inline(always)]
    fn progress_to(&self, direct: &mut crate::cq::Direct) -> u64 {
        // SYNC POINT: pairs with the Release store in `CqObj::note_eps`.
        let sole = self.sole.load(std::sync::atomic::Ordering::Acquire);
        if sole != 0 {
            // (not closed meanwhile: see `CqObj::sole`)
            return progress_eps(&[sole], direct);
        }
        progress_eps(&self.eps(), direct)
    }

    /// Before sleeping on the queue: forget the events already there, arm every bound
    /// endpoint's receivers and look again. `true`: sleeping is safe (whatever arrives from
    /// now on posts to the queue); `false`: something is there to progress or read.
    fn prepare_wait(&self, who: Sleeper) -> bool {
        while self.queue.try_take().is_some() {}
        (!self.arms || prepare_eps(&self.eps(), who)) && !self.cq.has_any() && !self.cq.is_signaled()
    }

    /// After a [`CqObj::prepare_wait`] of [`Sleeper::Ours`] and its sleep, if any.
    fn end_wait(&self) {
        if self.arms {
            end_eps(&self.eps());
        }
    }

    /// Sleep on the queue for at most `d`, unless something is there to progress or read
    /// (what arrives meanwhile wakes it, as in [`CqObj::wait`]). A signal is left for the
    /// blocking read it is meant for.
    fn nap(&self, d: std::time::Duration) {
        self.cq.sleeping(|| {
            if self.prepare_wait(Sleeper::Ours) {
                let _ = self.queue.wait(Some(d));
            }
            self.end_wait();
        });
    }

    /// Wait until a completion (or an error completion) is there, `end` passes, or the
    /// queue is signalled. Progress is made on the way; the thread sleeps on the event
    /// queue in between (it never spins).
    fn wait(&self, end: Option<std::time::Instant>) -> Result<(), crate::cq::ReadError> {
        use crate::cq::ReadError;
        // Spin first (a reply that comes within the spin costs no wake-up), then sleep.
        let spin_end = std::time::Instant::now() + spin();
        loop {
            self.progress();
            if self.cq.has_any() {
                return Ok(());
            }
            if std::time::Instant::now() < spin_end && end.is_none_or(|e| std::time::Instant::now() < e) {
                std::hint::spin_loop();
                continue;
            }
            if self.cq.take_signal() {
                return Err(ReadError::Canceled);
            }
            let left = end.map(|e| e.saturating_duration_since(std::time::Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(ReadError::Again);
            }
            self.cq.sleeping(|| {
                if self.prepare_wait(Sleeper::Ours) {
                    // (bounded: a wake-up taken by another thread sleeping on the same
                    // queue costs at most this)
                    let nap = std::time::Duration::from_millis(100);
                    let _ = self.queue.wait(Some(left.map_or(nap, |l| l.min(nap))));
                }
                self.end_wait();
            });
        }
    }
}

/// Reads in a row that found nothing, of an application polling a queue or counter in a
/// loop (as MPI libraries and `fi_pingpong` do, never sleeping): every [`Polls::EVERY`]th
/// gives the CPU up for a moment (`sched_yield`). The provider's own threads (the NIC's
/// engine, which answers a peer's connection hand-shake, and the endpoint's acceptor) may
/// share that CPU (a process bound to one core); without it they would wait for the
/// scheduler to take the CPU from the poller, a few milliseconds for each step of a
/// hand-shake. A reply that comes while the loop is busy is not delayed by it.
///
/// A completion queue polled for longer than [`idle_after`] without finding anything (a
/// rank of an MPI program waiting for a peer that computes) stops spinning: its reads sleep
/// on the queue (bounded by [`NAP`] each, woken by what arrives), so an application that
/// polls waits the way one that blocks does. Nothing changes for an application that finds
/// something more often than that.
#[derive(Debug, Default)]
struct Polls {
    /// Empty reads in a row.
    n: std::sync::atomic::AtomicU32,
    /// When this run of empty reads was first seen at a yield ([`clock`]; 0: not yet).
    since: std::sync::atomic::AtomicU64,
    /// Idle for [`idle_after`] already: every empty read sleeps (until one finds something).
    napping: std::sync::atomic::AtomicBool,
    /// The progress count last seen: a read whose progress took anything in (the parts of
    /// a long message, which complete nothing yet) is not idle.
    activity: std::sync::atomic::AtomicU64,
    /// The last read found something: the next one only looks at the queue
    /// ([`Polls::after_find`]).
    found_last: std::sync::atomic::AtomicBool,
}

/// How long a read of an idle completion queue sleeps at most (then the application polls
/// again: a wake-up that went to another thread costs no more than this).
const NAP: std::time::Duration = std::time::Duration::from_millis(2);

/// How long a completion queue is polled without finding anything before its reads sleep:
/// `CLAN_FI_IDLE_US` (microseconds; `off`: never), default 1000 µs.
fn idle_after() -> Option<u64> {
    static IDLE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *IDLE.get_or_init(|| idle_from(std::env::var("CLAN_FI_IDLE_US").ok().as_deref()))
}

/// [`idle_after`] from the variable's value (in nanoseconds).
fn idle_from(v: Option<&str>) -> Option<u64> {
    match v.map(str::trim) {
        None | Some("") => Some(1_000_000),
        Some("off") => None,
        Some(us) => Some(us.parse::<u64>().map_or(1_000_000, |us| us.saturating_mul(1000))),
    }
}

/// Nanoseconds since the provider first looked (never 0).
fn clock() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64 + 1
}

impl Polls {
    const EVERY: u32 = 256;

    /// A read found nothing, its progress counting `activity` (see [`Polls::activity`]);
    /// `true` (only when the reader `may_sleep`): the queue has been idle for
    /// [`idle_after`], and the reader should sleep on it instead of polling on.
    fn empty(&self, may_sleep: bool, activity: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if self.activity.load(Relaxed) != activity {
            // (something was taken in: busy, not idle)
            self.activity.store(activity, Relaxed);
            self.busy();
            return false;
        }
        // (a load and a store, not an atomic add: a count lost to a racing poller only
        // moves the next yield, and a locked instruction in every poll costs more)
        if may_sleep && self.napping.load(Relaxed) {
            return true;
        }
        let n = self.n.load(Relaxed).wrapping_add(1);
        self.n.store(n, Relaxed);
        if n % Self::EVERY != 0 {
            return false;
        }
        let now = clock();
        match self.since.load(Relaxed) {
            0 => self.since.store(now, Relaxed),
            since => {
                if may_sleep && idle_after().is_some_and(|idle| now.saturating_sub(since) >= idle) {
                    self.napping.store(true, Relaxed);
                    return true;
                }
            }
        }
        std::thread::yield_now();
        false
    }

    /// Whether the read before this one found something (and forget it). Such a read takes
    /// what is queued without a pass over the receivers; the read after it makes one. A
    /// caller that reads until the queue is empty, as Open MPI's `mtl ofi` does after every
    /// completion it reads, would otherwise pay a whole pass (the lock, every receiver's
    /// ring, ~370 instructions) for nothing between a message's arrival and its
    /// `MPI_Recv`'s return: its sender was answered, or the read before took in all there
    /// was a moment ago. Progress is only put off, never lost: a caller that polls makes it
    /// at every other read at least, and one that sleeps makes it first (`fi_cq_sread`,
    /// `fi_trywait`, which look at every ring).
    #[inline]
    fn after_find(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        // (a load and a store: readers racing here at worst both pass, or both look)
        let was = self.found_last.load(Relaxed);
        if was {
            self.found_last.store(false, Relaxed);
        }
        was
    }

    /// A read found something.
    fn found(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.found_last.load(Relaxed) {
            self.found_last.store(true, Relaxed);
        }
        self.busy();
    }

    /// A read's progress took something in, though the read found nothing (the parts of
    /// a long message, or the message a read before completed straight to its caller):
    /// not idle. The next read makes its pass all the same: only a read that returned
    /// completions lets the one after it skip ([`Polls::after_find`]). A skip after mere
    /// activity could hide what came while the process was off its CPU: with two ranks on
    /// one CPU, Open MPI yields after every empty read, and such a skip cost each hop a
    /// round of yields (one way 6.2–6.8 µs against 3.6–4.1 µs).
    fn busy(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.n.load(Relaxed) != 0 {
            self.n.store(0, Relaxed);
        }
        if self.since.load(Relaxed) != 0 {
            self.since.store(0, Relaxed);
        }
        if self.napping.load(Relaxed) {
            self.napping.store(false, Relaxed);
        }
    }
}

/// Progress of the endpoints `eps` (addresses of `EpObj`s bound to a queue or counter; the
/// caller holds the list's lock, or the endpoint is a serial domain's [`CqObj::sole`]).
fn progress_eps(eps: &[usize], direct: &mut crate::cq::Direct) -> u64 {
    let mut activity = 0u64;
    for &ep in eps {
        // SAFETY: an endpoint removes itself from the lists it is on before it is freed, and
        // the caller holds the list's lock (so the endpoint is not freed while it runs), or
        // it is a serial domain's sole endpoint, which the application does not close while
        // it reads the queue (`CqObj::sole`).
        if let Some(ep) = unsafe { (ep as *const EpObj).as_ref() } {
            ep.progress_to(direct);
            activity = activity.wrapping_add(ep.rdm.activity());
        }
    }
    activity
}

/// Arm the receivers of the endpoints `eps` and look again: `true` when nothing has
/// arrived (sleeping on the domain's queue is safe). Every endpoint is armed, even after one
/// said no, so that a sleep of [`Sleeper::Ours`] ends on each with [`end_eps`].
fn prepare_eps(eps: &[usize], who: Sleeper) -> bool {
    eps.iter().fold(true, |idle, &ep| {
        // SAFETY: as in `progress_eps`.
        let this = unsafe { (ep as *const EpObj).as_ref() }.is_none_or(|ep| ep.rdm.prepare_wait(who));
        idle && this
    })
}

/// A sleep of [`Sleeper::Ours`] over the endpoints `eps` ended (or was not taken): the
/// last such sleeper of each disarms its receivers ([`crate::rdm::Rdm::end_wait`]). An
/// endpoint bound between the two calls is told of an end it did not see begin: a sleeper
/// of another queue on it may then lose its wake-up, and wake at the end of its nap
/// instead (100 ms at most); one unbound between them keeps its receivers armed (its
/// senders pay for it, nothing is lost).
fn end_eps(eps: &[usize]) {
    for &ep in eps {
        // SAFETY: as in `progress_eps`.
        if let Some(ep) = unsafe { (ep as *const EpObj).as_ref() } {
            ep.rdm.end_wait();
        }
    }
}

static CQ_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(cq_close),
    bind: Some(fi_no_bind),
    control: Some(cq_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static CQ_OPS: fi_ops_cq = fi_ops_cq {
    size: size_of::<fi_ops_cq>(),
    read: Some(cq_read),
    readfrom: Some(cq_readfrom),
    readerr: Some(cq_readerr),
    sread: Some(cq_sread),
    sreadfrom: Some(cq_sreadfrom),
    signal: Some(cq_signal),
    strerror: Some(cq_strerror),
};

/// How long a blocking read polls before it sleeps: [`clan::default_spin`] (`CLAN_SPIN_US`;
/// 0: sleep at once).
fn spin() -> std::time::Duration {
    clan::default_spin()
}

unsafe fn cq_of<'a>(cq: *mut fid_cq) -> Option<&'a CqObj> {
    // SAFETY: null, or the `fid_cq` at the start of a `CqObj` leaked by `cq_open`.
    unsafe { cq.cast::<CqObj>().as_ref() }
}

unsafe extern "C" fn cq_open(
    domain: *mut fid_domain,
    attr: *mut fi_cq_attr,
    out: *mut *mut fid_cq,
    context: *mut c_void,
) -> c_int {
    if domain.is_null() || attr.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null.
    let a = unsafe { &mut *attr };
    let format = match a.format {
        fi_cq_format_FI_CQ_FORMAT_UNSPEC => fi_cq_format_FI_CQ_FORMAT_CONTEXT,
        f @ (fi_cq_format_FI_CQ_FORMAT_CONTEXT
        | fi_cq_format_FI_CQ_FORMAT_MSG
        | fi_cq_format_FI_CQ_FORMAT_DATA
        | fi_cq_format_FI_CQ_FORMAT_TAGGED) => f,
        _ => return err(FI_ENOSYS),
    };
    let wait_fd = match a.wait_obj {
        fi_wait_obj_FI_WAIT_NONE | fi_wait_obj_FI_WAIT_UNSPEC | fi_wait_obj_FI_WAIT_YIELD => false,
        // (the descriptor is the domain's event queue's)
        fi_wait_obj_FI_WAIT_FD => true,
        _ => return err(FI_ENOSYS),
    };
    if a.flags & !(FI_AFFINITY as u64) != 0 && a.wait_cond != fi_cq_wait_cond_FI_CQ_COND_NONE {
        return err(FI_ENOSYS);
    }
    // SAFETY: checked non-null: the `fid_domain` at the start of a `Domain` of ours.
    let Some((queue, arms)) = (unsafe { (*domain.cast::<Domain>()).wait_queue() }) else { return err(FI_ENODEV) };
    let size = if a.size == 0 { 1024 } else { a.size };
    let cq = Box::new(CqObj {
        fid: fid_cq {
            fid: fid { fclass: FI_CLASS_CQ as usize, context, ops: (&raw const CQ_FI_OPS).cast_mut() },
            ops: (&raw const CQ_OPS).cast_mut(),
        },
        cq: crate::cq::Cq::new(size, Some(queue.clone())),
        format,
        eps: std::sync::Mutex::new(Vec::new()),
        queue,
        wait_fd,
        arms,
        polls: Polls::default(),
        // SAFETY: as above.
        serial: unsafe { (*domain.cast::<Domain>()).serial },
        sole: std::sync::atomic::AtomicUsize::new(0),
    });
    // SAFETY: checked non-null; lives until `cq_close`.
    unsafe { *out = &mut Box::leak(cq).fid };
    0
}

/// `FI_GETWAIT` (the descriptor, for a queue opened with `FI_WAIT_FD`) and
/// `FI_GETWAITOBJ`.
unsafe extern "C" fn cq_control(f: *mut fid, command: c_int, arg: *mut c_void) -> c_int {
    if f.is_null() || arg.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `CqObj`.
    let q = unsafe { &*f.cast::<CqObj>() };
    match command as u32 {
        FI_GETWAIT if q.wait_fd => {
            use std::os::fd::AsRawFd;
            // SAFETY: for FI_WAIT_FD the argument is the caller's `int`.
            unsafe { *arg.cast::<c_int>() = q.queue.as_raw_fd() };
            0
        }
        FI_GETWAIT => err(FI_ENODATA),
        FI_GETWAITOBJ => {
            let obj = if q.wait_fd { fi_wait_obj_FI_WAIT_FD } else { fi_wait_obj_FI_WAIT_NONE };
            // SAFETY: for FI_GETWAITOBJ the argument is the caller's `enum fi_wait_obj`.
            unsafe { *arg.cast::<fi_wait_obj>() = obj };
            0
        }
        _ => err(FI_ENOSYS),
    }
}

unsafe extern "C" fn cq_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of a `CqObj`.
    if unsafe { !(*f.cast::<CqObj>()).eps().is_empty() } {
        return err(FI_EBUSY);
    }
    // SAFETY: the `fid` at the start of a `CqObj` leaked by `cq_open`, closed once.
    drop(unsafe { Box::from_raw(f.cast::<CqObj>()) });
    0
}

/// Write entry `e` at index `i` of `buf`, in the queue's format.
unsafe fn write_entry(format: fi_cq_format, buf: *mut c_void, i: usize, e: &crate::cq::Entry) {
    let ctx = e.op_context as *mut c_void;
    // SAFETY: the caller's buffer holds more than `i` entries of its format.
    unsafe {
        match format {
            fi_cq_format_FI_CQ_FORMAT_MSG => buf.cast::<fi_cq_msg_entry>().add(i).write(fi_cq_msg_entry {
                op_context: ctx,
                flags: e.flags,
                len: e.len,
            }),
            fi_cq_format_FI_CQ_FORMAT_DATA => buf.cast::<fi_cq_data_entry>().add(i).write(fi_cq_data_entry {
                op_context: ctx,
                flags: e.flags,
                len: e.len,
                buf: e.buf as *mut c_void,
                data: e.data,
            }),
            fi_cq_format_FI_CQ_FORMAT_TAGGED => buf.cast::<fi_cq_tagged_entry>().add(i).write(fi_cq_tagged_entry {
                op_context: ctx,
                flags: e.flags,
                len: e.len,
                buf: e.buf as *mut c_void,
                data: e.data,
                tag: e.tag,
            }),
            _ => buf.cast::<fi_cq_entry>().add(i).write(fi_cq_entry { op_context: ctx }),
        }
    }
}

/// Read up to `count` completions of `q` into the caller's `buf`; how many, or the error.
unsafe fn read_entries(q: &CqObj, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: forwarded.
    unsafe { read_entries_from(q, buf, 0, count) }
}

/// [`read_entries`] into the caller's entries `first..first + count`.
unsafe fn read_entries_from(q: &CqObj, buf: *mut c_void, first: usize, count: usize) -> isize {
    // SAFETY: the caller's buffer of `first + count` entries; `read` hands out at most
    // `count`.
    match q.cq.read(count, |i, e| unsafe { write_entry(q.format, buf, first + i, e) }) {
        Ok(n) => n as isize,
        Err(e) => read_err(e),
    }
}

fn read_err(e: crate::cq::ReadError) -> isize {
    use crate::cq::ReadError;
    -(match e {
        ReadError::Again => FI_EAGAIN,
        ReadError::Avail => FI_EAVAIL,
        ReadError::Canceled => FI_ECANCELED,
    } as isize)
}

unsafe extern "C" fn cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: as `cq_of` requires.
    let Some(q) = (unsafe { cq_of(cq) }) else { return err(FI_EINVAL) as isize };
    if count > 0 && buf.is_null() {
        return err(FI_EINVAL) as isize;
    }
    if q.polls.after_find() {
        // Right after a read that found something: what is queued, without a pass over the
        // receivers (`Polls::after_find`).
        // SAFETY: the caller's buffer of `count` entries.
        let n = unsafe { read_entries(q, buf, count) };
        if n > 0 {
            q.polls.found();
        }
        return n;
    }
    // What this read's own progress lands for this queue comes straight here, not through
    // the queue (`cq::Direct`): the short path of every message a polling reader receives.
    let mut direct = crate::cq::Direct::to(&q.cq, count > 0);
    let activity = q.progress_to(&mut direct);
    if let Some(e) = direct.got() {
        // SAFETY: the caller's buffer of `count` ≥ 1 entries.
        unsafe { write_entry(q.format, buf, 0, e) };
        // Then what was queued (after it: it was made once the queue was empty), if there
        // is room; an error waiting there is reported by the next read.
        // SAFETY: the caller's entries `1..count`.
        let more = if count > 1 { unsafe { read_entries_from(q, buf, 1, count - 1) } } else { 0 };
        q.polls.found();
        return 1 + more.max(0);
    }
    // SAFETY: the caller's buffer of `count` entries.
    let mut n = unsafe { read_entries(q, buf, count) };
    if n == -(FI_EAGAIN as isize) {
        if !q.polls.empty(true, activity) {
            return n;
        }
        // Idle for long: sleep until something comes (or a nap passes), then look again.
        q.nap(NAP);
        q.progress();
        // SAFETY: as above.
        n = unsafe { read_entries(q, buf, count) };
        if n == -(FI_EAGAIN as isize) {
            return n;
        }
    }
    q.polls.found();
    n
}

unsafe extern "C" fn cq_readfrom(cq: *mut fid_cq, buf: *mut c_void, count: usize, src: *mut fi_addr_t) -> isize {
    // SAFETY: forwarded.
    let n = unsafe { cq_read(cq, buf, count) };
    if n > 0 && !src.is_null() {
        for i in 0..n as usize {
            // SAFETY: the caller's array of `count` ≥ n entries. (Source addresses come
            // with the endpoints.)
            unsafe { *src.add(i) = FI_ADDR_NOTAVAIL };
        }
    }
    n
}

unsafe extern "C" fn cq_sread(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    _cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: as `cq_of` requires.
    let Some(q) = (unsafe { cq_of(cq) }) else { return err(FI_EINVAL) as isize };
    if count > 0 && buf.is_null() {
        return err(FI_EINVAL) as isize;
    }
    let end = (timeout >= 0).then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout as u64));
    if let Err(e) = q.wait(end) {
        return read_err(e);
    }
    // SAFETY: the caller's buffer of `count` entries.
    unsafe { read_entries(q, buf, count) }
}

unsafe extern "C" fn cq_sreadfrom(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut fi_addr_t,
    cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: forwarded.
    let n = unsafe { cq_sread(cq, buf, count, cond, timeout) };
    if n > 0 && !src.is_null() {
        for i in 0..n as usize {
            // SAFETY: the caller's array of `count` ≥ n entries.
            unsafe { *src.add(i) = FI_ADDR_NOTAVAIL };
        }
    }
    n
}

unsafe extern "C" fn cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, _flags: u64) -> isize {
    // SAFETY: as `cq_of` requires.
    let Some(q) = (unsafe { cq_of(cq) }) else { return err(FI_EINVAL) as isize };
    if buf.is_null() {
        return err(FI_EINVAL) as isize;
    }
    let Some(e) = q.cq.readerr() else { return err(FI_EAGAIN) as isize };
    // SAFETY: the caller's entry (its err_data / err_data_size are the caller's to give: we
    // leave err_data alone and say we wrote none of it).
    unsafe {
        let b = &mut *buf;
        b.op_context = e.entry.op_context as *mut c_void;
        b.flags = e.entry.flags;
        b.len = e.entry.len;
        b.buf = e.entry.buf as *mut c_void;
        b.data = e.entry.data;
        b.tag = e.entry.tag;
        b.olen = e.olen;
        b.err = e.err;
        b.prov_errno = e.prov_errno;
        b.err_data_size = 0;
    }
    1
}

unsafe extern "C" fn cq_signal(cq: *mut fid_cq) -> c_int {
    // SAFETY: as `cq_of` requires.
    let Some(q) = (unsafe { cq_of(cq) }) else { return err(FI_EINVAL) };
    q.cq.signal();
    0
}

unsafe extern "C" fn cq_strerror(
    _cq: *mut fid_cq,
    prov_errno: c_int,
    _err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    let text = crate::cq::strerror(prov_errno);
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller's buffer of `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        return buf;
    }
    match prov_errno {
        crate::cq::prov::OVERRUN => c"the completion queue was full: completions were lost".as_ptr(),
        crate::cq::prov::PEER_GONE => c"the peer went away".as_ptr(),
        crate::cq::prov::TRUNCATED => c"the message was longer than the posted buffer".as_ptr(),
        _ => c"no provider error".as_ptr(),
    }
}

// ---- event queues ----------------------------------------------------------------------------

/// An event queue (`fid_eq` first).
#[repr(C)]
struct EqObj {
    fid: fid_eq,
    eq: crate::eq::Eq,
    /// Connected and passive endpoints bound to it: reading it makes their control
    /// progress.
    watched: std::sync::Mutex<Vec<Watched>>,
}

/// What an event queue makes progress for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// An `EpObj` (its address).
    Ep(usize),
    /// A `cm::PepObj` (its address).
    Pep(usize),
}

/// The event queue at `addr` (0: none).
fn eq_at<'a>(addr: usize) -> Option<&'a EqObj> {
    // SAFETY: 0, or the address of an `EqObj` bound to an object of ours, which stays open
    // while anything is bound to it (its close refuses, FI_EBUSY).
    unsafe { (addr as *const EqObj).as_ref() }
}

impl EqObj {
    fn watch(&self, w: Watched) {
        let mut v = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if !v.contains(&w) {
            v.push(w);
        }
    }

    /// Forget the object at `addr`.
    fn unwatch(&self, addr: usize) {
        self.watched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|w| !matches!(w, Watched::Ep(a) | Watched::Pep(a) if *a == addr));
    }

    /// Control progress of what is bound here.
    fn progress(&self) {
        let v = self.watched.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for w in v {
            match w {
                Watched::Ep(a) => {
                    // SAFETY: an endpoint removes itself from this list before it is freed.
                    if let Some(e) = unsafe { (a as *const EpObj).as_ref() } {
                        e.progress();
                    }
                }
                Watched::Pep(a) => {
                    // SAFETY: as above, for passive endpoints.
                    if let Some(p) = unsafe { (a as *const cm::PepObj).as_ref() } {
                        p.progress();
                    }
                }
            }
        }
    }
}

static EQ_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(eq_close),
    bind: Some(fi_no_bind),
    control: Some(fi_no_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

static EQ_OPS: fi_ops_eq = fi_ops_eq {
    size: size_of::<fi_ops_eq>(),
    read: Some(eq_read),
    readerr: Some(eq_readerr),
    write: Some(eq_write),
    sread: Some(eq_sread),
    strerror: Some(eq_strerror),
};

unsafe fn eq_of<'a>(eq: *mut fid_eq) -> Option<&'a EqObj> {
    // SAFETY: null, or the `fid_eq` at the start of an `EqObj` leaked by `eq_open`.
    unsafe { eq.cast::<EqObj>().as_ref() }
}

unsafe extern "C" fn eq_open(
    fabric: *mut fid_fabric,
    attr: *mut fi_eq_attr,
    out: *mut *mut fid_eq,
    context: *mut c_void,
) -> c_int {
    if fabric.is_null() || attr.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null.
    let a = unsafe { &*attr };
    match a.wait_obj {
        fi_wait_obj_FI_WAIT_NONE | fi_wait_obj_FI_WAIT_UNSPEC | fi_wait_obj_FI_WAIT_YIELD => {}
        _ => return err(FI_ENOSYS),
    }
    let eq = Box::new(EqObj {
        fid: fid_eq {
            fid: fid { fclass: FI_CLASS_EQ as usize, context, ops: (&raw const EQ_FI_OPS).cast_mut() },
            ops: (&raw const EQ_OPS).cast_mut(),
        },
        eq: crate::eq::Eq::new(if a.size == 0 { 1024 } else { a.size }),
        watched: std::sync::Mutex::new(Vec::new()),
    });
    // SAFETY: checked non-null; lives until `eq_close`.
    unsafe { *out = &mut Box::leak(eq).fid };
    0
}

unsafe extern "C" fn eq_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of an `EqObj`.
    if unsafe { !(*f.cast::<EqObj>()).watched.lock().unwrap_or_else(|p| p.into_inner()).is_empty() } {
        return err(FI_EBUSY);
    }
    // SAFETY: the `fid` at the start of an `EqObj` leaked by `eq_open`, closed once.
    drop(unsafe { Box::from_raw(f.cast::<EqObj>()) });
    0
}

fn eq_read_err(e: crate::eq::ReadError) -> isize {
    use crate::eq::ReadError;
    -(match e {
        ReadError::Again => FI_EAGAIN,
        ReadError::Avail => FI_EAVAIL,
        ReadError::TooSmall => FI_ETOOSMALL,
    } as isize)
}

/// Hand an event to the caller: its number and its bytes (the caller's buffer holds `len`).
unsafe fn eq_out(ev: (u32, Vec<u8>), event: *mut u32, buf: *mut c_void) -> isize {
    if !event.is_null() {
        // SAFETY: the caller's event slot.
        unsafe { *event = ev.0 };
    }
    if !buf.is_null() {
        // SAFETY: the caller's buffer, checked by the queue to be long enough.
        unsafe { std::ptr::copy_nonoverlapping(ev.1.as_ptr(), buf.cast::<u8>(), ev.1.len()) };
    }
    ev.1.len() as isize
}

unsafe extern "C" fn eq_read(eq: *mut fid_eq, event: *mut u32, buf: *mut c_void, len: usize, flags: u64) -> isize {
    // SAFETY: as `eq_of` requires.
    let Some(q) = (unsafe { eq_of(eq) }) else { return err(FI_EINVAL) as isize };
    let room = if buf.is_null() { 0 } else { len };
    q.progress();
    match q.eq.read(room, flags & (FI_PEEK as u64) != 0) {
        // SAFETY: the caller's slots.
        Ok(ev) => unsafe { eq_out(ev, event, buf) },
        Err(e) => eq_read_err(e),
    }
}

unsafe extern "C" fn eq_sread(
    eq: *mut fid_eq,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    timeout: c_int,
    flags: u64,
) -> isize {
    // SAFETY: as `eq_of` requires.
    let Some(q) = (unsafe { eq_of(eq) }) else { return err(FI_EINVAL) as isize };
    let room = if buf.is_null() { 0 } else { len };
    let end = (timeout >= 0).then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout as u64));
    loop {
        q.progress();
        // (in slices: what comes to the bound endpoints is seen by progress, not by the
        // queue's own wake-up)
        let slice = std::time::Duration::from_millis(2);
        let left = end.map_or(slice, |e| e.saturating_duration_since(std::time::Instant::now()).min(slice));
        match q.eq.sread(room, flags & (FI_PEEK as u64) != 0, Some(left)) {
            // SAFETY: the caller's slots.
            Ok(ev) => return unsafe { eq_out(ev, event, buf) },
            Err(crate::eq::ReadError::Again) if end.is_none_or(|e| std::time::Instant::now() < e) => {}
            Err(e) => return eq_read_err(e),
        }
    }
}

unsafe extern "C" fn eq_write(eq: *mut fid_eq, event: u32, buf: *const c_void, len: usize, _flags: u64) -> isize {
    // SAFETY: as `eq_of` requires.
    let Some(q) = (unsafe { eq_of(eq) }) else { return err(FI_EINVAL) as isize };
    if len > 0 && buf.is_null() {
        return err(FI_EINVAL) as isize;
    }
    let bytes = if len == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's `len` bytes.
        unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }
    };
    if q.eq.write(event, bytes) { len as isize } else { err(FI_EAGAIN) as isize }
}

unsafe extern "C" fn eq_readerr(eq: *mut fid_eq, buf: *mut fi_eq_err_entry, _flags: u64) -> isize {
    // SAFETY: as `eq_of` requires.
    let Some(q) = (unsafe { eq_of(eq) }) else { return err(FI_EINVAL) as isize };
    if buf.is_null() {
        return err(FI_EINVAL) as isize;
    }
    let Some(e) = q.eq.readerr() else { return err(FI_EAGAIN) as isize };
    // SAFETY: the caller's entry (its err_data is the caller's: we say we wrote none).
    unsafe {
        let b = &mut *buf;
        b.fid = e.fid as fid_t;
        b.context = e.context as *mut c_void;
        b.data = e.data;
        b.err = e.err;
        b.prov_errno = e.prov_errno;
        b.err_data_size = 0;
    }
    size_of::<fi_eq_err_entry>() as isize
}

unsafe extern "C" fn eq_strerror(
    eq: *mut fid_eq,
    prov_errno: c_int,
    err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    // (the same provider codes as the completion queues')
    // SAFETY: forwarded; the queue pointer is not used.
    unsafe { cq_strerror(eq.cast(), prov_errno, err_data, buf, len) }
}

// ---- endpoints -------------------------------------------------------------------------------

/// A reliable-datagram endpoint (`fid_ep` first).
#[repr(C)]
struct EpObj {
    fid: fid_ep,
    rdm: crate::rdm::Rdm,
    /// Receives honour their source address (`FI_DIRECTED_RECV` among the endpoint's caps).
    directed: bool,
    av: std::sync::atomic::AtomicUsize,
    tx_cq: std::sync::atomic::AtomicUsize,
    rx_cq: std::sync::atomic::AtomicUsize,
    /// Completion queues bound with `FI_SELECTIVE_COMPLETION`: only operations that ask
    /// (`FI_COMPLETION`) report success there.
    tx_selective: std::sync::atomic::AtomicBool,
    rx_selective: std::sync::atomic::AtomicBool,
    /// The default flags of operations given without flags (`tx_attr`/`rx_attr.op_flags`).
    tx_op_flags: u64,
    rx_op_flags: u64,
    /// Bound counters, by [`Count`].
    cntrs: [std::sync::atomic::AtomicUsize; 6],
    /// The domain (its address): which registrations peers may reach through us.
    domain: usize,
    /// Remote memory requests of ours not yet answered, by id.
    rma: std::sync::Mutex<std::collections::HashMap<u64, rma::Pending>>,
    /// How many there are (read without the lock by progress, which fails those of peers
    /// that went away).
    rma_count: std::sync::atomic::AtomicUsize,
    next_rma: std::sync::atomic::AtomicU64,
    /// A connected endpoint (`FI_EP_MSG`): its event queue, its peer, its state
    /// (`cm::CM_*`).
    msg: bool,
    eq: std::sync::atomic::AtomicUsize,
    peer: std::sync::Mutex<Option<crate::av::Addr>>,
    cm_state: std::sync::atomic::AtomicU8,
}

/// What a counter bound to an endpoint counts (the bind flags, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    Send = 0,
    Recv = 1,
    Read = 2,
    Write = 3,
    RemoteRead = 4,
    RemoteWrite = 5,
}

impl Count {
    const FLAGS: [(u32, Count); 6] = [
        (FI_SEND, Count::Send),
        (FI_RECV, Count::Recv),
        (FI_READ, Count::Read),
        (FI_WRITE, Count::Write),
        (FI_REMOTE_READ, Count::RemoteRead),
        (FI_REMOTE_WRITE, Count::RemoteWrite),
    ];
}

static EP_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(ep_close),
    bind: Some(ep_bind),
    control: Some(ep_control),
    ops_open: Some(fi_no_ops_open),
    tostr: None,
    ops_set: None,
};
static EP_OPS: fi_ops_ep = fi_ops_ep { cancel: Some(ep_cancel), ..stubs::EP_ENOSYS };
static CM_OPS: fi_ops_cm = fi_ops_cm {
    getname: Some(ep_getname),
    getpeer: Some(cm::getpeer),
    connect: Some(cm::connect),
    accept: Some(cm::accept),
    shutdown: Some(cm::shutdown),
    ..stubs::CM_ENOSYS
};
static MSG_OPS: fi_ops_msg = fi_ops_msg {
    recv: Some(msg_recv),
    recvmsg: Some(msg_recvmsg),
    send: Some(msg_send),
    sendmsg: Some(msg_sendmsg),
    inject: Some(msg_inject),
    senddata: Some(msg_senddata),
    injectdata: Some(msg_injectdata),
    ..stubs::MSG_ENOSYS
};
static TAGGED_OPS: fi_ops_tagged = fi_ops_tagged {
    recv: Some(tagged_recv),
    recvmsg: Some(tagged_recvmsg),
    send: Some(tagged_send),
    sendmsg: Some(tagged_sendmsg),
    inject: Some(tagged_inject),
    senddata: Some(tagged_senddata),
    injectdata: Some(tagged_injectdata),
    ..stubs::TAGGED_ENOSYS
};
static RMA_OPS: fi_ops_rma = rma::RMA_OPS;
static ATOMIC_OPS: fi_ops_atomic = stubs::ATOMIC_ENOSYS;
static COLLECTIVE_OPS: fi_ops_collective = stubs::COLLECTIVE_ENOSYS;

unsafe fn ep_of<'a>(ep: *mut fid_ep) -> Option<&'a EpObj> {
    // SAFETY: null, or the `fid_ep` at the start of an `EpObj` leaked by `ep_open`.
    unsafe { ep.cast::<EpObj>().as_ref() }
}

impl EpObj {
    fn cq(&self, which: &std::sync::atomic::AtomicUsize) -> Option<&CqObj> {
        // SAFETY: a bound queue stays open while we are bound (its close refuses, FI_EBUSY).
        unsafe { (which.load(std::sync::atomic::Ordering::Acquire) as *const CqObj).as_ref() }
    }

    fn cntr(&self, c: Count) -> Option<&CntrObj> {
        // SAFETY: a bound counter stays open while we are bound (its close refuses, FI_EBUSY).
        unsafe { (self.cntrs[c as usize].load(std::sync::atomic::Ordering::Acquire) as *const CntrObj).as_ref() }
    }

    fn dest(&self, a: fi_addr_t) -> Option<crate::av::Addr> {
        if self.msg {
            // (a connected endpoint sends to its peer, whatever address is named)
            if self.cm_state.load(std::sync::atomic::Ordering::Acquire) != cm::CM_CONNECTED {
                return None;
            }
            return *self.peer.lock().unwrap_or_else(|p| p.into_inner());
        }
        // SAFETY: the bound address vector stays open while the endpoint uses it (the
        // application's contract).
        let av = unsafe { (self.av.load(std::sync::atomic::Ordering::Acquire) as *const Av).as_ref() }?;
        av.table.lookup(a)
    }

    /// Whether an operation with `flags` (None: given without flags) reports its success in
    /// the transmit (or receive) completion queue.
    fn wants_completion(&self, rx: bool, flags: Option<u64>) -> bool {
        use std::sync::atomic::Ordering;
        let (selective, default) = if rx {
            (self.rx_selective.load(Ordering::Relaxed), self.rx_op_flags)
        } else {
            (self.tx_selective.load(Ordering::Relaxed), self.tx_op_flags)
        };
        !selective || flags.unwrap_or(default) & FI_COMPLETION as u64 != 0
    }

    /// An operation succeeded: its completion (if it asked for one) and its count.
    fn succeeded(&self, rx: bool, entry: crate::cq::Entry, completion: bool, count: Count) {
        if completion {
            if let Some(cq) = self.cq(if rx { &self.rx_cq } else { &self.tx_cq }) {
                cq.cq.push(entry);
            }
        }
        if let Some(c) = self.cntr(count) {
            c.cntr.add(1);
        }
    }

    /// An operation failed: its error completion (always) and its error count.
    fn failed(&self, rx: bool, e: crate::cq::ErrEntry, count: Count) {
        if let Some(cq) = self.cq(if rx { &self.rx_cq } else { &self.tx_cq }) {
            cq.cq.push_err(e);
        }
        if let Some(c) = self.cntr(count) {
            c.cntr.add_err(1);
        }
    }

    /// Take in arrivals and complete the receives they match; serve peers' remote memory
    /// requests; fail our requests to peers that went away.
    fn progress(&self) {
        self.progress_to(&mut crate::cq::Direct::none());
    }

    /// [`EpObj::progress`] for the reader of a completion queue (`direct`: what lands for
    /// it is handed to it, [`crate::cq::Direct`]).
    fn progress_to(&self, direct: &mut crate::cq::Direct) {
        for d in self.rdm.progress_to(direct) {
            self.deliver(d);
        }
        self.fail_gone_rma();
        if self.msg {
            self.watch_peer();
        }
    }

    fn deliver(&self, d: crate::rdm::Done) {
        let (p, a) = match d {
            crate::rdm::Done::Received(p, a) => (p, a),
            crate::rdm::Done::Failed(p) => {
                // A receive directed to a peer that went away.
                let flags = (FI_RECV as u64) | if p.tagged { FI_TAGGED as u64 } else { FI_MSG as u64 };
                let entry =
                    crate::cq::Entry { op_context: p.context, flags, buf: p.buf, tag: p.tag, ..Default::default() };
                let e = crate::cq::ErrEntry {
                    entry,
                    olen: 0,
                    err: FI_ECONNRESET as i32,
                    prov_errno: crate::cq::prov::PEER_GONE,
                };
                self.failed(true, e, Count::Recv);
                return;
            }
            crate::rdm::Done::Rma(req) => return self.serve(req),
            crate::rdm::Done::Reply(r) => return self.answered(r),
            crate::rdm::Done::Cm { from, kind, data } => return self.on_cm(from, kind, &data),
        };
        self.complete_recv(p, a.landed());
    }

    /// Copy arrival `a` into the buffer of receive `p`, and complete it.
    fn complete_recv(&self, p: crate::rdm::Posted, a: crate::rdm::Landed<'_>) {
        self.land_part(&p, 0, a.data);
        self.land_done(&p, a, a.data.len(), &mut crate::cq::Direct::none());
    }

    /// Copy bytes `at..at + data.len()` of a message into the buffer of receive `p` (what
    /// lies past its length is dropped). (Also called by the endpoint's `rdm` with its lock
    /// held, as the parts are taken in: nothing here calls back into it.)
    fn land_part(&self, p: &crate::rdm::Posted, at: usize, data: &[u8]) {
        let n = data.len().min(p.len.saturating_sub(at));
        if n > 0 {
            // SAFETY: the application posted `p.len` writable bytes at `p.buf`, valid until
            // this receive completes; `at + n <= p.len`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (p.buf as *mut u8).add(at), n) };
        }
    }

    /// Complete receive `p` with a message of `len` bytes whose header is `a` (its bytes are
    /// in place): truncated if `len` is over the receive's length. (Also called by `rdm`, as
    /// `land_part` is.) A success goes to `direct` if that reads the receive queue
    /// ([`crate::cq::Cq::push_to`]).
    fn land_done(&self, p: &crate::rdm::Posted, a: crate::rdm::Landed<'_>, len: usize, direct: &mut crate::cq::Direct) {
        let n = len.min(p.len);
        let mut flags = (FI_RECV as u64) | if a.tagged { FI_TAGGED as u64 } else { FI_MSG as u64 };
        if a.cq_data.is_some() {
            flags |= FI_REMOTE_CQ_DATA as u64;
        }
        let entry = crate::cq::Entry {
            op_context: p.context,
            flags,
            len: n,
            buf: p.buf,
            data: a.cq_data.unwrap_or(0),
            tag: a.tag,
        };
        if len > p.len {
            let olen = len - p.len;
            let e = crate::cq::ErrEntry { entry, olen, err: FI_ETRUNC as i32, prov_errno: crate::cq::prov::TRUNCATED };
            self.failed(true, e, Count::Recv);
        } else {
            if p.completion {
                if let Some(cq) = self.cq(&self.rx_cq) {
                    cq.cq.push_to(entry, direct);
                }
            }
            if let Some(c) = self.cntr(Count::Recv) {
                c.cntr.add(1);
            }
        }
    }

    fn post(&self, p: crate::rdm::Posted) -> isize {
        if let Some(d) = self.rdm.post(p) {
            self.deliver(d);
        }
        0
    }

    /// Send; `completion`: report success in the transmit queue (an inject never does; a
    /// failure always does, or, for an inject, is returned).
    fn send(
        &self,
        buf: *const c_void,
        len: usize,
        dest: fi_addr_t,
        tag: Option<u64>,
        data: Option<u64>,
        ctx: Option<*mut c_void>,
        completion: bool,
    ) -> isize {
        if len > 0 && buf.is_null() {
            return err(FI_EINVAL) as isize;
        }
        let Some(to) = self.dest(dest) else { return err(if self.msg { FI_ENOTCONN } else { FI_EINVAL }) as isize };
        let bytes = if len == 0 {
            &[][..]
        } else {
            // SAFETY: the application's `len` readable bytes.
            unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }
        };
        let flags = (FI_SEND as u64) | if tag.is_some() { FI_TAGGED as u64 } else { FI_MSG as u64 };
        let entry = crate::cq::Entry { op_context: ctx.map_or(0, |c| c as usize), flags, len, ..Default::default() };
        match self.rdm.send(to, bytes, tag.is_some(), tag.unwrap_or(0), data) {
            Ok(()) => self.succeeded(false, entry, completion && ctx.is_some(), Count::Send),
            Err(crate::rdm::Error::TooLong(_)) => return err(FI_EMSGSIZE) as isize,
            Err(crate::rdm::Error::PeerGone) => {
                // The peer went away: the send completes in error (an inject, which has no
                // completion, fails here).
                if ctx.is_none() {
                    return err(FI_ECONNRESET) as isize;
                }
                let e = crate::cq::ErrEntry {
                    entry,
                    olen: 0,
                    err: FI_ECONNRESET as i32,
                    prov_errno: crate::cq::prov::PEER_GONE,
                };
                self.failed(false, e, Count::Send);
                return 0;
            }
            Err(_) => return err(FI_EIO) as isize,
        }
        // (no progress here: what arrived is taken in by the application's next read of a
        // queue or counter, as manual progress asks, and straight into its entries; a send
        // that waits for room takes in meanwhile. Taking in after every send cost a pass over
        // the receivers, two locks and ~800 instructions, on the critical path of every
        // ping-pong, to find nothing: the answer had not come yet)
        0
    }
}

/// Where an endpoint's `rdm` lands the messages that match posted receives: the endpoint
/// (its address), which copies them into the receives' buffers.
struct LandIn(usize);

impl LandIn {
    fn ep(&self) -> &EpObj {
        // SAFETY: a `LandIn` lives in its endpoint's own `rdm`, which calls it only from its
        // methods, called through the endpoint: the endpoint is alive.
        unsafe { &*(self.0 as *const EpObj) }
    }
}

impl crate::rdm::Land for LandIn {
    fn part(&self, p: &crate::rdm::Posted, at: usize, data: &[u8]) {
        self.ep().land_part(p, at, data);
    }

    fn part_from(&self, p: &crate::rdm::Posted, at: usize, src: &clan_proto::InPlace<'_>, from: u64, len: usize) {
        let n = len.min(p.len.saturating_sub(at));
        if n > 0 {
            // SAFETY: the application posted `p.len` writable bytes at `p.buf`, valid until
            // this receive completes, and lends them to nothing else meanwhile; `at + n <=
            // p.len`. (The copy from the ring is `InPlace::read`'s, bounds-checked.)
            let dst = unsafe { std::slice::from_raw_parts_mut((p.buf as *mut u8).add(at), n) };
            let _ = src.read(from, dst);
        }
    }

    fn done(&self, p: &crate::rdm::Posted, m: crate::rdm::Landed<'_>, len: usize, direct: &mut crate::cq::Direct) {
        self.ep().land_done(p, m, len, direct);
    }
}

unsafe extern "C" fn ep_open(
    domain: *mut fid_domain,
    info: *mut fi_info,
    out: *mut *mut fid_ep,
    context: *mut c_void,
) -> c_int {
    if domain.is_null() || info.is_null() || out.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null; an fi_info's attribute pointers are null or valid.
    let msg = match unsafe { (*info).ep_attr.as_ref() }.map_or(fi_ep_type_FI_EP_RDM, |a| a.type_) {
        fi_ep_type_FI_EP_RDM | fi_ep_type_FI_EP_UNSPEC => false,
        fi_ep_type_FI_EP_MSG => true,
        _ => return err(FI_EINVAL),
    };
    // The endpoint that takes a connection request (`fi_info::handle` of `FI_CONNREQ`).
    // SAFETY: checked non-null.
    let peer = if msg { unsafe { cm::take_handle(info) } } else { None };
    // SAFETY: as above.
    if msg && peer.is_none() && unsafe { !(*info).handle.is_null() } {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null above.
    let caps = unsafe { (*info).caps | (*info).rx_attr.as_ref().map_or(0, |r| r.caps) };
    // SAFETY: as above.
    let (tx_op_flags, rx_op_flags) = unsafe {
        ((*info).tx_attr.as_ref().map_or(0, |a| a.op_flags), (*info).rx_attr.as_ref().map_or(0, |a| a.op_flags))
    };
    let directed = caps & FI_DIRECTED_RECV as u64 != 0;
    // SAFETY: checked non-null: the `fid_domain` at the start of a `Domain` of ours.
    let queue = unsafe { &(*domain.cast::<Domain>()).queue };
    let rdm = match crate::rdm::Rdm::open(queue) {
        Ok(r) => r,
        Err(_) => return err(FI_ENODEV),
    };
    let ep = Box::new(EpObj {
        fid: fid_ep {
            fid: fid { fclass: FI_CLASS_EP as usize, context, ops: (&raw const EP_FI_OPS).cast_mut() },
            ops: (&raw const EP_OPS).cast_mut(),
            cm: (&raw const CM_OPS).cast_mut(),
            msg: (&raw const MSG_OPS).cast_mut(),
            rma: (&raw const RMA_OPS).cast_mut(),
            tagged: (&raw const TAGGED_OPS).cast_mut(),
            atomic: (&raw const ATOMIC_OPS).cast_mut(),
            collective: (&raw const COLLECTIVE_OPS).cast_mut(),
        },
        rdm,
        directed,
        av: std::sync::atomic::AtomicUsize::new(0),
        tx_cq: std::sync::atomic::AtomicUsize::new(0),
        rx_cq: std::sync::atomic::AtomicUsize::new(0),
        tx_selective: std::sync::atomic::AtomicBool::new(false),
        rx_selective: std::sync::atomic::AtomicBool::new(false),
        tx_op_flags,
        rx_op_flags,
        cntrs: Default::default(),
        domain: domain as usize,
        rma: Default::default(),
        rma_count: Default::default(),
        next_rma: std::sync::atomic::AtomicU64::new(1),
        msg,
        eq: std::sync::atomic::AtomicUsize::new(0),
        peer: std::sync::Mutex::new(peer),
        cm_state: std::sync::atomic::AtomicU8::new(cm::CM_IDLE),
    });
    let ep = Box::leak(ep);
    ep.rdm.set_land(Box::new(LandIn(ep as *const EpObj as usize)));
    // SAFETY: checked non-null: the `fid_domain` at the start of a `Domain` of ours, which
    // outlives its endpoints (its close refuses while the progress thread has any).
    if let Some(a) = unsafe { (*domain.cast::<Domain>()).auto.as_ref() } {
        a.add(ep as *const EpObj as usize);
    }
    // SAFETY: checked non-null; lives until `ep_close`.
    unsafe { *out = &mut ep.fid };
    0
}

unsafe extern "C" fn ep_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    let me = f as usize;
    // SAFETY: the `fid` at the start of an `EpObj` leaked by `ep_open`.
    let ep = unsafe { Box::from_raw(f.cast::<EpObj>()) };
    for q in [&ep.tx_cq, &ep.rx_cq] {
        if let Some(cq) = ep.cq(q) {
            let mut eps = cq.eps.lock().unwrap_or_else(|p| p.into_inner());
            eps.retain(|e| *e != me);
            cq.note_eps(&eps);
        }
    }
    for (_, c) in Count::FLAGS {
        if let Some(c) = ep.cntr(c) {
            c.eps.lock().unwrap_or_else(|p| p.into_inner()).retain(|e| *e != me);
        }
    }
    if let Some(eq) = eq_at(ep.eq.load(std::sync::atomic::Ordering::Acquire)) {
        eq.unwatch(me);
    }
    // SAFETY: the endpoint's domain, open while it is (see `ep_open`).
    if let Some(a) = unsafe { (ep.domain as *const Domain).as_ref() }.and_then(|d| d.auto.as_ref()) {
        // (waits for the progress thread to be done with it)
        a.remove(me);
    }
    drop(ep);
    0
}

unsafe extern "C" fn ep_bind(f: *mut fid, bfid: *mut fid, flags: u64) -> c_int {
    if f.is_null() || bfid.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of an `EpObj`; `bfid` is an object of ours (its class
    // says which).
    let (ep, class) = unsafe { (&*f.cast::<EpObj>(), (*bfid).fclass as u32) };
    use std::sync::atomic::Ordering;
    match class {
        FI_CLASS_AV => ep.av.store(bfid as usize, Ordering::Release),
        FI_CLASS_CQ => {
            let known = (FI_TRANSMIT | FI_RECV) as u64 | FI_SELECTIVE_COMPLETION as u64;
            if flags & !known != 0 || flags & ((FI_TRANSMIT | FI_RECV) as u64) == 0 {
                return err(FI_EINVAL);
            }
            // SAFETY: a CQ of ours.
            let cq = unsafe { &*bfid.cast::<CqObj>() };
            let mut eps = cq.eps.lock().unwrap_or_else(|p| p.into_inner());
            if !eps.contains(&(f as usize)) {
                eps.push(f as usize);
            }
            cq.note_eps(&eps);
            let selective = flags & FI_SELECTIVE_COMPLETION as u64 != 0;
            if flags & FI_TRANSMIT as u64 != 0 {
                ep.tx_selective.store(selective, Ordering::Relaxed);
                ep.tx_cq.store(bfid as usize, Ordering::Release);
            }
            if flags & FI_RECV as u64 != 0 {
                ep.rx_selective.store(selective, Ordering::Relaxed);
                ep.rx_cq.store(bfid as usize, Ordering::Release);
            }
        }
        FI_CLASS_CNTR => {
            let known: u64 = Count::FLAGS.iter().map(|(f, _)| *f as u64).sum();
            if flags & !known != 0 || flags == 0 {
                return err(FI_EINVAL);
            }
            // SAFETY: a counter of ours.
            let c = unsafe { &*bfid.cast::<CntrObj>() };
            let mut eps = c.eps.lock().unwrap_or_else(|p| p.into_inner());
            if !eps.contains(&(f as usize)) {
                eps.push(f as usize);
            }
            for (flag, which) in Count::FLAGS {
                if flags & flag as u64 != 0 {
                    ep.cntrs[which as usize].store(bfid as usize, Ordering::Release);
                }
            }
        }
        FI_CLASS_EQ if ep.msg => {
            ep.eq.store(bfid as usize, Ordering::Release);
            if let Some(eq) = eq_at(bfid as usize) {
                eq.watch(Watched::Ep(f as usize));
            }
        }
        FI_CLASS_EQ => return err(FI_ENOSYS),
        _ => return err(FI_EINVAL),
    }
    0
}

unsafe extern "C" fn ep_control(f: *mut fid, command: c_int, _arg: *mut c_void) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of an `EpObj`.
    let ep = unsafe { &*f.cast::<EpObj>() };
    match command as u32 {
        FI_ENABLE => {
            use std::sync::atomic::Ordering;
            if (if ep.msg { ep.eq.load(Ordering::Acquire) } else { ep.av.load(Ordering::Acquire) }) == 0
                || ep.tx_cq.load(Ordering::Acquire) == 0
                || ep.rx_cq.load(Ordering::Acquire) == 0
            {
                // (FI_ENOAV / FI_ENOCQ in libfabric's terms)
                return err(FI_ENOCQ);
            }
            0
        }
        _ => err(FI_ENOSYS),
    }
}

unsafe extern "C" fn ep_cancel(f: fid_t, context: *mut c_void) -> isize {
    if f.is_null() {
        return err(FI_EINVAL) as isize;
    }
    // SAFETY: the `fid` at the start of an `EpObj`.
    let ep = unsafe { &*f.cast::<EpObj>() };
    match ep.rdm.cancel(context as usize) {
        Some(p) => {
            if let Some(cq) = ep.cq(&ep.rx_cq) {
                cq.cq.push_err(crate::cq::ErrEntry {
                    entry: crate::cq::Entry { op_context: p.context, flags: FI_RECV as u64, ..Default::default() },
                    olen: 0,
                    err: FI_ECANCELED as i32,
                    prov_errno: 0,
                });
            }
            0
        }
        None => err(FI_ENOENT) as isize,
    }
}

unsafe extern "C" fn ep_getname(f: fid_t, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    if f.is_null() || addrlen.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: an object of ours (its class says which): the `fid` at the start of an
    // `EpObj` or a `PepObj`; the caller's length slot.
    let (me, room) = unsafe {
        match (*f).fclass as u32 {
            FI_CLASS_EP => ((*f.cast::<EpObj>()).rdm.addr(), *addrlen),
            FI_CLASS_PEP => ((*f.cast::<cm::PepObj>()).addr(), *addrlen),
            _ => return err(FI_EINVAL),
        }
    };
    // SAFETY: as above.
    unsafe { *addrlen = crate::av::ADDR_LEN };
    if room < crate::av::ADDR_LEN || addr.is_null() {
        return err(FI_ETOOSMALL);
    }
    // SAFETY: the caller's buffer of `room` ≥ ADDR_LEN bytes.
    unsafe { std::ptr::copy_nonoverlapping(me.bytes().as_ptr(), addr.cast::<u8>(), crate::av::ADDR_LEN) };
    0
}

fn posted(
    buf: *mut c_void,
    len: usize,
    context: *mut c_void,
    tag: Option<(u64, u64)>,
    from: Option<crate::av::Addr>,
    completion: bool,
) -> crate::rdm::Posted {
    crate::rdm::Posted {
        buf: buf as usize,
        len: if buf.is_null() { 0 } else { len },
        context: context as usize,
        tagged: tag.is_some(),
        tag: tag.map_or(0, |t| t.0),
        ignore: tag.map_or(0, |t| t.1),
        from,
        completion,
    }
}

/// The source a receive is directed to (FI_ADDR_UNSPEC: any).
fn source(ep: &EpObj, src: fi_addr_t) -> Result<Option<crate::av::Addr>, isize> {
    if src == FI_ADDR_UNSPEC || !ep.directed || ep.msg {
        return Ok(None);
    }
    ep.dest(src).map(Some).ok_or(err(FI_EINVAL) as isize)
}

unsafe extern "C" fn msg_recv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    match source(ep, src) {
        Ok(from) => ep.post(posted(buf, len, ctx, None, from, ep.wants_completion(true, None))),
        Err(e) => e,
    }
}

unsafe extern "C" fn msg_recvmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's iovecs.
    let (buf, len) = match unsafe { one_iov(m.msg_iov, m.iov_count) } {
        Ok(b) => b,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    match source(ep, m.addr) {
        Ok(from) => ep.post(posted(buf, len, m.context, None, from, ep.wants_completion(true, Some(flags)))),
        Err(e) => e,
    }
}

unsafe extern "C" fn msg_send(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, None, None, Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn msg_sendmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's iovecs.
    let (buf, len) = match unsafe { one_iov(m.msg_iov, m.iov_count) } {
        Ok(b) => b,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    let data = (flags & FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data);
    let ctx = (flags & FI_INJECT as u64 == 0).then_some(m.context);
    ep.send(buf, len, m.addr, None, data, ctx, ep.wants_completion(false, Some(flags)))
}

unsafe extern "C" fn msg_inject(ep: *mut fid_ep, buf: *const c_void, len: usize, dest: fi_addr_t) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, None, None, None, false)
}

unsafe extern "C" fn msg_senddata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, None, Some(data), Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn msg_injectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi_addr_t,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, None, Some(data), None, false)
}

unsafe extern "C" fn tagged_recv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi_addr_t,
    tag: u64,
    ignore: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    match source(ep, src) {
        Ok(from) => ep.post(posted(buf, len, ctx, Some((tag, ignore)), from, ep.wants_completion(true, None))),
        Err(e) => e,
    }
}

unsafe extern "C" fn tagged_send(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi_addr_t,
    tag: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, Some(tag), None, Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn tagged_inject(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi_addr_t,
    tag: u64,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, Some(tag), None, None, false)
}

unsafe extern "C" fn tagged_senddata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi_addr_t,
    tag: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, Some(tag), Some(data), Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn tagged_injectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi_addr_t,
    tag: u64,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.send(buf, len, dest, Some(tag), Some(data), None, false)
}

/// The one buffer of a message's iovecs (more than one is not offered: `iov_limit` is 1).
unsafe fn one_iov(iov: *const iovec, count: usize) -> Result<(*mut c_void, usize), isize> {
    match count {
        0 => Ok((std::ptr::null_mut(), 0)),
        // SAFETY: the caller's iovec.
        1 if !iov.is_null() => Ok(unsafe { ((*iov).iov_base, (*iov).iov_len) }),
        _ => Err(err(FI_EINVAL) as isize),
    }
}

/// A tagged receive with flags; also a peek (`FI_PEEK`: is a matching message there? its
/// answer is a completion with the message's length and tag, or an error completion
/// `FI_ENOMSG`), which may claim the message (`FI_CLAIM`: a later receive with `FI_CLAIM`
/// and the same context takes it) or discard it (`FI_DISCARD`).
unsafe extern "C" fn tagged_recvmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's iovecs.
    let (buf, len) = match unsafe { one_iov(m.msg_iov, m.iov_count) } {
        Ok(b) => b,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    let from = match source(ep, m.addr) {
        Ok(f) => f,
        Err(e) => return e,
    };
    let p = posted(buf, len, m.context, Some((m.tag, m.ignore)), from, ep.wants_completion(true, Some(flags)));
    let (peek, claim, discard) = (flags & FI_PEEK as u64 != 0, flags & FI_CLAIM != 0, flags & FI_DISCARD != 0);
    let flags_of = |cq_data: bool| (FI_RECV | FI_TAGGED) as u64 | if cq_data { FI_REMOTE_CQ_DATA as u64 } else { 0 };
    if peek {
        ep.progress();
        let entry =
            crate::cq::Entry { op_context: p.context, flags: flags_of(false), tag: m.tag, ..Default::default() };
        match ep.rdm.peek(&p, claim || discard) {
            Some(found) => {
                if discard {
                    drop(ep.rdm.claimed(p.context));
                }
                let entry = crate::cq::Entry {
                    flags: flags_of(found.cq_data.is_some()),
                    len: found.len,
                    data: found.cq_data.unwrap_or(0),
                    tag: found.tag,
                    ..entry
                };
                if let Some(cq) = ep.cq(&ep.rx_cq) {
                    cq.cq.push(entry);
                }
            }
            None => {
                if let Some(cq) = ep.cq(&ep.rx_cq) {
                    cq.cq.push_err(crate::cq::ErrEntry { entry, olen: 0, err: FI_ENOMSG as i32, prov_errno: 0 });
                }
            }
        }
        return 0;
    }
    if claim {
        // Only a message a peek claimed under this context.
        let Some(a) = ep.rdm.claimed(p.context) else { return err(FI_EINVAL) as isize };
        if discard {
            let entry =
                crate::cq::Entry { op_context: p.context, flags: flags_of(false), tag: a.tag, ..Default::default() };
            ep.succeeded(true, entry, true, Count::Recv);
        } else {
            ep.complete_recv(p, a.landed());
        }
        return 0;
    }
    ep.post(p)
}

unsafe extern "C" fn tagged_sendmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's iovecs.
    let (buf, len) = match unsafe { one_iov(m.msg_iov, m.iov_count) } {
        Ok(b) => b,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    let data = (flags & FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data);
    // (FI_INJECT: no completion; a send completes when it returns, whatever was asked)
    let ctx = (flags & FI_INJECT as u64 == 0).then_some(m.context);
    ep.send(buf, len, m.addr, Some(m.tag), data, ctx, ep.wants_completion(false, Some(flags)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_from_the_environment() {
        assert_eq!(idle_from(None), Some(1_000_000), "1 ms by default");
        assert_eq!(idle_from(Some("250")), Some(250_000));
        assert_eq!(idle_from(Some(" off ")), None, "never");
        assert_eq!(idle_from(Some("soon")), Some(1_000_000), "garbage: the default");
    }

    #[test]
    fn polls_yield_then_nap_once_idle_and_stop_at_a_find() {
        // (the process's idle time is 1 ms unless CLAN_FI_IDLE_US says otherwise)
        let Some(idle) = idle_after() else { return };
        let p = Polls::default();
        let counter_never = Polls::default();
        let start = std::time::Instant::now();
        let mut napped = false;
        while start.elapsed() < std::time::Duration::from_secs(10) && !napped {
            napped = p.empty(true, 7);
            assert!(!counter_never.empty(false, 0), "a counter's reads never nap");
        }
        assert!(napped, "idle for {idle} ns, yet no nap");
        assert!(start.elapsed().as_nanos() as u64 >= idle, "napped before the idle time");
        assert!(p.empty(true, 7), "idle: every empty read naps");
        p.found();
        assert!(!p.empty(true, 7), "a read that found something ends the naps");
        while !p.empty(true, 7) {}
        assert!(!p.empty(true, 8), "progress taking anything in ends the naps");
        assert!(!p.empty(true, 8), "and starts the idle time again");
    }

    #[test]
    fn only_the_read_right_after_a_find_skips_the_pass() {
        let p = Polls::default();
        assert!(!p.after_find(), "a first read makes its pass");
        p.found();
        assert!(p.after_find(), "the read after a find skips it");
        assert!(!p.after_find(), "the read after that makes it");
        p.found();
        p.found();
        assert!(p.after_find() && !p.after_find(), "one skip however many finds");
        // Activity without a find (what the last read's progress took in) is not a find.
        assert!(!p.empty(true, 7), "activity: busy");
        assert!(!p.after_find(), "the read after mere activity makes its pass");
    }
}
