//! The agent's lease queue `<c>.lease.<agent>` (DESIGN.md, "Leases"):
//! reading it, removing one job's copy, acking and requeueing its messages,
//! and the round trip that confirms acks. Operations only: which copy is
//! kept, recovered or discarded is decided in [`crate::job`].

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Acker, Channel};
use std::time::Duration;
use tokio::sync::watch;
use tracing::{debug, warn};
use vq_common::amqp::{bounded, envelope, AmqpError};
use vq_common::topology::CLAIM_HEADER;

use crate::error::chain;
use crate::report::header_str;

/// Bound on one lease-queue operation.
pub(crate) const LEASE_OP_TIMEOUT: Duration = Duration::from_secs(15);

/// Most messages a lease scan reads (a lease queue holds at most `slots`
/// jobs; more means leftovers of earlier processes).
const MAX_SCAN: usize = 4096;

/// The agent's lease queue and the channel to read it (set by the session
/// loop, `None` while disconnected). One lease operation at a time: a scan
/// or a release holds the messages it read unacked until it is done.
#[derive(Debug)]
pub(crate) struct Leases {
    queue: String,
    channel: watch::Receiver<Option<Channel>>,
    lock: tokio::sync::Mutex<()>,
}

/// The job id of a lease or pool message ([`envelope::job_id_of`]).
pub(crate) fn message_key(d: &Delivery) -> Option<String> {
    envelope::job_id_of(&d.properties, &d.data)
}

impl Leases {
    /// Leases in `queue`, read through the channel published on `channel`.
    pub(crate) fn new(queue: String, channel: watch::Receiver<Option<Channel>>) -> Self {
        Leases {
            queue,
            channel,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The lease queue's name.
    pub(crate) fn queue(&self) -> &str {
        &self.queue
    }

    /// The lease channel, if connected.
    fn current(&self) -> Result<Channel, AmqpError> {
        self.channel
            .borrow()
            .clone()
            .filter(|c| c.status().connected())
            .ok_or_else(|| AmqpError::Timeout {
                what: "lease channel (not connected)".into(),
                secs: 0,
            })
    }

    /// Removes the lease message of job `key` and claim `claim` (a copy
    /// without a claim id matches by job id alone): reads up to `limit`
    /// messages, acks the match, requeues the others, and confirms with a
    /// round trip. `Ok(false)` if no message matched.
    ///
    /// # Errors
    /// [`AmqpError`] if the broker is gone or an operation times out.
    pub(crate) async fn remove(
        &self,
        key: &str,
        claim: Option<&str>,
        limit: usize,
    ) -> Result<bool, AmqpError> {
        let _guard = self.lock.lock().await;
        let ch = self.current()?;
        bounded("release lease", LEASE_OP_TIMEOUT, async {
            let mut others = Vec::new();
            let mut found = false;
            for _ in 0..limit.max(1) {
                let Some(m) = ch
                    .basic_get(
                        self.queue.as_str().into(),
                        BasicGetOptions { no_ack: false },
                    )
                    .await
                    .map_err(AmqpError::op("basic.get lease"))?
                else {
                    break;
                };
                let d = m.delivery;
                let copy_claim = header_str(&d.properties, CLAIM_HEADER);
                let same_claim = match (claim, copy_claim.as_deref()) {
                    (Some(want), Some(have)) => want == have,
                    _ => true,
                };
                if message_key(&d).as_deref() == Some(key) && same_claim {
                    d.acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(AmqpError::op("ack lease"))?;
                    found = true;
                    break;
                }
                others.push(d.acker);
            }
            for a in others {
                requeue_acker(&a).await;
            }
            sync(&ch, &self.queue).await?;
            Ok(found)
        })
        .await
    }
}

/// A synchronous round trip on `ch` (passive declare of `queue`): when it
/// returns, the broker has processed every earlier method on the channel,
/// acks included.
pub(crate) async fn sync(ch: &Channel, queue: &str) -> Result<(), AmqpError> {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(AmqpError::op("passive declare (sync)"))?;
    Ok(())
}

pub(crate) async fn requeue_acker(a: &Acker) {
    let r = a
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await;
    match r {
        Ok(true) => {}
        Ok(false) => debug!("cannot requeue: the channel is gone (the broker requeues it)"),
        Err(e) => warn!(error = %chain(&e), "cannot requeue a message"),
    }
}

/// A lease scan in progress: every message of the lease queue read and held
/// unacked (so no other lease operation runs meanwhile). The caller acks
/// or requeues each of [`Scan::held`], then calls [`Scan::finish`].
pub(crate) struct Scan<'a> {
    _guard: tokio::sync::MutexGuard<'a, ()>,
    ch: Channel,
    queue: &'a str,
    /// The messages read, unacked.
    pub(crate) held: Vec<Delivery>,
}

impl Leases {
    /// Reads (at most [`MAX_SCAN`]) every message of the lease queue and
    /// holds them unacked.
    ///
    /// # Errors
    /// [`AmqpError`] if the broker is gone or an operation times out.
    pub(crate) async fn scan(&self) -> Result<Scan<'_>, AmqpError> {
        let guard = self.lock.lock().await;
        let ch = self.current()?;
        let mut held = Vec::new();
        for _ in 0..MAX_SCAN {
            let got = bounded("scan lease queue", LEASE_OP_TIMEOUT, async {
                ch.basic_get(
                    self.queue.as_str().into(),
                    BasicGetOptions { no_ack: false },
                )
                .await
                .map_err(AmqpError::op("basic.get lease"))
            })
            .await?;
            match got {
                Some(m) => held.push(m.delivery),
                None => break,
            }
        }
        Ok(Scan {
            _guard: guard,
            ch,
            queue: &self.queue,
            held,
        })
    }
}

impl Scan<'_> {
    /// Confirms every ack and requeue of the scan with a round trip, and
    /// ends it.
    ///
    /// # Errors
    /// [`AmqpError`] if the broker is gone or the round trip times out.
    pub(crate) async fn finish(self) -> Result<(), AmqpError> {
        bounded(
            "sync lease queue",
            LEASE_OP_TIMEOUT,
            sync(&self.ch, self.queue),
        )
        .await
    }
}

/// Acks one message read from the lease queue.
///
/// # Errors
/// [`AmqpError`] if the broker is gone or the ack times out.
pub(crate) async fn ack_lease(d: &Delivery) -> Result<(), AmqpError> {
    bounded("ack lease", LEASE_OP_TIMEOUT, async {
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(AmqpError::op("ack lease"))
    })
    .await?;
    Ok(())
}
