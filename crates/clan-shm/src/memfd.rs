//! memfd-backed regions: the unit of protection between processes.
//!
//! The kernel enforces access per memfd, never per byte: a process handed a descriptor can
//! keep it, map all of it, `pread` it, and reopen it through `/proc/self/fd/N` with any mode
//! the inode allows. So a memfd must hold nothing beyond what the process receiving it may
//! reach (the NIC's grants are built on that: `clan`'s aperture and queue modules), and:
//!
//! - every memfd made here is `chmod 0600` at once: a process of another user cannot reopen
//!   it, so a read-only descriptor ([`Memfd::reopen_read_only`]) stays read-only — no
//!   writable reopen, no writable shared mapping, no `write`, no hole punching. (Root, or a
//!   process of the same user, can open it anyway: between processes of one user the kernel
//!   offers no protection at all, `ptrace` included.)
//! - sizes are sealed (`F_SEAL_SHRINK`, `F_SEAL_GROW`, and `F_SEAL_SEAL` so that nobody adds a
//!   write seal later) before the descriptor leaves the process, and a received memfd is
//!   refused unless it carries the size seals: otherwise the other side could truncate the
//!   file under our mapping and turn every later access into `SIGBUS`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags, OFlags, SealFlags};

/// An owned memfd of fixed, sealed size.
#[derive(Debug)]
pub struct Memfd {
    fd: OwnedFd,
    len: u64,
    /// The file's identity (device, inode), when known already (an adopted memfd's, read
    /// with its size).
    ident: Option<(u64, u64)>,
}

impl Memfd {
    /// Create a zero-filled memfd of `len` bytes, readable and writable by its owner only,
    /// and seal its size.
    pub fn create(name: &str, len: u64) -> io::Result<Memfd> {
        let fd = crate::fdfloor::lift(rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?);
        rustix::fs::fchmod(&fd, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR)?;
        rustix::fs::ftruncate(&fd, len)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Ok(Memfd { fd, len, ident: None })
    }

    /// Adopt a memfd received from another process, checking that it is sealed against
    /// resizing and at least `min_len` bytes long.
    pub fn adopt(fd: OwnedFd, min_len: u64) -> io::Result<Memfd> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "received descriptor is not a memfd"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "received memfd is not sealed against shrinking"));
        }
        let st = rustix::fs::fstat(&fd)?;
        let len = st.st_size as u64;
        if len < min_len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("received memfd holds {len} bytes, {min_len} expected"),
            ));
        }
        #[allow(clippy::unnecessary_cast)]
        let ident = Some((st.st_dev as u64, st.st_ino as u64));
        Ok(Memfd { fd, len, ident })
    }

    /// The file's identity: (device, inode). A file's identity is not reused while a
    /// descriptor or a mapping of it is open.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        if let Some(i) = self.ident {
            return Ok(i);
        }
        let st = rustix::fs::fstat(&self.fd)?;
        #[allow(clippy::unnecessary_cast)]
        Ok((st.st_dev as u64, st.st_ino as u64))
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the memfd is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A new, read-only open file description of the same memory: a process that receives it
    /// can map it `PROT_READ` only, whatever it tries.
    pub fn reopen_read_only(&self) -> io::Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, rustix::fs::Mode::empty()).map_err(Into::into)
    }

    /// Discard the contents of `[offset, offset + len)`: it reads as zeros afterwards and its
    /// pages are returned to the system.
    pub fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        rustix::fs::fallocate(&self.fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)?;
        Ok(())
    }

    /// Duplicate the descriptor (for sending; the duplicate is closed after `sendmsg`).
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

impl AsFd for Memfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit. Returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    if let (Some(cur), max) = (lim.current, lim.maximum) {
        if max.is_none_or(|m| cur < m) {
            let _ = setrlimit(Resource::Nofile, Rlimit { current: max, maximum: max });
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}
