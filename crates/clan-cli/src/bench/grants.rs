//! `clan bench grants`: what protecting a grant narrower than its aperture costs, both ways
//! the kernel allows (a process can only be kept from memory by not holding a descriptor of
//! it), measured in the same run:
//!
//! - **mediated** (what clan does): another process of this host imports a narrowed
//!   descriptor through a link to the exporter's NIC, which checks and applies every access;
//!   against a whole-aperture grant of the same size, mapped directly (true zero copy);
//! - **split memory** (the alternative): apertures made of many memfd chunks, so that a grant
//!   receives only the chunks it covers. Its costs are the system calls per aperture — create,
//!   pass and map each chunk — and one descriptor per chunk held by every importer; measured
//!   here at 4 KiB chunks (page-granular grants) and 64 KiB chunks, against one memfd. It
//!   would still need mediation for grants that are not page-aligned.
//!
//! Placement: this process (the exporter) on CPU 0, the importing peer on CPU 1.

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use clan::{Descriptor, Nic, NicConfig, Rights};
use clan_shm::memfd::Memfd;
use clan_shm::segment::{Access, Segment};
use serde::Serialize;

use super::report::{Percentiles, Samples, emit, ns, ratio};
use super::{Link, PeerProc, Result, Role};
use crate::sys;

/// Bytes of a grant.
const GRANT: u64 = 64 << 10;
/// The aperture a narrowed grant is cut from.
const APERTURE: u64 = 1 << 20;

/// Arguments of `clan bench grants`.
#[derive(clap::Args, Debug, Clone)]
pub struct GrantsArgs {
    /// Imports timed per kind of grant.
    #[arg(long, default_value_t = 300)]
    pub imports: u64,
    /// Accesses timed per kind of grant and access.
    #[arg(long, default_value_t = 20_000)]
    pub iters: u64,
    /// Apertures split per chunk size.
    #[arg(long, default_value_t = 50)]
    pub splits: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One kind of grant, seen from the importing process.
#[derive(Serialize, serde::Deserialize, Debug)]
pub struct GrantCosts {
    pub kind: &'static str,
    /// Import, first access, unimport.
    pub import: Percentiles,
    /// Write 64 B, then read 8 B back (the write has landed).
    pub write_read_64: Percentiles,
    /// Read 4 KiB.
    pub read_4k: Percentiles,
    /// Writing the whole grant (64 KiB) repeatedly.
    pub write_mbit_s: f64,
    /// Descriptors the importer holds per grant.
    pub fds_held: u64,
}

/// One way of splitting an aperture into memfds.
#[derive(Serialize, serde::Deserialize, Debug)]
pub struct SplitCosts {
    pub chunk: u64,
    pub chunks: u64,
    /// Create the chunks (memfd, mode, size, seals), pass them over a Unix socket, map each.
    pub per_aperture: Percentiles,
    /// Descriptors an importer of the whole aperture holds.
    pub fds_held: u64,
}

#[derive(Serialize, serde::Deserialize, Debug)]
pub struct GrantsReport {
    pub machine: sys::Machine,
    pub placement: &'static str,
    pub grant_bytes: u64,
    pub aperture_bytes: u64,
    pub direct: GrantCosts,
    pub mediated: GrantCosts,
    /// Mediated / direct, at p50 (import, write+read, read 4 KiB) and in bandwidth.
    pub import_ratio: f64,
    pub write_read_ratio: f64,
    pub read_4k_ratio: f64,
    pub bandwidth_ratio: f64,
    /// The split alternative, with one memfd as its baseline (chunk = the aperture).
    pub split: Vec<SplitCosts>,
}

pub fn run(a: &GrantsArgs) -> Result<()> {
    let machine = sys::machine();
    sys::pin(0);
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    let whole = ep.export(GRANT)?;
    let big = ep.export(APERTURE)?;
    let narrowed = big.descriptor().derive(APERTURE / 2, GRANT, Rights::READ_WRITE)?;
    let mut peer = PeerProc::spawn(Role::GrantsPeer, &ImporterArgs { imports: a.imports, iters: a.iters, cpu: 1 })?;
    let direct = measure(&mut peer, "direct", &whole.descriptor())?;
    let mediated = measure(&mut peer, "mediated", &narrowed)?;
    peer.finish()?;
    drop((whole, big));

    let mut split = Vec::new();
    for chunk in [APERTURE, 64 << 10, 4 << 10] {
        split.push(split_costs(chunk, a.splits)?);
    }
    let r = GrantsReport {
        machine,
        placement: "exporter on CPU 0, importer on CPU 1",
        grant_bytes: GRANT,
        aperture_bytes: APERTURE,
        import_ratio: ratio(mediated.import.p50_ns as f64, direct.import.p50_ns as f64),
        write_read_ratio: ratio(mediated.write_read_64.p50_ns as f64, direct.write_read_64.p50_ns as f64),
        read_4k_ratio: ratio(mediated.read_4k.p50_ns as f64, direct.read_4k.p50_ns as f64),
        bandwidth_ratio: ratio(mediated.write_mbit_s, direct.write_mbit_s),
        direct,
        mediated,
        split,
    };
    emit(a.json, &r, || {
        println!(
            "clan bench grants: a {} KiB grant, whole aperture (mapped) vs cut from a {} KiB aperture (mediated); {}",
            GRANT >> 10,
            APERTURE >> 10,
            r.placement
        );
        println!(
            "{:<10} {:>12} {:>16} {:>12} {:>14} {:>5}",
            "", "import p50", "write64+read p50", "read 4K p50", "write Mbit/s", "fds"
        );
        for g in [&r.direct, &r.mediated] {
            println!(
                "{:<10} {:>12} {:>16} {:>12} {:>14.0} {:>5}",
                g.kind,
                ns(g.import.p50_ns),
                ns(g.write_read_64.p50_ns),
                ns(g.read_4k.p50_ns),
                g.write_mbit_s,
                g.fds_held
            );
        }
        println!(
            "ratio mediated/direct: import {:.2}, write+read {:.2}, read 4K {:.2}, bandwidth {:.3}",
            r.import_ratio, r.write_read_ratio, r.read_4k_ratio, r.bandwidth_ratio
        );
        println!("split memory, a {} KiB aperture (create + pass + map every chunk):", APERTURE >> 10);
        for s in &r.split {
            println!(
                "  chunk {:>5} KiB: {:>4} memfds, {:>10} p50 per aperture ({:.1}× one memfd), importer holds {} fds",
                s.chunk >> 10,
                s.chunks,
                ns(s.per_aperture.p50_ns),
                ratio(s.per_aperture.p50_ns as f64, r.split[0].per_aperture.p50_ns as f64),
                s.fds_held
            );
        }
    });
    Ok(())
}

fn measure(peer: &mut PeerProc, kind: &'static str, desc: &Descriptor) -> Result<GrantCosts> {
    peer.send(desc)?;
    let mut get = || -> Result<Samples> { Samples::from_line(&peer.recv()?).ok_or_else(|| "bad samples".into()) };
    let import = get()?.summary();
    let write_read_64 = get()?.summary();
    let read_4k = get()?.summary();
    let line = peer.recv()?;
    let (mbit, fds) = line.split_once(' ').ok_or("bad peer line")?;
    Ok(GrantCosts { kind, import, write_read_64, read_4k, write_mbit_s: mbit.parse()?, fds_held: fds.parse()? })
}

/// What the importing peer is told.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ImporterArgs {
    imports: u64,
    iters: u64,
    cpu: usize,
}

/// The importing peer: for each descriptor it is sent, time imports and accesses.
pub fn peer(a: ImporterArgs) -> Result<()> {
    let ImporterArgs { imports, iters, cpu } = a;
    sys::pin(cpu);
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    while let Ok(line) = Link::hear() {
        let desc: Descriptor = line.parse()?;
        let mut s = Samples::new();
        let mut b8 = [0u8; 8];
        for _ in 0..imports {
            let t = Instant::now();
            let m = ep.import(&desc)?;
            m.read(0, &mut b8)?;
            drop(m);
            s.record(t.elapsed());
        }
        Link::say(s.to_line());
        let fds_before = open_fds();
        let m = ep.import(&desc)?;
        let fds_held = open_fds().saturating_sub(fds_before);
        let payload = [7u8; 64];
        let mut s = Samples::new();
        for i in 0..iters {
            let t = Instant::now();
            m.write((i * 64) % GRANT, &payload)?;
            m.read((i * 64) % GRANT, &mut b8)?;
            s.record(t.elapsed());
        }
        Link::say(s.to_line());
        let mut s = Samples::new();
        let mut b4k = vec![0u8; 4096];
        for i in 0..iters {
            let t = Instant::now();
            m.read((i * 4096) % GRANT, &mut b4k)?;
            s.record(t.elapsed());
        }
        Link::say(s.to_line());
        let block = vec![9u8; GRANT as usize];
        let rounds = (iters / 16).max(64);
        let t = Instant::now();
        for _ in 0..rounds {
            m.write(0, &block)?;
        }
        m.read(0, &mut b8)?; // the last write has landed
        let secs = t.elapsed().as_secs_f64();
        Link::say(format!("{} {fds_held}", (rounds * GRANT * 8) as f64 / secs / 1e6));
    }
    Ok(())
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// Make an aperture of [`APERTURE`] bytes out of `chunk`-sized memfds, pass them all over a
/// Unix socket and map every one: `rounds` times.
fn split_costs(chunk: u64, rounds: u64) -> Result<SplitCosts> {
    let chunks = APERTURE / chunk;
    let (tx, rx) = UnixStream::pair()?;
    let mut s = Samples::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let fds: Vec<Memfd> =
            (0..chunks).map(|_| Memfd::create("clan-bench-chunk", chunk)).collect::<std::io::Result<_>>()?;
        let mut got: Vec<OwnedFd> = Vec::with_capacity(chunks as usize);
        for batch in fds.chunks(250) {
            let borrowed: Vec<BorrowedFd<'_>> = batch.iter().map(|m| m.as_fd()).collect();
            send_fds(&tx, &borrowed)?;
            got.extend(recv_fds(&rx, batch.len())?);
        }
        let maps: Vec<Segment> = got
            .iter()
            .map(|fd| Segment::map(fd, 0, chunk as usize, Access::ReadWrite))
            .collect::<std::io::Result<_>>()?;
        s.record(t.elapsed());
        drop(maps);
    }
    Ok(SplitCosts { chunk, chunks, per_aperture: s.summary(), fds_held: chunks })
}

fn send_fds(sock: &UnixStream, fds: &[BorrowedFd<'_>]) -> Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(250))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err("descriptors do not fit".into());
    }
    sendmsg(sock, &[IoSlice::new(&[0])], &mut control, SendFlags::empty())?;
    Ok(())
}

fn recv_fds(sock: &UnixStream, n: usize) -> Result<Vec<OwnedFd>> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(250))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    recvmsg(sock, &mut [std::io::IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let mut out = Vec::with_capacity(n);
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            out.extend(r);
        }
    }
    if out.len() != n {
        return Err(format!("received {} of {n} descriptors", out.len()).into());
    }
    Ok(out)
}
