//! The controller's Prometheus metrics, served by `GET /metrics`
//! ([`crate::http`]) and set by the loop ([`crate::status::publish`] and
//! [`crate::observe`]). README.md's "Monitoring" section lists every
//! family with its type, labels and unit.
//!
//! Stale values are never served as current: while the last observation
//! of a pool failed, its value gauges (`vq_pool_queued`, `vq_pool_running`,
//! `vq_pool_target_vms`, `vq_pool_vms`) are *absent* from the exposition
//! ([`Metrics::pool_unobserved`]), `vq_pool_observed{pool}` is 0 and
//! `vq_pool_last_success_timestamp_seconds{pool}` keeps the time of the
//! last observation that succeeded. Absent rather than NaN: a query or
//! alert on an absent series yields nothing instead of a number.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

type Labels = Vec<(String, String)>;

/// The controller's Prometheus metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Jobs waiting per pool.
    pub pool_queued: Family<Labels, Gauge>,
    /// Jobs running per pool.
    pub pool_running: Family<Labels, Gauge>,
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
}

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
        Metrics { registry, ..m }
    }

    /// Labels `pool=<pool>`.
    pub fn pool(pool: &str) -> Labels {
        vec![("pool".into(), pool.into())]
    }

    /// Labels `pool=<pool>, <key>=<value>`.
    pub fn pool_and(pool: &str, key: &str, value: &str) -> Labels {
        vec![("pool".into(), pool.into()), (key.into(), value.into())]
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
