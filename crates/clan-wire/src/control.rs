//! The control channel between the NICs of one host, sans-IO: its messages and the state of
//! one connection on the serving side.
//!
//! NICs of a host talk over their abstract `SOCK_SEQPACKET` sockets (the driver, in `clan`,
//! passes file descriptors and reads the kernel's peer credentials). Every message is one
//! packet: a type byte, a request id (`u32`: a reply carries its request's, so a reply that
//! comes after its requester gave up is recognised and discarded), then fixed little-endian
//! fields; a NIC address is encoded as in [`crate::frame`]. Decoding checks every length and
//! value: the other side is another process and its bytes are untrusted.
//!
//! ```text
//! requests                                     replies
//!  1 Hello    nic, pid u32                     0x81 HelloOk  nic
//!  2 Import   importer, desc                   0x82 ImportOk grant (import id, geometry, port, …)
//!  3 Unimport import_id u64      (no reply)    0x83 Ok
//!  4 Oob      from, to_port u32, payload [40]  0x84 Err      code u16, detail
//!  5 OobOneWay  the same, no reply
//!  6 OobBatch   from, to_port u32, n u8, n × payload [40]   (in order; one reply)
//!  7 OobBatchOneWay  the same, no reply
//!  8 ImportOnAccept importer, token u64      (replied ImportOk/Err when the connect
//!                                              with that token is accepted, or never)
//! ```
//!
//! `ImportOnAccept` comes before a connect request with `token` sent on the same
//! connection: the server answers it with the grant of the descriptor it accepts with, sent
//! before its answer to the connect, so the client needs no import round trip of its own. A
//! connect answered without it (the server did not file it, or refused) leaves it unanswered:
//! the client then imports as usual, and drops a late reply (giving its grant back).
//!
//! ## A connection on the serving side ([`Session`])
//!
//! - The first message must be `Hello`, within [`SessionLimits::hello_timeout`]; a
//!   connection that says nothing is dropped (so idle connections cannot pin the server's
//!   file descriptors).
//! - `Hello` claims a NIC address: the pid must be the one the kernel reports for the
//!   connection, and the driver must *verify* that the NIC is the connecting process's own
//!   (`Step::Verify`: in `clan`, a non-blocking connect to the claimed name whose listener's
//!   credentials must name that pid). Until then, and if it fails, nothing is served.
//! - An out-of-band message must come from an endpoint of the verified NIC.
//! - Bad messages are counted; after [`SessionLimits::max_bad`] the connection is dropped.
//!
//! [`Admission`] bounds how many connections one process and one user may hold.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::WireError;
use crate::frame::{Reader, put_addr};

/// Largest control message.
pub const MAX_MSG: usize = 1024;
/// Most out-of-band payloads one batch carries (a connect hand-shake's fragments).
pub const MAX_BATCH: usize = 16;
/// Out-of-band payload size.
pub const OOB_PAYLOAD: usize = 40;
/// Longest descriptor an import request carries.
pub const MAX_DESC: usize = 256;
/// Longest error detail carried.
pub const MAX_DETAIL: usize = 256;

/// An endpoint address: NIC and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EndpointId {
    /// The NIC.
    pub nic: SocketAddr,
    /// The endpoint's port.
    pub port: u32,
}

/// A request from a client NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message on a connection.
    Hello {
        /// The client NIC.
        nic: SocketAddr,
        /// Its process.
        pid: u32,
    },
    /// Import a descriptor (binary form).
    Import {
        /// The importing endpoint.
        importer: EndpointId,
        /// The descriptor.
        desc: Vec<u8>,
    },
    /// Release an import (no reply).
    Unimport {
        /// The import.
        import_id: u64,
    },
    /// Deliver an out-of-band message.
    Oob {
        /// The sending endpoint (must be on the connection's verified NIC).
        from: EndpointId,
        /// The destination endpoint on the serving NIC.
        to_port: u32,
        /// The payload.
        payload: [u8; OOB_PAYLOAD],
        /// Whether the sender waits for the result.
        reply: bool,
    },
    /// Deliver out-of-band messages, in order (1 to [`MAX_BATCH`]); the reply is the first
    /// refusal, or `Ok`.
    OobBatch {
        /// The sending endpoint (must be on the connection's verified NIC).
        from: EndpointId,
        /// The destination endpoint on the serving NIC.
        to_port: u32,
        /// The payloads.
        payloads: Vec<[u8; OOB_PAYLOAD]>,
        /// Whether the sender waits for the result.
        reply: bool,
    },
    /// Import, for endpoint `importer`, the descriptor the serving NIC accepts the connect
    /// request with `token` with (sent before that request, on the same connection). The
    /// reply, `ImportOk` or `Err`, comes before the connect's answer, or never.
    ImportOnAccept {
        /// The importing endpoint (the one connecting).
        importer: EndpointId,
        /// The connect request's token.
        token: u64,
    },
}

/// What an import grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportGrant {
    /// The import (for `Unimport`).
    pub import_id: u64,
    /// Length of the whole aperture.
    pub aperture_len: u64,
    /// Data capacity (a page multiple; a multiple of 64 for an aperture under a page carved
    /// from a pool).
    pub cap: u64,
    /// Where the aperture's data starts in the data memfd (a multiple of 64: 0 unless the
    /// aperture is carved from a pool of memory shared with the importer's NIC).
    pub data_offset: u64,
    /// Where the aperture's index starts in the index memfd (likewise).
    pub index_offset: u64,
    /// Tripwire entries of the aperture's index (the index memfd's geometry).
    pub slots: u32,
    /// The event queue's id on the serving NIC.
    pub eq_id: u32,
    /// The importing process's port in that queue (its memfd and eventfd follow the
    /// aperture's two memfds).
    pub port: u64,
    /// The port's ring capacity (its geometry).
    pub ring_cap: u32,
    /// The aperture index's tag.
    pub tag: u64,
    /// The revocation word's live value.
    pub live: u64,
    /// The data memfd is a read-only open.
    pub read_only: bool,
}

/// Error codes of [`Reply::Err`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Code {
    /// The aperture is no longer exported.
    Revoked = 1,
    /// The descriptor's tag does not verify.
    BadKey = 2,
    /// Denied by the exporter's uid restriction.
    DeniedUid = 3,
    /// Denied by the exporter's pid restriction.
    DeniedPid = 4,
    /// Denied by the exporter's endpoint restriction.
    DeniedEndpoint = 5,
    /// No producer ring free in the aperture's event queue.
    TooManyProducers = 6,
    /// No such endpoint.
    NoSuchEndpoint = 7,
    /// The endpoint's queue is full.
    QueueFull = 8,
    /// The descriptor names another NIC.
    NotOurs = 9,
    /// The request was malformed.
    Malformed = 10,
    /// The server failed.
    Internal = 11,
    /// `Hello` must come first.
    NeedHello = 12,
    /// The NIC claimed in `Hello` is not the connecting process's.
    Unverified = 13,
    /// The sender of an out-of-band message is not on the connection's NIC.
    ForgedSender = 14,
    /// A bounded table is full.
    TooMany = 15,
    /// The descriptor grants less than its whole aperture: such a grant is served through a
    /// link, never by handing over the aperture's memory.
    Narrowed = 16,
}

impl Code {
    fn from_u16(v: u16) -> Option<Code> {
        use Code::*;
        Some(match v {
            1 => Revoked,
            2 => BadKey,
            3 => DeniedUid,
            4 => DeniedPid,
            5 => DeniedEndpoint,
            6 => TooManyProducers,
            7 => NoSuchEndpoint,
            8 => QueueFull,
            9 => NotOurs,
            10 => Malformed,
            11 => Internal,
            12 => NeedHello,
            13 => Unverified,
            14 => ForgedSender,
            15 => TooMany,
            16 => Narrowed,
            _ => return None,
        })
    }
}

/// A reply from the serving NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Hello accepted.
    HelloOk {
        /// The serving NIC.
        nic: SocketAddr,
    },
    /// Import granted (descriptors follow with the message).
    ImportOk(ImportGrant),
    /// Done.
    Ok,
    /// Refused.
    Err {
        /// Why.
        code: Code,
        /// Details for a log.
        detail: String,
    },
}

impl Reply {
    /// An error reply.
    pub fn err(code: Code, detail: impl Into<String>) -> Reply {
        Reply::Err { code, detail: detail.into() }
    }
}

fn put_ep(w: &mut Vec<u8>, e: EndpointId) {
    put_addr(w, e.nic);
    w.extend_from_slice(&e.port.to_le_bytes());
}

fn get_ep(r: &mut Reader<'_>) -> Result<EndpointId, WireError> {
    Ok(EndpointId { nic: r.addr()?, port: r.u32()? })
}

fn get_bool(r: &mut Reader<'_>) -> Result<bool, WireError> {
    match r.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(WireError::BadField),
    }
}

impl Request {
    /// Whether the sender waits for a reply.
    pub fn wants_reply(&self) -> bool {
        !matches!(
            self,
            Request::Unimport { .. } | Request::Oob { reply: false, .. } | Request::OobBatch { reply: false, .. }
        )
    }

    /// Encode with request id `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        let mut w = Vec::with_capacity(128);
        let kind = match self {
            Request::Hello { .. } => 1,
            Request::Import { .. } => 2,
            Request::Unimport { .. } => 3,
            Request::Oob { reply: true, .. } => 4,
            Request::Oob { reply: false, .. } => 5,
            Request::OobBatch { reply: true, .. } => 6,
            Request::OobBatch { reply: false, .. } => 7,
            Request::ImportOnAccept { .. } => 8,
        };
        w.push(kind);
        w.extend_from_slice(&id.to_le_bytes());
        match self {
            Request::Hello { nic, pid } => {
                put_addr(&mut w, *nic);
                w.extend_from_slice(&pid.to_le_bytes());
            }
            Request::Import { importer, desc } => {
                let d = &desc[..desc.len().min(MAX_DESC)];
                put_ep(&mut w, *importer);
                w.extend_from_slice(&(d.len() as u16).to_le_bytes());
                w.extend_from_slice(d);
            }
            Request::Unimport { import_id } => {
                w.extend_from_slice(&import_id.to_le_bytes());
            }
            Request::Oob { from, to_port, payload, .. } => {
                put_ep(&mut w, *from);
                w.extend_from_slice(&to_port.to_le_bytes());
                w.extend_from_slice(payload);
            }
            Request::OobBatch { from, to_port, payloads, .. } => {
                let n = payloads.len().min(MAX_BATCH);
                put_ep(&mut w, *from);
                w.extend_from_slice(&to_port.to_le_bytes());
                w.push(n as u8);
                for p in &payloads[..n] {
                    w.extend_from_slice(p);
                }
            }
            Request::ImportOnAccept { importer, token } => {
                put_ep(&mut w, *importer);
                w.extend_from_slice(&token.to_le_bytes());
            }
        }
        w
    }

    /// Decode (the request id and the request), validating everything. Never panics.
    pub fn decode(b: &[u8]) -> Result<(u32, Request), WireError> {
        let mut r = Reader(b);
        let kind = r.u8()?;
        let id = r.u32()?;
        let req = match kind {
            1 => Request::Hello { nic: r.addr()?, pid: r.u32()? },
            2 => {
                let importer = get_ep(&mut r)?;
                let n = r.u16()? as usize;
                if n > MAX_DESC {
                    return Err(WireError::TooLarge { kind: 2, len: n as u64 });
                }
                Request::Import { importer, desc: r.take(n)?.to_vec() }
            }
            3 => Request::Unimport { import_id: r.u64()? },
            k @ (4 | 5) => {
                Request::Oob { from: get_ep(&mut r)?, to_port: r.u32()?, payload: r.array()?, reply: k == 4 }
            }
            k @ (6 | 7) => {
                let from = get_ep(&mut r)?;
                let to_port = r.u32()?;
                let n = usize::from(r.u8()?);
                if n == 0 || n > MAX_BATCH {
                    return Err(WireError::BadField);
                }
                let mut payloads = Vec::with_capacity(n);
                for _ in 0..n {
                    payloads.push(r.array()?);
                }
                Request::OobBatch { from, to_port, payloads, reply: k == 6 }
            }
            8 => Request::ImportOnAccept { importer: get_ep(&mut r)?, token: r.u64()? },
            k => return Err(WireError::UnknownKind(k)),
        };
        r.done()?;
        Ok((id, req))
    }
}

impl Reply {
    /// Encode as the reply to request `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        let mut w = Vec::with_capacity(128);
        w.push(match self {
            Reply::HelloOk { .. } => 0x81,
            Reply::ImportOk(_) => 0x82,
            Reply::Ok => 0x83,
            Reply::Err { .. } => 0x84,
        });
        w.extend_from_slice(&id.to_le_bytes());
        match self {
            Reply::HelloOk { nic } => put_addr(&mut w, *nic),
            Reply::ImportOk(g) => {
                for v in [g.import_id, g.aperture_len, g.cap, g.data_offset, g.index_offset] {
                    w.extend_from_slice(&v.to_le_bytes());
                }
                for v in [g.slots, g.eq_id, g.ring_cap] {
                    w.extend_from_slice(&v.to_le_bytes());
                }
                for v in [g.port, g.tag, g.live] {
                    w.extend_from_slice(&v.to_le_bytes());
                }
                w.push(u8::from(g.read_only));
            }
            Reply::Ok => {}
            Reply::Err { code, detail } => {
                let mut n = detail.len().min(MAX_DETAIL);
                while !detail.is_char_boundary(n) {
                    n -= 1;
                }
                w.extend_from_slice(&(*code as u16).to_le_bytes());
                w.extend_from_slice(&(n as u16).to_le_bytes());
                w.extend_from_slice(&detail.as_bytes()[..n]);
            }
        }
        w
    }

    /// Decode (the id of the request answered, and the reply), validating everything.
    /// Never panics.
    pub fn decode(b: &[u8]) -> Result<(u32, Reply), WireError> {
        let mut r = Reader(b);
        let kind = r.u8()?;
        let id = r.u32()?;
        let rep = match kind {
            0x81 => Reply::HelloOk { nic: r.addr()? },
            0x82 => Reply::ImportOk(ImportGrant {
                import_id: r.u64()?,
                aperture_len: r.u64()?,
                cap: r.u64()?,
                data_offset: r.u64()?,
                index_offset: r.u64()?,
                slots: r.u32()?,
                eq_id: r.u32()?,
                ring_cap: r.u32()?,
                port: r.u64()?,
                tag: r.u64()?,
                live: r.u64()?,
                read_only: get_bool(&mut r)?,
            }),
            0x83 => Reply::Ok,
            0x84 => {
                let code = Code::from_u16(r.u16()?).ok_or(WireError::BadField)?;
                let n = r.u16()? as usize;
                if n > MAX_DETAIL {
                    return Err(WireError::TooLarge { kind: 0x84, len: n as u64 });
                }
                Reply::Err { code, detail: String::from_utf8_lossy(r.take(n)?).into_owned() }
            }
            k => return Err(WireError::UnknownKind(k)),
        };
        r.done()?;
        Ok((id, rep))
    }
}

/// Bounds of one serving-side connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// A connection that has not said a verified hello by then is dropped.
    pub hello_timeout: Duration,
    /// Bad messages tolerated.
    pub max_bad: u32,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits { hello_timeout: Duration::from_secs(2), max_bad: 8 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionState {
    AwaitHello,
    /// The hello with this request id claimed this NIC.
    Verifying(u32, SocketAddr),
    Open(SocketAddr),
    Closed,
}

/// What the driver does with a message. Replies carry the id of the request they answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Check that `nic` belongs to the connecting process, then call
    /// [`Session::hello_verified`].
    Verify {
        /// The NIC claimed.
        nic: SocketAddr,
    },
    /// Serve request `id`: it passed every check (an `Oob` comes from the verified NIC).
    Serve(u32, Request),
    /// Send this reply (an error) to request `id` and go on.
    Reply(u32, Reply),
    /// Nothing to send.
    Ignore,
    /// Send this reply if there is one, then drop the connection.
    Close(Option<(u32, Reply)>, &'static str),
}

/// One connection on the serving side (see the module documentation).
#[derive(Debug, Clone)]
pub struct Session {
    pid: u32,
    state: SessionState,
    deadline: Instant,
    bad: u32,
    limits: SessionLimits,
}

impl Session {
    /// A connection from process `pid` (the kernel's credentials), accepted at `now`.
    pub fn new(pid: u32, now: Instant, limits: SessionLimits) -> Session {
        Session { pid, state: SessionState::AwaitHello, deadline: now + limits.hello_timeout, bad: 0, limits }
    }

    /// The verified NIC at the other end, once there is one.
    pub fn peer(&self) -> Option<SocketAddr> {
        match self.state {
            SessionState::Open(n) => Some(n),
            _ => None,
        }
    }

    /// The connecting process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it was closed.
    pub fn is_closed(&self) -> bool {
        self.state == SessionState::Closed
    }

    fn bad(&mut self, id: u32, r: Reply) -> Step {
        self.bad += 1;
        if self.bad >= self.limits.max_bad {
            self.state = SessionState::Closed;
            return Step::Close(Some((id, r)), "too many bad messages");
        }
        Step::Reply(id, r)
    }

    /// A packet arrived: `fds` descriptors came with it (requests carry none) and
    /// `truncated` says it did not fit.
    pub fn handle_packet(&mut self, bytes: &[u8], fds: usize, truncated: bool) -> Step {
        if self.state == SessionState::Closed {
            return Step::Close(None, "closed");
        }
        if bytes.is_empty() && fds == 0 {
            self.state = SessionState::Closed;
            return Step::Close(None, "closed by the peer");
        }
        let decoded = if truncated || fds != 0 { None } else { Request::decode(bytes).ok() };
        let (id, req) = match decoded {
            Some(r) => r,
            None => return self.bad(0, Reply::err(Code::Malformed, "malformed request")),
        };
        match (self.state, req) {
            (SessionState::AwaitHello, Request::Hello { nic, pid }) => {
                if pid != self.pid {
                    return self
                        .bad(id, Reply::err(Code::Unverified, "pid does not match the connection's credentials"));
                }
                self.state = SessionState::Verifying(id, nic);
                Step::Verify { nic }
            }
            (SessionState::Open(_) | SessionState::Verifying(..), Request::Hello { .. }) => {
                self.bad(id, Reply::err(Code::Malformed, "hello said twice"))
            }
            (SessionState::AwaitHello | SessionState::Verifying(..), r) => {
                let s = self.bad(id, Reply::err(Code::NeedHello, "a verified hello must come first"));
                if r.wants_reply() { s } else { s.without_reply() }
            }
            (SessionState::Open(nic), r @ (Request::Oob { from, .. } | Request::OobBatch { from, .. })) => {
                if from.nic != nic {
                    let s = self.bad(id, Reply::err(Code::ForgedSender, "the sender is not on this connection's NIC"));
                    return if r.wants_reply() { s } else { s.without_reply() };
                }
                Step::Serve(id, r)
            }
            (SessionState::Open(_), r) => Step::Serve(id, r),
            (SessionState::Closed, _) => Step::Close(None, "closed"),
        }
    }

    /// The driver checked the NIC claimed by `Hello`; `ours` is our own address (the reply).
    pub fn hello_verified(&mut self, ok: bool, ours: SocketAddr) -> Step {
        match self.state {
            SessionState::Verifying(id, nic) if ok => {
                self.state = SessionState::Open(nic);
                Step::Reply(id, Reply::HelloOk { nic: ours })
            }
            SessionState::Verifying(id, _) => {
                self.state = SessionState::AwaitHello;
                self.bad(id, Reply::err(Code::Unverified, "the NIC named in hello is not this process's"))
            }
            _ => Step::Ignore,
        }
    }

    /// Time passed: whether the connection must be dropped (no verified hello in time).
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        if matches!(self.state, SessionState::AwaitHello | SessionState::Verifying(..)) && now >= self.deadline {
            self.state = SessionState::Closed;
        }
        self.state == SessionState::Closed
    }

    /// When [`Session::handle_timeout`] must be called (None once open).
    pub fn poll_timeout(&self) -> Option<Instant> {
        matches!(self.state, SessionState::AwaitHello | SessionState::Verifying(..)).then_some(self.deadline)
    }
}

impl Step {
    fn without_reply(self) -> Step {
        match self {
            Step::Reply(..) => Step::Ignore,
            Step::Close(_, why) => Step::Close(None, why),
            s => s,
        }
    }
}

/// How many control connections one process, one user and everyone may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Per process.
    pub per_pid: usize,
    /// Per user.
    pub per_uid: usize,
    /// In all.
    pub total: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits { per_pid: 256, per_uid: 2048, total: 8192 }
    }
}

/// Counts connections against [`AdmissionLimits`].
#[derive(Debug, Clone, Default)]
pub struct Admission {
    limits: AdmissionLimits,
    pids: HashMap<u32, usize>,
    uids: HashMap<u32, usize>,
    total: usize,
}

impl Admission {
    /// Counting against `limits`.
    pub fn new(limits: AdmissionLimits) -> Admission {
        Admission { limits, ..Admission::default() }
    }

    /// Admit a connection from (`pid`, `uid`), or refuse it (it must then be closed at once).
    pub fn admit(&mut self, pid: u32, uid: u32) -> bool {
        let p = self.pids.get(&pid).copied().unwrap_or(0);
        let u = self.uids.get(&uid).copied().unwrap_or(0);
        if p >= self.limits.per_pid || u >= self.limits.per_uid || self.total >= self.limits.total {
            return false;
        }
        *self.pids.entry(pid).or_insert(0) += 1;
        *self.uids.entry(uid).or_insert(0) += 1;
        self.total += 1;
        true
    }

    /// A connection admitted for (`pid`, `uid`) closed.
    pub fn release(&mut self, pid: u32, uid: u32) {
        for (m, k) in [(&mut self.pids, pid), (&mut self.uids, uid)] {
            if let Some(n) = m.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&k);
                }
            }
        }
        self.total = self.total.saturating_sub(1);
    }

    /// Connections held.
    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let ep = EndpointId { nic: "10.77.0.1:7000".parse().unwrap(), port: 9 };
        let reqs = [
            Request::Hello { nic: "[::1]:5".parse().unwrap(), pid: 42 },
            Request::Import { importer: ep, desc: vec![1, 2, 3] },
            Request::Unimport { import_id: u64::MAX },
            Request::Oob { from: ep, to_port: 3, payload: [7; 40], reply: true },
            Request::Oob { from: ep, to_port: 3, payload: [7; 40], reply: false },
            Request::OobBatch { from: ep, to_port: 3, payloads: vec![[1; 40], [2; 40], [3; 40]], reply: true },
            Request::OobBatch { from: ep, to_port: 3, payloads: vec![[1; 40]], reply: false },
            Request::ImportOnAccept { importer: ep, token: 0x0123_4567_89ab_cdef },
        ];
        for q in reqs {
            assert_eq!(Request::decode(&q.encode(7)).unwrap(), (7, q));
        }
        for p in [
            Reply::HelloOk { nic: ep.nic },
            Reply::Ok,
            Reply::err(Code::BadKey, "x"),
            Reply::err(Code::TooMany, "é".repeat(200)),
        ] {
            let (id, d) = Reply::decode(&p.encode(9)).unwrap();
            assert_eq!(id, 9);
            if let (Reply::Err { detail: a, .. }, Reply::Err { detail: b, .. }) = (&d, &p) {
                assert!(b.starts_with(a.as_str()));
            } else {
                assert_eq!(d, p);
            }
        }
    }

    #[test]
    fn a_session_serves_only_after_a_verified_hello_and_checks_senders() {
        let now = Instant::now();
        let me: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let nic: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let mut s = Session::new(10, now, SessionLimits::default());
        let oob = |n: SocketAddr| {
            Request::Oob { from: EndpointId { nic: n, port: 1 }, to_port: 2, payload: [0; 40], reply: true }.encode(3)
        };
        assert!(matches!(s.handle_packet(&oob(nic), 0, false), Step::Reply(3, _)));
        assert_eq!(s.handle_packet(&Request::Hello { nic, pid: 10 }.encode(4), 0, false), Step::Verify { nic });
        assert!(matches!(s.hello_verified(true, me), Step::Reply(4, Reply::HelloOk { .. })));
        assert!(matches!(s.handle_packet(&oob(nic), 0, false), Step::Serve(3, _)));
        assert!(matches!(
            s.handle_packet(&oob(me), 0, false),
            Step::Reply(3, Reply::Err { code: Code::ForgedSender, .. })
        ));
        assert!(!s.handle_timeout(now + Duration::from_secs(60)));
    }
}
