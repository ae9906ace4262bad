//! Waiting, written once: every blocking call of the library (event queues, tripwires,
//! tripsets, DMA tickets, hand-shakes, link replies) waits through one of the two loops here.
//!
//! - [`wait`]: spin for a while, then sleep in the caller's way (a futex, a descriptor),
//!   re-polling after each wake-up; for state in shared memory.
//! - [`wait_locked`]: the condition-variable form, for state behind a mutex that the engine
//!   updates; the check runs with the lock held, so no wake-up is lost between check and
//!   sleep.
//!
//! Both bound every sleep by the deadline and by an optional slice (so that a waiter looks
//! again at things nothing would wake it for, such as a dead exporter), and both drive the
//! NIC's links from the waiting thread when the NIC makes progress manually
//! ([`crate::Progress::Manual`]): then nobody else would.

use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::lock;
use crate::nic::{Cmd, NicInner};

/// How long a waiter driving links with no descriptor of its own to sleep on naps between
/// looks (firings by other processes of the host are seen within this).
pub(crate) const MANUAL_NAP: Duration = Duration::from_millis(1);

/// When a wait gives up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now (None: never).
    pub fn after(timeout: Option<Duration>) -> Deadline {
        Deadline(timeout.map(|t| Instant::now() + t))
    }

    /// At `at`.
    pub fn at(at: Instant) -> Deadline {
        Deadline(Some(at))
    }

    /// The instant, if any.
    pub fn instant(self) -> Option<Instant> {
        self.0
    }

    /// Time left: `None` once passed, `Some(None)` without a limit.
    pub fn left(self) -> Option<Option<Duration>> {
        match self.0 {
            None => Some(None),
            Some(d) => {
                let l = d.saturating_duration_since(Instant::now());
                (!l.is_zero()).then_some(Some(l))
            }
        }
    }

    /// Time left, at most `slice` (None: no limit); `None` once passed.
    pub fn nap(self, slice: Option<Duration>) -> Option<Option<Duration>> {
        self.left().map(|l| match (l, slice) {
            (Some(l), Some(s)) => Some(l.min(s)),
            (l, s) => l.or(s),
        })
    }
}

/// The NIC a waiting thread drives, if it makes progress manually.
pub(crate) fn driver(nic: Option<std::sync::Arc<NicInner>>) -> Option<std::sync::Arc<NicInner>> {
    nic.filter(|n| n.manual_progress())
}

/// Sleep on `nic`'s links (and `fd`, if given) for at most `nap`: traffic wakes the thread.
/// False if the NIC has no links (the caller sleeps its own way).
pub(crate) fn sleep_on_links(nic: &NicInner, fd: Option<BorrowedFd<'_>>, nap: Option<Duration>) -> bool {
    // Without a descriptor of its own, the waiter must look again soon.
    let nap = if fd.is_none() { Some(nap.map_or(MANUAL_NAP, |n| n.min(MANUAL_NAP))) } else { nap };
    nic.wait_links(fd, nap)
}

/// Spin for `spin`, then sleep with `sleep(at_most)` until `poll` finds something or
/// `deadline` passes (None then). `poll` runs first of all and after every spin and sleep;
/// `sleep` must return when what `poll` looks for may have happened, or after its argument
/// (None: no limit), and may return early. Each sleep is at most `slice`.
pub(crate) fn wait<T>(
    spin: Duration,
    deadline: Deadline,
    slice: Option<Duration>,
    mut poll: impl FnMut() -> Option<T>,
    mut sleep: impl FnMut(Option<Duration>),
) -> Option<T> {
    if let Some(t) = poll() {
        return Some(t);
    }
    if !spin.is_zero() {
        let end = Instant::now() + spin;
        let end = deadline.instant().map_or(end, |d| d.min(end));
        while Instant::now() < end {
            std::hint::spin_loop();
            if let Some(t) = poll() {
                return Some(t);
            }
        }
    }
    loop {
        let nap = deadline.nap(slice)?;
        sleep(nap);
        if let Some(t) = poll() {
            return Some(t);
        }
    }
}

/// Polls between two drives of the links in a wait's spin ([`SpinLinks`]): a receive call
/// each; more often contends with the kernel delivering into the socket, less often leaves
/// the bytes waiting (measured over a loopback link: every poll and every 32nd both slower).
pub(crate) const LINK_EVERY: u32 = 8;

/// The spin of a wait on a queue of `nic` (`links_open`: its count of links, a hint) with
/// engine progress: what comes over links is applied by the spinning thread every
/// [`LINK_EVERY`]th poll (the engine, woken for it, would take this thread's CPU), and the
/// spin ends before the first sleep ([`SpinLinks::sleeping`]) or with the wait. Nothing
/// without links, without a spin, or with manual progress (whose waits drive at every poll
/// already).
///
/// The [`LinkSpin`] begins at the first drive, never before: a spin counted but not driving
/// would keep the engine away from the links (it leaves them to spinners) with nobody
/// reading them, and short waits, ended within a few polls, come by the thousand.
pub(crate) struct SpinLinks {
    nic: Option<Arc<NicInner>>,
    spin: std::cell::RefCell<Option<LinkSpin>>,
    polls: std::cell::Cell<u32>,
}

impl SpinLinks {
    pub(crate) fn new(
        nic: &std::sync::Weak<NicInner>,
        links_open: &std::sync::atomic::AtomicUsize,
        spin: Duration,
    ) -> SpinLinks {
        // A hint (Relaxed): a link that opens during the spin is served by the engine.
        let nic = if spin.is_zero() || links_open.load(Ordering::Relaxed) == 0 {
            None
        } else {
            nic.upgrade().filter(|n| n.config.progress == crate::config::Progress::Engine)
        };
        SpinLinks { nic, spin: std::cell::RefCell::new(None), polls: std::cell::Cell::new(0) }
    }

    /// One poll of the spin: every [`LINK_EVERY`]th drives the links (the first of them
    /// begins the [`LinkSpin`]).
    pub(crate) fn poll(&self) {
        let Some(n) = &self.nic else { return };
        let k = self.polls.get().wrapping_add(1);
        self.polls.set(k);
        if k % LINK_EVERY == 0 {
            self.spin.borrow_mut().get_or_insert_with(|| LinkSpin::begin(Some(n.clone()))).drive();
        }
    }

    /// About to sleep: the spin ends, and the engine listens to the links again.
    pub(crate) fn sleeping(&self) {
        if let Some(s) = self.spin.borrow_mut().take() {
            s.sleep();
        }
    }
}

/// A thread asleep in a wait that relies on the engine to apply what comes over links (a
/// tripwire's or an event queue's, with [`crate::Progress::Engine`]): links parked for
/// spinners are listened to again when the last spinner stops, or at once if none spins.
pub(crate) struct Sleeper(Option<Arc<NicInner>>);

impl Sleeper {
    /// About to sleep on a queue of `nic` (`links_open`: its count of links, a hint).
    pub(crate) fn enter(nic: &std::sync::Weak<NicInner>, links_open: &std::sync::atomic::AtomicUsize) -> Sleeper {
        // A hint (Relaxed): a NIC without links has nothing parked.
        if links_open.load(Ordering::Relaxed) == 0 {
            return Sleeper(None);
        }
        let Some(n) = nic.upgrade().filter(|n| n.config.progress == crate::config::Progress::Engine) else {
            return Sleeper(None);
        };
        if n.spinners.sleep_begin() {
            n.command(Cmd::Unpark);
        }
        Sleeper(Some(n))
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        if let Some(n) = &self.0 {
            n.spinners.sleep_end();
        }
    }
}

/// A thread's spin on bytes that come over links ([`crate::Tripwire::spin_links`]).
///
/// The thread applies them itself with [`LinkSpin::drive`], rather than waiting for the
/// engine's thread to be scheduled. While it spins, the engine is not woken for them: on a
/// machine with few CPUs it would take the CPU from the spinner. Dropping the spin ends it
/// (the engine listens again once no thread has spun for a fraction of a millisecond);
/// [`LinkSpin::sleep`] ends it before the thread sleeps, and the engine listens at once.
///
/// ```
/// # let nic = clan::Nic::open_default()?;
/// # let ep = nic.endpoint()?;
/// # let ap = ep.export(4096)?;
/// let tw = ap.tripwire(clan::TripwireConfig::writes(0..8))?;
/// let spin = tw.spin_links();
/// for _ in 0..100 {
///     if ap.load_u64(0)? != 0 {
///         break;
///     }
///     spin.drive(); // no link here: one load
/// }
/// spin.sleep(); // about to block on the tripwire
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct LinkSpin {
    nic: Option<Arc<NicInner>>,
    /// Counted in the NIC's `clan_shm::handoff::Handoff` (engine progress): ends once.
    counted: bool,
}

impl LinkSpin {
    /// A spin on `nic`'s links (None: no link to drive).
    #[inline]
    pub(crate) fn begin(nic: Option<Arc<NicInner>>) -> LinkSpin {
        let counted = nic.as_ref().is_some_and(|n| n.config.progress == crate::config::Progress::Engine);
        if let (true, Some(n)) = (counted, &nic) {
            n.spinners.begin();
        }
        LinkSpin { nic, counted }
    }

    /// Process the links' incoming traffic in this thread (what [`crate::Nic::progress`]
    /// does); whether there was any.
    #[inline]
    pub fn drive(&self) -> bool {
        self.nic.as_ref().is_some_and(|n| n.progress())
    }

    /// End the spin before sleeping: the engine listens to the links again at once.
    pub fn sleep(mut self) {
        self.end(true);
    }

    #[inline]
    fn end(&mut self, sleeping: bool) {
        if !std::mem::replace(&mut self.counted, false) {
            return;
        }
        if let Some(n) = &self.nic {
            if n.spinners.end(sleeping) {
                n.command(Cmd::Unpark);
            }
        }
    }
}

impl Drop for LinkSpin {
    #[inline]
    fn drop(&mut self) {
        self.end(false);
    }
}

/// How a [`wait_locked`] waiter makes progress besides sleeping on the condition variable.
pub(crate) enum Drive<'a> {
    /// Others (the engine) do the work and notify the condition variable.
    Others,
    /// The waiter drives `step` itself first (true: something happened, look again); if
    /// nothing did, with `park`, it sleeps there (without the lock) instead of on the
    /// condition variable: with manual progress nobody would notify it.
    Itself { step: &'a dyn Fn() -> bool, park: Option<&'a dyn Fn(Option<Duration>)> },
}

/// Wait until `check` (run with `mutex` held) finds something, sleeping on `cv` (or
/// parking, see [`Drive`]) at most `slice` at a time; None once `deadline` passed.
pub(crate) fn wait_locked<'m, S, T>(
    mutex: &'m Mutex<S>,
    cv: &Condvar,
    deadline: Deadline,
    slice: Option<Duration>,
    drive: Drive<'_>,
    mut check: impl FnMut(&mut MutexGuard<'m, S>) -> Option<T>,
) -> Option<T> {
    let mut g = lock(mutex);
    loop {
        if let Some(t) = check(&mut g) {
            return Some(t);
        }
        let nap = deadline.nap(slice)?;
        match &drive {
            Drive::Others => {
                g = match nap {
                    Some(n) => cv.wait_timeout(g, n).unwrap_or_else(|e| e.into_inner()).0,
                    None => cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                };
            }
            Drive::Itself { step, park } => {
                drop(g);
                if !step() {
                    match park {
                        Some(p) => p(nap),
                        None => {
                            let g2 = lock(mutex);
                            let n = nap.unwrap_or(Duration::from_millis(100));
                            drop(cv.wait_timeout(g2, n).unwrap_or_else(|e| e.into_inner()));
                        }
                    }
                }
                g = lock(mutex);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn wait_times_out_and_polls_last() {
        let polls = AtomicU32::new(0);
        let r: Option<()> = wait(
            Duration::from_micros(50),
            Deadline::after(Some(Duration::from_millis(5))),
            Some(Duration::from_millis(1)),
            || {
                polls.fetch_add(1, Ordering::Relaxed);
                None
            },
            |n| std::thread::sleep(n.unwrap_or(Duration::from_millis(1))),
        );
        assert!(r.is_none());
        assert!(polls.load(Ordering::Relaxed) >= 2);
    }

    #[test]
    fn wait_returns_what_poll_found() {
        let n = AtomicU32::new(0);
        let r = wait(
            Duration::ZERO,
            Deadline::after(None),
            None,
            || (n.fetch_add(1, Ordering::Relaxed) == 3).then_some(7),
            |_| {},
        );
        assert_eq!(r, Some(7));
    }

    #[test]
    fn wait_locked_is_woken() {
        let m = Arc::new((Mutex::new(false), Condvar::new()));
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            *lock(&m2.0) = true;
            m2.1.notify_all();
        });
        let r = wait_locked(&m.0, &m.1, Deadline::after(Some(Duration::from_secs(30))), None, Drive::Others, |g| {
            (**g).then_some(())
        });
        assert_eq!(r, Some(()));
        t.join().unwrap();
    }

    #[test]
    fn wait_locked_times_out() {
        let m = (Mutex::new(0u32), Condvar::new());
        let step = || false;
        let r: Option<()> = wait_locked(
            &m.0,
            &m.1,
            Deadline::after(Some(Duration::from_millis(5))),
            Some(Duration::from_millis(1)),
            Drive::Itself { step: &step, park: None },
            |_| None,
        );
        assert!(r.is_none());
    }
}
