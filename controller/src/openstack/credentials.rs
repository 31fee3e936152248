//! OpenStack credentials the way every OpenStack tool takes them:
//! `clouds.yaml` (with `secure.yaml`) by cloud name or the `OS_*`
//! variables; password or application credential; and the Keystone v3
//! token request they make.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};
use vq_common::config::OpenStackSection;

use crate::error::CredentialsError;

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
    /// TLS to the cloud's endpoints (`cacert`, `verify`, `cert`, `key`).
    pub tls: CloudTls,
}

/// One TLS setting and the key it was read from, so that a problem names
/// it: `clouds.yaml /etc/openstack/clouds.yaml: clouds.prod.cacert` or
/// `OS_CACERT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// Where it was read from.
    pub key: String,
}

/// TLS to the cloud, with openstacksdk's semantics (its `cacert`,
/// `verify`, `cert` and `key` cloud settings; `OS_CACERT`, `OS_INSECURE`,
/// `OS_CERT`, `OS_KEY`, which, as for the `openstack` CLI, also override a
/// clouds.yaml cloud's values).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CloudTls {
    /// `cacert`: a PEM CA bundle. When set its certificates are the only
    /// trust anchors (requests' `verify=<path>`); unset, the system roots.
    pub cacert: Option<Setting<PathBuf>>,
    /// `verify: false` / `OS_INSECURE=true`: accept any server
    /// certificate (logged as a warning at start and shown on `/status`
    /// as `cloud_tls_insecure`). `None`: verify.
    pub insecure: Option<Setting<bool>>,
    /// `cert`: PEM client certificate (chain), for clouds that require one.
    pub cert: Option<Setting<PathBuf>>,
    /// `key`: the PEM private key of `cert`; unset, `cert`'s file holds it
    /// too (as requests' `cert=<path>`).
    pub key: Option<Setting<PathBuf>>,
}

/// The parsed TLS material of a [`CloudTls`], ready for the HTTP client.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    /// The only trust anchors (from `cacert`), or empty for the system
    /// roots.
    pub roots: Vec<reqwest::Certificate>,
    /// The client certificate and key, if configured.
    pub identity: Option<reqwest::Identity>,
    /// Whether server certificates are not verified (`verify: false`).
    pub insecure: bool,
}

impl CloudTls {
    /// Whether server certificates are not verified.
    pub fn is_insecure(&self) -> bool {
        self.insecure.as_ref().is_some_and(|s| s.value)
    }

    /// Reads and parses the files: `cacert` must hold at least one PEM
    /// certificate usable as a CA; `cert` and `key` a certificate rustls
    /// accepts and the private key belonging to it.
    ///
    /// # Errors
    /// Every problem, each `"<key>: <path> <problem>"` (e.g.
    /// `OS_CACERT: /x.pem cannot be read: No such file or directory`).
    pub fn load(&self) -> Result<TlsMaterial, Vec<String>> {
        let mut problems = Vec::new();
        let mut roots = Vec::new();
        if let Some(ca) = &self.cacert {
            match vq_common::tls::load_ca(&ca.value) {
                Ok(certs) => {
                    for der in certs {
                        match reqwest::Certificate::from_der(&der) {
                            Ok(c) => roots.push(c),
                            Err(e) => problems.push(format!(
                                "{}: {} holds a certificate that cannot be used: {e}",
                                ca.key,
                                ca.value.display()
                            )),
                        }
                    }
                }
                Err(e) => problems.push(format!("{}: {} {}", ca.key, e.path.display(), e.problem)),
            }
        }
        let mut identity = None;
        match (&self.cert, &self.key) {
            (None, Some(key)) => problems.push(format!(
                "{}: set without a client certificate (set cert too, or remove key)",
                key.key
            )),
            (None, None) => {}
            (Some(cert), key) => {
                let key_path = key.as_ref().map_or(&cert.value, |k| &k.value);
                let key_name = key.as_ref().map_or(&cert.key, |k| &k.key);
                match vq_common::tls::load_identity(&cert.value, key_path) {
                    Ok(_) => {
                        let mut pem = std::fs::read(&cert.value).unwrap_or_default();
                        if key.is_some() {
                            pem.push(b'\n');
                            pem.extend(std::fs::read(key_path).unwrap_or_default());
                        }
                        match reqwest::Identity::from_pem(&pem) {
                            Ok(id) => identity = Some(id),
                            Err(e) => problems.push(format!(
                                "{}: {} cannot be used as a client identity: {e}",
                                cert.key,
                                cert.value.display()
                            )),
                        }
                    }
                    Err(e) => {
                        let name = if e.key == "key_file" {
                            key_name
                        } else {
                            &cert.key
                        };
                        problems.push(format!("{name}: {} {}", e.path.display(), e.problem));
                    }
                }
            }
        }
        if problems.is_empty() {
            Ok(TlsMaterial {
                roots,
                identity,
                insecure: self.is_insecure(),
            })
        } else {
            Err(problems)
        }
    }
}

/// Reads a boolean the way openstacksdk does (`true`/`false`, also
/// `yes`/`no`, `1`/`0`, any case); `None` for anything else.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" | "on" => Some(true),
        "false" | "no" | "0" | "off" => Some(false),
        _ => None,
    }
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
    /// openstacksdk's `cacert`: CA bundle path.
    cacert: Option<String>,
    /// openstacksdk's `verify`: `false` turns certificate checks off.
    verify: Option<serde_yaml_ng::Value>,
    /// openstacksdk's `cert`: client certificate path.
    cert: Option<String>,
    /// openstacksdk's `key`: client key path.
    key: Option<String>,
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

/// The TLS settings of a clouds.yaml cloud (`cacert`, `verify`, `cert`,
/// `key`; a relative path is taken as it is, from the working directory,
/// as openstacksdk does).
fn entry_tls(entry: &CloudEntry, path: &Path, cloud: &str) -> Result<CloudTls, CredentialsError> {
    let key = |k: &str| format!("clouds.yaml {}: clouds.{cloud}.{k}", path.display());
    let file = |v: &Option<String>, k: &str| {
        v.as_ref().filter(|s| !s.is_empty()).map(|v| Setting {
            value: PathBuf::from(v),
            key: key(k),
        })
    };
    let insecure = match &entry.verify {
        None => None,
        Some(v) => {
            let verify = match v {
                serde_yaml_ng::Value::Bool(b) => Some(*b),
                other => yaml_str(other).as_deref().and_then(parse_bool),
            };
            let Some(verify) = verify else {
                return Err(CredentialsError::Value {
                    key: key("verify"),
                    value: format!("{v:?}"),
                    expected: "true or false (a CA bundle goes in cacert)",
                });
            };
            Some(Setting {
                value: !verify,
                key: key("verify"),
            })
        }
    };
    Ok(CloudTls {
        cacert: file(&entry.cacert, "cacert"),
        insecure,
        cert: file(&entry.cert, "cert"),
        key: file(&entry.key, "key"),
    })
}

/// `OS_CACERT`, `OS_INSECURE`, `OS_CERT`, `OS_KEY` over `tls` (each one
/// set and not empty replaces the clouds.yaml value, as the `openstack`
/// CLI's `--os-cacert`, `--insecure`, `--os-cert`, `--os-key` do).
fn overlay_tls_env(
    tls: &mut CloudTls,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), CredentialsError> {
    let get = |k: &str| env(k).filter(|s| !s.is_empty());
    let file = |k: &str| {
        get(k).map(|v| Setting {
            value: PathBuf::from(v),
            key: k.to_string(),
        })
    };
    if let Some(v) = file("OS_CACERT") {
        tls.cacert = Some(v);
    }
    if let Some(v) = file("OS_CERT") {
        tls.cert = Some(v);
    }
    if let Some(v) = file("OS_KEY") {
        tls.key = Some(v);
    }
    if let Some(v) = get("OS_INSECURE") {
        let insecure = parse_bool(&v).ok_or_else(|| CredentialsError::Value {
            key: "OS_INSECURE".into(),
            value: format!("{v:?}"),
            expected: "true or false",
        })?;
        tls.insecure = Some(Setting {
            value: insecure,
            key: "OS_INSECURE".into(),
        });
    }
    Ok(())
}

impl Credentials {
    /// Finds credentials: with a cloud name (config `cloud`, else
    /// `OS_CLOUD`) the first clouds.yaml of [`clouds_yaml_candidates`] that
    /// defines it (merged with a `secure.yaml` next to it, if present);
    /// without one, the `OS_*` variables. `env` reads a variable (tests pass
    /// a map).
    ///
    /// # Errors
    /// [`CredentialsError`] for unreadable files (also a directory where a
    /// clouds.yaml is looked for), an unknown cloud, missing
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
            let mut creds = Self::from_env(env)?;
            overlay_tls_env(&mut creds.tls, env)?;
            return Ok(creds);
        };
        let candidates = clouds_yaml_candidates(section, env);
        for path in &candidates {
            // Only what does not exist is skipped: a directory or an
            // unreadable file where a clouds.yaml is looked for is an error
            // naming it, not "the cloud is not defined".
            if !path.exists() {
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
                let mut creds = Self::from_entry(entry, origin)?;
                creds.tls = entry_tls(entry, path, &cloud)?;
                overlay_tls_env(&mut creds.tls, env)?;
                return Ok(creds);
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
            tls: CloudTls::default(),
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

    /// `{auth_url}/v3/users/{user_id}/application_credentials/{id}`
    /// (Keystone API v3, "Show application credential details").
    pub fn application_credential_url(&self, user_id: &str, id: &str) -> String {
        let base = self.auth_url.trim_end_matches('/');
        let v3 = if base.ends_with("/v3") {
            base.to_string()
        } else {
            format!("{base}/v3")
        };
        format!("{v3}/users/{user_id}/application_credentials/{id}")
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
    fn a_clouds_yaml_path_that_is_not_a_file_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("vq-clouds-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.display().to_string();
        let env = env_of(&[("OS_CLIENT_CONFIG_FILE", &path), ("OS_CLOUD", "c1")]);
        let err = Credentials::discover(&OpenStackSection::default(), &env).unwrap_err();
        assert!(
            matches!(&err, CredentialsError::Read { path: p, .. } if *p == path),
            "{err:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn clouds_yaml_tls_settings_are_read_and_os_variables_override_them() {
        let dir = tempfile_dir("tls");
        std::fs::write(
            dir.join("clouds.yaml"),
            "clouds:\n  c1:\n    auth:\n      auth_url: https://k/v3\n      username: u\n      password: p\n      project_id: pid\n    cacert: /etc/ca.pem\n    verify: false\n    cert: /etc/c.pem\n",
        )
        .unwrap();
        let path = dir.join("clouds.yaml").display().to_string();
        let env = env_of(&[("OS_CLIENT_CONFIG_FILE", &path), ("OS_CLOUD", "c1")]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        let ca = c.tls.cacert.as_ref().unwrap();
        assert_eq!(ca.value, PathBuf::from("/etc/ca.pem"));
        assert_eq!(ca.key, format!("clouds.yaml {path}: clouds.c1.cacert"));
        assert!(c.tls.is_insecure());
        assert_eq!(
            c.tls.cert.as_ref().unwrap().value,
            PathBuf::from("/etc/c.pem")
        );
        assert!(c.tls.key.is_none());

        let env = env_of(&[
            ("OS_CLIENT_CONFIG_FILE", &path),
            ("OS_CLOUD", "c1"),
            ("OS_CACERT", "/other.pem"),
            ("OS_INSECURE", "False"),
        ]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        let ca = c.tls.cacert.as_ref().unwrap();
        assert_eq!(
            (ca.value.to_str(), ca.key.as_str()),
            (Some("/other.pem"), "OS_CACERT")
        );
        assert!(!c.tls.is_insecure());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn os_cacert_and_os_insecure_apply_to_os_variable_credentials() {
        let env = env_of(&[
            ("OS_AUTH_URL", "https://k:5000"),
            ("OS_USERNAME", "u"),
            ("OS_PASSWORD", "p"),
            ("OS_PROJECT_NAME", "proj"),
            ("OS_CACERT", "/ca.pem"),
            ("OS_INSECURE", "true"),
        ]);
        let c = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
        assert_eq!(c.tls.cacert.unwrap().key, "OS_CACERT");
        assert_eq!(c.tls.insecure.unwrap().key, "OS_INSECURE");
    }

    #[test]
    fn a_verify_or_os_insecure_that_is_not_a_boolean_is_an_error_naming_the_key() {
        let dir = tempfile_dir("verify");
        std::fs::write(
            dir.join("clouds.yaml"),
            "clouds:\n  c1:\n    auth:\n      auth_url: https://k/v3\n      username: u\n      password: p\n      project_id: pid\n    verify: /etc/ca.pem\n",
        )
        .unwrap();
        let path = dir.join("clouds.yaml").display().to_string();
        let env = env_of(&[("OS_CLIENT_CONFIG_FILE", &path), ("OS_CLOUD", "c1")]);
        let err = Credentials::discover(&OpenStackSection::default(), &env).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("clouds.c1.verify") && msg.contains("cacert"),
            "{msg}"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let env = env_of(&[
            ("OS_AUTH_URL", "https://k:5000"),
            ("OS_USERNAME", "u"),
            ("OS_PASSWORD", "p"),
            ("OS_PROJECT_NAME", "proj"),
            ("OS_INSECURE", "maybe"),
        ]);
        let msg = Credentials::discover(&OpenStackSection::default(), &env)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("OS_INSECURE") && msg.contains("maybe"),
            "{msg}"
        );
    }

    #[test]
    fn unusable_tls_files_are_all_named_by_their_key() {
        let dir = tempfile_dir("files");
        let not_pem = dir.join("not.pem");
        std::fs::write(&not_pem, "hello\n").unwrap();
        let tls = CloudTls {
            cacert: Some(Setting {
                value: dir.join("missing.pem"),
                key: "OS_CACERT".into(),
            }),
            insecure: None,
            cert: Some(Setting {
                value: not_pem.clone(),
                key: "clouds.yaml x: clouds.c1.cert".into(),
            }),
            key: None,
        };
        let problems = tls.load().unwrap_err();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("OS_CACERT: ") && problems[0].contains("missing.pem"),
            "{problems:?}"
        );
        assert!(
            problems[1].starts_with("clouds.yaml x: clouds.c1.cert: ")
                && problems[1].contains("no PEM certificate"),
            "{problems:?}"
        );
        let tls = CloudTls {
            cacert: Some(Setting {
                value: not_pem,
                key: "OS_CACERT".into(),
            }),
            ..CloudTls::default()
        };
        let problems = tls.load().unwrap_err();
        assert!(problems[0].contains("no PEM certificate"), "{problems:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vq-clouds-{what}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
