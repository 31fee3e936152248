//! Flavor and image names to ids for [`HttpCloud`]: flavors through
//! Nova's flavor list (by id, else a unique name), images through Glance (a
//! UUID is taken as it is, else the one active image of that name). Found
//! ids are cached for the process's life.

use reqwest::Method;
use serde_json::Value;

use super::{looks_like_uuid, HttpCloud};
use crate::error::CloudError;

impl HttpCloud {
    /// The id of flavor `name` (a name or an id), cached.
    ///
    /// # Errors
    /// [`CloudError::Resolve`] if no flavor or several have this name; any
    /// other [`CloudError`] if the list cannot be read.
    pub async fn flavor_id(&self, name: &str) -> Result<String, CloudError> {
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

    /// The id of image `name` (a name or a UUID), cached.
    ///
    /// # Errors
    /// [`CloudError::Resolve`] if no active image or several have this
    /// name; [`CloudError::NoEndpoint`] without an image endpoint; any
    /// other [`CloudError`] if the list cannot be read.
    pub async fn image_id(&self, name: &str) -> Result<String, CloudError> {
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
}
