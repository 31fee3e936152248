//! A throwaway PKI for TLS tests, made by the `openssl` CLI: a self-signed
//! CA and a server certificate it signed for `127.0.0.1` / `localhost`
//! (X.509 v3, serverAuth), valid two days.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// The files of a [`TestPki`], all PEM.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate (`ca.pem`).
    pub ca: PathBuf,
    /// The server certificate (`server.pem`), signed by the CA.
    pub server_cert: PathBuf,
    /// The server's private key (`server.key`, mode 0600).
    pub server_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("run openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl TestPki {
    /// Writes the CA and the server certificate into `dir`.
    ///
    /// # Errors
    /// If `openssl` is missing or fails, or a file cannot be written.
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        #[rustfmt::skip]
        openssl(dir, &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=vq test cloud CA", "-keyout", "ca.key", "-out", "ca.pem",
        ])?;
        #[rustfmt::skip]
        openssl(dir, &[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
            "-keyout", "server.key", "-out", "server.csr",
        ])?;
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName = IP:127.0.0.1, DNS:localhost\n\
             basicConstraints = CA:FALSE\n\
             keyUsage = digitalSignature, keyEncipherment\n\
             extendedKeyUsage = serverAuth\n",
        )?;
        #[rustfmt::skip]
        openssl(dir, &[
            "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "server.pem",
        ])?;
        std::fs::set_permissions(
            dir.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )?;
        Ok(TestPki {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
        })
    }
}
