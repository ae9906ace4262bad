//! The Tripwire paper's event-driven server (§5.3): one thread, one epoll loop in which the
//! clan event queue of all connections is one descriptor next to a TCP listener (a plain
//! "stats" port), a callback per connection, the queue drained and then polled 15 µs before
//! the loop sleeps. A client with N connections sends requests on connections chosen at
//! random, one in flight.
//!
//! ```sh
//! cargo run --release -p clan-proto --example event_server -- 1000
//! ```

use std::cell::RefCell;
use std::io::{Read, Write};
use std::rc::Rc;
use std::time::{Duration, Instant};

use clan::{Nic, NicConfig};
use clan_proto::rpc::{RpcClient, RpcConfig, RpcServer};
use clan_proto::server::EventLoop;

/// Run the server loop until `stop` says so; returns the requests answered.
pub fn serve(
    nic: &Nic,
    max_conns: u32,
    ready: std::sync::mpsc::Sender<(clan::EndpointAddr, std::net::SocketAddr)>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> u64 {
    let rpc = RpcServer::bind(nic, RpcConfig { max_msg: 4096, ..RpcConfig::default() }, max_conns).unwrap();
    let addr = rpc.local_addr();
    let q = rpc.event_queue().clone();
    let rpc = Rc::new(RefCell::new(rpc));
    let served = Rc::new(RefCell::new(0u64));
    let mut el = EventLoop::new(Duration::from_micros(15)).unwrap();
    let (r2, s2) = (rpc.clone(), served.clone());
    // The callback per connection: answer the request in place, reply straight into the client.
    el.add_queue(&q, move |ev| {
        let n = r2
            .borrow_mut()
            .handle_event(ev, &mut |conn, req, reply| {
                let mut b = vec![0u8; req.len() as usize];
                let _ = req.copy_to(&mut b);
                let _ = reply.write(&conn.0.to_le_bytes());
                let _ = reply.write(&b);
            })
            .unwrap_or(0);
        *s2.borrow_mut() += n;
    })
    .unwrap();
    // Next to it, an ordinary TCP listener: connect and read the count of requests served.
    let mut tcp = mio::net::TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    let listener = Rc::new(tcp_addr);
    let s3 = served.clone();
    let tcp_cell = Rc::new(RefCell::new(None::<mio::net::TcpListener>));
    let tc = tcp_cell.clone();
    el.add_source(&mut tcp, mio::Interest::READABLE, move |_| {
        if let Some(l) = tc.borrow().as_ref() {
            while let Ok((mut s, _)) = l.accept() {
                let _ = writeln!(s, "served {}", s3.borrow());
            }
        }
    })
    .unwrap();
    *tcp_cell.borrow_mut() = Some(tcp);
    let _ = listener;
    ready.send((addr, tcp_addr)).unwrap();
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        el.run_once(Some(Duration::from_millis(20))).unwrap();
    }
    served.take()
}

/// A client with `n` connections sending `requests` requests, each on a connection chosen
/// at random; returns the round-trip times.
pub fn client(nic: &Nic, addr: clan::EndpointAddr, n: usize, requests: usize) -> Vec<Duration> {
    let mut conns: Vec<RpcClient> = (0..n)
        .map(|_| RpcClient::connect(nic, addr, &RpcConfig { max_msg: 4096, ..RpcConfig::default() }).unwrap())
        .collect();
    let mut x = 0x9E37_79B9u64;
    let mut rtts = Vec::with_capacity(requests);
    let mut reply = Vec::new();
    for i in 0..requests {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = (x % n as u64) as usize;
        let req = (i as u64).to_le_bytes();
        let t0 = Instant::now();
        conns[k].call(&req, &mut reply, Some(Duration::from_secs(30))).unwrap();
        rtts.push(t0.elapsed());
        assert_eq!(&reply[8..], &req, "the reply answers this request");
    }
    rtts
}

#[allow(dead_code)]
fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100);
    let nic = Nic::open(NicConfig::default()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let (n2, s2) = (nic.clone(), stop.clone());
    let server = std::thread::spawn(move || serve(&n2, n as u32 + 16, tx, s2));
    let (addr, stats) = rx.recv().unwrap();
    let mut rtts = client(&nic, addr, n, 100_000);
    rtts.sort();
    println!("{n} connections: RTT p50 {:?}, p99 {:?}", rtts[rtts.len() / 2], rtts[rtts.len() * 99 / 100]);
    let mut line = String::new();
    std::net::TcpStream::connect(stats).unwrap().read_to_string(&mut line).unwrap();
    print!("stats port says: {line}");
    stop.store(true, std::sync::atomic::Ordering::Release);
    println!("server answered {}", server.join().unwrap());
}
