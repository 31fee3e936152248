//! Answers `vq stat`'s job-table queries over AMQP
//! ([`vq_common::jobs::query`]): a consumer of an exclusive server-named
//! queue bound to `<c>.control` with the key `<c>.query.jobs`, started with
//! every broker session (a consumer that ends ends the session, which is
//! then rebuilt, as for the other consumers). Each query gets one
//! [`JobPage`] published to `<c>.replies` with routing key = its
//! `reply_to` and its `correlation_id`. The requester is the delivery's
//! `user_id`, which RabbitMQ checks against the publishing connection's
//! user; a query without one gets a refusal. An answer carries the table's
//! `complete` flag: while the table is rebuilt from the stream (after a
//! start or a reconnect) the answer says so instead of waiting.
//!
//! `vq cancel`'s requests (key `<c>.query.cancel`) come through the same
//! consumer and are answered the same way with a
//! [`vq_common::jobs::cancel::CancelAnswer`]; a queued job is withdrawn
//! here (its claim marker taken, its `withdrawn` event published). Every
//! controller, leader or standby, answers: a withdrawal is idempotent
//! (the same marker, the same event `message_id`).
//!
//! `vq submit`'s question for the pools' limits (key `<c>.query.pools`,
//! [`vq_common::pools`]) comes through the same consumer too and gets a
//! [`PoolsPage`] of every configured pool's limits, whoever asks (limits
//! are not secret).
//!
//! The consumer runs apart from the reconcile cycle and holds the table's
//! read lock only while it copies out one page.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{BasicProperties, Channel, Connection};
use vq_common::amqp::{self, AmqpError};
use vq_common::jobs::cancel::{self, CancelAnswer, CancelStep, WITHDRAWN_AGENT, WITHDRAWN_CLAIM};
use vq_common::jobs::{answer, JobPage, JobRecord, Visibility};
use vq_common::lease::Marker;
use vq_common::messages::{JobEvent, JobState, Message};
use vq_common::pools::{self, PoolLimits, PoolsPage};
use vq_common::topology::{job_event_key, Topology};

use super::feed::SharedJobs;

/// Bound of publishing one answer (an answer the broker does not take in
/// this time, e.g. during a memory alarm, is dropped: the requester times
/// out and says so).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts answering queries on `conn` from `jobs` with the rule `vis`,
/// and questions for the pools' limits with `limits`.
///
/// # Errors
/// [`AmqpError`] if the channel, the queue, its binding or the consumer
/// cannot be set up.
pub async fn start(
    conn: Arc<Connection>,
    topo: &Topology,
    jobs: SharedJobs,
    vis: Arc<Visibility>,
    limits: Arc<Vec<PoolLimits>>,
) -> Result<tokio::task::JoinHandle<()>, AmqpError> {
    let ch = amqp::confirm_channel(&conn).await?;
    let key = topo.job_query_key();
    let cancel_key = topo.cancel_query_key();
    let pools_key = topo.pool_query_key();
    let consumer = amqp::subscribe(
        &ch,
        "",
        &topo.control_exchange(),
        &[key.as_str(), cancel_key.as_str(), pools_key.as_str()],
        "vq-controller-queries",
    )
    .await?;
    let answerer = Answerer {
        ch,
        conn,
        markers: None,
        topo: topo.clone(),
        jobs,
        vis,
        limits,
    };
    Ok(tokio::spawn(answerer.serve(consumer)))
}

/// Whether `reply_to` names a reply queue the controller answers to: a
/// server-named queue (`amq.gen-…`), which only its declaring connection
/// can consume.
pub fn valid_reply_to(reply_to: &str) -> bool {
    reply_to.starts_with("amq.gen-") && reply_to.len() <= 255
}

struct Answerer {
    /// Confirm channel: answers and withdrawal events.
    ch: Channel,
    conn: Arc<Connection>,
    /// Channel of claim-marker declarations (a 406 closes it), opened on
    /// first use and again after each close.
    markers: Option<Channel>,
    topo: Topology,
    jobs: SharedJobs,
    vis: Arc<Visibility>,
    limits: Arc<Vec<PoolLimits>>,
}

impl Answerer {
    async fn serve(mut self, mut consumer: lapin::Consumer) {
        let cancel_key = self.topo.cancel_query_key();
        let pools_key = self.topo.pool_query_key();
        while let Some(delivery) = consumer.next().await {
            let delivery = match delivery {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(error = %e, "job-query consumer failed");
                    break;
                }
            };
            let props = &delivery.properties;
            let Some(reply_to) = props.reply_to().as_ref().map(|r| r.to_string()) else {
                tracing::debug!("job query without reply_to dropped");
                continue;
            };
            if !valid_reply_to(&reply_to) {
                tracing::debug!(
                    reply_to,
                    "job query with a reply_to that is no amq.gen- queue dropped"
                );
                continue;
            }
            let user_id = props.user_id().as_ref().map(|u| u.to_string());
            let key = delivery.routing_key.as_str();
            let (body, kind) = if key == cancel_key {
                let answer = self.cancel(user_id.as_deref(), &delivery.data).await;
                (answer.encode(), CancelAnswer::KIND)
            } else if key == pools_key {
                let page = pools::answer(&self.limits, &delivery.data);
                tracing::debug!(
                    requester = user_id.as_deref().unwrap_or("-"),
                    pools = page.pools.len(),
                    error = page.error.as_deref().unwrap_or(""),
                    "pools query answered"
                );
                (page.encode(), PoolsPage::KIND)
            } else {
                let page = self.page(user_id.as_deref(), &delivery.data);
                (page.encode(), JobPage::KIND)
            };
            let mut out: BasicProperties = amqp::json_properties::<JobPage>()
                .with_type(kind.into())
                .with_delivery_mode(1);
            if let Some(c) = props.correlation_id() {
                out = out.with_correlation_id(c.clone());
            }
            if let Err(e) = amqp::publish_confirmed(
                &self.ch,
                &self.topo.replies_exchange(),
                &reply_to,
                &body,
                out,
                false,
                REPLY_TIMEOUT,
            )
            .await
            {
                tracing::warn!(error = %vq_common::error::chain(&e), "cannot answer a job query");
                if !self.ch.status().connected() {
                    break;
                }
            }
        }
    }

    fn page(&self, user_id: Option<&str>, body: &[u8]) -> JobPage {
        let page: JobPage = {
            let v = self.jobs.read().unwrap_or_else(|p| p.into_inner());
            let mut page = answer(&v.table, v.complete, &self.vis, user_id, body);
            page.jobs.iter_mut().for_each(|r| v.annotate(r));
            page
        };
        tracing::debug!(
            requester = user_id.unwrap_or("-"),
            rows = page.jobs.len(),
            complete = page.complete,
            error = page.error.as_deref().unwrap_or(""),
            "job query answered"
        );
        page
    }

    /// Decides and carries out a `vq cancel` request
    /// ([`vq_common::jobs::cancel`]).
    async fn cancel(&mut self, user_id: Option<&str>, body: &[u8]) -> CancelAnswer {
        let step = {
            let v = self.jobs.read().unwrap_or_else(|p| p.into_inner());
            cancel::decide(&v.table, v.complete, &self.vis, user_id, body)
        };
        let by = user_id.unwrap_or("-");
        let answer = match step {
            CancelStep::Answer(a) => a,
            CancelStep::Withdraw(job) => match self.withdraw(&job, by).await {
                Ok(a) => a,
                Err(e) => {
                    let reason = format!(
                        "the broker did not confirm the withdrawal of job {}: {}; the job may still run, cancel it again",
                        job.id,
                        vq_common::error::chain(&e)
                    );
                    tracing::warn!(job_id = %job.id, requester = by, "{reason}");
                    CancelAnswer::Refused {
                        reason,
                        kind: vq_common::jobs::cancel::Refusal::Unavailable,
                    }
                }
            },
        };
        tracing::info!(requester = by, answer = ?answer, "cancel request answered");
        answer
    }

    /// Takes the claim marker of queued job `job` for the withdrawal, then
    /// publishes (and applies to the table at once) its
    /// [`JobState::Withdrawn`] event.
    async fn withdraw(&mut self, job: &JobRecord, by: &str) -> Result<CancelAnswer, AmqpError> {
        let ch = match self.markers.as_ref().filter(|c| c.status().connected()) {
            Some(c) => c.clone(),
            None => {
                let c = self
                    .conn
                    .create_channel()
                    .await
                    .map_err(AmqpError::op("channel.open (claim markers)"))?;
                self.markers = Some(c.clone());
                c
            }
        };
        let marker = amqp::claim_marker(
            &ch,
            &self.topo,
            &job.id,
            WITHDRAWN_AGENT,
            WITHDRAWN_CLAIM,
            true,
        )
        .await?;
        if marker != Marker::Ours {
            // An agent's claim came first: its `started` is on the way.
            return Ok(CancelAnswer::Starting {
                job_id: job.id.clone(),
            });
        }
        let mut event = JobEvent::about(
            None,
            &job.id,
            &job.pool,
            "",
            None,
            JobState::Withdrawn {
                by: by.to_string(),
                reason: None,
            },
        );
        event.owner = job.owner.clone();
        event.job_name = job.name.clone();
        event.submission = job.submission.clone();
        amqp::publish_confirmed(
            &self.ch,
            &self.topo.events_exchange(),
            &job_event_key(&job.pool, event.state.routing_word()),
            &event.encode(),
            amqp::event_properties(&event),
            false,
            REPLY_TIMEOUT,
        )
        .await?;
        // The table shows `X` at once; the stream's copy of the event is
        // then a duplicate by message_id.
        self.jobs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .table
            .apply(&event, Some(&event.message_id()));
        tracing::info!(job_id = %job.id, pool = %job.pool, by, was = job.state.word(), "job withdrawn: no agent will run it");
        Ok(CancelAnswer::Withdrawn {
            job_id: job.id.clone(),
            was: job.state.word().into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_server_named_queues_get_answers() {
        assert!(valid_reply_to("amq.gen-JzTY20BRgKO-HjmUJj0wLg"));
        for bad in ["", "vq.control.agent-1", "amq.rabbitmq.reply-to", "x"] {
            assert!(!valid_reply_to(bad), "{bad}");
        }
    }
}
