//! Accelerated connections and other processes: `fork`, `exec`, `posix_spawn` and
//! descriptors passed with `SCM_RIGHTS`.
//!
//! A connection's clan state lives in this process (its engine thread, its mappings'
//! bookkeeping), which a child does not get (threads do not survive `fork`) and a new image
//! loses (`exec`). So a connection another process may use goes over to the kernel's TCP
//! socket under it ([`Conn::hand_over`]; the peer takes it over at its next look), and
//! only then:
//! - **`fork`**: nothing happens at the fork itself (a child that never touches the
//!   connection, such as redis's background save, leaves it accelerated). The connections
//!   are marked shared; the first time the child touches one, it asks the parent, over a
//!   socket pair made at the fork and served by a thread of the parent, to hand it over,
//!   and uses the kernel's socket once it has. The parent hands a shared connection over
//!   when it closes it (the usual fork-after-accept server), instead of ending it.
//! - **`exec`** and **`posix_spawn`**: every connection whose descriptor survives the
//!   `exec` is handed over first; before an `exec`, for at most a second, until the peer has
//!   taken back what it needed from our memory (the image that owns it is going).
//! - **`SCM_RIGHTS`**: a passed connection is handed over before it goes.
//!
//! A connection handed over keeps its clan side until the peer has taken back the bytes it
//! wrote that were never read here (the "graveyard", swept on later calls).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::c_int;

use crate::conn::Conn;
use crate::{ready, table};

/// Connections handed over whose peer has not yet taken back what it needed.
static GRAVEYARD: Mutex<Vec<Arc<Conn>>> = Mutex::new(Vec::new());
static BURIED: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn bury(c: Arc<Conn>) {
    let mut g = GRAVEYARD.lock().unwrap_or_else(|e| e.into_inner());
    g.push(c);
    BURIED.store(g.len(), Ordering::Relaxed);
}

/// Let go of the connections whose peer has taken back what it needed (cheap when none).
pub(crate) fn sweep() {
    if BURIED.load(Ordering::Relaxed) == 0 {
        return;
    }
    let done: Vec<Arc<Conn>> = {
        let Ok(mut g) = GRAVEYARD.try_lock() else { return };
        let (done, keep): (Vec<_>, Vec<_>) = g.drain(..).partition(|c| c.taken());
        *g = keep;
        BURIED.store(g.len(), Ordering::Relaxed);
        done
    };
    drop(done);
}

/// Hand the connection `c` of descriptor `fd` over to the kernel, here, for `why`.
pub(crate) fn hand_over(fd: c_int, c: &Arc<Conn>, why: &str) {
    if c.hand_over(fd, why) {
        bury(c.clone());
    }
    ready::retire(Arc::as_ptr(c));
    sweep();
}

/// Hand over every connection whose descriptor is not closed by `exec`; with `wait`, wait
/// (a second at most) until their peers have taken back what they need from our memory.
pub(crate) fn before_exec(why: &str, wait: bool) {
    if table::forked() {
        for fd in table::inherited_fds() {
            if !cloexec(fd) {
                inherited(fd);
            }
        }
        // A listening socket going on into the new image: it could accept claimed
        // connections it knows nothing of, so the parent must not take claims again.
        if crate::registry::inherited_listeners().into_iter().any(|fd| !cloexec(fd)) {
            ask_parent(&PIN.to_ne_bytes(), -1);
        }
        return;
    }
    let mut kept = Vec::new();
    for (fd, c) in table::snapshot() {
        if !cloexec(fd) && !c.is_kernel_only() {
            if c.hand_over(fd, why) {
                kept.push(c.clone());
            }
            ready::retire(Arc::as_ptr(&c));
        }
    }
    if wait {
        let limit = Instant::now() + Duration::from_secs(1);
        while Instant::now() < limit && !kept.iter().all(|c| c.taken()) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    for c in kept {
        bury(c);
    }
}

fn cloexec(fd: c_int) -> bool {
    crate::real::with_fd(fd, |b| rustix::io::fcntl_getfd(b).is_ok_and(|f| f.contains(rustix::io::FdFlags::CLOEXEC)))
}

// ---- fork -----------------------------------------------------------------------------------

/// The socket pair made in `before_fork`: (parent's end, child's end).
static PAIR: Mutex<Option<(OwnedFd, OwnedFd)>> = Mutex::new(None);
/// In a child: its end of the pair to the parent that had the connections (-1: none).
static TO_PARENT: AtomicI32 = AtomicI32::new(-1);
/// In a child: a request to the parent is under way (one at a time).
static ASKING: AtomicBool = AtomicBool::new(false);

/// `pthread_atfork` prepare: if connections are accelerated, mark them shared and make the
/// pair the child will ask the parent through.
pub(crate) extern "C" fn before_fork() {
    if table::forked() {
        return;
    }
    let conns = table::snapshot();
    if conns.is_empty() && !crate::registry::active() {
        return;
    }
    for (_, c) in &conns {
        c.shared.store(true, Ordering::Release);
    }
    let pair = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    );
    if let Ok(p) = pair {
        *PAIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    }
    drop(conns);
}

/// Forks whose children (or their children) still hold their end of the pair.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// `pthread_atfork` parent: serve the child's requests (a thread, until the child and its
/// own children have all closed their end: exited, or exec'ed). When the last such fork is
/// done, the listeners take claims again.
pub(crate) extern "C" fn after_fork_parent() {
    let Some((mine, theirs)) = PAIR.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
    drop(theirs);
    LIVE.fetch_add(1, Ordering::AcqRel);
    let spawned = crate::real::with_signals_blocked(|| {
        std::thread::Builder::new().name("clan-run-fork".into()).spawn(move || {
            serve(mine);
            // AcqRel: the last one out sees every other's decrement.
            if LIVE.fetch_sub(1, Ordering::AcqRel) == 1 {
                crate::registry::resume_claims();
            }
        })
    });
    if let Err(e) = spawned {
        crate::say(format_args!("no thread to serve a child's requests ({e}): its shared connections stay here"));
    }
}

/// `pthread_atfork` child (async-signal-safe: stores, and a close).
pub(crate) extern "C" fn after_fork_child() {
    table::FORKED.store(true, Ordering::Relaxed);
    ASKING.store(false, Ordering::Relaxed);
    // The pair is taken without the lock (a thread of the parent may have held it; it did
    // not come along), as raw numbers: the mutex's content is ours alone now.
    if let Ok(mut g) = PAIR.try_lock() {
        if let Some((mine, theirs)) = g.take() {
            TO_PARENT.store(std::os::fd::IntoRawFd::into_raw_fd(theirs), Ordering::Relaxed);
            drop(mine);
        }
    }
}

/// A request: the connection's identity in the parent (its address, the same in the child),
/// 8 bytes; or [`CLAIMED`] and the token of a claimed connection a child accepted, 16.
fn serve(sock: OwnedFd) {
    let mut buf = [0u8; 16];
    loop {
        let n = match rustix::net::recv(&sock, &mut buf, rustix::net::RecvFlags::empty()) {
            Ok((n @ (8 | 16), _)) => n,
            Ok(_) => return,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        };
        let first = u64::from_ne_bytes(buf[..8].try_into().unwrap_or_default());
        if n == 8 && first == PIN {
            crate::registry::pin_stop();
            let _ = rustix::net::send(&sock, &[1], rustix::net::SendFlags::NOSIGNAL);
            continue;
        }
        if n == 16 && first == CLAIMED {
            crate::registry::hand_over_claimed(u64::from_ne_bytes(buf[8..].try_into().unwrap_or_default()));
            let _ = rustix::net::send(&sock, &[1], rustix::net::SendFlags::NOSIGNAL);
            continue;
        }
        let id = first as usize;
        let found = table::snapshot().into_iter().find(|(_, c)| Arc::as_ptr(c) as usize == id);
        if let Some((fd, c)) = found {
            hand_over(fd, &c, "a child after fork uses it");
        }
        // (not found: closed here, so handed over already, or never accelerated)
        let _ = rustix::net::send(&sock, &[1], rustix::net::SendFlags::NOSIGNAL);
    }
}

/// The first word of a request about a claimed connection (never a connection's address).
const CLAIMED: u64 = u64::MAX;
/// A request saying a listener survives the child's `exec` (never a connection's address).
const PIN: u64 = u64::MAX - 1;

/// In a child: `fd` was accelerated in the parent when it forked. Ask the parent to hand it
/// over (waiting for its answer, a few seconds at most), then it is the kernel's here.
pub(crate) fn inherited(fd: c_int) {
    let Some(id) = table::take_inherited(fd) else { return };
    ask_parent(&(id as u64).to_ne_bytes(), fd);
}

/// In a child: `fd`, accepted here, was claimed by a clan-run client whose stream went to
/// the parent: have the parent hand it over, so that its bytes come over the kernel.
pub(crate) fn accepted_claimed(lfd: c_int, fd: c_int) {
    let Some(token) = crate::registry::claimed_token(lfd, fd) else { return };
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&CLAIMED.to_ne_bytes());
    m[8..].copy_from_slice(&token.to_ne_bytes());
    ask_parent(&m, fd);
}

fn ask_parent(request: &[u8], fd: c_int) {
    let to = TO_PARENT.load(Ordering::Relaxed);
    if to < 0 {
        return;
    }
    // One request at a time (a bounded spin: a thread holding it cannot stall us forever).
    let start = Instant::now();
    while ASKING.swap(true, Ordering::Acquire) {
        if start.elapsed() > Duration::from_secs(5) {
            return;
        }
        std::thread::yield_now();
    }
    let ok = crate::real::with_fd(to, |s| rustix::net::send(s, request, rustix::net::SendFlags::NOSIGNAL).is_ok());
    if ok {
        let mut p = [libc::pollfd { fd: to, events: libc::POLLIN, revents: 0 }];
        if crate::real::poll_fds(&mut p, 5000).is_ok_and(|n| n > 0) {
            crate::real::with_fd(to, |s| {
                let _ = rustix::net::recv(s, &mut [0u8; 1], rustix::net::RecvFlags::empty());
            });
        } else {
            crate::say(format_args!("the parent did not hand descriptor {fd} over in time"));
        }
    }
    // Release: pairs with the Acquire swap above.
    ASKING.store(false, Ordering::Release);
}
