//! Tests of the scaling rule: examples of each decision and the
//! properties of `plan()` (proptest).

use super::*;
use crate::observe::{AgentSeen, AnswerSeen};
use proptest::prelude::*;

const T: Timing = Timing {
    heartbeat_timeout_secs: 60.0,
};

fn pool(min: u32, max: u32, slots: u32) -> PoolConfig {
    PoolConfig {
        flavor: "f".into(),
        image: "i".into(),
        agent_broker_url: "amqp://a".into(),
        min,
        max,
        slots,
        boot_timeout_secs: 600,
        idle_secs: 60,
        cooldown_secs: 30,
        // Off here: the scale-down holds have tests of their own.
        scale_down_delay_secs: Some(0),
        min_lifetime_secs: 0,
        ..PoolConfig::default()
    }
}

fn agent(running: u32, idle_secs: f64, hb_age: f64) -> AgentSeen {
    AgentSeen {
        heartbeat_age_secs: hb_age,
        state: if running > 0 {
            AgentState::Busy
        } else {
            AgentState::Idle
        },
        running,
        jobs: (0..running).map(|i| format!("job-{i}")).collect(),
        slots: running.max(1),
        is_del: false,
        idle_secs,
        answer: None,
        drain_reason: None,
    }
}

fn srv(name: &str, status: NovaStatus, age: f64, agent: Option<AgentSeen>) -> ObservedServer {
    ObservedServer {
        id: format!("id-{name}"),
        name: name.into(),
        status,
        age_secs: Some(age),
        agent,
    }
}

fn obs(servers: Vec<ObservedServer>, queued: u64, running: u64) -> Observed {
    Observed {
        pool: "cms".into(),
        servers,
        queued,
        running,
        queued_slots: queued,
        running_slots: running,
        quota_remaining: None,
        quota: Default::default(),
        listening_secs: 1000.0,
        since_scale_down_secs: None,
        since_boot_failure_secs: None,
        surplus_secs: None,
        boot_obstacle: None,
        unlisted_created: 0,
        configured_slots: 0,
        boot_gate: Default::default(),
    }
}

fn boots(p: &Plan) -> u32 {
    p.actions
        .iter()
        .map(|a| match a {
            Action::Boot { count, .. } => *count,
            _ => 0,
        })
        .sum()
}

fn deletes(p: &Plan) -> Vec<(String, DeleteCause)> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::Delete { name, cause, .. } => Some((name.clone(), *cause)),
            _ => None,
        })
        .collect()
}

fn asks(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::AskDelete { agent, .. } => Some(agent.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_boot_obstacle_holds_boots_but_not_deletes() {
    let mut o = obs(vec![srv("e", NovaStatus::Error, 10.0, None)], 5, 0);
    o.boot_obstacle = Some("server x is missing from the listings".into());
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 0);
    assert_eq!(deletes(&p).len(), 1);
    assert!(p
        .held
        .iter()
        .any(|h| h.contains("missing from the listings")));
}

#[test]
fn created_servers_not_listed_yet_count_as_booting() {
    let mut o = obs(vec![], 3, 0);
    o.unlisted_created = 2;
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!((p.booting, boots(&p)), (2, 1));
    let p = plan(&o, &pool(0, 2, 1), T);
    assert_eq!(boots(&p), 0, "max counts them");
}

#[test]
fn queued_jobs_boot_vms_by_slots_up_to_max() {
    let p = plan(&obs(vec![], 7, 0), &pool(0, 10, 2), T);
    assert_eq!(p.target, 4);
    assert_eq!(boots(&p), 4);
    assert!(p.actions[0].reason().contains("7 queued"));
    let p = plan(&obs(vec![], 100, 0), &pool(0, 3, 1), T);
    assert_eq!(boots(&p), 3);
}

#[test]
fn min_is_kept_without_demand() {
    let p = plan(&obs(vec![], 0, 0), &pool(2, 5, 1), T);
    assert_eq!(boots(&p), 2);
}

#[test]
fn booting_servers_count_so_a_rerun_boots_nothing_more() {
    let s = vec![
        srv("a", NovaStatus::Build, 5.0, None),
        srv("b", NovaStatus::Active, 50.0, None),
    ];
    let p = plan(&obs(s, 2, 0), &pool(0, 10, 1), T);
    assert_eq!(p.booting, 2);
    assert!(p.actions.is_empty(), "{:?}", p.actions);
}

#[test]
fn quota_limits_boots() {
    let mut o = obs(vec![], 10, 0);
    o.quota_remaining = Some(3);
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 3);
    assert!(p.held.iter().any(|h| h.contains("quota")));
    // The first limit that cut the boots is the pool's obstacle.
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA);
    assert!(
        l.reason.contains("10 more VM(s) wanted, 3 allowed"),
        "{}",
        l.reason
    );
}

fn quota(max_instances: u32, used_instances: u32) -> crate::openstack::Quota {
    crate::openstack::Quota {
        max_instances: Some(max_instances),
        used_instances,
        max_cores: Some(100),
        used_cores: 2 * used_instances,
        max_ram_mib: Some(1 << 20),
        used_ram_mib: 2048 * u64::from(used_instances),
    }
}

#[test]
fn a_full_quota_is_the_obstacle_in_words_with_its_figures() {
    use crate::observe::QuotaView;
    // 10/10 instances: nothing allowed.
    let mut o = obs(vec![], 3, 0);
    o.quota = QuotaView::Read(quota(10, 10));
    o.quota_remaining = quota(10, 10).remaining();
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 0);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA);
    assert_eq!(
        l.reason,
        "quota exhausted: 10/10 instances; 3 more VM(s) wanted, 0 allowed"
    );
    // 8/10 read, but an earlier pool of the cycle booted 2: this pool's
    // turn sees 10/10.
    o.quota = QuotaView::Read(quota(10, 8));
    o.quota_remaining = Some(0);
    let l = plan(&o, &pool(0, 10, 1), T).limited.expect("limited");
    assert!(
        l.reason.starts_with("quota exhausted: 10/10 instances;"),
        "{}",
        l.reason
    );
    // Nearly exhausted: 1 of 3 allowed.
    o.quota_remaining = Some(1);
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 1);
    assert_eq!(
        p.limited.expect("limited").reason,
        "quota nearly exhausted: 9/10 instances; 3 more VM(s) wanted, 1 allowed"
    );
    // Cores used up, instances free: the cores are named.
    let mut q = quota(10, 2);
    q.max_cores = Some(4);
    q.used_cores = 4;
    o.quota = QuotaView::Read(q);
    o.quota_remaining = q.remaining();
    assert_eq!(o.quota_remaining, Some(0));
    let l = plan(&o, &pool(0, 10, 1), T).limited.expect("limited");
    assert!(
        l.reason.starts_with("quota exhausted: 4/4 cores;"),
        "{}",
        l.reason
    );
    // RAM used up.
    let mut q = quota(10, 2);
    q.max_ram_mib = Some(4096);
    o.quota = QuotaView::Read(q);
    o.quota_remaining = q.remaining();
    let l = plan(&o, &pool(0, 10, 1), T).limited.expect("limited");
    assert!(
        l.reason.starts_with("quota exhausted: 4096/4096 MiB RAM;"),
        "{}",
        l.reason
    );
    // Unreadable: nothing booted, the cause said.
    o.quota = QuotaView::Unreadable("HTTP 503 from /limits".into());
    o.quota_remaining = Some(0);
    let l = plan(&o, &pool(0, 10, 1), T).limited.expect("limited");
    assert!(
        l.reason
            .starts_with("quota could not be read: HTTP 503 from /limits;"),
        "{}",
        l.reason
    );
    // Unlimited instances and free cores: no quota limit at all.
    let q = crate::openstack::Quota {
        max_instances: None,
        ..quota(0, 2)
    };
    o.quota = QuotaView::Read(q);
    o.quota_remaining = q.remaining();
    assert_eq!(plan(&o, &pool(0, 10, 1), T).limited, None);
}

#[test]
fn the_binding_limit_is_named_and_none_when_all_are_made() {
    // max 4 cuts 10 to 4, the quota allows more: max binds.
    let mut o = obs(vec![], 10, 0);
    o.quota_remaining = Some(5);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 4);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_MAX);
    assert!(
        l.reason.contains("pool at max 4: 10 job slots need 10 VMs"),
        "{}",
        l.reason
    );
    // max 4 cuts first, but the quota allows fewer: the quota binds.
    o.quota_remaining = Some(2);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 2);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA);
    assert!(
        l.reason.ends_with("4 more VM(s) wanted, 2 allowed"),
        "{}",
        l.reason
    );
    // A failed boot's cooldown.
    let mut o = obs(vec![], 1, 0);
    o.since_boot_failure_secs = Some(5.0);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(p.limited.map(|l| l.kind), Some(LIMIT_COOLDOWN));
    // Every wanted boot made: nothing limited.
    let p = plan(&obs(vec![], 2, 0), &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 2);
    assert!(p.limited.is_none());
}

#[test]
fn a_failed_boot_holds_boots_for_the_cooldown() {
    let mut o = obs(vec![], 10, 0);
    o.since_boot_failure_secs = Some(5.0);
    assert_eq!(boots(&plan(&o, &pool(0, 10, 1), T)), 0);
    o.since_boot_failure_secs = Some(31.0);
    assert_eq!(boots(&plan(&o, &pool(0, 10, 1), T)), 10);
}

#[test]
fn error_and_stuck_and_black_hole_servers_are_deleted_and_replaced() {
    let s = vec![
        srv("err", NovaStatus::Error, 10.0, None),
        srv("stuck", NovaStatus::Build, 700.0, None),
        srv("hole", NovaStatus::Active, 700.0, None),
    ];
    let p = plan(&obs(s, 3, 0), &pool(0, 3, 1), T);
    let d = deletes(&p);
    assert_eq!(
        d,
        vec![
            ("err".into(), DeleteCause::Error),
            ("stuck".into(), DeleteCause::StuckBuild),
            ("hole".into(), DeleteCause::BlackHole)
        ]
    );
    assert_eq!(boots(&p), 3, "replacements fit under max once deleted");
}

#[test]
fn nothing_is_judged_dead_before_the_controller_listened_a_heartbeat_timeout() {
    let s = vec![
        srv("hole", NovaStatus::Active, 700.0, None),
        srv(
            "dead",
            NovaStatus::Active,
            700.0,
            Some(agent(1, 0.0, 120.0)),
        ),
    ];
    let mut o = obs(s, 0, 0);
    o.listening_secs = 30.0;
    let p = plan(&o, &pool(0, 3, 1), T);
    assert!(deletes(&p).is_empty(), "{:?}", p.actions);
    assert_eq!(p.classes, vec![Class::Unknown, Class::Unknown]);
    o.listening_secs = 61.0;
    let p = plan(&o, &pool(0, 3, 1), T);
    assert_eq!(
        deletes(&p),
        vec![
            ("hole".into(), DeleteCause::BlackHole),
            ("dead".into(), DeleteCause::Dead)
        ]
    );
    assert!(p
        .actions
        .iter()
        .any(|a| a.reason().contains("1 running job")));
}

#[test]
fn idle_agents_are_asked_busy_ones_never() {
    let s = vec![
        srv("busy", NovaStatus::Active, 900.0, Some(agent(1, 0.0, 2.0))),
        srv(
            "idle-long",
            NovaStatus::Active,
            900.0,
            Some(agent(0, 500.0, 2.0)),
        ),
        srv(
            "idle-short",
            NovaStatus::Active,
            900.0,
            Some(agent(0, 10.0, 2.0)),
        ),
        srv(
            "idle-mid",
            NovaStatus::Active,
            900.0,
            Some(agent(0, 100.0, 2.0)),
        ),
    ];
    let p = plan(&obs(s, 0, 1), &pool(0, 10, 1), T);
    assert_eq!(p.target, 1);
    assert_eq!(
        asks(&p),
        vec!["idle-long".to_string(), "idle-mid".to_string()]
    );
    assert!(deletes(&p).is_empty());
}

#[test]
fn scale_down_respects_min_and_cooldown() {
    let s = vec![
        srv("a", NovaStatus::Active, 900.0, Some(agent(0, 500.0, 2.0))),
        srv("b", NovaStatus::Active, 900.0, Some(agent(0, 500.0, 2.0))),
    ];
    let mut o = obs(s, 0, 0);
    assert_eq!(asks(&plan(&o, &pool(1, 10, 1), T)).len(), 1);
    o.since_scale_down_secs = Some(3.0);
    assert!(asks(&plan(&o, &pool(1, 10, 1), T)).is_empty());
}

#[test]
fn an_agreeing_agent_is_deleted_but_not_if_it_runs_a_job() {
    let mut yes = agent(0, 500.0, 5.0);
    yes.answer = Some(AnswerSeen {
        age_secs: 1.0,
        may_delete: true,
        running: 0,
        matched: true,
    });
    let mut no = agent(1, 0.0, 5.0);
    no.answer = Some(AnswerSeen {
        age_secs: 1.0,
        may_delete: false,
        running: 1,
        matched: true,
    });
    let mut del_but_busy = agent(1, 0.0, 1.0);
    del_but_busy.is_del = true;
    let s = vec![
        srv("yes", NovaStatus::Active, 900.0, Some(yes)),
        srv("no", NovaStatus::Active, 900.0, Some(no)),
        srv("odd", NovaStatus::Active, 900.0, Some(del_but_busy)),
    ];
    let p = plan(&obs(s, 0, 0), &pool(0, 10, 1), T);
    assert_eq!(deletes(&p), vec![("yes".into(), DeleteCause::Agreed)]);
}

fn yes(matched: bool, age_secs: f64) -> Option<AnswerSeen> {
    Some(AnswerSeen {
        age_secs,
        may_delete: true,
        running: 0,
        matched,
    })
}

#[test]
fn only_a_yes_matched_to_our_request_id_deletes() {
    // A yes to a request this controller never sent (forged, or from
    // before a restart) deletes nothing.
    let mut stranger = agent(0, 500.0, 5.0);
    stranger.answer = yes(false, 1.0);
    let p = plan(
        &obs(
            vec![srv("a", NovaStatus::Active, 900.0, Some(stranger.clone()))],
            5,
            0,
        ),
        &pool(0, 10, 1),
        T,
    );
    assert!(deletes(&p).is_empty(), "{:?}", p.actions);
    // The same with a matching request id is deleted.
    stranger.answer = yes(true, 1.0);
    let p = plan(
        &obs(
            vec![srv("a", NovaStatus::Active, 900.0, Some(stranger))],
            5,
            0,
        ),
        &pool(0, 10, 1),
        T,
    );
    assert_eq!(deletes(&p), vec![("a".into(), DeleteCause::Agreed)]);
}

#[test]
fn decisions_about_an_agent_drained_by_an_operator_give_the_operators_reason() {
    let mut drained = agent(0, 500.0, 2.0);
    drained.state = AgentState::Drained;
    drained.is_del = true;
    drained.drain_reason = Some("kernel update, ticket 4711".into());
    let s = vec![srv("d", NovaStatus::Active, 900.0, Some(drained.clone()))];
    let p = plan(&obs(s, 0, 0), &pool(0, 10, 1), T);
    assert_eq!(asks(&p), vec!["d".to_string()]);
    assert!(
        p.actions[0]
            .reason()
            .ends_with("; drained by an operator: kernel update, ticket 4711"),
        "{:?}",
        p.actions
    );
    drained.answer = yes(true, 1.0);
    let s = vec![srv("d", NovaStatus::Active, 900.0, Some(drained))];
    let p = plan(&obs(s, 0, 0), &pool(0, 10, 1), T);
    assert_eq!(deletes(&p), vec![("d".into(), DeleteCause::Agreed)]);
    assert!(
        p.actions[0]
            .reason()
            .contains("drained by an operator: kernel update"),
        "{:?}",
        p.actions
    );
}

#[test]
fn is_del_alone_is_not_enough_the_agent_is_asked_again() {
    // After a controller restart: the heartbeat says is_del, but no
    // matching answer is known.
    let mut del = agent(0, 500.0, 2.0);
    del.is_del = true;
    del.state = AgentState::Drained;
    let mut drained = agent(0, 500.0, 2.0);
    drained.state = AgentState::Drained;
    let mut del_busy = agent(1, 0.0, 2.0);
    del_busy.is_del = true;
    del_busy.state = AgentState::Draining;
    let s = vec![
        srv("del", NovaStatus::Active, 900.0, Some(del.clone())),
        srv("drained", NovaStatus::Active, 900.0, Some(drained)),
        srv("busy", NovaStatus::Active, 900.0, Some(del_busy)),
    ];
    let p = plan(&obs(s, 0, 1), &pool(0, 10, 1), T);
    assert!(deletes(&p).is_empty(), "{:?}", p.actions);
    assert_eq!(asks(&p), vec!["del".to_string(), "drained".to_string()]);
    assert!(p.actions[0].reason().contains("no matching yes"));
    // Its fresh yes, matched, arrives (older than the next heartbeat,
    // which still says is_del): deleted.
    del.answer = yes(true, 4.0);
    let p = plan(
        &obs(
            vec![srv("del", NovaStatus::Active, 900.0, Some(del.clone()))],
            0,
            0,
        ),
        &pool(0, 10, 1),
        T,
    );
    assert_eq!(deletes(&p), vec![("del".into(), DeleteCause::Agreed)]);
    assert!(asks(&p).is_empty());
    // A later heartbeat showing a job running wins over the yes.
    del.running = 1;
    let p = plan(
        &obs(vec![srv("del", NovaStatus::Active, 900.0, Some(del))], 0, 1),
        &pool(0, 10, 1),
        T,
    );
    assert!(deletes(&p).is_empty(), "{:?}", p.actions);
}

#[test]
fn a_dead_agent_is_deleted_without_any_answer() {
    let s = vec![srv(
        "gone",
        NovaStatus::Active,
        900.0,
        Some(agent(0, 0.0, 120.0)),
    )];
    let p = plan(&obs(s, 0, 0), &pool(0, 10, 1), T);
    assert_eq!(deletes(&p), vec![("gone".into(), DeleteCause::Dead)]);
}

#[test]
fn scale_down_waits_until_the_surplus_has_lasted_the_delay() {
    let s = vec![
        srv("a", NovaStatus::Active, 900.0, Some(agent(0, 500.0, 2.0))),
        srv("b", NovaStatus::Active, 900.0, Some(agent(0, 500.0, 2.0))),
    ];
    let mut p = pool(0, 10, 1);
    p.scale_down_delay_secs = None; // = idle_secs, 60
    assert_eq!(p.scale_down_delay(), 60);
    let mut o = obs(s, 0, 0);
    // The first cycle with a surplus: none recorded yet.
    let pl = plan(&o, &p, T);
    assert!(pl.surplus);
    assert!(asks(&pl).is_empty(), "{:?}", pl.actions);
    assert!(
        pl.held
            .iter()
            .any(|h| h
                .contains("2 too many for 0 s, no scale-down before 60 s (scale_down_delay_secs)")),
        "{:?}",
        pl.held
    );
    o.surplus_secs = Some(59.9);
    let pl = plan(&o, &p, T);
    assert!(asks(&pl).is_empty());
    assert!(
        pl.held
            .iter()
            .any(|h| h.contains("for 59 s, no scale-down before 60 s")),
        "{:?}",
        pl.held
    );
    o.surplus_secs = Some(60.0);
    let pl = plan(&o, &p, T);
    assert_eq!(asks(&pl), vec!["a".to_string(), "b".to_string()]);
    assert!(pl.actions[0]
        .reason()
        .contains("2 too many for 60 s; agent idle for 500 s"));
    // 0 turns the hysteresis off.
    p.scale_down_delay_secs = Some(0);
    o.surplus_secs = None;
    assert_eq!(asks(&plan(&o, &p, T)).len(), 2);
}

#[test]
fn the_plan_says_whether_the_pool_has_more_vms_than_its_target() {
    let idle = || Some(agent(0, 0.0, 2.0));
    let two = || {
        vec![
            srv("a", NovaStatus::Active, 900.0, idle()),
            srv("b", NovaStatus::Build, 5.0, None),
        ]
    };
    assert!(plan(&obs(two(), 1, 0), &pool(0, 10, 1), T).surplus);
    assert!(!plan(&obs(two(), 2, 0), &pool(0, 10, 1), T).surplus);
    assert!(!plan(&obs(two(), 5, 0), &pool(0, 10, 1), T).surplus);
    // min counts: 2 VMs are the target without demand.
    assert!(!plan(&obs(two(), 0, 0), &pool(2, 10, 1), T).surplus);
}

#[test]
fn idle_agents_on_servers_younger_than_the_minimum_lifetime_are_kept() {
    let mut p = pool(0, 10, 1);
    p.min_lifetime_secs = 300;
    let s = vec![
        srv(
            "young",
            NovaStatus::Active,
            200.0,
            Some(agent(0, 150.0, 2.0)),
        ),
        srv("old", NovaStatus::Active, 300.0, Some(agent(0, 100.0, 2.0))),
        srv("err", NovaStatus::Error, 10.0, None),
        srv("hole", NovaStatus::Active, 700.0, None),
    ];
    let pl = plan(&obs(s, 0, 0), &p, T);
    assert_eq!(asks(&pl), vec!["old".to_string()]);
    assert!(
        pl.held.iter().any(|h| h.contains(
            "1 idle agent(s) kept: their servers are younger than min_lifetime_secs 300 (youngest 200 s)"
        )),
        "{:?}",
        pl.held
    );
    // Failed servers go at any age.
    assert_eq!(
        deletes(&pl),
        vec![
            ("err".into(), DeleteCause::Error),
            ("hole".into(), DeleteCause::BlackHole)
        ]
    );
    // 0 turns it off.
    p.min_lifetime_secs = 0;
    let s = vec![srv(
        "young",
        NovaStatus::Active,
        200.0,
        Some(agent(0, 150.0, 2.0)),
    )];
    assert_eq!(asks(&plan(&obs(s, 0, 0), &p, T)), vec!["young".to_string()]);
}

// ------------------------------------------------------------ properties

fn arb_agent() -> impl Strategy<Value = AgentSeen> {
    (
        0u32..3,
        0.0f64..1000.0,
        0.0f64..200.0,
        any::<bool>(),
        0u8..4,
        proptest::option::of((0.0f64..200.0, any::<bool>(), 0u32..2, any::<bool>())),
    )
        .prop_map(|(running, idle, age, is_del, st, ans)| AgentSeen {
            heartbeat_age_secs: age,
            state: match st {
                0 => AgentState::Idle,
                1 => AgentState::Busy,
                2 => AgentState::Draining,
                _ => AgentState::Drained,
            },
            running,
            jobs: (0..running).map(|i| format!("job-{i}")).collect(),
            slots: running.max(1),
            is_del,
            idle_secs: idle,
            drain_reason: None,
            answer: ans.map(|(a, m, r, matched)| AnswerSeen {
                age_secs: a,
                may_delete: m,
                running: r,
                matched,
            }),
        })
}

fn arb_server() -> impl Strategy<Value = ObservedServer> {
    (
        0u8..6,
        0.0f64..2000.0,
        proptest::option::of(arb_agent()),
        "[a-z]{6}",
    )
        .prop_map(|(st, age, agent, name)| ObservedServer {
            id: format!("id-{name}"),
            name,
            status: match st {
                0 => NovaStatus::Build,
                1 | 2 => NovaStatus::Active,
                3 => NovaStatus::Error,
                4 => NovaStatus::Deleting,
                _ => NovaStatus::Other("SHUTOFF".into()),
            },
            age_secs: Some(age),
            agent,
        })
}

fn arb_case() -> impl Strategy<Value = (Observed, PoolConfig)> {
    (
        proptest::collection::vec(arb_server(), 0..12),
        0u64..40,
        0u64..10,
        proptest::option::of(0u32..10),
        0.0f64..200.0,
        (0u32..4, 0u32..12, 1u32..4),
        (
            proptest::option::of(0.0f64..200.0),
            proptest::option::of(0u64..150),
            0u64..1500,
        ),
    )
        .prop_map(
            |(
                mut servers,
                queued,
                running,
                quota,
                listening,
                (min, extra, slots),
                (surplus, delay, life),
            )| {
                for (i, s) in servers.iter_mut().enumerate() {
                    s.name = format!("{}{i}", s.name);
                    s.id = format!("id-{}", s.name);
                }
                let mut o = obs(servers, queued, running);
                o.quota_remaining = quota;
                o.listening_secs = listening;
                o.surplus_secs = surplus;
                let mut p = pool(min, min + extra, slots);
                p.scale_down_delay_secs = delay;
                p.min_lifetime_secs = life;
                (o, p)
            },
        )
}

proptest! {
    #[test]
    fn never_boots_above_max_or_quota((o, p) in arb_case()) {
        let pl = plan(&o, &p, T);
        let b = boots(&pl);
        let deleted = deletes(&pl).len() as u32;
        let vanishing = pl.classes.iter().filter(|c| **c == Class::Vanishing).count() as u32;
        let kept = o.servers.len() as u32 - deleted - vanishing;
        prop_assert!(b == 0 || kept + b <= p.max, "kept {kept} + boots {b} > max {}", p.max);
        if let Some(q) = o.quota_remaining {
            prop_assert!(b <= q);
        }
        prop_assert!(pl.target >= p.min && pl.target <= p.max);
    }

    #[test]
    fn never_deletes_or_asks_a_live_busy_agent((o, p) in arb_case()) {
        let pl = plan(&o, &p, T);
        for a in &pl.actions {
            let id = match a {
                Action::Delete { server_id, .. } | Action::AskDelete { server_id, .. } => server_id,
                Action::Boot { .. } => continue,
            };
            let s = o.servers.iter().find(|s| &s.id == id).unwrap();
            if let Some(ag) = &s.agent {
                let live = ag.heartbeat_age_secs <= T.heartbeat_timeout_secs;
                if live && s.status != NovaStatus::Error {
                    prop_assert_eq!(ag.running, 0, "{:?} on busy {:?}", a, s);
                }
            }
        }
    }

    #[test]
    fn idle_agents_are_asked_only_after_the_delay_and_the_minimum_lifetime((o, p) in arb_case()) {
        let pl = plan(&o, &p, T);
        for a in &pl.actions {
            let Action::AskDelete { server_id, .. } = a else { continue };
            let i = o.servers.iter().position(|s| &s.id == server_id).unwrap();
            if pl.classes[i] != Class::Idle {
                continue; // an out-of-service agent asked again
            }
            let s = &o.servers[i];
            prop_assert!(pl.surplus);
            prop_assert!(o.surplus_secs.unwrap_or(0.0) >= p.scale_down_delay() as f64, "{:?} {:?}", a, o.surplus_secs);
            prop_assert!(s.age_secs.is_none_or(|age| age >= p.min_lifetime_secs as f64), "{:?} on {:?}", a, s);
            prop_assert!(s.agent.as_ref().is_some_and(|ag| ag.idle_secs >= p.idle_secs as f64));
        }
    }

    #[test]
    fn agreed_deletions_need_a_matched_yes((o, p) in arb_case()) {
        let pl = plan(&o, &p, T);
        for a in &pl.actions {
            if let Action::Delete { server_id, cause: DeleteCause::Agreed, .. } = a {
                let s = o.servers.iter().find(|s| &s.id == server_id).unwrap();
                let ans = s.agent.as_ref().and_then(|a| a.answer.as_ref());
                prop_assert!(
                    ans.is_some_and(|ans| ans.matched && ans.may_delete),
                    "{:?} without a matched yes: {:?}", a, s
                );
            }
        }
    }

    #[test]
    fn nothing_is_deleted_as_dead_or_missing_before_listening_a_timeout((o, p) in arb_case()) {
        let pl = plan(&o, &p, T);
        if o.listening_secs < T.heartbeat_timeout_secs {
            for (_, cause) in deletes(&pl) {
                prop_assert!(!matches!(cause, DeleteCause::Dead | DeleteCause::BlackHole));
            }
        }
    }

    #[test]
    fn applying_plans_converges_to_the_target(
        (o, p) in arb_case(),
    ) {
        // Simulated world: boots become booting servers, then idle agents;
        // ask-delete makes an agent agree; deletes remove servers. Jobs
        // keep running on busy agents. Cooldowns, idle time and the
        // scale-down holds are off.
        let mut p = p;
        p.cooldown_secs = 0;
        p.idle_secs = 0;
        p.scale_down_delay_secs = Some(0);
        p.min_lifetime_secs = 0;
        let mut o = o;
        o.quota_remaining = None;
        o.listening_secs = 1000.0;
        let mut next_id = 0;
        for _ in 0..8 {
            let pl = plan(&o, &p, T);
            // Agents: booting servers come up.
            for s in o.servers.iter_mut() {
                if s.agent.is_none()
                    && !matches!(s.status, NovaStatus::Error | NovaStatus::Deleting)
                {
                    s.status = NovaStatus::Active;
                    s.agent = Some(agent(0, 0.0, 1.0));
                }
            }
            for a in pl.actions {
                match a {
                    Action::Boot { count, .. } => {
                        for _ in 0..count {
                            next_id += 1;
                            o.servers.push(srv(&format!("new{next_id}"), NovaStatus::Build, 0.0, None));
                        }
                    }
                    Action::AskDelete { server_id, .. } => {
                        let s = o.servers.iter_mut().find(|s| s.id == server_id).unwrap();
                        let ag = s.agent.as_mut().unwrap();
                        if ag.running == 0 {
                            ag.is_del = true;
                            ag.state = AgentState::Drained;
                            ag.answer = Some(AnswerSeen {
                                age_secs: 0.0,
                                may_delete: true,
                                running: 0,
                                matched: true,
                            });
                        }
                    }
                    Action::Delete { server_id, .. } => {
                        o.servers.retain(|s| s.id != server_id);
                    }
                }
            }
            // Nova finishes deletions.
            o.servers.retain(|s| s.status != NovaStatus::Deleting);
        }
        let pl = plan(&o, &p, T);
        // A fixed point: nothing left to do, and the pool is at its
        // target unless max (counting draining VMs) or busy agents
        // prevent it.
        prop_assert!(pl.actions.is_empty(), "not converged: {:?}", pl.actions);
        let have = pl.active + pl.booting;
        let idle = pl.classes.iter().filter(|c| **c == Class::Idle).count();
        if have < pl.target {
            prop_assert!(o.servers.len() as u32 >= p.max, "below target with room: {:?}", pl.classes);
        } else if have > pl.target {
            prop_assert_eq!(idle, 0, "above target with idle agents: {:?}", pl.classes);
        }
    }
}

#[test]
fn the_boot_gate_limits_boots_and_says_why() {
    use crate::breaker::BootGate;
    let mut o = obs(vec![], 5, 0);
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 5);
    o.boot_gate = BootGate::BreakerOpen {
        failures: 5,
        secs_left: 100.0,
        last: "server x went to ERROR".into(),
    };
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 0);
    assert!(
        p.held.iter().any(|h| h.contains("circuit breaker open")),
        "{:?}",
        p.held
    );
    o.boot_gate = BootGate::HalfOpen {
        failures: 5,
        probing: false,
    };
    assert_eq!(boots(&plan(&o, &pool(0, 10, 1), T)), 1, "one trial boot");
    o.boot_gate = BootGate::HalfOpen {
        failures: 5,
        probing: true,
    };
    assert_eq!(boots(&plan(&o, &pool(0, 10, 1), T)), 0);
}

#[test]
fn demand_counts_slots_not_jobs() {
    // Two ppn=4 jobs queued in a pool of 2-slot VMs: 4 VMs, not 1.
    let mut o = obs(vec![], 2, 0);
    o.queued_slots = 8;
    let pl = plan(&o, &pool(0, 10, 2), T);
    assert_eq!(boots(&pl), 4, "{:?}", pl.actions);
    assert!(
        pl.actions[0].reason().contains("(8 + 0 slots)"),
        "{}",
        pl.actions[0].reason()
    );
    // Running slots count too.
    let mut o = obs(vec![], 0, 1);
    o.running_slots = 3;
    assert_eq!(boots(&plan(&o, &pool(0, 10, 2), T)), 2);
}

#[test]
fn queue_messages_the_table_does_not_know_count_one_slot_each() {
    use crate::jobs::slots::PoolSlots;
    use crate::observe::slot_demand;
    assert_eq!(slot_demand(5, None), (5, 0));
    let t = PoolSlots {
        queued_jobs: 2,
        queued_slots: 8,
        running_slots: 4,
    };
    // 5 messages, 2 known (8 slots) + 3 unknown (1 each).
    assert_eq!(slot_demand(5, Some(t)), (11, 4));
    // The table may know of more queued jobs than the queue shows yet.
    assert_eq!(slot_demand(1, Some(t)), (8, 4));
    assert_eq!(slot_demand(0, Some(PoolSlots::default())), (0, 0));
}

proptest! {
    #[test]
    fn the_target_is_the_ceiling_of_slots_over_vm_slots(
        queued in 0u64..20, extra_q in 0u64..40, running in 0u64..10, extra_r in 0u64..20, slots in 1u32..8,
    ) {
        let mut o = obs(vec![], queued, running);
        o.queued_slots = queued + extra_q;
        o.running_slots = running + extra_r;
        let pl = plan(&o, &pool(0, 1000, slots), T);
        let want = (queued + extra_q + running + extra_r).div_ceil(u64::from(slots)) as u32;
        prop_assert_eq!(boots(&pl), want);
        // Never fewer VMs than counting each job as one slot.
        prop_assert!(boots(&pl) as u64 >= (queued + running).div_ceil(u64::from(slots)));
    }
}

fn draining(running: u32) -> AgentSeen {
    AgentSeen {
        state: AgentState::Draining,
        drain_reason: Some("kernel update".into()),
        ..agent(running, 0.0, 5.0)
    }
}

/// Operator review, cloudsim `--quota-instances 2`, pool max 4, 1 slot/VM,
/// case A: the quota binds, not max.
#[test]
fn a_full_quota_is_named_not_max_when_max_would_allow_more() {
    use crate::observe::QuotaView;
    let s = vec![
        srv("a", NovaStatus::Active, 100.0, Some(agent(1, 0.0, 5.0))),
        srv("b", NovaStatus::Active, 100.0, Some(agent(1, 0.0, 5.0))),
    ];
    let mut o = obs(s, 4, 2);
    o.quota = QuotaView::Read(quota(2, 2));
    o.quota_remaining = quota(2, 2).remaining();
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 0);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA);
    assert_eq!(
        l.reason,
        "quota exhausted: 2/2 instances; 2 more VM(s) wanted, 0 allowed"
    );
}

/// Case B: one VM drains; max allows 2 more, the quota none: the quota is
/// named with the true 0 allowed; with quota for more than max allows,
/// max is named with its figure.
#[test]
fn the_allowed_boots_named_are_those_after_all_limits() {
    use crate::observe::QuotaView;
    let s = vec![
        srv("a", NovaStatus::Active, 100.0, Some(agent(1, 0.0, 5.0))),
        srv("b", NovaStatus::Active, 100.0, Some(draining(1))),
    ];
    let mut o = obs(s, 4, 2);
    o.quota = QuotaView::Read(quota(2, 2));
    o.quota_remaining = Some(0);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 0);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA, "{}", l.reason);
    assert!(
        l.reason.ends_with("3 more VM(s) wanted, 0 allowed"),
        "{}",
        l.reason
    );
    o.quota_remaining = Some(1);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 1);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_QUOTA, "{}", l.reason);
    assert!(l.reason.ends_with("1 allowed"), "{}", l.reason);
    o.quota = QuotaView::Unknown;
    o.quota_remaining = Some(5);
    let p = plan(&o, &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 2);
    let l = p.limited.expect("limited");
    assert_eq!(l.kind, LIMIT_MAX);
    assert_eq!(
        l.reason,
        "pool at max 4: 2 servers, 3 more wanted, 2 allowed"
    );
    // At max and no quota left: max alone allows none, max is named.
    let s = (0..4)
        .map(|i| {
            srv(
                &format!("s{i}"),
                NovaStatus::Active,
                100.0,
                Some(agent(1, 0.0, 5.0)),
            )
        })
        .collect();
    let mut o = obs(s, 3, 4);
    o.quota_remaining = Some(0);
    let l = plan(&o, &pool(0, 4, 1), T).limited.expect("limited");
    assert_eq!(l.kind, LIMIT_MAX, "{}", l.reason);
}

#[test]
fn a_quota_with_nothing_used_is_not_called_nearly_exhausted() {
    use crate::observe::QuotaView;
    let mut o = obs(vec![], 3, 0);
    o.quota = QuotaView::Read(quota(2, 0));
    o.quota_remaining = quota(2, 0).remaining();
    let p = plan(&o, &pool(0, 10, 1), T);
    assert_eq!(boots(&p), 2);
    assert_eq!(
        p.limited.expect("limited").reason,
        "quota allows 2 instances: 0/2 used; 3 more VM(s) wanted, 2 allowed"
    );
}

/// Draining a busy node with nothing queued boots no replacement: its job
/// is served by the draining VM until it ends.
#[test]
fn draining_a_busy_agent_boots_no_replacement() {
    let s = vec![srv("a", NovaStatus::Active, 100.0, Some(draining(1)))];
    let p = plan(&obs(s.clone(), 0, 1), &pool(0, 4, 1), T);
    assert_eq!(boots(&p), 0, "{:?}", p.actions);
    assert_eq!(p.target, 0);
    assert!(p.limited.is_none());
    // Being deleted (`is_del`) is the same.
    let mut d = agent(1, 0.0, 5.0);
    d.is_del = true;
    let p = plan(
        &obs(vec![srv("a", NovaStatus::Active, 100.0, Some(d))], 0, 1),
        &pool(0, 4, 1),
        T,
    );
    assert_eq!(boots(&p), 0, "{:?}", p.actions);
    // Queued jobs still get VMs; jobs of live agents still count.
    let mut s2 = s;
    s2.push(srv(
        "b",
        NovaStatus::Active,
        100.0,
        Some(agent(1, 0.0, 5.0)),
    ));
    let p = plan(&obs(s2, 2, 2), &pool(0, 4, 1), T);
    assert_eq!(p.target, 3);
    assert_eq!(boots(&p), 2, "{:?}", p.actions);
    assert!(p.actions[0].reason().contains("1 of them on draining VMs"));
}
