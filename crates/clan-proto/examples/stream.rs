//! Stream sockets: a clan byte stream used like a `std::net::TcpStream`.
//!
//! This process is an echo server: it binds a [`Listener`] (an endpoint of its NIC), then
//! starts a copy of itself as the client, passing the listener's address (`ip:port/endpoint`)
//! on its command line. The client connects with [`Stream::connect_with`] and sends messages
//! of several sizes — from one byte to several times the stream's ring, so that flow control
//! is exercised — from one thread while another thread reads the echoes back (a [`Stream`]
//! is `Sync`: `&Stream` implements `Read` and `Write`). It checks every echoed byte, shuts its
//! side down for writing and expects the end of the stream. The server checks it echoed as
//! many bytes as the client sent and that the client succeeded.
//!
//! Every blocking call is bounded: `accept_timeout`, `set_read_timeout`, `set_write_timeout`.
//!
//! ```sh
//! cargo run -p clan-proto --example stream
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};

/// The messages the client sends, by size: the last ones are longer than the ring.
const SIZES: &[usize] = &[1, 7, 100, 4096, 65_536, 300_000, 1 << 20, 3 << 20];
/// Each direction's ring (the stream's buffering): small, to show messages longer than it.
const RING: u64 = 256 << 10;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("client") => client(args.get(1).ok_or("usage: stream client <ip:port/endpoint>")?.parse()?),
        None => server(),
        Some(other) => Err(format!("unknown argument {other:?}").into()),
    }
}

fn config() -> StreamConfig {
    StreamConfig { ring: RING, ..StreamConfig::default() }
}

/// The server: accept one client, echo everything until it closes.
fn server() -> Result<()> {
    let nic = Nic::open(NicConfig::default())?;
    let listener = Listener::bind_with(&nic, None, config())?;
    let addr = listener.local_addr();
    println!("server: listening at {addr}");

    let mut child = Command::new(std::env::current_exe()?).arg("client").arg(addr.to_string()).spawn()?;
    let (mut stream, peer) = listener.accept_timeout(TIMEOUT)?;
    println!("server: accepted {peer}");
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;

    // Echo: read what there is, write it all back; a read of 0 bytes is the end of stream.
    let mut buf = vec![0u8; 64 << 10];
    let mut echoed = 0usize;
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
        echoed += n;
    }
    drop(stream); // the client reads the end of stream
    println!("server: the client closed; echoed {echoed} bytes");

    let status = wait_child(&mut child, TIMEOUT)?;
    check(status.success(), format!("the client failed: {status}"))?;
    let expected: usize = SIZES.iter().sum();
    check(echoed == expected, format!("echoed {echoed} bytes, the client sent {expected}"))?;
    println!("stream: all checks passed");
    Ok(())
}

/// The client: send every message from a writer thread, read and check the echoes here.
fn client(addr: EndpointAddr) -> Result<()> {
    // Die with the server, whatever happens to it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let nic = Nic::open(NicConfig::default())?;
    let stream = Stream::connect_with(&nic, addr, &config())?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    println!("client: connected from {} to {}", stream.local_addr(), stream.peer_addr());

    std::thread::scope(|s| -> Result<()> {
        // Writing and reading at once: an echo of a message longer than both rings together
        // would otherwise wait for us to read while we wait for room to write.
        let writer = s.spawn(|| -> Result<()> {
            let mut w = &stream;
            for (i, &n) in SIZES.iter().enumerate() {
                w.write_all(&message(i, n))?;
            }
            // No more to send: the server's next read returns 0 bytes.
            stream.shutdown(Shutdown::Write)?;
            Ok(())
        });

        let mut r = &stream;
        for (i, &n) in SIZES.iter().enumerate() {
            let mut echo = vec![0u8; n];
            r.read_exact(&mut echo)?;
            if let Some(at) = echo.iter().zip(message(i, n)).position(|(a, b)| *a != b) {
                return Err(format!("message {i} ({n} bytes) differs from byte {at} on").into());
            }
            println!("client: message {i}: {n} bytes echoed intact");
        }
        writer.join().map_err(|_| "the writer thread panicked")??;
        Ok(())
    })?;

    // The server closes after echoing everything: end of stream, not an error.
    let mut more = [0u8; 1];
    match (&stream).read(&mut more) {
        Ok(0) => println!("client: end of stream"),
        Ok(_) => return Err("the server sent more than the echoes".into()),
        Err(e) if e.kind() == ErrorKind::TimedOut => return Err("no end of stream in time".into()),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Message `i` of `n` bytes: a pattern that differs from message to message.
fn message(i: usize, n: usize) -> Vec<u8> {
    (0..n).map(|k| (k.wrapping_mul(31) ^ i.wrapping_mul(97)) as u8).collect()
}

/// Wait for `child` to exit, at most `limit` (then kill it).
fn wait_child(child: &mut Child, limit: Duration) -> Result<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the client did not exit in time".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn check(ok: bool, what: impl Into<String>) -> Result<()> {
    if ok { Ok(()) } else { Err(format!("check failed: {}", what.into()).into()) }
}

/// Whatever happens, the example ends within `limit`.
fn watchdog(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("watchdog: still running after {limit:?}; giving up");
        std::process::exit(2);
    });
}
