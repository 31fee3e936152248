//! Issue #4, "systemd stop of the agent drains with a grace, then requeues
//! rerunnable jobs it could not finish", on a private RabbitMQ node with
//! the production jobagent and controller binaries.
//!
//! Each trial starts an agent with 2 slots and `--drain-grace-secs 3`, runs
//! a short job (1 s) and a long one (30 s) on it and sends it one SIGTERM,
//! as `systemctl stop` does. Then:
//!
//! * it stops pulling at once: its next heartbeat says `is_pull: false`,
//!   and a job submitted right after the signal is not taken by it, even
//!   once the short job has freed a slot;
//! * the short job finishes normally within the grace;
//! * after the grace the long job is stopped. Rerunnable (`-r y`): no
//!   result; its lease stays until the controller, seeing the agent's
//!   heartbeats stop, fences it and returns the job to the pool, where a
//!   second agent runs it to completion. Non-rerunnable (`-r n`): reported
//!   failed with the reason and dead-lettered, never started again;
//! * the agent exits 0 within the grace plus a few seconds;
//! * per job: one `started` per execution (the job's own log counts the
//!   executions too), exactly one final result, no lease left.
//!
//! Trials alternate `-r y` / `-r n`; every third one sends the SIGTERM
//! 0-40 ms after publishing the long job, so that the job may be in flight
//! (delivered, not yet claimed: it must go back to the queue and run once
//! elsewhere) or just claimed. The other trials signal at a random moment
//! up to 1 s after the long job started.
//!
//! `VQ_FAULT_TRIALS=N` overrides the number of trials (default 6, about
//! 10 s each). Root only:
//! `cargo test -p vq-tests --test faults_drain -- --include-ignored --nocapture`.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use nix::sys::signal::Signal;
use vq_common::messages::Job;
use vq_common::topology::Role;
use vq_tests::harness::{
    ensure_test_user, job, require_root, start_controller_on_empty_cloud, unique_cluster,
    wait_agent_up, AgentLaunch, ChildGuard, EventTap, TestBroker, TestUser,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "drain";
/// Config of every agent here (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 2\n";
/// The drain grace given to the agent under test.
const GRACE: Duration = Duration::from_secs(3);
/// How long after the grace the agent may take to exit.
const EXIT_SLACK: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(30);
const DEFAULT_TRIALS: usize = 6;

/// Starts `jobagent` on `dir` (config, identity and state there) with
/// `--drain-grace-secs`, as the packaged systemd unit does. Its log goes
/// to the test's stderr.
fn spawn_agent(
    url: &str,
    cluster: &str,
    agent_id: &str,
    grace: Duration,
    dir: &Path,
) -> anyhow::Result<ChildGuard> {
    let grace = grace.as_secs().to_string();
    AgentLaunch {
        url,
        cluster,
        pool: POOL,
        agent_id,
        extra_toml: AGENT_TOML,
        broker_toml: "",
        dir,
        stderr: None,
        args: &["--drain-grace-secs", &grace],
        env: &[],
    }
    .spawn()
}

/// Waits (without blocking the runtime) up to `timeout` for `child` to
/// exit.
async fn wait_exit(child: &mut ChildGuard, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `is_pull` of `agent`'s heartbeats seen from index `from` on.
fn pull_flags(tap: &EventTap, agent: &str, from: usize) -> Vec<bool> {
    tap.seen[from..]
        .iter()
        .filter(|(k, v)| k.ends_with(".heartbeat") && v["agent"] == agent)
        .map(|(_, v)| v["is_pull"] == true)
        .collect()
}

/// Lets late events arrive.
async fn settle(tap: &mut EventTap, d: Duration) {
    let _ = tap.wait_for(d, "late events", |_, _| false).await;
}

/// Waits for the `n`-th `started` of `job_id`.
async fn nth_started(
    tap: &mut EventTap,
    job_id: &str,
    n: usize,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = tap.events(job_id, "started").get(n - 1) {
            return Ok((*v).clone());
        }
        ensure!(
            Instant::now() < deadline,
            "timed out waiting for start #{n} of {job_id}"
        );
        settle(tap, Duration::from_millis(300)).await;
    }
}

/// A job script that logs each execution's start and end to `log`; the
/// first execution (no `mark` yet) takes `first_secs`, later ones 1 s.
fn logged_script(log: &Path, mark: &Path, first_secs: u32) -> String {
    format!(
        "echo start >> {log}\nif [ -e {mark} ]; then sleep 1; else touch {mark}; sleep {first_secs}; fi\necho end >> {log}\n",
        log = log.display(),
        mark = mark.display()
    )
}

/// (executions started, executions that reached their end) from a job log.
fn runs(log: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    (
        text.lines().filter(|l| *l == "start").count(),
        text.lines().filter(|l| *l == "end").count(),
    )
}

/// Whether queue `q` exists and holds messages; `None` if it is gone.
async fn queue_len(b: &TestBroker, q: &str) -> Option<u32> {
    b.queue_len(q).await.ok()
}

/// One trial's facts, for the summary line.
#[derive(Debug)]
struct Trial {
    rerunnable: bool,
    race: bool,
    /// The long job was claimed (started) by the drained agent.
    claimed: bool,
    /// When SIGTERM came.
    term_after: String,
    /// SIGTERM → agent exit.
    exit_secs: f64,
    /// Executions of the long job.
    long_runs: usize,
}

struct Files {
    paths: Vec<PathBuf>,
}

impl Files {
    fn job_outputs(&mut self, user: &TestUser, j: &Job) {
        for ext in ["o", "e"] {
            self.paths
                .push(user.home.join(format!("{}.{ext}{}", j.name, j.seq())));
        }
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[allow(clippy::too_many_lines)]
async fn trial(
    t: usize,
    url: &str,
    cluster: &str,
    broker: &TestBroker,
    tap: &mut EventTap,
    alice: &TestUser,
    files: &mut Files,
) -> anyhow::Result<Trial> {
    let rerunnable = t % 2 == 0;
    let race = t % 3 == 2;
    let a1 = format!("{cluster}-t{t}a");
    let a2 = format!("{cluster}-t{t}b");
    let dir1 = tempfile::tempdir()?;
    let dir2 = tempfile::tempdir()?;
    let mut agent1 = spawn_agent(url, cluster, &a1, GRACE, dir1.path())?;
    wait_agent_up(tap, &a1).await?;

    let path = |name: &str, ext: &str| alice.home.join(format!("{cluster}-{t}-{name}.{ext}"));
    let (short_log, long_log, late_log) = (
        path("short", "log"),
        path("long", "log"),
        path("late", "log"),
    );
    let long_mark = path("long", "mark");
    files.paths.extend([
        short_log.clone(),
        long_log.clone(),
        late_log.clone(),
        long_mark.clone(),
    ]);
    let short = job(
        POOL,
        &alice.name,
        &format!("short{t}"),
        &logged_script(&short_log, &path("short", "mark"), 1),
    );
    files.paths.push(path("short", "mark"));
    let mut long = job(
        POOL,
        &alice.name,
        &format!("long{t}"),
        &logged_script(&long_log, &long_mark, 30),
    );
    long.rerunnable = rerunnable;
    let late = job(
        POOL,
        &alice.name,
        &format!("late{t}"),
        &format!("echo start >> {0}\necho end >> {0}\n", late_log.display()),
    );
    for j in [&short, &long, &late] {
        files.job_outputs(alice, j);
    }

    broker.publish_job(&short).await?;
    let s = tap.job_event(&short.id, "started", WAIT).await?;
    ensure!(s["agent"] == a1.as_str(), "{s}");
    // Race trials: SIGTERM from 10 ms before to 15 ms after the long job's
    // publish is confirmed; the agent claims a delivery within a few ms.
    let offset_ms: i64 = if race { rand::random_range(-10..15) } else { 0 };
    let n_seen = tap.seen.len();
    // `systemctl stop`: SIGTERM to the agent alone.
    let mut t_term = Instant::now();
    if offset_ms < 0 {
        agent1.signal(Signal::SIGTERM);
        t_term = Instant::now();
        tokio::time::sleep(Duration::from_millis(offset_ms.unsigned_abs())).await;
    }
    let t_publish = Instant::now();
    broker.publish_job(&long).await?;
    if !race {
        let s = tap.job_event(&long.id, "started", WAIT).await?;
        ensure!(s["agent"] == a1.as_str(), "{s}");
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
    } else if offset_ms > 0 {
        tokio::time::sleep(Duration::from_millis(offset_ms.unsigned_abs())).await;
    }
    if offset_ms >= 0 {
        agent1.signal(Signal::SIGTERM);
        t_term = Instant::now();
    }
    let term_after = if race {
        format!("{offset_ms:+} ms from the long job's publish")
    } else {
        format!(
            "{} ms after the long job's start",
            t_publish.elapsed().as_millis()
        )
    };
    broker.publish_job(&late).await?;

    // It stops pulling at once.
    tap.wait_for(
        Duration::from_secs(2),
        "a heartbeat without is_pull",
        |k, v| k.ends_with(".heartbeat") && v["agent"] == a1.as_str() && v["is_pull"] == false,
    )
    .await?;
    let stop_pulling = t_term.elapsed();
    ensure!(
        pull_flags(tap, &a1, n_seen)
            .iter()
            .skip_while(|p| **p)
            .all(|p| !p),
        "trial {t}: the agent said is_pull again after SIGTERM"
    );
    // The short job ends normally on it, within the grace.
    let f = tap.job_event(&short.id, "finished", WAIT).await?;
    ensure!(
        f["agent"] == a1.as_str() && f["outcome"]["kind"] == "exited" && f["outcome"]["code"] == 0,
        "trial {t}: short job: {f}"
    );
    ensure!(
        t_term.elapsed() < GRACE,
        "trial {t}: short job finished only {:?} after SIGTERM",
        t_term.elapsed()
    );

    // It exits 0 within the grace plus a little.
    let st = wait_exit(&mut agent1, GRACE + EXIT_SLACK)
        .await
        .with_context(|| {
            format!(
                "trial {t}: agent did not exit within {:?}",
                GRACE + EXIT_SLACK
            )
        })?;
    let exit_secs = t_term.elapsed().as_secs_f64();
    ensure!(st.success(), "trial {t}: agent exited with {st}");
    settle(tap, Duration::from_millis(300)).await;
    ensure!(
        pull_flags(tap, &a1, n_seen)
            .iter()
            .skip_while(|p| **p)
            .all(|p| !p),
        "trial {t}: the agent said is_pull again after SIGTERM"
    );
    let claimed = !tap.events(&long.id, "started").is_empty();
    ensure!(
        race || claimed,
        "trial {t}: long job not started before the signal"
    );
    if claimed {
        // Stopped by the end of the grace, not before.
        ensure!(
            exit_secs >= GRACE.as_secs_f64(),
            "trial {t}: agent exited {exit_secs:.1} s after SIGTERM, before the grace"
        );
    }
    // The late job was not taken, though a slot was free for 2 s.
    ensure!(
        tap.events(&late.id, "started").is_empty(),
        "trial {t}: the draining agent took a job submitted after SIGTERM"
    );
    let queued = queue_len(broker, &broker.topo.pool_queue(POOL))
        .await
        .unwrap_or(0);
    // The late job, and the long job unless it was claimed. A claimed
    // rerunnable long job waits in the stopped agent's lease queue until
    // the controller, a heartbeat timeout (2 s) after the last heartbeat,
    // fences the agent and returns it: on a loaded machine that may have
    // happened already, so both counts are right then (the exactly-once
    // accounting below checks the job's runs).
    let expect_queued: &[u32] = match (claimed, rerunnable) {
        (false, _) => &[2],
        (true, false) => &[1],
        (true, true) => &[1, 2],
    };
    ensure!(
        expect_queued.contains(&queued),
        "trial {t}: {queued} job(s) in the pool queue after the drain, expected {expect_queued:?}"
    );
    if claimed && !rerunnable {
        let f = tap
            .job_event(&long.id, "failed", Duration::from_secs(1))
            .await?;
        let reason = f["reason"].as_str().unwrap_or_default();
        ensure!(
            f["agent"] == a1.as_str()
                && reason.contains("shut down")
                && reason.contains("not rerunnable"),
            "trial {t}: non-rerunnable long job: {f}"
        );
    }
    if claimed && rerunnable {
        ensure!(
            tap.finals(&long.id).is_empty(),
            "trial {t}: an interrupted rerunnable job got a result: {:?}",
            tap.finals(&long.id)
        );
    }

    if !claimed {
        // Never ran: its one execution (on the next agent) may be short.
        std::fs::write(&long_mark, "")?;
    }
    // A replacement agent: the late job runs there, and the long job too
    // when it is rerunnable or was never claimed (the controller returns
    // the lease of the stopped agent once its heartbeats are missed).
    let mut agent2 = spawn_agent(url, cluster, &a2, Duration::from_secs(10), dir2.path())?;
    let f = tap.job_event(&late.id, "finished", WAIT).await?;
    ensure!(
        f["agent"] == a2.as_str() && f["outcome"]["code"] == 0,
        "trial {t}: late job: {f}"
    );
    let long_runs_expected = match (claimed, rerunnable) {
        (true, true) => 2,
        _ => 1,
    };
    if rerunnable || !claimed {
        let s = nth_started(tap, &long.id, long_runs_expected, WAIT).await?;
        ensure!(s["agent"] == a2.as_str(), "trial {t}: long job rerun: {s}");
        let f = tap.job_event(&long.id, "finished", WAIT).await?;
        ensure!(
            f["agent"] == a2.as_str() && f["outcome"]["code"] == 0,
            "trial {t}: long job: {f}"
        );
    }
    // Nothing left: the stopped agent's lease queue is emptied and deleted
    // by the controller (a non-rerunnable job must stay failed).
    let deadline = Instant::now() + WAIT;
    while queue_len(broker, &broker.topo.lease_queue(&a1))
        .await
        .is_some()
    {
        ensure!(
            Instant::now() < deadline,
            "trial {t}: lease queue of the stopped agent never fenced"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    settle(tap, Duration::from_millis(1500)).await;

    // Exactly-once accounting, from the events and from the jobs' own logs.
    for (j, log, runs_expected) in [
        (&short, &short_log, 1),
        (&late, &late_log, 1),
        (&long, &long_log, long_runs_expected),
    ] {
        let started = tap.events(&j.id, "started").len();
        let fin = tap.finals(&j.id);
        let (ran, ended) = runs(log);
        ensure!(
            started == runs_expected && ran == runs_expected,
            "trial {t}: job {} started {started} times (log: {ran}), expected {runs_expected}",
            j.name
        );
        ensure!(
            fin.len() == 1,
            "trial {t}: job {} has {} final results: {fin:?}",
            j.name,
            fin.len()
        );
        let interrupted_here = j.id == long.id && claimed;
        let ok = fin[0]["state"] == "finished" && fin[0]["outcome"]["code"] == 0;
        if interrupted_here && !rerunnable {
            ensure!(
                fin[0]["state"] == "failed" && ended == 0,
                "trial {t}: {}",
                fin[0]
            );
        } else {
            ensure!(
                ok && ended == 1,
                "trial {t}: job {} did not finish normally: {} (log ends: {ended})",
                j.name,
                fin[0]
            );
        }
    }
    let dead = broker.take_dead().await?;
    if claimed && !rerunnable {
        ensure!(
            dead.len() == 1
                && dead[0].message_id.as_deref() == Some(long.id.as_str())
                && dead[0]
                    .headers
                    .get("x-vq-reason")
                    .is_some_and(|r| r.contains("not rerunnable")),
            "trial {t}: dead letters: {dead:#?}"
        );
    } else {
        ensure!(dead.is_empty(), "trial {t}: dead letters: {dead:#?}");
    }
    ensure!(
        queue_len(broker, &broker.topo.lease_queue(&a2))
            .await
            .unwrap_or(0)
            == 0,
        "trial {t}: lease left on the second agent"
    );
    ensure!(
        queue_len(broker, &broker.topo.pool_queue(POOL))
            .await
            .unwrap_or(0)
            == 0,
        "trial {t}: job left in the pool queue"
    );
    // The idle replacement stops at once, with 0.
    agent2.signal(Signal::SIGTERM);
    let st = wait_exit(&mut agent2, Duration::from_secs(10))
        .await
        .context("idle agent did not exit")?;
    ensure!(st.success(), "trial {t}: idle agent exited with {st}");
    eprintln!(
        "faults_drain trial {t}: -r {} {} SIGTERM {term_after}; stopped pulling after {:.2} s; exit 0 after {exit_secs:.1} s; long job {}, {} execution(s)",
        if rerunnable { "y" } else { "n" },
        if race { "race" } else { "running" },
        stop_pulling.as_secs_f64(),
        if !claimed { "not claimed (ran once elsewhere)" } else if rerunnable { "interrupted, rerun elsewhere" } else { "interrupted, failed + dead-lettered" },
        long_runs_expected,
    );
    Ok(Trial {
        rerunnable,
        race,
        claimed,
        term_after,
        exit_secs,
        long_runs: long_runs_expected,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn systemd_stop_drains_with_a_grace_then_requeues_rerunnable_jobs() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let url = node.role_url(Role::Agent);
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;

    // The controller against an empty test cloud (max 0): it boots
    // nothing, and fences agents without a server once their heartbeats
    // stop, as it fences a stopped agent's VM.
    let controller =
        start_controller_on_empty_cloud(&node.role_url(Role::Controller), &cluster, POOL, "warn")
            .await?;
    // It judges agents without a server only after listening a whole
    // heartbeat timeout.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let n = vq_tests::harness::fault_trials(DEFAULT_TRIALS);
    let mut files = Files { paths: Vec::new() };
    let mut done = Vec::new();
    let t0 = Instant::now();
    for t in 0..n {
        match trial(t, &url, &cluster, &broker, &mut tap, &alice, &mut files).await {
            Ok(r) => done.push(r),
            Err(e) => bail!("{e:#}\nearlier trials: {done:#?}"),
        }
    }
    let interrupted_r = done.iter().filter(|r| r.claimed && r.rerunnable).count();
    let interrupted_n = done.iter().filter(|r| r.claimed && !r.rerunnable).count();
    let in_flight = done.iter().filter(|r| !r.claimed).count();
    let races = done.iter().filter(|r| r.race).count();
    let max_exit = done.iter().map(|r| r.exit_secs).fold(0.0, f64::max);
    let reruns: usize = done.iter().map(|r| r.long_runs.saturating_sub(1)).sum();
    let delays: Vec<&str> = done
        .iter()
        .filter(|r| r.race)
        .map(|r| r.term_after.as_str())
        .collect();
    eprintln!(
        "faults_drain: {n} trials in {:.0} s ({races} racing the delivery: SIGTERM {delays:?}): \
         {interrupted_r} rerunnable long jobs stopped after the grace and rerun once elsewhere ({reruns} reruns), \
         {interrupted_n} non-rerunnable ones failed + dead-lettered, {in_flight} in flight and run once elsewhere; \
         every short job finished within the grace, no late job taken by a draining agent; agents exited 0 within {max_exit:.1} s; \
         lost 0, duplicated 0, unexpected interruptions 0",
        t0.elapsed().as_secs_f64()
    );
    controller.sim.shutdown().await;
    broker.cleanup().await;
    drop(node);
    Ok(())
}
