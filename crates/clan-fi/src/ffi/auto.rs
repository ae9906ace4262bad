//! Automatic data progress (`FI_PROGRESS_AUTO`, when the caller's hints ask for it): a thread
//! per domain makes the progress of the domain's endpoints, so that peers' messages are taken
//! in and their remote memory requests served while the application computes and never
//! calls in. It sleeps on the domain's event queue (every receiver reports there) and wakes
//! when a sender publishes; completion queues and counters of such a domain then sleep on
//! queues of their own (`CqObj::wait`), woken by the completions the thread pushes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::prepare_eps;
use crate::rdm::Sleeper;

/// The progress thread of a domain, and the endpoints it serves.
pub(super) struct Auto {
    /// The endpoints (`EpObj` addresses). An endpoint removes itself under this lock before
    /// it is freed, and the thread works on them only under it.
    pub(super) eps: Arc<Mutex<Vec<usize>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Auto {
    /// Start the thread; it sleeps on `queue`.
    pub(super) fn start(queue: clan::EventQueue) -> std::io::Result<Auto> {
        let eps: Arc<Mutex<Vec<usize>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (e2, s2) = (eps.clone(), stop.clone());
        let thread = std::thread::Builder::new().name("clan-fi-progress".into()).spawn(move || {
            // Pairs with the Release store in `drop`.
            while !s2.load(Ordering::Acquire) {
                let idle = {
                    let eps = e2.lock().unwrap_or_else(|p| p.into_inner());
                    super::progress_eps(&eps, &mut crate::cq::Direct::none());
                    // (drained before arming: events from now on are for the next look)
                    while queue.try_take().is_some() {}
                    // (this thread sleeps again as soon as it has made progress: the
                    // receivers stay armed)
                    prepare_eps(&eps, Sleeper::Theirs)
                };
                if idle {
                    // (bounded, so that a stop is seen)
                    let _ = queue.wait(Some(Duration::from_millis(50)));
                }
            }
        })?;
        Ok(Auto { eps, stop, thread: Some(thread) })
    }

    pub(super) fn add(&self, ep: usize) {
        self.eps.lock().unwrap_or_else(|p| p.into_inner()).push(ep);
    }

    pub(super) fn remove(&self, ep: usize) {
        self.eps.lock().unwrap_or_else(|p| p.into_inner()).retain(|e| *e != ep);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.eps.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

impl Drop for Auto {
    fn drop(&mut self) {
        // Pairs with the Acquire load in the thread's loop.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
