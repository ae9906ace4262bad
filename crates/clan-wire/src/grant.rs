//! The import grant, sans-IO: may this importer have this aperture? One decision for every
//! path — an endpoint of the exporter's own process, another process of the host (over the
//! control channel), another host (over a link) — and one vocabulary of refusals
//! ([`Refusal`]), carried on the wire as [`crate::control::Code`] within a host and
//! [`Status`] across hosts, and reported to the importer as the same error either way.
//!
//! The driver establishes the facts (the descriptor parses and names this NIC, the aperture is
//! exported in that generation, its key verifies the descriptor); this module decides what the
//! exporter's [`Policy`] says about the [`Importer`]:
//!
//! - user and process restrictions need kernel-verified credentials: a process of this host
//!   has them (the connection's `SO_PEERCRED`); a peer on another host has none, so such a
//!   restriction always refuses it;
//! - an endpoint restriction needs the importing endpoint's NIC to be verified: within a host
//!   the NIC the connection's hello named (verified to be the connecting process's), across
//!   hosts the link's peer (authenticated with a cluster key, or claimed without one).

use std::net::SocketAddr;

use crate::control::{Code, EndpointId};
use crate::frame::Status;

/// Why an import is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The descriptor does not parse.
    Malformed,
    /// The descriptor names another NIC.
    NotOurs,
    /// The aperture is no longer exported (or never was, in that generation).
    Revoked,
    /// The descriptor's tag does not verify (forged or altered), or disagrees with the
    /// aperture.
    BadKey,
    /// The policy's user restriction excludes the importer.
    DeniedUid,
    /// The policy's process restriction excludes the importer.
    DeniedPid,
    /// The policy's endpoint restriction excludes the importer (or its NIC is not verified).
    DeniedEndpoint,
    /// The policy restricts users or processes, and the importer (on another host) has no
    /// credentials that could be checked.
    DeniedCredentials,
    /// No producer ring is free in the aperture's event queue.
    TooManyProducers,
    /// The importer holds as many imports as it may.
    TooMany,
    /// The descriptor grants less than its whole aperture, and was asked for over a path that
    /// would hand over the aperture's memory (a process of the exporter's host): such grants
    /// are served mediated, through a link.
    Narrowed,
    /// The exporter failed (out of descriptors, …).
    Internal,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::Malformed => "the descriptor is malformed",
            Refusal::NotOurs => "the descriptor names another NIC",
            Refusal::Revoked => "the aperture is no longer exported",
            Refusal::BadKey => "the descriptor does not verify",
            Refusal::DeniedUid => "the exporter does not allow this user",
            Refusal::DeniedPid => "the exporter does not allow this process",
            Refusal::DeniedEndpoint => "the exporter does not allow this endpoint",
            Refusal::DeniedCredentials => "the exporter restricts users or processes, which another host cannot prove",
            Refusal::TooManyProducers => "the aperture's event queue has no free producer ring",
            Refusal::TooMany => "the importer holds as many imports as it may",
            Refusal::Narrowed => "a grant narrower than its aperture is served through a link only",
            Refusal::Internal => "the exporter failed",
        })
    }
}

impl std::error::Error for Refusal {}

/// Who may import (empty lists: anyone holding the descriptor).
#[derive(Debug, Clone, Copy)]
pub struct Policy<'a> {
    /// Allowed users.
    pub uids: &'a [u32],
    /// Allowed processes.
    pub pids: &'a [u32],
    /// Allowed importing endpoints.
    pub endpoints: &'a [EndpointId],
    /// Allowed importing NICs (any endpoint of them).
    pub nics: &'a [SocketAddr],
}

/// Who asks, with what the transport established about it.
#[derive(Debug, Clone, Copy)]
pub enum Importer {
    /// A process of this host (or the exporter's own): kernel-verified credentials.
    Process {
        /// Its user.
        uid: u32,
        /// Its process.
        pid: u32,
        /// The importing endpoint (as the request names it).
        endpoint: EndpointId,
        /// The NIC verified to be the process's (for its own process: the exporter's NIC).
        verified_nic: Option<SocketAddr>,
    },
    /// A peer on another host.
    Remote {
        /// The importing endpoint (as the request names it).
        endpoint: EndpointId,
        /// The link's peer.
        link_peer: SocketAddr,
    },
}

/// What the policy says of the importer.
pub fn decide(policy: &Policy<'_>, importer: &Importer) -> Result<(), Refusal> {
    match *importer {
        Importer::Process { uid, pid, endpoint, verified_nic } => {
            if !policy.uids.is_empty() && !policy.uids.contains(&uid) {
                return Err(Refusal::DeniedUid);
            }
            if !policy.pids.is_empty() && !policy.pids.contains(&pid) {
                return Err(Refusal::DeniedPid);
            }
            if !policy.endpoints.is_empty()
                && (verified_nic != Some(endpoint.nic) || !policy.endpoints.contains(&endpoint))
            {
                return Err(Refusal::DeniedEndpoint);
            }
            if !policy.nics.is_empty() && !verified_nic.is_some_and(|n| policy.nics.contains(&n)) {
                return Err(Refusal::DeniedEndpoint);
            }
        }
        Importer::Remote { endpoint, link_peer } => {
            if !policy.uids.is_empty() || !policy.pids.is_empty() {
                return Err(Refusal::DeniedCredentials);
            }
            if !policy.endpoints.is_empty() && (endpoint.nic != link_peer || !policy.endpoints.contains(&endpoint)) {
                return Err(Refusal::DeniedEndpoint);
            }
            if !policy.nics.is_empty() && !policy.nics.contains(&link_peer) {
                return Err(Refusal::DeniedEndpoint);
            }
        }
    }
    Ok(())
}

impl From<Refusal> for Code {
    fn from(r: Refusal) -> Code {
        match r {
            Refusal::Malformed => Code::Malformed,
            Refusal::NotOurs => Code::NotOurs,
            Refusal::Revoked => Code::Revoked,
            Refusal::BadKey => Code::BadKey,
            Refusal::DeniedUid => Code::DeniedUid,
            Refusal::DeniedPid => Code::DeniedPid,
            Refusal::DeniedEndpoint | Refusal::DeniedCredentials => Code::DeniedEndpoint,
            Refusal::TooManyProducers => Code::TooManyProducers,
            Refusal::TooMany => Code::TooMany,
            Refusal::Narrowed => Code::Narrowed,
            Refusal::Internal => Code::Internal,
        }
    }
}

impl From<Refusal> for Status {
    fn from(r: Refusal) -> Status {
        match r {
            Refusal::Malformed => Status::Malformed,
            Refusal::NotOurs => Status::NotOurs,
            Refusal::Revoked => Status::Revoked,
            Refusal::BadKey => Status::BadKey,
            Refusal::DeniedUid | Refusal::DeniedPid | Refusal::DeniedCredentials => Status::Denied,
            Refusal::DeniedEndpoint => Status::DeniedEndpoint,
            Refusal::TooManyProducers | Refusal::TooMany => Status::TooMany,
            Refusal::Narrowed | Refusal::Internal => Status::Other,
        }
    }
}

impl Refusal {
    /// The refusal a control-channel code carries (None: not a refusal of an import).
    pub fn from_code(c: Code) -> Option<Refusal> {
        Some(match c {
            Code::Malformed => Refusal::Malformed,
            Code::NotOurs => Refusal::NotOurs,
            Code::Revoked => Refusal::Revoked,
            Code::BadKey => Refusal::BadKey,
            Code::DeniedUid => Refusal::DeniedUid,
            Code::DeniedPid => Refusal::DeniedPid,
            Code::DeniedEndpoint => Refusal::DeniedEndpoint,
            Code::TooManyProducers => Refusal::TooManyProducers,
            Code::TooMany => Refusal::TooMany,
            Code::Narrowed => Refusal::Narrowed,
            Code::Internal => Refusal::Internal,
            _ => return None,
        })
    }

    /// The refusal a link status carries (None: not a refusal of an import).
    pub fn from_status(s: Status) -> Option<Refusal> {
        Some(match s {
            Status::Malformed => Refusal::Malformed,
            Status::NotOurs => Refusal::NotOurs,
            Status::Revoked => Refusal::Revoked,
            Status::BadKey => Refusal::BadKey,
            Status::Denied => Refusal::DeniedCredentials,
            Status::DeniedEndpoint => Refusal::DeniedEndpoint,
            Status::TooMany => Refusal::TooMany,
            Status::Other => Refusal::Internal,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_decision_for_every_path() {
        let me: SocketAddr = "10.77.0.1:7000".parse().unwrap();
        let ep = EndpointId { nic: me, port: 3 };
        let other = EndpointId { nic: "10.77.0.2:7000".parse().unwrap(), port: 3 };
        let open = Policy { uids: &[], pids: &[], endpoints: &[], nics: &[] };
        let by_uid = Policy { uids: &[1000], pids: &[], endpoints: &[], nics: &[] };
        let by_ep = Policy { uids: &[], pids: &[], endpoints: &[ep], nics: &[] };
        let by_nic = Policy { uids: &[], pids: &[], endpoints: &[], nics: &[me] };
        let local = |uid, verified| Importer::Process { uid, pid: 9, endpoint: ep, verified_nic: verified };
        assert_eq!(decide(&open, &local(0, None)), Ok(()));
        assert_eq!(decide(&by_uid, &local(1000, None)), Ok(()));
        assert_eq!(decide(&by_uid, &local(0, None)), Err(Refusal::DeniedUid));
        assert_eq!(decide(&by_ep, &local(0, Some(me))), Ok(()));
        assert_eq!(decide(&by_ep, &local(0, None)), Err(Refusal::DeniedEndpoint), "an unverified NIC");
        let remote = |e, peer| Importer::Remote { endpoint: e, link_peer: peer };
        assert_eq!(decide(&by_uid, &remote(ep, me)), Err(Refusal::DeniedCredentials));
        assert_eq!(decide(&by_ep, &remote(ep, me)), Ok(()));
        assert_eq!(decide(&by_ep, &remote(ep, other.nic)), Err(Refusal::DeniedEndpoint), "a forged endpoint");
        assert_eq!(decide(&by_nic, &local(0, Some(me))), Ok(()));
        assert_eq!(decide(&by_nic, &local(0, Some(other.nic))), Err(Refusal::DeniedEndpoint));
        assert_eq!(decide(&by_nic, &local(0, None)), Err(Refusal::DeniedEndpoint), "an unverified NIC");
        assert_eq!(decide(&by_nic, &remote(other, me)), Ok(()), "any endpoint of the NIC");
        assert_eq!(decide(&by_nic, &remote(ep, other.nic)), Err(Refusal::DeniedEndpoint));
        for r in [Refusal::Revoked, Refusal::BadKey, Refusal::DeniedEndpoint, Refusal::TooMany, Refusal::Malformed] {
            assert_eq!(Refusal::from_code(Code::from(r)), Some(r));
            assert_eq!(Refusal::from_status(Status::from(r)).map(Status::from), Some(Status::from(r)));
        }
    }
}
