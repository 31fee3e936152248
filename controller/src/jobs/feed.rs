//! Keeps the [`JobTable`] current: a consumer of the job-event stream
//! `<c>.events.log` from its first retained message, started with every
//! broker session. The table is rebuilt from scratch each time (the
//! controller holds no state of its own), and is *complete* once the
//! consumer has caught up: the first moment no message arrived for
//! [`CAUGHT_UP_IDLE`]. Until then `/jobs` answers 503.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::{Channel, Connection};
use vq_common::amqp::{self, AmqpError};
use vq_common::messages::{unix_now, JobEvent};
use vq_common::topology::Topology;

use vq_common::jobs::JobTable;

/// Prefetch of the stream consumer, messages (the stream needs acks to
/// grant credit: acked in batches of half of it, and whenever the stream
/// is quiet).
pub const STREAM_PREFETCH: u16 = 2000;

/// The table counts as caught up with the stream after this long without a
/// message.
pub const CAUGHT_UP_IDLE: Duration = Duration::from_millis(300);

/// How often ended jobs past `keep_completed_secs` are forgotten.
pub const EXPIRE_EVERY: Duration = Duration::from_secs(30);

/// The table and whether it reflects the whole stream.
#[derive(Debug, Default)]
pub struct JobsView {
    /// The table.
    pub table: JobTable,
    /// Whether the consumer caught up with the stream since it (re)started.
    pub complete: bool,
    /// Why the table is not complete, for `/jobs`' 503 (`None` while
    /// catching up for the first time).
    pub stalled: Option<String>,
    /// Why each pool's queued jobs wait, by pool
    /// ([`super::pending::pending_reason`], set after every cycle).
    pub pending: std::collections::BTreeMap<String, String>,
}

impl JobsView {
    /// Gives `r`, if it is queued and has no reason of its own, its pool's
    /// pending reason; if it is held, the dependency it waits for
    /// ([`vq_common::jobs::depend::held_reason`], e.g. `held: afterok 123
    /// not finished`).
    pub fn annotate(&self, r: &mut vq_common::jobs::JobRecord) {
        if r.state == vq_common::jobs::State::Queued && r.reason.is_none() {
            r.reason = self.pending.get(&r.pool).cloned();
        }
        if r.state == vq_common::jobs::State::Held && r.reason.is_none() {
            let depend = r.request.as_ref().map_or(&[][..], |q| &q.depend[..]);
            let submitter = r.submitter.as_deref().unwrap_or_default();
            r.reason = Some(vq_common::jobs::depend::held_reason(
                &r.id,
                depend,
                submitter,
                &self.table,
            ));
        }
    }
}

/// Shared handle on the view.
pub type SharedJobs = Arc<RwLock<JobsView>>;

/// Starts following the stream on `conn`: the table in `jobs` is emptied
/// and rebuilt from the stream's first message; ended jobs are forgotten
/// `keep_completed_secs` after their end. Once the table is caught up,
/// each job's first start is observed in `metrics`'
/// `vq_job_wait_duration_seconds` (queued → started, from the two events'
/// times; a replayed stream after a reconnect is not observed again).
///
/// # Errors
/// [`AmqpError`] if the channel or the consumer cannot be opened.
pub async fn start(
    conn: &Connection,
    topo: &Topology,
    jobs: SharedJobs,
    keep_completed_secs: f64,
    metrics: Arc<crate::metrics::Metrics>,
) -> Result<tokio::task::JoinHandle<()>, AmqpError> {
    let ch = conn
        .create_channel()
        .await
        .map_err(AmqpError::op("channel.open (job table)"))?;
    let consumer = amqp::consume_stream_from_first(
        &ch,
        &topo.event_log_queue(),
        "vq-controller-jobs",
        STREAM_PREFETCH,
    )
    .await?;
    {
        let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
        *v = JobsView::default();
    }
    Ok(tokio::spawn(follow(
        consumer,
        ch,
        jobs,
        keep_completed_secs,
        metrics,
    )))
}

/// Seconds `ev` (a job's first `started`, just applied to `table`) came
/// after the job's `queued` event; `None` for any other event, a rerun, or
/// a job whose `queued` event the table has not seen.
fn first_start_wait(table: &vq_common::jobs::JobTable, ev: &JobEvent) -> Option<f64> {
    if !matches!(ev.state, vq_common::messages::JobState::Started) || ev.attempt > 1 {
        return None;
    }
    let r = table.get(&ev.job_id)?;
    if r.started_at != Some(ev.at) || r.submission != ev.submission {
        return None;
    }
    let wait = ev.at - r.queued_at?;
    wait.is_finite().then_some(wait.max(0.0))
}

async fn follow(
    mut consumer: lapin::Consumer,
    _ch: Channel,
    jobs: SharedJobs,
    keep: f64,
    metrics: Arc<crate::metrics::Metrics>,
) {
    let mut unacked: Option<lapin::Acker> = None;
    let mut pending = 0u32;
    let mut last_expiry = tokio::time::Instant::now();
    loop {
        if last_expiry.elapsed() >= EXPIRE_EVERY {
            last_expiry = tokio::time::Instant::now();
            let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
            let n = v.table.expire(unix_now(), keep);
            if n > 0 {
                tracing::debug!(
                    forgotten = n,
                    "job table: ended jobs past keep_completed_secs forgotten"
                );
            }
        }
        let next = tokio::time::timeout(CAUGHT_UP_IDLE, consumer.next()).await;
        let delivery = match next {
            Err(_) => {
                // Quiet: ack what was taken (credit), mark caught up.
                if let Some(a) = unacked.take() {
                    let _ = a.ack(BasicAckOptions { multiple: true }).await;
                    pending = 0;
                }
                let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
                if !v.complete {
                    tracing::info!(
                        jobs = v.table.len(),
                        events = v.table.events_applied,
                        "job table built from the event stream"
                    );
                }
                v.complete = true;
                continue;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                tracing::warn!(error = %e, "job-event stream consumer failed");
                break;
            }
            Ok(Some(Ok(d))) => d,
        };
        let user_id = delivery.properties.user_id().as_ref().map(|u| u.as_str());
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str());
        match JobEvent::decode_delivered(&delivery.data, delivery.routing_key.as_str(), user_id) {
            Ok(ev) => {
                let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
                let before = v.table.events_applied;
                v.table.apply(&ev, message_id);
                let new = v.table.events_applied > before;
                if new && v.complete {
                    if let Some(wait) = first_start_wait(&v.table, &ev) {
                        metrics.job_waited(&ev.pool, wait);
                    }
                }
            }
            Err(e) => {
                tracing::debug!(routing_key = %delivery.routing_key, error = %e, "job table: skipping an event")
            }
        }
        pending += 1;
        if pending >= u32::from(STREAM_PREFETCH) / 2 {
            let _ = delivery.acker.ack(BasicAckOptions { multiple: true }).await;
            pending = 0;
            unacked = None;
        } else {
            unacked = Some(delivery.acker);
        }
    }
    let mut v = jobs.write().unwrap_or_else(|p| p.into_inner());
    v.complete = false;
    v.stalled = Some("the job-event stream consumer ended; the table is rebuilt when the broker session restarts".into());
}
