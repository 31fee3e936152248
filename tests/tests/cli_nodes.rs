//! `vq nodes` and `vq pools -v` against a real controller (issue 13): a
//! controller on vq-cloudsim boots a VM for a waiting job, whose real agent
//! runs it (the job waits until the test releases it). While it runs:
//! `vq nodes` shows the server with its pool, `ACTIVE`, agent `busy` and
//! the job id; `vq nodes --json` parses and names the job; `vq nodes
//! nosuchpool` exits 64 listing the pools; `vq pools -v` lists the VM under
//! its pool. Released, the job ends and the server shows no job.
//!
//! Root (rabbitmqctl creates the broker accounts, the job runs as
//! the test user `vqt-alice`): `cargo test -p vq-tests --test cli_nodes -- --include-ignored
//! --nocapture` (prints the commands' output).

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde_json::Value;
use vq_tests::accounts;
use vq_tests::cloudsim::{Sim, SimConfig};
use vq_tests::harness::{
    build_bin, ensure_test_user, job, require_root, shared_broker, unique_cluster, ChildGuard,
    TestBroker,
};
use vq_tests::rabbit_node::free_port;

const POOL: &str = "nod";

/// `vq ARGS` against the controller at `base` for `cluster`.
fn vq(base: &str, cluster: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(build_bin("vq-cli", "vq")?)
        .args(args)
        .env("VQ_CONTROLLER_URL", base)
        .env("VQ_CLUSTER", cluster)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .output()?)
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Polls the controller's `/status` (every 200 ms, up to `timeout`) until
/// `pred` holds for the pool's entry; returns the entry.
async fn wait_pool(
    client: &reqwest::Client,
    base: &str,
    timeout: Duration,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = async {
            let st: Value = client
                .get(format!("{base}/status"))
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            anyhow::Ok(st["pools"][POOL].clone())
        }
        .await;
        match &last {
            Ok(p) if pred(p) => return Ok(p.clone()),
            _ => {}
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last pool entry: {last:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl, a test user)"]
async fn vq_nodes_and_vq_pools_v_show_the_vm_its_agent_and_its_job() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = unique_cluster();
    shared_broker()?;
    let suite = accounts::suite();
    let controller_url = shared_broker()?.url_of(&suite.controller);
    let agent_url = shared_broker()?.url_of(&suite.agent);
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;

    let agent_bin = build_bin("vq-jobagent", "jobagent")?;
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    build_bin("vq-cli", "vq")?;
    let tmp = tempfile::tempdir()?;
    let agent_cfg = tmp.path().join("jobagent.toml");
    std::fs::write(
        &agent_cfg,
        format!(
            "cluster = \"{cluster}\"\nslots = 1\nheartbeat_secs = 0.5\n{}{}",
            suite.agent_admins_toml(),
            suite.agent_submitters_toml()
        ),
    )?;
    let mut sim_cfg = SimConfig::new(tmp.path().join("sim"), &agent_bin, &agent_cfg);
    sim_cfg.boot_delay = Duration::from_millis(300);
    let sim = Sim::start(sim_cfg).await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller_cfg = tmp.path().join("controller.toml");
    std::fs::write(
        &controller_cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"{listen}\"\ninterval_secs = 0.5\nheartbeat_timeout_secs = 20.0\n\
             [broker]\nurl = \"{controller_url}\"\n[openstack]\ncloud = \"cloudsim\"\n\
             [pools.{POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{agent_url}\"\n\
             min = 0\nmax = 1\nslots = 1\nboot_timeout_secs = 60\nidle_secs = 600\n"
        ),
    )?;
    let mut cmd = Command::new(&controller_bin);
    cmd.arg("--config")
        .arg(&controller_cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info");
    let controller = ChildGuard::spawn(cmd)?;

    // A job that runs until the test creates its release file.
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let release = tmp.path().join("release");
    let tmp_mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(tmp.path(), tmp_mode)?;
    let mut j = job(
        POOL,
        &alice.name,
        "held",
        &format!(
            "while [ ! -e '{}' ]; do sleep 0.2; done\necho released\n",
            release.display()
        ),
    );
    let out_file = alice.home.join(format!("held.o{}", j.seq()));
    j.join = vq_common::messages::Join::Oe;
    broker.publish_job(&j).await?;

    let client = reqwest::Client::new();
    let base = format!("http://{listen}");
    let p = wait_pool(
        &client,
        &base,
        Duration::from_secs(120),
        "a server whose agent runs the job",
        |p| {
            p["servers"].as_array().is_some_and(|s| {
                s.len() == 1 && s[0]["agent_state"] == "busy" && s[0]["jobs"][0] == j.id.as_str()
            })
        },
    )
    .await
    .with_context(|| {
        format!(
            "the job's output in {}: {:?}",
            out_file.display(),
            std::fs::read_to_string(&out_file)
        )
    })?;
    let server = p["servers"][0]["name"]
        .as_str()
        .context("server name")?
        .to_string();

    // vq nodes: one line for the server.
    let o = vq(&base, &cluster, &["nodes"])?;
    println!("$ vq nodes\n{}", out(&o));
    ensure!(o.status.success(), "vq nodes: {:?} {}", o.status, err(&o));
    let text = out(&o);
    let lines: Vec<&str> = text.lines().collect();
    ensure!(lines.len() == 2, "one server expected:\n{text}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    ensure!(
        header.starts_with(&[
            "Server",
            "Pool",
            "Status",
            "Agent",
            "Jobs",
            "Age",
            "Heartbeat"
        ]),
        "{text}"
    );
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    ensure!(
        cells.len() >= 7
            && cells[..5] == [server.as_str(), POOL, "ACTIVE", "busy", j.id.as_str()]
            && cells[5] != "-"
            && cells[6] != "-",
        "vq nodes does not show the server, its pool, ACTIVE, busy, the job and the ages:\n{text}"
    );
    let o = vq(&base, &cluster, &["nodes", POOL])?;
    ensure!(
        o.status.success() && out(&o) == text,
        "vq nodes {POOL}: {}",
        out(&o)
    );

    // --json: the controller's entries with their pool.
    let o = vq(&base, &cluster, &["nodes", "--json"])?;
    ensure!(o.status.success(), "{}", err(&o));
    let list: Value = serde_json::from_slice(&o.stdout).context("vq nodes --json parses")?;
    let s = &list[0];
    ensure!(
        list.as_array().map(Vec::len) == Some(1)
            && s["name"] == server.as_str()
            && s["pool"] == POOL
            && s["status"] == "ACTIVE"
            && s["agent_state"] == "busy"
            && s["jobs"] == serde_json::json!([j.id]),
        "vq nodes --json: {list}"
    );

    // An unknown pool: a usage error naming the pools.
    let o = vq(&base, &cluster, &["nodes", "nosuchpool"])?;
    println!("$ vq nodes nosuchpool\n{}", err(&o));
    ensure!(o.status.code() == Some(64), "{:?} {}", o.status, err(&o));
    ensure!(
        err(&o).trim_end()
            == format!("vq: no pool named \"nosuchpool\" on cluster \"{cluster}\"; pools: {POOL}"),
        "{}",
        err(&o)
    );

    // vq pools -v: the VM under its pool's line.
    let o = vq(&base, &cluster, &["pools", "-v"])?;
    println!("$ vq pools -v\n{}", out(&o));
    ensure!(o.status.success(), "{}", err(&o));
    let text = out(&o);
    let lines: Vec<&str> = text.lines().collect();
    ensure!(
        lines.len() >= 4
            && lines[1].starts_with(POOL)
            && lines[2].starts_with("  Server")
            && lines[3].starts_with(&format!("  {server} "))
            && lines[3].contains(" busy ")
            && lines[3].contains(&j.id),
        "vq pools -v does not list the VM under its pool:\n{text}"
    );
    let o = vq(&base, &cluster, &["pools"])?;
    ensure!(
        o.status.success() && !out(&o).contains(&server),
        "vq pools without -v lists servers: {}",
        out(&o)
    );

    // Released: the job ends, the server shows no job.
    std::fs::write(&release, b"")?;
    wait_pool(
        &client,
        &base,
        Duration::from_secs(60),
        "the job's end",
        |p| {
            p["servers"][0]["agent_state"] == "idle"
                && p["servers"][0]["jobs"]
                    .as_array()
                    .is_some_and(Vec::is_empty)
        },
    )
    .await?;
    let o = vq(&base, &cluster, &["nodes"])?;
    let cells: Vec<String> = out(&o)
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    ensure!(
        cells.get(3).map(String::as_str) == Some("idle")
            && cells.get(4).map(String::as_str) == Some("-"),
        "after the job: {}",
        out(&o)
    );

    let output = std::fs::read_to_string(&out_file).unwrap_or_default();
    ensure!(output == "released\n", "the job's output: {output:?}");
    let _ = std::fs::remove_file(&out_file);

    drop(controller);
    sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}
