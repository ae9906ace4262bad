//! Spare clan streams: a process that connects again and again to the same server has its
//! next connection's clan stream connected ahead, by a thread of this library, while it
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
//! repeat), at most [`PER_SERVER`] each and [`KEPT`] in all, and dropped after [`TTL`]
//! unused (the server's runtime drops the streams whose client closed them:
//! `registry.rs::Runtime::attach`). A spare is used only while its stream is up and nothing
//! came on it.

use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, EventQueue};
use clan_proto::stream::Stream;

use crate::registry::Runtime;

/// Spares kept for one server at most.
pub(crate) const PER_SERVER: usize = 2;
/// Spares kept in all at most.
pub(crate) const KEPT: usize = 8;
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
    /// The maker thread runs.
    maker: bool,
}

static STATE: Mutex<State> = Mutex::new(State { ready: Vec::new(), wanted: Vec::new(), maker: false });
static CV: Condvar = Condvar::new();

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a spare's stream can still carry a connection: up, and nothing came on it.
fn fresh(s: &Spare, now: Instant) -> bool {
    if now.duration_since(s.made) >= TTL {
        return false;
    }
    let r = s.stream.0.readiness();
    !(r.error || r.eof || r.readable)
}

/// A spare stream to `server`, if one is ready (another is asked for in its place).
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
    want_locked(&mut st, rt, server);
    found
}

/// Have a spare ready for the next connection to `server`.
pub(crate) fn want(rt: &Arc<Runtime>, server: EndpointAddr) {
    want_locked(&mut lock(), rt, server);
}

fn want_locked(st: &mut State, rt: &Arc<Runtime>, server: EndpointAddr) {
    let have =
        st.ready.iter().filter(|s| s.server == server).count() + st.wanted.iter().filter(|w| **w == server).count();
    if have >= PER_SERVER || st.ready.len() + st.wanted.len() >= KEPT {
        return;
    }
    st.wanted.push(server);
    if !st.maker {
        let weak = Arc::downgrade(rt);
        let spawned = crate::real::with_signals_blocked(|| {
            std::thread::Builder::new().name("clan-run-spares".into()).spawn(move || make(weak))
        });
        st.maker = spawned.is_ok();
        if !st.maker {
            st.wanted.clear();
        }
    }
    CV.notify_one();
}

/// The maker thread: connects the spares wanted, and drops those kept too long.
fn make(rt: Weak<Runtime>) {
    // (to ask whether a spare's descriptors have room in clan's share: `fd_room`)
    let probe = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()
    .map(clan_shm::fdfloor::lift);
    loop {
        let server = {
            let mut st = lock();
            loop {
                let now = Instant::now();
                st.ready.retain(|s| now.duration_since(s.made) < TTL);
                if let Some(s) = st.wanted.pop() {
                    break s;
                }
                // (nothing kept: asleep until wanted; else until the first kept expires)
                st = match st.ready.iter().map(|s| (s.made + TTL).saturating_duration_since(now)).min() {
                    None => CV.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some(wait) => {
                        CV.wait_timeout(st, wait.max(Duration::from_millis(10))).unwrap_or_else(|e| e.into_inner()).0
                    }
                };
            }
        };
        let Some(r) = rt.upgrade() else {
            lock().maker = false;
            return;
        };
        if !probe.as_ref().is_some_and(|p| crate::registry::fd_room(p.as_fd())) {
            // (few descriptors left: connections make their own streams, or stay with the kernel)
            continue;
        }
        let token = crate::registry::random_token();
        if let Some(stream) = crate::registry::connect_stream(&r, server, token) {
            let mut st = lock();
            if st.ready.len() < KEPT {
                st.ready.push(Spare { server, token, stream, made: Instant::now() });
            }
        }
    }
}
