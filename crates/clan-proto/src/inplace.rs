//! Received data lent in place: no copy into a buffer of the receiver's until it asks.

use clan::{AccessError, Aperture};

/// A run of received bytes where they landed, in the receiver's own memory. Reads are
/// bounds-checked; [`InPlace::as_raw`] gives the raw window for zero-copy parsing.
///
/// Lent by [`crate::stream::Stream::read_in_place`], [`crate::queue::MsgReceiver::recv_in_place`],
/// the RPC handlers and replies ([`crate::rpc`]):
///
/// ```
/// use std::io::Write;
/// # use std::time::Duration;
/// # use clan_proto::stream::{Listener, Stream};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = Listener::bind(&nic)?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
/// # let (server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// # let mut client = connecting.join().unwrap()?;
/// client.write_all(&[0, 0, 0, 0, 0, 0, 0, 7, b'!'])?;
/// let parsed = server.read_in_place(9, |m| -> Result<_, clan::AccessError> {
///     let mut tail = [0u8; 1];
///     m.read(8, &mut tail)?; // bounds-checked, relative to the run
///     let (ap, off) = m.location(); // where it lives: for word loads
///     let raw = m.as_raw()?;
///     Ok((m.len(), tail[0], ap.len() > off, raw.len()))
/// })?;
/// assert_eq!(parsed, Some(Ok((9, b'!', true, 9))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct InPlace<'a> {
    ap: &'a Aperture,
    off: u64,
    len: u64,
}

impl<'a> InPlace<'a> {
    pub(crate) fn new(ap: &'a Aperture, off: u64, len: u64) -> InPlace<'a> {
        InPlace { ap, off, len }
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy `buf.len()` bytes starting `at` bytes in.
    pub fn read(&self, at: u64, buf: &mut [u8]) -> Result<(), AccessError> {
        let end = at.checked_add(buf.len() as u64).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(AccessError::OutOfBounds { offset: at, len: buf.len() as u64, size: self.len });
        }
        self.ap.read(self.off + at, buf)
    }

    /// All of it, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        // In bounds by construction.
        let _ = self.ap.read(self.off, &mut v);
        v
    }

    /// Copy all of it into the start of `buf` (which must be long enough).
    pub fn copy_to(&self, buf: &mut [u8]) -> Result<(), AccessError> {
        let n = self.len as usize;
        if buf.len() < n {
            return Err(AccessError::OutOfBounds { offset: 0, len: self.len, size: buf.len() as u64 });
        }
        self.ap.read(self.off, &mut buf[..n])
    }

    /// The aperture and offset it lives at (for word loads and tripwires).
    pub fn location(&self) -> (&'a Aperture, u64) {
        (self.ap, self.off)
    }

    /// The raw window over it (turning it into a slice is `unsafe`: see
    /// [`clan::RawRegion`]; the protocol guarantees the sender does not write these bytes
    /// until they are consumed, but another process cannot be prevented from doing so).
    pub fn as_raw(&self) -> Result<clan::RawRegion<'a>, AccessError> {
        self.ap.raw(self.off, self.len)
    }
}
