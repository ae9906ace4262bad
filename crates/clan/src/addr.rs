//! Addresses: a NIC is a host address and a port; an endpoint is a NIC and an endpoint port.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::str::FromStr;

/// The address of a NIC: the host address it is reachable at and its port.
///
/// On one host, NICs find each other through the abstract Unix socket named after this
/// address (abstract names are scoped to the network namespace, i.e. to the virtual host);
/// across hosts, through a link to `ip:port`.
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
}
