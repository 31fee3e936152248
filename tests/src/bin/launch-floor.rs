//! The launch floor of a batch job (issue 14): what any agent must do at
//! least to start a tiny job as its owner, done N times in a row on one
//! core, with nothing else: fork; in the child setgroups, setgid, setuid to
//! the owner, open two output files as the owner (stdout, stderr), exec
//! `sh -c true`; the parent waits. `scripts/bench.sh` runs it beside the
//! agent, in the same run, so the agent's figures can be read as ratios.
//!
//! Usage: `launch-floor UID GID GROUPS DIR N` (GROUPS comma separated,
//! may be empty; DIR writable by UID). Root. Prints one line
//! `floor jobs N wall_s W jobs_per_s R cpu_self_ms_per_job S cpu_children_ms_per_job C`
//! (CPU from `getrusage`: the parent's own, and the children's, which
//! includes each child's pre-exec work and `sh` itself).

#![allow(unsafe_code)] // fork(2) is the point of the program.

use std::ffi::CString;
use std::time::Instant;

use nix::fcntl::{open, OFlag};
use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::stat::Mode;
use nix::sys::wait::waitpid;
use nix::unistd::{
    dup2_stderr, dup2_stdout, execv, fork, setgid, setgroups, setuid, ForkResult, Gid, Uid,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: launch-floor UID GID GROUPS DIR N");
        std::process::exit(64);
    }
    let uid = Uid::from_raw(args[1].parse().expect("UID"));
    let gid = Gid::from_raw(args[2].parse().expect("GID"));
    let groups: Vec<Gid> = args[3]
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|g| Gid::from_raw(g.parse().expect("GROUPS")))
        .collect();
    let dir = &args[4];
    let n: usize = args[5].parse().expect("N");
    // Decide before fork: every path and argv is built in the parent.
    let sh = CString::new("/bin/sh").expect("static");
    let argv = [
        CString::new("sh").expect("static"),
        CString::new("-c").expect("static"),
        CString::new("true").expect("static"),
    ];
    let outs: Vec<(CString, CString)> = (0..n)
        .map(|i| {
            (
                CString::new(format!("{dir}/floor.o{i}")).expect("path"),
                CString::new(format!("{dir}/floor.e{i}")).expect("path"),
            )
        })
        .collect();
    let start = Instant::now();
    for (o, e) in &outs {
        // SAFETY: the child only makes async-signal-safe calls (setgroups,
        // setgid, setuid, open, dup2, execv, _exit) on data built before
        // the fork; the program has one thread.
        match unsafe { fork() }.expect("fork") {
            ForkResult::Child => {
                let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC;
                let ok = setgroups(&groups).is_ok()
                    && setgid(gid).is_ok()
                    && setuid(uid).is_ok()
                    && open(o.as_c_str(), flags, Mode::from_bits_truncate(0o600))
                        .and_then(dup2_stdout)
                        .is_ok()
                    && open(e.as_c_str(), flags, Mode::from_bits_truncate(0o600))
                        .and_then(dup2_stderr)
                        .is_ok();
                if ok {
                    let _ = execv(&sh, &argv);
                }
                // SAFETY: _exit is async-signal-safe and skips atexit work.
                unsafe { nix::libc::_exit(127) };
            }
            ForkResult::Parent { child } => {
                let status = waitpid(child, None).expect("waitpid");
                if !matches!(status, nix::sys::wait::WaitStatus::Exited(_, 0)) {
                    eprintln!("launch-floor: child ended {status:?}");
                    std::process::exit(1);
                }
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let ms = |who| {
        let u = getrusage(who).expect("getrusage");
        let tv = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e3 + t.tv_usec() as f64 / 1e3;
        (tv(u.user_time()) + tv(u.system_time())) / n as f64
    };
    println!(
        "floor jobs {n} wall_s {wall:.3} jobs_per_s {:.1} cpu_self_ms_per_job {:.3} cpu_children_ms_per_job {:.3}",
        n as f64 / wall,
        ms(UsageWho::RUSAGE_SELF),
        ms(UsageWho::RUSAGE_CHILDREN)
    );
    for (o, e) in &outs {
        let _ = std::fs::remove_file(o.to_str().unwrap_or_default());
        let _ = std::fs::remove_file(e.to_str().unwrap_or_default());
    }
}
