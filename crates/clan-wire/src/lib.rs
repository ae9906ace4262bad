//! # clan-wire — the wire protocol between NICs, sans-IO
//!
//! Layer: below the `clan` crate's links, above nothing: no sockets, no clock, no unsafe
//! code. It is a value you feed bytes and time, and ask for bytes and events, so it is
//! unit-tested, property-tested and fuzzed on its own (`fuzz/`).
//!
//! - [`frame`]: the frames (write burst, read request/response, out-of-band message,
//!   hello/authentication, credit/ack, import, refusal, ping/pong, close) and their encoding.
//! - [`Decoder`]: a streaming decoder that yields write bursts as sub-bursts of whatever
//!   arrived, and lets the caller move payload bytes itself (straight into an aperture).
//! - [`burst`]: splitting a burst at any byte and coalescing adjacent bursts.
//! - [`LinkState`]: the window of unacknowledged bytes, acknowledgements, keepalive, and
//!   the limit on a peer that does not read.
//! - [`handshake`]: link set-up (hello, authentication with a cluster key, the acceptor's
//!   decision) as a state machine with a deadline.
//! - [`control`]: the control channel between the NICs of one host: its messages, the
//!   serving side's per-connection state (verified hello, checked senders) and admission
//!   limits.
//! - [`connect`]: the connect/accept hand-shake between endpoints carried by out-of-band
//!   messages, and the per-endpoint state (backlog, dials) with bounds and expiry.
//! - [`grant`]: the import grant: one policy decision for every path, one vocabulary of
//!   refusals.
//!
//! Every machine here takes input through `handle_*` (bytes, messages, `now`) and gives
//! output through `poll_*` (bytes to send, events, its next deadline): the drivers in `clan`
//! own the sockets and the clock, and never wait inside a machine.
//!
//! ## Panic contract
//!
//! No function panics on any input bytes: malformed input is a [`WireError`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod burst;
pub mod connect;
pub mod control;
mod decoder;
pub mod frame;
#[doc(hidden)]
pub mod fuzzing;
pub mod grant;
pub mod handshake;
mod link;

pub use decoder::{Decoder, Item, Pending};
pub use frame::{Ack, Frame, Hello, Import, ImportReply, Oob, ReadReq, Refused, Status, Target};
pub use link::{LinkConfig, LinkState, Timeout};

/// A decoding or protocol error. Small and `Copy`; every variant means the byte stream can
/// no longer be trusted and the link must be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireError {
    /// A frame kind we do not know.
    UnknownKind(u8),
    /// A frame whose length does not fit its kind.
    BadLength {
        /// Frame kind.
        kind: u8,
        /// Announced length.
        len: u64,
    },
    /// A frame larger than allowed.
    TooLarge {
        /// Frame kind.
        kind: u8,
        /// Announced length.
        len: u64,
    },
    /// A write burst without data.
    EmptyBurst,
    /// A field with an impossible value.
    BadField,
    /// A frame body shorter than its fields.
    Truncated,
    /// A frame body longer than its fields.
    TrailingBytes,
    /// Payload accounting outside a payload.
    NotInPayload,
    /// An acknowledgement going backwards or beyond what was sent.
    BadAck,
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            WireError::BadLength { kind, len } => write!(f, "frame of kind {kind} with impossible length {len}"),
            WireError::TooLarge { kind, len } => write!(f, "frame of kind {kind} too large ({len} bytes)"),
            WireError::EmptyBurst => write!(f, "write burst without data"),
            WireError::BadField => write!(f, "frame field with an impossible value"),
            WireError::Truncated => write!(f, "frame body truncated"),
            WireError::TrailingBytes => write!(f, "frame body has trailing bytes"),
            WireError::NotInPayload => write!(f, "payload accounting outside a payload"),
            WireError::BadAck => write!(f, "acknowledgement out of range"),
        }
    }
}

impl std::error::Error for WireError {}
