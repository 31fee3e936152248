//! What outlives an agent that dies: the record of each running job in
//! `<state_dir>/running/<pid>.json`, and the next agent's reaping of what
//! is left of those jobs (module doc of [`super`], "When the agent itself
//! dies").

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::cgroup::{cgroup_kill, cgroup_pids};
use super::procs::{all_pids, pin_found, proc_stat, proc_uid, ProcStat};
/// Creates `dir` (0700, owned by root) or tightens its mode.
pub(super) fn secure_dir(dir: &Path) {
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        warn!(path = %dir.display(), error = %e, "cannot create directory");
        return;
    }
    let _ = nix::unistd::chown(dir, Some(nix::unistd::Uid::from_raw(0)), None);
    if let Ok(meta) = std::fs::metadata(dir) {
        if meta.permissions().mode() & 0o077 != 0 {
            warn!(path = %dir.display(), "state directory was accessible to others: now 0700");
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
    }
}

/// What a restarted agent needs to kill what is left of a job.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) job_id: String,
    pub(super) pid: i32,
    pub(super) starttime: u64,
    pub(super) uid: u32,
    pub(super) cgroup: Option<PathBuf>,
    /// Without a cgroup: the job's processes (pid, start time) last seen,
    /// so processes that escaped with `setsid` are found after a restart.
    #[serde(default)]
    pub(super) members: Vec<(i32, u64)>,
}

pub(super) fn record_path(dir: &Path, pid: Pid) -> PathBuf {
    dir.join("running").join(format!("{}.json", pid.as_raw()))
}

pub(super) fn write_record(dir: &Path, rec: &Record) {
    let path = record_path(dir, Pid::from_raw(rec.pid));
    let body = serde_json::to_vec(rec).unwrap_or_default();
    if let Err(e) = std::fs::write(&path, body) {
        warn!(path = %path.display(), error = %e, "cannot record the running job; a restarted agent will not find it");
    }
}

/// Directory of `state_dir` holding the records of a previous agent's jobs
/// while their leftovers are killed: they are no running jobs any more, and
/// a recovery interrupted by a crash is completed by the next start.
pub(super) const REAPING: &str = "reaping";

/// Kills what is left of the jobs recorded in `<state_dir>/running` by a
/// previous agent and removes the records. Each record is first moved to
/// `<state_dir>/reaping` (an atomic rename), so `running/` never lists a
/// job whose processes are already dead, and the record is removed once
/// the kill is done.
pub(super) fn recover_leftovers(state_dir: &Path) {
    let running = state_dir.join("running");
    let reaping = state_dir.join(REAPING);
    if let Ok(dir) = std::fs::read_dir(&running) {
        for entry in dir.flatten() {
            if let Err(e) = std::fs::rename(entry.path(), reaping.join(entry.file_name())) {
                warn!(path = %entry.path().display(), error = %e, "cannot move the record of a previous agent's job; it is removed after the kill");
                reap(&entry.path());
            }
        }
    }
    let Ok(dir) = std::fs::read_dir(&reaping) else {
        return;
    };
    for entry in dir.flatten() {
        reap(&entry.path());
    }
}

/// Kills what is left of the job recorded at `path` and removes the record.
pub(super) fn reap(path: &Path) {
    let rec: Option<Record> = std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if let Some(rec) = rec {
        let mut killed = 0;
        match &rec.cgroup {
            Some(cg) if cg.is_dir() => {
                for _ in 0..50 {
                    let pids = cgroup_pids(cg);
                    if pids.is_empty() {
                        break;
                    }
                    killed = killed.max(pids.len());
                    cgroup_kill(cg);
                    std::thread::sleep(Duration::from_millis(100));
                }
                let _ = std::fs::remove_dir(cg);
            }
            _ => {
                let leader_alive =
                    proc_stat(rec.pid).is_some_and(|st| st.starttime == rec.starttime);
                let mut stats: BTreeMap<i32, ProcStat> = BTreeMap::new();
                for pid in all_pids() {
                    if let Some(st) = proc_stat(pid) {
                        stats.insert(pid, st);
                    }
                }
                let mut doomed: BTreeSet<i32> = stats
                    .iter()
                    .filter(|(pid, st)| {
                        let known = rec
                            .members
                            .iter()
                            .any(|(p, start)| p == *pid && *start == st.starttime);
                        let in_session = (st.session == rec.pid || st.pgrp == rec.pid)
                            && (leader_alive || **pid != rec.pid)
                            && proc_uid(**pid) == Some(rec.uid);
                        known || in_session
                    })
                    .map(|(pid, _)| *pid)
                    .collect();
                loop {
                    let more: Vec<i32> = stats
                        .iter()
                        .filter(|(pid, st)| doomed.contains(&st.ppid) && !doomed.contains(pid))
                        .map(|(pid, _)| *pid)
                        .collect();
                    if more.is_empty() {
                        break;
                    }
                    doomed.extend(more);
                }
                doomed.remove(&(std::process::id() as i32));
                let pinned = pin_found(
                    doomed
                        .iter()
                        .filter_map(|p| Some((*p, stats.get(p)?.starttime))),
                );
                for p in &pinned {
                    p.signal(Signal::SIGKILL);
                }
                killed = pinned.len();
            }
        }
        warn!(job_id = %rec.job_id, pid = rec.pid, processes = killed, "killed what was left of a job of a previous agent");
    }
    let _ = std::fs::remove_file(path);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_recovery_removes_stale_ones() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("running")).unwrap();
        std::fs::create_dir(dir.path().join(REAPING)).unwrap();
        let rec = Record {
            job_id: "1-x".into(),
            pid: 999_999_999,
            starttime: 1,
            uid: 4242,
            cgroup: None,
            members: vec![(999_999_998, 5)],
        };
        write_record(dir.path(), &rec);
        let path = record_path(dir.path(), Pid::from_raw(rec.pid));
        assert!(path.exists());
        recover_leftovers(dir.path());
        assert!(!path.exists());
        let reaping = std::fs::read_dir(dir.path().join(REAPING)).unwrap().count();
        assert_eq!(reaping, 0, "records left in {REAPING}/");
    }
}
