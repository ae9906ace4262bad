//! Addresses: a NIC is a host address and a port; an endpoint is a NIC and an endpoint port.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::str::FromStr;

/// Who is at the other end of a connection, as far as this NIC could prove it
/// ([`crate::ConnectRequest::peer_identity`], [`crate::Connection::peer_identity`]): what a
/// server keys a per-user limit or an access check on, as it would on `SO_PEERCRED`.
///
/// ```
/// use std::time::Duration;
/// use clan::PeerIdentity;
///
/// let nic = clan::Nic::open_default()?;
/// let server = nic.endpoint()?;
/// server.listen();
/// let (to, nic2) = (server.addr(), nic.clone());
/// let client = std::thread::spawn(move || -> std::io::Result<_> {
///     let ep = nic2.endpoint()?;
///     let mine = ep.export(4096)?;
///     let conn = ep.connect(to, &mine.descriptor(), Some(Duration::from_secs(5)))?;
///     Ok(conn.peer_identity())
/// });
/// let req = server.accept(Some(Duration::from_secs(5)))?;
/// // A client of this host: its pid and uid, from the kernel.
/// let me = PeerIdentity::Process { pid: std::process::id(), uid: req.peer_identity().uid().unwrap() };
/// assert_eq!(req.peer_identity(), me);
/// let inbox = server.export(4096)?;
/// let _conn = req.accept(&server, &inbox.descriptor())?;
/// assert_eq!(client.join().unwrap()?, me);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerIdentity {
    /// A process of this host: the pid and uid the kernel gave for the control connection
    /// its messages came on (`SO_PEERCRED`), whose NIC was verified at its hello to be that
    /// process's. This process's own endpoints are this too.
    Process {
        /// Its process id.
        pid: u32,
        /// Its user id.
        uid: u32,
    },
    /// A NIC reached through a link (another host's, usually): no credentials, only
    /// addresses.
    Remote {
        /// The peer's NIC. With a cluster key ([`crate::NicConfig::cluster_key`]) the
        /// link's hand-shake proved that the peer holds the key; without one, this is what
        /// the peer claimed.
        nic: NicAddr,
        /// The host address the link's connection comes from, as the kernel reports it:
        /// what per-user limits count a remote peer by (a peer cannot claim another
        /// host's).
        source: IpAddr,
    },
}

impl PeerIdentity {
    /// The user id, for a process of this host.
    pub fn uid(&self) -> Option<u32> {
        match self {
            PeerIdentity::Process { uid, .. } => Some(*uid),
            PeerIdentity::Remote { .. } => None,
        }
    }

    /// The process id, for a process of this host.
    pub fn pid(&self) -> Option<u32> {
        match self {
            PeerIdentity::Process { pid, .. } => Some(*pid),
            PeerIdentity::Remote { .. } => None,
        }
    }
}

/// The users of the hand-shake's per-user limits: a uid of this host (all its processes), or
/// a host across a link (all its NICs: we cannot tell its users apart), known by the address
/// its connection comes from, not by the NIC address it claims.
impl clan_wire::connect::Sender for PeerIdentity {
    fn same_user(&self, other: &PeerIdentity) -> bool {
        match (self, other) {
            (PeerIdentity::Process { uid: a, .. }, PeerIdentity::Process { uid: b, .. }) => a == b,
            (PeerIdentity::Remote { source: a, .. }, PeerIdentity::Remote { source: b, .. }) => a == b,
            _ => false,
        }
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerIdentity::Process { pid, uid } => write!(f, "pid {pid} uid {uid}"),
            PeerIdentity::Remote { nic, source } => write!(f, "remote NIC {nic} from {source}"),
        }
    }
}

/// The address of a NIC: the host address it is reachable at and its port.
///
/// On one host, NICs find each other through the abstract Unix socket named after this
/// address (abstract names are scoped to the network namespace, i.e. to the virtual host);
/// across hosts, through a link to `ip:port`.
///
/// ```
/// use clan::NicAddr;
///
/// let a: NicAddr = "127.0.0.1:7000".parse()?;
/// assert_eq!(a, NicAddr::localhost(7000));
/// assert_eq!(a.port(), 7000);
/// assert_eq!(a.to_string(), "127.0.0.1:7000");
/// assert_eq!(a.socket_addr(), "127.0.0.1:7000".parse::<std::net::SocketAddr>()?);
/// let v6: NicAddr = "[::1]:9".parse()?;
/// assert!(v6.ip().is_ipv6());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NicAddr {
    ip: IpAddr,
    port: u16,
}

impl NicAddr {
    /// A NIC address.
    pub const fn new(ip: IpAddr, port: u16) -> NicAddr {
        NicAddr { ip, port }
    }

    /// `127.0.0.1:port`.
    pub const fn localhost(port: u16) -> NicAddr {
        NicAddr { ip: IpAddr::V4(Ipv4Addr::LOCALHOST), port }
    }

    /// Host address.
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// Port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// As a socket address.
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }

    /// The abstract socket name of this NIC's control channel (in the network namespace of
    /// the process), for diagnostics and tests.
    pub fn abstract_name(&self) -> Vec<u8> {
        format!("clan/nic/{}", self.socket_addr()).into_bytes()
    }
}

impl From<SocketAddr> for NicAddr {
    fn from(s: SocketAddr) -> NicAddr {
        NicAddr::new(s.ip(), s.port())
    }
}

impl fmt::Display for NicAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.socket_addr().fmt(f)
    }
}

/// Error parsing an address.
///
/// ```
/// use clan::{AddrParseError, EndpointAddr, NicAddr};
///
/// let e: AddrParseError = "localhost".parse::<NicAddr>().unwrap_err();
/// assert!(e.to_string().contains("expected ip:port"));
/// assert!("127.0.0.1:7000".parse::<EndpointAddr>().is_err(), "no endpoint port");
/// let io: std::io::Error = e.into();
/// assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid address {input:?}: expected {expected}")]
pub struct AddrParseError {
    input: String,
    expected: &'static str,
}

impl FromStr for NicAddr {
    type Err = AddrParseError;
    fn from_str(s: &str) -> Result<NicAddr, AddrParseError> {
        SocketAddr::from_str(s)
            .map(NicAddr::from)
            .map_err(|_| AddrParseError { input: s.to_owned(), expected: "ip:port, e.g. 127.0.0.1:7000 or [::1]:7000" })
    }
}

/// The address of an endpoint: its NIC and its endpoint port.
///
/// Its text form is `ip:port/endpoint`: what to hand to a peer so that it can connect.
///
/// ```
/// use clan::{EndpointAddr, NicAddr};
///
/// let e: EndpointAddr = "127.0.0.1:7000/3".parse()?;
/// assert_eq!(e, EndpointAddr::new(NicAddr::localhost(7000), 3));
/// assert_eq!((e.nic.port(), e.port), (7000, 3));
/// assert_eq!(e.to_string(), "127.0.0.1:7000/3");
///
/// let nic = clan::Nic::open_default()?;
/// let ep = nic.endpoint()?;
/// assert_eq!(ep.addr().to_string().parse::<EndpointAddr>()?, ep.addr());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointAddr {
    /// The NIC.
    pub nic: NicAddr,
    /// The endpoint's port on that NIC.
    pub port: u32,
}

impl EndpointAddr {
    /// An endpoint address.
    pub const fn new(nic: NicAddr, port: u32) -> EndpointAddr {
        EndpointAddr { nic, port }
    }
}

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.nic, self.port)
    }
}

impl FromStr for EndpointAddr {
    type Err = AddrParseError;
    fn from_str(s: &str) -> Result<EndpointAddr, AddrParseError> {
        let err = || AddrParseError { input: s.to_owned(), expected: "ip:port/endpoint, e.g. 127.0.0.1:7000/3" };
        let (nic, port) = s.rsplit_once('/').ok_or_else(err)?;
        Ok(EndpointAddr { nic: nic.parse().map_err(|_| err())?, port: port.parse().map_err(|_| err())? })
    }
}

/// What can name one or more endpoints, the way [`std::net::ToSocketAddrs`] names sockets:
/// an [`EndpointAddr`]; a string `"host:port/endpoint"` whose host is an IP address or a
/// name looked up with the system's resolver (`"node7:7000/3"`, `"localhost:7000/3"`,
/// `"[::1]:7000/3"`); a tuple `(host, port, endpoint)` with the host as a string or an
/// [`IpAddr`]; `(NicAddr, endpoint)`; a slice of addresses. Functions that connect
/// (`clan_proto::stream::Stream::connect` and the others) try each address in turn and return
/// the first that works, or the last error.
///
/// ```
/// use clan::{EndpointAddr, ToEndpointAddrs};
///
/// let addrs: Vec<EndpointAddr> = "localhost:7000/3".to_endpoint_addrs()?.collect();
/// assert!(addrs.iter().all(|a| a.nic.port() == 7000 && a.port == 3 && a.nic.ip().is_loopback()));
/// let one = ("127.0.0.1", 7000, 3).to_endpoint_addrs()?.next();
/// assert_eq!(one, Some("127.0.0.1:7000/3".parse()?));
/// assert!("localhost:7000".to_endpoint_addrs().is_err()); // no endpoint
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait ToEndpointAddrs {
    /// The addresses, in the order to try them.
    type Iter: Iterator<Item = EndpointAddr>;
    /// Resolve to addresses: an error when a host name cannot be looked up or the text is
    /// not an address (`ErrorKind::InvalidInput`).
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter>;
}

impl ToEndpointAddrs for EndpointAddr {
    type Iter = std::option::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        Ok(Some(*self).into_iter())
    }
}

impl ToEndpointAddrs for (NicAddr, u32) {
    type Iter = std::option::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        Ok(Some(EndpointAddr::new(self.0, self.1)).into_iter())
    }
}

impl ToEndpointAddrs for (IpAddr, u16, u32) {
    type Iter = std::option::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        Ok(Some(EndpointAddr::new(NicAddr::new(self.0, self.1), self.2)).into_iter())
    }
}

impl ToEndpointAddrs for (&str, u16, u32) {
    type Iter = std::vec::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        let (host, port, ep) = *self;
        let found: Vec<EndpointAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))?
            .map(|s| EndpointAddr::new(NicAddr::from(s), ep))
            .collect();
        Ok(found.into_iter())
    }
}

impl ToEndpointAddrs for str {
    type Iter = std::vec::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        if let Ok(a) = self.parse::<EndpointAddr>() {
            return Ok(vec![a].into_iter());
        }
        let invalid = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("invalid endpoint address {self:?}: expected host:port/endpoint, e.g. node7:7000/3"),
            )
        };
        let (host_port, ep) = self.rsplit_once('/').ok_or_else(invalid)?;
        let ep: u32 = ep.parse().map_err(|_| invalid())?;
        let (host, port) = host_port.rsplit_once(':').ok_or_else(invalid)?;
        let port: u16 = port.parse().map_err(|_| invalid())?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        (host, port, ep).to_endpoint_addrs()
    }
}

impl ToEndpointAddrs for String {
    type Iter = std::vec::IntoIter<EndpointAddr>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        self.as_str().to_endpoint_addrs()
    }
}

impl<'a> ToEndpointAddrs for &'a [EndpointAddr] {
    type Iter = std::iter::Copied<std::slice::Iter<'a, EndpointAddr>>;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        Ok(self.iter().copied())
    }
}

impl<T: ToEndpointAddrs + ?Sized> ToEndpointAddrs for &T {
    type Iter = T::Iter;
    fn to_endpoint_addrs(&self) -> std::io::Result<Self::Iter> {
        (**self).to_endpoint_addrs()
    }
}

/// Try `f` on each address `addrs` names, in turn: the first success, or the last error
/// (`InvalidInput` when `addrs` names none).
///
/// ```
/// use clan::{EndpointAddr, each_endpoint_addr};
///
/// let addrs: [EndpointAddr; 2] = ["127.0.0.1:1/1".parse()?, "127.0.0.1:2/2".parse()?];
/// let mut tried = Vec::new();
/// let r: std::io::Result<u32> = each_endpoint_addr(&addrs[..], |a| {
///     tried.push(a.port);
///     if a.port == 2 { Ok(a.port) } else { Err(std::io::Error::other("refused")) }
/// });
/// assert_eq!(r?, 2);
/// assert_eq!(tried, [1, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn each_endpoint_addr<A, T, E>(addrs: A, mut f: impl FnMut(EndpointAddr) -> Result<T, E>) -> Result<T, E>
where
    A: ToEndpointAddrs,
    E: From<std::io::Error>,
{
    let mut last = None;
    for a in addrs.to_endpoint_addrs()? {
        match f(a) {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the address resolved to no endpoint address").into()
    }))
}

impl From<EndpointAddr> for clan_wire::control::EndpointId {
    fn from(e: EndpointAddr) -> Self {
        clan_wire::control::EndpointId { nic: e.nic.socket_addr(), port: e.port }
    }
}

impl From<clan_wire::control::EndpointId> for EndpointAddr {
    fn from(e: clan_wire::control::EndpointId) -> Self {
        EndpointAddr::new(NicAddr::from(e.nic), e.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for s in ["127.0.0.1:7000", "[::1]:9", "10.77.0.2:65535"] {
            let a: NicAddr = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
            let e = EndpointAddr::new(a, 42);
            assert_eq!(e.to_string().parse::<EndpointAddr>().unwrap(), e);
        }
        assert!("nonsense".parse::<NicAddr>().is_err());
        assert!("127.0.0.1:1/x".parse::<EndpointAddr>().is_err());
    }

    #[test]
    fn names_resolve_to_endpoint_addrs() {
        let e: EndpointAddr = "127.0.0.1:7000/3".parse().unwrap();
        assert_eq!(e.to_endpoint_addrs().unwrap().collect::<Vec<_>>(), [e]);
        assert_eq!("127.0.0.1:7000/3".to_endpoint_addrs().unwrap().collect::<Vec<_>>(), [e]);
        assert_eq!(String::from("[::1]:9/1").to_endpoint_addrs().unwrap().count(), 1);
        let local: Vec<_> = "localhost:7000/3".to_endpoint_addrs().unwrap().collect();
        assert!(!local.is_empty() && local.iter().all(|a| a.nic.ip().is_loopback() && a.port == 3));
        assert_eq!(("127.0.0.1", 7000, 3).to_endpoint_addrs().unwrap().next(), Some(e));
        assert_eq!((e.nic, 3).to_endpoint_addrs().unwrap().next(), Some(e));
        for bad in ["localhost:7000", "localhost/3", "localhost:x/3", "localhost:7000/y", ""] {
            let err = bad.to_endpoint_addrs().unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{bad}");
        }
        let two = [e, EndpointAddr::new(e.nic, 4)];
        let mut tried = Vec::new();
        let r: Result<(), std::io::Error> = each_endpoint_addr(&two[..], |a| {
            tried.push(a.port);
            Err(std::io::Error::other("no"))
        });
        assert!(r.is_err());
        assert_eq!(tried, [3, 4]);
        let empty: &[EndpointAddr] = &[];
        let r: Result<(), std::io::Error> = each_endpoint_addr(empty, |_| Ok(()));
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn users_are_uids_here_and_hosts_across_links() {
        use clan_wire::connect::Sender;
        let p = |pid, uid| PeerIdentity::Process { pid, uid };
        let r = |ip: [u8; 4], port| PeerIdentity::Remote {
            nic: NicAddr::new(IpAddr::from(ip), port),
            source: IpAddr::from(ip),
        };
        assert!(p(1, 1000).same_user(&p(2, 1000)));
        assert!(!p(1, 1000).same_user(&p(1, 1001)));
        assert!(r([10, 77, 0, 2], 7000).same_user(&r([10, 77, 0, 2], 7001)));
        assert!(!r([10, 77, 0, 2], 7000).same_user(&r([10, 77, 0, 3], 7000)));
        assert!(!p(1, 0).same_user(&r([127, 0, 0, 1], 1)));
        assert_eq!((p(5, 7).uid(), p(5, 7).pid(), r([10, 77, 0, 2], 1).uid()), (Some(7), Some(5), None));
        assert_eq!(p(5, 7).to_string(), "pid 5 uid 7");
    }
}
