//! Percentiles, tables and JSON.

use std::time::Duration;

use hdrhistogram::Histogram;
use hdrhistogram::serialization::Serializer as _;
use serde::Serialize;

/// Nanosecond samples.
#[derive(Debug)]
pub struct Samples {
    h: Histogram<u64>,
}

impl Default for Samples {
    fn default() -> Self {
        Samples::new()
    }
}

impl Samples {
    pub fn new() -> Samples {
        Samples { h: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds") }
    }
    pub fn record(&mut self, d: Duration) {
        let _ = self.h.record((d.as_nanos() as u64).max(1));
    }
    /// One line of text to send a histogram over a pipe: hdrhistogram's own V2 compressed
    /// serialisation (the format of its interval logs), in base64.
    pub fn to_line(&self) -> String {
        let mut bytes = Vec::new();
        hdrhistogram::serialization::V2DeflateSerializer::new()
            .serialize(&self.h, &mut bytes)
            .expect("serialising into memory");
        data_encoding::BASE64.encode(&bytes)
    }

    /// Parse [`Samples::to_line`] (None if it is not a histogram).
    pub fn from_line(line: &str) -> Option<Samples> {
        let bytes = data_encoding::BASE64.decode(line.trim().as_bytes()).ok()?;
        let h: Histogram<u64> = hdrhistogram::serialization::Deserializer::new().deserialize(&mut &bytes[..]).ok()?;
        let mut s = Samples::new();
        s.h.add(&h).ok()?;
        Some(s)
    }

    pub fn merge(&mut self, o: &Samples) {
        let _ = self.h.add(&o.h);
    }
    pub fn p(&self, q: f64) -> u64 {
        self.h.value_at_quantile(q)
    }
    pub fn summary(&self) -> Percentiles {
        Percentiles {
            p50_ns: self.p(0.50),
            p90_ns: self.p(0.90),
            p99_ns: self.p(0.99),
            p999_ns: self.p(0.999),
            min_ns: self.h.min(),
            max_ns: self.h.max(),
            // (0 for no samples, not NaN: a report must read back)
            mean_ns: if self.h.is_empty() { 0.0 } else { self.h.mean() },
            count: self.h.len(),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
pub struct Percentiles {
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
    pub mean_ns: f64,
    pub count: u64,
}

pub fn ns(v: u64) -> String {
    if v >= 10_000_000 {
        format!("{:.1} ms", v as f64 / 1e6)
    } else if v >= 10_000 {
        format!("{:.1} µs", v as f64 / 1e3)
    } else {
        format!("{v} ns")
    }
}

pub fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { f64::NAN } else { a / b }
}

/// Whether a target was met spinning (both sides poll) and blocking (both sides sleep), in
/// words: "both ways", "spinning only", "blocking only" or "neither".
pub fn verdict(spin: bool, block: bool) -> &'static str {
    match (spin, block) {
        (true, true) => "both ways",
        (true, false) => "spinning only",
        (false, true) => "blocking only",
        (false, false) => "neither",
    }
}

/// Print a report as pretty JSON or as text lines.
pub fn emit<T: Serialize>(json: bool, value: &T, text: impl FnOnce()) {
    if json {
        println!("{}", serde_json::to_string(value).expect("serialisable report"));
    } else {
        text();
    }
}

/// Run `send(i)` for `i` in `0..iters`, timed in batches of `batch` calls: each batch
/// records its time per call (up to 16 samples of it), so that timing costs little against
/// calls of a few nanoseconds.
pub fn timed_batches(iters: u64, batch: u64, mut send: impl FnMut(u64) -> super::Result<()>) -> super::Result<Samples> {
    let mut s = Samples::new();
    let mut i = 0;
    while i < iters {
        let n = batch.max(1).min(iters - i);
        let t0 = std::time::Instant::now();
        for k in 0..n {
            send(i + k)?;
        }
        let per = t0.elapsed() / n as u32;
        for _ in 0..n.min(16) {
            s.record(per);
        }
        i += n;
    }
    Ok(s)
}

/// A progress bar with an ETA for a long benchmark: `len` steps, on standard error when it is
/// a terminal (hidden otherwise, and with `--json`, whose output is for programs).
pub fn progress(len: u64, json: bool) -> indicatif::ProgressBar {
    if json {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{spinner} {elapsed:>4} [{bar:30}] {pos}/{len}  ETA {eta}  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

#[cfg(test)]
mod tests {
    use super::Samples;
    use std::time::Duration;

    #[test]
    fn samples_cross_a_pipe_whole() {
        let mut s = Samples::new();
        for i in 1..5000u64 {
            s.record(Duration::from_nanos(i * 37 % 100_000 + 100));
        }
        let line = s.to_line();
        assert!(!line.contains('\n'));
        let back = Samples::from_line(&line).expect("parses");
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(back.p(q), s.p(q), "quantile {q}");
        }
        assert!(Samples::from_line("not a histogram").is_none());
        assert!(Samples::from_line("").is_none() || Samples::from_line("").is_some_and(|e| e.p(0.5) == 0));
    }
}
