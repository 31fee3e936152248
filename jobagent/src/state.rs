//! The agent's shared state: claimed jobs (and whether each claim is
//! settled: owned through its claim marker), whether it pulls, whether it
//! agreed to be deleted. Guarded by one std mutex that is never held across an
//! `.await`; the session loop is the only place that claims jobs, which
//! makes "check idle and stop pulling" atomic with respect to taking jobs.

use std::collections::BTreeMap;
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
    /// The claim id: a UUID, `x-vq-claim` of the lease copy and argument
    /// of the job's claim marker.
    claim: String,
    /// Set once the claim is settled: the job's claim marker is ours.
    owned: Option<Owned>,
}

/// A settled claim: this agent owns the job through its claim marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    /// The job's losses to lost nodes before this execution.
    pub losses: u32,
    /// Whether the broker confirmed the ack of the pool delivery; if not, a
    /// copy of the job may still be queued and the marker is kept after the
    /// job ends (`vq_common::lease::may_delete_marker`).
    pub ack_confirmed: bool,
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
}

/// Result of [`Shared::claim`].
#[derive(Debug)]
pub enum Claim {
    /// Run it under claim id `claim` (a fresh UUID); the token cancels it.
    New {
        /// Cancels the job.
        cancel: CancellationToken,
        /// The claim id.
        claim: String,
    },
    /// The agent does not pull or has no free slot: return the delivery
    /// to the queue.
    Requeue,
    /// A delivery of a job claimed here already: a copy (a redelivery of
    /// it, or a duplicate submission), dead-lettered without running.
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
    /// Claims not settled yet (no marker known to be ours).
    unsettled: watch::Sender<usize>,
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
            }),
            slots: slots as usize,
            pull_changed: Notify::new(),
            heartbeat_now: Notify::new(),
            count: watch::channel(0).0,
            unsettled: watch::channel(0).0,
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
        let claim = uuid::Uuid::new_v4().to_string();
        Self::insert(&mut g, key, &claim);
        self.count_unsettled(&g);
        let cancel = g.jobs[key].cancel.clone();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Claim::New { cancel, claim }
    }

    /// Claims a job found in the agent's own lease queue whose marker is
    /// ours (recovery after a restart), whatever the pulling state; the
    /// claim is settled at once. `None` if it is claimed already.
    pub fn claim_recovered(
        &self,
        key: &str,
        claim: &str,
        owned: Owned,
    ) -> Option<CancellationToken> {
        let mut g = self.lock();
        if g.jobs.contains_key(key) {
            return None;
        }
        Self::insert(&mut g, key, claim);
        if let Some(j) = g.jobs.get_mut(key) {
            j.owned = Some(owned);
        }
        let cancel = g.jobs[key].cancel.clone();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Some(cancel)
    }

    fn insert(g: &mut Inner, key: &str, claim: &str) {
        g.jobs.insert(
            key.to_string(),
            Claimed {
                cancel: CancellationToken::new(),
                pid: None,
                interrupted: false,
                cancellers: Vec::new(),
                claim: claim.to_string(),
                owned: None,
            },
        );
    }

    fn count_unsettled(&self, g: &Inner) {
        let n = g.jobs.values().filter(|j| j.owned.is_none()).count();
        self.unsettled.send_replace(n);
    }

    /// Settles the claim of job `key`: its marker is ours.
    pub fn set_owned(&self, key: &str, owned: Owned) {
        let mut g = self.lock();
        if let Some(j) = g.jobs.get_mut(key) {
            j.owned = Some(owned);
        }
        self.count_unsettled(&g);
    }

    /// The settled claim of job `key`, if any.
    pub fn owned(&self, key: &str) -> Option<Owned> {
        self.lock().jobs.get(key).and_then(|j| j.owned.clone())
    }

    /// Every settled claim: `(job id, claim id)`.
    pub fn owned_claims(&self) -> Vec<(String, String)> {
        self.lock()
            .jobs
            .iter()
            .filter(|(_, j)| j.owned.is_some())
            .map(|(k, j)| (k.clone(), j.claim.clone()))
            .collect()
    }

    /// The claim id under which job `key` is claimed here, if it is.
    pub fn claim_id(&self, key: &str) -> Option<String> {
        self.lock().jobs.get(key).map(|j| j.claim.clone())
    }

    /// Waits until every claim is settled or released. A session waits for
    /// this before it pulls, so that a delivery returned by the broker when
    /// the previous session was lost is judged against settled claims.
    pub async fn wait_settled(&self) {
        let mut rx = self.unsettled.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
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
        self.count_unsettled(&g);
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn owned() -> Owned {
        Owned {
            losses: 0,
            ack_confirmed: true,
        }
    }

    #[test]
    fn a_second_delivery_of_a_claimed_job_is_a_duplicate() {
        let s = Shared::new(2);
        assert!(matches!(s.claim("j1"), Claim::New { .. }));
        assert!(matches!(s.claim("j1"), Claim::Duplicate));
        assert!(matches!(s.claim("j2"), Claim::New { .. }));
        assert!(matches!(s.claim("j3"), Claim::Requeue), "no free slot");
    }

    #[test]
    fn every_claim_gets_its_own_claim_id() {
        let s = Shared::new(2);
        let Claim::New { claim: a, .. } = s.claim("j1") else {
            panic!("claimed")
        };
        s.release("j1");
        let Claim::New { claim: b, .. } = s.claim("j1") else {
            panic!("claimed")
        };
        assert_ne!(a, b);
        assert_eq!(s.claim_id("j1"), Some(b));
    }

    #[tokio::test]
    async fn a_session_pulls_only_once_every_claim_is_settled() {
        let s = std::sync::Arc::new(Shared::new(2));
        let _ = s.claim("j1");
        let _ = s.claim("j2");
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move { s.wait_settled().await })
        };
        s.set_owned("j1", owned());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "j2 is not settled yet");
        s.release("j2");
        waiter.await.unwrap();
        assert_eq!(s.owned_claims().len(), 1);
        assert_eq!(s.owned("j1"), Some(owned()));
    }

    #[test]
    fn a_recovered_claim_is_settled_at_once() {
        let s = Shared::new(1);
        let c = s.claim_recovered("j1", "c1", owned());
        assert!(c.is_some());
        assert_eq!(s.owned_claims(), vec![("j1".to_string(), "c1".to_string())]);
        assert!(s.claim_recovered("j1", "c2", owned()).is_none());
    }

    #[test]
    fn ask_delete_with_a_claimed_job_changes_nothing_and_says_no() {
        let s = Shared::new(1);
        let _ = s.claim("j1");
        assert_eq!(s.try_stop_for_delete(), Err(vec!["j1".to_string()]));
        assert!(s.wants_pull());
        s.release("j1");
        assert_eq!(s.try_stop_for_delete(), Ok(()));
        assert!(!s.wants_pull());
        assert!(matches!(s.claim("j2"), Claim::Requeue), "stopped pulling");
    }
}
