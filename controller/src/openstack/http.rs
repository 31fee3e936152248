//! HTTP plumbing of [`HttpCloud`]: the client, the Keystone token and the
//! service catalog (renewed before it expires), sending a request with one
//! token renewal on 401 and a version check on 406, and the OpenStack fault
//! message of an error response.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use reqwest::{RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::Mutex;
use vq_common::config::Microversion;
use vq_common::messages::unix_now;

use super::{parse_timestamp, token_renew_margin_secs, Credentials, DEFAULT_COMPUTE_MICROVERSION};
use crate::error::{CloudError, HttpClientError};
use crate::metrics::Metrics;

/// A Keystone token and the endpoints its catalog gave.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) token: String,
    /// When it is renewed, Unix seconds ([`token_renew_margin_secs`]
    /// before its expiry).
    renew_at: f64,
    /// The compute endpoint.
    pub(super) compute: String,
    /// The image endpoint, if the catalog has one.
    pub(super) image: Option<String>,
    /// The network (Neutron) endpoint, if the catalog has one.
    pub(super) network: Option<String>,
}

/// Less than this left on the application credential (seconds, a week)
/// is logged as a warning with each new token.
pub const CREDENTIAL_WARN_SECS: f64 = 7.0 * 86_400.0;

/// [`CloudApi`](super::CloudApi) over HTTP: Keystone v3, Nova v2.1, Glance v2.
pub struct HttpCloud {
    pub(super) client: reqwest::Client,
    pub(super) creds: Credentials,
    pub(super) microversion: Microversion,
    session: Mutex<Option<Session>>,
    /// Flavor ids by configured name ([`super::lookup`]).
    pub(super) flavors: Mutex<BTreeMap<String, String>>,
    /// Image ids by configured name ([`super::lookup`]).
    pub(super) images: Mutex<BTreeMap<String, String>>,
    /// Where requests are counted (`vq_cloud_requests_total`), if anywhere.
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for HttpCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpCloud")
            .field("creds", &self.creds)
            .field("microversion", &self.microversion)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct TokenBody {
    token: TokenInfo,
}

#[derive(Deserialize)]
struct TokenInfo {
    expires_at: String,
    #[serde(default)]
    issued_at: Option<String>,
    #[serde(default)]
    user: Option<IdOnly>,
    /// Present when the token was got with an application credential.
    #[serde(default)]
    application_credential: Option<IdOnly>,
    #[serde(default)]
    catalog: Vec<CatalogEntry>,
}

#[derive(Deserialize)]
struct IdOnly {
    id: String,
}

/// `GET …/application_credentials/{id}`: `{"application_credential":
/// {"expires_at": "2018-02-27T18:30:59.000000" | null, …}}`.
#[derive(Deserialize)]
struct AppCredBody {
    application_credential: AppCredInfo,
}

#[derive(Deserialize)]
struct AppCredInfo {
    #[serde(default)]
    expires_at: Option<String>,
}

#[derive(Deserialize)]
struct CatalogEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
struct Endpoint {
    interface: String,
    #[serde(default)]
    region: Option<String>,
    #[serde(default)]
    region_id: Option<String>,
    url: String,
}

fn pick_endpoint(
    catalog: &[CatalogEntry],
    service: &str,
    interface: &str,
    region: Option<&str>,
) -> Option<String> {
    catalog
        .iter()
        .filter(|c| c.kind == service)
        .flat_map(|c| c.endpoints.iter())
        .find(|e| {
            e.interface == interface
                && region.is_none_or(|r| {
                    e.region.as_deref() == Some(r) || e.region_id.as_deref() == Some(r)
                })
        })
        .map(|e| e.url.trim_end_matches('/').to_string())
}

fn fault_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let from_json = parsed.as_ref().and_then(|v| {
        let obj = v.as_object()?;
        obj.values()
            .find_map(|inner| inner.get("message").and_then(Value::as_str))
            .or_else(|| obj.get("message").and_then(Value::as_str))
            .map(str::to_string)
    });
    let msg = from_json.unwrap_or_else(|| body.split_whitespace().collect::<Vec<_>>().join(" "));
    let mut msg: String = msg.chars().take(300).collect();
    if msg.is_empty() {
        msg.push_str("(empty body)");
    }
    msg
}

/// The [`CloudError::Status`] of `op`'s error response `resp`: its status,
/// fault message and `Retry-After`.
pub(super) async fn status_error(op: String, resp: Response) -> CloudError {
    let status = resp.status().as_u16();
    let retry_after = retry_after(&resp);
    let body = resp.text().await.unwrap_or_default();
    CloudError::Status {
        op,
        status,
        message: fault_message(&body),
        retry_after,
    }
}

fn retry_after(resp: &Response) -> Option<Duration> {
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}
impl HttpCloud {
    /// A client for `creds`, requesting compute microversion `microversion`
    /// (`None`: [`DEFAULT_COMPUTE_MICROVERSION`]). Does no I/O on the
    /// network; the first call authenticates.
    /// [`HttpCloud::check_compute_version`] tells whether the cloud serves
    /// that microversion. TLS follows `creds.tls`: `cacert`'s certificates
    /// as the only roots (else the system's), the client identity of
    /// `cert`/`key`, and with `verify: false` no certificate check at all,
    /// logged here as a warning.
    ///
    /// # Errors
    /// [`HttpClientError::TlsFiles`] naming every unusable TLS file;
    /// [`HttpClientError::Build`] if reqwest refuses the client (no rustls
    /// provider installed).
    pub fn new(
        creds: Credentials,
        microversion: Option<Microversion>,
    ) -> Result<Self, HttpClientError> {
        let tls = creds
            .tls
            .load()
            .map_err(|problems| HttpClientError::TlsFiles { problems })?;
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            // The pid tells the cloud's API log which of several
            // controllers (one leader, standbys) sent a request.
            .user_agent(format!(
                "vq-controller/{} (pid {})",
                env!("CARGO_PKG_VERSION"),
                std::process::id()
            ));
        if !tls.roots.is_empty() {
            builder = builder.tls_certs_only(tls.roots);
        }
        if let Some(identity) = tls.identity {
            builder = builder.identity(identity);
        }
        if tls.insecure {
            let key = creds
                .tls
                .insecure
                .as_ref()
                .map(|s| s.key.as_str())
                .unwrap_or_default();
            tracing::warn!(
                key,
                auth_url = %creds.auth_url,
                "TLS CERTIFICATE VERIFICATION OF THE CLOUD IS OFF: any server can pose as Keystone and Nova and receive the cloud password or token; set cacert to the cloud's CA instead of verify: false"
            );
            builder = builder.danger_accept_invalid_certs(true);
        }
        let client = builder.build().map_err(HttpClientError::Build)?;
        Ok(HttpCloud {
            client,
            creds,
            microversion: microversion.unwrap_or(DEFAULT_COMPUTE_MICROVERSION),
            session: Mutex::new(None),
            flavors: Mutex::new(BTreeMap::new()),
            images: Mutex::new(BTreeMap::new()),
            metrics: None,
        })
    }

    /// Counts every request in `metrics` (`vq_cloud_requests_total{op,status}`).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Counts request `op` answered `status` (`None`: no response).
    pub(super) fn count(&self, op: &str, status: Option<u16>) {
        if let Some(m) = &self.metrics {
            m.cloud_request(op, status);
        }
    }

    /// The credentials in use.
    pub fn credentials(&self) -> &Credentials {
        &self.creds
    }

    /// The compute microversion this client requests.
    pub fn microversion(&self) -> Microversion {
        self.microversion
    }
    async fn authenticate(&self) -> Result<Session, CloudError> {
        let url = self.creds.token_url();
        let op = format!("POST {url}");
        let resp = self
            .client
            .post(&url)
            .json(&self.creds.token_request())
            .send()
            .await
            .map_err(|source| {
                self.count(&op, None);
                CloudError::Transport {
                    op: op.clone(),
                    source,
                }
            })?;
        let status = resp.status();
        self.count(&op, Some(status.as_u16()));
        if !status.is_success() {
            return Err(status_error(op, resp).await);
        }
        let token = resp
            .headers()
            .get("x-subject-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| CloudError::Decode {
                op: op.clone(),
                detail: "no X-Subject-Token header".into(),
            })?;
        let body: TokenBody = resp.json().await.map_err(|e| CloudError::Decode {
            op: op.clone(),
            detail: e.to_string(),
        })?;
        let expires_at =
            parse_timestamp(&body.token.expires_at).ok_or_else(|| CloudError::Decode {
                op: op.clone(),
                detail: format!("bad expires_at {:?}", body.token.expires_at),
            })?;
        let issued_at = body
            .token
            .issued_at
            .as_deref()
            .and_then(parse_timestamp)
            .unwrap_or_else(unix_now);
        let renew_at = expires_at - token_renew_margin_secs(expires_at - issued_at);
        let region = self.creds.region.as_deref();
        let iface = &self.creds.interface;
        let compute =
            pick_endpoint(&body.token.catalog, "compute", iface, region).ok_or_else(|| {
                CloudError::NoEndpoint {
                    service: "compute".into(),
                    interface: iface.clone(),
                    region: self.creds.region.clone(),
                }
            })?;
        let image = pick_endpoint(&body.token.catalog, "image", iface, region);
        let network = pick_endpoint(&body.token.catalog, "network", iface, region);
        tracing::info!(
            origin = %self.creds.origin,
            compute = %compute,
            image = image.as_deref().unwrap_or("-"),
            expires_in_secs = (expires_at - unix_now()) as i64,
            "authenticated to Keystone"
        );
        if let Some(m) = &self.metrics {
            m.cloud_token_expiry.set(expires_at);
        }
        if let (Some(user), Some(cred)) = (&body.token.user, &body.token.application_credential) {
            self.note_credential_expiry(&token, &user.id, &cred.id)
                .await;
        }
        Ok(Session {
            token,
            renew_at,
            compute,
            image,
            network,
        })
    }

    /// Reads the expiry of the application credential `id` of `user_id`
    /// (with each new token, so a credential replaced under the same id is
    /// seen) into `vq_cloud_credential_expiry_timestamp_seconds`, and warns
    /// when less than a week is left. Best effort: a failure is logged and
    /// the gauge keeps its last value; a credential that never expires
    /// removes it.
    async fn note_credential_expiry(&self, token: &str, user_id: &str, id: &str) {
        let url = self.creds.application_credential_url(user_id, id);
        let op = "GET /v3/users/{user_id}/application_credentials/{id}";
        let resp = self
            .client
            .get(&url)
            .header("X-Auth-Token", token)
            .send()
            .await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                self.count(op, None);
                tracing::warn!(url = %url, error = %e, "cannot read the application credential's expiry");
                return;
            }
        };
        self.count(op, Some(resp.status().as_u16()));
        if !resp.status().is_success() {
            tracing::warn!(url = %url, status = resp.status().as_u16(), "cannot read the application credential's expiry");
            return;
        }
        let expires_at = match resp.json::<AppCredBody>().await {
            Ok(b) => b.application_credential.expires_at,
            Err(e) => {
                tracing::warn!(url = %url, error = %e, "cannot decode the application credential");
                return;
            }
        };
        let at = expires_at.as_deref().and_then(parse_timestamp);
        if let Some(m) = &self.metrics {
            m.set_credential_expiry(at);
        }
        match at {
            Some(at) if at - unix_now() < CREDENTIAL_WARN_SECS => {
                tracing::warn!(application_credential = %id, expires_in_secs = (at - unix_now()) as i64, "the application credential expires soon: create a new one and update clouds.yaml")
            }
            Some(at) => {
                tracing::info!(application_credential = %id, expires_in_secs = (at - unix_now()) as i64, "application credential expiry read")
            }
            None => {
                tracing::info!(application_credential = %id, "the application credential does not expire")
            }
        }
    }

    pub(super) async fn session(&self, force: bool) -> Result<Session, CloudError> {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_ref() {
            if !force && unix_now() < s.renew_at {
                return Ok(s.clone());
            }
        }
        let s = self.authenticate().await?;
        *guard = Some(s.clone());
        Ok(s)
    }

    /// Sends a request built by `build` from the session; renews the token
    /// and retries once on 401. Returns the response if its status is a
    /// success or is in `ok_also`.
    pub(super) async fn send(
        &self,
        op: &str,
        ok_also: &[StatusCode],
        build: impl Fn(&Session) -> RequestBuilder,
    ) -> Result<Response, CloudError> {
        let mut renewed = false;
        loop {
            let session = self.session(renewed).await?;
            let resp = build(&session)
                .header("X-Auth-Token", &session.token)
                .header(
                    "OpenStack-API-Version",
                    format!("compute {}", self.microversion),
                )
                .header(
                    "X-OpenStack-Nova-API-Version",
                    self.microversion.to_string(),
                )
                .header("Accept", "application/json")
                .send()
                .await
                .map_err(|source| {
                    self.count(op, None);
                    CloudError::Transport {
                        op: op.into(),
                        source,
                    }
                })?;
            let status = resp.status();
            self.count(op, Some(status.as_u16()));
            if status.is_success() || ok_also.contains(&status) {
                return Ok(resp);
            }
            if status == StatusCode::UNAUTHORIZED && !renewed {
                tracing::info!(op, "token refused (401); renewing it and retrying once");
                renewed = true;
                continue;
            }
            let err = status_error(op.into(), resp).await;
            if status == StatusCode::NOT_ACCEPTABLE {
                // Microversion not acceptable: the cloud may have been
                // downgraded (or was unreadable at start). Its version
                // document says which versions it serves.
                match self.check_compute_version().await {
                    Err(e @ CloudError::Microversion { .. }) => return Err(e),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(op, error = %e, "answered 406 and the compute version document cannot be read")
                    }
                }
            }
            return Err(err);
        }
    }

    pub(super) async fn json<T: serde::de::DeserializeOwned>(
        op: &str,
        resp: Response,
    ) -> Result<T, CloudError> {
        let bytes = resp.bytes().await.map_err(|source| CloudError::Transport {
            op: op.into(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|e| CloudError::Decode {
            op: op.into(),
            detail: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn catalog_endpoints_are_chosen_by_interface_and_region() {
        let catalog: Vec<CatalogEntry> = serde_json::from_value(json!([
            {"type": "compute", "endpoints": [
                {"interface": "internal", "region": "R1", "url": "http://int/"},
                {"interface": "public", "region": "R2", "url": "http://r2"},
                {"interface": "public", "region": "R1", "url": "http://r1/v2.1/"}
            ]}
        ]))
        .unwrap();
        assert_eq!(
            pick_endpoint(&catalog, "compute", "public", Some("R1")).as_deref(),
            Some("http://r1/v2.1")
        );
        assert_eq!(
            pick_endpoint(&catalog, "compute", "internal", None).as_deref(),
            Some("http://int")
        );
        assert_eq!(pick_endpoint(&catalog, "image", "public", None), None);
    }

    #[test]
    fn nova_fault_messages_are_extracted() {
        assert_eq!(
            fault_message(
                r#"{"itemNotFound": {"message": "Flavor x could not be found.", "code": 404}}"#
            ),
            "Flavor x could not be found."
        );
        assert_eq!(
            fault_message("<html> Bad\n gateway </html>"),
            "<html> Bad gateway </html>"
        );
    }
}
