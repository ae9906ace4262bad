//! Tripwires across processes: an exporter wakes up when another process writes into its
//! memory.
//!
//! What it shows, in the order a program does it:
//!
//! 1. The exporter (this process) opens a NIC, exports a 4 KiB aperture and sets two
//!    tripwires on it: one on the flag word (bytes 0..8), which it will wait on, and one on
//!    the message body that posts an event to the endpoint's event queue.
//! 2. It turns the aperture's descriptor into text (`clan1.…`) and hands it to an importer:
//!    here a copy of this program started as a child process, with the text as an argument.
//! 3. The importer parses the text back into a [`clan::Descriptor`], imports it (a
//!    [`clan::Mapping`]), sets a tripwire on its own mapping (it fires when the importer's own
//!    write through the mapping has completed), writes the body, then the flag.
//! 4. The exporter arms its flag tripwire, re-checks the flag, and only then waits: the
//!    pattern that never misses a wake-up. It then checks the body, the tripwire's counter
//!    and fired bit, and the body tripwire's event.
//!
//! ```sh
//! cargo run -p clan --example tripwire_remote           # the two processes share memory
//! cargo run -p clan --example tripwire_remote -- link   # the same over a TCP link (as across hosts)
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use clan::{Access, Descriptor, Event, LocalTransport, Nic, NicConfig, TripwireConfig, TripwireError};

/// Where the flag word is: the exporter waits for it to become non-zero.
const FLAG: u64 = 0;
/// Where the message body starts.
const BODY: u64 = 8;
/// The message the importer writes.
const MESSAGE: &[u8] = b"hello from another process, through a tripwire";
/// The value the importer stores into the flag.
const FLAG_VALUE: u64 = 0x5eed;
/// The cookie the body tripwire's events carry.
const BODY_COOKIE: u64 = 42;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        // `tripwire_remote importer <descriptor> [link]`: the child's part.
        Some("importer") => {
            let desc = args.get(1).ok_or("usage: tripwire_remote importer <descriptor> [link]")?;
            importer(desc, args.get(2).is_some_and(|a| a == "link"))
        }
        Some("link") => exporter(true),
        None => exporter(false),
        Some(other) => Err(format!("unknown argument {other:?} (expected nothing or `link`)").into()),
    }
}

fn nic_config(link: bool) -> NicConfig {
    NicConfig {
        // `Link` makes two NICs of one host talk over TCP, as NICs of two hosts do.
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    }
}

/// The exporter: owns the memory and waits on it.
fn exporter(link: bool) -> Result<()> {
    let nic = Nic::open(nic_config(link))?;
    let ep = nic.endpoint()?;
    let buf = ep.export(4096)?;

    // The flag's tripwire: default actions (a bit in the queue's fired bitmap and a counter),
    // and it wakes `wait`. Tripwires are created armed.
    let flag = buf.tripwire(TripwireConfig::writes(FLAG..FLAG + 8))?;
    // The body's tripwire posts an event (with our cookie) to the endpoint's event queue,
    // whose file descriptor an epoll/mio/tokio loop can wait on.
    let body_end = BODY + MESSAGE.len() as u64;
    let _body = buf.tripwire(TripwireConfig::writes(BODY..body_end).event(BODY_COOKIE))?;

    // A descriptor is plain text: send it anywhere (here: on the child's command line).
    let desc = buf.descriptor().to_string();
    println!("exporter: exported {} bytes as {}…", buf.len(), &desc[..desc.len().min(24)]);
    let mut child = spawn_importer(&desc, link)?;

    // Arm, re-check, wait. Arming first means a write that lands after the re-check fires the
    // tripwire; a write that landed before it is seen by the re-check. Never a lost wake-up.
    // (The wait is cut into slices only to notice an importer that died before writing.)
    let deadline = Instant::now() + TIMEOUT;
    flag.arm()?;
    while buf.load_u64(FLAG)? == 0 {
        match flag.wait(Some(Duration::from_millis(100))) {
            Ok(()) | Err(TripwireError::Timeout) => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(status) = child.try_wait()? {
            return Err(format!("the importer exited ({status}) without writing the flag").into());
        }
        check(Instant::now() < deadline, "the flag was not written in time")?;
    }

    // The body was written before the flag, so it is in place now.
    let flag_value = buf.load_u64(FLAG)?;
    check(flag_value == FLAG_VALUE, format!("flag is {flag_value:#x}, expected {FLAG_VALUE:#x}"))?;
    let mut body = vec![0u8; MESSAGE.len()];
    buf.read(BODY, &mut body)?;
    check(body == MESSAGE, format!("body is {:?}", String::from_utf8_lossy(&body)))?;
    check(flag.count() >= 1, format!("the flag tripwire counted {} firings", flag.count()))?;
    check(flag.fired(), "the flag tripwire's bit in the fired bitmap is not set")?;
    println!("exporter: woken by the flag tripwire; the body says {:?}", String::from_utf8_lossy(&body));

    // The body's firing is an event on the endpoint's queue (other events may come first).
    loop {
        let left = deadline.checked_duration_since(Instant::now()).ok_or("no event for the body tripwire")?;
        match ep.event_queue().wait(Some(left))? {
            Event::Tripwire { cookie: BODY_COOKIE, access, .. } => {
                check(access == Access::Write, format!("the body tripwire fired on {access:?}"))?;
                println!("exporter: event queue says the body tripwire fired ({access:?})");
                break;
            }
            other => println!("exporter: (another event: {other:?})"),
        }
    }

    // Let the importer go (it waits for this so that it stays alive while we look), then
    // collect its verdict: it checked its own tripwire.
    drop(child.stdin.take());
    let status = wait_child(&mut child, TIMEOUT)?;
    check(status.success(), format!("the importer failed: {status}"))?;
    println!("tripwire_remote: all checks passed{}", if link { " (over a link)" } else { "" });
    Ok(())
}

/// The importer: parses the descriptor, writes through the mapping.
fn importer(text: &str, link: bool) -> Result<()> {
    // Die with the exporter, whatever happens to it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let desc: Descriptor = text.parse()?;
    let nic = Nic::open(nic_config(link))?;
    let ep = nic.endpoint()?;
    let remote = ep.import_timeout(&desc, TIMEOUT)?;
    println!("importer: imported {} bytes of {} (remote: {})", remote.len(), desc.nic(), remote.is_remote());

    // A tripwire on the importer's own mapping watches outgoing traffic: it fires once a
    // write of ours through the mapping to the flag has completed.
    let sent = remote.tripwire(TripwireConfig::writes(FLAG..FLAG + 8))?;
    check(sent.count() == 0, "the mapping tripwire fired before anything was written")?;

    remote.write(BODY, MESSAGE)?; // the body first ...
    check(sent.count() == 0, "the mapping tripwire on the flag fired for a write of the body")?;
    remote.store_u64(FLAG, FLAG_VALUE)?; // ... then the flag: fires the exporter's tripwire.
    // (`remote.write_then_store_u64(BODY, MESSAGE, FLAG, FLAG_VALUE)` does both with one fence.)

    sent.wait(Some(TIMEOUT))?; // returns at once: it has fired
    check(sent.count() == 1, format!("the mapping tripwire counted {} firings, expected 1", sent.count()))?;
    println!("importer: wrote body and flag; my mapping's tripwire fired once");

    // Stay until the exporter has seen everything (it closes our stdin).
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(())
}

fn spawn_importer(desc: &str, link: bool) -> Result<Child> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("importer").arg(desc);
    if link {
        cmd.arg("link");
    }
    Ok(cmd.stdin(Stdio::piped()).spawn()?)
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
            return Err("the importer did not exit in time".into());
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
