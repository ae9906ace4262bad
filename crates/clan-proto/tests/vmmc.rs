//! The VMMC API: export/import with restrictions, deliberate update (inline and DMA,
//! synchronous and asynchronous), fetch, notifications (handlers and waits), within a
//! process, across processes and across a link.

#[path = "../../clan/tests/util/mod.rs"]
mod util;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use clan::{Denial, ImportError, ImportPolicy, LocalTransport, Nic, NicConfig};
use clan_proto::vmmc::{
    DEFAULT_INLINE_MAX, ExportOptions, LocalBuffer, Notification, Notify, SendFlags, Vmmc, VmmcConfig, VmmcError,
};

const WAIT: Option<Duration> = Some(Duration::from_secs(60));

struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    fn new(limit: Duration) -> Watchdog {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while start.elapsed() < limit {
                if d.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("WATCHDOG: test did not finish within {limit:?}");
            std::process::abort();
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

fn pair(nic_a: &Nic, nic_b: &Nic) -> (Vmmc, Vmmc) {
    (Vmmc::new(nic_a).unwrap(), Vmmc::new(nic_b).unwrap())
}

/// Sends of every size, both ways (inline and DMA), each with a notification the receiver
/// waits for; the data is in place when the notification is taken.
fn send_and_notify(sender: &Vmmc, receiver: &Vmmc) {
    let rx = receiver.export(1 << 20, ExportOptions { notify: Notify::Wait, ..Default::default() }).unwrap();
    let dst = sender.import(&rx.descriptor()).unwrap();
    let src = sender.send_buffer(1 << 20).unwrap();
    for (i, n) in [1u64, 8, 100, DEFAULT_INLINE_MAX, DEFAULT_INLINE_MAX + 1, 64 << 10, 1 << 20].into_iter().enumerate()
    {
        let data = pattern(n as usize, i as u8);
        src.write(0, &data).unwrap();
        let off = (1 << 20) - n;
        sender.send_msg(&src, 0, &dst, off, n, SendFlags::notify()).unwrap();
        assert_eq!(rx.wait_notification(WAIT).unwrap(), Notification::Landed { offset: off, len: n });
        let mut got = vec![0u8; n as usize];
        rx.read(off, &mut got).unwrap();
        assert!(got == data, "{n} bytes arrived intact");
    }
    let s = sender.stats();
    assert!(s.inline_sends >= 4 && s.dma_sends >= 3, "both paths used: {s:?}");
    // Asynchronous: the handle says when the source may be reused.
    let data = pattern(1 << 20, 77);
    src.write(0, &data).unwrap();
    let h = sender.send_msg_async(&src, 0, &dst, 0, 1 << 20, SendFlags::notify()).unwrap();
    h.wait(WAIT).unwrap();
    assert!(h.is_complete());
    src.fill(0, 1 << 20, 0).unwrap(); // reusing the buffer cannot change what was sent
    assert_eq!(rx.wait_notification(WAIT).unwrap(), Notification::Landed { offset: 0, len: 1 << 20 });
    let mut got = vec![0u8; 1 << 20];
    rx.read(0, &mut got).unwrap();
    assert!(got == data);
    // Fetch, small (inline) and large (DMA), sync and async.
    let back = sender.send_buffer(1 << 20).unwrap();
    sender.fetch(&dst, 8, &back, 0, 16).unwrap();
    let mut f = [0u8; 16];
    back.read(0, &mut f).unwrap();
    assert_eq!(&f[..], &data[8..24]);
    let h = sender.fetch_async(&dst, 0, &back, 0, 1 << 20).unwrap();
    h.wait(WAIT).unwrap();
    back.read(0, &mut got).unwrap();
    assert!(got == data, "fetched intact");
}

#[test]
fn deliberate_update_fetch_and_waits_in_one_process() {
    let _wd = Watchdog::new(Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    let (a, b) = pair(&nic, &nic);
    send_and_notify(&a, &b);
}

#[test]
fn deliberate_update_fetch_and_waits_across_a_link() {
    let _wd = Watchdog::new(Duration::from_secs(120));
    let cfg = || NicConfig { local_transport: LocalTransport::Link, ..NicConfig::default() };
    let (na, nb) = (Nic::open(cfg()).unwrap(), Nic::open(cfg()).unwrap());
    let (a, b) = pair(&na, &nb);
    send_and_notify(&a, &b);
}

#[test]
fn handlers_run_after_the_message_landed() {
    let _wd = Watchdog::new(Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let (a, b) = pair(&nic, &nic);
    let (tx, rx) = mpsc::channel();
    let slot: Arc<std::sync::Mutex<Option<Arc<clan_proto::vmmc::ExportedBuffer>>>> = Arc::default();
    let s2 = slot.clone();
    let handler = Arc::new(move |n: Notification| {
        // The data is there when the handler runs.
        let buf = s2.lock().unwrap().clone().unwrap();
        let Notification::Landed { offset, len } = n else { panic!("lost notifications") };
        let mut got = vec![0u8; len as usize];
        buf.read(offset, &mut got).unwrap();
        tx.send((offset, got, std::thread::current().name().map(String::from))).unwrap();
    });
    let buf = Arc::new(
        b.export(256 << 10, ExportOptions { notify: Notify::Handler(handler), ..Default::default() }).unwrap(),
    );
    *slot.lock().unwrap() = Some(buf.clone());
    let dst = a.import(&buf.descriptor()).unwrap();
    let src = a.send_buffer(256 << 10).unwrap();
    for (k, n) in [16u64, 200 << 10].into_iter().enumerate() {
        let data = pattern(n as usize, 5 + k as u8);
        src.write(0, &data).unwrap();
        a.send_msg(&src, 0, &dst, 1024, n, SendFlags::notify()).unwrap();
        let (off, got, thread) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(off, 1024);
        assert!(got == data, "handler saw the whole message");
        assert_eq!(thread.as_deref(), Some("vmmc-notify"));
    }
    // A send without the flag raises nothing.
    a.send_bytes(b"quiet", &dst, 0, SendFlags::default()).unwrap();
    a.send_bytes(b"loud", &dst, 8, SendFlags::notify()).unwrap();
    let (off, got, _) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!((off, &got[..]), (8, &b"loud"[..]));
    *slot.lock().unwrap() = None;
}

#[test]
fn restrictions_unexport_and_misuse_are_errors() {
    let _wd = Watchdog::new(Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let (a, b) = pair(&nic, &nic);
    let c = Vmmc::new(&nic).unwrap();
    let only_a = ImportPolicy::anyone().endpoint(a.endpoint().addr());
    let buf = b.export(4096, ExportOptions { policy: only_a, ..Default::default() }).unwrap();
    let dst = a.import(&buf.descriptor()).unwrap();
    assert!(matches!(c.import(&buf.descriptor()), Err(VmmcError::Import(ImportError::Denied(Denial::Endpoint)))));
    // Waiting on a buffer not exported for waits.
    assert!(matches!(buf.wait_notification(Some(Duration::from_millis(1))), Err(VmmcError::NotWaitable)));
    // Out of range.
    let src = a.send_buffer(8192).unwrap();
    assert!(matches!(a.send_msg(&src, 0, &dst, 4000, 200, SendFlags::default()), Err(VmmcError::Access(_))));
    assert!(matches!(a.send_msg(&src, 0, &dst, 0, 8192, SendFlags::default()), Err(VmmcError::Access(_))));
    // Send buffers cannot be imported by anyone.
    assert!(c.import(&src.aperture().descriptor()).is_err());
    // After unexport: imports fail, sends fail.
    let desc = buf.descriptor();
    b.unexport(buf);
    assert!(matches!(c.import(&desc), Err(VmmcError::Import(ImportError::Revoked { .. }))));
    assert!(a.send_msg(&src, 0, &dst, 0, 8, SendFlags::default()).is_err());
    assert!(a.send_msg(&src, 0, &dst, 0, 64 << 10, SendFlags::default()).is_err());
    // No notification pending: a zero timeout returns at once.
    let w = b.export(4096, ExportOptions { notify: Notify::Wait, ..Default::default() }).unwrap();
    assert!(matches!(w.try_notification(), Ok(None)));
    assert!(matches!(w.wait_notification(Some(Duration::from_millis(20))), Err(VmmcError::Timeout)));
}

#[test]
fn many_threads_send_and_many_threads_wait() {
    let _wd = Watchdog::new(Duration::from_secs(120));
    let nic = Nic::open_default().unwrap();
    let (a, b) = pair(&nic, &nic);
    const T: usize = 4;
    const N: u64 = 200;
    // Each message has its own slot; odd ones are long enough to go by DMA.
    const SLOT: u64 = 2 * DEFAULT_INLINE_MAX;
    let bufs: Vec<_> = (0..T)
        .map(|_| Arc::new(b.export(N * SLOT, ExportOptions { notify: Notify::Wait, ..Default::default() }).unwrap()))
        .collect();
    let waiters: Vec<_> = bufs
        .iter()
        .map(|buf| {
            let buf = buf.clone();
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while seen < N {
                    match buf.wait_notification(WAIT).unwrap() {
                        Notification::Landed { offset, len } => {
                            let mut w = [0u8; 8];
                            buf.read(offset, &mut w).unwrap();
                            assert_eq!(offset, seen * SLOT, "in order");
                            assert_eq!(u64::from_le_bytes(w), seen, "data in place");
                            assert_eq!(len, if seen % 2 == 0 { 8 } else { SLOT });
                            seen += 1;
                        }
                        Notification::Lost => panic!("nothing should be lost"),
                    }
                }
            })
        })
        .collect();
    let senders: Vec<_> = bufs
        .iter()
        .map(|buf| {
            let (a, desc) = (a.clone(), buf.descriptor());
            std::thread::spawn(move || {
                let dst = a.import(&desc).unwrap();
                let src = a.send_buffer(SLOT).unwrap();
                for i in 0..N {
                    let n = if i % 2 == 0 { 8 } else { SLOT };
                    src.store_u64(0, i).unwrap();
                    a.send_msg(&src, 0, &dst, i * SLOT, n, SendFlags::notify()).unwrap();
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    for w in waiters {
        w.join().unwrap();
    }
}

#[test]
fn a_full_mailbox_reports_lost() {
    let _wd = Watchdog::new(Duration::from_secs(60));
    let nic = Nic::open_default().unwrap();
    let a = Vmmc::new(&nic).unwrap();
    let b = Vmmc::with_config(&nic, VmmcConfig { mailbox: 4, ..VmmcConfig::default() }).unwrap();
    let rx = b.export(4096, ExportOptions { notify: Notify::Wait, ..Default::default() }).unwrap();
    let dst = a.import(&rx.descriptor()).unwrap();
    for i in 0..20u64 {
        a.send_bytes(&i.to_le_bytes(), &dst, 0, SendFlags::notify()).unwrap();
    }
    // Take what is there: at most the mailbox's worth, ending with `Lost`.
    let mut got = Vec::new();
    while let Ok(n) = rx.wait_notification(Some(Duration::from_millis(200))) {
        got.push(n);
    }
    assert!(got.len() <= 4, "{got:?}");
    assert_eq!(got.last(), Some(&Notification::Lost));
    assert!(b.stats().dropped >= 16);
}

/// The child side of the cross-process tests.
#[test]
fn child() {
    let Some(role) = util::role() else { return };
    let nic = Nic::open_default().unwrap();
    let v = Vmmc::new(&nic).unwrap();
    match role.as_str() {
        "receiver" => {
            let buf = v.export(1 << 20, ExportOptions { notify: Notify::Wait, ..Default::default() }).unwrap();
            util::say(buf.descriptor());
            for _ in 0..2 + BURST {
                let Notification::Landed { offset, len } = buf.wait_notification(WAIT).unwrap() else { panic!("lost") };
                let mut got = vec![0u8; len as usize];
                buf.read(offset, &mut got).unwrap();
                let sum = got.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
                util::say(format!("{offset} {len} {sum}"));
            }
            while util::hear().is_some() {}
        }
        other => panic!("unknown role {other}"),
    }
}

/// Notifications the test sends back to back, without waiting for their answers: the
/// receiver's queue takes them from the sender's port several at a time (the claims of a
/// batch are looked up together) and must hand them over in the order they were sent.
const BURST: u64 = 24;

#[test]
fn notifications_across_processes() {
    let _wd = Watchdog::new(Duration::from_secs(120));
    let mut peer = util::Peer::spawn("child", "receiver", &[]);
    let desc: clan::Descriptor = peer.expect("descriptor").parse().unwrap();
    let nic = Nic::open_default().unwrap();
    let v = Vmmc::new(&nic).unwrap();
    let dst = v.import(&desc).unwrap();
    let src = v.send_buffer(1 << 20).unwrap();
    for (off, n) in [(100u64, 64u64), (0, 1 << 20)] {
        let data = pattern(n as usize, n as u8);
        src.write(0, &data).unwrap();
        v.send_msg(&src, 0, &dst, off, n, SendFlags::notify()).unwrap();
        let sum = data.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        assert_eq!(peer.expect("notification"), format!("{off} {n} {sum}"));
    }
    let mut want = Vec::new();
    for i in 0..BURST {
        let (off, n) = (4096 * (i + 1) + i, 64 + i);
        let data = pattern(n as usize, i as u8);
        src.write(off, &data).unwrap();
        v.send_msg(&src, off, &dst, off, n, SendFlags::notify()).unwrap();
        let sum = data.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        want.push(format!("{off} {n} {sum}"));
    }
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&peer.expect("notification"), w, "notification {i} of the burst, in order");
    }
}

/// What the module documentation promises about threads.
#[test]
fn types_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    fn cloneable<T: Clone>() {}
    both::<Vmmc>();
    both::<clan_proto::vmmc::ExportedBuffer>();
    both::<clan_proto::vmmc::ImportedBuffer>();
    both::<clan_proto::vmmc::SendBuffer>();
    both::<clan_proto::vmmc::SendHandle>();
    both::<clan_proto::vmmc::FetchHandle>();
    both::<clan::DmaTicket>();
    both::<clan::DmaRequest>();
    cloneable::<Vmmc>();
    cloneable::<clan_proto::vmmc::ImportedBuffer>();
    cloneable::<clan::DmaTicket>();
}
