//! Loading the agent's settings: config file, `VQ_*` environment overrides,
//! the VM identity file, command-line overrides, and the host-name default
//! for the agent id. Every problem of all of them is reported at once, in
//! one round (exit 64): the config's unknown keys, type and value errors,
//! the identity file's, and an unusable host name.

use std::path::{Path, PathBuf};

use vq_common::config::{env_overrides, parse_checked, parse_identity, AgentConfig, Validate};
use vq_common::topology::valid_name;
use vq_common::ConfigError;

/// Default config file.
pub const DEFAULT_CONFIG: &str = "/etc/vq/jobagent.toml";

/// Default identity file, used when it exists.
pub const DEFAULT_IDENTITY: &str = "/etc/vq/identity.toml";

/// Loads the config at `config`, with `env` (`VQ_*` variables), then the
/// identity file (pool, agent id, cluster, broker URL, loss limit, and the
/// pool's slots and max walltime, which also caps the default walltime), then
/// `state_dir` layered over it, and fills an empty agent id with the short
/// host name `hostname`.
///
/// # Errors
/// [`ConfigError::Invalid`] (origin: the config file) listing every
/// problem: an unreadable config or identity file, each key of either
/// that is unknown, of the wrong type or missing (identity problems are
/// prefixed with the identity file's path), each value problem, and a host
/// name that cannot be the agent id.
pub fn load_settings(
    config: &Path,
    identity: Option<&Path>,
    state_dir: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    hostname: &str,
) -> Result<AgentConfig, ConfigError> {
    let origin = config.display().to_string();
    let mut problems = Vec::new();
    let mut overrides = env_overrides(AgentConfig::ENV_PREFIX, env);
    let mut pool_max_walltime = None;
    if let Some(path) = identity {
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| vec![format!("cannot be read: {e}")])
            .and_then(|text| parse_identity(&text));
        match parsed {
            Ok(id) => {
                overrides.insert("pool".into(), id.pool.into());
                overrides.insert("agent_id".into(), id.agent_id.into());
                if let Some(c) = id.cluster {
                    overrides.insert("cluster".into(), c.into());
                }
                if let Some(n) = id.loss_limit {
                    overrides.insert("loss_limit".into(), i64::from(n).into());
                }
                if let Some(n) = id.slots {
                    overrides.insert("slots".into(), i64::from(n).into());
                }
                if let Some(max) = id.max_walltime_secs {
                    pool_max_walltime = Some(max);
                    overrides.insert("max_walltime_secs".into(), toml_int(max));
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
            Err(ps) => problems.extend(
                ps.into_iter()
                    .map(|p| format!("identity file {}: {p}", path.display())),
            ),
        }
    }
    if let Some(dir) = state_dir {
        overrides.insert(
            "state_dir".into(),
            dir.to_string_lossy().into_owned().into(),
        );
    }
    let checked = std::fs::read_to_string(config)
        .map_err(|e| vec![format!("{origin}: cannot be read: {e}")])
        .and_then(|text| {
            if let Some(max) = pool_max_walltime {
                cap_default_walltime(&text, &mut overrides, max);
            }
            parse_checked::<AgentConfig>(&origin, &text, overrides).map_err(|e| match e {
                ConfigError::Invalid { problems, .. } => problems,
                other => vec![other.to_string()],
            })
        });
    let mut cfg = match checked {
        Ok(c) => {
            problems.extend(c.problems);
            c.config
        }
        Err(ps) => {
            problems.extend(ps);
            return Err(ConfigError::Invalid { origin, problems });
        }
    };
    // An agent_id with a problem of its own is not replaced by the host name.
    let id_listed = problems.iter().any(|p| p.starts_with("agent_id:"));
    if cfg.agent_id.is_empty() && !id_listed {
        let short = hostname.split('.').next().unwrap_or_default();
        if valid_name(short) {
            cfg.agent_id = short.to_string();
        } else {
            problems.push(format!(
                "agent_id: empty and the host name {hostname:?} is not a valid agent id; set agent_id"
            ));
        }
    }
    if problems.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError::Invalid { origin, problems })
    }
}

fn toml_int(n: u64) -> toml::Value {
    toml::Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// Caps the `default_walltime_secs` of the config `text` with `overrides`
/// over it (else [`AgentConfig`]'s default) to the pool's walltime maximum
/// `max` from the identity file: a job without a walltime must be one the
/// pool accepts, whatever the image's config says. A value that is no
/// integer is left for the config check to report.
fn cap_default_walltime(text: &str, overrides: &mut toml::Table, max: u64) {
    let key = "default_walltime_secs";
    let from_file = text
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get(key).cloned());
    let given = overrides.get(key).cloned().or(from_file);
    let default = match given {
        None => AgentConfig::default().default_walltime_secs,
        Some(toml::Value::Integer(n)) => u64::try_from(n).unwrap_or(0),
        Some(_) => return,
    };
    if default > max {
        overrides.insert(key.into(), toml_int(max));
    }
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

    /// An agent booted by the controller runs its pool's `slots` and
    /// `max_walltime_secs`, whatever the image's config says, and its
    /// default walltime fits under that maximum.
    #[test]
    fn the_pools_slots_and_max_walltime_from_the_identity_win_and_cap_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let cfg_path = dir.path().join("a.toml");
        let id_path = dir.path().join("id.toml");
        let load = |config: &str, identity: &str| {
            std::fs::write(&cfg_path, config).unwrap();
            std::fs::write(&id_path, identity).unwrap();
            load_settings(&cfg_path, Some(&id_path), None, [], "h")
        };
        let id = "pool = \"cms\"\nagent_id = \"vq-cms-1\"\nslots = 4\nmax_walltime_secs = 3600\n";
        let cfg = load("slots = 2\n", id).unwrap();
        assert_eq!(
            (cfg.slots, cfg.max_walltime_secs, cfg.default_walltime_secs),
            (4, 3600, 3600),
            "the default of 24 h is capped to the pool's 1 h"
        );
        let cfg = load("default_walltime_secs = 600\nmax_walltime_secs = 60\n", id).unwrap();
        assert_eq!(
            (cfg.max_walltime_secs, cfg.default_walltime_secs),
            (3600, 600),
            "a default under the pool's maximum stays"
        );
        let cfg = load("default_walltime_secs = 7200\n", id).unwrap();
        assert_eq!(cfg.default_walltime_secs, 3600);
        // An identity without them (an older controller): the config's.
        let cfg = load(
            "slots = 2\nmax_walltime_secs = 7200\ndefault_walltime_secs = 7200\n",
            "pool = \"cms\"\nagent_id = \"vq-cms-1\"\n",
        )
        .unwrap();
        assert_eq!(
            (cfg.slots, cfg.max_walltime_secs, cfg.default_walltime_secs),
            (2, 7200, 7200)
        );
        // A bad default is still reported as the config's problem.
        let err = load("default_walltime_secs = \"long\"\n", id).unwrap_err();
        assert!(
            err.to_string()
                .contains("default_walltime_secs: expected an integer"),
            "{err}"
        );
    }

    /// The config's type and value errors, the identity file's and the
    /// host name's come out in one run.
    #[test]
    fn config_identity_and_host_name_problems_come_out_together() {
        let dir = tempfile::tempdir().unwrap();
        let cfg_path = dir.path().join("a.toml");
        std::fs::write(&cfg_path, "slots = \"four\"\nmin_uid = 0\n").unwrap();
        let id_path = dir.path().join("id.toml");
        std::fs::write(&id_path, "pool = 7\nbroker_url = \"amqp://h\"\nzone = 1\n").unwrap();
        let err =
            load_settings(&cfg_path, Some(&id_path), None, [], "bad!host.example.org").unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!("{err}")
        };
        let all = problems.join("\n");
        let id = id_path.display();
        for needle in [
            format!("identity file {id}: pool: expected a string, found the integer 7"),
            format!("identity file {id}: zone: unknown key"),
            format!("identity file {id}: agent_id: missing"),
            "slots: expected an integer, found the string \"four\"".into(),
            "min_uid: 0 would allow jobs as root".into(),
            "agent_id: empty and the host name \"bad!host.example.org\"".into(),
        ] {
            assert!(all.contains(&needle), "{needle} not in:\n{all}");
        }
        // A missing identity file is a problem of the same round.
        let gone = dir.path().join("gone.toml");
        let err = load_settings(&cfg_path, Some(&gone), None, [], "h").unwrap_err();
        let text = err.to_string();
        for needle in [
            format!("identity file {}: cannot be read", gone.display()),
            "slots: expected an integer".into(),
        ] {
            assert!(text.contains(&needle), "{needle} not in {text}");
        }
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
