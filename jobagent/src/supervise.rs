//! Supervision of a running job: wait for it on a blocking thread, enforce
//! the walltime on the monotonic clock, honour cancel, and stop the whole
//! process group with SIGTERM then SIGKILL.

use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vq_common::messages::{Outcome, Usage};

use crate::spawn::{wait_child, Reaped};

/// Why the agent stopped a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Walltime,
    Cancelled,
}

fn signal_group(pid: Pid, sig: Signal) {
    match killpg(pid, sig) {
        Ok(()) | Err(nix::Error::ESRCH) => {}
        Err(e) => {
            warn!(pid = pid.as_raw(), signal = %sig, error = %e, "cannot signal job process group")
        }
    }
}

/// Waits for the job whose leader (and process group) is `pid`. After
/// `walltime`, or when `cancel` fires, sends SIGTERM to the group and
/// SIGKILL `grace` later. When the leader has exited, any process left in
/// its group is killed. Returns the outcome and usage (wall time measured
/// from `started` on the monotonic clock).
pub async fn supervise(
    pid: Pid,
    started: Instant,
    walltime: Duration,
    grace: Duration,
    cancel: CancellationToken,
) -> (Outcome, Usage) {
    let mut waiter = tokio::task::spawn_blocking(move || wait_child(pid));
    let deadline = tokio::time::Instant::from_std(started + walltime);
    let stop = tokio::select! {
        r = &mut waiter => return finish(pid, started, r, None),
        _ = tokio::time::sleep_until(deadline) => Stop::Walltime,
        _ = cancel.cancelled() => Stop::Cancelled,
    };
    info!(pid = pid.as_raw(), reason = ?stop, "stopping job: SIGTERM to its process group");
    signal_group(pid, Signal::SIGTERM);
    let r = tokio::select! {
        r = &mut waiter => r,
        _ = tokio::time::sleep(grace) => {
            info!(pid = pid.as_raw(), "job still running after the grace period: SIGKILL");
            signal_group(pid, Signal::SIGKILL);
            waiter.await
        }
    };
    finish(pid, started, r, Some(stop))
}

fn finish(
    pid: Pid,
    started: Instant,
    r: Result<std::io::Result<Reaped>, tokio::task::JoinError>,
    stop: Option<Stop>,
) -> (Outcome, Usage) {
    // Leftover background processes of the job die with it, as in PBS.
    signal_group(pid, Signal::SIGKILL);
    let wall = started.elapsed().as_secs_f64();
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
        (None, Some(code), _) => Outcome::Exited { code },
        (None, None, Some(signal)) => Outcome::Signaled { signal },
        (None, None, None) => Outcome::FailedToStart {
            reason: "job ended with an unknown wait status".into(),
        },
    };
    (outcome, usage)
}
