//! Pools: the memory of apertures exported for one peer NIC, carved from shared memfds.
//!
//! An aperture of its own costs two memfds (its data and its tripwire index) and two mappings
//! for as long as it lives: a server with ten thousand connections would hold twenty thousand
//! descriptors for its sides alone, past the usual `RLIMIT_NOFILE`. Apertures exported *for*
//! one peer NIC ([`crate::ExportConfig::for_peer`]; every connection side of `clan-proto`)
//! are carved instead from *chunks*: one data memfd of [`CHUNK_DATA`] bytes and one index
//! memfd of [`CHUNK_INDEX`] bytes, each mapped once by the exporter and shared by every
//! aperture of the pool that fits in them (hundreds of page-sized ones, thousands of smaller
//! ones, which are carved on cache lines several to a page: [`PART_ALIGN`]). The importer maps only
//! its aperture's pages of the chunk and keeps no descriptor, as for any import.
//!
//! # Protection
//!
//! A process that imports one aperture of a chunk receives the chunk's memfds (the kernel
//! grants per file, never per byte), and so can reach every aperture carved from that chunk.
//! A pool is therefore one peer's, and:
//!
//! - only its NIC may import its apertures: their import policy names it
//!   (`clan_wire::grant::Policy::nics`), on every path;
//! - the pool is bound to the first process that imports from it (its kernel-verified pid
//!   and uid) and refuses every other ([`Pool::bind`]); when that NIC goes away the pool is
//!   retired: a later process on the same address gets a new pool, never this memory;
//! - only whole, read-write descriptors of a pooled aperture are served by handing over the
//!   chunk; a read-only or narrowed one is served mediated, through a link
//!   (`Refusal::Narrowed`), so a read-only grant is never upgraded by the chunk's other
//!   apertures;
//! - memory of a pool is reused only within that pool (zeroed first), never for anyone else;
//!   and since the only process that could keep a descriptor of it is the peer itself, it is
//!   reused as soon as the peer has unimported it (an own aperture whose memory went to
//!   another process is never reused by default).
//!
//! So pool only apertures whose descriptors go to that peer anyway (a connection's buffers):
//! the peer may read and write all of them once it imports one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use clan_shm::memfd::Memfd;
use clan_shm::segment::{Access as SegAccess, Segment};

/// Granularity of what a pool carves (a cache line).
pub const PART_ALIGN: u64 = clan_shm::segment::PART_ALIGN as u64;
use clan_wire::grant::Refusal;

use crate::addr::NicAddr;
use crate::error::ExportError;
use crate::lock;

/// Bytes of data per chunk (address space: its pages hold memory only where apertures were
/// written, and a slice given back is wiped or punched out: [`WIPE_MAX`]).
pub const CHUNK_DATA: u64 = 16 << 20;
/// Bytes of index per chunk.
pub const CHUNK_INDEX: u64 = 1 << 20;
/// Largest data capacity carved from a pool (larger apertures get memfds of their own): 2
/// MiB, so that a stream side of the default geometry (a 1 MiB ring, a 64 KiB post area and
/// its control page) is pooled too, a dozen to a chunk: connecting makes no memfd then.
pub const MAX_POOLED: u64 = CHUNK_DATA / 8;
/// A slice given back with at most this many bytes holding memory (data and index: the pages
/// its aperture's users wrote) is *wiped*: zeros stored over those bytes through the
/// exporter's mapping, its pages kept. A larger one is punched out. Punching a hole unmaps
/// its pages from every process that maps the chunk (a TLB shootdown, an interrupt to each
/// CPU running one) and both sides fault them in again at the next connection: for a
/// connection that wrote a page or two, that was most of its close and of the next one's
/// set-up.
pub const WIPE_MAX: u64 = 64 << 10;
/// Bytes of wiped slices a pool keeps (resident, zeroed, for its next apertures) at most;
/// past it, slices given back are punched out.
pub const WARM_MAX: u64 = 4 << 20;
/// Bytes of wiped slices all the pools of a NIC keep at most (a server with many peers).
pub const NIC_WARM_MAX: u64 = 16 << 20;

/// One data memfd and one index memfd, mapped once, shared by the apertures carved from them.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub data: Memfd,
    pub index: Memfd,
    pub data_seg: Arc<Segment>,
    pub index_seg: Arc<Segment>,
    /// A read-only open of the index, made at the first grant and sent with every later one
    /// (rather than a new open through `/proc/self/fd` per connection). Only the pool's one
    /// process ever receives it ([`Pool::bind`]), so sharing the open file description among
    /// its grants lets nobody else see anything.
    index_ro: std::sync::OnceLock<std::os::fd::OwnedFd>,
}

impl Chunk {
    fn create() -> Result<Chunk, ExportError> {
        let fd = |e, what| crate::aperture::fd_or_io(e, what);
        let data = Memfd::create("clan-pool", CHUNK_DATA).map_err(|e| fd(e, "creating a pool's data memfd"))?;
        let index =
            Memfd::create("clan-pool-index", CHUNK_INDEX).map_err(|e| fd(e, "creating a pool's index memfd"))?;
        let map = |m: &Memfd, len: u64, what| {
            Segment::map(m, 0, len as usize, SegAccess::ReadWrite)
                .map(Arc::new)
                .map_err(|source| ExportError::Io { context: what, source })
        };
        let data_seg = map(&data, CHUNK_DATA, "mapping a pool's data")?;
        let index_seg = map(&index, CHUNK_INDEX, "mapping a pool's index")?;
        Ok(Chunk { data, index, data_seg, index_seg, index_ro: std::sync::OnceLock::new() })
    }

    /// A read-only open of the index, for a grant (see `index_ro`): made at the first call,
    /// the same one after.
    pub fn index_read_only(&self) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        if let Some(fd) = self.index_ro.get() {
            return Ok(fd.as_fd());
        }
        let fd = self.index.reopen_read_only()?;
        // (a racing grant may have set it first: either open serves)
        Ok(self.index_ro.get_or_init(|| fd).as_fd())
    }
}

/// An aperture's part of a chunk. Dropping it gives it back to its pool (zeroed).
#[derive(Debug)]
pub(crate) struct Slice {
    pub pool: Arc<Pool>,
    pub chunk: Arc<Chunk>,
    /// Where the data starts in the chunk's data memfd (a multiple of [`PART_ALIGN`]).
    pub data_off: u64,
    /// Where the index starts in the chunk's index memfd (a multiple of [`PART_ALIGN`]).
    pub index_off: u64,
    /// The index's length (a multiple of [`PART_ALIGN`]).
    pub index_len: u64,
    /// The data's length (a multiple of [`PART_ALIGN`]).
    pub cap: u64,
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.pool.give_back(self);
    }
}

/// Slices given back, by (data capacity, index length): (chunk, data offset, index offset,
/// bytes wiped rather than punched: still resident).
type FreeSlices = HashMap<(u64, u64), Vec<(Arc<Chunk>, u64, u64, u64)>>;

#[derive(Debug, Default)]
struct PoolState {
    /// Every chunk; the last is being filled.
    chunks: Vec<Arc<Chunk>>,
    /// Slices carved and not yet dropped: when none is left, the chunks go, but the last
    /// one of a bound pool ([`Pool::give_back`]).
    live: usize,
    /// Bytes of the last chunk's data and index handed out.
    data_used: u64,
    index_used: u64,
    /// Slices given back (zeroed).
    free: FreeSlices,
    /// Resident bytes of the slices in `free` (wiped, not punched): at most [`WARM_MAX`];
    /// counted in the NIC's total too ([`Pool::set_warm`]).
    warm: u64,
    /// The process that imports from the pool (pid, uid), once one did.
    bound: Option<(u32, u32)>,
    retired: bool,
}

/// The memory of the apertures exported for one peer NIC.
#[derive(Debug)]
pub(crate) struct Pool {
    pub peer: NicAddr,
    state: Mutex<PoolState>,
    /// Wiped bytes kept by all the pools of the NIC: at most [`NIC_WARM_MAX`].
    nic_warm: Arc<AtomicU64>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // Relaxed: a budget, ordering nothing.
        self.nic_warm.fetch_sub(st.warm, Ordering::Relaxed);
    }
}

impl Pool {
    fn new(peer: NicAddr, nic_warm: Arc<AtomicU64>) -> Pool {
        Pool { peer, state: Mutex::new(PoolState::default()), nic_warm }
    }

    /// Set the pool's wiped bytes kept to `to`, and the NIC's total with them.
    fn set_warm(&self, st: &mut PoolState, to: u64) {
        // Relaxed: a budget, ordering nothing (every change is made under the pool's lock,
        // and the NIC's total is only compared with its limit).
        if to >= st.warm {
            self.nic_warm.fetch_add(to - st.warm, Ordering::Relaxed);
        } else {
            self.nic_warm.fetch_sub(st.warm - to, Ordering::Relaxed);
        }
        st.warm = to;
    }

    /// Count `bytes` more wiped bytes kept, if the pool's and the NIC's limits allow.
    fn reserve_warm(&self, st: &mut PoolState, bytes: u64) -> bool {
        if st.retired || st.warm + bytes > WARM_MAX {
            return false;
        }
        // Relaxed: as in `set_warm`.
        let fits = |w: u64| (w + bytes <= NIC_WARM_MAX).then_some(w + bytes);
        if self.nic_warm.fetch_update(Ordering::Relaxed, Ordering::Relaxed, fits).is_err() {
            return false;
        }
        st.warm += bytes;
        true
    }

    /// Carve `cap` bytes of data (at most [`MAX_POOLED`]) and `index_len` bytes of index,
    /// both multiples of [`PART_ALIGN`]: zero-filled. Small apertures are carved several to
    /// a page: a peer that uses thousands of them at random then touches as few pages (TLB
    /// entries) and cache lines as their sizes allow.
    pub fn carve(self: &Arc<Pool>, cap: u64, index_len: u64) -> Result<Slice, ExportError> {
        debug_assert!(cap <= MAX_POOLED && index_len <= CHUNK_INDEX);
        debug_assert!(cap % PART_ALIGN == 0 && index_len % PART_ALIGN == 0);
        let mut s = lock(&self.state);
        let slice =
            |chunk, data_off, index_off| Slice { pool: self.clone(), chunk, data_off, index_off, index_len, cap };
        if let Some((chunk, d, i, warm)) = s.free.get_mut(&(cap, index_len)).and_then(Vec::pop) {
            s.live += 1;
            let to = s.warm - warm;
            self.set_warm(&mut s, to);
            return Ok(slice(chunk, d, i));
        }
        let fits = |s: &PoolState| {
            !s.chunks.is_empty() && s.data_used + cap <= CHUNK_DATA && s.index_used + index_len <= CHUNK_INDEX
        };
        if !fits(&s) {
            s.chunks.push(Arc::new(Chunk::create()?));
            s.data_used = 0;
            s.index_used = 0;
        }
        let chunk = s.chunks.last().expect("a chunk was just made").clone();
        let (d, i) = (s.data_used, s.index_used);
        s.live += 1;
        s.data_used += cap;
        s.index_used += index_len;
        Ok(slice(chunk, d, i))
    }

    /// Take back a slice whose aperture is gone (its memory reachable by the pool's peer
    /// at most, `nic.rs::releasable`): zeroed, for the pool's next aperture of that size. A
    /// retired pool keeps nothing. A pool whose last slice this was lets its chunks go,
    /// except the last one of a pool bound to a process of this host (retired, and so
    /// emptied, when that process goes): all its slices given back, it holds little memory
    /// (its pages are holes, but for at most [`WARM_MAX`] bytes of wiped ones) and two
    /// descriptors and mappings, and a peer that connects and closes in a loop does not make
    /// and unmake a chunk per connection (two memfds, their seals and mappings here, mappings
    /// in the peer).
    ///
    /// Zeroed how: the few bytes that hold memory of a slice that wrote little are wiped in
    /// place, under the pool's lock (no system call, and its pages stay mapped here and in
    /// the peer), while the pool's wiped bytes stay within [`WARM_MAX`] and the NIC's within
    /// [`NIC_WARM_MAX`]; anything else is punched out ([`WIPE_MAX`]).
    fn give_back(&self, s: &Slice) {
        let data = written(&s.chunk.data, s.data_off, s.cap, WIPE_MAX);
        let index = data.as_ref().and_then(|d| written(&s.chunk.index, s.index_off, s.index_len, WIPE_MAX - d.bytes));
        let mut st = lock(&self.state);
        let wiped = match (data, index) {
            (Some(d), Some(i)) if self.reserve_warm(&mut st, d.bytes + i.bytes) => {
                let bytes = d.bytes + i.bytes;
                if d.wipe(&s.chunk.data_seg) && i.wipe(&s.chunk.index_seg) {
                    Some(bytes)
                } else {
                    let to = st.warm - bytes;
                    self.set_warm(&mut st, to);
                    None
                }
            }
            _ => None,
        };
        // (wiped: under the lock all along, so the pool cannot have been retired meanwhile)
        let (zeroed, warm) = match wiped {
            Some(bytes) => (true, bytes),
            None => {
                drop(st);
                let punched = s.chunk.data.zero(s.data_off, s.cap).is_ok()
                    && s.chunk.index.zero(s.index_off, s.index_len).is_ok();
                st = lock(&self.state);
                (punched, 0)
            }
        };
        st.live -= 1;
        let keep = zeroed && !st.retired;
        if keep {
            st.free.entry((s.cap, s.index_len)).or_default().push((s.chunk.clone(), s.data_off, s.index_off, warm));
        }
        if st.live > 0 {
            return;
        }
        if !keep || st.bound.is_none() {
            st.chunks.clear();
            st.free.clear();
            self.set_warm(&mut st, 0);
            st.data_used = 0;
            st.index_used = 0;
        } else if st.chunks.len() > 1 {
            let last = st.chunks.pop().expect("more than one chunk");
            st.chunks = vec![last.clone()];
            st.free.retain(|_, v| {
                v.retain(|(c, _, _, _)| Arc::ptr_eq(c, &last));
                !v.is_empty()
            });
            let to = st.free.values().flatten().map(|e| e.3).sum();
            self.set_warm(&mut st, to);
        }
    }

    /// May process `pid` of user `uid` receive the pool's memory? The first to ask binds the
    /// pool; any other process is refused, and so is everyone once the pool is retired.
    pub fn bind(&self, pid: u32, uid: u32) -> Result<(), Refusal> {
        let mut s = lock(&self.state);
        if s.retired {
            return Err(Refusal::DeniedEndpoint);
        }
        match s.bound {
            None => {
                s.bound = Some((pid, uid));
                Ok(())
            }
            Some(b) if b == (pid, uid) => Ok(()),
            Some(_) => Err(Refusal::DeniedPid),
        }
    }

    fn retire(&self) {
        let mut s = lock(&self.state);
        s.retired = true;
        s.free.clear();
        self.set_warm(&mut s, 0);
        s.chunks.clear();
    }

    fn chunks(&self) -> usize {
        lock(&self.state).chunks.len()
    }

    fn is_empty(&self) -> bool {
        lock(&self.state).live == 0
    }
}

/// The parts of a range of a chunk's memfd that hold memory (shared memory keeps pages only
/// where something was written; the rest are holes, which read as zeros).
#[derive(Debug)]
struct Written {
    /// (start, end) in the memfd, clipped to the range.
    parts: Vec<(u64, u64)>,
    bytes: u64,
}

impl Written {
    /// Store zeros over every part, through the exporter's mapping of the memfd.
    fn wipe(&self, seg: &Segment) -> bool {
        self.parts.iter().all(|&(start, end)| seg.fill(start as usize, (end - start) as usize, 0).is_ok())
    }
}

/// What of `[off, off + len)` in `fd` holds memory, if that is at most `max` bytes (`None`:
/// more, or the file could not say: punch it instead). The memfd's open file description is
/// shared with the peer, which may move its position: `SEEK_DATA` and `SEEK_HOLE` return
/// their answer, they do not depend on the position.
fn written(fd: &Memfd, off: u64, len: u64, max: u64) -> Option<Written> {
    use rustix::fs::SeekFrom;
    let end = off + len;
    let mut w = Written { parts: Vec::new(), bytes: 0 };
    let mut at = off;
    while at < end {
        let start = match rustix::fs::seek(fd, SeekFrom::Data(at)) {
            Ok(d) if d >= end => break,
            Ok(d) => d.max(at),
            // No data from `at` to the end of the file.
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return None,
        };
        let stop = rustix::fs::seek(fd, SeekFrom::Hole(start)).ok()?.min(end);
        if stop <= start {
            return None;
        }
        w.bytes += stop - start;
        if w.bytes > max {
            return None;
        }
        w.parts.push((start, stop));
        at = stop;
    }
    Some(w)
}

/// A NIC's pools, by peer NIC.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    by_peer: Mutex<HashMap<NicAddr, Arc<Pool>>>,
    /// Wiped bytes kept by all of them ([`NIC_WARM_MAX`]).
    warm: Arc<AtomicU64>,
}

impl Pools {
    /// The pool for `peer` (a new one if it has none, or its last was retired).
    pub fn for_peer(&self, peer: NicAddr) -> Arc<Pool> {
        let mut m = lock(&self.by_peer);
        if let Some(p) = m.get(&peer) {
            return p.clone();
        }
        // Forget the pools of other peers that hold nothing (peers over links are never
        // told gone), so that the table stays as small as the live peers.
        m.retain(|_, p| !p.is_empty());
        m.entry(peer).or_insert_with(|| Arc::new(Pool::new(peer, self.warm.clone()))).clone()
    }

    /// `peer` went away (its NIC closed, its process died): its pool takes no new aperture
    /// and is granted to nobody; its memory goes when the last aperture carved from it does.
    pub fn retire(&self, peer: NicAddr) {
        if let Some(p) = lock(&self.by_peer).remove(&peer) {
            tracing::debug!(peer = %p.peer, chunks = p.chunks(), "pool retired");
            p.retire();
        }
    }

    /// Pools, and chunks (memfd pairs) in them.
    pub fn counts(&self) -> (u64, u64) {
        let m = lock(&self.by_peer);
        (m.len() as u64, m.values().map(|p| p.chunks() as u64).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every grant of a chunk's index gets a read-only descriptor of it, opened at the first:
    /// it cannot be mapped for writing.
    #[test]
    fn a_chunks_index_is_handed_out_read_only_every_time() {
        let c = Chunk::create().unwrap();
        for _ in 0..3 {
            let fd = c.index_read_only().unwrap().try_clone_to_owned().unwrap();
            assert!(Segment::map(&fd, 0, 4096, SegAccess::ReadOnly).is_ok());
            assert!(Segment::map(&fd, 0, 4096, SegAccess::ReadWrite).is_err(), "a writable index");
        }
    }

    #[test]
    fn a_pool_is_one_process_and_dies_with_its_peer() {
        let pools = Pools::default();
        let peer = NicAddr::localhost(7);
        let p = pools.for_peer(peer);
        assert_eq!(p.bind(10, 1000), Ok(()));
        assert_eq!(p.bind(10, 1000), Ok(()), "the bound process again");
        assert_eq!(p.bind(11, 1000), Err(Refusal::DeniedPid), "another process of the same user");
        let a = p.carve(4096, 4096).unwrap();
        let b = p.carve(4096, 4096).unwrap();
        assert!(Arc::ptr_eq(&a.chunk, &b.chunk) && a.data_off != b.data_off && a.index_off != b.index_off);
        a.chunk.data_seg.write(a.data_off as usize, b"old").unwrap();
        let (a_data, a_index) = (a.data_off, a.index_off);
        drop(a);
        let c = p.carve(4096, 4096).unwrap();
        assert_eq!((c.data_off, c.index_off), (a_data, a_index), "reused within the pool");
        let mut buf = [1u8; 3];
        c.chunk.data_seg.read(c.data_off as usize, &mut buf).unwrap();
        assert_eq!(buf, [0; 3], "zeroed before reuse");
        pools.retire(peer);
        assert_eq!(p.bind(10, 1000), Err(Refusal::DeniedEndpoint), "a retired pool is granted to nobody");
        drop(c);
        let q = pools.for_peer(peer);
        assert!(!Arc::ptr_eq(&p, &q), "a later process on the address gets a new pool");
        assert_eq!(q.bind(99, 1000), Ok(()));
        let d = q.carve(4096, 4096).unwrap();
        assert!(!Arc::ptr_eq(&d.chunk, &b.chunk), "never the retired pool's memory");
        let chunk = Arc::downgrade(&d.chunk);
        let (d_data, d_index) = (d.data_off, d.index_off);
        drop(d);
        // A bound pool whose apertures are all gone keeps one chunk for the next.
        assert_eq!(pools.counts().1, 1);
        let e = q.carve(4096, 4096).unwrap();
        assert!(Arc::ptr_eq(&e.chunk, &chunk.upgrade().unwrap()), "the kept chunk is used again");
        assert_eq!((e.data_off, e.index_off), (d_data, d_index));
        drop(e);
        // Retired, it keeps nothing.
        pools.retire(peer);
        assert!(chunk.upgrade().is_none(), "a retired pool whose apertures are all gone holds no memfd");
        assert_eq!(pools.counts(), (0, 0));
        // Nor does a pool nobody of this host imports from (a peer across a link).
        let r = pools.for_peer(NicAddr::localhost(11));
        drop(r.carve(4096, 4096).unwrap());
        assert_eq!(pools.counts(), (1, 0));
    }

    /// Whether byte `at` of `fd` holds memory (not a hole).
    fn resident(fd: &Memfd, at: u64) -> bool {
        rustix::fs::seek(fd, rustix::fs::SeekFrom::Data(at)).is_ok_and(|d| d == at)
    }

    fn warm(p: &Pool) -> u64 {
        lock(&p.state).warm
    }

    /// A slice that wrote a little is wiped in place (its pages stay, zeroed: nobody's TLB is
    /// shot down, nobody faults them in again); one that wrote more than [`WIPE_MAX`] is
    /// punched out. Either way, the next aperture carved there reads zeros.
    #[test]
    fn a_slice_given_back_is_wiped_if_it_wrote_little_and_punched_otherwise() {
        let pools = Pools::default();
        let p = pools.for_peer(NicAddr::localhost(12));
        p.bind(10, 1000).unwrap();
        let (small, big) = (p.carve(64 << 10, 4096).unwrap(), p.carve(1 << 20, 4096).unwrap());
        let (c, s_off, b_off) = (small.chunk.clone(), small.data_off, big.data_off);
        c.data_seg.write(s_off as usize + 5000, b"small").unwrap();
        c.index_seg.write(small.index_off as usize + 8, b"i").unwrap();
        c.data_seg.fill(b_off as usize, (WIPE_MAX + 4096) as usize, 3).unwrap();
        drop(small);
        assert!(resident(&c.data, s_off + 4096), "wiped: the written page stays");
        assert_eq!(warm(&p), 8192, "a data page and an index page kept, wiped");
        drop(big);
        assert!(!resident(&c.data, b_off), "punched: more than WIPE_MAX was written");
        assert_eq!(warm(&p), 8192);
        for (cap, off) in [(64 << 10, s_off), (1 << 20, b_off)] {
            let again = p.carve(cap, 4096).unwrap();
            assert_eq!(again.data_off, off, "reused");
            let mut buf = vec![1u8; cap as usize];
            c.data_seg.read(off as usize, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 0), "zeroed before reuse");
            let mut idx = [1u8; 64];
            c.index_seg.read(again.index_off as usize, &mut idx).unwrap();
            assert_eq!(idx, [0; 64]);
            std::mem::forget(again);
        }
        assert_eq!(warm(&p), 0, "a wiped slice taken again is no longer kept");
    }

    /// Wiped slices keep their pages: a pool keeps at most [`WARM_MAX`] bytes of them and
    /// punches the slices given back past it.
    #[test]
    fn a_pool_keeps_few_wiped_pages() {
        let pools = Pools::default();
        let p = pools.for_peer(NicAddr::localhost(13));
        p.bind(10, 1000).unwrap();
        // A page of data and a line of index written each (1 KiB of index: all in one chunk).
        let each = 4096 + 1024;
        let n = (WARM_MAX / each) as usize + 20;
        let s: Vec<Slice> = (0..n).map(|_| p.carve(4096, 1024).unwrap()).collect();
        assert_eq!(p.chunks(), 1);
        for x in &s {
            x.chunk.data_seg.write(x.data_off as usize, b"x").unwrap();
            x.chunk.index_seg.write(x.index_off as usize, b"x").unwrap();
        }
        let last = (s[n - 1].chunk.clone(), s[n - 1].data_off);
        drop(s);
        assert!(warm(&p) > WARM_MAX - each && warm(&p) <= WARM_MAX, "wiped up to the limit");
        assert!(!resident(&last.0.data, last.1), "punched past it");
        // The pool keeps them (and its last chunk) while it is bound; retired, nothing.
        pools.retire(NicAddr::localhost(13));
        assert_eq!(warm(&p), 0);
        assert_eq!(pools.warm.load(Ordering::Relaxed), 0);
    }

    /// All the pools of a NIC keep at most [`NIC_WARM_MAX`] wiped bytes between them, and a
    /// pool that goes takes its share with it.
    #[test]
    fn a_nics_pools_keep_few_wiped_pages_between_them() {
        let pools = Pools::default();
        let n_pools = (NIC_WARM_MAX / WARM_MAX) as u16 + 1;
        // A page of data written each, the index untouched (1 KiB each: all in one chunk).
        let per_pool = (WARM_MAX / 4096) as usize;
        let ps: Vec<Arc<Pool>> = (0..n_pools)
            .map(|k| {
                let p = pools.for_peer(NicAddr::localhost(100 + k));
                p.bind(10 + u32::from(k), 1000).unwrap();
                let s: Vec<Slice> = (0..per_pool).map(|_| p.carve(4096, 1024).unwrap()).collect();
                assert_eq!(p.chunks(), 1);
                for x in &s {
                    x.chunk.data_seg.write(x.data_off as usize, b"x").unwrap();
                }
                drop(s);
                p
            })
            .collect();
        let total: u64 = ps.iter().map(|p| warm(p)).sum();
        assert_eq!(total, pools.warm.load(Ordering::Relaxed));
        assert_eq!(total, NIC_WARM_MAX, "wiped up to the NIC's limit");
        assert_eq!(warm(&ps[n_pools as usize - 1]), 0, "the last pool found the NIC's budget spent");
        for k in 0..n_pools {
            pools.retire(NicAddr::localhost(100 + k));
        }
        drop(ps);
        assert_eq!(pools.warm.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_empty_bound_pool_keeps_its_last_chunk_only() {
        let pools = Pools::default();
        let p = pools.for_peer(NicAddr::localhost(9));
        p.bind(10, 1000).unwrap();
        // Two chunks' worth of the largest pooled slices.
        let n = (CHUNK_DATA / MAX_POOLED) as usize + 1;
        let s: Vec<Slice> = (0..n).map(|_| p.carve(MAX_POOLED, 4096).unwrap()).collect();
        assert_eq!(p.chunks(), 2);
        let first = Arc::downgrade(&s[0].chunk);
        let last = s[n - 1].chunk.clone();
        drop(s);
        assert_eq!(p.chunks(), 1);
        assert!(first.upgrade().is_none(), "the other chunks go");
        let again = p.carve(MAX_POOLED, 4096).unwrap();
        assert!(Arc::ptr_eq(&again.chunk, &last), "the last one is used again");
        drop(again);
        // Another peer's pool made later forgets this empty one (and its chunk).
        let _other = pools.for_peer(NicAddr::localhost(10));
        assert_eq!(pools.counts(), (1, 0));
    }

    #[test]
    fn small_slices_are_carved_on_cache_lines_several_to_a_page() {
        let pools = Pools::default();
        let p = pools.for_peer(NicAddr::localhost(8));
        let s: Vec<Slice> = (0..8).map(|_| p.carve(320, 640).unwrap()).collect();
        for (i, x) in s.iter().enumerate() {
            assert_eq!((x.data_off, x.index_off), (i as u64 * 320, i as u64 * 640), "packed, in order");
            assert_eq!(x.data_off % PART_ALIGN + x.index_off % PART_ALIGN, 0);
        }
        // Given back, zeroed, and its lines only: the neighbours keep their bytes.
        s[1].chunk.data_seg.write(320, &[7; 320]).unwrap();
        s[2].chunk.data_seg.write(640, &[9; 8]).unwrap();
        let mut s = s;
        drop(s.remove(1));
        let again = p.carve(320, 640).unwrap();
        assert_eq!(again.data_off, 320, "reused");
        let mut b = [1u8; 320];
        again.chunk.data_seg.read(320, &mut b).unwrap();
        assert_eq!(b, [0; 320], "zeroed");
        let mut n = [0u8; 8];
        again.chunk.data_seg.read(640, &mut n).unwrap();
        assert_eq!(n, [9; 8], "the next slice's bytes are untouched");
    }
}
