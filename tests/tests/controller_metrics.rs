//! The controller's metrics and readiness as an operator's monitoring sees
//! them: a controller on vq-cloudsim whose broker becomes unreachable (its
//! port refuses connections) says so on `/readyz` (503, with the reason)
//! and serves no stale pool values on `/metrics` (`vq_pool_observed` 0,
//! `vq_pool_queued` absent), while `/healthz` stays 200; once the broker is
//! reachable again it is ready and current again. Likewise when the cloud
//! answers its server listings 503 (a cloudsim fault rule). And on a
//! private RabbitMQ node that is stopped and restarted: `/readyz` 200, 503
//! with the reason while the node is down, 200 again after it is back (the
//! measured times printed, `--nocapture`).
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test controller_metrics -- --include-ignored`.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use vq_common::topology::Role;
use vq_tests::accounts;
use vq_tests::harness::{
    job, require_root, shared_broker, start_controller_on_empty_cloud_at, unique_cluster,
    TestBroker,
};
use vq_tests::rabbit_node::{free_port, NodeOptions, RabbitNode};

/// How long the controller may take to be ready again after its broker
/// node restarted (a deadline, not a measured figure: the pool's backoff
/// after the failed cycles is part of it).
const RECOVERY_DEADLINE_SECS: u64 = 300;

/// A TCP forwarder on a fixed local port that can be switched off (the
/// port refuses connections and open ones are closed, as when the broker
/// stops) and on again (the same port forwards again).
struct Gate {
    port: u16,
    upstream: SocketAddr,
    tasks: Mutex<Option<JoinSet<()>>>,
}

impl Gate {
    async fn open_on(port: u16, upstream: SocketAddr) -> anyhow::Result<Self> {
        let g = Gate {
            port,
            upstream,
            tasks: Mutex::new(None),
        };
        g.open().await?;
        Ok(g)
    }

    /// Forwards again (binds the port).
    async fn open(&self) -> anyhow::Result<()> {
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await?;
        let upstream = self.upstream;
        let mut set = JoinSet::new();
        set.spawn(async move {
            // Aborting this task drops the listener (the port refuses) and
            // this set, which aborts the forwarded connections.
            let mut conns = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                conns.spawn(forward(client, upstream));
                while conns.try_join_next().is_some() {}
            }
        });
        *self.tasks.lock().unwrap() = Some(set);
        Ok(())
    }

    /// Closes the port and every forwarded connection.
    fn close(&self) {
        if let Some(mut set) = self.tasks.lock().unwrap().take() {
            set.abort_all();
        }
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr) {
    if let Ok(mut server) = TcpStream::connect(upstream).await {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
    }
}

/// The shared broker's address (host and port of `VQ_TEST_BROKER_URL`).
async fn broker_addr() -> anyhow::Result<SocketAddr> {
    let url =
        std::env::var("VQ_TEST_BROKER_URL").unwrap_or_else(|_| "amqp://127.0.0.1:5672/%2f".into());
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let hostport = rest.split('/').next().unwrap_or(rest);
    let hostport = hostport.rsplit_once('@').map_or(hostport, |(_, h)| h);
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5672")
    };
    let mut addrs = tokio::net::lookup_host(hostport.as_str()).await?;
    addrs
        .next()
        .with_context(|| format!("cannot resolve {hostport}"))
}

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
async fn an_unreachable_broker_makes_the_controller_unready_and_its_pool_values_absent(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = unique_cluster();
    let pool = "mon";
    // Creates the suite's accounts.
    shared_broker()?;
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    // Three jobs wait in the pool (max = 0: nothing boots, they stay).
    for i in 0..3 {
        broker
            .publish_job(&job(pool, "nobody", &format!("wait{i}"), "true\n"))
            .await?;
    }
    let gate = Gate::open_on(free_port()?, broker_addr().await?).await?;
    let url = accounts::suite()
        .controller
        .url(&format!("amqp://127.0.0.1:{}/%2f", gate.port));
    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller = start_controller_on_empty_cloud_at(&url, &cluster, pool, "info", &listen)
        .await
        .context("start the controller")?;
    let client = reqwest::Client::new();
    let readyz = format!("http://{listen}/readyz");
    let metrics = format!("http://{listen}/metrics");
    let queued = format!("vq_pool_queued{{pool=\"{pool}\"}}");
    let observed = |v: u8| format!("vq_pool_observed{{pool=\"{pool}\"}} {v}");

    wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "a ready controller",
        |code, body| code == 200 && body == "ready",
    )
    .await?;
    let (_, m) = wait_http(
        &client,
        &metrics,
        Duration::from_secs(30),
        "the three queued jobs on /metrics",
        |_, m| m.contains(&format!("{queued} 3")),
    )
    .await?;
    ensure!(
        m.contains(&observed(1))
            && m.contains("vq_broker_connected 1")
            && m.contains("vq_build_info{")
            && m.contains(&format!(
                "vq_pool_last_success_timestamp_seconds{{pool=\"{pool}\"}}"
            ))
            && m.contains("vq_cloud_requests_total{op=\"list_servers\",status=\"200\"}")
            && m.contains("vq_quota_used{resource=\"instances\"} 0")
            && m.contains(&format!(
                "vq_reconcile_duration_seconds_count{{pool=\"{pool}\"}}"
            )),
        "/metrics of a healthy controller:\n{m}"
    );

    // The broker's port refuses connections.
    gate.close();
    let (code, body) = wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "an unready controller naming the broker",
        |code, body| code == 503 && body.contains("not connected to the broker"),
    )
    .await?;
    ensure!(code == 503, "{body}");
    let (_, m) = wait_http(
        &client,
        &metrics,
        Duration::from_secs(30),
        "the pool unobserved on /metrics",
        |_, m| m.contains(&observed(0)),
    )
    .await?;
    ensure!(
        !m.contains(&queued)
            && !m.contains("vq_quota_used{")
            && m.contains("vq_broker_connected 0"),
        "stale or wrong values while the broker is unreachable:\n{m}"
    );
    let (code, body) = get(&client, &format!("http://{listen}/healthz")).await?;
    ensure!(
        code == 200 && body == "ok",
        "/healthz is liveness: {code} {body}"
    );
    let (_, status) = get(&client, &format!("http://{listen}/status")).await?;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    ensure!(
        status["pools"][pool]["observed"] == false && status["broker_connected"] == false,
        "/status while the broker is unreachable: {status}"
    );

    // Reachable again: ready and current (after the pool's backoff).
    gate.open().await?;
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(120),
        "a ready controller after the broker came back",
        |code, body| code == 200 && body == "ready",
    )
    .await?;
    let (_, m) = wait_http(
        &client,
        &metrics,
        Duration::from_secs(30),
        "current values again",
        |_, m| m.contains(&format!("{queued} 3")),
    )
    .await?;
    ensure!(
        m.contains(&observed(1))
            && m.contains("vq_broker_connected 1")
            && m.contains("vq_broker_reconnects_total 1"),
        "/metrics after the broker came back:\n{m}"
    );

    drop(controller.guard);
    controller.sim.shutdown().await;
    gate.close();
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl)"]
async fn a_cloud_that_cannot_list_servers_makes_the_controller_unready_until_it_can(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = unique_cluster();
    let pool = "monc";
    let url = shared_broker()?.url_of(&accounts::suite().controller);
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller = start_controller_on_empty_cloud_at(&url, &cluster, pool, "info", &listen)
        .await
        .context("start the controller")?;
    let client = reqwest::Client::new();
    let readyz = format!("http://{listen}/readyz");
    let metrics = format!("http://{listen}/metrics");
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "a ready controller",
        |code, body| code == 200 && body == "ready",
    )
    .await?;

    // The next three server listings fail with 503.
    let faults = serde_json::json!({"fail_next": [{
        "method": "GET", "path_prefix": "/compute/v2.1/servers", "status": 503, "count": 3
    }]});
    let r = client
        .post(format!("{}/_sim/faults", controller.sim.base_url()))
        .json(&faults)
        .send()
        .await?;
    ensure!(r.status().is_success(), "cloudsim faults: {}", r.status());
    let (_, body) = wait_http(
        &client,
        &readyz,
        Duration::from_secs(30),
        "an unready controller naming the cloud",
        |code, body| code == 503 && body.contains("the cloud cannot be read"),
    )
    .await?;
    ensure!(
        body.contains("HTTP 503") && !body.contains("not connected to the broker"),
        "/readyz must give the cloud's answer and only that: {body}"
    );
    let (_, m) = get(&client, &metrics).await?;
    ensure!(
        m.contains(&format!("vq_pool_observed{{pool=\"{pool}\"}} 0"))
            && !m.contains(&format!("vq_pool_queued{{pool=\"{pool}\"}}"))
            && m.contains("vq_cloud_requests_total{op=\"list_servers\",status=\"503\"}")
            && !m.contains("vq_quota_used{")
            && m.contains("vq_broker_connected 1"),
        "/metrics while the cloud cannot list servers:\n{m}"
    );

    // The rule used up, the controller is ready again.
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(120),
        "a ready controller once the cloud lists servers again",
        |code, body| code == 200 && body == "ready",
    )
    .await?;
    let (_, m) = get(&client, &metrics).await?;
    ensure!(
        m.contains(&format!("vq_pool_observed{{pool=\"{pool}\"}} 1"))
            && m.contains(&format!("vq_pool_queued{{pool=\"{pool}\"}} 0")),
        "/metrics once the cloud lists servers again:\n{m}"
    );

    drop(controller.guard);
    controller.sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (a private RabbitMQ node)"]
async fn readyz_recovers_when_a_stopped_broker_node_is_restarted() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut node = RabbitNode::start_new(NodeOptions::default()).await?;
    let cluster = unique_cluster();
    let pool = "monr";
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[pool]).await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller = start_controller_on_empty_cloud_at(
        &node.role_url(Role::Controller),
        &cluster,
        pool,
        "info",
        &listen,
    )
    .await
    .context("start the controller")?;
    let client = reqwest::Client::new();
    let readyz = format!("http://{listen}/readyz");
    let started = tokio::time::Instant::now();
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "a ready controller",
        |code, body| code == 200 && body == "ready",
    )
    .await?;
    let ready_after = started.elapsed();
    drop(broker);

    // The node stops (SIGTERM, as `systemctl stop`): not ready, the broker
    // named. Not SIGKILL: after a crash of this single node its stream
    // `<c>.events.log` stayed `down` for more than 5 minutes in trials, and
    // the controller, which declares it at every connection, with it.
    node.stop();
    let stopped = tokio::time::Instant::now();
    let (_, body) = wait_http(
        &client,
        &readyz,
        Duration::from_secs(60),
        "an unready controller naming the broker",
        |code, body| code == 503 && body.contains("not connected to the broker"),
    )
    .await?;
    let unready_after = stopped.elapsed();
    let (code, health) = get(&client, &format!("http://{listen}/healthz")).await?;
    ensure!(
        code == 200 && health == "ok",
        "/healthz is liveness: {code} {health}"
    );

    // The same node back on the same port: ready again.
    node.start().await?;
    let restarted = tokio::time::Instant::now();
    wait_http(
        &client,
        &readyz,
        Duration::from_secs(RECOVERY_DEADLINE_SECS),
        "a ready controller after the node restarted",
        |code, body| code == 200 && body == "ready",
    )
    .await
    .with_context(|| {
        let log: String = std::fs::read_dir(node.log_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .flat_map(|t| {
                t.lines()
                    .filter(|l| l.contains("[error]") || l.contains("crash"))
                    .map(|l| l.chars().take(400).collect::<String>() + "\n")
                    .collect::<Vec<_>>()
            })
            .collect();
        format!(
            "the node's queues: {:?}; errors in its log:\n{log}",
            node.ctl(&["list_queues", "name", "type", "state", "leader"])
        )
    })?;
    let ready_again_after = restarted.elapsed();
    let (_, m) = get(&client, &format!("http://{listen}/metrics")).await?;
    ensure!(
        m.contains("vq_broker_connected 1")
            && m.contains(&format!("vq_pool_observed{{pool=\"{pool}\"}} 1")),
        "/metrics after the node restarted:\n{m}"
    );
    println!(
        "readyz: ready {ready_after:.1?} after start; 503 {unready_after:.1?} after the node stopped ({}); \
         200 again {ready_again_after:.1?} after the node accepted connections again (node start took {:.1?})",
        body.lines().next().unwrap_or(""),
        node.last_start
    );

    drop(controller.guard);
    controller.sim.shutdown().await;
    Ok(())
}
