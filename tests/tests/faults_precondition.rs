//! A pool queue declared earlier with other arguments (here: a classic
//! queue with its own dead-letter exchange where vq wants a quorum queue
//! dead-lettering to `<c>.dead`): the agent logs a clear error naming the
//! queue, the argument and both values, and retries with a capped backoff
//! rather than in a tight loop.
//!
//! Uses a private RabbitMQ node. Root only:
//! `cargo test -p vq-tests --test faults_precondition -- --include-ignored`.

use std::time::Duration;

use anyhow::ensure;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use vq_common::config::BrokerConfig;
use vq_common::topology::Role;
use vq_tests::harness::{require_root, unique_cluster, AgentLaunch};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "pre";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_pool_queue_with_other_arguments_is_a_clear_error_retried_with_backoff(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let cluster = unique_cluster();
    let queue = format!("{cluster}.jobs.{POOL}");
    let conn = vq_common::amqp::connect(
        &BrokerConfig {
            // Declared earlier by the controller's account (e.g. an older
            // vq with other arguments).
            url: node.role_url(Role::Controller),
            ..Default::default()
        },
        "vq-tests precondition",
    )
    .await?;
    let ch = conn.create_channel().await?;
    // Another exchange of the cluster's (declaring a dead-letter exchange
    // needs write on it, which vq's accounts have on their cluster only).
    let elsewhere = format!("{cluster}.elsewhere");
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(elsewhere.as_str())),
    );
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await?;

    let dir = tempfile::tempdir()?;
    let log = dir.path().join("agent.log");
    let agent_id = format!("{cluster}-pre1");
    let agent_url = node.role_url(Role::Agent);
    let mut agent = AgentLaunch {
        url: &agent_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &agent_id,
        extra_toml: "",
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    ensure!(
        agent.try_wait().is_none(),
        "the agent exited instead of retrying:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let text = std::fs::read_to_string(&log)?;
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("PRECONDITION_FAILED") && l.contains("reconnecting"))
        .collect();
    eprintln!(
        "{} error line(s) in 6 s:\n{}",
        errors.len(),
        errors.join("\n")
    );
    ensure!(
        !errors.is_empty(),
        "no PRECONDITION_FAILED error logged:\n{text}"
    );
    // Backoff from 0.5 s doubling: attempts at about 0, 0.5, 1.5, 3.5 s.
    ensure!(
        errors.len() <= 6,
        "{} attempts in 6 s: a tight loop, not a backoff",
        errors.len()
    );
    let first = errors[0];
    for needle in [
        queue.as_str(),
        "x-dead-letter-exchange",
        elsewhere.as_str(),
        &format!("{cluster}.dead"),
    ] {
        ensure!(
            first.contains(needle),
            "the error does not name {needle:?}: {first}"
        );
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
