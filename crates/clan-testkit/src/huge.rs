//! Huge pages for a test: reserve some (`vm.nr_hugepages`, root only), or take every free one
//! away (to test what runs without them), and put the system's setting back when done.

use std::time::{Duration, Instant};

const NR: &str = "/proc/sys/vm/nr_hugepages";

/// `HugePages_Total` and `HugePages_Free` (default huge page size) from `/proc/meminfo`.
pub fn counts() -> Option<(u64, u64)> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        m.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    Some((field("HugePages_Total:")?, field("HugePages_Free:")?))
}

/// The system's huge page setting as it was before a test changed it; put back on drop.
#[derive(Debug)]
pub struct HugePages {
    /// `vm.nr_hugepages` before, if this guard changed it.
    before: Option<u64>,
}

impl HugePages {
    /// At least `n` huge pages free: those there are, or (as root) `vm.nr_hugepages` raised
    /// until they are. `None`: not to be had (not root, or the kernel found no memory).
    pub fn reserve(n: u64) -> Option<HugePages> {
        let (total, free) = counts()?;
        if free >= n {
            return Some(HugePages { before: None });
        }
        let g = HugePages { before: Some(total) };
        std::fs::write(NR, (total + n - free).to_string()).ok()?;
        // (dropping `g` puts the setting back if the kernel found too few pages)
        counts().filter(|&(_, f)| f >= n).map(|_| g)
    }

    /// No huge page free (as root: `vm.nr_hugepages` lowered to those in use), until
    /// dropped. `None` if that cannot be done (not root).
    pub fn exhaust() -> Option<HugePages> {
        let (total, free) = counts()?;
        if free == 0 {
            return Some(HugePages { before: None });
        }
        let g = HugePages { before: Some(total) };
        std::fs::write(NR, (total - free).to_string()).ok()?;
        counts().filter(|&(_, f)| f == 0).map(|_| g)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(n) = self.before {
            // (pages still in use are kept by the kernel as surplus, and freed with their
            // last user; a write can fail transiently while pages move: a few tries)
            let end = Instant::now() + Duration::from_secs(2);
            while std::fs::write(NR, n.to_string()).is_err() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
