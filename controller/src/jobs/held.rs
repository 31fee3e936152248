//! Held jobs (DESIGN.md, "Held jobs and dependencies"): the leader's
//! consumer of the held queue `<c>.held`, which releases a job with
//! dependencies into its pool once they are satisfied and cancels it with
//! a reason once one can never be.
//!
//! The consumer runs on the leader only (started and stopped with the
//! demand consumer, [`crate::broker::Broker::take_demand`]); the queue is
//! single-active-consumer besides, so two controllers that overlap for a
//! moment never both hold held jobs. It keeps every held delivery
//! unacked in memory (prefetch [`HELD_PREFETCH`]) and, every
//! [`EVALUATE_EVERY`] while the job table is complete, applies the pure
//! [`step`] to each:
//!
//! * [`Step::Release`]: the job message is published to its pool queue
//!   (confirmed, mandatory) with the envelope of a requeued copy
//!   ([`envelope::lease_copy_properties`]: the original submitter in
//!   `x-vq-submitter`, the controller's own `user_id`, which agents accept
//!   from `[submitters].requeuers` only); then its `queued` event
//!   (confirmed), which moves it from `H` to `Q`; then the held delivery is
//!   acked.
//! * [`Step::Never`]: a dead letter of the job (reason header, dead by
//!   `vq-controller`) is published to `<c>.dead`, then its `withdrawn`
//!   event with the reason (`X`), then the delivery is acked.
//! * [`Step::Drop`]: the table shows the job already released, running,
//!   ended or cancelled (`vq cancel` of a held job withdraws it as a queued
//!   one; a redelivery to a new leader after a release): acked, nothing
//!   published.
//!
//! A step whose publish fails is retried at the next evaluation; a
//! consumer whose channel fails ends, and the session is rebuilt (the
//! unacked deliveries go back to the queue).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{Channel, Consumer};
use vq_common::amqp::{self, envelope, AmqpError};
use vq_common::jobs::depend::{decide, Decision};
use vq_common::jobs::{JobTable, State};
use vq_common::messages::{fingerprint, unix_now, Job, JobEvent, JobState, Message};
use vq_common::topology::{job_event_key, Topology};

use super::feed::SharedJobs;
use crate::metrics::Metrics;

/// Prefetch of the held-queue consumer: at most this many held jobs are
/// evaluated at once. Held jobs beyond it wait in the queue (still `H` in
/// the table, from their `held` event) until earlier ones are released or
/// cancelled; see DESIGN.md for the one case that stalls (every job of the
/// window waiting for a job beyond it).
pub const HELD_PREFETCH: u16 = 10_000;

/// How often held jobs are evaluated against the job table.
pub const EVALUATE_EVERY: Duration = Duration::from_millis(500);

/// What to do with one held job now ([`step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Keep holding it (the reason, e.g. `held: afterok 123 not
    /// finished`; or the table is still being rebuilt).
    Keep(String),
    /// Publish it to its pool, then its `queued` event, then ack.
    Release,
    /// Dead-letter it and publish its `withdrawn` event with this reason.
    Never(String),
    /// The table shows it handled already: ack, publish nothing.
    Drop(State),
}

/// What to do with held job `job`, whose message body has the fingerprint
/// `submission`, published by broker user `submitter` (its validated
/// `user_id`; its dependencies name that submitter's jobs), given the job table `table` (`complete`: caught up with
/// the stream), at Unix time `now`, with the grace for unknown dependency
/// ids `grace_secs` counted from the job's `submitted_at`. Nothing is
/// decided on an incomplete table.
pub fn step(
    job: &Job,
    submission: &str,
    submitter: &str,
    table: &JobTable,
    complete: bool,
    now: f64,
    grace_secs: u64,
) -> Step {
    if !complete {
        return Step::Keep("the job table is being rebuilt".into());
    }
    // This very submission's record: another submission of the id (a
    // later one, anybody's) says nothing about it.
    if let Some(r) = table.get_submission(&job.id, submission) {
        if r.state != State::Held {
            return Step::Drop(r.state);
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let age = now - job.submitted_at as f64;
    let after_grace = (age >= grace_secs as f64).then_some(grace_secs);
    match decide(&job.id, &job.depend, submitter, table, after_grace) {
        Decision::Wait(why) => Step::Keep(why),
        Decision::Release => Step::Release,
        Decision::Never(why) => Step::Never(why),
    }
}

/// One held delivery, decoded.
struct Held {
    delivery: Delivery,
    job: Job,
    submitter: String,
    submission: String,
}

/// The held-queue consumer of one session ([`Holder::run`]).
pub struct Holder {
    /// Confirm channel for releases, dead letters and events.
    pub publish: Channel,
    /// The cluster's names.
    pub topo: Topology,
    /// The job table.
    pub jobs: SharedJobs,
    /// The controller's broker user (`user_id` of released copies, `by`
    /// of withdrawals).
    pub user: String,
    /// `[jobs] depend_grace_secs`.
    pub grace_secs: u64,
    /// Bound of each publish confirm.
    pub confirm: Duration,
    /// `vq_pool_held`.
    pub metrics: Arc<Metrics>,
    /// The pools this controller serves (their gauge is set, 0 included).
    pub pools: Vec<String>,
}

impl Holder {
    /// Consumes `consumer` (of `<c>.held`, manual ack) until it fails.
    pub async fn run(self, mut consumer: Consumer, _consume_channel: Channel) {
        let mut held: Vec<Held> = Vec::new();
        let mut tick = tokio::time::interval(EVALUATE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                d = consumer.next() => match d {
                    Some(Ok(d)) => {
                        if let Some(h) = self.take(d).await {
                            held.push(h);
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "held-queue consumer failed");
                        break;
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    if let Err(e) = self.evaluate(&mut held).await {
                        tracing::warn!(error = %vq_common::error::chain(&e), "held jobs: a release or cancel was not confirmed; retried");
                        if !self.publish.status().connected() {
                            break;
                        }
                    }
                }
            }
        }
        for p in &self.pools {
            self.metrics.set_pool_held(p, 0);
        }
    }

    /// Decodes a delivery; an undecodable one, or one without a
    /// broker-validated `user_id` (no submitter to judge it by), is
    /// dead-lettered with its reason (`x-vq-reason`) and acked; the
    /// dead-letter watch publishes its `failed` event.
    async fn take(&self, d: Delivery) -> Option<Held> {
        let job = Job::decode(&d.data);
        let submitter = d.properties.user_id().as_ref().map(|u| u.to_string());
        match (job, submitter) {
            (Ok(job), Some(submitter)) => {
                let submission = fingerprint(&d.data);
                tracing::info!(job_id = %job.id, pool = %job.pool, "held job taken");
                Some(Held {
                    delivery: d,
                    job,
                    submitter,
                    submission,
                })
            }
            (job, submitter) => {
                let why = match &job {
                    Err(e) => format!("held message refused: {}", vq_common::error::chain(e)),
                    Ok(_) => "held message refused: it carries no user_id (publish it with the user_id property set to your broker user, which the broker checks)".to_string(),
                };
                tracing::warn!(reason = %why, "held message refused: dead-lettered");
                // Dead-lettered with its reason, as the agents' refusals
                // are; a nack (RabbitMQ's own dead-lettering) would carry
                // none, and is the fallback when that publish fails.
                let props = envelope::dead_letter_properties(
                    &d.properties,
                    &why,
                    envelope::CONTROLLER_DEAD_BY,
                    submitter.as_deref(),
                );
                let published = amqp::publish_confirmed(
                    &self.publish,
                    &self.topo.dead_exchange(),
                    d.routing_key.as_str(),
                    &d.data,
                    props,
                    false,
                    self.confirm,
                )
                .await;
                let settled = match published {
                    Ok(()) => d.acker.ack(BasicAckOptions::default()).await,
                    Err(e) => {
                        tracing::warn!(error = %vq_common::error::chain(&e), "cannot dead-letter a refused held message with its reason; rejected instead");
                        d.acker
                            .nack(BasicNackOptions {
                                requeue: false,
                                ..Default::default()
                            })
                            .await
                    }
                };
                if let Err(e) = settled {
                    tracing::warn!(error = %e, "cannot settle a refused held message; the broker redelivers it");
                }
                None
            }
        }
    }

    /// Applies [`step`] to every held job; removes those dealt with.
    async fn evaluate(&self, held: &mut Vec<Held>) -> Result<(), AmqpError> {
        let steps: Vec<Step> = {
            let v = self.jobs.read().unwrap_or_else(|p| p.into_inner());
            let now = unix_now();
            held.iter()
                .map(|h| {
                    step(
                        &h.job,
                        &h.submission,
                        &h.submitter,
                        &v.table,
                        v.complete,
                        now,
                        self.grace_secs,
                    )
                })
                .collect()
        };
        let mut done = vec![false; held.len()];
        let mut result = Ok(());
        for (i, (h, s)) in held.iter().zip(steps).enumerate() {
            let r = match s {
                Step::Keep(_) => continue,
                Step::Drop(state) => {
                    tracing::info!(job_id = %h.job.id, state = state.word(), "held job already dealt with: acked");
                    Ok(())
                }
                Step::Release => self.release(h).await,
                Step::Never(why) => self.never(h, &why).await,
            };
            match r.and(ack(&h.delivery).await) {
                Ok(()) => done[i] = true,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let mut i = 0;
        held.retain(|_| {
            i += 1;
            !done[i - 1]
        });
        let mut per_pool: BTreeMap<&str, i64> =
            self.pools.iter().map(|p| (p.as_str(), 0)).collect();
        for h in held.iter() {
            *per_pool.entry(h.job.pool.as_str()).or_default() += 1;
        }
        for (pool, n) in per_pool {
            self.metrics.set_pool_held(pool, n);
        }
        result
    }

    async fn release(&self, h: &Held) -> Result<(), AmqpError> {
        let props =
            envelope::lease_copy_properties(&h.delivery.properties, &h.job.id, Some(&h.submitter))
                .with_user_id(self.user.as_str().into());
        amqp::publish_confirmed(
            &self.publish,
            &self.topo.jobs_exchange(),
            &h.job.pool,
            &h.delivery.data,
            props,
            true,
            self.confirm,
        )
        .await?;
        let event = JobEvent::queued(&h.job, &h.delivery.data, &h.submitter);
        self.publish_event(&event).await?;
        tracing::info!(job_id = %h.job.id, pool = %h.job.pool, "held job released: its dependencies are satisfied");
        Ok(())
    }

    async fn never(&self, h: &Held, why: &str) -> Result<(), AmqpError> {
        let props = envelope::dead_letter_properties(
            &h.delivery.properties,
            why,
            envelope::CONTROLLER_DEAD_BY,
            Some(&h.submitter),
        );
        amqp::publish_confirmed(
            &self.publish,
            &self.topo.dead_exchange(),
            &h.job.pool,
            &h.delivery.data,
            props,
            false,
            self.confirm,
        )
        .await?;
        let mut event = JobEvent::about(
            Some(&h.job),
            &h.job.id,
            &h.job.pool,
            "",
            Some(&h.submitter),
            JobState::Withdrawn {
                by: self.user.clone(),
                reason: Some(why.to_string()),
            },
        )
        .of_submission(&h.delivery.data);
        event.at = unix_now();
        self.publish_event(&event).await?;
        tracing::warn!(job_id = %h.job.id, pool = %h.job.pool, reason = why, "held job cancelled and dead-lettered");
        Ok(())
    }

    /// Publishes `event` (confirmed) and applies it to the table at once,
    /// so the next evaluation sees it; the stream's copy is then a
    /// duplicate by `message_id`.
    async fn publish_event(&self, event: &JobEvent) -> Result<(), AmqpError> {
        amqp::publish_confirmed(
            &self.publish,
            &self.topo.events_exchange(),
            &job_event_key(&event.pool, event.state.routing_word()),
            &event.encode(),
            amqp::event_properties(event),
            false,
            self.confirm,
        )
        .await?;
        self.jobs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .table
            .apply(event, Some(&event.message_id()));
        Ok(())
    }
}

async fn ack(d: &Delivery) -> Result<(), AmqpError> {
    d.acker
        .ack(BasicAckOptions::default())
        .await
        .map_err(AmqpError::op("ack a held job"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use vq_common::messages::{DependKind, Dependency, JobRequest, Outcome, Usage};

    use super::*;

    fn job(depend: &[(DependKind, &str)], submitted_at: u64) -> Job {
        let mut j: Job = serde_json::from_str(
            r#"{"id":"b1","name":"n","owner":"alice","pool":"p","script":"true"}"#,
        )
        .unwrap();
        j.submitted_at = submitted_at;
        j.depend = depend
            .iter()
            .map(|(kind, id)| Dependency {
                kind: *kind,
                jobs: vec![id.to_string()],
            })
            .collect();
        j
    }

    fn apply(t: &mut JobTable, id: &str, sub: &str, state: JobState) {
        let mut e = JobEvent::about(None, id, "p", "", Some("alice"), state);
        e.submission = Some(sub.into());
        t.apply(&e, Some(&e.message_id()));
    }

    #[test]
    fn a_held_job_waits_is_released_or_cancelled_and_a_handled_one_is_dropped() {
        let mut t = JobTable::new();
        apply(
            &mut t,
            "a1",
            "sa",
            JobState::Queued {
                request: JobRequest::default(),
            },
        );
        let b = job(&[(DependKind::AfterOk, "a1")], 1000);
        let sub = "sb";
        apply(
            &mut t,
            "b1",
            sub,
            JobState::Held {
                request: JobRequest::of(&b),
            },
        );
        assert!(matches!(
            step(&b, sub, "alice", &t, false, 1001.0, 120),
            Step::Keep(_)
        ));
        assert_eq!(
            step(&b, sub, "alice", &t, true, 1001.0, 120),
            Step::Keep("held: afterok a1 not finished".into())
        );
        apply(&mut t, "a1", "sa", JobState::Started);
        apply(
            &mut t,
            "a1",
            "sa",
            JobState::Finished {
                outcome: Outcome::Exited { code: 0 },
                usage: Usage::default(),
            },
        );
        assert_eq!(step(&b, sub, "alice", &t, true, 1001.0, 120), Step::Release);
        // Released (its queued event applied): a redelivery is dropped.
        apply(
            &mut t,
            "b1",
            sub,
            JobState::Queued {
                request: JobRequest::of(&b),
            },
        );
        assert_eq!(
            step(&b, sub, "alice", &t, true, 1001.0, 120),
            Step::Drop(State::Queued)
        );
        // Another submission under the same id is not this one.
        assert_eq!(
            step(&b, "other", "alice", &t, true, 1001.0, 120),
            Step::Release
        );

        let c = job(&[(DependKind::AfterNotOk, "a1")], 1000);
        assert_eq!(
            step(&c, "sc", "alice", &t, true, 1001.0, 120),
            Step::Never("dependency afternotok:a1 can never be satisfied: a1 exited 0".into())
        );
        // A cancelled held job is dropped.
        apply(
            &mut t,
            "c1",
            "sc",
            JobState::Held {
                request: JobRequest::of(&c),
            },
        );
        apply(
            &mut t,
            "c1",
            "sc",
            JobState::Withdrawn {
                by: "alice".into(),
                reason: None,
            },
        );
        let mut c1 = c.clone();
        c1.id = "c1".into();
        assert_eq!(
            step(&c1, "sc", "alice", &t, true, 1001.0, 120),
            Step::Drop(State::Cancelled)
        );
    }

    #[test]
    fn an_unknown_dependency_is_cancelled_only_after_the_grace() {
        let t = JobTable::new();
        let d = job(&[(DependKind::AfterAny, "nosuch")], 1000);
        assert!(
            matches!(step(&d, "s", "alice", &t, true, 1119.0, 120), Step::Keep(w) if w.contains("unknown"))
        );
        assert!(matches!(
            step(&d, "s", "alice", &t, true, 1120.0, 120),
            Step::Never(w) if w.contains("afterany:nosuch can never be satisfied")
        ));
    }
}
