//! Machine facts and thread placement for benchmarks.

use serde::Serialize;

/// What the benchmark ran on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub model: String,
    pub kernel: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    Machine { cpus: online_cpus(), model, kernel }
}

/// CPUs online on the machine (not the affinity mask of this process, which a pinned
/// parent passes on to its children).
pub fn online_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| {
            s.trim()
                .split(',')
                .map(|r| match r.split_once('-') {
                    Some((a, b)) => b.parse::<usize>().ok().zip(a.parse::<usize>().ok()).map(|(b, a)| b - a + 1),
                    None => r.parse::<usize>().ok().map(|_| 1),
                })
                .sum::<Option<usize>>()
        })
        .unwrap_or(1)
        .max(1)
}

/// Pin the calling thread to `cpu` (modulo the CPUs available). Returns the CPU used, or
/// None if pinning is not possible.
pub fn pin(cpu: usize) -> Option<usize> {
    let cpu = cpu % online_cpus();
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).ok().map(|_| cpu)
}

/// A size on the command line: `4096`, `64KiB`, `1MiB`, `1.5 MB` (`KiB`/`MiB`/`GiB` and `K`
/// are powers of 1024; `KB`/`MB`/`GB` powers of 1000).
pub fn size(s: &str) -> Result<u64, String> {
    parse_size::Config::new().parse_size(s).map_err(|e| format!("{e} (a size: 4096, 64KiB, 1MiB, 1.5MB)"))
}

/// [`size`] for arguments held as `usize`.
pub fn size_usize(s: &str) -> Result<usize, String> {
    size(s).and_then(|n| usize::try_from(n).map_err(|_| format!("{s}: too large")))
}

/// The full path of `exe` if it is on `PATH`.
pub fn which(exe: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| std::path::Path::new(d).join(exe)).find(|p| p.is_file())
}
