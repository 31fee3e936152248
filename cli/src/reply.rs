//! Request and answer over AMQP: the CLI's exclusive reply queue.
//!
//! A request goes out with AMQP `reply_to` = the caller's server-named
//! (`amq.gen-…`) exclusive queue and a fresh `correlation_id`; whoever
//! answers publishes to `<c>.replies` (a direct exchange) with the routing
//! key = that queue's name and the same `correlation_id` (the RPC pattern
//! of RabbitMQ's tutorial 6, through a named exchange so that the
//! answerers' write permission is limited to it). Answers with another
//! correlation id (to an earlier request that timed out) are skipped.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::BasicProperties;
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Consumer};
use vq_common::amqp::{self, AmqpError};
use vq_common::topology::Topology;

use crate::error::{amqp_reply_code, CliError, NOT_FOUND};
use crate::settings::Settings;

/// How a request left: routed to a queue, or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// A queue took it; wait for the answer with this correlation id.
    Routed {
        /// The request's `correlation_id`.
        correlation: String,
    },
    /// No queue is bound for the routing key (mandatory publish came back).
    Unroutable,
}

/// The caller's reply queue and its consumer.
pub struct Replies {
    ch: Channel,
    queue: ShortString,
    consumer: Consumer,
    cluster: String,
}

impl Replies {
    /// Declares an exclusive, auto-delete, server-named queue, binds it to
    /// `<c>.replies` with its own name as the routing key and consumes it
    /// (no-ack) on a confirm channel of `conn`; `tag` names the consumer.
    ///
    /// # Errors
    /// [`CliError::NoSuchCluster`] if `<c>.replies` does not exist,
    /// [`CliError::Broker`] otherwise.
    pub async fn open(
        conn: &lapin::Connection,
        settings: &Settings,
        tag: &str,
    ) -> Result<Replies, CliError> {
        let topo = Topology::new(&settings.cluster);
        let replies = topo.replies_exchange();
        let ch = amqp::confirm_channel(conn)
            .await
            .map_err(CliError::broker("open a channel"))?;
        let queue = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::op("declare a reply queue"))
            .map_err(CliError::broker("declare a reply queue"))?;
        let name = queue.name().clone();
        if let Err(e) = ch
            .queue_bind(
                name.clone(),
                replies.as_str().into(),
                name.clone(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            let e = AmqpError::Declare {
                name: format!("binding {replies} -> {name}"),
                source: e,
            };
            if amqp_reply_code(&e) == Some(NOT_FOUND) {
                return Err(CliError::NoSuchCluster {
                    cluster: settings.cluster.clone(),
                    exchange: replies,
                });
            }
            return Err(CliError::broker("bind the reply queue")(e));
        }
        let consumer = ch
            .basic_consume(
                name.clone(),
                tag.into(),
                BasicConsumeOptions {
                    no_ack: true,
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::op("consume the reply queue"))
            .map_err(CliError::broker("consume the reply queue"))?;
        Ok(Replies {
            ch,
            queue: name,
            consumer,
            cluster: settings.cluster.clone(),
        })
    }

    /// The reply queue's name (the `reply_to` of every request).
    pub fn queue(&self) -> &str {
        self.queue.as_str()
    }

    /// Publishes `body` to `exchange` with `key`, mandatory, with a
    /// publisher confirm within `timeout`, `props` plus `reply_to` and a
    /// fresh `correlation_id`; `action` names the request in errors.
    ///
    /// # Errors
    /// [`CliError::NoSuchCluster`] if `exchange` does not exist,
    /// [`CliError::Broker`] otherwise.
    pub async fn send(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
        timeout: Duration,
        action: &str,
    ) -> Result<Sent, CliError> {
        let correlation = uuid::Uuid::new_v4().to_string();
        self.send_as(exchange, key, body, props, timeout, action, &correlation)
            .await
    }

    /// [`Replies::send`] with the caller's `correlation` id (a request
    /// whose body names its id, e.g. a drain's `request_id`).
    ///
    /// # Errors
    /// As [`Replies::send`].
    #[allow(clippy::too_many_arguments)]
    pub async fn send_as(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
        timeout: Duration,
        action: &str,
        correlation: &str,
    ) -> Result<Sent, CliError> {
        let correlation = correlation.to_string();
        let props = props
            .with_reply_to(self.queue.clone())
            .with_correlation_id(correlation.as_str().into());
        match amqp::publish_confirmed(&self.ch, exchange, key, body, props, true, timeout).await {
            Ok(()) => Ok(Sent::Routed { correlation }),
            Err(AmqpError::Unroutable { .. }) => Ok(Sent::Unroutable),
            Err(e) if amqp_reply_code(&e) == Some(NOT_FOUND) => Err(CliError::NoSuchCluster {
                cluster: self.cluster.clone(),
                exchange: exchange.to_string(),
            }),
            Err(e) => Err(CliError::broker(action)(e)),
        }
    }

    /// The next answer carrying `correlation`, or `None` if none came
    /// before `deadline` (or the channel closed).
    ///
    /// # Errors
    /// [`CliError::Broker`] if the consumer fails.
    pub async fn answer(
        &mut self,
        correlation: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Delivery>, CliError> {
        loop {
            let d = match tokio::time::timeout_at(deadline, self.consumer.next()).await {
                Err(_) | Ok(None) => return Ok(None),
                Ok(Some(d)) => d
                    .map_err(AmqpError::op("basic.deliver"))
                    .map_err(CliError::broker("read an answer"))?,
            };
            if d.properties.correlation_id().as_ref().map(|c| c.as_str()) == Some(correlation) {
                return Ok(Some(d));
            }
            // An answer to an earlier request that timed out: skip it.
        }
    }

    /// Closes the channel (the queue goes with it).
    pub async fn close(self) {
        let _ = self.ch.close(200, "done".into()).await;
    }
}
