//! Claim markers: who owns a job (see `vq_common::lease` and DESIGN.md,
//! "Unknown outcomes"). A marker is an empty durable queue
//! `<c>.claim.<job id>` whose declaration arguments name the owning agent
//! and claim; RabbitMQ answers a declaration with other arguments with
//! `406 PRECONDITION_FAILED` ("inequivalent arg"), so declaring is a
//! compare-and-set that an agent can repeat after a lost reply.
//!
//! Marker operations run on their own channel of the *consuming*
//! connection (never blocked by a resource alarm, since nothing is
//! published on it). A 406 or 404 closes that channel: the next operation
//! opens a new one.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::{Channel, Connection};
use tokio::sync::watch;
use vq_common::amqp::{bounded, claim_marker, AmqpError};
use vq_common::jobs::cancel::{WITHDRAWN_AGENT, WITHDRAWN_CLAIM};
use vq_common::lease::Marker;
use vq_common::topology::Topology;

/// Bound on one marker operation.
const OP_TIMEOUT: Duration = Duration::from_secs(15);

/// The claim markers of one agent.
#[derive(Debug)]
pub(crate) struct Markers {
    topo: Topology,
    agent: String,
    conn: watch::Receiver<Option<Arc<Connection>>>,
    channel: tokio::sync::Mutex<Option<Channel>>,
}

impl Markers {
    /// Markers of `agent`, operated on the consuming connection published
    /// on `conn` by the session loop (`None` while disconnected).
    pub(crate) fn new(
        topo: Topology,
        agent: String,
        conn: watch::Receiver<Option<Arc<Connection>>>,
    ) -> Self {
        Markers {
            topo,
            agent,
            conn,
            channel: tokio::sync::Mutex::new(None),
        }
    }

    async fn channel(&self) -> Result<Channel, AmqpError> {
        let mut cached = self.channel.lock().await;
        if let Some(ch) = cached.as_ref().filter(|c| c.status().connected()) {
            return Ok(ch.clone());
        }
        let conn = self
            .conn
            .borrow()
            .clone()
            .filter(|c| c.status().connected())
            .ok_or_else(|| AmqpError::Timeout {
                what: "claim marker channel (not connected)".into(),
                secs: 0,
            })?;
        let ch = bounded("open claim marker channel", OP_TIMEOUT, async {
            conn.create_channel()
                .await
                .map_err(AmqpError::op("channel.open"))
        })
        .await?;
        *cached = Some(ch.clone());
        Ok(ch)
    }

    /// Claims job `job_id` for claim `claim` of this agent: declares its
    /// marker with our arguments. [`Marker::Ours`] if the marker is ours
    /// now (created, or created by an earlier declaration whose reply was
    /// lost), [`Marker::Theirs`] if another claim holds it. Repeatable.
    ///
    /// # Errors
    /// [`AmqpError`] when the outcome is unknown (not connected, timeout,
    /// connection lost): declare again on the next session.
    pub(crate) async fn claim(&self, job_id: &str, claim: &str) -> Result<Marker, AmqpError> {
        self.claim_as(&self.agent, job_id, claim).await
    }

    async fn claim_as(&self, agent: &str, job_id: &str, claim: &str) -> Result<Marker, AmqpError> {
        let ch = self.channel().await?;
        claim_marker(&ch, &self.topo, job_id, agent, claim, true).await
    }

    /// What the marker of job `job_id` says about claim `claim` of this
    /// agent, without creating one: [`Marker::Absent`] if there is none.
    ///
    /// # Errors
    /// [`AmqpError`] when the broker cannot be asked.
    pub(crate) async fn look(&self, job_id: &str, claim: &str) -> Result<Marker, AmqpError> {
        let ch = self.channel().await?;
        claim_marker(&ch, &self.topo, job_id, &self.agent, claim, false).await
    }

    /// Whether the marker of job `job_id` is the controller's withdrawal
    /// (`vq cancel` of a queued job, [`vq_common::jobs::cancel`]): asked
    /// after a claim found the marker taken.
    ///
    /// # Errors
    /// [`AmqpError`] when the broker cannot be asked.
    pub(crate) async fn withdrawn(&self, job_id: &str) -> Result<bool, AmqpError> {
        let ch = self.channel().await?;
        let m = claim_marker(
            &ch,
            &self.topo,
            job_id,
            WITHDRAWN_AGENT,
            WITHDRAWN_CLAIM,
            false,
        )
        .await?;
        Ok(m == Marker::Ours)
    }

    /// Declares the marker of a job this agent runs again, which restarts
    /// its expiry ([`vq_common::topology::CLAIM_TTL_MS`]).
    ///
    /// # Errors
    /// [`AmqpError`].
    pub(crate) async fn refresh(&self, job_id: &str, claim: &str) -> Result<Marker, AmqpError> {
        self.claim(job_id, claim).await
    }

    /// Deletes the marker of job `job_id` (its result is confirmed and no
    /// copy of it can be queued; see `vq_common::lease::may_delete_marker`).
    /// Deleting a missing marker succeeds.
    ///
    /// # Errors
    /// [`AmqpError`].
    pub(crate) async fn delete(&self, job_id: &str) -> Result<(), AmqpError> {
        let ch = self.channel().await?;
        let queue = self.topo.claim_queue(job_id);
        bounded("delete claim marker", OP_TIMEOUT, async {
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(AmqpError::op("delete claim marker"))
        })
        .await?;
        Ok(())
    }
}
