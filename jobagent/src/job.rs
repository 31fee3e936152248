//! One job from claim to release, with the lease protocol of DESIGN.md
//! ("Leases", "Unknown outcomes"). Every step is repeatable, and a step
//! whose outcome is unknown (its reply or confirm was lost with the
//! connection) is resolved by looking, never by assuming it failed:
//!
//! * **lease copy**: the delivery is copied into the agent's durable lease
//!   queue `<c>.lease.<agent>` with a fresh claim id (`x-vq-claim`),
//!   publisher confirm. Unknown → the session ends (so the broker surely
//!   returns the unacked delivery to the pool) and the claim is abandoned;
//!   a copy that did arrive has no marker and the next lease scan discards
//!   it.
//! * **claim marker** ([`crate::claim`]): the job's marker
//!   `<c>.claim.<job id>` is declared with this claim's arguments, a
//!   compare-and-set in the broker. Ours → the job is this agent's, whatever
//!   becomes of the pool delivery. Another claim's → the delivery is a copy
//!   of a job claimed elsewhere: dead-lettered with the reason (and, for a
//!   first delivery, a duplicate report to its submitter), never run.
//!   Unknown → the session ends and the declaration is repeated on the
//!   next one, which pulls nothing until every claim is settled.
//! * **ack** of the pool delivery, confirmed by a round trip on its
//!   channel. Unknown → nothing to resolve: the marker makes the job ours;
//!   a copy the broker returned to the pool is dead-lettered by whoever
//!   receives it, and the marker is kept after the job ends so that a copy
//!   arriving later still finds it ([`vq_common::lease::may_delete_marker`]).
//! * **start and result**: `job.started` and the final event carry a stable
//!   `message_id` ([`vq_common::messages::JobEvent::message_id`]); the
//!   result is stored on disk ([`crate::report::Outbox`]) and published
//!   until confirmed; a retransmission after an unknown outcome is
//!   deduplicated by consumers.
//! * **release**: the marker is deleted (when allowed), then the lease copy
//!   removed, then the stored result.
//! * **recover** ([`scan_leases`], at every session start): a lease copy no
//!   running claim holds is recovered only if the job's marker names its
//!   claim (a leftover of an earlier process on this VM): a stored result
//!   is (re)published; otherwise [`vq_common::lease::fate`] with the
//!   configured `loss_limit` decides: run again here, or `job.failed`
//!   "node lost" and dead-lettered. Any other copy is discarded.
//!
//! Refused jobs (malformed, invalid) get `job.failed` with the reason and
//! are dead-lettered at once; the pool delivery is acked after both are
//! confirmed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::{Acker, BasicProperties, Channel};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};
use vq_common::amqp::{bounded, envelope, event_properties, json_properties, AmqpError};
use vq_common::lease::{fate, leftover, may_delete_marker, LeaseFate, Leftover, Marker};
use vq_common::messages::{
    fingerprint, DecodeError, Job, JobEvent, JobState, Message, Outcome, Usage,
};
use vq_common::topology::{job_event_key, CLAIM_HEADER, LOSSES_HEADER};

use crate::ctx::Ctx;
use crate::error::{chain, Rejection};
use crate::lease::{ack_lease, requeue_acker, sync};
use crate::metrics::JobOutcome;
use crate::plan::{plan_job_async, LaunchPlan};
use crate::report::{
    header_str, header_u32, with_header_str, with_header_u32, DeadLetter, SUBMITTER_HEADER,
};
use crate::state::Owned;

/// Bound on one `basic.ack` plus its confirming round trip.
const ACK_TIMEOUT: Duration = Duration::from_secs(15);

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
            Err(e) => return Err(AmqpError::op("ack pool delivery")(e)),
        }
        sync(ch, queue).await
    })
    .await
}

/// A claimed job on its way from claim to release: the pieces every step
/// needs, in one value.
struct Ticket {
    /// Job id.
    key: String,
    job: Job,
    /// The job's message as delivered (body and properties), dead-lettered
    /// if the job cannot end normally.
    body: Vec<u8>,
    props: BasicProperties,
    /// The submitter the job was judged by.
    submitter: Option<String>,
    cancel: CancellationToken,
    /// The claim id (`x-vq-claim`, the marker's argument).
    claim: String,
    /// Losses to lost nodes before this execution.
    losses: u32,
}

impl Ticket {
    /// Who besides the control admins may cancel the job: its owner and
    /// the submitter it was judged by.
    fn cancellers(&self) -> Vec<String> {
        let mut users = vec![self.job.owner.clone()];
        users.extend(self.submitter.clone());
        users
    }

    /// The event of this execution (attempt = 1 + losses) in `state`.
    fn event(&self, ctx: &Ctx, state: JobState) -> JobEvent {
        let mut e = JobEvent::about(
            Some(&self.job),
            &self.key,
            &ctx.cfg.pool,
            &ctx.agent,
            self.submitter.as_deref(),
            state,
        )
        .of_submission(&self.body);
        e.attempt = self.losses.saturating_add(1);
        e
    }

    /// The job's message as delivered, to dead-letter with `reason`.
    fn dead_letter<'a>(&'a self, reason: &'a str) -> DeadLetter<'a> {
        DeadLetter {
            body: &self.body,
            props: &self.props,
            reason,
        }
    }
}

/// A pool delivery claimed by the session loop ([`crate::state::Claim::New`]).
pub(crate) struct NewClaim {
    /// Job id.
    pub(crate) key: String,
    /// Cancels the job.
    pub(crate) cancel: CancellationToken,
    /// The claim id.
    pub(crate) claim: String,
}

/// Handles one claimed pool delivery to the end (refuse, or lease, mark,
/// ack, run, report, release).
pub(crate) async fn handle_delivery(
    ctx: Arc<Ctx>,
    delivery: Delivery,
    decoded: Result<Job, DecodeError>,
    claimed: NewClaim,
    jobs_ch: Channel,
) {
    let NewClaim { key, cancel, claim } = claimed;
    let span = tracing::info_span!("job", pool = %ctx.cfg.pool, agent = %ctx.agent, job_id = %key);
    async move {
        // The broker validated `user_id`; a requeuer (the controller
        // returning a lost node's job) is judged by the original submitter.
        let submitter = judged_submitter(&ctx, &delivery.properties);
        let pool_queue = ctx.topo.pool_queue(&ctx.cfg.pool);
        // A job with dependencies runs only as the controller released it.
        let user_id = delivery.properties.user_id().as_ref().map(|u| u.as_str());
        let decoded = decoded.map(|job| {
            let released = crate::plan::check_released(&job, user_id, &ctx.cfg.submitters);
            (job, released)
        });
        let refused = match decoded {
            Err(e) => Some((None, Rejection::Malformed(e))),
            Ok((job, Err(rej))) => Some((Some(job), rej)),
            Ok((job, Ok(()))) => {
                match plan_job_async(&job, submitter.as_deref(), &ctx.cfg, &ctx.sys).await {
                    Err(rej) => Some((Some(job), rej)),
                    Ok(plan) => {
                        let ticket = Ticket {
                            key: key.clone(),
                            job,
                            body: delivery.data.clone(),
                            props: delivery.properties.clone(),
                            submitter,
                            cancel,
                            claim,
                            losses: header_u32(&delivery.properties, LOSSES_HEADER),
                        };
                        claim_and_run(&ctx, &delivery, ticket, plan, &jobs_ch, &pool_queue).await;
                        None
                    }
                }
            }
        };
        if let Some((job, rej)) = refused {
            refuse(
                &ctx,
                (&delivery.data, &delivery.properties),
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

/// Ends the current broker session because an outcome is unknown: the
/// broker then returns every unacked delivery of it to its queue, and the
/// next session resolves what is pending before it pulls. An `error` that
/// is a broker refusal (not [`AmqpError::is_transient`]) makes the next
/// session wait with a growing backoff: a refusal repeats, and each
/// session that fails a claim returns a delivery to the pool, spending the
/// pool queue's delivery limit.
fn end_session(ctx: &Ctx, why: &str, error: &AmqpError) {
    if error.is_transient() {
        warn!(
            why,
            "ending the broker session: an outcome is unknown and is resolved on the next session"
        );
    } else {
        let refused = error.access_refused().unwrap_or_else(|| chain(error));
        warn!(
            why,
            refused = %refused,
            "the broker refused a claim step: ending the broker session; the next one waits longer and must prove the permissions before it pulls"
        );
        ctx.session_refused
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    ctx.restart_session
        .store(true, std::sync::atomic::Ordering::SeqCst);
    ctx.shared.pull_changed.notify_one();
}

/// Waits for the session after `generation` (or for the agent's stop);
/// returns the new generation, `None` when stopping.
async fn next_session(ctx: &Ctx, generation: u64) -> Option<u64> {
    let mut rx = ctx.session.subscribe();
    let r = rx.wait_for(|g| *g > generation).await.ok().map(|g| *g);
    r
}

async fn claim_and_run(
    ctx: &Arc<Ctx>,
    delivery: &Delivery,
    ticket: Ticket,
    plan: LaunchPlan,
    jobs_ch: &Channel,
    pool_queue: &str,
) {
    let key = ticket.key.clone();
    let mut generation = *ctx.session.borrow();
    ctx.shared.set_cancellers(&key, ticket.cancellers());
    // 1. The lease copy. It records the claim and the submitter this job
    // was judged by, so that a recovery on this VM judges it the same way.
    let props = with_header_str(
        envelope::lease_copy_properties(&delivery.properties, &key, ticket.submitter.as_deref()),
        CLAIM_HEADER,
        &ticket.claim,
    );
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
            requeue_acker(&delivery.acker).await;
        } else {
            // Unknown: the copy may have arrived. Without a marker it is
            // discarded by the next lease scan; the delivery goes back to
            // the pool when this session ends.
            warn!(error = %chain(&e), "lease copy not confirmed: abandoning the claim");
            end_session(ctx, "lease copy not confirmed", &e);
        }
        ctx.shared.release(&key);
        return;
    }
    // 2. The claim marker, repeated across sessions until its outcome is
    // known.
    let mut same_session = true;
    let marker = loop {
        match ctx.markers.claim(&key, &ticket.claim).await {
            Ok(m) => break m,
            Err(e) => {
                warn!(error = %chain(&e), "claim marker not confirmed: declaring it again on the next session");
                end_session(ctx, "claim marker not confirmed", &e);
                same_session = false;
                // Once per session: the generation waited for is the one
                // the last attempt ran in (else every later failure would
                // find "a newer session" at once and spin).
                match next_session(ctx, generation).await {
                    Some(g) => generation = g,
                    None => {
                        // Stopping: the marker (if made) names this agent;
                        // the lease copy is recovered at the next start.
                        ctx.shared.release(&key);
                        return;
                    }
                }
            }
        }
    };
    if marker != Marker::Ours {
        // Taken by another agent, or by the controller withdrawing the job
        // (`vq cancel` while it was queued: dropped without a trace, the
        // controller published its `withdrawn` event).
        let withdrawn = match ctx.markers.withdrawn(&key).await {
            Ok(w) => w,
            Err(e) => {
                // Unknown: the delivery goes back to the pool when the
                // session ends, and the next claim asks again.
                warn!(error = %chain(&e), "cannot tell whether a claimed-elsewhere job was withdrawn: returning it");
                end_session(ctx, "withdrawal check not answered", &e);
                same_session = false;
                false
            }
        };
        if withdrawn {
            info!("the job was cancelled while queued: dropped, not run");
            if same_session {
                let q = ctx.topo.pool_queue(&ctx.cfg.pool);
                if let Err(e) = ack_confirmed(&delivery.acker, jobs_ch, &q).await {
                    warn!(error = %chain(&e), "ack of a withdrawn job not confirmed; its next delivery is dropped alike");
                }
            }
        } else if same_session {
            info!("the job is claimed elsewhere: this delivery is a copy");
            handle_copy(ctx, delivery, &key, jobs_ch, true).await;
        }
        if let Err(e) = ctx
            .leases
            .remove(&key, Some(&ticket.claim), ctx.cfg.slots as usize + 16)
            .await
        {
            debug!(error = %chain(&e), "lease copy of a copy not removed now; the next scan discards it");
        }
        ctx.shared.release(&key);
        return;
    }
    // 3. The ack. Its outcome does not decide ownership (the marker did);
    // it decides whether the marker may go when the job ends.
    let ack_ok = same_session
        && match ack_confirmed(&delivery.acker, jobs_ch, pool_queue).await {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %chain(&e), "pool ack not confirmed: the job is ours (claim marker); a copy the broker may return is dead-lettered where it lands");
                false
            }
        };
    ctx.shared.set_owned(
        &key,
        Owned {
            losses: ticket.losses,
            ack_confirmed: ack_ok,
        },
    );
    debug!("claimed: leased, marked and acked");
    run_and_release(ctx, ticket, plan).await;
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

/// Refuses a job that will not run: dead-letters its message (`body`,
/// `props`) with the reason in its headers, then reports `job.<pool>.failed`
/// with the reason ([`crate::report::Reporter::failed`]), both confirmed.
/// The caller acks or releases afterwards.
pub(crate) async fn refuse(
    ctx: &Ctx,
    (body, props): (&[u8], &BasicProperties),
    job: Option<&Job>,
    key: &str,
    rejection: &Rejection,
) {
    let reason = chain(rejection);
    warn!(reason = %reason, "job refused");
    let submitter = judged_submitter(ctx, props);
    let event = JobEvent::about(
        job,
        key,
        &ctx.cfg.pool,
        &ctx.agent,
        submitter.as_deref(),
        JobState::Failed {
            reason: reason.clone(),
        },
    )
    .of_submission(body);
    let dead = DeadLetter {
        body,
        props,
        reason: &reason,
    };
    ctx.reporter.failed(key, dead, &event).await;
    ctx.outbox.remove(key);
    ctx.metrics.job_ended(JobOutcome::Refused);
}

/// Releases a job whose result is confirmed: removes its lease copy, then
/// deletes its claim marker when no copy of the job can be queued (else the
/// marker expires later), then its stored result. What cannot be done now
/// is done by the next lease scan (a copy whose marker is ours is recovered
/// from the stored result) or by the marker's expiry.
async fn release_lease(ctx: &Ctx, key: &str, claim: &str, owned: Option<&Owned>) {
    let removed = ctx
        .leases
        .remove(key, Some(claim), ctx.cfg.slots as usize + 16)
        .await;
    if removed.is_ok() && owned.is_some_and(|o| may_delete_marker(o.ack_confirmed, o.losses)) {
        if let Err(e) = ctx.markers.delete(key).await {
            warn!(error = %chain(&e), "cannot delete the claim marker now; it expires by itself");
        }
    }
    match removed {
        Ok(true) => {
            ctx.outbox.remove(key);
            debug!("lease released");
        }
        Ok(false) => {
            warn!("no lease message found for the job (already removed)");
            ctx.outbox.remove(key);
        }
        Err(e) => {
            warn!(error = %chain(&e), "cannot release the lease now; the next lease scan does");
        }
    }
}

/// Runs a claimed (owned) job, reports it and releases it.
async fn run_and_release(ctx: &Arc<Ctx>, t: Ticket, plan: LaunchPlan) {
    let attempt = t.losses.saturating_add(1);
    // A job of several slots that does not fit beside the running ones
    // waits here, claimed (leased, marked, acked: its delivery is neither
    // held nor requeued), until they end; the agent pulls nothing
    // meanwhile, so its slots do come free (DESIGN.md, "The jobagent").
    if ctx.shared.is_waiting(&t.key) && !ctx.shared.try_start(&t.key) {
        info!(
            slots = t.job.slots,
            agent_slots = ctx.shared.slots(),
            "job waits for its slots"
        );
        tokio::select! {
            _ = ctx.shared.wait_for_slots(&t.key) => {}
            _ = t.cancel.cancelled() => {}
        }
    }
    if t.cancel.is_cancelled() && ctx.shared.is_waiting(&t.key) {
        // Cancelled (or the agent shuts down) before it started: it never
        // ran. Reported like a job cancelled at its start.
        info!("stopped while waiting for slots: not run");
        finish(ctx, t, Outcome::Cancelled, Usage::default()).await;
        return;
    }
    let started_event = t.event(ctx, JobState::Started);
    // Published while the job runs: a broker outage must not delay the job.
    let started_pub = {
        let reporter = ctx.reporter.clone();
        tokio::spawn(async move { reporter.started(&started_event).await }.in_current_span())
    };
    info!(owner = %plan.owner, uid = plan.uid, walltime_secs = plan.walltime.as_secs(), slots = t.job.slots, attempt, "job starting");
    let (outcome, usage) = execute(ctx, &t.key, &plan, t.cancel.clone()).await;
    info!(outcome = ?outcome, exit_status = outcome.exit_status(), wall_secs = usage.wall_secs, "job ended");
    let _ = started_pub.await;
    finish(ctx, t, outcome, usage).await;
}

/// Reports the end of a claimed job (or keeps its lease when the agent's
/// shutdown stopped a rerunnable one) and releases it.
async fn finish(ctx: &Arc<Ctx>, t: Ticket, outcome: Outcome, usage: Usage) {
    let owned = ctx.shared.owned(&t.key);
    if ctx.shared.take_interrupted(&t.key) {
        if t.job.rerunnable {
            info!("stopped by the agent's shutdown: no result; the lease stays and the job is run again (rerunnable)");
            ctx.shared.release(&t.key);
            return;
        }
        // At most once: never run again, and kept in the dead-letter queue
        // with the reason (as a node-lost job is), so nothing vanishes.
        let reason = "the agent shut down before the job finished; it is not rerunnable (-r n)";
        warn!(
            reason,
            "stopped by the agent's shutdown: reported failed and dead-lettered"
        );
        let e = t.event(
            ctx,
            JobState::Failed {
                reason: reason.into(),
            },
        );
        ctx.reporter.failed(&t.key, t.dead_letter(reason), &e).await;
        ctx.metrics.job_ended(JobOutcome::DeadLettered);
    } else {
        ctx.metrics.job_ended(JobOutcome::from(&outcome));
        let e = t.event(ctx, JobState::Finished { outcome, usage });
        ctx.reporter.finished(&t.key, &e).await;
    }
    release_lease(ctx, &t.key, &t.claim, owned.as_ref()).await;
    ctx.shared.release(&t.key);
}

/// Spawns the job of `plan` and supervises it to its outcome.
async fn execute(
    ctx: &Ctx,
    key: &str,
    plan: &LaunchPlan,
    cancel: CancellationToken,
) -> (Outcome, Usage) {
    let started = Instant::now();
    crate::supervise::run_job(
        plan.clone(),
        started,
        cancel,
        ctx.metrics.output_bytes.clone(),
        |pid| ctx.shared.set_pid(key, pid),
    )
    .await
}

/// Scans the lease queue at the start of a session (see the module doc).
/// Copies of claims this process holds are kept; a copy no claim holds is
/// recovered if the job's marker names its claim, and discarded otherwise.
///
/// # Errors
/// [`AmqpError`]: the session ends and the scan is repeated on the next.
pub(crate) async fn scan_leases(ctx: &Arc<Ctx>) -> Result<(), AmqpError> {
    let mut scan = ctx.leases.scan().await?;
    let held = std::mem::take(&mut scan.held);
    if !held.is_empty() {
        info!(pool = %ctx.cfg.pool, leases = held.len(), "lease queue scanned");
    }
    let mut keep = Vec::new();
    for d in held {
        let key = envelope::delivery_key(Job::decode(&d.data).ok().as_ref(), &d.properties);
        let claim = header_str(&d.properties, CLAIM_HEADER);
        let running = ctx.shared.claim_id(&key);
        if running.is_some() && (claim.is_none() || claim == running) {
            keep.push(d);
            continue;
        }
        // A copy without a claim id predates claim markers: it was this
        // agent's claim.
        let marker = match &claim {
            Some(c) => ctx.markers.look(&key, c).await?,
            None => Marker::Ours,
        };
        match leftover(marker) {
            Leftover::Discard => {
                info!(job_id = %key, marker = ?marker, "lease copy of a claim that never held the job (a connection was lost while claiming): discarded");
                ack_lease(&d).await?;
            }
            Leftover::Recover => {
                let claim = claim.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
                recover_one(ctx, &d, &key, &claim).await?;
            }
        }
    }
    for d in keep {
        requeue_acker(&d.acker).await;
    }
    scan.finish().await?;
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

/// Publishes a stored result once, with the `message_id` of the event it
/// holds.
async fn publish_stored(ctx: &Ctx, st: &crate::report::Stored) -> Result<(), AmqpError> {
    let props = match JobEvent::decode(&st.body) {
        Ok(e) => event_properties(&e),
        Err(_) => json_properties::<JobEvent>(),
    };
    ctx.publisher
        .publish_once(
            &ctx.topo.events_exchange(),
            &st.routing_key,
            &st.body,
            props,
        )
        .await
}

/// Recovers one leftover lease of a previous agent process on this VM (its
/// marker is ours): a stored result is republished; otherwise the job's
/// fate ([`vq_common::lease::fate`] with the configured `loss_limit`) is to
/// fail ("node lost", dead-lettered, marker kept: [`fail_leftover`]) or to
/// run again here under the same claim ([`rerun_leftover`]).
async fn recover_one(
    ctx: &Arc<Ctx>,
    d: &Delivery,
    key: &str,
    claim: &str,
) -> Result<(), AmqpError> {
    let span =
        tracing::info_span!("recover", pool = %ctx.cfg.pool, agent = %ctx.agent, job_id = %key);
    async move {
        if let Some(st) = ctx.outbox.load(key) {
            if !st.sent {
                info!(
                    "republishing the stored result of a job that ended before the agent restarted"
                );
                publish_stored(ctx, &st).await?;
            }
            ack_lease(d).await?;
            ctx.outbox.remove(key);
            return Ok(());
        }
        let decoded = Job::decode(&d.data);
        let losses = header_u32(&d.properties, LOSSES_HEADER).saturating_add(1);
        match fate(
            decoded.as_ref().ok(),
            &ctx.agent,
            losses,
            ctx.cfg.loss_limit,
        ) {
            LeaseFate::Fail { reason } => {
                fail_leftover(ctx, d, key, decoded.ok().as_ref(), losses, reason).await
            }
            LeaseFate::Requeue { .. } => match decoded {
                Ok(job) => rerun_leftover(ctx, d, key, claim, job, losses).await,
                // fate() fails an undecodable job; nothing to run.
                Err(_) => Ok(()),
            },
        }
    }
    .instrument(span)
    .await
}

/// A leftover lease whose job ends here: dead-lettered with `reason`, one
/// `failed` event (attempt `losses`), then the lease copy is acked.
async fn fail_leftover(
    ctx: &Ctx,
    d: &Delivery,
    key: &str,
    job: Option<&Job>,
    losses: u32,
    reason: String,
) -> Result<(), AmqpError> {
    warn!(reason = %reason, "leftover lease: job ends failed and is dead-lettered");
    let props = with_header_u32(d.properties.clone(), LOSSES_HEADER, losses);
    dead_letter_now_props(ctx, &d.data, &props, &reason).await?;
    let submitter = header_str(&d.properties, SUBMITTER_HEADER);
    let mut event = JobEvent::about(
        job,
        key,
        &ctx.cfg.pool,
        &ctx.agent,
        submitter.as_deref(),
        JobState::Failed { reason },
    )
    .of_submission(&d.data);
    event.attempt = losses;
    let rk = job_event_key(&ctx.cfg.pool, "failed");
    ctx.publisher
        .publish_once(
            &ctx.topo.events_exchange(),
            &rk,
            &event.encode(),
            event_properties(&event),
        )
        .await?;
    ack_lease(d).await?;
    ctx.metrics.job_ended(JobOutcome::DeadLettered);
    Ok(())
}

/// A leftover lease of a rerunnable job within the loss limit: a fresh
/// lease copy of the same claim with the loss counter `losses` replaces it
/// (the marker stays ours), and the job runs again here on its own task.
async fn rerun_leftover(
    ctx: &Arc<Ctx>,
    d: &Delivery,
    key: &str,
    claim: &str,
    job: Job,
    losses: u32,
) -> Result<(), AmqpError> {
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
    let owned = Owned {
        losses,
        ack_confirmed: false,
    };
    let Some(cancel) = ctx.shared.claim_recovered(key, claim, owned, job.slots) else {
        return Ok(());
    };
    info!(
        losses,
        "leftover lease of a rerunnable job: running it again"
    );
    let ticket = Ticket {
        key: key.to_string(),
        job,
        body: d.data.clone(),
        submitter: header_str(&d.properties, SUBMITTER_HEADER),
        props,
        cancel,
        claim: claim.to_string(),
        losses,
    };
    let ctx = ctx.clone();
    tokio::spawn(
        async move {
            match plan_job_async(&ticket.job, ticket.submitter.as_deref(), &ctx.cfg, &ctx.sys).await
            {
                Ok(plan) => {
                    ctx.shared.set_cancellers(&ticket.key, ticket.cancellers());
                    run_and_release(&ctx, ticket, plan).await
                }
                Err(rej) => {
                    refuse(
                        &ctx,
                        (&ticket.body, &ticket.props),
                        Some(&ticket.job),
                        &ticket.key,
                        &rej,
                    )
                    .await;
                    let owned = ctx.shared.owned(&ticket.key);
                    release_lease(&ctx, &ticket.key, &ticket.claim, owned.as_ref()).await;
                    ctx.shared.release(&ticket.key);
                }
            }
        }
        .in_current_span(),
    );
    Ok(())
}

/// Dead-letters one of this agent's lease copies (properties `props`),
/// once; its submitter is the one the copy records ([`SUBMITTER_HEADER`],
/// written by this agent when it claimed the job), as in the controller's
/// fence.
async fn dead_letter_now_props(
    ctx: &Ctx,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
) -> Result<(), AmqpError> {
    let submitter = header_str(props, SUBMITTER_HEADER);
    let props = envelope::dead_letter_properties(props, reason, &ctx.agent, submitter.as_deref());
    ctx.publisher
        .publish_once(&ctx.topo.dead_exchange(), &ctx.cfg.pool, body, props)
        .await
}

/// Dead-letters a delivery of a job that is claimed already (here, or by
/// another agent: `elsewhere`) and acks it, never running it. A first
/// delivery (`redelivered` false) is a second message that reused the id,
/// so its submitter is told with a `failed` event marked
/// [`JobEvent::duplicate`]; a redelivered one may be the broker returning
/// a copy of the claimed job after a lost connection, which reports on its
/// own, so only the dead letter's reason tells.
async fn handle_copy(
    ctx: &Ctx,
    delivery: &Delivery,
    key: &str,
    jobs_ch: &Channel,
    elsewhere: bool,
) {
    let whose = if elsewhere {
        "another agent".to_string()
    } else {
        format!("agent {} (this one)", ctx.agent)
    };
    let reason = if delivery.redelivered {
        format!("a copy of job {key}, which {whose} has claimed already (a redelivery after a lost connection, or a duplicate submission): not run")
    } else {
        format!("duplicate job id: job {key} was claimed already by {whose}; this second message with the same id was not run")
    };
    warn!(pool = %ctx.cfg.pool, job_id = %key, "{reason}");
    ctx.reporter
        .dead_letter(DeadLetter {
            body: &delivery.data,
            props: &delivery.properties,
            reason: &reason,
        })
        .await;
    if !delivery.redelivered {
        let submitter = judged_submitter(ctx, &delivery.properties);
        let mut event = JobEvent::about(
            Job::decode(&delivery.data).ok().as_ref(),
            key,
            &ctx.cfg.pool,
            &ctx.agent,
            submitter.as_deref(),
            JobState::Failed { reason },
        )
        .of_submission(&delivery.data);
        event.duplicate = Some(fingerprint(&delivery.data));
        ctx.reporter.notice(&event).await;
    }
    let q = ctx.topo.pool_queue(&ctx.cfg.pool);
    if let Err(e) = ack_confirmed(&delivery.acker, jobs_ch, &q).await {
        warn!(job_id = %key, error = %chain(&e), "ack of a copy not confirmed");
    }
}

/// Handles a delivery of a job claimed here already (see [`handle_copy`]).
pub(crate) async fn drop_duplicate(
    ctx: Arc<Ctx>,
    delivery: Delivery,
    key: String,
    jobs_ch: Channel,
) {
    handle_copy(&ctx, &delivery, &key, &jobs_ch, false).await;
}
