//! Credential expiry (issue 13): the controller's cloud client exports when
//! its Keystone token and its application credential expire, read from
//! the token and from Keystone's "show application credential" call, so
//! that an operator is warned before the controller locks itself out.
//!
//! `cargo test -p vq-tests --test controller_credentials`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context, Result};
use vq_common::config::OpenStackSection;
use vq_controller::metrics::Metrics;
use vq_controller::openstack::{cluster_tag, CloudApi, Credentials, HttpCloud};
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle, APP_CRED_CLOUD_NAME};

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The value of the unlabelled sample `name` in an OpenMetrics text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

async fn sim_with_app_cred(
    dir: &std::path::Path,
    expires_in: Option<Duration>,
) -> Result<(SimHandle, Option<SystemTime>)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let agent_cfg = dir.join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    let mut cfg = SimConfig::new(dir.join("sim"), "/bin/true", &agent_cfg);
    cfg.app_cred = Some(("appcred-7".into(), "appcred-secret".into()));
    let expiry = expires_in.map(|d| SystemTime::now() + d);
    cfg.app_cred_expires_at = expiry;
    Ok((Sim::start(cfg).await?, expiry))
}

/// A client for `cloud` of the sim's clouds.yaml, with metrics, after one
/// listing (which authenticates).
async fn client(sim: &SimHandle, cloud: &str) -> Result<Arc<Metrics>> {
    let section = OpenStackSection {
        cloud: Some(cloud.into()),
        clouds_yaml: Some(sim.clouds_yaml().to_path_buf()),
        compute_microversion: None,
    };
    let creds = Credentials::discover(&section, &|_| None)?;
    let metrics = Arc::new(Metrics::new());
    let http = HttpCloud::new(creds, None)?.with_metrics(metrics.clone());
    http.list_servers(&cluster_tag("creds")).await?;
    Ok(metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_credential_s_and_the_token_s_expiry_are_exported() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (sim, expiry) =
        sim_with_app_cred(dir.path(), Some(Duration::from_secs(3 * 86_400))).await?;
    let expiry = unix(expiry.context("expiry")?);
    let m = client(&sim, APP_CRED_CLOUD_NAME).await?;
    let text = m.render();
    let cred = sample(&text, "vq_cloud_credential_expiry_timestamp_seconds")
        .with_context(|| format!("no credential expiry in:\n{text}"))?;
    // Keystone prints microseconds; the sim's clock read it a moment ago.
    ensure!(
        (cred - expiry).abs() < 1.0,
        "credential expiry {cred}, want {expiry}"
    );
    let token = sample(&text, "vq_cloud_token_expiry_timestamp_seconds").context("token")?;
    let now = unix(SystemTime::now());
    ensure!(
        (token - (now + 3600.0)).abs() < 60.0,
        "token expiry {token}, now {now}"
    );
    sim.shutdown().await;

    // A credential about to expire caps its tokens (as Keystone does): the
    // token gauge shows the earlier time.
    let dir = tempfile::tempdir()?;
    let (sim, expiry) = sim_with_app_cred(dir.path(), Some(Duration::from_secs(600))).await?;
    let expiry = unix(expiry.context("expiry")?);
    let text = client(&sim, APP_CRED_CLOUD_NAME).await?.render();
    let token = sample(&text, "vq_cloud_token_expiry_timestamp_seconds").context("token")?;
    let cred =
        sample(&text, "vq_cloud_credential_expiry_timestamp_seconds").context("credential")?;
    ensure!(
        token <= expiry + 1.0 && (cred - expiry).abs() < 1.0,
        "token {token}, credential {cred}, want both at {expiry}"
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_or_a_credential_without_expiry_exports_no_credential_expiry() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (sim, _) = sim_with_app_cred(dir.path(), None).await?;
    for cloud in ["cloudsim", APP_CRED_CLOUD_NAME] {
        let text = client(&sim, cloud).await?.render();
        ensure!(
            sample(&text, "vq_cloud_credential_expiry_timestamp_seconds").is_none(),
            "{cloud}: a credential expiry is exported:\n{text}"
        );
        ensure!(
            sample(&text, "vq_cloud_token_expiry_timestamp_seconds").is_some_and(|t| t > 0.0),
            "{cloud}: no token expiry:\n{text}"
        );
    }
    sim.shutdown().await;
    Ok(())
}
