//! The error policy of a pool cycle, apart from the loop (as kube-runtime's
//! `error_policy`): how each kind of cloud or broker error is retried,
//! backed off and surfaced. The loop never looks inside an error; it asks
//! [`error_policy`] and applies the answer ([`crate::backoff::PoolBackoff`]
//! computes the jittered delay, [`Next::at_least`] is its floor).
//!
//! Every failure backs the pool off (capped exponential, reset on
//! success); a service's `Retry-After` is honoured up to
//! [`MAX_RETRY_AFTER`]; a permanent error (one retrying cannot fix: a
//! flavor that does not exist, a refused permission, an unrenderable
//! user-data) is retried at the same pace but logged as an error, because
//! only the operator can fix it. The status page shows every failure with
//! its whole cause chain ([`CycleError::chain`]). A broker alarm is not an
//! error: the loop holds the pools without backing off.

use std::time::Duration;

use vq_common::amqp::AmqpError;

use crate::error::{ActError, ObserveError};

/// Longest `Retry-After` honoured: a service asking for more is retried
/// after an hour anyway.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// What made a pool's cycle fail: observing (nothing was acted on) or the
/// first failed action of its plan.
#[derive(Debug, Clone, Copy)]
pub enum CycleError<'a> {
    /// Observing failed (broker connection, alarm probe, server list,
    /// queue depth).
    Observe(&'a ObserveError),
    /// An action of the plan failed.
    Act(&'a ActError),
}

impl CycleError<'_> {
    /// The error itself.
    pub fn error(&self) -> &(dyn std::error::Error + 'static) {
        match self {
            CycleError::Observe(e) => *e,
            CycleError::Act(e) => *e,
        }
    }

    /// The error with its whole cause chain, one line
    /// ([`vq_common::error::chain`]), for the log and the status page.
    pub fn chain(&self) -> String {
        vq_common::error::chain(self.error())
    }
}

/// What to do after a failed pool cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Next {
    /// The least delay before the pool is reconciled again (the service's
    /// `Retry-After`, at most [`MAX_RETRY_AFTER`]); the pool's backoff
    /// delay applies when it is longer.
    pub at_least: Option<Duration>,
    /// Whether retrying cannot fix it: the log says so at error level
    /// (check the pool's configuration, the cloud or the broker account).
    pub permanent: bool,
}

/// The policy for `err` (see the module doc).
pub fn error_policy(err: CycleError<'_>) -> Next {
    let (transient, retry_after) = match err {
        CycleError::Observe(e) => (e.is_transient(), e.retry_after()),
        CycleError::Act(e) => (e.is_transient(), e.retry_after()),
    };
    Next {
        at_least: retry_after.map(|d| d.min(MAX_RETRY_AFTER)),
        permanent: !transient,
    }
}

/// The first permission the broker refused in a cycle
/// ([`AmqpError::access_refused`]): a cycle with one counts as failed for
/// lack of permission (`/readyz` 503, `/status` `broker_access_refused`),
/// whichever step met it (observe, act or fence).
#[derive(Debug, Default)]
pub struct Refusals {
    first: Option<String>,
}

impl Refusals {
    /// Notes `e` if the broker refused it for lack of a permission; the
    /// first one of the cycle is logged and kept.
    pub fn note(&mut self, e: &AmqpError) {
        if let Some(text) = e.access_refused() {
            if self.first.is_none() {
                // A refused login (wrong user or password, or no access to
                // the vhost) is no missing permission: say which it is.
                let text = if matches!(e, AmqpError::Connect { .. }) {
                    tracing::error!(refused = %text, "the broker refused the controller's login: check the user and password of [broker] url and the user's access to the vhost; /readyz reports 503");
                    format!("login refused (check the user and password of [broker] url, and the user's access to the vhost): {text}")
                } else {
                    tracing::error!(refused = %text, "the broker refused an operation: the controller's account lacks a permission (README.md, \"Broker accounts and trust\"); /readyz reports 503");
                    format!("permission refused: {text}")
                };
                self.first = Some(text);
            }
        }
    }

    /// The refusal noted since the last call, if any (a cycle starts with
    /// none).
    pub fn take(&mut self) -> Option<String> {
        self.first.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CloudError;
    use vq_common::amqp::AmqpError;

    fn access_refused(text: &str) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(
            lapin::protocol::AMQPError::from_id(403, text.into()).unwrap(),
        )
        .into()
    }

    /// A refused login is told from a missing permission (the operator's
    /// fix differs: the password, or `set_permissions`).
    #[test]
    fn a_refused_login_is_no_missing_permission() {
        let mut r = Refusals::default();
        r.note(&AmqpError::Connect {
            url: "amqp://ctl@h/%2f".into(),
            source: access_refused(
                "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN",
            ),
        });
        let t = r.take().unwrap();
        assert!(
            t.starts_with("login refused (check the user and password"),
            "{t}"
        );
        r.note(&AmqpError::Op {
            what: "declare".into(),
            source: access_refused(
                "ACCESS_REFUSED - access to exchange 'vq.x' in vhost '/' refused for user 'ctl'",
            ),
        });
        let t = r.take().unwrap();
        assert!(
            t.starts_with("permission refused: ACCESS_REFUSED - access to exchange"),
            "{t}"
        );
    }

    fn status(code: u16, retry_after: Option<u64>) -> CloudError {
        CloudError::Status {
            op: "GET /servers/detail".into(),
            status: code,
            message: "m".into(),
            retry_after: retry_after.map(Duration::from_secs),
        }
    }

    #[test]
    fn a_quota_403_is_temporary_and_other_403s_are_permanent() {
        let forbidden = |message: &str| CloudError::Status {
            op: "POST /servers".into(),
            status: 403,
            message: message.into(),
            retry_after: None,
        };
        let quota = forbidden(
            "Quota exceeded for instances: Requested 1, but already used 10 of 10 instances",
        );
        assert!(quota.is_quota_exceeded());
        assert!(quota.is_transient(), "a quota stop is logged as permanent");
        let policy =
            forbidden("Policy doesn't allow os_compute_api:servers:create to be performed.");
        assert!(!policy.is_quota_exceeded());
        assert!(!policy.is_transient());
    }

    fn timeout() -> AmqpError {
        AmqpError::Timeout {
            what: "connect".into(),
            secs: 15,
        }
    }

    fn unroutable() -> AmqpError {
        AmqpError::Unroutable {
            exchange: "vq.control".into(),
            routing_key: "vq.probe".into(),
            reply: "NO_ROUTE".into(),
        }
    }

    fn create(e: CloudError) -> ActError {
        ActError::Create {
            pool: "cms".into(),
            name: "vq-cms-1".into(),
            source: Box::new(e),
        }
    }

    #[test]
    fn each_error_kind_is_retried_backed_off_and_surfaced_as_the_table_says() {
        let secs = |s| Some(Duration::from_secs(s));
        let observe = |e: ObserveError| move || error_policy(CycleError::Observe(&e));
        let act = |e: ActError| move || error_policy(CycleError::Act(&e));
        #[allow(clippy::type_complexity)]
        let table: Vec<(&str, Box<dyn Fn() -> Next>, Option<Duration>, bool)> = vec![
            (
                "server list 429 with Retry-After",
                Box::new(observe(ObserveError::Servers(status(429, Some(7))))),
                secs(7),
                false,
            ),
            (
                "server list 503",
                Box::new(observe(ObserveError::Servers(status(503, None)))),
                None,
                false,
            ),
            (
                "server list 403",
                Box::new(observe(ObserveError::Servers(status(403, None)))),
                None,
                true,
            ),
            (
                "server list Retry-After of a day",
                Box::new(observe(ObserveError::Servers(status(503, Some(86_400))))),
                Some(MAX_RETRY_AFTER),
                false,
            ),
            (
                "server list unexpected body",
                Box::new(observe(ObserveError::Servers(CloudError::Decode {
                    op: "GET".into(),
                    detail: "d".into(),
                }))),
                None,
                true,
            ),
            (
                "no broker connection",
                Box::new(observe(ObserveError::Broker(timeout()))),
                None,
                false,
            ),
            (
                "alarm probe unroutable",
                Box::new(observe(ObserveError::Probe(unroutable()))),
                None,
                true,
            ),
            (
                "queue depth timed out",
                Box::new(observe(ObserveError::QueueDepth {
                    queue: "vq.jobs.cms".into(),
                    source: timeout(),
                })),
                None,
                false,
            ),
            (
                "create 413 quota with Retry-After",
                Box::new(act(create(status(413, Some(30))))),
                secs(30),
                false,
            ),
            (
                "create 400 bad request",
                Box::new(act(create(status(400, None)))),
                None,
                true,
            ),
            (
                "flavor not found",
                Box::new(act(ActError::Resolve {
                    pool: "cms".into(),
                    source: Box::new(CloudError::Resolve {
                        kind: "flavor",
                        name: "m1".into(),
                        detail: "none".into(),
                    }),
                })),
                None,
                true,
            ),
            (
                "ask-delete timed out",
                Box::new(act(ActError::Control {
                    what: "ask-delete",
                    agent: "a".into(),
                    source: Box::new(timeout()),
                })),
                None,
                false,
            ),
            (
                "user-data unrenderable",
                Box::new(act(ActError::UserData {
                    pool: "cms".into(),
                    detail: "d".into(),
                })),
                None,
                true,
            ),
        ];
        for (what, next, at_least, permanent) in table {
            assert_eq!(
                next(),
                Next {
                    at_least,
                    permanent
                },
                "{what}"
            );
        }
    }

    #[test]
    fn the_status_line_keeps_every_cause() {
        let e = ObserveError::QueueDepth {
            queue: "vq.jobs.cms".into(),
            source: timeout(),
        };
        assert_eq!(
            CycleError::Observe(&e).chain(),
            "cannot read the depth of queue vq.jobs.cms: broker operation connect timed out after 15 s"
        );
    }
}
