//! Broker resource alarm (`connection.blocked`) against a private RabbitMQ
//! node (tests/src/rabbit_node.rs), several trials with the alarm raised at
//! a random moment of a running job:
//!
//! * the agent's publishing connection is blocked, its consuming connection
//!   is not (RabbitMQ blocks only connections that publish); the agent does
//!   not reconnect or exit;
//! * publishers wait: the result of a job that ends during the alarm is
//!   held and arrives exactly once after it; the agent does not pull the
//!   next job while it could not write the claim;
//! * control messages still reach the agent (a drain sent during the alarm
//!   stops it pulling; its "drained" answer arrives after the alarm);
//! * the controller's broker client sees the alarm through its probe
//!   publish: `blocked()` is set and no agent is judged by heartbeats
//!   (`listening_secs` = 0) until the alarm ends;
//! * afterwards every job has run once, finished, and nothing is left in the
//!   lease or pool queues or dead-lettered.
//!
//! Trials: `VQ_FAULT_TRIALS` (default 3).
//! Root only: `cargo test -p vq-tests --test faults_alarm -- --include-ignored`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use vq_common::config::BrokerConfig;
use vq_common::messages::Control;
use vq_common::topology::{Role, Topology};
use vq_controller::broker::Broker;
use vq_tests::harness::{ensure_test_user, job, require_root, AgentLaunch, DurableTap, TestBroker};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "fa";
/// Config of the agent (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 1\n";

/// Alarm trials (each about 10 s); `VQ_FAULT_TRIALS` overrides.
fn trials() -> usize {
    vq_tests::harness::fault_trials(3)
}

/// `(client-provided name, state)` of the node's client connections.
fn connections(node: &RabbitNode) -> anyhow::Result<Vec<(String, String)>> {
    let out = node.ctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "client_properties",
        "state",
    ])?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let (props, state) = l.rsplit_once('\t')?;
            // ... {"connection_name","jobagent x publish"} ...
            let key = "\"connection_name\",\"";
            let after = &props[props.find(key)? + key.len()..];
            let start = 0;
            let len = after[start..].find('"')?;
            Some((
                after[start..start + len].to_string(),
                state.trim().to_string(),
            ))
        })
        .collect())
}

/// The state of the connection called exactly `name`.
fn conn_state(node: &RabbitNode, name: &str) -> anyhow::Result<Option<String>> {
    Ok(connections(node)?
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, s)| s))
}

async fn wait_conn_state(node: &RabbitNode, name: &str, want: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let st = conn_state(node, name)?;
        if st.as_deref() == Some(want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "connection {name:?} is {st:?}, not {want:?}; all: {:?}; raw: {}",
                connections(node)?,
                node.ctl(&[
                    "list_connections",
                    "-q",
                    "--no-table-headers",
                    "client_properties",
                    "state"
                ])?
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn raise_alarm(node: &RabbitNode) -> anyhow::Result<()> {
    node.ctl(&["set_vm_memory_high_watermark", "absolute", "1"])
        .map(drop)
}

fn clear_alarm(node: &RabbitNode) -> anyhow::Result<()> {
    node.ctl(&["set_vm_memory_high_watermark", "0.4"]).map(drop)
}

async fn wait_controller_blocked(ctl: &Broker, want: bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if want && ctl.blocked().is_none() {
            // The probe is what makes the broker block (and tell) a
            // connection; it waits for its confirm at most 2 s.
            let _ = ctl.probe().await;
        }
        if ctl.blocked().is_some() == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the controller's blocked() is not {want} after 15 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_broker_alarm_holds_publishers_and_loses_nothing() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let cluster = vq_tests::harness::unique_cluster();
    // The writer publishes jobs (and is blocked during alarms); the reader
    // only reads the tap and inspects queues, so it never is.
    let writer = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    // The tap is the cluster's (the controller account may declare it).
    let tap = format!("{cluster}.faults-alarm-tap");
    writer.durable_tap(&tap).await?;
    let reader = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;

    let controller = Broker::new(
        BrokerConfig {
            url: node.role_url(Role::Controller),
            confirm_timeout_secs: 2,
            ..Default::default()
        },
        Topology::new(cluster.clone()),
        vec![POOL.to_string()],
    );
    controller.ensure_connected().await?;
    controller.probe().await.context("probe before any alarm")?;
    ensure!(controller.blocked().is_none(), "blocked without an alarm");

    let agent_id = format!("{cluster}-a1");
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("agent.log");
    let agent_url = node.role_url(Role::Agent);
    let agent = AgentLaunch {
        url: &agent_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &agent_id,
        extra_toml: AGENT_TOML,
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&log),
        args: &[],
        env: &[],
    };
    let mut guard = agent.spawn()?;
    let mut seen = DurableTap::new(&tap);
    seen.wait(&reader, "first heartbeat", Duration::from_secs(30), |s| {
        s.keys(".heartbeat") > 0
    })
    .await?;
    let consume_name = format!("jobagent {agent_id}");
    let publish_name = format!("jobagent {agent_id} publish");
    wait_conn_state(&node, &consume_name, "running").await?;
    wait_conn_state(&node, &publish_name, "running").await?;

    // The held jobs end when the test releases them (creates their file),
    // once the alarm is known to block the agent: a `sleep` would race the
    // `rabbitmqctl` calls that raise and check the alarm, which take
    // seconds on a loaded machine.
    let release = |name: &str| alice.home.join(format!("{cluster}-{name}.release"));
    let wait_for =
        |file: &std::path::Path| format!("while [ ! -e {} ]; do sleep 0.1; done\n", file.display());
    let mut jobs = Vec::new();
    let mut raised_after = Vec::new();
    for trial in 0..trials() {
        let held = release(&format!("held{trial}"));
        let running = job(
            POOL,
            &alice.name,
            &format!("held{trial}"),
            &format!(
                "{}echo held-done\ntouch {}.done\n",
                wait_for(&held),
                held.display()
            ),
        );
        let next = job(POOL, &alice.name, &format!("next{trial}"), "echo next\n");
        writer.publish_job(&running).await?;
        seen.wait(&reader, "job started", Duration::from_secs(30), |s| {
            s.count(&running.id, "started") > 0
        })
        .await?;
        // Queued behind it (slots = 1); published before the alarm so that
        // it is surely in the queue.
        writer.publish_job(&next).await?;
        let delay = Duration::from_millis(rand::random_range(0..1200));
        tokio::time::sleep(delay).await;
        raised_after.push(delay);

        raise_alarm(&node)?;
        // Heartbeats (every 0.5 s) are publishes: the agent's publishing
        // connection is blocked at once, its consuming one never.
        wait_conn_state(&node, &publish_name, "blocked").await?;
        ensure!(
            conn_state(&node, &consume_name)?.as_deref() != Some("blocked"),
            "the agent's consuming connection was blocked"
        );
        wait_controller_blocked(&controller, true).await?;
        ensure!(
            controller
                .snapshot(tokio::time::Instant::now())
                .listening_secs
                == 0.0,
            "the controller judges heartbeats during an alarm"
        );

        // The job ends during the alarm; its result waits.
        std::fs::write(&held, "")?;
        // Wait for the job's own end (its marker), not for time: its
        // result is then in the agent's hands, behind the blocked connection.
        let done = std::path::PathBuf::from(format!("{}.done", held.display()));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done.exists() {
            ensure!(
                Instant::now() < deadline,
                "trial {trial}: the held job never ended"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen.poll(&reader).await?;
        ensure!(
            seen.finals(&running.id).is_empty(),
            "a result got through a blocked connection (the block came too late?)"
        );
        let hb_before = seen.keys(".heartbeat");
        tokio::time::sleep(Duration::from_secs(2)).await;
        seen.poll(&reader).await?;
        ensure!(
            seen.keys(".heartbeat") == hb_before,
            "heartbeats passed a blocked connection"
        );
        // Not pulling while a claim could not be written: the next job is
        // still ready in the pool queue (passive declare: ready messages).
        ensure!(
            reader.queue_len(&reader.topo.pool_queue(POOL)).await? == 1,
            "the agent took a job while the broker blocked its publishing"
        );
        ensure!(
            guard.try_wait().is_none(),
            "the agent exited during the alarm"
        );
        ensure!(
            conn_state(&node, &consume_name)?.is_some(),
            "the agent's consuming connection went away"
        );

        clear_alarm(&node)?;
        wait_controller_blocked(&controller, false).await?;
        seen.wait(
            &reader,
            "held result and next job after the alarm",
            Duration::from_secs(30),
            |s| !s.finals(&running.id).is_empty() && !s.finals(&next.id).is_empty(),
        )
        .await?;
        jobs.push(running);
        jobs.push(next);
    }

    // A drain asked for before the alarm is carried out during it: the
    // agent finishes its job, stops pulling, and its result and "drained"
    // answer wait for the alarm to end. (Nobody can publish a control
    // message during an alarm: RabbitMQ 3.10 does not read even the first
    // publish of a fresh connection then.)
    let last_file = release("drained-job");
    let last = job(
        POOL,
        &alice.name,
        "drained-job",
        &format!("{}echo last\n", wait_for(&last_file)),
    );
    writer.publish_job(&last).await?;
    seen.wait(&reader, "last job started", Duration::from_secs(30), |s| {
        s.count(&last.id, "started") > 0
    })
    .await?;
    writer
        .publish_control(
            &agent_id,
            &Control::Drain {
                request_id: "alarm-drain".into(),
                reason: None,
            },
        )
        .await?;
    let log_has = |needle: &str| {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(needle)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log_has("drain requested") {
        ensure!(Instant::now() < deadline, "the agent did not get the drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    raise_alarm(&node)?;
    wait_conn_state(&node, &publish_name, "blocked").await?;
    std::fs::write(&last_file, "")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    seen.poll(&reader).await?;
    ensure!(
        seen.finals(&last.id).is_empty() && seen.keys(".drained") == 0,
        "a result or the drained answer got through a blocked connection"
    );
    clear_alarm(&node)?;
    seen.wait(
        &reader,
        "last result and drained answer after the alarm",
        Duration::from_secs(30),
        |s| !s.finals(&last.id).is_empty() && s.keys(".drained") == 1,
    )
    .await?;
    jobs.push(last);

    // Late duplicates would show up here.
    tokio::time::sleep(Duration::from_secs(2)).await;
    seen.poll(&reader).await?;
    let mut report = BTreeMap::new();
    for j in &jobs {
        let started = seen.count(&j.id, "started");
        let finals = seen.finals(&j.id);
        report.insert(j.name.clone(), (started, finals.len()));
        ensure!(started == 1, "job {} started {started} times", j.name);
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
        let _ = std::fs::remove_file(release(&j.name));
    }
    let agent_log = std::fs::read_to_string(&log).unwrap_or_default();
    ensure!(
        !agent_log.contains("reconnecting"),
        "the agent reconnected during an alarm:\n{agent_log}"
    );
    ensure!(
        agent_log.contains("the broker blocks publishing"),
        "the agent did not log the alarm"
    );
    ensure!(
        reader
            .queue_len(&reader.topo.lease_queue(&agent_id))
            .await?
            == 0,
        "a lease was left behind"
    );
    ensure!(
        reader.queue_len(&reader.topo.pool_queue(POOL)).await? == 0,
        "a job was left in the pool queue"
    );
    ensure!(
        reader.take_dead().await?.is_empty(),
        "a job was dead-lettered"
    );
    eprintln!(
        "faults_alarm: {} alarm trials (raised {raised_after:?} after the job started) + 1 drain during an alarm; per job (started, final results): {report:?}; lost 0, duplicated 0, interrupted 0",
        trials()
    );
    controller.close().await;
    drop(guard);
    Ok(())
}
