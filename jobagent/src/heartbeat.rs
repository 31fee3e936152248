//! Heartbeats (`agent.<pool>.heartbeat`) and the drained report
//! (`agent.<pool>.drained`).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};
use vq_common::amqp::json_properties;
use vq_common::messages::{unix_now, Heartbeat, Message, SCHEMA_VERSION};
use vq_common::topology::agent_event_key;

use crate::ctx::Ctx;
use crate::error::chain;

/// The agent's heartbeat now.
pub fn heartbeat(ctx: &Ctx) -> Heartbeat {
    let s = ctx.shared.snapshot();
    Heartbeat {
        schema: SCHEMA_VERSION,
        agent: ctx.agent.clone(),
        pool: ctx.cfg.pool.clone(),
        host: ctx.host.clone(),
        state: s.state,
        slots: ctx.cfg.slots,
        running: s.running,
        is_pull: s.is_pull,
        is_del: s.is_del,
        idle_secs: s.idle_secs,
        interval_secs: ctx.cfg.heartbeat_secs,
        at: unix_now(),
        version: env!("CARGO_PKG_VERSION").into(),
        drain_reason: s.drain_reason,
    }
}

/// Publishes a heartbeat every `heartbeat_secs` (and when asked through
/// `Shared::heartbeat_now`) until `stop`. A heartbeat that cannot be
/// published is skipped, not queued: the next one supersedes it. While the
/// broker blocks publishing (resource alarm) no heartbeat is sent; the
/// controller does not judge agents by heartbeats then (it sees the alarm
/// on its own connection).
pub(crate) async fn heartbeat_loop(ctx: Arc<Ctx>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(ctx.cfg.heartbeat_secs));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let key = agent_event_key(&ctx.cfg.pool, "heartbeat");
    let exchange = ctx.topo.events_exchange();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = ctx.shared.heartbeat_now.notified() => {}
            _ = stop.cancelled() => return,
        }
        if ctx.publisher.is_blocked() {
            // It would wait in the blocked connection and arrive stale;
            // the first heartbeat after `connection.unblocked` replaces it.
            debug!("heartbeat skipped: the broker blocks publishing");
            continue;
        }
        let hb = heartbeat(&ctx);
        match ctx
            .publisher
            .publish_once(
                &exchange,
                &key,
                &hb.encode(),
                json_properties::<Heartbeat>(),
            )
            .await
        {
            Ok(()) => ctx.metrics.heartbeat_sent(hb.at),
            Err(e) => debug!(error = %chain(&e), "heartbeat not published"),
        }
    }
}

/// After the first drain request (of generation `epoch`): waits for
/// running jobs to end, marks the agent deletable and publishes
/// `agent.<pool>.drained` (a heartbeat body with state `drained`); does
/// nothing if the drain was resumed meanwhile
/// ([`crate::state::Shared::finish_drain`]).
pub(crate) async fn report_drained(ctx: Arc<Ctx>, epoch: u64) {
    ctx.shared.wait_idle().await;
    if !ctx.shared.finish_drain(epoch) {
        debug!(pool = %ctx.cfg.pool, "drain resumed before it finished: no drained report");
        return;
    }
    info!(pool = %ctx.cfg.pool, "drained: no job left, not pulling");
    let hb = heartbeat(&ctx);
    ctx.publisher
        .publish_message_reliably(
            &ctx.topo.events_exchange(),
            &agent_event_key(&ctx.cfg.pool, "drained"),
            &hb,
        )
        .await;
}
