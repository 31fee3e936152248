//! The agent's shared state: claimed jobs, whether it pulls, whether it
//! agreed to be deleted, and which lease messages must be removed at the
//! next lease scan. Guarded by one std mutex that is never held across an
//! `.await`; the session loop is the only place that claims jobs, which
//! makes "check idle and stop pulling" atomic with respect to taking jobs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use nix::unistd::Pid;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use vq_common::messages::AgentState;

/// A job claimed by this agent (validating, running or reporting).
#[derive(Debug)]
struct Claimed {
    cancel: CancellationToken,
    pid: Option<Pid>,
    /// Stopped by the agent's shutdown, not by the job or a user.
    interrupted: bool,
    /// Broker users who may cancel it besides the control admins: the
    /// owner's name and the submitter it was judged by. Empty until the job
    /// passed validation.
    cancellers: Vec<String>,
}

/// Result of [`Shared::cancel_by`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The job runs here and was told to stop.
    Cancelled,
    /// The job runs here but the sender may not cancel it.
    Denied,
    /// No such job here.
    NotHere,
}

#[derive(Debug)]
struct Inner {
    pulling: bool,
    draining: bool,
    is_del: bool,
    jobs: BTreeMap<String, Claimed>,
    last_end: Instant,
    /// Job ids whose lease message must be removed (acked) at the next
    /// lease scan: their result is confirmed, or their claim was abandoned
    /// because the pool delivery could not be acked.
    drop_leases: BTreeSet<String>,
}

/// Result of [`Shared::claim`].
#[derive(Debug)]
pub enum Claim {
    /// Run it; the token cancels it.
    New(CancellationToken),
    /// The agent does not pull or has no free slot: return the delivery
    /// to the queue.
    Requeue,
    /// A delivery of a job that runs here (its lease is held here): a
    /// duplicate, acked and dead-lettered without running.
    Duplicate,
}

/// A point-in-time view for heartbeats.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Overall state.
    pub state: AgentState,
    /// Claimed job ids.
    pub running: Vec<String>,
    /// Whether the agent pulls jobs.
    pub is_pull: bool,
    /// Whether the agent agreed to be deleted.
    pub is_del: bool,
    /// Seconds since the last job ended (or the agent started); 0 when busy.
    pub idle_secs: f64,
}

/// Shared agent state plus the notifications the tasks wait on.
#[derive(Debug)]
pub struct Shared {
    inner: Mutex<Inner>,
    slots: usize,
    /// Wakes the session loop when pulling should change or a slot frees.
    pub pull_changed: Notify,
    /// Asks the heartbeat loop for an immediate heartbeat.
    pub heartbeat_now: Notify,
    count: watch::Sender<usize>,
}

impl Shared {
    /// New state: pulling, no jobs, `slots` slots.
    pub fn new(slots: u32) -> Self {
        Shared {
            inner: Mutex::new(Inner {
                pulling: true,
                draining: false,
                is_del: false,
                jobs: BTreeMap::new(),
                last_end: Instant::now(),
                drop_leases: BTreeSet::new(),
            }),
            slots: slots as usize,
            pull_changed: Notify::new(),
            heartbeat_now: Notify::new(),
            count: watch::channel(0).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the agent should consume its pool queue.
    pub fn wants_pull(&self) -> bool {
        self.lock().pulling
    }

    /// Free job slots.
    pub fn free_slots(&self) -> usize {
        self.slots.saturating_sub(self.lock().jobs.len())
    }

    /// Claims a pool delivery for job `key`.
    pub fn claim(&self, key: &str) -> Claim {
        let mut g = self.lock();
        if g.jobs.contains_key(key) {
            return Claim::Duplicate;
        }
        if !g.pulling || g.jobs.len() >= self.slots {
            return Claim::Requeue;
        }
        Self::insert(&mut g, key);
        let cancel = g.jobs[key].cancel.clone();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Claim::New(cancel)
    }

    /// Claims a job found in the agent's own lease queue (recovery after a
    /// restart), whatever the pulling state. `None` if it is claimed
    /// already.
    pub fn claim_recovered(&self, key: &str) -> Option<CancellationToken> {
        let mut g = self.lock();
        if g.jobs.contains_key(key) {
            return None;
        }
        Self::insert(&mut g, key);
        let cancel = g.jobs[key].cancel.clone();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Some(cancel)
    }

    fn insert(g: &mut Inner, key: &str) {
        g.jobs.insert(
            key.to_string(),
            Claimed {
                cancel: CancellationToken::new(),
                pid: None,
                interrupted: false,
                cancellers: Vec::new(),
            },
        );
    }

    /// Whether job `key` is claimed here.
    pub fn is_claimed(&self, key: &str) -> bool {
        self.lock().jobs.contains_key(key)
    }

    /// Whether every slot is taken.
    pub fn is_full(&self) -> bool {
        self.lock().jobs.len() >= self.slots
    }

    /// Records the pid of a started job.
    pub fn set_pid(&self, key: &str, pid: Pid) {
        if let Some(job) = self.lock().jobs.get_mut(key) {
            job.pid = Some(pid);
        }
    }

    /// Releases job `key` (its result is confirmed, or it never ran).
    pub fn release(&self, key: &str) {
        let mut g = self.lock();
        g.jobs.remove(key);
        g.last_end = Instant::now();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
    }

    /// Remembers that the lease message of job `key` must be removed at the
    /// next lease scan (it could not be removed now).
    pub fn drop_lease_later(&self, key: &str) {
        self.lock().drop_leases.insert(key.to_string());
    }

    /// Whether the lease of `key` is to be removed; forgets it.
    pub fn take_drop_lease(&self, key: &str) -> bool {
        self.lock().drop_leases.remove(key)
    }

    /// Forgets a pending lease removal (the lease was removed).
    pub fn forget_drop_lease(&self, key: &str) {
        self.lock().drop_leases.remove(key);
    }

    /// If no job is claimed, stops pulling and returns `Ok`; else returns
    /// the claimed ids and changes nothing. Atomic with respect to
    /// [`Shared::claim`].
    pub fn try_stop_for_delete(&self) -> Result<(), Vec<String>> {
        let mut g = self.lock();
        if g.jobs.is_empty() {
            g.pulling = false;
            Ok(())
        } else {
            Err(g.jobs.keys().cloned().collect())
        }
    }

    /// Marks the agent as agreeing to deletion (after the consumer is gone).
    pub fn mark_deleted(&self) {
        self.lock().is_del = true;
        self.heartbeat_now.notify_one();
    }

    /// Stops pulling and marks the agent as draining. Returns `false` if it
    /// was already draining.
    pub fn start_drain(&self) -> bool {
        let mut g = self.lock();
        g.pulling = false;
        let first = !g.draining;
        g.draining = true;
        drop(g);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
        first
    }

    /// Waits until no job is claimed.
    pub async fn wait_idle(&self) {
        let mut rx = self.count.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Records who besides the control admins may cancel job `key` (its
    /// owner and the submitter it was judged by).
    pub fn set_cancellers(&self, key: &str, users: Vec<String>) {
        if let Some(job) = self.lock().jobs.get_mut(key) {
            job.cancellers = users;
        }
    }

    /// Cancels job `key` (SIGTERM, then SIGKILL) on behalf of broker user
    /// `by`, who must be a control admin (`admin`) or one of the job's
    /// cancellers.
    pub fn cancel_by(&self, key: &str, by: &str, admin: bool) -> CancelOutcome {
        match self.lock().jobs.get(key) {
            Some(job) if admin || job.cancellers.iter().any(|u| u == by) => {
                job.cancel.cancel();
                CancelOutcome::Cancelled
            }
            Some(_) => CancelOutcome::Denied,
            None => CancelOutcome::NotHere,
        }
    }

    /// Stops every claimed job because the agent shuts down: rerunnable
    /// ones keep their lease (to be run again), others are reported failed.
    pub fn interrupt_all(&self) {
        for job in self.lock().jobs.values_mut() {
            job.interrupted = true;
            job.cancel.cancel();
        }
    }

    /// Whether job `key` was stopped by [`Shared::interrupt_all`].
    pub fn take_interrupted(&self, key: &str) -> bool {
        self.lock().jobs.get(key).is_some_and(|j| j.interrupted)
    }

    /// Sends SIGKILL to the process group of every started job (forced
    /// exit).
    pub fn kill_all(&self) {
        for job in self.lock().jobs.values() {
            if let Some(pid) = job.pid {
                let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }

    /// A view for heartbeats.
    pub fn snapshot(&self) -> Snapshot {
        let g = self.lock();
        let running: Vec<String> = g.jobs.keys().cloned().collect();
        let state = match (running.is_empty(), g.draining || !g.pulling, g.is_del) {
            (false, false, _) => AgentState::Busy,
            (false, true, _) => AgentState::Draining,
            (true, _, true) => AgentState::Drained,
            (true, true, false) if g.draining => AgentState::Drained,
            (true, true, false) => AgentState::Draining,
            (true, false, false) => AgentState::Idle,
        };
        Snapshot {
            idle_secs: if running.is_empty() {
                g.last_end.elapsed().as_secs_f64()
            } else {
                0.0
            },
            state,
            running,
            is_pull: g.pulling,
            is_del: g.is_del,
        }
    }
}
