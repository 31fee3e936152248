//! The status page as a person sees it: a controller on vq-cloudsim boots
//! two VMs for two waiting jobs; once both agents sent heartbeats, headless
//! Chromium (Debian's `chromium`, installed by `scripts/ensure-chromium.sh`)
//! loads `/` and the rendered DOM must show the pool, its counts as
//! `/status` gives them, and each server by name with its Nova status.
//! Screenshots (laptop 1280×900 and phone 390×844) are kept as artefacts
//! in `target/artefacts/status-page.png` and `status-page-phone.png`.
//!
//! Root (rabbitmqctl creates the broker accounts, jobs run as `nobody`):
//! `cargo test -p vq-tests --test status_page_browser -- --include-ignored`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde_json::Value;
use vq_tests::accounts;
use vq_tests::cloudsim::{Sim, SimConfig};
use vq_tests::harness::{
    build_bin, job, require_root, shared_broker, unique_cluster, ChildGuard, TestBroker,
};
use vq_tests::rabbit_node::free_port;

const POOL: &str = "web";

/// The browser: `VQ_TEST_CHROMIUM` or `chromium` on the PATH.
fn chromium() -> String {
    std::env::var("VQ_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into())
}

/// Runs headless Chromium with `args` then `url` (a fresh profile in
/// `profile`), and returns its stdout.
async fn chromium_run(profile: &Path, args: &[&str], url: &str) -> anyhow::Result<String> {
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .arg(url)
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .context("chromium did not finish within 120 s")?
        .with_context(|| {
            format!(
                "run {} (scripts/ensure-chromium.sh installs it)",
                chromium()
            )
        })?;
    ensure!(
        out.status.success(),
        "chromium {args:?} {url}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `target/artefacts/` of this workspace (or of `CARGO_TARGET_DIR`).
fn artefacts() -> anyhow::Result<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("artefacts");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn status(client: &reqwest::Client, base: &str) -> anyhow::Result<Value> {
    Ok(client
        .get(format!("{base}/status"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

/// A pool's counts (page label, value) and servers (name, Nova status).
type PoolView = (Vec<(String, u64)>, Vec<(String, String)>);

/// The pool's counts and server names in a `/status` document, to compare
/// two documents and the page.
fn counts(st: &Value) -> Option<PoolView> {
    let p = st.get("pools")?.get(POOL)?;
    let n = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
    let c = vec![
        ("queued".into(), n(&p["queued"])),
        ("running".into(), n(&p["running"])),
        ("target VMs".into(), n(&p["target"])),
        ("booting".into(), n(&p["vms"]["booting"])),
        ("active".into(), n(&p["vms"]["active"])),
        ("draining".into(), n(&p["vms"]["draining"])),
        ("error".into(), n(&p["vms"]["error"])),
    ];
    let servers = p["servers"]
        .as_array()?
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap_or("").to_string(),
                s["status"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    Some((c, servers))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl) and chromium"]
async fn the_status_page_shows_the_pool_its_counts_and_its_vms_in_a_real_browser(
) -> anyhow::Result<()> {
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
             min = 0\nmax = 2\nslots = 1\nboot_timeout_secs = 60\nidle_secs = 600\n"
        ),
    )?;
    let mut cmd = Command::new(&controller_bin);
    cmd.arg("--config")
        .arg(&controller_cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info");
    let controller = ChildGuard::spawn(cmd)?;

    // Two long jobs: two VMs boot and each agent runs one.
    for i in 0..2 {
        let mut j = job(POOL, "nobody", &format!("page{i}"), "sleep 300\n");
        j.workdir = Some("/tmp".into());
        j.stdout = Some("/dev/null".into());
        j.stderr = Some("/dev/null".into());
        broker.publish_job(&j).await?;
    }

    let client = reqwest::Client::new();
    let base = format!("http://{listen}");
    // Both servers have an agent that sent heartbeats.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let last = status(&client, &base).await;
        if let Ok(st) = &last {
            let servers = st["pools"][POOL]["servers"].as_array().cloned();
            if servers.is_some_and(|s| {
                s.len() == 2
                    && s.iter()
                        .all(|s| !s["heartbeat_age_secs"].is_null() && s["status"] == "ACTIVE")
            }) {
                break;
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for two VMs with agents; last /status: {last:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The page as Chromium renders it, between two equal /status reads (a
    // cycle may change the counts meanwhile: then read again).
    let profile = tmp.path().join("chromium");
    let mut tries = 0;
    let (dom, expected) = loop {
        tries += 1;
        let before = counts(&status(&client, &base).await?);
        let dom = chromium_run(&profile, &["--dump-dom"], &format!("{base}/")).await?;
        let after = counts(&status(&client, &base).await?);
        if before.is_some() && before == after {
            break (dom, after.unwrap());
        }
        ensure!(tries < 10, "/status kept changing: {before:?} / {after:?}");
    };
    ensure!(
        dom.contains(&format!("vq cluster {cluster}")),
        "no cluster name:\n{dom}"
    );
    ensure!(
        dom.contains(&format!("<h3>Pool {POOL}</h3>")),
        "no pool:\n{dom}"
    );
    let (counts, servers) = expected;
    for (label, v) in &counts {
        ensure!(
            dom.contains(&format!("<dt>{label}</dt><dd>{v}</dd>")),
            "{label} {v} (as /status says) not on the page:\n{dom}"
        );
    }
    ensure!(servers.len() == 2, "{servers:?}");
    for (name, nova) in &servers {
        ensure!(
            dom.contains(&format!(">{name}</td><td>{nova}</td>")),
            "server {name} ({nova}) not on the page:\n{dom}"
        );
    }
    ensure!(
        dom.contains("Recent decisions") && dom.contains("<td>boot</td>"),
        "{dom}"
    );

    let dir = artefacts()?;
    for (file, size) in [
        ("status-page.png", "1280,900"),
        ("status-page-phone.png", "390,844"),
    ] {
        let path = dir.join(file);
        let _ = std::fs::remove_file(&path);
        chromium_run(
            &profile,
            &[
                &format!("--screenshot={}", path.display()),
                &format!("--window-size={size}"),
            ],
            &format!("{base}/"),
        )
        .await?;
        let png = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        ensure!(
            png.len() > 1000 && png.starts_with(b"\x89PNG"),
            "{} is not a PNG screenshot",
            path.display()
        );
        eprintln!("screenshot: {}", path.display());
    }

    drop(controller);
    sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}
