//! Spare clan streams: a process that connects again and again to the same server has its
//! next connections' clan streams connected ahead, by threads of this library, while it
//! works on the current one.
//!
//! A claimed connection's stream used to be connected inside the program's `connect`, and
//! that was most of what `connect` cost (the stream's set-up is a round trip through both
//! processes' engines and the server's accepting thread). A spare stream is connected with a
//! random token of its own, exactly as a claim's stream is, and the server's runtime files it
//! under that token as it files every stream; the claim that takes the spare names its token,
//! and the server's `accept` takes it as it takes any claimed connection's stream. Nothing on
//! the server's side knows spares from streams that came a moment before their claim.
//!
//! Spares are made only for a server this process connected to on a kept claim channel (a
//! repeat). How many are kept for a server follows its demand: [`PER_SERVER`] at first,
//! doubled (up to [`MAX_PER_SERVER`]) each time a connection finds none ready while some are
//! being made, one fewer each time one expires unused ([`TTL`]); [`KEPT`] in all at most.
//!
//! One thread makes them, one after another; while spares wait to be made behind it, more
//! threads help ([`MAKERS`] in all at most), each ending once it has found nothing to do for
//! [`HELPER_IDLE`]. A stream's set-up is mostly waiting for the other side's threads to
//! wake, and a client that opens connections faster than one set-up at a time
//! (`redis-benchmark -k 0 -c 16`: sixteen at once from one thread) found the one thread
//! behind; but helpers kept for a client that connects one at a time cost it three context
//! switches a connection (the work went round them), so they help only with a backlog. (The server's
//! runtime drops the streams whose client closed them: `registry.rs::Runtime::attach`.) A
//! spare is used only while its stream is up and nothing came on it.

use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, EventQueue};
use clan_proto::stream::Stream;

use crate::registry::Runtime;

/// Spares kept for a server at first.
pub(crate) const PER_SERVER: usize = 2;
/// Spares kept for a server at most (its demand grown: connections that found none).
pub(crate) const MAX_PER_SERVER: usize = 16;
/// Spares kept in all at most.
pub(crate) const KEPT: usize = 32;
/// Threads making spares at once at most: the first, and helpers.
pub(crate) const MAKERS: usize = 4;
/// A helper that found nothing to do for this long ends.
pub(crate) const HELPER_IDLE: Duration = Duration::from_millis(100);
/// How long a spare is kept unused.
pub(crate) const TTL: Duration = Duration::from_secs(2);

/// A stream connected ahead to a server's runtime, with the token it brought.
pub(crate) struct Spare {
    pub server: EndpointAddr,
    pub token: u64,
    pub stream: (Stream, EventQueue),
    made: Instant,
}

#[derive(Default)]
struct State {
    ready: Vec<Spare>,
    /// Servers to make one more for (one entry per spare wanted).
    wanted: Vec<EndpointAddr>,
    /// Servers a maker is connecting a spare to now (one entry per spare).
    making: Vec<EndpointAddr>,
    /// Spares to keep, by server (absent: [`PER_SERVER`]).
    depth: Vec<(EndpointAddr, usize)>,
    /// Maker threads running (the first and its helpers), and helpers waiting for work.
    makers: usize,
    idle_helpers: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    ready: Vec::new(),
    wanted: Vec::new(),
    making: Vec::new(),
    depth: Vec::new(),
    makers: 0,
    idle_helpers: 0,
});
/// The first maker waits here (for any spare wanted), the helpers on [`HELPERS`] (for a
/// backlog only).
static FIRST: Condvar = Condvar::new();
static HELPERS: Condvar = Condvar::new();

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

impl State {
    fn depth(&self, server: EndpointAddr) -> usize {
        self.depth.iter().find(|(s, _)| *s == server).map_or(PER_SERVER, |(_, d)| *d)
    }

    /// Change the spares kept for `server` (within [`PER_SERVER`]..=[`MAX_PER_SERVER`]).
    fn set_depth(&mut self, server: EndpointAddr, f: impl FnOnce(usize) -> usize) {
        let (was, d) = (self.depth(server), f(self.depth(server)).clamp(PER_SERVER, MAX_PER_SERVER));
        if d != was {
            crate::say(format_args!("spares kept for {server}: {d}"));
        }
        match self.depth.iter_mut().find(|(s, _)| *s == server) {
            Some(e) => e.1 = d,
            None if d != PER_SERVER => {
                // (a bounded list: the oldest server forgotten first)
                if self.depth.len() >= KEPT {
                    self.depth.remove(0);
                }
                self.depth.push((server, d));
            }
            None => {}
        }
    }

    /// Drop the spares kept past [`TTL`]: each is one fewer to keep for its server.
    fn expire(&mut self, now: Instant) {
        let mut gone = Vec::new();
        self.ready.retain(|s| {
            let keep = now.duration_since(s.made) < TTL;
            if !keep {
                gone.push(s.server);
            }
            keep
        });
        for server in gone {
            self.set_depth(server, |d| d - 1);
        }
    }

    /// Whether spares wait to be made behind the one the first maker will take.
    fn backlog(&self) -> bool {
        self.wanted.len() >= 2
    }
}

/// Whether a spare's stream can still carry a connection: up, and nothing came on it.
fn fresh(s: &Spare, now: Instant) -> bool {
    if now.duration_since(s.made) >= TTL {
        return false;
    }
    let r = s.stream.0.readiness();
    !(r.error || r.eof || r.readable)
}

/// A spare stream to `server`, if one is ready (others are asked for in its place; when
/// none was but some were being made, the server's spares kept are doubled).
pub(crate) fn take(rt: &Arc<Runtime>, server: EndpointAddr) -> Option<Spare> {
    let now = Instant::now();
    let mut st = lock();
    let mut found = None;
    // (the stale ones for that server go on the way)
    while let Some(i) = st.ready.iter().position(|s| s.server == server) {
        let s = st.ready.swap_remove(i);
        if fresh(&s, now) {
            found = Some(s);
            break;
        }
    }
    // (none ready while some were on their way: this client outpaces its spares)
    if found.is_none() && (st.wanted.contains(&server) || st.making.contains(&server)) {
        st.set_depth(server, |d| d * 2);
    }
    want_locked(&mut st, rt, server);
    found
}

/// Have spares ready for the next connections to `server`.
pub(crate) fn want(rt: &Arc<Runtime>, server: EndpointAddr) {
    want_locked(&mut lock(), rt, server);
}

fn want_locked(st: &mut State, rt: &Arc<Runtime>, server: EndpointAddr) {
    let mine = |v: &[EndpointAddr]| v.iter().filter(|w| **w == server).count();
    let mut have = st.ready.iter().filter(|s| s.server == server).count() + mine(&st.wanted) + mine(&st.making);
    let depth = st.depth(server);
    let mut asked = false;
    while have < depth && st.ready.len() + st.wanted.len() + st.making.len() < KEPT {
        st.wanted.push(server);
        have += 1;
        asked = true;
    }
    if !asked {
        return;
    }
    // (the first maker; then a helper, while a backlog finds none waiting)
    while st.makers == 0 || (st.makers < MAKERS && st.backlog() && st.idle_helpers == 0) {
        let weak = Arc::downgrade(rt);
        let first = st.makers == 0;
        let spawned = crate::real::with_signals_blocked(|| {
            std::thread::Builder::new().name("clan-run-spares".into()).spawn(move || make(weak, first))
        });
        if spawned.is_err() {
            break;
        }
        st.makers += 1;
        if !first {
            st.idle_helpers += 1;
            crate::say(format_args!("spares: a helper joins ({} making)", st.makers));
        }
    }
    if st.makers == 0 {
        st.wanted.clear();
        return;
    }
    FIRST.notify_one();
    if st.backlog() {
        HELPERS.notify_all();
    }
}

/// A maker thread: connects the spares wanted. The `first` takes any, and drops those kept
/// too long; a helper takes them only from a backlog, and ends once idle for [`HELPER_IDLE`].
fn make(rt: Weak<Runtime>, first: bool) {
    // (to ask whether a spare's descriptors have room in clan's share: `fd_room`)
    let probe = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()
    .map(clan_shm::fdfloor::lift);
    let mut idle_since = Instant::now();
    loop {
        let server = {
            let mut st = lock();
            loop {
                let now = Instant::now();
                st.expire(now);
                if first || st.backlog() {
                    if let Some(s) = st.wanted.pop() {
                        if !first {
                            st.idle_helpers -= 1;
                        }
                        st.making.push(s);
                        break s;
                    }
                }
                if first {
                    // (nothing kept: asleep until wanted; else until the first kept expires)
                    let next = st.ready.iter().map(|s| (s.made + TTL).saturating_duration_since(now)).min();
                    st = match next {
                        None => FIRST.wait(st).unwrap_or_else(|e| e.into_inner()),
                        Some(wait) => {
                            FIRST
                                .wait_timeout(st, wait.max(Duration::from_millis(10)))
                                .unwrap_or_else(|e| e.into_inner())
                                .0
                        }
                    };
                } else {
                    let left = HELPER_IDLE.saturating_sub(idle_since.elapsed());
                    if left.is_zero() {
                        st.makers -= 1;
                        st.idle_helpers -= 1;
                        return;
                    }
                    st = HELPERS.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        };
        let made = rt.upgrade().map(|r| {
            // (few descriptors left: connections make their own streams, or stay with the kernel)
            if !probe.as_ref().is_some_and(|p| crate::registry::fd_room(p.as_fd())) {
                return None;
            }
            let token = crate::registry::random_token();
            crate::registry::connect_stream(&r, server, token).map(|stream| (token, stream))
        });
        let mut st = lock();
        if let Some(i) = st.making.iter().position(|s| *s == server) {
            st.making.swap_remove(i);
        }
        let Some(made) = made else {
            // (the runtime gone: this maker ends)
            st.makers -= 1;
            return;
        };
        if !first {
            st.idle_helpers += 1;
            idle_since = Instant::now();
        }
        if let Some((token, stream)) = made {
            if st.ready.len() < KEPT {
                st.ready.push(Spare { server, token, stream, made: Instant::now() });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clan::NicAddr;

    /// A server's spares kept start at [`PER_SERVER`], double up to [`MAX_PER_SERVER`], fall
    /// one at a time back to [`PER_SERVER`] and no lower; the list of servers stays bounded.
    #[test]
    fn spares_kept_follow_demand_within_bounds() {
        let mut st = State::default();
        let a = EndpointAddr::new(NicAddr::localhost(7000), 1);
        assert_eq!(st.depth(a), PER_SERVER);
        let mut seen = Vec::new();
        for _ in 0..6 {
            st.set_depth(a, |d| d * 2);
            seen.push(st.depth(a));
        }
        assert_eq!(seen, [4, 8, 16, 16, 16, 16]);
        for _ in 0..20 {
            st.set_depth(a, |d| d - 1);
        }
        assert_eq!(st.depth(a), PER_SERVER);
        for p in 0..(KEPT as u32 + 10) {
            st.set_depth(EndpointAddr::new(NicAddr::localhost(7001), p), |d| d * 2);
        }
        assert_eq!(st.depth.len(), KEPT, "a bounded list of servers");
        assert_eq!(st.depth(EndpointAddr::new(NicAddr::localhost(7001), KEPT as u32 + 9)), 2 * PER_SERVER);
        assert_eq!(st.depth(EndpointAddr::new(NicAddr::localhost(7001), 0)), PER_SERVER, "the oldest forgotten");
    }

    /// Helpers take work only from a backlog: one spare wanted is the first maker's.
    #[test]
    fn one_spare_wanted_is_no_backlog() {
        let mut st = State::default();
        let a = EndpointAddr::new(NicAddr::localhost(7000), 1);
        st.wanted.push(a);
        assert!(!st.backlog());
        st.wanted.push(a);
        assert!(st.backlog());
    }
}
