//! Processes of a job found through `/proc` (session, process group,
//! orphans reparented to the agent as child subreaper, and their
//! descendants), the zombie sweep, and [`JobProc`]: a found process pinned
//! by a pidfd, so a signal never reaches a process that got its pid later
//! (module doc of [`super`]).

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;

use crate::spawn::leaders;

/// One line of `/proc/<pid>/stat` that matters here.
#[derive(Debug, Clone, Copy)]
pub(super) struct ProcStat {
    pub(super) state: char,
    pub(super) ppid: i32,
    pub(super) pgrp: i32,
    pub(super) session: i32,
    pub(super) starttime: u64,
}

pub(super) fn proc_stat(pid: i32) -> Option<ProcStat> {
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

pub(super) fn proc_uid(pid: i32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub(super) fn all_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The pids listed in `children` files (`/proc/PID/task/TID/children`
/// contents, space separated).
pub(super) fn parse_children<'a>(files: impl IntoIterator<Item = &'a str>) -> Vec<i32> {
    let mut pids: Vec<i32> = files
        .into_iter()
        .flat_map(|t| t.split_whitespace().filter_map(|p| p.parse().ok()))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// The agent's children (orphans reparented to it included, as it is a
/// child subreaper), from `/proc/AGENT/task/*/children`, so a sweep reads
/// only them and not every process of the host. `None` when the kernel
/// has no `children` files (`CONFIG_PROC_CHILDREN` off).
pub(super) fn children_of(agent_pid: i32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{agent_pid}/task")).ok()?;
    let mut texts = Vec::new();
    for t in tasks.flatten() {
        match std::fs::read_to_string(t.path().join("children")) {
            Ok(text) => texts.push(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A thread that just ended, or no `children` files at all.
                if !t.path().exists() {
                    continue;
                }
                return None;
            }
            Err(_) => continue,
        }
    }
    Some(parse_children(texts.iter().map(String::as_str)))
}

/// Reaps zombie children of the agent that are not job leaders and not
/// root-owned (see the module docs). Returns how many were reaped. Reads
/// only the agent's children ([`children_of`]); scans all of `/proc` only
/// on kernels without `children` files. A child that ends while the list
/// is read is reaped by the next sweep.
pub(super) fn sweep_zombies(agent_pid: i32) -> usize {
    let leaders = leaders();
    let mut reaped = 0;
    for pid in children_of(agent_pid).unwrap_or_else(all_pids) {
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
pub(super) fn fallback_members(leader: i32, uid: u32, agent_pid: i32) -> Vec<(i32, u64)> {
    members_in(&process_table(), leader, uid, agent_pid)
}

/// The `stat` of every process of the host, by pid (one `/proc` scan).
pub(super) type Table = BTreeMap<i32, ProcStat>;

fn process_table() -> Table {
    let mut stats = Table::new();
    for pid in all_pids() {
        if let Some(st) = proc_stat(pid) {
            stats.insert(pid, st);
        }
    }
    stats
}

static SHARED_TABLE: std::sync::Mutex<Option<(std::time::Instant, std::sync::Arc<Table>)>> =
    std::sync::Mutex::new(None);

/// A process table at most `max_age` old, shared by every job that asks
/// within that time: the periodic bookkeeping of all running jobs without
/// a cgroup costs one `/proc` scan per tick, not one per job. Only for
/// records ([`fallback_members_shared`]); signalling always scans afresh.
fn shared_table(max_age: std::time::Duration) -> std::sync::Arc<Table> {
    let mut guard = SHARED_TABLE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, t)) = guard.as_ref() {
        if at.elapsed() < max_age {
            return t.clone();
        }
    }
    let t = std::sync::Arc::new(process_table());
    *guard = Some((std::time::Instant::now(), t.clone()));
    t
}

/// [`fallback_members`] from a table shared by all jobs for up to
/// `max_age` ([`shared_table`]).
pub(super) fn fallback_members_shared(
    leader: i32,
    uid: u32,
    agent_pid: i32,
    max_age: std::time::Duration,
) -> Vec<(i32, u64)> {
    members_in(&shared_table(max_age), leader, uid, agent_pid)
}

fn members_in(stats: &Table, leader: i32, uid: u32, agent_pid: i32) -> Vec<(i32, u64)> {
    let leaders = leaders().clone();
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

/// A process of a job, pinned by a pidfd opened when it was found, so a
/// signal never reaches another process that got its pid later.
#[derive(Debug)]
pub(super) struct JobProc {
    pub(super) pid: i32,
    /// `None` only on kernels without `pidfd_open` (before 5.3).
    pub(super) fd: Option<OwnedFd>,
}

impl JobProc {
    /// Opens a pidfd for `pid` and keeps it if `is_it(pid)` (which reads
    /// `/proc/<pid>`) holds **after** the open and the pidfd's process has
    /// still not exited after that check: what `is_it` read was then the
    /// pidfd's process, not a successor with the recycled pid.
    pub(super) fn open(pid: i32, is_it: impl Fn(i32) -> bool) -> Option<Self> {
        let rpid = rustix::process::Pid::from_raw(pid)?;
        match rustix::process::pidfd_open(rpid, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => (is_it(pid) && !pidfd_exited(&fd)).then_some(JobProc { pid, fd: Some(fd) }),
            Err(rustix::io::Errno::NOSYS) => is_it(pid).then_some(JobProc { pid, fd: None }),
            Err(_) => None,
        }
    }

    /// Sends `sig` through the pidfd (a process that ended meanwhile gets
    /// nothing: `ESRCH`).
    pub(super) fn signal(&self, sig: Signal) {
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
pub(super) fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    !matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
}

/// Pins the processes `(pid, starttime)` found by a `/proc` scan: each one
/// whose pid still belongs to a live process started at that time.
pub(super) fn pin_found(found: impl IntoIterator<Item = (i32, u64)>) -> Vec<JobProc> {
    found
        .into_iter()
        .filter_map(|(pid, start)| {
            JobProc::open(pid, |p| {
                proc_stat(p).is_some_and(|st| st.starttime == start && st.state != 'Z')
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_files_parse_and_list_our_own_children() {
        assert_eq!(parse_children(["12 7 ", "", "7 30\n"]), vec![7, 12, 30]);
        assert_eq!(parse_children(["x 5"]), vec![5]);
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let kids = children_of(me);
        let _ = child.kill();
        let _ = child.wait();
        if let Some(kids) = kids {
            assert!(kids.contains(&(child.id() as i32)), "{kids:?}");
        }
    }

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
}
