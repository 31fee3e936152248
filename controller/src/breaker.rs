//! Per-pool boot-failure backoff and circuit breaker (issue 12, "Replacement
//! storms").
//!
//! A *boot failure* is a create call that failed, or a server of the pool
//! that Nova reports in ERROR or that stays in BUILD past the pool's
//! `boot_timeout_secs` (each server counted once). A *boot success* is a
//! server this pool saw booting (or created) that Nova reports ACTIVE.
//!
//! Consecutive failures back the pool's boots off exponentially
//! ([`vq_common::backoff::Backoff`], base `boot_backoff_base_secs`, cap
//! `boot_backoff_cap_secs`); at `breaker_failures` consecutive failures the
//! breaker opens and the pool boots nothing for `breaker_open_secs`; then it
//! half-opens and boots one server; that server's success closes the
//! breaker (and resets the backoff), its failure opens it again.
//!
//! The state lives here, in the controller's per-pool memory; the planner
//! only sees its [`BootGate`] (pure input).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;
use vq_common::backoff::Backoff;
use vq_common::config::PoolConfig;

use crate::observe::{NovaStatus, ObservedServer};
use crate::plan::Class;

/// What the breaker lets a pool boot now: the planner's input.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum BootGate {
    /// Boot as many as the rule wants.
    #[default]
    Open,
    /// Consecutive boot failures: no boot for `secs_left` seconds more.
    Backoff {
        /// Consecutive boot failures.
        failures: u32,
        /// Seconds until boots may resume.
        secs_left: f64,
        /// The last failure, for the reason.
        last: String,
    },
    /// The breaker is open: no boot for `secs_left` seconds more.
    BreakerOpen {
        /// Consecutive boot failures.
        failures: u32,
        /// Seconds until it half-opens.
        secs_left: f64,
        /// The last failure, for the reason.
        last: String,
    },
    /// Half-open: one trial boot is allowed (`probing`: it was made and
    /// its outcome is awaited, so none more).
    HalfOpen {
        /// Consecutive boot failures.
        failures: u32,
        /// Whether the trial boot was already made.
        probing: bool,
    },
}

impl BootGate {
    /// Most servers the pool may boot now (`None`: no limit).
    pub fn allowed(&self) -> Option<u32> {
        match self {
            BootGate::Open => None,
            BootGate::HalfOpen { probing: false, .. } => Some(1),
            _ => Some(0),
        }
    }

    /// Short kind for `/status` and the metric (`backoff`, `breaker-open`,
    /// `breaker-half-open`), `None` when open.
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            BootGate::Open => None,
            BootGate::Backoff { .. } => Some("boot-backoff"),
            BootGate::BreakerOpen { .. } => Some("breaker-open"),
            BootGate::HalfOpen { .. } => Some("breaker-half-open"),
        }
    }

    /// Why boots are limited, for logs, `/status` and `vq pools`.
    pub fn reason(&self) -> Option<String> {
        match self {
            BootGate::Open => None,
            BootGate::Backoff {
                failures,
                secs_left,
                last,
            } => Some(format!(
                "{failures} consecutive boot failure(s), last: {last}; boots back off for {secs_left:.0} s more"
            )),
            BootGate::BreakerOpen {
                failures,
                secs_left,
                last,
            } => Some(format!(
                "circuit breaker open after {failures} consecutive boot failures, last: {last}; no boot for {secs_left:.0} s more, then one trial boot"
            )),
            BootGate::HalfOpen { failures, probing } => Some(if *probing {
                format!("circuit breaker half-open after {failures} consecutive boot failures: waiting for the trial boot")
            } else {
                format!("circuit breaker half-open after {failures} consecutive boot failures: one trial boot allowed")
            }),
        }
    }
}

/// The breaker's thresholds (from the pool's configuration).
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    /// Backoff between failed boots.
    pub backoff: Backoff,
    /// Consecutive failures that open the breaker.
    pub open_after: u32,
    /// How long it stays open before half-opening.
    pub open_for: Duration,
}

impl BreakerConfig {
    /// The thresholds of `pool` (`boot_backoff_base_secs`,
    /// `boot_backoff_cap_secs`, `breaker_failures`, `breaker_open_secs`;
    /// validated with the configuration, so a wrong pair falls back to
    /// base = cap).
    pub fn of(pool: &PoolConfig) -> Self {
        let base = Duration::from_secs_f64(pool.boot_backoff_base_secs.max(0.001));
        let cap = Duration::from_secs_f64(pool.boot_backoff_cap_secs.max(0.001));
        let backoff = Backoff::try_new(base, cap)
            .unwrap_or_else(|_| Backoff::new_unchecked(base.max(cap), base.max(cap)));
        BreakerConfig {
            backoff,
            open_after: pool.breaker_failures.max(1),
            open_for: Duration::from_secs_f64(pool.breaker_open_secs.max(0.001)),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    Closed { not_before: Option<Instant> },
    Open { until: Instant },
    HalfOpen { probe: Option<String> },
}

/// One pool's boot breaker.
#[derive(Debug, Clone)]
pub struct BootBreaker {
    cfg: BreakerConfig,
    failures: u32,
    state: State,
    last: String,
    /// Servers seen booting (or created) whose outcome is not known yet.
    booting: BTreeSet<String>,
    /// Failed servers already counted (pruned to the listed ones).
    counted: BTreeSet<String>,
}

impl BootBreaker {
    /// A closed breaker with `cfg`.
    pub fn new(cfg: BreakerConfig) -> Self {
        BootBreaker {
            cfg,
            failures: 0,
            state: State::Closed { not_before: None },
            last: String::new(),
            booting: BTreeSet::new(),
            counted: BTreeSet::new(),
        }
    }

    /// Consecutive boot failures.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether the breaker is open (not half-open).
    pub fn is_open(&self, now: Instant) -> bool {
        matches!(self.state, State::Open { until } if now < until)
    }

    /// The gate at `now` (an open breaker whose time is up half-opens).
    pub fn gate(&mut self, now: Instant) -> BootGate {
        let left = |t: Instant| t.saturating_duration_since(now).as_secs_f64();
        if let State::Open { until } = self.state {
            if now >= until {
                tracing::info!(
                    failures = self.failures,
                    "boot circuit breaker half-open: one trial boot"
                );
                self.state = State::HalfOpen { probe: None };
            }
        }
        match &self.state {
            State::Closed {
                not_before: Some(t),
            } if now < *t => BootGate::Backoff {
                failures: self.failures,
                secs_left: left(*t),
                last: self.last.clone(),
            },
            State::Closed { .. } => BootGate::Open,
            State::Open { until } => BootGate::BreakerOpen {
                failures: self.failures,
                secs_left: left(*until),
                last: self.last.clone(),
            },
            State::HalfOpen { probe } => BootGate::HalfOpen {
                failures: self.failures,
                probing: probe.is_some(),
            },
        }
    }

    /// Records one boot failure (`what` says which) at `now`.
    pub fn failed(&mut self, now: Instant, what: String) {
        self.failures = self.failures.saturating_add(1);
        self.last = what;
        let reopen = matches!(self.state, State::HalfOpen { .. } | State::Open { .. });
        if reopen || self.failures >= self.cfg.open_after {
            let until = now + self.cfg.open_for;
            if !matches!(self.state, State::Open { .. }) {
                tracing::error!(failures = self.failures, last = %self.last, open_secs = self.cfg.open_for.as_secs_f64(), "boot circuit breaker open: this pool boots nothing until it half-opens");
            }
            self.state = State::Open { until };
        } else {
            let delay = self.cfg.backoff.next_delay();
            tracing::warn!(failures = self.failures, last = %self.last, retry_in_secs = delay.as_secs_f64(), "boot failed: backing off this pool's boots");
            self.state = State::Closed {
                not_before: Some(now + delay),
            };
        }
    }

    /// Records a successful boot: the breaker closes, the backoff resets.
    pub fn succeeded(&mut self, server: &str) {
        if self.failures > 0 || !matches!(self.state, State::Closed { not_before: None }) {
            tracing::info!(
                server,
                failures = self.failures,
                "boot succeeded: boot backoff and circuit breaker reset"
            );
        }
        self.failures = 0;
        self.cfg.backoff.reset();
        self.state = State::Closed { not_before: None };
    }

    /// Remembers server `id` as created by this pool (its outcome counts);
    /// in half-open state it is the trial boot.
    pub fn created(&mut self, id: &str) {
        self.booting.insert(id.to_string());
        if let State::HalfOpen { probe } = &mut self.state {
            probe.get_or_insert_with(|| id.to_string());
        }
    }

    /// Takes one complete view of the pool: each server with the planner's
    /// judgement. ERROR and stuck-BUILD servers not counted yet are
    /// failures; a server seen booting that is now ACTIVE is a success.
    pub fn observe(&mut self, now: Instant, servers: &[ObservedServer], classes: &[Class]) {
        let listed: BTreeSet<&str> = servers.iter().map(|s| s.id.as_str()).collect();
        self.counted.retain(|id| listed.contains(id.as_str()));
        for (s, c) in servers.iter().zip(classes) {
            let failure = match c {
                Class::Error => Some("went to ERROR"),
                Class::StuckBuild => Some("stayed in BUILD past the boot timeout"),
                _ => None,
            };
            if let Some(why) = failure {
                if self.counted.insert(s.id.clone()) {
                    self.booting.remove(&s.id);
                    self.failed(now, format!("server {} ({}) {why}", s.name, s.id));
                }
            } else if s.status == NovaStatus::Active {
                if self.booting.remove(&s.id) {
                    self.succeeded(&s.name);
                }
            } else if s.status == NovaStatus::Build {
                self.booting.insert(s.id.clone());
            }
        }
        // A trial boot that vanished without an outcome: try again.
        if let State::HalfOpen { probe: Some(id) } = &self.state {
            if !listed.contains(id.as_str()) && !self.booting.contains(id) {
                self.state = State::HalfOpen { probe: None };
            }
        }
        self.booting.retain(|id| listed.contains(id.as_str()));
    }
}

/// Every pool's breaker, made on first use from the pool's configuration.
#[derive(Debug, Default)]
pub struct Breakers {
    pools: BTreeMap<String, BootBreaker>,
}

impl Breakers {
    /// `pool`'s breaker.
    pub fn get(&mut self, pool: &str, cfg: &PoolConfig) -> &mut BootBreaker {
        self.pools
            .entry(pool.to_string())
            .or_insert_with(|| BootBreaker::new(BreakerConfig::of(cfg)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            backoff: Backoff::try_new(Duration::from_secs(10), Duration::from_secs(40)).unwrap(),
            open_after: 3,
            open_for: Duration::from_secs(600),
        }
    }

    fn server(id: &str, status: NovaStatus) -> ObservedServer {
        ObservedServer {
            id: id.into(),
            name: format!("vq-p-{id}"),
            status,
            age_secs: Some(1.0),
            agent: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_then_open_half_open_and_a_success_closes() {
        let mut b = BootBreaker::new(cfg());
        let t0 = Instant::now();
        assert_eq!(b.gate(t0), BootGate::Open);
        b.created("a");
        // The same ERROR server seen twice is one failure.
        for _ in 0..2 {
            b.observe(t0, &[server("a", NovaStatus::Error)], &[Class::Error]);
        }
        assert_eq!(b.failures(), 1);
        let g = b.gate(t0);
        assert_eq!(g.allowed(), Some(0));
        assert_eq!(g.kind(), Some("boot-backoff"));
        assert!(g.reason().unwrap().contains("vq-p-a"), "{g:?}");
        // The first delay is within [5, 10] s.
        assert_eq!(b.gate(t0 + Duration::from_secs(10)), BootGate::Open);
        let t1 = t0 + Duration::from_secs(10);
        b.failed(t1, "create refused".into());
        b.failed(t1, "create refused".into());
        assert_eq!(b.failures(), 3);
        assert!(b.is_open(t1));
        assert_eq!(
            b.gate(t1 + Duration::from_secs(599)).kind(),
            Some("breaker-open")
        );
        let t2 = t1 + Duration::from_secs(600);
        let g = b.gate(t2);
        assert_eq!(g.allowed(), Some(1), "half-open: one trial boot");
        b.created("trial");
        assert_eq!(b.gate(t2).allowed(), Some(0), "only one trial");
        b.observe(t2, &[server("trial", NovaStatus::Build)], &[Class::Booting]);
        assert_eq!(b.gate(t2).allowed(), Some(0));
        b.observe(
            t2,
            &[server("trial", NovaStatus::Active)],
            &[Class::Booting],
        );
        assert_eq!(b.failures(), 0);
        assert_eq!(b.gate(t2), BootGate::Open, "the trial's success closes it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_trial_opens_the_breaker_again_and_old_active_servers_do_not_close_it() {
        let mut c = cfg();
        c.open_after = 1;
        let mut b = BootBreaker::new(c);
        let t0 = Instant::now();
        b.observe(t0, &[server("old", NovaStatus::Active)], &[Class::Idle]);
        b.failed(t0, "create refused".into());
        let t1 = t0 + Duration::from_secs(600);
        assert_eq!(b.gate(t1).allowed(), Some(1));
        b.observe(t1, &[server("old", NovaStatus::Active)], &[Class::Idle]);
        assert_eq!(b.failures(), 1, "a server up all along is no boot success");
        b.created("trial");
        b.observe(
            t1,
            &[
                server("old", NovaStatus::Active),
                server("trial", NovaStatus::Build),
            ],
            &[Class::Idle, Class::StuckBuild],
        );
        assert!(b.is_open(t1), "the trial failed: open again");
        assert_eq!(b.gate(t1).kind(), Some("breaker-open"));
    }
}
