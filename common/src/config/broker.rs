//! The broker connection both daemons share: URL, timeouts and the TLS
//! files (whose rules and checks are [`crate::tls`]'s).

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::redact_url;
use crate::tls::TlsFiles;

/// Connection to RabbitMQ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct BrokerConfig {
    /// AMQP URI, `amqp://user:password@host:5672/vhost` or `amqps://…`
    /// (vhost `%2f` for `/`). A `frame_max` query parameter is added when
    /// absent (131072 bytes) because lapin allocates 8 MiB buffers otherwise.
    pub url: String,
    /// PEM file with the CA certificate(s) that sign the broker's
    /// certificate (amqps only; with an `amqp://` url it is a configuration
    /// error). It must hold at least one certificate. When set, these
    /// certificates are the ONLY trust anchors of the connection: the system
    /// roots are not consulted, so a broker certificate from a publicly
    /// trusted CA is refused unless that CA is in the file (vq builds its own
    /// rustls configuration for this; lapin's default would ADD the file to
    /// the system roots). `None` uses the system roots (`SSL_CERT_FILE` /
    /// `SSL_CERT_DIR` or the OS store), for a broker with a publicly trusted
    /// certificate.
    pub ca_file: Option<PathBuf>,
    /// PEM file with this component's client certificate, end-entity first,
    /// then any intermediates (amqps only; set together with `key_file`).
    /// Presented when the broker asks for a peer certificate
    /// (`ssl_options.verify = verify_peer`); the login stays user/password
    /// from `url`. `None`: no client certificate.
    pub cert_file: Option<PathBuf>,
    /// PEM file with the unencrypted private key of `cert_file` (PKCS#8
    /// `BEGIN PRIVATE KEY`; PKCS#1 RSA and SEC1 EC keys are accepted too).
    /// Must be mode 0600 (no group or other bits), owned by the user the
    /// daemon runs as: root for the jobagent, whose jobs run as other users
    /// on the same machine. A key with group or other permission bits is a
    /// configuration error.
    pub key_file: Option<PathBuf>,
    /// Seconds to wait for one connection attempt.
    pub connect_timeout_secs: u64,
    /// Seconds to wait for a publisher confirm before the publish counts as
    /// failed.
    pub confirm_timeout_secs: u64,
    /// AMQP heartbeat interval requested from the broker, seconds.
    pub heartbeat_secs: u16,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            connect_timeout_secs: 10,
            confirm_timeout_secs: 30,
            heartbeat_secs: 15,
        }
    }
}

impl BrokerConfig {
    pub(crate) fn problems(&self, prefix: &str, out: &mut Vec<String>) {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            out.push(format!(
                "{prefix}.url: {:?} is not an amqp:// or amqps:// URI",
                redact_url(&self.url)
            ));
        }
        if self.connect_timeout_secs == 0 {
            out.push(format!("{prefix}.connect_timeout_secs: must be at least 1"));
        }
        if self.confirm_timeout_secs == 0 {
            out.push(format!("{prefix}.confirm_timeout_secs: must be at least 1"));
        }
        crate::tls::file_problems(self.tls_files(), prefix, out);
    }

    /// The TLS settings of this connection, for [`crate::tls`].
    pub fn tls_files(&self) -> TlsFiles<'_> {
        TlsFiles {
            url: &self.url,
            ca_file: self.ca_file.as_deref(),
            cert_file: self.cert_file.as_deref(),
            key_file: self.key_file.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::*;

    /// A file in the temporary directory with `text` and `mode`, removed
    /// on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str, mode: u32) -> TempFile {
            use std::os::unix::fs::PermissionsExt;
            let path =
                std::env::temp_dir().join(format!("vq-config-{}-{name}", uuid::Uuid::new_v4()));
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    // A real pair (v3 certificate and its key): with feature `amqp` the
    // files are parsed and matched too.
    const CERT: &str = include_str!("../../testdata/tls/client-v3.pem");
    const KEY: &str = include_str!("../../testdata/tls/client.key");

    fn broker_problems(b: &BrokerConfig) -> String {
        let mut p = Vec::new();
        b.problems("broker", &mut p);
        p.join("\n")
    }

    #[test]
    fn client_cert_and_key_go_together_with_amqps_only() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let mut b = BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            cert_file: Some(cert.0.clone()),
            key_file: Some(key.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b), "");
        b.key_file = None;
        assert!(broker_problems(&b).contains("broker.key_file: missing (cert_file is set"));
        b.key_file = Some(key.0.clone());
        b.cert_file = None;
        assert!(broker_problems(&b).contains("broker.cert_file: missing (key_file is set"));
        b.cert_file = Some(cert.0.clone());
        b.url = "amqp://a:b@h:5672/%2f".into();
        let all = broker_problems(&b);
        assert!(all.contains("need an amqps:// url"), "{all}");
        assert!(!all.contains(":b@"), "password in {all}");
    }

    #[test]
    fn client_cert_files_are_read_and_checked_at_start() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let loose = TempFile::new("loose.pem", KEY, 0o640);
        let world = TempFile::new("world.pem", KEY, 0o604);
        let encrypted = TempFile::new(
            "enc.pem",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIE\n-----END ENCRYPTED PRIVATE KEY-----\n",
            0o600,
        );
        let url = "amqps://a:b@h:5671/%2f".to_string();
        let with = |c: &Path, k: &Path| BrokerConfig {
            url: url.clone(),
            cert_file: Some(c.to_path_buf()),
            key_file: Some(k.to_path_buf()),
            ..Default::default()
        };
        let missing = std::env::temp_dir().join("vq-config-no-such-file.pem");
        let all = broker_problems(&with(&missing, &missing));
        for needle in [
            format!("broker.cert_file: cannot read {}: ", missing.display()),
            format!("broker.key_file: cannot read {}: ", missing.display()),
        ] {
            assert!(all.contains(&needle), "{needle} not in:\n{all}");
        }
        // Swapped files.
        let all = broker_problems(&with(&key.0, &cert.0));
        assert!(all.contains("holds no PEM certificate"), "{all}");
        assert!(all.contains("holds no PEM private key"), "{all}");
        for (file, mode) in [(&loose, "0640"), (&world, "0604")] {
            let all = broker_problems(&with(&cert.0, &file.0));
            assert!(
                all.contains(&format!("{} has mode {mode}", file.0.display()))
                    && all.contains("chmod 600"),
                "{all}"
            );
        }
        let all = broker_problems(&with(&cert.0, &encrypted.0));
        assert!(all.contains("is encrypted"), "{all}");
    }

    #[test]
    fn client_cert_env_overrides() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                (
                    "VQ_AGENT__BROKER__URL".to_string(),
                    "amqps://x:y@h:5671/v".to_string(),
                ),
                (
                    "VQ_AGENT__BROKER__CERT_FILE".to_string(),
                    cert.0.display().to_string(),
                ),
                (
                    "VQ_AGENT__BROKER__KEY_FILE".to_string(),
                    key.0.display().to_string(),
                ),
                ("VQ_AGENT__POOL".to_string(), "cms".to_string()),
            ],
        );
        let cfg: AgentConfig = parse("t", "", over).unwrap();
        assert_eq!(cfg.broker.cert_file.as_deref(), Some(cert.0.as_path()));
        assert_eq!(cfg.broker.key_file.as_deref(), Some(key.0.as_path()));
        // The same keys in a file, with every problem listed at once.
        let err = parse::<AgentConfig>(
            "t",
            "pool = \"cms\"\n[broker]\nurl = \"amqp://x:y@h/v\"\ncert_file = \"/nonexistent/c.pem\"\n",
            toml::Table::new(),
        )
        .unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "broker.key_file: missing",
            "need an amqps:// url",
            "broker.cert_file: cannot read /nonexistent/c.pem",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
    }

    #[test]
    fn ca_file_must_hold_a_certificate_and_need_amqps() {
        let ca = TempFile::new("ca.pem", CERT, 0o644);
        let empty = TempFile::new("empty.pem", "", 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let mut b = BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            ca_file: Some(ca.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b), "");
        for file in [&empty, &key] {
            b.ca_file = Some(file.0.clone());
            let all = broker_problems(&b);
            assert!(
                all.contains(&format!(
                    "broker.ca_file: {} holds no PEM certificate",
                    file.0.display()
                )),
                "{all}"
            );
        }
        b.ca_file = Some(ca.0.clone());
        b.url = "amqp://a:b@h:5672/%2f".into();
        let all = broker_problems(&b);
        assert!(
            all.contains("broker.ca_file: only used with an amqps:// url"),
            "{all}"
        );
        assert!(!all.contains(":b@"), "password in {all}");
    }

    #[test]
    fn path_overrides_stay_strings_and_empty_paths_are_named() {
        let over = env_overrides(
            ControllerConfig::ENV_PREFIX,
            [
                (
                    "VQ_CONTROLLER__BROKER__URL".to_string(),
                    "amqps://x:y@h:5671/v".to_string(),
                ),
                (
                    "VQ_CONTROLLER__BROKER__CERT_FILE".to_string(),
                    "1234".to_string(),
                ),
                (
                    "VQ_CONTROLLER__BROKER__KEY_FILE".to_string(),
                    "true".to_string(),
                ),
                ("VQ_CONTROLLER__BROKER__CA_FILE".to_string(), String::new()),
                ("VQ_CONTROLLER__INTERVAL_SECS".to_string(), "5".to_string()),
            ],
        );
        let err = parse::<ControllerConfig>("t", "", over).unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "broker.cert_file: cannot read 1234",
            "broker.key_file: cannot read true",
            "broker.ca_file: is empty",
            // The listing goes on past the broker.
            "pools: no pool configured",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
        assert!(!all.contains("invalid type"), "{all}");
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                ("VQ_AGENT__BROKER__CERT_FILE".to_string(), String::new()),
                ("VQ_AGENT__BROKER__KEY_FILE".to_string(), String::new()),
                ("VQ_AGENT__SLOTS".to_string(), "4".to_string()),
            ],
        );
        let mut p = Vec::new();
        let cfg: AgentConfig = {
            let mut t = toml::Table::new();
            merge(&mut t, over);
            toml::Value::Table(t).try_into().unwrap()
        };
        assert_eq!(cfg.slots, 4);
        cfg.broker.problems("broker", &mut p);
        let all = p.join("\n");
        assert!(
            all.contains("broker.cert_file: is empty") && all.contains("broker.key_file: is empty"),
            "{all}"
        );
        assert!(!all.contains("cannot read"), "{all}");
    }

    /// With feature `amqp`, validation parses the files as a connect does.
    #[cfg(feature = "amqp")]
    #[test]
    fn unusable_tls_material_is_a_config_problem() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let v1 = TempFile::new(
            "v1.pem",
            include_str!("../../testdata/tls/client-v1.pem"),
            0o644,
        );
        let other = TempFile::new(
            "other.key",
            include_str!("../../testdata/tls/other.key"),
            0o600,
        );
        let ec = TempFile::new(
            "ec.key",
            include_str!("../../testdata/tls/ec-sec1.key"),
            0o600,
        );
        let key = TempFile::new("key.pem", KEY, 0o600);
        let garbage = TempFile::new(
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\n%%%%\n-----END CERTIFICATE-----\n",
            0o644,
        );
        let b = |ca: Option<&TempFile>, c: &TempFile, k: &TempFile| BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            ca_file: ca.map(|f| f.0.clone()),
            cert_file: Some(c.0.clone()),
            key_file: Some(k.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b(Some(&cert), &cert, &key)), "");
        for k in [&other, &ec] {
            let all = broker_problems(&b(None, &cert, k));
            assert!(
                all.contains(&format!(
                    "broker.key_file: {} does not match the certificate",
                    k.0.display()
                )),
                "{all}"
            );
        }
        let all = broker_problems(&b(None, &v1, &key));
        assert!(
            all.contains(&format!(
                "broker.cert_file: {} holds an X.509 version 1",
                v1.0.display()
            )),
            "{all}"
        );
        assert!(!all.contains("key_file"), "{all}");
        // Garbage in all three at once: every file named.
        let all = broker_problems(&b(Some(&garbage), &garbage, &key));
        for needle in [
            format!("broker.ca_file: {} is not valid PEM", garbage.0.display()),
            format!("broker.cert_file: {} is not valid PEM", garbage.0.display()),
        ] {
            assert!(all.contains(&needle), "{needle} not in:\n{all}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://agent:s3cret@h:5672/%2f"),
            "amqp://agent:***@h:5672/%2f"
        );
        assert_eq!(redact_url("amqp://h:5672"), "amqp://h:5672");
    }
}
