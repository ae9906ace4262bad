//! Dead peers: when an exporting, importing or connected process dies (SIGKILL or a plain
//! exit), every access, wait and transfer that depends on it gets a typed error, and what it
//! held on the other side is freed. Within a host and across a link.
//!
//! The tests wait for each outcome with a watchdog, never against a clock; the time each
//! took is printed (the requirement is well under a second: the control channel of a dead
//! process closes at once, a link's at once or after `LinkConfig::dead_after`).

mod util;

use std::time::{Duration, Instant};

use clan::{
    AccessError, DmaOptions, EndpointAddr, Event, LocalTransport, Nic, NicConfig, TripwireConfig, TripwireError,
};
use util::{Peer, Watchdog, hear, say};

fn config(link: bool) -> NicConfig {
    NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    }
}

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    let link = std::env::var("CLAN_LINK").is_ok();
    let nic = Nic::open(config(link)).unwrap();
    match role.as_str() {
        "exporter" => {
            let ep = nic.endpoint().unwrap();
            let ap = ep.export(1 << 20).unwrap();
            ep.listen();
            say(format!("{} {}", ap.descriptor(), ep.addr()));
            let req = ep.accept(Some(Duration::from_secs(60))).unwrap();
            let _conn = req.accept(&ep, &ap.descriptor()).unwrap();
            say("accepted");
            while hear().is_some() {}
        }
        "importer" => {
            let desc: clan::Descriptor = std::env::var("CLAN_DESC").unwrap().parse().unwrap();
            let ep = nic.endpoint().unwrap();
            let m = ep.import(&desc).unwrap();
            m.write(0, b"imported").unwrap();
            m.barrier().unwrap();
            say("imported");
            while hear().is_some() {}
        }
        other => panic!("unknown role {other}"),
    }
}

fn kill(p: &mut Peer) {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(p.pid() as i32).unwrap(),
        rustix::process::Signal::KILL,
    );
}

/// Wait for `done`, with a watchdog around the whole test; returns how long it took.
fn until(what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    let e = t.elapsed();
    eprintln!("{what}: {e:?}");
    e
}

fn exporter_killed(link: bool) {
    let env = if link { vec![("CLAN_LINK", "1".to_string())] } else { vec![] };
    let mut exporter = Peer::spawn("child", "exporter", &env);
    let line = exporter.expect("descriptor");
    let (desc, addr) = line.split_once(' ').unwrap();
    let desc: clan::Descriptor = desc.parse().unwrap();
    let addr: EndpointAddr = addr.parse().unwrap();

    let nic = Nic::open(config(link)).unwrap();
    let ep = nic.endpoint().unwrap();
    let mine = ep.export(4096).unwrap();
    let conn = ep.connect(addr, &mine.descriptor(), Some(Duration::from_secs(20))).unwrap();
    assert_eq!(exporter.expect("accepted"), "accepted");
    let m = ep.import(&desc).unwrap();
    m.write(0, b"hello").unwrap();
    assert_eq!(m.is_remote(), link);
    // A thread waiting on the mapping's own tripwire (it fires on our writes only: once the
    // exporter is gone, nothing ever will).
    let tw = m.tripwire(TripwireConfig::writes(4096..4104)).unwrap();
    let waiter = std::thread::spawn(move || {
        tw.arm().unwrap();
        tw.wait(None)
    });
    // A DMA source.
    let src = ep.export(64 << 10).unwrap();

    kill(&mut exporter);
    let died = Instant::now();
    let mut disconnect_seen = false;
    until("the connection ends and its endpoint's queue says so", || {
        while let Some(e) = ep.event_queue().try_take() {
            disconnect_seen |= matches!(e, Event::Disconnect { token, .. } if token == conn.token());
        }
        !conn.is_alive() && disconnect_seen
    });
    until("a write through the mapping fails", || m.write(0, b"x").is_err());
    let e = m.write(0, b"x").unwrap_err();
    assert!(matches!(e, AccessError::Disconnected | AccessError::Revoked), "{e:?}");
    assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::ConnectionReset);
    assert!(m.load_u64(8).is_err(), "reads fail too");
    let r = waiter.join().unwrap();
    assert_eq!(r, Err(TripwireError::Disconnected), "the waiter on the mapping's tripwire is told");
    eprintln!("the tripwire waiter was told after {:?}", died.elapsed());
    // A transfer to the dead exporter: refused at once (checked when posted), or failed.
    match ep.dma_write(&src, 0, &m, 0, 4096, DmaOptions::new()) {
        Err(_) => {}
        Ok(t) => assert!(t.wait(Some(Duration::from_secs(30))).is_err(), "the DMA to a dead exporter fails"),
    }
}

#[test]
fn an_exporter_killed_ends_mappings_waits_transfers_and_connections() {
    let _wd = Watchdog::new("exporter killed", Duration::from_secs(120));
    exporter_killed(false);
}

#[test]
fn an_exporter_killed_across_a_link_ends_mappings_waits_transfers_and_connections() {
    let _wd = Watchdog::new("exporter killed across a link", Duration::from_secs(120));
    exporter_killed(true);
}

fn importer_killed(link: bool) {
    // Trusting importers: memory they received is recycled once they are gone (by default it
    // never is: `protection::memory_another_process_received_is_never_recycled`).
    let nic = Nic::open(NicConfig { cache_bytes: 64 << 20, reuse_imported_apertures: true, ..config(link) }).unwrap();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(1 << 20).unwrap();
    let mut env = vec![("CLAN_DESC", ap.descriptor().to_string())];
    if link {
        env.push(("CLAN_LINK", "1".to_string()));
    }
    let mut importer = Peer::spawn("child", "importer", &env);
    assert_eq!(importer.expect("imported"), "imported");
    let mut b = [0u8; 8];
    ap.read(0, &mut b).unwrap();
    assert_eq!(&b, b"imported");
    if link {
        // Across a link the importer never maps our memory (its accesses are applied by our
        // engine): what it holds is the link and its import records, freed with the link.
        assert_eq!(nic.stats().links, 1);
        kill(&mut importer);
        until("the dead importer's link and its imports are freed", || nic.stats().links == 0);
        return;
    }
    // Unexported while another process still maps it: the memory waits for that process.
    drop(ap);
    let before = nic.stats().cached_bytes;
    kill(&mut importer);
    // The importer's death releases its import: the memory is recycled.
    until("the dead importer's import is released and the memory recycled", || nic.stats().cached_bytes > before);
}

#[test]
fn an_importer_killed_releases_what_it_held() {
    let _wd = Watchdog::new("importer killed", Duration::from_secs(120));
    importer_killed(false);
}

#[test]
fn an_importer_killed_across_a_link_releases_what_it_held() {
    let _wd = Watchdog::new("importer killed across a link", Duration::from_secs(120));
    importer_killed(true);
}
