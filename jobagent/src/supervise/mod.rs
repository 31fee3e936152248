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
//! for), so `wait4` on a leader never races into `ECHILD`. The sweep reads
//! only the agent's children (`/proc/<agent>/task/*/children`), never all
//! of `/proc` (except on kernels built without those files); with cgroups
//! a job's processes come from its `cgroup.procs` alone, so no per-job
//! work grows with the host's process count.
//!
//! # When the agent itself dies
//! Each running job is recorded in `<state_dir>/running/<pid>.json` (leader
//! pid and start time, owner uid, cgroup). Under systemd the unit's
//! default `KillMode=control-group` kills the jobs with the agent. Without
//! it the jobs keep running, orphaned to init; the next agent started with
//! the same `state_dir` kills what is left of them ([`prepare_host`]),
//! as DESIGN.md's *recover* rule demands, and their deliveries follow the
//! lease rules.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vq_common::config::AgentConfig;
use vq_common::messages::{Outcome, Usage};

use crate::error::{chain, LaunchError};
use crate::output;
use crate::plan::LaunchPlan;
use crate::spawn::{spawn, wait_child, OutputStream, Reaped, AGENT_OOM_SCORE_ADJ};

mod cgroup;
mod leftovers;
mod procs;

use cgroup::{
    cgroup_kill, cgroup_pids, cgroup_procs, detect_cgroup, remove_stale_cgroups, JobCgroup,
};
use leftovers::{record_path, recover_leftovers, secure_dir, write_record, Record, REAPING};
use procs::{fallback_members, pin_found, proc_stat, sweep_zombies, JobProc};

/// How often zombies are swept (and, without a cgroup, the job's
/// processes recorded).
pub const TICK: Duration = Duration::from_secs(1);

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
    // Shared by all jobs for half a tick: one /proc scan per tick in all.
    let now = procs::fallback_members_shared(
        members.leader.as_raw(),
        members.uid,
        members.host.agent_pid,
        TICK / 2,
    );
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
    /// A duplicate of the last stream's file (stderr, or the joined file
    /// with `-j oe`/`eo`): where the agent notes why it stopped the job.
    note: Option<OwnedFd>,
}

impl Outputs {
    /// The stop pipe (read end, write end), made before the job starts.
    fn stop_pipe() -> Result<(OwnedFd, OwnedFd), LaunchError> {
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Prepare {
            what: "create the output stop pipe",
            source: e.into(),
        })
    }

    /// Starts one copier per stream, each on a blocking thread, adding
    /// the bytes written to `written`.
    fn start(
        streams: Vec<OutputStream>,
        cap: u64,
        (stop_rd, stop_wr): (OwnedFd, OwnedFd),
        written: &Counter,
    ) -> Self {
        let stop_rd = std::sync::Arc::new(stop_rd);
        let over = CancellationToken::new();
        let note = streams
            .last()
            .and_then(|s| s.file.as_ref())
            .and_then(|f| f.try_clone().ok());
        let copiers = streams
            .into_iter()
            .map(|s| {
                let (stop, over, written) = (stop_rd.clone(), over.clone(), written.clone());
                if s.file.is_none() {
                    warn!("the job's output file did not arrive; its output is dropped");
                }
                tokio::task::spawn_blocking(move || {
                    output::copy_capped(&s.pipe, s.file.as_ref(), cap, &stop, &over, &written)
                })
            })
            .collect();
        Outputs {
            over,
            stop: Some(stop_wr),
            copiers,
            note,
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
/// start failure is `Outcome::FailedToStart`. Every byte written into the
/// output files is also added to `written` as it is written.
pub async fn run_job(
    plan: LaunchPlan,
    started: Instant,
    cancel: CancellationToken,
    written: Counter,
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
    let mut outputs = Outputs::start(spawned.outputs, plan.max_output_bytes, stop_pipe, &written);
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
    let note = outputs.note.take();
    let over = outputs.finish().await;
    let stop = stop.or(over.then_some(Stop::OutputLimit));
    if let (Some(Stop::Walltime), Some(file)) = (stop, note) {
        let (text, cap) = (walltime_note(wall, plan.walltime), plan.max_output_bytes);
        // The file may be on a slow file system: not on the runtime.
        let _ = tokio::task::spawn_blocking(move || note_stop(&file, &text, cap)).await;
    }
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

/// The line pbs_mom appends to a job's stderr when it kills the job for its
/// walltime (`=>> PBS: job killed: walltime 65 exceeded limit 60`, Torque
/// `mom_main.c`), with `vq` for `PBS`: the used wall time (whole seconds,
/// rounded down) and the limit.
fn walltime_note(wall_secs: f64, limit: Duration) -> String {
    format!(
        "=>> vq: job killed: walltime {} exceeded limit {}\n",
        wall_secs.max(0.0) as u64,
        limit.as_secs()
    )
}

/// Appends `text` to the job's output `file` (an fd the job opened as its
/// owner: no path is resolved as root), unless that would take the file
/// past `cap` bytes (`0` = no cap; the output cap has no slack). Failures
/// are logged: the note must not change the job's result.
fn note_stop(file: &OwnedFd, text: &str, cap: u64) {
    let size = match nix::sys::stat::fstat(file) {
        Ok(st) => u64::try_from(st.st_size).unwrap_or(u64::MAX),
        Err(e) => {
            warn!(error = %e, "cannot note the stop in the job's stderr");
            return;
        }
    };
    if cap > 0 && size.saturating_add(text.len() as u64) > cap {
        info!("stop not noted in the job's stderr: it would pass max_output_bytes");
        return;
    }
    let mut rest = text.as_bytes();
    while !rest.is_empty() {
        match nix::unistd::write(file, rest) {
            Ok(n) => rest = &rest[n..],
            Err(Errno::EINTR) => {}
            Err(e) => {
                warn!(error = %e, "cannot note the stop in the job's stderr");
                return;
            }
        }
    }
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
