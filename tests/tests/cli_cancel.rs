//! `vq cancel` of queued and running jobs through the controller (issue 11,
//! "`vq cancel` works on queued jobs: the agent must never run a job
//! cancelled before its claim; the table shows `X` at once"):
//!
//! * a queued job cancelled by its submitter shows `X` in the very next
//!   `vq stat`, a `withdrawn` event is published, and the agent started
//!   afterwards drops it without running it (no `started`), runs the job
//!   behind it and leaves the pool queue empty;
//! * another broker user is refused ("not yours");
//! * a running job's cancel goes to its agent (exit 271 in the table);
//! * an ended job says so; a job an agent claimed first (its claim marker
//!   taken) is "starting", and once its start is in the table the cancel
//!   goes to that agent.
//!
//! Root (rabbitmqctl creates the broker accounts; the agent switches
//! users): `cargo test -p vq-tests --test cli_cancel -- --include-ignored`.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, ensure};
use vq_common::amqp;
use vq_common::lease::Marker;
use vq_common::messages::{Job, JobEvent, JobState, Message};
use vq_common::topology::job_event_key;
use vq_tests::accounts::{self, Account};
use vq_tests::harness::{
    build_bin, ensure_test_user, job, require_root, shared_broker, start_agent,
    start_controller_on_empty_cloud_with, unique_cluster, wait_agent_up, TestBroker,
};

const POOL: &str = "cx";

/// `vq ARGS` as `account` on `cluster`.
fn vq_as(account: &Account, cluster: &str, args: &[&str]) -> anyhow::Result<Output> {
    let url = shared_broker()?.url_of(account);
    Ok(Command::new(build_bin("vq-cli", "vq")?)
        .args(args)
        .env("VQ_BROKER_URL", url)
        .env("VQ_CLUSTER", cluster)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env_remove("VQ_CONTROLLER_URL")
        .output()?)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The record of `id` in `vq stat --json ID` as `account`.
fn stat_one(account: &Account, cluster: &str, id: &str) -> anyhow::Result<serde_json::Value> {
    let o = vq_as(account, cluster, &["stat", "--json", id])?;
    ensure!(o.status.success(), "vq stat {id}: {}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    Ok(v["jobs"][0].clone())
}

/// Polls `vq stat --json ID` until the job's letter is `letter` (every
/// 200 ms, up to 60 s).
async fn wait_letter(
    account: &Account,
    cluster: &str,
    id: &str,
    letter: &str,
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let last = match stat_one(account, cluster, id) {
            Ok(r) if r["letter"] == letter => return Ok(r),
            Ok(r) => r.to_string(),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("job {id} never showed {letter}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Submits `j` as the suite's submitter the way `vq submit` does: the job
/// to its pool queue, then its `queued` event.
async fn submit(broker: &TestBroker, account: &Account, j: &Job) -> anyhow::Result<()> {
    broker.publish_job(j).await?;
    let cfg = vq_common::config::BrokerConfig {
        url: shared_broker()?.url_of(account),
        ..Default::default()
    };
    let conn = amqp::connect(&cfg, "cli_cancel submitter").await?;
    let ch = amqp::confirm_channel(&conn).await?;
    let ev = JobEvent::queued(j, &j.encode(), &account.user);
    amqp::publish_confirmed(
        &ch,
        &broker.topo.submitted_exchange(),
        &job_event_key(POOL, "queued"),
        &ev.encode(),
        amqp::event_properties(&ev).with_user_id(account.user.as_str().into()),
        false,
        Duration::from_secs(10),
    )
    .await?;
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_cancelled_queued_job_never_runs_and_shows_x_at_once() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let suite = accounts::suite();
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let url = shared_broker()?.url_of(&suite.controller);
    let _ctl =
        start_controller_on_empty_cloud_with(&url, &cluster, POOL, "info", "127.0.0.1:0", "")
            .await?;
    let sub = &suite.submitter;

    // Two queued jobs, no agent yet: the first is cancelled.
    let doomed = job(
        POOL,
        &alice.name,
        "doomed",
        "echo ran > /tmp/vq-doomed-$PBS_JOBID\n",
    );
    let after = job(POOL, &alice.name, "after", "echo ok\n");
    submit(&broker, sub, &doomed).await?;
    submit(&broker, sub, &after).await?;
    wait_letter(sub, &cluster, &after.id, "Q").await?;
    // A queued job says why it waits: the pool's state after a cycle.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let r = stat_one(sub, &cluster, &after.id)?;
        if r["reason"]
            .as_str()
            .is_some_and(|s| s.starts_with("waiting"))
        {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no pending reason: {r}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Somebody else may see it (or not) but never cancel it.
    // A refusal exits 77, as an agent's (README, "vq cancel"); an unknown
    // id 64.
    let o = vq_as(&suite.untrusted, &cluster, &["cancel", &doomed.id])?;
    ensure!(o.status.code() == Some(77), "{o:?}");
    ensure!(
        text(&o.stderr).starts_with("vq: refused: job ")
            && text(&o.stderr).contains("is not yours"),
        "{}",
        text(&o.stderr)
    );
    let o = vq_as(sub, &cluster, &["cancel", "ffffffff-nosuchjob"])?;
    ensure!(o.status.code() == Some(64), "{o:?}");
    ensure!(
        text(&o.stderr).contains("unknown job id"),
        "{}",
        text(&o.stderr)
    );

    let o = vq_as(sub, &cluster, &["cancel", &doomed.id[..8]])?;
    ensure!(o.status.success(), "{}", text(&o.stderr));
    ensure!(
        text(&o.stdout).contains(&format!(
            "job {} cancelled: it was queued and no agent will run it",
            doomed.id
        )),
        "{}",
        text(&o.stdout)
    );
    ensure!(o.stderr.is_empty(), "{}", text(&o.stderr));
    // At once: the very next stat shows it, with the reason.
    let r = stat_one(sub, &cluster, &doomed.id)?;
    ensure!(r["letter"] == "X", "{r}");
    ensure!(
        r["reason"]
            .as_str()
            .is_some_and(|s| s.contains(&format!("cancelled by {} while queued", sub.user))),
        "{r}"
    );
    ensure!(r["exit_status"].is_null(), "{r}");
    let ev = tap
        .job_event(&doomed.id, "cancelled", Duration::from_secs(20))
        .await?;
    ensure!(ev["state"] == "withdrawn", "{ev}");
    // Cancelling it again: it ended.
    let o = vq_as(sub, &cluster, &["cancel", &doomed.id])?;
    ensure!(
        !o.status.success() && text(&o.stderr).contains("is not running (state X cancelled)"),
        "{:?} {}",
        o.status,
        text(&o.stderr)
    );

    // The agent pulls both in order: drops the first, runs the second.
    let agent_id = format!("{cluster}-a1");
    let _agent = start_agent(
        &cluster,
        POOL,
        &agent_id,
        "slots = 1\nkill_grace_secs = 1\n",
        &[],
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;
    tap.job_event(&after.id, "finished", Duration::from_secs(60))
        .await?;
    ensure!(
        tap.events(&doomed.id, "started").is_empty(),
        "a withdrawn job started"
    );
    ensure!(
        !std::path::Path::new(&format!("/tmp/vq-doomed-{}", doomed.id)).exists(),
        "the withdrawn job's script ran"
    );
    let left = broker.queue_len(&broker.topo.pool_queue(POOL)).await?;
    ensure!(left == 0, "{left} messages left in the pool queue");
    ensure!(
        broker.take_dead().await?.is_empty(),
        "a withdrawn job was dead-lettered"
    );

    // A running job: the cancel goes to its agent, which stops it and
    // answers.
    let long = job(POOL, &alice.name, "long", "sleep 60\n");
    submit(&broker, sub, &long).await?;
    tap.job_event(&long.id, "started", Duration::from_secs(30))
        .await?;
    wait_letter(sub, &cluster, &long.id, "R").await?;
    let o = vq_as(sub, &cluster, &["cancel", &long.id])?;
    ensure!(o.status.success(), "{}", text(&o.stderr));
    ensure!(
        text(&o.stdout).trim()
            == format!(
                "job {}: cancelled on agent {agent_id} (SIGTERM now, SIGKILL after its grace period)",
                long.id
            ),
        "{}",
        text(&o.stdout)
    );
    let r = wait_letter(sub, &cluster, &long.id, "X").await?;
    ensure!(r["exit_status"] == 271, "{r}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_claimed_before_the_cancel_is_starting_then_cancelled_through_its_agent(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let suite = accounts::suite();
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let url = shared_broker()?.url_of(&suite.controller);
    let _ctl =
        start_controller_on_empty_cloud_with(&url, &cluster, POOL, "info", "127.0.0.1:0", "")
            .await?;
    let sub = &suite.submitter;
    let j = job(POOL, "alice", "raced", "true\n");
    submit(&broker, sub, &j).await?;
    wait_letter(sub, &cluster, &j.id, "Q").await?;

    // An agent ("ghost") claimed it: its marker is taken, its `started`
    // not yet published.
    let ch = broker.conn.create_channel().await?;
    let m = amqp::claim_marker(&ch, &broker.topo, &j.id, "ghost", "c1", true).await?;
    ensure!(m == Marker::Ours);
    let o = vq_as(sub, &cluster, &["cancel", "--timeout", "2", &j.id])?;
    ensure!(!o.status.success(), "{}", text(&o.stdout));
    ensure!(
        text(&o.stderr).contains("is starting on an agent"),
        "{}",
        text(&o.stderr)
    );
    ensure!(stat_one(sub, &cluster, &j.id)?["letter"] == "Q");

    // Its start reaches the table: the cancel goes to "ghost", which has
    // no control queue (not connected), and says so.
    let started = JobEvent::about(Some(&j), &j.id, POOL, "ghost", None, JobState::Started)
        .of_submission(&j.encode());
    amqp::publish_confirmed(
        &broker.ch,
        &broker.topo.events_exchange(),
        &job_event_key(POOL, "started"),
        &started.encode(),
        amqp::event_properties(&started),
        false,
        Duration::from_secs(10),
    )
    .await?;
    wait_letter(sub, &cluster, &j.id, "R").await?;
    let o = vq_as(sub, &cluster, &["cancel", &j.id])?;
    ensure!(
        o.status.code() == Some(64) && text(&o.stderr).contains("no agent named \"ghost\""),
        "{:?} {}",
        o.status,
        text(&o.stderr)
    );
    Ok(())
}
