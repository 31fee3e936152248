//! Loading the agent's settings: config file, `VQ_*` environment overrides,
//! the VM identity file, command-line overrides, and the host-name default
//! for the agent id. Every problem is reported at once (exit 64).

use std::path::{Path, PathBuf};

use vq_common::config::{env_overrides, load_identity, parse, AgentConfig};
use vq_common::topology::valid_name;
use vq_common::ConfigError;

/// Default config file.
pub const DEFAULT_CONFIG: &str = "/etc/vq/jobagent.toml";

/// Default identity file, used when it exists.
pub const DEFAULT_IDENTITY: &str = "/etc/vq/identity.toml";

/// Loads the config at `config`, with `env` (`VQ_*` variables), then the
/// identity file (pool, agent id, cluster, broker URL), then `state_dir`
/// layered over it, and fills an empty agent id with the short host name
/// `hostname`.
///
/// # Errors
/// [`ConfigError::Read`] for an unreadable file, [`ConfigError::Invalid`]
/// listing every problem.
pub fn load_settings(
    config: &Path,
    identity: Option<&Path>,
    state_dir: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    hostname: &str,
) -> Result<AgentConfig, ConfigError> {
    let text = std::fs::read_to_string(config).map_err(|source| ConfigError::Read {
        path: config.to_path_buf(),
        source,
    })?;
    let mut overrides = env_overrides(
        <AgentConfig as vq_common::config::Validate>::ENV_PREFIX,
        env,
    );
    if let Some(path) = identity {
        let id = load_identity(path)?;
        overrides.insert("pool".into(), id.pool.into());
        overrides.insert("agent_id".into(), id.agent_id.into());
        if let Some(c) = id.cluster {
            overrides.insert("cluster".into(), c.into());
        }
        if let Some(n) = id.loss_limit {
            overrides.insert("loss_limit".into(), i64::from(n).into());
        }
        if let Some(url) = id.broker_url {
            let broker = overrides
                .entry("broker")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !broker.is_table() {
                *broker = toml::Value::Table(toml::Table::new());
            }
            if let toml::Value::Table(t) = broker {
                t.insert("url".into(), url.into());
            }
        }
    }
    if let Some(dir) = state_dir {
        overrides.insert(
            "state_dir".into(),
            dir.to_string_lossy().into_owned().into(),
        );
    }
    let mut cfg: AgentConfig = parse(&config.display().to_string(), &text, overrides)?;
    if cfg.agent_id.is_empty() {
        let short = hostname.split('.').next().unwrap_or_default();
        if !valid_name(short) {
            return Err(ConfigError::Invalid {
                origin: config.display().to_string(),
                problems: vec![format!(
                    "agent_id: empty and the host name {hostname:?} is not a valid agent id; set agent_id"
                )],
            });
        }
        cfg.agent_id = short.to_string();
    }
    Ok(cfg)
}

/// The identity file to use: `explicit`, else [`DEFAULT_IDENTITY`] if it
/// exists.
pub fn identity_path(explicit: Option<PathBuf>) -> Option<PathBuf> {
    explicit.or_else(|| {
        let p = PathBuf::from(DEFAULT_IDENTITY);
        p.exists().then_some(p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_and_flags_override_the_file_and_hostname_fills_the_id() {
        let dir = tempfile::tempdir().unwrap();
        let cfg_path = dir.path().join("a.toml");
        std::fs::write(&cfg_path, "pool = \"x\"\nslots = 2\n").unwrap();
        let cfg = load_settings(
            &cfg_path,
            None,
            Some(Path::new("/tmp/s")),
            [],
            "node7.example.org",
        )
        .unwrap();
        assert_eq!(cfg.agent_id, "node7");
        assert_eq!(cfg.state_dir, Path::new("/tmp/s"));
        let id_path = dir.path().join("id.toml");
        std::fs::write(
            &id_path,
            "pool = \"cms\"\nagent_id = \"vq-cms-1\"\nbroker_url = \"amqp://a:b@h/%2f\"\n",
        )
        .unwrap();
        let cfg = load_settings(&cfg_path, Some(&id_path), None, [], "h").unwrap();
        assert_eq!(
            (
                cfg.pool.as_str(),
                cfg.agent_id.as_str(),
                cfg.broker.url.as_str()
            ),
            ("cms", "vq-cms-1", "amqp://a:b@h/%2f")
        );
        assert_eq!(cfg.slots, 2);
    }

    #[test]
    fn every_problem_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, "slots = 0\ncolour = 1\n").unwrap();
        let err = load_settings(&p, None, None, [], "h").unwrap_err();
        let text = err.to_string();
        for needle in ["colour", "slots", "pool"] {
            assert!(text.contains(needle), "{needle} missing in {text}");
        }
    }
}
