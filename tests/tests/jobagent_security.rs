//! Root-only hostile tests of the jobagent (issue 3): identity through NSS
//! from the static binary (libnss-extrausers), group policy, files opened
//! as the owner (symlinks, unwritable and unenterable directories), the
//! agent's environment and state directory, regaining root, the output cap,
//! oom_score_adj, processes that escape with `setsid` (with and without
//! cgroup v2), jobs left behind by an agent that was SIGKILLed, and
//! (issue 9) nothing of root's reaching a job: its session keyring, its
//! ignored signals, unlimited processes (fork bombs),
//! and root's answers about paths its owner cannot see.
//!
//! Run as root:
//! `cargo test -p vq-tests --test jobagent_security -- --include-ignored`.
//! `make test` runs them against the static musl agent (`VQ_JOBAGENT_BIN`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use vq_common::messages::Join;
use vq_common::topology::Role;
use vq_tests::harness::{
    broker_url, ensure_group, ensure_test_user, job, one_agent, require_root, start_agent_in,
    start_agent_wrapped, unique_cluster, wait_agent_up, ChildGuard, EventTap, OneAgent, TestBroker,
};

const POOL: &str = "sec";
const EVENT_WAIT: Duration = Duration::from_secs(30);

async fn setup(top_level: &str, env: &[(&str, &str)]) -> anyhow::Result<OneAgent> {
    one_agent(POOL, &format!("kill_grace_secs = 1\n{top_level}"), env).await
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn remove_outputs(home: &Path, name: &str, seq: &str) {
    let _ = std::fs::remove_file(home.join(format!("{name}.o{seq}")));
    let _ = std::fs::remove_file(home.join(format!("{name}.e{seq}")));
}

/// Pids of live processes of `uid` whose command line contains `needle`.
fn live_pids(uid: u32, needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let uid_ok = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .is_some_and(|u| u == uid.to_string());
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if uid_ok && !zombie && cmd.contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// Zombie children of `parent`.
fn zombies_of(parent: u32) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.parse::<u32>().is_err() {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{name}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first() == Some(&"Z") && f.get(1) == Some(&parent.to_string().as_str()) {
            out.push(stat);
        }
    }
    out
}

async fn wait_gone(uid: u32, needle: &str, timeout: Duration) -> Vec<i32> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = live_pids(uid, needle);
        if left.is_empty() || std::time::Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------ NSS

const EXT_USER: &str = "vqx-ext";
const EXT_UID: u32 = 2451;
const EXT_GROUP: &str = "vqx-extgrp";
const EXT_GID: u32 = 2452;

/// Adds `extrausers` to the passwd, group and initgroups sources of
/// /etc/nsswitch.conf (idempotent; harmless when its files do not list a
/// name) and an extrausers-only user with an extrausers-only group.
fn ensure_extrausers() -> anyhow::Result<PathBuf> {
    let have_module = || {
        [
            "/usr/lib/x86_64-linux-gnu",
            "/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .iter()
        .any(|d| Path::new(d).join("libnss_extrausers.so.2").exists())
    };
    if !have_module() {
        let st = Command::new("apt-get")
            .args(["install", "-y", "-q", "libnss-extrausers"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("apt-get install libnss-extrausers")?;
        if !st.success() || !have_module() {
            bail!("libnss-extrausers is needed for this test and could not be installed");
        }
    }
    let conf = std::fs::read_to_string("/etc/nsswitch.conf")?;
    let mut changed = false;
    let mut lines: Vec<String> = Vec::new();
    let mut seen_initgroups = false;
    for line in conf.lines() {
        let db = line.split(':').next().unwrap_or_default().trim();
        if ["passwd", "group", "initgroups"].contains(&db) && !line.starts_with('#') {
            seen_initgroups |= db == "initgroups";
            if !line.split_whitespace().any(|w| w == "extrausers") {
                lines.push(format!("{line} extrausers"));
                changed = true;
                continue;
            }
        }
        lines.push(line.to_string());
    }
    let _ = seen_initgroups; // without an initgroups line glibc uses group's sources
    if changed {
        let tmp = "/etc/nsswitch.conf.vq-tmp";
        std::fs::write(tmp, lines.join("\n") + "\n")?;
        std::fs::rename(tmp, "/etc/nsswitch.conf")?;
    }
    std::fs::create_dir_all("/var/lib/extrausers")?;
    let home = PathBuf::from(format!("/home/{EXT_USER}"));
    for (file, entries) in [
        (
            "/var/lib/extrausers/passwd",
            vec![format!(
                "{EXT_USER}:x:{EXT_UID}:{EXT_UID}:vq extrausers test:{}:/bin/bash",
                home.display()
            )],
        ),
        (
            "/var/lib/extrausers/group",
            vec![
                format!("{EXT_USER}:x:{EXT_UID}:"),
                format!("{EXT_GROUP}:x:{EXT_GID}:{EXT_USER}"),
            ],
        ),
    ] {
        let old = std::fs::read_to_string(file).unwrap_or_default();
        let names: Vec<&str> = entries
            .iter()
            .map(|e| e.split(':').next().unwrap_or_default())
            .collect();
        // Our entries replace any earlier version of them; others stay.
        let mut text: String = old
            .lines()
            .filter(|l| !names.contains(&l.split(':').next().unwrap_or_default()))
            .map(|l| format!("{l}\n"))
            .collect();
        for e in &entries {
            text.push_str(e);
            text.push('\n');
        }
        if text != old {
            std::fs::write(file, text)?;
        }
    }
    std::fs::create_dir_all(&home)?;
    nix::unistd::chown(
        &home,
        Some(nix::unistd::Uid::from_raw(EXT_UID)),
        Some(nix::unistd::Gid::from_raw(EXT_UID)),
    )?;
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    assert!(
        !passwd
            .lines()
            .any(|l| l.starts_with(&format!("{EXT_USER}:"))),
        "{EXT_USER} must exist only in extrausers"
    );
    let out = Command::new("getent").args(["passwd", EXT_USER]).output()?;
    if !out.status.success() {
        bail!("getent passwd {EXT_USER} does not see the extrausers user");
    }
    Ok(home)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_user_known_only_to_a_non_files_nss_source_runs_with_its_groups() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let home = ensure_extrausers()?;
    let mut s = setup("", &[]).await?;
    let mut j = job(
        POOL,
        EXT_USER,
        "extuser",
        "id -u\nid -g\nid -G\necho HOME=$HOME\n",
    );
    j.group = Some(EXT_GROUP.into());
    s.broker.publish_job(&j).await?;
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    let out = read(&home.join(format!("extuser.o{}", j.seq())));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], EXT_UID.to_string(), "{out}");
    assert_eq!(
        lines[1],
        EXT_GID.to_string(),
        "-W group from extrausers: {out}"
    );
    let groups: Vec<&str> = lines[2].split_whitespace().collect();
    assert!(groups.contains(&EXT_UID.to_string().as_str()), "{out}");
    assert!(groups.contains(&EXT_GID.to_string().as_str()), "{out}");
    assert!(!groups.contains(&"0"), "{out}");
    assert_eq!(lines[3], format!("HOME={}", home.display()));
    remove_outputs(&home, "extuser", j.seq());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

// ------------------------------------------------- identity and policy

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn hostile_owners_groups_and_variables_are_refused_with_reasons() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let wheel = ensure_test_user("vqt-wheel0", 2461)?;
    ensure_group("root", 0, &[&wheel.name])?;
    let denied = ensure_test_user("vqt-denied", 2462)?;
    ensure_group("vqt-badgrp", 3462, &[&denied.name])?;
    let mut s = setup("deny_groups = [\"vqt-badgrp\"]", &[]).await?;

    let numeric = job(POOL, "0", "numeric", "id -u");
    let dash = job(POOL, "-s", "dash", "id -u");
    let wheel_job = job(POOL, &wheel.name, "wheel", "id -G");
    let denied_job = job(POOL, &denied.name, "denied", "true");
    let mut root_group = job(POOL, &s.alice.name, "rootgrp", "id -g");
    root_group.group = Some("root".into());
    let mut eq_var = job(POOL, &s.alice.name, "eqvar", "true");
    eq_var.env.insert("A=B".into(), "x".into());
    let mut missing_dir = job(POOL, &s.alice.name, "nodir", "true");
    missing_dir.workdir = Some("/nonexistent/vq-workdir".into());
    let mut relative = job(POOL, &s.alice.name, "relout", "true");
    relative.stdout = Some("relative/out".into());
    for j in [
        &numeric,
        &dash,
        &wheel_job,
        &denied_job,
        &root_group,
        &eq_var,
        &missing_dir,
        &relative,
    ] {
        s.broker.publish_job(j).await?;
    }
    for (id, needle) in [
        (numeric.id.as_str(), "does not exist"),
        (dash.id.as_str(), "user database"),
        (wheel_job.id.as_str(), "group 0"),
        (denied_job.id.as_str(), "deny_groups"),
        (root_group.id.as_str(), "group"),
        (eq_var.id.as_str(), "variable name"),
        (relative.id.as_str(), "absolute"),
    ] {
        let ev = s.tap.job_event(id, "failed", EVENT_WAIT).await?;
        let reason = ev["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(needle), "{id}: {reason:?} lacks {needle:?}");
    }
    // The working directory is checked by the job's process, as the owner.
    let fin = s
        .tap
        .job_event(&missing_dir.id, "finished", EVENT_WAIT)
        .await?;
    assert_eq!(fin["outcome"]["kind"], "failed_to_start", "{fin}");
    let reason = fin["outcome"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("chdir to /nonexistent/vq-workdir as the owner")
            && reason.contains("No such file"),
        "{reason}"
    );
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn files_are_opened_as_the_owner_and_root_cannot_be_regained() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup(
        "",
        &[
            ("AGENT_SECRET_TOKEN", "leak"),
            ("LD_LIBRARY_PATH", "/agent-marker"),
        ],
    )
    .await?;
    let alice = s.alice.clone();
    let scratch = tempfile::tempdir()?;
    // A root-owned file the owner plants a symlink to.
    let precious = scratch.path().join("precious");
    std::fs::write(&precious, "precious\n")?;
    let planted = alice.home.join("planted.out");
    let _ = std::fs::remove_file(&planted);
    std::os::unix::fs::symlink(&precious, &planted)?;
    std::os::unix::fs::lchown(&planted, Some(alice.uid), Some(alice.gid))?;
    // A directory the owner can neither write nor enter.
    let locked = scratch.path().join("locked");
    std::fs::create_dir(&locked)?;
    std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    std::fs::set_permissions(
        scratch.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;

    let mut symlink_job = job(POOL, &alice.name, "symlink", "echo overwritten");
    symlink_job.stdout = Some(planted.display().to_string());
    symlink_job.join = Join::Oe;
    let mut unwritable = job(POOL, &alice.name, "unwritable", "echo x");
    unwritable.stdout = Some(scratch.path().join("out").display().to_string());
    let mut unenterable = job(POOL, &alice.name, "unenterable", "pwd");
    unenterable.workdir = Some(locked.display().to_string());
    unenterable.stdout = Some(alice.home.join("unenterable.out").display().to_string());
    unenterable.stderr = Some(alice.home.join("unenterable.err").display().to_string());
    let state_dir = s.agent.dir.path().join("state");
    // Open the way to the state dir so only its own mode protects it.
    std::fs::set_permissions(
        s.agent.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let script = format!(
        "echo uid=$(id -u) euid=$(id -u -r)\n\
         perl -e '$< = $> = 0; print(($< == 0 || $> == 0) ? \"SETUID-OK\\n\" : \"setuid-refused\\n\")'\n\
         su -c 'echo SU-OK' root </dev/null 2>/dev/null || echo su-refused\n\
         ls {} >/dev/null 2>&1 && echo STATE-READABLE || echo state-closed\n\
         env | sort\n",
        state_dir.display()
    );
    let mut hostile = job(POOL, &alice.name, "hostile", &script);
    hostile.env.insert("LD_PRELOAD".into(), "".into());
    for j in [&symlink_job, &unwritable, &unenterable, &hostile] {
        s.broker.publish_job(j).await?;
    }
    for (j, needle) in [
        (&symlink_job, "open stdout"),
        (&unwritable, "open stdout"),
        (&unenterable, "chdir"),
    ] {
        let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
        assert_eq!(fin["outcome"]["kind"], "failed_to_start", "{fin}");
        let reason = fin["outcome"]["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(needle), "{}: {reason}", j.name);
    }
    assert_eq!(
        read(&precious),
        "precious\n",
        "the symlink target is untouched"
    );
    assert!(!scratch.path().join("out").exists());
    let fin = s.tap.job_event(&hostile.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let out = read(&alice.home.join(format!("hostile.o{}", hostile.seq())));
    assert!(
        out.contains(&format!("uid={} euid={}", alice.uid, alice.uid)),
        "{out}"
    );
    for want in ["setuid-refused", "su-refused", "state-closed"] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
    for bad in ["SETUID-OK", "SU-OK", "STATE-READABLE"] {
        assert!(!out.contains(bad), "{bad}:\n{out}");
    }
    assert!(
        out.contains("\nLD_PRELOAD=\n"),
        "the job's own LD_PRELOAD passes:\n{out}"
    );
    for leak in ["AGENT_SECRET_TOKEN", "/agent-marker", "RUST_LOG", "VQ_"] {
        assert!(!out.contains(leak), "{leak} leaked into the job:\n{out}");
    }
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&state_dir)?.permissions());
    assert_eq!(mode & 0o777, 0o700, "state dir mode");
    let _ = std::fs::remove_file(&planted);
    remove_outputs(&alice.home, "hostile", hostile.seq());
    let _ = std::fs::remove_file(alice.home.join("unenterable.out"));
    let _ = std::fs::remove_file(alice.home.join("unenterable.err"));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_fifo_at_the_output_path_is_refused_and_jobs_inherit_no_agent_descriptors(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let alice = s.alice.clone();
    // A FIFO the owner planted: opening it for writing would block until
    // someone reads, before exec (outside walltime and cancel).
    let fifo = alice.home.join("planted.fifo");
    let _ = std::fs::remove_file(&fifo);
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    std::os::unix::fs::lchown(&fifo, Some(alice.uid), Some(alice.gid))?;
    let mut fifo_job = job(POOL, &alice.name, "fifo", "echo never");
    fifo_job.stdout = Some(fifo.display().to_string());
    fifo_job.join = Join::Oe;
    fifo_job.walltime = Some(5);
    // Every descriptor bash holds: 0-2, its script (255) and the memfd;
    // listed by a child with a plain redirect so that no pipe of the shell's
    // own shows up.
    let fds_job = job(
        POOL,
        &alice.name,
        "fds",
        "ls -l /proc/$$/fd/ > \"$HOME/fds.list\"\ncat \"$HOME/fds.list\"\n",
    );
    s.broker.publish_job(&fifo_job).await?;
    s.broker.publish_job(&fds_job).await?;
    let fin = s
        .tap
        .job_event(&fifo_job.id, "finished", EVENT_WAIT)
        .await?;
    assert_eq!(fin["outcome"]["kind"], "failed_to_start", "{fin}");
    let reason = fin["outcome"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("not a regular file"), "{reason}");
    let fin = s.tap.job_event(&fds_job.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let out = read(&alice.home.join(format!("fds.o{}", fds_job.seq())));
    let _ = std::fs::remove_file(alice.home.join("fds.list"));
    for line in out.lines().filter(|l| l.contains(" -> ")) {
        let (left, target) = line.split_once(" -> ").unwrap_or_default();
        let fd: u32 = left
            .rsplit(' ')
            .next()
            .unwrap_or("x")
            .parse()
            .unwrap_or(u32::MAX);
        assert!(
            fd <= 2 || fd == 255 || target.contains("memfd:vq-job-script"),
            "the job inherited a descriptor: {line}\n{out}"
        );
    }
    let _ = std::fs::remove_file(&fifo);
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    std::os::unix::fs::lchown(&fifo, Some(alice.uid), Some(alice.gid))?;
    let mut fifo_job = job(POOL, &alice.name, "fifo", "echo never");
    fifo_job.stdout = Some(fifo.display().to_string());
    fifo_job.join = Join::Oe;
    fifo_job.walltime = Some(5);
    // Every descriptor bash holds: 0-2, its script (255) and the memfd;
    // listed by a child with a plain redirect so that no pipe of the shell's
    // own shows up.
    let fds_job = job(
        POOL,
        &alice.name,
        "fds",
        "ls -l /proc/$$/fd/ > \"$HOME/fds.list\"\ncat \"$HOME/fds.list\"\n",
    );
    s.broker.publish_job(&fifo_job).await?;
    s.broker.publish_job(&fds_job).await?;
    let fin = s
        .tap
        .job_event(&fifo_job.id, "finished", EVENT_WAIT)
        .await?;
    assert_eq!(fin["outcome"]["kind"], "failed_to_start", "{fin}");
    let reason = fin["outcome"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("not a regular file"), "{reason}");
    let fin = s.tap.job_event(&fds_job.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["code"], 0, "{fin}");
    let out = read(&alice.home.join(format!("fds.o{}", fds_job.seq())));
    for line in out.lines().filter(|l| l.starts_with("fd ")) {
        let mut parts = line.split_whitespace().skip(1);
        let fd: u32 = parts.next().unwrap_or("x").parse().unwrap_or(u32::MAX);
        let target = parts.next().unwrap_or_default();
        assert!(
            fd <= 2 || fd == 255 || target.contains("memfd:vq-job-script"),
            "the job inherited a descriptor: {line}\n{out}"
        );
    }
    let _ = std::fs::remove_file(&fifo);
    remove_outputs(&alice.home, "fds", fds_job.seq());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

// --------------------------------------------------- process lifetime

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn output_over_the_cap_stops_the_job_and_oom_score_is_reset() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("max_output_bytes = 65536", &[]).await?;
    let agent_pid = s.agent.guard.id();
    let agent_oom = std::fs::read_to_string(format!("/proc/{agent_pid}/oom_score_adj"))?;
    // Lowering needs CAP_SYS_RESOURCE, which some containers withhold.
    let can_lower = Command::new("sh")
        .args(["-c", "echo -1000 > /proc/self/oom_score_adj"])
        .status()?
        .success();
    if can_lower {
        assert_eq!(agent_oom.trim(), "-1000", "the agent protects itself");
    } else {
        eprintln!(
            "oom_score_adj cannot be lowered here (no CAP_SYS_RESOURCE): agent at {}",
            agent_oom.trim()
        );
    }
    let job_oom = agent_oom.trim().parse::<i32>()?.max(0);

    let flood = job(POOL, &s.alice.name, "flood", "yes vq-flood-output\n");
    s.broker.publish_job(&flood).await?;
    let fin = s.tap.job_event(&flood.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "output_limit", "{fin}");
    assert!(
        wait_gone(s.alice.uid, "vq-flood-output", Duration::from_secs(3))
            .await
            .is_empty()
    );

    // The agent still runs jobs, and a job starts at oom_score_adj 0 and
    // cannot lower it.
    let oom = job(
        POOL,
        &s.alice.name,
        "oom",
        "cat /proc/self/oom_score_adj\n(echo -1000 > /proc/self/oom_score_adj) 2>/dev/null && echo LOWERED\ncat /proc/self/oom_score_adj\n",
    );
    s.broker.publish_job(&oom).await?;
    let fin = s.tap.job_event(&oom.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    let out = read(&s.alice.home.join(format!("oom.o{}", oom.seq())));
    assert_eq!(
        out,
        format!("{job_oom}\n{job_oom}\n"),
        "job oom_score_adj:\n{out}"
    );
    remove_outputs(&s.alice.home, "flood", flood.seq());
    remove_outputs(&s.alice.home, "oom", oom.seq());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

async fn escaped_processes_die_with_the_job(cgroups: bool) -> anyhow::Result<()> {
    let tag = if cgroups { 1301 } else { 1302 };
    let mut s = setup(&format!("cgroups = {cgroups}"), &[]).await?;
    let agent_pid = s.agent.guard.id();
    let script = format!(
        "setsid sleep {tag}1 &\n\
         ( setsid sh -c 'trap \"\" TERM; sleep {tag}2' & )\n\
         nohup sleep {tag}3 >/dev/null 2>&1 &\n\
         sleep 0.5\n\
         echo started\n"
    );
    let j = job(POOL, &s.alice.name, "escape", &script);
    s.broker.publish_job(&j).await?;
    let fin = s.tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    // The report comes after the leftovers are gone (grace 1 s).
    let left = live_pids(s.alice.uid, &format!("sleep {tag}"));
    assert!(left.is_empty(), "processes outlived the job: {left:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let z = zombies_of(agent_pid);
    assert!(z.is_empty(), "zombies of the agent: {z:?}");
    remove_outputs(&s.alice.home, "escape", j.seq());

    // Walltime with an escaped process ignoring SIGTERM.
    let mut w = job(
        POOL,
        &s.alice.name,
        "escwall",
        &format!("( setsid sh -c 'trap \"\" TERM; sleep {tag}4' & )\nsleep {tag}5\n"),
    );
    w.walltime = Some(1);
    s.broker.publish_job(&w).await?;
    let fin = s.tap.job_event(&w.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "walltime", "{fin}");
    let left = live_pids(s.alice.uid, &format!("sleep {tag}"));
    assert!(left.is_empty(), "processes outlived the walltime: {left:?}");
    remove_outputs(&s.alice.home, "escwall", w.seq());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn processes_that_escape_with_setsid_die_with_the_job_in_a_cgroup() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    escaped_processes_die_with_the_job(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn processes_that_escape_with_setsid_die_with_the_job_without_cgroups() -> anyhow::Result<()>
{
    if !require_root() {
        return Ok(());
    }
    escaped_processes_die_with_the_job(false).await
}

/// Starts the agent with a given state directory (so a restart finds the
/// records of the previous process).
fn start_agent_with_state(
    cluster: &str,
    agent_id: &str,
    dir: &Path,
    extra: &str,
) -> anyhow::Result<ChildGuard> {
    start_agent_in(
        &broker_url(Role::Agent)?,
        cluster,
        POOL,
        agent_id,
        &format!("kill_grace_secs = 1\n{extra}"),
        dir,
    )
}

async fn leftovers_of_a_killed_agent(cgroups: bool) -> anyhow::Result<()> {
    let tag = if cgroups { 1401 } else { 1402 };
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-k1");
    let dir = tempfile::tempdir()?;
    let extra = format!("cgroups = {cgroups}");
    let mut agent = start_agent_with_state(&cluster, &agent_id, dir.path(), &extra)?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let mut j = job(
        POOL,
        &alice.name,
        "orphaned",
        &format!("setsid sleep {tag}1 &\nsleep {tag}2\n"),
    );
    j.rerunnable = false;
    broker.publish_job(&j).await?;
    tap.job_event(&j.id, "started", EVENT_WAIT).await?;
    // Let the agent see the escaped process (checked every second).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    agent.signal(nix::sys::signal::Signal::SIGKILL);
    agent.wait_timeout(Duration::from_secs(5));
    // Without systemd's KillMode=control-group the job survives its agent...
    let alive = live_pids(alice.uid, &format!("sleep {tag}"));
    assert_eq!(
        alive.len(),
        2,
        "job processes after the agent died: {alive:?}"
    );
    // ...until an agent starts again with the same state directory.
    let _agent2 = start_agent_with_state(&cluster, &agent_id, dir.path(), &extra)?;
    let left = wait_gone(alice.uid, &format!("sleep {tag}"), Duration::from_secs(20)).await;
    assert!(left.is_empty(), "left over after the restart: {left:?}");
    let running: Vec<_> = std::fs::read_dir(dir.path().join("state").join("running"))?.collect();
    assert!(running.is_empty(), "records: {running:?}");
    remove_outputs(&alice.home, "orphaned", j.seq());
    drop(_agent2);
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_restarted_agent_kills_what_is_left_of_its_previous_jobs() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    leftovers_of_a_killed_agent(true).await?;
    leftovers_of_a_killed_agent(false).await
}

// ------------------------------------------- nothing of root's reaches a job

/// Installs keyutils (`keyctl`) when it is missing: the keyring test needs
/// it on the test host and inside the jobs (`apt-get install keyutils`).
fn ensure_keyctl() -> anyhow::Result<()> {
    let have = || {
        Command::new("sh")
            .args(["-c", "command -v keyctl"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if have() {
        return Ok(());
    }
    for step in [
        &["update", "-qq"][..],
        &["install", "-y", "-q", "keyutils"][..],
    ] {
        Command::new("apt-get")
            .args(step)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("apt-get install keyutils")?;
    }
    if !have() {
        bail!("keyutils (keyctl) is needed for this test and could not be installed");
    }
    Ok(())
}

/// Waits for the final event (`failed` or `finished`) of `id` and returns
/// its reason: the `failed` event's, or the `failed_to_start` outcome's.
async fn final_reason(tap: &mut EventTap, id: &str) -> anyhow::Result<String> {
    let ev = tap
        .wait_for(EVENT_WAIT, &format!("final event of {id}"), |k, v| {
            k.starts_with("job.") && vq_tests::harness::is_final_key(k) && v["job_id"] == id
        })
        .await?;
    Ok(ev["reason"]
        .as_str()
        .or(ev["outcome"]["reason"].as_str())
        .unwrap_or_default()
        .to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn every_job_gets_its_own_session_keyring_so_no_key_of_root_or_of_another_owner_is_seen(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    ensure_keyctl()?;
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let bob = ensure_test_user("vqt-keyb", 2471)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-key");
    // The agent runs in a session keyring that holds a key of root's, as
    // under systemd (the unit's keyring) or after a root login.
    let secret = format!("root-secret-{:08x}", rand::random::<u32>());
    let add = format!("keyctl add user vq-root-key {secret} @s >/dev/null && exec \"$@\"");
    let agent = start_agent_wrapped(
        &cluster,
        POOL,
        &agent_id,
        "kill_grace_secs = 1",
        &[],
        &[
            "keyctl",
            "session",
            "-",
            "sh",
            "-c",
            &add,
            "vq-keyring-wrap",
        ],
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;

    let probe = |key: &str, tag: &str| {
        format!(
            "if id=$(keyctl search @s user {key} 2>/dev/null); then echo {tag}-FOUND; keyctl print \"$id\"; else echo {tag}-hidden; fi\n\
             grep -q ' {key}: ' /proc/keys && echo {tag}-LISTED || echo {tag}-unlisted\n"
        )
    };
    let a = job(
        POOL,
        &alice.name,
        "keya",
        &format!(
            "{}keyctl add user vq-alice-key alice-secret @s >/dev/null && echo alice-key-added\n",
            probe("vq-root-key", "root")
        ),
    );
    broker.publish_job(&a).await?;
    let fin = tap.job_event(&a.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    let out_a = read(&alice.home.join(format!("keya.o{}", a.seq())));
    let b = job(
        POOL,
        &bob.name,
        "keyb",
        &format!(
            "{}{}",
            probe("vq-alice-key", "alice"),
            probe("vq-root-key", "root")
        ),
    );
    broker.publish_job(&b).await?;
    let fin = tap.job_event(&b.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    let out_b = read(&bob.home.join(format!("keyb.o{}", b.seq())));
    for (out, want) in [
        (&out_a, "root-hidden\nroot-unlisted\nalice-key-added\n"),
        (
            &out_b,
            "alice-hidden\nalice-unlisted\nroot-hidden\nroot-unlisted\n",
        ),
    ] {
        assert!(!out.contains(&secret), "root's key reached a job:\n{out}");
        assert_eq!(out.as_str(), want, "job output");
    }
    remove_outputs(&alice.home, "keya", a.seq());
    remove_outputs(&bob.home, "keyb", b.seq());
    drop(agent);
    broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_job_of_an_agent_started_with_signals_ignored_starts_with_default_signals_and_no_mask(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-sig");
    // As `nohup` or a background start from a script would leave them.
    let agent = start_agent_wrapped(
        &cluster,
        POOL,
        &agent_id,
        "kill_grace_secs = 1",
        &[],
        &[
            "sh",
            "-c",
            "trap '' HUP QUIT USR2 PIPE; exec \"$@\"",
            "vq-nohup-wrap",
        ],
    )?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.guard.id()))?;
    let ignored = status
        .lines()
        .find(|l| l.starts_with("SigIgn:"))
        .unwrap_or_default()
        .to_string();
    wait_agent_up(&mut tap, &agent_id).await?;
    let j = job(
        POOL,
        &alice.name,
        "signals",
        "grep -E '^Sig(Ign|Blk):' /proc/self/status\n",
    );
    broker.publish_job(&j).await?;
    let fin = tap.job_event(&j.id, "finished", EVENT_WAIT).await?;
    assert_eq!(fin["outcome"]["kind"], "exited", "{fin}");
    let out = read(&alice.home.join(format!("signals.o{}", j.seq())));
    assert_eq!(
        out, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n",
        "the agent ran with {ignored}"
    );
    remove_outputs(&alice.home, "signals", j.seq());
    drop(agent);
    broker.cleanup().await;
    Ok(())
}

async fn a_fork_bomb_stops_at_the_process_limit(cgroups: bool) -> anyhow::Result<()> {
    const LIMIT: usize = 20;
    const TRIES: usize = 200;
    let forker = ensure_test_user("vqt-forker", 2472)?;
    let mut s = setup(&format!("cgroups = {cgroups}\njob_pids_max = {LIMIT}"), &[]).await?;
    // Forks children that sleep until it fails or reaches TRIES, reports the
    // count, then waits to be cancelled.
    let script = format!(
        "exec perl -e '$0 = \"vq-forkbomb\"; $| = 1; $n = 0;\n\
         for (1..{TRIES}) {{ $p = fork; last unless defined $p; if ($p == 0) {{ sleep 120; exit 0 }} $n++ }}\n\
         print \"forked $n\\n\"; sleep 120'\n"
    );
    let j = job(POOL, &forker.name, "forkbomb", &script);
    s.broker.publish_job(&j).await?;
    s.tap.job_event(&j.id, "started", EVENT_WAIT).await?;
    let out_path = forker.home.join(format!("forkbomb.o{}", j.seq()));
    // Synchronise on the job's report (it prints once its forks are done).
    let deadline = std::time::Instant::now() + EVENT_WAIT;
    let out = loop {
        let out = std::fs::read_to_string(&out_path).unwrap_or_default();
        if out.ends_with('\n') || std::time::Instant::now() >= deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let forked: usize = out
        .trim()
        .strip_prefix("forked ")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("job output {out:?}"))?;
    eprintln!("cgroups = {cgroups}: {forked} of {TRIES} forks succeeded (job_pids_max = {LIMIT})");
    assert!(
        forked < LIMIT,
        "cgroups = {cgroups}: {forked} forks succeeded with job_pids_max = {LIMIT}"
    );
    // The agent (root, outside the job's limit) still cancels and reports.
    s.broker
        .publish_control(
            &s.agent.agent_id,
            &vq_common::messages::Control::Cancel {
                job_id: j.id.clone(),
            },
        )
        .await?;
    s.tap.job_event(&j.id, "cancelled", EVENT_WAIT).await?;
    let left = live_pids(forker.uid, "vq-forkbomb");
    assert!(left.is_empty(), "processes outlived the job: {left:?}");
    remove_outputs(&forker.home, "forkbomb", j.seq());
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_fork_bomb_stops_at_job_pids_max_and_the_agent_still_cancels_it() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    // With cgroups: pids.max where the pids controller is delegated, else
    // RLIMIT_NPROC; without: RLIMIT_NPROC.
    a_fork_bomb_stops_at_the_process_limit(true).await?;
    a_fork_bomb_stops_at_the_process_limit(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn workdir_and_shell_paths_the_owner_cannot_reach_fail_alike_whether_or_not_they_exist(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut s = setup("", &[]).await?;
    let alice = s.alice.clone();
    // A directory only root can enter, like /root, holding a directory and
    // a shell the owner must not learn about.
    let private = tempfile::Builder::new()
        .prefix("vq-private-")
        .tempdir_in("/root")?;
    std::fs::set_permissions(
        private.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )?;
    let exists = private.path().join("exists");
    std::fs::create_dir(&exists)?;
    let shell = private.path().join("sh");
    std::fs::copy("/bin/sh", &shell)?;
    let (missing, no_shell) = (private.path().join("missing"), private.path().join("nosh"));
    let mut jobs = Vec::new();
    for (what, path) in [
        ("wd", &exists),
        ("wd", &missing),
        ("sh", &shell),
        ("sh", &no_shell),
    ] {
        let mut j = job(POOL, &alice.name, &format!("probe{what}"), "echo ran");
        if what == "wd" {
            j.workdir = Some(path.display().to_string());
            j.stdout = Some(alice.home.join("probe.out").display().to_string());
            j.stderr = Some(alice.home.join("probe.err").display().to_string());
        } else {
            j.shell = Some(path.display().to_string());
        }
        s.broker.publish_job(&j).await?;
        jobs.push((j, path.display().to_string()));
    }
    let mut reasons = Vec::new();
    for (j, path) in &jobs {
        let reason = final_reason(&mut s.tap, &j.id).await?;
        assert!(
            !reason.contains("does not exist"),
            "{path}: {reason:?} says whether it exists"
        );
        reasons.push(reason.replace(path.as_str(), "<path>"));
    }
    assert_eq!(reasons[0], reasons[1], "workdir reasons differ");
    assert_eq!(reasons[2], reasons[3], "shell reasons differ");
    for (j, _) in &jobs {
        remove_outputs(&alice.home, &j.name, j.seq());
    }
    let _ = std::fs::remove_file(alice.home.join("probe.out"));
    let _ = std::fs::remove_file(alice.home.join("probe.err"));
    drop(s.agent);
    s.broker.cleanup().await;
    Ok(())
}
