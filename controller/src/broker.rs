//! The controller's RabbitMQ side: one long-lived connection that declares
//! the topology, listens to agent events (`agent.#`: heartbeats, delete
//! answers, drained notices) and bridge demand, reads pool queue depths and
//! publishes control messages to agents.
//!
//! What the consumers hear goes into the event book ([`crate::events`]);
//! the dead-letter watch is [`crate::dead_watch`]. The [`BrokerApi`] and
//! [`Messenger`] traits the loop and its fakes use live here, beside the
//! real implementation.
//!
//! Fencing (DESIGN.md, "Leases"): before a server is deleted its agent id
//! is put into the durable fence queue `<c>.fence` ([`Broker::mark_fence`]);
//! once the server is gone from Nova, [`Broker::fence`] empties the agent's
//! lease queue (rerunnable jobs back to their pool with the loss counter
//! incremented, past the limit or non-rerunnable: `job.failed` and dead
//! letter), deletes it and removes the fence entry. The fence queue keeps
//! the controller stateless: a restart between delete and requeue loses
//! nothing.
//!
//! Dead letters: see [`crate::dead_watch`].

use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use vq_common::amqp::{
    self, bounded, envelope, header_str, header_u32, with_header_u32, AmqpError,
};
use vq_common::config::BrokerConfig;
use vq_common::messages::{Control, Job, JobEvent, JobState, Message, SUBMITTER_HEADER};
use vq_common::topology::{
    job_event_key, Topology, ALL_AGENT_EVENTS, CLAIM_HEADER, LOSSES_HEADER, POOL_HEADER,
};

pub use crate::dead_watch::broker_dead_letter_event;
use crate::dead_watch::watch_dead_letters;
use crate::events::{consume_demand, consume_events, watch_blocked};
pub use crate::events::{record_event, remember_ask, EventSnapshot, Shared, AGENT_RECORD_TTL_SECS};

const OP_TIMEOUT: Duration = Duration::from_secs(15);

struct Session {
    conn: Connection,
    channel: Channel,
    tasks: Vec<JoinHandle<()>>,
}

/// The controller's broker client.
pub struct Broker {
    cfg: BrokerConfig,
    user: String,
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
        }
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
            {
                return Ok(());
            }
            tracing::warn!("broker connection or channel lost; reconnecting");
            for t in &s.tasks {
                t.abort();
            }
            let _ =
                tokio::time::timeout(OP_TIMEOUT, s.conn.close(320, "reconnecting".into())).await;
            let mut sh = self.shared_lock();
            sh.listening_since = None;
            sh.blocked = None;
        }
        *guard = None;
        let conn = amqp::connect(&self.cfg, "vq-controller").await?;
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
        let demand = self.start_demand(&conn).await?;
        let dead = self.start_dead_watch(&conn).await?;
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
        *guard = Some(Session {
            conn,
            channel,
            tasks: vec![events, demand, alarms, dead],
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
            &[ALL_AGENT_EVENTS],
            "vq-controller-events",
        )
        .await?;
        let shared = self.shared.clone();
        Ok(tokio::spawn(consume_events(consumer, shared, ch)))
    }

    async fn start_demand(&self, conn: &Connection) -> Result<JoinHandle<()>, AmqpError> {
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open (demand)"))?;
        let consumer =
            consume_acked(&ch, &self.topo.demand_queue(), "vq-controller-demand", 100).await?;
        let shared = self.shared.clone();
        Ok(tokio::spawn(consume_demand(consumer, shared, ch)))
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
        )))
    }

    /// A copy of the agent and demand state, with old records pruned.
    pub fn snapshot(&self, now: Instant) -> EventSnapshot {
        self.shared_lock().snapshot(now)
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

    /// Records (durably, confirmed) that `agent` is being fenced: call it
    /// before deleting its server.
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn mark_fence(&self, agent: &str) -> Result<(), AmqpError> {
        let channel = self.channel().await?;
        amqp::publish_confirmed(
            &channel,
            &self.topo.fence_exchange(),
            &self.topo.fence_queue(),
            agent.as_bytes(),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("text/plain".into()),
            true,
            Duration::from_secs(self.cfg.confirm_timeout_secs),
        )
        .await
    }

    /// Agent ids in the fence queue (deduplicated, sorted).
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn pending_fences(&self) -> Result<Vec<String>, AmqpError> {
        self.read_ids(&self.topo.fence_queue()).await
    }

    /// Entries of the agent registry ([`Topology::agents_queue`]):
    /// `(agent id, pool)`, deduplicated and sorted; entries without a pool
    /// header get pool `""` (they match no configured pool).
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn registered_agents(&self) -> Result<Vec<(String, String)>, AmqpError> {
        let mut out: Vec<(String, String)> = self
            .read_entries(&self.topo.agents_queue())
            .await?
            .into_iter()
            .map(|(agent, pool)| (agent, pool.unwrap_or_default()))
            .collect();
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Reads every entry (an agent id) of `queue` and returns them all to
    /// it; deduplicated and sorted.
    async fn read_ids(&self, queue: &str) -> Result<Vec<String>, AmqpError> {
        let mut out: Vec<String> = self
            .read_entries(queue)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Reads every entry of `queue` (body: an agent id; header
    /// [`POOL_HEADER`]: its pool, if set) and returns them all to it.
    async fn read_entries(&self, queue: &str) -> Result<Vec<(String, Option<String>)>, AmqpError> {
        let ch = self.fresh_channel().await?;
        let r = bounded(&format!("read {queue}"), OP_TIMEOUT, async {
            let mut out = Vec::new();
            while let Some(m) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(AmqpError::op("basic.get (agent ids)"))?
            {
                out.push((
                    String::from_utf8_lossy(&m.delivery.data).into_owned(),
                    header_str(&m.delivery.properties, POOL_HEADER),
                ));
                if out.len() > 10_000 {
                    break;
                }
            }
            Ok(out)
        })
        .await;
        // Closing the channel returns every entry read to the queue.
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "read".into())).await;
        r
    }

    /// Empties `agent`'s lease queue (see the module doc), deletes it and
    /// removes `agent` from the fence queue. Call it only when the agent's
    /// server is gone (deleted), so no job runs twice. Idempotent.
    ///
    /// # Errors
    /// [`AmqpError`]; what was done stays done, the rest is retried on the
    /// next call.
    pub async fn fence(&self, agent: &str, loss_limit: u32) -> Result<FenceReport, AmqpError> {
        let ch = self.fresh_channel().await?;
        let r = self.fence_on(&ch, agent, loss_limit).await;
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "fenced".into())).await;
        if r.is_ok() {
            self.shared_lock().agents.remove(agent);
        }
        r
    }

    async fn fence_on(
        &self,
        ch: &Channel,
        agent: &str,
        loss_limit: u32,
    ) -> Result<FenceReport, AmqpError> {
        let lease = self.topo.lease_queue(agent);
        // Declaring (not passively) never fails on a missing queue.
        amqp::declare_lease_queue(ch, &self.topo, agent).await?;
        let confirm = Duration::from_secs(self.cfg.confirm_timeout_secs);
        let submitter = self.user();
        let mut report = FenceReport::default();
        // Read every lease first (held unacked), then look up which of them
        // already have a final result: an agent that died between
        // publishing its result and releasing the lease must not get its
        // job run again.
        let mut leases = Vec::new();
        loop {
            let got = bounded("read a lease", OP_TIMEOUT, async {
                ch.basic_get(lease.as_str().into(), BasicGetOptions { no_ack: false })
                    .await
                    .map_err(AmqpError::op("basic.get lease"))
            })
            .await?;
            let Some(m) = got else { break };
            leases.push(m.delivery);
            if leases.len() > 10_000 {
                break;
            }
        }
        let done = if leases.is_empty() {
            std::collections::BTreeSet::new()
        } else {
            let since = leases
                .iter()
                .filter_map(|d| *d.properties.timestamp())
                .min()
                .unwrap_or(0);
            let ids: std::collections::BTreeSet<String> =
                leases.iter().filter_map(lease_job_id).collect();
            self.final_results_since(since.saturating_sub(60), &ids)
                .await?
        };
        for d in leases {
            if let Some(id) = lease_job_id(&d).filter(|id| done.contains(id)) {
                tracing::info!(agent, job_id = %id, "lease of a job whose result was already published: dropped");
                bounded("ack a lease", OP_TIMEOUT, async {
                    d.acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(AmqpError::op("ack lease"))
                })
                .await?;
                continue;
            }
            if let Some(claim) = header_str(&d.properties, CLAIM_HEADER) {
                // Only a copy whose claim marker names it is the job's
                // claim; any other is a copy the agent made while a
                // connection was lost, of a job that is elsewhere.
                let id = lease_job_id(&d).unwrap_or_default();
                let marker_ch = self.fresh_channel().await?;
                let marker =
                    amqp::claim_marker(&marker_ch, &self.topo, &id, agent, &claim, false).await;
                let _ =
                    tokio::time::timeout(OP_TIMEOUT, marker_ch.close(200, "looked".into())).await;
                if vq_common::lease::leftover(marker?) == vq_common::lease::Leftover::Discard {
                    tracing::info!(agent, job_id = %id, "lease copy of a claim that never held the job: dropped");
                    bounded("ack a lease", OP_TIMEOUT, async {
                        d.acker
                            .ack(BasicAckOptions::default())
                            .await
                            .map_err(AmqpError::op("ack lease"))
                    })
                    .await?;
                    continue;
                }
            }
            let losses = header_u32(&d.properties, LOSSES_HEADER).saturating_add(1);
            let decoded = Job::decode(&d.data);
            let job_id = envelope::job_id(decoded.as_ref().ok(), &d.properties).unwrap_or_default();
            if let Some(reason) = self.blocked() {
                // Nothing of this lease is written yet: stop here; the
                // channel's close returns it and the rest to the queue.
                return Err(AmqpError::Timeout {
                    what: format!(
                        "fence of {agent} paused: the broker blocks publishing ({reason})"
                    ),
                    secs: 0,
                });
            }
            let blocked = || self.blocked().is_some();
            match lease_fate(decoded.as_ref().ok(), agent, losses, loss_limit) {
                LeaseFate::Requeue { pool } => {
                    // The job's claim marker goes first, or the requeued
                    // copy would be taken for a copy of a claimed job. A
                    // not-rerunnable job's marker stays (until its TTL), so
                    // that a stray copy of it never runs.
                    self.delete_claim_marker(ch, &job_id).await?;
                    let mut props = with_header_u32(d.properties.clone(), LOSSES_HEADER, losses);
                    props = props.with_user_id(submitter.into());
                    amqp::publish_confirmed_patiently(
                        ch,
                        &self.topo.jobs_exchange(),
                        &pool,
                        &d.data,
                        props,
                        true,
                        confirm,
                        &blocked,
                    )
                    .await?;
                    tracing::warn!(agent, job_id = %job_id, pool = %pool, losses, "fenced agent's job returned to its pool");
                    report.requeued.push(job_id);
                }
                LeaseFate::Fail { reason } => {
                    let pool = decoded.as_ref().map(|j| j.pool.clone()).unwrap_or_default();
                    let props = dead_props(&d.properties, &reason, losses);
                    amqp::publish_confirmed_patiently(
                        ch,
                        &self.topo.dead_exchange(),
                        &pool,
                        &d.data,
                        props,
                        false,
                        confirm,
                        &blocked,
                    )
                    .await?;
                    if let Ok(job) = &decoded {
                        let submitter = header_str(&d.properties, SUBMITTER_HEADER);
                        let mut event = JobEvent::about(
                            Some(job),
                            &job.id,
                            &job.pool,
                            agent,
                            submitter.as_deref(),
                            JobState::Failed {
                                reason: reason.clone(),
                            },
                        );
                        event.attempt = losses;
                        amqp::publish_confirmed_patiently(
                            ch,
                            &self.topo.events_exchange(),
                            &job_event_key(&job.pool, "failed"),
                            &event.encode(),
                            amqp::event_properties(&event),
                            false,
                            confirm,
                            &blocked,
                        )
                        .await?;
                    }
                    tracing::warn!(agent, job_id = %job_id, reason = %reason, "fenced agent's job failed and dead-lettered");
                    report.failed.push(job_id);
                }
            }
            bounded("ack a lease", OP_TIMEOUT, async {
                d.acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(AmqpError::op("ack lease"))
            })
            .await?;
        }
        // Registry entries first: an agent (wrongly fenced, alive) that
        // finds its lease queue gone registers again, and that entry must
        // survive this fence.
        self.remove_entries(ch, &self.topo.agents_queue(), agent)
            .await?;
        bounded("delete the lease queue", OP_TIMEOUT, async {
            ch.queue_delete(lease.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(AmqpError::op("delete lease queue"))
        })
        .await?;
        self.remove_entries(ch, &self.topo.fence_queue(), agent)
            .await?;
        tracing::info!(
            agent,
            requeued = report.requeued.len(),
            failed = report.failed.len(),
            "agent fenced: lease queue emptied and deleted"
        );
        Ok(report)
    }

    /// Deletes the claim marker of job `job_id` (see `vq_common::lease`);
    /// deleting a missing queue succeeds.
    async fn delete_claim_marker(&self, ch: &Channel, job_id: &str) -> Result<(), AmqpError> {
        if job_id.is_empty() {
            return Ok(());
        }
        let marker = self.topo.claim_queue(job_id);
        bounded("delete a claim marker", OP_TIMEOUT, async {
            ch.queue_delete(marker.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(AmqpError::op("delete claim marker"))
        })
        .await?;
        Ok(())
    }

    /// Job ids among `ids` with a final event (`finished`, `failed`,
    /// `cancelled`) in the job-event stream since Unix second `since`.
    async fn final_results_since(
        &self,
        since: u64,
        ids: &std::collections::BTreeSet<String>,
    ) -> Result<std::collections::BTreeSet<String>, AmqpError> {
        let ch = self.fresh_channel().await?;
        let stream = self.topo.event_log_queue();
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), AMQPValue::Timestamp(since));
        let mut consumer = bounded("read the job-event stream", OP_TIMEOUT, async {
            ch.basic_qos(500, BasicQosOptions::default())
                .await
                .map_err(AmqpError::op("basic.qos (stream)"))?;
            ch.basic_consume(
                stream.as_str().into(),
                "vq-controller-fence".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .map_err(AmqpError::op("consume the job-event stream"))
        })
        .await?;
        let mut found = std::collections::BTreeSet::new();
        let started = std::time::Instant::now();
        // A stream never ends: read until it is quiet for a moment.
        while started.elapsed() < Duration::from_secs(60) {
            match tokio::time::timeout(Duration::from_millis(700), consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    if !d.routing_key.as_str().ends_with(".started") {
                        if let Ok(ev) = JobEvent::decode(&d.data) {
                            if ids.contains(&ev.job_id) {
                                found.insert(ev.job_id);
                            }
                        }
                    }
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                }
                Ok(Some(Err(e))) => return Err(AmqpError::op("read the job-event stream")(e)),
                Ok(None) | Err(_) => break,
            }
        }
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "read".into())).await;
        Ok(found)
    }

    /// Removes every entry `agent` from `queue` (the fence queue or the
    /// agent registry), returning the others.
    async fn remove_entries(
        &self,
        ch: &Channel,
        queue: &str,
        agent: &str,
    ) -> Result<(), AmqpError> {
        bounded(&format!("remove {agent} from {queue}"), OP_TIMEOUT, async {
            let mut others = Vec::new();
            while let Some(m) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(AmqpError::op("basic.get (agent ids)"))?
            {
                if m.delivery.data == agent.as_bytes() {
                    m.delivery
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(AmqpError::op("ack fence entry"))?;
                } else {
                    others.push(m.delivery.acker);
                }
                if others.len() > 10_000 {
                    break;
                }
            }
            for a in others {
                a.nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .map_err(AmqpError::op("requeue fence entry"))?;
            }
            Ok(())
        })
        .await
    }

    /// Closes the connection (before the runtime is dropped).
    pub async fn close(&self) {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.take() {
            for t in &s.tasks {
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
}

/// What fencing one agent did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FenceReport {
    /// Job ids returned to their pool.
    pub requeued: Vec<String>,
    /// Job ids reported failed and dead-lettered.
    pub failed: Vec<String>,
}

/// The lease-fate rule, shared with the agent's own recovery.
pub use vq_common::lease::{fate as lease_fate, LeaseFate};

fn lease_job_id(d: &lapin::message::Delivery) -> Option<String> {
    envelope::job_id_of(&d.properties, &d.data)
}

/// The dead letter of a fenced agent's lease copy with properties
/// `lease`: the common envelope ([`envelope::dead_letter_properties`]),
/// dead by `vq-controller`, the submitter the agent judged the job by (its
/// lease copy's [`SUBMITTER_HEADER`], written by the agent, never the
/// original publisher's), and the loss count.
fn dead_props(lease: &BasicProperties, reason: &str, losses: u32) -> BasicProperties {
    let submitter = header_str(lease, SUBMITTER_HEADER);
    let props = envelope::dead_letter_properties(
        lease,
        reason,
        envelope::CONTROLLER_DEAD_BY,
        submitter.as_deref(),
    );
    with_header_u32(props, LOSSES_HEADER, losses)
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

    fn job(rerunnable: bool) -> Job {
        let mut j: Job = serde_json::from_str(
            r#"{"id":"7.x","name":"n","owner":"alice","pool":"cms","script":"true","submit_host":"h","submitted_at":0}"#,
        )
        .unwrap();
        j.rerunnable = rerunnable;
        j
    }

    #[test]
    fn leases_of_lost_agents_are_requeued_until_the_loss_limit() {
        assert_eq!(
            lease_fate(Some(&job(true)), "a1", 1, 3),
            LeaseFate::Requeue { pool: "cms".into() }
        );
        assert_eq!(
            lease_fate(Some(&job(true)), "a1", 2, 3),
            LeaseFate::Requeue { pool: "cms".into() }
        );
        match lease_fate(Some(&job(true)), "a1", 3, 3) {
            LeaseFate::Fail { reason } => assert!(reason.contains("3 times"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match lease_fate(Some(&job(false)), "a1", 1, 3) {
            LeaseFate::Fail { reason } => assert!(reason.contains("node lost"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            lease_fate(None, "a1", 1, 3),
            LeaseFate::Fail { .. }
        ));
    }

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
