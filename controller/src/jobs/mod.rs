//! The job table (issue "The job table"; DESIGN.md, "The job table and the
//! operator's view"): [`table`] folds job events into one record per job,
//! [`feed`] keeps it current from the event stream with every broker
//! session, [`http`] serves it read-only at `/jobs`.

pub mod feed;
pub mod http;
pub mod slots;
pub mod table;

pub use feed::{JobsView, SharedJobs};
pub use table::{Filter, JobRecord, JobTable, State};
