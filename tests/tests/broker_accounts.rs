//! Broker accounts: a controller whose account lacks a documented
//! permission says which one, in its log, `/status` and `/readyz` (503;
//! `/healthz`, liveness, stays 200), and is ready again once the permission
//! is granted; an agent account without write on `<c>.replies` (made
//! before agents answered control requests) still drains, unanswered.
//!
//! Uses the machine's shared broker and `rabbitmqctl` (root):
//! `cargo test -p vq-tests --test broker_accounts -- --include-ignored`.

use std::time::Duration;

use anyhow::{bail, ensure};
use vq_common::topology::{Permissions, Role};
use vq_tests::accounts::{self, Clusters};
use vq_tests::harness::{
    require_root, shared_broker, start_controller_on_empty_cloud_at, unique_cluster, TestBroker,
};
use vq_tests::rabbit_node::free_port;

/// `GET url`: (status code, body).
async fn get(client: &reqwest::Client, url: &str) -> anyhow::Result<(u16, String)> {
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
) -> anyhow::Result<(u16, String)> {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn a_controller_lacking_write_on_the_control_exchange_is_not_ready_and_names_the_permission(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = unique_cluster();
    let pool = "perm";
    // The controller's documented permissions, minus write on <c>.control
    // (its own control queues stay writable).
    let full = Permissions::for_role(Role::Controller, &cluster);
    let mut lacking = full.clone();
    lacking.write = format!(r"^({cluster}\.(?!control$).*|amq\.gen-.*)$");
    let ctl = accounts::account(Role::Controller, "vqt-perm-controller");
    accounts::create_with(&[(ctl.clone(), lacking)], accounts::import_shared)?;
    let url = shared_broker()?.url_of(&ctl);
    // The topology exists (declared with the same account: declaring needs
    // no write on the exchange).
    let broker = TestBroker::connect_url(&url, &cluster, &[pool]).await?;

    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let controller =
        start_controller_on_empty_cloud_at(&url, &cluster, pool, "info", &listen).await?;
    let client = reqwest::Client::new();
    let readyz = format!("http://{listen}/readyz");
    let exchange = format!("{cluster}.control");
    // Not ready before the first cycle, too: wait for the refusal itself.
    let (code, body) = wait_http(
        &client,
        &readyz,
        Duration::from_secs(30),
        "a /readyz naming the refusal",
        |code, body| code != 200 && body.contains("ACCESS_REFUSED"),
    )
    .await?;
    ensure!(code == 503, "/readyz answered {code}: {body}");
    ensure!(
        body.contains("ACCESS_REFUSED")
            && body.contains(&format!("write permission on exchange '{exchange}'"))
            && body.contains(&ctl.user),
        "/readyz must name the missing permission: {body}"
    );
    let (code, body) = get(&client, &format!("http://{listen}/healthz")).await?;
    ensure!(
        code == 200 && body == "ok",
        "/healthz is liveness only: {code} {body}"
    );
    let (_, status) = get(&client, &format!("http://{listen}/status")).await?;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    let refused = status["broker_access_refused"].as_str().unwrap_or_default();
    ensure!(
        refused.contains(&format!("write permission on exchange '{exchange}'")),
        "/status broker_access_refused: {status}"
    );
    // The pool's last error carries the whole cause chain.
    let last_error = status["pools"][pool]["last_error"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        last_error.contains("alarm probe") && last_error.contains(&exchange),
        "/status pools.{pool}.last_error: {status}"
    );

    // Granted the documented permissions, it is ready again.
    accounts::create(&[ctl], Clusters::Named(&cluster), accounts::import_shared)?;
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "a ready /readyz after the permission was granted",
        |code, body| code == 200 && body == "ready",
    )
    .await?;

    drop(controller.guard);
    controller.sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn an_inspector_takes_dead_letters_and_reads_nothing_else() -> anyhow::Result<()> {
    use lapin::options::BasicGetOptions;
    use vq_common::amqp::{connect, publish_confirmed};
    use vq_common::config::BrokerConfig;
    if !require_root() {
        return Ok(());
    }
    let cluster = unique_cluster();
    let pool = "insp";
    let ctl = accounts::account(Role::Controller, "vqt-insp-controller");
    let inspector = accounts::account(Role::Inspector, "vqt-insp-inspector");
    accounts::create(
        &[ctl.clone(), inspector.clone()],
        Clusters::Named(&cluster),
        accounts::import_shared,
    )?;
    let broker = TestBroker::connect_url(&shared_broker()?.url_of(&ctl), &cluster, &[pool]).await?;
    publish_confirmed(
        &broker.ch,
        &broker.topo.dead_exchange(),
        pool,
        b"dead",
        lapin::BasicProperties::default(),
        false,
        Duration::from_secs(10),
    )
    .await?;
    let cfg = BrokerConfig {
        url: shared_broker()?.url_of(&inspector),
        ..Default::default()
    };
    let conn = connect(&cfg, "vq-tests inspector").await?;
    let ch = conn.create_channel().await?;
    let got = ch
        .basic_get(
            broker.topo.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?;
    ensure!(
        got.is_some_and(|m| m.delivery.data == b"dead"),
        "the inspector must take the dead letter"
    );
    let pool_queue = broker.topo.pool_queue(pool);
    let refused = ch
        .basic_get(pool_queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await;
    ensure!(
        refused.as_ref().is_err_and(
            |e| vq_common::amqp::lapin_reply_code(e) == Some(vq_common::amqp::ACCESS_REFUSED)
        ),
        "the inspector must not read {pool_queue}: {refused:?}"
    );
    let _ = conn.close(200, "done".into()).await;
    broker.cleanup().await;
    Ok(())
}

/// Lines of `path` containing `needle` (0 while the file does not exist).
fn log_count(path: &std::path::Path, needle: &str) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().filter(|l| l.contains(needle)).count())
        .unwrap_or(0)
}

/// An agent whose account lacks a permission a claim needs (a site's
/// mistake) never takes a job it could not claim or report: each session
/// fails while proving its permissions, before it consumes, and sessions
/// that end so back off. The job stays in its pool, never delivered, and
/// runs once when the permission is granted. `lacking` is the agent's
/// documented permissions minus one; `refused` the resource the agent's
/// log must name.
async fn agent_lacking(
    tag: &str,
    lacking: impl FnOnce(&str, &mut Permissions),
    refused: impl FnOnce(&str, &str) -> String,
) -> anyhow::Result<()> {
    use lapin::options::{BasicGetOptions, BasicRejectOptions};
    use vq_tests::harness::{ensure_test_user, job, AgentLaunch};
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "noperm";
    let mut perms = Permissions::for_role(Role::Agent, &cluster);
    lacking(&cluster, &mut perms);
    let agent_acct = accounts::account(Role::Agent, &format!("vqt-{tag}-agent"));
    accounts::create_with(&[(agent_acct.clone(), perms)], accounts::import_shared)?;
    let url = shared_broker()?.url_of(&agent_acct);

    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let j = job(pool, &alice.name, tag, "echo ran-once\n");
    broker.publish_job(&j).await?;

    let dir = tempfile::tempdir()?;
    let log = dir.path().join("agent.log");
    let agent_id = format!("{cluster}-a1");
    let refused = refused(&cluster, &agent_id);
    let launch = AgentLaunch {
        url: &url,
        cluster: &cluster,
        pool,
        agent_id: &agent_id,
        extra_toml: "",
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&log),
        args: &[],
        env: &[],
    };
    let guard = launch.spawn()?;
    // Five sessions, each refused at its first heartbeat.
    let ended = "broker session ended";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while log_count(&log, ended) < 5 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the agent did not end 5 sessions in 90 s; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(guard);
    let text = std::fs::read_to_string(&log)?;
    // In the agent's own words, not only lapin's.
    ensure!(
        text.lines().any(|l| l.contains("vq_jobagent")
            && l.contains("ACCESS_REFUSED")
            && l.contains(&refused)),
        "the agent's log must name the refused {refused}:\n{text}"
    );
    // Backed off: the waits between sessions grew (each in [c/2, c] for
    // c = 0.5 s, 1 s, 2 s, 4 s), so 5 sessions took at least 3.75 s; at a
    // constant 0.5 s they take at most 2 s plus the sessions themselves.
    let starts: Vec<_> = text
        .lines()
        .filter(|l| l.contains(ended))
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(chrono_like_secs)
        .collect();
    ensure!(
        starts.len() >= 5 && starts[4] - starts[0] >= 3.75,
        "sessions that end at once must back off; session ends at {starts:?}:\n{text}"
    );

    // Never delivered: the job is in its pool without a delivery count,
    // and nothing was dead-lettered or started.
    let ch = broker.conn.create_channel().await?;
    let got = ch
        .basic_get(
            broker.topo.pool_queue(pool).as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("the job left its pool queue:\n{text}"))?;
    let count = got
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").cloned())
        .and_then(|v| match v {
            lapin::types::AMQPValue::LongLongInt(n) => Some(n),
            lapin::types::AMQPValue::LongInt(n) => Some(i64::from(n)),
            _ => None,
        });
    // Quorum queues count earlier deliveries: 0 (or none) on the first.
    ensure!(
        count.unwrap_or(0) == 0,
        "the job was delivered to an agent that could not report it (x-delivery-count {count:?}):\n{text}"
    );
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: true })
        .await?;
    let _ = ch.close(200, "done".into()).await;
    ensure!(
        broker.take_dead().await?.is_empty(),
        "dead letters:\n{text}"
    );
    ensure!(
        tap.events(&j.id, "started").is_empty(),
        "the job started without events"
    );

    // Granted the documented permissions, the agent runs the job once.
    accounts::create(
        &[agent_acct],
        Clusters::Named(&cluster),
        accounts::import_shared,
    )?;
    let _guard = launch.spawn()?;
    tap.wait_for(Duration::from_secs(60), "the job's result", |k, v| {
        k.ends_with(".finished") && v["job_id"] == j.id.as_str()
    })
    .await?;
    ensure!(tap.events(&j.id, "started").len() == 1, "started once");
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn an_agent_that_cannot_publish_events_takes_no_job_and_backs_off() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    agent_lacking(
        "noev",
        |c, p| p.write = format!(r"^{c}\.(dead|lease|agents|(jobs|lease|control)\.[^.]+)$"),
        |c, _| format!("exchange '{c}.events'"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn an_agent_that_cannot_write_lease_copies_takes_no_job_and_backs_off() -> anyhow::Result<()>
{
    if !require_root() {
        return Ok(());
    }
    agent_lacking(
        "nolease",
        |c, p| p.write = format!(r"^{c}\.(events|dead|agents|(jobs|lease|control)\.[^.]+)$"),
        |c, _| format!("exchange '{c}.lease'"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn an_agent_that_cannot_declare_claim_markers_takes_no_job_and_backs_off(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    agent_lacking(
        "noclaim",
        |c, p| {
            p.configure = format!(
                r"^{c}\.(jobs|dead|events|demand|control|lease|agents|(jobs|lease|control)\.[^.]+)$"
            )
        },
        |c, agent| format!("queue '{c}.claim..probe.{agent}'"),
    )
    .await
}

/// Seconds since midnight of a tracing timestamp such as
/// `2026-12-02T05:41:20.123456Z` (`None` if it is not one).
fn chrono_like_secs(t: &str) -> Option<f64> {
    let time = t.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// An agent account made before agents answered control requests (no
/// write on `<c>.replies`): the agent still follows an operator's drain,
/// its refused answer closes only the answer's own channel (the session
/// lives on, no reconnect), its log names the permission, and `vq drain`
/// says that no answer came (exit 69).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn an_agent_that_cannot_write_replies_still_drains_unanswered_in_the_same_session(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    use vq_tests::harness::{broker_url, build_bin, wait_agent_up, AgentLaunch};
    let cluster = unique_cluster();
    let pool = "norep";
    let mut perms = Permissions::for_role(Role::Agent, &cluster);
    // The documented rule before `replies` (test cluster names have no
    // regex characters).
    let c = &cluster;
    perms.write = format!(r"^{c}\.(events|dead|lease|agents|(jobs|lease|control)\.[^.]+)$");
    let agent_acct = accounts::account(Role::Agent, "vqt-norep-agent");
    accounts::create_with(&[(agent_acct.clone(), perms)], accounts::import_shared)?;
    let url = shared_broker()?.url_of(&agent_acct);

    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("agent.log");
    let agent_id = format!("{cluster}-a1");
    let launch = AgentLaunch {
        url: &url,
        cluster: &cluster,
        pool,
        agent_id: &agent_id,
        extra_toml: "",
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&log),
        args: &[],
        env: &[],
    };
    let _guard = launch.spawn()?;
    wait_agent_up(&mut tap, &agent_id).await?;

    let bin = build_bin("vq-cli", "vq")?;
    let admin = broker_url(Role::Controller)?;
    let (cl, ag) = (cluster.clone(), agent_id.clone());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .env("VQ_BROKER_URL", admin)
            .env("VQ_CLUSTER", cl)
            .env("XDG_CONFIG_HOME", "/nonexistent")
            .args(["drain", &ag, "--timeout", "3"])
            .output()
    })
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(69), "{:?}: {stderr}", out.status);
    ensure!(stderr.contains("did not answer within 3 s"), "{stderr}");
    // Followed all the same: idle, so drained at once.
    tap.wait_for(Duration::from_secs(10), "drained", |k, v| {
        k.ends_with(".drained") && v["agent"] == agent_id.as_str()
    })
    .await?;
    let text = std::fs::read_to_string(&log)?;
    ensure!(
        text.lines()
            .any(|l| l.contains("cannot answer a control request")
                && l.contains("ACCESS_REFUSED")
                && l.contains(&format!("{cluster}.replies"))),
        "the agent's log must name the refused exchange:\n{text}"
    );
    ensure!(
        !text.contains("broker session ended"),
        "a refused answer must not end the session:\n{text}"
    );
    broker.cleanup().await;
    Ok(())
}
