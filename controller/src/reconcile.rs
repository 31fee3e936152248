//! The reconcile loop: every `interval_secs`, for each pool that is not
//! backing off, observe (all or nothing, [`crate::observe`]), plan (pure,
//! [`crate::plan`]), act ([`crate::act`]) and publish the result on the
//! status page and in the metrics ([`crate::status`]); a failed pool is
//! backed off as [`crate::policy::error_policy`] says, and the leases of
//! lost agents are returned ([`crate::fence`]). The loop keeps only soft
//! state (backoff, cooldown instants, the event map): restarting the
//! controller loses nothing and creates no duplicates.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use vq_common::config::{ControllerConfig, Microversion};
use vq_common::topology::Topology;

use crate::act::{act, PoolRef};
use crate::backoff::{PoolBackoff, POOL_BACKOFF};
use crate::breaker::Breakers;
use crate::broker::Broker;
use crate::deletes::{Decision as DeleteDecision, Deletes};
use crate::error::{ActError, CloudError, ObserveError, RunError};
use crate::fence::{self, FenceView};
use crate::http::{AppState, Metrics};
use crate::leader::{Gated, Leadership, Role};
use crate::observe::{observe_pool, observe_world, NoWorld, PoolMemory, World};
use crate::openstack::{CloudApi, Credentials, HttpCloud};
use crate::plan::Action;
use crate::plan::{classify, plan, Timing};
use crate::policy::{error_policy, CycleError, Refusals};
use crate::status::{self, PoolFailure, PoolStatus, Reach, StatusReport};
use crate::timings::Timings;

/// The shutdown deadline: how long after the first shutdown request the
/// controller may take to stop (finish the cycle in flight, acting no
/// more, close the broker connection and the status endpoint); whatever
/// is still running then is aborted. Below the unit's `TimeoutStopSec`.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Runs `work` to its end, or until `grace` has passed since `shutdown`
/// was cancelled, whichever comes first: the controller's one shutdown
/// deadline, counted from the request, not from when `work` started.
/// `None`: the deadline cut `work` short (it is dropped, which aborts its
/// in-flight calls).
pub async fn until_shutdown_deadline<F: std::future::Future>(
    work: F,
    shutdown: &CancellationToken,
    grace: Duration,
) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = work => Some(out),
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        } => None,
    }
}

pub use crate::broker::BrokerApi;

/// Result of one cycle, for tests and `--once`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CycleSummary {
    /// Pools reconciled successfully.
    pub ok: Vec<String>,
    /// Pools whose cycle failed.
    pub failed: Vec<String>,
    /// Pools skipped (backing off).
    pub skipped: Vec<String>,
    /// Pools held without acting because the broker blocks publishing
    /// (memory or disk alarm); not counted as failures.
    pub held: Vec<String>,
    /// Servers created.
    pub created: u32,
    /// Servers deleted.
    pub deleted: u32,
    /// Agents whose leases were returned (their server is gone).
    pub fenced: Vec<String>,
}

/// How one pool's turn of a cycle ended.
enum Turn {
    /// Observing the pool failed: nothing was planned.
    Unobserved(ObserveError),
    /// Observed and planned, not acted on (shutting down).
    Planned,
    /// Acted: servers created and deleted, and the first failed action.
    Acted {
        created: u32,
        deleted: u32,
        failure: Option<ActError>,
    },
}

/// The controller: configuration, clients and soft state.
pub struct Controller<C, B> {
    cfg: ControllerConfig,
    cloud: C,
    broker: B,
    backoff: BTreeMap<String, PoolBackoff>,
    /// Cooldown instants and the servers created but not listed yet.
    memory: PoolMemory,
    /// Each pool's boot-failure backoff and circuit breaker.
    breakers: Breakers,
    /// Each pool's deletes in flight (polled, re-sent rarely, flagged).
    deletes: BTreeMap<String, Deletes>,
    /// When this controller first saw each agent registry entry: an agent
    /// is judged by the registry only after a whole heartbeat timeout in it
    /// (a new agent registers before its first heartbeat).
    registry_first_seen: BTreeMap<String, Instant>,
    /// The first ACCESS_REFUSED the broker gave in the running cycle.
    refusals: Refusals,
    /// Boots and asks being timed for the histograms.
    timings: Timings,
    started: Instant,
    /// The controller lock (`None`: this controller always acts, as in the
    /// unit tests' fakes).
    lock: Option<Arc<Leadership>>,
    /// The role of the last cycle.
    role: Role,
    /// `--dry-run`: observe, plan and log what would be done; act on
    /// nothing.
    dry_run: bool,
    /// The job table, given each pool's pending reason after every cycle
    /// (`None`: no table, as in the unit tests' fakes).
    jobs: Option<crate::jobs::SharedJobs>,
    /// Status page contents.
    pub status: Arc<RwLock<StatusReport>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl<C: CloudApi, B: BrokerApi> Controller<C, B> {
    /// A controller for `cfg` using `cloud` and `broker`.
    pub fn new(cfg: ControllerConfig, cloud: C, broker: B) -> Self {
        let backoff = cfg
            .pools
            .keys()
            .map(|pool| (pool.clone(), PoolBackoff::new(POOL_BACKOFF)))
            .collect();
        let status = StatusReport {
            cluster: cfg.cluster.clone(),
            pools: cfg
                .pools
                .keys()
                .map(|p| (p.clone(), PoolStatus::default()))
                .collect(),
            ..Default::default()
        };
        Controller {
            cfg,
            cloud,
            broker,
            backoff,
            memory: PoolMemory::default(),
            breakers: Breakers::default(),
            deletes: BTreeMap::new(),
            registry_first_seen: BTreeMap::new(),
            refusals: Refusals::default(),
            timings: Timings::default(),
            started: Instant::now(),
            lock: None,
            role: Role::Leader,
            dry_run: false,
            jobs: None,
            status: Arc::new(RwLock::new(StatusReport {
                role: Role::Leader,
                ..status
            })),
            metrics: Arc::new(Metrics::new()),
        }
    }

    /// Publishes into `metrics` (shared with the cloud and broker clients)
    /// instead of a registry of its own.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Acts only while holding `lock` (standby otherwise: observes, plans
    /// and serves status).
    pub fn with_leadership(mut self, lock: Arc<Leadership>) -> Self {
        self.lock = Some(lock);
        self.role = Role::Standby;
        status::show_role(
            &self.status,
            &self.metrics,
            Role::Standby,
            Some("not tried yet"),
        );
        self
    }

    /// `--dry-run`: plans are logged ("dry run: would …", with the
    /// reasons), nothing is created, deleted, asked or fenced.
    /// Gives each pool's pending reason to the queued jobs of `jobs`
    /// after every cycle ([`crate::jobs::pending`]).
    pub fn with_job_table(mut self, jobs: crate::jobs::SharedJobs) -> Self {
        self.jobs = Some(jobs);
        self
    }

    /// A dry-run controller never takes the controller lock (it must not
    /// keep a production controller from acting): it is standby.
    pub fn with_dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self.status
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .dry_run = dry_run;
        if dry_run {
            self.lock = None;
            self.role = Role::Standby;
            status::show_role(
                &self.status,
                &self.metrics,
                Role::Standby,
                Some("dry run: plans only, never takes the controller lock"),
            );
        }
        self
    }

    /// The role of the last cycle.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The cloud client.
    pub fn cloud(&self) -> &C {
        &self.cloud
    }

    /// The broker client.
    pub fn broker(&self) -> &B {
        &self.broker
    }

    /// Backs `pool` off after its cycle failed with `err`, as
    /// [`error_policy`] says, and shows the whole cause chain on the status
    /// page.
    fn fail_pool(&mut self, pool: &str, now: Instant, err: CycleError<'_>) {
        let next = error_policy(err);
        let b = self.backoff.get_mut(pool).expect("pool has a backoff");
        let delay = b.failed(now, next.at_least);
        let chain = err.chain();
        let attempts = b.attempts();
        if next.permanent {
            tracing::error!(pool, error = %chain, retry_in_secs = delay.as_secs_f64(), attempts = b.attempts(), "permanent error; check the pool's configuration, the cloud and the broker account");
        } else {
            tracing::warn!(pool, error = %chain, retry_in_secs = delay.as_secs_f64(), attempts = b.attempts(), "pool cycle failed; backing off");
        }
        status::show_failure(
            &self.status,
            &self.metrics,
            pool,
            PoolFailure {
                error: chain,
                attempts,
                permanent: next.permanent,
                observed: matches!(err, CycleError::Act(_)),
            },
        );
    }

    /// Runs one cycle. With `shutdown` cancelled, observes and plans but
    /// does not act. A cycle that touched the broker sets or clears
    /// [`StatusReport::broker_access_refused`].
    pub async fn cycle(&mut self, shutdown: &CancellationToken) -> CycleSummary {
        self.refusals.take();
        let summary = self.cycle_inner(shutdown).await;
        let ran = !(summary.ok.is_empty() && summary.failed.is_empty() && summary.held.is_empty());
        if ran {
            status::show_refused(&self.status, self.refusals.take());
        }
        if let Some(jobs) = &self.jobs {
            let pending = {
                let report = self.status.read().unwrap_or_else(|p| p.into_inner());
                report
                    .pools
                    .iter()
                    .map(|(name, p)| (name.clone(), crate::jobs::pending::pending_reason(p)))
                    .collect()
            };
            jobs.write().unwrap_or_else(|p| p.into_inner()).pending = pending;
        }
        summary
    }

    /// The pools not backing off observe the world once, then each takes
    /// its turn (observe, plan, act, error policy), each seeing the quota
    /// the ones before it left; then lost agents are fenced.
    async fn cycle_inner(&mut self, shutdown: &CancellationToken) -> CycleSummary {
        let now = Instant::now();
        let mut summary = CycleSummary::default();
        let (ready, skipped): (Vec<String>, Vec<String>) = self
            .cfg
            .pools
            .keys()
            .cloned()
            .partition(|p| self.backoff[p].ready(now));
        summary.skipped = skipped;
        if ready.is_empty() {
            return summary;
        }
        // First, on its own connection: a partitioned leader shows it is
        // standby at once, even while the observation below waits.
        self.leadership_step().await;
        let world = observe_world(
            &self.cloud,
            &self.broker,
            &self.cfg.cluster,
            self.started,
            now,
            &self.metrics,
            &mut self.refusals,
        )
        .await;
        let cloud_error = match &world {
            Err(NoWorld::Failed(e @ ObserveError::Servers(_))) => Some(vq_common::error::chain(e)),
            _ => None,
        };
        let reach = match &world {
            Ok(_) => Reach::Both(None),
            Err(NoWorld::Failed(ObserveError::Servers(_))) => Reach::Both(cloud_error.as_deref()),
            Err(NoWorld::Failed(ObserveError::Broker(_))) => Reach::NoBroker,
            Err(_) => Reach::Broker,
        };
        status::show_connections(&self.status, &self.metrics, reach);
        if world.is_err() {
            // Not read this cycle: no stale quota is served as current.
            self.metrics.quota_unknown();
        }
        let world = match world {
            Ok(w) => w,
            Err(NoWorld::Held(reason)) => {
                status::show_held(&self.status, &self.metrics, &ready, &reason);
                summary.held = ready;
                return summary;
            }
            Err(NoWorld::Failed(e)) => {
                for p in &ready {
                    self.fail_pool(p, now, CycleError::Observe(&e));
                }
                summary.failed = ready;
                return summary;
            }
        };
        let mut quota = world.quota_remaining;
        let acting = self.role == Role::Leader && !self.dry_run;
        for pool in ready {
            let turn_started = Instant::now();
            let turn = self.pool_turn(&pool, &world, quota, shutdown, acting).await;
            self.metrics
                .reconcile_duration
                .get_or_create(&Metrics::pool(&pool))
                .observe(turn_started.elapsed().as_secs_f64());
            match turn {
                Turn::Unobserved(e) => {
                    self.fail_pool(&pool, now, CycleError::Observe(&e));
                    summary.failed.push(pool);
                }
                Turn::Planned => {
                    status::show_success(&self.status, &pool);
                    summary.ok.push(pool);
                }
                Turn::Acted {
                    created,
                    deleted,
                    failure,
                } => {
                    quota = quota.map(|q| q.saturating_sub(created));
                    summary.created += created;
                    summary.deleted += deleted;
                    match failure {
                        Some(e) => {
                            self.fail_pool(&pool, now, CycleError::Act(&e));
                            summary.failed.push(pool);
                        }
                        None => {
                            self.backoff.get_mut(&pool).expect("pool").succeeded();
                            status::show_success(&self.status, &pool);
                            summary.ok.push(pool);
                        }
                    }
                }
            }
        }
        if !shutdown.is_cancelled() && acting {
            summary.fenced = self.fence_lost(&world).await;
        } else if self.dry_run {
            tracing::debug!(
                "dry run: no fencing step (no lease is returned, no fence mark written)"
            );
        }
        summary
    }

    /// Proves or takes the controller lock; publishes the role (status,
    /// metrics) and logs a change.
    async fn leadership_step(&mut self) {
        let Some(lock) = self.lock.clone() else {
            return;
        };
        let role = lock.step().await;
        let why = (role == Role::Standby).then(|| lock.why_standby());
        if role != self.role {
            self.metrics.leadership_changes.inc();
            match role {
                Role::Leader => tracing::info!("this controller is now the leader: it acts"),
                Role::Standby => {
                    tracing::warn!(reason = ?why, "this controller is now standby: it observes and serves status, acts on nothing")
                }
            }
        }
        self.role = role;
        self.broker.take_demand(role == Role::Leader).await;
        status::show_role(&self.status, &self.metrics, role, why.as_deref());
    }

    /// One pool's turn: observe it (with `quota` instances left), plan,
    /// publish the plan, and act on it unless shutting down.
    async fn pool_turn(
        &mut self,
        name: &str,
        world: &World,
        quota: Option<u32>,
        shutdown: &CancellationToken,
        acting: bool,
    ) -> Turn {
        let now = world.clock.now;
        let pool_cfg = self.cfg.pools[name].clone();
        let pool = PoolRef {
            cluster: &self.cfg.cluster,
            name,
            cfg: &pool_cfg,
            loss_limit: self.cfg.loss_limit,
        };
        let mut observed = match observe_pool(
            &self.broker,
            world,
            pool,
            quota,
            &mut self.memory,
            &mut self.refusals,
        )
        .await
        {
            Ok(o) => o,
            Err(e) => return Turn::Unobserved(e),
        };
        self.timings.observed(&self.metrics, &observed, now);
        let wait = Duration::from_secs_f64(self.cfg.heartbeat_timeout_secs);
        for u in self.timings.unanswered(&observed, now, wait) {
            tracing::warn!(
                pool = %name,
                agent = %u.agent,
                asked_secs = u.asked_secs.round(),
                broker_user = %vq_common::amqp_url::broker_user(&self.cfg.broker.url),
                "agent heartbeats but has not answered whether it may be deleted for {:.0} s: the controller's broker user must be in the agent's control_admins (an agent refuses control messages from others without answering the controller), or the agent is older than the ask-delete protocol; it is asked again each cycle and not deleted",
                u.asked_secs
            );
        }
        match (
            &observed.boot_obstacle,
            status::has_obstacle(&self.status, name),
        ) {
            (Some(why), false) => {
                tracing::warn!(pool = %name, reason = %why, "boots stopped")
            }
            (None, true) => {
                tracing::info!(pool = %name, "created servers listed again: boots resume")
            }
            _ => {}
        }
        let timing = Timing {
            heartbeat_timeout_secs: self.cfg.heartbeat_timeout_secs,
        };
        // The breaker takes this view (ERROR and stuck servers are boot
        // failures, a booted one a success); the plan gets its gate.
        let classes: Vec<_> = observed
            .servers
            .iter()
            .map(|s| classify(s, &pool_cfg, &observed, timing))
            .collect();
        let breaker = self.breakers.get(name, &pool_cfg);
        breaker.observe(now, &observed.servers, &classes);
        observed.boot_gate = breaker.gate(now);
        let planned = plan(&observed, &pool_cfg, timing);
        // The scale-down hysteresis' clock: since when the pool has had
        // more VMs than its target without a break.
        if planned.surplus {
            self.memory
                .surplus_since
                .entry(name.to_string())
                .or_insert(now);
        } else {
            self.memory.surplus_since.remove(name);
        }
        // Deletes in flight: a server a complete listing no longer shows
        // is gone; one still listed is polled, not deleted again at once.
        let deletes = self.deletes.entry(name.to_string()).or_default();
        for (server, secs) in deletes.observe(observed.servers.iter().map(|s| s.id.as_str()), now) {
            tracing::info!(pool = %name, server = %server, secs_after_first_delete = secs, "deleted server is gone");
        }
        let actions: Vec<_> = planned
            .actions
            .iter()
            .filter(|a| match a {
                crate::plan::Action::Delete { server_id, name: server, .. } => {
                    match deletes.decide(server_id, now) {
                        DeleteDecision::Send => true,
                        DeleteDecision::Poll { secs_left } => {
                            tracing::debug!(pool = %name, server = %server, secs_left, "delete sent, server still listed: polling");
                            false
                        }
                    }
                }
                _ => true,
            })
            .cloned()
            .collect();
        for h in &planned.held {
            tracing::info!(pool = %name, reason = %h, "held back");
        }
        tracing::debug!(pool = %name, target = planned.target, active = planned.active, booting = planned.booting, queued = observed.queued, running = observed.running, "planned");
        status::publish(
            &self.status,
            &self.metrics,
            self.started,
            name,
            &observed,
            &planned,
        );
        if shutdown.is_cancelled() {
            if !planned.actions.is_empty() {
                tracing::info!(pool = %name, actions = planned.actions.len(), "shutting down: not acting");
            }
            return Turn::Planned;
        }
        if !acting {
            for a in &planned.actions {
                if self.dry_run {
                    tracing::info!(pool = %name, action = a.kind(), what = %describe(a), reason = %a.reason(), "dry run: would {}", describe(a));
                } else {
                    tracing::debug!(pool = %name, action = a.kind(), reason = %a.reason(), "standby: not acting");
                }
            }
            return Turn::Planned;
        }
        let acting_since = Instant::now();
        let report = act(pool, &actions, &self.cloud, &self.broker).await;
        let created_at = Instant::now();
        self.note_deletes(name, &pool_cfg, &actions, &report, created_at);
        for (server, id) in &report.created {
            self.memory
                .created_watch
                .created(name, id, server, created_at);
            self.timings.created(id, created_at);
        }
        for agent in &report.asked {
            self.timings.asked(agent, acting_since);
        }
        status::count_actions(&self.metrics, name, &report);
        if !report.asked.is_empty() {
            self.memory.last_scale_down.insert(name.to_string(), now);
        }
        let breaker = self.breakers.get(name, &pool_cfg);
        for (_, id) in &report.created {
            breaker.created(id);
        }
        if report.boot_failed {
            self.memory.last_boot_failure.insert(name.to_string(), now);
            let failed = report
                .errors
                .iter()
                .rev()
                .find(|e| matches!(e, ActError::Create { .. } | ActError::Resolve { .. }));
            // A full quota is a temporary stop of the cloud, not a failing
            // boot: the breaker does not count it.
            let quota = matches!(failed, Some(ActError::Create { source, .. }) if source.is_quota_exceeded());
            // Nor is a create not sent because the lock was lost.
            let not_leader = matches!(failed, Some(ActError::Create { source, .. }) if matches!(**source, CloudError::NotLeader { .. }));
            if !quota && !not_leader {
                let what = failed
                    .map(|e| vq_common::error::chain(e))
                    .unwrap_or_else(|| "create failed".into());
                breaker.failed(created_at, what);
            }
        }
        let gate = breaker.gate(created_at);
        let failures = breaker.failures();
        status::show_breaker(&self.status, &self.metrics, name, &gate, failures);
        for e in &report.errors {
            if let ActError::Control { source, .. } = e {
                self.refusals.note(source);
            }
        }
        Turn::Acted {
            created: report.created.len() as u32,
            deleted: report.deleted.len() as u32,
            failure: report.errors.into_iter().next(),
        }
    }

    /// Records the deletes Nova accepted in this turn, warns about re-sends
    /// and servers that will not go, and shows the latter in `/status`.
    fn note_deletes(
        &mut self,
        pool: &str,
        pool_cfg: &vq_common::config::PoolConfig,
        actions: &[crate::plan::Action],
        report: &crate::act::ActReport,
        now: Instant,
    ) {
        let deletes = self.deletes.entry(pool.to_string()).or_default();
        let retry = Duration::from_secs_f64(pool_cfg.delete_retry_secs);
        for (server, _) in &report.deleted {
            let id = actions.iter().find_map(|a| match a {
                crate::plan::Action::Delete {
                    server_id, name, ..
                } if name == server => Some(server_id),
                _ => None,
            });
            if let Some(id) = id {
                let sent = deletes.sent(id, server, retry, now);
                if sent > 1 {
                    tracing::warn!(pool = %pool, server = %server, deletes_sent = sent, "server still listed after its delete was accepted: DELETE sent again");
                }
            }
        }
        let timeout = Duration::from_secs_f64(pool_cfg.delete_timeout_secs);
        let (stuck, newly) = deletes.stuck(timeout, now);
        for s in &newly {
            tracing::warn!(pool = %pool, server = %s.server, server_id = %s.server_id, since_secs = s.since_secs, deletes_sent = s.deletes_sent, "server will not go: still listed after delete_timeout_secs ({} s); DELETE is re-sent at a backoff", pool_cfg.delete_timeout_secs);
        }
        status::show_stuck_deletes(&self.status, &self.metrics, pool, stuck);
    }

    /// The fence step of a cycle ([`fence::fence_step`]): marks the agents
    /// without a server and returns the leases of every marked agent whose
    /// server is gone. Returns the agents fenced.
    async fn fence_lost(&mut self, world: &World) -> Vec<String> {
        let now = world.clock.now;
        fence::note_registry(
            &mut self.registry_first_seen,
            world.registered.as_deref(),
            now,
        );
        let in_nova: BTreeSet<&str> = world.servers.iter().map(|s| s.name.as_str()).collect();
        let pools: BTreeSet<&str> = self.cfg.pools.keys().map(String::as_str).collect();
        let view = FenceView {
            in_nova: &in_nova,
            registered: world.registered.as_deref(),
            events: &world.events,
            registry_first_seen: &self.registry_first_seen,
            listening_secs: world.clock.listening_secs,
            now,
            timeout_secs: self.cfg.heartbeat_timeout_secs,
        };
        let out = fence::fence_step(&self.broker, &view, &pools, self.cfg.loss_limit).await;
        for e in &out.errors {
            self.refusals.note(e);
        }
        for (_, pool) in &out.requeued {
            self.metrics.job_requeued(pool, "node-lost");
        }
        out.fenced
    }
}

/// What `action` would do, for the dry-run log: `boot 2 server(s)`,
/// `ask agent X to drain for deletion`, `delete server NAME (ID)`.
pub fn describe(action: &Action) -> String {
    match action {
        Action::Boot { count, .. } => format!("boot {count} server(s)"),
        Action::AskDelete {
            agent, server_id, ..
        } => format!("ask agent {agent} (server {server_id}) whether its VM may be deleted"),
        Action::Delete {
            server_id,
            name,
            cause,
            ..
        } => format!("delete server {name} ({server_id}, {cause:?})"),
    }
}

/// Options of [`run`].
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// Run one cycle, then return.
    pub once: bool,
    /// The shutdown deadline ([`SHUTDOWN_GRACE`] by default).
    pub shutdown_grace: Duration,
    /// `--dry-run`: observe and plan, log what would be done, do nothing
    /// that changes the cloud or the agents.
    pub dry_run: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            once: false,
            shutdown_grace: SHUTDOWN_GRACE,
            dry_run: false,
        }
    }
}

/// Bound of reading the flavors' RAM at start ([`pool_limits`]).
pub const FLAVOR_RAM_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits every pool publishes ([`vq_common::pools`]); a pool without
/// `memory_mb` publishes its flavor's RAM, read once here if the cloud
/// answered the start's version check (`cloud_answered`), within
/// [`FLAVOR_RAM_TIMEOUT`]. If the flavors cannot be read now, such pools
/// publish no memory per VM until the controller restarts (the agents still
/// refuse a job larger than their VM), and the log says so.
async fn pool_limits(
    cfg: &ControllerConfig,
    cloud: &HttpCloud,
    cloud_answered: bool,
) -> Vec<vq_common::pools::PoolLimits> {
    let wanted = cfg.pools.values().any(|p| p.memory_mb.is_none());
    if wanted && !cloud_answered {
        tracing::warn!("the cloud did not answer at start: pools without memory_mb publish no memory per VM (vq submit does not check -l mem)");
    }
    let flavors = if wanted && cloud_answered {
        match tokio::time::timeout(FLAVOR_RAM_TIMEOUT, cloud.list_flavor_ram()).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                tracing::warn!(error = %vq_common::error::chain(&e), "cannot read the flavors' RAM: pools without memory_mb publish no memory per VM (vq submit does not check -l mem)");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!(secs = FLAVOR_RAM_TIMEOUT.as_secs(), "the flavors' RAM was not read in time: pools without memory_mb publish no memory per VM (vq submit does not check -l mem)");
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    cfg.pools
        .iter()
        .map(|(name, pool)| {
            let ram = crate::openstack::inventory::flavor_ram(&flavors, &pool.flavor);
            vq_common::pools::PoolLimits::of(name, pool, ram)
        })
        .collect()
}

/// Runs the controller until `shutdown` is cancelled (or one cycle with
/// `once`) with `creds` (found and checked once, in the configuration
/// round, [`Credentials::discover`]): the status endpoint on
/// `listen`, the reconcile loop every `interval_secs`. The cycle running when
/// `shutdown` is cancelled finishes without acting on the remaining pools;
/// then the broker connection and the status endpoint are closed. All of
/// that within one deadline, `opts.shutdown_grace` after the request
/// ([`until_shutdown_deadline`]): what is still running then is aborted
/// and `run` returns.
///
/// # Errors
/// [`RunError`] if the HTTP client cannot be built, the compute API is too
/// old or `listen` cannot be bound; with `once`, if the cycle failed for a
/// pool ([`RunError::OnceFailed`]).
pub async fn run(
    cfg: ControllerConfig,
    creds: Credentials,
    opts: RunOptions,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    tracing::info!(origin = %creds.origin, auth_url = %creds.auth_url, "OpenStack credentials found");
    let microversion = match cfg.openstack.compute_microversion.as_deref() {
        None => None,
        Some(s) => {
            Some(Microversion::parse(s).ok_or_else(|| RunError::Microversion { value: s.into() })?)
        }
    };
    let metrics = Arc::new(Metrics::for_pools(cfg.pools.keys().map(String::as_str)));
    let lock = Arc::new(Leadership::new(cfg.broker.clone(), &cfg.cluster));
    let cloud_tls_insecure = creds.tls.is_insecure();
    let cloud = HttpCloud::new(creds, microversion)
        .map_err(RunError::HttpClient)?
        .with_metrics(metrics.clone());
    // A cloud older than vq needs would answer every request 406 (or, below
    // 2.52 requested, list nothing vq booted): refuse to start. A cloud
    // that cannot be read now is checked again when it answers 406.
    let cloud_answered = tokio::select! {
        checked = cloud.check_compute_version() => match checked {
            Ok(v) => {
                tracing::info!(min = %v.min, max = %v.max, requested = %cloud.microversion(), "compute API microversions");
                true
            }
            Err(e @ CloudError::Microversion { .. }) => return Err(RunError::Cloud(e)),
            Err(e) => {
                tracing::warn!(error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "cannot read the compute API's version document now; it is read again when a request is answered 406");
                false
            }
        },
        _ = shutdown.cancelled() => return Ok(()),
    };
    let limits = tokio::select! {
        l = pool_limits(&cfg, &cloud, cloud_answered) => l,
        _ = shutdown.cancelled() => return Ok(()),
    };
    let token =
        match cfg.jobs.api_token_file.as_deref() {
            None => None,
            Some(path) => Some(crate::jobs::http::read_token(path).map_err(|problem| {
                RunError::JobsToken {
                    path: path.into(),
                    problem,
                }
            })?),
        };
    let jobs = crate::jobs::SharedJobs::default();
    let broker = Broker::new(
        cfg.broker.clone(),
        Topology::new(cfg.cluster.clone()),
        cfg.pools.keys().cloned().collect(),
    )
    .with_job_table(jobs.clone(), cfg.jobs.keep_completed_secs)
    .with_depend_grace(cfg.jobs.depend_grace_secs)
    .with_job_queries(vq_common::jobs::Visibility {
        query_other_jobs: cfg.jobs.query_other_jobs,
        operators: cfg.jobs.operators.clone(),
    })
    .with_pool_limits(limits)
    .with_metrics(metrics.clone())
    .without_demand();
    let interval = Duration::from_secs_f64(cfg.interval_secs);
    let listen = cfg.listen.clone();
    if opts.dry_run {
        tracing::warn!(
            "dry run: the controller observes and plans, logs what it would do, and does nothing"
        );
    }
    let cloud = Gated::new(cloud, Some(lock.clone()));
    let broker = Gated::new(broker, Some(lock.clone()));
    let mut ctl = Controller::new(cfg, cloud, broker)
        .with_metrics(metrics)
        .with_job_table(jobs.clone())
        .with_leadership(lock.clone())
        .with_dry_run(opts.dry_run);
    ctl.status
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .cloud_tls_insecure = cloud_tls_insecure;
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|source| RunError::Listen {
            addr: listen.clone(),
            source,
        })?;
    tracing::info!(listen = %listen, "serving /healthz, /readyz, /status, /metrics and /jobs");
    let http_stop = CancellationToken::new();
    let mut http = tokio::spawn(crate::http::serve(
        listener,
        AppState {
            status: ctl.status.clone(),
            metrics: ctl.metrics.clone(),
            jobs: crate::jobs::http::JobsApi { jobs, token },
            started: ctl.started.into_std(),
        },
        http_stop.clone(),
    ));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut once_failed = Vec::new();
    let work = async {
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.cancelled() => break,
            }
            // A cycle ends on its own after a shutdown request (it acts on
            // nothing more), except one waiting out a broker alarm in a
            // fence: the shutdown deadline bounds that one.
            let s = ctl.cycle(&shutdown).await;
            tracing::debug!(?s, "cycle done");
            if opts.once {
                tracing::info!(ok = ?s.ok, failed = ?s.failed, created = s.created, deleted = s.deleted, "single cycle done");
                once_failed = s.failed;
                break;
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        lock.release().await;
        ctl.broker().inner().close().await;
        http_stop.cancel();
        match (&mut http).await {
            Ok(Err(e)) => tracing::warn!(error = %e, "status endpoint failed"),
            Err(e) => tracing::warn!(error = %e, "status endpoint task failed"),
            Ok(Ok(())) => {}
        }
    };
    if until_shutdown_deadline(work, &shutdown, opts.shutdown_grace)
        .await
        .is_none()
    {
        tracing::warn!(
            grace_secs = opts.shutdown_grace.as_secs_f64(),
            "shutdown deadline passed: aborting the cycle, broker close or status requests still in flight (a cycle waiting out a broker alarm?)"
        );
        http.abort();
    }
    if !once_failed.is_empty() {
        return Err(RunError::OnceFailed { pools: once_failed });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_shutdown_deadline_counts_from_the_request_and_aborts_what_still_runs() {
        let shutdown = CancellationToken::new();
        let grace = Duration::from_secs(30);
        let t0 = Instant::now();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            // The request comes long after the work started.
            tokio::time::sleep(Duration::from_secs(100)).await;
            stop.cancel();
        });
        let out = until_shutdown_deadline(std::future::pending::<()>(), &shutdown, grace).await;
        assert_eq!(out, None, "work that never ends is cut short");
        assert_eq!(Instant::now() - t0, Duration::from_secs(130));
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_ends_within_the_deadline_is_not_cut_short() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let t0 = Instant::now();
        let work = async {
            tokio::time::sleep(Duration::from_secs(29)).await;
            7
        };
        let out = until_shutdown_deadline(work, &shutdown, Duration::from_secs(30)).await;
        assert_eq!(out, Some(7));
        assert_eq!(Instant::now() - t0, Duration::from_secs(29));
        // Without a request there is no deadline at all.
        let idle = CancellationToken::new();
        let long = tokio::time::sleep(Duration::from_secs(3600));
        assert_eq!(
            until_shutdown_deadline(long, &idle, Duration::ZERO).await,
            Some(())
        );
    }
}
