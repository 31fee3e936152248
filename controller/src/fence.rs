//! Fencing (DESIGN.md, "Leases: fence, then requeue"): which agents to
//! mark as lost (a pure decision, [`to_mark`]) and the step of a cycle
//! that marks them and returns the leases of every marked agent whose
//! server is gone ([`fence_step`]). The broker primitives (the fence
//! queue, emptying a lease queue) stay in [`crate::broker`].
//!
//! Agents are marked when their server is deleted ([`crate::act`]) and
//! here when they have no server at all: agents of our pools that stopped
//! heartbeating, and registered agents never heard. Orphans are judged
//! only after the controller has listened for a whole heartbeat timeout,
//! on its own receive times, and registry entries only after a whole
//! heartbeat timeout in the registry (a new agent registers before its
//! first heartbeat).

use std::collections::{BTreeMap, BTreeSet};

use tokio::time::Instant;
use vq_common::amqp::AmqpError;

use crate::broker::{BrokerApi, EventSnapshot};

/// Why an agent without a server is marked for fencing.
#[derive(Debug, Clone, PartialEq)]
pub enum MarkReason {
    /// Its heartbeats stopped `age_secs` ago, longer than the timeout.
    HeartbeatStopped {
        /// The agent's pool (from its last heartbeat).
        pool: String,
        /// Seconds since its last heartbeat was received.
        age_secs: f64,
    },
    /// It is in the agent registry but was never heard while the
    /// controller listened for a whole heartbeat timeout.
    RegisteredUnheard {
        /// The pool of its registry entry.
        pool: String,
    },
}

/// What [`to_mark`] looks at.
#[derive(Debug, Clone, Copy)]
pub struct FenceView<'a> {
    /// Names of every server of the cluster in the Nova listing.
    pub in_nova: &'a BTreeSet<&'a str>,
    /// The agent registry `(agent, pool)`, if it could be read.
    pub registered: Option<&'a [(String, String)]>,
    /// Agent events heard.
    pub events: &'a EventSnapshot,
    /// When this controller first saw each registry entry.
    pub registry_first_seen: &'a BTreeMap<String, Instant>,
    /// Seconds the controller has listened to agent events without a
    /// break (the cycle's clock).
    pub listening_secs: f64,
    /// The cycle's instant.
    pub now: Instant,
    /// `heartbeat_timeout_secs`.
    pub timeout_secs: f64,
}

/// Agents without a server to mark for fencing, with the reason; only
/// agents of `pools` (other controllers' pools are theirs to judge).
/// Nothing before the controller has listened a whole heartbeat timeout.
pub fn to_mark<P: Ord + std::borrow::Borrow<str>>(
    v: &FenceView<'_>,
    pools: &BTreeSet<P>,
) -> Vec<(String, MarkReason)> {
    let mut out = Vec::new();
    if v.listening_secs < v.timeout_secs {
        return out;
    }
    for (agent, rec) in &v.events.agents {
        let Some((hb, at)) = &rec.heartbeat else {
            continue;
        };
        let age = v.now.saturating_duration_since(*at).as_secs_f64();
        if pools.contains(hb.pool.as_str())
            && !v.in_nova.contains(agent.as_str())
            && age > v.timeout_secs
        {
            out.push((
                agent.clone(),
                MarkReason::HeartbeatStopped {
                    pool: hb.pool.clone(),
                    age_secs: age,
                },
            ));
        }
    }
    // Agents registered but not heard during a whole heartbeat timeout of
    // listening, and without a server: their server vanished while no
    // controller listened (or was deleted by someone else). Their leases
    // would otherwise stay forever.
    for (agent, pool) in v.registered.unwrap_or_default() {
        let in_registry = v
            .registry_first_seen
            .get(agent)
            .map_or(0.0, |t| v.now.saturating_duration_since(*t).as_secs_f64());
        if !pools.contains(pool.as_str())
            || v.in_nova.contains(agent.as_str())
            || v.events.agents.contains_key(agent)
            || in_registry <= v.timeout_secs
        {
            // Heard agents are judged above, by their heartbeat age; a new
            // agent registers before its first heartbeat.
            continue;
        }
        out.push((
            agent.clone(),
            MarkReason::RegisteredUnheard { pool: pool.clone() },
        ));
    }
    out
}

/// Keeps `first_seen` to the entries of `registered` (when it was read),
/// stamping new ones with `now`.
pub fn note_registry(
    first_seen: &mut BTreeMap<String, Instant>,
    registered: Option<&[(String, String)]>,
    now: Instant,
) {
    if let Some(reg) = registered {
        first_seen.retain(|a, _| reg.iter().any(|(r, _)| r == a));
        for (agent, _) in reg {
            first_seen.entry(agent.clone()).or_insert(now);
        }
    }
}

/// What one [`fence_step`] did.
#[derive(Debug, Default)]
pub struct FenceOutcome {
    /// Agents whose leases were returned (their server is gone).
    pub fenced: Vec<String>,
    /// Jobs of those agents returned to their pool: (job id, pool).
    pub requeued: Vec<(String, String)>,
    /// Broker errors met (the caller notes refused permissions); each was
    /// logged, and what failed is retried next cycle.
    pub errors: Vec<AmqpError>,
}

/// The fence step of a cycle: marks the agents [`to_mark`] names, then
/// returns the leases (with `loss_limit`) of every agent in the fence
/// queue whose server is not in the listing.
pub async fn fence_step<B: BrokerApi, P: Ord + std::borrow::Borrow<str>>(
    broker: &B,
    view: &FenceView<'_>,
    pools: &BTreeSet<P>,
    loss_limit: u32,
) -> FenceOutcome {
    let mut out = FenceOutcome::default();
    tracing::debug!(
        agents = view.events.agents.len(),
        listening_secs = view.listening_secs,
        "fence step"
    );
    for (agent, why) in to_mark(view, pools) {
        match &why {
            MarkReason::HeartbeatStopped { pool, age_secs } => {
                tracing::warn!(pool = %pool, agent = %agent, heartbeat_age_secs = age_secs, timeout_secs = view.timeout_secs,
                    "agent without a server stopped heartbeating: fencing it")
            }
            MarkReason::RegisteredUnheard { pool } => {
                tracing::warn!(pool = %pool, agent = %agent, listening_secs = view.listening_secs, timeout_secs = view.timeout_secs,
                    "registered agent without a server, not heard since the controller listens: fencing it")
            }
        }
        if let Err(e) = broker.mark_fence(&agent).await {
            tracing::warn!(agent = %agent, error = %e, "cannot record the fence");
            out.errors.push(e);
        }
    }
    let pending = match broker.pending_fences().await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the fence queue; leases are returned next cycle");
            out.errors.push(e);
            return out;
        }
    };
    for agent in pending {
        if view.in_nova.contains(agent.as_str()) {
            tracing::debug!(agent = %agent, "fence pending: server not gone yet");
            continue;
        }
        match broker.fence(&agent, loss_limit).await {
            Ok(r) => {
                if !r.requeued.is_empty() || !r.failed.is_empty() {
                    tracing::warn!(agent = %agent, requeued = ?r.requeued, failed = ?r.failed, "returned the leases of a lost agent");
                }
                out.requeued.extend(r.requeued);
                out.fenced.push(agent);
            }
            Err(e) => {
                tracing::warn!(agent = %agent, error = %e, "cannot return the leases of a lost agent; retrying next cycle");
                out.errors.push(e);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::AgentRecord;
    use std::time::Duration;
    use vq_common::messages::Heartbeat;

    fn heartbeat(agent: &str, pool: &str) -> Heartbeat {
        serde_json::from_str(&format!(
            r#"{{"agent":"{agent}","pool":"{pool}","state":"busy","slots":1,"running":["j"],"is_pull":true,"is_del":false,"idle_secs":0,"interval_secs":10,"at":0}}"#
        ))
        .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn only_silent_agents_of_our_pools_without_a_server_are_marked() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(1000)).await;
        let now = Instant::now();
        let mut events = EventSnapshot::default();
        for (agent, pool, at) in [
            ("silent", "cms", t0),
            ("fresh", "cms", now),
            ("listed", "cms", t0),
            ("foreign", "atlas", t0),
        ] {
            events.agents.insert(
                agent.into(),
                AgentRecord {
                    heartbeat: Some((heartbeat(agent, pool), at)),
                    ..AgentRecord::default()
                },
            );
        }
        let in_nova: BTreeSet<&str> = ["listed"].into();
        let registered = vec![
            ("reg-old".to_string(), "cms".to_string()),
            ("reg-new".to_string(), "cms".to_string()),
            ("silent".to_string(), "cms".to_string()),
        ];
        let first_seen: BTreeMap<String, Instant> =
            [("reg-old".to_string(), t0), ("reg-new".to_string(), now)].into();
        let pools: BTreeSet<&str> = ["cms"].into();
        let view = FenceView {
            in_nova: &in_nova,
            registered: Some(&registered),
            events: &events,
            registry_first_seen: &first_seen,
            listening_secs: 1000.0,
            now,
            timeout_secs: 60.0,
        };
        let marked: Vec<String> = to_mark(&view, &pools).into_iter().map(|m| m.0).collect();
        assert_eq!(marked, vec!["silent".to_string(), "reg-old".to_string()]);
        // Not before a whole timeout of listening.
        let early = FenceView {
            listening_secs: 59.0,
            ..view
        };
        assert!(to_mark(&early, &pools).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn registry_entries_are_stamped_once_and_forgotten_when_gone() {
        let t0 = Instant::now();
        let mut seen = BTreeMap::new();
        let reg = vec![("a".to_string(), "cms".to_string())];
        note_registry(&mut seen, Some(&reg), t0);
        tokio::time::advance(Duration::from_secs(5)).await;
        note_registry(&mut seen, Some(&reg), Instant::now());
        assert_eq!(seen["a"], t0);
        note_registry(&mut seen, None, Instant::now());
        assert_eq!(seen.len(), 1, "an unread registry changes nothing");
        note_registry(&mut seen, Some(&[]), Instant::now());
        assert!(seen.is_empty());
    }
}
