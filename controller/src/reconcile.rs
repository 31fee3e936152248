//! The reconcile loop: every `interval_secs`, for each pool that is not
//! backing off, observe (all or nothing), plan (pure), act, and publish the
//! result on the status page and in the metrics; a failed pool is backed
//! off as [`crate::policy::error_policy`] says, and the leases of lost
//! agents are returned ([`crate::fence`]). The loop keeps only soft
//! state (backoff, cooldown instants, the event map): restarting the
//! controller loses nothing and creates no duplicates.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use vq_common::amqp::AmqpError;
use vq_common::config::{ControllerConfig, Microversion};
use vq_common::messages::unix_now;
use vq_common::topology::Topology;

use crate::act::{act, PoolRef};
use crate::backoff::{PoolBackoff, POOL_BACKOFF};
use crate::broker::Broker;
use crate::error::{CloudError, ObserveError, RunError};
use crate::fence::{self, FenceView};
use crate::http::{AppState, Metrics};
use crate::observe::{assemble, Clock, CreatedWatch};
use crate::openstack::{cluster_tag, CloudApi, Credentials, HttpCloud};
use crate::plan::{plan, Action, Class, Timing};
use crate::policy::{error_policy, CycleError};
use crate::status::{Decision, PoolStatus, ServerStatus, StatusReport, DECISIONS_KEPT};

/// How long a cycle may go on after a shutdown request, seconds.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

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

/// The controller: configuration, clients and soft state.
pub struct Controller<C, B> {
    cfg: ControllerConfig,
    cloud: C,
    broker: B,
    backoff: BTreeMap<String, PoolBackoff>,
    last_scale_down: BTreeMap<String, Instant>,
    last_boot_failure: BTreeMap<String, Instant>,
    /// When this controller first saw each agent registry entry: an agent
    /// is judged by the registry only after a whole heartbeat timeout in it
    /// (a new agent registers before its first heartbeat).
    registry_first_seen: BTreeMap<String, Instant>,
    /// Servers this controller created that no listing has shown yet.
    created_watch: CreatedWatch,
    /// The first ACCESS_REFUSED text the broker gave in the running cycle.
    refused: Option<String>,
    started: Instant,
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
            last_scale_down: BTreeMap::new(),
            last_boot_failure: BTreeMap::new(),
            registry_first_seen: BTreeMap::new(),
            created_watch: CreatedWatch::default(),
            refused: None,
            started: Instant::now(),
            status: Arc::new(RwLock::new(status)),
            metrics: Arc::new(Metrics::new()),
        }
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
        if next.permanent {
            tracing::error!(pool, error = %chain, retry_in_secs = delay.as_secs_f64(), attempts = b.attempts(), "permanent error; check the pool's configuration, the cloud and the broker account");
        } else {
            tracing::warn!(pool, error = %chain, retry_in_secs = delay.as_secs_f64(), attempts = b.attempts(), "pool cycle failed; backing off");
        }
        let mut st = self.status.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ps) = st.pools.get_mut(pool) {
            ps.last_error = Some(chain);
        }
    }

    /// Records `e` if the broker refused it for lack of a permission
    /// ([`AmqpError::access_refused`]): the cycle then counts as failed
    /// for lack of permission (`/healthz` 503, `/status`
    /// `broker_access_refused`).
    fn note_broker_error(&mut self, e: &AmqpError) {
        if let Some(text) = e.access_refused() {
            if self.refused.is_none() {
                tracing::error!(refused = %text, "the broker refused an operation: the controller's account lacks a permission (README.md, \"Broker accounts and trust\"); /healthz reports 503");
                self.refused = Some(text);
            }
        }
    }

    /// Runs one cycle. With `shutdown` cancelled, observes and plans but
    /// does not act. A cycle that touched the broker sets or clears
    /// [`StatusReport::broker_access_refused`].
    pub async fn cycle(&mut self, shutdown: &CancellationToken) -> CycleSummary {
        self.refused = None;
        let summary = self.cycle_inner(shutdown).await;
        let ran = !(summary.ok.is_empty() && summary.failed.is_empty() && summary.held.is_empty());
        if ran {
            let refused = self.refused.take();
            self.status
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .broker_access_refused = refused;
        }
        summary
    }

    async fn cycle_inner(&mut self, shutdown: &CancellationToken) -> CycleSummary {
        let now = Instant::now();
        let mut summary = CycleSummary::default();
        let pools: Vec<String> = self.cfg.pools.keys().cloned().collect();
        let ready: Vec<String> = pools
            .iter()
            .filter(|p| self.backoff[*p].ready(now))
            .cloned()
            .collect();
        summary.skipped = pools
            .iter()
            .filter(|p| !ready.contains(p))
            .cloned()
            .collect();
        if ready.is_empty() {
            return summary;
        }
        if let Err(e) = self.broker.ensure_connected().await {
            self.note_broker_error(&e);
            let e = ObserveError::Broker(e);
            for p in &ready {
                self.fail_pool(p, now, CycleError::Observe(&e));
            }
            summary.failed = ready;
            return summary;
        }
        // During a broker alarm agents cannot publish heartbeats or answers:
        // nothing is judged or acted on until it ends (no backoff: the
        // alarm is not this controller's failure).
        let probed = match self.broker.blocked() {
            Some(reason) => Err(reason),
            // A probe stuck behind an alarm another publish raised ends in
            // a timeout: the blocked flag, set meanwhile, decides.
            None => match (self.broker.probe().await, self.broker.blocked()) {
                (_, Some(reason)) => Err(reason),
                (Ok(()), None) => Ok(()),
                (Err(e), None) => {
                    self.note_broker_error(&e);
                    let e = ObserveError::Probe(e);
                    for p in &ready {
                        self.fail_pool(p, now, CycleError::Observe(&e));
                    }
                    summary.failed = ready;
                    return summary;
                }
            },
        };
        if let Err(reason) = probed {
            self.metrics.broker_blocked.set(1);
            tracing::info!(reason = %reason, "broker alarm: holding every pool this cycle");
            let mut st = self.status.write().unwrap_or_else(|p| p.into_inner());
            for p in &ready {
                if let Some(ps) = st.pools.get_mut(p) {
                    ps.last_error = Some(format!(
                        "the broker blocks publishing ({reason}): holding, no VM booted or deleted"
                    ));
                }
            }
            summary.held = ready;
            return summary;
        }
        self.metrics.broker_blocked.set(0);
        // Read before the server list: an agent registers from its server,
        // so every registered agent whose server exists is in that list.
        let registered = match self.broker.registered_agents().await {
            Ok(r) => Some(r),
            Err(e) => {
                self.note_broker_error(&e);
                tracing::warn!(error = %e, "cannot read the agent registry; orphaned leases are looked for next cycle");
                None
            }
        };
        let servers = match self
            .cloud
            .list_servers(&cluster_tag(&self.cfg.cluster))
            .await
        {
            Ok(s) => s,
            Err(e) => {
                self.metrics.cloud_errors.inc();
                let e = ObserveError::Servers(e);
                for p in &ready {
                    self.fail_pool(p, now, CycleError::Observe(&e));
                }
                summary.failed = ready;
                return summary;
            }
        };
        let mut quota = match self.cloud.quota().await {
            Ok(q) => q.remaining(),
            Err(e) => {
                self.metrics.cloud_errors.inc();
                tracing::warn!(error = %e, "cannot read the instance quota; booting nothing this cycle");
                Some(0)
            }
        };
        let events = self.broker.snapshot(now);
        let clock = Clock {
            now,
            unix_now: unix_now(),
            listening_secs: events
                .listening_secs
                .min(now.saturating_duration_since(self.started).as_secs_f64()),
        };
        let timing = Timing {
            heartbeat_timeout_secs: self.cfg.heartbeat_timeout_secs,
        };
        for pool in ready {
            let depth = match self.broker.queue_depth(&pool).await {
                Ok(d) => d,
                Err(source) => {
                    self.note_broker_error(&source);
                    let e = ObserveError::QueueDepth {
                        queue: Topology::new(self.cfg.cluster.clone()).pool_queue(&pool),
                        source,
                    };
                    self.fail_pool(&pool, now, CycleError::Observe(&e));
                    summary.failed.push(pool);
                    continue;
                }
            };
            let pool_cfg = self.cfg.pools[&pool].clone();
            let mut observed = assemble(
                &self.cfg.cluster,
                &pool,
                &servers,
                &events.agents,
                events.demand.get(&pool),
                depth,
                quota,
                clock,
            );
            let since = |m: &BTreeMap<String, Instant>| {
                m.get(&pool)
                    .map(|t| now.saturating_duration_since(*t).as_secs_f64())
            };
            observed.since_scale_down_secs = since(&self.last_scale_down);
            observed.since_boot_failure_secs = since(&self.last_boot_failure);
            (observed.unlisted_created, observed.boot_obstacle) = self.created_watch.listed(
                &pool,
                observed.servers.iter().map(|s| s.id.as_str()),
                pool_cfg.boot_timeout_secs,
                now,
            );
            let was_stopped = self
                .status
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .pools
                .get(&pool)
                .is_some_and(|ps| ps.obstacle.is_some());
            match (&observed.boot_obstacle, was_stopped) {
                (Some(why), false) => {
                    tracing::warn!(pool = %pool, reason = %why, "boots stopped")
                }
                (None, true) => {
                    tracing::info!(pool = %pool, "created servers listed again: boots resume")
                }
                _ => {}
            }
            let planned = plan(&observed, &pool_cfg, timing);
            for h in &planned.held {
                tracing::info!(pool = %pool, reason = %h, "held back");
            }
            tracing::debug!(pool = %pool, target = planned.target, active = planned.active, booting = planned.booting, queued = observed.queued, running = observed.running, "planned");
            self.publish_status(&pool, &observed, &planned);
            if shutdown.is_cancelled() {
                if !planned.actions.is_empty() {
                    tracing::info!(pool = %pool, actions = planned.actions.len(), "shutting down: not acting");
                }
                summary.ok.push(pool);
                continue;
            }
            let report = act(
                PoolRef {
                    cluster: &self.cfg.cluster,
                    name: &pool,
                    cfg: &pool_cfg,
                    loss_limit: self.cfg.loss_limit,
                },
                &planned.actions,
                &self.cloud,
                &self.broker,
            )
            .await;
            if let Some(q) = quota.as_mut() {
                *q = q.saturating_sub(report.created.len() as u32);
            }
            let created_at = Instant::now();
            for (name, id) in &report.created {
                self.created_watch.created(&pool, id, name, created_at);
            }
            summary.created += report.created.len() as u32;
            summary.deleted += report.deleted.len() as u32;
            self.metrics
                .created
                .get_or_create(&Metrics::pool(&pool))
                .inc_by(report.created.len() as u64);
            for (_, cause) in &report.deleted {
                self.metrics
                    .deleted
                    .get_or_create(&Metrics::pool_and(&pool, "reason", cause.label()))
                    .inc();
            }
            if !report.asked.is_empty() {
                self.last_scale_down.insert(pool.clone(), now);
            }
            if report.boot_failed {
                self.last_boot_failure.insert(pool.clone(), now);
            }
            let cloud_errors = report
                .errors
                .iter()
                .filter(|e| {
                    matches!(
                        e,
                        crate::error::ActError::Create { .. }
                            | crate::error::ActError::Delete { .. }
                            | crate::error::ActError::Resolve { .. }
                    )
                })
                .count();
            self.metrics.cloud_errors.inc_by(cloud_errors as u64);
            for e in &report.errors {
                if let crate::error::ActError::Control { source, .. } = e {
                    self.note_broker_error(source);
                }
            }
            match report.errors.first() {
                Some(e) => {
                    self.fail_pool(&pool, now, CycleError::Act(e));
                    summary.failed.push(pool);
                }
                None => {
                    self.backoff.get_mut(&pool).expect("pool").succeeded();
                    summary.ok.push(pool);
                }
            }
        }
        if !shutdown.is_cancelled() {
            fence::note_registry(&mut self.registry_first_seen, registered.as_deref(), now);
            let in_nova: BTreeSet<&str> = servers.iter().map(|s| s.name.as_str()).collect();
            let pools: BTreeSet<&str> = self.cfg.pools.keys().map(String::as_str).collect();
            let view = FenceView {
                in_nova: &in_nova,
                registered: registered.as_deref(),
                events: &events,
                registry_first_seen: &self.registry_first_seen,
                listening_secs: clock.listening_secs,
                now,
                timeout_secs: self.cfg.heartbeat_timeout_secs,
            };
            let out = fence::fence_step(&self.broker, &view, &pools, self.cfg.loss_limit).await;
            for e in &out.errors {
                self.note_broker_error(e);
            }
            summary.fenced = out.fenced;
        }
        summary
    }

    fn publish_status(
        &self,
        pool: &str,
        observed: &crate::observe::Observed,
        planned: &crate::plan::Plan,
    ) {
        let mut vms = crate::status::VmCounts::default();
        let mut agents = crate::status::AgentCounts::default();
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
                    crate::observe::NovaStatus::Build => "BUILD".into(),
                    crate::observe::NovaStatus::Active => "ACTIVE".into(),
                    crate::observe::NovaStatus::Error => "ERROR".into(),
                    crate::observe::NovaStatus::Deleting => "DELETING".into(),
                    crate::observe::NovaStatus::Other(o) => o.clone(),
                },
                agent_state: c.agent_state().into(),
                running: s.agent.as_ref().map(|a| a.running).unwrap_or(0),
            });
        }
        let m = &self.metrics;
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
        let mut st = self.status.write().unwrap_or_else(|p| p.into_inner());
        st.generated_at = now;
        st.uptime_secs = self.started.elapsed().as_secs_f64();
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
}

/// Options of [`run`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Run one cycle, then return.
    pub once: bool,
}

/// Runs the controller until `shutdown` is cancelled (or one cycle with
/// `once`): credentials from clouds.yaml/`OS_*`, the status endpoint on
/// `listen`, the reconcile loop every `interval_secs`. The cycle running when
/// `shutdown` is cancelled finishes without acting on the remaining pools;
/// then the broker connection is closed.
///
/// # Errors
/// [`RunError`] if the credentials are missing, the HTTP client cannot be
/// built or `listen` cannot be bound.
pub async fn run(
    cfg: ControllerConfig,
    opts: RunOptions,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let env = |k: &str| std::env::var(k).ok();
    let creds = Credentials::discover(&cfg.openstack, &env)?;
    tracing::info!(origin = %creds.origin, auth_url = %creds.auth_url, "OpenStack credentials found");
    let microversion = match cfg.openstack.compute_microversion.as_deref() {
        None => None,
        Some(s) => {
            Some(Microversion::parse(s).ok_or_else(|| RunError::Microversion { value: s.into() })?)
        }
    };
    let cloud = HttpCloud::new(creds, microversion).map_err(RunError::HttpClient)?;
    // A cloud older than vq needs would answer every request 406 (or, below
    // 2.52 requested, list nothing vq booted): refuse to start. A cloud
    // that cannot be read now is checked again when it answers 406.
    tokio::select! {
        checked = cloud.check_compute_version() => match checked {
            Ok(v) => tracing::info!(min = %v.min, max = %v.max, requested = %cloud.microversion(), "compute API microversions"),
            Err(e @ CloudError::Microversion { .. }) => return Err(RunError::Cloud(e)),
            Err(e) => tracing::warn!(error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "cannot read the compute API's version document now; it is read again when a request is answered 406"),
        },
        _ = shutdown.cancelled() => return Ok(()),
    }
    let broker = Broker::new(
        cfg.broker.clone(),
        Topology::new(cfg.cluster.clone()),
        cfg.pools.keys().cloned().collect(),
    );
    let interval = Duration::from_secs_f64(cfg.interval_secs);
    let listen = cfg.listen.clone();
    let mut ctl = Controller::new(cfg, cloud, broker);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|source| RunError::Listen {
            addr: listen.clone(),
            source,
        })?;
    tracing::info!(listen = %listen, "serving /healthz, /status and /metrics");
    let http_stop = CancellationToken::new();
    let http = tokio::spawn(crate::http::serve(
        listener,
        AppState {
            status: ctl.status.clone(),
            metrics: ctl.metrics.clone(),
        },
        http_stop.clone(),
    ));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        // A cycle ends on its own after a shutdown request (it acts on
        // nothing more), except one waiting out a broker alarm in a fence:
        // that one is given SHUTDOWN_GRACE.
        let cycle = ctl.cycle(&shutdown);
        tokio::pin!(cycle);
        let s = tokio::select! {
            s = &mut cycle => s,
            _ = async {
                shutdown.cancelled().await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } => {
                tracing::warn!(grace_secs = SHUTDOWN_GRACE.as_secs(), "the cycle did not end after the shutdown request (waiting out a broker alarm?); stopping it");
                break;
            }
        };
        tracing::debug!(?s, "cycle done");
        if opts.once {
            tracing::info!(ok = ?s.ok, failed = ?s.failed, created = s.created, deleted = s.deleted, "single cycle done");
            break;
        }
        if shutdown.is_cancelled() {
            break;
        }
    }
    ctl.broker().close().await;
    http_stop.cancel();
    match http.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "status endpoint failed"),
        Err(e) => tracing::warn!(error = %e, "status endpoint task failed"),
        Ok(Ok(())) => {}
    }
    Ok(())
}
