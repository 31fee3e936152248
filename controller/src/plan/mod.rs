//! Plan: the pure scaling rule. [`plan`] turns one pool's [`Observed`] view
//! and its [`PoolConfig`] into [`Action`]s, each with a human-readable
//! reason.
//!
//! The rule (seed: `VN = VT - VA`, counting VMs booting):
//!
//! * `VT = clamp(ceil((queued slots + running slots - slots on draining
//!   VMs) / slots), min, max)`, where a job counts its requested slots
//!   (`Job::slots`, from the job table) and a queued message the table
//!   does not know counts 1; jobs running on a draining agent
//!   (operator-drained or `is_del`, not in `VA`) are served by that VM
//!   until they end and ask for no new VM (counted at 1 slot per job, as
//!   heartbeats name jobs, not slots);
//! * `VA` = servers whose agent heartbeats and takes jobs (idle or busy);
//! * `VB` = servers booting (BUILD, or up without a first heartbeat within
//!   `boot_timeout_secs`), plus servers not judged yet because the
//!   controller has not listened for a whole heartbeat timeout;
//! * `VN = VT - VA - VB`: boot `min(VN, max - servers kept, quota)`, or ask
//!   up to `-VN` idle agents (idle at least `idle_secs`) whether they may be
//!   deleted, once `VN < 0` has lasted `scale_down_delay_secs` without a
//!   break ([`Observed::surplus_secs`], hysteresis) and only on servers at
//!   least `min_lifetime_secs` old (DESIGN.md, "No flapping").
//!
//! Deleted are: servers whose agent agreed (an explicit `may_delete` answer
//! matched to a request id this controller sent, no job running; agents
//! that report `is_del` or drained without one are asked again), ERROR
//! servers, servers stuck in BUILD, servers whose agent never heartbeated within the boot timeout (black holes) and servers whose
//! agent stopped heartbeating (dead). The last two only once the controller
//! has listened for a whole heartbeat timeout. A server whose agent's live
//! heartbeat shows a running job is never deleted or asked.

use vq_common::config::PoolConfig;
use vq_common::messages::AgentState;

use crate::observe::{NovaStatus, Observed, ObservedServer};

/// Why a server is deleted (the `reason` label of
/// `vq_servers_deleted_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeleteCause {
    /// The agent agreed to be deleted and runs nothing.
    Agreed,
    /// Nova reports ERROR.
    Error,
    /// Still BUILD after the boot timeout.
    StuckBuild,
    /// Up, but its agent never heartbeated within the boot timeout.
    BlackHole,
    /// Its agent stopped heartbeating.
    Dead,
}

impl DeleteCause {
    /// Short label (`agreed`, `error`, `stuck-build`, `black-hole`, `dead`).
    pub fn label(self) -> &'static str {
        match self {
            DeleteCause::Agreed => "agreed",
            DeleteCause::Error => "error",
            DeleteCause::StuckBuild => "stuck-build",
            DeleteCause::BlackHole => "black-hole",
            DeleteCause::Dead => "dead",
        }
    }
}

/// One thing to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Create `count` servers.
    Boot {
        /// How many.
        count: u32,
        /// Why.
        reason: String,
    },
    /// Ask an agent whether its VM may be deleted.
    AskDelete {
        /// Server id.
        server_id: String,
        /// Agent id (= server name).
        agent: String,
        /// Why.
        reason: String,
    },
    /// Delete a server.
    Delete {
        /// Server id.
        server_id: String,
        /// Server name.
        name: String,
        /// Category.
        cause: DeleteCause,
        /// Why.
        reason: String,
    },
}

impl Action {
    /// The action's reason.
    pub fn reason(&self) -> &str {
        match self {
            Action::Boot { reason, .. }
            | Action::AskDelete { reason, .. }
            | Action::Delete { reason, .. } => reason,
        }
    }

    /// `boot`, `ask-delete` or `delete`.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Boot { .. } => "boot",
            Action::AskDelete { .. } => "ask-delete",
            Action::Delete { .. } => "delete",
        }
    }
}

/// How the planner judged one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// BUILD, or up without a first heartbeat, within the boot timeout.
    Booting,
    /// Not judged: the controller has not listened for a heartbeat timeout.
    Unknown,
    /// Live agent taking jobs, none running.
    Idle,
    /// Live agent running jobs.
    Busy,
    /// Live agent not pulling, finishing jobs.
    Draining,
    /// Live agent that agreed to be deleted and runs nothing.
    Agreed,
    /// ERROR.
    Error,
    /// BUILD past the boot timeout.
    StuckBuild,
    /// No heartbeat ever, past the boot timeout.
    BlackHole,
    /// Heartbeats stopped.
    Dead,
    /// Already being deleted by Nova.
    Vanishing,
}

impl Class {
    /// Name used in the status page's `agent_state`.
    pub fn agent_state(self) -> &'static str {
        match self {
            Class::Booting => "booting",
            Class::Unknown => "unknown",
            Class::Idle => "idle",
            Class::Busy => "busy",
            Class::Draining => "draining",
            Class::Agreed => "drained",
            Class::Dead => "dead",
            Class::Error | Class::StuckBuild | Class::BlackHole | Class::Vanishing => "none",
        }
    }

    fn delete_cause(self) -> Option<DeleteCause> {
        match self {
            Class::Agreed => Some(DeleteCause::Agreed),
            Class::Error => Some(DeleteCause::Error),
            Class::StuckBuild => Some(DeleteCause::StuckBuild),
            Class::BlackHole => Some(DeleteCause::BlackHole),
            Class::Dead => Some(DeleteCause::Dead),
            _ => None,
        }
    }
}

/// Settings of the planner that are not per pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Seconds without a heartbeat after which an agent is dead.
    pub heartbeat_timeout_secs: f64,
}

/// The planner's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// VT.
    pub target: u32,
    /// VA.
    pub active: u32,
    /// VB.
    pub booting: u32,
    /// How each server was judged, in the order of `Observed::servers`.
    pub classes: Vec<Class>,
    /// What to do.
    pub actions: Vec<Action>,
    /// Things the rule wanted but held back (cooldown, quota, max, the
    /// scale-down hysteresis, the minimum lifetime), for logs.
    pub held: Vec<String>,
    /// Whether the pool has more VMs than its target (`VN < 0`): the loop
    /// keeps the instant since which this holds without a break, and
    /// gives its age back as [`Observed::surplus_secs`].
    pub surplus: bool,
    /// The limit that binds the boots the rule wanted, for `/status`
    /// (`obstacle`, `obstacle_kind`) and `vq_pool_obstacle`: of `max`, the
    /// quota and the cooldown, the one allowing the fewest boots (the
    /// earlier on a tie: the quota is named only when `max` alone allowed
    /// more), its "N allowed" the boots made; `None` when
    /// every wanted boot is made, or when only the boot gate or an unlisted
    /// server cut them (those are shown as the pool's state already).
    pub limited: Option<Limit>,
}

/// A limit that held boots back ([`Plan::limited`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// [`LIMIT_MAX`], [`LIMIT_QUOTA`] or [`LIMIT_COOLDOWN`].
    pub kind: &'static str,
    /// In words, with the figures.
    pub reason: String,
}

/// The pool's `max` is reached.
pub const LIMIT_MAX: &str = "max";
/// The project's quota (instances, cores or RAM) is used up, or could not
/// be read; the obstacle's words come from [`quota_words`].
pub const LIMIT_QUOTA: &str = "quota";
/// A boot failed less than `cooldown_secs` ago.
pub const LIMIT_COOLDOWN: &str = "boot-cooldown";

/// The quota that holds a pool's boots back, in the words of the status
/// page and `vq pools` (issue 13): `"quota exhausted: 10/10 instances"`,
/// `"… 40/40 cores"`, `"… 20480/20480 MiB RAM"` when `remaining` (the
/// instances this pool may still create, after the pools before it in the
/// cycle) is 0, else `"quota nearly exhausted: 8/10 instances"`, or
/// `"quota allows 10 instances: 0/10 used"` when none is used; `"quota
/// could not be read: …"` when the read failed. Instances used are counted
/// as `limit - remaining`, so boots of earlier pools in the cycle are in
/// it. Cores and RAM are named when they are used up (see
/// [`crate::openstack::Quota::remaining`]).
pub fn quota_words(quota: &crate::observe::QuotaView, remaining: u32) -> String {
    use crate::observe::QuotaView;
    match quota {
        QuotaView::Unreadable(e) => format!("quota could not be read: {e}"),
        QuotaView::Unknown => format!("quota allows {remaining} more instance(s)"),
        QuotaView::Read(q) => {
            if q.cores_full() {
                return format!(
                    "quota exhausted: {}/{} cores",
                    q.used_cores,
                    q.max_cores.unwrap_or_default()
                );
            }
            if q.ram_full() {
                return format!(
                    "quota exhausted: {}/{} MiB RAM",
                    q.used_ram_mib,
                    q.max_ram_mib.unwrap_or_default()
                );
            }
            match q.max_instances {
                // Nothing used yet: the demand is above the whole quota.
                Some(max) if remaining > 0 && remaining >= max => {
                    format!("quota allows {max} instances: 0/{max} used")
                }
                Some(max) => format!(
                    "quota {}exhausted: {}/{max} instances",
                    if remaining == 0 { "" } else { "nearly " },
                    max.saturating_sub(remaining)
                ),
                None => format!("quota allows {remaining} more instance(s)"),
            }
        }
    }
}

/// Judges one server.
pub fn classify(s: &ObservedServer, pool: &PoolConfig, obs: &Observed, t: Timing) -> Class {
    if s.status == NovaStatus::Deleting {
        return Class::Vanishing;
    }
    if s.status == NovaStatus::Error {
        return Class::Error;
    }
    let listened = obs.listening_secs >= t.heartbeat_timeout_secs;
    match &s.agent {
        Some(a) if a.heartbeat_age_secs <= t.heartbeat_timeout_secs => {
            // Only an explicit yes to a request this controller sent
            // counts; `is_del` alone (e.g. after a controller restart)
            // gets the agent asked again.
            let matched_yes = a
                .answer
                .as_ref()
                .filter(|ans| ans.matched && ans.may_delete && ans.running == 0);
            let agreed = a.running == 0
                && match matched_yes {
                    // A later heartbeat must still show it out of service.
                    Some(ans) => ans.age_secs < a.heartbeat_age_secs || a.is_del,
                    None => false,
                };
            if agreed {
                Class::Agreed
            } else if a.state == AgentState::Draining || a.state == AgentState::Drained || a.is_del
            {
                Class::Draining
            } else if a.running > 0 || a.state == AgentState::Busy {
                Class::Busy
            } else {
                Class::Idle
            }
        }
        Some(_) => {
            if listened {
                Class::Dead
            } else {
                Class::Unknown
            }
        }
        None => {
            let young = s
                .age_secs
                .is_none_or(|age| age <= pool.boot_timeout_secs as f64);
            if young {
                Class::Booting
            } else if s.status == NovaStatus::Build {
                Class::StuckBuild
            } else if listened {
                Class::BlackHole
            } else {
                Class::Unknown
            }
        }
    }
}

/// `"; drained by an operator: REASON"` when the agent drains for an
/// operator's `--reason`, else nothing: decisions about such an agent say
/// why it went out of service.
fn drain_note(s: &ObservedServer) -> String {
    match s.agent.as_ref().and_then(|a| a.drain_reason.as_deref()) {
        Some(r) => format!("; drained by an operator: {r}"),
        None => String::new(),
    }
}

fn delete_reason(cause: DeleteCause, s: &ObservedServer, pool: &PoolConfig, t: Timing) -> String {
    match cause {
        DeleteCause::Agreed => format!(
            "agent agreed to be deleted and runs no job{}",
            drain_note(s)
        ),
        DeleteCause::Error => "server is in ERROR".into(),
        DeleteCause::StuckBuild => format!(
            "server still in BUILD after {:.0} s (boot timeout {} s)",
            s.age_secs.unwrap_or(0.0),
            pool.boot_timeout_secs
        ),
        DeleteCause::BlackHole => format!(
            "agent never sent a heartbeat in {:.0} s since the server was created (boot timeout {} s): black hole",
            s.age_secs.unwrap_or(0.0),
            pool.boot_timeout_secs
        ),
        DeleteCause::Dead => format!(
            "agent's last heartbeat was {:.0} s ago (timeout {:.0} s){}: dead",
            s.agent.as_ref().map(|a| a.heartbeat_age_secs).unwrap_or(0.0),
            t.heartbeat_timeout_secs,
            match s.agent.as_ref().map(|a| a.running).unwrap_or(0) {
                0 => String::new(),
                n => format!(", it last reported {n} running job(s)"),
            }
        ),
    }
}

/// The pure scaling rule (see the module doc).
pub fn plan(obs: &Observed, pool: &PoolConfig, t: Timing) -> Plan {
    let classes: Vec<Class> = obs
        .servers
        .iter()
        .map(|s| classify(s, pool, obs, t))
        .collect();
    let count = |f: &dyn Fn(Class) -> bool| classes.iter().filter(|c| f(**c)).count() as u32;
    let va = count(&|c| matches!(c, Class::Idle | Class::Busy));
    // Servers created but not listed yet boot too: booting again for them
    // would boot twice.
    let vb = count(&|c| matches!(c, Class::Booting | Class::Unknown)) + obs.unlisted_created;
    let slots = u64::from(pool.slots.max(1));
    // Jobs running on draining agents (operator-drained or `is_del`) are
    // served by those VMs until they end: they ask for no VM. Counted at
    // 1 slot per job (heartbeats name jobs, not their slots), at most the
    // running slots.
    let running_slots = obs.running_slots.max(obs.running);
    let on_draining = obs
        .servers
        .iter()
        .zip(&classes)
        .filter(|(_, c)| **c == Class::Draining)
        .filter_map(|(s, _)| s.agent.as_ref())
        .map(|a| u64::from(a.running))
        .sum::<u64>()
        .min(running_slots);
    // Slots, not jobs: a job of N slots needs N of a VM's `slots`.
    let demand = obs
        .queued_slots
        .max(obs.queued)
        .saturating_add(running_slots - on_draining);
    let wanted = demand.div_ceil(slots).min(u64::from(u32::MAX)) as u32;
    let vt = wanted.clamp(pool.min, pool.max.max(pool.min));
    let mut actions = Vec::new();
    let mut held = Vec::new();
    // The limits that cut boots, with the boots each allows: the one
    // allowing the fewest binds (the earliest on a tie).
    let mut limits: Vec<(u32, Limit)> = Vec::new();
    let mut limit = |kind: &'static str, allowed: u32, reason: String| {
        limits.push((allowed, Limit { kind, reason }));
    };

    // Deletions of servers that are gone in all but name.
    let mut deleted = 0u32;
    for (s, c) in obs.servers.iter().zip(&classes) {
        if let Some(cause) = c.delete_cause() {
            deleted += 1;
            actions.push(Action::Delete {
                server_id: s.id.clone(),
                name: s.name.clone(),
                cause,
                reason: delete_reason(cause, s, pool, t),
            });
        }
    }
    // Agents out of service without a matched yes (said `is_del` or
    // drained before this controller asked, e.g. before a restart): ask
    // them, their fresh yes lets them go.
    for (s, c) in obs.servers.iter().zip(&classes) {
        if *c != Class::Draining {
            continue;
        }
        if let Some(a) = s
            .agent
            .as_ref()
            .filter(|a| a.running == 0 && (a.is_del || a.state == AgentState::Drained))
        {
            actions.push(Action::AskDelete {
                server_id: s.id.clone(),
                agent: s.name.clone(),
                reason: format!(
                    "agent reports {} with no job running, but this controller holds no matching yes: asking (again){}",
                    if a.is_del { "is_del" } else { "drained" },
                    drain_note(s)
                ),
            });
        }
    }
    let vanishing = count(&|c| c == Class::Vanishing);
    let kept = obs.servers.len() as u32 - deleted - vanishing + obs.unlisted_created;

    let vn = i64::from(vt) - i64::from(va) - i64::from(vb);
    if wanted > vt {
        limit(
            LIMIT_MAX,
            vn.max(0) as u32,
            format!(
                "pool at max {}: {demand} job slots need {wanted} VMs at {slots} slots/VM",
                pool.max
            ),
        );
    }
    let draining_note = match on_draining {
        0 => String::new(),
        n => format!(", {n} of them on draining VMs"),
    };
    let why = format!(
        "target {vt} VMs for {} queued + {} running jobs ({} + {} slots{draining_note}) at {} slots/VM (min {}, max {}); {va} active, {vb} booting",
        obs.queued, obs.running, obs.queued_slots.max(obs.queued), running_slots, pool.slots, pool.min, pool.max
    );
    if vn > 0 {
        let mut n = vn as u32;
        let headroom = pool.max.saturating_sub(kept);
        if headroom < n {
            held.push(format!(
                "{why}: wanted {n} more, but only {headroom} fit under max {} ({kept} servers exist)",
                pool.max
            ));
            limit(
                LIMIT_MAX,
                headroom,
                format!(
                    "pool at max {}: {kept} servers, {n} more wanted, {headroom} allowed",
                    pool.max
                ),
            );
            n = headroom;
        }
        if let Some(q) = obs.quota_remaining {
            if q < n {
                held.push(format!(
                    "{why}: wanted {n} more, but the instance quota allows only {q}"
                ));
                limit(
                    LIMIT_QUOTA,
                    q,
                    format!(
                        "{}; {vn} more VM(s) wanted, {q} allowed",
                        quota_words(&obs.quota, q)
                    ),
                );
                n = q;
            }
        }
        if let Some(why_not) = obs.boot_obstacle.as_deref() {
            if n > 0 {
                held.push(format!("{why}: boot of {n} held back: {why_not}"));
                n = 0;
            }
        }
        if let Some(since) = obs.since_boot_failure_secs {
            if n > 0 && since < pool.cooldown_secs as f64 {
                held.push(format!(
                    "{why}: boot of {n} held back, last boot failed {since:.0} s ago (cooldown {} s)",
                    pool.cooldown_secs
                ));
                limit(
                    LIMIT_COOLDOWN,
                    0,
                    format!(
                        "last boot failed {since:.0} s ago: no boot for cooldown_secs {}",
                        pool.cooldown_secs
                    ),
                );
                n = 0;
            }
        }
        if let Some(allowed) = obs.boot_gate.allowed() {
            if n > allowed {
                held.push(format!(
                    "{why}: wanted {n} more, {allowed} allowed: {}",
                    obs.boot_gate.reason().unwrap_or_default()
                ));
                n = allowed;
            }
        }
        if n > 0 {
            actions.push(Action::Boot {
                count: n,
                reason: format!("{why}: boot {n}"),
            });
        }
    } else if vn < 0 {
        let excess = (-vn) as u32;
        let cooling = obs
            .since_scale_down_secs
            .filter(|since| *since < pool.cooldown_secs as f64);
        // Before this cycle's observation no surplus was recorded: it
        // starts now.
        let surplus_secs = obs.surplus_secs.unwrap_or(0.0);
        let delay = pool.scale_down_delay();
        if let Some(since) = cooling {
            held.push(format!(
                "{why}: {excess} too many, but the last scale-down was {since:.0} s ago (cooldown {} s)",
                pool.cooldown_secs
            ));
        } else if surplus_secs < delay as f64 {
            // Whole seconds, rounded down: never "3 s, … before 3 s".
            held.push(format!(
                "{why}: {excess} too many for {:.0} s, no scale-down before {delay} s (scale_down_delay_secs)",
                surplus_secs.floor()
            ));
        } else {
            let idle_enough: Vec<&ObservedServer> = obs
                .servers
                .iter()
                .zip(&classes)
                .filter(|(s, c)| {
                    **c == Class::Idle
                        && s.agent
                            .as_ref()
                            .is_some_and(|a| a.running == 0 && a.idle_secs >= pool.idle_secs as f64)
                })
                .map(|(s, _)| s)
                .collect();
            // A server whose age Nova did not give is old enough: the
            // minimum lifetime must not keep a VM for ever.
            let min_life = pool.min_lifetime_secs as f64;
            let (mut idle, young): (Vec<&ObservedServer>, Vec<&ObservedServer>) = idle_enough
                .into_iter()
                .partition(|s| s.age_secs.is_none_or(|age| age >= min_life));
            if idle.len() < excess as usize && !young.is_empty() {
                let youngest = young
                    .iter()
                    .filter_map(|s| s.age_secs)
                    .fold(f64::INFINITY, f64::min);
                held.push(format!(
                    "{why}: {excess} too many, {} idle agent(s) kept: their servers are younger than min_lifetime_secs {} (youngest {youngest:.0} s)",
                    young.len(),
                    pool.min_lifetime_secs
                ));
            }
            // Longest idle first; name as a tie-break for determinism.
            idle.sort_by(|a, b| {
                let ia = a.agent.as_ref().map(|x| x.idle_secs).unwrap_or(0.0);
                let ib = b.agent.as_ref().map(|x| x.idle_secs).unwrap_or(0.0);
                ib.total_cmp(&ia).then_with(|| a.name.cmp(&b.name))
            });
            if idle.len() < excess as usize && young.is_empty() {
                held.push(format!(
                    "{why}: {excess} too many, only {} agents idle for {} s or more",
                    idle.len(),
                    pool.idle_secs
                ));
            }
            for s in idle.into_iter().take(excess as usize) {
                let idle_secs = s.agent.as_ref().map(|a| a.idle_secs).unwrap_or(0.0);
                actions.push(Action::AskDelete {
                    server_id: s.id.clone(),
                    agent: s.name.clone(),
                    reason: format!(
                        "{why}: {excess} too many for {surplus_secs:.0} s; agent idle for {idle_secs:.0} s"
                    ),
                });
            }
        }
    }
    // Fewest boots allowed binds; `min_by_key` keeps the first of equals.
    let limited = limits
        .into_iter()
        .min_by_key(|(allowed, _)| *allowed)
        .map(|(_, l)| l);
    Plan {
        target: vt,
        active: va,
        booting: vb,
        classes,
        actions,
        held,
        surplus: vn < 0,
        limited,
    }
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
