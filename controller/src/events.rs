//! The event book: what the controller heard from agents (heartbeats,
//! delete answers, drained notices) and bridges (demand), stamped with the
//! controller's own monotonic receive time (the agents' clocks are never
//! trusted for liveness), and the consumers that fill it. The broker
//! session ([`crate::broker`]) starts the consumers; each cycle takes a
//! [`Shared::snapshot`]. Job events heard on the same consumer are only
//! counted ([`count_job_event`], `vq_jobs_ended_total`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::{Channel, Consumer};
use tokio::time::Instant;
use vq_common::messages::{DeleteAnswer, Demand, Heartbeat, JobEvent, Message};

use crate::metrics::Metrics;

/// A heartbeat or answer with the controller's receive time.
#[derive(Debug, Clone, Default)]
pub struct AgentRecord {
    /// Last heartbeat and when it arrived.
    pub heartbeat: Option<(Heartbeat, Instant)>,
    /// Last delete answer and when it arrived.
    pub answer: Option<(DeleteAnswer, Instant)>,
    /// Request ids of the ask-deletes this controller sent to the agent,
    /// oldest first, at most [`ASKED_KEPT`]. Soft state: lost on restart,
    /// after which the agent is simply asked again.
    pub asked: Vec<String>,
}

/// Request ids remembered per agent.
pub const ASKED_KEPT: usize = 8;

impl AgentRecord {
    /// Remembers that ask-delete `request_id` was sent (call it before
    /// sending, so an answer cannot arrive first).
    pub fn remember_ask(&mut self, request_id: &str) {
        self.asked.push(request_id.to_string());
        let excess = self.asked.len().saturating_sub(ASKED_KEPT);
        self.asked.drain(..excess);
    }

    /// Whether `request_id` is one this controller sent.
    pub fn asked_for(&self, request_id: &str) -> bool {
        self.asked.iter().any(|r| r == request_id)
    }
}

/// Latest demand per pool with its receive time.
pub type DemandMap = BTreeMap<String, (Demand, Instant)>;

/// Agent records not refreshed for this long are forgotten, seconds.
pub const AGENT_RECORD_TTL_SECS: u64 = 3600;

/// What the event consumers collected.
#[derive(Debug, Default)]
pub struct Shared {
    /// Latest heartbeat and answer per agent id.
    pub agents: BTreeMap<String, AgentRecord>,
    /// Latest demand per pool.
    pub demand: DemandMap,
    /// Since when the event consumer has run without interruption (and
    /// the broker has not blocked the connection).
    pub listening_since: Option<Instant>,
    /// The broker's reason while it blocks this connection
    /// (`connection.blocked`: a memory or disk alarm), else `None`.
    pub blocked: Option<String>,
}

impl Shared {
    /// A copy of the agent and demand state at `now`, with agent records
    /// older than [`AGENT_RECORD_TTL_SECS`] forgotten first.
    pub fn snapshot(&mut self, now: Instant) -> EventSnapshot {
        let ttl = Duration::from_secs(AGENT_RECORD_TTL_SECS);
        self.agents.retain(|_, rec| {
            let last = [
                rec.heartbeat.as_ref().map(|h| h.1),
                rec.answer.as_ref().map(|a| a.1),
            ]
            .into_iter()
            .flatten()
            .max();
            last.is_some_and(|t| now.saturating_duration_since(t) < ttl)
        });
        EventSnapshot {
            agents: self.agents.clone(),
            demand: self.demand.clone(),
            listening_secs: self
                .listening_since
                .map(|t| now.saturating_duration_since(t).as_secs_f64())
                .unwrap_or(0.0),
            job_slots: None,
        }
    }
}

/// Snapshot of the event state at one instant.
#[derive(Debug, Clone, Default)]
pub struct EventSnapshot {
    /// Latest heartbeat and answer per agent id.
    pub agents: BTreeMap<String, AgentRecord>,
    /// Latest demand per pool.
    pub demand: DemandMap,
    /// Seconds the event consumer has run without interruption (0 if it
    /// does not run).
    pub listening_secs: f64,
    /// Per pool, the queued and running jobs' slots from the job table;
    /// `None` while the table is not complete (then demand counts jobs).
    pub job_slots: Option<BTreeMap<String, crate::jobs::slots::PoolSlots>>,
}

/// Remembers that ask-delete `request_id` goes to `agent`, so that only
/// its answer can allow the agent's VM to be deleted.
pub fn remember_ask(shared: &mut Shared, agent: &str, request_id: &str) {
    shared
        .agents
        .entry(agent.to_string())
        .or_default()
        .remember_ask(request_id);
}

/// Records one agent event (by routing key `agent.<pool>.<word>`).
pub fn record_event(shared: &mut Shared, routing_key: &str, body: &[u8], at: Instant) {
    let word = routing_key.rsplit('.').next().unwrap_or_default();
    match word {
        "heartbeat" | "drained" => match Heartbeat::decode(body) {
            Ok(hb) => {
                let rec = shared.agents.entry(hb.agent.clone()).or_default();
                let before = rec
                    .heartbeat
                    .as_ref()
                    .and_then(|(h, _)| h.drain_reason.as_deref());
                if let Some(reason) = hb.drain_reason.as_deref().filter(|r| Some(*r) != before) {
                    tracing::info!(pool = %hb.pool, agent = %hb.agent, state = ?hb.state, reason, "agent drains, by an operator's request");
                }
                rec.heartbeat = Some((hb, at));
            }
            Err(e) => tracing::warn!(routing_key, error = %e, "ignoring a malformed heartbeat"),
        },
        "answer" => match DeleteAnswer::decode(body) {
            Ok(ans) => {
                tracing::info!(
                    pool = %ans.pool, agent = %ans.agent, may_delete = ans.may_delete,
                    running = ans.running.len(), "agent answered ask-delete"
                );
                let rec = shared.agents.entry(ans.agent.clone()).or_default();
                if !rec.asked_for(&ans.request_id) {
                    tracing::warn!(
                        pool = %ans.pool, agent = %ans.agent, request_id = %ans.request_id,
                        "delete answer to a request this controller did not send (restarted?); it never allows a deletion"
                    );
                }
                rec.answer = Some((ans, at));
            }
            Err(e) => tracing::warn!(routing_key, error = %e, "ignoring a malformed delete answer"),
        },
        _ => tracing::debug!(routing_key, "ignoring agent event"),
    }
}

/// Counts one job event (routing key `job.<pool>.<word>`, published by
/// broker user `user_id`) in `metrics`; an event whose routing key does not
/// say what its body says is ignored ([`JobEvent::decode_delivered`]).
pub fn count_job_event(metrics: &Metrics, routing_key: &str, user_id: Option<&str>, body: &[u8]) {
    match JobEvent::decode_delivered(body, routing_key, user_id) {
        Ok(ev) => metrics.job_event(&ev),
        Err(e) => tracing::debug!(routing_key, error = %e, "ignoring a malformed job event"),
    }
}

/// The `message_id`s of the last [`RecentIds::CAPACITY`] job events, so that
/// a retransmitted event (a publish whose confirm was lost is sent again,
/// with the same `message_id`; DESIGN.md "Unknown outcomes") is counted
/// once. Bounded: an id older than the last `CAPACITY` events counts again.
#[derive(Debug, Default)]
pub struct RecentIds {
    order: std::collections::VecDeque<String>,
    seen: std::collections::HashSet<String>,
}

impl RecentIds {
    /// Ids remembered.
    pub const CAPACITY: usize = 65_536;

    /// Whether `id` is new (and remembers it); `None` (an event without
    /// `message_id`) is always new.
    pub fn first_time(&mut self, id: Option<&str>) -> bool {
        let Some(id) = id else {
            return true;
        };
        if self.seen.contains(id) {
            return false;
        }
        if self.order.len() == Self::CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
        self.order.push_back(id.to_string());
        self.seen.insert(id.to_string());
        true
    }
}

pub(crate) async fn consume_events(
    mut consumer: Consumer,
    shared: Arc<StdMutex<Shared>>,
    metrics: Arc<Metrics>,
    _ch: Channel,
) {
    let mut recent = RecentIds::default();
    while let Some(delivery) = consumer.next().await {
        match delivery {
            Ok(d) if d.routing_key.as_str().starts_with("job.") => {
                let id = d.properties.message_id().as_ref().map(|m| m.as_str());
                if !recent.first_time(id) {
                    tracing::debug!(message_id = ?id, "job event retransmitted: counted once");
                    continue;
                }
                let user_id = d.properties.user_id().as_ref().map(|u| u.as_str());
                count_job_event(&metrics, d.routing_key.as_str(), user_id, &d.data);
            }
            Ok(d) => {
                let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
                record_event(&mut s, d.routing_key.as_str(), &d.data, Instant::now());
            }
            Err(e) => {
                tracing::warn!(error = %e, "agent event consumer failed");
                break;
            }
        }
    }
    tracing::warn!("agent event consumer ended; agents are not judged until it runs again");
    shared
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .listening_since = None;
}

/// Follows `connection.blocked`/`unblocked` of the controller's connection:
/// while blocked, agents cannot publish heartbeats either, so nobody is
/// judged by heartbeats (`listening_since` = `None`); when unblocked, the
/// heartbeat grace starts again from that moment.
pub(crate) async fn watch_blocked(
    events: impl futures_util::Stream<Item = lapin::Event>,
    shared: Arc<StdMutex<Shared>>,
) {
    futures_util::pin_mut!(events);
    while let Some(e) = events.next().await {
        let mut sh = shared.lock().unwrap_or_else(|p| p.into_inner());
        match e {
            lapin::Event::ConnectionBlocked(reason) => {
                tracing::warn!(reason = %reason, "the broker blocks publishing (resource alarm): holding all pools, agents are not judged by heartbeats until it ends");
                sh.blocked = Some(reason);
                sh.listening_since = None;
            }
            lapin::Event::ConnectionUnblocked => {
                tracing::info!("the broker accepts publishing again; heartbeat grace restarts now");
                sh.blocked = None;
                sh.listening_since = Some(Instant::now());
            }
            _ => {}
        }
    }
}

pub(crate) async fn consume_demand(
    mut consumer: Consumer,
    shared: Arc<StdMutex<Shared>>,
    _ch: Channel,
) {
    while let Some(delivery) = consumer.next().await {
        let d = match delivery {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "demand consumer failed");
                break;
            }
        };
        match Demand::decode(&d.data) {
            Ok(dem) => {
                tracing::debug!(pool = %dem.pool, queued = dem.queued, running = dem.running, source = %dem.source, "demand");
                shared
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .demand
                    .insert(dem.pool.clone(), (dem, Instant::now()));
            }
            Err(e) => tracing::warn!(error = %e, "ignoring malformed demand"),
        }
        if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
            tracing::warn!(error = %e, "cannot ack demand");
            break;
        }
    }
    tracing::warn!("demand consumer ended");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retransmitted_event_is_counted_once_and_the_memory_is_bounded() {
        let mut r = RecentIds::default();
        assert!(r.first_time(Some("j.1.finished")));
        assert!(!r.first_time(Some("j.1.finished")));
        assert!(r.first_time(None) && r.first_time(None));
        for i in 0..RecentIds::CAPACITY {
            assert!(r.first_time(Some(&format!("other.{i}"))));
        }
        assert_eq!(r.order.len(), RecentIds::CAPACITY);
        assert_eq!(r.seen.len(), RecentIds::CAPACITY);
        // Pushed out by newer ids: counted again.
        assert!(r.first_time(Some("j.1.finished")));
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_and_answers_are_recorded_by_agent() {
        let mut s = Shared::default();
        let t = Instant::now();
        let hb = br#"{"agent":"vq-cms-1","pool":"cms","state":"busy","slots":1,"running":["j"],"is_pull":true,"is_del":false,"idle_secs":0,"interval_secs":10,"at":0}"#;
        record_event(&mut s, "agent.cms.heartbeat", hb, t);
        let ans = br#"{"agent":"vq-cms-1","pool":"cms","request_id":"r","may_delete":false,"running":["j"],"at":0}"#;
        record_event(&mut s, "agent.cms.answer", ans, t);
        record_event(&mut s, "agent.cms.heartbeat", b"not json", t);
        let rec = &s.agents["vq-cms-1"];
        assert_eq!(
            rec.heartbeat.as_ref().unwrap().0.running,
            vec!["j".to_string()]
        );
        assert!(!rec.answer.as_ref().unwrap().0.may_delete);
        assert_eq!(s.agents.len(), 1);
    }
}
