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

/// Early wake-ups (`crate::pipe`'s documentation): the token a waiter leaves in its peer's
/// `CTL_ASLEEP` before its `n`th sleep (`n` from 1: a token is never 0): `n` and the CPU.
fn sleep_token(n: u64) -> u64 {
    n << 16 | cpu()
}

/// The sleeper's half of an early wake-up: before its `n`th sleep (`n` from 1), leave the
/// token in the peer's side, if that is imported already and on this host (a nudge across
/// a link would be one more frame for the reply to wait behind).
pub(crate) fn ask_nudge(peer: &crate::side::PeerSide, n: u64) {
    if let Some(m) = peer.imported().filter(|m| !m.is_remote()) {
        let _ = m.store_u64(crate::pipe::CTL_ASLEEP, sleep_token(n));
    }
}

/// The taker's half of an early wake-up: if our side `mine` holds a token that `*answered`
/// is not, from a sleeper on another CPU than ours, store it into `peer`'s `CTL_NUDGE`
/// (which its wait's tripwire watches). One local load when there is nothing to answer.
/// Errors are ignored: a hint, and a failing peer shows on the next real access. Whether
/// it stored.
pub(crate) fn nudge(mine: &Aperture, answered: &mut u64, peer: &crate::side::PeerSide) -> bool {
    let Ok(token) = mine.load_u64(crate::pipe::CTL_ASLEEP) else { return false };
    if token == *answered {
        return false;
    }
    *answered = token;
    if token & 0xffff == cpu() {
        return false;
    }
    peer.imported().filter(|m| !m.is_remote()).is_some_and(|m| m.store_u64(crate::pipe::CTL_NUDGE, token).is_ok())
}

/// Whether spinning for the peer can only delay it: the peer last went to sleep on the CPU
/// this thread runs on (its token in our side, `CTL_ASLEEP`, [`ask_nudge`]), and this thread
/// may run on that CPU alone. Then the peer, woken, waits for this CPU, and a spin holds it
/// the whole spin for nothing (both sides of a stream on one CPU with the default spin: 53 µs
/// a round trip against 12 µs blocking). One local load and the CPU number in the common case
/// (a peer that slept elsewhere, or never); the affinity system call only when they agree.
/// A hint from memory the peer writes: a forged token costs this wait its spin, nothing else.
pub(crate) fn spin_is_futile(mine: &Aperture) -> bool {
    let Ok(token) = mine.load_u64(crate::pipe::CTL_ASLEEP) else { return false };
    futile(token, cpu(), || rustix::thread::sched_getaffinity(None).is_ok_and(|s| s.count() == 1))
}

/// [`spin_is_futile`] from the peer's token, this thread's CPU, and whether this thread may
/// run on one CPU only (asked last).
fn futile(token: u64, my_cpu: u64, alone: impl FnOnce() -> bool) -> bool {
    token != 0 && token & 0xffff == my_cpu && alone()
}

/// The CPU this thread runs on, as a token holds it (16 bits).
fn cpu() -> u64 {
    (rustix::thread::sched_getcpu() & 0xffff) as u64
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

/// Polls per receive from the NIC's links in a spin that waits for a peer of this host
/// (its writes land by themselves; the links are looked at for other peers' sake).
const LINK_EVERY: u32 = 8;

/// How a wait polls before it sleeps: for how long, and how often it receives from the
/// NIC's links meanwhile.
///
/// A wait for a peer across a link receives at every poll: while it spins, the engine
/// leaves the link to it (`clan::LinkSpin`), so what it waits for lands only when one of its
/// own receives applies it, and a look at memory between two receives cannot find anything
/// new. Receiving at every 8th poll only, as a wait for a peer of this host does, put ~8
/// polls (a few hundred nanoseconds) between the bytes' arrival in the socket and the
/// receive that takes them, on each side of a round trip: a 64 B stream round trip over a
/// loopback link, both sides spinning, read ~9.1 µs that way against ~8.5 µs receiving at
/// every poll (kernel TCP, polled: ~7.6 µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spin {
    /// How long (zero: sleep at once).
    pub(crate) time: Duration,
    /// Polls per receive from the links.
    every: u32,
}

impl Spin {
    /// A spin of `time` waiting for a peer across a link (`across_link`: it receives at
    /// every poll) or on this host.
    pub(crate) fn for_peer(time: Duration, across_link: bool) -> Spin {
        Spin { time, every: if across_link { 1 } else { LINK_EVERY } }
    }

    /// A spin of `time` waiting for the peer of `conn`.
    pub(crate) fn for_conn(time: Duration, conn: &clan::Connection) -> Spin {
        Spin::for_peer(time, matches!(conn.peer_identity(), clan::PeerIdentity::Remote { .. }))
    }

    /// No spin: sleep at once.
    #[cfg(test)]
    pub(crate) const NONE: Spin = Spin { time: Duration::ZERO, every: LINK_EVERY };
}

/// Wait until `ready()` holds: poll it for `spin.time`, then block on `tw` (armed, re-checked,
/// slept on) at most `slice_max` at a time, until it holds, `deadline` passes, or `dead()`
/// holds. A `deadline` in the past checks once. Short slices suit conditions that another
/// write than the tripwire's may also satisfy.
pub(crate) fn wait_sliced(
    tw: &Tripwire,
    spin: Spin,
    deadline: Option<Instant>,
    slice_max: Duration,
    ready: impl FnMut() -> bool,
    dead: impl FnMut() -> bool,
) -> Result<(), WaitError> {
    wait_sliced_with(tw, spin, deadline, slice_max, ready, dead, || {})
}

/// [`wait_sliced`], calling `sleeping()` once, before the first sleep (after the spin and
/// the first re-check): a wait that ends without sleeping never calls it.
pub(crate) fn wait_sliced_with(
    tw: &Tripwire,
    spin: Spin,
    deadline: Option<Instant>,
    slice_max: Duration,
    mut ready: impl FnMut() -> bool,
    mut dead: impl FnMut() -> bool,
    sleeping: impl FnOnce(),
) -> Result<(), WaitError> {
    let mut sleeping = Some(sleeping);
    if ready() {
        return Ok(());
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(WaitError::Timeout);
    }
    if !spin.time.is_zero() {
        // The clock is first read after 64 polls: a wait that ends within them (the common
        // case of a reader just ahead of its writer) costs no clock read at all; the spin
        // time counts from there, and ends at the deadline if that comes first.
        let mut until = None;
        let mut n = 0u32;
        // Bytes that come over a link: this thread applies them (at every poll for a peer
        // across a link, every 8th otherwise, so that a wait on shared memory alone pays
        // little for it: `Spin`), and the NIC's engine is not woken for them meanwhile (it
        // would take this thread's CPU).
        let links = tw.spin_links();
        loop {
            std::hint::spin_loop();
            if ready() {
                return Ok(());
            }
            n = n.wrapping_add(1);
            if n % spin.every == 0 && links.drive() && ready() {
                return Ok(());
            }
            if n % 64 == 0 {
                let now = Instant::now();
                let end = until.get_or_insert_with(|| deadline.map_or(now + spin.time, |d| d.min(now + spin.time)));
                if now >= *end {
                    // The engine serves the links again while this thread sleeps.
                    links.sleep();
                    break;
                }
            }
        }
    }
    // Armed from here on, and disarmed again on every way out (see `Disarm`).
    let _disarm = Disarm(tw);
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
        if let Some(f) = sleeping.take() {
            f();
        }
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

/// Disarms a wait's tripwire when the wait ends, unless it has fired (a once-only tripwire
/// disarms then; one load). Left armed after a wait that found its condition without
/// sleeping, or that timed out, the tripwire would charge every later write of the peer's
/// to the watched words a firing (from another process: a claim that this process takes
/// only when it next sleeps), although nobody waits: a claim posted to this process's port
/// on each of the peer's stores, for as long as this side polls.
struct Disarm<'a>(&'a Tripwire);

impl Drop for Disarm<'_> {
    fn drop(&mut self) {
        if self.0.is_armed() {
            // (stale only once the aperture is gone: nothing left to disarm)
            let _ = self.0.disarm();
        }
    }
}

/// [`wait_sliced`] for a condition whose evaluation can fail: `check()` says the wait is
/// over (`Ok(true)`), not yet (`Ok(false)`), or failed (`Err`, returned at once); a wait
/// that ends otherwise is mapped by `map`.
pub(crate) fn wait_check<E>(
    tw: &Tripwire,
    spin: Spin,
    deadline: Option<Instant>,
    slice: Duration,
    check: impl FnMut() -> Result<bool, E>,
    dead: impl FnMut() -> bool,
    map: impl FnOnce(WaitError) -> E,
) -> Result<(), E> {
    wait_check_with(tw, spin, deadline, slice, check, dead, map, || {})
}

/// [`wait_check`] with [`wait_sliced_with`]'s `sleeping`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_check_with<E>(
    tw: &Tripwire,
    spin: Spin,
    deadline: Option<Instant>,
    slice: Duration,
    mut check: impl FnMut() -> Result<bool, E>,
    dead: impl FnMut() -> bool,
    map: impl FnOnce(WaitError) -> E,
    sleeping: impl FnOnce(),
) -> Result<(), E> {
    let mut failed = None;
    let r = wait_sliced_with(
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
        sleeping,
    );
    match failed {
        Some(e) => Err(e),
        None => r.map_err(map),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However a wait ends (its condition found at the look after arming, a timeout, or a
    /// write that woke it), its tripwire is disarmed afterwards: a peer's later stores fire
    /// nothing.
    #[test]
    fn a_wait_leaves_its_tripwire_disarmed() {
        let nic = clan::Nic::open_default().unwrap();
        let (ep, peer) = (nic.endpoint().unwrap(), nic.endpoint().unwrap());
        let ap = ep.export(4096).unwrap();
        let tw = wait_tripwire(&ap, 0..8).unwrap();
        let never = || false;
        // Found at the look after arming (the first look, before it, said no).
        let mut looks = 0;
        let found = wait_sliced(
            &tw,
            Spin::NONE,
            None,
            SLICE,
            || {
                looks += 1;
                looks > 1
            },
            never,
        );
        assert_eq!((found, looks), (Ok(()), 2));
        assert!(!tw.is_armed(), "found without sleeping");
        // A timeout.
        let late = Instant::now() + Duration::from_millis(20);
        assert_eq!(wait_sliced(&tw, Spin::NONE, Some(late), SLICE, || false, never), Err(WaitError::Timeout));
        assert!(!tw.is_armed(), "timed out");
        // Woken by a write of another endpoint's (an import of the aperture).
        let m = peer.import(&ap.descriptor()).unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            m.store_u64(0, 1).unwrap();
            m
        });
        let woke = wait_sliced(
            &tw,
            Spin::NONE,
            Some(Instant::now() + Duration::from_secs(20)),
            SLICE,
            || ap.load_u64(0).unwrap() == 1,
            never,
        );
        assert_eq!(woke, Ok(()));
        assert!(!tw.is_armed(), "woken");
        let m = writer.join().unwrap();
        tw.take_fired();
        m.store_u64(0, 2).unwrap();
        assert!(!tw.take_fired(), "nothing armed to fire");
    }

    /// A spin for a peer across a link receives from the links at every poll (what it
    /// waits for lands only by its own receives); one for a peer of this host, at every
    /// 8th. Counted by the NIC's receives that found nothing, against the polls. With
    /// manual progress: no engine thread holds the link's receive lock meanwhile (on a
    /// loaded machine one preempted while it held it made a third of the receives skip).
    #[test]
    fn a_spin_for_a_peer_across_a_link_receives_at_every_poll() {
        use crate::stream::{Listener, Stream, StreamConfig};
        let d = clan::NicConfig::default();
        let cfg =
            clan::NicConfig { local_transport: clan::LocalTransport::Link, progress: clan::Progress::Manual, ..d };
        let (a, b) = (clan::Nic::open(cfg.clone()).unwrap(), clan::Nic::open(cfg).unwrap());
        // A link between the two NICs: a stream's connection.
        let l = Listener::bind_with(&b, None, StreamConfig::default()).unwrap();
        let to = l.local_addr();
        let accepting = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let _c = Stream::connect_with(&a, to, &StreamConfig::default()).unwrap();
        let _s = accepting.join().unwrap().unwrap();
        assert_eq!(a.stats().links, 1);
        let ep = a.endpoint().unwrap();
        let ap = ep.export(4096).unwrap();
        let tw = wait_tripwire(&ap, 0..8).unwrap();
        for across in [true, false] {
            let before = a.stats().link_empty_receives;
            let mut polls = 0u64;
            let spin = Spin::for_peer(Duration::from_millis(20), across);
            let end = Instant::now() + Duration::from_millis(20);
            let r = wait_sliced(
                &tw,
                spin,
                Some(end),
                SLICE,
                || {
                    polls += 1;
                    false
                },
                || false,
            );
            assert_eq!(r, Err(WaitError::Timeout));
            let empty = a.stats().link_empty_receives - before;
            assert!(polls > 64, "{polls} polls in 20 ms");
            if across {
                assert!(empty >= polls / 2, "across a link: {empty} empty receives in {polls} polls");
            } else {
                assert!(empty <= polls / 4, "on this host: {empty} empty receives in {polls} polls");
            }
        }
    }

    #[test]
    fn a_spin_is_futile_only_for_a_peer_asleep_on_our_only_cpu() {
        let token = |n: u64, cpu: u64| n << 16 | cpu;
        assert!(futile(token(3, 0), 0, || true), "the peer slept on our CPU, and we have no other");
        assert!(!futile(token(3, 0), 0, || false), "we may run elsewhere: the scheduler may part us");
        assert!(!futile(token(3, 1), 0, || true), "the peer slept on another CPU");
        assert!(!futile(0, 0, || true), "the peer never slept (no token): spin");
        let mut asked = false;
        assert!(!futile(token(3, 1), 0, || {
            asked = true;
            true
        }));
        assert!(!asked, "no affinity system call unless the CPUs agree");
        // This thread, pinned to the CPU it is on, with a token of that CPU in its side.
        let nic = clan::Nic::open_default().unwrap();
        let ap = nic.endpoint().unwrap().export(4096).unwrap();
        let all = rustix::thread::sched_getaffinity(None).unwrap();
        let here = cpu();
        let mut one = rustix::thread::CpuSet::new();
        one.set(here as usize);
        if rustix::thread::sched_setaffinity(None, &one).is_ok() {
            let now = cpu();
            ap.store_u64(crate::pipe::CTL_ASLEEP, token(1, now)).unwrap();
            assert!(spin_is_futile(&ap));
            ap.store_u64(crate::pipe::CTL_ASLEEP, token(2, now + 1)).unwrap();
            assert!(!spin_is_futile(&ap));
            rustix::thread::sched_setaffinity(None, &all).unwrap();
        }
    }
}
