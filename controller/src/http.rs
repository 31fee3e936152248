//! HTTP endpoint of the controller (axum on `listen`):
//!
//! * `GET /healthz`: liveness, `200 ok` while the process serves;
//! * `GET /readyz`: readiness, `200 ready` when the controller can act,
//!   else `503` with one reason per line ([`crate::status::readiness`]:
//!   broker not connected, a permission the broker refused to the
//!   controller's account ([`StatusReport::broker_access_refused`], the
//!   broker's ACCESS_REFUSED text), a broker alarm, the cloud unreadable,
//!   a pool failing past its first backoff steps);
//! * `GET /status`: the [`StatusReport`] as JSON (shape documented in
//!   [`crate::status`]);
//! * `GET /`: the status page, HTML for a browser ([`crate::page`]),
//!   from the same report as `/status`;
//! * `GET /metrics`: OpenMetrics text ([`Metrics`]; README.md's
//!   "Monitoring" lists every family);
//! * `GET /jobs`, `GET /jobs/{id}`: the job table, for bearer-token holders
//!   ([`crate::jobs::http`]).

use std::sync::{Arc, RwLock};
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use tokio_util::sync::CancellationToken;

pub use crate::metrics::Metrics;
pub use crate::status::{AgentCounts, Decision, PoolStatus, ServerStatus, StatusReport, VmCounts};

/// State shared by the handlers and the reconcile loop.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Latest status report.
    pub status: Arc<RwLock<StatusReport>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The job table API (`/jobs`, [`crate::jobs::http`]).
    pub jobs: crate::jobs::http::JobsApi,
    /// When the controller started: `uptime_secs` of `/status` and of the
    /// page is counted from it when they are served.
    pub started: Instant,
}

impl AppState {
    /// The latest status report as served: `generated_at` (Unix seconds)
    /// and `uptime_secs` are those of the request, not of the last
    /// successful observation, so that a controller that never observed
    /// (wrong broker password) or lost its broker does not show
    /// "Generated at Unix time 0", "Up 0s" or stale times.
    pub fn served_status(&self) -> StatusReport {
        let mut report = self
            .status
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        report.generated_at = vq_common::messages::unix_now();
        report.uptime_secs = self.started.elapsed().as_secs_f64();
        report
    }
}

/// The router (`/`, `/healthz`, `/readyz`, `/status`, `/metrics`).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(state.clone())
        .merge(crate::jobs::http::router(state.jobs))
}

async fn healthz() -> Response {
    (StatusCode::OK, "ok").into_response()
}

async fn readyz(State(s): State<AppState>) -> Response {
    let reasons = crate::status::readiness(&s.status.read().unwrap_or_else(|p| p.into_inner()));
    if reasons.is_empty() {
        (StatusCode::OK, "ready").into_response()
    } else {
        let mut body = reasons.join("\n");
        body.push('\n');
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

async fn status(State(s): State<AppState>) -> Json<StatusReport> {
    Json(s.served_status())
}

async fn page(State(s): State<AppState>) -> Html<String> {
    Html(crate::page::render(&s.served_status()))
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

/// Serves `router` on `listener` until `shutdown` is cancelled.
///
/// # Errors
/// The I/O error if serving fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn endpoints_answer() {
        let metrics = Arc::new(Metrics::new());
        metrics
            .pool_queued
            .get_or_create(&Metrics::pool("cms"))
            .set(7);
        metrics
            .deleted
            .get_or_create(&Metrics::pool_and("cms", "reason", "error"))
            .inc();
        let mut report = StatusReport {
            cluster: "vq".into(),
            broker_connected: true,
            last_cycle_at: 1.0,
            ..Default::default()
        };
        report.pools.insert(
            "cms".into(),
            PoolStatus {
                queued: 7,
                ..Default::default()
            },
        );
        let state_status = Arc::new(RwLock::new(report.clone()));
        let state = AppState {
            status: state_status.clone(),
            metrics,
            jobs: crate::jobs::http::JobsApi {
                jobs: Default::default(),
                token: None,
            },
            // Started 100 s ago, never observed: the report's own
            // `generated_at` and `uptime_secs` are 0.
            started: Instant::now()
                .checked_sub(std::time::Duration::from_secs(100))
                .unwrap(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let before = vq_common::messages::unix_now();
        let server = tokio::spawn(serve(listener, state, stop.clone()));
        let get = |path: &str| {
            let path = path.to_string();
            async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                s.write_all(
                    format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        .as_bytes(),
                )
                .await
                .unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).await.unwrap();
                out
            }
        };
        assert!(get("/healthz").await.ends_with("ok"));
        let ready = get("/readyz").await;
        assert!(
            ready.starts_with("HTTP/1.1 200") && ready.ends_with("ready"),
            "{ready}"
        );
        let status = get("/status").await;
        let body = status.split("\r\n\r\n").nth(1).unwrap();
        let mut parsed: StatusReport = serde_json::from_str(body).unwrap();
        assert!(
            parsed.generated_at >= before && parsed.generated_at <= vq_common::messages::unix_now(),
            "generated when served, not Unix time 0: {}",
            parsed.generated_at
        );
        assert!(
            parsed.uptime_secs >= 100.0,
            "uptime counted from the start, not 0: {}",
            parsed.uptime_secs
        );
        parsed.generated_at = report.generated_at;
        parsed.uptime_secs = report.uptime_secs;
        assert_eq!(parsed, report);
        let refused = "ACCESS_REFUSED - write access to exchange 'vq.control' in vhost '/' refused for user 'ctl'";
        state_status.write().unwrap().broker_access_refused = Some(refused.into());
        let health = get("/healthz").await;
        assert!(
            health.starts_with("HTTP/1.1 200"),
            "alive all the same: {health}"
        );
        let ready = get("/readyz").await;
        assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
        assert!(ready.contains(refused), "{ready}");
        state_status.write().unwrap().broker_connected = false;
        let ready = get("/readyz").await;
        let body = ready.split("\r\n\r\n").nth(1).unwrap();
        assert_eq!(body.lines().count(), 2, "one reason per line: {body}");
        assert!(body.contains("not connected to the broker"), "{body}");
        let page = get("/").await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(
            page.to_ascii_lowercase()
                .contains("content-type: text/html; charset=utf-8"),
            "{page}"
        );
        assert!(
            page.contains("<h3>Pool cms</h3>") && page.contains("<dt>queued</dt><dd>7</dd>"),
            "{page}"
        );
        assert!(page.contains("not connected to the broker"), "{page}");
        assert!(
            !page.contains("Generated at Unix time 0 ") && !page.contains("Up 0s"),
            "times of the request: {page}"
        );
        let m = get("/metrics").await;
        assert!(m.contains("vq_pool_queued{pool=\"cms\"} 7"), "{m}");
        assert!(
            m.contains("vq_servers_deleted_total{pool=\"cms\",reason=\"error\"} 1"),
            "{m}"
        );
        assert!(m.contains("vq_cloud_errors_total 0"), "{m}");
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}
