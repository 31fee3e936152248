//! HTTPS for the test cloud: a listener that completes the TLS handshake
//! of each accepted connection (in a task of its own, so a slow or failing
//! client holds up no other) before axum sees it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::SimError;

/// The server certificate of an HTTPS test cloud ([`super::SimConfig::tls`]).
#[derive(Debug, Clone)]
pub struct SimTls {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf.
    pub key: PathBuf,
}

/// A handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl SimTls {
    /// The rustls acceptor of this certificate and key (ring provider).
    pub(super) fn acceptor(&self) -> Result<TlsAcceptor, SimError> {
        let err = |problem: String| SimError::Tls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            problem,
        };
        let chain = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| err(format!("certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| err(format!("key: {e}")))?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| err(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| err(e.to_string()))?;
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

/// [`axum::serve::Listener`] of TLS connections: accepted TCP connections
/// whose handshake succeeded; failed handshakes are logged and dropped.
pub(super) struct TlsListener {
    addr: SocketAddr,
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    /// Accepts on `listener` in a background task (ends with the listener's
    /// owner, when this is dropped) and hands each connection to `acceptor`.
    pub(super) fn new(listener: TcpListener, acceptor: TlsAcceptor) -> Self {
        let addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(error) => {
                        tracing::warn!(%error, "cloudsim: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let conn_tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = conn_tx.send((tls, peer)).await;
                        }
                        Ok(Err(error)) => {
                            tracing::info!(%peer, %error, "cloudsim: TLS handshake failed")
                        }
                        Err(_) => tracing::info!(%peer, "cloudsim: TLS handshake timed out"),
                    }
                });
                if tx.is_closed() {
                    break;
                }
            }
        });
        TlsListener { addr, rx }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task ended: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
