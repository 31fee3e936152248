//! No flapping (issue 12): bridge demand that alternates between 3 and 0
//! makes the production controller boot 3 VMs on vq-cloudsim and keep them
//! through the dips (its scale-down hysteresis), then return to zero once
//! the demand is gone for good. The agents get no job (the demand comes
//! from a bridge), so their idle clocks run from their start: without the
//! hysteresis they are drained in the first dip and booted again in the
//! next peak.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test flapping -- --include-ignored`.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use lapin::options::BasicPublishOptions;
use vq_common::messages::{unix_now, Demand, Message};
use vq_common::topology::Role;
use vq_tests::accounts;
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle};
use vq_tests::harness::{
    broker_url, build_bin, connect_role, require_root, shared_broker, unique_cluster, ChildGuard,
};

const POOL: &str = "flap";
/// VMs the peaks ask for.
const PEAK: u64 = 3;
/// Peaks and dips of the oscillation.
const ROUNDS: usize = 6;
/// The pool's `scale_down_delay_secs`: far longer than a dip (3 cycles of
/// 0.3 s), so that a loaded machine's slow cycles do not end a dip's
/// hysteresis.
const DELAY: u64 = 30;

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

/// `(servers listed now, servers ever created)` of the test cloud.
async fn sim_counts(sim: &SimHandle) -> Result<(u64, u64)> {
    let v = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    let now = v["servers"].as_array().map(Vec::len).unwrap_or(0) as u64;
    Ok((now, v["created_total"].as_u64().context("created_total")?))
}

struct Bridge {
    _conn: lapin::Connection,
    ch: lapin::Channel,
    exchange: String,
}

impl Bridge {
    async fn demand(&self, queued: u64) -> Result<()> {
        let d = Demand {
            schema: vq_common::messages::SCHEMA_VERSION,
            pool: POOL.into(),
            queued,
            running: 0,
            at: unix_now(),
            source: "flap-bridge".into(),
        };
        self.ch
            .basic_publish(
                self.exchange.as_str().into(),
                "".into(),
                BasicPublishOptions::default(),
                &d.encode(),
                lapin::BasicProperties::default(),
            )
            .await?
            .await?;
        Ok(())
    }
}

/// Waits until the controller's `/status` shows the pool planned with
/// `target` in `cycles` more cycles (each a new `observed_at`), the bridge
/// repeating `queued` meanwhile.
async fn hold_demand(
    status_url: &str,
    bridge: &Bridge,
    queued: u64,
    target: u64,
    cycles: usize,
    log: &std::path::Path,
) -> Result<()> {
    let mut seen: Vec<String> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < cycles {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the pool was not planned at target {target} for {cycles} cycles; log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        bridge.demand(queued).await?;
        if let Ok(s) = get_json(status_url).await {
            let p = &s["pools"][POOL];
            let at = p["observed_at"].to_string();
            if p["target"].as_u64() == Some(target) && !seen.contains(&at) {
                seen.push(at);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// A controller (pool [`POOL`], `max` [`PEAK`], `idle_secs` 1, 0.3 s
/// cycles, the pool keys `pool_keys` added) on vq-cloudsim whose VMs run
/// real agents (`admins`: with the controller's account in their
/// `control_admins`), and a bridge that publishes the pool's demand.
struct Setup {
    sim: SimHandle,
    _controller: ChildGuard,
    status_url: String,
    log: std::path::PathBuf,
    bridge: Bridge,
    _dir: tempfile::TempDir,
}

async fn setup(admins: bool, pool_keys: &str) -> Result<Setup> {
    let agent_bin = build_bin("vq-jobagent", "jobagent")?;
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    let dir = tempfile::tempdir()?;
    let agent_cfg = dir.path().join("jobagent.toml");
    // Heartbeats well within the controller's heartbeat timeout (2 s);
    // the controller's account may ask the agents to go, if `admins`.
    std::fs::write(
        &agent_cfg,
        format!(
            "cluster = \"{cluster}\"\nheartbeat_secs = 0.5\n{}",
            if admins {
                accounts::suite().agent_admins_toml()
            } else {
                String::new()
            }
        ),
    )?;
    let sim = Sim::start(SimConfig::new(
        dir.path().join("sim"),
        &agent_bin,
        &agent_cfg,
    ))
    .await?;
    let agent_url = accounts::suite().agent.url(&url);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let cfg = dir.path().join("controller.toml");
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"127.0.0.1:{port}\"\ninterval_secs = 0.3\nheartbeat_timeout_secs = 2.0\n\
             [broker]\nurl = \"{url}\"\n[openstack]\ncloud = \"cloudsim\"\n\
             [pools.{POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{agent_url}\"\n\
             min = 0\nmax = {PEAK}\nslots = 1\nboot_timeout_secs = 60\nidle_secs = 1\ncooldown_secs = 0\n{pool_keys}"
        ),
    )?;
    let log = dir.path().join("controller.log");
    let mut cmd = std::process::Command::new(&controller_bin);
    cmd.arg("--config")
        .arg(&cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    let controller = ChildGuard::spawn(cmd)?;
    let status_url = format!("http://127.0.0.1:{port}/status");

    // The controller declares the topology; the bridge publishes once it
    // serves its status.
    hold_demand_ready(&status_url, &log).await?;
    let (conn, ch) = connect_role(&shared_broker()?, Role::Submitter, "flap-bridge").await?;
    let bridge = Bridge {
        _conn: conn,
        ch,
        exchange: format!("{cluster}.demand"),
    };
    Ok(Setup {
        sim,
        _controller: controller,
        status_url,
        log,
        bridge,
        _dir: dir,
    })
}

/// Publishes `queued` as the bridge's demand until `/status` shows `active`
/// VMs active (90 s at most).
async fn until_active(s: &Setup, queued: u64, active: u64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        s.bridge.demand(queued).await?;
        let st = get_json(&s.status_url).await?;
        let p = &st["pools"][POOL];
        if p["vms"]["active"].as_u64() == Some(active) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the pool did not reach {active} active agents: {p}; log:\n{}",
                std::fs::read_to_string(&s.log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn demand_alternating_between_peak_and_zero_boots_once_and_returns_to_zero() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    // idle_secs 1: an agent without a job is idle enough within a second
    // of its start; the dips last a few cycles (about a second), the
    // hysteresis DELAY.
    let s = setup(
        true,
        &format!("scale_down_delay_secs = {DELAY}\nmin_lifetime_secs = 0\n"),
    )
    .await?;
    // The first peak: the pool boots PEAK VMs and their agents come up.
    until_active(&s, PEAK, PEAK).await?;
    // Dips and peaks, each a few controller cycles long: the agents are
    // idle for more than idle_secs in every dip.
    for _ in 0..ROUNDS {
        hold_demand(&s.status_url, &s.bridge, 0, 0, 3, &s.log).await?;
        hold_demand(&s.status_url, &s.bridge, PEAK, PEAK, 3, &s.log).await?;
    }
    let (listed, created) = sim_counts(&s.sim).await?;
    let text = std::fs::read_to_string(&s.log).unwrap_or_default();
    if created != PEAK || listed != PEAK {
        bail!("{created} servers created and {listed} listed after {ROUNDS} dips, {PEAK} wanted: the pool flapped; log:\n{text}");
    }
    if !text.contains(&format!(
        "no scale-down before {DELAY} s (scale_down_delay_secs)"
    )) {
        bail!("the held scale-down is not logged with its reason; log:\n{text}");
    }

    // The demand goes for good: after the hysteresis the pool returns to
    // zero.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(DELAY + 90);
    loop {
        s.bridge.demand(0).await?;
        let (listed, _) = sim_counts(&s.sim).await?;
        if listed == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{listed} servers left after the demand went; log:\n{}",
                std::fs::read_to_string(&s.log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, created) = sim_counts(&s.sim).await?;
    eprintln!("{ROUNDS} dips: {created} servers created, all deleted at the end");
    if created != PEAK {
        bail!("{created} servers created, {PEAK} wanted");
    }
    s.sim.shutdown().await;
    Ok(())
}

/// An agent whose `control_admins` lacks the controller's account ignores
/// the controller's ask-delete and heartbeats on: the controller must say
/// so in its log (once) instead of asking for ever in silence, and must not
/// delete the VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn an_agent_that_ignores_the_controller_s_ask_delete_is_named_in_the_log() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let s = setup(false, "scale_down_delay_secs = 0\nmin_lifetime_secs = 0\n").await?;
    until_active(&s, 1, 1).await?;
    let want = "has not answered whether it may be deleted";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        s.bridge.demand(0).await?;
        let text = std::fs::read_to_string(&s.log).unwrap_or_default();
        if text.contains(want) {
            assert_eq!(text.matches(want).count(), 1, "said once; log:\n{text}");
            assert!(text.contains("control_admins"), "{text}");
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no word of the unanswered ask-delete; log:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (listed, _) = sim_counts(&s.sim).await?;
    assert_eq!(listed, 1, "the VM whose agent did not agree stays");
    s.sim.shutdown().await;
    Ok(())
}

/// Waits until the controller serves a status with the pool observed and
/// the broker connected (the topology, with the demand exchange, declared).
async fn hold_demand_ready(status_url: &str, log: &std::path::Path) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(s) = get_json(status_url).await {
            if s["broker_connected"] == true && s["pools"][POOL]["observed"] == true {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the controller never observed the pool; log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
