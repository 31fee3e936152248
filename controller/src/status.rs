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

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
