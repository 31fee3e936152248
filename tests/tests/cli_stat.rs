//! `vq stat` answered by the controller's job table over AMQP (issue 11):
//! a submitter sees its queued and finished jobs, another submitter does
//! not (`[jobs] query_other_jobs = false`, Torque's default) but an
//! operator (`[jobs] operators`) does; a query without `user_id` gets a
//! refusal and one with another user's `user_id` is refused by the broker;
//! `-f` and `--json` checked field by field; without a controller `vq
//! stat` says so and exits non-zero.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test cli_stat -- --include-ignored`.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use vq_common::amqp;
use vq_common::jobs::{JobPage, JobQuery};
use vq_common::messages::{Job, JobEvent, JobState, Message, Outcome, Usage};
use vq_common::topology::job_event_key;
use vq_tests::accounts::{self, Account};
use vq_tests::harness::{
    build_bin, job, require_root, shared_broker, start_controller_on_empty_cloud_with,
    unique_cluster, TestBroker,
};

const POOL: &str = "st";

/// `vq stat ARGS` as `account` on `cluster` (run by root, so no owner
/// filter of the invoking Unix user: the controller's rule alone decides).
fn vq_stat(account: &Account, cluster: &str, args: &[&str]) -> anyhow::Result<Output> {
    let url = shared_broker()?.url_of(account);
    Ok(Command::new(build_bin("vq-cli", "vq")?)
        .arg("stat")
        .args(args)
        .env("VQ_BROKER_URL", url)
        .env("VQ_CLUSTER", cluster)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env_remove("VQ_CONTROLLER_URL")
        .output()?)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Polls `vq stat --json -a` as `account` until `pred` holds (every
/// 200 ms, up to 60 s).
async fn wait_stat(
    account: &Account,
    cluster: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let o = vq_stat(account, cluster, &["-a", "--json"])?;
        let last = if o.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
            if v["complete"] == true && pred(&v) {
                return Ok(v);
            }
            v.to_string()
        } else {
            format!("{}: {}", o.status, stderr(&o))
        };
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}; last answer: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn ids(v: &serde_json::Value) -> Vec<String> {
    v["jobs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|j| j["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Publishes `j`'s `queued` event as `account` (as `vq submit` does).
async fn queued_as(
    account: &Account,
    topo: &vq_common::topology::Topology,
    j: &Job,
) -> anyhow::Result<()> {
    let cfg = vq_common::config::BrokerConfig {
        url: shared_broker()?.url_of(account),
        ..Default::default()
    };
    let conn = amqp::connect(&cfg, "cli_stat submitter").await?;
    let ch = amqp::confirm_channel(&conn).await?;
    let ev = JobEvent::queued(j, &j.encode(), &account.user);
    amqp::publish_confirmed(
        &ch,
        &topo.submitted_exchange(),
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
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn vq_stat_shows_each_submitter_its_jobs_operators_all_and_needs_a_validated_user_id(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let suite = accounts::suite();
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let topo = broker.topo.clone();

    // No controller yet: a clear error, exit 69, within the timeout.
    let o = vq_stat(&suite.submitter, &cluster, &["--timeout", "3"])?;
    ensure!(o.status.code() == Some(69), "{:?} {}", o.status, stderr(&o));
    ensure!(
        stderr(&o).contains(&format!("no controller is listening on {cluster}.control")),
        "{}",
        stderr(&o)
    );

    let extra = format!(
        "[jobs]\nquery_other_jobs = false\noperators = [\"{}\"]\n",
        suite.controller.user
    );
    let url = shared_broker()?.url_of(&suite.controller);
    let ctl =
        start_controller_on_empty_cloud_with(&url, &cluster, POOL, "info", "127.0.0.1:0", &extra)
            .await?;

    // The trusted submitter submits two jobs, one runs to its end; the
    // untrusted one submits a third.
    let mut ran = job(POOL, "alice", "ran", "true\n");
    ran.walltime = Some(3600);
    let waits = job(POOL, "bob", "waits", "true\n");
    let other = job(POOL, "carol", "other", "true\n");
    queued_as(&suite.submitter, &topo, &ran).await?;
    queued_as(&suite.submitter, &topo, &waits).await?;
    queued_as(&suite.untrusted, &topo, &other).await?;
    let body = ran.encode();
    let agent_event = |state| {
        JobEvent::about(
            Some(&ran),
            &ran.id,
            POOL,
            "agent-1",
            Some(&suite.submitter.user),
            state,
        )
        .of_submission(&body)
    };
    let usage = Usage {
        wall_secs: 61.4,
        user_cpu_secs: 30.2,
        system_cpu_secs: 0.1,
        max_rss_bytes: 3 * 1024 * 1024,
    };
    for ev in [
        agent_event(JobState::Started),
        agent_event(JobState::Finished {
            outcome: Outcome::Exited { code: 4 },
            usage,
        }),
    ] {
        amqp::publish_confirmed(
            &broker.ch,
            &topo.events_exchange(),
            &job_event_key(POOL, ev.state.routing_word()),
            &ev.encode(),
            amqp::event_properties(&ev),
            false,
            Duration::from_secs(10),
        )
        .await?;
    }

    // The operator sees all three once the table has them.
    let all = wait_stat(
        &suite.controller,
        &cluster,
        "three jobs for the operator",
        |v| {
            ids(v).len() == 3
                && v["jobs"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|j| j["letter"] == "C"))
        },
    )
    .await?;
    ensure!(
        ids(&all) == [ran.id.clone(), waits.id.clone(), other.id.clone()],
        "{all}"
    );
    // The submitter sees its two (queued and finished), not the third.
    let mine = wait_stat(&suite.submitter, &cluster, "the submitter's jobs", |_| true).await?;
    ensure!(ids(&mine) == [ran.id.clone(), waits.id.clone()], "{mine}");
    let rec = &mine["jobs"][0];
    for (k, want) in [
        ("letter", serde_json::json!("C")),
        ("state", serde_json::json!("completed")),
        ("exit_status", serde_json::json!(4)),
        ("agent", serde_json::json!("agent-1")),
        ("owner", serde_json::json!("alice")),
        ("name", serde_json::json!("ran")),
        ("pool", serde_json::json!(POOL)),
        ("submitter", serde_json::json!(suite.submitter.user)),
    ] {
        ensure!(rec[k] == want, "{k}: {} in {rec}", rec[k]);
    }
    ensure!(rec["request"]["walltime"] == 3600, "{rec}");
    ensure!(rec["usage"]["max_rss_bytes"] == 3 * 1024 * 1024, "{rec}");
    ensure!(mine["jobs"][1]["letter"] == "Q", "{mine}");
    // The untrusted submitter sees only its own; the others' by id: refused.
    let theirs = wait_stat(&suite.untrusted, &cluster, "the untrusted's jobs", |_| true).await?;
    ensure!(ids(&theirs) == [other.id.clone()], "{theirs}");
    let o = vq_stat(&suite.untrusted, &cluster, &[&ran.id])?;
    ensure!(!o.status.success(), "{}", stdout(&o));
    ensure!(
        stderr(&o).contains("is not yours") && stderr(&o).contains("query_other_jobs"),
        "{}",
        stderr(&o)
    );

    // `vq stat -f ID` of the finished job, as Torque's qstat -f.
    let o = vq_stat(&suite.submitter, &cluster, &["-f", &ran.id[..8]])?;
    ensure!(o.status.success(), "{}", stderr(&o));
    let full = stdout(&o);
    let lines: Vec<&str> = full.lines().collect();
    ensure!(lines[0] == format!("Job Id: {}", ran.id), "{full}");
    for want in [
        "    Job_Name = ran".to_string(),
        format!("    Job_Owner = alice@{}", ran.submit_host),
        "    job_state = C".into(),
        format!("    queue = {POOL}"),
        "    exec_host = agent-1".into(),
        "    exit_status = 4".into(),
        "    Resource_List.walltime = 01:00:00".into(),
        "    resources_used.walltime = 00:01:01".into(),
        "    resources_used.cput = 00:00:30".into(),
        "    resources_used.mem = 3072kb".into(),
        "    run_count = 1".into(),
    ] {
        ensure!(
            lines.contains(&want.as_str()),
            "{want:?} missing in\n{full}"
        );
    }
    for key in [
        "ctime = ",
        "qtime = ",
        "start_time = ",
        "comp_time = ",
        "mtime = ",
    ] {
        ensure!(full.contains(key), "{key} missing in\n{full}");
    }
    // The queued one by id, in the table and with --state.
    let o = vq_stat(&suite.submitter, &cluster, &[&waits.id])?;
    ensure!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    ensure!(table.lines().count() == 3, "{table}");
    ensure!(
        table
            .lines()
            .nth(2)
            .is_some_and(|l| l.starts_with(waits.id.as_str()) && l.contains(" Q ")),
        "{table}"
    );
    let o = vq_stat(&suite.submitter, &cluster, &["--state", "Q", "--json"])?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).context(stderr(&o))?;
    ensure!(ids(&v) == [waits.id.clone()], "{v}");
    // --pool: the pool's jobs only.
    let o = vq_stat(&suite.submitter, &cluster, &["--pool", POOL, "--json"])?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).context(stderr(&o))?;
    ensure!(ids(&v) == [ran.id.clone(), waits.id.clone()], "{v}");
    let o = vq_stat(
        &suite.submitter,
        &cluster,
        &["--pool", "elsewhere", "--json"],
    )?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).context(stderr(&o))?;
    ensure!(ids(&v).is_empty(), "{v}");

    // A query without user_id gets a refusal; one with another user's
    // user_id never reaches the controller (the broker refuses it).
    let page = raw_query(&suite.untrusted, &topo, None).await?;
    ensure!(
        page.as_ref().is_ok_and(
            |p| p.error.as_deref().is_some_and(|e| e.contains("no user_id")) && p.jobs.is_empty()
        ),
        "{page:?}"
    );
    let forged = raw_query(&suite.untrusted, &topo, Some(&suite.controller.user)).await?;
    ensure!(
        forged
            .as_ref()
            .is_err_and(|e| e.contains("PRECONDITION_FAILED") || e.contains("user_id")),
        "{forged:?}"
    );

    drop(ctl);
    broker.cleanup().await;
    Ok(())
}

/// Sends a [`JobQuery`] for every job as `account` with `user_id` (none:
/// no `user_id` property); `Ok(page)` with the answer, `Err(text)` if the
/// publish failed.
async fn raw_query(
    account: &Account,
    topo: &vq_common::topology::Topology,
    user_id: Option<&str>,
) -> anyhow::Result<Result<JobPage, String>> {
    let cfg = vq_common::config::BrokerConfig {
        url: shared_broker()?.url_of(account),
        ..Default::default()
    };
    let conn = amqp::connect(&cfg, "cli_stat raw query").await?;
    let ch = amqp::confirm_channel(&conn).await?;
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let name = q.name().clone();
    ch.queue_bind(
        name.clone(),
        topo.replies_exchange().into(),
        name.clone(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let mut consumer = ch
        .basic_consume(
            name.clone(),
            "raw".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut props = amqp::json_properties::<JobQuery>()
        .with_reply_to(name.clone())
        .with_correlation_id("raw-1".into());
    if let Some(u) = user_id {
        props = props.with_user_id(u.into());
    }
    let sent = amqp::publish_confirmed(
        &ch,
        &topo.control_exchange(),
        &topo.job_query_key(),
        &JobQuery::default().encode(),
        props,
        true,
        Duration::from_secs(10),
    )
    .await;
    if let Err(e) = sent {
        let _ = conn.close(200, "bye".into()).await;
        return Ok(Err(vq_common::error::chain(&e)));
    }
    let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .context("no answer within 10 s")?
        .context("reply consumer ended")??;
    ensure!(
        d.properties.correlation_id().as_ref().map(|c| c.as_str()) == Some("raw-1"),
        "{:?}",
        d.properties
    );
    let page = JobPage::decode(&d.data)?;
    let _ = conn.close(200, "bye".into()).await;
    Ok(Ok(page))
}
