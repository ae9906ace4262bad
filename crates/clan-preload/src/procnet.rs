//! Which socket is at the other end of a local TCP connection: its cookie (and inode),
//! asked of the kernel by an exact `NETLINK_SOCK_DIAG` lookup of the 4-tuple (one round
//! trip, whatever the number of sockets), or, where that is not available, its inode, found
//! in the kernel's tables of this network namespace (`/proc/net/tcp`, `/proc/net/tcp6`).
//! A socket its process closed keeps its cookie (and its place in the lookup) while the
//! connection ends, but no longer has an inode.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// How the socket at the other end was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Its cookie (`SO_COOKIE`).
    Cookie(u64),
    /// Its inode only (no `NETLINK_SOCK_DIAG`).
    Inode(u64),
}

/// The socket whose local address is `local` and remote address `remote`.
pub(crate) fn peer_socket(local: SocketAddr, remote: SocketAddr) -> Option<Found> {
    if let Some((_, cookie)) = diag(local, remote) {
        return Some(Found::Cookie(cookie));
    }
    proc_tables(local, remote).map(Found::Inode)
}

/// The inode of the socket whose local address is `local` and remote address `remote`
/// (none once its process closed it).
#[cfg(test)]
pub(crate) fn inode_of(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    if let Some((i, _)) = diag(local, remote) {
        return (i != 0).then_some(i);
    }
    proc_tables(local, remote)
}

fn proc_tables(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        if let Some(i) = find(&text, local, remote) {
            return Some(i);
        }
    }
    None
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_ERROR: u16 = 2;

/// The IPv6 form of an address (an IPv4 one mapped), as the diag socket id holds it for an
/// AF_INET6 socket; the 16 bytes the id holds for `family`.
fn id_bytes(a: SocketAddr, family: u8) -> [u8; 16] {
    let mut b = [0u8; 16];
    match (a.ip(), family) {
        (IpAddr::V4(v4), f) if f == libc::AF_INET as u8 => b[..4].copy_from_slice(&v4.octets()),
        (IpAddr::V4(v4), _) => b = v4.to_ipv6_mapped().octets(),
        (IpAddr::V6(v6), f) if f == libc::AF_INET as u8 => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                b[..4].copy_from_slice(&v4.octets());
            }
        }
        (IpAddr::V6(v6), _) => b = v6.octets(),
    }
    b
}

/// The diag socket, kept for the next lookup (a socket and a close per `accept` were
/// about 10 µs), with the process it was made in (a child after `fork` makes its own: the
/// two would read each other's answers).
static DIAG: std::sync::Mutex<Option<(u32, std::os::fd::OwnedFd)>> = std::sync::Mutex::new(None);
/// Sequence numbers of the lookups: an answer is taken only for its own request.
static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// One exact `inet_diag` lookup (`struct inet_diag_req_v2` after a `nlmsghdr`): the socket's
/// inode (0 once closed) and cookie.
fn diag(local: SocketAddr, remote: SocketAddr) -> Option<(u64, u64)> {
    use rustix::net::{AddressFamily, SocketType};
    let pid = std::process::id();
    let mut kept = DIAG.lock().unwrap_or_else(|e| e.into_inner());
    let nl = match kept.take() {
        Some((p, fd)) if p == pid => fd,
        _ => {
            let fd =
                rustix::net::socket(AddressFamily::NETLINK, SocketType::DGRAM, Some(rustix::net::netlink::SOCK_DIAG))
                    .ok()?;
            // (never a wait without end: an answer that does not come fails the lookup)
            rustix::net::sockopt::set_socket_timeout(
                &fd,
                rustix::net::sockopt::Timeout::Recv,
                Some(std::time::Duration::from_secs(1)),
            )
            .ok()?;
            clan_shm::fdfloor::lift(fd)
        }
    };
    let found = query(&nl, local, remote);
    // (a socket that failed is not kept: it may hold an answer no one will read)
    if let Ok(found) = found {
        *kept = Some((pid, nl));
        return found;
    }
    None
}

/// The lookup on the diag socket `nl`: Err if the socket failed.
fn query(nl: &std::os::fd::OwnedFd, local: SocketAddr, remote: SocketAddr) -> Result<Option<(u64, u64)>, ()> {
    use rustix::net::{RecvFlags, SendFlags};
    // The socket could be IPv4 or IPv6 (dual stack): ask as each.
    let families: &[u8] = if local.is_ipv4() && remote.is_ipv4() {
        &[libc::AF_INET as u8, libc::AF_INET6 as u8]
    } else {
        &[libc::AF_INET6 as u8, libc::AF_INET as u8]
    };
    for &family in families {
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut req = Vec::with_capacity(72);
        req.extend_from_slice(&72u32.to_ne_bytes()); // nlmsg_len
        req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        req.extend_from_slice(&seq.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes()); // pid
        req.push(family);
        req.push(libc::IPPROTO_TCP as u8);
        req.push(0); // ext
        req.push(0); // pad
        req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
        req.extend_from_slice(&local.port().to_be_bytes());
        req.extend_from_slice(&remote.port().to_be_bytes());
        req.extend_from_slice(&id_bytes(local, family));
        req.extend_from_slice(&id_bytes(remote, family));
        req.extend_from_slice(&0u32.to_ne_bytes()); // interface
        req.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
        req.extend_from_slice(&u32::MAX.to_ne_bytes());
        debug_assert_eq!(req.len(), 72);
        rustix::net::send(nl, &req, SendFlags::empty()).map_err(|_| ())?;
        let mut buf = [0u8; 512];
        // Our answer (one message: the socket's, or an error); an older one, left by a
        // lookup whose answer came late, is skipped.
        let r = loop {
            let (n, _) = rustix::net::recv(nl, &mut buf, RecvFlags::empty()).map_err(|_| ())?;
            if n < 16 {
                return Err(());
            }
            if u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]) == seq {
                break &buf[..n];
            }
        };
        // nlmsghdr (16) + inet_diag_msg: family, state, timer, retrans (4), id (48: ports 4,
        // addresses 32, interface 4, cookie 8 as two native words, low first), expires,
        // rqueue, wqueue, uid (16), inode (4).
        // (72 bytes: a connection in its time-wait state has no attributes after them)
        if r.len() >= 16 + 72 && u16::from_ne_bytes([r[4], r[5]]) == SOCK_DIAG_BY_FAMILY {
            let word = |at: usize| r[at..at + 4].try_into().map(u32::from_ne_bytes).map_err(|_| ());
            let cookie = u64::from(word(16 + 4 + 40)?) | u64::from(word(16 + 4 + 44)?) << 32;
            let inode = u64::from(word(16 + 4 + 48 + 16)?);
            return Ok(Some((inode, cookie)));
        } else if u16::from_ne_bytes([r[4], r[5]]) != NLMSG_ERROR {
            return Ok(None);
        }
    }
    Ok(None)
}

/// The inodes of every TCP socket listening on `port` in this network namespace (any
/// address, IPv4 and IPv6): one `NETLINK_SOCK_DIAG` dump of the listening sockets per family.
/// None if the kernel could not be asked.
pub(crate) fn listening_inodes(port: u16) -> Option<Vec<u64>> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType};
    const NLM_F_DUMP: u16 = 0x300;
    const NLMSG_DONE: u16 = 3;
    const TCP_LISTEN: u32 = 10;
    // (a socket of its own: a dump answers in many messages, which a lookup must not meet)
    let nl =
        rustix::net::socket(AddressFamily::NETLINK, SocketType::DGRAM, Some(rustix::net::netlink::SOCK_DIAG)).ok()?;
    rustix::net::sockopt::set_socket_timeout(
        &nl,
        rustix::net::sockopt::Timeout::Recv,
        Some(std::time::Duration::from_secs(1)),
    )
    .ok()?;
    let mut inodes = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut req = Vec::with_capacity(72);
        req.extend_from_slice(&72u32.to_ne_bytes()); // nlmsg_len
        req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
        req.extend_from_slice(&seq.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes()); // pid
        req.push(family);
        req.push(libc::IPPROTO_TCP as u8);
        req.push(0); // ext
        req.push(0); // pad
        req.extend_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
        req.resize(72, 0); // the socket id: unused by a dump
        rustix::net::send(&nl, &req, SendFlags::empty()).ok()?;
        'answers: loop {
            let (n, _) = rustix::net::recv(&nl, &mut buf, RecvFlags::empty()).ok()?;
            let mut at = 0;
            while at + 16 <= n {
                let word = |i: usize| u32::from_ne_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
                let len = word(at) as usize;
                let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                if len < 16 || at + len > n {
                    return None;
                }
                if word(at + 8) == seq {
                    match kind {
                        NLMSG_DONE => break 'answers,
                        NLMSG_ERROR => return None,
                        SOCK_DIAG_BY_FAMILY if len >= 16 + 72 => {
                            // (inet_diag_msg: the id's source port at 4, big-endian; the
                            // inode at 68)
                            let m = at + 16;
                            if u16::from_be_bytes([buf[m + 4], buf[m + 5]]) == port {
                                inodes.push(u64::from(word(m + 68)));
                            }
                        }
                        _ => {}
                    }
                }
                at += len.div_ceil(4) * 4;
            }
        }
    }
    Some(inodes)
}

/// The inode on the line of `text` (a `/proc/net/tcp*` table) for `local` → `remote`.
pub(crate) fn find(text: &str, local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    for line in text.lines().skip(1) {
        let mut f = line.split_whitespace();
        let (Some(_), Some(l), Some(r)) = (f.next(), f.next(), f.next()) else { continue };
        if same(parse(l), local) && same(parse(r), remote) {
            // st tx:rx tr:when retrnsmt uid timeout inode
            return f.nth(6)?.parse().ok();
        }
    }
    None
}

fn same(a: Option<SocketAddr>, b: SocketAddr) -> bool {
    let norm = |s: SocketAddr| match s.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(s, |v4| SocketAddr::new(IpAddr::V4(v4), s.port())),
        _ => s,
    };
    a.is_some_and(|a| norm(a) == norm(b))
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:port` (IPv6): each 32-bit word as the kernel
/// holds it (network order) printed as a host-order number.
fn parse(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |h: &str| u32::from_str_radix(h, 16).ok().map(|w| w.to_ne_bytes());
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(&ip[i * 8..i * 8 + 8])?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_inode_of_a_connection() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 123456 1 0000000000000000 20 4 30 10 -1\n";
        let a: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:54321".parse().unwrap();
        assert_eq!(find(t, a, b), Some(123456));
        assert_eq!(find(t, b, a), None);
        let t6 = "  sl  local_address                         remote_address                        st\n   0: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:D431 01 00000000:00000000 00:00000000 00000000     0        0 777 1\n";
        let a6: SocketAddr = "[::1]:8080".parse().unwrap();
        let b6: SocketAddr = "[::1]:54321".parse().unwrap();
        assert_eq!(find(t6, a6, b6), Some(777));
    }

    /// The listeners of a port, found by a dump: both of a `SO_REUSEPORT` pair, an IPv6 one
    /// on another port not, nor a connection on the port.
    #[test]
    fn sock_diag_lists_the_listeners_of_a_port() {
        use rustix::net::{AddressFamily, SocketType, bind, listen, socket, sockopt};
        use std::os::unix::fs::MetadataExt;
        let make = |port: u16| {
            let s = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
            sockopt::set_socket_reuseport(&s, true).unwrap();
            bind(&s, &SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
            listen(&s, 16).unwrap();
            std::net::TcpListener::from(s)
        };
        let a = make(0);
        let port = a.local_addr().unwrap().port();
        let b = make(port);
        let other = std::net::TcpListener::bind("[::1]:0").unwrap();
        let _c = std::net::TcpStream::connect(a.local_addr().unwrap()).unwrap();
        let ino = |fd: i32| std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino();
        let mut found = listening_inodes(port).unwrap();
        found.sort_unstable();
        let mut want = vec![ino(std::os::fd::AsRawFd::as_raw_fd(&a)), ino(std::os::fd::AsRawFd::as_raw_fd(&b))];
        want.sort_unstable();
        assert_eq!(found, want);
        let o = listening_inodes(other.local_addr().unwrap().port()).unwrap();
        assert_eq!(o, vec![ino(std::os::fd::AsRawFd::as_raw_fd(&other))]);
    }

    #[test]
    fn sock_diag_finds_a_real_loopback_connection() {
        use std::os::unix::fs::MetadataExt;
        let cookie = |s: &std::net::TcpStream| rustix::net::sockopt::socket_cookie(s).unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let (ino, ck) = diag(s.peer_addr().unwrap(), s.local_addr().unwrap()).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&c);
        assert_eq!(ino, std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino());
        assert_eq!(ck, cookie(&c));
        // And the server's own socket, seen the other way round.
        let (ino, ck) = diag(s.local_addr().unwrap(), s.peer_addr().unwrap()).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
        assert_eq!(ino, std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino());
        assert_eq!(ck, cookie(&s));
        // A socket its process closed: no inode any more, the same cookie.
        let want = cookie(&c);
        let (peer, local) = (s.peer_addr().unwrap(), s.local_addr().unwrap());
        drop(c);
        assert_eq!(peer_socket(peer, local), Some(Found::Cookie(want)));
        // (and once the connection is in its time-wait state, which carries the cookie)
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(peer_socket(peer, local), Some(Found::Cookie(want)));
        assert_eq!(diag(peer, local).map(|(i, _)| i), Some(0));
        // IPv6.
        if let Ok(l) = std::net::TcpListener::bind("[::1]:0") {
            let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, _) = l.accept().unwrap();
            let (ino, ck) = diag(s.peer_addr().unwrap(), s.local_addr().unwrap()).unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&c);
            assert_eq!(ino, std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino());
            assert_eq!(ck, cookie(&c));
        }
    }

    #[test]
    fn finds_a_real_loopback_connection() {
        use std::os::unix::fs::MetadataExt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // The client's socket, found from the server's side of the connection.
        let ino = inode_of(s.peer_addr().unwrap(), s.local_addr().unwrap()).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&c);
        let meta = std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap();
        assert_eq!(ino, meta.ino());
    }
}
