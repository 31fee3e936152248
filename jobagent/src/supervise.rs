//! Process lifetime of jobs: start one in its own session (and cgroup v2
//! when available), wait for it on a blocking thread, enforce walltime on
//! the monotonic clock, honour cancel, cap its output, and make sure no
//! process of the job outlives it.
//!
//! # How the processes of a job are found
//! - **cgroup v2** (preferred): at start the agent finds its own cgroup
//!   (`/proc/self/cgroup` line `0::PATH` under the cgroup2 mount from
//!   `/proc/self/mountinfo`; with systemd this needs `Delegate=yes`). Each
//!   job gets `<agent cgroup>/vq-job-<agent pid>-<n>`, joined by the child
//!   before it drops privileges, with optional `memory.max` and `cpu.max`,
//!   and `pids.max` = `job_pids_max` when the pids controller is available
//!   (else the child sets `RLIMIT_NPROC`, as without a cgroup).
//!   SIGTERM goes to every process in `cgroup.procs`; SIGKILL is
//!   `cgroup.kill` (Linux 5.14; before it, SIGKILL goes the SIGTERM way).
//!   If the agent's cgroup holds the agent itself and a controller must be
//!   enabled, the agent first moves itself into `<agent cgroup>/vq-agent`
//!   (cgroup v2's no-internal-processes rule).
//! - **fallback** (no writable cgroup2, or `cgroups = false`): the job's
//!   process group and session (the leader calls `setsid`), plus, because
//!   the agent is a child subreaper (`PR_SET_CHILD_SUBREAPER`), every
//!   process of the owner's uid that was orphaned to the agent, plus all
//!   their descendants. A process that escaped with `setsid` and whose
//!   parent died is therefore found. Limitation: with two jobs of the same
//!   owner running at once, an orphan of one is also attributed to the
//!   other (use cgroups to avoid it).
//!
//! # How processes are signalled
//! Never by a bare pid read earlier: every process found (in
//! `cgroup.procs` or by the `/proc` scan) is pinned by a pidfd
//! (`pidfd_open`, Linux 5.3) and kept only if `/proc` read *after* the open
//! still shows it as the job's (in the job's cgroup, or with the start time
//! the scan saw) while the pidfd's process is still running; the signal then
//! goes through `pidfd_send_signal`, so a process that ended meanwhile gets
//! nothing and a process that got its pid is never signalled. The leader's
//! process group is signalled with `killpg` only while the leader is
//! unreaped (its pid, the group id, cannot be reused then). Only kernels
//! without `pidfd_open` fall back to `kill(2)` right after the check.
//!
//! # How a job ends
//! The job ends when its main process (the shell) exits. Any process of the
//! job still alive then gets SIGTERM, and SIGKILL after `kill_grace_secs`;
//! the report waits until they are gone. Walltime, cancel and the output
//! cap send SIGTERM to every process of the job, then SIGKILL after the
//! grace. Zombies of orphans (reparented to the agent) are reaped by a
//! sweep that skips registered job leaders ([`crate::spawn::leaders`]) and
//! root-owned children (the agent's own `getent` helpers, which std waits
//! for), so `wait4` on a leader never races into `ECHILD`.
//!
//! # When the agent itself dies
//! Each running job is recorded in `<state_dir>/running/<pid>.json` (leader
//! pid and start time, owner uid, cgroup). Under systemd the unit's
//! default `KillMode=control-group` kills the jobs with the agent. Without
//! it the jobs keep running, orphaned to init; the next agent started with
//! the same `state_dir` kills what is left of them ([`prepare_host`]),
//! as DESIGN.md's *recover* rule demands, and their deliveries follow the
//! lease rules.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vq_common::config::AgentConfig;
use vq_common::messages::{Outcome, Usage};

use crate::error::{chain, LaunchError};
use crate::output;
use crate::plan::{LaunchPlan, CPU_PERIOD_US};
use crate::spawn::{leaders, spawn, wait_child, OutputStream, Reaped, AGENT_OOM_SCORE_ADJ};

/// How often zombies are swept (and, without a cgroup, the job's
/// processes recorded).
pub const TICK: Duration = Duration::from_secs(1);

/// Name of the leaf cgroup the agent moves itself into when it must enable
/// controllers in its own cgroup.
const AGENT_LEAF: &str = "vq-agent";

/// Why the agent stopped a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Walltime,
    Cancelled,
    OutputLimit,
}

/// Host-wide facts and setup, decided once per agent process.
#[derive(Debug)]
struct Host {
    agent_pid: i32,
    cgroup_base: Option<PathBuf>,
    /// Serialises enabling controllers and moving the agent.
    controllers: Mutex<()>,
}

static HOST: OnceLock<Host> = OnceLock::new();
static JOB_SEQ: AtomicU64 = AtomicU64::new(0);

fn host(cgroups: bool) -> &'static Host {
    HOST.get_or_init(|| {
        if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
            warn!(error = %e, "cannot become a child subreaper; escaped job processes are found by uid only");
        }
        if let Err(e) = std::fs::write("/proc/self/oom_score_adj", AGENT_OOM_SCORE_ADJ.to_string()) {
            warn!(error = %e, "cannot set the agent's oom_score_adj");
        }
        let cgroup_base = if cgroups { detect_cgroup() } else { None };
        match &cgroup_base {
            Some(p) => info!(cgroup = %p.display(), "jobs run in their own cgroup v2"),
            None => info!("no writable cgroup v2 (or cgroups = false): jobs are tracked by session, process group and subreaper"),
        }
        Host {
            agent_pid: std::process::id() as i32,
            cgroup_base,
            controllers: Mutex::new(()),
        }
    })
}

/// Prepares the host once, at agent start: child subreaper, the agent's
/// `oom_score_adj` ([`AGENT_OOM_SCORE_ADJ`]), cgroup detection, a
/// root-only (0700) `state_dir` and its `running/` and `reaping/`
/// directories, and kills what is left of jobs of a previous agent recorded
/// there. Runs before any session, so before a lease of a previous agent
/// is recovered (run again here or failed): a job run again never shares
/// the host with what is left of its previous run.
pub fn prepare_host(cfg: &AgentConfig) {
    host(cfg.cgroups);
    secure_dir(&cfg.state_dir);
    secure_dir(&cfg.state_dir.join("running"));
    secure_dir(&cfg.state_dir.join(REAPING));
    recover_leftovers(&cfg.state_dir);
    if let Some(base) = &host(cfg.cgroups).cgroup_base {
        remove_stale_cgroups(base);
    }
}

/// Removes empty job cgroups of agent processes that no longer exist (an
/// agent killed between a job's end and its cgroup's removal). Non-empty
/// ones are left to the recovery of their own agent's state directory.
fn remove_stale_cgroups(base: &Path) {
    let Ok(dir) = std::fs::read_dir(base) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("vq-job-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if cgroup_pids(&entry.path()).is_empty() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

fn secure_dir(dir: &Path) {
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

// ---------------------------------------------------------------- /proc

/// One line of `/proc/<pid>/stat` that matters here.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    state: char,
    ppid: i32,
    pgrp: i32,
    session: i32,
    starttime: u64,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and ')': parse after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        session: f.get(3)?.parse().ok()?,
        starttime: f.get(19)?.parse().ok()?,
    })
}

fn proc_uid(pid: i32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn all_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Reaps zombie children of the agent that are not job leaders and not
/// root-owned (see the module docs). Returns how many were reaped.
fn sweep_zombies(agent_pid: i32) -> usize {
    let leaders = leaders();
    let mut reaped = 0;
    for pid in all_pids() {
        if leaders.contains(&pid) {
            continue;
        }
        let Some(st) = proc_stat(pid) else { continue };
        if st.ppid != agent_pid || st.state != 'Z' || proc_uid(pid).unwrap_or(0) == 0 {
            continue;
        }
        if let Ok(status) = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            if status.pid().is_some() {
                reaped += 1;
            }
        }
    }
    reaped
}

/// Live (non-zombie) processes of a job without a cgroup, as `(pid, start
/// time)`: its process group and session, orphans of `uid` reparented to
/// the agent, and all their descendants.
fn fallback_members(leader: i32, uid: u32, agent_pid: i32) -> Vec<(i32, u64)> {
    let leaders = leaders().clone();
    let mut stats: BTreeMap<i32, ProcStat> = BTreeMap::new();
    for pid in all_pids() {
        if let Some(st) = proc_stat(pid) {
            stats.insert(pid, st);
        }
    }
    let mut members: BTreeSet<i32> = stats
        .iter()
        .filter(|(pid, st)| {
            st.pgrp == leader
                || st.session == leader
                || (st.ppid == agent_pid && !leaders.contains(pid) && proc_uid(**pid) == Some(uid))
        })
        .map(|(pid, _)| *pid)
        .collect();
    loop {
        let more: Vec<i32> = stats
            .iter()
            .filter(|(pid, st)| members.contains(&st.ppid) && !members.contains(pid))
            .map(|(pid, _)| *pid)
            .collect();
        if more.is_empty() {
            break;
        }
        members.extend(more);
    }
    members
        .into_iter()
        .filter(|p| *p != agent_pid)
        .filter_map(|p| {
            let st = stats.get(&p)?;
            (st.state != 'Z').then_some((p, st.starttime))
        })
        .collect()
}

// -------------------------------------------------------------- cgroups

fn detect_cgroup() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        post.starts_with("cgroup2 ")
            .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut base = mount.join(rel.trim_start_matches('/'));
    if base.file_name().is_some_and(|n| n == AGENT_LEAF) {
        base.pop();
    }
    let probe = base.join(format!("vq-probe-{}", std::process::id()));
    match std::fs::create_dir(&probe) {
        Ok(()) => {
            let _ = std::fs::remove_dir(&probe);
            Some(base)
        }
        Err(e) => {
            info!(cgroup = %base.display(), error = %e, "cgroup v2 not writable");
            None
        }
    }
}

fn write_file(path: &Path, value: &str) -> std::io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

fn cg_err(what: String) -> impl FnOnce(std::io::Error) -> LaunchError {
    move |source| LaunchError::Cgroup { what, source }
}

/// Enables `controllers` (e.g. `memory`) for the children of `base`,
/// moving the agent into [`AGENT_LEAF`] first if `base` holds processes.
fn enable_controllers(host: &Host, base: &Path, controllers: &[&str]) -> Result<(), LaunchError> {
    let _guard = host.controllers.lock().unwrap_or_else(|e| e.into_inner());
    let enabled = std::fs::read_to_string(base.join("cgroup.subtree_control")).unwrap_or_default();
    let available = std::fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
    for c in controllers {
        if enabled.split_whitespace().any(|e| e == *c) {
            continue;
        }
        if !available.split_whitespace().any(|e| e == *c) {
            return Err(LaunchError::Cgroup {
                what: format!(
                    "controller {c} is not available in {} (a limit is configured, so the job does not run without it)",
                    base.display()
                ),
                source: std::io::Error::from_raw_os_error(nix::libc::ENOENT),
            });
        }
        let control = base.join("cgroup.subtree_control");
        match write_file(&control, &format!("+{c}")) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(nix::libc::EBUSY) => {
                let leaf = base.join(AGENT_LEAF);
                let _ = std::fs::create_dir(&leaf);
                write_file(&leaf.join("cgroup.procs"), "0")
                    .map_err(cg_err(format!("move the agent into {}", leaf.display())))?;
                info!(cgroup = %leaf.display(), "agent moved into its own leaf cgroup");
                write_file(&control, &format!("+{c}"))
                    .map_err(cg_err(format!("enable {c} in {}", control.display())))?;
            }
            Err(e) => {
                return Err(cg_err(format!("enable {c} in {}", control.display()))(e));
            }
        }
    }
    Ok(())
}

/// The cgroup of one job.
#[derive(Debug)]
struct JobCgroup {
    path: PathBuf,
    procs: OwnedFd,
    /// Whether `pids.max` enforces the job's process limit.
    pids_max: bool,
}

impl JobCgroup {
    fn create(host: &Host, base: &Path, plan: &LaunchPlan) -> Result<Self, LaunchError> {
        let mut wanted = Vec::new();
        if plan.memory_max_bytes > 0 {
            wanted.push("memory");
        }
        if plan.cpu_quota_us > 0 {
            wanted.push("cpu");
        }
        // The process limit always applies; without the pids controller the
        // child enforces it with RLIMIT_NPROC instead.
        let available =
            std::fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
        let pids_max = available.split_whitespace().any(|c| c == "pids");
        if pids_max {
            wanted.push("pids");
        }
        if !wanted.is_empty() {
            enable_controllers(host, base, &wanted)?;
        }
        let path = base.join(format!(
            "vq-job-{}-{}",
            host.agent_pid,
            JOB_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&path).map_err(cg_err(format!("mkdir {}", path.display())))?;
        let remove = |e: LaunchError| {
            let _ = std::fs::remove_dir(&path);
            e
        };
        if plan.memory_max_bytes > 0 {
            write_file(&path.join("memory.max"), &plan.memory_max_bytes.to_string())
                .map_err(cg_err(format!("set memory.max of {}", path.display())))
                .map_err(remove)?;
            // No swap beyond the limit either, where swap accounting exists.
            let _ = write_file(&path.join("memory.swap.max"), "0");
        }
        if plan.cpu_quota_us > 0 {
            write_file(
                &path.join("cpu.max"),
                &format!("{} {CPU_PERIOD_US}", plan.cpu_quota_us),
            )
            .map_err(cg_err(format!("set cpu.max of {}", path.display())))
            .map_err(remove)?;
        }
        if pids_max {
            write_file(&path.join("pids.max"), &plan.pids_max.to_string())
                .map_err(cg_err(format!("set pids.max of {}", path.display())))
                .map_err(remove)?;
        }
        let procs = OpenOptions::new()
            .write(true)
            .open(path.join("cgroup.procs"))
            .map_err(cg_err(format!("open {}/cgroup.procs", path.display())))
            .map_err(remove)?;
        Ok(JobCgroup {
            path,
            procs: procs.into(),
            pids_max,
        })
    }
}

fn cgroup_pids(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// SIGKILL to every process of the cgroup at `path`: `cgroup.kill` (Linux
/// 5.14), else through pidfds of its listed members (callers loop).
fn cgroup_kill(path: &Path) {
    if write_file(&path.join("cgroup.kill"), "1").is_err() {
        for p in cgroup_procs(path) {
            p.signal(Signal::SIGKILL);
        }
    }
}

/// The processes listed in the cgroup at `path`, each pinned by a pidfd
/// and checked (after the open) to be in that cgroup.
fn cgroup_procs(path: &Path) -> Vec<JobProc> {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    cgroup_pids(path)
        .into_iter()
        .filter_map(|pid| JobProc::open(pid, |p| in_cgroup(p, &name)))
        .collect()
}

/// Whether the cgroup v2 of `pid` is the one named `name` (job cgroups
/// have agent-unique names and no children).
fn in_cgroup(pid: i32, name: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|t| {
        t.lines()
            .filter_map(|l| l.strip_prefix("0::"))
            .any(|rel| rel.trim_end().rsplit('/').next() == Some(name))
    })
}

// ----------------------------------------------------------- signalling

/// A process of a job, pinned by a pidfd opened when it was found, so a
/// signal never reaches another process that got its pid later.
#[derive(Debug)]
struct JobProc {
    pid: i32,
    /// `None` only on kernels without `pidfd_open` (before 5.3).
    fd: Option<OwnedFd>,
}

impl JobProc {
    /// Opens a pidfd for `pid` and keeps it if `is_it(pid)` (which reads
    /// `/proc/<pid>`) holds **after** the open and the pidfd's process has
    /// still not exited after that check: what `is_it` read was then the
    /// pidfd's process, not a successor with the recycled pid.
    fn open(pid: i32, is_it: impl Fn(i32) -> bool) -> Option<Self> {
        let rpid = rustix::process::Pid::from_raw(pid)?;
        match rustix::process::pidfd_open(rpid, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => (is_it(pid) && !pidfd_exited(&fd)).then_some(JobProc { pid, fd: Some(fd) }),
            Err(rustix::io::Errno::NOSYS) => is_it(pid).then_some(JobProc { pid, fd: None }),
            Err(_) => None,
        }
    }

    /// Sends `sig` through the pidfd (a process that ended meanwhile gets
    /// nothing: `ESRCH`).
    fn signal(&self, sig: Signal) {
        match (
            &self.fd,
            rustix::process::Signal::from_named_raw(sig as i32),
        ) {
            (Some(fd), Some(rsig)) => {
                let _ = rustix::process::pidfd_send_signal(fd, rsig);
            }
            // Kernels before 5.3 only: the pid was checked just now.
            _ => {
                let _ = kill(Pid::from_raw(self.pid), sig);
            }
        }
    }
}

/// Whether the process of `pidfd` has exited (a pidfd polls readable then).
fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    !matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
}

/// Pins the processes `(pid, starttime)` found by a `/proc` scan: each one
/// whose pid still belongs to a live process started at that time.
fn pin_found(found: impl IntoIterator<Item = (i32, u64)>) -> Vec<JobProc> {
    found
        .into_iter()
        .filter_map(|(pid, start)| {
            JobProc::open(pid, |p| {
                proc_stat(p).is_some_and(|st| st.starttime == start && st.state != 'Z')
            })
        })
        .collect()
}

// ------------------------------------------------------------- records

/// What a restarted agent needs to kill what is left of a job.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    job_id: String,
    pid: i32,
    starttime: u64,
    uid: u32,
    cgroup: Option<PathBuf>,
    /// Without a cgroup: the job's processes (pid, start time) last seen,
    /// so processes that escaped with `setsid` are found after a restart.
    #[serde(default)]
    members: Vec<(i32, u64)>,
}

fn record_path(dir: &Path, pid: Pid) -> PathBuf {
    dir.join("running").join(format!("{}.json", pid.as_raw()))
}

fn write_record(dir: &Path, rec: &Record) {
    let path = record_path(dir, Pid::from_raw(rec.pid));
    let body = serde_json::to_vec(rec).unwrap_or_default();
    if let Err(e) = std::fs::write(&path, body) {
        warn!(path = %path.display(), error = %e, "cannot record the running job; a restarted agent will not find it");
    }
}

/// Directory of `state_dir` holding the records of a previous agent's jobs
/// while their leftovers are killed: they are no running jobs any more, and
/// a recovery interrupted by a crash is completed by the next start.
const REAPING: &str = "reaping";

/// Kills what is left of the jobs recorded in `<state_dir>/running` by a
/// previous agent and removes the records. Each record is first moved to
/// `<state_dir>/reaping` (an atomic rename), so `running/` never lists a
/// job whose processes are already dead, and the record is removed once
/// the kill is done.
fn recover_leftovers(state_dir: &Path) {
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
fn reap(path: &Path) {
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

// ------------------------------------------------------------ the job

/// The processes of one running job and how to signal them.
struct Members<'a> {
    host: &'a Host,
    leader: Pid,
    uid: u32,
    cgroup: Option<&'a JobCgroup>,
}

impl Members<'_> {
    /// Pids of the job's processes now (for counting and records).
    fn live(&self) -> Vec<i32> {
        match self.cgroup {
            Some(cg) => cgroup_pids(&cg.path),
            None => fallback_members(self.leader.as_raw(), self.uid, self.host.agent_pid)
                .into_iter()
                .map(|(pid, _)| pid)
                .collect(),
        }
    }

    /// The job's processes now, pinned by pidfds for signalling.
    fn pinned(&self) -> Vec<JobProc> {
        match self.cgroup {
            Some(cg) => cgroup_procs(&cg.path),
            None => pin_found(fallback_members(
                self.leader.as_raw(),
                self.uid,
                self.host.agent_pid,
            )),
        }
    }

    /// Sends `sig` to every process of the job: SIGKILL through
    /// `cgroup.kill` where the job has a cgroup, and to every process found
    /// through a pidfd opened when it was found, never by a bare pid;
    /// `group` also signals the leader's process group (only while the
    /// leader is not yet reaped: a pid in use as a process group id is never
    /// given to a new process).
    fn signal(&self, sig: Signal, group: bool) {
        if sig == Signal::SIGKILL {
            if let Some(cg) = self.cgroup {
                cgroup_kill(&cg.path);
            }
        }
        if group {
            match killpg(self.leader, sig) {
                Ok(()) | Err(nix::Error::ESRCH) | Err(nix::Error::EPERM) => {}
                Err(e) => {
                    warn!(pid = self.leader.as_raw(), signal = %sig, error = %e, "cannot signal job process group")
                }
            }
        }
        for p in self.pinned() {
            p.signal(sig);
        }
    }

    /// After the leader was reaped: SIGTERM what is left, SIGKILL after
    /// `grace`, and wait (bounded) until nothing is left.
    async fn finish_off(&self, grace: Duration) {
        if self.live().is_empty() {
            sweep_zombies(self.host.agent_pid);
            return;
        }
        info!(
            pid = self.leader.as_raw(),
            "processes of the job are left after its main process ended: SIGTERM"
        );
        self.signal(Signal::SIGTERM, false);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !self.live().is_empty() {
            sweep_zombies(self.host.agent_pid);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for _ in 0..100 {
            sweep_zombies(self.host.agent_pid);
            let left = self.live();
            if left.is_empty() {
                break;
            }
            info!(
                pid = self.leader.as_raw(),
                left = left.len(),
                "SIGKILL to what is left of the job"
            );
            self.signal(Signal::SIGKILL, false);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sweep_zombies(self.host.agent_pid);
    }
}

/// Without a cgroup: records the job's current processes so a restarted
/// agent can find processes that escaped the session.
fn remember_members(members: &Members<'_>, record: &mut Record, state_dir: &Path) {
    let now = fallback_members(members.leader.as_raw(), members.uid, members.host.agent_pid);
    if now != record.members {
        record.members = now;
        write_record(state_dir, record);
    }
}

/// The copiers of a job's output streams ([`crate::output`]).
struct Outputs {
    /// Cancelled by the first stream that exceeds the cap.
    over: CancellationToken,
    /// Dropped to make the copiers give up (a leftover holds a pipe).
    stop: Option<OwnedFd>,
    copiers: Vec<tokio::task::JoinHandle<std::io::Result<output::Copied>>>,
}

impl Outputs {
    /// The stop pipe (read end, write end), made before the job starts.
    fn stop_pipe() -> Result<(OwnedFd, OwnedFd), LaunchError> {
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Prepare {
            what: "create the output stop pipe",
            source: e.into(),
        })
    }

    /// Starts one copier per stream, each on a blocking thread.
    fn start(streams: Vec<OutputStream>, cap: u64, (stop_rd, stop_wr): (OwnedFd, OwnedFd)) -> Self {
        let stop_rd = std::sync::Arc::new(stop_rd);
        let over = CancellationToken::new();
        let copiers = streams
            .into_iter()
            .map(|s| {
                let (stop, over) = (stop_rd.clone(), over.clone());
                if s.file.is_none() {
                    warn!("the job's output file did not arrive; its output is dropped");
                }
                tokio::task::spawn_blocking(move || {
                    output::copy_capped(&s.pipe, s.file.as_ref(), cap, &stop, &over)
                })
            })
            .collect();
        Outputs {
            over,
            stop: Some(stop_wr),
            copiers,
        }
    }

    /// Waits (at most [`output::DRAIN_AFTER_END`]) until every stream
    /// reached end of file, then stops the copiers. Returns whether a stream
    /// exceeded the cap.
    async fn finish(mut self) -> bool {
        let all = futures_util::future::join_all(self.copiers.iter_mut());
        if tokio::time::timeout(output::DRAIN_AFTER_END, all)
            .await
            .is_err()
        {
            warn!(
                "a process that is not the job's keeps its output pipe open: output copy stopped"
            );
            drop(self.stop.take());
            for c in &mut self.copiers {
                let _ = c.await;
            }
        }
        self.over.is_cancelled()
    }
}

/// Starts the job of `plan` (calling `on_start` with its leader pid) and
/// supervises it to its end. After `plan.walltime` (monotonic, from
/// `started`), when `cancel` fires, or when an output stream exceeds
/// `plan.max_output_bytes` (the file is never written past it, see
/// [`crate::output`]), every process of the job gets SIGTERM, then SIGKILL
/// `plan.kill_grace` later. Returns, once the output files are complete,
/// the outcome and usage (wall time from `started` to the leader's end); a
/// start failure is `Outcome::FailedToStart`.
pub async fn run_job(
    plan: LaunchPlan,
    started: Instant,
    cancel: CancellationToken,
    on_start: impl FnOnce(Pid),
) -> (Outcome, Usage) {
    let failed = |e: &LaunchError| {
        (
            Outcome::FailedToStart { reason: chain(e) },
            Usage {
                wall_secs: started.elapsed().as_secs_f64(),
                ..Usage::default()
            },
        )
    };
    let stop_pipe = match Outputs::stop_pipe() {
        Ok(p) => p,
        Err(e) => return failed(&e),
    };
    let host = host(plan.cgroups);
    let wants_limits = plan.memory_max_bytes > 0 || plan.cpu_quota_us > 0;
    let cgroup = match (&host.cgroup_base, plan.cgroups) {
        (Some(base), true) => match JobCgroup::create(host, base, &plan) {
            Ok(cg) => Some(cg),
            Err(e) if wants_limits => return failed(&e),
            Err(e) => {
                warn!(error = %chain(&e), "job runs without its own cgroup");
                None
            }
        },
        _ if wants_limits => return failed(&LaunchError::Cgroup {
            what: "job_memory_max_bytes/job_cpu_max are set but no writable cgroup v2 is available"
                .into(),
            source: std::io::Error::from_raw_os_error(nix::libc::ENOTSUP),
        }),
        _ => None,
    };
    let spawned = {
        let plan = plan.clone();
        let procs = cgroup.as_ref().map(|c| c.procs.try_clone());
        let rlimit_nproc = match &cgroup {
            Some(cg) if cg.pids_max => None,
            _ => Some(plan.pids_max),
        };
        tokio::task::spawn_blocking(move || {
            let procs = match procs {
                Some(Ok(fd)) => Some(fd),
                Some(Err(source)) => {
                    return Err(LaunchError::Prepare {
                        what: "duplicate the cgroup.procs fd",
                        source,
                    })
                }
                None => None,
            };
            spawn(&plan, procs.as_ref(), rlimit_nproc)
        })
        .await
    };
    let spawned = match spawned {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            if let Some(cg) = &cgroup {
                let _ = std::fs::remove_dir(&cg.path);
            }
            return failed(&e);
        }
        Err(e) => {
            return (
                Outcome::FailedToStart {
                    reason: format!("spawn thread failed: {e}"),
                },
                Usage::default(),
            )
        }
    };
    let pid = spawned.pid;
    let outputs = Outputs::start(spawned.outputs, plan.max_output_bytes, stop_pipe);
    on_start(pid);
    let mut record = Record {
        job_id: plan.job_id.clone(),
        pid: pid.as_raw(),
        starttime: proc_stat(pid.as_raw()).map_or(0, |s| s.starttime),
        uid: plan.uid,
        cgroup: cgroup.as_ref().map(|c| c.path.clone()),
        members: Vec::new(),
    };
    write_record(&plan.state_dir, &record);
    let members = Members {
        host,
        leader: pid,
        uid: plan.uid,
        cgroup: cgroup.as_ref(),
    };
    let (reaped, wall, stop) =
        supervise(&members, &outputs.over, &plan, &mut record, started, cancel).await;
    members.finish_off(plan.kill_grace).await;
    // Output is complete before the job is reported.
    let over = outputs.finish().await;
    let stop = stop.or(over.then_some(Stop::OutputLimit));
    let result = finish(pid, wall, reaped, stop);
    if let Some(cg) = &cgroup {
        for _ in 0..50 {
            match std::fs::remove_dir(&cg.path) {
                Ok(()) => break,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    let _ = std::fs::remove_file(record_path(&plan.state_dir, pid));
    result
}

/// What the job leader's waiter thread returns.
type Waited = Result<std::io::Result<Reaped>, tokio::task::JoinError>;

/// Waits for the job leader, stopping the job on walltime, cancel or when
/// `over` (an output stream exceeded the cap) fires. Returns the wait
/// result, the wall time at the leader's end, seconds, and why the agent
/// stopped the job (`None`: it ended by itself).
async fn supervise(
    members: &Members<'_>,
    over: &CancellationToken,
    plan: &LaunchPlan,
    record: &mut Record,
    started: Instant,
    cancel: CancellationToken,
) -> (Waited, f64, Option<Stop>) {
    let pid = members.leader;
    let mut waiter = tokio::task::spawn_blocking(move || wait_child(pid));
    let deadline = tokio::time::Instant::from_std(started + plan.walltime);
    let mut tick = tokio::time::interval(TICK);
    let stop = loop {
        tokio::select! {
            r = &mut waiter => return (r, started.elapsed().as_secs_f64(), None),
            _ = tokio::time::sleep_until(deadline) => break Stop::Walltime,
            _ = cancel.cancelled() => break Stop::Cancelled,
            _ = over.cancelled() => break Stop::OutputLimit,
            _ = tick.tick() => {
                sweep_zombies(members.host.agent_pid);
                if members.cgroup.is_none() {
                    remember_members(members, record, &plan.state_dir);
                }
            }
        }
    };
    info!(pid = pid.as_raw(), reason = ?stop, "stopping job: SIGTERM to all its processes");
    members.signal(Signal::SIGTERM, true);
    let r = tokio::select! {
        r = &mut waiter => r,
        _ = tokio::time::sleep(plan.kill_grace) => {
            info!(pid = pid.as_raw(), "job still running after the grace period: SIGKILL");
            members.signal(Signal::SIGKILL, true);
            waiter.await
        }
    };
    (r, started.elapsed().as_secs_f64(), Some(stop))
}

/// The outcome and usage of a job whose leader ended after `wall` seconds.
fn finish(pid: Pid, wall: f64, r: Waited, stop: Option<Stop>) -> (Outcome, Usage) {
    let reaped = match r {
        Ok(Ok(reaped)) => reaped,
        Ok(Err(e)) => {
            warn!(pid = pid.as_raw(), error = %e, "cannot collect job status");
            return (
                Outcome::FailedToStart {
                    reason: format!("cannot collect the job's exit status: {e}"),
                },
                Usage {
                    wall_secs: wall,
                    ..Usage::default()
                },
            );
        }
        Err(e) => {
            warn!(pid = pid.as_raw(), error = %e, "job waiter thread failed");
            return (
                Outcome::FailedToStart {
                    reason: format!("job waiter failed: {e}"),
                },
                Usage {
                    wall_secs: wall,
                    ..Usage::default()
                },
            );
        }
    };
    let usage = Usage {
        wall_secs: wall,
        ..reaped.usage
    };
    let outcome = match (stop, reaped.code, reaped.signal) {
        (Some(Stop::Walltime), _, _) => Outcome::Walltime,
        (Some(Stop::Cancelled), _, _) => Outcome::Cancelled,
        (Some(Stop::OutputLimit), _, _) => Outcome::OutputLimit,
        (None, Some(code), _) => Outcome::Exited { code },
        (None, None, Some(signal)) => Outcome::Signaled { signal },
        (None, None, None) => Outcome::FailedToStart {
            reason: "job ended with an unknown wait status".into(),
        },
    };
    (outcome, usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_stat_line_parses() {
        let me = std::process::id() as i32;
        let st = proc_stat(me).expect("own stat");
        assert_ne!(st.state, 'Z');
        assert_eq!(st.ppid, nix::unistd::getppid().as_raw());
        assert!(st.starttime > 0);
        assert_eq!(proc_uid(me), Some(nix::unistd::getuid().as_raw()));
    }

    /// Starts `sleep 1000` with the pid `want` (root: through
    /// `ns_last_pid`; other processes of the host may take the pid first,
    /// so it retries). `None` if the pid could not be had.
    fn spawn_with_pid(want: i32) -> Option<std::process::Child> {
        for _ in 0..200 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (want - 1).to_string()).ok()?;
            let mut child = std::process::Command::new("sleep")
                .arg("1000")
                .spawn()
                .ok()?;
            if child.id() as i32 == want {
                return Some(child);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        None
    }

    #[test]
    #[ignore = "needs root (ns_last_pid)"]
    fn a_found_process_whose_pid_was_recycled_is_never_signalled() {
        use std::os::unix::process::ExitStatusExt;
        // A process of a job is found (as every kill path finds them) ...
        let mut found = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = found.id() as i32;
        let start = proc_stat(pid).unwrap().starttime;
        let pinned = pin_found([(pid, start)]);
        assert_eq!(pinned.len(), 1);
        // ... then exits, and an unrelated process gets its pid ...
        found.kill().unwrap();
        found.wait().unwrap();
        let mut unrelated = spawn_with_pid(pid).expect("pid reused");
        // ... before the job is killed: the unrelated process is spared.
        for p in &pinned {
            p.signal(Signal::SIGKILL);
        }
        // A SIGKILL sent above would be the fatal signal; ours comes later.
        kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap();
        let status = unrelated.wait().unwrap();
        assert_eq!(
            status.signal(),
            Some(Signal::SIGTERM as i32),
            "the process that got the recycled pid was signalled by the kill path"
        );
        // And a live one found is signalled.
        let mut live = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let lpid = live.id() as i32;
        let pinned = pin_found([(lpid, proc_stat(lpid).unwrap().starttime)]);
        pinned[0].signal(Signal::SIGKILL);
        assert_eq!(live.wait().unwrap().signal(), Some(Signal::SIGKILL as i32));
    }

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
