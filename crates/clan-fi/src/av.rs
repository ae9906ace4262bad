//! Address vectors: the table that turns an endpoint's address (what `fi_getname` gives, a
//! clan endpoint address as text, NUL-padded to [`ADDR_LEN`] bytes) into the small integer
//! (`fi_addr_t`) the data calls take. Safe Rust; `ffi` passes raw bytes in and out.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock, RwLock};

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
/// as `FI_AV_TABLE` promises. Its entries live in segments that double in size (segment `k`
/// holds `64 << k`), made as the table grows and never moved: a lookup, which every send of
/// the application makes, is two loads and takes no lock; inserts and removals take one.
#[derive(Debug)]
pub struct Table {
    /// Entry: 0 when empty, else the address's handle plus one.
    segments: [OnceLock<Box<[AtomicU64]>>; SEGMENTS],
    /// Indices handed out.
    next: Mutex<u64>,
}

/// Segments of a table: `64 * (2^32 - 1)` entries in all.
const SEGMENTS: usize = 32;

impl Default for Table {
    fn default() -> Table {
        Table { segments: std::array::from_fn(|_| OnceLock::new()), next: Mutex::new(0) }
    }
}

/// Which segment index `i` is in, and where in it.
fn locate(i: u64) -> Option<(usize, usize)> {
    let j = (i / 64).checked_add(1)?;
    let k = 63 - j.leading_zeros() as usize;
    (k < SEGMENTS).then(|| (k, (i - 64 * ((1u64 << k) - 1)) as usize))
}

impl Table {
    fn slot(&self, i: u64) -> Option<&AtomicU64> {
        let (k, at) = locate(i)?;
        self.segments[k].get()?.get(at)
    }

    /// Add `a`; its index (`None`: the table is full).
    pub fn insert(&self, a: Addr) -> Option<u64> {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let i = *next;
        let (k, at) = locate(i)?;
        let seg = self.segments[k].get_or_init(|| (0..64usize << k).map(|_| AtomicU64::new(0)).collect());
        // SYNC POINT: pairs with the Acquire load in `lookup` (another thread may send to
        // the index as soon as it is handed out).
        seg.get(at)?.store(u64::from(a.0) + 1, Ordering::Release);
        *next += 1;
        Some(i)
    }

    pub fn lookup(&self, i: u64) -> Option<Addr> {
        // SYNC POINT: pairs with the Release store in `insert`.
        match self.slot(i)?.load(Ordering::Acquire) {
            0 => None,
            v => u32::try_from(v - 1).ok().map(Addr),
        }
    }

    /// False if `i` held nothing.
    pub fn remove(&self, i: u64) -> bool {
        let _next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        self.slot(i).is_some_and(|e| e.swap(0, Ordering::AcqRel) != 0)
    }

    pub fn len(&self) -> usize {
        *self.next.lock().unwrap_or_else(|p| p.into_inner()) as usize
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
        let (i, j) = (t.insert(a).unwrap(), t.insert(a).unwrap());
        assert_eq!((i, j), (0, 1));
        assert_eq!(t.lookup(1), Some(a));
        assert!(t.remove(0) && !t.remove(0) && !t.remove(99));
        assert_eq!(t.lookup(0), None);
        assert_eq!(t.insert(a), Some(2), "indices are not reused");
        // Across segments (64, then 128, 256 …): every index finds its own address.
        let b = Addr::of(nic.endpoint().unwrap().addr());
        for k in 3..1000u64 {
            assert_eq!(t.insert(if k % 2 == 0 { a } else { b }), Some(k));
        }
        for k in 3..1000u64 {
            assert_eq!(t.lookup(k), Some(if k % 2 == 0 { a } else { b }), "index {k}");
        }
        assert_eq!((t.lookup(1000), t.lookup(u64::MAX)), (None, None));
        assert_eq!(t.len(), 1000);
        assert_eq!(locate(64 * ((1 << 32) - 1)), None, "past the last segment");
    }
}
