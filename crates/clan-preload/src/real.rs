//! The functions we interpose, as the C library (or whatever is next in the lookup order)
//! defines them: found once with `dlsym(RTLD_NEXT, …)` and called for everything that is not
//! ours. Safe wrappers for the few the rest of the library needs.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_int, c_void, epoll_event, pollfd, size_t, sockaddr, socklen_t, ssize_t};

/// The address of `name` after us in the lookup order, cached in `slot`.
fn resolve(name: &CStr, slot: &AtomicUsize) -> usize {
    // Relaxed: the value is the same whoever stores it (dlsym is deterministic), and a
    // function pointer needs no ordering with other memory.
    let f = slot.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    // SAFETY: `name` is a NUL-terminated string; RTLD_NEXT is a valid pseudo-handle.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if p == 0 {
        // Nothing to call: the process cannot go on correctly (every libc has these).
        std::process::abort();
    }
    slot.store(p, Ordering::Relaxed);
    p
}

macro_rules! next {
    ($(fn $name:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {$(
        /// The next definition of this function (the C library's).
        ///
        /// # Safety
        /// As the C function: the caller passes what it requires.
        pub(crate) unsafe fn $name($($a: $t),*) -> $r {
            static SLOT: AtomicUsize = AtomicUsize::new(0);
            let name = concat!(stringify!($name), "\0");
            let p = resolve(CStr::from_bytes_with_nul(name.as_bytes()).unwrap_or(c"abort"), &SLOT);
            // SAFETY: `p` is the address of the C function of this name, whose signature is
            // the one declared here (the same as libc's prototype).
            let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute(p) };
            // SAFETY: forwarded from the caller.
            unsafe { f($($a),*) }
        }
    )*};
}

next! {
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t;
    fn poll(fds: *mut pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    fn ppoll(fds: *mut pollfd, n: libc::nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int;
    fn epoll_create(size: c_int) -> c_int;
    fn epoll_create1(flags: c_int) -> c_int;
    fn epoll_wait(epfd: c_int, evs: *mut epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(epfd: c_int, evs: *mut epoll_event, max: c_int, timeout: c_int, mask: *const libc::sigset_t) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(fd: c_int, to: c_int) -> c_int;
    fn dup3(fd: c_int, to: c_int, flags: c_int) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int;
    fn select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *mut libc::timeval) -> c_int;
    fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t;
    fn execve(path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int;
    fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int;
    fn execvpe(file: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn posix_spawn(pid: *mut libc::pid_t, path: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
    fn posix_spawnp(pid: *mut libc::pid_t, file: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
}

/// `poll` on `fds` (the kernel's, safe: the slice is valid for its length).
pub(crate) fn poll_fds(fds: &mut [pollfd], timeout: c_int) -> Result<usize, c_int> {
    // SAFETY: `fds` is a valid, writable array of `fds.len()` entries.
    let r = unsafe { poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if r < 0 { Err(errno()) } else { Ok(r as usize) }
}

/// `ppoll` with the signal mask `mask` while it waits (`poll` when None).
pub(crate) fn poll_masked(fds: &mut [pollfd], timeout: c_int, mask: Option<&libc::sigset_t>) -> Result<usize, c_int> {
    let Some(mask) = mask else { return poll_fds(fds, timeout) };
    let ts = (timeout >= 0).then(|| libc::timespec {
        tv_sec: (timeout / 1000) as libc::time_t,
        tv_nsec: ((timeout % 1000) * 1_000_000) as libc::c_long,
    });
    let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is a valid, writable array of `fds.len()` entries; `tsp` is null or
    // points at `ts`, alive for the call; `mask` is a valid signal set.
    let r = unsafe { ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tsp, mask) };
    if r < 0 { Err(errno()) } else { Ok(r as usize) }
}

/// `epoll_wait` into `evs` (the kernel's); `epoll_pwait` with `mask` while it waits.
pub(crate) fn epoll_wait_into(
    epfd: c_int,
    evs: &mut [epoll_event],
    timeout: c_int,
    mask: Option<&libc::sigset_t>,
) -> Result<usize, c_int> {
    if evs.is_empty() {
        return Ok(0);
    }
    let n = evs.len().min(c_int::MAX as usize) as c_int;
    // SAFETY: `evs` is a valid, writable array of `evs.len()` entries; `mask` a valid set.
    let r = unsafe {
        match mask {
            None => epoll_wait(epfd, evs.as_mut_ptr(), n, timeout),
            Some(m) => epoll_pwait(epfd, evs.as_mut_ptr(), n, timeout, m),
        }
    };
    if r < 0 { Err(errno()) } else { Ok(r as usize) }
}

/// `epoll_ctl` (the kernel's).
pub(crate) fn epoll_control(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> Result<(), c_int> {
    let mut ev = epoll_event { events, u64: data };
    // SAFETY: `ev` is a valid event for the duration of the call.
    let r = unsafe { epoll_ctl(epfd, op, fd, &mut ev) };
    if r < 0 { Err(errno()) } else { Ok(()) }
}

/// The calling thread's `errno`.
pub(crate) fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Set the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Raise `SIGPIPE` in the calling thread, as the kernel does on a write to a broken
/// connection without `MSG_NOSIGNAL`.
pub(crate) fn raise_sigpipe() {
    // SAFETY: `raise` has no memory-safety requirement.
    unsafe { libc::raise(libc::SIGPIPE) };
}

/// Run `f` on the descriptor number `fd` of the call in progress (the application passed it;
/// a descriptor closed meanwhile by another thread only makes the system calls fail).
pub(crate) fn with_fd<R>(fd: c_int, f: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> R) -> R {
    // SAFETY: `BorrowedFd` is a number for system calls; it is used only during this call,
    // and an fd that is not open makes them fail with EBADF, nothing worse.
    f(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}

/// `FD_ISSET` (`fd` below `FD_SETSIZE`: the caller bounds it).
pub(crate) fn fd_isset(fd: c_int, s: &libc::fd_set) -> bool {
    // SAFETY: `s` is a valid set and `fd` is within FD_SETSIZE.
    unsafe { libc::FD_ISSET(fd, s) }
}

/// `FD_SET`.
pub(crate) fn fd_set(fd: c_int, s: &mut libc::fd_set) {
    // SAFETY: as `fd_isset`.
    unsafe { libc::FD_SET(fd, s) }
}

/// `FD_ZERO`.
pub(crate) fn fd_zero(s: &mut libc::fd_set) {
    // SAFETY: `s` is a valid set.
    unsafe { libc::FD_ZERO(s) }
}

/// Whether a signal handler is installed without `SA_RESTART` (then a blocking call a signal
/// interrupts returns `EINTR`, as the kernel's would for that handler; we cannot tell which
/// signal came, so any such handler counts).
pub(crate) fn any_handler_without_restart() -> bool {
    (1..libc::SIGRTMAX()).any(|sig| {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            return false;
        }
        // SAFETY: reading a signal's disposition into a zeroed struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: `old` is valid for writing; a null new action only reads.
        let r = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
        r == 0
            && old.sa_sigaction != libc::SIG_DFL
            && old.sa_sigaction != libc::SIG_IGN
            && old.sa_flags & libc::SA_RESTART == 0
    })
}

/// `recv` on the kernel's socket into `buf` (safe: the slice is valid for its length).
pub(crate) fn recv_into(fd: c_int, buf: &mut [u8], flags: c_int) -> Result<usize, c_int> {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe { recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
    if n < 0 { Err(errno()) } else { Ok(n as usize) }
}

/// `send` on the kernel's socket from `buf`.
pub(crate) fn send_from(fd: c_int, buf: &[u8], flags: c_int) -> Result<usize, c_int> {
    // SAFETY: `buf` is valid for reads of its length.
    let n = unsafe { send(fd, buf.as_ptr().cast(), buf.len(), flags) };
    if n < 0 { Err(errno()) } else { Ok(n as usize) }
}

/// `shutdown` of the kernel's socket.
pub(crate) fn shutdown_fd(fd: c_int, how: c_int) -> Result<(), c_int> {
    // SAFETY: plain integers.
    if unsafe { shutdown(fd, how) } != 0 { Err(errno()) } else { Ok(()) }
}

/// Bytes the kernel's socket holds for reading (`FIONREAD`).
pub(crate) fn fionread(fd: c_int) -> usize {
    let mut n: c_int = 0;
    // SAFETY: FIONREAD writes one int, ours.
    let r = unsafe { ioctl(fd, libc::FIONREAD as libc::c_ulong, (&raw mut n) as usize) };
    if r == 0 { n.max(0) as usize } else { 0 }
}

/// Run `f` with every asynchronous signal blocked in this thread: the threads it starts
/// inherit that mask, so that the application's signals go to the application's threads
/// (a process-directed signal goes to any thread not blocking it: it must not be one of
/// ours, where the application's waits would not see it).
pub(crate) fn with_signals_blocked<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: sigset_t is plain data, filled by sigfillset before use; pthread_sigmask with
    // valid pointers.
    let old = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        for s in [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGTRAP] {
            libc::sigdelset(&mut all, s);
        }
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    };
    let r = f();
    // SAFETY: restoring the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    r
}
