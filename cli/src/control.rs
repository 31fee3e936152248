//! `vq cancel`, `vq drain` and `vq resume`: control messages to one agent
//! (and, for `vq cancel`, a request to the controller first), and the
//! agent's answer.
//!
//! Control messages go to the control exchange with routing key = agent id,
//! mandatory (an agent that is not connected has no control queue, so the
//! message comes back unroutable), with a publisher confirm, with the
//! broker-validated `user_id` so that the agent can check who asked, and
//! with `reply_to` = the CLI's reply queue ([`crate::reply`]). The agent
//! answers with a [`ControlAnswer`]; a command waits `--timeout` seconds
//! ([`ANSWER_TIMEOUT`] by default) for it. Exit codes: 0 done (or nothing
//! to do), 77 refused ([`EXIT_REFUSED`]), 1 a cancel of a job not running
//! there, 69 no answer in time (an agent older than the answers, or one
//! that is stuck), 64 no such agent.

use std::time::Duration;

use vq_common::amqp;
use vq_common::jobs::cancel::{CancelAnswer, CancelRequest, Refusal};
use vq_common::messages::{
    AgentState, Control, ControlAnswer, ControlOutcome, ControlRequest, Message, MAX_REASON_BYTES,
    SCHEMA_VERSION,
};
use vq_common::topology::Topology;

use crate::error::CliError;
use crate::reply::{Replies, Sent};
use vq_common::jobs::{JobRecord, State};

use crate::events::{find_job, read_job_table};
use crate::settings::Settings;

pub use crate::error::EXIT_REFUSED;

/// How long `vq cancel`, `vq drain` and `vq resume` wait for the agent's
/// answer unless `--timeout` says otherwise.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Checks that `user` may cancel `job` and that it is running; returns the
/// agent to send the cancel to.
///
/// # Errors
/// [`CliError::NotOwner`] unless `user` owns the job or `is_root`;
/// [`CliError::NotRunning`] if the job ended.
pub fn cancel_target<'a>(
    job: &'a JobRecord,
    user: &str,
    is_root: bool,
) -> Result<&'a str, CliError> {
    if !is_root && job.owner != user {
        return Err(CliError::NotOwner {
            job_id: job.id.clone(),
            owner: job.owner.clone(),
            user: user.to_string(),
        });
    }
    if job.state != State::Running || job.agent.is_empty() {
        return Err(CliError::NotRunning {
            job_id: job.id.clone(),
            state: format!("{} {}", job.state.letter(), job.state.word()),
        });
    }
    Ok(&job.agent)
}

/// Checks a `--reason`: at most [`MAX_REASON_BYTES`] bytes, no control
/// characters; blank means none.
///
/// # Errors
/// [`CliError::Usage`] naming the problem.
pub fn check_reason(reason: Option<&str>) -> Result<Option<String>, CliError> {
    let Some(r) = reason.map(str::trim).filter(|r| !r.is_empty()) else {
        return Ok(None);
    };
    if r.len() > MAX_REASON_BYTES {
        return Err(CliError::Usage(format!(
            "--reason: {} bytes, longer than the limit of {MAX_REASON_BYTES}",
            r.len()
        )));
    }
    if r.chars().any(char::is_control) {
        return Err(CliError::Usage(
            "--reason: control characters (newlines, tabs, escapes) are not allowed".into(),
        ));
    }
    Ok(Some(r.to_string()))
}

/// Checks a `--timeout` in seconds.
///
/// # Errors
/// [`CliError::Usage`] unless it is a positive finite number (below 10⁹).
pub fn check_timeout(secs: f64) -> Result<Duration, CliError> {
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        return Err(CliError::Usage(format!(
            "--timeout: {secs} is not a positive number of seconds"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Publishes `msg` to `agent`'s control queue with `correlation` as
/// correlation id and waits up to `timeout` for the agent's answer.
///
/// # Errors
/// [`CliError::NoSuchAgent`] if the agent is not connected,
/// [`CliError::NoSuchCluster`] if the cluster's exchanges do not exist,
/// [`CliError::NoAnswer`] if no answer came in time,
/// [`CliError::Decode`] for an answer that is not a [`ControlAnswer`],
/// [`CliError::Broker`] otherwise.
pub async fn request(
    conn: &lapin::Connection,
    settings: &Settings,
    agent: &str,
    msg: &Control,
    correlation: &str,
    timeout: Duration,
) -> Result<ControlAnswer, CliError> {
    let topo = Topology::new(&settings.cluster);
    let mut replies = Replies::open(conn, settings, "vq-control").await?;
    let result = async {
        let props =
            amqp::json_properties::<Control>().with_user_id(settings.broker_user().as_str().into());
        let sent = replies
            .send_as(
                &topo.control_exchange(),
                agent,
                &msg.encode(),
                props,
                Duration::from_secs(settings.broker.confirm_timeout_secs),
                &format!("send a control message to agent {agent:?}"),
                correlation,
            )
            .await?;
        let Sent::Routed { correlation } = sent else {
            return Err(CliError::NoSuchAgent {
                agent: agent.to_string(),
                cluster: settings.cluster.clone(),
            });
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let Some(d) = replies.answer(&correlation, deadline).await? else {
                return Err(CliError::NoAnswer {
                    agent: agent.to_string(),
                    secs: timeout.as_secs_f64(),
                });
            };
            let answer = ControlAnswer::decode(&d.data).map_err(|source| CliError::Decode {
                what: format!("the answer of agent {agent:?}"),
                source,
            })?;
            // Only the agent asked answers for itself.
            if answer.agent == agent {
                return Ok(answer);
            }
            tracing::warn!(agent, from = %answer.agent, "ignoring an answer from another agent");
        }
    }
    .await;
    replies.close().await;
    result
}

/// What an answer means for the command: the line to print (exit 0), or
/// the error.
///
/// # Errors
/// [`CliError::Refused`] (exit [`EXIT_REFUSED`]) or
/// [`CliError::NotHere`] (exit 1).
pub fn judge(answer: &ControlAnswer) -> Result<String, CliError> {
    let agent = &answer.agent;
    let jobs = match answer.running.len() {
        0 => "no job running".to_string(),
        1 => "1 job running".to_string(),
        n => format!("{n} jobs running"),
    };
    let job = answer.job_id.as_deref().unwrap_or("?");
    let drained = answer.state == AgentState::Drained;
    match (&answer.outcome, answer.request) {
        (ControlOutcome::Refused { reason }, _) => Err(CliError::Refused {
            reason: reason.clone(),
        }),
        (ControlOutcome::NotHere, _) => Err(CliError::NotHere {
            job_id: job.to_string(),
            agent: agent.clone(),
        }),
        (ControlOutcome::Done, ControlRequest::Drain) if drained => {
            Ok(format!("agent {agent}: drained ({jobs})"))
        }
        (ControlOutcome::Done, ControlRequest::Drain) => {
            Ok(format!("agent {agent}: draining ({jobs})"))
        }
        (ControlOutcome::Already, ControlRequest::Drain) if drained => {
            Ok(format!("agent {agent}: already drained ({jobs})"))
        }
        (ControlOutcome::Already, ControlRequest::Drain) => {
            Ok(format!("agent {agent}: already draining ({jobs})"))
        }
        (ControlOutcome::Done, ControlRequest::Resume) => {
            Ok(format!("agent {agent}: pulling jobs again ({jobs})"))
        }
        (ControlOutcome::Already, ControlRequest::Resume) => Ok(format!(
            "agent {agent}: not draining, pulling jobs already ({jobs})"
        )),
        (ControlOutcome::Done | ControlOutcome::Already, ControlRequest::Cancel) => Ok(format!(
            "job {job}: cancelled on agent {agent} (SIGTERM now, SIGKILL after its grace period)"
        )),
    }
}

async fn connect(settings: &Settings, name: &str) -> Result<lapin::Connection, CliError> {
    amqp::connect(&settings.broker, name)
        .await
        .map_err(CliError::broker("connect to the broker"))
}

/// What `vq cancel JOB_ID` does: asks the controller
/// ([`vq_common::jobs::cancel`]), which withdraws a queued job itself and
/// names the agent of a running one; a running job's cancel then goes to
/// its agent, which checks the owner again. An agent's claim that races the
/// withdrawal is answered "starting", and the request is asked again
/// until the job shows running (within `timeout`). With no controller
/// listening, a running job is still found in the event stream and
/// cancelled through its agent; a queued one is not (it needs the
/// controller's withdrawal).
///
/// # Errors
/// [`CliError`].
pub async fn run_cancel(
    settings: &Settings,
    job_id: &str,
    timeout: Duration,
) -> Result<i32, CliError> {
    let conn = amqp::connect(&settings.broker, "vq cancel")
        .await
        .map_err(CliError::broker("connect to the broker"))?;
    let result = async {
        match ask_cancel(&conn, settings, job_id, timeout).await? {
            Some(CancelAnswer::Withdrawn { job_id, was }) => {
                println!(
                    "job {job_id} cancelled: it was {} and no agent will run it",
                    crate::term::printable(&was)
                );
                Ok(0)
            }
            Some(CancelAnswer::Running { job_id, agent }) => {
                cancel_running(&conn, settings, &job_id, &agent, timeout).await
            }
            Some(CancelAnswer::Ended { job_id, state }) => Err(CliError::NotRunning {
                job_id,
                state: format!("{} {}", state.letter(), state.word()),
            }),
            Some(CancelAnswer::Refused { reason, kind }) => Err(match kind {
                Refusal::NotPermitted => CliError::Refused { reason },
                Refusal::UnknownJob => CliError::UnknownJobAnswer { reason },
                Refusal::BadRequest => CliError::QueryRefused { problem: reason },
                Refusal::Unavailable => CliError::ControllerBusy { reason },
            }),
            Some(CancelAnswer::Starting { job_id }) => Err(CliError::QueryRefused {
                problem: format!(
                    "job {job_id} is starting on an agent and has not reported its start within {:.0} s; try again",
                    timeout.as_secs_f64()
                ),
            }),
            None => cancel_from_stream(&conn, settings, job_id, timeout).await,
        }
    }
    .await;
    let _ = conn.close(200, "bye".into()).await;
    result
}

/// The controller's last answer to cancelling `job_id`, asked again while
/// it says "starting" or "retry" (every 200 ms, within `timeout`); `None`
/// when no controller listens.
async fn ask_cancel(
    conn: &lapin::Connection,
    settings: &Settings,
    job_id: &str,
    timeout: Duration,
) -> Result<Option<CancelAnswer>, CliError> {
    let topo = Topology::new(&settings.cluster);
    let mut replies = Replies::open(conn, settings, "vq-cancel").await?;
    let control = topo.control_exchange();
    let key = topo.cancel_query_key();
    let req = CancelRequest {
        schema: SCHEMA_VERSION,
        job_id: job_id.to_string(),
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let answer = loop {
        let props = amqp::json_properties::<CancelRequest>()
            .with_delivery_mode(1)
            .with_user_id(settings.broker_user().as_str().into());
        let sent = replies
            .send(
                &control,
                &key,
                &req.encode(),
                props,
                timeout,
                "send the cancel to the controller",
            )
            .await?;
        let Sent::Routed { correlation } = sent else {
            replies.close().await;
            return Ok(None);
        };
        let Some(d) = replies.answer(&correlation, deadline).await? else {
            replies.close().await;
            return Err(CliError::NoController {
                exchange: control,
                key,
                secs: timeout.as_secs_f64(),
                listening: true,
            });
        };
        let answer = CancelAnswer::decode(&d.data).map_err(|source| CliError::Decode {
            what: "the controller's cancel answer".into(),
            source,
        })?;
        let again = answer.worth_asking_again();
        let pause = tokio::time::Instant::now() + RETRY_PAUSE;
        if !again || pause >= deadline {
            break answer;
        }
        tracing::debug!(?answer, "asking the controller again");
        tokio::time::sleep_until(pause).await;
    };
    replies.close().await;
    Ok(Some(answer))
}

/// Pause between two cancel requests while the job is starting.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Sends the cancel of running job `job_id` to `agent` and prints its
/// answer (within `timeout`).
async fn cancel_running(
    conn: &lapin::Connection,
    settings: &Settings,
    job_id: &str,
    agent: &str,
    timeout: Duration,
) -> Result<i32, CliError> {
    let msg = Control::Cancel {
        job_id: job_id.to_string(),
    };
    let correlation = uuid::Uuid::new_v4().to_string();
    let answer = request(conn, settings, agent, &msg, &correlation, timeout).await?;
    tracing::info!(job_id, agent, outcome = ?answer.outcome, "cancel answered");
    println!("{}", judge(&answer)?);
    Ok(0)
}

/// `vq cancel` without a controller: the job's state from one read of the
/// event stream; only a running job can be cancelled this way.
async fn cancel_from_stream(
    conn: &lapin::Connection,
    settings: &Settings,
    job_id: &str,
    timeout: Duration,
) -> Result<i32, CliError> {
    let crate::term::InvokingUser {
        name: user,
        is_root,
        ..
    } = crate::term::invoking_user()?;
    let topo = Topology::new(&settings.cluster);
    let jobs = read_job_table(conn, &topo).await?;
    let job = find_job(&jobs, job_id)?;
    if matches!(job.state, State::Queued | State::Held) {
        return Err(CliError::NeedsController {
            problem: format!(
                "job {} is {}, and no controller listens on {} (key {}): a queued or held job is cancelled by the controller; start it, or cancel the job once it runs",
                job.id,
                job.state.word(),
                topo.control_exchange(),
                topo.cancel_query_key()
            ),
        });
    }
    let agent = cancel_target(&job, &user, is_root)?;
    cancel_running(conn, settings, &job.id, agent, timeout).await
}

/// Which of `vq drain` and `vq resume` ([`run_drain_or_resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toggle {
    /// `vq drain`: the agent stops pulling, finishes its jobs and reports
    /// `drained`.
    Drain,
    /// `vq resume`: a draining agent pulls again.
    Resume,
}

/// What `vq drain AGENT` and `vq resume AGENT` do: send the request with
/// the operator's `reason` and print the agent's answer.
///
/// # Errors
/// [`CliError`].
pub async fn run_drain_or_resume(
    settings: &Settings,
    which: Toggle,
    agent: &str,
    reason: Option<&str>,
    timeout: Duration,
) -> Result<i32, CliError> {
    let reason = check_reason(reason)?;
    if !vq_common::topology::valid_name(agent) {
        return Err(CliError::NoSuchAgent {
            agent: agent.to_string(),
            cluster: settings.cluster.clone(),
        });
    }
    let (name, word) = match which {
        Toggle::Drain => ("vq drain", "drain"),
        Toggle::Resume => ("vq resume", "resume"),
    };
    let conn = connect(settings, name).await?;
    let request_id = uuid::Uuid::new_v4().to_string();
    let msg = match which {
        Toggle::Drain => Control::Drain {
            request_id: request_id.clone(),
            reason,
        },
        Toggle::Resume => Control::Resume {
            request_id: request_id.clone(),
            reason,
        },
    };
    let result = request(&conn, settings, agent, &msg, &request_id, timeout).await;
    let _ = conn.close(200, "bye".into()).await;
    let answer = result?;
    tracing::info!(agent, request_id, outcome = ?answer.outcome, "{word} answered");
    println!("{}", judge(&answer)?);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use vq_common::messages::{JobState, Outcome, Usage};

    use super::*;
    use crate::events::table_of;
    use crate::events::tests::ev;

    #[test]
    fn only_the_owner_or_root_cancels_a_running_job() {
        let running = table_of(&[ev("j", "alice", "ag1", 1.0, JobState::Started)]);
        let running = running.get("j").unwrap();
        assert_eq!(cancel_target(&running, "alice", false).unwrap(), "ag1");
        assert_eq!(cancel_target(&running, "root", true).unwrap(), "ag1");
        assert!(matches!(
            cancel_target(&running, "bob", false),
            Err(CliError::NotOwner { .. })
        ));
        let done = table_of(&[
            ev("j", "alice", "ag1", 1.0, JobState::Started),
            ev(
                "j",
                "alice",
                "ag1",
                2.0,
                JobState::Finished {
                    outcome: Outcome::Exited { code: 0 },
                    usage: Usage::default(),
                },
            ),
        ]);
        let err = cancel_target(&done.get("j").unwrap(), "alice", false).unwrap_err();
        assert!(err.to_string().contains("C completed"), "{err}");
    }

    fn answer(
        request: ControlRequest,
        outcome: ControlOutcome,
        state: AgentState,
    ) -> ControlAnswer {
        ControlAnswer {
            schema: 1,
            request_id: "r".into(),
            agent: "ag1".into(),
            pool: "cms".into(),
            request,
            job_id: (request == ControlRequest::Cancel).then(|| "j1".to_string()),
            outcome,
            state,
            running: vec!["j1".into(), "j2".into()],
            at: 0.0,
        }
    }

    #[test]
    fn every_answer_reads_as_one_line_or_an_error_with_its_exit_code() {
        use ControlOutcome::*;
        use ControlRequest::*;
        let refused = Refused {
            reason: "broker user \"bob\" is not in control_admins of agent ag1".into(),
        };
        #[rustfmt::skip]
        let table = [
            (Drain,  Done,            AgentState::Draining, Ok("agent ag1: draining (2 jobs running)")),
            (Drain,  Already,         AgentState::Draining, Ok("agent ag1: already draining (2 jobs running)")),
            (Resume, Done,            AgentState::Busy,     Ok("agent ag1: pulling jobs again (2 jobs running)")),
            (Resume, Already,         AgentState::Busy,     Ok("agent ag1: not draining, pulling jobs already (2 jobs running)")),
            (Cancel, Done,            AgentState::Busy,     Ok("job j1: cancelled on agent ag1 (SIGTERM now, SIGKILL after its grace period)")),
            (Drain,  refused.clone(), AgentState::Busy,     Err((EXIT_REFUSED, "refused: broker user \"bob\" is not in control_admins of agent ag1"))),
            (Resume, refused,         AgentState::Busy,     Err((EXIT_REFUSED, "refused: broker user \"bob\" is not in control_admins of agent ag1"))),
            (Cancel, NotHere,         AgentState::Busy,     Err((1, "job j1 is not running on agent ag1 (it may have ended just now; see vq stat)"))),
        ];
        for (request, outcome, state, want) in table {
            let got = judge(&answer(request, outcome.clone(), state))
                .map_err(|e| (e.exit_code(), e.to_string()));
            let want = want
                .map(str::to_string)
                .map_err(|(c, m)| (c, m.to_string()));
            assert_eq!(got, want, "{request:?} {outcome:?}");
        }
        let mut idle = answer(Drain, Done, AgentState::Drained);
        idle.running.clear();
        assert_eq!(judge(&idle).unwrap(), "agent ag1: drained (no job running)");
    }

    #[test]
    fn a_reason_is_checked_before_anything_is_sent() {
        assert_eq!(check_reason(Some("  ")).unwrap(), None);
        assert_eq!(
            check_reason(Some(" kernel update ")).unwrap().as_deref(),
            Some("kernel update")
        );
        let long = "x".repeat(MAX_REASON_BYTES + 1);
        assert_eq!(check_reason(Some(&long)).unwrap_err().exit_code(), 64);
        assert!(check_reason(Some("a\nb")).is_err());
        assert!(check_timeout(0.0).is_err() && check_timeout(f64::NAN).is_err());
        assert_eq!(check_timeout(1.5).unwrap(), Duration::from_millis(1500));
    }
}
