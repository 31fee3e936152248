//! The broker's queues of agent ids: the durable fence queue (who is being
//! fenced, [`Broker::mark_fence`], [`Broker::pending_fences`]) and the agent
//! registry ([`Broker::registered_agents`]). Entries are read by taking
//! them unacked and closing the channel, which returns them all.

use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::{BasicProperties, Channel};
use vq_common::amqp::{self, bounded, header_str, AmqpError};
use vq_common::topology::POOL_HEADER;

use super::{Broker, OP_TIMEOUT};

impl Broker {
    /// Records (durably, confirmed) that `agent` is being fenced: call it
    /// before deleting its server.
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn mark_fence(&self, agent: &str) -> Result<(), AmqpError> {
        let channel = self.channel().await?;
        amqp::publish_confirmed(
            &channel,
            &self.topo.fence_exchange(),
            &self.topo.fence_queue(),
            agent.as_bytes(),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("text/plain".into()),
            true,
            Duration::from_secs(self.cfg.confirm_timeout_secs),
        )
        .await
    }

    /// Agent ids in the fence queue (deduplicated, sorted).
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn pending_fences(&self) -> Result<Vec<String>, AmqpError> {
        self.read_ids(&self.topo.fence_queue()).await
    }

    /// Entries of the agent registry ([`Topology::agents_queue`](vq_common::topology::Topology::agents_queue)):
    /// `(agent id, pool)`, deduplicated and sorted; entries without a pool
    /// header get pool `""` (they match no configured pool).
    ///
    /// # Errors
    /// [`AmqpError`].
    pub async fn registered_agents(&self) -> Result<Vec<(String, String)>, AmqpError> {
        let mut out: Vec<(String, String)> = self
            .read_entries(&self.topo.agents_queue())
            .await?
            .into_iter()
            .map(|(agent, pool)| (agent, pool.unwrap_or_default()))
            .collect();
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Reads every entry (an agent id) of `queue` and returns them all to
    /// it; deduplicated and sorted.
    async fn read_ids(&self, queue: &str) -> Result<Vec<String>, AmqpError> {
        let mut out: Vec<String> = self
            .read_entries(queue)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Reads every entry of `queue` (body: an agent id; header
    /// [`POOL_HEADER`]: its pool, if set) and returns them all to it.
    async fn read_entries(&self, queue: &str) -> Result<Vec<(String, Option<String>)>, AmqpError> {
        let ch = self.fresh_channel().await?;
        let r = bounded(&format!("read {queue}"), OP_TIMEOUT, async {
            let mut out = Vec::new();
            while let Some(m) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(AmqpError::op("basic.get (agent ids)"))?
            {
                out.push((
                    String::from_utf8_lossy(&m.delivery.data).into_owned(),
                    header_str(&m.delivery.properties, POOL_HEADER),
                ));
                if out.len() > 10_000 {
                    break;
                }
            }
            Ok(out)
        })
        .await;
        // Closing the channel returns every entry read to the queue.
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "read".into())).await;
        r
    }

    /// Removes every entry `agent` from `queue` (the fence queue or the
    /// agent registry), returning the others.
    pub(super) async fn remove_entries(
        &self,
        ch: &Channel,
        queue: &str,
        agent: &str,
    ) -> Result<(), AmqpError> {
        bounded(&format!("remove {agent} from {queue}"), OP_TIMEOUT, async {
            let mut others = Vec::new();
            while let Some(m) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(AmqpError::op("basic.get (agent ids)"))?
            {
                if m.delivery.data == agent.as_bytes() {
                    m.delivery
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(AmqpError::op("ack fence entry"))?;
                } else {
                    others.push(m.delivery.acker);
                }
                if others.len() > 10_000 {
                    break;
                }
            }
            for a in others {
                a.nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .map_err(AmqpError::op("requeue fence entry"))?;
            }
            Ok(())
        })
        .await
    }
}
