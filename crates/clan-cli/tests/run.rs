//! `clan run -- CMD`: unmodified socket programs over clan. The programs are this test
//! binary in a role (std's blocking sockets; mio's edge-triggered epoll) and, when installed,
//! redis. Loopback only; every child has a time limit.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLAN: &str = env!("CARGO_BIN_EXE_clan");

/// A program started by the test, killed when dropped.
struct Proc {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    /// The thread that reads its standard error (taken once).
    err: Option<std::thread::JoinHandle<String>>,
}

impl Proc {
    /// This test binary in `role`, under `clan run` or not.
    fn spawn(role: &str, args: &[&str], clan: bool) -> Proc {
        let exe = std::env::current_exe().unwrap();
        let mut c = if clan {
            let mut c = Command::new(CLAN);
            c.arg("run").arg("--").arg(exe);
            c
        } else {
            Command::new(exe)
        };
        Proc::from_command(&mut c, role, args)
    }

    /// As [`Proc::spawn`], under `clan run --min-turns 0`, every connection over clan however
    /// short (`CLAN_RUN_MIN_TURNS=0`): for tests of what many one-exchange connections go
    /// through over clan, which `short.rs` would otherwise leave to the kernel after eight.
    fn spawn_every_connection(role: &str, args: &[&str]) -> Proc {
        let mut c = Command::new(CLAN);
        c.args(["run", "--min-turns", "0", "--"]).arg(std::env::current_exe().unwrap());
        Proc::from_command(&mut c, role, args)
    }

    /// `c` (a command that runs this test binary: [`unprivileged`]) in `role`.
    fn from_command(c: &mut Command, role: &str, args: &[&str]) -> Proc {
        c.args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("RUN_ROLE", role)
            .env("RUN_ARGS", args.join(" "))
            .env("CLAN_RUN_DEBUG", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        // Its standard error is read as it comes, by a thread: a program that says a line
        // per connection would otherwise fill the pipe and block.
        let mut e = child.stderr.take().unwrap();
        let err = Some(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = e.read_to_string(&mut s);
            s
        }));
        Proc { child, out, err }
    }

    /// The next line the program printed that starts with `want`.
    fn expect(&mut self, want: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                let _ = self.child.wait();
                let err = self.err.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
                panic!("the program ended before printing {want}: {err}");
            }
            // (libtest may have printed "test child ... " before it on the same line)
            if let Some(at) = line.find(want) {
                return line[at + want.len()..].trim().to_string();
            }
        }
    }

    /// Its standard error, all of it once the program ended (the handle of the thread that
    /// reads it).
    fn stderr_at_end(&mut self) -> std::thread::JoinHandle<String> {
        self.err.take().unwrap()
    }

    /// Wait for the end (at most `limit`); its standard error.
    fn finish(mut self, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let err = self.err.take().unwrap().join().unwrap();
                assert!(st.success(), "the program failed ({st}): {err}");
                return err;
            }
            assert!(start.elapsed() < limit, "the program did not finish in {limit:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The roles, run by the children.
#[test]
fn child() {
    let Ok(role) = std::env::var("RUN_ROLE") else { return };
    let args: Vec<String> = std::env::var("RUN_ARGS").unwrap().split_whitespace().map(String::from).collect();
    // Nothing may hang: a child ends itself after a while.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(3);
    });
    match role.as_str() {
        "idle_listener" => {
            // A registered listener nobody connects to: how often do the library's threads
            // wake while the program waits in `accept`?
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let wakes = || -> u64 {
                let mut n = 0;
                for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
                    let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                    if !comm.starts_with("clan-run-") {
                        continue;
                    }
                    let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                    n += status
                        .lines()
                        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap_or(0);
                }
                n
            };
            // (the threads start at the listen, then settle into their sleep)
            std::thread::sleep(Duration::from_millis(300));
            let before = wakes();
            std::thread::sleep(Duration::from_secs(3));
            println!("wakes {}", wakes() - before);
            drop(l);
        }
        "echo_server" => {
            // Blocking std sockets: accept one connection, greet first (a server that
            // speaks first), then echo until end of stream.
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            // (a slow acceptor: the connection waits in the backlog this many seconds)
            if let Some(secs) = args.first() {
                std::thread::sleep(Duration::from_secs(secs.parse().unwrap()));
            }
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"hello\n").unwrap();
            let mut buf = vec![0u8; 70000];
            let mut total = 0;
            loop {
                let n = s.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                total += n;
                s.write_all(&buf[..n]).unwrap();
            }
            s.shutdown(Shutdown::Write).unwrap();
            println!("echoed {total}");
        }
        "epoll_echo_many" => {
            // Accept that many connections, then echo on all of them from one level-triggered
            // epoll set until every one has ended.
            let n: usize = args[0].parse().unwrap();
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let conns: Vec<TcpStream> = (0..n).map(|_| l.accept().unwrap().0).collect();
            many::echo(&conns);
            println!("echoed {n}");
        }
        "quiet_many_client" => {
            // That many connections; exchanges on one at a time, the others quiet.
            let (port, n, rounds): (u16, usize, usize) =
                (args[0].parse().unwrap(), args[1].parse().unwrap(), args[2].parse().unwrap());
            let mut conns: Vec<TcpStream> = (0..n).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
            for r in 0..rounds {
                let i = (r * 7919 + r / 3) % n;
                let msg = [b'a' + (r % 26) as u8, b'0' + (i % 10) as u8, b'.'];
                conns[i].write_all(&msg).unwrap();
                let mut back = [0u8; 3];
                conns[i].read_exact(&mut back).unwrap();
                assert_eq!(back, msg, "round {r}, connection {i}");
            }
            drop(conns);
            println!("client ok");
        }
        "serve_hold" | "connect_hold" => {
            // Many connections held at once: `serve_hold N` accepts N (with as many
            // descriptors as it may have), `connect_hold PORT N` makes them under a limit of
            // 1024 soft, 2048 hard (clan raises the soft one to the hard one); five bytes
            // echoed on each.
            use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
            let server = role == "serve_hold";
            if server {
                let hard = getrlimit(Resource::Nofile).maximum;
                let _ = setrlimit(Resource::Nofile, Rlimit { current: Some(65536), maximum: Some(65536) })
                    .or_else(|_| setrlimit(Resource::Nofile, Rlimit { current: hard, maximum: hard }));
            } else {
                setrlimit(Resource::Nofile, Rlimit { current: Some(1024), maximum: Some(2048) }).unwrap();
            }
            let n: usize = args[if server { 0 } else { 1 }].parse().unwrap();
            let mut held = Vec::with_capacity(n);
            if server {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                println!("port {}", l.local_addr().unwrap().port());
                for _ in 0..n {
                    let (mut s, _) = l.accept().unwrap();
                    let mut b = [0u8; 5];
                    s.read_exact(&mut b).unwrap();
                    s.write_all(&b).unwrap();
                    held.push(s);
                }
                println!("served {n}");
                // (until the client has them all)
                let mut b = [0u8; 1];
                assert_eq!(held[0].read(&mut b).unwrap(), 0);
            } else {
                let port: u16 = args[0].parse().unwrap();
                for i in 0..n {
                    let mut s =
                        TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("connection {i}: {e}"));
                    s.write_all(b"hello").unwrap();
                    let mut b = [0u8; 5];
                    s.read_exact(&mut b).unwrap();
                    held.push(s);
                }
                let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
                    .unwrap()
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect();
                eprintln!(
                    "descriptors: {} open, highest {}; {:?}",
                    fds.len(),
                    fds.iter().max().unwrap_or(&0),
                    rustix::process::getrlimit(rustix::process::Resource::Nofile)
                );
                println!("held {n}");
            }
        }
        "serve_n" => {
            // Listen on the port given (0: any), serve that many connections one after the
            // other (echo five bytes), then end.
            let (port, n): (u16, usize) = (args[0].parse().unwrap(), args[1].parse().unwrap());
            let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            for _ in 0..n {
                let (mut s, _) = l.accept().unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
            }
            println!("served {n}");
        }
        "echo_each_until_killed" => {
            // Echo everything on each connection until its end, one connection after the
            // other, until killed.
            let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let mut buf = vec![0u8; 65536];
            loop {
                let (mut s, _) = l.accept().unwrap();
                loop {
                    let n = s.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    s.write_all(&buf[..n]).unwrap();
                }
            }
        }
        "connect_turns" => {
            // Phases of connections, one after the other: `N:TURNS[:SIZE]` makes N
            // connections that each send SIZE bytes (5 by default) and read them back echoed,
            // TURNS times, then close.
            let port: u16 = args[0].parse().unwrap();
            let mut made = 0;
            for phase in args[1].split(',') {
                let f: Vec<usize> = phase.split(':').map(|x| x.parse().unwrap()).collect();
                let (n, turns, size) = (f[0], f[1], f.get(2).copied().unwrap_or(5));
                let sent: Vec<u8> = (0..size).map(|i| (i * 7 + made) as u8).collect();
                let mut back = vec![0u8; size];
                for _ in 0..n {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    for _ in 0..turns {
                        s.write_all(&sent).unwrap();
                        s.read_exact(&mut back).unwrap();
                        assert_eq!(back, sent);
                    }
                    made += 1;
                }
                println!("phase {phase} done");
            }
            println!("connected {made}");
        }
        "serve_until_killed" => {
            // Echo five bytes on each connection, one after the other, until killed.
            let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            loop {
                let (mut s, _) = l.accept().unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
            }
        }
        "reuseport_server" => {
            // Two listeners sharing a port (`SO_REUSEPORT`; the port given, or a new one),
            // each accepting on its own thread: echo five bytes on each connection, `n` in all
            // (0: until killed).
            use rustix::net::{AddressFamily, SocketType, bind, socket, sockopt};
            let n: usize = args[0].parse().unwrap();
            let n = if n == 0 { usize::MAX } else { n };
            let given: u16 = args.get(1).map_or(0, |p| p.parse().unwrap());
            let make = |port: u16| {
                let s = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
                sockopt::set_socket_reuseport(&s, true).unwrap();
                bind(&s, &std::net::SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
                // (through the C library, as a program's `listen` goes: interposed)
                // SAFETY: a socket of ours, bound.
                assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&s), 128) }, 0);
                TcpListener::from(s)
            };
            let a = make(given);
            let port = a.local_addr().unwrap().port();
            let b = make(port);
            println!("port {port}");
            let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let threads: Vec<_> = [a, b]
                .into_iter()
                .map(|l| {
                    let served = served.clone();
                    l.set_nonblocking(true).unwrap();
                    std::thread::spawn(move || {
                        while served.load(std::sync::atomic::Ordering::SeqCst) < n {
                            match l.accept() {
                                Ok((mut s, _)) => {
                                    s.set_nonblocking(false).unwrap();
                                    let mut b = [0u8; 5];
                                    s.read_exact(&mut b).unwrap();
                                    s.write_all(&b).unwrap();
                                    served.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                }
                                Err(_) => std::thread::sleep(Duration::from_millis(1)),
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            println!("served {n}");
        }
        "late_reader" => {
            // Accept one connection 1.5 s after listening, and read it to its end.
            let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            std::thread::sleep(Duration::from_millis(1500));
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            println!("read {}", String::from_utf8_lossy(&got));
        }
        "write_and_close" => {
            let mut s = TcpStream::connect(("127.0.0.1", args[0].parse::<u16>().unwrap())).unwrap();
            s.write_all(b"hello").unwrap();
            drop(s);
            println!("sent");
        }
        "connect_batches" => {
            // Batches of connections to the port, one after the other (each echoing five
            // bytes, 50 ms apart); after batch `b`, wait for the file `go.b`.
            let (port, batches, n, go) = (
                args[0].parse::<u16>().unwrap(),
                args[1].parse::<usize>().unwrap(),
                args[2].parse::<usize>().unwrap(),
                &args[3],
            );
            for b in 0..batches {
                for _ in 0..n {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    s.write_all(b"hello").unwrap();
                    let mut r = [0u8; 5];
                    s.read_exact(&mut r).unwrap();
                    assert_eq!(&r, b"hello");
                    drop(s);
                    std::thread::sleep(Duration::from_millis(50));
                }
                println!("batch {b}");
                while !std::path::Path::new(&format!("{go}.{b}")).exists() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            println!("done");
        }
        "connect_from_threads" => {
            // `t` threads at once, each making `n` connections to the port one after the
            // other (each echoing five bytes), on one CPU, every thread, as a benchmark pins
            // its client: the threads that make streams ahead share it with the program.
            let (port, t, n) =
                (args[0].parse::<u16>().unwrap(), args[1].parse::<usize>().unwrap(), args[2].parse::<usize>().unwrap());
            let mut one = rustix::thread::CpuSet::new();
            one.set(0);
            for task in std::fs::read_dir("/proc/self/task").unwrap() {
                let tid = task.unwrap().file_name().to_string_lossy().parse::<i32>().unwrap();
                let _ = rustix::thread::sched_setaffinity(rustix::process::Pid::from_raw(tid), &one);
            }
            let start = std::sync::Arc::new(std::sync::Barrier::new(t));
            let threads: Vec<_> = (0..t)
                .map(|_| {
                    let start = start.clone();
                    std::thread::spawn(move || {
                        start.wait();
                        for _ in 0..n {
                            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                            s.write_all(b"hello").unwrap();
                            let mut r = [0u8; 5];
                            s.read_exact(&mut r).unwrap();
                            assert_eq!(&r, b"hello");
                        }
                    })
                })
                .collect();
            for h in threads {
                h.join().unwrap();
            }
            println!("done");
        }
        "connect_while_stopped" => {
            // One connection to the port (the server is then known), then, once the file
            // `go` exists (the server stopped meanwhile), two more: `a` non-blocking, waited
            // for in epoll; `b` blocking. Each echoes five bytes once the server runs again.
            let (port, go) = (args[0].parse::<u16>().unwrap(), &args[1]);
            let echo = |s: &mut TcpStream, what: &[u8; 5]| {
                s.write_all(what).unwrap();
                let mut r = [0u8; 5];
                s.read_exact(&mut r).unwrap();
                assert_eq!(&r, what);
            };
            // (a few, apart: the next one's stream is made ahead meanwhile, `spares.rs`)
            for _ in 0..3 {
                echo(&mut TcpStream::connect(("127.0.0.1", port)).unwrap(), b"first");
                std::thread::sleep(Duration::from_millis(100));
            }
            println!("first ok");
            while !std::path::Path::new(go).exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            // (through the C library, as a program's `connect` goes: interposed)
            // SAFETY: a socket of our own; the address and its length are a `sockaddr_in`'s.
            let a = unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0);
                assert!(fd >= 0);
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: port.to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() },
                    sin_zero: [0; 8],
                };
                let r = libc::connect(
                    fd,
                    (&sin as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                );
                let e = std::io::Error::last_os_error();
                assert!(r == 0 || e.raw_os_error() == Some(libc::EINPROGRESS), "{e}");
                <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd)
            };
            println!("connected a");
            // Nothing goes before the server's answer: while it is stopped, the connection is
            // not writable. (Its stream made ahead, `connect` returned at once; else it waited
            // for the server to make one.)
            let early = (&a).write(b"sentA");
            match &early {
                Ok(n) => assert_eq!(*n, 5),
                Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}"),
            }
            eprintln!("a: {}", if early.is_ok() { "written at once" } else { "waits for the answer" });
            let mut b = TcpStream::connect(("127.0.0.1", port)).unwrap();
            println!("connected b");
            let mut poll = mio::Poll::new().unwrap();
            let mut a = mio::net::TcpStream::from_std(a);
            poll.registry().register(&mut a, mio::Token(1), mio::Interest::WRITABLE).unwrap();
            let mut events = mio::Events::with_capacity(4);
            while events.is_empty() {
                poll.poll(&mut events, None).unwrap();
            }
            let mut a = TcpStream::from(std::os::fd::OwnedFd::from(a));
            a.set_nonblocking(false).unwrap();
            if early.is_err() {
                a.write_all(b"sentA").unwrap();
            }
            let mut r = [0u8; 5];
            a.read_exact(&mut r).unwrap();
            assert_eq!(&r, b"sentA");
            println!("a ok");
            echo(&mut b, b"sentB");
            println!("b ok");
        }
        "await_a_dead_server" => {
            // Connections to the port (the server is then known, its streams made ahead),
            // then, once the file `go` exists (the server stopped, and killed after), one
            // more: its connect, write and read must each end, however.
            let (port, go) = (args[0].parse::<u16>().unwrap(), &args[1]);
            for _ in 0..3 {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.write_all(b"first").unwrap();
                let mut r = [0u8; 5];
                s.read_exact(&mut r).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
            println!("first ok");
            while !std::path::Path::new(go).exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            match TcpStream::connect(("127.0.0.1", port)) {
                Err(e) => eprintln!("connect: {e}"),
                Ok(mut s) => {
                    println!("connected");
                    let w = s.write_all(b"lost!");
                    let mut r = [0u8; 5];
                    let got = s.read(&mut r);
                    eprintln!("write: {w:?}, read: {got:?}");
                    assert!(w.is_err() || got.is_err() || matches!(got, Ok(0)), "{w:?} {got:?}");
                }
            }
            println!("ended");
        }
        "connect_n" => {
            // Connections to the port, one after the other, each echoing five bytes; before
            // the `from`-th, wait for the file `go` to exist.
            let (port, n, from, go) =
                (args[0].parse::<u16>().unwrap(), args[1].parse().unwrap(), args[2].parse().unwrap(), &args[3]);
            for i in 0..n {
                if i == from {
                    println!("waiting");
                    while !std::path::Path::new(go).exists() {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.write_all(b"hello").unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                assert_eq!(&b, b"hello");
            }
            println!("connected {n}");
        }
        "silent_streams" => {
            // Claim a connection to the server (any TCP socket of ours will do), learn its
            // runtime's clan address from the answer, connect clan streams there and send
            // nothing on them.
            use std::os::fd::AsFd;
            let (port, n): (u16, usize) = (args[0].parse().unwrap(), args[1].parse().unwrap());
            let chan =
                clan_shm::seqpacket::SeqPacket::connect_abstract(format!("clan-run/127.0.0.1:{port}").as_bytes())
                    .unwrap();
            let sock = TcpListener::bind("127.0.0.1:0").unwrap();
            chan.send(b"CLAIM\x01\x02\x03\x04\x05\x06\x07\x08", &[sock.as_fd()]).unwrap();
            let mut buf = [0u8; 256];
            let m = chan.recv(&mut buf).unwrap();
            let r = &buf[..m.len];
            assert!(r.starts_with(b"OK") && r.len() > 2, "the claim was refused");
            let addr: clan::EndpointAddr = std::str::from_utf8(&r[2..]).unwrap().parse().unwrap();
            let nic = clan::Nic::open_default().unwrap();
            let q = nic.event_queue(clan::EventQueueConfig::default()).unwrap();
            let cfg = clan_proto::stream::StreamConfig::default();
            // (The runtime drops them at once: a connect may fail for it. Half bring no data,
            // half three bytes where a token is eight.)
            let _held: Vec<_> = (0..n)
                .filter_map(|i| {
                    let data: &[u8] = if i % 2 == 0 { &[] } else { b"abc" };
                    clan_proto::stream::Stream::connect_to_with_data(&nic, addr, &cfg, &q, data).ok()
                })
                .collect();
            println!("silent {n}");
            std::thread::sleep(Duration::from_secs(50));
        }
        "claim_then_kernel" => {
            // Claim a kernel socket of ours (a token we choose) as a clan-run client would,
            // and, with `stream`, bring the token in a clan stream of ours at once; print the
            // token and the server's clan address, wait for `go`, then connect the socket
            // with the kernel and talk: over our stream if we brought one (the server must
            // have taken it), else over the kernel (the server must read our bytes there,
            // whoever brought our token in a stream).
            use std::os::fd::AsFd;
            let (port, go, own_stream) = (args[0].parse::<u16>().unwrap(), &args[1], args[2] == "stream");
            let chan =
                clan_shm::seqpacket::SeqPacket::connect_abstract(format!("clan-run/127.0.0.1:{port}").as_bytes())
                    .unwrap();
            let sock =
                rustix::net::socket(rustix::net::AddressFamily::INET, rustix::net::SocketType::STREAM, None).unwrap();
            rustix::net::bind(&sock, &"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap()).unwrap();
            let token = 0x5eed_0000_0000_0001u64;
            let mut msg = b"CLAIM".to_vec();
            msg.extend_from_slice(&token.to_le_bytes());
            chan.send(&msg, &[sock.as_fd()]).unwrap();
            let mut buf = [0u8; 256];
            let m = chan.recv(&mut buf).unwrap();
            let r = &buf[..m.len];
            assert!(r.starts_with(b"OK") && r.len() > 2, "the claim was refused");
            let addr = std::str::from_utf8(&r[2..]).unwrap().to_string();
            let nic = clan::Nic::open_default().unwrap();
            let q = nic.event_queue(clan::EventQueueConfig::default()).unwrap();
            let mine = own_stream.then(|| {
                let cfg = clan_proto::stream::StreamConfig::default();
                let to: clan::EndpointAddr = addr.parse().unwrap();
                clan_proto::stream::Stream::connect_to_with_data(&nic, to, &cfg, &q, &token.to_le_bytes()).unwrap()
            });
            println!("claimed {token} {addr}");
            while !std::path::Path::new(go).exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            rustix::net::connect(&sock, &format!("127.0.0.1:{port}").parse::<std::net::SocketAddr>().unwrap()).unwrap();
            if let Some(mut s) = mine {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut hello = [0u8; 6];
                s.read_exact(&mut hello).expect("the server's greeting over our stream");
                assert_eq!(&hello, b"hello\n");
                s.write_all(b"mine!").unwrap();
                let mut back = [0u8; 5];
                s.read_exact(&mut back).unwrap();
                assert_eq!(&back, b"mine!");
                s.shutdown(Shutdown::Write).unwrap();
                assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0);
                println!("stream ok");
                return;
            }
            let mut s = TcpStream::from(sock);
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut hello = [0u8; 6];
            s.read_exact(&mut hello).expect("the server's greeting over the kernel");
            assert_eq!(&hello, b"hello\n");
            s.write_all(b"mine!").unwrap();
            let mut back = [0u8; 5];
            s.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"mine!");
            s.shutdown(Shutdown::Write).unwrap();
            assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0);
            println!("kernel ok");
        }
        "stream_with_token" => {
            // Connect a clan stream to a runtime, bringing a token that is not ours, and say
            // what the server sends on it (it must send nothing: the stream is not taken).
            let (addr, token): (clan::EndpointAddr, u64) = (args[0].parse().unwrap(), args[1].parse().unwrap());
            let nic = clan::Nic::open_default().unwrap();
            let q = nic.event_queue(clan::EventQueueConfig::default()).unwrap();
            let cfg = clan_proto::stream::StreamConfig::default();
            // (A stream that comes after the claimant's may be dropped before its connect
            // returns.)
            let mut s =
                match clan_proto::stream::Stream::connect_to_with_data(&nic, addr, &cfg, &q, &token.to_le_bytes()) {
                    Ok(s) => s,
                    Err(e) => {
                        println!("stream dropped at once ({e})");
                        println!("got nothing");
                        return;
                    }
                };
            println!("stream connected");
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut b = [0u8; 6];
            match s.read(&mut b) {
                Ok(0) | Err(_) => println!("got nothing"),
                Ok(n) => println!("got {}", String::from_utf8_lossy(&b[..n])),
            }
        }
        "stale_queue_server" => {
            // Three connections in an epoll set, each closed without leaving the set; then
            // one never added to it, waited on with `poll` by another thread (which arms its
            // queue's descriptor) while the main thread waits on the set, which holds only a
            // pipe nobody writes: how often those waits return, and their CPU time.
            use std::os::fd::AsRawFd;
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            // SAFETY: epoll and poll calls on our own descriptors and buffers.
            let ep = unsafe { libc::epoll_create1(0) };
            assert!(ep >= 0);
            let add = |fd: i32, data: u64| {
                let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: data };
                // SAFETY: as above.
                assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
            };
            let wait = |ms: i32| -> i32 {
                let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 8];
                // SAFETY: as above.
                unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 8, ms) }
            };
            for i in 0..3 {
                let (mut s, _) = l.accept().unwrap();
                add(s.as_raw_fd(), i);
                assert!(wait(20_000) >= 1, "connection {i} never became readable");
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
                assert_eq!(s.read(&mut b).unwrap(), 0);
                drop(s);
            }
            let (mut b, _) = l.accept().unwrap();
            let echo = std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                loop {
                    let mut p = libc::pollfd { fd: b.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: as above.
                    unsafe { libc::poll(&mut p, 1, 20_000) };
                    let n = b.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    b.write_all(&buf[..n]).unwrap();
                }
            });
            let mut pipe = [0i32; 2];
            // SAFETY: as above.
            assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
            add(pipe[0], 99);
            let cpu = || {
                // SAFETY: as above (a struct of plain integers).
                let mut u: libc::rusage = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
                let t =
                    |v: libc::timeval| Duration::from_secs(v.tv_sec as u64) + Duration::from_micros(v.tv_usec as u64);
                t(u.ru_utime) + t(u.ru_stime)
            };
            let (cpu0, start) = (cpu(), Instant::now());
            let mut waits = 0;
            while start.elapsed() < Duration::from_millis(1500) {
                assert_eq!(wait(100), 0, "the set reported an event");
                waits += 1;
            }
            println!("waits {waits} cpu_ms {}", (cpu() - cpu0).as_millis());
            echo.join().unwrap();
        }
        "stale_queue_client" => {
            // Three connections closed after one echo, then one that echoes every 10 ms for
            // 2.5 s.
            let port: u16 = args[0].parse().unwrap();
            for _ in 0..3 {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.write_all(b"hello").unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
            }
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            for _ in 0..250 {
                s.write_all(b"again").unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                std::thread::sleep(Duration::from_millis(10));
            }
            println!("client done");
        }
        "echo_client" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            // The descriptor is the kernel's socket: its names and options are the kernel's.
            assert_eq!(s.peer_addr().unwrap().port(), port, "getpeername");
            assert!(s.local_addr().unwrap().ip().is_loopback(), "getsockname");
            s.set_nodelay(true).unwrap();
            assert!(s.nodelay().unwrap(), "TCP_NODELAY");
            assert!(s.take_error().unwrap().is_none(), "SO_ERROR");
            let mut hello = [0u8; 6];
            s.read_exact(&mut hello).unwrap();
            assert_eq!(&hello, b"hello\n");
            let data = pattern(1 << 20, port.into());
            let mut back = vec![0u8; data.len()];
            let mut sent = 0;
            let mut got = 0;
            let mut sizes = pattern(4096, 7).into_iter().cycle();
            while got < data.len() {
                if sent < data.len() && sent - got < 32768 {
                    let k = (usize::from(sizes.next().unwrap()) * 97 + 1).min(data.len() - sent);
                    s.write_all(&data[sent..sent + k]).unwrap();
                    sent += k;
                    continue;
                }
                got += s.read(&mut back[got..sent]).unwrap();
            }
            assert!(back == data, "the echo differs");
            s.shutdown(Shutdown::Write).unwrap();
            assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "end of stream after the echo");
            println!("client ok");
        }
        "mio_server" => {
            // Non-blocking sockets under edge-triggered epoll (mio): echo every connection.
            use mio::net::TcpListener;
            use mio::{Events, Interest, Poll, Token};
            let mut l = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let mut poll = Poll::new().unwrap();
            poll.registry().register(&mut l, Token(0), Interest::READABLE).unwrap();
            let mut events = Events::with_capacity(64);
            let mut conns = std::collections::HashMap::new();
            let want: usize = args[0].parse().unwrap();
            let mut done = 0;
            let mut next = 1;
            while done < want {
                poll.poll(&mut events, Some(Duration::from_secs(30))).unwrap();
                assert!(!events.is_empty(), "the server waited 30 s for nothing");
                for ev in events.iter() {
                    if ev.token() == Token(0) {
                        while let Ok((mut s, _)) = l.accept() {
                            poll.registry()
                                .register(&mut s, Token(next), Interest::READABLE | Interest::WRITABLE)
                                .unwrap();
                            conns.insert(next, (s, Vec::<u8>::new()));
                            next += 1;
                        }
                        continue;
                    }
                    let t = ev.token().0;
                    let Some((s, pending)) = conns.get_mut(&t) else { continue };
                    let mut closed = false;
                    let mut buf = [0u8; 16384];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) => {
                                closed = true;
                                break;
                            }
                            Ok(n) => pending.extend_from_slice(&buf[..n]),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) => panic!("read: {e}"),
                        }
                    }
                    while !pending.is_empty() {
                        match s.write(pending) {
                            Ok(n) => {
                                pending.drain(..n);
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) => panic!("write: {e}"),
                        }
                    }
                    if closed && pending.is_empty() {
                        conns.remove(&t);
                        done += 1;
                    }
                }
            }
            println!("served {done}");
        }
        "plain_client" => {
            let port: u16 = args[0].parse().unwrap();
            let n: usize = args[1].parse().unwrap();
            let threads: Vec<_> = (0..n)
                .map(|i| {
                    std::thread::spawn(move || {
                        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                        let data = pattern(200_000 + i * 1000, i as u64 + 1);
                        let mut back = vec![0u8; data.len()];
                        let w = {
                            let mut s2 = s.try_clone().unwrap();
                            let d = data.clone();
                            std::thread::spawn(move || {
                                s2.write_all(&d).unwrap();
                                s2.shutdown(Shutdown::Write).unwrap();
                            })
                        };
                        s.read_exact(&mut back).unwrap();
                        w.join().unwrap();
                        assert!(back == data, "connection {i}: the echo differs");
                        assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            println!("clients ok");
        }
        "blocked_reader" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            println!("connected");
            let start = Instant::now();
            let mut buf = [0u8; 64];
            // The server is killed while we wait: end of stream or a reset, quickly.
            let r = loop {
                match s.read(&mut buf) {
                    Ok(0) => break "eof".to_string(),
                    Ok(_) => continue,
                    Err(e) => break format!("{:?}", e.kind()),
                }
            };
            println!("reader woke {r} after {} ms", start.elapsed().as_millis());
        }
        "silent_server" => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let (_s, _) = l.accept().unwrap();
            println!("accepted");
            std::thread::sleep(Duration::from_secs(60));
        }
        "fork_server" => {
            // Accept, read the start of the request, fork: the child serves the rest (it
            // echoes the whole request, then a second one). The parent closes its copy at
            // once ("early") or after the child has been using it for a while ("late").
            let late = args[0] == "late";
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let (mut s, _) = l.accept().unwrap();
            let mut first = vec![0u8; 1000];
            s.read_exact(&mut first).unwrap();
            // SAFETY: fork; the child only reads, writes and exits (no locks of other
            // threads are needed: the C library's allocator is fork-safe).
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                drop(l);
                let mut req = first;
                req.resize(100_000, 0);
                s.read_exact(&mut req[1000..]).unwrap();
                s.write_all(&req).unwrap();
                let mut second = vec![0u8; 50_000];
                s.read_exact(&mut second).unwrap();
                s.write_all(&second).unwrap();
                s.shutdown(Shutdown::Write).unwrap();
                // SAFETY: ending the child without running the parent's atexit work.
                unsafe { libc::_exit(0) };
            }
            if late {
                std::thread::sleep(Duration::from_millis(300));
            }
            drop(s);
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child failed: {status}");
            println!("served by a child");
        }
        "fork_client" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let req = pattern(100_000, 11);
            s.write_all(&req).unwrap();
            let mut back = vec![0u8; req.len()];
            s.read_exact(&mut back).unwrap();
            assert!(back == req, "the first echo differs");
            let second = pattern(50_000, 12);
            s.write_all(&second).unwrap();
            let mut back = vec![0u8; second.len()];
            s.read_exact(&mut back).unwrap();
            assert!(back == second, "the second echo differs");
            assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "end of stream after the echo");
            println!("client ok");
        }
        "exec_server" => {
            // inetd's way: accept, read the start of the request, then `cat` serves the
            // connection as its standard input and output, in a forked child ("fork") or
            // in this very process ("self").
            let in_child = args[0] == "fork";
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let (mut s, _) = l.accept().unwrap();
            let mut first = [0u8; 10];
            s.read_exact(&mut first).unwrap();
            use std::os::fd::AsRawFd;
            let fd = s.as_raw_fd();
            let cat = c"/bin/cat";
            let argv = [cat.as_ptr(), std::ptr::null()];
            // SAFETY: fork (or not); the child dups the socket onto 0 and 1 and execs cat.
            let pid = if in_child { unsafe { libc::fork() } } else { 0 };
            if pid == 0 {
                // SAFETY: plain descriptor calls, then exec with a null-terminated argv.
                unsafe {
                    libc::dup2(fd, 0);
                    libc::dup2(fd, 1);
                    libc::execv(cat.as_ptr(), argv.as_ptr());
                    libc::_exit(127);
                }
            }
            drop(s);
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "cat failed: {status}");
            println!("served by cat");
        }
        "cat_client" => {
            // Everything after the first 10 bytes comes back (cat echoes), then the end.
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let req = pattern(300_000, 21);
            let mut r = s.try_clone().unwrap();
            let rest = req[10..].to_vec();
            let reader = std::thread::spawn(move || {
                let mut back = Vec::new();
                r.read_to_end(&mut back).unwrap();
                back
            });
            s.write_all(&req).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            let back = reader.join().unwrap();
            assert_eq!(back.len(), rest.len(), "bytes echoed");
            assert!(back == rest, "the echo differs");
            println!("client ok");
        }
        "masked_waiter" => {
            // SIGUSR1 blocked; each wait unblocks it with its signal mask (ppoll, pselect,
            // epoll_pwait) on an accelerated connection with nothing to read: the signal,
            // sent meanwhile, interrupts the wait (EINTR) and its handler runs.
            use std::os::fd::AsRawFd;
            use std::sync::atomic::{AtomicUsize, Ordering};
            static HANDLED: AtomicUsize = AtomicUsize::new(0);
            extern "C" fn on_usr1(_: libc::c_int) {
                HANDLED.fetch_add(1, Ordering::SeqCst);
            }
            let port: u16 = args[0].parse().unwrap();
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let fd = s.as_raw_fd();
            // SAFETY: signal-set and handler set-up with valid pointers; the handler only
            // touches an atomic.
            let (block, empty) = unsafe {
                let mut b: libc::sigset_t = std::mem::zeroed();
                let mut e: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut b);
                libc::sigaddset(&mut b, libc::SIGUSR1);
                libc::sigemptyset(&mut e);
                libc::pthread_sigmask(libc::SIG_BLOCK, &b, std::ptr::null_mut());
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_usr1 as *const () as usize;
                libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
                (b, e)
            };
            let _ = block;
            let ep = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC).unwrap();
            rustix::event::epoll::add(
                &ep,
                &s,
                rustix::event::epoll::EventData::new_u64(1),
                rustix::event::epoll::EventFlags::IN,
            )
            .unwrap();
            for how in ["ppoll", "pselect", "epoll_pwait"] {
                let before = HANDLED.load(Ordering::SeqCst);
                // (to this thread: a process-directed signal may go to any thread that does
                // not block it, such as the test harness's)
                // SAFETY: our own thread's id.
                let me = unsafe { libc::pthread_self() } as usize;
                let kicker = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(200));
                    // SAFETY: a signal to a thread of ours that is alive (it joins us).
                    unsafe { libc::pthread_kill(me as libc::pthread_t, libc::SIGUSR1) };
                });
                let start = Instant::now();
                // SAFETY: valid arrays, sets and timeouts for each call.
                let (r, err) = unsafe {
                    let ts = libc::timespec { tv_sec: 20, tv_nsec: 0 };
                    let r = match how {
                        "ppoll" => {
                            let mut p = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
                            libc::ppoll(p.as_mut_ptr(), 1, &ts, &empty)
                        }
                        "pselect" => {
                            let mut set: libc::fd_set = std::mem::zeroed();
                            libc::FD_ZERO(&mut set);
                            libc::FD_SET(fd, &mut set);
                            libc::pselect(fd + 1, &mut set, std::ptr::null_mut(), std::ptr::null_mut(), &ts, &empty)
                        }
                        _ => {
                            let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
                            libc::epoll_pwait(ep.as_raw_fd(), evs.as_mut_ptr(), 4, 20_000, &empty)
                        }
                    };
                    (r, std::io::Error::last_os_error())
                };
                kicker.join().unwrap();
                let ms = start.elapsed().as_millis();
                assert_eq!(r, -1, "{how} returned {r} after {ms} ms");
                assert_eq!(err.raw_os_error(), Some(libc::EINTR), "{how}: {err}");
                assert!(HANDLED.load(Ordering::SeqCst) > before, "{how}: the handler did not run");
                println!("{how} interrupted after {ms} ms");
            }
            println!("masks ok");
        }
        "scm_server" => {
            // Accept over clan, read the start, pass the connection to another process over
            // a Unix socket (SCM_RIGHTS), close ours.
            let to = args[0].clone();
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let (mut s, _) = l.accept().unwrap();
            let mut hello = [0u8; 5];
            s.read_exact(&mut hello).unwrap();
            assert_eq!(&hello, b"hello");
            let u = std::os::unix::net::UnixStream::connect(&to).unwrap();
            // (the C library's sendmsg, as programs call it: rustix's would bypass clan run)
            use std::os::fd::AsRawFd;
            // SAFETY: a message header over our own buffers, its control part built with the
            // C library's macros within the space they said.
            let r = unsafe {
                let mut byte = *b"x";
                let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
                let space = libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as usize;
                let mut control = vec![0u8; space];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = space;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), s.as_raw_fd());
                libc::sendmsg(u.as_raw_fd(), &msg, 0)
            };
            assert_eq!(r, 1, "sendmsg: {}", std::io::Error::last_os_error());
            drop(s);
            println!("passed");
            // Stay until the receiver is done (its peer must be able to take back).
            let mut done = [0u8; 1];
            let _ = (&u).read(&mut done);
        }
        "scm_receiver" => {
            let path = args[0].clone();
            let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
            println!("listening");
            let (u, _) = l.accept().unwrap();
            let mut space = vec![std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut anc = rustix::net::RecvAncillaryBuffer::new(&mut space);
            let mut b = [0u8; 1];
            rustix::net::recvmsg(
                &u,
                &mut [std::io::IoSliceMut::new(&mut b)],
                &mut anc,
                rustix::net::RecvFlags::empty(),
            )
            .unwrap();
            let mut got = None;
            for m in anc.drain() {
                if let rustix::net::RecvAncillaryMessage::ScmRights(mut fds) = m {
                    got = fds.next();
                }
            }
            let mut s = TcpStream::from(got.expect("a descriptor"));
            // Echo 20 000 bytes, then the end.
            let mut buf = vec![0u8; 20_000];
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            (&u).write_all(b"d").unwrap();
            println!("echoed");
        }
        "scm_client" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let data = pattern(20_000, 31);
            s.write_all(b"hello").unwrap();
            s.write_all(&data[..8000]).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            s.write_all(&data[8000..]).unwrap();
            let mut back = Vec::new();
            s.read_to_end(&mut back).unwrap();
            assert!(back == data, "the echo differs ({} bytes back)", back.len());
            println!("client ok");
        }
        "epoll_first_client" => {
            // The socket goes into an epoll set before its (non-blocking) connect: the set
            // must report what arrives over clan (echo_server greets first, then echoes).
            let port: u16 = args[0].parse().unwrap();
            // SAFETY: plain socket calls on our own descriptors and buffers.
            unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0);
                assert!(fd >= 0);
                let ep = libc::epoll_create1(0);
                let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: 7 };
                assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
                let mut sa: libc::sockaddr_in = std::mem::zeroed();
                sa.sin_family = libc::AF_INET as libc::sa_family_t;
                sa.sin_port = port.to_be();
                sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
                let r = libc::connect(fd, (&raw const sa).cast(), size_of::<libc::sockaddr_in>() as u32);
                assert!(r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EINPROGRESS));
                let wait_in = || {
                    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
                    let n = libc::epoll_wait(ep, evs.as_mut_ptr(), 4, 20_000);
                    assert!(n >= 1, "the epoll set saw nothing (n = {n})");
                    assert_eq!({ evs[0].u64 }, 7, "the application's data");
                };
                let read_exact = |buf: &mut [u8]| {
                    let mut got = 0;
                    while got < buf.len() {
                        let n = libc::read(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got);
                        if n > 0 {
                            got += n as usize;
                        } else {
                            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EAGAIN));
                            wait_in();
                        }
                    }
                };
                let mut hello = [0u8; 6];
                read_exact(&mut hello);
                assert_eq!(&hello, b"hello\n");
                let msg = pattern(1000, 41);
                let mut sent = 0;
                while sent < msg.len() {
                    let n = libc::write(fd, msg[sent..].as_ptr().cast(), msg.len() - sent);
                    assert!(n > 0, "write: {}", std::io::Error::last_os_error());
                    sent += n as usize;
                }
                let mut back = vec![0u8; msg.len()];
                read_exact(&mut back);
                assert!(back == msg, "the echo differs");
                libc::shutdown(fd, libc::SHUT_WR);
                libc::close(fd);
                libc::close(ep);
            }
            println!("client ok");
        }
        "prefork_server" => {
            // A connection claimed by a clan-run client is waiting in the accept queue when
            // the server forks; the child accepts it (the parent never does).
            use std::os::fd::AsRawFd;
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let mut p = [libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            // SAFETY: poll on our listener; fork, the child serving one connection and exiting.
            let pid = unsafe {
                assert_eq!(libc::poll(p.as_mut_ptr(), 1, 20_000), 1, "no connection came");
                libc::fork()
            };
            assert!(pid >= 0);
            if pid == 0 {
                let (mut s, _) = l.accept().unwrap();
                let mut req = vec![0u8; 10_000];
                s.read_exact(&mut req).unwrap();
                s.write_all(&req).unwrap();
                // SAFETY: ending the child.
                unsafe { libc::_exit(0) };
            }
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child failed: {status}");
            println!("served by a child");
        }
        "prefork_client" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let req = pattern(10_000, 51);
            s.write_all(&req).unwrap();
            let mut back = vec![0u8; req.len()];
            s.read_exact(&mut back).unwrap();
            assert!(back == req, "the echo differs");
            println!("client ok");
        }
        "bgsave_server" => {
            // A connection over clan, then a fork whose child never touches it and exits (as
            // redis's background save does); the connection stays accelerated, and once the
            // child is gone, new connections are claimed again. Then: echo 5 bytes per
            // connection until one says "stop!".
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            let (mut first, _) = l.accept().unwrap();
            // SAFETY: fork; the child sleeps and exits.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                std::thread::sleep(Duration::from_millis(200));
                // SAFETY: ending the child.
                unsafe { libc::_exit(0) };
            }
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            let mut b = [0u8; 5];
            first.read_exact(&mut b).unwrap();
            first.write_all(&b).unwrap();
            println!("child gone");
            loop {
                let (mut s, _) = l.accept().unwrap();
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
                if &b == b"stop!" {
                    break;
                }
            }
            println!("server done");
        }
        "echo5_client" => {
            let port: u16 = args[0].parse().unwrap();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(args[1].as_bytes()).unwrap();
            let mut b = [0u8; 5];
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, args[1].as_bytes());
            println!("client ok");
        }
        "sem_server" => sem::server(),
        "sem_client" => sem::client(args[0].parse().unwrap()),
        other => panic!("unknown role {other}"),
    }
}

fn over_clan(err: &str) -> usize {
    err.matches("over clan").count()
}

fn went_over(err: &str) -> usize {
    err.matches("went over to the kernel").count()
}

/// The threads `clan run` adds to a server sleep while it waits: no period of theirs wakes
/// them (they woke 15 times a second: the claims thread every 200 ms to see whether its
/// listener closed, the runtime's accepting thread every 100 ms).
#[test]
fn an_idle_servers_threads_sleep() {
    let mut server = Proc::spawn("idle_listener", &[], true);
    let wakes: u64 = server.expect("wakes").parse().unwrap();
    let err = server.finish(Duration::from_secs(60));
    assert!(err.contains("registered"), "the listener was registered: {err}");
    // (a wake or two for work that came in the while: none is periodic)
    assert!(wakes <= 2, "the clan-run threads woke {wakes} times in 3 s of idling");
}

/// A server that forks after accepting, its child serving the connection: the bytes the
/// parent had not read when it forked, and everything after, reach the child exactly once,
/// in order (the connection goes over to the kernel's socket, both sides following), whether
/// the parent closes its copy at once or after the child has been using it.
#[test]
fn a_server_that_forks_after_accepting() {
    for when in ["early", "late"] {
        let mut server = Proc::spawn("fork_server", &[when], true);
        let port = server.expect("port");
        let mut client = Proc::spawn("fork_client", &[&port], true);
        client.expect("client ok");
        let cerr = client.finish(Duration::from_secs(60));
        server.expect("served by a child");
        let serr = server.finish(Duration::from_secs(60));
        assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "{when}: client: {cerr}\nserver: {serr}");
        assert_eq!((went_over(&cerr), went_over(&serr)), (1, 1), "{when}: client: {cerr}\nserver: {serr}");
    }
}

/// A socket added to an epoll set before its non-blocking `connect` made it an accelerated
/// connection: the set reports its readiness from clan (a server that speaks first).
#[test]
fn a_socket_in_an_epoll_set_before_it_connects() {
    let mut server = Proc::spawn("echo_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("epoll_first_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    server.expect("echoed");
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
    assert!(cerr.contains("before it was accelerated: moved"), "{cerr}");
}

/// `ppoll`, `pselect` and `epoll_pwait` on an accelerated connection apply their signal
/// mask while they sleep: a signal the mask unblocks interrupts them (EINTR), its handler
/// having run.
#[test]
fn signal_masks_of_ppoll_pselect_and_epoll_pwait() {
    let mut server = Proc::spawn("silent_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("masked_waiter", &[&port], true);
    client.expect("masks ok");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(over_clan(&cerr), 1, "{cerr}");
}

/// A connection passed to another process with `SCM_RIGHTS` goes over to the kernel's
/// socket first: the receiver gets every byte the passer had not read, and the rest.
#[test]
fn a_connection_passed_with_scm_rights() {
    let path = std::env::temp_dir().join(format!("clan-run-scm-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let p = path.to_str().unwrap();
    let mut receiver = Proc::spawn("scm_receiver", &[p], true);
    receiver.expect("listening");
    let mut server = Proc::spawn("scm_server", &[p], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("scm_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    receiver.expect("echoed");
    server.expect("passed");
    let serr = server.finish(Duration::from_secs(60));
    let _ = receiver.finish(Duration::from_secs(60));
    let _ = std::fs::remove_file(&path);
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
    assert_eq!((went_over(&cerr), went_over(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
}

/// Idle accelerated connections cost next to no CPU: a reader blocked on one, and its
/// server, each use under 1 % of a CPU over two seconds (they spin briefly, then sleep).
#[test]
fn idle_connections_cost_no_cpu() {
    fn cpu_ms(pid: u32) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split(' ').collect();
        // utime and stime (fields 14 and 15; 12 and 13 after the name), in clock ticks.
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        let hz = rustix::param::clock_ticks_per_second();
        ticks * 1000 / hz
    }
    let mut server = Proc::spawn("silent_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("blocked_reader", &[&port], true);
    client.expect("connected");
    server.expect("accepted");
    std::thread::sleep(Duration::from_millis(200));
    let (s0, c0) = (cpu_ms(server.child.id()), cpu_ms(client.child.id()));
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let wall = start.elapsed().as_millis() as u64;
    let (s1, c1) = (cpu_ms(server.child.id()), cpu_ms(client.child.id()));
    assert!(
        (s1 - s0) * 100 <= wall && (c1 - c0) * 100 <= wall,
        "CPU over {wall} ms: server {} ms, client {} ms",
        s1 - s0,
        c1 - c0
    );
}

/// A connection a clan-run client claimed, still in the accept queue when the server forks,
/// accepted by the child: the parent hands its clan stream over, and the bytes come over the
/// kernel to the child.
#[test]
fn a_claimed_connection_accepted_by_a_forked_child() {
    let mut server = Proc::spawn("prefork_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("prefork_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    server.expect("served by a child");
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!(over_clan(&cerr), 1, "client: {cerr}\nserver: {serr}");
    assert_eq!((went_over(&cerr), went_over(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
}

/// A fork whose child never touches the connections (redis's background save): they stay
/// accelerated, and once the child is gone the listener takes claims again.
#[test]
fn a_fork_that_leaves_connections_alone() {
    let mut server = Proc::spawn("bgsave_server", &[], true);
    let port = server.expect("port");
    // The first connection: made before the fork, used after it.
    let first = std::thread::spawn({
        let port = port.clone();
        move || {
            let mut c = Proc::spawn("echo5_client", &[&port, "first"], true);
            c.expect("client ok");
            c.finish(Duration::from_secs(60))
        }
    });
    server.expect("child gone");
    let cerr = first.join().unwrap();
    assert_eq!((over_clan(&cerr), went_over(&cerr)), (1, 0), "the first connection stays over clan: {cerr}");
    // New connections: over clan again once the parent has seen its child go (a bounded
    // number of tries: that happens on a thread of the parent, soon after).
    let mut again = false;
    for _ in 0..100 {
        let mut c = Proc::spawn("echo5_client", &[&port, "again"], true);
        c.expect("client ok");
        if over_clan(&c.finish(Duration::from_secs(60))) == 1 {
            again = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut stop = Proc::spawn("echo5_client", &[&port, "stop!"], false);
    stop.expect("client ok");
    stop.finish(Duration::from_secs(60));
    server.expect("server done");
    let serr = server.finish(Duration::from_secs(60));
    assert!(again, "claims were not resumed after the child went: {serr}");
}

/// An accelerated connection survives `exec` (inetd's way: `cat` serves it as its standard
/// input and output), in a forked child or in the accepting process itself: every byte
/// after what the server read first comes back, once, in order, then the end.
#[test]
fn exec_with_an_accelerated_socket_falls_back_transparently() {
    for how in ["fork", "self"] {
        let mut server = Proc::spawn("exec_server", &[how], true);
        let port = server.expect("port");
        let mut client = Proc::spawn("cat_client", &[&port], true);
        client.expect("client ok");
        let cerr = client.finish(Duration::from_secs(60));
        if how == "fork" {
            server.expect("served by cat");
        }
        let serr = server.finish(Duration::from_secs(60));
        assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "{how}: client: {cerr}\nserver: {serr}");
        assert_eq!(went_over(&cerr), 1, "{how}: client: {cerr}\nserver: {serr}");
    }
}

/// Both sides under `clan run`: the bytes go over clan, identical, in order; a server that
/// speaks first does not deadlock; end of stream both ways.
#[test]
fn blocking_sockets_both_sides_over_clan() {
    let mut server = Proc::spawn("echo_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("echo_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(server.expect("echoed"), (1 << 20).to_string());
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
}

/// A claimed connection that waits in the listener's backlog longer than claims used to
/// live (30 s) still goes over clan on both sides when the server accepts it. (Its claim
/// had expired: the server took the kernel's connection while the client sent over clan,
/// and both waited for good.)
#[test]
fn a_connection_accepted_late_still_goes_over_clan() {
    let mut server = Proc::spawn("echo_server", &["33"], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("echo_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(server.expect("echoed"), (1 << 20).to_string());
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
}

/// A client claims its connections to a server on one channel to the server's registry,
/// kept between connections; when that server is gone and another listens on the same port,
/// the kept channel (closed by the first server's end) is given up and a new one made: every
/// connection goes over clan.
#[test]
fn a_claim_channel_kept_for_a_server_that_went_is_replaced() {
    let go = std::env::temp_dir().join(format!("clan-run-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut first = Proc::spawn("serve_n", &["0", "3"], true);
    let port = first.expect("port");
    let mut client = Proc::spawn("connect_n", &[&port, "5", "3", go.to_str().unwrap()], true);
    client.expect("waiting");
    first.expect("served 3");
    let ferr = first.finish(Duration::from_secs(60));
    let mut second = Proc::spawn("serve_n", &[&port, "2"], true);
    second.expect("port");
    std::fs::write(&go, b"").unwrap();
    client.expect("connected 5");
    let cerr = client.finish(Duration::from_secs(60));
    second.expect("served 2");
    let serr = second.finish(Duration::from_secs(60));
    let _ = std::fs::remove_file(&go);
    assert_eq!(
        (over_clan(&cerr), over_clan(&ferr), over_clan(&serr)),
        (5, 3, 2),
        "client: {cerr}\nfirst server: {ferr}\nsecond server: {serr}"
    );
}

/// A server whose listeners share their port (`SO_REUSEPORT`, two of them): the kernel
/// hands each connection to either, so they share one registration, and every connection
/// goes over clan whichever listener accepts it. (Each used to register alone: the second
/// failed, and a claimed connection handed to it was taken for a plain one while its client
/// sent over clan, which then waited for good. Then neither was registered.)
#[test]
fn listeners_that_share_their_port_in_one_process_share_their_claims() {
    let mut server = Proc::spawn("reuseport_server", &["20"], true);
    let port = server.expect("port");
    let go = std::env::temp_dir().join(format!("clan-run-reuseport-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut client = Proc::spawn_every_connection("connect_n", &[&port, "20", "99", go.to_str().unwrap()]);
    client.expect("connected 20");
    let cerr = client.finish(Duration::from_secs(60));
    server.expect("served 20");
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (20, 20), "client: {cerr}\nserver: {serr}");
    assert!(serr.contains("registered with the others"), "{serr}");
}

/// A port shared (`SO_REUSEPORT`) by a clan-run server and a process not under clan: the
/// kernel may hand a connection to either, so the clan-run server takes no claim while the
/// other listens (it looks at the port's listeners for each), and every connection goes
/// over the kernel, echoed by whichever got it.
#[test]
fn a_port_shared_with_another_process_leaves_its_connections_to_the_kernel() {
    let mut server = Proc::spawn("reuseport_server", &["0"], true);
    let port = server.expect("port");
    let mut other = Proc::spawn("reuseport_server", &["0", &port], false);
    other.expect("port");
    let go = std::env::temp_dir().join(format!("clan-run-reuseport2-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut client = Proc::spawn("connect_n", &[&port, "20", "99", go.to_str().unwrap()], true);
    client.expect("connected 20");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(over_clan(&cerr), 0, "{cerr}");
    assert_eq!(cerr.matches("the listener declined").count(), 20, "{cerr}");
}

/// A client that writes and closes long before the server accepts: its stream, ended, waits
/// for the `accept` (the server's runtime drops ended streams no claim names, not this one:
/// `registry.rs::Filed::sweep`), and the server reads what was sent.
#[test]
fn a_connection_that_ended_before_its_accept_keeps_its_bytes() {
    let mut server = Proc::spawn("late_reader", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("write_and_close", &[&port], true);
    client.expect("sent");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(server.expect("read"), "hello");
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
}

/// A client whose connections to a server make one exchange each (a connection per request)
/// has its next ones stay with the kernel once the last eight were short (`short.rs`), but
/// for a probe now and then (after 64, then 128…) that goes over clan to look again; both
/// sides agree on every connection,
/// and every byte is echoed. (Over clan, such a client ran at a quarter of its kernel
/// speed: `redis-benchmark -k 0`.)
#[test]
fn short_connections_stay_with_the_kernel_but_for_probes() {
    let mut server = Proc::spawn("echo_each_until_killed", &[], true);
    let port = server.expect("port");
    let server_err = server.stderr_at_end();
    let mut client = Proc::spawn("connect_turns", &[&port, "200:1"], true);
    client.expect("connected 200");
    let cerr = client.finish(Duration::from_secs(60));
    let _ = server.child.kill();
    let _ = server.child.wait();
    let serr = server_err.join().unwrap();
    let over = over_clan(&cerr);
    let kept = cerr.matches("left to the kernel: its connections are short").count();
    let probes = cerr.matches("this one is a probe").count();
    // (the first eight, then a probe after 64: 9 when every close is recorded at once)
    assert!((8..=24).contains(&over) && over + kept == 200, "over clan {over}, kept with the kernel {kept}: {cerr}");
    assert!(probes >= 1 && cerr.contains("are short"), "probes {probes}: {cerr}");
    assert_eq!(over_clan(&serr), over, "the server took another number over clan: {serr}");
    assert_eq!(went_over(&cerr), 0, "{cerr}");
}

/// Connections that make many exchanges, or move many bytes in one, pay for their set-up:
/// they all go over clan, and the server is never found short. With `CLAN_RUN_MIN_TURNS=0`,
/// one-exchange connections all go over clan too.
#[test]
fn connections_that_carry_enough_stay_over_clan() {
    let mut server = Proc::spawn("echo_each_until_killed", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("connect_turns", &[&port, "20:10,12:1:300000"], true);
    client.expect("connected 32");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(over_clan(&cerr), 32, "{cerr}");
    assert!(!cerr.contains("short"), "{cerr}");
    let mut client = Proc::spawn_every_connection("connect_turns", &[&port, "30:1"]);
    client.expect("connected 30");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(over_clan(&cerr), 30, "{cerr}");
    assert!(!cerr.contains("short"), "{cerr}");
}

/// A client found short whose connections then make many exchanges is back over clan after
/// two probes that paid (the first 128 connections into the second phase, the next 64
/// after it).
#[test]
fn a_short_servers_connections_go_back_over_clan_when_they_grow() {
    let mut server = Proc::spawn("echo_each_until_killed", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("connect_turns", &[&port, "100:1,400:10"], true);
    client.expect("phase 100:1 done");
    client.expect("connected 500");
    let cerr = client.finish(Duration::from_secs(120));
    let (short_at, back_at) = (cerr.find("are short"), cerr.find("not short any more"));
    assert!(matches!((short_at, back_at), (Some(a), Some(b)) if a < b), "{cerr}");
    // (two probes in the second phase, then the rest: about 240)
    let over = over_clan(&cerr);
    assert!(over >= 150, "over clan {over}: {cerr}");
}

/// A client that connects again and again to one server has its next connection's clan
/// stream made ahead (`spares.rs`): later connections take one instead of making theirs in
/// `connect`. The spares it lets go unused (they expire) are dropped by the server's runtime
/// too: batch after batch, the server's descriptors come back to where they were.
#[test]
fn a_client_that_connects_again_and_again_has_its_streams_made_ahead() {
    let go = std::env::temp_dir().join(format!("clan-run-spares-{}", std::process::id()));
    let mut server = Proc::spawn("serve_until_killed", &[], true);
    let port = server.expect("port");
    let spid = server.child.id();
    let fds = || std::fs::read_dir(format!("/proc/{spid}/fd")).unwrap().count();
    let batches = 5;
    let mut client =
        Proc::spawn_every_connection("connect_batches", &[&port, &batches.to_string(), "10", go.to_str().unwrap()]);
    let mut after = Vec::new();
    for b in 0..batches {
        client.expect(&format!("batch {b}"));
        eprintln!("batch {b}");
        // (its spares expire unused, `spares::TTL`, and the server's runtime drops them
        // within a second of their end)
        std::thread::sleep(Duration::from_secs(4));
        after.push(fds());
        std::fs::write(format!("{}.{b}", go.display()), b"").unwrap();
    }
    client.expect("done");
    let cerr = client.finish(Duration::from_secs(60));
    for b in 0..batches {
        let _ = std::fs::remove_file(format!("{}.{b}", go.display()));
    }
    assert_eq!(over_clan(&cerr), 50, "{cerr}");
    let ahead = cerr.matches("made ahead").count();
    assert!(ahead >= 1, "no connection took a stream made ahead: {cerr}");
    // (a few for the queues the server keeps for new connections, whose number moves: a
    // spare kept for good would cost four or five a batch)
    assert!(after[batches - 1] <= after[0] + 8, "the server's descriptors after each batch: {after:?}");
}

/// A client whose threads connect to one server at once, faster than one stream's set-up
/// at a time, has more spares kept for it, made by helper threads too (`spares.rs`); every
/// connection still carries its own bytes over clan. (Two were kept, made by one thread,
/// whatever the demand.)
#[test]
fn a_client_that_connects_from_many_threads_has_more_streams_made_ahead() {
    let mut server = Proc::spawn("serve_until_killed", &[], true);
    let port = server.expect("port");
    let (t, n) = (8, 12);
    let mut client = Proc::spawn_every_connection("connect_from_threads", &[&port, &t.to_string(), &n.to_string()]);
    client.expect("done");
    let cerr = client.finish(Duration::from_secs(120));
    drop(server);
    assert_eq!(over_clan(&cerr), t * n, "{cerr}");
    assert!(!cerr.contains("left to the kernel"), "{cerr}");
    let kept: Vec<usize> = cerr
        .lines()
        .filter_map(|l| l.split("spares kept for ").nth(1))
        .filter_map(|l| l.rsplit(": ").next()?.trim().parse().ok())
        .collect();
    assert!(kept.iter().any(|k| *k > 2), "never more than two spares kept: {kept:?}\n{cerr}");
    assert!(cerr.contains("a helper joins"), "no helper made spares: {cerr}");
    assert!(cerr.contains("made ahead"), "{cerr}");
}

/// A client connecting to a server that is stopped (`SIGSTOP`: a debugger, a pause) neither
/// blocks in `connect` nor gives up: its claim's answer comes when the server runs again, and
/// until then the connection awaits it (not writable; a blocking write waits). (It used to wait
/// in `connect` for the answer, 5 s at most, then go to the kernel, while the server, once
/// running again, took the claim and the clan stream: the two ends disagreed, and the
/// connection's bytes were never read.)
#[test]
fn a_connection_to_a_stopped_server_waits_for_it_and_keeps_its_bytes() {
    let go = std::env::temp_dir().join(format!("clan-run-stopped-{}", std::process::id()));
    let mut server = Proc::spawn("serve_until_killed", &[], true);
    let port = server.expect("port");
    let spid = server.child.id() as i32;
    let mut client = Proc::spawn("connect_while_stopped", &[&port, go.to_str().unwrap()], true);
    client.expect("first ok");
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGSTOP) }, 0);
    std::fs::write(&go, b"").unwrap();
    // (longer than the client's channel ever waited for an answer)
    std::thread::sleep(Duration::from_secs(6));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGCONT) }, 0);
    client.expect("connected a");
    client.expect("connected b");
    client.expect("a ok");
    client.expect("b ok");
    let cerr = client.finish(Duration::from_secs(60));
    let _ = std::fs::remove_file(&go);
    assert_eq!(over_clan(&cerr), 5, "{cerr}");
    assert!(!cerr.contains("left to the kernel") && went_over(&cerr) == 0, "{cerr}");
}

/// A server that dies (stopped, then killed) while a client's connection awaits its claim's
/// answer: the client's calls end (the answer's channel closes with the server, and the
/// connection goes to the kernel's socket, which the server's end reset), never hang.
#[test]
fn a_server_that_dies_before_answering_ends_its_clients_calls() {
    let go = std::env::temp_dir().join(format!("clan-run-dead-{}", std::process::id()));
    let mut server = Proc::spawn("serve_until_killed", &[], true);
    let port = server.expect("port");
    let spid = server.child.id() as i32;
    let mut client = Proc::spawn("await_a_dead_server", &[&port, go.to_str().unwrap()], true);
    client.expect("first ok");
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGSTOP) }, 0);
    std::fs::write(&go, b"").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGKILL) }, 0);
    let _ = server.child.wait();
    client.expect("ended");
    let cerr = client.finish(Duration::from_secs(60));
    let _ = std::fs::remove_file(&go);
    eprintln!("{cerr}");
}

/// A client whose descriptor limit is 1024 (2048 hard) holds 400 connections at once, as it
/// may over the kernel: while there is room in clan's share of the descriptors (half of
/// those above a floor), its connections go over clan (about eight descriptors each); past
/// that they stay with the kernel (one each). (Without that share, clan's descriptors filled
/// every number up to the limit, and the program met `EMFILE` at a quarter of the
/// connections.)
#[test]
fn connections_past_the_descriptors_clan_may_take_stay_with_the_kernel() {
    let mut server = Proc::spawn("serve_hold", &["400"], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("connect_hold", &[&port, "400"], true);
    client.expect("held 400");
    server.expect("served 400");
    let cerr = client.finish(Duration::from_secs(60));
    let serr = server.finish(Duration::from_secs(60));
    let over = over_clan(&cerr);
    let (short, declined) = (cerr.matches("few descriptors left").count(), cerr.matches("listener declined").count());
    assert!(
        (10..200).contains(&over) && over + short + declined == 400,
        "over clan {over}, kept for the kernel {short}, declined by the server {declined}: {cerr}"
    );
    assert_eq!(over_clan(&serr), over, "{serr}");
}

/// A process that connects clan streams to a server's runtime without tokens, or with
/// tokens of the wrong size, and holds them (anyone may reach the runtime's listener) costs
/// only its own streams: a claimed connection made meanwhile still goes over clan on both
/// sides and carries every byte. (The runtime's thread once waited for each stream's token
/// in turn, up to 5 s each: behind sixteen silent streams, the claimant's own stream waited
/// 80 s to be accepted, past the children's 60 s watchdog. The token now travels in the
/// stream's connect hand-shake, and a stream without one is dropped at once.)
#[test]
fn silent_streams_to_the_runtime_hold_up_nobody() {
    let mut server = Proc::spawn("echo_server", &[], true);
    let port = server.expect("port");
    let mut silent = Proc::spawn("silent_streams", &[&port, "16"], false);
    silent.expect("silent 16");
    let mut client = Proc::spawn("echo_client", &[&port], true);
    client.expect("client ok");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(server.expect("echoed"), (1 << 20).to_string());
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (1, 1), "client: {cerr}\nserver: {serr}");
    drop(silent);
}

/// A stream that brings a claimed connection's token but comes from another user (a process
/// as `nobody` that learned it) is never taken. Before the claimant's own stream: the
/// server's `accept` gives the connection to the kernel and reads the claimant's bytes there.
/// After it: the claimant's stream, filed first, carries the connection. Either way the
/// stranger's stream gets nothing. (The runtime once took any stream with a known token, the
/// last to come replacing the first, and tokens were a counter.)
#[test]
fn a_stream_from_another_user_with_a_claimed_token_is_not_taken() {
    for (mode, done) in [("kernel", "kernel ok"), ("stream", "stream ok")] {
        let Some(mut nobody) = unprivileged() else { return };
        let go = std::env::temp_dir().join(format!("clan-run-token-go-{}-{mode}", std::process::id()));
        let _ = std::fs::remove_file(&go);
        let mut server = Proc::spawn("echo_server", &[], true);
        let port = server.expect("port");
        let mut claimant = Proc::spawn("claim_then_kernel", &[&port, go.to_str().unwrap(), mode], false);
        let claimed = claimant.expect("claimed");
        let (token, addr) = claimed.split_once(' ').unwrap();
        let mut stranger = Proc::from_command(&mut nobody, "stream_with_token", &[addr, token]);
        stranger.expect("stream");
        std::fs::write(&go, b"").unwrap();
        claimant.expect(done);
        let _ = std::fs::remove_file(&go);
        assert_eq!(server.expect("echoed"), "5", "{mode}");
        let serr = server.finish(Duration::from_secs(60));
        if mode == "kernel" {
            assert_eq!(over_clan(&serr), 0, "server: {serr}");
            assert!(serr.contains("came from another user"), "server: {serr}");
        } else {
            assert_eq!(over_clan(&serr), 1, "server: {serr}");
        }
        assert_eq!(stranger.expect("got"), "nothing", "{mode}");
        claimant.finish(Duration::from_secs(60));
    }
}

/// A connection's queue outlives it (the next connection reuses it), and so does its place
/// in the epoll sets the connection was in: a reused queue made readable for a connection not
/// in the set wakes the set, and left there it would wake every wait on it at once. The
/// first wake-up through a queue no member of the set has takes it out: waits on the set
/// sleep their whole timeout, and the waiting thread's CPU time stays small. (Checked with
/// the removal taken out: the waits spin.)
#[test]
fn a_closed_connections_queue_left_in_an_epoll_set_does_not_wake_it_for_good() {
    let mut server = Proc::spawn("stale_queue_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("stale_queue_client", &[&port], true);
    let got = server.expect("waits");
    client.expect("client done");
    let cerr = client.finish(Duration::from_secs(60));
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (4, 4), "client: {cerr}\nserver: {serr}");
    let (waits, cpu) = got.split_once(" cpu_ms ").unwrap();
    let (waits, cpu): (u32, u64) = (waits.parse().unwrap(), cpu.parse().unwrap());
    // 1.5 s of 100 ms waits: 15 or fewer, and little CPU (a spinning wait takes most of it).
    assert!(waits <= 30 && cpu < 500, "{waits} waits, {cpu} ms of CPU: {serr}");
}

/// A C program (`tests/run/echo.c`: a server thread with epoll, a client with poll, 64-byte
/// round trips over loopback TCP) under `clan run` and valgrind's memcheck, `clan` and the
/// program both traced: its connection goes over clan, every byte comes back, and memcheck
/// finds no read or write of memory the program or the preloaded library does not own.
#[test]
fn a_c_program_over_clan_under_memcheck() {
    if !have("valgrind") || !have("cc") {
        return;
    }
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/run/echo.c");
    let exe = std::env::temp_dir().join(format!("clan-run-echo-{}", std::process::id()));
    let cc = Command::new("cc").args(["-O1", "-g", "-o"]).arg(&exe).arg(src).arg("-lpthread").output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new("timeout")
        .args(["300", "valgrind", "--trace-children=yes", "--tool=memcheck", "-q", "--error-exitcode=99", CLAN])
        .args(["run", "--"])
        .arg(&exe)
        .arg("200")
        .env("CLAN_RUN_DEBUG", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&exe);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok 200",
        "under memcheck ({}): {}\n{err}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(over_clan(&err) >= 1, "the connection went over clan: {err}");
}

/// The scenarios where the preloaded library does the most with descriptors and memory
/// (a connection passed with `SCM_RIGHTS`, a server that forks after accepting, an `exec`
/// with an accelerated socket) run again, this test binary and every process it starts
/// under memcheck (`--trace-children`): every one passes, and no process's log reports an
/// error.
#[test]
fn preload_scenarios_under_memcheck() {
    if !have("valgrind") {
        return;
    }
    let logs = std::env::temp_dir().join(format!("clan-run-memcheck-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let exe = std::env::current_exe().unwrap();
    for t in [
        "a_connection_passed_with_scm_rights",
        "a_server_that_forks_after_accepting",
        "exec_with_an_accelerated_socket_falls_back_transparently",
    ] {
        let out = Command::new("timeout")
            .args(["600", "valgrind", "--trace-children=yes", "--tool=memcheck", "-q"])
            .arg(format!("--log-file={}/{t}.%p.log", logs.display()))
            .arg(&exe)
            .args([t, "--exact", "--test-threads=1"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{t} under memcheck ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A log line of an error names it ("Invalid read of size 4", "Conditionally jump …",
    // "Syscall param … points to unaddressable byte(s)", …); valgrind's own notes about
    // system calls it does not know are not errors.
    let mut errors = Vec::new();
    for f in std::fs::read_dir(&logs).unwrap() {
        let path = f.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let noted = |l: &&str| {
            ["unhandled amd64-linux syscall", "You may be able", "README_MISSING", "Nevertheless we", "it at http"]
                .iter()
                .any(|n| l.contains(n))
        };
        let lines: Vec<&str> =
            text.lines().filter(|l| !noted(l) && l.trim_start_matches(|c| c != ' ').trim() != "").collect();
        if !lines.is_empty() {
            errors.push(format!("{}:\n{}", path.display(), lines.join("\n")));
        }
    }
    let _ = std::fs::remove_dir_all(&logs);
    assert!(errors.is_empty(), "memcheck reported:\n{}", errors.join("\n\n"));
}

/// Only one side under `clan run`: exactly as without clan (the kernel's connection).
#[test]
fn one_side_only_stays_with_the_kernel() {
    for (srv, cli) in [(true, false), (false, true)] {
        let mut server = Proc::spawn("echo_server", &[], srv);
        let port = server.expect("port");
        let mut client = Proc::spawn("echo_client", &[&port], cli);
        client.expect("client ok");
        let cerr = client.finish(Duration::from_secs(60));
        server.expect("echoed");
        let serr = server.finish(Duration::from_secs(60));
        assert_eq!(over_clan(&cerr) + over_clan(&serr), 0, "client: {cerr}\nserver: {serr}");
    }
}

/// Non-blocking sockets under edge-triggered epoll (mio) on the server, many connections at
/// once from threads of a blocking client: all over clan, every byte echoed.
#[test]
fn edge_triggered_epoll_server_over_clan() {
    const N: usize = 8;
    let mut server = Proc::spawn("mio_server", &[&N.to_string()], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("plain_client", &[&port, &N.to_string()], true);
    client.expect("clients ok");
    let cerr = client.finish(Duration::from_secs(60));
    assert_eq!(server.expect("served"), N.to_string());
    let serr = server.finish(Duration::from_secs(60));
    assert_eq!((over_clan(&cerr), over_clan(&serr)), (N, N), "client: {cerr}\nserver: {serr}");
}

/// A reader blocked on an accelerated connection whose peer is SIGKILLed wakes within a
/// second with end of stream or a reset.
#[test]
fn a_killed_peer_ends_a_blocked_read() {
    let mut server = Proc::spawn("silent_server", &[], true);
    let port = server.expect("port");
    let mut client = Proc::spawn("blocked_reader", &[&port], true);
    client.expect("connected");
    server.expect("accepted");
    std::thread::sleep(Duration::from_millis(100));
    let _ = server.child.kill();
    let woke = client.expect("reader woke");
    let ms: u64 = woke.rsplit(' ').nth(1).unwrap().parse().unwrap();
    assert!(woke.starts_with("eof") || woke.contains("Reset") || woke.contains("Broken"), "{woke}");
    assert!(ms < 1000 + 100 + 500, "the reader woke after {ms} ms");
    let cerr = client.finish(Duration::from_secs(30));
    assert_eq!(over_clan(&cerr), 1, "{cerr}");
}

/// redis (when installed): a 1 MiB value set and read back byte-identical, with clan on both
/// sides and with a plain client.
#[test]
fn redis_over_clan() {
    if Command::new("redis-server").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI installs redis-server");
        eprintln!("redis-server is not installed: skipped");
        return;
    }
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let mut server = Command::new(CLAN)
        .args(["run", "--", "redis-server", "--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .env("CLAN_RUN_DEBUG", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _kill = KillOnDrop(&mut server);
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "redis did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let value: String = pattern(1 << 20, 99).iter().map(|b| char::from(b'a' + b % 26)).collect();
    let cli = |clan: bool, args: &[&str], input: Option<&str>| -> String {
        let mut c = if clan {
            let mut c = Command::new(CLAN);
            c.args(["run", "--", "redis-cli"]);
            c
        } else {
            Command::new("redis-cli")
        };
        let mut ch = c
            .args(["-p", &port])
            .args(args)
            .env("CLAN_RUN_DEBUG", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = ch.stdin.take().unwrap();
        if let Some(i) = input {
            stdin.write_all(i.as_bytes()).unwrap();
        }
        drop(stdin);
        let out = ch.wait_with_output().unwrap();
        assert!(out.status.success(), "redis-cli failed: {}", String::from_utf8_lossy(&out.stderr));
        if clan {
            assert_eq!(over_clan(&String::from_utf8_lossy(&out.stderr)), 1, "redis-cli was not over clan");
        }
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(cli(true, &["-x", "SET", "big"], Some(&value)).trim(), "OK");
    assert!(cli(true, &["GET", "big"], None).trim_end_matches('\n') == value, "the value read back over clan differs");
    assert!(
        cli(false, &["GET", "big"], None).trim_end_matches('\n') == value,
        "the value read back by a plain client differs"
    );
}

struct KillOnDrop<'a>(&'a mut Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// sockperf (when installed): ping-pong and throughput over TCP with both sides under
/// `clan run`, the connection over clan. (`--mps`: sockperf sizes its table of sequence
/// numbers for 600 000 messages/s unless told more, and clan goes faster.)
#[test]
fn sockperf_over_clan() {
    if Command::new("sockperf").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI installs sockperf");
        eprintln!("sockperf is not installed: skipped");
        return;
    }
    for mode in ["ping-pong", "throughput"] {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port().to_string()
        };
        let mut server = Command::new(CLAN)
            .args(["run", "--", "sockperf", "server", "--tcp", "-i", "127.0.0.1", "-p", &port])
            .env("CLAN_RUN_DEBUG", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "sockperf server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        // (that probe connection was a plain one: the client below is the clan one)
        let out = Command::new("timeout")
            .args([
                "60",
                CLAN,
                "run",
                "--",
                "sockperf",
                mode,
                "--tcp",
                "-i",
                "127.0.0.1",
                "-p",
                &port,
                "-t",
                "1",
                "-m",
                "64",
                "--mps",
                "5000000",
            ])
            .env("CLAN_RUN_DEBUG", "1")
            .output()
            .unwrap();
        let _ = server.kill();
        let _ = server.wait();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "sockperf {mode} failed: {text}");
        assert!(!text.contains("ERROR"), "sockperf {mode}: {text}");
        assert_eq!(over_clan(&text), 1, "sockperf {mode} was not over clan: {text}");
        let want = if mode == "ping-pong" { "avg-latency" } else { "Message Rate" };
        assert!(text.contains(want), "sockperf {mode} reported nothing: {text}");
    }
}

/// A command that runs this test binary as `nobody` (through `setpriv`), for the tests of
/// what another user can do. None when we are not root (the test is then skipped; under `CI`,
/// which runs as root, that is a failure).
fn unprivileged() -> Option<Command> {
    if !rustix::process::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root: this test cannot be skipped");
        eprintln!("not root: cannot run a child as another user; skipped");
        return None;
    }
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]).arg(std::env::current_exe().unwrap());
    Some(c)
}

fn have(prog: &str) -> bool {
    let ok = Command::new("sh").args(["-c", &format!("command -v {prog}")]).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "CI installs {prog}");
        eprintln!("{prog} is not installed: skipped");
    }
    ok
}

/// nginx (when installed) serving a large file: curl under `clan run` gets identical bytes
/// over clan, a plain curl too; wrk under `clan run` runs without a socket error. nginx with a
/// master and a worker (it forks after listening) also serves identical bytes: after a fork
/// the connections are the kernel's (`docs/ARCHITECTURE.md`).
#[test]
fn nginx_curl_and_wrk_over_clan() {
    if !(have("nginx") && have("curl") && have("wrk")) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("clan-nginx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("html")).unwrap();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let big = pattern(4 << 20, 5);
    std::fs::write(dir.join("html/big.bin"), &big).unwrap();
    std::fs::write(dir.join("html/small.txt"), b"hello\n").unwrap();
    for forking in [false, true] {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let d = dir.display();
        let conf = format!(
            "daemon off;\nmaster_process {};\nworker_processes 1;\nerror_log {d}/error.log;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\nhttp {{ access_log off; sendfile on;\n\
             client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;\n\
             uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;\n\
             server {{ listen 127.0.0.1:{port}; root {d}/html; }} }}\n",
            if forking { "on" } else { "off" }
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let mut server = Command::new(CLAN)
            .args(["run", "--", "nginx", "-p"])
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let _kill = KillOnDrop(&mut server);
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "nginx did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let url = format!("http://127.0.0.1:{port}/big.bin");
        for clan in [true, false] {
            let mut c = if clan {
                let mut c = Command::new(CLAN);
                c.args(["run", "--", "curl"]);
                c
            } else {
                Command::new("curl")
            };
            let out = c.args(["-s", "--max-time", "30", &url]).env("CLAN_RUN_DEBUG", "1").output().unwrap();
            assert!(out.status.success(), "curl failed: {}", String::from_utf8_lossy(&out.stderr));
            assert!(out.stdout == big, "curl (clan: {clan}, forking nginx: {forking}) got different bytes");
            let over = over_clan(&String::from_utf8_lossy(&out.stderr));
            assert_eq!(over, usize::from(clan && !forking), "curl over clan (clan: {clan}, forking nginx: {forking})");
        }
        if !forking {
            let out = Command::new("timeout")
                .args(["60", CLAN, "run", "--", "wrk", "-t1", "-c4", "-d1s"])
                .arg(format!("http://127.0.0.1:{port}/small.txt"))
                .env("CLAN_RUN_DEBUG", "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "wrk failed: {text}");
            assert!(text.contains("Requests/sec"), "wrk: {text}");
            assert!(!text.contains("Socket errors"), "wrk saw socket errors over clan: {text}");
            assert!(over_clan(&text) >= 4, "wrk's connections were not over clan: {text}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The calls programs make, each checked against what the kernel does: the same two roles
/// run under `clan run` (both sides over clan) and without it (the kernel's TCP), and must
/// pass both ways.
mod sem {
    use std::io::Error;

    use libc::c_int;

    fn errno() -> i32 {
        Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    pub fn write_all(fd: c_int, b: &[u8]) {
        let mut done = 0;
        while done < b.len() {
            // SAFETY: libc calls on our own descriptors, with buffers and structures that live
            // across each call and lengths that match them.
            let n = unsafe { libc::write(fd, b[done..].as_ptr().cast(), b.len() - done) };
            assert!(n > 0, "write: {}", Error::last_os_error());
            done += n as usize;
        }
    }

    /// Read exactly `n` bytes (blocking descriptor).
    pub fn read_n(fd: c_int, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        let mut got = 0;
        while got < n {
            // SAFETY: libc calls on our own descriptors, with buffers and structures that live
            // across each call and lengths that match them.
            let k = unsafe { libc::read(fd, v[got..].as_mut_ptr().cast(), n - got) };
            assert!(k > 0, "read {got}/{n}: {} ({})", k, Error::last_os_error());
            got += k as usize;
        }
        v
    }

    fn poll1(fd: c_int, events: i16, ms: c_int) -> i16 {
        let mut p = [libc::pollfd { fd, events, revents: 0 }];
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        let n = unsafe { libc::poll(p.as_mut_ptr(), 1, ms) };
        assert!(n >= 0, "poll: {}", Error::last_os_error());
        p[0].revents
    }

    fn select_read(fd: c_int, ms: i64) -> c_int {
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        unsafe {
            let mut set: libc::fd_set = std::mem::zeroed();
            libc::FD_ZERO(&mut set);
            libc::FD_SET(fd, &mut set);
            let mut tv = libc::timeval { tv_sec: ms / 1000, tv_usec: (ms % 1000) * 1000 };
            let n = libc::select(fd + 1, &mut set, std::ptr::null_mut(), std::ptr::null_mut(), &mut tv);
            assert!(n >= 0, "select: {}", Error::last_os_error());
            if n == 1 {
                assert!(libc::FD_ISSET(fd, &set));
            }
            n
        }
    }

    fn epoll_wait1(ep: c_int, ms: c_int) -> c_int {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 4, ms) };
        assert!(n >= 0, "epoll_wait: {}", Error::last_os_error());
        if n > 0 {
            assert_eq!({ evs[0].u64 }, 99, "the data of the registration");
        }
        n
    }

    pub fn server() {
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        unsafe {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            use std::os::fd::AsRawFd;
            let fd = libc::accept4(
                l.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            );
            assert!(fd >= 0, "accept4: {}", Error::last_os_error());
            assert_ne!(libc::fcntl(fd, libc::F_GETFL) & libc::O_NONBLOCK, 0, "accept4's SOCK_NONBLOCK");
            assert_ne!(libc::fcntl(fd, libc::F_GETFD) & libc::FD_CLOEXEC, 0, "accept4's SOCK_CLOEXEC");
            // 1. writev arrives whole: poll, FIONREAD, MSG_PEEK, MSG_DONTWAIT, EAGAIN.
            assert_ne!(poll1(fd, libc::POLLIN, 20_000) & libc::POLLIN, 0);
            let mut avail: c_int = 0;
            for _ in 0..2000 {
                assert_eq!(libc::ioctl(fd, libc::FIONREAD, &mut avail), 0);
                if avail >= 6 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert_eq!(avail, 6, "FIONREAD");
            let mut b = [0u8; 16];
            assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 3, libc::MSG_PEEK), 3);
            assert_eq!(&b[..3], b"abc", "MSG_PEEK");
            assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 16, libc::MSG_DONTWAIT), 6);
            assert_eq!(&b[..6], b"abcdef");
            assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 16, 0), -1);
            assert_eq!(errno(), libc::EAGAIN, "non-blocking, nothing there");
            // 2. Blocking again (fcntl), MSG_WAITALL across two writes.
            let fl = libc::fcntl(fd, libc::F_GETFL);
            assert_eq!(libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK), 0);
            write_all(fd, b"g");
            assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 10, libc::MSG_WAITALL), 10, "MSG_WAITALL");
            assert_eq!(&b[..10], b"0123456789");
            // 3. Duplicates write to the same connection.
            let d1 = libc::dup(fd);
            assert_eq!(libc::dup2(fd, 700), 700);
            assert_eq!(libc::dup3(fd, 701, libc::O_CLOEXEC), 701);
            assert_ne!(libc::fcntl(701, libc::F_GETFD) & libc::FD_CLOEXEC, 0, "dup3's O_CLOEXEC");
            let d4 = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 710);
            assert!(d1 >= 0 && d4 >= 710);
            for (d, c) in [(d1, b"x"), (700, b"y"), (701, b"z"), (d4, b"w")] {
                write_all(d, c);
            }
            // 4. recvmsg scatters what sendmsg gathered.
            let (mut p1, mut p2) = ([0u8; 5], [0u8; 6]);
            let mut iov = [
                libc::iovec { iov_base: p1.as_mut_ptr().cast(), iov_len: 5 },
                libc::iovec { iov_base: p2.as_mut_ptr().cast(), iov_len: 6 },
            ];
            let mut got = 0usize;
            while got < 11 {
                let mut msg: libc::msghdr = std::mem::zeroed();
                // (what is left of the two buffers)
                let mut rest: Vec<libc::iovec> = Vec::new();
                let mut skip = got;
                for v in iov.iter_mut() {
                    if skip >= v.iov_len {
                        skip -= v.iov_len;
                        continue;
                    }
                    rest.push(libc::iovec {
                        iov_base: v.iov_base.cast::<u8>().add(skip).cast(),
                        iov_len: v.iov_len - skip,
                    });
                    skip = 0;
                }
                msg.msg_iov = rest.as_mut_ptr();
                msg.msg_iovlen = rest.len();
                let n = libc::recvmsg(fd, &mut msg, 0);
                assert!(n > 0, "recvmsg: {}", Error::last_os_error());
                got += n as usize;
            }
            assert_eq!((&p1, &p2), (b"hello", b" world"), "recvmsg");
            // 5. select: nothing, then something.
            assert_eq!(select_read(fd, 0), 0, "select with nothing to read");
            write_all(fd, b"g");
            assert_eq!(select_read(fd, 20_000), 1, "select");
            assert_eq!(read_n(fd, 1), b"s");
            // 6. Closing duplicates does not end the connection.
            for d in [d1, 700, 701, d4] {
                assert_eq!(libc::close(d), 0);
            }
            write_all(fd, b"g");
            assert_eq!(read_n(fd, 1), b"q");
            // 7. epoll: one-shot, then edge-triggered.
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, u64: 99 };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
            write_all(fd, b"g");
            assert_eq!(epoll_wait1(ep, 20_000), 1, "one-shot fires");
            assert_eq!(epoll_wait1(ep, 100), 0, "one-shot fired already");
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev), 0);
            assert_eq!(epoll_wait1(ep, 20_000), 1, "re-armed");
            assert_eq!(read_n(fd, 1), b"1");
            let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 99 };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev), 0);
            write_all(fd, b"g");
            assert_eq!(epoll_wait1(ep, 20_000), 1, "an edge");
            assert_eq!(epoll_wait1(ep, 100), 0, "no new edge");
            write_all(fd, b"g");
            assert_eq!(epoll_wait1(ep, 20_000), 1, "a new edge");
            // (both bytes, maybe not at once)
            assert_eq!(read_n(fd, 2), b"23");
            // 7b. Level-triggered, the wake-up taken by a blocking read: epoll still reports
            // the next byte (a quiet member is looked at again only when its queue wakes the
            // set, or whoever takes that wake-up says so), and again until it is read.
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 99 };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev), 0);
            assert_eq!(epoll_wait1(ep, 100), 0, "nothing yet");
            write_all(fd, b"g");
            assert_eq!(read_n(fd, 1), b"4", "the first byte, waited for");
            assert_eq!(epoll_wait1(ep, 20_000), 1, "the second byte, 300 ms later");
            assert_eq!(epoll_wait1(ep, 100), 1, "until it is read");
            assert_eq!(read_n(fd, 1), b"5");
            assert_eq!(epoll_wait1(ep, 100), 0, "read");
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()), 0);
            libc::close(ep);
            // 8. The client shuts down writing: end of stream here, and we still write.
            write_all(fd, b"g");
            assert_ne!(poll1(fd, libc::POLLIN, 20_000) & libc::POLLIN, 0, "end of stream is readable");
            assert_eq!(libc::read(fd, b.as_mut_ptr().cast(), 16), 0, "end of stream");
            write_all(fd, b"after");
            // 9. Gone: the client's writes fail with EPIPE (SIGPIPE unless MSG_NOSIGNAL).
            assert_eq!(libc::close(fd), 0);
            println!("server ok");
        }
    }

    pub fn client(port: u16) {
        static PIPES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        extern "C" fn on_pipe(_: c_int) {
            PIPES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        unsafe {
            let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            use std::os::fd::IntoRawFd;
            let fd = s.into_raw_fd();
            let mut b = [0u8; 16];
            // 1.
            let iov = [
                libc::iovec { iov_base: b"ab".as_ptr() as *mut _, iov_len: 2 },
                libc::iovec { iov_base: b"cdef".as_ptr() as *mut _, iov_len: 4 },
            ];
            assert_eq!(libc::writev(fd, iov.as_ptr(), 2), 6, "writev");
            // 2.
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"01234");
            std::thread::sleep(std::time::Duration::from_millis(50));
            write_all(fd, b"56789");
            // 3. Four bytes, read with readv into two buffers.
            let mut got = Vec::new();
            while got.len() < 4 {
                let (mut a, mut c) = ([0u8; 2], [0u8; 2]);
                let iov = [
                    libc::iovec { iov_base: a.as_mut_ptr().cast(), iov_len: 2 },
                    libc::iovec { iov_base: c.as_mut_ptr().cast(), iov_len: 2 },
                ];
                let n = libc::readv(fd, iov.as_ptr(), 2) as usize;
                assert!(n > 0 && n <= 4 - got.len(), "readv: {n}");
                got.extend_from_slice(&a[..n.min(2)]);
                got.extend_from_slice(&c[..n.saturating_sub(2)]);
            }
            assert_eq!(got, b"xyzw");
            // 4.
            let iov = [
                libc::iovec { iov_base: b"hello".as_ptr() as *mut _, iov_len: 5 },
                libc::iovec { iov_base: b" world".as_ptr() as *mut _, iov_len: 6 },
            ];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_ptr() as *mut _;
            msg.msg_iovlen = 2;
            assert_eq!(libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL), 11, "sendmsg");
            // 5.
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"s");
            // 6.
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"q");
            // 7.
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"1");
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"2");
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"3");
            assert_eq!(read_n(fd, 1), b"g");
            write_all(fd, b"4");
            std::thread::sleep(std::time::Duration::from_millis(300));
            write_all(fd, b"5");
            // 8.
            assert_eq!(read_n(fd, 1), b"g");
            assert_eq!(libc::shutdown(fd, libc::SHUT_WR), 0);
            assert_eq!(read_n(fd, 5), b"after", "reading after shutting down writing");
            // 9. The server closes: EOF here; writes fail with EPIPE, SIGPIPE unless asked.
            assert_eq!(libc::read(fd, b.as_mut_ptr().cast(), 16), 0, "end of stream");
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_pipe as *const () as usize;
            libc::sigaction(libc::SIGPIPE, &sa, std::ptr::null_mut());
            // (we shut down writing: every write fails at once, as with the kernel)
            assert_eq!(libc::send(fd, b"x".as_ptr().cast(), 1, libc::MSG_NOSIGNAL), -1);
            assert_eq!(errno(), libc::EPIPE, "send after shutdown");
            assert_eq!(PIPES.load(std::sync::atomic::Ordering::SeqCst), 0, "MSG_NOSIGNAL: no SIGPIPE");
            assert_eq!(libc::write(fd, b"x".as_ptr().cast(), 1), -1);
            assert_eq!(errno(), libc::EPIPE, "write after shutdown");
            assert_eq!(PIPES.load(std::sync::atomic::Ordering::SeqCst), 1, "SIGPIPE");
            libc::close(fd);
            println!("client ok");
        }
    }
}

/// An epoll echo loop over many connections (libc, as C servers do).
mod many {
    use std::net::TcpStream;
    use std::os::fd::AsRawFd;

    pub fn echo(conns: &[TcpStream]) {
        // SAFETY: libc calls on our own descriptors, with buffers and structures that live
        // across each call and lengths that match them.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0);
            for (i, c) in conns.iter().enumerate() {
                c.set_nonblocking(true).unwrap();
                let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: i as u64 };
                assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, c.as_raw_fd(), &mut ev), 0);
            }
            let mut open = conns.len();
            let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 16];
            let mut buf = [0u8; 4096];
            while open > 0 {
                let n = libc::epoll_wait(ep, evs.as_mut_ptr(), 16, 30_000);
                assert!(n > 0, "epoll_wait: {n} ({})", std::io::Error::last_os_error());
                for ev in &evs[..n as usize] {
                    let fd = conns[ev.u64 as usize].as_raw_fd();
                    loop {
                        let k = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                        if k == 0 {
                            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()), 0);
                            open -= 1;
                            break;
                        }
                        if k < 0 {
                            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EAGAIN));
                            break;
                        }
                        let mut done = 0;
                        while done < k as usize {
                            let w = libc::write(fd, buf[done..].as_ptr().cast(), k as usize - done);
                            assert!(w > 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN));
                            if w > 0 {
                                done += w as usize;
                            }
                        }
                    }
                }
            }
            libc::close(ep);
        }
    }
}

/// One epoll set over 100 connections, one of them talking at a time: every exchange is
/// reported and echoed, over clan and over the kernel alike (a wait looks only at the
/// members that moved: the quiet ones must still be woken when their turn comes).
#[test]
fn an_epoll_set_of_many_quiet_connections_reports_the_one_that_moves() {
    for clan in [true, false] {
        let mut server = Proc::spawn("epoll_echo_many", &["100"], clan);
        let port = server.expect("port");
        let mut client = Proc::spawn("quiet_many_client", &[&port, "100", "2000"], clan);
        client.expect("client ok");
        let cerr = client.finish(Duration::from_secs(60));
        server.expect("echoed 100");
        let serr = server.finish(Duration::from_secs(60));
        let want = if clan { 100 } else { 0 };
        assert_eq!((over_clan(&cerr), over_clan(&serr)), (want, want), "client: {cerr}\nserver: {serr}");
    }
}

/// Every call of the list the programs need, over clan and over the kernel alike.
#[test]
fn socket_calls_behave_as_the_kernels() {
    for clan in [true, false] {
        let mut server = Proc::spawn("sem_server", &[], clan);
        let port = server.expect("port");
        let mut client = Proc::spawn("sem_client", &[&port], clan);
        client.expect("client ok");
        let cerr = client.finish(Duration::from_secs(60));
        server.expect("server ok");
        let serr = server.finish(Duration::from_secs(60));
        let want = usize::from(clan);
        assert_eq!((over_clan(&cerr), over_clan(&serr)), (want, want), "client: {cerr}\nserver: {serr}");
    }
}
