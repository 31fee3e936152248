//! `vq cancel` and `vq drain`: control messages to one agent (and, for
//! `vq cancel`, a request to the controller first).
//!
//! Control messages go to the control exchange with routing key = agent id,
//! mandatory (an agent that is not connected has no control queue, so the
//! message comes back unroutable), with a publisher confirm, and with the
//! broker-validated `user_id` so that the agent can check who asked.

use std::time::Duration;

use vq_common::amqp::{self, AmqpError};
use vq_common::jobs::cancel::{CancelAnswer, CancelRequest};
use vq_common::messages::{Control, Message, SCHEMA_VERSION};
use vq_common::topology::Topology;

use crate::error::{amqp_reply_code, CliError, NOT_FOUND};
use vq_common::jobs::{JobRecord, State};

use crate::events::{find_job, read_job_table};
use crate::reply::{Replies, Sent};
use crate::settings::Settings;

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

/// Publishes `msg` to `agent`'s control queue.
///
/// # Errors
/// [`CliError::NoSuchAgent`] if the agent is not connected,
/// [`CliError::NoSuchCluster`] if the control exchange does not exist,
/// [`CliError::Broker`] otherwise.
pub async fn send_control(
    conn: &lapin::Connection,
    settings: &Settings,
    agent: &str,
    msg: &Control,
) -> Result<(), CliError> {
    let topo = Topology::new(&settings.cluster);
    let ch = amqp::confirm_channel(conn)
        .await
        .map_err(CliError::broker("open a channel"))?;
    let props =
        amqp::json_properties::<Control>().with_user_id(settings.broker_user().as_str().into());
    let exchange = topo.control_exchange();
    let res = amqp::publish_confirmed(
        &ch,
        &exchange,
        agent,
        &msg.encode(),
        props,
        true,
        Duration::from_secs(settings.broker.confirm_timeout_secs),
    )
    .await;
    match res {
        Ok(()) => Ok(()),
        Err(AmqpError::Unroutable { .. }) => Err(CliError::NoSuchAgent {
            agent: agent.to_string(),
            cluster: settings.cluster.clone(),
        }),
        Err(e) if amqp_reply_code(&e) == Some(NOT_FOUND) => Err(CliError::NoSuchCluster {
            cluster: settings.cluster.clone(),
            exchange,
        }),
        Err(source) => Err(CliError::Broker {
            action: format!("send a control message to agent {agent:?}"),
            source: Box::new(source),
        }),
    }
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
            Some(CancelAnswer::Withdrawn { job_id }) => {
                println!("job {job_id} cancelled: it was queued and no agent will run it");
                Ok(0)
            }
            Some(CancelAnswer::Running { job_id, agent }) => {
                cancel_running(&conn, settings, &job_id, &agent).await
            }
            Some(CancelAnswer::Ended { job_id, state }) => Err(CliError::NotRunning {
                job_id,
                state: format!("{} {}", state.letter(), state.word()),
            }),
            Some(CancelAnswer::Refused { reason, .. }) => {
                Err(CliError::QueryRefused { problem: reason })
            }
            Some(CancelAnswer::Starting { job_id }) => Err(CliError::QueryRefused {
                problem: format!(
                    "job {job_id} is starting on an agent and has not reported its start within {:.0} s; try again",
                    timeout.as_secs_f64()
                ),
            }),
            None => cancel_from_stream(&conn, settings, job_id).await,
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
        let again = matches!(
            answer,
            CancelAnswer::Starting { .. } | CancelAnswer::Refused { retry: true, .. }
        );
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

/// Sends the cancel of running job `job_id` to `agent`.
async fn cancel_running(
    conn: &lapin::Connection,
    settings: &Settings,
    job_id: &str,
    agent: &str,
) -> Result<i32, CliError> {
    let msg = Control::Cancel {
        job_id: job_id.to_string(),
    };
    send_control(conn, settings, agent, &msg).await?;
    tracing::info!(job_id, agent, "cancel sent");
    println!("cancel of job {job_id} sent to agent {agent}");
    Ok(0)
}

/// `vq cancel` without a controller: the job's state from one read of the
/// event stream; only a running job can be cancelled this way.
async fn cancel_from_stream(
    conn: &lapin::Connection,
    settings: &Settings,
    job_id: &str,
) -> Result<i32, CliError> {
    let crate::term::InvokingUser {
        name: user,
        is_root,
        ..
    } = crate::term::invoking_user()?;
    let topo = Topology::new(&settings.cluster);
    let jobs = read_job_table(conn, &topo).await?;
    let job = find_job(&jobs, job_id)?;
    if job.state == State::Queued {
        return Err(CliError::QueryRefused {
            problem: format!(
                "job {} is queued, and no controller listens on {} (key {}): a queued job is cancelled by the controller; start it, or cancel the job once it runs",
                job.id,
                topo.control_exchange(),
                topo.cancel_query_key()
            ),
        });
    }
    let agent = cancel_target(job, &user, is_root)?;
    cancel_running(conn, settings, &job.id, agent).await
}

/// What `vq drain AGENT` does: the agent stops pulling, finishes its jobs and
/// reports `drained`.
///
/// # Errors
/// [`CliError`].
pub async fn run_drain(settings: &Settings, agent: &str) -> Result<i32, CliError> {
    if !vq_common::topology::valid_name(agent) {
        return Err(CliError::NoSuchAgent {
            agent: agent.to_string(),
            cluster: settings.cluster.clone(),
        });
    }
    let conn = amqp::connect(&settings.broker, "vq drain")
        .await
        .map_err(CliError::broker("connect to the broker"))?;
    let request_id = uuid::Uuid::new_v4().to_string();
    let msg = Control::Drain {
        request_id: request_id.clone(),
    };
    let result = send_control(&conn, settings, agent, &msg).await;
    let _ = conn.close(200, "bye".into()).await;
    result?;
    tracing::info!(agent, request_id, "drain sent");
    println!("drain request {request_id} sent to agent {agent}");
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
        assert_eq!(cancel_target(running, "alice", false).unwrap(), "ag1");
        assert_eq!(cancel_target(running, "root", true).unwrap(), "ag1");
        assert!(matches!(
            cancel_target(running, "bob", false),
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
        let err = cancel_target(done.get("j").unwrap(), "alice", false).unwrap_err();
        assert!(err.to_string().contains("C completed"), "{err}");
    }
}
