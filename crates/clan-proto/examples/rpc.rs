//! RPC on flags and tripwires: an event-driven server and a client in another process.
//!
//! The client writes its request straight into the server's memory and sets the server's
//! flag; the flag's tripwire posts an event to the server's event queue; the server's handler
//! reads the request in place and writes the reply straight into the client's memory,
//! setting the client's flag, on which the client waits.
//!
//! This process is the server: [`RpcServer::bind`], then a loop of [`RpcServer::run_once`]
//! (wait for events, accept connections, answer requests) until the client has exited. The
//! client is a copy of this program started as a child process with the server's address
//! (`ip:port/endpoint`) on its command line. It makes calls of several kinds — adding two
//! numbers, upper-casing text, a checksum of a 60 KB request, and one call written and
//! read in place with [`RpcClient::call_with`] — and checks every reply. The server checks
//! that it answered every call and that its handler never failed.
//!
//! ```sh
//! cargo run -p clan-proto --example rpc
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use clan::{EndpointAddr, Nic, NicConfig};
use clan_proto::InPlace;
use clan_proto::rpc::{ConnId, RpcClient, RpcConfig, RpcServer, Writer};

/// Request kinds: the first byte of a request.
const ADD: u8 = 1;
const UPPER: u8 = 2;
const CHECKSUM: u8 = 3;
/// The first byte of the reply to a request the server did not understand.
const BAD_REQUEST: u8 = 0xff;
/// Calls the client makes (checked by both sides).
const CALLS: u64 = 4 + 3 + 1 + 1;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("client") => client(args.get(1).ok_or("usage: rpc client <ip:port/endpoint>")?.parse()?),
        None => server(),
        Some(other) => Err(format!("unknown argument {other:?}").into()),
    }
}

/// The server: answer requests until the client exits.
fn server() -> Result<()> {
    let nic = Nic::open(NicConfig::default())?;
    // `max_msg`: the largest request this server takes (its receive buffer per connection).
    let mut server = RpcServer::bind(&nic, RpcConfig::default(), 16)?;
    let addr = server.local_addr();
    println!("server: listening at {addr}");
    let mut child = Command::new(std::env::current_exe()?).arg("client").arg(addr.to_string()).spawn()?;

    // The handler cannot return an error (a reply is always sent): keep the first one.
    let mut failure: Option<String> = None;
    let mut handler = |conn: ConnId, req: InPlace<'_>, reply: &mut Writer<'_>| {
        if let Err(e) = answer(req, reply) {
            failure.get_or_insert(format!("connection {}: {e}", conn.0));
        }
    };

    let deadline = Instant::now() + TIMEOUT;
    let mut served = 0;
    let status = loop {
        // Wait at most 50 ms for an event, answer what came, poll a little, return.
        served += server.run_once(Some(Duration::from_millis(50)), &mut handler)?;
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            stop(&mut child);
            return Err("the client did not finish in time".into());
        }
    };
    check(status.success(), format!("the client failed: {status}"))?;
    if let Some(f) = failure {
        return Err(format!("the handler failed: {f}").into());
    }
    check(served == CALLS, format!("answered {served} calls, the client made {CALLS}"))?;
    println!("server: answered {served} calls");
    println!("rpc: all checks passed");
    Ok(())
}

/// Answer one request: read it in place, write the reply into the client's memory.
fn answer(req: InPlace<'_>, reply: &mut Writer<'_>) -> Result<()> {
    let mut kind = [0u8; 1];
    if req.is_empty() {
        reply.write(&[BAD_REQUEST])?;
        return Ok(());
    }
    req.read(0, &mut kind)?;
    let body = req.len() - 1;
    match kind[0] {
        ADD if body == 16 => {
            let mut ab = [0u8; 16];
            req.read(1, &mut ab)?;
            let a = u64::from_le_bytes(ab[..8].try_into()?);
            let b = u64::from_le_bytes(ab[8..].try_into()?);
            reply.write(&[ADD])?;
            reply.write(&a.wrapping_add(b).to_le_bytes())?;
        }
        UPPER => {
            let mut text = vec![0u8; body as usize];
            req.read(1, &mut text)?;
            reply.write(&[UPPER])?;
            reply.write(&text.to_ascii_uppercase())?;
        }
        CHECKSUM => {
            let mut data = vec![0u8; body as usize];
            req.read(1, &mut data)?;
            reply.write(&[CHECKSUM])?;
            reply.write(&body.to_le_bytes())?;
            reply.write(&checksum(&data).to_le_bytes())?;
        }
        _ => reply.write(&[BAD_REQUEST])?,
    }
    Ok(())
}

/// The client: make every kind of call, check every reply.
fn client(addr: EndpointAddr) -> Result<()> {
    // Die with the server, whatever happens to it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let nic = Nic::open(NicConfig::default())?;
    let mut rpc = RpcClient::connect(&nic, addr, &RpcConfig::default())?;
    println!("client: connected from {}", rpc.local_addr());
    let mut reply = Vec::new();

    // Add two numbers (4 calls).
    for (a, b) in [(1u64, 2u64), (40, 2), (u64::MAX, 1), (123_456_789, 987_654_321)] {
        let mut req = vec![ADD];
        req.extend_from_slice(&a.to_le_bytes());
        req.extend_from_slice(&b.to_le_bytes());
        rpc.call(&req, &mut reply, Some(TIMEOUT))?;
        let mut want = vec![ADD];
        want.extend_from_slice(&a.wrapping_add(b).to_le_bytes());
        check(reply == want, format!("{a} + {b}: reply {reply:?}"))?;
    }
    println!("client: 4 additions answered correctly");

    // Upper-case text (3 calls).
    for text in ["hello", "Remote Procedure Call over clan", ""] {
        let mut req = vec![UPPER];
        req.extend_from_slice(text.as_bytes());
        rpc.call(&req, &mut reply, Some(TIMEOUT))?;
        let mut want = vec![UPPER];
        want.extend_from_slice(text.to_ascii_uppercase().as_bytes());
        check(reply == want, format!("upper({text:?}): reply {:?}", String::from_utf8_lossy(&reply)))?;
    }
    println!("client: 3 texts upper-cased correctly");

    // A checksum of a request of 60 000 bytes (1 call).
    let data: Vec<u8> = (0..60_000u32).map(|i| (i * 7 + i / 256) as u8).collect();
    let mut req = vec![CHECKSUM];
    req.extend_from_slice(&data);
    rpc.call(&req, &mut reply, Some(TIMEOUT))?;
    let mut want = vec![CHECKSUM];
    want.extend_from_slice(&(data.len() as u64).to_le_bytes());
    want.extend_from_slice(&checksum(&data).to_le_bytes());
    check(reply == want, "the checksum of 60 000 bytes")?;
    println!("client: the checksum of {} bytes is right", data.len());

    // In place (1 call): the request is written piece by piece straight into the server's
    // memory, the reply is read where it landed in ours (no intermediate buffers).
    let sum = rpc.call_with(
        Some(TIMEOUT),
        |w| {
            w.write(&[ADD])?;
            w.write(&20u64.to_le_bytes())?;
            w.write(&22u64.to_le_bytes())
        },
        |r| -> Result<u64> {
            let mut b = [0u8; 9];
            r.read(0, &mut b)?;
            check(r.len() == 9 && b[0] == ADD, "the reply to an in-place call")?;
            Ok(u64::from_le_bytes(b[1..].try_into()?))
        },
    )??;
    check(sum == 42, format!("20 + 22 = {sum} in place"))?;
    println!("client: 20 + 22 = {sum}, written and read in place");
    Ok(())
}

/// A simple checksum (FNV-1a).
fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
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
