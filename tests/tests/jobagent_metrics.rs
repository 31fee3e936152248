//! What an operator scrapes from a jobagent: its JSON log
//! (`--log-format json`), every stderr line one JSON object, a job's lines
//! with pool, agent and job id; and its `/metrics` (`metrics_listen`).
//!
//! Run as root: `cargo test -p vq-tests --test jobagent_metrics -- --include-ignored`.

use std::process::Command;
use std::time::Duration;

use vq_common::topology::Role;
use vq_tests::harness::{
    broker_url, build_bin, ensure_test_user, job, require_root, unique_cluster, wait_agent_up,
    AgentLaunch, TestBroker,
};

const POOL: &str = "batch";
const EVENT_WAIT: Duration = Duration::from_secs(30);

/// Every line of `log` parsed as JSON; panics naming the first line that
/// is not.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l:?}"))
        })
        .collect()
}

#[test]
fn a_bad_config_is_reported_as_one_json_line_with_log_format_json() -> anyhow::Result<()> {
    let bin = build_bin("vq-jobagent", "jobagent")?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("jobagent.toml");
    std::fs::write(&config, "slots = 0\nheartbeat_secs = \"often\"\n")?;
    let out = Command::new(bin)
        .arg("--log-format")
        .arg("json")
        .arg("--config")
        .arg(&config)
        .arg("--identity")
        .arg(dir.path().join("missing-identity.toml"))
        .env_remove("RUST_LOG")
        .output()?;
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    let log = String::from_utf8(out.stderr)?;
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 1, "{log}");
    let line = &lines[0];
    assert_eq!(line["level"], "ERROR", "{line}");
    assert_eq!(line["fields"]["message"], "invalid configuration", "{line}");
    let error = line["fields"]["error"].as_str().unwrap_or_default();
    for key in ["slots:", "heartbeat_secs:", "identity file"] {
        assert!(error.contains(key), "{key} missing in {error}");
    }
    assert!(line["timestamp"].is_string(), "{line}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_json_log_is_all_json_and_a_jobs_lines_carry_pool_agent_and_job_id() -> anyhow::Result<()>
{
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-a1");
    let dir = tempfile::tempdir()?;
    let log_path = dir.path().join("agent.log");
    let url = broker_url(Role::Agent)?;
    let mut agent = AgentLaunch {
        url: &url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &agent_id,
        extra_toml: "",
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&log_path),
        args: &["--log-format", "json", "--drain-grace-secs", "5"],
        env: &[],
    }
    .spawn()?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let j = job(POOL, &alice.name, "jsonlog", "echo hello\n");
    broker.publish_job(&j).await?;
    let fin = tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    let status = agent.wait_timeout(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");

    let log = std::fs::read_to_string(&log_path)?;
    let lines = json_lines(&log);
    let starting = lines
        .iter()
        .find(|l| l["fields"]["message"] == "jobagent starting")
        .unwrap_or_else(|| panic!("no start line in\n{log}"));
    assert_eq!(starting["fields"]["pool"], POOL, "{starting}");
    let job_lines: Vec<_> = lines
        .iter()
        .filter(|l| l["span"]["job_id"] == j.id.as_str())
        .collect();
    for message in ["job starting", "job ended"] {
        let line = job_lines
            .iter()
            .find(|l| l["fields"]["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line of job {} in\n{log}", j.id));
        assert_eq!(line["span"]["pool"], POOL, "{line}");
        assert_eq!(line["span"]["agent"], agent_id.as_str(), "{line}");
        assert_eq!(line["spans"][0]["name"], "job", "{line}");
    }
    let _ = std::fs::remove_file(alice.home.join(format!("jsonlog.o{}", j.seq())));
    let _ = std::fs::remove_file(alice.home.join(format!("jsonlog.e{}", j.seq())));
    broker.cleanup().await;
    Ok(())
}
