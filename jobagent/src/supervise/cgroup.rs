//! The job's cgroup v2: detection of the agent's own cgroup, enabling
//! controllers (moving the agent into its leaf when it must), one
//! [`JobCgroup`] per job with its limits, listing and killing its
//! processes, and removing stale job cgroups (module doc of [`super`]).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::signal::Signal;
use tracing::info;

use super::procs::JobProc;
use super::Host;
use crate::error::LaunchError;
use crate::plan::{LaunchPlan, CPU_PERIOD_US};

/// Name of the leaf cgroup the agent moves itself into when it must enable
/// controllers in its own cgroup.
pub(super) const AGENT_LEAF: &str = "vq-agent";

/// Numbers the job cgroups of this agent process.
pub(super) static JOB_SEQ: AtomicU64 = AtomicU64::new(0);

/// Removes empty job cgroups of agent processes that no longer exist (an
/// agent killed between a job's end and its cgroup's removal). Non-empty
/// ones are left to the recovery of their own agent's state directory.
pub(super) fn remove_stale_cgroups(base: &Path) {
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

pub(super) fn detect_cgroup() -> Option<PathBuf> {
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

pub(super) fn write_file(path: &Path, value: &str) -> std::io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

pub(super) fn cg_err(what: String) -> impl FnOnce(std::io::Error) -> LaunchError {
    move |source| LaunchError::Cgroup { what, source }
}

/// Enables `controllers` (e.g. `memory`) for the children of `base`,
/// moving the agent into [`AGENT_LEAF`] first if `base` holds processes.
pub(super) fn enable_controllers(
    host: &Host,
    base: &Path,
    controllers: &[&str],
) -> Result<(), LaunchError> {
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
pub(super) struct JobCgroup {
    pub(super) path: PathBuf,
    pub(super) procs: OwnedFd,
    /// Whether `pids.max` enforces the job's process limit.
    pub(super) pids_max: bool,
}

impl JobCgroup {
    pub(super) fn create(host: &Host, base: &Path, plan: &LaunchPlan) -> Result<Self, LaunchError> {
        let mut wanted = Vec::new();
        let available =
            std::fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| available.split_whitespace().any(|a| a == c);
        // The site's limits are required; the job's request (`-l mem`, its
        // slots as CPUs) applies where the controller is delegated.
        let memory_max = effective_limit(
            plan.memory_max_bytes,
            plan.requested_memory_bytes,
            has("memory"),
        );
        let cpu_quota = effective_limit(plan.cpu_quota_us, plan.requested_cpu_quota_us, has("cpu"));
        if memory_max > 0 {
            wanted.push("memory");
        }
        if cpu_quota > 0 {
            wanted.push("cpu");
        }
        // The process limit always applies; without the pids controller the
        // child enforces it with RLIMIT_NPROC instead.
        let pids_max = has("pids");
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
        if memory_max > 0 {
            write_file(&path.join("memory.max"), &memory_max.to_string())
                .map_err(cg_err(format!("set memory.max of {}", path.display())))
                .map_err(remove)?;
            // No swap beyond the limit either, where swap accounting exists.
            let _ = write_file(&path.join("memory.swap.max"), "0");
        }
        if cpu_quota > 0 {
            write_file(
                &path.join("cpu.max"),
                &format!("{cpu_quota} {CPU_PERIOD_US}"),
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

pub(super) fn cgroup_pids(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// SIGKILL to every process of the cgroup at `path`: `cgroup.kill` (Linux
/// 5.14), else through pidfds of its listed members (callers loop).
pub(super) fn cgroup_kill(path: &Path) {
    if write_file(&path.join("cgroup.kill"), "1").is_err() {
        for p in cgroup_procs(path) {
            p.signal(Signal::SIGKILL);
        }
    }
}

/// The processes listed in the cgroup at `path`, each pinned by a pidfd
/// and checked (after the open) to be in that cgroup.
pub(super) fn cgroup_procs(path: &Path) -> Vec<JobProc> {
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
pub(super) fn in_cgroup(pid: i32, name: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|t| {
        t.lines()
            .filter_map(|l| l.strip_prefix("0::"))
            .any(|rel| rel.trim_end().rsplit('/').next() == Some(name))
    })
}

/// The limit a job's cgroup gets from the site's `hard` one (0 = none,
/// required: the job fails without its controller) and the job's
/// `requested` one (0 = none, applied only when the controller is
/// `available`): the smaller of those that apply.
pub(super) fn effective_limit(hard: u64, requested: u64, available: bool) -> u64 {
    let requested = if available { requested } else { 0 };
    match (hard, requested) {
        (0, r) => r,
        (h, 0) => h,
        (h, r) => h.min(r),
    }
}

#[cfg(test)]
mod limit_tests {
    use super::effective_limit;

    #[test]
    fn a_jobs_request_applies_only_with_its_controller_and_never_raises_the_sites_limit() {
        assert_eq!(effective_limit(0, 0, true), 0);
        assert_eq!(effective_limit(0, 400_000, true), 400_000);
        assert_eq!(effective_limit(0, 400_000, false), 0);
        assert_eq!(effective_limit(200_000, 400_000, true), 200_000);
        assert_eq!(effective_limit(800_000, 400_000, true), 400_000);
        assert_eq!(effective_limit(800_000, 400_000, false), 800_000);
    }
}
