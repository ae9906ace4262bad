//! The provider's core without libfabric: what a small tagged message costs through
//! `clan_fi::rdm` (the layer under `fi_tsend`/`fi_cq_read`), to tell the provider's own cost
//! from libfabric's and MPI's.
//!
//! ```text
//! cargo run --release -p clan-fi --example rdm_pingpong [ITERS] [solo]
//! ```
//!
//! Prints the round trip between two endpoints on two threads pinned to CPUs 0 and 1 (p10,
//! p50, p90), one message sent and received on one thread (warm caches, no other core), an
//! empty poll, and a send into a ring with room; and, on the peer's side, how long the poll
//! that finds a message takes and how long its reply's send takes. `solo`: only the
//! one-thread figure. `procs`: the round trip between two processes (the peer forked, each
//! with its own endpoint, pinned to CPUs 1 and 0), as MPI ranks are. `PAUSE=1`: both sides
//! pause (`spin_loop`) between empty polls.
use clan_fi::rdm::{Land, Landed, Posted, Rdm};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Count(Arc<AtomicUsize>);
impl Land for Count {
    fn part(&self, _p: &Posted, _at: usize, _data: &[u8]) {}
    fn done(&self, _p: &Posted, _m: Landed<'_>, _len: usize, _direct: &mut clan_fi::cq::Direct) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

fn pin(cpu: usize) {
    // SAFETY: a zeroed `cpu_set_t` is a valid empty set; `CPU_SET` and `sched_setaffinity`
    // get a valid pointer to it and its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn posted() -> Posted {
    Posted { buf: 0, len: 8, context: 1, tagged: true, tag: 7, ignore: 0, from: None, completion: true }
}

/// The round trip between two processes: the child echoes, the parent times.
fn procs(iters: usize) {
    let mut fds = [0i32; 4];
    // SAFETY: two arrays of two fds each for `pipe`; `fork` in a process with one thread
    // (nothing opened yet); the child only uses its own objects and exits.
    let child = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        assert_eq!(libc::pipe(fds.as_mut_ptr().add(2)), 0);
        libc::fork()
    };
    assert!(child >= 0);
    // The child writes to pipe 0 and reads pipe 1; the parent the other way.
    let (rd, wr) = if child == 0 { (fds[2], fds[1]) } else { (fds[0], fds[3]) };
    let xfer = |mine: &[u8]| -> Vec<u8> {
        let mut theirs = vec![0u8; mine.len()];
        // SAFETY: `mine` and `theirs` are valid for their lengths; the fds are the pipes'.
        unsafe {
            assert_eq!(libc::write(wr, mine.as_ptr().cast(), mine.len()), mine.len() as isize);
            assert_eq!(libc::read(rd, theirs.as_mut_ptr().cast(), theirs.len()), theirs.len() as isize);
        }
        theirs
    };
    pin(if child == 0 { 1 } else { 0 });
    let q = clan_fi::rdm::nic().unwrap().event_queue(clan::EventQueueConfig::default()).unwrap();
    let me = Rdm::open(&q).unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    me.set_land(Box::new(Count(count.clone())));
    let peer = clan_fi::av::Addr::from_bytes(&xfer(me.addr().bytes())).unwrap();
    let data = [0u8; 8];
    let mut t = Vec::with_capacity(iters);
    for i in 0..iters + 1000 {
        let s = std::time::Instant::now();
        assert!(me.post(posted()).is_none());
        if child != 0 {
            me.send(peer, &data, true, 7, Some(3)).unwrap();
        }
        while count.load(Ordering::Acquire) <= i {
            me.progress();
        }
        if child == 0 {
            me.send(peer, &data, true, 7, Some(3)).unwrap();
        } else if i >= 1000 {
            t.push(s.elapsed().as_nanos() as u64);
        }
    }
    xfer(b"x");
    if child == 0 {
        std::process::exit(0);
    }
    t.sort();
    println!(
        "two processes: rdm rtt p50 {} ns p10 {} p90 {} (one way p50 {})",
        t[t.len() / 2],
        t[t.len() / 10],
        t[t.len() * 9 / 10],
        t[t.len() / 2] / 2
    );
}

fn main() {
    let iters: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    if std::env::args().nth(2).as_deref() == Some("procs") {
        return procs(iters);
    }
    let q = clan_fi::rdm::nic().unwrap().event_queue(clan::EventQueueConfig::default()).unwrap();
    let a = Arc::new(Rdm::open(&q).unwrap());
    let b = Arc::new(Rdm::open(&q).unwrap());
    let (ca, cb) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    a.set_land(Box::new(Count(ca.clone())));
    b.set_land(Box::new(Count(cb.clone())));
    let (aa, ba) = (a.addr(), b.addr());
    let data = [0u8; 8];
    let pause = std::env::var_os("PAUSE").is_some();
    if std::env::args().nth(2).as_deref() == Some("solo") {
        pin(0);
        let s0 = std::time::Instant::now();
        for i in 0..iters {
            assert!(b.post(posted()).is_none());
            a.send(ba, &data, true, 7, Some(3)).unwrap();
            while cb.load(Ordering::Acquire) <= i {
                b.progress();
            }
        }
        println!("solo {:.1} ns", s0.elapsed().as_nanos() as f64 / iters as f64);
        return;
    }
    let peer = {
        let b = b.clone();
        let cb = cb.clone();
        std::thread::spawn(move || {
            pin(1);
            let (mut t_found, mut t_send) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
            for i in 0..iters + 1000 {
                assert!(b.post(posted()).is_none());
                let mut t0;
                loop {
                    t0 = std::time::Instant::now();
                    b.progress();
                    if cb.load(Ordering::Acquire) > i {
                        break;
                    }
                    if pause {
                        std::hint::spin_loop();
                    }
                }
                let t1 = std::time::Instant::now();
                b.send(aa, &data, true, 7, Some(3)).unwrap();
                let t2 = std::time::Instant::now();
                if i >= 1000 {
                    t_found.push((t1 - t0).as_nanos() as u64);
                    t_send.push((t2 - t1).as_nanos() as u64);
                }
            }
            t_found.sort();
            t_send.sort();
            println!(
                "peer: the poll that finds a message p50 {} ns, its reply's send p50 {} ns (clock reads included)",
                t_found[t_found.len() / 2],
                t_send[t_send.len() / 2]
            );
        })
    };
    pin(0);
    let mut t = Vec::with_capacity(iters);
    for i in 0..iters + 1000 {
        let s = std::time::Instant::now();
        assert!(a.post(posted()).is_none());
        a.send(ba, &data, true, 7, Some(3)).unwrap();
        while ca.load(Ordering::Acquire) <= i {
            a.progress();
            if pause {
                std::hint::spin_loop();
            }
        }
        if i >= 1000 {
            t.push(s.elapsed().as_nanos() as u64);
        }
    }
    peer.join().unwrap();
    // One message sent and received on this thread (warm caches, no other core).
    let base = cb.load(Ordering::Acquire);
    let n = 1_000_000;
    let s0 = std::time::Instant::now();
    for i in 0..n {
        assert!(b.post(posted()).is_none());
        a.send(ba, &data, true, 7, Some(3)).unwrap();
        while cb.load(Ordering::Acquire) <= base + i {
            b.progress();
        }
    }
    println!("one message, one thread {:.1} ns", s0.elapsed().as_nanos() as f64 / n as f64);
    // Idle poll cost.
    let n = 1_000_000;
    let s0 = std::time::Instant::now();
    for _ in 0..n {
        a.progress();
    }
    println!("idle progress {:.1} ns", s0.elapsed().as_nanos() as f64 / n as f64);
    // Send cost (20 in a row into a ring of 31, then drained by b).
    let mut tot = 0u128;
    let mut cnt = 0u128;
    for _ in 0..20000 {
        let s0 = std::time::Instant::now();
        for _ in 0..20 {
            a.send(ba, &data, true, 9, None).unwrap();
        }
        tot += s0.elapsed().as_nanos();
        cnt += 20;
        b.progress();
        let mut st = b.progress();
        st.clear();
    }
    println!("send {:.1} ns", tot as f64 / cnt as f64);
    t.sort();
    println!(
        "rdm rtt p50 {} ns p10 {} p90 {} (one way p50 {})",
        t[t.len() / 2],
        t[t.len() / 10],
        t[t.len() * 9 / 10],
        t[t.len() / 2] / 2
    );
}
