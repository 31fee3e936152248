//! The agent's shared state: claimed jobs, whether it pulls, whether it
//! agreed to be deleted. Guarded by one std mutex that is never held across
//! an `.await`; the session loop is the only place that claims jobs, which
//! makes "check idle and stop pulling" atomic with respect to taking jobs.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use lapin::Acker;
use nix::unistd::Pid;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use vq_common::messages::AgentState;

/// How many job ids whose ack was lost are remembered.
const ACK_LOST_MEMORY: usize = 1024;

/// A job claimed by this agent (validating, running or reporting).
#[derive(Debug)]
struct Claimed {
    cancel: CancellationToken,
    pid: Option<Pid>,
    /// Ackers of redeliveries of this job that arrived while it ran.
    extra: Vec<Acker>,
}

#[derive(Debug)]
struct Inner {
    pulling: bool,
    draining: bool,
    is_del: bool,
    jobs: BTreeMap<String, Claimed>,
    last_end: Instant,
    ack_lost: VecDeque<String>,
}

/// Result of [`Shared::claim`].
#[derive(Debug)]
pub enum Claim {
    /// Run it; the token cancels it.
    New(CancellationToken),
    /// The agent does not pull: return the delivery to the queue.
    Requeue,
    /// A redelivery of a job running here: its acker was attached and is
    /// acked when the job ends.
    Attached,
    /// A redelivery of a job that already finished here but whose ack was
    /// lost: ack it without running it again.
    AlreadyDone,
    /// A fresh delivery with the id of a job running here: refuse it.
    DuplicateId,
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
                ack_lost: VecDeque::new(),
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

    /// Claims a delivery for job `key`.
    pub fn claim(&self, key: &str, redelivered: bool, acker: &Acker) -> Claim {
        let mut g = self.lock();
        if let Some(job) = g.jobs.get_mut(key) {
            if redelivered {
                job.extra.push(acker.clone());
                return Claim::Attached;
            }
            return Claim::DuplicateId;
        }
        if redelivered && g.ack_lost.iter().any(|k| k == key) {
            return Claim::AlreadyDone;
        }
        if !g.pulling {
            return Claim::Requeue;
        }
        let cancel = CancellationToken::new();
        g.jobs.insert(
            key.to_string(),
            Claimed {
                cancel: cancel.clone(),
                pid: None,
                extra: Vec::new(),
            },
        );
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Claim::New(cancel)
    }

    /// Records the pid of a started job.
    pub fn set_pid(&self, key: &str, pid: Pid) {
        if let Some(job) = self.lock().jobs.get_mut(key) {
            job.pid = Some(pid);
        }
    }

    /// Releases job `key` after its report; returns ackers of redeliveries
    /// to ack as well.
    pub fn release(&self, key: &str) -> Vec<Acker> {
        let mut g = self.lock();
        let extra = g.jobs.remove(key).map(|j| j.extra).unwrap_or_default();
        g.last_end = Instant::now();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
        extra
    }

    /// Remembers that the ack of job `key` was lost with its channel, so a
    /// redelivery is acked instead of run again.
    pub fn note_ack_lost(&self, key: &str) {
        let mut g = self.lock();
        g.ack_lost.push_back(key.to_string());
        while g.ack_lost.len() > ACK_LOST_MEMORY {
            g.ack_lost.pop_front();
        }
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

    /// Cancels job `key` (SIGTERM, then SIGKILL). Returns whether it was
    /// claimed here.
    pub fn cancel(&self, key: &str) -> bool {
        match self.lock().jobs.get(key) {
            Some(job) => {
                job.cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// Cancels every claimed job.
    pub fn cancel_all(&self) {
        for job in self.lock().jobs.values() {
            job.cancel.cancel();
        }
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
