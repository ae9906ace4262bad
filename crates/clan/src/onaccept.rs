//! Imports granted on accept: the client of a connection between two NICs of this host asks,
//! just before its connect request and on the same control connection, for the import of
//! whatever descriptor the server will accept it with (`Request::ImportOnAccept`). The
//! engine files that here; the server's accepting thread takes it in
//! [`crate::ConnectRequest::accept`] and sends the grant on that control connection before
//! its answer to the connect goes out. The client finds the grant waiting when the answer
//! wakes it: no import request, and no wake-up of our engine to serve one.
//!
//! A request never taken (the connect was refused, never accepted, or its entry was pushed
//! out) is never answered: the client, finding no grant when the answer comes, imports as
//! usual. So nothing here must be kept for the client's sake, and the list is bounded
//! ([`MAX_FILED`]): past it, the oldest requests go.
//!
//! What a grant made here needs of the control connection (the socket, the peer's kernel
//! credentials, the imports made through it) is shared with the engine, which owns the
//! connection: the engine holds the only strong reference to the socket, so a connection
//! the engine dropped is never written to from here, and a grant made after the engine
//! released the connection's imports is refused ([`HostGrants::closed`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, Weak};

use clan_shm::seqpacket::{PeerCred, SeqPacket};

use crate::addr::{EndpointAddr, NicAddr};

/// Requests filed at most, by all host connections together.
pub(crate) const MAX_FILED: usize = 1024;

/// The imports granted through one host connection, and the queues its process was given
/// ports in: released when the connection ends.
#[derive(Debug, Default)]
pub(crate) struct HostGrants {
    /// By import id: the aperture `(id, generation)`.
    pub imports: HashMap<u64, (u32, u32)>,
    /// Queues that gave the connection's process a port.
    pub eqs: HashSet<u32>,
    /// The engine released the connection's grants: no more may be made through it.
    pub closed: bool,
}

/// Who a grant goes to: the process at the other end of a host connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grantee {
    pub cred: PeerCred,
    /// The host connection's serial (what the aperture table and the ports count by).
    pub id: u64,
    /// The NIC its verified hello named.
    pub hello: Option<NicAddr>,
}

/// An `ImportOnAccept` waiting for its connect to be accepted.
#[derive(Debug)]
pub(crate) struct Filed {
    /// The control connection it came on (the engine's; gone with it).
    pub sock: Weak<SeqPacket>,
    pub grants: Weak<Mutex<HostGrants>>,
    pub who: Grantee,
    /// The request's id (its reply carries it).
    pub id: u32,
    pub importer: EndpointAddr,
}

/// The filed requests, by (the client's verified NIC, the connect's token).
#[derive(Debug, Default)]
pub(crate) struct OnAccept {
    map: HashMap<(NicAddr, u64), Filed>,
    /// Keys in the order they were filed (some taken already: skipped when met).
    order: VecDeque<(NicAddr, u64)>,
}

impl OnAccept {
    /// File a request (one filed before with the same key is replaced); past [`MAX_FILED`],
    /// the oldest go.
    pub fn file(&mut self, nic: NicAddr, token: u64, f: Filed) {
        if self.map.insert((nic, token), f).is_none() {
            self.order.push_back((nic, token));
        }
        while self.map.len() > MAX_FILED {
            match self.order.pop_front() {
                Some(k) => {
                    self.map.remove(&k);
                }
                None => break,
            }
        }
        // Keys of requests taken meanwhile stay in `order` until met: keep it bounded too.
        if self.order.len() > 2 * MAX_FILED {
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
    }

    /// The request filed by `nic` for the connect with `token`, taken.
    pub fn take(&mut self, nic: NicAddr, token: u64) -> Option<Filed> {
        self.map.remove(&(nic, token))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filed(id: u32) -> Filed {
        Filed {
            sock: Weak::new(),
            grants: Weak::new(),
            who: Grantee { cred: PeerCred { pid: 1, uid: 2, gid: 3 }, id: 4, hello: None },
            id,
            importer: "127.0.0.1:9/1".parse().unwrap(),
        }
    }

    /// Past the bound the oldest requests go, one for each new one; those taken meanwhile
    /// are skipped, and the order list stays bounded however many are filed and taken.
    #[test]
    fn filed_requests_past_the_bound_lose_their_oldest() {
        let nic: NicAddr = "127.0.0.1:9".parse().unwrap();
        let mut o = OnAccept::default();
        let n = MAX_FILED as u64;
        for t in 0..n {
            o.file(nic, t, filed(t as u32));
        }
        assert!(o.take(nic, 3).is_some());
        assert!(o.take(nic, 3).is_none(), "taken once");
        for t in n..n + 10 {
            o.file(nic, t, filed(t as u32));
        }
        assert_eq!(o.len(), MAX_FILED);
        // 10 new over one free place: the 9 oldest still filed went (0..10 but 3).
        assert!((0..10).all(|t| o.take(nic, t).is_none()));
        assert!(o.take(nic, 10).is_some());
        // Another NIC's request with the same token is another request.
        let other: NicAddr = "127.0.0.1:10".parse().unwrap();
        o.file(other, 11, filed(1));
        assert_eq!(o.take(other, 11).map(|f| f.id), Some(1));
        assert!(o.take(nic, 11).is_some());
        for t in 0..20 * n {
            o.file(nic, 1_000_000 + t, filed(0));
            o.take(nic, 1_000_000 + t);
        }
        assert!(o.order.len() <= 2 * MAX_FILED + 1, "{}", o.order.len());
    }
}
