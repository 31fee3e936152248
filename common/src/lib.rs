//! `vq-common`: what the vq controller, the jobagent, the `vq` CLI and
//! bridges share.
//!
//! * [`messages`]: versioned JSON wire types (job, job event, heartbeat,
//!   demand, control, delete answer) and their JSON Schemas;
//! * [`jobs`]: the job table (the one fold of job events) and the
//!   messages of a job-table query;
//! * [`pools`]: the pools' published limits (slots, max walltime, memory
//!   per VM), the query that asks for them and the rule that refuses a job
//!   larger than its pool;
//! * [`topology`]: exchange, queue and routing-key names and queue arguments;
//! * [`config`]: config structs, `VQ_*` overrides and `validate()`;
//! * [`pbs`]: `#PBS` directive and walltime parsing;
//! * [`lease`]: lease fate and claim ownership rules both daemons apply;
//! * [`backoff`]: the one capped, jittered backoff;
//! * [`error`]: [`ConfigError`] and [`error::chain`], the one renderer of
//!   an error's cause chain;
//! * [`tls`]: every rule and check of a broker connection's TLS files (with
//!   feature `amqp` parsed with rustls, and the connection's TLS built);
//! * `amqp` (feature `amqp`): connect, declare, publish with a confirm,
//!   subscribe; `amqp::envelope`: lease-copy and dead-letter properties,
//!   the job id of a delivery;
//! * `logging` (feature `logging`): the daemons' log set-up,
//!   `--log-format text|json`.
//!
//! Everything but `amqp` and `logging` is pure: no I/O beyond reading a named config file
//! and the TLS files it names (and the random jitter of a backoff).

#![forbid(unsafe_code)]

pub mod amqp_url;
pub mod backoff;
pub mod config;
pub mod error;
pub mod jobs;
pub mod lease;
pub mod messages;
pub mod pbs;
pub mod pools;
pub mod text;
pub mod tls;
pub mod topology;

#[cfg(feature = "amqp")]
pub mod amqp;

#[cfg(feature = "logging")]
pub mod logging;

pub use error::ConfigError;
