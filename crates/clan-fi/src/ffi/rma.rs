//! Memory registration and remote memory access at the boundary.
//!
//! `fi_mr_reg` records a range of the application's memory in [`crate::mr::Registry`] under
//! an unguessable key (`fi_mr_key`; `FI_MR_PROV_KEY | FI_MR_VIRT_ADDR`: peers address it by
//! its virtual address). `fi_write`/`fi_read` (and `writedata`, `inject_write`, the `v` and
//! `msg` forms with one iovec) become requests on the endpoint's queue to the target
//! ([`crate::rdm::Rdm::write`]); the target's provider checks each against its registrations
//! ([`EpObj::serve`]) and answers, and the answer completes the operation here: success in
//! the transmit queue and the `FI_WRITE`/`FI_READ` counter, or an error completion saying
//! why (a rejected key, a range outside the registration, no rights, the peer gone). The
//! target's `FI_REMOTE_WRITE`/`FI_REMOTE_READ` counters count what it served; a write with
//! remote CQ data also completes in the target's receive queue. Like messages, requests are
//! served when the target makes progress (reads its queues or counters).

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use super::sys::*;
use super::{Count, EpObj, ep_of, err, one_iov};
use crate::rdm::{RmaKind, RmaReply, RmaRequest, RmaStatus};

/// A registration (`fid_mr` first).
#[repr(C)]
struct MrObj {
    fid: fid_mr,
}

static MR_FI_OPS: fi_ops = fi_ops {
    size: size_of::<fi_ops>(),
    close: Some(mr_close),
    bind: Some(super::fi_no_bind),
    control: Some(super::fi_no_control),
    ops_open: Some(super::fi_no_ops_open),
    tostr: None,
    ops_set: None,
};

pub(super) static RMA_OPS: fi_ops_rma = fi_ops_rma {
    size: size_of::<fi_ops_rma>(),
    read: Some(rma_read),
    readv: Some(rma_readv),
    readmsg: Some(rma_readmsg),
    write: Some(rma_write),
    writev: Some(rma_writev),
    writemsg: Some(rma_writemsg),
    inject: Some(rma_inject),
    writedata: Some(rma_writedata),
    injectdata: Some(rma_injectdata),
};

/// Register `len` bytes at `buf` in domain `dom` (the checks of every `mr_reg*` form).
unsafe fn register(
    dom: *mut fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    flags: u64,
    out: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    if dom.is_null() || out.is_null() || (buf.is_null() && len > 0) || flags != 0 {
        return err(FI_EINVAL);
    }
    // SAFETY: checked non-null; an object of ours (its class says which).
    if unsafe { (*dom).fclass } as u32 != FI_CLASS_DOMAIN {
        return err(FI_EINVAL);
    }
    let base = buf as u64;
    if base.checked_add(len as u64).is_none() {
        return err(FI_EINVAL);
    }
    let rights = crate::mr::Rights {
        remote_read: access & FI_REMOTE_READ as u64 != 0,
        remote_write: access & FI_REMOTE_WRITE as u64 != 0,
    };
    let key =
        crate::mr::Registry::get().register(crate::mr::Region { base, len: len as u64, rights, domain: dom as usize });
    let mr = Box::new(MrObj {
        fid: fid_mr {
            fid: fid { fclass: FI_CLASS_MR as usize, context, ops: (&raw const MR_FI_OPS).cast_mut() },
            // (local buffers need no descriptor: FI_MR_LOCAL is not asked)
            mem_desc: std::ptr::null_mut(),
            key,
        },
    });
    // SAFETY: checked non-null; lives until `mr_close`.
    unsafe { *out = &mut Box::leak(mr).fid };
    0
}

pub(super) unsafe extern "C" fn mr_reg(
    dom: *mut fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    _offset: u64,
    _requested_key: u64,
    flags: u64,
    out: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { register(dom, buf, len, access, flags, out, context) }
}

pub(super) unsafe extern "C" fn mr_regv(
    dom: *mut fid,
    iov: *const iovec,
    count: usize,
    access: u64,
    _offset: u64,
    _requested_key: u64,
    flags: u64,
    out: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller's iovecs (one at most: `mr_iov_limit` is 1).
    match unsafe { one_iov(iov, count) } {
        // SAFETY: forwarded.
        Ok((buf, len)) => unsafe { register(dom, buf, len, access, flags, out, context) },
        Err(_) => err(FI_EINVAL),
    }
}

pub(super) unsafe extern "C" fn mr_regattr(
    dom: *mut fid,
    attr: *const fi_mr_attr,
    flags: u64,
    out: *mut *mut fid_mr,
) -> c_int {
    // SAFETY: null or the caller's attributes.
    let Some(a) = (unsafe { attr.as_ref() }) else { return err(FI_EINVAL) };
    if a.iface != fi_hmem_iface_FI_HMEM_SYSTEM {
        return err(FI_ENOSYS);
    }
    // SAFETY: forwarded.
    unsafe { mr_regv(dom, a.mr_iov, a.iov_count, a.access, a.offset, a.requested_key, flags, out, a.context) }
}

unsafe extern "C" fn mr_close(f: *mut fid) -> c_int {
    if f.is_null() {
        return err(FI_EINVAL);
    }
    // SAFETY: the `fid` at the start of an `MrObj` leaked by `register`, closed once.
    let mr = unsafe { Box::from_raw(f.cast::<MrObj>()) };
    // (waits for a copy into it in progress: after this, peers reach none of it)
    crate::mr::Registry::get().deregister(mr.fid.key);
    0
}

/// One of our requests waiting for its answer.
#[derive(Debug)]
pub(super) struct Pending {
    context: usize,
    to: crate::av::Addr,
    /// A read's local buffer (the application's until the read completes).
    read_into: Option<usize>,
    len: usize,
    completion: bool,
}

impl Pending {
    fn entry(&self) -> crate::cq::Entry {
        let kind = if self.read_into.is_some() { FI_READ } else { FI_WRITE };
        crate::cq::Entry {
            op_context: self.context,
            flags: (FI_RMA | kind) as u64,
            len: self.len,
            ..Default::default()
        }
    }

    fn count(&self) -> Count {
        if self.read_into.is_some() { Count::Read } else { Count::Write }
    }
}

/// The error completion of a request that ended with `status`.
fn error_of(status: RmaStatus) -> (u32, i32) {
    use crate::cq::prov;
    match status {
        RmaStatus::NoKey => (FI_EKEYREJECTED, prov::RMA_NO_KEY),
        RmaStatus::OutOfRange => (FI_EINVAL, prov::RMA_RANGE),
        RmaStatus::NoRights => (FI_EACCES, prov::RMA_RIGHTS),
        RmaStatus::Malformed | RmaStatus::Done => (FI_EIO, prov::RMA_MALFORMED),
    }
}

impl EpObj {
    /// Start a remote write (`read_into` None) or read of `len` bytes at `buf`.
    #[allow(clippy::too_many_arguments)]
    fn rma(
        &self,
        buf: *const c_void,
        len: usize,
        read_into: bool,
        dest: fi_addr_t,
        addr: u64,
        key: u64,
        data: Option<u64>,
        ctx: Option<*mut c_void>,
        completion: bool,
    ) -> isize {
        if len > 0 && buf.is_null() {
            return err(FI_EINVAL) as isize;
        }
        if len > crate::rdm::MAX_MSG {
            return err(FI_EMSGSIZE) as isize;
        }
        let Some(to) = self.dest(dest) else { return err(if self.msg { FI_ENOTCONN } else { FI_EINVAL }) as isize };
        let id = self.next_rma.fetch_add(1, Ordering::Relaxed);
        let p = Pending {
            context: ctx.map_or(0, |c| c as usize),
            to,
            read_into: read_into.then_some(buf as usize),
            len,
            completion: completion && ctx.is_some(),
        };
        // (recorded first: the answer may be taken in while the request is being sent)
        self.rma_insert(id, p);
        let r = if read_into {
            self.rdm.read(to, id, key, addr, len)
        } else {
            let bytes = if len == 0 {
                &[][..]
            } else {
                // SAFETY: the application's `len` readable bytes.
                unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }
            };
            self.rdm.write(to, id, key, addr, bytes, data)
        };
        if let Err(e) = r {
            let Some(p) = self.rma_remove(id) else { return 0 };
            return match e {
                crate::rdm::Error::PeerGone if ctx.is_some() => {
                    let e = crate::cq::ErrEntry {
                        entry: p.entry(),
                        olen: 0,
                        err: FI_ECONNRESET as i32,
                        prov_errno: crate::cq::prov::PEER_GONE,
                    };
                    self.failed(false, e, p.count());
                    0
                }
                crate::rdm::Error::PeerGone => err(FI_ECONNRESET) as isize,
                crate::rdm::Error::TooLong(_) => err(FI_EMSGSIZE) as isize,
                _ => err(FI_EIO) as isize,
            };
        }
        self.progress();
        0
    }

    /// Serve a peer's request: check it against this domain's registrations, copy, count,
    /// and answer.
    pub(super) fn serve(&self, req: RmaRequest) {
        let reg = crate::mr::Registry::get();
        let (status, data) = match req.kind {
            RmaKind::Write { data, cq_data } => {
                match reg.check(self.domain, req.key, req.addr, data.len() as u64, true) {
                    Ok(access) => {
                        if !data.is_empty() {
                            // SAFETY: `access` holds the registry's lock, so the registration,
                            // which covers these `data.len()` bytes at `access.addr` (checked) and
                            // allows remote writes, stays registered (its memory the
                            // application's, live) until the copy is done.
                            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), access.addr as *mut u8, data.len()) };
                        }
                        drop(access);
                        if let Some(c) = self.cntr(Count::RemoteWrite) {
                            c.cntr.add(1);
                        }
                        if let (Some(d), Some(cq)) = (cq_data, self.cq(&self.rx_cq)) {
                            cq.cq.push(crate::cq::Entry {
                                flags: (FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA) as u64,
                                len: data.len(),
                                data: d,
                                ..Default::default()
                            });
                        }
                        (RmaStatus::Done, Vec::new())
                    }
                    Err(s) => (s, Vec::new()),
                }
            }
            RmaKind::Read { len } if len > crate::rdm::MAX_MSG as u64 => (RmaStatus::Malformed, Vec::new()),
            RmaKind::Read { len } => match reg.check(self.domain, req.key, req.addr, len, false) {
                Ok(access) => {
                    let mut out = vec![0u8; len as usize];
                    if len > 0 {
                        // SAFETY: as for writes: `len` bytes at `access.addr`, inside a live
                        // registration that allows remote reads, held registered.
                        unsafe { std::ptr::copy_nonoverlapping(access.addr as *const u8, out.as_mut_ptr(), out.len()) };
                    }
                    drop(access);
                    if let Some(c) = self.cntr(Count::RemoteRead) {
                        c.cntr.add(1);
                    }
                    (RmaStatus::Done, out)
                }
                Err(s) => (s, Vec::new()),
            },
        };
        if let Some(to) = req.from {
            // (a requester that went away has nobody to tell)
            let _ = self.rdm.reply(to, req.id, status, &data);
        }
    }

    /// The answer to one of our requests.
    pub(super) fn answered(&self, r: RmaReply) {
        // (an answer to nothing of ours — forged or late — is dropped)
        let Some(p) = self.rma_remove(r.id) else { return };
        let mut status = RmaStatus::from_word(r.status);
        if status == RmaStatus::Done {
            match p.read_into {
                Some(buf) if r.data.len() == p.len => {
                    if p.len > 0 {
                        // SAFETY: the application's `p.len` writable bytes at `buf`, valid
                        // until this read completes (now).
                        unsafe { std::ptr::copy_nonoverlapping(r.data.as_ptr(), buf as *mut u8, p.len) };
                    }
                }
                Some(_) => status = RmaStatus::Malformed,
                None => {}
            }
        }
        if status == RmaStatus::Done {
            self.succeeded(false, p.entry(), p.completion, p.count());
        } else {
            let (code, prov_errno) = error_of(status);
            let e = crate::cq::ErrEntry { entry: p.entry(), olen: 0, err: code as i32, prov_errno };
            self.failed(false, e, p.count());
        }
    }

    /// Record request `id` of ours, awaiting its answer.
    fn rma_insert(&self, id: u64, p: Pending) {
        let mut m = self.rma.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(id, p);
        self.rma_count.store(m.len(), Ordering::Relaxed);
    }

    /// Take request `id` of ours (answered, or failed).
    fn rma_remove(&self, id: u64) -> Option<Pending> {
        let mut m = self.rma.lock().unwrap_or_else(|p| p.into_inner());
        let p = m.remove(&id);
        self.rma_count.store(m.len(), Ordering::Relaxed);
        p
    }

    /// Fail our requests to peers that went away (they will never answer).
    pub(super) fn fail_gone_rma(&self) {
        // (most of the time there is none: polling a queue costs no lock for it)
        if self.rma_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let gone: Vec<Pending> = {
            let mut m = self.rma.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<u64> = m.iter().filter(|(_, p)| self.rdm.is_gone(p.to)).map(|(id, _)| *id).collect();
            let gone: Vec<Pending> = ids.iter().filter_map(|id| m.remove(id)).collect();
            self.rma_count.store(m.len(), Ordering::Relaxed);
            gone
        };
        for p in gone {
            let e = crate::cq::ErrEntry {
                entry: p.entry(),
                olen: 0,
                err: FI_ECONNRESET as i32,
                prov_errno: crate::cq::prov::PEER_GONE,
            };
            self.failed(false, e, p.count());
        }
    }
}

unsafe extern "C" fn rma_read(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, true, src, addr, key, None, Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn rma_readv(
    ep: *mut fid_ep,
    iov: *const iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: the caller's iovecs.
    match unsafe { one_iov(iov, count) } {
        // SAFETY: forwarded.
        Ok((buf, len)) => unsafe { rma_read(ep, buf, len, std::ptr::null_mut(), src, addr, key, ctx) },
        Err(e) => e,
    }
}

/// The local buffer and the one remote range of `m` (their lengths must agree).
unsafe fn msg_parts(m: &fi_msg_rma) -> Result<(*mut c_void, usize, fi_rma_iov), isize> {
    // SAFETY: the message's iovecs.
    let (buf, len) = unsafe { one_iov(m.msg_iov, m.iov_count) }?;
    if m.rma_iov_count != 1 || m.rma_iov.is_null() {
        return Err(err(FI_EINVAL) as isize);
    }
    // SAFETY: checked non-null: the caller's one remote iovec.
    let r = unsafe { *m.rma_iov };
    if r.len != len {
        return Err(err(FI_EINVAL) as isize);
    }
    Ok((buf, len, r))
}

unsafe extern "C" fn rma_readmsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's parts.
    let (buf, len, r) = match unsafe { msg_parts(m) } {
        Ok(x) => x,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, true, m.addr, r.addr, r.key, None, Some(m.context), ep.wants_completion(false, Some(flags)))
}

unsafe extern "C" fn rma_write(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, false, dest, addr, key, None, Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn rma_writev(
    ep: *mut fid_ep,
    iov: *const iovec,
    _desc: *mut *mut c_void,
    count: usize,
    dest: fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: the caller's iovecs.
    match unsafe { one_iov(iov, count) } {
        // SAFETY: forwarded.
        Ok((buf, len)) => unsafe { rma_write(ep, buf, len, std::ptr::null_mut(), dest, addr, key, ctx) },
        Err(e) => e,
    }
}

unsafe extern "C" fn rma_writemsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    // SAFETY: null or the caller's message.
    let Some(m) = (unsafe { msg.as_ref() }) else { return err(FI_EINVAL) as isize };
    // SAFETY: the message's parts.
    let (buf, len, r) = match unsafe { msg_parts(m) } {
        Ok(x) => x,
        Err(e) => return e,
    };
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    let data = (flags & FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data);
    let ctx = (flags & FI_INJECT as u64 == 0).then_some(m.context);
    ep.rma(buf, len, false, m.addr, r.addr, r.key, data, ctx, ep.wants_completion(false, Some(flags)))
}

unsafe extern "C" fn rma_inject(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, false, dest, addr, key, None, None, false)
}

unsafe extern "C" fn rma_writedata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, false, dest, addr, key, Some(data), Some(ctx), ep.wants_completion(false, None))
}

unsafe extern "C" fn rma_injectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    // SAFETY: as `ep_of` requires.
    let Some(ep) = (unsafe { ep_of(ep) }) else { return err(FI_EINVAL) as isize };
    ep.rma(buf, len, false, dest, addr, key, Some(data), None, false)
}
