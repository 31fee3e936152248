//! Leadership: of several controllers of one cluster, exactly one acts.
//!
//! The lock is the exclusive queue `<c>.controller.lock` (AMQP 0-9-1
//! `exclusive`: only the connection that declared it may use it, and the
//! broker deletes it when that connection closes or misses its heartbeats),
//! held on a connection of its own that does nothing else. Every cycle a
//! controller either proves the lock (passive declare on that connection)
//! or tries to take it (active, exclusive declare; another holder makes the
//! broker answer `RESOURCE_LOCKED`).
//!
//! A holder *proves* it holds the lock by a broker round trip on the lock's
//! connection: [`Leadership::prove`] runs right before every cloud create
//! and delete, every drain ask and every fencing step ([`Gated`]), and
//! refuses when the round trip does not come back within
//! [`Leadership::bound`] (half the AMQP heartbeat). The broker cannot give
//! the lock away before it has heard nothing from that connection for a
//! heartbeat timeout, counted from a frame sent no earlier than the proof's
//! request, so a proven holder's action starts while it still holds the
//! lock. A controller that takes over after having seen the lock held by
//! another waits [`Leadership::bound`] more before its first action: an old
//! holder whose connection the broker closed at once (a TCP reset) has
//! started its last proven action by then. DESIGN.md, "More than one", has
//! the timing argument with the numbers.
//!
//! A controller that loses the lock stops acting (it does not exit): it
//! keeps observing and serving `/status`, `/metrics`, `/jobs` and the page
//! as a standby, and tries to take the lock again every cycle.

use std::sync::Mutex as StdMutex;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tokio::time::Instant;
use vq_common::amqp::{self, AmqpError};
use vq_common::config::BrokerConfig;
use vq_common::messages::Control;

use crate::broker::{BrokerApi, EventSnapshot, FenceReport, Messenger};
use crate::error::CloudError;
use crate::openstack::{CloudApi, CreateServer, Quota, Server};

/// What a controller is doing in a cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Holds the lock and acts.
    Leader,
    /// Observes and serves status only (another controller holds the lock,
    /// the broker is unreachable, or it is taking over and waits out the
    /// old holder's proof bound).
    #[default]
    Standby,
}

impl Role {
    /// `leader` or `standby`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Standby => "standby",
        }
    }
}

/// The lock queue of `cluster`: `<c>.controller.lock` (covered by the
/// controller account's `<c>\..*` configure permission).
pub fn lock_queue(cluster: &str) -> String {
    format!("{cluster}.controller.lock")
}

/// Why a controller may not act now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotLeader(pub String);

impl std::fmt::Display for NotLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not the acting controller: {}", self.0)
    }
}

struct Session {
    conn: Connection,
    channel: Option<Channel>,
}

#[derive(Debug, Default)]
struct State {
    /// Holding the lock (declared it and every proof since succeeded).
    held: bool,
    /// When this process last saw the lock held by another controller.
    seen_other: Option<Instant>,
    /// Not acting before this instant (taking over).
    act_from: Option<Instant>,
    /// Why the last step left us standby.
    why: String,
}

/// The controller lock of one cluster (see the module doc).
pub struct Leadership {
    cfg: BrokerConfig,
    queue: String,
    bound: Duration,
    session: Mutex<Option<Session>>,
    state: StdMutex<State>,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("queue", &self.queue)
            .field("bound", &self.bound)
            .finish_non_exhaustive()
    }
}

impl Leadership {
    /// The lock of `cluster` on the broker of `cfg`. Does no I/O. The proof
    /// bound is half of `cfg.heartbeat_secs` (at least 0.5 s; 5 s when
    /// heartbeats are off, which leaves a partitioned holder's lock to TCP
    /// keepalive: run HA controllers with heartbeats on).
    pub fn new(cfg: BrokerConfig, cluster: &str) -> Self {
        let bound = if cfg.heartbeat_secs == 0 {
            Duration::from_secs(5)
        } else {
            Duration::from_secs_f64((f64::from(cfg.heartbeat_secs) / 2.0).max(0.5))
        };
        Leadership {
            cfg,
            queue: lock_queue(cluster),
            bound,
            session: Mutex::new(None),
            state: StdMutex::new(State {
                why: "not tried yet".into(),
                ..State::default()
            }),
        }
    }

    /// The proof bound: a proof's round trip must come back within it, and
    /// a controller taking over waits it out before acting.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the controller is standby (after a [`Leadership::step`] that
    /// returned [`Role::Standby`]).
    pub fn why_standby(&self) -> String {
        self.state().why.clone()
    }

    /// A cycle's leadership step: proves the lock if held, else tries to
    /// take it. Returns the role for this cycle; never fails (a broker that
    /// cannot be reached makes a standby).
    pub async fn step(&self) -> Role {
        let held = self.state().held;
        if held {
            if let Err(e) = self.prove().await {
                tracing::warn!(reason = %e, "controller lock lost: acting no more (standby)");
                return Role::Standby;
            }
        } else if let Err(why) = self.try_take().await {
            self.state().why = why;
            return Role::Standby;
        }
        let mut st = self.state();
        match st.act_from {
            Some(t) if Instant::now() < t => {
                st.why = format!(
                    "took the controller lock; waiting {:.1} s (the old holder's proof bound) before acting",
                    (t - Instant::now()).as_secs_f64()
                );
                Role::Standby
            }
            _ => Role::Leader,
        }
    }

    /// Connects if needed and declares the lock queue exclusively.
    async fn try_take(&self) -> Result<(), String> {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| !s.conn.status().connected()) {
            *guard = None;
        }
        if guard.is_none() {
            let conn = amqp::connect(&self.cfg, "vq-controller-lock")
                .await
                .map_err(|e| format!("broker unreachable: {}", vq_common::error::chain(&e)))?;
            *guard = Some(Session {
                conn,
                channel: None,
            });
        }
        let s = guard.as_mut().expect("session");
        if s.channel.as_ref().is_none_or(|c| !c.status().connected()) {
            match s.conn.create_channel().await {
                Ok(ch) => s.channel = Some(ch),
                Err(e) => {
                    // A fresh connection next cycle (a refused declare
                    // closes its channel: a standby opens one per try).
                    *guard = None;
                    return Err(format!(
                        "cannot open a channel for the controller lock: {e}"
                    ));
                }
            }
        }
        let ch = s.channel.clone().expect("channel");
        let declared = amqp::bounded("declare the controller lock", self.bound, async {
            ch.queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::op("queue.declare exclusive"))
        })
        .await;
        match declared {
            Ok(_) => {
                let now = Instant::now();
                let mut st = self.state();
                st.held = true;
                // Seen held by another: that one may still be finishing its
                // last proven action.
                st.act_from = st.seen_other.map(|_| now + self.bound);
                tracing::info!(
                    lock = %self.queue,
                    wait_secs = st.act_from.map_or(0.0, |t| (t - now).as_secs_f64()),
                    "took the controller lock: this controller acts (leader)"
                );
                Ok(())
            }
            Err(e) => {
                s.channel = None;
                let text = vq_common::error::chain(&e);
                let locked = text.contains("RESOURCE_LOCKED") || text.contains("405");
                if locked {
                    self.state().seen_other = Some(Instant::now());
                    Err(format!(
                        "another controller holds the lock {} (standby)",
                        self.queue
                    ))
                } else {
                    Err(format!("cannot take the lock {}: {text}", self.queue))
                }
            }
        }
    }

    /// Proves the lock is held: a passive declare of the lock queue on the
    /// lock's connection, answered within [`Leadership::bound`]. On failure
    /// the lock counts as lost (the connection is dropped, so the broker
    /// frees the queue) and this controller is standby until it takes the
    /// lock again.
    ///
    /// # Errors
    /// [`NotLeader`] with the reason (not holding, not connected, the
    /// round trip failed or was too slow).
    pub async fn prove(&self) -> Result<(), NotLeader> {
        if !self.state().held {
            let why = self.state().why.clone();
            return Err(NotLeader(why));
        }
        let mut guard = self.session.lock().await;
        let ch = guard
            .as_ref()
            .filter(|s| s.conn.status().connected())
            .and_then(|s| s.channel.clone())
            .filter(|c| c.status().connected());
        let result = match ch {
            None => Err("the lock's connection is down".to_string()),
            Some(ch) => amqp::bounded("prove the controller lock", self.bound, async {
                ch.queue_declare(
                    self.queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(AmqpError::op("queue.declare passive"))
            })
            .await
            .map(|_| ())
            .map_err(|e| vq_common::error::chain(&e)),
        };
        match result {
            Ok(()) => Ok(()),
            Err(why) => {
                if let Some(s) = guard.take() {
                    // Not awaited for long: a partitioned broker does not
                    // answer; dropping the connection ends it anyway.
                    let _ = tokio::time::timeout(
                        Duration::from_millis(200),
                        s.conn.close(200, "controller lock lost".into()),
                    )
                    .await;
                }
                let mut st = self.state();
                st.held = false;
                st.act_from = None;
                st.why = format!("cannot prove the controller lock: {why}");
                Err(NotLeader(st.why.clone()))
            }
        }
    }

    /// Releases the lock (closes its connection) at shutdown, so that a
    /// standby takes over within one cycle.
    pub async fn release(&self) {
        if let Some(s) = self.session.lock().await.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                s.conn.close(200, "controller shutting down".into()),
            )
            .await;
        }
        self.state().held = false;
    }
}

/// A cloud or broker client whose acting calls (create, delete; drain ask,
/// fence mark, fence) first [`Leadership::prove`] the lock; reads pass
/// through. Without a lock (`None`, a single controller in unit tests) it
/// is the client as it is.
#[derive(Debug)]
pub struct Gated<T> {
    inner: T,
    lock: Option<std::sync::Arc<Leadership>>,
}

impl<T> Gated<T> {
    /// `inner` gated by `lock`.
    pub fn new(inner: T, lock: Option<std::sync::Arc<Leadership>>) -> Self {
        Gated { inner, lock }
    }

    /// The client itself.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    async fn check(&self) -> Result<(), NotLeader> {
        match &self.lock {
            None => Ok(()),
            Some(l) => l.prove().await,
        }
    }
}

fn amqp_refused(op: &str, e: NotLeader) -> AmqpError {
    AmqpError::Timeout {
        what: format!("{op} not done: {e}"),
        secs: 0,
    }
}

impl<C: CloudApi> CloudApi for Gated<C> {
    async fn list_servers(&self, tag: &str) -> Result<Vec<Server>, CloudError> {
        self.inner.list_servers(tag).await
    }
    async fn create_server(&self, req: &CreateServer) -> Result<String, CloudError> {
        self.check().await.map_err(|e| CloudError::NotLeader {
            op: "create server".into(),
            why: e.0,
        })?;
        self.inner.create_server(req).await
    }
    async fn delete_server(&self, id: &str) -> Result<(), CloudError> {
        self.check().await.map_err(|e| CloudError::NotLeader {
            op: format!("delete server {id}"),
            why: e.0,
        })?;
        self.inner.delete_server(id).await
    }
    async fn resolve_flavor(&self, name: &str) -> Result<String, CloudError> {
        self.inner.resolve_flavor(name).await
    }
    async fn resolve_image(&self, name: &str) -> Result<String, CloudError> {
        self.inner.resolve_image(name).await
    }
    async fn quota(&self) -> Result<Quota, CloudError> {
        self.inner.quota().await
    }
}

impl<B: BrokerApi> Messenger for Gated<B> {
    async fn send_control(&self, agent: &str, msg: &Control) -> Result<(), AmqpError> {
        self.check()
            .await
            .map_err(|e| amqp_refused(&format!("control message to {agent}"), e))?;
        self.inner.send_control(agent, msg).await
    }
    async fn mark_fence(&self, agent: &str) -> Result<(), AmqpError> {
        self.check()
            .await
            .map_err(|e| amqp_refused(&format!("fence mark of {agent}"), e))?;
        self.inner.mark_fence(agent).await
    }
}

impl<B: BrokerApi> BrokerApi for Gated<B> {
    async fn ensure_connected(&self) -> Result<(), AmqpError> {
        self.inner.ensure_connected().await
    }
    async fn queue_depth(&self, pool: &str) -> Result<u64, AmqpError> {
        self.inner.queue_depth(pool).await
    }
    fn snapshot(&self, now: Instant) -> EventSnapshot {
        self.inner.snapshot(now)
    }
    fn blocked(&self) -> Option<String> {
        self.inner.blocked()
    }
    async fn probe(&self) -> Result<(), AmqpError> {
        self.inner.probe().await
    }
    async fn pending_fences(&self) -> Result<Vec<String>, AmqpError> {
        self.inner.pending_fences().await
    }
    async fn registered_agents(&self) -> Result<Vec<(String, String)>, AmqpError> {
        self.inner.registered_agents().await
    }
    async fn take_demand(&self, on: bool) {
        self.inner.take_demand(on).await
    }
    async fn fence(&self, agent: &str, loss_limit: u32) -> Result<FenceReport, AmqpError> {
        self.check()
            .await
            .map_err(|e| amqp_refused(&format!("fence of {agent}"), e))?;
        self.inner.fence(agent, loss_limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proof_bound_is_half_the_amqp_heartbeat() {
        let lock = |hb| {
            Leadership::new(
                BrokerConfig {
                    heartbeat_secs: hb,
                    ..Default::default()
                },
                "vq",
            )
        };
        assert_eq!(lock(15).bound(), Duration::from_millis(7500));
        assert_eq!(lock(1).bound(), Duration::from_millis(500));
        assert_eq!(lock(0).bound(), Duration::from_secs(5));
        assert_eq!(lock_queue("vq"), "vq.controller.lock");
    }

    #[tokio::test]
    async fn a_lock_never_taken_refuses_every_action() {
        let l = Leadership::new(BrokerConfig::default(), "vq");
        let e = l.prove().await.unwrap_err();
        assert!(e.to_string().contains("not the acting controller"), "{e}");
    }
}
