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
//! The consumer runs apart from the reconcile cycle and holds the table's
//! read lock only while it copies out one page.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{BasicProperties, Channel, Connection};
use vq_common::amqp::{self, AmqpError};
use vq_common::jobs::{answer, JobPage, Visibility};
use vq_common::messages::Message;
use vq_common::topology::Topology;

use super::feed::SharedJobs;

/// Bound of publishing one answer (an answer the broker does not take in
/// this time, e.g. during a memory alarm, is dropped: the requester times
/// out and says so).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts answering queries on `conn` from `jobs` with the rule `vis`.
///
/// # Errors
/// [`AmqpError`] if the channel, the queue, its binding or the consumer
/// cannot be set up.
pub async fn start(
    conn: &Connection,
    topo: &Topology,
    jobs: SharedJobs,
    vis: Arc<Visibility>,
) -> Result<tokio::task::JoinHandle<()>, AmqpError> {
    let ch = conn
        .create_channel()
        .await
        .map_err(AmqpError::op("channel.open (job queries)"))?;
    let key = topo.job_query_key();
    let consumer = amqp::subscribe(
        &ch,
        "",
        &topo.control_exchange(),
        &[key.as_str()],
        "vq-controller-queries",
    )
    .await?;
    Ok(tokio::spawn(serve(
        consumer,
        ch,
        topo.replies_exchange(),
        jobs,
        vis,
    )))
}

/// Whether `reply_to` names a reply queue the controller answers to: a
/// server-named queue (`amq.gen-…`), which only its declaring connection
/// can consume.
pub fn valid_reply_to(reply_to: &str) -> bool {
    reply_to.starts_with("amq.gen-") && reply_to.len() <= 255
}

async fn serve(
    mut consumer: lapin::Consumer,
    ch: Channel,
    replies: String,
    jobs: SharedJobs,
    vis: Arc<Visibility>,
) {
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
        let page: JobPage = {
            let v = jobs.read().unwrap_or_else(|p| p.into_inner());
            answer(
                &v.table,
                v.complete,
                &vis,
                user_id.as_deref(),
                &delivery.data,
            )
        };
        tracing::debug!(
            requester = user_id.as_deref().unwrap_or("-"),
            rows = page.jobs.len(),
            complete = page.complete,
            error = page.error.as_deref().unwrap_or(""),
            "job query answered"
        );
        let mut out: BasicProperties = amqp::json_properties::<JobPage>().with_delivery_mode(1);
        if let Some(c) = props.correlation_id() {
            out = out.with_correlation_id(c.clone());
        }
        if let Err(e) = amqp::publish_confirmed(
            &ch,
            &replies,
            &reply_to,
            &page.encode(),
            out,
            false,
            REPLY_TIMEOUT,
        )
        .await
        {
            tracing::warn!(error = %vq_common::error::chain(&e), "cannot answer a job query");
            if !ch.status().connected() {
                break;
            }
        }
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
