//! The simulator's own admin API (not OpenStack): `/_sim/servers` and
//! `/_sim/faults`, and the middleware that injects the failures.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::compute::NovaFault;
use super::state::SimState;

/// One injected failure: the next `count` requests whose method and path
/// match are answered with `status` and a Nova-shaped error body (Keystone
/// shaped under `/identity`), before authentication, the way a rate limiter
/// or an overloaded API node in front of the service would.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FailRule {
    /// HTTP method to match (`GET`, `POST`, ...), or `*` for any.
    pub method: String,
    /// Path prefix to match, e.g. `/compute/v2.1/servers`.
    pub path_prefix: String,
    /// Status to answer with (409, 413, 429, 500, 503, ...).
    pub status: u16,
    /// How many matching requests fail before the rule is used up.
    #[serde(default = "one")]
    pub count: u32,
    /// Seconds put in `Retry-After` (and Nova's `retryAfter` for 413/429).
    #[serde(default)]
    pub retry_after: Option<u64>,
}

fn one() -> u32 {
    1
}

/// The fault settings, as posted to and returned by `/_sim/faults`. Every
/// field of a POST is optional; absent fields keep their current value.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Probability (0..=1) that a new server ends in ERROR with a fault
    /// instead of ACTIVE; drawn when the server is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_error_rate: Option<f64>,
    /// Servers created while this is true never leave BUILD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stuck_build: Option<bool>,
    /// Servers created while this is true are missing from every server
    /// listing (`GET /servers`, `/servers/detail`) as long as it stays true,
    /// like a cloud whose list does not show what it just created (a tag
    /// filter that ignores the tags, an eventually consistent cell). They
    /// exist, boot and count against the quota; setting it to false shows
    /// them again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hide_new_servers: Option<bool>,
    /// Page-size cap of server listings (Nova's `[api] max_limit`; default
    /// 1000): a larger `limit`, or none, gets this many per page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_limit: Option<u32>,
    /// While true, a listing page's `next` link repeats the page's last
    /// server on the next page (its marker is the second to last server),
    /// as Nova does while servers are being scheduled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlapping_pages: Option<bool>,
    /// While true, a full listing page's `next` link is the page's own URL:
    /// a repeated `next` link that never ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeated_next_link: Option<bool>,
    /// While true, `DELETE /servers/{id}` answers 204 and does nothing:
    /// the server stays listed as it was (a delete lost in a cell, a
    /// compute host that never acts on it). Setting it to false lets the
    /// next delete work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_deletes: Option<bool>,
    /// Failure rules; a POST appends its rules to the pending ones.
    #[serde(default)]
    pub fail_next: Vec<FailRule>,
    /// When true in a POST, every token issued so far expires now (this flag
    /// is an action; it is never stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_tokens_now: Option<bool>,
}

pub(crate) fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/_sim/servers", get(servers))
        .route("/_sim/faults", get(get_faults).post(post_faults))
        .route("/_sim/requests", get(requests))
        .with_state(state)
}

async fn servers(State(state): State<Arc<SimState>>) -> Response {
    let inner = state.lock();
    let list: Vec<_> = inner
        .servers
        .values()
        .map(|s| {
            json!({
                "id": s.id,
                "name": s.name,
                "status": s.status(),
                "task_state": s.task_state(),
                "metadata": s.metadata,
                "tags": s.tags,
                "hidden": s.hidden,
                "agent_pid": s.agent.as_ref().map(|a| a.pid),
                "agent_running": s.agent.as_ref().is_some_and(|a| a.running),
                "agent_exit": s.agent.as_ref().and_then(|a| a.exit.clone()),
                "cgroup": s.agent.as_ref().and_then(|a| a.cgroup.as_ref()).map(|c| c.path()),
                "vm_dir": state.config.state_dir.join("vms").join(&s.id),
            })
        })
        .collect();
    axum::Json(json!({
        "servers": list,
        "created_total": inner.created_total,
        "delete_requests_total": inner.delete_requests_total,
    }))
    .into_response()
}

/// Every create and delete request received, oldest first:
/// `{"requests": [{"at", "method", "path", "user_agent"}]}`.
async fn requests(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({ "requests": state.lock().mutations })).into_response()
}

async fn get_faults(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(state.lock().faults.clone()).into_response()
}

async fn post_faults(State(state): State<Arc<SimState>>, body: Bytes) -> Response {
    let update: Faults = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": format!("invalid faults: {e}")})),
            )
                .into_response()
        }
    };
    if let Some(rate) = update.create_error_rate {
        if !(0.0..=1.0).contains(&rate) {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": "create_error_rate must be within 0..=1"})),
            )
                .into_response();
        }
    }
    let mut inner = state.lock();
    if update.create_error_rate.is_some() {
        inner.faults.create_error_rate = update.create_error_rate;
    }
    if update.stuck_build.is_some() {
        inner.faults.stuck_build = update.stuck_build;
    }
    if update.hide_new_servers.is_some() {
        inner.faults.hide_new_servers = update.hide_new_servers;
    }
    if update.max_limit.is_some() {
        inner.faults.max_limit = update.max_limit;
    }
    if update.overlapping_pages.is_some() {
        inner.faults.overlapping_pages = update.overlapping_pages;
    }
    if update.repeated_next_link.is_some() {
        inner.faults.repeated_next_link = update.repeated_next_link;
    }
    if update.ignore_deletes.is_some() {
        inner.faults.ignore_deletes = update.ignore_deletes;
    }
    inner.faults.fail_next.extend(update.fail_next);
    if update.expire_tokens_now == Some(true) {
        let now = SystemTime::now();
        let n = inner.tokens.len();
        for token in inner.tokens.values_mut() {
            token.expires_at = token.expires_at.min(now);
        }
        tracing::info!(tokens = n, "fault: all tokens expired");
    }
    tracing::info!(faults = ?inner.faults, "faults updated");
    axum::Json(inner.faults.clone()).into_response()
}

/// Answer the request from the first matching [`FailRule`], if any.
pub(crate) async fn inject_faults(
    State(state): State<Arc<SimState>>,
    req: Request,
    next: Next,
) -> Response {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let hit = {
        let mut inner = state.lock();
        let servers = path.trim_end_matches('/').ends_with("/servers");
        if (method == "POST" && servers) || (method == "DELETE" && path.contains("/servers/")) {
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            let user_agent = req
                .headers()
                .get(axum::http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            inner.mutations.push(super::state::Mutation {
                at,
                method: method.clone(),
                path: path.clone(),
                user_agent,
            });
        }
        let rules = &mut inner.faults.fail_next;
        let found = rules.iter().position(|r| {
            (r.method == "*" || r.method.eq_ignore_ascii_case(&method))
                && path.starts_with(&r.path_prefix)
        });
        found.map(|i| {
            let rule = rules[i].clone();
            if rules[i].count <= 1 {
                rules.remove(i);
            } else {
                rules[i].count -= 1;
            }
            rule
        })
    };
    let Some(rule) = hit else {
        return next.run(req).await;
    };
    let status = StatusCode::from_u16(rule.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    tracing::info!(%method, %path, status = rule.status, "fault: injected error response");
    let message = match status.as_u16() {
        409 => "Conflict (injected by cloudsim)".to_string(),
        413 | 429 => "This request was rate-limited.".to_string(),
        503 => "The server is currently unavailable. Please try again at a later time.".to_string(),
        _ => "Unexpected API Error. Please report this at http://bugs.launchpad.net/nova/ and attach the Nova API log if possible.".to_string(),
    };
    if path.starts_with("/identity") {
        let mut resp = super::identity::keystone_error(&state, status, &message);
        if let Some(secs) = rule.retry_after {
            resp.headers_mut()
                .insert("Retry-After", axum::http::HeaderValue::from(secs));
        }
        return resp;
    }
    NovaFault::new(status, message)
        .with_retry_after(rule.retry_after)
        .into_response()
}
