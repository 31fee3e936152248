//! The controller's job table as an operator reads it at `/jobs`: built
//! from the job-event stream (submitters' `queued` events, agents'
//! `started` and results), kept current, rebuilt from the stream by a new
//! controller process, closed without the bearer token, and deaf to a
//! submitter's forged result.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test controller_jobs -- --include-ignored`.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use anyhow::{bail, ensure};
use vq_common::amqp;
use vq_common::messages::{JobEvent, JobState, Message, Outcome, Usage};
use vq_common::topology::{job_event_key, Role};
use vq_tests::accounts;
use vq_tests::harness::{
    connect_role, job, require_root, shared_broker, start_controller_on_empty_cloud_with,
    unique_cluster, TestBroker,
};
use vq_tests::rabbit_node::free_port;

const POOL: &str = "jt";
const TOKEN: &str = "s3cret-token-of-the-test";

/// Polls `GET /jobs<query>` with the token until `pred` holds for the JSON
/// answer (every 200 ms, up to 60 s).
async fn wait_jobs(
    client: &reqwest::Client,
    base: &str,
    query: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let last = match client
            .get(format!("{base}/jobs{query}"))
            .bearer_auth(TOKEN)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => {
                let v: serde_json::Value = r.json().await?;
                if pred(&v) {
                    return Ok(v);
                }
                v.to_string()
            }
            Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}; last answer: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The letter of job `id` in a `/jobs` answer.
fn letter(v: &serde_json::Value, id: &str) -> Option<String> {
    v["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["id"] == id)
        .and_then(|j| j["letter"].as_str().map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn the_job_table_follows_the_stream_is_rebuilt_by_a_new_controller_and_needs_the_token(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let topo = broker.topo.clone();
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("jobs.token");
    std::fs::write(&token_file, format!("{TOKEN}\n"))?;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    let extra = format!("[jobs]\napi_token_file = \"{}\"\n", token_file.display());
    let url = shared_broker()?.url_of(&accounts::suite().controller);
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let base = format!("http://{listen}");
    let ctl =
        start_controller_on_empty_cloud_with(&url, &cluster, POOL, "info", &listen, &extra).await?;
    let client = reqwest::Client::new();

    // Two submissions, as `vq submit` publishes them; one runs to its end.
    let (sub_conn, sub_ch) = connect_role(
        &shared_broker()?,
        Role::Submitter,
        "controller_jobs submitter",
    )
    .await?;
    let submitter = accounts::suite().submitter.user.clone();
    let ran = job(POOL, "alice", "ran", "true\n");
    let waits = job(POOL, "bob", "waits", "true\n");
    for j in [&ran, &waits] {
        let ev = JobEvent::queued(j, &j.encode(), &submitter);
        amqp::publish_confirmed(
            &sub_ch,
            &topo.submitted_exchange(),
            &job_event_key(POOL, "queued"),
            &ev.encode(),
            amqp::event_properties(&ev).with_user_id(submitter.as_str().into()),
            false,
            Duration::from_secs(10),
        )
        .await?;
    }
    let body = ran.encode();
    let agent_event = |state| {
        JobEvent::about(
            Some(&ran),
            &ran.id,
            POOL,
            "agent-1",
            Some(&submitter),
            state,
        )
        .of_submission(&body)
    };
    let finished = agent_event(JobState::Finished {
        outcome: Outcome::Exited { code: 4 },
        usage: Usage {
            wall_secs: 1.5,
            ..Default::default()
        },
    });
    for ev in [agent_event(JobState::Started), finished.clone()] {
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
    // A submitter's forged result for the waiting job, routed as `queued`
    // (the one key it can route): ignored.
    let forged = JobEvent::about(
        Some(&waits),
        &waits.id,
        POOL,
        "agent-x",
        None,
        JobState::Finished {
            outcome: Outcome::Exited { code: 0 },
            usage: Usage::default(),
        },
    )
    .of_submission(&waits.encode());
    amqp::publish_confirmed(
        &sub_ch,
        &topo.submitted_exchange(),
        &job_event_key(POOL, "queued"),
        &forged.encode(),
        amqp::event_properties(&forged).with_user_id(submitter.as_str().into()),
        false,
        Duration::from_secs(10),
    )
    .await?;
    let _ = sub_conn.close(200, "bye".into()).await;

    let both = |v: &serde_json::Value| {
        letter(v, &ran.id).as_deref() == Some("C") && letter(v, &waits.id).as_deref() == Some("Q")
    };
    let v = wait_jobs(&client, &base, "", "ran C and waits Q", both).await?;
    let rec = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == ran.id.as_str())
        .unwrap();
    ensure!(
        rec["exit_status"] == 4 && rec["agent"] == "agent-1",
        "{rec}"
    );
    ensure!(rec["submitter"] == submitter.as_str(), "{rec}");
    ensure!(
        rec["request"]["submit_host"] == ran.submit_host.as_str(),
        "{rec}"
    );

    // Filters, one job, errors.
    let v = wait_jobs(&client, &base, "?owner=bob&state=Q", "bob's queued", |v| {
        v["jobs"].as_array().is_some_and(|a| a.len() == 1)
    })
    .await?;
    ensure!(letter(&v, &waits.id).as_deref() == Some("Q"), "{v}");
    let r = client
        .get(format!("{base}/jobs/{}", ran.id))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    ensure!(r.status() == 200, "{}", r.status());
    let one: serde_json::Value = r.json().await?;
    ensure!(one["letter"] == "C", "{one}");
    let r = client
        .get(format!("{base}/jobs?state=Z"))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    ensure!(r.status() == 400, "{}", r.status());
    for auth in [None, Some("wrong")] {
        let mut req = client.get(format!("{base}/jobs"));
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        let r = req.send().await?;
        ensure!(r.status() == 401, "{:?}: {}", auth, r.status());
        ensure!(r.headers().get("www-authenticate").is_some());
    }

    // A new controller process rebuilds the same table from the stream.
    drop(ctl);
    let ctl =
        start_controller_on_empty_cloud_with(&url, &cluster, POOL, "info", &listen, &extra).await?;
    wait_jobs(&client, &base, "", "the rebuilt table", both).await?;

    // The rebuilt (caught-up: /jobs answers) table did not observe the
    // replayed start again; a new first start is observed once, from its
    // queued event's time.
    let wait_count = |text: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "vq_job_wait_duration_seconds_count{{pool=\"{POOL}\"}} "
                ))
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let metrics = || async {
        anyhow::Ok(
            client
                .get(format!("{base}/metrics"))
                .send()
                .await?
                .text()
                .await?,
        )
    };
    ensure!(wait_count(&metrics().await?) == 0, "replay observed");
    let start = JobEvent::about(
        Some(&waits),
        &waits.id,
        POOL,
        "agent-2",
        Some(&submitter),
        JobState::Started,
    )
    .of_submission(&waits.encode());
    amqp::publish_confirmed(
        &broker.ch,
        &topo.events_exchange(),
        &job_event_key(POOL, "started"),
        &start.encode(),
        amqp::event_properties(&start),
        false,
        Duration::from_secs(10),
    )
    .await?;
    wait_jobs(&client, &base, "", "waits R", |v| {
        letter(v, &waits.id).as_deref() == Some("R")
    })
    .await?;
    let text = metrics().await?;
    ensure!(wait_count(&text) == 1, "no job wait observed:\n{text}");

    drop(ctl);
    broker.cleanup().await;
    Ok(())
}
