//! Job events: reading the retained stream `<cluster>.events.log` and
//! folding it into the common job table (`vq stat --from-stream`, `vq cancel`),
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
use vq_common::jobs::{FindError, JobRecord, JobTable};
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
        JobState::Queued { .. } | JobState::Held { .. } | JobState::Started => 0,
        JobState::Finished { .. } | JobState::Failed { .. } | JobState::Withdrawn { .. } => 1,
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
    let mut started = false;
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
            JobState::Queued { .. } | JobState::Held { .. } => {}
            JobState::Started => {
                started = true;
                eprintln!("vq: job {} started on {}", job_id, event.agent)
            }
            // A start that won the race against the withdrawal: the job
            // runs, and its cancel goes to the agent.
            JobState::Withdrawn { .. } if started => {}
            JobState::Withdrawn { by, reason: None } => {
                eprintln!("vq: job {job_id} was cancelled by {by} while queued");
                return Ok(wait_exit_code(&event.state));
            }
            JobState::Withdrawn {
                reason: Some(reason),
                ..
            } => {
                eprintln!("vq: job {job_id} was cancelled: {reason}");
                return Ok(wait_exit_code(&event.state));
            }
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

/// Folds `events` (in stream order) into the one job table of
/// [`vq_common::jobs::JobTable`] (the fold the controller keeps), each
/// event deduplicated on its stable `message_id`.
pub fn table_of(events: &[JobEvent]) -> JobTable {
    let mut t = JobTable::new();
    for ev in events {
        t.apply(ev, Some(&ev.message_id()));
    }
    t
}

/// Reads the whole stream ([`read_job_events`]) into a [`JobTable`]; an
/// empty table if the stream does not exist.
///
/// # Errors
/// [`CliError::Broker`].
pub async fn read_job_table(
    conn: &lapin::Connection,
    topo: &Topology,
) -> Result<JobTable, CliError> {
    Ok(read_job_events(conn, topo)
        .await?
        .map(|evs| table_of(&evs))
        .unwrap_or_default())
}

/// The job `wanted` names in `table` ([`JobTable::find`]).
///
/// # Errors
/// [`CliError::UnknownJob`] or [`CliError::AmbiguousJob`].
pub fn find_job(table: &JobTable, wanted: &str) -> Result<JobRecord, CliError> {
    table.find(wanted).map_err(|e| match e {
        FindError::Unknown => CliError::UnknownJob {
            job_id: wanted.to_string(),
        },
        FindError::Ambiguous(matches) => CliError::AmbiguousJob {
            job_id: wanted.to_string(),
            matches,
        },
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use vq_common::messages::SCHEMA_VERSION;

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

    #[test]
    fn the_stream_folds_into_the_common_table_and_ids_name_jobs_by_prefix() {
        let start = ev("abc1", "alice", "ag1", 1.0, JobState::Started);
        let t = table_of(&[
            start.clone(),
            ev("abc2", "bob", "ag2", 1.0, JobState::Started),
            start,
        ]);
        assert_eq!(t.len(), 2);
        assert_eq!(t.events_applied, 2, "a repeated event is applied once");
        assert_eq!(find_job(&t, "abc1").unwrap().agent, "ag1");
        assert!(matches!(
            find_job(&t, "abc"),
            Err(CliError::AmbiguousJob { matches, .. }) if matches.len() == 2
        ));
        assert!(matches!(
            find_job(&t, "zz"),
            Err(CliError::UnknownJob { .. })
        ));
    }
}
