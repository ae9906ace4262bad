//! The state of one link, sans-IO: the flow-control window, acknowledgements and keepalive.
//! Time is an input (`now`), never read here, so all of it is testable with a virtual clock.
//!
//! - **Window.** Each side grants the other a window of unacknowledged write bytes (`Hello`,
//!   `Credit`). A sender may have at most that many bytes in flight (or one burst, whatever
//!   its size, when nothing is in flight); the receiver acknowledges cumulatively (`Ack`)
//!   every quarter window, so a sender that fills the window is always released.
//! - **Ordering barrier.** Frames are applied in order, so a `Ping` answered by a `Pong`
//!   proves that every write sent before the `Ping` has been applied: `Mapping::barrier`
//!   across hosts is a ping.
//! - **Keepalive.** After `keepalive` without hearing anything, ping; after `dead_after`
//!   without hearing anything, the link is dead (the peer died or the path broke).
//! - **A peer that does not read.** What we owe the peer (acknowledgements, replies) is
//!   queued up to `max_queued` bytes; past that the driver stops reading from it (so it cannot
//!   make us queue more) and reports the queue blocked ([`LinkState::on_tx_blocked`]). A
//!   queue that stays blocked for `dead_after` ends the link: a peer that never reads is cut
//!   off, never buffered without limit.

use std::time::{Duration, Instant};

use crate::WireError;
use crate::frame::Ack;

/// Link parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkConfig {
    /// Window of unacknowledged write bytes we grant the peer.
    pub credit: u64,
    /// Probe after this long without traffic from the peer.
    pub keepalive: Duration,
    /// Declare the link dead after this long without traffic from the peer (or with our
    /// queue to it blocked).
    pub dead_after: Duration,
    /// Bytes of frames we owe the peer (replies, acknowledgements) queued before we stop
    /// reading from it.
    pub max_queued: usize,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            credit: 8 << 20,
            keepalive: Duration::from_millis(250),
            dead_after: Duration::from_secs(1),
            max_queued: 4 << 20,
        }
    }
}

/// What a timeout asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// Nothing to do.
    None,
    /// Send `Ping { token }`.
    Ping(u64),
    /// The peer is silent for too long: close the link.
    Dead,
    /// The peer has not read what we owe it for too long: close the link.
    Stalled,
}

/// The state of one link.
#[derive(Debug, Clone)]
pub struct LinkState {
    cfg: LinkConfig,
    sent_writes: u64,
    sent_bytes: u64,
    acked: Ack,
    window: u64,
    applied: Ack,
    ack_sent: Ack,
    last_heard: Instant,
    ping: Option<(u64, Instant)>,
    next_token: u64,
    blocked_since: Option<Instant>,
}

impl LinkState {
    /// A new link at `now`. Until the peer's `Hello`, its window is our own credit.
    pub fn new(cfg: LinkConfig, now: Instant) -> LinkState {
        LinkState {
            cfg,
            sent_writes: 0,
            sent_bytes: 0,
            acked: Ack::default(),
            window: cfg.credit,
            applied: Ack::default(),
            ack_sent: Ack::default(),
            last_heard: now,
            ping: None,
            next_token: 1,
            blocked_since: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    // ---- sending ----------------------------------------------------------------------

    /// The peer granted a window of `bytes` (its `Hello` or a `Credit`).
    pub fn on_credit(&mut self, bytes: u64) {
        self.window = bytes.max(1);
    }

    /// Bytes sent and not yet acknowledged.
    pub fn in_flight(&self) -> u64 {
        self.sent_bytes - self.acked.bytes
    }

    /// Whether a burst of `bytes` may be sent now.
    pub fn window_allows(&self, bytes: u64) -> bool {
        self.in_flight() == 0 || self.in_flight().saturating_add(bytes) <= self.window
    }

    /// A burst of `bytes` was sent.
    pub fn on_write_sent(&mut self, bytes: u64) {
        self.sent_writes += 1;
        self.sent_bytes += bytes;
    }

    /// Bursts sent so far.
    pub fn sent_writes(&self) -> u64 {
        self.sent_writes
    }

    /// The peer acknowledged. Acknowledgements are cumulative and may not go backwards nor
    /// beyond what was sent.
    pub fn on_ack(&mut self, a: Ack) -> Result<(), WireError> {
        if a.writes < self.acked.writes
            || a.bytes < self.acked.bytes
            || a.writes > self.sent_writes
            || a.bytes > self.sent_bytes
        {
            return Err(WireError::BadAck);
        }
        self.acked = a;
        Ok(())
    }

    /// What the peer acknowledged so far.
    pub fn acked(&self) -> Ack {
        self.acked
    }

    // ---- receiving --------------------------------------------------------------------

    /// A burst began (counted once) / `bytes` of burst data were applied.
    pub fn on_write_applied(&mut self, new_burst: bool, bytes: u64) {
        if new_burst {
            self.applied.writes += 1;
        }
        self.applied.bytes += bytes;
    }

    /// An acknowledgement to send, if a quarter of the granted window was applied since the
    /// last one (or `force` and anything was).
    pub fn poll_ack(&mut self, force: bool) -> Option<Ack> {
        let since = self.applied.bytes - self.ack_sent.bytes;
        let due = since >= (self.cfg.credit / 4).max(1) || (force && self.applied != self.ack_sent);
        if due {
            self.ack_sent = self.applied;
            Some(self.applied)
        } else {
            None
        }
    }

    // ---- liveness ---------------------------------------------------------------------

    /// Something arrived from the peer.
    pub fn on_heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    /// A `Pong` arrived.
    pub fn on_pong(&mut self, token: u64, now: Instant) {
        if self.ping.is_some_and(|(t, _)| t == token) {
            self.ping = None;
        }
        self.last_heard = now;
    }

    /// A token for a `Ping` sent for another reason (a barrier), so keepalive does not send a
    /// second one.
    pub fn next_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    /// Our queue of frames for the peer is over its limit (`blocked`), or drained below it.
    pub fn on_tx_blocked(&mut self, blocked: bool, now: Instant) {
        if blocked {
            self.blocked_since.get_or_insert(now);
        } else {
            self.blocked_since = None;
        }
    }

    /// Whether our queue to the peer is blocked.
    pub fn tx_blocked(&self) -> bool {
        self.blocked_since.is_some()
    }

    /// When [`LinkState::handle_timeout`] should next be called.
    pub fn poll_timeout(&self) -> Instant {
        let t = match self.ping {
            Some(_) => self.last_heard + self.cfg.dead_after,
            None => self.last_heard + self.cfg.keepalive,
        };
        match self.blocked_since {
            Some(b) => t.min(b + self.cfg.dead_after),
            None => t,
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) -> Timeout {
        if self.blocked_since.is_some_and(|b| now.saturating_duration_since(b) >= self.cfg.dead_after) {
            return Timeout::Stalled;
        }
        let silent = now.saturating_duration_since(self.last_heard);
        if silent >= self.cfg.dead_after {
            return Timeout::Dead;
        }
        if silent >= self.cfg.keepalive && self.ping.is_none() {
            let t = self.next_token();
            self.ping = Some((t, now));
            return Timeout::Ping(t);
        }
        Timeout::None
    }
}
