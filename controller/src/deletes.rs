//! Deletes in flight (issue 12, "Delete that does nothing").
//!
//! Nova's `DELETE /servers/{id}` is asynchronous: 204 means the request was
//! accepted, not that the server is gone (Compute API reference, "Delete
//! Server": "preconditions … the server is deleted asynchronously"). A
//! server the controller deleted may stay listed for a while, or, on a
//! broken cell or compute host, for ever. The planner is pure and wants
//! such a server deleted on every cycle; this module stands between the
//! plan and the act step so that:
//!
//! * a delete is *polled*: while the server is still listed after a 204, the
//!   controller does not send `DELETE` again until a delay has passed that
//!   starts at the pool's `delete_retry_secs` and doubles with each re-send
//!   (the project's one [`Backoff`], jittered, capped at 16 × the base);
//! * a server still listed `delete_timeout_secs` after the first delete is
//!   *flagged*: a warning ("will not go") once, a `/status` entry
//!   (`stuck_deletes`) and the `vq_pool_servers_stuck_deleting` gauge until
//!   it goes; re-sends go on at the capped delay;
//! * a server that a complete listing no longer shows is forgotten (and its
//!   time from the first delete to gone is logged).
//!
//! Soft state of the loop, like the breaker: a restarted controller sends
//! one `DELETE` more and then polls again.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;
use vq_common::backoff::Backoff;

/// Re-send delays are capped at this multiple of `delete_retry_secs`.
pub const RETRY_CAP_FACTOR: u32 = 16;

/// One server this controller sent `DELETE` for and still sees listed.
#[derive(Debug, Clone)]
struct Pending {
    name: String,
    first_sent: Instant,
    last_sent: Instant,
    /// Delay after `last_sent` before the next re-send.
    wait: Duration,
    sent: u32,
    backoff: Backoff,
    flagged: bool,
}

/// A server flagged as not going: the `/status` entry.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StuckDelete {
    /// Server name.
    pub server: String,
    /// Nova server id.
    pub server_id: String,
    /// Seconds since the first `DELETE`.
    pub since_secs: f64,
    /// `DELETE` requests sent so far.
    pub deletes_sent: u32,
}

/// What to do with a planned delete.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Send `DELETE` (first time, or the re-send delay has passed).
    Send,
    /// Sent before and still listed: wait (`secs_left` until the next
    /// re-send).
    Poll {
        /// Seconds until a re-send.
        secs_left: f64,
    },
}

/// The deletes in flight of one pool.
#[derive(Debug, Default)]
pub struct Deletes {
    pending: BTreeMap<String, Pending>,
}

impl Deletes {
    /// Whether the planned delete of `server_id` is to be sent at `now`.
    pub fn decide(&self, server_id: &str, now: Instant) -> Decision {
        match self.pending.get(server_id) {
            None => Decision::Send,
            Some(p) => {
                let due = p.last_sent + p.wait;
                if now >= due {
                    Decision::Send
                } else {
                    Decision::Poll {
                        secs_left: (due - now).as_secs_f64(),
                    }
                }
            }
        }
    }

    /// Records a `DELETE` that Nova accepted (2xx or 404) at `now`;
    /// `retry` is the pool's `delete_retry_secs` (positive, checked by the
    /// configuration). Returns how many were sent for this server so far.
    pub fn sent(&mut self, server_id: &str, name: &str, retry: Duration, now: Instant) -> u32 {
        let cap = retry.saturating_mul(RETRY_CAP_FACTOR);
        let p = self
            .pending
            .entry(server_id.to_string())
            .or_insert_with(|| Pending {
                name: name.to_string(),
                first_sent: now,
                last_sent: now,
                wait: retry,
                sent: 0,
                backoff: Backoff::try_new(retry, cap).unwrap_or_else(|_| {
                    Backoff::new_unchecked(Duration::from_secs(30), Duration::from_secs(480))
                }),
                flagged: false,
            });
        p.sent += 1;
        p.last_sent = now;
        p.wait = p.backoff.next_delay();
        p.sent
    }

    /// Takes a complete listing of the pool (`listed`: server ids): every
    /// pending server that is not listed is gone and forgotten. Returns the
    /// gone ones as (name, seconds from the first delete).
    pub fn observe<'a>(
        &mut self,
        listed: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Vec<(String, f64)> {
        let listed: std::collections::BTreeSet<&str> = listed.into_iter().collect();
        let gone: Vec<String> = self
            .pending
            .keys()
            .filter(|id| !listed.contains(id.as_str()))
            .cloned()
            .collect();
        gone.into_iter()
            .filter_map(|id| self.pending.remove(&id))
            .map(|p| (p.name, (now - p.first_sent).as_secs_f64()))
            .collect()
    }

    /// The servers still listed `timeout` or more after their first delete;
    /// the ones flagged for the first time are returned in `newly` too (to
    /// be logged once).
    pub fn stuck(
        &mut self,
        timeout: Duration,
        now: Instant,
    ) -> (Vec<StuckDelete>, Vec<StuckDelete>) {
        let mut all = Vec::new();
        let mut newly = Vec::new();
        for (id, p) in &mut self.pending {
            let since = now - p.first_sent;
            if since < timeout {
                continue;
            }
            let entry = StuckDelete {
                server: p.name.clone(),
                server_id: id.clone(),
                since_secs: since.as_secs_f64(),
                deletes_sent: p.sent,
            };
            if !p.flagged {
                p.flagged = true;
                newly.push(entry.clone());
            }
            all.push(entry);
        }
        (all, newly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_server_is_polled_then_re_sent_with_growing_delays_and_flagged_once() {
        let t0 = Instant::now();
        let retry = Duration::from_secs(2);
        let mut d = Deletes::default();
        assert_eq!(d.decide("a", t0), Decision::Send);
        assert_eq!(d.sent("a", "vq-x-1", retry, t0), 1);
        // Right after: poll, do not send again.
        assert!(matches!(
            d.decide("a", t0 + Duration::from_millis(300)),
            Decision::Poll { .. }
        ));
        // Walk a minute in 0.3 s cycles, sending only when told.
        let mut sends = 1;
        let mut t = t0;
        let mut gaps = Vec::new();
        let mut last = t0;
        while t < t0 + Duration::from_secs(60) {
            t += Duration::from_millis(300);
            if d.decide("a", t) == Decision::Send {
                sends = d.sent("a", "vq-x-1", retry, t);
                gaps.push((t - last).as_secs_f64());
                last = t;
            }
        }
        // Jittered doubling from 2 s, capped at 32 s: a handful, not 200.
        assert!((3..=8).contains(&sends), "{sends} sends: gaps {gaps:?}");
        assert!(gaps.iter().all(|g| *g >= 1.0), "{gaps:?}");
        assert!(gaps.iter().all(|g| *g <= 32.3), "{gaps:?}");
        // Flagged once, listed every time.
        let (all, newly) = d.stuck(Duration::from_secs(10), t);
        assert_eq!((all.len(), newly.len()), (1, 1));
        assert_eq!(all[0].server, "vq-x-1");
        assert_eq!(all[0].deletes_sent, sends);
        let (all, newly) = d.stuck(Duration::from_secs(10), t);
        assert_eq!((all.len(), newly.len()), (1, 0));
        // Gone from a listing: forgotten, with its time to go.
        let gone = d.observe(["b"], t);
        assert_eq!(gone.len(), 1);
        assert!(gone[0].1 >= 59.0);
        assert_eq!(d.decide("a", t), Decision::Send);
        assert!(d.stuck(Duration::from_secs(10), t).0.is_empty());
    }

    #[test]
    fn a_server_gone_before_its_deadline_is_never_flagged() {
        let t0 = Instant::now();
        let mut d = Deletes::default();
        d.sent("a", "n", Duration::from_secs(30), t0);
        assert!(d
            .stuck(Duration::from_secs(600), t0 + Duration::from_secs(5))
            .0
            .is_empty());
        assert_eq!(d.observe([], t0 + Duration::from_secs(5)).len(), 1);
        assert!(d
            .stuck(Duration::ZERO, t0 + Duration::from_secs(5))
            .0
            .is_empty());
    }
}
