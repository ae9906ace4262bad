//! Splitting and coalescing write bursts (Tripwire paper §2.2).
//!
//! A burst is a destination and a run of bytes. Because the header holds the destination
//! address and no length, a burst can be cut at any byte (the second part's destination is
//! the first's plus the cut) and two bursts whose bytes are adjacent in the same import can
//! be merged — in a switch, in a sender's queue, or in a receiver.

use crate::frame::Target;

/// A burst: destination and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Burst {
    /// Destination of the first byte.
    pub to: Target,
    /// The bytes.
    pub data: Vec<u8>,
}

impl Burst {
    /// Cut after `at` bytes (`0 < at < len`); `None` if that is not a proper cut.
    pub fn split(&self, at: usize) -> Option<(Burst, Burst)> {
        if at == 0 || at >= self.data.len() {
            return None;
        }
        Some((
            Burst { to: self.to, data: self.data[..at].to_vec() },
            Burst { to: self.to.advance(at as u64), data: self.data[at..].to_vec() },
        ))
    }

    /// Whether `next` continues this burst (same import, adjacent bytes).
    pub fn continued_by(&self, next: &Burst) -> bool {
        coalescible(&self.to, self.data.len() as u64, &next.to)
    }

    /// Append `next` if it continues this burst; gives it back otherwise.
    pub fn coalesce(&mut self, next: Burst) -> Result<(), Burst> {
        if self.continued_by(&next) {
            self.data.extend_from_slice(&next.data);
            Ok(())
        } else {
            Err(next)
        }
    }
}

/// Whether a burst of `len` bytes to `a` is continued by a burst to `b`.
pub fn coalescible(a: &Target, len: u64, b: &Target) -> bool {
    a.aperture == b.aperture
        && a.generation == b.generation
        && a.key == b.key
        && a.offset.checked_add(len) == Some(b.offset)
}
