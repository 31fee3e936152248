//! Job events: reading the retained stream `<cluster>.events.log` and
//! folding it into one summary per job (used by `vq stat` and `vq cancel`),
//! and following one job's live events (`vq submit --wait`).
//!
//! The stream is a RabbitMQ stream queue (3.9+): it is consumed from its
//! first retained message (`x-stream-offset = first`) with a prefetch and
//! manual acks (the broker requires both), until no message arrives for a
//! short idle time. Reading never removes anything.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use vq_common::amqp::{self, AmqpError};
use vq_common::messages::{JobEvent, JobState, Outcome};
use vq_common::topology::{job_event_key, Topology};

use crate::error::CliError;

/// Prefetch of the stream consumer (messages).
pub const STREAM_PREFETCH: u16 = 1000;

/// The stream is read until no message arrives for this long.
pub const STREAM_IDLE: Duration = Duration::from_millis(500);

/// Upper bound of one read of the stream, whatever its size.
pub const STREAM_READ_LIMIT: Duration = Duration::from_secs(60);

/// Reads every retained job event. Returns `None` if the stream does not
/// exist (no controller has declared the topology yet).
///
/// # Errors
/// [`CliError::Broker`].
pub async fn read_job_events(
    conn: &lapin::Connection,
    topo: &Topology,
) -> Result<Option<Vec<JobEvent>>, CliError> {
    let queue = topo.event_log_queue();
    let op = |what: &'static str| {
        move |source| CliError::Broker {
            action: format!("read the job-event stream {}", topo.event_log_queue()),
            source: Box::new(AmqpError::Op {
                what: what.into(),
                source,
            }),
        }
    };
    // Passive declare on its own channel: NOT_FOUND closes that channel.
    let probe = conn.create_channel().await.map_err(op("channel.open"))?;
    let exists = amqp::queue_exists(&probe, &queue, "queue.declare passive")
        .await
        .map_err(CliError::broker(format!(
            "read the job-event stream {queue}"
        )))?;
    if !exists {
        return Ok(None);
    }
    let _ = probe.close(200, "ok".into()).await;

    let ch = conn.create_channel().await.map_err(op("channel.open"))?;
    let mut consumer = amqp::consume_stream_from_first(&ch, &queue, "vq-stat", STREAM_PREFETCH)
        .await
        .map_err(CliError::broker(format!(
            "read the job-event stream {queue}"
        )))?;
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + STREAM_READ_LIMIT;
    let mut unacked = 0u32;
    loop {
        let wait = STREAM_IDLE.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        let next = match tokio::time::timeout(wait, consumer.next()).await {
            Err(_) | Ok(None) => break,
            Ok(Some(d)) => d.map_err(op("basic.deliver"))?,
        };
        unacked += 1;
        // Streams need acks to grant credit; ack in batches.
        if unacked >= u32::from(STREAM_PREFETCH) / 2 {
            next.ack(BasicAckOptions { multiple: true })
                .await
                .map_err(op("basic.ack"))?;
            unacked = 0;
        }
        let user_id = next.properties.user_id().as_ref().map(|u| u.as_str());
        match JobEvent::decode_delivered(&next.data, next.routing_key.as_str(), user_id) {
            Ok(ev) => events.push(ev),
            Err(e) => tracing::debug!(error = %e, "skipping undecodable event"),
        }
    }
    let _ = ch.close(200, "done".into()).await;
    Ok(Some(events))
}

/// Subscribes to the pool's job events ([`amqp::subscribe`]: a
/// server-named exclusive queue, no acks). Subscribe before publishing a job
/// so that a fast job's events are not missed.
///
/// # Errors
/// [`CliError::Broker`].
pub async fn subscribe_job_events(
    conn: &lapin::Connection,
    topo: &Topology,
    pool: &str,
) -> Result<lapin::Consumer, CliError> {
    const ACTION: &str = "subscribe to job events";
    let ch = conn
        .create_channel()
        .await
        .map_err(AmqpError::op("channel.open"))
        .map_err(CliError::broker(ACTION))?;
    let key = job_event_key(pool, "*");
    amqp::subscribe(&ch, "", &topo.events_exchange(), &[key.as_str()], "")
        .await
        .map_err(CliError::broker(ACTION))
}

/// Exit status of `vq submit --wait` for a final job state: the job's exit
/// code; `128 + signal` for a signal (as a shell reports it); 1 for
/// walltime, cancel, output limit, failure to start and rejection.
pub fn wait_exit_code(state: &JobState) -> i32 {
    match state {
        JobState::Finished {
            outcome: Outcome::Exited { code },
            ..
        } => *code,
        JobState::Finished {
            outcome: Outcome::Signaled { signal },
            ..
        } => 128 + signal,
        JobState::Queued { .. } | JobState::Started => 0,
        JobState::Finished { .. } | JobState::Failed { .. } => 1,
    }
}

/// A short human description of an outcome, e.g. `exited with status 3`.
pub fn describe_outcome(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Exited { code } => format!("exited with status {code}"),
        Outcome::Signaled { signal } => format!("was killed by signal {signal}"),
        Outcome::Walltime => "exceeded its walltime and was killed".into(),
        Outcome::Cancelled => "was cancelled".into(),
        Outcome::OutputLimit => "exceeded the output limit and was killed".into(),
        Outcome::FailedToStart { reason } => format!("failed to start: {reason}"),
    }
}

/// Follows `job_id`'s events on `consumer` (from [`subscribe_job_events`])
/// until its final one, printing progress to stderr; returns
/// [`wait_exit_code`] of the final state. Events published by another
/// submitter than `me` (the broker user) are ignored.
///
/// # Errors
/// [`CliError::WaitInterrupted`] if the subscription ends first.
pub async fn wait_for_job(
    mut consumer: lapin::Consumer,
    job_id: &str,
    me: &str,
) -> Result<i32, CliError> {
    // Job ids are chosen by submitters: an event for the same id from
    // another submitter's message is not about this job.
    while let Some(delivery) = consumer.next().await {
        let Ok(delivery) = delivery else { break };
        let user_id = delivery.properties.user_id().as_ref().map(|u| u.as_str());
        let Ok(event) =
            JobEvent::decode_delivered(&delivery.data, delivery.routing_key.as_str(), user_id)
        else {
            continue;
        };
        if event.job_id != job_id || event.submitter.as_deref().is_some_and(|s| s != me) {
            continue;
        }
        match &event.state {
            JobState::Queued { .. } => {}
            JobState::Started => eprintln!("vq: job {} started on {}", job_id, event.agent),
            JobState::Finished { outcome, .. } => {
                eprintln!("vq: job {} {}", job_id, describe_outcome(outcome));
                return Ok(wait_exit_code(&event.state));
            }
            JobState::Failed { reason } => {
                eprintln!("vq: job {} failed: {reason}", job_id);
                return Ok(wait_exit_code(&event.state));
            }
        }
    }
    Err(CliError::WaitInterrupted {
        job_id: job_id.to_string(),
    })
}

/// State of a job as `qstat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatState {
    /// `Q`: queued (its `queued` event seen, no start yet).
    Queued,
    /// `R`: started, no end seen.
    Running,
    /// `C`: completed (exited, signalled, walltime or output limit).
    Completed,
    /// `F`: failed (rejected, failed to start, node lost).
    Failed,
    /// `X`: cancelled.
    Cancelled,
}

impl StatState {
    /// The one-letter code.
    pub fn letter(self) -> char {
        match self {
            StatState::Queued => 'Q',
            StatState::Running => 'R',
            StatState::Completed => 'C',
            StatState::Failed => 'F',
            StatState::Cancelled => 'X',
        }
    }

    /// The word for messages.
    pub fn word(self) -> &'static str {
        match self {
            StatState::Queued => "queued",
            StatState::Running => "running",
            StatState::Completed => "completed",
            StatState::Failed => "failed",
            StatState::Cancelled => "cancelled",
        }
    }
}

/// What the events say about one job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSummary {
    /// Job id.
    pub id: String,
    /// Job name.
    pub name: String,
    /// Owner.
    pub owner: String,
    /// Pool.
    pub pool: String,
    /// Agent of the latest event (the one running it, if running).
    pub agent: String,
    /// Current state.
    pub state: StatState,
    /// PBS exit status once ended (see `Outcome::exit_status`).
    pub exit: Option<i32>,
    /// The submission ([`JobEvent::submission`]): with the id, what names
    /// one job (an id may be submitted again once its job ended).
    pub submission: Option<String>,
    /// Broker user that submitted the job (validated by the broker).
    pub submitter: Option<String>,
    /// What the job asked for, from its `queued` event.
    pub request: Option<vq_common::messages::JobRequest>,
    /// Submission time, Unix seconds (from its `queued` event).
    pub queued_at: Option<f64>,
    /// Start time, Unix seconds (latest `started`).
    pub started_at: Option<f64>,
    /// End time, Unix seconds.
    pub ended_at: Option<f64>,
    /// Wall time reported by the agent, seconds.
    pub wall_secs: Option<f64>,
    /// Failure reason, if failed.
    pub reason: Option<String>,
}

impl JobSummary {
    /// Elapsed run time at `now` (Unix seconds): the agent's wall time when
    /// ended, else `now - started`.
    pub fn elapsed(&self, now: f64) -> Option<u64> {
        let secs = match (self.wall_secs, self.started_at, self.ended_at) {
            (Some(w), _, _) => w,
            (None, Some(s), Some(e)) => e - s,
            (None, Some(s), None) => now - s,
            _ => return None,
        };
        Some(secs.max(0.0).round() as u64)
    }
}

/// Folds events (in stream order) into one summary per job, in order of
/// first appearance. A job is `(job_id, submission)`: an id submitted again
/// after its job ended is another job (events without a submission join
/// the id's latest job). A later `started` (a rerun after a node loss)
/// reopens the job; a `queued` event never moves a job back (it may reach
/// the stream after the job's `started`). Reports about a duplicate
/// message ([`JobEvent::duplicate`]) say nothing about the job and are
/// skipped.
pub fn summarize(events: &[JobEvent]) -> Vec<JobSummary> {
    type Key = (String, Option<String>);
    let mut order: Vec<Key> = Vec::new();
    let mut by_key: std::collections::HashMap<Key, JobSummary> = Default::default();
    let mut latest: std::collections::HashMap<String, Option<String>> = Default::default();
    for ev in events {
        if ev.duplicate.is_some() {
            continue;
        }
        let submission = match &ev.submission {
            Some(sub) => Some(sub.clone()),
            None => latest.get(&ev.job_id).cloned().flatten(),
        };
        latest.insert(ev.job_id.clone(), submission.clone());
        let key = (ev.job_id.clone(), submission.clone());
        let s = by_key.entry(key.clone()).or_insert_with(|| {
            order.push(key);
            JobSummary {
                id: ev.job_id.clone(),
                name: ev.job_name.clone(),
                owner: ev.owner.clone(),
                pool: ev.pool.clone(),
                agent: String::new(),
                state: StatState::Queued,
                exit: None,
                submission,
                submitter: None,
                request: None,
                queued_at: None,
                started_at: None,
                ended_at: None,
                wall_secs: None,
                reason: None,
            }
        });
        if ev.submitter.is_some() && s.submitter.is_none() {
            s.submitter = ev.submitter.clone();
        }
        if !ev.job_name.is_empty() {
            s.name = ev.job_name.clone();
        }
        if !ev.owner.is_empty() {
            s.owner = ev.owner.clone();
        }
        if !ev.agent.is_empty() {
            s.agent = ev.agent.clone();
        }
        match &ev.state {
            JobState::Queued { request } => {
                s.request = Some(request.clone());
                s.queued_at = Some(ev.at);
            }
            JobState::Started => {
                s.state = StatState::Running;
                s.started_at = Some(ev.at);
                s.ended_at = None;
                s.exit = None;
                s.wall_secs = None;
                s.reason = None;
            }
            JobState::Finished { outcome, usage } => {
                s.state = match outcome {
                    Outcome::Cancelled => StatState::Cancelled,
                    Outcome::FailedToStart { reason } => {
                        s.reason = Some(reason.clone());
                        StatState::Failed
                    }
                    _ => StatState::Completed,
                };
                s.exit = Some(outcome.exit_status());
                s.ended_at = Some(ev.at);
                s.wall_secs = Some(usage.wall_secs);
            }
            JobState::Failed { reason } => {
                s.state = StatState::Failed;
                s.reason = Some(reason.clone());
                s.ended_at = Some(ev.at);
            }
        }
    }
    order
        .into_iter()
        .filter_map(|k| by_key.remove(&k))
        .collect()
}

/// Finds the job `wanted` names: the exact id, else the unique job whose id
/// starts with `wanted` (so the short `<uuid-prefix>` works).
///
/// # Errors
/// [`CliError::UnknownJob`] or [`CliError::AmbiguousJob`].
///
/// An id submitted again after its job ended names the latest of its jobs.
pub fn find_job<'a>(jobs: &'a [JobSummary], wanted: &str) -> Result<&'a JobSummary, CliError> {
    if let Some(j) = jobs.iter().rev().find(|j| j.id == wanted) {
        return Ok(j);
    }
    let mut ids: Vec<&str> = jobs
        .iter()
        .filter(|j| j.id.starts_with(wanted))
        .map(|j| j.id.as_str())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    match ids.as_slice() {
        [one] if !wanted.is_empty() => Ok(jobs
            .iter()
            .rev()
            .find(|j| j.id == *one)
            .expect("a matching id has a job")),
        [] | [_] => Err(CliError::UnknownJob {
            job_id: wanted.to_string(),
        }),
        many => Err(CliError::AmbiguousJob {
            job_id: wanted.to_string(),
            matches: many.iter().map(|id| id.to_string()).collect(),
        }),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use vq_common::messages::{Usage, SCHEMA_VERSION};

    use super::*;

    pub(crate) fn ev(id: &str, owner: &str, agent: &str, at: f64, state: JobState) -> JobEvent {
        JobEvent {
            schema: SCHEMA_VERSION,
            job_id: id.into(),
            job_name: format!("n-{id}"),
            owner: owner.into(),
            pool: "p".into(),
            agent: agent.into(),
            submitter: None,
            at,
            attempt: 1,
            duplicate: None,
            submission: None,
            state,
        }
    }

    fn fin(outcome: Outcome, wall: f64) -> JobState {
        JobState::Finished {
            outcome,
            usage: Usage {
                wall_secs: wall,
                ..Default::default()
            },
        }
    }

    #[test]
    fn events_fold_into_one_line_per_job() {
        let events = vec![
            ev("a", "alice", "ag1", 100.0, JobState::Started),
            ev("b", "bob", "ag2", 101.0, JobState::Started),
            ev(
                "a",
                "alice",
                "ag1",
                110.0,
                fin(Outcome::Exited { code: 2 }, 9.6),
            ),
            ev(
                "c",
                "carol",
                "ag1",
                120.0,
                JobState::Failed {
                    reason: "no user".into(),
                },
            ),
            ev("b", "bob", "ag2", 130.0, fin(Outcome::Cancelled, 29.0)),
            ev("d", "dave", "ag3", 140.0, JobState::Started),
        ];
        let s = summarize(&events);
        let ids: Vec<_> = s.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        let letters: String = s.iter().map(|j| j.state.letter()).collect();
        assert_eq!(letters, "CXFR");
        assert_eq!(s[0].exit, Some(2));
        assert_eq!(s[0].elapsed(1000.0), Some(10));
        assert_eq!(s[1].exit, Some(271));
        assert_eq!(s[2].reason.as_deref(), Some("no user"));
        assert_eq!(s[3].elapsed(150.0), Some(10));
        assert_eq!(s[3].agent, "ag3");
    }

    #[test]
    fn a_rerun_reopens_the_job_on_its_new_agent() {
        let events = vec![
            ev("a", "alice", "ag1", 100.0, JobState::Started),
            ev("a", "alice", "ag2", 200.0, JobState::Started),
        ];
        let s = summarize(&events);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].agent, "ag2");
        assert_eq!(s[0].state, StatState::Running);
    }

    #[test]
    fn jobs_are_found_by_id_or_unique_prefix() {
        let s = summarize(&[
            ev("abc1.vq", "u", "x", 1.0, JobState::Started),
            ev("abc2.vq", "u", "x", 1.0, JobState::Started),
            ev("abc", "u", "x", 1.0, JobState::Started),
        ]);
        assert_eq!(find_job(&s, "abc").unwrap().id, "abc");
        assert_eq!(find_job(&s, "abc1").unwrap().id, "abc1.vq");
        assert!(matches!(
            find_job(&s, "abc."),
            Err(CliError::UnknownJob { .. })
        ));
        assert!(matches!(
            find_job(&s, ""),
            Err(CliError::AmbiguousJob { .. })
        ));
        let s = summarize(&[
            ev("abc1.vq", "u", "x", 1.0, JobState::Started),
            ev("abc2.vq", "u", "x", 1.0, JobState::Started),
        ]);
        assert!(matches!(
            find_job(&s, "abc"),
            Err(CliError::AmbiguousJob { .. })
        ));
    }

    #[test]
    fn wait_exit_codes_follow_the_shell() {
        let fin = |outcome| JobState::Finished {
            outcome,
            usage: Default::default(),
        };
        assert_eq!(wait_exit_code(&fin(Outcome::Exited { code: 3 })), 3);
        assert_eq!(wait_exit_code(&fin(Outcome::Signaled { signal: 9 })), 137);
        assert_eq!(wait_exit_code(&fin(Outcome::Walltime)), 1);
        assert_eq!(wait_exit_code(&JobState::Failed { reason: "x".into() }), 1);
    }

    fn queued(id: &str, submission: &str, at: f64) -> JobEvent {
        let mut e = ev(
            id,
            "alice",
            "",
            at,
            JobState::Queued {
                request: Default::default(),
            },
        );
        e.submission = Some(submission.into());
        e.submitter = Some("alice".into());
        e
    }

    fn of(mut e: JobEvent, submission: &str) -> JobEvent {
        e.submission = Some(submission.into());
        e
    }

    #[test]
    fn a_queued_job_waits_until_started_and_a_late_queued_never_moves_it_back() {
        let jobs = summarize(&[queued("a", "s1", 10.0)]);
        assert_eq!(jobs[0].state, StatState::Queued);
        assert_eq!(jobs[0].state.letter(), 'Q');
        assert_eq!(jobs[0].queued_at, Some(10.0));
        assert_eq!(jobs[0].submitter.as_deref(), Some("alice"));
        assert_eq!(jobs[0].elapsed(100.0), None);

        let started = of(ev("a", "alice", "ag1", 11.0, JobState::Started), "s1");
        let jobs = summarize(&[queued("a", "s1", 10.0), started.clone()]);
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].state, StatState::Running);
        assert_eq!(jobs[0].agent, "ag1");
        // The queued event reaching the stream after the start.
        let jobs = summarize(&[started, queued("a", "s1", 10.0)]);
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].state, StatState::Running);
        assert!(jobs[0].request.is_some());
    }

    #[test]
    fn an_id_submitted_again_is_another_job_and_names_the_latest() {
        let done = JobState::Finished {
            outcome: Outcome::Exited { code: 0 },
            usage: Usage::default(),
        };
        let events = [
            queued("a", "s1", 1.0),
            of(ev("a", "alice", "ag1", 2.0, JobState::Started), "s1"),
            of(ev("a", "alice", "ag1", 3.0, done), "s1"),
            queued("a", "s2", 4.0),
        ];
        let jobs = summarize(&events);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].state, StatState::Completed);
        assert_eq!(jobs[1].state, StatState::Queued);
        let found = find_job(&jobs, "a").unwrap();
        assert_eq!(found.submission.as_deref(), Some("s2"));
        // A unique prefix of that id is not ambiguous either.
        assert!(find_job(&jobs, "").is_err());
        let mut longer = events.to_vec();
        for e in &mut longer {
            e.job_id = "abc.vq".into();
        }
        let jobs = summarize(&longer);
        assert_eq!(
            find_job(&jobs, "ab").unwrap().submission.as_deref(),
            Some("s2")
        );
        // Events without a submission join the id's latest job.
        let mut events = events.to_vec();
        events.push(ev("a", "alice", "ag2", 5.0, JobState::Started));
        let jobs = summarize(&events);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[1].state, StatState::Running);
    }
}
