//! The distributed message queue: a sender writes messages into slots in the receiver's
//! memory; each message carries a 64-bit metadata word.
//!
//! The receiver binds a [`QueueListener`] with a small ring (16 slots of 512 bytes, so that
//! long messages are visibly split), a sender thread on a second NIC connects with
//! [`MsgSender::connect`] and sends:
//!
//! - messages of every interesting size, one by one ([`MsgSender::send_timeout`]): empty,
//!   one byte, exactly one slot's payload, one byte more (two slots: a multi-part message),
//!   and 40 KB — longer than the whole ring, which the receiver frees as it copies;
//! - 200 small messages in batches ([`MsgSender::send_batch`]: one publication per run of
//!   messages that fits the free slots), with a long one in the middle of a batch.
//!
//! The receiver takes them with [`MsgReceiver::recv`] (and one with
//! [`MsgReceiver::recv_in_place`], lent where it landed), checking order, metadata and every
//! byte. Once the sender is gone, waiting for more fails with `Disconnected`.
//!
//! ```sh
//! cargo run -p clan-proto --example queue
//! ```
//!
//! It exits 0 when every check passed, non-zero with a message otherwise.

#![forbid(unsafe_code)]

use std::error::Error;
use std::time::Duration;

use clan::{Nic, NicConfig};
use clan_proto::queue::{HEADER, MsgReceiver, MsgSender, QueueConfig, QueueError, QueueListener};

/// Bytes of a slot, its header included.
const SLOT: u64 = 512;
/// Slots in the ring (one stays free).
const SLOTS: u64 = 16;
/// How many small messages go in batches.
const BATCHED: u64 = 200;
/// Messages per batch.
const BATCH: usize = 50;
/// Every wait of this example is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// The messages sent one by one, by length: around a slot's payload, and longer than the ring.
fn single_sizes() -> Vec<usize> {
    let payload = (SLOT - HEADER) as usize;
    vec![0, 1, 100, payload, payload + 1, 3 * payload + 5, 40_000]
}

/// Message `meta`'s bytes: its length, and a pattern that depends on `meta`.
fn payload(meta: u64, len: usize) -> Vec<u8> {
    (0..len).map(|k| (k as u64).wrapping_mul(17).wrapping_add(meta.wrapping_mul(131)) as u8).collect()
}

/// The length of batched message `i`: small, but one long one in the middle of a batch.
fn batched_len(i: u64) -> usize {
    if i == 123 { 5000 } else { (i % 60) as usize + 1 }
}

fn main() -> Result<()> {
    watchdog(Duration::from_secs(30));
    let cfg = QueueConfig { slots: SLOTS, slot_size: SLOT, ..QueueConfig::default() };
    let (receiver_nic, sender_nic) = (Nic::open(NicConfig::default())?, Nic::open(NicConfig::default())?);

    let listener = QueueListener::bind(&receiver_nic, cfg.clone())?;
    let addr = listener.local_addr();
    println!("receiver: listening at {addr}");

    let sender = std::thread::spawn(move || -> Result<u64> {
        let mut tx = MsgSender::connect(&sender_nic, addr, &cfg)?;
        println!("sender: connected; {} payload bytes per slot", tx.slot_payload());
        let mut meta = 0;
        for len in single_sizes() {
            // Waits for room as needed, each wait at most TIMEOUT.
            tx.send_timeout(meta, &payload(meta, len), Some(TIMEOUT))?;
            meta += 1;
        }
        let first = meta;
        let all: Vec<(u64, Vec<u8>)> =
            (first..first + BATCHED).map(|m| (m, payload(m, batched_len(m - first)))).collect();
        for batch in all.chunks(BATCH) {
            let msgs: Vec<(u64, &[u8])> = batch.iter().map(|(m, d)| (*m, d.as_slice())).collect();
            tx.send_batch(&msgs)?;
        }
        println!("sender: sent {} messages in {} slots", first + BATCHED, tx.sent());
        Ok(first + BATCHED)
        // `tx` drops here: the receiver still gets what was sent, then `Disconnected`.
    });

    let mut rx = listener.accept(Some(TIMEOUT))?;
    let received = receive(&mut rx)?;
    let sent = sender.join().map_err(|_| "the sender thread panicked")??;
    check(received == sent, format!("received {received} messages, {sent} were sent"))?;

    // Nothing more will come: the wait ends with `Disconnected` (not a hang).
    match rx.recv(Some(TIMEOUT)) {
        Err(QueueError::Disconnected) => println!("receiver: the sender is gone, as expected"),
        Err(e) => return Err(format!("after the last message: {e}, expected Disconnected").into()),
        Ok(m) => return Err(format!("an unexpected message (meta {})", m.meta).into()),
    }
    println!("queue: all checks passed");
    Ok(())
}

/// Take every message in order, check each; returns how many.
fn receive(rx: &mut MsgReceiver) -> Result<u64> {
    let mut meta = 0u64;
    for len in single_sizes() {
        let m = rx.recv(Some(TIMEOUT))?;
        check(m.meta == meta, format!("got message {} where {meta} was due", m.meta))?;
        check(m.data == payload(meta, len), format!("message {meta}: {} bytes, expected {len}", m.data.len()))?;
        println!("receiver: message {meta}: {len} bytes intact");
        meta += 1;
    }
    let first = meta;
    for i in 0..BATCHED {
        let want = payload(first + i, batched_len(i));
        if i == 7 {
            // One message lent in place: read where it landed in our memory, no copy.
            let (m, data) = rx.recv_in_place(Some(TIMEOUT), |m, msg| (m, msg.to_vec()))?;
            check(m == first + i && data == want, format!("the message lent in place (meta {m})"))?;
            continue;
        }
        let m = rx.recv(Some(TIMEOUT))?;
        check(m.meta == first + i, format!("got message {} where {} was due", m.meta, first + i))?;
        check(m.data == want, format!("batched message {}: wrong contents", first + i))?;
    }
    println!("receiver: {BATCHED} batched messages in order and intact");
    Ok(first + BATCHED)
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
