//! The job table (DESIGN.md, "The job table and the operator's view"): one
//! record per job, folded from the job events of the retained stream
//! `<c>.events.log` and kept in memory. The controller stays stateless: a
//! new broker session rebuilds the table from the stream's first message
//! (the controller's `jobs::feed`). This is the one fold of job events:
//! the controller keeps it current, `vq stat --from-stream` and
//! `vq cancel` build it from a read of the stream.
//!
//! A job is `(job_id, submission)` ([`JobEvent::submission`]): an id
//! submitted again after its job ended is another job; an event without a
//! submission joins the id's latest job. Events are applied in stream
//! order; a `queued` event never moves a job back (it may reach the stream
//! after the job's `started`) but releases a held job (`H`→`Q`), a `held`
//! event makes `H` only a job nothing else was heard of, a later `started` (a rerun after a node
//! loss) reopens it, a repeated event (same `message_id`, from a publish
//! whose confirm was lost) changes nothing. Ended jobs are forgotten
//! [`JobTable::expire`] seconds after their end, as Torque's
//! `keep_completed`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::messages::{JobEvent, JobRequest, JobState, Outcome};

/// A job's state as `qstat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// `Q`: in its pool queue.
    Queued,
    /// `H`: held in `<c>.held` until its dependencies are satisfied
    /// ([`crate::jobs::depend`]).
    Held,
    /// `R`: started, no end seen.
    Running,
    /// `C`: completed (exited, signalled, walltime or output limit).
    Completed,
    /// `F`: failed (refused, failed to start, node lost).
    Failed,
    /// `X`: cancelled.
    Cancelled,
}

impl State {
    /// The one-letter code of `qstat`.
    pub fn letter(self) -> char {
        match self {
            State::Queued => 'Q',
            State::Held => 'H',
            State::Running => 'R',
            State::Completed => 'C',
            State::Failed => 'F',
            State::Cancelled => 'X',
        }
    }

    /// Parses a letter (`Q H R C F X`, either case).
    pub fn from_letter(c: char) -> Option<State> {
        Some(match c.to_ascii_uppercase() {
            'Q' => State::Queued,
            'H' => State::Held,
            'R' => State::Running,
            'C' => State::Completed,
            'F' => State::Failed,
            'X' => State::Cancelled,
            _ => return None,
        })
    }

    /// The word for messages (`queued`, `held`, `running`, `completed`,
    /// `failed`, `cancelled`).
    pub fn word(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Held => "held",
            State::Running => "running",
            State::Completed => "completed",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
        }
    }

    /// Whether the job ended (`C`, `F` or `X`).
    pub fn ended(self) -> bool {
        matches!(self, State::Completed | State::Failed | State::Cancelled)
    }
}

/// One job of the table (the `/jobs` JSON shape and a row of a
/// [`crate::jobs::JobPage`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobRecord {
    /// Job id.
    pub id: String,
    /// Submission fingerprint (`None` when no event named it).
    pub submission: Option<String>,
    /// Job name.
    pub name: String,
    /// Owner (the user it runs as).
    pub owner: String,
    /// Pool.
    pub pool: String,
    /// Broker user that submitted it (validated by the broker).
    pub submitter: Option<String>,
    /// Current state.
    pub state: State,
    /// `state` as a letter.
    pub letter: char,
    /// Agent of the latest start (empty before).
    pub agent: String,
    /// Which execution the latest start was (1 + losses).
    pub attempt: u32,
    /// PBS exit status once ended ([`Outcome::exit_status`]).
    pub exit_status: Option<i32>,
    /// Why it failed or ended without running.
    pub reason: Option<String>,
    /// What it asked for (from its `queued` event).
    pub request: Option<JobRequest>,
    /// Submission, start and end times, Unix seconds (senders' clocks).
    pub queued_at: Option<f64>,
    /// See [`JobRecord::queued_at`].
    pub started_at: Option<f64>,
    /// See [`JobRecord::queued_at`].
    pub ended_at: Option<f64>,
    /// Wall, user CPU and system CPU seconds, and max RSS bytes, once ended.
    pub usage: Option<crate::messages::Usage>,
}

/// A shared, interned string: the names that repeat across jobs (owners,
/// pools, agents, submitters, job names, reasons, work directories, submit
/// hosts) are held once ([`Interner`]).
type Name = Arc<str>;

/// The set of names the table holds; a name no record uses any more is
/// dropped by [`JobTable::expire`].
#[derive(Debug, Default)]
struct Interner {
    set: HashSet<Name>,
}

impl Interner {
    fn name(&mut self, s: &str) -> Name {
        if let Some(n) = self.set.get(s) {
            return n.clone();
        }
        let n: Name = Arc::from(s);
        self.set.insert(n.clone());
        n
    }

    fn opt(&mut self, s: Option<&str>) -> Option<Name> {
        s.map(|s| self.name(s))
    }

    /// Forgets the names only the interner holds.
    fn sweep(&mut self) {
        self.set.retain(|n| Arc::strong_count(n) > 1);
    }
}

/// A [`JobRequest`] as the table stores it (names interned, the per-job
/// output paths boxed).
#[derive(Debug)]
struct Req {
    group: Option<Name>,
    shell: Option<Name>,
    workdir: Option<Name>,
    stdout: Option<Box<str>>,
    stderr: Option<Box<str>>,
    join: crate::messages::Join,
    walltime: Option<u64>,
    slots: u32,
    mem: Option<u64>,
    rerunnable: bool,
    submit_host: Name,
    submitted_at: u64,
    depend: Vec<crate::messages::Dependency>,
}

impl Req {
    fn of(q: &JobRequest, names: &mut Interner) -> Req {
        Req {
            group: names.opt(q.group.as_deref()),
            shell: names.opt(q.shell.as_deref()),
            workdir: names.opt(q.workdir.as_deref()),
            stdout: q.stdout.as_deref().map(Box::from),
            stderr: q.stderr.as_deref().map(Box::from),
            join: q.join,
            walltime: q.walltime,
            slots: q.slots,
            mem: q.mem,
            rerunnable: q.rerunnable,
            submit_host: names.name(&q.submit_host),
            submitted_at: q.submitted_at,
            depend: q.depend.clone(),
        }
    }

    fn to_request(&self) -> JobRequest {
        let s = |n: &Option<Name>| n.as_deref().map(str::to_string);
        JobRequest {
            group: s(&self.group),
            shell: s(&self.shell),
            workdir: s(&self.workdir),
            stdout: self.stdout.as_deref().map(str::to_string),
            stderr: self.stderr.as_deref().map(str::to_string),
            join: self.join,
            walltime: self.walltime,
            slots: self.slots,
            mem: self.mem,
            rerunnable: self.rerunnable,
            submit_host: self.submit_host.to_string(),
            submitted_at: self.submitted_at,
            depend: self.depend.clone(),
        }
    }
}

/// A time the table may not know: NaN for none (8 bytes, not 16).
#[derive(Debug, Clone, Copy)]
struct When(f64);

impl When {
    const NONE: When = When(f64::NAN);
    fn get(self) -> Option<f64> {
        (!self.0.is_nan()).then_some(self.0)
    }
    fn set(&mut self, t: Option<f64>) {
        self.0 = t.unwrap_or(f64::NAN);
    }
}

/// One job as the table stores it (a [`JobRecord`] is made from it on
/// demand, [`Rec::to_record`]): interned names, times without an `Option`
/// tag, the request boxed. Its `message_id`s applied (as 64-bit FNV-1a
/// hashes: only compared among one job's few events) are kept beside it.
#[derive(Debug)]
struct Rec {
    id: Name,
    submission: Option<Box<str>>,
    name: Name,
    owner: Name,
    pool: Name,
    submitter: Option<Name>,
    agent: Option<Name>,
    state: State,
    attempt: u32,
    exit_status: Option<i32>,
    reason: Option<Name>,
    request: Option<Box<Req>>,
    queued_at: When,
    started_at: When,
    ended_at: When,
    usage: Option<crate::messages::Usage>,
    seen: Vec<u64>,
}

impl Rec {
    fn to_record(&self) -> JobRecord {
        JobRecord {
            id: self.id.to_string(),
            submission: self.submission.as_deref().map(str::to_string),
            name: self.name.to_string(),
            owner: self.owner.to_string(),
            pool: self.pool.to_string(),
            submitter: self.submitter.as_deref().map(str::to_string),
            state: self.state,
            letter: self.state.letter(),
            agent: self.agent.as_deref().unwrap_or("").to_string(),
            attempt: self.attempt,
            exit_status: self.exit_status,
            reason: self.reason.as_deref().map(str::to_string),
            request: self.request.as_ref().map(|q| q.to_request()),
            queued_at: self.queued_at.get(),
            started_at: self.started_at.get(),
            ended_at: self.ended_at.get(),
            usage: self.usage,
        }
    }

    fn is_owned_by(&self, user: &str) -> bool {
        &*self.owner == user || self.submitter.as_deref() == Some(user)
    }
}

/// What [`JobTable::each`] shows of a job: enough to count demand without
/// making a [`JobRecord`].
#[derive(Debug, Clone, Copy)]
pub struct JobBrief<'a> {
    /// The job's pool.
    pub pool: &'a str,
    /// Its state.
    pub state: State,
    /// Slots it asks for (`request.slots`, 1 when unknown).
    pub slots: u32,
}

/// The jobs of one id: their sequence numbers (usually one: an id is
/// rarely submitted again), and the job of the id's latest event (for
/// events that name no submission; `None`: the submission-less job).
#[derive(Debug, Default)]
struct IdEntry {
    first: u64,
    more: Vec<u64>,
    latest: Option<u64>,
}

impl IdEntry {
    fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        std::iter::once(self.first).chain(self.more.iter().copied())
    }
}

fn hash_id(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The table: records by `(job_id, submission)`, in order of first event.
///
/// Records live in one ordered map by sequence number (order of first
/// event); ids are indexed in an ordered map (exact and prefix look-ups),
/// and every owner and submitter name in a map of sequence sets, so that one
/// user's query among a million jobs reads only that user's records.
#[derive(Debug, Default)]
pub struct JobTable {
    recs: BTreeMap<u64, Rec>,
    ids: BTreeMap<Name, IdEntry>,
    by_user: HashMap<Name, BTreeSet<u64>>,
    names: Interner,
    next_seq: u64,
    /// Events applied since the table was (re)built.
    pub events_applied: u64,
}

impl JobTable {
    /// An empty table.
    pub fn new() -> JobTable {
        JobTable::default()
    }

    /// Number of jobs.
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// Whether the table holds no job.
    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    fn index_user(&mut self, user: &Name, seq: u64) {
        if user.is_empty() {
            return;
        }
        match self.by_user.get_mut(&**user) {
            Some(set) => {
                set.insert(seq);
            }
            None => {
                self.by_user.insert(user.clone(), BTreeSet::from([seq]));
            }
        }
    }

    fn unindex_user(&mut self, user: &str, seq: u64) {
        let user: &str = user;
        if let Some(set) = self.by_user.get_mut(user) {
            set.remove(&seq);
            if set.is_empty() {
                self.by_user.remove(user);
            }
        }
    }

    /// Applies one event (decoded as delivered,
    /// [`JobEvent::decode_delivered`]) with its AMQP `message_id`.
    /// Duplicate-message reports ([`JobEvent::duplicate`]) say nothing
    /// about the job and are skipped.
    pub fn apply(&mut self, ev: &JobEvent, message_id: Option<&str>) {
        if ev.duplicate.is_some() {
            return;
        }
        let recs = &self.recs;
        let found = self.ids.get(ev.job_id.as_str()).map(|e| {
            let latest_sub = e
                .latest
                .and_then(|q| recs.get(&q))
                .and_then(|r| r.submission.clone());
            let submission = match &ev.submission {
                Some(s) => Some(Box::from(s.as_str())),
                None => latest_sub,
            };
            let seq = e
                .seqs()
                .find(|q| recs.get(q).is_some_and(|r| r.submission == submission));
            (submission, seq)
        });
        let (submission, seq, fresh) = match found {
            Some((sub, Some(q))) => (sub, q, false),
            Some((sub, None)) => {
                let q = self.next_seq;
                self.next_seq += 1;
                let e = self.ids.get_mut(ev.job_id.as_str()).expect("found above");
                e.more.push(q);
                (sub, q, true)
            }
            None => {
                let q = self.next_seq;
                self.next_seq += 1;
                self.ids.insert(
                    Name::from(ev.job_id.as_str()),
                    IdEntry {
                        first: q,
                        more: Vec::new(),
                        latest: None,
                    },
                );
                (ev.submission.as_deref().map(Box::from), q, true)
            }
        };
        let id = match self.ids.get_key_value(ev.job_id.as_str()) {
            Some((k, _)) => k.clone(),
            None => Name::from(ev.job_id.as_str()),
        };
        if let Some(e) = self.ids.get_mut(ev.job_id.as_str()) {
            e.latest = Some(seq);
        }
        if fresh {
            let owner = self.names.name(&ev.owner);
            let rec = Rec {
                id,
                submission,
                name: self.names.name(&ev.job_name),
                owner: owner.clone(),
                pool: self.names.name(&ev.pool),
                submitter: None,
                state: State::Queued,
                agent: None,
                attempt: 0,
                exit_status: None,
                reason: None,
                request: None,
                queued_at: When::NONE,
                started_at: When::NONE,
                ended_at: When::NONE,
                usage: None,
                seen: Vec::new(),
            };
            self.recs.insert(seq, rec);
            self.index_user(&owner, seq);
        }
        let r = self.recs.get_mut(&seq).expect("indexed jobs have a record");
        if let Some(id) = message_id {
            let h = hash_id(id);
            if r.seen.contains(&h) {
                return;
            }
            r.seen.push(h);
        }
        self.events_applied += 1;
        let names = &mut self.names;
        if !ev.job_name.is_empty() && *r.name != *ev.job_name {
            r.name = names.name(&ev.job_name);
        }
        let mut old_owner = None;
        if !ev.owner.is_empty() && *r.owner != *ev.owner {
            old_owner = Some(std::mem::replace(&mut r.owner, names.name(&ev.owner)));
        }
        let mut new_submitter = None;
        if r.submitter.is_none() {
            if let Some(s) = ev.submitter.as_deref() {
                let s = names.name(s);
                r.submitter = Some(s.clone());
                new_submitter = Some(s);
            }
        }
        Self::fold(r, ev, names);
        let (owner, submitter) = (r.owner.clone(), r.submitter.clone());
        if let Some(old) = old_owner {
            if submitter.as_deref() != Some(&*old) {
                self.unindex_user(&old, seq);
            }
            self.index_user(&owner, seq);
        }
        if let Some(s) = new_submitter {
            self.index_user(&s, seq);
        }
    }

    fn fold(r: &mut Rec, ev: &JobEvent, names: &mut Interner) {
        match &ev.state {
            JobState::Queued { request } => {
                r.request = Some(Box::new(Req::of(request, names)));
                r.queued_at.set(Some(ev.at));
                // The controller's release of a held job; never R→Q.
                if r.state == State::Held {
                    r.state = State::Queued;
                }
            }
            JobState::Held { request } => {
                // Only a job nothing else was heard of: a fresh record
                // (`Q` without a request). A held event that reaches the
                // stream after the release (`queued`) or the start never
                // moves the job back.
                if r.state == State::Queued && r.request.is_none() {
                    r.state = State::Held;
                }
                if r.request.is_none() || r.state == State::Held {
                    r.request = Some(Box::new(Req::of(request, names)));
                    r.queued_at.set(Some(ev.at));
                }
            }
            JobState::Started => {
                // A start older than the latest one (reordered copies) does
                // not reopen an ended job.
                if ev.attempt >= r.attempt {
                    r.state = State::Running;
                    r.attempt = ev.attempt;
                    r.agent = names.opt(Some(ev.agent.as_str()).filter(|a| !a.is_empty()));
                    r.started_at.set(Some(ev.at));
                    r.ended_at = When::NONE;
                    r.exit_status = None;
                    r.reason = None;
                    r.usage = None;
                }
            }
            JobState::Finished { outcome, usage } => {
                r.state = match outcome {
                    Outcome::Cancelled => State::Cancelled,
                    Outcome::FailedToStart { reason } => {
                        r.reason = Some(names.name(reason));
                        State::Failed
                    }
                    _ => State::Completed,
                };
                if !ev.agent.is_empty() {
                    r.agent = Some(names.name(&ev.agent));
                }
                r.exit_status = Some(outcome.exit_status());
                r.ended_at.set(Some(ev.at));
                r.usage = Some(*usage);
            }
            JobState::Failed { reason } => {
                r.state = State::Failed;
                r.reason = Some(names.name(reason));
                r.ended_at.set(Some(ev.at));
            }
            // Only a job no agent started: a start that won the race
            // against the withdrawal keeps the job running (its cancel then
            // goes to the agent).
            JobState::Withdrawn { by, reason }
                if matches!(r.state, State::Queued | State::Held) =>
            {
                let why = match reason {
                    Some(reason) => reason.clone(),
                    None => format!("cancelled by {by} while {}", r.state.word()),
                };
                r.state = State::Cancelled;
                r.reason = Some(names.name(&why));
                r.ended_at.set(Some(ev.at));
            }
            JobState::Withdrawn { .. } => {}
        }
    }

    /// Forgets jobs that ended more than `keep_secs` before `now` (Unix
    /// seconds; Torque's `keep_completed`), and the names no job uses any
    /// more. Returns how many jobs were dropped.
    pub fn expire(&mut self, now: f64, keep_secs: f64) -> usize {
        let old: Vec<u64> = self
            .recs
            .iter()
            .filter(|(_, r)| {
                r.state.ended() && r.ended_at.get().is_some_and(|e| now - e > keep_secs)
            })
            .map(|(q, _)| *q)
            .collect();
        for seq in &old {
            let Some(rec) = self.recs.remove(seq) else {
                continue;
            };
            self.unindex_user(&rec.owner, *seq);
            if let Some(s) = &rec.submitter {
                self.unindex_user(s, *seq);
            }
            if let Some(e) = self.ids.get_mut(&*rec.id) {
                if e.latest == Some(*seq) {
                    e.latest = None;
                }
                let rest: Vec<u64> = e.seqs().filter(|q| q != seq).collect();
                match rest.split_first() {
                    Some((first, more)) => {
                        e.first = *first;
                        e.more = more.to_vec();
                    }
                    None => {
                        self.ids.remove(&*rec.id);
                    }
                }
            }
        }
        if !old.is_empty() {
            self.names.sweep();
        }
        old.len()
    }

    fn get_rec(&self, id: &str) -> Option<&Rec> {
        let e = self.ids.get(id)?;
        // After the latest job expired, the submission-less one (if any).
        let seq = e.latest.or_else(|| {
            e.seqs()
                .find(|q| self.recs.get(q).is_some_and(|r| r.submission.is_none()))
        })?;
        self.recs.get(&seq)
    }

    /// The latest job named `id`.
    pub fn get(&self, id: &str) -> Option<JobRecord> {
        self.get_rec(id).map(Rec::to_record)
    }

    /// The job `wanted` names: the exact id, else the one id that starts
    /// with `wanted` (so the short `<uuid-prefix>` works); an id submitted
    /// again names its latest job.
    ///
    /// # Errors
    /// [`FindError::Unknown`] or [`FindError::Ambiguous`] (with the
    /// matching ids, sorted).
    pub fn find(&self, wanted: &str) -> Result<JobRecord, FindError> {
        if let Some(r) = self.get_rec(wanted) {
            return Ok(r.to_record());
        }
        if wanted.is_empty() {
            return Err(FindError::Unknown);
        }
        let ids: Vec<&str> = self
            .ids
            .range::<str, _>((
                std::ops::Bound::Included(wanted),
                std::ops::Bound::Unbounded,
            ))
            .map(|(id, _)| &**id)
            .take_while(|id| id.starts_with(wanted))
            .take(20)
            .collect();
        match ids.as_slice() {
            [one] => self.get(one).ok_or(FindError::Unknown),
            [] => Err(FindError::Unknown),
            many => Err(FindError::Ambiguous(
                many.iter().map(|s| s.to_string()).collect(),
            )),
        }
    }

    /// The latest job of `id` whose record `keep` accepts (latest first:
    /// sequence numbers grow with each submission).
    fn latest_where(&self, id: &str, keep: &dyn Fn(&Rec) -> bool) -> Option<&Rec> {
        let e = self.ids.get(id)?;
        e.seqs()
            .filter_map(|q| self.recs.get(&q).map(|r| (q, r)))
            .filter(|(_, r)| keep(r))
            .max_by_key(|(q, _)| *q)
            .map(|(_, r)| r)
    }

    /// The job of `id` whose submission fingerprint is `submission`, if the
    /// table holds it (whichever submission of the id is the latest).
    pub fn get_submission(&self, id: &str, submission: &str) -> Option<JobRecord> {
        self.latest_where(id, &|r: &Rec| r.submission.as_deref() == Some(submission))
            .map(Rec::to_record)
    }

    /// [`JobTable::find`] among the jobs broker user `submitter` submitted
    /// (the broker-validated submitter of their `queued` or `held` event):
    /// the exact id, else the one id with such a job that starts with
    /// `wanted`. Another submitter's job of the same id is not seen, so a
    /// message that reuses an id (any submitter may publish any id) cannot
    /// stand in for this submitter's job, nor make its prefix ambiguous: a
    /// held job's dependencies are looked up this way
    /// ([`crate::jobs::depend::decide`]).
    ///
    /// # Errors
    /// [`FindError::Unknown`] or [`FindError::Ambiguous`].
    pub fn find_by(&self, wanted: &str, submitter: &str) -> Result<JobRecord, FindError> {
        let keep = |r: &Rec| r.submitter.as_deref() == Some(submitter);
        self.find_where(wanted, &keep)
    }

    /// [`JobTable::find`] that prefers the jobs `user` owns or submitted:
    /// the exact id or a unique prefix among those first, then the exact id
    /// among all jobs (whose record the caller then judges: not yours,
    /// visible by `query_other_jobs`). A prefix is matched against other
    /// users' ids only when `others` (the caller may see every job), so
    /// that a refusal never tells a user the full id of a job they may not
    /// see, and another user's reuse of an id never hides a user's own job.
    ///
    /// # Errors
    /// [`FindError::Unknown`] or [`FindError::Ambiguous`].
    pub fn find_for(&self, wanted: &str, user: &str, others: bool) -> Result<JobRecord, FindError> {
        let mine = |r: &Rec| &*r.owner == user || r.submitter.as_deref() == Some(user);
        match self.find_where(wanted, &mine) {
            Err(FindError::Unknown) => {}
            found => return found,
        }
        if others {
            return self.find(wanted);
        }
        self.get(wanted).ok_or(FindError::Unknown)
    }

    fn find_where(
        &self,
        wanted: &str,
        keep: &dyn Fn(&Rec) -> bool,
    ) -> Result<JobRecord, FindError> {
        if let Some(r) = self.latest_where(wanted, keep) {
            return Ok(r.to_record());
        }
        if wanted.is_empty() {
            return Err(FindError::Unknown);
        }
        let mut ids = self
            .ids
            .range::<str, _>((
                std::ops::Bound::Included(wanted),
                std::ops::Bound::Unbounded,
            ))
            .map(|(id, _)| &**id)
            .take_while(|id| id.starts_with(wanted))
            .filter(|id| self.latest_where(id, keep).is_some());
        let first = ids.next();
        let more: Vec<&str> = ids.take(19).collect();
        match (first, more.is_empty()) {
            (Some(one), true) => self
                .latest_where(one, keep)
                .map(Rec::to_record)
                .ok_or(FindError::Unknown),
            (None, _) => Err(FindError::Unknown),
            (Some(one), false) => Err(FindError::Ambiguous(
                std::iter::once(one)
                    .chain(more)
                    .map(str::to_string)
                    .collect(),
            )),
        }
    }

    fn candidates(
        &self,
        user: Option<&String>,
        start: u64,
    ) -> Box<dyn Iterator<Item = (u64, &Rec)> + '_> {
        match user {
            Some(u) => match self.by_user.get(u.as_str()) {
                Some(set) => Box::new(
                    set.range(start..)
                        .filter_map(|q| self.recs.get(q).map(|r| (*q, r))),
                ),
                None => Box::new(std::iter::empty()),
            },
            None => Box::new(self.recs.range(start..).map(|(q, r)| (*q, r))),
        }
    }

    /// Jobs matching `filter`, in order of first event, at most `limit`,
    /// starting after position `after` (a cursor from an earlier page);
    /// returns them and the cursor of the next page, if any. A filter on
    /// an owner or a requester reads only that user's jobs.
    pub fn query(
        &self,
        filter: &Filter,
        after: Option<u64>,
        limit: usize,
    ) -> (Vec<JobRecord>, Option<u64>) {
        let start = after.map_or(0, |a| a + 1);
        let user = filter.owner.as_ref().or(filter.visible_to.as_ref());
        let mut out = Vec::new();
        let mut last = None;
        for (seq, r) in self.candidates(user, start) {
            if !filter.matches_rec(r) {
                continue;
            }
            if out.len() == limit {
                return (out, last);
            }
            out.push(r.to_record());
            last = Some(seq);
        }
        (out, None)
    }

    /// Calls `f` with a [`JobBrief`] of every job in one of `states` (all
    /// when empty), in order of first event, without making records (the
    /// controller's slot demand, every cycle).
    pub fn each(&self, states: &[State], mut f: impl FnMut(JobBrief<'_>)) {
        for r in self.recs.values() {
            if states.is_empty() || states.contains(&r.state) {
                f(JobBrief {
                    pool: &r.pool,
                    state: r.state,
                    slots: r.request.as_ref().map_or(1, |q| q.slots.max(1)),
                });
            }
        }
    }
}

/// Why [`JobTable::find`] found no job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FindError {
    /// No job has that id or an id starting with it.
    Unknown,
    /// Several ids start with it (listed, sorted).
    Ambiguous(Vec<String>),
}

/// Which jobs `/jobs` and a [`crate::jobs::JobQuery`] list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only jobs of this owner.
    pub owner: Option<String>,
    /// Only jobs in one of these states (empty: all).
    pub states: Vec<State>,
    /// Only jobs of this pool.
    pub pool: Option<String>,
    /// Only jobs this broker user may see without being an operator: those
    /// it submitted (the event's broker-validated `user_id`) or whose
    /// owner has its name ([`Visibility`](crate::jobs::Visibility)).
    pub visible_to: Option<String>,
}

impl Filter {
    /// Whether `r` passes.
    pub fn matches(&self, r: &JobRecord) -> bool {
        self.owner.as_ref().is_none_or(|o| &r.owner == o)
            && (self.states.is_empty() || self.states.contains(&r.state))
            && self.pool.as_ref().is_none_or(|p| &r.pool == p)
            && self.visible_to.as_ref().is_none_or(|u| own(r, u))
    }

    fn matches_rec(&self, r: &Rec) -> bool {
        self.owner.as_deref().is_none_or(|o| &*r.owner == o)
            && (self.states.is_empty() || self.states.contains(&r.state))
            && self.pool.as_deref().is_none_or(|p| &*r.pool == p)
            && self.visible_to.as_deref().is_none_or(|u| r.is_owned_by(u))
    }
}

/// Whether `r` is `user`'s job: `user` submitted it (broker user) or owns
/// it (Unix user of the same name).
pub fn own(r: &JobRecord, user: &str) -> bool {
    r.owner == user || r.submitter.as_deref() == Some(user)
}

#[cfg(test)]
mod tests {
    use crate::messages::{JobEvent, JobState, Outcome, Usage};

    use super::*;

    fn ev(id: &str, sub: Option<&str>, at: f64, state: JobState) -> JobEvent {
        let mut e = JobEvent::about(None, id, "p", "ag1", Some("alice"), state);
        e.owner = "alice".into();
        e.submission = sub.map(str::to_string);
        e.at = at;
        e
    }

    fn queued(id: &str, sub: &str, at: f64) -> JobEvent {
        ev(
            id,
            Some(sub),
            at,
            JobState::Queued {
                request: JobRequest {
                    walltime: Some(60),
                    ..Default::default()
                },
            },
        )
    }

    fn done(code: i32) -> JobState {
        JobState::Finished {
            outcome: Outcome::Exited { code },
            usage: Usage {
                wall_secs: 2.0,
                ..Default::default()
            },
        }
    }

    fn apply(t: &mut JobTable, e: &JobEvent) {
        t.apply(e, Some(&e.message_id()));
    }

    #[test]
    fn a_job_goes_from_queued_to_its_end_and_a_late_queued_never_moves_it_back() {
        let mut t = JobTable::new();
        apply(&mut t, &queued("a", "s1", 1.0));
        assert_eq!(t.get("a").unwrap().state, State::Queued);
        assert_eq!(
            t.get("a").unwrap().request.as_ref().unwrap().walltime,
            Some(60)
        );
        apply(&mut t, &ev("a", Some("s1"), 2.0, JobState::Started));
        let r = t.get("a").unwrap();
        assert_eq!(
            (r.state, r.letter, r.agent.as_str()),
            (State::Running, 'R', "ag1")
        );
        apply(&mut t, &ev("a", Some("s1"), 4.0, done(3)));
        let r = t.get("a").unwrap();
        assert_eq!(
            (r.state, r.exit_status, r.ended_at),
            (State::Completed, Some(3), Some(4.0))
        );
        assert_eq!(r.queued_at, Some(1.0));

        // Started and finished before the queued event reached the stream.
        let mut t = JobTable::new();
        apply(&mut t, &ev("b", Some("s"), 2.0, JobState::Started));
        apply(&mut t, &ev("b", Some("s"), 3.0, done(0)));
        apply(&mut t, &queued("b", "s", 1.0));
        let r = t.get("b").unwrap();
        assert_eq!(r.state, State::Completed);
        assert!(r.request.is_some());
        assert_eq!(t.len(), 1);
    }

    fn held(id: &str, sub: &str, at: f64) -> JobEvent {
        let mut e = queued(id, sub, at);
        let JobState::Queued { request } = e.state else {
            unreachable!()
        };
        e.state = JobState::Held { request };
        e
    }

    #[test]
    fn a_held_job_is_released_to_queued_then_runs_and_a_late_held_never_moves_it_back() {
        let mut t = JobTable::new();
        apply(&mut t, &held("a", "s", 1.0));
        let r = t.get("a").unwrap();
        assert_eq!(
            (r.state, r.letter, r.queued_at),
            (State::Held, 'H', Some(1.0))
        );
        assert!(r.request.is_some());
        // The controller's release.
        apply(&mut t, &queued("a", "s", 1.0));
        assert_eq!(t.get("a").unwrap().state, State::Queued);
        apply(&mut t, &ev("a", Some("s"), 2.0, JobState::Started));
        assert_eq!(t.get("a").unwrap().state, State::Running);
        // Neither a late release nor a late held event moves it back.
        let mut late = queued("a", "s", 1.0);
        late.at = 1.5;
        t.apply(&late, Some("other-id"));
        apply(&mut t, &held("a", "s", 1.0));
        assert_eq!(t.get("a").unwrap().state, State::Running);
        apply(&mut t, &ev("a", Some("s"), 3.0, done(0)));
        assert_eq!(t.get("a").unwrap().state, State::Completed);

        // A held event after the release (reordered) leaves it queued.
        let mut t = JobTable::new();
        apply(&mut t, &queued("b", "s", 1.0));
        apply(&mut t, &held("b", "s", 1.0));
        assert_eq!(t.get("b").unwrap().state, State::Queued);
        assert_eq!(State::from_letter('h'), Some(State::Held));
    }

    #[test]
    fn a_held_job_is_cancelled_by_a_user_or_for_its_dependency() {
        let mut t = JobTable::new();
        apply(&mut t, &held("a", "s", 1.0));
        apply(
            &mut t,
            &ev(
                "a",
                Some("s"),
                2.0,
                JobState::Withdrawn {
                    by: "alice".into(),
                    reason: None,
                },
            ),
        );
        let r = t.get("a").unwrap();
        assert_eq!(
            (r.letter, r.reason.as_deref(), r.ended_at, r.exit_status),
            ('X', Some("cancelled by alice while held"), Some(2.0), None)
        );
        apply(&mut t, &held("b", "s", 1.0));
        let why = "dependency afterok:a can never be satisfied: a was cancelled";
        apply(
            &mut t,
            &ev(
                "b",
                Some("s"),
                2.0,
                JobState::Withdrawn {
                    by: "vq-controller".into(),
                    reason: Some(why.into()),
                },
            ),
        );
        let r = t.get("b").unwrap();
        assert_eq!((r.letter, r.reason.as_deref()), ('X', Some(why)));
        // A late release does not revive it.
        apply(&mut t, &queued("b", "s", 1.0));
        assert_eq!(t.get("b").unwrap().state, State::Cancelled);
    }

    #[test]
    fn a_retransmitted_event_changes_nothing_and_a_rerun_reopens_the_job() {
        let mut t = JobTable::new();
        let start = ev("a", Some("s"), 2.0, JobState::Started);
        apply(&mut t, &start);
        let fail = ev(
            "a",
            Some("s"),
            3.0,
            JobState::Failed {
                reason: "node lost".into(),
            },
        );
        apply(&mut t, &fail);
        // The first start again (its confirm was lost): still failed.
        apply(&mut t, &start);
        assert_eq!(t.get("a").unwrap().state, State::Failed);
        assert_eq!(t.events_applied, 2);
        // A rerun (attempt 2) on another agent reopens it.
        let mut rerun = ev("a", Some("s"), 5.0, JobState::Started);
        rerun.attempt = 2;
        rerun.agent = "ag2".into();
        apply(&mut t, &rerun);
        let r = t.get("a").unwrap();
        assert_eq!(
            (r.state, r.attempt, r.agent.as_str()),
            (State::Running, 2, "ag2")
        );
        assert_eq!(r.reason, None);
    }

    #[test]
    fn an_id_submitted_again_is_a_new_job_and_duplicate_reports_are_not_about_the_job() {
        let mut t = JobTable::new();
        apply(&mut t, &queued("a", "s1", 1.0));
        apply(&mut t, &ev("a", Some("s1"), 2.0, done(0)));
        apply(&mut t, &queued("a", "s2", 3.0));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("a").unwrap().submission.as_deref(), Some("s2"));
        assert_eq!(t.get("a").unwrap().state, State::Queued);
        // An event naming no submission joins the latest one.
        apply(&mut t, &ev("a", None, 4.0, JobState::Started));
        assert_eq!(t.get("a").unwrap().state, State::Running);
        assert_eq!(t.len(), 2);
        let mut dup = ev(
            "a",
            Some("s2"),
            5.0,
            JobState::Failed {
                reason: "duplicate".into(),
            },
        );
        dup.duplicate = Some("ffff".into());
        apply(&mut t, &dup);
        assert_eq!(t.get("a").unwrap().state, State::Running);
        // Cancelled shows X with Torque's 271.
        apply(
            &mut t,
            &ev(
                "a",
                Some("s2"),
                6.0,
                JobState::Finished {
                    outcome: Outcome::Cancelled,
                    usage: Usage::default(),
                },
            ),
        );
        let r = t.get("a").unwrap();
        assert_eq!((r.letter, r.exit_status), ('X', Some(271)));
    }

    #[test]
    fn ended_jobs_are_forgotten_after_keep_completed_and_others_never() {
        let mut t = JobTable::new();
        apply(&mut t, &queued("q", "s", 1.0));
        apply(&mut t, &ev("r", Some("s"), 1.0, JobState::Started));
        apply(&mut t, &ev("c", Some("s"), 1.0, JobState::Started));
        apply(&mut t, &ev("c", Some("s"), 10.0, done(0)));
        assert_eq!(t.expire(100.0, 100.0), 0);
        assert_eq!(t.expire(111.0, 100.0), 1);
        assert!(t.get("c").is_none());
        assert_eq!(t.len(), 2);
        let (all, _) = t.query(&Filter::default(), None, 10);
        let ids: Vec<_> = all.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["q", "r"]);
    }

    #[test]
    fn names_are_held_once_and_forgotten_with_the_last_job_that_used_them() {
        let mut t = JobTable::new();
        for (id, name) in [("a", "same"), ("b", "same"), ("c", "only-c")] {
            let mut e = queued(id, "s", 1.0);
            e.job_name = name.into();
            apply(&mut t, &e);
        }
        let same = |t: &JobTable| t.names.set.get("same").map(Arc::strong_count);
        // The interner's copy and one per job.
        assert_eq!(same(&t), Some(3));
        assert!(t.names.set.contains("only-c"));
        for id in ["a", "c"] {
            apply(&mut t, &ev(id, Some("s"), 2.0, JobState::Started));
            apply(&mut t, &ev(id, Some("s"), 3.0, done(0)));
        }
        assert_eq!(t.expire(100.0, 10.0), 2);
        assert!(
            !t.names.set.contains("only-c"),
            "a name no job uses is kept"
        );
        assert_eq!(same(&t), Some(2));
        assert_eq!(t.get("b").unwrap().name, "same");
        // The owner and pool of "b" stay.
        assert!(t.names.set.contains("alice") && t.names.set.contains("p"));
    }

    #[test]
    fn queries_filter_and_page_in_submission_order() {
        let mut t = JobTable::new();
        for i in 0..7 {
            let mut e = queued(&format!("j{i}"), "s", f64::from(i));
            if i % 2 == 1 {
                e.owner = "bob".into();
            }
            apply(&mut t, &e);
        }
        apply(&mut t, &ev("j0", Some("s"), 9.0, JobState::Started));
        let f = Filter {
            owner: Some("alice".into()),
            ..Default::default()
        };
        let (page, next) = t.query(&f, None, 2);
        let ids: Vec<_> = page.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["j0", "j2"]);
        let (page, next) = t.query(&f, next, 2);
        let ids: Vec<_> = page.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["j4", "j6"]);
        assert_eq!(next, None, "no page after the last match");
        let running = Filter {
            states: vec![State::Running],
            ..Default::default()
        };
        let (page, next) = t.query(&running, None, 10);
        assert_eq!((page.len(), page[0].id.as_str(), next), (1, "j0", None));
        let other = Filter {
            pool: Some("other".into()),
            ..Default::default()
        };
        assert!(t.query(&other, None, 10).0.is_empty());
        assert_eq!(State::from_letter('x'), Some(State::Cancelled));
        assert_eq!(State::from_letter('Z'), None);
    }

    #[test]
    fn the_user_index_follows_owner_and_submitter_and_expiry() {
        let mut t = JobTable::new();
        let mut e = queued("a", "s", 1.0);
        e.owner = String::new();
        e.submitter = Some("bridge".into());
        apply(&mut t, &e);
        let by = |t: &JobTable, f: Filter| -> Vec<String> {
            t.query(&f, None, 10)
                .0
                .iter()
                .map(|r| r.id.clone())
                .collect()
        };
        let owner = |o: &str| Filter {
            owner: Some(o.into()),
            ..Default::default()
        };
        let visible = |u: &str| Filter {
            visible_to: Some(u.into()),
            ..Default::default()
        };
        assert!(by(&t, owner("alice")).is_empty());
        assert_eq!(by(&t, visible("bridge")), ["a"]);
        // The owner becomes known with the start.
        apply(&mut t, &ev("a", Some("s"), 2.0, JobState::Started));
        assert_eq!(by(&t, owner("alice")), ["a"]);
        assert_eq!(by(&t, visible("alice")), ["a"]);
        assert_eq!(by(&t, visible("bridge")), ["a"]);
        assert!(by(&t, owner("bridge")).is_empty(), "owner is not submitter");
        apply(&mut t, &ev("a", Some("s"), 3.0, done(0)));
        assert_eq!(t.expire(1000.0, 10.0), 1);
        assert!(by(&t, visible("alice")).is_empty() && t.by_user.is_empty() && t.ids.is_empty());
    }

    #[test]
    fn a_job_is_found_by_its_id_or_a_unique_prefix() {
        let mut t = JobTable::new();
        apply(&mut t, &queued("abc1", "s", 1.0));
        apply(&mut t, &queued("abc2", "s", 1.0));
        apply(&mut t, &queued("xyz", "s", 1.0));
        assert_eq!(t.find("xyz").unwrap().id, "xyz");
        assert_eq!(t.find("x").unwrap().id, "xyz");
        assert_eq!(
            t.find("abc").unwrap_err(),
            FindError::Ambiguous(vec!["abc1".into(), "abc2".into()])
        );
        assert_eq!(t.find("q").unwrap_err(), FindError::Unknown);
        assert_eq!(t.find("").unwrap_err(), FindError::Unknown);
    }

    /// Another submitter's reuse of an id (anyone may publish any id) does
    /// not hide a user's own job from them, nor do prefixes of jobs a user
    /// may not see resolve (a refusal would tell the full id); the exact
    /// id still names the latest job, for the caller to judge.
    #[test]
    fn a_user_finds_their_own_job_first_and_no_prefix_of_others() {
        let mut t = JobTable::new();
        apply(&mut t, &queued("dd3dc142-a", "s-alice", 1.0));
        let mut m = queued("dd3dc142-a", "s-mallory", 2.0);
        m.owner = "mallory".into();
        m.submitter = Some("mallory".into());
        apply(&mut t, &m);
        let mut other = queued("e5-bob", "s-bob", 3.0);
        other.owner = "bob".into();
        other.submitter = Some("bob".into());
        apply(&mut t, &other);
        assert_eq!(t.find("dd3dc142-a").unwrap().owner, "mallory", "latest");
        let mine = t.find_for("dd3dc142-a", "alice", false).unwrap();
        assert_eq!(mine.submission.as_deref(), Some("s-alice"));
        assert_eq!(t.find_for("dd3", "alice", false).unwrap().owner, "alice");
        assert_eq!(
            t.find_for("dd3", "mallory", false).unwrap().owner,
            "mallory"
        );
        // Bob's job: its prefix is nobody else's, its exact id the caller's
        // to judge.
        assert_eq!(
            t.find_for("e5", "alice", false).unwrap_err(),
            FindError::Unknown
        );
        assert_eq!(t.find_for("e5", "alice", true).unwrap().owner, "bob");
        assert_eq!(t.find_for("e5-bob", "alice", false).unwrap().owner, "bob");
        // Dependencies: by submitter only.
        assert_eq!(
            t.find_by("dd3", "alice").unwrap().submission.as_deref(),
            Some("s-alice")
        );
        assert_eq!(t.find_by("e5", "alice").unwrap_err(), FindError::Unknown);
        assert_eq!(
            t.get_submission("dd3dc142-a", "s-alice").unwrap().owner,
            "alice"
        );
    }
}
