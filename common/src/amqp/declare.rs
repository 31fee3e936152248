//! Declaring the topology: exchanges, bound queues, the queues of pools,
//! leases and the agent registry, and the claim markers of jobs.

use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::Channel;

use super::{bounded, lapin_reply_code, AmqpError, NOT_FOUND, PRECONDITION_FAILED};
use crate::topology::{
    ArgValue, ExchangeKind, QueueArgs, Topology, ALL_JOB_EVENTS, HELD_BINDING, SUBMITTED_BINDING,
};

/// Converts queue arguments to an AMQP field table.
pub fn field_table(args: &QueueArgs) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in args {
        let value = match v {
            ArgValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
            ArgValue::Int(i) => AMQPValue::LongLongInt(*i),
            ArgValue::Bool(b) => AMQPValue::Boolean(*b),
        };
        t.insert(ShortString::from(*k), value);
    }
    t
}

const DECLARE_TIMEOUT: Duration = Duration::from_secs(15);

/// Declares a durable exchange.
///
/// # Errors
/// [`AmqpError::Declare`] naming the exchange.
pub async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), AmqpError> {
    let kind = match kind {
        ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        ExchangeKind::Topic => lapin::ExchangeKind::Topic,
        ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
    };
    bounded(
        &format!("declare exchange {name}"),
        DECLARE_TIMEOUT,
        async {
            ch.exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| AmqpError::Declare {
                name: name.into(),
                source,
            })
        },
    )
    .await
}

/// Declares a durable queue with `args` and binds it to `exchange` with
/// `routing_key`. A queue that exists with other arguments fails with
/// PRECONDITION_FAILED, whose text names the argument and both values; the
/// broker then closes `ch`.
///
/// # Errors
/// [`AmqpError::Declare`] naming the queue.
pub async fn declare_bound_queue(
    ch: &Channel,
    queue: &str,
    args: &QueueArgs,
    exchange: &str,
    routing_key: &str,
) -> Result<(), AmqpError> {
    bounded(&format!("declare queue {queue}"), DECLARE_TIMEOUT, async {
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            field_table(args),
        )
        .await
        .map_err(|source| AmqpError::Declare {
            name: queue.into(),
            source,
        })?;
        bind_queue(ch, queue, exchange, routing_key).await
    })
    .await
}

/// Binds `queue` to `exchange` with `routing_key`, not bounded by itself:
/// [`declare_bound_queue`] and [`subscribe`](super::subscribe) bound the
/// whole sequence it is part of.
///
/// # Errors
/// [`AmqpError::Declare`] naming the binding.
pub(super) async fn bind_queue(
    ch: &Channel,
    queue: &str,
    exchange: &str,
    routing_key: &str,
) -> Result<(), AmqpError> {
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        routing_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|source| AmqpError::Declare {
        name: format!("binding {exchange} -> {queue} ({routing_key})"),
        source,
    })
}

/// Declares `agent`'s lease queue `<c>.lease.<agent>` and binds it to
/// [`Topology::lease_exchange`] with its own name as the routing key (the
/// key lease copies are published with).
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_lease_queue(
    ch: &Channel,
    topo: &Topology,
    agent: &str,
) -> Result<(), AmqpError> {
    let queue = topo.lease_queue(agent);
    declare_bound_queue(
        ch,
        &queue,
        &topo.lease_queue_args(),
        &topo.lease_exchange(),
        &queue,
    )
    .await
}

/// Declares the agent registry `<c>.agents` and binds it to
/// [`Topology::agents_exchange`] with its own name as the routing key.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_agents_queue(ch: &Channel, topo: &Topology) -> Result<(), AmqpError> {
    let queue = topo.agents_queue();
    declare_bound_queue(
        ch,
        &queue,
        &topo.agents_queue_args(),
        &topo.agents_exchange(),
        &queue,
    )
    .await
}

/// Declares the exchanges that agents and the controller publish to or
/// bind to: jobs, dead, events, demand, control, lease, agents (not the
/// controller's own fence exchange, see [`declare_topology`]).
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_exchanges(ch: &Channel, topo: &Topology) -> Result<(), AmqpError> {
    declare_exchange(ch, &topo.jobs_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.dead_exchange(), ExchangeKind::Fanout).await?;
    declare_exchange(ch, &topo.events_exchange(), ExchangeKind::Topic).await?;
    declare_exchange(ch, &topo.demand_exchange(), ExchangeKind::Fanout).await?;
    declare_exchange(ch, &topo.control_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.lease_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.agents_exchange(), ExchangeKind::Direct).await?;
    Ok(())
}

/// Declares the submissions exchange and binds it into the events exchange
/// for [`SUBMITTED_BINDING`] and [`HELD_BINDING`] only
/// ([`Topology::submitted_exchange`]).
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_submitted_exchange(ch: &Channel, topo: &Topology) -> Result<(), AmqpError> {
    let source = topo.submitted_exchange();
    let destination = topo.events_exchange();
    declare_exchange(ch, &source, ExchangeKind::Topic).await?;
    for key in [SUBMITTED_BINDING, HELD_BINDING] {
        bounded(
            &format!("bind exchange {destination} to {source} ({key})"),
            DECLARE_TIMEOUT,
            async {
                ch.exchange_bind(
                    destination.as_str().into(),
                    source.as_str().into(),
                    key.into(),
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| AmqpError::Declare {
                    name: destination.clone(),
                    source,
                })
            },
        )
        .await?;
    }
    Ok(())
}

/// Declares the whole topology (the controller's part): exchanges (the
/// submissions exchange included), the dead-letter queue, the job-event stream, the demand queue, the fence
/// queue and its exchange, the agent registry, the pool queues of
/// `pools`, and the held exchange and queue, bound for each of `pools`.
/// Idempotent.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_topology<'a>(
    ch: &Channel,
    topo: &Topology,
    pools: impl IntoIterator<Item = &'a str>,
) -> Result<(), AmqpError> {
    declare_exchanges(ch, topo).await?;
    declare_submitted_exchange(ch, topo).await?;
    declare_bound_queue(
        ch,
        &topo.dead_queue(),
        &topo.dead_queue_args(),
        &topo.dead_exchange(),
        "",
    )
    .await?;
    declare_bound_queue(
        ch,
        &topo.event_log_queue(),
        &topo.event_log_args(),
        &topo.events_exchange(),
        ALL_JOB_EVENTS,
    )
    .await?;
    declare_bound_queue(
        ch,
        &topo.demand_queue(),
        &topo.demand_queue_args(),
        &topo.demand_exchange(),
        "",
    )
    .await?;
    declare_exchange(ch, &topo.fence_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.replies_exchange(), ExchangeKind::Direct).await?;
    let fence = topo.fence_queue();
    declare_bound_queue(
        ch,
        &fence,
        &topo.fence_queue_args(),
        &topo.fence_exchange(),
        &fence,
    )
    .await?;
    declare_agents_queue(ch, topo).await?;
    declare_exchange(ch, &topo.held_exchange(), ExchangeKind::Direct).await?;
    for pool in pools {
        declare_pool_queue(ch, topo, pool).await?;
        declare_bound_queue(
            ch,
            &topo.held_queue(),
            &topo.held_queue_args(),
            &topo.held_exchange(),
            pool,
        )
        .await?;
    }
    Ok(())
}

/// Declares the job queue of `pool` and binds it to the jobs exchange.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_pool_queue(
    ch: &Channel,
    topo: &Topology,
    pool: &str,
) -> Result<(), AmqpError> {
    declare_bound_queue(
        ch,
        &topo.pool_queue(pool),
        &topo.pool_queue_args(),
        &topo.jobs_exchange(),
        pool,
    )
    .await
}

/// Looks at or takes the claim marker of job `job_id` for claim `claim` of
/// agent `agent` (see [`crate::lease`]): declares it with that claim's
/// arguments, after a passive declaration when `create` is false (a
/// missing marker is then [`Marker::Absent`](crate::lease::Marker) and is
/// not created). A 404 or 406 reply closes `ch`: use a channel that holds
/// nothing else.
///
/// # Errors
/// [`AmqpError`] when the outcome is unknown (not connected, timeout,
/// connection lost): ask again.
pub async fn claim_marker(
    ch: &Channel,
    topo: &Topology,
    job_id: &str,
    agent: &str,
    claim: &str,
    create: bool,
) -> Result<crate::lease::Marker, AmqpError> {
    use crate::lease::Marker;
    let queue = topo.claim_queue(job_id);
    if !create && !queue_exists(ch, &queue, "look up claim marker").await? {
        return Ok(Marker::Absent);
    }
    let args = field_table(&topo.claim_queue_args(agent, claim));
    let r = bounded("declare claim marker", DECLARE_TIMEOUT, async {
        Ok(ch
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await)
    })
    .await?;
    match r {
        Ok(_) => Ok(Marker::Ours),
        Err(e) if lapin_reply_code(&e) == Some(PRECONDITION_FAILED) => Ok(Marker::Theirs),
        Err(e) => Err(AmqpError::op("declare claim marker")(e)),
    }
}

/// Queue `queue` as the broker has it now (its message and consumer
/// counts), `None` if it does not exist: a passive declaration, bounded by
/// 15 s. A missing queue (404 NOT_FOUND) closes `ch`: use a channel that
/// holds nothing else.
///
/// # Errors
/// [`AmqpError::Op`] naming `what` when the broker refuses otherwise,
/// [`AmqpError::Timeout`] naming `what`.
pub async fn inspect_queue(
    ch: &Channel,
    queue: &str,
    what: &str,
) -> Result<Option<lapin::Queue>, AmqpError> {
    let r = bounded(what, DECLARE_TIMEOUT, async {
        Ok(ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await)
    })
    .await?;
    match r {
        Ok(q) => Ok(Some(q)),
        Err(e) if lapin_reply_code(&e) == Some(NOT_FOUND) => Ok(None),
        Err(e) => Err(AmqpError::op(what)(e)),
    }
}

/// Whether queue `queue` exists ([`inspect_queue`]; a missing queue
/// closes `ch`).
///
/// # Errors
/// As [`inspect_queue`].
pub async fn queue_exists(ch: &Channel, queue: &str, what: &str) -> Result<bool, AmqpError> {
    Ok(inspect_queue(ch, queue, what).await?.is_some())
}
