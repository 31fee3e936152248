//! Issue #4, "silent network partition": the broker does not die, packets
//! just stop (no RST, no FIN). The agent reaches a private RabbitMQ node
//! through a [`TcpProxy`] with a 2 s AMQP heartbeat (`?heartbeat=2` in its
//! broker URL); the test switches the proxy to blackhole for 6-9 s, longer
//! than two heartbeat intervals, so the agent (lapin: nothing read for 2
//! intervals) and, usually, the broker give up the connection, then heals
//! it. The test's own connection goes to the node directly.
//!
//! Trials rotate over three moments:
//!
//! * **running**: a 12 s job runs through the partition;
//! * **idle**: the agent is idle, and a job is submitted during the
//!   partition (the broker may push it into the dead connection; it must
//!   run once after the heal);
//! * **finishing**: the partition starts around the end of a 3 s job, so
//!   the result is usually published into the partition; it must arrive
//!   after the heal, from the agent's outbox, exactly once.
//!
//! After each heal: the agent reconnected (a new connection through the
//! proxy, heartbeats again), the job ran exactly once (one `started`, one
//! final result, one execution in the job's own log) and was not
//! interrupted, the agent takes a new job, and no lease, queued job or dead
//! letter is left.
//!
//! `VQ_FAULT_TRIALS=N` overrides the number of trials (default 6, about
//! 15 s each). Root only:
//! `cargo test -p vq-tests --test faults_partition -- --include-ignored --nocapture`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use vq_common::messages::Job;
use vq_tests::accounts;
use vq_tests::harness::{
    ensure_test_user, job, require_root, unique_cluster, AgentLaunch, EventTap, TestBroker,
    TestUser,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};
use vq_tests::tcp_proxy::TcpProxy;

const POOL: &str = "part";
/// Config of the agent (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 1\n";
/// AMQP heartbeat of the agent's connection, seconds.
const AMQP_HEARTBEAT: u64 = 2;
const WAIT: Duration = Duration::from_secs(40);
const DEFAULT_TRIALS: usize = 6;

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Lets events arrive for `d`.
async fn settle(tap: &mut EventTap, d: Duration) {
    let _ = tap.wait_for(d, "events", |_, _| false).await;
}

/// A script that logs its start and end (unix times) to `log` and sleeps
/// `secs` in between.
fn logged_script(log: &Path, secs: f64) -> String {
    format!(
        "echo \"start $(date +%s.%N)\" >> {log}\nsleep {secs}\necho \"end $(date +%s.%N)\" >> {log}\n",
        log = log.display()
    )
}

/// (start times, end times) of a job's executions from its log.
fn runs(log: &Path) -> (Vec<f64>, Vec<f64>) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let times = |word: &str| {
        text.lines()
            .filter_map(|l| l.strip_prefix(word))
            .filter_map(|t| t.trim().parse::<f64>().ok())
            .collect::<Vec<_>>()
    };
    (times("start "), times("end "))
}

/// Lines of the agent's log about its broker connection.
fn connection_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("reconnect") || l.contains("session ended") || l.contains("connected to")
        })
        .map(str::to_string)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moment {
    Running,
    Idle,
    Finishing,
}

/// One trial's facts, for the summary.
#[derive(Debug)]
struct Trial {
    moment: Moment,
    partition_secs: f64,
    /// The job ended during the partition (its result had to wait).
    ended_in_partition: bool,
    /// Heal → the agent's first heartbeat through its new connection.
    reconnect_secs: f64,
}

struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn outputs(user: &TestUser, j: &Job) -> [PathBuf; 2] {
    ["o", "e"].map(|ext| user.home.join(format!("{}.{ext}{}", j.name, j.seq())))
}

struct Env<'a> {
    broker: &'a TestBroker,
    proxy: &'a TcpProxy,
    alice: &'a TestUser,
    cluster: &'a str,
    agent_id: &'a str,
    agent_log: &'a Path,
}

/// Waits until the agent connected again through the proxy (a connection
/// accepted after `accepted_before`; one attempted during the partition
/// counts, it was held) and heartbeats again; returns the seconds from the
/// heal to that heartbeat.
async fn wait_reconnected(
    env: &Env<'_>,
    tap: &mut EventTap,
    accepted_before: usize,
    healed: Instant,
) -> anyhow::Result<f64> {
    let deadline = Instant::now() + WAIT;
    while env.proxy.accepted() <= accepted_before {
        ensure!(
            Instant::now() < deadline,
            "the agent did not reconnect within {WAIT:?} of the heal; its log: {:#?}",
            connection_lines(env.agent_log)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t_heal = now_unix() - healed.elapsed().as_secs_f64();
    let agent = env.agent_id.to_string();
    let hb = tap
        .wait_for(WAIT, "a heartbeat sent after the heal", move |k, v| {
            k.ends_with(".heartbeat")
                && v["agent"] == agent.as_str()
                && v["at"].as_f64().is_some_and(|at| at >= t_heal)
        })
        .await?;
    Ok(hb["at"].as_f64().unwrap_or(t_heal) - t_heal)
}

#[allow(clippy::too_many_lines)]
async fn trial(
    t: usize,
    env: &Env<'_>,
    tap: &mut EventTap,
    files: &mut Cleanup,
) -> anyhow::Result<Trial> {
    let moment = [Moment::Running, Moment::Idle, Moment::Finishing][t % 3];
    let partition = Duration::from_millis(rand::random_range(6000..9000));
    let log = env.alice.home.join(format!("{}-part{t}.log", env.cluster));
    files.0.push(log.clone());
    let (secs, name) = match moment {
        Moment::Running => (12.0, format!("run{t}")),
        Moment::Idle => (1.0, format!("idle{t}")),
        Moment::Finishing => (3.0, format!("fin{t}")),
    };
    let j = job(POOL, &env.alice.name, &name, &logged_script(&log, secs));
    files.0.extend(outputs(env.alice, &j));
    let accepted_before = env.proxy.accepted();
    let lines_before = connection_lines(env.agent_log).len();

    let mut offset_secs = None;
    let bh_start_unix;
    let healed;
    let bh_end_unix;
    let mut finals_before_heal = 0;
    if moment == Moment::Idle {
        // Idle: partition first, submit during it.
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
        env.proxy.blackhole();
        bh_start_unix = now_unix();
        let at = Duration::from_millis(rand::random_range(0..partition.as_millis() as u64 - 500));
        tokio::time::sleep(at).await;
        env.broker.publish_job(&j).await?;
        tokio::time::sleep(partition - at).await;
        settle(tap, Duration::from_millis(200)).await;
        ensure!(
            tap.events(&j.id, "started").is_empty(),
            "trial {t}: a job started through a partition"
        );
        env.proxy.heal();
        healed = Instant::now();
        bh_end_unix = now_unix();
    } else {
        env.broker.publish_job(&j).await?;
        tap.job_event(&j.id, "started", WAIT).await?;
        let t_started = Instant::now();
        // Running: partition 0.5-2 s into the 12 s job. Finishing: from
        // 1.2 s before to 0.1 s after the 3 s job's end (as seen here).
        let offset = match moment {
            Moment::Running => rand::random_range(0.5..2.0),
            _ => rand::random_range(secs - 1.2..secs + 0.1),
        };
        offset_secs = Some(offset);
        tokio::time::sleep(Duration::from_secs_f64(offset).saturating_sub(t_started.elapsed()))
            .await;
        env.proxy.blackhole();
        bh_start_unix = now_unix();
        tokio::time::sleep(partition).await;
        settle(tap, Duration::from_millis(200)).await;
        finals_before_heal = tap.finals(&j.id).len();
        env.proxy.heal();
        healed = Instant::now();
        bh_end_unix = now_unix();
    }
    let reconnect_secs = wait_reconnected(env, tap, accepted_before, healed).await?;
    let f = tap.job_event(&j.id, "finished", WAIT).await?;
    ensure!(
        f["outcome"]["kind"] == "exited" && f["outcome"]["code"] == 0,
        "trial {t}: job interrupted or failed: {f}"
    );
    let (starts, ends) = runs(&log);
    let ended_in_partition = ends
        .first()
        .is_some_and(|e| *e > bh_start_unix + 0.05 && *e < bh_end_unix);
    if ended_in_partition {
        // Its result could not cross the partition: it came after the heal.
        ensure!(
            finals_before_heal == 0,
            "trial {t}: a result crossed the partition"
        );
    }
    // The agent takes a new job afterwards.
    let after = job(POOL, &env.alice.name, &format!("after{t}"), "true");
    files.0.extend(outputs(env.alice, &after));
    env.broker.publish_job(&after).await?;
    let fa = tap.job_event(&after.id, "finished", WAIT).await?;
    ensure!(fa["outcome"]["code"] == 0, "trial {t}: {fa}");
    // Late duplicates would show up here.
    settle(tap, Duration::from_millis(1500)).await;

    let started = tap.events(&j.id, "started").len();
    let fin = tap.finals(&j.id);
    ensure!(
        started == 1 && starts.len() == 1,
        "trial {t} ({moment:?}): job started {started} times (its log: {} executions)",
        starts.len()
    );
    ensure!(
        fin.len() == 1 && ends.len() == 1,
        "trial {t} ({moment:?}): {} final results, {} ends in its log: {fin:#?}",
        fin.len(),
        ends.len()
    );
    ensure!(
        tap.events(&after.id, "started").len() == 1 && tap.finals(&after.id).len() == 1,
        "trial {t}: the job after the partition ran more than once"
    );
    let b = env.broker;
    ensure!(
        b.queue_len(&b.topo.lease_queue(env.agent_id)).await? == 0,
        "trial {t}: a lease was left"
    );
    ensure!(
        b.queue_len(&b.topo.pool_queue(POOL)).await? == 0,
        "trial {t}: a job was left in the pool queue"
    );
    let dead = b.take_dead().await?;
    ensure!(dead.is_empty(), "trial {t}: dead letters: {dead:#?}");
    let lines = connection_lines(env.agent_log);
    let new_lines = &lines[lines_before.min(lines.len())..];
    ensure!(
        new_lines.iter().any(|l| l.contains("connected to")),
        "trial {t}: no reconnection in the agent's log: {new_lines:#?}"
    );
    eprintln!(
        "faults_partition trial {t}: {moment:?}{} partition {:.1} s; the agent heartbeated again {reconnect_secs:.1} s after the heal; job ran once{}; agent log: {:?}",
        offset_secs.map_or(String::new(), |o| format!(" (blackhole {o:.2} s after the start)")),
        partition.as_secs_f64(),
        if ended_in_partition { ", ended inside the partition, result delivered after the heal" } else { "" },
        new_lines
            .iter()
            .map(|l| l.split_once("vq_jobagent").map_or(l.as_str(), |(_, r)| r).trim())
            .collect::<Vec<_>>()
    );
    Ok(Trial {
        moment,
        partition_secs: partition.as_secs_f64(),
        ended_in_partition,
        reconnect_secs,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_silent_partition_neither_loses_nor_duplicates_jobs() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let proxy = TcpProxy::start(([127, 0, 0, 1], node.port()).into()).await?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-p");
    let dir = tempfile::tempdir()?;
    let agent_log = dir.path().join("agent.log");
    let url = accounts::suite().agent.url(&format!(
        "amqp://127.0.0.1:{}/%2f?heartbeat={AMQP_HEARTBEAT}",
        proxy.port()
    ));
    let _agent = AgentLaunch {
        url: &url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &agent_id,
        extra_toml: AGENT_TOML,
        broker_toml: "",
        dir: dir.path(),
        stderr: Some(&agent_log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    let up = tap
        .wait_for(WAIT, "first heartbeat", |k, v| {
            k.ends_with(".heartbeat") && v["agent"] == agent_id.as_str()
        })
        .await;
    up.with_context(|| {
        format!(
            "agent log:\n{}",
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        )
    })?;
    let env = Env {
        broker: &broker,
        proxy: &proxy,
        alice: &alice,
        cluster: &cluster,
        agent_id: &agent_id,
        agent_log: &agent_log,
    };
    let n = vq_tests::harness::fault_trials(DEFAULT_TRIALS);
    let mut files = Cleanup(Vec::new());
    let mut done = Vec::new();
    let t0 = Instant::now();
    for t in 0..n {
        match trial(t, &env, &mut tap, &mut files).await {
            Ok(r) => done.push(r),
            Err(e) => {
                let log = std::fs::read_to_string(&agent_log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(80).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                anyhow::bail!(
                    "{e:#}\nearlier trials: {done:#?}\nagent log (last 80 lines):\n{}",
                    tail.join("\n")
                );
            }
        }
    }
    let count = |m: Moment| done.iter().filter(|r| r.moment == m).count();
    let in_partition = done.iter().filter(|r| r.ended_in_partition).count();
    let max_reconnect = done.iter().map(|r| r.reconnect_secs).fold(0.0, f64::max);
    let parts: Vec<String> = done
        .iter()
        .map(|r| format!("{:.1}", r.partition_secs))
        .collect();
    eprintln!(
        "faults_partition: {n} trials in {:.0} s ({} running, {} idle, {} finishing; {in_partition} results published into the partition; partitions {parts:?} s); \
         the agent reconnected and heartbeated within {max_reconnect:.1} s of every heal; lost 0, duplicated 0, interrupted 0",
        t0.elapsed().as_secs_f64(),
        count(Moment::Running),
        count(Moment::Idle),
        count(Moment::Finishing),
    );
    broker.cleanup().await;
    drop(proxy);
    drop(node);
    Ok(())
}
