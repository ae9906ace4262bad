//! Fuzz harnesses: each drives a decoder or a state machine with arbitrary input and checks
//! its invariants with `assert!` (a violated invariant is a crash, like a panic inside).
//! `fuzz/` runs them under libFuzzer; the tests replay the checked-in corpus through them.
//! Not part of the API.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::connect::{self, Handshakes, Limits};
use crate::control::{Admission, AdmissionLimits, Reply, Request, Session, SessionLimits, Step};
use crate::handshake::{Handshake, HandshakeConfig, HandshakeEvent, Role};

/// A cursor over the fuzzer's bytes (zeros once they run out).
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        h
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn addr(i: u8) -> SocketAddr {
    SocketAddr::from(([10, 77, 0, i % 8], 7000))
}

/// The control channel: both decoders, their round trip, and a serving session fed
/// arbitrary packets. Invariants: nothing is served before a verified hello; an
/// out-of-band message is served only from the verified NIC; a session that was told to
/// close stays closed.
pub fn control(data: &[u8]) {
    let mut inp = Input(data);
    let t0 = Instant::now();
    let mut now = t0;
    let mut s = Session::new(7, t0, SessionLimits::default());
    let mut admission = Admission::new(AdmissionLimits { per_pid: 3, per_uid: 5, total: 8 });
    let mut held: Vec<(u32, u32)> = Vec::new();
    while !inp.is_empty() {
        let ctl = inp.u8();
        let n = usize::from(inp.u8());
        let pkt = inp.take(n).to_vec();
        if let Ok((id, r)) = Request::decode(&pkt) {
            assert_eq!(Request::decode(&r.encode(id)), Ok((id, r)), "request round trip");
        }
        if let Ok((id, r)) = Reply::decode(&pkt) {
            if !matches!(r, Reply::Err { .. }) {
                assert_eq!(Reply::decode(&r.encode(id)), Ok((id, r)), "reply round trip");
            }
        }
        let was_closed = s.is_closed();
        match s.handle_packet(&pkt, usize::from(ctl & 1), ctl & 2 != 0) {
            Step::Verify { .. } => {
                let step = s.hello_verified(ctl & 4 != 0, addr(0));
                if ctl & 4 != 0 {
                    assert!(matches!(step, Step::Reply(_, Reply::HelloOk { .. })));
                    assert!(s.peer().is_some());
                }
            }
            Step::Serve(_, req) => {
                assert!(!was_closed, "served after close");
                let peer = s.peer();
                assert!(peer.is_some(), "served before a verified hello");
                assert!(ctl & 3 == 0, "served a packet with descriptors or truncated");
                if let Request::Oob { from, .. } | Request::OobBatch { from, .. } = req {
                    assert_eq!(Some(from.nic), peer, "an out-of-band message served from another NIC");
                }
                assert!(!matches!(req, Request::Hello { .. }), "a hello is never served");
            }
            Step::Close(..) => assert!(s.is_closed()),
            Step::Reply(..) | Step::Ignore => {}
        }
        if ctl & 8 != 0 {
            now += Duration::from_millis(u64::from(ctl >> 4) * 200);
            s.handle_timeout(now);
        }
        // Admission counting.
        let (pid, uid) = (u32::from(ctl & 3), u32::from((ctl >> 2) & 1));
        if ctl & 16 != 0 && !held.is_empty() {
            let (p, u) = held.swap_remove(usize::from(ctl) % held.len());
            admission.release(p, u);
        } else if admission.admit(pid, uid) {
            held.push((pid, uid));
        }
        assert_eq!(admission.total(), held.len());
        assert!(held.len() <= 8 && held.iter().filter(|(p, _)| *p == pid).count() <= 3);
    }
}

/// The connect/accept machine of one endpoint fed arbitrary operations and messages (raw,
/// or well-formed ones dropped, duplicated and reordered). Invariants: its tables stay
/// within their limits; a request popped was sent, whole, by the peer it names and not
/// withdrawn or expired; nothing from a peer that went away is popped afterwards.
pub fn connect(data: &[u8]) {
    let mut inp = Input(data);
    let limits = Limits {
        max_partial: 8,
        max_partial_per_peer: 3,
        max_partial_per_user: 6,
        partial_ttl: Duration::from_secs(1),
        backlog: 6,
        backlog_per_peer: 4,
        backlog_per_user: 5,
        max_request_ttl: Duration::from_secs(5),
        max_dials: 5,
    };
    let mut h: Handshakes<u32> = Handshakes::new(limits);
    let t0 = Instant::now();
    let mut now = t0;
    // What each peer really sent: (peer, token) → descriptor.
    let mut sent: std::collections::HashMap<(u32, u64), Vec<u8>> = Default::default();
    let mut gone: std::collections::HashSet<u32> = Default::default();
    let mut withdrawn: std::collections::HashSet<(u32, u64)> = Default::default();
    // Keys that raw bytes touched: their content is unpredictable.
    let mut tainted: std::collections::HashSet<(u32, u64)> = Default::default();
    while !inp.is_empty() {
        let op = inp.u8();
        let peer = u32::from(inp.u8() % 4);
        let token = u64::from(inp.u8() % 8);
        match op % 9 {
            0 => {
                let mut p = [0u8; connect::PAYLOAD];
                let b = inp.take(connect::PAYLOAD);
                p[..b.len()].copy_from_slice(b);
                if connect::is_handshake(&p) {
                    // Raw bytes may form a request no test can predict: sent, not checked.
                    let key = (peer, u64::from_le_bytes(p[3..11].try_into().unwrap_or([0; 8])));
                    sent.entry(key).or_default();
                    tainted.insert(key);
                    gone.remove(&peer);
                    // A new request head after a close is a new request, as in op 1 (a
                    // fragment alone never brings a withdrawn one back: the close dropped
                    // its partial).
                    if matches!(connect::Message::decode(&p), Ok(connect::Message::Connect { .. })) {
                        withdrawn.remove(&key);
                    }
                }
                h.handle_message(peer, &p, now);
            }
            1 => {
                // The same descriptor every time for a (peer, token): a resend is a duplicate.
                let n = 1 + (token as usize * 37 + peer as usize * 11) % 200;
                let desc: Vec<u8> = (0..n).map(|i| (i as u8) ^ (token as u8) ^ (peer as u8)).collect();
                let msgs = connect::encode_connect(token, Duration::from_secs(3), &desc);
                sent.insert((peer, token), desc);
                withdrawn.remove(&(peer, token));
                gone.remove(&peer);
                let pattern = inp.u8();
                let mut order: Vec<usize> = (0..msgs.len()).collect();
                if pattern & 1 != 0 {
                    order.reverse();
                }
                for (k, i) in order.into_iter().enumerate() {
                    if pattern & 2 != 0 && k == 1 {
                        continue; // dropped
                    }
                    h.handle_message(peer, &msgs[i], now);
                    if pattern & 4 != 0 {
                        h.handle_message(peer, &msgs[i], now); // duplicated
                    }
                }
            }
            2 => {
                if let Some(r) = h.pop_request(now) {
                    assert!(!gone.contains(&r.from), "a request from a peer that went away");
                    assert!(!withdrawn.contains(&(r.from, r.token)), "a withdrawn request");
                    assert!(r.expires > now, "an expired request");
                    let want = sent.get(&(r.from, r.token));
                    assert!(want.is_some(), "a request nobody sent");
                    if let (Some(w), false) = (want, tainted.contains(&(r.from, r.token))) {
                        assert_eq!(&r.desc, w, "a request's descriptor mixed up or corrupted");
                    }
                }
            }
            3 => {
                h.peers_gone(|p| *p == peer);
                gone.insert(peer);
            }
            4 => {
                now += Duration::from_millis(u64::from(inp.u8()) * 20);
                h.handle_timeout(now);
            }
            5 => {
                h.handle_message(peer, &connect::encode_close(token), now);
                withdrawn.insert((peer, token));
            }
            6 => {
                let _ = h.dial(peer, token, &[1, 2, 3], Duration::from_secs(1));
            }
            7 => h.listen(op & 0x80 != 0),
            _ => {
                let _ = h.take_answer(token);
                let _ = h.cancel_dial(token);
            }
        }
        while h.poll_transmit().is_some() {}
        while h.poll_event().is_some() {}
        assert!(h.backlog_len() <= limits.backlog);
        assert!(h.partial_len() <= limits.max_partial);
        assert!(h.dials_len() <= limits.max_dials);
    }
}

/// One hand-shake fed arbitrary bytes in arbitrary chunks, with timeouts and decisions.
/// Invariants: without the key nobody gets verified (a keyed acceptor never says
/// `Verified`, a keyed dialler is never ready); a dialler is never ready with another NIC
/// than the one it dialled; what it buffers stays bounded.
pub fn handshake(data: &[u8]) {
    let mut inp = Input(data);
    let mode = inp.u8();
    let keyed = mode & 1 != 0;
    let dialler = mode & 2 != 0;
    let expect = addr(2);
    let role = if dialler { Role::Dialler { expect } } else { Role::Acceptor };
    let cfg = HandshakeConfig {
        local: addr(1),
        credit: 1 << 20,
        key: keyed.then_some([0x42; 32]),
        timeout: Duration::from_secs(5),
        hello_timeout: Duration::from_secs(2),
    };
    let t0 = Instant::now();
    let mut h = Handshake::new(role, cfg, [3; 16], t0);
    let mut out = Vec::new();
    while !inp.is_empty() {
        let ctl = inp.u8();
        let n = usize::from(inp.u8());
        let chunk = inp.take(n).to_vec();
        match ctl % 8 {
            0 => h.handle_eof(),
            1 => h.handle_timeout(t0 + Duration::from_millis(u64::from(ctl) * 40)),
            2 => h.decide(ctl & 8 != 0),
            _ => h.handle_data(&chunk),
        }
        h.poll_transmit(&mut out);
        out.clear();
        while let Some(e) = h.poll_event() {
            match e {
                HandshakeEvent::Verified { .. } => assert!(!keyed, "verified without the key"),
                HandshakeEvent::Ready { peer, .. } => {
                    assert!(!keyed, "ready without the key");
                    if dialler {
                        assert_eq!(peer, expect, "ready with another NIC than the one dialled");
                    }
                }
                HandshakeEvent::Failed(_) => {}
            }
        }
        assert!(h.take_rest().len() <= crate::handshake::MAX_BUFFER);
    }
}

/// Two hand-shakes (the same key, or none) over a network that may cut the connection,
/// duplicate, drop or reorder frames, or let time pass. Invariants: they never end ready
/// with anything but each other; without interference both end ready.
pub fn handshake_pair(data: &[u8]) {
    use crate::decoder::{Decoder, Item};
    let mut inp = Input(data);
    let mode = inp.u8();
    let key = (mode & 1 != 0).then_some([0x24; 32]);
    let (d_addr, a_addr) = (addr(1), addr(2));
    let cfg = |local| HandshakeConfig {
        local,
        credit: 1 << 20,
        key,
        timeout: Duration::from_secs(5),
        hello_timeout: Duration::from_secs(2),
    };
    let t0 = Instant::now();
    let mut d = Handshake::new(Role::Dialler { expect: a_addr }, cfg(d_addr), [1; 16], t0);
    let mut a = Handshake::new(Role::Acceptor, cfg(a_addr), [2; 16], t0);
    let mut interfered = false; // (kept for a debugger)
    // Frames in flight each way.
    let mut to_a: Vec<Vec<u8>> = Vec::new();
    let mut to_d: Vec<Vec<u8>> = Vec::new();
    let frames = |bytes: &[u8]| -> Vec<Vec<u8>> {
        let mut dec = Decoder::new();
        let mut out = Vec::new();
        let mut at = 0;
        while let Ok(Some((Item::Frame(_), used))) = dec.next(&bytes[at..]) {
            out.push(bytes[at..at + used].to_vec());
            at += used;
        }
        out
    };
    for _ in 0..64 {
        let mut b = Vec::new();
        d.poll_transmit(&mut b);
        to_a.extend(frames(&b));
        b.clear();
        a.poll_transmit(&mut b);
        to_d.extend(frames(&b));
        while let Some(e) = a.poll_event() {
            if let HandshakeEvent::Verified { peer } = e {
                assert_eq!(peer, d_addr);
                a.decide(true);
            }
        }
        let ctl = inp.u8();
        let (queue, target) = if ctl & 1 == 0 { (&mut to_a, &mut a) } else { (&mut to_d, &mut d) };
        if queue.is_empty() && ctl & 0xf0 == 0 {
            if to_a.is_empty() && to_d.is_empty() {
                break;
            }
            continue;
        }
        match (ctl >> 4) % 8 {
            1 if !queue.is_empty() => {
                queue.remove(0);
                interfered = true;
            }
            2 if !queue.is_empty() => {
                let f = queue[0].clone();
                queue.insert(0, f);
                interfered = true;
            }
            3 if queue.len() > 1 => {
                queue.swap(0, 1);
                interfered = true;
            }
            4 => {
                target.handle_eof();
                interfered = true;
            }
            5 => {
                let t = t0 + Duration::from_millis(u64::from(ctl) * 30);
                d.handle_timeout(t);
                a.handle_timeout(t);
                interfered = true;
            }
            _ if !queue.is_empty() => {
                let f = queue.remove(0);
                target.handle_data(&f);
            }
            _ => {}
        }
    }
    while let Some(e) = a.poll_event() {
        if let HandshakeEvent::Verified { .. } = e {
            a.decide(true);
        }
    }
    for (h, other) in [(&mut d, a_addr), (&mut a, d_addr)] {
        while let Some(e) = h.poll_event() {
            if let HandshakeEvent::Ready { peer, .. } = e {
                assert_eq!(peer, other, "ready with a stranger");
            }
        }
    }
    let _ = interfered;
}
