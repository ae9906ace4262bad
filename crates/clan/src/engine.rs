//! The NIC engine: the thread that serves the control channel of this NIC.
//!
//! It waits in epoll (through mio) and is idle unless another NIC of the host imports,
//! unimports or sends an out-of-band message. Data never passes through it: within a host,
//! processes move data with their own loads and stores. A connection's end (the importer
//! exited, was killed, or closed its NIC) releases its imports and retires its event rings.
//!
//! Every request is validated before anything is touched; a connection that sends garbage
//! gets an error reply and is dropped after [`MAX_BAD`] bad messages, and a connection whose
//! peer does not read its replies is dropped rather than allowed to stall the engine.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use clan_shm::seqpacket::{PeerCred, SeqPacket};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::ctl::{self, Code, Reply, Request};
use crate::nic::NicInner;

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
/// Bad messages tolerated on one connection.
pub const MAX_BAD: u32 = 8;

/// Server-side state of one connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub sock: SeqPacket,
    pub cred: PeerCred,
    pub id: u64,
    pub hello: Option<crate::addr::NicAddr>,
    /// Whether `hello` was checked to be a NIC of the connecting process.
    pub verified: Option<bool>,
    pub imports: HashMap<u64, (u32, u32)>,
    pub eqs: HashSet<u32>,
    pub bad: u32,
}

#[derive(Debug)]
pub(crate) struct Engine {
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    pub fn start(nic: Weak<NicInner>, listener: SeqPacket) -> std::io::Result<Engine> {
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("clan-engine".into())
            .spawn(move || run(nic, listener, poll, s))?;
        Ok(Engine {
            waker,
            stop,
            thread: Some(thread),
        })
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            // The last handle of the NIC may be dropped by the engine itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn run(nic: Weak<NicInner>, listener: SeqPacket, mut poll: Poll, stop: Arc<AtomicBool>) {
    let mut events = Events::with_capacity(256);
    let mut conns: HashMap<Token, Conn> = HashMap::new();
    let mut next_token = 2usize;
    while !stop.load(Ordering::Acquire) {
        if let Err(e) = poll.poll(&mut events, None) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("clan engine: poll failed: {e}");
            break;
        }
        let Some(nic) = nic.upgrade() else { break };
        for ev in events.iter() {
            match ev.token() {
                WAKER => {}
                LISTENER => loop {
                    match listener.accept() {
                        Ok(Some(sock)) => {
                            let Ok(cred) = sock.peer_cred() else { continue };
                            if sock.set_nonblocking(true).is_err() {
                                continue;
                            }
                            let token = Token(next_token);
                            next_token += 1;
                            if poll
                                .registry()
                                .register(
                                    &mut SourceFd(&sock.as_raw_fd()),
                                    token,
                                    Interest::READABLE,
                                )
                                .is_err()
                            {
                                continue;
                            }
                            let id = nic.next_serial();
                            conns.insert(
                                token,
                                Conn {
                                    sock,
                                    cred,
                                    id,
                                    hello: None,
                                    verified: None,
                                    imports: HashMap::new(),
                                    eqs: HashSet::new(),
                                    bad: 0,
                                },
                            );
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!("clan engine: accept failed: {e}");
                            break;
                        }
                    }
                },
                token => {
                    let close = match conns.get_mut(&token) {
                        Some(c) => serve(&nic, c),
                        None => false,
                    };
                    if close {
                        if let Some(c) = conns.remove(&token) {
                            let _ = poll
                                .registry()
                                .deregister(&mut SourceFd(&c.sock.as_raw_fd()));
                            nic.connection_closed(c);
                        }
                    }
                }
            }
        }
    }
    if let Some(nic) = nic.upgrade() {
        for (_, c) in conns.drain() {
            nic.connection_closed(c);
        }
    }
}

/// Serve every pending message of a connection. Returns true if it must be closed.
fn serve(nic: &Arc<NicInner>, c: &mut Conn) -> bool {
    let mut buf = [0u8; ctl::MAX_MSG];
    loop {
        let got = match c.sock.recv(&mut buf) {
            Ok(g) => g,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        };
        if got.len == 0 && got.fds.is_empty() {
            return true; // orderly close, or the process died
        }
        // Requests never carry descriptors: any that came are closed here.
        let req = if got.truncated || !got.fds.is_empty() {
            None
        } else {
            Request::decode(&buf[..got.len]).ok()
        };
        let (reply, fds): (Option<Reply>, Vec<OwnedFd>) = match req {
            None => {
                c.bad += 1;
                (
                    Some(Reply::Err {
                        code: Code::Malformed,
                        detail: "malformed request".into(),
                    }),
                    Vec::new(),
                )
            }
            Some(Request::Hello { nic: addr, pid }) => {
                if pid != c.cred.pid {
                    c.bad += 1;
                    (
                        Some(Reply::Err {
                            code: Code::Malformed,
                            detail: "pid does not match credentials".into(),
                        }),
                        Vec::new(),
                    )
                } else {
                    c.hello = Some(addr);
                    (Some(Reply::HelloOk { nic: nic.addr }), Vec::new())
                }
            }
            Some(_) if c.hello.is_none() => {
                c.bad += 1;
                (
                    Some(Reply::Err {
                        code: Code::NeedHello,
                        detail: "hello first".into(),
                    }),
                    Vec::new(),
                )
            }
            Some(Request::Import {
                importer,
                want_eq,
                desc,
            }) => match nic.grant_import(c, importer, want_eq, &desc) {
                Ok((grant, fds)) => (Some(Reply::ImportOk(grant)), fds),
                Err((code, detail)) => (Some(Reply::Err { code, detail }), Vec::new()),
            },
            Some(Request::Unimport { import_id }) => {
                if let Some((ap, generation)) = c.imports.remove(&import_id) {
                    nic.remote_unref(ap, generation, c.id);
                }
                (None, Vec::new())
            }
            Some(Request::Oob {
                from,
                to_port,
                payload,
            }) => {
                let r = match nic.deliver_oob(from, to_port, payload) {
                    Ok(()) => Reply::Ok,
                    Err(code) => Reply::Err {
                        code,
                        detail: String::new(),
                    },
                };
                (Some(r), Vec::new())
            }
        };
        if let Some(r) = reply {
            let borrowed: Vec<_> = fds.iter().map(|f| std::os::fd::AsFd::as_fd(f)).collect();
            if c.sock.send(&r.encode(), &borrowed).is_err() {
                return true; // the peer does not read: drop it rather than stall
            }
        }
        if c.bad >= MAX_BAD {
            tracing::warn!(
                "clan engine: dropping connection from pid {} after {} bad messages",
                c.cred.pid,
                c.bad
            );
            return true;
        }
    }
}
