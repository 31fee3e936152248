//! Act: carry out a pool's plan. Boots create servers named
//! `<cluster>-<pool>-<8 hex>` (the name is the agent id) with cloud-init
//! user-data that writes the agent's identity; ask-delete sends
//! `Control::AskDelete` to the agent; delete deletes the server in Nova.
//!
//! Idempotent by construction: a created server is in the next Nova list
//! and counts as booting, so re-running a cycle creates no duplicates (the
//! loop checks that it is, see [`crate::observe::CreatedWatch`]); a
//! repeated delete of a server that is gone succeeds.

use std::collections::BTreeMap;

use serde::Serialize;
use vq_common::amqp::AmqpError;
use vq_common::config::{AgentIdentity, PoolConfig};
use vq_common::messages::Control;

use crate::error::ActError;
use crate::openstack::{cluster_tag, CloudApi, CreateServer, META_AGENT, META_CLUSTER, META_POOL};
use crate::plan::{Action, DeleteCause};

/// Path of the identity file written by the user-data.
pub const IDENTITY_PATH: &str = "/etc/vq/identity.toml";

pub use crate::broker::Messenger;
/// The pool-specific context of [`act`] (and of [`crate::observe::observe_pool`]).
pub use crate::observe::PoolRef;

/// A new agent id: `<cluster>-<pool>-<8 hex digits>`.
pub fn new_agent_id(cluster: &str, pool: &str) -> String {
    format!("{cluster}-{pool}-{:08x}", rand::random::<u32>())
}

#[derive(Serialize)]
struct WriteFile {
    path: String,
    permissions: String,
    owner: String,
    content: String,
}

#[derive(Serialize)]
struct CloudConfig {
    bootcmd: Vec<Vec<String>>,
    write_files: Vec<WriteFile>,
    runcmd: Vec<Vec<String>>,
}

/// Shell command run by cloud-init's `bootcmd` (early, every boot): only
/// root may reach the metadata service, because the user-data it serves
/// holds the agent's broker credentials and jobs run as ordinary users.
pub const BLOCK_METADATA_CMD: &str = "command -v iptables >/dev/null 2>&1 && { iptables -C OUTPUT -d 169.254.169.254 -m owner ! --uid-owner 0 -j REJECT 2>/dev/null || iptables -I OUTPUT -d 169.254.169.254 -m owner ! --uid-owner 0 -j REJECT; } || echo 'vq: no iptables: job owners can read the user-data from the metadata service' >&2";

/// The identity file of a new agent, as TOML. It carries the
/// controller's `loss_limit` so that the agent, recovering its own leases
/// after a restart, decides a lost job's fate as the controller does, and
/// the pool's `slots` and `max_walltime_secs` so that the agent takes the
/// jobs the controller planned VMs for and `vq submit` accepted
/// ([`vq_common::pools`]).
pub fn identity_toml(
    cluster: &str,
    pool: &str,
    agent_id: &str,
    cfg: &PoolConfig,
    loss_limit: u32,
) -> String {
    let id = AgentIdentity {
        cluster: Some(cluster.to_string()),
        pool: pool.to_string(),
        agent_id: agent_id.to_string(),
        broker_url: Some(cfg.agent_broker_url.clone()),
        loss_limit: Some(loss_limit),
        slots: Some(cfg.slots),
        max_walltime_secs: Some(cfg.max_walltime_secs),
    };
    toml::to_string(&id).expect("identity serializes to TOML")
}

/// Renders the user-data of a new server. Without a template: a
/// `#cloud-config` document that blocks the metadata service for non-root
/// users ([`BLOCK_METADATA_CMD`]), writes [`IDENTITY_PATH`] (mode 0600) and
/// runs `systemctl enable --now --no-block jobagent` (`--no-block`: runcmd
/// runs inside cloud-final.service, which is ordered after
/// multi-user.target). With a template: its text with
/// `{{identity_toml}}`, `{{pool}}`, `{{agent_id}}`, `{{cluster}}` and
/// `{{broker_url}}` replaced.
///
/// # Errors
/// [`ActError::UserData`] if the YAML cannot be produced.
pub fn render_user_data(
    cluster: &str,
    pool: &str,
    agent_id: &str,
    cfg: &PoolConfig,
    loss_limit: u32,
    template: Option<&str>,
) -> Result<String, ActError> {
    let identity = identity_toml(cluster, pool, agent_id, cfg, loss_limit);
    if let Some(t) = template {
        return Ok(t
            .replace("{{identity_toml}}", &identity)
            .replace("{{pool}}", pool)
            .replace("{{agent_id}}", agent_id)
            .replace("{{cluster}}", cluster)
            .replace("{{broker_url}}", &cfg.agent_broker_url));
    }
    let doc = CloudConfig {
        bootcmd: vec![vec!["sh".into(), "-c".into(), BLOCK_METADATA_CMD.into()]],
        write_files: vec![WriteFile {
            path: IDENTITY_PATH.into(),
            permissions: "0600".into(),
            owner: "root:root".into(),
            content: identity,
        }],
        runcmd: vec![vec![
            "systemctl".into(),
            "enable".into(),
            "--now".into(),
            "--no-block".into(),
            "jobagent".into(),
        ]],
    };
    let yaml = serde_yaml_ng::to_string(&doc).map_err(|e| ActError::UserData {
        pool: pool.into(),
        detail: e.to_string(),
    })?;
    Ok(format!("#cloud-config\n{yaml}"))
}

/// What one act step did.
#[derive(Debug, Default)]
pub struct ActReport {
    /// Servers created: `(name, id)`.
    pub created: Vec<(String, String)>,
    /// Servers deleted, with the cause.
    pub deleted: Vec<(String, DeleteCause)>,
    /// Agents asked whether they may be deleted.
    pub asked: Vec<String>,
    /// Whether a boot failed (starts the boot cooldown).
    pub boot_failed: bool,
    /// Errors, each already logged once here.
    pub errors: Vec<ActError>,
}

/// Carries out `actions` for `pool`. Deletions and questions go first (they
/// free quota), then boots. A failing boot stops the remaining boots of
/// this cycle; every other failure is recorded and the rest continues.
pub async fn act<C: CloudApi, M: Messenger>(
    pool: PoolRef<'_>,
    actions: &[Action],
    cloud: &C,
    messenger: &M,
) -> ActReport {
    let mut report = ActReport::default();
    let mut ordered: Vec<&Action> = actions
        .iter()
        .filter(|a| !matches!(a, Action::Boot { .. }))
        .collect();
    ordered.extend(actions.iter().filter(|a| matches!(a, Action::Boot { .. })));
    for action in ordered {
        match action {
            Action::Delete {
                server_id,
                name,
                cause,
                reason,
            } => {
                tracing::info!(pool = pool.name, server = %name, server_id = %server_id, cause = cause.label(), reason = %reason, "deleting server");
                // Fence first: the leases of the agent are returned once the
                // server is gone, whatever happens to this controller.
                if let Err(source) = messenger.mark_fence(name).await {
                    let e = ActError::Control {
                        what: "fence mark",
                        agent: name.clone(),
                        source: Box::new(source),
                    };
                    tracing::warn!(pool = pool.name, server = %name, error = %e, "cannot record the fence; not deleting");
                    report.errors.push(e);
                    continue;
                }
                match cloud.delete_server(server_id).await {
                    Ok(()) => report.deleted.push((name.clone(), *cause)),
                    Err(source) => {
                        let e = ActError::Delete {
                            id: server_id.clone(),
                            name: name.clone(),
                            source: Box::new(source),
                        };
                        tracing::warn!(pool = pool.name, server = %name, error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "delete failed");
                        report.errors.push(e);
                    }
                }
            }
            Action::AskDelete { agent, reason, .. } => {
                let msg = Control::AskDelete {
                    request_id: uuid::Uuid::new_v4().to_string(),
                };
                tracing::info!(pool = pool.name, agent = %agent, reason = %reason, "asking agent whether it may be deleted");
                match messenger.send_control(agent, &msg).await {
                    Ok(()) => report.asked.push(agent.clone()),
                    Err(AmqpError::Unroutable { .. }) => {
                        // Not connected: it stops heartbeating and is judged dead.
                        tracing::warn!(pool = pool.name, agent = %agent, "agent has no control queue (not connected); not asked");
                    }
                    Err(source) => {
                        let e = ActError::Control {
                            what: "ask-delete",
                            agent: agent.clone(),
                            source: Box::new(source),
                        };
                        tracing::warn!(pool = pool.name, agent = %agent, error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "ask-delete failed");
                        report.errors.push(e);
                    }
                }
            }
            Action::Boot { count, reason } => {
                if let Err(e) = boot(pool, *count, reason, cloud, &mut report).await {
                    tracing::warn!(pool = pool.name, error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "boot failed");
                    report.boot_failed = true;
                    report.errors.push(e);
                }
            }
        }
    }
    report
}

async fn boot<C: CloudApi>(
    pool: PoolRef<'_>,
    count: u32,
    reason: &str,
    cloud: &C,
    report: &mut ActReport,
) -> Result<(), ActError> {
    let resolve_err = |source| ActError::Resolve {
        pool: pool.name.into(),
        source: Box::new(source),
    };
    let flavor = cloud
        .resolve_flavor(&pool.cfg.flavor)
        .await
        .map_err(resolve_err)?;
    let image = cloud
        .resolve_image(&pool.cfg.image)
        .await
        .map_err(resolve_err)?;
    let template = match &pool.cfg.user_data_template {
        Some(path) => Some(
            std::fs::read_to_string(path).map_err(|e| ActError::UserData {
                pool: pool.name.into(),
                detail: format!("cannot read {}: {e}", path.display()),
            })?,
        ),
        None => None,
    };
    for _ in 0..count {
        let name = new_agent_id(pool.cluster, pool.name);
        let user_data = render_user_data(
            pool.cluster,
            pool.name,
            &name,
            pool.cfg,
            pool.loss_limit,
            template.as_deref(),
        )?;
        let metadata: BTreeMap<String, String> = [
            (META_CLUSTER.to_string(), pool.cluster.to_string()),
            (META_POOL.to_string(), pool.name.to_string()),
            (META_AGENT.to_string(), name.clone()),
        ]
        .into();
        let req = CreateServer {
            name: name.clone(),
            flavor_ref: flavor.clone(),
            image_ref: image.clone(),
            user_data: user_data.into_bytes(),
            metadata,
            tags: vec![cluster_tag(pool.cluster)],
            network: pool.cfg.network.clone(),
            key_name: pool.cfg.key_name.clone(),
            security_groups: pool.cfg.security_groups.clone(),
            availability_zone: pool.cfg.availability_zone.clone(),
        };
        let id = cloud
            .create_server(&req)
            .await
            .map_err(|source| ActError::Create {
                pool: pool.name.into(),
                name: name.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(pool = pool.name, server = %name, server_id = %id, reason, "created server");
        report.created.push((name, id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_cfg() -> PoolConfig {
        PoolConfig {
            flavor: "m1.tiny".into(),
            image: "cirros".into(),
            agent_broker_url: "amqp://agent:pw@10.0.0.1:5672/%2f".into(),
            ..PoolConfig::default()
        }
    }

    #[test]
    fn default_user_data_writes_the_identity_for_cloud_init() {
        let ud = render_user_data("vq", "cms", "vq-cms-0000abcd", &pool_cfg(), 5, None).unwrap();
        assert!(ud.starts_with("#cloud-config\n"));
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&ud).unwrap();
        let wf = &doc["write_files"][0];
        assert_eq!(wf["path"].as_str(), Some(IDENTITY_PATH));
        assert_eq!(wf["permissions"].as_str(), Some("0600"));
        let id: AgentIdentity = toml::from_str(wf["content"].as_str().unwrap()).unwrap();
        assert_eq!(id.pool, "cms");
        assert_eq!(id.agent_id, "vq-cms-0000abcd");
        assert_eq!(id.cluster.as_deref(), Some("vq"));
        assert_eq!(
            id.broker_url.as_deref(),
            Some("amqp://agent:pw@10.0.0.1:5672/%2f")
        );
        assert_eq!(
            id.loss_limit,
            Some(5),
            "the agent gets the controller's loss_limit"
        );
        assert_eq!(
            (id.slots, id.max_walltime_secs),
            (Some(1), Some(31 * 24 * 3600)),
            "the agent gets the pool's slots and max walltime"
        );
        let wide = PoolConfig {
            slots: 4,
            max_walltime_secs: 3600,
            ..pool_cfg()
        };
        let id: AgentIdentity =
            toml::from_str(&identity_toml("vq", "cms", "vq-cms-1", &wide, 5)).unwrap();
        assert_eq!((id.slots, id.max_walltime_secs), (Some(4), Some(3600)));
        assert_eq!(doc["runcmd"][0][4].as_str(), Some("jobagent"));
        assert_eq!(doc["runcmd"][0][3].as_str(), Some("--no-block"));
        assert!(doc["bootcmd"][0][2]
            .as_str()
            .unwrap()
            .contains("169.254.169.254"));
    }

    #[test]
    fn templates_get_their_placeholders_replaced() {
        let t = "#!/bin/sh\necho {{agent_id}} {{pool}} {{cluster}} {{broker_url}}\ncat > /etc/vq/identity.toml <<'E'\n{{identity_toml}}E\n";
        let ud = render_user_data("vq", "cms", "vq-cms-1", &pool_cfg(), 5, Some(t)).unwrap();
        assert!(ud.contains("echo vq-cms-1 cms vq amqp://agent:pw@10.0.0.1:5672/%2f"));
        assert!(ud.contains("agent_id = \"vq-cms-1\""));
        assert!(!ud.contains("{{"));
    }

    #[test]
    fn agent_ids_are_valid_names() {
        let id = new_agent_id("vq", "cms");
        assert!(vq_common::topology::valid_name(&id));
        assert_eq!(id.len(), "vq-cms-".len() + 8);
    }
}
