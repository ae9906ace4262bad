//! Property tests of the wire protocol.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clan_wire::burst::Burst;
use clan_wire::frame::{self, OOB_PAYLOAD};
use clan_wire::{
    Ack, Decoder, Frame, Hello, Import, ImportReply, Item, LinkConfig, LinkState, Oob, Pending, ReadReq, Refused,
    Status, Target, Timeout, WireError,
};
use proptest::prelude::*;

/// An owned frame or data frame, for generating streams.
#[derive(Debug, Clone, PartialEq)]
enum Owned {
    Small(SmallFrame),
    Write(Target, Vec<u8>),
    ReadResp(u64, Status, Vec<u8>),
}

#[derive(Debug, Clone, PartialEq)]
enum SmallFrame {
    Hello(Hello),
    Auth([u8; 32]),
    ReadReq(ReadReq),
    Oob(Oob),
    OobResult(u64, Status),
    Import(u64, SocketAddr, u32, Vec<u8>),
    ImportReply(ImportReply),
    Unimport(u64),
    Ack(Ack),
    Credit(u64),
    Refused(Refused),
    Ping(u64),
    Pong(u64),
    Close(Status),
    Notify(Target, u64),
    Welcome,
}

impl SmallFrame {
    fn frame(&self) -> Frame<'_> {
        match self {
            SmallFrame::Hello(h) => Frame::Hello(*h),
            SmallFrame::Auth(a) => Frame::Auth(*a),
            SmallFrame::ReadReq(r) => Frame::ReadReq(*r),
            SmallFrame::Oob(o) => Frame::Oob(*o),
            SmallFrame::OobResult(id, s) => Frame::OobResult { id: *id, status: *s },
            SmallFrame::Import(id, n, p, d) => {
                Frame::Import(Import { id: *id, importer_nic: *n, importer_port: *p, desc: d })
            }
            SmallFrame::ImportReply(r) => Frame::ImportReply(*r),
            SmallFrame::Unimport(k) => Frame::Unimport { key: *k },
            SmallFrame::Ack(a) => Frame::Ack(*a),
            SmallFrame::Credit(b) => Frame::Credit { bytes: *b },
            SmallFrame::Refused(r) => Frame::Refused(*r),
            SmallFrame::Ping(t) => Frame::Ping { token: *t },
            SmallFrame::Pong(t) => Frame::Pong { token: *t },
            SmallFrame::Close(s) => Frame::Close { status: *s },
            SmallFrame::Notify(t, l) => Frame::Notify { to: *t, len: *l },
            SmallFrame::Welcome => Frame::Welcome,
        }
    }
}

fn addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::from((ip, p))),
        (any::<[u8; 16]>(), any::<u16>())
            .prop_filter("not v4-mapped", |(ip, _)| std::net::Ipv6Addr::from(*ip).to_ipv4_mapped().is_none())
            .prop_map(|(ip, p)| SocketAddr::from((ip, p))),
    ]
}

fn status() -> impl Strategy<Value = Status> {
    (0u8..=14).prop_map(Status::from_u8)
}

fn target() -> impl Strategy<Value = Target> {
    (0u32..4, 0u32..3, 0u64..3, 0u64..1 << 20).prop_map(|(aperture, generation, key, offset)| Target {
        aperture,
        generation,
        key,
        offset,
    })
}

fn small() -> impl Strategy<Value = SmallFrame> {
    prop_oneof![
        (any::<u16>(), addr(), any::<[u8; 16]>(), any::<u64>()).prop_map(|(flags, nic, nonce, credit)| {
            SmallFrame::Hello(Hello { version: frame::VERSION, flags, nic, nonce, credit })
        }),
        any::<[u8; 32]>().prop_map(SmallFrame::Auth),
        (any::<u64>(), target(), 0u32..1 << 20).prop_map(|(id, from, len)| SmallFrame::ReadReq(ReadReq {
            id,
            from,
            len
        })),
        (any::<u64>(), addr(), any::<u32>(), any::<u32>(), any::<[u8; 32]>()).prop_map(|(id, n, fp, tp, p)| {
            let mut payload = [0u8; OOB_PAYLOAD];
            payload[..32].copy_from_slice(&p);
            SmallFrame::Oob(Oob { id, from_nic: n, from_port: fp, to_port: tp, payload })
        }),
        (any::<u64>(), status()).prop_map(|(i, s)| SmallFrame::OobResult(i, s)),
        (any::<u64>(), addr(), any::<u32>(), prop::collection::vec(any::<u8>(), 0..200))
            .prop_map(|(i, n, p, d)| SmallFrame::Import(i, n, p, d)),
        (any::<u64>(), status(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u8>()).prop_map(
            |(id, status, key, aperture_len, offset, len, rights)| {
                SmallFrame::ImportReply(ImportReply { id, status, key, aperture_len, offset, len, rights })
            }
        ),
        any::<u64>().prop_map(SmallFrame::Unimport),
        (any::<u64>(), any::<u64>()).prop_map(|(w, b)| SmallFrame::Ack(Ack { writes: w, bytes: b })),
        any::<u64>().prop_map(SmallFrame::Credit),
        (status(), any::<u64>(), any::<u64>()).prop_map(|(status, key, offset)| SmallFrame::Refused(Refused {
            status,
            key,
            offset
        })),
        any::<u64>().prop_map(SmallFrame::Ping),
        any::<u64>().prop_map(SmallFrame::Pong),
        status().prop_map(SmallFrame::Close),
        (target(), any::<u64>()).prop_map(|(t, l)| SmallFrame::Notify(t, l)),
        Just(SmallFrame::Welcome),
    ]
}

fn owned() -> impl Strategy<Value = Owned> {
    prop_oneof![
        small().prop_map(Owned::Small),
        (target(), prop::collection::vec(any::<u8>(), 1..3000)).prop_map(|(t, d)| Owned::Write(t, d)),
        (any::<u64>(), status(), prop::collection::vec(any::<u8>(), 0..3000))
            .prop_map(|(i, s, d)| Owned::ReadResp(i, s, d)),
    ]
}

fn encode_all(frames: &[Owned]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        match f {
            Owned::Small(s) => s.frame().encode(&mut out),
            Owned::Write(t, d) => frame::encode_write(t, d, &mut out),
            Owned::ReadResp(i, s, d) => frame::encode_read_resp(*i, *s, d, &mut out),
        }
    }
    out
}

/// Appends bytes moved "directly" to the item they belong to.
type Push = Box<dyn Fn(&mut Vec<Owned>, &[u8])>;

/// Decode `stream` fed in chunks of the given sizes; when `direct` says so, move pending
/// payload bytes "ourselves" (as a receiver reading straight into an aperture would).
fn decode_chunked(stream: &[u8], chunks: &[usize], direct: &[bool]) -> Result<Vec<Owned>, WireError> {
    let mut dec = Decoder::new();
    let mut out: Vec<Owned> = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut pos = 0;
    let mut ci = 0;
    let mut di = 0;
    while pos < stream.len() || !buf.is_empty() {
        if pos < stream.len() {
            let n = chunks.get(ci).copied().unwrap_or(7).clamp(1, stream.len() - pos);
            ci += 1;
            buf.extend_from_slice(&stream[pos..pos + n]);
            pos += n;
        }
        loop {
            // Sometimes take payload bytes directly.
            if let Some(p) = dec.pending_payload() {
                if direct.get(di).copied().unwrap_or(false) && !buf.is_empty() {
                    di += 1;
                    let (rem, push): (u64, Push) = match p {
                        Pending::Write { to, remaining } => (
                            remaining,
                            Box::new(move |o: &mut Vec<Owned>, d: &[u8]| {
                                let Some(Owned::Write(t, data)) = o.last_mut() else { panic!("no burst open") };
                                assert_eq!(
                                    t.advance(data.len() as u64),
                                    to,
                                    "direct bytes land where the burst continues"
                                );
                                data.extend_from_slice(d);
                            }),
                        ),
                        Pending::ReadResp { remaining, .. } => (
                            remaining,
                            Box::new(|o: &mut Vec<Owned>, d: &[u8]| {
                                let Some(Owned::ReadResp(_, _, data)) = o.last_mut() else {
                                    panic!("no response open")
                                };
                                data.extend_from_slice(d);
                            }),
                        ),
                    };
                    let n = (rem as usize).min(buf.len()).min(5);
                    push(&mut out, &buf[..n]);
                    dec.consume_payload(n as u64)?;
                    buf.drain(..n);
                    continue;
                }
                di += 1;
            }
            let Some((item, used)) = dec.next(&buf)? else { break };
            match item {
                Item::Frame(f) => {
                    let s = match f {
                        Frame::Hello(h) => SmallFrame::Hello(h),
                        Frame::Auth(a) => SmallFrame::Auth(a),
                        Frame::ReadReq(r) => SmallFrame::ReadReq(r),
                        Frame::Oob(o) => SmallFrame::Oob(o),
                        Frame::OobResult { id, status } => SmallFrame::OobResult(id, status),
                        Frame::Import(i) => SmallFrame::Import(i.id, i.importer_nic, i.importer_port, i.desc.to_vec()),
                        Frame::ImportReply(r) => SmallFrame::ImportReply(r),
                        Frame::Unimport { key } => SmallFrame::Unimport(key),
                        Frame::Ack(a) => SmallFrame::Ack(a),
                        Frame::Credit { bytes } => SmallFrame::Credit(bytes),
                        Frame::Refused(r) => SmallFrame::Refused(r),
                        Frame::Ping { token } => SmallFrame::Ping(token),
                        Frame::Pong { token } => SmallFrame::Pong(token),
                        Frame::Close { status } => SmallFrame::Close(status),
                        Frame::Notify { to, len } => SmallFrame::Notify(to, len),
                        Frame::Welcome => SmallFrame::Welcome,
                    };
                    out.push(Owned::Small(s));
                }
                Item::WriteBegin { to, .. } => out.push(Owned::Write(to, Vec::new())),
                Item::WriteData { to, data, .. } => {
                    let Some(Owned::Write(t, d)) = out.last_mut() else { panic!("data outside a burst") };
                    assert_eq!(t.advance(d.len() as u64), to, "each chunk is the rest of the burst");
                    d.extend_from_slice(data);
                }
                Item::ReadRespBegin { id, status, .. } => out.push(Owned::ReadResp(id, status, Vec::new())),
                Item::ReadRespData { at, data, .. } => {
                    let Some(Owned::ReadResp(_, _, d)) = out.last_mut() else { panic!("data outside a response") };
                    assert_eq!(at as usize, d.len());
                    d.extend_from_slice(data);
                }
            }
            buf.drain(..used);
        }
        if pos >= stream.len() && dec.next(&buf)?.is_none() && dec.pending_payload().is_none() {
            break;
        }
    }
    assert!(dec.at_boundary(), "stream ended inside a frame");
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Encoding then decoding gives the frames back, however the bytes are chunked and
    /// whoever moves the payload.
    #[test]
    fn encode_decode_identity(
        frames in prop::collection::vec(owned(), 1..12),
        chunks in prop::collection::vec(1usize..600, 0..64),
        direct in prop::collection::vec(any::<bool>(), 0..64),
    ) {
        let stream = encode_all(&frames);
        let got = decode_chunked(&stream, &chunks, &direct).unwrap();
        prop_assert_eq!(got, frames);
    }

    /// Splitting bursts anywhere and coalescing adjacent ones never changes what memory holds.
    #[test]
    fn split_and_coalesce_are_equivalent(
        writes in prop::collection::vec((target(), prop::collection::vec(any::<u8>(), 1..200)), 1..20),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..40),
        merges in prop::collection::vec(any::<bool>(), 0..80),
    ) {
        let bursts: Vec<Burst> = writes.into_iter().map(|(to, data)| Burst { to, data }).collect();
        // Split at random points.
        let mut split: Vec<Burst> = Vec::new();
        let mut ci = 0;
        for b in &bursts {
            let mut cur = b.clone();
            while cur.data.len() > 1 && ci < cuts.len() {
                let at = cuts[ci].index(cur.data.len() - 1) + 1;
                ci += 1;
                let (a, rest) = cur.split(at).unwrap();
                split.push(a);
                cur = rest;
            }
            split.push(cur);
        }
        // Coalesce adjacent ones where allowed.
        let mut merged: Vec<Burst> = Vec::new();
        for (i, b) in split.into_iter().enumerate() {
            match merged.last_mut() {
                Some(last) if merges.get(i).copied().unwrap_or(true) => {
                    if let Err(b) = last.coalesce(b) { merged.push(b); }
                }
                _ => merged.push(b),
            }
        }
        prop_assert_eq!(apply(&bursts), apply(&merged));
        // And the result survives the wire.
        let frames: Vec<Owned> = merged.iter().map(|b| Owned::Write(b.to, b.data.clone())).collect();
        let got = decode_chunked(&encode_all(&frames), &[3, 50, 1], &[]).unwrap();
        prop_assert_eq!(got, frames);
    }

    /// Arbitrary bytes are an error or a wait for more, never a panic.
    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        let mut dec = Decoder::new();
        let mut buf = &bytes[..];
        while let Ok(Some((_, used))) = dec.next(buf) {
            if used == 0 { break; }
            buf = &buf[used..];
        }
    }

    /// The window is never exceeded and acknowledgements are checked.
    #[test]
    fn window_is_respected(ops in prop::collection::vec((any::<bool>(), 1u64..100_000), 1..200)) {
        let now = Instant::now();
        let cfg = LinkConfig { credit: 256 << 10, ..LinkConfig::default() };
        let mut tx = LinkState::new(cfg, now);
        let mut rx = LinkState::new(cfg, now);
        let mut in_wire: Vec<u64> = Vec::new();
        for (send, n) in ops {
            if send && tx.window_allows(n) {
                tx.on_write_sent(n);
                in_wire.push(n);
                prop_assert!(tx.in_flight() <= cfg.credit || in_wire.len() == 1 || tx.in_flight() == n);
            } else if let Some(n) = (!in_wire.is_empty()).then(|| in_wire.remove(0)) {
                rx.on_write_applied(true, n);
                if let Some(a) = rx.poll_ack(false) { tx.on_ack(a).unwrap(); }
            }
        }
        // Everything applied: a forced ack releases the whole window.
        for n in in_wire.drain(..) { rx.on_write_applied(true, n); }
        if let Some(a) = rx.poll_ack(true) { tx.on_ack(a).unwrap(); }
        prop_assert_eq!(tx.in_flight(), 0);
        if tx.sent_writes() > 0 {
            prop_assert_eq!(tx.on_ack(Ack { writes: 0, bytes: 0 }), Err(WireError::BadAck), "going backwards");
        }
        prop_assert_eq!(
            tx.on_ack(Ack { writes: tx.sent_writes() + 1, bytes: u64::MAX }),
            Err(WireError::BadAck),
            "beyond what was sent"
        );
    }
}

fn apply(bursts: &[Burst]) -> HashMap<(u32, u32, u64, u64), u8> {
    let mut mem = HashMap::new();
    for b in bursts {
        for (i, &byte) in b.data.iter().enumerate() {
            mem.insert((b.to.aperture, b.to.generation, b.to.key, b.to.offset + i as u64), byte);
        }
    }
    mem
}

#[test]
fn malformed_frames_are_errors() {
    let mut d = Decoder::new();
    assert_eq!(d.next(&[0, 0, 0, 0, 1]), Err(WireError::BadLength { kind: 1, len: 0 }));
    let mut d = Decoder::new();
    assert_eq!(d.next(&[2, 0, 0, 0, 99, 0]), Err(WireError::UnknownKind(99)));
    // A write without data.
    let mut d = Decoder::new();
    let mut f = frame::write_header(&Target { aperture: 0, generation: 0, key: 0, offset: 0 }, 0).to_vec();
    f.truncate(frame::WRITE_HEADER);
    assert_eq!(d.next(&f), Err(WireError::EmptyBurst));
    // A burst whose end would overflow the address space.
    let mut d = Decoder::new();
    let h = frame::write_header(&Target { aperture: 0, generation: 0, key: 0, offset: u64::MAX - 1 }, 8);
    assert_eq!(d.next(&h), Err(WireError::BadField));
    // Too large.
    let mut d = Decoder::new();
    assert!(matches!(d.next(&[0xff, 0xff, 0xff, 0x7f, 3]), Err(WireError::TooLarge { .. })));
    // A small frame with trailing bytes.
    let mut b = Vec::new();
    Frame::Ping { token: 1 }.encode(&mut b);
    b[0] += 1;
    b.push(0);
    assert_eq!(Decoder::new().next(&b), Err(WireError::TrailingBytes));
    // Truncated small frame body.
    let mut b = Vec::new();
    Frame::Ping { token: 1 }.encode(&mut b);
    b[0] -= 1;
    b.pop();
    assert_eq!(Decoder::new().next(&b), Err(WireError::Truncated));
    assert_eq!(Decoder::new().consume_payload(1), Err(WireError::NotInPayload));
}

#[test]
fn keepalive_with_a_virtual_clock() {
    let t0 = Instant::now();
    let cfg = LinkConfig {
        credit: 1 << 20,
        keepalive: Duration::from_millis(100),
        dead_after: Duration::from_millis(500),
        ..LinkConfig::default()
    };
    let mut s = LinkState::new(cfg, t0);
    assert_eq!(s.handle_timeout(t0 + Duration::from_millis(50)), Timeout::None);
    assert_eq!(s.poll_timeout(), t0 + Duration::from_millis(100));
    let Timeout::Ping(tok) = s.handle_timeout(t0 + Duration::from_millis(120)) else { panic!("expected a ping") };
    assert_eq!(s.handle_timeout(t0 + Duration::from_millis(130)), Timeout::None, "one probe at a time");
    assert_eq!(s.poll_timeout(), t0 + Duration::from_millis(500));
    s.on_pong(tok, t0 + Duration::from_millis(200));
    assert_eq!(s.handle_timeout(t0 + Duration::from_millis(250)), Timeout::None);
    assert!(matches!(s.handle_timeout(t0 + Duration::from_millis(310)), Timeout::Ping(_)));
    assert_eq!(s.handle_timeout(t0 + Duration::from_millis(700)), Timeout::Dead);
}

/// Every file of the fuzzer's seed corpus decodes without panicking (and the corpus is made
/// of real frames: regenerate with `CLAN_WRITE_CORPUS=1 cargo test -p clan-wire seed_corpus`).
#[test]
fn seed_corpus() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/decode");
    if std::env::var_os("CLAN_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        let nic: SocketAddr = "10.77.0.1:7000".parse().unwrap();
        let t = Target { aperture: 3, generation: 1, key: 0x1234_5678_9abc_def0, offset: 4096 };
        let samples: Vec<(&str, Vec<u8>)> = vec![
            ("hello", enc(Frame::Hello(Hello { version: 1, flags: 0, nic, nonce: [7; 16], credit: 8 << 20 }))),
            ("auth", enc(Frame::Auth([9; 32]))),
            ("write_small", {
                let mut b = Vec::new();
                frame::encode_write(&t, &[1, 2, 3, 4, 5, 6, 7, 8], &mut b);
                b
            }),
            ("write_page", {
                let mut b = Vec::new();
                frame::encode_write(&t, &[0xab; 4096], &mut b);
                b
            }),
            ("read_req", enc(Frame::ReadReq(ReadReq { id: 1, from: t, len: 64 }))),
            ("read_resp", {
                let mut b = Vec::new();
                frame::encode_read_resp(1, Status::Ok, &[5; 64], &mut b);
                b
            }),
            ("oob", enc(Frame::Oob(Oob { id: 2, from_nic: nic, from_port: 1, to_port: 2, payload: [3; 40] }))),
            (
                "import",
                enc(Frame::Import(Import { id: 3, importer_nic: nic, importer_port: 4, desc: &[0x43, 0x31, 0, 0] })),
            ),
            (
                "import_reply",
                enc(Frame::ImportReply(ImportReply {
                    id: 3,
                    status: Status::Ok,
                    key: 5,
                    aperture_len: 8192,
                    offset: 0,
                    len: 8192,
                    rights: 3,
                })),
            ),
            ("ack", enc(Frame::Ack(Ack { writes: 10, bytes: 4096 }))),
            ("credit", enc(Frame::Credit { bytes: 1 << 20 })),
            ("refused", enc(Frame::Refused(Refused { status: Status::OutOfBounds, key: 5, offset: 9000 }))),
            ("notify", enc(Frame::Notify { to: t, len: 4096 })),
            ("ping_pong_close", {
                let mut b = enc(Frame::Ping { token: 1 });
                b.extend(enc(Frame::Pong { token: 1 }));
                b.extend(enc(Frame::Close { status: Status::Shutdown }));
                b
            }),
        ];
        for (name, bytes) in samples {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("fuzz/corpus/decode exists").flatten() {
        let bytes = std::fs::read(e.path()).unwrap();
        let mut dec = Decoder::new();
        let mut buf = &bytes[..];
        while let Ok(Some((_, used))) = dec.next(buf) {
            buf = &buf[used..];
        }
        // The seeds are real frames and decode completely; inputs the fuzzer added to the
        // corpus only have to be survived.
        let seed = !e.file_name().to_string_lossy().chars().any(|c| c.is_ascii_hexdigit() && c.is_ascii_digit());
        assert!(!seed || buf.is_empty(), "{:?} did not decode completely", e.path());
        n += 1;
    }
    assert!(n >= 10);
}

fn enc(f: Frame<'_>) -> Vec<u8> {
    let mut b = Vec::new();
    f.encode(&mut b);
    b
}
