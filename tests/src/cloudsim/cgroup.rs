//! The containment of a simulated VM: one cgroup v2 per VM, so that a
//! power-off kills everything that ran in the VM. Processes stay in the
//! cgroup they were forked in whatever happens to their parent, so a job
//! that daemonised, or whose agent was killed (reparenting it to init), is
//! still found; the process tree of the agent is not.
//!
//! Layout: `<the sim's own cgroup>/vq-cloudsim/<server id>/`. The agent
//! joins its VM's cgroup between fork and exec, so nothing it starts can
//! escape. The jobagent puts each job in a cgroup below its own (and moves
//! itself into a `vq-agent` leaf when it enables controllers, the cgroup v2
//! "no internal processes" rule), so job cgroups nest inside the VM's. The
//! controllers `vq-cloudsim` receives are handed on to the VMs, so an agent
//! can limit its jobs as it would on a real VM.
//!
//! Without a writable cgroup v2 the sim falls back to killing the agent's
//! process tree (see [`super::vm::kill_process_tree`]), with a warning.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Directory below the sim's own cgroup that holds one cgroup per VM.
const VMS_DIR: &str = "vq-cloudsim";

/// How long a power-off waits for the killed processes to leave the cgroup.
const EMPTY_TIMEOUT: Duration = Duration::from_secs(10);

/// Where VM cgroups are made: `<own cgroup>/vq-cloudsim`, checked writable.
#[derive(Debug, Clone)]
pub(crate) struct VmCgroups {
    root: PathBuf,
}

impl VmCgroups {
    /// Finds the cgroup v2 the sim runs in and prepares `vq-cloudsim` below
    /// it, or says (once, as a warning) why VMs are not contained.
    pub(crate) fn detect() -> Option<Self> {
        match Self::try_detect() {
            Ok(found) => {
                tracing::info!(cgroup = %found.root.display(), "VMs are contained in cgroups");
                Some(found)
            }
            Err(why) => {
                tracing::warn!(
                    %why,
                    "no cgroup v2 for the VMs: a power-off kills the agent's process tree only, \
                     so jobs that left it (daemonised, or orphaned by a killed agent) survive"
                );
                None
            }
        }
    }

    fn try_detect() -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("read /proc/self/mountinfo: {e}"))?;
        let mount = mountinfo
            .lines()
            .find_map(|l| {
                let (pre, post) = l.split_once(" - ")?;
                post.starts_with("cgroup2 ")
                    .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
            })
            .ok_or("cgroup v2 is not mounted")?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("read /proc/self/cgroup: {e}"))?;
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or("the sim is in no cgroup v2")?;
        let root = mount.join(rel.trim().trim_start_matches('/')).join(VMS_DIR);
        match std::fs::create_dir(&root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("mkdir {}: {e}", root.display())),
        }
        hand_on_controllers(&root);
        Ok(Self { root })
    }

    /// Makes the cgroup of VM `server_id`.
    pub(crate) fn create(&self, server_id: &str) -> std::io::Result<VmCgroup> {
        let path = self.root.join(server_id);
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            // A leftover of a killed sim with the same id: reuse it.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        Ok(VmCgroup { path })
    }
}

/// Enables in `root`'s children every controller `root` has, best effort:
/// `root` holds no process, so the "no internal processes" rule allows it.
fn hand_on_controllers(root: &Path) {
    let available = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    for c in available.split_whitespace() {
        if let Err(error) = write_file(&root.join("cgroup.subtree_control"), &format!("+{c}")) {
            tracing::info!(controller = c, %error, "controller not handed on to the VMs");
        }
    }
}

fn write_file(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// The cgroup of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VmCgroup {
    path: PathBuf,
}

impl VmCgroup {
    /// The cgroup's directory.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Makes the child of `cmd` join this cgroup between fork and exec, so
    /// that nothing it starts is ever outside it. A failed join fails the
    /// spawn.
    pub(crate) fn join_on_spawn(&self, cmd: &mut tokio::process::Command) -> std::io::Result<()> {
        // Opened now, close-on-exec; the child only writes to it.
        let procs: OwnedFd = std::fs::OpenOptions::new()
            .write(true)
            .open(self.path.join("cgroup.procs"))?
            .into();
        join_before_exec(cmd, procs);
        Ok(())
    }

    /// Power-off: SIGKILL every process of the cgroup and its descendants
    /// (`cgroup.kill`, Linux 5.14; else each listed process, until empty),
    /// wait until none is left, then remove the cgroups. Returns how many
    /// processes it held.
    pub(crate) fn kill(&self) -> usize {
        let held = self.pids().len();
        let killed_at_once = write_file(&self.path.join("cgroup.kill"), "1").is_ok();
        if !killed_at_once {
            // Frozen (Linux 5.2), nothing forks while it is killed one by
            // one; SIGKILL still ends frozen processes.
            let _ = write_file(&self.path.join("cgroup.freeze"), "1");
        }
        let deadline = Instant::now() + EMPTY_TIMEOUT;
        while self.populated() {
            if !killed_at_once {
                for pid in self.pids() {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            if Instant::now() > deadline {
                tracing::warn!(cgroup = %self.path.display(), pids = ?self.pids(), "processes still in the VM's cgroup after SIGKILL");
                return held;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Err(error) = remove_tree(&self.path) {
            tracing::warn!(cgroup = %self.path.display(), %error, "VM cgroup not removed");
        }
        held
    }

    /// Whether any process is in the cgroup or below (`cgroup.events`).
    fn populated(&self) -> bool {
        match std::fs::read_to_string(self.path.join("cgroup.events")) {
            Ok(events) => events.lines().any(|l| l.trim() == "populated 1"),
            Err(e) => e.kind() != std::io::ErrorKind::NotFound && !self.pids().is_empty(),
        }
    }

    /// Every process of the cgroup and of its descendants.
    fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        let mut dirs = vec![self.path.clone()];
        while let Some(dir) = dirs.pop() {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            dirs.extend(child_cgroups(&dir));
        }
        pids
    }
}

fn child_cgroups(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes an empty cgroup and its descendants, deepest first (a cgroup
/// with children cannot be removed).
fn remove_tree(dir: &Path) -> std::io::Result<()> {
    for child in child_cgroups(dir) {
        remove_tree(&child)?;
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The pre-exec step of [`VmCgroup::join_on_spawn`].
#[allow(unsafe_code)]
fn join_before_exec(cmd: &mut tokio::process::Command, procs: OwnedFd) {
    // SAFETY: the closure runs in the forked child before exec and makes
    // one async-signal-safe call, write(2) on an fd opened by the parent;
    // it allocates nothing and takes no lock. Writing "0" to cgroup.procs
    // moves the writing process.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::write(&procs, b"0")
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_a_cgroup_tree_goes_deepest_first() -> std::io::Result<()> {
        // Plain directories stand in for cgroups (rmdir works the same).
        let dir = tempfile::tempdir()?;
        let vm = dir.path().join("vm");
        std::fs::create_dir_all(vm.join("vq-agent"))?;
        std::fs::create_dir_all(vm.join("vq-job-1-0"))?;
        remove_tree(&vm)?;
        assert!(!vm.exists());
        remove_tree(&vm)?;
        Ok(())
    }
}
