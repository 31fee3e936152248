//! [`subscribe`]: the one exclusive-subscribe sequence of every listener.

use std::time::Duration;

use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Channel;

use super::declare::bind_queue;
use super::{bounded, AmqpError};

/// Bound on the whole of [`subscribe`] (declare, bind, consume).
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(15);

/// Subscribes to `exchange` with each of `keys`: declares the exclusive,
/// auto-delete queue `queue` (`""`: a server-named `amq.gen-…` queue),
/// binds it with every key and consumes it without acks as the only
/// consumer, tag `consumer_tag` (`""`: server-chosen). The queue lives as
/// long as the connection: for listeners that must not leave a queue
/// behind (the controller's agent events, an agent's control queue, the
/// CLI's and the tests' event taps). The whole sequence is bounded by
/// [`SUBSCRIBE_TIMEOUT`].
///
/// # Errors
/// [`AmqpError::Declare`] naming the queue or the binding (403 when the
/// account may not declare or bind it, 405 RESOURCE_LOCKED when another
/// connection holds the exclusive queue), [`AmqpError::Op`] for the
/// consume, [`AmqpError::Timeout`].
pub async fn subscribe(
    ch: &Channel,
    queue: &str,
    exchange: &str,
    keys: &[&str],
    consumer_tag: &str,
) -> Result<lapin::Consumer, AmqpError> {
    let what = format!("subscribe to {exchange} ({})", keys.join(", "));
    bounded(&what, SUBSCRIBE_TIMEOUT, async {
        let declared = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| AmqpError::Declare {
                name: if queue.is_empty() {
                    format!("a server-named queue for {exchange}")
                } else {
                    queue.into()
                },
                source,
            })?;
        let name = declared.name().clone();
        for key in keys {
            bind_queue(ch, name.as_str(), exchange, key).await?;
        }
        ch.basic_consume(
            name.clone(),
            consumer_tag.into(),
            BasicConsumeOptions {
                no_ack: true,
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::op(format!("consume {name}")))
    })
    .await
}

/// Consumes the stream queue `queue` (RabbitMQ 3.9+) from its first
/// retained message (`x-stream-offset = first`) with manual acks and
/// prefetch `prefetch` (the broker requires both for a stream; acks only
/// grant credit, they remove nothing), consumer tag `consumer_tag`, on
/// `ch` (which it sets the prefetch of). Bounded by [`SUBSCRIBE_TIMEOUT`].
///
/// # Errors
/// [`AmqpError::Op`] (a missing stream is 404 NOT_FOUND, which closes
/// `ch`), [`AmqpError::Timeout`].
pub async fn consume_stream_from_first(
    ch: &Channel,
    queue: &str,
    consumer_tag: &str,
    prefetch: u16,
) -> Result<lapin::Consumer, AmqpError> {
    use lapin::options::BasicQosOptions;
    use lapin::types::{AMQPValue, LongString};
    bounded(
        &format!("consume the stream {queue}"),
        SUBSCRIBE_TIMEOUT,
        async {
            ch.basic_qos(prefetch, BasicQosOptions::default())
                .await
                .map_err(AmqpError::op("basic.qos"))?;
            let mut args = FieldTable::default();
            args.insert(
                "x-stream-offset".into(),
                AMQPValue::LongString(LongString::from("first")),
            );
            ch.basic_consume(
                queue.into(),
                consumer_tag.into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .map_err(AmqpError::op("basic.consume"))
        },
    )
    .await
}
