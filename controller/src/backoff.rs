//! Per-pool backoff after failed cycles: [`vq_common::backoff::Backoff`]
//! (capped exponential with full jitter, reset on success) plus the
//! instant before which the pool is not touched.

use std::time::Duration;

use tokio::time::Instant;
use vq_common::backoff::Backoff;

/// First delay after a failed cycle.
pub const BACKOFF_BASE: Duration = Duration::from_secs(2);
/// Largest delay after failed cycles.
pub const BACKOFF_CAP: Duration = Duration::from_secs(300);
/// The backoff every pool starts with.
pub const POOL_BACKOFF: Backoff = Backoff::new_unchecked(BACKOFF_BASE, BACKOFF_CAP);

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
}
