//! What a job's child does between `fork` and `exec`, as a value: the list
//! of [`ChildStep`]s that [`child_steps`] builds in the parent (decide
//! before fork, STYLE.md practice 10), walked after fork by [`run_steps`]
//! through a [`ChildOps`]. The real [`ChildOps`] (libc calls, the only
//! `unsafe`) lives in [`super`]; the tests here use a recording one, so the
//! privilege-drop order is checked without root (the root system test
//! `jobagent_security` checks the real calls).
//!
//! The order, and why (DESIGN.md, "Privilege drop"; issue 9):
//!
//! 1. reset every signal to its default and unblock all (ignored signals
//!    survive `exec`: an agent started by `nohup` has SIGHUP ignored);
//! 2. join the job's cgroup, set `oom_score_adj` and `RLIMIT_NPROC` (only
//!    when no cgroup `pids.max` limits the job) while still root, so the
//!    job cannot undo them;
//! 3. `setsid`, then `setgroups` (the owner's list) → `setresgid` →
//!    `setresuid` (groups need root, and so does the gid once the uid is
//!    gone), then check that root cannot be regained;
//! 4. a fresh session keyring, after the uid switch so it is the owner's;
//! 5. `umask`, `chdir` and the shell check, as the owner;
//! 6. open stdout/stderr as the owner, pass them to the agent, put the
//!    output pipes on fds 1 and 2, mark fds from 3 close-on-exec and make
//!    the script fd inheritable; then `exec`.

// The parent module allows `unsafe` for its libc calls; none of it here.
#![forbid(unsafe_code)]

use std::ffi::CString;
use std::os::fd::RawFd;

use vq_common::messages::Join;

use crate::plan::LaunchPlan;

/// Which output stream an [`ChildStep::OpenOutput`] opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The job's stdout file (also its stderr with `-j oe`).
    Stdout,
    /// The job's stderr file (also its stdout with `-j eo`).
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// One step of the child between `fork` and `exec`. Everything a step
/// needs was made before fork; running it allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildStep {
    /// Every signal but SIGKILL/SIGSTOP to `SIG_DFL`, the mask emptied.
    ResetSignals,
    /// Write `0` to the job cgroup's `cgroup.procs`, open as this fd.
    JoinCgroup {
        /// The `cgroup.procs` fd, opened by the agent.
        procs: RawFd,
    },
    /// Write this value to `/proc/self/oom_score_adj`.
    OomScoreAdj {
        /// The value as decimal ASCII (rendered before fork).
        value: Vec<u8>,
    },
    /// `RLIMIT_NPROC` soft and hard (no cgroup `pids.max` for the job).
    LimitProcs {
        /// Most processes of the owner's uid.
        max: u64,
    },
    /// A new session (and process group) led by the job.
    Setsid,
    /// `setgroups`: the owner's supplementary groups.
    SetGroups {
        /// The owner's full group list.
        groups: Vec<u32>,
    },
    /// `setresgid` to the job's group.
    SetGid {
        /// Group id.
        gid: u32,
    },
    /// `setresuid` to the owner.
    SetUid {
        /// User id (never 0).
        uid: u32,
    },
    /// Fail if `setuid(0)` or `setgid(0)` succeeds or the euid is 0.
    RefuseRoot,
    /// Join a new anonymous session keyring (as `pam_keyinit` does).
    SessionKeyring,
    /// The job's file mode creation mask.
    Umask {
        /// The mask.
        mask: u32,
    },
    /// `chdir` to the working directory, as the owner.
    Chdir {
        /// The directory.
        dir: CString,
    },
    /// The shell is a regular file the owner may execute.
    CheckShell {
        /// The shell's path.
        shell: CString,
    },
    /// Open an output file as the owner (`O_NOFOLLOW`, non-blocking, mode
    /// 0600; only a regular file or `/dev/null`).
    OpenOutput {
        /// Which stream.
        stream: Stream,
        /// The file.
        path: CString,
    },
    /// Send the files opened so far to the agent (`SCM_RIGHTS`).
    PassOutputs {
        /// The child's end of the fd-passing socket.
        socket: RawFd,
    },
    /// `dup2` the write ends of the output pipes onto fds 1 and 2.
    DupPipes {
        /// Becomes fd 1.
        stdout: RawFd,
        /// Becomes fd 2 (the same pipe as `stdout` when joined).
        stderr: RawFd,
    },
    /// Every fd from 3 up close-on-exec.
    CloexecFrom3,
    /// Clear close-on-exec of the script's memfd (the shell runs it).
    ScriptInheritable {
        /// The sealed script memfd.
        fd: RawFd,
    },
}

/// Why a [`ChildStep`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepError {
    /// The system call failed with this errno.
    Errno(i32),
    /// The path is not a regular file (an output may also be `/dev/null`):
    /// refused, reported with this errno.
    NotRegular(i32),
}

impl StepError {
    /// The errno the failure is reported with.
    pub fn errno(self) -> i32 {
        match self {
            StepError::Errno(e) | StepError::NotRegular(e) => e,
        }
    }
}

/// Runs [`ChildStep`]s. The real implementation runs in the forked child
/// and must make async-signal-safe calls only (no allocation, no locks).
pub trait ChildOps {
    /// Runs one step.
    ///
    /// # Errors
    /// Why the step failed; the child then stops (fail closed).
    fn run(&mut self, step: &ChildStep) -> Result<(), StepError>;
}

/// The fds the child's steps use, made by the agent before fork.
#[derive(Debug, Clone, Copy)]
pub struct ChildFds {
    /// The job cgroup's `cgroup.procs`, if the job has a cgroup.
    pub cgroup_procs: Option<RawFd>,
    /// The child's end of the fd-passing socket.
    pub socket: RawFd,
    /// Write end of the stdout pipe.
    pub stdout_pipe: RawFd,
    /// Write end of the stderr pipe (the stdout pipe when joined).
    pub stderr_pipe: RawFd,
    /// The sealed script memfd.
    pub script: RawFd,
}

/// The child's steps for `plan`, in the order they run (module doc).
/// `oom_score_adj`: the job's value; `rlimit_nproc`: the job's process
/// limit when no cgroup `pids.max` enforces it.
pub fn child_steps(
    plan: &LaunchPlan,
    fds: &ChildFds,
    oom_score_adj: i32,
    rlimit_nproc: Option<u64>,
) -> Vec<ChildStep> {
    let mut steps = vec![ChildStep::ResetSignals];
    if let Some(procs) = fds.cgroup_procs {
        steps.push(ChildStep::JoinCgroup { procs });
    }
    steps.push(ChildStep::OomScoreAdj {
        value: oom_score_adj.to_string().into_bytes(),
    });
    if let Some(max) = rlimit_nproc {
        steps.push(ChildStep::LimitProcs { max });
    }
    steps.extend([
        ChildStep::Setsid,
        ChildStep::SetGroups {
            groups: plan.groups.clone(),
        },
        ChildStep::SetGid { gid: plan.gid },
        ChildStep::SetUid { uid: plan.uid },
        ChildStep::RefuseRoot,
        // After the uid switch, so the new keyring belongs to the owner
        // (and counts against the owner's key quota).
        ChildStep::SessionKeyring,
        ChildStep::Umask { mask: plan.umask },
        ChildStep::Chdir {
            dir: plan.cwd.clone(),
        },
        // As the owner, before any output file is created: what exec
        // would answer, and nothing the owner could not learn itself.
        ChildStep::CheckShell {
            shell: plan.shell.clone(),
        },
    ]);
    match plan.join {
        Join::Oe => steps.push(ChildStep::OpenOutput {
            stream: Stream::Stdout,
            path: plan.stdout.clone(),
        }),
        Join::Eo => steps.push(ChildStep::OpenOutput {
            stream: Stream::Stderr,
            path: plan.stderr.clone(),
        }),
        Join::N => steps.extend([
            ChildStep::OpenOutput {
                stream: Stream::Stdout,
                path: plan.stdout.clone(),
            },
            ChildStep::OpenOutput {
                stream: Stream::Stderr,
                path: plan.stderr.clone(),
            },
        ]),
    }
    steps.extend([
        ChildStep::PassOutputs { socket: fds.socket },
        ChildStep::DupPipes {
            stdout: fds.stdout_pipe,
            stderr: fds.stderr_pipe,
        },
        ChildStep::CloexecFrom3,
        ChildStep::ScriptInheritable { fd: fds.script },
    ]);
    steps
}

/// Runs `steps` in order through `ops` and stops at the first failure,
/// returning its index in `steps`. Allocates nothing.
///
/// # Errors
/// `(index, why)` of the failed step.
pub fn run_steps(ops: &mut impl ChildOps, steps: &[ChildStep]) -> Result<(), (usize, StepError)> {
    for (i, step) in steps.iter().enumerate() {
        ops.run(step).map_err(|e| (i, e))?;
    }
    Ok(())
}

impl ChildStep {
    /// A short fixed name of the step kind (for logs and tests).
    pub fn kind(&self) -> &'static str {
        match self {
            ChildStep::ResetSignals => "reset-signals",
            ChildStep::JoinCgroup { .. } => "join-cgroup",
            ChildStep::OomScoreAdj { .. } => "oom-score-adj",
            ChildStep::LimitProcs { .. } => "limit-procs",
            ChildStep::Setsid => "setsid",
            ChildStep::SetGroups { .. } => "setgroups",
            ChildStep::SetGid { .. } => "setresgid",
            ChildStep::SetUid { .. } => "setresuid",
            ChildStep::RefuseRoot => "refuse-root",
            ChildStep::SessionKeyring => "session-keyring",
            ChildStep::Umask { .. } => "umask",
            ChildStep::Chdir { .. } => "chdir",
            ChildStep::CheckShell { .. } => "check-shell",
            ChildStep::OpenOutput {
                stream: Stream::Stdout,
                ..
            } => "open-stdout",
            ChildStep::OpenOutput {
                stream: Stream::Stderr,
                ..
            } => "open-stderr",
            ChildStep::PassOutputs { .. } => "pass-outputs",
            ChildStep::DupPipes { .. } => "dup-pipes",
            ChildStep::CloexecFrom3 => "cloexec-from-3",
            ChildStep::ScriptInheritable { .. } => "script-inheritable",
        }
    }

    /// What failed, for `LaunchError::Child` (and so the job's
    /// `FailedToStart` reason), given why.
    pub fn describe(&self, why: StepError) -> String {
        let not_regular = matches!(why, StepError::NotRegular(_));
        let lossy = |c: &CString| c.to_string_lossy().into_owned();
        match self {
            ChildStep::ResetSignals => "resetting signal dispositions and the signal mask".into(),
            ChildStep::JoinCgroup { .. } => "joining the job's cgroup".into(),
            ChildStep::OomScoreAdj { .. } => "setting the job's oom_score_adj".into(),
            ChildStep::LimitProcs { max } => format!("setting RLIMIT_NPROC to {max}"),
            ChildStep::Setsid => "setsid".into(),
            ChildStep::SetGroups { groups } => format!("setgroups {groups:?}"),
            ChildStep::SetGid { gid } => format!("setresgid {gid}"),
            ChildStep::SetUid { uid } => format!("setresuid {uid}"),
            ChildStep::RefuseRoot => {
                "check that root cannot be regained (setuid(0) or setgid(0) succeeded)".into()
            }
            ChildStep::SessionKeyring => "joining a new session keyring as the owner".into(),
            ChildStep::Umask { mask } => format!("setting umask {mask:04o}"),
            ChildStep::Chdir { dir } => format!("chdir to {} as the owner", lossy(dir)),
            ChildStep::CheckShell { shell } if not_regular => {
                format!("shell {} is not a regular file: refused", lossy(shell))
            }
            ChildStep::CheckShell { shell } => {
                format!("checking shell {} as the owner", lossy(shell))
            }
            ChildStep::OpenOutput { stream, path } if not_regular => format!(
                "{} path {} is not a regular file (FIFO, socket or device): refused",
                stream.name(),
                lossy(path)
            ),
            ChildStep::OpenOutput { stream, path } => {
                format!("open {} file {} as the owner", stream.name(), lossy(path))
            }
            ChildStep::PassOutputs { .. } => "passing the output fds to the agent".into(),
            ChildStep::DupPipes { .. } => "dup2 of the output pipes".into(),
            ChildStep::CloexecFrom3 => "marking every fd from 3 close-on-exec".into(),
            ChildStep::ScriptInheritable { .. } => "making the script fd inheritable".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;

    /// Records every step it is given; fails the step of kind `fail_at`.
    #[derive(Default)]
    struct RecordingOps {
        ran: Vec<ChildStep>,
        fail_at: Option<(&'static str, StepError)>,
    }

    impl ChildOps for RecordingOps {
        fn run(&mut self, step: &ChildStep) -> Result<(), StepError> {
            self.ran.push(step.clone());
            match self.fail_at {
                Some((kind, e)) if kind == step.kind() => Err(e),
                _ => Ok(()),
            }
        }
    }

    fn plan(join: Join) -> LaunchPlan {
        LaunchPlan {
            job_id: "j1".into(),
            owner: "alice".into(),
            uid: 1001,
            gid: 1002,
            groups: vec![1002, 27, 100],
            shell: c"/bin/bash".into(),
            script: b"echo hi\n".to_vec(),
            env: vec![("HOME".into(), "/home/alice".into())],
            cwd: c"/home/alice/work".into(),
            stdout: c"/home/alice/j1.out".into(),
            stderr: c"/home/alice/j1.err".into(),
            join,
            umask: 0o022,
            walltime: Duration::from_secs(60),
            kill_grace: Duration::from_secs(5),
            max_output_bytes: 0,
            cgroups: true,
            memory_max_bytes: 0,
            cpu_quota_us: 0,
            pids_max: 512,
            state_dir: PathBuf::from("/var/lib/vq"),
            slots: 1,
            nodefile: PathBuf::from("/var/lib/vq/nodefiles/j1"),
            requested_memory_bytes: 0,
            requested_cpu_quota_us: 0,
        }
    }

    const FDS: ChildFds = ChildFds {
        cgroup_procs: Some(20),
        socket: 21,
        stdout_pipe: 22,
        stderr_pipe: 23,
        script: 24,
    };

    fn kinds(steps: &[ChildStep]) -> Vec<&'static str> {
        steps.iter().map(ChildStep::kind).collect()
    }

    fn recorded(steps: &[ChildStep]) -> RecordingOps {
        let mut ops = RecordingOps::default();
        run_steps(&mut ops, steps).expect("no step fails");
        ops
    }

    fn position(ops: &RecordingOps, kind: &str) -> usize {
        ops.ran
            .iter()
            .position(|s| s.kind() == kind)
            .unwrap_or_else(|| panic!("{kind} did not run"))
    }

    #[test]
    fn groups_are_set_before_the_gid_and_the_gid_before_the_uid() {
        let ops = recorded(&child_steps(&plan(Join::N), &FDS, 0, None));
        let (groups, gid, uid) = (
            position(&ops, "setgroups"),
            position(&ops, "setresgid"),
            position(&ops, "setresuid"),
        );
        assert!(groups < gid && gid < uid, "{:?}", kinds(&ops.ran));
        assert_eq!(
            ops.ran[groups],
            ChildStep::SetGroups {
                groups: vec![1002, 27, 100]
            }
        );
        assert_eq!(ops.ran[gid], ChildStep::SetGid { gid: 1002 });
        assert_eq!(ops.ran[uid], ChildStep::SetUid { uid: 1001 });
        assert_eq!(ops.ran[uid + 1], ChildStep::RefuseRoot);
    }

    #[test]
    fn the_child_runs_every_step_in_the_documented_order() {
        let ops = recorded(&child_steps(&plan(Join::N), &FDS, 0, Some(512)));
        assert_eq!(
            kinds(&ops.ran),
            [
                "reset-signals",
                "join-cgroup",
                "oom-score-adj",
                "limit-procs",
                "setsid",
                "setgroups",
                "setresgid",
                "setresuid",
                "refuse-root",
                "session-keyring",
                "umask",
                "chdir",
                "check-shell",
                "open-stdout",
                "open-stderr",
                "pass-outputs",
                "dup-pipes",
                "cloexec-from-3",
                "script-inheritable",
            ]
        );
    }

    #[test]
    fn limits_are_set_while_root_and_outputs_are_opened_only_as_the_owner() {
        let ops = recorded(&child_steps(&plan(Join::N), &FDS, 0, Some(512)));
        let uid = position(&ops, "setresuid");
        for kind in [
            "join-cgroup",
            "oom-score-adj",
            "limit-procs",
            "reset-signals",
        ] {
            assert!(position(&ops, kind) < uid, "{kind} after the uid switch");
        }
        for kind in [
            "session-keyring",
            "chdir",
            "check-shell",
            "open-stdout",
            "open-stderr",
        ] {
            assert!(position(&ops, kind) > uid, "{kind} before the uid switch");
        }
        assert!(position(&ops, "chdir") < position(&ops, "open-stdout"));
        assert_eq!(
            ops.ran.last(),
            Some(&ChildStep::ScriptInheritable { fd: 24 })
        );
    }

    #[test]
    fn without_a_cgroup_or_a_process_limit_those_steps_are_left_out() {
        let fds = ChildFds {
            cgroup_procs: None,
            ..FDS
        };
        let steps = child_steps(&plan(Join::N), &fds, 0, None);
        let k = kinds(&steps);
        assert!(
            !k.contains(&"join-cgroup") && !k.contains(&"limit-procs"),
            "{k:?}"
        );
        let steps = child_steps(&plan(Join::N), &FDS, 300, Some(64));
        assert!(steps.contains(&ChildStep::JoinCgroup { procs: 20 }));
        assert!(steps.contains(&ChildStep::LimitProcs { max: 64 }));
        assert!(steps.contains(&ChildStep::OomScoreAdj {
            value: b"300".to_vec()
        }));
    }

    #[test]
    fn joined_streams_open_one_file_and_share_one_pipe() {
        let fds = ChildFds {
            stderr_pipe: FDS.stdout_pipe,
            ..FDS
        };
        for (join, stream, path) in [
            (Join::Oe, Stream::Stdout, "/home/alice/j1.out"),
            (Join::Eo, Stream::Stderr, "/home/alice/j1.err"),
        ] {
            let steps = child_steps(&plan(join), &fds, 0, None);
            let opens: Vec<&ChildStep> = steps
                .iter()
                .filter(|s| matches!(s, ChildStep::OpenOutput { .. }))
                .collect();
            assert_eq!(
                opens,
                [&ChildStep::OpenOutput {
                    stream,
                    path: CString::new(path).unwrap()
                }],
                "{join:?}"
            );
            assert!(steps.contains(&ChildStep::DupPipes {
                stdout: 22,
                stderr: 22
            }));
        }
    }

    #[test]
    fn a_failing_step_stops_the_child_and_nothing_after_it_runs() {
        let steps = child_steps(&plan(Join::N), &FDS, 0, None);
        let mut ops = RecordingOps {
            fail_at: Some(("setresgid", StepError::Errno(1))),
            ..Default::default()
        };
        let (i, why) = run_steps(&mut ops, &steps).expect_err("setresgid fails");
        assert_eq!(steps[i], ChildStep::SetGid { gid: 1002 });
        assert_eq!(why.errno(), 1);
        assert_eq!(ops.ran.last(), Some(&steps[i]));
        assert!(
            !kinds(&ops.ran).contains(&"setresuid"),
            "never half-dropped"
        );
    }

    #[test]
    fn a_failed_step_is_named_with_its_data() {
        let p = plan(Join::N);
        let steps = child_steps(&p, &FDS, 0, Some(512));
        let describe = |kind: &str, why| {
            let s = steps.iter().find(|s| s.kind() == kind).expect("step");
            s.describe(why)
        };
        let errno = StepError::Errno(2);
        assert_eq!(
            describe("chdir", errno),
            "chdir to /home/alice/work as the owner"
        );
        assert_eq!(describe("setgroups", errno), "setgroups [1002, 27, 100]");
        assert_eq!(
            describe("limit-procs", errno),
            "setting RLIMIT_NPROC to 512"
        );
        assert_eq!(
            describe("open-stderr", errno),
            "open stderr file /home/alice/j1.err as the owner"
        );
        assert!(describe("open-stdout", StepError::NotRegular(22)).contains("not a regular file"));
        assert_eq!(
            describe("check-shell", StepError::NotRegular(13)),
            "shell /bin/bash is not a regular file: refused"
        );
    }
}
