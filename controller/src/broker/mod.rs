//! The controller's RabbitMQ side: one long-lived connection that declares
//! the topology, listens to agent events (`agent.#`: heartbeats, delete
//! answers, drained notices), job events (`job.#`, counted in the
//! metrics only) and bridge demand, reads pool queue depths and
//! publishes control messages to agents.
//!
//! What the consumers hear goes into the event book ([`crate::events`]);
//! the dead-letter watch is [`crate::dead_watch`]. The [`BrokerApi`] and
//! [`Messenger`] traits the loop and its fakes use live here, beside the
//! real implementation.
//!
//! Fencing (DESIGN.md, "Leases"): before a server is deleted its agent id
//! is put into the durable fence queue `<c>.fence` ([`Broker::mark_fence`],
//! with the agent registry's reads in [`entries`]); once the server is gone
//! from Nova, [`Broker::fence`] ([`lease`]) empties the agent's
//! lease queue (rerunnable jobs back to their pool with the loss counter
//! incremented, past the limit or non-rerunnable: `job.failed` and dead
//! letter), deletes it and removes the fence entry. The fence queue keeps
//! the controller stateless: a restart between delete and requeue loses
//! nothing.
//!
//! Dead letters: see [`crate::dead_watch`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, Consumer};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use vq_common::amqp::{self, bounded, AmqpError};
use vq_common::config::BrokerConfig;
use vq_common::messages::{Control, Message};
use vq_common::topology::{Topology, ALL_AGENT_EVENTS, ALL_JOB_EVENTS};

pub use crate::dead_watch::broker_dead_letter_event;
use crate::dead_watch::watch_dead_letters;
use crate::events::{consume_demand, consume_events, watch_blocked};
pub use crate::events::{record_event, remember_ask, EventSnapshot, Shared, AGENT_RECORD_TTL_SECS};
use crate::metrics::Metrics;

pub mod entries;
pub mod lease;

pub use lease::{lease_fate, FenceReport, LeaseFate};

const OP_TIMEOUT: Duration = Duration::from_secs(15);

struct Session {
    conn: Arc<Connection>,
    channel: Channel,
    tasks: Vec<JoinHandle<()>>,
    /// The demand consumer and its channel, while this controller takes
    /// demand ([`Broker::take_demand`]).
    demand: Option<(JoinHandle<()>, Channel)>,
    /// The held-queue consumer ([`crate::jobs::held`]) and its channel,
    /// with the demand consumer (the leader's) when there is a job table.
    held: Option<(JoinHandle<()>, Channel)>,
}

/// The controller's broker client.
pub struct Broker {
    cfg: BrokerConfig,
    user: String,
    topo: Topology,
    pools: Vec<String>,
    session: Mutex<Option<Session>>,
    shared: Arc<StdMutex<Shared>>,
    metrics: Arc<Metrics>,
    /// Whether a session was ever established (later ones are reconnects).
    connected_once: AtomicBool,
    /// The job table each session rebuilds from the event stream, and how
    /// long ended jobs stay in it (seconds); `None`: no table.
    jobs: Option<(crate::jobs::SharedJobs, f64)>,
    /// Who sees which job in `vq stat`'s queries; `None`: queries are not
    /// answered (no table).
    job_queries: Option<Arc<vq_common::jobs::Visibility>>,
    /// The pools' limits that `vq submit`'s questions are answered with
    /// (with the job queries; empty: every pool is unknown to the asker).
    pool_limits: Arc<Vec<vq_common::pools::PoolLimits>>,
    /// Whether this controller consumes `<c>.demand` (the leader only:
    /// the queue is single-active-consumer, and a standby holding the
    /// active slot would take the leader's bridge demand).
    demand_on: AtomicBool,
    /// `[jobs] depend_grace_secs` of the held-queue consumer.
    depend_grace_secs: u64,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("topology", &self.topo)
            .field("pools", &self.pools)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// A client for `cfg` managing `pools` of `topo`'s cluster. Does no I/O.
    pub fn new(cfg: BrokerConfig, topo: Topology, pools: Vec<String>) -> Self {
        Broker {
            user: amqp::broker_user(&cfg.url),
            cfg,
            topo,
            pools,
            session: Mutex::new(None),
            shared: Arc::new(StdMutex::new(Shared::default())),
            metrics: Arc::new(Metrics::new()),
            connected_once: AtomicBool::new(false),
            jobs: None,
            job_queries: None,
            pool_limits: Arc::new(Vec::new()),
            demand_on: AtomicBool::new(true),
            depend_grace_secs: 120,
        }
    }

    /// Starts without consuming demand (a controller that must first take
    /// the controller lock, [`crate::leader`]); [`Broker::take_demand`]
    /// turns it on.
    pub fn without_demand(self) -> Self {
        self.demand_on.store(false, Ordering::Relaxed);
        self
    }

    /// Consumes the demand queue (`on`, the leader) or stops consuming it
    /// (a standby: cancels the consumer by closing its channel, so that
    /// the broker makes the leader's consumer the active one). Takes
    /// effect at once when connected, else with the next session.
    pub async fn take_demand(&self, on: bool) {
        if self.demand_on.swap(on, Ordering::Relaxed) == on {
            return;
        }
        let mut guard = self.session.lock().await;
        let Some(s) = guard.as_mut() else { return };
        if on {
            if s.demand.is_none() && s.conn.status().connected() {
                match self.start_demand(&s.conn).await {
                    Ok(d) => s.demand = Some(d),
                    Err(e) => {
                        tracing::warn!(error = %vq_common::error::chain(&e), "cannot consume demand; retried with the next session");
                        // The next health check reconnects.
                        s.tasks.push(tokio::spawn(async {}));
                    }
                }
            }
            if s.held.is_none() && s.conn.status().connected() {
                match self.start_held(&s.conn).await {
                    Ok(h) => s.held = h,
                    Err(e) => {
                        tracing::warn!(error = %vq_common::error::chain(&e), "cannot consume held jobs; retried with the next session");
                        s.tasks.push(tokio::spawn(async {}));
                    }
                }
            }
        } else {
            if let Some((task, ch)) = s.demand.take() {
                task.abort();
                let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "standby".into())).await;
            }
            // Closing the channel returns the unacked held jobs to the
            // queue, for the new leader.
            if let Some((task, ch)) = s.held.take() {
                task.abort();
                let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "standby".into())).await;
                for p in &self.pools {
                    self.metrics.set_pool_held(p, 0);
                }
            }
        }
    }

    /// Cancels held jobs naming a dependency the table does not know
    /// `secs` after their submission (`[jobs] depend_grace_secs`; default
    /// 120).
    pub fn with_depend_grace(mut self, secs: u64) -> Self {
        self.depend_grace_secs = secs;
        self
    }

    /// Keeps `jobs` current from the event stream with every session,
    /// forgetting ended jobs `keep_completed_secs` after their end
    /// ([`crate::jobs::feed`]).
    pub fn with_job_table(
        mut self,
        jobs: crate::jobs::SharedJobs,
        keep_completed_secs: f64,
    ) -> Self {
        self.jobs = Some((jobs, keep_completed_secs));
        self
    }

    /// Answers `vq stat`'s job-table queries from the table of
    /// [`Broker::with_job_table`] with the rule `vis`
    /// ([`crate::jobs::queries`]) in every session.
    pub fn with_job_queries(mut self, vis: vq_common::jobs::Visibility) -> Self {
        self.job_queries = Some(Arc::new(vis));
        self
    }

    /// Answers `vq submit`'s questions for the pools' limits (`<c>.query.pools`,
    /// [`vq_common::pools`]) with `limits`, on the consumer of the job
    /// queries ([`Broker::with_job_queries`]).
    pub fn with_pool_limits(mut self, limits: Vec<vq_common::pools::PoolLimits>) -> Self {
        self.pool_limits = Arc::new(limits);
        self
    }

    /// Counts reconnects, job events and dead letters in `metrics`
    /// (instead of a private registry).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The broker user this client logs in as and stamps as `user_id` on
    /// control messages and requeued jobs
    /// ([`vq_common::amqp::broker_user`]: `guest` when the URL names none).
    pub fn user(&self) -> &str {
        &self.user
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
            // A consumer that ended (its channel failed) is restarted with
            // the whole session: dead letters must not wait unwatched.
            if s.conn.status().connected()
                && s.channel.status().connected()
                && !s.tasks.iter().any(JoinHandle::is_finished)
                && !s.demand.as_ref().is_some_and(|(t, _)| t.is_finished())
                && !s.held.as_ref().is_some_and(|(t, _)| t.is_finished())
            {
                return Ok(());
            }
            tracing::warn!("broker connection or channel lost; reconnecting");
            for t in &s.tasks {
                t.abort();
            }
            if let Some((t, _)) = &s.demand {
                t.abort();
            }
            if let Some((t, _)) = &s.held {
                t.abort();
            }
            let _ =
                tokio::time::timeout(OP_TIMEOUT, s.conn.close(320, "reconnecting".into())).await;
            let mut sh = self.shared_lock();
            sh.listening_since = None;
            sh.blocked = None;
        }
        *guard = None;
        let conn = Arc::new(amqp::connect(&self.cfg, "vq-controller").await?);
        let channel = amqp::confirm_channel(&conn).await?;
        amqp::declare_topology(&channel, &self.topo, self.pools.iter().map(String::as_str)).await?;
        amqp::declare_bound_queue(
            &channel,
            &self.topo.dead_watch_queue(),
            &self.topo.dead_watch_queue_args(),
            &self.topo.dead_exchange(),
            "",
        )
        .await?;
        let events = self.start_events(&conn).await?;
        let demand = if self.demand_on.load(Ordering::Relaxed) {
            Some(self.start_demand(&conn).await?)
        } else {
            None
        };
        let dead = self.start_dead_watch(&conn).await?;
        let held = if self.demand_on.load(Ordering::Relaxed) {
            self.start_held(&conn).await?
        } else {
            None
        };
        let alarms = tokio::spawn(watch_blocked(conn.events_listener(), self.shared.clone()));
        {
            let mut sh = self.shared_lock();
            sh.listening_since = Some(Instant::now());
            sh.blocked = None;
        }
        tracing::info!(
            broker = %vq_common::config::redact_url(&self.cfg.url),
            "connected to the broker, topology declared, listening to agent events and demand"
        );
        if self.connected_once.swap(true, Ordering::Relaxed) {
            self.metrics.broker_reconnects.inc();
        }
        let mut tasks = vec![events, alarms, dead];
        if let Some((jobs, keep)) = &self.jobs {
            // The table is secondary to acting: a session whose stream
            // consumer cannot start acts anyway, and /jobs says why.
            match crate::jobs::feed::start(
                &conn,
                &self.topo,
                jobs.clone(),
                *keep,
                self.metrics.clone(),
            )
            .await
            {
                Ok(task) => tasks.push(task),
                Err(e) => {
                    let why = format!(
                        "cannot follow the job-event stream: {}",
                        vq_common::error::chain(&e)
                    );
                    tracing::warn!(error = %why, "job table not built");
                    let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
                    v.complete = false;
                    v.stalled = Some(why);
                }
            }
            if let Some(vis) = &self.job_queries {
                // Answered in every session, complete or not: an answer
                // says whether the table has caught up.
                match crate::jobs::queries::start(
                    conn.clone(),
                    &self.topo,
                    jobs.clone(),
                    vis.clone(),
                    self.pool_limits.clone(),
                )
                .await
                {
                    Ok(task) => tasks.push(task),
                    Err(e) => tracing::warn!(
                        error = %vq_common::error::chain(&e),
                        "job queries (vq stat, vq cancel, vq submit's pool limits) are not answered in this session"
                    ),
                }
            }
        }
        *guard = Some(Session {
            conn,
            channel,
            tasks,
            demand,
            held,
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
            .map_err(AmqpError::op("channel.open (events)"))?;
        let consumer = amqp::subscribe(
            &ch,
            "",
            &self.topo.events_exchange(),
            &[ALL_AGENT_EVENTS, ALL_JOB_EVENTS],
            "vq-controller-events",
        )
        .await?;
        let shared = self.shared.clone();
        Ok(tokio::spawn(consume_events(
            consumer,
            shared,
            self.metrics.clone(),
            ch,
        )))
    }

    async fn start_demand(
        &self,
        conn: &Connection,
    ) -> Result<(JoinHandle<()>, Channel), AmqpError> {
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open (demand)"))?;
        let consumer =
            consume_acked(&ch, &self.topo.demand_queue(), "vq-controller-demand", 100).await?;
        let shared = self.shared.clone();
        Ok((
            tokio::spawn(consume_demand(consumer, shared, ch.clone())),
            ch,
        ))
    }

    /// Starts the held-queue consumer ([`crate::jobs::held`]); `None`
    /// without a job table (nothing to decide by).
    async fn start_held(
        &self,
        conn: &Connection,
    ) -> Result<Option<(JoinHandle<()>, Channel)>, AmqpError> {
        let Some((jobs, _)) = &self.jobs else {
            return Ok(None);
        };
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open (held jobs)"))?;
        let publish = amqp::confirm_channel(conn).await?;
        let consumer = consume_acked(
            &ch,
            &self.topo.held_queue(),
            "vq-controller-held",
            crate::jobs::held::HELD_PREFETCH,
        )
        .await?;
        let holder = crate::jobs::held::Holder {
            publish,
            topo: self.topo.clone(),
            jobs: jobs.clone(),
            user: self.user.clone(),
            grace_secs: self.depend_grace_secs,
            confirm: Duration::from_secs(self.cfg.confirm_timeout_secs),
            metrics: self.metrics.clone(),
            pools: self.pools.clone(),
        };
        Ok(Some((tokio::spawn(holder.run(consumer, ch.clone())), ch)))
    }

    async fn start_dead_watch(&self, conn: &Connection) -> Result<JoinHandle<()>, AmqpError> {
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open (dead letters)"))?;
        let publish = amqp::confirm_channel(conn).await?;
        let consumer = consume_acked(
            &ch,
            &self.topo.dead_watch_queue(),
            "vq-controller-dead-watch",
            1,
        )
        .await?;
        Ok(tokio::spawn(watch_dead_letters(
            consumer,
            ch,
            publish,
            self.topo.clone(),
            Duration::from_secs(self.cfg.confirm_timeout_secs),
            self.shared.clone(),
            self.metrics.clone(),
        )))
    }

    /// A copy of the agent and demand state, with old records pruned.
    pub fn snapshot(&self, now: Instant) -> EventSnapshot {
        let mut snap = self.shared_lock().snapshot(now);
        if let Some((jobs, _)) = &self.jobs {
            let view = jobs.read().unwrap_or_else(|e| e.into_inner());
            if view.complete {
                snap.job_slots = Some(crate::jobs::slots::pool_slots(&view.table));
            }
        }
        snap
    }

    /// The broker's reason while it blocks the controller's connection
    /// (resource alarm), else `None`. Learnt from `connection.blocked`,
    /// which RabbitMQ sends only to connections that publish: see
    /// [`Broker::probe`].
    pub fn blocked(&self) -> Option<String> {
        self.shared_lock().blocked.clone()
    }

    /// Publishes an empty, unroutable message (control exchange, routing
    /// key [`Topology::probe_key`], which is no agent id) and waits for its
    /// confirm. Called every cycle so that a broker memory or disk alarm
    /// blocks this connection, and the controller learns of it, before
    /// the agents' silenced heartbeats could be taken for dead agents.
    ///
    /// # Errors
    /// [`AmqpError`] if not connected or unconfirmed within
    /// `confirm_timeout_secs`.
    pub async fn probe(&self) -> Result<(), AmqpError> {
        let channel = self.channel().await?;
        amqp::publish_confirmed(
            &channel,
            &self.topo.control_exchange(),
            &self.topo.probe_key(),
            b"",
            BasicProperties::default(),
            false,
            Duration::from_secs(self.cfg.confirm_timeout_secs),
        )
        .await
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
                .map_err(AmqpError::op("queue.declare passive"))
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
        if let Control::AskDelete { request_id } = msg {
            // Before publishing: the answer may arrive before the confirm.
            remember_ask(&mut self.shared_lock(), agent, request_id);
        }
        // The agent authorises control messages by the broker-validated
        // user_id (its `control_admins`), so it must be set.
        let mut props = amqp::json_properties::<Control>();
        props = props.with_user_id(self.user().into());
        amqp::publish_confirmed(
            &channel,
            &self.topo.control_exchange(),
            agent,
            &msg.encode(),
            props,
            true,
            Duration::from_secs(self.cfg.confirm_timeout_secs),
        )
        .await
    }

    async fn fresh_channel(&self) -> Result<Channel, AmqpError> {
        let guard = self.session.lock().await;
        match guard.as_ref() {
            Some(s) if s.conn.status().connected() => amqp::confirm_channel(&s.conn).await,
            _ => Err(AmqpError::Timeout {
                what: "broker connection (not connected)".into(),
                secs: 0,
            }),
        }
    }

    /// Closes the connection (before the runtime is dropped).
    pub async fn close(&self) {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.take() {
            for t in &s.tasks {
                t.abort();
            }
            if let Some((t, _)) = &s.demand {
                t.abort();
            }
            if let Some((t, _)) = &s.held {
                t.abort();
            }
            // A blocked connection (broker alarm) does not read our close.
            match tokio::time::timeout(
                OP_TIMEOUT,
                s.conn.close(200, "controller shutting down".into()),
            )
            .await
            {
                Ok(Ok(())) => tracing::info!("broker connection closed"),
                Ok(Err(e)) => tracing::warn!(error = %e, "closing the broker connection failed"),
                Err(_) => tracing::warn!(
                    "the broker did not answer our close in time; dropping the connection"
                ),
            }
        }
    }
}

/// Sends control messages to agents (the broker, or a fake in tests).
pub trait Messenger: Send + Sync {
    /// Sends `msg` to `agent`.
    fn send_control(
        &self,
        agent: &str,
        msg: &Control,
    ) -> impl Future<Output = Result<(), AmqpError>> + Send;

    /// Records durably that `agent` is being fenced, before its server is
    /// deleted, so that its leases are returned even if the controller
    /// restarts right after the delete.
    fn mark_fence(&self, agent: &str) -> impl Future<Output = Result<(), AmqpError>> + Send;
}

impl Messenger for Broker {
    async fn send_control(&self, agent: &str, msg: &Control) -> Result<(), AmqpError> {
        Broker::send_control(self, agent, msg).await
    }
    async fn mark_fence(&self, agent: &str) -> Result<(), AmqpError> {
        Broker::mark_fence(self, agent).await
    }
}

/// The broker operations the loop needs (the real [`Broker`] or a fake).
/// No method has a default body: a fake implements the whole contract, so
/// the fake tests run the fencing path, and a new implementation that
/// forgot a method does not compile.
pub trait BrokerApi: Messenger {
    /// Connects if needed.
    fn ensure_connected(&self) -> impl Future<Output = Result<(), AmqpError>> + Send;
    /// Ready messages in the pool's queue.
    fn queue_depth(&self, pool: &str) -> impl Future<Output = Result<u64, AmqpError>> + Send;
    /// Agent and demand state now.
    fn snapshot(&self, now: Instant) -> EventSnapshot;
    /// The broker's reason while it blocks publishing (see
    /// [`crate::broker::Broker::blocked`]), else `None`.
    fn blocked(&self) -> Option<String>;
    /// A confirmed publish that makes a broker alarm visible (see
    /// [`crate::broker::Broker::probe`]).
    fn probe(&self) -> impl Future<Output = Result<(), AmqpError>> + Send;
    /// Agents being fenced (see [`crate::broker::Broker::pending_fences`]).
    fn pending_fences(&self) -> impl Future<Output = Result<Vec<String>, AmqpError>> + Send;
    /// `(agent, pool)` entries of the registry (see
    /// [`crate::broker::Broker::registered_agents`]).
    fn registered_agents(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, String)>, AmqpError>> + Send;
    /// Empties and deletes `agent`'s lease queue (see
    /// [`crate::broker::Broker::fence`]).
    fn fence(
        &self,
        agent: &str,
        loss_limit: u32,
    ) -> impl Future<Output = Result<FenceReport, AmqpError>> + Send;
    /// Consumes bridge demand (the leader) or not (a standby), see
    /// [`crate::broker::Broker::take_demand`].
    fn take_demand(&self, on: bool) -> impl Future<Output = ()> + Send;
}

impl BrokerApi for Broker {
    async fn ensure_connected(&self) -> Result<(), AmqpError> {
        Broker::ensure_connected(self).await
    }
    async fn queue_depth(&self, pool: &str) -> Result<u64, AmqpError> {
        Broker::queue_depth(self, pool).await
    }
    fn snapshot(&self, now: Instant) -> EventSnapshot {
        Broker::snapshot(self, now)
    }
    fn blocked(&self) -> Option<String> {
        Broker::blocked(self)
    }
    async fn probe(&self) -> Result<(), AmqpError> {
        Broker::probe(self).await
    }
    async fn pending_fences(&self) -> Result<Vec<String>, AmqpError> {
        Broker::pending_fences(self).await
    }
    async fn registered_agents(&self) -> Result<Vec<(String, String)>, AmqpError> {
        Broker::registered_agents(self).await
    }
    async fn fence(&self, agent: &str, loss_limit: u32) -> Result<FenceReport, AmqpError> {
        Broker::fence(self, agent, loss_limit).await
    }
    async fn take_demand(&self, on: bool) {
        Broker::take_demand(self, on).await
    }
}

/// Consumes the named queue `queue` with manual acks and prefetch
/// `prefetch`, consumer tag `tag`.
async fn consume_acked(
    ch: &Channel,
    queue: &str,
    tag: &str,
    prefetch: u16,
) -> Result<Consumer, AmqpError> {
    bounded(&format!("consume {queue}"), OP_TIMEOUT, async {
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(AmqpError::op("basic.qos"))?;
        ch.basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::op("basic.consume"))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn the_broker_user_is_taken_from_the_url_and_is_guest_without_one() {
        let broker = |url: &str| {
            Broker::new(
                BrokerConfig {
                    url: url.into(),
                    ..Default::default()
                },
                Topology::new("vq"),
                vec![],
            )
        };
        assert_eq!(broker("amqp://vq%2Dctl:pw@h:5672/%2f").user(), "vq-ctl");
        // RabbitMQ's (and lapin's) default login: control messages must
        // carry it as user_id, or every agent ignores them.
        assert_eq!(broker("amqp://host/%2f").user(), "guest");
    }
}
