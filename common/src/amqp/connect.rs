//! Opening a connection: the URL tuning and [`connect`] with a timeout and
//! the TLS material of [`crate::tls`].

use std::time::Duration;

use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use super::{bounded, redact_url, AmqpError};
use crate::config::BrokerConfig;
use crate::tls::{connection_tls, ConnectionTls};

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
/// first ([`crate::tls::connection_tls`]), before any network I/O, so a bad
/// file fails at once and by name.
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
    let tls = connection_tls(cfg.tls_files())?;
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = Duration::from_secs(cfg.connect_timeout_secs);
    let connect_err = |source| AmqpError::Connect {
        url: redacted.clone(),
        source,
    };
    bounded("connect", timeout, async {
        let runtime = lapin::runtime::default_runtime().map_err(connect_err)?;
        match tls {
            ConnectionTls::OwnRoots(config) => {
                let uri: AMQPUri = url
                    .parse()
                    .map_err(|e: String| connect_err(std::io::Error::other(e).into()))?;
                let connector = lapin::tcp::RustlsConnector::from(*config);
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
            ConnectionTls::Default { identity } => {
                // lapin parses the PEM files itself (checked before).
                let identity =
                    identity.map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 { pem, key });
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
