//! The link transport: the exporter's memory is behind a link to its NIC (another host, or a
//! NIC forced onto links). A write becomes a write burst sent by the calling thread straight
//! from its memory; a read becomes a read request the exporter answers; word stores are 8- or
//! 4-byte bursts the exporter applies atomically. Raw access works on a local staging area
//! (sparse: only touched pages cost memory) that `commit` sends. The exporter's NIC checks
//! every access against the grant and fires its tripwires as it applies them. Writes are
//! asynchronous: one the exporter refuses (the aperture was just unexported) is reported
//! back, and every later access through the mapping fails.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clan_shm::segment::{self, RawRegion, Segment};
use clan_wire::{Frame, Status, Target};

use super::{ReadDone, ReadStart, Transport};
use crate::aperture::ApertureInner;
use crate::error::AccessError;
use crate::event_queue::EqInner;
use crate::link::{Link, LinkError, MAX_READ, Payload, ReadInto, TargetState};
use crate::lock;
use crate::nic::NicInner;

/// A mapping's route to an aperture behind a link.
#[derive(Debug)]
pub(crate) struct LinkTarget {
    pub link: Arc<Link>,
    pub nic: Arc<NicInner>,
    pub aperture: u32,
    pub generation: u32,
    pub key: u64,
    pub state: Arc<TargetState>,
    pub shadow: OnceLock<Segment>,
    pub len: u64,
}

impl Drop for LinkTarget {
    fn drop(&mut self) {
        lock(&self.link.targets).remove(&self.key);
        if !self.link.is_closed() {
            self.link.send_control(&Frame::Unimport { key: self.key });
        }
    }
}

pub(crate) fn link_error(e: LinkError) -> AccessError {
    match e {
        LinkError::Down(_) | LinkError::Unreachable(_) | LinkError::Refused(_) => AccessError::Disconnected,
        LinkError::Timeout => AccessError::Timeout,
    }
}

/// The access error a link status reports (a refusal that revokes marks the target).
pub(crate) fn check_status(status: Status, state: &TargetState) -> Result<(), AccessError> {
    match status {
        Status::Ok => Ok(()),
        Status::Revoked | Status::BadKey => {
            state.revoked.store(true, Ordering::Release);
            Err(AccessError::Revoked)
        }
        Status::NoRights => Err(AccessError::NotReadable),
        _ => Err(AccessError::Disconnected),
    }
}

impl LinkTarget {
    fn to(&self, abs: u64) -> Target {
        Target { aperture: self.aperture, generation: self.generation, key: self.key, offset: abs }
    }

    fn shadow(&self) -> Result<&Segment, AccessError> {
        if let Some(s) = self.shadow.get() {
            return Ok(s);
        }
        let s = Segment::anonymous(segment::page_align(self.len as usize).max(segment::page_size()))
            .map_err(|_| AccessError::Disconnected)?;
        let _ = self.shadow.set(s);
        self.shadow.get().ok_or(AccessError::Disconnected)
    }

    fn send(&self, abs: u64, payload: Payload<'_>, len: usize) -> Result<(), AccessError> {
        self.link.send_write(&self.nic, self.to(abs), payload, len).map_err(link_error)
    }

    /// Write bursts in order, gathered into one send when small ([`Link::send_writes`]).
    fn send_all(&self, parts: &[(u64, &[u8])]) -> Result<(), AccessError> {
        // An empty burst is no burst (as `send` sends nothing for it).
        let bursts = parts.iter().filter(|(_, d)| !d.is_empty()).map(|(abs, d)| (self.to(*abs), *d));
        // A transfer and its word (and a lead word) are a few bursts: listed on the stack,
        // with no allocation on the path of every small write.
        const FEW: usize = 4;
        if parts.len() <= FEW {
            let mut few = [(self.to(0), &[][..]); FEW];
            let mut n = 0;
            for b in bursts {
                few[n] = b;
                n += 1;
            }
            self.link.send_writes(&self.nic, &few[..n]).map_err(link_error)
        } else {
            let targets: Vec<(Target, &[u8])> = bursts.collect();
            self.link.send_writes(&self.nic, &targets).map_err(link_error)
        }
    }
}

impl Transport for LinkTarget {
    fn is_remote(&self) -> bool {
        true
    }

    fn check_live(&self) -> Result<(), AccessError> {
        if self.state.revoked.load(Ordering::Acquire) {
            return Err(AccessError::Revoked);
        }
        if self.link.is_closed() {
            return Err(AccessError::Disconnected);
        }
        Ok(())
    }

    fn write(&self, abs: u64, src: &[u8]) -> Result<(), AccessError> {
        self.send(abs, Payload::Bytes(src), src.len())
    }

    fn read(&self, abs: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        let mut done = 0usize;
        while done < dst.len() {
            let n = (dst.len() - done).min(MAX_READ as usize);
            let id = self.link.start_read(&self.nic, self.to(abs + done as u64), n as u32, None).map_err(link_error)?;
            let deadline = Instant::now() + self.link.timeout;
            let (status, data) = self.link.finish_read(&self.nic, id, deadline).map_err(link_error)?;
            check_status(status, &self.state)?;
            if data.len() != n {
                return Err(AccessError::Disconnected);
            }
            dst[done..done + n].copy_from_slice(&data);
            done += n;
        }
        Ok(())
    }

    fn store_u64(&self, abs: u64, v: u64) -> Result<(), AccessError> {
        self.write(abs, &v.to_le_bytes())
    }

    fn store_u32(&self, abs: u64, v: u32) -> Result<(), AccessError> {
        self.write(abs, &v.to_le_bytes())
    }

    fn load_u64(&self, abs: u64) -> Result<u64, AccessError> {
        let mut b = [0u8; 8];
        self.read(abs, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn load_u32(&self, abs: u64) -> Result<u32, AccessError> {
        let mut b = [0u8; 4];
        self.read(abs, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn write_then_store_u64(&self, abs: u64, src: &[u8], word_abs: u64, v: u64) -> Result<(), AccessError> {
        // Two bursts, in order: the exporter applies the second after the first (one send
        // when small).
        let word = v.to_le_bytes();
        self.send_all(&[(abs, src), (word_abs, &word)])
    }

    fn write_led_then_store_u64(
        &self,
        abs: u64,
        lead: u64,
        src: &[u8],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        // Three bursts, in order: the exporter applies each after the one before.
        let (lead, word) = (lead.to_le_bytes(), v.to_le_bytes());
        self.send_all(&[(abs + 8, src), (abs, &lead), (word_abs, &word)])
    }

    fn write_led_run_then_store_u64(
        &self,
        abs: u64,
        stride: u64,
        msgs: &[(u64, &[u8])],
        word_abs: u64,
        v: u64,
    ) -> Result<(), AccessError> {
        // In order: each message's body, then its lead word, then the flag.
        let leads: Vec<[u8; 8]> = msgs.iter().map(|(lead, _)| lead.to_le_bytes()).collect();
        let word = v.to_le_bytes();
        let mut parts: Vec<(u64, &[u8])> = Vec::with_capacity(msgs.len() * 2 + 1);
        for (k, ((_, body), lead)) in msgs.iter().zip(&leads).enumerate() {
            let at = abs + k as u64 * stride;
            parts.push((at + 8, body));
            parts.push((at, lead));
        }
        parts.push((word_abs, &word));
        self.send_all(&parts)
    }

    fn prefault(&self, _abs: u64, _len: u64) {
        // (the exporter's memory is not mapped here: its NIC applies our writes)
    }

    fn raw(&self, off: u64, _abs: u64, len: u64) -> Result<RawRegion<'_>, AccessError> {
        self.shadow()?.raw(off as usize, len as usize).map_err(|_| AccessError::OutOfBounds {
            offset: off,
            len,
            size: self.len,
        })
    }

    fn commit(&self, off: u64, abs: u64, len: u64) -> Result<u32, AccessError> {
        let s = self.shadow()?;
        self.send(abs, Payload::Seg(s, off as usize), len as usize)?;
        Ok(0) // the exporter's tripwires fire there
    }

    fn barrier(&self) -> Result<(), AccessError> {
        self.link.barrier(&self.nic).map_err(link_error)
    }

    fn notify(&self, _aperture: u32, _generation: u32, abs: u64, len: u64) -> Result<(), AccessError> {
        self.check_live()?;
        // Behind the writes sent so far on the link: applied after them.
        self.link.send_frame_blocking(&self.nic, &Frame::Notify { to: self.to(abs), len }).map_err(link_error)
    }

    fn write_from(&self, abs: u64, src: &Segment, src_off: u64, len: u64) -> Result<(), AccessError> {
        self.check_live()?;
        // No copy: the burst goes from that memory.
        self.send(abs, Payload::Seg(src, src_off as usize), len as usize)
    }

    fn read_to(&self, abs: u64, dst: &ApertureInner, dst_off: u64, len: u64) -> Result<(), AccessError> {
        // Bounded pieces through a buffer (a read answer is at most MAX_READ bytes).
        let mut done = 0u64;
        let mut buf = Vec::new();
        while done < len {
            let n = (len - done).min(u64::from(MAX_READ));
            buf.resize(n as usize, 0);
            self.read(abs + done, &mut buf)?;
            dst.window.write(dst_off + done, &buf)?;
            done += n;
        }
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
        self.check_live()?;
        let state = self.state.clone();
        let into = ReadInto {
            ap: dst,
            abs: dst_off,
            want: len,
            got: 0,
            done: Box::new(move |r: Result<u64, Status>| {
                done(r.map_err(|s| match check_status(s, &state) {
                    Err(e) => e,
                    Ok(()) => AccessError::Disconnected,
                }))
            }),
        };
        self.link.start_read_into(&self.nic, self.to(abs), len as u32, into).map_err(link_error)
    }

    fn read_start(&self, abs: u64, len: u64, notify: Option<(Arc<EqInner>, u64)>) -> Result<ReadStart, AccessError> {
        if len > u64::from(MAX_READ) {
            return Err(AccessError::OutOfBounds { offset: abs, len, size: u64::from(MAX_READ) });
        }
        let id = self.link.start_read(&self.nic, self.to(abs), len as u32, notify).map_err(link_error)?;
        Ok(ReadStart::Pending(id))
    }

    fn read_done(&self, id: u64) -> bool {
        self.link.read_done(id)
    }

    fn read_finish(&self, id: u64, len: u64, timeout: Option<Duration>) -> Result<Vec<u8>, AccessError> {
        let deadline = Instant::now() + timeout.unwrap_or(self.link.timeout);
        let (status, data) = self.link.finish_read(&self.nic, id, deadline).map_err(link_error)?;
        check_status(status, &self.state)?;
        if data.len() as u64 != len {
            return Err(AccessError::Disconnected);
        }
        Ok(data)
    }
}
