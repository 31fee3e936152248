//! One job from claim to release, with the lease protocol of DESIGN.md
//! ("Leases"):
//!
//! * **claim**: validate; copy the delivery into the agent's durable lease
//!   queue `<c>.lease.<agent>` (publisher confirm); ack the pool delivery
//!   and confirm the ack with a synchronous round trip on the same channel;
//!   only then publish `job.started` and run it. The pool delivery is held
//!   for seconds, never for the whole run, so `consumer_timeout` and the
//!   quorum delivery limit do not matter for long jobs. If the ack cannot
//!   be confirmed the broker redelivers the job: the claim is abandoned and
//!   its lease copy removed, so the job never runs twice.
//! * **release**: the result is stored on disk ([`crate::report::Outbox`]),
//!   published with a confirm (across reconnects), then the job's message is
//!   removed from the lease queue, then the stored result.
//! * **recover** ([`scan_leases`], at every session start): lease messages
//!   of jobs this process does not run are leftovers of a previous agent
//!   process on this VM: a stored result is (re)published and the lease
//!   removed; otherwise a rerunnable job is run again here with its loss
//!   counter ([`LOSSES_HEADER`]) incremented, dead-lettered past the limit;
//!   a non-rerunnable job gets `job.failed` "node lost" and is
//!   dead-lettered.
//!
//! Refused jobs (malformed, invalid) get `job.failed` with the reason and
//! are dead-lettered at once; the pool delivery is acked after both are
//! confirmed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Acker, BasicProperties, Channel};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};
use vq_common::amqp::{bounded, json_properties, AmqpError};
use vq_common::messages::{DecodeError, Job, JobEvent, JobState, Message, Outcome, Usage};
use vq_common::topology::{job_event_key, DEFAULT_LOSS_LIMIT, LOSSES_HEADER};

use crate::error::{chain, Rejection};
use crate::plan::{plan_job, LaunchPlan};
use crate::report::{
    dead_letter_properties, header_str, header_u32, job_event, lease_properties, with_header_u32,
    SUBMITTER_HEADER,
};
use crate::Ctx;

/// Bound on one `basic.ack` plus its confirming round trip.
const ACK_TIMEOUT: Duration = Duration::from_secs(15);

/// Bound on one lease-queue operation.
const LEASE_OP_TIMEOUT: Duration = Duration::from_secs(15);

/// Most messages a lease scan reads (a lease queue holds at most `slots`
/// jobs; more means leftovers of earlier processes).
const MAX_SCAN: usize = 4096;

/// Losses after which a job is dead-lettered instead of run again.
pub(crate) const LOSS_LIMIT: u32 = DEFAULT_LOSS_LIMIT;

/// The agent's lease queue and the channel to read it (set by the session
/// loop, `None` while disconnected). One lease operation at a time: a scan
/// or a release holds the messages it read unacked until it is done.
#[derive(Debug)]
pub(crate) struct Leases {
    queue: String,
    channel: watch::Receiver<Option<Channel>>,
    lock: tokio::sync::Mutex<()>,
}

fn op(what: &str) -> impl FnOnce(lapin::Error) -> AmqpError + '_ {
    move |source| AmqpError::Op {
        what: what.into(),
        source,
    }
}

/// The job id of a lease or pool message: its `message_id`, else the id in
/// its body.
fn message_key(d: &Delivery) -> Option<String> {
    d.properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str().to_string())
        .filter(|m| !m.is_empty())
        .or_else(|| Job::decode(&d.data).ok().map(|j| j.id))
}

impl Leases {
    /// Leases in `queue`, read through the channel published on `channel`.
    pub(crate) fn new(queue: String, channel: watch::Receiver<Option<Channel>>) -> Self {
        Leases {
            queue,
            channel,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The lease queue's name.
    pub(crate) fn queue(&self) -> &str {
        &self.queue
    }

    fn current(&self) -> Result<Channel, AmqpError> {
        self.channel
            .borrow()
            .clone()
            .filter(|c| c.status().connected())
            .ok_or_else(|| AmqpError::Timeout {
                what: "lease channel (not connected)".into(),
                secs: 0,
            })
    }

    /// Removes the lease message of job `key`: reads up to `limit`
    /// messages, acks the match, requeues the others, and confirms with a
    /// round trip. `Ok(false)` if no message matched.
    ///
    /// # Errors
    /// [`AmqpError`] if the broker is gone or an operation times out.
    pub(crate) async fn remove(&self, key: &str, limit: usize) -> Result<bool, AmqpError> {
        let _guard = self.lock.lock().await;
        let ch = self.current()?;
        bounded("release lease", LEASE_OP_TIMEOUT, async {
            let mut others = Vec::new();
            let mut found = false;
            for _ in 0..limit.max(1) {
                let Some(m) = ch
                    .basic_get(
                        self.queue.as_str().into(),
                        BasicGetOptions { no_ack: false },
                    )
                    .await
                    .map_err(op("basic.get lease"))?
                else {
                    break;
                };
                let d = m.delivery;
                if message_key(&d).as_deref() == Some(key) {
                    d.acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(op("ack lease"))?;
                    found = true;
                    break;
                }
                others.push(d.acker);
            }
            for a in others {
                requeue_acker(&a).await;
            }
            sync(&ch, &self.queue).await?;
            Ok(found)
        })
        .await
    }
}

/// A synchronous round trip on `ch` (passive declare of `queue`): when it
/// returns, the broker has processed every earlier method on the channel,
/// acks included.
async fn sync(ch: &Channel, queue: &str) -> Result<(), AmqpError> {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(op("passive declare (sync)"))?;
    Ok(())
}

async fn requeue_acker(a: &Acker) {
    let r = a
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await;
    match r {
        Ok(true) => {}
        Ok(false) => debug!("cannot requeue: the channel is gone (the broker requeues it)"),
        Err(e) => warn!(error = %chain(&e), "cannot requeue a message"),
    }
}

/// Acks a pool delivery and confirms that the broker processed the ack
/// with a round trip on the same channel (`queue` is any existing queue).
async fn ack_confirmed(acker: &Acker, ch: &Channel, queue: &str) -> Result<(), AmqpError> {
    bounded("ack pool delivery", ACK_TIMEOUT, async {
        match acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(AmqpError::Timeout {
                    what: "ack pool delivery (channel gone)".into(),
                    secs: 0,
                })
            }
            Err(e) => return Err(op("ack pool delivery")(e)),
        }
        sync(ch, queue).await
    })
    .await
}

/// Handles one claimed pool delivery to the end (refuse, or lease, run,
/// report, release).
pub(crate) async fn handle_delivery(
    ctx: Arc<Ctx>,
    delivery: Delivery,
    decoded: Result<Job, DecodeError>,
    key: String,
    cancel: CancellationToken,
    jobs_ch: Channel,
) {
    let span = tracing::info_span!("job", pool = %ctx.cfg.pool, job_id = %key);
    async move {
        // The broker validated `user_id`; a requeuer (the controller
        // returning a lost node's job) is judged by the original submitter.
        let submitter = judged_submitter(&ctx, &delivery.properties);
        let pool_queue = ctx.topo.pool_queue(&ctx.cfg.pool);
        let refused = match decoded {
            Err(e) => Some((None, Rejection::Malformed(e))),
            Ok(job) => match plan_job(&job, submitter.as_deref(), &ctx.cfg, &ctx.sys) {
                Err(rej) => Some((Some(job), rej)),
                Ok(plan) => {
                    let mut cancellers = vec![job.owner.clone()];
                    cancellers.extend(submitter.clone());
                    ctx.shared.set_cancellers(&key, cancellers);
                    claim_and_run(
                        &ctx,
                        &delivery,
                        &job,
                        plan,
                        cancel,
                        &key,
                        &jobs_ch,
                        &pool_queue,
                        submitter.as_deref(),
                    )
                    .await;
                    None
                }
            },
        };
        if let Some((job, rej)) = refused {
            refuse(
                &ctx,
                &delivery.data,
                &delivery.properties,
                job.as_ref(),
                &key,
                &rej,
            )
            .await;
            if let Err(e) = ack_confirmed(&delivery.acker, &jobs_ch, &pool_queue).await {
                // The broker redelivers it; it is refused again then.
                warn!(error = %chain(&e), "ack of a refused job not confirmed");
            }
            ctx.shared.release(&key);
        }
    }
    .instrument(span)
    .await;
}

#[allow(clippy::too_many_arguments)]
async fn claim_and_run(
    ctx: &Arc<Ctx>,
    delivery: &Delivery,
    job: &Job,
    plan: LaunchPlan,
    cancel: CancellationToken,
    key: &str,
    jobs_ch: &Channel,
    pool_queue: &str,
    submitter: Option<&str>,
) {
    // The lease records the submitter this job was judged by, so that a
    // recovery on this VM judges it the same way.
    let props = lease_properties(&delivery.properties, key, submitter);
    if let Err(e) = ctx
        .publisher
        .publish_once_mandatory(
            &ctx.topo.lease_exchange(),
            ctx.leases.queue(),
            &delivery.data,
            props,
            true,
        )
        .await
    {
        if matches!(e, AmqpError::Unroutable { .. }) {
            // Our lease queue was deleted (a controller fenced this agent):
            // pulling on would bounce every job back into the pool. The next
            // session finds it missing, declares it and registers again.
            warn!(queue = %ctx.leases.queue(), "the lease queue is gone (fenced?): returning the job, reconnecting to declare it and register again");
            ctx.lease_queue_gone
                .store(true, std::sync::atomic::Ordering::SeqCst);
            ctx.shared.pull_changed.notify_one();
        } else {
            warn!(error = %chain(&e), "cannot copy the job into the lease queue; returning it to the pool");
        }
        requeue_acker(&delivery.acker).await;
        ctx.shared.release(key);
        return;
    }
    if let Err(e) = ack_confirmed(&delivery.acker, jobs_ch, pool_queue).await {
        warn!(error = %chain(&e), "pool ack not confirmed: the broker redelivers the job; abandoning this claim");
        match ctx.leases.remove(key, ctx.cfg.slots as usize + 16).await {
            Ok(_) => {}
            Err(_) => ctx.shared.drop_lease_later(key),
        }
        ctx.shared.release(key);
        return;
    }
    debug!("claimed: leased and acked");
    let orig = (&delivery.data[..], &delivery.properties);
    run_and_release(ctx, job, plan, cancel, key, submitter, orig).await;
}

/// The submitter a delivery is judged by (see
/// `SubmitterRules::effective_submitter`).
fn judged_submitter(ctx: &Ctx, props: &BasicProperties) -> Option<String> {
    let user_id = props.user_id().as_ref().map(|u| u.as_str().to_string());
    let original = header_str(props, SUBMITTER_HEADER);
    ctx.cfg
        .submitters
        .effective_submitter(user_id.as_deref(), original.as_deref())
        .map(str::to_string)
}

/// Refuses a job that will not run: dead-letters `body` with the reason in
/// its headers, then publishes `job.<pool>.failed` with the reason through
/// the outbox, both confirmed. The caller acks or releases afterwards.
pub(crate) async fn refuse(
    ctx: &Ctx,
    body: &[u8],
    props: &BasicProperties,
    job: Option<&Job>,
    key: &str,
    rejection: &Rejection,
) {
    let reason = chain(rejection);
    warn!(reason = %reason, "job refused");
    dead_letter(ctx, body, props, &reason).await;
    let pool = &ctx.cfg.pool;
    let submitter = judged_submitter(ctx, props);
    let event = job_event(
        job,
        key,
        pool,
        &ctx.agent,
        submitter.as_deref(),
        JobState::Failed { reason },
    );
    publish_result(ctx, key, &event).await;
    ctx.outbox.remove(key);
}

async fn dead_letter(ctx: &Ctx, body: &[u8], props: &BasicProperties, reason: &str) {
    let props = dead_letter_properties(props, reason, &ctx.agent);
    ctx.publisher
        .publish_reliably(&ctx.topo.dead_exchange(), &ctx.cfg.pool, body, props)
        .await;
}

/// Stores `event` in the outbox, publishes it until confirmed, marks it
/// sent. The caller removes the lease, then the stored result.
async fn publish_result(ctx: &Ctx, key: &str, event: &JobEvent) {
    let rk = job_event_key(&ctx.cfg.pool, event.state.routing_word());
    let body = event.encode();
    if let Err(e) = ctx.outbox.store(key, &rk, &body) {
        warn!(error = %e, "cannot keep the result on disk; publishing it from memory only");
    }
    ctx.publisher
        .publish_reliably(
            &ctx.topo.events_exchange(),
            &rk,
            &body,
            json_properties::<JobEvent>(),
        )
        .await;
    if let Err(e) = ctx.outbox.mark_sent(key) {
        debug!(error = %e, "cannot mark the stored result as sent");
    }
}

/// Removes the lease of `key` and its stored result; if the broker is
/// gone, the next lease scan removes it.
async fn release_lease(ctx: &Ctx, key: &str) {
    match ctx.leases.remove(key, ctx.cfg.slots as usize + 16).await {
        Ok(true) => {
            ctx.outbox.remove(key);
            debug!("lease released");
        }
        Ok(false) => {
            warn!("no lease message found for the job (already removed)");
            ctx.outbox.remove(key);
        }
        Err(e) => {
            warn!(error = %chain(&e), "cannot release the lease now; it is removed after reconnecting");
            ctx.shared.drop_lease_later(key);
        }
    }
}

/// Runs a claimed job and reports it. `orig` is the job's message (body and
/// properties), dead-lettered if the job cannot end normally.
async fn run_and_release(
    ctx: &Arc<Ctx>,
    job: &Job,
    plan: LaunchPlan,
    cancel: CancellationToken,
    key: &str,
    submitter: Option<&str>,
    orig: (&[u8], &BasicProperties),
) {
    let pool = ctx.cfg.pool.clone();
    let started_event = job_event(
        Some(job),
        key,
        &pool,
        &ctx.agent,
        submitter,
        JobState::Started,
    );
    // Published while the job runs: a broker outage must not delay the job.
    let started_pub = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.publisher
                .publish_message_reliably(
                    &ctx.topo.events_exchange(),
                    &job_event_key(&ctx.cfg.pool, "started"),
                    &started_event,
                )
                .await;
        })
    };
    info!(owner = %plan.owner, uid = plan.uid, walltime_secs = plan.walltime.as_secs(), "job starting");
    let (outcome, usage) = execute(ctx, key, &plan, cancel).await;
    info!(outcome = ?outcome, exit_status = outcome.exit_status(), wall_secs = usage.wall_secs, "job ended");
    let _ = started_pub.await;
    if ctx.shared.take_interrupted(key) {
        if job.rerunnable {
            info!("stopped by the agent's shutdown: no result; the lease stays and the job is run again (rerunnable)");
            ctx.shared.release(key);
            return;
        }
        // At most once: never run again, and kept in the dead-letter queue
        // with the reason (as a node-lost job is), so nothing vanishes.
        let reason = "the agent shut down before the job finished; it is not rerunnable (-r n)";
        warn!(
            reason,
            "stopped by the agent's shutdown: reported failed and dead-lettered"
        );
        dead_letter(ctx, orig.0, orig.1, reason).await;
        let state = JobState::Failed {
            reason: reason.into(),
        };
        let event = job_event(Some(job), key, &pool, &ctx.agent, submitter, state);
        publish_result(ctx, key, &event).await;
    } else {
        let state = JobState::Finished { outcome, usage };
        let event = job_event(Some(job), key, &pool, &ctx.agent, submitter, state);
        publish_result(ctx, key, &event).await;
    }
    release_lease(ctx, key).await;
    ctx.shared.release(key);
}

/// Spawns the job of `plan` and supervises it to its outcome.
async fn execute(
    ctx: &Ctx,
    key: &str,
    plan: &LaunchPlan,
    cancel: CancellationToken,
) -> (Outcome, Usage) {
    let started = Instant::now();
    crate::supervise::run_job(plan.clone(), started, cancel, |pid| {
        ctx.shared.set_pid(key, pid)
    })
    .await
}

/// Scans the lease queue at the start of a session (see the module doc).
/// Leases of jobs running here are kept; leases whose removal was pending
/// are removed; leftovers of a previous process are recovered.
///
/// # Errors
/// [`AmqpError`]: the session ends and the scan is repeated on the next.
pub(crate) async fn scan_leases(ctx: &Arc<Ctx>) -> Result<(), AmqpError> {
    let _guard = ctx.leases.lock.lock().await;
    let ch = ctx.leases.current()?;
    let queue = ctx.leases.queue().to_string();
    let mut held = Vec::new();
    for _ in 0..MAX_SCAN {
        let got = bounded("scan lease queue", LEASE_OP_TIMEOUT, async {
            ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(op("basic.get lease"))
        })
        .await?;
        match got {
            Some(m) => held.push(m.delivery),
            None => break,
        }
    }
    if !held.is_empty() {
        info!(pool = %ctx.cfg.pool, leases = held.len(), "lease queue scanned");
    }
    let mut keep = Vec::new();
    for d in held {
        let key = message_key(&d)
            .unwrap_or_else(|| format!("undecodable-{}", uuid::Uuid::new_v4().simple()));
        if ctx.shared.take_drop_lease(&key) {
            ack_lease(&d).await?;
            ctx.outbox.remove(&key);
            debug!(job_id = %key, "pending lease removal done");
            continue;
        }
        if ctx.shared.is_claimed(&key) {
            keep.push(d);
            continue;
        }
        recover_one(ctx, &d, &key).await?;
    }
    for d in keep {
        requeue_acker(&d.acker).await;
    }
    bounded("sync lease queue", LEASE_OP_TIMEOUT, sync(&ch, &queue)).await?;
    // Results stored without a lease (their lease was removed but the file
    // was not): drop the sent ones, publish the others.
    for key in ctx.outbox.job_ids() {
        if ctx.shared.is_claimed(&key) {
            continue;
        }
        if let Some(st) = ctx.outbox.load(&key) {
            if !st.sent {
                publish_stored(ctx, &st).await?;
            }
            ctx.outbox.remove(&key);
        }
    }
    Ok(())
}

async fn ack_lease(d: &Delivery) -> Result<(), AmqpError> {
    bounded("ack lease", LEASE_OP_TIMEOUT, async {
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(op("ack lease"))
    })
    .await?;
    Ok(())
}

async fn publish_stored(ctx: &Ctx, st: &crate::report::Stored) -> Result<(), AmqpError> {
    ctx.publisher
        .publish_once(
            &ctx.topo.events_exchange(),
            &st.routing_key,
            &st.body,
            json_properties::<JobEvent>(),
        )
        .await
}

/// Recovers one leftover lease of a previous agent process on this VM.
async fn recover_one(ctx: &Arc<Ctx>, d: &Delivery, key: &str) -> Result<(), AmqpError> {
    let span = tracing::info_span!("recover", pool = %ctx.cfg.pool, job_id = %key);
    let _e = span.enter();
    if let Some(st) = ctx.outbox.load(key) {
        if !st.sent {
            info!("republishing the stored result of a job that ended before the agent restarted");
            publish_stored(ctx, &st).await?;
        }
        ack_lease(d).await?;
        ctx.outbox.remove(key);
        return Ok(());
    }
    let pool = ctx.cfg.pool.clone();
    let job = match Job::decode(&d.data) {
        Ok(j) => j,
        Err(e) => {
            let reason = format!("lease message cannot be decoded: {}", chain(&e));
            warn!(reason = %reason, "dead-lettering a leftover lease");
            dead_letter_now(ctx, d, &reason).await?;
            ack_lease(d).await?;
            return Ok(());
        }
    };
    let losses = header_u32(&d.properties, LOSSES_HEADER).saturating_add(1);
    let final_reason = if !job.rerunnable {
        Some(format!(
            "node lost: the agent restarted while the job ran (loss {losses}); the job is not rerunnable (-r n)"
        ))
    } else if losses >= LOSS_LIMIT {
        Some(format!(
            "node lost {losses} times while running the job (limit {LOSS_LIMIT}): not run again"
        ))
    } else {
        None
    };
    if let Some(reason) = final_reason {
        warn!(reason = %reason, "leftover lease: job ends failed and is dead-lettered");
        let props = with_header_u32(d.properties.clone(), LOSSES_HEADER, losses);
        dead_letter_now_props(ctx, &d.data, &props, &reason).await?;
        let submitter = header_str(&d.properties, SUBMITTER_HEADER);
        let event = job_event(
            Some(&job),
            key,
            &pool,
            &ctx.agent,
            submitter.as_deref(),
            JobState::Failed { reason },
        );
        let rk = job_event_key(&pool, "failed");
        ctx.publisher
            .publish_once(
                &ctx.topo.events_exchange(),
                &rk,
                &event.encode(),
                json_properties::<JobEvent>(),
            )
            .await?;
        ack_lease(d).await?;
        return Ok(());
    }
    // Rerunnable, under the limit: run it again here, with the counter
    // incremented in a fresh lease copy.
    let props = with_header_u32(d.properties.clone(), LOSSES_HEADER, losses);
    ctx.publisher
        .publish_once_mandatory(
            &ctx.topo.lease_exchange(),
            ctx.leases.queue(),
            &d.data,
            props.clone(),
            true,
        )
        .await?;
    ack_lease(d).await?;
    let Some(cancel) = ctx.shared.claim_recovered(key) else {
        return Ok(());
    };
    info!(
        losses,
        "leftover lease of a rerunnable job: running it again"
    );
    let submitter = header_str(&d.properties, SUBMITTER_HEADER);
    let ctx2 = ctx.clone();
    let key = key.to_string();
    let body = d.data.clone();
    tokio::spawn(
        async move {
            match plan_job(&job, submitter.as_deref(), &ctx2.cfg, &ctx2.sys) {
                Ok(plan) => {
                    let mut cancellers = vec![job.owner.clone()];
                    cancellers.extend(submitter.clone());
                    ctx2.shared.set_cancellers(&key, cancellers);
                    let orig = (&body[..], &props);
                    run_and_release(&ctx2, &job, plan, cancel, &key, submitter.as_deref(), orig)
                        .await
                }
                Err(rej) => {
                    refuse(&ctx2, &body, &props, Some(&job), &key, &rej).await;
                    release_lease(&ctx2, &key).await;
                    ctx2.shared.release(&key);
                }
            }
        }
        .instrument(span.clone()),
    );
    Ok(())
}

async fn dead_letter_now(ctx: &Ctx, d: &Delivery, reason: &str) -> Result<(), AmqpError> {
    dead_letter_now_props(ctx, &d.data, &d.properties, reason).await
}

async fn dead_letter_now_props(
    ctx: &Ctx,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
) -> Result<(), AmqpError> {
    let props = dead_letter_properties(props, reason, &ctx.agent);
    ctx.publisher
        .publish_once(&ctx.topo.dead_exchange(), &ctx.cfg.pool, body, props)
        .await
}

/// Dead-letters a duplicate delivery of a job that runs here (its lease is
/// held here) and acks it, without a job event: the running copy reports.
pub(crate) async fn drop_duplicate(
    ctx: Arc<Ctx>,
    delivery: Delivery,
    key: String,
    jobs_ch: Channel,
) {
    let reason = format!(
        "duplicate delivery of job {key}, which runs on agent {} already",
        ctx.agent
    );
    warn!(pool = %ctx.cfg.pool, job_id = %key, "{reason}");
    dead_letter(&ctx, &delivery.data, &delivery.properties, &reason).await;
    let q = ctx.topo.pool_queue(&ctx.cfg.pool);
    if let Err(e) = ack_confirmed(&delivery.acker, &jobs_ch, &q).await {
        warn!(job_id = %key, error = %chain(&e), "ack of a duplicate not confirmed");
    }
}
