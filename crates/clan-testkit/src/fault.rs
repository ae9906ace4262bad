//! A fault-injecting TCP proxy.
//!
//! Put it between two NICs (`NicConfig::routes` sends one NIC's link through it) and make
//! the link misbehave on demand: delay every chunk, stop forwarding without closing (a silent
//! path, which keepalive must detect), drop every connection now, or cut them after a number
//! of bytes — in the middle of whatever frame is passing.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug)]
struct Shared {
    target: SocketAddr,
    delay_us: AtomicU64,
    cut_at: AtomicU64,
    forwarded: AtomicU64,
    silent: AtomicBool,
    stop: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
}

/// A TCP proxy that injects faults.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listen on 127.0.0.1 (or the target's address family) and forward to `target`.
    pub fn start(target: SocketAddr) -> std::io::Result<FaultProxy> {
        let bind: SocketAddr =
            if target.is_ipv4() { "127.0.0.1:0".parse() } else { "[::1]:0".parse() }.expect("literal address");
        FaultProxy::start_on(bind, target)
    }

    /// Listen on `bind` and forward to `target`.
    pub fn start_on(bind: SocketAddr, target: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            target,
            delay_us: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
            forwarded: AtomicU64::new(0),
            silent: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let acceptor = std::thread::spawn(move || accept_loop(listener, s));
        Ok(FaultProxy { addr, shared, acceptor: Some(acceptor) })
    }

    /// Where to connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delay every forwarded chunk by `d`.
    pub fn set_delay(&self, d: Duration) {
        self.shared.delay_us.store(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Stop forwarding (bytes are held back) without closing anything, or resume.
    pub fn set_silent(&self, on: bool) {
        self.shared.silent.store(on, Ordering::Relaxed);
    }

    /// After `bytes` more bytes (in either direction), cut every connection abruptly.
    pub fn cut_after(&self, bytes: u64) {
        let now = self.shared.forwarded.load(Ordering::Relaxed);
        self.shared.cut_at.store(now.saturating_add(bytes), Ordering::Relaxed);
    }

    /// Close every connection now.
    pub fn drop_connections(&self) {
        for c in self.shared.conns.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Bytes forwarded so far.
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.drop_connections();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, s: Arc<Shared>) {
    while !s.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((client, _)) => {
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect_timeout(&s.target, Duration::from_secs(5)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    let mut c = s.conns.lock().unwrap_or_else(|e| e.into_inner());
                    for x in [&client, &server] {
                        if let Ok(d) = x.try_clone() {
                            c.push(d);
                        }
                    }
                }
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (Ok(f), Ok(t)) = (from.try_clone(), to.try_clone()) else { continue };
                    let s = s.clone();
                    std::thread::spawn(move || pump(f, t, s));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, s: Arc<Shared>) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = vec![0u8; 64 << 10];
    let mut held: Vec<u8> = Vec::new();
    loop {
        if s.stop.load(Ordering::Relaxed) {
            break;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => 0,
            Err(_) => break,
        };
        held.extend_from_slice(&buf[..n]);
        if held.is_empty() || s.silent.load(Ordering::Relaxed) {
            continue;
        }
        let delay = s.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        let before = s.forwarded.fetch_add(held.len() as u64, Ordering::Relaxed);
        let cut = s.cut_at.load(Ordering::Relaxed);
        if before.saturating_add(held.len() as u64) >= cut {
            let keep = cut.saturating_sub(before) as usize;
            let _ = to.write_all(&held[..keep.min(held.len())]);
            let _ = to.flush();
            for c in s.conns.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
            break;
        }
        if to.write_all(&held).is_err() {
            break;
        }
        held.clear();
    }
    let _ = to.shutdown(Shutdown::Write);
}
