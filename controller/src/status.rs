//! The controller's status report, served as JSON by `GET /status` and read
//! by `vq pools`.
//!
//! Shape (all counts are plain integers, times are Unix seconds):
//!
//! ```json
//! {
//!   "cluster": "vq",
//!   "generated_at": 1764412800.5,
//!   "uptime_secs": 120.0,
//!   "broker_access_refused": null,
//!   "broker_connected": true,
//!   "broker_blocked": null,
//!   "cloud_error": null,
//!   "last_cycle_at": 1764412799.0,
//!   "pools": {
//!     "cms": {
//!       "queued": 12, "running": 4, "target": 4,
//!       "vms": {"booting": 1, "active": 3, "draining": 0, "error": 0},
//!       "agents": {"idle": 0, "busy": 3, "draining": 0},
//!       "servers": [
//!         {"id": "…", "name": "vq-cms-1a2b3c4d", "status": "ACTIVE",
//!          "agent_state": "busy", "running": 1,
//!          "jobs": ["1764412700-sim"], "slots": 4, "slots_mismatch": false,
//!          "age_secs": 600, "heartbeat_age_secs": 4,
//!          "drain_reason": "kernel update"}
//!       ],
//!       "last_decisions": [
//!         {"at": 1764412790.0, "action": "boot", "server": null,
//!          "reason": "target 4 VMs for 12 queued + 4 running jobs at 4 slots/VM; 3 exist"}
//!       ],
//!       "observed_at": 1764412799.0,
//!       "last_error": null,
//!       "obstacle": null,
//!       "observed": true,
//!       "failures": 0,
//!       "failure_permanent": false
//!     }
//!   }
//! }
//! ```
//!
//! `agent_state` is one of `idle`, `busy`, `draining`, `drained`, `booting`
//! (no heartbeat yet), `unknown` (controller just started, no heartbeat
//! seen), `dead` (heartbeats stopped) or `none` (server in ERROR or
//! stuck).
//!
//! `obstacle` is set while the pool boots nothing because something keeps
//! it from seeing what it boots (a server it created is missing from the
//! server listings); it says which server and why.
//!
//! `observed` is `false` while the pool's last observation failed: its
//! counts are then those of `observed_at`, not current (its value gauges
//! are absent from `/metrics`). `failures` counts the pool's failed cycles
//! in a row, `failure_permanent` says whether the last one was an error
//! retrying cannot fix. [`readiness`] (served by `/readyz`) is computed
//! from this document.
//!
//! The loop publishes into it (and into the [`Metrics`]) through the
//! functions at the end of this module: [`publish`] after each pool's
//! plan, [`count_actions`] after it acted, [`show_failure`] or
//! [`show_success`] when its cycle ended, [`show_held`] during a broker
//! alarm, and [`show_connections`] and [`show_refused`] after a cycle.

use std::collections::BTreeMap;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use vq_common::messages::unix_now;

use crate::act::ActReport;
use crate::error::ActError;
use crate::metrics::{Metrics, AGENT_STATES, SLOT_STATES, VM_STATES};
use crate::observe::{NovaStatus, Observed};
use crate::plan::{Action, Class, DeleteCause, Plan};

/// Number of decisions kept per pool in [`PoolStatus::last_decisions`].
pub const DECISIONS_KEPT: usize = 20;

/// The whole `/status` document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Cluster name.
    pub cluster: String,
    /// When this document was served, Unix seconds (set per request by
    /// [`crate::http::AppState::served_status`], whether or not any
    /// observation succeeded).
    pub generated_at: f64,
    /// Seconds since the controller started, at the time of the request.
    pub uptime_secs: f64,
    /// Per pool, by name.
    pub pools: BTreeMap<String, PoolStatus>,
    /// The broker's ACCESS_REFUSED text (it names the operation, the
    /// resource and the user) if the last cycle failed for lack of a
    /// permission of the controller's account, else `null`; while set,
    /// `/readyz` answers 503 with it.
    #[serde(default)]
    pub broker_access_refused: Option<String>,
    /// Whether the controller's last attempt to reach the broker succeeded
    /// (`false` before the first cycle).
    #[serde(default)]
    pub broker_connected: bool,
    /// The broker's reason while it blocks the controller's publishing
    /// (resource alarm: every pool is held), else `null`.
    #[serde(default)]
    pub broker_blocked: Option<String>,
    /// The whole cause chain of the last failed read of the cloud's server
    /// list, `null` since the last one that succeeded.
    #[serde(default)]
    pub cloud_error: Option<String>,
    /// When a cycle last tried to read the broker and the cloud, Unix seconds
    /// (0 = none yet).
    #[serde(default)]
    pub last_cycle_at: f64,
    /// `leader` (holds the controller lock and acts) or `standby` (observes
    /// and serves status only), as of the last cycle ([`crate::leader`]).
    #[serde(default)]
    pub role: crate::leader::Role,
    /// Why this controller is standby (another holds the lock, the lock
    /// cannot be proven, taking over), `null` while leader.
    #[serde(default)]
    pub standby_reason: Option<String>,
    /// Whether the controller runs with `--dry-run` (plans and logs, acts
    /// on nothing).
    #[serde(default)]
    pub dry_run: bool,
    /// Whether the cloud's TLS certificates go unchecked (clouds.yaml
    /// `verify: false` or `OS_INSECURE=true`): anyone on the path can pose
    /// as the cloud.
    #[serde(default)]
    pub cloud_tls_insecure: bool,
}

/// One pool's state as seen in the last successful observation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Jobs waiting (max of the pool queue depth and bridge demand).
    pub queued: u64,
    /// Jobs running (max of heartbeat sum and bridge demand).
    pub running: u64,
    /// Target number of VMs computed by the last plan.
    pub target: u32,
    /// VMs by lifecycle state.
    pub vms: VmCounts,
    /// Live agents by state.
    pub agents: AgentCounts,
    /// Every server of the pool.
    pub servers: Vec<ServerStatus>,
    /// Most recent decisions, newest last (at most [`DECISIONS_KEPT`]).
    pub last_decisions: Vec<Decision>,
    /// When the pool was last observed completely, Unix seconds (0 = never).
    pub observed_at: f64,
    /// The last error of the pool's cycle, if the last cycle failed.
    #[serde(default)]
    pub last_error: Option<String>,
    /// Why the pool boots nothing at the moment, if something stops it
    /// (see the module doc); `None` when it may boot.
    #[serde(default)]
    pub obstacle: Option<String>,
    /// The kind of [`PoolStatus::obstacle`]: `server-unlisted` (a server
    /// this controller created is missing from the listings),
    /// `boot-backoff` (consecutive boot failures back boots off),
    /// `breaker-open` (the pool's circuit breaker stops its boots),
    /// `breaker-half-open` (one trial boot); `null` without one.
    #[serde(default)]
    pub obstacle_kind: Option<String>,
    /// The pool's consecutive boot failures (failed creates, servers in
    /// ERROR or stuck in BUILD; 0 after a boot that reached ACTIVE).
    #[serde(default)]
    pub boot_failures: u32,
    /// Servers still listed `delete_timeout_secs` after this controller's
    /// first `DELETE` ([`crate::deletes`]); empty when none.
    #[serde(default)]
    pub stuck_deletes: Vec<crate::deletes::StuckDelete>,
    /// Whether the pool's last observation succeeded (its counts are
    /// current); `false` before the first one and while it fails.
    #[serde(default)]
    pub observed: bool,
    /// The pool's failed cycles in a row (0 after a success).
    #[serde(default)]
    pub failures: u32,
    /// Whether the last failed cycle failed with a permanent error (one
    /// retrying cannot fix).
    #[serde(default)]
    pub failure_permanent: bool,
}

/// VM counts of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmCounts {
    /// Building, or active without a first heartbeat yet.
    pub booting: u32,
    /// Active with a live agent that takes jobs.
    pub active: u32,
    /// Active with an agent that stopped pulling (draining, drained, agreed
    /// to be deleted).
    pub draining: u32,
    /// In ERROR, stuck, black holes and dead agents (to be deleted).
    pub error: u32,
}

/// Live agent counts of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentCounts {
    /// Pulling, no job.
    pub idle: u32,
    /// Running at least one job.
    pub busy: u32,
    /// Not pulling.
    pub draining: u32,
}

/// One server of a pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStatus {
    /// Nova server id.
    pub id: String,
    /// Server name (= agent id).
    pub name: String,
    /// Nova status (`BUILD`, `ACTIVE`, `ERROR`, …).
    pub status: String,
    /// Agent state as judged by the controller (see the module doc).
    pub agent_state: String,
    /// Jobs the agent reported running.
    pub running: u32,
    /// Their job ids, per the agent's last heartbeat (empty: none, or no
    /// heartbeat).
    #[serde(default)]
    pub jobs: Vec<String>,
    /// Job slots its last heartbeat reported (`null`: no heartbeat).
    #[serde(default)]
    pub slots: Option<u32>,
    /// Whether those slots differ from the pool's configured `slots` (the
    /// controller plans with the pool's; the agent runs with its own).
    #[serde(default)]
    pub slots_mismatch: bool,
    /// Whole seconds since Nova created the server, as of the pool's
    /// `observed_at` (`null` if Nova did not say).
    #[serde(default)]
    pub age_secs: Option<u64>,
    /// Whole seconds since the controller received the agent's last
    /// heartbeat, as of `observed_at` (`null`: none received).
    #[serde(default)]
    pub heartbeat_age_secs: Option<u64>,
    /// The operator's `--reason` of the drain the agent follows (`vq drain
    /// --reason`), per its last heartbeat; absent when it is not draining
    /// for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_reason: Option<String>,
}

/// One decision of the planner.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// When decided, Unix seconds (as a string-free number).
    #[serde(with = "f64_as_secs")]
    pub at: u64,
    /// `boot`, `ask-delete` or `delete`.
    pub action: String,
    /// Server name the action is about (`None` for boots).
    pub server: Option<String>,
    /// Why.
    pub reason: String,
}

mod f64_as_secs {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let v = f64::deserialize(d)?;
        Ok(if v.is_finite() && v > 0.0 {
            v as u64
        } else {
            0
        })
    }
}

fn write(status: &RwLock<StatusReport>) -> std::sync::RwLockWriteGuard<'_, StatusReport> {
    status.write().unwrap_or_else(|p| p.into_inner())
}

/// Publishes `pool`'s observation and plan: its entry of the status page
/// (counts, servers, the plan's decisions, the obstacle; the last error
/// cleared) and its gauges. `started`: when the controller started.
pub fn publish(
    status: &RwLock<StatusReport>,
    metrics: &Metrics,
    started: Instant,
    pool: &str,
    observed: &Observed,
    planned: &Plan,
) {
    let mut vms = VmCounts::default();
    let mut agents = AgentCounts::default();
    let mut servers = Vec::new();
    let (mut slots, mut slots_used) = (0u32, 0u32);
    for (s, c) in observed.servers.iter().zip(&planned.classes) {
        if matches!(
            c,
            Class::Idle | Class::Busy | Class::Draining | Class::Agreed
        ) {
            if let Some(a) = &s.agent {
                slots += a.slots;
                slots_used += a.running.min(a.slots);
            }
        }
        match c {
            Class::Booting | Class::Unknown => vms.booting += 1,
            Class::Idle => {
                vms.active += 1;
                agents.idle += 1;
            }
            Class::Busy => {
                vms.active += 1;
                agents.busy += 1;
            }
            Class::Draining | Class::Agreed => {
                vms.draining += 1;
                agents.draining += 1;
            }
            Class::Error | Class::StuckBuild | Class::BlackHole | Class::Dead => vms.error += 1,
            Class::Vanishing => {}
        }
        servers.push(ServerStatus {
            id: s.id.clone(),
            name: s.name.clone(),
            status: match &s.status {
                NovaStatus::Build => "BUILD".into(),
                NovaStatus::Active => "ACTIVE".into(),
                NovaStatus::Error => "ERROR".into(),
                NovaStatus::Deleting => "DELETING".into(),
                NovaStatus::Other(o) => o.clone(),
            },
            agent_state: c.agent_state().into(),
            running: s.agent.as_ref().map(|a| a.running).unwrap_or(0),
            jobs: s.agent.as_ref().map(|a| a.jobs.clone()).unwrap_or_default(),
            slots: s.agent.as_ref().map(|a| a.slots),
            slots_mismatch: s.agent.as_ref().is_some_and(|a| {
                observed.configured_slots != 0 && a.slots != observed.configured_slots
            }),
            age_secs: s.age_secs.map(|a| a.max(0.0) as u64),
            heartbeat_age_secs: s
                .agent
                .as_ref()
                .map(|a| a.heartbeat_age_secs.max(0.0) as u64),
            drain_reason: s.agent.as_ref().and_then(|a| a.drain_reason.clone()),
        });
    }
    let now = unix_now();
    let m = metrics;
    m.pool_observed_at(pool, now);
    m.pool_queued
        .get_or_create(&Metrics::pool(pool))
        .set(observed.queued as i64);
    m.pool_running
        .get_or_create(&Metrics::pool(pool))
        .set(observed.running as i64);
    m.pool_target
        .get_or_create(&Metrics::pool(pool))
        .set(i64::from(planned.target));
    for (state, n) in VM_STATES
        .into_iter()
        .zip([vms.booting, vms.active, vms.draining, vms.error])
    {
        m.pool_vms
            .get_or_create(&Metrics::pool_and(pool, "state", state))
            .set(i64::from(n));
    }
    for (state, n) in AGENT_STATES
        .into_iter()
        .zip([agents.idle, agents.busy, agents.draining])
    {
        m.pool_agents
            .get_or_create(&Metrics::pool_and(pool, "state", state))
            .set(i64::from(n));
    }
    for (state, n) in SLOT_STATES
        .into_iter()
        .zip([slots.saturating_sub(slots_used), slots_used])
    {
        m.pool_slots
            .get_or_create(&Metrics::pool_and(pool, "state", state))
            .set(i64::from(n));
    }
    let mut st = write(status);
    st.generated_at = now;
    st.uptime_secs = started.elapsed().as_secs_f64();
    let ps = st.pools.entry(pool.to_string()).or_default();
    ps.queued = observed.queued;
    ps.running = observed.running;
    ps.target = planned.target;
    ps.vms = vms;
    ps.agents = agents;
    ps.servers = servers;
    ps.observed_at = now;
    // `last_error` stays until the cycle succeeds ([`show_success`]): this
    // runs before the act step, which may fail again.
    ps.observed = true;
    ps.obstacle = observed.boot_obstacle.clone();
    ps.obstacle_kind = observed
        .boot_obstacle
        .as_ref()
        .map(|_| OBSTACLE_UNLISTED.to_string());
    if ps.obstacle.is_none() {
        ps.obstacle = observed.boot_gate.reason();
        ps.obstacle_kind = observed.boot_gate.kind().map(str::to_string);
    }
    if ps.obstacle.is_none() {
        if let Some(l) = &planned.limited {
            ps.obstacle = Some(l.reason.clone());
            ps.obstacle_kind = Some(l.kind.to_string());
        }
    }
    let kind = ps.obstacle_kind.clone();
    m.pool_obstacle_kind(pool, kind.as_deref());
    for a in &planned.actions {
        ps.last_decisions.push(Decision {
            at: now as u64,
            action: a.kind().into(),
            server: match a {
                Action::Boot { .. } => None,
                Action::AskDelete { agent, .. } => Some(agent.clone()),
                Action::Delete { name, .. } => Some(name.clone()),
            },
            reason: a.reason().into(),
        });
    }
    let excess = ps.last_decisions.len().saturating_sub(DECISIONS_KEPT);
    ps.last_decisions.drain(..excess);
}

/// Counts what one pool's act step did: servers created and deleted (by
/// cause), failed boots (`vq_boot_failures_total{reason}`: `create`,
/// `resolve`, `user-data` when the boot action failed; `error`,
/// `stuck-build`, `black-hole` when a server that never became a working
/// agent was deleted) and the failed cloud requests among its errors.
pub fn count_actions(metrics: &Metrics, pool: &str, report: &ActReport) {
    metrics
        .created
        .get_or_create(&Metrics::pool(pool))
        .inc_by(report.created.len() as u64);
    for (_, cause) in &report.deleted {
        metrics
            .deleted
            .get_or_create(&Metrics::pool_and(pool, "reason", cause.label()))
            .inc();
        // A server that never became a working agent is a failed boot.
        if matches!(
            cause,
            DeleteCause::Error | DeleteCause::StuckBuild | DeleteCause::BlackHole
        ) {
            metrics
                .boot_failures
                .get_or_create(&Metrics::pool_and(pool, "reason", cause.label()))
                .inc();
        }
    }
    for e in &report.errors {
        let reason = match e {
            ActError::Create { .. } => "create",
            ActError::Resolve { .. } => "resolve",
            ActError::UserData { .. } => "user-data",
            _ => continue,
        };
        metrics
            .boot_failures
            .get_or_create(&Metrics::pool_and(pool, "reason", reason))
            .inc();
    }
    let cloud_errors = report
        .errors
        .iter()
        .filter(|e| {
            matches!(
                e,
                ActError::Create { .. } | ActError::Delete { .. } | ActError::Resolve { .. }
            )
        })
        .count();
    metrics.cloud_errors.inc_by(cloud_errors as u64);
}

/// How one pool's cycle failed, for [`show_failure`].
#[derive(Debug, Clone)]
pub struct PoolFailure {
    /// The whole cause chain, one line.
    pub error: String,
    /// Failed cycles in a row, this one included.
    pub attempts: u32,
    /// Whether retrying cannot fix it.
    pub permanent: bool,
    /// Whether the pool was observed before the cycle failed (an act
    /// failure); `false`: its observation failed, its values are stale.
    pub observed: bool,
}

/// Shows `pool`'s failed cycle: its last error, failure count and, when
/// its observation failed, that its values are stale (`observed` false,
/// value gauges removed: [`Metrics::pool_unobserved`]).
pub fn show_failure(
    status: &RwLock<StatusReport>,
    metrics: &Metrics,
    pool: &str,
    failure: PoolFailure,
) {
    if !failure.observed {
        metrics.pool_unobserved(pool);
    }
    if let Some(ps) = write(status).pools.get_mut(pool) {
        if !failure.observed {
            ps.observed = false;
            ps.obstacle = Some(format!("not observed: {}", failure.error));
            ps.obstacle_kind = Some(OBSTACLE_UNOBSERVED.into());
            metrics.pool_obstacle_kind(pool, Some(OBSTACLE_UNOBSERVED));
        }
        ps.last_error = Some(failure.error);
        ps.failures = failure.attempts;
        ps.failure_permanent = failure.permanent;
    }
}

/// Shows `pool`'s cycle as succeeded: no failures in a row.
pub fn show_success(status: &RwLock<StatusReport>, pool: &str) {
    if let Some(ps) = write(status).pools.get_mut(pool) {
        ps.last_error = None;
        ps.failures = 0;
        ps.failure_permanent = false;
    }
}

/// Shows `pools` as held because the broker blocks publishing (`reason`):
/// not observed this cycle, so their values are stale.
pub fn show_held(status: &RwLock<StatusReport>, metrics: &Metrics, pools: &[String], reason: &str) {
    let mut st = write(status);
    st.broker_blocked = Some(reason.to_string());
    for p in pools {
        metrics.pool_unobserved(p);
        if let Some(ps) = st.pools.get_mut(p) {
            ps.observed = false;
            ps.last_error = Some(format!(
                "the broker blocks publishing ({reason}): holding, no VM booted or deleted"
            ));
        }
    }
}

/// What a cycle learnt of the controller's connections, for
/// [`show_connections`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach<'a> {
    /// The broker could not be reached (the cloud was not tried).
    NoBroker,
    /// The broker was reached; the cloud was not tried (probe failed,
    /// alarm).
    Broker,
    /// Both were reached, or the cloud failed with this cause chain.
    Both(Option<&'a str>),
}

/// Records what a cycle that ran learnt of the broker and the cloud
/// (`broker_connected`, `cloud_error`, `broker_blocked`,
/// `vq_broker_connected`) and when it ended.
pub fn show_connections(status: &RwLock<StatusReport>, metrics: &Metrics, reach: Reach<'_>) {
    let mut st = write(status);
    st.broker_connected = reach != Reach::NoBroker;
    metrics.broker_connected.set(i64::from(st.broker_connected));
    if let Reach::Both(cloud) = reach {
        st.cloud_error = cloud.map(str::to_string);
        st.broker_blocked = None;
    }
    st.last_cycle_at = unix_now();
}

/// A pool whose cycles failed this many times in a row with transient
/// errors makes the controller not ready ([`readiness`]); fewer are taken
/// as the pool waiting out its backoff.
pub const NOT_READY_AFTER_FAILURES: u32 = 3;

/// Shows `role` (and, while standby, `why`) on `/status` and in
/// `vq_controller_leader`.
pub fn show_role(
    status: &RwLock<StatusReport>,
    metrics: &Metrics,
    role: crate::leader::Role,
    why: Option<&str>,
) {
    let mut s = status.write().unwrap_or_else(|p| p.into_inner());
    s.role = role;
    s.standby_reason = why.map(str::to_string);
    metrics
        .controller_leader
        .set(i64::from(role == crate::leader::Role::Leader));
}

/// Why the controller is not ready, one reason per entry (empty: ready).
/// Ready means: a cycle has run, the broker is connected and refused no
/// permission nor blocks publishing, the cloud answered the last server
/// listing, and the last cycle of every pool succeeded or is inside its
/// backoff: failed with a transient error fewer than
/// [`NOT_READY_AFTER_FAILURES`] times in a row.
/// A standby controller is ready: ready means serving `/status`,
/// `/metrics` and `/jobs`, which a standby does (its role is in `/status`,
/// not a readiness reason).
pub fn readiness(report: &StatusReport) -> Vec<String> {
    let mut reasons = Vec::new();
    if report.last_cycle_at <= 0.0 {
        reasons.push("no reconcile cycle has run yet".to_string());
    }
    if !report.broker_connected {
        reasons.push("not connected to the broker".to_string());
    }
    if let Some(r) = &report.broker_access_refused {
        reasons.push(format!("the broker refused the controller's account: {r}"));
    }
    if let Some(b) = &report.broker_blocked {
        reasons.push(format!(
            "the broker blocks publishing ({b}): every pool is held"
        ));
    }
    if let Some(e) = &report.cloud_error {
        reasons.push(format!("the cloud cannot be read: {e}"));
    }
    for (name, p) in &report.pools {
        if p.failures > 0 && (p.failure_permanent || p.failures >= NOT_READY_AFTER_FAILURES) {
            reasons.push(format!(
                "pool {name}: {} failed cycle(s) in a row{}: {}",
                p.failures,
                if p.failure_permanent {
                    ", permanent error"
                } else {
                    ""
                },
                p.last_error.as_deref().unwrap_or("")
            ));
        }
    }
    reasons
}

/// [`PoolStatus::obstacle_kind`] of a server this controller created that
/// the listings do not show.
pub const OBSTACLE_UNLISTED: &str = "server-unlisted";

/// `obstacle_kind` of a pool whose observation failed (its counts are not
/// current; `obstacle` says why).
pub const OBSTACLE_UNOBSERVED: &str = "unobserved";

/// Every `obstacle_kind` (the `kind` label of `vq_pool_obstacle`): an
/// unlisted created server, the boot gate's (`boot-backoff`,
/// `breaker-open`, `breaker-half-open`), the planner's limits (`max`,
/// `quota`, `boot-cooldown`), `unobserved`.
pub const OBSTACLE_KINDS: [&str; 8] = [
    OBSTACLE_UNLISTED,
    "boot-backoff",
    "breaker-open",
    "breaker-half-open",
    crate::plan::LIMIT_MAX,
    crate::plan::LIMIT_QUOTA,
    crate::plan::LIMIT_COOLDOWN,
    OBSTACLE_UNOBSERVED,
];

/// How `vq pools` and the status page introduce an obstacle of `kind`:
/// the planner's limits hold some boots back, the others stop them.
pub fn obstacle_heading(kind: Option<&str>) -> &'static str {
    match kind {
        Some(crate::plan::LIMIT_MAX | crate::plan::LIMIT_QUOTA | crate::plan::LIMIT_COOLDOWN) => {
            "boots held back"
        }
        _ => "boots stopped",
    }
}

/// Whether `pool`'s entry shows the obstacle of an unlisted created server
/// (its boots are stopped).
pub fn has_obstacle(status: &RwLock<StatusReport>, pool: &str) -> bool {
    status
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .pools
        .get(pool)
        .is_some_and(|ps| ps.obstacle_kind.as_deref() == Some(OBSTACLE_UNLISTED))
}

/// Shows `pool`'s boot gate after its act step (a failed create may have
/// backed it off or opened its breaker) unless an unlisted server is the
/// obstacle, and sets `vq_pool_breaker_open{pool}` (1 while the breaker is
/// open or half-open) and `vq_pool_boot_failures{pool}`.
pub fn show_breaker(
    status: &RwLock<StatusReport>,
    metrics: &Metrics,
    pool: &str,
    gate: &crate::breaker::BootGate,
    failures: u32,
) {
    let open = matches!(gate.kind(), Some("breaker-open" | "breaker-half-open"));
    metrics
        .pool_breaker_open
        .get_or_create(&Metrics::pool(pool))
        .set(i64::from(open));
    metrics
        .pool_boot_failures
        .get_or_create(&Metrics::pool(pool))
        .set(i64::from(failures));
    let mut st = write(status);
    let ps = st.pools.entry(pool.to_string()).or_default();
    ps.boot_failures = failures;
    if ps.obstacle_kind.as_deref() != Some(OBSTACLE_UNLISTED) {
        // A gate that opened after the act step leaves the planner's limit
        // of this cycle shown.
        let planner = matches!(
            ps.obstacle_kind.as_deref(),
            Some(crate::plan::LIMIT_MAX | crate::plan::LIMIT_QUOTA | crate::plan::LIMIT_COOLDOWN)
        );
        if gate.kind().is_some() || !planner {
            ps.obstacle = gate.reason();
            ps.obstacle_kind = gate.kind().map(str::to_string);
        }
    }
    metrics.pool_obstacle_kind(pool, ps.obstacle_kind.as_deref());
}

/// Shows the pool's servers that will not go ([`crate::deletes`]) in
/// `/status` and `vq_pool_servers_stuck_deleting`.
pub fn show_stuck_deletes(
    status: &RwLock<StatusReport>,
    metrics: &Metrics,
    pool: &str,
    stuck: Vec<crate::deletes::StuckDelete>,
) {
    metrics
        .pool_servers_stuck_deleting
        .get_or_create(&Metrics::pool(pool))
        .set(stuck.len() as i64);
    write(status)
        .pools
        .entry(pool.to_string())
        .or_default()
        .stuck_deletes = stuck;
}

/// Sets [`StatusReport::broker_access_refused`] after a cycle that
/// touched the broker.
pub fn show_refused(status: &RwLock<StatusReport>, refused: Option<String>) {
    write(status).broker_access_refused = refused;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_with(pool: &str) -> RwLock<StatusReport> {
        let mut r = StatusReport::default();
        r.pools.insert(pool.into(), PoolStatus::default());
        RwLock::new(r)
    }

    fn observed(queued: u64) -> (Observed, Plan) {
        let o = Observed {
            pool: "cms".into(),
            queued,
            ..Default::default()
        };
        let p = Plan {
            target: 2,
            active: 0,
            booting: 0,
            classes: vec![],
            actions: vec![],
            held: vec![],
            surplus: false,
            limited: None,
        };
        (o, p)
    }

    #[test]
    fn the_last_error_stays_until_a_cycle_succeeds() {
        let status = status_with("cms");
        let m = Metrics::new();
        let (o, p) = observed(1);
        let fail = || PoolFailure {
            error: "create refused: 403 Quota exceeded".into(),
            attempts: 1,
            permanent: false,
            observed: true,
        };
        show_failure(&status, &m, "cms", fail());
        // The next cycle publishes its view before its act step fails again.
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        assert_eq!(
            status.read().unwrap().pools["cms"].last_error.as_deref(),
            Some("create refused: 403 Quota exceeded"),
            "cleared before the cycle's outcome was known"
        );
        show_failure(&status, &m, "cms", fail());
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        show_success(&status, "cms");
        assert_eq!(status.read().unwrap().pools["cms"].last_error, None);
    }

    #[test]
    fn an_agent_heartbeating_other_slots_than_its_pool_is_shown_as_a_mismatch() {
        use crate::observe::{AgentSeen, ObservedServer};
        use vq_common::messages::AgentState;
        let status = status_with("cms");
        let m = Metrics::new();
        let seen = |slots| AgentSeen {
            heartbeat_age_secs: 1.0,
            state: AgentState::Idle,
            running: 0,
            jobs: vec![],
            slots,
            is_del: false,
            idle_secs: 0.0,
            answer: None,
            drain_reason: None,
        };
        let server = |name: &str, slots| ObservedServer {
            id: format!("id-{name}"),
            name: name.into(),
            status: NovaStatus::Active,
            age_secs: Some(10.0),
            agent: Some(seen(slots)),
        };
        let o = Observed {
            pool: "cms".into(),
            servers: vec![server("a", 2), server("b", 4)],
            configured_slots: 4,
            ..Default::default()
        };
        let p = Plan {
            target: 2,
            active: 2,
            booting: 0,
            classes: vec![Class::Idle, Class::Idle],
            actions: vec![],
            held: vec![],
            surplus: false,
            limited: None,
        };
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        let report = status.read().unwrap();
        let servers = &report.pools["cms"].servers;
        assert_eq!(
            (servers[0].slots, servers[0].slots_mismatch),
            (Some(2), true)
        );
        assert_eq!(
            (servers[1].slots, servers[1].slots_mismatch),
            (Some(4), false)
        );
        let json = serde_json::to_value(&report.pools["cms"]).unwrap();
        assert_eq!(json["servers"][0]["slots_mismatch"], true);
    }

    #[test]
    fn each_server_shows_the_job_ids_and_drain_reason_of_its_agents_heartbeat() {
        use crate::observe::{AgentSeen, ObservedServer};
        use vq_common::messages::AgentState;
        let status = status_with("cms");
        let m = Metrics::new();
        let busy = AgentSeen {
            heartbeat_age_secs: 3.0,
            state: AgentState::Draining,
            running: 2,
            jobs: vec!["17-a".into(), "18-b".into()],
            slots: 2,
            is_del: false,
            idle_secs: 0.0,
            answer: None,
            drain_reason: Some("kernel update".into()),
        };
        let server = |name: &str, agent| ObservedServer {
            id: format!("id-{name}"),
            name: name.into(),
            status: NovaStatus::Active,
            age_secs: Some(10.0),
            agent,
        };
        let o = Observed {
            pool: "cms".into(),
            servers: vec![server("a", Some(busy)), server("b", None)],
            configured_slots: 2,
            ..Default::default()
        };
        let p = Plan {
            target: 2,
            active: 0,
            booting: 1,
            classes: vec![Class::Draining, Class::Booting],
            actions: vec![],
            held: vec![],
            limited: None,
            surplus: false,
        };
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        let json = serde_json::to_value(&status.read().unwrap().pools["cms"]).unwrap();
        let s = &json["servers"];
        assert_eq!(s[0]["jobs"], serde_json::json!(["17-a", "18-b"]));
        assert_eq!(s[0]["running"], 2);
        assert_eq!(s[0]["drain_reason"], "kernel update");
        assert_eq!(s[0]["agent_state"], "draining");
        assert_eq!(s[1]["jobs"], serde_json::json!([]));
        assert!(s[1].get("drain_reason").is_none(), "{s}");
    }

    #[test]
    fn a_pool_whose_observation_failed_serves_no_stale_values() {
        let status = status_with("cms");
        let m = Metrics::new();
        let (o, p) = observed(3);
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        let text = m.render();
        assert!(text.contains("vq_pool_queued{pool=\"cms\"} 3"), "{text}");
        assert!(text.contains("vq_pool_observed{pool=\"cms\"} 1"), "{text}");
        assert!(
            text.contains("vq_pool_vms{pool=\"cms\",state=\"booting\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("vq_pool_agents{pool=\"cms\",state=\"idle\"} 0")
                && text.contains("vq_pool_slots{pool=\"cms\",state=\"free\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE vq_pool_last_success_timestamp_seconds gauge")
                && text.contains("# UNIT vq_pool_last_success_timestamp_seconds seconds"),
            "{text}"
        );
        let ts_line = |t: &str| {
            t.lines()
                .find(|l| l.starts_with("vq_pool_last_success_timestamp_seconds{pool=\"cms\"}"))
                .map(str::to_string)
        };
        let before = ts_line(&text).expect("a last success");
        assert!(status.read().unwrap().pools["cms"].observed);

        show_failure(
            &status,
            &m,
            "cms",
            PoolFailure {
                error: "no broker connection: refused".into(),
                attempts: 1,
                permanent: false,
                observed: false,
            },
        );
        let text = m.render();
        assert!(
            !text.contains("vq_pool_queued{"),
            "stale value served: {text}"
        );
        assert!(!text.contains("vq_pool_running{"), "{text}");
        assert!(!text.contains("vq_pool_target_vms{"), "{text}");
        assert!(!text.contains("vq_pool_vms{"), "{text}");
        assert!(!text.contains("vq_pool_agents{"), "{text}");
        assert!(!text.contains("vq_pool_slots{"), "{text}");
        assert!(text.contains("vq_pool_observed{pool=\"cms\"} 0"), "{text}");
        assert_eq!(ts_line(&text), Some(before), "the last success is kept");
        let st = status.read().unwrap();
        assert!(!st.pools["cms"].observed);
        assert_eq!(st.pools["cms"].failures, 1);
        drop(st);

        // An act failure leaves the (current) values in place.
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        show_failure(
            &status,
            &m,
            "cms",
            PoolFailure {
                error: "cannot create".into(),
                attempts: 1,
                permanent: false,
                observed: true,
            },
        );
        assert!(m.render().contains("vq_pool_queued{pool=\"cms\"} 3"));
        assert!(status.read().unwrap().pools["cms"].observed);
    }

    #[test]
    fn held_pools_are_unobserved_and_the_alarm_makes_the_controller_not_ready() {
        let status = status_with("cms");
        let m = Metrics::new();
        let (o, p) = observed(1);
        publish(&status, &m, Instant::now(), "cms", &o, &p);
        show_connections(&status, &m, Reach::Both(None));
        assert!(readiness(&status.read().unwrap()).is_empty());
        show_held(&status, &m, &["cms".into()], "memory alarm");
        show_connections(&status, &m, Reach::Broker);
        assert!(m.render().contains("vq_pool_observed{pool=\"cms\"} 0"));
        let reasons = readiness(&status.read().unwrap());
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(reasons[0].contains("memory alarm"), "{reasons:?}");
        show_connections(&status, &m, Reach::Both(None));
        assert!(readiness(&status.read().unwrap()).is_empty());
    }

    #[test]
    fn readiness_names_every_reason_and_tolerates_a_pool_inside_its_backoff() {
        let status = status_with("cms");
        let m = Metrics::new();
        let r = readiness(&status.read().unwrap());
        assert!(
            r.iter().any(|r| r.contains("no reconcile cycle"))
                && r.iter().any(|r| r.contains("not connected to the broker")),
            "{r:?}"
        );
        show_connections(&status, &m, Reach::NoBroker);
        assert!(m.render().contains("vq_broker_connected 0"));
        assert_eq!(
            readiness(&status.read().unwrap()),
            ["not connected to the broker"]
        );
        show_connections(&status, &m, Reach::Both(Some("cannot list: HTTP 503")));
        assert!(m.render().contains("vq_broker_connected 1"));
        assert_eq!(
            readiness(&status.read().unwrap()),
            ["the cloud cannot be read: cannot list: HTTP 503"]
        );
        show_connections(&status, &m, Reach::Both(None));
        let fail = |attempts, permanent| PoolFailure {
            error: "cannot read the depth of queue vq.jobs.cms".into(),
            attempts,
            permanent,
            observed: false,
        };
        for attempts in 1..NOT_READY_AFTER_FAILURES {
            show_failure(&status, &m, "cms", fail(attempts, false));
            assert!(
                readiness(&status.read().unwrap()).is_empty(),
                "backing off after {attempts} failure(s)"
            );
        }
        show_failure(&status, &m, "cms", fail(NOT_READY_AFTER_FAILURES, false));
        let r = readiness(&status.read().unwrap());
        assert!(
            r.len() == 1 && r[0].starts_with("pool cms: 3 failed") && r[0].contains("vq.jobs.cms"),
            "{r:?}"
        );
        show_success(&status, "cms");
        assert!(readiness(&status.read().unwrap()).is_empty());
        show_failure(&status, &m, "cms", fail(1, true));
        let r = readiness(&status.read().unwrap());
        assert!(r.len() == 1 && r[0].contains("permanent"), "{r:?}");
    }
}
