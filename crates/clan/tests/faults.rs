//! Links under attack and under faults (in one process, over loopback TCP).

mod util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use clan::{AccessError, Event, LinkConfig, LocalTransport, Nic, NicConfig, Rights, TripwireConfig};
use clan_testkit::fault::FaultProxy;
use clan_wire::frame::{self, Status};
use clan_wire::{Decoder, Frame, Hello, Import, Item, ReadReq, Target};
use util::Watchdog;

fn config() -> NicConfig {
    NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }
}

/// A hostile peer speaking the wire protocol by hand.
struct Raw {
    sock: TcpStream,
    dec: Decoder,
    buf: Vec<u8>,
}

enum Got {
    Frame(Vec<u8>, u8),
    ReadResp(Status, Vec<u8>),
    Eof,
}

impl Raw {
    fn connect(nic: &Nic) -> Raw {
        let sock = TcpStream::connect(nic.addr().socket_addr()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut r = Raw { sock, dec: Decoder::new(), buf: Vec::new() };
        r.send(&Frame::Hello(Hello {
            version: frame::VERSION,
            flags: 0,
            nic: "127.0.0.1:9".parse().unwrap(),
            nonce: [1; 16],
            credit: 1 << 20,
        }));
        assert!(matches!(r.next(), Got::Frame(_, k) if k == frame::kind::HELLO));
        assert!(matches!(r.next(), Got::Frame(_, k) if k == frame::kind::WELCOME));
        r
    }
    fn send(&mut self, f: &Frame<'_>) {
        let mut b = Vec::new();
        f.encode(&mut b);
        let _ = self.sock.write_all(&b);
    }
    fn send_raw(&mut self, b: &[u8]) {
        let _ = self.sock.write_all(b);
    }
    /// The next frame (small frames: their encoding; read responses: status and data).
    fn next(&mut self) -> Got {
        let mut resp: Option<(Status, Vec<u8>, u64)> = None;
        loop {
            while let Ok(Some((item, used))) = self.dec.next(&self.buf) {
                let out = match item {
                    Item::Frame(f) => {
                        let mut b = Vec::new();
                        f.encode(&mut b);
                        Some(Got::Frame(b.clone(), b[4]))
                    }
                    Item::ReadRespBegin { status, len, .. } => {
                        if len == 0 {
                            Some(Got::ReadResp(status, Vec::new()))
                        } else {
                            resp = Some((status, Vec::new(), len));
                            None
                        }
                    }
                    Item::ReadRespData { data, last, .. } => {
                        let (s, mut d, _) = resp.take().expect("response begun");
                        d.extend_from_slice(data);
                        if last {
                            Some(Got::ReadResp(s, d))
                        } else {
                            resp = Some((s, d, 0));
                            None
                        }
                    }
                    _ => None,
                };
                self.buf.drain(..used);
                if let Some(o) = out {
                    return o;
                }
            }
            let mut tmp = [0u8; 4096];
            match self.sock.read(&mut tmp) {
                Ok(0) | Err(_) => return Got::Eof,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
            }
        }
    }
    /// Skip acknowledgements and pings until a frame of `kind`.
    fn expect(&mut self, kind: u8) -> Vec<u8> {
        loop {
            match self.next() {
                Got::Frame(b, k) if k == kind => return b,
                Got::Frame(_, k) if k == frame::kind::ACK || k == frame::kind::PING || k == frame::kind::CREDIT => {}
                Got::Frame(_, k) => panic!("expected frame kind {kind}, got {k}"),
                Got::ReadResp(..) => panic!("expected frame kind {kind}, got a read response"),
                Got::Eof => panic!("connection closed while expecting frame kind {kind}"),
            }
        }
    }
}

fn decode_small(b: &[u8]) -> Frame<'_> {
    match Decoder::new().next(b) {
        Ok(Some((Item::Frame(f), _))) => f,
        other => panic!("not a small frame: {other:?}"),
    }
}

/// Every incoming frame is validated before memory is touched; violations are refused,
/// counted and reported; a peer that keeps sending bad frames is disconnected; the NIC is fine.
#[test]
fn hostile_peer_is_refused_and_disconnected() {
    let _wd = Watchdog::new("hostile peer", Duration::from_secs(120));
    let nic = Nic::open(config()).unwrap();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(16384).unwrap();
    let granted = ap.descriptor().derive(4096, 4096, Rights::READ_WRITE).unwrap();
    let mut raw = Raw::connect(&nic);
    let bytes = granted.to_bytes();
    raw.send(&Frame::Import(Import {
        id: 1,
        importer_nic: "127.0.0.1:9".parse().unwrap(),
        importer_port: 1,
        desc: &bytes,
    }));
    let reply = raw.expect(frame::kind::IMPORT_REPLY);
    let Frame::ImportReply(r) = decode_small(&reply) else { unreachable!() };
    assert_eq!(r.status, Status::Ok);
    let t = |offset: u64| Target { aperture: ap.id(), generation: ap.generation(), key: r.key, offset };
    // Inside the grant: applied.
    let mut b = Vec::new();
    frame::encode_write(&t(4096), b"legitimate", &mut b);
    raw.send_raw(&b);
    // Outside it, on either side: refused, memory untouched.
    for off in [0u64, 4090, 8192, 12000] {
        let mut b = Vec::new();
        frame::encode_write(&t(off), &[0xee; 16], &mut b);
        raw.send_raw(&b);
        let f = raw.expect(frame::kind::REFUSED);
        let Frame::Refused(x) = decode_small(&f) else { unreachable!() };
        assert_eq!((x.status, x.offset), (Status::OutOfBounds, off));
    }
    // Forged key, wrong generation: refused.
    let mut b = Vec::new();
    frame::encode_write(&Target { key: r.key ^ 1, ..t(4096) }, b"forged", &mut b);
    raw.send_raw(&b);
    let Frame::Refused(x) = decode_small(&raw.expect(frame::kind::REFUSED)) else { unreachable!() };
    assert_eq!(x.status, Status::BadKey);
    let mut b = Vec::new();
    frame::encode_write(&Target { generation: ap.generation() + 1, ..t(4096) }, b"stale", &mut b);
    raw.send_raw(&b);
    let Frame::Refused(x) = decode_small(&raw.expect(frame::kind::REFUSED)) else { unreachable!() };
    assert_eq!(x.status, Status::BadKey);
    // A read outside the grant gets an error response, no data.
    raw.send(&Frame::ReadReq(ReadReq { id: 5, from: t(0), len: 64 }));
    loop {
        match raw.next() {
            Got::ReadResp(s, d) => {
                assert_eq!(s, Status::OutOfBounds);
                assert!(d.is_empty());
                break;
            }
            Got::Eof => panic!("closed"),
            Got::Frame(..) => {}
        }
    }
    let mut all = vec![0u8; 16384];
    ap.read(0, &mut all).unwrap();
    assert_eq!(&all[4096..4106], b"legitimate");
    assert!(
        all[..4096].iter().all(|&x| x == 0) && all[8192..].iter().all(|&x| x == 0),
        "nothing written outside the grant"
    );
    // Keep sending bad frames: disconnected.
    let mut closed = false;
    for i in 0..40 {
        let mut b = Vec::new();
        frame::encode_write(&t(100 + i), &[1; 8], &mut b);
        raw.send_raw(&b);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match raw.next() {
            Got::Eof => {
                closed = true;
                break;
            }
            Got::Frame(b, k) if k == frame::kind::CLOSE => {
                assert!(matches!(decode_small(&b), Frame::Close { status: Status::TooManyErrors }));
            }
            _ => {}
        }
    }
    assert!(closed, "a peer that keeps sending bad frames is disconnected");
    // Garbage that breaks the framing closes the connection at once.
    let mut raw2 = Raw::connect(&nic);
    raw2.send_raw(&[0xff, 0xff, 0xff, 0xff, 0x63, 0, 0, 0]);
    let mut eof = false;
    for _ in 0..10 {
        if matches!(raw2.next(), Got::Eof) {
            eof = true;
            break;
        }
    }
    assert!(eof);
    // And the NIC still works for honest peers.
    let other = Nic::open(config()).unwrap();
    let m = other.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    m.store_u64(0, 77).unwrap();
    m.barrier().unwrap();
    assert_eq!(ap.load_u64(0).unwrap(), 77);
}

/// A small transfer and its words come as separate bursts and an exporter applies them
/// together when they are whole in its buffer: a hostile peer that puts a word outside its
/// grant (or misaligned, or under another key) behind a legitimate body gets the body
/// applied and the word refused, exactly as burst by burst, and nothing lands outside the
/// grant.
#[test]
fn a_body_with_a_bad_word_behind_it_is_checked_burst_by_burst() {
    let _wd = Watchdog::new("hostile transfers", Duration::from_secs(120));
    let nic = Nic::open(config()).unwrap();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(16384).unwrap();
    let granted = ap.descriptor().derive(4096, 4096, Rights::READ_WRITE).unwrap();
    let mut raw = Raw::connect(&nic);
    let bytes = granted.to_bytes();
    raw.send(&Frame::Import(Import {
        id: 1,
        importer_nic: "127.0.0.1:9".parse().unwrap(),
        importer_port: 1,
        desc: &bytes,
    }));
    let Frame::ImportReply(r) = decode_small(&raw.expect(frame::kind::IMPORT_REPLY)) else { unreachable!() };
    assert_eq!(r.status, Status::Ok);
    let t = |offset: u64| Target { aperture: ap.id(), generation: ap.generation(), key: r.key, offset };
    // Each case: the bursts in one send (so the exporter finds them whole together), the
    // refusals expected (status, offset), in order.
    type Bursts = Vec<(Target, Vec<u8>)>;
    let cases: Vec<(Bursts, Vec<(Status, u64)>)> = vec![
        // A good body and its word: applied together, nothing refused.
        (vec![(t(4160), vec![0x11; 40]), (t(4096), 1u64.to_le_bytes().to_vec())], vec![]),
        // The word past the grant.
        (vec![(t(4224), vec![0x22; 40]), (t(8192), 2u64.to_le_bytes().to_vec())], vec![(Status::OutOfBounds, 8192)]),
        // The word before it.
        (vec![(t(4288), vec![0x33; 40]), (t(4088), 3u64.to_le_bytes().to_vec())], vec![(Status::OutOfBounds, 4088)]),
        // The word under a forged key.
        (
            vec![(t(4352), vec![0x44; 40]), (Target { key: r.key ^ 1, ..t(4104) }, 4u64.to_le_bytes().to_vec())],
            vec![(Status::BadKey, 4104)],
        ),
        // A slot: lead, body, word, with the word past the grant.
        (
            vec![
                (t(4424), vec![0x55; 40]),
                (t(4416), 5u64.to_le_bytes().to_vec()),
                (t(12288), 5u64.to_le_bytes().to_vec()),
            ],
            vec![(Status::OutOfBounds, 12288)],
        ),
        // The body past the grant, its word inside: the body refused, the word applied.
        (vec![(t(8180), vec![0x66; 40]), (t(4112), 6u64.to_le_bytes().to_vec())], vec![(Status::OutOfBounds, 8180)]),
    ];
    for (k, (bursts, refusals)) in cases.iter().enumerate() {
        let mut b = Vec::new();
        for (to, data) in bursts {
            frame::encode_write(to, data, &mut b);
        }
        raw.send_raw(&b);
        for (status, offset) in refusals {
            let Frame::Refused(x) = decode_small(&raw.expect(frame::kind::REFUSED)) else { unreachable!() };
            assert_eq!((x.status, x.offset), (*status, *offset), "case {k}");
        }
    }
    // Everything above was applied by now: a ping is answered after it.
    raw.send(&Frame::Ping { token: 9 });
    raw.expect(frame::kind::PONG);
    let mut all = vec![0u8; 16384];
    ap.read(0, &mut all).unwrap();
    let word = |at: usize| u64::from_le_bytes(all[at..at + 8].try_into().unwrap());
    assert_eq!((word(4096), word(4416), word(4112)), (1, 5, 6), "the good words landed");
    for (at, byte) in [(4160usize, 0x11u8), (4224, 0x22), (4288, 0x33), (4352, 0x44), (4424, 0x55)] {
        assert!(all[at..at + 40].iter().all(|&x| x == byte), "the body at {at} landed whole");
    }
    assert_eq!(word(4104), 0, "nothing under a forged key");
    assert!(
        all[..4096].iter().all(|&x| x == 0) && all[8192..].iter().all(|&x| x == 0),
        "nothing written outside the grant"
    );
}

/// The exporter checks rights itself: a hostile peer holding a read-only grant that sends
/// write frames anyway (a burst, a word store, a notification), or one holding a write-only
/// grant that asks for a read, is refused with `NoRights` and changes nothing: not a byte,
/// not a tripwire.
#[test]
fn rights_are_checked_by_the_exporter_not_the_importer() {
    let _wd = Watchdog::new("rights over a link", Duration::from_secs(120));
    let nic = Nic::open(config()).unwrap();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(8192).unwrap();
    let before: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    ap.write(0, &before).unwrap();
    let watched = ap.tripwire(TripwireConfig::writes(0..8192).event(9)).unwrap();
    let mut raw = Raw::connect(&nic);
    let import = |raw: &mut Raw, id: u64, rights: Rights| {
        let bytes = ap.descriptor().derive(0, 8192, rights).unwrap().to_bytes();
        raw.send(&Frame::Import(Import {
            id,
            importer_nic: "127.0.0.1:9".parse().unwrap(),
            importer_port: 1,
            desc: &bytes,
        }));
        let reply = raw.expect(frame::kind::IMPORT_REPLY);
        let Frame::ImportReply(r) = decode_small(&reply) else { unreachable!() };
        assert_eq!(r.status, Status::Ok);
        Target { aperture: ap.id(), generation: ap.generation(), key: r.key, offset: 0 }
    };
    let ro = import(&mut raw, 1, Rights::READ);
    let wo = import(&mut raw, 2, Rights::WRITE);

    // Writes through the read-only grant: a bulk burst, a small write, an aligned word (the
    // atomic-store path), each refused with NoRights at its offset.
    for (off, len) in [(0u64, 6000usize), (100, 16), (4096, 8), (64, 4)] {
        let mut b = Vec::new();
        frame::encode_write(&Target { offset: off, ..ro }, &vec![0xee; len], &mut b);
        raw.send_raw(&b);
        let Frame::Refused(x) = decode_small(&raw.expect(frame::kind::REFUSED)) else { unreachable!() };
        assert_eq!((x.status, x.offset), (Status::NoRights, off), "write of {len} at {off} through read-only");
    }
    // A notification through it (it would post an event to the exporter).
    raw.send(&Frame::Notify { to: Target { offset: 0, ..ro }, len: 64 });
    // A read through the write-only grant: an error response, no data.
    raw.send(&Frame::ReadReq(ReadReq { id: 7, from: Target { offset: 0, ..wo }, len: 64 }));
    let read_refused = loop {
        match raw.next() {
            Got::ReadResp(s, d) => break (s, d),
            Got::Eof => panic!("closed"),
            Got::Frame(b, k) if k == frame::kind::REFUSED => {
                // The notification's refusal, if the exporter sends one.
                let Frame::Refused(x) = decode_small(&b) else { unreachable!() };
                assert_eq!(x.status, Status::NoRights);
            }
            Got::Frame(..) => {}
        }
    };
    assert_eq!(read_refused, (Status::NoRights, Vec::new()), "a read through a write-only grant");
    // The same grants used as granted still work: a read through the read-only one returns
    // the bytes; that proves the frames above reached the exporter and were judged.
    raw.send(&Frame::ReadReq(ReadReq { id: 8, from: Target { offset: 0, ..ro }, len: 8192 }));
    loop {
        match raw.next() {
            Got::ReadResp(s, d) => {
                assert_eq!(s, Status::Ok);
                assert!(d == before, "the read-only grant reads the aperture as it was");
                break;
            }
            Got::Eof => panic!("closed"),
            Got::Frame(..) => {}
        }
    }
    let mut after = vec![0u8; 8192];
    ap.read(0, &mut after).unwrap();
    assert!(after == before, "a refused write changed the aperture");
    assert_eq!(watched.count(), 0, "a refused write fired a tripwire");
    while let Some(e) = ep.event_queue().try_take() {
        assert!(!matches!(e, Event::Tripwire { .. } | Event::Notification { .. }), "refused access posted {e:?}");
    }
    // And a write through the write-only grant lands (the check is about rights, not the
    // peer).
    let mut b = Vec::new();
    frame::encode_write(&Target { offset: 8, ..wo }, b"granted!", &mut b);
    raw.send_raw(&b);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ap.load_u64(8).unwrap() != u64::from_le_bytes(*b"granted!") {
        assert!(Instant::now() < deadline, "the granted write never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The count is raised just after the data is visible: wait for it, then check it is one.
    while watched.count() < 1 {
        assert!(Instant::now() < deadline, "the granted write fired no tripwire");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(watched.count(), 1);
}

fn through_proxy(target: &Nic, keepalive: Option<Duration>) -> (Nic, FaultProxy) {
    let proxy = FaultProxy::start(target.addr().socket_addr()).unwrap();
    let mut cfg = config();
    cfg.routes.push((target.addr(), proxy.addr()));
    if let Some(k) = keepalive {
        cfg.link = LinkConfig { keepalive: k, dead_after: k * 5, ..LinkConfig::default() };
    }
    (Nic::open(cfg).unwrap(), proxy)
}

#[test]
fn delayed_link_still_delivers_in_order() {
    let _wd = Watchdog::new("delay", Duration::from_secs(120));
    let a = Nic::open(config()).unwrap();
    let ea = a.endpoint().unwrap();
    let ap = ea.export(1 << 20).unwrap();
    let (b, proxy) = through_proxy(&a, None);
    proxy.set_delay(Duration::from_millis(3));
    let m = b.endpoint().unwrap().import(&ap.descriptor()).unwrap();
    for i in 0..200u64 {
        m.write(i * 4096 % (1 << 20), &i.to_le_bytes().repeat(16)).unwrap();
        m.store_u64(8, i).unwrap();
    }
    m.barrier().unwrap();
    assert_eq!(ap.load_u64(8).unwrap(), 199, "last write wins: order kept (PRAM)");
}

#[test]
fn link_cut_mid_frame_then_reconnect() {
    let _wd = Watchdog::new("cut", Duration::from_secs(120));
    let a = Nic::open(config()).unwrap();
    let ea = a.endpoint().unwrap();
    let ap = ea.export(4 << 20).unwrap();
    let _tw = ap.tripwire(TripwireConfig::writes(0..8).event(1)).unwrap();
    ea.listen();
    let (b, proxy) = through_proxy(&a, None);
    let eb = std::sync::Arc::new(b.endpoint().unwrap());
    let mine = eb.export(4096).unwrap();
    let client = {
        let (eb, to, d) = (eb.clone(), ea.addr(), mine.descriptor());
        std::thread::spawn(move || eb.connect(to, &d, Some(Duration::from_secs(30))).unwrap())
    };
    let req = ea.accept(Some(Duration::from_secs(30))).unwrap();
    let sconn = req.accept(&ea, &ap.descriptor()).unwrap();
    let conn = client.join().unwrap();
    let m = eb.import(conn.peer_descriptor()).unwrap();
    proxy.cut_after(300_000);
    let big = vec![0xabu8; 4 << 20];
    let r = m.write(0, &big);
    // The write may or may not fail (it may have been handed to the kernel before the cut);
    // after the link is gone, the mapping says so.
    let start = Instant::now();
    loop {
        match m.store_u64(0, 1) {
            Err(AccessError::Disconnected) => break,
            _ => {
                assert!(start.elapsed() < Duration::from_secs(30), "the cut was never noticed ({r:?})");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    // Both endpoints learn that their connection is gone.
    let token = sconn.token();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = false;
    while Instant::now() < deadline && !seen {
        if let Ok(Event::Disconnect { token: t, .. }) = ea.event_queue().wait(Some(Duration::from_millis(100))) {
            seen = t == token;
        }
    }
    assert!(seen, "server saw the disconnect");
    assert!(
        !conn.is_alive() || {
            std::thread::sleep(Duration::from_millis(200));
            !conn.is_alive()
        }
    );
    // Nothing was written outside the aperture, and the exporter is fine; reconnecting works.
    proxy.cut_after(u64::MAX / 2);
    let m2 = eb.import(&ap.descriptor()).unwrap();
    m2.store_u64(0, 5).unwrap();
    m2.barrier().unwrap();
    assert_eq!(ap.load_u64(0).unwrap(), 5);
}

#[test]
fn silent_path_is_detected_by_keepalive() {
    let _wd = Watchdog::new("silence", Duration::from_secs(120));
    let mut cfg = config();
    cfg.link = LinkConfig {
        keepalive: Duration::from_millis(100),
        dead_after: Duration::from_millis(600),
        ..LinkConfig::default()
    };
    let a = Nic::open(cfg).unwrap();
    let ea = a.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    ea.listen();
    let (b, proxy) = through_proxy(&a, Some(Duration::from_millis(100)));
    let eb = b.endpoint().unwrap();
    let mine = eb.export(4096).unwrap();
    let t = {
        let to = ea.addr();
        let d = mine.descriptor();
        std::thread::spawn(move || {
            let c = eb.connect(to, &d, Some(Duration::from_secs(30))).unwrap();
            (eb, c)
        })
    };
    let sconn = ea.accept(Some(Duration::from_secs(30))).unwrap().accept(&ea, &ap.descriptor()).unwrap();
    let (eb, cconn) = t.join().unwrap();
    assert_eq!(b.stats().links, 1);
    proxy.set_silent(true);
    let start = Instant::now();
    while sconn.is_alive() || cconn.is_alive() {
        assert!(start.elapsed() < Duration::from_secs(30), "a silent peer was never declared dead");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The server's queue received the disconnect event for that connection.
    let token = sconn.token();
    let mut seen = false;
    while let Some(ev) = ea.event_queue().try_take() {
        seen |= matches!(ev, Event::Disconnect { token: t, .. } if t == token);
    }
    assert!(seen, "disconnect event for the dead connection");
    drop(eb);
}

#[test]
fn dropped_connections_end_connections_and_links_come_back() {
    let _wd = Watchdog::new("drop", Duration::from_secs(120));
    let a = Nic::open(config()).unwrap();
    let ea = a.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    let (b, proxy) = through_proxy(&a, None);
    let eb = b.endpoint().unwrap();
    let mut m = eb.import(&ap.descriptor()).unwrap();
    m.store_u64(0, 1).unwrap();
    m.barrier().unwrap();
    for round in 0..5u64 {
        proxy.drop_connections();
        let start = Instant::now();
        while m.store_u64(0, 0).is_ok() {
            assert!(start.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(m.store_u64(0, 0), Err(AccessError::Disconnected));
        // Import again: a new link is dialled on demand.
        m = eb.import(&ap.descriptor()).unwrap();
        m.store_u64(0, round + 10).unwrap();
        m.barrier().unwrap();
        assert_eq!(ap.load_u64(0).unwrap(), round + 10);
    }
    // Right after a drop, an import may find the dying link: it is repeated on a fresh one.
    for round in 0..5u64 {
        proxy.drop_connections();
        m = eb.import(&ap.descriptor()).unwrap();
        m.store_u64(0, round + 100).unwrap();
        m.barrier().unwrap();
        assert_eq!(ap.load_u64(0).unwrap(), round + 100);
    }
}

#[test]
fn simultaneous_dialling_leaves_one_link_per_pair() {
    let _wd = Watchdog::new("simultaneous", Duration::from_secs(120));
    for _ in 0..10 {
        let a = Nic::open(config()).unwrap();
        let b = Nic::open(config()).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        let (pa, pb) = (ea.export(4096).unwrap(), eb.export(4096).unwrap());
        let (da, db) = (pa.descriptor(), pb.descriptor());
        let t = std::thread::spawn(move || {
            let m = eb.import(&da).unwrap();
            m.store_u64(0, 2).unwrap();
            m.barrier().unwrap();
            eb
        });
        let m = ea.import(&db).unwrap();
        m.store_u64(0, 1).unwrap();
        m.barrier().unwrap();
        let _eb = t.join().unwrap();
        assert_eq!((pa.load_u64(0).unwrap(), pb.load_u64(0).unwrap()), (2, 1));
        let start = Instant::now();
        while a.stats().links != 1 || b.stats().links != 1 {
            assert!(start.elapsed() < Duration::from_secs(10), "links: {} and {}", a.stats().links, b.stats().links);
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
