//! Why a queued job waits (issue 11: "for a pending job the pool's current
//! obstacle"): one sentence per pool, made from the pool's status after
//! each cycle ([`pending_reason`]) and shown as the `reason` of its queued
//! jobs that have none of their own, in `vq stat -s`/`-f`, `/jobs` and the
//! query answers ([`JobsView::annotate`](super::JobsView::annotate)).

use crate::status::PoolStatus;

/// Why the queued jobs of a pool in state `p` wait, in words: the pool's
/// obstacle (quota, breaker, backoff, unlisted servers, `max`), else an
/// observation that failed, else the VMs booting, else the pool's agents
/// being busy, else that none is planned.
pub fn pending_reason(p: &PoolStatus) -> String {
    if let Some(o) = &p.obstacle {
        return format!("waiting: {o}");
    }
    if !p.observed {
        return match &p.last_error {
            Some(e) => format!("waiting: the controller cannot observe the pool: {e}"),
            None => "waiting: the controller has not observed the pool yet".into(),
        };
    }
    let (booting, active) = (p.vms.booting, p.vms.active);
    if booting > 0 {
        return format!(
            "waiting for a VM: {booting} booting ({active} active, target {})",
            p.target
        );
    }
    if p.agents.idle > 0 {
        return format!(
            "waiting for one of {} idle agents to pull it",
            p.agents.idle
        );
    }
    if p.agents.busy > 0 {
        return format!(
            "waiting for a free slot: {} agents busy, target {} VMs",
            p.agents.busy, p.target
        );
    }
    format!("waiting: no VM of the pool is up (target {} VMs)", p.target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{AgentCounts, VmCounts};

    #[test]
    fn the_obstacle_comes_first_then_observation_booting_and_busy_agents() {
        let mut p = PoolStatus {
            observed: true,
            target: 3,
            ..Default::default()
        };
        p.vms = VmCounts {
            booting: 2,
            active: 1,
            ..Default::default()
        };
        assert_eq!(
            pending_reason(&p),
            "waiting for a VM: 2 booting (1 active, target 3)"
        );
        p.obstacle = Some("quota exhausted: 10/10 instances".into());
        assert_eq!(
            pending_reason(&p),
            "waiting: quota exhausted: 10/10 instances"
        );
        p.obstacle = None;
        p.vms.booting = 0;
        p.agents = AgentCounts {
            busy: 1,
            ..Default::default()
        };
        assert!(pending_reason(&p).contains("free slot: 1 agents busy"));
        p.observed = false;
        p.last_error = Some("503 from nova".into());
        assert!(pending_reason(&p).contains("cannot observe the pool: 503 from nova"));
        let none = PoolStatus {
            observed: true,
            ..Default::default()
        };
        assert_eq!(
            pending_reason(&none),
            "waiting: no VM of the pool is up (target 0 VMs)"
        );
    }
}
