//! `SOCK_SEQPACKET` Unix sockets in the abstract namespace, with fd passing and peer
//! credentials: the control channel between the NICs of one host.
//!
//! Abstract names live in the network namespace of the process, so a NIC is reachable this
//! way exactly from the processes of its own (virtual) host. Message boundaries are preserved,
//! so every `recv` returns one whole control message, and a message that does not fit (or whose
//! descriptors do not fit) is reported as [`Received::truncated`] and must be refused.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// Most descriptors one control message may carry.
pub const MAX_FDS: usize = 4;

/// Kernel-verified identity of the process at the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id (at connect time).
    pub pid: u32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// One received message.
#[derive(Debug)]
pub struct Received {
    /// Bytes of payload placed in the buffer (0 with no descriptors means end of stream).
    pub len: usize,
    /// Descriptors that came with it (closed on drop if unused).
    pub fds: Vec<OwnedFd>,
    /// The payload or the descriptors did not fit: the message must be refused.
    pub truncated: bool,
}

/// A SEQPACKET Unix socket (listener or connection).
#[derive(Debug)]
pub struct SeqPacket {
    fd: OwnedFd,
}

fn socket() -> io::Result<OwnedFd> {
    Ok(crate::fdfloor::lift(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?))
}

impl SeqPacket {
    /// Bind and listen on an abstract name. Fails with `AddrInUse` if the name is taken.
    pub fn listen_abstract(name: &[u8]) -> io::Result<SeqPacket> {
        let fd = socket()?;
        let addr = SocketAddrUnix::new_abstract_name(name)?;
        rustix::net::bind(&fd, &addr)?;
        rustix::net::listen(&fd, 4096)?;
        Ok(SeqPacket { fd })
    }

    /// Connect to an abstract name (blocking).
    pub fn connect_abstract(name: &[u8]) -> io::Result<SeqPacket> {
        let fd = socket()?;
        let addr = SocketAddrUnix::new_abstract_name(name)?;
        rustix::net::connect(&fd, &addr)?;
        Ok(SeqPacket { fd })
    }

    /// Connect to an abstract name without ever blocking: the result is immediate (a Unix
    /// socket connects at once or not at all). `WouldBlock` means the listener's backlog is
    /// full (try again later); `ConnectionRefused` or `NotFound` that nothing listens there.
    /// The socket is left non-blocking.
    pub fn connect_abstract_nonblocking(name: &[u8]) -> io::Result<SeqPacket> {
        let fd = crate::fdfloor::lift(rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?);
        let addr = SocketAddrUnix::new_abstract_name(name)?;
        loop {
            match rustix::net::connect(&fd, &addr) {
                Ok(()) => return Ok(SeqPacket { fd }),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A connected pair (for tests and for in-process plumbing).
    pub fn pair() -> io::Result<(SeqPacket, SeqPacket)> {
        let (a, b) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        Ok((SeqPacket { fd: crate::fdfloor::lift(a) }, SeqPacket { fd: crate::fdfloor::lift(b) }))
    }

    /// Accept one connection; `Ok(None)` if none is pending on a non-blocking listener.
    pub fn accept(&self) -> io::Result<Option<SeqPacket>> {
        match rustix::net::accept_with(&self.fd, SocketFlags::CLOEXEC) {
            Ok(fd) => Ok(Some(SeqPacket { fd: crate::fdfloor::lift(fd) })),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Switch non-blocking mode.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        rustix::io::ioctl_fionbio(&self.fd, on)?;
        Ok(())
    }

    /// Bound every blocking `send` and `recv` by `timeout`, so that a stuck peer surfaces as
    /// an error (`WouldBlock`/`TimedOut`) instead of a hang.
    pub fn set_timeouts(&self, timeout: Duration) -> io::Result<()> {
        rustix::net::sockopt::set_socket_timeout(&self.fd, rustix::net::sockopt::Timeout::Recv, Some(timeout))?;
        rustix::net::sockopt::set_socket_timeout(&self.fd, rustix::net::sockopt::Timeout::Send, Some(timeout))?;
        Ok(())
    }

    /// Credentials of the connected peer, as recorded by the kernel at connect time.
    pub fn peer_cred(&self) -> io::Result<PeerCred> {
        let c = rustix::net::sockopt::socket_peercred(&self.fd)?;
        Ok(PeerCred { pid: c.pid.as_raw_nonzero().get() as u32, uid: c.uid.as_raw(), gid: c.gid.as_raw() })
    }

    /// Send one message with up to [`MAX_FDS`] descriptors (blocking or not, as the socket
    /// is set).
    pub fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors"));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "descriptors do not fit"));
        }
        let iov = [io::IoSlice::new(data)];
        loop {
            match rustix::net::sendmsg(&self.fd, &iov, &mut control, SendFlags::NOSIGNAL) {
                Ok(n) if n == data.len() => return Ok(()),
                Ok(_) => {
                    return Err(io::Error::new(io::ErrorKind::WriteZero, "short send on a seqpacket socket"));
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Receive one message into `buf` (the descriptors it brings lifted above the floor:
    /// [`crate::fdfloor`]).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        self.recv_lifting(buf, true)
    }

    /// [`SeqPacket::recv`], the descriptors left where the kernel put them (low numbers):
    /// for a receiver that closes most of them at once, and lifts those it keeps.
    pub fn recv_unlifted(&self, buf: &mut [u8]) -> io::Result<Received> {
        self.recv_lifting(buf, false)
    }

    /// [`SeqPacket::recv`] that never blocks, whatever the socket's mode (`WouldBlock` when no
    /// message waits): no switch of the socket's mode, and its cost of two system calls.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        self.recv_with(buf, true, RecvFlags::DONTWAIT)
    }

    /// [`SeqPacket::try_recv`], the descriptors left where the kernel put them.
    pub fn try_recv_unlifted(&self, buf: &mut [u8]) -> io::Result<Received> {
        self.recv_with(buf, false, RecvFlags::DONTWAIT)
    }

    fn recv_lifting(&self, buf: &mut [u8], lift: bool) -> io::Result<Received> {
        self.recv_with(buf, lift, RecvFlags::empty())
    }

    fn recv_with(&self, buf: &mut [u8], lift: bool, flags: RecvFlags) -> io::Result<Received> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [io::IoSliceMut::new(buf)];
        let msg = loop {
            match rustix::net::recvmsg(&self.fd, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC | flags) {
                Ok(m) => break m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                if lift {
                    fds.extend(rights.map(crate::fdfloor::lift));
                } else {
                    fds.extend(rights);
                }
            }
        }
        let truncated = msg.flags.contains(ReturnFlags::TRUNC) || msg.flags.contains(ReturnFlags::CTRUNC);
        Ok(Received { len: msg.bytes, fds, truncated })
    }
}

impl AsFd for SeqPacket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for SeqPacket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `try_recv` never blocks, even on a blocking socket, and leaves the socket's mode as it
    /// was; a message and its descriptors come whole, lifted or not as asked.
    #[test]
    fn try_recv_never_blocks_and_keeps_the_mode() {
        let (a, b) = SeqPacket::pair().unwrap();
        let mut buf = [0u8; 16];
        let e = b.try_recv(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        let (x, _y) = SeqPacket::pair().unwrap();
        a.send(b"one", &[x.as_fd()]).unwrap();
        a.send(b"two", &[x.as_fd()]).unwrap();
        let m = b.try_recv(&mut buf).unwrap();
        assert_eq!((&buf[..m.len], m.fds.len(), m.truncated), (&b"one"[..], 1, false));
        let m = b.try_recv_unlifted(&mut buf).unwrap();
        assert_eq!((&buf[..m.len], m.fds.len()), (&b"two"[..], 1));
        // (still blocking: a timed receive waits, then says so)
        b.set_timeouts(Duration::from_millis(20)).unwrap();
        let e = b.recv(&mut buf).unwrap_err();
        assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e:?}");
    }
}
