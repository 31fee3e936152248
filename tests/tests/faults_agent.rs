//! Agent faults against the shared broker, with the production jobagent
//! (and controller) binaries:
//!
//! * a poison job whose agent is SIGKILLed (with the job) every time it
//!   starts is run again by the restarted agent (lease recovery) until the
//!   loss limit, then reported failed and dead-lettered with the reason;
//! * an agent SIGKILLed mid-job is fenced by the controller (judged dead on
//!   its own receive times): a rerunnable job runs again on another agent
//!   and finishes once; a non-rerunnable one is reported failed
//!   "node lost" and dead-lettered;
//! * an agent that dies while no controller runs, and whose server is gone,
//!   is found by a controller started later through the agent registry:
//!   its rerunnable job runs again and finishes once;
//! * ask-delete sent at random moments around a job's delivery never gets
//!   "yes" from an agent that took the job, and the job is never lost.
//!
//! Root only: `cargo test -p vq-tests --test faults_agent -- --include-ignored`.

use std::time::{Duration, Instant};

use anyhow::ensure;
use nix::sys::signal::Signal;
use vq_common::messages::Control;
use vq_common::topology::Role;
use vq_tests::harness::{
    broker_url, ensure_test_user, job, require_root, start_agent_in, start_agent_url,
    start_controller_on_empty_cloud, start_controller_on_empty_cloud_with, unique_cluster,
    wait_agent_up, EventTap, TestBroker, TestUser,
};
use vq_tests::rabbit_node::free_port;

/// Config of every agent here (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 1\n";
const WAIT: Duration = Duration::from_secs(30);

/// A script that, once it runs, records its process group id (written
/// whole, then renamed into place: the file's existence is the job's
/// readiness signal) and sleeps.
fn pid_script(user: &TestUser, name: &str, secs: u32) -> (String, std::path::PathBuf) {
    let pidfile = user.home.join(format!("{name}.pid"));
    let _ = std::fs::remove_file(&pidfile);
    let p = pidfile.display();
    (
        format!("echo $$ > {p}.tmp && mv {p}.tmp {p}\nsleep {secs}\necho done\n"),
        pidfile,
    )
}

/// Waits until the job of `pid_script` runs (its pid file exists; the
/// agent publishes `started` before it spawns the job, so that event alone
/// does not mean a job process exists) and returns its process group,
/// removing the file for the next run.
async fn job_running(pidfile: &std::path::Path) -> anyhow::Result<nix::unistd::Pid> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(text) = std::fs::read_to_string(pidfile) {
            let pid = text.trim().parse::<i32>()?;
            std::fs::remove_file(pidfile)?;
            return Ok(nix::unistd::Pid::from_raw(pid));
        }
        ensure!(
            Instant::now() < deadline,
            "the job never ran: no pid file {}",
            pidfile.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGKILLs the job's process group, as the death of its VM would.
fn kill_job(pgid: nix::unistd::Pid) {
    let _ = nix::sys::signal::killpg(pgid, Signal::SIGKILL);
}

fn count(tap: &EventTap, job_id: &str, word: &str) -> usize {
    tap.seen
        .iter()
        .filter(|(k, v)| {
            k.starts_with("job.") && k.ends_with(&format!(".{word}")) && v["job_id"] == job_id
        })
        .count()
}

/// Waits for the `n`-th event `word` of `job_id`.
async fn nth_event(
    tap: &mut EventTap,
    job_id: &str,
    word: &str,
    n: usize,
) -> anyhow::Result<serde_json::Value> {
    let what = format!("{word} #{n} of {job_id}");
    let deadline = Instant::now() + WAIT;
    loop {
        let found: Vec<serde_json::Value> = tap
            .seen
            .iter()
            .filter(|(k, v)| k.ends_with(&format!(".{word}")) && v["job_id"] == job_id)
            .map(|(_, v)| v.clone())
            .collect();
        if found.len() >= n {
            return Ok(found[n - 1].clone());
        }
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        // Any new event (heartbeats arrive every 0.5 s) wakes us.
        let _ = tap
            .wait_for(Duration::from_millis(600), &what, |_, _| false)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_that_keeps_killing_its_agent_is_dead_lettered_after_the_loss_limit(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "poison";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-p1");
    let dir = tempfile::tempdir()?;
    let url = broker_url(Role::Agent)?;
    let mut agent = start_agent_in(&url, &cluster, pool, &agent_id, AGENT_TOML, dir.path())?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let (script, pidfile) = pid_script(&alice, "poison", 30);
    let j = job(pool, &alice.name, "poison", &script);
    broker.publish_job(&j).await?;
    let limit = vq_common::topology::DEFAULT_LOSS_LIMIT as usize;
    for run in 1..=limit {
        nth_event(&mut tap, &j.id, "started", run).await?;
        let pgid = job_running(&pidfile).await?;
        // The job "kills its node": agent and job die together.
        agent.signal(Signal::SIGKILL);
        agent.wait_timeout(Duration::from_secs(5));
        kill_job(pgid);
        drop(agent);
        agent = start_agent_in(&url, &cluster, pool, &agent_id, AGENT_TOML, dir.path())?;
    }
    let failed = tap.job_event(&j.id, "failed", WAIT).await?;
    let reason = failed["reason"].as_str().unwrap_or_default().to_string();
    ensure!(
        reason.contains(&format!("{limit} times")),
        "reason: {reason}"
    );
    // The agent is fine and takes the next job.
    let ok = job(pool, &alice.name, "afterpoison", "true");
    broker.publish_job(&ok).await?;
    tap.job_event(&ok.id, "finished", WAIT).await?;
    ensure!(
        count(&tap, &j.id, "started") == limit,
        "started {} times",
        count(&tap, &j.id, "started")
    );
    ensure!(count(&tap, &j.id, "finished") == 0);
    ensure!(count(&tap, &j.id, "failed") == 1);
    let dead = broker.take_dead().await?;
    ensure!(dead.len() == 1, "dead letters: {dead:#?}");
    ensure!(
        dead[0].headers["x-vq-reason"].contains("times"),
        "{:?}",
        dead[0].headers
    );
    ensure!(
        dead[0].headers["x-vq-losses"].contains(&limit.to_string()),
        "{:?}",
        dead[0].headers
    );
    ensure!(
        broker
            .queue_len(&broker.topo.lease_queue(&agent_id))
            .await?
            == 0,
        "lease left"
    );
    ensure!(
        broker.queue_len(&broker.topo.pool_queue(pool)).await? == 0,
        "job left in the pool"
    );
    eprintln!("faults_agent poison: {limit} losses, then dead-lettered: {reason}");
    for ext in ["o", "e"] {
        let _ = std::fs::remove_file(alice.home.join(format!("poison.{ext}{}", j.seq())));
        let _ = std::fs::remove_file(alice.home.join(format!("afterpoison.{ext}{}", ok.seq())));
    }
    drop(agent);
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_controller_fences_a_dead_agent_and_returns_its_jobs_by_rerunnable(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "fence";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let url = broker_url(Role::Agent)?;

    // The controller runs against an empty test cloud (max 0: it boots
    // nothing); the agents are started here, so they are fenced as agents
    // without a server once their heartbeats stop.
    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller = start_controller_on_empty_cloud_with(
        &broker_url(Role::Controller)?,
        &cluster,
        pool,
        "info",
        &listen,
        "",
    )
    .await?;
    // The controller knows agents without a server only from their
    // heartbeats: let it listen before the first agent starts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Rerunnable: runs again elsewhere after its agent died.
    let a1 = format!("{cluster}-f1");
    let agent1 = start_agent_url(&url, &cluster, pool, &a1, AGENT_TOML)?;
    wait_agent_up(&mut tap, &a1).await?;
    let (script, pidfile) = pid_script(&alice, "fence-r", 3);
    let r = job(pool, &alice.name, "fence-r", &script);
    broker.publish_job(&r).await?;
    let s1 = tap.job_event(&r.id, "started", WAIT).await?;
    ensure!(s1["agent"] == a1.as_str(), "{s1}");
    let pgid = job_running(&pidfile).await?;
    agent1.guard.signal(Signal::SIGKILL);
    kill_job(pgid);
    let t_killed = Instant::now();
    let a2 = format!("{cluster}-f2");
    let _agent2 = start_agent_url(&url, &cluster, pool, &a2, AGENT_TOML)?;
    let s2 = nth_event(&mut tap, &r.id, "started", 2).await?;
    ensure!(
        s2["agent"] == a2.as_str(),
        "second run on the new agent: {s2}"
    );
    let requeue_secs = t_killed.elapsed().as_secs_f64();
    let fin = tap.job_event(&r.id, "finished", WAIT).await?;
    ensure!(
        fin["outcome"]["code"] == 0 && fin["agent"] == a2.as_str(),
        "{fin}"
    );

    // Non-rerunnable: reported failed "node lost", never started again.
    let (script, pidfile) = pid_script(&alice, "fence-n", 30);
    let mut n = job(pool, &alice.name, "fence-n", &script);
    n.rerunnable = false;
    let a3 = format!("{cluster}-f3");
    drop(_agent2);
    let agent3 = start_agent_url(&url, &cluster, pool, &a3, AGENT_TOML)?;
    wait_agent_up(&mut tap, &a3).await?;
    broker.publish_job(&n).await?;
    let s = tap.job_event(&n.id, "started", WAIT).await?;
    ensure!(s["agent"] == a3.as_str(), "{s}");
    let pgid = job_running(&pidfile).await?;
    agent3.guard.signal(Signal::SIGKILL);
    kill_job(pgid);
    let failed = tap.job_event(&n.id, "failed", WAIT).await?;
    let reason = failed["reason"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("node lost") && reason.contains("not rerunnable"),
        "{reason}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = tap
        .wait_for(Duration::from_millis(500), "late events", |_, _| false)
        .await;

    ensure!(
        count(&tap, &r.id, "started") == 2
            && count(&tap, &r.id, "finished") == 1
            && count(&tap, &r.id, "failed") == 0,
        "rerunnable job: started {} finished {} failed {}",
        count(&tap, &r.id, "started"),
        count(&tap, &r.id, "finished"),
        count(&tap, &r.id, "failed")
    );
    ensure!(
        count(&tap, &n.id, "started") == 1
            && count(&tap, &n.id, "finished") == 0
            && count(&tap, &n.id, "failed") == 1,
        "non-rerunnable job: started {} finished {} failed {}",
        count(&tap, &n.id, "started"),
        count(&tap, &n.id, "finished"),
        count(&tap, &n.id, "failed")
    );
    let dead = broker.take_dead().await?;
    ensure!(
        dead.len() == 1 && dead[0].message_id.as_deref() == Some(n.id.as_str()),
        "dead letters: {dead:#?}"
    );
    for a in [&a1, &a3] {
        // The fenced agents' lease queues are deleted.
        let gone = broker.queue_len(&broker.topo.lease_queue(a)).await.is_err();
        ensure!(gone, "lease queue of {a} still exists");
    }
    // The controller's metrics tell the same story: one job requeued for a
    // lost node, one run measured, each end counted once.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let metrics = reqwest::get(format!("http://{listen}/metrics"))
        .await?
        .text()
        .await?;
    for want in [
        format!("vq_jobs_requeued_total{{pool=\"{pool}\",reason=\"node-lost\"}} 1"),
        format!("vq_job_run_duration_seconds_count{{pool=\"{pool}\"}} 1"),
        format!(
            "vq_jobs_ended_total{{pool=\"{pool}\",outcome=\"finished\",reason=\"exit-zero\"}} 1"
        ),
        format!("vq_jobs_ended_total{{pool=\"{pool}\",outcome=\"failed\",reason=\"node-lost\"}} 1"),
    ] {
        ensure!(metrics.contains(&want), "no {want} in /metrics:\n{metrics}");
    }
    eprintln!("faults_agent fence: rerunnable job ran again {requeue_secs:.1} s after its agent was killed; non-rerunnable failed: {reason}");
    for name in ["fence-r", "fence-n"] {
        for ext in ["o", "e"] {
            let seq = if name == "fence-r" { r.seq() } else { n.seq() };
            let _ = std::fs::remove_file(alice.home.join(format!("{name}.{ext}{seq}")));
        }
    }
    controller.sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}

/// Agents registered in `<c>.agents` (read and returned).
async fn registered(broker: &TestBroker) -> anyhow::Result<Vec<String>> {
    let ch = broker.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            broker.topo.agents_queue().as_str().into(),
            lapin::options::BasicGetOptions { no_ack: false },
        )
        .await?
    {
        out.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    ch.close(200, "read".into()).await?;
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_controller_that_never_heard_a_dead_agent_finds_its_leases_in_the_registry(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "orphan";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let url = broker_url(Role::Agent)?;

    // The agent runs, takes a job and dies (with its job) before any
    // controller runs: nobody ever hears its heartbeats.
    let a1 = format!("{cluster}-o1");
    let agent1 = start_agent_url(&url, &cluster, pool, &a1, AGENT_TOML)?;
    wait_agent_up(&mut tap, &a1).await?;
    ensure!(
        registered(&broker).await?.contains(&a1),
        "the agent did not register before taking jobs"
    );
    let (script, pidfile) = pid_script(&alice, "orphan-r", 3);
    let r = job(pool, &alice.name, "orphan-r", &script);
    broker.publish_job(&r).await?;
    let s1 = tap.job_event(&r.id, "started", WAIT).await?;
    ensure!(s1["agent"] == a1.as_str(), "{s1}");
    let pgid = job_running(&pidfile).await?;
    agent1.guard.signal(Signal::SIGKILL);
    kill_job(pgid);
    ensure!(
        broker.queue_len(&broker.topo.lease_queue(&a1)).await? == 1,
        "the dead agent's lease is not in its lease queue"
    );

    // Now a controller starts, against a cloud without that server.
    let t_controller = Instant::now();
    let controller =
        start_controller_on_empty_cloud(&broker_url(Role::Controller)?, &cluster, pool, "info")
            .await?;
    let a2 = format!("{cluster}-o2");
    let _agent2 = start_agent_url(&url, &cluster, pool, &a2, AGENT_TOML)?;
    let s2 = nth_event(&mut tap, &r.id, "started", 2).await?;
    ensure!(
        s2["agent"] == a2.as_str(),
        "second run on the new agent: {s2}"
    );
    let found_secs = t_controller.elapsed().as_secs_f64();
    let fin = tap.job_event(&r.id, "finished", WAIT).await?;
    ensure!(
        fin["outcome"]["code"] == 0 && fin["agent"] == a2.as_str(),
        "{fin}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = tap
        .wait_for(Duration::from_millis(500), "late events", |_, _| false)
        .await;
    ensure!(
        count(&tap, &r.id, "started") == 2
            && count(&tap, &r.id, "finished") == 1
            && count(&tap, &r.id, "failed") == 0,
        "started {} finished {} failed {}",
        count(&tap, &r.id, "started"),
        count(&tap, &r.id, "finished"),
        count(&tap, &r.id, "failed")
    );
    ensure!(
        broker
            .queue_len(&broker.topo.lease_queue(&a1))
            .await
            .is_err(),
        "the orphaned lease queue still exists"
    );
    // The controller reads the registry each cycle with basic.get and
    // returns the entries when it closes its channel: while it holds them
    // a reader sees fewer, so read until the expected entries are seen.
    let deadline = Instant::now() + WAIT;
    loop {
        let reg = registered(&broker).await?;
        if !reg.contains(&a1) && reg.contains(&a2) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "registry after the fence: {reg:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("faults_agent orphan: a controller started after the agent died returned its job in {found_secs:.1} s (heartbeat timeout 2 s); started 2 (1 killed), finished 1, lost 0");
    for ext in ["o", "e"] {
        let _ = std::fs::remove_file(alice.home.join(format!("orphan-r.{ext}{}", r.seq())));
    }
    controller.sim.shutdown().await;
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_agent_whose_lease_queue_was_deleted_declares_it_again_and_loses_nothing(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "relived";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let a1 = format!("{cluster}-r1");
    let _agent = start_agent_url(&broker_url(Role::Agent)?, &cluster, pool, &a1, AGENT_TOML)?;
    wait_agent_up(&mut tap, &a1).await?;
    // What a wrong fence does to a live agent: its lease queue and registry
    // entry are gone.
    broker
        .ch
        .queue_delete(
            broker.topo.lease_queue(&a1).as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await?;
    let _ = broker
        .ch
        .queue_purge(
            broker.topo.agents_queue().as_str().into(),
            lapin::options::QueuePurgeOptions::default(),
        )
        .await?;
    let jobs: Vec<_> = (0..3)
        .map(|i| job(pool, &alice.name, &format!("relived{i}"), "echo ok\n"))
        .collect();
    for j in &jobs {
        broker.publish_job(j).await?;
    }
    for j in &jobs {
        let fin = tap.job_event(&j.id, "finished", WAIT).await?;
        ensure!(fin["outcome"]["code"] == 0, "{fin}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = tap
        .wait_for(Duration::from_millis(500), "late events", |_, _| false)
        .await;
    for j in &jobs {
        ensure!(
            count(&tap, &j.id, "started") == 1 && count(&tap, &j.id, "finished") == 1,
            "job {} started {} finished {}",
            j.name,
            count(&tap, &j.id, "started"),
            count(&tap, &j.id, "finished")
        );
        for ext in ["o", "e"] {
            let _ = std::fs::remove_file(alice.home.join(format!("{}.{ext}{}", j.name, j.seq())));
        }
    }
    ensure!(
        broker.take_dead().await?.is_empty(),
        "jobs were dead-lettered"
    );
    ensure!(
        registered(&broker).await?.contains(&a1),
        "the agent did not register again"
    );
    ensure!(
        broker.queue_len(&broker.topo.lease_queue(&a1)).await? == 0,
        "the lease queue was not declared again (or a lease was left)"
    );
    // Found missing another way: deleted while idle, then the connection
    // drops. The next session finds it missing and registers again.
    broker
        .ch
        .queue_delete(
            broker.topo.lease_queue(&a1).as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await?;
    let _ = broker
        .ch
        .queue_purge(
            broker.topo.agents_queue().as_str().into(),
            lapin::options::QueuePurgeOptions::default(),
        )
        .await?;
    let needle = format!("jobagent {a1}");
    tokio::task::spawn_blocking(move || vq_tests::harness::close_broker_connections(&needle))
        .await??;
    let deadline = Instant::now() + WAIT;
    while !registered(&broker).await?.contains(&a1) {
        ensure!(
            Instant::now() < deadline,
            "the agent did not register again after finding its lease queue gone"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    broker.cleanup().await;
    Ok(())
}

/// Ask-delete trials.
const ASK_TRIALS: usize = 12;

fn ask_trials() -> usize {
    vq_tests::harness::fault_trials(ASK_TRIALS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn ask_delete_racing_a_job_delivery_never_says_yes_with_a_job_held() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "race";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let url = broker_url(Role::Agent)?;
    let (mut yes, mut no) = (0, 0);
    for trial in 0..ask_trials() {
        let agent_id = format!("{cluster}-r{trial}");
        let agent = start_agent_url(&url, &cluster, pool, &agent_id, AGENT_TOML)?;
        wait_agent_up(&mut tap, &agent_id).await?;
        // The job must still be held when the question arrives (at most
        // 40 ms after it): a `true` job can be claimed, run, reported and
        // released within that window, and an agent that took and finished
        // a job before the question is rightly idle and says yes.
        let j = job(pool, &alice.name, &format!("race{trial}"), "sleep 1");
        let request_id = format!("req-{trial}");
        let ask = Control::AskDelete {
            request_id: request_id.clone(),
        };
        let delay = Duration::from_millis(rand::random_range(0..40));
        if trial % 2 == 0 {
            broker.publish_job(&j).await?;
            tokio::time::sleep(delay).await;
            broker.publish_control(&agent_id, &ask).await?;
        } else {
            broker.publish_control(&agent_id, &ask).await?;
            tokio::time::sleep(delay).await;
            broker.publish_job(&j).await?;
        }
        let answer = tap
            .wait_for(WAIT, "delete answer", |k, v| {
                k.ends_with(".answer") && v["request_id"] == request_id.as_str()
            })
            .await?;
        ensure!(
            answer["agent"] == agent_id.as_str(),
            "answer from another agent: {answer}"
        );
        // Let a wrongly taken job show itself.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let _ = tap
            .wait_for(Duration::from_millis(300), "late events", |_, _| false)
            .await;
        let started_here = tap.seen.iter().any(|(k, v)| {
            k.ends_with(".started")
                && v["job_id"] == j.id.as_str()
                && v["agent"] == agent_id.as_str()
        });
        if answer["may_delete"] == true {
            yes += 1;
            ensure!(
                !started_here,
                "trial {trial}: the agent said yes but ran job {}",
                j.id
            );
            ensure!(
                answer["running"].as_array().is_some_and(|a| a.is_empty()),
                "{answer}"
            );
            // Not lost: still in the pool queue.
            let n = broker.queue_len(&broker.topo.pool_queue(pool)).await?;
            ensure!(
                n == 1,
                "trial {trial}: job not back in the pool queue ({n})"
            );
            // Take it out for the next trial.
            let got = broker
                .ch
                .basic_get(
                    broker.topo.pool_queue(pool).as_str().into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await?;
            ensure!(got.is_some(), "job vanished");
        } else {
            no += 1;
            ensure!(
                started_here,
                "trial {trial}: the agent said no but did not run job {}: {answer}",
                j.id
            );
            tap.job_event(&j.id, "finished", WAIT).await?;
        }
        drop(agent);
        let _ = std::fs::remove_file(alice.home.join(format!("race{trial}.o{}", j.seq())));
        let _ = std::fs::remove_file(alice.home.join(format!("race{trial}.e{}", j.seq())));
    }
    eprintln!("faults_agent ask-delete race: {} trials, {yes} yes (job stayed queued), {no} no (job ran); 0 violations", ask_trials());
    if yes == 0 || no == 0 {
        eprintln!("note: only one side of the race was hit this time");
    }
    broker.cleanup().await;
    Ok(())
}

/// A script that records its process group (see [`pid_script`]) and runs
/// until `release` exists.
fn held_script(user: &TestUser, name: &str) -> (String, std::path::PathBuf, std::path::PathBuf) {
    let (start, pidfile) = pid_script(user, name, 0);
    let release = user.home.join(format!("{name}.release"));
    let _ = std::fs::remove_file(&release);
    let script = start.replace(
        "sleep 0\n",
        &format!("while [ ! -e {} ]; do sleep 0.1; done\n", release.display()),
    );
    (script, pidfile, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_second_message_with_the_id_of_a_running_job_on_another_agent_is_reported_not_run(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "dup";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let url = broker_url(Role::Agent)?;
    let (da, db) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let a = format!("{cluster}-a");
    let b = format!("{cluster}-b");
    let _agent_a = start_agent_in(&url, &cluster, pool, &a, AGENT_TOML, da.path())?;
    wait_agent_up(&mut tap, &a).await?;
    let (script, pidfile, release) = held_script(&alice, "dupfirst");
    let first = job(pool, &alice.name, "dupfirst", &script);
    broker.publish_job(&first).await?;
    tap.job_event(&first.id, "started", WAIT).await?;
    job_running(&pidfile).await?;
    // Agent A is full (one slot): the second message goes to agent B, which
    // knows nothing of the first in memory; only the claim marker tells.
    let _agent_b = start_agent_in(&url, &cluster, pool, &b, AGENT_TOML, db.path())?;
    wait_agent_up(&mut tap, &b).await?;
    let mut second = job(pool, &alice.name, "dupsecond", "echo second");
    second.id = first.id.clone();
    broker.publish_job(&second).await?;
    let failed = tap.job_event(&first.id, "failed", WAIT).await?;
    ensure!(
        failed["duplicate"].is_string(),
        "not marked duplicate: {failed}"
    );
    ensure!(
        failed["reason"]
            .as_str()
            .is_some_and(|r| r.contains("duplicate job id")),
        "{failed}"
    );
    std::fs::write(&release, b"go")?;
    let fin = tap.job_event(&first.id, "finished", WAIT).await?;
    ensure!(fin["agent"] == a.as_str(), "the first ran on A: {fin}");
    ensure!(count(&tap, &first.id, "started") == 1, "started twice");
    let dead = broker.take_dead().await?;
    ensure!(dead.len() == 1, "dead letters: {dead:#?}");
    ensure!(
        dead[0].headers["x-vq-reason"].contains("duplicate job id"),
        "{:?}",
        dead[0].headers
    );
    for ext in ["o", "e"] {
        let _ = std::fs::remove_file(alice.home.join(format!("dupfirst.{ext}{}", first.seq())));
    }
    let _ = std::fs::remove_file(&release);
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_agent_restarting_under_a_job_applies_the_configured_loss_limit() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let pool = "limit1";
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-l1");
    let dir = tempfile::tempdir()?;
    let url = broker_url(Role::Agent)?;
    let cfg = format!("loss_limit = 1\n{AGENT_TOML}");
    let mut agent = start_agent_in(&url, &cluster, pool, &agent_id, &cfg, dir.path())?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let (script, pidfile) = pid_script(&alice, "limit1", 30);
    let j = job(pool, &alice.name, "limit1", &script);
    broker.publish_job(&j).await?;
    tap.job_event(&j.id, "started", WAIT).await?;
    let pgid = job_running(&pidfile).await?;
    agent.signal(Signal::SIGKILL);
    agent.wait_timeout(Duration::from_secs(5));
    kill_job(pgid);
    drop(agent);
    let _agent = start_agent_in(&url, &cluster, pool, &agent_id, &cfg, dir.path())?;
    let failed = tap.job_event(&j.id, "failed", WAIT).await?;
    let reason = failed["reason"].as_str().unwrap_or_default();
    ensure!(reason.contains("limit 1"), "reason: {reason}");
    ensure!(
        count(&tap, &j.id, "started") == 1,
        "run again past the limit"
    );
    let dead = broker.take_dead().await?;
    ensure!(dead.len() == 1, "dead letters: {dead:#?}");
    let _ = std::fs::remove_file(&pidfile);
    broker.cleanup().await;
    Ok(())
}
