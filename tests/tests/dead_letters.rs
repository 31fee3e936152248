//! Every dead letter ends with exactly one `failed` event: the controller
//! publishes it for the ones RabbitMQ makes itself (quorum delivery limit,
//! rejection), agents for their own. No agent runs here: the test plays it
//! on a connection of the suite's agent account. Root (rabbitmqctl creates
//! the broker accounts): `cargo test -p vq-tests --test dead_letters --
//! --include-ignored`.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lapin::options::{BasicGetOptions, BasicNackOptions, BasicRejectOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use vq_common::amqp::{declare_bound_queue, publish_confirmed};
use vq_common::messages::{Message, REASON_HEADER};
use vq_common::topology::{Role, POOL_DELIVERY_LIMIT};
use vq_tests::harness::{
    broker_url, connect_role, job, require_root, shared_broker, start_controller_on_empty_cloud,
    unique_cluster, EventTap, TestBroker,
};

const POOL: &str = "dl";
const WAIT: Duration = Duration::from_secs(30);

/// A job event with its AMQP message id.
struct Event {
    key: String,
    message_id: Option<String>,
    body: serde_json::Value,
}

/// The job events `tap` has seen, with their message ids.
fn job_events(tap: &EventTap) -> Vec<Event> {
    tap.seen
        .iter()
        .zip(&tap.message_ids)
        .filter(|((k, _), _)| k.starts_with("job."))
        .map(|((key, body), message_id)| Event {
            key: key.clone(),
            message_id: message_id.clone(),
            body: body.clone(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn dead_letters_made_by_rabbitmq_get_exactly_one_failed_event() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let cluster = unique_cluster();
    let b = TestBroker::connect(&cluster, &[POOL]).await?;
    let watch = b.topo.dead_watch_queue();
    // Declared here too (as the controller declares it), so that the dead
    // letters below reach it whenever the controller starts consuming.
    declare_bound_queue(
        &b.ch,
        &watch,
        &b.topo.dead_watch_queue_args(),
        &b.topo.dead_exchange(),
        "",
    )
    .await?;
    let mut tap = b.tap_events().await?;
    let ctl =
        start_controller_on_empty_cloud(&broker_url(Role::Controller)?, &cluster, POOL, "info")
            .await?;
    // The controller is connected once it has declared its own queues.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while b.queue_len(&b.topo.fence_queue()).await.is_err() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the controller never connected"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The agent's side, with the agent's account.
    let (agent, agent_ch) = connect_role(&shared_broker()?, Role::Agent, "vq-tests agent").await?;

    // An agent's dead letter (vq's reason header): its agent reports it.
    let by_agent = job(POOL, "alice", "byagent", "true");
    let mut headers = FieldTable::default();
    headers.insert(
        REASON_HEADER.into(),
        AMQPValue::LongString(LongString::from("owner refused")),
    );
    publish_confirmed(
        &agent_ch,
        &b.topo.dead_exchange(),
        POOL,
        &by_agent.encode(),
        BasicProperties::default()
            .with_headers(headers)
            .with_message_id(by_agent.id.clone().into()),
        false,
        Duration::from_secs(10),
    )
    .await?;

    // Redelivered past the quorum delivery limit: RabbitMQ dead-letters it.
    let limited = job(POOL, "alice", "limited", "true");
    b.publish_job(&limited).await?;
    let pool_queue = b.topo.pool_queue(POOL);
    let mut deliveries = 0;
    while let Some(m) = agent_ch
        .basic_get(
            pool_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await?
    {
        deliveries += 1;
        m.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
        ensure!(deliveries <= 100, "the delivery limit never applied");
    }
    ensure!(deliveries as i64 > POOL_DELIVERY_LIMIT, "{deliveries}");
    tap.job_event(&limited.id, "failed", WAIT).await?;

    // Rejected without requeue, with a body that is no job.
    let garbage_id = format!("{}-garbage", rand::random::<u32>());
    b.publish_raw_job(POOL, b"not a job", Some(b.submitter_user()?), &garbage_id)
        .await?;
    let m = agent_ch
        .basic_get(
            pool_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await?
        .context("the garbage job is not in its queue")?;
    m.delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    // The watch queue is consumed in order: once this event is out, every
    // event of the letters before it is too.
    tap.job_event(&garbage_id, "failed", WAIT).await?;
    let seen = job_events(&tap);

    let of = |id: &str| -> Vec<&Event> { seen.iter().filter(|e| e.body["job_id"] == id).collect() };
    let limited_events = of(&limited.id);
    ensure!(limited_events.len() == 1, "{} events", limited_events.len());
    let e = limited_events[0];
    let reason = e.body["reason"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("dead-lettered by RabbitMQ: delivery_limit")
            && reason.contains(&format!("more than {POOL_DELIVERY_LIMIT} times"))
            && reason.contains(&pool_queue),
        "reason: {reason}"
    );
    ensure!(e.key == format!("job.{POOL}.failed"), "key {}", e.key);
    ensure!(
        e.message_id.as_deref()
            == Some(
                format!(
                    "{}.{}.failed",
                    limited.id,
                    vq_common::messages::fingerprint(&limited.encode())
                )
                .as_str()
            ),
        "message id {:?}",
        e.message_id
    );
    ensure!(e.body["owner"] == "alice" && e.body["submitter"] == b.submitter_user()?);
    ensure!(
        of(&by_agent.id).is_empty(),
        "an agent-made dead letter got a controller event"
    );
    let garbage = of(&garbage_id);
    ensure!(garbage.len() == 1, "{} events", garbage.len());
    let reason = garbage[0].body["reason"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("rejected") && garbage[0].body["pool"] == POOL,
        "{:?}",
        garbage[0].body
    );

    // The letters stay in <c>.jobs.dead for operators; the watch copies
    // were acked.
    let dead = b.take_dead().await?;
    let ids: Vec<_> = dead.iter().filter_map(|d| d.message_id.clone()).collect();
    for id in [&by_agent.id, &limited.id, &garbage_id] {
        ensure!(
            ids.contains(id),
            "{id} not in the dead-letter queue: {ids:?}"
        );
    }
    let limited_dead = dead
        .iter()
        .find(|d| d.message_id.as_deref() == Some(&limited.id))
        .context("limited")?;
    ensure!(limited_dead.headers.contains_key("x-death"));
    ensure!(b.queue_len(&watch).await? == 0, "watch copies left");

    agent.close(200, "done".into()).await.ok();
    drop(ctl.guard);
    ctl.sim.shutdown().await;
    let _ =
        b.ch.queue_delete(watch.as_str().into(), QueueDeleteOptions::default())
            .await;
    for q in [b.topo.fence_queue(), b.topo.agents_queue()] {
        let _ =
            b.ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
    }
    b.cleanup().await;
    Ok(())
}
