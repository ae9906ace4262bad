//! The event-driven server example: an RpcServer's queue in an epoll loop next to a TCP
//! listener, many connections, requests on connections chosen at random.

#[path = "../examples/event_server.rs"]
#[allow(dead_code)]
mod example;

use std::io::Read;

use clan::Nic;

#[test]
fn one_thread_serves_many_connections_and_other_descriptors() {
    let nic = Nic::open_default().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let (n2, s2) = (nic.clone(), stop.clone());
    let server = std::thread::spawn(move || example::serve(&n2, 300, tx, s2));
    let (addr, stats) = rx.recv().unwrap();
    let rtts = example::client(&nic, addr, 200, 5000);
    assert_eq!(rtts.len(), 5000);
    // The TCP descriptor in the same loop answers too.
    let mut line = String::new();
    std::net::TcpStream::connect(stats).unwrap().read_to_string(&mut line).unwrap();
    let served: u64 = line.trim().strip_prefix("served ").unwrap().parse().unwrap();
    assert_eq!(served, 5000);
    stop.store(true, std::sync::atomic::Ordering::Release);
    assert_eq!(server.join().unwrap(), 5000);
}
