//! vq controller library: the stateless reconcile loop (`vq-controller`).
//! The user/admin CLI `vq` is the crate `vq-cli` (`cli/`).
//!
//! The loop (STYLE.md practice 4) is observe ([`observe`]: every read,
//! the whole view of each pool), plan ([`plan`], pure) and act ([`act`]),
//! with an explicit error policy ([`policy`]), driven per pool by
//! [`reconcile`], which then fences lost agents ([`fence`]) and publishes
//! the outcome ([`status`], [`metrics`], with the boot and drain
//! [`timings`]); [`openstack`] talks to Keystone/Nova/Glance, [`broker`]
//! to RabbitMQ (what it hears goes into the event book, [`events`]), and
//! [`http`] serves `/healthz`, `/readyz`, `/status`, `/metrics` and the
//! status page `/` ([`page`]).

#![forbid(unsafe_code)]

pub mod act;
pub mod backoff;
pub mod breaker;
pub mod broker;
pub mod dead_watch;
pub mod deletes;
pub mod error;
pub mod events;
pub mod fence;
pub mod http;
pub mod jobs;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod openstack;
pub mod page;
pub mod plan;
pub mod policy;
pub mod preflight;
pub mod reconcile;
pub mod status;
pub mod timings;

pub use reconcile::run;
