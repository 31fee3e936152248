//! Error types of the jobagent, one enum per area (STYLE practice 3).

use std::path::PathBuf;

use vq_common::amqp::AmqpError;
use vq_common::messages::DecodeError;

/// Why a job was refused before it ran. The `Display` text is the reason
/// published in the `job.<pool>.failed` event and in the dead-letter header.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    /// The body is not a valid job message.
    #[error("job message cannot be decoded")]
    Malformed(#[source] DecodeError),
    /// The job names another pool than the one this agent serves.
    #[error("job is for pool {job_pool:?}, this agent serves pool {our_pool:?}")]
    WrongPool {
        /// Pool named in the job.
        job_pool: String,
        /// Pool of the agent.
        our_pool: String,
    },
    /// A job field has a value the agent cannot use.
    #[error("job field {field}: {problem}")]
    BadField {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The job asks for more slots or memory than this VM has (one VM per
    /// job: it can never run here).
    #[error("job asks for {asked}, more than this VM has ({have}): it cannot run in this pool")]
    TooLarge {
        /// `slots` or `memory`.
        what: &'static str,
        /// What the job asked for.
        asked: String,
        /// What the VM has.
        have: String,
    },
    /// The script is larger than the configured limit.
    #[error("job script is {size} bytes, larger than max_script_bytes {limit}")]
    ScriptTooLarge {
        /// Script size, bytes.
        size: usize,
        /// Limit, bytes.
        limit: usize,
    },
    /// The job has dependencies (`-W depend=`) but did not come from the
    /// controller's release (its `user_id` is no requeuer): it was
    /// published straight to the pool queue and would run without waiting
    /// for them.
    #[error("job has dependencies ({depend}) but was published to the pool queue, not released by the controller: publish it to the held exchange <cluster>.hold instead")]
    NotReleased {
        /// The dependencies, e.g. `afterok:12`.
        depend: String,
    },
    /// The message carries no broker-validated `user_id`.
    #[error("job message has no AMQP user_id, so its submitter is unknown")]
    NoSubmitter,
    /// The submitter may not submit jobs for this owner.
    #[error("submitter {submitter:?} may not submit jobs for owner {owner:?}")]
    SubmitterNotAllowed {
        /// Broker user that published the job.
        submitter: String,
        /// Owner named in the job.
        owner: String,
    },
    /// The thread that plans the job (and runs its lookups) failed.
    #[error("the agent's job planning thread failed")]
    PlanningFailed(#[source] tokio::task::JoinError),
    /// The user database could not be read (or did not answer in time).
    #[error("cannot look up {what} {name:?} in the user database")]
    Lookup {
        /// `user` or `group`.
        what: &'static str,
        /// Name looked up.
        name: String,
        /// Cause.
        #[source]
        source: NssError,
    },
    /// The owner's group list contains gid 0 and `allow_group_zero` is off.
    #[error("owner {owner:?} is a member of group 0 (root); set allow_group_zero to allow it")]
    GroupZero {
        /// Owner.
        owner: String,
    },
    /// The owner is a member of a group in `deny_groups`.
    #[error("owner {owner:?} is a member of group {group:?}, which is in deny_groups")]
    GroupDenied {
        /// Owner.
        owner: String,
        /// The denied group.
        group: String,
    },
    /// `allow_groups` is set and the owner is in none of them.
    #[error("owner {owner:?} is a member of none of allow_groups")]
    GroupNotAllowed {
        /// Owner.
        owner: String,
    },
    /// The owner does not exist on this host.
    #[error("owner {owner:?} does not exist on this host")]
    UnknownOwner {
        /// Owner named in the job.
        owner: String,
    },
    /// The owner is root (uid 0): never allowed.
    #[error("owner {owner:?} has uid 0: jobs never run as root")]
    RootOwner {
        /// Owner named in the job.
        owner: String,
    },
    /// The owner's uid is below `min_uid`.
    #[error("owner {owner:?} has uid {uid} below min_uid {min_uid}")]
    UidBelowMin {
        /// Owner.
        owner: String,
        /// Owner's uid.
        uid: u32,
        /// Configured minimum.
        min_uid: u32,
    },
    /// The owner is in `deny_owners`.
    #[error("owner {owner:?} is in deny_owners")]
    OwnerDenied {
        /// Owner.
        owner: String,
    },
    /// `allow_owners` is set and does not name the owner.
    #[error("owner {owner:?} is not in allow_owners")]
    OwnerNotAllowed {
        /// Owner.
        owner: String,
    },
    /// The requested group does not exist.
    #[error("group {group:?} does not exist on this host")]
    UnknownGroup {
        /// Group named in the job.
        group: String,
    },
    /// The owner is not a member of the requested group.
    #[error("owner {owner:?} is not a member of group {group:?}")]
    NotInGroup {
        /// Owner.
        owner: String,
        /// Group.
        group: String,
    },
    /// The working directory is unusable.
    #[error("working directory {path}: {problem}")]
    Workdir {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        problem: &'static str,
    },
    /// The shell is unusable.
    #[error("shell {path}: {problem}")]
    Shell {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        problem: &'static str,
    },
    /// A job with this id is already running here and the delivery is not a
    /// redelivery of it.
    #[error("a job with id {job_id:?} is already running on this agent")]
    DuplicateId {
        /// Job id.
        job_id: String,
    },
}

/// A user or group lookup through the system's NSS failed (not "no such
/// entry", which is `Ok(None)`).
#[derive(Debug, thiserror::Error)]
pub enum NssError {
    /// `getent` could not be started or waited for.
    #[error("cannot run {getent}")]
    Exec {
        /// Path of getent.
        getent: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `getent` did not answer in time (it was killed).
    #[error("lookup timed out after {secs} s: {getent} {database} {key}")]
    Timeout {
        /// Path of getent.
        getent: String,
        /// Database asked (`passwd`, `group`, `initgroups`).
        database: &'static str,
        /// The name looked up.
        key: String,
        /// Timeout, seconds.
        secs: f64,
    },
    /// `getent` failed with an exit status other than "not found".
    #[error("{getent} {database} exited with status {status}")]
    Status {
        /// Path of getent.
        getent: String,
        /// Database asked.
        database: &'static str,
        /// Exit status (or -signal).
        status: i32,
    },
    /// `getent` printed an entry that cannot be parsed.
    #[error("{database} entry {line:?} cannot be parsed")]
    Parse {
        /// Database asked.
        database: &'static str,
        /// The offending line (lossy UTF-8).
        line: String,
    },
    /// A passwd or group file (the `files` source) cannot be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The libc lookup (fallback without getent) failed.
    #[error("libc lookup failed")]
    Libc(#[source] nix::Error),
    /// A name contains a NUL byte or starts with '-'.
    #[error("{name:?} is not a valid user or group name")]
    BadName {
        /// The name.
        name: String,
    },
}

/// A job could not be started; becomes `Outcome::FailedToStart`.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Preparing the script, pipes or the command in the parent failed.
    #[error("cannot prepare the job process: {what}")]
    Prepare {
        /// Which step.
        what: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A step in the child between fork and exec failed (reported through
    /// the spawn pipe).
    #[error("{step} failed in the job process")]
    Child {
        /// Which step, e.g. `open stdout file /home/u/x.o1 as the owner`.
        step: String,
        /// The errno of the failure.
        #[source]
        source: std::io::Error,
    },
    /// A cgroup v2 operation for the job failed, or a configured limit
    /// cannot be applied (jobs never run without their configured limits).
    #[error("cannot set up the job's cgroup: {what}")]
    Cgroup {
        /// What failed, with the path.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `exec` of the shell failed.
    #[error("cannot execute shell {shell}")]
    Exec {
        /// Shell path.
        shell: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Errors that end a broker session (the agent reconnects) or the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A broker operation failed.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    /// The broker cancelled our consumer or closed a channel.
    #[error("the broker ended the {what}")]
    Lost {
        /// What ended, e.g. `pool queue consumer`.
        what: &'static str,
    },
    /// The agent ends the session itself to resolve `what` on a new one
    /// (DESIGN.md, "Unknown outcomes").
    #[error("ending the session to resolve {what} on a new one")]
    Resolving {
        /// What is resolved, e.g. `an outcome (a lost confirm …)`.
        what: &'static str,
    },
    /// The state directory could not be created.
    #[error("cannot create state directory {path}")]
    StateDir {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Renders an error with its whole `source` chain on one line, for event
/// reasons and logs (the one renderer, shared with the controller).
pub use vq_common::error::chain;
