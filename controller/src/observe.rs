//! Observe: every read of a cycle, and the whole [`Observed`] view of
//! each pool built from them. [`observe_world`] reads what all pools share
//! once per cycle (broker connection and alarm probe, agent registry, the
//! complete Nova server list, the quota, the event book);
//! [`observe_pool`] reads a pool's queue depth and [`assemble`]s its view
//! with what the controller remembers of the pool ([`PoolMemory`]). All or
//! nothing: the caller gets a view only when every source was read (never
//! act on a partial view).
//!
//! All ages are measured on the controller's own monotonic clock at
//! observation time (heartbeats) or against the wall clock (Nova's
//! `created`), so [`crate::plan::plan`] needs no clock.

use std::collections::BTreeMap;

use tokio::time::Instant;
use vq_common::config::PoolConfig;
use vq_common::messages::{unix_now, AgentState, Demand};
use vq_common::topology::Topology;

use crate::breaker::BootGate;
use crate::broker::{BrokerApi, EventSnapshot};
use crate::error::ObserveError;
pub use crate::events::{AgentRecord, DemandMap, ASKED_KEPT};
use crate::metrics::Metrics;
use crate::openstack::{cluster_tag, CloudApi, Server, META_CLUSTER, META_POOL};
use crate::policy::Refusals;

/// Nova status of a server, reduced to what the planner distinguishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NovaStatus {
    /// `BUILD`.
    Build,
    /// `ACTIVE`.
    Active,
    /// `ERROR`.
    Error,
    /// Being deleted (`DELETED`, `SOFT_DELETED`, task state `deleting`).
    Deleting,
    /// Anything else (`SHUTOFF`, `REBOOT`, …), verbatim.
    Other(String),
}

impl NovaStatus {
    /// Reduces Nova's status and task state.
    pub fn from_nova(status: &str, task_state: Option<&str>) -> Self {
        if task_state == Some("deleting") {
            return NovaStatus::Deleting;
        }
        match status {
            "BUILD" => NovaStatus::Build,
            "ACTIVE" => NovaStatus::Active,
            "ERROR" => NovaStatus::Error,
            "DELETED" | "SOFT_DELETED" => NovaStatus::Deleting,
            other => NovaStatus::Other(other.to_string()),
        }
    }
}

/// The agent's latest answer to "may I delete you?".
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerSeen {
    /// Seconds since the controller received it.
    pub age_secs: f64,
    /// Whether the agent agreed.
    pub may_delete: bool,
    /// Jobs it said were running.
    pub running: u32,
    /// Whether its request id is one this controller sent to this agent
    /// (since the controller started). Only a matched yes lets a live
    /// agent's VM be deleted.
    pub matched: bool,
}

/// What the controller last heard from an agent.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSeen {
    /// Seconds since the controller received the last heartbeat.
    pub heartbeat_age_secs: f64,
    /// State in the last heartbeat.
    pub state: AgentState,
    /// Jobs running per the last heartbeat.
    pub running: u32,
    /// Their job ids, per the last heartbeat (`running` of the
    /// [`vq_common::messages::Heartbeat`]), in its order.
    pub jobs: Vec<String>,
    /// Job slots per the last heartbeat.
    pub slots: u32,
    /// `is_del` in the last heartbeat.
    pub is_del: bool,
    /// Seconds the agent has been idle per the last heartbeat.
    pub idle_secs: f64,
    /// Latest answer to an ask-delete, if any.
    pub answer: Option<AnswerSeen>,
    /// The operator's `--reason` of the drain the agent follows, per the
    /// last heartbeat ([`vq_common::messages::Heartbeat::drain_reason`]).
    pub drain_reason: Option<String>,
}

/// One server of the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedServer {
    /// Nova id.
    pub id: String,
    /// Name (= agent id).
    pub name: String,
    /// Reduced status.
    pub status: NovaStatus,
    /// Seconds since Nova created it (`None` if Nova did not say).
    pub age_secs: Option<f64>,
    /// Its agent, if the controller ever received a heartbeat from it.
    pub agent: Option<AgentSeen>,
}

/// Everything the planner needs about one pool.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Observed {
    /// Pool name.
    pub pool: String,
    /// The pool's servers (complete).
    pub servers: Vec<ObservedServer>,
    /// Jobs waiting: max of the pool queue's ready messages and the bridges'
    /// demand.
    pub queued: u64,
    /// Jobs running: max of the heartbeats' sum and the bridges' demand.
    pub running: u64,
    /// Slots the waiting jobs ask for: the job table's queued jobs' slots,
    /// plus 1 per queue message the table does not know of (the queue
    /// depth is a floor at 1 slot per message); at least `queued`.
    pub queued_slots: u64,
    /// Slots of the running jobs: the job table's, at least `running`.
    pub running_slots: u64,
    /// Instances the quota still allows (shared by all pools); `None` =
    /// unlimited.
    pub quota_remaining: Option<u32>,
    /// The project's quota as the cycle read it (before any pool booted),
    /// for the planner's obstacle in words ([`crate::plan::quota_words`]).
    pub quota: QuotaView,
    /// Seconds the controller has been receiving agent events without
    /// interruption: no agent is judged dead or missing before this reaches
    /// the heartbeat timeout.
    pub listening_secs: f64,
    /// Seconds since the last scale-down request of this pool.
    pub since_scale_down_secs: Option<f64>,
    /// Seconds since the last failed boot of this pool.
    pub since_boot_failure_secs: Option<f64>,
    /// Seconds the pool has had more VMs than its target without a break,
    /// as its earlier cycles found ([`crate::plan::Plan::surplus`]);
    /// `None`: no surplus recorded (none last cycle, or the controller just
    /// started). The scale-down hysteresis `scale_down_delay_secs` is
    /// measured on it.
    pub surplus_secs: Option<f64>,
    /// Why the pool may boot nothing (a server this controller created is
    /// missing from the listings, see [`CreatedWatch`]); `None`: no
    /// obstacle.
    pub boot_obstacle: Option<String>,
    /// Servers this controller created that no listing of the pool has
    /// shown yet: they count as booting (see [`CreatedWatch`]).
    pub unlisted_created: u32,
    /// The pool's configured `slots` per VM (0: not known), to tell agents
    /// whose heartbeat says otherwise (`/status` `slots_mismatch`).
    pub configured_slots: u32,
    /// What the pool's boot-failure backoff and circuit breaker let it
    /// boot ([`crate::breaker`]); set by the loop after observing.
    pub boot_gate: BootGate,
}

/// What a cycle learnt of the project's compute quota (Nova's absolute
/// limits), shared by every pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum QuotaView {
    /// Not read (tests, or an unlimited quota's absence of figures).
    #[default]
    Unknown,
    /// The figures of the cycle's read.
    Read(crate::openstack::Quota),
    /// The read failed: its cause chain (the pools boot nothing).
    Unreadable(String),
}

/// Demand older than this is ignored, seconds (as the demand queue's TTL).
pub const DEMAND_MAX_AGE_SECS: f64 = (vq_common::topology::DEMAND_TTL_MS / 1000) as f64;

/// Whether `server` is one of `pool`'s servers in `cluster` (by metadata;
/// the list was already filtered by the cluster tag).
pub fn owned_by(server: &Server, cluster: &str, pool: &str) -> bool {
    server.metadata.get(META_CLUSTER).map(String::as_str) == Some(cluster)
        && server.metadata.get(META_POOL).map(String::as_str) == Some(pool)
}

/// Inputs of [`assemble`] that are the same for every pool of a cycle.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// Observation instant (monotonic).
    pub now: Instant,
    /// Observation wall time, Unix seconds (for Nova's `created`).
    pub unix_now: f64,
    /// See [`Observed::listening_secs`].
    pub listening_secs: f64,
}

/// Everything [`assemble`] builds one pool's [`Observed`] from, each read
/// completely.
#[derive(Debug, Clone, Copy)]
pub struct PoolInputs<'a> {
    /// Cluster name.
    pub cluster: &'a str,
    /// Pool name.
    pub pool: &'a str,
    /// Every server of the cluster.
    pub servers: &'a [Server],
    /// The event book's agent records.
    pub agents: &'a BTreeMap<String, AgentRecord>,
    /// The pool's latest bridge demand, with its receive time.
    pub demand: Option<&'a (Demand, Instant)>,
    /// Ready messages in the pool's queue.
    pub queue_depth: u64,
    /// See [`Observed::quota_remaining`].
    pub quota_remaining: Option<u32>,
    /// See [`Observed::quota`].
    pub quota: &'a QuotaView,
    /// See [`Observed::since_scale_down_secs`].
    pub since_scale_down_secs: Option<f64>,
    /// See [`Observed::since_boot_failure_secs`].
    pub since_boot_failure_secs: Option<f64>,
    /// See [`Observed::surplus_secs`].
    pub surplus_secs: Option<f64>,
    /// See [`Observed::unlisted_created`].
    pub unlisted_created: u32,
    /// See [`Observed::boot_obstacle`].
    pub boot_obstacle: Option<&'a str>,
    /// The pool's slots from the job table (`None`: not known).
    pub job_slots: Option<crate::jobs::slots::PoolSlots>,
    /// See [`Observed::configured_slots`].
    pub configured_slots: u32,
    /// The cycle's clock.
    pub clock: Clock,
}

/// Builds a pool's whole view from complete inputs. Pure.
pub fn assemble(input: &PoolInputs<'_>) -> Observed {
    let PoolInputs {
        cluster,
        pool,
        servers,
        agents,
        demand,
        queue_depth,
        quota_remaining,
        clock,
        ..
    } = *input;
    let age = |t: Instant| clock.now.saturating_duration_since(t).as_secs_f64();
    let mut heartbeat_running: u64 = 0;
    let servers: Vec<ObservedServer> = servers
        .iter()
        .filter(|s| owned_by(s, cluster, pool))
        .map(|s| {
            let agent = agents.get(&s.name).and_then(|rec| {
                let (hb, at) = rec.heartbeat.as_ref()?;
                let answer = rec.answer.as_ref().map(|(a, at)| AnswerSeen {
                    age_secs: age(*at),
                    may_delete: a.may_delete,
                    running: a.running.len() as u32,
                    matched: rec.asked_for(&a.request_id),
                });
                Some(AgentSeen {
                    heartbeat_age_secs: age(*at),
                    state: hb.state,
                    running: hb.running.len() as u32,
                    jobs: hb.running.clone(),
                    slots: hb.slots,
                    is_del: hb.is_del,
                    idle_secs: hb.idle_secs,
                    answer,
                    drain_reason: hb.drain_reason.clone(),
                })
            });
            if let Some(a) = &agent {
                heartbeat_running += u64::from(a.running);
            }
            ObservedServer {
                id: s.id.clone(),
                name: s.name.clone(),
                status: NovaStatus::from_nova(&s.status, s.task_state.as_deref()),
                age_secs: s.created.map(|c| (clock.unix_now - c).max(0.0)),
                agent,
            }
        })
        .collect();
    let fresh_demand = demand.filter(|(_, at)| age(*at) <= DEMAND_MAX_AGE_SECS);
    let (d_queued, d_running) = fresh_demand
        .map(|(d, _)| (d.queued, d.running))
        .unwrap_or((0, 0));
    Observed {
        pool: pool.to_string(),
        servers,
        queued: queue_depth.max(d_queued),
        running: heartbeat_running.max(d_running),
        queued_slots: slot_demand(queue_depth.max(d_queued), input.job_slots).0,
        running_slots: slot_demand(queue_depth.max(d_queued), input.job_slots)
            .1
            .max(heartbeat_running.max(d_running)),
        quota_remaining,
        quota: input.quota.clone(),
        listening_secs: clock.listening_secs,
        since_scale_down_secs: input.since_scale_down_secs,
        since_boot_failure_secs: input.since_boot_failure_secs,
        surplus_secs: input.surplus_secs,
        boot_obstacle: input.boot_obstacle.map(str::to_string),
        unlisted_created: input.unlisted_created,
        configured_slots: input.configured_slots,
        boot_gate: BootGate::Open,
    }
}

/// `(queued slots, running slots)` from `queued` jobs (queue depth or
/// bridge demand) and the job table's `table` view of the pool: the
/// table's queued slots plus 1 per queued job it does not know of, at
/// least `queued`; the table's running slots. Pure.
pub fn slot_demand(queued: u64, table: Option<crate::jobs::slots::PoolSlots>) -> (u64, u64) {
    match table {
        None => (queued, 0),
        Some(t) => (
            t.queued_slots
                .saturating_add(queued.saturating_sub(t.queued_jobs))
                .max(queued),
            t.running_slots,
        ),
    }
}

/// Listings after its create's response within which a created server
/// must appear in its pool's view (see [`CreatedWatch`]).
pub const UNLISTED_LISTINGS_LIMIT: u32 = 2;

/// A server this controller created that no listing has shown yet.
#[derive(Debug, Clone, PartialEq)]
struct Unlisted {
    name: String,
    created_at: Instant,
    missed: u32,
}

/// The servers this controller created and has not seen in a listing yet,
/// per pool (in memory only: a restarted controller starts empty).
///
/// A pool boots on what its listing shows; a server it created that the
/// listing does not show (a cloud whose list filter misses it, servers
/// created without the tags the list filters on) would make it boot again
/// every cycle. So such a server counts as booting, and it must be in the
/// pool's view within [`UNLISTED_LISTINGS_LIMIT`] listings after the
/// create's response or the pool's `boot_timeout_secs`, whichever comes
/// first; else the pool boots nothing (its obstacle says why) until a
/// listing shows the server.
#[derive(Debug, Clone, Default)]
pub struct CreatedWatch {
    pools: BTreeMap<String, BTreeMap<String, Unlisted>>,
}

impl CreatedWatch {
    /// Remembers that server `id` (`name`) of `pool` was created at `now`
    /// (the create's response). Call it after the cycle's listing.
    pub fn created(&mut self, pool: &str, id: &str, name: &str, now: Instant) {
        self.pools.entry(pool.to_string()).or_default().insert(
            id.to_string(),
            Unlisted {
                name: name.to_string(),
                created_at: now,
                missed: 0,
            },
        );
    }

    /// Takes one complete listing of `pool` (the ids of its view): servers
    /// in it are forgotten, the others have missed one more listing.
    /// Returns how many created servers are still unlisted and the pool's
    /// obstacle: the oldest server past the bound, or `None`.
    pub fn listed<'a>(
        &mut self,
        pool: &str,
        listed_ids: impl IntoIterator<Item = &'a str>,
        boot_timeout_secs: u64,
        now: Instant,
    ) -> (u32, Option<String>) {
        let Some(unlisted) = self.pools.get_mut(pool) else {
            return (0, None);
        };
        for id in listed_ids {
            if let Some(u) = unlisted.remove(id) {
                tracing::debug!(pool, server = %u.name, server_id = id, "created server listed");
            }
        }
        for u in unlisted.values_mut() {
            u.missed = u.missed.saturating_add(1);
        }
        let obstacle = unlisted
            .iter()
            .filter(|(_, u)| {
                u.missed >= UNLISTED_LISTINGS_LIMIT
                    || now.saturating_duration_since(u.created_at).as_secs() >= boot_timeout_secs
            })
            .min_by_key(|(_, u)| u.created_at)
            .map(|(id, u)| {
                format!(
                    "server {} ({id}), created by this controller {:.0} s ago, is missing from the {} server listings since: the controller cannot see the servers it boots (is the cloud's tag filter or compute microversion wrong?), so the pool boots no more until a listing shows it or the controller is restarted",
                    u.name,
                    now.saturating_duration_since(u.created_at).as_secs_f64(),
                    u.missed
                )
            });
        (unlisted.len() as u32, obstacle)
    }
}

/// One pool of this controller, as a cycle observes it and acts on it.
#[derive(Debug, Clone, Copy)]
pub struct PoolRef<'a> {
    /// Cluster name.
    pub cluster: &'a str,
    /// Pool name.
    pub name: &'a str,
    /// Pool settings.
    pub cfg: &'a PoolConfig,
    /// The controller's `loss_limit`, written into new agents' identity.
    pub loss_limit: u32,
}

/// What the controller remembers of its pools between cycles (soft state:
/// a restarted controller starts empty, which costs at most one cooldown).
#[derive(Debug, Default)]
pub struct PoolMemory {
    /// When each pool last asked an agent whether it may be deleted.
    pub last_scale_down: BTreeMap<String, Instant>,
    /// When each pool's last boot failed.
    pub last_boot_failure: BTreeMap<String, Instant>,
    /// Since when each pool has had more VMs than its target without a
    /// break (absent: no surplus at its last plan).
    pub surplus_since: BTreeMap<String, Instant>,
    /// The servers created that no listing has shown yet.
    pub created_watch: CreatedWatch,
    /// Agents whose heartbeat's slots differ from their pool's `slots`,
    /// with the slots already warned about (a warning once per change).
    pub slots_warned: BTreeMap<String, u32>,
}

/// The part of a cycle's observation every pool shares, read once.
#[derive(Debug)]
pub struct World {
    /// Every server of the cluster (the complete list).
    pub servers: Vec<Server>,
    /// The agent registry `(agent, pool)`, if it could be read.
    pub registered: Option<Vec<(String, String)>>,
    /// Instances the quota allows at the start of the cycle (`None`:
    /// unlimited; `Some(0)` when it could not be read: boot nothing).
    pub quota_remaining: Option<u32>,
    /// The quota's figures as read (or why they could not be), for the
    /// pools' obstacle when it holds boots back.
    pub quota: QuotaView,
    /// The event book at the cycle's instant.
    pub events: EventSnapshot,
    /// The cycle's clock.
    pub clock: Clock,
}

/// Why a cycle has no [`World`].
#[derive(Debug)]
pub enum NoWorld {
    /// The broker blocks publishing (memory or disk alarm; its reason):
    /// every pool is held, without backoff, since the alarm is not this
    /// controller's failure.
    Held(String),
    /// A source every pool needs could not be read: every pool fails.
    Failed(ObserveError),
}

/// Reads the [`World`] of a cycle at `now`: connects to the broker,
/// probes for an alarm, reads the agent registry, the complete server
/// list of `cluster`, the quota and the event book. A controller `started`
/// at that instant judges nobody before it has listened long enough.
/// Broker refusals are noted in `refusals`, failed cloud reads counted in
/// `metrics`.
///
/// # Errors
/// [`NoWorld`]: held during a broker alarm; failed without a broker
/// connection, a probe or a server list. An unreadable registry or quota
/// is no error (no orphans looked for; no boots).
pub async fn observe_world<C: CloudApi, B: BrokerApi>(
    cloud: &C,
    broker: &B,
    cluster: &str,
    started: Instant,
    now: Instant,
    metrics: &Metrics,
    refusals: &mut Refusals,
) -> Result<World, NoWorld> {
    if let Err(e) = broker.ensure_connected().await {
        refusals.note(&e);
        return Err(NoWorld::Failed(ObserveError::Broker(e)));
    }
    // During a broker alarm agents cannot publish heartbeats or answers:
    // nothing is judged or acted on until it ends.
    let probed = match broker.blocked() {
        Some(reason) => Err(reason),
        // A probe stuck behind an alarm another publish raised ends in
        // a timeout: the blocked flag, set meanwhile, decides.
        None => match (broker.probe().await, broker.blocked()) {
            (_, Some(reason)) => Err(reason),
            (Ok(()), None) => Ok(()),
            (Err(e), None) => {
                refusals.note(&e);
                return Err(NoWorld::Failed(ObserveError::Probe(e)));
            }
        },
    };
    if let Err(reason) = probed {
        metrics.broker_blocked.set(1);
        tracing::info!(reason = %reason, "broker alarm: holding every pool this cycle");
        return Err(NoWorld::Held(reason));
    }
    metrics.broker_blocked.set(0);
    // Read before the server list: an agent registers from its server,
    // so every registered agent whose server exists is in that list.
    let registered = match broker.registered_agents().await {
        Ok(r) => Some(r),
        Err(e) => {
            refusals.note(&e);
            tracing::warn!(error = %e, "cannot read the agent registry; orphaned leases are looked for next cycle");
            None
        }
    };
    let servers = match cloud.list_servers(&cluster_tag(cluster)).await {
        Ok(s) => s,
        Err(e) => {
            metrics.cloud_errors.inc();
            return Err(NoWorld::Failed(ObserveError::Servers(e)));
        }
    };
    let quota;
    let quota_remaining = match cloud.quota().await {
        Ok(q) => {
            quota = QuotaView::Read(q);
            metrics.quota(
                "instances",
                q.used_instances.into(),
                q.max_instances.map(u64::from),
            );
            metrics.quota("cores", q.used_cores.into(), q.max_cores.map(u64::from));
            let bytes = |mib: u64| mib.saturating_mul(1024 * 1024);
            metrics.quota("ram_bytes", bytes(q.used_ram_mib), q.max_ram_mib.map(bytes));
            q.remaining()
        }
        Err(e) => {
            metrics.cloud_errors.inc();
            metrics.quota_unknown();
            tracing::warn!(error = %e, "cannot read the instance quota; booting nothing this cycle");
            quota = QuotaView::Unreadable(vq_common::error::chain(&e));
            Some(0)
        }
    };
    let events = broker.snapshot(now);
    let clock = Clock {
        now,
        unix_now: unix_now(),
        listening_secs: events
            .listening_secs
            .min(now.saturating_duration_since(started).as_secs_f64()),
    };
    Ok(World {
        servers,
        registered,
        quota_remaining,
        quota,
        events,
        clock,
    })
}

/// Reads `pool`'s queue depth and builds its whole [`Observed`] from it,
/// `world` (with `quota_remaining`: what the pools before it left) and
/// `memory`, whose [`CreatedWatch`] takes this listing of the pool.
///
/// # Errors
/// [`ObserveError::QueueDepth`] (a refusal is noted in `refusals`).
pub async fn observe_pool<B: BrokerApi>(
    broker: &B,
    world: &World,
    pool: PoolRef<'_>,
    quota_remaining: Option<u32>,
    memory: &mut PoolMemory,
    refusals: &mut Refusals,
) -> Result<Observed, ObserveError> {
    let PoolRef {
        cluster,
        name: pool,
        cfg: pool_cfg,
        ..
    } = pool;
    let depth = match broker.queue_depth(pool).await {
        Ok(d) => d,
        Err(source) => {
            refusals.note(&source);
            return Err(ObserveError::QueueDepth {
                queue: Topology::new(cluster.to_string()).pool_queue(pool),
                source,
            });
        }
    };
    let now = world.clock.now;
    let since = |m: &BTreeMap<String, Instant>| {
        m.get(pool)
            .map(|t| now.saturating_duration_since(*t).as_secs_f64())
    };
    let listed = world
        .servers
        .iter()
        .filter(|s| owned_by(s, cluster, pool))
        .map(|s| s.id.as_str());
    let (unlisted_created, boot_obstacle) =
        memory
            .created_watch
            .listed(pool, listed, pool_cfg.boot_timeout_secs, now);
    for s in world.servers.iter().filter(|s| owned_by(s, cluster, pool)) {
        let Some((hb, _)) = world
            .events
            .agents
            .get(&s.name)
            .and_then(|r| r.heartbeat.as_ref())
        else {
            continue;
        };
        if hb.slots != pool_cfg.slots {
            if memory.slots_warned.insert(s.name.clone(), hb.slots) != Some(hb.slots) {
                tracing::warn!(pool, agent = %s.name, agent_slots = hb.slots, pool_slots = pool_cfg.slots,
                    "agent heartbeats other slots than its pool's configured slots: the controller plans with the pool's, the agent runs with its own (fix the pool's slots or the agent's config)");
            }
        } else {
            memory.slots_warned.remove(&s.name);
        }
    }
    Ok(assemble(&PoolInputs {
        cluster,
        pool,
        servers: &world.servers,
        agents: &world.events.agents,
        demand: world.events.demand.get(pool),
        queue_depth: depth,
        quota_remaining,
        quota: &world.quota,
        since_scale_down_secs: since(&memory.last_scale_down),
        since_boot_failure_secs: since(&memory.last_boot_failure),
        surplus_secs: since(&memory.surplus_since),
        unlisted_created,
        boot_obstacle: boot_obstacle.as_deref(),
        job_slots: world
            .events
            .job_slots
            .as_ref()
            .map(|m| m.get(pool).copied().unwrap_or_default()),
        configured_slots: pool_cfg.slots,
        clock: world.clock,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{record_event, remember_ask, Shared};
    use std::time::Duration;
    use vq_common::messages::Heartbeat;

    /// The inputs of one pool with no history and no created servers.
    fn inputs<'a>(
        servers: &'a [Server],
        agents: &'a BTreeMap<String, AgentRecord>,
        demand: Option<&'a (Demand, Instant)>,
        queue_depth: u64,
        quota_remaining: Option<u32>,
        clock: Clock,
    ) -> PoolInputs<'a> {
        PoolInputs {
            cluster: "vq",
            pool: "cms",
            servers,
            agents,
            demand,
            queue_depth,
            quota_remaining,
            quota: &QuotaView::Unknown,
            since_scale_down_secs: None,
            since_boot_failure_secs: None,
            surplus_secs: None,
            unlisted_created: 0,
            boot_obstacle: None,
            job_slots: None,
            configured_slots: 0,
            clock,
        }
    }

    #[test]
    fn a_created_server_missing_from_two_listings_is_an_obstacle_until_listed() {
        let t0 = Instant::now();
        let mut w = CreatedWatch::default();
        assert_eq!(w.listed("cms", [], 600, t0), (0, None));
        w.created("cms", "id-1", "vq-cms-1", t0);
        assert_eq!(w.listed("other", [], 600, t0), (0, None));
        assert_eq!(
            w.listed("cms", ["id-0"], 600, t0),
            (1, None),
            "one listing missed: booting"
        );
        let (n, o) = w.listed("cms", [], 600, t0);
        let o = o.expect("two listings missed");
        assert_eq!(n, 1);
        assert!(o.contains("vq-cms-1") && o.contains("id-1"), "{o}");
        assert!(w.listed("cms", [], 600, t0).1.is_some(), "still missing");
        assert_eq!(
            w.listed("cms", ["id-1"], 600, t0),
            (0, None),
            "listed at last"
        );
        assert_eq!(
            w.listed("cms", [], 600, t0),
            (0, None),
            "forgotten once listed"
        );
        // The boot timeout bounds it too.
        w.created("cms", "id-2", "vq-cms-2", t0);
        let later = t0 + Duration::from_secs(30);
        assert!(w.listed("cms", [], 30, later).1.is_some());
    }

    fn server(name: &str, pool: &str) -> Server {
        Server {
            id: format!("id-{name}"),
            name: name.into(),
            status: "ACTIVE".into(),
            task_state: None,
            created: Some(1000.0),
            metadata: [
                (META_CLUSTER.to_string(), "vq".to_string()),
                (META_POOL.to_string(), pool.to_string()),
            ]
            .into(),
            tags: vec![],
            fault: None,
        }
    }

    fn hb(agent: &str, running: usize) -> Heartbeat {
        Heartbeat {
            schema: 1,
            agent: agent.into(),
            pool: "cms".into(),
            host: String::new(),
            state: if running > 0 {
                AgentState::Busy
            } else {
                AgentState::Idle
            },
            slots: 2,
            running: (0..running).map(|i| format!("j{i}")).collect(),
            is_pull: true,
            is_del: false,
            idle_secs: 0.0,
            interval_secs: 10.0,
            at: 0.0,
            version: String::new(),
            drain_reason: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_pools_servers_are_seen_and_demand_is_a_floor() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(5)).await;
        let servers = vec![server("a", "cms"), server("b", "atlas"), {
            let mut s = server("c", "cms");
            s.metadata.insert(META_CLUSTER.into(), "other".into());
            s
        }];
        let mut agents = BTreeMap::new();
        agents.insert(
            "a".to_string(),
            AgentRecord {
                heartbeat: Some((hb("a", 2), t0)),
                answer: None,
                asked: Vec::new(),
            },
        );
        let demand = (
            Demand {
                schema: 1,
                pool: "cms".into(),
                queued: 7,
                running: 1,
                at: 0.0,
                source: "t".into(),
            },
            t0,
        );
        let clock = Clock {
            now: Instant::now(),
            unix_now: 1100.0,
            listening_secs: 5.0,
        };
        let o = assemble(&inputs(&servers, &agents, Some(&demand), 3, Some(4), clock));
        assert_eq!(o.servers.len(), 1);
        assert_eq!(o.servers[0].age_secs, Some(100.0));
        let a = o.servers[0].agent.as_ref().unwrap();
        assert_eq!(a.heartbeat_age_secs, 5.0);
        assert_eq!(o.queued, 7, "bridge demand above the queue depth wins");
        assert_eq!(o.running, 2, "heartbeats above the bridge's running win");
        assert_eq!(o.quota_remaining, Some(4));

        tokio::time::advance(Duration::from_secs(3600)).await;
        let clock = Clock {
            now: Instant::now(),
            ..clock
        };
        let o = assemble(&inputs(&servers, &agents, Some(&demand), 3, None, clock));
        assert_eq!(o.queued, 3, "stale demand is ignored");
    }

    #[test]
    fn the_view_carries_the_pool_s_history_and_its_unlisted_servers() {
        let agents = BTreeMap::new();
        let clock = Clock {
            now: Instant::now(),
            unix_now: 1100.0,
            listening_secs: 5.0,
        };
        let o = assemble(&PoolInputs {
            since_scale_down_secs: Some(12.0),
            since_boot_failure_secs: Some(3.0),
            surplus_secs: Some(7.0),
            unlisted_created: 2,
            boot_obstacle: Some("server x is missing"),
            ..inputs(&[], &agents, None, 0, None, clock)
        });
        assert_eq!(o.since_scale_down_secs, Some(12.0));
        assert_eq!(o.since_boot_failure_secs, Some(3.0));
        assert_eq!(o.surplus_secs, Some(7.0));
        assert_eq!(o.unlisted_created, 2);
        assert_eq!(o.boot_obstacle.as_deref(), Some("server x is missing"));
    }

    #[test]
    fn deleting_servers_are_recognised() {
        assert_eq!(
            NovaStatus::from_nova("ACTIVE", Some("deleting")),
            NovaStatus::Deleting
        );
        assert_eq!(
            NovaStatus::from_nova("SHUTOFF", None),
            NovaStatus::Other("SHUTOFF".into())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn only_answers_to_remembered_request_ids_are_matched() {
        let mut s = Shared::default();
        let t = Instant::now();
        let hb = br#"{"agent":"vq-cms-1","pool":"cms","state":"drained","slots":1,"running":[],"is_pull":false,"is_del":true,"idle_secs":99,"interval_secs":10,"at":0}"#;
        record_event(&mut s, "agent.cms.heartbeat", hb, t);
        let ans = |id: &str| {
            format!(
                r#"{{"agent":"vq-cms-1","pool":"cms","request_id":"{id}","may_delete":true,"running":[],"at":0}}"#
            )
        };
        let matched = |s: &Shared| {
            let server = Server {
                id: "id1".into(),
                name: "vq-cms-1".into(),
                status: "ACTIVE".into(),
                task_state: None,
                created: Some(0.0),
                metadata: [
                    (META_CLUSTER.to_string(), "vq".to_string()),
                    (META_POOL.to_string(), "cms".to_string()),
                ]
                .into(),
                tags: vec![],
                fault: None,
            };
            let servers = [server];
            let o = assemble(&PoolInputs {
                cluster: "vq",
                pool: "cms",
                servers: &servers,
                agents: &s.agents,
                demand: None,
                queue_depth: 0,
                quota_remaining: None,
                quota: &QuotaView::Unknown,
                since_scale_down_secs: None,
                since_boot_failure_secs: None,
                surplus_secs: None,
                unlisted_created: 0,
                boot_obstacle: None,
                job_slots: None,
                configured_slots: 0,
                clock: Clock {
                    now: Instant::now(),
                    unix_now: 100.0,
                    listening_secs: 1000.0,
                },
            });
            o.servers[0]
                .agent
                .as_ref()
                .unwrap()
                .answer
                .as_ref()
                .map(|a| a.matched)
        };
        // A yes to an id this controller never sent (e.g. before a restart).
        record_event(&mut s, "agent.cms.answer", ans("old").as_bytes(), t);
        assert_eq!(matched(&s), Some(false));
        remember_ask(&mut s, "vq-cms-1", "r1");
        record_event(&mut s, "agent.cms.answer", ans("r1").as_bytes(), t);
        assert_eq!(matched(&s), Some(true));
        // Only the last few ids are kept.
        for i in 0..ASKED_KEPT {
            remember_ask(&mut s, "vq-cms-1", &format!("n{i}"));
        }
        assert_eq!(matched(&s), Some(false));
        assert_eq!(s.agents["vq-cms-1"].asked.len(), ASKED_KEPT);
    }
}
