//! What happens to a job whose agent was lost, and who owns a claimed job:
//! rules the controller (fencing a dead agent) and the jobagent (recovering
//! its own leases after a restart) must apply identically, so they live
//! here once (DESIGN.md, "Leases" and "Unknown outcomes"). Pure.
//!
//! **Claim markers.** A job is owned by the agent whose *claim marker*
//! exists: an empty durable queue `<c>.claim.<job id>`
//! ([`crate::topology::Topology::claim_queue`]) whose declaration arguments
//! name the claim ([`crate::topology::Topology::claim_queue_args`]).
//! RabbitMQ refuses a second declaration with other arguments
//! (`406 PRECONDITION_FAILED`, "inequivalent arg"), which makes the
//! declaration a compare-and-set that survives connection losses: an
//! agent whose declaration's reply was lost declares again and learns
//! whether the marker is its own, and an agent that receives a
//! redelivered copy of a claimed job learns that it must not run it.

use crate::messages::Job;

/// What to do with a leased job whose agent was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseFate {
    /// Return it to its pool queue with the loss counter incremented.
    Requeue {
        /// The job's pool.
        pool: String,
    },
    /// Publish `job.failed` with `reason`, and dead-letter it.
    Fail {
        /// Why, for the event and the dead letter's `x-vq-reason`.
        reason: String,
    },
}

/// Decides the fate of a leased job (`None`: its body cannot be decoded)
/// whose agent `agent` was lost, this being loss number `losses` (1 for
/// the first), with the operator's `loss_limit` (`loss_limit` in
/// `controller.toml` and `jobagent.toml`; a job lost that many times is not
/// run again). PBS `-r n` jobs are never run again (at most once).
pub fn fate(job: Option<&Job>, agent: &str, losses: u32, loss_limit: u32) -> LeaseFate {
    match job {
        None => LeaseFate::Fail {
            reason: format!("lease of lost agent {agent} cannot be decoded as a job"),
        },
        Some(j) if !j.rerunnable => LeaseFate::Fail {
            reason: format!(
                "node lost: agent {agent} died, restarted or lost its VM while the job ran; the job is not rerunnable (-r n)"
            ),
        },
        Some(_) if losses >= loss_limit => LeaseFate::Fail {
            reason: format!(
                "node lost {losses} times while running the job (last: agent {agent}; limit {loss_limit}): not run again"
            ),
        },
        Some(j) => LeaseFate::Requeue {
            pool: j.pool.clone(),
        },
    }
}

/// What a look at a job's claim marker found (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// No marker: nobody owns the job.
    Absent,
    /// The marker names the claim we asked about.
    Ours,
    /// The marker names another claim.
    Theirs,
}

/// What an agent does with one of its lease copies that no claim of the
/// running process holds (a leftover of an earlier process, or a claim
/// abandoned when a connection dropped), given the job's claim marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leftover {
    /// The copy never became the job's claim (no marker, or another
    /// claim's): remove it without a trace; the job is elsewhere.
    Discard,
    /// The copy is the job's claim: it was ours when the process or the
    /// connection was lost; recover it (republish a stored result, or
    /// decide with [`fate`]).
    Recover,
}

/// The rule for a lease copy no running claim holds.
pub fn leftover(marker: Marker) -> Leftover {
    match marker {
        Marker::Ours => Leftover::Recover,
        Marker::Absent | Marker::Theirs => Leftover::Discard,
    }
}

/// Whether the claim marker may be deleted once the job's result is
/// confirmed. A marker is kept (until its TTL,
/// [`crate::topology::CLAIM_TTL_MS`]) when a copy of the job may still be
/// queued: the pool delivery's ack was never confirmed (`ack_confirmed`
/// false: the broker may have requeued it when the connection dropped), or
/// the job came back from a lost node (`losses > 0`: its original
/// delivery's fate is unknown). A copy arriving later then finds the
/// marker and is dead-lettered instead of running the job a second time.
pub fn may_delete_marker(ack_confirmed: bool, losses: u32) -> bool {
    ack_confirmed && losses == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(rerunnable: bool) -> Job {
        let mut j: Job =
            serde_json::from_str(include_str!("../tests/fixtures/job.json")).expect("fixture");
        j.rerunnable = rerunnable;
        j
    }

    #[test]
    fn the_loss_limit_is_the_operators() {
        let j = job(true);
        for limit in [1, 3, 5] {
            for losses in 1..=6 {
                let f = fate(Some(&j), "a1", losses, limit);
                assert_eq!(
                    matches!(f, LeaseFate::Requeue { .. }),
                    losses < limit,
                    "losses {losses}, limit {limit}: {f:?}"
                );
            }
        }
    }

    #[test]
    fn a_job_that_is_not_rerunnable_is_never_requeued() {
        let f = fate(Some(&job(false)), "a1", 1, 5);
        assert!(matches!(f, LeaseFate::Fail { reason } if reason.contains("-r n")));
        assert!(matches!(fate(None, "a1", 1, 5), LeaseFate::Fail { .. }));
    }

    #[test]
    fn only_a_copy_whose_marker_is_ours_is_recovered() {
        assert_eq!(leftover(Marker::Ours), Leftover::Recover);
        assert_eq!(leftover(Marker::Absent), Leftover::Discard);
        assert_eq!(leftover(Marker::Theirs), Leftover::Discard);
    }

    #[test]
    fn a_marker_stays_while_a_copy_may_be_queued() {
        assert!(may_delete_marker(true, 0));
        assert!(!may_delete_marker(false, 0));
        assert!(!may_delete_marker(true, 1));
    }
}
