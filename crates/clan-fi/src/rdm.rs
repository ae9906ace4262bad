//! Reliable-datagram endpoints (`FI_EP_RDM`) over clan's distributed queue: each endpoint
//! listens for senders with a [`QueueListener`]; a send to an address connects a
//! [`MsgSender`] to that address's listener the first time (announcing its own address
//! first, so that receives can be directed by source) and puts the message in the
//! receiver's ring. Receiving matches arrivals against posted receives in order (tag and
//! source for tagged receives), keeping unmatched arrivals until a receive is posted.
//! Progress is made when the application reads a completion queue or posts (the
//! provider's data progress is manual). Safe Rust: the bytes go to the application's buffers
//! in `ffi`, which owns the pointers.
//!
//! Waiting: every receiver's endpoint reports to one event queue (the domain's, whose
//! descriptor is the completion queues' `FI_WAIT_FD`). A waiter arms each receiver's
//! readiness tripwire, looks again ([`Rdm::prepare_wait`]), then sleeps on the queue; the
//! sender's store of its write counter, the end of a connection and a newly accepted sender
//! (posted by the acceptor thread) wake it. Nothing spins.
//!
//! A peer that goes away (its process killed, or its endpoint closed) is noticed when its
//! connection ends: what it sent is still delivered, then receives directed to it fail
//! ([`Done::Failed`]), as do sends to it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use clan::{EventQueue, Nic, Tripwire};
use clan_proto::SetupError;
use clan_proto::queue::{MsgReceiver, MsgSender, QueueConfig, QueueError, QueueListener};

use crate::av::Addr;

/// The process's NIC (one for every endpoint).
pub(crate) fn nic() -> Result<&'static Nic, Error> {
    static NIC: OnceLock<Result<Nic, String>> = OnceLock::new();
    NIC.get_or_init(|| Nic::open(clan::NicConfig::default()).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Nic(e.clone()))
}

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("clan is not available: {0}")]
    Nic(String),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("the address is not a clan endpoint")]
    BadAddr,
    #[error("the message is longer than the endpoint takes ({0} bytes)")]
    TooLong(usize),
    #[error("the peer went away")]
    PeerGone,
}

/// Bytes before the payload of every message: flags, tag, remote CQ data.
const HEADER: usize = 24;
const F_TAGGED: u64 = 1;
const F_DATA: u64 = 2;
const F_HELLO: u64 = 4;

/// Longest message.
pub const MAX_MSG: usize = 1 << 20;

fn config() -> QueueConfig {
    QueueConfig { slots: 64, slot_size: 2048, spin: Duration::ZERO, ..QueueConfig::default() }
}

/// A receive the application posted (its buffer as an address: `ffi` writes into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    pub buf: usize,
    pub len: usize,
    pub context: usize,
    pub tagged: bool,
    pub tag: u64,
    pub ignore: u64,
    /// Only from this address (directed receive).
    pub from: Option<Addr>,
}

/// A message that arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    pub data: Vec<u8>,
    pub tagged: bool,
    pub tag: u64,
    pub cq_data: Option<u64>,
    pub from: Option<Addr>,
}

impl Posted {
    fn matches(&self, a: &Arrival) -> bool {
        self.tagged == a.tagged
            && (!self.tagged || (self.tag ^ a.tag) & !self.ignore == 0)
            && self.from.is_none_or(|f| a.from == Some(f))
    }
}

/// What progress finished: a receive matched by an arrival, or a receive directed to a
/// peer that went away.
#[derive(Debug)]
pub enum Done {
    Received(Posted, Arrival),
    Failed(Posted),
}

/// A sender's queue into this endpoint.
struct Rx {
    rx: MsgReceiver,
    /// Who it is (its hello says).
    from: Option<Addr>,
    /// Armed by a waiter: fires when the sender publishes.
    ready: Tripwire,
}

#[derive(Default)]
struct State {
    senders: HashMap<[u8; crate::av::ADDR_LEN], std::sync::Arc<Mutex<MsgSender>>>,
    receivers: Vec<Rx>,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Arrival>,
    /// Peers whose connection to us ended (until they connect again).
    gone: HashSet<[u8; crate::av::ADDR_LEN]>,
}

/// The cookie of receivers' readiness events, and of the acceptor's wake-up.
const READY: u64 = 1;

/// An endpoint. A thread of its own takes in new senders (a sender's connect waits for
/// that, and must not wait for this application to look).
pub struct Rdm {
    shared: std::sync::Arc<Shared>,
    me: Addr,
}

struct Shared {
    listener: QueueListener,
    state: Mutex<State>,
    closed: std::sync::atomic::AtomicBool,
    /// Where receivers report (the domain's queue).
    queue: EventQueue,
}

impl Drop for Rdm {
    fn drop(&mut self) {
        self.shared.closed.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn take_senders(shared: std::sync::Arc<Shared>) {
    use std::sync::atomic::Ordering;
    while !shared.closed.load(Ordering::Acquire) {
        match shared.listener.accept_to(&shared.queue, Some(Duration::from_millis(100))) {
            Ok(rx) => {
                let Ok(ready) = rx.readiness_tripwire(READY) else { continue };
                shared.state.lock().unwrap_or_else(|p| p.into_inner()).receivers.push(Rx { rx, from: None, ready });
                // A waiter that looked before this receiver was there looks again.
                shared.queue.post_user(READY);
            }
            Err(QueueError::Timeout) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

impl std::fmt::Debug for Rdm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rdm").field("addr", &self.me.text()).finish()
    }
}

impl Rdm {
    /// A new endpoint whose receivers report to `queue`.
    pub fn open(queue: &EventQueue) -> Result<Rdm, Error> {
        let listener = QueueListener::bind(nic()?, config())?;
        let me = Addr::of(listener.local_addr());
        let shared = std::sync::Arc::new(Shared {
            listener,
            state: Mutex::new(State::default()),
            closed: std::sync::atomic::AtomicBool::new(false),
            queue: queue.clone(),
        });
        let s2 = shared.clone();
        std::thread::Builder::new()
            .name("clan-fi-accept".into())
            .spawn(move || take_senders(s2))
            .map_err(|e| Error::Nic(e.to_string()))?;
        Ok(Rdm { shared, me })
    }

    /// Its address (what `fi_getname` gives).
    pub fn addr(&self) -> Addr {
        self.me
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send `data` to `to` (copied out when this returns).
    pub fn send(&self, to: Addr, data: &[u8], tagged: bool, tag: u64, cq_data: Option<u64>) -> Result<(), Error> {
        if data.len() > MAX_MSG {
            return Err(Error::TooLong(MAX_MSG));
        }
        let existing = self.lock().senders.get(to.bytes()).cloned();
        let tx = match existing {
            Some(tx) => tx,
            None => {
                // (connecting without the lock: the peer's acceptor thread may be ours)
                let dest = to.endpoint().ok_or(Error::BadAddr)?;
                let mut tx = MsgSender::connect(nic()?, dest, &config()).map_err(|e| match e {
                    QueueError::Setup(SetupError::Connect(_)) => Error::PeerGone,
                    e => Error::Queue(e),
                })?;
                let mut hello = vec![0u8; HEADER];
                hello[..8].copy_from_slice(&F_HELLO.to_le_bytes());
                hello.extend_from_slice(self.me.bytes());
                tx.send(0, &hello)?;
                self.lock().senders.entry(*to.bytes()).or_insert_with(|| std::sync::Arc::new(Mutex::new(tx))).clone()
            }
        };
        let mut m = Vec::with_capacity(HEADER + data.len());
        let flags = if tagged { F_TAGGED } else { 0 } | if cq_data.is_some() { F_DATA } else { 0 };
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&tag.to_le_bytes());
        m.extend_from_slice(&cq_data.unwrap_or(0).to_le_bytes());
        m.extend_from_slice(data);
        // Only this peer's sender is held while it waits for room (never the receive side).
        let r = tx.lock().unwrap_or_else(|p| p.into_inner()).send(0, &m);
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                // A broken connection is made again by the next send.
                self.lock().senders.remove(to.bytes());
                Err(match e {
                    QueueError::Disconnected | QueueError::Access(_) => Error::PeerGone,
                    e => Error::Queue(e),
                })
            }
        }
    }

    /// Post a receive: matched at once against what already arrived, if anything did; failed
    /// at once if it is directed to a peer that went away.
    pub fn post(&self, p: Posted) -> Option<Done> {
        let mut s = self.lock();
        if let Some(i) = s.unexpected.iter().position(|a| p.matches(a)) {
            let a = s.unexpected.remove(i)?;
            return Some(Done::Received(p, a));
        }
        if p.from.is_some_and(|f| s.gone.contains(f.bytes())) {
            return Some(Done::Failed(p));
        }
        s.posted.push_back(p);
        None
    }

    /// Before sleeping on the queue: arm every receiver's readiness tripwire and look again.
    /// `true`: nothing has arrived and every sender is still there (sleep; a sender's next
    /// message wakes the queue); `false`: make progress first.
    pub fn prepare_wait(&self) -> bool {
        let s = self.lock();
        for r in &s.receivers {
            if r.ready.arm().is_err() {
                return false;
            }
        }
        // (after arming: a message published before the arm is seen here, one after it
        // fires the tripwire)
        s.receivers.iter().all(|r| r.rx.pending().is_ok_and(|n| n == 0) && r.rx.is_connected())
    }

    /// Take in what arrived; the receives it completes (and those directed to peers that
    /// went away, which fail).
    pub fn progress(&self) -> Vec<Done> {
        let mut done = Vec::new();
        let mut s = self.lock();
        let mut arrivals = Vec::new();
        let mut dead = Vec::new();
        for (i, r) in s.receivers.iter_mut().enumerate() {
            loop {
                match r.rx.pending() {
                    Ok(0) => {
                        // (looked at after `pending`: a sender that published and then went
                        // away has its last messages taken before it counts as gone)
                        if !r.rx.is_connected() {
                            dead.push(i);
                        }
                        break;
                    }
                    Ok(_) => {}
                    Err(_) => {
                        dead.push(i);
                        break;
                    }
                }
                // (a message's parts come as its sender writes them: wait for the rest)
                let Ok(m) = r.rx.recv(Some(Duration::from_secs(5))) else {
                    dead.push(i);
                    break;
                };
                if m.data.len() < HEADER {
                    continue;
                }
                let word = |k: usize| u64::from_le_bytes(m.data[k * 8..k * 8 + 8].try_into().unwrap_or_default());
                let flags = word(0);
                if flags & F_HELLO != 0 {
                    r.from = Addr::from_bytes(&m.data[HEADER..]).ok();
                    continue;
                }
                arrivals.push(Arrival {
                    data: m.data[HEADER..].to_vec(),
                    tagged: flags & F_TAGGED != 0,
                    tag: word(1),
                    cq_data: (flags & F_DATA != 0).then(|| word(2)),
                    from: r.from,
                });
            }
        }
        for i in dead.into_iter().rev() {
            let r = s.receivers.swap_remove(i);
            if let Some(f) = r.from {
                s.gone.insert(*f.bytes());
                s.senders.remove(f.bytes());
            }
        }
        // A peer that connected again is back.
        let back: Vec<_> = s.receivers.iter().filter_map(|r| r.from).filter(|f| s.gone.contains(f.bytes())).collect();
        for f in back {
            s.gone.remove(f.bytes());
        }
        for a in arrivals {
            match s.posted.iter().position(|p| p.matches(&a)) {
                Some(i) => {
                    if let Some(p) = s.posted.remove(i) {
                        done.push(Done::Received(p, a));
                    }
                }
                None => s.unexpected.push_back(a),
            }
        }
        // Receives directed to a peer that went away can never complete.
        let mut k = 0;
        while k < s.posted.len() {
            if s.posted[k].from.is_some_and(|f| s.gone.contains(f.bytes())) {
                if let Some(p) = s.posted.remove(k) {
                    done.push(Done::Failed(p));
                }
            } else {
                k += 1;
            }
        }
        done
    }

    /// Cancel the posted receive with `context`; whether there was one.
    pub fn cancel(&self, context: usize) -> Option<Posted> {
        let mut s = self.lock();
        let i = s.posted.iter().position(|p| p.context == context)?;
        s.posted.remove(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn posted(ctx: usize, tagged: bool, tag: u64) -> Posted {
        Posted { buf: 0, len: 64, context: ctx, tagged, tag, ignore: 0, from: None }
    }

    fn queue() -> EventQueue {
        nic().unwrap().event_queue(clan::EventQueueConfig::default()).unwrap()
    }

    fn received(d: Done) -> (Posted, Arrival) {
        match d {
            Done::Received(p, a) => (p, a),
            Done::Failed(p) => panic!("failed: {p:?}"),
        }
    }

    #[test]
    fn messages_match_posted_receives_in_order_by_tag_and_source() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        // Before anything is posted: kept.
        a.send(b.addr(), b"one", false, 0, None).unwrap();
        a.send(b.addr(), b"tagged 7", true, 7, Some(99)).unwrap();
        let mut got = Vec::new();
        for _ in 0..1000 {
            got.extend(b.progress());
            if b.lock().unexpected.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(got.is_empty());
        // A tagged receive for tag 7 takes the tagged one, not the first.
        let (p, m) = received(b.post(posted(1, true, 7)).expect("matched at once"));
        assert_eq!((p.context, m.data.as_slice(), m.cq_data, m.from), (1, &b"tagged 7"[..], Some(99), Some(a.addr())));
        let (_, m) = received(b.post(posted(2, false, 0)).unwrap());
        assert_eq!(m.data, b"one");
        // Directed: only from `a`; a receive from elsewhere waits.
        let c = Rdm::open(&q).unwrap();
        assert!(b.post(Posted { from: Some(c.addr()), ..posted(3, false, 0) }).is_none());
        assert!(b.post(Posted { from: Some(a.addr()), ..posted(4, false, 0) }).is_none());
        a.send(b.addr(), b"from a", false, 0, None).unwrap();
        let mut done = Vec::new();
        for _ in 0..1000 {
            done.extend(b.progress());
            if !done.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(done.len(), 1);
        let (p, m) = received(done.remove(0));
        assert_eq!((p.context, m.data.as_slice()), (4, &b"from a"[..]));
        assert_eq!(b.cancel(3).map(|p| p.context), Some(3));
        assert!(b.cancel(3).is_none());
    }

    /// A waiter sleeps on the queue (nothing pending) and is woken by a message; a peer that
    /// goes away fails the receives directed to it, after what it sent was delivered.
    #[test]
    fn waiting_wakes_for_messages_and_a_gone_peer_fails_directed_receives() {
        let q = queue();
        let a = Rdm::open(&q).unwrap();
        let b = Rdm::open(&q).unwrap();
        a.send(b.addr(), b"first", false, 0, None).unwrap();
        // Until the message is taken, b must not sleep.
        let mut got = Vec::new();
        for _ in 0..2000 {
            got.extend(b.progress());
            if !b.lock().unexpected.is_empty() {
                break;
            }
            if b.prepare_wait() {
                let _ = q.wait(Some(Duration::from_millis(50)));
            }
        }
        assert_eq!(b.lock().unexpected.len(), 1);
        assert!(b.prepare_wait(), "nothing pending: safe to sleep");
        while q.try_take().is_some() {}
        let t = std::thread::spawn({
            let to = b.addr();
            move || {
                std::thread::sleep(Duration::from_millis(30));
                a.send(to, b"second", false, 0, None).unwrap();
                a
            }
        });
        // Woken by the sender's store, not by a timeout.
        let woke = q.wait(Some(Duration::from_secs(20)));
        assert!(woke.is_ok(), "{woke:?}");
        let a = t.join().unwrap();
        // Directed receives from `a`: the next message, then `a` goes away.
        let from = Some(a.addr());
        let first = b.post(Posted { from, ..posted(1, false, 0) }).map(received).unwrap();
        assert_eq!(first.1.data, b"first");
        assert!(b.post(Posted { from, ..posted(5, false, 0) }).is_none());
        let mut done = Vec::new();
        for _ in 0..2000 {
            done.extend(b.progress().into_iter().map(received));
            if !done.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(done[0].1.data, b"second");
        assert!(b.post(Posted { from, ..posted(2, false, 0) }).is_none(), "waits for a live peer");
        drop(a);
        let mut failed = None;
        for _ in 0..2000 {
            if let Some(Done::Failed(p)) = b.progress().into_iter().next() {
                failed = Some(p.context);
                break;
            }
            if b.prepare_wait() {
                let _ = q.wait(Some(Duration::from_millis(50)));
            }
        }
        assert_eq!(failed, Some(2), "the receive directed to the gone peer failed");
        assert!(
            matches!(b.post(Posted { from, ..posted(3, false, 0) }), Some(Done::Failed(_))),
            "and later ones at once"
        );
    }
}
