//! The in-memory cloud: tokens, servers, faults. One mutex, never held
//! across an await.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use super::admin::Faults;
use super::cgroup::{VmCgroup, VmCgroups};
use super::SimConfig;

/// A Nova flavor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flavor {
    pub id: &'static str,
    pub name: &'static str,
    pub ram_mb: u32,
    pub vcpus: u32,
    pub disk_gb: u32,
}

/// The flavors of a default devstack (and of the shared fixture).
pub(crate) const FLAVORS: [Flavor; 3] = [
    Flavor {
        id: "1",
        name: "m1.tiny",
        ram_mb: 512,
        vcpus: 1,
        disk_gb: 1,
    },
    Flavor {
        id: "2",
        name: "m1.small",
        ram_mb: 2048,
        vcpus: 1,
        disk_gb: 20,
    },
    Flavor {
        id: "3",
        name: "m1.medium",
        ram_mb: 4096,
        vcpus: 2,
        disk_gb: 40,
    },
];

/// Look a flavor up by id.
pub(crate) fn flavor(id: &str) -> Option<Flavor> {
    FLAVORS.iter().copied().find(|f| f.id == id)
}

/// How an issued token was obtained.
#[derive(Debug, Clone)]
pub(crate) struct Token {
    pub methods: Vec<&'static str>,
    pub issued_at: SystemTime,
    pub expires_at: SystemTime,
    /// Project scope (absent for an unscoped token).
    pub scoped: bool,
    pub app_cred: Option<String>,
    pub audit_id: String,
}

/// Lifecycle of a sim server; Nova's status/vm_state/task_state derive from it.
#[derive(Debug, Clone)]
pub(crate) enum Phase {
    Build,
    Active,
    Error { message: String, at: SystemTime },
}

/// The local process standing in for a VM's jobagent.
#[derive(Debug, Clone)]
pub(crate) struct Agent {
    pub pid: u32,
    pub running: bool,
    pub exit: Option<String>,
    /// The VM's cgroup, holding the agent and all it started; `None` when
    /// the VM is not contained (no cgroup v2), then the power-off kills
    /// the agent's process tree.
    pub cgroup: Option<VmCgroup>,
}

/// One server.
#[derive(Debug, Clone)]
pub(crate) struct Server {
    pub id: String,
    /// Creation order, the tie-breaker of Nova's `created_at desc, id desc`.
    pub seq: u64,
    pub name: String,
    pub flavor: Flavor,
    pub image_id: String,
    pub key_name: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub tags: BTreeSet<String>,
    pub description: Option<String>,
    pub availability_zone: String,
    pub user_data: Option<String>,
    pub created: SystemTime,
    pub updated: SystemTime,
    pub launched: Option<SystemTime>,
    pub phase: Phase,
    pub deleting: bool,
    /// Created while `stuck_build` was set: never leaves BUILD.
    pub stuck: bool,
    /// Created while `hide_new_servers` was set: missing from listings
    /// while it stays set.
    pub hidden: bool,
    /// Created while `create_error_rate` drew a failure: goes ERROR at boot.
    pub doomed: bool,
    /// Booted with NICs (`networks` not `"none"`): shows security groups.
    pub has_ports: bool,
    pub agent: Option<Agent>,
}

impl Server {
    /// Nova's `status`.
    pub fn status(&self) -> &'static str {
        match self.phase {
            Phase::Build => "BUILD",
            Phase::Active => "ACTIVE",
            Phase::Error { .. } => "ERROR",
        }
    }

    /// Nova's `OS-EXT-STS:vm_state`.
    pub fn vm_state(&self) -> &'static str {
        match self.phase {
            Phase::Build => "building",
            Phase::Active => "active",
            Phase::Error { .. } => "error",
        }
    }

    /// Nova's `OS-EXT-STS:task_state`.
    pub fn task_state(&self) -> Option<&'static str> {
        if self.deleting {
            Some("deleting")
        } else if matches!(self.phase, Phase::Build) {
            Some("spawning")
        } else {
            None
        }
    }

    /// Nova's `OS-EXT-STS:power_state` (0 NOSTATE, 1 RUNNING).
    pub fn power_state(&self) -> u8 {
        u8::from(matches!(self.phase, Phase::Active))
    }
}

/// Everything mutable.
#[derive(Debug, Default)]
pub(crate) struct Inner {
    pub tokens: HashMap<String, Token>,
    pub servers: BTreeMap<String, Server>,
    pub next_seq: u64,
    pub faults: Faults,
    /// Servers ever created (shown by `/_sim/servers` as `created_total`).
    pub created_total: u64,
    /// Every create and delete request received (`/_sim/requests`), in
    /// arrival order.
    pub mutations: Vec<Mutation>,
    /// `DELETE /servers/{id}` requests answered 204 (shown by
    /// `/_sim/servers` as `delete_requests_total`).
    pub delete_requests_total: u64,
}

impl Inner {
    /// Instances, cores and RAM counted against the quota (Nova counts
    /// every server that exists, ERROR and deleting ones included).
    pub fn usage(&self) -> (u32, u32, u32) {
        self.servers.values().fold((0, 0, 0), |(n, c, r), s| {
            (n + 1, c + s.flavor.vcpus, r + s.flavor.ram_mb)
        })
    }
}

/// Shared by every handler.
pub(crate) struct SimState {
    pub config: SimConfig,
    pub addr: SocketAddr,
    pub user_id: String,
    pub project_id: String,
    pub cancel: CancellationToken,
    /// Where the VMs' cgroups are made; `None` without cgroup v2.
    pub vm_cgroups: Option<VmCgroups>,
    inner: Mutex<Inner>,
}

impl SimState {
    pub fn new(config: SimConfig, addr: SocketAddr, cancel: CancellationToken) -> Self {
        Self {
            config,
            addr,
            user_id: uuid::Uuid::new_v4().simple().to_string(),
            project_id: uuid::Uuid::new_v4().simple().to_string(),
            cancel,
            vm_cgroups: VmCgroups::detect(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Lock the model; a panic elsewhere does not wedge the cloud.
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `http://ADDR`, or `https://ADDR` when serving TLS.
    pub fn base(&self) -> String {
        let scheme = if self.config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// Power every VM off (shutdown and drop): all processes of its
    /// cgroup, or its agent's process tree.
    pub fn stop_all_vms(&self) {
        let agents: Vec<(String, Agent)> = self
            .lock()
            .servers
            .values()
            .filter_map(|s| s.agent.clone().map(|a| (s.id.clone(), a)))
            .collect();
        for (server_id, agent) in agents {
            tracing::info!(%server_id, pid = agent.pid, "stopping VM");
            super::vm::power_off(&agent);
        }
    }
}

/// One create (`POST …/servers`) or delete (`DELETE …/servers/{id}`)
/// request as the sim received it, before any injected fault.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Mutation {
    /// Unix seconds of arrival.
    pub at: f64,
    /// `POST` or `DELETE`.
    pub method: String,
    /// The request path.
    pub path: String,
    /// The client's `User-Agent` (vq-controller puts its pid in it).
    pub user_agent: String,
}
