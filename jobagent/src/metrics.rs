//! The agent's own `/metrics` (OpenMetrics text), served on
//! `metrics_listen` when it is set (off by default), so that a site that
//! scrapes its nodes sees the agents too:
//!
//! * `vq_agent_slots`: jobs the agent runs at once (`slots`);
//! * `vq_agent_jobs_running`: jobs claimed or running now;
//! * `vq_agent_jobs_total{outcome}`: jobs that ended here, by outcome:
//!   `exited`, `signaled`, `walltime`, `cancelled`, `output_limit`,
//!   `failed_to_start` (the job's outcome), `refused` (invalid or not
//!   allowed, never run) and `dead_lettered` (ended without a result: a
//!   non-rerunnable job stopped by the agent's shutdown, a leftover lease
//!   over the loss limit). A job stopped by the shutdown that runs again
//!   (rerunnable) and a duplicate copy of a job are not counted;
//! * `vq_agent_broker_connected`: 1 while the publishing channel to the
//!   broker is open, read when scraped;
//! * `vq_agent_heartbeats_sent_total` and
//!   `vq_agent_last_heartbeat_timestamp_seconds` (Unix time of the last
//!   heartbeat the broker confirmed; 0 before the first);
//! * `vq_agent_output_bytes_written_total`: bytes of job output written
//!   into output files;
//! * `vq_agent_build_info{version}`.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};
use vq_common::messages::Outcome;

use crate::ctx::Ctx;

type Labels = Vec<(&'static str, &'static str)>;

/// How a job ended, as the `outcome` label of `vq_agent_jobs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOutcome {
    /// [`Outcome::Exited`].
    Exited,
    /// [`Outcome::Signaled`].
    Signaled,
    /// [`Outcome::Walltime`].
    Walltime,
    /// [`Outcome::Cancelled`].
    Cancelled,
    /// [`Outcome::OutputLimit`].
    OutputLimit,
    /// [`Outcome::FailedToStart`].
    FailedToStart,
    /// Refused before it ran (malformed, invalid, not allowed).
    Refused,
    /// Ended without a result and dead-lettered.
    DeadLettered,
}

impl JobOutcome {
    /// Every outcome, in label order.
    pub const ALL: [JobOutcome; 8] = [
        JobOutcome::Exited,
        JobOutcome::Signaled,
        JobOutcome::Walltime,
        JobOutcome::Cancelled,
        JobOutcome::OutputLimit,
        JobOutcome::FailedToStart,
        JobOutcome::Refused,
        JobOutcome::DeadLettered,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            JobOutcome::Exited => "exited",
            JobOutcome::Signaled => "signaled",
            JobOutcome::Walltime => "walltime",
            JobOutcome::Cancelled => "cancelled",
            JobOutcome::OutputLimit => "output_limit",
            JobOutcome::FailedToStart => "failed_to_start",
            JobOutcome::Refused => "refused",
            JobOutcome::DeadLettered => "dead_lettered",
        }
    }
}

impl From<&Outcome> for JobOutcome {
    fn from(o: &Outcome) -> Self {
        match o {
            Outcome::Exited { .. } => JobOutcome::Exited,
            Outcome::Signaled { .. } => JobOutcome::Signaled,
            Outcome::Walltime => JobOutcome::Walltime,
            Outcome::Cancelled => JobOutcome::Cancelled,
            Outcome::OutputLimit => JobOutcome::OutputLimit,
            Outcome::FailedToStart { .. } => JobOutcome::FailedToStart,
        }
    }
}

/// The agent's metrics (see the module doc). Counters are updated where
/// things happen; `jobs_running` and `broker_connected` are read from the
/// agent's state when scraped, so they are never stale.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `vq_agent_slots`.
    pub slots: Gauge,
    /// `vq_agent_jobs_running`.
    pub jobs_running: Gauge,
    /// `vq_agent_jobs_total{outcome}`.
    jobs: Family<Labels, Counter>,
    /// `vq_agent_broker_connected`.
    pub broker_connected: Gauge,
    /// `vq_agent_heartbeats_sent_total`.
    pub heartbeats_sent: Counter,
    /// `vq_agent_last_heartbeat_timestamp_seconds`.
    pub last_heartbeat: Gauge<f64, AtomicU64>,
    /// `vq_agent_output_bytes_written_total`, shared with the output
    /// copiers ([`crate::output::copy_capped`]).
    pub output_bytes: Counter,
}

impl Metrics {
    /// Registers every metric; `slots` is the configured slot count.
    pub fn new(slots: u32) -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            slots: Gauge::default(),
            jobs_running: Gauge::default(),
            jobs: Family::default(),
            broker_connected: Gauge::default(),
            heartbeats_sent: Counter::default(),
            last_heartbeat: Gauge::default(),
            output_bytes: Counter::default(),
        };
        m.slots.set(i64::from(slots));
        // Every outcome from the start, so that rates work from 0.
        for o in JobOutcome::ALL {
            let _ = m.jobs.get_or_create(&vec![("outcome", o.as_str())]);
        }
        registry.register(
            "vq_agent_slots",
            "Jobs the agent runs at once",
            m.slots.clone(),
        );
        registry.register(
            "vq_agent_jobs_running",
            "Jobs claimed or running on the agent",
            m.jobs_running.clone(),
        );
        registry.register(
            "vq_agent_jobs",
            "Jobs that ended on the agent, by outcome",
            m.jobs.clone(),
        );
        registry.register(
            "vq_agent_broker_connected",
            "1 while the agent's publishing channel to the broker is open",
            m.broker_connected.clone(),
        );
        registry.register(
            "vq_agent_heartbeats_sent",
            "Heartbeats the broker confirmed",
            m.heartbeats_sent.clone(),
        );
        registry.register(
            "vq_agent_last_heartbeat_timestamp_seconds",
            "Unix time of the last heartbeat the broker confirmed (0: none yet)",
            m.last_heartbeat.clone(),
        );
        registry.register(
            "vq_agent_output_bytes_written",
            "Bytes of job output written into output files",
            m.output_bytes.clone(),
        );
        registry.register(
            "vq_agent_build",
            "The agent's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        Metrics { registry, ..m }
    }

    /// Counts a job that ended with `outcome`.
    pub fn job_ended(&self, outcome: JobOutcome) {
        self.jobs
            .get_or_create(&vec![("outcome", outcome.as_str())])
            .inc();
    }

    /// The count of jobs that ended with `outcome`.
    pub fn jobs_ended(&self, outcome: JobOutcome) -> u64 {
        self.jobs
            .get_or_create(&vec![("outcome", outcome.as_str())])
            .get()
    }

    /// Counts a confirmed heartbeat sent at `at` (Unix seconds).
    pub fn heartbeat_sent(&self, at: f64) {
        self.heartbeats_sent.inc();
        self.last_heartbeat.set(at);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `GET /metrics` on `addr` until `stop`. A port that cannot be
/// bound is logged and the agent runs on without metrics: jobs matter more
/// than their numbers (a scraper sees the target down).
pub(crate) async fn serve(ctx: Arc<Ctx>, addr: SocketAddr, stop: CancellationToken) {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            error!(%addr, error = %e, "cannot listen for /metrics; running without metrics");
            return;
        }
    };
    info!(addr = %listener.local_addr().unwrap_or(addr), "serving /metrics");
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(ctx);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
    {
        error!(error = %e, "/metrics stopped serving");
    }
}

async fn metrics(State(ctx): State<Arc<Ctx>>) -> Response {
    let running = ctx.shared.snapshot().running.len();
    ctx.metrics
        .jobs_running
        .set(i64::try_from(running).unwrap_or(i64::MAX));
    ctx.metrics
        .broker_connected
        .set(i64::from(ctx.publisher.is_connected()));
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctx.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_rendered_with_every_outcome_from_zero() {
        let m = Metrics::new(4);
        m.job_ended(JobOutcome::from(&Outcome::Exited { code: 3 }));
        m.job_ended(JobOutcome::Refused);
        m.heartbeat_sent(1_700_000_000.5);
        m.output_bytes.inc_by(12);
        let text = m.render();
        for line in [
            "vq_agent_slots 4",
            "vq_agent_jobs_running 0",
            "vq_agent_jobs_total{outcome=\"exited\"} 1",
            "vq_agent_jobs_total{outcome=\"refused\"} 1",
            "vq_agent_jobs_total{outcome=\"dead_lettered\"} 0",
            "vq_agent_jobs_total{outcome=\"output_limit\"} 0",
            "vq_agent_broker_connected 0",
            "vq_agent_heartbeats_sent_total 1",
            "vq_agent_last_heartbeat_timestamp_seconds 1700000000.5",
            "vq_agent_output_bytes_written_total 12",
            &format!(
                "vq_agent_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        for o in JobOutcome::ALL {
            assert!(text.contains(&format!("outcome=\"{}\"", o.as_str())));
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
