//! The `vq` CLI against the shared RabbitMQ, each test under a fresh random
//! cluster name: `vq` logs in as the suite's submitter, the test declares
//! the topology as the controller does (the suite's controller account) and
//! plays the agent with the agent account (it takes the job from the pool
//! queue and publishes the job events an agent would). One test runs a
//! controller (on an empty vq-cloudsim) for the pools' limits it publishes.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test cli_submit -- --include-ignored`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use vq_cli::events::read_job_events;
use vq_cli::submit::{build_job, new_job_id, publish_job, SubmitContext};
use vq_cli::CliError;
use vq_common::amqp;
use vq_common::messages::{Control, Job, JobEvent, JobState, Message, Outcome, Usage};
use vq_common::pbs::Directives;
use vq_common::topology::{job_event_key, Role, Topology};
use vq_tests::harness::{
    broker_url, build_bin, connect_role, require_root, shared_broker, unique_cluster, TestBroker,
};

/// The broker user `vq` logs in as (the suite's submitter).
fn submitter_user() -> String {
    vq_tests::accounts::suite().submitter.user.clone()
}

/// The test's sides of a cluster: the topology declared as the controller,
/// and a connection as the agent.
struct Sides {
    broker: TestBroker,
    agent: lapin::Connection,
    agent_ch: lapin::Channel,
}

impl Sides {
    async fn new(pools: &[&str]) -> Sides {
        // Build `vq` before any connection is open: the build blocks this
        // test's runtime (minutes on a loaded machine), and a connection
        // whose heartbeats stop meanwhile is closed by the broker, taking
        // the test's exclusive queues with it.
        build_bin("vq-cli", "vq").unwrap();
        let broker = TestBroker::connect(&unique_cluster(), pools).await.unwrap();
        let (agent, agent_ch) =
            connect_role(&shared_broker().unwrap(), Role::Agent, "vq-cli-test agent")
                .await
                .unwrap();
        Sides {
            broker,
            agent,
            agent_ch,
        }
    }

    fn topo(&self) -> &Topology {
        &self.broker.topo
    }

    async fn cleanup(self) {
        let _ = self.agent.close(200, "bye".into()).await;
        self.broker.cleanup().await;
    }
}

/// A connection as the suite's submitter and a confirm channel on it (the
/// library's `publish_job`, as `vq submit` calls it).
async fn submitter() -> (lapin::Connection, lapin::Channel) {
    connect_role(
        &shared_broker().unwrap(),
        Role::Submitter,
        "vq-cli-test submitter",
    )
    .await
    .unwrap()
}

fn ctx(cluster: &str) -> SubmitContext {
    SubmitContext {
        job_id: new_job_id(cluster),
        user: "alice".into(),
        home: "/home/alice".into(),
        login_shell: "/bin/bash".into(),
        submit_dir: "/home/alice/w".into(),
        host: "ui01".into(),
        env: BTreeMap::new(),
        now: 1_700_000_000,
        broker_url: broker_url(Role::Submitter).unwrap(),
        is_dir: |_| false,
    }
}

async fn get_one(ch: &lapin::Channel, queue: &str) -> lapin::message::BasicGetMessage {
    for _ in 0..100 {
        if let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no message in {queue} after 10 s");
}

async fn publish_event(ch: &lapin::Channel, topo: &Topology, ev: &JobEvent) {
    amqp::publish_message(
        ch,
        &topo.events_exchange(),
        &job_event_key(&ev.pool, ev.state.routing_word()),
        ev,
        true,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
}

fn event(job: &Job, agent: &str, state: JobState) -> JobEvent {
    JobEvent {
        schema: 1,
        job_id: job.id.clone(),
        job_name: job.name.clone(),
        owner: job.owner.clone(),
        pool: job.pool.clone(),
        agent: agent.into(),
        submitter: None,
        at: vq_common::messages::unix_now(),
        attempt: 1,
        duplicate: None,
        submission: None,
        state,
    }
}

fn vq(cluster: &str) -> Command {
    let mut cmd = Command::new(build_bin("vq-cli", "vq").unwrap());
    cmd.env("VQ_BROKER_URL", broker_url(Role::Submitter).unwrap())
        .env("VQ_CLUSTER", cluster)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env_remove("VQ_CONTROLLER_URL");
    cmd
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_submitted_job_lands_in_its_pool_queue_with_validated_ids() {
    if !require_root() {
        return;
    }
    let sides = Sides::new(&["p1"]).await;
    let topo = sides.topo();
    let (conn, ch) = submitter().await;

    let built = build_job(
        b"#!/bin/sh\n#PBS -N t1\n#PBS -q p1\n#PBS -l walltime=00:01:00\necho hi\n",
        "t1.pbs",
        Directives::default(),
        &ctx(topo.cluster()),
    )
    .unwrap();
    let job = built.job;
    publish_job(&ch, topo, &job, &submitter_user(), Duration::from_secs(10))
        .await
        .unwrap();

    let got = get_one(&sides.agent_ch, &topo.pool_queue("p1")).await;
    let props = &got.delivery.properties;
    assert_eq!(
        props.message_id().as_ref().map(|s| s.as_str()),
        Some(job.id.as_str())
    );
    assert_eq!(
        props.user_id().as_ref().map(|s| s.to_string()),
        Some(submitter_user())
    );
    assert_eq!(
        props.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(props.delivery_mode(), &Some(2));
    let body = Job::decode(&got.delivery.data).unwrap();
    assert_eq!(body, job);
    assert_eq!(body.walltime, Some(60));

    let _ = conn.close(200, "bye".into()).await;
    sides.cleanup().await;
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn unknown_pools_and_clusters_are_clear_errors() {
    if !require_root() {
        return;
    }
    let sides = Sides::new(&["p1"]).await;
    let topo = sides.topo();
    let (conn, ch) = submitter().await;

    let mut job = build_job(b"true\n", "j", Directives::default(), &ctx(topo.cluster()))
        .unwrap()
        .job;
    job.pool = "nope".into();
    let err = publish_job(&ch, topo, &job, &submitter_user(), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(err, CliError::NoSuchPool { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("no pool named \"nope\"") && text.contains(topo.cluster()),
        "{text}"
    );
    assert_eq!(err.exit_code(), 64);

    // A cluster whose exchanges were never declared.
    let ch2 = amqp::confirm_channel(&conn).await.unwrap();
    let other = Topology::new(unique_cluster());
    let err = publish_job(
        &ch2,
        &other,
        &job,
        &submitter_user(),
        Duration::from_secs(10),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, CliError::NoSuchCluster { .. }), "{err:?}");
    // The binary says so once (its question for the pools' limits found
    // no cluster either, and adds nothing).
    let out = vq(other.cluster())
        .args(["submit", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"true\n")?;
            c.wait_with_output()
        })
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("no cluster named"), "{stderr}");

    // The binary says the same and exits 64.
    let out = vq(topo.cluster())
        .args(["submit", "-q", "nope", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"true\n")?;
            c.wait_with_output()
        })
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("no pool named \"nope\""), "{stderr}");
    assert!(out.stdout.is_empty());
    // Said once, on one line, with no library's log lines (the returned
    // message, the channel close) before it; without a reachable
    // controller it says where the pools are listed.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("`vq pools`"), "{stderr}");

    // With the controller's status at hand it lists the pools that exist.
    let status = serde_json::json!({
        "cluster": topo.cluster(),
        "pools": {"p1": {"queued": 0}, "gpu": {"queued": 2}},
    });
    let app = axum::Router::new().route(
        "/status",
        axum::routing::get(move || {
            let status = status.clone();
            async move { axum::Json(status) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let out = tokio::task::spawn_blocking({
        let cluster = topo.cluster().to_string();
        move || {
            vq(&cluster)
                .env("VQ_CONTROLLER_URL", format!("http://{addr}"))
                .args(["submit", "-q", "nope", "-"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    c.stdin.take().unwrap().write_all(b"true\n")?;
                    c.wait_with_output()
                })
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no pool named \"nope\"") && stderr.contains("pools: gpu, p1"),
        "{stderr}"
    );

    let _ = conn.close(200, "bye".into()).await;
    sides.cleanup().await;
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn submit_wait_exits_with_the_job_status_and_stat_shows_it() {
    if !require_root() {
        return;
    }
    let sides = Sides::new(&["default"]).await;
    let topo = sides.topo();
    let ch = &sides.agent_ch;

    let dir = std::env::temp_dir().join(format!("vq-cli-{}", topo.cluster()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("exit3.pbs");
    std::fs::write(&script, "#!/bin/bash\n#PBS -N exit3\n#PBS -j oe\nexit 3\n").unwrap();

    let child = vq(topo.cluster())
        .current_dir(&dir)
        .args(["submit", "--wait", script.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    // Play the agent.
    let got = get_one(ch, &topo.pool_queue("default")).await;
    let job = Job::decode(&got.delivery.data).unwrap();
    assert_eq!(job.name, "exit3");
    assert_eq!(job.workdir.as_deref(), Some(dir.to_str().unwrap()));
    assert_eq!(
        job.stdout,
        Some(format!("{}/exit3.o{}", dir.display(), job.seq()))
    );
    publish_event(ch, topo, &event(&job, "agent-1", JobState::Started)).await;
    let finished = JobState::Finished {
        outcome: Outcome::Exited { code: 3 },
        usage: Usage {
            wall_secs: 1.0,
            ..Default::default()
        },
    };
    publish_event(ch, topo, &event(&job, "agent-1", finished)).await;

    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), job.id);
    assert!(stderr.contains("started on agent-1"), "{stderr}");

    // The event stream has both events (read as a submitter reads it), and
    // vq stat shows the job.
    let (reader, _) = submitter().await;
    let events = read_job_events(&reader, topo).await.unwrap().unwrap();
    let _ = reader.close(200, "bye".into()).await;
    let words: Vec<_> = events.iter().map(|e| e.state.routing_word()).collect();
    assert_eq!(events.len(), 3, "{words:?}");
    let queued = events
        .iter()
        .find(|e| matches!(e.state, JobState::Queued { .. }))
        .expect("vq submit published the queued event");
    assert_eq!(queued.submitter.as_deref(), Some(submitter_user().as_str()));
    let out = vq(topo.cluster())
        .args(["stat", "--from-stream", "-a"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().find(|l| l.starts_with(&job.id)).expect(&text);
    assert!(
        line.contains(" C ") && line.contains(" 3 ") && line.contains("agent-1"),
        "{text}"
    );

    std::fs::remove_dir_all(Path::new(&dir)).unwrap();
    sides.cleanup().await;
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn stat_without_a_stream_says_no_jobs() {
    if !require_root() {
        return;
    }
    let out = vq(&unique_cluster())
        .args(["stat", "--from-stream"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no jobs");
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn cancel_reaches_the_running_agent_and_drain_needs_a_live_agent() {
    if !require_root() {
        return;
    }
    let sides = Sides::new(&["p1"]).await;
    let topo = sides.topo();
    let ch = &sides.agent_ch;
    // The agent's control queue.
    let control = topo.control_queue("ag1");
    ch.queue_declare(
        control.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        control.as_str().into(),
        topo.control_exchange().as_str().into(),
        "ag1".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let mut job = build_job(
        b"sleep 100\n",
        "j",
        Directives::default(),
        &ctx(topo.cluster()),
    )
    .unwrap()
    .job;
    job.pool = "p1".into();
    job.owner = nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .unwrap()
        .name;
    publish_event(ch, topo, &event(&job, "ag1", JobState::Started)).await;

    // Nothing answers on this control queue (as an agent older than
    // control answers): the request is delivered, then the command says
    // no answer came and exits 69.
    let prefix = &job.id[..8];
    let out = vq(topo.cluster())
        .args(["cancel", prefix, "--timeout", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains("agent ag1 took the request but did not answer within 1 s"),
        "{stderr}"
    );
    // A failed command prints its error only, no library log line.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let got = get_one(ch, &control).await;
    assert_eq!(
        Control::decode(&got.delivery.data).unwrap(),
        Control::Cancel {
            job_id: job.id.clone()
        }
    );
    let props = &got.delivery.properties;
    assert_eq!(
        props.user_id().as_ref().map(|s| s.to_string()),
        Some(submitter_user())
    );
    // Where the agent answers: the CLI's reply queue, with a correlation id.
    assert!(
        props
            .reply_to()
            .as_ref()
            .is_some_and(|q| q.as_str().starts_with("amq.gen-")),
        "{props:?}"
    );
    assert!(props.correlation_id().is_some(), "{props:?}");

    let out = vq(topo.cluster())
        .args(["cancel", "doesnotexist"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));

    let out = vq(topo.cluster())
        .args([
            "drain",
            "ag1",
            "--reason",
            "kernel update",
            "--timeout",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("did not answer within 1 s"), "{stderr}");
    let got = get_one(ch, &control).await;
    let Control::Drain { request_id, reason } = Control::decode(&got.delivery.data).unwrap() else {
        panic!("not a drain")
    };
    assert_eq!(reason.as_deref(), Some("kernel update"));
    // The drain's request id is its correlation id.
    assert_eq!(
        got.delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.to_string()),
        Some(request_id)
    );
    let out = vq(topo.cluster())
        .args(["drain", "ghost"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("no agent named \"ghost\""), "{stderr}");

    sides.cleanup().await;
}

/// Runs `vq stat -a` and returns the line of `job_id`.
fn stat_line(cluster: &str, job_id: &str) -> String {
    let out = vq(cluster)
        .args(["stat", "--from-stream", "-a"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find(|l| l.starts_with(job_id))
        .unwrap_or_else(|| panic!("no line for {job_id} in:\n{text}"))
        .to_string()
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_queued_job_is_in_stat_before_it_starts_and_submitters_cannot_forge_results() {
    if !require_root() {
        return;
    }
    let sides = Sides::new(&["p1"]).await;
    let topo = sides.topo();
    let dir = std::env::temp_dir().join(format!("vq-cli-q-{}", topo.cluster()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("waits.pbs");
    std::fs::write(
        &script,
        "#!/bin/sh\n#PBS -N waits\n#PBS -q p1\n#PBS -l walltime=00:02:00\necho hi\n",
    )
    .unwrap();
    let out = vq(topo.cluster())
        .current_dir(&dir)
        .args(["submit", script.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // No controller runs: one warning that the pool's limits were not
    // checked, and no library log line.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "vq: warning: job {id} was not checked against pool p1's limits"
        )) && stderr.contains(&format!(
            "no controller is listening on {}.control (key {}.query.pools)",
            topo.cluster(),
            topo.cluster()
        )),
        "{stderr}"
    );

    // No agent has it: `vq stat` shows it queued, `vq stat ID` finds it.
    let line = stat_line(topo.cluster(), &id);
    assert!(line.contains(" Q ") && line.contains("waits"), "{line}");
    let out = vq(topo.cluster())
        .args(["stat", "--from-stream", &id])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A submitter can add `queued` events and nothing else: a result routed
    // through the submissions exchange is not delivered, one whose body
    // claims a result on a `queued` key is ignored, a `queued` event's
    // submitter is the broker-validated user, and the events exchange
    // itself refuses the submitter.
    let job = Job::decode(
        &get_one(&sides.agent_ch, &topo.pool_queue("p1"))
            .await
            .delivery
            .data,
    )
    .unwrap();
    let (conn, ch) = submitter().await;
    let fake = event(
        &job,
        "nobody",
        JobState::Finished {
            outcome: Outcome::Exited { code: 0 },
            usage: Usage::default(),
        },
    );
    for key in [
        job_event_key("p1", "finished"),
        job_event_key("p1", "queued"),
    ] {
        let props = amqp::event_properties(&fake).with_user_id(submitter_user().as_str().into());
        amqp::publish_confirmed(
            &ch,
            &topo.submitted_exchange(),
            &key,
            &fake.encode(),
            props,
            false,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    }
    let mut forged_queued = JobEvent::queued(&job, &job.encode(), "someone-else");
    forged_queued.job_name = "forged".into();
    let props =
        amqp::event_properties(&forged_queued).with_user_id(submitter_user().as_str().into());
    amqp::publish_confirmed(
        &ch,
        &topo.submitted_exchange(),
        &job_event_key("p1", "queued"),
        &forged_queued.encode(),
        props,
        false,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let refused = amqp::publish_confirmed(
        &ch,
        &topo.events_exchange(),
        &job_event_key("p1", "finished"),
        &fake.encode(),
        amqp::event_properties(&fake),
        false,
        Duration::from_secs(10),
    )
    .await;
    assert!(
        refused.is_err(),
        "the events exchange took a submitter's publish"
    );
    let _ = conn.close(200, "bye".into()).await;

    let (reader, _) = submitter().await;
    let events = read_job_events(&reader, topo).await.unwrap().unwrap();
    let _ = reader.close(200, "bye".into()).await;
    assert_eq!(events.len(), 2, "{events:#?}");
    for e in &events {
        assert!(matches!(e.state, JobState::Queued { .. }), "{e:?}");
        assert_eq!(
            e.submitter.as_deref(),
            Some(submitter_user().as_str()),
            "{e:?}"
        );
    }
    let line = stat_line(topo.cluster(), &id);
    assert!(line.contains(" Q "), "{line}");

    // Once an agent reports it started, it runs (a late `queued` never
    // moves it back).
    publish_event(
        &sides.agent_ch,
        topo,
        &event(&job, "agent-1", JobState::Started),
    )
    .await;
    let line = stat_line(topo.cluster(), &id);
    assert!(line.contains(" R ") && line.contains("agent-1"), "{line}");

    std::fs::remove_dir_all(Path::new(&dir)).unwrap();
    sides.cleanup().await;
}

/// `vq submit -q POOL ARGS` of a one-line script on stdin, as the suite's
/// submitter.
fn submit_stdin(cluster: &str, args: &[&str]) -> std::process::Output {
    vq(cluster)
        .arg("submit")
        .args(args)
        .arg("-")
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"true\n")?;
            c.wait_with_output()
        })
        .unwrap()
}

/// A controller publishes its pools' limits (`slots`, `max_walltime_secs`,
/// `memory_mb`); `vq submit` asks for them first and refuses a job that
/// no VM of the pool could run, one line per limit, exit 64, publishing
/// nothing; a job within them is queued with nothing on stderr; an
/// unknown pool is listed against the controller's pools (issue 11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn submit_refuses_a_job_beyond_its_pools_published_limits_and_publishes_nothing() {
    if !require_root() {
        return;
    }
    const POOL: &str = "lim";
    build_bin("vq-cli", "vq").unwrap();
    let cluster = unique_cluster();
    // A second pool, without memory_mb, publishes its flavor's RAM.
    const BIG: &str = "big";
    let broker = TestBroker::connect(&cluster, &[POOL, BIG]).await.unwrap();
    let topo = broker.topo.clone();
    let mut tap = broker.tap_events().await.unwrap();
    let suite = vq_tests::accounts::suite();
    let url = shared_broker().unwrap().url_of(&suite.controller);
    let _ctl = vq_tests::harness::start_controller_on_empty_cloud_with(
        &url,
        &cluster,
        POOL,
        "info",
        "127.0.0.1:0",
        &format!(
            "slots = 2\nmax_walltime_secs = 3600\nmemory_mb = 1024\n\
             [pools.{BIG}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{}\"\nmax = 0\nslots = 8\n",
            suite.agent.url(&url)
        ),
    )
    .await
    .unwrap();

    // The controller answers once its broker session is up.
    let settings = vq_cli::settings::Settings {
        broker: vq_common::config::BrokerConfig {
            url: broker_url(Role::Submitter).unwrap(),
            ..Default::default()
        },
        cluster: cluster.clone(),
        controller_url: "http://127.0.0.1:1".into(),
    };
    let (conn, _ch) = submitter().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let page = loop {
        match vq_cli::limits::ask(&conn, &settings, Duration::from_secs(2)).await {
            vq_cli::limits::Limits::Known(page) => break page,
            vq_cli::limits::Limits::Unchecked(why) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the controller never answered: {why}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(
        page.pools,
        [
            vq_common::pools::PoolLimits {
                pool: BIG.into(),
                slots: 8,
                max_walltime_secs: 31 * 24 * 3600,
                memory_mb: Some(2048),
            },
            vq_common::pools::PoolLimits {
                pool: POOL.into(),
                slots: 2,
                max_walltime_secs: 3600,
                memory_mb: Some(1024),
            }
        ],
        "{BIG}'s memory is m1.small's RAM, its max walltime the default 31 days"
    );

    // Beyond each limit: refused, with the reason, nothing on stdout.
    for (args, reasons) in [
        (
            vec!["-l", "walltime=02:00:00"],
            vec![format!(
                "vq: walltime 02:00:00 is more than pool {POOL}'s max_walltime 01:00:00"
            )],
        ),
        (
            vec!["-l", "nodes=1:ppn=4"],
            vec![format!(
                "vq: 4 slots (nodes=1:ppn, ncpus) are more than pool {POOL}'s VMs have (2 slots)"
            )],
        ),
        (
            vec!["-l", "mem=2gb"],
            vec![format!(
                "vq: mem 2gb is more than pool {POOL}'s memory per VM 1gb"
            )],
        ),
        (
            vec!["-l", "walltime=3601,ncpus=3"],
            vec![
                format!("vq: walltime 01:00:01 is more than pool {POOL}'s max_walltime 01:00:00"),
                format!(
                    "vq: 3 slots (nodes=1:ppn, ncpus) are more than pool {POOL}'s VMs have (2 slots)"
                ),
            ],
        ),
    ] {
        let mut all = vec!["-q", POOL];
        all.extend(&args);
        let out = submit_stdin(&cluster, &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().collect::<Vec<_>>(), reasons, "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    let out = submit_stdin(&cluster, &["-q", BIG, "-l", "mem=3gb"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!("vq: mem 3gb is more than pool {BIG}'s memory per VM 2gb")
    );

    // Within every limit (at each limit exactly): queued, nothing said.
    let out = submit_stdin(
        &cluster,
        &["-q", POOL, "-l", "walltime=01:00:00,nodes=1:ppn=2,mem=1gb"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();

    // Nothing of the refused jobs was published: the accepted job's
    // `queued` event is the only one (the refused commands ended before
    // it was submitted), and it is the one message of the pool queue.
    tap.job_event(&id, "queued", Duration::from_secs(30))
        .await
        .unwrap();
    let queued: Vec<_> = tap
        .seen
        .iter()
        .filter(|(k, _)| k.ends_with(".queued"))
        .map(|(_, v)| v["job_id"].clone())
        .collect();
    assert_eq!(queued, [serde_json::Value::from(id.clone())]);
    assert_eq!(broker.queue_len(&topo.pool_queue(POOL)).await.unwrap(), 1);

    // An unknown pool: one line, naming the controller's pools.
    let out = submit_stdin(&cluster, &["-q", "nope"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no pool named \"nope\"")
            && stderr.contains(&format!("pools: {BIG}, {POOL}")),
        "{stderr}"
    );

    broker.cleanup().await;
}
