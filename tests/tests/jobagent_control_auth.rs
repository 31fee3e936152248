//! Control messages are authorised by the broker-validated `user_id`: only
//! `control_admins` may drain or ask an agent to go; a user may cancel only
//! a job they own or submitted. Root only (the agent switches users).

use std::time::Duration;

use anyhow::ensure;
use vq_common::messages::Control;
use vq_tests::accounts;
use vq_tests::harness::{
    ensure_test_user, job, require_root, start_agent, unique_cluster, wait_agent_up, TestBroker,
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
