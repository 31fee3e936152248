//! What the project has, by name, for `vq-controller --check-config
//! --online` ([`crate::preflight`]): its flavors, active images, key pairs
//! (Nova), networks and security groups (Neutron v2.0). Read-only; nothing
//! is cached.

use reqwest::Method;
use serde_json::Value;

use super::HttpCloud;
use crate::error::CloudError;

/// One thing of the project: its id and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// Its id (for a key pair, its name).
    pub id: String,
    /// Its name.
    pub name: String,
}

impl Named {
    /// Whether `wanted` is this thing's id or name.
    pub fn is(&self, wanted: &str) -> bool {
        self.id == wanted || self.name == wanted
    }
}

fn named_list(
    op: &str,
    v: &Value,
    array: &str,
    inner: Option<&str>,
) -> Result<Vec<Named>, CloudError> {
    let items = v
        .get(array)
        .and_then(Value::as_array)
        .ok_or_else(|| CloudError::Decode {
            op: op.into(),
            detail: format!("no {array} array"),
        })?;
    Ok(items
        .iter()
        .filter_map(|item| {
            let item = match inner {
                Some(k) => item.get(k)?,
                None => item,
            };
            let name = item.get("name").and_then(Value::as_str)?.to_string();
            let id = item
                .get("id")
                .and_then(Value::as_str)
                .map_or_else(|| name.clone(), str::to_string);
            Some(Named { id, name })
        })
        .collect())
}

impl HttpCloud {
    /// The project's name for messages: the credentials' project name,
    /// else its id, else `the project` (an application credential).
    pub fn project_label(&self) -> String {
        match &self.creds.method {
            super::AuthMethod::Password {
                project_name,
                project_id,
                ..
            } => project_name
                .clone()
                .or_else(|| project_id.clone())
                .unwrap_or_else(|| "the project".into()),
            super::AuthMethod::ApplicationCredential { .. } => {
                "the application credential's project".into()
            }
        }
    }

    /// Authenticates now (a new token).
    ///
    /// # Errors
    /// The [`CloudError`] of the token request.
    pub async fn login(&self) -> Result<(), CloudError> {
        self.session(true).await.map(|_| ())
    }

    async fn get_json(
        &self,
        op: &str,
        url: impl Fn(&super::http::Session) -> Option<String>,
        service: &str,
    ) -> Result<Value, CloudError> {
        let session = self.session(false).await?;
        let Some(base) = url(&session) else {
            return Err(CloudError::NoEndpoint {
                service: service.into(),
                interface: self.creds.interface.clone(),
                region: self.creds.region.clone(),
            });
        };
        let resp = self
            .send(op, &[], |_| self.client.request(Method::GET, &base))
            .await?;
        Self::json(op, resp).await
    }

    /// Every flavor the project may use (`GET /flavors/detail?is_public=None`).
    ///
    /// # Errors
    /// [`CloudError`] if the list cannot be read.
    pub async fn list_flavors(&self) -> Result<Vec<Named>, CloudError> {
        let op = "GET /flavors/detail";
        let v = self
            .get_json(
                op,
                |s| Some(format!("{}/flavors/detail?is_public=None", s.compute)),
                "compute",
            )
            .await?;
        named_list(op, &v, "flavors", None)
    }

    /// Every flavor the project may use with its RAM, MiB (`GET
    /// /flavors/detail?is_public=None`; a flavor without a `ram` number
    /// is left out).
    ///
    /// # Errors
    /// [`CloudError`] if the list cannot be read.
    pub async fn list_flavor_ram(&self) -> Result<Vec<(Named, u64)>, CloudError> {
        let op = "GET /flavors/detail";
        let v = self
            .get_json(
                op,
                |s| Some(format!("{}/flavors/detail?is_public=None", s.compute)),
                "compute",
            )
            .await?;
        let named = named_list(op, &v, "flavors", None)?;
        let rams = v["flavors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f.get("name").and_then(Value::as_str).is_some())
            .map(|f| f.get("ram").and_then(Value::as_u64));
        Ok(named
            .into_iter()
            .zip(rams)
            .filter_map(|(n, ram)| Some((n, ram?)))
            .collect())
    }

    /// The active images the project sees (Glance v2, up to 1000).
    ///
    /// # Errors
    /// [`CloudError`] if there is no image endpoint or the list cannot be
    /// read.
    pub async fn list_images(&self) -> Result<Vec<Named>, CloudError> {
        let op = "GET /v2/images?status=active";
        let v = self
            .get_json(
                op,
                |s| {
                    s.image.as_ref().map(|b| {
                        let b = b.trim_end_matches("/v2");
                        format!("{b}/v2/images?status=active&limit=1000")
                    })
                },
                "image",
            )
            .await?;
        named_list(op, &v, "images", None)
    }

    /// The user's key pairs (`GET /os-keypairs`).
    ///
    /// # Errors
    /// [`CloudError`] if the list cannot be read.
    pub async fn list_keypairs(&self) -> Result<Vec<Named>, CloudError> {
        let op = "GET /os-keypairs";
        let v = self
            .get_json(
                op,
                |s| Some(format!("{}/os-keypairs", s.compute)),
                "compute",
            )
            .await?;
        named_list(op, &v, "keypairs", Some("keypair"))
    }

    /// The networks the project sees (Neutron `GET /v2.0/networks`).
    ///
    /// # Errors
    /// [`CloudError::NoEndpoint`] without a network endpoint; any other
    /// [`CloudError`] if the list cannot be read.
    pub async fn list_networks(&self) -> Result<Vec<Named>, CloudError> {
        let op = "GET /v2.0/networks";
        let v = self
            .get_json(
                op,
                |s| s.network.as_ref().map(|b| format!("{b}/v2.0/networks")),
                "network",
            )
            .await?;
        named_list(op, &v, "networks", None)
    }

    /// The project's security groups (Neutron `GET /v2.0/security-groups`).
    ///
    /// # Errors
    /// As [`HttpCloud::list_networks`].
    pub async fn list_security_groups(&self) -> Result<Vec<Named>, CloudError> {
        let op = "GET /v2.0/security-groups";
        let v = self
            .get_json(
                op,
                |s| {
                    s.network
                        .as_ref()
                        .map(|b| format!("{b}/v2.0/security-groups"))
                },
                "network",
            )
            .await?;
        named_list(op, &v, "security_groups", None)
    }
}

/// The RAM, MiB, of the flavor `wanted` (an id, else a name that only one
/// flavor has) among `flavors` ([`HttpCloud::list_flavor_ram`]); `None`
/// if no flavor, or more than one, answers to it.
pub fn flavor_ram(flavors: &[(Named, u64)], wanted: &str) -> Option<u64> {
    if let Some((_, ram)) = flavors.iter().find(|(f, _)| f.id == wanted) {
        return Some(*ram);
    }
    let mut named = flavors.iter().filter(|(f, _)| f.name == wanted);
    match (named.next(), named.next()) {
        (Some((_, ram)), None) => Some(*ram),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flavors_ram_is_found_by_id_or_by_a_unique_name() {
        let f = |id: &str, name: &str, ram| {
            (
                Named {
                    id: id.into(),
                    name: name.into(),
                },
                ram,
            )
        };
        let flavors = [
            f("1", "m1.tiny", 512),
            f("2", "m1.small", 2048),
            f("3", "dup", 1),
            f("4", "dup", 2),
        ];
        assert_eq!(flavor_ram(&flavors, "m1.small"), Some(2048));
        assert_eq!(flavor_ram(&flavors, "1"), Some(512));
        assert_eq!(flavor_ram(&flavors, "4"), Some(2));
        assert_eq!(flavor_ram(&flavors, "dup"), None, "ambiguous");
        assert_eq!(flavor_ram(&flavors, "x1.huge"), None);
    }
}
