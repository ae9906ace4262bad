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

use std::cell::UnsafeCell;
use std::ffi::{CStr, c_char, c_int, c_void};

use sys::*;

use crate::offer::{self, EpType, Hints};

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
    _flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> c_int {
    if info.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: `info` is a valid out-pointer (checked non-null).
    unsafe { *info = std::ptr::null_mut() };
    if version > API_VERSION && version >> 16 != API_VERSION >> 16 {
        return err(FI_ENODATA);
    }
    // SAFETY: null or valid hints.
    let h = unsafe { hints_of(hints) };
    let offers = offer::matching(&h);
    if offers.is_empty() {
        return err(FI_ENODATA);
    }
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
        unsafe { fill(&mut *i, o) };
        // SAFETY: as above.
        unsafe { (*i).next = head };
        head = i;
    }
    // SAFETY: checked non-null above.
    unsafe { *info = head };
    0
}

/// Fill a fresh `fi_info` (from `fi_dupinfo(NULL)`) for `o`.
unsafe fn fill(i: &mut fi_info, o: &offer::Offer) {
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
    tx.iov_limit = 4;
    tx.rma_iov_limit = 1;
    rx.caps = o.caps;
    rx.msg_order = tx.msg_order;
    rx.size = 1024;
    rx.iov_limit = 4;
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
    dom.threading = fi_threading_FI_THREAD_SAFE;
    dom.control_progress = fi_progress_FI_PROGRESS_AUTO;
    dom.data_progress = fi_progress_FI_PROGRESS_AUTO;
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
    domain: Some(no_domain),
    passive_ep: Some(no_passive_ep),
    eq_open: Some(no_eq_open),
    wait_open: Some(no_wait_open),
    trywait: Some(no_trywait),
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
unsafe extern "C" fn no_domain(_: *mut fid_fabric, _: *mut fi_info, _: *mut *mut fid_domain, _: *mut c_void) -> c_int {
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
unsafe extern "C" fn no_passive_ep(_: *mut fid_fabric, _: *mut fi_info, _: *mut *mut fid_pep, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_eq_open(_: *mut fid_fabric, _: *mut fi_eq_attr, _: *mut *mut fid_eq, _: *mut c_void) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_wait_open(_: *mut fid_fabric, _: *mut fi_wait_attr, _: *mut *mut fid_wait) -> c_int {
    err(FI_ENOSYS)
}
unsafe extern "C" fn no_trywait(_: *mut fid_fabric, _: *mut *mut fid, _: c_int) -> c_int {
    err(FI_ENOSYS)
}
