//! `vq-jobagent`: the daemon inside every VM. It pulls jobs of its pool from
//! RabbitMQ, validates them, runs each as its owner (uid, gid, groups, shell,
//! working directory, clean PBS environment), enforces walltime, reports
//! `job.<pool>.started|finished|failed|cancelled` with publisher confirms,
//! heartbeats, and answers drain and ask-delete questions (DESIGN.md, "The
//! jobagent").
//!
//! Modules: [`settings`] (config + identity), [`plan`] (pure validation →
//! [`plan::LaunchPlan`]), [`sys`] (user database seam), `spawn` (the only
//! `unsafe`: privilege drop and exec), [`supervise`] (walltime, cancel,
//! rusage), [`report`] (publishing; `Reporter` owns each transition's
//! store → publish → mark-sent), [`state`] (claims and the agent's
//! [`state::Mode`]), `ctx` (what the tasks share), `session` (broker
//! session and control), `job` (one job from claim to release, and the
//! recovery of leftover leases), `lease` (lease-queue operations only),
//! `heartbeat`, [`metrics`] (`/metrics` on `metrics_listen`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vq_common::config::AgentConfig;
use vq_common::topology::Topology;

mod claim;
mod ctx;
pub mod error;
mod heartbeat;
mod job;
mod lease;
pub mod metrics;
pub mod nss;
pub mod output;
pub mod plan;
pub mod report;
mod session;
pub mod settings;
pub mod spawn;
pub mod state;
pub mod supervise;
pub mod sys;

pub use error::{AgentError, LaunchError, Rejection};

use ctx::Ctx;

/// Exit code for "must run as root" (`EX_NOPERM`).
pub const EXIT_NOPERM: i32 = 77;

/// Shutdown requests: the first SIGTERM/SIGINT cancels `drain`, the second
/// cancels `force`.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    /// Stop pulling, let running jobs finish within the grace period.
    pub drain: CancellationToken,
    /// Kill running jobs and exit now.
    pub force: CancellationToken,
}

/// How the agent ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Drained: every job finished (or was stopped) and was reported.
    Drained,
    /// Forced: jobs were killed without reports.
    Forced,
}

/// How long, after the drain grace, the agent waits for interrupted jobs to
/// stop and for pending results to be confirmed before it exits anyway
/// (results stay in the outbox and leases in the lease queue).
const AFTER_GRACE: Duration = Duration::from_secs(30);

/// Runs the agent until `shutdown`. On the first signal it stops pulling,
/// waits up to `drain_grace` for running jobs, then stops the rest:
/// rerunnable ones keep their lease and run again (after an agent restart
/// here, or on another VM when the controller fences this one),
/// non-rerunnable ones are reported failed. On the second signal it kills
/// every job's process group and returns at once. The broker connection is
/// closed before returning.
///
/// # Errors
/// [`AgentError::StateDir`] if the state directory or its outbox cannot be
/// created.
pub async fn run(
    cfg: AgentConfig,
    shutdown: Shutdown,
    drain_grace: Duration,
) -> Result<Ended, AgentError> {
    create_state_dir(&cfg.state_dir)?;
    supervise::prepare_host(&cfg);
    let (channel_tx, channel_rx) = watch::channel(None);
    let (lease_tx, lease_rx) = watch::channel(None);
    let (conn_tx, conn_rx) = watch::channel(None);
    let (blocked_tx, blocked_rx) = watch::channel(false);
    let blocked_tx = Arc::new(blocked_tx);
    let outbox = report::Outbox::open(&cfg.state_dir).map_err(|source| AgentError::StateDir {
        path: cfg.state_dir.join("outbox"),
        source,
    })?;
    let topo = Topology::new(cfg.cluster.clone());
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let publisher = report::Publisher::new(
        channel_rx,
        blocked_rx,
        Duration::from_secs(cfg.broker.confirm_timeout_secs),
    );
    let ctx = Arc::new(Ctx {
        reporter: report::Reporter::new(
            publisher.clone(),
            outbox.clone(),
            topo.clone(),
            cfg.pool.clone(),
            cfg.agent_id.clone(),
        ),
        leases: lease::Leases::new(topo.lease_queue(&cfg.agent_id), lease_rx),
        markers: claim::Markers::new(topo.clone(), cfg.agent_id.clone(), conn_rx),
        session: watch::channel(0).0,
        restart_session: std::sync::atomic::AtomicBool::new(false),
        session_refused: std::sync::atomic::AtomicBool::new(false),
        outbox,
        topo,
        agent: cfg.agent_id.clone(),
        host,
        shared: state::Shared::new(cfg.slots),
        publisher,
        sys: sys::HostSys,
        registered: std::sync::atomic::AtomicBool::new(false),
        lease_queue_gone: std::sync::atomic::AtomicBool::new(false),
        metrics: metrics::Metrics::new(cfg.slots),
        cfg,
    });
    info!(pool = %ctx.cfg.pool, agent = %ctx.agent, cluster = %ctx.cfg.cluster, slots = ctx.cfg.slots,
        broker = %vq_common::config::redact_url(&ctx.cfg.broker.url), "jobagent starting");

    let stop = CancellationToken::new();
    let conn_task = tokio::spawn(session::connection_loop(
        ctx.clone(),
        session::Links {
            channel_tx,
            lease_tx,
            conn_tx,
            blocked_tx,
        },
        stop.clone(),
    ));
    let hb_task = tokio::spawn(heartbeat::heartbeat_loop(ctx.clone(), stop.clone()));
    let refresh_task = tokio::spawn(refresh_markers(ctx.clone(), stop.clone()));
    // Validated by `AgentConfig::validate`; empty = off.
    let metrics_task = ctx
        .cfg
        .metrics_listen
        .parse()
        .ok()
        .map(|addr| tokio::spawn(metrics::serve(ctx.clone(), addr, stop.clone())));

    tokio::select! {
        _ = shutdown.drain.cancelled() => {}
        _ = shutdown.force.cancelled() => {}
    }
    let mut ended = Ended::Drained;
    if !shutdown.force.is_cancelled() {
        info!(pool = %ctx.cfg.pool, grace_secs = drain_grace.as_secs(), "first signal: draining (stop pulling, let jobs finish)");
        ctx.shared.start_shutdown();
        tokio::select! {
            _ = ctx.shared.wait_idle() => {}
            _ = tokio::time::sleep(drain_grace) => {
                warn!(pool = %ctx.cfg.pool, "drain grace period over: stopping running jobs (rerunnable ones keep their lease and run again)");
                ctx.shared.interrupt_all();
                tokio::select! {
                    _ = ctx.shared.wait_idle() => {}
                    _ = tokio::time::sleep(AFTER_GRACE) => {
                        warn!(pool = %ctx.cfg.pool, "results not confirmed in time; they stay in the outbox for the next start");
                    }
                    _ = shutdown.force.cancelled() => {}
                }
            }
            _ = shutdown.force.cancelled() => {}
        }
    }
    if shutdown.force.is_cancelled() {
        warn!(pool = %ctx.cfg.pool, "second signal: killing running jobs and exiting now");
        ctx.shared.kill_all();
        ended = Ended::Forced;
    } else {
        ctx.shared.mark_deleted();
        info!(pool = %ctx.cfg.pool, "all jobs reported; exiting");
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), conn_task).await;
    hb_task.abort();
    refresh_task.abort();
    if let Some(t) = metrics_task {
        t.abort();
    }
    Ok(ended)
}

/// Declares the claim marker of every job running here again every
/// [`vq_common::topology::CLAIM_REFRESH_SECS`], which restarts its expiry
/// ([`vq_common::topology::CLAIM_TTL_MS`]), so that a days-long job keeps
/// its marker.
async fn refresh_markers(ctx: Arc<Ctx>, stop: CancellationToken) {
    let period = Duration::from_secs(vq_common::topology::CLAIM_REFRESH_SECS);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.cancelled() => return,
        }
        for (job, claim) in ctx.shared.owned_claims() {
            match ctx.markers.refresh(&job, &claim).await {
                Ok(vq_common::lease::Marker::Ours) => {}
                Ok(m) => {
                    warn!(job_id = %job, marker = ?m, "the claim marker of a running job is not ours any more")
                }
                Err(e) => {
                    warn!(job_id = %job, error = %error::chain(&e), "cannot refresh a claim marker now")
                }
            }
        }
    }
}

fn create_state_dir(dir: &std::path::Path) -> Result<(), AgentError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| AgentError::StateDir {
            path: dir.to_path_buf(),
            source,
        })
}
