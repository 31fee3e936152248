//! The job table (issue "The job table"; DESIGN.md, "The job table and the
//! operator's view"): the fold itself is [`vq_common::jobs::table`] (the
//! one copy, shared with the CLI); [`feed`] keeps it current from the event
//! stream with every broker session, [`http`] serves it read-only at
//! `/jobs`, [`queries`] answers `vq stat`'s queries over AMQP, [`pending`]
//! says why queued jobs wait, [`held`] releases or cancels held jobs.

pub mod feed;
pub mod held;
pub mod http;
pub mod pending;
pub mod queries;
pub mod slots;

pub use feed::{JobsView, SharedJobs};
pub use vq_common::jobs::{Filter, JobRecord, JobTable, State};
