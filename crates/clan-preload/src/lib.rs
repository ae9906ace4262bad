//! The socket interposition library behind `clan run -- CMD` (loaded with `LD_PRELOAD`).
//!
//! A TCP connection between two processes of this host that both run under `clan run` is
//! carried over a clan stream (shared memory, tripwire wake-ups); every other socket — a peer
//! not under clan, another host, UDP, Unix sockets — stays with the kernel, untouched.
//!
//! - **Deciding** (`registry.rs`): before its kernel `connect`, a client claims the
//!   connection from the listening process's library (a host-local registry of clan-run
//!   listeners, answered by a thread of the library, not by the application), passing its
//!   socket as proof; the server's `accept` recognises the claimed connection by its peer
//!   socket's inode. No byte ever travels on two paths, and neither side waits for the
//!   other's application (a slow acceptor, a server that speaks first). A process that
//!   connects again and again to one server has its next connection's stream made ahead
//!   (`spares.rs`).
//! - **The descriptor** stays the kernel's TCP socket: `getpeername`, socket options, `dup`
//!   and the listening socket's readiness keep working; its bytes move over the stream.
//! - **Short connections** (`short.rs`): a process whose connections to a server carry too
//!   little to repay a stream's set-up (a connection per request) makes its next ones plain
//!   TCP connections, but for a probe now and then that goes over clan to look again.
//! - **Readiness** (`ready.rs`): `poll`, `select` and `epoll` read accelerated descriptors'
//!   readiness from their streams and sleep in the kernel on the other descriptors together
//!   with the streams' event queues.
//!
//! - **Other processes** (`fork.rs`): a connection a child after `fork` touches, that
//!   survives an `exec` or `posix_spawn`, or that is passed with `SCM_RIGHTS`, goes over
//!   to the kernel's socket under it, losing and doubling no byte; the peer follows.
#![deny(unsafe_code)]

/// `CLAN_LOG=debug` (or `CLAN_RUN_DEBUG=1`): say on stderr what was decided for each
/// connection and why (accelerated, left to the kernel, gone over to it). Tests read it.
pub(crate) fn say(what: std::fmt::Arguments<'_>) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = || {
        std::env::var_os("CLAN_RUN_DEBUG").is_some_and(|v| v != "0")
            || std::env::var("CLAN_LOG").is_ok_and(|v| {
                v.split(',').any(|d| {
                    let level = d.rsplit('=').next().unwrap_or("");
                    level.eq_ignore_ascii_case("debug") || level.eq_ignore_ascii_case("trace")
                })
            })
    };
    if *ON.get_or_init(on) {
        eprintln!("clan run[{}]: {what}", std::process::id());
    }
}

mod answers;
mod conn;
mod fork;
mod hooks;
mod procnet;
mod ready;
mod real;
mod registry;
mod short;
mod spares;
mod table;
