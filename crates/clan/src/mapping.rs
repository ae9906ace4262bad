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
//! Across hosts (`crate::transport::link`) writes become bursts on the link, sent from the caller's
//! memory, and `barrier` waits until the exporter has applied every earlier write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use clan_shm::cam::CamLayout;
use clan_shm::eq::CamMap;
use clan_shm::segment::{self, Segment};
use clan_shm::trip::Access;

use crate::descriptor::{Descriptor, Rights};
use crate::endpoint::EndpointInner;
use crate::error::{AccessError, TripwireError};
use crate::event_queue::EqInner;
use crate::transport::{ReadStart, Transport, Via};
use crate::tripwire::{Tripwire, TripwireConfig, WatchOwner};
use crate::window::Window;
use crate::window::{check_align, check_range, with_scratch};

/// What keeps the exporter's side alive, dropped after the window (so memory is unmapped
/// before the exporter is told it may reuse it).
#[derive(Debug)]
pub(crate) enum Keep {
    Local(#[allow(dead_code)] Arc<crate::aperture::ApertureInner>),
    Remote(#[allow(dead_code)] crate::peer::ImportGuard),
    /// Over a link: the target unimports itself.
    None,
}

#[derive(Debug)]
pub(crate) struct MappingInner {
    // Field order matters: `via` (the mappings) drops before `_keep` (the unimport).
    pub via: Via,
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
///
/// ```
/// use clan::{AccessError, Rights};
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = server.export(4096)?;
/// let m = client.import(&ap.descriptor())?;
/// assert_eq!((m.len(), m.rights(), m.is_remote()), (4096, Rights::READ_WRITE, false));
/// m.write(8, b"message")?;
/// m.store_u64(0, 1)?; // then the flag that announces it
/// assert_eq!(ap.load_u64(0)?, 1);
/// let mut got = [0u8; 7];
/// m.read(8, &mut got)?;
/// assert_eq!(&got, b"message");
/// assert_eq!(m.store_u32(4096, 1), Err(AccessError::OutOfBounds { offset: 4096, len: 4, size: 4096 }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Mapping {
    // Field order: the aliases in `hot` drop before the record (and its unimport).
    hot: Hot,
    pub(crate) inner: Arc<MappingInner>,
}

/// What every access reads, held in the handle as well as in its record: at thousands of
/// mappings each pointer followed is a cache miss, and an access through a handle held by
/// value (a connection's) follows none before the exporter's memory and index. The range
/// and rights never change; the window (memory mapped in this process) is an alias of the
/// record's, `None` across hosts.
struct Hot {
    off: u64,
    len: u64,
    rights: Rights,
    window: Option<Window>,
}

impl Clone for Hot {
    fn clone(&self) -> Hot {
        Hot { off: self.off, len: self.len, rights: self.rights, window: self.window.as_ref().and_then(Window::alias) }
    }
}

/// Whether any mapping of this process has outgoing tripwires ([`Mapping::tripwire`]):
/// until one has, an access does not look at its mapping's record for them.
static OUTGOING_SET: AtomicBool = AtomicBool::new(false);

impl Mapping {
    /// A new import of `desc` by endpoint `ep`, reaching the memory through `via`; `keep`
    /// holds what releases the import when the last clone drops (after `via`).
    pub(crate) fn new(ep: &EndpointInner, desc: &Descriptor, via: Via, keep: Keep) -> Mapping {
        Mapping::from_inner(Arc::new(MappingInner {
            via,
            desc: desc.clone(),
            off: desc.offset(),
            len: desc.len(),
            rights: desc.rights(),
            importer_eq: ep.queue.inner.clone(),
            importer_port: ep.addr.port,
            outgoing: OnceLock::new(),
            serial: ep.nic.next_serial(),
            _keep: keep,
        }))
    }

    fn from_inner(inner: Arc<MappingInner>) -> Mapping {
        let window = match &inner.via {
            Via::Mapped(w) => w.alias(),
            Via::Link(_) => None,
        };
        Mapping { hot: Hot { off: inner.off, len: inner.len, rights: inner.rights, window }, inner }
    }

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

    /// Whether the export is still live, as far as this side knows (a plain memory load;
    /// across hosts, an unexport becomes known with the exporter's next refusal).
    pub fn is_live(&self) -> bool {
        self.check_live().is_ok()
    }

    /// Whether the exporter is on another host (the mapping goes through a link).
    pub fn is_remote(&self) -> bool {
        self.inner.via.is_remote()
    }

    #[inline]
    fn check_live(&self) -> Result<(), AccessError> {
        match &self.hot.window {
            Some(w) => w.check_live(),
            None => self.inner.via.check_live(),
        }
    }

    #[inline]
    fn check(&self, off: u64, len: u64, need: Rights) -> Result<u64, AccessError> {
        let h = &self.hot;
        let r = if !h.rights.contains(need) {
            Err(if need == Rights::WRITE { AccessError::NotWritable } else { AccessError::NotReadable })
        } else {
            check_range(off, len, h.len).and_then(|()| self.check_live())
        };
        match r {
            Ok(()) => Ok(h.off + off),
            Err(e) => Err(self.refused(e, off, len)),
        }
    }

    /// The second range of an access whose first range [`Mapping::check`] has just passed:
    /// its bounds only (the rights and the liveness are the first's, of the same moment).
    #[inline]
    fn check_more(&self, off: u64, len: u64) -> Result<u64, AccessError> {
        match check_range(off, len, self.hot.len) {
            Ok(()) => Ok(self.hot.off + off),
            Err(e) => Err(self.refused(e, off, len)),
        }
    }

    #[cold]
    fn refused(&self, e: AccessError, off: u64, len: u64) -> AccessError {
        tracing::debug!(exporter = %self.inner.desc.nic(), aperture = self.inner.desc.aperture(), off, len, "access refused: {e}");
        e
    }

    /// Hint that an access of `[off, off+len)` comes soon: the lines it will read (this
    /// handle's, the index's first, the memory's) are asked for at once, so that their cache
    /// misses overlap rather than follow one another. Changes nothing else; across hosts, and
    /// out of range, it does nothing. Worth it where thousands of mappings are used at
    /// random (an RPC server's connections), each access then finding every line cold.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// m.prefetch(128, 128); // the lines of the next message and its flag
    /// m.prefetch(4000, 1 << 20); // out of range: nothing
    /// m.write_then_store_u64(192, b"request", 128, 1)?;
    /// assert_eq!(ap.load_u64(128)?, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn prefetch(&self, off: u64, len: u64) {
        clan_shm::prefetch::value(&self.hot);
        if let Some(w) = &self.hot.window {
            if check_range(off, len, self.hot.len).is_ok() {
                w.prefetch(self.hot.off + off, len);
            }
        }
    }

    #[inline]
    fn outgoing(&self, access: Access, off: u64, len: u64) {
        // SYNC POINT: pairs with the Release store in `Mapping::tripwire`: a tripwire made
        // before this access (in its happens-before) is seen.
        if OUTGOING_SET.load(Ordering::Acquire) {
            if let Some(o) = self.inner.outgoing.get() {
                o.fire_range(access, off, len);
            }
        }
    }

    /// Write `src` at `off` (programmed I/O).
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), AccessError> {
        let abs = self.check(off, src.len() as u64, Rights::WRITE)?;
        match &self.hot.window {
            Some(w) => Transport::write(w, abs, src)?,
            None => self.inner.via.write(abs, src)?,
        }
        self.outgoing(Access::Write, off, src.len() as u64);
        Ok(())
    }

    /// Read into `dst` from `off` (costs more than a write across hosts: protocols avoid it).
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        let abs = self.check(off, dst.len() as u64, Rights::READ)?;
        self.inner.via.read(abs, dst)?;
        self.outgoing(Access::Read, off, dst.len() as u64);
        Ok(())
    }

    /// Atomic store (Release) of the aligned word at `off`.
    #[inline]
    pub fn store_u64(&self, off: u64, v: u64) -> Result<(), AccessError> {
        check_align(off, 8)?;
        let abs = self.check(off, 8, Rights::WRITE)?;
        match &self.hot.window {
            Some(w) => Transport::store_u64(w, abs, v)?,
            None => self.inner.via.store_u64(abs, v)?,
        }
        self.outgoing(Access::Write, off, 8);
        Ok(())
    }

    /// Atomic store (Release) of the aligned 32-bit word at `off`.
    pub fn store_u32(&self, off: u64, v: u32) -> Result<(), AccessError> {
        check_align(off, 4)?;
        let abs = self.check(off, 4, Rights::WRITE)?;
        self.inner.via.store_u32(abs, v)?;
        self.outgoing(Access::Write, off, 4);
        Ok(())
    }

    /// Atomic load (Acquire) of the aligned word at `off`.
    pub fn load_u64(&self, off: u64) -> Result<u64, AccessError> {
        check_align(off, 8)?;
        let abs = self.check(off, 8, Rights::READ)?;
        let v = self.inner.via.load_u64(abs)?;
        self.outgoing(Access::Read, off, 8);
        Ok(v)
    }

    /// Atomic load (Acquire) of the aligned 32-bit word at `off`.
    pub fn load_u32(&self, off: u64) -> Result<u32, AccessError> {
        check_align(off, 4)?;
        let abs = self.check(off, 4, Rights::READ)?;
        let v = self.inner.via.load_u32(abs)?;
        self.outgoing(Access::Read, off, 4);
        Ok(v)
    }

    /// A raw window onto `len` bytes at `off` for zero-copy access (for instance, serialise
    /// a message directly into remote memory). Stores through it are invisible to the NIC
    /// until [`Mapping::commit`] of the range fires its tripwires. Writable only with write
    /// rights ([`clan_shm::segment::RawRegion::is_writable`]). Across hosts, the window is a
    /// local staging area that `commit` sends (reading it shows what was staged, not the
    /// remote memory).
    ///
    /// ```
    /// use clan::TripwireConfig;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let tw = ap.tripwire(TripwireConfig::writes(64..72))?;
    /// let m = client.import(&ap.descriptor())?;
    /// let mut r = m.raw(0, 128)?;
    /// assert!(r.is_writable());
    /// // SAFETY: nobody else touches bytes 0..128 of this aperture meanwhile.
    /// let s = unsafe { r.as_mut_slice() };
    /// s[64..72].copy_from_slice(&9u64.to_le_bytes()); // serialise straight into the peer
    /// assert_eq!(tw.count(), 0, "raw stores are invisible to the NIC ...");
    /// assert_eq!(m.commit(0, 128)?, 1, "... until committed: one tripwire fired");
    /// assert_eq!(ap.load_u64(64)?, 9);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn raw(&self, off: u64, len: u64) -> Result<clan_shm::segment::RawRegion<'_>, AccessError> {
        let need = if self.inner.rights.contains(Rights::WRITE) { Rights::WRITE } else { Rights::READ };
        let abs = self.check(off, len, need)?;
        self.inner.via.raw(off, abs, len)
    }

    /// Fault in the pages of `[off, off+len)` now, so that the first accesses there take no
    /// page fault (a protocol does this for the memory it will use at once, when it sets up:
    /// a ring's slots). Best effort: a range outside is refused, and across hosts (or on a
    /// kernel before 5.14) there is nothing to do.
    ///
    /// ```
    /// # let nic = clan::Nic::open_default()?;
    /// # let ep = nic.endpoint()?;
    /// # let ap = ep.export(64 << 10)?;
    /// let m = ep.import(&ap.descriptor())?;
    /// m.prefault(0, 64 << 10)?; // the next stores there fault no page in
    /// assert!(m.prefault(0, 1 << 20).is_err(), "past the end");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prefault(&self, off: u64, len: u64) -> Result<(), AccessError> {
        let need = if self.inner.rights.contains(Rights::WRITE) { Rights::WRITE } else { Rights::READ };
        let abs = self.check(off, len, need)?;
        self.inner.via.prefault(abs, len);
        Ok(())
    }

    /// Publish raw stores to `[off, off+len)`: fence, then fire the tripwires the range
    /// touches, as a write through the NIC would have (across hosts: send the staged bytes).
    /// Returns how many tripwires fired locally (0 across hosts: they fire at the exporter).
    /// Example at [`Mapping::raw`].
    pub fn commit(&self, off: u64, len: u64) -> Result<u32, AccessError> {
        let abs = self.check(off, len, Rights::WRITE)?;
        let n = self.inner.via.commit(off, abs, len)?;
        self.outgoing(Access::Write, off, len);
        Ok(n)
    }

    /// Order all earlier writes through this mapping before all later memory accesses of the
    /// caller: a full fence within a host; across hosts, returns once the exporter has
    /// applied every earlier write of this NIC (an error if the link went down).
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// m.write(0, b"data")?;
    /// m.barrier()?; // the write is in the exporter's memory before anything after this
    /// let mut got = [0u8; 4];
    /// ap.read(0, &mut got)?;
    /// assert_eq!(&got, b"data");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn barrier(&self) -> Result<(), AccessError> {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.inner.via.barrier()
    }

    /// Start reading `len` bytes at `off` without waiting. Within a host the read completes
    /// at once; across hosts the request goes out now and the data comes back later. If
    /// `notify` is given, [`crate::Event::ReadComplete`] with that token is posted to the
    /// queue when the data is there.
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::Event;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// ap.write(0, b"fetch me")?;
    /// let m = client.import(&ap.descriptor())?;
    /// let q = client.event_queue();
    /// let pending = m.read_async(0, 8, Some((q, 77)))?;
    /// // ... other work while the read is in flight ...
    /// assert_eq!(pending.wait(Some(Duration::from_secs(5)))?, b"fetch me");
    /// assert_eq!(q.try_take(), Some(Event::ReadComplete { token: 77 }));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_async(
        &self,
        off: u64,
        len: u64,
        notify: Option<(&crate::EventQueue, u64)>,
    ) -> Result<PendingRead, AccessError> {
        let abs = self.check(off, len, Rights::READ)?;
        let state = match self.inner.via.read_start(abs, len, notify.map(|(q, token)| (q.inner.clone(), token)))? {
            ReadStart::Done(data) => {
                self.outgoing(Access::Read, off, len);
                ReadState::Done(Some(data))
            }
            ReadStart::Pending(id) => ReadState::Pending(id, len),
        };
        Ok(PendingRead { mapping: self.clone(), off, state })
    }

    /// Write `src` at `off`, then store `v` at the aligned word `word_off` — a message and
    /// then the flag that announces it, the pattern of every protocol on apertures. The
    /// word is stored atomically after the message is in place; within a host the two cost
    /// one fence instead of two; across hosts they are two frames, in order.
    ///
    /// ```
    /// use clan::TripwireConfig;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let flag = ap.tripwire(TripwireConfig::writes(0..8))?;
    /// let m = client.import(&ap.descriptor())?;
    /// m.write_then_store_u64(8, b"body", 0, 1)?;
    /// assert!(flag.take_fired());
    /// let mut body = [0u8; 4];
    /// ap.read(8, &mut body)?; // whoever sees the flag sees the body
    /// assert_eq!((ap.load_u64(0)?, &body), (1, b"body"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn write_then_store_u64(&self, off: u64, src: &[u8], word_off: u64, v: u64) -> Result<(), AccessError> {
        let abs = self.check(off, src.len() as u64, Rights::WRITE)?;
        check_align(word_off, 8)?;
        let wabs = self.check_more(word_off, 8)?;
        match &self.hot.window {
            Some(w) => Transport::write_then_store_u64(w, abs, src, wabs, v)?,
            None => self.inner.via.write_then_store_u64(abs, src, wabs, v)?,
        }
        self.outgoing(Access::Write, off, src.len() as u64);
        self.outgoing(Access::Write, word_off, 8);
        Ok(())
    }

    /// Write a message led by a word, then the flag that announces it: `src` at `off + 8`,
    /// the word `lead` at `off` (stored atomically once the whole message is in place: a
    /// reader that sees it sees all of `src`), then `v` at the aligned word `word_off`. Within a host one snooped
    /// transfer with one fence; across hosts three frames, in order. The message queue's
    /// slot (its sequence word, then its header and body) is written this way.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// m.write_led_then_store_u64(64, 5, b"slot body", 0, 1)?;
    /// let mut body = [0u8; 9];
    /// ap.read(72, &mut body)?;
    /// assert_eq!((ap.load_u64(0)?, ap.load_u64(64)?, &body), (1, 5, b"slot body"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn write_led_then_store_u64(
        &self,
        off: u64,
        lead: u64,
        src: &[u8],
        word_off: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        check_align(off, 8)?;
        let len = (src.len() as u64).checked_add(8).ok_or(AccessError::OutOfBounds {
            offset: off,
            len: u64::MAX,
            size: self.len(),
        })?;
        let abs = self.check(off, len, Rights::WRITE)?;
        check_align(word_off, 8)?;
        let wabs = self.check_more(word_off, 8)?;
        match &self.hot.window {
            Some(w) => Transport::write_led_then_store_u64(w, abs, lead, src, wabs, v)?,
            None => self.inner.via.write_led_then_store_u64(abs, lead, src, wabs, v)?,
        }
        self.outgoing(Access::Write, off, len);
        self.outgoing(Access::Write, word_off, 8);
        Ok(())
    }

    /// [`Mapping::write_led_then_store_u64`] for a run of messages `stride` bytes apart
    /// from `off` (a multiple of 8, each body at most `stride - 8` bytes): every message's
    /// body then its lead word, in order, then `v` at `word_off`. Within a host one snooped
    /// transfer and one fence for the whole run: the message queue's batched send.
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// let run: [(u64, &[u8]); 2] = [(1, b"first"), (2, b"second")];
    /// m.write_led_run_then_store_u64(64, 32, &run, 0, 2)?; // slots of 32 bytes from 64
    /// assert_eq!((ap.load_u64(64)?, ap.load_u64(96)?, ap.load_u64(0)?), (1, 2, 2));
    /// let mut second = [0u8; 6];
    /// ap.read(104, &mut second)?;
    /// assert_eq!(&second, b"second");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn write_led_run_then_store_u64(
        &self,
        off: u64,
        stride: u64,
        msgs: &[(u64, &[u8])],
        word_off: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        let Some(last) = msgs.last() else { return Ok(()) };
        check_align(off, 8)?;
        let bad = AccessError::OutOfBounds { offset: off, len: u64::MAX, size: self.len() };
        if stride % 8 != 0 || msgs.iter().any(|(_, b)| b.len() as u64 + 8 > stride) {
            return Err(bad);
        }
        let len = (msgs.len() as u64 - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(8 + last.1.len() as u64))
            .ok_or(bad)?;
        let abs = self.check(off, len, Rights::WRITE)?;
        check_align(word_off, 8)?;
        let wabs = self.check_more(word_off, 8)?;
        match &self.hot.window {
            Some(w) => Transport::write_led_run_then_store_u64(w, abs, stride, msgs, wabs, v)?,
            None => self.inner.via.write_led_run_then_store_u64(abs, stride, msgs, wabs, v)?,
        }
        self.outgoing(Access::Write, off, len);
        self.outgoing(Access::Write, word_off, 8);
        Ok(())
    }

    /// Write `len` bytes of local aperture `src` at `src_off` to `off` (programmed I/O by
    /// the calling thread, straight from the aperture's memory: one copy within a host, no
    /// copy into a link's bursts).
    ///
    /// ```
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let (dst, src) = (server.export(4096)?, client.export(4096)?);
    /// src.write(0, b"from an aperture")?;
    /// let m = client.import(&dst.descriptor())?;
    /// m.write_from(100, &src, 0, 16)?;
    /// let back = client.export(4096)?;
    /// m.read_to(100, &back, 0, 16)?; // and the other way round
    /// let mut got = [0u8; 16];
    /// back.read(0, &mut got)?;
    /// assert_eq!(&got, b"from an aperture");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn write_from(&self, off: u64, src: &crate::Aperture, src_off: u64, len: u64) -> Result<(), AccessError> {
        check_range(src_off, len, src.len())?;
        self.write_from_segment(off, &src.inner.window.data, src_off, len)
    }

    /// Read `len` bytes at `off` into local aperture `dst` at `dst_off` (the calling thread
    /// does it; `dst`'s write tripwires fire as for incoming traffic). Example at
    /// [`Mapping::write_from`].
    pub fn read_to(&self, off: u64, dst: &crate::Aperture, dst_off: u64, len: u64) -> Result<(), AccessError> {
        check_range(dst_off, len, dst.len())?;
        self.read_into_aperture(off, &dst.inner, dst_off, len)
    }

    /// Tell the exporter that a message of `len` bytes at `off` has landed: its endpoint's
    /// event queue gets [`crate::Event::Notification`] (VMMC notifications). Call it after
    /// writing the message: the notification is ordered after every earlier write through
    /// this NIC to that exporter (within a host, the writes are already in place; across
    /// hosts, the notification travels behind them on the link).
    ///
    /// ```
    /// use std::time::Duration;
    /// use clan::Event;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let q = nic.event_queue(clan::EventQueueConfig::default())?; // the server's alone
    /// let server = nic.endpoint_with(clan::EndpointConfig { queue: Some(q.clone()), ..Default::default() })?;
    /// let client = nic.endpoint()?;
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// m.write(512, b"landed")?;
    /// m.notify(512, 6)?;
    /// match q.wait(Some(Duration::from_secs(5)))? {
    ///     Event::Notification { aperture, offset, len, .. } => {
    ///         assert_eq!((aperture, offset, len), (ap.id(), 512, 6));
    ///     }
    ///     other => panic!("unexpected {other:?}"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn notify(&self, off: u64, len: u64) -> Result<(), AccessError> {
        let abs = self.check(off, len, Rights::WRITE)?;
        let d = &self.inner.desc;
        self.inner.via.notify(d.aperture(), d.generation(), abs, len)
    }

    /// Bounds, rights and liveness of an access; its aperture offset.
    pub(crate) fn check_access(&self, off: u64, len: u64, need: Rights) -> Result<u64, AccessError> {
        self.check(off, len, need)
    }

    /// Fire this mapping's outgoing tripwires for a completed access.
    pub(crate) fn fire_outgoing(&self, access: Access, off: u64, len: u64) {
        self.outgoing(access, off, len);
    }

    /// Write `len` bytes of `src` (a segment of this process) at `src_off` to `off` (DMA).
    pub(crate) fn write_from_segment(
        &self,
        off: u64,
        src: &Segment,
        src_off: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let abs = self.check(off, len, Rights::WRITE)?;
        self.inner.via.write_from(abs, src, src_off, len)?;
        self.outgoing(Access::Write, off, len);
        Ok(())
    }

    /// Read `len` bytes at `off` into aperture `dst` at `dst_off`, waiting for them: the
    /// destination's write tripwires fire as for incoming traffic, the exporter's read
    /// tripwires and this mapping's outgoing ones after.
    pub(crate) fn read_into_aperture(
        &self,
        off: u64,
        dst: &crate::aperture::ApertureInner,
        dst_off: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let abs = self.check(off, len, Rights::READ)?;
        self.inner.via.read_to(abs, dst, dst_off, len)?;
        self.outgoing(Access::Read, off, len);
        Ok(())
    }

    /// Start reading `len` bytes at `off` into aperture `dst` at `dst_off`; `done` runs (on
    /// whichever thread completes it: across hosts, the one that receives the answer) with
    /// the bytes read. The caller fires this mapping's outgoing tripwires.
    pub(crate) fn read_into_aperture_async(
        &self,
        off: u64,
        dst: std::sync::Arc<crate::aperture::ApertureInner>,
        dst_off: u64,
        len: u64,
        done: crate::transport::ReadDone,
    ) -> Result<(), AccessError> {
        let abs = self.check(off, len, Rights::READ)?;
        self.inner.via.read_to_async(abs, dst, dst_off, len, done)
    }

    /// Set a tripwire on this node's own traffic through the mapping: it fires once a write
    /// (or read) through the mapping that touches `cfg`'s range (relative to the mapping) has
    /// completed. It reports to the importing endpoint's event queue.
    ///
    /// ```
    /// use clan::TripwireConfig;
    ///
    /// let nic = clan::Nic::open_default()?;
    /// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
    /// let ap = server.export(4096)?;
    /// let m = client.import(&ap.descriptor())?;
    /// let sent = m.tripwire(TripwireConfig::writes(0..4096))?;
    /// m.write(10, b"out")?;
    /// assert_eq!(sent.count(), 1, "fired once the write was complete");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tripwire(&self, cfg: TripwireConfig) -> Result<Tripwire, TripwireError> {
        let i = &self.inner;
        let owner = match i.outgoing.get() {
            Some(o) => o.clone(),
            None => {
                let slots = CamLayout::default_cap(i.len, crate::aperture::MAX_SLOTS);
                let layout = CamLayout::new(i.len, slots);
                let seg = Segment::anonymous(segment::page_align(layout.size))
                    .map_err(|_| TripwireError::TableFull { capacity: i.importer_eq.layout.params.trip_cap })?;
                let cam = CamMap::new(Arc::new(seg), 0, i.len, slots).map_err(|_| TripwireError::Stale)?;
                let tag = (1u64 << 63) | i.serial;
                let mut o = WatchOwner::new(
                    i.importer_eq.clone(),
                    Arc::new(cam),
                    tag,
                    i.len,
                    0,
                    i.importer_port,
                    clan_shm::trip::NO_SOURCE,
                );
                // Weak: the mapping owns the index, not the other way round.
                let m = Arc::downgrade(&self.inner);
                o.alive = Some(Box::new(move || {
                    m.upgrade()
                        .is_some_and(|m| !matches!(Mapping::from_inner(m).check_live(), Err(AccessError::Disconnected)))
                }));
                let o = Arc::new(o);
                let _ = i.outgoing.set(o);
                // SYNC POINT: pairs with the Acquire load in `Mapping::outgoing`.
                OUTGOING_SET.store(true, Ordering::Release);
                i.outgoing.get().cloned().ok_or(TripwireError::Stale)?
            }
        };
        owner.add(&cfg)
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &self.inner.desc;
        f.debug_struct("Mapping")
            .field("exporter", &format_args!("{}", d.nic()))
            .field("aperture", &d.aperture())
            .field("offset", &self.inner.off)
            .field("len", &self.inner.len)
            .field("rights", &format_args!("{}", self.inner.rights))
            .field("remote", &self.is_remote())
            .field("live", &self.is_live())
            .finish()
    }
}

#[derive(Debug)]
enum ReadState {
    Done(Option<Vec<u8>>),
    /// Read `id` of the transport, `len` bytes.
    Pending(u64, u64),
}

/// A read in flight ([`Mapping::read_async`]).
///
/// ```
/// use std::time::Duration;
///
/// let nic = clan::Nic::open_default()?;
/// let (server, client) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = server.export(4096)?;
/// ap.store_u64(8, 3)?;
/// let read = client.import(&ap.descriptor())?.read_async(8, 8, None)?;
/// assert!(read.is_done(), "within a host a read completes at once");
/// assert_eq!(read.wait(Some(Duration::from_secs(1)))?, 3u64.to_ne_bytes());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PendingRead {
    mapping: Mapping,
    off: u64,
    state: ReadState,
}

impl std::fmt::Debug for PendingRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRead").field("off", &self.off).field("done", &self.is_done()).finish_non_exhaustive()
    }
}

impl PendingRead {
    /// Whether the data has arrived (never blocks).
    pub fn is_done(&self) -> bool {
        match self.state {
            ReadState::Done(_) => true,
            ReadState::Pending(id, _) => self.mapping.inner.via.read_done(id),
        }
    }

    /// Wait for the data.
    pub fn wait(mut self, timeout: Option<std::time::Duration>) -> Result<Vec<u8>, AccessError> {
        match std::mem::replace(&mut self.state, ReadState::Done(None)) {
            ReadState::Done(d) => d.ok_or(AccessError::Disconnected),
            ReadState::Pending(id, len) => {
                let data = self.mapping.inner.via.read_finish(id, len, timeout)?;
                self.mapping.outgoing(Access::Read, self.off, len);
                Ok(data)
            }
        }
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
        let watch = clan_shm::snoop::Watch { cam: self.cam.view(), table: &v.table, tag: self.tag };
        let sink = self.eq.port.sink(None);
        with_scratch(|s| clan_shm::snoop::commit(access, &watch, &sink, off + self.base, len, s))
    }
}
