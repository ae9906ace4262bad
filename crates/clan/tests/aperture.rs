//! Apertures, descriptors and mappings within one process.

use clan::{
    AccessError, Denial, Descriptor, EndpointConfig, ExportConfig, ExportError, ImportError, ImportPolicy, Nic,
    NicConfig, Rights,
};

fn nic() -> Nic {
    Nic::open(NicConfig::default()).expect("open NIC")
}

#[test]
fn export_import_write_read() {
    let nic = nic();
    let a = nic.endpoint().unwrap();
    let b = nic.endpoint().unwrap();
    let ap = a.export(10_000).unwrap();
    assert_eq!(ap.len(), 10_000);
    let desc: Descriptor = ap.descriptor().to_string().parse().unwrap();
    let m = b.import(&desc).unwrap();
    assert_eq!(m.len(), 10_000);
    m.write(100, b"hello, aperture").unwrap();
    let mut buf = [0u8; 15];
    ap.read(100, &mut buf).unwrap();
    assert_eq!(&buf, b"hello, aperture");
    ap.write(9_990, &[7; 10]).unwrap();
    let mut tail = [0u8; 10];
    m.read(9_990, &mut tail).unwrap();
    assert_eq!(tail, [7; 10]);
    m.store_u64(8, 0xdead_beef).unwrap();
    assert_eq!(ap.load_u64(8).unwrap(), 0xdead_beef);
    ap.store_u32(16, 77).unwrap();
    assert_eq!(m.load_u32(16).unwrap(), 77);
    // A new aperture is zero-filled.
    let z = a.export(4096).unwrap();
    let mut all = vec![1u8; 4096];
    z.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 0));
}

#[test]
fn out_of_range_and_misaligned_accesses_are_errors() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    // A narrowed descriptor: 100 bytes at 1000.
    let d = ap.descriptor().derive(1000, 100, Rights::READ_WRITE).unwrap();
    let m = ep.import(&d).unwrap();
    assert_eq!(m.write(95, &[0; 6]), Err(AccessError::OutOfBounds { offset: 95, len: 6, size: 100 }));
    assert_eq!(m.write(u64::MAX, &[0; 2]), Err(AccessError::OutOfBounds { offset: u64::MAX, len: 2, size: 100 }));
    assert_eq!(m.read(100, &mut [0; 1]), Err(AccessError::OutOfBounds { offset: 100, len: 1, size: 100 }));
    assert_eq!(m.store_u64(4, 1), Err(AccessError::Misaligned { offset: 4, align: 8 }));
    assert!(matches!(m.raw(50, 51), Err(AccessError::OutOfBounds { .. })));
    // Nothing outside [1000, 1100) was touched by the in-range writes.
    m.write(0, &[0xff; 100]).unwrap();
    let mut before = [0u8; 1000];
    ap.read(0, &mut before).unwrap();
    assert!(before.iter().all(|&b| b == 0));
    let mut after = vec![0u8; 4096 - 1100];
    ap.read(1100, &mut after).unwrap();
    assert!(after.iter().all(|&b| b == 0));
    let mut inside = [0u8; 100];
    ap.read(1000, &mut inside).unwrap();
    assert!(inside.iter().all(|&b| b == 0xff));
    // Local access to the aperture is bounded by its length too.
    assert!(matches!(ap.write(4090, &[0; 7]), Err(AccessError::OutOfBounds { .. })));
}

#[test]
fn rights_are_enforced() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let ro = ep.import(&ap.descriptor().derive(0, 4096, Rights::READ).unwrap()).unwrap();
    assert_eq!(ro.write(0, b"x"), Err(AccessError::NotWritable));
    assert_eq!(ro.store_u64(0, 1), Err(AccessError::NotWritable));
    assert_eq!(ro.commit(0, 8), Err(AccessError::NotWritable));
    ap.write(0, b"visible").unwrap();
    let mut b = [0u8; 7];
    ro.read(0, &mut b).unwrap();
    assert_eq!(&b, b"visible");
    let wo = ep.import(&ap.descriptor().derive(0, 4096, Rights::WRITE).unwrap()).unwrap();
    assert_eq!(wo.read(0, &mut b), Err(AccessError::NotReadable));
    assert_eq!(wo.load_u64(0), Err(AccessError::NotReadable));
    wo.write(0, b"W").unwrap();
}

#[test]
fn stale_and_forged_descriptors_are_refused() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(8192).unwrap();
    let desc = ap.descriptor();
    let m = ep.import(&desc).unwrap();
    // Forge: escalate a read-only descriptor's rights byte.
    let ro = desc.derive(0, 4096, Rights::READ).unwrap();
    let mut bytes = ro.to_bytes();
    let at = bytes.len() - 17;
    bytes[at] = 3;
    let forged = Descriptor::from_bytes(&bytes).unwrap();
    assert!(matches!(ep.import(&forged), Err(ImportError::BadKey)));
    // Unexport: the mapping and the descriptor go stale at once.
    let (id, generation) = (ap.id(), ap.generation());
    drop(ap);
    assert_eq!(m.write(0, b"late"), Err(AccessError::Revoked));
    assert!(!m.is_live());
    match ep.import(&desc) {
        Err(ImportError::Revoked { aperture, generation: g }) => assert_eq!((aperture, g), (id, generation)),
        other => panic!("expected Revoked, got {other:?}"),
    }
    // A new export reusing the id has a new generation; the old descriptor stays dead.
    drop(m);
    let ap2 = ep.export(8192).unwrap();
    assert!(ap2.id() != id || ap2.generation() != generation);
    assert!(matches!(ep.import(&desc), Err(ImportError::Revoked { .. })));
}

#[test]
fn restricting_importers_by_endpoint() {
    let nic = nic();
    let owner = nic.endpoint().unwrap();
    let friend = nic.endpoint().unwrap();
    let stranger = nic.endpoint().unwrap();
    let ap = owner
        .export_with(
            4096,
            ExportConfig { policy: ImportPolicy::anyone().endpoint(friend.addr()), ..ExportConfig::default() },
        )
        .unwrap();
    assert!(friend.import(&ap.descriptor()).is_ok());
    assert!(matches!(stranger.import(&ap.descriptor()), Err(ImportError::Denied(Denial::Endpoint))));
    let ap = owner
        .export_with(4096, ExportConfig { policy: ImportPolicy::anyone().uid(0xfffe), ..ExportConfig::default() })
        .unwrap();
    assert!(matches!(friend.import(&ap.descriptor()), Err(ImportError::Denied(Denial::Uid))));
    let ap = owner
        .export_with(
            4096,
            ExportConfig { policy: ImportPolicy::anyone().pid(std::process::id()), ..ExportConfig::default() },
        )
        .unwrap();
    assert!(friend.import(&ap.descriptor()).is_ok());
}

#[test]
fn memory_is_reused_only_when_no_mapping_can_reach_it() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(64 * 1024).unwrap();
    ap.fill(0, 64 * 1024, 0xaa).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    let fresh = nic.stats().exports_fresh;
    drop(ap);
    // A mapping still exists: the memory must not be handed out again.
    let other = ep.export(64 * 1024).unwrap();
    assert_eq!(nic.stats().exports_fresh, fresh + 1, "memory reachable by a stale mapping was reused");
    drop(m);
    drop(other);
    // Now both are released: the next export of that size comes from the cache, zeroed.
    let cached = nic.stats().exports_cached;
    let again = ep.export(64 * 1024).unwrap();
    assert_eq!(nic.stats().exports_cached, cached + 1);
    let mut buf = vec![1u8; 64 * 1024];
    again.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "reused memory must be zeroed");
}

#[test]
fn closing_an_endpoint_unexports_its_apertures_and_frees_its_port() {
    let nic = nic();
    let ep = nic.endpoint_with(EndpointConfig { port: Some(4242), queue: None, ..Default::default() }).unwrap();
    let other = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let m = other.import(&ap.descriptor()).unwrap();
    assert!(matches!(
        nic.endpoint_with(EndpointConfig { port: Some(4242), queue: None, ..Default::default() }),
        Err(clan::EndpointError::PortInUse(4242))
    ));
    ep.close();
    assert_eq!(m.write(0, b"x"), Err(AccessError::Revoked));
    assert!(matches!(ap.tripwire(clan::TripwireConfig::writes(0..8)), Err(clan::TripwireError::Stale)));
    let again = nic.endpoint_with(EndpointConfig { port: Some(4242), queue: None, ..Default::default() }).unwrap();
    assert_eq!(again.port(), 4242);
}

#[test]
fn bad_export_arguments() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    assert!(matches!(ep.export(0), Err(ExportError::Empty)));
    assert!(matches!(ep.export(clan::MAX_APERTURE + 1), Err(ExportError::TooLarge { .. })));
}

#[test]
fn raw_access_then_commit() {
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let tw = ap.tripwire(clan::TripwireConfig::writes(64..72)).unwrap();
    let m = ep.import(&ap.descriptor()).unwrap();
    {
        let mut r = m.raw(0, 128).unwrap();
        assert!(r.is_writable());
        // SAFETY: this test is the only party touching the aperture.
        let s = unsafe { r.as_mut_slice() };
        s[64..72].copy_from_slice(&9u64.to_le_bytes());
    }
    assert!(!tw.take_fired(), "raw stores are invisible to the NIC until committed");
    assert_eq!(m.commit(0, 128).unwrap(), 1);
    assert!(tw.take_fired());
    assert_eq!(ap.load_u64(64).unwrap(), 9);
}

#[test]
fn two_nics_in_one_process_talk_like_two_processes() {
    let n1 = nic();
    let n2 = nic();
    assert_ne!(n1.addr(), n2.addr());
    let a = n1.endpoint().unwrap();
    let b = n2.endpoint().unwrap();
    let ap = a.export(4096).unwrap();
    let m = b.import(&ap.descriptor()).unwrap();
    m.write(0, b"across NICs").unwrap();
    let mut buf = [0u8; 11];
    ap.read(0, &mut buf).unwrap();
    assert_eq!(&buf, b"across NICs");
    assert_eq!(ap.remote_imports(), 1);
    drop(m);
    let w = std::time::Instant::now();
    while ap.remote_imports() != 0 {
        assert!(w.elapsed() < std::time::Duration::from_secs(10), "unimport never arrived");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn nic_addresses() {
    let n1 = nic();
    let taken = n1.addr();
    match Nic::open(NicConfig::at(taken.ip(), taken.port())) {
        Err(clan::NicError::AddrInUse(a)) => assert_eq!(a, taken),
        other => panic!("expected AddrInUse, got {other:?}"),
    }
}

/// The descriptor fuzzer's corpus (real descriptors: whole, narrowed, text) through its
/// harness. Regenerate the seeds with `CLAN_WRITE_CORPUS=1 cargo test -p clan --test aperture
/// descriptor_corpus`.
#[test]
fn descriptor_corpus_replays() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/descriptor");
    if std::env::var_os("CLAN_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        let nic = clan::Nic::open_default().unwrap();
        let ep = nic.endpoint().unwrap();
        let ap = ep.export(1 << 20).unwrap();
        let d = ap.descriptor();
        let n = d.derive(4096, 8192, clan::Rights::READ).unwrap();
        let nn = n.derive(0, 64, clan::Rights::READ).unwrap();
        for (name, ctl, bytes) in [
            ("whole", 0u8, d.to_bytes()),
            ("narrowed", 2, n.to_bytes()),
            ("narrowed_twice", 4, nn.to_bytes()),
            ("text", 1, d.to_string().into_bytes()),
            ("text_narrowed", 3, n.to_string().into_bytes()),
        ] {
            std::fs::write(dir.join(name), [vec![ctl], bytes].concat()).unwrap();
        }
    }
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        clan::fuzzing::descriptor(&std::fs::read(e.path()).unwrap());
        n += 1;
    }
    assert!(n > 0, "the descriptor corpus is empty");
}

/// This thread's minor page faults so far (`/proc/thread-self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("thread stat");
    // (the command name, in parentheses, may hold spaces: count from its end)
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    rest.split_whitespace().nth(7).and_then(|f| f.parse().ok()).expect("minflt")
}

/// Whether the kernel has `MADV_POPULATE_WRITE` (Linux 5.14).
fn has_populate() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    (major, minor) >= (5, 14)
}

/// A prefaulted range takes no page fault on its first stores, through the aperture or a
/// mapping of it; the same stores on a range not prefaulted do (the control).
#[test]
fn prefaulted_pages_take_no_fault_on_first_use() {
    if !has_populate() {
        eprintln!("skipped: the kernel has no MADV_POPULATE_WRITE");
        return;
    }
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let pages = 64u64;
    let touch = |f: &dyn Fn(u64)| {
        let before = minor_faults();
        for p in 0..pages {
            f(p * 4096);
        }
        minor_faults() - before
    };
    // The control: first stores into fresh pages fault.
    let cold = ep.export(pages * 4096).unwrap();
    let faults = touch(&|off| cold.write(off, &[1]).unwrap());
    assert!(faults >= pages / 2, "the control took only {faults} faults for {pages} fresh pages");
    // Prefaulted: none.
    let warm = ep.export(pages * 4096).unwrap();
    warm.prefault(0, pages * 4096).unwrap();
    assert_eq!(touch(&|off| warm.write(off, &[1]).unwrap()), 0, "stores into a prefaulted aperture faulted");
    let other = nic.endpoint().unwrap();
    let m = other.import(&warm.descriptor()).unwrap();
    m.prefault(0, pages * 4096).unwrap();
    // (one store first: this thread's first write through a mapping sets up its own state)
    m.write(0, &[0]).unwrap();
    // (a write through a mapping also reads the aperture's index, whose pages fault apart:
    // at most a couple here, against one per page without the prefault)
    let faults = touch(&|off| m.write(off + 8, &[2]).unwrap());
    assert!(faults <= 2, "stores through a prefaulted mapping took {faults} faults for {pages} pages");
    assert!(m.prefault(0, pages * 4096 + 1).is_err() && warm.prefault(1, pages * 4096).is_err());
}

/// An import begun and then dropped unfinished (`Endpoint::import_begin`, and the import
/// `Endpoint::connect_importing` begins) is given back: its grant released and the
/// descriptors its answer brings closed, whether that answer came before the drop or after.
#[test]
fn an_import_begun_and_dropped_is_given_back() {
    use std::time::{Duration, Instant};
    let (n1, n2) = (nic(), nic());
    let (a, b) = (n1.endpoint().unwrap(), n2.endpoint().unwrap());
    let ap = a.export(4096).unwrap();
    let settle = |want: u32| {
        let w = Instant::now();
        while ap.remote_imports() != want {
            assert!(w.elapsed() < Duration::from_secs(20), "{} imports held, {want} expected", ap.remote_imports());
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    // A first import connects the two NICs (an import is begun at once only over a
    // connection that is up).
    drop(b.import(&ap.descriptor()).unwrap());
    settle(0);
    let before = fds();
    for _ in 0..100 {
        // Dropped before its answer is read: released when it is.
        let p = b.import_begin(&ap.descriptor());
        assert!(p.is_started());
        drop(p);
        // Dropped after its answer was read (by the other import's wait): released at once.
        let (p, q) = (b.import_begin(&ap.descriptor()), b.import_begin(&ap.descriptor()));
        let m = q.finish(Duration::from_secs(10)).unwrap();
        drop(p);
        drop(m);
    }
    // One more import reads whatever answer is still in the socket.
    let m = b.import(&ap.descriptor()).unwrap();
    drop(m);
    settle(0);
    // (the descriptors of the whole process: under `cargo test` other tests of this file
    // open and close theirs meanwhile; theirs go when they end, a leak stays)
    let w = Instant::now();
    while fds() > before + 4 {
        assert!(w.elapsed() < Duration::from_secs(20), "{} descriptors before, {} after", before, fds());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A connect with `Endpoint::connect_importing` to another NIC of this host asks that NIC,
/// on the control connection the connect goes on, to grant the import as it accepts: the
/// grant is there when the answer comes (no import request of the client's own), the
/// mapping works, and dropping it gives the grant back as for any import.
#[test]
fn a_connect_importing_finds_its_grant_waiting_and_gives_it_back() {
    use std::time::{Duration, Instant};
    let (sn, cn) = (nic(), nic());
    let server = sn.endpoint().unwrap();
    server.listen();
    let to = server.addr();
    let t = Some(Duration::from_secs(20));
    let n = 40u64;
    let srv = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..=n {
            let req = server.accept(t).unwrap();
            let ap = server.export(4096).unwrap();
            let conn = req.accept(&server, &ap.descriptor()).unwrap();
            held.push((ap, conn));
        }
        (server, held)
    });
    let client = cn.endpoint().unwrap();
    let mine = client.export(4096).unwrap();
    let mut maps = Vec::new();
    for i in 0..=n {
        let (conn, pending) = client.connect_importing(to, &mine.descriptor(), &[], t).unwrap();
        let m = pending.finish(Duration::from_secs(20)).unwrap();
        m.store_u64(0, i + 1).unwrap();
        maps.push((conn, m));
    }
    let (_server, held) = srv.join().unwrap();
    for (i, (ap, _)) in held.iter().enumerate() {
        assert_eq!(ap.load_u64(0).unwrap(), i as u64 + 1, "connection {i}");
    }
    // The first connect opened the control connection between the NICs (a request on
    // accept goes only on one that is up): every later one was granted on accept.
    let s = sn.stats();
    assert_eq!((s.imports_granted, s.imports_granted_on_accept), (n + 1, n));
    drop(maps);
    let w = Instant::now();
    for (i, (ap, _)) in held.iter().enumerate() {
        while ap.remote_imports() != 0 {
            assert!(w.elapsed() < Duration::from_secs(20), "connection {i}'s import was not given back");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// What ends a connection to another NIC of this host (its close, the release of its
/// import) may wait to go with the next message to that NIC: with nothing else ever sent, it
/// still goes (the NIC's timer), one connection or a hundred (past a control connection's
/// queue bound) at a time.
#[test]
fn a_connections_end_reaches_the_peer_when_nothing_else_is_sent() {
    use std::time::{Duration, Instant};
    let (sn, cn) = (nic(), nic());
    let server = sn.endpoint().unwrap();
    server.listen();
    let to = server.addr();
    let t = Some(Duration::from_secs(20));
    let client = cn.endpoint().unwrap();
    let mine = client.export(4096).unwrap();
    for n in [1, 1, 100] {
        let (conns, held) = std::thread::scope(|s| {
            let c = s.spawn(|| {
                (0..n)
                    .map(|_| {
                        let (conn, p) = client.connect_importing(to, &mine.descriptor(), &[], t).unwrap();
                        (conn, p.finish(Duration::from_secs(20)).unwrap())
                    })
                    .collect::<Vec<_>>()
            });
            let held: Vec<_> = (0..n)
                .map(|_| {
                    let req = server.accept(t).unwrap();
                    let ap = server.export(4096).unwrap();
                    let conn = req.accept(&server, &ap.descriptor()).unwrap();
                    (ap, conn)
                })
                .collect();
            (c.join().unwrap(), held)
        });
        assert!(held.iter().all(|(ap, c)| c.is_alive() && ap.remote_imports() == 1));
        drop(conns);
        let w = Instant::now();
        for (i, (ap, c)) in held.iter().enumerate() {
            while c.is_alive() || ap.remote_imports() != 0 {
                assert!(w.elapsed() < Duration::from_secs(20), "connection {i} of {n}: its end never came");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
