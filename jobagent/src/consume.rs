//! One claimed delivery, from validation to ack: refuse it (job.failed +
//! dead letter) or run it (job.started, spawn, supervise, job.finished),
//! and only then ack, so a job is never dropped silently.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::Acker;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};
use vq_common::messages::{DecodeError, Job, JobState, Outcome, Usage};
use vq_common::topology::job_event_key;

use crate::error::{chain, Rejection};
use crate::plan::{plan_job, LaunchPlan};
use crate::report::{dead_letter_properties, job_event};
use crate::supervise::supervise;
use crate::Ctx;

/// Bound on one `basic.ack`.
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

/// Handles one claimed delivery to the end (report, ack, release).
pub(crate) async fn handle_delivery(
    ctx: Arc<Ctx>,
    delivery: Delivery,
    decoded: Result<Job, DecodeError>,
    key: String,
    cancel: CancellationToken,
) {
    let span = tracing::info_span!("job", pool = %ctx.cfg.pool, job_id = %key);
    async move {
        let submitter = delivery
            .properties
            .user_id()
            .as_ref()
            .map(|u| u.as_str().to_string());
        match decoded {
            Err(e) => refuse(&ctx, &delivery, None, &key, &Rejection::Malformed(e)).await,
            Ok(job) => match plan_job(&job, submitter.as_deref(), &ctx.cfg, &ctx.sys) {
                Err(rej) => refuse(&ctx, &delivery, Some(&job), &key, &rej).await,
                Ok(plan) => run(&ctx, &job, plan, cancel, &key).await,
            },
        }
        ack(&ctx, &delivery.acker, &key).await;
        for extra in ctx.shared.release(&key) {
            ack(&ctx, &extra, &key).await;
        }
    }
    .instrument(span)
    .await;
}

/// Refuses a delivery that will not run: publishes `job.<pool>.failed` with
/// the reason, then the original body to the dead exchange with the reason
/// in its headers, both confirmed. The caller acks afterwards.
pub(crate) async fn refuse(
    ctx: &Ctx,
    delivery: &Delivery,
    job: Option<&Job>,
    key: &str,
    rejection: &Rejection,
) {
    let reason = chain(rejection);
    warn!(reason = %reason, "job refused");
    let pool = &ctx.cfg.pool;
    let event = job_event(
        job,
        key,
        pool,
        &ctx.agent,
        JobState::Failed {
            reason: reason.clone(),
        },
    );
    ctx.publisher
        .publish_message_reliably(
            &ctx.topo.events_exchange(),
            &job_event_key(pool, "failed"),
            &event,
        )
        .await;
    let props = dead_letter_properties(&delivery.properties, &reason, &ctx.agent);
    ctx.publisher
        .publish_reliably(&ctx.topo.dead_exchange(), pool, &delivery.data, props)
        .await;
}

async fn run(ctx: &Ctx, job: &Job, plan: LaunchPlan, cancel: CancellationToken, key: &str) {
    let pool = &ctx.cfg.pool;
    let events = ctx.topo.events_exchange();
    let started_event = job_event(Some(job), key, pool, &ctx.agent, JobState::Started);
    ctx.publisher
        .publish_message_reliably(&events, &job_event_key(pool, "started"), &started_event)
        .await;
    info!(owner = %plan.owner, uid = plan.uid, walltime_secs = plan.walltime.as_secs(), "job starting");
    let started = Instant::now();
    let walltime = plan.walltime;
    let spawned = {
        let plan = plan.clone();
        tokio::task::spawn_blocking(move || crate::spawn::spawn(&plan)).await
    };
    let (outcome, usage) = match spawned {
        Ok(Ok(pid)) => {
            ctx.shared.set_pid(key, pid);
            supervise(
                pid,
                started,
                walltime,
                Duration::from_secs(ctx.cfg.kill_grace_secs),
                cancel,
            )
            .await
        }
        Ok(Err(e)) => (
            Outcome::FailedToStart { reason: chain(&e) },
            Usage::default(),
        ),
        Err(e) => (
            Outcome::FailedToStart {
                reason: format!("spawn thread failed: {e}"),
            },
            Usage::default(),
        ),
    };
    info!(outcome = ?outcome, exit_status = outcome.exit_status(), wall_secs = usage.wall_secs, "job ended");
    let state = JobState::Finished { outcome, usage };
    let word = state.routing_word();
    let event = job_event(Some(job), key, pool, &ctx.agent, state);
    ctx.publisher
        .publish_message_reliably(&events, &job_event_key(pool, word), &event)
        .await;
}

/// Acks a delivery; a lost ack (channel gone, so the broker requeued the
/// delivery) is remembered so that its redelivery is acked, not rerun.
pub(crate) async fn ack(ctx: &Ctx, acker: &Acker, key: &str) {
    let result = tokio::time::timeout(ACK_TIMEOUT, acker.ack(BasicAckOptions::default())).await;
    match result {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            warn!("ack not possible: the delivery's channel is gone and the broker requeued it; a redelivery will be acked without running");
            ctx.shared.note_ack_lost(key);
        }
        Ok(Err(e)) => {
            warn!(error = %chain(&e), "ack failed; a redelivery will be acked without running");
            ctx.shared.note_ack_lost(key);
        }
        Err(_) => {
            warn!("ack timed out; a redelivery will be acked without running");
            ctx.shared.note_ack_lost(key);
        }
    }
}
