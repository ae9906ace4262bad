//! One direction of a byte stream: the distributed queue of the Tripwire paper (§4.2) for
//! unstructured data, with transfer redirection (VMMC).
//!
//! Each side of a connection exports one aperture, its *side*, laid out as below. The
//! sender writes data into the receiver's ring and advances `RX_WRITE` there (its
//! `write_i`, mirrored into the receiver); the receiver advances `CTL_READ` in the sender's
//! side (its `read_i`, mirrored into the sender). Every cross-network access is a write; each
//! side polls only its own memory. Positions are byte counts since the start of the stream;
//! the ring is empty when they are equal and full with one free byte.
//!
//! ```text
//! side aperture (exported by each party; the peer writes the fields marked "peer")
//!    0  CTL_READ      peer (the receiver of my outgoing data): bytes it has consumed
//!   64  CTL_POST_SEQ  peer: seqlock of a posted receive buffer (even: stable)
//!   72  CTL_POST_AT   peer: stream position the posted buffer starts at
//!   80  CTL_POST_LEN  peer: its length
//!   96  CTL_LEFT      peer: LEFT bit | its final read position, once it has stopped reading
//!                     this stream (hand-over: the bytes past it go again by other means)
//!  120  CTL_NUDGE     peer: the token I wrote into its side, stored back when it took my
//!                     data while I slept waiting for its own (my data tripwire watches it)
//!  128  RX_WRITE      peer (the sender of my incoming data): bytes it has written
//!  136  RX_FIN        peer: FIN bit | final position, once it has shut down writing
//!  144  RX_ACK_SEQ    peer: the post it redirected (its seq)
//!  152  RX_ACK_AT     peer: the position redirection began at
//!  160  RX_TAKEN      peer: non-zero once it has taken back what we left unread
//!  168  CTL_ASLEEP    peer: a token (count << 16 | its CPU), new each time it goes to sleep
//!                     waiting for my data (see "Early wake-up"); on `RX_WRITE`'s line, which
//!                     a reader loads anyway (no cold line more per read at 10 000 streams)
//! 4096  ring          incoming data, `cap` bytes
//! 4096+cap  post area incoming data redirected into a posted buffer, `post_cap` bytes
//! ```
//!
//! ## Transfer redirection
//!
//! A receiver that knows where the next bytes should go *posts* a buffer in its post area
//! for stream positions `[P, P+L)` (`P` = its read position), by writing the post record
//! into the sender's side. The sender, before writing the bytes at position `W`, looks at
//! the record (its own memory); if `W` falls in a posted range it first writes an
//! acknowledgement `(seq, W)` into the receiver's side and then writes the bytes straight
//! into the posted buffer, skipping the ring. Bytes `[P, W)` had already gone to the ring
//! before the sender saw the post: the receiver copies them. The receiver learns exactly
//! which part was placed directly (`RX_ACK_AT`), because the acknowledgement is written
//! before the data it covers and before `RX_WRITE` moves past it (writes from one NIC to
//! another are applied in order). Redirected positions take no ring space.
//!
//! ## Early wake-up
//!
//! A reader that sleeps for data costs the sender a wake-up, and the data then waits for the
//! sleeper's CPU to wake (tens of microseconds on a virtual machine's idle CPU). In a
//! request/response exchange the reply is made right after the request is taken; so, as a
//! Unix socket does (its reader's wait queue is also its writers', which the peer's read
//! wakes as it frees what it took), a reader going to sleep leaves a token (`CTL_ASLEEP`) in
//! the side of the peer it waits for; the peer, when it next takes data from us and finds a
//! token it has not answered, stores it into our `CTL_NUDGE`, which our data tripwire
//! watches. Our CPU wakes while the peer makes its reply, not after. Only a hint: a token
//! missed costs only the early wake-up, a nudge with no reply behind it only a re-check and
//! a sleep (at most one per sleep). A peer on the same CPU is not nudged (the wake-up would
//! only take the CPU from the one making the reply), nor one across a link (the nudge would
//! be one more frame for the reply to wait behind).
//!
//! The same token tells a reader about to spin for data whether the spin can help: when the
//! peer last slept on the CPU this thread runs on and this thread may run nowhere else, the
//! peer, woken by our request, needs this very CPU to make the reply, and a spin would hold
//! it from it for the whole spin. Such a read sleeps at once (`wait::spin_is_futile`; both
//! processes pinned to one CPU with the default spin: 53 µs a round trip before, 11.5–14 µs
//! after, a Unix socket 13–15 µs).
//!
//! ## Memory written by the other side is untrusted
//!
//! Every position read from shared memory is checked against what it can legally be
//! (`RX_WRITE` never beyond `read + cap` outside a redirection, never backwards; posts within
//! the post area); a peer that breaks the protocol gets an error, never an access outside
//! the apertures.

use std::time::{Duration, Instant};

use clan::{AccessError, Aperture, Tripwire, TripwireConfig};

use crate::wait::{SLICE, Spin, WaitError, wait_check, wait_check_with, wait_sliced, wait_tripwire};

pub(crate) const CTL_READ: u64 = 0;
pub(crate) const CTL_POST_SEQ: u64 = 64;
pub(crate) const CTL_POST_AT: u64 = 72;
pub(crate) const CTL_POST_LEN: u64 = 80;
pub(crate) const CTL_LEFT: u64 = 96;
pub(crate) const CTL_ASLEEP: u64 = 168;
pub(crate) const CTL_NUDGE: u64 = 120;
pub(crate) const RX_WRITE: u64 = 128;
pub(crate) const RX_FIN: u64 = 136;
pub(crate) const RX_ACK_SEQ: u64 = 144;
pub(crate) const RX_ACK_AT: u64 = 152;
pub(crate) const RX_TAKEN: u64 = 160;
pub(crate) const RING: u64 = 4096;
const FIN: u64 = 1 << 63;
/// The flag of `CTL_LEFT` (a position is below it).
pub(crate) const LEFT: u64 = 1 << 63;

/// Bytes moved per publication of a position: half the ring (at least 1 KiB), so that the two
/// sides copy at once (measured with `clan bench queue`: a quarter costs more in publications).
fn chunk(cap: u64) -> u64 {
    (cap / 2).max(1024)
}

/// Where stream position `pos` falls in a ring of `cap` bytes: a mask when `cap` is a power
/// of two (every ring of the default geometry), else a division (a 64-bit `div`, tens of
/// cycles, on the path of every write and read).
#[inline(always)]
fn wrap(pos: u64, cap: u64) -> u64 {
    if cap.is_power_of_two() { pos & (cap - 1) } else { pos % cap }
}

/// A broken protocol, a dead peer, or an access failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PipeError {
    /// The peer wrote something impossible into our memory.
    Protocol(&'static str),
    /// An access to the peer failed (revoked, link down).
    Access(AccessError),
    /// The peer went away.
    Dead,
    /// Nothing happened in time.
    Timeout,
    /// Writing after shutdown.
    Shutdown,
}

impl From<AccessError> for PipeError {
    fn from(e: AccessError) -> PipeError {
        PipeError::Access(e)
    }
}

fn wait_err(e: WaitError) -> PipeError {
    match e {
        WaitError::Timeout => PipeError::Timeout,
        WaitError::Dead => PipeError::Dead,
        WaitError::Stale => PipeError::Access(AccessError::Revoked),
    }
}

/// The sending half: writes into the peer's side.
#[derive(Debug)]
pub(crate) struct PipeTx {
    /// Our side (the peer writes `CTL_*` here).
    mine: std::sync::Arc<Aperture>,
    /// The peer's side.
    peer: std::sync::Arc<crate::side::PeerSide>,
    cap: u64,
    post_cap: u64,
    /// Bytes written.
    write: u64,
    /// Fires when the peer consumes (space).
    space: Tripwire,
    fin: bool,
    /// The receiver's position as last read from `CTL_READ` (re-read only when the ring
    /// looks full: that word's cache line then stays with the receiver, which updates it).
    read_seen: u64,
    /// The post we are redirecting into: (seq, at, len, began-at).
    redirect: Option<(u64, u64, u64, u64)>,
    pub spin: Duration,
}

impl PipeTx {
    pub fn new(
        mine: std::sync::Arc<Aperture>,
        peer: std::sync::Arc<crate::side::PeerSide>,
        cap: u64,
        post_cap: u64,
        spin: Duration,
    ) -> Result<PipeTx, PipeError> {
        let space = wait_tripwire(&mine, CTL_READ..CTL_READ + 8)?;
        Ok(PipeTx { mine, peer, cap, post_cap, write: 0, space, fin: false, read_seen: 0, redirect: None, spin })
    }

    /// Bytes the peer has consumed, validated.
    fn read_pos(&self) -> Result<u64, PipeError> {
        let r = self.mine.load_u64(CTL_READ)?;
        if r > self.write {
            return Err(PipeError::Protocol("the receiver claims to have read more than was written"));
        }
        Ok(r)
    }

    /// The peer's current post, if stable and sane: (seq, at, len).
    fn post(&self) -> Result<Option<(u64, u64, u64)>, PipeError> {
        if self.post_cap == 0 {
            return Ok(None);
        }
        for _ in 0..8 {
            let s1 = self.mine.load_u64(CTL_POST_SEQ)?;
            if s1 == 0 {
                // Never posted (a post makes the sequence odd, then even and non-zero).
                return Ok(None);
            }
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let at = self.mine.load_u64(CTL_POST_AT)?;
            let len = self.mine.load_u64(CTL_POST_LEN)?;
            if self.mine.load_u64(CTL_POST_SEQ)? != s1 {
                continue;
            }
            if s1 == 0 || len == 0 {
                return Ok(None);
            }
            if len > self.post_cap || at > self.write {
                return Err(PipeError::Protocol("the receiver posted an impossible buffer"));
            }
            return Ok(Some((s1, at, len)));
        }
        // Being rewritten right now: treat as not posted (the bytes go to the ring).
        Ok(None)
    }

    /// Room for ring bytes now.
    fn room(&self) -> Result<u64, PipeError> {
        let used = self.write - self.read_pos()?;
        Ok((self.cap - 1).saturating_sub(used))
    }

    /// Write as much of `data` as fits now (at least one byte unless it would block);
    /// returns the bytes written (0: the ring is full).
    pub fn try_write(&mut self, data: &[u8]) -> Result<usize, PipeError> {
        if self.fin {
            return Err(PipeError::Shutdown);
        }
        if data.is_empty() {
            return Ok(0);
        }
        // Redirection: does the next position fall in a posted buffer?
        if let Some((seq, at, len)) = self.post()? {
            if self.write >= at && self.write < at + len {
                if self.redirect.is_none_or(|r| r.0 != seq) {
                    // Acknowledge first: the receiver learns where the direct part begins
                    // before any of it (and before RX_WRITE moves past it).
                    self.peer.get()?.store_u64(RX_ACK_AT, self.write)?;
                    self.peer.get()?.store_u64(RX_ACK_SEQ, seq)?;
                    self.redirect = Some((seq, at, len, self.write));
                }
                let n = (data.len() as u64).min(at + len - self.write);
                let to = RING + self.cap + (self.write - at);
                self.write += n;
                self.peer.get()?.write_then_store_u64(to, &data[..n as usize], RX_WRITE, self.write)?;
                return Ok(n as usize);
            }
        }
        let mut room = (self.cap - 1).saturating_sub(self.write - self.read_seen);
        if room < (data.len() as u64).min(chunk(self.cap)) {
            self.read_seen = self.read_pos()?;
            room = (self.cap - 1).saturating_sub(self.write - self.read_seen);
        }
        if room == 0 {
            return Ok(0);
        }
        let at = wrap(self.write, self.cap);
        // At most half the ring per publication: the receiver starts copying out
        // while the rest is still being written (with a small ring, one big write would
        // make the two sides take turns instead of working at once).
        let n = (data.len() as u64).min(room).min(chunk(self.cap));
        // A write that wraps around the end of the ring is still published at once: the
        // receiver never sees half of a small write (programs written for TCP over loopback
        // count on small writes arriving whole).
        let first = n.min(self.cap - at);
        let peer = self.peer.get()?;
        if first < n {
            peer.write(RING + at, &data[..first as usize])?;
        }
        // The bytes, then the counter that publishes them (one snooped transfer).
        self.write += n;
        let (to, rest) =
            if first < n { (RING, &data[first as usize..n as usize]) } else { (RING + at, &data[..n as usize]) };
        peer.write_then_store_u64(to, rest, RX_WRITE, self.write)?;
        Ok(n as usize)
    }

    /// Whether at least one byte can be written now (room in the ring, or a posted buffer
    /// at the write position), and the peer's read position as last seen (it moves when
    /// room frees: an edge for event-driven writers).
    pub fn poll_space(&mut self) -> Result<(bool, u64), PipeError> {
        let posted = matches!(self.post()?, Some((_, at, len)) if self.write >= at && self.write < at + len);
        self.read_seen = self.read_pos()?;
        Ok(((self.cap - 1).saturating_sub(self.write - self.read_seen) > 0 || posted, self.read_seen))
    }

    /// Whether writing was shut down here.
    pub fn is_finished(&self) -> bool {
        self.fin
    }

    /// The position the receiver stopped reading at, if it has handed the stream over
    /// (validated: never beyond what we wrote, never more than a ring behind).
    pub fn peer_left(&self) -> Result<Option<u64>, PipeError> {
        let v = self.mine.load_u64(CTL_LEFT)?;
        if v & LEFT == 0 {
            return Ok(None);
        }
        let r = v & !LEFT;
        if r > self.write || self.write - r >= self.cap {
            return Err(PipeError::Protocol("the receiver left at an impossible position"));
        }
        Ok(Some(r))
    }

    /// The receiver has handed the stream over: read back from its ring the bytes written
    /// that it never read (they must go again by other means), and write no more. The
    /// receiver keeps its side until we say we have them (`RX_TAKEN`).
    pub fn take_back(&mut self) -> Result<Vec<u8>, PipeError> {
        let r = self.peer_left()?.ok_or(PipeError::Protocol("the receiver has not left"))?;
        if self.redirect.is_some() {
            // Bytes placed in a posted buffer are not in the ring (clan run never posts).
            return Err(PipeError::Protocol("bytes redirected into a posted buffer cannot be taken back"));
        }
        let mut out = vec![0u8; (self.write - r) as usize];
        let peer = self.peer.get()?;
        let mut done = 0u64;
        while done < out.len() as u64 {
            let at = wrap(r + done, self.cap);
            let n = (out.len() as u64 - done).min(self.cap - at);
            peer.read(RING + at, &mut out[done as usize..(done + n) as usize])?;
            done += n;
        }
        self.fin = true;
        // Release (the store): the receiver may let go of its side once it reads this.
        peer.store_u64(RX_TAKEN, 1)?;
        Ok(out)
    }

    /// Wait until there is room for at least one byte.
    pub fn wait_space(&self, deadline: Option<Instant>, dead: &mut dyn FnMut() -> bool) -> Result<(), PipeError> {
        let posted = || matches!(self.post(), Ok(Some((_, at, len))) if self.write >= at && self.write < at + len);
        let spin = Spin::for_peer(self.spin, self.peer.across_link());
        wait_check(&self.space, spin, deadline, SLICE, || Ok(self.room()? > 0 || posted()), dead, wait_err)
    }

    /// Shut down writing: the receiver reads what was written, then end of stream.
    pub fn finish(&mut self) -> Result<(), PipeError> {
        if self.fin {
            return Ok(());
        }
        self.fin = true;
        self.peer.get()?.store_u64(RX_FIN, FIN | self.write)?;
        Ok(())
    }
}

/// What a completed posted receive did ([`crate::stream::Stream::recv_posted`]).
///
/// ```
/// use std::io::Write;
/// use clan_proto::Redirection;
/// # use std::time::Duration;
/// # use clan_proto::stream::{Listener, Stream};
/// # let nic = clan::Nic::open_default()?;
/// # let listener = Listener::bind(&nic)?;
/// # let (addr, n2) = (listener.local_addr(), nic.clone());
/// # let connecting = std::thread::spawn(move || Stream::connect(&n2, addr));
/// # let (server, _) = listener.accept_timeout(Duration::from_secs(5))?;
/// # let mut client = connecting.join().unwrap()?;
/// client.write_all(b"early")?; // before the post: lands in the ring
/// # let deadline = std::time::Instant::now() + Duration::from_secs(5);
/// # while server.available()? < 5 { assert!(std::time::Instant::now() < deadline); std::thread::yield_now(); }
/// server.post_recv(10)?;
/// client.write_all(b"later")?; // after it: placed straight into the posted buffer
/// let (rep, data) = server.recv_posted(|rep, data| (rep, data.to_vec()))?;
/// assert_eq!(rep, Redirection { len: 10, direct: 5, copied: 5 });
/// assert_eq!(data, b"earlylater");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redirection {
    /// Bytes received.
    pub len: u64,
    /// Of which the sender placed directly into the posted buffer.
    pub direct: u64,
    /// Of which had already gone to the default buffer (the ring) and were copied.
    pub copied: u64,
}

/// The receiving half: reads our side, writes `CTL_*` into the peer's side.
#[derive(Debug)]
pub(crate) struct PipeRx {
    mine: std::sync::Arc<Aperture>,
    peer: std::sync::Arc<crate::side::PeerSide>,
    cap: u64,
    post_cap: u64,
    read: u64,
    /// Fires when data (or the end) arrives.
    data: Tripwire,
    /// The outstanding post: (seq, at, len).
    post: Option<(u64, u64, u64)>,
    next_seq: u64,
    /// Bytes known to be in place beyond `RX_WRITE` (seen landing by a position tripwire).
    landed: u64,
    /// The sender's position as last read from `RX_WRITE` (re-read when we run out).
    written_seen: u64,
    /// The read position last mirrored into the sender.
    published: u64,
    /// The peer's last `CTL_ASLEEP` token answered (nudged, or seen on its own CPU).
    nudged: u64,
    /// Sleeps waiting for data (the count in our tokens).
    sleeps: u64,
    /// Early wake-ups given to the peer.
    nudges: u64,
    pub spin: Duration,
}

impl PipeRx {
    pub fn new(
        mine: std::sync::Arc<Aperture>,
        peer: std::sync::Arc<crate::side::PeerSide>,
        cap: u64,
        post_cap: u64,
        spin: Duration,
    ) -> Result<PipeRx, PipeError> {
        // From CTL_NUDGE (early wake-ups) to RX_FIN: the words stored when there is something
        // to read, or about to be.
        let data = wait_tripwire(&mine, CTL_NUDGE..RX_FIN + 8)?;
        Ok(PipeRx {
            mine,
            peer,
            cap,
            post_cap,
            read: 0,
            data,
            post: None,
            next_seq: 2,
            landed: 0,
            written_seen: 0,
            published: 0,
            nudged: 0,
            sleeps: 0,
            nudges: 0,
            spin,
        })
    }

    /// Bytes written by the peer, validated.
    fn written(&self) -> Result<u64, PipeError> {
        let w = self.mine.load_u64(RX_WRITE)?;
        let limit = self.read + self.cap - 1 + self.post.map_or(0, |(_, _, len)| len);
        if w < self.read || w > limit {
            return Err(PipeError::Protocol("the sender's write position is impossible"));
        }
        Ok(w)
    }

    /// Bytes landed so far (the stream position the sender published): moves whenever data
    /// arrives, an edge for event-driven readers.
    pub fn landed(&self) -> Result<u64, PipeError> {
        self.written()
    }

    /// Bytes readable now.
    pub fn available(&self) -> Result<u64, PipeError> {
        Ok(self.written()? - self.read)
    }

    /// The final position, if the peer has shut down writing.
    fn fin(&self) -> Result<Option<u64>, PipeError> {
        let f = self.mine.load_u64(RX_FIN)?;
        if f & FIN == 0 {
            return Ok(None);
        }
        Ok(Some(f & !FIN))
    }

    /// Whether the stream has ended here (everything before the end was read).
    pub fn at_end(&self) -> Result<bool, PipeError> {
        Ok(self.fin()?.is_some_and(|f| self.read >= f))
    }

    /// Where the byte at stream position `q` (already written) is: in the post area or the ring.
    fn place(&self, q: u64) -> Result<(u64, u64), PipeError> {
        if let Some((seq, at, len)) = self.post {
            if q >= at && q < at + len && self.mine.load_u64(RX_ACK_SEQ)? == seq {
                let began = self.mine.load_u64(RX_ACK_AT)?;
                if began < at || began > at + len {
                    return Err(PipeError::Protocol("the sender acknowledged an impossible redirection"));
                }
                if q >= began {
                    // In the post area, up to the end of the post.
                    return Ok((RING + self.cap + (q - at), at + len - q));
                }
                // In the ring, up to where redirection began.
                let r = wrap(q, self.cap);
                return Ok((RING + r, (began - q).min(self.cap - r)));
            }
        }
        let r = wrap(q, self.cap);
        let mut run = self.cap - r;
        if let Some((_, at, _)) = self.post {
            if q < at {
                run = run.min(at - q);
            }
        }
        Ok((RING + r, run))
    }

    /// Copy up to `buf.len()` readable bytes; returns how many (0: none now). The read
    /// position is mirrored to the sender every half ring, so that it can refill the ring
    /// while we copy the rest out.
    pub fn try_read(&mut self, buf: &mut [u8]) -> Result<usize, PipeError> {
        let mut done = 0usize;
        loop {
            let mut avail = self.written_seen.saturating_sub(self.read);
            if avail == 0 {
                self.written_seen = self.written()?;
                avail = self.written_seen - self.read;
            }
            let want = (buf.len() - done) as u64;
            if avail == 0 || want == 0 {
                return Ok(done);
            }
            let mut piece = 0u64;
            let limit = avail.min(want).min(chunk(self.cap));
            while piece < limit {
                let (off, run) = self.place(self.read + piece)?;
                let n = run.min(limit - piece) as usize;
                self.mine.read(off, &mut buf[done..done + n])?;
                done += n;
                piece += n as u64;
            }
            self.advance(piece)?;
        }
    }

    /// Lend up to `max` readable bytes in place (no copy): `f` gets the aperture, the offset
    /// and the length of one contiguous run; returns what `f` returns and consumes the run.
    pub fn read_in_place<R>(
        &mut self,
        max: u64,
        f: impl FnOnce(&Aperture, u64, u64) -> R,
    ) -> Result<Option<R>, PipeError> {
        let avail = self.available()?.min(max);
        if avail == 0 {
            return Ok(None);
        }
        let (off, run) = self.place(self.read)?;
        let n = run.min(avail);
        let r = f(&self.mine, off, n);
        self.advance(n)?;
        Ok(Some(r))
    }

    fn advance(&mut self, n: u64) -> Result<(), PipeError> {
        self.read += n;
        if let Some((_, at, len)) = self.post {
            if self.read >= at + len {
                self.post = None;
            }
        }
        // Lazily, as the paper says: when a quarter of the ring has been consumed since the
        // last time. Like TCP's receive window, a few bytes read do not reopen the ring at
        // once, and a reader that keeps up with a writer of small messages does not send a
        // store back for each one. Liveness: a writer waits for room only when the ring is
        // full as it last saw it (`cap - 1` bytes past the published position); a reader
        // that reads them all has then consumed at least a quarter of the ring, so it
        // publishes before it can wait for data in turn.
        if self.read - self.published >= self.cap / 4 {
            self.publish_read()?;
        }
        self.nudge();
        Ok(())
    }

    /// Early wake-up (module documentation): answer the peer's token, if it sleeps waiting
    /// for our data on another CPU.
    fn nudge(&mut self) {
        if crate::wait::nudge(&self.mine, &mut self.nudged, &self.peer) {
            self.nudges += 1;
        }
    }

    /// Bytes consumed, sleeps waiting for data, early wake-ups given to the peer.
    pub fn counts(&self) -> (u64, u64, u64) {
        (self.read, self.sleeps, self.nudges)
    }

    /// Mirror read_i into the sender (it polls its own memory for space). A sender that has
    /// shut down and gone no longer has memory to write into; that is not an error.
    fn publish_read(&mut self) -> Result<(), PipeError> {
        self.published = self.read;
        match self.peer.get().and_then(|m| m.store_u64(CTL_READ, self.read)) {
            Ok(()) => Ok(()),
            Err(_) if self.fin()?.is_some() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Stop reading for good: tell the sender where (it then takes back what we have not
    /// read, [`PipeTx::take_back`]). The position goes first, then the read counter, whose
    /// store wakes a sender waiting for room.
    pub fn leave(&mut self) -> Result<(), PipeError> {
        let peer = self.peer.get()?;
        peer.store_u64(CTL_LEFT, LEFT | self.read)?;
        self.published = self.read;
        peer.store_u64(CTL_READ, self.read)?;
        Ok(())
    }

    /// Bytes landed and not read (what the sender will take back after [`PipeRx::leave`]).
    pub fn unread(&self) -> Result<u64, PipeError> {
        self.available()
    }

    /// Whether the sender has taken back what we left unread (our side may go).
    pub fn taken(&self) -> bool {
        self.mine.load_u64(RX_TAKEN).is_ok_and(|v| v != 0)
    }

    /// For a read that found nothing and will not wait (non-blocking): if the sender is
    /// across a link, receive from the NIC's links in this thread once, as a wait's spin
    /// does, rather than leave the bytes to the engine's thread (woken for them, it would
    /// take the CPU from this one, which polls). Whether anything came in. Whether the peer
    /// is across a link comes from the connection, not from the import of its side: an
    /// accepted stream imports it at its first write, and its reads before that drove
    /// nothing (with manual progress nobody else reads a link: its first message waited for
    /// the engine's timer).
    pub fn drive_links(&self) -> bool {
        if !self.peer.across_link() {
            return false;
        }
        self.data.spin_links().drive()
    }

    /// Wait for data or the end of the stream. Before sleeping, leaves the sender a token
    /// asking for an early wake-up (module documentation).
    pub fn wait_data(&mut self, deadline: Option<Instant>, dead: &mut dyn FnMut() -> bool) -> Result<(), PipeError> {
        let slept = std::cell::Cell::new(false);
        // (no spin while the peer that would end it needs this CPU to run)
        let spin =
            if self.spin.is_zero() || crate::wait::spin_is_futile(&self.mine) { Duration::ZERO } else { self.spin };
        let r = wait_check_with(
            &self.data,
            Spin::for_peer(spin, self.peer.across_link()),
            deadline,
            SLICE,
            || Ok(self.available()? > 0 || self.at_end()?),
            dead,
            wait_err,
            || {
                slept.set(true);
                crate::wait::ask_nudge(&self.peer, self.sleeps + 1);
            },
        );
        if slept.get() {
            self.sleeps += 1;
        }
        r
    }

    /// Wait until the written position passes `beyond`, or the stream ends.
    fn wait_beyond(
        &self,
        beyond: u64,
        deadline: Option<Instant>,
        dead: &mut dyn FnMut() -> bool,
    ) -> Result<(), PipeError> {
        wait_check(
            &self.data,
            Spin::for_peer(self.spin, self.peer.across_link()),
            deadline,
            SLICE,
            || Ok(self.written()? > beyond || self.at_end_after(beyond)?),
            dead,
            wait_err,
        )
    }

    fn at_end_after(&self, w: u64) -> Result<bool, PipeError> {
        Ok(self.fin()?.is_some_and(|f| w >= f))
    }

    /// Wait until the bytes before stream position `pos` are in place (or the stream
    /// ended), possibly before the sender has published them: a tripwire on the byte before
    /// `pos` in the ring fires when that byte is written, and the bytes before it are
    /// visible by then (a write that spans a tripwire makes the watched bytes visible
    /// first). Then [`PipeRx::peek`] may copy them. `pos` at most the ring's size ahead.
    pub fn wait_position(
        &mut self,
        pos: u64,
        deadline: Option<Instant>,
        dead: &mut dyn FnMut() -> bool,
    ) -> Result<(), PipeError> {
        if pos <= self.read || self.written()? >= pos {
            self.landed = self.landed.max(pos);
            return Ok(());
        }
        if pos - self.read > self.cap - 1 || self.post.is_some() {
            return Err(PipeError::Protocol("can only wait for a position within the ring, without a posted buffer"));
        }
        let byte = RING + wrap(pos - 1, self.cap);
        let tw = self
            .mine
            .tripwire(TripwireConfig::writes(byte..byte + 1).once().disarmed().actions(clan::Actions::COUNTER))
            .map_err(|_| PipeError::Access(AccessError::Revoked))?;
        // Short sleeps: if the byte landed between our look and the arming, only the
        // publication that follows it says so, and that does not fire this tripwire.
        let r = wait_sliced(
            &tw,
            Spin::for_peer(self.spin, self.peer.across_link()),
            deadline,
            Duration::from_micros(500),
            || tw.count() > 0 || self.written().is_ok_and(|w| w >= pos) || self.at_end().unwrap_or(true),
            dead,
        );
        r.map_err(wait_err)?;
        if tw.count() > 0 || self.written()? >= pos {
            self.landed = self.landed.max(pos);
        }
        Ok(())
    }

    /// Copy the bytes at `read + skip ..` into `buf` without consuming them; only bytes
    /// known to be in place (published, or seen landing by [`PipeRx::wait_position`]).
    pub fn peek(&self, skip: u64, buf: &mut [u8]) -> Result<usize, PipeError> {
        let known = self.written()?.max(self.landed);
        let from = self.read + skip;
        if from >= known {
            return Ok(0);
        }
        let want = (buf.len() as u64).min(known - from);
        let mut done = 0u64;
        while done < want {
            let (off, run) = self.place(from + done)?;
            let n = run.min(want - done);
            self.mine.read(off, &mut buf[done as usize..(done + n) as usize])?;
            done += n;
        }
        Ok(done as usize)
    }

    /// Post the post area's first `len` bytes for the next `len` bytes of the stream.
    pub fn post(&mut self, len: u64) -> Result<u64, PipeError> {
        if len == 0 || len > self.post_cap {
            return Err(PipeError::Protocol("posted length must be between 1 and the post area's size"));
        }
        if self.post.is_some() {
            return Err(PipeError::Protocol("a posted buffer is still outstanding"));
        }
        let seq = self.next_seq;
        self.next_seq += 2;
        let at = self.read;
        // Seqlock: odd while the record is rewritten.
        self.peer.get()?.store_u64(CTL_POST_SEQ, seq - 1)?;
        self.peer.get()?.store_u64(CTL_POST_AT, at)?;
        self.peer.get()?.store_u64(CTL_POST_LEN, len)?;
        self.peer.get()?.store_u64(CTL_POST_SEQ, seq)?;
        self.post = Some((seq, at, len));
        Ok(at)
    }

    /// Complete the outstanding post: wait until all its bytes are written (or the end),
    /// move the part that went to the ring into the post area, consume the bytes, and say
    /// exactly which part was redirected. The data is then in the post area, offset 0.
    pub fn complete_post(
        &mut self,
        deadline: Option<Instant>,
        dead: &mut dyn FnMut() -> bool,
    ) -> Result<Redirection, PipeError> {
        let Some((seq, at, len)) = self.post else {
            return Err(PipeError::Protocol("no posted buffer"));
        };
        if at != self.read {
            return Err(PipeError::Protocol("bytes before the posted buffer were not read"));
        }
        loop {
            let w = self.written()?;
            if w >= at + len || self.at_end_after(w)? {
                break;
            }
            self.wait_beyond(w, deadline, dead)?;
        }
        let end = self.written()?.min(at + len);
        let got = end - at;
        let began = if self.mine.load_u64(RX_ACK_SEQ)? == seq {
            let b = self.mine.load_u64(RX_ACK_AT)?;
            if b < at || b > at + len {
                return Err(PipeError::Protocol("the sender acknowledged an impossible redirection"));
            }
            b.min(end)
        } else {
            end
        };
        // Bytes [at, began) are in the ring: copy them into place.
        let mut q = at;
        let mut tmp = vec![0u8; (began - at).min(64 << 10) as usize];
        while q < began {
            let r = wrap(q, self.cap);
            let n = (began - q).min(self.cap - r).min(tmp.len() as u64) as usize;
            self.mine.read(RING + r, &mut tmp[..n])?;
            self.mine.write(RING + self.cap + (q - at), &tmp[..n])?;
            q += n as u64;
        }
        self.read = end;
        self.post = None;
        self.publish_read()?;
        Ok(Redirection { len: got, direct: end - began, copied: began - at })
    }

    /// Our side (the post area is at `RING + cap`).
    pub fn side(&self) -> &Aperture {
        &self.mine
    }

    /// Offset of the post area in our side.
    pub fn post_area(&self) -> u64 {
        RING + self.cap
    }

    /// Bytes read so far.
    pub fn consumed(&self) -> u64 {
        self.read
    }
}
