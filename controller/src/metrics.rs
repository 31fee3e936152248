//! The controller's Prometheus metrics, served by `GET /metrics`
//! ([`crate::http`]) and set by the loop ([`crate::status::publish`] and
//! [`crate::observe`]).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
}

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
        };
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

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
