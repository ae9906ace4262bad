//! Cross-process behaviour, with real child processes (this binary re-executed in a role).

mod util;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clan::{
    AccessError, Descriptor, EndpointAddr, Event, EventQueueConfig, ExportConfig, ImportError, ImportPolicy, Nic,
    NicConfig, Rights, TripwireConfig,
};
use util::{Peer, Watchdog, hear, say};

const ENTRY: &str = "child";

fn nic() -> Nic {
    Nic::open(NicConfig::default()).expect("open NIC")
}

fn describe(e: &ImportError) -> String {
    match e {
        ImportError::Denied(d) => format!("Denied({d:?})"),
        ImportError::Revoked { .. } => "Revoked".into(),
        ImportError::BadKey => "BadKey".into(),
        other => format!("other: {other}"),
    }
}

/// The child side of every test: dispatched on the role in the environment.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    match role.as_str() {
        "import_write" => {
            let d: Descriptor = hear().unwrap().parse().unwrap();
            let m = ep.import(&d).unwrap();
            m.write(64, b"written by the child").unwrap();
            m.store_u64(0, 1).unwrap();
            say("done");
            let _ = hear();
        }
        "import_many" => {
            // Many threads import from the parent at once (one control connection: the
            // requests are in flight together), then one gives up on a deadline too short.
            let ds: Vec<Descriptor> = hear().unwrap().split(' ').map(|d| d.parse().unwrap()).collect();
            let ep = std::sync::Arc::new(ep);
            let threads: Vec<_> = ds
                .chunks(4)
                .map(|c| {
                    let (c, ep) = (c.to_vec(), ep.clone());
                    std::thread::spawn(move || {
                        for d in c {
                            let m = ep.import(&d).unwrap();
                            m.store_u64(0, 7).unwrap();
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let late = ep.import_timeout(&ds[0], Duration::from_nanos(1));
            say(format!("done {}", late.is_err()));
            let _ = hear();
        }
        // Say our NIC, import every descriptor we are sent, report what that cost us.
        "import_all" => {
            say(nic.addr());
            let ds: Vec<Descriptor> = hear().unwrap().split(' ').map(|d| d.parse().unwrap()).collect();
            let (fds, maps) = (count_fds(), count_maps());
            let ms: Vec<_> = ds.iter().map(|d| ep.import(d).unwrap()).collect();
            for (i, m) in ms.iter().enumerate() {
                m.store_u64(0, i as u64 + 1).unwrap();
            }
            say(format!("fds {} maps {}", count_fds() - fds, count_maps() - maps));
            let _ = hear();
        }
        "export_pooled" => {
            // Apertures the size of a stream side of the default geometry (a 1 MiB ring, a
            // 64 KiB post area, a control page), exported for the parent's NIC.
            say(nic.addr());
            let peer: clan::NicAddr = hear().unwrap().parse().unwrap();
            let fds = count_fds();
            let aps: Vec<_> = (0..20)
                .map(|_| ep.export_with((1 << 20) + (64 << 10) + 4096, ExportConfig::for_peer(peer)).unwrap())
                .collect();
            say(format!("fds {}", count_fds() - fds));
            say(aps.iter().map(|a| a.descriptor().to_string()).collect::<Vec<_>>().join(" "));
            let _ = hear();
        }
        "fill_small" => {
            // Each aperture (200 bytes, several to a page): its word, then its bytes up to its
            // end, then one byte past it (refused).
            say(nic.addr());
            let ds: Vec<Descriptor> = hear().unwrap().split(' ').map(|d| d.parse().unwrap()).collect();
            let ms: Vec<_> = ds.iter().map(|d| ep.import(d).unwrap()).collect();
            let mut past = Vec::new();
            for (i, m) in ms.iter().enumerate() {
                m.write(8, &[(i % 251) as u8 + 1; 192]).unwrap();
                m.store_u64(0, i as u64 + 1).unwrap();
                past.push(format!("{:?}", m.write(200, b"x")));
            }
            past.dedup();
            say(past.join(";"));
            let _ = hear();
        }
        "try_import" => {
            let d: Descriptor = hear().unwrap().parse().unwrap();
            match ep.import(&d) {
                Ok(_) => say("ok"),
                Err(e) => say(describe(&e)),
            }
        }
        "endpoint_import" => {
            say(ep.addr());
            let d: Descriptor = hear().unwrap().parse().unwrap();
            match ep.import(&d) {
                Ok(_) => say("ok"),
                Err(e) => say(describe(&e)),
            }
        }
        "read_only" => {
            let d: Descriptor = hear().unwrap().parse().unwrap();
            let m = ep.import(&d).unwrap();
            say(format!("{:?}", m.write(0, b"x")));
            say(format!("{}", m.raw(0, 8).unwrap().is_writable()));
            let mut b = [0u8; 5];
            m.read(0, &mut b).unwrap();
            say(String::from_utf8_lossy(&b));
        }
        "revoke" => {
            let d: Descriptor = hear().unwrap().parse().unwrap();
            let m = ep.import(&d).unwrap();
            m.write(0, b"before").unwrap();
            say("imported");
            assert_eq!(hear().as_deref(), Some("unexported"));
            say(format!("{:?}", m.write(0, b"after")));
            say(match ep.import(&d) {
                Ok(_) => "ok".to_string(),
                Err(e) => describe(&e),
            });
            drop(m);
            say("dropped");
            let _ = hear();
        }
        "hold" => {
            let d: Descriptor = hear().unwrap().parse().unwrap();
            let _m = ep.import(&d).unwrap();
            say("holding");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        "pingpong" => {
            // Parent's aperture to write into; ours to be written.
            let mine = ep.export(4096).unwrap();
            let tw = mine.tripwire(TripwireConfig::writes(0..8)).unwrap();
            say(mine.descriptor());
            let theirs = ep.import(&hear().unwrap().parse().unwrap()).unwrap();
            let rounds: u64 = hear().unwrap().parse().unwrap();
            for i in 1..=rounds {
                tw.arm().unwrap();
                while mine.load_u64(0).unwrap() < i {
                    tw.wait(Some(Duration::from_secs(60))).expect("lost wake-up in the child");
                }
                theirs.store_u64(0, i).unwrap();
            }
            say("finished");
        }
        "write_loop" => {
            let m = match ep.import(&hear().unwrap().parse().unwrap()) {
                Ok(m) => m,
                Err(clan::ImportError::TooManyProducers) => {
                    say("TooManyProducers");
                    return;
                }
                Err(e) => panic!("import failed: {e}"),
            };
            say("looping");
            let mut i = 0u64;
            loop {
                i += 1;
                m.store_u64(0, i).unwrap();
            }
        }
        "victim" => victim(),
        "scribble" => {
            let ppid = hear().unwrap();
            let secs: u64 = hear().unwrap().parse().unwrap();
            scribble(&ppid, Duration::from_millis(secs));
            say("scribbled");
        }
        other => panic!("unknown role {other}"),
    }
}

/// A hostile process of the same user (which the kernel lets reopen every memfd of `pid`
/// through /proc): write garbage over the ports, the aperture indexes and some data.
fn scribble(pid: &str, time: Duration) {
    use clan_shm::segment::{Access, Segment};
    let mut segs = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let l = link.to_string_lossy();
        if !(l.contains("memfd:clan-port") || l.contains("memfd:clan-index") || l.contains("memfd:clan-aperture")) {
            continue;
        }
        let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open(e.path()) else {
            continue;
        };
        let len = f.metadata().unwrap().len() as usize;
        if let Ok(s) = Segment::map(&f, 0, len, Access::ReadWrite) {
            segs.push((!l.contains("clan-aperture"), s));
        }
    }
    assert!(!segs.is_empty(), "found no clan memory to attack");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let start = Instant::now();
    while start.elapsed() < time {
        for (is_eq, s) in &segs {
            for _ in 0..256 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Ports and indexes: anywhere. Aperture data: the second half (data is data).
                let lo = if *is_eq { 0 } else { s.len() / 2 };
                let off = (lo + (x as usize % (s.len() - lo - 8))) & !7;
                let v = if x & 3 == 0 { u64::MAX } else { x.rotate_left(17) };
                let _ = s.write(off, &v.to_le_bytes());
            }
        }
    }
}

#[test]
fn import_from_another_process_and_wake_on_its_write() {
    let _wd = Watchdog::new("cross-process import", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).event(42)).unwrap();
    tw.arm().unwrap();
    let mut child = Peer::spawn(ENTRY, "import_write", &[]);
    child.send(&ap.descriptor().to_string());
    while ap.load_u64(0).unwrap() == 0 {
        tw.wait(Some(Duration::from_secs(60))).expect("tripwire wake-up from the other process");
    }
    let mut b = [0u8; 20];
    ap.read(64, &mut b).unwrap();
    assert_eq!(&b, b"written by the child");
    match ep.event_queue().wait(Some(Duration::from_secs(60))).unwrap() {
        Event::Tripwire { cookie: 42, id, .. } => assert_eq!(id, tw.id()),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(child.expect("done"), "done");
    assert_eq!(ap.remote_imports(), 1);
    assert_eq!(nic.stats().imports_granted, 1);
    child.wait_ok();
}

/// A process under valgrind (as users run their programs to find memory errors) opens its
/// NIC, imports, writes and wakes our tripwire like any other. (It crashed before the
/// auxiliary vector was read through libc: valgrind hands its guest a vector of its own, and
/// the one in `/proc/self/auxv` names a vDSO the guest has not mapped.)
#[test]
fn a_process_under_valgrind_imports_writes_and_wakes() {
    let have = std::process::Command::new("valgrind").arg("--version").output().is_ok_and(|o| o.status.success());
    if !have {
        assert!(std::env::var_os("CI").is_none(), "CI installs valgrind (.ci/run)");
        eprintln!("valgrind is not installed: skipped");
        return;
    }
    let _wd = Watchdog::new("import under valgrind", Duration::from_secs(240));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8).event(42)).unwrap();
    tw.arm().unwrap();
    let mut cmd = std::process::Command::new("valgrind");
    cmd.args(["--tool=none", "-q", "--error-exitcode=97"]).arg(std::env::current_exe().unwrap());
    let mut child = Peer::spawn_via(cmd, ENTRY, "import_write", &[]);
    child.send(&ap.descriptor().to_string());
    // (its word and bytes are written when it says so; a child that crashed says nothing)
    assert_eq!(child.expect("done"), "done");
    assert_eq!(ap.load_u64(0).unwrap(), 1);
    let mut b = [0u8; 20];
    ap.read(64, &mut b).unwrap();
    assert_eq!(&b, b"written by the child");
    match ep.event_queue().wait(Some(Duration::from_secs(60))).unwrap() {
        Event::Tripwire { cookie: 42, id, .. } => assert_eq!(id, tw.id()),
        other => panic!("unexpected {other:?}"),
    }
    child.wait_ok();
}

fn count_fds() -> i64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as i64
}

/// Mappings of shared memory (memfds): what imports and exports map. (Not every line of
/// the maps: the allocator and thread stacks come and go with them.)
fn count_maps() -> i64 {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("/memfd:")).count() as i64
}

/// Apertures exported for one peer NIC share memfds and mappings (`ExportConfig::for_peer`):
/// 300 of them cost the exporter a handful of descriptors and mappings, not two each, and the
/// importer no descriptor and one mapping per chunk. Each still works on its own.
#[test]
fn apertures_for_one_peer_share_their_memfds() {
    let _wd = Watchdog::new("pooled apertures", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let mut c = Peer::spawn(ENTRY, "import_all", &[]);
    let peer: clan::NicAddr = c.expect("nic").parse().unwrap();
    let (fds, maps) = (count_fds(), count_maps());
    let aps: Vec<_> = (0..300).map(|_| ep.export_with(4096, ExportConfig::for_peer(peer)).unwrap()).collect();
    let (fds, maps) = (count_fds() - fds, count_maps() - maps);
    assert!(fds <= 8, "300 pooled apertures cost {fds} descriptors");
    assert!((2..=8).contains(&maps), "300 pooled apertures cost {maps} mappings");
    let st = nic.stats();
    assert_eq!((st.pools, st.pool_chunks), (1, 2), "1 KiB-index apertures: 256 per chunk");
    let tws: Vec<_> = aps.iter().map(|a| a.tripwire(TripwireConfig::writes(0..8)).unwrap()).collect();
    let list: Vec<String> = aps.iter().map(|a| a.descriptor().to_string()).collect();
    c.send(&list.join(" "));
    let cost = c.expect("cost");
    let (f, m) = cost.strip_prefix("fds ").and_then(|r| r.split_once(" maps ")).unwrap();
    let (f, m): (i64, i64) = (f.parse().unwrap(), m.parse().unwrap());
    assert!(f <= 4, "the importer kept {f} descriptors for 300 imports");
    assert!((2..=8).contains(&m), "the importer made {m} mappings for 300 imports (one per chunk expected)");
    for (i, (a, t)) in aps.iter().zip(&tws).enumerate() {
        t.wait(Some(Duration::from_secs(20))).unwrap();
        assert_eq!(a.load_u64(0).unwrap(), i as u64 + 1, "aperture {i} got another's write");
    }
    // The importer gone, its pool is retired once our NIC hears of it (a later process at
    // that address gets memory of its own, never this): apertures for that address come
    // from a new pool, zeroed, and the retired pool's memory goes with its last aperture.
    // (Waited for: exports made before our NIC hears of it would still be carved from the
    // old pool, and how many is a race.)
    drop(tws);
    c.send("bye");
    c.wait_ok();
    let deadline = Instant::now() + Duration::from_secs(60);
    while nic.stats().pools != 0 {
        assert!(Instant::now() < deadline, "the importer's exit never retired its pool");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut aps = aps;
    let first = aps.swap_remove(0);
    drop(aps);
    let again: Vec<_> = (0..299).map(|_| ep.export_with(4096, ExportConfig::for_peer(peer)).unwrap()).collect();
    assert_eq!((nic.stats().pools, nic.stats().pool_chunks), (1, 2), "a new pool for that address");
    assert!(again.iter().all(|a| a.load_u64(0) == Ok(0)), "new memory is zeroed");
    let before = count_fds();
    drop((first, again));
    assert_eq!(nic.stats().pool_chunks, 0);
    assert!(count_fds() <= before - 4, "the chunks' memfds are closed");
}

/// A client that connects and closes in a loop maps nothing after its first connection: the
/// exporter pools stream sides of the default geometry (1 MiB rings), and the importer keeps
/// the pool's chunks and its port in the exporter's queue mapped once their imports are
/// gone, until the exporter goes. Then they go too.
#[test]
fn an_importer_keeps_a_peers_pool_mapped_until_the_peer_goes() {
    let _wd = Watchdog::new("kept pool mappings", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let mut c = Peer::spawn(ENTRY, "export_pooled", &[]);
    c.expect("nic");
    c.send(&nic.addr().to_string());
    let fds: i64 = c.expect("fds").strip_prefix("fds ").unwrap().parse().unwrap();
    assert!(fds <= 4, "20 stream sides of 1 MiB cost their exporter {fds} descriptors");
    let ds: Vec<Descriptor> = c.recv().unwrap().split(' ').map(|d| d.parse().unwrap()).collect();
    let base = count_maps();
    let m = ep.import(&ds[0]).unwrap();
    m.store_u64(0, 1).unwrap();
    drop(m);
    let kept = count_maps();
    assert!(kept >= base + 2, "the chunk's data and index stay mapped ({base} -> {kept} mappings)");
    // Twenty sides take two chunks: the first import from the second maps it (its data and
    // index); no other import maps anything, and no drop unmaps anything.
    let mut now = kept;
    for (i, d) in ds.iter().enumerate().skip(1) {
        let m = ep.import(d).unwrap();
        m.store_u64(0, i as u64 + 1).unwrap();
        let held = count_maps();
        assert!(held == now || held == now + 2, "import {i} mapped {} more", held - now);
        drop(m);
        assert_eq!(count_maps(), held, "dropping import {i} unmapped its chunk");
        now = held;
    }
    assert_eq!(now, kept + 2, "twenty sides, two chunks");
    c.kill();
    let deadline = Instant::now() + Duration::from_secs(60);
    while count_maps() > base {
        assert!(Instant::now() < deadline, "the exporter's chunks stayed mapped after it died");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Pooled apertures smaller than a page are carved several to a page (on cache lines), each
/// with an index of its own a few lines long: 300 of 200 bytes take a few pages of data.
/// Another process reaches each one's bytes and no more: its writes up to each end land there
/// and nowhere else, one past the end is refused, and each one's tripwire fires.
#[test]
fn small_pooled_apertures_share_pages_and_keep_to_their_bytes() {
    let _wd = Watchdog::new("small pooled apertures", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let mut c = Peer::spawn(ENTRY, "fill_small", &[]);
    let peer: clan::NicAddr = c.expect("nic").parse().unwrap();
    let aps: Vec<_> = (0..300).map(|_| ep.export_with(200, ExportConfig::for_peer(peer)).unwrap()).collect();
    assert!(aps.iter().all(|a| a.len() == 200));
    assert_eq!(nic.stats().pool_chunks, 1, "300 small apertures fit one chunk");
    let tws: Vec<_> = aps.iter().map(|a| a.tripwire(TripwireConfig::writes(0..8)).unwrap()).collect();
    let list: Vec<String> = aps.iter().map(|a| a.descriptor().to_string()).collect();
    c.send(&list.join(" "));
    let past = c.expect("past");
    assert!(past.starts_with("Err(OutOfBounds") && !past.contains(';'), "a write past the end: {past}");
    for (i, (a, t)) in aps.iter().zip(&tws).enumerate() {
        t.wait(Some(Duration::from_secs(20))).unwrap();
        assert_eq!(a.load_u64(0).unwrap(), i as u64 + 1, "aperture {i} got another's word");
        let mut body = [0u8; 192];
        a.read(8, &mut body).unwrap();
        assert!(body.iter().all(|&b| b == (i % 251) as u8 + 1), "aperture {i} got another's bytes");
    }
    c.send("bye");
    c.wait_ok();
}

fn try_import(desc: &Descriptor) -> String {
    let mut c = Peer::spawn(ENTRY, "try_import", &[]);
    c.send(&desc.to_string());
    let r = c.expect("result");
    c.wait_ok();
    r
}

#[test]
fn import_restrictions_by_pid_uid_and_endpoint() {
    let _wd = Watchdog::new("restrictions", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let only_me = ep
        .export_with(
            4096,
            ExportConfig { policy: ImportPolicy::anyone().pid(std::process::id()), ..ExportConfig::default() },
        )
        .unwrap();
    assert_eq!(try_import(&only_me.descriptor()), "Denied(Pid)");
    let other_uid = ep
        .export_with(4096, ExportConfig { policy: ImportPolicy::anyone().uid(54321), ..ExportConfig::default() })
        .unwrap();
    assert_eq!(try_import(&other_uid.descriptor()), "Denied(Uid)");
    let my_uid = rustix::process::getuid().as_raw();
    let same_uid = ep
        .export_with(4096, ExportConfig { policy: ImportPolicy::anyone().uid(my_uid), ..ExportConfig::default() })
        .unwrap();
    assert_eq!(try_import(&same_uid.descriptor()), "ok");
    // Endpoint: only the endpoint the first child announces.
    let mut friend = Peer::spawn(ENTRY, "endpoint_import", &[]);
    let friend_ep: EndpointAddr = friend.expect("endpoint").parse().unwrap();
    let ap = ep
        .export_with(
            4096,
            ExportConfig { policy: ImportPolicy::anyone().endpoint(friend_ep), ..ExportConfig::default() },
        )
        .unwrap();
    friend.send(&ap.descriptor().to_string());
    assert_eq!(friend.expect("result"), "ok");
    friend.wait_ok();
    let mut stranger = Peer::spawn(ENTRY, "endpoint_import", &[]);
    let _ = stranger.expect("endpoint");
    stranger.send(&ap.descriptor().to_string());
    assert_eq!(stranger.expect("result"), "Denied(Endpoint)");
    stranger.wait_ok();
    // Forged and stale descriptors, across processes.
    let ro = ap.descriptor().derive(0, 4096, Rights::READ).unwrap();
    let mut b = ro.to_bytes();
    let at = b.len() - 17;
    b[at] = 3;
    assert_eq!(try_import(&Descriptor::from_bytes(&b).unwrap()), "BadKey");
    let stale = only_me.descriptor();
    drop(only_me);
    assert_eq!(try_import(&stale), "Revoked");
    assert!(nic.stats().imports_refused >= 5);
}

#[test]
fn read_only_descriptors_map_read_only() {
    let _wd = Watchdog::new("read only", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    ap.write(0, b"hello").unwrap();
    let mut c = Peer::spawn(ENTRY, "read_only", &[]);
    c.send(&ap.descriptor().derive(0, 4096, Rights::READ).unwrap().to_string());
    assert_eq!(c.expect("write result"), format!("{:?}", Err::<(), _>(AccessError::NotWritable)));
    assert_eq!(c.expect("raw writable"), "false", "the kernel mapping itself is read-only");
    assert_eq!(c.expect("content"), "hello");
    c.wait_ok();
}

#[test]
fn unexport_revokes_remote_mappings_and_memory_waits_for_them() {
    let _wd = Watchdog::new("revoke", Duration::from_secs(120));
    // Trusting importers (memory they received is recycled once they unimport); the default
    // never recycles it (`protection::memory_another_process_received_is_never_recycled`).
    let nic = Nic::open(NicConfig { reuse_imported_apertures: true, ..NicConfig::default() }).unwrap();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(16384).unwrap();
    let desc = ap.descriptor();
    let mut c = Peer::spawn(ENTRY, "revoke", &[]);
    c.send(&desc.to_string());
    assert_eq!(c.expect("imported"), "imported");
    let fresh = nic.stats().exports_fresh;
    drop(ap);
    // The child still maps the memory: a new export must not get it.
    let other = ep.export(16384).unwrap();
    assert_eq!(nic.stats().exports_fresh, fresh + 1);
    c.send("unexported");
    assert_eq!(c.expect("write after unexport"), format!("{:?}", Err::<(), _>(AccessError::Revoked)));
    assert_eq!(c.expect("re-import"), "Revoked");
    assert_eq!(c.expect("dropped"), "dropped");
    drop(other);
    // Once the child's unimport is processed, the memory comes back through the cache.
    let start = Instant::now();
    loop {
        let cached = nic.stats().cached_bytes;
        if cached >= 2 * 16384 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "memory never recycled ({cached} bytes cached)");
        std::thread::sleep(Duration::from_millis(5));
    }
    c.wait_ok();
}

#[test]
fn a_killed_importer_releases_its_imports() {
    let _wd = Watchdog::new("importer death", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(4096).unwrap();
    let mut c = Peer::spawn(ENTRY, "hold", &[]);
    c.send(&ap.descriptor().to_string());
    assert_eq!(c.expect("holding"), "holding");
    assert_eq!(ap.remote_imports(), 1);
    c.kill();
    let start = Instant::now();
    while ap.remote_imports() != 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "import of a dead process never released");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Tens of thousands of arm / re-check / wait rounds across two processes: a single lost
/// wake-up hangs (and the watchdog fails the test).
#[test]
fn pingpong_stress_never_loses_a_wakeup() {
    let rounds: u64 = 20_000;
    let _wd = Watchdog::new("ping-pong stress", Duration::from_secs(600));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let mine = ep.export(4096).unwrap();
    let tw = mine.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let mut c = Peer::spawn(ENTRY, "pingpong", &[]);
    let theirs = ep.import(&c.expect("descriptor").parse().unwrap()).unwrap();
    c.send(&mine.descriptor().to_string());
    c.send(&rounds.to_string());
    for i in 1..=rounds {
        tw.arm().unwrap();
        theirs.store_u64(0, i).unwrap();
        while mine.load_u64(0).unwrap() < i {
            tw.wait(Some(Duration::from_secs(60))).expect("lost wake-up in the parent");
        }
    }
    assert_eq!(c.expect("finished"), "finished");
    c.wait_ok();
}

/// Producers SIGKILLed at random points never stall or corrupt the consumer's queue.
#[test]
fn producers_killed_at_random_points() {
    let _wd = Watchdog::new("SIGKILL producers", Duration::from_secs(600));
    let nic = nic();
    // Fewer producer ports than producers killed: a dead producer's port must be retired
    // and its place given to the next process, or the fourth round is refused.
    const PORTS: u32 = 3;
    let q = nic
        .event_queue(EventQueueConfig {
            ring_capacity: 64,
            producers: PORTS,
            producers_per_user: PORTS,
            ..EventQueueConfig::default()
        })
        .unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let _tw = ap.tripwire(TripwireConfig::writes(0..8).event(7)).unwrap();
    let mine = ep.import(&ap.descriptor()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicU64::new(0));
    let consumer = {
        let (q, stop, seen) = (q.clone(), stop.clone(), seen.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                match q.wait(Some(Duration::from_millis(50))) {
                    Ok(Event::Tripwire { cookie: 7, .. }) | Ok(Event::Overflow { .. }) => {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(other) => panic!("unexpected event {other:?}"),
                    Err(_) => {}
                }
            }
        })
    };
    let mut x = std::process::id() as u64 | 1;
    for round in 0..25 {
        let mut c = Peer::spawn(ENTRY, "write_loop", &[]);
        c.send(&ap.descriptor().to_string());
        assert_eq!(c.expect("looping"), "looping");
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_micros(x % 20_000));
        c.kill();
        // Its port is retired once the exporter sees the process gone (its connection
        // closes); until then it still counts.
        let start = Instant::now();
        while q.stats().producers > 0 {
            assert!(start.elapsed() < Duration::from_secs(30), "a killed producer's port was never retired");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The queue still works: our own write is delivered.
        let before = seen.load(Ordering::Relaxed);
        let start = Instant::now();
        mine.store_u64(0, round).unwrap();
        while seen.load(Ordering::Relaxed) == before {
            assert!(start.elapsed() < Duration::from_secs(30), "queue stalled after a producer was killed");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    stop.store(true, Ordering::Release);
    consumer.join().unwrap();
    assert_eq!(q.stats().malformed, 0, "killed producers never produce garbage");
    assert!(seen.load(Ordering::Relaxed) >= 25);
}

/// A queue gives at most `producers` processes a port: the next importing process is
/// refused with `TooManyProducers` (and nothing else breaks), and the place of a killed
/// producer goes to the next process that asks.
#[test]
fn producer_ports_are_bounded_and_freed_by_death() {
    let _wd = Watchdog::new("producer limit", Duration::from_secs(300));
    let nic = nic();
    let q = nic
        .event_queue(EventQueueConfig { producers: 2, producers_per_user: 2, ..EventQueueConfig::default() })
        .unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    let spawn = || {
        let mut c = Peer::spawn(ENTRY, "write_loop", &[]);
        c.send(&ap.descriptor().to_string());
        let r = c.expect("import result");
        (c, r)
    };
    let (mut a, ra) = spawn();
    let (b, rb) = spawn();
    assert_eq!((ra.as_str(), rb.as_str()), ("looping", "looping"));
    assert_eq!(q.stats().producers, 2);
    let (c, rc) = spawn();
    assert_eq!(rc, "TooManyProducers", "a third process got a port in a queue of two");
    drop(c);
    // The two that have ports keep writing through them.
    let start = Instant::now();
    let n = tw.count();
    while tw.count() < n + 100 {
        assert!(start.elapsed() < Duration::from_secs(30), "the producers with ports stalled");
        std::thread::sleep(Duration::from_millis(1));
    }
    a.kill();
    let start = Instant::now();
    while q.stats().producers > 1 {
        assert!(start.elapsed() < Duration::from_secs(30), "a killed producer's port was never retired");
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut d, rd) = spawn();
    assert_eq!(rd, "looping", "the killed producer's place was not given to the next process");
    assert_eq!(q.stats().producers, 2);
    d.kill();
    drop(b);
    assert_eq!(q.stats().malformed, 0);
}

/// A hostile process of the same user writes garbage over a victim's event queues and
/// aperture indexes while the victim keeps working: it may see spurious events, never a
/// crash or a hang. The victim is a child of its own: the scribbler opens every clan memfd
/// of the process it attacks, and under `cargo test` (all tests in one process) it would
/// hit the other tests' memory too.
#[test]
fn hostile_process_cannot_crash_or_hang_us() {
    let _wd = Watchdog::new("hostile scribbler", Duration::from_secs(300));
    let mut victim = Peer::spawn(ENTRY, "victim", &[]);
    let pid = victim.expect("the victim's pid");
    let mut c = Peer::spawn(ENTRY, "scribble", &[]);
    c.send(&pid);
    c.send("1500");
    victim.send("go");
    assert_eq!(c.expect("scribbled"), "scribbled");
    c.wait_ok();
    let done = victim.expect("the victim's outcome");
    assert!(done.starts_with("ok "), "victim: {done}");
    victim.wait_ok();
}

/// The victim of `hostile_process_cannot_crash_or_hang_us`: works for 1.5 s under attack,
/// then checks that fresh resources work normally.
fn victim() {
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(1 << 16).unwrap();
    let mine = ep.import(&ap.descriptor()).unwrap();
    let tws: Vec<_> =
        (0..64).map(|i| ap.tripwire(TripwireConfig::writes(i * 512..i * 512 + 64).event(i)).unwrap()).collect();
    // (its memory made before the scribbler looks for it)
    say(std::process::id());
    assert_eq!(hear().as_deref(), Some("go"));
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < Duration::from_millis(1500) {
        let off = (ops * 4096) % (1 << 16);
        let _ = mine.write(off, &[ops as u8; 700]);
        while q.try_take().is_some() {}
        let t = ap.tripwire(TripwireConfig::writes(off..off + 8).event(1));
        let _ = t.map(|t| t.wait(Some(Duration::from_micros(100))));
        let _ = tws[(ops % 64) as usize].arm();
        let _ = q.wait(Some(Duration::from_micros(200)));
        ops += 1;
    }
    // Fresh resources still work normally.
    let q2 = nic.event_queue(EventQueueConfig::default()).unwrap();
    let ep2 =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q2.clone()), ..Default::default() }).unwrap();
    let ap2 = ep2.export(4096).unwrap();
    let tw2 = ap2.tripwire(TripwireConfig::writes(0..8).event(3)).unwrap();
    ep2.import(&ap2.descriptor()).unwrap().store_u64(0, 1).unwrap();
    assert!(matches!(q2.wait(Some(Duration::from_secs(10))), Ok(Event::Tripwire { cookie: 3, .. })));
    assert_eq!(tw2.count(), 1);
    assert!(ops > 10, "only {ops} operations in 1.5 s");
    say(format!("ok {ops}"));
}

/// Imports from many threads of one process share one control connection, each with its own
/// request in flight (replies matched by id); an import abandoned on its deadline is an error
/// to its caller only, and everything the process held is released when it goes.
#[test]
fn concurrent_imports_through_one_connection() {
    let _wd = Watchdog::new("concurrent imports", Duration::from_secs(120));
    let nic = Nic::open(NicConfig { reuse_imported_apertures: true, ..NicConfig::default() }).unwrap();
    let ep = nic.endpoint().unwrap();
    let aps: Vec<_> = (0..32).map(|_| ep.export(4096).unwrap()).collect();
    let mut child = Peer::spawn("child", "import_many", &[]);
    child.send(&aps.iter().map(|a| a.descriptor().to_string()).collect::<Vec<_>>().join(" "));
    let line = child.expect("done");
    assert!(line.starts_with("done"), "{line}");
    for a in &aps {
        assert_eq!(a.load_u64(0).unwrap(), 7, "every import landed its write");
    }
    drop(child);
    // The child is gone: every import it held (including one it may have given up on, whose
    // grant came late) is released, so the memory of each unexported aperture is recycled.
    let before = nic.stats().cached_bytes;
    drop(aps);
    let t = std::time::Instant::now();
    while nic.stats().cached_bytes < before + 32 * 4096 {
        assert!(t.elapsed() < Duration::from_secs(30), "imports were not released: {:?}", nic.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}
