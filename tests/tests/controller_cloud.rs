//! The production controller against vq-cloudsim configured as a cloud it
//! must not run blindly on: a compute API older than vq needs, a cloud
//! whose listings do not show what the controller booted.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test controller_cloud -- --include-ignored`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use vq_common::topology::Role;
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle};
use vq_tests::harness::{
    broker_url, build_bin, require_root, unique_cluster, ChildGuard, TestBroker,
};

const POOL: &str = "vis";

/// A controller process and the files it writes.
struct Running {
    guard: ChildGuard,
    cluster: String,
    log: PathBuf,
    status_url: String,
    _dir: tempfile::TempDir,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The pool's entry of `/status`, `None` while the controller does not
    /// answer yet.
    async fn pool_status(&self) -> Option<serde_json::Value> {
        let v = get_json(&self.status_url).await.ok()?;
        Some(v["pools"][POOL].clone())
    }

    /// Waits up to `timeout` for the pool's status to satisfy `pred`.
    async fn wait_status(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        while tokio::time::Instant::now() < deadline {
            if let Some(p) = self.pool_status().await {
                if pred(&p) {
                    return Ok(p);
                }
                last = Some(p);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!(
            "timed out waiting for {what}; last status {last:?}; log:\n{}",
            self.log()
        )
    }

    /// Waits until the controller has observed the pool `n` more times.
    async fn wait_cycles(&self, n: usize) -> Result<()> {
        let mut seen = Vec::new();
        while seen.len() <= n {
            let p = self
                .wait_status("the next cycle", Duration::from_secs(30), |p| {
                    !seen.contains(&p["observed_at"].to_string())
                })
                .await?;
            seen.push(p["observed_at"].to_string());
        }
        Ok(())
    }
}

async fn sim_servers(sim: &SimHandle) -> Result<Vec<serde_json::Value>> {
    let v = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    Ok(v["servers"].as_array().cloned().unwrap_or_default())
}

async fn sim_faults(sim: &SimHandle, faults: serde_json::Value) -> Result<()> {
    http()
        .post(format!("{}/_sim/faults", sim.base_url()))
        .json(&faults)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
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
    start_controller_with(sim, dir, extra, "")
}

/// As [`start_controller`], with `pool_extra` added to the pool's section
/// (a `# --once` line in it also passes `--once`).
fn start_controller_with(
    sim: &SimHandle,
    dir: tempfile::TempDir,
    extra: &str,
    pool_extra: &str,
) -> Result<Running> {
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    let agent_url = broker_url(Role::Agent)?;
    let port = free_port()?;
    let cfg = dir.path().join("controller.toml");
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"127.0.0.1:{port}\"\ninterval_secs = 0.3\nheartbeat_timeout_secs = 2.0\n\
             [broker]\nurl = \"{url}\"\n[openstack]\ncloud = \"cloudsim\"\n{extra}\n\
             [pools.{POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{agent_url}\"\nmin = 1\nmax = 1\n{pool_extra}\n"
        ),
    )?;
    let log = dir.path().join("controller.log");
    let mut cmd = Command::new(&controller_bin);
    if pool_extra.contains("# --once") {
        cmd.arg("--once");
    }
    cmd.arg("--config")
        .arg(&cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    Ok(Running {
        guard: ChildGuard::spawn(cmd)?,
        cluster,
        log,
        status_url: format!("http://127.0.0.1:{port}/status"),
        _dir: dir,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn the_controller_refuses_to_start_when_the_compute_api_is_older_than_vq_needs() -> Result<()>
{
    if !require_root() {
        return Ok(());
    }
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
    let servers = sim_servers(&sim).await?;
    ensure!(servers.is_empty(), "servers were created: {servers:?}");
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_pool_whose_servers_the_listings_do_not_show_stops_booting_and_says_why() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |_| {}).await?;
    sim_faults(&sim, serde_json::json!({"hide_new_servers": true})).await?;
    let ctl = start_controller(&sim, dir, "")?;
    let stopped = ctl
        .wait_status("the pool's obstacle", Duration::from_secs(60), |p| {
            p["obstacle"].is_string()
        })
        .await;
    let servers = sim_servers(&sim).await?;
    let stopped = stopped.with_context(|| format!("{} servers created", servers.len()))?;
    let obstacle = stopped["obstacle"].as_str().unwrap_or_default().to_string();
    ensure!(
        servers.len() == 1,
        "{} servers created: {servers:?}",
        servers.len()
    );
    let name = servers[0]["name"].as_str().context("server name")?;
    ensure!(
        obstacle.contains(name) && obstacle.contains("listing"),
        "the obstacle does not name the server and the listings: {obstacle}"
    );
    // More cycles: still one server, still stopped.
    ctl.wait_cycles(3).await?;
    let servers = sim_servers(&sim).await?;
    ensure!(
        servers.len() == 1,
        "boots went on: {servers:?}\n{}",
        ctl.log()
    );
    let p = ctl.pool_status().await.context("status")?;
    ensure!(p["obstacle"].is_string(), "obstacle gone: {p}");
    ensure!(ctl.log().contains(name), "the log does not name {name}");
    let cli = build_bin("vq-cli", "vq")?;
    let out = Command::new(&cli)
        .args([
            "pools",
            "--controller",
            &ctl.status_url.replace("/status", ""),
        ])
        .env("VQ_CLUSTER", &ctl.cluster)
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout);
    ensure!(
        shown.contains("boots stopped") && shown.contains(name),
        "vq pools does not show the obstacle: {shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Once a listing shows the server the pool is unblocked.
    sim_faults(&sim, serde_json::json!({"hide_new_servers": false})).await?;
    ctl.wait_status("the obstacle to clear", Duration::from_secs(30), |p| {
        p["obstacle"].is_null() && p["vms"]["booting"] == 1
    })
    .await?;
    ensure!(sim_servers(&sim).await?.len() == 1);
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}

/// Servers the test cloud ever created.
async fn sim_created(sim: &SimHandle) -> Result<u64> {
    let v = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    v["created_total"].as_u64().context("created_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_pool_whose_servers_all_go_to_error_backs_off_and_opens_its_breaker() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |_| {}).await?;
    // Every server goes to ERROR (NoValidHost) a second after its create.
    sim_faults(&sim, serde_json::json!({"create_error_rate": 1.0})).await?;
    let ctl = start_controller_with(
        &sim,
        dir,
        "",
        "boot_backoff_base_secs = 0.5\nboot_backoff_cap_secs = 1.0\nbreaker_failures = 3\nbreaker_open_secs = 3600.0",
    )?;
    // 40 cycles (12 s at 0.3 s): without a backoff each cycle replaces
    // the failed server.
    ctl.wait_cycles(40).await?;
    let created = sim_created(&sim).await?;
    eprintln!("all boots fail: {created} creates in 40 cycles (breaker_failures = 3)");
    ensure!(
        created <= 3,
        "{created} creates in 40 cycles with every boot failing and breaker_failures = 3:\n{}",
        ctl.log()
    );
    let p = ctl.pool_status().await.context("status")?;
    ensure!(
        p["obstacle_kind"] == "breaker-open" && p["boot_failures"] == 3,
        "the breaker is not shown open: {p}"
    );
    let obstacle = p["obstacle"].as_str().unwrap_or_default();
    ensure!(
        obstacle.contains("circuit breaker open") && obstacle.contains("ERROR"),
        "the obstacle does not say why: {obstacle}"
    );
    let metrics = http()
        .get(ctl.status_url.replace("/status", "/metrics"))
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        metrics.contains(&format!("vq_pool_breaker_open{{pool=\"{POOL}\"}} 1")),
        "no vq_pool_breaker_open 1 in /metrics:\n{metrics}"
    );
    let cli = build_bin("vq-cli", "vq")?;
    let out = Command::new(&cli)
        .args([
            "pools",
            "--controller",
            &ctl.status_url.replace("/status", ""),
        ])
        .env("VQ_CLUSTER", &ctl.cluster)
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout);
    ensure!(
        shown.contains("circuit breaker open"),
        "vq pools does not show the breaker: {shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_pool_whose_servers_stay_in_build_opens_its_breaker_and_a_trial_boot_closes_it(
) -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |_| {}).await?;
    sim_faults(&sim, serde_json::json!({"stuck_build": true})).await?;
    let ctl = start_controller_with(
        &sim,
        dir,
        "",
        "boot_timeout_secs = 2\nboot_backoff_base_secs = 0.5\nboot_backoff_cap_secs = 1.0\nbreaker_failures = 2\nbreaker_open_secs = 4.0",
    )?;
    let open = ctl
        .wait_status("the breaker to open", Duration::from_secs(60), |p| {
            p["obstacle_kind"] == "breaker-open"
        })
        .await?;
    let created = sim_created(&sim).await?;
    eprintln!("servers stuck in BUILD: breaker open after {created} creates: {open}");
    ensure!(created == 2, "{created} creates before the breaker opened");
    ensure!(
        open["obstacle"]
            .as_str()
            .unwrap_or_default()
            .contains("BUILD past the boot timeout"),
        "{open}"
    );
    // The cloud recovers: the trial boot reaches ACTIVE and closes it.
    sim_faults(&sim, serde_json::json!({"stuck_build": false})).await?;
    ctl.wait_status("the breaker to close", Duration::from_secs(60), |p| {
        p["obstacle"].is_null() && p["boot_failures"] == 0
    })
    .await?;
    let created = sim_created(&sim).await?;
    eprintln!("after recovery: {created} creates in all");
    // 2 failed + 1 trial; at most one more: the trial server's VM runs no
    // agent, so past the boot timeout it is a black hole and replaced
    // (the breaker stays closed: it reached ACTIVE).
    ensure!(
        (3..=4).contains(&created),
        "{created} creates: the half-open breaker made more than one trial boot"
    );
    ensure!(ctl.log().contains("half-open"), "no half-open in the log");
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn controller_once_exits_non_zero_when_its_only_cycle_failed() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |_| {}).await?;
    // Every server listing is answered 503: the cycle fails.
    sim_faults(
        &sim,
        serde_json::json!({"fail_next": [{"method": "GET", "path_prefix": "/compute/v2.1/servers", "status": 503, "count": 1000}]}),
    )
    .await?;
    let mut ctl = start_controller_with(&sim, dir, "", "# --once")?;
    let status = tokio::task::block_in_place(|| ctl.guard.wait_timeout(Duration::from_secs(60)));
    let log = ctl.log();
    let status = status.with_context(|| format!("--once did not exit:\n{log}"))?;
    ensure!(
        !status.success(),
        "--once exited {status} though its only cycle failed:\n{log}"
    );
    ensure!(
        log.contains("single cycle failed") && log.contains(POOL),
        "the error does not name the pool:\n{log}"
    );
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}

/// `DELETE` requests the test cloud answered.
async fn sim_delete_requests(sim: &SimHandle) -> Result<u64> {
    let v = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    v["delete_requests_total"]
        .as_u64()
        .context("delete_requests_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_delete_that_does_nothing_is_polled_not_repeated_and_flagged_after_its_deadline(
) -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path(), |_| {}).await?;
    // The pool's one server goes to ERROR, and the breaker (one failure)
    // stops further boots: what is left is deleting that server, and the
    // cloud answers every DELETE with 204 and does nothing.
    sim_faults(
        &sim,
        serde_json::json!({"create_error_rate": 1.0, "ignore_deletes": true}),
    )
    .await?;
    let ctl = start_controller_with(
        &sim,
        dir,
        "",
        "breaker_failures = 1\nbreaker_open_secs = 3600.0\ndelete_retry_secs = 2.0\ndelete_timeout_secs = 3.0",
    )?;
    let flagged = ctl
        .wait_status(
            "the stuck delete to be flagged",
            Duration::from_secs(60),
            |p| p["stuck_deletes"].as_array().is_some_and(|a| !a.is_empty()),
        )
        .await?;
    let servers = sim_servers(&sim).await?;
    ensure!(servers.len() == 1, "servers: {servers:?}");
    let name = servers[0]["name"].as_str().context("name")?.to_string();
    let stuck = &flagged["stuck_deletes"][0];
    ensure!(
        stuck["server"] == name.as_str() && stuck["deletes_sent"].as_u64() >= Some(1),
        "the stuck delete does not name {name}: {flagged}"
    );
    // 40 cycles (12 s at 0.3 s): without polling each cycle sends DELETE
    // again; with it, re-sends back off from delete_retry_secs (2, 4, 8 s).
    ctl.wait_cycles(40).await?;
    let deletes = sim_delete_requests(&sim).await?;
    eprintln!("delete that does nothing: {deletes} DELETE requests in 40 cycles (retry base 2 s)");
    ensure!(
        (1..=5).contains(&deletes),
        "{deletes} DELETE requests in 40 cycles:\n{}",
        ctl.log()
    );
    let metrics = http()
        .get(ctl.status_url.replace("/status", "/metrics"))
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        metrics.contains(&format!(
            "vq_pool_servers_stuck_deleting{{pool=\"{POOL}\"}} 1"
        )),
        "no vq_pool_servers_stuck_deleting 1 in /metrics:\n{metrics}"
    );
    ensure!(
        ctl.log().contains("will not go"),
        "the log does not flag the server:\n{}",
        ctl.log()
    );
    // The cloud acts again: the next re-sent DELETE removes it and the
    // flag clears.
    sim_faults(&sim, serde_json::json!({"ignore_deletes": false})).await?;
    ctl.wait_status("the server to go", Duration::from_secs(60), |p| {
        p["stuck_deletes"].as_array().is_some_and(|a| a.is_empty())
    })
    .await?;
    ensure!(
        sim_servers(&sim).await?.is_empty(),
        "the server is still there"
    );
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_full_quota_and_an_unreachable_cloud_are_the_pool_s_obstacle_until_they_clear(
) -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    // The project's instance quota is 0: the pool's one server (min 1)
    // cannot be booted.
    let sim = start_sim(dir.path(), |c| c.quota_instances = 0).await?;
    let ctl = start_controller(&sim, dir, "")?;
    let p = ctl
        .wait_status("the quota obstacle", Duration::from_secs(60), |p| {
            p["obstacle_kind"] == "quota"
        })
        .await?;
    let obstacle = p["obstacle"].as_str().unwrap_or_default().to_string();
    ensure!(
        obstacle == "quota exhausted: 0/0 instances; 1 more VM(s) wanted, 0 allowed",
        "the obstacle does not give the quota's figures: {obstacle}"
    );
    // It stays while the quota is full (not one sample in three).
    ctl.wait_cycles(5).await?;
    let p = ctl.pool_status().await.context("status")?;
    ensure!(p["obstacle_kind"] == "quota", "obstacle gone: {p}");
    let metrics_url = ctl.status_url.replace("/status", "/metrics");
    let metrics = http().get(&metrics_url).send().await?.text().await?;
    for (kind, v) in [("quota", 1), ("max", 0), ("unobserved", 0)] {
        let want = format!("vq_pool_obstacle{{pool=\"{POOL}\",kind=\"{kind}\"}} {v}");
        ensure!(metrics.contains(&want), "no {want} in /metrics:\n{metrics}");
    }
    let cli = build_bin("vq-cli", "vq")?;
    let pools = |ctl: &Running| -> Result<String> {
        let out = Command::new(&cli)
            .args([
                "pools",
                "--controller",
                &ctl.status_url.replace("/status", ""),
            ])
            .env("VQ_CLUSTER", &ctl.cluster)
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let shown = pools(&ctl)?;
    ensure!(
        shown.contains(&format!(
            "{POOL}: boots held back: quota exhausted: 0/0 instances;"
        )),
        "vq pools does not show the quota: {shown}"
    );
    // The cloud stops answering listings: the pool is not observed, and
    // says so as its obstacle.
    sim_faults(
        &sim,
        serde_json::json!({"fail_next": [{"method": "GET", "path_prefix": "/compute/v2.1/servers", "status": 503, "count": 100000}]}),
    )
    .await?;
    let p = ctl
        .wait_status("the unobserved obstacle", Duration::from_secs(60), |p| {
            p["obstacle_kind"] == "unobserved"
        })
        .await?;
    let obstacle = p["obstacle"].as_str().unwrap_or_default();
    ensure!(
        obstacle.starts_with("not observed: ") && obstacle.contains("503"),
        "{obstacle}"
    );
    let metrics = http().get(&metrics_url).send().await?.text().await?;
    let want = format!("vq_pool_obstacle{{pool=\"{POOL}\",kind=\"unobserved\"}} 1");
    ensure!(metrics.contains(&want), "no {want} in /metrics:\n{metrics}");
    let cluster = ctl.cluster.clone();
    drop(ctl);
    sim.shutdown().await;
    TestBroker::connect(&cluster, &[POOL])
        .await?
        .cleanup()
        .await;
    Ok(())
}
