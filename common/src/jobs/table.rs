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
//! after the job's `started`), a later `started` (a rerun after a node
//! loss) reopens it, a repeated event (same `message_id`, from a publish
//! whose confirm was lost) changes nothing. Ended jobs are forgotten
//! [`JobTable::expire`] seconds after their end, as Torque's
//! `keep_completed`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::messages::{JobEvent, JobRequest, JobState, Outcome};

/// A job's state as `qstat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// `Q`: in its pool queue.
    Queued,
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
            State::Running => 'R',
            State::Completed => 'C',
            State::Failed => 'F',
            State::Cancelled => 'X',
        }
    }

    /// Parses a letter (`Q R C F X`, either case).
    pub fn from_letter(c: char) -> Option<State> {
        Some(match c.to_ascii_uppercase() {
            'Q' => State::Queued,
            'R' => State::Running,
            'C' => State::Completed,
            'F' => State::Failed,
            'X' => State::Cancelled,
            _ => return None,
        })
    }

    /// The word for messages (`queued`, `running`, `completed`, `failed`,
    /// `cancelled`).
    pub fn word(self) -> &'static str {
        match self {
            State::Queued => "queued",
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

/// One job in the table, with the `message_id`s applied to it (as 64-bit
/// FNV-1a hashes: only compared among one job's few events).
#[derive(Debug)]
struct Slot {
    rec: JobRecord,
    seen: Vec<u64>,
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
    recs: BTreeMap<u64, Slot>,
    ids: BTreeMap<String, IdEntry>,
    by_user: HashMap<String, BTreeSet<u64>>,
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

    fn index_user(&mut self, user: &str, seq: u64) {
        if user.is_empty() {
            return;
        }
        match self.by_user.get_mut(user) {
            Some(set) => {
                set.insert(seq);
            }
            None => {
                self.by_user.insert(user.to_string(), BTreeSet::from([seq]));
            }
        }
    }

    fn unindex_user(&mut self, user: &str, seq: u64) {
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
        let found = self.ids.get(&ev.job_id).map(|e| {
            let latest_sub = e
                .latest
                .and_then(|q| recs.get(&q))
                .and_then(|s| s.rec.submission.clone());
            let submission = match &ev.submission {
                Some(s) => Some(s.clone()),
                None => latest_sub,
            };
            let seq = e
                .seqs()
                .find(|q| recs.get(q).is_some_and(|s| s.rec.submission == submission));
            (submission, seq)
        });
        let (submission, seq, fresh) = match found {
            Some((sub, Some(q))) => (sub, q, false),
            Some((sub, None)) => {
                let q = self.next_seq;
                self.next_seq += 1;
                let e = self.ids.get_mut(&ev.job_id).expect("found above");
                e.more.push(q);
                (sub, q, true)
            }
            None => {
                let q = self.next_seq;
                self.next_seq += 1;
                self.ids.insert(
                    ev.job_id.clone(),
                    IdEntry {
                        first: q,
                        more: Vec::new(),
                        latest: None,
                    },
                );
                (ev.submission.clone(), q, true)
            }
        };
        if let Some(e) = self.ids.get_mut(&ev.job_id) {
            e.latest = Some(seq);
        }
        if fresh {
            self.recs.insert(
                seq,
                Slot {
                    rec: JobRecord {
                        id: ev.job_id.clone(),
                        submission,
                        name: ev.job_name.clone(),
                        owner: ev.owner.clone(),
                        pool: ev.pool.clone(),
                        submitter: None,
                        state: State::Queued,
                        letter: 'Q',
                        agent: String::new(),
                        attempt: 0,
                        exit_status: None,
                        reason: None,
                        request: None,
                        queued_at: None,
                        started_at: None,
                        ended_at: None,
                        usage: None,
                    },
                    seen: Vec::new(),
                },
            );
            self.index_user(&ev.owner, seq);
        }
        let slot = self.recs.get_mut(&seq).expect("indexed jobs have a record");
        if let Some(id) = message_id {
            let h = hash_id(id);
            if slot.seen.contains(&h) {
                return;
            }
            slot.seen.push(h);
        }
        self.events_applied += 1;
        let r = &mut slot.rec;
        if !ev.job_name.is_empty() {
            r.name = ev.job_name.clone();
        }
        let mut old_owner = None;
        if !ev.owner.is_empty() && r.owner != ev.owner {
            old_owner = Some(std::mem::replace(&mut r.owner, ev.owner.clone()));
        }
        let mut new_submitter = None;
        if r.submitter.is_none() && ev.submitter.is_some() {
            r.submitter = ev.submitter.clone();
            new_submitter = ev.submitter.clone();
        }
        Self::fold(r, ev);
        let (owner, submitter) = (r.owner.clone(), r.submitter.clone());
        if let Some(old) = old_owner {
            if submitter.as_deref() != Some(old.as_str()) {
                self.unindex_user(&old, seq);
            }
            self.index_user(&owner, seq);
        }
        if let Some(s) = new_submitter {
            self.index_user(&s, seq);
        }
    }

    fn fold(r: &mut JobRecord, ev: &JobEvent) {
        match &ev.state {
            JobState::Queued { request } => {
                r.request = Some(request.clone());
                r.queued_at = Some(ev.at);
            }
            JobState::Started => {
                // A start older than the latest one (reordered copies) does
                // not reopen an ended job.
                if ev.attempt >= r.attempt {
                    r.state = State::Running;
                    r.attempt = ev.attempt;
                    r.agent = ev.agent.clone();
                    r.started_at = Some(ev.at);
                    r.ended_at = None;
                    r.exit_status = None;
                    r.reason = None;
                    r.usage = None;
                }
            }
            JobState::Finished { outcome, usage } => {
                r.state = match outcome {
                    Outcome::Cancelled => State::Cancelled,
                    Outcome::FailedToStart { reason } => {
                        r.reason = Some(reason.clone());
                        State::Failed
                    }
                    _ => State::Completed,
                };
                if !ev.agent.is_empty() {
                    r.agent = ev.agent.clone();
                }
                r.exit_status = Some(outcome.exit_status());
                r.ended_at = Some(ev.at);
                r.usage = Some(*usage);
            }
            JobState::Failed { reason } => {
                r.state = State::Failed;
                r.reason = Some(reason.clone());
                r.ended_at = Some(ev.at);
            }
            // Only a job no agent started: a start that won the race
            // against the withdrawal keeps the job running (its cancel then
            // goes to the agent).
            JobState::Withdrawn { by } if r.state == State::Queued => {
                r.state = State::Cancelled;
                r.reason = Some(format!("cancelled by {by} while queued"));
                r.ended_at = Some(ev.at);
            }
            JobState::Withdrawn { .. } => {}
        }
        r.letter = r.state.letter();
    }

    /// Forgets jobs that ended more than `keep_secs` before `now` (Unix
    /// seconds; Torque's `keep_completed`). Returns how many were dropped.
    pub fn expire(&mut self, now: f64, keep_secs: f64) -> usize {
        let old: Vec<u64> = self
            .recs
            .iter()
            .filter(|(_, s)| {
                s.rec.state.ended() && s.rec.ended_at.is_some_and(|e| now - e > keep_secs)
            })
            .map(|(q, _)| *q)
            .collect();
        for seq in &old {
            let Some(Slot { rec, .. }) = self.recs.remove(seq) else {
                continue;
            };
            self.unindex_user(&rec.owner, *seq);
            if let Some(s) = &rec.submitter {
                self.unindex_user(s, *seq);
            }
            if let Some(e) = self.ids.get_mut(&rec.id) {
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
                        self.ids.remove(&rec.id);
                    }
                }
            }
        }
        old.len()
    }

    /// The latest job named `id`.
    pub fn get(&self, id: &str) -> Option<&JobRecord> {
        let e = self.ids.get(id)?;
        // After the latest job expired, the submission-less one (if any).
        let seq = e.latest.or_else(|| {
            e.seqs()
                .find(|q| self.recs.get(q).is_some_and(|s| s.rec.submission.is_none()))
        })?;
        self.recs.get(&seq).map(|s| &s.rec)
    }

    /// The job `wanted` names: the exact id, else the one id that starts
    /// with `wanted` (so the short `<uuid-prefix>` works); an id submitted
    /// again names its latest job.
    ///
    /// # Errors
    /// [`FindError::Unknown`] or [`FindError::Ambiguous`] (with the
    /// matching ids, sorted).
    pub fn find(&self, wanted: &str) -> Result<&JobRecord, FindError> {
        if let Some(r) = self.get(wanted) {
            return Ok(r);
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
            .map(|(id, _)| id.as_str())
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

    /// Jobs matching `filter`, in order of first event, at most `limit`,
    /// starting after position `after` (a cursor from an earlier page);
    /// returns them and the cursor of the next page, if any. A filter on
    /// an owner or a requester reads only that user's jobs.
    pub fn query(
        &self,
        filter: &Filter,
        after: Option<u64>,
        limit: usize,
    ) -> (Vec<&JobRecord>, Option<u64>) {
        let start = after.map_or(0, |a| a + 1);
        let user = filter.owner.as_ref().or(filter.visible_to.as_ref());
        let candidates: Box<dyn Iterator<Item = (u64, &JobRecord)>> = match user {
            Some(u) => match self.by_user.get(u) {
                Some(set) => Box::new(
                    set.range(start..)
                        .filter_map(|q| self.recs.get(q).map(|s| (*q, &s.rec))),
                ),
                None => Box::new(std::iter::empty()),
            },
            None => Box::new(self.recs.range(start..).map(|(q, s)| (*q, &s.rec))),
        };
        let mut out = Vec::new();
        let mut last = None;
        for (seq, r) in candidates {
            if !filter.matches(r) {
                continue;
            }
            if out.len() == limit {
                return (out, last);
            }
            out.push(r);
            last = Some(seq);
        }
        (out, None)
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
}
