//! `vq submit`'s check of a job against its pool's limits before it is
//! published ([`vq_common::pools`]): the controller publishes every pool's
//! slots, max walltime and memory per VM; a job that no VM of its pool
//! could run is refused here, with one sentence per limit, instead of
//! being queued for an agent to refuse (and a VM perhaps booted for it).
//!
//! Without an answer (no controller running, or none answering within
//! [`LIMITS_TIMEOUT`]) the job is submitted anyway and `vq submit` warns
//! once: the agent still refuses a job beyond its limits when it takes it,
//! and dead-letters it with the reason.

use std::time::Duration;

use vq_common::amqp;
use vq_common::messages::{Job, JobRequest, Message};
use vq_common::pools::{PoolQuery, PoolsPage};
use vq_common::topology::Topology;

use crate::error::CliError;
use crate::reply::{Replies, Sent};
use crate::settings::Settings;

/// How long `vq submit` waits for the controller's answer.
pub const LIMITS_TIMEOUT: Duration = Duration::from_secs(2);

/// The controller's answer to `vq submit`'s question, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limits {
    /// The controller answered with every pool's limits.
    Known(PoolsPage),
    /// No answer: why, in words (the job is then not checked).
    Unchecked(String),
}

impl Limits {
    /// The pools the controller names (for an unknown pool's error), if it
    /// answered.
    pub fn pool_names(&self) -> Option<Vec<String>> {
        match self {
            Limits::Known(page) => Some(page.names()),
            Limits::Unchecked(_) => None,
        }
    }
}

/// Asks the controller for the pools' limits on `conn` as `settings`'
/// broker user, waiting at most `timeout` for the publish's confirm and
/// then for the answer. Never fails: every problem is a
/// [`Limits::Unchecked`] (the publish of the job says what is wrong with
/// the broker or the cluster, if anything).
pub async fn ask(conn: &lapin::Connection, settings: &Settings, timeout: Duration) -> Limits {
    let topo = Topology::new(&settings.cluster);
    let key = topo.pool_query_key();
    let control = topo.control_exchange();
    let mut replies = match Replies::open(conn, settings, "vq-submit").await {
        Ok(r) => r,
        Err(e) => return Limits::Unchecked(vq_common::error::chain(&e)),
    };
    let props = amqp::json_properties::<PoolQuery>()
        .with_delivery_mode(1)
        .with_user_id(settings.broker_user().as_str().into());
    let sent = replies
        .send(
            &control,
            &key,
            &PoolQuery::default().encode(),
            props,
            timeout,
            "ask the controller for the pools' limits",
        )
        .await;
    let answer = match sent {
        Err(e) => Err(vq_common::error::chain(&e)),
        Ok(Sent::Unroutable) => Err(format!(
            "no controller is listening on {control} (key {key})"
        )),
        Ok(Sent::Routed { correlation }) => {
            let deadline = tokio::time::Instant::now() + timeout;
            match replies.answer(&correlation, deadline).await {
                Err(e) => Err(vq_common::error::chain(&e)),
                Ok(None) => Err(format!(
                    "no controller answered on {control} (key {key}) within {} s",
                    timeout.as_secs_f64()
                )),
                Ok(Some(d)) => match PoolsPage::decode(&d.data) {
                    Err(e) => Err(format!("cannot decode the controller's answer: {e}")),
                    Ok(PoolsPage {
                        error: Some(why), ..
                    }) => Err(format!("the controller refused the question: {why}")),
                    Ok(page) => Ok(page),
                },
            }
        }
    };
    replies.close().await;
    match answer {
        Ok(page) => Limits::Known(page),
        Err(why) => Limits::Unchecked(why),
    }
}

/// Refuses `job` if its pool is in `page` and the job exceeds one of the
/// pool's limits. A pool the page does not name passes: its queue may be
/// served by agents the controller does not manage, and a pool without a
/// queue is refused by the publish ([`CliError::NoSuchPool`], which then
/// lists the page's pools).
///
/// # Errors
/// [`CliError::OverLimits`] with every limit the job exceeds.
pub fn check(page: &PoolsPage, job: &Job) -> Result<(), CliError> {
    let Some(limits) = page.get(&job.pool) else {
        return Ok(());
    };
    let refusals = limits.refusals(&JobRequest::of(job));
    if refusals.is_empty() {
        Ok(())
    } else {
        Err(CliError::OverLimits { refusals })
    }
}

/// The one-line warning of a job submitted unchecked, with `why`.
pub fn unchecked_warning(job: &Job, why: &str) -> String {
    format!(
        "vq: warning: job {} was not checked against pool {}'s limits (walltime, slots, memory): {why}; an agent refuses a job beyond them when it takes it, and dead-letters it with the reason",
        job.id,
        job.pool
    )
}

#[cfg(test)]
mod tests {
    use vq_common::pools::PoolLimits;

    use super::*;

    fn page() -> PoolsPage {
        PoolsPage {
            schema: 1,
            pools: vec![PoolLimits {
                pool: "cms".into(),
                slots: 2,
                max_walltime_secs: 3600,
                memory_mb: None,
            }],
            error: None,
        }
    }

    fn job(pool: &str, walltime: Option<u64>, slots: u32) -> Job {
        serde_json::from_value(serde_json::json!({
            "id": "1.vq", "name": "n", "owner": "u", "pool": pool, "script": "true",
            "walltime": walltime, "slots": slots,
        }))
        .unwrap()
    }

    #[test]
    fn a_job_beyond_its_pools_limits_is_refused_with_every_reason_and_exit_64() {
        assert!(check(&page(), &job("cms", Some(3600), 2)).is_ok());
        assert!(check(&page(), &job("cms", None, 1)).is_ok());
        let err = check(&page(), &job("cms", Some(7200), 3)).unwrap_err();
        assert_eq!(err.exit_code(), 64);
        let text = err.to_string();
        assert_eq!(
            text,
            "walltime 02:00:00 is more than pool cms's max_walltime 01:00:00\n\
             vq: 3 slots (nodes=1:ppn, ncpus) are more than pool cms's VMs have (2 slots)"
        );
        // A pool the controller does not name is left to the publish.
        assert!(check(&page(), &job("static", Some(1 << 30), 64)).is_ok());
        assert_eq!(
            Limits::Known(page()).pool_names(),
            Some(vec!["cms".to_string()])
        );
        assert_eq!(Limits::Unchecked("x".into()).pool_names(), None);
    }

    #[test]
    fn the_unchecked_warning_is_one_line_with_the_reason() {
        let w = unchecked_warning(&job("cms", None, 1), "no controller is listening");
        assert_eq!(w.lines().count(), 1);
        assert!(
            w.starts_with("vq: warning: job 1.vq was not checked against pool cms's limits")
                && w.contains("no controller is listening; an agent refuses"),
            "{w}"
        );
    }
}
