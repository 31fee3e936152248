//! The job table (DESIGN.md, "The job table and the operator's view"):
//! [`table`] is the one fold of job events into one record per job (the
//! controller keeps it current from the event stream, `vq stat
//! --from-stream` and `vq cancel` build it from one read of the stream);
//! [`query`] holds the messages with which `vq stat` asks the controller
//! for a page of it over AMQP, and the rule of who sees which job;
//! [`depend`] decides when a held job may run.

pub mod cancel;
pub mod depend;
pub mod query;
pub mod table;

pub use query::{answer, JobPage, JobQuery, Visibility, DEFAULT_PAGE, MAX_PAGE};
pub use table::{Filter, FindError, JobBrief, JobRecord, JobTable, State};
