//! Which socket is at the other end of a local TCP connection: its inode, from the
//! kernel's table of this network namespace (`/proc/net/tcp`, `/proc/net/tcp6`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The inode of the socket whose local address is `local` and remote address `remote`.
pub(crate) fn inode_of(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        if let Some(i) = find(&text, local, remote) {
            return Some(i);
        }
    }
    None
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
