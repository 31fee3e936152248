//! Slot demand from the job table: per pool, the jobs known to be queued
//! and the slots they and the running jobs take ([`PoolSlots`]), so that
//! the planner counts slots, not jobs (issue 11, "Resources").

use std::collections::BTreeMap;

use vq_common::jobs::{JobTable, State};

/// One pool's jobs as the table knows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolSlots {
    /// Queued jobs (`Q`) in the table.
    pub queued_jobs: u64,
    /// Slots those queued jobs ask for (`request.slots`, 1 when unknown).
    pub queued_slots: u64,
    /// Slots of the running jobs (`R`).
    pub running_slots: u64,
}

/// [`PoolSlots`] of every pool with queued or running jobs in `table`.
pub fn pool_slots(table: &JobTable) -> BTreeMap<String, PoolSlots> {
    let mut out: BTreeMap<String, PoolSlots> = BTreeMap::new();
    table.each(&[State::Queued, State::Running], |j| {
        let slots = u64::from(j.slots);
        let p = match out.get_mut(j.pool) {
            Some(p) => p,
            None => out.entry(j.pool.to_string()).or_default(),
        };
        match j.state {
            State::Queued => {
                p.queued_jobs += 1;
                p.queued_slots += slots;
            }
            State::Running => p.running_slots += slots,
            _ => {}
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use vq_common::messages::{JobEvent, JobRequest, JobState};

    use super::*;

    fn queued(id: &str, pool: &str, slots: u32) -> JobEvent {
        let mut e = JobEvent::about(
            None,
            id,
            pool,
            "",
            Some("alice"),
            JobState::Queued {
                request: JobRequest {
                    slots,
                    ..Default::default()
                },
            },
        );
        e.owner = "alice".into();
        e.at = 1.0;
        e
    }

    #[test]
    fn queued_and_running_jobs_count_their_slots_per_pool() {
        let mut t = JobTable::new();
        t.apply(&queued("a", "p", 4), None);
        t.apply(&queued("b", "p", 1), None);
        t.apply(&queued("c", "q", 2), None);
        let mut started = JobEvent::about(None, "c", "q", "ag", Some("alice"), JobState::Started);
        started.at = 2.0;
        t.apply(&started, None);
        let s = pool_slots(&t);
        assert_eq!(
            s["p"],
            PoolSlots {
                queued_jobs: 2,
                queued_slots: 5,
                running_slots: 0
            }
        );
        assert_eq!(
            s["q"],
            PoolSlots {
                queued_jobs: 0,
                queued_slots: 0,
                running_slots: 2
            }
        );
    }
}
