//! The libfabric provider as libfabric's own tools see it: `clan fabric env` makes the
//! loader find `libclan-fi.so`, and `fi_info -p clan` lists what it offers, narrowed by the
//! hints it is given. Without `fi_info` (Debian's `libfabric-bin`) this is skipped, except in
//! CI (`CI=1`), where it must be installed.

use std::process::Command;

const CLAN: &str = env!("CARGO_BIN_EXE_clan");

fn have_fi_info() -> bool {
    let there = Command::new("sh").args(["-c", "command -v fi_info"]).output().is_ok_and(|o| o.status.success());
    if !there && std::env::var_os("CI").is_some() {
        panic!("fi_info is not installed (libfabric-bin): .ci/run installs it");
    }
    there
}

/// The provider directory `clan fabric env` sets up.
fn provider_path() -> String {
    let out = Command::new(CLAN).args(["fabric", "env"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "clan fabric env: {}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().find(|l| l.starts_with("export FI_PROVIDER_PATH=")).expect("an export line");
    let path = line.trim_start_matches("export FI_PROVIDER_PATH=").trim_matches('\'').to_string();
    assert!(std::path::Path::new(&path).join("libclan-fi.so").exists(), "{path}/libclan-fi.so");
    path
}

fn fi_info(path: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("fi_info")
        .args(["-p", "clan"])
        .args(args)
        .env("FI_PROVIDER_PATH", path)
        .env_remove("FI_PROVIDER")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn fi_info_lists_the_clan_provider() {
    if !have_fi_info() {
        eprintln!("skipped: fi_info is not installed");
        return;
    }
    let path = provider_path();
    let (ok, all) = fi_info(&path, &[]);
    assert!(ok, "fi_info -p clan failed:\n{all}");
    // Ours, not a utility provider layered over it.
    let ours: Vec<&str> = all.split("provider: ").filter(|b| b.starts_with("clan\n")).collect();
    assert!(ours.iter().any(|b| b.contains("type: FI_EP_RDM")), "an RDM endpoint:\n{all}");
    // Connected endpoints too, and nothing is layered over clan (libfabric's `ofi_rxm` would
    // make reliable datagrams of our connected endpoints, listed before ours).
    assert!(ours.iter().any(|b| b.contains("type: FI_EP_MSG")), "a connected endpoint:\n{all}");
    assert!(!all.contains("ofi_rxm"), "{all}");
    assert!(ours.iter().all(|b| b.contains("fabric: clan") && b.contains("domain: clan")), "{all}");

    // Hints narrow it: tagged messages on RDM only; atomics not at all.
    let (ok, tagged) = fi_info(&path, &["-c", "FI_TAGGED|FI_DIRECTED_RECV", "-t", "FI_EP_RDM", "-v"]);
    assert!(ok, "{tagged}");
    let ours = tagged.split("fi_info:").find(|b| b.contains("prov_name: clan\n")).unwrap_or_else(|| panic!("{tagged}"));
    assert!(ours.contains("FI_TAGGED") && ours.contains("FI_DIRECTED_RECV") && ours.contains("FI_EP_RDM"), "{ours}");
    let (ok, msg_tagged) = fi_info(&path, &["-c", "FI_TAGGED", "-t", "FI_EP_MSG"]);
    assert!(!ok || !msg_tagged.contains("provider: clan\n"), "tagged over MSG is not offered:\n{msg_tagged}");
    let (ok, rma) = fi_info(&path, &["-c", "FI_RMA"]);
    assert!(ok && rma.contains("provider: clan\n"), "remote memory access is offered:\n{rma}");
    let (ok, atomics) = fi_info(&path, &["-c", "FI_ATOMIC"]);
    assert!(!ok || !atomics.contains("provider: clan\n"), "atomics are not offered:\n{atomics}");
}

/// The provider's objects through libfabric's own API (a C program, `tests/fabric/objects.c`,
/// built here with the system's C compiler): fabric, domain, address vector, completion and
/// event queues, endpoints, counters, memory registration and remote memory access (its
/// refusals: a wrong key, a range outside, a read-only registration, a closed one), peeks
/// and claims work, and bad arguments are refused by code, never a crash.
#[test]
fn objects_through_libfabric() {
    if !have_fi_info() {
        eprintln!("skipped: libfabric is not installed");
        return;
    }
    let path = provider_path();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fabric/objects.c");
    let exe = std::env::temp_dir().join(format!("clan-fi-objects-{}", std::process::id()));
    let cc = Command::new("cc").args(["-Wall", "-o"]).arg(&exe).arg(src).arg("-lfabric").output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&exe)
        .env("FI_PROVIDER_PATH", &path)
        .env_remove("FI_PROVIDER")
        .env_remove("CLAN_LOG")
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("NIC open"), "quiet without CLAN_LOG");
    // With `CLAN_LOG`, the provider's NIC says what it does on standard error; the
    // program's own output is the same.
    let out = Command::new(&exe)
        .env("FI_PROVIDER_PATH", &path)
        .env_remove("FI_PROVIDER")
        .env("CLAN_LOG", "clan=debug")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok", "{err}");
    assert!(err.contains("NIC open") && err.contains("DEBUG"), "CLAN_LOG=clan=debug:\n{err}");
    // The same under valgrind's memcheck: no read or write of memory the provider does not
    // own (a request handle used after its answer, a made-up one) at the C boundary.
    let valgrind = Command::new("sh").args(["-c", "command -v valgrind"]).output().is_ok_and(|o| o.status.success());
    if valgrind {
        let out = Command::new("timeout")
            .args(["300", "valgrind", "--tool=memcheck", "-q", "--error-exitcode=99"])
            .arg(&exe)
            .env("FI_PROVIDER_PATH", &path)
            .env_remove("FI_PROVIDER")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
            "under memcheck ({}):\n{}\n{err}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
    } else {
        assert!(std::env::var_os("CI").is_none(), "CI installs valgrind (.ci/run)");
    }
    let _ = std::fs::remove_file(&exe);
}

/// libfabric's own `fi_pingpong` over the clan provider, reliable datagrams, every size it
/// tries, data checked (`-c`), plain and tagged messages over reliable datagrams, and plain
/// messages over connected endpoints (`-e msg`: passive endpoint, connection request,
/// accept, connected events through event queues): two processes on loopback.
#[test]
fn fi_pingpong_rdm_and_msg_every_size_checked() {
    if !have_fi_info() {
        eprintln!("skipped: libfabric is not installed");
        return;
    }
    let path = provider_path();
    for (ep, mode) in [("rdm", "msg"), ("rdm", "tagged"), ("msg", "msg")] {
        // A free control port (the default one may be taken by another run).
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
        let args = ["-p", "clan", "-e", ep, "-m", mode, "-I", "20", "-S", "all", "-c"];
        let spawn = |extra: &[&str]| {
            Command::new("timeout")
                .arg("120")
                .arg("fi_pingpong")
                .args(args)
                .args(extra)
                .env("FI_PROVIDER_PATH", &path)
                .env_remove("FI_PROVIDER")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let server = spawn(&["-B", &port]);
        // The client again while the server is not listening on its control port yet
        // (bounded; probing the port would be taken by the server as its client).
        let mut c = spawn(&["-P", &port, "127.0.0.1"]).wait_with_output().unwrap();
        for _ in 0..100 {
            if c.status.success() || !String::from_utf8_lossy(&c.stderr).contains("Connection refused") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            c = spawn(&["-P", &port, "127.0.0.1"]).wait_with_output().unwrap();
        }
        let s = server.wait_with_output().unwrap();
        let (cout, sout) = (String::from_utf8_lossy(&c.stdout), String::from_utf8_lossy(&s.stdout));
        assert!(
            c.status.success() && s.status.success(),
            "{ep} {mode}: client {}:\n{cout}{}\nserver {}:\n{sout}{}",
            c.status,
            String::from_utf8_lossy(&c.stderr),
            s.status,
            String::from_utf8_lossy(&s.stderr)
        );
        // Every size from 64 B to 1 MiB went both ways, 20 times each.
        for size in ["64 ", "4k ", "1m "] {
            assert!(
                cout.lines().any(|l| l.starts_with(size) && l.contains("=20")),
                "{ep} {mode}: size {size}:\n{cout}"
            );
        }
    }
}

/// The provider between two hosts (network namespaces joined by a veth pair): each
/// process's NIC takes its address from `CLAN_FI_IP` and links over TCP with a cluster key
/// (`CLAN_FI_KEY`); `fi_pingpong` runs reliable datagrams and connected endpoints between
/// them, every size with data checks. Needs root; CI runs it.
#[test]
fn fi_pingpong_between_two_hosts() {
    if !have_fi_info() {
        eprintln!("skipped: libfabric is not installed");
        return;
    }
    let net = match clan_testkit::netns::TestNet::new(2) {
        Ok(n) => n,
        Err(why) => {
            assert!(std::env::var_os("CI").is_none(), "CI must run this between test hosts, but: {why}");
            eprintln!("skipped: {why}");
            return;
        }
    };
    let path = provider_path();
    let key = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2";
    let server_ip = net.host(0).ip.to_string();
    for (ep, port) in [("rdm", "47600"), ("msg", "47601")] {
        let args = ["-p", "clan", "-e", ep, "-I", "10", "-S", "all", "-c"];
        let spawn = |host: usize, extra: &[&str]| {
            net.command(host, "timeout")
                .args(["120", "fi_pingpong"])
                .args(args)
                .args(extra)
                .env("FI_PROVIDER_PATH", &path)
                .env_remove("FI_PROVIDER")
                .env("CLAN_FI_IP", net.host(host).ip.to_string())
                .env("CLAN_FI_KEY", key)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        // (the server's control port on its own host; the client's is any)
        let server = spawn(0, &["-B", port]);
        let mut c = spawn(1, &["-P", port, &server_ip]).wait_with_output().unwrap();
        for _ in 0..100 {
            if c.status.success() || !String::from_utf8_lossy(&c.stderr).contains("Connection refused") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            c = spawn(1, &["-P", port, &server_ip]).wait_with_output().unwrap();
        }
        let s = server.wait_with_output().unwrap();
        let cout = String::from_utf8_lossy(&c.stdout);
        assert!(
            c.status.success() && s.status.success(),
            "{ep}: client {}:\n{cout}{}\nserver {}:\n{}{}",
            c.status,
            String::from_utf8_lossy(&c.stderr),
            s.status,
            String::from_utf8_lossy(&s.stdout),
            String::from_utf8_lossy(&s.stderr)
        );
        for size in ["64 ", "4k ", "1m "] {
            assert!(cout.lines().any(|l| l.starts_with(size) && l.contains("=10")), "{ep}: size {size}:\n{cout}");
        }
    }
}

/// Open MPI (Debian's `openmpi-bin`) with its `cm` layer over libfabric (`mtl ofi`), held to
/// the clan provider: an MPI program of our own (`tests/fabric/mpi.c`: a ping-pong checking
/// every byte from 1 B to 1 MiB, an all-reduce, many messages received with wildcards) on 2
/// ranks and on 3 (more ranks than CPUs).
#[test]
fn open_mpi_over_the_clan_provider() {
    let have = |p: &str| {
        Command::new("sh").args(["-c", &format!("command -v {p}")]).output().is_ok_and(|o| o.status.success())
    };
    if !(have("mpicc") && have("mpirun") && have("fi_info")) {
        assert!(std::env::var_os("CI").is_none(), "Open MPI and libfabric are installed by .ci/run");
        eprintln!("skipped: Open MPI is not installed");
        return;
    }
    let path = provider_path();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fabric/mpi.c");
    let exe = std::env::temp_dir().join(format!("clan-fi-mpi-{}", std::process::id()));
    let cc = Command::new("mpicc").args(["-Wall", "-o"]).arg(&exe).arg(src).output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    for np in ["2", "3"] {
        let out = Command::new("timeout")
            .args(["180", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", np])
            .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "clan"])
            // (one host: started by fork, no ssh needed)
            .args(["--mca", "plm", "isolated", "--mca", "mtl_base_verbose", "100", "-x", "FI_PROVIDER_PATH"])
            .arg(&exe)
            .env("FI_PROVIDER_PATH", &path)
            .env_remove("FI_PROVIDER")
            .output()
            .unwrap();
        let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success() && so.lines().any(|l| l.trim() == "ok"),
            "{np} ranks ({}):\n{so}\n{se}",
            out.status
        );
        // Every rank's MPI went over the clan provider (nothing else was allowed either).
        let chosen = format!("{so}{se}").matches("mtl:ofi:provider: clan").count();
        assert_eq!(chosen.to_string(), np, "{so}\n{se}");
    }
    let _ = std::fs::remove_file(&exe);
}

/// An Open MPI rank that waits in `MPI_Recv` for a peer that sleeps a second first does not
/// spin all that time, though Open MPI only polls (`fi_cq_read` in a loop, yielding): once
/// the completion queue has been idle for a while (`CLAN_FI_IDLE_US`, 1 ms), its reads sleep
/// on the domain's event queue until the message wakes them. Both ranks on one CPU (as
/// oversubscribed ranks are); the waiting rank's process uses under a quarter of the wait
/// in CPU (about 2 % on this project's machine), and the message arrives intact.
#[test]
fn an_open_mpi_rank_waiting_for_a_peer_sleeps_instead_of_spinning() {
    let have = |p: &str| {
        Command::new("sh").args(["-c", &format!("command -v {p}")]).output().is_ok_and(|o| o.status.success())
    };
    if !(have("mpicc") && have("mpirun") && have("fi_info")) {
        assert!(std::env::var_os("CI").is_none(), "Open MPI and libfabric are installed by .ci/run");
        eprintln!("skipped: Open MPI is not installed");
        return;
    }
    let path = provider_path();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src/bench/fabric/mpi_pingpong.c");
    let exe = std::env::temp_dir().join(format!("clan-fi-mpi-idle-{}", std::process::id()));
    let cc = Command::new("mpicc").args(["-Wall", "-O2", "-o"]).arg(&exe).arg(src).output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new("timeout")
        .args(["120", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--mca", "plm", "isolated"])
        .args(["--cpu-set", "0", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"])
        .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "clan"])
        .args(["-x", "FI_PROVIDER_PATH"])
        .arg(&exe)
        .args(["idle", "1"])
        .env("FI_PROVIDER_PATH", &path)
        .env_remove("FI_PROVIDER")
        .env_remove("CLAN_FI_IDLE_US")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&exe);
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{}:\n{so}\n{se}", out.status);
    let line = so.lines().find(|l| l.starts_with("waited_ms ")).unwrap_or_else(|| panic!("no result:\n{so}\n{se}"));
    let w: Vec<&str> = line.split_whitespace().collect();
    let (waited, cpu, value): (f64, f64, i64) = (w[1].parse().unwrap(), w[3].parse().unwrap(), w[5].parse().unwrap());
    assert_eq!(value, 42, "{line}");
    assert!(waited >= 900.0, "the peer slept a second: {line}");
    assert!(cpu < 0.25 * waited, "the waiting rank spun: {line}");
}

/// Where MPICH from PyPI is (`.ci/run` installs the `mpich` wheel into a virtual
/// environment at `/opt/clan-mpich`; `CLAN_MPICH` names another).
fn mpich_bin() -> Option<std::path::PathBuf> {
    let root = std::env::var_os("CLAN_MPICH").map_or_else(|| "/opt/clan-mpich".into(), std::path::PathBuf::from);
    let bin = root.join("bin");
    (bin.join("mpiexec").exists() && bin.join("mpicc").exists()).then_some(bin)
}

/// MPICH 5 from PyPI (`pip install mpich`, its ch4 device with the ofi netmod) runs the same
/// MPI program over the clan provider, on 2 ranks and on 3 (oversubscribed), its one-sided
/// puts and gets through the provider's remote memory access. The wheel carries its own
/// libfabric (2.x), which loads our provider from `FI_PROVIDER_PATH`; MPICH is told to
/// speak the provider's API version (1.17) to it, as for any provider built against 1.x.
/// MPICH's capability report names the provider it chose.
#[test]
fn mpich_over_the_clan_provider() {
    let Some(bin) = mpich_bin() else {
        assert!(std::env::var_os("CI").is_none(), "MPICH is installed by .ci/run (/opt/clan-mpich)");
        eprintln!("skipped: MPICH (pip install mpich) is not installed");
        return;
    };
    let path = provider_path();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fabric/mpi.c");
    let exe = std::env::temp_dir().join(format!("clan-fi-mpich-{}", std::process::id()));
    let cc = Command::new(bin.join("mpicc")).args(["-Wall", "-o"]).arg(&exe).arg(src).output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    for np in ["2", "3"] {
        let out = Command::new("timeout")
            .arg("180")
            .arg(bin.join("mpiexec"))
            .args(["-n", np])
            .args(["-genv", "MPIR_CVAR_CH4_NETMOD", "ofi", "-genv", "MPIR_CVAR_NOLOCAL", "1"])
            .args(["-genv", "MPIR_CVAR_CH4_OFI_MAJOR_VERSION", "1", "-genv", "MPIR_CVAR_CH4_OFI_MINOR_VERSION", "17"])
            .args(["-genv", "MPIR_CVAR_CH4_OFI_CAPABILITY_SETS_DEBUG", "1"])
            .arg(&exe)
            .env("FI_PROVIDER_PATH", &path)
            .env("FI_PROVIDER", "clan")
            .env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()))
            .output()
            .unwrap();
        let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success() && so.lines().any(|l| l.trim() == "ok"),
            "{np} ranks ({}):\n{so}\n{se}",
            out.status
        );
        assert!(format!("{so}{se}").contains("libfabric provider: clan"), "{so}\n{se}");
    }
    let _ = std::fs::remove_file(&exe);
}

/// Two processes through libfabric's API (`tests/fabric/peers.c`): the server sleeps on its
/// completion queue's wait descriptor (`FI_WAIT_FD`, `fi_trywait`, `poll`) until the client's
/// first message wakes it, using little CPU meanwhile; then the client is SIGKILLed, and the
/// server's receive directed to it completes in error within a second, as do a send to it,
/// a read of its registered memory and a receive directed to it posted afterwards. Before
/// that the client writes 256 KiB into the server's registered buffer and reads it back
/// (remote memory access between processes, served by the server's progress while it
/// sleeps on its queue), and a forged key is rejected. Never a hang.
#[test]
fn a_sleeping_peer_wakes_and_a_killed_peer_fails_its_operations() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    if !have_fi_info() {
        eprintln!("skipped: libfabric is not installed");
        return;
    }
    let path = provider_path();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fabric/peers.c");
    let exe = std::env::temp_dir().join(format!("clan-fi-peers-{}", std::process::id()));
    let cc = Command::new("cc").args(["-Wall", "-O1", "-o"]).arg(&exe).arg(src).arg("-lfabric").output().unwrap();
    assert!(cc.status.success(), "building {src}: {}", String::from_utf8_lossy(&cc.stderr));
    let spawn = |args: &[&str]| {
        Command::new("timeout")
            .arg("120")
            .arg(&exe)
            .args(args)
            .env("FI_PROVIDER_PATH", &path)
            .env_remove("FI_PROVIDER")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut server = spawn(&["server"]);
    let mut sin = server.stdin.take().unwrap();
    let mut sout = BufReader::new(server.stdout.take().unwrap()).lines();
    let mut line = || sout.next().and_then(Result::ok).unwrap_or_default();
    let first = line();
    let addr = first.strip_prefix("addr ").unwrap_or_else(|| panic!("the server's address, got {first:?}")).to_string();
    let mut client = spawn(&["client", &addr]);
    let slept = line();
    let ready = line();
    let mut cout = BufReader::new(client.stdout.take().unwrap()).lines();
    let answered = cout.next().and_then(Result::ok).unwrap_or_default();
    // The client is SIGKILLed (`timeout` runs it in the foreground: kill the program itself).
    let killed = Command::new("pkill").args(["-KILL", "-f", &format!("{} client", exe.display())]).status().unwrap();
    let _ = writeln!(sin, "killed");
    let rest: Vec<String> = std::iter::repeat_with(&mut line).take_while(|l| !l.is_empty()).collect();
    let s = server.wait_with_output().unwrap();
    let c = client.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&exe);
    let all = format!(
        "server: {first}\n{slept}\n{ready}\n{}\n{}\nclient: {answered}\n{}",
        rest.join("\n"),
        String::from_utf8_lossy(&s.stderr),
        String::from_utf8_lossy(&c.stderr)
    );
    assert!(killed.success() && answered == "answered" && ready == "ready", "{all}");
    assert!(s.status.success() && rest.last().is_some_and(|l| l == "ok"), "{all}");
    // Asleep, not spinning: while it waited (the client waits 400 ms before it sends), the
    // server used a fraction of one CPU.
    let field = |l: &str, k: &str| -> f64 {
        let mut w = l.split_whitespace();
        w.position(|x| x == k)
            .and_then(|_| w.next())
            .and_then(|v| v.trim_end_matches(':').parse().ok())
            .unwrap_or(f64::NAN)
    };
    let (cpu, wall) = (field(&slept, "cpu_ms"), field(&slept, "wall_ms"));
    assert!(wall >= 100.0 && cpu < 0.25 * wall, "slept {wall} ms using {cpu} ms of CPU: {all}");
    let after = field(&rest[0], "after_ms");
    assert!(after < 1000.0, "the receive failed only after {after} ms: {all}");
}
