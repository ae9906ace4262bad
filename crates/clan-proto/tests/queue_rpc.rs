//! The distributed message queue (slots, multi-part, metadata, header landing, DMA) and
//! message transfer / RPC (flags and tripwires, in place, event-driven server).

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::time::Duration;

use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::queue::{Header, Message, MsgSender, QueueConfig, QueueListener};
use clan_proto::rpc::{ChannelSender, RpcClient, RpcConfig, RpcListener, RpcServer};
use util::Watchdog;

const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn linked() -> Nic {
    Nic::open(NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }).unwrap()
}

fn queue_roundtrip(a: &Nic, b: &Nic) {
    let cfg = QueueConfig { slots: 8, slot_size: 256, ..QueueConfig::default() };
    let l = QueueListener::bind(b, cfg.clone()).unwrap();
    let addr = l.local_addr();
    let a2 = a.clone();
    let c2 = cfg.clone();
    let t = std::thread::spawn(move || {
        let mut tx = MsgSender::connect(&a2, addr, &c2).unwrap();
        // Small, exactly one slot, multi-part longer than the whole ring, empty.
        for i in 0..200u64 {
            let len = [0usize, 1, 224, 225, 5000][i as usize % 5];
            let data: Vec<u8> = (0..len).map(|k| (k as u64 * 31 + i) as u8).collect();
            tx.send(i, &data).unwrap();
        }
        tx
    });
    let mut rx = l.accept(WAIT).unwrap();
    for i in 0..200u64 {
        let len = [0usize, 1, 224, 225, 5000][i as usize % 5];
        let data: Vec<u8> = (0..len).map(|k| (k as u64 * 31 + i) as u8).collect();
        assert_eq!(rx.recv(WAIT).unwrap(), Message { meta: i, data }, "message {i}");
    }
    let _tx = t.join().unwrap();
}

#[test]
fn queue_messages_within_a_host() {
    let _wd = Watchdog::new("queue shm", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    queue_roundtrip(&nic, &nic);
}

#[test]
fn queue_messages_across_a_link() {
    let _wd = Watchdog::new("queue link", Duration::from_secs(120));
    queue_roundtrip(&linked(), &linked());
}

#[test]
fn queue_in_place_header_landing_and_dma() {
    let _wd = Watchdog::new("queue in place", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let cfg = QueueConfig { slots: 4, slot_size: 64 << 10, dma_threshold: 1024, ..QueueConfig::default() };
    let l = QueueListener::bind(&nic, cfg.clone()).unwrap();
    let (n2, c2, addr) = (nic.clone(), cfg.clone(), l.local_addr());
    // Connecting completes when the listener accepts: from another thread.
    let t = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2).unwrap());
    let mut rx = l.accept(WAIT).unwrap();
    let mut tx = t.join().unwrap();
    tx.send(7, b"in place").unwrap();
    assert_eq!(rx.wait_header(WAIT).unwrap(), Header { meta: 7, len: 8 });
    let got = rx.recv_in_place(WAIT, |meta, d| (meta, d.to_vec())).unwrap();
    assert_eq!(got, (7, b"in place".to_vec()));
    // By DMA from a local aperture: header now, body and counter by a chain.
    let ep = nic.endpoint().unwrap();
    let src = ep.export(64 << 10).unwrap();
    let body: Vec<u8> = (0..60_000u32).map(|i| (i % 241) as u8).collect();
    src.write(0, &body).unwrap();
    let t = tx.send_from(9, &src, 0, 60_000).unwrap().expect("went by DMA");
    assert_eq!(rx.wait_header(WAIT).unwrap(), Header { meta: 9, len: 60_000 });
    let m = rx.recv(WAIT).unwrap();
    t.wait(WAIT).unwrap();
    assert_eq!(m.meta, 9);
    assert!(m.data == body);
    // Small ones go by PIO.
    assert!(tx.send_from(10, &src, 0, 100).unwrap().is_none());
    assert_eq!(rx.recv(WAIT).unwrap().data, body[..100]);
    // A multi-part message cannot be lent in place.
    tx.send(11, &vec![1u8; 100_000]).unwrap_or(());
    assert!(rx.recv_in_place(WAIT, |_, _| ()).is_err());
}

#[test]
fn channel_and_rpc() {
    let _wd = Watchdog::new("rpc", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    // One-way message transfer: tx_ready / rx_ready.
    let l = RpcListener::bind(&nic, RpcConfig { max_msg: 4096, ..RpcConfig::default() }).unwrap();
    let (n2, addr) = (nic.clone(), l.local_addr());
    let t = std::thread::spawn(move || {
        let mut tx = ChannelSender::connect(&n2, addr, &RpcConfig::default()).unwrap();
        for i in 0..100u32 {
            tx.send(&i.to_le_bytes(), WAIT).unwrap();
        }
        assert!(tx.send(&[0u8; 5000], WAIT).is_err(), "too long for the receiver's buffer");
    });
    let mut rx = l.accept_channel(WAIT).unwrap();
    for i in 0..100u32 {
        assert_eq!(rx.recv(WAIT).unwrap(), i.to_le_bytes());
    }
    t.join().unwrap();

    // RPC with an event-driven server in its own thread.
    let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16).unwrap();
    let addr = server.local_addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let st = std::thread::spawn(move || {
        let mut total = 0;
        while !s2.load(std::sync::atomic::Ordering::Acquire) {
            total += server
                .run_once(Some(Duration::from_millis(50)), &mut |_, req, reply| {
                    // In place: sum the request's words, reply straight into the client.
                    let mut b = vec![0u8; req.len() as usize];
                    req.copy_to(&mut b).unwrap();
                    let sum: u64 = b.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).sum();
                    reply.write(&sum.to_le_bytes()).unwrap();
                    reply.write(&b[..8.min(b.len())]).unwrap();
                })
                .unwrap();
        }
        total
    });
    let clients: Vec<_> = (0..4)
        .map(|k| {
            let nic = nic.clone();
            std::thread::spawn(move || {
                let mut c = RpcClient::connect(&nic, addr, &RpcConfig::default()).unwrap();
                let mut reply = Vec::new();
                for i in 0..300u64 {
                    let req: Vec<u8> = [i, k, 5].iter().flat_map(|w| w.to_le_bytes()).collect();
                    c.call(&req, &mut reply, WAIT).unwrap();
                    assert_eq!(u64::from_le_bytes(reply[..8].try_into().unwrap()), i + k + 5);
                    assert_eq!(&reply[8..], &req[..8]);
                }
                // Zero-copy both ways.
                let n = c
                    .call_with(
                        WAIT,
                        |w| w.write_at(8, &1u64.to_le_bytes()).and_then(|_| w.write_at(0, &2u64.to_le_bytes())),
                        |r| r.len(),
                    )
                    .unwrap();
                assert_eq!(n, 16);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    assert_eq!(st.join().unwrap(), 4 * 301);
}
