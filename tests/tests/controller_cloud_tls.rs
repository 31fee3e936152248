//! TLS to the cloud (issue 13): the test cloud served over HTTPS with a
//! certificate of a CA made at test time (`openssl` CLI).
//!
//! * the controller's cloud client trusts the cloud with clouds.yaml
//!   `cacert` or `OS_CACERT`, and refuses it without (a certificate
//!   error); with `verify: false` / `OS_INSECURE=true` it accepts it;
//! * an unusable `cacert` fails the start (and `--check-config`, exit 64)
//!   naming the key;
//! * a `vq-controller` process: without the CA not ready, `/readyz`
//!   naming the certificate error; with `OS_CACERT` ready; with
//!   `OS_INSECURE=true` ready, warning in its log and on `/status`.
//!
//! `cargo test -p vq-tests --test controller_cloud_tls -- --include-ignored`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use vq_common::config::OpenStackSection;
use vq_common::topology::Role;
use vq_controller::openstack::{cluster_tag, CloudApi, Credentials, HttpCloud};
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle, SimTls};
use vq_tests::harness::{
    broker_url, build_bin, require_root, start_controller_on_cloud, unique_cluster, TestBroker,
};
use vq_tests::rabbit_node::free_port;
use vq_tests::test_pki::TestPki;

/// An HTTPS test cloud with a fresh PKI in `dir`.
async fn tls_sim(dir: &Path) -> Result<(SimHandle, TestPki)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = TestPki::create(&dir.join("pki"))?;
    let agent_cfg = dir.join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    let mut cfg = SimConfig::new(dir.join("sim"), "/bin/true", &agent_cfg);
    cfg.tls = Some(SimTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
    });
    Ok((Sim::start(cfg).await?, pki))
}

/// A copy of the sim's clouds.yaml in `dir` with `extra` (YAML lines)
/// added to cloud `cloudsim`.
fn clouds_yaml_with(sim: &SimHandle, dir: &Path, extra: &str) -> Result<PathBuf> {
    let text = std::fs::read_to_string(sim.clouds_yaml())?;
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text)?;
    let add: serde_yaml_ng::Mapping = serde_yaml_ng::from_str(extra)?;
    let cloud = doc["clouds"]["cloudsim"]
        .as_mapping_mut()
        .context("no cloudsim cloud")?;
    for (k, v) in add {
        cloud.insert(k, v);
    }
    let path = dir.join(format!("clouds-{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&path, serde_yaml_ng::to_string(&doc)?)?;
    Ok(path)
}

/// The cloud client of `clouds_yaml`'s `cloudsim` with the variables `env`,
/// after it read the version document and listed the servers.
async fn use_cloud(clouds_yaml: &Path, env: &[(&str, &str)]) -> Result<()> {
    let section = OpenStackSection {
        cloud: Some("cloudsim".into()),
        clouds_yaml: Some(clouds_yaml.to_path_buf()),
        compute_microversion: None,
    };
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let creds = Credentials::discover(&section, &get)?;
    let cloud = HttpCloud::new(creds, None)?;
    cloud.check_compute_version().await?;
    cloud.list_servers(&cluster_tag("tls")).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_client_trusts_an_https_cloud_through_cacert_only() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (sim, pki) = tls_sim(dir.path()).await?;
    ensure!(sim.auth_url().starts_with("https://"), "{}", sim.auth_url());
    let ca = pki.ca.display().to_string();

    // No CA: the system roots do not know the test CA.
    let err = use_cloud(sim.clouds_yaml(), &[])
        .await
        .err()
        .context("an unknown CA was trusted")?;
    let text = format!("{err:#}");
    ensure!(
        text.contains("certificate") && text.contains("UnknownIssuer"),
        "want a certificate error, got: {text}"
    );

    // clouds.yaml `cacert`, and OS_CACERT over the plain clouds.yaml.
    let with_ca = clouds_yaml_with(&sim, dir.path(), &format!("cacert: {ca}\n"))?;
    use_cloud(&with_ca, &[])
        .await
        .context("clouds.yaml cacert")?;
    use_cloud(sim.clouds_yaml(), &[("OS_CACERT", &ca)])
        .await
        .context("OS_CACERT")?;

    // verify: false and OS_INSECURE=true accept the certificate unchecked.
    let insecure = clouds_yaml_with(&sim, dir.path(), "verify: false\n")?;
    use_cloud(&insecure, &[]).await.context("verify: false")?;
    use_cloud(sim.clouds_yaml(), &[("OS_INSECURE", "true")])
        .await
        .context("OS_INSECURE")?;

    // A CA file that is missing or holds no certificate fails before any
    // request, naming the key.
    let missing = dir.path().join("nope.pem");
    let bad = clouds_yaml_with(
        &sim,
        dir.path(),
        &format!("cacert: {}\n", missing.display()),
    )?;
    let text = format!(
        "{:#}",
        use_cloud(&bad, &[]).await.err().context("missing cacert")?
    );
    ensure!(
        text.contains("clouds.cloudsim.cacert") && text.contains("nope.pem"),
        "{text}"
    );
    let text = format!(
        "{:#}",
        use_cloud(
            sim.clouds_yaml(),
            &[("OS_CACERT", &pki.server_key.display().to_string())]
        )
        .await
        .err()
        .context("a key as cacert")?
    );
    ensure!(
        text.contains("OS_CACERT") && text.contains("no PEM certificate"),
        "{text}"
    );
    sim.shutdown().await;
    Ok(())
}

#[test]
#[ignore = "builds the controller"]
fn check_config_names_an_unusable_cacert() -> Result<()> {
    let bin = build_bin("vq-controller", "vq-controller")?;
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("controller.toml");
    std::fs::write(
        &cfg,
        "cluster = \"c\"\n[broker]\nurl = \"amqp://u:p@127.0.0.1:5672/%2f\"\n\
         [openstack]\n[pools.p]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\n\
         agent_broker_url = \"amqp://a:b@127.0.0.1:5672/%2f\"\nmax = 1\n",
    )?;
    let out = Command::new(&bin)
        .arg("--check-config")
        .arg("--config")
        .arg(&cfg)
        .env_clear()
        .env("OS_AUTH_URL", "https://127.0.0.1:1/identity/v3")
        .env("OS_USERNAME", "u")
        .env("OS_PASSWORD", "p")
        .env("OS_PROJECT_NAME", "demo")
        .env("OS_CACERT", dir.path().join("missing-ca.pem"))
        .env("OS_INSECURE", "")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(64),
        "exit {:?}: {stderr}",
        out.status
    );
    ensure!(
        stderr.contains("openstack: OS_CACERT: ") && stderr.contains("missing-ca.pem"),
        "{stderr}"
    );
    Ok(())
}

async fn get(client: &reqwest::Client, url: &str) -> Result<(u16, String)> {
    let r = client.get(url).send().await?;
    Ok((r.status().as_u16(), r.text().await?))
}

/// Polls `url` (every 200 ms, up to `timeout`) until `pred` holds for its
/// answer, and returns it.
async fn wait_http(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
    what: &str,
    pred: impl Fn(u16, &str) -> bool,
) -> Result<(u16, String)> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match get(client, url).await {
            Ok((code, body)) if pred(code, &body) => return Ok((code, body)),
            other => format!("{other:?}"),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} at {url}; last answer: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A controller process against an HTTPS test cloud with the variables
/// `env`, its stderr in `log`; returns its `/readyz` and `/status` after
/// `/readyz` satisfied `pred`.
async fn controller_on_tls_cloud(
    env: &[(&str, String)],
    log: &Path,
    what: &str,
    pred: impl Fn(u16, &str) -> bool,
) -> Result<((u16, String), serde_json::Value)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir()?;
    let pki = TestPki::create(&dir.path().join("pki"))?;
    let cluster = unique_cluster();
    let pool = "tls";
    let url = broker_url(Role::Controller)?;
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let stderr = std::fs::File::create(log)?;
    let tls = SimTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
    };
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| {
            let v = v.replace("{ca}", &pki.ca.display().to_string());
            (k.to_string(), v)
        })
        .collect();
    let controller = start_controller_on_cloud(
        &url,
        &cluster,
        pool,
        "info",
        &listen,
        "",
        |s| s.tls = Some(tls),
        |c| {
            c.envs(env).stderr(stderr);
        },
    )
    .await?;
    let client = reqwest::Client::new();
    let ready = wait_http(
        &client,
        &format!("http://{listen}/readyz"),
        Duration::from_secs(60),
        what,
        pred,
    )
    .await;
    let status = get(&client, &format!("http://{listen}/status")).await;
    drop(controller.guard);
    controller.sim.shutdown().await;
    broker.cleanup().await;
    let status: serde_json::Value = serde_json::from_str(&status?.1)?;
    Ok((ready?, status))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn a_controller_without_the_cloud_s_ca_is_not_ready_and_names_the_certificate_error(
) -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("controller.log");
    let ((code, body), status) =
        controller_on_tls_cloud(&[], &log, "a /readyz naming the cloud", |code, body| {
            code != 200 && body.contains("cloud")
        })
        .await?;
    ensure!(code == 503, "/readyz answered {code}: {body}");
    ensure!(
        body.contains("certificate") && body.contains("UnknownIssuer"),
        "/readyz must name the certificate error: {body}"
    );
    ensure!(
        status["cloud_tls_insecure"] == false,
        "/status cloud_tls_insecure: {status}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn a_controller_with_os_cacert_is_ready_on_an_https_cloud() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("controller.log");
    let (_, status) = controller_on_tls_cloud(
        &[("OS_CACERT", "{ca}".into())],
        &log,
        "a ready controller",
        |code, body| code == 200 && body == "ready",
    )
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    ensure!(
        status["cloud_error"].is_null() && status["cloud_tls_insecure"] == false,
        "/status: {status}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn a_controller_with_os_insecure_is_ready_warns_and_shows_it_on_status() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("controller.log");
    let (_, status) = controller_on_tls_cloud(
        &[("OS_INSECURE", "true".into())],
        &log,
        "a ready controller",
        |code, body| code == 200 && body == "ready",
    )
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    ensure!(status["cloud_tls_insecure"] == true, "/status: {status}");
    let text = std::fs::read_to_string(&log)?;
    let warn = text
        .lines()
        .find(|l| l.contains("VERIFICATION OF THE CLOUD IS OFF"))
        .with_context(|| format!("no warning in the log:\n{text}"))?;
    ensure!(
        warn.contains("WARN") && warn.contains("OS_INSECURE"),
        "{warn}"
    );
    Ok(())
}
