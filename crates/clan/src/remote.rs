//! Importing over a link (the import request and its reply), and out-of-band messages over a
//! link. The mapping it makes reaches its aperture through `crate::transport::link`.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clan_wire::{Frame, Import, Status};

use crate::addr::EndpointAddr;
use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::EndpointInner;
use crate::error::{ImportError, OobError};
use crate::link::{Link, LinkError, TargetState};
use crate::lock;
use crate::mapping::{Keep, Mapping};
use crate::nic::NicInner;
use crate::transport::Via;
use crate::transport::link::LinkTarget;

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
