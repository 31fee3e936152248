//! Root-only end-to-end tests of resource requests on a real RabbitMQ
//! (issue 11, "Resources"): a job takes its `slots` (PBS `ppn`/`ncpus`) of
//! an agent and the agent never overcommits; a job gets `PBS_NP`,
//! `PBS_NUM_PPN`, `PBS_NUM_NODES` and a `PBS_NODEFILE` of N lines; a job
//! larger than the agent is dead-lettered with a `failed` event.
//!
//! Run as root: `cargo test -p vq-tests --test jobagent_slots -- --include-ignored`.

use std::time::Duration;

use vq_common::messages::Control;
use vq_tests::harness::{
    ensure_test_user, job, one_agent, require_root, start_agent, unique_cluster, wait_agent_up,
    OneAgent, TestBroker,
};

const POOL: &str = "batch";
const EVENT_WAIT: Duration = Duration::from_secs(60);

/// An agent with 2 slots (its `PBS_NODEFILE`s in the default
/// `nodefile_dir`).
async fn two_slot_agent() -> anyhow::Result<OneAgent> {
    one_agent(POOL, "slots = 2\n", &[]).await
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The value of `KEY=value` lines in a job's output.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("{key} missing in:\n{out}"))
}

/// Job script printing its start and end times (ns), its PBS slot
/// variables and its node file, busy for `secs` in between.
fn timed_script(secs: &str) -> String {
    format!(
        "echo START=$(date +%s%N)\n\
         echo NP=$PBS_NP\n\
         echo PPN=$PBS_NUM_PPN\n\
         echo NODES=$PBS_NUM_NODES\n\
         echo NODEFILE=$PBS_NODEFILE\n\
         echo LINES=$(wc -l < \"$PBS_NODEFILE\")\n\
         echo HOSTS=$(sort -u \"$PBS_NODEFILE\")\n\
         sleep {secs}\n\
         echo END=$(date +%s%N)\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn two_ppn2_jobs_on_a_two_slot_agent_run_one_after_the_other() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = two_slot_agent().await?;
    let mut a = job(POOL, &s.alice.name, "wideA", &timed_script("1"));
    a.slots = 2;
    let mut b = job(POOL, &s.alice.name, "wideB", &timed_script("1"));
    b.slots = 2;
    s.broker.publish_job(&a).await?;
    s.broker.publish_job(&b).await?;
    let fa = s.tap.job_event(&a.id, "finished", EVENT_WAIT).await?;
    let fb = s.tap.job_event(&b.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fa["outcome"]["code"], 0, "{fa}");
    assert_eq!(fb["outcome"]["code"], 0, "{fb}");
    let host = nix::unistd::gethostname()?.into_string().unwrap();
    let mut spans = Vec::new();
    for j in [&a, &b] {
        let out_path = s.alice.home.join(format!("{}.o{}", j.name, j.seq()));
        let out = read(&out_path);
        assert_eq!(field(&out, "NP"), "2", "{out}");
        assert_eq!(field(&out, "PPN"), "2", "{out}");
        assert_eq!(field(&out, "NODES"), "1", "{out}");
        assert_eq!(field(&out, "LINES"), "2", "{out}");
        assert_eq!(field(&out, "HOSTS"), host, "{out}");
        let nodefile = std::path::PathBuf::from(field(&out, "NODEFILE"));
        assert!(!nodefile.exists(), "the node file is removed after the job");
        let start: u128 = field(&out, "START").parse()?;
        let end: u128 = field(&out, "END").parse()?;
        spans.push((start, end));
        let _ = std::fs::remove_file(out_path);
        let _ = std::fs::remove_file(s.alice.home.join(format!("{}.e{}", j.name, j.seq())));
    }
    spans.sort();
    assert!(
        spans[0].1 <= spans[1].0,
        "2 + 2 slots ran at once on a 2-slot agent: {spans:?}"
    );
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn two_ppn1_jobs_on_a_two_slot_agent_run_at_once() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = two_slot_agent().await?;
    let home = s.alice.home.display().to_string();
    let tag = uuid::Uuid::new_v4().simple().to_string();
    // Each job announces itself and waits (bounded) for the other: both
    // see each other only if they run at the same time.
    let meet = |me: &str, other: &str| {
        format!(
            "touch {home}/meet-{tag}-{me}\n\
             for i in $(seq 300); do [ -e {home}/meet-{tag}-{other} ] && break; sleep 0.1; done\n\
             [ -e {home}/meet-{tag}-{other} ] && echo MET=yes || echo MET=no\n\
             echo NP=$PBS_NP\n"
        )
    };
    let x = job(POOL, &s.alice.name, "narrowX", &meet("x", "y"));
    let y = job(POOL, &s.alice.name, "narrowY", &meet("y", "x"));
    s.broker.publish_job(&x).await?;
    s.broker.publish_job(&y).await?;
    for j in [&x, &y] {
        let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
        assert_eq!(fin["outcome"]["code"], 0, "{fin}");
        let out_path = s.alice.home.join(format!("{}.o{}", j.name, j.seq()));
        let out = read(&out_path);
        assert_eq!(field(&out, "MET"), "yes", "{}: {out}", j.name);
        assert_eq!(field(&out, "NP"), "1", "{out}");
        let _ = std::fs::remove_file(out_path);
        let _ = std::fs::remove_file(s.alice.home.join(format!("{}.e{}", j.name, j.seq())));
    }
    for me in ["x", "y"] {
        let _ = std::fs::remove_file(s.alice.home.join(format!("meet-{tag}-{me}")));
    }
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_ppn4_job_on_a_two_slot_agent_is_dead_lettered_with_a_failed_event() -> anyhow::Result<()>
{
    if !require_root() {
        return Ok(());
    }
    let mut s = two_slot_agent().await?;
    let mut big = job(POOL, &s.alice.name, "toobig", "echo never\n");
    big.slots = 4;
    s.broker.publish_job(&big).await?;
    let ev = s.tap.job_event(&big.id, "failed", EVENT_WAIT).await?;
    let reason = ev["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("4 slots") && reason.contains("2 slots"),
        "reason {reason:?}"
    );
    // The agent goes on: a job that fits runs.
    let mut ok = job(POOL, &s.alice.name, "fits", "echo NP=$PBS_NP\n");
    ok.slots = 2;
    s.broker.publish_job(&ok).await?;
    let fin = s.tap.job_event(&ok.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let dead = s.broker.take_dead().await?;
    assert_eq!(dead.len(), 1, "dead letters: {dead:#?}");
    assert_eq!(dead[0].message_id.as_deref(), Some(big.id.as_str()));
    assert!(
        dead[0].headers["x-vq-reason"].contains("4 slots"),
        "{:?}",
        dead[0].headers
    );
    assert!(!s.alice.home.join(format!("toobig.o{}", big.seq())).exists());
    let out_path = s.alice.home.join(format!("fits.o{}", ok.seq()));
    assert_eq!(field(&read(&out_path), "NP"), "2");
    let _ = std::fs::remove_file(out_path);
    let _ = std::fs::remove_file(s.alice.home.join(format!("fits.e{}", ok.seq())));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_ppn2_job_never_shares_a_two_slot_agent_with_ppn1_jobs() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = two_slot_agent().await?;
    let mut wide = job(POOL, &s.alice.name, "mixW", &timed_script("1"));
    wide.slots = 2;
    let n1 = job(POOL, &s.alice.name, "mixN1", &timed_script("1"));
    let n2 = job(POOL, &s.alice.name, "mixN2", &timed_script("1"));
    // Published together: delivered in one prefetch window of 2.
    s.broker.publish_job(&n1).await?;
    s.broker.publish_job(&wide).await?;
    s.broker.publish_job(&n2).await?;
    let mut spans = std::collections::BTreeMap::new();
    for j in [&n1, &wide, &n2] {
        let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
        assert_eq!(fin["outcome"]["code"], 0, "{fin}");
        let out_path = s.alice.home.join(format!("{}.o{}", j.name, j.seq()));
        let out = read(&out_path);
        assert_eq!(field(&out, "NP"), j.slots.to_string(), "{out}");
        let start: u128 = field(&out, "START").parse()?;
        let end: u128 = field(&out, "END").parse()?;
        spans.insert(j.name.clone(), (start, end));
        let _ = std::fs::remove_file(out_path);
        let _ = std::fs::remove_file(s.alice.home.join(format!("{}.e{}", j.name, j.seq())));
    }
    let w = spans["mixW"];
    for n in ["mixN1", "mixN2"] {
        let o = spans[n];
        assert!(
            o.1 <= w.0 || w.1 <= o.0,
            "{n} ran beside the 2-slot job on a 2-slot agent: {spans:?}"
        );
    }
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_cancelled_while_it_waits_for_slots_never_runs() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    // Both jobs are queued before the agent starts: its first consumer
    // (prefetch 2) gets both at once; the first fills the agent, the
    // second is claimed from the buffer and waits for slots.
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let mut first = job(POOL, &alice.name, "holder", "sleep 120\n");
    first.slots = 2;
    let mut waiting = job(POOL, &alice.name, "waiter", "echo ran\n");
    waiting.slots = 2;
    broker.publish_job(&first).await?;
    broker.publish_job(&waiting).await?;
    let agent = format!("{cluster}-a1");
    let guard = start_agent(
        &cluster,
        POOL,
        &agent,
        "slots = 2\nkill_grace_secs = 1\n",
        &[],
    )?;
    let mut s = OneAgent {
        broker,
        tap: {
            wait_agent_up(&mut tap, &agent).await?;
            tap
        },
        agent: guard,
        alice,
    };
    s.tap.job_event(&first.id, "started", EVENT_WAIT).await?;
    // The agent holds the second job (claimed, waiting): its heartbeat
    // lists both.
    let wid = waiting.id.clone();
    s.tap
        .wait_for(EVENT_WAIT, "heartbeat listing the waiting job", |k, v| {
            k.ends_with(".heartbeat")
                && v["running"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|x| x == wid.as_str()))
        })
        .await?;
    s.broker
        .publish_control(
            &agent,
            &Control::Cancel {
                job_id: waiting.id.clone(),
            },
        )
        .await?;
    let ev = s
        .tap
        .job_event(&waiting.id, "cancelled", EVENT_WAIT)
        .await?;
    assert_eq!(ev["outcome"]["kind"], "cancelled", "{ev}");
    assert_eq!(ev["usage"]["wall_secs"], 0.0, "{ev}");
    assert!(
        !s.alice
            .home
            .join(format!("waiter.o{}", waiting.seq()))
            .exists(),
        "a job cancelled while waiting must not run"
    );
    s.broker
        .publish_control(
            &agent,
            &Control::Cancel {
                job_id: first.id.clone(),
            },
        )
        .await?;
    s.tap.job_event(&first.id, "cancelled", EVENT_WAIT).await?;
    let _ = std::fs::remove_file(s.alice.home.join(format!("holder.o{}", first.seq())));
    let _ = std::fs::remove_file(s.alice.home.join(format!("holder.e{}", first.seq())));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}
