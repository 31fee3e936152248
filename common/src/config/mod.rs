//! Configuration of the jobagent and the controller: TOML files plus
//! `VQ_*` environment overrides, parsed completely and then validated once so
//! that an operator sees every problem in one run (exit code 64, `EX_USAGE`).
//!
//! Every key is first checked against the JSON Schema of its config type
//! ([`check`], the schemas published in `schemas/`): unknown keys (a
//! misspelt key must not silently fall back to a default) and values of
//! the wrong type are listed with their dotted paths and set aside, the
//! rest is deserialised, and `validate()`'s value problems join the same
//! list. The daemons add their own checks to that round
//! ([`Checked`]: OpenStack credentials, the identity file, the host name)
//! and fail once.
//!
//! * [`broker`]: the broker connection both daemons share ([`BrokerConfig`]);
//! * [`agent`]: the jobagent's config and identity file ([`AgentConfig`],
//!   [`AgentIdentity`], [`SubmitterRules`]);
//! * [`controller`]: the controller's config ([`ControllerConfig`],
//!   [`PoolConfig`], [`OpenStackSection`]);
//! * [`check`]: the per-key walk of a document against a schema.

use std::path::Path;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;

use crate::error::ConfigError;

pub mod agent;
pub mod broker;
pub mod check;
pub mod controller;

pub use agent::{
    AgentConfig, AgentIdentity, SubmitterRules, DEFAULT_MAX_WALLTIME_SECS, MAX_JOB_PIDS,
    MAX_WALLTIME_LIMIT_SECS,
};
pub use broker::BrokerConfig;
pub use controller::{
    ControllerConfig, Microversion, OpenStackSection, PoolConfig, MIN_COMPUTE_MICROVERSION,
};

/// Exit code for a bad configuration (`EX_USAGE` from sysexits.h).
pub const EXIT_CONFIG: i32 = 64;

pub use crate::amqp_url::redact_url;

/// Environment overrides for a config whose variables start with `prefix`
/// ([`Validate::ENV_PREFIX`]: `VQ_AGENT__` for the jobagent,
/// `VQ_CONTROLLER__` for the controller). After the prefix, `__` separates
/// nested keys: `VQ_AGENT__SLOTS=4`, `VQ_CONTROLLER__BROKER__URL=amqps://…`.
/// The prefix names the component so that the `vq` CLI's own variables
/// (`VQ_BROKER_URL`, `VQ_CLUSTER`, `VQ_CONTROLLER_URL`) and unrelated `VQ_*`
/// variables never leak into a daemon's config. Values are parsed as TOML
/// values when they parse (numbers, booleans, arrays), else taken as
/// strings; values of paths and URLs (keys ending in `_file`, `_dir`,
/// `_template`, `_yaml` or `url`) are always strings.
pub fn env_overrides(
    prefix: &str,
    vars: impl IntoIterator<Item = (String, String)>,
) -> toml::Table {
    let mut table = toml::Table::new();
    for (k, v) in vars {
        let Some(rest) = k.strip_prefix(prefix) else {
            continue;
        };
        let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
        if path.iter().any(|s| s.is_empty()) {
            continue;
        }
        let value = if path.last().is_some_and(|k| is_string_key(k)) {
            toml::Value::String(v)
        } else {
            parse_env_value(&v)
        };
        insert_path(&mut table, &path, value);
    }
    table
}

/// Whether an environment override of `key` is always a string, never
/// parsed as a TOML value: file and directory paths and URLs
/// (`VQ_CONTROLLER__BROKER__CERT_FILE=1234` is the file `1234`, not a
/// number).
fn is_string_key(key: &str) -> bool {
    ["_file", "_dir", "_template", "_yaml", "url"]
        .iter()
        .any(|suffix| key.ends_with(suffix))
}

fn parse_env_value(v: &str) -> toml::Value {
    let doc = format!("v = {v}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(v.into())),
        Err(_) => toml::Value::String(v.into()),
    }
}

fn insert_path(table: &mut toml::Table, path: &[String], value: toml::Value) {
    match path {
        [] => {}
        [last] => {
            table.insert(last.clone(), value);
        }
        [first, rest @ ..] => {
            let entry = table
                .entry(first.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            if let toml::Value::Table(t) = entry {
                insert_path(t, rest, value);
            }
        }
    }
}

pub(crate) fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// A config type that can be loaded with [`load`]: deserialisable, with a
/// JSON Schema (the one published in `schemas/`, against which every key
/// is checked before deserialising) and a value check.
pub trait Validate: DeserializeOwned + JsonSchema + Default {
    /// Prefix of this config's environment overrides (see [`env_overrides`]).
    const ENV_PREFIX: &'static str;
    /// Lists every problem with the values, each starting with its key.
    fn check(&self) -> Result<(), Vec<String>>;
}

impl Validate for AgentConfig {
    const ENV_PREFIX: &'static str = "VQ_AGENT__";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
}

impl Validate for ControllerConfig {
    const ENV_PREFIX: &'static str = "VQ_CONTROLLER__";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
}

/// A config read as far as it goes: every problem of the document, and
/// the config built from the keys that fit (the others at their
/// defaults), so that a caller can add its own checks of the same round
/// (OpenStack credentials, the identity file) before failing once.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked<T> {
    /// The config; meaningful only as far as `problems` allows.
    pub config: T,
    /// Every problem, one line each, starting with the key's dotted path:
    /// unknown keys, values of the wrong type, then value problems.
    pub problems: Vec<String>,
}

impl<T> Checked<T> {
    /// The config if there is no problem.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] with every problem, attributed to `origin`.
    pub fn into_result(self, origin: &str) -> Result<T, ConfigError> {
        if self.problems.is_empty() {
            Ok(self.config)
        } else {
            Err(ConfigError::Invalid {
                origin: origin.into(),
                problems: self.problems,
            })
        }
    }
}

/// The JSON Schema of `T` as JSON (schemars' draft 2020-12 output).
fn schema_of<T: JsonSchema>() -> serde_json::Value {
    schemars::schema_for!(T).as_value().clone()
}

/// Checks `doc` against `T`'s schema and deserialises what fits: the
/// problems of the keys that do not fit go to `problems` (and their paths
/// to the returned list), the keys themselves are removed first. `None`
/// if `doc` cannot make a `T` even so (a required key is missing).
fn check_and_deserialize<T: DeserializeOwned + JsonSchema>(
    doc: toml::Table,
    problems: &mut Vec<String>,
) -> (Option<T>, Vec<String>) {
    let mut doc = toml::Value::Table(doc);
    let mut found = Vec::new();
    let fits = check::prune(&schema_of::<T>(), &mut doc, &mut found);
    problems.extend(found.iter().map(ToString::to_string));
    let bad = found.into_iter().map(|p| p.path).collect();
    let value = match doc.try_into::<T>() {
        Ok(v) => Some(v),
        // The schema walk let through what serde refuses: say so rather
        // than lose it (a missing key is already listed).
        Err(e) if fits => {
            problems.push(e.to_string().trim().to_string());
            None
        }
        Err(_) => None,
    };
    (value, bad)
}

/// Whether `problem` (`"<path>: …"` or `"<path>.<key>: …"`) is about a key
/// under one of the `bad` paths, whose value was replaced by its default.
fn under_bad_key(problem: &str, bad: &[String]) -> bool {
    bad.iter().any(|b| {
        problem.strip_prefix(b.as_str()).is_some_and(|rest| {
            rest.starts_with(':') || rest.starts_with('.') || rest.starts_with('[')
        })
    })
}

/// Parses TOML `text` (from `origin`, for messages) with `overrides` merged
/// over it, checks every key against `T`'s schema (unknown keys, values of
/// the wrong type, each with its dotted path), deserialises the keys that
/// fit and validates the values. Does no I/O beyond what `T::check` does
/// (the TLS file checks).
///
/// # Errors
/// [`ConfigError::Invalid`] only for a document that is not TOML at all
/// (its syntax error is the one problem); everything else is in
/// [`Checked::problems`].
pub fn parse_checked<T: Validate>(
    origin: &str,
    text: &str,
    overrides: toml::Table,
) -> Result<Checked<T>, ConfigError> {
    let mut table: toml::Table =
        text.parse()
            .map_err(|e: toml::de::Error| ConfigError::Invalid {
                origin: origin.into(),
                problems: vec![e.to_string().trim().to_string()],
            })?;
    merge(&mut table, overrides);
    let mut problems = Vec::new();
    let (config, bad) = check_and_deserialize::<T>(table, &mut problems);
    let config = match config {
        Some(cfg) => {
            if let Err(values) = cfg.check() {
                problems.extend(values.into_iter().filter(|p| !under_bad_key(p, &bad)));
            }
            cfg
        }
        None => T::default(),
    };
    Ok(Checked { config, problems })
}

/// [`parse_checked`], failing on any problem.
///
/// # Errors
/// [`ConfigError::Invalid`] listing every unknown key, type error and value
/// problem.
pub fn parse<T: Validate>(
    origin: &str,
    text: &str,
    overrides: toml::Table,
) -> Result<T, ConfigError> {
    parse_checked(origin, text, overrides)?.into_result(origin)
}

/// Reads the TOML file at `path` (a missing file is an error), applies the
/// process's `VQ_*` overrides and checks it as [`parse_checked`] does.
///
/// # Errors
/// [`ConfigError::Read`] if the file cannot be read, else as
/// [`parse_checked`].
pub fn load_checked<T: Validate>(path: &Path) -> Result<Checked<T>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_checked(
        &path.display().to_string(),
        &text,
        env_overrides(T::ENV_PREFIX, std::env::vars()),
    )
}

/// [`load_checked`], failing on any problem.
///
/// # Errors
/// [`ConfigError::Read`] if the file cannot be read, else as [`parse`].
pub fn load<T: Validate>(path: &Path) -> Result<T, ConfigError> {
    load_checked(path)?.into_result(&path.display().to_string())
}

/// Parses an identity file's `text` ([`AgentIdentity`]) with the same
/// per-key check as a config: every unknown key, value of the wrong type
/// and missing key is listed.
///
/// # Errors
/// Every problem, one line each, starting with the key (a TOML syntax
/// error is the one problem).
pub fn parse_identity(text: &str) -> Result<AgentIdentity, Vec<String>> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| vec![e.to_string().trim().to_string()])?;
    let mut problems = Vec::new();
    let (id, _) = check_and_deserialize::<AgentIdentity>(table, &mut problems);
    match id {
        Some(id) if problems.is_empty() => Ok(id),
        _ => Err(problems),
    }
}

/// Reads an identity file (`/etc/vq/identity.toml`).
///
/// # Errors
/// [`ConfigError::Read`] or [`ConfigError::Invalid`] with every problem of
/// [`parse_identity`].
pub fn load_identity(path: &Path) -> Result<AgentIdentity, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_identity(&text).map_err(|problems| ConfigError::Invalid {
        origin: path.display().to_string(),
        problems,
    })
}

/// JSON Schemas of the config files, as `(file name, pretty JSON)`, for
/// `schemas/` beside the message schemas: `controller-config.schema.json`
/// (`/etc/vq/controller.toml`), `agent-config.schema.json`
/// (`/etc/vq/jobagent.toml`) and `agent-identity.schema.json`
/// (`/etc/vq/identity.toml`). A TOML file is valid when its JSON form is,
/// and every key is checked against these before deserialising.
pub fn json_schemas() -> Vec<(&'static str, String)> {
    fn one<T: JsonSchema>(name: &'static str) -> (&'static str, String) {
        (
            name,
            serde_json::to_string_pretty(&schemars::schema_for!(T)).expect("schema serializes")
                + "\n",
        )
    }
    vec![
        one::<ControllerConfig>("controller-config.schema.json"),
        one::<AgentConfig>("agent-config.schema.json"),
        one::<AgentIdentity>("agent-identity.schema.json"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_is_listed_at_once() {
        let err = parse::<ControllerConfig>(
            "test",
            r#"
            cluster = "a.b"
            listen = "nowhere"
            colour = "blue"
            [pools.cms]
            flavor = "m1.small"
            min = 5
            max = 2
            slotz = 3
            "#,
            toml::Table::new(),
        )
        .unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "colour: unknown",
            "pools.cms.slotz: unknown",
            "cluster:",
            "listen:",
            "pools.cms.image: missing",
            "min 5 is greater than max 2",
            "agent_broker_url: missing",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
    }

    #[test]
    fn env_overrides_reach_nested_keys() {
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                (
                    "VQ_AGENT__BROKER__URL".to_string(),
                    "amqp://x:y@h:1/v".to_string(),
                ),
                ("VQ_AGENT__SLOTS".to_string(), "4".to_string()),
                ("VQ_AGENT__POOL".to_string(), "cms".to_string()),
                (
                    "VQ_BROKER_URL".to_string(),
                    "amqp://cli:only@h:1/v".to_string(),
                ),
                ("VQ_JOBAGENT_BIN".to_string(), "/x".to_string()),
                ("HOME".to_string(), "/root".to_string()),
            ],
        );
        let cfg: AgentConfig = parse("t", "", over).unwrap();
        assert_eq!(cfg.broker.url, "amqp://x:y@h:1/v");
        assert_eq!(cfg.slots, 4);
        assert_eq!(cfg.pool, "cms");
    }
}
