//! Mappings: imported descriptors, the importer's view of remote memory.
//!
//! The API is the same whether the exporter is this process or another process on the host
//! (and, with a link, another host): programmed I/O with [`Mapping::write`] and
//! [`Mapping::read`], aligned word access ([`Mapping::store_u64`], [`Mapping::load_u64`]),
//! raw zero-copy access followed by [`Mapping::commit`], and [`Mapping::barrier`].
//!
//! Within a host the data moves by the caller's own loads and stores into the exporter's
//! memory (true zero copy); the NIC's part is the snooping: every access is matched against
//! the aperture's tripwires, and the mapping's own (outgoing) tripwires fire once the access
//! has completed. Every access is checked first: the range against the descriptor, the
//! rights, and that the export is still live — a bad access is an error, never a write
//! outside the descriptor's range.
//!
//! Writes from one mapping are applied in program order; [`Mapping::barrier`] orders them
//! with the caller's later accesses to other memory (PRAM consistency, as in the paper).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use clan_shm::cam::CamLayout;
use clan_shm::eq::CamMap;
use clan_shm::segment::{self, Segment};
use clan_shm::trip::Access;

use crate::descriptor::{Descriptor, Rights};
use crate::error::{AccessError, TripwireError};
use crate::event_queue::EqInner;
use crate::tripwire::{Tripwire, TripwireConfig, WatchOwner};
use crate::window::{Window, check_align, check_range, with_scratch};

/// What keeps the exporter's side alive, dropped after the window (so memory is unmapped
/// before the exporter is told it may reuse it).
#[derive(Debug)]
pub(crate) enum Keep {
    Local(#[allow(dead_code)] Arc<crate::aperture::ApertureInner>),
    Remote(#[allow(dead_code)] crate::peer::ImportGuard),
}

#[derive(Debug)]
pub(crate) struct MappingInner {
    // Field order matters: `window` (the mappings) drops before `_keep` (the unimport).
    pub window: Window,
    pub desc: Descriptor,
    pub off: u64,
    pub len: u64,
    pub rights: Rights,
    pub importer_eq: Arc<EqInner>,
    pub importer_port: u32,
    pub outgoing: OnceLock<Arc<WatchOwner>>,
    pub serial: u64,
    pub _keep: Keep,
}

/// An imported descriptor. Cheap to clone (clones share the import); `Send` and `Sync`.
/// The import is released when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub(crate) inner: Arc<MappingInner>,
}

impl Mapping {
    /// Length of the mapped range.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Whether the mapping is empty (never).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The descriptor it was imported from.
    pub fn descriptor(&self) -> &Descriptor {
        &self.inner.desc
    }

    /// Rights granted.
    pub fn rights(&self) -> Rights {
        self.inner.rights
    }

    /// Whether the export is still live (a plain memory load).
    pub fn is_live(&self) -> bool {
        self.inner.window.check_live().is_ok()
    }

    #[inline]
    fn check(&self, off: u64, len: u64, need: Rights) -> Result<u64, AccessError> {
        let i = &self.inner;
        if !i.rights.contains(need) {
            return Err(if need == Rights::WRITE {
                AccessError::NotWritable
            } else {
                AccessError::NotReadable
            });
        }
        check_range(off, len, i.len)?;
        i.window.check_live()?;
        Ok(i.off + off)
    }

    #[inline]
    fn outgoing(&self, access: Access, off: u64, len: u64) {
        if let Some(o) = self.inner.outgoing.get() {
            o.fire_range(access, off, len);
        }
    }

    /// Write `src` at `off` (programmed I/O).
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), AccessError> {
        let abs = self.check(off, src.len() as u64, Rights::WRITE)?;
        self.inner.window.write(abs, src)?;
        self.outgoing(Access::Write, off, src.len() as u64);
        Ok(())
    }

    /// Read into `dst` from `off` (costs more than a write across hosts: protocols avoid it).
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        let abs = self.check(off, dst.len() as u64, Rights::READ)?;
        self.inner.window.read(abs, dst)?;
        self.outgoing(Access::Read, off, dst.len() as u64);
        Ok(())
    }

    /// Atomic store (Release) of the aligned word at `off`.
    pub fn store_u64(&self, off: u64, v: u64) -> Result<(), AccessError> {
        check_align(off, 8)?;
        let abs = self.check(off, 8, Rights::WRITE)?;
        self.inner.window.store_u64(abs, v)?;
        self.outgoing(Access::Write, off, 8);
        Ok(())
    }

    /// Atomic store (Release) of the aligned 32-bit word at `off`.
    pub fn store_u32(&self, off: u64, v: u32) -> Result<(), AccessError> {
        check_align(off, 4)?;
        let abs = self.check(off, 4, Rights::WRITE)?;
        self.inner.window.store_u32(abs, v)?;
        self.outgoing(Access::Write, off, 4);
        Ok(())
    }

    /// Atomic load (Acquire) of the aligned word at `off`.
    pub fn load_u64(&self, off: u64) -> Result<u64, AccessError> {
        check_align(off, 8)?;
        let abs = self.check(off, 8, Rights::READ)?;
        let v = self.inner.window.load_u64(abs)?;
        self.outgoing(Access::Read, off, 8);
        Ok(v)
    }

    /// Atomic load (Acquire) of the aligned 32-bit word at `off`.
    pub fn load_u32(&self, off: u64) -> Result<u32, AccessError> {
        check_align(off, 4)?;
        let abs = self.check(off, 4, Rights::READ)?;
        let v = self.inner.window.load_u32(abs)?;
        self.outgoing(Access::Read, off, 4);
        Ok(v)
    }

    /// A raw window onto `len` bytes at `off` for zero-copy access (for instance, serialise
    /// a message directly into remote memory). Stores through it are invisible to the NIC
    /// until [`Mapping::commit`] of the range fires its tripwires. Writable only with write
    /// rights ([`clan_shm::segment::RawRegion::is_writable`]).
    pub fn raw(&self, off: u64, len: u64) -> Result<clan_shm::segment::RawRegion<'_>, AccessError> {
        let need = if self.inner.rights.contains(Rights::WRITE) {
            Rights::WRITE
        } else {
            Rights::READ
        };
        let abs = self.check(off, len, need)?;
        self.inner.window.raw(abs, len)
    }

    /// Publish raw stores to `[off, off+len)`: fence, then fire the tripwires the range
    /// touches, as a write through the NIC would have. Returns how many fired.
    pub fn commit(&self, off: u64, len: u64) -> Result<u32, AccessError> {
        let abs = self.check(off, len, Rights::WRITE)?;
        let n = self.inner.window.commit(abs, len, Access::Write);
        self.outgoing(Access::Write, off, len);
        Ok(n)
    }

    /// Order all earlier accesses through this mapping before all later memory accesses of
    /// the caller (a full fence within a host).
    pub fn barrier(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Set a tripwire on this node's own traffic through the mapping: it fires once a write
    /// (or read) through the mapping that touches `cfg`'s range (relative to the mapping) has
    /// completed. It reports to the importing endpoint's event queue.
    pub fn tripwire(&self, cfg: TripwireConfig) -> Result<Tripwire, TripwireError> {
        let i = &self.inner;
        let owner = match i.outgoing.get() {
            Some(o) => o.clone(),
            None => {
                let layout = CamLayout::new(i.len);
                let seg = Segment::anonymous(segment::page_align(layout.size)).map_err(|_| {
                    TripwireError::TableFull {
                        capacity: i.importer_eq.layout.params.trip_cap,
                    }
                })?;
                let cam = CamMap::new(Arc::new(seg), 0, i.len).map_err(|_| TripwireError::Stale)?;
                let tag = (1u64 << 63) | i.serial;
                let o = Arc::new(WatchOwner::new(
                    i.importer_eq.clone(),
                    Arc::new(cam),
                    tag,
                    i.len,
                    0,
                    i.importer_port,
                ));
                let _ = i.outgoing.set(o);
                i.outgoing.get().cloned().ok_or(TripwireError::Stale)?
            }
        };
        owner.add(&cfg)
    }
}

impl Drop for MappingInner {
    fn drop(&mut self) {
        if let Some(o) = self.outgoing.get() {
            o.clear();
        }
    }
}

impl WatchOwner {
    /// Fire this (outgoing) index's tripwires over `[off, off+len)`, after completion.
    pub(crate) fn fire_range(&self, access: Access, off: u64, len: u64) -> u32 {
        let v = self.eq.view();
        let watch = clan_shm::snoop::Watch {
            cam: self.cam.view(),
            table: &v.table,
            tag: self.tag,
        };
        let sink = self.eq.port.sink();
        with_scratch(|s| clan_shm::snoop::commit(access, &watch, &sink, off + self.base, len, s))
    }
}
