//! The one backoff of vq (practice 6 of the house style: capped
//! exponential with full jitter, reset on success, built by a validating
//! `try_new`): the controller backs off per pool after failed cycles, the
//! jobagent between broker sessions. Compiled-in parameters are built with
//! [`Backoff::new_unchecked`] in a `const`, so they cannot fail at run
//! time; parameters from configuration go through [`Backoff::try_new`].
//! Modelled on linkerd2-proxy's `linkerd/exp-backoff`. Pure apart from the
//! random number of [`Backoff::next_delay`].

use std::time::Duration;

/// Invalid backoff parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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

/// Largest exponent of the doubling: `base * 2^30` saturates any useful
/// `cap`, and a larger shift would overflow the `u32` multiplier.
const MAX_SHIFT: u32 = 30;

/// Capped exponential backoff: the n-th delay (from 0) is uniformly random
/// in `[c/2, c]` with `c = min(cap, base * 2^n)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting at `base` and never exceeding `cap`, unchecked:
    /// for `const` parameters written in the code (a `const` item makes a
    /// wrong pair a compile-time panic, not a run-time error).
    ///
    /// # Panics
    /// If `base` is zero or greater than `cap` (at compile time in a
    /// `const` context).
    pub const fn new_unchecked(base: Duration, cap: Duration) -> Self {
        assert!(
            !base.is_zero() && base.as_nanos() <= cap.as_nanos(),
            "backoff base must be non-zero and at most the cap"
        );
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

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
    /// jitter range `[c/2, c]` (pure, for tests; a value outside the range
    /// is clamped, NaN counts as 1).
    pub fn next_delay_with(&mut self, unit: f64) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(MAX_SHIFT))
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
    #[should_panic(expected = "backoff base")]
    fn an_unchecked_backoff_with_a_zero_base_panics() {
        let _ = Backoff::new_unchecked(Duration::ZERO, Duration::from_secs(1));
    }

    #[test]
    fn a_constant_backoff_equals_the_checked_one() {
        const B: Backoff = Backoff::new_unchecked(Duration::from_secs(2), Duration::from_secs(300));
        assert_eq!(
            Ok(B),
            Backoff::try_new(Duration::from_secs(2), Duration::from_secs(300))
        );
    }

    #[test]
    fn delays_double_until_the_cap_and_reset_on_success() {
        let mut b = Backoff::try_new(Duration::from_secs(1), Duration::from_secs(8)).unwrap();
        let got: Vec<u64> = (0..6).map(|_| b.next_delay_with(1.0).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 8, 8]);
        assert_eq!(b.attempts(), 6);
        b.reset();
        assert_eq!(b.next_delay_with(1.0), Duration::from_secs(1));
        assert_eq!(b.next_delay_with(0.0), Duration::from_secs(1));
    }

    #[test]
    fn random_delays_stay_under_the_cap_after_many_failures() {
        let mut b = Backoff::try_new(Duration::from_millis(100), Duration::from_secs(2)).unwrap();
        for _ in 0..100 {
            assert!(b.next_delay() <= Duration::from_secs(2));
        }
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
                let ceiling = base.saturating_mul(1u32 << (n as u32).min(MAX_SHIFT)).min(cap);
                let d = b.next_delay_with(u);
                prop_assert!(d <= cap);
                prop_assert!(d <= ceiling);
                prop_assert!(d >= ceiling / 2);
            }
        }
    }
}
