//! Apertures: regions of memory an endpoint exports (page-aligned, but for the small ones
//! carved from a pool).
//!
//! Each aperture is two sealed memfds, both `0600` (`clan_shm::memfd`): its data (a page
//! multiple), and its tripwire index (`clan_shm::cam`: the lists and the entries) that every
//! importer reads to snoop its own writes. An importer of the whole aperture receives the
//! data memfd (a read-only open of it if its descriptor grants reading only) and a read-only
//! open of the index — never any other memory, and nothing it could write but the data it
//! was granted. An aperture exported for one peer NIC ([`crate::ExportConfig::for_peer`]) is
//! carved instead from a chunk of that peer's pool (`pool.rs`): the chunk then holds apertures
//! made for that same peer only.
//!
//! The owner accesses its aperture as local memory ([`Aperture::write`], [`Aperture::load_u64`],
//! …): those are plain loads and stores, invisible to the NIC, exactly like the CPU's
//! accesses to local memory next to a CLAN NIC. Traffic through the NIC (mappings, DMA, links)
//! fires tripwires.
//!
//! ## Unexport and reuse
//!
//! Unexporting revokes the descriptor generation at once: the index header's revocation word
//! changes, so every later access through a mapping and every import fails with a clear
//! error. Memory no other process ever received is recycled (the endpoint cache, zeroed
//! first) once the last local mapping of it is gone. Memory whose descriptors went to another
//! process is never recycled by default: that process may have kept the descriptor (or passed
//! it on) whatever it answered to the unimport, and would read and write the next aperture
//! made from it. [`crate::NicConfig::reuse_imported_apertures`] trusts importers instead
//! (recycling once every importing process has unimported or gone).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clan_shm::cam::{CAM_MAGIC, CamLayout, live_state};
use clan_shm::eq::CamMap;
use clan_shm::memfd::Memfd;
use clan_shm::segment::{self, Access as SegAccess, Segment};
use clan_shm::sync::{AtomicU32, AtomicU64};

use crate::addr::EndpointAddr;
use crate::config::ImportPolicy;
use crate::descriptor::Descriptor;
use crate::error::{AccessError, ExportError, TripwireError};
use crate::nic::NicInner;
use crate::pool::{Pool, Slice};
use crate::tripwire::{Tripwire, TripwireConfig, WatchOwner};
use crate::window::{Window, check_align, check_range};

/// Largest aperture.
pub const MAX_APERTURE: u64 = 1 << 40;

/// Most tripwire entries of one aperture's index.
pub const MAX_SLOTS: u32 = 1 << 20;

/// The length of the index of an aperture of capacity `cap` with `slots` entries (a whole
/// number of cache lines: a pool carves indexes several to a page).
pub(crate) fn index_len(cap: u64, slots: u32) -> u64 {
    (CamLayout::new(cap, slots).size as u64).next_multiple_of(crate::pool::PART_ALIGN)
}

/// Tripwire entries of a pooled aperture smaller than a page.
pub const SMALL_POOLED_SLOTS: u32 = 8;

/// The capacity of a pooled aperture of `len` bytes: under a page, a whole number of cache
/// lines (carved several to a page); else whole pages.
pub(crate) fn pooled_cap(len: u64) -> u64 {
    let page = segment::page_size() as u64;
    if len < page { len.next_multiple_of(crate::pool::PART_ALIGN) } else { len.next_multiple_of(page) }
}

/// Where an aperture's memory lives.
#[derive(Debug)]
pub(crate) enum Backing {
    /// Two memfds of its own: the data, and the index.
    Own { memfd: Memfd, index_fd: Memfd },
    /// Part of a chunk of a pool shared with one peer NIC (`pool.rs`).
    Pooled(Slice),
}

/// Tripwire entries of a pooled aperture's index. Pooled apertures are connection buffers
/// with a few tripwires each. One smaller than a page (an RPC party's buffer) gets
/// [`SMALL_POOLED_SLOTS`]: with its data it is then a few cache lines, many to a page. A
/// larger one gets at least 32, and as many more as fill its index's last page: a one-page
/// aperture's index is one page (58 entries) instead of sixteen (1024).
fn pooled_slots(cap: u64) -> u32 {
    const MIN: u32 = 32;
    if cap < segment::page_size() as u64 {
        return SMALL_POOLED_SLOTS;
    }
    let l = CamLayout::new(cap, MIN);
    let room = (segment::page_align(l.size) - l.entries_off) / std::mem::size_of::<clan_shm::trip::TripEntry>();
    (room as u32).clamp(MIN, MAX_SLOTS)
}

/// The recyclable memory of an aperture.
#[derive(Debug)]
pub(crate) struct ApertureMem {
    pub backing: Backing,
    pub seg: Arc<Segment>,
    pub cam: Arc<CamMap>,
    /// Data capacity (a page multiple; a pooled aperture under a page: a cache line
    /// multiple, [`pooled_cap`]).
    pub cap: u64,
    /// Tripwire entries of the index.
    pub slots: u32,
    /// A descriptor of this memory went to another process (it may keep it forever).
    pub handed_out: AtomicBool,
}

impl ApertureMem {
    pub fn create(cap: u64) -> Result<ApertureMem, ExportError> {
        let slots = CamLayout::default_cap(cap, MAX_SLOTS);
        let index_len = index_len(cap, slots);
        let memfd = Memfd::create("clan-aperture", cap).map_err(|e| fd_or_io(e, "creating the aperture memfd"))?;
        let index_fd =
            Memfd::create("clan-index", index_len).map_err(|e| fd_or_io(e, "creating the aperture index memfd"))?;
        let seg = Arc::new(
            Segment::map(&memfd, 0, cap as usize, SegAccess::ReadWrite)
                .map_err(|source| ExportError::Io { context: "mapping the aperture", source })?,
        );
        let index_seg = Arc::new(
            Segment::map(&index_fd, 0, index_len as usize, SegAccess::ReadWrite)
                .map_err(|source| ExportError::Io { context: "mapping the aperture index", source })?,
        );
        let cam = Arc::new(CamMap::new(index_seg, 0, cap, slots).map_err(|e| ExportError::Io {
            context: "laying out the aperture index",
            source: std::io::Error::other(e),
        })?);
        Ok(ApertureMem {
            backing: Backing::Own { memfd, index_fd },
            seg,
            cam,
            cap,
            slots,
            handed_out: AtomicBool::new(false),
        })
    }

    /// Memory carved from `pool` (zero-filled) for an aperture of `len` bytes, if it is small
    /// enough to be pooled.
    pub fn pooled(pool: &Arc<Pool>, len: u64) -> Result<Option<ApertureMem>, ExportError> {
        let cap = pooled_cap(len);
        let slots = pooled_slots(cap);
        let index_len = index_len(cap, slots);
        if cap > crate::pool::MAX_POOLED || index_len > crate::pool::CHUNK_INDEX / 8 {
            return Ok(None);
        }
        let slice = pool.carve(cap, index_len)?;
        let part = |seg: &Arc<Segment>, off: u64, len: u64| {
            Segment::sub(seg, off as usize, len as usize).map(Arc::new).map_err(|e| ExportError::Io {
                context: "carving an aperture from its pool",
                source: std::io::Error::other(e.to_string()),
            })
        };
        let seg = part(&slice.chunk.data_seg, slice.data_off, cap)?;
        let index_seg = part(&slice.chunk.index_seg, slice.index_off, index_len)?;
        let cam = Arc::new(CamMap::new(index_seg, 0, cap, slots).map_err(|e| ExportError::Io {
            context: "laying out the aperture index",
            source: std::io::Error::other(e),
        })?);
        Ok(Some(ApertureMem {
            backing: Backing::Pooled(slice),
            seg,
            cam,
            cap,
            slots,
            handed_out: AtomicBool::new(false),
        }))
    }

    /// The pool the memory was carved from, if any.
    pub fn slice(&self) -> Option<&Slice> {
        match &self.backing {
            Backing::Pooled(s) => Some(s),
            Backing::Own { .. } => None,
        }
    }

    /// The data memfd, the index memfd, and where the aperture starts in each.
    pub fn fds(&self) -> (&Memfd, &Memfd, u64, u64) {
        match &self.backing {
            Backing::Own { memfd, index_fd } => (memfd, index_fd, 0, 0),
            Backing::Pooled(s) => (&s.chunk.data, &s.chunk.index, s.data_off, s.index_off),
        }
    }

    /// Zero data and index (returns the pages to the system).
    pub fn reset(&self) -> std::io::Result<()> {
        match &self.backing {
            Backing::Own { memfd, index_fd } => {
                memfd.zero(0, memfd.len())?;
                index_fd.zero(0, index_fd.len())
            }
            Backing::Pooled(s) => {
                s.chunk.data.zero(s.data_off, self.cap)?;
                s.chunk.index.zero(s.index_off, s.index_len)
            }
        }
    }

    /// Initialise the index header for a new export.
    pub fn init(&self, generation: u32, tag: u64) {
        let (h, m) = (self.cam.view().header, self.cam.view().meta);
        m.len.store(self.cap, Ordering::Relaxed);
        m.tag.store(tag, Ordering::Relaxed);
        h.wide_head.store(0, Ordering::Relaxed);
        m.magic.store(CAM_MAGIC, Ordering::Relaxed);
        // SYNC POINT: pairs with the importers' Acquire check of `state` (`Window::check_live`).
        h.state.store(live_state(generation), Ordering::Release);
    }

    pub fn revoke(&self) {
        // SYNC POINT: pairs with `Window::check_live`'s Acquire load.
        self.cam.view().header.state.store(0, Ordering::Release);
    }
}

pub(crate) fn fd_or_io(e: std::io::Error, context: &'static str) -> ExportError {
    if e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error())
        || e.raw_os_error() == Some(rustix::io::Errno::NFILE.raw_os_error())
    {
        ExportError::FdLimit { limit: crate::nic::fd_limit() }
    } else {
        ExportError::Io { context, source: e }
    }
}

/// The tag of an aperture's index: what its tripwire entries carry.
pub(crate) fn aperture_tag(id: u32, generation: u32) -> u64 {
    (u64::from(generation & 0x7fff_ffff) << 32) | u64::from(id)
}

#[derive(Debug)]
pub(crate) struct ApertureInner {
    pub nic: Arc<NicInner>,
    pub id: u32,
    pub generation: u32,
    pub len: u64,
    pub endpoint: EndpointAddr,
    /// `Option` only so that `Drop` can hand the memory over for reuse.
    pub mem: Option<Arc<ApertureMem>>,
    pub window: Window,
    pub watch: Arc<WatchOwner>,
    pub policy: ImportPolicy,
    pub revoked: AtomicBool,
}

impl ApertureInner {
    pub fn mem(&self) -> &Arc<ApertureMem> {
        self.mem.as_ref().expect("aperture memory present until drop")
    }

    pub fn unexport(&self) {
        if self.revoked.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(endpoint = %self.endpoint, aperture = self.id, generation = self.generation, "unexported");
        self.mem().revoke();
        self.watch.clear();
        self.watch.eq.revoke_grants(self.id, self.generation);
        self.nic.aperture_unexported(self.id, self.generation);
    }

    /// The key its descriptors' tags chain from: derived from the NIC's secret when asked
    /// (at an export or an import, not on the data path), not kept in every aperture.
    pub fn key(&self) -> [u8; 32] {
        crate::descriptor::aperture_key(&self.nic.secret, self.id, self.generation)
    }

    pub fn descriptor(&self) -> Descriptor {
        Descriptor::root(self.nic.addr, self.id, self.generation, self.len, &self.key())
    }

    /// Post a notification for `len` bytes at `offset` to the owner's event queue.
    pub fn post_notification(&self, offset: u64, len: u64) {
        let (aperture, generation) = (self.id, self.generation);
        self.window.port.post(crate::event_queue::Word::Notification { aperture, generation, offset, len });
    }
}

impl Drop for ApertureInner {
    fn drop(&mut self) {
        self.unexport();
        if let Some(mem) = self.mem.take() {
            self.nic.aperture_released(self.id, self.generation, mem);
        }
    }
}

/// An exported region of memory. Dropping it unexports it. `Send` and `Sync`.
///
/// Made by [`crate::Endpoint::export`]; it lives as long as its endpoint (closing or dropping
/// the endpoint unexports it too). The owner reads and writes it as local memory; importers
/// reach it through the [`Descriptor`] it hands out.
///
/// ```
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// let ap = ep.export(10_000)?;
/// assert_eq!(ap.len(), 10_000);
/// assert_eq!(ap.endpoint(), ep.addr());
/// ap.write(100, b"local store")?;
/// ap.store_u64(0, 42)?; // aligned words are atomic
/// let mut back = [0u8; 11];
/// ap.read(100, &mut back)?;
/// assert_eq!((&back, ap.load_u64(0)?), (b"local store", 42));
/// let d = ap.descriptor();
/// assert_eq!((d.aperture(), d.generation(), d.len()), (ap.id(), ap.generation(), 10_000));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Aperture {
    pub(crate) inner: Arc<ApertureInner>,
    /// The data and the exported length, held here as well: a load or store of one's own
    /// aperture follows no pointer to reach the memory (at thousands of connections each
    /// pointer followed is a cache miss).
    data: Segment,
    len: u64,
}

impl Aperture {
    pub(crate) fn new(inner: Arc<ApertureInner>) -> Aperture {
        let data = Segment::whole(&inner.mem().seg);
        let len = inner.len;
        Aperture { inner, data, len }
    }

    /// The descriptor of the whole aperture (read-write). Narrow it with
    /// [`Descriptor::derive`] before handing it out if the importer needs less.
    pub fn descriptor(&self) -> Descriptor {
        self.inner.descriptor()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the aperture is empty (never).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Aperture id on this NIC.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Generation of the id.
    pub fn generation(&self) -> u32 {
        self.inner.generation
    }

    /// The exporting endpoint.
    pub fn endpoint(&self) -> EndpointAddr {
        self.inner.endpoint
    }

    /// Mappings of this aperture currently held by other processes.
    ///
    /// ```
    /// // Another NIC stands for another process of the host.
    /// let (mine, theirs) = (clan::Nic::open_default()?, clan::Nic::open_default()?);
    /// let (ep, other) = (mine.endpoint()?, theirs.endpoint()?);
    /// let ap = ep.export(4096)?;
    /// let _own = ep.import(&ap.descriptor())?;
    /// assert_eq!(ap.remote_imports(), 0, "imports of this process do not count");
    /// let _m = other.import(&ap.descriptor())?;
    /// assert_eq!(ap.remote_imports(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remote_imports(&self) -> u32 {
        self.inner.nic.remote_refs(self.inner.id, self.inner.generation)
    }

    #[inline]
    fn seg(&self) -> &Segment {
        &self.data
    }

    /// Copy `src` into the aperture at `off` (a local store: fires no tripwire).
    #[inline]
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), AccessError> {
        check_range(off, src.len() as u64, self.len)?;
        self.seg().write(off as usize, src).map_err(|_| AccessError::NotWritable)
    }

    /// Copy from the aperture at `off` into `dst` (a local load).
    #[inline]
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        check_range(off, dst.len() as u64, self.len)?;
        self.seg().read(off as usize, dst).map_err(|_| AccessError::NotReadable)
    }

    /// Fill `len` bytes at `off` with `byte`.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let ap = ep.export(4096)?;
    /// ap.fill(8, 4, 0xab)?;
    /// let mut b = [0u8; 6];
    /// ap.read(7, &mut b)?;
    /// assert_eq!(b, [0, 0xab, 0xab, 0xab, 0xab, 0]);
    /// assert!(ap.fill(4090, 7, 0).is_err(), "past the end");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fill(&self, off: u64, len: u64, byte: u8) -> Result<(), AccessError> {
        check_range(off, len, self.len)?;
        self.seg().fill(off as usize, len as usize, byte).map_err(|_| AccessError::NotWritable)
    }

    #[inline]
    fn word<T: segment::Shared>(&self, off: u64, size: u64) -> Result<&T, AccessError> {
        check_range(off, size, self.len)?;
        check_align(off, size)?;
        self.seg().view::<T>(off as usize).map_err(|_| AccessError::Misaligned { offset: off, align: size })
    }

    /// Atomic load (Acquire) of the aligned word at `off`: the way to poll a flag or counter
    /// that a remote writer updates.
    ///
    /// ```
    /// use clan::AccessError;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = ep.export(4096)?;
    /// peer.import(&ap.descriptor())?.store_u64(64, 7)?;
    /// assert_eq!(ap.load_u64(64)?, 7);
    /// assert_eq!(ap.load_u64(3), Err(AccessError::Misaligned { offset: 3, align: 8 }));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn load_u64(&self, off: u64) -> Result<u64, AccessError> {
        Ok(self.word::<AtomicU64>(off, 8)?.load(Ordering::Acquire))
    }

    /// Hint that `[off, off+len)` is about to be read or written: its cache lines are
    /// asked for at once (their misses overlap). Changes nothing else; out of range, it
    /// does nothing.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let ap = nic.endpoint()?.export(4096)?;
    /// ap.prefetch(0, 64); // the flag a poll is about to read
    /// ap.prefetch(u64::MAX - 8, 64); // out of range: nothing
    /// assert_eq!(ap.load_u64(0)?, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn prefetch(&self, off: u64, len: u64) {
        if check_range(off, len, self.len).is_ok() {
            let seg = self.seg();
            clan_shm::prefetch::range(seg.as_ptr().wrapping_add(off as usize), len as usize);
        }
    }

    /// Atomic store (Release) of the aligned word at `off`.
    #[inline]
    pub fn store_u64(&self, off: u64, v: u64) -> Result<(), AccessError> {
        self.word::<AtomicU64>(off, 8)?.store(v, Ordering::Release);
        Ok(())
    }

    /// Atomic load (Acquire) of the aligned 32-bit word at `off`.
    #[inline]
    pub fn load_u32(&self, off: u64) -> Result<u32, AccessError> {
        Ok(self.word::<AtomicU32>(off, 4)?.load(Ordering::Acquire))
    }

    /// Atomic store (Release) of the aligned 32-bit word at `off`.
    #[inline]
    pub fn store_u32(&self, off: u64, v: u32) -> Result<(), AccessError> {
        self.word::<AtomicU32>(off, 4)?.store(v, Ordering::Release);
        Ok(())
    }

    /// A raw window onto `len` bytes at `off`, for zero-copy processing in place.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let ap = ep.export(4096)?;
    /// ap.write(16, b"parse me in place")?;
    /// let r = ap.raw(16, 17)?;
    /// assert_eq!(r.len(), 17);
    /// // SAFETY: nobody else writes these bytes while the slice is alive (no importer here).
    /// let bytes = unsafe { r.as_slice() };
    /// assert_eq!(bytes, b"parse me in place");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn raw(&self, off: u64, len: u64) -> Result<clan_shm::segment::RawRegion<'_>, AccessError> {
        check_range(off, len, self.len)?;
        self.inner.window.raw(off, len)
    }

    /// Fault in the pages of `[off, off+len)` now, so that the first accesses there (ours,
    /// or an importer's through its own mapping, which faults separately) take no page
    /// fault. Best effort, as [`crate::Mapping::prefault`].
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// # let ep = nic.endpoint()?;
    /// let ap = ep.export(64 << 10)?;
    /// ap.prefault(0, 64 << 10)?;
    /// assert!(ap.prefault(60 << 10, 8 << 10).is_err(), "past the end");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prefault(&self, off: u64, len: u64) -> Result<(), AccessError> {
        check_range(off, len, self.len)?;
        self.inner.window.prefault(off, len);
        Ok(())
    }

    /// Set a tripwire on incoming traffic (writes and/or reads by importers) to a range.
    ///
    /// ```
    /// use clan::TripwireConfig;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = ep.export(4096)?;
    /// let tw = ap.tripwire(TripwireConfig::writes(0..8))?;
    /// ap.store_u64(0, 1)?; // the owner's own store: local memory, the NIC does not see it
    /// assert_eq!(tw.count(), 0);
    /// peer.import(&ap.descriptor())?.store_u64(0, 2)?; // traffic through the NIC
    /// assert_eq!(tw.count(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tripwire(&self, cfg: TripwireConfig) -> Result<Tripwire, TripwireError> {
        if self.inner.revoked.load(Ordering::Acquire) {
            return Err(TripwireError::Stale);
        }
        self.inner.watch.add(&cfg)
    }

    /// Unexport now (dropping does the same).
    ///
    /// ```
    /// use clan::{AccessError, ImportError};
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let ep = nic.endpoint()?;
    /// let ap = ep.export(4096)?;
    /// let (desc, m) = (ap.descriptor(), ep.import(&ap.descriptor())?);
    /// ap.unexport();
    /// assert_eq!(m.write(0, b"late"), Err(AccessError::Revoked));
    /// assert!(!m.is_live());
    /// assert!(matches!(ep.import(&desc), Err(ImportError::Revoked { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn unexport(self) {}
}

impl Drop for Aperture {
    fn drop(&mut self) {
        self.inner.unexport();
    }
}

impl std::fmt::Debug for Aperture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inner;
        f.debug_struct("Aperture")
            .field("endpoint", &format_args!("{}", i.endpoint))
            .field("id", &i.id)
            .field("generation", &i.generation)
            .field("len", &i.len)
            .field("exported", &!i.revoked.load(Ordering::Acquire))
            .finish()
    }
}
