//! [`Ctx`]: everything the agent's tasks share, built once by
//! [`crate::run`] and handed to the session, job and heartbeat tasks as an
//! `Arc`. It lives apart from `lib.rs` so that those modules import it
//! from a sibling, not from the module that runs them.

use tokio::sync::watch;
use vq_common::config::AgentConfig;
use vq_common::topology::Topology;

use crate::{claim, lease, metrics, report, state, sys};

/// Everything the agent's tasks share.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub(crate) cfg: AgentConfig,
    pub(crate) topo: Topology,
    pub(crate) agent: String,
    pub(crate) host: String,
    pub(crate) shared: state::Shared,
    pub(crate) publisher: report::Publisher,
    /// Job events, results and dead letters ([`report::Reporter`]).
    pub(crate) reporter: report::Reporter,
    pub(crate) leases: lease::Leases,
    /// Claim markers (who owns a job), on the consuming connection.
    pub(crate) markers: claim::Markers,
    /// Generation of the broker session, raised each time a session's
    /// channels are up; a claim whose outcome is unknown waits for the next.
    pub(crate) session: watch::Sender<u64>,
    /// Set when an outcome is unknown: the session ends (so the broker
    /// returns its unacked deliveries) and the next one resolves it.
    pub(crate) restart_session: std::sync::atomic::AtomicBool,
    /// Set when the broker refused an operation whose failure ended the
    /// session (a missing permission, inequivalent arguments): refusals
    /// repeat, so the next session waits with a growing backoff.
    pub(crate) session_refused: std::sync::atomic::AtomicBool,
    pub(crate) outbox: report::Outbox,
    pub(crate) sys: sys::HostSys,
    /// Whether this process has put its id into the agent registry
    /// (`Topology::agents_queue`), which it does before its first claim.
    pub(crate) registered: std::sync::atomic::AtomicBool,
    /// Set when a claim finds the lease queue gone (deleted by a fence):
    /// the session ends, and the next one declares the queue again and
    /// registers again.
    pub(crate) lease_queue_gone: std::sync::atomic::AtomicBool,
    /// What `/metrics` serves (counted whether it is served or not).
    pub(crate) metrics: metrics::Metrics,
}
