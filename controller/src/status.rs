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
//!   "pools": {
//!     "cms": {
//!       "queued": 12, "running": 4, "target": 4,
//!       "vms": {"booting": 1, "active": 3, "draining": 0, "error": 0},
//!       "agents": {"idle": 0, "busy": 3, "draining": 0},
//!       "servers": [
//!         {"id": "…", "name": "vq-cms-1a2b3c4d", "status": "ACTIVE",
//!          "agent_state": "busy", "running": 1}
//!       ],
//!       "last_decisions": [
//!         {"at": 1764412790.0, "action": "boot", "server": null,
//!          "reason": "target 4 VMs for 12 queued + 4 running jobs at 4 slots/VM; 3 exist"}
//!       ],
//!       "observed_at": 1764412799.0,
//!       "last_error": null,
//!       "obstacle": null
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
//! The loop publishes into it (and into the [`Metrics`]) through the
//! functions at the end of this module: [`publish`] after each pool's
//! plan, [`count_actions`] after it acted, [`show_error`], [`show_held`]
//! and [`show_refused`] when a cycle did not go through.

use std::collections::BTreeMap;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use vq_common::messages::unix_now;

use crate::act::ActReport;
use crate::error::ActError;
use crate::metrics::Metrics;
use crate::observe::{NovaStatus, Observed};
use crate::plan::{Action, Class, Plan};

/// Number of decisions kept per pool in [`PoolStatus::last_decisions`].
pub const DECISIONS_KEPT: usize = 20;

/// The whole `/status` document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Cluster name.
    pub cluster: String,
    /// When this document was produced, Unix seconds.
    pub generated_at: f64,
    /// Seconds since the controller started.
    pub uptime_secs: f64,
    /// Per pool, by name.
    pub pools: BTreeMap<String, PoolStatus>,
    /// The broker's ACCESS_REFUSED text (it names the operation, the
    /// resource and the user) if the last cycle failed for lack of a
    /// permission of the controller's account, else `null`; while set,
    /// `/healthz` answers 503 with it.
    #[serde(default)]
    pub broker_access_refused: Option<String>,
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
    for (s, c) in observed.servers.iter().zip(&planned.classes) {
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
        });
    }
    let m = metrics;
    m.pool_queued
        .get_or_create(&Metrics::pool(pool))
        .set(observed.queued as i64);
    m.pool_running
        .get_or_create(&Metrics::pool(pool))
        .set(observed.running as i64);
    m.pool_target
        .get_or_create(&Metrics::pool(pool))
        .set(i64::from(planned.target));
    for (state, n) in [
        ("booting", vms.booting),
        ("active", vms.active),
        ("draining", vms.draining),
        ("error", vms.error),
    ] {
        m.pool_vms
            .get_or_create(&Metrics::pool_and(pool, "state", state))
            .set(i64::from(n));
    }
    let now = unix_now();
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
    ps.last_error = None;
    ps.obstacle = observed.boot_obstacle.clone();
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
/// cause) and the failed cloud requests among its errors.
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

/// Shows `error` (the whole cause chain, one line) as `pool`'s last error.
pub fn show_error(status: &RwLock<StatusReport>, pool: &str, error: String) {
    if let Some(ps) = write(status).pools.get_mut(pool) {
        ps.last_error = Some(error);
    }
}

/// Shows `pools` as held because the broker blocks publishing (`reason`).
pub fn show_held(status: &RwLock<StatusReport>, pools: &[String], reason: &str) {
    let mut st = write(status);
    for p in pools {
        if let Some(ps) = st.pools.get_mut(p) {
            ps.last_error = Some(format!(
                "the broker blocks publishing ({reason}): holding, no VM booted or deleted"
            ));
        }
    }
}

/// Whether `pool`'s entry shows an obstacle (its boots are stopped).
pub fn has_obstacle(status: &RwLock<StatusReport>, pool: &str) -> bool {
    status
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .pools
        .get(pool)
        .is_some_and(|ps| ps.obstacle.is_some())
}

/// Sets [`StatusReport::broker_access_refused`] after a cycle that
/// touched the broker.
pub fn show_refused(status: &RwLock<StatusReport>, refused: Option<String>) {
    write(status).broker_access_refused = refused;
}
