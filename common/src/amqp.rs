//! AMQP glue shared by the controller, the jobagent and the CLI (feature
//! `amqp`), one job a submodule, every item re-exported here
//! (`vq_common::amqp::X`):
//!
//! * errors: [`AmqpError`] and the AMQP reply codes;
//! * connect: [`connect`] with a timeout and TLS ([`crate::tls`]), the URL
//!   tuning ([`tuned_url`]) and the URL's user ([`broker_user`]);
//! * declare: the topology ([`declare_topology`], [`declare_exchanges`],
//!   the pool, lease and agent queues), the claim markers ([`claim_marker`])
//!   and passive lookups ([`inspect_queue`], [`queue_exists`]);
//! * publish: a confirm channel, message properties, [`publish_confirmed`]
//!   and its alarm-aware form;
//! * subscribe: [`subscribe`], the exclusive, auto-delete listener queue;
//! * headers: reading and setting message headers ([`header_u32`] …);
//! * [`envelope`]: the properties of the job copies vq makes (lease copies,
//!   dead letters) and the job id of a delivery.
//!
//! Every broker operation here is bounded by a timeout: an await that can
//! wait forever on a half-dead connection is a bug.

use std::time::Duration;

mod connect;
mod declare;
pub mod envelope;
mod error;
mod headers;
mod publish;
mod subscribe;

pub use crate::amqp_url::{broker_user, parse_url, redact_url, DEFAULT_USER};
pub use connect::{connect, tuned_url, DEFAULT_FRAME_MAX};
pub use declare::{
    claim_marker, declare_agents_queue, declare_bound_queue, declare_exchange, declare_exchanges,
    declare_lease_queue, declare_pool_queue, declare_topology, field_table, inspect_queue,
    queue_exists,
};
pub use error::{lapin_reply_code, AmqpError, ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED};
pub use headers::{header_str, header_u32, with_header_str, with_header_u32};
pub use publish::{
    confirm_channel, event_properties, json_properties, publish_confirmed,
    publish_confirmed_patiently, publish_message,
};
pub use subscribe::{consume_stream_from_first, subscribe, SUBSCRIBE_TIMEOUT};

/// Runs `fut` with a timeout, mapping expiry to [`AmqpError::Timeout`].
pub async fn bounded<T>(
    what: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, AmqpError>>,
) -> Result<T, AmqpError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(AmqpError::Timeout {
            what: what.into(),
            secs: timeout.as_secs(),
        }),
    }
}

#[cfg(test)]
mod tests;
