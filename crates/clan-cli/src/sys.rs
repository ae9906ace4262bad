//! Machine facts and thread placement for benchmarks.

use serde::Serialize;

/// What the benchmark ran on.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub model: String,
    pub kernel: String,
    /// Memory in GiB.
    pub memory_gib: f64,
}

fn system() -> sysinfo::System {
    use sysinfo::{CpuRefreshKind, MemoryRefreshKind, RefreshKind};
    sysinfo::System::new_with_specifics(
        RefreshKind::nothing().with_cpu(CpuRefreshKind::nothing()).with_memory(MemoryRefreshKind::nothing().with_ram()),
    )
}

/// The machine's facts (from `sysinfo`).
pub fn machine() -> Machine {
    let sys = system();
    let model = sys
        .cpus()
        .first()
        .map(|c| c.brand().trim().to_owned())
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| "unknown CPU".into());
    Machine {
        cpus: sys.cpus().len().max(1),
        model,
        kernel: sysinfo::System::kernel_version().unwrap_or_else(|| "unknown".into()),
        memory_gib: sys.total_memory() as f64 / (1u64 << 30) as f64,
    }
}

/// CPUs of the machine (not the affinity mask of this process, which a pinned parent passes
/// on to its children).
pub fn online_cpus() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| system().cpus().len().max(1))
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

/// Resident memory of process `pid` in bytes (0 if it is gone), from `sysinfo`.
pub fn rss_bytes(pid: u32) -> u64 {
    use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate};
    let pid = Pid::from_u32(pid);
    let mut sys = sysinfo::System::new();
    sys.refresh_processes_specifics(
        ProcessesToUpdate::Some(&[pid]),
        false,
        ProcessRefreshKind::nothing().with_memory(),
    );
    sys.process(pid).map_or(0, |p| p.memory())
}

/// The processes descended from `pid` (its children, theirs, …), from `sysinfo`.
pub fn descendants(pid: u32) -> Vec<u32> {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate};
    let mut sys = sysinfo::System::new();
    sys.refresh_processes_specifics(ProcessesToUpdate::All, true, ProcessRefreshKind::nothing());
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        let children: Vec<u32> = sys
            .processes()
            .iter()
            .filter(|(c, proc_)| proc_.parent().map(|x| x.as_u32()) == Some(p) && !found.contains(&c.as_u32()))
            .map(|(c, _)| c.as_u32())
            .collect();
        found.extend(children);
        i += 1;
    }
    found.remove(0);
    found
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    /// A process's children and theirs are found; others are not.
    #[test]
    fn descendants_are_children_and_theirs() {
        // sh (the child) runs a subshell that runs sleep: both below the child.
        let mut child =
            Command::new("sh").args(["-c", "(sleep 30; true) & wait"]).stdout(Stdio::null()).spawn().expect("sh");
        let start = std::time::Instant::now();
        let found = loop {
            let d = super::descendants(child.id());
            let names: Vec<String> = d
                .iter()
                .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
                .map(|s| s.trim().to_owned())
                .collect();
            if names.iter().any(|n| n == "sleep") || start.elapsed() > std::time::Duration::from_secs(20) {
                break (d, names);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert!(found.1.iter().any(|n| n == "sleep"), "the grandchild is found: {found:?}");
        assert!(!found.0.contains(&child.id()) && !found.0.contains(&std::process::id()), "{found:?}");
        for p in &found.0 {
            let _ = Command::new("kill").args(["-KILL", &p.to_string()]).status();
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
