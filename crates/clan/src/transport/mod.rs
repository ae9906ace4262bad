//! The transport seam: how a [`crate::Mapping`] reaches its aperture.
//!
//! A mapping checks every access (rights, bounds against its descriptor, liveness) and fires
//! its own outgoing tripwires; *how* the bytes move is the transport's, behind one interface
//! ([`Transport`]), one file per transport:
//!
//! | transport | file | the exporter is | accesses |
//! |---|---|---|---|
//! | mapped | [`mapped`] | this process, or another process of this host | the caller's loads and stores into the exporter's memory, snooped here |
//! | link | [`link`] | another host (or a NIC forced onto links) | write bursts and read requests, applied and checked by the exporter's NIC |
//!
//! [`Via`] holds one of them; its dispatch is written here once. Offsets given to a transport
//! are aperture offsets (`abs`), already checked.

pub(crate) mod link;
pub(crate) mod mapped;

use std::sync::Arc;
use std::time::Duration;

use clan_shm::segment::{RawRegion, Segment};

use crate::aperture::ApertureInner;
use crate::error::AccessError;
use crate::event_queue::EqInner;

/// Where an asynchronous read stands once started.
#[derive(Debug)]
pub(crate) enum ReadStart {
    /// It completed at once (the bytes).
    Done(Vec<u8>),
    /// It is in flight, as request `id` of the transport.
    Pending(u64),
}

/// Runs when an asynchronous read into an aperture has completed (with the bytes read).
pub(crate) type ReadDone = Box<dyn FnOnce(Result<u64, AccessError>) + Send>;

/// How a mapping's accesses reach the exporter's memory.
pub(crate) trait Transport {
    /// Whether accesses travel to the exporter's NIC (asynchronous; applied there).
    fn is_remote(&self) -> bool;
    /// Whether the export and the exporter are still there.
    fn check_live(&self) -> Result<(), AccessError>;
    fn write(&self, abs: u64, src: &[u8]) -> Result<(), AccessError>;
    fn read(&self, abs: u64, dst: &mut [u8]) -> Result<(), AccessError>;
    fn store_u64(&self, abs: u64, v: u64) -> Result<(), AccessError>;
    fn store_u32(&self, abs: u64, v: u32) -> Result<(), AccessError>;
    fn load_u64(&self, abs: u64) -> Result<u64, AccessError>;
    fn load_u32(&self, abs: u64) -> Result<u32, AccessError>;
    /// `src` at `abs`, then the word `v` at `word_abs`, in that order.
    fn write_then_store_u64(&self, abs: u64, src: &[u8], word_abs: u64, v: u64) -> Result<(), AccessError>;
    /// `src` at `abs + 8`, the word `lead` at `abs`, then the word `v` at `word_abs`, in that
    /// order (see `Mapping::write_led_then_store_u64`).
    fn write_led_then_store_u64(
        &self,
        abs: u64,
        lead: u64,
        src: &[u8],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError>;
    /// Messages `stride` bytes apart from `abs`, each its body then its lead word, then the
    /// word `v` at `word_abs` (see `Mapping::write_led_run_then_store_u64`).
    fn write_led_run_then_store_u64(
        &self,
        abs: u64,
        stride: u64,
        msgs: &[(u64, &[u8])],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError>;
    /// A raw window of `len` bytes at mapping offset `off` (aperture offset `abs`).
    fn raw(&self, off: u64, abs: u64, len: u64) -> Result<RawRegion<'_>, AccessError>;
    /// Fault in the pages of `len` bytes at `abs` now (best effort; nothing to do across
    /// hosts).
    fn prefault(&self, abs: u64, len: u64);
    /// Publish raw stores to `[off, off+len)`; how many tripwires fired here.
    fn commit(&self, off: u64, abs: u64, len: u64) -> Result<u32, AccessError>;
    /// Every earlier write has been applied (the caller fenced already).
    fn barrier(&self) -> Result<(), AccessError>;
    /// Tell the exporter that `len` bytes at `abs` of aperture `(aperture, generation)` landed.
    fn notify(&self, aperture: u32, generation: u32, abs: u64, len: u64) -> Result<(), AccessError>;
    /// Write `len` bytes of segment `src` at `src_off` to `abs` (no intermediate copy).
    fn write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<(), AccessError>;
    /// Read `len` bytes at `abs` into aperture `dst` at `dst_off` (its write tripwires fire).
    fn read_to(&self, abs: u64, dst: &ApertureInner, dst_off: u64, len: u64) -> Result<(), AccessError>;
    /// [`Transport::read_to`] without waiting; `done` runs on whichever thread completes it.
    fn read_to_async(
        &self,
        abs: u64,
        dst: Arc<ApertureInner>,
        dst_off: u64,
        len: u64,
        done: ReadDone,
    ) -> Result<(), AccessError>;
    /// Start reading `len` bytes at `abs`; `notify` gets `Event::ReadComplete` when done.
    fn read_start(&self, abs: u64, len: u64, notify: Option<(Arc<EqInner>, u64)>) -> Result<ReadStart, AccessError>;
    /// Whether read `id` completed.
    fn read_done(&self, id: u64) -> bool;
    /// The bytes of read `id` (`len` of them), waiting at most `timeout` (None: the
    /// transport's own limit).
    fn read_finish(&self, id: u64, len: u64, timeout: Option<Duration>) -> Result<Vec<u8>, AccessError>;
}

/// One transport.
#[derive(Debug)]
pub(crate) enum Via {
    /// Memory mapped in this process.
    Mapped(mapped::Window),
    /// A link to the exporter's NIC.
    Link(link::LinkTarget),
}

/// The dispatch, written once: every method of [`Transport`] forwarded to the transport held.
macro_rules! forward {
    ($($name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*) => {
        impl Transport for Via {
            $(
                #[inline]
                fn $name(&self $(, $arg: $ty)*) -> $ret {
                    match self {
                        Via::Mapped(t) => Transport::$name(t $(, $arg)*),
                        Via::Link(t) => Transport::$name(t $(, $arg)*),
                    }
                }
            )*
        }
    };
}

forward! {
    is_remote(&self) -> bool;
    check_live(&self) -> Result<(), AccessError>;
    write(&self, abs: u64, src: &[u8]) -> Result<(), AccessError>;
    read(&self, abs: u64, dst: &mut [u8]) -> Result<(), AccessError>;
    store_u64(&self, abs: u64, v: u64) -> Result<(), AccessError>;
    store_u32(&self, abs: u64, v: u32) -> Result<(), AccessError>;
    load_u64(&self, abs: u64) -> Result<u64, AccessError>;
    load_u32(&self, abs: u64) -> Result<u32, AccessError>;
    write_then_store_u64(&self, abs: u64, src: &[u8], word_abs: u64, v: u64) -> Result<(), AccessError>;
    write_led_then_store_u64(&self, abs: u64, lead: u64, src: &[u8], word_abs: u64, v: u64) -> Result<(), AccessError>;
    write_led_run_then_store_u64(&self, abs: u64, stride: u64, msgs: &[(u64, &[u8])], word_abs: u64, v: u64) -> Result<(), AccessError>;
    raw(&self, off: u64, abs: u64, len: u64) -> Result<RawRegion<'_>, AccessError>;
    prefault(&self, abs: u64, len: u64) -> ();
    commit(&self, off: u64, abs: u64, len: u64) -> Result<u32, AccessError>;
    barrier(&self) -> Result<(), AccessError>;
    notify(&self, aperture: u32, generation: u32, abs: u64, len: u64) -> Result<(), AccessError>;
    write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<(), AccessError>;
    read_to(&self, abs: u64, dst: &ApertureInner, dst_off: u64, len: u64) -> Result<(), AccessError>;
    read_to_async(&self, abs: u64, dst: Arc<ApertureInner>, dst_off: u64, len: u64, done: ReadDone) -> Result<(), AccessError>;
    read_start(&self, abs: u64, len: u64, notify: Option<(Arc<EqInner>, u64)>) -> Result<ReadStart, AccessError>;
    read_done(&self, id: u64) -> bool;
    read_finish(&self, id: u64, len: u64, timeout: Option<Duration>) -> Result<Vec<u8>, AccessError>;
}
