//! Publishing: job events, dead letters, heartbeats and answers, each with a
//! publisher confirm. Results that must not be lost are retried across
//! reconnects until the broker confirms them.

use std::time::Duration;

use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{BasicProperties, Channel};
use tokio::sync::watch;
use tracing::warn;
use vq_common::amqp::{json_properties, publish_confirmed, AmqpError};
use vq_common::messages::{
    unix_now, Job, JobEvent, JobState, Message, DEAD_BY_HEADER, REASON_HEADER,
};

/// Header on dead-lettered jobs naming the broker user that submitted them
/// (the original `user_id` cannot be republished: the broker validates it
/// against the agent's own account).
pub const SUBMITTER_HEADER: &str = "x-vq-submitter";

/// Pause between attempts of a publish that must not be lost.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Publishes on the current session's confirm channel.
#[derive(Debug, Clone)]
pub struct Publisher {
    channel: watch::Receiver<Option<Channel>>,
    timeout: Duration,
}

impl Publisher {
    /// A publisher following `channel` (set by the session loop, `None`
    /// while disconnected), waiting `timeout` for each confirm.
    pub fn new(channel: watch::Receiver<Option<Channel>>, timeout: Duration) -> Self {
        Publisher { channel, timeout }
    }

    /// Publishes once; fails at once when not connected.
    ///
    /// # Errors
    /// [`AmqpError`] from the publish, or `Timeout` when not connected.
    pub async fn publish_once(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), AmqpError> {
        let ch = self.channel.borrow().clone();
        let Some(ch) = ch else {
            return Err(AmqpError::Timeout {
                what: "waiting for a broker connection".into(),
                secs: 0,
            });
        };
        publish_confirmed(&ch, exchange, key, body, props, false, self.timeout).await
    }

    /// Publishes until the broker confirms, waiting for reconnects. Never
    /// gives up: the caller's task is dropped on a forced exit.
    pub async fn publish_reliably(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) {
        let mut rx = self.channel.clone();
        loop {
            let ch = match rx.wait_for(|c| c.is_some()).await {
                Ok(c) => c.clone(),
                Err(_) => return, // the session loop is gone: shutting down
            };
            let Some(ch) = ch else { continue };
            match publish_confirmed(&ch, exchange, key, body, props.clone(), false, self.timeout)
                .await
            {
                Ok(()) => return,
                Err(e) => {
                    warn!(exchange, key, error = %crate::error::chain(&e), "publish failed; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Publishes message `msg` until confirmed (see
    /// [`Publisher::publish_reliably`]).
    pub async fn publish_message_reliably<M: Message>(&self, exchange: &str, key: &str, msg: &M) {
        self.publish_reliably(exchange, key, &msg.encode(), json_properties::<M>())
            .await;
    }
}

/// A job event for `job` (or, for an undecodable body, for `job_id`).
pub fn job_event(
    job: Option<&Job>,
    job_id: &str,
    pool: &str,
    agent: &str,
    state: JobState,
) -> JobEvent {
    JobEvent {
        schema: vq_common::messages::SCHEMA_VERSION,
        job_id: job.map_or_else(|| job_id.to_string(), |j| j.id.clone()),
        job_name: job.map(|j| j.name.clone()).unwrap_or_default(),
        owner: job.map(|j| j.owner.clone()).unwrap_or_default(),
        pool: pool.into(),
        agent: agent.into(),
        at: unix_now(),
        state,
    }
}

/// Properties for dead-lettering a delivery: the original properties except
/// `user_id` (moved to [`SUBMITTER_HEADER`]) and `expiration`, plus
/// [`REASON_HEADER`] and [`DEAD_BY_HEADER`].
pub fn dead_letter_properties(
    orig: &BasicProperties,
    reason: &str,
    agent: &str,
) -> BasicProperties {
    let mut headers = orig.headers().clone().unwrap_or_default();
    headers.insert(
        REASON_HEADER.into(),
        AMQPValue::LongString(LongString::from(reason)),
    );
    headers.insert(
        DEAD_BY_HEADER.into(),
        AMQPValue::LongString(LongString::from(agent)),
    );
    if let Some(user) = orig.user_id() {
        headers.insert(
            SUBMITTER_HEADER.into(),
            AMQPValue::LongString(LongString::from(user.as_str())),
        );
    }
    let mut p = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(orig.delivery_mode().unwrap_or(2));
    let copy = |v: &Option<ShortString>| v.clone();
    if let Some(v) = copy(orig.content_type()) {
        p = p.with_content_type(v);
    }
    if let Some(v) = copy(orig.content_encoding()) {
        p = p.with_content_encoding(v);
    }
    if let Some(v) = *orig.priority() {
        p = p.with_priority(v);
    }
    if let Some(v) = copy(orig.correlation_id()) {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = copy(orig.reply_to()) {
        p = p.with_reply_to(v);
    }
    if let Some(v) = copy(orig.message_id()) {
        p = p.with_message_id(v);
    }
    if let Some(v) = *orig.timestamp() {
        p = p.with_timestamp(v);
    }
    if let Some(v) = copy(orig.kind()) {
        p = p.with_type(v);
    }
    if let Some(v) = copy(orig.app_id()) {
        p = p.with_app_id(v);
    }
    p
}
