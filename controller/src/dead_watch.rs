//! The dead-letter watch (README.md, dead letters): every dead letter is
//! copied into `<c>.dead.watch`; for each one RabbitMQ made itself
//! (delivery limit, TTL, rejection: `x-death`, no `x-vq-reason`) the
//! controller publishes the job's `failed` event (message id
//! `<job_id>.failed`), confirmed, then acks. Agents and the fence publish
//! their own dead letters' events.

use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel, Consumer};
use vq_common::amqp::{self, header_str};
use vq_common::messages::{Job, JobEvent, JobState, Message, REASON_HEADER, SUBMITTER_HEADER};
use vq_common::topology::{job_event_key, Topology};

use crate::events::Shared;
use crate::metrics::{failure_reason, Metrics};

/// The `failed` event of a dead letter RabbitMQ made itself: its
/// `x-death` header (most recent death first; else the
/// `x-first-death-*` headers) names the reason and the queue. `None` for
/// dead letters vq made (they carry [`REASON_HEADER`], and their maker
/// publishes the event) and for letters without any death record.
///
/// The job fields come from the body; an undecodable body still gets an
/// event for its AMQP `message_id` (pool from the queue name), and a
/// letter with neither gets `None`.
pub fn broker_dead_letter_event(
    topo: &Topology,
    props: &BasicProperties,
    body: &[u8],
    at: f64,
) -> Option<JobEvent> {
    if header_str(props, REASON_HEADER).is_some() {
        return None;
    }
    let headers = props.headers().as_ref()?;
    let text = |v: &AMQPValue| match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    };
    let latest = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().iter().find_map(|d| match d {
            AMQPValue::FieldTable(t) => Some(t.clone()),
            _ => None,
        }),
        _ => None,
    };
    let (reason, queue) = match &latest {
        Some(t) => (
            t.inner().get("reason").and_then(text),
            t.inner().get("queue").and_then(text),
        ),
        None => (
            header_str(props, "x-first-death-reason"),
            header_str(props, "x-first-death-queue"),
        ),
    };
    let reason = reason?;
    let queue = queue.unwrap_or_default();
    let why = match reason.as_str() {
        "delivery_limit" => format!(
            " (redelivered more than {} times)",
            vq_common::topology::POOL_DELIVERY_LIMIT
        ),
        "expired" => " (its message TTL ran out before an agent took it)".into(),
        "rejected" => " (rejected without requeue)".into(),
        "maxlen" => " (the queue was over its length limit)".into(),
        _ => String::new(),
    };
    let reason = format!("dead-lettered by RabbitMQ: {reason}{why} from queue {queue}");
    let submitter = header_str(props, SUBMITTER_HEADER)
        .or_else(|| props.user_id().as_ref().map(|u| u.to_string()));
    let (job_id, job_name, owner, pool) = match Job::decode(body) {
        Ok(j) => (j.id, j.name, j.owner, j.pool),
        Err(_) => {
            let id = props.message_id().as_ref()?.to_string();
            let prefix = format!("{}.", topo.jobs_exchange());
            let pool = queue.strip_prefix(&prefix).unwrap_or_default().to_string();
            (id, String::new(), String::new(), pool)
        }
    };
    let mut event = JobEvent::about(
        None,
        &job_id,
        &pool,
        "",
        submitter.as_deref(),
        JobState::Failed { reason },
    )
    .of_submission(body);
    event.job_name = job_name;
    event.owner = owner;
    event.at = at;
    Some(event)
}

/// The `pool` and bounded `reason` labels of a dead letter
/// ([`crate::metrics::failure_reason`] of its reason: RabbitMQ's for those
/// it made, `event` being their `failed` event; vq's [`REASON_HEADER`]
/// for the others). The pool is empty when the body is no job.
pub fn dead_letter_labels(
    event: Option<&JobEvent>,
    props: &BasicProperties,
    body: &[u8],
) -> (String, &'static str) {
    if let Some(JobEvent {
        pool,
        state: JobState::Failed { reason },
        ..
    }) = event
    {
        return (pool.clone(), failure_reason(reason));
    }
    let pool = Job::decode(body).map(|j| j.pool).unwrap_or_default();
    let reason = header_str(props, REASON_HEADER).map_or("unknown", |r| failure_reason(&r));
    (pool, reason)
}

/// Consumes `<c>.dead.watch`: publishes the `failed` event of every dead
/// letter RabbitMQ made ([`broker_dead_letter_event`]) on `publish`
/// (confirmed, AMQP `message_id` `<job_id>.failed`, so a redelivered watch
/// message yields a duplicate consumers drop), then acks. A publish that
/// fails leaves the message unacked and ends the task (the next cycle
/// reconnects, and the message is delivered again).
pub(crate) async fn watch_dead_letters(
    mut consumer: Consumer,
    _ch: Channel,
    publish: Channel,
    topo: Topology,
    confirm: Duration,
    shared: Arc<StdMutex<Shared>>,
    metrics: Arc<Metrics>,
) {
    let blocked = move || {
        shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .blocked
            .is_some()
    };
    while let Some(delivery) = consumer.next().await {
        let d = match delivery {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "dead-letter consumer failed");
                break;
            }
        };
        let event = broker_dead_letter_event(
            &topo,
            &d.properties,
            &d.data,
            vq_common::messages::unix_now(),
        );
        let (pool, reason) = dead_letter_labels(event.as_ref(), &d.properties, &d.data);
        metrics
            .jobs_dead_lettered
            .get_or_create(&Metrics::pool_and(&pool, "reason", reason))
            .inc();
        match event {
            Some(event) => {
                let props = amqp::event_properties(&event);
                let sent = amqp::publish_confirmed_patiently(
                    &publish,
                    &topo.events_exchange(),
                    &job_event_key(&event.pool, "failed"),
                    &event.encode(),
                    props,
                    false,
                    confirm,
                    &blocked,
                )
                .await;
                if let Err(e) = sent {
                    tracing::warn!(job_id = %event.job_id, error = %e, "cannot publish the failed event of a dead letter; it is handled again after reconnecting");
                    break;
                }
                let reason = match &event.state {
                    JobState::Failed { reason } => reason.as_str(),
                    _ => "",
                };
                tracing::warn!(pool = %event.pool, job_id = %event.job_id, reason, "job dead-lettered by RabbitMQ: failed event published");
            }
            None => {
                if header_str(&d.properties, REASON_HEADER).is_none() {
                    tracing::warn!(message_id = ?d.properties.message_id(), "dead letter without a death record, job id or vq reason: no event");
                }
            }
        }
        if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
            tracing::warn!(error = %e, "cannot ack a dead-letter copy");
            break;
        }
    }
    tracing::warn!("dead-letter consumer ended; it restarts with the next broker connection");
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldTable;

    fn job(rerunnable: bool) -> Job {
        let mut j: Job = serde_json::from_str(
            r#"{"id":"7.x","name":"n","owner":"alice","pool":"cms","script":"true","submit_host":"h","submitted_at":0}"#,
        )
        .unwrap();
        j.rerunnable = rerunnable;
        j
    }

    #[test]
    fn dead_letters_made_by_rabbitmq_get_a_failed_event_and_vq_s_own_do_not() {
        let topo = Topology::new("vq");
        let mut death = FieldTable::default();
        death.insert("reason".into(), AMQPValue::LongString("expired".into()));
        death.insert("queue".into(), AMQPValue::LongString("vq.jobs.cms".into()));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        let props = BasicProperties::default()
            .with_headers(h.clone())
            .with_user_id("alice".into());
        let body = job(true).encode();
        let e = broker_dead_letter_event(&topo, &props, &body, 1.0).unwrap();
        assert_eq!((e.job_id.as_str(), e.pool.as_str()), ("7.x", "cms"));
        assert_eq!(
            dead_letter_labels(Some(&e), &props, &body),
            ("cms".to_string(), "rabbitmq-expired")
        );
        assert_eq!(e.submitter.as_deref(), Some("alice"));
        let JobState::Failed { reason } = &e.state else {
            panic!("{e:?}")
        };
        assert!(
            reason.starts_with("dead-lettered by RabbitMQ: expired"),
            "{reason}"
        );
        assert!(reason.ends_with("from queue vq.jobs.cms"), "{reason}");
        // An undecodable body: the message id names it.
        let p2 = props.clone().with_message_id("m1".into());
        let e = broker_dead_letter_event(&topo, &p2, b"junk", 1.0).unwrap();
        assert_eq!((e.job_id.as_str(), e.pool.as_str()), ("m1", "cms"));
        assert!(broker_dead_letter_event(&topo, &props, b"junk", 1.0).is_none());
        // vq's own dead letters are reported by whoever made them.
        let mut own = h;
        own.insert(
            REASON_HEADER.into(),
            AMQPValue::LongString("refused".into()),
        );
        let p3 = BasicProperties::default().with_headers(own);
        assert!(broker_dead_letter_event(&topo, &p3, &body, 1.0).is_none());
        assert_eq!(
            dead_letter_labels(None, &p3, &body),
            ("cms".to_string(), "refused")
        );
        assert!(broker_dead_letter_event(&topo, &BasicProperties::default(), &body, 1.0).is_none());
    }
}
