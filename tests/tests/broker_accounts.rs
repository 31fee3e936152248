//! Broker accounts: a controller whose account lacks a documented
//! permission says which one, in its log, `/status` and `/healthz` (503),
//! and is healthy again once the permission is granted.
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
async fn a_controller_lacking_write_on_the_control_exchange_is_unhealthy_and_names_the_permission(
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
    let healthz = format!("http://{listen}/healthz");
    let (code, body) = wait_http(
        &client,
        &healthz,
        Duration::from_secs(30),
        "an unhealthy /healthz",
        |code, _| code != 200,
    )
    .await?;
    let exchange = format!("{cluster}.control");
    ensure!(code == 503, "/healthz answered {code}: {body}");
    ensure!(
        body.contains("ACCESS_REFUSED")
            && body.contains(&format!("write permission on exchange '{exchange}'"))
            && body.contains(&ctl.user),
        "/healthz must name the missing permission: {body}"
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

    // Granted the documented permissions, it is healthy again.
    accounts::create(&[ctl], Clusters::Named(&cluster), accounts::import_shared)?;
    wait_http(
        &client,
        &healthz,
        Duration::from_secs(60),
        "a healthy /healthz after the permission was granted",
        |code, body| code == 200 && body == "ok",
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
