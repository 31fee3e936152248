//! High availability (issue 15, "Two controllers, one acts") and
//! `--dry-run`: several production controllers against one vq-cloudsim
//! and the shared RabbitMQ; who sent each create and delete is read from
//! the sim's request log (`/_sim/requests`, the controller's pid is in its
//! `User-Agent`).
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test controller_ha -- --include-ignored`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use tokio::time::Instant;
use vq_common::topology::Role;
use vq_tests::accounts::BrokerAt;
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle};
use vq_tests::harness::{
    broker_url, build_bin, require_root, shared_broker, unique_cluster, ChildGuard,
};
use vq_tests::tcp_proxy::TcpProxy;

const POOL: &str = "ha";
/// Cycle interval of the controllers under test, seconds.
const INTERVAL: f64 = 0.3;
/// AMQP heartbeat of the controllers under test, seconds (proof bound: 1 s).
const AMQP_HEARTBEAT: u16 = 2;
/// Pool sizes: `min = max`.
const SIZE: u64 = 2;

/// A controller process and the files it writes.
struct Ctl {
    guard: ChildGuard,
    log: PathBuf,
    base: String,
}

impl Ctl {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.guard.id()
    }

    async fn status(&self) -> Option<serde_json::Value> {
        get_json(&format!("{}/status", self.base)).await.ok()
    }

    /// Waits up to `timeout` for `/status` to satisfy `pred`.
    async fn wait_status(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        while Instant::now() < deadline {
            if let Some(s) = self.status().await {
                if pred(&s) {
                    return Ok(s);
                }
                last = Some(s);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "timed out waiting for {what}; last status {last:?}; log:\n{}",
            self.log()
        )
    }

    /// Waits until the controller has run `n` more cycles.
    async fn wait_cycles(&self, n: usize) -> Result<()> {
        let mut seen = Vec::new();
        while seen.len() <= n {
            let s = self
                .wait_status("the next cycle", Duration::from_secs(30), |s| {
                    !seen.contains(&s["last_cycle_at"].to_string())
                })
                .await?;
            seen.push(s["last_cycle_at"].to_string());
        }
        Ok(())
    }
}

fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn get_json(url: &str) -> Result<serde_json::Value> {
    Ok(http()
        .get(url)
        .timeout(Duration::from_secs(5))
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

/// One create or delete the sim received.
#[derive(Debug, Clone)]
struct Mutation {
    at: f64,
    method: String,
    pid: u32,
}

async fn mutations(sim: &SimHandle) -> Result<Vec<Mutation>> {
    let v = get_json(&format!("{}/_sim/requests", sim.base_url())).await?;
    let list = v["requests"].as_array().context("requests")?;
    Ok(list
        .iter()
        .map(|r| {
            let ua = r["user_agent"].as_str().unwrap_or("");
            let pid = ua
                .split_once("(pid ")
                .and_then(|(_, r)| r.trim_end_matches(')').parse().ok())
                .unwrap_or(0);
            Mutation {
                at: r["at"].as_f64().unwrap_or(0.0),
                method: r["method"].as_str().unwrap_or("").to_string(),
                pid,
            }
        })
        .collect())
}

async fn sim_servers(sim: &SimHandle) -> Result<(Vec<serde_json::Value>, u64)> {
    let v = get_json(&format!("{}/_sim/servers", sim.base_url())).await?;
    Ok((
        v["servers"].as_array().cloned().unwrap_or_default(),
        v["created_total"].as_u64().context("created_total")?,
    ))
}

/// A test cloud whose "VMs" run /bin/true (these tests are about who acts
/// on servers, not about agents).
async fn start_sim(dir: &Path) -> Result<SimHandle> {
    let agent_cfg = dir.join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    Ok(Sim::start(SimConfig::new(dir.join("sim"), "/bin/true", &agent_cfg)).await?)
}

/// Starts `vq-controller` number `n` for `cluster` against `sim`, logging
/// in with `url`; `pool_extra` is added to the pool's section, `args` to
/// the command line.
fn start_ctl(
    sim: &SimHandle,
    dir: &Path,
    n: usize,
    cluster: &str,
    url: &str,
    pool_extra: &str,
    args: &[&str],
) -> Result<Ctl> {
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let agent_url = broker_url(Role::Agent)?;
    let port = free_port()?;
    let cfg = dir.join(format!("controller-{n}.toml"));
    let min = if pool_extra.contains("min = ") {
        String::new()
    } else {
        format!("min = {SIZE}\n")
    };
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"127.0.0.1:{port}\"\ninterval_secs = {INTERVAL}\nheartbeat_timeout_secs = 2.0\n\
             [broker]\nurl = \"{url}\"\nheartbeat_secs = {AMQP_HEARTBEAT}\n[openstack]\ncloud = \"cloudsim\"\n\
             [pools.{POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{agent_url}\"\n{min}max = {SIZE}\n{pool_extra}\n"
        ),
    )?;
    let log = dir.join(format!("controller-{n}.log"));
    let mut cmd = Command::new(&controller_bin);
    cmd.args(args)
        .arg("--config")
        .arg(&cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    Ok(Ctl {
        guard: ChildGuard::spawn(cmd)?,
        log,
        base: format!("http://127.0.0.1:{port}"),
    })
}

fn is_role(s: &serde_json::Value, role: &str) -> bool {
    s["role"] == role && s["last_cycle_at"].as_f64().unwrap_or(0.0) > 0.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn of_two_controllers_one_acts_and_the_standby_takes_over_after_kill_9() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path()).await?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    // Servers never heartbeat here: a long boot timeout keeps them booting.
    let pool = "boot_timeout_secs = 3600";
    let a = start_ctl(&sim, dir.path(), 1, &cluster, &url, pool, &[])?;
    a.wait_status("A leader", Duration::from_secs(30), |s| {
        is_role(s, "leader")
    })
    .await?;
    let b = start_ctl(&sim, dir.path(), 2, &cluster, &url, pool, &[])?;
    let sb = b
        .wait_status("B standby", Duration::from_secs(30), |s| {
            is_role(s, "standby")
        })
        .await?;
    println!("standby reason: {}", sb["standby_reason"]);
    b.wait_cycles(5).await?;
    // The standby serves status and readiness; it acted on nothing.
    let ready = http().get(format!("{}/readyz", b.base)).send().await?;
    println!("standby /readyz: {}", ready.status());
    let metrics = http()
        .get(format!("{}/metrics", b.base))
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        metrics.contains("vq_controller_leader 0"),
        "standby metrics: {metrics}"
    );
    let (servers, created) = sim_servers(&sim).await?;
    ensure!(
        servers.len() as u64 == SIZE && created == SIZE,
        "{servers:?}"
    );
    let m = mutations(&sim).await?;
    ensure!(
        m.iter().all(|x| x.pid == a.pid()),
        "only A acted: {m:?} (A {}, B {})",
        a.pid(),
        b.pid()
    );
    // kill -9 the leader: its TCP connection closes, the broker drops
    // the lock at once.
    let t0 = Instant::now();
    a.guard.signal(nix::sys::signal::Signal::SIGKILL);
    b.wait_status("B leader", Duration::from_secs(30), |s| {
        is_role(s, "leader")
    })
    .await?;
    let takeover = t0.elapsed().as_secs_f64();
    let bound = 2.0 * INTERVAL + f64::from(AMQP_HEARTBEAT);
    println!(
        "takeover after kill -9: {takeover:.2} s (bound 2 x interval + heartbeat = {bound:.1} s)"
    );
    ensure!(takeover <= bound, "takeover {takeover:.2} s > {bound} s");
    // The new leader adopts A's servers: no duplicate, no orphan.
    b.wait_cycles(5).await?;
    let (servers, created) = sim_servers(&sim).await?;
    ensure!(
        servers.len() as u64 == SIZE && created == SIZE,
        "no duplicate after the takeover: {servers:?}, created {created}; log:\n{}",
        b.log()
    );
    let sb = b.status().await.context("status")?;
    ensure!(
        sb["pools"][POOL]["vms"]["booting"].as_u64() == Some(SIZE),
        "the new leader counts A's servers as its own: {sb}"
    );
    let m = mutations(&sim).await?;
    ensure!(
        m.iter().all(|x| x.method == "POST"),
        "nothing deleted: {m:?}"
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_leader_partitioned_from_the_broker_stops_acting_before_the_other_starts() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path()).await?;
    let cluster = unique_cluster();
    let direct = broker_url(Role::Controller)?;
    let upstream: std::net::SocketAddr = ([127, 0, 0, 1], 5672).into();
    let proxy = TcpProxy::start(upstream).await?;
    let _ = shared_broker()?;
    let via_proxy =
        BrokerAt::new(format!("amqp://127.0.0.1:{}/%2f", proxy.port())).url(Role::Controller);
    // Servers that never heartbeat are black holes after 2 s: deleted and
    // replaced again and again, so the leader acts all the time.
    let pool = "boot_timeout_secs = 2\nbreaker_failures = 1000\nboot_backoff_base_secs = 0.1\nboot_backoff_cap_secs = 0.2\ncooldown_secs = 0";
    let a = start_ctl(&sim, dir.path(), 1, &cluster, &via_proxy, pool, &[])?;
    a.wait_status("A leader", Duration::from_secs(30), |s| {
        is_role(s, "leader")
    })
    .await?;
    let b = start_ctl(&sim, dir.path(), 2, &cluster, &direct, pool, &[])?;
    b.wait_status("B standby", Duration::from_secs(30), |s| {
        is_role(s, "standby")
    })
    .await?;
    // A acts (deletes black holes) while B watches.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = mutations(&sim).await?;
        if m.iter().filter(|x| x.method == "DELETE").count() >= 2 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "A never deleted: {m:?}; log:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(mutations(&sim).await?.iter().all(|x| x.pid == a.pid()));
    let partition_at = vq_common::messages::unix_now();
    let t0 = Instant::now();
    proxy.blackhole();
    let (b_first, takeover) = loop {
        let m = mutations(&sim).await?;
        if let Some(first) = m.iter().find(|x| x.pid == b.pid()) {
            break (first.at, t0.elapsed().as_secs_f64());
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "B never acted; B log:\n{}",
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let m = mutations(&sim).await?;
    let a_last = m
        .iter()
        .filter(|x| x.pid == a.pid())
        .map(|x| x.at)
        .fold(0.0, f64::max);
    println!(
        "partition: A's last action {:.2} s after the partition, B's first {:.2} s after it (first B action seen {takeover:.2} s after)",
        a_last - partition_at,
        b_first - partition_at
    );
    ensure!(a_last < b_first, "A acted after B's first action: {m:?}");
    // RabbitMQ closes a silent connection 2 to 3 heartbeat timeouts after
    // its last frame (measured here); then one cycle and the proof bound.
    let bound = 2.0 * INTERVAL + 4.0 * f64::from(AMQP_HEARTBEAT);
    println!("takeover after a partition: {takeover:.2} s (bound 2 x interval + 4 x heartbeat = {bound:.1} s)");
    ensure!(takeover <= bound, "takeover {takeover:.2} s");
    // A serves its status as a standby while partitioned.
    let sa = a
        .wait_status("A standby", Duration::from_secs(10), |s| {
            s["role"] == "standby"
        })
        .await?;
    println!("partitioned A: {}", sa["standby_reason"]);
    // Healed, A stays standby: B holds the lock.
    proxy.heal();
    b.wait_cycles(10).await?;
    let m = mutations(&sim).await?;
    let late: Vec<_> = m
        .iter()
        .filter(|x| x.pid == a.pid() && x.at >= b_first)
        .collect();
    ensure!(late.is_empty(), "A acted after the takeover: {late:?}");
    ensure!(
        a.status().await.context("A status")?["role"] == "standby",
        "A after the heal"
    );
    let (servers, _) = sim_servers(&sim).await?;
    ensure!(
        servers.len() as u64 <= SIZE,
        "never more than max servers: {servers:?}"
    );
    drop(a);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn two_controllers_started_at_once_elect_one_and_boot_once() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path()).await?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    let pool = "boot_timeout_secs = 3600";
    let a = start_ctl(&sim, dir.path(), 1, &cluster, &url, pool, &[])?;
    let b = start_ctl(&sim, dir.path(), 2, &cluster, &url, pool, &[])?;
    a.wait_cycles(5).await?;
    b.wait_cycles(5).await?;
    let ra = a.status().await.context("A")?["role"].clone();
    let rb = b.status().await.context("B")?["role"].clone();
    let leaders = [&ra, &rb].iter().filter(|r| **r == "leader").count();
    ensure!(leaders == 1, "exactly one leader: A {ra}, B {rb}");
    let (servers, created) = sim_servers(&sim).await?;
    ensure!(
        servers.len() as u64 == SIZE && created == SIZE,
        "booted once: {servers:?}"
    );
    let leader_pid = if ra == "leader" { a.pid() } else { b.pid() };
    ensure!(mutations(&sim).await?.iter().all(|x| x.pid == leader_pid));
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_dry_run_logs_what_it_would_do_and_does_nothing() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path()).await?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    let c = start_ctl(
        &sim,
        dir.path(),
        1,
        &cluster,
        &url,
        "boot_timeout_secs = 3600",
        &["--dry-run"],
    )?;
    // A dry run never takes the lock: it keeps no controller from acting.
    c.wait_status("standby", Duration::from_secs(30), |s| {
        is_role(s, "standby")
    })
    .await?;
    c.wait_cycles(5).await?;
    let s = c.status().await.context("status")?;
    ensure!(s["dry_run"] == true, "{s}");
    ensure!(
        s["pools"][POOL]["target"].as_u64() == Some(SIZE),
        "it plans: {s}"
    );
    let m = mutations(&sim).await?;
    ensure!(m.is_empty(), "a dry run creates and deletes nothing: {m:?}");
    let log = c.log();
    ensure!(
        log.contains(&format!("dry run: would boot {SIZE} server(s)")),
        "the log names what would have been done:\n{log}"
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_standby_leaves_bridge_demand_to_the_leader() -> Result<()> {
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    use vq_common::messages::{Demand, Message};
    if !require_root() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sim = start_sim(dir.path()).await?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    // The test holds the lock: both controllers start as standbys.
    let (lock_conn, lock_ch) =
        vq_tests::harness::connect_role(&shared_broker()?, Role::Controller, "test-lock").await?;
    lock_ch
        .queue_declare(
            format!("{cluster}.controller.lock").as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let pool = "min = 0\nboot_timeout_secs = 3600";
    let a = start_ctl(&sim, dir.path(), 1, &cluster, &url, pool, &[])?;
    let b = start_ctl(&sim, dir.path(), 2, &cluster, &url, pool, &[])?;
    for c in [&a, &b] {
        c.wait_status("standby", Duration::from_secs(30), |s| {
            is_role(s, "standby")
        })
        .await?;
        c.wait_cycles(3).await?;
    }
    let demand = Demand {
        schema: vq_common::messages::SCHEMA_VERSION,
        pool: POOL.into(),
        queued: 5,
        running: 0,
        at: vq_common::messages::unix_now(),
        source: "test-bridge".into(),
    };
    lock_ch
        .basic_publish(
            format!("{cluster}.demand").as_str().into(),
            "".into(),
            BasicPublishOptions::default(),
            &demand.encode(),
            lapin::BasicProperties::default(),
        )
        .await?
        .await?;
    a.wait_cycles(5).await?;
    let tb = vq_tests::harness::TestBroker::connect(&cluster, &[POOL]).await?;
    let left = tb.queue_len(&format!("{cluster}.demand")).await?;
    ensure!(left == 1, "no standby consumed the demand: {left} left");
    // The lock freed, the new leader takes the demand and boots for it.
    let _ = lock_conn.close(200, "done".into()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (servers, _) = sim_servers(&sim).await?;
        if servers.len() as u64 == SIZE {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the leader never booted for the demand; A:\n{}\nB:\n{}",
            a.log(),
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(tb.queue_len(&format!("{cluster}.demand")).await? == 0);
    sim.shutdown().await;
    Ok(())
}
