//! Broker TLS: every rule and check of the `ca_file`, `cert_file` and
//! `key_file` of a broker connection ([`TlsFiles`], borrowed from
//! [`BrokerConfig`](crate::config::BrokerConfig) or built by a caller), in
//! one place:
//!
//! * [`file_problems`]: for configuration validation, so that
//!   `--check-config` and a daemon's start report every unusable file
//!   together with all other problems (exit 64): the pairing and
//!   amqps-only rules, the files readable and PEM, the key unencrypted and
//!   mode 0600; with feature `amqp` also parsed with rustls and matched
//!   ([`material_problems`]);
//! * (feature `amqp`) [`connection_tls`]: for [`crate::amqp::connect`], the
//!   same rules and parsing before any network I/O (so a file replaced
//!   after the start is still reported by name), giving the TLS the
//!   connection uses;
//! * (feature `amqp`) [`load_ca`], [`load_identity`], [`client_config`]:
//!   the rustls parsing and configuration both rely on.
//!
//! With `ca_file` set, its certificates are the only trust anchors: the
//! connection is made with a rustls configuration built here, not with
//! lapin's default one, which adds `ca_file` to the system roots
//! (tcp-stream with `rustls-native-certs`). Without `ca_file` lapin's
//! default is kept: the system roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` or the
//! OS store).

use std::path::{Path, PathBuf};

use crate::amqp_url::redact_url;

#[cfg(feature = "amqp")]
mod material;

#[cfg(feature = "amqp")]
pub use material::{
    client_config, connection_tls, load_ca, load_identity, material_problems, ConnectionTls,
};

/// The TLS settings of one broker connection.
#[derive(Debug, Clone, Copy)]
pub struct TlsFiles<'a> {
    /// The broker URL (`amqp://` or `amqps://`).
    pub url: &'a str,
    /// `ca_file`: the PEM CA certificate(s), the only roots when set.
    pub ca_file: Option<&'a Path>,
    /// `cert_file`: the PEM client certificate chain.
    pub cert_file: Option<&'a Path>,
    /// `key_file`: the PEM private key of `cert_file`.
    pub key_file: Option<&'a Path>,
}

/// A TLS file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} {}: {problem}", path.display())]
pub struct TlsFileError {
    /// Config key of the file at fault: `ca_file`, `cert_file` or
    /// `key_file`.
    pub key: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What is wrong, worded to follow the path.
    pub problem: String,
}

/// Problems of the TLS files of `files` for configuration validation, each
/// `"<prefix>.<key>: …"`: `ca_file` only with amqps:// and holding a PEM
/// certificate, the client pair set together, with amqps:// only, both
/// readable PEM files and the key unencrypted and mode 0600; with feature
/// `amqp`, the files that passed are also parsed and matched
/// ([`material_problems`]).
pub fn file_problems(files: TlsFiles<'_>, prefix: &str, out: &mut Vec<String>) {
    let mut ca_ok = false;
    if let Some(ca) = files.ca_file {
        if ca.as_os_str().is_empty() {
            out.push(format!(
                "{prefix}.ca_file: is empty (remove the key to use the system roots)"
            ));
        } else if !ca.is_file() {
            out.push(format!(
                "{prefix}.ca_file: {} does not exist or is not a file",
                ca.display()
            ));
        } else {
            match std::fs::read(ca) {
                Err(e) => out.push(format!(
                    "{prefix}.ca_file: cannot read {}: {e}",
                    ca.display()
                )),
                Ok(text) if !contains(&text, b"-----BEGIN CERTIFICATE-----") => out.push(format!(
                    "{prefix}.ca_file: {} holds no PEM certificate \
                         (-----BEGIN CERTIFICATE-----)",
                    ca.display()
                )),
                Ok(_) => ca_ok = true,
            }
        }
        if !files.url.starts_with("amqps://") {
            out.push(format!(
                "{prefix}.ca_file: only used with an amqps:// url, not {:?} \
                 (use amqps:// or remove ca_file)",
                redact_url(files.url)
            ));
        }
    }
    let pair_ok = client_cert_problems(files, prefix, out);
    #[cfg(feature = "amqp")]
    material_problems(files, prefix, ca_ok, pair_ok, out);
    #[cfg(not(feature = "amqp"))]
    let _ = (ca_ok, pair_ok);
}

/// Problems of `cert_file`/`key_file`: both or neither, amqps only, and
/// both readable PEM files, the key unencrypted and mode 0600. Returns
/// whether both files passed these checks, so that (feature `amqp`)
/// `material_problems` parses them and checks that they belong together,
/// as `connection_tls` does when connecting.
fn client_cert_problems(files: TlsFiles<'_>, prefix: &str, out: &mut Vec<String>) -> bool {
    match (files.cert_file, files.key_file) {
        (None, None) => return false,
        (Some(_), None) => out.push(format!(
            "{prefix}.key_file: missing (cert_file is set; set both or neither)"
        )),
        (None, Some(_)) => out.push(format!(
            "{prefix}.cert_file: missing (key_file is set; set both or neither)"
        )),
        (Some(_), Some(_)) => {}
    }
    if !files.url.starts_with("amqps://") {
        out.push(format!(
            "{prefix}.cert_file/key_file: client certificates need an amqps:// url, not {:?}",
            redact_url(files.url)
        ));
    }
    let mut empty = false;
    for (key, path) in [("cert_file", files.cert_file), ("key_file", files.key_file)] {
        if path.is_some_and(|p| p.as_os_str().is_empty()) {
            out.push(format!("{prefix}.{key}: is empty"));
            empty = true;
        }
    }
    if empty {
        return false;
    }
    let both = files.cert_file.is_some() && files.key_file.is_some();
    let before = out.len();
    if let Some(cert) = files.cert_file {
        match std::fs::read(cert) {
            Err(e) => out.push(format!(
                "{prefix}.cert_file: cannot read {}: {e}",
                cert.display()
            )),
            Ok(text) if !contains(&text, b"-----BEGIN CERTIFICATE-----") => out.push(format!(
                "{prefix}.cert_file: {} holds no PEM certificate \
                     (-----BEGIN CERTIFICATE-----)",
                cert.display()
            )),
            Ok(_) => {}
        }
    }
    if let Some(key) = files.key_file {
        match std::fs::read(key) {
            Err(e) => out.push(format!(
                "{prefix}.key_file: cannot read {}: {e}",
                key.display()
            )),
            Ok(text)
                if contains(&text, b"ENCRYPTED PRIVATE KEY")
                    || contains(&text, b"Proc-Type: 4,ENCRYPTED") =>
            {
                out.push(format!(
                    "{prefix}.key_file: {} is encrypted; give an unencrypted PEM key \
                     (e.g. `openssl pkey -in old.key -out new.key`) protected by mode 0600",
                    key.display()
                ))
            }
            Ok(text) if !contains(&text, b"PRIVATE KEY-----") => out.push(format!(
                "{prefix}.key_file: {} holds no PEM private key (-----BEGIN PRIVATE KEY-----)",
                key.display()
            )),
            Ok(_) => {
                if let Some(mode) = loose_mode(key) {
                    out.push(format!(
                        "{prefix}.key_file: {} has mode {mode:04o}, readable or writable by \
                         group or others; make it 0600 (chmod 600) and owned by the user the \
                         daemon runs as (root for the jobagent)",
                        key.display()
                    ));
                }
            }
        }
    }
    both && out.len() == before
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The permission bits of `path` if any group or other bit is set.
#[cfg(unix)]
fn loose_mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    (mode & 0o077 != 0).then_some(mode)
}

#[cfg(not(unix))]
fn loose_mode(_path: &Path) -> Option<u32> {
    None
}
