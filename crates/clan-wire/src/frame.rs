//! Frames and their encoding.
//!
//! Every frame is length-delimited: `len: u32 LE` (bytes after the prefix), `kind: u8`, body.
//! All integers are little-endian. A write burst's body is its destination ([`Target`], 24
//! bytes) followed by the data: the data's length is implied by the frame's, which is what
//! lets a burst be split at any byte and adjacent bursts be coalesced ([`crate::burst`]).
//!
//! ```text
//! kind  frame        body
//!  1    Hello        version u16, flags u16, nic addr (19), nonce [16], credit u64
//!  2    Auth         proof [32]
//!  3    Write        Target (aperture u32, generation u32, key u64, offset u64), data …
//!  4    ReadReq      id u64, Target, len u32
//!  5    ReadResp     id u64, status u8, data …
//!  6    Oob          id u64, from (nic addr 19 + port u32), to_port u32, payload [40]
//!  7    OobResult    id u64, status u8
//!  8    Import       id u64, importer (23), desc_len u16, desc …
//!  9    ImportReply  id u64, status u8, key u64, aperture_len u64, offset u64, len u64, rights u8
//! 10    Unimport     key u64
//! 11    Ack          writes u64, bytes u64           (cumulative, applied by the receiver)
//! 12    Credit       bytes u64                        (window of unacknowledged write bytes)
//! 13    Refused      status u8, key u64, offset u64
//! 14    Ping         token u64
//! 15    Pong         token u64
//! 16    Close        status u8
//! 17    Notify       Target, len u64                  (after a write: tell the exporter it landed)
//! 18    Welcome      (empty)                          (the acceptor keeps the link: it may carry traffic)
//! ```
//!
//! The link hand-shake (`Hello`, `Auth`, `Welcome`, `Close`) is driven by
//! [`crate::handshake::Handshake`].
//!
//! A nic addr is `family u8 (4 or 6), address [16] (IPv4 mapped), port u16`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::WireError;

/// Protocol version carried in `Hello`.
pub const VERSION: u16 = 2;
/// Bytes of the length prefix.
pub const PREFIX: usize = 4;
/// Largest data part of a `Write` or `ReadResp` frame.
pub const MAX_DATA: u64 = 16 << 20;
/// Largest body of any other frame.
pub const MAX_SMALL: usize = 1024;
/// Bytes of a `Write` frame before its data (prefix, kind, target).
pub const WRITE_HEADER: usize = PREFIX + 1 + Target::LEN;
/// Bytes of a `ReadResp` frame before its data.
pub const READ_RESP_HEADER: usize = PREFIX + 1 + 9;
/// Size of an out-of-band payload.
pub const OOB_PAYLOAD: usize = 40;

/// Frame kinds.
pub mod kind {
    #![allow(missing_docs)]
    pub const HELLO: u8 = 1;
    pub const AUTH: u8 = 2;
    pub const WRITE: u8 = 3;
    pub const READ_REQ: u8 = 4;
    pub const READ_RESP: u8 = 5;
    pub const OOB: u8 = 6;
    pub const OOB_RESULT: u8 = 7;
    pub const IMPORT: u8 = 8;
    pub const IMPORT_REPLY: u8 = 9;
    pub const UNIMPORT: u8 = 10;
    pub const ACK: u8 = 11;
    pub const CREDIT: u8 = 12;
    pub const REFUSED: u8 = 13;
    pub const PING: u8 = 14;
    pub const PONG: u8 = 15;
    pub const CLOSE: u8 = 16;
    pub const NOTIFY: u8 = 17;
    pub const WELCOME: u8 = 18;
}

/// Result codes carried by replies, refusals and `Close`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// The aperture is no longer exported.
    Revoked = 1,
    /// The descriptor's tag, or the burst's key check, does not match.
    BadKey = 2,
    /// The import does not grant this access.
    NoRights = 3,
    /// The access is outside the imported range.
    OutOfBounds = 4,
    /// The exporter's policy excludes the importer.
    Denied = 5,
    /// No such endpoint.
    NoSuchEndpoint = 6,
    /// The destination's queue is full.
    QueueFull = 7,
    /// The frame was malformed.
    Malformed = 8,
    /// The descriptor names another NIC.
    NotOurs = 9,
    /// Too large.
    TooLarge = 10,
    /// A duplicate link between the same two NICs (the other one wins).
    Duplicate = 11,
    /// Authentication failed.
    AuthFailed = 12,
    /// Too many bad frames: the sender is being disconnected.
    TooManyErrors = 13,
    /// The NIC is closing.
    Shutdown = 14,
    /// A bounded table is full (imports on one link, pending set-ups): try again later.
    TooMany = 15,
    /// The peer did not answer in time.
    Timeout = 16,
    /// The exporter's endpoint restriction excludes the importer.
    DeniedEndpoint = 17,
    /// Unknown reason.
    Other = 255,
}

impl Status {
    /// From its byte.
    pub fn from_u8(v: u8) -> Status {
        use Status::*;
        match v {
            0 => Ok,
            1 => Revoked,
            2 => BadKey,
            3 => NoRights,
            4 => OutOfBounds,
            5 => Denied,
            6 => NoSuchEndpoint,
            7 => QueueFull,
            8 => Malformed,
            9 => NotOurs,
            10 => TooLarge,
            11 => Duplicate,
            12 => AuthFailed,
            13 => TooManyErrors,
            14 => Shutdown,
            15 => TooMany,
            16 => Timeout,
            17 => DeniedEndpoint,
            _ => Other,
        }
    }
}

/// The destination address of a write burst (or the source of a read): which aperture, the
/// generation the importer was granted, the key check of its import, and the byte offset in
/// the aperture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Target {
    /// Aperture id on the receiving NIC.
    pub aperture: u32,
    /// Generation of the aperture id.
    pub generation: u32,
    /// Key check of the import (issued by the exporter when it granted the import).
    pub key: u64,
    /// Byte offset within the aperture.
    pub offset: u64,
}

impl Target {
    /// Encoded size.
    pub const LEN: usize = 24;

    /// The same target `n` bytes further (the header of the rest of a split burst).
    pub fn advance(self, n: u64) -> Target {
        Target { offset: self.offset.wrapping_add(n), ..self }
    }

    fn put(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.aperture.to_le_bytes());
        w.extend_from_slice(&self.generation.to_le_bytes());
        w.extend_from_slice(&self.key.to_le_bytes());
        w.extend_from_slice(&self.offset.to_le_bytes());
    }

    fn get(r: &mut Reader<'_>) -> Result<Target, WireError> {
        Ok(Target { aperture: r.u32()?, generation: r.u32()?, key: r.u64()?, offset: r.u64()? })
    }
}

/// `Hello`: the first frame in each direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// Flags (bit 0: authentication required).
    pub flags: u16,
    /// Address of the sending NIC.
    pub nic: SocketAddr,
    /// Random challenge for the peer's `Auth`.
    pub nonce: [u8; 16],
    /// Initial window of unacknowledged write bytes the sender accepts.
    pub credit: u64,
}

/// An out-of-band message between endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oob {
    /// Request id (for the `OobResult`).
    pub id: u64,
    /// Sending NIC.
    pub from_nic: SocketAddr,
    /// Sending endpoint port.
    pub from_port: u32,
    /// Destination endpoint port on the receiving NIC.
    pub to_port: u32,
    /// Payload.
    pub payload: [u8; OOB_PAYLOAD],
}

/// An import request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Import<'a> {
    /// Request id.
    pub id: u64,
    /// Importing NIC (must match the link's authenticated peer).
    pub importer_nic: SocketAddr,
    /// Importing endpoint port.
    pub importer_port: u32,
    /// The descriptor, in its binary form.
    pub desc: &'a [u8],
}

/// The answer to an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportReply {
    /// Request id.
    pub id: u64,
    /// Result.
    pub status: Status,
    /// Key check to carry in every burst to this import.
    pub key: u64,
    /// Length of the whole aperture.
    pub aperture_len: u64,
    /// Start of the granted range.
    pub offset: u64,
    /// Length of the granted range.
    pub len: u64,
    /// Rights granted (bit 0 read, bit 1 write).
    pub rights: u8,
}

/// A read request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReq {
    /// Request id.
    pub id: u64,
    /// Where to read.
    pub from: Target,
    /// How many bytes.
    pub len: u32,
}

/// Cumulative count of what the receiver has applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ack {
    /// Write bursts applied.
    pub writes: u64,
    /// Write bytes applied.
    pub bytes: u64,
}

/// A refused burst or read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Why.
    pub status: Status,
    /// Key check of the import concerned.
    pub key: u64,
    /// Offset of the refused access.
    pub offset: u64,
}

/// A decoded frame (write and read-response data come separately, see [`crate::Decoder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Hello.
    Hello(Hello),
    /// Authentication proof.
    Auth([u8; 32]),
    /// A read request.
    ReadReq(ReadReq),
    /// An out-of-band message.
    Oob(Oob),
    /// The result of an out-of-band delivery.
    OobResult {
        /// Request id.
        id: u64,
        /// Result.
        status: Status,
    },
    /// An import request.
    Import(Import<'a>),
    /// An import reply.
    ImportReply(ImportReply),
    /// Release an import.
    Unimport {
        /// Key check of the import.
        key: u64,
    },
    /// Acknowledgement.
    Ack(Ack),
    /// Window grant.
    Credit {
        /// Bytes.
        bytes: u64,
    },
    /// A refusal.
    Refused(Refused),
    /// Keepalive probe.
    Ping {
        /// Echoed in the `Pong`.
        token: u64,
    },
    /// Keepalive answer.
    Pong {
        /// The `Ping`'s token.
        token: u64,
    },
    /// Orderly close.
    Close {
        /// Why.
        status: Status,
    },
    /// A notification attached to the writes before it (VMMC): `len` bytes at `to` have
    /// landed; the exporter posts an event to the aperture's owner.
    Notify {
        /// Where the message landed (checked like a write of `len` bytes).
        to: Target,
        /// Its length.
        len: u64,
    },
    /// The last frame of the hand-shake, from the acceptor: it keeps this connection, and
    /// traffic may flow.
    Welcome,
}

pub(crate) struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated);
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn addr(&mut self) -> Result<SocketAddr, WireError> {
        let fam = self.u8()?;
        let oct: [u8; 16] = self.array()?;
        let v6 = Ipv6Addr::from(oct);
        let ip = match fam {
            4 => IpAddr::V4(v6.to_ipv4_mapped().ok_or(WireError::BadField)?),
            6 => IpAddr::V6(v6),
            _ => return Err(WireError::BadField),
        };
        Ok(SocketAddr::new(ip, self.u16()?))
    }
    pub fn done(&self) -> Result<(), WireError> {
        if self.0.is_empty() { Ok(()) } else { Err(WireError::TrailingBytes) }
    }
}

pub(crate) fn put_addr(w: &mut Vec<u8>, a: SocketAddr) {
    let (fam, oct) = match a.ip() {
        IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => (6u8, v6.octets()),
    };
    w.push(fam);
    w.extend_from_slice(&oct);
    w.extend_from_slice(&a.port().to_le_bytes());
}

fn begin(out: &mut Vec<u8>, kind: u8) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, kind]);
    at
}

fn finish(out: &mut [u8], at: usize) {
    let len = (out.len() - at - PREFIX) as u32;
    out[at..at + PREFIX].copy_from_slice(&len.to_le_bytes());
}

/// The bytes of a `Write` frame that precede its data: send them, then the data (for
/// instance with one vectored write), and the peer receives one burst of `len` bytes.
pub fn write_header(to: &Target, len: usize) -> [u8; WRITE_HEADER] {
    let mut h = [0u8; WRITE_HEADER];
    h[..4].copy_from_slice(&((1 + Target::LEN + len) as u32).to_le_bytes());
    h[4] = kind::WRITE;
    h[5..9].copy_from_slice(&to.aperture.to_le_bytes());
    h[9..13].copy_from_slice(&to.generation.to_le_bytes());
    h[13..21].copy_from_slice(&to.key.to_le_bytes());
    h[21..29].copy_from_slice(&to.offset.to_le_bytes());
    h
}

/// The bytes of a `ReadResp` frame that precede its data.
pub fn read_resp_header(id: u64, status: Status, len: usize) -> [u8; READ_RESP_HEADER] {
    let mut h = [0u8; READ_RESP_HEADER];
    h[..4].copy_from_slice(&((1 + 9 + len) as u32).to_le_bytes());
    h[4] = kind::READ_RESP;
    h[5..13].copy_from_slice(&id.to_le_bytes());
    h[13] = status as u8;
    h
}

/// Append a whole `Write` frame (header and data) to `out`.
pub fn encode_write(to: &Target, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&write_header(to, data.len()));
    out.extend_from_slice(data);
}

/// Append a whole `ReadResp` frame to `out`.
pub fn encode_read_resp(id: u64, status: Status, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&read_resp_header(id, status, data.len()));
    out.extend_from_slice(data);
}

impl Frame<'_> {
    /// Append this frame, length prefix included, to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let at;
        match self {
            Frame::Hello(h) => {
                at = begin(out, kind::HELLO);
                out.extend_from_slice(&h.version.to_le_bytes());
                out.extend_from_slice(&h.flags.to_le_bytes());
                put_addr(out, h.nic);
                out.extend_from_slice(&h.nonce);
                out.extend_from_slice(&h.credit.to_le_bytes());
            }
            Frame::Auth(p) => {
                at = begin(out, kind::AUTH);
                out.extend_from_slice(p);
            }
            Frame::ReadReq(r) => {
                at = begin(out, kind::READ_REQ);
                out.extend_from_slice(&r.id.to_le_bytes());
                r.from.put(out);
                out.extend_from_slice(&r.len.to_le_bytes());
            }
            Frame::Oob(o) => {
                at = begin(out, kind::OOB);
                out.extend_from_slice(&o.id.to_le_bytes());
                put_addr(out, o.from_nic);
                out.extend_from_slice(&o.from_port.to_le_bytes());
                out.extend_from_slice(&o.to_port.to_le_bytes());
                out.extend_from_slice(&o.payload);
            }
            Frame::OobResult { id, status } => {
                at = begin(out, kind::OOB_RESULT);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(*status as u8);
            }
            Frame::Import(i) => {
                at = begin(out, kind::IMPORT);
                out.extend_from_slice(&i.id.to_le_bytes());
                put_addr(out, i.importer_nic);
                out.extend_from_slice(&i.importer_port.to_le_bytes());
                let d = &i.desc[..i.desc.len().min(MAX_SMALL - 64)];
                out.extend_from_slice(&(d.len() as u16).to_le_bytes());
                out.extend_from_slice(d);
            }
            Frame::ImportReply(r) => {
                at = begin(out, kind::IMPORT_REPLY);
                out.extend_from_slice(&r.id.to_le_bytes());
                out.push(r.status as u8);
                out.extend_from_slice(&r.key.to_le_bytes());
                out.extend_from_slice(&r.aperture_len.to_le_bytes());
                out.extend_from_slice(&r.offset.to_le_bytes());
                out.extend_from_slice(&r.len.to_le_bytes());
                out.push(r.rights);
            }
            Frame::Unimport { key } => {
                at = begin(out, kind::UNIMPORT);
                out.extend_from_slice(&key.to_le_bytes());
            }
            Frame::Ack(a) => {
                at = begin(out, kind::ACK);
                out.extend_from_slice(&a.writes.to_le_bytes());
                out.extend_from_slice(&a.bytes.to_le_bytes());
            }
            Frame::Credit { bytes } => {
                at = begin(out, kind::CREDIT);
                out.extend_from_slice(&bytes.to_le_bytes());
            }
            Frame::Refused(r) => {
                at = begin(out, kind::REFUSED);
                out.push(r.status as u8);
                out.extend_from_slice(&r.key.to_le_bytes());
                out.extend_from_slice(&r.offset.to_le_bytes());
            }
            Frame::Ping { token } => {
                at = begin(out, kind::PING);
                out.extend_from_slice(&token.to_le_bytes());
            }
            Frame::Pong { token } => {
                at = begin(out, kind::PONG);
                out.extend_from_slice(&token.to_le_bytes());
            }
            Frame::Close { status } => {
                at = begin(out, kind::CLOSE);
                out.push(*status as u8);
            }
            Frame::Notify { to, len } => {
                at = begin(out, kind::NOTIFY);
                to.put(out);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Frame::Welcome => at = begin(out, kind::WELCOME),
        }
        finish(out, at);
    }
}

/// Decode the body of a small (non-data) frame of `kind`.
pub(crate) fn decode_small(kind_: u8, body: &[u8]) -> Result<Frame<'_>, WireError> {
    let mut r = Reader(body);
    let f = match kind_ {
        kind::HELLO => Frame::Hello(Hello {
            version: r.u16()?,
            flags: r.u16()?,
            nic: r.addr()?,
            nonce: r.array()?,
            credit: r.u64()?,
        }),
        kind::AUTH => Frame::Auth(r.array()?),
        kind::READ_REQ => {
            let id = r.u64()?;
            let from = Target::get(&mut r)?;
            let len = r.u32()?;
            if u64::from(len) > MAX_DATA {
                return Err(WireError::TooLarge { kind: kind_, len: u64::from(len) });
            }
            Frame::ReadReq(ReadReq { id, from, len })
        }
        kind::OOB => Frame::Oob(Oob {
            id: r.u64()?,
            from_nic: r.addr()?,
            from_port: r.u32()?,
            to_port: r.u32()?,
            payload: r.array()?,
        }),
        kind::OOB_RESULT => Frame::OobResult { id: r.u64()?, status: Status::from_u8(r.u8()?) },
        kind::IMPORT => {
            let id = r.u64()?;
            let importer_nic = r.addr()?;
            let importer_port = r.u32()?;
            let n = r.u16()? as usize;
            Frame::Import(Import { id, importer_nic, importer_port, desc: r.take(n)? })
        }
        kind::IMPORT_REPLY => Frame::ImportReply(ImportReply {
            id: r.u64()?,
            status: Status::from_u8(r.u8()?),
            key: r.u64()?,
            aperture_len: r.u64()?,
            offset: r.u64()?,
            len: r.u64()?,
            rights: r.u8()?,
        }),
        kind::UNIMPORT => Frame::Unimport { key: r.u64()? },
        kind::ACK => Frame::Ack(Ack { writes: r.u64()?, bytes: r.u64()? }),
        kind::CREDIT => Frame::Credit { bytes: r.u64()? },
        kind::REFUSED => Frame::Refused(Refused { status: Status::from_u8(r.u8()?), key: r.u64()?, offset: r.u64()? }),
        kind::PING => Frame::Ping { token: r.u64()? },
        kind::PONG => Frame::Pong { token: r.u64()? },
        kind::CLOSE => Frame::Close { status: Status::from_u8(r.u8()?) },
        kind::NOTIFY => Frame::Notify { to: Target::get(&mut r)?, len: r.u64()? },
        kind::WELCOME => Frame::Welcome,
        other => return Err(WireError::UnknownKind(other)),
    };
    r.done()?;
    Ok(f)
}
