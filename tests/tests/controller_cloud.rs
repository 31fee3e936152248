//! The production controller against vq-cloudsim configured as a cloud it
//! must not run blindly on: a compute API older than vq needs, a cloud
//! whose listings do not show what the controller booted.
//!
//! `cargo test -p vq-tests --test controller_cloud` (no root needed).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle};
use vq_tests::harness::{broker_url, build_bin, unique_cluster, ChildGuard};

const POOL: &str = "vis";

/// A controller process and the files it writes.
struct Running {
    guard: ChildGuard,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// reqwest (rustls without a built-in provider) needs one installed.
fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn get_json(url: &str) -> Result<serde_json::Value> {
    Ok(http()
        .get(url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Starts a test cloud tuned by `tune` (its agents are never started in
/// these tests: the pool's image does not matter).
async fn start_sim(dir: &Path, tune: impl FnOnce(&mut SimConfig)) -> Result<SimHandle> {
    let agent_cfg = dir.join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    // The "VMs" run /bin/true: these tests are about servers, not agents.
    let mut config = SimConfig::new(dir.join("sim"), "/bin/true", &agent_cfg);
    tune(&mut config);
    Ok(Sim::start(config).await?)
}

/// Starts `vq-controller` against `sim` with one pool of `min = max = 1`.
fn start_controller(sim: &SimHandle, dir: tempfile::TempDir, extra: &str) -> Result<Running> {
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let cluster = unique_cluster();
    let url = broker_url();
    let port = free_port()?;
    let cfg = dir.path().join("controller.toml");
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"127.0.0.1:{port}\"\ninterval_secs = 0.3\nheartbeat_timeout_secs = 2.0\n\
             [broker]\nurl = \"{url}\"\n[openstack]\ncloud = \"cloudsim\"\n{extra}\n\
             [pools.{POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{url}\"\nmin = 1\nmax = 1\n"
        ),
    )?;
    let log = dir.path().join("controller.log");
    let mut cmd = Command::new(&controller_bin);
    cmd.arg("--config")
        .arg(&cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    Ok(Running {
        guard: ChildGuard::spawn(cmd)?,
        log,
        _dir: dir,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_refuses_to_start_when_the_compute_api_is_older_than_vq_needs() -> Result<()>
{
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |c| c.compute_max_minor = 40).await?;
    let mut ctl = start_controller(&sim, dir, "")?;
    let status = tokio::task::block_in_place(|| ctl.guard.wait_timeout(Duration::from_secs(30)));
    let log = ctl.log();
    let status = status.with_context(|| {
        format!("the controller still runs against a cloud whose maximum is 2.40:\n{log}")
    })?;
    ensure!(!status.success(), "exit status {status}:\n{log}");
    ensure!(
        log.contains("2.40") && log.contains("2.52"),
        "the error names neither the cloud's maximum nor vq's version:\n{log}"
    );
    let servers = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    ensure!(
        servers["servers"].as_array().is_some_and(Vec::is_empty),
        "servers were created: {servers}"
    );
    sim.shutdown().await;
    Ok(())
}
