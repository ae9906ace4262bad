//! The distributed message queue (slots, multi-part, metadata, header landing, DMA) and
//! message transfer / RPC (flags and tripwires, in place, event-driven server).

#[path = "../../clan/tests/util/mod.rs"]
mod util;

mod blocked;

use std::time::Duration;

use blocked::Waiter;
use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::queue::{HEADER, Header, Message, MsgSender, QueueConfig, QueueError, QueueListener};
use clan_proto::rpc::{ChannelSender, RpcClient, RpcConfig, RpcError, RpcListener, RpcServer};
use util::Watchdog;

const WAIT: Option<Duration> = Some(Duration::from_secs(60));
/// For what must succeed or fail at once: a wrong wait fails fast.
const SHORT: Option<Duration> = Some(Duration::from_secs(5));

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
    // Every other message (so both of every length) polled into a reused buffer.
    let mut buf = Vec::new();
    for i in 0..200u64 {
        let len = [0usize, 1, 224, 225, 5000][i as usize % 5];
        let data: Vec<u8> = (0..len).map(|k| (k as u64 * 31 + i) as u8).collect();
        if i % 2 == 0 {
            assert_eq!(rx.recv(WAIT).unwrap(), Message { meta: i, data }, "message {i}");
            continue;
        }
        let deadline = std::time::Instant::now() + WAIT.unwrap();
        let meta = loop {
            if let Some(meta) = rx.try_recv_into(&mut buf).unwrap() {
                break meta;
            }
            assert!(std::time::Instant::now() < deadline, "message {i} never came");
            std::thread::yield_now();
        };
        assert_eq!(Message { meta, data: buf.clone() }, Message { meta: i, data }, "message {i}, polled");
    }
    let _tx = t.join().unwrap();
}

/// The messages of `queue_batches`: mostly small, some one slot long, some multi-part.
fn batch_message(i: u64) -> Vec<u8> {
    let len = [0usize, 8, 64, 224, 1, 5000, 200, 64][i as usize % 8];
    (0..len).map(|k| (k as u64 * 7 + i * 13) as u8).collect()
}

fn queue_batches(a: &Nic, b: &Nic) {
    const N: u64 = 3000;
    let cfg = QueueConfig { slots: 16, slot_size: 256, ..QueueConfig::default() };
    let l = QueueListener::bind(b, cfg.clone()).unwrap();
    let addr = l.local_addr();
    let (a2, c2) = (a.clone(), cfg.clone());
    let t = std::thread::spawn(move || {
        let mut tx = MsgSender::connect(&a2, addr, &c2).unwrap();
        let all: Vec<Vec<u8>> = (0..N).map(batch_message).collect();
        // Batches of 1 to 40 messages: runs longer than the free slots, runs that reach the
        // ring's end, multi-part messages in the middle of a batch.
        let mut i = 0usize;
        let mut k = 0usize;
        while i < all.len() {
            let n = (k * 7 % 40 + 1).min(all.len() - i);
            let batch: Vec<(u64, &[u8])> = (i..i + n).map(|j| (j as u64, &all[j][..])).collect();
            tx.send_batch(&batch).unwrap();
            i += n;
            k += 1;
        }
        tx
    });
    let mut rx = l.accept(WAIT).unwrap();
    for i in 0..N {
        if i % 5 == 0 {
            // A header landed: it is the next message's, whole.
            let h = rx.wait_header(WAIT).unwrap();
            assert_eq!(h, Header { meta: i, len: batch_message(i).len() as u64 }, "header {i}");
        }
        assert_eq!(rx.recv(WAIT).unwrap(), Message { meta: i, data: batch_message(i) }, "message {i}");
    }
    let _tx = t.join().unwrap();
}

#[test]
fn queue_batches_within_a_host() {
    let _wd = Watchdog::new("queue batches shm", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    queue_batches(&nic, &nic);
}

#[test]
fn queue_batches_across_a_link() {
    let _wd = Watchdog::new("queue batches link", Duration::from_secs(120));
    queue_batches(&linked(), &linked());
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
    // A multi-part message cannot be lent in place: refused as such (at once: a wait that
    // ran into the time limit would say `Timeout`), and left in the queue for `recv`.
    let long: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    tx.send(11, &long).unwrap();
    let e = rx.recv_in_place(SHORT, |_, _| ()).unwrap_err();
    assert!(matches!(e, QueueError::BadConfig(_)), "refused as multi-part, not {e:?}");
    let m = rx.recv(SHORT).unwrap();
    assert_eq!(m.meta, 11, "the refused message is still the next one");
    assert!(m.data == long, "and intact");
}

/// A header wait armed before anything was sent wakes when the header lands, while the rest
/// of the message is still to come: the message is six slots long and the ring holds three,
/// so the sender cannot finish it until the receiver, woken, takes the first parts.
#[test]
fn a_header_wait_armed_first_wakes_while_the_body_is_still_to_come() {
    let _wd = Watchdog::new("header wait armed first", Duration::from_secs(30));
    let nic = Nic::open_default().unwrap();
    let cfg = QueueConfig { slots: 4, slot_size: 256, ..QueueConfig::default() };
    let l = QueueListener::bind(&nic, cfg.clone()).unwrap();
    let (n2, c2, addr) = (nic.clone(), cfg.clone(), l.local_addr());
    let t = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2).unwrap());
    let rx = l.accept(WAIT).unwrap();
    let mut tx = t.join().unwrap();
    let payload = (cfg.slot_size - HEADER) as usize;
    let body: Vec<u8> = (0..5 * payload + 100).map(|i| (i * 7 % 253) as u8).collect();

    // The receiver waits in its own thread; the sender starts once it sleeps there.
    let (me_tx, me_rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        me_tx.send(Waiter::current()).unwrap();
        let h = rx.wait_header(SHORT);
        (rx, h)
    });
    me_rx.recv().unwrap().wait_asleep(Duration::from_secs(10));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = sent.clone();
    let b2 = body.clone();
    let sender = std::thread::spawn(move || {
        tx.send(42, &b2).unwrap();
        s2.store(true, std::sync::atomic::Ordering::Release);
        tx
    });
    let (mut rx, h) = waiter.join().unwrap();
    assert_eq!(h.unwrap(), Header { meta: 42, len: body.len() as u64 }, "woken by the header");
    assert!(!sent.load(std::sync::atomic::Ordering::Acquire), "the sender is still sending the body");
    // Taking the message lets the sender finish it.
    let m = rx.recv(SHORT).unwrap();
    assert_eq!(m.meta, 42);
    assert!(m.data == body, "all of it, intact");
    let tx = sender.join().unwrap();
    assert!(sent.load(std::sync::atomic::Ordering::Acquire));
    assert_eq!((tx.sent(), rx.received()), (6, 6), "six slots");
}

/// A sender that sends its last message and goes away at once: the receiver still gets
/// that message (its acknowledgement has nowhere to go, and that loses nothing), then
/// learns that the sender is gone.
#[test]
fn a_channel_keeps_the_last_message_of_a_sender_gone() {
    let _wd = Watchdog::new("channel, sender gone", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let l = RpcListener::bind(&nic, RpcConfig::default()).unwrap();
    let (n2, addr) = (nic.clone(), l.local_addr());
    let t = std::thread::spawn(move || {
        let mut tx = ChannelSender::connect(&n2, addr, &RpcConfig::default()).unwrap();
        tx.send(b"last words", WAIT).unwrap();
        drop(tx);
    });
    let mut rx = l.accept_channel(WAIT).unwrap();
    t.join().unwrap(); // gone before the message is taken
    assert_eq!(rx.recv(WAIT).unwrap(), b"last words");
    assert!(rx.recv(SHORT).is_err(), "then the sender is reported gone");
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
        // Too long for the receiver's buffer: refused as such (a sender that waited for
        // `tx_ready` in vain would say `Timeout`), before anything was written.
        let e = tx.send(&[0u8; 5000], SHORT).unwrap_err();
        assert!(matches!(e, RpcError::TooLong { len: 5000, max: 4096 }), "refused as too long, not {e:?}");
        // So the channel goes on.
        tx.send(b"after", SHORT).unwrap();
        tx
    });
    let mut rx = l.accept_channel(WAIT).unwrap();
    for i in 0..100u32 {
        assert_eq!(rx.recv(WAIT).unwrap(), i.to_le_bytes());
    }
    assert_eq!(rx.recv(SHORT).unwrap(), b"after", "the refused message left nothing behind");
    let _tx = t.join().unwrap();

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

/// A message sent by DMA is published by its chain, after its body; a message sent by PIO
/// right behind it must not publish it earlier (the counter covers every slot before it).
#[test]
fn a_pio_send_behind_a_dma_send_does_not_publish_it_early() {
    let _wd = Watchdog::new("pio behind dma", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let cfg = QueueConfig { slots: 8, slot_size: 64 << 10, dma_threshold: 1024, ..QueueConfig::default() };
    let l = QueueListener::bind(&nic, cfg.clone()).unwrap();
    let (n2, c2, addr) = (nic.clone(), cfg.clone(), l.local_addr());
    let t = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2).unwrap());
    let mut rx = l.accept(WAIT).unwrap();
    let mut tx = t.join().unwrap();
    let ep = nic.endpoint().unwrap();
    let src = ep.export(64 << 10).unwrap();
    let body: Vec<u8> = (0..60_000u32).map(|i| (i % 239) as u8 | 1).collect();
    src.write(0, &body).unwrap();
    for round in 0..20u64 {
        let t = tx.send_from(3 * round, &src, 0, 60_000).unwrap().expect("went by DMA");
        tx.send(3 * round + 1, b"by PIO, right behind").unwrap();
        assert!(tx.send_from(3 * round + 2, &src, 0, 100).unwrap().is_none(), "by PIO");
        let m = rx.recv(SHORT).unwrap();
        assert_eq!(m.meta, 3 * round);
        assert!(m.data == body, "round {round}: the DMA message whole when it is published");
        assert_eq!(rx.recv(SHORT).unwrap(), Message { meta: 3 * round + 1, data: b"by PIO, right behind".to_vec() });
        assert_eq!(rx.recv(SHORT).unwrap(), Message { meta: 3 * round + 2, data: body[..100].to_vec() });
        t.wait(SHORT).unwrap();
    }
}

/// A message sent from several pieces arrives as one; taken part by part it is whole at its
/// last part; a message begun part by part is finished that way (and one begun by
/// `try_recv` by that), and mixing them in the middle is refused without losing anything.
#[test]
fn vectored_sends_and_parts() {
    let _w = Watchdog::new("vectored_sends_and_parts", Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    let cfg = QueueConfig { slots: 8, slot_size: 256, ..QueueConfig::default() };
    let l = QueueListener::bind(&nic, cfg.clone()).unwrap();
    let (addr, n2, c2) = (l.local_addr(), nic.clone(), cfg.clone());
    let t = std::thread::spawn(move || MsgSender::connect(&n2, addr, &c2).unwrap());
    let mut rx = l.accept(WAIT).unwrap();
    let mut tx = t.join().unwrap();
    let head = b"head".to_vec();
    let body: Vec<u8> = (0..1000u32).map(|i| (i % 253) as u8).collect();
    let whole = [&head[..], &body[..], b"", b"tail"].concat();
    // (1008 bytes: five slots of 224, fewer than the ring's seven)
    tx.send_vectored(7, &[&head, &body, b"", b"tail"]).unwrap();
    let mut buf = Vec::new();
    let mut got = vec![0u8; whole.len()];
    let mut parts = 0;
    loop {
        let p = rx.try_recv_part(&mut buf).unwrap().expect("published");
        assert_eq!((p.meta, p.total), (7, whole.len() as u64));
        got[p.at as usize..p.at as usize + buf.len()].copy_from_slice(&buf);
        parts += 1;
        if parts == 1 {
            // In the middle of a message begun part by part: the others refuse.
            assert!(matches!(rx.try_recv(), Err(QueueError::BadConfig(_))));
            assert!(matches!(rx.try_recv_into(&mut Vec::new()), Err(QueueError::BadConfig(_))));
        }
        if p.last {
            break;
        }
    }
    assert_eq!((got == whole, parts), (true, 5));
    // The second, begun by `try_recv` (the ring holds it whole: taken at once).
    tx.send_vectored(8, &[&head, &body, b"", b"tail"]).unwrap();
    assert_eq!(rx.try_recv().unwrap(), Some(Message { meta: 8, data: whole.clone() }));
    // More pieces than one slot's write takes at once: still one message, in order.
    let pieces: Vec<Vec<u8>> = (0..7u8).map(|i| vec![i; 10]).collect();
    let refs: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
    tx.send_vectored(10, &refs).unwrap();
    assert_eq!(rx.recv(WAIT).unwrap(), Message { meta: 10, data: pieces.concat() });
    // Begun by `try_recv`, which keeps what it took: a part-by-part take is refused.
    let sending = std::thread::spawn(move || {
        tx.send(9, &vec![5u8; 3000]).unwrap();
        tx
    });
    let deadline = std::time::Instant::now() + WAIT.unwrap();
    while rx.pending().unwrap() == 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
    let first = rx.try_recv().unwrap();
    if first.is_none() {
        assert!(matches!(rx.try_recv_part(&mut buf), Err(QueueError::BadConfig(_))));
    }
    let m = match first {
        Some(m) => m,
        None => rx.recv(WAIT).unwrap(),
    };
    assert_eq!((m.meta, m.data.len()), (9, 3000));
    let _tx = sending.join().unwrap();
}

/// A client that misbehaves during the hand-shake (here: a side geometry that makes no
/// sense) is refused and never reported by the accepts, which take the next request; an
/// accept that sees none in time is a `Timeout`; an `RpcServer` full at `max_conns` refuses
/// the next client and goes on serving the others.
#[test]
fn accepts_skip_clients_that_fail_their_hand_shake() {
    let _wd = Watchdog::new("accepts and bad hand-shakes", Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    // A raw client: a real side aperture, garbage for its geometry. Its connect returns
    // once the accept has refused it: an honest client connects only then (so the accept
    // has the liar's request before the honest one).
    let liar = nic.endpoint().unwrap();
    let side = liar.export(4096).unwrap();
    let lie = |to| {
        let r = liar.connect_with_data(to, &side.descriptor(), &[0xEE; 40], Some(Duration::from_secs(30)));
        assert!(matches!(r, Err(clan::ConnectError::Refused(_))), "a nonsense geometry was not refused: {r:?}");
    };

    let ql = QueueListener::bind(&nic, QueueConfig::default()).unwrap();
    assert!(matches!(ql.accept(Some(Duration::from_millis(5))), Err(QueueError::Timeout)));
    std::thread::scope(|sc| {
        let acc = sc.spawn(|| ql.accept(WAIT));
        lie(ql.local_addr());
        let mut tx = MsgSender::connect(&nic, ql.local_addr(), &QueueConfig::default()).unwrap();
        let mut rx = acc.join().unwrap().expect("the honest sender behind the liar");
        tx.send(7, b"after").unwrap();
        assert_eq!(rx.recv(SHORT).unwrap().data, b"after");
    });

    let rl = RpcListener::bind(&nic, RpcConfig::default()).unwrap();
    assert!(matches!(rl.accept_channel(Some(Duration::from_millis(5))), Err(RpcError::Timeout)));
    std::thread::scope(|sc| {
        let acc = sc.spawn(|| rl.accept_channel(WAIT));
        lie(rl.local_addr());
        let mut tx = ChannelSender::connect(&nic, rl.local_addr(), &RpcConfig::default()).unwrap();
        let mut ch = acc.join().unwrap().expect("the honest channel sender behind the liar");
        tx.send(b"after", SHORT).unwrap();
        assert_eq!(ch.recv(SHORT).unwrap(), b"after");
    });

    // The event-driven server: a liar's hand-shake, then more clients than it takes.
    let mut server = RpcServer::bind(&nic, RpcConfig::default(), 2).unwrap();
    let addr = server.local_addr();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let srv = sc.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                server
                    .run_once(Some(Duration::from_millis(10)), &mut |_, req, reply| {
                        reply.write(&req.to_vec()).unwrap();
                    })
                    .expect("a client's failed hand-shake is not the server's error");
            }
            server
        });
        lie(addr);
        let mut ok: Vec<RpcClient> =
            (0..2).map(|_| RpcClient::connect(&nic, addr, &RpcConfig::default()).unwrap()).collect();
        let third = RpcClient::connect(&nic, addr, &RpcConfig::default());
        assert!(
            matches!(third, Err(RpcError::Setup(clan_proto::SetupError::Connect(clan::ConnectError::Refused(_))))),
            "a third client was not refused beyond max_conns: {third:?}"
        );
        let mut reply = Vec::new();
        for c in &mut ok {
            c.call(b"ping", &mut reply, SHORT).unwrap();
            assert_eq!(reply, b"ping");
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        let server = srv.join().unwrap();
        assert_eq!(server.connections(), 2);
        assert_eq!(server.cut_off_clients(), 0);
    });
}
