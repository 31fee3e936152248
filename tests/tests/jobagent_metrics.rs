//! What an operator scrapes from a jobagent: its JSON log
//! (`--log-format json`), every stderr line one JSON object, a job's lines
//! with pool, agent and job id; and its `/metrics` (`metrics_listen`).
//!
//! Run as root: `cargo test -p vq-tests --test jobagent_metrics -- --include-ignored`.

use std::process::Command;
use std::time::Duration;

use vq_common::topology::Role;
use vq_tests::harness::{
    broker_url, build_bin, ensure_test_user, job, one_agent, require_root, unique_cluster,
    wait_agent_up, AgentLaunch, TestBroker,
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

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The TCP ports process `pid` listens on: its socket inodes
/// (`/proc/PID/fd`) matched with the LISTEN entries of `/proc/net/tcp{,6}`.
fn listening_ports(pid: u32) -> anyhow::Result<Vec<u16>> {
    let mut inodes = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(fd?.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
        {
            inodes.push(inode.to_string());
        }
    }
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address = 1, st = 3 (0A = LISTEN), inode = 9.
            if cols.len() > 9 && cols[3] == "0A" && inodes.iter().any(|i| i == cols[9]) {
                let port = cols[1].rsplit(':').next().unwrap_or("0");
                ports.push(u16::from_str_radix(port, 16)?);
            }
        }
    }
    Ok(ports)
}

/// `GET /metrics` on `port`: (status line, content type, body).
async fn scrape(port: u16) -> anyhow::Result<(String, String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head.lines().next().unwrap_or_default().to_string();
    let ctype = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type: ")
                .map(str::to_string)
        })
        .unwrap_or_default();
    Ok((status, ctype, body.to_string()))
}

/// The value of sample `name` (with its labels, as written) in `text`.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
    })
}

/// Scrapes `port` until `ok` holds for the text (the agent updates its
/// state a moment after the event the test saw), at most 20 s.
async fn scrape_until(port: u16, what: &str, ok: impl Fn(&str) -> bool) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let last = scrape(port).await.map(|(_, _, body)| body);
        if let Ok(body) = &last {
            if ok(body) {
                return Ok(body.clone());
            }
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("/metrics never showed {what}; last scrape: {last:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn metrics_listen_serves_slots_jobs_by_outcome_broker_and_heartbeats() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let port = free_port()?;
    let mut s = one_agent(
        POOL,
        &format!("metrics_listen = \"127.0.0.1:{port}\"\n"),
        &[],
    )
    .await?;
    assert_eq!(listening_ports(s.agent.guard.id())?, vec![port]);
    let (status, ctype, text) = scrape(port).await?;
    assert!(status.contains(" 200 "), "{status}");
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert_eq!(sample(&text, "vq_agent_slots"), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "vq_agent_broker_connected"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, "vq_agent_jobs_running"), Some(0.0), "{text}");
    assert!(text.contains("vq_agent_build_info{version=\""), "{text}");
    // The harness waited for a heartbeat: it is counted.
    let text = scrape_until(port, "a heartbeat", |t| {
        sample(t, "vq_agent_heartbeats_sent_total").unwrap_or(0.0) >= 1.0
    })
    .await?;
    let last = sample(&text, "vq_agent_last_heartbeat_timestamp_seconds").unwrap_or(0.0);
    assert!(last > 1.7e9, "{text}");

    let j = job(POOL, &s.alice.name, "metered", "echo hello\n");
    let refused = job(POOL, "root", "asroot", "id -u");
    s.broker.publish_job(&j).await?;
    s.broker.publish_job(&refused).await?;
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    s.tap.job_event(&refused.id, "failed", EVENT_WAIT).await?;
    let text = scrape_until(port, "the job released", |t| {
        sample(t, "vq_agent_jobs_running") == Some(0.0)
            && sample(t, "vq_agent_jobs_total{outcome=\"refused\"}") == Some(1.0)
    })
    .await?;
    assert_eq!(
        sample(&text, "vq_agent_jobs_total{outcome=\"exited\"}"),
        Some(1.0),
        "{text}"
    );
    for outcome in [
        "signaled",
        "walltime",
        "cancelled",
        "output_limit",
        "failed_to_start",
        "dead_lettered",
    ] {
        assert_eq!(
            sample(
                &text,
                &format!("vq_agent_jobs_total{{outcome=\"{outcome}\"}}")
            ),
            Some(0.0),
            "{outcome}: {text}"
        );
    }
    assert_eq!(
        sample(&text, "vq_agent_output_bytes_written_total"),
        Some("hello\n".len() as f64),
        "{text}"
    );
    assert_eq!(
        sample(&text, "vq_agent_broker_connected"),
        Some(1.0),
        "{text}"
    );
    let _ = std::fs::remove_file(s.alice.home.join(format!("metered.o{}", j.seq())));
    let _ = std::fs::remove_file(s.alice.home.join(format!("metered.e{}", j.seq())));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn without_metrics_listen_the_agent_listens_on_no_port() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let s = one_agent(POOL, "", &[]).await?;
    assert_eq!(listening_ports(s.agent.guard.id())?, Vec::<u16>::new());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}
