//! The thread that reads the claims' answers nobody waits for in a call.
//!
//! A connection whose claim's answer had not come when `connect` returned awaits it
//! (`registry.rs::Unanswered`, [`Conn::awaiting`]): nothing is readable or writable on it
//! until then. A thread blocked on the connection sleeps on the answer's channel itself
//! (`Conn::block`), and so does a `poll` (`ready.rs`); but a program that waits in `epoll`
//! sleeps on its set, where the channel is not. This thread sleeps on every such channel and,
//! when an answer comes, reads it ([`Conn::settle_claim`]), which wakes the connection's
//! waiters through its queue (whose descriptor is in their sets). A connection is watched
//! only once an epoll wait is about to sleep with it awaiting (`ready.rs`): most answers
//! are read by the program's next call, and waking this thread for each connection cost a
//! context switch per connection.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::conn::Conn;

/// Connections awaiting their claim's answer (those answered meanwhile leave at the next
/// pass).
static WATCHED: Mutex<Vec<Weak<Conn>>> = Mutex::new(Vec::new());
/// Wakes the thread when one is added (None: the thread could not start; the connections'
/// own calls read their answers).
static WAKE: OnceLock<Option<OwnedFd>> = OnceLock::new();

fn lock() -> std::sync::MutexGuard<'static, Vec<Weak<Conn>>> {
    WATCHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read `c`'s claim's answer when it comes.
pub(crate) fn watch(c: &Arc<Conn>) {
    let wake = WAKE.get_or_init(|| {
        let ev =
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)
                .ok()
                .map(clan_shm::fdfloor::lift)?;
        let theirs = ev.try_clone().ok()?;
        crate::real::with_signals_blocked(|| {
            std::thread::Builder::new().name("clan-run-answers".into()).spawn(move || run(theirs))
        })
        .ok()?;
        Some(ev)
    });
    let Some(wake) = wake else { return };
    // (once: an epoll wait asks on each sleep while the answer has not come)
    if c.watched.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    lock().push(Arc::downgrade(c));
    let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
}

fn run(wake: OwnedFd) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        // The channels of those still awaiting (the connections themselves are not held
        // while asleep: one the program closes meanwhile goes, and its channel with it; the
        // number, if reused, only wakes this early).
        let waiting: Vec<Arc<Conn>> = {
            let mut w = lock();
            w.retain(|c| c.upgrade().is_some_and(|c| c.awaiting()));
            w.iter().filter_map(Weak::upgrade).collect()
        };
        fds.clear();
        fds.push(libc::pollfd { fd: wake.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 });
        fds.extend(waiting.iter().map(|c| libc::pollfd {
            fd: c.claim_fd().unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        }));
        drop(waiting);
        // (a second at most while it watches: a pass also drops the entries of connections
        // gone; watching none, until one is added, which writes `wake`)
        let timeout = if fds.len() == 1 { -1 } else { 1000 };
        let _ = crate::real::poll_fds(&mut fds, timeout);
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&wake, &mut b);
        let ready = fds.iter().skip(1).any(|p| p.revents != 0);
        if ready {
            let waiting: Vec<Arc<Conn>> = lock().iter().filter_map(Weak::upgrade).collect();
            for c in waiting {
                c.settle_claim(true);
            }
        }
    }
}
