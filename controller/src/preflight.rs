//! `vq-controller --check-config --online`: the configuration checked
//! against the cloud and the broker it names, without changing either.
//!
//! Cloud: log in to Keystone, read the compute version document (the
//! requested microversion must be served), resolve every pool's flavor,
//! image, network, key pair and security groups against what the project
//! has, read the quota. Broker: connect and declare the topology with the
//! controller's account (idempotent, as the controller does at start),
//! inspect every pool queue (passive declare) and publish the unroutable
//! alarm probe to the control exchange (the write permission the
//! controller needs). Every problem is reported, each with the config key
//! it is about ([`Problem`]).

use serde::Serialize;
use vq_common::config::ControllerConfig;
use vq_common::error::chain;
use vq_common::topology::Topology;

use crate::broker::Broker;
use crate::error::CloudError;
use crate::openstack::inventory::Named;
use crate::openstack::{CloudApi, HttpCloud};

/// One problem of the configuration against reality.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The config key it is about (`pools.gpu.flavor`, `broker.url`,
    /// `openstack`).
    pub key: String,
    /// What is wrong, for a person.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

fn problem(key: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        key: key.into(),
        message: message.into(),
    }
}

/// At most this many names are listed after `have:`.
const HAVE_SHOWN: usize = 20;

/// `a, b, c` of the sorted distinct names of `items` (`none` if empty).
fn have(items: &[Named]) -> String {
    let mut names: Vec<&str> = items.iter().map(|n| n.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    if names.is_empty() {
        return "none".into();
    }
    let more = names.len().saturating_sub(HAVE_SHOWN);
    let mut out = names[..names.len().min(HAVE_SHOWN)].join(", ");
    if more > 0 {
        out.push_str(&format!(" and {more} more"));
    }
    out
}

/// What one check found of `wanted` in `items` (`kind` names the kind for
/// messages): `Ok` for exactly one match by id or name.
fn find(items: &[Named], wanted: &str, kind: &str, project: &str) -> Result<(), String> {
    let by_id = items.iter().any(|n| n.id == wanted);
    let by_name = items.iter().filter(|n| n.name == wanted).count();
    match (by_id, by_name) {
        (true, _) | (false, 1) => Ok(()),
        (false, 0) => Err(format!(
            "no {kind} {wanted:?} in project {project} (have: {})",
            have(items)
        )),
        (false, n) => Err(format!(
            "{n} {kind}s are named {wanted:?} in project {project}; use its id"
        )),
    }
}

/// A list of the project's things, or the problem of reading it (reported
/// once, under `key`).
async fn listed(
    what: &str,
    key: &str,
    out: &mut Vec<Problem>,
    list: impl std::future::Future<Output = Result<Vec<Named>, CloudError>>,
) -> Option<Vec<Named>> {
    match list.await {
        Ok(l) => Some(l),
        Err(e) => {
            out.push(problem(
                key,
                format!("cannot list the {what}: {}", chain(&e)),
            ));
            None
        }
    }
}

/// Every problem of `cfg` against `cloud`; empty when all is well.
pub async fn check_cloud(cfg: &ControllerConfig, cloud: &HttpCloud) -> Vec<Problem> {
    let mut out = Vec::new();
    if let Err(e) = cloud.login().await {
        out.push(problem(
            "openstack",
            format!(
                "cannot log in to Keystone ({}): {}",
                cloud.credentials().origin,
                chain(&e)
            ),
        ));
        return out;
    }
    if let Err(e) = cloud.check_compute_version().await {
        out.push(problem("openstack.compute_microversion", chain(&e)));
    }
    let project = cloud.project_label();
    let uses = |f: &dyn Fn(&vq_common::config::PoolConfig) -> bool| cfg.pools.values().any(f);
    let flavors = listed("flavors", "openstack", &mut out, cloud.list_flavors()).await;
    let images = listed("images", "openstack", &mut out, cloud.list_images()).await;
    let keypairs = if uses(&|p| p.key_name.is_some()) {
        listed("key pairs", "openstack", &mut out, cloud.list_keypairs()).await
    } else {
        None
    };
    let networks = if uses(&|p| p.network.is_some()) {
        listed("networks", "openstack", &mut out, cloud.list_networks()).await
    } else {
        None
    };
    let groups = if uses(&|p| !p.security_groups.is_empty()) {
        listed(
            "security groups",
            "openstack",
            &mut out,
            cloud.list_security_groups(),
        )
        .await
    } else {
        None
    };
    for (name, pool) in &cfg.pools {
        let key = |k: &str| format!("pools.{name}.{k}");
        if let Some(l) = &flavors {
            if let Err(m) = find(l, &pool.flavor, "flavor", &project) {
                out.push(problem(key("flavor"), m));
            }
        }
        if let Some(l) = &images {
            let uuid = crate::openstack::looks_like_uuid(&pool.image);
            if !(uuid && l.iter().any(|i| i.id == pool.image)) {
                if let Err(m) = find(l, &pool.image, "active image", &project) {
                    out.push(problem(key("image"), m));
                }
            }
        }
        if let (Some(l), Some(net)) = (&networks, &pool.network) {
            if !l.iter().any(|n| &n.id == net) {
                let m = match l.iter().find(|n| &n.name == net) {
                    Some(n) => format!(
                        "{net:?} is the name of a network; network takes its id ({})",
                        n.id
                    ),
                    None => format!(
                        "no network with id {net:?} in project {project} (have: {})",
                        l.iter()
                            .map(|n| format!("{} {}", n.name, n.id))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
                out.push(problem(key("network"), m));
            }
        }
        if let (Some(l), Some(k)) = (&keypairs, &pool.key_name) {
            if !l.iter().any(|n| &n.name == k) {
                out.push(problem(
                    key("key_name"),
                    format!("no key pair {k:?} of this user (have: {})", have(l)),
                ));
            }
        }
        if let Some(l) = &groups {
            for g in &pool.security_groups {
                if let Err(m) = find(l, g, "security group", &project) {
                    out.push(problem(key("security_groups"), m));
                }
            }
        }
    }
    if let Err(e) = cloud.quota().await {
        out.push(problem(
            "openstack",
            format!("cannot read the compute quota: {}", chain(&e)),
        ));
    }
    out
}

/// Every problem of `cfg`'s broker account: connect and declare, inspect
/// each pool queue, publish the alarm probe.
pub async fn check_broker(cfg: &ControllerConfig) -> Vec<Problem> {
    let mut out = Vec::new();
    let broker = Broker::new(
        cfg.broker.clone(),
        Topology::new(cfg.cluster.clone()),
        cfg.pools.keys().cloned().collect(),
    )
    .without_demand();
    if let Err(e) = broker.ensure_connected().await {
        out.push(problem(
            "broker.url",
            format!("cannot connect and declare the topology: {}", chain(&e)),
        ));
        return out;
    }
    for pool in cfg.pools.keys() {
        if let Err(e) = broker.queue_depth(pool).await {
            out.push(problem(format!("pools.{pool}"), chain(&e)));
        }
    }
    if let Err(e) = broker.probe().await {
        out.push(problem(
            "broker.url",
            format!(
                "the account cannot publish to the control exchange: {}",
                chain(&e)
            ),
        ));
    }
    broker.close().await;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(pairs: &[(&str, &str)]) -> Vec<Named> {
        pairs
            .iter()
            .map(|(id, name)| Named {
                id: id.to_string(),
                name: name.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_name_is_found_by_id_or_unique_name_and_a_miss_lists_what_there_is() {
        let l = named(&[
            ("2", "m1.small"),
            ("1", "m1.tiny"),
            ("3", "dup"),
            ("4", "dup"),
        ]);
        assert_eq!(find(&l, "m1.small", "flavor", "demo"), Ok(()));
        assert_eq!(find(&l, "1", "flavor", "demo"), Ok(()));
        assert_eq!(
            find(&l, "x1.huge", "flavor", "demo"),
            Err("no flavor \"x1.huge\" in project demo (have: dup, m1.small, m1.tiny)".into())
        );
        assert_eq!(
            find(&l, "dup", "flavor", "demo"),
            Err("2 flavors are named \"dup\" in project demo; use its id".into())
        );
        assert_eq!(have(&[]), "none");
    }

    #[test]
    fn long_lists_are_cut_with_a_count() {
        let l: Vec<Named> = (0..25)
            .map(|i| Named {
                id: i.to_string(),
                name: format!("n{i:02}"),
            })
            .collect();
        let h = have(&l);
        assert!(h.ends_with("n19 and 5 more"), "{h}");
    }
}
