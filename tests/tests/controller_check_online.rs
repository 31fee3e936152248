//! `vq-controller --check-config --online` (issue 13): the configuration
//! checked against the test cloud and the broker. A config with several
//! wrong names in one pool (flavor, image, network given by name, key pair,
//! one of two security groups) and a broker account that cannot log in, next
//! to a valid pool: every problem is listed with its key, none of the valid
//! pool, exit 64; in JSON one object per problem. A fully valid config
//! exits 0.
//!
//! `cargo test -p vq-tests --test controller_check_online -- --include-ignored`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};

use anyhow::{ensure, Result};
use vq_common::topology::Role;
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle, KEYPAIR_NAME, NETWORK_ID};
use vq_tests::harness::{broker_url, build_bin, require_root, unique_cluster, TestBroker};

const GOOD_POOL: &str = "good";

fn good_pool() -> String {
    format!(
        "[pools.{GOOD_POOL}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nnetwork = \"{NETWORK_ID}\"\n\
         key_name = \"{KEYPAIR_NAME}\"\nsecurity_groups = [\"default\"]\n\
         agent_broker_url = \"amqp://a:b@127.0.0.1:5672/%2f\"\nmax = 1\n"
    )
}

const BAD_POOL: &str = "[pools.gpu]\nflavor = \"x1.huge\"\nimage = \"no-such-image\"\n\
    network = \"private\"\nkey_name = \"nokey\"\nsecurity_groups = [\"default\", \"web\"]\n\
    agent_broker_url = \"amqp://a:b@127.0.0.1:5672/%2f\"\nmax = 1\n";

fn write_config(
    dir: &Path,
    sim: &SimHandle,
    cluster: &str,
    url: &str,
    pools: &str,
) -> Result<std::path::PathBuf> {
    let path = dir.join(format!("controller-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(
        &path,
        format!(
            "cluster = \"{cluster}\"\n[broker]\nurl = \"{url}\"\n[openstack]\ncloud = \"cloudsim\"\nclouds_yaml = \"{}\"\n{pools}",
            sim.clouds_yaml().display()
        ),
    )?;
    Ok(path)
}

fn check(bin: &Path, config: &Path, json: bool) -> Result<Output> {
    let mut cmd = Command::new(bin);
    cmd.args(["--check-config", "--online", "--config"])
        .arg(config)
        .env_remove("OS_CLOUD")
        .env_remove("OS_CLIENT_CONFIG_FILE")
        .env("RUST_LOG", "warn");
    if json {
        cmd.args(["--log-format", "json"]);
    }
    Ok(cmd.output()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn check_config_online_lists_every_wrong_name_with_its_key_and_passes_a_valid_config(
) -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bin = build_bin("vq-controller", "vq-controller")?;
    let dir = tempfile::tempdir()?;
    let agent_cfg = dir.path().join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    let sim = Sim::start(SimConfig::new(
        dir.path().join("sim"),
        "/bin/true",
        &agent_cfg,
    ))
    .await?;
    let cluster = unique_cluster();
    let url = broker_url(Role::Controller)?;
    let broker = TestBroker::connect(&cluster, &[GOOD_POOL]).await?;

    // Several wrong names and a broker account that cannot log in.
    let bad_url = "amqp://vqt-no-such-user:wrong@127.0.0.1:5672/%2f";
    let bad = write_config(
        dir.path(),
        &sim,
        &cluster,
        bad_url,
        &format!("{}{BAD_POOL}", good_pool()),
    )?;
    let out = check(&bin, &bad, false)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--check-config --online of the wrong config:\n{stderr}");
    ensure!(
        out.status.code() == Some(64),
        "exit {:?}: {stderr}",
        out.status
    );
    for want in [
        "pools.gpu.flavor: no flavor \"x1.huge\" in project demo (have: m1.medium, m1.small, m1.tiny",
        "pools.gpu.image: no active image \"no-such-image\" in project demo (have: ",
        &format!("pools.gpu.network: \"private\" is the name of a network; network takes its id ({NETWORK_ID})"),
        &format!("pools.gpu.key_name: no key pair \"nokey\" of this user (have: {KEYPAIR_NAME})"),
        "pools.gpu.security_groups: no security group \"web\" in project demo (have: default)",
        "broker.url: cannot connect and declare the topology",
    ] {
        ensure!(stderr.contains(want), "no {want:?} in:\n{stderr}");
    }
    ensure!(
        !stderr.contains("pools.good") && !stderr.contains("\"default\" in project"),
        "the valid pool is reported:\n{stderr}"
    );

    // The same in JSON: one object per problem, with its key.
    let out = check(&bin, &bad, true)?;
    ensure!(out.status.code() == Some(64), "exit {:?}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problems: Vec<serde_json::Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("config").is_some())
        .collect();
    let keys: BTreeSet<&str> = problems.iter().filter_map(|p| p["key"].as_str()).collect();
    let want: BTreeSet<&str> = [
        "pools.gpu.flavor",
        "pools.gpu.image",
        "pools.gpu.network",
        "pools.gpu.key_name",
        "pools.gpu.security_groups",
        "broker.url",
    ]
    .into();
    ensure!(keys == want, "keys {keys:?}, want {want:?}:\n{stderr}");
    ensure!(
        problems.len() == want.len()
            && problems
                .iter()
                .all(|p| p["message"].as_str().is_some_and(|m| !m.is_empty())),
        "{problems:#?}"
    );

    // A fully valid config.
    let good = write_config(dir.path(), &sim, &cluster, &url, &good_pool())?;
    let out = check(&bin, &good, false)?;
    ensure!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        String::from_utf8_lossy(&out.stdout).contains("matches the cloud and the broker"),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    broker.cleanup().await;
    sim.shutdown().await;
    Ok(())
}
