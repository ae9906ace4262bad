//! `clan bench tripwires`: the cost of snooping a write, and that it does not grow with the
//! tripwires of other apertures.
//!
//! Measures writes through a mapping of aperture A (8-byte word stores and `--size` writes)
//! with no tripwire anywhere, then again after `--count` tripwires were set on aperture B of
//! the same NIC and queue, then with one tripwire on A near the written range (the slow path:
//! lookup, ordered copy, firing). Baseline, same run: the same stores straight into the same
//! shared memory without the NIC (`raw`).

use std::time::Instant;

use clan::{Nic, NicConfig, TripwireConfig};
use serde::Serialize;

use super::Result;
use super::report::{emit, ratio};
use crate::sys;

/// Arguments of `clan bench tripwires`.
#[derive(clap::Args, Debug, Clone)]
pub struct TripwiresArgs {
    /// Tripwires set on the other aperture.
    #[arg(long, default_value_t = 1_000_000)]
    pub count: u64,
    /// Size of the bulk writes.
    #[arg(long, default_value_t = 4096)]
    pub size: usize,
    /// Writes per measurement.
    #[arg(long, default_value_t = 2_000_000)]
    pub iters: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, serde::Deserialize)]
struct Report {
    bench: &'static str,
    count: u64,
    size: usize,
    iters: u64,
    word_ns_no_tripwires: f64,
    word_ns_with_other_tripwires: f64,
    word_ns_watched: f64,
    write_ns_no_tripwires: f64,
    write_ns_with_other_tripwires: f64,
    write_ns_watched: f64,
    baseline: &'static str,
    baseline_word_ns: f64,
    baseline_write_ns: f64,
    growth_word: f64,
    growth_write: f64,
    setup_ns_per_tripwire: f64,
    machine: sys::Machine,
}

fn per_op(iters: u64, mut f: impl FnMut(u64) -> Result<()>) -> Result<f64> {
    for i in 0..iters / 10 {
        f(i)?;
    }
    let t = Instant::now();
    for i in 0..iters {
        f(i)?;
    }
    Ok(t.elapsed().as_nanos() as f64 / iters as f64)
}

pub fn run(a: &TripwiresArgs) -> Result<()> {
    sys::pin(0);
    let nic = Nic::open(NicConfig::default())?;
    let ep = nic.endpoint()?;
    let len = 1u64 << 20;
    let ap_a = ep.export(len)?;
    let m = ep.import(&ap_a.descriptor())?;
    let src = vec![0x33u8; a.size];
    let slots = len / a.size.max(64) as u64;
    let word = |m: &clan::Mapping, i: u64| -> Result<()> { Ok(m.store_u64((i % 1024) * 64, i)?) };
    let bulk = |m: &clan::Mapping, i: u64| -> Result<()> { Ok(m.write((i % slots) * a.size as u64, &src)?) };

    // Baseline: the same stores into the same memory, without the NIC.
    let base_word = per_op(a.iters, |i| {
        ap_a.store_u64((i % 1024) * 64, i)?;
        Ok(())
    })?;
    let base_write = per_op(a.iters, |i| {
        ap_a.write((i % slots) * a.size as u64, &src)?;
        Ok(())
    })?;

    let w0 = per_op(a.iters, |i| word(&m, i))?;
    let b0 = per_op(a.iters, |i| bulk(&m, i))?;

    let ap_b = ep.export((a.count * 8).max(8))?;
    let t = Instant::now();
    let tws: Vec<_> = (0..a.count)
        .map(|i| ap_b.tripwire(TripwireConfig::writes(i * 8..i * 8 + 8)))
        .collect::<std::result::Result<_, _>>()?;
    let setup = t.elapsed().as_nanos() as f64 / a.count.max(1) as f64;
    let w1 = per_op(a.iters, |i| word(&m, i))?;
    let b1 = per_op(a.iters, |i| bulk(&m, i))?;

    // One tripwire on A inside the written ranges: every write takes the slow path.
    let _near = ap_a.tripwire(TripwireConfig::writes(0..len))?;
    let w2 = per_op(a.iters, |i| word(&m, i))?;
    let b2 = per_op(a.iters, |i| bulk(&m, i))?;
    drop(tws);

    let r = Report {
        bench: "tripwires",
        count: a.count,
        size: a.size,
        iters: a.iters,
        word_ns_no_tripwires: w0,
        word_ns_with_other_tripwires: w1,
        word_ns_watched: w2,
        write_ns_no_tripwires: b0,
        write_ns_with_other_tripwires: b1,
        write_ns_watched: b2,
        baseline: "raw",
        baseline_word_ns: base_word,
        baseline_write_ns: base_write,
        growth_word: ratio(w1, w0),
        growth_write: ratio(b1, b0),
        setup_ns_per_tripwire: setup,
        machine: sys::machine(),
    };
    emit(a.json, &r, || {
        println!(
            "clan bench tripwires: {} tripwires on another aperture, {}-byte writes, {} writes each",
            r.count, r.size, r.iters
        );
        println!("{:<44} {:>12} {:>12}", "", "8-byte word", format!("{} B write", r.size));
        println!("{:<44} {:>9.1} ns {:>9.1} ns", "raw store (no NIC)", r.baseline_word_ns, r.baseline_write_ns);
        println!("{:<44} {:>9.1} ns {:>9.1} ns", "through a mapping, no tripwires", w0, b0);
        println!("{:<44} {:>9.1} ns {:>9.1} ns", format!("… with {} tripwires on another aperture", r.count), w1, b1);
        println!("{:<44} {:>9.1} ns {:>9.1} ns", "… with a tripwire over the written range", w2, b2);
        println!(
            "growth with the other aperture's tripwires: {:.2}× (word), {:.2}× (write)",
            r.growth_word, r.growth_write
        );
        println!("setting a tripwire: {:.0} ns each", r.setup_ns_per_tripwire);
    });
    Ok(())
}
