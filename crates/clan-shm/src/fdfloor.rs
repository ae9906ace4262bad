//! Where this library's descriptors go: at or above a floor, when one is set.
//!
//! A program run under `clan run` sizes its own tables by the descriptors it expects (wrk
//! refuses a socket numbered beyond its event loop's size); the library's memfds, eventfds,
//! epoll and Unix sockets must not push the program's own descriptors up. With a floor set
//! ([`set`]), every descriptor created here is moved to the lowest free number at or above
//! it (one `F_DUPFD_CLOEXEC`); by default (floor 0) nothing moves.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicI32, Ordering};

static FLOOR: AtomicI32 = AtomicI32::new(0);

/// Put descriptors created from now on at or above `floor` (0: anywhere).
pub fn set(floor: i32) {
    FLOOR.store(floor.max(0), Ordering::Relaxed);
}

/// The floor.
pub fn get() -> i32 {
    FLOOR.load(Ordering::Relaxed)
}

/// `fd`, moved at or above the floor if it is below (unchanged if none is set, or if no
/// number up there is free).
pub fn lift(fd: OwnedFd) -> OwnedFd {
    use std::os::fd::AsRawFd;
    let floor = get();
    if floor == 0 || fd.as_raw_fd() >= floor {
        return fd;
    }
    rustix::io::fcntl_dupfd_cloexec(&fd, floor).unwrap_or(fd)
}
