//! Stream sockets: std::net-shaped behaviour, transfer redirection, lending in place, end of
//! stream, peer death, non-blocking mode.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

mod blocked;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::Duration;

use blocked::Waiter;
use clan::Nic;
use clan_proto::stream::{Listener, Stream, StreamConfig};
use util::Watchdog;

fn pair(cfg: StreamConfig) -> (Stream, Stream, Listener) {
    let nic = Nic::open_default().unwrap();
    let l = Listener::bind_with(&nic, None, cfg.clone()).unwrap();
    let addr = l.local_addr();
    let n2 = nic.clone();
    let c2 = cfg.clone();
    let t = std::thread::spawn(move || Stream::connect_with(&n2, addr, &c2).unwrap());
    let (s, from) = l.accept().unwrap();
    let c = t.join().unwrap();
    assert_eq!(from, c.local_addr());
    assert_eq!(s.peer_addr(), c.local_addr());
    (c, s, l)
}

fn small() -> StreamConfig {
    StreamConfig { ring: 4096, post_area: 64 << 10, ..StreamConfig::default() }
}

#[test]
fn echo_and_end_of_stream() {
    let _wd = Watchdog::new("stream echo", Duration::from_secs(60));
    let (mut c, mut s, _l) = pair(small());
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let d2 = data.clone();
    let w = std::thread::spawn(move || {
        c.write_all(&d2).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        // Then read the echo.
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        back
    });
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert!(got == data, "all bytes, in order, through a 4 KiB ring");
    s.write_all(&got).unwrap();
    drop(s);
    let back = w.join().unwrap();
    assert!(back == data);
}

/// Data given with a connect reaches the accepting side before any byte of the stream, and
/// none of it enters the stream; more than `MAX_CONNECT_DATA` bytes is refused before
/// anything is sent; a request whose private data runs past the geometry by more than that
/// (a peer speaking the raw API) is refused by the listener, which goes on accepting.
#[test]
fn connect_data_reaches_the_listener_and_is_bounded() {
    use clan_proto::stream::MAX_CONNECT_DATA;
    let _wd = Watchdog::new("connect data", Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let l = Listener::bind_with(&nic, None, small()).unwrap();
    let addr = l.local_addr();
    let (q, cfg) = (nic.event_queue(clan::EventQueueConfig::default()).unwrap(), small());
    let too_much = vec![7u8; MAX_CONNECT_DATA + 1];
    let e = Stream::connect_to_with_data(&nic, addr, &cfg, &q, &too_much).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");

    // A raw client: a geometry-sized prefix and then too much.
    let raw = nic.endpoint().unwrap();
    let inbox = raw.export(1 << 20).unwrap();
    let to = addr;
    let liar = std::thread::spawn(move || {
        let data = vec![0u8; 32 + MAX_CONNECT_DATA + 1];
        raw.connect_with_data(to, &inbox.descriptor(), &data, Some(Duration::from_secs(30)))
    });
    // The listener's accept refuses it and reports nothing.
    while !liar.is_finished() {
        let e = l.accept_timeout(Duration::from_millis(100)).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    }
    assert!(matches!(liar.join().unwrap(), Err(clan::ConnectError::Refused(_))), "the oversized request was refused");
    let (n2, q2, c2) = (nic.clone(), q.clone(), cfg.clone());
    let honest = std::thread::spawn(move || {
        let mut c = Stream::connect_to_with_data(&n2, addr, &c2, &q2, b"which one").unwrap();
        c.write_all(b"first bytes").unwrap();
        c
    });
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(s.peer_data(), b"which one");
    let mut got = [0u8; 11];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"first bytes", "the data is not in the stream");
    let c = honest.join().unwrap();
    assert_eq!(c.peer_data(), b"");
}

/// `write_all` holds the sending side for the whole buffer: two threads writing buffers
/// larger than the ring into one stream at once deliver each buffer whole, one after the
/// other. Its write timeout counts from the last progress: a reader that keeps taking
/// bytes, slower than the timeout overall, never makes it time out; one that stops does.
#[test]
fn write_all_is_whole_and_times_out_only_without_progress() {
    let _wd = Watchdog::new("write_all", Duration::from_secs(120));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (c, mut s, _l) = pair(cfg);
    let c = std::sync::Arc::new(c);
    const LEN: usize = 20_000;
    let writers: Vec<_> = (0..2u8)
        .map(|k| {
            let c = c.clone();
            std::thread::spawn(move || {
                for round in 0..5u8 {
                    let buf = vec![k * 16 + round; LEN];
                    (&*c).write_all(&buf).unwrap();
                }
            })
        })
        .collect();
    let mut got = vec![0u8; 10 * LEN];
    s.read_exact(&mut got).unwrap();
    for w in writers {
        w.join().unwrap();
    }
    for (i, b) in got.chunks(LEN).enumerate() {
        assert!(b.iter().all(|x| *x == b[0]), "buffer {i} arrived whole, not interleaved with another");
    }

    // Progress resets the timeout: 12 pauses of 250 ms, 3 s in all, under a 2 s timeout.
    c.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let reader = std::thread::spawn(move || {
        let mut piece = vec![0u8; 4000];
        for _ in 0..12 {
            std::thread::sleep(Duration::from_millis(250));
            s.read_exact(&mut piece).unwrap();
        }
        s
    });
    let started = std::time::Instant::now();
    (&*c).write_all(&vec![9u8; 12 * 4000]).unwrap();
    assert!(started.elapsed() >= Duration::from_secs(2), "the reader paced the writer past one timeout");
    let s = reader.join().unwrap();

    // A reader that takes nothing: the write times out.
    c.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
    let e = (&*c).write_all(&vec![1u8; 3 * 4096]).unwrap_err();
    assert!(matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock), "{e}");
    drop(s);
}

/// A stream with one handle reads (waits included) and writes without its sides' locks
/// (`&mut Stream`, no clone); with clones it takes them (for good: its sides are shared from
/// the first clone on). The two ways give the same bytes, waits, timeouts and errors.
#[test]
fn the_only_handle_and_shared_handles_behave_alike() {
    let _wd = Watchdog::new("solo and shared", Duration::from_secs(60));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (mut c, mut s, _l) = pair(cfg);
    let data: Vec<u8> = (0..60_000u32).map(|i| (i * 13 + i / 509) as u8).collect();

    // The only handle: writes of 100 bytes fill the ring, wait for room, go on.
    let d2 = data.clone();
    let w = std::thread::spawn(move || {
        for piece in d2.chunks(100) {
            c.write_all(piece).unwrap();
        }
        c
    });
    let mut got = vec![0u8; data.len()];
    s.read_exact(&mut got).unwrap();
    let mut c = w.join().unwrap();
    assert!(got == data, "in order through the only handle");

    // A clone: both handles write through the locks, each write_all whole.
    let mut c2 = c.try_clone().unwrap();
    let w2 = std::thread::spawn(move || {
        c2.write_all(&[0xAA; 10_000]).unwrap();
        c2 // kept alive until joined
    });
    let w = std::thread::spawn(move || {
        c.write_all(&[0x55; 10_000]).unwrap();
        c
    });
    let mut both = vec![0u8; 20_000];
    s.read_exact(&mut both).unwrap();
    let (mut c, c2) = (w.join().unwrap(), w2.join().unwrap());
    let (a, b) = both.split_at(10_000);
    assert!(a.iter().all(|x| *x == a[0]) && b.iter().all(|x| *x == b[0]) && a[0] != b[0], "each whole");
    drop(c2);

    // The only handle again (the clone is gone): a read finds nothing, then what is written.
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(s.read(&mut buf).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    assert_eq!(s.read(&mut buf).unwrap_err().kind(), std::io::ErrorKind::TimedOut, "a wait times out");
    s.set_read_timeout(None).unwrap();
    let w = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        c.write_all(b"after the clone").unwrap();
        c
    });
    s.read_exact(&mut buf[..15]).unwrap(); // waits for it
    assert_eq!(&buf[..15], b"after the clone");
    let mut c = w.join().unwrap();

    // Full ring, non-blocking: WouldBlock, as through a shared handle.
    c.set_nonblocking(true).unwrap();
    let mut sent = 0;
    loop {
        match c.write(&[7u8; 1000]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(sent > 0 && sent <= 4095, "{sent} bytes: the ring filled");
    assert_eq!(s.available().unwrap(), sent as u64);

    // Reading shut down: the end at once, though bytes are there.
    s.shutdown(Shutdown::Read).unwrap();
    assert_eq!(s.read(&mut buf).unwrap(), 0);

    // The peer gone: the write fails (as over TCP: a broken pipe or a reset, by when it looks).
    drop(s);
    c.set_nonblocking(false).unwrap();
    c.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let e = loop {
        match c.write(&[1u8; 100]) {
            Ok(n) => assert!(n > 0),
            Err(e) => break e,
        }
    };
    assert!(matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset), "{e}");
}

/// The receiving side of the only handle stays its own through brief looks (`peek`,
/// `available`, `stats`, `readiness`, a posted receive's set-up) and moves for good to where
/// every handle reaches it at a read or a wait through `&Stream`, or a clone: the bytes come
/// in order across every change, each counted once.
#[test]
fn reads_keep_their_order_as_the_receiving_side_moves() {
    let _wd = Watchdog::new("receiving side moves", Duration::from_secs(60));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (mut c, mut s, _l) = pair(cfg);
    let data: Vec<u8> = (0..40_000u32).map(|i| (i * 31 + i / 251) as u8).collect();
    let d2 = data.clone();
    let w = std::thread::spawn(move || {
        for piece in d2.chunks(100) {
            c.write_all(piece).unwrap();
        }
        c
    });
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut at = 0;
    let check = |buf: &[u8], at: &mut usize| {
        assert!(buf == &data[*at..*at + buf.len()], "bytes {at}..{} in order", *at + buf.len());
        *at += buf.len();
    };
    let mut buf = vec![0u8; 1000];
    // The only handle's own side: a read, then brief looks, then a read again.
    s.read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    let mut peeked = [0u8; 8];
    let k = s.peek(&mut peeked).unwrap();
    assert!(k <= 8 && peeked[..k] == data[at..at + k], "a peek shows what comes next");
    assert_eq!(s.stats().read, 1000, "each byte counted once");
    let _ = s.readiness();
    let _ = s.available().unwrap();
    s.read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    // A wait through `&Stream`: the side is shared from now on.
    let mut head = [0u8; 8];
    assert_eq!(s.peek_when_landed(8, &mut head).unwrap(), 8);
    assert!(head[..] == data[at..at + 8], "landed, not consumed");
    let got = s.read_in_place(300, |d| d.to_vec()).unwrap().unwrap();
    assert!(!got.is_empty() && got.len() <= 300);
    check(&got, &mut at);
    (&s).read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    s.read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    // A clone reads from where the handle left off, and the handle after it.
    let mut s2 = s.try_clone().unwrap();
    s2.read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    s.read_exact(&mut buf).unwrap();
    check(&buf, &mut at);
    drop(s2);
    let mut rest = vec![0u8; data.len() - at];
    s.read_exact(&mut rest).unwrap();
    check(&rest, &mut at);
    assert_eq!(s.stats().read, data.len() as u64, "each byte counted once");
    drop(w.join().unwrap());
}

/// A non-blocking `write_all` through the only handle that runs out of room says
/// `WouldBlock` with a prefix of its bytes written once; then writes through `&Stream` (the
/// sending side shared from then on) and through the handle again go on in order.
#[test]
fn a_non_blocking_write_all_leaves_a_prefix_and_sharing_keeps_the_order() {
    let _wd = Watchdog::new("write_all prefix", Duration::from_secs(60));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (mut c, mut s, _l) = pair(cfg);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 29 + i / 97) as u8).collect();
    c.set_nonblocking(true).unwrap();
    assert_eq!(c.write_all(&data).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    let k = s.available().unwrap() as usize;
    assert!(k > 0 && k < data.len(), "{k} bytes written");
    let mut got = vec![0u8; k];
    s.read_exact(&mut got).unwrap();
    assert!(got == data[..k], "a prefix, once");
    c.set_nonblocking(false).unwrap();
    (&c).write_all(b"shared ").unwrap();
    c.write_all(b"then own").unwrap();
    let mut tail = [0u8; 15];
    s.read_exact(&mut tail).unwrap();
    assert_eq!(&tail, b"shared then own");
    drop(c);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "the end of stream, once the handle is gone");
}

/// A ring whose size is not a power of two (positions wrap by division, not by a mask):
/// writes of every size up to past the ring's, many times around it, arrive whole and in
/// order, read back in pieces of other sizes.
#[test]
fn a_ring_of_any_size_wraps_in_order() {
    let _wd = Watchdog::new("odd ring", Duration::from_secs(60));
    for ring in [3000u64, 4097, 12_345] {
        let cfg = StreamConfig { ring, post_area: 0, ..StreamConfig::default() };
        let (mut c, mut s, _l) = pair(cfg);
        let total: usize = 20 * ring as usize + 77;
        let data: Vec<u8> = (0..total).map(|i| (i * 31 + i / 251) as u8).collect();
        let d2 = data.clone();
        let w = std::thread::spawn(move || {
            let (mut at, mut n) = (0usize, 1usize);
            while at < d2.len() {
                let k = n.min(d2.len() - at);
                c.write_all(&d2[at..at + k]).unwrap();
                at += k;
                n = n * 7 % (ring as usize + 500) + 1;
            }
            c
        });
        let mut got = vec![0u8; total];
        let (mut at, mut n) = (0usize, 3usize);
        while at < total {
            let k = n.min(total - at);
            s.read_exact(&mut got[at..at + k]).unwrap();
            at += k;
            n = n * 5 % 2000 + 1;
        }
        w.join().unwrap();
        assert!(got == data, "a {ring}-byte ring: the bytes arrive whole and in order");
    }
}

/// The reader publishes its position lazily (every quarter of the ring): a writer blocked on
/// a full ring must still be woken when the reader drains it in tiny reads, and a
/// request/response exchange of sizes that never add up to a quarter must not stall.
#[test]
fn lazy_read_position_never_stalls_the_writer() {
    let _wd = Watchdog::new("lazy read position", Duration::from_secs(60));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (mut c, mut s, _l) = pair(cfg);
    let total = 3 * 4096 + 17;
    let data: Vec<u8> = (0..total).map(|i| (i * 13 + 5) as u8).collect();
    let d2 = data.clone();
    let w = std::thread::spawn(move || {
        // Odd-sized writes that fill the ring and then wait for room.
        for piece in d2.chunks(1000) {
            c.write_all(piece).unwrap();
        }
        // Then ping-pong with messages far below a quarter of the ring.
        for i in 0..2000u32 {
            c.write_all(&i.to_le_bytes()[..3]).unwrap();
            let mut one = [0u8; 1];
            c.read_exact(&mut one).unwrap();
            assert_eq!(one[0], i as u8);
        }
        c
    });
    let mut got = vec![0u8; total];
    for b in got.iter_mut() {
        s.read_exact(std::slice::from_mut(b)).unwrap();
    }
    assert!(got == data, "a full ring drained byte by byte, in order");
    for i in 0..2000u32 {
        let mut m = [0u8; 3];
        s.read_exact(&mut m).unwrap();
        assert_eq!(m, i.to_le_bytes()[..3]);
        s.write_all(&[i as u8]).unwrap();
    }
    drop(w.join().unwrap());
}

#[test]
fn nonblocking_timeouts_and_shutdown() {
    let _wd = Watchdog::new("stream nonblocking", Duration::from_secs(60));
    let (mut c, mut s, _l) = pair(small());
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    assert_eq!(s.read(&mut b).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(30))).unwrap();
    assert_eq!(s.read(&mut b).unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    assert!(s.set_read_timeout(Some(Duration::ZERO)).is_err());
    // A full ring: non-blocking writes say so.
    c.set_nonblocking(true).unwrap();
    let mut sent = 0;
    loop {
        match c.write(&[1u8; 1000]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(sent, 4095, "full with one free byte");
    assert_eq!(s.available().unwrap(), 4095);
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(c.write(b"x").unwrap_err().kind(), std::io::ErrorKind::BrokenPipe);
    let mut all = Vec::new();
    s.set_read_timeout(None).unwrap();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), 4095);
    // Shutting down reading: reads see the end at once.
    s.shutdown(Shutdown::Read).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

#[test]
fn lending_in_place_and_landing() {
    let _wd = Watchdog::new("stream in place", Duration::from_secs(60));
    let (mut c, s, _l) = pair(small());
    c.write_all(b"hello, in place").unwrap();
    let got = s.read_in_place(5, |d| d.to_vec()).unwrap().unwrap();
    assert_eq!(got, b"hello");
    let mut head = [0u8; 3];
    assert_eq!(s.peek_when_landed(3, &mut head).unwrap(), 3);
    assert_eq!(&head, b", i");
    let rest = s.read_in_place(100, |d| d.to_vec()).unwrap().unwrap();
    assert_eq!(rest, b", in place");
    drop(c);
    assert!(s.read_in_place(100, |d| d.len()).unwrap().is_none(), "end of stream");
}

/// A position wait armed before anything was written wakes when the header lands, while the
/// body is still to come: the writer writes the header and sends the body only once the
/// reader has come back from its wait (the reader's wake-up is the writer's gate).
#[test]
fn a_position_wait_armed_first_wakes_while_the_body_is_still_to_come() {
    let _wd = Watchdog::new("position wait armed first", Duration::from_secs(30));
    let (mut c, s, _l) = pair(small());
    // A wait that missed the header fails in time instead of hanging.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let header = *b"HDR len=00001000";
    let body: Vec<u8> = (0..10_000u32).map(|i| (i * 11 % 241) as u8).collect();
    let (me_tx, me_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        me_tx.send(Waiter::current()).unwrap();
        let mut head = [0u8; 16];
        let n = s.peek_when_landed(16, &mut head);
        let available = s.available().unwrap();
        (s, n, head, available)
    });
    // Write the header once the reader sleeps in its wait.
    me_rx.recv().unwrap().wait_asleep(Duration::from_secs(10));
    c.write_all(&header).unwrap();
    // The gate: the body goes only after the reader came back.
    let (s, n, head, available) = reader.join().unwrap();
    assert_eq!(n.unwrap(), 16, "woken by the header");
    assert_eq!(head, header);
    // Woken with the body still to come; perhaps even before the header was published (the
    // wait watches its last byte land, ahead of the counter that publishes it).
    assert!(available == 0 || available == 16, "woken with the body still to come, not {available} bytes");
    let b2 = body.clone();
    let writer = std::thread::spawn(move || c.write_all(&b2).unwrap());
    // The peek consumed nothing: header and body follow, in order, through a 4 KiB ring.
    let mut all = vec![0u8; 16 + body.len()];
    (&s).read_exact(&mut all).unwrap();
    writer.join().unwrap();
    assert_eq!(all[..16], header);
    assert!(all[16..] == body[..]);
}

#[test]
fn redirection_places_data_directly_and_reports_exactly() {
    let _wd = Watchdog::new("stream redirection", Duration::from_secs(60));
    let (mut c, s, _l) = pair(StreamConfig { ring: 16 << 10, post_area: 64 << 10, ..StreamConfig::default() });
    // Posted before the data: all of it placed directly.
    s.post_recv(40_000).unwrap();
    let data: Vec<u8> = (0..40_000u32).map(|i| (i % 253) as u8).collect();
    c.write_all(&data).unwrap();
    let (rep, got) = s.recv_posted(|r, d| (r, d.to_vec())).unwrap();
    assert_eq!((rep.len, rep.direct, rep.copied), (40_000, 40_000, 0));
    assert!(got == data);
    // Data sent before the post: it went to the ring and is copied.
    c.write_all(&data[..3000]).unwrap();
    while s.available().unwrap() < 3000 {
        std::thread::yield_now();
    }
    s.post_recv(10_000).unwrap();
    c.write_all(&data[3000..10_000]).unwrap();
    let (rep, got) = s.recv_posted(|r, d| (r, d.to_vec())).unwrap();
    assert_eq!((rep.len, rep.copied, rep.direct), (10_000, 3000, 7000), "a partial redirection, exactly");
    assert!(got == data[..10_000]);
    // Normal reads go on.
    c.write_all(b"after").unwrap();
    let mut b = [0u8; 5];
    let mut r: &Stream = &s;
    r.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"after");
    // Misuse.
    assert!(s.post_recv(0).is_err());
    assert!(s.post_recv(1 << 20).is_err());
}

#[test]
fn a_dead_peer_is_an_error_not_a_hang() {
    let _wd = Watchdog::new("stream peer death", Duration::from_secs(120));
    let mut peer = util::Peer::spawn("child", "server", &[]);
    let addr: clan::EndpointAddr = peer.expect("address").parse().unwrap();
    let nic = Nic::open_default().unwrap();
    let mut c = Stream::connect(&nic, addr).unwrap();
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"pong");
    peer.kill();
    let start = std::time::Instant::now();
    let e = c.read(&mut b).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    assert!(start.elapsed() < Duration::from_secs(30));
    // Writing fails too (not at once necessarily: the peer's memory stays mapped until the
    // NIC notices; then it does).
    let start = std::time::Instant::now();
    loop {
        match c.write(&[0u8; 1024]) {
            Err(e) => {
                assert!(
                    matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset),
                    "{e}"
                );
                break;
            }
            Ok(n) => {
                assert!(n > 0 && start.elapsed() < Duration::from_secs(30), "writes to a dead peer kept succeeding")
            }
        }
    }
}

/// The same over a TCP link with nothing spinning: the reader sleeps on the link's socket
/// (it drives the link itself while the engine leaves it alone), and the peer's death
/// still ends its read with an error, promptly, whoever finds the link closed.
#[test]
fn a_dead_peer_over_a_link_is_an_error_for_a_blocked_reader() {
    let _wd = Watchdog::new("stream peer death over a link", Duration::from_secs(120));
    for round in 0..3 {
        let mut peer = util::Peer::spawn("child", "server", &[("STREAM_LINK", "1".into())]);
        let addr: clan::EndpointAddr = peer.expect("address").parse().unwrap();
        let nic = Nic::open(blocking_link_nic()).unwrap();
        let cfg = StreamConfig { spin: Duration::ZERO, ..StreamConfig::default() };
        let mut c = Stream::connect_with(&nic, addr, &cfg).unwrap();
        for _ in 0..20 {
            c.write_all(b"ping").unwrap();
            let mut b = [0u8; 4];
            c.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"pong", "round {round}");
        }
        // Blocked in the read (asleep) when the peer dies, or about to be.
        let reader = std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let e = c.read(&mut [0u8; 4]).unwrap_err();
            (e.kind(), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(20 * round));
        peer.kill();
        let (kind, took) = reader.join().unwrap();
        assert_eq!(kind, std::io::ErrorKind::ConnectionReset, "round {round}");
        assert!(took < Duration::from_secs(30), "round {round}: {took:?}");
    }
}

/// A NIC that reaches the other processes of this host over TCP links and never spins.
fn blocking_link_nic() -> clan::NicConfig {
    let d = clan::NicConfig::default();
    clan::NicConfig {
        local_transport: clan::LocalTransport::Link,
        default_queue: clan::EventQueueConfig { spin: Duration::ZERO, ..d.default_queue.clone() },
        ..d
    }
}

#[test]
fn child() {
    let Some(role) = util::role() else { return };
    assert_eq!(role, "server");
    let link = std::env::var("STREAM_LINK").is_ok();
    let nic = if link { Nic::open(blocking_link_nic()).unwrap() } else { Nic::open_default().unwrap() };
    let cfg =
        if link { StreamConfig { spin: Duration::ZERO, ..StreamConfig::default() } } else { StreamConfig::default() };
    let l = Listener::bind_with(&nic, None, cfg).unwrap();
    util::say(l.local_addr());
    let (mut s, _) = l.accept().unwrap();
    let mut b = [0u8; 4];
    let pings = if link { 20 } else { 1 };
    for _ in 0..pings {
        s.read_exact(&mut b).unwrap();
        s.write_all(b"pong").unwrap();
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// With manual progress, a non-blocking read of a stream just accepted over a link takes in
/// what its peer sent. (Its reads drove the links only once the peer's side was imported, at
/// the stream's first write: nothing else reads a link with manual progress, and the first
/// message waited for the engine's timer.)
#[test]
fn a_non_blocking_read_over_a_link_with_manual_progress_takes_in_the_first_message() {
    let _wd = Watchdog::new("non-blocking first read over a link", Duration::from_secs(120));
    let nic = Nic::open(clan::NicConfig { progress: clan::Progress::Manual, ..blocking_link_nic() }).unwrap();
    let cfg = StreamConfig { spin: Duration::ZERO, ..StreamConfig::default() };
    let l = Listener::bind_with(&nic, None, cfg).unwrap();
    let mut peer = util::Peer::spawn("writer_child", "writer", &[("STREAM_TO", l.local_addr().to_string())]);
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(peer.expect("written"), "written");
    // (the bytes are in the link's socket by now: the peer's write has returned)
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 5];
    let mut got = 0;
    for _ in 0..10_000 {
        match s.read(&mut b[got..]) {
            Ok(n) => {
                got += n;
                if got == b.len() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("read: {e}"),
        }
    }
    assert_eq!(&b[..got], b"hello", "10 000 non-blocking reads did not take in what the peer sent");
    peer.kill();
}

#[test]
fn writer_child() {
    let Some(role) = util::role() else { return };
    assert_eq!(role, "writer");
    let nic = Nic::open(blocking_link_nic()).unwrap();
    let to: clan::EndpointAddr = std::env::var("STREAM_TO").unwrap().parse().unwrap();
    let mut s = Stream::connect(&nic, to).unwrap();
    s.write_all(b"hello").unwrap();
    util::say("written");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A stream connects to another process by host name, as `std::net` does (`localhost`
/// from `/etc/hosts`: no query leaves the host); a name that is not an address is a typed
/// error, not a panic or a hang.
#[test]
fn connect_by_host_name() {
    let _wd = Watchdog::new("stream by host name", Duration::from_secs(120));
    let mut peer = util::Peer::spawn("child", "server", &[]);
    let addr: clan::EndpointAddr = peer.expect("address").parse().unwrap();
    assert!(addr.nic.ip().is_loopback());
    let nic = Nic::open_default().unwrap();
    let by_name = format!("localhost:{}/{}", addr.nic.port(), addr.port);
    let mut c = Stream::connect(&nic, by_name.as_str()).unwrap();
    assert_eq!(c.peer_addr().nic, addr.nic);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"pong");
    for bad in ["localhost", "localhost:1", "localhost:1/x", "localhost:99999/1"] {
        let e = Stream::connect(&nic, bad).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad}: {e}");
    }
    peer.kill();
}

#[test]
fn refused_and_timed_out_connects() {
    let nic = Nic::open_default().unwrap();
    let ep = nic.endpoint().unwrap(); // not listening
    let e = Stream::connect_with(
        &nic,
        ep.addr(),
        &StreamConfig { connect_timeout: Duration::from_secs(5), ..StreamConfig::default() },
    )
    .unwrap_err();
    assert!(matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut), "{e}");
    let l = Listener::bind(&nic).unwrap();
    l.set_nonblocking(true).unwrap();
    assert_eq!(l.accept().unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    assert_eq!(l.accept_timeout(Duration::from_millis(20)).unwrap_err().kind(), std::io::ErrorKind::TimedOut);
}

/// A stream handed over (what `clan run` does at `fork`): the side that stays takes back
/// exactly the bytes it wrote that the leaver never read, and gets every byte the leaver
/// wrote that it had not read yet; nothing is lost or doubled, and the leaver's side stays
/// until the taker says it has them. Both sides leaving at once: the second one takes over.
#[test]
fn hand_over_and_take_over_lose_and_double_nothing() {
    use clan_proto::stream::HandOver;
    let _wd = Watchdog::new("stream hand-over", Duration::from_secs(60));
    let cfg = StreamConfig { ring: 4096, post_area: 0, ..StreamConfig::default() };
    let (mut c, mut s, _l) = pair(cfg.clone());
    let to_s: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let to_c: Vec<u8> = (0..2000u32).map(|i| (i % 239) as u8).collect();
    c.write_all(&to_s).unwrap();
    s.write_all(&to_c).unwrap();
    // Each reads part of what it got.
    let mut got_s = vec![0u8; 1000];
    s.read_exact(&mut got_s).unwrap();
    let mut got_c = vec![0u8; 500];
    c.read_exact(&mut got_c).unwrap();
    assert!(!c.peer_left() && !s.peer_left());
    let HandOver::Left { unread } = s.hand_over().unwrap() else { panic!("s was first") };
    assert_eq!(unread, 2000, "s had 2000 of c's bytes unread");
    assert!(!s.taken(), "nothing taken back yet");
    assert!(c.peer_left());
    // The leaver reads and writes no more.
    assert_eq!(s.write(b"x").unwrap_err().kind(), std::io::ErrorKind::NotConnected);
    assert_eq!(s.read(&mut [0u8; 8]).unwrap_err().kind(), std::io::ErrorKind::NotConnected);
    let t = c.take_over().unwrap();
    assert_eq!(t.resend, to_s[1000..], "c sends again what s never read");
    assert_eq!(t.unread, to_c[500..], "c reads first what s wrote and c had not read");
    assert!(!t.write_shut);
    assert!(s.taken(), "the leaver learns it may let go");
    assert_eq!(c.write(b"x").unwrap_err().kind(), std::io::ErrorKind::NotConnected);

    // A write shut down before: the taker learns it must end the other carrier too.
    let (c, s, _l) = pair(cfg.clone());
    c.shutdown(Shutdown::Write).unwrap();
    s.hand_over().unwrap();
    let t = c.take_over().unwrap();
    assert!(t.write_shut && t.resend.is_empty() && t.unread.is_empty());

    // Both leave: the one that sees the other's mark takes over (here the second).
    let (mut c, mut s, _l) = pair(cfg);
    c.write_all(b"abc").unwrap();
    s.write_all(b"defg").unwrap();
    assert!(matches!(c.hand_over().unwrap(), HandOver::Left { unread: 4 }));
    match s.hand_over().unwrap() {
        HandOver::PeerLeftFirst(t) => {
            assert_eq!(t.resend, b"defg", "s sends again what c dropped");
            assert_eq!(t.unread, b"abc", "s keeps what c wrote");
        }
        other => panic!("s should take over: {other:?}"),
    }
}
