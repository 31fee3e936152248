//! Job dependencies end to end (issue 11, "Dependencies": `-W
//! depend=afterok|afternotok|afterany:ID`, held jobs wait in the table,
//! are released by the controller when satisfied and cancelled with a
//! reason when they can never be): `vq submit` as a Unix user, the
//! controller on an empty test cloud, one agent on this host.
//!
//! * A waits for a file the test creates; B `-W depend=afterok:<A's
//!   prefix>` is `H` with the reason `held: afterok A not finished` and
//!   its dependency resolved to A's full id; E, held on A too, is cancelled
//!   with `vq cancel` and shows `X` at once;
//! * the controller is killed and started again while B is held: B is
//!   still `H`; A is let go (exit 0): B runs and finishes, E never starts;
//! * C `-W depend=afterok:D` with D exiting 1: C is `X` with the reason
//!   and is in the dead-letter queue with it;
//! * an unknown dependency id is refused by `vq submit`; a job with
//!   dependencies published straight to the pool queue is refused by the
//!   agent;
//! * a held job published without `vq submit`'s check, naming an id
//!   nobody submitted, is cancelled after `depend_grace_secs`; afternotok
//!   of a failed job releases its job into the pool with the submitter in
//!   the requeue envelope, afterok of it cancels.
//!
//! Root (rabbitmqctl creates the broker accounts; the agent switches
//! users): `cargo test -p vq-tests --test cli_depend -- --include-ignored`.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use vq_common::amqp;
use vq_common::messages::{
    DependKind, Dependency, Job, JobEvent, JobState, Message, SUBMITTER_HEADER,
};
use vq_common::topology::job_event_key;
use vq_tests::accounts::{self, Account};
use vq_tests::harness::{
    build_bin, ensure_test_user, job, require_root, shared_broker, start_agent,
    start_controller_on_empty_cloud_with, unique_cluster, wait_agent_up, TestBroker, TestUser,
};

const POOL: &str = "dp";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `vq ARGS` as broker `account` on `cluster` (run as root).
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

/// `vq submit ARGS SCRIPT` run as Unix user `user` in `dir`, as broker
/// `account`.
fn submit(
    user: &TestUser,
    account: &Account,
    cluster: &str,
    dir: &Path,
    args: &[&str],
    script: &str,
) -> anyhow::Result<Output> {
    let url = shared_broker()?.url_of(account);
    Ok(Command::new("runuser")
        .args(["-u", &user.name, "--"])
        .arg(build_bin("vq-cli", "vq")?)
        .args(["--cluster", cluster, "submit"])
        .args(args)
        .arg(script)
        .current_dir(dir)
        .env("VQ_BROKER_URL", url)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env_remove("VQ_CONTROLLER_URL")
        .output()?)
}

/// The id `vq submit` printed, after checking it succeeded.
fn submitted(o: &Output, what: &str) -> anyhow::Result<String> {
    ensure!(o.status.success(), "vq submit {what}: {}", text(&o.stderr));
    let id = text(&o.stdout).trim().to_string();
    ensure!(!id.is_empty(), "vq submit {what} printed no id");
    Ok(id)
}

/// The record of `id` in `vq stat --json ID`.
fn stat_one(account: &Account, cluster: &str, id: &str) -> anyhow::Result<serde_json::Value> {
    let o = vq_as(account, cluster, &["stat", "--json", id])?;
    ensure!(o.status.success(), "vq stat {id}: {}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    Ok(v["jobs"][0].clone())
}

/// Polls `vq stat --json ID` until the job's letter is one of `letters`
/// (every 200 ms, up to 90 s; a restarted controller answers "unknown" or
/// not at all for a moment).
async fn wait_letter(
    account: &Account,
    cluster: &str,
    id: &str,
    letters: &[&str],
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let last = match stat_one(account, cluster, id) {
            Ok(r) if letters.iter().any(|l| r["letter"] == *l) => return Ok(r),
            Ok(r) => r.to_string(),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("job {id} never showed {letters:?}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `vq stat ID` until the controller's answer says its table has
/// caught up with the event stream (no "still reading" warning).
async fn wait_table_complete(account: &Account, cluster: &str, id: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let o = vq_as(account, cluster, &["stat", id])?;
        if o.status.success() && !text(&o.stderr).contains("still reading") {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the job table never caught up: {}",
            text(&o.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn held_jobs_wait_are_released_cancelled_and_survive_a_controller_restart(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Build before any connection is open (a long build would let the
    // broker close an idle test connection).
    build_bin("vq-cli", "vq")?;
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let suite = accounts::suite();
    let sub = &suite.submitter;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let ctl_url = shared_broker()?.url_of(&suite.controller);
    let start_ctl = || {
        start_controller_on_empty_cloud_with(
            &ctl_url,
            &cluster,
            POOL,
            "info",
            "127.0.0.1:0",
            "[jobs]\ndepend_grace_secs = 120\n",
        )
    };
    let ctl = start_ctl().await?;
    let agent_id = format!("{cluster}-a1");
    let _agent = start_agent(
        &cluster,
        POOL,
        &agent_id,
        "slots = 2\nkill_grace_secs = 1\n",
        &[],
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;

    let dir = alice.home.join(format!("dep-{cluster}"));
    std::fs::create_dir_all(&dir)?;
    nix::unistd::chown(&dir, Some(alice.uid.into()), Some(alice.gid.into()))?;
    let go = format!("/tmp/vq-dep-{cluster}-go");
    let ran_e = format!("/tmp/vq-dep-{cluster}-e-ran");
    let script = |name: &str, body: &str| -> anyhow::Result<String> {
        let file = format!("{name}.pbs");
        std::fs::write(
            dir.join(&file),
            format!("#!/bin/sh\n#PBS -N {name}\n#PBS -q {POOL}\n#PBS -j oe\n{body}"),
        )?;
        Ok(file)
    };
    let a_pbs = script(
        "a",
        &format!("while [ ! -e {go} ]; do sleep 0.2; done\nexit 0\n"),
    )?;
    let b_pbs = script("b", "echo b ran\n")?;
    let e_pbs = script("e", &format!("touch {ran_e}\n"))?;
    let d_pbs = script("d", "exit 1\n")?;
    let c_pbs = script("c", "echo c ran\n")?;

    // A runs and waits; B and E wait for it, held.
    let a = submitted(&submit(&alice, sub, &cluster, &dir, &[], &a_pbs)?, "a")?;
    tap.job_event(&a, "started", Duration::from_secs(60))
        .await?;
    // (`vq submit` resolves a prefix against a complete table; one that
    // is still being rebuilt keeps it as written.)
    wait_table_complete(sub, &cluster, &a).await?;
    let prefix = &a[..8];
    let o = submit(
        &alice,
        sub,
        &cluster,
        &dir,
        &["-W", &format!("depend=afterok:{prefix}")],
        &b_pbs,
    )?;
    eprintln!(
        "$ vq submit -W depend=afterok:{prefix} b.pbs\n{}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let b = submitted(&o, "b")?;
    let ev = tap.job_event(&b, "held", Duration::from_secs(20)).await?;
    ensure!(
        ev["request"]["depend"][0]["jobs"][0] == a.as_str(),
        "the prefix was not resolved to A's id: {ev}"
    );
    let r = wait_letter(sub, &cluster, &b, &["H"]).await?;
    ensure!(
        r["reason"] == format!("held: afterok {a} not finished"),
        "{r}"
    );
    // The outputs README.md shows.
    let o = vq_as(sub, &cluster, &["stat", "-s", &a, &b])?;
    eprintln!("$ vq stat -s A B\n{}{}", text(&o.stdout), text(&o.stderr));
    let o = vq_as(sub, &cluster, &["stat", "-f", &b])?;
    eprintln!("$ vq stat -f B\n{}{}", text(&o.stdout), text(&o.stderr));
    ensure!(
        text(&o.stdout).contains(&format!("    depend = afterok:{a}\n"))
            && text(&o.stdout).contains("    job_state = H\n"),
        "{}",
        text(&o.stdout)
    );
    let e = submitted(
        &submit(
            &alice,
            sub,
            &cluster,
            &dir,
            &["-W", &format!("depend=afterany:{a}")],
            &e_pbs,
        )?,
        "e",
    )?;
    wait_letter(sub, &cluster, &e, &["H"]).await?;
    let o = vq_as(sub, &cluster, &["cancel", &e])?;
    eprintln!("$ vq cancel E\n{}{}", text(&o.stdout), text(&o.stderr));
    ensure!(o.status.success(), "vq cancel {e}: {}", text(&o.stderr));
    ensure!(
        text(&o.stdout).contains("cancelled: it was held and no agent will run it"),
        "{}",
        text(&o.stdout)
    );
    let r = stat_one(sub, &cluster, &e)?;
    ensure!(
        r["letter"] == "X"
            && r["reason"] == format!("cancelled by {} while held", sub.user)
            && r["exit_status"].is_null(),
        "{r}"
    );

    // The controller dies while B is held; its successor still holds it.
    drop(ctl);
    let _ctl = start_ctl().await?;
    let r = wait_letter(sub, &cluster, &b, &["H"]).await?;
    ensure!(
        r["reason"]
            .as_str()
            .is_some_and(|s| s.contains("not finished")),
        "{r}"
    );

    // A ends well: B is released and runs; E never does.
    std::fs::write(&go, b"")?;
    let fin = tap
        .job_event(&a, "finished", Duration::from_secs(60))
        .await?;
    ensure!(fin["outcome"]["code"] == 0, "{fin}");
    let fin = tap
        .job_event(&b, "finished", Duration::from_secs(90))
        .await?;
    ensure!(fin["outcome"]["code"] == 0, "{fin}");
    ensure!(
        !tap.events(&b, "queued").is_empty(),
        "B was released without its queued event"
    );
    ensure!(
        tap.events(&e, "started").is_empty(),
        "the cancelled held job started"
    );
    ensure!(
        !Path::new(&ran_e).exists(),
        "the cancelled held job's script ran"
    );

    // D exits 1: C, afterok D, can never run.
    let d = submitted(&submit(&alice, sub, &cluster, &dir, &[], &d_pbs)?, "d")?;
    let c = submitted(
        &submit(
            &alice,
            sub,
            &cluster,
            &dir,
            &["-W", &format!("depend=afterok:{d}")],
            &c_pbs,
        )?,
        "c",
    )?;
    let why = format!("dependency afterok:{d} can never be satisfied: {d} exited 1");
    let r = wait_letter(sub, &cluster, &c, &["X"]).await?;
    ensure!(r["reason"] == why.as_str(), "{r}");
    let o = vq_as(sub, &cluster, &["stat", "-s", &d, &c])?;
    eprintln!("$ vq stat -s D C\n{}{}", text(&o.stdout), text(&o.stderr));
    let ev = tap
        .job_event(&c, "cancelled", Duration::from_secs(20))
        .await?;
    ensure!(
        ev["state"] == "withdrawn" && ev["reason"] == why.as_str(),
        "{ev}"
    );
    ensure!(tap.events(&c, "started").is_empty(), "C started");
    let dead = broker.take_dead().await?;
    let letter = dead
        .iter()
        .find(|l| l.message_id.as_deref() == Some(c.as_str()))
        .with_context(|| format!("C is not in the dead-letter queue ({} letters)", dead.len()))?;
    ensure!(
        letter.headers.get("x-vq-reason").map(String::as_str) == Some(why.as_str()),
        "{:?}",
        letter.headers
    );
    ensure!(
        letter.headers.get("x-vq-submitter").map(String::as_str) == Some(sub.user.as_str()),
        "{:?}",
        letter.headers
    );

    // A job with dependencies published straight to the pool queue (not
    // released by the controller) is refused by the agent, not run.
    let mut p = job(POOL, &alice.name, "p", &format!("touch {ran_e}\n"));
    p.depend = vec![Dependency {
        kind: DependKind::AfterOk,
        jobs: vec![d.clone()],
    }];
    broker.publish_job(&p).await?;
    let ev = tap
        .job_event(&p.id, "failed", Duration::from_secs(30))
        .await?;
    ensure!(
        ev["reason"]
            .as_str()
            .is_some_and(|r| r.contains("not released by the controller")),
        "{ev}"
    );
    ensure!(!Path::new(&ran_e).exists(), "the unreleased job ran");

    // An unknown dependency is refused at submission, once the table is
    // complete (before, `vq submit` says it cannot tell and submits).
    wait_table_complete(sub, &cluster, &c).await?;
    let o = submit(
        &alice,
        sub,
        &cluster,
        &dir,
        &["-W", "depend=afterok:nosuchjob"],
        &c_pbs,
    )?;
    eprintln!(
        "$ vq submit -W depend=afterok:nosuchjob c.pbs\n{}",
        text(&o.stderr)
    );
    ensure!(
        o.status.code() == Some(64) && text(&o.stderr).contains("unknown job id \"nosuchjob\""),
        "{:?} {}",
        o.status,
        text(&o.stderr)
    );
    let _ = std::fs::remove_file(&go);
    broker.cleanup().await;
    Ok(())
}

/// Publishes `j` (with dependencies) as `account` the way `vq submit`
/// does, without its check of the ids: the job to the held exchange, then
/// its `held` event.
async fn submit_held(broker: &TestBroker, account: &Account, j: &Job) -> anyhow::Result<()> {
    let cfg = vq_common::config::BrokerConfig {
        url: shared_broker()?.url_of(account),
        ..Default::default()
    };
    let conn = amqp::connect(&cfg, "cli_depend submitter").await?;
    let ch = amqp::confirm_channel(&conn).await?;
    let user = account.user.as_str();
    amqp::publish_confirmed(
        &ch,
        &broker.topo.held_exchange(),
        &j.pool,
        &j.encode(),
        amqp::json_properties::<Job>()
            .with_message_id(j.id.as_str().into())
            .with_user_id(user.into()),
        true,
        Duration::from_secs(10),
    )
    .await?;
    let ev = JobEvent::held(j, &j.encode(), user);
    amqp::publish_confirmed(
        &ch,
        &broker.topo.submitted_exchange(),
        &job_event_key(&j.pool, "held"),
        &ev.encode(),
        amqp::event_properties(&ev).with_user_id(user.into()),
        false,
        Duration::from_secs(10),
    )
    .await?;
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_unknown_dependency_is_cancelled_after_the_grace_and_afternotok_releases_after_a_failure(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    build_bin("vq-cli", "vq")?;
    let suite = accounts::suite();
    let sub = &suite.submitter;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let url = shared_broker()?.url_of(&suite.controller);
    let _ctl = start_controller_on_empty_cloud_with(
        &url,
        &cluster,
        POOL,
        "info",
        "127.0.0.1:0",
        "[jobs]\ndepend_grace_secs = 1\n",
    )
    .await?;
    let depends = |kind, id: &str| {
        vec![Dependency {
            kind,
            jobs: vec![id.to_string()],
        }]
    };

    // G names a job nobody submitted: cancelled once the grace has passed.
    let mut g = job(POOL, "alice", "g", "true\n");
    g.depend = depends(DependKind::AfterOk, "never-submitted");
    g.submitted_at = vq_common::messages::unix_now() as u64;
    submit_held(&broker, sub, &g).await?;
    let ev = tap
        .job_event(&g.id, "cancelled", Duration::from_secs(60))
        .await?;
    let why = "dependency afterok:never-submitted can never be satisfied: never-submitted is not in the job table 1 s after submission";
    ensure!(
        ev["state"] == "withdrawn" && ev["reason"].as_str().is_some_and(|r| r.starts_with(why)),
        "{ev}"
    );
    let r = wait_letter(sub, &cluster, &g.id, &["X"]).await?;
    ensure!(r["reason"] == ev["reason"], "{r}");

    // F failed (as an agent reports a job it refused): K, afternotok F,
    // is released into the pool with its submitter in the requeue
    // envelope; L, afterok F, is cancelled.
    let f = job(POOL, "alice", "f", "true\n");
    let failed = JobEvent::about(
        Some(&f),
        &f.id,
        POOL,
        "ag1",
        Some(&sub.user),
        JobState::Failed {
            reason: "owner \"alice\" is not allowed".into(),
        },
    )
    .of_submission(&f.encode());
    amqp::publish_confirmed(
        &broker.ch,
        &broker.topo.events_exchange(),
        &job_event_key(POOL, "failed"),
        &failed.encode(),
        amqp::event_properties(&failed),
        false,
        Duration::from_secs(10),
    )
    .await?;
    wait_letter(sub, &cluster, &f.id, &["F"]).await?;
    let mut k = job(POOL, "alice", "k", "true\n");
    k.depend = depends(DependKind::AfterNotOk, &f.id);
    let mut l = job(POOL, "alice", "l", "true\n");
    l.depend = depends(DependKind::AfterOk, &f.id);
    submit_held(&broker, sub, &k).await?;
    submit_held(&broker, sub, &l).await?;
    tap.job_event(&k.id, "queued", Duration::from_secs(30))
        .await?;
    wait_letter(sub, &cluster, &k.id, &["Q"]).await?;
    let ev = tap
        .job_event(&l.id, "cancelled", Duration::from_secs(30))
        .await?;
    ensure!(
        ev["reason"]
            == format!(
                "dependency afterok:{} can never be satisfied: {} failed: owner \"alice\" is not allowed",
                f.id, f.id
            ),
        "{ev}"
    );
    let got = broker
        .ch
        .basic_get(
            broker.topo.pool_queue(POOL).as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await?
        .context("K is not in its pool queue")?;
    ensure!(
        Job::decode(&got.delivery.data)? == k,
        "another job in the pool"
    );
    ensure!(
        amqp::header_str(&got.delivery.properties, SUBMITTER_HEADER).as_deref()
            == Some(sub.user.as_str()),
        "{:?}",
        got.delivery.properties.headers()
    );
    ensure!(
        broker.queue_len(&broker.topo.pool_queue(POOL)).await? == 0,
        "L or a second copy of K reached the pool"
    );
    let dead: Vec<_> = broker
        .take_dead()
        .await?
        .into_iter()
        .filter_map(|d| d.message_id)
        .collect();
    ensure!(
        dead.contains(&g.id) && dead.contains(&l.id) && !dead.contains(&k.id),
        "{dead:?}"
    );

    // A held message that is no job is dead-lettered with its reason
    // (x-vq-reason), not dropped, and the held consumer goes on.
    let cfg = vq_common::config::BrokerConfig {
        url: shared_broker()?.url_of(sub),
        ..Default::default()
    };
    let conn = amqp::connect(&cfg, "cli_depend bad held").await?;
    let ch = amqp::confirm_channel(&conn).await?;
    amqp::publish_confirmed(
        &ch,
        &broker.topo.held_exchange(),
        POOL,
        b"not a job",
        lapin::BasicProperties::default().with_user_id(sub.user.as_str().into()),
        true,
        Duration::from_secs(10),
    )
    .await?;
    let _ = conn.close(200, "bye".into()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let letter = loop {
        if let Some(d) = broker
            .take_dead()
            .await?
            .into_iter()
            .find(|d| d.body == b"not a job")
        {
            break d;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the bad held message never reached the dead-letter queue"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let reason = letter
        .headers
        .get("x-vq-reason")
        .cloned()
        .unwrap_or_default();
    ensure!(
        reason.starts_with("held message refused: "),
        "{:?}",
        letter.headers
    );
    broker.cleanup().await;
    Ok(())
}
