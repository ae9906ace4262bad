//! Spin, then block on a tripwire: the synchronisation every protocol here uses (Tripwire
//! paper §4.3: "poll the control variables for a few microseconds before blocking").
//!
//! The protocol that makes blocking safe: arm the tripwire, re-check the memory, and only
//! then sleep. A write that lands between the check and the sleep fires the armed tripwire,
//! so the sleep returns at once; a write before the arm is seen by the re-check.

use std::time::{Duration, Instant};

use clan::{AccessError, Aperture, Tripwire, TripwireConfig};

/// The tripwire the waits of this crate block on: watching writes to `range` of `ap`,
/// once-only, disarmed (the wait arms it), no actions beyond waking its waiter. Fails only
/// if the aperture is gone.
pub(crate) fn wait_tripwire(ap: &Aperture, range: std::ops::Range<u64>) -> Result<Tripwire, AccessError> {
    ap.tripwire(TripwireConfig::writes(range).once().disarmed().actions(clan::Actions::NONE))
        .map_err(|_| AccessError::Revoked)
}

/// Why a wait ended without its condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitError {
    /// The deadline passed.
    Timeout,
    /// `dead()` said the other side is gone.
    Dead,
    /// The tripwire is gone (its aperture was unexported).
    Stale,
}

/// Longest single sleep: the liveness check runs at least this often while blocked.
pub(crate) const SLICE: Duration = Duration::from_millis(20);

/// Wait until `ready()` holds: poll it for `spin`, then block on `tw` (armed, re-checked,
/// slept on) at most `slice_max` at a time, until it holds, `deadline` passes, or `dead()`
/// holds. A `deadline` in the past checks once. Short slices suit conditions that another
/// write than the tripwire's may also satisfy.
pub(crate) fn wait_sliced(
    tw: &Tripwire,
    spin: Duration,
    deadline: Option<Instant>,
    slice_max: Duration,
    mut ready: impl FnMut() -> bool,
    mut dead: impl FnMut() -> bool,
) -> Result<(), WaitError> {
    if ready() {
        return Ok(());
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(WaitError::Timeout);
    }
    if !spin.is_zero() {
        // The clock is first read after 64 polls: a wait that ends within them (the common
        // case of a reader just ahead of its writer) costs no clock read at all; the spin
        // time counts from there, and ends at the deadline if that comes first.
        let mut until = None;
        let mut n = 0u32;
        // Bytes that come over a link: this thread applies them (every 8th poll, so a wait
        // on shared memory alone pays little for it), and the NIC's engine is not woken for
        // them meanwhile (it would take this thread's CPU).
        let links = tw.spin_links();
        loop {
            std::hint::spin_loop();
            if ready() {
                return Ok(());
            }
            n = n.wrapping_add(1);
            if n % 8 == 0 && links.drive() && ready() {
                return Ok(());
            }
            if n % 64 == 0 {
                let now = Instant::now();
                let end = until.get_or_insert_with(|| deadline.map_or(now + spin, |d| d.min(now + spin)));
                if now >= *end {
                    // The engine serves the links again while this thread sleeps.
                    links.sleep();
                    break;
                }
            }
        }
    }
    loop {
        tw.arm().map_err(|_| WaitError::Stale)?;
        if ready() {
            return Ok(());
        }
        if dead() {
            return Err(WaitError::Dead);
        }
        let slice = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(WaitError::Timeout);
                }
                left.min(slice_max)
            }
            None => slice_max,
        };
        // Spun above already (or configured not to): sleep at once.
        match tw.wait_spin(Duration::ZERO, Some(slice)) {
            Ok(()) | Err(clan::TripwireError::Timeout) => {}
            Err(_) => return Err(WaitError::Stale),
        }
        if ready() {
            return Ok(());
        }
    }
}

/// [`wait_sliced`] for a condition whose evaluation can fail: `check()` says the wait is
/// over (`Ok(true)`), not yet (`Ok(false)`), or failed (`Err`, returned at once); a wait
/// that ends otherwise is mapped by `map`.
pub(crate) fn wait_check<E>(
    tw: &Tripwire,
    spin: Duration,
    deadline: Option<Instant>,
    slice: Duration,
    mut check: impl FnMut() -> Result<bool, E>,
    dead: impl FnMut() -> bool,
    map: impl FnOnce(WaitError) -> E,
) -> Result<(), E> {
    let mut failed = None;
    let r = wait_sliced(
        tw,
        spin,
        deadline,
        slice,
        || match check() {
            Ok(done) => done,
            Err(e) => {
                failed = Some(e);
                true
            }
        },
        dead,
    );
    match failed {
        Some(e) => Err(e),
        None => r.map_err(map),
    }
}
