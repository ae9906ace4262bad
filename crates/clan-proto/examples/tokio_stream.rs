//! Async stream sockets with tokio: an echo server and several concurrent clients, all in
//! one runtime.
//!
//! A [`Reactor`] is one clan event queue registered with tokio (through its file
//! descriptor) plus a task that wakes the tasks waiting on it. The server's reactor binds an
//! [`AsyncListener`]; every accepted [`AsyncStream`] is served by a task of its own, which
//! echoes what it reads ([`AsyncReadExt`], [`AsyncWriteExt`]) until the client shuts down its
//! side. The clients run on a second NIC (as another process would), with a reactor of their
//! own, all at once: each sends messages of several sizes, reads the echoes, checks every
//! byte, shuts down and expects the end of the stream. The server checks that every client
//! was served and every byte echoed.
//!
//! Every wait is bounded with `tokio::time::timeout`.
//!
//! ```sh
//! cargo run -p clan-proto --features tokio --example tokio_stream
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::time::Duration;

use clan::{Nic, NicConfig};
use clan_proto::stream::StreamConfig;
use clan_proto::tokio::{AsyncListener, AsyncStream, Reactor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

/// Clients connecting at once.
const CLIENTS: usize = 8;
/// The messages each client sends, by size (the last is larger than the ring).
const SIZES: &[usize] = &[1, 64, 1500, 16_384, 200_000];
/// Each direction's ring.
const RING: u64 = 128 << 10;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let cfg = StreamConfig { ring: RING, ..StreamConfig::default() };
    let (server_nic, client_nic) = (Nic::open(NicConfig::default())?, Nic::open(NicConfig::default())?);

    // The server: a reactor, a listener, and the accept loop as a task.
    let server = Reactor::new(&server_nic)?;
    let listener = server.bind(cfg.clone())?;
    let addr = listener.local_addr();
    println!("server: listening at {addr}");
    let accepting = tokio::spawn(serve(listener, CLIENTS));

    // The clients: a reactor on the other NIC, one task per client, all at once.
    let clients = Reactor::new(&client_nic)?;
    let mut tasks = Vec::new();
    for id in 0..CLIENTS {
        let (reactor, cfg) = (clients.clone(), cfg.clone());
        tasks.push(tokio::spawn(async move {
            let stream = timeout(TIMEOUT, reactor.connect(addr, cfg)).await??;
            client(id, stream).await
        }));
    }
    for (id, task) in tasks.into_iter().enumerate() {
        task.await?.map_err(|e| format!("client {id}: {e}"))?;
    }

    // The server echoed, per client, what that client sent.
    let echoed = timeout(TIMEOUT, accepting).await???;
    let expected: usize = SIZES.iter().sum();
    check(echoed.len() == CLIENTS, format!("the server served {} clients, expected {CLIENTS}", echoed.len()))?;
    for (i, n) in echoed.iter().enumerate() {
        check(*n == expected, format!("connection {i}: echoed {n} bytes, expected {expected}"))?;
    }
    println!("tokio_stream: all checks passed ({CLIENTS} clients, {expected} bytes each)");
    Ok(())
}

/// Accept `n` connections, echo each in a task; returns the bytes echoed per connection.
async fn serve(listener: AsyncListener, n: usize) -> Result<Vec<usize>> {
    let mut conns = Vec::new();
    for _ in 0..n {
        let (stream, peer) = timeout(TIMEOUT, listener.accept()).await??;
        println!("server: accepted {peer}");
        conns.push(tokio::spawn(echo(stream)));
    }
    let mut echoed = Vec::new();
    for c in conns {
        echoed.push(c.await??);
    }
    Ok(echoed)
}

/// Echo until the peer shuts down; returns the bytes echoed.
async fn echo(mut stream: AsyncStream) -> Result<usize> {
    let mut buf = vec![0u8; 32 << 10];
    let mut total = 0;
    loop {
        let n = timeout(TIMEOUT, stream.read(&mut buf)).await??;
        if n == 0 {
            // End of stream: the client shut down its side. Close ours.
            stream.shutdown().await?;
            return Ok(total);
        }
        timeout(TIMEOUT, stream.write_all(&buf[..n])).await??;
        total += n;
    }
}

/// One client: send each message, read its echo back, check it; then shut down.
async fn client(id: usize, stream: AsyncStream) -> Result<()> {
    // Reading and writing from two tasks at once: a message larger than the rings could
    // not be written whole before its echo is read.
    let (mut rd, mut wr) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        for (i, &n) in SIZES.iter().enumerate() {
            timeout(TIMEOUT, wr.write_all(&message(id, i, n))).await??;
        }
        wr.shutdown().await?;
        Ok::<_, Box<dyn Error + Send + Sync>>(())
    });
    for (i, &n) in SIZES.iter().enumerate() {
        let mut echo = vec![0u8; n];
        timeout(TIMEOUT, rd.read_exact(&mut echo)).await??;
        if echo != message(id, i, n) {
            return Err(format!("message {i} ({n} bytes) came back different").into());
        }
    }
    writer.await??;
    let mut more = [0u8; 1];
    let n = timeout(TIMEOUT, rd.read(&mut more)).await??;
    check(n == 0, "expected the end of the stream after the echoes")?;
    println!("client {id}: {} messages echoed intact, then end of stream", SIZES.len());
    Ok(())
}

/// Message `i` of client `id`, `n` bytes.
fn message(id: usize, i: usize, n: usize) -> Vec<u8> {
    (0..n).map(|k| (k.wrapping_mul(13) ^ i.wrapping_mul(101) ^ id.wrapping_mul(7)) as u8).collect()
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
