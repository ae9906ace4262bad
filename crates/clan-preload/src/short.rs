//! Short connections stay with the kernel: a process whose connections to a server carry
//! too little to repay a clan stream's set-up makes its next ones plain TCP connections.
//!
//! A connection over clan costs more to open and close than the kernel's (a stream made,
//! imported and let go on both sides: some 130 system calls and five context switches
//! against the kernel's 27 and none, `docs/ARCHITECTURE.md`, "System calls of a short
//! connection"), and repays it with every exchange: each request and reply is a store into
//! shared memory instead of a trip through the kernel's TCP stack. A program that opens a
//! connection per request (`redis-benchmark -k 0`, an HTTP/1.0 client) never gets it back:
//! under `clan run` it ran at a quarter of its kernel speed.
//!
//! So each client connection over clan counts what it carried: its *turns* (writes that
//! follow a read, the first write included: a request and its reply is one) and the bytes
//! it wrote and read. One that made [`min_turns`] turns or moved [`PAID_BYTES`] *paid*. When
//! the last [`HISTORY`] connections to a server (its listening address) that ended over clan
//! hold at most [`SHORT_PAID`] that paid, the next connections to it stay with the kernel,
//! but for a probe now and then, which goes over clan to see whether the program changed
//! its ways: the first after [`PROBE_EVERY`] connections, each probe that did not pay
//! doubling the gap to the next (up to [`PROBE_MAX`]), one that paid bringing it back to
//! [`PROBE_EVERY`] (a probe costs what a short connection over clan costs, several kernel
//! ones); and a history that heard nothing for [`FORGET`] is forgotten, so a program
//! that now connects rarely (long connections are rare) is back over clan at its next one.
//! A connection that stays with the kernel does so from its `connect` on, on both sides
//! (the server's `accept` finds no claim for it): nothing moves between the two paths.
//!
//! `CLAN_RUN_MIN_TURNS` sets [`min_turns`] (default [`DEFAULT_MIN_TURNS`]); `0` sends every
//! connection over clan, however short.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Turns a connection must make to have paid for its set-up, by default.
pub(crate) const DEFAULT_MIN_TURNS: u32 = 8;
/// Bytes (written and read) that pay for a connection's set-up whatever its turns.
pub(crate) const PAID_BYTES: u64 = 256 << 10;
/// Connections remembered per server.
pub(crate) const HISTORY: u32 = 8;
/// A server whose last [`HISTORY`] connections hold at most this many that paid is short.
pub(crate) const SHORT_PAID: u32 = 1;
/// While a server is short, the first probe (a connection over clan all the same) comes
/// after this many connections, and after a probe that paid, the next.
pub(crate) const PROBE_EVERY: u32 = 64;
/// The gap between probes, doubled by each that did not pay, grows to this at most.
pub(crate) const PROBE_MAX: u32 = 1024;
/// A server's history is forgotten once no connection to it ended over clan for this long.
pub(crate) const FORGET: Duration = Duration::from_secs(2);
/// Servers remembered at most (the least recently heard of goes first).
pub(crate) const SERVERS: usize = 64;

/// `CLAN_RUN_MIN_TURNS`, read once: 0 turns the policy off.
pub(crate) fn min_turns() -> u32 {
    static MIN: OnceLock<u32> = OnceLock::new();
    *MIN.get_or_init(|| match std::env::var("CLAN_RUN_MIN_TURNS") {
        Err(_) => DEFAULT_MIN_TURNS,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            crate::say(format_args!("CLAN_RUN_MIN_TURNS={v:?} is not a number: {DEFAULT_MIN_TURNS} turns it is"));
            DEFAULT_MIN_TURNS
        }),
    })
}

/// What a connection carried, counted by the connection as it goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Carried {
    pub turns: u32,
    pub bytes: u64,
}

impl Carried {
    fn paid(self, min_turns: u32) -> bool {
        self.turns >= min_turns || self.bytes >= PAID_BYTES
    }
}

/// One server's recent connections.
#[derive(Debug)]
struct History {
    server: SocketAddr,
    /// The last `len` outcomes, newest in bit 0: 1 paid.
    paid: u32,
    len: u32,
    /// Connections that stayed with the kernel since the last probe (or since the server was
    /// found short).
    kept: u32,
    /// Connections between two probes now (`PROBE_EVERY` up to `PROBE_MAX`).
    gap: u32,
    /// Probes made whose outcome was not heard yet: the next outcomes heard are theirs (a
    /// connection made before the verdict that ends after it, as a client's other threads'
    /// do, is no probe: it leaves the gap alone).
    probing: u32,
    heard: Instant,
}

impl History {
    fn new(server: SocketAddr, now: Instant) -> History {
        History { server, paid: 0, len: 0, kept: 0, gap: PROBE_EVERY, probing: 0, heard: now }
    }

    fn short(&self) -> bool {
        self.len >= HISTORY && (self.paid & ((1 << HISTORY) - 1)).count_ones() <= SHORT_PAID
    }
}

/// The servers' histories, and the policy's decisions on them.
#[derive(Debug, Default)]
pub(crate) struct Policy {
    servers: Vec<History>,
}

/// What [`Policy::decide`] says of a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Over clan (the server is not short, or nothing is known of it).
    Clan,
    /// Over clan, to look again at a short server.
    Probe,
    /// With the kernel: its connections are short.
    Kernel,
}

impl Policy {
    /// A new connection to `server` at `now`.
    pub(crate) fn decide(&mut self, server: SocketAddr, now: Instant) -> Decision {
        let Some(i) = self.servers.iter().position(|h| h.server == server) else {
            return Decision::Clan;
        };
        if now.saturating_duration_since(self.servers[i].heard) >= FORGET {
            self.servers.swap_remove(i);
            return Decision::Clan;
        }
        let h = &mut self.servers[i];
        if !h.short() {
            return Decision::Clan;
        }
        h.kept += 1;
        if h.kept >= h.gap {
            h.kept = 0;
            h.probing += 1;
            Decision::Probe
        } else {
            Decision::Kernel
        }
    }

    /// A connection to `server` that ended over clan at `now` carried `c`. Returns whether
    /// the server's verdict changed (short now, or not any more).
    pub(crate) fn record(&mut self, server: SocketAddr, c: Carried, min_turns: u32, now: Instant) -> Option<bool> {
        let i = match self.servers.iter().position(|h| h.server == server) {
            Some(i) if now.saturating_duration_since(self.servers[i].heard) < FORGET => i,
            Some(i) => {
                self.servers[i] = History::new(server, now);
                i
            }
            None => {
                if self.servers.len() >= SERVERS {
                    if let Some(old) = (0..self.servers.len()).min_by_key(|&k| self.servers[k].heard) {
                        self.servers.swap_remove(old);
                    }
                }
                self.servers.push(History::new(server, now));
                self.servers.len() - 1
            }
        };
        let h = &mut self.servers[i];
        let was = h.short();
        let paid = c.paid(min_turns);
        if was && h.probing > 0 {
            h.probing -= 1;
            h.gap = if paid { PROBE_EVERY } else { (h.gap * 2).min(PROBE_MAX) };
        }
        h.paid = (h.paid << 1) | u32::from(paid);
        h.len = (h.len + 1).min(HISTORY);
        h.heard = now;
        let is = h.short();
        if is != was {
            h.kept = 0;
            h.gap = PROBE_EVERY;
            h.probing = 0;
        }
        (is != was).then_some(is)
    }
}

fn policy() -> std::sync::MutexGuard<'static, Policy> {
    static POLICY: Mutex<Policy> = Mutex::new(Policy { servers: Vec::new() });
    POLICY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A new connection to `server`: whether it stays with the kernel (its connections are
/// short). Says a probe under `CLAN_RUN_DEBUG` (no line of this module says "over clan":
/// tests count the connections that went so by that phrase).
pub(crate) fn keep_on_kernel(server: SocketAddr) -> bool {
    if min_turns() == 0 {
        return false;
    }
    let d = policy().decide(server, Instant::now());
    if d == Decision::Probe {
        crate::say(format_args!("connection to {server}: its connections are short, this one is a probe (clan)"));
    }
    d == Decision::Kernel
}

/// A client connection to `server` ended over clan, having carried `c`.
pub(crate) fn ended(server: SocketAddr, c: Carried) {
    let min = min_turns();
    if min == 0 {
        return;
    }
    let changed = policy().record(server, c, min, Instant::now());
    match changed {
        Some(true) => crate::say(format_args!(
            "connections to {server} are short (at most {SHORT_PAID} of the last {HISTORY} made {min} turns or moved \
             {PAID_BYTES} bytes): the next stay with the kernel, but for a probe now and then"
        )),
        Some(false) => crate::say(format_args!("connections to {server} are not short any more: clan again")),
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    const SHORT: Carried = Carried { turns: 1, bytes: 40 };
    const LONG: Carried = Carried { turns: 20, bytes: 4000 };

    #[test]
    fn a_server_is_short_after_a_full_history_of_short_connections() {
        let (mut p, t, s) = (Policy::default(), Instant::now(), addr(1));
        for k in 0..HISTORY {
            assert_eq!(p.decide(s, t), Decision::Clan, "connection {k}: nothing known yet");
            let changed = p.record(s, SHORT, 8, t);
            assert_eq!(changed, (k == HISTORY - 1).then_some(true));
        }
        // The first probe after PROBE_EVERY connections; each that did not pay doubles the
        // gap, up to PROBE_MAX.
        let mut gaps = Vec::new();
        let mut since = 0;
        for _ in 0..PROBE_EVERY * 64 {
            since += 1;
            if p.decide(s, t) == Decision::Probe {
                gaps.push(since);
                since = 0;
                assert_eq!(p.record(s, SHORT, 8, t), None);
            }
        }
        assert_eq!(&gaps[..6], &[PROBE_EVERY, PROBE_EVERY * 2, PROBE_EVERY * 4, PROBE_EVERY * 8, PROBE_MAX, PROBE_MAX]);
        assert!(gaps.iter().all(|g| *g <= PROBE_MAX), "{gaps:?}");
        // Another server is unaffected.
        assert_eq!(p.decide(addr(2), t), Decision::Clan);
    }

    #[test]
    fn connections_that_pay_keep_a_server_over_clan() {
        let (mut p, t, s) = (Policy::default(), Instant::now(), addr(1));
        // Two of every eight pay: more than SHORT_PAID.
        for k in 0..HISTORY * 4 {
            let c = if k % 4 == 0 { LONG } else { SHORT };
            assert_eq!(p.record(s, c, 8, t), None);
            assert_eq!(p.decide(s, t), Decision::Clan);
        }
        // Bytes alone pay too.
        let bulk = Carried { turns: 1, bytes: PAID_BYTES };
        let mut p = Policy::default();
        for _ in 0..HISTORY * 2 {
            p.record(s, bulk, 8, t);
        }
        assert_eq!(p.decide(s, t), Decision::Clan);
    }

    #[test]
    fn probes_that_pay_bring_a_short_server_back() {
        let (mut p, t, s) = (Policy::default(), Instant::now(), addr(1));
        for _ in 0..HISTORY {
            p.record(s, SHORT, 8, t);
        }
        assert_eq!(p.decide(s, t), Decision::Kernel);
        // Connections made before the verdict, ending after it: no probes, the gap stays.
        p.record(s, SHORT, 8, t);
        assert_eq!(p.servers[0].gap, PROBE_EVERY);
        // A probe that did not pay, then one that paid: the gap back at its start.
        while p.decide(s, t) != Decision::Probe {}
        p.record(s, SHORT, 8, t);
        assert_eq!(p.servers[0].gap, PROBE_EVERY * 2);
        while p.decide(s, t) != Decision::Probe {}
        assert_eq!(p.record(s, LONG, 8, t), None, "one paid: still short");
        assert_eq!(p.servers[0].gap, PROBE_EVERY);
        assert_eq!(p.record(s, LONG, 8, t), Some(false), "two paid: over clan again");
        assert_eq!(p.decide(s, t), Decision::Clan);
    }

    #[test]
    fn a_history_heard_of_long_ago_is_forgotten() {
        let (mut p, t, s) = (Policy::default(), Instant::now(), addr(1));
        for _ in 0..HISTORY {
            p.record(s, SHORT, 8, t);
        }
        assert_eq!(p.decide(s, t + FORGET / 2), Decision::Kernel);
        assert_eq!(p.decide(s, t + FORGET), Decision::Clan);
        // Forgotten: a full history again before the next verdict.
        for k in 0..HISTORY {
            assert_eq!(p.decide(s, t + FORGET), Decision::Clan, "{k}");
            p.record(s, SHORT, 8, t + FORGET);
        }
        assert_eq!(p.decide(s, t + FORGET), Decision::Kernel);
        // Recorded after a long silence: the old outcomes do not count.
        let later = t + FORGET * 3;
        assert_eq!(p.record(s, SHORT, 8, later), None);
        assert_eq!(p.decide(s, later), Decision::Clan);
    }

    #[test]
    fn the_servers_remembered_are_bounded() {
        let (mut p, t) = (Policy::default(), Instant::now());
        for k in 0..SERVERS as u16 * 3 {
            p.record(addr(k), SHORT, 8, t + Duration::from_millis(u64::from(k)));
        }
        assert_eq!(p.servers.len(), SERVERS);
        // The newest are the ones kept.
        assert!(p.servers.iter().all(|h| h.server.port() >= SERVERS as u16 * 2));
    }
}
