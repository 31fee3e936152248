//! Opening a connection: the URL tuning and [`connect`] with a timeout and
//! the TLS material of [`crate::tls`].

use std::time::Duration;

use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{bounded, redact_url, AmqpError};
use crate::config::BrokerConfig;

/// `frame_max` added to URIs that do not set it, bytes. Without it lapin
/// allocates 8 MiB of buffers per connection (DESIGN.md, "lapin memory").
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

/// Adds `frame_max` and `heartbeat` query parameters to `url` when absent.
pub fn tuned_url(url: &str, heartbeat_secs: u16) -> String {
    let mut out = url.to_string();
    let mut sep = if url.contains('?') { '&' } else { '?' };
    if !url.contains("frame_max=") {
        out.push(sep);
        out.push_str(&format!("frame_max={DEFAULT_FRAME_MAX}"));
        sep = '&';
    }
    if !url.contains("heartbeat=") {
        out.push(sep);
        out.push_str(&format!("heartbeat={heartbeat_secs}"));
    }
    out
}

/// Opens a connection named `name` (shown in the management UI), bounded by
/// `connect_timeout_secs`, and presents the client certificate `cert_file`
/// with `key_file` when both are set. The TLS files are read and checked
/// here ([`crate::tls`]), before any network I/O, so a bad file fails at
/// once and by name.
///
/// Trust: with `ca_file` (amqps), its certificates are the only roots (a
/// broker certificate from a publicly trusted CA is refused unless that CA
/// is in `ca_file`); without it, lapin's default, the system roots.
///
/// # Errors
/// [`AmqpError::Connect`], [`AmqpError::Timeout`], [`AmqpError::CaFile`] or
/// [`AmqpError::ClientCert`].
pub async fn connect(cfg: &BrokerConfig, name: &str) -> Result<Connection, AmqpError> {
    let url = tuned_url(&cfg.url, cfg.heartbeat_secs);
    let redacted = redact_url(&cfg.url);
    let identity = match (&cfg.cert_file, &cfg.key_file) {
        (Some(cert), Some(key)) => Some((cert, key, client_identity(cert, key)?)),
        (None, None) => None,
        (Some(path), None) | (None, Some(path)) => {
            return Err(AmqpError::ClientCert {
                what: if cfg.cert_file.is_some() {
                    "certificate"
                } else {
                    "key"
                },
                path: path.display().to_string(),
                problem: "cert_file and key_file must be set together".into(),
            })
        }
    };
    // Plain AMQP with a CA file would send the password in clear while
    // the operator believes TLS is on (the CLI's URL and CA file can come
    // from different places).
    if let (Some(ca), false) = (&cfg.ca_file, url.starts_with("amqps://")) {
        return Err(AmqpError::CaFile {
            path: ca.display().to_string(),
            problem: format!(
                "set, but the broker URL {redacted} is not amqps:// (TLS would not be used)"
            ),
        });
    }
    let exclusive = match &cfg.ca_file {
        Some(ca) if url.starts_with("amqps://") => {
            let roots = crate::tls::load_ca(ca).map_err(tls_file_error)?;
            let identity = identity
                .as_ref()
                .map(|(cert, _, (chain, key))| (cert.as_path(), chain.clone(), key.clone_key()));
            Some(crate::tls::client_config(ca, roots, identity).map_err(tls_file_error)?)
        }
        _ => None,
    };
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = Duration::from_secs(cfg.connect_timeout_secs);
    let connect_err = |source| AmqpError::Connect {
        url: redacted.clone(),
        source,
    };
    bounded("connect", timeout, async {
        let runtime = lapin::runtime::default_runtime().map_err(connect_err)?;
        match exclusive {
            Some(config) => {
                let uri: AMQPUri = url
                    .parse()
                    .map_err(|e: String| connect_err(std::io::Error::other(e).into()))?;
                let connector = lapin::tcp::RustlsConnector::from(config);
                Connection::connector(
                    uri,
                    runtime,
                    async move |uri: AMQPUri, runtime| {
                        // TCP as lapin does it (the URI with the amqp
                        // scheme), then TLS with our own connector.
                        let mut plain = uri.clone();
                        plain.scheme = AMQPScheme::AMQP;
                        let tcp = plain.connect_async(&runtime).await?;
                        Ok(tcp.into_rustls(&connector, &uri.authority.host).await?)
                    },
                    props,
                )
                .await
                .map_err(connect_err)
            }
            None => {
                let identity = match identity {
                    // lapin parses the PEM files itself (checked above).
                    Some((cert, key, _)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                        pem: read_tls_file("certificate", cert)?,
                        key: read_tls_file("key", key)?,
                    }),
                    None => None,
                };
                let tls = OwnedTLSConfig {
                    identity,
                    cert_chain: None,
                };
                Connection::connect_with_config(&url, props, tls, runtime)
                    .await
                    .map_err(connect_err)
            }
        }
    })
    .await
}

fn read_tls_file(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, AmqpError> {
    std::fs::read(path).map_err(|e| AmqpError::ClientCert {
        what,
        path: path.display().to_string(),
        problem: format!("cannot be read: {e}"),
    })
}

fn tls_file_error(e: crate::tls::TlsFileError) -> AmqpError {
    match e.key {
        "ca_file" => AmqpError::CaFile {
            path: e.path.display().to_string(),
            problem: e.problem,
        },
        key => AmqpError::ClientCert {
            what: if key == "key_file" {
                "key"
            } else {
                "certificate"
            },
            path: e.path.display().to_string(),
            problem: e.problem,
        },
    }
}

/// Reads and checks the client certificate chain and key of [`connect`]
/// ([`crate::tls::load_identity`]).
fn client_identity(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), AmqpError> {
    crate::tls::load_identity(cert, key).map_err(tls_file_error)
}
