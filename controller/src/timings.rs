//! Boot and drain timings for the histograms of [`crate::metrics`]: the
//! servers this controller created and the agents it asked to be deleted,
//! followed through the pool's observations (soft state, like the rest of
//! the loop's memory: a restarted controller times only what it does
//! after the restart). Times are taken at observation (the listing that
//! shows a server ACTIVE) or at receipt (heartbeats, answers), on the
//! controller's monotonic clock, so they are as fine as `interval_secs`
//! for the Nova side.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::observe::{NovaStatus, Observed};

/// Entries older than this are forgotten (a server that never became
/// ACTIVE, an ask never answered), seconds.
pub const TIMINGS_KEPT_SECS: u64 = 3600;

#[derive(Debug, Clone)]
struct Boot {
    created_at: Instant,
    active_at: Option<Instant>,
}

/// What is being timed (see the module doc).
#[derive(Debug, Default)]
pub struct Timings {
    /// Created servers by id.
    boots: BTreeMap<String, Boot>,
    /// Ask-deletes by agent: when the last one was sent.
    asks: BTreeMap<String, Instant>,
    /// Ask-deletes by agent not answered yet: since when the agent has been
    /// asked (the first ask of an unbroken run of asks), and whether it
    /// was reported as unanswered ([`Timings::unanswered`]).
    waiting: BTreeMap<String, Waiting>,
}

#[derive(Debug, Clone, Copy)]
struct Waiting {
    since: Instant,
    reported: bool,
}

/// An agent that keeps heartbeating but has not answered the controller's
/// ask-delete ([`Timings::unanswered`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Unanswered {
    /// Agent id (the server name).
    pub agent: String,
    /// Seconds since the first ask of the run.
    pub asked_secs: f64,
}

impl Timings {
    /// Server `id` was created at `at` (the create's response).
    pub fn created(&mut self, id: &str, at: Instant) {
        self.boots.insert(
            id.to_string(),
            Boot {
                created_at: at,
                active_at: None,
            },
        );
    }

    /// Agent `agent` was asked whether it may be deleted at `at`.
    pub fn asked(&mut self, agent: &str, at: Instant) {
        self.asks.insert(agent.to_string(), at);
        self.waiting.entry(agent.to_string()).or_insert(Waiting {
            since: at,
            reported: false,
        });
    }

    /// The agents of `observed` that were asked whether they may be deleted
    /// more than `after` ago, have heartbeated since without answering any
    /// ask, and were not reported yet: each is returned once per run of
    /// asks. An agent answers an ask-delete only from a broker user in its
    /// `control_admins` (the controller's account must be there), and an
    /// agent older than the ask-delete protocol never does; both keep
    /// heartbeating, so without this report the pool would ask for ever
    /// with nothing in the log. Call after [`Timings::observed`], which
    /// ends a run when the answer comes.
    pub fn unanswered(
        &mut self,
        observed: &Observed,
        now: Instant,
        after: Duration,
    ) -> Vec<Unanswered> {
        let mut out = Vec::new();
        for s in &observed.servers {
            let (Some(w), Some(a)) = (self.waiting.get_mut(&s.name), &s.agent) else {
                continue;
            };
            let heard = now
                .checked_sub(Duration::from_secs_f64(a.heartbeat_age_secs.max(0.0)))
                .unwrap_or(now);
            let waited = now.saturating_duration_since(w.since);
            if !w.reported && waited > after && heard > w.since + after {
                w.reported = true;
                out.push(Unanswered {
                    agent: s.name.clone(),
                    asked_secs: waited.as_secs_f64(),
                });
            }
        }
        out
    }

    /// Takes one complete observation of a pool made at `now`: observes
    /// create → ACTIVE (`vq_boot_active_duration_seconds`), ACTIVE → first
    /// heartbeat (`vq_boot_heartbeat_duration_seconds`) and ask-delete →
    /// answer (`vq_drain_handshake_duration_seconds`) for what it shows.
    pub fn observed(&mut self, metrics: &Metrics, observed: &Observed, now: Instant) {
        let labels = Metrics::pool(&observed.pool);
        let received = |age_secs: f64| {
            now.checked_sub(Duration::from_secs_f64(age_secs.max(0.0)))
                .unwrap_or(now)
        };
        for s in &observed.servers {
            if let Some(b) = self.boots.get_mut(&s.id) {
                match s.status {
                    NovaStatus::Active if b.active_at.is_none() => {
                        metrics
                            .boot_active
                            .get_or_create(&labels)
                            .observe(now.saturating_duration_since(b.created_at).as_secs_f64());
                        b.active_at = Some(now);
                    }
                    NovaStatus::Error | NovaStatus::Deleting => {
                        self.boots.remove(&s.id);
                        continue;
                    }
                    _ => {}
                }
                if let (Some(active), Some(a)) = (b.active_at, &s.agent) {
                    let first = received(a.heartbeat_age_secs);
                    metrics
                        .boot_heartbeat
                        .get_or_create(&labels)
                        .observe(first.saturating_duration_since(active).as_secs_f64());
                    self.boots.remove(&s.id);
                }
            }
            let answered = s
                .agent
                .as_ref()
                .and_then(|a| a.answer.as_ref())
                .filter(|ans| ans.matched);
            if let (Some(asked), Some(ans)) = (self.asks.get(&s.name).copied(), answered) {
                let at = received(ans.age_secs);
                if at >= asked {
                    metrics
                        .drain_handshake
                        .get_or_create(&labels)
                        .observe(at.saturating_duration_since(asked).as_secs_f64());
                    self.asks.remove(&s.name);
                    self.waiting.remove(&s.name);
                }
            }
        }
        let kept = Duration::from_secs(TIMINGS_KEPT_SECS);
        self.waiting
            .retain(|_, w| now.saturating_duration_since(w.since) < kept);
        self.boots
            .retain(|_, b| now.saturating_duration_since(b.created_at) < kept);
        self.asks
            .retain(|_, t| now.saturating_duration_since(*t) < kept);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::{AgentSeen, AnswerSeen, ObservedServer};
    use vq_common::messages::AgentState;

    fn server(status: NovaStatus, agent: Option<AgentSeen>) -> ObservedServer {
        ObservedServer {
            id: "id-1".into(),
            name: "vq-cms-1".into(),
            status,
            age_secs: None,
            agent,
        }
    }

    fn agent(hb_age: f64, answer: Option<AnswerSeen>) -> AgentSeen {
        AgentSeen {
            heartbeat_age_secs: hb_age,
            state: AgentState::Idle,
            running: 0,
            jobs: vec![],
            slots: 1,
            is_del: false,
            idle_secs: 0.0,
            answer,
            drain_reason: None,
        }
    }

    fn pool(servers: Vec<ObservedServer>) -> Observed {
        Observed {
            pool: "cms".into(),
            servers,
            ..Default::default()
        }
    }

    fn sum_count(text: &str, name: &str) -> (String, String) {
        let find = |suffix: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{name}_{suffix}{{pool=\"cms\"}}")))
                .and_then(|l| l.split_whitespace().nth(1))
                .unwrap_or("-")
                .to_string()
        };
        (find("sum"), find("count"))
    }

    /// An agent that heartbeats on but never answers the ask-delete (the
    /// controller's account missing from its `control_admins`) is reported
    /// once, after the wait, and again only in a new run of asks.
    #[tokio::test(start_paused = true)]
    async fn an_agent_that_heartbeats_but_never_answers_an_ask_is_reported_once() {
        let m = Metrics::new();
        let mut t = Timings::default();
        let after = Duration::from_secs(10);
        let silent = || pool(vec![server(NovaStatus::Active, Some(agent(0.5, None)))]);
        t.asked("vq-cms-1", Instant::now());
        for _ in 0..9 {
            tokio::time::advance(Duration::from_secs(1)).await;
            t.asked("vq-cms-1", Instant::now());
            t.observed(&m, &silent(), Instant::now());
            assert_eq!(t.unanswered(&silent(), Instant::now(), after), vec![]);
        }
        // A heartbeat from before the wait ended says nothing yet.
        tokio::time::advance(Duration::from_secs(2)).await;
        let quiet = pool(vec![server(NovaStatus::Active, Some(agent(5.0, None)))]);
        assert_eq!(t.unanswered(&quiet, Instant::now(), after), vec![]);
        let out = t.unanswered(&silent(), Instant::now(), after);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].agent, "vq-cms-1");
        assert!((out[0].asked_secs - 11.0).abs() < 1e-6, "{out:?}");
        tokio::time::advance(Duration::from_secs(5)).await;
        t.asked("vq-cms-1", Instant::now());
        assert_eq!(
            t.unanswered(&silent(), Instant::now(), after),
            vec![],
            "once"
        );
        // An answer ends the run; a new run is reported again.
        let answered = server(
            NovaStatus::Active,
            Some(agent(
                0.5,
                Some(AnswerSeen {
                    age_secs: 0.5,
                    may_delete: false,
                    running: 1,
                    matched: true,
                }),
            )),
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        t.observed(&m, &pool(vec![answered]), Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        t.asked("vq-cms-1", Instant::now());
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(t.unanswered(&silent(), Instant::now(), after).len(), 1);
        // An agent that answers in time is never reported.
        let mut t = Timings::default();
        t.asked("vq-cms-1", Instant::now());
        tokio::time::advance(Duration::from_secs(2)).await;
        let ok = server(
            NovaStatus::Active,
            Some(agent(
                0.5,
                Some(AnswerSeen {
                    age_secs: 0.5,
                    may_delete: true,
                    running: 0,
                    matched: true,
                }),
            )),
        );
        t.observed(&m, &pool(vec![ok]), Instant::now());
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(t.unanswered(&silent(), Instant::now(), after), vec![]);
    }

    #[tokio::test(start_paused = true)]
    async fn boots_are_timed_to_active_and_to_the_first_heartbeat_and_asks_to_their_answer() {
        let m = Metrics::new();
        let mut t = Timings::default();
        let t0 = Instant::now();
        t.created("id-1", t0);
        tokio::time::advance(Duration::from_secs(10)).await;
        t.observed(
            &m,
            &pool(vec![server(NovaStatus::Build, None)]),
            Instant::now(),
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        t.observed(
            &m,
            &pool(vec![server(NovaStatus::Active, None)]),
            Instant::now(),
        );
        tokio::time::advance(Duration::from_secs(8)).await;
        // The heartbeat arrived 3 s before this observation: 5 s after ACTIVE.
        let up = server(NovaStatus::Active, Some(agent(3.0, None)));
        t.observed(&m, &pool(vec![up.clone()]), Instant::now());
        t.observed(&m, &pool(vec![up]), Instant::now());
        let text = m.render();
        assert_eq!(
            sum_count(&text, "vq_boot_active_duration_seconds"),
            ("30.0".into(), "1".into()),
            "{text}"
        );
        assert_eq!(
            sum_count(&text, "vq_boot_heartbeat_duration_seconds"),
            ("5.0".into(), "1".into()),
            "timed once: {text}"
        );

        let asked = Instant::now();
        t.asked("vq-cms-1", asked);
        tokio::time::advance(Duration::from_secs(4)).await;
        let answer = |age, matched| AnswerSeen {
            age_secs: age,
            may_delete: true,
            running: 0,
            matched,
        };
        // An answer to another request, or from before the ask, is no answer.
        let stale = server(
            NovaStatus::Active,
            Some(agent(1.0, Some(answer(1.0, false)))),
        );
        t.observed(&m, &pool(vec![stale]), Instant::now());
        let old = server(
            NovaStatus::Active,
            Some(agent(1.0, Some(answer(9.0, true)))),
        );
        t.observed(&m, &pool(vec![old]), Instant::now());
        let ok = server(
            NovaStatus::Active,
            Some(agent(1.0, Some(answer(1.5, true)))),
        );
        t.observed(&m, &pool(vec![ok]), Instant::now());
        let text = m.render();
        assert_eq!(
            sum_count(&text, "vq_drain_handshake_duration_seconds"),
            ("2.5".into(), "1".into()),
            "{text}"
        );
    }
}
