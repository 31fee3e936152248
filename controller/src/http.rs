//! HTTP endpoint of the controller (axum on `listen`):
//!
//! * `GET /healthz`: `200 ok` while the process runs, `503` with the
//!   broker's ACCESS_REFUSED text while the last cycle failed because the
//!   controller's broker account lacks a permission
//!   ([`StatusReport::broker_access_refused`]);
//! * `GET /status`: the [`StatusReport`] as JSON (shape documented in
//!   [`crate::status`]);
//! * `GET /metrics`: Prometheus text format: `vq_pool_queued{pool}`,
//!   `vq_pool_running{pool}`, `vq_pool_target_vms{pool}`,
//!   `vq_pool_vms{pool,state}`, `vq_servers_created_total{pool}`,
//!   `vq_servers_deleted_total{pool,reason}`, `vq_cloud_errors_total`.

use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
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
}

/// The router (`/healthz`, `/status`, `/metrics`).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz(State(s): State<AppState>) -> Response {
    let refused = s
        .status
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .broker_access_refused
        .clone();
    match refused {
        None => (StatusCode::OK, "ok").into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ok: the broker refused a permission of the controller's account: {reason}"
            ),
        )
            .into_response(),
    }
}

async fn status(State(s): State<AppState>) -> Json<StatusReport> {
    let report = s.status.read().unwrap_or_else(|p| p.into_inner()).clone();
    Json(report)
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
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
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
        let status = get("/status").await;
        let body = status.split("\r\n\r\n").nth(1).unwrap();
        let parsed: StatusReport = serde_json::from_str(body).unwrap();
        assert_eq!(parsed, report);
        let refused = "ACCESS_REFUSED - write access to exchange 'vq.control' in vhost '/' refused for user 'ctl'";
        state_status.write().unwrap().broker_access_refused = Some(refused.into());
        let health = get("/healthz").await;
        assert!(health.starts_with("HTTP/1.1 503"), "{health}");
        assert!(health.contains(refused), "{health}");
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
