//! The streaming decoder.
//!
//! Feed it whatever bytes arrived ([`Decoder::next`]); it returns one [`Item`] at a time and
//! how many bytes it used. Small frames come whole. A write burst comes as
//! [`Item::WriteBegin`] — its destination and total length, so the receiver can validate the
//! whole burst before any byte of it touches memory — followed by [`Item::WriteData`] chunks,
//! each a valid sub-burst (the burst split where the input happened to end). A receiver that
//! wants the payload to go straight from the socket into place asks
//! [`Decoder::pending_payload`] where the next bytes belong, reads them there itself, and
//! reports them with [`Decoder::consume_payload`]. Read responses work the same way.
//!
//! Malformed input is an error (the link must be closed: framing is lost), never a panic.

use crate::WireError;
use crate::frame::{self, Frame, MAX_DATA, MAX_SMALL, PREFIX, Reader, Status, Target, kind};

/// One decoded item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item<'a> {
    /// A complete non-data frame.
    Frame(Frame<'a>),
    /// A write burst of `len` bytes to `to` begins.
    WriteBegin {
        /// Destination.
        to: Target,
        /// Data length.
        len: u64,
    },
    /// The next data bytes of the current burst, to be written at `to`.
    WriteData {
        /// Destination of `data[0]`.
        to: Target,
        /// Bytes.
        data: &'a [u8],
        /// Whether this completes the burst.
        last: bool,
    },
    /// A read response of `len` bytes begins.
    ReadRespBegin {
        /// Request id.
        id: u64,
        /// Result.
        status: Status,
        /// Data length.
        len: u64,
    },
    /// The next bytes of the current read response, at `at` within it.
    ReadRespData {
        /// Request id.
        id: u64,
        /// Offset of `data[0]` within the response.
        at: u64,
        /// Bytes.
        data: &'a [u8],
        /// Whether this completes the response.
        last: bool,
    },
}

/// Where the next payload bytes belong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    /// `remaining` bytes of a burst, the next one at `to`.
    Write {
        /// Destination of the next byte.
        to: Target,
        /// Bytes left in the burst.
        remaining: u64,
    },
    /// `remaining` bytes of read response `id`, the next one at offset `at`.
    ReadResp {
        /// Request id.
        id: u64,
        /// Offset within the response.
        at: u64,
        /// Bytes left.
        remaining: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Frame,
    Payload(Pending),
}

/// A streaming frame decoder (sans-IO).
#[derive(Debug, Clone)]
pub struct Decoder {
    state: State,
    max_data: u64,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new()
    }
}

impl Decoder {
    /// A decoder accepting data parts up to [`MAX_DATA`].
    pub fn new() -> Decoder {
        Decoder { state: State::Frame, max_data: MAX_DATA }
    }

    /// Whether the decoder is between frames.
    pub fn at_boundary(&self) -> bool {
        self.state == State::Frame
    }

    /// If inside a burst or response: where the next payload byte belongs.
    pub fn pending_payload(&self) -> Option<Pending> {
        match self.state {
            State::Frame => None,
            State::Payload(p) => Some(p),
        }
    }

    /// Account for `n` payload bytes the caller moved itself (at most the pending remainder).
    pub fn consume_payload(&mut self, n: u64) -> Result<(), WireError> {
        let State::Payload(p) = &mut self.state else { return Err(WireError::NotInPayload) };
        match p {
            Pending::Write { to, remaining } => {
                if n > *remaining {
                    return Err(WireError::NotInPayload);
                }
                *to = to.advance(n);
                *remaining -= n;
                if *remaining == 0 {
                    self.state = State::Frame;
                }
            }
            Pending::ReadResp { at, remaining, .. } => {
                if n > *remaining {
                    return Err(WireError::NotInPayload);
                }
                *at += n;
                *remaining -= n;
                if *remaining == 0 {
                    self.state = State::Frame;
                }
            }
        }
        Ok(())
    }

    /// Decode the next item of `buf`: `Ok(None)` if more bytes are needed.
    pub fn next<'a>(&mut self, buf: &'a [u8]) -> Result<Option<(Item<'a>, usize)>, WireError> {
        if let State::Payload(p) = self.state {
            if buf.is_empty() {
                return Ok(None);
            }
            return Ok(Some(match p {
                Pending::Write { to, remaining } => {
                    let n = (remaining.min(buf.len() as u64)) as usize;
                    self.consume_payload(n as u64)?;
                    (Item::WriteData { to, data: &buf[..n], last: n as u64 == remaining }, n)
                }
                Pending::ReadResp { id, at, remaining } => {
                    let n = (remaining.min(buf.len() as u64)) as usize;
                    self.consume_payload(n as u64)?;
                    (Item::ReadRespData { id, at, data: &buf[..n], last: n as u64 == remaining }, n)
                }
            }));
        }
        if buf.len() < PREFIX + 1 {
            return Ok(None);
        }
        let len = u64::from(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]));
        let k = buf[4];
        if len == 0 {
            return Err(WireError::BadLength { kind: k, len });
        }
        match k {
            kind::WRITE => {
                let hdr = (1 + Target::LEN) as u64;
                if len <= hdr {
                    return Err(WireError::EmptyBurst);
                }
                let data = len - hdr;
                if data > self.max_data {
                    return Err(WireError::TooLarge { kind: k, len: data });
                }
                let need = PREFIX + 1 + Target::LEN;
                if buf.len() < need {
                    return Ok(None);
                }
                let mut r = Reader(&buf[PREFIX + 1..need]);
                let to = Target { aperture: r.u32()?, generation: r.u32()?, key: r.u64()?, offset: r.u64()? };
                if to.offset.checked_add(data).is_none() {
                    return Err(WireError::BadField);
                }
                self.state = State::Payload(Pending::Write { to, remaining: data });
                Ok(Some((Item::WriteBegin { to, len: data }, need)))
            }
            kind::READ_RESP => {
                let hdr = 1 + 9u64;
                if len < hdr {
                    return Err(WireError::BadLength { kind: k, len });
                }
                let data = len - hdr;
                if data > self.max_data {
                    return Err(WireError::TooLarge { kind: k, len: data });
                }
                let need = PREFIX + 1 + 9;
                if buf.len() < need {
                    return Ok(None);
                }
                let mut r = Reader(&buf[PREFIX + 1..need]);
                let id = r.u64()?;
                let status = Status::from_u8(r.u8()?);
                if data > 0 {
                    self.state = State::Payload(Pending::ReadResp { id, at: 0, remaining: data });
                }
                Ok(Some((Item::ReadRespBegin { id, status, len: data }, need)))
            }
            _ => {
                let body = (len - 1) as usize;
                if body > MAX_SMALL {
                    return Err(WireError::TooLarge { kind: k, len });
                }
                let need = PREFIX + 1 + body;
                if buf.len() < need {
                    return Ok(None);
                }
                let f = frame::decode_small(k, &buf[PREFIX + 1..need])?;
                Ok(Some((Item::Frame(f), need)))
            }
        }
    }
}
