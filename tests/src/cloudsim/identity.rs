//! Keystone v3: version document and token issue/validate/revoke.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use super::state::{SimState, Token};
use super::timefmt::{iso8601, Style};
use super::REGION;

const DEFAULT_DOMAIN_ID: &str = "default";
const DEFAULT_DOMAIN_NAME: &str = "Default";

pub(crate) fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/identity", get(versions))
        .route("/identity/", get(versions))
        .route("/identity/v3", get(version))
        .route("/identity/v3/", get(version))
        .route(
            "/identity/v3/auth/tokens",
            get(validate).post(issue).delete(revoke),
        )
        .route(
            "/identity/v3/users/{user_id}/application_credentials/{id}",
            get(get_app_cred),
        )
        .with_state(state)
}

/// Keystone's error body: `{"error": {"code", "message", "title"}}`.
pub(crate) fn keystone_error(state: &SimState, status: StatusCode, message: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let mut resp = (
        status,
        axum::Json(json!({"error": {"code": status.as_u16(), "message": message, "title": title}})),
    )
        .into_response();
    if status == StatusCode::UNAUTHORIZED {
        let value = format!("Keystone uri=\"{}/identity/v3\"", state.base());
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert("WWW-Authenticate", v);
        }
    }
    resp
}

fn version_doc(state: &SimState) -> Value {
    json!({
        "id": "v3.14",
        "status": "stable",
        "updated": "2020-04-07T00:00:00Z",
        "links": [{"rel": "self", "href": format!("{}/identity/v3/", state.base())}],
        "media-types": [{
            "base": "application/json",
            "type": "application/vnd.openstack.identity-v3+json"
        }]
    })
}

async fn versions(State(state): State<Arc<SimState>>) -> Response {
    (
        StatusCode::MULTIPLE_CHOICES,
        axum::Json(json!({"versions": {"values": [version_doc(&state)]}})),
    )
        .into_response()
}

async fn version(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({"version": version_doc(&state)})).into_response()
}

const AUTH_REQUIRED: &str = "The request you have made requires authentication.";

/// Authentication outcome before a token is minted.
struct Grant {
    methods: Vec<&'static str>,
    scoped: bool,
    app_cred: Option<String>,
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

fn domain_matches(domain: Option<&Value>) -> bool {
    match domain {
        None => false,
        Some(d) => {
            d.get("id").and_then(Value::as_str) == Some(DEFAULT_DOMAIN_ID)
                || d.get("name").and_then(Value::as_str) == Some(DEFAULT_DOMAIN_NAME)
        }
    }
}

/// Check the request body; `Err` carries Keystone's status and message.
fn authenticate(state: &SimState, body: &Value) -> Result<Grant, (StatusCode, String)> {
    let bad = |m: &str| (StatusCode::BAD_REQUEST, m.to_string());
    let unauthorized = || (StatusCode::UNAUTHORIZED, AUTH_REQUIRED.to_string());
    let identity = body
        .get("auth")
        .and_then(|a| a.get("identity"))
        .ok_or_else(|| bad("'identity' is a required property"))?;
    let methods: Vec<&str> = identity
        .get("methods")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("'methods' is a required property"))?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let scope = body.get("auth").and_then(|a| a.get("scope"));
    let cfg = &state.config;
    match methods.as_slice() {
        ["password"] => {
            let user = identity
                .get("password")
                .and_then(|p| p.get("user"))
                .ok_or_else(|| bad("'user' is a required property"))?;
            let by_id = user.get("id").and_then(Value::as_str) == Some(state.user_id.as_str());
            let by_name = user.get("name").and_then(Value::as_str) == Some(cfg.user.as_str())
                && domain_matches(user.get("domain"));
            let password_ok =
                user.get("password").and_then(Value::as_str) == Some(cfg.password.as_str());
            if !(by_id || by_name) || !password_ok {
                return Err(unauthorized());
            }
            let scoped = match scope {
                None => false,
                Some(scope) => {
                    let project = scope.get("project").ok_or_else(unauthorized)?;
                    let by_id = project.get("id").and_then(Value::as_str)
                        == Some(state.project_id.as_str());
                    let by_name = project.get("name").and_then(Value::as_str)
                        == Some(cfg.project.as_str())
                        && domain_matches(project.get("domain"));
                    if !(by_id || by_name) {
                        return Err(unauthorized());
                    }
                    true
                }
            };
            Ok(Grant {
                methods: vec!["password"],
                scoped,
                app_cred: None,
            })
        }
        ["application_credential"] => {
            if scope.is_some() {
                return Err((
                    StatusCode::UNAUTHORIZED,
                    "Application credentials cannot request a scope.".into(),
                ));
            }
            let id = str_at(identity, &["application_credential", "id"]);
            let secret = str_at(identity, &["application_credential", "secret"]);
            match &cfg.app_cred {
                Some((want_id, want_secret))
                    if id == Some(want_id.as_str()) && secret == Some(want_secret.as_str()) =>
                {
                    Ok(Grant {
                        methods: vec!["application_credential"],
                        scoped: true,
                        app_cred: Some(want_id.clone()),
                    })
                }
                _ => Err(unauthorized()),
            }
        }
        [] => Err(bad(
            "Invalid input for field 'identity': methods must not be empty",
        )),
        _ => Err(unauthorized()),
    }
}

/// The token body shared by issue and validate.
fn token_body(state: &SimState, token: &Token) -> Value {
    let base = state.base();
    let domain = json!({"id": DEFAULT_DOMAIN_ID, "name": DEFAULT_DOMAIN_NAME});
    let mut body = json!({
        "methods": token.methods,
        "user": {
            "domain": domain,
            "id": state.user_id,
            "name": state.config.user,
            "password_expires_at": null
        },
        "audit_ids": [token.audit_id],
        "expires_at": iso8601(token.expires_at, Style::Micros),
        "issued_at": iso8601(token.issued_at, Style::Micros),
    });
    if token.scoped {
        let endpoints = |url: String, seed: u8| -> Value {
            ["public", "internal", "admin"]
                .iter()
                .enumerate()
                .map(|(i, interface)| {
                    json!({
                        "id": format!("{:030x}{:02x}", seed, i),
                        "interface": interface,
                        "region": REGION,
                        "region_id": REGION,
                        "url": url,
                    })
                })
                .collect()
        };
        body["project"] =
            json!({"domain": domain, "id": state.project_id, "name": state.config.project});
        body["is_domain"] = json!(false);
        body["roles"] = json!([
            {"id": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "name": "member"},
            {"id": "a1b2c3d4e5f60718293a4b5c6d7e8f90", "name": "reader"}
        ]);
        body["catalog"] = json!([
            {"endpoints": endpoints(format!("{base}/compute/v2.1"), 1), "id": "c0000000000000000000000000000001", "type": "compute", "name": "nova"},
            {"endpoints": endpoints(format!("{base}/image"), 2), "id": "c0000000000000000000000000000002", "type": "image", "name": "glance"},
            {"endpoints": endpoints(format!("{base}/identity/v3"), 3), "id": "c0000000000000000000000000000003", "type": "identity", "name": "keystone"},
            {"endpoints": endpoints(format!("{base}/network"), 4), "id": "c0000000000000000000000000000004", "type": "network", "name": "neutron"},
        ]);
    }
    if let Some(id) = &token.app_cred {
        body["application_credential"] = json!({"id": id, "name": id, "restricted": true});
    }
    json!({ "token": body })
}

async fn issue(State(state): State<Arc<SimState>>, body: Bytes) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return keystone_error(
            &state,
            StatusCode::BAD_REQUEST,
            "Expecting to find valid JSON in request body.",
        );
    };
    let grant = match authenticate(&state, &body) {
        Ok(g) => g,
        Err((status, message)) => {
            tracing::info!(%status, "token request refused");
            return keystone_error(&state, status, &message);
        }
    };
    let now = SystemTime::now();
    let token = Token {
        methods: grant.methods,
        issued_at: now,
        // Keystone caps a token at its application credential's expiry.
        expires_at: match (&grant.app_cred, state.config.app_cred_expires_at) {
            (Some(_), Some(limit)) => (now + state.config.token_ttl).min(limit),
            _ => now + state.config.token_ttl,
        },
        scoped: grant.scoped,
        app_cred: grant.app_cred,
        audit_id: uuid::Uuid::new_v4().simple().to_string()[..22].to_string(),
    };
    let id = format!(
        "gAAAAA{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let body = token_body(&state, &token);
    state.lock().tokens.insert(id.clone(), token);
    tracing::debug!("token issued");
    let mut resp = (StatusCode::CREATED, axum::Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("X-Subject-Token", v);
    }
    resp
}

/// The token named by `header`, if it exists and has not expired.
pub(crate) fn valid_token(state: &SimState, headers: &HeaderMap, header: &str) -> Option<Token> {
    let id = headers.get(header)?.to_str().ok()?;
    let inner = state.lock();
    let token = inner.tokens.get(id)?;
    (SystemTime::now() < token.expires_at).then(|| token.clone())
}

async fn validate(State(state): State<Arc<SimState>>, headers: HeaderMap) -> Response {
    if valid_token(&state, &headers, "X-Auth-Token").is_none() {
        return keystone_error(&state, StatusCode::UNAUTHORIZED, AUTH_REQUIRED);
    }
    let subject = headers
        .get("X-Subject-Token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    match valid_token(&state, &headers, "X-Subject-Token") {
        Some(token) => {
            let mut resp = axum::Json(token_body(&state, &token)).into_response();
            if let Ok(v) = HeaderValue::from_str(&subject) {
                resp.headers_mut().insert("X-Subject-Token", v);
            }
            resp
        }
        None => keystone_error(
            &state,
            StatusCode::NOT_FOUND,
            &format!("Could not find token: {subject}."),
        ),
    }
}

/// `GET /v3/users/{user_id}/application_credentials/{id}` (Keystone API
/// v3, "Show application credential details"): the owner's own credential,
/// `expires_at` without a zone (`2018-02-27T18:30:59.000000`) or null.
async fn get_app_cred(
    State(state): State<Arc<SimState>>,
    headers: HeaderMap,
    axum::extract::Path((user_id, id)): axum::extract::Path<(String, String)>,
) -> Response {
    if valid_token(&state, &headers, "X-Auth-Token").is_none() {
        return keystone_error(&state, StatusCode::UNAUTHORIZED, AUTH_REQUIRED);
    }
    let known = state.config.app_cred.as_ref().map(|(i, _)| i.as_str());
    if user_id != state.user_id || known != Some(id.as_str()) {
        return keystone_error(
            &state,
            StatusCode::NOT_FOUND,
            &format!("Could not find application credential: {id}."),
        );
    }
    let expires_at = state
        .config
        .app_cred_expires_at
        .map(|t| iso8601(t, Style::MicrosNaive));
    axum::Json(json!({"application_credential": {
        "id": id,
        "name": id,
        "description": null,
        "expires_at": expires_at,
        "project_id": state.project_id,
        "roles": [{"id": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "name": "member"}],
        "unrestricted": false,
        "access_rules": [],
        "links": {"self": format!("{}/identity/v3/users/{user_id}/application_credentials/{id}", state.base())},
    }}))
    .into_response()
}

async fn revoke(State(state): State<Arc<SimState>>, headers: HeaderMap) -> Response {
    if valid_token(&state, &headers, "X-Auth-Token").is_none() {
        return keystone_error(&state, StatusCode::UNAUTHORIZED, AUTH_REQUIRED);
    }
    let subject = headers
        .get("X-Subject-Token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if state.lock().tokens.remove(&subject).is_some() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        keystone_error(
            &state,
            StatusCode::NOT_FOUND,
            &format!("Could not find token: {subject}."),
        )
    }
}
