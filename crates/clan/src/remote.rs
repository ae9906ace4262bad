//! Mappings of apertures on other hosts, through a link.
//!
//! Same API as a mapping within a host. A write becomes a write burst sent by the calling
//! thread straight from its memory; a read becomes a read request answered by the exporter;
//! word stores are 8- or 4-byte bursts the exporter applies atomically. Raw access works on a
//! local staging area (sparse: only touched pages cost memory) that [`crate::Mapping::commit`]
//! sends. Writes are asynchronous: one the exporter refuses (because the aperture was just
//! unexported) is reported back, and every later access through the mapping fails.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clan_shm::segment::{self, Segment};
use clan_wire::{Frame, Import, Status, Target};

use crate::addr::EndpointAddr;
use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::EndpointInner;
use crate::error::{AccessError, ImportError, OobError};
use crate::link::{Link, LinkError, Payload, TargetState};
use crate::lock;
use crate::mapping::{Keep, Mapping, Via};
use crate::nic::NicInner;

/// A mapping's route to an aperture on another host.
#[derive(Debug)]
pub(crate) struct LinkTarget {
    pub link: Arc<Link>,
    pub nic: Arc<NicInner>,
    pub aperture: u32,
    pub generation: u32,
    pub key: u64,
    pub state: Arc<TargetState>,
    pub shadow: OnceLock<Segment>,
    pub len: u64,
}

impl Drop for LinkTarget {
    fn drop(&mut self) {
        lock(&self.link.targets).remove(&self.key);
        if !self.link.is_closed() {
            self.link.send_control(&Frame::Unimport { key: self.key });
        }
    }
}

pub(crate) fn link_error(e: LinkError) -> AccessError {
    match e {
        LinkError::Down(_) | LinkError::Unreachable(_) | LinkError::Refused(_) => AccessError::Disconnected,
        LinkError::Timeout => AccessError::Timeout,
    }
}

impl LinkTarget {
    fn to(&self, abs: u64) -> Target {
        Target { aperture: self.aperture, generation: self.generation, key: self.key, offset: abs }
    }

    pub fn check_live(&self) -> Result<(), AccessError> {
        if self.state.revoked.load(Ordering::Acquire) {
            return Err(AccessError::Revoked);
        }
        if self.link.is_closed() {
            return Err(AccessError::Disconnected);
        }
        Ok(())
    }

    pub fn write(&self, abs: u64, src: &[u8]) -> Result<(), AccessError> {
        self.link.send_write(&self.nic, self.to(abs), Payload::Bytes(src), src.len()).map_err(link_error)
    }

    pub fn read(&self, abs: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        let mut done = 0usize;
        while done < dst.len() {
            let n = (dst.len() - done).min(crate::link::MAX_READ as usize);
            let id = self.link.start_read(&self.nic, self.to(abs + done as u64), n as u32, None).map_err(link_error)?;
            let deadline = Instant::now() + self.link.timeout;
            let (status, data) = self.link.finish_read(&self.nic, id, deadline).map_err(link_error)?;
            check_status(status, &self.state)?;
            if data.len() != n {
                return Err(AccessError::Disconnected);
            }
            dst[done..done + n].copy_from_slice(&data);
            done += n;
        }
        Ok(())
    }

    pub fn shadow(&self) -> Result<&Segment, AccessError> {
        if let Some(s) = self.shadow.get() {
            return Ok(s);
        }
        let s = Segment::anonymous(segment::page_align(self.len as usize).max(segment::page_size()))
            .map_err(|_| AccessError::Disconnected)?;
        let _ = self.shadow.set(s);
        self.shadow.get().ok_or(AccessError::Disconnected)
    }

    /// Send `len` bytes of the staging area at mapping offset `off` (aperture offset `abs`).
    pub fn commit(&self, off: u64, abs: u64, len: u64) -> Result<(), AccessError> {
        let s = self.shadow()?;
        self.link.send_write(&self.nic, self.to(abs), Payload::Seg(s, off as usize), len as usize).map_err(link_error)
    }

    pub fn barrier(&self) -> Result<(), AccessError> {
        self.link.barrier(&self.nic).map_err(link_error)
    }

    /// Send `len` bytes of `src` at `src_off` (no copy: the burst goes from that memory).
    pub fn write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<(), AccessError> {
        self.check_live()?;
        self.link
            .send_write(&self.nic, self.to(abs), Payload::Seg(src, src_off as usize), len as usize)
            .map_err(link_error)
    }

    /// A notification behind the writes sent so far.
    pub fn notify(&self, abs: u64, len: u64) -> Result<(), AccessError> {
        self.check_live()?;
        self.link.send_frame_blocking(&self.nic, &Frame::Notify { to: self.to(abs), len }).map_err(link_error)
    }

    /// Read into a local aperture; `done` runs when the answer is in place.
    pub fn read_into(
        &self,
        abs: u64,
        dst: Arc<crate::aperture::ApertureInner>,
        dst_off: u64,
        len: u64,
        done: Box<dyn FnOnce(Result<u64, AccessError>) + Send>,
    ) -> Result<(), AccessError> {
        self.check_live()?;
        let state = self.state.clone();
        let into = crate::link::ReadInto {
            ap: dst,
            abs: dst_off,
            want: len,
            got: 0,
            done: Box::new(move |r: Result<u64, Status>| {
                done(r.map_err(|s| match check_status(s, &state) {
                    Err(e) => e,
                    Ok(()) => AccessError::Disconnected,
                }))
            }),
        };
        self.link.start_read_into(&self.nic, self.to(abs), len as u32, into).map_err(link_error)
    }
}

pub(crate) fn check_status(status: Status, state: &TargetState) -> Result<(), AccessError> {
    match status {
        Status::Ok => Ok(()),
        Status::Revoked | Status::BadKey => {
            state.revoked.store(true, Ordering::Release);
            Err(AccessError::Revoked)
        }
        Status::NoRights => Err(AccessError::NotReadable),
        _ => Err(AccessError::Disconnected),
    }
}

fn import_error(peer: crate::addr::NicAddr, e: LinkError, timeout: Duration) -> ImportError {
    match e {
        LinkError::Unreachable(_) => ImportError::Unreachable(peer),
        LinkError::Refused(detail) => ImportError::LinkRefused { peer, detail },
        LinkError::Down(d) => ImportError::Protocol { peer, detail: d },
        LinkError::Timeout => ImportError::Timeout { peer, timeout },
    }
}

/// Import `desc` (exported on another host) over a link, set up on demand. If the link the
/// request went out on dies before any answer (a link that broke just before, whose end had
/// not been noticed yet), the request is repeated once on a fresh link: importing is safe to
/// repeat (the dead link took any half-made import with it).
pub(crate) fn import_over_link(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    deadline: Instant,
    timeout: Duration,
) -> Result<Mapping, ImportError> {
    match import_once(ep, desc, deadline, timeout) {
        Err(Retry::Again(_)) => match import_once(ep, desc, deadline, timeout) {
            Err(Retry::Again(e)) | Err(Retry::Final(e)) => Err(e),
            Ok(m) => Ok(m),
        },
        Err(Retry::Final(e)) => Err(e),
        Ok(m) => Ok(m),
    }
}

enum Retry {
    Again(ImportError),
    Final(ImportError),
}

fn import_once(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    deadline: Instant,
    timeout: Duration,
) -> Result<Mapping, Retry> {
    let nic = &ep.nic;
    let peer = desc.nic();
    let link = nic.link(peer, deadline).map_err(|e| Retry::Final(import_error(peer, e, timeout)))?;
    let again = |e: LinkError| {
        if matches!(e, LinkError::Down(_)) {
            Retry::Again(import_error(peer, e, timeout))
        } else {
            Retry::Final(import_error(peer, e, timeout))
        }
    };
    let id = link.next_id();
    lock(&link.waits).imports.insert(id, None);
    let bytes = desc.to_bytes();
    let req = Frame::Import(Import {
        id,
        importer_nic: ep.addr.nic.socket_addr(),
        importer_port: ep.addr.port,
        desc: &bytes,
    });
    if let Err(e) = link.send_frame_until(nic, &req, deadline) {
        lock(&link.waits).imports.remove(&id);
        return Err(again(e));
    }
    let reply = link.wait_until(nic, deadline, |w| w.imports.get(&id).copied().flatten(), false);
    lock(&link.waits).imports.remove(&id);
    let reply = reply.map_err(|e| match e {
        LinkError::Timeout => Retry::Final(ImportError::Timeout { peer, timeout }),
        e => again(e),
    })?;
    finish_import(ep, desc, link, reply).map_err(Retry::Final)
}

fn finish_import(
    ep: &Arc<EndpointInner>,
    desc: &Descriptor,
    link: Arc<Link>,
    reply: clan_wire::ImportReply,
) -> Result<Mapping, ImportError> {
    let nic = &ep.nic;
    let peer = desc.nic();
    match reply.status {
        Status::Ok => {}
        other => {
            return Err(match clan_wire::grant::Refusal::from_status(other) {
                Some(r) => ImportError::refused(r, desc),
                None => ImportError::Protocol { peer, detail: format!("import refused: {other:?}") },
            });
        }
    }
    let rights_ok = Rights::READ_WRITE.contains(desc.rights()) && reply.rights == desc.rights().bits();
    if reply.offset != desc.offset()
        || reply.len != desc.len()
        || reply.aperture_len != desc.aperture_len()
        || !rights_ok
    {
        link.send_control(&Frame::Unimport { key: reply.key });
        return Err(ImportError::Protocol { peer, detail: "import reply does not match the descriptor".into() });
    }
    let state = Arc::new(TargetState::default());
    lock(&link.targets).insert(reply.key, Arc::downgrade(&state));
    let target = LinkTarget {
        link,
        nic: nic.clone(),
        aperture: desc.aperture(),
        generation: desc.generation(),
        key: reply.key,
        state,
        shadow: OnceLock::new(),
        len: desc.len(),
    };
    Ok(Mapping::new(ep, desc, Via::Link(target), Keep::None))
}

/// Send out-of-band messages over a link, all at once, and wait (until `deadline`) for their
/// delivery results (repeated once on a fresh link if the link dies before they went out).
pub(crate) fn oob_over_link(
    nic: &NicInner,
    from: EndpointAddr,
    to: EndpointAddr,
    payloads: &[[u8; 40]],
    deadline: Instant,
) -> Result<(), OobError> {
    match oob_once(nic, from, to, payloads, deadline) {
        Err((true, _)) => oob_once(nic, from, to, payloads, deadline).map_err(|(_, e)| e),
        r => r.map_err(|(_, e)| e),
    }
}

/// One attempt; the flag says whether repeating it is safe (nothing went out).
fn oob_once(
    nic: &NicInner,
    from: EndpointAddr,
    to: EndpointAddr,
    payloads: &[[u8; 40]],
    deadline: Instant,
) -> Result<(), (bool, OobError)> {
    let link = nic.link(to.nic, deadline).map_err(|e| match e {
        LinkError::Timeout => (false, OobError::Timeout),
        LinkError::Refused(d) => (false, OobError::Protocol { peer: to.nic, detail: d }),
        _ => (false, OobError::Unreachable(to.nic)),
    })?;
    let down = |d: String| OobError::Protocol { peer: to.nic, detail: d };
    let mut ids = Vec::with_capacity(payloads.len());
    let forget = |ids: &[u64]| {
        let mut w = lock(&link.waits);
        for id in ids {
            w.oobs.remove(id);
        }
    };
    for (i, payload) in payloads.iter().enumerate() {
        let id = link.next_id();
        lock(&link.waits).oobs.insert(id, None);
        ids.push(id);
        let f = Frame::Oob(clan_wire::Oob {
            id,
            from_nic: from.nic.socket_addr(),
            from_port: from.port,
            to_port: to.port,
            payload: *payload,
        });
        if let Err(e) = link.send_frame_until(nic, &f, deadline) {
            forget(&ids);
            return Err(match e {
                LinkError::Down(d) | LinkError::Unreachable(d) | LinkError::Refused(d) => (i == 0, down(d)),
                LinkError::Timeout => (false, OobError::Timeout),
            });
        }
    }
    // Once sent, they may have been delivered: never repeated (no duplicates).
    let mut result = Ok(());
    for id in &ids {
        let r = link.wait_until(nic, deadline, |w| w.oobs.get(id).copied().flatten(), false);
        let r = match r {
            Ok(Status::Ok) => Ok(()),
            Ok(Status::QueueFull) => Err((false, OobError::QueueFull(to))),
            Ok(Status::NoSuchEndpoint) => Err((false, OobError::NoSuchEndpoint(to))),
            Ok(s) => Err((false, down(format!("{s:?}")))),
            Err(LinkError::Down(d) | LinkError::Unreachable(d) | LinkError::Refused(d)) => Err((false, down(d))),
            Err(LinkError::Timeout) => Err((false, OobError::Timeout)),
        };
        if let Err(e) = r {
            result = Err(e);
            break;
        }
    }
    forget(&ids);
    result
}
