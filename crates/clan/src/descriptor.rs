//! Descriptors: opaque, serialisable capabilities for apertures (the paper's "RDMA cookie").
//!
//! A descriptor names an aperture (NIC address, aperture id, generation), a byte range of it
//! and the rights granted (read, write), and carries a 128-bit tag that makes it unforgeable.
//!
//! ## The tag: a chain of MACs
//!
//! The exporting NIC holds a random per-aperture key `K` (derived from a secret of the NIC,
//! the aperture id and its generation). The descriptor of the whole aperture carries
//! `tag₀ = MAC_K(root)`. Anyone holding a descriptor can *narrow* it offline (sub-range, fewer
//! rights) by appending a caveat `cᵢ` and replacing the tag with `tagᵢ = MAC_{kdf(tagᵢ₋₁)}(cᵢ)`;
//! the exporter verifies by recomputing the chain from `K`, and checks that every caveat lies
//! within the previous one. Without `K`, nobody can compute a tag for a wider range or more
//! rights, nor remove a caveat (its tag is not recoverable from the next). BLAKE3 in keyed
//! mode is the MAC.
//!
//! ## Forms
//!
//! [`Descriptor::to_bytes`] gives a compact binary form (at most [`MAX_BYTES`] bytes) for
//! messages; `Display`/`FromStr` give `clan1.<base64url>` for logs, files and command lines.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use crate::addr::NicAddr;
use crate::error::DescriptorError;

/// Most derivations (caveats) one descriptor can carry.
pub const MAX_CAVEATS: usize = 4;
/// Largest binary form.
pub const MAX_BYTES: usize = 4 + 19 + 4 + 4 + 8 + 1 + MAX_CAVEATS * 17 + 16;

const MAGIC: [u8; 2] = *b"C1";
const TEXT_PREFIX: &str = "clan1.";

/// Access rights granted by a descriptor.
///
/// ```
/// use clan::Rights;
///
/// assert_eq!(Rights::READ | Rights::WRITE, Rights::READ_WRITE);
/// assert!(Rights::READ_WRITE.contains(Rights::READ));
/// assert!(!Rights::READ.contains(Rights::WRITE));
/// assert_eq!(Rights::WRITE.to_string(), "w");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rights(u8);

impl Rights {
    /// Read only.
    pub const READ: Rights = Rights(1);
    /// Write only.
    pub const WRITE: Rights = Rights(2);
    /// Read and write.
    pub const READ_WRITE: Rights = Rights(3);

    /// Whether all of `other`'s rights are in `self`.
    pub fn contains(self, other: Rights) -> bool {
        self.0 & other.0 == other.0
    }
    /// Raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }
    fn from_bits(b: u8) -> Option<Rights> {
        (b != 0 && b & !3 == 0).then_some(Rights(b))
    }
}

impl std::ops::BitOr for Rights {
    type Output = Rights;
    fn bitor(self, o: Rights) -> Rights {
        Rights(self.0 | o.0)
    }
}

impl fmt::Display for Rights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            1 => "r",
            2 => "w",
            _ => "rw",
        })
    }
}

/// One narrowing step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Caveat {
    offset: u64,
    len: u64,
    rights: Rights,
}

impl Caveat {
    fn bytes(&self) -> [u8; 17] {
        let mut b = [0u8; 17];
        b[..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16] = self.rights.0;
        b
    }
}

/// A capability for (part of) an aperture. Cheap to clone; safe to send anywhere.
///
/// Its text form (`clan1.…`, `Display`/`FromStr`) travels in any message, file or command
/// line; the importer parses it back and imports it:
///
/// ```
/// use clan::Descriptor;
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = server.export(4096)?;
/// let text = ap.descriptor().to_string();
/// assert!(text.starts_with("clan1."));
///
/// let desc: Descriptor = text.parse()?;
/// assert_eq!(desc, ap.descriptor());
/// assert_eq!((desc.nic(), desc.offset(), desc.len()), (nic.addr(), 0, 4096));
/// client.import(&desc)?.write(0, b"hi")?;
/// assert!("clan1.not-base64!".parse::<Descriptor>().is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Descriptor {
    nic: NicAddr,
    aperture: u32,
    generation: u32,
    /// The whole aperture (offset 0, this length, read-write) is the root of the chain.
    aperture_len: u64,
    caveats: Vec<Caveat>,
    tag: [u8; 16],
}

impl fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Descriptor")
            .field("nic", &self.nic)
            .field("aperture", &self.aperture)
            .field("generation", &self.generation)
            .field("offset", &self.offset())
            .field("len", &self.len())
            .field("rights", &self.rights())
            .finish_non_exhaustive()
    }
}

fn root_bytes(aperture: u32, generation: u32, len: u64) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..4].copy_from_slice(&aperture.to_le_bytes());
    b[4..8].copy_from_slice(&generation.to_le_bytes());
    b[8..16].copy_from_slice(&len.to_le_bytes());
    b[16] = Rights::READ_WRITE.0;
    b
}

fn mac(key: &[u8; 32], msg: &[u8]) -> [u8; 16] {
    let h = blake3::keyed_hash(key, msg);
    let mut t = [0u8; 16];
    t.copy_from_slice(&h.as_bytes()[..16]);
    t
}

fn chain_key(tag: &[u8; 16]) -> [u8; 32] {
    blake3::derive_key("clan descriptor caveat v1", tag)
}

/// The per-aperture key `K` from the NIC secret.
pub(crate) fn aperture_key(nic_secret: &[u8; 32], aperture: u32, generation: u32) -> [u8; 32] {
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&aperture.to_le_bytes());
    msg[4..].copy_from_slice(&generation.to_le_bytes());
    let h = blake3::keyed_hash(nic_secret, &msg);
    *h.as_bytes()
}

impl Descriptor {
    /// The root descriptor of an aperture (whole range, read-write), made by its exporter.
    pub(crate) fn root(nic: NicAddr, aperture: u32, generation: u32, len: u64, key: &[u8; 32]) -> Descriptor {
        let tag = mac(key, &root_bytes(aperture, generation, len));
        Descriptor { nic, aperture, generation, aperture_len: len, caveats: Vec::new(), tag }
    }

    /// Whether the tag chain verifies against the aperture key (the exporter's check).
    pub(crate) fn verify(&self, key: &[u8; 32]) -> bool {
        let mut tag = mac(key, &root_bytes(self.aperture, self.generation, self.aperture_len));
        for c in &self.caveats {
            tag = mac(&chain_key(&tag), &c.bytes());
        }
        // Constant-time comparison.
        tag.iter().zip(self.tag.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// Exporting NIC.
    pub fn nic(&self) -> NicAddr {
        self.nic
    }
    /// Aperture id on that NIC.
    pub fn aperture(&self) -> u32 {
        self.aperture
    }
    /// Generation of the aperture id (changes on every re-export).
    pub fn generation(&self) -> u32 {
        self.generation
    }
    /// Length of the whole aperture.
    pub fn aperture_len(&self) -> u64 {
        self.aperture_len
    }
    /// Start of the granted range within the aperture.
    pub fn offset(&self) -> u64 {
        self.caveats.last().map_or(0, |c| c.offset)
    }
    /// Length of the granted range.
    pub fn len(&self) -> u64 {
        self.caveats.last().map_or(self.aperture_len, |c| c.len)
    }
    /// Whether the grant covers less than its whole aperture (example at
    /// [`Descriptor::derive`]). Another process of the exporter's host imports such a
    /// descriptor through a link (its accesses are checked and applied by the exporter's NIC),
    /// never by mapping the aperture's memory, which would reach beyond the grant.
    pub fn is_narrowed(&self) -> bool {
        self.offset() != 0 || self.len() != self.aperture_len
    }
    /// Whether the granted range is empty (never: derivation refuses it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rights granted.
    pub fn rights(&self) -> Rights {
        self.caveats.last().map_or(Rights::READ_WRITE, |c| c.rights)
    }

    /// A narrower descriptor: `len` bytes at `offset` *relative to this descriptor's range*,
    /// with `rights` (a subset of this descriptor's). Needs no contact with the exporter.
    ///
    /// ```
    /// use clan::{AccessError, DescriptorError, Rights};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// ap.write(1000, b"read me")?;
    /// // Read-only, 100 bytes at 1000: all the client will ever reach.
    /// let narrow = ap.descriptor().derive(1000, 100, Rights::READ)?;
    /// assert!(narrow.is_narrowed());
    /// assert_eq!((narrow.offset(), narrow.len(), narrow.rights()), (1000, 100, Rights::READ));
    /// let m = client.import(&narrow)?;
    /// let mut got = [0u8; 7];
    /// m.read(0, &mut got)?; // offset 0 of the grant is byte 1000 of the aperture
    /// assert_eq!(&got, b"read me");
    /// assert_eq!(m.write(0, b"x"), Err(AccessError::NotWritable));
    /// // Narrowing never widens.
    /// assert_eq!(narrow.derive(0, 100, Rights::READ_WRITE), Err(DescriptorError::RightsEscalation));
    /// assert!(matches!(narrow.derive(50, 51, Rights::READ), Err(DescriptorError::NotWithin { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn derive(&self, offset: u64, len: u64, rights: Rights) -> Result<Descriptor, DescriptorError> {
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(DescriptorError::NotWithin { offset, len, parent_len: self.len() });
        }
        if !self.rights().contains(rights) {
            return Err(DescriptorError::RightsEscalation);
        }
        if self.caveats.len() >= MAX_CAVEATS {
            return Err(DescriptorError::TooDeep(MAX_CAVEATS));
        }
        let c = Caveat { offset: self.offset() + offset, len, rights };
        let mut d = self.clone();
        d.tag = mac(&chain_key(&self.tag), &c.bytes());
        d.caveats.push(c);
        Ok(d)
    }

    /// The compact binary form, for messages: 55 bytes, and 17 more per narrowing.
    ///
    /// ```
    /// use clan::{Descriptor, DescriptorError};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let ap = ep.export(4096)?;
    /// let d = ap.descriptor();
    /// let bytes = d.to_bytes();
    /// assert_eq!(bytes.len(), 55);
    /// assert_eq!(d.derive(0, 8, clan::Rights::READ)?.to_bytes().len(), 55 + 17);
    /// assert_eq!(Descriptor::from_bytes(&bytes)?, d);
    /// assert_eq!(Descriptor::from_bytes(&bytes[..10]), Err(DescriptorError::BadLength));
    /// assert_eq!(Descriptor::from_bytes(b"not one"), Err(DescriptorError::BadMagic));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_BYTES);
        b.extend_from_slice(&MAGIC);
        b.push(self.caveats.len() as u8);
        b.push(0);
        match self.nic.ip() {
            IpAddr::V4(v4) => {
                b.push(4);
                b.extend_from_slice(&v4.to_ipv6_mapped().octets());
            }
            IpAddr::V6(v6) => {
                b.push(6);
                b.extend_from_slice(&v6.octets());
            }
        }
        b.extend_from_slice(&self.nic.port().to_le_bytes());
        b.extend_from_slice(&self.aperture.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.aperture_len.to_le_bytes());
        for c in &self.caveats {
            b.extend_from_slice(&c.bytes());
        }
        b.extend_from_slice(&self.tag);
        b
    }

    /// Parse the binary form. Validates structure (not the tag: only the exporter can,
    /// when the descriptor is imported: example at [`Descriptor::to_bytes`]).
    pub fn from_bytes(b: &[u8]) -> Result<Descriptor, DescriptorError> {
        if b.len() < 4 || b[..2] != MAGIC {
            return Err(DescriptorError::BadMagic);
        }
        let depth = b[2] as usize;
        if depth > MAX_CAVEATS || b[3] != 0 {
            return Err(DescriptorError::BadField);
        }
        let want = 4 + 19 + 4 + 4 + 8 + depth * 17 + 16;
        if b.len() != want {
            return Err(DescriptorError::BadLength);
        }
        let mut p = 4;
        let mut take = |n: usize| {
            let s = &b[p..p + n];
            p += n;
            s
        };
        let family = take(1)[0];
        let octets: [u8; 16] = take(16).try_into().map_err(|_| DescriptorError::BadLength)?;
        let v6 = Ipv6Addr::from(octets);
        let ip = match family {
            4 => IpAddr::V4(v6.to_ipv4_mapped().ok_or(DescriptorError::BadField)?),
            6 => IpAddr::V6(v6),
            _ => return Err(DescriptorError::BadField),
        };
        let u16_at = |s: &[u8]| u16::from_le_bytes([s[0], s[1]]);
        let u32_at = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let u64_at = |s: &[u8]| u64::from_le_bytes(s[..8].try_into().unwrap_or([0; 8]));
        let port = u16_at(take(2));
        let aperture = u32_at(take(4));
        let generation = u32_at(take(4));
        let aperture_len = u64_at(take(8));
        let mut caveats = Vec::with_capacity(depth);
        let (mut lo, mut hi, mut rights) = (0u64, aperture_len, Rights::READ_WRITE);
        for _ in 0..depth {
            let s = take(17);
            let c = Caveat {
                offset: u64_at(&s[..8]),
                len: u64_at(&s[8..16]),
                rights: Rights::from_bits(s[16]).ok_or(DescriptorError::BadField)?,
            };
            // Each caveat must narrow the previous one.
            let end = c.offset.checked_add(c.len).ok_or(DescriptorError::BadField)?;
            if c.len == 0 || c.offset < lo || end > hi || !rights.contains(c.rights) {
                return Err(DescriptorError::BadField);
            }
            (lo, hi, rights) = (c.offset, end, c.rights);
            caveats.push(c);
        }
        let tag: [u8; 16] = take(16).try_into().map_err(|_| DescriptorError::BadLength)?;
        if aperture_len == 0 {
            return Err(DescriptorError::BadField);
        }
        Ok(Descriptor { nic: NicAddr::new(ip, port), aperture, generation, aperture_len, caveats, tag })
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{TEXT_PREFIX}{}", data_encoding::BASE64URL_NOPAD.encode(&self.to_bytes()))
    }
}

impl FromStr for Descriptor {
    type Err = DescriptorError;
    fn from_str(s: &str) -> Result<Descriptor, DescriptorError> {
        let body = s.trim().strip_prefix(TEXT_PREFIX).ok_or(DescriptorError::BadText)?;
        let bytes = data_encoding::BASE64URL_NOPAD.decode(body.as_bytes()).map_err(|_| DescriptorError::BadText)?;
        Descriptor::from_bytes(&bytes)
    }
}

/// Fuzz harness (see `fuzz/fuzz_targets/descriptor.rs`): not part of the API.
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let Some((&ctl, rest)) = data.split_first() else { return };
    let d = if ctl & 1 == 0 {
        Descriptor::from_bytes(rest).ok()
    } else {
        std::str::from_utf8(rest).ok().and_then(|s| s.parse::<Descriptor>().ok())
    };
    let Some(d) = d else { return };
    // Whatever decodes encodes back to the same value, in both forms.
    assert_eq!(Descriptor::from_bytes(&d.to_bytes()).as_ref(), Ok(&d));
    assert_eq!(d.to_string().parse::<Descriptor>().as_ref(), Ok(&d));
    assert!(d.offset().checked_add(d.len()).is_some_and(|end| end <= d.aperture_len()));
    // Narrowing never widens, never adds rights, and never panics.
    let off = u64::from(ctl >> 1) % d.len().max(1);
    if let Ok(n) = d.derive(off, d.len() - off, d.rights()) {
        assert!(n.offset() >= d.offset() && n.offset() + n.len() <= d.offset() + d.len());
        assert!(d.rights().contains(n.rights()));
        assert_eq!(Descriptor::from_bytes(&n.to_bytes()).as_ref(), Ok(&n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> [u8; 32] {
        aperture_key(&[7u8; 32], 3, 9)
    }

    fn root() -> Descriptor {
        Descriptor::root(NicAddr::localhost(7000), 3, 9, 1 << 20, &key())
    }

    #[test]
    fn root_verifies_and_round_trips() {
        let d = root();
        assert!(d.verify(&key()));
        assert!(!d.verify(&aperture_key(&[7u8; 32], 3, 10)), "other generation");
        let b = Descriptor::from_bytes(&d.to_bytes()).unwrap();
        assert_eq!(b, d);
        let s = d.to_string();
        assert!(s.starts_with("clan1."));
        assert_eq!(s.parse::<Descriptor>().unwrap(), d);
        assert_eq!((d.offset(), d.len(), d.rights()), (0, 1 << 20, Rights::READ_WRITE));
    }

    #[test]
    fn derive_narrows_and_verifies() {
        let d = root().derive(4096, 8192, Rights::READ).unwrap();
        assert_eq!((d.offset(), d.len(), d.rights()), (4096, 8192, Rights::READ));
        assert!(d.verify(&key()));
        let dd = d.derive(100, 50, Rights::READ).unwrap();
        assert_eq!(dd.offset(), 4196);
        assert!(dd.verify(&key()));
        assert_eq!(
            d.derive(0, 8193, Rights::READ),
            Err(DescriptorError::NotWithin { offset: 0, len: 8193, parent_len: 8192 })
        );
        assert_eq!(d.derive(0, 1, Rights::READ_WRITE), Err(DescriptorError::RightsEscalation));
        assert_eq!(
            d.derive(0, 0, Rights::READ).unwrap_err(),
            DescriptorError::NotWithin { offset: 0, len: 0, parent_len: 8192 }
        );
    }

    #[test]
    fn tampering_is_detected() {
        let d = root().derive(0, 4096, Rights::READ).unwrap();
        let mut b = d.to_bytes();
        // Escalate the rights byte of the caveat to read-write.
        let rights_at = b.len() - 16 - 1;
        b[rights_at] = 3;
        let forged = Descriptor::from_bytes(&b).unwrap();
        assert_eq!(forged.rights(), Rights::READ_WRITE);
        assert!(!forged.verify(&key()));
        // Drop the caveat entirely (keep the narrowed tag): fails as well.
        let mut root_form = root();
        root_form.tag = d.tag;
        assert!(!root_form.verify(&key()));
        // Flip a tag bit.
        let mut b = root().to_bytes();
        let n = b.len();
        b[n - 1] ^= 1;
        assert!(!Descriptor::from_bytes(&b).unwrap().verify(&key()));
    }

    #[test]
    fn malformed_inputs_are_errors() {
        assert_eq!(Descriptor::from_bytes(b""), Err(DescriptorError::BadMagic));
        assert_eq!(Descriptor::from_bytes(b"XX\0\0"), Err(DescriptorError::BadMagic));
        let b = root().to_bytes();
        assert_eq!(Descriptor::from_bytes(&b[..b.len() - 1]), Err(DescriptorError::BadLength));
        assert_eq!("clan1.!!".parse::<Descriptor>(), Err(DescriptorError::BadText));
        assert_eq!("nope".parse::<Descriptor>(), Err(DescriptorError::BadText));
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = Descriptor::from_bytes(&bytes);
        }

        #[test]
        fn derive_chains_verify(steps in prop::collection::vec((0u64..1000, 1u64..1000, any::<bool>()), 0..4)) {
            let mut d = root();
            for (off, len, ro) in steps {
                let off = off % d.len();
                let len = len.min(d.len() - off);
                let r = if ro { Rights::READ } else { d.rights() };
                d = d.derive(off, len, r).unwrap();
                prop_assert!(d.verify(&key()));
                prop_assert_eq!(Descriptor::from_bytes(&d.to_bytes()).unwrap(), d.clone());
            }
        }
    }
}
