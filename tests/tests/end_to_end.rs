//! vq end to end on one machine: PBS scripts submitted with `vq submit` by
//! an unprivileged user, the pool scales up on vq-cloudsim, the jobs run as
//! their owner through the production controller and jobagent binaries, the
//! pool scales back to zero. The agents run the pool's slots (the image's
//! config says otherwise) and `vq submit` refuses a walltime above the
//! pool's maximum.
//!
//! Root only (the agent switches users): `cargo test -p vq-tests --test
//! end_to_end -- --include-ignored`.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use vq_common::topology::Role;
use vq_tests::accounts::{self, Clusters};
use vq_tests::cloudsim::{Sim, SimConfig};
use vq_tests::harness::{
    build_bin, ensure_test_user, require_root, shared_broker, unique_cluster, ChildGuard,
    TestBroker,
};

const POOL: &str = "e2e";

fn sim_server_count(sim_url: &str) -> anyhow::Result<usize> {
    let out = Command::new("curl")
        .args(["-fsS", &format!("{sim_url}/_sim/servers")])
        .output()
        .context("run curl")?;
    ensure!(out.status.success(), "GET /_sim/servers failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["servers"].as_array().map(Vec::len).unwrap_or(0))
}

fn write_script(dir: &Path, name: &str, body: &str) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.pbs"));
    std::fs::write(&path, body)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn pbs_jobs_scale_a_pool_up_run_as_their_owner_and_the_pool_returns_to_zero(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let cluster = unique_cluster();
    let alice = ensure_test_user("vqt-e2e-alice", 2301)?;
    // One broker account per role, with exactly the documented
    // permissions on this cluster; alice submits as herself.
    let submitter = accounts::account(Role::Submitter, &alice.name);
    let controller_account = accounts::account(Role::Controller, "vqt-e2e-controller");
    let agent_account = accounts::account(Role::Agent, "vqt-e2e-agent");
    accounts::create(
        &[
            submitter.clone(),
            controller_account.clone(),
            agent_account.clone(),
        ],
        Clusters::Named(&cluster),
        accounts::import_shared,
    )?;
    let controller_url = shared_broker()?.url_of(&controller_account);
    let agent_url = shared_broker()?.url_of(&agent_account);

    let agent_bin = build_bin("vq-jobagent", "jobagent")?;
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let vq_bin = build_bin("vq-cli", "vq")?;

    let tmp = tempfile::tempdir()?;
    let agent_cfg = tmp.path().join("jobagent.toml");
    std::fs::write(
        &agent_cfg,
        format!(
            "cluster = \"{cluster}\"\nslots = 1\nheartbeat_secs = 0.5\nmin_uid = 1000\ncontrol_admins = [\"{c}\"]\n[submitters]\nsame_name = true\nrequeuers = [\"{c}\"]\n",
            c = controller_account.user
        ),
    )?;
    // Declare the topology (as the controller would) and tap events before
    // anything is published.
    let broker = TestBroker::connect_url(&controller_url, &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;

    let mut sim_cfg = SimConfig::new(tmp.path().join("sim"), &agent_bin, &agent_cfg);
    sim_cfg.boot_delay = Duration::from_millis(500);
    let sim = Sim::start(sim_cfg).await?;
    let sim_url = sim.base_url();

    let controller_cfg = tmp.path().join("controller.toml");
    std::fs::write(
        &controller_cfg,
        format!(
            r#"cluster = "{cluster}"
listen = "127.0.0.1:0"
interval_secs = 0.5
heartbeat_timeout_secs = 20.0
[broker]
url = "{controller_url}"
[openstack]
cloud = "cloudsim"
[pools.{POOL}]
flavor = "m1.small"
image = "vq-worker"
agent_broker_url = "{agent_url}"
min = 0
max = 2
slots = 2
max_walltime_secs = 600
boot_timeout_secs = 60
idle_secs = 2
cooldown_secs = 1
min_lifetime_secs = 0
"#
        ),
    )?;
    let mut cmd = Command::new(&controller_bin);
    cmd.arg("--config")
        .arg(&controller_cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env("RUST_LOG", "info");
    let _controller = ChildGuard::spawn(cmd)?;

    // Five jobs for two VMs of two slots: the pool must stop at max = 2.
    let jobdir = alice.home.join(format!("e2e-{cluster}"));
    std::fs::create_dir_all(&jobdir)?;
    nix::unistd::chown(&jobdir, Some(alice.uid.into()), Some(alice.gid.into()))?;
    let mut names = Vec::new();
    for i in 0..5 {
        let name = format!("e2e{i}");
        write_script(
            &jobdir,
            &name,
            &format!(
                "#!/bin/bash\n#PBS -N {name}\n#PBS -q {POOL}\n#PBS -l walltime=00:01:00\n#PBS -j oe\n#PBS -v E2E_VAR=v{i}\n\
                 sleep 1\necho \"uid=$(id -u) gid=$(id -g) job=$PBS_JOBID var=$E2E_VAR wd=$(pwd)\"\n"
            ),
        )?;
        names.push(name);
    }
    let submit_url = shared_broker()?.url_of(&submitter);
    let mut ids = BTreeMap::new();
    for name in &names {
        let out = Command::new("runuser")
            .args(["-u", &alice.name, "--"])
            .arg(&vq_bin)
            .args(["--cluster", &cluster, "submit", &format!("{name}.pbs")])
            .current_dir(&jobdir)
            .env("VQ_BROKER_URL", &submit_url)
            .output()?;
        ensure!(
            out.status.success(),
            "vq submit {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id = String::from_utf8(out.stdout)?.trim().to_string();
        ensure!(!id.is_empty(), "vq submit printed no job id");
        ids.insert(name.clone(), id);
    }

    // Every job finishes with exit code 0; watch the VM count meanwhile.
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    for (name, id) in &ids {
        loop {
            peak = peak.max(sim_server_count(&sim_url)?);
            ensure!(peak <= 2, "the pool went above max = 2 VMs: {peak}");
            let left = deadline.saturating_duration_since(Instant::now());
            ensure!(!left.is_zero(), "job {name} did not finish in time");
            match tap
                .job_event(id, "finished", Duration::from_millis(500))
                .await
            {
                Ok(ev) => {
                    ensure!(
                        ev["outcome"]["kind"] == "exited" && ev["outcome"]["code"] == 0,
                        "job {name} ended badly: {ev}"
                    );
                    break;
                }
                Err(_) => continue,
            }
        }
    }
    ensure!(peak >= 1, "the pool never scaled up");

    // Outputs: PBS default name, owned by alice, written as alice, with the
    // job's own -v variable and PBS_JOBID.
    for (name, id) in &ids {
        let seq = id.split(['-', '.']).next().unwrap_or(id);
        let out = jobdir.join(format!("{name}.o{seq}"));
        let meta = std::fs::metadata(&out).with_context(|| format!("{}", out.display()))?;
        ensure!(
            meta.uid() == alice.uid,
            "{} owned by uid {}",
            out.display(),
            meta.uid()
        );
        let text = std::fs::read_to_string(&out)?;
        let i = &name[3..];
        ensure!(
            text.contains(&format!(
                "uid={} gid={} job={id} var=v{i} wd={}",
                alice.uid,
                alice.gid,
                jobdir.display()
            )),
            "unexpected output of {name}: {text}"
        );
    }

    // The image's config says `slots = 1`; the agents run the pool's 2,
    // from the identity file the controller wrote (issue 11: agents and
    // controller never disagree).
    let beats: Vec<_> = tap
        .seen
        .iter()
        .filter(|(k, _)| k == &format!("agent.{POOL}.heartbeat"))
        .map(|(_, v)| v["slots"].as_u64())
        .collect();
    ensure!(
        !beats.is_empty() && beats.iter().all(|s| *s == Some(2)),
        "heartbeats must carry the pool's 2 slots: {beats:?}"
    );

    // The controller publishes the pool's max walltime (600 s): vq submit
    // refuses a job above it before anything is queued.
    write_script(
        &jobdir,
        "toolong",
        &format!("#!/bin/bash\n#PBS -q {POOL}\n#PBS -l walltime=01:00:00\ntrue\n"),
    )?;
    let out = Command::new("runuser")
        .args(["-u", &alice.name, "--"])
        .arg(&vq_bin)
        .args(["--cluster", &cluster, "submit", "toolong.pbs"])
        .current_dir(&jobdir)
        .env("VQ_BROKER_URL", &submit_url)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(64)
            && out.stdout.is_empty()
            && stderr.trim()
                == format!(
                    "vq: walltime 01:00:00 is more than pool {POOL}'s max_walltime 00:10:00"
                ),
        "vq submit of a job above the pool's max walltime: {:?} {stderr}",
        out.status
    );

    // And an agent refuses one above it that reaches the queue anyway (a
    // bridge that does not ask): its max walltime is the pool's 600 s from
    // the identity file, not the 31 days of its config.
    let mut toolong = vq_tests::harness::job(POOL, &alice.name, "toolong", "true\n");
    toolong.walltime = Some(601);
    {
        let cfg = vq_common::config::BrokerConfig {
            url: submit_url.clone(),
            ..Default::default()
        };
        let conn = vq_common::amqp::connect(&cfg, "e2e bridge").await?;
        let ch = vq_common::amqp::confirm_channel(&conn).await?;
        vq_common::amqp::publish_confirmed(
            &ch,
            &broker.topo.jobs_exchange(),
            POOL,
            &vq_common::messages::Message::encode(&toolong),
            vq_common::amqp::json_properties::<vq_common::messages::Job>()
                .with_message_id(toolong.id.as_str().into())
                .with_user_id(alice.name.as_str().into()),
            true,
            Duration::from_secs(10),
        )
        .await?;
        let _ = conn.close(200, "bye".into()).await;
    }
    let failed = tap
        .job_event(&toolong.id, "failed", Duration::from_secs(60))
        .await?;
    ensure!(
        failed
            .to_string()
            .contains("601 s is more than this pool's max_walltime_secs 600"),
        "the agent must refuse with the pool's max walltime: {failed}"
    );

    // Back to zero VMs, without a failed job (but the refused one) and
    // without running a job twice.
    let deadline = Instant::now() + Duration::from_secs(60);
    while sim_server_count(&sim_url)? > 0 {
        if Instant::now() > deadline {
            bail!(
                "{} VM(s) left after scale-down",
                sim_server_count(&sim_url)?
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut started = BTreeMap::<String, usize>::new();
    for (key, ev) in &tap.seen {
        ensure!(
            !key.ends_with(".failed") || ev["job_id"] == toolong.id.as_str(),
            "a job failed: {ev}"
        );
        if key.ends_with(".started") {
            *started
                .entry(ev["job_id"].as_str().unwrap_or("").to_string())
                .or_default() += 1;
        }
    }
    let expected: BTreeSet<_> = ids.values().cloned().collect();
    ensure!(
        started.keys().cloned().collect::<BTreeSet<_>>() == expected
            && started.values().all(|n| *n == 1),
        "every job must start exactly once: {started:?}"
    );

    sim.shutdown().await;
    broker.cleanup().await;
    std::fs::remove_dir_all(&jobdir).ok();
    Ok(())
}
