//! The controller's Prometheus metrics, served by `GET /metrics`
//! ([`crate::http`]) and set by the loop ([`crate::status::publish`] and
//! [`crate::observe`]). README.md's "Monitoring" section lists every
//! family with its type, labels and unit.
//!
//! Stale values are never served as current: while the last observation
//! of a pool failed, its value gauges (`vq_pool_queued`, `vq_pool_running`,
//! `vq_pool_target_vms`, `vq_pool_vms`, `vq_pool_agents`, `vq_pool_slots`)
//! are *absent* from the exposition
//! ([`Metrics::pool_unobserved`]), `vq_pool_observed{pool}` is 0 and
//! `vq_pool_last_success_timestamp_seconds{pool}` keeps the time of the
//! last observation that succeeded. Absent rather than NaN: a query or
//! alert on an absent series yields nothing instead of a number.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use vq_common::messages::{JobEvent, JobState, Outcome};

type Labels = Vec<(String, String)>;

/// The controller's Prometheus metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Jobs waiting per pool.
    pub pool_queued: Family<Labels, Gauge>,
    /// Jobs running per pool.
    pub pool_running: Family<Labels, Gauge>,
    /// Held jobs (waiting for dependencies) the leader holds, per pool.
    pub pool_held: Family<Labels, Gauge>,
    /// Target VMs per pool.
    pub pool_target: Family<Labels, Gauge>,
    /// VMs per pool and state (`booting`, `active`, `draining`, `error`).
    pub pool_vms: Family<Labels, Gauge>,
    /// Servers created per pool.
    pub created: Family<Labels, Counter<u64, AtomicU64>>,
    /// Servers deleted per pool and reason.
    pub deleted: Family<Labels, Counter<u64, AtomicU64>>,
    /// Failed OpenStack requests.
    pub cloud_errors: Counter<u64, AtomicU64>,
    /// 1 while the broker blocks the controller's publishing (memory or
    /// disk alarm; every pool is held), else 0.
    pub broker_blocked: Gauge,
    /// 1 while the controller is connected to the broker, else 0.
    pub broker_connected: Gauge,
    /// Per pool: 1 when its last observation succeeded, else 0.
    pub pool_observed: Family<Labels, Gauge>,
    /// Per pool: when its last observation succeeded, Unix seconds (absent
    /// before the first one).
    pub pool_last_success: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `vq_build_info{version,commit}`, always 1.
    pub build_info: Family<Labels, Gauge>,
    /// OpenStack requests by operation ([`cloud_op`]) and HTTP status (or
    /// `transport` when no response came).
    pub cloud_requests: Family<Labels, Counter<u64, AtomicU64>>,
    /// Failed boots per pool and reason ([`crate::status::count_actions`]).
    pub boot_failures: Family<Labels, Counter<u64, AtomicU64>>,
    /// Broker connections re-established after a lost one.
    pub broker_reconnects: Counter<u64, AtomicU64>,
    /// 1 while this controller holds the controller lock and acts, 0 while
    /// it is standby ([`crate::leader`]).
    pub controller_leader: Gauge,
    /// Times this controller became leader or stopped being it.
    pub leadership_changes: Counter<u64, AtomicU64>,
    /// Job ends heard on the events exchange per pool, outcome and reason
    /// ([`job_end_labels`]).
    pub jobs_ended: Family<Labels, Counter<u64, AtomicU64>>,
    /// Dead letters seen by the dead-letter watch per pool and reason.
    pub jobs_dead_lettered: Family<Labels, Counter<u64, AtomicU64>>,
    /// Duration of each pool's turn of a cycle (observe, plan, act).
    pub reconcile_duration: Family<Labels, Histogram, fn() -> Histogram>,
    /// Seconds from a create's response to the first listing showing the
    /// server ACTIVE.
    pub boot_active: Family<Labels, Histogram, fn() -> Histogram>,
    /// Seconds from the first listing showing a created server ACTIVE to
    /// the first observation of its agent's heartbeat.
    pub boot_heartbeat: Family<Labels, Histogram, fn() -> Histogram>,
    /// Seconds from an ask-delete sent to its answer received.
    pub drain_handshake: Family<Labels, Histogram, fn() -> Histogram>,
    /// Quota used by resource (`instances`, `cores`, `ram_bytes`).
    pub quota_used: Family<Labels, Gauge>,
    /// Quota limit by resource (absent when unlimited).
    pub quota_limit: Family<Labels, Gauge>,
    /// Live agents per pool and state (`idle`, `busy`, `draining`).
    pub pool_agents: Family<Labels, Gauge>,
    /// Job slots of the pool's live agents, `free` or `used`.
    pub pool_slots: Family<Labels, Gauge>,
    /// 1 while the pool's boot circuit breaker is open or half-open.
    pub pool_breaker_open: Family<Labels, Gauge>,
    /// The pool's consecutive boot failures.
    pub pool_boot_failures: Family<Labels, Gauge>,
    /// 1 for the kind of the pool's current obstacle, 0 for the others
    /// ([`crate::status::OBSTACLE_KINDS`]).
    pub pool_obstacle: Family<Labels, Gauge>,
    /// Jobs the controller returned to their pool queue, by pool and
    /// reason (`node-lost`: their agent's server is gone).
    pub jobs_requeued: Family<Labels, Counter<u64, AtomicU64>>,
    /// Queued → started of each job's first start, per pool.
    pub job_wait: Family<Labels, Histogram, fn() -> Histogram>,
    /// Run time of finished jobs (the agent's `usage.wall_secs`), per pool.
    pub job_run: Family<Labels, Histogram, fn() -> Histogram>,
    /// Unix time at which the current Keystone token expires (0: none yet).
    pub cloud_token_expiry: Gauge<f64, AtomicU64>,
    /// Unix time at which the application credential expires; a series
    /// only while one is in use and has an expiry (see
    /// [`Metrics::set_credential_expiry`]).
    pub cloud_credential_expiry: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Servers of the pool still listed `delete_timeout_secs` after the
    /// controller's first `DELETE`.
    pub pool_servers_stuck_deleting: Family<Labels, Gauge>,
}

/// The agent states of `vq_pool_agents{state}`.
pub const AGENT_STATES: [&str; 3] = ["idle", "busy", "draining"];

/// The slot states of `vq_pool_slots{state}`.
pub const SLOT_STATES: [&str; 2] = ["free", "used"];

fn reconcile_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 13))
}

fn boot_active_histogram() -> Histogram {
    Histogram::new(exponential_buckets(5.0, 2.0, 9))
}

fn boot_heartbeat_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 10))
}

/// 1 s to about 9 days.
fn job_run_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 4.0, 11))
}

fn drain_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.1, 2.0, 10))
}

/// The bounded `op` label of an OpenStack request named `op` as the
/// client names it (`GET /servers/detail`, `POST /servers (name)`,
/// `DELETE /servers/<id>`, `POST <keystone>/auth/tokens`, …): `auth`,
/// `list_servers`, `create_server`, `delete_server`, `limits`, `flavors`,
/// `images`, `versions` or `other`.
pub fn cloud_op(op: &str) -> &'static str {
    let (method, path) = op.split_once(' ').unwrap_or((op, ""));
    match method {
        "POST" if path.contains("/auth/tokens") => "auth",
        "POST" if path.starts_with("/servers") => "create_server",
        "DELETE" if path.starts_with("/servers/") => "delete_server",
        "GET" if path.starts_with("/servers/detail") => "list_servers",
        "GET" if path.starts_with("/limits") => "limits",
        "GET" if path.starts_with("/flavors") => "flavors",
        "GET" if path.starts_with("/v2/images") => "images",
        "GET" if path.contains("://") => "versions",
        _ => "other",
    }
}

/// The bounded `outcome` and `reason` labels of a job event about a job
/// that ended, `None` for `started`. Outcomes: `finished` (reasons
/// `exit-zero`, `exit-nonzero`, `signal`, `walltime`, `output-limit`,
/// `failed-to-start`), `cancelled` (`cancelled`; `withdrawn` for a job
/// cancelled while queued) and `failed`
/// ([`failure_reason`]).
pub fn job_end_labels(event: &JobEvent) -> Option<(&'static str, &'static str)> {
    Some(match &event.state {
        JobState::Queued { .. } | JobState::Held { .. } | JobState::Started => return None,
        JobState::Withdrawn { .. } => ("cancelled", "withdrawn"),
        JobState::Finished { outcome, .. } => match outcome {
            Outcome::Cancelled => ("cancelled", "cancelled"),
            Outcome::Exited { code: 0 } => ("finished", "exit-zero"),
            Outcome::Exited { .. } => ("finished", "exit-nonzero"),
            Outcome::Signaled { .. } => ("finished", "signal"),
            Outcome::Walltime => ("finished", "walltime"),
            Outcome::OutputLimit => ("finished", "output-limit"),
            Outcome::FailedToStart { .. } => ("finished", "failed-to-start"),
        },
        JobState::Failed { reason } => (
            "failed",
            if event.duplicate.is_some() {
                "duplicate"
            } else {
                failure_reason(reason)
            },
        ),
    })
}

/// The bounded reason label of a failed job's (or a dead letter's) reason
/// text: `rabbitmq-delivery-limit`, `rabbitmq-expired`,
/// `rabbitmq-rejected`, `rabbitmq-maxlen`, `rabbitmq-other` (dead-lettered
/// by RabbitMQ), `node-lost` (its node was lost too often, or it could
/// not be rerun) or `refused` (an agent refused or could not run it).
pub fn failure_reason(text: &str) -> &'static str {
    if let Some(rest) = text.strip_prefix("dead-lettered by RabbitMQ: ") {
        return rabbitmq_reason(rest.split([' ', ',']).next().unwrap_or(""));
    }
    if text.contains("node lost") {
        "node-lost"
    } else {
        "refused"
    }
}

/// The label of a RabbitMQ dead-letter reason (`x-death`'s `reason`).
pub fn rabbitmq_reason(reason: &str) -> &'static str {
    match reason {
        "delivery_limit" => "rabbitmq-delivery-limit",
        "expired" => "rabbitmq-expired",
        "rejected" => "rabbitmq-rejected",
        "maxlen" => "rabbitmq-maxlen",
        _ => "rabbitmq-other",
    }
}

/// The `reason` labels of `vq_servers_deleted_total`
/// ([`crate::plan::DeleteCause::label`]).
pub const DELETE_REASONS: [&str; 5] = ["agreed", "error", "stuck-build", "black-hole", "dead"];

/// The `reason` labels of `vq_boot_failures_total`
/// ([`crate::status::count_actions`]): a refused create, an image or
/// flavor not resolved, user-data not built, and servers deleted in ERROR,
/// stuck in BUILD or without a heartbeat (black hole).
pub const BOOT_FAILURE_REASONS: [&str; 6] = [
    "create",
    "resolve",
    "user-data",
    "error",
    "stuck-build",
    "black-hole",
];

/// The `reason` labels of [`failure_reason`] (and so of a failed job's
/// `vq_jobs_ended_total` series).
pub const FAILURE_REASONS: [&str; 7] = [
    "rabbitmq-delivery-limit",
    "rabbitmq-expired",
    "rabbitmq-rejected",
    "rabbitmq-maxlen",
    "rabbitmq-other",
    "node-lost",
    "refused",
];

/// The `reason` labels of `vq_jobs_dead_lettered_total`: those of
/// [`failure_reason`], and `unknown` for a dead letter without a reason
/// header ([`crate::dead_watch::dead_letter_labels`]).
pub const DEAD_LETTER_REASONS: [&str; 8] = [
    "rabbitmq-delivery-limit",
    "rabbitmq-expired",
    "rabbitmq-rejected",
    "rabbitmq-maxlen",
    "rabbitmq-other",
    "node-lost",
    "refused",
    "unknown",
];

/// The `reason` labels of `vq_jobs_requeued_total`.
pub const REQUEUE_REASONS: [&str; 1] = ["node-lost"];

/// The `(outcome, reason)` labels of `vq_jobs_ended_total` other than
/// `failed` ([`job_end_labels`]; `failed` has [`FAILURE_REASONS`] and
/// `duplicate`).
pub const JOB_END_LABELS: [(&str, &str); 8] = [
    ("finished", "exit-zero"),
    ("finished", "exit-nonzero"),
    ("finished", "signal"),
    ("finished", "walltime"),
    ("finished", "output-limit"),
    ("finished", "failed-to-start"),
    ("cancelled", "cancelled"),
    ("cancelled", "withdrawn"),
];

/// The VM states of `vq_pool_vms{state}`.
pub const VM_STATES: [&str; 4] = ["booting", "active", "draining", "error"];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            pool_queued: Family::default(),
            pool_running: Family::default(),
            pool_held: Family::default(),
            pool_target: Family::default(),
            pool_vms: Family::default(),
            created: Family::default(),
            deleted: Family::default(),
            cloud_errors: Counter::default(),
            broker_blocked: Gauge::default(),
            broker_connected: Gauge::default(),
            pool_observed: Family::default(),
            pool_last_success: Family::default(),
            build_info: Family::default(),
            cloud_requests: Family::default(),
            boot_failures: Family::default(),
            broker_reconnects: Counter::default(),
            controller_leader: Gauge::default(),
            leadership_changes: Counter::default(),
            jobs_ended: Family::default(),
            jobs_dead_lettered: Family::default(),
            reconcile_duration: Family::new_with_constructor(reconcile_histogram),
            boot_active: Family::new_with_constructor(boot_active_histogram),
            boot_heartbeat: Family::new_with_constructor(boot_heartbeat_histogram),
            drain_handshake: Family::new_with_constructor(drain_histogram),
            quota_used: Family::default(),
            quota_limit: Family::default(),
            pool_agents: Family::default(),
            pool_slots: Family::default(),
            pool_breaker_open: Family::default(),
            pool_servers_stuck_deleting: Family::default(),
            cloud_token_expiry: Gauge::default(),
            jobs_requeued: Family::default(),
            pool_obstacle: Family::default(),
            job_run: Family::new_with_constructor(job_run_histogram),
            job_wait: Family::new_with_constructor(job_run_histogram),
            cloud_credential_expiry: Family::default(),
            pool_boot_failures: Family::default(),
        };
        m.build_info
            .get_or_create(&vec![
                ("version".into(), env!("CARGO_PKG_VERSION").into()),
                ("commit".into(), env!("VQ_GIT_COMMIT").into()),
            ])
            .set(1);
        registry.register(
            "vq_build_info",
            "Version and git commit of the running controller (always 1)",
            m.build_info.clone(),
        );
        registry.register(
            "vq_broker_connected",
            "1 while the controller is connected to the broker",
            m.broker_connected.clone(),
        );
        registry.register(
            "vq_pool_observed",
            "1 when the last observation of the pool succeeded, 0 when it failed (its value gauges are then absent)",
            m.pool_observed.clone(),
        );
        registry.register_with_unit(
            "vq_pool_last_success_timestamp",
            "When the last observation of the pool succeeded, Unix time",
            Unit::Seconds,
            m.pool_last_success.clone(),
        );
        registry.register(
            "vq_broker_blocked",
            "1 while the broker blocks publishing (resource alarm): pools are held",
            m.broker_blocked.clone(),
        );
        registry.register(
            "vq_pool_queued",
            "Jobs waiting in the pool",
            m.pool_queued.clone(),
        );
        registry.register(
            "vq_pool_held",
            "Held jobs (with dependencies not yet satisfied) the leading controller holds in the pool; 0 on a standby",
            m.pool_held.clone(),
        );
        registry.register(
            "vq_pool_running",
            "Jobs running in the pool",
            m.pool_running.clone(),
        );
        registry.register(
            "vq_pool_target_vms",
            "VMs the pool should have",
            m.pool_target.clone(),
        );
        registry.register(
            "vq_pool_vms",
            "VMs of the pool by state",
            m.pool_vms.clone(),
        );
        registry.register(
            "vq_servers_created",
            "Servers created by the controller",
            m.created.clone(),
        );
        registry.register(
            "vq_servers_deleted",
            "Servers deleted by the controller, by reason",
            m.deleted.clone(),
        );
        registry.register(
            "vq_cloud_errors",
            "Failed OpenStack requests",
            m.cloud_errors.clone(),
        );
        registry.register(
            "vq_cloud_requests",
            "OpenStack requests by operation and HTTP status (transport: no response)",
            m.cloud_requests.clone(),
        );
        registry.register(
            "vq_boot_failures",
            "Failed boots by pool and reason (the cloud refused the create, or the server never became a working agent)",
            m.boot_failures.clone(),
        );
        registry.register(
            "vq_broker_reconnects",
            "Broker connections re-established after a lost one",
            m.broker_reconnects.clone(),
        );
        registry.register(
            "vq_controller_leader",
            "1 while this controller holds the controller lock and acts, 0 while standby",
            m.controller_leader.clone(),
        );
        registry.register(
            "vq_controller_leadership_changes",
            "Times this controller became leader or stopped being it",
            m.leadership_changes.clone(),
        );
        registry.register(
            "vq_jobs_ended",
            "Job ends heard on the events exchange, by pool, outcome and reason",
            m.jobs_ended.clone(),
        );
        registry.register(
            "vq_jobs_dead_lettered",
            "Dead letters seen by the controller's dead-letter watch, by pool and reason",
            m.jobs_dead_lettered.clone(),
        );
        registry.register_with_unit(
            "vq_reconcile_duration",
            "Duration of a pool's turn of a reconcile cycle (observe, plan, act)",
            Unit::Seconds,
            m.reconcile_duration.clone(),
        );
        registry.register_with_unit(
            "vq_boot_active_duration",
            "From a create's response to the first listing showing the server ACTIVE",
            Unit::Seconds,
            m.boot_active.clone(),
        );
        registry.register_with_unit(
            "vq_boot_heartbeat_duration",
            "From the first listing showing a created server ACTIVE to its agent's first heartbeat seen",
            Unit::Seconds,
            m.boot_heartbeat.clone(),
        );
        registry.register_with_unit(
            "vq_drain_handshake_duration",
            "From an ask-delete sent to the agent's answer received",
            Unit::Seconds,
            m.drain_handshake.clone(),
        );
        registry.register(
            "vq_quota_used",
            "Quota used by the project, by resource (instances, cores, ram_bytes)",
            m.quota_used.clone(),
        );
        registry.register(
            "vq_quota_limit",
            "Quota limit of the project, by resource (absent when unlimited)",
            m.quota_limit.clone(),
        );
        registry.register(
            "vq_pool_agents",
            "Live agents of the pool by state (absent while unobserved)",
            m.pool_agents.clone(),
        );
        registry.register(
            "vq_pool_slots",
            "Job slots of the pool's live agents, free or used (absent while unobserved)",
            m.pool_slots.clone(),
        );
        registry.register(
            "vq_pool_obstacle",
            "1 for the kind of what currently stops or holds back the pool's boots (server-unlisted, boot-backoff, breaker-open, breaker-half-open, max, quota, boot-cooldown, unobserved), 0 for the other kinds; the status page says it in words",
            m.pool_obstacle.clone(),
        );
        registry.register(
            "vq_jobs_requeued",
            "Jobs the controller returned to their pool queue, by reason (node-lost: their agent's server is gone and the job is rerunnable within loss_limit)",
            m.jobs_requeued.clone(),
        );
        registry.register_with_unit(
            "vq_job_wait_duration",
            "Time from a job's queued event to its first started event, per pool (jobs whose queued event the job table saw, once it is caught up)",
            Unit::Seconds,
            m.job_wait.clone(),
        );
        registry.register_with_unit(
            "vq_job_run_duration",
            "Run time of finished jobs (the agent's measured wall time), per pool",
            Unit::Seconds,
            m.job_run.clone(),
        );
        registry.register(
            "vq_cloud_token_expiry_timestamp_seconds",
            "Unix time at which the controller's current Keystone token expires (0 before the first)",
            m.cloud_token_expiry.clone(),
        );
        registry.register(
            "vq_cloud_credential_expiry_timestamp_seconds",
            "Unix time at which the application credential the controller authenticates with expires (no series for a password or a credential without expiry)",
            m.cloud_credential_expiry.clone(),
        );
        registry.register(
            "vq_pool_servers_stuck_deleting",
            "Servers of the pool still listed delete_timeout_secs after the controller's first DELETE (Nova accepted it and did not act)",
            m.pool_servers_stuck_deleting.clone(),
        );
        registry.register(
            "vq_pool_breaker_open",
            "1 while the pool's boot circuit breaker is open or half-open (it boots at most one trial server), else 0",
            m.pool_breaker_open.clone(),
        );
        registry.register(
            "vq_pool_boot_failures",
            "The pool's consecutive boot failures (failed creates, servers in ERROR or stuck in BUILD; 0 after a boot that reached ACTIVE)",
            m.pool_boot_failures.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Creates, at 0, every counter series of `pool` whose labels are a
    /// closed set: `vq_servers_created_total{pool}`,
    /// `vq_servers_deleted_total{pool,reason}` ([`DELETE_REASONS`]),
    /// `vq_boot_failures_total{pool,reason}` ([`BOOT_FAILURE_REASONS`]),
    /// `vq_jobs_dead_lettered_total{pool,reason}` ([`DEAD_LETTER_REASONS`]),
    /// `vq_jobs_requeued_total{pool,reason}` ([`REQUEUE_REASONS`]) and
    /// `vq_jobs_ended_total{pool,outcome,reason}` ([`JOB_END_LABELS`],
    /// `failed` × [`FAILURE_REASONS`] and `duplicate`). Prometheus'
    /// `increase()` needs a sample before the first count: a series born
    /// at 1 would never fire `VqBootFailures`, `VqBlackHolePool`,
    /// `VqDeadLettersGrowing` or `VqAgentsLost` for its first event. The
    /// controller calls it for every configured pool when it starts.
    /// Counts already made are kept. `vq_cloud_requests_total{op,status}`
    /// is not pre-created: its `status` (HTTP code) is open, and no rule
    /// alerts on it (`VqCloudErrors` uses the unlabelled
    /// `vq_cloud_errors_total`, served at 0 from the start).
    pub fn init_pool(&self, pool: &str) {
        let _ = self.created.get_or_create(&Self::pool(pool));
        for reason in DELETE_REASONS {
            let _ = self
                .deleted
                .get_or_create(&Self::pool_and(pool, "reason", reason));
        }
        for reason in BOOT_FAILURE_REASONS {
            let _ = self
                .boot_failures
                .get_or_create(&Self::pool_and(pool, "reason", reason));
        }
        for reason in DEAD_LETTER_REASONS {
            let _ = self
                .jobs_dead_lettered
                .get_or_create(&Self::pool_and(pool, "reason", reason));
        }
        for reason in REQUEUE_REASONS {
            let _ = self
                .jobs_requeued
                .get_or_create(&Self::pool_and(pool, "reason", reason));
        }
        let failed = FAILURE_REASONS
            .into_iter()
            .chain(["duplicate"])
            .map(|r| ("failed", r));
        for (outcome, reason) in JOB_END_LABELS.into_iter().chain(failed) {
            let _ = self.jobs_ended.get_or_create(&vec![
                ("pool".into(), pool.to_string()),
                ("outcome".into(), outcome.into()),
                ("reason".into(), reason.into()),
            ]);
        }
    }

    /// [`Metrics::new`] with every closed-label counter series of each of
    /// `pools` at 0 ([`Metrics::init_pool`]): the registry of a starting
    /// controller.
    pub fn for_pools<'a>(pools: impl IntoIterator<Item = &'a str>) -> Self {
        let m = Self::new();
        for pool in pools {
            m.init_pool(pool);
        }
        m
    }

    /// Labels `pool=<pool>`.
    pub fn pool(pool: &str) -> Labels {
        vec![("pool".into(), pool.into())]
    }

    /// Labels `pool=<pool>, <key>=<value>`.
    pub fn pool_and(pool: &str, key: &str, value: &str) -> Labels {
        vec![("pool".into(), pool.into()), (key.into(), value.into())]
    }

    /// Sets `vq_cloud_credential_expiry_timestamp_seconds` to `at` (Unix
    /// seconds), or removes its series (`None`: the credential does not
    /// expire).
    pub fn set_credential_expiry(&self, at: Option<f64>) {
        let none: Labels = Vec::new();
        match at {
            Some(at) => {
                self.cloud_credential_expiry.get_or_create(&none).set(at);
            }
            None => {
                self.cloud_credential_expiry.remove(&none);
            }
        }
    }

    /// Marks `pool` as observed at `unix_now` (its value gauges are set by
    /// [`crate::status::publish`]).
    pub fn pool_observed_at(&self, pool: &str, unix_now: f64) {
        let l = Self::pool(pool);
        self.pool_observed.get_or_create(&l).set(1);
        self.pool_last_success.get_or_create(&l).set(unix_now);
    }

    /// Marks `pool`'s last observation as failed: `vq_pool_observed` 0 and
    /// its value gauges removed, so that no stale value is served as
    /// current.
    pub fn pool_unobserved(&self, pool: &str) {
        let l = Self::pool(pool);
        self.pool_observed.get_or_create(&l).set(0);
        self.pool_queued.remove(&l);
        self.pool_running.remove(&l);
        self.pool_target.remove(&l);
        for state in VM_STATES {
            self.pool_vms.remove(&Self::pool_and(pool, "state", state));
        }
        for state in AGENT_STATES {
            self.pool_agents
                .remove(&Self::pool_and(pool, "state", state));
        }
        for state in SLOT_STATES {
            self.pool_slots
                .remove(&Self::pool_and(pool, "state", state));
        }
    }

    /// Records one OpenStack request `op` (as the client names it) that
    /// got `status` (`None`: no response).
    pub fn cloud_request(&self, op: &str, status: Option<u16>) {
        let status = status.map_or_else(|| "transport".to_string(), |s| s.to_string());
        self.cloud_requests
            .get_or_create(&vec![
                ("op".into(), cloud_op(op).into()),
                ("status".into(), status),
            ])
            .inc();
    }

    /// Sets `vq_pool_held{pool}` to `n` held jobs.
    pub fn set_pool_held(&self, pool: &str, n: i64) {
        self.pool_held.get_or_create(&Self::pool(pool)).set(n);
    }

    /// Sets `vq_pool_obstacle{pool,kind}`: 1 for `kind` (`None`: no
    /// obstacle), 0 for every other kind.
    pub fn pool_obstacle_kind(&self, pool: &str, kind: Option<&str>) {
        for k in crate::status::OBSTACLE_KINDS {
            self.pool_obstacle
                .get_or_create(&Self::pool_and(pool, "kind", k))
                .set(i64::from(Some(k) == kind));
        }
    }

    /// Observes a job of `pool` that waited `secs` from queued to started.
    pub fn job_waited(&self, pool: &str, secs: f64) {
        self.job_wait.get_or_create(&Self::pool(pool)).observe(secs);
    }

    /// Counts a job `pool` returned to its queue for `reason`.
    pub fn job_requeued(&self, pool: &str, reason: &str) {
        self.jobs_requeued
            .get_or_create(&vec![
                ("pool".into(), pool.to_string()),
                ("reason".into(), reason.to_string()),
            ])
            .inc();
    }

    /// Counts a job event heard on the events exchange: its end in
    /// `vq_jobs_ended_total`, and a `finished` event's wall time (whatever
    /// the outcome, a duplicate report excepted) in
    /// `vq_job_run_duration_seconds`.
    pub fn job_event(&self, event: &JobEvent) {
        if let vq_common::messages::JobState::Finished { usage, .. } = &event.state {
            if event.duplicate.is_none() && usage.wall_secs.is_finite() {
                self.job_run
                    .get_or_create(&Self::pool(&event.pool))
                    .observe(usage.wall_secs.max(0.0));
            }
        }
        if let Some((outcome, reason)) = job_end_labels(event) {
            self.jobs_ended
                .get_or_create(&vec![
                    ("pool".into(), event.pool.clone()),
                    ("outcome".into(), outcome.into()),
                    ("reason".into(), reason.into()),
                ])
                .inc();
        }
    }

    /// Sets the quota gauges of `resource`: `used`, and `limit` (`None`:
    /// unlimited, the limit series is removed).
    pub fn quota(&self, resource: &str, used: u64, limit: Option<u64>) {
        let l = vec![("resource".to_string(), resource.to_string())];
        self.quota_used.get_or_create(&l).set(used as i64);
        match limit {
            Some(n) => {
                self.quota_limit.get_or_create(&l).set(n as i64);
            }
            None => {
                self.quota_limit.remove(&l);
            }
        }
    }

    /// Removes every quota series: the quota was not read this cycle, so
    /// the last values are not current.
    pub fn quota_unknown(&self) {
        self.quota_used.clear();
        self.quota_limit.clear();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(state: JobState) -> JobEvent {
        JobEvent::about(None, "7.x", "cms", "a1", None, state)
    }

    #[test]
    fn every_family_is_exposed_under_its_documented_name_and_type() {
        let m = Metrics::new();
        m.pool_observed_at("cms", 1.0);
        m.cloud_request("GET /servers/detail", Some(200));
        m.reconcile_duration
            .get_or_create(&Metrics::pool("cms"))
            .observe(0.2);
        m.boot_active
            .get_or_create(&Metrics::pool("cms"))
            .observe(30.0);
        m.boot_heartbeat
            .get_or_create(&Metrics::pool("cms"))
            .observe(5.0);
        m.drain_handshake
            .get_or_create(&Metrics::pool("cms"))
            .observe(1.0);
        // Families print only once they have a series.
        let cms = Metrics::pool("cms");
        let cms_and = |k, v| Metrics::pool_and("cms", k, v);
        for g in [&m.pool_queued, &m.pool_running, &m.pool_target] {
            g.get_or_create(&cms).set(1);
        }
        m.set_pool_held("cms", 2);
        m.pool_vms.get_or_create(&cms_and("state", "active")).set(1);
        m.pool_agents
            .get_or_create(&cms_and("state", "idle"))
            .set(1);
        m.pool_slots.get_or_create(&cms_and("state", "free")).set(1);
        m.quota("instances", 1, Some(2));
        m.created.get_or_create(&cms).inc();
        for c in [&m.deleted, &m.boot_failures, &m.jobs_dead_lettered] {
            c.get_or_create(&cms_and("reason", "error")).inc();
        }
        m.job_event(&event(JobState::Failed { reason: "x".into() }));
        let text = m.render();
        for (name, kind) in [
            ("vq_build_info", "gauge"),
            ("vq_broker_connected", "gauge"),
            ("vq_broker_blocked", "gauge"),
            ("vq_pool_observed", "gauge"),
            ("vq_pool_last_success_timestamp_seconds", "gauge"),
            ("vq_pool_queued", "gauge"),
            ("vq_pool_running", "gauge"),
            ("vq_pool_held", "gauge"),
            ("vq_pool_target_vms", "gauge"),
            ("vq_pool_vms", "gauge"),
            ("vq_pool_agents", "gauge"),
            ("vq_pool_slots", "gauge"),
            ("vq_quota_used", "gauge"),
            ("vq_quota_limit", "gauge"),
            ("vq_servers_created", "counter"),
            ("vq_servers_deleted", "counter"),
            ("vq_cloud_errors", "counter"),
            ("vq_cloud_requests", "counter"),
            ("vq_boot_failures", "counter"),
            ("vq_broker_reconnects", "counter"),
            ("vq_controller_leader", "gauge"),
            ("vq_controller_leadership_changes", "counter"),
            ("vq_jobs_ended", "counter"),
            ("vq_jobs_dead_lettered", "counter"),
            ("vq_reconcile_duration_seconds", "histogram"),
            ("vq_boot_active_duration_seconds", "histogram"),
            ("vq_boot_heartbeat_duration_seconds", "histogram"),
            ("vq_drain_handshake_duration_seconds", "histogram"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} {kind} missing:\n{text}"
            );
        }
        let commit = env!("VQ_GIT_COMMIT");
        assert!(
            text.contains(&format!(
                "vq_build_info{{version=\"{}\",commit=\"{commit}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        assert!(
            text.contains("vq_cloud_requests_total{op=\"list_servers\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("vq_reconcile_duration_seconds_count{pool=\"cms\"} 1"),
            "{text}"
        );
        assert!(text.contains("vq_broker_reconnects_total 0"), "{text}");
    }

    #[test]
    fn cloud_operations_get_bounded_labels() {
        for (op, label) in [
            ("POST https://keystone.example:5000/v3/auth/tokens", "auth"),
            ("GET /servers/detail", "list_servers"),
            ("POST /servers (vq-cms-1a2b3c4d)", "create_server"),
            ("DELETE /servers/1f0e-42", "delete_server"),
            ("GET /limits", "limits"),
            ("GET /flavors/detail", "flavors"),
            ("GET /v2/images?name=cirros", "images"),
            ("GET https://nova.example:8774/", "versions"),
            ("PATCH /x", "other"),
        ] {
            assert_eq!(cloud_op(op), label, "{op}");
        }
        let m = Metrics::new();
        m.cloud_request("DELETE /servers/a", None);
        m.cloud_request("DELETE /servers/b", None);
        assert!(m
            .render()
            .contains("vq_cloud_requests_total{op=\"delete_server\",status=\"transport\"} 2"));
    }

    #[test]
    fn job_ends_are_counted_by_outcome_and_a_bounded_reason() {
        let usage = vq_common::messages::Usage::default();
        let finished = |outcome| JobState::Finished { outcome, usage };
        let failed = |reason: &str| JobState::Failed {
            reason: reason.into(),
        };
        assert_eq!(job_end_labels(&event(JobState::Started)), None);
        for (state, labels) in [
            (finished(Outcome::Exited { code: 0 }), ("finished", "exit-zero")),
            (finished(Outcome::Exited { code: 3 }), ("finished", "exit-nonzero")),
            (finished(Outcome::Signaled { signal: 9 }), ("finished", "signal")),
            (finished(Outcome::Walltime), ("finished", "walltime")),
            (finished(Outcome::Cancelled), ("cancelled", "cancelled")),
            (
                failed("dead-lettered by RabbitMQ: expired (its message TTL ran out) from queue q"),
                ("failed", "rabbitmq-expired"),
            ),
            (
                failed("dead-lettered by RabbitMQ: delivery_limit (redelivered more than 5 times)"),
                ("failed", "rabbitmq-delivery-limit"),
            ),
            (
                failed("node lost 3 times while running the job (last: agent a; limit 3): not run again"),
                ("failed", "node-lost"),
            ),
            (failed("owner \"root\" has uid 0 below min_uid 1000"), ("failed", "refused")),
        ] {
            assert_eq!(job_end_labels(&event(state.clone())), Some(labels), "{state:?}");
        }
        let mut dup = event(failed("a claimed job's id reused"));
        dup.duplicate = Some("00ff".into());
        assert_eq!(job_end_labels(&dup), Some(("failed", "duplicate")));
        let m = Metrics::new();
        m.job_event(&event(finished(Outcome::Exited { code: 0 })));
        m.job_event(&event(JobState::Started));
        let text = m.render();
        assert!(
            text.contains(
                "vq_jobs_ended_total{pool=\"cms\",outcome=\"finished\",reason=\"exit-zero\"} 1"
            ),
            "{text}"
        );
        assert_eq!(text.matches("vq_jobs_ended_total{").count(), 1, "{text}");
        // The run time of the finished job, not of the start.
        assert!(
            text.contains("vq_job_run_duration_seconds_count{pool=\"cms\"} 1"),
            "{text}"
        );
        m.job_requeued("cms", "node-lost");
        assert!(m
            .render()
            .contains("vq_jobs_requeued_total{pool=\"cms\",reason=\"node-lost\"} 1"));
    }

    #[test]
    fn an_unlimited_quota_has_no_limit_series() {
        let m = Metrics::new();
        m.quota("instances", 3, Some(10));
        m.quota("ram_bytes", 1 << 30, None);
        let text = m.render();
        assert!(
            text.contains("vq_quota_used{resource=\"instances\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("vq_quota_limit{resource=\"instances\"} 10"),
            "{text}"
        );
        assert!(
            text.contains("vq_quota_used{resource=\"ram_bytes\"} 1073741824"),
            "{text}"
        );
        assert!(
            !text.contains("vq_quota_limit{resource=\"ram_bytes\"}"),
            "{text}"
        );
        m.quota("instances", 3, None);
        assert!(!m
            .render()
            .contains("vq_quota_limit{resource=\"instances\"}"));
        m.quota_unknown();
        assert!(!m.render().contains("vq_quota_used{"), "not read: absent");
    }

    #[test]
    fn a_starting_controller_serves_every_closed_counter_series_at_zero() {
        let m = Metrics::for_pools(["cms", "atlas"]);
        let text = m.render();
        for pool in ["cms", "atlas"] {
            let mut want = vec![format!("vq_servers_created_total{{pool=\"{pool}\"}} 0")];
            for r in DELETE_REASONS {
                want.push(format!(
                    "vq_servers_deleted_total{{pool=\"{pool}\",reason=\"{r}\"}} 0"
                ));
            }
            for r in BOOT_FAILURE_REASONS {
                want.push(format!(
                    "vq_boot_failures_total{{pool=\"{pool}\",reason=\"{r}\"}} 0"
                ));
            }
            for r in DEAD_LETTER_REASONS {
                want.push(format!(
                    "vq_jobs_dead_lettered_total{{pool=\"{pool}\",reason=\"{r}\"}} 0"
                ));
            }
            for r in REQUEUE_REASONS {
                want.push(format!(
                    "vq_jobs_requeued_total{{pool=\"{pool}\",reason=\"{r}\"}} 0"
                ));
            }
            let failed = FAILURE_REASONS
                .into_iter()
                .chain(["duplicate"])
                .map(|r| ("failed", r));
            for (o, r) in JOB_END_LABELS.into_iter().chain(failed) {
                want.push(format!(
                    "vq_jobs_ended_total{{pool=\"{pool}\",outcome=\"{o}\",reason=\"{r}\"}} 0"
                ));
            }
            for w in want {
                assert!(text.lines().any(|l| l == w), "missing {w}:\n{text}");
            }
        }
        // The alerts' series in particular.
        for w in [
            "vq_boot_failures_total{pool=\"cms\",reason=\"black-hole\"} 0",
            "vq_servers_deleted_total{pool=\"cms\",reason=\"dead\"} 0",
            "vq_jobs_dead_lettered_total{pool=\"atlas\",reason=\"rabbitmq-delivery-limit\"} 0",
        ] {
            assert!(text.lines().any(|l| l == w), "missing {w}:\n{text}");
        }
        // A count already made is kept by a second init.
        m.boot_failures
            .get_or_create(&Metrics::pool_and("cms", "reason", "create"))
            .inc();
        m.init_pool("cms");
        assert!(m
            .render()
            .lines()
            .any(|l| l == "vq_boot_failures_total{pool=\"cms\",reason=\"create\"} 1"));
    }

    #[test]
    fn the_pre_created_reasons_are_every_reason_the_code_counts() {
        use crate::plan::DeleteCause;
        for c in [
            DeleteCause::Agreed,
            DeleteCause::Error,
            DeleteCause::StuckBuild,
            DeleteCause::BlackHole,
            DeleteCause::Dead,
        ] {
            assert!(DELETE_REASONS.contains(&c.label()), "{c:?}");
        }
        for r in ["error", "stuck-build", "black-hole"] {
            assert!(BOOT_FAILURE_REASONS.contains(&r));
        }
        for text in [
            "dead-lettered by RabbitMQ: delivery_limit",
            "dead-lettered by RabbitMQ: expired",
            "dead-lettered by RabbitMQ: rejected",
            "dead-lettered by RabbitMQ: maxlen",
            "dead-lettered by RabbitMQ: something-new",
            "node lost 3 times",
            "refused by agent",
        ] {
            let r = failure_reason(text);
            assert!(FAILURE_REASONS.contains(&r), "{text}: {r}");
            assert!(DEAD_LETTER_REASONS.contains(&r), "{text}: {r}");
        }
        assert_eq!(FAILURE_REASONS.len(), 7);
        for (i, r) in FAILURE_REASONS.iter().enumerate() {
            assert_eq!(DEAD_LETTER_REASONS[i], *r);
        }
    }
}
