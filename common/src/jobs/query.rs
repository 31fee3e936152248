//! A job-table query over AMQP (`vq stat` → controller) and its answer.
//!
//! The requester publishes a [`JobQuery`] to the control exchange
//! `<c>.control` with the routing key [`Topology::job_query_key`]
//! (`<c>.query.jobs`: it contains dots, so it is no agent id and reaches no
//! agent), its own broker user as `user_id` (RabbitMQ refuses a publish
//! whose `user_id` is not the connection's user, so it cannot be forged),
//! a `correlation_id`, and as `reply_to` the name of an exclusive
//! server-named queue (`amq.gen-…`) it bound to the replies exchange
//! `<c>.replies` with that name as the routing key. The controller
//! answers one [`JobPage`] to `<c>.replies` with routing key = `reply_to`
//! and the same `correlation_id`. Nothing goes to the default exchange.
//!
//! Who sees what follows Torque's `query_other_jobs` ([`Visibility`]).
//!
//! [`Topology::job_query_key`]: crate::topology::Topology::job_query_key

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::table::{own, Filter, FindError, JobRecord, JobTable, State};
use crate::messages::{DecodeError, Message, SCHEMA_VERSION};

/// Rows of a page when the query names no `limit`.
pub const DEFAULT_PAGE: u32 = 500;

/// Largest page a controller answers (rows); a larger `limit` is cut to it.
pub const MAX_PAGE: u32 = 1000;

fn schema_version() -> u32 {
    SCHEMA_VERSION
}

/// What `vq stat` asks the controller (message kind `job-query`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct JobQuery {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Jobs named by id or unique id prefix (`vq stat ID…`); empty: every
    /// job that passes the filters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    /// Only jobs of this owner (`-u USER`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Only jobs in these states (empty: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<State>,
    /// Only jobs of this pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The `next` cursor of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// Rows wanted, 1–[`MAX_PAGE`] (default [`DEFAULT_PAGE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// The controller's answer to a [`JobQuery`] (message kind `job-page`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobPage {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Whether the table had caught up with the event stream of the
    /// controller's broker session when it answered (false while it is
    /// rebuilt after a start or a reconnect: rows may be missing or stale).
    pub complete: bool,
    /// The broker user the answer is for (the request's validated
    /// `user_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<String>,
    /// Whether the requester sees every user's jobs (an operator, or
    /// `query_other_jobs = true`).
    #[serde(default)]
    pub sees_all: bool,
    /// The jobs, in order of submission.
    #[serde(default)]
    pub jobs: Vec<JobRecord>,
    /// Cursor of the next page (`after` of the next query); `None`: last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u64>,
    /// Why the query was refused (no `user_id`, a malformed query, a job
    /// id unknown, ambiguous or not the requester's); `jobs` is then empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Message for JobQuery {
    const KIND: &'static str = "job-query";
    fn schema(&self) -> u32 {
        self.schema
    }
}

impl Message for JobPage {
    const KIND: &'static str = "job-page";
    fn schema(&self) -> u32 {
        self.schema
    }
}

impl JobPage {
    /// A refusal: no rows, `error` set.
    pub fn refusal(complete: bool, requester: Option<&str>, error: impl Into<String>) -> JobPage {
        JobPage {
            schema: SCHEMA_VERSION,
            complete,
            requester: requester.map(str::to_string),
            sees_all: false,
            jobs: Vec::new(),
            next: None,
            error: Some(error.into()),
        }
    }
}

/// Who sees which job: the controller's `[jobs] query_other_jobs` and
/// `[jobs] operators`, with Torque's meaning. With `query_other_jobs =
/// false` (Torque's default) a broker user sees only its own jobs: those it
/// submitted or whose owner (Unix user) has its name; the broker users in
/// `operators` (Torque's managers and operators) see every job. With
/// `query_other_jobs = true` everybody sees every job.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Visibility {
    /// Torque's `query_other_jobs`.
    pub query_other_jobs: bool,
    /// Broker users that see every job.
    pub operators: Vec<String>,
}

impl Visibility {
    /// Whether `user` sees every job.
    pub fn sees_all(&self, user: &str) -> bool {
        self.query_other_jobs || self.operators.iter().any(|o| o == user)
    }
}

/// The answer to `body` (a [`JobQuery`]) from `table` for the broker user
/// `user_id` (the delivery's broker-validated `user_id`; `None` is refused:
/// nobody can be told apart). `complete` is the table's
/// [`JobPage::complete`].
pub fn answer(
    table: &JobTable,
    complete: bool,
    vis: &Visibility,
    user_id: Option<&str>,
    body: &[u8],
) -> JobPage {
    let Some(user) = user_id.filter(|u| !u.is_empty()) else {
        return JobPage::refusal(
            complete,
            None,
            "the query carries no user_id: publish it with the user_id property set to your broker user (the broker checks it), so the controller knows whose jobs to show",
        );
    };
    let q = match JobQuery::decode(body) {
        Ok(q) => q,
        Err(e) => {
            let why = match &e {
                DecodeError::Malformed { source, .. } => format!("{e}: {source}"),
                _ => e.to_string(),
            };
            return JobPage::refusal(complete, Some(user), why);
        }
    };
    let sees_all = vis.sees_all(user);
    let mut page = JobPage {
        schema: SCHEMA_VERSION,
        complete,
        requester: Some(user.to_string()),
        sees_all,
        jobs: Vec::new(),
        next: None,
        error: None,
    };
    if !q.ids.is_empty() {
        for id in &q.ids {
            match table.find_for(id, user, sees_all) {
                Ok(r) if sees_all || own(&r, user) => page.jobs.push(r),
                Ok(r) => {
                    return JobPage::refusal(
                        complete,
                        Some(user),
                        format!(
                            "job {} is not yours (owner {}): the controller's [jobs] query_other_jobs is off and {user:?} is not in [jobs] operators",
                            r.id, r.owner
                        ),
                    )
                }
                Err(FindError::Unknown) => {
                    let mut why = format!("unknown job id {id:?}");
                    if !complete {
                        why.push_str(" (the controller is still reading the event stream)");
                    }
                    return JobPage::refusal(complete, Some(user), why);
                }
                Err(FindError::Ambiguous(ids)) => {
                    return JobPage::refusal(
                        complete,
                        Some(user),
                        format!("job id {id:?} is ambiguous: {}", ids.join(", ")),
                    )
                }
            }
        }
        return page;
    }
    let filter = Filter {
        owner: q.owner.clone(),
        states: q.states.clone(),
        pool: q.pool.clone(),
        visible_to: (!sees_all).then(|| user.to_string()),
    };
    let limit = q.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE) as usize;
    let (rows, next) = table.query(&filter, q.after, limit);
    page.jobs = rows;
    page.next = next;
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{JobEvent, JobRequest, JobState};

    fn table() -> JobTable {
        let mut t = JobTable::new();
        for (id, owner, submitter) in [
            ("a1", "alice", "bridge"),
            ("b1", "bob", "bob"),
            ("a2", "alice", "alice"),
        ] {
            let mut e = JobEvent::about(
                None,
                id,
                "p",
                "",
                Some(submitter),
                JobState::Queued {
                    request: JobRequest::default(),
                },
            );
            e.owner = owner.into();
            e.submission = Some("s".into());
            e.submitter = Some(submitter.into());
            t.apply(&e, Some(&e.message_id()));
        }
        t
    }

    fn ids(p: &JobPage) -> Vec<&str> {
        p.jobs.iter().map(|r| r.id.as_str()).collect()
    }

    fn ask(vis: &Visibility, user: Option<&str>, q: &JobQuery) -> JobPage {
        answer(&table(), true, vis, user, &q.encode())
    }

    #[test]
    fn users_see_their_own_jobs_and_operators_all_as_torques_query_other_jobs() {
        let vis = Visibility {
            query_other_jobs: false,
            operators: vec!["admin".into()],
        };
        let all = JobQuery::default();
        assert_eq!(ids(&ask(&vis, Some("alice"), &all)), ["a1", "a2"]);
        assert_eq!(ids(&ask(&vis, Some("bridge"), &all)), ["a1"]);
        assert_eq!(ids(&ask(&vis, Some("carol"), &all)), Vec::<&str>::new());
        let p = ask(&vis, Some("admin"), &all);
        assert_eq!((ids(&p), p.sees_all), (vec!["a1", "b1", "a2"], true));
        let open = Visibility {
            query_other_jobs: true,
            operators: vec![],
        };
        assert_eq!(ask(&open, Some("carol"), &all).jobs.len(), 3);
        // Another's job by id: refused with the reason.
        let one = JobQuery {
            ids: vec!["b1".into()],
            ..Default::default()
        };
        let e = ask(&vis, Some("alice"), &one).error.unwrap();
        assert!(
            e.contains("not yours") && e.contains("query_other_jobs"),
            "{e}"
        );
        assert_eq!(ids(&ask(&vis, Some("admin"), &one)), ["b1"]);
        assert_eq!(ids(&ask(&open, Some("alice"), &one)), ["b1"]);
    }

    #[test]
    fn a_query_without_user_id_or_malformed_is_refused_and_pages_follow_the_cursor() {
        let vis = Visibility {
            query_other_jobs: true,
            operators: vec![],
        };
        let p = ask(&vis, None, &JobQuery::default());
        assert!(p.error.unwrap().contains("no user_id"));
        let p = answer(&table(), false, &vis, Some("x"), b"{not json");
        assert!(p.error.unwrap().contains("malformed job-query"));
        assert!(!p.complete);
        let q = JobQuery {
            limit: Some(2),
            ..Default::default()
        };
        let first = ask(&vis, Some("x"), &q);
        assert_eq!(ids(&first), ["a1", "b1"]);
        let rest = ask(
            &vis,
            Some("x"),
            &JobQuery {
                after: first.next,
                ..q
            },
        );
        assert_eq!((ids(&rest), rest.next), (vec!["a2"], None));
        let unknown = JobQuery {
            ids: vec!["zz".into()],
            ..Default::default()
        };
        assert!(ask(&vis, Some("x"), &unknown)
            .error
            .unwrap()
            .contains("unknown job id \"zz\""));
    }
}
