//! Layout of an event queue's segment: the synchronisation memory of a group of endpoints.
//!
//! One segment per event queue (or port) holds, page-aligned:
//!
//! ```text
//! | header (EqHeader: geometry, armed/wake words, summary bits) |  page 0
//! | ring 0: RingHeader + slots | ring 1 | ... | ring nrings-1  |
//! | fired bitmap: trip_cap bits                                 |
//! | tripset words: tripset_cap × TripsetWord (8 B)              |
//! | tripwire cells: trip_cap × TripCell (64 B: state, source, count, seq, waiters, tripset) |
//! ```
//!
//! The tripwire entries themselves live in the index of the aperture (or mapping) each one
//! watches ([`crate::cam`]); the queue holds what their firings do here.
//!
//! `clan` keeps a queue's own segment private to its process (it alone fires its
//! tripwires), and gives every other process that reaches the queue a *port*: a segment of
//! the same layout with one ring and no table, shared with that process alone. Everything
//! read from a port is untrusted input, validated by its consumer.
//! The segment is sparse: pages of the table are only allocated when entries are used.

use crate::ring::{EventSlot, QueueWords, RingHeader, Rings};
use crate::sync::{AtomicU32, AtomicU64};
use crate::trip::{TripCell, TripTable, TripsetWord};

/// Header magic.
pub const EQ_MAGIC: u64 = u64::from_le_bytes(*b"CLANEQ01");
/// Offsets inside the segment are multiples of this.
pub const LAYOUT_PAGE: usize = 4096;
/// Largest tripwire table of one queue.
pub const MAX_TRIP_CAP: u32 = 1 << 24;
/// Largest ring.
pub const MAX_RING_CAP: u32 = 1 << 20;

/// Header of the segment.
#[repr(C)]
#[derive(Debug)]
pub struct EqHeader {
    /// [`EQ_MAGIC`] once initialised.
    pub magic: AtomicU64,
    /// Geometry, for diagnostics only (importers use the geometry they were given).
    pub nrings: AtomicU32,
    /// Slots per ring.
    pub ring_cap: AtomicU32,
    /// Tripwire entries.
    pub trip_cap: AtomicU32,
    /// Tripset words.
    pub tripset_cap: AtomicU32,
    _pad: [AtomicU64; 5],
    /// Words shared by the consumer and the producers.
    pub words: QueueWords,
}

impl EqHeader {
    /// A zeroed header.
    pub fn new() -> EqHeader {
        EqHeader {
            magic: AtomicU64::new(0),
            nrings: AtomicU32::new(0),
            ring_cap: AtomicU32::new(0),
            trip_cap: AtomicU32::new(0),
            tripset_cap: AtomicU32::new(0),
            _pad: std::array::from_fn(|_| AtomicU64::new(0)),
            words: QueueWords::new(),
        }
    }
}

impl Default for EqHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// Geometry of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EqParams {
    /// Rings (producer processes), at most [`crate::ring::MAX_RINGS`].
    pub nrings: u32,
    /// Slots per ring, a power of two.
    pub ring_cap: u32,
    /// Tripwires (queue indexes: fired bits).
    pub trip_cap: u32,
    /// Tripset words.
    pub tripset_cap: u32,
}

impl EqHeader {
    /// Check a queue segment another process laid out (a producer's first look at its port):
    /// its magic word is [`EQ_MAGIC`] and its geometry is the one it was told. Memory
    /// written by another process is untrusted: anything else is refused.
    pub fn check(&self, params: &EqParams) -> Result<(), String> {
        // SYNC POINT: pairs with the creator's Release store of `magic` after the geometry.
        let magic = self.magic.load(crate::sync::Ordering::Acquire);
        if magic != EQ_MAGIC {
            return Err(format!("not a clan event queue (magic {magic:#018x})"));
        }
        let (n, cap) =
            (self.nrings.load(crate::sync::Ordering::Relaxed), self.ring_cap.load(crate::sync::Ordering::Relaxed));
        if n != params.nrings || cap != params.ring_cap {
            return Err(format!(
                "the queue has {n} rings of {cap}, the import says {} of {}",
                params.nrings, params.ring_cap
            ));
        }
        Ok(())
    }
}

impl EqParams {
    /// Whether the geometry is acceptable (used on parameters received from elsewhere).
    pub fn is_valid(&self) -> bool {
        self.nrings >= 1
            && self.nrings as usize <= crate::ring::MAX_RINGS
            && self.ring_cap.is_power_of_two()
            && self.ring_cap <= MAX_RING_CAP
            && self.trip_cap <= MAX_TRIP_CAP
            && self.tripset_cap <= MAX_TRIP_CAP
    }
}

/// Offsets of the parts of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EqLayout {
    /// Geometry.
    pub params: EqParams,
    /// Offset of ring 0.
    pub rings_off: usize,
    /// Distance between rings.
    pub ring_stride: usize,
    /// Offset of the fired bitmap.
    pub bitmap_off: usize,
    /// Words of the fired bitmap.
    pub bitmap_words: usize,
    /// Offset of the tripset words.
    pub tripsets_off: usize,
    /// Offset of the tripwire cells (one per queue index).
    pub cells_off: usize,
    /// Total size (page multiple).
    pub size: usize,
}

fn page_up(n: usize) -> usize {
    n.div_ceil(LAYOUT_PAGE) * LAYOUT_PAGE
}

impl EqLayout {
    /// Layout for `params` (which must be valid).
    pub fn new(params: EqParams) -> EqLayout {
        let rings_off = LAYOUT_PAGE;
        let ring_stride =
            page_up(std::mem::size_of::<RingHeader>() + params.ring_cap as usize * std::mem::size_of::<EventSlot>());
        let bitmap_off = rings_off + params.nrings as usize * ring_stride;
        let bitmap_words = (params.trip_cap as usize).div_ceil(64);
        let tripsets_off = (bitmap_off + bitmap_words * 8).div_ceil(64) * 64;
        let cells_off =
            (tripsets_off + params.tripset_cap as usize * std::mem::size_of::<TripsetWord>()).div_ceil(64) * 64;
        let size = page_up(cells_off + params.trip_cap as usize * std::mem::size_of::<TripCell>());
        EqLayout { params, rings_off, ring_stride, bitmap_off, bitmap_words, tripsets_off, cells_off, size }
    }
}

/// A queue's segment as seen by one process.
#[derive(Clone)]
pub struct EqView<'a> {
    /// Header.
    pub header: &'a EqHeader,
    /// Ring headers.
    pub ring_headers: Vec<&'a RingHeader>,
    /// Ring slots.
    pub ring_slots: Vec<&'a [EventSlot]>,
    /// The fired bitmap and tripset words.
    pub table: TripTable<'a>,
}

impl std::fmt::Debug for EqView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EqView")
            .field("rings", &self.ring_headers.len())
            .field("tripwires", &(self.table.bitmap.len() * 64))
            .finish_non_exhaustive()
    }
}

impl<'a> EqView<'a> {
    /// The rings, for producers and the consumer.
    pub fn rings(&self) -> Rings<'_> {
        Rings { words: &self.header.words, headers: &self.ring_headers, slots: &self.ring_slots }
    }
}

impl std::fmt::Debug for EqModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EqModel").field("rings", &self.rings.len()).finish_non_exhaustive()
    }
}

/// A heap-allocated queue with the same structure, for tests and loom models.
pub struct EqModel {
    header: EqHeader,
    rings: Vec<RingHeader>,
    slots: Vec<Vec<EventSlot>>,
    bitmap: Vec<AtomicU64>,
    tripsets: Vec<TripsetWord>,
    cells: Vec<TripCell>,
}

impl EqModel {
    /// A zeroed model queue.
    pub fn new(params: EqParams) -> EqModel {
        EqModel {
            header: EqHeader::new(),
            rings: (0..params.nrings).map(|_| RingHeader::new()).collect(),
            slots: (0..params.nrings).map(|_| (0..params.ring_cap).map(|_| EventSlot::new()).collect()).collect(),
            bitmap: (0..(params.trip_cap as usize).div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            tripsets: (0..params.tripset_cap).map(|_| TripsetWord::new()).collect(),
            cells: (0..params.trip_cap).map(|_| TripCell::new()).collect(),
        }
    }

    /// Its view.
    pub fn view(&self) -> EqView<'_> {
        EqView {
            header: &self.header,
            ring_headers: self.rings.iter().collect(),
            ring_slots: self.slots.iter().map(Vec::as_slice).collect(),
            table: TripTable { bitmap: &self.bitmap, tripsets: &self.tripsets, cells: &self.cells },
        }
    }
}

impl std::fmt::Debug for CamModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CamModel").field("lines", &self.heads.len()).finish_non_exhaustive()
    }
}

/// A heap-allocated index, for tests, loom models and mapping-side (outgoing) tripwires.
pub struct CamModel {
    header: crate::cam::CamHeader,
    meta: crate::cam::CamMeta,
    watch: Vec<AtomicU64>,
    wide: Vec<AtomicU64>,
    heads: Vec<AtomicU32>,
    entries: Vec<crate::trip::TripEntry>,
    len: u64,
}

impl CamModel {
    /// A zeroed index over `len` bytes with `cap` entries.
    pub fn new(len: u64, cap: u32) -> CamModel {
        let l = crate::cam::CamLayout::new(len, cap);
        CamModel {
            header: crate::cam::CamHeader::new(),
            meta: crate::cam::CamMeta::new(),
            watch: (0..l.watch_words).map(|_| AtomicU64::new(0)).collect(),
            wide: (0..l.wide_words).map(|_| AtomicU64::new(0)).collect(),
            heads: (0..l.nlines).map(|_| AtomicU32::new(0)).collect(),
            entries: (0..cap).map(|_| crate::trip::TripEntry::new()).collect(),
            len,
        }
    }

    /// Its view.
    pub fn view(&self) -> crate::cam::CamView<'_> {
        crate::cam::CamView {
            header: &self.header,
            meta: &self.meta,
            watch: &self.watch,
            wide: &self.wide,
            heads: &self.heads,
            entries: &self.entries,
            len: self.len,
        }
    }
}

#[cfg(not(loom))]
pub use mapped::{CamMap, CamRef, EqMap};

#[cfg(not(loom))]
mod mapped {
    use std::sync::Arc;

    use super::*;
    use crate::cam::{CamLayout, CamView};
    use crate::segment::{Segment, SegmentError};

    /// An event queue segment mapped in this process, with its view.
    pub struct EqMap {
        // Field order: the view (borrowing the mapping) is dropped before the mapping.
        view: EqView<'static>,
        layout: EqLayout,
        seg: Arc<Segment>,
    }

    impl std::fmt::Debug for EqMap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("EqMap").field("params", &self.layout.params).field("size", &self.layout.size).finish()
        }
    }

    impl std::fmt::Debug for CamMap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CamMap").field("len", &self.view.len).finish_non_exhaustive()
        }
    }

    impl EqMap {
        /// Build the view of `seg` laid out as `layout`. Fails if the segment is too small.
        pub fn new(seg: Arc<Segment>, layout: EqLayout) -> Result<EqMap, SegmentError> {
            let p = layout.params;
            let view = {
                let s: &Segment = &seg;
                let header = s.view::<EqHeader>(0)?;
                let mut ring_headers = Vec::with_capacity(p.nrings as usize);
                let mut ring_slots = Vec::with_capacity(p.nrings as usize);
                for r in 0..p.nrings as usize {
                    let off = layout.rings_off + r * layout.ring_stride;
                    ring_headers.push(s.view::<RingHeader>(off)?);
                    ring_slots
                        .push(s.slice::<EventSlot>(off + std::mem::size_of::<RingHeader>(), p.ring_cap as usize)?);
                }
                let table = TripTable {
                    bitmap: s.slice::<AtomicU64>(layout.bitmap_off, layout.bitmap_words)?,
                    tripsets: s.slice::<TripsetWord>(layout.tripsets_off, p.tripset_cap as usize)?,
                    cells: s.slice::<TripCell>(layout.cells_off, p.trip_cap as usize)?,
                };
                EqView { header, ring_headers, ring_slots, table }
            };
            // SAFETY: every reference in `view` points into the mapping owned by `seg`, which
            // this struct keeps alive (and unmoved: it is behind an `Arc`) for as long as the
            // view exists; the view is only ever handed out reborrowed for `&self`'s lifetime.
            let view = unsafe { std::mem::transmute::<EqView<'_>, EqView<'static>>(view) };
            Ok(EqMap { view, layout, seg })
        }

        /// The view, for as long as `self` is borrowed.
        pub fn view(&self) -> &EqView<'_> {
            &self.view
        }

        /// The layout.
        pub fn layout(&self) -> &EqLayout {
            &self.layout
        }

        /// The segment.
        pub fn segment(&self) -> &Arc<Segment> {
            &self.seg
        }
    }

    /// An index mapped in this process, with its view.
    pub struct CamMap {
        // (no copy of the layout: the view holds what it placed, and an aperture on each
        // side of each connection has one of these)
        view: CamView<'static>,
        seg: Arc<Segment>,
    }

    impl CamMap {
        /// The index at `offset` of `seg`, watching `len` bytes, with `cap` entries.
        pub fn new(seg: Arc<Segment>, offset: usize, len: u64, cap: u32) -> Result<CamMap, SegmentError> {
            let layout = CamLayout::new(len, cap);
            let view = {
                let s: &Segment = &seg;
                CamView {
                    header: s.view(offset)?,
                    meta: s.view(offset + layout.meta_off)?,
                    watch: s.slice(offset + layout.watch_off, layout.watch_words)?,
                    wide: s.slice(offset + layout.wide_off, layout.wide_words)?,
                    heads: s.slice(offset + layout.heads_off, layout.nlines as usize)?,
                    entries: s.slice(offset + layout.entries_off, cap as usize)?,
                    len,
                }
            };
            // SAFETY: as in `EqMap::new`: the references point into `seg`'s mapping, kept
            // alive and unmoved by this struct, and are only lent out for `&self`'s lifetime.
            let view = unsafe { std::mem::transmute::<CamView<'_>, CamView<'static>>(view) };
            Ok(CamMap { view, seg })
        }

        /// The view.
        pub fn view(&self) -> &CamView<'_> {
            &self.view
        }

        /// The segment.
        pub fn segment(&self) -> &Arc<Segment> {
            &self.seg
        }

        /// A handle that keeps the index mapped and holds its view inline: reaching an entry
        /// through it costs no load of the `CamMap` (a window keeps one per aperture, and at
        /// thousands of apertures each such load is a cache miss on the data path).
        pub fn handle(self: &Arc<CamMap>) -> CamRef {
            CamRef { view: self.view, map: self.clone() }
        }
    }

    /// An index mapped in this process, its view held inline ([`CamMap::handle`]).
    #[derive(Clone)]
    pub struct CamRef {
        // Field order: the view (borrowing the mapping) is dropped before the mapping.
        view: CamView<'static>,
        map: Arc<CamMap>,
    }

    impl CamRef {
        /// The view, for as long as `self` is borrowed.
        #[inline]
        pub fn view(&self) -> &CamView<'_> {
            // The references point into the mapping that `map` keeps alive (and unmoved:
            // behind an `Arc`), as for `CamMap::view`.
            &self.view
        }

        /// The index.
        pub fn map(&self) -> &Arc<CamMap> {
            &self.map
        }
    }

    impl std::fmt::Debug for CamRef {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.map.fmt(f)
        }
    }
}
