//! vq controller library: the stateless reconcile loop (`vq-controller`).
//! The user/admin CLI `vq` is the crate `vq-cli` (`cli/`).
//!
//! The loop (STYLE.md practice 4) is observe ([`observe`]), plan
//! ([`plan`], pure) and act ([`act`]), driven per pool by [`reconcile`];
//! [`openstack`] talks to Keystone/Nova/Glance, [`broker`] to RabbitMQ, and
//! [`http`] serves `/healthz`, `/status` ([`status`]) and `/metrics`.

#![forbid(unsafe_code)]

pub mod act;
pub mod backoff;
pub mod broker;
pub mod dead_watch;
pub mod error;
pub mod events;
pub mod fence;
pub mod http;
pub mod observe;
pub mod openstack;
pub mod plan;
pub mod policy;
pub mod reconcile;
pub mod status;

pub use reconcile::run;
