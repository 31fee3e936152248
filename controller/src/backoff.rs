//! Per-pool backoff after failed cycles: capped exponential with full
//! jitter, reset on success (STYLE.md practice 6).

use std::time::Duration;

use tokio::time::Instant;

/// Invalid backoff parameters.
#[derive(Debug, thiserror::Error)]
pub enum BackoffError {
    /// `base` was zero or greater than `cap`.
    #[error("backoff base {base:?} must be non-zero and at most the cap {cap:?}")]
    Range {
        /// First delay.
        base: Duration,
        /// Largest delay.
        cap: Duration,
    },
}

/// Capped exponential backoff: the n-th delay (from 0) is uniformly random in
/// `[c/2, c]` with `c = min(cap, base * 2^n)`.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting at `base` and never exceeding `cap`.
    ///
    /// # Errors
    /// [`BackoffError::Range`] if `base` is zero or greater than `cap`.
    pub fn try_new(base: Duration, cap: Duration) -> Result<Self, BackoffError> {
        if base.is_zero() || base > cap {
            return Err(BackoffError::Range { base, cap });
        }
        Ok(Backoff {
            base,
            cap,
            attempt: 0,
        })
    }

    /// Failures since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The next delay, with `unit` in `[0, 1]` choosing the point in the
    /// jitter range (pure, for tests).
    pub fn next_delay_with(&mut self, unit: f64) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(30))
            .min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let half = ceiling / 2;
        half + (ceiling - half).mul_f64(unit)
    }

    /// The next delay, randomly jittered.
    pub fn next_delay(&mut self) -> Duration {
        self.next_delay_with(rand::random::<f64>())
    }

    /// Back to the first delay (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A pool's backoff plus the instant before which the pool is not touched.
#[derive(Debug, Clone)]
pub struct PoolBackoff {
    backoff: Backoff,
    not_before: Option<Instant>,
}

impl PoolBackoff {
    /// Wraps `backoff`; the pool starts ready.
    pub fn new(backoff: Backoff) -> Self {
        PoolBackoff {
            backoff,
            not_before: None,
        }
    }

    /// Whether the pool may be reconciled at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| now >= t)
    }

    /// Records a failure at `now`; the delay is at least `retry_after` when
    /// the service asked for one. Returns the delay.
    pub fn failed(&mut self, now: Instant, retry_after: Option<Duration>) -> Duration {
        let mut delay = self.backoff.next_delay();
        if let Some(ra) = retry_after {
            delay = delay.max(ra.min(Duration::from_secs(3600)));
        }
        self.not_before = Some(now + delay);
        delay
    }

    /// Records a success: the next failure starts from the base delay again.
    pub fn succeeded(&mut self) {
        self.backoff.reset();
        self.not_before = None;
    }

    /// Failures since the last success.
    pub fn attempts(&self) -> u32 {
        self.backoff.attempts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(Backoff::try_new(Duration::ZERO, Duration::from_secs(1)).is_err());
        assert!(Backoff::try_new(Duration::from_secs(2), Duration::from_secs(1)).is_err());
        assert!(Backoff::try_new(Duration::from_secs(1), Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn delays_double_until_the_cap_and_reset_on_success() {
        let mut b = Backoff::try_new(Duration::from_secs(1), Duration::from_secs(8)).unwrap();
        let got: Vec<u64> = (0..6).map(|_| b.next_delay_with(1.0).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 8, 8]);
        b.reset();
        assert_eq!(b.next_delay_with(1.0), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_pool_waits_and_retry_after_is_honoured() {
        let mut p = PoolBackoff::new(
            Backoff::try_new(Duration::from_secs(1), Duration::from_secs(60)).unwrap(),
        );
        let now = Instant::now();
        assert!(p.ready(now));
        let d = p.failed(now, Some(Duration::from_secs(30)));
        assert!(d >= Duration::from_secs(30));
        assert!(!p.ready(now + Duration::from_secs(29)));
        assert!(p.ready(now + d));
        p.succeeded();
        assert!(p.ready(now));
        assert_eq!(p.attempts(), 0);
    }

    proptest! {
        #[test]
        fn delays_stay_within_half_ceiling_and_cap(
            base_ms in 1u64..10_000,
            extra_ms in 0u64..1_000_000,
            units in proptest::collection::vec(0.0f64..=1.0, 1..40),
        ) {
            let base = Duration::from_millis(base_ms);
            let cap = base + Duration::from_millis(extra_ms);
            let mut b = Backoff::try_new(base, cap).unwrap();
            for (n, u) in units.into_iter().enumerate() {
                let ceiling = base.saturating_mul(1u32 << (n as u32).min(30)).min(cap);
                let d = b.next_delay_with(u);
                prop_assert!(d <= cap);
                prop_assert!(d <= ceiling);
                prop_assert!(d >= ceiling / 2);
            }
        }
    }
}
