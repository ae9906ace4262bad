//! Tripsets: wait for any of a group of tripwires of one endpoint.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clan_shm::trip;

use crate::error::TripwireError;
use crate::event_queue::EqInner;
use crate::lock;
use crate::progress::{self, Deadline};
use crate::tripwire::{Tripwire, TripwireId, WatchOwner};

#[derive(Debug)]
struct Member {
    id: TripwireId,
    /// Whose queue holds its cell.
    owner: Arc<WatchOwner>,
    last_seen: u32,
}

impl Member {
    /// Its firing state, in the queue's table.
    fn cell(&self) -> &trip::TripCell {
        &self.owner.eq.view().table.cells[self.id.index as usize]
    }

    /// Whether the tripwire is still this member (not destroyed, not reused).
    fn is_live(&self) -> bool {
        trip::is_live(self.cell(), self.id.generation)
    }
}

/// A group of tripwires of one endpoint, waited on together. `Send` and `Sync`.
///
/// ```
/// use std::time::Duration;
/// use clan::{TripwireConfig, TripwireError};
///
/// let nic = clan::Nic::open_default()?;
/// let (ep, peer) = (nic.endpoint()?, nic.endpoint()?);
/// let ap = ep.export(4096)?;
/// let a = ap.tripwire(TripwireConfig::writes(0..8))?;
/// let b = ap.tripwire(TripwireConfig::writes(64..72))?;
/// let set = ep.tripset()?;
/// set.add(&a)?;
/// set.add(&b)?;
/// assert_eq!(set.add(&a), Err(TripwireError::InTripset));
/// assert_eq!(set.wait(Some(Duration::from_millis(5))), Err(TripwireError::Timeout));
/// peer.import(&ap.descriptor())?.store_u64(64, 1)?;
/// assert_eq!(set.wait(Some(Duration::from_secs(5)))?, vec![b.id()]);
/// assert!(set.poll().is_empty(), "nothing fired since");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Each member links to the tripset's wake word in the event queue's segment; a firing of
/// any member bumps it and wakes the waiters, who then find which members fired by comparing
/// their firing sequence numbers (no system call when nothing sleeps).
pub struct Tripset {
    eq: Arc<EqInner>,
    endpoint: u32,
    slot: u32,
    members: Mutex<Vec<Member>>,
}

impl std::fmt::Debug for Tripset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tripset")
            .field("queue", &self.eq.id)
            .field("endpoint", &self.endpoint)
            .field("members", &crate::lock(&self.members).len())
            .finish()
    }
}

impl Tripset {
    pub(crate) fn new(eq: Arc<EqInner>, endpoint: u32) -> Result<Tripset, TripwireError> {
        let slot = eq.alloc_tripset().ok_or(TripwireError::TripsetsFull { capacity: eq.layout.params.tripset_cap })?;
        Ok(Tripset { eq, endpoint, slot, members: Mutex::new(Vec::new()) })
    }

    /// Add a tripwire of the same endpoint. A tripwire belongs to at most one tripset.
    pub fn add(&self, tw: &Tripwire) -> Result<(), TripwireError> {
        if !Arc::ptr_eq(&tw.owner.eq, &self.eq) || tw.owner.endpoint != self.endpoint {
            return Err(TripwireError::Foreign);
        }
        let c = tw.cell();
        let mut m = lock(&self.members);
        if c.tripset.load(Ordering::Relaxed) != 0 {
            return Err(TripwireError::InTripset);
        }
        let last_seen = tw.cell().seq.load(Ordering::Acquire);
        // Linking before the waiters' fence: see `clan_shm::trip::fire` (reads the link after
        // its own fence), model-checked by `tripset_link_vs_fire`.
        c.tripset.store(self.slot + 1, Ordering::Relaxed);
        m.push(Member { id: tw.id, owner: tw.owner.clone(), last_seen });
        Ok(())
    }

    /// Remove a member; returns whether it was one.
    pub fn remove(&self, tw: &Tripwire) -> bool {
        let mut m = lock(&self.members);
        let Some(p) = m.iter().position(|x| x.id == tw.id) else {
            return false;
        };
        m.remove(p);
        let _ = tw.cell().tripset.compare_exchange(self.slot + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        true
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        lock(&self.members).len()
    }

    /// Whether there are no members.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The members that fired since the last `poll`/`wait` (or since they were added).
    pub fn poll(&self) -> Vec<TripwireId> {
        self.eq.pump();
        let mut m = lock(&self.members);
        let mut out = Vec::new();
        // Members destroyed since they were added are dropped from the set.
        m.retain(Member::is_live);
        for x in m.iter_mut() {
            let now = x.cell().seq.load(Ordering::Acquire);
            if now != x.last_seen {
                x.last_seen = now;
                out.push(x.id);
            }
        }
        out
    }

    /// Block until a member fires (spinning for the queue's spin time first); returns the
    /// members that fired.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<TripwireId>, TripwireError> {
        let v = self.eq.view();
        let w = &v.table.tripsets[self.slot as usize];
        let fired = || {
            let m = lock(&self.members);
            m.iter().any(|x| x.cell().seq.load(Ordering::Acquire) != x.last_seen)
        };
        // Another waiter may take what fired first: then wait on. (`poll` pumps the ports.)
        let poll = || {
            self.eq.pump();
            if fired() { Some(self.poll()).filter(|f| !f.is_empty()) } else { None }
        };
        let sleep = |nap: Option<Duration>| {
            let until = nap.map(|n| Instant::now() + n);
            self.eq.wait_word(&w.seq, &w.waiters, until, fired);
        };
        progress::wait(self.eq.config.spin, Deadline::after(timeout), None, poll, sleep).ok_or(TripwireError::Timeout)
    }
}

impl Drop for Tripset {
    fn drop(&mut self) {
        let m = self.members.get_mut().unwrap_or_else(|e| e.into_inner());
        for x in m.drain(..).filter(Member::is_live) {
            let _ = x.cell().tripset.compare_exchange(self.slot + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        self.eq.free_tripset(self.slot);
    }
}
