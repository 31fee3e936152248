//! Where the CLI connects: flags, `VQ_*` environment variables, a TOML config
//! file, then built-in defaults, in that order of precedence.
//!
//! The config file is `--config PATH` if given, else
//! `$XDG_CONFIG_HOME/vq/vq.toml` (default `~/.config/vq/vq.toml`) if it
//! exists. Keys:
//!
//! ```toml
//! broker_url = "amqps://alice:secret@mq.example.org:5671/%2f"
//! cluster = "vq"
//! controller_url = "http://vq-controller.example.org:9180"
//! broker_ca_file = "/etc/vq/ca.pem"   # optional, amqps with a private CA
//! ```
//!
//! The broker URL holds a password: prefer the config file (mode 0600) or
//! `VQ_BROKER_URL` over `--broker-url`, which other users see in `ps`.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use vq_common::config::{redact_url, BrokerConfig};
use vq_common::topology::{valid_name, DEFAULT_CLUSTER};

use crate::error::CliError;

/// Default broker URL (a local RabbitMQ with the guest account).
pub const DEFAULT_BROKER_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Default controller status URL.
pub const DEFAULT_CONTROLLER_URL: &str = "http://127.0.0.1:9180";

/// Contents of the CLI config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// AMQP URI of the broker.
    pub broker_url: Option<String>,
    /// Cluster name.
    pub cluster: Option<String>,
    /// Base URL of the controller's HTTP server.
    pub controller_url: Option<String>,
    /// PEM CA bundle for `amqps://` brokers with a private CA.
    pub broker_ca_file: Option<PathBuf>,
}

/// Values given by flags or environment variables (`None` = not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--broker-url` / `VQ_BROKER_URL`.
    pub broker_url: Option<String>,
    /// `--cluster` / `VQ_CLUSTER`.
    pub cluster: Option<String>,
    /// `--controller` / `VQ_CONTROLLER_URL`.
    pub controller_url: Option<String>,
}

/// Resolved settings of one `vq` run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Broker connection (timeouts are the library defaults).
    pub broker: BrokerConfig,
    /// Cluster name.
    pub cluster: String,
    /// Controller base URL, without a trailing `/`.
    pub controller_url: String,
}

impl Settings {
    /// Combines `overrides` (flags and environment) with `file` and the
    /// defaults, then validates: the broker URL must be `amqp://` or
    /// `amqps://`, the cluster a valid name, the controller URL `http(s)://`.
    ///
    /// # Errors
    /// [`CliError::Config`] listing every problem.
    pub fn resolve(
        overrides: Overrides,
        file: FileConfig,
        origin: Option<&Path>,
    ) -> Result<Settings, CliError> {
        let mut broker = BrokerConfig {
            url: overrides
                .broker_url
                .or(file.broker_url)
                .unwrap_or_else(|| DEFAULT_BROKER_URL.into()),
            ca_file: file.broker_ca_file,
            ..BrokerConfig::default()
        };
        // A CLI waits less than a daemon before saying "unavailable".
        broker.connect_timeout_secs = 10;
        let cluster = overrides
            .cluster
            .or(file.cluster)
            .unwrap_or_else(|| DEFAULT_CLUSTER.into());
        let controller_url = overrides
            .controller_url
            .or(file.controller_url)
            .unwrap_or_else(|| DEFAULT_CONTROLLER_URL.into())
            .trim_end_matches('/')
            .to_string();
        let mut problems = Vec::new();
        if !(broker.url.starts_with("amqp://") || broker.url.starts_with("amqps://")) {
            problems.push(format!(
                "broker_url: {:?} is not an amqp:// or amqps:// URI",
                redact_url(&broker.url)
            ));
        } else if let Err(e) = vq_common::amqp::parse_url(&broker.url) {
            problems.push(format!(
                "broker_url: {:?} cannot be parsed: {e}",
                redact_url(&broker.url)
            ));
        }
        if !valid_name(&cluster) {
            problems.push(format!(
                "cluster: {cluster:?} is not 1-64 characters of a-z A-Z 0-9 _ -"
            ));
        }
        if !(controller_url.starts_with("http://") || controller_url.starts_with("https://")) {
            problems.push(format!(
                "controller_url: {controller_url:?} is not an http:// or https:// URL"
            ));
        }
        if problems.is_empty() {
            Ok(Settings {
                broker,
                cluster,
                controller_url,
            })
        } else {
            Err(CliError::Config {
                origin: origin.map(|p| p.display().to_string()),
                problem: problems.join("; "),
            })
        }
    }

    /// The broker user name in the URL (percent-decoded), `guest` when the
    /// URL has none ([`vq_common::amqp::broker_user`]). Sent as the AMQP
    /// `user_id`, which the broker checks against the authenticated user.
    pub fn broker_user(&self) -> String {
        vq_common::amqp::broker_user(&self.broker.url)
    }
}

/// Parses a config file's text.
///
/// # Errors
/// [`CliError::Config`] naming `origin`.
pub fn parse_file(text: &str, origin: &Path) -> Result<FileConfig, CliError> {
    toml::from_str(text).map_err(|e| CliError::Config {
        origin: Some(origin.display().to_string()),
        problem: e.message().to_string(),
    })
}

/// Loads the config file: `explicit` must exist; otherwise `default_path`
/// is read if it exists. Returns the config and the path read.
///
/// # Errors
/// [`CliError::Read`] or [`CliError::Config`].
pub fn load_file(
    explicit: Option<&Path>,
    default_path: Option<PathBuf>,
) -> Result<(FileConfig, Option<PathBuf>), CliError> {
    let path = match (explicit, default_path) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(p)) if p.is_file() => p,
        _ => return Ok((FileConfig::default(), None)),
    };
    let text = std::fs::read_to_string(&path).map_err(|source| CliError::Read {
        path: path.display().to_string(),
        source,
    })?;
    Ok((parse_file(&text, &path)?, Some(path)))
}

/// `$XDG_CONFIG_HOME/vq/vq.toml`, else `$HOME/.config/vq/vq.toml`.
pub fn default_config_path(xdg_config_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    match (xdg_config_home.filter(|s| !s.is_empty()), home) {
        (Some(x), _) => Some(Path::new(x).join("vq/vq.toml")),
        (None, Some(h)) if !h.is_empty() => Some(Path::new(h).join(".config/vq/vq.toml")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_which_beats_the_defaults() {
        let file = parse_file(
            "broker_url = \"amqp://alice:pw@mq:5672/%2f\"\ncluster = \"farm\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let s = Settings::resolve(
            Overrides {
                cluster: Some("other".into()),
                ..Default::default()
            },
            file,
            None,
        )
        .unwrap();
        assert_eq!(s.cluster, "other");
        assert_eq!(s.broker.url, "amqp://alice:pw@mq:5672/%2f");
        assert_eq!(s.broker_user(), "alice");
        assert_eq!(s.controller_url, DEFAULT_CONTROLLER_URL);
    }

    #[test]
    fn the_default_broker_user_is_guest() {
        let s = Settings::resolve(Overrides::default(), FileConfig::default(), None).unwrap();
        assert_eq!(s.broker_user(), "guest");
        assert_eq!(s.cluster, "vq");
    }

    #[test]
    fn bad_values_are_all_reported() {
        let err = Settings::resolve(
            Overrides {
                broker_url: Some("http://x".into()),
                cluster: Some("a.b".into()),
                controller_url: Some("ftp://x".into()),
            },
            FileConfig::default(),
            Some(Path::new("/etc/vq.toml")),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("broker_url")
                && text.contains("cluster")
                && text.contains("controller_url"),
            "{text}"
        );
        assert_eq!(err.exit_code(), 64);
    }

    #[test]
    fn the_packaged_example_config_is_valid() {
        // packaging/vq.example.toml, shipped in the vq package as
        // /usr/share/doc/vq/examples/vq.toml.
        let path = Path::new("vq.example.toml");
        let file = parse_file(include_str!("../../packaging/vq.example.toml"), path).unwrap();
        assert_eq!(file.cluster.as_deref(), Some("vq"));
        let s = Settings::resolve(Overrides::default(), file, Some(path)).unwrap();
        assert_eq!(s.broker_user(), "alice");
        assert_eq!(s.controller_url, "http://vq-controller.example.org:9180");
    }

    #[test]
    fn unknown_file_keys_are_refused() {
        assert!(parse_file("brokr_url = \"x\"", Path::new("t")).is_err());
    }

    #[test]
    fn the_default_path_follows_xdg() {
        assert_eq!(
            default_config_path(Some("/x"), Some("/h")),
            Some(PathBuf::from("/x/vq/vq.toml"))
        );
        assert_eq!(
            default_config_path(None, Some("/h")),
            Some(PathBuf::from("/h/.config/vq/vq.toml"))
        );
        assert_eq!(default_config_path(None, None), None);
    }
}
