//! Root-only end-to-end tests of the jobagent against a real RabbitMQ and
//! real Unix users: jobs run as their owners with a clean PBS environment,
//! bad jobs are refused and dead-lettered, walltime and cancel stop jobs,
//! and the ask-delete handshake answers yes only when idle.
//!
//! Run as root: `cargo test -p vq-tests --test jobagent_runs_job -- --include-ignored`.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use vq_common::messages::{Control, Join, Message};
use vq_tests::accounts;
use vq_tests::harness::{ensure_test_user, job, one_agent, require_root, OneAgent};

const POOL: &str = "batch";
const EVENT_WAIT: Duration = Duration::from_secs(30);

async fn setup(top_level: &str, env: &[(&str, &str)]) -> anyhow::Result<OneAgent> {
    one_agent(POOL, top_level, env).await
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_runs_as_its_owner_with_a_clean_pbs_environment() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[("AGENT_SECRET_MARKER", "leak")]).await?;
    let script = "id -u\n\
                  echo \"JOBID=$PBS_JOBID\"\n\
                  echo \"WORKDIR=$PBS_O_WORKDIR\"\n\
                  echo \"ENVIRONMENT=$PBS_ENVIRONMENT\"\n\
                  echo \"QUEUE=$PBS_QUEUE\"\n\
                  echo \"MARKER=${AGENT_SECRET_MARKER:-absent}\"\n\
                  echo \"FROMJOB=$FROM_JOB\"\n\
                  echo \"PWD=$(pwd)\"\n\
                  cat > /dev/null\n\
                  echo still-here\n\
                  echo to-stderr >&2\n\
                  exit 3\n";
    let mut j = job(POOL, &s.alice.name, "envcheck", script);
    j.env.insert("FROM_JOB".into(), "yes".into());
    s.broker.publish_job(&j).await?;

    let started = s.tap.job_event(&j.id, "started", EVENT_WAIT).await?;
    assert_eq!(started["owner"], s.alice.name.as_str());
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    assert_eq!(fin["outcome"]["code"], 3, "{fin}");
    assert!(fin["usage"]["wall_secs"].as_f64().unwrap() >= 0.0);

    let out_path = s.alice.home.join(format!("envcheck.o{}", j.seq()));
    let err_path = s.alice.home.join(format!("envcheck.e{}", j.seq()));
    let out = read(&out_path);
    let meta = std::fs::metadata(&out_path)?;
    assert_eq!(
        meta.uid(),
        s.alice.uid,
        "stdout file must be created by the owner"
    );
    assert_eq!(meta.mode() & 0o777, 0o600 & !0o022);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], s.alice.uid.to_string(), "id -u output:\n{out}");
    for want in [
        format!("JOBID={}", j.id),
        format!("WORKDIR={}", s.alice.home.display()),
        "ENVIRONMENT=PBS_BATCH".to_string(),
        format!("QUEUE={POOL}"),
        "MARKER=absent".to_string(),
        "FROMJOB=yes".to_string(),
        format!("PWD={}", s.alice.home.display()),
        "still-here".to_string(),
    ] {
        assert!(
            lines.contains(&want.as_str()),
            "{want:?} missing in:\n{out}"
        );
    }
    assert_eq!(read(&err_path), "to-stderr\n");
    assert_eq!(std::fs::metadata(&err_path)?.uid(), s.alice.uid);
    let _ = std::fs::remove_file(out_path);
    let _ = std::fs::remove_file(err_path);
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn join_oe_writes_both_streams_into_the_stdout_file() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let mut j = job(
        POOL,
        &s.alice.name,
        "joined",
        "echo out1\necho err1 >&2\necho out2\n",
    );
    j.join = Join::Oe;
    s.broker.publish_job(&j).await?;
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let out_path = s.alice.home.join(format!("joined.o{}", j.seq()));
    let err_path = s.alice.home.join(format!("joined.e{}", j.seq()));
    assert_eq!(read(&out_path), "out1\nerr1\nout2\n");
    assert!(!err_path.exists(), "-j oe must not create the stderr file");
    let _ = std::fs::remove_file(out_path);
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn bad_jobs_are_refused_dead_lettered_and_the_agent_keeps_running() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let low = ensure_test_user("vqt-low", 500)?;
    let mut s = setup("", &[]).await?;
    let as_root = job(POOL, "root", "asroot", "id -u");
    let unknown = job(POOL, "vqt-nosuchuser", "ghost", "true");
    let low_uid = job(POOL, &low.name, "lowuid", "true");
    let no_submitter = job(POOL, &s.alice.name, "anon", "true");
    let untrusted = job(POOL, &s.alice.name, "untrusted", "true");
    s.broker.publish_job(&as_root).await?;
    s.broker.publish_job(&unknown).await?;
    s.broker.publish_job(&low_uid).await?;
    s.broker
        .publish_raw_job(POOL, &no_submitter.encode(), None, &no_submitter.id)
        .await?;
    // A broker user that is neither alice nor trusted.
    s.broker
        .publish_job_as(&accounts::suite().untrusted, &untrusted)
        .await?;
    let submitter = s.broker.submitter_user()?.to_string();
    s.broker
        .publish_raw_job(POOL, b"{this is not json", Some(&submitter), "malformed-1")
        .await?;

    for (id, needle) in [
        (as_root.id.as_str(), "uid 0"),
        (unknown.id.as_str(), "does not exist"),
        (low_uid.id.as_str(), "below min_uid"),
        (no_submitter.id.as_str(), "user_id"),
        (untrusted.id.as_str(), "may not submit jobs for owner"),
        ("malformed-1", "cannot be decoded"),
    ] {
        let ev = s.tap.job_event(id, "failed", EVENT_WAIT).await?;
        let reason = ev["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(needle),
            "{id}: reason {reason:?} lacks {needle:?}"
        );
    }

    // The agent still runs a good job afterwards.
    let good = job(POOL, &s.alice.name, "good", "exit 0");
    s.broker.publish_job(&good).await?;
    let fin = s.tap.job_event(&good.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");

    let dead = s.broker.take_dead().await?;
    assert_eq!(dead.len(), 6, "dead letters: {dead:#?}");
    for d in &dead {
        assert!(!d.headers["x-vq-reason"].is_empty());
        assert_eq!(d.headers["x-vq-dead-by"], s.agent.agent_id);
    }
    let root_dead = dead
        .iter()
        .find(|d| d.message_id.as_deref() == Some(as_root.id.as_str()))
        .expect("root job dead-lettered");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&root_dead.body)?["owner"],
        "root",
        "the original body is dead-lettered"
    );
    assert_eq!(root_dead.headers["x-vq-submitter"], submitter);
    assert!(
        s.agent.guard.try_wait().is_none(),
        "agent must keep running"
    );
    let _ = std::fs::remove_file(s.alice.home.join(format!("good.o{}", good.seq())));
    let _ = std::fs::remove_file(s.alice.home.join(format!("good.e{}", good.seq())));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

/// The cap the output test sets, bytes.
const CAP: u64 = 1 << 20;

/// How far past `max_output_bytes` an output file may grow (README: "the
/// output cap"): none, the agent copies exactly up to the cap.
const OUTPUT_SLACK_BYTES: u64 = 0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_output_flood_is_cut_at_the_cap_and_the_job_is_stopped() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup(
        &format!("kill_grace_secs = 1\nmax_output_bytes = {CAP}"),
        &[],
    )
    .await?;
    // stdout alone, then both streams into one file with -j oe.
    let flood = job(POOL, &s.alice.name, "flood", "yes\n");
    let mut joined = job(POOL, &s.alice.name, "floodoe", "yes &\nyes >&2\n");
    joined.join = Join::Oe;
    for j in [&flood, &joined] {
        s.broker.publish_job(j).await?;
        let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
        assert_eq!(fin["outcome"]["kind"], "output_limit", "{fin}");
        let out = s.alice.home.join(format!("{}.o{}", j.name, j.seq()));
        let size = std::fs::metadata(&out)?.len();
        eprintln!("output cap {CAP}: {} is {size} bytes", j.name);
        assert!(
            size <= CAP + OUTPUT_SLACK_BYTES,
            "{} grew to {size} bytes, cap {CAP} + slack {OUTPUT_SLACK_BYTES}",
            j.name
        );
        // The file holds the first bytes the job wrote.
        let head = std::fs::read(&out)?;
        assert!(
            head.starts_with(b"y\ny\n"),
            "{:?}",
            &head[..head.len().min(16)]
        );
        let _ = std::fs::remove_file(out);
        let _ = std::fs::remove_file(s.alice.home.join(format!("{}.e{}", j.name, j.seq())));
    }
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn walltime_kills_a_job_that_runs_too_long() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("kill_grace_secs = 1", &[]).await?;
    let mut j = job(
        POOL,
        &s.alice.name,
        "sleeper",
        "echo started >&2; sleep 100\n",
    );
    j.walltime = Some(2);
    s.broker.publish_job(&j).await?;
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "walltime", "{fin}");
    let wall = fin["usage"]["wall_secs"].as_f64().unwrap();
    assert!((1.9..10.0).contains(&wall), "wall_secs {wall}");
    // As pbs_mom does, the kill is noted at the end of the job's stderr,
    // after what the job wrote.
    let err_path = s.alice.home.join(format!("sleeper.e{}", j.seq()));
    let err = read(&err_path);
    assert!(
        err.starts_with("started\n")
            && err.contains("\n=>> vq: job killed: walltime ")
            && err.ends_with(" exceeded limit 2\n"),
        "{err:?}"
    );
    let _ = std::fs::remove_file(&err_path);
    let _ = std::fs::remove_file(s.alice.home.join(format!("sleeper.o{}", j.seq())));
    // The whole process group is gone: no `sleep 100` of the owner is left.
    let left = std::process::Command::new("pgrep")
        .args(["-u", &s.alice.uid.to_string(), "-f", "sleep 100"])
        .output()?;
    assert!(
        left.stdout.is_empty(),
        "left over: {}",
        String::from_utf8_lossy(&left.stdout)
    );
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_idle_agent_agrees_to_be_deleted_and_stops_pulling() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let agent = s.agent.agent_id.clone();
    s.broker
        .publish_control(
            &agent,
            &Control::AskDelete {
                request_id: "r1".into(),
            },
        )
        .await?;
    let answer = s
        .tap
        .wait_for(EVENT_WAIT, "delete answer", |k, v| {
            k.ends_with(".answer") && v["request_id"] == "r1"
        })
        .await?;
    assert_eq!(answer["may_delete"], true, "{answer}");
    assert_eq!(answer["agent"], agent.as_str());
    let hb = s
        .tap
        .wait_for(EVENT_WAIT, "deletable heartbeat", |k, v| {
            k.ends_with(".heartbeat") && v["is_del"] == true
        })
        .await?;
    assert_eq!(hb["is_pull"], false, "{hb}");
    assert_eq!(hb["state"], "drained", "{hb}");

    // It no longer takes jobs.
    let j = job(POOL, &s.alice.name, "notaken", "true");
    s.broker.publish_job(&j).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let queued = s.broker.queue_len(&s.broker.topo.pool_queue(POOL)).await?;
    assert_eq!(queued, 1, "the job must stay queued");
    assert!(!s.tap.seen.iter().any(|(_, v)| v["job_id"] == j.id.as_str()));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_busy_agent_refuses_deletion_and_cancel_stops_its_job() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("kill_grace_secs = 1", &[]).await?;
    let agent = s.agent.agent_id.clone();
    let j = job(POOL, &s.alice.name, "busy", "sleep 60\n");
    s.broker.publish_job(&j).await?;
    s.tap.job_event(&j.id, "started", EVENT_WAIT).await?;
    s.broker
        .publish_control(
            &agent,
            &Control::AskDelete {
                request_id: "r2".into(),
            },
        )
        .await?;
    let answer = s
        .tap
        .wait_for(EVENT_WAIT, "delete answer", |k, v| {
            k.ends_with(".answer") && v["request_id"] == "r2"
        })
        .await?;
    assert_eq!(answer["may_delete"], false, "{answer}");
    assert_eq!(answer["running"], serde_json::json!([j.id]), "{answer}");

    s.broker
        .publish_control(
            &agent,
            &Control::Cancel {
                job_id: j.id.clone(),
            },
        )
        .await?;
    let ev = s.tap.job_event(&j.id, "cancelled", EVENT_WAIT).await?;
    assert_eq!(ev["outcome"]["kind"], "cancelled", "{ev}");
    let _ = std::fs::remove_file(s.alice.home.join(format!("busy.o{}", j.seq())));
    let _ = std::fs::remove_file(s.alice.home.join(format!("busy.e{}", j.seq())));

    // Still pulling after saying no: a new job runs.
    let next = job(POOL, &s.alice.name, "after", "exit 0");
    s.broker.publish_job(&next).await?;
    s.tap.job_event(&next.id, "finished", EVENT_WAIT).await?;
    let _ = std::fs::remove_file(s.alice.home.join(format!("after.o{}", next.seq())));
    let _ = std::fs::remove_file(s.alice.home.join(format!("after.e{}", next.seq())));

    // SIGTERM drains an idle agent: it exits 0.
    s.agent.guard.signal(nix::sys::signal::Signal::SIGTERM);
    let status = s.agent.guard.wait_timeout(Duration::from_secs(20));
    assert!(
        status.is_some_and(|st| st.success()),
        "agent exit: {status:?}"
    );
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_running_job_survives_a_lost_broker_connection_and_runs_once() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let agent = s.agent.agent_id.clone();
    let j = job(
        POOL,
        &s.alice.name,
        "survivor",
        "sleep 4\necho finished-ok\n",
    );
    s.broker.publish_job(&j).await?;
    s.tap.job_event(&j.id, "started", EVENT_WAIT).await?;
    let closed = tokio::task::spawn_blocking(move || {
        vq_tests::harness::close_broker_connections(&format!("jobagent {agent}"))
    })
    .await??;
    assert_eq!(
        closed, 2,
        "both of the agent's connections (consuming and publishing) must have been found"
    );
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let out_path = s.alice.home.join(format!("survivor.o{}", j.seq()));
    assert_eq!(read(&out_path), "finished-ok\n");
    // The broker requeued the delivery when the connection dropped; the
    // agent must not run the job a second time, and must ack the redelivery.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let starts = s
        .tap
        .seen
        .iter()
        .filter(|(k, v)| k.ends_with(".started") && v["job_id"] == j.id.as_str())
        .count();
    assert_eq!(starts, 1, "job started {starts} times");
    let queued = s.broker.queue_len(&s.broker.topo.pool_queue(POOL)).await?;
    assert_eq!(
        queued, 0,
        "the redelivered job must be acked, not left queued"
    );
    let _ = std::fs::remove_file(out_path);
    let _ = std::fs::remove_file(s.alice.home.join(format!("survivor.e{}", j.seq())));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

/// A job id submitted again once its job has ended is a new job: it runs,
/// and its events name its own submission, so a consumer that
/// deduplicates on `message_id` sees both results (README, "Claims and
/// unknown outcomes").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_id_submitted_again_after_its_job_ended_gets_its_own_events() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let first = job(POOL, &s.alice.name, "again", "echo first\n");
    s.broker.publish_job(&first).await?;
    let fin1 = s.tap.job_event(&first.id, "finished", EVENT_WAIT).await?;
    // Released: its claim marker is gone (else the second message is a
    // copy of a live job, which is refused).
    let marker = s.broker.topo.claim_queue(&first.id);
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    while s.broker.queue_len(&marker).await.is_ok() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "claim marker {marker} still there"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut second = job(POOL, &s.alice.name, "again", "echo second\n");
    second.id = first.id.clone();
    s.broker.publish_job(&second).await?;
    let fin2 = s
        .tap
        .wait_for(EVENT_WAIT, "the second job's result", |k, v| {
            k.ends_with(".finished") && v["job_id"] == first.id.as_str() && v["at"] != fin1["at"]
        })
        .await?;
    assert_eq!(fin2["outcome"]["kind"], "exited", "{fin2}");
    assert_ne!(fin1["submission"], fin2["submission"], "{fin1} {fin2}");
    assert_eq!(
        s.tap.distinct_finals(&first.id).len(),
        2,
        "deduplicating on message_id must keep both results"
    );
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}
