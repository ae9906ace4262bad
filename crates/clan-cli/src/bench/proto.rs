//! What the protocol benchmarks share (`queue.rs`, `rpc.rs`, `stream.rs`: `clan bench
//! queue`, `rpc`, `stream`): limits, targets and helpers.
//!
//! Every measurement runs between two processes pinned to different CPUs (0 and 1).

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::stream::Stream;

use super::Result;

pub(super) const LIMIT: Duration = Duration::from_secs(60);
/// How long a spinning side polls before it would sleep: far longer than any wait of a run,
/// so that it never sleeps while the run goes on.
pub(super) const BUSY_POLL: Duration = Duration::from_millis(10);
/// RTT p50, clan over the Unix socket: the target, both ways (at most as slow).
pub(super) const TARGET_RTT_VS_UNIX: f64 = 1.0;
/// Messages per `send_batch` in the batched slot queue of `bench queue`.
pub(super) const BATCH: u64 = 64;
/// RPC calls per round of the message-rate table of `bench queue`.
pub(super) const RATE_CALLS: u64 = 20_000;
/// Transfers up to this size also run batched and against UCX.
pub(super) const RATE_SIZES: usize = 1024;
/// A stream over a TCP link: RTT p50 at most this times kernel TCP's.
pub(super) const TARGET_LINK_RTT_VS_TCP: f64 = 1.1;
/// A stream over a TCP link: bandwidth at least this times kernel TCP's.
pub(super) const TARGET_LINK_BW_VS_TCP: f64 = 0.9;
/// Oversubscribed (both on one CPU): RTT p50 at most this times a Unix socket's.
pub(super) const TARGET_ONE_CORE_VS_UNIX: f64 = 2.0;

pub(super) fn mbit(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64().max(1e-9) / 1e6
}

/// A peer's NIC at `ip`, reaching the other side over links (`link`) or shared memory.
pub(super) fn peer_nic(ip: IpAddr, link: bool) -> Result<Nic> {
    Ok(Nic::open(NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::at(ip, 0)
    })?)
}

pub(super) fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

/// `read_exact` by polling: a non-blocking source is read again at once when it has
/// nothing.
pub(super) fn read_exact_polling(s: &mut impl Read, buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::ErrorKind;
    // The clock is first read after 4096 empty polls: a read that ends sooner (every round
    // trip of a benchmark) costs no clock read, which would otherwise be on the measured path.
    let (mut start, mut n, mut got) = (None, 0u32, 0usize);
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(k) => got += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n % 4096 == 0 && start.get_or_insert_with(Instant::now).elapsed() > LIMIT {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` by polling (a non-blocking sink is written again at once when it is full).
pub(super) fn write_all_polling(s: &mut impl Write, mut buf: &[u8]) -> std::io::Result<()> {
    use std::io::ErrorKind;
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(k) => buf = &buf[k..],
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A connected stream of any kind, as `Read + Write`. (A clan stream is larger than a socket's
/// descriptor: it holds its two sides. A benchmark holds one or two of these, and a box would
/// put one more pointer on the measured path.)
#[allow(clippy::large_enum_variant)]
pub(super) enum AnyStream {
    Clan(Stream),
    Unix(std::os::unix::net::UnixStream),
    Tcp(TcpStream),
}

impl AnyStream {
    /// Make a socket non-blocking (clan streams poll by their configuration instead).
    pub(super) fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        match self {
            AnyStream::Clan(_) => Ok(()),
            AnyStream::Unix(s) => s.set_nonblocking(on),
            AnyStream::Tcp(s) => s.set_nonblocking(on),
        }
    }
}

impl Read for AnyStream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            AnyStream::Clan(s) => s.read(b),
            AnyStream::Unix(s) => s.read(b),
            AnyStream::Tcp(s) => s.read(b),
        }
    }
}

impl Write for AnyStream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            AnyStream::Clan(s) => s.write(b),
            AnyStream::Unix(s) => s.write(b),
            AnyStream::Tcp(s) => s.write(b),
        }
    }
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        // Each stream's own (clan's holds its side once for the whole buffer).
        match self {
            AnyStream::Clan(s) => s.write_all(b),
            AnyStream::Unix(s) => s.write_all(b),
            AnyStream::Tcp(s) => s.write_all(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
