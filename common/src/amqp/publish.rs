//! Publishing: a channel in confirm mode, the properties of vq's JSON
//! messages and publishing with a publisher confirm, alarm-aware or not.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use super::{bounded, AmqpError};
use crate::messages::{JobEvent, Message, SCHEMA_HEADER, SCHEMA_VERSION};

/// Opens a channel with publisher confirms enabled.
///
/// # Errors
/// [`AmqpError::Op`] or [`AmqpError::Timeout`] (10 s).
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, AmqpError> {
    bounded("open channel", Duration::from_secs(10), async {
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::op("confirm.select"))?;
        Ok(ch)
    })
    .await
}

/// Properties of a job event: [`json_properties`] plus its stable
/// `message_id` ([`JobEvent::message_id`]), on which consumers deduplicate.
pub fn event_properties(event: &JobEvent) -> BasicProperties {
    json_properties::<JobEvent>().with_message_id(event.message_id().into())
}

/// Properties of a JSON message of type `M`: content type, schema header,
/// persistent delivery mode, current timestamp.
pub fn json_properties<M: Message>() -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(SCHEMA_HEADER.into(), AMQPValue::LongUInt(SCHEMA_VERSION));
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_type(M::KIND.into())
        .with_timestamp(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        )
        .with_headers(headers)
}

/// Publishes `body` with `props` and waits for the publisher confirm (the
/// channel must be in confirm mode). With `mandatory`, an unroutable message
/// is an error.
///
/// # Errors
/// [`AmqpError::Nacked`], [`AmqpError::Unroutable`], [`AmqpError::Publish`]
/// or [`AmqpError::Timeout`] after `timeout`.
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    mandatory: bool,
    timeout: Duration,
) -> Result<(), AmqpError> {
    let what = format!("publish to {exchange:?} key {routing_key:?}");
    let publish_err = |source| AmqpError::Publish {
        exchange: exchange.into(),
        routing_key: routing_key.into(),
        source: Box::new(source),
    };
    let confirmation = bounded(&what, timeout, async {
        let pending = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory,
                    ..Default::default()
                },
                body,
                props,
            )
            .await
            .map_err(publish_err)?;
        pending.await.map_err(publish_err)
    })
    .await?;
    match confirmation {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(AmqpError::Unroutable {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            reply: returned.reply_text.to_string(),
        }),
        Confirmation::Nack(_) => Err(AmqpError::Nacked {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }),
    }
}

/// How often [`publish_confirmed_patiently`] re-checks `blocked` and the
/// channel.
const BLOCKED_POLL: Duration = Duration::from_millis(250);

/// [`publish_confirmed`] on a connection the broker may block during a
/// memory or disk alarm (`connection.blocked`,
/// <https://www.rabbitmq.com/docs/connection-blocked>); `blocked()` says
/// whether it is blocked now.
///
/// Waits while blocked before publishing, and counts only unblocked time
/// towards `timeout` while waiting for the confirm: a message written into
/// a blocked connection is still read by the broker after the alarm (even
/// after the client has gone), so giving up and sending it again, or
/// treating it as not sent, would duplicate it. It therefore does not
/// return while `blocked()` stays true and the channel stays open: bound
/// it from outside where that matters (the controller's one shutdown
/// deadline, `--shutdown-grace-secs`, bounds the cycle in flight).
///
/// # Errors
/// As [`publish_confirmed`]; [`AmqpError::Timeout`] also when the channel
/// closes while waiting.
#[allow(clippy::too_many_arguments)]
pub async fn publish_confirmed_patiently(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    mandatory: bool,
    timeout: Duration,
    blocked: &(dyn Fn() -> bool + Send + Sync),
) -> Result<(), AmqpError> {
    let gone = || AmqpError::Timeout {
        what: format!("publish to {exchange:?} key {routing_key:?} (channel closed)"),
        secs: 0,
    };
    while blocked() {
        if !ch.status().connected() {
            return Err(gone());
        }
        tokio::time::sleep(BLOCKED_POLL).await;
    }
    // The real bound is counted below; this one only avoids an Instant
    // overflow.
    let no_bound = Duration::from_secs(365 * 24 * 3600);
    let publish = publish_confirmed(ch, exchange, routing_key, body, props, mandatory, no_bound);
    tokio::pin!(publish);
    let mut unblocked_wait = Duration::ZERO;
    loop {
        tokio::select! {
            r = &mut publish => return r,
            _ = tokio::time::sleep(BLOCKED_POLL) => {
                if !ch.status().connected() {
                    return Err(gone());
                }
                if !blocked() {
                    unblocked_wait += BLOCKED_POLL;
                }
                if unblocked_wait >= timeout {
                    return Err(AmqpError::Timeout {
                        what: format!("publish to {exchange:?} key {routing_key:?}"),
                        secs: timeout.as_secs(),
                    });
                }
            }
        }
    }
}

/// Publishes message `msg` as JSON (see [`json_properties`]) with a confirm.
/// Neither daemon uses it (they need `user_id`, `message_id` or alarm
/// awareness); it is the one-call publish for Rust bridges and for tests
/// (`common/tests/topology_broker.rs`, `controller/tests/cli_submit.rs`).
///
/// # Errors
/// As [`publish_confirmed`].
pub async fn publish_message<M: Message>(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    msg: &M,
    mandatory: bool,
    timeout: Duration,
) -> Result<(), AmqpError> {
    publish_confirmed(
        ch,
        exchange,
        routing_key,
        &msg.encode(),
        json_properties::<M>(),
        mandatory,
        timeout,
    )
    .await
}
