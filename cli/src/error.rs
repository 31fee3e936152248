//! Errors of the `vq` CLI and their exit codes: [`CliError`] for every
//! command, [`SubmitError`] for a job that cannot be built.

use vq_common::amqp::AmqpError;
use vq_common::pbs::PbsError;

/// Exit code for bad usage or bad input (`EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;
/// Exit code when the broker or the controller cannot be reached
/// (`EX_UNAVAILABLE`).
pub const EXIT_UNAVAILABLE: i32 = 69;
/// Exit code when an agent refused a control request (`EX_NOPERM`): the
/// sender is not in its `control_admins`, does not own the job, or the
/// agent already agreed to be deleted.
pub const EXIT_REFUSED: i32 = 77;
/// Exit code for any other failure.
pub const EXIT_OTHER: i32 = 1;

/// A failed `vq` command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The CLI configuration (flags, environment, config file) is invalid.
    #[error("invalid vq configuration{}: {problem}", origin.as_deref().map(|o| format!(" in {o}")).unwrap_or_default())]
    Config {
        /// The config file, if the problem is in one.
        origin: Option<String>,
        /// What is wrong.
        problem: String,
    },
    /// A file (config or script) could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file (`-` for stdin).
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The job could not be built from the script and options.
    #[error("cannot submit job")]
    Submit(#[from] SubmitError),
    /// A command-line value is invalid (e.g. a bad `-l` list).
    #[error("invalid option")]
    Option(#[source] PbsError),
    /// Facts about the submitting user or host could not be found.
    #[error("cannot determine the {what}")]
    Environment {
        /// What, e.g. `current directory`.
        what: String,
        /// Cause, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A broker operation failed.
    #[error("cannot {action}")]
    Broker {
        /// What was being done, e.g. `submit job to pool "cms"`.
        action: String,
        /// Cause (boxed: lapin errors are large).
        #[source]
        source: Box<AmqpError>,
    },
    /// The pool has no queue on the broker.
    #[error("no pool named {pool:?} on cluster {cluster:?} (no queue {cluster}.jobs.{pool}); {}", pools_hint(.known))]
    NoSuchPool {
        /// Pool.
        pool: String,
        /// Cluster.
        cluster: String,
        /// The pools the controller's `/status` names, when it answered
        /// (`None`: not asked or not reachable).
        known: Option<Vec<String>>,
    },
    /// The job asks more than any VM of its pool has, as the controller
    /// publishes the pool's limits ([`vq_common::pools`]); nothing was
    /// published. One sentence per limit, each on its own line (the lines
    /// after the first start with `vq: `, as `vq` prints the first).
    #[error("{}", refusals.join("\nvq: "))]
    OverLimits {
        /// Why, one sentence per limit exceeded
        /// ([`vq_common::pools::PoolLimits::refusals`]).
        refusals: Vec<String>,
    },
    /// The controller's `/status` has no pool of this name (`vq nodes
    /// POOL`).
    #[error("no pool named {pool:?} on cluster {cluster:?}; {}", pools_hint(&Some(.known.clone())))]
    UnknownPool {
        /// Pool as given.
        pool: String,
        /// Cluster.
        cluster: String,
        /// The pools the controller's `/status` names, sorted.
        known: Vec<String>,
    },
    /// The cluster's exchanges do not exist on the broker.
    #[error("no cluster named {cluster:?} on the broker (exchange {exchange:?} does not exist); check --cluster, or start the controller, which declares it")]
    NoSuchCluster {
        /// Cluster.
        cluster: String,
        /// The missing exchange.
        exchange: String,
    },
    /// No connected agent has this id.
    #[error("no agent named {agent:?} is connected to cluster {cluster:?}")]
    NoSuchAgent {
        /// Agent id.
        agent: String,
        /// Cluster.
        cluster: String,
    },
    /// No event names the job.
    #[error("unknown job id {job_id:?} (vq only knows jobs that started in the last 7 days)")]
    UnknownJob {
        /// The id as given.
        job_id: String,
    },
    /// A job-id prefix matches several jobs.
    #[error("job id {job_id:?} is ambiguous: it matches {}", matches.join(", "))]
    AmbiguousJob {
        /// The prefix as given.
        job_id: String,
        /// The matching ids.
        matches: Vec<String>,
    },
    /// The job is not running, so it cannot be cancelled.
    #[error("job {job_id} is not running (state {state})")]
    NotRunning {
        /// Job id.
        job_id: String,
        /// Its state letter and meaning.
        state: String,
    },
    /// Only the owner (or root) may act on a job.
    #[error("job {job_id} belongs to {owner:?}, not to {user:?}")]
    NotOwner {
        /// Job id.
        job_id: String,
        /// Job owner.
        owner: String,
        /// The invoking user.
        user: String,
    },
    /// A broker message could not be decoded.
    #[error("cannot decode {what}")]
    Decode {
        /// What.
        what: String,
        /// Cause.
        #[source]
        source: vq_common::messages::DecodeError,
    },
    /// A command-line value that cannot be used (the message says which
    /// and why).
    #[error("{0}")]
    Usage(String),
    /// No controller answered a job-table query (`vq stat`).
    #[error("{}", if *listening {
        format!("no controller answered on {exchange} (key {key}) within {secs} s; the controller may be overloaded or its broker session restarting (try again, raise --timeout, or use vq stat --from-stream to read the event stream yourself, slowly)")
    } else {
        format!("no controller is listening on {exchange} (key {key}): is vq-controller running for this cluster? (vq stat --from-stream reads the event stream yourself, slowly)")
    })]
    NoController {
        /// The control exchange.
        exchange: String,
        /// The query routing key.
        key: String,
        /// How long it waited, seconds.
        secs: f64,
        /// Whether a controller's queue took the query (then it did not
        /// answer in time); `false`: no queue was bound (unroutable).
        listening: bool,
    },
    /// An agent refused a control request, saying why.
    #[error("refused: {reason}")]
    Refused {
        /// The agent's reason.
        reason: String,
    },
    /// A cancel reached the agent, but the job is not running there.
    #[error(
        "job {job_id} is not running on agent {agent} (it may have ended just now; see vq stat)"
    )]
    NotHere {
        /// Job id.
        job_id: String,
        /// Agent id.
        agent: String,
    },
    /// The agent took a control request but did not answer in time.
    #[error("agent {agent} took the request but did not answer within {secs} s: it may run a vq-jobagent older than control answers (then the request is followed, unanswered; see vq pools), be stuck, or its broker account may lack write on the replies exchange")]
    NoAnswer {
        /// Agent id.
        agent: String,
        /// How long the command waited, seconds.
        secs: f64,
    },
    /// The controller's table has no job of this id (prefix), or several.
    #[error("{reason}")]
    UnknownJobAnswer {
        /// The controller's words.
        reason: String,
    },
    /// What was asked needs a controller, and none answers.
    #[error("{problem}")]
    NeedsController {
        /// What and why, in words.
        problem: String,
    },
    /// The controller could not answer for good yet (its table is being
    /// rebuilt, the broker did not confirm): try again.
    #[error("the controller cannot answer now: {reason}")]
    ControllerBusy {
        /// The controller's words.
        reason: String,
    },
    /// The controller refused a job-table query, saying why.
    #[error("the controller refused the query: {problem}")]
    QueryRefused {
        /// The controller's reason.
        problem: String,
    },
    /// The controller's status page could not be fetched.
    #[error("cannot fetch the controller status from {url}")]
    Controller {
        /// URL.
        url: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// The controller answered with something other than a status document.
    #[error("unexpected answer from the controller at {url}: {problem}")]
    ControllerAnswer {
        /// URL.
        url: String,
        /// What is wrong.
        problem: String,
    },
    /// The connection was lost while waiting for the job (`--wait`).
    #[error("lost the event subscription while waiting for job {job_id}; the job may still run (see vq stat)")]
    WaitInterrupted {
        /// Job id.
        job_id: String,
    },
}

/// Why a job could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The script is larger than
    /// [`MAX_SCRIPT_BYTES`](vq_common::messages::MAX_SCRIPT_BYTES).
    #[error("the script is {size} bytes, larger than the limit of {limit} bytes (keep large files on a shared file system)")]
    ScriptTooLarge {
        /// Size, bytes (at least; reading stops past the limit).
        size: usize,
        /// Limit, bytes.
        limit: usize,
    },
    /// The script is not UTF-8 text.
    #[error("the script is not UTF-8 text")]
    ScriptNotText,
    /// The script has nothing but blanks.
    #[error("the script is empty")]
    EmptyScript,
    /// A `#PBS` directive is invalid.
    #[error("invalid #PBS directive in {script}")]
    Directive {
        /// Script name.
        script: String,
        /// The problem, with its line.
        #[source]
        source: PbsError,
    },
    /// The encoded job is larger than
    /// [`MAX_JOB_MESSAGE_BYTES`](vq_common::messages::MAX_JOB_MESSAGE_BYTES)
    /// (usually a huge `-V` environment).
    #[error("the job message is {size} bytes, larger than the limit of {limit} bytes (is the -V environment huge?)")]
    JobTooLarge {
        /// Size, bytes.
        size: usize,
        /// Limit, bytes.
        limit: usize,
    },
    /// A `-W depend=` job id the controller's job table does not know (or
    /// names ambiguously): the job would be held until cancelled.
    #[error("-W depend: {problem} (a dependency must be a job the controller's table knows: see `vq stat -a`)")]
    Dependency {
        /// The id as written.
        id: String,
        /// The controller's answer, e.g. `unknown job id "123"`.
        problem: String,
    },
}

impl CliError {
    /// Process exit code: 64 for bad usage or input, 69 when the broker,
    /// the controller or an agent's answer is unavailable, 77 when an agent
    /// refused, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Config { .. }
            | CliError::Read { .. }
            | CliError::Submit(_)
            | CliError::Option(_)
            | CliError::Usage(_)
            | CliError::NoSuchPool { .. }
            | CliError::OverLimits { .. }
            | CliError::UnknownPool { .. }
            | CliError::NoSuchCluster { .. }
            | CliError::NoSuchAgent { .. }
            | CliError::UnknownJob { .. }
            | CliError::UnknownJobAnswer { .. }
            | CliError::AmbiguousJob { .. } => EXIT_USAGE,
            CliError::Broker { source, .. } => match **source {
                AmqpError::Connect { .. }
                | AmqpError::Timeout { .. }
                | AmqpError::CaFile { .. } => EXIT_UNAVAILABLE,
                _ => EXIT_OTHER,
            },
            CliError::Controller { .. }
            | CliError::NoController { .. }
            | CliError::NoAnswer { .. }
            | CliError::ControllerBusy { .. }
            | CliError::NeedsController { .. } => EXIT_UNAVAILABLE,
            CliError::Refused { .. } => EXIT_REFUSED,
            CliError::NotHere { .. } => EXIT_OTHER,
            CliError::QueryRefused { .. } => EXIT_OTHER,
            CliError::Environment { .. }
            | CliError::NotRunning { .. }
            | CliError::NotOwner { .. }
            | CliError::Decode { .. }
            | CliError::ControllerAnswer { .. }
            | CliError::WaitInterrupted { .. } => EXIT_OTHER,
        }
    }

    pub(crate) fn broker(action: impl Into<String>) -> impl FnOnce(AmqpError) -> CliError {
        let action = action.into();
        move |source| CliError::Broker {
            action,
            source: Box::new(source),
        }
    }
}

/// The AMQP reply code (e.g. 404 NOT_FOUND, 403 ACCESS_REFUSED) of a broker
/// error that the broker sent, if any.
pub fn amqp_reply_code(err: &AmqpError) -> Option<u16> {
    let source = match err {
        AmqpError::Connect { source, .. }
        | AmqpError::Declare { source, .. }
        | AmqpError::Op { source, .. } => source,
        AmqpError::Publish { source, .. } => source.as_ref(),
        _ => return None,
    };
    lapin_reply_code(source)
}

pub use vq_common::amqp::{lapin_reply_code, NOT_FOUND};

/// The second half of [`CliError::NoSuchPool`]'s message: the pools that
/// exist, or where to find them.
fn pools_hint(known: &Option<Vec<String>>) -> String {
    match known {
        Some(names) if names.is_empty() => "the controller names no pools".into(),
        Some(names) => format!("pools: {}", names.join(", ")),
        None => "`vq pools` lists the pools".into(),
    }
}
