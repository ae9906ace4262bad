//! Reliable-datagram endpoints (`FI_EP_RDM`) over clan's distributed queue: each endpoint
//! listens for senders with a [`QueueListener`]; a send to an address connects a
//! [`MsgSender`] to that address's listener the first time (announcing its own address
//! first, so that receives can be directed by source) and puts the message in the
//! receiver's ring. Receiving matches arrivals against posted receives in order (tag and
//! source for tagged receives), keeping unmatched arrivals until a receive is posted.
//! Progress is made when the application reads a completion queue or posts (the
//! provider's data progress is manual). Safe Rust: the bytes go to the application's buffers
//! in `ffi`, which owns the pointers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use clan::Nic;
use clan_proto::queue::{MsgReceiver, MsgSender, QueueConfig, QueueError, QueueListener};

use crate::av::Addr;

/// The process's NIC (one for every endpoint).
fn nic() -> Result<&'static Nic, Error> {
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

#[derive(Default)]
struct State {
    senders: HashMap<[u8; crate::av::ADDR_LEN], std::sync::Arc<Mutex<MsgSender>>>,
    receivers: Vec<(MsgReceiver, Option<Addr>)>,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Arrival>,
}

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
}

impl Drop for Rdm {
    fn drop(&mut self) {
        self.shared.closed.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn take_senders(shared: std::sync::Arc<Shared>) {
    use std::sync::atomic::Ordering;
    while !shared.closed.load(Ordering::Acquire) {
        match shared.listener.accept(Some(Duration::from_millis(100))) {
            Ok(rx) => shared.state.lock().unwrap_or_else(|p| p.into_inner()).receivers.push((rx, None)),
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
    pub fn open() -> Result<Rdm, Error> {
        let listener = QueueListener::bind(nic()?, config())?;
        let me = Addr::of(listener.local_addr());
        let shared = std::sync::Arc::new(Shared {
            listener,
            state: Mutex::new(State::default()),
            closed: std::sync::atomic::AtomicBool::new(false),
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
                let mut tx = MsgSender::connect(nic()?, dest, &config())?;
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
        if r.is_err() {
            // A broken connection is made again by the next send.
            self.lock().senders.remove(to.bytes());
        }
        r?;
        Ok(())
    }

    /// Post a receive: matched at once against what already arrived, if anything did.
    pub fn post(&self, p: Posted) -> Option<(Posted, Arrival)> {
        let mut s = self.lock();
        if let Some(i) = s.unexpected.iter().position(|a| p.matches(a)) {
            let a = s.unexpected.remove(i)?;
            return Some((p, a));
        }
        s.posted.push_back(p);
        None
    }

    /// Take in new senders and what arrived; the receives it completes.
    pub fn progress(&self) -> Vec<(Posted, Arrival)> {
        let mut done = Vec::new();
        let mut s = self.lock();
        let mut arrivals = Vec::new();
        let mut dead = Vec::new();
        for (i, (rx, from)) in s.receivers.iter_mut().enumerate() {
            loop {
                match rx.pending() {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(_) => {
                        dead.push(i);
                        break;
                    }
                }
                // (a message's parts come as its sender writes them: wait for the rest)
                let Ok(m) = rx.recv(Some(Duration::from_secs(5))) else {
                    dead.push(i);
                    break;
                };
                if m.data.len() < HEADER {
                    continue;
                }
                let word = |k: usize| u64::from_le_bytes(m.data[k * 8..k * 8 + 8].try_into().unwrap_or_default());
                let flags = word(0);
                if flags & F_HELLO != 0 {
                    *from = Addr::from_bytes(&m.data[HEADER..]).ok();
                    continue;
                }
                arrivals.push(Arrival {
                    data: m.data[HEADER..].to_vec(),
                    tagged: flags & F_TAGGED != 0,
                    tag: word(1),
                    cq_data: (flags & F_DATA != 0).then(|| word(2)),
                    from: *from,
                });
            }
        }
        for i in dead.into_iter().rev() {
            s.receivers.swap_remove(i);
        }
        for a in arrivals {
            match s.posted.iter().position(|p| p.matches(&a)) {
                Some(i) => {
                    if let Some(p) = s.posted.remove(i) {
                        done.push((p, a));
                    }
                }
                None => s.unexpected.push_back(a),
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

    #[test]
    fn messages_match_posted_receives_in_order_by_tag_and_source() {
        let a = Rdm::open().unwrap();
        let b = Rdm::open().unwrap();
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
        let (p, m) = b.post(posted(1, true, 7)).expect("matched at once");
        assert_eq!((p.context, m.data.as_slice(), m.cq_data, m.from), (1, &b"tagged 7"[..], Some(99), Some(a.addr())));
        let (_, m) = b.post(posted(2, false, 0)).unwrap();
        assert_eq!(m.data, b"one");
        // Directed: only from `a`; a receive from elsewhere waits.
        let c = Rdm::open().unwrap();
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
        assert_eq!((done[0].0.context, done[0].1.data.as_slice()), (4, &b"from a"[..]));
        assert_eq!(b.cancel(3).map(|p| p.context), Some(3));
        assert!(b.cancel(3).is_none());
    }
}
