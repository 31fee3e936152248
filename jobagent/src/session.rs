//! The broker session: connect, declare, consume the pool queue and the
//! control queue, and reconnect with backoff when the broker goes away.
//! Running jobs are not tied to a session: they keep running and publish
//! their results on the next one.
//!
//! Claims happen only in this loop, and so do the answers to ask-delete and
//! drain, which makes "no job claimed → stop pulling" atomic with respect to
//! taking a job. A claimed pool delivery is acked seconds later, after its
//! lease copy is confirmed (`job`), so the consumer is cancelled while
//! every slot is taken and started again with prefetch = free slots.
//!
//! Every session declares the agent's lease queue and scans it before it
//! consumes: leases left by a previous agent process are recovered, lease
//! removals that failed during an outage are completed.
//!
//! A session has two connections, as RabbitMQ advises for clients that both
//! publish and consume (<https://www.rabbitmq.com/docs/alarms>): during a
//! memory or disk alarm the broker stops reading from connections that
//! publish (`connection.blocked`) but not from connections that only
//! consume. The *consuming* connection carries the pool, control and lease
//! channels (deliveries, acks, `basic.get`, cancels), so control messages
//! are still received and acted on; the *publishing* connection carries
//! events, heartbeats, answers, claims and dead letters, which wait while
//! it is blocked ([`crate::report::Publisher`]). While blocked the agent
//! stops pulling (a claim could not be written) and skips heartbeats.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use vq_common::amqp::{
    bounded, confirm_channel, connect, declare_bound_queue, declare_exchanges, declare_lease_queue,
    declare_pool_queue, envelope, subscribe, AmqpError,
};
use vq_common::backoff::Backoff;
use vq_common::messages::{
    unix_now, Control, ControlAnswer, ControlOutcome, ControlRequest, DeleteAnswer, Job, Message,
    SCHEMA_VERSION,
};
use vq_common::topology::agent_event_key;

use crate::ctx::Ctx;
use crate::error::{chain, AgentError};
use crate::job::{drop_duplicate, handle_delivery, scan_leases, NewClaim};
use crate::state::{CancelOutcome, Claim, Reply};

/// Bound on broker operations in this module.
const OP_TIMEOUT: Duration = Duration::from_secs(15);

/// How often the session checks its connection and free slots.
const TICK: Duration = Duration::from_secs(1);

/// The reconnect backoff between broker sessions: from 0.5 s doubling up
/// to 30 s.
const RECONNECT: Backoff =
    Backoff::new_unchecked(Duration::from_millis(500), Duration::from_secs(30));

/// Where a session announces its channels and state to the rest of the
/// agent.
pub(crate) struct Links {
    /// The confirm channel on the publishing connection (`None` while
    /// disconnected).
    pub(crate) channel_tx: watch::Sender<Option<Channel>>,
    /// The lease channel on the consuming connection (`None` while
    /// disconnected).
    pub(crate) lease_tx: watch::Sender<Option<Channel>>,
    /// The consuming connection, for claim markers (`None` while
    /// disconnected).
    pub(crate) conn_tx: watch::Sender<Option<Arc<Connection>>>,
    /// True while the broker blocks the publishing connection (set by a
    /// task that follows the connection's events from its first moment,
    /// so publishes before the session loop see it too).
    pub(crate) blocked_tx: Arc<watch::Sender<bool>>,
}

impl Links {
    fn disconnected(&self) {
        self.channel_tx.send_replace(None);
        self.lease_tx.send_replace(None);
        self.conn_tx.send_replace(None);
        self.blocked_tx.send_replace(false);
    }
}

/// Keeps a broker session up until `stop`, announcing it on `links`.
///
/// Between sessions it waits [`RECONNECT`]'s delay. The delay starts over
/// only after a *proven* session (one that proved the permissions a claim
/// needs, see [`prove_session`]) that did not end by a broker refusal;
/// a session that could not publish, or that a refusal ended (a missing
/// permission, inequivalent arguments), makes the next wait longer, so a
/// permanent fault costs one attempt per backoff step, not two a second.
pub(crate) async fn connection_loop(ctx: Arc<Ctx>, links: Links, stop: CancellationToken) {
    use std::sync::atomic::Ordering;
    let mut backoff = RECONNECT;
    loop {
        if stop.is_cancelled() {
            break;
        }
        let mut proven = false;
        ctx.session_refused.store(false, Ordering::SeqCst);
        let refused = match session(&ctx, &links, &stop, &mut proven).await {
            Ok(()) => break,
            Err(e) => {
                warn!(pool = %ctx.cfg.pool, error = %chain(&e), "broker session ended; reconnecting");
                matches!(&e, AgentError::Amqp(a) if !a.is_transient())
            }
        };
        if proven && !refused && !ctx.session_refused.swap(false, Ordering::SeqCst) {
            backoff.reset();
        }
        links.disconnected();
        let delay = backoff.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.cancelled() => break,
        }
    }
    links.disconnected();
}

async fn session(
    ctx: &Arc<Ctx>,
    links: &Links,
    stop: &CancellationToken,
    proven: &mut bool,
) -> Result<(), AgentError> {
    let name = format!("jobagent {}", ctx.agent);
    let conns = tokio::select! {
        c = async {
            let conn = connect(&ctx.cfg.broker, &name).await?;
            match connect(&ctx.cfg.broker, &format!("{name} publish")).await {
                Ok(p) => Ok((conn, p)),
                Err(e) => {
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "jobagent reconnecting".into())).await;
                    Err(e)
                }
            }
        } => c?,
        _ = stop.cancelled() => return Ok(()),
    };
    let (conn, pub_conn) = conns;
    let conn = Arc::new(conn);
    let pub_conn = Arc::new(pub_conn);
    let result = run_session(ctx, &conn, &pub_conn, links, stop, proven).await;
    links.disconnected();
    // A blocked publishing connection does not read our close: bounded.
    for c in [&*conn, &*pub_conn] {
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            c.close(200, "jobagent stopping".into()),
        )
        .await;
    }
    result
}

async fn run_session(
    ctx: &Arc<Ctx>,
    conn: &Arc<Connection>,
    pub_conn: &Arc<Connection>,
    links: &Links,
    stop: &CancellationToken,
    proven: &mut bool,
) -> Result<(), AgentError> {
    let topo = &ctx.topo;
    let pool = &ctx.cfg.pool;
    // Before any publish of this session (declares, registration, lease
    // scan): a broker in alarm blocks us at the first one.
    let follower = AbortOnDrop(tokio::spawn(follow_blocked(
        pub_conn.events_listener(),
        links.blocked_tx.clone(),
        pool.clone(),
    )));
    let mut blocked_rx = links.blocked_tx.subscribe();
    let pub_ch = confirm_channel(pub_conn).await?;
    declare_exchanges(&pub_ch, topo).await?;
    declare_pool_queue(&pub_ch, topo, pool).await?;
    // The dead-letter queue too: a job refused before any controller ran
    // must not vanish into an exchange without a bound queue.
    declare_bound_queue(
        &pub_ch,
        &topo.dead_queue(),
        &topo.dead_queue_args(),
        &topo.dead_exchange(),
        "",
    )
    .await?;
    // A lease queue missing at a session start after the first one was
    // deleted under us (a fence, which also removed our registry entry):
    // register again once it is declared again.
    if !lease_queue_exists(conn, &topo.lease_queue(&ctx.agent)).await? {
        ctx.registered
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
    declare_lease_queue(&pub_ch, topo, &ctx.agent).await?;
    let lease_ch = bounded("open lease channel", OP_TIMEOUT, async {
        conn.create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))
    })
    .await?;

    let ctl_ch = bounded("open control channel", OP_TIMEOUT, async {
        conn.create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))
    })
    .await?;
    let ctl_queue = topo.control_queue(&ctx.agent);
    let mut control = subscribe(
        &ctl_ch,
        &ctl_queue,
        &topo.control_exchange(),
        &[ctx.agent.as_str()],
        "",
    )
    .await?;

    let jobs_ch = bounded("open jobs channel", OP_TIMEOUT, async {
        conn.create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))
    })
    .await?;

    links.channel_tx.send_replace(Some(pub_ch.clone()));
    links.lease_tx.send_replace(Some(lease_ch.clone()));
    links.conn_tx.send_replace(Some(conn.clone()));
    ctx.restart_session
        .store(false, std::sync::atomic::Ordering::SeqCst);
    // Claims left unsettled by the previous session resolve now, on these
    // channels; nothing is pulled before they have.
    ctx.session.send_modify(|g| *g += 1);
    register(ctx, &pub_ch).await?;
    scan_leases(ctx).await?;
    // A claim that cannot settle on this session (its marker declaration
    // failed again) asks for the next one: wait for that as well, or the
    // claim would wait for a session that waits for it.
    loop {
        if ctx
            .restart_session
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(AgentError::Resolving {
                what: "a claim left unsettled by the previous session",
            });
        }
        tokio::select! {
            _ = ctx.shared.wait_settled() => break,
            _ = ctx.shared.pull_changed.notified() => {}
            _ = stop.cancelled() => return Ok(()),
        }
    }
    info!(pool = %pool, agent = %ctx.agent, "connected to the broker");
    // The session pulls only after it proved every permission a claim
    // needs ([`prove_session`]): a job delivered to a session that cannot
    // claim and report it goes back to the pool, spending its delivery
    // limit, on every attempt. Concurrent with the loop, so that control
    // messages are answered while the broker blocks publishing (alarm).
    let mut probe = Some(Box::pin(prove_session(ctx)));

    let mut consumer: Option<Consumer> = None;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut blocked = *blocked_rx.borrow_and_update();
    loop {
        if ctx
            .lease_queue_gone
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            drop(follower);
            return Err(AgentError::Lost {
                what: "lease queue (deleted, e.g. by a fence): declaring it again",
            });
        }
        if ctx
            .restart_session
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            drop(follower);
            return Err(AgentError::Resolving {
                what: "an outcome (a lost confirm or reply, or a refused claim step)",
            });
        }
        // Pull only while the publishing side is up: a claim starts with a
        // confirmed publish.
        let can_publish = pub_conn.status().connected() && pub_ch.status().connected();
        if !can_publish {
            if let Some(c) = consumer.take() {
                let _ = stop_consumer(ctx, &jobs_ch, c).await;
            }
            return Err(AgentError::Lost {
                what: "publishing connection",
            });
        }
        let now = Pull {
            consuming: consumer.is_some(),
            proven: *proven,
            wants_pull: ctx.shared.wants_pull(),
            blocked,
            free: ctx.shared.free_slots(),
        };
        match now.step() {
            PullStep::Start { prefetch } => {
                consumer = Some(start_consumer(ctx, &jobs_ch, prefetch).await?);
            }
            PullStep::Stop => {
                if let Some(c) = consumer.take() {
                    stop_consumer(ctx, &jobs_ch, c).await?;
                }
            }
            PullStep::Keep => {}
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            r = async { probe.as_mut().expect("guarded by the condition").await }, if probe.is_some() => {
                probe = None;
                r?;
                *proven = true;
                debug!("the session proved its permissions: pulling allowed");
            }
            d = next_delivery(&mut consumer) => match d {
                Some(Ok(delivery)) => {
                    let task = dispatch(ctx, delivery, &jobs_ch).await;
                    // Cancel before the claim can ack: with prefetch = free
                    // slots nothing else is in flight, so a full agent
                    // requeues nothing (requeues count towards the pool
                    // queue's delivery limit). A job of several slots can
                    // fill the agent while the broker has already sent
                    // more of the prefetch: those (and only those: none
                    // come after cancel-ok) are claimed too and wait for
                    // slots (`Shared::wait_for_slots`), not requeued.
                    let mut tasks: Vec<_> = task.into_iter().collect();
                    let stopped = match consumer.take() {
                        Some(c) if ctx.shared.is_full() => {
                            match stop_consumer_keeping(ctx, &jobs_ch, c).await {
                                Ok(buffered) => {
                                    for d in buffered {
                                        tasks.extend(dispatch(ctx, d, &jobs_ch).await);
                                    }
                                    Ok(())
                                }
                                Err(e) => Err(e),
                            }
                        }
                        other => {
                            consumer = other;
                            Ok(())
                        }
                    };
                    for t in tasks {
                        tokio::spawn(t);
                    }
                    stopped?;
                }
                Some(Err(e)) => return Err(AmqpError::op("consume pool queue")(e).into()),
                None => return Err(AgentError::Lost { what: "pool queue consumer" }),
            },
            c = control.next() => match c {
                Some(Ok(msg)) => {
                    let from = Requester::of(&msg.properties);
                    on_control(ctx, &jobs_ch, &mut consumer, &msg.data, &from, pub_conn).await?
                }
                Some(Err(e)) => return Err(AmqpError::op("consume control queue")(e).into()),
                None => return Err(AgentError::Lost { what: "control queue consumer" }),
            },
            changed = blocked_rx.changed() => {
                if changed.is_err() {
                    return Err(AgentError::Lost { what: "publishing connection events" });
                }
                blocked = *blocked_rx.borrow_and_update();
                if !blocked {
                    ctx.shared.heartbeat_now.notify_one();
                }
            }
            // Stopping and restarting the consumer happens at the top of
            // the loop.
            _ = ctx.shared.pull_changed.notified() => {}
            _ = tick.tick() => {
                if !conn.status().connected() {
                    return Err(AgentError::Lost { what: "connection" });
                }
                if !pub_conn.status().connected() {
                    return Err(AgentError::Lost { what: "publishing connection" });
                }
                for (ch, what) in [(&pub_ch, "publish channel"), (&ctl_ch, "control channel"), (&jobs_ch, "jobs channel"), (&lease_ch, "lease channel")] {
                    if !ch.status().connected() {
                        return Err(AgentError::Lost { what });
                    }
                }
            }
        }
    }
}

/// What the session loop knows when it decides about the pool consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pull {
    /// A pool consumer is running.
    consuming: bool,
    /// The session proved its permissions ([`prove_session`]).
    proven: bool,
    /// The agent's mode takes jobs ([`crate::state::Mode`]: pulling).
    wants_pull: bool,
    /// The broker blocks the publishing connection (resource alarm).
    blocked: bool,
    /// Free job slots.
    free: usize,
}

/// What to do with the pool consumer ([`Pull::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PullStep {
    /// Start consuming with `prefetch` = the free slots.
    Start { prefetch: usize },
    /// Cancel the consumer (its unclaimed deliveries go back).
    Stop,
    /// Leave it as it is.
    Keep,
}

impl Pull {
    /// The one rule: consume only in a proven session, in a mode that
    /// takes jobs, with a slot free and publishing not blocked (a claim
    /// starts with a confirmed publish); otherwise cancel a running
    /// consumer, so that nothing is delivered that cannot be claimed.
    fn step(self) -> PullStep {
        let may = self.proven && self.wants_pull && !self.blocked && self.free > 0;
        match (self.consuming, may) {
            (false, true) => PullStep::Start {
                prefetch: self.free,
            },
            (true, false) => PullStep::Stop,
            _ => PullStep::Keep,
        }
    }
}

/// Proves, before the session pulls, the permissions a claim needs, each
/// with an operation that leaves nothing behind: the session's first
/// heartbeat (write on `<c>.events`, where `started` and results go), a
/// confirmed publish to `<c>.lease` that routes nowhere (write there, for
/// lease copies), and a claim marker declared and deleted under a name no
/// job id can have (`<c>.claim..probe.<agent>`: job ids never start with
/// `.`; configure on `<c>.claim.*`).
///
/// # Errors
/// [`AgentError::Amqp`]: e.g. 403 ACCESS_REFUSED naming the exchange or
/// queue and the user, when the account lacks a documented permission.
async fn prove_session(ctx: &Ctx) -> Result<(), AgentError> {
    let hb = crate::heartbeat::heartbeat(ctx);
    ctx.publisher
        .publish_once(
            &ctx.topo.events_exchange(),
            &agent_event_key(&ctx.cfg.pool, "heartbeat"),
            &hb.encode(),
            vq_common::amqp::json_properties::<vq_common::messages::Heartbeat>(),
        )
        .await?;
    ctx.publisher
        .publish_once(
            &ctx.topo.lease_exchange(),
            ".probe",
            b"",
            lapin::BasicProperties::default(),
        )
        .await?;
    let probe = format!(".probe.{}", ctx.agent);
    ctx.markers.claim(&probe, "probe").await?;
    ctx.markers.delete(&probe).await?;
    Ok(())
}

/// Puts this agent's id and pool into the agent registry before it can
/// claim a job: once per process, and again in a session that found its
/// lease queue missing (a fence removed the entry too). A controller that
/// never heard this agent (its server vanished while no controller
/// listened) still finds its lease queue.
async fn register(ctx: &Ctx, ch: &Channel) -> Result<(), AgentError> {
    use std::sync::atomic::Ordering;
    if ctx.registered.load(Ordering::SeqCst) {
        return Ok(());
    }
    let queue = ctx.topo.agents_queue();
    vq_common::amqp::declare_agents_queue(ch, &ctx.topo).await?;
    ctx.publisher
        .publish_once_mandatory(
            &ctx.topo.agents_exchange(),
            &queue,
            ctx.agent.as_bytes(),
            lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("text/plain".into())
                .with_headers(pool_header(&ctx.cfg.pool)),
            true,
        )
        .await?;
    ctx.registered.store(true, Ordering::SeqCst);
    debug!(queue = %queue, "registered in the agent registry");
    Ok(())
}

/// Whether `queue` exists (passive declare on a throwaway channel: a
/// missing queue closes it with 404).
async fn lease_queue_exists(conn: &Connection, queue: &str) -> Result<bool, AgentError> {
    let ch = bounded("open probe channel", OP_TIMEOUT, async {
        conn.create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))
    })
    .await?;
    let exists = vq_common::amqp::queue_exists(&ch, queue, "probe lease queue").await?;
    if exists {
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "probed".into())).await;
    }
    Ok(exists)
}

fn pool_header(pool: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        vq_common::topology::POOL_HEADER.into(),
        lapin::types::AMQPValue::LongString(pool.into()),
    );
    t
}

/// Aborts the task when dropped (the session's helper tasks end with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Follows `connection.blocked` / `unblocked` of the publishing connection
/// into `blocked` until the connection's event stream ends.
async fn follow_blocked(
    events: impl futures_util::Stream<Item = lapin::Event>,
    blocked: Arc<watch::Sender<bool>>,
    pool: String,
) {
    futures_util::pin_mut!(events);
    while let Some(e) = events.next().await {
        match e {
            lapin::Event::ConnectionBlocked(reason) => {
                warn!(pool = %pool, reason = %reason, "the broker blocks publishing (resource alarm): results, answers and claims wait, heartbeats are skipped, not pulling jobs");
                blocked.send_replace(true);
            }
            lapin::Event::ConnectionUnblocked => {
                info!(pool = %pool, "the broker accepts publishing again");
                blocked.send_replace(false);
            }
            _ => {}
        }
    }
}

async fn next_delivery(consumer: &mut Option<Consumer>) -> Option<lapin::Result<Delivery>> {
    match consumer {
        Some(c) => c.next().await,
        None => std::future::pending().await,
    }
}

/// Starts consuming the pool queue with prefetch = `free` slots.
async fn start_consumer(ctx: &Ctx, ch: &Channel, free: usize) -> Result<Consumer, AgentError> {
    let prefetch = u16::try_from(free).unwrap_or(u16::MAX).max(1);
    let queue = ctx.topo.pool_queue(&ctx.cfg.pool);
    let consumer = bounded("start pool consumer", OP_TIMEOUT, async {
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(AmqpError::op("basic.qos"))?;
        ch.basic_consume(
            queue.as_str().into(),
            format!("{}-{}", ctx.agent, uuid::Uuid::new_v4().simple()).into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::op("consume pool queue"))
    })
    .await?;
    info!(pool = %ctx.cfg.pool, queue = %queue, prefetch, "pulling jobs");
    ctx.shared.started_pulling();
    Ok(consumer)
}

/// Cancels the pool consumer, waits for `basic.cancel-ok`, and returns every
/// delivery that arrived but was not claimed to the queue.
async fn stop_consumer(ctx: &Ctx, ch: &Channel, consumer: Consumer) -> Result<(), AgentError> {
    for d in stop_consumer_keeping(ctx, ch, consumer).await? {
        requeue(&d).await;
    }
    Ok(())
}

/// Cancels the pool consumer, waits for `basic.cancel-ok`, and returns the
/// deliveries that arrived but were not claimed (the caller claims or
/// requeues them; none arrive after cancel-ok).
async fn stop_consumer_keeping(
    ctx: &Ctx,
    ch: &Channel,
    mut consumer: Consumer,
) -> Result<Vec<Delivery>, AgentError> {
    bounded("cancel pool consumer", OP_TIMEOUT, async {
        ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await
            .map_err(AmqpError::op("basic.cancel"))
    })
    .await?;
    // After cancel-ok the stream yields what was buffered, then ends.
    let mut buffered = Vec::new();
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await
    {
        buffered.push(d);
    }
    info!(pool = %ctx.cfg.pool, "stopped pulling jobs");
    Ok(buffered)
}

async fn requeue(d: &Delivery) {
    let r = d
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await;
    match r {
        Ok(true) => debug!("returned an unclaimed delivery to the queue"),
        Ok(false) => {
            warn!("cannot requeue a delivery: its channel is gone (the broker requeues it)")
        }
        Err(e) => warn!(error = %chain(&e), "cannot requeue a delivery"),
    }
}

/// Claims a delivery and returns its task (to be spawned), or requeues or
/// drops it.
async fn dispatch(
    ctx: &Arc<Ctx>,
    delivery: Delivery,
    jobs_ch: &Channel,
) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> {
    let decoded = Job::decode(&delivery.data);
    let key = envelope::delivery_key(decoded.as_ref().ok(), &delivery.properties);
    let slots = decoded.as_ref().map(|j| j.slots).unwrap_or(1);
    match ctx.shared.claim(&key, slots) {
        Claim::New { cancel, claim } => Some(Box::pin(handle_delivery(
            ctx.clone(),
            delivery,
            decoded,
            NewClaim { key, cancel, claim },
            jobs_ch.clone(),
        ))),
        Claim::Requeue => {
            requeue(&delivery).await;
            None
        }
        Claim::Duplicate => Some(Box::pin(drop_duplicate(
            ctx.clone(),
            delivery,
            key,
            jobs_ch.clone(),
        ))),
    }
}

/// Who sent a control message, and where it wants its answer.
struct Requester {
    /// The broker-validated `user_id`.
    user: Option<String>,
    /// `reply_to` (a reply queue bound on `<c>.replies`), if an answer is
    /// wanted.
    reply_to: Option<String>,
    /// `correlation_id`, echoed in the answer.
    correlation: Option<String>,
}

impl Requester {
    fn of(p: &lapin::BasicProperties) -> Requester {
        let s = |v: &Option<lapin::types::ShortString>| v.as_ref().map(|v| v.as_str().to_string());
        Requester {
            user: s(p.user_id()),
            reply_to: s(p.reply_to()),
            correlation: s(p.correlation_id()),
        }
    }
}

/// `reason` cut to [`vq_common::messages::MAX_REASON_BYTES`] at a
/// character boundary, without control characters (it goes into logs and
/// heartbeats); `None` for an empty one.
fn clean_reason(reason: Option<String>) -> Option<String> {
    let r: String = reason?.chars().filter(|c| !c.is_control()).collect();
    let r = r.trim();
    let mut end = r.len().min(vq_common::messages::MAX_REASON_BYTES);
    while !r.is_char_boundary(end) {
        end -= 1;
    }
    (!r.is_empty()).then(|| r[..end].to_string())
}

async fn on_control(
    ctx: &Arc<Ctx>,
    jobs_ch: &Channel,
    consumer: &mut Option<Consumer>,
    body: &[u8],
    from: &Requester,
    pub_conn: &Arc<Connection>,
) -> Result<(), AgentError> {
    let msg = match Control::decode(body) {
        Ok(m) => m,
        Err(e) => {
            warn!(error = %chain(&e), "ignoring a malformed control message");
            return Ok(());
        }
    };
    let pool = &ctx.cfg.pool;
    // Control messages are authorised by the broker-validated user_id:
    // admins (the controller, operators) may do anything; others may only
    // cancel their own jobs.
    let Some(sender) = from.user.as_deref() else {
        warn!(pool = %pool, "ignoring a control message without user_id");
        return Ok(());
    };
    let admin = ctx.cfg.control_admins.iter().any(|a| a == sender);
    let answer = |request, job_id: Option<String>, outcome| {
        answer_control(ctx, from, pub_conn, request, job_id, outcome)
    };
    if !admin && !matches!(msg, Control::Cancel { .. }) {
        warn!(pool = %pool, sender, "refusing a control message from a broker user not in control_admins");
        let request = match msg {
            Control::Drain { .. } => ControlRequest::Drain,
            Control::Resume { .. } => ControlRequest::Resume,
            // Ask-delete has its own answer, for the controller only.
            Control::AskDelete { .. } | Control::Cancel { .. } => return Ok(()),
        };
        answer(
            request,
            None,
            ControlOutcome::Refused {
                reason: format!(
                    "broker user {sender:?} is not in control_admins of agent {}",
                    ctx.agent
                ),
            },
        );
        return Ok(());
    }
    match msg {
        Control::AskDelete { request_id } => {
            let answer = match ctx.shared.try_stop_for_delete() {
                Ok(()) => {
                    if let Some(c) = consumer.take() {
                        stop_consumer(ctx, jobs_ch, c).await?;
                    }
                    ctx.shared.mark_deleted();
                    info!(pool = %pool, request_id = %request_id, "asked to go: idle, stopped pulling, may be deleted");
                    (true, Vec::new())
                }
                Err(running) => {
                    info!(pool = %pool, request_id = %request_id, running = ?running, "asked to go: busy, refusing");
                    (false, running)
                }
            };
            let answer = DeleteAnswer {
                schema: SCHEMA_VERSION,
                agent: ctx.agent.clone(),
                pool: pool.clone(),
                request_id,
                may_delete: answer.0,
                running: answer.1,
                at: unix_now(),
            };
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let key = agent_event_key(&ctx.cfg.pool, "answer");
                ctx.publisher
                    .publish_message_reliably(&ctx.topo.events_exchange(), &key, &answer)
                    .await;
            });
        }
        Control::Drain { request_id, reason } => {
            let reason = clean_reason(reason);
            info!(pool = %pool, request_id = %request_id, sender, reason = reason.as_deref().unwrap_or(""), "drain requested");
            let outcome = match ctx.shared.start_drain(reason) {
                Some(epoch) => {
                    if let Some(c) = consumer.take() {
                        stop_consumer(ctx, jobs_ch, c).await?;
                    }
                    tokio::spawn(crate::heartbeat::report_drained(ctx.clone(), epoch));
                    ControlOutcome::Done
                }
                None => ControlOutcome::Already,
            };
            answer(ControlRequest::Drain, None, outcome);
        }
        Control::Resume { request_id, reason } => {
            let reason = clean_reason(reason);
            let outcome = match ctx.shared.resume() {
                Reply::Resume => {
                    info!(pool = %pool, request_id = %request_id, sender, reason = reason.as_deref().unwrap_or(""), "drain resumed: pulling again");
                    ControlOutcome::Done
                }
                Reply::RefuseResume(why) => {
                    warn!(pool = %pool, request_id = %request_id, sender, reason = reason.as_deref().unwrap_or(""), refused = %why, "resume refused");
                    ControlOutcome::Refused {
                        reason: why.to_string(),
                    }
                }
                _ => {
                    info!(pool = %pool, request_id = %request_id, sender, "resume requested, but not draining");
                    ControlOutcome::Already
                }
            };
            answer(ControlRequest::Resume, None, outcome);
        }
        Control::Cancel { job_id } => {
            let outcome = match ctx.shared.cancel_by(&job_id, sender, admin) {
                CancelOutcome::Cancelled => {
                    info!(pool = %pool, job_id = %job_id, sender, "cancel requested: stopping the job");
                    ControlOutcome::Done
                }
                CancelOutcome::Denied => {
                    warn!(pool = %pool, job_id = %job_id, sender, "cancel refused: the sender neither owns nor submitted the job");
                    ControlOutcome::Refused {
                        reason: format!(
                            "broker user {sender:?} neither owns nor submitted job {job_id} and is not in control_admins of agent {}",
                            ctx.agent
                        ),
                    }
                }
                CancelOutcome::NotHere => {
                    warn!(pool = %pool, job_id = %job_id, sender, "cancel requested for a job not running here");
                    ControlOutcome::NotHere
                }
            };
            answer(ControlRequest::Cancel, Some(job_id), outcome);
        }
    }
    Ok(())
}

/// Answers a control request that has a `reply_to` with a
/// [`ControlAnswer`] on `<c>.replies` (routing key = `reply_to`, same
/// `correlation_id`), confirmed, from a task of its own on a channel of
/// its own on the publishing connection: a refusal (an account without
/// write on `<c>.replies`) closes only that channel, and an alarm delays
/// only the answer. A request without `reply_to` (an older CLI, the
/// controller) gets no answer.
fn answer_control(
    ctx: &Arc<Ctx>,
    from: &Requester,
    pub_conn: &Arc<Connection>,
    request: ControlRequest,
    job_id: Option<String>,
    outcome: ControlOutcome,
) {
    let Some(reply_to) = from.reply_to.clone() else {
        return;
    };
    let (state, running) = ctx.shared.state_now();
    let answer = ControlAnswer {
        schema: SCHEMA_VERSION,
        request_id: from.correlation.clone().unwrap_or_default(),
        agent: ctx.agent.clone(),
        pool: ctx.cfg.pool.clone(),
        request,
        job_id,
        outcome,
        state,
        running,
        at: unix_now(),
    };
    let (ctx, conn) = (ctx.clone(), pub_conn.clone());
    tokio::spawn(async move {
        let exchange = ctx.topo.replies_exchange();
        let mut props = vq_common::amqp::json_properties::<ControlAnswer>();
        if !answer.request_id.is_empty() {
            props = props.with_correlation_id(answer.request_id.as_str().into());
        }
        let sent = async {
            let ch = confirm_channel(&conn).await?;
            let r = vq_common::amqp::publish_confirmed(
                &ch,
                &exchange,
                &reply_to,
                &answer.encode(),
                props,
                false,
                OP_TIMEOUT,
            )
            .await;
            let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "answered".into())).await;
            r
        }
        .await;
        match sent {
            Ok(()) => debug!(request = ?answer.request, reply_to, "control request answered"),
            Err(e) => {
                warn!(pool = %ctx.cfg.pool, request = ?answer.request, error = %chain(&e), "cannot answer a control request (the agent account needs write on {exchange})")
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::{Pull, PullStep};

    const READY: Pull = Pull {
        consuming: false,
        proven: true,
        wants_pull: true,
        blocked: false,
        free: 2,
    };

    #[test]
    fn a_proven_pulling_session_with_free_slots_consumes_with_prefetch_free() {
        assert_eq!(READY.step(), PullStep::Start { prefetch: 2 });
        let running = Pull {
            consuming: true,
            ..READY
        };
        assert_eq!(running.step(), PullStep::Keep);
    }

    #[test]
    fn nothing_is_consumed_before_the_session_proved_its_permissions() {
        let unproven = Pull {
            proven: false,
            ..READY
        };
        assert_eq!(unproven.step(), PullStep::Keep);
    }

    #[test]
    fn a_full_blocked_or_leaving_agent_stops_its_consumer_and_starts_none() {
        let full = Pull { free: 0, ..READY };
        let blocked = Pull {
            blocked: true,
            ..READY
        };
        let leaving = Pull {
            wants_pull: false,
            ..READY
        };
        for p in [full, blocked, leaving] {
            assert_eq!(p.step(), PullStep::Keep, "{p:?}");
            let running = Pull {
                consuming: true,
                ..p
            };
            assert_eq!(running.step(), PullStep::Stop, "{running:?}");
        }
    }
}
