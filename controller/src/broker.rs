//! The controller's RabbitMQ side: one long-lived connection that declares
//! the topology, listens to agent events (`agent.#`: heartbeats, delete
//! answers, drained notices) and bridge demand, reads pool queue depths and
//! publishes control messages to agents.
//!
//! Agent events are stamped with the controller's own monotonic receive
//! time; the agents' clocks are never trusted for liveness.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use vq_common::amqp::{self, bounded, AmqpError};
use vq_common::config::BrokerConfig;
use vq_common::messages::{Control, DeleteAnswer, Demand, Heartbeat, Message};
use vq_common::topology::{Topology, ALL_AGENT_EVENTS};

use crate::observe::{AgentRecord, DemandMap};

/// Agent records not refreshed for this long are forgotten, seconds.
pub const AGENT_RECORD_TTL_SECS: u64 = 3600;

const OP_TIMEOUT: Duration = Duration::from_secs(15);

/// What the event consumers collected.
#[derive(Debug, Default)]
pub struct Shared {
    /// Latest heartbeat and answer per agent id.
    pub agents: BTreeMap<String, AgentRecord>,
    /// Latest demand per pool.
    pub demand: DemandMap,
    /// Since when the event consumer has run without interruption.
    pub listening_since: Option<Instant>,
}

struct Session {
    conn: Connection,
    channel: Channel,
    tasks: Vec<JoinHandle<()>>,
}

/// Snapshot of the event state at one instant.
#[derive(Debug, Clone, Default)]
pub struct EventSnapshot {
    /// Latest heartbeat and answer per agent id.
    pub agents: BTreeMap<String, AgentRecord>,
    /// Latest demand per pool.
    pub demand: DemandMap,
    /// Seconds the event consumer has run without interruption (0 if it
    /// does not run).
    pub listening_secs: f64,
}

/// The controller's broker client.
pub struct Broker {
    cfg: BrokerConfig,
    topo: Topology,
    pools: Vec<String>,
    session: Mutex<Option<Session>>,
    shared: Arc<StdMutex<Shared>>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("topology", &self.topo)
            .field("pools", &self.pools)
            .finish_non_exhaustive()
    }
}

fn op_err(what: &str) -> impl FnOnce(lapin::Error) -> AmqpError + '_ {
    move |source| AmqpError::Op {
        what: what.into(),
        source,
    }
}

impl Broker {
    /// A client for `cfg` managing `pools` of `topo`'s cluster. Does no I/O.
    pub fn new(cfg: BrokerConfig, topo: Topology, pools: Vec<String>) -> Self {
        Broker {
            cfg,
            topo,
            pools,
            session: Mutex::new(None),
            shared: Arc::new(StdMutex::new(Shared::default())),
        }
    }

    /// Connects (if not connected): declares the topology, starts the event
    /// and demand consumers.
    ///
    /// # Errors
    /// [`AmqpError`] if the broker cannot be reached or refuses a
    /// declaration.
    pub async fn ensure_connected(&self) -> Result<(), AmqpError> {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_ref() {
            if s.conn.status().connected() && s.channel.status().connected() {
                return Ok(());
            }
            tracing::warn!("broker connection or channel lost; reconnecting");
            for t in &s.tasks {
                t.abort();
            }
            let _ = s.conn.close(320, "reconnecting".into()).await;
            self.shared_lock().listening_since = None;
        }
        *guard = None;
        let conn = amqp::connect(&self.cfg, "vq-controller").await?;
        let channel = amqp::confirm_channel(&conn).await?;
        amqp::declare_topology(&channel, &self.topo, self.pools.iter().map(String::as_str)).await?;
        let events = self.start_events(&conn).await?;
        let demand = self.start_demand(&conn).await?;
        self.shared_lock().listening_since = Some(Instant::now());
        tracing::info!(
            broker = %vq_common::config::redact_url(&self.cfg.url),
            "connected to the broker, topology declared, listening to agent events and demand"
        );
        *guard = Some(Session {
            conn,
            channel,
            tasks: vec![events, demand],
        });
        Ok(())
    }

    fn shared_lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn start_events(&self, conn: &Connection) -> Result<JoinHandle<()>, AmqpError> {
        let ch = conn
            .create_channel()
            .await
            .map_err(op_err("channel.open (events)"))?;
        let consumer = bounded("subscribe to agent events", OP_TIMEOUT, async {
            let q = ch
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
                .map_err(op_err("declare the agent-event queue"))?;
            ch.queue_bind(
                q.name().clone(),
                self.topo.events_exchange().into(),
                ALL_AGENT_EVENTS.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(op_err("bind the agent-event queue"))?;
            ch.basic_consume(
                q.name().clone(),
                "vq-controller-events".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(op_err("consume agent events"))
        })
        .await?;
        let shared = self.shared.clone();
        Ok(tokio::spawn(consume_events(consumer, shared, ch)))
    }

    async fn start_demand(&self, conn: &Connection) -> Result<JoinHandle<()>, AmqpError> {
        let ch = conn
            .create_channel()
            .await
            .map_err(op_err("channel.open (demand)"))?;
        let consumer = bounded("consume demand", OP_TIMEOUT, async {
            ch.basic_qos(100, BasicQosOptions::default())
                .await
                .map_err(op_err("basic.qos (demand)"))?;
            ch.basic_consume(
                self.topo.demand_queue().into(),
                "vq-controller-demand".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(op_err("consume demand"))
        })
        .await?;
        let shared = self.shared.clone();
        Ok(tokio::spawn(consume_demand(consumer, shared, ch)))
    }

    /// A copy of the agent and demand state, with old records pruned.
    pub fn snapshot(&self, now: Instant) -> EventSnapshot {
        let mut s = self.shared_lock();
        let ttl = Duration::from_secs(AGENT_RECORD_TTL_SECS);
        s.agents.retain(|_, rec| {
            let last = [
                rec.heartbeat.as_ref().map(|h| h.1),
                rec.answer.as_ref().map(|a| a.1),
            ]
            .into_iter()
            .flatten()
            .max();
            last.is_some_and(|t| now.saturating_duration_since(t) < ttl)
        });
        EventSnapshot {
            agents: s.agents.clone(),
            demand: s.demand.clone(),
            listening_secs: s
                .listening_since
                .map(|t| now.saturating_duration_since(t).as_secs_f64())
                .unwrap_or(0.0),
        }
    }

    /// Ready messages in `pool`'s queue (passive declare).
    ///
    /// # Errors
    /// [`AmqpError`] if not connected or the queue cannot be inspected.
    pub async fn queue_depth(&self, pool: &str) -> Result<u64, AmqpError> {
        let channel = self.channel().await?;
        let name = self.topo.pool_queue(pool);
        let q = bounded(&format!("inspect {name}"), OP_TIMEOUT, async {
            channel
                .queue_declare(
                    name.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(op_err("queue.declare passive"))
        })
        .await?;
        Ok(u64::from(q.message_count()))
    }

    async fn channel(&self) -> Result<Channel, AmqpError> {
        let guard = self.session.lock().await;
        match guard.as_ref() {
            Some(s) if s.channel.status().connected() => Ok(s.channel.clone()),
            _ => Err(AmqpError::Timeout {
                what: "broker channel (not connected)".into(),
                secs: 0,
            }),
        }
    }

    /// Sends `msg` to `agent`'s control queue, mandatory and confirmed; an
    /// agent that is not connected gives [`AmqpError::Unroutable`].
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn send_control(&self, agent: &str, msg: &Control) -> Result<(), AmqpError> {
        let channel = self.channel().await?;
        amqp::publish_message(
            &channel,
            &self.topo.control_exchange(),
            agent,
            msg,
            true,
            Duration::from_secs(self.cfg.confirm_timeout_secs),
        )
        .await
    }

    /// Closes the connection (before the runtime is dropped).
    pub async fn close(&self) {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.take() {
            for t in &s.tasks {
                t.abort();
            }
            match s.conn.close(200, "controller shutting down".into()).await {
                Ok(()) => tracing::info!("broker connection closed"),
                Err(e) => tracing::warn!(error = %e, "closing the broker connection failed"),
            }
        }
    }
}

/// Records one agent event (by routing key `agent.<pool>.<word>`).
pub fn record_event(shared: &mut Shared, routing_key: &str, body: &[u8], at: Instant) {
    let word = routing_key.rsplit('.').next().unwrap_or_default();
    match word {
        "heartbeat" | "drained" => match Heartbeat::decode(body) {
            Ok(hb) => {
                let rec = shared
                    .agents
                    .entry(hb.agent.clone())
                    .or_insert_with(|| AgentRecord {
                        heartbeat: None,
                        answer: None,
                    });
                rec.heartbeat = Some((hb, at));
            }
            Err(e) => tracing::warn!(routing_key, error = %e, "ignoring a malformed heartbeat"),
        },
        "answer" => match DeleteAnswer::decode(body) {
            Ok(ans) => {
                tracing::info!(
                    pool = %ans.pool, agent = %ans.agent, may_delete = ans.may_delete,
                    running = ans.running.len(), "agent answered ask-delete"
                );
                let rec = shared
                    .agents
                    .entry(ans.agent.clone())
                    .or_insert_with(|| AgentRecord {
                        heartbeat: None,
                        answer: None,
                    });
                rec.answer = Some((ans, at));
            }
            Err(e) => tracing::warn!(routing_key, error = %e, "ignoring a malformed delete answer"),
        },
        _ => tracing::debug!(routing_key, "ignoring agent event"),
    }
}

async fn consume_events(mut consumer: Consumer, shared: Arc<StdMutex<Shared>>, _ch: Channel) {
    while let Some(delivery) = consumer.next().await {
        match delivery {
            Ok(d) => {
                let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
                record_event(&mut s, d.routing_key.as_str(), &d.data, Instant::now());
            }
            Err(e) => {
                tracing::warn!(error = %e, "agent event consumer failed");
                break;
            }
        }
    }
    tracing::warn!("agent event consumer ended; agents are not judged until it runs again");
    shared
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .listening_since = None;
}

async fn consume_demand(mut consumer: Consumer, shared: Arc<StdMutex<Shared>>, _ch: Channel) {
    while let Some(delivery) = consumer.next().await {
        let d = match delivery {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "demand consumer failed");
                break;
            }
        };
        match Demand::decode(&d.data) {
            Ok(dem) => {
                tracing::debug!(pool = %dem.pool, queued = dem.queued, running = dem.running, source = %dem.source, "demand");
                shared
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .demand
                    .insert(dem.pool.clone(), (dem, Instant::now()));
            }
            Err(e) => tracing::warn!(error = %e, "ignoring malformed demand"),
        }
        if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
            tracing::warn!(error = %e, "cannot ack demand");
            break;
        }
    }
    tracing::warn!("demand consumer ended");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn heartbeats_and_answers_are_recorded_by_agent() {
        let mut s = Shared::default();
        let t = Instant::now();
        let hb = br#"{"agent":"vq-cms-1","pool":"cms","state":"busy","slots":1,"running":["j"],"is_pull":true,"is_del":false,"idle_secs":0,"interval_secs":10,"at":0}"#;
        record_event(&mut s, "agent.cms.heartbeat", hb, t);
        let ans = br#"{"agent":"vq-cms-1","pool":"cms","request_id":"r","may_delete":false,"running":["j"],"at":0}"#;
        record_event(&mut s, "agent.cms.answer", ans, t);
        record_event(&mut s, "agent.cms.heartbeat", b"not json", t);
        let rec = &s.agents["vq-cms-1"];
        assert_eq!(
            rec.heartbeat.as_ref().unwrap().0.running,
            vec!["j".to_string()]
        );
        assert!(!rec.answer.as_ref().unwrap().0.may_delete);
        assert_eq!(s.agents.len(), 1);
    }
}
