//! The Nova calls of [`HttpCloud`]: the compute API's microversion range,
//! and the [`CloudApi`] operations on servers (the paginated, all-or-nothing
//! list, create, delete) and the instance quota. Flavor and image names
//! are resolved in [`super::lookup`].

use std::collections::BTreeMap;

use base64::Engine as _;
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use vq_common::config::{Microversion, MIN_COMPUTE_MICROVERSION};

use super::http::status_error;
use super::{
    parse_timestamp, CloudApi, CreateServer, HttpCloud, Quota, Server, LIST_PAGE_SIZE, MAX_PAGES,
};
use crate::error::CloudError;

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
                .map_err(|source| {
                    self.count(&op, None);
                    CloudError::Transport {
                        op: op.clone(),
                        source,
                    }
                })?;
            let status = resp.status();
            self.count(&op, Some(status.as_u16()));
            if status == StatusCode::UNAUTHORIZED && !renewed {
                renewed = true;
                continue;
            }
            if !status.is_success() {
                return Err(status_error(op, resp).await);
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
}

impl CloudApi for HttpCloud {
    async fn list_servers(&self, tag: &str) -> Result<Vec<Server>, CloudError> {
        let mut out: Vec<Server> = Vec::new();
        let mut ids = std::collections::BTreeSet::new();
        let mut links = std::collections::BTreeSet::new();
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
            // Nova can list a server twice while servers are being
            // scheduled: each counts once.
            for server in page.servers.into_iter().map(Server::from) {
                if ids.insert(server.id.clone()) {
                    out.push(server);
                } else {
                    tracing::debug!(server_id = %server.id, "server listed twice; counted once");
                }
            }
            next = page
                .servers_links
                .into_iter()
                .find(|l| l.rel == "next")
                .map(|l| l.href);
            match &next {
                None => return Ok(out),
                Some(_) if count == 0 => return Ok(out),
                Some(link) if !links.insert(link.clone()) => {
                    return Err(CloudError::Decode {
                        op,
                        detail: format!("the next link {link} was already followed (a repeated or cycling next link): the listing is incomplete, refusing a partial view"),
                    });
                }
                Some(_) => {}
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
        self.flavor_id(name).await
    }

    async fn resolve_image(&self, name: &str) -> Result<String, CloudError> {
        self.image_id(name).await
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
        // A limit that is absent or -1 is unlimited; a usage absent is 0.
        let limit = |k: &str| match abs.get(k).and_then(Value::as_i64) {
            Some(m) if m >= 0 => Some(m as u64),
            _ => None,
        };
        let used = |k: &str| abs.get(k).and_then(Value::as_i64).unwrap_or(0).max(0) as u64;
        let small = |v: u64| v.min(u64::from(u32::MAX)) as u32;
        Ok(Quota {
            max_instances: limit("maxTotalInstances").map(small),
            used_instances: small(used("totalInstancesUsed")),
            max_cores: limit("maxTotalCores").map(small),
            used_cores: small(used("totalCoresUsed")),
            max_ram_mib: limit("maxTotalRAMSize"),
            used_ram_mib: used("totalRAMUsed"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openstack::DEFAULT_COMPUTE_MICROVERSION;

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
}
