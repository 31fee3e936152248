//! OpenStack client: credentials the way every OpenStack tool takes them
//! (`clouds.yaml`, `OS_*` variables; password and application credentials),
//! Keystone v3 tokens with the service catalog, and the few Nova and Glance
//! calls the controller needs, behind the [`CloudApi`] trait so that tests
//! use a fake.
//!
//! The HTTP client is reqwest with rustls; the process must install a rustls
//! crypto provider (ring) before [`HttpCloud::new`].

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;
use vq_common::config::{Microversion, OpenStackSection, MIN_COMPUTE_MICROVERSION};
use vq_common::messages::unix_now;

use crate::error::{CloudError, CredentialsError};

/// Compute microversion requested when the config names none: 2.52 is the
/// first with server tags at create time (and 2.37+ requires `networks`).
pub const DEFAULT_COMPUTE_MICROVERSION: Microversion = MIN_COMPUTE_MICROVERSION;

/// A token is renewed when it has less than this left, seconds.
pub const TOKEN_RENEW_MARGIN_SECS: f64 = 300.0;

/// Servers asked for per page when listing.
pub const LIST_PAGE_SIZE: u32 = 200;

/// Pages followed at most when listing (a loop guard: 200 000 servers).
pub const MAX_PAGES: usize = 1000;

/// Metadata key holding the cluster name.
pub const META_CLUSTER: &str = "vq-cluster";
/// Metadata key holding the pool name.
pub const META_POOL: &str = "vq-pool";
/// Metadata key holding the agent id.
pub const META_AGENT: &str = "vq-agent";

/// The Nova tag every server of `cluster` carries.
pub fn cluster_tag(cluster: &str) -> String {
    format!("vq-cluster-{cluster}")
}

// ---------------------------------------------------------------- credentials

/// How to authenticate to Keystone v3.
#[derive(Clone, PartialEq, Eq)]
pub enum AuthMethod {
    /// User name (or id) and password, scoped to a project.
    Password {
        /// User name (with a user domain) …
        username: Option<String>,
        /// … or user id.
        user_id: Option<String>,
        /// Password.
        password: String,
        /// Domain of the user, by name.
        user_domain_name: Option<String>,
        /// Domain of the user, by id.
        user_domain_id: Option<String>,
        /// Project name (with a project domain) …
        project_name: Option<String>,
        /// … or project id.
        project_id: Option<String>,
        /// Domain of the project, by name.
        project_domain_name: Option<String>,
        /// Domain of the project, by id.
        project_domain_id: Option<String>,
    },
    /// An application credential (already scoped to its project).
    ApplicationCredential {
        /// Credential id …
        id: Option<String>,
        /// … or name (with the user name and domain).
        name: Option<String>,
        /// Secret.
        secret: String,
        /// Owner's user name, for a credential given by name.
        username: Option<String>,
        /// Owner's user domain name.
        user_domain_name: Option<String>,
    },
}

impl std::fmt::Debug for AuthMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets.
        match self {
            AuthMethod::Password {
                username,
                user_id,
                project_name,
                project_id,
                ..
            } => f
                .debug_struct("Password")
                .field("username", username)
                .field("user_id", user_id)
                .field("project_name", project_name)
                .field("project_id", project_id)
                .finish_non_exhaustive(),
            AuthMethod::ApplicationCredential { id, name, .. } => f
                .debug_struct("ApplicationCredential")
                .field("id", id)
                .field("name", name)
                .finish_non_exhaustive(),
        }
    }
}

/// Everything needed to talk to one cloud.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Keystone URL; `/v3` is appended when missing.
    pub auth_url: String,
    /// How to authenticate.
    pub method: AuthMethod,
    /// Region of the endpoints to use, if the catalog has several.
    pub region: Option<String>,
    /// Endpoint interface: `public` (default), `internal` or `admin`.
    pub interface: String,
    /// Where these came from, for logs (`clouds.yaml /x cloud y`, `OS_*`).
    pub origin: String,
}

#[derive(Debug, Default, Deserialize)]
struct CloudsFile {
    #[serde(default)]
    clouds: BTreeMap<String, CloudEntry>,
}

#[derive(Debug, Default, Deserialize)]
struct CloudEntry {
    #[serde(default)]
    auth: BTreeMap<String, serde_yaml_ng::Value>,
    auth_type: Option<String>,
    region_name: Option<String>,
    interface: Option<String>,
    endpoint_type: Option<String>,
}

fn yaml_str(v: &serde_yaml_ng::Value) -> Option<String> {
    match v {
        serde_yaml_ng::Value::String(s) => Some(s.clone()),
        serde_yaml_ng::Value::Number(n) => Some(n.to_string()),
        serde_yaml_ng::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The clouds.yaml files searched, in order: `OS_CLIENT_CONFIG_FILE`, the
/// config's `clouds_yaml`, `./clouds.yaml`,
/// `~/.config/openstack/clouds.yaml`, `/etc/openstack/clouds.yaml`.
pub fn clouds_yaml_candidates(
    section: &OpenStackSection,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = env("OS_CLIENT_CONFIG_FILE").filter(|s| !s.is_empty()) {
        out.push(PathBuf::from(p));
    }
    if let Some(p) = &section.clouds_yaml {
        out.push(p.clone());
    }
    out.push(PathBuf::from("clouds.yaml"));
    if let Some(home) = env("HOME").filter(|s| !s.is_empty()) {
        out.push(Path::new(&home).join(".config/openstack/clouds.yaml"));
    }
    out.push(PathBuf::from("/etc/openstack/clouds.yaml"));
    out
}

fn read_yaml(path: &Path) -> Result<serde_yaml_ng::Value, CredentialsError> {
    let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
        path: path.display().to_string(),
        source,
    })?;
    serde_yaml_ng::from_str(&text).map_err(|source| CredentialsError::Parse {
        path: path.display().to_string(),
        source,
    })
}

fn merge_yaml(base: &mut serde_yaml_ng::Value, over: serde_yaml_ng::Value) {
    match (base, over) {
        (serde_yaml_ng::Value::Mapping(b), serde_yaml_ng::Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge_yaml(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

impl Credentials {
    /// Finds credentials: with a cloud name (config `cloud`, else
    /// `OS_CLOUD`) the first clouds.yaml of [`clouds_yaml_candidates`] that
    /// defines it (merged with a `secure.yaml` next to it, if present);
    /// without one, the `OS_*` variables. `env` reads a variable (tests pass
    /// a map).
    ///
    /// # Errors
    /// [`CredentialsError`] for unreadable files, an unknown cloud, missing
    /// values or an unsupported auth type.
    pub fn discover(
        section: &OpenStackSection,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Credentials, CredentialsError> {
        let cloud = section
            .cloud
            .clone()
            .or_else(|| env("OS_CLOUD"))
            .filter(|s| !s.is_empty());
        let Some(cloud) = cloud else {
            return Self::from_env(env);
        };
        let candidates = clouds_yaml_candidates(section, env);
        for path in &candidates {
            if !path.is_file() {
                continue;
            }
            let mut doc = read_yaml(path)?;
            let secure = path.with_file_name("secure.yaml");
            if secure.is_file() {
                merge_yaml(&mut doc, read_yaml(&secure)?);
            }
            let file: CloudsFile =
                serde_yaml_ng::from_value(doc).map_err(|source| CredentialsError::Parse {
                    path: path.display().to_string(),
                    source,
                })?;
            if let Some(entry) = file.clouds.get(&cloud) {
                let origin = format!("clouds.yaml {} cloud {cloud}", path.display());
                return Self::from_entry(entry, origin);
            }
        }
        Err(CredentialsError::UnknownCloud {
            cloud,
            searched: candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    fn from_entry(entry: &CloudEntry, origin: String) -> Result<Credentials, CredentialsError> {
        let get = |k: &str| {
            entry
                .auth
                .get(k)
                .and_then(yaml_str)
                .filter(|s| !s.is_empty())
        };
        let auth_type = entry.auth_type.clone().unwrap_or_else(|| {
            if get("application_credential_secret").is_some() {
                "v3applicationcredential".into()
            } else {
                "password".into()
            }
        });
        Self::build(
            &auth_type,
            &get,
            entry.region_name.clone(),
            entry
                .interface
                .clone()
                .or_else(|| entry.endpoint_type.clone()),
            origin,
        )
    }

    fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Credentials, CredentialsError> {
        let get =
            |k: &str| env(&format!("OS_{}", k.to_ascii_uppercase())).filter(|s| !s.is_empty());
        let auth_type = get("auth_type").unwrap_or_else(|| {
            if get("application_credential_secret").is_some() {
                "v3applicationcredential".into()
            } else {
                "password".into()
            }
        });
        Self::build(
            &auth_type,
            &get,
            get("region_name"),
            get("interface").or_else(|| get("endpoint_type")),
            "OS_* environment".into(),
        )
    }

    fn build(
        auth_type: &str,
        get: &dyn Fn(&str) -> Option<String>,
        region: Option<String>,
        interface: Option<String>,
        origin: String,
    ) -> Result<Credentials, CredentialsError> {
        let mut missing = Vec::new();
        let auth_url = get("auth_url").unwrap_or_else(|| {
            missing.push("auth_url");
            String::new()
        });
        let method = match auth_type {
            "password" | "v3password" => {
                let password = get("password").unwrap_or_else(|| {
                    missing.push("password");
                    String::new()
                });
                let m = AuthMethod::Password {
                    username: get("username"),
                    user_id: get("user_id"),
                    password,
                    user_domain_name: get("user_domain_name").or_else(|| get("domain_name")),
                    user_domain_id: get("user_domain_id").or_else(|| get("domain_id")),
                    project_name: get("project_name").or_else(|| get("tenant_name")),
                    project_id: get("project_id").or_else(|| get("tenant_id")),
                    project_domain_name: get("project_domain_name").or_else(|| get("domain_name")),
                    project_domain_id: get("project_domain_id").or_else(|| get("domain_id")),
                };
                if let AuthMethod::Password {
                    username,
                    user_id,
                    project_name,
                    project_id,
                    ..
                } = &m
                {
                    if username.is_none() && user_id.is_none() {
                        missing.push("username or user_id");
                    }
                    if project_name.is_none() && project_id.is_none() {
                        missing.push("project_name or project_id");
                    }
                }
                m
            }
            "v3applicationcredential" | "applicationcredential" => {
                let secret = get("application_credential_secret").unwrap_or_else(|| {
                    missing.push("application_credential_secret");
                    String::new()
                });
                let id = get("application_credential_id");
                let name = get("application_credential_name");
                if id.is_none() && name.is_none() {
                    missing.push("application_credential_id or application_credential_name");
                }
                AuthMethod::ApplicationCredential {
                    id,
                    name,
                    secret,
                    username: get("username"),
                    user_domain_name: get("user_domain_name"),
                }
            }
            other => {
                return Err(CredentialsError::AuthType {
                    auth_type: other.into(),
                })
            }
        };
        if !missing.is_empty() {
            return Err(CredentialsError::Incomplete {
                origin,
                missing: missing.join(", "),
            });
        }
        Ok(Credentials {
            auth_url,
            method,
            region,
            interface: interface
                .map(|i| i.trim_end_matches("URL").to_ascii_lowercase())
                .unwrap_or_else(|| "public".into()),
            origin,
        })
    }

    /// The Keystone token URL (`…/v3/auth/tokens`).
    pub fn token_url(&self) -> String {
        let base = self.auth_url.trim_end_matches('/');
        if base.ends_with("/v3") {
            format!("{base}/auth/tokens")
        } else {
            format!("{base}/v3/auth/tokens")
        }
    }

    /// The JSON body of `POST /v3/auth/tokens`.
    pub fn token_request(&self) -> Value {
        fn domain(name: &Option<String>, id: &Option<String>) -> Value {
            match (id, name) {
                (Some(id), _) => json!({ "id": id }),
                (None, Some(name)) => json!({ "name": name }),
                (None, None) => json!({ "name": "Default" }),
            }
        }
        match &self.method {
            AuthMethod::Password {
                username,
                user_id,
                password,
                user_domain_name,
                user_domain_id,
                project_name,
                project_id,
                project_domain_name,
                project_domain_id,
            } => {
                let user = match (user_id, username) {
                    (Some(id), _) => json!({ "id": id, "password": password }),
                    (None, name) => json!({
                        "name": name,
                        "domain": domain(user_domain_name, user_domain_id),
                        "password": password,
                    }),
                };
                let project = match (project_id, project_name) {
                    (Some(id), _) => json!({ "id": id }),
                    (None, name) => json!({
                        "name": name,
                        "domain": domain(project_domain_name, project_domain_id),
                    }),
                };
                json!({ "auth": {
                    "identity": { "methods": ["password"], "password": { "user": user } },
                    "scope": { "project": project },
                }})
            }
            AuthMethod::ApplicationCredential {
                id,
                name,
                secret,
                username,
                user_domain_name,
            } => {
                let cred = match (id, name) {
                    (Some(id), _) => json!({ "id": id, "secret": secret }),
                    (None, name) => json!({
                        "name": name,
                        "secret": secret,
                        "user": {
                            "name": username,
                            "domain": domain(user_domain_name, &None),
                        },
                    }),
                };
                json!({ "auth": { "identity": {
                    "methods": ["application_credential"],
                    "application_credential": cred,
                }}})
            }
        }
    }
}

// ---------------------------------------------------------------- time

/// Parses an ISO 8601 / RFC 3339 timestamp as OpenStack writes them
/// (`2026-11-29T12:00:00Z`, `2026-11-29T12:00:00.000000Z`,
/// `2026-11-29T12:00:00+01:00`, or without a zone meaning UTC) into Unix
/// seconds.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut frac = 0.0;
    if let Some(r) = rest.strip_prefix('.') {
        let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
        frac = format!("0.{}", &r[..end]).parse().ok()?;
        rest = &r[end..];
    }
    let offset = match rest {
        "" | "Z" | "z" => 0,
        z if (z.starts_with('+') || z.starts_with('-')) && z.len() == 6 => {
            let sign = if z.starts_with('-') { -1 } else { 1 };
            let oh: i64 = z.get(1..3)?.parse().ok()?;
            let om: i64 = z.get(4..6)?.parse().ok()?;
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = if y2 >= 0 { y2 } else { y2 - 399 } / 400;
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + mi * 60 + se - offset) as f64 + frac)
}

// ---------------------------------------------------------------- API types

/// A server as listed by Nova.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// Server id.
    pub id: String,
    /// Server name.
    pub name: String,
    /// Nova status (`BUILD`, `ACTIVE`, `ERROR`, `SHUTOFF`, `DELETED`, …).
    pub status: String,
    /// Task state (`deleting`, `spawning`, …), when Nova shows it.
    pub task_state: Option<String>,
    /// Creation time, Unix seconds.
    pub created: Option<f64>,
    /// Server metadata.
    pub metadata: BTreeMap<String, String>,
    /// Server tags.
    pub tags: Vec<String>,
    /// Fault message of an ERROR server, if any.
    pub fault: Option<String>,
}

/// What to create.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateServer {
    /// Server name (= agent id).
    pub name: String,
    /// Flavor id.
    pub flavor_ref: String,
    /// Image id.
    pub image_ref: String,
    /// User-data, raw (base64-encoded on the wire).
    pub user_data: Vec<u8>,
    /// Metadata (cluster, pool, agent).
    pub metadata: BTreeMap<String, String>,
    /// Tags (the cluster tag).
    pub tags: Vec<String>,
    /// Network id; `None` boots without a network.
    pub network: Option<String>,
    /// Key pair.
    pub key_name: Option<String>,
    /// Security group names.
    pub security_groups: Vec<String>,
    /// Availability zone.
    pub availability_zone: Option<String>,
}

/// Instance quota of the project.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// `maxTotalInstances`; `None` when unlimited (-1).
    pub max_instances: Option<u32>,
    /// `totalInstancesUsed`.
    pub used_instances: u32,
}

impl Quota {
    /// Instances that may still be created; `None` when unlimited.
    pub fn remaining(&self) -> Option<u32> {
        self.max_instances
            .map(|m| m.saturating_sub(self.used_instances))
    }
}

/// The cloud operations the controller uses.
pub trait CloudApi: Send + Sync {
    /// Every server tagged `tag`, following pagination to the end: either
    /// the complete list or an error, never a partial view.
    fn list_servers(
        &self,
        tag: &str,
    ) -> impl Future<Output = Result<Vec<Server>, CloudError>> + Send;
    /// Creates a server; returns its id.
    fn create_server(
        &self,
        req: &CreateServer,
    ) -> impl Future<Output = Result<String, CloudError>> + Send;
    /// Deletes a server; a server that is already gone counts as deleted.
    fn delete_server(&self, id: &str) -> impl Future<Output = Result<(), CloudError>> + Send;
    /// Flavor id for a flavor name or id.
    fn resolve_flavor(&self, name: &str)
        -> impl Future<Output = Result<String, CloudError>> + Send;
    /// Image id for an image name or id.
    fn resolve_image(&self, name: &str) -> impl Future<Output = Result<String, CloudError>> + Send;
    /// The project's instance quota.
    fn quota(&self) -> impl Future<Output = Result<Quota, CloudError>> + Send;
}

/// Whether `s` looks like a UUID (then it is used as an id as it is).
pub fn looks_like_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                *c == b'-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

// ---------------------------------------------------------------- HTTP impl

#[derive(Debug, Clone)]
struct Session {
    token: String,
    expires_at: f64,
    compute: String,
    image: Option<String>,
}

/// [`CloudApi`] over HTTP: Keystone v3, Nova v2.1, Glance v2.
pub struct HttpCloud {
    client: reqwest::Client,
    creds: Credentials,
    microversion: Microversion,
    session: Mutex<Option<Session>>,
    flavors: Mutex<BTreeMap<String, String>>,
    images: Mutex<BTreeMap<String, String>>,
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
    catalog: Vec<CatalogEntry>,
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

fn microversion_at_least(mv: Microversion, major: u32, minor: u32) -> bool {
    mv >= Microversion { major, minor }
}

/// The microversion range of the compute API, from its version document
/// (`GET <compute endpoint>/`: `{"version": {"id": "v2.1", "version":
/// "2.95", "min_version": "2.1", …}}`, Nova's "Show Details of Specific API
/// Version").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeVersions {
    /// `min_version`.
    pub min: Microversion,
    /// `version`: the highest microversion the cloud serves.
    pub max: Microversion,
}

impl ComputeVersions {
    /// Whether `mv` is within the range.
    pub fn serves(&self, mv: Microversion) -> bool {
        self.min <= mv && mv <= self.max
    }

    /// Reads the range from a version document: `{"version": {…}}`, or
    /// `{"versions": […]}` (an unversioned root; the `v2.1` entry). An empty
    /// `version` (the legacy v2.0 API, no microversions) counts as 2.0.
    ///
    /// # Errors
    /// A description of what is missing or malformed.
    pub fn from_document(doc: &Value) -> Result<ComputeVersions, String> {
        let entry = match (doc.get("version"), doc.get("versions")) {
            (Some(v), _) => v,
            (None, Some(Value::Array(all))) => all
                .iter()
                .find(|v| v.get("id").and_then(Value::as_str) == Some("v2.1"))
                .ok_or("no v2.1 entry in versions")?,
            _ => return Err("neither version nor versions in the document".into()),
        };
        let field = |k: &str| -> Result<Microversion, String> {
            match entry.get(k).and_then(Value::as_str) {
                Some("") => Ok(Microversion { major: 2, minor: 0 }),
                Some(s) => {
                    Microversion::parse(s).ok_or_else(|| format!("{k} {s:?} is not a version"))
                }
                None => Err(format!("no {k} in the version document")),
            }
        };
        Ok(ComputeVersions {
            min: field("min_version")?,
            max: field("version")?,
        })
    }
}

/// The version root of a compute endpoint: the endpoint itself, or its
/// parent when the catalog URL ends in a project id after the version
/// (`…/v2.1/<project>`), with a trailing `/`.
fn version_root(compute: &str) -> String {
    let is_version = |seg: &str| {
        seg.strip_prefix('v')
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
    };
    let trimmed = compute.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((parent, last))
            if !is_version(last) && parent.rsplit('/').next().is_some_and(is_version) =>
        {
            format!("{parent}/")
        }
        _ => format!("{trimmed}/"),
    }
}

#[derive(Deserialize)]
struct ServerJson {
    id: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    status: String,
    #[serde(rename = "OS-EXT-STS:task_state", default)]
    task_state: Option<String>,
    #[serde(default)]
    created: Option<String>,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    fault: Option<Value>,
}

impl From<ServerJson> for Server {
    fn from(s: ServerJson) -> Self {
        Server {
            id: s.id,
            name: s.name,
            status: s.status,
            task_state: s.task_state,
            created: s.created.as_deref().and_then(parse_timestamp),
            metadata: s
                .metadata
                .into_iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (k, v)
                })
                .collect(),
            tags: s.tags.unwrap_or_default(),
            fault: s
                .fault
                .and_then(|f| f.get("message").and_then(Value::as_str).map(str::to_string)),
        }
    }
}

#[derive(Deserialize)]
struct ServersPage {
    servers: Vec<ServerJson>,
    #[serde(default)]
    servers_links: Vec<Link>,
}

#[derive(Deserialize)]
struct Link {
    rel: String,
    href: String,
}

impl HttpCloud {
    /// A client for `creds`, requesting compute microversion `microversion`
    /// (`None`: [`DEFAULT_COMPUTE_MICROVERSION`]). Does no I/O; the first
    /// call authenticates. [`HttpCloud::check_compute_version`] tells
    /// whether the cloud serves that microversion.
    ///
    /// # Errors
    /// The reqwest error if the HTTP client cannot be built (no rustls
    /// provider installed).
    pub fn new(
        creds: Credentials,
        microversion: Option<Microversion>,
    ) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .user_agent(concat!("vq-controller/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(HttpCloud {
            client,
            creds,
            microversion: microversion.unwrap_or(DEFAULT_COMPUTE_MICROVERSION),
            session: Mutex::new(None),
            flavors: Mutex::new(BTreeMap::new()),
            images: Mutex::new(BTreeMap::new()),
        })
    }

    /// The credentials in use.
    pub fn credentials(&self) -> &Credentials {
        &self.creds
    }

    /// The compute microversion this client requests.
    pub fn microversion(&self) -> Microversion {
        self.microversion
    }

    /// Reads the compute API's version document (`GET` on the compute
    /// endpoint's version root, sent without a microversion header, which
    /// an older API would refuse) and returns its microversion range.
    ///
    /// # Errors
    /// [`CloudError`] if it cannot be read or has no microversion range.
    pub async fn compute_versions(&self) -> Result<ComputeVersions, CloudError> {
        let mut renewed = false;
        loop {
            let session = self.session(renewed).await?;
            let url = version_root(&session.compute);
            let op = format!("GET {url}");
            let resp = self
                .client
                .get(&url)
                .header("X-Auth-Token", &session.token)
                .header("Accept", "application/json")
                .send()
                .await
                .map_err(|source| CloudError::Transport {
                    op: op.clone(),
                    source,
                })?;
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && !renewed {
                renewed = true;
                continue;
            }
            if !status.is_success() {
                let ra = retry_after(&resp);
                let body = resp.text().await.unwrap_or_default();
                return Err(CloudError::Status {
                    op,
                    status: status.as_u16(),
                    message: fault_message(&body),
                    retry_after: ra,
                });
            }
            let doc: Value = Self::json(&op, resp).await?;
            return ComputeVersions::from_document(&doc)
                .map_err(|detail| CloudError::Decode { op, detail });
        }
    }

    /// Reads the compute API's version document and checks that it serves
    /// the microversion this client requests.
    ///
    /// # Errors
    /// [`CloudError::Microversion`] (naming both versions) when it does
    /// not; any other [`CloudError`] when the document cannot be read.
    pub async fn check_compute_version(&self) -> Result<ComputeVersions, CloudError> {
        let v = self.compute_versions().await?;
        if v.serves(self.microversion) {
            Ok(v)
        } else {
            Err(CloudError::Microversion {
                wanted: self.microversion,
                needed: MIN_COMPUTE_MICROVERSION,
                min: v.min,
                max: v.max,
            })
        }
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
            .map_err(|source| CloudError::Transport {
                op: op.clone(),
                source,
            })?;
        let status = resp.status();
        if !status.is_success() {
            let ra = retry_after(&resp);
            let body = resp.text().await.unwrap_or_default();
            return Err(CloudError::Status {
                op,
                status: status.as_u16(),
                message: fault_message(&body),
                retry_after: ra,
            });
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
        tracing::info!(
            origin = %self.creds.origin,
            compute = %compute,
            image = image.as_deref().unwrap_or("-"),
            expires_in_secs = (expires_at - unix_now()) as i64,
            "authenticated to Keystone"
        );
        Ok(Session {
            token,
            expires_at,
            compute,
            image,
        })
    }

    async fn session(&self, force: bool) -> Result<Session, CloudError> {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_ref() {
            if !force && s.expires_at - unix_now() > TOKEN_RENEW_MARGIN_SECS {
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
    async fn send(
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
                .map_err(|source| CloudError::Transport {
                    op: op.into(),
                    source,
                })?;
            let status = resp.status();
            if status.is_success() || ok_also.contains(&status) {
                return Ok(resp);
            }
            if status == StatusCode::UNAUTHORIZED && !renewed {
                tracing::info!(op, "token refused (401); renewing it and retrying once");
                renewed = true;
                continue;
            }
            let ra = retry_after(&resp);
            let body = resp.text().await.unwrap_or_default();
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
            return Err(CloudError::Status {
                op: op.into(),
                status: status.as_u16(),
                message: fault_message(&body),
                retry_after: ra,
            });
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
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

impl CloudApi for HttpCloud {
    async fn list_servers(&self, tag: &str) -> Result<Vec<Server>, CloudError> {
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let op = "GET /servers/detail".to_string();
            let resp = match &next {
                None => {
                    self.send(&op, &[], |s| {
                        self.client
                            .request(Method::GET, format!("{}/servers/detail", s.compute))
                            .query(&[
                                ("tags", tag.to_string()),
                                ("limit", LIST_PAGE_SIZE.to_string()),
                            ])
                    })
                    .await?
                }
                Some(url) => {
                    self.send(&op, &[], |_| self.client.request(Method::GET, url.clone()))
                        .await?
                }
            };
            let page: ServersPage = Self::json(&op, resp).await?;
            let count = page.servers.len();
            out.extend(page.servers.into_iter().map(Server::from));
            next = page
                .servers_links
                .into_iter()
                .find(|l| l.rel == "next")
                .map(|l| l.href);
            if next.is_none() || count == 0 {
                return Ok(out);
            }
        }
        Err(CloudError::Decode {
            op: "GET /servers/detail".into(),
            detail: format!("more than {MAX_PAGES} pages; refusing a partial view"),
        })
    }

    async fn create_server(&self, req: &CreateServer) -> Result<String, CloudError> {
        let op = format!("POST /servers ({})", req.name);
        let mut server = json!({
            "name": req.name,
            "flavorRef": req.flavor_ref,
            "imageRef": req.image_ref,
            "user_data": base64::engine::general_purpose::STANDARD.encode(&req.user_data),
            "metadata": req.metadata,
            "min_count": 1,
            "max_count": 1,
        });
        let obj = server.as_object_mut().expect("json object");
        if !req.tags.is_empty() && microversion_at_least(self.microversion, 2, 52) {
            obj.insert("tags".into(), json!(req.tags));
        }
        match &req.network {
            Some(net) => {
                obj.insert("networks".into(), json!([{ "uuid": net }]));
            }
            None if microversion_at_least(self.microversion, 2, 37) => {
                obj.insert("networks".into(), json!("none"));
            }
            None => {}
        }
        if let Some(k) = &req.key_name {
            obj.insert("key_name".into(), json!(k));
        }
        if !req.security_groups.is_empty() {
            let sg: Vec<Value> = req
                .security_groups
                .iter()
                .map(|n| json!({ "name": n }))
                .collect();
            obj.insert("security_groups".into(), Value::Array(sg));
        }
        if let Some(az) = &req.availability_zone {
            obj.insert("availability_zone".into(), json!(az));
        }
        let body = json!({ "server": server });
        let resp = self
            .send(&op, &[], |s| {
                self.client
                    .request(Method::POST, format!("{}/servers", s.compute))
                    .json(&body)
            })
            .await?;
        let v: Value = Self::json(&op, resp).await?;
        v.pointer("/server/id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| CloudError::Decode {
                op,
                detail: "no server.id in the response".into(),
            })
    }

    async fn delete_server(&self, id: &str) -> Result<(), CloudError> {
        let op = format!("DELETE /servers/{id}");
        self.send(&op, &[StatusCode::NOT_FOUND], |s| {
            self.client
                .request(Method::DELETE, format!("{}/servers/{id}", s.compute))
        })
        .await?;
        Ok(())
    }

    async fn resolve_flavor(&self, name: &str) -> Result<String, CloudError> {
        if let Some(id) = self.flavors.lock().await.get(name) {
            return Ok(id.clone());
        }
        let op = "GET /flavors/detail".to_string();
        let resp = self
            .send(&op, &[], |s| {
                self.client
                    .request(Method::GET, format!("{}/flavors/detail", s.compute))
                    .query(&[("is_public", "None")])
            })
            .await?;
        let v: Value = Self::json(&op, resp).await?;
        let flavors =
            v.get("flavors")
                .and_then(Value::as_array)
                .ok_or_else(|| CloudError::Decode {
                    op: op.clone(),
                    detail: "no flavors array".into(),
                })?;
        let field = |f: &Value, k: &str| f.get(k).and_then(Value::as_str).map(str::to_string);
        let by_id = flavors.iter().find_map(|f| {
            (field(f, "id").as_deref() == Some(name))
                .then(|| field(f, "id"))
                .flatten()
        });
        let found = match by_id {
            Some(id) => id,
            None => {
                let matches: Vec<String> = flavors
                    .iter()
                    .filter(|f| field(f, "name").as_deref() == Some(name))
                    .filter_map(|f| field(f, "id"))
                    .collect();
                match matches.as_slice() {
                    [one] => one.clone(),
                    [] => {
                        return Err(CloudError::Resolve {
                            kind: "flavor",
                            name: name.into(),
                            detail: "no flavor has this name or id".into(),
                        })
                    }
                    _ => {
                        return Err(CloudError::Resolve {
                            kind: "flavor",
                            name: name.into(),
                            detail: format!("{} flavors have this name", matches.len()),
                        })
                    }
                }
            }
        };
        self.flavors.lock().await.insert(name.into(), found.clone());
        Ok(found)
    }

    async fn resolve_image(&self, name: &str) -> Result<String, CloudError> {
        if looks_like_uuid(name) {
            return Ok(name.to_string());
        }
        if let Some(id) = self.images.lock().await.get(name) {
            return Ok(id.clone());
        }
        let op = format!("GET /v2/images?name={name}");
        let session = self.session(false).await?;
        let Some(image_base) = session.image.clone() else {
            return Err(CloudError::NoEndpoint {
                service: "image".into(),
                interface: self.creds.interface.clone(),
                region: self.creds.region.clone(),
            });
        };
        let url = if image_base.ends_with("/v2") {
            format!("{image_base}/images")
        } else {
            format!("{image_base}/v2/images")
        };
        let resp = self
            .send(&op, &[], |_| {
                self.client
                    .request(Method::GET, &url)
                    .query(&[("name", name), ("status", "active")])
            })
            .await?;
        let v: Value = Self::json(&op, resp).await?;
        let ids: Vec<String> = v
            .get("images")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|i| i.get("id").and_then(Value::as_str).map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        match ids.as_slice() {
            [one] => {
                self.images.lock().await.insert(name.into(), one.clone());
                Ok(one.clone())
            }
            [] => Err(CloudError::Resolve {
                kind: "image",
                name: name.into(),
                detail: "no active image has this name".into(),
            }),
            _ => Err(CloudError::Resolve {
                kind: "image",
                name: name.into(),
                detail: format!("{} active images have this name; use its id", ids.len()),
            }),
        }
    }

    async fn quota(&self) -> Result<Quota, CloudError> {
        let op = "GET /limits".to_string();
        let resp = self
            .send(&op, &[], |s| {
                self.client
                    .request(Method::GET, format!("{}/limits", s.compute))
            })
            .await?;
        let v: Value = Self::json(&op, resp).await?;
        let abs = v
            .pointer("/limits/absolute")
            .ok_or_else(|| CloudError::Decode {
                op: op.clone(),
                detail: "no limits.absolute".into(),
            })?;
        let max = abs.get("maxTotalInstances").and_then(Value::as_i64);
        let used = abs
            .get("totalInstancesUsed")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        Ok(Quota {
            max_instances: match max {
                Some(m) if m >= 0 => Some(m.min(u32::MAX as i64) as u32),
                _ => None,
            },
            used_instances: used.clamp(0, u32::MAX as i64) as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn timestamps_parse_in_the_forms_openstack_writes() {
        assert_eq!(parse_timestamp("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(parse_timestamp("2000-03-01T00:00:00Z"), Some(951_868_800.0));
        assert_eq!(
            parse_timestamp("2026-11-29T12:00:00.500000Z"),
            Some(1_795_953_600.5)
        );
        assert_eq!(
            parse_timestamp("2026-11-29T13:00:00+01:00"),
            parse_timestamp("2026-11-29T12:00:00")
        );
        assert_eq!(parse_timestamp("yesterday"), None);
        assert_eq!(parse_timestamp("2026-13-01T00:00:00Z"), None);
    }

    #[test]
    fn os_variables_give_password_credentials() {
        let env = env_of(&[
            ("OS_AUTH_URL", "http://k:5000"),
            ("OS_USERNAME", "u"),
            ("OS_PASSWORD", "p"),
            ("OS_PROJECT_NAME", "proj"),
            ("OS_USER_DOMAIN_NAME", "Default"),
            ("OS_REGION_NAME", "R1"),
        ]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        assert_eq!(c.token_url(), "http://k:5000/v3/auth/tokens");
        assert_eq!(c.region.as_deref(), Some("R1"));
        assert_eq!(c.interface, "public");
        let body = c.token_request();
        assert_eq!(
            body.pointer("/auth/identity/password/user/name"),
            Some(&json!("u"))
        );
        assert_eq!(
            body.pointer("/auth/scope/project/name"),
            Some(&json!("proj"))
        );
        assert_eq!(
            body.pointer("/auth/scope/project/domain/name"),
            Some(&json!("Default"))
        );
        assert!(
            !format!("{c:?}").contains("\"p\""),
            "password must not be printed"
        );
    }

    #[test]
    fn missing_values_are_all_named() {
        let env = env_of(&[("OS_USERNAME", "u")]);
        let err = Credentials::discover(&OpenStackSection::default(), &env).unwrap_err();
        let msg = err.to_string();
        for k in ["auth_url", "password", "project_name"] {
            assert!(msg.contains(k), "{k} not in {msg}");
        }
    }

    #[test]
    fn application_credentials_from_the_environment_are_unscoped() {
        let env = env_of(&[
            ("OS_AUTH_URL", "https://k/v3/"),
            ("OS_AUTH_TYPE", "v3applicationcredential"),
            ("OS_APPLICATION_CREDENTIAL_ID", "abc"),
            ("OS_APPLICATION_CREDENTIAL_SECRET", "s"),
        ]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        assert_eq!(c.token_url(), "https://k/v3/auth/tokens");
        let body = c.token_request();
        assert_eq!(
            body.pointer("/auth/identity/methods/0"),
            Some(&json!("application_credential"))
        );
        assert_eq!(
            body.pointer("/auth/identity/application_credential/id"),
            Some(&json!("abc"))
        );
        assert!(body.pointer("/auth/scope").is_none());
    }

    #[test]
    fn clouds_yaml_is_found_by_name_and_merged_with_secure_yaml() {
        let dir = std::env::temp_dir().join(format!("vq-clouds-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("clouds.yaml"),
            "clouds:\n  c1:\n    auth:\n      auth_url: http://k/v3\n      username: u\n      project_id: pid\n    region_name: R\n    interface: internal\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("secure.yaml"),
            "clouds:\n  c1:\n    auth:\n      password: sec\n",
        )
        .unwrap();
        let path = dir.join("clouds.yaml").display().to_string();
        let env = env_of(&[("OS_CLIENT_CONFIG_FILE", &path), ("OS_CLOUD", "c1")]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        assert_eq!(c.interface, "internal");
        assert_eq!(c.region.as_deref(), Some("R"));
        assert_eq!(
            c.token_request()
                .pointer("/auth/identity/password/user/password"),
            Some(&json!("sec"))
        );
        assert_eq!(
            c.token_request().pointer("/auth/scope/project/id"),
            Some(&json!("pid"))
        );
        let env = env_of(&[("OS_CLIENT_CONFIG_FILE", &path), ("OS_CLOUD", "nope")]);
        assert!(matches!(
            Credentials::discover(&OpenStackSection::default(), &env),
            Err(CredentialsError::UnknownCloud { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_know_whether_they_are_transient() {
        let st = |status| CloudError::Status {
            op: "x".into(),
            status,
            message: String::new(),
            retry_after: None,
        };
        for s in [401, 409, 413, 429, 500, 503] {
            assert!(st(s).is_transient(), "{s}");
        }
        for s in [400, 403, 404] {
            assert!(!st(s).is_transient(), "{s}");
        }
    }

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
    fn version_documents_give_the_microversion_range() {
        let mv = |s| Microversion::parse(s).unwrap();
        let one = json!({"version": {"id": "v2.1", "status": "CURRENT", "version": "2.95", "min_version": "2.1"}});
        let v = ComputeVersions::from_document(&one).unwrap();
        assert_eq!((v.min, v.max), (mv("2.1"), mv("2.95")));
        assert!(v.serves(mv("2.52")) && !v.serves(mv("2.96")));
        let all = json!({"versions": [
            {"id": "v2.0", "version": "", "min_version": ""},
            {"id": "v2.1", "version": "2.40", "min_version": "2.1"}
        ]});
        let v = ComputeVersions::from_document(&all).unwrap();
        assert!(!v.serves(DEFAULT_COMPUTE_MICROVERSION));
        assert_eq!(v.max, mv("2.40"));
        assert!(ComputeVersions::from_document(&json!({"version": {"id": "v2.1"}})).is_err());
        assert_eq!(
            version_root("http://n/compute/v2.1"),
            "http://n/compute/v2.1/"
        );
        assert_eq!(
            version_root("http://n:8774/v2.1/abc123"),
            "http://n:8774/v2.1/"
        );
        assert_eq!(version_root("http://n:8774/"), "http://n:8774/");
        let e = CloudError::Microversion {
            wanted: mv("2.52"),
            needed: MIN_COMPUTE_MICROVERSION,
            min: mv("2.1"),
            max: mv("2.40"),
        };
        assert!(!e.is_transient());
        let msg = e.to_string();
        assert!(msg.contains("2.40") && msg.contains("2.52"), "{msg}");
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
        assert!(looks_like_uuid("6f2b9b4e-0c0a-4c55-9d51-0fa6e0c1e001"));
        assert!(!looks_like_uuid("cirros-fake"));
    }
}
