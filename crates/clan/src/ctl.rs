//! The control protocol between the NICs of one host (over their abstract SEQPACKET
//! sockets): hello, import/unimport with fd passing, out-of-band delivery.
//!
//! Every message is one packet: a type byte, then fixed little-endian fields. Decoding
//! checks every length and value; a malformed message is an error, never a panic — the other
//! side is another process and its bytes are untrusted input.

use std::net::{IpAddr, Ipv6Addr};

use crate::addr::{EndpointAddr, NicAddr};

/// Largest control message.
pub const MAX_MSG: usize = 512;
/// Out-of-band payload size.
pub const OOB_PAYLOAD: usize = 40;

/// A request from a client NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message on a connection.
    Hello { nic: NicAddr, pid: u32 },
    /// Import a descriptor (binary form). `want_eq`: send the event queue's fds.
    Import { importer: EndpointAddr, want_eq: bool, desc: Vec<u8> },
    /// Release an import (no reply).
    Unimport { import_id: u64 },
    /// Deliver an out-of-band message.
    Oob { from: EndpointAddr, to_port: u32, payload: [u8; OOB_PAYLOAD] },
}

/// What an import grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportGrant {
    pub import_id: u64,
    pub aperture_len: u64,
    /// Data capacity (page multiple) = offset of the index in the memfd.
    pub cap: u64,
    pub eq_id: u32,
    pub nrings: u32,
    pub ring_cap: u32,
    pub trip_cap: u32,
    pub tripset_cap: u32,
    pub ring: u32,
    pub tag: u64,
    pub live: u64,
    pub read_only: bool,
    /// The event queue's memfd and eventfd follow the aperture memfd.
    pub eq_fds: bool,
}

/// Error codes of [`Reply::Err`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Code {
    Revoked = 1,
    BadKey = 2,
    DeniedUid = 3,
    DeniedPid = 4,
    DeniedEndpoint = 5,
    TooManyProducers = 6,
    NoSuchEndpoint = 7,
    QueueFull = 8,
    NotOurs = 9,
    Malformed = 10,
    Internal = 11,
    NeedHello = 12,
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
            _ => return None,
        })
    }
}

/// A reply from the serving NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    HelloOk { nic: NicAddr },
    ImportOk(ImportGrant),
    Ok,
    Err { code: Code, detail: String },
}

/// A malformed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed control message")]
pub struct Malformed;

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn nic(&mut self, a: NicAddr) -> &mut Self {
        let (fam, oct) = match a.ip() {
            IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6u8, v6.octets()),
        };
        self.u8(fam).bytes(&oct).u16(a.port())
    }
    fn ep(&mut self, e: EndpointAddr) -> &mut Self {
        self.nic(e.nic).u32(e.port)
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed);
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| Malformed)?))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| Malformed)?))
    }
    fn u64(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| Malformed)?))
    }
    fn bool(&mut self) -> Result<bool, Malformed> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Malformed),
        }
    }
    fn nic(&mut self) -> Result<NicAddr, Malformed> {
        let fam = self.u8()?;
        let oct: [u8; 16] = self.take(16)?.try_into().map_err(|_| Malformed)?;
        let v6 = Ipv6Addr::from(oct);
        let ip = match fam {
            4 => IpAddr::V4(v6.to_ipv4_mapped().ok_or(Malformed)?),
            6 => IpAddr::V6(v6),
            _ => return Err(Malformed),
        };
        Ok(NicAddr::new(ip, self.u16()?))
    }
    fn ep(&mut self) -> Result<EndpointAddr, Malformed> {
        Ok(EndpointAddr::new(self.nic()?, self.u32()?))
    }
    fn end(self) -> Result<(), Malformed> {
        if self.0.is_empty() { Ok(()) } else { Err(Malformed) }
    }
}

impl Request {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(128));
        match self {
            Request::Hello { nic, pid } => {
                w.u8(1).nic(*nic).u32(*pid);
            }
            Request::Import { importer, want_eq, desc } => {
                w.u8(2).ep(*importer).u8(u8::from(*want_eq)).u16(desc.len() as u16).bytes(desc);
            }
            Request::Unimport { import_id } => {
                w.u8(3).u64(*import_id);
            }
            Request::Oob { from, to_port, payload } => {
                w.u8(4).ep(*from).u32(*to_port).bytes(payload);
            }
        }
        w.0
    }

    /// Decode, validating everything.
    pub fn decode(b: &[u8]) -> Result<Request, Malformed> {
        let mut r = R(b);
        let req = match r.u8()? {
            1 => Request::Hello { nic: r.nic()?, pid: r.u32()? },
            2 => {
                let importer = r.ep()?;
                let want_eq = r.bool()?;
                let n = r.u16()? as usize;
                if n > crate::descriptor::MAX_BYTES {
                    return Err(Malformed);
                }
                Request::Import { importer, want_eq, desc: r.take(n)?.to_vec() }
            }
            3 => Request::Unimport { import_id: r.u64()? },
            4 => {
                let from = r.ep()?;
                let to_port = r.u32()?;
                let payload = r.take(OOB_PAYLOAD)?.try_into().map_err(|_| Malformed)?;
                Request::Oob { from, to_port, payload }
            }
            _ => return Err(Malformed),
        };
        r.end()?;
        Ok(req)
    }
}

impl Reply {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(128));
        match self {
            Reply::HelloOk { nic } => {
                w.u8(0x81).nic(*nic);
            }
            Reply::ImportOk(g) => {
                w.u8(0x82)
                    .u64(g.import_id)
                    .u64(g.aperture_len)
                    .u64(g.cap)
                    .u32(g.eq_id)
                    .u32(g.nrings)
                    .u32(g.ring_cap)
                    .u32(g.trip_cap)
                    .u32(g.tripset_cap)
                    .u32(g.ring)
                    .u64(g.tag)
                    .u64(g.live)
                    .u8(u8::from(g.read_only))
                    .u8(u8::from(g.eq_fds));
            }
            Reply::Ok => {
                w.u8(0x83);
            }
            Reply::Err { code, detail } => {
                let d = &detail.as_bytes()[..detail.len().min(256)];
                w.u8(0x84).u16(*code as u16).u16(d.len() as u16).bytes(d);
            }
        }
        w.0
    }

    /// Decode, validating everything.
    pub fn decode(b: &[u8]) -> Result<Reply, Malformed> {
        let mut r = R(b);
        let rep = match r.u8()? {
            0x81 => Reply::HelloOk { nic: r.nic()? },
            0x82 => Reply::ImportOk(ImportGrant {
                import_id: r.u64()?,
                aperture_len: r.u64()?,
                cap: r.u64()?,
                eq_id: r.u32()?,
                nrings: r.u32()?,
                ring_cap: r.u32()?,
                trip_cap: r.u32()?,
                tripset_cap: r.u32()?,
                ring: r.u32()?,
                tag: r.u64()?,
                live: r.u64()?,
                read_only: r.bool()?,
                eq_fds: r.bool()?,
            }),
            0x83 => Reply::Ok,
            0x84 => {
                let code = Code::from_u16(r.u16()?).ok_or(Malformed)?;
                let n = r.u16()? as usize;
                let detail = String::from_utf8_lossy(r.take(n)?).into_owned();
                Reply::Err { code, detail }
            }
            _ => return Err(Malformed),
        };
        r.end()?;
        Ok(rep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let ep = EndpointAddr::new("10.77.0.1:7000".parse().unwrap(), 9);
        let reqs = [
            Request::Hello { nic: "[::1]:5".parse().unwrap(), pid: 42 },
            Request::Import { importer: ep, want_eq: true, desc: vec![1, 2, 3] },
            Request::Unimport { import_id: u64::MAX },
            Request::Oob { from: ep, to_port: 3, payload: [7; 40] },
        ];
        for q in reqs {
            assert_eq!(Request::decode(&q.encode()).unwrap(), q);
        }
        let g = ImportGrant {
            import_id: 1,
            aperture_len: 2,
            cap: 4096,
            eq_id: 3,
            nrings: 4,
            ring_cap: 8,
            trip_cap: 9,
            tripset_cap: 10,
            ring: 1,
            tag: 11,
            live: 13,
            read_only: true,
            eq_fds: false,
        };
        for p in [
            Reply::HelloOk { nic: ep.nic },
            Reply::ImportOk(g),
            Reply::Ok,
            Reply::Err { code: Code::BadKey, detail: "x".into() },
        ] {
            assert_eq!(Reply::decode(&p.encode()).unwrap(), p);
        }
    }

    proptest! {
        #[test]
        fn decoding_garbage_never_panics(b in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = Request::decode(&b);
            let _ = Reply::decode(&b);
        }

        #[test]
        fn truncation_is_an_error(cut in 0usize..60) {
            let q = Request::Oob { from: EndpointAddr::new(NicAddr::localhost(1), 2), to_port: 3, payload: [1; 40] };
            let e = q.encode();
            if cut < e.len() {
                prop_assert!(Request::decode(&e[..cut]).is_err());
            }
        }
    }
}
