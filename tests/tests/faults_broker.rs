//! Broker faults against a private RabbitMQ node (tests/src/rabbit_node.rs)
//! whose `consumer_timeout` is 3 s (checked every 0.5 s):
//!
//! * a job that runs longer than the consumer timeout runs once and
//!   finishes (the pool delivery is acked at claim time; the job is held by
//!   its lease);
//! * the broker is SIGKILLed and restarted at a random moment while a job
//!   runs, several times: the job keeps running, exactly one `started` and
//!   one final result reach the events exchange, the agent reconnects and
//!   takes the next job, and no lease or job is left behind.
//!
//! Root only: `cargo test -p vq-tests --test faults_broker -- --include-ignored`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::ensure;
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use vq_common::topology::Role;
use vq_tests::harness::{
    ensure_test_user, job, require_root, start_agent_url, unique_cluster, DurableTap, TestBroker,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "fb";
/// Config of the agent (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 1\n";
/// Broker crash trials (each costs one node restart, about 8 s).
const CRASH_TRIALS: usize = 4;

fn crash_trials() -> usize {
    vq_tests::harness::fault_trials(CRASH_TRIALS)
}

/// The file a job's script appends a line to each time it starts.
fn runs_file(home: &std::path::Path, name: &str) -> std::path::PathBuf {
    home.join(format!("{name}.runs"))
}

/// The test's durable event tap: a queue of the cluster's, so the
/// controller account may declare it.
fn tap(cluster: &str) -> String {
    format!("{cluster}.faults-broker-tap")
}

/// Connects and declares; after a restart, quorum queues and streams come
/// back a moment after the node accepts connections, so this retries.
async fn connect(node: &RabbitNode, cluster: &str) -> anyhow::Result<TestBroker> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = async {
            let b = TestBroker::connect_at(&node.broker(), cluster, &[POOL]).await?;
            b.durable_tap(&tap(cluster)).await?;
            anyhow::Ok(b)
        }
        .await;
        match r {
            Ok(b) => return Ok(b),
            Err(e) if Instant::now() < deadline => {
                eprintln!("test broker connection not ready yet: {e:#}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The node really enforces the short consumer timeout: a consumer that
/// holds a delivery unacked loses its channel within a few seconds.
async fn consumer_timeout_is_enforced(b: &TestBroker) -> anyhow::Result<()> {
    // A queue and exchange of the cluster's: vq's accounts reach nothing
    // else (not even the default exchange).
    let probe = format!("{}.probe", b.topo.cluster());
    let ch = b.conn.create_channel().await?;
    ch.exchange_declare(
        probe.as_str().into(),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    vq_common::amqp::declare_bound_queue(&ch, &probe, &Vec::new(), &probe, &probe).await?;
    vq_common::amqp::publish_confirmed(
        &b.ch,
        &probe,
        &probe,
        b"x",
        Default::default(),
        true,
        Duration::from_secs(5),
    )
    .await?;
    let mut c = ch
        .basic_consume(
            probe.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let _held = c.next().await;
    let t0 = Instant::now();
    while ch.status().connected() {
        ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "the node did not enforce consumer_timeout"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "probe: channel closed by consumer_timeout after {:?}",
        t0.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn jobs_outlive_the_consumer_timeout_and_survive_broker_crashes() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let mut node = RabbitNode::start_new(NodeOptions {
        consumer_timeout_ms: Some(3000),
        channel_tick_ms: Some(500),
        ..Default::default()
    })
    .await?;
    let cluster = unique_cluster();
    let mut broker = connect(&node, &cluster).await?;
    consumer_timeout_is_enforced(&broker).await?;
    let agent_id = format!("{cluster}-a1");
    let _agent = start_agent_url(
        &node.role_url(Role::Agent),
        &cluster,
        POOL,
        &agent_id,
        AGENT_TOML,
    )?;
    let mut seen = DurableTap::new(&tap(&cluster));
    seen.wait(&broker, "first heartbeat", Duration::from_secs(20), |s| {
        s.keys(".heartbeat") > 0
    })
    .await?;

    let mut jobs = Vec::new();
    // A job three times longer than the consumer timeout.
    let long = job(POOL, &alice.name, "long", "sleep 10\necho long-done\n");
    broker.publish_job(&long).await?;
    seen.wait(&broker, "long job finished", Duration::from_secs(40), |s| {
        !s.finals(&long.id).is_empty()
    })
    .await?;
    jobs.push(long.clone());

    // Broker crashes at random moments while a job runs.
    let mut kill_at = Vec::new();
    for trial in 0..crash_trials() {
        // Each run of the script leaves a line in its runs file: the
        // events say how often the job was reported started, this file how
        // often it really started.
        let name = format!("crash{trial}");
        let runs = runs_file(&alice.home, &name);
        let _ = std::fs::remove_file(&runs);
        let j = job(
            POOL,
            &alice.name,
            &name,
            &format!("echo run >> '{}'\nsleep 6\necho done\n", runs.display()),
        );
        broker.publish_job(&j).await?;
        seen.wait(&broker, "job started", Duration::from_secs(30), |s| {
            s.count(&j.id, "started") > 0
        })
        .await?;
        let delay = Duration::from_millis(rand::random_range(0..4000));
        tokio::time::sleep(delay).await;
        kill_at.push(delay);
        drop(broker);
        node.kill();
        node.start().await?;
        broker = connect(&node, &cluster).await?;
        seen.wait(
            &broker,
            "job finished after the crash",
            Duration::from_secs(60),
            |s| !s.finals(&j.id).is_empty(),
        )
        .await?;
        jobs.push(j);
    }
    // The agent takes a new job after the last restart.
    let after = job(POOL, &alice.name, "after", "echo after\n");
    broker.publish_job(&after).await?;
    seen.wait(
        &broker,
        "job after the crashes",
        Duration::from_secs(30),
        |s| !s.finals(&after.id).is_empty(),
    )
    .await?;
    jobs.push(after);
    // Late duplicates would show up here.
    tokio::time::sleep(Duration::from_secs(2)).await;
    seen.poll(&broker).await?;

    let mut report = BTreeMap::new();
    for j in &jobs {
        // As a consumer sees them: deduplicated on `message_id` (a
        // `started` whose confirm the crash cut off is published again).
        let started = seen.count(&j.id, "started");
        let published = seen.count_published(&j.id, "started");
        let finals = seen.finals(&j.id);
        report.insert(j.name.clone(), (started, published, finals.len()));
        ensure!(
            started == 1,
            "job {} started {started} times (distinct message ids; {published} published)",
            j.name
        );
        let runs = runs_file(&alice.home, &j.name);
        if j.name.starts_with("crash") {
            let ran = std::fs::read_to_string(&runs)?.lines().count();
            ensure!(ran == 1, "job {} ran {ran} times", j.name);
            let _ = std::fs::remove_file(&runs);
        }
        ensure!(
            finals.len() == 1,
            "job {} has {} final results: {finals:?}",
            j.name,
            finals.len()
        );
        let f = finals[0];
        ensure!(
            f["state"] == "finished"
                && f["outcome"]["kind"] == "exited"
                && f["outcome"]["code"] == 0,
            "job {} was interrupted or failed: {f}",
            j.name
        );
        for ext in ["o", "e"] {
            let _ = std::fs::remove_file(alice.home.join(format!("{}.{ext}{}", j.name, j.seq())));
        }
    }
    ensure!(
        broker
            .queue_len(&broker.topo.lease_queue(&agent_id))
            .await?
            == 0,
        "a lease was left behind"
    );
    ensure!(
        broker.queue_len(&broker.topo.pool_queue(POOL)).await? == 0,
        "a job was left in the pool queue"
    );
    ensure!(
        broker.take_dead().await?.is_empty(),
        "a job was dead-lettered"
    );
    eprintln!(
        "faults_broker: {} crash trials (kill after {kill_at:?}); per job (started, started events published, final results): {report:?}; lost 0, duplicated 0, interrupted 0",
        crash_trials()
    );
    Ok(())
}
