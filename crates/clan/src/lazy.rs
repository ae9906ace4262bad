//! Messages that may wait: what ends a connection to another NIC of this host (the
//! connection's close, the release of an import) tells that NIC only that memory and state
//! can go. Nothing waits for it there: a stream's end travels in the stream's own memory.
//! Sent at once, each close woke that NIC's engine for nothing urgent, once per connection.
//!
//! So they are queued on the control connection to that NIC ([`crate::peer::PeerConn`]) and
//! go with the next message any thread sends there (a program that connects again and again
//! sends its last connection's end with its next connect: one wake-up of the peer's engine
//! for both), or when a timer of this NIC fires, [`DELAY`] after the first was queued: the
//! engine then sends every queue (one wake-up of ours for all of them). Once nothing is
//! queued, the timer is disarmed.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec};

use crate::lock;

/// How long a queued message waits at most (for the timer).
pub(crate) const DELAY: Duration = Duration::from_millis(2);
/// Messages one control connection queues at most: past it, the queue goes at once.
pub(crate) const MAX_QUEUED: usize = 64;

/// The timer and the count of messages queued on all the control connections of a NIC.
#[derive(Debug)]
pub(crate) struct Lazy {
    timer: OwnedFd,
    /// (the timer is armed, messages queued)
    state: Mutex<(bool, usize)>,
}

impl Lazy {
    pub fn new() -> std::io::Result<Lazy> {
        let timer =
            rustix::time::timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK)?;
        let timer = clan_shm::fdfloor::lift(timer);
        Ok(Lazy { timer, state: Mutex::new((false, 0)) })
    }

    /// The timer's descriptor (the engine watches it).
    pub fn fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }

    fn set(&self, after: Duration) {
        let value = Timespec { tv_sec: after.as_secs() as i64, tv_nsec: i64::from(after.subsec_nanos()) };
        let spec = Itimerspec { it_interval: Timespec { tv_sec: 0, tv_nsec: 0 }, it_value: value };
        let _ = rustix::time::timerfd_settime(self.timer.as_fd(), TimerfdTimerFlags::empty(), &spec);
    }

    /// `n` messages were queued: the timer is armed if it was not.
    pub fn queued(&self, n: usize) {
        let mut s = lock(&self.state);
        s.1 += n;
        if !s.0 && s.1 > 0 {
            s.0 = true;
            self.set(DELAY);
        }
    }

    /// `n` queued messages went (or were dropped): once none is left, the timer is disarmed.
    pub fn gone(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut s = lock(&self.state);
        s.1 = s.1.saturating_sub(n);
        if s.0 && s.1 == 0 {
            s.0 = false;
            // (a zero value disarms it)
            self.set(Duration::ZERO);
        }
    }

    /// The timer fired (the engine calls this before sending every queue): it counts as
    /// disarmed, and is armed again by [`Lazy::still_queued`] if something could not go.
    pub fn fired(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.timer, &mut buf);
        lock(&self.state).0 = false;
    }

    /// After the engine sent every queue: armed again if messages are still queued (a full
    /// socket).
    pub fn still_queued(&self) {
        self.queued(0);
    }
}
