//! Issue #9, "an unknown outcome is not a refusal": the agent's broker
//! connections are dropped at single steps of the claim / start / finish /
//! release protocol, and the invariant must hold: **at any moment at most
//! one live execution per job id; exactly one final result per job id**.
//!
//! Agent A reaches a private RabbitMQ node through an [`AmqpProxy`]; the test's
//! own connection, and agent B (started in half of the trials, so that a
//! job the broker returns to the pool can run elsewhere), go to the broker
//! directly. Each trial arms one proxy rule for one [`Case`] (a protocol
//! step and whether the cut comes before or after the frame), with a random
//! occurrence among the trial's jobs and a random close (RST or FIN),
//! submits 1-3 jobs (`-r y` or `-r n`, 1.5-3 s each), and waits until the
//! system is quiet: every running agent heartbeated twice with no job
//! running, after the last job event (and, if the rule fired, after A
//! reconnected), while the pool and lease queues were empty. Then, per job:
//!
//! * exactly one final result (`job.<pool>.{finished,failed}` events,
//!   deduplicated on the AMQP `message_id` when there is one): none is a
//!   **lost** job;
//! * never two live executions (the job script holds `flock -n` on a
//!   per-job lock file while it runs and logs `overlap` if it cannot take
//!   it; start/end times are checked too); a rerun after the first
//!   execution ended is allowed for `-r y` only;
//! * a `-r n` job runs at most once, and is not reported "node lost" when
//!   it ran;
//! * nothing is left in the lease queues or the pool queue.
//!
//! A table of every trial and a summary per case are printed; the test
//! fails at the end if any trial broke the invariant.
//!
//! To add a step: add a [`Case`] variant to [`CASES`] and give its rule in
//! [`Case::rule`] (a [`Target`] built from the names in [`Names`], and an
//! [`Action`]).
//!
//! `VQ_FAULT_TRIALS=N` sets the number of trials (default 48: each case
//! with `-r y` and `-r n`, each with and without B, about 3-4 minutes). Root only:
//! `cargo test -p vq-tests --test faults_protocol -- --include-ignored --nocapture`.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use vq_common::amqp::{confirm_channel, connect, publish_confirmed};
use vq_common::config::BrokerConfig;
use vq_common::topology::{job_event_key, Role};
use vq_tests::accounts;
use vq_tests::amqp_proxy::{Action, AmqpProxy, Close, Direction, Method, Pred, Rule, Target};
use vq_tests::harness::{
    ensure_test_user, job, require_root, unique_cluster, AgentLaunch, ChildGuard, EventTap,
    TestBroker, TestUser,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "proto";
/// Config of every agent here (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 2\n";
/// Longest a trial may take to become quiet.
const TRIAL_DEADLINE: Duration = Duration::from_secs(60);

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The names of the test cluster a rule needs.
struct Names {
    jobs_exchange: String,
    pool_queue: String,
    events_exchange: String,
    /// The cluster's lease exchange (lease copies are published there with
    /// the lease queue's name as routing key).
    lease_exchange: String,
    /// Agent A's lease queue.
    lease_a: String,
    /// Prefix of every claim marker of the cluster (`<c>.claim.`).
    claim_prefix: String,
    started_key: String,
    finished_key: String,
    failed_key: String,
}

/// A protocol step and when, relative to its frame, A's connection drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Case {
    /// Claim: the pool `basic.deliver`, cut before it reaches A.
    ClaimDeliver,
    /// Claim: the lease copy's `basic.publish`, cut before the broker.
    ClaimLeasePublish,
    /// Claim: the publisher confirm of the lease copy, cut before A.
    ClaimLeaseConfirm,
    /// Claim: A's `basic.ack` of the pool delivery, cut before the broker.
    ClaimPoolAckBefore,
    /// Claim: A's `basic.ack` of the pool delivery, cut right after it
    /// reached the broker.
    ClaimPoolAckAfter,
    /// Claim: the reply to the passive `queue.declare` that confirms the
    /// pool ack, cut before A.
    ClaimAckSyncReply,
    /// Claim: the `declare-ok` of the job's claim marker (the broker made
    /// the marker), cut before A.
    ClaimMarkerReply,
    /// Start: the publisher confirm of `job.<pool>.started`, cut before A.
    StartConfirm,
    /// Finish: the final result's `basic.publish`, cut before the broker.
    FinishPublish,
    /// Finish: the final result's publisher confirm, cut before A.
    FinishConfirm,
    /// Release: the lease `basic.get-ok`, cut before A.
    ReleaseGetOk,
    /// Release: A's `basic.ack` of the lease message, cut right after it
    /// reached the broker.
    ReleaseAckAfter,
    /// Release: the reply to the passive `queue.declare` of the lease
    /// queue that confirms a lease removal, cut before A.
    ReleaseSyncReply,
}

const CASES: [Case; 13] = [
    Case::ClaimDeliver,
    Case::ClaimLeasePublish,
    Case::ClaimLeaseConfirm,
    Case::ClaimPoolAckBefore,
    Case::ClaimPoolAckAfter,
    Case::ClaimAckSyncReply,
    Case::ClaimMarkerReply,
    Case::StartConfirm,
    Case::FinishPublish,
    Case::FinishConfirm,
    Case::ReleaseGetOk,
    Case::ReleaseAckAfter,
    Case::ReleaseSyncReply,
];

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::ClaimDeliver => "claim/deliver-before",
            Case::ClaimLeasePublish => "claim/lease-publish-before",
            Case::ClaimLeaseConfirm => "claim/lease-confirm-lost",
            Case::ClaimPoolAckBefore => "claim/pool-ack-before",
            Case::ClaimPoolAckAfter => "claim/pool-ack-after",
            Case::ClaimAckSyncReply => "claim/ack-sync-reply-lost",
            Case::ClaimMarkerReply => "claim/marker-reply-lost",
            Case::StartConfirm => "start/started-confirm-lost",
            Case::FinishPublish => "finish/result-publish-before",
            Case::FinishConfirm => "finish/result-confirm-lost",
            Case::ReleaseGetOk => "release/lease-get-ok-lost",
            Case::ReleaseAckAfter => "release/lease-ack-after",
            Case::ReleaseSyncReply => "release/lease-sync-reply-lost",
        }
    }

    /// The proxy rule's target and action for this step.
    fn rule(self, n: &Names) -> (Target, Action) {
        use Action::{CutAfter, CutBefore};
        let pool_delivery = || Pred::delivery(&n.jobs_exchange, POOL);
        let lease_copy = || Pred::publish(&n.lease_exchange, &n.lease_a);
        let lease_delivery = || Pred::delivery(&n.lease_exchange, &n.lease_a);
        let result = {
            let (x, f, l) = (
                n.events_exchange.clone(),
                n.finished_key.clone(),
                n.failed_key.clone(),
            );
            move || {
                let (x, f, l) = (x.clone(), f.clone(), l.clone());
                Pred::new(move |m| m.is_publish_to(&x, &f) || m.is_publish_to(&x, &l))
            }
        };
        match self {
            Case::ClaimDeliver => (
                Target::Method(Direction::ToClient, pool_delivery()),
                CutBefore,
            ),
            Case::ClaimLeasePublish => {
                (Target::Method(Direction::ToBroker, lease_copy()), CutBefore)
            }
            Case::ClaimLeaseConfirm => (Target::ConfirmOf(lease_copy()), CutBefore),
            Case::ClaimPoolAckBefore => (Target::AckOf(pool_delivery()), CutBefore),
            Case::ClaimPoolAckAfter => (Target::AckOf(pool_delivery()), CutAfter),
            Case::ClaimAckSyncReply => (
                Target::ReplyTo(Pred::queue_declare(&n.pool_queue, Some(true))),
                CutBefore,
            ),
            Case::ClaimMarkerReply => {
                let prefix = n.claim_prefix.clone();
                (
                    Target::ReplyTo(Pred::new(
                        move |m| matches!(m, Method::QueueDeclare { queue, passive: false, .. } if queue.starts_with(&prefix)),
                    )),
                    CutBefore,
                )
            }
            Case::StartConfirm => (
                Target::ConfirmOf(Pred::publish(&n.events_exchange, &n.started_key)),
                CutBefore,
            ),
            Case::FinishPublish => (Target::Method(Direction::ToBroker, result()), CutBefore),
            Case::FinishConfirm => (Target::ConfirmOf(result()), CutBefore),
            Case::ReleaseGetOk => (
                Target::Method(Direction::ToClient, lease_delivery()),
                CutBefore,
            ),
            Case::ReleaseAckAfter => (Target::AckOf(lease_delivery()), CutAfter),
            Case::ReleaseSyncReply => (
                Target::ReplyTo(Pred::queue_declare(&n.lease_a, Some(true))),
                CutBefore,
            ),
        }
    }
}

/// One planned trial.
#[derive(Debug, Clone, Copy)]
struct Plan {
    case: Case,
    rerunnable: bool,
    with_b: bool,
}

/// What one trial found.
#[derive(Debug)]
struct Row {
    t: usize,
    plan: Plan,
    jobs: usize,
    nth: usize,
    close: Close,
    /// Where the rule fired (`None`: it never matched often enough).
    fired: Option<String>,
    /// Distinct final results per job.
    finals: Vec<usize>,
    /// Executions per job.
    execs: Vec<usize>,
    /// Dead letters of the trial's jobs: "job: reason".
    dead: Vec<String>,
    secs: f64,
    violations: Vec<String>,
}

struct Env<'a> {
    /// The private node's URL (for B).
    url: String,
    broker: &'a TestBroker,
    proxy: &'a AmqpProxy,
    names: Names,
    alice: &'a TestUser,
    /// Job logs and lock files (owned by alice).
    jobdir: PathBuf,
    a_id: String,
    b_id: String,
    a_log: PathBuf,
    b_log: PathBuf,
    b_dir: PathBuf,
    b: Option<ChildGuard>,
    /// Whether B ran at some point (its lease queue exists).
    b_ever: bool,
}

/// The job script: logs `start <token> <time>`, holds the job's lock file
/// while it runs (logging `overlap` if another execution holds it), sleeps,
/// logs `end <token> <time>`.
fn script(dir: &Path, name: &str, secs: f64) -> String {
    let log = dir.join(format!("{name}.log"));
    let lock = dir.join(format!("{name}.lock"));
    format!(
        "tok=\"$$-$(date +%s%N)\"\n\
         exec 9>>{lock}\n\
         flock -n 9 || echo \"overlap $tok $(date +%s.%N)\" >> {log}\n\
         echo \"start $tok $(date +%s.%N)\" >> {log}\n\
         sleep {secs:.2}\n\
         echo \"end $tok $(date +%s.%N)\" >> {log}\n",
        lock = lock.display(),
        log = log.display()
    )
}

/// A job's executions from its log: (token, start, end if it ended), and
/// whether an execution saw the lock taken.
fn executions(dir: &Path, name: &str) -> (Vec<(String, f64, Option<f64>)>, bool) {
    let text = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
    let mut runs: Vec<(String, f64, Option<f64>)> = Vec::new();
    let mut overlap = false;
    for l in text.lines() {
        let mut w = l.split_whitespace();
        let (Some(kind), Some(tok), Some(at)) = (w.next(), w.next(), w.next()) else {
            continue;
        };
        let at: f64 = at.parse().unwrap_or(0.0);
        match kind {
            "start" => runs.push((tok.to_string(), at, None)),
            "end" => {
                if let Some(r) = runs.iter_mut().find(|r| r.0 == tok) {
                    r.2 = Some(at);
                }
            }
            "overlap" => overlap = true,
            _ => {}
        }
    }
    (runs, overlap)
}

/// Ready messages and consumers of `queue` (0, 0 if it does not exist).
async fn queue_state(b: &TestBroker, queue: &str) -> anyhow::Result<(u32, u32)> {
    let ch = b.conn.create_channel().await?;
    let r = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    let out = match r {
        Ok(q) => (q.message_count(), q.consumer_count()),
        Err(_) => (0, 0),
    };
    let _ = ch.close(200, "done".into()).await;
    Ok(out)
}

impl Env<'_> {
    fn lease_queues(&self) -> Vec<String> {
        let mut q = vec![self.names.lease_a.clone()];
        if self.b_ever {
            q.push(self.broker.topo.lease_queue(&self.b_id));
        }
        q
    }

    /// Starts or stops agent B.
    async fn set_b(&mut self, want: bool, tap: &mut EventTap) -> anyhow::Result<()> {
        if want && self.b.is_none() {
            let since = now_unix();
            let url = self.url.clone();
            self.b = Some(
                AgentLaunch {
                    url: &url,
                    cluster: self.broker.topo.cluster(),
                    pool: POOL,
                    agent_id: &self.b_id,
                    extra_toml: AGENT_TOML,
                    broker_toml: "",
                    dir: &self.b_dir,
                    stderr: Some(&self.b_log),
                    args: &[],
                    env: &[],
                }
                .spawn()?,
            );
            self.b_ever = true;
            let b = self.b_id.clone();
            tap.wait_for(
                Duration::from_secs(30),
                "agent B's first heartbeat",
                |k, v| {
                    k.ends_with(".heartbeat")
                        && v["agent"] == b.as_str()
                        && v["at"].as_f64().is_some_and(|at| at >= since)
                },
            )
            .await?;
        } else if !want && self.b.is_some() {
            // SIGKILL (B is idle); wait until the broker dropped its
            // consumer, so no job is pushed to a dead B.
            self.b = None;
            let deadline = Instant::now() + Duration::from_secs(20);
            while queue_state(self.broker, &self.names.pool_queue).await?.1 > 1 {
                ensure!(Instant::now() < deadline, "agent B's consumer stays");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

/// Lines of the agents' logs that name one of `ids`.
fn log_lines(env: &Env<'_>, ids: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (who, path) in [("A", &env.a_log), ("B", &env.b_log)] {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for l in text.lines().filter(|l| ids.iter().any(|id| l.contains(id))) {
            let l = l.split_once("vq_jobagent").map_or(l, |(_, r)| r);
            out.push(format!("{who}: {}", l.trim()));
        }
    }
    out
}

/// Waits until the system is quiet (see the module doc). Returns `false`
/// if it was not quiet by [`TRIAL_DEADLINE`].
async fn wait_quiet(
    env: &Env<'_>,
    tap: &mut EventTap,
    ids: &[String],
    rule: vq_tests::amqp_proxy::RuleId,
    accepted_before: usize,
    start_unix: f64,
) -> anyhow::Result<bool> {
    let deadline = Instant::now() + TRIAL_DEADLINE;
    let mut reconnected_unix: Option<f64> = None;
    let mut quiet_heartbeats: BTreeMap<String, usize> = BTreeMap::new();
    let mut agents = vec![env.a_id.clone()];
    if env.b.is_some() {
        agents.push(env.b_id.clone());
    }
    let mut scanned = tap.seen.len();
    let mut last_job_at = start_unix;
    while Instant::now() < deadline {
        tap.next_event(Duration::from_secs(1)).await?;
        let fired = env.proxy.fired(rule).is_some();
        if fired && reconnected_unix.is_none() && env.proxy.accepted() >= accepted_before + 2 {
            reconnected_unix = Some(now_unix());
        }
        // New events since the last look: job events move the reference
        // time, heartbeats count towards quiet.
        let mut heartbeats = Vec::new();
        for (k, v) in &tap.seen[scanned..] {
            let at = v["at"].as_f64().unwrap_or(0.0);
            if k.starts_with("job.") && ids.iter().any(|id| v["job_id"] == id.as_str()) {
                last_job_at = last_job_at.max(at);
                quiet_heartbeats.clear();
            } else if k.ends_with(".heartbeat") {
                heartbeats.push((
                    v["agent"].as_str().unwrap_or("").to_string(),
                    at,
                    v["running"].as_array().is_some_and(Vec::is_empty),
                ));
            }
        }
        scanned = tap.seen.len();
        if heartbeats.is_empty() {
            continue;
        }
        let since = match (fired, reconnected_unix) {
            (true, None) => continue,
            (true, Some(r)) => r.max(last_job_at),
            (false, _) => last_job_at,
        };
        let mut queues_empty = queue_state(env.broker, &env.names.pool_queue).await?.0 == 0;
        for q in env.lease_queues() {
            queues_empty &= queue_state(env.broker, &q).await?.0 == 0;
        }
        for (agent, at, idle) in heartbeats {
            if !agents.contains(&agent) {
                continue;
            }
            if idle && at >= since && queues_empty {
                *quiet_heartbeats.entry(agent).or_default() += 1;
            } else {
                quiet_heartbeats.remove(&agent);
            }
        }
        if agents
            .iter()
            .all(|a| quiet_heartbeats.get(a).copied().unwrap_or(0) >= 2)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

#[allow(clippy::too_many_lines)]
async fn trial(t: usize, plan: Plan, env: &mut Env<'_>, tap: &mut EventTap) -> anyhow::Result<Row> {
    env.set_b(plan.with_b, tap).await?;
    let t0 = Instant::now();
    let k = rand::random_range(1..=3usize);
    let nth = rand::random_range(1..=k);
    let close = if rand::random::<bool>() {
        Close::Reset
    } else {
        Close::Fin
    };
    let mut jobs = Vec::new();
    for i in 0..k {
        let name = format!("t{t}j{i}");
        let secs = rand::random_range(1.5..3.0);
        let mut j = job(
            POOL,
            &env.alice.name,
            &name,
            &script(&env.jobdir, &name, secs),
        );
        j.rerunnable = plan.rerunnable;
        j.workdir = Some(env.jobdir.display().to_string());
        jobs.push(j);
    }
    let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
    let (target, action) = plan.case.rule(&env.names);
    let accepted_before = env.proxy.accepted();
    let rule = env
        .proxy
        .add_rule(Rule::new(target).nth(nth).action(action).close(close));
    let start_unix = now_unix();
    for j in &jobs {
        env.broker.publish_job(j).await?;
    }
    let quiet = wait_quiet(env, tap, &ids, rule, accepted_before, start_unix).await?;
    env.proxy.disarm(rule);
    let fired = env.proxy.fired(rule).map(|f| {
        format!(
            "conn {} ch {} {:?}{}",
            f.connection,
            f.channel,
            f.method.id(),
            if f.forwarded { " (forwarded)" } else { "" }
        )
    });

    let mut violations = Vec::new();
    if !quiet {
        violations.push(format!(
            "not quiet after {TRIAL_DEADLINE:?} (a job stuck, or an agent never idle)"
        ));
    }
    let dead = env.broker.take_dead().await?;
    let dead_reason = |d: &vq_tests::harness::DeadLetter| {
        d.headers
            .get(vq_common::messages::REASON_HEADER)
            .or_else(|| d.headers.get("x-first-death-reason"))
            .cloned()
            .unwrap_or_else(|| "?".into())
    };
    let dead_of = |id: &str| -> Vec<String> {
        dead.iter()
            .filter(|d| d.message_id.as_deref() == Some(id))
            .map(dead_reason)
            .collect()
    };
    let mut finals = Vec::new();
    let mut execs = Vec::new();
    let mut dead_letters = Vec::new();
    for j in &jobs {
        let dl = dead_of(&j.id);
        dead_letters.extend(dl.iter().map(|r| {
            let r: String = r.chars().take(60).collect();
            format!("{}: {r}", j.name)
        }));
        let f = tap.distinct_finals(&j.id);
        let (runs, overlap) = executions(&env.jobdir, &j.name);
        finals.push(f.len());
        execs.push(runs.len());
        let what = |f: &serde_json::Value| match f["state"].as_str().unwrap_or("?") {
            "failed" => format!("failed ({})", f["reason"].as_str().unwrap_or("?")),
            other => other.to_string(),
        };
        let kinds: Vec<String> = f
            .iter()
            .map(|f| format!("{}:{}", f["agent"], what(f)))
            .collect();
        match f.len() {
            0 => violations.push(format!(
                "{}: LOST (no final result; {} executions{})",
                j.name,
                runs.len(),
                if dl.is_empty() {
                    String::new()
                } else {
                    format!("; dead-lettered: {dl:?}")
                }
            )),
            1 => {}
            n => violations.push(format!("{}: {n} final results {kinds:?}", j.name)),
        }
        let mut live_overlap = overlap;
        for (i, a) in runs.iter().enumerate() {
            for b in &runs[i + 1..] {
                let a_end = a.2.unwrap_or(f64::INFINITY);
                let b_end = b.2.unwrap_or(f64::INFINITY);
                if a.1 < b_end && b.1 < a_end {
                    live_overlap = true;
                }
            }
        }
        if live_overlap {
            violations.push(format!("{}: two live executions at once", j.name));
        }
        if !plan.rerunnable && runs.len() > 1 {
            violations.push(format!("{}: -r n job ran {} times", j.name, runs.len()));
        }
        let node_lost = f.iter().any(|f| {
            f["reason"]
                .as_str()
                .is_some_and(|r| r.contains("node lost"))
        });
        if !plan.rerunnable && node_lost && !runs.is_empty() {
            violations.push(format!(
                "{}: -r n job reported \"node lost\" and ran {kinds:?}",
                j.name
            ));
        }
    }
    for q in env.lease_queues() {
        let n = queue_state(env.broker, &q).await?.0;
        if n > 0 {
            violations.push(format!("{n} message(s) left in lease queue {q}"));
        }
    }
    let pool_left = queue_state(env.broker, &env.names.pool_queue).await?.0;
    if pool_left > 0 {
        violations.push(format!("{pool_left} job(s) left in the pool queue"));
    }
    // Start the next trial clean whatever this one left.
    let mut queues = env.lease_queues();
    queues.push(env.names.pool_queue.clone());
    for q in queues {
        let _ = env
            .broker
            .ch
            .queue_purge(q.as_str().into(), QueuePurgeOptions::default())
            .await;
    }
    let row = Row {
        t,
        plan,
        jobs: k,
        nth,
        close,
        fired,
        finals,
        execs,
        dead: dead_letters,
        secs: t0.elapsed().as_secs_f64(),
        violations,
    };
    if !row.violations.is_empty() {
        let dl: Vec<String> = dead
            .iter()
            .map(|d| {
                d.headers
                    .get(vq_common::messages::REASON_HEADER)
                    .cloned()
                    .unwrap_or_else(|| format!("{:?}", d.headers))
            })
            .collect();
        let lines = log_lines(env, &ids);
        let tail = &lines[lines.len().saturating_sub(25)..];
        eprintln!(
            "faults_protocol trial {t} {} -r {} B={} FAILED: {:#?}\n  dead letters: {dl:#?}\n  agent log (lines naming the jobs): {tail:#?}",
            plan.case.name(),
            if plan.rerunnable { "y" } else { "n" },
            plan.with_b,
            row.violations
        );
    }
    Ok(row)
}

fn plans(n: usize) -> Vec<Plan> {
    let nc = CASES.len();
    let mut v: Vec<Plan> = (0..n)
        .map(|t| {
            let c = t % nc;
            Plan {
                case: CASES[c],
                rerunnable: (t / nc) % 2 == 0,
                // Every (case, -r) pair meets both with and without B
                // within 4 rounds.
                with_b: (c + t / nc + t / (2 * nc)) % 2 == 1,
            }
        })
        .collect();
    // Fewer starts and stops of B.
    v.sort_by_key(|p| p.with_b);
    v
}

fn print_table(rows: &[Row]) {
    eprintln!("\nfaults_protocol: per trial (finals, execs: per job; fired: the frame cut)");
    eprintln!(
        "{:>3} {:<30} {:>2} {:>2} {:>4} {:>3} {:<5} {:<34} {:<9} {:<9} {:>5}  verdict",
        "t", "case", "-r", "B", "jobs", "nth", "close", "fired", "finals", "execs", "secs"
    );
    for r in rows {
        let dead = if r.dead.is_empty() {
            String::new()
        } else {
            format!(" [dead letters: {}]", r.dead.join("; "))
        };
        eprintln!(
            "{:>3} {:<30} {:>2} {:>2} {:>4} {:>3} {:<5} {:<34} {:<9} {:<9} {:>5.1}  {}{dead}",
            r.t,
            r.plan.case.name(),
            if r.plan.rerunnable { "y" } else { "n" },
            if r.plan.with_b { "y" } else { "n" },
            r.jobs,
            r.nth,
            format!("{:?}", r.close),
            r.fired.as_deref().unwrap_or("no"),
            format!("{:?}", r.finals),
            format!("{:?}", r.execs),
            r.secs,
            if r.violations.is_empty() {
                "ok".to_string()
            } else {
                format!("FAIL: {}", r.violations.join("; "))
            }
        );
    }
    eprintln!("\nfaults_protocol: per case (trials / rule fired / failed)");
    let mut by: BTreeMap<(Case, bool), (usize, usize, usize)> = BTreeMap::new();
    for r in rows {
        let e = by.entry((r.plan.case, r.plan.rerunnable)).or_default();
        e.0 += 1;
        e.1 += usize::from(r.fired.is_some());
        e.2 += usize::from(!r.violations.is_empty());
    }
    for ((case, rr), (n, fired, failed)) in by {
        eprintln!(
            "  {:<30} -r {}: {n} trials, fired {fired}, failed {failed}",
            case.name(),
            if rr { "y" } else { "n" }
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_connection_dropped_at_any_protocol_step_neither_loses_nor_duplicates_a_job(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let proxy = AmqpProxy::start(([127, 0, 0, 1], node.port()).into()).await?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let topo = &broker.topo;
    let a_id = format!("{cluster}-a");
    let names = Names {
        jobs_exchange: topo.jobs_exchange(),
        pool_queue: topo.pool_queue(POOL),
        events_exchange: topo.events_exchange(),
        lease_exchange: topo.lease_exchange(),
        lease_a: topo.lease_queue(&a_id),
        claim_prefix: topo.claim_queue(""),
        started_key: job_event_key(POOL, "started"),
        finished_key: job_event_key(POOL, "finished"),
        failed_key: job_event_key(POOL, "failed"),
    };
    let jobdir = alice.home.join(format!("{cluster}-proto"));
    std::fs::create_dir_all(&jobdir)?;
    nix::unistd::chown(
        &jobdir,
        Some(nix::unistd::Uid::from_raw(alice.uid)),
        Some(nix::unistd::Gid::from_raw(alice.gid)),
    )?;
    std::fs::set_permissions(&jobdir, std::fs::Permissions::from_mode(0o755))?;
    let dir = tempfile::tempdir()?;
    let a_log = dir.path().join("a.log");
    let a_dir = dir.path().join("a");
    let b_dir = dir.path().join("b");
    std::fs::create_dir_all(&a_dir)?;
    std::fs::create_dir_all(&b_dir)?;
    // Agent A through the proxy, agent B (when it runs) directly.
    let agent = &accounts::suite().agent;
    let url = proxy.url(&agent.user, &agent.password);
    let _a = AgentLaunch {
        url: &url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &a_id,
        extra_toml: AGENT_TOML,
        broker_toml: "",
        dir: &a_dir,
        stderr: Some(&a_log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    tap.wait_for(
        Duration::from_secs(30),
        "agent A's first heartbeat",
        |k, v| k.ends_with(".heartbeat") && v["agent"] == a_id.as_str(),
    )
    .await
    .with_context(|| std::fs::read_to_string(&a_log).unwrap_or_default())?;
    let mut env = Env {
        url: node.role_url(Role::Agent),
        broker: &broker,
        proxy: &proxy,
        names,
        alice: &alice,
        jobdir: jobdir.clone(),
        a_id: a_id.clone(),
        b_id: format!("{cluster}-b"),
        a_log: a_log.clone(),
        b_log: dir.path().join("b.log"),
        b_dir,
        b: None,
        b_ever: false,
    };
    let n = vq_tests::harness::fault_trials(4 * CASES.len());
    let t0 = Instant::now();
    let mut rows = Vec::new();
    let mut result = Ok(());
    for (t, plan) in plans(n).into_iter().enumerate() {
        match trial(t, plan, &mut env, &mut tap).await {
            Ok(r) => rows.push(r),
            Err(e) => {
                result = Err(e.context(format!("trial {t} {plan:?}")));
                break;
            }
        }
    }
    print_table(&rows);
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.violations.is_empty()).collect();
    eprintln!(
        "faults_protocol: {} trials in {:.0} s; rule fired in {}; {} broke the invariant; the proxy parsed every connection: {}",
        rows.len(),
        t0.elapsed().as_secs_f64(),
        rows.iter().filter(|r| r.fired.is_some()).count(),
        failed.len(),
        proxy.unparsed_connections() == 0
    );
    drop(env);
    broker.cleanup().await;
    drop(node);
    let _ = std::fs::remove_dir_all(&jobdir);
    result?;
    ensure!(
        proxy.unparsed_connections() == 0,
        "the proxy failed to parse a connection"
    );
    ensure!(
        failed.is_empty(),
        "{} of {} trials broke \"at most one live execution, exactly one final result per job\": {:#?}",
        failed.len(),
        rows.len(),
        failed
            .iter()
            .map(|r| format!("t{} {} -r {} B={}: {}", r.t, r.plan.case.name(), if r.plan.rerunnable { "y" } else { "n" }, r.plan.with_b, r.violations.join("; ")))
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// The proxy against a real broker: a cut before the publisher confirm of
/// a publish leaves the message queued while the client sees its
/// connection drop; the client's other connection is not affected, and a
/// new connection passes through once the rule fired. Root only (a
/// private node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_cut_before_a_publish_confirm_drops_only_that_connection_after_the_broker_queued_it(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let proxy = AmqpProxy::start(([127, 0, 0, 1], node.port()).into()).await?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[]).await?;
    // An exchange and queue of the cluster's: the controller's account,
    // which the clients below use, reaches nothing else.
    let queue = format!("{cluster}.proxy-test");
    let exchange = queue.clone();
    broker
        .ch
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    broker
        .ch
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    broker
        .ch
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            queue.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let controller = &accounts::suite().controller;
    let cfg = BrokerConfig {
        url: proxy.url(&controller.user, &controller.password),
        ..Default::default()
    };
    let victim = connect(&cfg, "victim").await?;
    let bystander = connect(&cfg, "bystander").await?;
    let vch = confirm_channel(&victim).await?;
    let bch = confirm_channel(&bystander).await?;
    let props = lapin::BasicProperties::default();
    let wait = Duration::from_secs(10);
    // A publish elsewhere is confirmed: the rule ignores it.
    publish_confirmed(
        &vch,
        &exchange,
        &format!("{queue}-none"),
        b"x",
        props.clone(),
        false,
        wait,
    )
    .await?;
    let rule = proxy.add_rule(Rule::new(Target::ConfirmOf(Pred::publish(
        &exchange, &queue,
    ))));
    let r = publish_confirmed(&vch, &exchange, &queue, b"one", props.clone(), false, wait).await;
    ensure!(r.is_err(), "the publish was confirmed through the cut");
    let f = proxy
        .wait_fired(rule, wait)
        .await
        .context("the rule did not fire")?;
    ensure!(
        f.direction == Direction::ToClient && f.method.id() == (60, 80),
        "{f:?}"
    );
    ensure!(!f.forwarded, "{f:?}");
    ensure!(
        queue_state(&broker, &queue).await?.0 == 1,
        "the broker did not queue the message"
    );
    // The other connection, and a new one, pass through.
    publish_confirmed(&bch, &exchange, &queue, b"two", props.clone(), false, wait).await?;
    let fresh = connect(&cfg, "fresh").await?;
    let fch = confirm_channel(&fresh).await?;
    publish_confirmed(&fch, &exchange, &queue, b"three", props, false, wait).await?;
    ensure!(queue_state(&broker, &queue).await?.0 == 3);
    ensure!(proxy.matches(rule) == 1 && proxy.unparsed_connections() == 0);
    let _ = broker
        .ch
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = broker
        .ch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    broker.cleanup().await;
    Ok(())
}
