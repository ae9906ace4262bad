//! The mapped transport: the exporter's memory is mapped in this process (the exporter is this
//! process, or another process of the host that passed its memfd), and every access is the
//! caller's own loads and stores, snooped here ([`Window`]) so that the exporter's tripwires
//! fire exactly as the hardware NIC's would. True zero copy.

use std::sync::Arc;
use std::time::Duration;

use clan_shm::segment::{RawRegion, Segment};
use clan_shm::trip::Access;

use super::{ReadDone, ReadStart, Transport};
use crate::aperture::ApertureInner;
use crate::error::AccessError;
use crate::event_queue::{EqInner, Word};

pub(crate) use crate::window::Window;

impl Transport for Window {
    #[inline]
    fn is_remote(&self) -> bool {
        false
    }

    #[inline]
    fn check_live(&self) -> Result<(), AccessError> {
        Window::check_live(self)
    }

    #[inline]
    fn write(&self, abs: u64, src: &[u8]) -> Result<(), AccessError> {
        Window::write(self, abs, src).map(drop)
    }

    #[inline]
    fn read(&self, abs: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        Window::read(self, abs, dst).map(drop)
    }

    #[inline]
    fn store_u64(&self, abs: u64, v: u64) -> Result<(), AccessError> {
        Window::store_u64(self, abs, v).map(drop)
    }

    #[inline]
    fn store_u32(&self, abs: u64, v: u32) -> Result<(), AccessError> {
        Window::store_u32(self, abs, v).map(drop)
    }

    #[inline]
    fn load_u64(&self, abs: u64) -> Result<u64, AccessError> {
        Window::load_u64(self, abs)
    }

    #[inline]
    fn load_u32(&self, abs: u64) -> Result<u32, AccessError> {
        Window::load_u32(self, abs)
    }

    #[inline]
    fn write_then_store_u64(&self, abs: u64, src: &[u8], word_abs: u64, v: u64) -> Result<(), AccessError> {
        Window::write_then_store_u64(self, abs, src, word_abs, v).map(drop)
    }

    #[inline]
    fn write_led_then_store_u64(
        &self,
        abs: u64,
        lead: u64,
        src: &[u8],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        Window::write_led_then_store_u64(self, abs, lead, src, word_abs, v).map(drop)
    }

    #[inline]
    fn write_led_run_then_store_u64(
        &self,
        abs: u64,
        stride: u64,
        msgs: &[(u64, &[u8])],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        Window::write_led_run_then_store_u64(self, abs, stride, msgs, word_abs, v).map(drop)
    }

    fn raw(&self, _off: u64, abs: u64, len: u64) -> Result<RawRegion<'_>, AccessError> {
        Window::raw(self, abs, len)
    }

    fn prefault(&self, abs: u64, len: u64) {
        Window::prefault(self, abs, len);
    }

    fn commit(&self, _off: u64, abs: u64, len: u64) -> Result<u32, AccessError> {
        Ok(Window::commit(self, abs, len, Access::Write))
    }

    fn barrier(&self) -> Result<(), AccessError> {
        // The caller's fence is the whole barrier: stores to mapped memory are in place.
        Ok(())
    }

    fn notify(&self, aperture: u32, generation: u32, abs: u64, len: u64) -> Result<(), AccessError> {
        // Behind the writes already: they are in place. Into the exporter's queue (our ring).
        self.port.post(Word::Notification { aperture, generation, offset: abs, len });
        Ok(())
    }

    fn write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<(), AccessError> {
        Window::write_from(self, abs, src, src_off, len).map(drop)
    }

    fn read_to(&self, abs: u64, dst: &ApertureInner, dst_off: u64, len: u64) -> Result<(), AccessError> {
        dst.window.write_from(dst_off, &self.data, abs - self.data_base, len)?;
        // The exporter's read tripwires fire: its memory was read through the NIC.
        Window::commit(self, abs, len, Access::Read);
        Ok(())
    }

    fn read_to_async(
        &self,
        abs: u64,
        dst: Arc<ApertureInner>,
        dst_off: u64,
        len: u64,
        done: ReadDone,
    ) -> Result<(), AccessError> {
        let r = self.read_to(abs, &dst, dst_off, len);
        done(r.clone().map(|()| len));
        r
    }

    fn read_start(&self, abs: u64, len: u64, notify: Option<(Arc<EqInner>, u64)>) -> Result<ReadStart, AccessError> {
        let mut data = vec![0u8; len as usize];
        Window::read(self, abs, &mut data)?;
        if let Some((q, token)) = notify {
            q.post_local(Word::ReadComplete { token });
        }
        Ok(ReadStart::Done(data))
    }

    fn read_done(&self, _id: u64) -> bool {
        true
    }

    fn read_finish(&self, _id: u64, _len: u64, _timeout: Option<Duration>) -> Result<Vec<u8>, AccessError> {
        Err(AccessError::Disconnected)
    }
}
