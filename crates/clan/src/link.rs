//! Links: connections between NICs of different hosts (TCP by default), carrying
//! `clan_wire` frames.
//!
//! ## Sending
//!
//! A thread that writes through a remote mapping sends its burst itself: header and payload
//! in one vectored write straight from the caller's memory (no copy), under the link's send
//! lock, so bursts from one NIC to another stay in order (PRAM). It first waits for room in
//! the window of unacknowledged bytes the peer granted. Control frames produced while
//! receiving (acknowledgements, replies, refusals) never block: they are queued and flushed by
//! whoever holds the send lock next, or by the engine when the socket becomes writable. A
//! thread blocked on a full socket keeps receiving meanwhile, so two NICs that both send can
//! never deadlock on each other's full buffers.
//!
//! ## A peer that does not read
//!
//! What we owe the peer (acknowledgements, read answers, refusals, pongs) is queued, never
//! sent by blocking the receiving thread. The queue is bounded: past
//! [`clan_wire::LinkConfig::max_queued`] bytes we stop reading from the peer (so it cannot make
//! us queue more: TCP's window pushes back on it), and a queue that stays over the limit for
//! `dead_after` ends the link (`clan_wire::Timeout::Stalled`).
//!
//! ## Receiving
//!
//! The engine thread (or, in manual progress, the application through
//! [`crate::Nic::progress`]; or a thread waiting for a reply on the link) decodes frames. A
//! write burst is validated from its header before any byte of it touches memory (import key,
//! aperture and generation, rights, bounds, revocation); refused bursts are discarded,
//! counted and reported to the peer with `Refused`, and a peer that keeps sending bad frames is
//! disconnected. Accepted payload goes straight from the socket into the aperture when the
//! receive buffer is empty, in pieces cut where tripwires' watched ranges end, so the exporter's
//! tripwires fire exactly as for a local write.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use clan_shm::cam::Candidate;
use clan_shm::segment::Segment;
use clan_wire::frame::{self, MAX_DATA};
use clan_wire::{Decoder, Frame, Item, LinkState, Pending, ReadReq, Refused, Status, Target, Timeout};

use crate::addr::NicAddr;
use crate::aperture::ApertureInner;
use crate::descriptor::Rights;
use crate::event_queue::EqInner;
use crate::lock;
use crate::nic::NicInner;
use crate::progress::{self, Deadline};

/// Bad frames tolerated from a peer before it is disconnected.
pub const MAX_BAD_FRAMES: u32 = 16;
/// Bytes of the receive buffer.
const RX_BUF: usize = 64 << 10;
/// Read at most this much into the buffer when a burst's payload could go straight to memory.
const RX_CHUNK: usize = 16 << 10;
/// A burst at least this long is bulk traffic (see `Rx::bulk`).
const BULK: u64 = 8 << 10;
/// What is read when a bulk burst's header is expected: the header, a little more.
const HEADER_READ: usize = 64;
/// Bytes a peer may ask to read at once.
pub const MAX_READ: u32 = 1 << 20;
/// Frames up to this size (header and payload) are copied into one buffer and sent with one
/// system call rather than vectored.
const SMALL_FRAME: usize = 128;
/// Bytes of incoming traffic an application thread processes per [`Link::progress`] (the
/// engine's budget per turn too).
pub(crate) const PROGRESS_BUDGET: usize = 1 << 20;
/// Most bytes of write bursts [`Link::send_writes`] gathers into one send.
pub(crate) const GATHER: usize = 4096;
/// The largest first part [`Link::send_writes`] sends in one system call with small parts
/// behind it (larger ones go burst by burst, each with its own wait for the window).
const BIG_FIRST: usize = 1 << 20;

/// The longest a thread waiting for a reply sleeps before it looks again (deadlines, a
/// closed link).
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Why a link operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkError {
    /// No link could be made: nothing answers at the peer's address.
    Unreachable(String),
    /// The link is closed (peer closed, died, path broke, protocol violation).
    Down(String),
    /// The hand-shake refused the peer or was refused by it (authentication, version).
    Refused(String),
    /// No answer in time.
    Timeout,
}

/// An import the peer holds from us (exporter side).
#[derive(Debug)]
pub(crate) struct ExportRec {
    pub ap: Weak<ApertureInner>,
    pub aperture: u32,
    pub generation: u32,
    pub lo: u64,
    pub hi: u64,
    pub rights: Rights,
}

/// Importer side: the state of a mapping through this link, for refusals to reach it.
#[derive(Debug, Default)]
pub(crate) struct TargetState {
    pub revoked: AtomicBool,
    pub refused: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct ReadSlot {
    pub data: Vec<u8>,
    pub status: Option<Status>,
    pub done: bool,
    pub notify: Option<(Arc<EqInner>, u64)>,
    /// The answer goes straight into a local aperture (DMA) instead of `data`.
    pub into: Option<ReadInto>,
}

/// Where a read's answer lands when it goes straight into a local aperture.
pub(crate) struct ReadInto {
    pub ap: Arc<ApertureInner>,
    /// Aperture offset of the answer's first byte.
    pub abs: u64,
    /// Bytes asked for: a longer answer is not written past them.
    pub want: u64,
    /// Bytes in place so far.
    pub got: u64,
    /// Runs once, on the receiving thread, when the answer is complete (or the link died).
    pub done: Box<dyn FnOnce(Result<u64, Status>) + Send>,
}

impl std::fmt::Debug for ReadInto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadInto").field("abs", &self.abs).field("want", &self.want).field("got", &self.got).finish()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Waits {
    next_id: u64,
    pub imports: HashMap<u64, Option<clan_wire::ImportReply>>,
    pub reads: HashMap<u64, ReadSlot>,
    pub oobs: HashMap<u64, Option<Status>>,
    pub pongs: HashMap<u64, bool>,
}

impl Waits {
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// Counters of a link.
#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    pub bursts_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bursts_out: AtomicU64,
    pub bytes_out: AtomicU64,
    pub refused_in: AtomicU64,
    pub refused_out: AtomicU64,
    /// Receive calls that found nothing.
    pub empty_receives: AtomicU64,
    /// Sleeps of a queue's leader in the socket's `recv` (written under `rx`).
    pub recv_sleeps: AtomicU64,
    /// Of those, ended by a local wake's signal (`EINTR`).
    pub recv_interrupts: AtomicU64,
}

#[derive(Debug)]
struct BurstCtx {
    end: u64,
    ap: Option<Arc<ApertureInner>>,
    /// An aligned 4- or 8-byte burst is applied as one atomic store, even if its bytes come
    /// in pieces (a reader polling that word must never see half of it): gathered here.
    word: Option<(u64, [u8; 8], usize)>,
}

pub(crate) struct Rx {
    dec: Decoder,
    buf: Box<[u8]>,
    head: usize,
    tail: usize,
    burst: Option<BurstCtx>,
    bad: u32,
    scratch: Vec<Candidate>,
    /// The last burst was large: the next one probably is too, so read its header alone
    /// (a few bytes) and let its payload go straight into place.
    bulk: bool,
    /// The export record last looked up, by key (forgotten when the peer unimports it): the
    /// bursts of one transfer (a body and the word behind it), and usually the transfers
    /// that follow, go to one import and pay no look-up. It holds the record only: its
    /// aperture is reached through the record's weak reference, burst by burst, so an
    /// aperture unexported meanwhile is refused and not kept alive.
    access: Option<(u64, Arc<ExportRec>)>,
    /// Bursts and bytes applied in this receive call, counted into the statistics at its
    /// end (one update, not two per burst).
    applied: (u64, u64),
    /// Bursts and bytes applied and not yet counted into the link state: they are, under its
    /// lock, once they are worth an acknowledgement ([`Link::ack_every`]), so a receive call
    /// that applies a small transfer takes no lock for it.
    unacked: (u64, u64),
    /// A sleep in `recv` ([`RecvSleep`]) read less than it asked for: the socket was drained
    /// then, and the next receive decodes what came without asking the socket again (a new
    /// arrival makes it readable again: a new epoll edge, or the next sleeper's `recv`).
    drained: bool,
    /// The socket's receive timeout ([`RECV_SLICES`]): set by sleepers only, under this lock.
    timeo: Duration,
}

impl std::fmt::Debug for Rx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rx").field("buffered", &(self.tail - self.head)).finish_non_exhaustive()
    }
}

/// When a blocking send gives up: at a given instant, or the link's timeout after the send
/// first has to wait (a send that never waits, the common case, reads no clock).
#[derive(Debug, Clone, Copy)]
enum SendBy {
    At(Instant),
    After(Duration),
}

impl SendBy {
    /// The deadline, fixed from now on.
    fn instant(&mut self) -> Instant {
        let at = match *self {
            SendBy::At(t) => t,
            SendBy::After(d) => Instant::now() + d,
        };
        *self = SendBy::At(at);
        at
    }
}

/// One link to a peer NIC.
pub(crate) struct Link {
    pub peer: NicAddr,
    /// Where the link's connection comes from, as the kernel says (`peer` is the peer's
    /// word, verified only with a cluster key).
    pub source: std::net::IpAddr,
    pub id: u64,
    /// Whether we dialled it (the tie-break between simultaneous connections needs to know).
    pub dialled: bool,
    pub sock: mio::net::TcpStream,
    state: Mutex<LinkState>,
    tx: Mutex<()>,
    overflow: Mutex<Vec<u8>>,
    /// Bytes in `overflow`, readable without its lock (a hint: set under the lock whenever
    /// it changes).
    overflow_len: AtomicUsize,
    rx: Mutex<Rx>,
    closed: AtomicBool,
    reason: Mutex<String>,
    pub waits: Mutex<Waits>,
    pub cv: Condvar,
    pub exports: Mutex<HashMap<u64, Arc<ExportRec>>>,
    pub targets: Mutex<HashMap<u64, Weak<TargetState>>>,
    pub stats: LinkStats,
    pub timeout: Duration,
    /// Bytes of owed frames past which we stop reading from the peer.
    max_queued: usize,
    /// We stopped reading because the queue was over `max_queued`.
    rx_paused: AtomicBool,
    /// Imports the peer may hold from us.
    pub max_imports: usize,
    /// Its end was reported (`NicInner::link_closed`).
    gone: AtomicBool,
    /// Applied bytes that earn the peer an acknowledgement (a quarter of the credit we grant:
    /// [`LinkState::poll_ack`]'s threshold).
    ack_every: u64,
    /// Something arrived since the timer last looked: the timer turns it into the time the
    /// peer was last heard from ([`Link::handle_timeout`]), so receiving reads no clock.
    heard: AtomicBool,
    /// The socket is blocking with a receive timeout ([`RECV_SLICES`]), so that a queue's
    /// leader may sleep in its `recv` ([`Link::sleeper`]). Every other call on it passes
    /// `MSG_DONTWAIT` and never blocks.
    sleepable: bool,
    /// A leader sleeps in the socket's `recv` holding `rx` (the engine leaves the link to it
    /// rather than wait for the lock: [`Link::engine_receive`]).
    rx_asleep: AtomicBool,
    /// A waker made the socket non-blocking to end a sleep in `recv` ([`Link::interrupt`]):
    /// the next sleeper makes it blocking again.
    kicked: AtomicBool,
}

/// The receive timeouts (`SO_RCVTIMEO`) of a sleep in a link socket's `recv`, longest
/// first: a sleep takes the longest that fits its own timeout with [`TICK`] to spare (the
/// kernel rounds it up to whole clock ticks), returns early from a longer one (waiters
/// re-check), and sets the socket's again only when it needs another. Never zero: without
/// a timeout, a signal would not end the `recv` (`SA_RESTART` restarts it).
const RECV_SLICES: [Duration; 3] = [Duration::from_secs(1), Duration::from_millis(100), Duration::from_millis(15)];
/// A clock tick at 250 Hz: what the kernel may add to a receive timeout.
const TICK: Duration = Duration::from_millis(4);
/// Shortest timeout a leader sleeps in `recv` with (a shorter one sleeps in epoll, whose
/// timeout is exact). The streams' waits sleep 20 ms at a time (`clan-proto`'s
/// `wait::SLICE`).
pub(crate) const RECV_SLEEP_MIN: Duration = Duration::from_millis(19);

/// How every send on a link's socket goes: never blocking (the socket itself is blocking,
/// for the sleepers), never raising `SIGPIPE`.
const SEND_NOW: rustix::net::SendFlags = rustix::net::SendFlags::DONTWAIT.union(rustix::net::SendFlags::NOSIGNAL);

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("id", &self.id)
            .field("dialled", &self.dialled)
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

/// A queue's leader about to sleep in a link socket's `recv`, with the link's receive lock
/// ([`Link::sleeper`]).
pub(crate) struct RecvSleep<'a> {
    link: &'a Link,
    rx: std::sync::MutexGuard<'a, Rx>,
}

impl RecvSleep<'_> {
    /// Sleep in the socket's `recv` until bytes come, the peer ends the stream, a signal
    /// lands ([`Link::interrupt`]) or about `timeout` passes (at most that, at least
    /// [`RECV_SLEEP_MIN`] less a tick; None: a second). What came stays in the receive
    /// buffer for the next receive to decode ([`Link::progress`]), which the caller makes
    /// when this returns true: bytes came, or the socket has news (its end, an error).
    pub fn sleep(&mut self, timeout: Option<Duration>) -> bool {
        let rx = &mut *self.rx;
        if rx.drained {
            // Read by an earlier sleep and not decoded yet: nothing to wait for.
            return true;
        }
        let slice = RECV_SLICES
            .iter()
            .copied()
            .find(|s| timeout.is_none_or(|t| *s + TICK <= t))
            .unwrap_or(RECV_SLICES[RECV_SLICES.len() - 1]);
        if slice != rx.timeo {
            let r = rustix::net::sockopt::set_socket_timeout(
                &self.link.sock,
                rustix::net::sockopt::Timeout::Recv,
                Some(slice),
            );
            if r.is_err() {
                // (the caller re-checks, and sleeps again)
                return false;
            }
            rx.timeo = slice;
        }
        if rx.head == rx.tail {
            rx.head = 0;
            rx.tail = 0;
        } else if rx.tail == rx.buf.len() {
            rx.buf.copy_within(rx.head..rx.tail, 0);
            rx.tail -= rx.head;
            rx.head = 0;
        }
        let (tail, end) = (rx.tail, rx.buf.len());
        // (only the holder of `rx` writes it: a load and a store)
        let s = &self.link.stats.recv_sleeps;
        s.store(s.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        match rustix::net::recv(&self.link.sock, &mut rx.buf[tail..end], rustix::net::RecvFlags::empty()) {
            Ok((0, _)) => true,
            Ok((n, _)) => {
                rx.tail += n;
                rx.drained = n < end - tail;
                true
            }
            Err(rustix::io::Errno::INTR) => {
                // (only the holder of `rx` writes it: a load and a store)
                let i = &self.link.stats.recv_interrupts;
                i.store(i.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                false
            }
            Err(rustix::io::Errno::AGAIN) => {
                // The slice passed, or a waker made the socket non-blocking: the next sleeper
                // makes it blocking again (one `ioctl` too many if it was the slice).
                self.link.kicked.store(true, Ordering::Relaxed);
                false
            }
            Err(e) => {
                self.link.close(Status::Other, format!("receive failed: {e}"));
                true
            }
        }
    }
}

impl Drop for RecvSleep<'_> {
    fn drop(&mut self) {
        // (before the lock is let go, with `rx`)
        self.link.rx_asleep.store(false, Ordering::Relaxed);
    }
}

/// Where a burst's payload comes from.
pub(crate) enum Payload<'a> {
    /// Caller's memory.
    Bytes(&'a [u8]),
    /// A segment (a mapping's staging area).
    Seg(&'a Segment, usize),
}

impl Link {
    pub fn new(
        peer: NicAddr,
        id: u64,
        dialled: bool,
        sock: mio::net::TcpStream,
        state: LinkState,
        timeout: Duration,
        max_imports: usize,
    ) -> Link {
        let max_queued = state.config().max_queued;
        let ack_every = (state.config().credit / 4).max(1);
        // Blocking, with a receive timeout: a leader may sleep in its `recv` (and a signal
        // then ends that sleep with EINTR even under SA_RESTART, signal(7)).
        let sleepable =
            rustix::net::sockopt::set_socket_timeout(&sock, rustix::net::sockopt::Timeout::Recv, Some(RECV_SLICES[0]))
                .is_ok()
                && rustix::io::ioctl_fionbio(&sock, false).is_ok();
        Link {
            peer,
            source: sock.peer_addr().map_or(peer.ip(), |a| a.ip()),
            id,
            dialled,
            sock,
            state: Mutex::new(state),
            tx: Mutex::new(()),
            overflow: Mutex::new(Vec::new()),
            overflow_len: AtomicUsize::new(0),
            rx: Mutex::new(Rx {
                dec: Decoder::new(),
                buf: vec![0u8; RX_BUF].into_boxed_slice(),
                head: 0,
                tail: 0,
                burst: None,
                bad: 0,
                scratch: Vec::new(),
                bulk: false,
                access: None,
                applied: (0, 0),
                unacked: (0, 0),
                drained: false,
                timeo: RECV_SLICES[0],
            }),
            closed: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            waits: Mutex::new(Waits::default()),
            cv: Condvar::new(),
            exports: Mutex::new(HashMap::new()),
            targets: Mutex::new(HashMap::new()),
            stats: LinkStats::default(),
            timeout,
            max_queued,
            rx_paused: AtomicBool::new(false),
            max_imports,
            gone: AtomicBool::new(false),
            ack_every,
            heard: AtomicBool::new(false),
            sleepable,
            rx_asleep: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
        }
    }

    // ---- the socket ---------------------------------------------------------------------
    //
    // Blocking (`sleepable`), for a leader's sleep in `recv` ([`Link::sleeper`]); every
    // other call below says MSG_DONTWAIT, and none of them ever blocks.

    fn send_now(&self, b: &[u8]) -> std::io::Result<usize> {
        rustix::net::send(&self.sock, b, SEND_NOW).map_err(Into::into)
    }

    fn sendv_now(&self, iov: &[IoSlice<'_>]) -> std::io::Result<usize> {
        rustix::net::sendmsg(&self.sock, iov, &mut rustix::net::SendAncillaryBuffer::default(), SEND_NOW)
            .map_err(Into::into)
    }

    fn recv_now(&self, b: &mut [u8]) -> std::io::Result<usize> {
        rustix::net::recv(&self.sock, b, rustix::net::RecvFlags::DONTWAIT).map(|(n, _)| n).map_err(Into::into)
    }

    /// Whether this is the first report of the link's end.
    pub fn take_gone(&self) -> bool {
        !self.gone.swap(true, Ordering::AcqRel)
    }

    /// Bytes that arrived behind the handshake, to be processed first.
    pub fn preload(&self, bytes: &[u8]) {
        let mut rx = lock(&self.rx);
        let n = bytes.len().min(rx.buf.len());
        rx.buf[..n].copy_from_slice(&bytes[..n]);
        rx.head = 0;
        rx.tail = n;
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn reason(&self) -> String {
        lock(&self.reason).clone()
    }

    fn down(&self) -> LinkError {
        LinkError::Down(self.reason())
    }

    /// Close the link (idempotent): tell the peer if we can, fail every waiter.
    pub fn close(&self, status: Status, why: impl Into<String>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let why = why.into();
        tracing::info!(peer = %self.peer, ?status, "link closed: {why}");
        *lock(&self.reason) = why;
        let mut b = Vec::new();
        Frame::Close { status }.encode(&mut b);
        let _ = self.send_now(&b);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        // Reads that will never be answered: complete them (waiters see the link closed;
        // notifications and callbacks must still come).
        let (intos, notes) = {
            let mut w = lock(&self.waits);
            let ids: Vec<u64> = w.reads.iter().filter(|(_, s)| !s.done).map(|(id, _)| *id).collect();
            let mut intos = Vec::new();
            let mut notes = Vec::new();
            for id in ids {
                if w.reads.get(&id).is_some_and(|s| s.into.is_some()) {
                    intos.extend(w.reads.remove(&id).and_then(|s| s.into));
                } else if let Some(s) = w.reads.get_mut(&id) {
                    s.status.get_or_insert(Status::Other);
                    s.done = true;
                    notes.extend(s.notify.take());
                }
            }
            self.cv.notify_all();
            (intos, notes)
        };
        for into in intos {
            (into.done)(Err(Status::Other));
        }
        for (eq, token) in notes {
            eq.post_local(crate::event_queue::Word::ReadComplete { token });
        }
    }

    // ---- sending ----------------------------------------------------------------------

    /// Queue a control frame and flush what can be flushed without blocking.
    pub fn send_control(&self, f: &Frame<'_>) {
        {
            let mut q = lock(&self.overflow);
            f.encode(&mut q);
            self.overflow_len.store(q.len(), Ordering::Relaxed);
        }
        self.try_flush();
    }

    /// Queue raw frame bytes (e.g. a read response) and flush without blocking.
    fn send_control_bytes(&self, b: &[u8]) {
        {
            let mut q = lock(&self.overflow);
            q.extend_from_slice(b);
            self.overflow_len.store(q.len(), Ordering::Relaxed);
        }
        self.try_flush();
    }

    /// Whether control frames are queued (no lock: a thread that queues one flushes it
    /// itself, or finds the sender busy, which flushes after its send).
    fn has_queued(&self) -> bool {
        self.queued() != 0
    }

    /// Bytes of frames queued for the peer.
    pub fn queued(&self) -> usize {
        // A hint (Relaxed: the bytes themselves are reached through the lock).
        self.overflow_len.load(Ordering::Relaxed)
    }

    /// Queue a frame the engine sends on its own behalf (an out-of-band message of the
    /// outbox): refused if the peer is not reading what it is owed already.
    pub fn send_control_bounded(&self, f: &Frame<'_>) -> bool {
        if self.queued() > self.max_queued {
            return false;
        }
        self.send_control(f);
        true
    }

    /// Flush queued control frames without blocking; returns whether all went out.
    pub fn try_flush(&self) -> bool {
        let Ok(_tx) = self.tx.try_lock() else { return false };
        self.flush_overflow_nonblocking()
    }

    /// Whether receiving stopped because the peer does not read (and the queue has drained
    /// since: the caller must receive again, no new readiness edge will come).
    pub fn take_resume(&self) -> bool {
        if !self.rx_paused.load(Ordering::Acquire) || self.queued() > self.max_queued / 2 {
            return false;
        }
        lock(&self.state).on_tx_blocked(false, Instant::now());
        self.rx_paused.swap(false, Ordering::AcqRel)
    }

    /// Send a `Ping` whose `Pong` proves the peer still answers on this link; returns its
    /// token (see [`Link::probe_answered`]).
    pub fn probe(&self) -> u64 {
        let token = lock(&self.state).next_token();
        lock(&self.waits).pongs.insert(token, false);
        self.send_control(&Frame::Ping { token });
        token
    }

    /// Whether the probe `token` was answered (and forget it if so).
    pub fn probe_answered(&self, token: u64) -> bool {
        let mut w = lock(&self.waits);
        if w.pongs.get(&token) == Some(&true) {
            w.pongs.remove(&token);
            return true;
        }
        false
    }

    /// Forget probe `token`.
    pub fn forget_probe(&self, token: u64) {
        lock(&self.waits).pongs.remove(&token);
    }

    fn flush_overflow_nonblocking(&self) -> bool {
        if !self.has_queued() {
            return true;
        }
        let mut q = lock(&self.overflow);
        while !q.is_empty() {
            match self.send_now(&q) {
                Ok(0) => return false,
                Ok(n) => {
                    q.drain(..n);
                    self.overflow_len.store(q.len(), Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    drop(q);
                    self.close(Status::Other, format!("send failed: {e}"));
                    return false;
                }
            }
        }
        true
    }

    /// Wait until the socket can take more bytes, receiving meanwhile.
    fn wait_writable(&self, nic: &NicInner, by: &mut SendBy) -> Result<(), LinkError> {
        use rustix::event::{PollFd, PollFlags, poll};
        let deadline = by.instant();
        loop {
            if self.is_closed() {
                return Err(self.down());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.close(Status::Other, "peer did not read its socket in time");
                return Err(LinkError::Timeout);
            }
            let mut fds = [PollFd::new(&self.sock, PollFlags::OUT | PollFlags::IN)];
            let ts =
                rustix::time::Timespec { tv_sec: 0, tv_nsec: left.min(Duration::from_millis(100)).as_nanos() as i64 };
            let _ = poll(&mut fds, Some(&ts));
            let r = fds[0].revents();
            if r.contains(PollFlags::IN) {
                // Keep the other direction flowing (its acknowledgements free our window).
                self.progress(nic);
            }
            if r.contains(PollFlags::OUT) || r.intersects(PollFlags::ERR | PollFlags::HUP) {
                return Ok(());
            }
        }
    }

    /// Write all of `bufs` (blocking with the link's timeout). Caller holds the send lock.
    fn write_all_locked(
        &self,
        nic: &NicInner,
        head: &[u8],
        payload: &Payload<'_>,
        len: usize,
        by: &mut SendBy,
    ) -> Result<(), LinkError> {
        // Queued control frames first (frames never interleave: they are whole).
        loop {
            if self.flush_overflow_nonblocking() {
                break;
            }
            if self.is_closed() {
                return Err(self.down());
            }
            self.wait_writable(nic, by)?;
        }
        let total = head.len() + len;
        let mut done = 0usize;
        while done < total {
            let r = if done < head.len() {
                match payload {
                    // A small frame goes out as one contiguous send: copying up to
                    // `SMALL_FRAME` bytes costs less than the kernel's iovec handling (measured
                    // with `clan bench latency --transport tcp`). Larger payloads are sent
                    // vectored, straight from the caller's memory.
                    // The frame is all head (gathered bursts): one plain send.
                    Payload::Bytes(_) if len == 0 => self.send_now(&head[done..]),
                    Payload::Bytes(d) if done == 0 && head.len() + len <= SMALL_FRAME => {
                        let mut b = [0u8; SMALL_FRAME];
                        b[..head.len()].copy_from_slice(head);
                        b[head.len()..head.len() + len].copy_from_slice(&d[..len]);
                        self.send_now(&b[..head.len() + len])
                    }
                    Payload::Bytes(d) => {
                        let iov = [IoSlice::new(&head[done..]), IoSlice::new(&d[..len])];
                        self.sendv_now(&iov)
                    }
                    Payload::Seg(s, off) => s.send_to(&self.sock, &head[done..], *off, len),
                }
            } else {
                let at = done - head.len();
                match payload {
                    Payload::Bytes(d) => self.send_now(&d[at..len]),
                    Payload::Seg(s, off) => s.send_to(&self.sock, &[], off + at, len - at),
                }
            };
            match r {
                Ok(0) => {
                    self.close(Status::Other, "connection closed while sending");
                    return Err(self.down());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.wait_writable(nic, by)?,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.close(Status::Other, format!("send failed: {e}"));
                    return Err(self.down());
                }
            }
        }
        Ok(())
    }

    /// Send one frame's bytes (and optional payload), blocking until `deadline`.
    fn send_blocking(
        &self,
        nic: &NicInner,
        head: &[u8],
        payload: Payload<'_>,
        len: usize,
        mut by: SendBy,
    ) -> Result<(), LinkError> {
        if self.is_closed() {
            return Err(self.down());
        }
        let _tx = lock(&self.tx);
        self.write_all_locked(nic, head, &payload, len, &mut by)?;
        // Control frames queued while we were sending.
        if self.has_queued() {
            self.flush_overflow_nonblocking();
        }
        Ok(())
    }

    /// Send a control frame, blocking until it is written (at most the link's timeout).
    pub fn send_frame_blocking(&self, nic: &NicInner, f: &Frame<'_>) -> Result<(), LinkError> {
        self.send_frame_until(nic, f, Instant::now() + self.timeout)
    }

    /// Send a control frame, blocking until it is written or `deadline` passes.
    pub fn send_frame_until(&self, nic: &NicInner, f: &Frame<'_>, deadline: Instant) -> Result<(), LinkError> {
        let mut b = Vec::with_capacity(128);
        f.encode(&mut b);
        self.send_blocking(nic, &b, Payload::Bytes(&[]), 0, SendBy::At(deadline))
    }

    /// Wait for room in the window for `bytes`.
    fn wait_window(&self, nic: &NicInner, bytes: u64) -> Result<(), LinkError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if lock(&self.state).window_allows(bytes) {
                return Ok(());
            }
            self.wait_until(nic, deadline, |_| None::<()>, true).ok();
            if self.is_closed() {
                return Err(self.down());
            }
            if Instant::now() >= deadline {
                return Err(LinkError::Timeout);
            }
        }
    }

    /// Send a write burst of `len` bytes to `to` (split into bursts of at most [`MAX_DATA`]).
    pub fn send_write(&self, nic: &NicInner, to: Target, payload: Payload<'_>, len: usize) -> Result<(), LinkError> {
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(MAX_DATA as usize);
            // Room in the window, counted at once (one lock on the common path).
            {
                let mut st = lock(&self.state);
                if st.window_allows(n as u64) {
                    st.on_write_sent(n as u64);
                } else {
                    drop(st);
                    self.wait_window(nic, n as u64)?;
                    lock(&self.state).on_write_sent(n as u64);
                }
            }
            let t = to.advance(done as u64);
            let head = frame::write_header(&t, n);
            let p = match payload {
                Payload::Bytes(d) => Payload::Bytes(&d[done..done + n]),
                Payload::Seg(s, off) => Payload::Seg(s, off + done),
            };
            self.send_blocking(nic, &head, p, n, SendBy::After(self.timeout))?;
            self.stats.bursts_out.fetch_add(1, Ordering::Relaxed);
            self.stats.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
            done += n;
        }
        Ok(())
    }

    /// Send several write bursts as one: each `(to, data)` becomes its own burst, applied by
    /// the exporter in this order, and all go out in one system call (one TCP segment when
    /// they are small): gathered when together they are at most [`GATHER`] bytes, or as the
    /// first part's header and bytes (up to [`BIG_FIRST`], sent from where they are) followed
    /// by the rest gathered (a transfer and the word that publishes it); larger sets go burst
    /// by burst. The exporter cannot tell the difference: this only saves system calls.
    pub fn send_writes(&self, nic: &NicInner, parts: &[(Target, &[u8])]) -> Result<(), LinkError> {
        let payload: usize = parts.iter().map(|(_, d)| d.len()).sum();
        let total = payload + parts.len() * frame::WRITE_HEADER;
        let big_first = parts.split_first().filter(|((_, first), rest)| {
            first.len() <= BIG_FIRST && rest.iter().map(|(_, d)| d.len() + frame::WRITE_HEADER).sum::<usize>() <= GATHER
        });
        if parts.len() < 2 || (total > GATHER && big_first.is_none()) {
            for (to, d) in parts {
                self.send_write(nic, *to, Payload::Bytes(d), d.len())?;
            }
            return Ok(());
        }
        {
            // Each part is a burst the peer acknowledges on its own.
            let mut st = lock(&self.state);
            if !st.window_allows(payload as u64) {
                drop(st);
                self.wait_window(nic, payload as u64)?;
                st = lock(&self.state);
            }
            for (_, d) in parts {
                st.on_write_sent(d.len() as u64);
            }
        }
        // Gathered in this thread's buffer (a stack array would be zeroed on every send).
        thread_local! {
            static GATHERED: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(GATHER));
        }
        let by = SendBy::After(self.timeout);
        GATHERED.with_borrow_mut(|buf| {
            buf.clear();
            match big_first.filter(|_| total > GATHER) {
                Some(((to, first), rest)) => {
                    for (to, d) in rest {
                        buf.extend_from_slice(&frame::write_header(to, d.len()));
                        buf.extend_from_slice(d);
                    }
                    let head = frame::write_header(to, first.len());
                    self.send_slices_blocking(nic, &[&head, first, buf], by)
                }
                None => {
                    for (to, d) in parts {
                        buf.extend_from_slice(&frame::write_header(to, d.len()));
                        buf.extend_from_slice(d);
                    }
                    self.send_blocking(nic, buf, Payload::Bytes(&[]), 0, by)
                }
            }
        })?;
        self.stats.bursts_out.fetch_add(parts.len() as u64, Ordering::Relaxed);
        self.stats.bytes_out.fetch_add(payload as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Send the concatenation of `slices` (whole frames), blocking until `deadline`, with
    /// as few system calls as the socket allows.
    fn send_slices_blocking(&self, nic: &NicInner, slices: &[&[u8]], mut by: SendBy) -> Result<(), LinkError> {
        if self.is_closed() {
            return Err(self.down());
        }
        let _tx = lock(&self.tx);
        // Queued control frames first (frames never interleave: they are whole).
        while !self.flush_overflow_nonblocking() {
            if self.is_closed() {
                return Err(self.down());
            }
            self.wait_writable(nic, &mut by)?;
        }
        let total: usize = slices.iter().map(|s| s.len()).sum();
        let mut done = 0usize;
        while done < total {
            let mut skip = done;
            let iov: Vec<IoSlice<'_>> = slices
                .iter()
                .filter_map(|s| {
                    if skip >= s.len() {
                        skip -= s.len();
                        return None;
                    }
                    let rest = &s[skip..];
                    skip = 0;
                    Some(IoSlice::new(rest))
                })
                .collect();
            match self.sendv_now(&iov) {
                Ok(0) => {
                    self.close(Status::Other, "connection closed while sending");
                    return Err(self.down());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.wait_writable(nic, &mut by)?,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.close(Status::Other, format!("send failed: {e}"));
                    return Err(self.down());
                }
            }
        }
        // Control frames queued while we were sending.
        if self.has_queued() {
            self.flush_overflow_nonblocking();
        }
        Ok(())
    }

    // ---- waiting for replies ------------------------------------------------------------

    /// Wait until `check` finds what it waits for, processing the link ourselves when we can
    /// (no engine hop) and sleeping on the condition variable otherwise.
    pub fn wait_until<T>(
        &self,
        nic: &NicInner,
        deadline: Instant,
        mut check: impl FnMut(&mut Waits) -> Option<T>,
        window: bool,
    ) -> Result<T, LinkError> {
        let step = || self.progress(nic);
        // Nobody else reads the link with manual progress: sleep on the sockets, and on this
        // thread's eventfd, which another thread that takes our reply in signals
        // (`Link::wake_waiters`). Registered before the first check.
        let parked = nic.manual_progress().then(|| nic.links.park()).flatten();
        let park = |nap: Option<Duration>| {
            let nap = nap.unwrap_or(WAIT_SLICE);
            match &parked {
                Some(p) => p.sleep(nic, Some(nap)),
                None => {
                    use rustix::event::{PollFd, PollFlags, poll};
                    let mut fds = [PollFd::new(&self.sock, PollFlags::IN)];
                    let ts = rustix::time::Timespec { tv_sec: 0, tv_nsec: nap.as_nanos() as i64 };
                    let _ = poll(&mut fds, Some(&ts));
                }
            }
        };
        let drive = progress::Drive::Itself {
            step: &step,
            park: nic.manual_progress().then_some(&park as &dyn Fn(Option<Duration>)),
        };
        progress::wait_locked(&self.waits, &self.cv, Deadline::at(deadline), Some(WAIT_SLICE), drive, |w| {
            if let Some(t) = check(w) {
                return Some(Ok(t));
            }
            if window && lock(&self.state).window_allows(1) {
                // Used by `wait_window`: any acknowledgement is worth a re-check.
                return Some(Err(LinkError::Timeout));
            }
            self.is_closed().then(|| Err(self.down()))
        })
        .unwrap_or(Err(LinkError::Timeout))
    }

    /// Wake the threads waiting for replies (`waits` changed): those on the condition
    /// variable, and with manual progress those asleep on the links.
    fn wake_waiters(&self, nic: &NicInner) {
        self.cv.notify_all();
        if nic.manual_progress() {
            nic.links.kick_parked();
        }
    }

    /// Ask for an ordering barrier: returns once every write sent before has been applied.
    pub fn barrier(&self, nic: &NicInner) -> Result<(), LinkError> {
        let token = lock(&self.state).next_token();
        lock(&self.waits).pongs.insert(token, false);
        self.send_frame_blocking(nic, &Frame::Ping { token })?;
        let deadline = Instant::now() + self.timeout;
        self.wait_until(nic, deadline, |w| (w.pongs.get(&token) == Some(&true)).then(|| w.pongs.remove(&token)), false)
            .map(|_| ())
    }

    /// Start a read of `len` bytes at `from`; returns its id.
    pub fn start_read(
        &self,
        nic: &NicInner,
        from: Target,
        len: u32,
        notify: Option<(Arc<EqInner>, u64)>,
    ) -> Result<u64, LinkError> {
        let id = {
            let mut w = lock(&self.waits);
            let id = w.id();
            w.reads.insert(id, ReadSlot { data: Vec::new(), status: None, done: false, notify, into: None });
            id
        };
        self.send_frame_blocking(nic, &Frame::ReadReq(ReadReq { id, from, len }))?;
        Ok(id)
    }

    /// Start a read of `len` bytes at `from` whose answer goes straight into `into.ap`.
    pub fn start_read_into(&self, nic: &NicInner, from: Target, len: u32, into: ReadInto) -> Result<(), LinkError> {
        let id = {
            let mut w = lock(&self.waits);
            let id = w.id();
            w.reads
                .insert(id, ReadSlot { data: Vec::new(), status: None, done: false, notify: None, into: Some(into) });
            id
        };
        if let Err(e) = self.send_frame_blocking(nic, &Frame::ReadReq(ReadReq { id, from, len })) {
            // Not sent: nobody will answer. (If the link closed meanwhile, `close` may have
            // run the callback already; then the slot is gone.)
            let slot = lock(&self.waits).reads.remove(&id);
            drop(slot);
            return Err(e);
        }
        Ok(())
    }

    /// Wait for read `id`.
    pub fn finish_read(&self, nic: &NicInner, id: u64, deadline: Instant) -> Result<(Status, Vec<u8>), LinkError> {
        let r = self.wait_until(
            nic,
            deadline,
            |w| match w.reads.get(&id) {
                Some(s) if s.done => w.reads.remove(&id).map(|s| (s.status.unwrap_or(Status::Other), s.data)),
                _ => None,
            },
            false,
        );
        if r.is_err() {
            lock(&self.waits).reads.remove(&id);
        }
        r
    }

    /// Whether read `id` has completed (without waiting).
    pub fn read_done(&self, id: u64) -> bool {
        lock(&self.waits).reads.get(&id).is_none_or(|s| s.done)
    }

    // ---- receiving ----------------------------------------------------------------------

    /// Process what has arrived, if no other thread is doing it, [`PROGRESS_BUDGET`] bytes
    /// at most (a peer that floods the link cannot keep a waiting thread from its deadline:
    /// the thread looks again). Returns whether anything was processed.
    pub fn progress(&self, nic: &NicInner) -> bool {
        if self.is_closed() {
            return false;
        }
        match self.rx.try_lock() {
            Ok(mut rx) => {
                let did = self.receive(nic, &mut rx, PROGRESS_BUDGET);
                drop(rx);
                // What the receive answered (acknowledgements, pongs) was sent then, unless
                // the sender was busy: then it is queued.
                if self.has_queued() {
                    self.try_flush();
                }
                did
            }
            Err(_) => false,
        }
    }

    /// The engine's entry: wait for the receive lock, process at most `budget` bytes.
    /// Returns whether the budget ran out (more may be pending); None if a leader sleeps in
    /// the socket's `recv` with the lock ([`Link::sleeper`]): it reads what comes, and the
    /// engine must not wait for it (it could sleep a whole second).
    pub fn engine_receive(&self, nic: &NicInner, budget: usize) -> Option<bool> {
        if self.is_closed() {
            return Some(false);
        }
        let more = {
            let mut rx = loop {
                match self.rx.try_lock() {
                    Ok(rx) => break rx,
                    Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => {
                        // A hint (Relaxed): a sleeper not seen yet is seen at the next look;
                        // any other holder receives for a moment only.
                        if self.rx_asleep.load(Ordering::Relaxed) {
                            return None;
                        }
                        std::thread::yield_now();
                    }
                }
            };
            let before = self.stats.bytes_in.load(Ordering::Relaxed);
            self.receive(nic, &mut rx, budget);
            self.stats.bytes_in.load(Ordering::Relaxed) - before >= budget as u64
        };
        self.try_flush();
        Some(more)
    }

    /// The receive side, for a sleep in the socket's `recv` by a queue's leader
    /// (`wake.rs::Sleepers::sleep`): None if the link cannot be slept on now (closed, not
    /// blocking, paused for a peer that does not read, or another thread receives).
    pub fn sleeper(&self) -> Option<RecvSleep<'_>> {
        if !self.sleepable || self.is_closed() || self.rx_paused.load(Ordering::Acquire) {
            return None;
        }
        let rx = match self.rx.try_lock() {
            Ok(rx) => rx,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        // SYNC POINT: pairs with the Release store in `interrupt`, made after its `ioctl`
        // made the socket non-blocking: seen set here, ours comes after that one.
        if self.kicked.swap(false, Ordering::AcqRel) && rustix::io::ioctl_fionbio(&self.sock, false).is_err() {
            self.kicked.store(true, Ordering::Relaxed);
            return None;
        }
        // A hint for the engine (Relaxed: it only decides whether to wait for the lock).
        self.rx_asleep.store(true, Ordering::Relaxed);
        Some(RecvSleep { link: self, rx })
    }

    /// End a sleep in the socket's `recv` (`wake.rs::Sleepers::kick`): the socket made
    /// non-blocking first, so that a sleeper not yet in `recv` returns at once from it
    /// (the kernel looks at the mode as the call begins), then `sig` for one already in it
    /// (it ends with EINTR). Thread `tid` must be alive: the caller holds what the sleeper
    /// clears, after it woke, before it can go.
    pub fn interrupt(&self, tid: i32, sig: i32) {
        let _ = rustix::io::ioctl_fionbio(&self.sock, true);
        // SYNC POINT: pairs with the AcqRel swap in `sleeper`, which makes the socket
        // blocking again for the next sleep (never before our `ioctl`, which it follows).
        self.kicked.store(true, Ordering::Release);
        let _ = clan_shm::wakesig::interrupt(tid, sig);
    }

    /// Receive loop: decode buffered bytes, read more (straight into an aperture when inside
    /// an accepted burst), until the socket is drained or `budget` bytes were taken.
    fn receive(&self, nic: &NicInner, rx: &mut Rx, budget: usize) -> bool {
        // Bytes a sleeper read, and the socket drained then: decode them, ask no more.
        let hinted = std::mem::take(&mut rx.drained);
        let mut did = hinted;
        let mut taken = 0usize;
        let mut drained = hinted;
        loop {
            if let Err(e) = self.decode_buffered(nic, rx) {
                self.close(Status::Malformed, format!("protocol error from {}: {e}", self.peer));
                return true;
            }
            if self.is_closed() {
                return did;
            }
            if self.queued() > self.max_queued {
                // The peer does not read what it is owed: read no more from it until it does.
                if !self.rx_paused.swap(true, Ordering::AcqRel) {
                    lock(&self.state).on_tx_blocked(true, Instant::now());
                    tracing::debug!(peer = %self.peer, queued = self.queued(), "link: the peer does not read; pausing");
                }
                break;
            }
            if taken >= budget || drained {
                break;
            }
            // Straight into place: inside an accepted burst, nothing buffered.
            if rx.head == rx.tail {
                rx.head = 0;
                rx.tail = 0;
                if let Some(Pending::Write { to, remaining }) = rx.dec.pending_payload() {
                    if remaining >= 1024 && rx.burst.as_ref().is_some_and(|b| b.ap.is_some()) {
                        match self.receive_direct(rx, to, remaining) {
                            Ok(0) => {
                                self.close(Status::Other, "connection closed by the peer");
                                return true;
                            }
                            Ok(n) => {
                                taken += n;
                                did = true;
                                continue;
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                self.close(Status::Other, format!("receive failed: {e}"));
                                return true;
                            }
                        }
                    }
                }
            } else if rx.tail == rx.buf.len() {
                rx.buf.copy_within(rx.head..rx.tail, 0);
                rx.tail -= rx.head;
                rx.head = 0;
            }
            let want = if rx.dec.pending_payload().is_some() {
                RX_CHUNK
            } else if rx.bulk && rx.head == rx.tail {
                HEADER_READ
            } else {
                rx.buf.len() - rx.tail
            };
            let end = (rx.tail + want).min(rx.buf.len());
            let tail = rx.tail;
            match self.recv_now(&mut rx.buf[tail..end]) {
                Ok(0) => {
                    self.close(Status::Other, "connection closed by the peer");
                    return true;
                }
                Ok(n) => {
                    rx.tail += n;
                    taken += n;
                    did = true;
                    if n < end - tail {
                        // A short read: the socket is drained for now. Process what came and
                        // stop, rather than pay one more system call to hear EAGAIN (new data
                        // makes the socket readable again: a new epoll edge).
                        drained = true;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // (only the holder of `rx` writes it: a load and a store)
                    let e = &self.stats.empty_receives;
                    e.store(e.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.close(Status::Other, format!("receive failed: {e}"));
                    return true;
                }
            }
        }
        if did {
            let (bursts, bytes) = std::mem::take(&mut rx.applied);
            // Only the holder of `rx` writes these two (Relaxed: statistics, ordering
            // nothing): a load and a store, no locked add.
            let st = &self.stats;
            st.bursts_in.store(st.bursts_in.load(Ordering::Relaxed) + bursts, Ordering::Relaxed);
            st.bytes_in.store(st.bytes_in.load(Ordering::Relaxed) + bytes, Ordering::Relaxed);
            // Relaxed: a hint for the timer, which only needs to see it eventually.
            self.heard.store(true, Ordering::Relaxed);
            rx.unacked.0 += bursts;
            rx.unacked.1 += bytes;
            if rx.unacked.1 >= self.ack_every {
                let (bursts, bytes) = std::mem::take(&mut rx.unacked);
                let ack = {
                    let mut st = lock(&self.state);
                    for _ in 0..bursts {
                        st.on_write_applied(true, 0);
                    }
                    st.on_write_applied(false, bytes);
                    st.poll_ack(false)
                };
                if let Some(a) = ack {
                    self.send_control(&Frame::Ack(a));
                }
            }
        }
        did
    }

    /// Read burst payload from the socket straight into the aperture, stopping where a
    /// tripwire's watched range ends, then fire what completed.
    fn receive_direct(&self, rx: &mut Rx, to: Target, remaining: u64) -> std::io::Result<usize> {
        let ctx = rx.burst.as_ref().expect("checked by the caller");
        let ap = ctx.ap.as_ref().expect("checked by the caller").clone();
        let end = ctx.end;
        let n = ap.window.receive_piece(to.offset, remaining, end, &mut rx.scratch, |seg, rel, len| {
            seg.recv_from(&self.sock, rel, len)
        })?;
        if n == 0 {
            return Ok(0);
        }
        rx.dec.consume_payload(n as u64).map_err(|e| std::io::Error::other(e.to_string()))?;
        rx.applied.1 += n as u64;
        if n as u64 == remaining {
            rx.burst = None;
        }
        Ok(n)
    }

    fn decode_buffered(&self, nic: &NicInner, rx: &mut Rx) -> Result<(), clan_wire::WireError> {
        while rx.head < rx.tail {
            if self.queued() > self.max_queued {
                return Ok(());
            }
            if rx.dec.at_boundary() && self.apply_transfer(rx) {
                continue;
            }
            let (item, used) = {
                let Some((item, used)) = rx.dec.next(&rx.buf[rx.head..rx.tail])? else { break };
                (owned_item(item), used)
            };
            let data_at = rx.head + used - item.data_len();
            rx.head += used;
            self.handle(nic, rx, item, data_at)?;
        }
        Ok(())
    }

    /// The common small transfer, whole in the buffer: a body and the word that publishes it
    /// (a stream's bytes and its counter), or a body, its lead word and the word (a
    /// message-queue slot), all to one import. Applied as the exporter's own write of that
    /// shape is (`Window::write_then_store_u64`, `Window::write_led_then_store_u64`): one
    /// snooped transfer with one fence, where burst by burst would take one for each. The
    /// memory and the tripwires end as burst by burst: the bursts land in order, each word
    /// with one atomic store, and every tripwire over them fires once they are in place.
    /// Anything else (a burst not whole yet, a refusal to send) is left to the burst-by-burst
    /// path. Returns whether the bursts were applied.
    fn apply_transfer(&self, rx: &mut Rx) -> bool {
        let mut dec = rx.dec.clone();
        let buf = &rx.buf[rx.head..rx.tail];
        let Some(body) = WholeBurst::decode(&mut dec, buf, 0) else { return false };
        // A body of word size is one atomic store on its own: not this shape.
        if body.is_word() || body.len == 0 {
            return false;
        }
        let Some(w1) = WholeBurst::decode(&mut dec, buf, body.end) else { return false };
        if w1.to.key != body.to.key || !w1.is_u64() {
            return false;
        }
        let mut after_lead = dec.clone();
        let w2 = WholeBurst::decode(&mut after_lead, buf, w1.end).filter(|w2| {
            w2.to.key == body.to.key && w2.is_u64() && w1.to.offset.checked_add(8) == Some(body.to.offset)
        });
        let ap = match self.check_write(rx, &body.to, body.len as u64) {
            Ok(ap) => ap,
            Err(_) => return false,
        };
        let Some((_, rec)) = &rx.access else { return false };
        let words_ok = Self::check_record(rec, &ap, &w1.to, 8, Rights::WRITE).is_ok()
            && w2.as_ref().is_none_or(|w2| Self::check_record(rec, &ap, &w2.to, 8, Rights::WRITE).is_ok());
        if !words_ok {
            return false;
        }
        let at = rx.head;
        let data = &rx.buf[at + body.data..at + body.data + body.len];
        let v1 = w1.word(&rx.buf[at..]);
        let used = match &w2 {
            // Checked above (the bounds and rights of all three): failures here are races
            // with an unexport, as for the burst-by-burst path.
            None => {
                let _ = ap.window.write_then_store_u64(body.to.offset, data, w1.to.offset, v1);
                w1.end
            }
            Some(w2) => {
                let v2 = w2.word(&rx.buf[at..]);
                let _ = ap.window.write_led_then_store_u64(w1.to.offset, v1, data, w2.to.offset, v2);
                dec = after_lead;
                w2.end
            }
        };
        let bursts = if w2.is_some() { 3 } else { 2 };
        rx.applied.0 += bursts;
        rx.applied.1 += body.len as u64 + 8 * (bursts - 1);
        rx.dec = dec;
        rx.head += used;
        rx.bulk = false;
        true
    }

    fn refuse(&self, rx: &mut Rx, status: Status, key: u64, offset: u64) {
        self.stats.refused_in.fetch_add(1, Ordering::Relaxed);
        // Writes to an aperture unexported meanwhile are a normal race (the importer learns
        // of it from this refusal, with several writes possibly in flight): not a reason to
        // drop the link. Forged keys, rights and bounds violations are.
        if status != Status::Revoked {
            rx.bad += 1;
        }
        self.send_control(&Frame::Refused(Refused { status, key, offset }));
        if rx.bad > MAX_BAD_FRAMES {
            self.close(Status::TooManyErrors, format!("{} sent too many bad frames", self.peer));
        }
    }

    /// Validate an access through import `key` before anything is touched.
    fn check_access(&self, to: &Target, len: u64, need: Rights) -> Result<Arc<ApertureInner>, Status> {
        let rec = lock(&self.exports).get(&to.key).cloned().ok_or(Status::BadKey)?;
        let ap = rec.ap.upgrade().ok_or(Status::Revoked)?;
        Self::check_record(&rec, &ap, to, len, need)?;
        Ok(ap)
    }

    /// [`Link::check_access`] for a write burst, through the record cached in `rx.access`.
    fn check_write(&self, rx: &mut Rx, to: &Target, len: u64) -> Result<Arc<ApertureInner>, Status> {
        if !matches!(&rx.access, Some((key, _)) if *key == to.key) {
            let rec = lock(&self.exports).get(&to.key).cloned().ok_or(Status::BadKey)?;
            rx.access = Some((to.key, rec));
        }
        let Some((_, rec)) = &rx.access else { return Err(Status::BadKey) };
        let ap = rec.ap.upgrade().ok_or(Status::Revoked)?;
        Self::check_record(rec, &ap, to, len, Rights::WRITE)?;
        Ok(ap)
    }

    /// Whether `rec` (of live `ap`) allows an access of `len` bytes at `to` with `need`.
    fn check_record(rec: &ExportRec, ap: &ApertureInner, to: &Target, len: u64, need: Rights) -> Result<(), Status> {
        if rec.aperture != to.aperture || rec.generation != to.generation {
            return Err(Status::BadKey);
        }
        if !rec.rights.contains(need) {
            return Err(Status::NoRights);
        }
        let end = to.offset.checked_add(len).ok_or(Status::OutOfBounds)?;
        if to.offset < rec.lo || end > rec.hi {
            return Err(Status::OutOfBounds);
        }
        if ap.window.check_live().is_err() {
            return Err(Status::Revoked);
        }
        Ok(())
    }

    fn handle(&self, nic: &NicInner, rx: &mut Rx, item: OwnedItem, data_at: usize) -> Result<(), clan_wire::WireError> {
        match item {
            OwnedItem::WriteBegin { to, len } => {
                rx.bulk = len >= BULK;
                rx.applied.0 += 1;
                let ap = match self.check_write(rx, &to, len) {
                    Ok(ap) => Some(ap),
                    Err(status) => {
                        self.refuse(rx, status, to.key, to.offset);
                        None
                    }
                };
                let word = ((len == 8 || len == 4) && to.offset % len == 0).then_some((to.offset, [0u8; 8], 0usize));
                rx.burst = Some(BurstCtx { end: to.offset + len, ap, word });
            }
            OwnedItem::WriteData { to, len, last } => {
                let data = &rx.buf[data_at..data_at + len];
                if let Some(ctx) = rx.burst.as_mut() {
                    if let (Some(ap), Some((at, word, have))) = (&ctx.ap, ctx.word.as_mut()) {
                        // Gather the word; store it atomically once complete.
                        let size = (ctx.end - *at) as usize;
                        let k = len.min(size - *have);
                        word[*have..*have + k].copy_from_slice(&data[..k]);
                        *have += k;
                        if *have == size {
                            let w = &ap.window;
                            let _ = if size == 8 {
                                w.store_u64(*at, u64::from_le_bytes(*word))
                            } else {
                                w.store_u32(*at, u32::from_le_bytes([word[0], word[1], word[2], word[3]]))
                            };
                        }
                    } else if let Some(ap) = &ctx.ap {
                        let _ = ap.window.write_piece(to.offset, data, ctx.end, &mut rx.scratch);
                    }
                }
                rx.applied.1 += len as u64;
                if last {
                    rx.burst = None;
                }
            }
            OwnedItem::ReadRespBegin { id, status, len } => {
                let mut w = lock(&self.waits);
                if w.reads.get(&id).is_some_and(|s| s.into.is_some()) {
                    if status != Status::Ok || len == 0 {
                        let slot = w.reads.remove(&id);
                        drop(w);
                        if let Some(into) = slot.and_then(|s| s.into) {
                            (into.done)(if status == Status::Ok && into.want == 0 { Ok(0) } else { Err(status) });
                        }
                    }
                    return Ok(());
                }
                if let Some(s) = w.reads.get_mut(&id) {
                    s.status = Some(status);
                    s.data.reserve(len as usize);
                    if len == 0 {
                        s.done = true;
                        if let Some((eq, token)) = s.notify.take() {
                            eq.post_local(crate::event_queue::Word::ReadComplete { token });
                        }
                        self.wake_waiters(nic);
                    }
                }
            }
            OwnedItem::ReadRespData { id, len, last } => {
                let data = &rx.buf[data_at..data_at + len];
                let mut w = lock(&self.waits);
                if let Some(into) = w.reads.get_mut(&id).and_then(|s| s.into.as_mut()) {
                    // Straight into the aperture (its write tripwires fire as for any
                    // incoming write), never past what was asked for.
                    let room = into.want - into.got;
                    let k = (len as u64).min(room) as usize;
                    if k > 0 {
                        let _ = into.ap.window.write(into.abs + into.got, &data[..k]);
                        into.got += k as u64;
                    }
                    let overlong = len as u64 > room;
                    if last || overlong {
                        let slot = w.reads.remove(&id);
                        drop(w);
                        if let Some(into) = slot.and_then(|s| s.into) {
                            let ok = !overlong && into.got == into.want;
                            (into.done)(if ok { Ok(into.got) } else { Err(Status::Malformed) });
                        }
                    }
                    return Ok(());
                }
                if let Some(s) = w.reads.get_mut(&id) {
                    s.data.extend_from_slice(data);
                    if last {
                        s.done = true;
                        if let Some((eq, token)) = s.notify.take() {
                            eq.post_local(crate::event_queue::Word::ReadComplete { token });
                        }
                        self.wake_waiters(nic);
                    }
                }
            }
            OwnedItem::Frame(f) => self.handle_frame(nic, rx, f, data_at)?,
        }
        Ok(())
    }

    fn handle_frame(
        &self,
        nic: &NicInner,
        rx: &mut Rx,
        f: OwnedFrame,
        data_at: usize,
    ) -> Result<(), clan_wire::WireError> {
        match f {
            OwnedFrame::ReadReq(r) => match self.check_access(&r.from, u64::from(r.len), Rights::READ) {
                Ok(ap) => {
                    if r.len > MAX_READ {
                        self.refuse(rx, Status::TooLarge, r.from.key, r.from.offset);
                        let mut b = Vec::new();
                        frame::encode_read_resp(r.id, Status::TooLarge, &[], &mut b);
                        self.send_control_bytes(&b);
                        return Ok(());
                    }
                    let mut data = vec![0u8; r.len as usize];
                    let w = &ap.window;
                    let ok = if r.len == 8 && r.from.offset % 8 == 0 {
                        w.load_u64(r.from.offset).map(|v| data.copy_from_slice(&v.to_le_bytes()))
                    } else {
                        w.read(r.from.offset, &mut data).map(|_| ())
                    };
                    let mut b = Vec::with_capacity(data.len() + 32);
                    let status = if ok.is_ok() { Status::Ok } else { Status::Revoked };
                    frame::encode_read_resp(r.id, status, if ok.is_ok() { &data } else { &[] }, &mut b);
                    self.send_control_bytes(&b);
                }
                Err(status) => {
                    self.refuse(rx, status, r.from.key, r.from.offset);
                    let mut b = Vec::new();
                    frame::encode_read_resp(r.id, status, &[], &mut b);
                    self.send_control_bytes(&b);
                }
            },
            OwnedFrame::Import { id, importer_nic, importer_port, desc } => {
                let desc_bytes = &rx.buf[data_at..data_at + desc];
                let importer = crate::addr::EndpointAddr::new(NicAddr::from(importer_nic), importer_port);
                let reply = nic.grant_link_import(self, importer, desc_bytes, id);
                if reply.status != Status::Ok {
                    self.stats.refused_in.fetch_add(1, Ordering::Relaxed);
                }
                self.send_control(&Frame::ImportReply(reply));
            }
            OwnedFrame::Other(fr) => match fr {
                SmallOwned::ImportReply(r) => {
                    let mut w = lock(&self.waits);
                    if let Some(slot) = w.imports.get_mut(&r.id) {
                        *slot = Some(r);
                        self.wake_waiters(nic);
                    }
                }
                SmallOwned::Unimport { key } => {
                    rx.access = None;
                    lock(&self.exports).remove(&key);
                }
                SmallOwned::Ack(a) => {
                    lock(&self.state).on_ack(a)?;
                    let _g = lock(&self.waits);
                    self.wake_waiters(nic);
                }
                SmallOwned::Credit { bytes } => lock(&self.state).on_credit(bytes),
                SmallOwned::Refused(r) => {
                    self.stats.refused_out.fetch_add(1, Ordering::Relaxed);
                    if let Some(t) = lock(&self.targets).get(&r.key).and_then(Weak::upgrade) {
                        t.refused.fetch_add(1, Ordering::Relaxed);
                        if r.status == Status::Revoked || r.status == Status::BadKey {
                            t.revoked.store(true, Ordering::Release);
                        }
                    }
                }
                SmallOwned::Ping { token } => self.send_control(&Frame::Pong { token }),
                SmallOwned::Pong { token } => {
                    lock(&self.state).on_pong(token, Instant::now());
                    let mut w = lock(&self.waits);
                    if let Some(p) = w.pongs.get_mut(&token) {
                        *p = true;
                        self.wake_waiters(nic);
                    }
                }
                SmallOwned::Oob(o) => {
                    let from = crate::addr::EndpointAddr::new(NicAddr::from(o.from_nic), o.from_port);
                    let status = if NicAddr::from(o.from_nic) != self.peer {
                        Status::Denied
                    } else {
                        let who = crate::addr::PeerIdentity::Remote { nic: self.peer, source: self.source };
                        let d = if o.id == 0 {
                            nic.deliver_oneway(from, who, o.to_port, o.payload)
                        } else {
                            nic.deliver_oob(from, who, o.to_port, o.payload)
                        };
                        match d {
                            Ok(()) => Status::Ok,
                            Err(clan_wire::control::Code::QueueFull) => Status::QueueFull,
                            Err(_) => Status::NoSuchEndpoint,
                        }
                    };
                    if status != Status::Ok {
                        tracing::debug!(peer = %self.peer, to_port = o.to_port, ?status, "link: out-of-band message refused");
                    }
                    // Id 0: the sender does not wait for the result.
                    if o.id != 0 {
                        self.send_control(&Frame::OobResult { id: o.id, status });
                    }
                }
                SmallOwned::OobResult { id, status } => {
                    let mut w = lock(&self.waits);
                    if let Some(slot) = w.oobs.get_mut(&id) {
                        *slot = Some(status);
                        self.wake_waiters(nic);
                    }
                }
                SmallOwned::Close { status } => {
                    self.close(status, format!("closed by {} ({status:?})", self.peer));
                }
                SmallOwned::Notify { to, len } => match self.check_access(&to, len, Rights::WRITE) {
                    // Behind the writes it follows (frames are applied in order): they landed.
                    Ok(ap) => ap.post_notification(to.offset, len),
                    Err(status) => self.refuse(rx, status, to.key, to.offset),
                },
                SmallOwned::Hello | SmallOwned::Auth | SmallOwned::Welcome => {
                    // Hand-shake frames have no place on an established link.
                    self.refuse(rx, Status::Malformed, 0, 0);
                }
            },
        }
        Ok(())
    }

    /// Keepalive: called by the engine with the time.
    pub fn handle_timeout(&self, now: Instant) -> Instant {
        let t = {
            let mut st = lock(&self.state);
            // Heard since the last look: as of now (at most one timer period late, which
            // moves keepalive and death by as much; receiving reads no clock for it).
            if self.heard.swap(false, Ordering::Relaxed) {
                st.on_heard(now);
            }
            st.handle_timeout(now)
        };
        match t {
            Timeout::None => {}
            Timeout::Ping(token) => self.send_control(&Frame::Ping { token }),
            Timeout::Dead => self.close(Status::Timeout, format!("{} silent for too long", self.peer)),
            Timeout::Stalled => {
                self.close(Status::TooManyErrors, format!("{} does not read what it is owed", self.peer))
            }
        }
        lock(&self.state).poll_timeout()
    }

    pub fn next_id(&self) -> u64 {
        lock(&self.waits).id()
    }
}

/// A write burst decoded whole from a receive buffer, by position.
#[derive(Debug, Clone, Copy)]
struct WholeBurst {
    to: Target,
    /// Where its bytes start, and how many.
    data: usize,
    len: usize,
    /// Where the next item starts.
    end: usize,
}

impl WholeBurst {
    /// The burst at `buf[from..]`, if `dec` (at a frame boundary) decodes one there whose
    /// bytes are all in `buf`.
    fn decode(dec: &mut Decoder, buf: &[u8], from: usize) -> Option<WholeBurst> {
        let rest = buf.get(from..)?;
        let Ok(Some((Item::WriteBegin { to, len }, u1))) = dec.next(rest) else { return None };
        if len == 0 {
            return None;
        }
        let Ok(Some((Item::WriteData { data, last: true, .. }, u2))) = dec.next(rest.get(u1..)?) else { return None };
        if data.len() as u64 != len {
            return None;
        }
        Some(WholeBurst { to, data: from + u1 + u2 - data.len(), len: data.len(), end: from + u1 + u2 })
    }

    /// Whether the burst-by-burst path stores it as one atomic word.
    fn is_word(&self) -> bool {
        (self.len == 8 || self.len == 4) && self.to.offset % self.len as u64 == 0
    }

    fn is_u64(&self) -> bool {
        self.len == 8 && self.to.offset % 8 == 0
    }

    /// Its bytes as a word (`buf` is what `decode` was given).
    fn word(&self, buf: &[u8]) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[self.data..self.data + 8]);
        u64::from_le_bytes(b)
    }
}

/// Decoded items with the data referred to by position (so the receive buffer can be
/// borrowed again while handling them).
enum OwnedItem {
    Frame(OwnedFrame),
    WriteBegin { to: Target, len: u64 },
    WriteData { to: Target, len: usize, last: bool },
    ReadRespBegin { id: u64, status: Status, len: u64 },
    ReadRespData { id: u64, len: usize, last: bool },
}

impl OwnedItem {
    /// Bytes at the end of the consumed input that are data (to find them in the buffer).
    fn data_len(&self) -> usize {
        match self {
            OwnedItem::WriteData { len, .. } | OwnedItem::ReadRespData { len, .. } => *len,
            OwnedItem::Frame(OwnedFrame::Import { desc, .. }) => *desc,
            _ => 0,
        }
    }
}

enum OwnedFrame {
    ReadReq(ReadReq),
    Import { id: u64, importer_nic: std::net::SocketAddr, importer_port: u32, desc: usize },
    Other(SmallOwned),
}

enum SmallOwned {
    ImportReply(clan_wire::ImportReply),
    Unimport { key: u64 },
    Ack(clan_wire::Ack),
    Credit { bytes: u64 },
    Refused(Refused),
    Ping { token: u64 },
    Pong { token: u64 },
    Oob(clan_wire::Oob),
    OobResult { id: u64, status: Status },
    Close { status: Status },
    Notify { to: Target, len: u64 },
    Hello,
    Auth,
    Welcome,
}

fn owned_item(i: Item<'_>) -> OwnedItem {
    match i {
        Item::WriteBegin { to, len } => OwnedItem::WriteBegin { to, len },
        Item::WriteData { to, data, last } => OwnedItem::WriteData { to, len: data.len(), last },
        Item::ReadRespBegin { id, status, len } => OwnedItem::ReadRespBegin { id, status, len },
        Item::ReadRespData { id, data, last, .. } => OwnedItem::ReadRespData { id, len: data.len(), last },
        Item::Frame(f) => OwnedItem::Frame(match f {
            Frame::ReadReq(r) => OwnedFrame::ReadReq(r),
            Frame::Import(i) => OwnedFrame::Import {
                id: i.id,
                importer_nic: i.importer_nic,
                importer_port: i.importer_port,
                desc: i.desc.len(),
            },
            Frame::ImportReply(r) => OwnedFrame::Other(SmallOwned::ImportReply(r)),
            Frame::Unimport { key } => OwnedFrame::Other(SmallOwned::Unimport { key }),
            Frame::Ack(a) => OwnedFrame::Other(SmallOwned::Ack(a)),
            Frame::Credit { bytes } => OwnedFrame::Other(SmallOwned::Credit { bytes }),
            Frame::Refused(r) => OwnedFrame::Other(SmallOwned::Refused(r)),
            Frame::Ping { token } => OwnedFrame::Other(SmallOwned::Ping { token }),
            Frame::Pong { token } => OwnedFrame::Other(SmallOwned::Pong { token }),
            Frame::Oob(o) => OwnedFrame::Other(SmallOwned::Oob(o)),
            Frame::OobResult { id, status } => OwnedFrame::Other(SmallOwned::OobResult { id, status }),
            Frame::Close { status } => OwnedFrame::Other(SmallOwned::Close { status }),
            Frame::Notify { to, len } => OwnedFrame::Other(SmallOwned::Notify { to, len }),
            Frame::Hello(_) => OwnedFrame::Other(SmallOwned::Hello),
            Frame::Auth(_) => OwnedFrame::Other(SmallOwned::Auth),
            Frame::Welcome => OwnedFrame::Other(SmallOwned::Welcome),
        }),
    }
}
