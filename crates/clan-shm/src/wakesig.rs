//! The signal that wakes one thread out of a blocking socket receive.
//!
//! A thread asleep in `recv` on a socket with a receive timeout (`SO_RCVTIMEO`) returns
//! `EINTR` when a signal handler runs in it, even one installed with `SA_RESTART` (signal(7):
//! "input" socket calls with a timeout are never restarted). This module installs an empty
//! handler with `SA_RESTART` for one real-time signal, so that delivering it to such a
//! thread ends its `recv`, while every other call the thread makes restarts as if nothing
//! happened. `clan`'s queue leaders sleep so on a link's socket (`clan/src/wake.rs`).
//!
//! The signal is `SIGRTMAX - 3` unless `CLAN_WAKE_SIGNAL` names another real-time signal
//! (`0`: none, the sleepers use epoll). It is taken only if nobody handles it yet (its
//! disposition is the default one when first asked for): a program that uses it for itself
//! keeps it, and clan does without.

use std::io;
use std::sync::OnceLock;

/// The signal number, if it is installed (None: not available, or turned off).
static SIGNAL: OnceLock<Option<i32>> = OnceLock::new();

/// The wake signal, installed on first use; None if it cannot be (see the module's text).
pub fn signal() -> Option<i32> {
    *SIGNAL.get_or_init(install)
}

fn install() -> Option<i32> {
    let lo = libc::SIGRTMIN();
    let hi = libc::SIGRTMAX();
    let sig = match std::env::var("CLAN_WAKE_SIGNAL") {
        Ok(v) => v.trim().parse::<i32>().ok().filter(|s| (lo..=hi).contains(s))?,
        Err(_) => hi - 3,
    };
    // SAFETY: `sigaction` with a null new action only reads the current one into `old`, a
    // zeroed plain-data struct of the right type.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the pointers are valid for the call.
    if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
        return None;
    }
    if old.sa_sigaction != libc::SIG_DFL {
        // Somebody's own signal (or ignored on purpose): leave it to them.
        return None;
    }
    // SAFETY: a zeroed `sigaction` is a valid value; `sigemptyset` initialises its mask.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_wake as extern "C" fn(libc::c_int) as libc::sighandler_t;
    sa.sa_flags = libc::SA_RESTART;
    // SAFETY: `sa.sa_mask` is a valid `sigset_t` to initialise.
    unsafe { libc::sigemptyset(&mut sa.sa_mask) };
    // SAFETY: `sa` is fully initialised, its handler is async-signal-safe (it does nothing)
    // and lives for the whole program; the old action is not asked for.
    if unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) } != 0 {
        return None;
    }
    Some(sig)
}

/// The handler: nothing. Its running is what ends the receive.
extern "C" fn on_wake(_: libc::c_int) {}

/// The calling thread's kernel id (`gettid`), cached per thread.
pub fn tid() -> i32 {
    thread_local! {
        static TID: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
    }
    TID.with(|t| {
        if t.get() == 0 {
            t.set(rustix::thread::gettid().as_raw_nonzero().get());
        }
        t.get()
    })
}

/// Whether the calling thread has `sig` blocked (then the signal could not wake it).
pub fn blocked_here(sig: i32) -> bool {
    // SAFETY: a zeroed `sigset_t` is valid to be written by `pthread_sigmask`, which with a
    // null new set only reads the thread's mask into it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the pointers are valid for the call.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut set) } != 0 {
        return true;
    }
    // SAFETY: `set` was filled in by the call above.
    unsafe { libc::sigismember(&set, sig) == 1 }
}

/// Deliver `sig` to thread `tid` of this process. The caller makes sure `tid` is a live
/// thread of ours (a thread id is reused once its thread has ended).
pub fn interrupt(tid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: `tgkill` takes plain integers; aimed at our own process, it can reach only our
    // threads, and the signal's handler (installed by `signal`) does nothing.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, sig) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    #[test]
    fn the_signal_ends_a_receive_with_a_timeout_and_nothing_else() {
        let Some(sig) = signal() else {
            panic!("the wake signal could not be installed in the test process");
        };
        assert!(!blocked_here(sig));
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        rustix::net::sockopt::set_socket_timeout(
            &a,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(20)),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tx.send(tid()).unwrap();
            let start = Instant::now();
            let mut buf = [0u8; 8];
            let r = rustix::net::recv(a.as_fd(), &mut buf, rustix::net::RecvFlags::empty());
            (r.map(|(n, _)| n), start.elapsed())
        });
        let t_id = rx.recv().unwrap();
        // Signal until the receive ends (the first may land before the thread is in it).
        let mut sent = 0;
        while !t.is_finished() && sent < 2000 {
            interrupt(t_id, sig).unwrap();
            sent += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let (r, took) = t.join().unwrap();
        assert_eq!(r, Err(rustix::io::Errno::INTR), "the receive ends with EINTR");
        assert!(took < Duration::from_secs(15), "woken by the signal, not the timeout");
        // A restartable call in a thread the signal hits goes on (SA_RESTART).
        let (c, d) = std::os::unix::net::UnixStream::pair().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tx.send(tid()).unwrap();
            let mut buf = [0u8; 1];
            rustix::io::read(c.as_fd(), &mut buf)
        });
        let t_id = rx.recv().unwrap();
        for _ in 0..20 {
            interrupt(t_id, sig).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        rustix::io::write(d.as_fd(), b"x").unwrap();
        assert_eq!(t.join().unwrap(), Ok(1));
    }

    static THEIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    extern "C" fn theirs(_: libc::c_int) {
        THEIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A program that handles the signal itself keeps it: clan takes none (in a child
    /// process, whose first ask for the signal this is), and `CLAN_WAKE_SIGNAL=0` turns it off.
    #[test]
    fn a_signal_the_program_handles_is_left_to_it() {
        match std::env::var("CLAN_WAKESIG_CHILD").as_deref() {
            Ok("theirs") => {
                let sig = libc::SIGRTMAX() - 3;
                // SAFETY: a zeroed `sigaction` is valid; the handler only bumps an atomic.
                let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
                sa.sa_sigaction = theirs as extern "C" fn(libc::c_int) as libc::sighandler_t;
                // SAFETY: `sa` is initialised; the old action is not asked for.
                assert_eq!(unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) }, 0);
                assert_eq!(signal(), None, "the program's signal was taken");
                interrupt(tid(), sig).unwrap();
                assert_eq!(THEIRS.load(std::sync::atomic::Ordering::Relaxed), 1, "their handler ran");
                return;
            }
            Ok("off") => {
                assert_eq!(signal(), None);
                return;
            }
            Ok(_) => return,
            Err(_) => {}
        }
        for (mode, env) in [("theirs", None), ("off", Some("0")), ("off", Some("9"))] {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", "wakesig::tests::a_signal_the_program_handles_is_left_to_it", "--nocapture"]);
            cmd.env("CLAN_WAKESIG_CHILD", mode);
            match env {
                Some(v) => cmd.env("CLAN_WAKE_SIGNAL", v),
                None => cmd.env_remove("CLAN_WAKE_SIGNAL"),
            };
            let out = cmd.output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success() && text.contains("1 passed"), "{mode} {env:?}: {text}");
        }
    }
}
