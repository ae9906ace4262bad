//! VMMC (virtual memory-mapped communication): the sender moves data straight into a
//! receive buffer the receiver exported; there is no receive call.
//!
//! Two [`Vmmc`] instances on two NICs (as two processes, or two hosts, would have):
//!
//! 1. **Export/import**: the receiver exports a 64 KiB buffer for the sender's endpoint only
//!    ([`ImportPolicy`]), with notifications kept for [`ExportedBuffer::wait_notification`]. Its
//!    descriptor travels as text; the sender imports it; a third party's import is refused.
//! 2. **Deliberate update**: the sender fills a send buffer (local memory registered with the
//!    NIC) and sends from it: 256 bytes synchronously ([`Vmmc::send_msg`]: inline, programmed
//!    I/O) and 48 KiB asynchronously ([`Vmmc::send_msg_async`]: by the DMA engine), both with
//!    a notification. The receiver waits for each notification and checks the bytes landed.
//! 3. **Remote fetch**: the receiver writes into its buffer; the sender reads it back into
//!    local memory ([`Vmmc::fetch`], and [`Vmmc::fetch_async`] for a long read by DMA).
//! 4. **Notification handler**: a second buffer runs a handler on the receiver's
//!    notification thread for each message sent to it with a notification.
//!
//! Every wait is bounded (the asynchronous forms are used where the synchronous ones would
//! wait without limit).
//!
//! ```sh
//! cargo run -p clan-proto --example vmmc
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use clan::{Descriptor, ImportError, ImportPolicy, Nic, NicConfig};
use clan_proto::vmmc::{ExportOptions, ExportedBuffer, Notification, Notify, SendFlags, Vmmc, VmmcError};

/// The receive buffer's size.
const BUF: u64 = 64 << 10;
/// The short message: where it lands, its length (sent inline).
const SHORT_AT: u64 = 0;
const SHORT: u64 = 256;
/// The long message: where it lands, its length (sent by DMA: above `inline_max`, 8 KiB).
const LONG_AT: u64 = 16 << 10;
const LONG: u64 = 48 << 10;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let (receiver_nic, sender_nic) = (Nic::open(NicConfig::default())?, Nic::open(NicConfig::default())?);
    let receiver = Vmmc::new(&receiver_nic)?;
    let sender = Vmmc::new(&sender_nic)?;

    // 1. Export for the sender only; the descriptor travels as text.
    let only_sender = ImportPolicy::anyone().endpoint(sender.endpoint().addr());
    let rbuf = receiver.export(BUF, ExportOptions { policy: only_sender, notify: Notify::Wait })?;
    let text = rbuf.descriptor().to_string();
    let desc: Descriptor = text.parse()?;
    let dst = sender.import(&desc)?;
    println!("sender: imported the receiver's {} byte buffer", dst.len());
    let intruder = Vmmc::new(&sender_nic)?;
    match intruder.import(&desc) {
        Err(VmmcError::Import(ImportError::Denied(why))) => println!("intruder: import refused ({why:?})"),
        Err(e) => return Err(format!("the intruder's import failed, but not as refused: {e}").into()),
        Ok(_) => return Err("check failed: an endpoint outside the policy imported the buffer".into()),
    }

    // 2. Deliberate update from a send buffer.
    let src = sender.send_buffer(BUF)?;
    let short = pattern(1, SHORT);
    let long = pattern(2, LONG);
    src.write(0, &short)?;
    src.write(SHORT, &long)?;

    // Short: inline, synchronous (the send buffer may be reused when it returns).
    sender.send_msg(&src, 0, &dst, SHORT_AT, SHORT, SendFlags::notify())?;
    expect_landed(&rbuf, SHORT_AT, SHORT)?;
    check(read(&rbuf, SHORT_AT, SHORT)? == short, "the short message's bytes")?;
    println!("receiver: notified of {SHORT} bytes at {SHORT_AT}; they are right");

    // Long: by DMA, asynchronous; its handle says when the send buffer may be reused.
    let handle = sender.send_msg_async(&src, SHORT, &dst, LONG_AT, LONG, SendFlags::notify())?;
    handle.wait(Some(TIMEOUT))?;
    expect_landed(&rbuf, LONG_AT, LONG)?;
    check(read(&rbuf, LONG_AT, LONG)? == long, "the long message's bytes")?;
    println!("receiver: notified of {LONG} bytes at {LONG_AT}; they are right");
    let stats = sender.stats();
    check(
        stats.inline_sends == 1 && stats.dma_sends == 1,
        format!("{} inline and {} DMA sends, expected one each", stats.inline_sends, stats.dma_sends),
    )?;

    // 3. Remote fetch: the receiver puts data in its buffer (its own memory: a plain write),
    // the sender reads it into local memory.
    let answer = pattern(3, SHORT);
    rbuf.write(SHORT_AT, &answer)?;
    let fetched = sender.send_buffer(BUF)?;
    sender.fetch(&dst, SHORT_AT, &fetched, 0, SHORT)?; // inline: a read through the mapping
    check(read(&fetched, 0, SHORT)? == answer, "the fetched short range")?;
    let h = sender.fetch_async(&dst, LONG_AT, &fetched, LONG_AT, LONG)?; // long: by DMA
    h.wait(Some(TIMEOUT))?;
    check(read(&fetched, LONG_AT, LONG)? == long, "the fetched long range")?;
    println!("sender: fetched {SHORT} and {LONG} bytes back from the receiver's buffer");

    // 4. A handler on the receiver's notification thread (here: it forwards to a channel).
    let (tx, rx) = mpsc::channel();
    let handler = Arc::new(move |n: Notification| {
        let _ = tx.send(n);
    });
    let hbuf = receiver.export(4096, ExportOptions { notify: Notify::Handler(handler), ..Default::default() })?;
    let hdst = sender.import(&hbuf.descriptor())?;
    for (i, msg) in [&b"ping"[..], b"second message", b"3"].iter().enumerate() {
        let at = 100 * i as u64;
        sender.send_bytes(msg, &hdst, at, SendFlags::notify())?; // from ordinary memory
        let n = rx.recv_timeout(TIMEOUT).map_err(|_| "no notification reached the handler")?;
        let want = Notification::Landed { offset: at, len: msg.len() as u64 };
        check(n == want, format!("the handler got {n:?}, expected {want:?}"))?;
        check(read(&hbuf, at, msg.len() as u64)? == *msg, "the bytes the handler was told about")?;
    }
    println!("receiver: the handler was told of 3 messages, in order");
    println!("vmmc: all checks passed");
    Ok(())
}

/// Wait for the buffer's next notification; it must say `len` bytes at `offset`.
fn expect_landed(buf: &ExportedBuffer, offset: u64, len: u64) -> Result<()> {
    let n = buf.wait_notification(Some(TIMEOUT))?;
    let want = Notification::Landed { offset, len };
    check(n == want, format!("notification {n:?}, expected {want:?}"))
}

/// `len` bytes at `off` of local memory (an exported or send buffer: both deref to an aperture).
fn read(ap: &clan::Aperture, off: u64, len: u64) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len as usize];
    ap.read(off, &mut v)?;
    Ok(v)
}

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|k| (k as u8).wrapping_mul(seed.wrapping_mul(2).wrapping_add(1)) ^ seed).collect()
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
