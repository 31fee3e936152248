//! The pools' published limits (`vq submit` → controller) and the pure
//! rule that refuses a job larger than its pool (issue 11, "Resources").
//!
//! The controller is the one owner of a pool's limits: its `[pools.<name>]`
//! keys `slots`, `max_walltime_secs` and `memory_mb` (else the flavor's
//! RAM; [`PoolLimits::of`]).
//! It gives the first two to every agent it boots (the identity file,
//! [`crate::config::AgentIdentity`]), so that agents refuse exactly what
//! the controller says, and it answers [`PoolQuery`]s with a
//! [`PoolsPage`] listing every pool's [`PoolLimits`], so that `vq submit`
//! refuses a job that no VM of its pool could run before it is queued
//! ([`PoolLimits::refusals`]) instead of a VM booting only to refuse it.
//!
//! The requester publishes a [`PoolQuery`] to `<c>.control` with the
//! routing key [`Topology::pool_query_key`] (`<c>.query.pools`), a
//! `correlation_id` and as `reply_to` its exclusive server-named reply
//! queue, exactly like a [`crate::jobs::JobQuery`]; the answer comes back
//! to `<c>.replies` the same way. Limits are not secret: any broker user
//! that may publish to `<c>.control` (every submitter) is answered.
//!
//! [`Topology::pool_query_key`]: crate::topology::Topology::pool_query_key

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::config::PoolConfig;
use crate::messages::{DecodeError, JobRequest, Message, SCHEMA_VERSION};
use crate::pbs::{format_size, format_walltime};

fn schema_version() -> u32 {
    SCHEMA_VERSION
}

/// What `vq submit` asks the controller before it publishes a job
/// (message kind `pool-query`): every pool's limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolQuery {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
}

impl Default for PoolQuery {
    fn default() -> Self {
        PoolQuery {
            schema: SCHEMA_VERSION,
        }
    }
}

/// The limits of one pool, as its controller applies them and gives them
/// to the pool's agents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolLimits {
    /// Pool name (PBS queue).
    pub pool: String,
    /// Job slots of each VM of the pool (the agents' `slots`): a job asking
    /// more (`-l nodes=1:ppn=N`, `ncpus`, `select=1:ncpus`) can run nowhere.
    pub slots: u32,
    /// Largest walltime a job may ask for, seconds (PBS queue's
    /// `resources_max.walltime`; the agents' `max_walltime_secs`).
    pub max_walltime_secs: u64,
    /// Memory of each VM for jobs, MiB (`-l mem` above it can run
    /// nowhere): the pool's `memory_mb`, else its flavor's RAM; `None`:
    /// unknown, not checked at submit (the agent still refuses a job larger
    /// than its VM's memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
}

impl PoolLimits {
    /// The limits of pool `name` configured as `cfg`, whose flavor has
    /// `flavor_ram_mb` of RAM if the controller could read it: the memory
    /// per VM is `cfg.memory_mb`, else the flavor's RAM (a bound the VM's
    /// usable memory is always under).
    pub fn of(name: &str, cfg: &PoolConfig, flavor_ram_mb: Option<u64>) -> PoolLimits {
        PoolLimits {
            pool: name.to_string(),
            slots: cfg.slots,
            max_walltime_secs: cfg.max_walltime_secs,
            memory_mb: cfg.memory_mb.or(flavor_ram_mb),
        }
    }

    /// Why a job asking `request` can run on no VM of this pool, one
    /// sentence per limit it exceeds (empty: within every limit):
    /// a walltime above [`PoolLimits::max_walltime_secs`] (a job without a
    /// walltime gets the agent's default, which is capped to it), more
    /// slots than [`PoolLimits::slots`], more memory than
    /// [`PoolLimits::memory_mb`].
    pub fn refusals(&self, request: &JobRequest) -> Vec<String> {
        let pool = &self.pool;
        let mut out = Vec::new();
        if let Some(w) = request.walltime {
            if w > self.max_walltime_secs {
                out.push(format!(
                    "walltime {} is more than pool {pool}'s max_walltime {}",
                    format_walltime(w),
                    format_walltime(self.max_walltime_secs)
                ));
            }
        }
        if request.slots > self.slots {
            out.push(format!(
                "{} slots (nodes=1:ppn, ncpus) are more than pool {pool}'s VMs have ({} slots)",
                request.slots, self.slots
            ));
        }
        if let (Some(mem), Some(mb)) = (request.mem, self.memory_mb) {
            if mem > mb.saturating_mul(1 << 20) {
                out.push(format!(
                    "mem {} is more than pool {pool}'s memory per VM {}",
                    format_size(mem),
                    format_size(mb.saturating_mul(1 << 20))
                ));
            }
        }
        out
    }
}

/// The controller's answer to a [`PoolQuery`] (message kind `pools-page`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolsPage {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Every pool the controller manages, by name.
    #[serde(default)]
    pub pools: Vec<PoolLimits>,
    /// Why the query was refused (a malformed query); `pools` is then
    /// empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Message for PoolQuery {
    const KIND: &'static str = "pool-query";
    fn schema(&self) -> u32 {
        self.schema
    }
}

impl Message for PoolsPage {
    const KIND: &'static str = "pools-page";
    fn schema(&self) -> u32 {
        self.schema
    }
}

impl PoolsPage {
    /// The limits of `pool`, if the page names it.
    pub fn get(&self, pool: &str) -> Option<&PoolLimits> {
        self.pools.iter().find(|p| p.pool == pool)
    }

    /// The names of the pools, in the page's order.
    pub fn names(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.pool.clone()).collect()
    }
}

/// The answer to `body` (a [`PoolQuery`]) from the controller's `limits`:
/// every pool, or a refusal of a query that cannot be read.
pub fn answer(limits: &[PoolLimits], body: &[u8]) -> PoolsPage {
    match PoolQuery::decode(body) {
        Ok(_) => PoolsPage {
            schema: SCHEMA_VERSION,
            pools: limits.to_vec(),
            error: None,
        },
        Err(e) => {
            let why = match &e {
                DecodeError::Malformed { source, .. } => format!("{e}: {source}"),
                _ => e.to_string(),
            };
            PoolsPage {
                schema: SCHEMA_VERSION,
                pools: Vec::new(),
                error: Some(why),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cms() -> PoolLimits {
        PoolLimits {
            pool: "cms".into(),
            slots: 4,
            max_walltime_secs: 24 * 3600,
            memory_mb: Some(4096),
        }
    }

    fn req(walltime: Option<u64>, slots: u32, mem: Option<u64>) -> JobRequest {
        JobRequest {
            walltime,
            slots,
            mem,
            ..JobRequest::default()
        }
    }

    #[test]
    fn a_job_within_every_limit_is_not_refused() {
        let p = cms();
        assert_eq!(p.refusals(&JobRequest::default()), Vec::<String>::new());
        // At each limit exactly: still fits.
        assert!(p
            .refusals(&req(Some(24 * 3600), 4, Some(4096 << 20)))
            .is_empty());
        // No memory published: any mem passes here (the agent checks).
        let open = PoolLimits {
            memory_mb: None,
            ..cms()
        };
        assert!(open.refusals(&req(None, 1, Some(1 << 40))).is_empty());
    }

    #[test]
    fn each_limit_exceeded_is_one_sentence() {
        let p = cms();
        assert_eq!(
            p.refusals(&req(Some(48 * 3600), 1, None)),
            ["walltime 48:00:00 is more than pool cms's max_walltime 24:00:00"]
        );
        assert_eq!(
            p.refusals(&req(None, 8, None)),
            ["8 slots (nodes=1:ppn, ncpus) are more than pool cms's VMs have (4 slots)"]
        );
        assert_eq!(
            p.refusals(&req(None, 1, Some((4096 << 20) + 1))),
            ["mem 4294967297b is more than pool cms's memory per VM 4gb"]
        );
        let all = p.refusals(&req(Some(24 * 3600 + 1), 5, Some(8 << 30)));
        assert_eq!(all.len(), 3, "{all:?}");
        assert!(all[0].starts_with("walltime 24:00:01"), "{all:?}");
        assert!(all[2].contains("mem 8gb"), "{all:?}");
    }

    #[test]
    fn memory_per_vm_is_the_configured_one_else_the_flavors_ram() {
        let mut cfg = PoolConfig {
            slots: 4,
            max_walltime_secs: 600,
            ..PoolConfig::default()
        };
        let l = PoolLimits::of("p", &cfg, Some(2048));
        assert_eq!(
            (l.slots, l.max_walltime_secs, l.memory_mb),
            (4, 600, Some(2048))
        );
        assert_eq!(PoolLimits::of("p", &cfg, None).memory_mb, None);
        cfg.memory_mb = Some(1500);
        assert_eq!(PoolLimits::of("p", &cfg, Some(2048)).memory_mb, Some(1500));
    }

    #[test]
    fn the_answer_lists_every_pool_and_refuses_a_malformed_query() {
        let limits = vec![cms()];
        let page = answer(&limits, &PoolQuery::default().encode());
        assert_eq!((page.pools.clone(), page.error.clone()), (limits, None));
        assert_eq!(page.get("cms").map(|p| p.slots), Some(4));
        assert_eq!(page.get("gpu"), None);
        assert_eq!(page.names(), ["cms"]);
        let bad = answer(&[cms()], b"{not json");
        assert!(bad.pools.is_empty());
        assert!(bad.error.unwrap().contains("malformed pool-query"));
        let newer = answer(&[cms()], br#"{"schema":99}"#);
        assert!(newer.error.is_some());
        // An empty body is an old-style or minimal query: every field has
        // a default.
        assert!(answer(&[cms()], b"{}").error.is_none());
    }
}
