//! Address vectors: the table that turns an endpoint's address (what `fi_getname` gives, a
//! clan endpoint address as text, NUL-padded to [`ADDR_LEN`] bytes) into the small integer
//! (`fi_addr_t`) the data calls take. Safe Rust; `ffi` passes raw bytes in and out.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::{LazyLock, Mutex, RwLock};

/// Bytes of an address: a clan endpoint address as text, NUL-padded.
pub const ADDR_LEN: usize = 64;

/// One address, validated and interned: a handle of one word (copied, compared and hashed
/// as such on the data path, where a receive directed to a source and a send to a peer look
/// their peer up), its bytes kept once for the process ([`Addr::bytes`]). The bytes of
/// every address the process has seen stay for its lifetime: what the application inserts
/// in address vectors, and what its peers' senders announce (one per connection made to it).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Addr(u32);

/// Why an address was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    #[error("an address is {ADDR_LEN} bytes")]
    Length,
    #[error("not a clan endpoint address")]
    Malformed,
}

/// The process's addresses: bytes to handle, and handle to bytes.
#[derive(Default)]
struct Interned {
    ids: HashMap<[u8; ADDR_LEN], u32, BuildHasherDefault<rustc_hash::FxHasher>>,
    all: Vec<&'static [u8; ADDR_LEN]>,
}

static INTERNED: LazyLock<RwLock<Interned>> = LazyLock::new(RwLock::default);

impl Addr {
    /// From the bytes an application passes (exactly [`ADDR_LEN`], text then NULs).
    pub fn from_bytes(b: &[u8]) -> Result<Addr, AddrError> {
        let raw: [u8; ADDR_LEN] = b.try_into().map_err(|_| AddrError::Length)?;
        let end = raw.iter().position(|&c| c == 0).unwrap_or(ADDR_LEN);
        if raw[end..].iter().any(|&c| c != 0) {
            return Err(AddrError::Malformed);
        }
        let text = std::str::from_utf8(&raw[..end]).map_err(|_| AddrError::Malformed)?;
        text.parse::<clan::EndpointAddr>().map_err(|_| AddrError::Malformed)?;
        Ok(Addr::intern(raw))
    }

    /// Of a clan endpoint address.
    pub fn of(a: clan::EndpointAddr) -> Addr {
        let text = a.to_string();
        let mut raw = [0u8; ADDR_LEN];
        let n = text.len().min(ADDR_LEN);
        raw[..n].copy_from_slice(&text.as_bytes()[..n]);
        Addr::intern(raw)
    }

    fn intern(raw: [u8; ADDR_LEN]) -> Addr {
        if let Some(&i) = INTERNED.read().unwrap_or_else(|p| p.into_inner()).ids.get(&raw) {
            return Addr(i);
        }
        let mut t = INTERNED.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&i) = t.ids.get(&raw) {
            return Addr(i);
        }
        let i = u32::try_from(t.all.len()).unwrap_or(u32::MAX);
        // (kept for the process's lifetime: handles are never reused, so they never dangle)
        t.all.push(Box::leak(Box::new(raw)));
        t.ids.insert(raw, i);
        Addr(i)
    }

    pub fn bytes(&self) -> &'static [u8; ADDR_LEN] {
        // (every handle was made by `intern`, which pushed its bytes first)
        INTERNED.read().unwrap_or_else(|p| p.into_inner()).all.get(self.0 as usize).copied().unwrap_or(&[0; ADDR_LEN])
    }

    /// The text (without the padding).
    pub fn text(&self) -> &'static str {
        let b = self.bytes();
        let end = b.iter().position(|&c| c == 0).unwrap_or(ADDR_LEN);
        std::str::from_utf8(&b[..end]).unwrap_or("")
    }

    pub fn endpoint(&self) -> Option<clan::EndpointAddr> {
        self.text().parse().ok()
    }
}

impl std::fmt::Debug for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Addr({})", self.text())
    }
}

/// The table. Indices are handed out in order and never reused (a removed one stays empty),
/// as `FI_AV_TABLE` promises.
#[derive(Debug, Default)]
pub struct Table {
    entries: Mutex<Vec<Option<Addr>>>,
}

impl Table {
    pub fn insert(&self, a: Addr) -> u64 {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        e.push(Some(a));
        (e.len() - 1) as u64
    }

    pub fn lookup(&self, i: u64) -> Option<Addr> {
        let e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(i).ok().and_then(|i| e.get(i).copied().flatten())
    }

    /// False if `i` held nothing.
    pub fn remove(&self, i: u64) -> bool {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(i).ok().and_then(|i| e.get_mut(i)).and_then(Option::take).is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_garbage_is_refused() {
        let nic = clan::Nic::open(clan::NicConfig::default()).unwrap();
        let ep = nic.endpoint().unwrap();
        let a = Addr::of(ep.addr());
        assert_eq!(Addr::from_bytes(a.bytes()), Ok(a));
        assert_eq!(a.endpoint(), Some(ep.addr()));
        assert_eq!(Addr::from_bytes(&[0u8; 10]), Err(AddrError::Length));
        assert_eq!(Addr::from_bytes(&[b'x'; ADDR_LEN]), Err(AddrError::Malformed));
        assert_eq!(Addr::of(ep.addr()), a, "one handle per address");
        let mut trailing = *a.bytes();
        trailing[ADDR_LEN - 1] = b'z';
        assert_eq!(Addr::from_bytes(&trailing), Err(AddrError::Malformed));

        let t = Table::default();
        let (i, j) = (t.insert(a), t.insert(a));
        assert_eq!((i, j), (0, 1));
        assert_eq!(t.lookup(1), Some(a));
        assert!(t.remove(0) && !t.remove(0) && !t.remove(99));
        assert_eq!(t.lookup(0), None);
        assert_eq!(t.insert(a), 2, "indices are not reused");
    }
}
