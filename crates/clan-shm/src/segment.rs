//! A mapped region of shared memory, accessed only through bounds-checked operations.
//!
//! A [`Segment`] is one `mmap` of a memfd (or of anonymous shared memory). It never hands out
//! Rust references to plain bytes of the mapping: bytes are moved with raw copies
//! ([`Segment::write`], [`Segment::read`]), and control words are reached as atomics
//! ([`Segment::view`], [`Segment::slice`]). The memory may be written at any moment by other
//! processes, so it is treated like device memory: every offset and length is checked here,
//! and every value read from it is untrusted input for the caller.

use std::io;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags};

use crate::sync::{AtomicU8, AtomicU32, AtomicU64};

/// Types that may be overlaid on shared memory.
///
/// # Safety
///
/// Implementors must be `#[repr(C)]` (or primitive), contain only atomics (or arrays and
/// structs of them) so that every bit pattern is a valid value and every access is atomic,
/// have no `Drop` glue, and no padding that matters. Concurrent modification by other
/// processes is then never undefined behaviour, only untrusted data.
pub unsafe trait Shared: Sync + Sized {}

// SAFETY: atomics accept every bit pattern and are accessed atomically.
unsafe impl Shared for AtomicU8 {}
// SAFETY: as above.
unsafe impl Shared for AtomicU32 {}
// SAFETY: as above.
unsafe impl Shared for AtomicU64 {}

// SAFETY: `#[repr(C)]` structs made only of atomics (see their definitions).
unsafe impl Shared for crate::ring::RingHeader {}
// SAFETY: as above.
unsafe impl Shared for crate::ring::EventSlot {}
// SAFETY: as above.
unsafe impl Shared for crate::trip::TripEntry {}
// SAFETY: as above.
unsafe impl Shared for crate::trip::TripsetWord {}
// SAFETY: as above.
unsafe impl Shared for crate::trip::TripCell {}
// SAFETY: as above.
unsafe impl Shared for crate::eq::EqHeader {}
// SAFETY: as above.
unsafe impl Shared for crate::cam::CamHeader {}
// SAFETY: as above.
unsafe impl Shared for crate::cam::CamMeta {}

/// How a segment is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `PROT_READ`: writes through this segment are refused with [`SegmentError::ReadOnly`].
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// A bad access to a segment. Always a caller's bug or hostile input, never a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentError {
    /// `offset + len` exceeds the segment.
    OutOfBounds {
        /// Requested offset.
        offset: usize,
        /// Requested length.
        len: usize,
        /// Size of the segment.
        size: usize,
    },
    /// The offset is not aligned for the requested type.
    Misaligned {
        /// Requested offset.
        offset: usize,
        /// Required alignment.
        align: usize,
    },
    /// A write to a read-only mapping.
    ReadOnly,
}

impl std::fmt::Display for SegmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            SegmentError::OutOfBounds { offset, len, size } => {
                write!(f, "access of {len} bytes at offset {offset} is outside the {size}-byte region")
            }
            SegmentError::Misaligned { offset, align } => {
                write!(f, "offset {offset} is not {align}-byte aligned")
            }
            SegmentError::ReadOnly => write!(f, "the region is mapped read-only"),
        }
    }
}

impl std::error::Error for SegmentError {}

/// One mapping of shared memory (or a part of one: [`Segment::sub`]). Unmapped on drop.
#[derive(Debug)]
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    /// For a part of a mapping: the mapping (kept alive, unmapped by its own drop).
    parent: Option<std::sync::Arc<Segment>>,
}

// SAFETY: the segment is a raw region; all access goes through atomics or raw copies whose
// concurrency is the protocol's business (see the module documentation). Nothing in it is
// tied to a thread.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only allows bounds-checked raw copies and atomic views.
unsafe impl Sync for Segment {}

impl Segment {
    /// Map `len` bytes of `fd` at `offset` (which must be page-aligned), shared.
    pub fn map(fd: impl AsFd, offset: u64, len: usize, access: Access) -> io::Result<Segment> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot map 0 bytes"));
        }
        if offset % page_size() as u64 != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "mapping offset is not page-aligned"));
        }
        let prot = match access {
            Access::ReadOnly => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        };
        // SAFETY: a fresh mapping at an address the kernel chooses cannot alias any Rust
        // object; the fd's file outlives the mapping by kernel reference counting.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, offset)? };
        Ok(Segment { ptr: NonNull::new(ptr.cast()).expect("mmap returned null"), len, access, parent: None })
    }

    /// `len` bytes of `parent` at `offset` (a multiple of [`PART_ALIGN`]) as a segment of
    /// their own: every access is checked against the part, and the mapping stays mapped
    /// while the part lives. How several apertures carved from one memfd share one mapping
    /// (small ones several to a page).
    pub fn sub(parent: &std::sync::Arc<Segment>, offset: usize, len: usize) -> Result<Segment, SegmentError> {
        if len == 0 {
            return Err(SegmentError::OutOfBounds { offset, len, size: parent.len });
        }
        parent.check(offset, len)?;
        if offset % PART_ALIGN != 0 {
            return Err(SegmentError::Misaligned { offset, align: PART_ALIGN });
        }
        // SAFETY: `offset + len <= parent.len` (checked), so the pointer stays inside the
        // parent's live mapping, which the part keeps alive through its `Arc`.
        let ptr = unsafe { NonNull::new_unchecked(parent.as_ptr().add(offset)) };
        Ok(Segment { ptr, len, access: parent.access, parent: Some(parent.clone()) })
    }

    /// The whole of `parent` as a part of it: a segment held by value (no `Arc` to follow on
    /// each access) that keeps the mapping alive.
    pub fn whole(parent: &std::sync::Arc<Segment>) -> Segment {
        Segment { ptr: parent.ptr, len: parent.len, access: parent.access, parent: Some(parent.clone()) }
    }

    /// Another handle on a part of a mapping (`None` for a mapping itself, which is unmapped
    /// by its one owner: share it through an `Arc` and [`Segment::whole`] instead).
    pub fn alias(&self) -> Option<Segment> {
        let parent = self.parent.as_ref()?.clone();
        Some(Segment { ptr: self.ptr, len: self.len, access: self.access, parent: Some(parent) })
    }

    /// Anonymous shared memory (inherited across `fork`), zero-filled.
    pub fn anonymous(len: usize) -> io::Result<Segment> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot map 0 bytes"));
        }
        // SAFETY: as for `map`: a fresh mapping aliases nothing.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED)?
        };
        Ok(Segment {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned null"),
            len,
            access: Access::ReadWrite,
            parent: None,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment is empty (never: mappings have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How the segment is mapped.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Base address. Dereferencing it is the caller's `unsafe` business.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    #[inline]
    fn check(&self, offset: usize, len: usize) -> Result<(), SegmentError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(SegmentError::OutOfBounds { offset, len, size: self.len }),
        }
    }

    /// Fault in the pages of `[offset, offset+len)` now — writable when the mapping is — so
    /// that the first loads and stores there take no page fault (each costs microseconds in a
    /// virtual machine). Best effort: `false` if the range is outside or the kernel would not
    /// (`MADV_POPULATE_*` came in Linux 5.14). The contents are not touched.
    pub fn populate(&self, offset: usize, len: usize) -> bool {
        if len == 0 || self.check(offset, len).is_err() {
            return false;
        }
        let page = rustix::param::page_size();
        let first = self.as_ptr() as usize + offset;
        let start = first & !(page - 1);
        let end = first + len;
        let advice = match self.access {
            Access::ReadOnly => rustix::mm::Advice::LinuxPopulateRead,
            _ => rustix::mm::Advice::LinuxPopulateWrite,
        };
        // SAFETY: `[first, end)` lies inside this live mapping (checked above), and the page
        // that holds `first` is mapped with it (a mapping starts on a page boundary; a
        // sub-segment's page belongs to its parent's mapping, which it keeps alive).
        // Populating only faults pages in: no byte changes, no mapping changes.
        unsafe { rustix::mm::madvise(start as *mut std::ffi::c_void, end - start, advice).is_ok() }
    }

    #[inline]
    fn check_writable(&self) -> Result<(), SegmentError> {
        if self.access == Access::ReadOnly {
            return Err(SegmentError::ReadOnly);
        }
        Ok(())
    }

    /// Copy `src` into the segment at `offset`.
    #[inline]
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), SegmentError> {
        self.check_writable()?;
        self.check(offset, src.len())?;
        // SAFETY: bounds checked above; the destination is inside our live, writable mapping
        // and cannot overlap `src` (a Rust slice cannot point into memory we only expose raw).
        // Concurrent access by other processes is part of the protocol: the bytes are plain
        // data and ordering is provided by the atomics and fences around this copy.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copy bytes at `offset` out of the segment into `dst`.
    #[inline]
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), SegmentError> {
        self.check(offset, dst.len())?;
        // SAFETY: bounds checked; source is inside our live mapping; `dst` is a distinct Rust
        // buffer. See `write` on concurrent modification.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Fill `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), SegmentError> {
        self.check_writable()?;
        self.check(offset, len)?;
        // SAFETY: bounds checked; writable mapping.
        unsafe { std::ptr::write_bytes(self.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    /// Copy `len` bytes within the segment from `src` to `dst` (ranges may overlap).
    pub fn copy_within(&self, src: usize, dst: usize, len: usize) -> Result<(), SegmentError> {
        self.check_writable()?;
        self.check(src, len)?;
        self.check(dst, len)?;
        // SAFETY: both ranges checked to lie inside the mapping; `copy` handles overlap.
        unsafe { std::ptr::copy(self.as_ptr().add(src), self.as_ptr().add(dst), len) };
        Ok(())
    }

    /// Copy `len` bytes from `src_seg` at `src` into this segment at `dst`.
    pub fn copy_from(&self, dst: usize, src_seg: &Segment, src: usize, len: usize) -> Result<(), SegmentError> {
        self.check_writable()?;
        self.check(dst, len)?;
        src_seg.check(src, len)?;
        // SAFETY: both ranges checked; `copy` (memmove) tolerates the two segments being
        // mappings of the same pages.
        unsafe { std::ptr::copy(src_seg.as_ptr().add(src), self.as_ptr().add(dst), len) };
        Ok(())
    }

    /// A shared-memory type overlaid at `offset`.
    #[inline]
    pub fn view<T: Shared>(&self, offset: usize) -> Result<&T, SegmentError> {
        self.check(offset, std::mem::size_of::<T>())?;
        if offset % std::mem::align_of::<T>() != 0 || (self.as_ptr() as usize) % std::mem::align_of::<T>() != 0 {
            return Err(SegmentError::Misaligned { offset, align: std::mem::align_of::<T>() });
        }
        // SAFETY: in bounds and aligned (checked); `T: Shared` is valid for any bit pattern
        // and only accessed atomically; the reference lives no longer than `&self`, i.e. the
        // mapping.
        Ok(unsafe { &*self.as_ptr().add(offset).cast::<T>() })
    }

    /// `n` consecutive shared-memory values starting at `offset`.
    #[inline]
    pub fn slice<T: Shared>(&self, offset: usize, n: usize) -> Result<&[T], SegmentError> {
        let bytes = n.checked_mul(std::mem::size_of::<T>()).ok_or(SegmentError::OutOfBounds {
            offset,
            len: usize::MAX,
            size: self.len,
        })?;
        self.check(offset, bytes)?;
        if offset % std::mem::align_of::<T>() != 0 || (self.as_ptr() as usize) % std::mem::align_of::<T>() != 0 {
            return Err(SegmentError::Misaligned { offset, align: std::mem::align_of::<T>() });
        }
        // SAFETY: as for `view`, for `n` elements.
        Ok(unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset).cast::<T>(), n) })
    }

    /// Receive from socket `fd` straight into `len` bytes at `offset` (one `recv` call with
    /// `MSG_DONTWAIT`: never blocks, whatever the socket's mode): returns how many bytes
    /// arrived (0 at end of stream). The bytes go from the kernel into the shared memory with
    /// no intermediate buffer.
    pub fn recv_from(&self, fd: impl AsFd, offset: usize, len: usize) -> io::Result<usize> {
        self.check_writable().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        self.check(offset, len).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: the range lies inside our live, writable mapping (checked); the kernel writes
        // at most `len` bytes into it. As for `write`, concurrent access by other processes to
        // these plain bytes is the protocol's business; no Rust reference to them outlives the
        // call.
        let buf = unsafe { std::slice::from_raw_parts_mut(self.as_ptr().add(offset), len) };
        loop {
            match rustix::net::recv(&fd, &mut *buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok((n, _)) => return Ok(n),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Send `head` then `len` bytes at `offset` on socket `fd` with one vectored send (no
    /// copy of the shared bytes; `MSG_DONTWAIT | MSG_NOSIGNAL`: never blocks, whatever the
    /// socket's mode): returns how many bytes were sent in total.
    pub fn send_to(&self, fd: impl AsFd, head: &[u8], offset: usize, len: usize) -> io::Result<usize> {
        self.check(offset, len).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: the range lies inside our live mapping (checked); the kernel only reads it
        // during the call. Concurrent writers make the copy a snapshot of racing bytes, never
        // an access outside the mapping.
        let data = unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset), len) };
        let iov = [io::IoSlice::new(head), io::IoSlice::new(data)];
        loop {
            let flags = rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL;
            match rustix::net::sendmsg(&fd, &iov, &mut rustix::net::SendAncillaryBuffer::default(), flags) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A checked raw window onto `len` bytes at `offset`, for zero-copy access.
    pub fn raw(&self, offset: usize, len: usize) -> Result<RawRegion<'_>, SegmentError> {
        self.check(offset, len)?;
        Ok(RawRegion { seg: self, offset, len })
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.parent.is_some() {
            // A part: the parent's drop unmaps (once every part is gone).
            return;
        }
        // SAFETY: we own this mapping; every reference handed out borrowed `self`, so none
        // outlives it.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A bounds-checked window onto shared memory for direct loads and stores.
///
/// Obtaining one is safe; turning it into a Rust slice is `unsafe` because the memory may be
/// concurrently accessed by other processes, which Rust's aliasing rules cannot see.
#[derive(Debug, Clone, Copy)]
pub struct RawRegion<'a> {
    seg: &'a Segment,
    offset: usize,
    len: usize,
}

impl<'a> RawRegion<'a> {
    /// Offset of the window within its segment.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length of the window.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether stores through this window are allowed.
    pub fn is_writable(&self) -> bool {
        self.seg.access == Access::ReadWrite
    }
    /// Start address of the window.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset <= len` of the mapping (checked on construction).
        unsafe { self.seg.as_ptr().add(self.offset) }
    }
    /// The window as a mutable byte slice.
    ///
    /// # Safety
    ///
    /// The window must be writable ([`RawRegion::is_writable`]), and for the lifetime of the
    /// slice no other party may access these bytes (the protocol must give the caller
    /// exclusive ownership of the range, as a sender owns a slot until it publishes it). Other
    /// processes cannot be prevented from doing so by Rust; hostile concurrent writes only
    /// change the bytes, they cannot break memory safety of plain `u8` data in practice, but
    /// the contract is the caller's to keep. No other slice of the range may be alive.
    pub unsafe fn as_mut_slice(&mut self) -> &'a mut [u8] {
        // SAFETY: bounds checked on construction; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
    /// The window as a byte slice.
    ///
    /// # Safety
    ///
    /// No party may write these bytes while the slice is alive (see [`RawRegion::as_mut_slice`]).
    pub unsafe fn as_slice(&self) -> &'a [u8] {
        // SAFETY: bounds checked on construction; immutability is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

/// Alignment of a part of a mapping ([`Segment::sub`]): a cache line, so that a part's words
/// are aligned for atomics and no two parts share a line.
pub const PART_ALIGN: usize = 64;

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// Round `n` up to a multiple of the page size.
pub fn page_align(n: usize) -> usize {
    let p = page_size();
    n.div_ceil(p) * p
}
