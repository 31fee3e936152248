//! The agent's shared state: claimed jobs (and whether each claim is
//! settled: owned through its claim marker) and the agent's [`Mode`]
//! (pulling, leaving for an ask-delete, agreed, draining, drained). Guarded
//! by one std mutex that is never held across an `.await`; the session loop
//! is the only place that claims jobs, which makes "check idle and stop
//! pulling" atomic with respect to taking jobs.
//!
//! The rules of the mode live in one transition function, [`Mode::step`],
//! and the heartbeat's view of it in [`Mode::agent_state`]; [`Shared`]
//! keeps the mutex, the claims and the notifications.

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
    /// Slots the job takes ([`vq_common::messages::Job::slots`], at most
    /// the agent's slots).
    slots: usize,
    /// Whether the job holds its slots (it started, or is being refused).
    started: bool,
    /// Claim order: a job waiting for slots starts only after every older
    /// waiting one (first come, first served: no starvation).
    seq: u64,
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

/// What the agent does about its pool queue and its deletion: the
/// lifecycle behind the heartbeat's `state`, `is_pull` and `is_del`
/// (DESIGN.md, "The jobagent" step 4 and "drain" under "Leases"). Changed
/// only by [`Mode::step`].
///
/// ```text
///            AskDelete (idle)          Deletable
///  Pulling ────────────────▶ Leaving ───────────▶ Agreed
///   │  ▲                        │                    │
///   │  │ Resume                 │ Drain              │ Drain, Shutdown
///   ▼  │                        ▼                    ▼
///  Draining ───────────── Deletable ──────────▶ Drained
///     │ Shutdown                                     ▲
///     ▼                                              │
///  Stopping ──────────────── Deletable ──────────────┘
/// ```
///
/// (`Shutdown` leads to `Stopping` from `Pulling` and `Leaving` too.) An
/// ask-delete while a job is claimed changes nothing, in every mode. Only
/// [`Mode::Pulling`] takes jobs; the one way back to it is a resume of a
/// drain (control `resume`), refused once the agent agreed to be deleted
/// (`Leaving`, `Agreed`, `Drained`) or while it shuts down (`Stopping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Takes jobs from the pool queue (the start).
    Pulling,
    /// Said yes to an ask-delete while idle: not pulling, the pool consumer
    /// is being cancelled; the answer goes out after [`Event::Deletable`].
    Leaving,
    /// Agreed to be deleted: not pulling, no consumer (`is_del`).
    Agreed,
    /// Told to drain (control `drain`): not pulling, claimed jobs run to
    /// their end; a resume makes it pull again.
    Draining,
    /// Shutting down after the first signal: like [`Mode::Draining`], but
    /// not resumable.
    Stopping,
    /// Drained, or agreed and then told to drain: not pulling, deletable
    /// (`is_del`).
    Drained,
}

/// What happens to the agent's [`Mode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The controller asks "may I delete you?" (control `ask-delete`).
    AskDelete,
    /// A control `drain`.
    Drain,
    /// The first shutdown signal: drain, for good.
    Shutdown,
    /// A control `resume`: undo a drain.
    Resume,
    /// The pool consumer is gone (`basic.cancel-ok` seen, unclaimed
    /// deliveries requeued) and the agent may be deleted: after a yes to
    /// an ask-delete, once a drain found no job left, or when a graceful
    /// shutdown has reported every job.
    Deletable,
}

/// Why a resume is refused ([`Reply::RefuseResume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoResume {
    /// The agent agreed to be deleted (an ask-delete said yes, or a drain
    /// finished): the controller may be deleting its VM.
    Agreed,
    /// The agent is shutting down (first signal).
    ShuttingDown,
}

impl std::fmt::Display for NoResume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NoResume::Agreed => "already agreed to be deleted",
            NoResume::ShuttingDown => "the agent is shutting down",
        })
    }
}

/// What the caller of [`Mode::step`] must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (a repeated or meaningless event).
    Nothing,
    /// Answer the ask-delete with no: jobs are claimed. Nothing changed.
    Refuse,
    /// Stop the pool consumer, then step [`Event::Deletable`], then answer
    /// the ask-delete with yes.
    StopThenAgree,
    /// A drain from a pulling mode: stop the pool consumer and, once no
    /// job is left, step [`Event::Deletable`] and report `drained` (once
    /// per drain: a resume ends the drain, see [`Shared::finish_drain`]).
    StartDrain,
    /// A resumed drain: pull again.
    Resume,
    /// A resume refused (nothing changed).
    RefuseResume(NoResume),
}

impl Mode {
    /// The one transition function: the mode after `event` and what to do,
    /// with `claimed` jobs claimed here at that moment (read under the same
    /// lock as the claims, so that an ask-delete and a claim are ordered).
    pub fn step(self, event: Event, claimed: usize) -> (Mode, Reply) {
        use Mode::*;
        match (self, event) {
            (m, Event::AskDelete) if claimed > 0 => (m, Reply::Refuse),
            (Pulling | Leaving, Event::AskDelete) => (Leaving, Reply::StopThenAgree),
            (m @ (Agreed | Draining | Stopping | Drained), Event::AskDelete) => {
                (m, Reply::StopThenAgree)
            }
            (Pulling | Leaving, Event::Drain) => (Draining, Reply::StartDrain),
            (Pulling | Leaving, Event::Shutdown) => (Stopping, Reply::StartDrain),
            (Agreed, Event::Drain | Event::Shutdown) => (Drained, Reply::StartDrain),
            (Draining, Event::Shutdown) => (Stopping, Reply::Nothing),
            (m @ (Draining | Stopping | Drained), Event::Drain) => (m, Reply::Nothing),
            (m @ (Stopping | Drained), Event::Shutdown) => (m, Reply::Nothing),
            (Pulling, Event::Resume) => (Pulling, Reply::Nothing),
            (Draining, Event::Resume) => (Pulling, Reply::Resume),
            (m @ (Leaving | Agreed | Drained), Event::Resume) => {
                (m, Reply::RefuseResume(NoResume::Agreed))
            }
            (Stopping, Event::Resume) => (Stopping, Reply::RefuseResume(NoResume::ShuttingDown)),
            // Only a mode that stopped pulling can become deletable.
            (Pulling, Event::Deletable) => (Pulling, Reply::Nothing),
            (Leaving | Agreed, Event::Deletable) => (Agreed, Reply::Nothing),
            (Draining | Stopping | Drained, Event::Deletable) => (Drained, Reply::Nothing),
        }
    }

    /// Whether the agent consumes its pool queue in this mode.
    pub fn pulls(self) -> bool {
        self == Mode::Pulling
    }

    /// Whether the agent agreed to be deleted (the heartbeat's `is_del`).
    pub fn is_del(self) -> bool {
        matches!(self, Mode::Agreed | Mode::Drained)
    }

    /// The heartbeat's `state` in this mode with `claimed` jobs claimed.
    pub fn agent_state(self, claimed: usize) -> AgentState {
        match (self, claimed) {
            (Mode::Pulling, 0) => AgentState::Idle,
            (Mode::Pulling, _) => AgentState::Busy,
            (Mode::Leaving, _) | (_, 1..) => AgentState::Draining,
            (Mode::Agreed | Mode::Draining | Mode::Stopping | Mode::Drained, 0) => {
                AgentState::Drained
            }
        }
    }
}

#[derive(Debug)]
struct Inner {
    mode: Mode,
    /// The `--reason` of the drain in force (cleared by a resume).
    drain_reason: Option<String>,
    /// Raised by every resume: a drain's report waits for the drain of its
    /// own generation ([`Shared::finish_drain`]).
    drain_epoch: u64,
    jobs: BTreeMap<String, Claimed>,
    /// When the last claim was released (a job ended, or never ran).
    last_end: Instant,
    /// When the agent started pulling: its first consumer, or the last
    /// resume (the agent's start until then).
    pulling_since: Instant,
    /// Whether a consumer was started since the agent started.
    pulled: bool,
    next_seq: u64,
}

impl Inner {
    /// Slots of every claim (started or waiting).
    fn claimed_slots(&self) -> usize {
        self.jobs.values().map(|j| j.slots).sum()
    }

    /// Slots of the started claims.
    fn started_slots(&self) -> usize {
        self.jobs
            .values()
            .filter(|j| j.started)
            .map(|j| j.slots)
            .sum()
    }
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
    /// The reason of the drain in force, while not pulling because of it.
    pub drain_reason: Option<String>,
    /// Seconds since the later of the last job's end and the agent's
    /// start of pulling (its first consumer, or the last resume); 0 when
    /// a job is claimed.
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
    /// Bumped whenever slots are taken or given back (waiting jobs look
    /// again).
    starts: watch::Sender<u64>,
}

impl Shared {
    /// New state: pulling, no jobs, `slots` slots.
    pub fn new(slots: u32) -> Self {
        Shared {
            inner: Mutex::new(Inner {
                mode: Mode::Pulling,
                drain_reason: None,
                drain_epoch: 0,
                jobs: BTreeMap::new(),
                last_end: Instant::now(),
                pulling_since: Instant::now(),
                pulled: false,
                next_seq: 0,
            }),
            slots: slots as usize,
            pull_changed: Notify::new(),
            heartbeat_now: Notify::new(),
            count: watch::channel(0).0,
            unsettled: watch::channel(0).0,
            starts: watch::channel(0).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the agent should consume its pool queue.
    pub fn wants_pull(&self) -> bool {
        self.lock().mode.pulls()
    }

    /// The agent's mode now.
    pub fn mode(&self) -> Mode {
        self.lock().mode
    }

    /// Steps the mode with `event` ([`Mode::step`]) under the claims' lock.
    fn step(&self, event: Event) -> Reply {
        let mut g = self.lock();
        let (mode, reply) = g.mode.step(event, g.jobs.len());
        g.mode = mode;
        reply
    }

    /// Free job slots: the agent's slots minus those of every claim
    /// (running or waiting for slots), 0 when overbooked by a waiting job.
    pub fn free_slots(&self) -> usize {
        self.slots.saturating_sub(self.lock().claimed_slots())
    }

    /// The agent's slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Claims a pool delivery for job `key`, which takes `slots` slots
    /// (a job larger than the agent counts as the whole agent until it is
    /// refused). A claim is accepted while the agent pulls and fewer jobs
    /// than slots are claimed, even if the job does not fit now: it was
    /// delivered within the consumer's prefetch (= free slots), so it
    /// waits here for its slots ([`Shared::wait_for_slots`]) rather than
    /// going back to the queue (a requeue spends its delivery limit).
    pub fn claim(&self, key: &str, slots: u32) -> Claim {
        let mut g = self.lock();
        if g.jobs.contains_key(key) {
            return Claim::Duplicate;
        }
        if !g.mode.pulls() || g.jobs.len() >= self.slots {
            return Claim::Requeue;
        }
        let claim = uuid::Uuid::new_v4().to_string();
        self.insert(&mut g, key, &claim, slots);
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
        slots: u32,
    ) -> Option<CancellationToken> {
        let mut g = self.lock();
        if g.jobs.contains_key(key) {
            return None;
        }
        self.insert(&mut g, key, claim, slots);
        if let Some(j) = g.jobs.get_mut(key) {
            j.owned = Some(owned);
        }
        let cancel = g.jobs[key].cancel.clone();
        let n = g.jobs.len();
        drop(g);
        self.count.send_replace(n);
        Some(cancel)
    }

    fn insert(&self, g: &mut Inner, key: &str, claim: &str, slots: u32) {
        let seq = g.next_seq;
        g.next_seq += 1;
        g.jobs.insert(
            key.to_string(),
            Claimed {
                cancel: CancellationToken::new(),
                pid: None,
                interrupted: false,
                cancellers: Vec::new(),
                claim: claim.to_string(),
                owned: None,
                slots: (slots as usize).clamp(1, self.slots.max(1)),
                started: false,
                seq,
            },
        );
    }

    /// Takes the slots of job `key` if it may start now: its slots are
    /// free among the started jobs and no older claim waits. Returns
    /// `true` when it holds them (also when it is not claimed: nothing to
    /// wait for).
    pub fn try_start(&self, key: &str) -> bool {
        let mut g = self.lock();
        let Some(job) = g.jobs.get(key) else {
            return true;
        };
        if job.started {
            return true;
        }
        let (need, seq) = (job.slots, job.seq);
        let older_waits = g.jobs.values().any(|j| !j.started && j.seq < seq);
        if older_waits || g.started_slots() + need > self.slots {
            return false;
        }
        if let Some(j) = g.jobs.get_mut(key) {
            j.started = true;
        }
        drop(g);
        self.starts.send_modify(|n| *n += 1);
        true
    }

    /// Waits until job `key` holds its slots ([`Shared::try_start`]): the
    /// agent never runs more slots than it has. Nothing is pulled while a
    /// job waits (its slots count in [`Shared::free_slots`]), so the
    /// running jobs' ends free them.
    pub async fn wait_for_slots(&self, key: &str) {
        let mut rx = self.starts.subscribe();
        loop {
            rx.borrow_and_update();
            if self.try_start(key) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Whether job `key` is claimed and waits for slots (not started).
    pub fn is_waiting(&self, key: &str) -> bool {
        self.lock().jobs.get(key).is_some_and(|j| !j.started)
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

    /// Whether every slot is taken (by running or waiting claims).
    pub fn is_full(&self) -> bool {
        let g = self.lock();
        g.claimed_slots() >= self.slots || g.jobs.len() >= self.slots
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
        self.starts.send_modify(|n| *n += 1);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
    }

    /// Steps [`Event::AskDelete`]: if no job is claimed, stops pulling and
    /// returns `Ok` (the caller stops the consumer, then calls
    /// [`Shared::mark_deleted`], then answers yes); else returns the
    /// claimed ids and changes nothing. Atomic with respect to
    /// [`Shared::claim`].
    pub fn try_stop_for_delete(&self) -> Result<(), Vec<String>> {
        let mut g = self.lock();
        let (mode, reply) = g.mode.step(Event::AskDelete, g.jobs.len());
        g.mode = mode;
        match reply {
            Reply::Refuse => Err(g.jobs.keys().cloned().collect()),
            _ => Ok(()),
        }
    }

    /// Steps [`Event::Deletable`]: the agent agrees to deletion (after the
    /// consumer is gone).
    pub fn mark_deleted(&self) {
        self.step(Event::Deletable);
        self.heartbeat_now.notify_one();
    }

    /// Steps [`Event::Drain`] (control `drain`, with the operator's
    /// `reason`, kept for heartbeats): stops pulling and marks the agent
    /// as draining. Returns the drain's generation for the first drain
    /// since the start or the last resume ([`Reply::StartDrain`]): the one
    /// that reports `drained` ([`Shared::finish_drain`]); `None` if the
    /// agent was draining already (the reason is kept then).
    pub fn start_drain(&self, reason: Option<String>) -> Option<u64> {
        self.drain_with(Event::Drain, reason)
    }

    /// Steps [`Event::Shutdown`]: drains for good (not resumable).
    pub fn start_shutdown(&self) {
        self.drain_with(Event::Shutdown, None);
    }

    fn drain_with(&self, event: Event, reason: Option<String>) -> Option<u64> {
        let mut g = self.lock();
        let (mode, reply) = g.mode.step(event, g.jobs.len());
        g.mode = mode;
        let first = (reply == Reply::StartDrain).then_some(g.drain_epoch);
        if first.is_some() && reason.is_some() {
            g.drain_reason = reason;
        }
        drop(g);
        self.pull_changed.notify_one();
        self.heartbeat_now.notify_one();
        first
    }

    /// Steps [`Event::Resume`]: a draining agent pulls again (the drain's
    /// pending `drained` report is called off and its reason dropped).
    /// Returns the [`Reply`]: [`Reply::Resume`] when resumed,
    /// [`Reply::Nothing`] when it was pulling already,
    /// [`Reply::RefuseResume`] otherwise.
    pub fn resume(&self) -> Reply {
        let mut g = self.lock();
        let (mode, reply) = g.mode.step(Event::Resume, g.jobs.len());
        g.mode = mode;
        if reply == Reply::Resume {
            g.drain_epoch += 1;
            g.drain_reason = None;
            // Idle time counts from the resume: the time out of service
            // was not time without work.
            g.pulling_since = Instant::now();
        }
        drop(g);
        if reply == Reply::Resume {
            self.pull_changed.notify_one();
            self.heartbeat_now.notify_one();
        }
        reply
    }

    /// Ends the drain of generation `epoch` (from [`Shared::start_drain`])
    /// once no job is left: steps [`Event::Deletable`] and returns `true`
    /// (report `drained`), unless a resume came since (`false`: nothing
    /// changes). Under the lock, so a resume and the end of a drain are
    /// ordered.
    pub fn finish_drain(&self, epoch: u64) -> bool {
        let mut g = self.lock();
        if g.drain_epoch != epoch || g.mode.pulls() {
            return false;
        }
        let (mode, _) = g.mode.step(Event::Deletable, g.jobs.len());
        g.mode = mode;
        drop(g);
        self.heartbeat_now.notify_one();
        true
    }

    /// The agent's state and claimed jobs now (for control answers).
    pub fn state_now(&self) -> (AgentState, Vec<String>) {
        let g = self.lock();
        let running: Vec<String> = g.jobs.keys().cloned().collect();
        (g.mode.agent_state(running.len()), running)
    }

    /// Notes that the session started its pool consumer: the first time
    /// since the agent's start, the idle clock starts again (the time
    /// before the agent could take jobs is not idle time).
    pub fn started_pulling(&self) {
        let mut g = self.lock();
        if !g.pulled {
            g.pulled = true;
            g.pulling_since = Instant::now();
        }
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
        self.snapshot_at(Instant::now())
    }

    /// A view for heartbeats, with the idle time measured at `now`.
    fn snapshot_at(&self, now: Instant) -> Snapshot {
        let g = self.lock();
        let running: Vec<String> = g.jobs.keys().cloned().collect();
        let state = g.mode.agent_state(running.len());
        Snapshot {
            idle_secs: if running.is_empty() {
                now.saturating_duration_since(g.last_end.max(g.pulling_since))
                    .as_secs_f64()
            } else {
                0.0
            },
            state,
            running,
            is_pull: g.mode.pulls(),
            is_del: g.mode.is_del(),
            drain_reason: if g.mode.pulls() {
                None
            } else {
                g.drain_reason.clone()
            },
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
        assert!(matches!(s.claim("j1", 1), Claim::New { .. }));
        assert!(matches!(s.claim("j1", 1), Claim::Duplicate));
        assert!(matches!(s.claim("j2", 1), Claim::New { .. }));
        assert!(matches!(s.claim("j3", 1), Claim::Requeue), "no free slot");
    }

    #[test]
    fn every_claim_gets_its_own_claim_id() {
        let s = Shared::new(2);
        let Claim::New { claim: a, .. } = s.claim("j1", 1) else {
            panic!("claimed")
        };
        s.release("j1");
        let Claim::New { claim: b, .. } = s.claim("j1", 1) else {
            panic!("claimed")
        };
        assert_ne!(a, b);
        assert_eq!(s.claim_id("j1"), Some(b));
    }

    #[tokio::test]
    async fn a_session_pulls_only_once_every_claim_is_settled() {
        let s = std::sync::Arc::new(Shared::new(2));
        let _ = s.claim("j1", 1);
        let _ = s.claim("j2", 1);
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
        let c = s.claim_recovered("j1", "c1", owned(), 1);
        assert!(c.is_some());
        assert_eq!(s.owned_claims(), vec![("j1".to_string(), "c1".to_string())]);
        assert!(s.claim_recovered("j1", "c2", owned(), 1).is_none());
    }

    use Event::{AskDelete, Deletable, Drain, Resume, Shutdown};
    use Mode::{Agreed, Drained, Draining, Leaving, Pulling, Stopping};

    /// Every (mode, event, claimed) of the lifecycle: the next mode and
    /// what the caller must do.
    #[test]
    fn every_transition_of_the_mode_is_the_one_of_the_table() {
        const AGREED: Reply = Reply::RefuseResume(NoResume::Agreed);
        const STOPPING: Reply = Reply::RefuseResume(NoResume::ShuttingDown);
        #[rustfmt::skip]
        let table = [
            // from      event      claimed  to        reply
            (Pulling,  AskDelete, 0, Leaving,  Reply::StopThenAgree),
            (Pulling,  AskDelete, 1, Pulling,  Reply::Refuse),
            (Pulling,  Drain,     0, Draining, Reply::StartDrain),
            (Pulling,  Drain,     1, Draining, Reply::StartDrain),
            (Pulling,  Shutdown,  0, Stopping, Reply::StartDrain),
            (Pulling,  Shutdown,  1, Stopping, Reply::StartDrain),
            (Pulling,  Resume,    0, Pulling,  Reply::Nothing),
            (Pulling,  Resume,    1, Pulling,  Reply::Nothing),
            (Pulling,  Deletable, 0, Pulling,  Reply::Nothing),
            (Pulling,  Deletable, 1, Pulling,  Reply::Nothing),
            (Leaving,  AskDelete, 0, Leaving,  Reply::StopThenAgree),
            (Leaving,  AskDelete, 1, Leaving,  Reply::Refuse),
            (Leaving,  Drain,     0, Draining, Reply::StartDrain),
            (Leaving,  Drain,     1, Draining, Reply::StartDrain),
            (Leaving,  Shutdown,  0, Stopping, Reply::StartDrain),
            (Leaving,  Shutdown,  1, Stopping, Reply::StartDrain),
            (Leaving,  Resume,    0, Leaving,  AGREED),
            (Leaving,  Resume,    1, Leaving,  AGREED),
            (Leaving,  Deletable, 0, Agreed,   Reply::Nothing),
            (Leaving,  Deletable, 1, Agreed,   Reply::Nothing),
            (Agreed,   AskDelete, 0, Agreed,   Reply::StopThenAgree),
            (Agreed,   AskDelete, 1, Agreed,   Reply::Refuse),
            (Agreed,   Drain,     0, Drained,  Reply::StartDrain),
            (Agreed,   Drain,     1, Drained,  Reply::StartDrain),
            (Agreed,   Shutdown,  0, Drained,  Reply::StartDrain),
            (Agreed,   Shutdown,  1, Drained,  Reply::StartDrain),
            (Agreed,   Resume,    0, Agreed,   AGREED),
            (Agreed,   Resume,    1, Agreed,   AGREED),
            (Agreed,   Deletable, 0, Agreed,   Reply::Nothing),
            (Agreed,   Deletable, 1, Agreed,   Reply::Nothing),
            (Draining, AskDelete, 0, Draining, Reply::StopThenAgree),
            (Draining, AskDelete, 1, Draining, Reply::Refuse),
            (Draining, Drain,     0, Draining, Reply::Nothing),
            (Draining, Drain,     1, Draining, Reply::Nothing),
            (Draining, Shutdown,  0, Stopping, Reply::Nothing),
            (Draining, Shutdown,  1, Stopping, Reply::Nothing),
            (Draining, Resume,    0, Pulling,  Reply::Resume),
            (Draining, Resume,    1, Pulling,  Reply::Resume),
            (Draining, Deletable, 0, Drained,  Reply::Nothing),
            (Draining, Deletable, 1, Drained,  Reply::Nothing),
            (Stopping, AskDelete, 0, Stopping, Reply::StopThenAgree),
            (Stopping, AskDelete, 1, Stopping, Reply::Refuse),
            (Stopping, Drain,     0, Stopping, Reply::Nothing),
            (Stopping, Drain,     1, Stopping, Reply::Nothing),
            (Stopping, Shutdown,  0, Stopping, Reply::Nothing),
            (Stopping, Shutdown,  1, Stopping, Reply::Nothing),
            (Stopping, Resume,    0, Stopping, STOPPING),
            (Stopping, Resume,    1, Stopping, STOPPING),
            (Stopping, Deletable, 0, Drained,  Reply::Nothing),
            (Stopping, Deletable, 1, Drained,  Reply::Nothing),
            (Drained,  AskDelete, 0, Drained,  Reply::StopThenAgree),
            (Drained,  AskDelete, 1, Drained,  Reply::Refuse),
            (Drained,  Drain,     0, Drained,  Reply::Nothing),
            (Drained,  Drain,     1, Drained,  Reply::Nothing),
            (Drained,  Shutdown,  0, Drained,  Reply::Nothing),
            (Drained,  Shutdown,  1, Drained,  Reply::Nothing),
            (Drained,  Resume,    0, Drained,  AGREED),
            (Drained,  Resume,    1, Drained,  AGREED),
            (Drained,  Deletable, 0, Drained,  Reply::Nothing),
            (Drained,  Deletable, 1, Drained,  Reply::Nothing),
        ];
        for (from, event, claimed, to, reply) in table {
            assert_eq!(
                from.step(event, claimed),
                (to, reply),
                "{from:?} + {event:?} with {claimed} claimed"
            );
        }
    }

    #[test]
    fn a_resumed_drain_pulls_again_and_its_report_is_called_off() {
        let s = Shared::new(1);
        let _ = s.claim("j1", 1);
        let first = s.start_drain(Some("kernel update".into())).expect("first");
        assert_eq!(s.snapshot().drain_reason.as_deref(), Some("kernel update"));
        assert_eq!(s.resume(), Reply::Resume);
        assert!(s.wants_pull());
        assert_eq!(s.snapshot().drain_reason, None, "a pulling agent has none");
        s.release("j1");
        assert!(!s.finish_drain(first), "the resumed drain does not report");
        assert_eq!(s.mode(), Pulling);
        // A new drain is a first drain again, and reports.
        let second = s.start_drain(None).expect("a new drain");
        assert_ne!(first, second);
        assert!(s.finish_drain(second));
        assert_eq!(s.mode(), Drained);
        assert_eq!(s.resume(), Reply::RefuseResume(NoResume::Agreed));
        assert!(!s.wants_pull());
    }

    #[test]
    fn a_shutdown_is_not_resumable() {
        let s = Shared::new(1);
        assert!(s.start_drain(None).is_some());
        s.start_shutdown();
        assert_eq!(s.resume(), Reply::RefuseResume(NoResume::ShuttingDown));
        assert_eq!(s.mode(), Stopping);
    }

    #[test]
    fn the_heartbeat_view_of_every_mode_is_the_one_of_the_table() {
        #[rustfmt::skip]
        let table = [
            // mode     claimed  state                 is_pull is_del
            (Pulling,  0, AgentState::Idle,     true,  false),
            (Pulling,  2, AgentState::Busy,     true,  false),
            (Leaving,  0, AgentState::Draining, false, false),
            (Leaving,  1, AgentState::Draining, false, false),
            (Agreed,   0, AgentState::Drained,  false, true),
            (Agreed,   1, AgentState::Draining, false, true),
            (Draining, 0, AgentState::Drained,  false, false),
            (Draining, 1, AgentState::Draining, false, false),
            (Stopping, 0, AgentState::Drained,  false, false),
            (Stopping, 1, AgentState::Draining, false, false),
            (Drained,  0, AgentState::Drained,  false, true),
            (Drained,  1, AgentState::Draining, false, true),
        ];
        for (mode, claimed, state, is_pull, is_del) in table {
            assert_eq!(mode.agent_state(claimed), state, "{mode:?} with {claimed}");
            assert_eq!(mode.pulls(), is_pull, "{mode:?}");
            assert_eq!(mode.is_del(), is_del, "{mode:?}");
        }
    }

    /// The race of an ask-delete with a delivery, both orders, on the one
    /// lock: whichever comes first decides, and the agent never agrees to go
    /// while it holds a job nor takes one after it agreed.
    #[test]
    fn an_ask_delete_and_a_claim_are_ordered_whichever_comes_first() {
        // A claim, then the ask-delete.
        let s = Shared::new(1);
        assert!(matches!(s.claim("j1", 1), Claim::New { .. }));
        assert_eq!(s.try_stop_for_delete(), Err(vec!["j1".to_string()]));
        assert_eq!(s.mode(), Pulling, "a refused ask-delete changes nothing");

        // The ask-delete, then the claim.
        let s = Shared::new(1);
        assert_eq!(s.try_stop_for_delete(), Ok(()));
        assert!(
            matches!(s.claim("j1", 1), Claim::Requeue),
            "stopped pulling"
        );
        assert!(!s.is_claimed("j1"));
        s.mark_deleted();
        assert_eq!(s.mode(), Agreed);
        assert!(s.snapshot().is_del);
    }

    /// Seconds `s` reports idle at `later` after `at`.
    fn idle_after(s: &Shared, at: Instant, later: f64) -> f64 {
        s.snapshot_at(at + std::time::Duration::from_secs_f64(later))
            .idle_secs
    }

    #[test]
    fn idle_time_runs_from_the_later_of_the_start_of_pulling_and_the_last_job_s_end() {
        let s = Shared::new(1);
        // Gaps between the agent's start, its first consumer and its
        // job's end, so that counting from the wrong instant shows (as more
        // than 10 s at 10 s after the right one).
        std::thread::sleep(std::time::Duration::from_millis(30));
        let before_pull = Instant::now();
        s.started_pulling();
        let idle = idle_after(&s, before_pull, 10.0);
        assert!(
            idle <= 10.0,
            "{idle}: counts from the start of pulling, not from the agent's start"
        );
        let _ = s.claim("j1", 1);
        assert_eq!(idle_after(&s, before_pull, 100.0), 0.0, "busy");
        std::thread::sleep(std::time::Duration::from_millis(30));
        let before_end = Instant::now();
        s.release("j1");
        let idle = idle_after(&s, before_end, 10.0);
        assert!(idle <= 10.0, "{idle}: counts from the job's end");
        // Another consumer (a new session, a slot freed) is no new start.
        std::thread::sleep(std::time::Duration::from_millis(30));
        let at = Instant::now();
        let idle = idle_after(&s, at, 10.0);
        s.started_pulling();
        assert_eq!(idle_after(&s, at, 10.0), idle);
    }

    #[test]
    fn a_resumed_agent_counts_its_idle_time_from_the_resume() {
        let s = Shared::new(1);
        s.started_pulling();
        assert!(s.start_drain(Some("maintenance".into())).is_some());
        std::thread::sleep(std::time::Duration::from_millis(30));
        let before = Instant::now();
        assert_eq!(s.resume(), Reply::Resume);
        let idle = idle_after(&s, before, 10.0);
        assert!(idle <= 10.0, "{idle}: the time drained is not idle time");
    }

    #[test]
    fn drain_then_idle_reports_drained_once() {
        let s = Shared::new(1);
        let _ = s.claim("j1", 1);
        assert!(s.start_drain(None).is_some(), "the first drain reports");
        assert_eq!(s.snapshot().state, AgentState::Draining);
        assert!(
            s.start_drain(None).is_none(),
            "a second drain does not report again"
        );
        s.release("j1");
        s.mark_deleted();
        let snap = s.snapshot();
        assert_eq!(
            (snap.state, snap.is_pull, snap.is_del),
            (AgentState::Drained, false, true)
        );
        assert!(s.start_drain(None).is_none(), "drained: no second report");
    }

    #[test]
    fn a_drain_after_an_agreed_ask_delete_still_reports_drained() {
        let s = Shared::new(1);
        assert_eq!(s.try_stop_for_delete(), Ok(()));
        s.mark_deleted();
        assert!(s.start_drain(None).is_some());
        assert_eq!(s.mode(), Drained);
    }

    #[test]
    fn ask_delete_with_a_claimed_job_changes_nothing_and_says_no() {
        let s = Shared::new(1);
        let _ = s.claim("j1", 1);
        assert_eq!(s.try_stop_for_delete(), Err(vec!["j1".to_string()]));
        assert!(s.wants_pull());
        s.release("j1");
        assert_eq!(s.try_stop_for_delete(), Ok(()));
        assert!(!s.wants_pull());
        assert!(
            matches!(s.claim("j2", 1), Claim::Requeue),
            "stopped pulling"
        );
    }

    #[test]
    fn an_n_slot_job_starts_only_when_its_slots_are_free_and_never_overcommits() {
        let s = Shared::new(2);
        assert!(matches!(s.claim("a", 2), Claim::New { .. }));
        assert!(s.try_start("a"));
        assert_eq!(s.free_slots(), 0);
        // Delivered within the same prefetch window: claimed, waits.
        assert!(matches!(s.claim("b", 2), Claim::New { .. }));
        assert!(!s.try_start("b"), "2 + 2 slots on a 2-slot agent");
        assert!(s.is_waiting("b"));
        assert_eq!(
            s.free_slots(),
            0,
            "a waiting job keeps the agent from pulling"
        );
        s.release("a");
        assert!(s.try_start("b"));
        assert!(!s.is_waiting("b"));
    }

    #[test]
    fn waiting_jobs_start_first_come_first_served() {
        let s = Shared::new(4);
        let _ = s.claim("small1", 1);
        assert!(s.try_start("small1"));
        let _ = s.claim("big", 4);
        let _ = s.claim("small2", 1);
        assert!(!s.try_start("big"));
        assert!(!s.try_start("small2"), "an older waiting job goes first");
        s.release("small1");
        assert!(s.try_start("big"));
        assert!(!s.try_start("small2"));
        s.release("big");
        assert!(s.try_start("small2"));
    }

    #[test]
    fn a_job_larger_than_the_agent_counts_as_the_whole_agent() {
        let s = Shared::new(2);
        let _ = s.claim("huge", 64);
        assert_eq!(s.free_slots(), 0);
        assert!(s.try_start("huge"));
    }

    #[tokio::test]
    async fn a_waiting_job_is_woken_when_slots_are_released() {
        let s = std::sync::Arc::new(Shared::new(2));
        let _ = s.claim("a", 2);
        assert!(s.try_start("a"));
        let _ = s.claim("b", 1);
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.wait_for_slots("b").await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        s.release("a");
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
        assert!(!s.is_waiting("b"));
    }
}
