//! The only module with `unsafe`: fork/exec of a job with the privilege drop
//! in one `pre_exec` hook, and `wait4` for its status and rusage.
//!
//! The parent prepares everything ([`LaunchPlan`]) and builds the child's
//! steps as a value ([`steps::child_steps`]: the order, and why, is
//! documented and unit-tested there); after `fork` the child walks them
//! with [`LibcOps`], which makes only async-signal-safe system calls. The
//! job never holds its output files: the agent copies the pipes into them
//! up to `max_output_bytes` ([`crate::output`]). std's
//! `Command::uid/gid/current_dir` are not used: they run before
//! `pre_exec`, as root, and break `setgroups` (DESIGN.md, "Privilege
//! drop"). Any failing step fails the job: it never runs with partial
//! credentials.
//!
//! The script is written into a sealed `memfd` and the shell runs
//! `/proc/self/fd/N`: the owner cannot swap it, and the job's stdin stays
//! `/dev/null` so commands that read stdin cannot eat the script.
//!
//! A failing step writes its index in the step list, the kind of failure
//! and the errno into a close-on-exec pipe before returning the error; the
//! parent reads the pipe after `spawn` to name the step
//! ([`steps::ChildStep::describe`]) in `Outcome::FailedToStart`.
//!
//! Every job leader is registered in [`leaders`] while the fork happens, so
//! the zombie sweep of the child-subreaper (`supervise`) never reaps a
//! leader whose status `wait_child` must collect (no `ECHILD` races).

#![allow(unsafe_code)]

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};

use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::libc;
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::unistd::Pid;
use vq_common::messages::{Join, Usage};

use crate::error::LaunchError;
use crate::plan::LaunchPlan;

pub mod steps;

use steps::{child_steps, run_steps, ChildFds, ChildOps, ChildStep, StepError};

/// `oom_score_adj` every job starts with (the agent itself runs at
/// [`AGENT_OOM_SCORE_ADJ`], so the kernel's OOM killer picks a job first).
/// If the agent could not lower its own value (no `CAP_SYS_RESOURCE`, e.g.
/// in a container), jobs get the agent's value when that is higher.
pub const JOB_OOM_SCORE_ADJ: i32 = 0;

/// `oom_score_adj` of the agent: never chosen by the OOM killer.
pub const AGENT_OOM_SCORE_ADJ: i32 = -1000;

static LEADERS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// The pids of job leaders not yet reaped by [`wait_child`]. Hold the guard
/// while sweeping zombies so no leader is reaped by the sweep.
pub fn leaders() -> MutexGuard<'static, BTreeSet<i32>> {
    LEADERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lowest fd number used for the script and the spawn pipe, so that std's
/// stdio setup (fds 0-2) can never clobber them.
const MIN_FD: RawFd = 10;

/// Highest signal number of the kernel (`_NSIG`; realtime signals included).
const KERNEL_NSIG: libc::c_int = 64;

/// The kernel's `struct sigaction` for `rt_sigaction(2)` on x86_64 and
/// aarch64 (handler, flags, restorer, mask): the raw call also resets
/// signals 32 and 33, which glibc and musl reserve and their `sigaction`
/// refuses, but which a parent may have ignored.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("KernelSigaction has the layout of x86_64 and aarch64 only");

#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// Sets every signal but SIGKILL/SIGSTOP (1..=[`KERNEL_NSIG`]) to `SIG_DFL`
/// and unblocks all of them. Returns the errno of a failed call.
///
/// # Safety
/// Async-signal-safe (raw `rt_sigaction`/`rt_sigprocmask` on stack data);
/// call it in the forked child only (handlers of the parent are gone).
unsafe fn reset_signals() -> Result<(), i32> {
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    let sigset_size = std::mem::size_of::<u64>();
    for sig in 1..=KERNEL_NSIG {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: `dfl` is a valid kernel sigaction; no old action wanted.
        let r = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                &dfl as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                sigset_size,
            )
        };
        if r == -1 {
            return Err(errno());
        }
    }
    let empty: u64 = 0;
    // SAFETY: a valid empty kernel sigset; no old mask wanted.
    let r = unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            sigset_size,
        )
    };
    if r == -1 {
        return Err(errno());
    }
    Ok(())
}

/// `keyctl(2)` operation that joins a new anonymous session keyring when
/// given a NULL name (`<linux/keyctl.h>`; not in the libc crate).
const KEYCTL_JOIN_SESSION_KEYRING: libc::c_long = 1;

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

/// Length of a failure report on the spawn pipe: step index, kind (0 =
/// errno, 1 = not a regular file), errno (native endian).
const REPORT_LEN: usize = 6;

/// Reports the failed step at `index` through the spawn pipe and returns
/// the error for std. Async-signal-safe: one `write`, no allocation.
fn fail(pipe: RawFd, index: usize, why: StepError) -> std::io::Error {
    let err = why.errno();
    let e = err.to_ne_bytes();
    let kind = u8::from(matches!(why, StepError::NotRegular(_)));
    let msg: [u8; REPORT_LEN] = [index as u8, kind, e[0], e[1], e[2], e[3]];
    // SAFETY: writing a stack buffer to an fd we own; the result is ignored
    // on purpose (the parent treats a short report as an unknown step).
    unsafe {
        libc::write(pipe, msg.as_ptr().cast(), msg.len());
    }
    std::io::Error::from_raw_os_error(err)
}

/// The real [`ChildOps`]: the libc calls of each step, in the forked child
/// only (it is private to this module and made only in [`spawn`]'s
/// `pre_exec` hook). Holds the output files opened so far, for
/// [`ChildStep::PassOutputs`].
struct LibcOps {
    outputs: [RawFd; 2],
    opened: usize,
}

impl ChildOps for LibcOps {
    fn run(&mut self, step: &ChildStep) -> Result<(), StepError> {
        let check = |r: libc::c_int| {
            if r == -1 {
                Err(StepError::Errno(errno()))
            } else {
                Ok(())
            }
        };
        // SAFETY: every call below is an async-signal-safe system call on
        // data prepared before fork (no allocation, no locks); `LibcOps`
        // runs in the forked child only.
        unsafe {
            match step {
                ChildStep::ResetSignals => reset_signals().map_err(StepError::Errno),
                ChildStep::JoinCgroup { procs } => {
                    if libc::write(*procs, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(StepError::Errno(errno()));
                    }
                    Ok(())
                }
                ChildStep::OomScoreAdj { value } => {
                    let oom = libc::open(
                        c"/proc/self/oom_score_adj".as_ptr(),
                        libc::O_WRONLY | libc::O_CLOEXEC,
                    );
                    if oom == -1
                        || libc::write(oom, value.as_ptr().cast(), value.len())
                            != value.len() as isize
                    {
                        return Err(StepError::Errno(errno()));
                    }
                    libc::close(oom);
                    Ok(())
                }
                ChildStep::LimitProcs { max } => {
                    let limit = libc::rlimit {
                        rlim_cur: *max as libc::rlim_t,
                        rlim_max: *max as libc::rlim_t,
                    };
                    check(libc::setrlimit(libc::RLIMIT_NPROC, &limit))
                }
                ChildStep::Setsid => check(libc::setsid()),
                ChildStep::SetGroups { groups } => {
                    check(libc::setgroups(groups.len(), groups.as_ptr()))
                }
                ChildStep::SetGid { gid } => check(libc::setresgid(*gid, *gid, *gid)),
                ChildStep::SetUid { uid } => check(libc::setresuid(*uid, *uid, *uid)),
                ChildStep::RefuseRoot => {
                    if libc::setuid(0) != -1 || libc::setgid(0) != -1 || libc::geteuid() == 0 {
                        return Err(StepError::Errno(libc::EPERM));
                    }
                    Ok(())
                }
                ChildStep::SessionKeyring => {
                    // ENOSYS: a kernel without keys support has no keyring
                    // to inherit.
                    if libc::syscall(
                        libc::SYS_keyctl,
                        KEYCTL_JOIN_SESSION_KEYRING,
                        std::ptr::null::<libc::c_char>(),
                    ) == -1
                    {
                        let e = errno();
                        if e != libc::ENOSYS {
                            return Err(StepError::Errno(e));
                        }
                    }
                    Ok(())
                }
                ChildStep::Umask { mask } => {
                    libc::umask(*mask as libc::mode_t);
                    Ok(())
                }
                ChildStep::Chdir { dir } => check(libc::chdir(dir.as_ptr())),
                ChildStep::CheckShell { shell } => {
                    let mut st: libc::stat = std::mem::zeroed();
                    check(libc::stat(shell.as_ptr(), &mut st))?;
                    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                        return Err(StepError::NotRegular(libc::EACCES));
                    }
                    check(libc::access(shell.as_ptr(), libc::X_OK))
                }
                ChildStep::OpenOutput { path, .. } => {
                    let fd = match open_output(path) {
                        Ok(fd) => fd,
                        Err(OpenFail::Errno(e)) => return Err(StepError::Errno(e)),
                        Err(OpenFail::NotRegular) => {
                            return Err(StepError::NotRegular(libc::EINVAL))
                        }
                    };
                    if self.opened < self.outputs.len() {
                        self.outputs[self.opened] = fd;
                        self.opened += 1;
                    }
                    Ok(())
                }
                ChildStep::PassOutputs { socket } => {
                    if send_fds(*socket, &self.outputs[..self.opened]) != 1 {
                        return Err(StepError::Errno(errno()));
                    }
                    Ok(())
                }
                ChildStep::DupPipes { stdout, stderr } => {
                    check(libc::dup2(*stdout, 1))?;
                    check(libc::dup2(*stderr, 2))
                }
                ChildStep::CloexecFrom3 => {
                    cloexec_from_3();
                    Ok(())
                }
                ChildStep::ScriptInheritable { fd } => check(libc::fcntl(*fd, libc::F_SETFD, 0)),
            }
        }
    }
}

/// Why [`open_output`] failed.
#[derive(Clone, Copy)]
enum OpenFail {
    /// `open` or `fcntl` failed with this errno.
    Errno(i32),
    /// The path is a FIFO, socket or device other than `/dev/null`.
    NotRegular,
}

/// Opens `path` for writing as the current (already dropped) user. The open
/// is non-blocking and anything but a regular file or `/dev/null` is
/// refused: a FIFO planted at the output path would otherwise block the
/// launch (before exec, so outside walltime and cancel) until someone opens
/// its other end.
///
/// # Safety
/// Async-signal-safe (`open`, `fstat`, `fcntl`, `close`); `path` must be a
/// valid C string.
unsafe fn open_output(path: &CStr) -> Result<RawFd, OpenFail> {
    // SAFETY: `path` is NUL-terminated; flags and mode are plain integers;
    // `st` is a plain C struct the kernel fills.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_WRONLY
                | libc::O_CREAT
                | libc::O_TRUNC
                | libc::O_NOFOLLOW
                | libc::O_CLOEXEC
                | libc::O_NONBLOCK,
            0o600 as libc::c_uint,
        );
        if fd == -1 {
            // ENXIO: a FIFO without a reader (or a device without a driver)
            // refused by O_NONBLOCK.
            let e = errno();
            return Err(if e == libc::ENXIO {
                OpenFail::NotRegular
            } else {
                OpenFail::Errno(e)
            });
        }
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) == -1 {
            let e = errno();
            libc::close(fd);
            return Err(OpenFail::Errno(e));
        }
        let kind = st.st_mode & libc::S_IFMT;
        let dev_null = kind == libc::S_IFCHR && st.st_rdev == libc::makedev(1, 3);
        if kind != libc::S_IFREG && !dev_null {
            libc::close(fd);
            return Err(OpenFail::NotRegular);
        }
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags == -1 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == -1 {
            let e = errno();
            libc::close(fd);
            return Err(OpenFail::Errno(e));
        }
        Ok(fd)
    }
}

/// Marks every descriptor from 3 up close-on-exec, so that a job inherits
/// nothing the agent (or whatever started it) had open. Uses `close_range`
/// (Linux 5.11) and falls back to `fcntl` on the first 65536 descriptors.
///
/// # Safety
/// Async-signal-safe.
unsafe fn cloexec_from_3() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: raw syscalls on integer arguments only.
    unsafe {
        if libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        ) == 0
        {
            return;
        }
        for fd in 3..65536 {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}

/// One output stream of a started job.
#[derive(Debug)]
pub struct OutputStream {
    /// Read end of the pipe the job writes into (close-on-exec).
    pub pipe: OwnedFd,
    /// The output file as the job opened it, as the owner, received over
    /// `SCM_RIGHTS`; `None` only if the fd never arrived (the stream is
    /// then drained into nothing).
    pub file: Option<OwnedFd>,
}

/// A started job: its leader and its output streams.
#[derive(Debug)]
pub struct Spawned {
    /// Leader pid, also its process group and session id.
    pub pid: Pid,
    /// `[stdout, stderr]`, or one stream for both with `-j oe`/`eo`.
    pub outputs: Vec<OutputStream>,
}

fn socketpair() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds: [libc::c_int; 2] = [-1, -1];
    // SAFETY: `fds` is a valid out-array of two ints.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r == -1 {
        return Err(LaunchError::Prepare {
            what: "create the fd-passing socket",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: socketpair returned two new descriptors that nothing owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends `fds` (1 or 2) with one byte over `sock`. Async-signal-safe: stack
/// buffers only.
///
/// # Safety
/// `sock` must be a connected `AF_UNIX` socket; `fds` valid descriptors.
unsafe fn send_fds(sock: RawFd, fds: &[RawFd]) -> libc::ssize_t {
    let mut byte = [b'F'; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // u64 elements give the alignment cmsghdr needs.
    let mut control = [0u64; 8];
    let n = fds.len().min(2);
    let payload = (n * std::mem::size_of::<RawFd>()) as libc::c_uint;
    // SAFETY (whole block): msghdr/cmsghdr are plain data filled in place;
    // CMSG_* are pointer arithmetic within `control`, which is large
    // enough for two fds (CMSG_SPACE(8) = 24 bytes on 64-bit Linux).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(payload) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), n);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    }
}

/// Receives the fds sent by [`send_fds`], without blocking.
fn recv_fds(sock: &OwnedFd) -> std::io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; 8];
    let mut out = Vec::new();
    // SAFETY: as in `send_fds`; the kernel writes at most msg_controllen
    // bytes into `control`, and every fd it delivers is new and ours.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let r = libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        );
        if r == -1 {
            return Err(std::io::Error::last_os_error());
        }
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    out.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(out)
}

/// Starts the job of `plan`, in the cgroup whose `cgroup.procs` is open as
/// `cgroup_procs` (if any). `rlimit_nproc`: the job's process limit when
/// no `pids.max` enforces it; the child then sets `RLIMIT_NPROC` (soft and
/// hard, so the job cannot raise it) before it drops privileges. The kernel
/// counts that limit over every process of the owner's uid, not only the
/// job's. Returns its pid, which is also its process group and session id,
/// and the output fds. Blocking (forks and waits for exec): call it from a
/// blocking thread.
///
/// # Errors
/// [`LaunchError::Prepare`] before fork, [`LaunchError::Child`] naming the
/// failed step in the child, [`LaunchError::Exec`] if the shell cannot be
/// executed.
pub fn spawn(
    plan: &LaunchPlan,
    cgroup_procs: Option<&OwnedFd>,
    rlimit_nproc: Option<u64>,
) -> Result<Spawned, LaunchError> {
    let script = script_memfd(&plan.script)?;
    let script_fd = script.as_raw_fd();
    let (rd, wr) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Prepare {
        what: "create the spawn pipe",
        source: e.into(),
    })?;
    let wr = high_fd(wr, "move the spawn pipe")?;
    let pipe_fd = wr.as_raw_fd();
    let (fd_rx, fd_tx) = socketpair()?;
    let fd_tx = high_fd(fd_tx, "move the fd-passing socket")?;
    let sock_fd = fd_tx.as_raw_fd();
    // The output pipes: read ends stay here, write ends become fds 1 and 2.
    let streams = if matches!(plan.join, Join::N) { 2 } else { 1 };
    let mut pipe_rd = Vec::new();
    let mut pipe_wr = Vec::new();
    for _ in 0..streams {
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Prepare {
            what: "create an output pipe",
            source: e.into(),
        })?;
        pipe_rd.push(r);
        pipe_wr.push(high_fd(w, "move an output pipe")?);
    }
    let out_pipe = pipe_wr[0].as_raw_fd();
    let err_pipe = pipe_wr[streams - 1].as_raw_fd();

    let shell =
        std::ffi::OsStr::new(std::str::from_utf8(plan.shell.to_bytes()).unwrap_or("/bin/sh"));
    let mut cmd = Command::new(shell);
    cmd.arg(format!("/proc/self/fd/{script_fd}"))
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());

    let agent_oom = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .unwrap_or(JOB_OOM_SCORE_ADJ);
    let fds = ChildFds {
        cgroup_procs: cgroup_procs.map(AsRawFd::as_raw_fd),
        socket: sock_fd,
        stdout_pipe: out_pipe,
        stderr_pipe: err_pipe,
        script: script_fd,
    };
    let steps = child_steps(plan, &fds, JOB_OOM_SCORE_ADJ.max(agent_oom), rlimit_nproc);
    let named = steps.clone();
    let mut ops = LibcOps {
        outputs: [-1; 2],
        opened: 0,
    };
    let hook = move || -> std::io::Result<()> {
        run_steps(&mut ops, &steps).map_err(|(i, why)| fail(pipe_fd, i, why))
    };
    // SAFETY: the hook only walks `steps` with `LibcOps`, whose calls are
    // async-signal-safe (see there), on data moved into it before fork.
    unsafe {
        cmd.pre_exec(hook);
    }
    let spawned = {
        // Registered under the lock, so the zombie sweep never sees this
        // leader unregistered.
        let mut leaders = leaders();
        let spawned = cmd.spawn();
        if let Ok(child) = &spawned {
            leaders.insert(child.id() as i32);
        }
        spawned
    };
    drop(wr);
    drop(fd_tx);
    // Only the job may hold the write ends: end of file when it is gone.
    drop(pipe_wr);
    let mut report = Vec::new();
    let _ = std::fs::File::from(rd).read_to_end(&mut report);
    drop(script);
    match spawned {
        Ok(child) => {
            let pid = Pid::from_raw(child.id() as i32);
            // The child sent its fds before exec, and exec has happened.
            let mut files = recv_fds(&fd_rx).unwrap_or_default().into_iter();
            let outputs = pipe_rd
                .into_iter()
                .map(|pipe| OutputStream {
                    pipe,
                    file: files.next(),
                })
                .collect();
            Ok(Spawned { pid, outputs })
        }
        Err(source) if report.len() >= REPORT_LEN => {
            let errno = i32::from_ne_bytes([report[2], report[3], report[4], report[5]]);
            let why = if report[1] == 1 {
                StepError::NotRegular(errno)
            } else {
                StepError::Errno(errno)
            };
            Err(LaunchError::Child {
                step: named.get(usize::from(report[0])).map_or_else(
                    || format!("unknown step {}", report[0]),
                    |s| s.describe(why),
                ),
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
            leaders().remove(&pid.as_raw());
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
