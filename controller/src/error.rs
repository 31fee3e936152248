//! Error types of the controller, one enum per area (STYLE.md practice 3).
//! Messages name the failed action; causes are `#[source]`; whether an error
//! is worth retrying is a method, never a string match.

use std::time::Duration;

use vq_common::amqp::AmqpError;

/// Errors talking to OpenStack (Keystone, Nova, Glance).
#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    /// The request could not be sent or its response not read (connection
    /// refused, timeout, TLS).
    #[error("OpenStack request {op} failed in transport")]
    Transport {
        /// What was attempted, e.g. `GET /servers/detail`.
        op: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// The service answered with an error status.
    #[error("OpenStack request {op} failed with HTTP {status}: {message}")]
    Status {
        /// What was attempted.
        op: String,
        /// HTTP status code.
        status: u16,
        /// The service's fault message (or the start of the body).
        message: String,
        /// `Retry-After` of the response, if any.
        retry_after: Option<Duration>,
    },
    /// The response was not what the API documents.
    #[error("OpenStack request {op} returned an unexpected response: {detail}")]
    Decode {
        /// What was attempted.
        op: String,
        /// What was wrong.
        detail: String,
    },
    /// The service catalog has no endpoint for a service we need.
    #[error("no {service} endpoint with interface {interface} in region {region:?} in the Keystone catalog")]
    NoEndpoint {
        /// Service type (`compute`, `image`).
        service: String,
        /// Interface (`public`, `internal`, `admin`).
        interface: String,
        /// Region, if one was configured.
        region: Option<String>,
    },
    /// The compute API does not serve the microversion vq requests: its
    /// version document gives a range without it.
    #[error("the compute API serves microversions {min} to {max}, but vq requests {wanted} (it needs at least {needed}, for server tags); upgrade Nova or set compute_microversion within that range")]
    Microversion {
        /// The microversion vq requests (the configured one, or 2.52).
        wanted: vq_common::config::Microversion,
        /// The lowest vq works with ([`vq_common::config::MIN_COMPUTE_MICROVERSION`]).
        needed: vq_common::config::Microversion,
        /// The cloud's `min_version`.
        min: vq_common::config::Microversion,
        /// The cloud's `version` (its maximum).
        max: vq_common::config::Microversion,
    },
    /// A flavor or image name matched nothing (or several things).
    #[error("cannot resolve {kind} {name:?}: {detail}")]
    Resolve {
        /// `flavor` or `image`.
        kind: &'static str,
        /// The configured name.
        name: String,
        /// What went wrong (none found, several found).
        detail: String,
    },
    /// Not sent: this controller could not prove it holds the controller
    /// lock right before the request ([`crate::leader`]); another one may
    /// act. Transient: it acts again once it holds the lock.
    #[error("{op} not sent: this controller is not the acting one ({why})")]
    NotLeader {
        /// The request not sent, e.g. `create server`.
        op: String,
        /// Why the lock is not proven.
        why: String,
    },
}

impl CloudError {
    /// Whether retrying later may succeed: transport errors, 401 (after the
    /// token was already renewed once), 409, 413, 429 and 5xx.
    pub fn is_transient(&self) -> bool {
        match self {
            CloudError::Transport { .. } | CloudError::NotLeader { .. } => true,
            CloudError::Status { status, .. } => {
                matches!(status, 401 | 409 | 413 | 429)
                    || (500..600).contains(status)
                    || self.is_quota_exceeded()
            }
            CloudError::Decode { .. }
            | CloudError::Microversion { .. }
            | CloudError::NoEndpoint { .. }
            | CloudError::Resolve { .. } => false,
        }
    }

    /// Whether this is Nova's quota refusal (403 or 413 whose message says
    /// "Quota exceeded"): a temporary condition (servers going away free
    /// it), not a configuration error.
    pub fn is_quota_exceeded(&self) -> bool {
        match self {
            CloudError::Status {
                status, message, ..
            } => {
                matches!(status, 403 | 413)
                    && message.to_ascii_lowercase().contains("quota exceeded")
            }
            _ => false,
        }
    }

    /// The delay the service asked for (`Retry-After`), if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            CloudError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The HTTP status, if the service answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            CloudError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Errors finding OpenStack credentials (clouds.yaml or `OS_*`).
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// A clouds.yaml file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A clouds.yaml file is not valid YAML of the expected shape.
    #[error("cannot parse {path}")]
    Parse {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// A cloud name was given but no clouds.yaml defines it.
    #[error("cloud {cloud:?} is not defined in any clouds.yaml (searched: {searched})")]
    UnknownCloud {
        /// The cloud name.
        cloud: String,
        /// Files searched, comma-separated.
        searched: String,
    },
    /// Required values are missing.
    #[error("incomplete OpenStack credentials from {origin}: {missing}")]
    Incomplete {
        /// `clouds.yaml cloud X` or `OS_* environment`.
        origin: String,
        /// What is missing.
        missing: String,
    },
    /// A setting has a value of the wrong kind (`verify: maybe`).
    #[error("{key}: {value} is not valid, expected {expected}")]
    Value {
        /// Where it was read: `clouds.yaml <path>: clouds.<cloud>.verify`
        /// or `OS_INSECURE`.
        key: String,
        /// The value, quoted.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// The auth type is not one we implement.
    #[error(
        "unsupported auth_type {auth_type:?} (use password, v3password or v3applicationcredential)"
    )]
    AuthType {
        /// The configured auth type.
        auth_type: String,
    },
}

/// Why the HTTP client of the cloud ([`crate::openstack::HttpCloud`])
/// could not be built.
#[derive(Debug, thiserror::Error)]
pub enum HttpClientError {
    /// The cloud's TLS files (`cacert`, `cert`, `key`) cannot be used.
    #[error("cannot use the cloud's TLS files: {}", problems.join("; "))]
    TlsFiles {
        /// Every problem, `"<key>: <path> <problem>"`.
        problems: Vec<String>,
    },
    /// reqwest refused the configuration (no rustls provider installed).
    #[error("cannot build the HTTP client")]
    Build(#[source] reqwest::Error),
}

/// Errors of observing a pool; any of them means "act on nothing this cycle".
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// The complete server list could not be read.
    #[error("cannot list the cluster's servers")]
    Servers(#[source] CloudError),
    /// A pool queue's depth could not be read.
    #[error("cannot read the depth of queue {queue}")]
    QueueDepth {
        /// Queue name.
        queue: String,
        /// Cause.
        #[source]
        source: AmqpError,
    },
    /// No broker connection.
    #[error("no broker connection")]
    Broker(#[source] AmqpError),
    /// The alarm probe (a publish to the control exchange) failed.
    #[error("cannot publish the broker alarm probe")]
    Probe(#[source] AmqpError),
}

impl ObserveError {
    /// Whether the next cycle may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            ObserveError::Servers(e) => e.is_transient(),
            ObserveError::QueueDepth { source, .. }
            | ObserveError::Broker(source)
            | ObserveError::Probe(source) => source.is_transient(),
        }
    }

    /// The delay the service asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ObserveError::Servers(e) => e.retry_after(),
            _ => None,
        }
    }
}

/// Errors of carrying out a plan.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// Creating a server failed.
    #[error("cannot create server {name} in pool {pool}")]
    Create {
        /// Pool.
        pool: String,
        /// Server name.
        name: String,
        /// Cause.
        #[source]
        source: Box<CloudError>,
    },
    /// Deleting a server failed.
    #[error("cannot delete server {name} ({id})")]
    Delete {
        /// Server id.
        id: String,
        /// Server name.
        name: String,
        /// Cause.
        #[source]
        source: Box<CloudError>,
    },
    /// Resolving the pool's flavor or image failed.
    #[error("cannot resolve the flavor or image of pool {pool}")]
    Resolve {
        /// Pool.
        pool: String,
        /// Cause.
        #[source]
        source: Box<CloudError>,
    },
    /// Sending a control message failed.
    #[error("cannot send {what} to agent {agent}")]
    Control {
        /// Message kind.
        what: &'static str,
        /// Agent id.
        agent: String,
        /// Cause (boxed: lapin errors are large).
        #[source]
        source: Box<AmqpError>,
    },
    /// The user-data template could not be read or rendered.
    #[error("cannot render the user-data of pool {pool}")]
    UserData {
        /// Pool.
        pool: String,
        /// What went wrong.
        detail: String,
    },
}

impl ActError {
    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            ActError::Create { source, .. }
            | ActError::Delete { source, .. }
            | ActError::Resolve { source, .. } => source.is_transient(),
            ActError::Control { source, .. } => source.is_transient(),
            ActError::UserData { .. } => false,
        }
    }

    /// The delay the service asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ActError::Create { source, .. }
            | ActError::Delete { source, .. }
            | ActError::Resolve { source, .. } => source.retry_after(),
            _ => None,
        }
    }
}

/// Errors that stop the controller.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client of the cloud")]
    HttpClient(#[source] HttpClientError),
    /// The status endpoint could not listen.
    #[error("cannot listen on {addr}")]
    Listen {
        /// Address.
        addr: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `compute_microversion` is not a version (config validation refuses
    /// it first).
    #[error("compute_microversion {value:?} is not a version like 2.52")]
    Microversion {
        /// The configured value.
        value: String,
    },
    /// `[jobs] api_token_file` cannot be used.
    #[error("jobs.api_token_file {path}: {problem}")]
    JobsToken {
        /// The configured path.
        path: String,
        /// What is wrong (unreadable, empty, group/other permission bits).
        problem: String,
    },
    /// The compute API cannot serve what vq needs (its version document,
    /// read at start, gives a lower maximum microversion).
    #[error("cannot run against this cloud")]
    Cloud(#[source] CloudError),
    /// `--once`: the single cycle failed for these pools (their errors are
    /// logged and on `/status`).
    #[error("the single cycle failed for pool(s) {}", pools.join(", "))]
    OnceFailed {
        /// The pools whose cycle failed.
        pools: Vec<String>,
    },
}
