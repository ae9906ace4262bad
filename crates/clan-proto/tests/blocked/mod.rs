//! Seeing that a thread is blocked in a wait, so that a test sends the data a wait is for
//! only once the waiter sleeps in it: the wait has then looked, found nothing and armed its
//! tripwire (every wait here arms before it sleeps), and the data arrives while it waits,
//! not before it looks. An observation, not a delay: the gate opens when the kernel says
//! the thread sleeps, however long that takes.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// A thread, as the kernel reports it (`/proc/<pid>/task/<tid>/stat`).
#[derive(Debug, Clone)]
pub struct Waiter {
    stat: String,
}

impl Waiter {
    /// The calling thread.
    pub fn current() -> Waiter {
        let task = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
        Waiter { stat: format!("/proc/{}/stat", task.display()) }
    }

    /// Its scheduler state (`R`, `S`, `D`, …).
    fn state(&self) -> Option<char> {
        let s = std::fs::read_to_string(&self.stat).ok()?;
        // The command name (in parentheses) may hold anything: the state follows the last ')'.
        s.rsplit_once(')')?.1.trim_start().chars().next()
    }

    /// Return once the thread has been seen asleep (`S`) twice in a row; panic if it has not
    /// within `limit` (the wait never blocked: it spun forever, or returned and went on).
    pub fn wait_asleep(&self, limit: Duration) {
        let start = Instant::now();
        let mut seen = 0;
        loop {
            if self.state() == Some('S') {
                seen += 1;
                if seen >= 2 {
                    return;
                }
            } else {
                seen = 0;
            }
            assert!(start.elapsed() < limit, "the waiter ({}) never slept in its wait", self.stat);
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
