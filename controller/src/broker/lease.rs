//! Fencing a lost agent's leases (DESIGN.md, "Leases"): once its server is
//! gone, [`Broker::fence`] reads every lease copy of its lease queue,
//! drops those whose job already has a final result or whose claim never
//! held the job, returns rerunnable jobs to their pool (loss counter + 1)
//! and fails the others (`job.failed` and a dead letter) as
//! [`lease_fate`] says, then deletes the lease queue and the agent's
//! registry and fence entries.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use vq_common::amqp::{
    self, bounded, envelope, header_str, header_u32, with_header_u32, AmqpError,
};
use vq_common::messages::{Job, JobEvent, JobState, Message, SUBMITTER_HEADER};
use vq_common::topology::{job_event_key, CLAIM_HEADER, LOSSES_HEADER};

use super::{Broker, OP_TIMEOUT};

impl Broker {
    /// Empties `agent`'s lease queue (see the module doc), deletes it and
    /// removes `agent` from the fence queue. Call it only when the agent's
    /// server is gone (deleted), so no job runs twice. Idempotent.
    ///
    /// # Errors
    /// [`AmqpError`]; what was done stays done, the rest is retried on the
    /// next call.
    pub async fn fence(&self, agent: &str, loss_limit: u32) -> Result<FenceReport, AmqpError> {
        let ch = self.fresh_channel().await?;
        let r = self.fence_on(&ch, agent, loss_limit).await;
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "fenced".into())).await;
        if r.is_ok() {
            self.shared_lock().agents.remove(agent);
        }
        r
    }

    async fn fence_on(
        &self,
        ch: &Channel,
        agent: &str,
        loss_limit: u32,
    ) -> Result<FenceReport, AmqpError> {
        let lease = self.topo.lease_queue(agent);
        // Declaring (not passively) never fails on a missing queue.
        amqp::declare_lease_queue(ch, &self.topo, agent).await?;
        let confirm = Duration::from_secs(self.cfg.confirm_timeout_secs);
        let submitter = self.user();
        let mut report = FenceReport::default();
        // Read every lease first (held unacked), then look up which of them
        // already have a final result: an agent that died between
        // publishing its result and releasing the lease must not get its
        // job run again.
        let mut leases = Vec::new();
        loop {
            let got = bounded("read a lease", OP_TIMEOUT, async {
                ch.basic_get(lease.as_str().into(), BasicGetOptions { no_ack: false })
                    .await
                    .map_err(AmqpError::op("basic.get lease"))
            })
            .await?;
            let Some(m) = got else { break };
            leases.push(m.delivery);
            if leases.len() > 10_000 {
                break;
            }
        }
        let done = if leases.is_empty() {
            std::collections::BTreeSet::new()
        } else {
            let since = leases
                .iter()
                .filter_map(|d| *d.properties.timestamp())
                .min()
                .unwrap_or(0);
            let ids: std::collections::BTreeSet<String> =
                leases.iter().filter_map(lease_job_id).collect();
            self.final_results_since(since.saturating_sub(60), &ids)
                .await?
        };
        for d in leases {
            if let Some(id) = lease_job_id(&d).filter(|id| done.contains(id)) {
                tracing::info!(agent, job_id = %id, "lease of a job whose result was already published: dropped");
                ack_lease(&d).await?;
                continue;
            }
            if let Some(claim) = header_str(&d.properties, CLAIM_HEADER) {
                // Only a copy whose claim marker names it is the job's
                // claim; any other is a copy the agent made while a
                // connection was lost, of a job that is elsewhere.
                let id = lease_job_id(&d).unwrap_or_default();
                let marker_ch = self.fresh_channel().await?;
                let marker =
                    amqp::claim_marker(&marker_ch, &self.topo, &id, agent, &claim, false).await;
                let _ =
                    tokio::time::timeout(OP_TIMEOUT, marker_ch.close(200, "looked".into())).await;
                if vq_common::lease::leftover(marker?) == vq_common::lease::Leftover::Discard {
                    tracing::info!(agent, job_id = %id, "lease copy of a claim that never held the job: dropped");
                    ack_lease(&d).await?;
                    continue;
                }
            }
            let losses = header_u32(&d.properties, LOSSES_HEADER).saturating_add(1);
            let decoded = Job::decode(&d.data);
            let job_id = envelope::job_id(decoded.as_ref().ok(), &d.properties).unwrap_or_default();
            if let Some(reason) = self.blocked() {
                // Nothing of this lease is written yet: stop here; the
                // channel's close returns it and the rest to the queue.
                return Err(AmqpError::Timeout {
                    what: format!(
                        "fence of {agent} paused: the broker blocks publishing ({reason})"
                    ),
                    secs: 0,
                });
            }
            let blocked = || self.blocked().is_some();
            match lease_fate(decoded.as_ref().ok(), agent, losses, loss_limit) {
                LeaseFate::Requeue { pool } => {
                    // The job's claim marker goes first, or the requeued
                    // copy would be taken for a copy of a claimed job. A
                    // not-rerunnable job's marker stays (until its TTL), so
                    // that a stray copy of it never runs.
                    self.delete_claim_marker(ch, &job_id).await?;
                    let mut props = with_header_u32(d.properties.clone(), LOSSES_HEADER, losses);
                    props = props.with_user_id(submitter.into());
                    amqp::publish_confirmed_patiently(
                        ch,
                        &self.topo.jobs_exchange(),
                        &pool,
                        &d.data,
                        props,
                        true,
                        confirm,
                        &blocked,
                    )
                    .await?;
                    tracing::warn!(agent, job_id = %job_id, pool = %pool, losses, "fenced agent's job returned to its pool");
                    report.requeued.push((job_id, pool));
                }
                LeaseFate::Fail { reason } => {
                    let pool = decoded.as_ref().map(|j| j.pool.clone()).unwrap_or_default();
                    let props = dead_props(&d.properties, &reason, losses);
                    amqp::publish_confirmed_patiently(
                        ch,
                        &self.topo.dead_exchange(),
                        &pool,
                        &d.data,
                        props,
                        false,
                        confirm,
                        &blocked,
                    )
                    .await?;
                    if let Ok(job) = &decoded {
                        let submitter = header_str(&d.properties, SUBMITTER_HEADER);
                        let mut event = JobEvent::about(
                            Some(job),
                            &job.id,
                            &job.pool,
                            agent,
                            submitter.as_deref(),
                            JobState::Failed {
                                reason: reason.clone(),
                            },
                        )
                        .of_submission(&d.data);
                        event.attempt = losses;
                        amqp::publish_confirmed_patiently(
                            ch,
                            &self.topo.events_exchange(),
                            &job_event_key(&job.pool, "failed"),
                            &event.encode(),
                            amqp::event_properties(&event),
                            false,
                            confirm,
                            &blocked,
                        )
                        .await?;
                    }
                    tracing::warn!(agent, job_id = %job_id, reason = %reason, "fenced agent's job failed and dead-lettered");
                    report.failed.push(job_id);
                }
            }
            ack_lease(&d).await?;
        }
        // Registry entries first: an agent (wrongly fenced, alive) that
        // finds its lease queue gone registers again, and that entry must
        // survive this fence.
        self.remove_entries(ch, &self.topo.agents_queue(), agent)
            .await?;
        bounded("delete the lease queue", OP_TIMEOUT, async {
            ch.queue_delete(lease.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(AmqpError::op("delete lease queue"))
        })
        .await?;
        self.remove_entries(ch, &self.topo.fence_queue(), agent)
            .await?;
        tracing::info!(
            agent,
            requeued = report.requeued.len(),
            failed = report.failed.len(),
            "agent fenced: lease queue emptied and deleted"
        );
        Ok(report)
    }

    /// Deletes the claim marker of job `job_id` (see `vq_common::lease`);
    /// deleting a missing queue succeeds.
    async fn delete_claim_marker(&self, ch: &Channel, job_id: &str) -> Result<(), AmqpError> {
        if job_id.is_empty() {
            return Ok(());
        }
        let marker = self.topo.claim_queue(job_id);
        bounded("delete a claim marker", OP_TIMEOUT, async {
            ch.queue_delete(marker.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(AmqpError::op("delete claim marker"))
        })
        .await?;
        Ok(())
    }

    /// Job ids among `ids` with a final event (`finished`, `failed`,
    /// `cancelled`) in the job-event stream since Unix second `since`.
    async fn final_results_since(
        &self,
        since: u64,
        ids: &std::collections::BTreeSet<String>,
    ) -> Result<std::collections::BTreeSet<String>, AmqpError> {
        let ch = self.fresh_channel().await?;
        let stream = self.topo.event_log_queue();
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), AMQPValue::Timestamp(since));
        let mut consumer = bounded("read the job-event stream", OP_TIMEOUT, async {
            ch.basic_qos(500, BasicQosOptions::default())
                .await
                .map_err(AmqpError::op("basic.qos (stream)"))?;
            ch.basic_consume(
                stream.as_str().into(),
                "vq-controller-fence".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .map_err(AmqpError::op("consume the job-event stream"))
        })
        .await?;
        let mut found = std::collections::BTreeSet::new();
        let started = std::time::Instant::now();
        // A stream never ends: read until it is quiet for a moment.
        while started.elapsed() < Duration::from_secs(60) {
            match tokio::time::timeout(Duration::from_millis(700), consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    // Decoded as delivered: a submitter's `queued` route
                    // cannot pass for a final result.
                    let user_id = d.properties.user_id().as_ref().map(|u| u.as_str());
                    if let Ok(ev) =
                        JobEvent::decode_delivered(&d.data, d.routing_key.as_str(), user_id)
                    {
                        let is_final = !matches!(
                            ev.state,
                            JobState::Started | JobState::Queued { .. } | JobState::Held { .. }
                        );
                        if is_final && ids.contains(&ev.job_id) {
                            found.insert(ev.job_id);
                        }
                    }
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                }
                Ok(Some(Err(e))) => return Err(AmqpError::op("read the job-event stream")(e)),
                Ok(None) | Err(_) => break,
            }
        }
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "read".into())).await;
        Ok(found)
    }
}

/// What fencing one agent did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FenceReport {
    /// Jobs returned to their pool: (job id, pool).
    pub requeued: Vec<(String, String)>,
    /// Job ids reported failed and dead-lettered.
    pub failed: Vec<String>,
}

/// The lease-fate rule, shared with the agent's own recovery.
pub use vq_common::lease::{fate as lease_fate, LeaseFate};

fn lease_job_id(d: &lapin::message::Delivery) -> Option<String> {
    envelope::job_id_of(&d.properties, &d.data)
}

/// Acks lease copy `d`: it is dealt with (requeued, failed or dropped).
async fn ack_lease(d: &lapin::message::Delivery) -> Result<(), AmqpError> {
    bounded("ack a lease", OP_TIMEOUT, async {
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(AmqpError::op("ack lease"))
    })
    .await?;
    Ok(())
}

/// The dead letter of a fenced agent's lease copy with properties
/// `lease`: the common envelope ([`envelope::dead_letter_properties`]),
/// dead by `vq-controller`, the submitter the agent judged the job by (its
/// lease copy's [`SUBMITTER_HEADER`], written by the agent, never the
/// original publisher's), and the loss count.
fn dead_props(lease: &BasicProperties, reason: &str, losses: u32) -> BasicProperties {
    let submitter = header_str(lease, SUBMITTER_HEADER);
    let props = envelope::dead_letter_properties(
        lease,
        reason,
        envelope::CONTROLLER_DEAD_BY,
        submitter.as_deref(),
    );
    with_header_u32(props, LOSSES_HEADER, losses)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(rerunnable: bool) -> Job {
        let mut j: Job = serde_json::from_str(
            r#"{"id":"7.x","name":"n","owner":"alice","pool":"cms","script":"true","submit_host":"h","submitted_at":0}"#,
        )
        .unwrap();
        j.rerunnable = rerunnable;
        j
    }

    #[test]
    fn leases_of_lost_agents_are_requeued_until_the_loss_limit() {
        assert_eq!(
            lease_fate(Some(&job(true)), "a1", 1, 3),
            LeaseFate::Requeue { pool: "cms".into() }
        );
        assert_eq!(
            lease_fate(Some(&job(true)), "a1", 2, 3),
            LeaseFate::Requeue { pool: "cms".into() }
        );
        match lease_fate(Some(&job(true)), "a1", 3, 3) {
            LeaseFate::Fail { reason } => assert!(reason.contains("3 times"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match lease_fate(Some(&job(false)), "a1", 1, 3) {
            LeaseFate::Fail { reason } => assert!(reason.contains("node lost"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            lease_fate(None, "a1", 1, 3),
            LeaseFate::Fail { .. }
        ));
    }
}
