//! Control messages are authorised by the broker-validated `user_id`: only
//! `control_admins` may drain, resume or ask an agent to go; a user may
//! cancel only a job they own or submitted. `vq drain`, `vq resume` and
//! `vq cancel` print the agent's answer (refused: exit 77). Root only (the
//! agent switches users).

use std::time::Duration;

use anyhow::ensure;
use vq_common::messages::Control;
use vq_common::topology::Role;
use vq_tests::accounts;
use vq_tests::harness::{
    broker_url, build_bin, ensure_test_user, job, require_root, shared_broker, start_agent,
    unique_cluster, wait_agent_up, TestBroker,
};

const POOL: &str = "ctl";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn only_admins_drain_and_only_owners_or_submitters_cancel() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    // mallory, the suite's untrusted submitter, may write control messages
    // (as `vq cancel` users can) but is neither an admin nor alice nor the
    // job's submitter.
    let mallory = &accounts::suite().untrusted;

    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-a1");
    let _agent = start_agent(
        &cluster,
        POOL,
        &agent_id,
        "slots = 2\nkill_grace_secs = 1\n",
        &[],
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let long = job(POOL, &alice.name, "long", "sleep 30\n");
    broker.publish_job(&long).await?;
    tap.job_event(&long.id, "started", Duration::from_secs(20))
        .await?;

    for msg in [
        Control::Cancel {
            job_id: long.id.clone(),
        },
        Control::AskDelete {
            request_id: "m1".into(),
        },
        Control::Drain {
            request_id: "m2".into(),
            reason: None,
        },
    ] {
        broker.publish_control_as(mallory, &agent_id, &msg).await?;
    }
    // None of it takes effect: no answer, the job keeps running, and the
    // agent still pulls (a second job starts).
    let second = job(POOL, &alice.name, "second", "echo ok\n");
    broker.publish_job(&second).await?;
    tap.job_event(&second.id, "finished", Duration::from_secs(20))
        .await?;
    ensure!(
        !tap.seen.iter().any(|(k, v)| k.ends_with(".answer")
            || k.ends_with(".drained")
            || v["job_id"] == long.id.as_str() && k.ends_with(".cancelled")),
        "a non-admin's control message took effect: {:?}",
        tap.seen.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    // The job's submitter (the suite's bridge, no admin) may cancel.
    broker
        .publish_control_as(
            &accounts::suite().submitter,
            &agent_id,
            &Control::Cancel {
                job_id: long.id.clone(),
            },
        )
        .await?;
    let ev = tap
        .job_event(&long.id, "cancelled", Duration::from_secs(20))
        .await?;
    ensure!(ev["outcome"]["kind"] == "cancelled", "{ev}");

    broker.cleanup().await;
    Ok(())
}

/// What a `vq` command printed and its exit status.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `vq ARGS` on `cluster` as the broker account of `url` (off the
/// runtime's threads: it blocks until the command ends).
async fn vq(url: String, cluster: &str, args: &[&str]) -> anyhow::Result<Ran> {
    let bin = build_bin("vq-cli", "vq")?;
    let cluster = cluster.to_string();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let argv = args.clone();
    let t0 = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .env("VQ_BROKER_URL", url)
            .env("VQ_CLUSTER", cluster)
            .env("XDG_CONFIG_HOME", "/nonexistent")
            .env_remove("VQ_CONTROLLER_URL")
            .args(&argv)
            .output()
    })
    .await??;
    let ran = Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!(
        "vq {args:?} -> {:?} in {} ms\n  stdout: {}\n  stderr: {}",
        ran.code,
        t0.elapsed().as_millis(),
        ran.stdout.trim(),
        ran.stderr.trim()
    );
    Ok(ran)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn vq_drain_resume_and_cancel_print_the_agents_answer() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let suite = accounts::suite();
    // The controller's account is in the agents' control_admins (the
    // harness's agent config); the bridge and mallory are not.
    let admin = broker_url(Role::Controller)?;
    let bridge = broker_url(Role::Submitter)?;
    let mallory = shared_broker()?.url_of(&suite.untrusted);

    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-a1");
    let _agent = start_agent(
        &cluster,
        POOL,
        &agent_id,
        "slots = 2\nkill_grace_secs = 1\n",
        &[],
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let long = job(POOL, &alice.name, "long", "sleep 30\n");
    broker.publish_job(&long).await?;
    tap.job_event(&long.id, "started", Duration::from_secs(20))
        .await?;
    let agent = agent_id.as_str();

    // A drain and a resume from a broker user not in control_admins:
    // refused, exit 77, saying who and why; the agent keeps pulling.
    for cmd in ["drain", "resume"] {
        let r = vq(bridge.clone(), &cluster, &[cmd, agent, "--reason", "x"]).await?;
        ensure!(r.code == Some(77), "{cmd}: {:?} {}", r.code, r.stderr);
        ensure!(
            r.stderr.contains(&format!(
                "refused: broker user \"{}\" is not in control_admins of agent {agent}",
                suite.submitter.user
            )),
            "{cmd}: {}",
            r.stderr
        );
    }
    // A cancel from mallory, who neither owns nor submitted the job (the
    // CLI runs as root here, so only the agent's check stands).
    let r = vq(mallory.clone(), &cluster, &["cancel", &long.id]).await?;
    ensure!(r.code == Some(77), "{:?} {}", r.code, r.stderr);
    ensure!(
        r.stderr.contains(&format!(
            "refused: broker user \"{}\" neither owns nor submitted job {}",
            suite.untrusted.user, long.id
        )),
        "{}",
        r.stderr
    );
    ensure!(
        !tap.seen.iter().any(|(k, v)| k.ends_with(".drained")
            || v["job_id"] == long.id.as_str() && k.ends_with(".cancelled")),
        "a refused request took effect"
    );

    // The admin's drain, with a reason: answered, and the reason is in
    // the agent's heartbeats.
    let r = vq(
        admin.clone(),
        &cluster,
        &["drain", agent, "--reason", "kernel update, ticket 4711"],
    )
    .await?;
    ensure!(r.code == Some(0), "{:?} {}", r.code, r.stderr);
    ensure!(
        r.stdout.trim() == format!("agent {agent}: draining (1 job running)"),
        "{}",
        r.stdout
    );
    tap.wait_for(
        Duration::from_secs(10),
        "a draining heartbeat with the reason",
        |k, v| {
            k.ends_with(".heartbeat")
                && v["agent"] == agent
                && v["is_pull"] == false
                && v["drain_reason"] == "kernel update, ticket 4711"
        },
    )
    .await?;
    let r = vq(admin.clone(), &cluster, &["drain", agent]).await?;
    ensure!(
        r.code == Some(0) && r.stdout.contains("already draining (1 job running)"),
        "{:?} {} {}",
        r.code,
        r.stdout,
        r.stderr
    );
    // A job submitted while draining waits in the queue...
    let second = job(POOL, &alice.name, "second", "echo after resume\n");
    broker.publish_job(&second).await?;
    // ...and runs once the drain is resumed.
    let r = vq(
        admin.clone(),
        &cluster,
        &["resume", agent, "--reason", "update postponed"],
    )
    .await?;
    ensure!(r.code == Some(0), "{:?} {}", r.code, r.stderr);
    ensure!(
        r.stdout.trim() == format!("agent {agent}: pulling jobs again (1 job running)"),
        "{}",
        r.stdout
    );
    ensure!(
        tap.events(&second.id, "started").is_empty(),
        "the second job started while the agent drained"
    );
    let done = tap
        .job_event(&second.id, "finished", Duration::from_secs(20))
        .await?;
    ensure!(done["outcome"]["kind"] == "exited", "{done}");
    let r = vq(admin.clone(), &cluster, &["resume", agent]).await?;
    ensure!(
        r.code == Some(0) && r.stdout.contains("not draining"),
        "{:?} {}",
        r.code,
        r.stdout
    );

    // Drain again; the job's submitter (the bridge) cancels it: answered.
    let r = vq(admin.clone(), &cluster, &["drain", agent]).await?;
    ensure!(r.code == Some(0), "{:?} {}", r.code, r.stderr);
    let r = vq(bridge.clone(), &cluster, &["cancel", &long.id]).await?;
    ensure!(r.code == Some(0), "{:?} {}", r.code, r.stderr);
    ensure!(
        r.stdout.trim()
            == format!(
                "job {}: cancelled on agent {agent} (SIGTERM now, SIGKILL after its grace period)",
                long.id
            ),
        "{}",
        r.stdout
    );
    tap.job_event(&long.id, "cancelled", Duration::from_secs(20))
        .await?;
    // Drained with no job left: it agreed to be deleted, so no resume.
    tap.wait_for(Duration::from_secs(20), "drained", |k, v| {
        k.ends_with(".drained") && v["agent"] == agent
    })
    .await?;
    let r = vq(admin.clone(), &cluster, &["resume", agent]).await?;
    ensure!(r.code == Some(77), "{:?} {}", r.code, r.stderr);
    ensure!(
        r.stderr.contains("refused: already agreed to be deleted"),
        "{}",
        r.stderr
    );
    // A cancel of a job that ended: the job table says so before anything
    // is sent (vq cancel's own check).
    let r = vq(bridge, &cluster, &["cancel", &long.id]).await?;
    ensure!(
        r.code == Some(1) && r.stderr.contains("is not running"),
        "{}",
        r.stderr
    );

    broker.cleanup().await;
    Ok(())
}
