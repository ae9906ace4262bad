//! The interposed C functions. Each one turns its raw arguments into safe values and calls
//! the library, or the C library's own definition for everything that is not an accelerated
//! connection (`crate::real`). A descriptor that is not ours costs one atomic load.
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::Arc;

use libc::{c_int, c_void, epoll_event, pollfd, size_t, sockaddr, socklen_t, ssize_t};

use crate::conn::Flags;
use crate::real::{self, set_errno};
use crate::{fork, ready, registry, table};

thread_local! {
    /// Inside the library's own work: nested calls are the C library's.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

struct Inside;

impl Inside {
    fn enter() -> Option<Inside> {
        INSIDE.with(|i| if i.replace(true) { None } else { Some(Inside) })
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|i| i.set(false));
    }
}

fn ret(r: Result<usize, c_int>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

fn ret0(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// A socket address the application passed.
unsafe fn sockaddr_of(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller passed `len` readable bytes at `addr`; the family is read first.
    let family = unsafe { (*addr).sa_family } as c_int;
    match family {
        libc::AF_INET if len as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: long enough for a sockaddr_in; read unaligned (any alignment).
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for a sockaddr_in6.
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn nonblocking(fd: c_int) -> bool {
    real::with_fd(fd, |b| rustix::fs::fcntl_getfl(b).is_ok_and(|f| f.contains(rustix::fs::OFlags::NONBLOCK)))
}

/// Wait (in the kernel) for a non-blocking `connect` in progress; its result.
fn finish_connect(fd: c_int) -> Result<(), c_int> {
    let mut p = [pollfd { fd, events: libc::POLLOUT, revents: 0 }];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match real::poll_fds(&mut p, 100) {
            Ok(1) => break,
            Ok(_) | Err(libc::EINTR) if std::time::Instant::now() < deadline => continue,
            Ok(_) => return Err(libc::ETIMEDOUT),
            Err(e) => return Err(e),
        }
    }
    real::with_fd(fd, |b| match rustix::net::sockopt::socket_error(b) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.raw_os_error()),
        Err(e) => Err(e.raw_os_error()),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the application's address and length.
    let dest = unsafe { sockaddr_of(addr, len) };
    let claim = dest.filter(|_| !table::forked()).and_then(|d| {
        let inside = Inside::enter()?;
        Some((registry::claim_before_connect(fd, d)?, d, inside))
    });
    let Some((claim, dest, _inside)) = claim else {
        // SAFETY: forwarded.
        return unsafe { real::connect(fd, addr, len) };
    };
    let nb = nonblocking(fd);
    // SAFETY: forwarded.
    if unsafe { real::connect(fd, addr, len) } != 0 {
        let e = real::errno();
        let done = if e == libc::EINPROGRESS { finish_connect(fd) } else { Err(e) };
        if let Err(e) = done {
            claim.withdraw();
            set_errno(e);
            return -1;
        }
    }
    match claim.attach(fd, dest, nb) {
        Some(c) => {
            let c = Arc::new(c);
            table::insert(fd, c.clone());
            crate::say(format_args!("connection to {dest} over clan"));
            ready::adopt(fd, &c);
        }
        None => crate::say(format_args!("connection to {dest} left to the kernel (the clan stream failed)")),
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarded.
    let r = unsafe { real::listen(fd, backlog) };
    if r == 0 && !table::forked() {
        if let Some(_inside) = Inside::enter() {
            registry::on_listen(fd);
        }
    }
    r
}

fn on_accepted(lfd: c_int, fd: c_int, flags: c_int) -> c_int {
    if fd >= 0 && table::forked() {
        if let Some(_inside) = Inside::enter() {
            fork::accepted_claimed(lfd, fd);
        }
        return fd;
    }
    if fd >= 0 {
        if let Some(_inside) = Inside::enter() {
            if let Some(c) = registry::on_accept(lfd, fd, flags & libc::SOCK_NONBLOCK != 0) {
                table::insert(fd, Arc::new(c));
                crate::say(format_args!("accepted a connection over clan"));
            }
        }
    }
    fd
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded.
    on_accepted(fd, unsafe { real::accept(fd, addr, len) }, 0)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: forwarded.
    on_accepted(fd, unsafe { real::accept4(fd, addr, len, flags) }, flags)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    ready::forget(fd);
    ready::forget_kernel_member(fd);
    ready::forget_epoll(fd);
    if let Some(c) = table::remove(fd) {
        // The last descriptor here of a connection a child shares: the child may go on with
        // it, so it goes over to the kernel instead of ending.
        if c.shared.load(std::sync::atomic::Ordering::Acquire)
            && !c.is_kernel_only()
            && !table::others(fd, Arc::as_ptr(&c))
        {
            if let Some(_inside) = Inside::enter() {
                fork::hand_over(fd, &c, "closed here, and a child shares it");
            }
        }
    }
    fork::sweep();
    registry::on_close(fd);
    // SAFETY: forwarded.
    unsafe { real::close(fd) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    match table::get(fd) {
        Some(c) => ret0(c.shutdown(fd, how)),
        // SAFETY: forwarded.
        None => unsafe { real::shutdown(fd, how) },
    }
}

/// The application's buffer as a slice (`n` writable bytes at `buf`).
unsafe fn buf_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if n == 0 || buf.is_null() {
        return &mut [];
    }
    // SAFETY: the caller passed `n` writable bytes at `buf`.
    unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }
}

unsafe fn buf_ref<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if n == 0 || buf.is_null() {
        return &[];
    }
    // SAFETY: the caller passed `n` readable bytes at `buf`.
    unsafe { std::slice::from_raw_parts(buf.cast(), n) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's buffer.
        Some(c) => ret(c.read(fd, unsafe { buf_mut(buf, n) }, Flags::default())),
        // SAFETY: forwarded.
        None => unsafe { real::read(fd, buf, n) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        std::process::abort();
    }
    // SAFETY: forwarded.
    unsafe { read(fd, buf, n) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's buffer.
        Some(c) => ret(c.read(fd, unsafe { buf_mut(buf, n) }, Flags::from_msg(flags))),
        // SAFETY: forwarded.
        None => unsafe { real::recv(fd, buf, n, flags) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t {
    if n > buflen {
        std::process::abort();
    }
    // SAFETY: forwarded.
    unsafe { recv(fd, buf, n, flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    match table::get(fd) {
        Some(c) => {
            if !len.is_null() {
                // SAFETY: the application's length slot. A connected stream reports no
                // address (as the kernel does for TCP).
                unsafe { *len = 0 };
            }
            // SAFETY: the application's buffer.
            ret(c.read(fd, unsafe { buf_mut(buf, n) }, Flags::from_msg(flags)))
        }
        // SAFETY: forwarded.
        None => unsafe { real::recvfrom(fd, buf, n, flags, addr, len) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        std::process::abort();
    }
    // SAFETY: forwarded.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

/// The iovecs as slices.
unsafe fn iovs<'a>(iov: *const libc::iovec, n: c_int) -> Vec<&'a mut [u8]> {
    if iov.is_null() || n <= 0 {
        return Vec::new();
    }
    // SAFETY: the caller passed `n` iovecs at `iov`, each describing writable memory.
    let v = unsafe { std::slice::from_raw_parts(iov, n as usize) };
    // SAFETY: as above.
    v.iter().map(|i| unsafe { buf_mut(i.iov_base, i.iov_len) }).collect()
}

/// Scatter a read over `bufs`: the first part waits as the call would, the rest takes only
/// what is there.
fn read_scatter(c: &crate::conn::Conn, fd: c_int, bufs: Vec<&mut [u8]>, f: Flags) -> Result<usize, c_int> {
    let mut done = 0;
    for (i, b) in bufs.into_iter().enumerate() {
        if b.is_empty() {
            continue;
        }
        let flags = if i == 0 || done == 0 { f } else { Flags { dontwait: true, ..f } };
        match c.read(fd, b, flags) {
            Ok(n) => {
                done += n;
                if n < b.len() {
                    break;
                }
            }
            Err(_) if done > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's iovecs.
        Some(c) => ret(read_scatter(&c, fd, unsafe { iovs(iov, n) }, Flags::default())),
        // SAFETY: forwarded.
        None => unsafe { real::readv(fd, iov, n) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    match table::get(fd) {
        Some(c) if !msg.is_null() => {
            // SAFETY: the application's message header.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: its iovecs.
            ret(read_scatter(&c, fd, unsafe { iovs(m.msg_iov, m.msg_iovlen as c_int) }, Flags::from_msg(flags)))
        }
        // SAFETY: forwarded.
        _ => unsafe { real::recvmsg(fd, msg, flags) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's buffer.
        Some(c) => ret(c.write(fd, unsafe { buf_ref(buf, n) }, Flags::default())),
        // SAFETY: forwarded.
        None => unsafe { real::write(fd, buf, n) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's buffer.
        Some(c) => ret(c.write(fd, unsafe { buf_ref(buf, n) }, Flags::from_msg(flags))),
        // SAFETY: forwarded.
        None => unsafe { real::send(fd, buf, n, flags) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's buffer (a connected stream ignores the address).
        Some(c) => ret(c.write(fd, unsafe { buf_ref(buf, n) }, Flags::from_msg(flags))),
        // SAFETY: forwarded.
        None => unsafe { real::sendto(fd, buf, n, flags, addr, len) },
    }
}

/// Gather iovecs into one buffer (one write: the bytes go out in order, at once).
unsafe fn gather(iov: *const libc::iovec, n: c_int) -> Vec<u8> {
    let mut out = Vec::new();
    if iov.is_null() || n <= 0 {
        return out;
    }
    // SAFETY: the caller passed `n` iovecs at `iov`.
    for i in unsafe { std::slice::from_raw_parts(iov, n as usize) } {
        // SAFETY: each describes readable memory.
        out.extend_from_slice(unsafe { buf_ref(i.iov_base, i.iov_len) });
    }
    out
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match table::get(fd) {
        // SAFETY: the application's iovecs.
        Some(c) => ret(c.write(fd, &unsafe { gather(iov, n) }, Flags::default())),
        // SAFETY: forwarded.
        None => unsafe { real::writev(fd, iov, n) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    match table::get(fd) {
        Some(c) if !msg.is_null() => {
            // SAFETY: the application's message header and its iovecs.
            let data = unsafe { gather((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
            ret(c.write(fd, &data, Flags::from_msg(flags)))
        }
        _ => {
            // SAFETY: the application's message header (null or valid).
            unsafe { pass_on(msg) };
            // SAFETY: forwarded.
            unsafe { real::sendmsg(fd, msg, flags) }
        }
    }
}

/// Descriptors passed with `SCM_RIGHTS` in `msg`: an accelerated connection among them goes
/// over to the kernel first (the receiving process has no clan state for it).
unsafe fn pass_on(msg: *const libc::msghdr) {
    if msg.is_null() {
        return;
    }
    // SAFETY: the application's header.
    let m = unsafe { &*msg };
    if m.msg_control.is_null() || m.msg_controllen == 0 {
        return;
    }
    let mut fds = Vec::new();
    // SAFETY: walking the application's control buffer with the C library's own macros,
    // which stay within `msg_controllen`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<c_int>();
                let n = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize) / size_of::<c_int>();
                for i in 0..n {
                    fds.push(std::ptr::read_unaligned(data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    for fd in fds {
        if table::forked() {
            fork::inherited(fd);
        } else if let Some(c) = table::get(fd) {
            if let Some(_inside) = Inside::enter() {
                fork::hand_over(fd, &c, "passed to another process (SCM_RIGHTS)");
            }
        }
    }
}

fn before_exec(wait: bool) {
    if let Some(_inside) = Inside::enter() {
        fork::before_exec("it survives exec", wait);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    before_exec(true);
    // SAFETY: forwarded.
    unsafe { real::execve(path, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    before_exec(true);
    // SAFETY: forwarded.
    unsafe { real::execv(path, argv) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    before_exec(true);
    // SAFETY: forwarded.
    unsafe { real::execvp(file, argv) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvpe(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    before_exec(true);
    // SAFETY: forwarded.
    unsafe { real::execvpe(file, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    before_exec(true);
    // SAFETY: forwarded.
    unsafe { real::fexecve(fd, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const libc::c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    // (this process stays: what the peers take back stays here as long as needed)
    before_exec(false);
    // SAFETY: forwarded.
    unsafe { real::posix_spawn(pid, path, fa, attr, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const libc::c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    before_exec(false);
    // SAFETY: forwarded.
    unsafe { real::posix_spawnp(pid, file, fa, attr, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t {
    let Some(c) = table::get(out) else {
        // SAFETY: forwarded (the C library's sendfile).
        return unsafe { real::sendfile(out, inp, off, count) };
    };
    // A copy through a buffer: read from `inp` (at `*off` if given), write to the stream.
    let mut buf = vec![0u8; count.min(1 << 20)];
    let n = if off.is_null() {
        // SAFETY: forwarded read into our buffer.
        unsafe { real::read(inp, buf.as_mut_ptr().cast(), buf.len()) }
    } else {
        // SAFETY: the application's offset slot; our buffer.
        unsafe { libc::pread(inp, buf.as_mut_ptr().cast(), buf.len(), *off) }
    };
    if n <= 0 {
        return n;
    }
    match c.write(out, &buf[..n as usize], Flags::default()) {
        Ok(w) => {
            if !off.is_null() {
                // SAFETY: as above.
                unsafe { *off += w as libc::off_t };
            } else if w < n as usize {
                // Give back what was read and not sent.
                // SAFETY: lseek on the application's descriptor.
                unsafe { libc::lseek(inp, w as libc::off_t - n as libc::off_t, libc::SEEK_CUR) };
            }
            w as ssize_t
        }
        Err(e) => {
            if off.is_null() {
                // SAFETY: as above.
                unsafe { libc::lseek(inp, -(n as libc::off_t), libc::SEEK_CUR) };
            }
            set_errno(e);
            -1
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t {
    // SAFETY: forwarded (off_t is 64 bits on the targets we build for).
    unsafe { sendfile(out, inp, off, count) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    if fds.is_null() || n == 0 {
        // SAFETY: forwarded.
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: the application's array of `n` entries.
    let v = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    ret(ready::poll(v, timeout, None)) as c_int
}

/// Milliseconds of a `timespec` (rounded up; -1 for none).
unsafe fn ts_ms(ts: *const libc::timespec) -> c_int {
    if ts.is_null() {
        return -1;
    }
    // SAFETY: the application's timeout.
    let t = unsafe { *ts };
    if t.tv_sec < 0 || t.tv_nsec < 0 {
        return 0;
    }
    let (sec, nsec): (i64, i64) = (t.tv_sec, t.tv_nsec);
    sec.saturating_mul(1000).saturating_add((nsec + 999_999) / 1_000_000).clamp(0, c_int::MAX as i64) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if fds.is_null() || n == 0 {
        // SAFETY: forwarded.
        return unsafe { real::ppoll(fds, n, ts, mask) };
    }
    // SAFETY: the application's array of `n` entries, its timeout and mask (null or valid).
    let (v, ms, m) = unsafe { (std::slice::from_raw_parts_mut(fds, n as usize), ts_ms(ts), mask.as_ref()) };
    if !v.iter().any(|p| table::is_marked(p.fd)) {
        // SAFETY: forwarded.
        return unsafe { real::ppoll(fds, n, ts, mask) };
    }
    ret(ready::poll(v, ms, m)) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if (n as usize).saturating_mul(size_of::<pollfd>()) > fdslen {
        std::process::abort();
    }
    // SAFETY: forwarded.
    unsafe { ppoll(fds, n, ts, mask) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(fds: *mut pollfd, n: libc::nfds_t, timeout: c_int, fdslen: size_t) -> c_int {
    if (n as usize).saturating_mul(size_of::<pollfd>()) > fdslen {
        std::process::abort();
    }
    // SAFETY: forwarded.
    unsafe { poll(fds, n, timeout) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    t: *mut libc::timeval,
) -> c_int {
    let lim = n.clamp(0, libc::FD_SETSIZE as c_int);
    // SAFETY: the application's sets (each null or valid).
    let (rs, ws, es) = unsafe { (r.as_mut(), w.as_mut(), e.as_mut()) };
    let ours = (0..lim).any(|fd| {
        let set = |s: &Option<&mut libc::fd_set>| s.as_ref().is_some_and(|s| real::fd_isset(fd, s));
        (set(&rs) || set(&ws) || set(&es)) && table::get(fd).is_some()
    });
    if !ours {
        // SAFETY: forwarded.
        return unsafe { real::select(n, r, w, e, t) };
    }
    let ms = if t.is_null() {
        -1
    } else {
        // SAFETY: the application's timeout.
        let tv = unsafe { *t };
        (tv.tv_sec * 1000 + (tv.tv_usec + 999) / 1000).clamp(0, c_int::MAX as i64) as c_int
    };
    ret(ready::select(n, rs, ws, es, ms, None)) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let lim = n.clamp(0, libc::FD_SETSIZE as c_int);
    // SAFETY: the application's sets (each null or valid).
    let (rs, ws, es) = unsafe { (r.as_mut(), w.as_mut(), e.as_mut()) };
    let ours = (0..lim).any(|fd| {
        let set = |s: &Option<&mut libc::fd_set>| s.as_ref().is_some_and(|s| real::fd_isset(fd, s));
        (set(&rs) || set(&ws) || set(&es)) && table::get(fd).is_some()
    });
    if !ours {
        // SAFETY: forwarded.
        return unsafe { real::pselect(n, r, w, e, ts, mask) };
    }
    // SAFETY: the application's timeout and mask (null or valid).
    let (ms, m) = unsafe { (ts_ms(ts), mask.as_ref()) };
    ret(ready::select(n, rs, ws, es, ms, m)) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int {
    match table::get(fd) {
        Some(c) => {
            // SAFETY: the application's event (null allowed for DEL).
            let e = unsafe { ev.as_ref() }.map(|e| (e.events, e.u64));
            let r = ready::epoll_ctl(epfd, op, fd, c, e);
            if let Err(e) = r {
                crate::say(format_args!("epoll_ctl({epfd}, {op}, {fd}) on a connection over clan: errno {e}"));
            }
            ret0(r)
        }
        None => {
            if op == libc::EPOLL_CTL_ADD {
                ready::note_kernel_member(fd);
            }
            // SAFETY: forwarded.
            unsafe { real::epoll_ctl(epfd, op, fd, ev) }
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarded.
    let fd = unsafe { real::epoll_create(size) };
    ready::note_epoll(fd);
    fd
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwarded.
    let fd = unsafe { real::epoll_create1(flags) };
    ready::note_epoll(fd);
    fd
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(epfd: c_int, evs: *mut epoll_event, max: c_int, timeout: c_int) -> c_int {
    if max <= 0 || evs.is_null() || !ready::is_mixed(epfd) {
        // SAFETY: forwarded.
        return unsafe { real::epoll_wait(epfd, evs, max, timeout) };
    }
    // SAFETY: the application's array of `max` events.
    let out = unsafe { std::slice::from_raw_parts_mut(evs, max as usize) };
    ret(ready::epoll_wait(epfd, out, timeout, None)) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    evs: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    if max <= 0 || evs.is_null() || !ready::is_mixed(epfd) {
        // SAFETY: forwarded.
        return unsafe { real::epoll_pwait(epfd, evs, max, timeout, mask) };
    }
    // SAFETY: the application's array of `max` events and its mask (null or valid): the
    // mask is the kernel's while we sleep, as with epoll_pwait itself.
    let (out, m) = unsafe { (std::slice::from_raw_parts_mut(evs, max as usize), mask.as_ref()) };
    ret(ready::epoll_wait(epfd, out, timeout, m)) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarded.
    let n = unsafe { real::dup(fd) };
    if n >= 0 {
        if let Some(c) = table::get(fd) {
            table::insert(n, c);
        }
    }
    n
}

fn after_dup2(old: c_int, new: c_int, r: c_int) -> c_int {
    if r >= 0 && old != new {
        ready::forget(new);
        table::remove(new);
        if let Some(c) = table::get(old) {
            table::insert(new, c);
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwarded.
    after_dup2(old, new, unsafe { real::dup2(old, new) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarded.
    after_dup2(old, new, unsafe { real::dup3(old, new, flags) })
}

fn after_fcntl(fd: c_int, cmd: c_int, arg: usize, r: c_int) -> c_int {
    if r < 0 {
        return r;
    }
    match cmd {
        libc::F_SETFL => {
            if let Some(c) = table::get(fd) {
                c.set_nonblocking(arg as c_int & libc::O_NONBLOCK != 0);
            }
        }
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            if let Some(c) = table::get(fd) {
                table::insert(r, c);
            }
        }
        _ => {}
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: forwarded (the third argument passed through as the register it came in).
    after_fcntl(fd, cmd, arg, unsafe { real::fcntl(fd, cmd, arg) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: forwarded.
    after_fcntl(fd, cmd, arg, unsafe { real::fcntl64(fd, cmd, arg) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int {
    if let Some(c) = table::get(fd) {
        if req == libc::FIONREAD as libc::c_ulong && arg != 0 {
            // SAFETY: FIONREAD's argument is an int the application gave.
            unsafe { *(arg as *mut c_int) = c.available(fd).min(c_int::MAX as usize) as c_int };
            return 0;
        }
        if req == libc::FIONBIO as libc::c_ulong && arg != 0 {
            // SAFETY: FIONBIO's argument is an int the application gave.
            c.set_nonblocking(unsafe { *(arg as *const c_int) } != 0);
        }
    }
    // SAFETY: forwarded.
    unsafe { real::ioctl(fd, req, arg) }
}

/// After `fork`, in the parent: its listeners stop taking claims (a child may be the one
/// that accepts, and it has no clan state; their connections go to the kernel from now on),
/// and a thread answers the child's requests to hand shared connections over.
extern "C" fn forked_parent() {
    registry::stop_claims();
    fork::after_fork_parent();
}

/// Register the `fork` handlers (once, when the library first does something).
pub(crate) fn on_fork_handlers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registering two functions that are valid for the life of the process.
        unsafe { libc::pthread_atfork(Some(fork::before_fork), Some(forked_parent), Some(fork::after_fork_child)) };
    });
}
