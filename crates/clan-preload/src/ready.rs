//! Readiness of accelerated connections merged with the kernel's: `poll`, `select` and
//! `epoll`.
//!
//! An accelerated descriptor is never handed to the kernel's wait (its kernel socket carries
//! no data, and always looks writable): its readiness is read from its clan stream. A wait
//! that finds nothing ready spins briefly (`CLAN_SPIN_US`, default 15 µs: [`clan::default_spin`]) on the streams, then
//! arms their readiness tripwires, looks once more, and sleeps in the kernel on the other
//! descriptors together with the connections' event queues (whose descriptors the tripwires
//! make readable).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event, pollfd};
use rustc_hash::FxHashMap;

use crate::conn::Conn;
use crate::{real, table};

/// Tag of our own entries in an application's epoll set: the entry's data is the tag and
/// the queue's own descriptor. (The queue's, not the member's: a queue outlives its
/// connection, given to the next one (`registry.rs::recycle_queue`), and stays in the sets
/// it was in until a wake-up through one finds it no member's there: then it leaves.)
const TAG: u64 = 0xC1A9_5EED_0000_0000;
const TAG_MASK: u64 = 0xFFFF_FFFF_0000_0000;

/// How long a wait polls the streams before it sleeps: [`clan::default_spin`]
/// (`CLAN_SPIN_US`; 0: never spin).
pub(crate) fn spin() -> Duration {
    clan::default_spin()
}

fn deadline(timeout_ms: c_int) -> Option<Instant> {
    (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64))
}

/// Milliseconds to `d` for the kernel (rounded up; -1: forever).
fn ms_left(d: Option<Instant>) -> c_int {
    match d {
        None => -1,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            left.as_micros().div_ceil(1000).min(c_int::MAX as u128) as c_int
        }
    }
}

fn queue_fd(c: &Conn) -> c_int {
    use std::os::fd::AsRawFd;
    c.queue.as_raw_fd()
}

/// `poll` events of an accelerated connection for interest `events` (None: it is the
/// kernel's socket now).
fn poll_events(c: &Conn, fd: c_int, events: i16) -> Option<i16> {
    let r = c.state(fd)?;
    let mut out = 0i16;
    if r.readable {
        out |= events & (libc::POLLIN | libc::POLLRDNORM);
    }
    if r.writable {
        out |= events & (libc::POLLOUT | libc::POLLWRNORM);
    }
    if r.eof {
        out |= events & libc::POLLRDHUP;
    }
    if r.error {
        out |= libc::POLLERR | libc::POLLHUP;
    }
    Some(out)
}

/// The connection at `conn` went over to the kernel for good: its descriptors leave the
/// table, and wherever one is in an epoll set, the kernel's socket takes its place there
/// (with the application's events and data), so that waits see it as any other.
pub(crate) fn retire(conn: *const Conn) {
    let gone = table::remove_conn(conn);
    if gone.is_empty() {
        return;
    }
    let mut dropped = Vec::new();
    {
        let mut all = sets();
        for (epfd, set) in all.iter_mut() {
            for (fd, _) in &gone {
                if set.members.get(fd).is_some_and(|m| std::ptr::eq(Arc::as_ptr(&m.conn), conn)) {
                    if let Some(m) = set.remove(*fd) {
                        let io = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLPRI) as u32;
                        let events = if m.disabled { m.events & !io } else { m.events };
                        if let Err(e) = real::epoll_control(*epfd, libc::EPOLL_CTL_ADD, *fd, events, m.data) {
                            crate::say(format_args!(
                                "epoll set {epfd}: adding the kernel's socket {fd} failed: errno {e}"
                            ));
                        }
                        dropped.push(m);
                    }
                }
            }
        }
    }
    // (the connections drop here, outside the lock)
    drop(dropped);
    drop(gone);
}

/// `poll(2)` over `fds`, some of which may be accelerated; `ppoll(2)`'s signal mask, if
/// given, is the kernel's while it sleeps (so a signal it unblocks interrupts the sleep, as
/// with `ppoll`; the brief spin before runs with the caller's mask).
pub(crate) fn poll(fds: &mut [pollfd], timeout: c_int, mask: Option<&libc::sigset_t>) -> Result<usize, c_int> {
    let end = deadline(timeout);
    let spin_until = Instant::now() + spin();
    loop {
        // (again from the start when a connection went over to the kernel meanwhile)
        if let Some(n) = poll_round(fds, timeout, end, spin_until, mask)? {
            return Ok(n);
        }
    }
}

/// One go of [`poll`] over the connections accelerated now; None if one of them went over
/// to the kernel meanwhile.
fn poll_round(
    fds: &mut [pollfd],
    timeout: c_int,
    end: Option<Instant>,
    spin_until: Instant,
    mask: Option<&libc::sigset_t>,
) -> Result<Option<usize>, c_int> {
    let mut accel: Vec<(usize, Arc<Conn>)> = Vec::new();
    for (i, p) in fds.iter().enumerate() {
        if let Some(c) = table::get(p.fd) {
            if c.is_kernel_only() {
                retire(Arc::as_ptr(&c));
            } else {
                accel.push((i, c));
            }
        }
    }
    if accel.is_empty() {
        let left = if timeout < 0 { -1 } else { ms_left(end) };
        return real::poll_masked(fds, left, mask).map(Some);
    }
    // The kernel's part: accelerated entries hidden (a negative fd is ignored), and one
    // entry per connection queue at the end (used only when sleeping).
    let mut kern: Vec<pollfd> = fds.to_vec();
    for (i, _) in &accel {
        kern[*i].fd = -1;
    }
    let has_kernel = kern.iter().any(|p| p.fd >= 0);
    loop {
        let mut n = 0;
        for (i, c) in &accel {
            let Some(ev) = poll_events(c, fds[*i].fd, fds[*i].events) else {
                retire(Arc::as_ptr(c));
                return Ok(None);
            };
            fds[*i].revents = ev;
            n += usize::from(ev != 0);
        }
        if has_kernel {
            for p in kern.iter_mut() {
                p.revents = 0;
            }
            real::poll_fds(&mut kern, 0)?;
            for (i, p) in kern.iter().enumerate() {
                if p.fd >= 0 {
                    fds[i].revents = p.revents;
                    n += usize::from(p.revents != 0);
                }
            }
        }
        if n > 0 || timeout == 0 {
            return Ok(Some(n));
        }
        if end.is_some_and(|d| Instant::now() >= d) {
            return Ok(Some(0));
        }
        if Instant::now() < spin_until {
            std::hint::spin_loop();
            continue;
        }
        // Sleep: arm, look again, then wait in the kernel with the queues.
        let mut ready = false;
        for (i, c) in &accel {
            let ev = fds[*i].events;
            let want_r = ev & (libc::POLLIN | libc::POLLRDNORM | libc::POLLRDHUP) != 0;
            let want_w = ev & (libc::POLLOUT | libc::POLLWRNORM) != 0;
            if !c.queue.arm() {
                // Events pending: take them and look again.
                c.drain();
                ready = true;
                continue;
            }
            ready |= !c.arm(want_r, want_w) || poll_events(c, fds[*i].fd, ev) != Some(0);
        }
        if ready {
            continue;
        }
        let mut sleep = kern.clone();
        sleep.extend(accel.iter().map(|(_, c)| pollfd { fd: queue_fd(c), events: libc::POLLIN, revents: 0 }));
        // (and the channels of claims not answered yet: `Conn::block` says why a number
        // closed meanwhile is harmless)
        sleep.extend(accel.iter().filter_map(|(_, c)| c.claim_fd()).map(|fd| pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        let slept = real::poll_masked(&mut sleep, ms_left(end), mask);
        for (_, c) in &accel {
            c.drain();
        }
        // A signal handler ran: the kernel's poll returns EINTR (it is never restarted).
        slept?;
    }
}

/// `select(2)` through [`poll`] when an accelerated descriptor is among the sets.
pub(crate) fn select(
    n: c_int,
    r: Option<&mut libc::fd_set>,
    w: Option<&mut libc::fd_set>,
    e: Option<&mut libc::fd_set>,
    timeout_ms: c_int,
    mask: Option<&libc::sigset_t>,
) -> Result<usize, c_int> {
    let n = n.clamp(0, libc::FD_SETSIZE as c_int);
    let isset = |s: &Option<&mut libc::fd_set>, fd: c_int| s.as_ref().is_some_and(|s| real::fd_isset(fd, s));
    let mut fds = Vec::new();
    for fd in 0..n {
        let mut events = 0i16;
        if isset(&r, fd) {
            events |= libc::POLLIN;
        }
        if isset(&w, fd) {
            events |= libc::POLLOUT;
        }
        if isset(&e, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            fds.push(pollfd { fd, events, revents: 0 });
        }
    }
    poll(&mut fds, timeout_ms, mask)?;
    let (mut r, mut w, mut e) = (r, w, e);
    for s in [&mut r, &mut w, &mut e].into_iter().flatten() {
        real::fd_zero(s);
    }
    let mut count = 0;
    for p in &fds {
        let bad = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
        if let Some(s) = r.as_deref_mut() {
            if p.events & libc::POLLIN != 0 && (p.revents & libc::POLLIN != 0 || bad) {
                real::fd_set(p.fd, s);
                count += 1;
            }
        }
        if let Some(s) = w.as_deref_mut() {
            if p.events & libc::POLLOUT != 0 && (p.revents & libc::POLLOUT != 0 || bad) {
                real::fd_set(p.fd, s);
                count += 1;
            }
        }
        if let Some(s) = e.as_deref_mut() {
            if p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0 {
                real::fd_set(p.fd, s);
                count += 1;
            }
        }
    }
    Ok(count)
}

/// An accelerated descriptor in an epoll set.
#[derive(Debug)]
struct Member {
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    /// What was last reported (edge-triggered: report again only when something moved).
    last: (u32, u64, u64),
    /// `EPOLLONESHOT` fired: nothing until `EPOLL_CTL_MOD`.
    disabled: bool,
    /// In the set's hot list.
    hot: bool,
    /// Since when a wait has found it quiet (None: ready at the last look, or just made
    /// hot). A quiet member is armed and made cold before a wait sleeps, or once it has
    /// been quiet for [`COOL_AFTER`]: not at the first quiet look, since an armed member's
    /// every change costs its peer a wake-up signal and the wait a drain, which a busy
    /// member, quiet only between requests, would pay on each.
    quiet_since: Option<Instant>,
    /// Bumped each time the member is made hot: a wait that armed it and found it quiet
    /// makes it cold only if nobody made it hot meanwhile (its queue's wake-up, taken by
    /// another thread, would be lost).
    woken: u64,
}

/// The accelerated members of one epoll set. A wait looks only at its **hot** members: new
/// or changed ones, those ready at the last look (level-triggered: until they are not), and
/// those whose queue woke the set. The others are **cold**: a wait found them quiet, armed
/// their tripwires and queue, and looked once more; whatever changes them posts to their
/// queue, whose descriptor wakes the set (the kernel's part), and the wait that takes that
/// wake-up makes them hot. A wait costs what is hot, not what the set holds: a server with
/// thousands of idle connections looks at the few that moved.
#[derive(Debug, Default)]
struct Set {
    members: FxHashMap<c_int, Member>,
    hot: Vec<c_int>,
    /// The members of each queue (by its descriptor: what a wake-up names).
    by_queue: FxHashMap<c_int, Vec<c_int>>,
}

impl Set {
    fn insert(&mut self, fd: c_int, m: Member) {
        self.by_queue.entry(queue_fd(&m.conn)).or_default().push(fd);
        self.members.insert(fd, m);
        self.make_hot(fd);
    }

    fn remove(&mut self, fd: c_int) -> Option<Member> {
        let m = self.members.remove(&fd)?;
        let q = queue_fd(&m.conn);
        if let Some(v) = self.by_queue.get_mut(&q) {
            v.retain(|x| *x != fd);
            if v.is_empty() {
                self.by_queue.remove(&q);
            }
        }
        if m.hot {
            self.hot.retain(|x| *x != fd);
        }
        Some(m)
    }

    fn make_hot(&mut self, fd: c_int) {
        if let Some(m) = self.members.get_mut(&fd) {
            m.woken = m.woken.wrapping_add(1);
            m.quiet_since = None;
            if !m.hot {
                m.hot = true;
                self.hot.push(fd);
            }
        }
    }

    /// Whether the set is small enough to look at all its members on every wait, as if all
    /// were hot, arming them only before a sleep ([`SMALL_SET`]).
    fn small(&self) -> bool {
        self.members.len() <= SMALL_SET
    }

    /// Members `cool` (each with the `woken` seen when it was armed) go cold, but those made
    /// hot since. (None in a small set: all its members are looked at anyway.)
    fn make_cold(&mut self, cool: &[(c_int, u64)]) {
        if self.small() {
            return;
        }
        let mut any = false;
        for (fd, woken) in cool {
            if let Some(m) = self.members.get_mut(fd) {
                if m.hot && m.woken == *woken {
                    m.hot = false;
                    m.quiet_since = None;
                    any = true;
                }
            }
        }
        if any {
            let members = &self.members;
            self.hot.retain(|fd| members.get(fd).is_some_and(|m| m.hot));
        }
    }
}

/// (Keyed by descriptor numbers: a fast hash, looked up on every wait.)
type Sets = FxHashMap<c_int, Set>;
/// The accelerated members of each epoll set. Never held across a call into clan (whose
/// engine thread waits in `epoll_wait` too: it must find out without this lock that its set
/// is not ours, [`is_mixed`]).
static SETS: LazyLock<Mutex<Sets>> = LazyLock::new(|| Mutex::new(FxHashMap::default()));

fn sets() -> std::sync::MutexGuard<'static, Sets> {
    SETS.lock().unwrap_or_else(|e| e.into_inner())
}

const MIXED_BITS: usize = 1 << 16;
/// Epoll sets (below 65 536) holding accelerated members; `MIXED_HIGH` counts those above.
static MIXED: [AtomicU64; MIXED_BITS / 64] = [const { AtomicU64::new(0) }; MIXED_BITS / 64];
static MIXED_HIGH: AtomicU64 = AtomicU64::new(0);

fn set_mixed(epfd: c_int, on: bool) {
    let i = epfd as usize;
    if i < MIXED_BITS {
        let bit = 1u64 << (i % 64);
        // Release: pairs with `is_mixed`'s Acquire (the members are in SETS before).
        if on {
            MIXED[i / 64].fetch_or(bit, Ordering::Release);
        } else {
            MIXED[i / 64].fetch_and(!bit, Ordering::Release);
        }
    } else if on {
        MIXED_HIGH.fetch_add(1, Ordering::Release);
    } else {
        MIXED_HIGH.fetch_sub(1, Ordering::Release);
    }
}

/// A member as seen at one moment: (fd, connection, events, data, last reported, disabled,
/// woken, quiet since).
type Snapshot = (c_int, Arc<Conn>, u32, u64, (u32, u64, u64), bool, u64, Option<Instant>);

/// Sets of at most this many members are looked at whole on every wait (the cost of the
/// cold members' wake-ups is not worth it: with every member of a 50-connection redis armed
/// whenever quiet, 0.55 signals per request against 0.20, and 16 % fewer requests/s).
const SMALL_SET: usize = 64;

/// How long a hot member may stay quiet before a wait that does not sleep arms it and makes
/// it cold ([`Member::quiet_since`]).
const COOL_AFTER: Duration = Duration::from_millis(2);

/// Snapshot of a set's hot members, taken under the lock, used without it.
fn hot_members(epfd: c_int) -> Vec<Snapshot> {
    let all = sets();
    let Some(s) = all.get(&epfd) else { return Vec::new() };
    let snap =
        |(fd, m): (c_int, &Member)| (fd, m.conn.clone(), m.events, m.data, m.last, m.disabled, m.woken, m.quiet_since);
    if s.small() {
        return s.members.iter().map(|(fd, m)| snap((*fd, m))).collect();
    }
    s.hot.iter().filter_map(|fd| s.members.get(fd).map(|m| (*fd, m))).map(snap).collect()
}

/// `epoll_ctl` on an accelerated descriptor `fd`: kept here, its queue in the kernel's set.
pub(crate) fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    conn: Arc<Conn>,
    ev: Option<(u32, u64)>,
) -> Result<(), c_int> {
    let mut all = sets();
    let set = all.entry(epfd).or_default();
    match op {
        libc::EPOLL_CTL_ADD => {
            if set.members.contains_key(&fd) {
                return Err(libc::EEXIST);
            }
            let (events, data) = ev.ok_or(libc::EFAULT)?;
            let qfd = queue_fd(&conn);
            match real::epoll_control(epfd, libc::EPOLL_CTL_ADD, qfd, libc::EPOLLIN as u32, TAG | qfd as u32 as u64) {
                Ok(()) | Err(libc::EEXIST) => {}
                Err(e) => return Err(e),
            }
            conn.epolled.store(true, Ordering::Relaxed);
            set.insert(
                fd,
                Member {
                    conn,
                    events,
                    data,
                    last: (0, 0, 0),
                    disabled: false,
                    hot: false,
                    quiet_since: None,
                    woken: 0,
                },
            );
            if !is_mixed(epfd) {
                set_mixed(epfd, true);
            }
            Ok(())
        }
        libc::EPOLL_CTL_MOD => {
            let m = set.members.get_mut(&fd).ok_or(libc::ENOENT)?;
            let (events, data) = ev.ok_or(libc::EFAULT)?;
            (m.events, m.data, m.last, m.disabled) = (events, data, (0, 0, 0), false);
            set.make_hot(fd);
            Ok(())
        }
        libc::EPOLL_CTL_DEL => {
            set.remove(fd).ok_or(libc::ENOENT)?;
            // The set stays marked as ours even when it has no accelerated member left: our
            // queue entries may still be in the kernel's set, and only our `epoll_wait` filters
            // them out. The queue stays in the kernel's set (programs remove and add again on every
            // change of interest), until a wake-up through it finds it no member's here
            // (`epoll_wait`), or the set closes.
            Ok(())
        }
        _ => Err(libc::EINVAL),
    }
}

/// `fd` was closed: it leaves every epoll set (as the kernel does when the last
/// descriptor of an open file closes), and if it was an epoll set, that set is forgotten.
pub(crate) fn forget(fd: c_int) {
    if !is_mixed(fd) && !table::is_marked(fd) {
        return;
    }
    let mut all = sets();
    if all.remove(&fd).is_some() {
        set_mixed(fd, false);
    }
    for set in all.values_mut() {
        set.remove(fd);
    }
}

/// (None: the connection is the kernel's socket now.)
fn epoll_bits(conn: &Conn, fd: c_int, events: u32) -> Option<(u32, u64, u64)> {
    let r = conn.state(fd)?;
    let mut b = 0u32;
    if r.readable {
        b |= libc::EPOLLIN as u32 | libc::EPOLLRDNORM as u32;
    }
    if r.writable {
        b |= libc::EPOLLOUT as u32 | libc::EPOLLWRNORM as u32;
    }
    if r.eof {
        b |= libc::EPOLLRDHUP as u32;
    }
    if r.error {
        b |= libc::EPOLLERR as u32 | libc::EPOLLHUP as u32;
    }
    let always = libc::EPOLLERR as u32 | libc::EPOLLHUP as u32;
    Some((b & (events | always), r.rx_landed, r.tx_freed))
}

/// Collect the ready hot members of `epfd` into `out` (at most `max`); the quiet ones are
/// armed, looked at once more, and go cold ([`Set`]).
fn collect(epfd: c_int, out: &mut Vec<epoll_event>, max: usize, to_sleep: bool) -> bool {
    // (whether every member looked at was armed and found quiet: a sleep then misses nothing)
    let mut all_armed = true;
    let mut report = Vec::new();
    let mut cool = Vec::new();
    let mut quiet = Vec::new();
    let mut gone = Vec::new();
    let at = Instant::now();
    for (fd, conn, events, data, last, disabled, woken, quiet_since) in hot_members(epfd) {
        if out.len() >= max {
            all_armed = false;
            break;
        }
        if disabled {
            cool.push((fd, woken));
            continue;
        }
        let Some(now) = epoll_bits(&conn, fd, events) else {
            all_armed = false;
            gone.push(conn);
            continue;
        };
        let et = events & libc::EPOLLET as u32 != 0;
        let oneshot = events & libc::EPOLLONESHOT as u32 != 0;
        let ready = now.0 != 0 && !(et && now == last);
        if ready {
            all_armed = false;
            out.push(epoll_event { events: now.0, u64: data });
            report.push((fd, now, oneshot));
            if oneshot {
                cool.push((fd, woken));
            }
            if oneshot || !et {
                // (level-triggered: looked at again next time, until it is not ready)
                continue;
            }
        }
        // Quiet (or edge-triggered and just reported): before a sleep, or quiet a while,
        // arm what it waits for, then look again; cold if nothing moved meanwhile.
        // (before a sleep that will not happen, one being ready, nothing is armed: an
        // armed member costs its peer a signal at its next change)
        let quiet_for = quiet_since.map_or(Duration::ZERO, |q| at.saturating_duration_since(q));
        if !(to_sleep && out.is_empty()) && quiet_for < COOL_AFTER {
            if quiet_since.is_none() {
                quiet.push(fd);
            }
            all_armed = false;
            continue;
        }
        // (a claim's answer to come: this set does not hold its channel, `answers.rs` does)
        if conn.awaiting() {
            crate::answers::watch(&conn);
        }
        if !conn.queue.arm() {
            conn.drain_quiet();
            all_armed = false;
            continue;
        }
        let want_r = events & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0;
        let want_w = events & libc::EPOLLOUT as u32 != 0;
        if !conn.arm(want_r, want_w) {
            all_armed = false;
            continue;
        }
        let Some(again) = epoll_bits(&conn, fd, events) else {
            all_armed = false;
            gone.push(conn);
            continue;
        };
        let moved = if ready { again != now } else { again.0 != 0 && !(et && again == last) };
        if moved {
            all_armed = false;
        } else {
            cool.push((fd, woken));
        }
    }
    for c in gone {
        retire(Arc::as_ptr(&c));
    }
    if !report.is_empty() || !cool.is_empty() || !quiet.is_empty() {
        let mut all = sets();
        if let Some(set) = all.get_mut(&epfd) {
            for (fd, now, oneshot) in report {
                if let Some(m) = set.members.get_mut(&fd) {
                    m.last = now;
                    m.disabled |= oneshot;
                    m.quiet_since = None;
                }
            }
            for fd in quiet {
                if let Some(m) = set.members.get_mut(&fd) {
                    m.quiet_since.get_or_insert(at);
                }
            }
            set.make_cold(&cool);
        }
    }
    all_armed
}

/// A wake-up of `conn`'s queue was taken outside an epoll wait (`poll`, a blocking read or
/// write): its members in every set are hot, so that their next wait looks at them.
pub(crate) fn touch(conn: &Conn) {
    let qfd = queue_fd(conn);
    let mut all = sets();
    for set in all.values_mut() {
        let Some(fds) = set.by_queue.get(&qfd).cloned() else { continue };
        for fd in fds {
            if set.members.get(&fd).is_some_and(|m| std::ptr::eq(Arc::as_ptr(&m.conn), conn)) {
                set.make_hot(fd);
            }
        }
    }
}

/// Whether every member of `epfd` is cold (armed: a sleep misses nothing).
fn all_cold(epfd: c_int) -> bool {
    sets().get(&epfd).is_none_or(|s| s.small() || s.hot.is_empty())
}

/// Whether `epfd` holds accelerated descriptors (no lock: the engine threads of clan itself
/// ask this on every wait of theirs).
pub(crate) fn is_mixed(epfd: c_int) -> bool {
    if epfd < 0 {
        return false;
    }
    let i = epfd as usize;
    if i < MIXED_BITS {
        // SYNC POINT: pairs with `set_mixed`'s Release.
        MIXED[i / 64].load(Ordering::Acquire) & (1u64 << (i % 64)) != 0
    } else {
        MIXED_HIGH.load(Ordering::Acquire) > 0
    }
}

/// `epoll_wait` on a set holding accelerated descriptors. The kernel's events go straight
/// into the caller's array (no buffer of ours: programs pass arrays of thousands).
pub(crate) fn epoll_wait(
    epfd: c_int,
    out: &mut [epoll_event],
    timeout: c_int,
    mask: Option<&libc::sigset_t>,
) -> Result<usize, c_int> {
    let max = out.len();
    let end = deadline(timeout);
    // (a set whose accelerated members are all gone — it stays marked until closed — has
    // nothing of ours to poll: the kernel's wait at once, as an unmarked set's. A server
    // whose clients' short connections stay with the kernel, `short.rs`, but for a probe
    // now and then, spun and called once more on every wait of its set.)
    let members = sets().get(&epfd).is_some_and(|s| !s.members.is_empty());
    let spin_until = if members { Instant::now() + spin() } else { Instant::now() };
    let mut got: Vec<epoll_event> = Vec::new();
    loop {
        got.clear();
        collect(epfd, &mut got, max, false);
        let mut sleep = got.is_empty() && Instant::now() >= spin_until && timeout != 0;
        let mut all_armed = false;
        if sleep {
            // (the quiet members armed, before the sleep: one may have moved meanwhile)
            all_armed = collect(epfd, &mut got, max, true);
            sleep = got.is_empty();
        }
        let collected = !got.is_empty();
        let armed = sleep && all_armed && all_cold(epfd);
        let wait = if armed { ms_left(end) } else { 0 };
        // Ours first (at the front), the kernel's after them.
        let room = max - got.len();
        // (the mask only for a sleep: a look without waiting runs with the caller's)
        let n = match real::epoll_wait_into(epfd, &mut out[got.len()..], wait, mask.filter(|_| wait != 0)) {
            Ok(n) => n.min(room),
            Err(libc::EINTR) if !got.is_empty() => 0,
            Err(e) => return Err(e),
        };
        // Drop our own (queue) entries from the kernel's, in place.
        let base = got.len();
        let mut kept = 0;
        let mut woke: Vec<c_int> = Vec::new();
        for i in 0..n {
            let ev = out[base + i];
            if ev.u64 & TAG_MASK == TAG {
                woke.push((ev.u64 & !TAG_MASK) as c_int);
            } else {
                out[base + kept] = ev;
                kept += 1;
            }
        }
        out[..base].copy_from_slice(&got);
        let mut total = base + kept;
        if !woke.is_empty() {
            woke.sort_unstable();
            woke.dedup();
            // The members of the queues that woke us are hot; each queue is drained once.
            // A queue no member of this set has now (its connection closed, or left the set,
            // and the queue perhaps serves another one elsewhere): nothing here drains it, and
            // a readable queue left in the set would wake every wait on it at once. It leaves.
            // (Under the sets' lock, which `epoll_ctl` holds while it adds a queue: a queue
            // that has just joined this set for a new member stays.)
            let mut drain = Vec::new();
            {
                let mut all = sets();
                match all.get_mut(&epfd) {
                    Some(set) => {
                        for qfd in &woke {
                            let fds = set.by_queue.get(qfd).cloned().unwrap_or_default();
                            if let Some(m) = fds.first().and_then(|fd| set.members.get(fd)) {
                                drain.push(m.conn.clone());
                            } else {
                                let _ = real::epoll_control(epfd, libc::EPOLL_CTL_DEL, *qfd, 0, 0);
                            }
                            for fd in fds {
                                set.make_hot(fd);
                            }
                        }
                    }
                    None => {
                        for qfd in &woke {
                            let _ = real::epoll_control(epfd, libc::EPOLL_CTL_DEL, *qfd, 0, 0);
                        }
                    }
                }
            }
            for c in drain {
                c.drain_quiet();
            }
            // (only if none was collected above: an event is reported once per call)
            if !collected && total < max {
                let mut more = Vec::new();
                collect(epfd, &mut more, max - total, false);
                out[total..total + more.len()].copy_from_slice(&more);
                total += more.len();
            }
        }
        if total > 0 || timeout == 0 || end.is_some_and(|d| Instant::now() >= d) {
            return Ok(total);
        }
        if !armed {
            std::hint::spin_loop();
        }
    }
}

/// The application's epoll sets (made through `epoll_create*`), so that a socket it added to
/// one before it was accelerated (a non-blocking `connect` registered first) can be moved to
/// our side of the set when it is.
static EPOLLS: Mutex<Vec<c_int>> = Mutex::new(Vec::new());
/// How many (`close` looks here first: no lock for a program without epoll sets).
static EPOLL_COUNT: AtomicU64 = AtomicU64::new(0);

pub(crate) fn note_epoll(epfd: c_int) {
    if epfd >= 0 {
        let mut e = EPOLLS.lock().unwrap_or_else(|e| e.into_inner());
        if !e.contains(&epfd) {
            e.push(epfd);
        }
        EPOLL_COUNT.store(e.len() as u64, Ordering::Release);
    }
}

pub(crate) fn forget_epoll(fd: c_int) {
    // Acquire: pairs with the Release in `note_epoll` (a set noted before is seen).
    if EPOLL_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut e = EPOLLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = e.iter().position(|x| *x == fd) {
        e.swap_remove(i);
        EPOLL_COUNT.store(e.len() as u64, Ordering::Release);
    }
}

/// Descriptors the application added to an epoll set while they were the kernel's (a bit
/// per descriptor below 65 536; above, one count for all): only for those does [`adopt`]
/// read the sets' `fdinfo`. Set by `epoll_ctl`, cleared by `close`.
static KERNEL_MEMBERS: [AtomicU64; MIXED_BITS / 64] = [const { AtomicU64::new(0) }; MIXED_BITS / 64];
static KERNEL_MEMBERS_HIGH: AtomicU64 = AtomicU64::new(0);

/// The application added `fd`, the kernel's, to an epoll set.
pub(crate) fn note_kernel_member(fd: c_int) {
    if fd < 0 {
        return;
    }
    let i = fd as usize;
    if i < MIXED_BITS {
        // Relaxed: `adopt` runs in the thread that connects `fd`, after the `epoll_ctl` that
        // added it (the application orders the two), or the bit does not matter.
        KERNEL_MEMBERS[i / 64].fetch_or(1u64 << (i % 64), Ordering::Relaxed);
    } else {
        KERNEL_MEMBERS_HIGH.fetch_add(1, Ordering::Relaxed);
    }
}

/// `fd` was closed.
pub(crate) fn forget_kernel_member(fd: c_int) {
    let i = fd as usize;
    if fd >= 0 && i < MIXED_BITS {
        KERNEL_MEMBERS[i / 64].fetch_and(!(1u64 << (i % 64)), Ordering::Relaxed);
    }
}

fn maybe_kernel_member(fd: c_int) -> bool {
    let i = fd as usize;
    if fd < 0 {
        false
    } else if i < MIXED_BITS {
        KERNEL_MEMBERS[i / 64].load(Ordering::Relaxed) & (1u64 << (i % 64)) != 0
    } else {
        KERNEL_MEMBERS_HIGH.load(Ordering::Relaxed) > 0
    }
}

/// `fd` was just accelerated: where the kernel's socket is already in an epoll set of the
/// application (`/proc/self/fdinfo` of each says so), take it out of the kernel's part and
/// keep it as an accelerated member with the same events and data. (Nothing to read for a
/// socket the application never added to a set: most connect first.)
pub(crate) fn adopt(fd: c_int, conn: &Arc<Conn>) {
    if !maybe_kernel_member(fd) {
        return;
    }
    let sets: Vec<c_int> = EPOLLS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for epfd in sets {
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else { continue };
        for line in info.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 6 || w[0] != "tfd:" || w[1].parse::<c_int>() != Ok(fd) {
                continue;
            }
            let (Ok(events), Ok(data)) = (u32::from_str_radix(w[3], 16), u64::from_str_radix(w[5], 16)) else {
                continue;
            };
            if real::epoll_control(epfd, libc::EPOLL_CTL_DEL, fd, 0, 0).is_ok() {
                let r = epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, conn.clone(), Some((events, data)));
                crate::say(format_args!(
                    "descriptor {fd} was in epoll set {epfd} before it was accelerated: moved ({r:?})"
                ));
            }
        }
    }
}
