//! Links between NICs, in one process over loopback TCP (LocalTransport::Link makes two NICs
//! of this host talk exactly as two hosts would).

mod util;

use std::time::Duration;

use clan::{AccessError, Event, ImportError, LocalTransport, Nic, NicConfig, Progress, Rights, TripwireConfig};
use util::Watchdog;

fn nic() -> Nic {
    Nic::open(NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() }).expect("open NIC")
}

#[test]
fn write_read_and_wake_across_a_link() {
    let _wd = Watchdog::new("link basic", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(1 << 16).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).event(7)).unwrap();
    let m = eb.import(&ap.descriptor()).unwrap();
    assert!(m.is_remote());
    tw.arm().unwrap();
    m.write(64, b"over the link").unwrap();
    m.store_u64(0, 42).unwrap();
    while ap.load_u64(0).unwrap() != 42 {
        tw.wait(Some(Duration::from_secs(30))).unwrap();
    }
    let mut buf = [0u8; 13];
    ap.read(64, &mut buf).unwrap();
    assert_eq!(&buf, b"over the link");
    assert!(matches!(ea.event_queue().wait(Some(Duration::from_secs(30))), Ok(Event::Tripwire { cookie: 7, .. })));
    // Reads are request/response.
    ap.write(1000, b"exporter data").unwrap();
    let mut r = [0u8; 13];
    m.read(1000, &mut r).unwrap();
    assert_eq!(&r, b"exporter data");
    assert_eq!(m.load_u64(0).unwrap(), 42);
    // Asynchronous read with a completion event.
    let p = m.read_async(1000, 13, Some((eb.event_queue(), 99))).unwrap();
    assert_eq!(p.wait(Some(Duration::from_secs(30))).unwrap(), b"exporter data");
    assert!(matches!(eb.event_queue().wait(Some(Duration::from_secs(30))), Ok(Event::ReadComplete { token: 99 })));
    // A large write, split into bursts, with a barrier.
    let big: Vec<u8> = (0..(1 << 16) - 4096).map(|i| (i * 31 % 251) as u8).collect();
    m.write(4096, &big).unwrap();
    m.barrier().unwrap();
    let mut back = vec![0u8; big.len()];
    ap.read(4096, &mut back).unwrap();
    assert!(back == big, "bulk data arrived intact");
}

#[test]
fn bounds_rights_and_stale_descriptors_across_a_link() {
    let _wd = Watchdog::new("link checks", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(8192).unwrap();
    let ro = eb.import(&ap.descriptor().derive(4096, 4096, Rights::READ).unwrap()).unwrap();
    assert_eq!(ro.write(0, b"x"), Err(AccessError::NotWritable));
    assert!(matches!(ro.write(4096, b"x"), Err(AccessError::NotWritable)));
    assert!(matches!(ro.read(4090, &mut [0; 8]), Err(AccessError::OutOfBounds { .. })));
    let mut bytes = ap.descriptor().derive(0, 4096, Rights::READ).unwrap().to_bytes();
    let at = bytes.len() - 17;
    bytes[at] = 3;
    let forged = clan::Descriptor::from_bytes(&bytes).unwrap();
    assert!(matches!(eb.import(&forged), Err(ImportError::BadKey)));
    let rw = eb.import(&ap.descriptor()).unwrap();
    rw.store_u64(0, 1).unwrap();
    rw.barrier().unwrap();
    let desc = ap.descriptor();
    drop(ap);
    // The next write is refused by the exporter; the refusal comes back; then the mapping is stale.
    let _ = rw.store_u64(0, 2);
    let _ = rw.barrier();
    assert_eq!(rw.store_u64(0, 3), Err(AccessError::Revoked));
    assert!(!rw.is_live());
    assert!(matches!(eb.import(&desc), Err(ImportError::Revoked { .. })));
}

#[test]
fn out_of_band_and_connections_across_a_link() {
    let _wd = Watchdog::new("link conns", Duration::from_secs(60));
    let (a, b) = (nic(), nic());
    let server = a.endpoint().unwrap();
    let client = b.endpoint().unwrap();
    client.send_oob(server.addr(), b"hi there").unwrap();
    let m = server.wait_oob(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(m.from, client.addr());
    assert_eq!(&m.payload[..8], b"hi there");
    server.listen();
    let s_ap = server.export(4096).unwrap();
    let c_ap = client.export(4096).unwrap();
    let c_desc = c_ap.descriptor();
    let to = server.addr();
    let t = std::thread::spawn(move || client.connect(to, &c_desc, Some(Duration::from_secs(30))).map(|c| (c, client)));
    let req = server.accept(Some(Duration::from_secs(30))).unwrap();
    let conn = req.accept(&server, &s_ap.descriptor()).unwrap();
    let (cconn, client) = t.join().unwrap().unwrap();
    assert_eq!(cconn.peer_descriptor(), &s_ap.descriptor());
    assert_eq!(conn.peer(), client.addr());
    // The client closes: the server sees a disconnect event carrying the token.
    let token = conn.token();
    drop(cconn);
    loop {
        match server.event_queue().wait(Some(Duration::from_secs(30))).unwrap() {
            Event::Disconnect { token: t, .. } if t == token => break,
            _ => {}
        }
    }
    assert!(!conn.is_alive());
}

#[test]
fn manual_progress() {
    let _wd = Watchdog::new("manual progress", Duration::from_secs(60));
    let a = Nic::open(NicConfig {
        local_transport: LocalTransport::Link,
        progress: Progress::Manual,
        ..NicConfig::default()
    })
    .unwrap();
    let b = nic();
    let ea = a.endpoint().unwrap();
    let eb = b.endpoint().unwrap();
    let ap = ea.export(4096).unwrap();
    // With manual progress the importer must drive its own link too while it waits.
    let m = eb.import(&ap.descriptor()).unwrap();
    m.store_u64(0, 5).unwrap();
    let start = std::time::Instant::now();
    while ap.load_u64(0).unwrap() != 5 {
        a.progress();
        assert!(start.elapsed() < Duration::from_secs(30));
    }
}
