//! Broker TLS material (feature `amqp`): `ca_file`, `cert_file` and
//! `key_file` of [`BrokerConfig`] read and checked with the rustls that
//! lapin uses, and the rustls client configuration of a connection whose
//! `ca_file` is set.
//!
//! The same functions serve configuration validation (so `--check-config`
//! and a daemon's start report every unusable file together with all other
//! problems, exit 64) and [`crate::amqp::connect`] (so a file replaced
//! after the start is still reported by name).
//!
//! With `ca_file` set, its certificates are the only trust anchors: the
//! connection is made with a rustls configuration built here, not with
//! lapin's default one, which adds `ca_file` to the system roots
//! (tcp-stream with `rustls-native-certs`). Without `ca_file` lapin's
//! default is kept: the system roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` or the
//! OS store).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{PemObject, SectionKind};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::BrokerConfig;

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

impl TlsFileError {
    fn new(key: &'static str, path: &Path, problem: impl Into<String>) -> Self {
        TlsFileError {
            key,
            path: path.to_path_buf(),
            problem: problem.into(),
        }
    }
}

/// Every PEM section of `path` (kind and DER), or an error naming the file.
fn pem_sections(
    key: &'static str,
    path: &Path,
) -> Result<Vec<(SectionKind, Vec<u8>)>, TlsFileError> {
    let text = std::fs::read(path)
        .map_err(|e| TlsFileError::new(key, path, format!("cannot be read: {e}")))?;
    <(SectionKind, Vec<u8>)>::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsFileError::new(key, path, format!("is not valid PEM: {e}")))
}

fn kind_name(kind: SectionKind) -> &'static str {
    match kind {
        SectionKind::Certificate => "a certificate",
        SectionKind::PublicKey => "a public key",
        SectionKind::RsaPrivateKey | SectionKind::PrivateKey | SectionKind::EcPrivateKey => {
            "a private key"
        }
        SectionKind::Crl => "a certificate revocation list",
        SectionKind::Csr => "a certificate request",
        SectionKind::EchConfigList => "an ECH configuration",
        _ => "something else",
    }
}

/// What a file without the wanted section holds instead, for messages.
fn holds_instead(sections: &[(SectionKind, Vec<u8>)]) -> String {
    match sections.first() {
        None => "no PEM section at all".into(),
        Some((kind, _)) => format!("only {}", kind_name(*kind)),
    }
}

/// Reads `ca_file`: at least one PEM certificate that can be a trust anchor.
///
/// # Errors
/// [`TlsFileError`] naming the file: unreadable, not PEM, no certificate
/// (an empty file, a key), or no certificate rustls can use.
pub fn load_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    const KEY: &str = "ca_file";
    let sections = pem_sections(KEY, path)?;
    let certs: Vec<CertificateDer<'static>> = sections
        .iter()
        .filter(|(k, _)| *k == SectionKind::Certificate)
        .map(|(_, der)| CertificateDer::from(der.clone()))
        .collect();
    if certs.is_empty() {
        return Err(TlsFileError::new(
            KEY,
            path,
            format!(
                "holds no PEM certificate (-----BEGIN CERTIFICATE-----), {}",
                holds_instead(&sections)
            ),
        ));
    }
    let mut store = rustls::RootCertStore::empty();
    let (_, ignored) = store.add_parsable_certificates(certs.iter().cloned());
    if store.is_empty() {
        return Err(TlsFileError::new(
            KEY,
            path,
            format!(
                "holds {ignored} certificate(s), none of them usable as a CA (not valid X.509)"
            ),
        ));
    }
    Ok(certs)
}

/// Whether the DER certificate `der` is X.509 version 1: its
/// `tbsCertificate` does not start with the explicit `[0]` version tag.
fn is_x509_v1(der: &[u8]) -> bool {
    // Skips a DER tag-length header, returning the content.
    fn content(b: &[u8]) -> Option<&[u8]> {
        let (&tag, rest) = b.split_first()?;
        if tag != 0x30 {
            return None;
        }
        let (&len, rest) = rest.split_first()?;
        let skip = if len & 0x80 == 0 {
            0
        } else {
            usize::from(len & 0x7f)
        };
        rest.get(skip..)
    }
    let Some(tbs) = content(der).and_then(content) else {
        return false;
    };
    tbs.first().is_some_and(|&t| t != 0xa0)
}

/// Reads `cert_file` and `key_file` and checks them as rustls will: at
/// least one certificate, the first one a certificate rustls accepts
/// (X.509 v3), a private key rustls can load, and the key belonging to the
/// first certificate.
///
/// # Errors
/// [`TlsFileError`] naming the file at fault.
pub fn load_identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsFileError> {
    let cert_err = |p: String| TlsFileError::new("cert_file", cert, p);
    let key_err = |p: String| TlsFileError::new("key_file", key, p);
    let sections = pem_sections("cert_file", cert)?;
    let chain: Vec<CertificateDer<'static>> = sections
        .iter()
        .filter(|(k, _)| *k == SectionKind::Certificate)
        .map(|(_, der)| CertificateDer::from(der.clone()))
        .collect();
    if chain.is_empty() {
        return Err(cert_err(format!(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----), {}",
            holds_instead(&sections)
        )));
    }
    if is_x509_v1(&chain[0]) {
        return Err(cert_err(
            "holds an X.509 version 1 certificate, which rustls refuses: re-issue it as v3, \
             with extensions (e.g. `openssl x509 -req ... -extfile client.ext` where client.ext \
             holds `basicConstraints = CA:FALSE` and `extendedKeyUsage = clientAuth`)"
                .into(),
        ));
    }
    let key_sections = pem_sections("key_file", key)?;
    let key_der = key_sections
        .into_iter()
        .find_map(|(kind, der)| match kind {
            SectionKind::PrivateKey => Some(PrivateKeyDer::Pkcs8(der.into())),
            SectionKind::RsaPrivateKey => Some(PrivateKeyDer::Pkcs1(der.into())),
            SectionKind::EcPrivateKey => Some(PrivateKeyDer::Sec1(der.into())),
            _ => None,
        })
        .ok_or_else(|| {
            key_err(
                "holds no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----, \
                 RSA PRIVATE KEY or EC PRIVATE KEY)"
                    .into(),
            )
        })?;
    let provider = rustls::crypto::ring::default_provider();
    match rustls::sign::CertifiedKey::from_der(chain.clone(), key_der.clone_key(), &provider) {
        Ok(_) => Ok((chain, key_der)),
        Err(rustls::Error::InconsistentKeys(_)) => Err(key_err(format!(
            "does not match the certificate in {} (a key of another certificate, or of \
             another type: e.g. an EC key with an RSA certificate)",
            cert.display()
        ))),
        Err(rustls::Error::InvalidCertificate(e)) => Err(cert_err(format!(
            "holds a certificate rustls cannot use: {e}"
        ))),
        Err(e) => Err(key_err(format!("is not a private key rustls can use: {e}"))),
    }
}

/// Problems of the broker's TLS files that only parsing them shows, for
/// configuration validation: `ca_file` if `check_ca`, the client pair if
/// `check_pair`. Each is `"<prefix>.<key>: <path> <problem>"`.
pub fn material_problems(
    cfg: &BrokerConfig,
    prefix: &str,
    check_ca: bool,
    check_pair: bool,
    out: &mut Vec<String>,
) {
    let mut push = |e: TlsFileError| {
        out.push(format!(
            "{prefix}.{}: {} {}",
            e.key,
            e.path.display(),
            e.problem
        ))
    };
    if let (true, Some(ca)) = (check_ca, &cfg.ca_file) {
        if let Err(e) = load_ca(ca) {
            push(e);
        }
    }
    if let (true, Some(cert), Some(key)) = (check_pair, &cfg.cert_file, &cfg.key_file) {
        if let Err(e) = load_identity(cert, key) {
            push(e);
        }
    }
}

/// The rustls client configuration of a connection with `ca_file`: the
/// certificates of `ca` as the only roots, and the client identity if any.
///
/// # Errors
/// [`TlsFileError`] for `ca_file` if rustls refuses the roots, for
/// `cert_file` if it refuses the identity.
pub fn client_config(
    ca_path: &Path,
    ca: Vec<CertificateDer<'static>>,
    identity: Option<(&Path, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<rustls::ClientConfig, TlsFileError> {
    let mut store = rustls::RootCertStore::empty();
    store.add_parsable_certificates(ca);
    if store.is_empty() {
        return Err(TlsFileError::new(
            "ca_file",
            ca_path,
            "holds no certificate usable as a CA",
        ));
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| TlsFileError::new("ca_file", ca_path, format!("TLS setup failed: {e}")))?
    .with_root_certificates(store);
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| TlsFileError::new("cert_file", cert, format!("unusable: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/tls")
            .join(name)
    }

    /// A file in the temporary directory with `text`, removed on drop.
    struct Temp(PathBuf);

    impl Temp {
        fn new(text: &str) -> Temp {
            let path = std::env::temp_dir().join(format!("vq-tls-{}.pem", uuid::Uuid::new_v4()));
            std::fs::write(&path, text).unwrap();
            Temp(path)
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn a_matching_v3_pair_loads() {
        let (chain, _) = load_identity(&data("client-v3.pem"), &data("client.key")).unwrap();
        assert_eq!(chain.len(), 1);
        assert!(!is_x509_v1(&chain[0]));
    }

    #[test]
    fn wrong_keys_are_blamed_on_the_key_file() {
        for key in ["other.key", "ec-sec1.key"] {
            let e = load_identity(&data("client-v3.pem"), &data(key)).unwrap_err();
            assert_eq!(e.key, "key_file", "{key}: {e}");
            assert!(
                e.problem.contains("does not match the certificate in"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_v1_certificate_is_blamed_on_the_certificate() {
        let e = load_identity(&data("client-v1.pem"), &data("client.key")).unwrap_err();
        assert_eq!(e.key, "cert_file", "{e}");
        assert!(e.problem.contains("X.509 version 1"), "{e}");
        assert!(e.problem.contains("-extfile"), "{e}");
    }

    #[test]
    fn garbage_inside_pem_markers_names_the_file() {
        let garbage =
            Temp::new("-----BEGIN CERTIFICATE-----\n!!not base64!!\n-----END CERTIFICATE-----\n");
        let e = load_identity(&garbage.0, &data("client.key")).unwrap_err();
        assert_eq!(
            (e.key, e.path.as_path()),
            ("cert_file", garbage.0.as_path())
        );
        assert!(e.problem.contains("is not valid PEM"), "{e}");
        let e = load_ca(&garbage.0).unwrap_err();
        assert_eq!((e.key, e.path.as_path()), ("ca_file", garbage.0.as_path()));
        // Valid base64 that is not a certificate.
        let junk = Temp::new("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        let e = load_identity(&junk.0, &data("client.key")).unwrap_err();
        assert_eq!(e.key, "cert_file", "{e}");
        let e = load_ca(&junk.0).unwrap_err();
        assert!(e.problem.contains("none of them usable"), "{e}");
        let key_garbage =
            Temp::new("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        let e = load_identity(&data("client-v3.pem"), &key_garbage.0).unwrap_err();
        assert_eq!(e.key, "key_file", "{e}");
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let empty = Temp::new("");
        let e = load_ca(&empty.0).unwrap_err();
        assert!(e.problem.contains("holds no PEM certificate"), "{e}");
        let e = load_ca(&data("client.key")).unwrap_err();
        assert!(e.problem.contains("only a private key"), "{e}");
        assert_eq!(load_ca(&data("client-v3.pem")).unwrap().len(), 1);
        // A v1 CA is still a usable trust anchor.
        assert_eq!(load_ca(&data("client-v1.pem")).unwrap().len(), 1);
        let e = load_ca(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("ca_file /nonexistent/ca.pem: cannot be read"),
            "{e}"
        );
    }

    #[test]
    fn client_config_takes_only_the_given_roots() {
        let ca = load_ca(&data("client-v3.pem")).unwrap();
        let (chain, key) = load_identity(&data("client-v3.pem"), &data("client.key")).unwrap();
        let path = data("client-v3.pem");
        client_config(&path, ca.clone(), None).unwrap();
        let cfg = client_config(&path, ca, Some((&path, chain, key))).unwrap();
        assert!(cfg.client_auth_cert_resolver.has_certs());
    }
}
