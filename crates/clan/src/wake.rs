//! How the threads sleeping on one of our event queues are woken.
//!
//! A queue's waiters (in `EventQueue::wait`, `Tripwire::wait`, `Tripset::wait`) sleep on a
//! futex word of their own — a tripwire's `seq`, a tripset's word, the queue's wake word —
//! which the firings and posts of *this* process bump and wake. Other processes cannot touch
//! those words (they are not shared with them): what they post arrives on their ports
//! (`crate::port`) and must be *pumped* (applied here) before a waiter can see it.
//!
//! The usual case needs nothing from this module: a waiter sleeps with one `futex_waitv` on
//! its own word, the ports' epoch and the wake word of every port (up to
//! `crate::port::WAITV_PORTS` of them, each armed for a futex wake), and pumps when any of
//! them moves (`crate::port::EqInner::sleep`). Only a queue with more ports than that uses
//! the scheme below: one sleeper at a time, the **leader**, sleeps in `epoll_wait` over the
//! ports' eventfds instead of on its word; the others, the **followers**, sleep on the
//! queue's bell. The leader pumps when the ports wake it, which bumps the words of whatever
//! fired (and so wakes their followers); when it leaves, it rings the bell and a follower
//! takes over.
//!
//! Every local wake ([`QueueFutex::wake`]) also reaches the sleepers that do not sleep on the
//! word itself: it signals the leader's eventfd if the leader sleeps, and rings the bell if
//! followers sleep. A spurious wake-up is allowed (waiters re-check), a missed one never:
//!
//! - leader: `leader_sleeping = 1`, arm the ports, `fence(SeqCst)`, check the word, sleep;
//!   a local firer: bump the word, `fence(SeqCst)` (`trip::fire`), load `leader_sleeping`,
//!   signal. The eventfd keeps the signal until the leader reads it.
//! - follower: `followers += 1`, `fence(SeqCst)`, read the bell, check the word and that a
//!   leader is there, sleep on the bell; a local firer: bump the word, fence, load
//!   `followers`, ring the bell (the leader leaving: clear `leader`, fence, load `followers`,
//!   ring).
//! - whoever resets a port's eventfd (the leader, or `EventQueue::arm`) pumps afterwards
//!   (the caller's re-check does), so a signal one of them consumed is never needed by the
//!   other: what it announced is applied, and what that fires wakes its own sleepers.
//!
//! The queue's descriptor for epoll/mio/tokio users ([`Sleepers::fd`]) is a second epoll set,
//! over the queue's own eventfd (signalled by posts to our ring while it is armed for it) and
//! the ports' eventfds.
//!
//! A leader that drives exactly one link and hears no port may sleep in that link socket's
//! own `recv` instead of epoll (`leader_sleeping == IN_RECV`; `docs/ARCHITECTURE.md`,
//! "Waiting"): the same protocol, with `Link::interrupt` (socket made non-blocking, then the
//! wake signal to the leader's thread) in place of the eventfd, found under `recv_sleeper`.
//!
//! The leader's epoll set and eventfd are made by the first leader ([`Sleepers::lead`]):
//! most queues never have one (a queue with few ports, or one an event loop waits on through
//! its descriptor), and a queue per connection (`clan run`) would otherwise hold two
//! descriptors more per connection for nothing.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use clan_shm::eventfd::EventFd;
use clan_shm::sync::{Futex, SharedFutex};
use rustix::event::epoll;

/// epoll data of the queue's own eventfd and of the leader's (ports use their ids, never 0).
pub(crate) const OWN: u64 = 0;
/// epoll data of a link's socket: this bit and the link's id.
const LINK: u64 = 1 << 63;

/// A leader that sleeps on its NIC's link sockets too, and applies what arrives on them
/// (`EqInner::link_driver`): the NIC, and the most links its set takes.
pub(crate) struct Driving<'a> {
    pub nic: &'a crate::nic::NicInner,
    pub most: usize,
}

thread_local! {
    /// The links whose sockets woke this thread's last sleep as a driving leader, for its
    /// caller to read (`NicInner::progress_woken`).
    static WOKEN_LINKS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The links noted by this thread's last driving sleep (emptied).
pub(crate) fn take_woken_links() -> Vec<u64> {
    WOKEN_LINKS.with(|w| std::mem::take(&mut *w.borrow_mut()))
}

/// Forget what an earlier sleep noted (a sleep begins so: what a sleep that did not drive
/// returns for its caller to apply is every link, `NicInner::progress_woken`).
pub(crate) fn clear_woken_links() {
    WOKEN_LINKS.with(|w| w.borrow_mut().clear());
}

/// An emptied list back, so that its room is used again.
pub(crate) fn give_back_woken_links(ids: Vec<u64>) {
    WOKEN_LINKS.with(|w| {
        let mut w = w.borrow_mut();
        if w.is_empty() {
            *w = ids;
        }
    });
}

/// The link sockets in a leader's set: each link's id and the link.
type LinksInSet = Vec<(u64, std::sync::Weak<crate::link::Link>)>;

/// `leader_sleeping`: the leader sleeps in epoll (a local wake signals its eventfd).
const IN_EPOLL: u32 = 1;
/// `leader_sleeping`: the leader sleeps in a link socket's `recv` (a local wake interrupts
/// it: `Link::interrupt`).
const IN_RECV: u32 = 2;

/// A leader asleep in a link socket's `recv`: the link, the thread and the signal that
/// wakes it.
type RecvSleeper = (Arc<crate::link::Link>, i32, i32);

/// The sleepers of one queue.
pub(crate) struct Sleepers {
    leader: AtomicBool,
    /// 0, [`IN_EPOLL`] or [`IN_RECV`].
    leader_sleeping: AtomicU32,
    /// The leader asleep in a link socket's `recv`, set before `leader_sleeping` says so and
    /// cleared after it stops saying so; a waker holds the lock while it interrupts the
    /// sleep, so the thread cannot end meanwhile (it clears this first).
    recv_sleeper: std::sync::Mutex<Option<RecvSleeper>>,
    /// Ports watched (their count, for a leader that would sleep in `recv`: it may only
    /// with none).
    nwatched: std::sync::atomic::AtomicUsize,
    followers: AtomicU32,
    /// Followers' futex word.
    bell: AtomicU32,
    /// The leader's epoll set and eventfd, made by the first leader.
    lead: OnceLock<Lead>,
    /// The ports' eventfds watched, with their ids (for a leader's set made after them), and
    /// the lock under which `lead` is made, so that a port watched meanwhile is in it.
    /// (Keyed by the eventfd's allocation, which its `Weak` keeps.)
    watched: std::sync::Mutex<std::collections::HashMap<usize, (Weak<EventFd>, u64)>>,
    /// The descriptor's: over `notify` and every port's eventfd.
    api: OwnedFd,
    /// The queue's own eventfd.
    pub notify: Arc<EventFd>,
    /// Link sockets in `epoll` (a driving leader's): id and link, removed once closed; and
    /// the generation of the NIC's links they are (`LinkTable::generation`; None: not yet
    /// synchronised).
    links: std::sync::Mutex<(Option<u64>, LinksInSet)>,
}

impl std::fmt::Debug for Sleepers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sleepers")
            .field("leader", &self.leader.load(Ordering::Relaxed))
            .field("followers", &self.followers.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The leader's: an epoll set over `kick` and every port's eventfd (and, for a driving
/// leader, the NIC's link sockets), and the eventfd local wakes signal while it sleeps.
struct Lead {
    epoll: OwnedFd,
    kick: EventFd,
}

impl Sleepers {
    pub fn new(notify: Arc<EventFd>) -> std::io::Result<Sleepers> {
        let api = clan_shm::fdfloor::lift(epoll::create(epoll::CreateFlags::CLOEXEC)?);
        epoll::add(&api, notify.as_fd(), epoll::EventData::new_u64(OWN), epoll::EventFlags::IN)?;
        Ok(Sleepers {
            leader: AtomicBool::new(false),
            leader_sleeping: AtomicU32::new(0),
            recv_sleeper: std::sync::Mutex::new(None),
            nwatched: std::sync::atomic::AtomicUsize::new(0),
            followers: AtomicU32::new(0),
            bell: AtomicU32::new(0),
            lead: OnceLock::new(),
            watched: std::sync::Mutex::new(std::collections::HashMap::new()),
            api,
            notify,
            links: std::sync::Mutex::new((None, Vec::new())),
        })
    }

    /// The leader's set and eventfd, made now if no leader made them yet (with every port
    /// watched so far in the set; `watch` adds later ones under the same lock).
    fn lead(&self) -> std::io::Result<&Lead> {
        if let Some(l) = self.lead.get() {
            return Ok(l);
        }
        let watched = crate::lock(&self.watched);
        if let Some(l) = self.lead.get() {
            return Ok(l);
        }
        let kick = EventFd::new()?;
        let ep = clan_shm::fdfloor::lift(epoll::create(epoll::CreateFlags::CLOEXEC)?);
        epoll::add(&ep, kick.as_fd(), epoll::EventData::new_u64(OWN), epoll::EventFlags::IN)?;
        for (fd, id) in watched.values() {
            // (a port's eventfd dropped without `unwatch` is gone from every set already)
            if let Some(fd) = fd.upgrade() {
                epoll::add(&ep, fd.as_fd(), epoll::EventData::new_u64(*id), epoll::EventFlags::IN)?;
            }
        }
        Ok(self.lead.get_or_init(|| Lead { epoll: ep, kick }))
    }

    /// Make `epoll`'s link sockets those of `nic`'s open links (level-triggered
    /// readability): nothing to do while the links did not change (one load). False if there
    /// are none, more than `most`, or one could not be added (the caller sleeps without
    /// driving).
    fn sync_links(&self, lead: &Lead, nic: &crate::nic::NicInner, most: usize) -> bool {
        // Read before the list: a change after it moves it, and the next sleep looks again.
        let generation = nic.links.generation();
        let mut guard = crate::lock(&self.links);
        let (synced, have) = &mut *guard;
        if *synced == Some(generation) {
            return !have.is_empty();
        }
        let links: Vec<Arc<crate::link::Link>> = nic.links.all().iter().filter(|l| !l.is_closed()).cloned().collect();
        *synced = None;
        for (id, w) in have.drain(..) {
            if let Some(l) = w.upgrade().filter(|l| !links.iter().any(|n| n.id == id) || l.is_closed()) {
                // Still open (the link lives): out of the set. A dropped link's descriptor
                // was closed, which took it out.
                let _ = epoll::delete(&lead.epoll, l.sock.as_fd());
            }
        }
        if links.is_empty() || links.len() > most {
            // (none in the set now: a later sync with as many adds them)
            return false;
        }
        for l in &links {
            let r =
                epoll::add(&lead.epoll, l.sock.as_fd(), epoll::EventData::new_u64(LINK | l.id), epoll::EventFlags::IN);
            if r.is_err() && r != Err(rustix::io::Errno::EXIST) {
                return false;
            }
            have.push((l.id, Arc::downgrade(l)));
        }
        *synced = Some(generation);
        true
    }

    /// The queue's descriptor: readable when the queue's eventfd or a port's is.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.api.as_fd()
    }

    /// Watch a port's eventfd.
    pub fn watch(&self, fd: &Arc<EventFd>, id: u64) -> std::io::Result<()> {
        let mut watched = crate::lock(&self.watched);
        epoll::add(&self.api, fd.as_fd(), epoll::EventData::new_u64(id), epoll::EventFlags::IN)?;
        if let Some(l) = self.lead.get() {
            if let Err(e) = epoll::add(&l.epoll, fd.as_fd(), epoll::EventData::new_u64(id), epoll::EventFlags::IN) {
                let _ = epoll::delete(&self.api, fd.as_fd());
                return Err(e.into());
            }
        }
        watched.insert(Arc::as_ptr(fd) as usize, (Arc::downgrade(fd), id));
        self.nwatched.store(watched.len(), Ordering::Relaxed);
        drop(watched);
        // A leader asleep in a link's `recv` does not hear this port: wake it, and it sleeps
        // in epoll next time (Dekker with its "IN_RECV, fence, load nwatched").
        fence(Ordering::SeqCst);
        if self.leader_sleeping.load(Ordering::Acquire) == IN_RECV {
            self.interrupt_recv();
        }
        Ok(())
    }

    /// Stop watching a port's eventfd.
    pub fn unwatch(&self, fd: &Arc<EventFd>) {
        let mut watched = crate::lock(&self.watched);
        watched.remove(&(Arc::as_ptr(fd) as usize));
        self.nwatched.store(watched.len(), Ordering::Relaxed);
        if let Some(l) = self.lead.get() {
            let _ = epoll::delete(&l.epoll, fd.as_fd());
        }
        let _ = epoll::delete(&self.api, fd.as_fd());
    }

    /// After a local change a sleeper may wait for: wake the sleepers that do not sleep on
    /// the changed word itself. The caller changed the word and fenced (`SeqCst`) before.
    pub fn kick(&self) {
        // SYNC POINT: pairs with the leader's Release store of `leader_sleeping`, made after
        // it made `lead` (a leader seen asleep in epoll has its eventfd) and set
        // `recv_sleeper` (one seen asleep in `recv` can be found).
        match self.leader_sleeping.load(Ordering::Acquire) {
            0 => {}
            IN_RECV => self.interrupt_recv(),
            _ => {
                if let Some(l) = self.lead.get() {
                    l.kick.signal();
                }
            }
        }
        if self.followers.load(Ordering::Relaxed) != 0 {
            self.ring();
        }
    }

    /// End the leader's sleep in a link socket's `recv`, if it still sleeps there (a
    /// spurious wake-up of its next sleep otherwise: it re-checks).
    fn interrupt_recv(&self) {
        if let Some((link, tid, sig)) = &*crate::lock(&self.recv_sleeper) {
            link.interrupt(*tid, *sig);
        }
    }

    /// Whether this leader may sleep in its link's `recv` (and the signal that would wake
    /// it): allowed by the NIC's config, the wait long enough ([`crate::link::RECV_SLEEP_MIN`]:
    /// a shorter one sleeps in epoll, whose timeout is exact), no ports to hear, and the wake signal available and not
    /// blocked in this thread (asked once in [`MASK_EVERY`] sleeps: one system call).
    fn recv_sleep_signal(&self, nic: &crate::nic::NicInner, timeout: Option<Duration>) -> Option<i32> {
        if !nic.config.wake_signal
            || timeout.is_some_and(|t| t < crate::link::RECV_SLEEP_MIN)
            || self.nwatched.load(Ordering::Relaxed) != 0
        {
            return None;
        }
        let sig = clan_shm::wakesig::signal()?;
        thread_local! {
            /// Sleeps until this thread's signal mask is asked again, and whether it
            /// blocked the wake signal when last asked.
            static MASK: std::cell::Cell<(u32, bool)> = const { std::cell::Cell::new((0, false)) };
        }
        let blocked = MASK.with(|m| {
            let (left, blocked) = m.get();
            if left == 0 {
                let blocked = clan_shm::wakesig::blocked_here(sig);
                m.set((MASK_EVERY - 1, blocked));
                blocked
            } else {
                m.set((left - 1, blocked));
                blocked
            }
        });
        (!blocked).then_some(sig)
    }

    /// The one link in the leader's set, if it holds exactly one.
    fn sole_link(&self) -> Option<Arc<crate::link::Link>> {
        let guard = crate::lock(&self.links);
        match guard.1.as_slice() {
            [(_, l)] => l.upgrade(),
            _ => None,
        }
    }

    fn ring(&self) {
        // SYNC POINT: pairs with the followers' Acquire load of `bell` before they sleep.
        self.bell.fetch_add(1, Ordering::Release);
        clan_shm::futex::wake_all(&self.bell);
    }

    /// Sleep while `word` holds `expected`, at most `timeout`, unless the ports may hold
    /// something: as the leader if there is none (on the epoll descriptor, after `arm_ports`
    /// armed the ports and said whether they are all empty; `drained` is told which
    /// eventfds were readable), as a follower otherwise. May return early; the caller
    /// re-checks (and pumps).
    ///
    /// With `driving`, the leader also sleeps on the NIC's link sockets, counted as a thread
    /// that drives them (the engine parks them meanwhile, `clan_shm::handoff`), and applies
    /// what arrives on them itself when they wake it: one wake-up for a byte from another
    /// host instead of two (the engine's, then this thread's). Nothing is missed if the
    /// engine or another thread applies those bytes meanwhile: their firing kicks the leader
    /// like any local firing. A sleeper that does not drive is counted by `asleep`. True if
    /// the caller is to apply what came on the links (`NicInner::progress`): it drove and a
    /// link woke it, or, with manual progress, it could not listen to them. The caller does
    /// so once it no longer counts itself among the word's waiters, so that its own firings
    /// make no system call to wake it.
    #[allow(clippy::too_many_arguments)]
    pub fn sleep(
        &self,
        word: &AtomicU32,
        expected: u32,
        timeout: Option<Duration>,
        arm_ports: impl FnOnce() -> bool,
        mut drained: impl FnMut(u64),
        driving: Option<Driving<'_>>,
        asleep: impl FnOnce() -> crate::progress::Sleeper,
    ) -> bool {
        // With manual progress nobody else reads the links: a sleep that cannot listen to
        // them is short, and its caller drives them after it.
        let manual = driving.as_ref().is_some_and(|d| d.nic.manual_progress());
        let lead = match self.leader.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => match self.lead() {
                Ok(l) => Some(l),
                Err(e) => {
                    // No descriptor for the leader's set: sleep as a follower would, for a
                    // moment at a time (what the ports bring is seen at the next look).
                    tracing::debug!("no epoll set for the queue's leader ({e}): napping");
                    // SYNC POINT: pairs with the followers' Acquire load of `leader`.
                    self.leader.store(false, Ordering::Release);
                    // (as a leader leaving: a follower that saw us lead is rung)
                    fence(Ordering::SeqCst);
                    if self.followers.load(Ordering::Relaxed) != 0 {
                        self.ring();
                    }
                    let nap = timeout.map_or(LEADERLESS_NAP, |t| t.min(LEADERLESS_NAP));
                    let _asleep = asleep();
                    clan_shm::futex::wait(&self.bell, self.bell.load(Ordering::Acquire), Some(nap));
                    return manual;
                }
            },
            Err(_) => None,
        };
        if let Some(lead) = lead {
            // A leader that could not add the links to its set, with manual progress, looks
            // again soon, and its caller drives them.
            let driving = driving.filter(|d| self.sync_links(lead, d.nic, d.most));
            let timeout = if manual && driving.is_none() {
                Some(timeout.map_or(crate::progress::MANUAL_NAP, |t| t.min(crate::progress::MANUAL_NAP)))
            } else {
                timeout
            };
            let _asleep = if driving.is_none() { Some(asleep()) } else { None };
            if let Some(d) = &driving {
                d.nic.spinners.begin();
            }
            let mut link_ready = false;
            // One link and nothing else to hear: sleep in its socket's `recv`, which a byte
            // from the peer ends with the byte (no epoll in between), and a local wake with
            // a signal (`kick` → `interrupt_recv`).
            let in_recv = driving.as_ref().and_then(|d| {
                let sig = self.recv_sleep_signal(d.nic, timeout)?;
                let link = self.sole_link()?;
                Some((sig, link))
            });
            let mut recv_sleep = in_recv.as_ref().and_then(|(sig, link)| Some((*sig, link, link.sleeper()?)));
            if let Some((sig, link, rs)) = &mut recv_sleep {
                *crate::lock(&self.recv_sleeper) = Some(((*link).clone(), clan_shm::wakesig::tid(), *sig));
                // SYNC POINT: pairs with `kick`'s Acquire load (`recv_sleeper` is set before).
                self.leader_sleeping.store(IN_RECV, Ordering::Release);
                let quiet = arm_ports();
                // Dekker with `kick`'s "word changed, fence, load leader_sleeping", and
                // with `watch`'s "port added, fence, load leader_sleeping".
                fence(Ordering::SeqCst);
                // SYNC POINT: pairs with the firer's `seq.fetch_add(AcqRel)`.
                if quiet
                    && word.load(Ordering::Acquire) == expected
                    && self.nwatched.load(Ordering::Relaxed) == 0
                    && rs.sleep(timeout)
                {
                    link_ready = true;
                    WOKEN_LINKS.with(|w| w.borrow_mut().push(link.id));
                }
                self.leader_sleeping.store(0, Ordering::Relaxed);
                *crate::lock(&self.recv_sleeper) = None;
            } else {
                // SYNC POINT: pairs with `kick`'s Acquire load (`lead` is made before this).
                self.leader_sleeping.store(IN_EPOLL, Ordering::Release);
                let quiet = arm_ports();
                // Dekker with `kick`'s "word changed, fence, load leader_sleeping".
                fence(Ordering::SeqCst);
                // SYNC POINT: pairs with the firer's `seq.fetch_add(AcqRel)`.
                if quiet && word.load(Ordering::Acquire) == expected {
                    // (on the stack: a sleep allocates nothing)
                    let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
                    let ts = timeout.map(|d| rustix::time::Timespec {
                        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
                        tv_nsec: d.subsec_nanos().into(),
                    });
                    if let Ok((events, _)) = epoll::wait(&lead.epoll, &mut events[..], ts.as_ref()) {
                        for ev in events.iter() {
                            match ev.data.u64() {
                                OWN => {
                                    lead.kick.drain();
                                }
                                id if id & LINK != 0 => {
                                    link_ready = true;
                                    WOKEN_LINKS.with(|w| w.borrow_mut().push(id & !LINK));
                                }
                                id => drained(id),
                            }
                        }
                    }
                }
                self.leader_sleeping.store(0, Ordering::Relaxed);
            }
            // (the receive lock, for the caller's receive)
            drop(recv_sleep);
            if let Some(d) = &driving {
                if d.nic.spinners.end(false) {
                    d.nic.command(crate::nic::Cmd::Unpark);
                }
            }
            // SYNC POINT: pairs with the followers' Acquire load of `leader`.
            self.leader.store(false, Ordering::Release);
            // Dekker with the followers' "followers += 1, fence, read bell, load leader".
            fence(Ordering::SeqCst);
            if self.followers.load(Ordering::Relaxed) != 0 {
                self.ring();
            }
            (driving.is_some() && link_ready) || (manual && driving.is_none())
        } else {
            let _asleep = asleep();
            self.followers.fetch_add(1, Ordering::AcqRel);
            fence(Ordering::SeqCst);
            let bell = self.bell.load(Ordering::Acquire);
            if self.leader.load(Ordering::Acquire) && word.load(Ordering::Acquire) == expected {
                clan_shm::futex::wait(&self.bell, bell, timeout);
            }
            self.followers.fetch_sub(1, Ordering::AcqRel);
            false
        }
    }
}

/// How long a would-be leader that could not make its epoll set sleeps before it looks again.
const LEADERLESS_NAP: Duration = Duration::from_millis(1);

/// A leader asks its thread's signal mask once in this many sleeps in `recv`: a thread that
/// blocks the wake signal meanwhile is woken by its link's traffic or its receive timeout
/// only, until it asks again.
const MASK_EVERY: u32 = 64;

/// The futex of a queue of ours: [`Futex::wake`] also reaches the sleepers that do not
/// sleep on the word itself ([`Sleepers::kick`]).
pub(crate) struct QueueFutex<'a> {
    pub sleepers: Option<&'a Sleepers>,
}

impl Futex for QueueFutex<'_> {
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        SharedFutex.wait(word, expected, timeout);
    }

    fn wake(&self, word: &AtomicU32) {
        SharedFutex.wake(word);
        if let Some(s) = self.sleepers {
            s.kick();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sleep as the leader until a port wakes it: the ids it drained.
    fn lead_once(s: &Sleepers) -> Vec<u64> {
        let word = AtomicU32::new(0);
        let mut woke = Vec::new();
        let nobody = std::sync::Weak::new();
        let links = std::sync::atomic::AtomicUsize::new(0);
        s.sleep(
            &word,
            0,
            Some(Duration::from_secs(30)),
            || true,
            |id| woke.push(id),
            None,
            || crate::progress::Sleeper::enter(&nobody, &links),
        );
        woke
    }

    /// The leader's set is made by the first leader, with the ports watched before it, and
    /// takes the ports watched after; a port unwatched leaves it; a local wake reaches the
    /// leader through its eventfd.
    #[test]
    fn the_leaders_set_is_made_at_the_first_leader_with_every_port_watched() {
        let s = Arc::new(Sleepers::new(Arc::new(EventFd::new().unwrap())).unwrap());
        let (early, late) = (Arc::new(EventFd::new().unwrap()), Arc::new(EventFd::new().unwrap()));
        s.watch(&early, 7).unwrap();
        assert!(s.lead.get().is_none(), "no leader yet: no set");
        early.signal();
        assert_eq!(lead_once(&s), vec![7], "a port watched before the set was made wakes the leader");
        assert!(s.lead.get().is_some());
        early.drain();
        s.watch(&late, 9).unwrap();
        late.signal();
        assert_eq!(lead_once(&s), vec![9], "a port watched after wakes it too");
        late.drain();
        s.unwatch(&late);
        late.signal();
        // A local wake while the leader sleeps (the set holds `early`, quiet, and the kick).
        let kicker = {
            let s = s.clone();
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                while s.leader_sleeping.load(Ordering::Acquire) == 0 && t.elapsed() < Duration::from_secs(30) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                fence(Ordering::SeqCst);
                s.kick();
            })
        };
        assert_eq!(lead_once(&s), Vec::<u64>::new(), "woken by the kick, not by the unwatched port");
        kicker.join().unwrap();
        assert_eq!(s.watched.lock().unwrap().len(), 1);
    }
}
