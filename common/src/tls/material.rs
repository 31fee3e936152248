//! The TLS material of a broker connection parsed and checked with the
//! rustls that lapin uses (feature `amqp`): the CA certificates, the client
//! pair, and the rustls client configuration of a connection whose
//! `ca_file` is set. Re-exported by [`crate::tls`].

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::{PemObject, SectionKind};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{TlsFileError, TlsFiles};
use crate::amqp_url::redact_url;

impl TlsFileError {
    fn new(key: &'static str, path: &Path, problem: impl Into<String>) -> Self {
        TlsFileError {
            key,
            path: path.to_path_buf(),
            problem: problem.into(),
        }
    }
}

/// The problem of a client certificate without its key, or a key without
/// its certificate, when connecting.
const PAIR_RULE: &str = "cert_file and key_file must be set together";

/// The bytes of `path`, or an error naming the file.
fn read_pem(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|e| TlsFileError::new(key, path, format!("cannot be read: {e}")))
}

/// Every PEM section of `path` (kind and DER), or an error naming the file.
fn pem_sections(
    key: &'static str,
    path: &Path,
) -> Result<Vec<(SectionKind, Vec<u8>)>, TlsFileError> {
    let text = read_pem(key, path)?;
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
    files: TlsFiles<'_>,
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
    if let (true, Some(ca)) = (check_ca, files.ca_file) {
        if let Err(e) = load_ca(ca) {
            push(e);
        }
    }
    if let (true, Some(cert), Some(key)) = (check_pair, files.cert_file, files.key_file) {
        if let Err(e) = load_identity(cert, key) {
            push(e);
        }
    }
}

/// The TLS of one connection, as [`connection_tls`] settles it.
pub enum ConnectionTls {
    /// `ca_file` is set (amqps): this rustls configuration, the file's
    /// certificates its only roots, with the client identity if any.
    OwnRoots(Box<rustls::ClientConfig>),
    /// No `ca_file`: lapin's default TLS (the system roots) for amqps, or
    /// none for amqp, presenting the client pair when set: the PEM bytes of
    /// the certificate and of the key, which lapin parses itself (checked
    /// here first).
    Default {
        /// (certificate PEM, key PEM).
        identity: Option<(Vec<u8>, Vec<u8>)>,
    },
}

/// Reads and checks the TLS files of a connection before any network I/O,
/// so that a bad file fails at once and by name (also one replaced after
/// the start): the client pair set together and matching, `ca_file` only
/// with amqps:// and holding a usable CA.
///
/// # Errors
/// [`TlsFileError`] naming the file at fault.
pub fn connection_tls(files: TlsFiles<'_>) -> Result<ConnectionTls, TlsFileError> {
    let identity = match (files.cert_file, files.key_file) {
        (Some(cert), Some(key)) => Some((cert, key, load_identity(cert, key)?)),
        (None, None) => None,
        (Some(path), None) => return Err(TlsFileError::new("cert_file", path, PAIR_RULE)),
        (None, Some(path)) => return Err(TlsFileError::new("key_file", path, PAIR_RULE)),
    };
    match files.ca_file {
        // Plain AMQP with a CA file would send the password in clear
        // while the operator believes TLS is on (the CLI's URL and CA file
        // can come from different places).
        Some(ca) if !files.url.starts_with("amqps://") => Err(TlsFileError::new(
            "ca_file",
            ca,
            format!(
                "set, but the broker URL {} is not amqps:// (TLS would not be used)",
                redact_url(files.url)
            ),
        )),
        Some(ca) => {
            let roots = load_ca(ca)?;
            let identity = identity.map(|(cert, _, (chain, key))| (cert, chain, key));
            Ok(ConnectionTls::OwnRoots(Box::new(client_config(
                ca, roots, identity,
            )?)))
        }
        None => {
            let identity = match identity {
                Some((cert, key, _)) => {
                    Some((read_pem("cert_file", cert)?, read_pem("key_file", key)?))
                }
                None => None,
            };
            Ok(ConnectionTls::Default { identity })
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
    use std::path::PathBuf;

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

    fn files<'a>(
        url: &'a str,
        ca: Option<&'a Path>,
        pair: Option<(&'a Path, &'a Path)>,
    ) -> TlsFiles<'a> {
        TlsFiles {
            url,
            ca_file: ca,
            cert_file: pair.map(|p| p.0),
            key_file: pair.map(|p| p.1),
        }
    }

    #[test]
    fn a_ca_file_with_plain_amqp_is_refused_before_connecting() {
        let ca = data("client-v3.pem");
        let Err(e) = connection_tls(files("amqp://u:pw@h/%2f", Some(&ca), None)) else {
            panic!("accepted")
        };
        assert_eq!(e.key, "ca_file");
        assert!(e.problem.contains("is not amqps://"), "{e}");
        assert!(!e.problem.contains("pw"), "password in {e}");
    }

    #[test]
    fn a_client_certificate_needs_its_key_and_the_key_its_certificate() {
        let (cert, key) = (data("client-v3.pem"), data("client.key"));
        for (f, at) in [
            (files("amqps://h/%2f", None, None), None),
            (
                TlsFiles {
                    cert_file: Some(&cert),
                    ..files("amqps://h/%2f", None, None)
                },
                Some("cert_file"),
            ),
            (
                TlsFiles {
                    key_file: Some(&key),
                    ..files("amqps://h/%2f", None, None)
                },
                Some("key_file"),
            ),
        ] {
            match (connection_tls(f), at) {
                (Ok(ConnectionTls::Default { identity: None }), None) => {}
                (Err(e), Some(at)) => assert_eq!((e.key, e.problem.as_str()), (at, PAIR_RULE)),
                (r, _) => panic!("{at:?}: {:?}", r.err()),
            }
        }
    }

    #[test]
    fn the_pair_goes_to_lapin_as_pem_without_a_ca_file_and_into_own_roots_with_one() {
        let (cert, key) = (data("client-v3.pem"), data("client.key"));
        let pair = Some((cert.as_path(), key.as_path()));
        match connection_tls(files("amqps://h/%2f", None, pair)) {
            Ok(ConnectionTls::Default {
                identity: Some((c, k)),
            }) => {
                assert_eq!(c, std::fs::read(&cert).unwrap());
                assert_eq!(k, std::fs::read(&key).unwrap());
            }
            r => panic!("{:?}", r.err()),
        }
        match connection_tls(files("amqps://h/%2f", Some(&cert), pair)) {
            Ok(ConnectionTls::OwnRoots(cfg)) => assert!(cfg.client_auth_cert_resolver.has_certs()),
            r => panic!("{:?}", r.err()),
        }
        // A mismatched pair is refused whatever the CA.
        let other = data("other.key");
        let Err(e) = connection_tls(files("amqps://h/%2f", None, Some((&cert, &other)))) else {
            panic!("accepted")
        };
        assert_eq!(e.key, "key_file", "{e}");
    }
}
