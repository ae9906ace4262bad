//! Protection within a host, tested as an attacker acts: the importer runs as another,
//! unprivileged user (`nobody`, through `setpriv`; root bypasses the kernel's mode checks),
//! keeps every descriptor it is handed, inspects each (reopens it through `/proc/self/fd`,
//! maps it whole, writes to it) and writes garbage into everything it can map, while we —
//! the exporter — and other, honest, importers go on working.
//!
//! What must hold (`docs/ARCHITECTURE.md`, "Protection"): no byte outside the grant is ever
//! readable, no byte is writable under a read-only grant, memory that went to another process
//! never becomes another aperture, and one importer's garbage or lies cost nobody else
//! anything (spurious events at most, on what it was granted).

mod util;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use clan::{Descriptor, EventQueueConfig, ExportConfig, ImportError, Nic, NicConfig, Rights, TripwireConfig};
use clan_shm::segment::{Access, Segment};
use util::{Peer, Watchdog, hear, say, unprivileged};

const ENTRY: &str = "child";
/// What the exporter keeps outside every grant: found anywhere by the attacker, the test fails.
const SECRET: &[u8; 16] = b"clan-secret-4e1f";

fn nic() -> Nic {
    Nic::open(NicConfig::default()).expect("open NIC")
}

/// The child side.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    match role.as_str() {
        // Import, try the mapping's limits, then inspect every descriptor the process holds.
        "inspect" => {
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            let m = ep.import(&desc).unwrap();
            say(format!("remote {}", m.is_remote()));
            say(format!("write {}", m.write(0, b"granted!").is_ok()));
            say(format!("beyond {}", m.write(desc.len(), b"x").is_err() && m.read(desc.len(), &mut [0]).is_err()));
            // What the exporter hands over directly, kept.
            let raw = raw_import(&nic, &ep, &desc);
            say(format!("raw {}", raw.as_ref().map_or_else(|e| e.clone(), |r| format!("fds {}", r.fds.len()))));
            for line in inspect_fds() {
                say(line);
            }
            say("end");
            // Now garbage into everything writable, for as long as asked.
            let ms: u64 = hear().unwrap().parse().unwrap();
            garbage(Duration::from_millis(ms));
            say("garbaged");
            while hear().is_some() {}
        }
        // Forge claims for an aperture we were not granted (and garbage), through our port.
        "forge" => {
            let mine: Descriptor = hear().unwrap().parse().unwrap();
            let theirs: Descriptor = hear().unwrap().parse().unwrap();
            let ms: u64 = hear().unwrap().parse().unwrap();
            let m = ep.import(&mine).unwrap();
            m.write(0, b"imported").unwrap();
            let _raw = raw_import(&nic, &ep, &mine).unwrap();
            say("imported");
            let forged = forge(&mine, &theirs, Duration::from_millis(ms));
            garbage(Duration::from_millis(ms / 2));
            say(format!("forged {forged}"));
            while hear().is_some() {}
        }
        // Keep raw descriptors of an import, unimport, and write through them later.
        "keep" => {
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            let raw = raw_import(&nic, &ep, &desc).unwrap();
            raw.lie_unimported();
            let kept: Vec<OwnedFd> =
                memfds().into_iter().filter(|(name, _)| name.contains("clan-aperture")).map(|(_, fd)| fd).collect();
            say(format!("kept {}", kept.len()));
            assert_eq!(hear().unwrap(), "write");
            for fd in &kept {
                let len = rustix::fs::fstat(fd).unwrap().st_size as usize;
                if let Ok(s) = Segment::map(fd, 0, len, Access::ReadWrite) {
                    for off in (0..len).step_by(4096) {
                        let _ = s.write(off, b"STOLEN!!");
                    }
                }
            }
            say("written");
            while hear().is_some() {}
        }
        // An honest importer: round trips with the exporter, each a write we are woken by.
        "honest" => {
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            let rounds: u64 = hear().unwrap().parse().unwrap();
            let m = ep.import(&desc).unwrap();
            say("ready");
            for i in 1..=rounds {
                m.store_u64(0, i).unwrap();
                let t = Instant::now();
                while m.load_u64(8).unwrap() != i {
                    assert!(t.elapsed() < Duration::from_secs(20), "round {i}: no answer");
                    std::thread::yield_now();
                }
            }
            say("done");
            while hear().is_some() {}
        }
        // Import from many NICs of one process (many control connections), then report.
        "many_nics" => {
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            let n: usize = hear().unwrap().parse().unwrap();
            let nics: Vec<Nic> = (0..n).map(|_| nic_or_die()).collect();
            let maps: Vec<_> = nics.iter().map(|x| x.endpoint().unwrap().import(&desc)).collect();
            say(format!("imported {}", maps.iter().filter(|m| m.is_ok()).count()));
            while hear().is_some() {}
        }
        // Apertures exported for our NIC (pooled): import ours, try one pooled for another
        // NIC, a read-only grant of ours, then inspect and garbage as "inspect" does.
        "pooled" => {
            say(nic.addr());
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            let other: Descriptor = hear().unwrap().parse().unwrap();
            let m = ep.import(&desc).unwrap();
            say(format!("remote {}", m.is_remote()));
            say(format!("write {}", m.write(0, b"granted!").is_ok()));
            say(format!("other {}", ep.import(&other).err().map_or("ok".to_string(), |e| format!("{e:?}"))));
            let ro = desc.derive(0, desc.len(), Rights::READ).unwrap();
            say(match ep.import(&ro) {
                Ok(m) => format!("read-only remote {} write {}", m.is_remote(), m.write(0, b"x").is_ok()),
                Err(e) => format!("read-only {e:?}"),
            });
            let raw = raw_import(&nic, &ep, &ro);
            say(format!("raw-ro {}", raw.as_ref().map_or_else(|e| e.clone(), |r| format!("fds {}", r.fds.len()))));
            let raw = raw_import(&nic, &ep, &desc);
            say(format!("raw {}", raw.as_ref().map_or_else(|e| e.clone(), |r| format!("fds {}", r.fds.len()))));
            for line in inspect_fds() {
                say(line);
            }
            say("end");
            let ms: u64 = hear().unwrap().parse().unwrap();
            garbage(Duration::from_millis(ms));
            say("garbaged");
            while hear().is_some() {}
        }
        "try_import" => {
            let desc: Descriptor = hear().unwrap().parse().unwrap();
            say(match ep.import(&desc) {
                Ok(_) => "ok".to_string(),
                Err(ImportError::TooManyProducers) => "TooManyProducers".to_string(),
                Err(e) => format!("error {e}"),
            });
            while hear().is_some() {}
        }
        "file_on_accept" => file_on_accept(),
        other => panic!("unknown role {other}"),
    }
}

/// A process that speaks the control protocol itself to the server NIC named on its first
/// line, hello'd as its own NIC, and files requests to be granted on accept as told:
/// `steal TOKEN` (another client's connect token), `flood N` (N made-up ones). After each, a
/// request with a reply shows the server took everything before it; what comes back first
/// must be that reply, never a grant: it says `clean` or what came instead.
fn file_on_accept() {
    use clan_wire::control::{Reply, Request};
    let own = nic_or_die();
    let ep = own.endpoint().unwrap();
    let server: clan::NicAddr = hear().unwrap().parse().unwrap();
    let sock = clan_shm::seqpacket::SeqPacket::connect_abstract(&server.abstract_name()).unwrap();
    sock.set_timeouts(Duration::from_secs(20)).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut next = |sock: &clan_shm::seqpacket::SeqPacket| -> (u32, Reply, usize) {
        let got = sock.recv(&mut buf).unwrap();
        let (id, r) = Reply::decode(&buf[..got.len]).unwrap();
        (id, r, got.fds.len())
    };
    sock.send(&Request::Hello { nic: own.addr().socket_addr(), pid: std::process::id() }.encode(1), &[]).unwrap();
    assert!(matches!(next(&sock), (1, Reply::HelloOk { .. }, 0)));
    let mut sync = 1_000_000u32;
    while let Some(line) = hear() {
        let (what, n) = line.split_once(' ').unwrap();
        let n: u64 = n.parse().unwrap();
        let tokens: Vec<u64> = if what == "steal" { vec![n] } else { (0..n).map(|i| 0x5eed_0000 + i).collect() };
        for (i, token) in tokens.into_iter().enumerate() {
            let r = Request::ImportOnAccept { importer: ep.addr().into(), token };
            sock.send(&r.encode(10 + i as u32), &[]).unwrap();
        }
        sync += 1;
        // (to a port that is not there: refused, after what came before it was taken)
        let probe = Request::Oob { from: ep.addr().into(), to_port: u32::MAX, payload: [0; 40], reply: true };
        sock.send(&probe.encode(sync), &[]).unwrap();
        match next(&sock) {
            (id, _, 0) if id == sync => say("clean"),
            (id, r, fds) => say(format!("got {id} {r:?} with {fds} descriptors")),
        }
    }
}

/// Import as a hostile process does: speak the control protocol ourselves (a real NIC of
/// ours answers the exporter's check that our hello is true), keep every descriptor the grant
/// carries, and tell the exporter we unimported whenever we like. The grant, or the refusal.
struct RawImport {
    sock: clan_shm::seqpacket::SeqPacket,
    fds: Vec<OwnedFd>,
    import_id: u64,
}

fn raw_import(nic: &Nic, ep: &clan::Endpoint, desc: &Descriptor) -> Result<RawImport, String> {
    use clan_wire::control::{Reply, Request};
    let sock =
        clan_shm::seqpacket::SeqPacket::connect_abstract(&desc.nic().abstract_name()).map_err(|e| e.to_string())?;
    sock.set_timeouts(Duration::from_secs(20)).unwrap();
    let ask = |req: Request, id: u32| -> Result<(Reply, Vec<OwnedFd>), String> {
        sock.send(&req.encode(id), &[]).map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; 1 << 16];
        let got = sock.recv(&mut buf).map_err(|e| e.to_string())?;
        let (rid, reply) = Reply::decode(&buf[..got.len]).map_err(|e| e.to_string())?;
        assert_eq!(rid, id);
        Ok((reply, got.fds))
    };
    match ask(Request::Hello { nic: nic.addr().socket_addr(), pid: std::process::id() }, 1)? {
        (Reply::HelloOk { .. }, _) => {}
        (other, _) => return Err(format!("hello: {other:?}")),
    }
    match ask(Request::Import { importer: ep.addr().into(), desc: desc.to_bytes() }, 2)? {
        (Reply::ImportOk(g), fds) => Ok(RawImport { sock, fds, import_id: g.import_id }),
        (Reply::Err { code, .. }, _) => Err(format!("{code:?}")),
        (other, _) => Err(format!("import: {other:?}")),
    }
}

impl RawImport {
    /// Say we unimported (and keep everything).
    fn lie_unimported(&self) {
        let r = clan_wire::control::Request::Unimport { import_id: self.import_id };
        self.sock.send(&r.encode(0), &[]).unwrap();
    }
}

fn nic_or_die() -> Nic {
    Nic::open(NicConfig { tcp: false, ..NicConfig::default() }).expect("open NIC")
}

/// Every memfd this process holds: its name and a descriptor.
fn memfds() -> Vec<(String, OwnedFd)> {
    use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
    // Our own descriptors, duplicated by number (what any code in the process can do).
    let me = pidfd_open(getpid(), PidfdFlags::empty()).expect("pidfd_open");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else { continue };
        let name = link.to_string_lossy().into_owned();
        if !name.starts_with("/memfd:") {
            continue;
        }
        let Ok(n) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if let Ok(fd) = pidfd_getfd(&me, n, PidfdGetfdFlags::empty()) {
            out.push((name, fd));
        }
    }
    out
}

/// One line per memfd held: what it can be made to do.
fn inspect_fds() -> Vec<String> {
    let mut lines = Vec::new();
    for (name, fd) in memfds() {
        let len = rustix::fs::fstat(&fd).unwrap().st_size as usize;
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let reopen_rw = std::fs::OpenOptions::new().read(true).write(true).open(&path).is_ok();
        let reopen_ro = std::fs::OpenOptions::new().read(true).open(&path).is_ok();
        let map_rw = Segment::map(&fd, 0, len, Access::ReadWrite).is_ok();
        // Writability without changing anything: write back the byte that is there.
        let mut b = [0u8; 1];
        let pwrite = rustix::io::pread(&fd, &mut b, 0).is_ok() && rustix::io::pwrite(&fd, &b, 0).is_ok();
        // Everything readable, searched for the exporter's secret.
        let mut secret = false;
        if let Ok(s) = Segment::map(&fd, 0, len, Access::ReadOnly) {
            let mut buf = vec![0u8; len];
            s.read(0, &mut buf).unwrap();
            secret = buf.windows(SECRET.len()).any(|w| w == SECRET);
        }
        let short = name.trim_start_matches("/memfd:").split(' ').next().unwrap_or("").to_string();
        lines.push(format!(
            "fd {short} size {len} reopen_rw {reopen_rw} reopen_ro {reopen_ro} map_rw {map_rw} pwrite {pwrite} secret {secret}"
        ));
    }
    lines
}

/// Write garbage into every memfd we can map writable, and every eventfd we hold, for `time`.
fn garbage(time: Duration) {
    let segs: Vec<Segment> = memfds()
        .into_iter()
        .filter_map(|(_, fd)| {
            let len = rustix::fs::fstat(&fd).ok()?.st_size as usize;
            Segment::map(&fd, 0, len, Access::ReadWrite).ok()
        })
        .collect();
    let eventfds: Vec<OwnedFd> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("eventfd")))
        .filter_map(|e| std::fs::OpenOptions::new().write(true).open(e.path()).ok().map(OwnedFd::from))
        .collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let start = Instant::now();
    while start.elapsed() < time {
        for s in &segs {
            for _ in 0..512 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = (x as usize % (s.len() - 8)) & !7;
                let v = match x & 3 {
                    0 => u64::MAX,
                    1 => x & 0xffff,
                    _ => x.rotate_left(17),
                };
                let _ = s.write(off, &v.to_le_bytes());
            }
        }
        for e in &eventfds {
            let _ = rustix::io::write(e, &(x | 1).to_ne_bytes());
        }
        std::thread::yield_now();
    }
}

/// Post well-formed claims on our port for `time`: for every slot, queue index and generation
/// of `theirs` (an aperture we hold no grant of), and naming `mine` (granted) but the queue
/// indexes of other apertures' tripwires. Returns how many were posted.
fn forge(mine: &Descriptor, theirs: &Descriptor, time: Duration) -> u64 {
    use clan_shm::eq::{EqLayout, EqMap, EqParams};
    use clan_shm::ring::Producer;
    let (_, fd) = memfds().into_iter().find(|(n, _)| n.contains("clan-port")).expect("a port");
    let len = rustix::fs::fstat(&fd).unwrap().st_size as usize;
    let layout = (1..=20)
        .map(|k| EqLayout::new(EqParams { nrings: 1, ring_cap: 1 << k, trip_cap: 0, tripset_cap: 0 }))
        .find(|l| l.size == len)
        .expect("the port's geometry");
    let seg = Segment::map(fd.as_fd(), 0, len, Access::ReadWrite).unwrap();
    let map = EqMap::new(std::sync::Arc::new(seg), layout).unwrap();
    let view = map.view();
    let head = view.ring_headers[0].head.load(std::sync::atomic::Ordering::Acquire);
    let mut p = Producer::resume(0, head);
    let mut posted = 0u64;
    let start = Instant::now();
    'out: while start.elapsed() < time {
        for slot in 0..80u64 {
            for generation in 0..4u64 {
                for (ap, kind) in [(theirs, 1u64), (theirs, 2), (mine, 2)] {
                    let w = [
                        8 | (kind << 8),
                        u64::from(ap.aperture()) | (u64::from(ap.generation()) << 32),
                        slot | (generation << 32),
                        // The queue index: the tripwires of every aperture of the queue.
                        slot,
                    ];
                    if p.post(&view.rings(), w, &clan_shm::sync::SharedFutex).stored {
                        posted += 1;
                    }
                }
            }
            if start.elapsed() >= time {
                break 'out;
            }
        }
        std::thread::yield_now();
    }
    posted
}

/// The `fd …` lines of an inspecting child, by memfd name.
fn read_inspection(c: &mut Peer) -> Vec<(String, String)> {
    let mut fds = Vec::new();
    loop {
        let l = c.expect("inspection");
        if l == "end" {
            return fds;
        }
        let rest = l.strip_prefix("fd ").unwrap_or_else(|| panic!("unexpected line {l}"));
        let (name, facts) = rest.split_once(' ').unwrap();
        fds.push((name.to_string(), facts.to_string()));
    }
}

fn spawn_unprivileged(role: &str) -> Option<Peer> {
    Some(Peer::spawn_via(unprivileged()?, ENTRY, role, &[]))
}

/// A read-only grant of a whole aperture maps the aperture's memory — and nothing the
/// importer does with the descriptors makes it writable: no writable reopen, no writable
/// shared mapping, no `pwrite`.
#[test]
fn a_read_only_grant_cannot_be_upgraded() {
    let _wd = Watchdog::new("read-only grant", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(1 << 16).unwrap();
    ap.write(0, &[0x5a; 1 << 16]).unwrap();
    let Some(mut c) = spawn_unprivileged("inspect") else { return };
    c.send(&ap.descriptor().derive(0, 1 << 16, Rights::READ).unwrap().to_string());
    assert_eq!(c.expect("remote"), "remote false", "a whole-aperture grant is mapped directly");
    assert_eq!(c.expect("write"), "write false");
    assert_eq!(c.expect("beyond"), "beyond true");
    assert_eq!(c.expect("raw"), "raw fds 4", "data, index, port and its eventfd");
    let fds = read_inspection(&mut c);
    let facts = |n: &str| fds.iter().filter(|(name, _)| name == n).map(|(_, f)| f.clone()).collect::<Vec<_>>();
    for name in ["clan-aperture", "clan-index"] {
        let f = facts(name);
        assert!(!f.is_empty(), "the importer kept its {name} memfd: {fds:?}");
        for f in &f {
            for no in ["reopen_rw false", "reopen_ro false", "map_rw false", "pwrite false"] {
                assert!(f.contains(no), "{name}: {f} (expected {no})");
            }
        }
    }
    // Its own port is the only memory it may write.
    for (name, f) in &fds {
        assert!(name == "clan-port" || !f.contains("map_rw true"), "{name} is writable: {f}");
    }
    c.send("1000");
    assert_eq!(c.expect("garbaged"), "garbaged");
    let mut back = vec![0u8; 1 << 16];
    ap.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a), "the aperture changed under a read-only grant");
    // And we still work.
    let tw = ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    ep.import(&ap.descriptor()).unwrap().store_u64(0, 1).unwrap();
    tw.wait(Some(Duration::from_secs(10))).unwrap();
}

/// A grant of 4 KiB of a 1 MiB aperture is served through the exporter's NIC (mediated, as
/// over a link): the importer holds no memory of the aperture at all, reads and writes
/// inside the grant work, and nothing outside it is reachable.
#[test]
fn a_narrowed_grant_reaches_nothing_beyond_it() {
    let _wd = Watchdog::new("narrowed grant", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let len = 1u64 << 20;
    let ap = ep.export(len).unwrap();
    let pattern: Vec<u8> = SECRET.iter().copied().cycle().take(len as usize).collect();
    ap.write(0, &pattern).unwrap();
    let Some(mut c) = spawn_unprivileged("inspect") else { return };
    let (off, glen) = (64 << 10, 4096);
    c.send(&ap.descriptor().derive(off, glen, Rights::READ_WRITE).unwrap().to_string());
    assert_eq!(c.expect("remote"), "remote true", "a narrowed grant is mediated");
    assert_eq!(c.expect("write"), "write true");
    assert_eq!(c.expect("beyond"), "beyond true");
    assert_eq!(c.expect("raw"), "raw Narrowed", "the exporter hands no memory for a narrowed grant");
    let fds = read_inspection(&mut c);
    for (name, f) in &fds {
        assert!(name != "clan-aperture" && name != "clan-index", "the importer holds {name}: {f}");
        assert!(f.contains("secret false"), "{name} reveals bytes outside the grant: {f}");
    }
    c.send("500");
    assert_eq!(c.expect("garbaged"), "garbaged");
    let mut back = vec![0u8; len as usize];
    ap.read(0, &mut back).unwrap();
    assert_eq!(&back[off as usize..off as usize + 8], b"granted!");
    let (o, g) = (off as usize, glen as usize);
    assert!(back[..o] == pattern[..o], "bytes before the grant changed");
    assert!(back[o + g..] == pattern[o + g..], "bytes after the grant changed");
}

/// Apertures exported for one peer NIC share their memfds (`pool.rs`): the peer, importing
/// one, receives its chunk, which holds only apertures made for that same peer. An attacker
/// given one finds nothing of any other aperture (its own pool's excepted), cannot import an
/// aperture pooled for another NIC, gets a read-only grant of a pooled aperture only through
/// a link (never the chunk), and its garbage changes nothing outside its pool.
#[test]
fn a_pooled_aperture_reaches_only_its_own_peers_pool() {
    let _wd = Watchdog::new("pooled grant", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let Some(mut c) = spawn_unprivileged("pooled") else { return };
    let peer: clan::NicAddr = c.expect("nic addr").parse().unwrap();
    // Ours and another NIC's pools, and an aperture of its own, hold the secret.
    let stranger = clan::NicAddr::localhost(1);
    let theirs: Vec<_> = (0..4).map(|_| ep.export_with(4096, ExportConfig::for_peer(stranger)).unwrap()).collect();
    let own = ep.export(1 << 16).unwrap();
    for ap in theirs.iter().chain([&own]) {
        let pattern: Vec<u8> = SECRET.iter().copied().cycle().take(ap.len() as usize).collect();
        ap.write(0, &pattern).unwrap();
    }
    let mine = ep.export_with(8192, ExportConfig::for_peer(peer)).unwrap();
    assert_eq!(nic.stats().pools, 2);
    c.send(&mine.descriptor().to_string());
    c.send(&theirs[0].descriptor().to_string());
    assert_eq!(c.expect("remote"), "remote false", "a whole grant of a pooled aperture is mapped");
    assert_eq!(c.expect("write"), "write true");
    assert_eq!(c.expect("other"), "other Denied(Endpoint)", "an aperture pooled for another NIC");
    let ro = c.expect("read-only");
    assert!(
        ro == "read-only remote true write false" || ro.starts_with("read-only NeedsLink"),
        "a read-only grant of a pooled aperture is mediated: {ro}"
    );
    assert_eq!(c.expect("raw-ro"), "raw-ro Narrowed", "no chunk for a read-only grant");
    assert_eq!(c.expect("raw"), "raw fds 4");
    let fds = read_inspection(&mut c);
    assert!(fds.iter().any(|(n, _)| n == "clan-pool"), "the importer kept the chunk: {fds:?}");
    for (name, f) in &fds {
        assert!(f.contains("secret false"), "{name} reveals another aperture: {f}");
    }
    c.send("500");
    assert_eq!(c.expect("garbaged"), "garbaged");
    for ap in theirs.iter().chain([&own]) {
        let mut back = vec![0u8; ap.len() as usize];
        ap.read(0, &mut back).unwrap();
        assert!(back.chunks(16).all(|w| w == SECRET), "another aperture changed");
    }
}

/// An importer that forges claims for an aperture it was never granted, and writes garbage
/// over its port and floods its eventfd, fires nothing it may not, and costs an honest
/// importer of the same event queue no wake-up.
#[test]
fn forged_claims_and_garbage_cost_nobody_else_anything() {
    let _wd = Watchdog::new("forged claims", Duration::from_secs(180));
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig::default()).unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let granted = ep.export(1 << 16).unwrap();
    let victim = ep.export(1 << 16).unwrap();
    let honest_ap = ep.export(4096).unwrap();
    // Armed tripwires on the aperture nobody was granted: only a forged claim could fire them.
    let untouchable: Vec<_> = (0..64)
        .map(|i| {
            let t = victim.tripwire(TripwireConfig::writes(i * 1024..i * 1024 + 8)).unwrap();
            t.arm().unwrap();
            t
        })
        .collect();
    let Some(mut attacker) = spawn_unprivileged("forge") else { return };
    attacker.send(&granted.descriptor().to_string());
    attacker.send(&victim.descriptor().to_string());
    attacker.send("2000");
    assert_eq!(attacker.expect("imported"), "imported");
    let mut honest = Peer::spawn(ENTRY, "honest", &[]);
    let rounds = 300u64;
    honest.send(&honest_ap.descriptor().to_string());
    honest.send(&rounds.to_string());
    assert_eq!(honest.expect("ready"), "ready");
    let tw = honest_ap.tripwire(TripwireConfig::writes(0..8)).unwrap();
    tw.arm().unwrap();
    let mut done = 0;
    while done < rounds {
        // Every round is one write of the honest importer that must wake us.
        let v = honest_ap.load_u64(0).unwrap();
        if v > done {
            done = v;
            honest_ap.store_u64(8, v).unwrap();
            continue;
        }
        tw.wait(Some(Duration::from_secs(20)))
            .unwrap_or_else(|e| panic!("round {}: the honest importer's write never woke us: {e}", done + 1));
    }
    assert_eq!(honest.expect("done"), "done");
    let forged = attacker.expect("forged");
    let n: u64 = forged.strip_prefix("forged ").unwrap().parse().unwrap();
    assert!(n > 0, "the attacker posted no forged claim");
    // Whatever it could still post has been applied once we pump.
    for t in &untouchable {
        assert_eq!(t.count(), 0, "a forged claim fired a tripwire of an aperture never granted");
    }
    let s = q.stats();
    assert!(s.malformed > 0, "forged claims were noticed: {s:?}");
    // Still working for everyone.
    let tw2 = victim.tripwire(TripwireConfig::writes(0..8)).unwrap();
    ep.import(&victim.descriptor()).unwrap().store_u64(0, 1).unwrap();
    tw2.wait(Some(Duration::from_secs(10))).unwrap();
}

/// Memory another process received is never recycled into another aperture: it may have
/// kept the descriptors whatever it answered, and would write into the next aperture.
#[test]
fn memory_another_process_received_is_never_recycled() {
    let _wd = Watchdog::new("tainted memory", Duration::from_secs(120));
    let nic = nic();
    let ep = nic.endpoint().unwrap();
    let ap = ep.export(1 << 16).unwrap();
    let Some(mut c) = spawn_unprivileged("keep") else { return };
    c.send(&ap.descriptor().to_string());
    assert_eq!(c.expect("kept"), "kept 1");
    drop(ap);
    // Give its unimport every chance to be processed, then make new apertures of that size.
    std::thread::sleep(Duration::from_millis(200));
    let fresh: Vec<_> = (0..8).map(|_| ep.export(1 << 16).unwrap()).collect();
    assert_eq!(nic.stats().exports_cached, 0, "an aperture got memory another process holds");
    c.send("write");
    assert_eq!(c.expect("written"), "written");
    for a in &fresh {
        let mut b = vec![0u8; 1 << 16];
        a.read(0, &mut b).unwrap();
        assert!(!b.windows(8).any(|w| w == b"STOLEN!!"), "a kept descriptor reaches a new aperture");
    }
    // Memory no other process received is recycled as before.
    drop(fresh);
    assert_eq!(ep.export(1 << 16).map(|_| nic.stats().exports_cached).unwrap(), 1);
}

/// A process is one producer however many connections it opens, and a user gets a bounded
/// share of a queue's producers: others can still import.
#[test]
fn one_port_per_process_and_a_bounded_share_per_user() {
    let _wd = Watchdog::new("ports", Duration::from_secs(120));
    let nic = nic();
    let q = nic.event_queue(EventQueueConfig { producers_per_user: 2, ..EventQueueConfig::default() }).unwrap();
    let ep =
        nic.endpoint_with(clan::EndpointConfig { port: None, queue: Some(q.clone()), ..Default::default() }).unwrap();
    let ap = ep.export(4096).unwrap();
    let Some(mut many) = spawn_unprivileged("many_nics") else { return };
    many.send(&ap.descriptor().to_string());
    many.send("40");
    assert_eq!(many.expect("imported"), "imported 40");
    assert_eq!(q.stats().producers, 1, "forty connections of one process are one producer");
    let Some(mut second) = spawn_unprivileged("try_import") else { return };
    second.send(&ap.descriptor().to_string());
    assert_eq!(second.expect("result"), "ok");
    let Some(mut third) = spawn_unprivileged("try_import") else { return };
    third.send(&ap.descriptor().to_string());
    assert_eq!(third.expect("result"), "TooManyProducers", "a user's share is bounded");
    // Another user is not locked out.
    let mut other = Peer::spawn(ENTRY, "try_import", &[]);
    other.send(&ap.descriptor().to_string());
    assert_eq!(other.expect("result"), "ok");
    assert_eq!(q.stats().producers, 3);
}

/// Requests to be granted on accept (`Request::ImportOnAccept`) are filed under the NIC
/// whose verified hello they came after: another process that files one with a client's
/// token gets nothing when that client's connect is accepted (the client gets its grant);
/// one that floods them pushes others' out, and that costs those clients only the round
/// trip the request saves: their connects import as usual.
#[test]
fn import_on_accept_requests_are_the_senders_own_and_a_flood_costs_only_speed() {
    let _wd = Watchdog::new("import on accept", Duration::from_secs(120));
    let (sn, cn) = (nic_or_die(), nic_or_die());
    let server = sn.endpoint().unwrap();
    server.listen();
    let to = server.addr();
    let client = cn.endpoint().unwrap();
    let mine = client.export(4096).unwrap();
    let t = Some(Duration::from_secs(20));
    let mut hostile = Peer::spawn(ENTRY, "file_on_accept", &[]);
    hostile.send(&sn.addr().to_string());
    // Each connect: accepted after `meanwhile` had its way with the request's token; the
    // client then writes through the import it was given.
    let connect = |n: u64, meanwhile: &mut dyn FnMut(u64)| {
        std::thread::scope(|s| {
            let c = s.spawn(|| {
                let (conn, pending) = client.connect_importing(to, &mine.descriptor(), &[], t).unwrap();
                let m = pending.finish(Duration::from_secs(20)).unwrap();
                m.store_u64(0, n).unwrap();
                (conn, m)
            });
            let req = server.accept(t).unwrap();
            meanwhile(req.token());
            let ap = server.export(4096).unwrap();
            let conn = req.accept(&server, &ap.descriptor()).unwrap();
            let kept = c.join().unwrap();
            assert_eq!(ap.load_u64(0).unwrap(), n, "connect {n}");
            (ap, conn, kept)
        })
    };
    let on_accept = || sn.stats().imports_granted_on_accept;
    // (the first opens the client's control connection: nothing asked on accept)
    let _first = connect(1, &mut |_| {});
    assert_eq!(on_accept(), 0);
    let _own = connect(2, &mut |_| {});
    assert_eq!(on_accept(), 1, "a client's own request is granted on accept");
    let _stolen = connect(3, &mut |token| {
        hostile.send(&format!("steal {token}"));
        assert_eq!(hostile.expect("clean"), "clean");
    });
    assert_eq!(on_accept(), 2, "the client's request was granted, not the thief's");
    hostile.send("check 0");
    assert_eq!(hostile.expect("clean"), "clean", "the thief was granted nothing");
    let _flooded = connect(4, &mut |_| {
        hostile.send(&format!("flood {}", 2 * 1024 + 10));
        assert_eq!(hostile.expect("clean"), "clean");
    });
    assert_eq!(on_accept(), 2, "the flood pushed the client's request out: imported as usual");
    let _after = connect(5, &mut |_| {});
    assert_eq!(on_accept(), 3);
    hostile.send("check 0");
    assert_eq!(hostile.expect("clean"), "clean", "nothing was ever granted to the thief");
}
