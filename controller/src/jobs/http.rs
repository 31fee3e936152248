//! `GET /jobs` and `GET /jobs/{id}`: the job table over HTTP, read-only.
//!
//! Callers authenticate with `Authorization: Bearer <token>`, the token
//! being the content of `[jobs] api_token_file` (mode 0600; surrounding
//! whitespace ignored). Token holders are operators and see every job.
//! Without a configured token both routes answer `404` saying how to turn
//! the API on; a missing or wrong token gets `401` with
//! `WWW-Authenticate: Bearer`. While the table is being built from the
//! stream (after a start or a broker reconnect) they answer `503`.
//!
//! `/jobs` takes `owner`, `state` (letters of `Q R C F X`, e.g. `QR`),
//! `pool`, `limit` (1–1000, default 100) and `after` (the `next` cursor of
//! the previous page) and answers
//! `{"complete": true, "jobs": [<record>…], "next": <cursor or null>}`
//! with records shaped as [`JobRecord`], in order of submission.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use super::feed::SharedJobs;
use vq_common::jobs::{Filter, JobRecord, State as JobStateLetter};

/// Default and largest page size of `/jobs`.
pub const DEFAULT_LIMIT: usize = 100;
/// See [`DEFAULT_LIMIT`].
pub const MAX_LIMIT: usize = 1000;

/// What the handlers need.
#[derive(Debug, Clone)]
pub struct JobsApi {
    /// The table.
    pub jobs: SharedJobs,
    /// The bearer token; `None`: the API is off.
    pub token: Option<Arc<str>>,
}

/// The `/jobs` routes.
pub fn router(api: JobsApi) -> Router {
    Router::new()
        .route("/jobs", get(list))
        .route("/jobs/{id}", get(one))
        .with_state(api)
}

/// Query of `/jobs`.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    owner: Option<String>,
    state: Option<String>,
    pool: Option<String>,
    limit: Option<usize>,
    after: Option<u64>,
}

/// Reads the bearer token from `path`: its first line, trimmed.
///
/// # Errors
/// A sentence saying what is wrong: unreadable, empty, or readable or
/// writable by group or others (it must be mode 0600, like a TLS key).
pub fn read_token(path: &str) -> Result<Arc<str>, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "mode {mode:04o} lets group or others read it; make it 0600 (chmod 600)"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
    let token = text.lines().next().unwrap_or("").trim();
    if token.is_empty() {
        return Err("it holds no token (the token is its first line)".into());
    }
    Ok(Arc::from(token))
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    let mut body = body.into();
    body.push('\n');
    (status, body).into_response()
}

/// Compares two byte strings in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `Ok` if the request may read the table, else the answer to give.
fn admit(api: &JobsApi, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let Some(token) = &api.token else {
        return Err(Box::new(text(
            StatusCode::NOT_FOUND,
            "the job API is off: set [jobs] api_token_file in the controller's config",
        )));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if same(g.as_bytes(), token.as_bytes()) => {}
        _ => {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "a valid bearer token is needed (Authorization: Bearer <token of [jobs] api_token_file>)",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return Err(Box::new(r));
        }
    }
    let v = api.jobs.read().unwrap_or_else(|p| p.into_inner());
    if !v.complete {
        let why = v
            .stalled
            .clone()
            .unwrap_or_else(|| "the job table is being built from the event stream".into());
        return Err(Box::new(text(StatusCode::SERVICE_UNAVAILABLE, why)));
    }
    Ok(())
}

/// Parses `/jobs`' query into a filter, page start and size.
///
/// # Errors
/// The 400 answer naming the bad parameter.
pub fn parse_query(q: &ListQuery) -> Result<(Filter, Option<u64>, usize), String> {
    let mut states = Vec::new();
    for c in q.state.as_deref().unwrap_or("").chars() {
        states.push(
            JobStateLetter::from_letter(c)
                .ok_or_else(|| format!("state: {c:?} is not a job state (Q R C F X)"))?,
        );
    }
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(format!("limit: {limit} is not within 1-{MAX_LIMIT}"));
    }
    Ok((
        Filter {
            owner: q.owner.clone(),
            states,
            pool: q.pool.clone(),
            visible_to: None,
        },
        q.after,
        limit,
    ))
}

async fn list(
    State(api): State<JobsApi>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    if let Err(r) = admit(&api, &headers) {
        return *r;
    }
    let (filter, after, limit) = match parse_query(&q) {
        Ok(p) => p,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    let v = api.jobs.read().unwrap_or_else(|p| p.into_inner());
    let (mut jobs, next) = v.table.query(&filter, after, limit);
    jobs.iter_mut().for_each(|r| v.annotate(r));
    Json(serde_json::json!({
        "complete": v.complete,
        "jobs": jobs,
        "next": next,
    }))
    .into_response()
}

async fn one(State(api): State<JobsApi>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = admit(&api, &headers) {
        return *r;
    }
    let v = api.jobs.read().unwrap_or_else(|p| p.into_inner());
    match v.table.get(&id) {
        Some(mut r) => {
            v.annotate(&mut r);
            Json::<JobRecord>(r).into_response()
        }
        None => text(StatusCode::NOT_FOUND, format!("unknown job id {id:?}")),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn the_token_file_must_be_private_and_hold_a_token() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t");
        std::fs::write(&f, "  abc \nignored\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let path = f.to_str().unwrap();
        assert_eq!(&*read_token(path).unwrap(), "abc");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = read_token(path).unwrap_err();
        assert!(e.contains("0640") && e.contains("chmod 600"), "{e}");
        std::fs::write(&f, "\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_token(path).unwrap_err().contains("no token"));
        let e = read_token(dir.path().join("absent").to_str().unwrap()).unwrap_err();
        assert!(e.contains("cannot read"), "{e}");
    }

    #[test]
    fn queries_are_checked_and_tokens_compared_whole() {
        let q = ListQuery {
            state: Some("qR".into()),
            owner: Some("alice".into()),
            ..Default::default()
        };
        let (f, after, limit) = parse_query(&q).unwrap();
        assert_eq!(f.states, [JobStateLetter::Queued, JobStateLetter::Running]);
        assert_eq!((after, limit), (None, DEFAULT_LIMIT));
        let bad = ListQuery {
            state: Some("QZ".into()),
            ..Default::default()
        };
        assert!(parse_query(&bad).unwrap_err().contains("'Z'"));
        for limit in [0, MAX_LIMIT + 1] {
            let q = ListQuery {
                limit: Some(limit),
                ..Default::default()
            };
            assert!(parse_query(&q).unwrap_err().starts_with("limit"));
        }
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd") && !same(b"abc", b"ab") && !same(b"", b"a"));
    }
}
