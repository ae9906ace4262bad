//! The software CAM: the index from addresses to the tripwires watching them.
//!
//! Every aperture (and every mapping that carries outgoing tripwires) has one index: its own
//! memory (for an aperture, a memfd of its own that importers map read-only), holding the
//! lists below and the tripwire entries they link, so that every process writing into the
//! aperture can match its writes. Only the owner modifies it ([`CamOwner`]); writers read it.
//!
//! ## Layout
//!
//! The watched range is cut into 64-byte *lines* and 4 KiB *pages*.
//! - `watch`: one bit per line, set while some tripwire (armed or not) covers the line;
//! - `wide`: one bit per page, set while some *wide* tripwire covers the page;
//! - `heads[line]`: first *narrow* tripwire (spanning at most [`NARROW_LINES`] lines) that
//!   starts in the line, chained through [`TripEntry::next`];
//! - `wide_head` (in the header): the list of wide tripwires;
//! - `entries`: the tripwire entries ([`TripEntry`]), `cap` of them.
//!
//! In memory: the header's hot words ([`CamHeader`]: revocation, epoch, `wide_head`), the
//! wide bits, the watch bits, the heads, the entries, then what identifies the index
//! ([`CamMeta`]: read once by an importer; [`CamLayout`]). An access reads the header first;
//! for an aperture of up to 8 KiB, what it reads next for its first lines is in the same
//! cache line, and for one of up to 384 bytes (an RPC party's buffer for small messages) the
//! first entries are in the next line (fetched with it: caches fetch lines in aligned pairs).
//!
//! ## Cost of matching a write of `len` bytes at `off`
//!
//! - `⌈len/4096⌉ + ⌈len/262144⌉ + 2` word loads when nothing near is watched (the common case);
//! - otherwise, in addition, one list walk per watched line in `[off − 3 lines, off + len)`,
//!   visiting the narrow tripwires that *start* in those lines, plus the wide list of this
//!   index if a written page is covered by a wide tripwire;
//! - except for the quick paths' question, after the writer's fence, whether anything over
//!   a watched word is armed ([`CamView::armed_in`]): one more load when no entry of the
//!   index is armed (the header's count, [`CamHeader::armed`]), the walk otherwise.
//!
//! Nothing here depends on the tripwires of any other aperture, nor on the total number of
//! tripwires of the NIC.
//!
//! ## Concurrency
//!
//! Lists are modified only by the owner, under its own lock, from a private mirror
//! ([`CamOwner`]), and every change bumps `epoch` (SeqCst). A reader that walks a list while
//! an entry is unlinked and reused may be led astray; it notices because `epoch` moved
//! between its lookup and the end of its transfer, and looks again ([`crate::snoop`]). Walks
//! are bounded by the table size and every entry is validated (generation, tag, line), so a
//! corrupted index costs time, never safety.

use crate::smallmap::SmallMap;
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};
use crate::trip::{self, ARMED, Access, LIVE, TripEntry, WIDE};

/// log2 of the line size.
pub const LINE_SHIFT: u32 = 6;
/// log2 of the wide-bit granularity.
pub const PAGE_SHIFT: u32 = 12;
/// A tripwire spanning at most this many lines is narrow.
pub const NARROW_LINES: u64 = 4;
/// Magic word of an index (its [`CamMeta`]).
pub const CAM_MAGIC: u64 = u64::from_le_bytes(*b"CLANCAM5");
/// Alignment of the entries within an index (a cache line: a small index keeps its header,
/// bits, list heads and first entries in one page).
const ENTRY_ALIGN: usize = 64;

/// The hot words of an index, 24 bytes at its start: what every access through a mapping
/// reads (`armed` only by a write to a watched word, after its fence). The index's bits and first list heads follow in the same cache line, and what is
/// read only once, at import, is further on ([`CamMeta`]): a write into a small aperture
/// whose tripwires watch its first lines looks at one line of the index, not two (at
/// thousands of apertures each line looked at is a cache miss).
#[repr(C)]
#[derive(Debug)]
pub struct CamHeader {
    /// Revocation word: `generation << 1 | 1` while the aperture is exported, anything else
    /// once it is revoked. Every access through a mapping compares it first.
    pub state: AtomicU64,
    /// Bumped by every change of the index.
    pub epoch: AtomicU64,
    /// First wide entry, as `index + 1`.
    pub wide_head: AtomicU32,
    /// At least the number of entries whose mirror says armed ([`crate::trip::ArmedCount`]):
    /// a writer that reads 0 after its fence has nothing to fire in this index, and walks
    /// no list.
    pub armed: AtomicU32,
}

impl CamHeader {
    /// A zeroed header.
    pub fn new() -> CamHeader {
        CamHeader {
            state: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            wide_head: AtomicU32::new(0),
            armed: AtomicU32::new(0),
        }
    }
}

impl Default for CamHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// What identifies an index, read once by an importer ([`CamMeta::check`]): after the
/// entries, at [`CamLayout::meta_off`].
#[repr(C)]
#[derive(Debug)]
pub struct CamMeta {
    /// [`CAM_MAGIC`] once initialised.
    pub magic: AtomicU64,
    /// Watched length in bytes.
    pub len: AtomicU64,
    /// Tag every entry of this index carries (aperture id and generation).
    pub tag: AtomicU64,
}

impl CamMeta {
    /// A zeroed one.
    pub fn new() -> CamMeta {
        CamMeta { magic: AtomicU64::new(0), len: AtomicU64::new(0), tag: AtomicU64::new(0) }
    }

    /// Check an index another process laid out (an importer's first look at it): its magic
    /// word is [`CAM_MAGIC`] and it watches `len` bytes, the length the import was told.
    /// Memory written by another process is untrusted: anything else is refused.
    pub fn check(&self, len: u64) -> Result<(), String> {
        // SYNC POINT: the exporter initialised the index before handing over the memfd
        // (its Release store of the header's `state` after these, and the fd passing
        // itself, order it).
        let magic = self.magic.load(Ordering::Acquire);
        if magic != CAM_MAGIC {
            return Err(format!("not a clan aperture index (magic {magic:#018x})"));
        }
        let have = self.len.load(Ordering::Relaxed);
        if have != len {
            return Err(format!("the aperture index watches {have} bytes, the import says {len}"));
        }
        Ok(())
    }
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<CamHeader>() == 24 && std::mem::size_of::<CamMeta>() == 24);

impl Default for CamMeta {
    fn default() -> Self {
        Self::new()
    }
}

/// The revocation word of a live export of generation `generation`.
pub fn live_state(generation: u32) -> u64 {
    (u64::from(generation) << 1) | 1
}

/// Sizes and offsets of an index for `len` watched bytes: the header, the wide bits, the
/// watch bits, the list heads, the entries (from a cache line boundary), then the
/// [`CamMeta`]. For an aperture of up to
/// 256 KiB the first cache line holds the header, all its wide bits and the watch bits of
/// its first 16 KiB; for one of up to 8 KiB (a connection's side) also the list heads of its
/// first four lines, where the protocols' flags are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CamLayout {
    /// Watched bytes.
    pub len: u64,
    /// Lines.
    pub nlines: u64,
    /// Offset of the watch bits.
    pub watch_off: usize,
    /// Words of watch bits.
    pub watch_words: usize,
    /// Offset of the wide bits.
    pub wide_off: usize,
    /// Words of wide bits.
    pub wide_words: usize,
    /// Offset of the list heads.
    pub heads_off: usize,
    /// Offset of the [`CamMeta`].
    pub meta_off: usize,
    /// Offset of the entries (a cache line boundary).
    pub entries_off: usize,
    /// Number of entries.
    pub cap: u32,
    /// Total bytes.
    pub size: usize,
}

impl CamLayout {
    /// The layout for `len` watched bytes and `cap` tripwire entries.
    pub fn new(len: u64, cap: u32) -> CamLayout {
        let nlines = len.div_ceil(1 << LINE_SHIFT).max(1);
        let npages = len.div_ceil(1 << PAGE_SHIFT).max(1);
        let wide_off = std::mem::size_of::<CamHeader>();
        let wide_words = npages.div_ceil(64) as usize;
        let watch_off = wide_off + wide_words * 8;
        let watch_words = nlines.div_ceil(64) as usize;
        let heads_off = watch_off + watch_words * 8;
        let entries_off = (heads_off + nlines as usize * 4).div_ceil(ENTRY_ALIGN) * ENTRY_ALIGN;
        let meta_off = entries_off + cap as usize * std::mem::size_of::<TripEntry>();
        let size = meta_off + std::mem::size_of::<CamMeta>();
        CamLayout {
            len,
            nlines,
            watch_off,
            watch_words,
            wide_off,
            wide_words,
            heads_off,
            meta_off,
            entries_off,
            cap,
            size,
        }
    }

    /// The default number of entries for `len` watched bytes: eight per line (at least
    /// 1024), at most `max`.
    pub fn default_cap(len: u64, max: u32) -> u32 {
        let lines = len.div_ceil(1 << LINE_SHIFT);
        lines.saturating_mul(8).clamp(1024, u64::from(max)).min(u64::from(u32::MAX)) as u32
    }
}

/// A tripwire that may match an access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Candidate {
    /// Entry index.
    pub index: u32,
    /// Entry generation when found.
    pub generation: u32,
    /// Watched range.
    pub start: u64,
    /// Watched range end.
    pub end: u64,
}

/// Most armed entries [`CamView::armed_in`] hands back (the word that publishes a message
/// is watched by its reader's tripwire, and rarely by a second).
pub const ARMED_MAX: usize = 2;

/// The entries a walk found armed ([`CamView::armed_in`]), in the order it met them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Armed {
    n: usize,
    found: [Candidate; ARMED_MAX],
}

impl Armed {
    /// The entries found.
    pub fn as_slice(&self) -> &[Candidate] {
        &self.found[..self.n]
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Add `c` unless it is there already; `false` if it is new and there is no room.
    fn add(&mut self, c: Candidate) -> bool {
        if self.as_slice().contains(&c) {
            return true;
        }
        if self.n == ARMED_MAX {
            return false;
        }
        self.found[self.n] = c;
        self.n += 1;
        true
    }
}

/// One index as seen by a process.
#[derive(Clone, Copy)]
pub struct CamView<'a> {
    /// Header.
    pub header: &'a CamHeader,
    /// Identity.
    pub meta: &'a CamMeta,
    /// Watch bits, one per line.
    pub watch: &'a [AtomicU64],
    /// Wide bits, one per page.
    pub wide: &'a [AtomicU64],
    /// List heads, one per line.
    pub heads: &'a [AtomicU32],
    /// The tripwire entries.
    pub entries: &'a [TripEntry],
    /// Watched length (trusted: from our own import, not from the header).
    pub len: u64,
}

// Shared-memory views print their geometry, never their contents (megabytes of tables).
impl std::fmt::Debug for CamView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CamView")
            .field("len", &self.len)
            .field("lines", &self.heads.len())
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

/// Whether any bit in `[lo, hi]` is set.
#[inline]
fn any_bit(words: &[AtomicU64], lo: u64, hi: u64) -> bool {
    if lo / 64 == hi / 64 {
        // (one word: a range within 64 lines or pages, what nearly every access is)
        let mask = (!0u64 << (lo % 64)) & (!0u64 >> (63 - hi % 64));
        // SYNC POINT: as below.
        return words.get((lo / 64) as usize).is_some_and(|w| w.load(Ordering::Acquire) & mask != 0);
    }
    let mut w = lo / 64;
    while w <= hi / 64 {
        let Some(word) = words.get(w as usize) else {
            return false;
        };
        let mut mask = !0u64;
        if w == lo / 64 {
            mask &= !0u64 << (lo % 64);
        }
        if w == hi / 64 {
            mask &= !0u64 >> (63 - hi % 64);
        }
        // SYNC POINT: pairs with `CamOwner`'s Release `fetch_or` of the bit, made after
        // linking the entry: a set bit implies the list is visible.
        if word.load(Ordering::Acquire) & mask != 0 {
            return true;
        }
        w += 1;
    }
    false
}

impl<'a> CamView<'a> {
    /// Cheap test: may any tripwire overlap `[start, end)`?
    #[inline(always)]
    pub fn may_match(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        let last = end - 1;
        any_bit(self.watch, start >> LINE_SHIFT, last >> LINE_SHIFT)
            || any_bit(self.wide, start >> PAGE_SHIFT, last >> PAGE_SHIFT)
    }

    /// Append to `out` every entry of this index watching `access` that overlaps
    /// `[start, end)` and is not already in `out` (armed or not: arming is re-checked at fire
    /// time). Returns `false` if an inconsistency was seen (concurrent change or corruption).
    pub fn collect(&self, tag: u64, start: u64, end: u64, access: Access, out: &mut Vec<Candidate>) -> bool {
        self.visit(tag, start, end, access, &mut |c, _| {
            if !out.iter().any(|o| o.index == c.index && o.generation == c.generation) {
                out.push(c);
            }
            true
        })
        .consistent
    }

    /// Whether a write (or read, `access`) of `[start, end)` has anything to fire: an entry
    /// watching it whose mirror says armed — or an inconsistent walk, which only the whole
    /// [`CamView::collect`] path may settle. Nothing is allocated. Called after the writer's
    /// fence, it answers the arm/fire Dekker as the firing would: an arming it does not see
    /// was not yet mirrored and fenced, so its owner's re-check sees the data.
    #[inline]
    pub fn armed_over(&self, tag: u64, start: u64, end: u64, access: Access) -> bool {
        if self.none_armed() || !self.may_match(start, end) {
            return false;
        }
        let mut armed = false;
        let walk = self.visit(tag, start, end, access, &mut |_, flags| {
            armed = flags & ARMED != 0;
            !armed
        });
        armed || !walk.consistent
    }

    /// [`CamView::armed_over`], keeping what it found: every entry watching `access` that
    /// overlaps `[start, end)` and whose mirror says armed (none: empty). `None` when the
    /// walk was inconsistent or found more than [`ARMED_MAX`], which only the whole
    /// [`CamView::collect`] path may settle. Called after the writer's fence, as
    /// `armed_over` is, the entries it found are those a firing must try (an entry it saw
    /// disarmed was armed, if at all, after that fence: its owner's re-check sees the data);
    /// the writer fires them without a second walk ([`crate::snoop::finish_store_armed`]).
    #[inline]
    pub fn armed_in(&self, tag: u64, start: u64, end: u64, access: Access) -> Option<Armed> {
        let mut armed = Armed::default();
        if self.none_armed() || !self.may_match(start, end) {
            return Some(armed);
        }
        let mut room = true;
        let walk = self.visit(tag, start, end, access, &mut |c, flags| {
            if flags & ARMED != 0 {
                room = armed.add(c);
            }
            room
        });
        (walk.consistent && room).then_some(armed)
    }

    /// The count of this index's armed mirrors, which the owner keeps with every write of a
    /// mirror ([`crate::trip::mirror`], [`crate::trip::publish`] and the changes).
    #[inline]
    pub fn armed_count(&self) -> trip::ArmedCount<'a> {
        trip::ArmedCount(&self.header.armed)
    }

    /// Whether no entry of this index is armed, by its count ([`CamHeader::armed`]). Called
    /// after the writer's fence, as [`CamView::armed_over`] is: an arming counts itself
    /// before it mirrors its word and fences (`crate::trip::ArmedCount`), so an arming this
    /// load does not see came after that fence, and its owner's re-check sees the data.
    /// One load of the header's line, which the access has read already.
    #[inline(always)]
    pub fn none_armed(&self) -> bool {
        // SYNC POINT: ordered by the writer's fence(SeqCst) before it against the arming
        // side's fence after its count (`trip::ArmedCount`), as the mirrors' loads are.
        self.header.armed.load(Ordering::Acquire) == 0
    }

    /// Call `f(candidate, flags of its mirror)` for every entry watching `access` that
    /// overlaps `[start, end)` until it returns false.
    fn visit(
        &self,
        tag: u64,
        start: u64,
        end: u64,
        access: Access,
        f: &mut impl FnMut(Candidate, u32) -> bool,
    ) -> Walk {
        let mut all = Walk { consistent: true, go: true };
        if start >= end {
            return all;
        }
        let first_line = start >> LINE_SHIFT;
        let last_line = (end - 1) >> LINE_SHIFT;
        let from = first_line.saturating_sub(NARROW_LINES - 1);
        let mut y = from;
        while y <= last_line && all.go {
            let wi = (y / 64) as usize;
            let Some(word) = self.watch.get(wi) else {
                break;
            };
            let mut bits = word.load(Ordering::Acquire) & (!0u64 << (y % 64));
            let word_last = (wi as u64) * 64 + 63;
            if word_last > last_line {
                bits &= !0u64 >> (63 - last_line % 64);
            }
            while bits != 0 && all.go {
                let line = (wi as u64) * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                if let Some(h) = self.heads.get(line as usize) {
                    // SYNC POINT: pairs with `CamOwner::link`'s Release store of the head.
                    let head = h.load(Ordering::Acquire);
                    all.and(walk(self.entries, head, tag, Some(line), start, end, access, f));
                }
            }
            y = word_last + 1;
        }
        if all.go && any_bit(self.wide, start >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT) {
            // SYNC POINT: pairs with `CamOwner::link`'s Release store of the wide head.
            let head = self.header.wide_head.load(Ordering::Acquire);
            all.and(walk(self.entries, head, tag, None, start, end, access, f));
        }
        all
    }
}

/// How a walk went: whether everything seen was consistent, and whether to go on (the
/// visitor did not stop it).
#[derive(Debug, Clone, Copy)]
struct Walk {
    consistent: bool,
    go: bool,
}

impl Walk {
    fn and(&mut self, w: Walk) {
        self.consistent &= w.consistent;
        self.go &= w.go;
    }
}

/// Walk one list. `line` is the start line every entry must have (narrow lists), `None` for
/// the wide list.
#[allow(clippy::too_many_arguments)]
fn walk(
    entries: &[TripEntry],
    head: u32,
    tag: u64,
    line: Option<u64>,
    start: u64,
    end: u64,
    access: Access,
    f: &mut impl FnMut(Candidate, u32) -> bool,
) -> Walk {
    let mut w = Walk { consistent: true, go: true };
    let mut next = head;
    let mut steps = 0usize;
    while next != 0 {
        steps += 1;
        if steps > entries.len() {
            w.consistent = false; // a cycle: corruption
            return w;
        }
        let index = next - 1;
        let Some(e) = entries.get(index as usize) else {
            w.consistent = false;
            return w;
        };
        // Seqlock read of the entry (module documentation of `trip`).
        let s1 = e.state.load(Ordering::Acquire);
        let e_start = e.start.load(Ordering::Relaxed);
        let e_end = e.end.load(Ordering::Relaxed);
        let e_tag = e.tag.load(Ordering::Relaxed);
        next = e.next.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        let s2 = e.state.load(Ordering::Relaxed);
        let fl = trip::flags(s1);
        let stable = trip::generation(s1) == trip::generation(s2) && trip::flags(s2) & LIVE != 0;
        let belongs = fl & LIVE != 0
            && e_tag == tag
            && e_start < e_end
            && match line {
                Some(l) => fl & WIDE == 0 && e_start >> LINE_SHIFT == l,
                None => fl & WIDE != 0,
            };
        if !stable || !belongs {
            w.consistent = false;
            continue;
        }
        if fl & access.flag() != 0 && e_start < end && start < e_end {
            let c = Candidate { index, generation: trip::generation(s1), start: e_start, end: e_end };
            if !f(c, fl) {
                w.go = false;
                return w;
            }
        }
    }
    w
}

/// The owner's private mirror of an index, from which the shared lists are written.
#[derive(Debug, Default)]
pub struct CamOwner {
    // (small maps: nearly every index holds one tripwire, on one line; `crate::smallmap`)
    narrow: SmallMap<u64, Vec<u32>>,
    wide: Vec<u32>,
    line_refs: SmallMap<u64, u32>,
    page_refs: SmallMap<u64, u32>,
}

/// Whether a tripwire over `[start, end)` goes on the wide list.
pub fn is_wide(start: u64, end: u64) -> bool {
    end > start && ((end - 1) >> LINE_SHIFT) - (start >> LINE_SHIFT) + 1 > NARROW_LINES
}

fn set_bit(words: &[AtomicU64], bit: u64) {
    if let Some(w) = words.get((bit / 64) as usize) {
        // SYNC POINT: pairs with `any_bit`'s Acquire load.
        w.fetch_or(1u64 << (bit % 64), Ordering::Release);
    }
}

fn clear_bit(words: &[AtomicU64], bit: u64) {
    if let Some(w) = words.get((bit / 64) as usize) {
        w.fetch_and(!(1u64 << (bit % 64)), Ordering::Release);
    }
}

impl CamOwner {
    /// An empty mirror.
    pub fn new() -> CamOwner {
        CamOwner::default()
    }

    /// Number of indexed tripwires.
    pub fn len(&self) -> usize {
        self.narrow.values().map(Vec::len).sum::<usize>() + self.wide.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Link entry `index`, already written and [`LIVE`] (with [`WIDE`] set iff
    /// [`is_wide`]`(start, end)`), into the index.
    pub fn insert(&mut self, cam: &CamView<'_>, index: u32, start: u64, end: u64) {
        let Some(e) = cam.entries.get(index as usize) else {
            return;
        };
        if is_wide(start, end) {
            let old = self.wide.first().map_or(0, |i| i + 1);
            e.next.store(old, Ordering::Relaxed);
            self.wide.insert(0, index);
            // SYNC POINT: publishes the entry's fields; pairs with `collect`'s Acquire.
            cam.header.wide_head.store(index + 1, Ordering::Release);
            for p in (start >> PAGE_SHIFT)..=((end - 1) >> PAGE_SHIFT) {
                let r = self.page_refs.get_or_insert_with(p, || 0);
                *r += 1;
                if *r == 1 {
                    set_bit(cam.wide, p);
                }
            }
        } else {
            let line = start >> LINE_SHIFT;
            let list = self.narrow.get_or_insert_with(line, Vec::new);
            let old = list.first().map_or(0, |i| i + 1);
            e.next.store(old, Ordering::Relaxed);
            if list.len() == list.capacity() {
                // Room for one, then doubling: most lines hold one tripwire.
                list.reserve_exact(list.len().max(1));
            }
            list.insert(0, index);
            if let Some(h) = cam.heads.get(line as usize) {
                // SYNC POINT: publishes the entry's fields; pairs with `collect`'s Acquire.
                h.store(index + 1, Ordering::Release);
            }
            for l in line..=((end - 1) >> LINE_SHIFT) {
                let r = self.line_refs.get_or_insert_with(l, || 0);
                *r += 1;
                if *r == 1 {
                    set_bit(cam.watch, l);
                }
            }
        }
        // SYNC POINT: the epoch pairs with the writers' "fence, load epoch" (`snoop`).
        cam.header.epoch.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Unlink entry `index` over `[start, end)`.
    pub fn remove(&mut self, cam: &CamView<'_>, index: u32, start: u64, end: u64) {
        if is_wide(start, end) {
            let Some(p) = self.wide.iter().position(|&i| i == index) else {
                return;
            };
            let next = self.wide.get(p + 1).map_or(0, |i| i + 1);
            if p == 0 {
                cam.header.wide_head.store(next, Ordering::Release);
            } else if let Some(prev) = cam.entries.get(self.wide[p - 1] as usize) {
                prev.next.store(next, Ordering::Release);
            }
            self.wide.remove(p);
            for pg in (start >> PAGE_SHIFT)..=((end - 1) >> PAGE_SHIFT) {
                if let Some(r) = self.page_refs.get_mut(&pg) {
                    *r -= 1;
                    if *r == 0 {
                        self.page_refs.remove(&pg);
                        clear_bit(cam.wide, pg);
                    }
                }
            }
        } else {
            let line = start >> LINE_SHIFT;
            let Some(list) = self.narrow.get_mut(&line) else {
                return;
            };
            let Some(p) = list.iter().position(|&i| i == index) else {
                return;
            };
            let next = list.get(p + 1).map_or(0, |i| i + 1);
            if p == 0 {
                if let Some(h) = cam.heads.get(line as usize) {
                    h.store(next, Ordering::Release);
                }
            } else if let Some(prev) = cam.entries.get(list[p - 1] as usize) {
                prev.next.store(next, Ordering::Release);
            }
            list.remove(p);
            if list.is_empty() {
                self.narrow.remove(&line);
            }
            for l in line..=((end - 1) >> LINE_SHIFT) {
                if let Some(r) = self.line_refs.get_mut(&l) {
                    *r -= 1;
                    if *r == 0 {
                        self.line_refs.remove(&l);
                        clear_bit(cam.watch, l);
                    }
                }
            }
        }
        cam.header.epoch.fetch_add(1, Ordering::SeqCst);
    }
}
