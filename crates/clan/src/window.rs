//! A window onto one aperture as seen by this process, and the snooped data path through it.
//!
//! Every access through the NIC — PIO through a mapping, and later DMA and incoming link
//! traffic — ends here: bounds and revocation are checked by the caller, then the bytes move
//! through [`clan_shm::snoop`], which fires the aperture's tripwires in the right order.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use clan_shm::cam::Candidate;
use clan_shm::eq::CamRef;
use clan_shm::segment::Segment;
use clan_shm::snoop::{self, Watch};
use clan_shm::sync::{AtomicU32, AtomicU64};
use clan_shm::trip::Access;

use crate::error::AccessError;
use crate::event_queue::{ClaimTo, EqPort};

thread_local! {
    static SCRATCH: RefCell<Vec<Candidate>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` with this thread's candidate buffer (a fresh one if it is already in use).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Vec<Candidate>) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut v) => f(&mut v),
        Err(_) => f(&mut Vec::new()),
    })
}

/// One aperture's memory and index, and the queue its tripwires report to.
#[derive(Debug)]
pub(crate) struct Window {
    /// Mapping of the data (all of it, or the pages a descriptor covers), held by value:
    /// an access follows no pointer from the window to the memory.
    pub data: Segment,
    /// Aperture offset of byte 0 of `data`.
    pub data_base: u64,
    /// The aperture's index, its view held inline (as `data`).
    pub cam: CamRef,
    /// The index's tag.
    pub tag: u64,
    /// The revocation word while the export is live.
    pub live: u64,
    /// Where firings are posted: the exporter's queue if it is ours, else our port in it.
    pub port: Arc<EqPort>,
    /// For another process's aperture: the aperture our port's claims name (its tripwires
    /// are fired by their owner, `crate::port`).
    pub claim: Option<ClaimTo>,
    /// For another process's aperture: false once that process (or its NIC) is gone, or the
    /// control connection the import came through broke.
    pub peer_alive: Option<Arc<std::sync::atomic::AtomicBool>>,
}

fn seg_err(e: clan_shm::segment::SegmentError) -> AccessError {
    match e {
        clan_shm::segment::SegmentError::OutOfBounds { offset, len, size } => {
            AccessError::OutOfBounds { offset: offset as u64, len: len as u64, size: size as u64 }
        }
        clan_shm::segment::SegmentError::Misaligned { offset, align } => {
            AccessError::Misaligned { offset: offset as u64, align: align as u64 }
        }
        clan_shm::segment::SegmentError::ReadOnly => AccessError::NotWritable,
    }
}

impl Window {
    /// Whether the export is still live (and its exporter).
    #[inline]
    pub fn check_live(&self) -> Result<(), AccessError> {
        if let Some(a) = &self.peer_alive {
            // SYNC POINT: pairs with the Release store in `PeerConn::mark_gone`.
            if !a.load(Ordering::Acquire) {
                return Err(AccessError::Disconnected);
            }
        }
        // SYNC POINT: pairs with the exporter's Release store of 0 on unexport.
        if self.cam.view().header.state.load(Ordering::Acquire) == self.live {
            Ok(())
        } else {
            Err(AccessError::Revoked)
        }
    }

    /// Another handle on this window, for a handle that holds its hot state by value
    /// (`crate::Mapping`): `None` if its memory is a mapping of its own, which has one owner.
    pub fn alias(&self) -> Option<Window> {
        Some(Window {
            data: self.data.alias()?,
            data_base: self.data_base,
            cam: self.cam.clone(),
            tag: self.tag,
            live: self.live,
            port: self.port.clone(),
            claim: self.claim,
            peer_alive: self.peer_alive.clone(),
        })
    }

    /// Prefetch what an access of `[abs, abs+len)` reads first: the index's header (and the
    /// line after it, where a small aperture's first entries are) and the data's lines.
    #[inline]
    pub fn prefetch(&self, abs: u64, len: u64) {
        let cam = self.cam.view();
        clan_shm::prefetch::range(cam.header as *const clan_shm::cam::CamHeader, 128);
        if let Some(rel) = abs.checked_sub(self.data_base) {
            let rel = rel as usize;
            let len = (len as usize).min(self.data.len().saturating_sub(rel));
            clan_shm::prefetch::range(self.data.as_ptr().wrapping_add(rel), len);
        }
    }

    #[inline]
    fn rel(&self, abs: u64) -> usize {
        (abs - self.data_base) as usize
    }

    fn with_watch<R>(&self, f: impl FnOnce(&Watch<'_>) -> R) -> R {
        let v = self.port.view();
        let watch = Watch { cam: self.cam.view(), table: &v.table, tag: self.tag };
        f(&watch)
    }

    /// Write `src` at aperture offset `abs` (in bounds: checked by the caller).
    pub fn write(&self, abs: u64, src: &[u8]) -> Result<u32, AccessError> {
        self.transfer(Access::Write, abs, src.len() as u64, &mut |o, l| {
            let from = (o - abs) as usize;
            self.data.write(self.rel(o), &src[from..from + l as usize]).map_err(seg_err)
        })
    }

    /// [`snoop::transfer`] of `[abs, abs+len)` by `mover`: its quick form first (no scratch
    /// list, no sink, when nothing near is watched), the whole of it otherwise.
    #[inline]
    fn transfer(
        &self,
        access: Access,
        abs: u64,
        len: u64,
        mover: &mut impl FnMut(u64, u64) -> Result<(), AccessError>,
    ) -> Result<u32, AccessError> {
        self.with_watch(|w| match snoop::transfer_quick(w, abs, len, mover)? {
            snoop::Quick::Done => Ok(0),
            // (`Fire` is the then-store form's: here only as `Finish`, which covers it)
            snoop::Quick::Finish(seen) | snoop::Quick::Fire { seen, .. } => {
                let sink = self.port.sink(self.claim);
                Ok(with_scratch(|s| snoop::finish_transfer(access, w, &sink, abs, len, seen, s)))
            }
            snoop::Quick::Watched => {
                let sink = self.port.sink(self.claim);
                with_scratch(|s| snoop::transfer(access, w, &sink, abs, len, s, mover))
            }
        })
    }

    /// Write `src` at `abs`, then store `v` (Release) at `word_abs`, snooped as one
    /// transfer with one fence (`snoop::transfer_then_store`).
    pub fn write_then_store_u64(&self, abs: u64, src: &[u8], word_abs: u64, v: u64) -> Result<u32, AccessError> {
        let word = self.data.view::<AtomicU64>(self.rel(word_abs)).map_err(seg_err)?;
        let mut mover = |o: u64, l: u64| {
            let from = (o - abs) as usize;
            self.data.write(self.rel(o), &src[from..from + l as usize]).map_err(seg_err)
        };
        // SYNC POINT: pairs with the reader's Acquire load of the word.
        let store = || word.store(v, Ordering::Release);
        self.with_watch(|w| self.then_store(w, abs, src.len() as u64, word_abs, &mut mover, &store))
    }

    /// [`snoop::transfer_then_store`] of `[abs, abs+len)` by `mover`, then the word at
    /// `word_abs` by `store`: its quick form first (no scratch list, no sink, when nothing
    /// near the data is watched), the whole of it otherwise.
    #[inline]
    fn then_store(
        &self,
        w: &snoop::Watch<'_>,
        abs: u64,
        len: u64,
        word_abs: u64,
        mover: &mut impl FnMut(u64, u64) -> Result<(), AccessError>,
        store: &impl Fn(),
    ) -> Result<u32, AccessError> {
        match snoop::transfer_then_store_quick(w, abs, len, word_abs, 8, mover, store)? {
            snoop::Quick::Done => Ok(0),
            snoop::Quick::Finish(seen) => {
                let sink = self.port.sink(self.claim);
                Ok(with_scratch(|s| snoop::finish_store(w, &sink, abs, len, word_abs, 8, seen, s)))
            }
            snoop::Quick::Fire { seen, armed } => {
                let sink = self.port.sink(self.claim);
                Ok(with_scratch(|s| snoop::finish_store_armed(w, &sink, abs, len, word_abs, 8, seen, &armed, s)))
            }
            snoop::Quick::Watched => {
                let sink = self.port.sink(self.claim);
                with_scratch(|s| snoop::transfer_then_store(w, &sink, abs, len, word_abs, 8, s, mover, store))
            }
        }
    }

    /// Write a message led by a word: `src` at `abs + 8`, then `lead` (Release) at `abs`,
    /// then `v` (Release) at `word_abs`, snooped as one transfer of `[abs, abs+8+len)` with
    /// one fence. The lead word is stored once the whole body is in place (in the transfer's
    /// last piece), so a reader that sees it sees the whole message: the message queue's
    /// receiver takes a slot on its sequence word alone, one cache line, without the
    /// counter's. A tripwire that splits the transfer before the body's end (one watching a
    /// header) fires before the lead is there; its waiter looks, finds nothing, and arms it
    /// again, and the Dekker argument of [`snoop::transfer_then_store`] (every store, the
    /// lead's included, before the fence; the look at the armed states after it) fires it
    /// again or lets the look see the lead.
    #[inline]
    pub fn write_led_then_store_u64(
        &self,
        abs: u64,
        lead: u64,
        src: &[u8],
        word_abs: u64,
        v: u64,
    ) -> Result<u32, AccessError> {
        let lead_word = self.data.view::<AtomicU64>(self.rel(abs)).map_err(seg_err)?;
        let word = self.data.view::<AtomicU64>(self.rel(word_abs)).map_err(seg_err)?;
        let body = abs + 8;
        let mut mover = |o: u64, l: u64| {
            let (from, end) = (o.max(body), o + l);
            if end > from {
                let at = (from - body) as usize;
                self.data.write(self.rel(from), &src[at..at + (end - from) as usize]).map_err(seg_err)?;
            }
            if end == body + src.len() as u64 {
                // SYNC POINT: pairs with the reader's Acquire load of the lead word: the
                // whole body (this piece and those before) is visible with it.
                lead_word.store(lead, Ordering::Release);
            }
            Ok(())
        };
        // SYNC POINT: pairs with the reader's Acquire load of the flag word.
        let store = || word.store(v, Ordering::Release);
        self.with_watch(|w| self.then_store(w, abs, 8 + src.len() as u64, word_abs, &mut mover, &store))
    }

    /// [`Window::write_led_then_store_u64`] for a run of messages `stride` bytes apart: each
    /// message's body, then its lead word, message after message, then `v` at `word_abs`; one
    /// snooped transfer over the run, one fence for all of them. Each body is at most
    /// `stride - 8` bytes (checked by the caller).
    pub fn write_led_run_then_store_u64(
        &self,
        abs: u64,
        stride: u64,
        msgs: &[(u64, &[u8])],
        word_abs: u64,
        v: u64,
    ) -> Result<u32, AccessError> {
        let Some(last) = msgs.last() else { return Ok(0) };
        let len = (msgs.len() as u64 - 1) * stride + 8 + last.1.len() as u64;
        let word = self.data.view::<AtomicU64>(self.rel(word_abs)).map_err(seg_err)?;
        let mut mover = |o: u64, l: u64| {
            let end = o + l;
            for (k, (lead, body)) in msgs.iter().enumerate().skip(((o - abs) / stride) as usize) {
                let start = abs + k as u64 * stride;
                if start >= end {
                    break;
                }
                let (b0, b1) = (start + 8, start + 8 + body.len() as u64);
                let (from, to) = (o.max(b0), end.min(b1));
                if to > from {
                    let at = (from - b0) as usize;
                    self.data.write(self.rel(from), &body[at..at + (to - from) as usize]).map_err(seg_err)?;
                }
                if b1 > o && b1 <= end {
                    // SYNC POINT: pairs with the reader's Acquire load of this message's lead
                    // word: its whole body is visible with it (it ends in this piece; exactly
                    // one piece holds its end).
                    self.data.view::<AtomicU64>(self.rel(start)).map_err(seg_err)?.store(*lead, Ordering::Release);
                }
            }
            Ok(())
        };
        // SYNC POINT: pairs with the reader's Acquire load of the flag word.
        let store = || word.store(v, Ordering::Release);
        self.with_watch(|w| self.then_store(w, abs, len, word_abs, &mut mover, &store))
    }

    /// Copy `len` bytes of segment `src` at `src_off` to aperture offset `abs`, snooped
    /// like [`Window::write`] (the DMA engine's copy: one pass, no intermediate buffer).
    pub fn write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<u32, AccessError> {
        self.transfer(Access::Write, abs, len, &mut |o, l| {
            let from = src_off + (o - abs);
            self.data.copy_from(self.rel(o), src, from as usize, l as usize).map_err(seg_err)
        })
    }

    /// Read into `dst` from aperture offset `abs`.
    pub fn read(&self, abs: u64, dst: &mut [u8]) -> Result<u32, AccessError> {
        let len = dst.len() as u64;
        self.transfer(Access::Read, abs, len, &mut |o, l| {
            let from = (o - abs) as usize;
            self.data.read(self.rel(o), &mut dst[from..from + l as usize]).map_err(seg_err)
        })
    }

    /// Apply `src` at `abs` as one piece of an incoming write burst that ends at `end` (a
    /// link's receive path): tripwires whose range the burst covers fire once, when its last
    /// piece is in ([`snoop::transfer_piece`]).
    pub fn write_piece(
        &self,
        abs: u64,
        src: &[u8],
        end: u64,
        scratch: &mut Vec<Candidate>,
    ) -> Result<u32, AccessError> {
        let sink = self.port.sink(self.claim);
        self.with_watch(|w| {
            snoop::transfer_piece(Access::Write, w, &sink, abs, src.len() as u64, end, scratch, |o, l| {
                let from = (o - abs) as usize;
                self.data.write(self.rel(o), &src[from..from + l as usize]).map_err(seg_err)
            })
        })
    }

    /// Receive up to `max` bytes of an incoming write burst that ends at `end` straight into
    /// the memory at `abs`: `fill(segment, offset, len)` puts at most `len` bytes there (a
    /// socket read) and says how many; it is given no more than reaches the next watched
    /// boundary, so the tripwires of what completed fire right after (and none of a range
    /// still partly unwritten). Returns how many bytes came.
    pub fn receive_piece<E>(
        &self,
        abs: u64,
        max: u64,
        end: u64,
        scratch: &mut Vec<Candidate>,
        fill: impl FnOnce(&Segment, usize, usize) -> Result<usize, E>,
    ) -> Result<usize, E> {
        let sink = self.port.sink(self.claim);
        self.with_watch(|w| {
            let stop = snoop::next_stop(Access::Write, w, abs, abs + max, end, scratch);
            let n = fill(&self.data, self.rel(abs), (stop - abs) as usize)?;
            if n > 0 {
                snoop::commit_piece(Access::Write, w, &sink, abs, n as u64, end, scratch);
            }
            Ok(n)
        })
    }

    /// Fire the tripwires of `[abs, abs+len)` for `access`, the data being already in place.
    pub fn commit(&self, abs: u64, len: u64, access: Access) -> u32 {
        self.with_watch(|w| {
            if snoop::commit_quick(access, w, abs, len) {
                return 0;
            }
            let sink = self.port.sink(self.claim);
            with_scratch(|s| snoop::commit(access, w, &sink, abs, len, s))
        })
    }

    /// Atomic word store (Release), then fire.
    pub fn store_u64(&self, abs: u64, v: u64) -> Result<u32, AccessError> {
        self.data.view::<AtomicU64>(self.rel(abs)).map_err(seg_err)?.store(v, Ordering::Release);
        Ok(self.commit(abs, 8, Access::Write))
    }

    /// Atomic word store (Release), then fire.
    pub fn store_u32(&self, abs: u64, v: u32) -> Result<u32, AccessError> {
        self.data.view::<AtomicU32>(self.rel(abs)).map_err(seg_err)?.store(v, Ordering::Release);
        Ok(self.commit(abs, 4, Access::Write))
    }

    /// Atomic word load (Acquire), then fire read tripwires.
    pub fn load_u64(&self, abs: u64) -> Result<u64, AccessError> {
        let v = self.data.view::<AtomicU64>(self.rel(abs)).map_err(seg_err)?.load(Ordering::Acquire);
        self.commit(abs, 8, Access::Read);
        Ok(v)
    }

    /// Atomic word load (Acquire), then fire read tripwires.
    pub fn load_u32(&self, abs: u64) -> Result<u32, AccessError> {
        let v = self.data.view::<AtomicU32>(self.rel(abs)).map_err(seg_err)?.load(Ordering::Acquire);
        self.commit(abs, 4, Access::Read);
        Ok(v)
    }

    /// A raw window for zero-copy access.
    pub fn raw(&self, abs: u64, len: u64) -> Result<clan_shm::segment::RawRegion<'_>, AccessError> {
        self.data.raw(self.rel(abs), len as usize).map_err(seg_err)
    }

    /// Fault in the pages of `len` bytes at `abs` (best effort).
    pub fn prefault(&self, abs: u64, len: u64) {
        self.data.populate(self.rel(abs), len as usize);
    }
}

/// Check that `[off, off+len)` lies within `size` bytes.
#[inline]
pub(crate) fn check_range(off: u64, len: u64, size: u64) -> Result<(), AccessError> {
    match off.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(AccessError::OutOfBounds { offset: off, len, size }),
    }
}

/// Check word alignment.
#[inline]
pub(crate) fn check_align(off: u64, align: u64) -> Result<(), AccessError> {
    if off % align == 0 { Ok(()) } else { Err(AccessError::Misaligned { offset: off, align }) }
}
