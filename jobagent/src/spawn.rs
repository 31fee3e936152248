//! The only module with `unsafe`: fork/exec of a job with the privilege drop
//! in one `pre_exec` hook, and `wait4` for its status and rusage.
//!
//! The parent prepares everything ([`LaunchPlan`]); after `fork` the child
//! makes only async-signal-safe system calls, in this order: `setsid`,
//! `setgroups` (owner's list), `setresgid`, `setresuid`, check that
//! `setuid(0)` fails, `umask`, `chdir`, open stdout/stderr **as the owner**
//! (`O_NOFOLLOW`, mode 0600) and `dup2` them onto fds 1 and 2, then make the
//! script fd inheritable. std's `Command::uid/gid/current_dir` are not used:
//! they run before `pre_exec`, as root, and break `setgroups` (DESIGN.md,
//! "Privilege drop").
//!
//! The script is written into a sealed `memfd` and the shell runs
//! `/proc/self/fd/N`: the owner cannot swap it, and the job's stdin stays
//! `/dev/null` so commands that read stdin cannot eat the script.
//!
//! A failing step writes its number and errno into a close-on-exec pipe
//! before returning the error; the parent reads the pipe after `spawn` to
//! name the step in `Outcome::FailedToStart`.

#![allow(unsafe_code)]

use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::libc;
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::unistd::Pid;
use vq_common::messages::{Join, Usage};

use crate::error::LaunchError;
use crate::plan::LaunchPlan;

/// Lowest fd number used for the script and the spawn pipe, so that std's
/// stdio setup (fds 0-2) can never clobber them.
const MIN_FD: RawFd = 10;

#[derive(Clone, Copy)]
#[repr(u8)]
enum Step {
    Setsid = 1,
    Setgroups,
    Setgid,
    Setuid,
    RegainRoot,
    Chdir,
    OpenStdout,
    OpenStderr,
    Dup,
    ScriptFd,
}

fn step_name(step: u8, plan: &LaunchPlan) -> String {
    match step {
        1 => "setsid".into(),
        2 => format!("setgroups {:?}", plan.groups),
        3 => format!("setresgid {}", plan.gid),
        4 => format!("setresuid {}", plan.uid),
        5 => "check that root cannot be regained (setuid(0) succeeded)".into(),
        6 => format!("chdir to {} as the owner", plan.cwd.to_string_lossy()),
        7 => format!(
            "open stdout file {} as the owner",
            plan.stdout.to_string_lossy()
        ),
        8 => format!(
            "open stderr file {} as the owner",
            plan.stderr.to_string_lossy()
        ),
        9 => "dup2 of the output files".into(),
        10 => "making the script fd inheritable".into(),
        n => format!("unknown step {n}"),
    }
}

/// Moves `fd` to a number >= [`MIN_FD`], close-on-exec.
fn high_fd(fd: OwnedFd, what: &'static str) -> Result<OwnedFd, LaunchError> {
    let raw = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(MIN_FD)).map_err(|e| LaunchError::Prepare {
        what,
        source: e.into(),
    })?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) })
}

/// Writes `script` into a sealed memfd (no write, grow, shrink or re-seal).
fn script_memfd(script: &[u8]) -> Result<OwnedFd, LaunchError> {
    let prep = |what: &'static str| {
        move |e: nix::Error| LaunchError::Prepare {
            what,
            source: e.into(),
        }
    };
    let fd = memfd_create(
        c"vq-job-script",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(prep("memfd_create for the script"))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(script)
        .map_err(|source| LaunchError::Prepare {
            what: "write the script to its memfd",
            source,
        })?;
    let fd = OwnedFd::from(file);
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(prep("seal the script memfd"))?;
    high_fd(fd, "move the script memfd")
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Reports `step` through the spawn pipe and returns the error for std.
/// Async-signal-safe: one `write`, no allocation.
fn fail(pipe: RawFd, step: Step, err: i32) -> std::io::Error {
    let e = err.to_ne_bytes();
    let msg = [step as u8, e[0], e[1], e[2], e[3]];
    // SAFETY: writing a stack buffer to an fd we own; the result is ignored
    // on purpose (the parent treats a short report as an unknown step).
    unsafe {
        libc::write(pipe, msg.as_ptr().cast(), msg.len());
    }
    std::io::Error::from_raw_os_error(err)
}

/// Opens `path` for writing as the current (already dropped) user.
///
/// # Safety
/// Async-signal-safe; `path` must be a valid C string.
unsafe fn open_output(path: &CStr) -> RawFd {
    // SAFETY: `path` is NUL-terminated; flags and mode are plain integers.
    unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    }
}

/// Starts the job of `plan`. Returns its pid, which is also its process
/// group and session id. Blocking (forks and waits for exec): call it from a
/// blocking thread.
///
/// # Errors
/// [`LaunchError::Prepare`] before fork, [`LaunchError::Child`] naming the
/// failed step in the child, [`LaunchError::Exec`] if the shell cannot be
/// executed.
pub fn spawn(plan: &LaunchPlan) -> Result<Pid, LaunchError> {
    let script = script_memfd(&plan.script)?;
    let script_fd = script.as_raw_fd();
    let (rd, wr) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Prepare {
        what: "create the spawn pipe",
        source: e.into(),
    })?;
    let wr = high_fd(wr, "move the spawn pipe")?;
    let pipe_fd = wr.as_raw_fd();

    let shell =
        std::ffi::OsStr::new(std::str::from_utf8(plan.shell.to_bytes()).unwrap_or("/bin/sh"));
    let mut cmd = Command::new(shell);
    cmd.arg(format!("/proc/self/fd/{script_fd}"))
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());

    let groups: Vec<libc::gid_t> = plan.groups.clone();
    let (uid, gid, umask) = (plan.uid, plan.gid, plan.umask);
    let cwd = plan.cwd.clone();
    let stdout = plan.stdout.clone();
    let stderr = plan.stderr.clone();
    let join = plan.join;

    let hook = move || -> std::io::Result<()> {
        // SAFETY: every call below is an async-signal-safe system call on
        // data prepared before fork (no allocation, no locks); this closure
        // runs in the forked child only.
        unsafe {
            if libc::setsid() == -1 {
                return Err(fail(pipe_fd, Step::Setsid, errno()));
            }
            if libc::setgroups(groups.len(), groups.as_ptr()) == -1 {
                return Err(fail(pipe_fd, Step::Setgroups, errno()));
            }
            if libc::setresgid(gid, gid, gid) == -1 {
                return Err(fail(pipe_fd, Step::Setgid, errno()));
            }
            if libc::setresuid(uid, uid, uid) == -1 {
                return Err(fail(pipe_fd, Step::Setuid, errno()));
            }
            if libc::setuid(0) != -1 {
                return Err(fail(pipe_fd, Step::RegainRoot, libc::EPERM));
            }
            libc::umask(umask as libc::mode_t);
            if libc::chdir(cwd.as_ptr()) == -1 {
                return Err(fail(pipe_fd, Step::Chdir, errno()));
            }
            match join {
                Join::Oe | Join::Eo => {
                    let (path, step) = if join == Join::Oe {
                        (&stdout, Step::OpenStdout)
                    } else {
                        (&stderr, Step::OpenStderr)
                    };
                    let fd = open_output(path);
                    if fd == -1 {
                        return Err(fail(pipe_fd, step, errno()));
                    }
                    if libc::dup2(fd, 1) == -1 || libc::dup2(fd, 2) == -1 {
                        return Err(fail(pipe_fd, Step::Dup, errno()));
                    }
                }
                Join::N => {
                    let out = open_output(&stdout);
                    if out == -1 {
                        return Err(fail(pipe_fd, Step::OpenStdout, errno()));
                    }
                    let err = open_output(&stderr);
                    if err == -1 {
                        return Err(fail(pipe_fd, Step::OpenStderr, errno()));
                    }
                    if libc::dup2(out, 1) == -1 || libc::dup2(err, 2) == -1 {
                        return Err(fail(pipe_fd, Step::Dup, errno()));
                    }
                }
            }
            if libc::fcntl(script_fd, libc::F_SETFD, 0) == -1 {
                return Err(fail(pipe_fd, Step::ScriptFd, errno()));
            }
        }
        Ok(())
    };
    // SAFETY: the hook only makes async-signal-safe calls (see above) and
    // captures data moved into it before fork.
    unsafe {
        cmd.pre_exec(hook);
    }
    let spawned = cmd.spawn();
    drop(wr);
    let mut report = Vec::new();
    let _ = std::fs::File::from(rd).read_to_end(&mut report);
    drop(script);
    match spawned {
        Ok(child) => Ok(Pid::from_raw(child.id() as i32)),
        Err(source) if report.len() >= 5 => {
            let errno = i32::from_ne_bytes([report[1], report[2], report[3], report[4]]);
            Err(LaunchError::Child {
                step: step_name(report[0], plan),
                source: if source.raw_os_error().is_some() {
                    source
                } else {
                    std::io::Error::from_raw_os_error(errno)
                },
            })
        }
        Err(source) => Err(LaunchError::Exec {
            shell: plan.shell.to_string_lossy().into_owned(),
            source,
        }),
    }
}

/// Exit status and resource usage of a reaped job.
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    /// `Some(code)` if the job exited.
    pub code: Option<i32>,
    /// `Some(signal)` if a signal killed it.
    pub signal: Option<i32>,
    /// CPU times and peak RSS (wall time is filled in by the supervisor).
    pub usage: Usage,
}

/// Waits for the job leader `pid` with `wait4`, retrying on `EINTR`.
/// Blocking: call it from a blocking thread.
///
/// # Errors
/// The errno of `wait4` (e.g. `ECHILD` if someone else reaped it).
pub fn wait_child(pid: Pid) -> std::io::Result<Reaped> {
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; zeroed is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: valid pointers to locals; pid is our own child.
        let r = unsafe { libc::wait4(pid.as_raw(), &mut status, 0, &mut ru) };
        if r == pid.as_raw() {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
    let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    let usage = Usage {
        wall_secs: 0.0,
        user_cpu_secs: secs(ru.ru_utime),
        system_cpu_secs: secs(ru.ru_stime),
        max_rss_bytes: (ru.ru_maxrss.max(0) as u64).saturating_mul(1024),
    };
    let (code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (None, None)
    };
    Ok(Reaped {
        code,
        signal,
        usage,
    })
}
