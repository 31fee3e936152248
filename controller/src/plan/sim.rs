//! A simulated hour of oscillating demand fed to [`plan`] (issue 12,
//! "Flapping"): the test advances a world of its own (servers boot, agents
//! come up, take jobs, answer ask-deletes, deleted servers go) and counts
//! the boots and deletes the planner makes. Pure: no clock, no I/O.
//!
//! Demand alternates between 10 and 0 job slots every 20 s for an hour,
//! then stays 0 for 10 minutes; the pool has `min = 0`, `max = 10`,
//! `idle_secs = 30`, `cooldown_secs = 20`, as in the run that found the
//! flapping. Riding out the dips takes 10 boots, and 10 deletes once the
//! demand is gone for good: 20 actions. Flapping takes hundreds.

use super::*;
use crate::observe::{AgentSeen, AnswerSeen, Observed, ObservedServer};

/// Seconds between two controller cycles of the simulation.
const STEP: f64 = 5.0;
/// Seconds from create to the agent's first heartbeat.
const BOOT: f64 = 30.0;
/// Seconds of oscillating demand.
const HOUR: f64 = 3600.0;
/// Seconds of zero demand after it, for the pool to return to zero.
const TAIL: f64 = 600.0;

const T: Timing = Timing {
    heartbeat_timeout_secs: 60.0,
};

/// What the agents do while there is demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Work {
    /// Every agent up runs a job while the demand is above 0 (the job ends
    /// when the demand drops).
    Jobs,
    /// No job reaches the agents (the demand comes from a bridge, as in
    /// the run that found the flapping): they stay idle from their start.
    DemandOnly,
}

struct SimServer {
    id: String,
    created: f64,
    /// When the agent started pulling (first heartbeat).
    up: f64,
    /// When the agent's last job ended (its idle clock), if it ran one.
    last_end: Option<f64>,
    running: bool,
    agreed: bool,
}

/// What a simulated run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Count {
    /// Servers created.
    pub boots: u32,
    /// Servers deleted.
    pub deletes: u32,
    /// Servers left at the end.
    pub left: u32,
}

/// The pool of the run that found the flapping.
pub(super) fn flapping_pool() -> PoolConfig {
    PoolConfig {
        flavor: "f".into(),
        image: "i".into(),
        agent_broker_url: "amqp://a".into(),
        min: 0,
        max: 10,
        slots: 1,
        boot_timeout_secs: 600,
        idle_secs: 30,
        cooldown_secs: 20,
        ..PoolConfig::default()
    }
}

fn demand_at(t: f64) -> u64 {
    if t < HOUR && ((t / 20.0).floor() as u64).is_multiple_of(2) {
        10
    } else {
        0
    }
}

/// Runs the hour (plus the tail) with `pool` and `work`.
pub(super) fn run(pool: &PoolConfig, work: Work) -> Count {
    let mut servers: Vec<SimServer> = Vec::new();
    let mut count = Count::default();
    let mut last_ask: Option<f64> = None;
    let mut surplus_since: Option<f64> = None;
    let mut next = 0u32;
    let mut t = 0.0;
    while t <= HOUR + TAIL {
        let demand = demand_at(t);
        for s in servers.iter_mut().filter(|s| t >= s.up && !s.agreed) {
            let busy = work == Work::Jobs && demand > 0;
            if s.running && !busy {
                s.last_end = Some(t);
            }
            s.running = busy;
        }
        let running = servers.iter().filter(|s| s.running).count() as u64;
        let queued = demand.saturating_sub(running);
        let observed = Observed {
            pool: "p".into(),
            servers: servers
                .iter()
                .map(|s| ObservedServer {
                    id: s.id.clone(),
                    name: s.id.clone(),
                    status: if t >= s.up {
                        NovaStatus::Active
                    } else {
                        NovaStatus::Build
                    },
                    age_secs: Some(t - s.created),
                    agent: (t >= s.up).then(|| AgentSeen {
                        heartbeat_age_secs: 0.0,
                        state: if s.agreed {
                            AgentState::Drained
                        } else if s.running {
                            AgentState::Busy
                        } else {
                            AgentState::Idle
                        },
                        running: u32::from(s.running),
                        jobs: if s.running {
                            vec![format!("{}-job", s.id)]
                        } else {
                            Vec::new()
                        },
                        slots: 1,
                        is_del: s.agreed,
                        // As the agent counts it: from the later of its
                        // start of pulling and its last job's end.
                        idle_secs: if s.running {
                            0.0
                        } else {
                            t - s.last_end.unwrap_or(s.up).max(s.up)
                        },
                        answer: s.agreed.then_some(AnswerSeen {
                            age_secs: 0.0,
                            may_delete: true,
                            running: 0,
                            matched: true,
                        }),
                        drain_reason: None,
                    }),
                })
                .collect(),
            queued,
            running,
            queued_slots: queued,
            running_slots: running,
            listening_secs: t + 1000.0,
            since_scale_down_secs: last_ask.map(|a| t - a),
            surplus_secs: surplus_since.map(|s| t - s),
            ..Observed::default()
        };
        let planned = plan(&observed, pool, T);
        // As the loop keeps it (reconcile.rs).
        surplus_since = if planned.surplus {
            surplus_since.or(Some(t))
        } else {
            None
        };
        let mut asked = false;
        for a in &planned.actions {
            match a {
                Action::Boot { count: n, .. } => {
                    for _ in 0..*n {
                        next += 1;
                        servers.push(SimServer {
                            id: format!("vm{next}"),
                            created: t,
                            up: t + BOOT,
                            last_end: None,
                            running: false,
                            agreed: false,
                        });
                    }
                    count.boots += n;
                }
                Action::AskDelete { server_id, .. } => {
                    asked = true;
                    let s = servers.iter_mut().find(|s| &s.id == server_id).unwrap();
                    if !s.running {
                        s.agreed = true;
                    }
                }
                Action::Delete { server_id, .. } => {
                    servers.retain(|s| &s.id != server_id);
                    count.deletes += 1;
                }
            }
        }
        if asked {
            last_ask = Some(t);
        }
        t += STEP;
    }
    count.left = servers.len() as u32;
    count
}

#[test]
fn an_hour_of_demand_alternating_10_and_0_every_20_s_does_not_flap() {
    let pool = flapping_pool();
    let counts = [Work::DemandOnly, Work::Jobs].map(|w| (w, run(&pool, w)));
    eprintln!("{counts:?}");
    for (work, c) in counts {
        assert_eq!(c.left, 0, "{work:?}: the pool returns to zero: {c:?}");
        assert!(
            c.boots + c.deletes <= 20,
            "{work:?}: {} boots + {} deletes in an hour of oscillating demand, at most 20 (10 up, 10 down)",
            c.boots,
            c.deletes
        );
    }
}

#[test]
fn each_scale_down_hold_alone_and_none_at_all() {
    let mut pool = flapping_pool();
    // Without the holds (the rule before them): VMs that never got a job
    // are drained in every dip and booted again in the next peak.
    pool.scale_down_delay_secs = Some(0);
    pool.min_lifetime_secs = 0;
    let none = run(&pool, Work::DemandOnly);
    // The hysteresis alone rides out the dips.
    pool.scale_down_delay_secs = None;
    let delay = run(&pool, Work::DemandOnly);
    // The minimum lifetime alone bounds the churn to a round per lifetime.
    pool.scale_down_delay_secs = Some(0);
    pool.min_lifetime_secs = 300;
    let life = run(&pool, Work::DemandOnly);
    eprintln!("no hold: {none:?}; scale_down_delay_secs = idle_secs: {delay:?}; min_lifetime_secs = 300: {life:?}");
    assert!(none.boots + none.deletes > 200, "{none:?}");
    assert!(delay.boots + delay.deletes <= 20, "{delay:?}");
    assert!(
        life.boots + life.deletes < none.boots + none.deletes,
        "{life:?}"
    );
    for c in [none, delay, life] {
        assert_eq!(c.left, 0, "{c:?}");
    }
}
