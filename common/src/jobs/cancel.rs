//! `vq cancel` through the controller: the request, the answer, and the
//! pure rule that decides it (DESIGN.md, "Cancelling a queued job").
//!
//! A queued job's message sits in a quorum queue, which cannot remove one
//! message; what is removed instead is the job's *ownership*. The
//! controller takes the job's claim marker (`<c>.claim.<job id>`, see
//! [`crate::lease`]) for the reserved claim [`WITHDRAWN_AGENT`] /
//! [`WITHDRAWN_CLAIM`], then publishes a [`JobState::Withdrawn`] event. A
//! marker is a compare-and-set in the broker, so exactly one of two
//! things happened first: the controller's declaration, and then every
//! agent that pulls the job finds the marker taken and drops the message
//! without running it; or an agent's claim, and then the controller's
//! declaration fails and the answer is [`CancelAnswer::Starting`] (the
//! requester asks again and gets [`CancelAnswer::Running`], then cancels
//! the running job through its agent as before). No agent can run a job
//! whose withdrawal was confirmed.
//!
//! The request goes to `<c>.control` with the key
//! [`Topology::cancel_query_key`] (`<c>.query.cancel`), the requester's
//! broker user as `user_id`, a `correlation_id` and a `reply_to`, exactly
//! like a [`super::JobQuery`]; the answer comes back the same way.
//!
//! [`Topology::cancel_query_key`]: crate::topology::Topology::cancel_query_key
//! [`JobState::Withdrawn`]: crate::messages::JobState::Withdrawn

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::query::Visibility;
use super::table::{own, FindError, JobRecord, JobTable, State};
use crate::messages::{DecodeError, Message, SCHEMA_VERSION};

/// The agent name of the claim that withdraws a queued job: it contains
/// parentheses, which no agent id may ([`crate::topology::valid_name`]).
pub const WITHDRAWN_AGENT: &str = "(cancelled)";

/// The claim id of a withdrawal (with [`WITHDRAWN_AGENT`]).
pub const WITHDRAWN_CLAIM: &str = "withdrawn";

fn schema_version() -> u32 {
    SCHEMA_VERSION
}

/// `vq cancel JOB_ID` asked of the controller (message kind
/// `cancel-request`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRequest {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Job id, or a unique prefix of one.
    pub job_id: String,
}

/// The controller's answer to a [`CancelRequest`] (message kind
/// `cancel-answer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum CancelAnswer {
    /// The job was queued and is withdrawn: no agent will run it, the table
    /// shows it `X`.
    Withdrawn {
        /// The job's full id.
        job_id: String,
        /// What it was: `queued` or `held` ([`State::word`]; absent from
        /// an older controller: queued).
        #[serde(default = "queued_word")]
        was: String,
    },
    /// The job runs on `agent`: send that agent a `Control::Cancel`
    /// (which it authorises by the requester's `user_id` itself).
    Running {
        /// The job's full id.
        job_id: String,
        /// The agent running it.
        agent: String,
    },
    /// An agent claimed the job, and its `started` event has not reached
    /// the table yet: ask again in a moment.
    Starting {
        /// The job's full id.
        job_id: String,
    },
    /// The job ended already.
    Ended {
        /// The job's full id.
        job_id: String,
        /// How (`C`, `F` or `X`).
        state: State,
    },
    /// Not cancelled: `reason` says why (no `user_id`, a malformed request,
    /// an unknown, ambiguous or foreign job, the table still being rebuilt,
    /// the broker not confirming the withdrawal).
    Refused {
        /// Why, in words.
        reason: String,
        /// What kind of refusal, for the requester's exit status.
        #[serde(default)]
        kind: Refusal,
    },
}

/// Why a [`CancelAnswer::Refused`] refused (`vq cancel` exits 77, 64, 1 or
/// 69 for them, as for an agent's refusal, an unknown job id, a bad request
/// and an unavailable answer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Refusal {
    /// The requester may not cancel this job (not its owner, submitter or
    /// an operator).
    #[default]
    NotPermitted,
    /// No job, or more than one, has this id (prefix).
    UnknownJob,
    /// The request was malformed or carried no `user_id`.
    BadRequest,
    /// Asking again may succeed: the table was still being rebuilt, or the
    /// broker did not confirm the withdrawal.
    Unavailable,
}

impl CancelAnswer {
    /// Whether asking again may give another answer (a job starting, or a
    /// [`Refusal::Unavailable`] refusal).
    pub fn worth_asking_again(&self) -> bool {
        matches!(
            self,
            CancelAnswer::Starting { .. }
                | CancelAnswer::Refused {
                    kind: Refusal::Unavailable,
                    ..
                }
        )
    }
}

fn queued_word() -> String {
    State::Queued.word().into()
}

impl Message for CancelRequest {
    const KIND: &'static str = "cancel-request";
    fn schema(&self) -> u32 {
        self.schema
    }
}

impl Message for CancelAnswer {
    const KIND: &'static str = "cancel-answer";
    fn schema(&self) -> u32 {
        SCHEMA_VERSION
    }
}

/// What the controller does with a cancel request.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelStep {
    /// Withdraw this queued job (take its marker, publish the event), then
    /// answer [`CancelAnswer::Withdrawn`] (or [`CancelAnswer::Starting`] if
    /// an agent's claim came first).
    Withdraw(Box<JobRecord>),
    /// Answer at once.
    Answer(CancelAnswer),
}

fn refused(reason: impl Into<String>, kind: Refusal) -> CancelStep {
    CancelStep::Answer(CancelAnswer::Refused {
        reason: reason.into(),
        kind,
    })
}

/// Decides the request `body` of broker user `user_id` (the delivery's
/// validated `user_id`; `None` is refused) against `table`, which is
/// `complete` when it has caught up with the stream. A job may be
/// cancelled by its owner, by the broker user that submitted it, and by
/// the `[jobs] operators` of `vis` (Torque's managers); `query_other_jobs`
/// lets users see other jobs, never cancel them.
pub fn decide(
    table: &JobTable,
    complete: bool,
    vis: &Visibility,
    user_id: Option<&str>,
    body: &[u8],
) -> CancelStep {
    let Some(user) = user_id.filter(|u| !u.is_empty()) else {
        return refused(
            "the request carries no user_id: publish it with the user_id property set to your broker user (the broker checks it)",
            Refusal::BadRequest,
        );
    };
    let req = match CancelRequest::decode(body) {
        Ok(r) => r,
        Err(e) => {
            let why = match &e {
                DecodeError::Malformed { source, .. } => format!("{e}: {source}"),
                _ => e.to_string(),
            };
            return refused(why, Refusal::BadRequest);
        }
    };
    let operator = vis.operators.iter().any(|o| o == user);
    let r = match table.find_for(&req.job_id, user, operator) {
        Ok(r) => r,
        Err(FindError::Unknown) if !complete => {
            return refused(
                format!(
                    "unknown job id {:?} (the controller is still reading the event stream)",
                    req.job_id
                ),
                Refusal::Unavailable,
            )
        }
        Err(FindError::Unknown) => {
            return refused(
                format!("unknown job id {:?}", req.job_id),
                Refusal::UnknownJob,
            )
        }
        Err(FindError::Ambiguous(ids)) => {
            return refused(
                format!("job id {:?} is ambiguous: {}", req.job_id, ids.join(", ")),
                Refusal::UnknownJob,
            )
        }
    };
    if !operator && !own(&r, user) {
        return refused(
            format!(
                "job {} is not yours (owner {}): only its owner, the broker user that submitted it and the controller's [jobs] operators may cancel it",
                r.id, r.owner
            ),
            Refusal::NotPermitted,
        );
    }
    match r.state {
        // A held job is withdrawn alike: its claim marker taken, no agent
        // runs it even if the controller's release raced the cancel, and
        // the held queue's consumer drops a held message whose job the
        // table shows cancelled.
        State::Queued | State::Held => CancelStep::Withdraw(Box::new(r)),
        State::Running => CancelStep::Answer(CancelAnswer::Running {
            job_id: r.id.clone(),
            agent: r.agent.clone(),
        }),
        s => CancelStep::Answer(CancelAnswer::Ended {
            job_id: r.id.clone(),
            state: s,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{JobEvent, JobRequest, JobState};

    fn table() -> JobTable {
        let mut t = JobTable::new();
        for (id, owner) in [("q1", "alice"), ("r1", "alice"), ("q2", "bob")] {
            let mut e = JobEvent::about(
                None,
                id,
                "p",
                "",
                Some("bridge"),
                JobState::Queued {
                    request: JobRequest::default(),
                },
            );
            e.owner = owner.into();
            e.at = 1.0;
            t.apply(&e, None);
        }
        let mut s = JobEvent::about(None, "r1", "p", "ag-1", None, JobState::Started);
        s.owner = "alice".into();
        s.attempt = 1;
        s.at = 2.0;
        t.apply(&s, None);
        t
    }

    fn ask(t: &JobTable, complete: bool, user: Option<&str>, id: &str) -> CancelStep {
        let vis = Visibility {
            query_other_jobs: true,
            operators: vec!["ops".into()],
        };
        let body = CancelRequest {
            schema: SCHEMA_VERSION,
            job_id: id.into(),
        }
        .encode();
        decide(t, complete, &vis, user, &body)
    }

    #[test]
    fn owners_submitters_and_operators_withdraw_queued_jobs_others_are_refused() {
        let t = table();
        for user in ["alice", "bridge", "ops"] {
            assert!(
                matches!(ask(&t, true, Some(user), "q1"), CancelStep::Withdraw(r) if r.id == "q1"),
                "{user}"
            );
        }
        // query_other_jobs lets bob see alice's job, not cancel it.
        let CancelStep::Answer(CancelAnswer::Refused { reason, kind }) =
            ask(&t, true, Some("bob"), "q1")
        else {
            panic!("bob cancelled alice's job");
        };
        assert!(reason.contains("not yours (owner alice)"), "{reason}");
        assert_eq!(kind, Refusal::NotPermitted);
        assert!(matches!(
            ask(&t, true, None, "q1"),
            CancelStep::Answer(CancelAnswer::Refused {
                kind: Refusal::BadRequest,
                ..
            })
        ));
        // A held job is withdrawn as a queued one.
        let mut t = t;
        let mut h = JobEvent::about(
            None,
            "h1",
            "p",
            "",
            Some("bridge"),
            JobState::Held {
                request: JobRequest::default(),
            },
        );
        h.owner = "alice".into();
        t.apply(&h, None);
        assert!(matches!(
            ask(&t, true, Some("alice"), "h1"),
            CancelStep::Withdraw(r) if r.state == State::Held
        ));
    }

    #[test]
    fn running_jobs_name_their_agent_ended_and_unknown_ones_say_so() {
        let t = table();
        assert_eq!(
            ask(&t, true, Some("alice"), "r1"),
            CancelStep::Answer(CancelAnswer::Running {
                job_id: "r1".into(),
                agent: "ag-1".into()
            })
        );
        assert!(matches!(
            ask(&t, true, Some("alice"), "zz"),
            CancelStep::Answer(CancelAnswer::Refused {
                kind: Refusal::UnknownJob,
                ..
            })
        ));
        assert!(matches!(
            ask(&t, false, Some("alice"), "zz"),
            CancelStep::Answer(CancelAnswer::Refused {
                kind: Refusal::Unavailable,
                ..
            })
        ));
        let mut t = t;
        let mut w = JobEvent::about(
            None,
            "q2",
            "p",
            "",
            None,
            JobState::Withdrawn {
                by: "bob".into(),
                reason: None,
            },
        );
        w.at = 3.0;
        t.apply(&w, None);
        assert_eq!(
            ask(&t, true, Some("bob"), "q2"),
            CancelStep::Answer(CancelAnswer::Ended {
                job_id: "q2".into(),
                state: State::Cancelled
            })
        );
    }
}
