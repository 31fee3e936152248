//! Wire messages exchanged over RabbitMQ.
//!
//! Every message is JSON (`content_type = application/json`) and carries its
//! schema version twice: in the body field `schema` and in the AMQP header
//! [`SCHEMA_HEADER`]. Readers accept unknown fields so that newer writers can
//! add optional fields without breaking older readers; a change that older
//! readers would misinterpret bumps [`SCHEMA_VERSION`].
//!
//! The field names follow the PBS job table of the IHEP design
//! (`seeds/000_*`): `job_hashname`→[`Job::id`], `euser`→[`Job::owner`],
//! `init_workdir`→[`Job::workdir`], `varlist`→[`Job::env`], and so on.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Version of every message schema in this module.
pub const SCHEMA_VERSION: u32 = 1;

/// AMQP header that carries the schema version (an unsigned integer).
pub const SCHEMA_HEADER: &str = "x-vq-schema";

/// AMQP header set on dead-lettered jobs: why the job could not run.
pub const REASON_HEADER: &str = "x-vq-reason";

/// AMQP header set on dead-lettered jobs: who dead-lettered it (agent id).
pub const DEAD_BY_HEADER: &str = "x-vq-dead-by";

/// AMQP header naming the broker user that originally submitted a job, on
/// copies republished by someone else (dead letters, leases, jobs of lost
/// nodes returned by the controller): the original `user_id` cannot be
/// republished because the broker validates it against the publisher.
pub const SUBMITTER_HEADER: &str = "x-vq-submitter";

/// Largest accepted job script, in bytes (1 MiB). Larger scripts belong in a
/// shared file system; the script travels inside every copy of the message.
pub const MAX_SCRIPT_BYTES: usize = 1024 * 1024;

/// Longest accepted job id, in bytes (the agent refuses longer ones).
pub const MAX_JOB_ID_BYTES: usize = 128;

/// Largest accepted job message, in bytes (2 MiB: script plus environment).
pub const MAX_JOB_MESSAGE_BYTES: usize = 2 * 1024 * 1024;

/// Shell used when neither the job (`-S`) nor the owner's passwd entry
/// names one.
pub const FALLBACK_SHELL: &str = "/bin/sh";

/// The shell that runs a job: its `-S` shell ([`Job::shell`]), else the
/// owner's login shell, else [`FALLBACK_SHELL`]; as with Torque, the
/// script's `#!` line is not consulted. The agent applies this rule with
/// the VM's passwd entry, `vq submit` with the submit host's to warn early.
pub fn job_shell<'a>(shell: Option<&'a str>, login_shell: &'a str) -> &'a str {
    match shell {
        Some(s) => s,
        None if login_shell.is_empty() => FALLBACK_SHELL,
        None => login_shell,
    }
}

fn schema_version() -> u32 {
    SCHEMA_VERSION
}

/// How stdout and stderr are joined, as PBS `-j`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Join {
    /// `-j n`: separate files (the default).
    #[default]
    N,
    /// `-j oe`: stderr is written into the stdout file.
    Oe,
    /// `-j eo`: stdout is written into the stderr file.
    Eo,
}

/// A batch job: one message in the pool queue `<cluster>.jobs.<pool>`.
///
/// The AMQP `message_id` is [`Job::id`]; the AMQP `user_id` is set by the
/// submitter and validated by the broker, and is the only submitter identity
/// the jobagent trusts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Job {
    /// Schema version of this message ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Unique job id, e.g. `"1f0c2a9e-….vq"`; exported as `PBS_JOBID`.
    pub id: String,
    /// Job name (PBS `-N`), at most 236 characters; exported as `PBS_JOBNAME`.
    pub name: String,
    /// User the job runs as (PBS `euser`); must exist on the VM.
    pub owner: String,
    /// Group the job runs as (PBS `egroup`, `-W group_list`); `None` means the
    /// owner's primary group.
    #[serde(default)]
    pub group: Option<String>,
    /// Pool (PBS queue, `-q`) the job was submitted to.
    pub pool: String,
    /// The job script, passed to the shell on stdin-free fd; at most
    /// [`MAX_SCRIPT_BYTES`] bytes.
    pub script: String,
    /// Absolute path of the shell (PBS `-S`); `None` means the owner's login
    /// shell.
    #[serde(default)]
    pub shell: Option<String>,
    /// Absolute working directory (PBS `-d`, `init_workdir`); `None` means
    /// the owner's home directory.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Job environment (PBS `-v`, and `-V` which copies the submit
    /// environment); the agent adds the PBS set on top.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Absolute stdout path (PBS `-o`); `None` means
    /// `<workdir>/<name>.o<seq>` as PBS does.
    #[serde(default)]
    pub stdout: Option<String>,
    /// Absolute stderr path (PBS `-e`); `None` means `<workdir>/<name>.e<seq>`.
    #[serde(default)]
    pub stderr: Option<String>,
    /// Join of stdout and stderr (PBS `-j`).
    #[serde(default)]
    pub join: Join,
    /// Walltime limit in seconds (PBS `-l walltime=HH:MM:SS`); `None` means
    /// the agent's `default_walltime`.
    #[serde(default)]
    pub walltime: Option<u64>,
    /// Job slots (cores) it takes on one VM (PBS `-l nodes=1:ppn=N`,
    /// `-l ncpus=N`, `-l select=1:ncpus=N`), at least 1; a message without
    /// the field (older writers) takes 1. Exported as `PBS_NP` and
    /// `PBS_NUM_PPN`; an agent with fewer slots refuses the job.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub slots: u32,
    /// Memory limit, bytes (PBS `-l mem=`); `None` means no limit beyond
    /// the VM's. Enforced as the job cgroup's `memory.max` where cgroups
    /// are delegated; an agent with less memory refuses the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// Whether the job may be run again after a node loss (PBS `-r y|n`).
    #[serde(default = "default_true")]
    pub rerunnable: bool,
    /// File mode creation mask (PBS `-W umask=`), e.g. `0o022`; `None` means
    /// the agent's default.
    #[serde(default)]
    pub umask: Option<u32>,
    /// Host the job was submitted from; exported as `PBS_O_HOST`.
    #[serde(default)]
    pub submit_host: String,
    /// Submission time, Unix seconds.
    #[serde(default)]
    pub submitted_at: u64,
    /// Dependencies (PBS `-W depend=`): the job is held until every one is
    /// satisfied ([`Dependency`]); empty (and absent on the wire) for a job
    /// that waits for nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depend: Vec<Dependency>,
}

/// How a [`Dependency`] is satisfied by the jobs it names, as Torque's
/// `qsub -W depend=` types (qsub(1)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DependKind {
    /// `afterok`: each job completed with exit status 0.
    AfterOk,
    /// `afternotok`: each job ended with a non-zero exit status, or failed
    /// or was cancelled.
    AfterNotOk,
    /// `afterany`: each job ended, in any way.
    AfterAny,
}

impl DependKind {
    /// Every kind, in Torque's order.
    pub const ALL: [DependKind; 3] = [
        DependKind::AfterOk,
        DependKind::AfterNotOk,
        DependKind::AfterAny,
    ];

    /// The Torque word: `afterok`, `afternotok`, `afterany`.
    pub fn word(self) -> &'static str {
        match self {
            DependKind::AfterOk => "afterok",
            DependKind::AfterNotOk => "afternotok",
            DependKind::AfterAny => "afterany",
        }
    }
}

/// One dependency of a job (PBS `-W depend=<kind>:<id>[:<id>...]`): the
/// job may run only once every job of `jobs` has ended as `kind` asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Dependency {
    /// How the jobs must end.
    pub kind: DependKind,
    /// Ids of the jobs depended on (at least one).
    pub jobs: Vec<String>,
}

impl std::fmt::Display for Dependency {
    /// Torque's form, `afterok:12:13`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind.word())?;
        for j in &self.jobs {
            write!(f, ":{j}")?;
        }
        Ok(())
    }
}

fn default_true() -> bool {
    true
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl Job {
    /// Short sequence token used in default output names (`name.o<seq>`):
    /// the part of the id before the first `-` or `.`.
    pub fn seq(&self) -> &str {
        self.id
            .split(['-', '.'])
            .next()
            .filter(|s| !s.is_empty())
            .unwrap_or(&self.id)
    }

    /// Default stdout path under `workdir`, as PBS names it: `<name>.o<seq>`.
    pub fn default_stdout(&self, workdir: &str) -> String {
        format!(
            "{}/{}.o{}",
            workdir.trim_end_matches('/'),
            self.name,
            self.seq()
        )
    }

    /// Default stderr path under `workdir`, as PBS names it: `<name>.e<seq>`.
    pub fn default_stderr(&self, workdir: &str) -> String {
        format!(
            "{}/{}.e{}",
            workdir.trim_end_matches('/'),
            self.name,
            self.seq()
        )
    }
}

/// Resource usage of a finished job, from `wait4`'s rusage.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Wall-clock run time, seconds (monotonic clock).
    pub wall_secs: f64,
    /// User CPU time, seconds.
    pub user_cpu_secs: f64,
    /// System CPU time, seconds.
    pub system_cpu_secs: f64,
    /// Peak resident set size, bytes.
    pub max_rss_bytes: u64,
}

/// Why a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// The job's shell exited with `code` (PBS `exit_status`).
    Exited {
        /// Exit code, 0–255.
        code: i32,
    },
    /// The job's shell was killed by `signal`.
    Signaled {
        /// Signal number, e.g. 9.
        signal: i32,
    },
    /// The walltime limit was reached and the job was killed.
    Walltime,
    /// The job was cancelled (`vq cancel`).
    Cancelled,
    /// The job wrote more than the agent's output limit and was killed.
    OutputLimit,
    /// The job could not be started (bad credentials, workdir, output path…).
    FailedToStart {
        /// Human-readable reason.
        reason: String,
    },
}

impl Outcome {
    /// Torque's exit status (`qstat -f` `exit_status`): the exit code,
    /// `256 + signal` for a job killed by a signal, `-11` for walltime
    /// (`JOB_EXEC_OVERLIMIT_WT`), `-1` for a job that could not start
    /// (`JOB_EXEC_FAIL1`); a job cancelled while running shows `271`
    /// (`256 + SIGTERM`, what Torque shows after `qdel`); a job stopped at
    /// the output limit (Torque has no such limit; the agent kills it)
    /// shows `265` (`256 + SIGKILL`). Negative codes are used only with
    /// Torque's meanings (`src/include/job.h`, `JOB_EXEC_*`).
    pub fn exit_status(&self) -> i32 {
        const SIGTERM: i32 = 15;
        const SIGKILL: i32 = 9;
        match self {
            Outcome::Exited { code } => *code,
            Outcome::Signaled { signal } => 256 + signal,
            Outcome::Walltime => -11,
            Outcome::Cancelled => 256 + SIGTERM,
            Outcome::OutputLimit => 256 + SIGKILL,
            Outcome::FailedToStart { .. } => -1,
        }
    }
}

/// What happened to a job; the body of a [`JobEvent`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum JobState {
    /// The job was submitted: its message is in the pool queue (published
    /// by whoever submitted it, `vq submit` or a bridge, after the job's
    /// publisher confirm, on the submissions exchange `<c>.submitted`,
    /// never with the script or the environment). It may arrive after the
    /// job's `started`: readers never let it move a job back.
    Queued {
        /// What the job asks for.
        request: JobRequest,
    },
    /// The job was submitted with dependencies ([`Job::depend`]): its
    /// message is in the held queue `<c>.held`, not in a pool queue, until
    /// the controller releases it (then publishes its [`JobState::Queued`],
    /// which moves it from `H` to `Q`) or cancels it
    /// ([`JobState::Withdrawn`] with a reason). Published by the submitter
    /// as `queued` is, on the submissions exchange.
    Held {
        /// What the job asks for, its dependencies included.
        request: JobRequest,
    },
    /// The agent took the job and started it.
    Started,
    /// The job ran and ended; see `outcome`.
    Finished {
        /// Why it ended.
        outcome: Outcome,
        /// Resource usage.
        usage: Usage,
    },
    /// The job could not run (rejected by validation, or node lost) and was
    /// dead-lettered or dropped from its lease; `reason` says why.
    Failed {
        /// Human-readable reason, e.g. `owner "root" has uid 0 below min_uid 1000`.
        reason: String,
    },
    /// The job was cancelled while queued (Torque's `qdel` of a queued
    /// job), before any agent claimed it: published by the controller once
    /// it holds the job's claim marker ([`crate::jobs::cancel`]), so no
    /// agent runs it; it has no exit status. Routed as `cancelled`; a
    /// reader ignores it for a job that started already.
    Withdrawn {
        /// The broker user that cancelled it.
        by: String,
        /// Why, when it is not a user's `vq cancel`: e.g. `dependency
        /// afterok:123 can never be satisfied: 123 exited 1` (a held job
        /// cancelled by the controller). Absent for a user's cancel.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

impl JobState {
    /// The last part of the routing key: `queued`, `held`, `started`,
    /// `finished` or `failed`;
    /// a finished job whose outcome is `cancelled` is `cancelled`.
    pub fn routing_word(&self) -> &'static str {
        match self {
            JobState::Queued { .. } => "queued",
            JobState::Held { .. } => "held",
            JobState::Started => "started",
            JobState::Finished {
                outcome: Outcome::Cancelled,
                ..
            } => "cancelled",
            JobState::Finished { .. } => "finished",
            JobState::Failed { .. } => "failed",
            JobState::Withdrawn { .. } => "cancelled",
        }
    }
}

/// What a queued job asks for: the fields of its [`Job`] that `vq stat -f`
/// shows, without the script and the environment (which may hold
/// secrets and do not belong in the retained event stream).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct JobRequest {
    /// [`Job::group`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// [`Job::shell`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// [`Job::workdir`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// [`Job::stdout`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    /// [`Job::stderr`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    /// [`Job::join`].
    #[serde(default)]
    pub join: Join,
    /// [`Job::walltime`], seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub walltime: Option<u64>,
    /// [`Job::slots`]: 1 when absent.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub slots: u32,
    /// [`Job::mem`], bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// [`Job::rerunnable`].
    #[serde(default)]
    pub rerunnable: bool,
    /// [`Job::submit_host`].
    #[serde(default)]
    pub submit_host: String,
    /// [`Job::submitted_at`], Unix seconds.
    #[serde(default)]
    pub submitted_at: u64,
    /// [`Job::depend`]: empty (and absent) when the job waits for nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depend: Vec<Dependency>,
}

impl Default for JobRequest {
    /// Nothing given: 1 slot, no memory limit, not rerunnable.
    fn default() -> Self {
        JobRequest {
            group: None,
            shell: None,
            workdir: None,
            stdout: None,
            stderr: None,
            join: Join::default(),
            walltime: None,
            slots: 1,
            mem: None,
            rerunnable: false,
            submit_host: String::new(),
            submitted_at: 0,
            depend: Vec::new(),
        }
    }
}

impl JobRequest {
    /// The request of `job`.
    pub fn of(job: &Job) -> JobRequest {
        JobRequest {
            group: job.group.clone(),
            shell: job.shell.clone(),
            workdir: job.workdir.clone(),
            stdout: job.stdout.clone(),
            stderr: job.stderr.clone(),
            join: job.join,
            walltime: job.walltime,
            slots: job.slots,
            mem: job.mem,
            rerunnable: job.rerunnable,
            submit_host: job.submit_host.clone(),
            submitted_at: job.submitted_at,
            depend: job.depend.clone(),
        }
    }
}

/// A job event, published on the events exchange with routing key
/// `job.<pool>.<started|finished|failed|cancelled>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobEvent {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Job id.
    pub job_id: String,
    /// Job name.
    #[serde(default)]
    pub job_name: String,
    /// Job owner.
    #[serde(default)]
    pub owner: String,
    /// Pool.
    pub pool: String,
    /// Agent that reports (PBS `mom_exec_host`); empty if no agent.
    #[serde(default)]
    pub agent: String,
    /// Broker user the job was judged by (the broker-validated `user_id` of
    /// the job message, or the original submitter of a requeued job), so
    /// that clients match events to their own submission and not to
    /// another user's message that reuses the id. `None` if unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitter: Option<String>,
    /// When the event happened, Unix seconds (sender's clock; informative).
    pub at: f64,
    /// Which execution of the job this is about: 1 for the first, 1 + the
    /// job's losses to lost nodes for a rerun (`x-vq-losses`). Part of the
    /// `started` event's [`JobEvent::message_id`], so that a rerun's start
    /// is not taken for a retransmission of the first.
    #[serde(default = "first_attempt", skip_serializing_if = "is_first_attempt")]
    pub attempt: u32,
    /// Set when this event is about a *second message* that reused the id
    /// of a job another agent had claimed already (a duplicate submission,
    /// or a redelivered copy of a claimed job): that message was
    /// dead-lettered and this event tells its submitter; it says nothing
    /// about the claimed job, which reports on its own. The value is the
    /// message's [`fingerprint`] in 16 hex digits (part of the
    /// [`JobEvent::message_id`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicate: Option<String>,
    /// The submission this event is about: the [`fingerprint`] of the job
    /// message's body, the same in every copy of one submission (lease
    /// copy, requeue, dead letter). A job id names one job from its
    /// submission to its final result; once that job has ended, the id may
    /// be submitted again (as Torque's ids wrap), which is a new job with
    /// another `submission`. Consumers key jobs by `(job_id, submission)`;
    /// part of the [`JobEvent::message_id`], so that deduplicating on it
    /// never drops the result of a later submission. `None` when the body
    /// is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission: Option<String>,
    /// What happened.
    #[serde(flatten)]
    pub state: JobState,
}

fn first_attempt() -> u32 {
    1
}

fn is_first_attempt(n: &u32) -> bool {
    *n == 1
}

impl JobEvent {
    /// An event about `job` (or, when its body could not be decoded, about
    /// the message with id `job_id`), reported by `agent` for `pool`, as
    /// the first attempt and not a duplicate.
    pub fn about(
        job: Option<&Job>,
        job_id: &str,
        pool: &str,
        agent: &str,
        submitter: Option<&str>,
        state: JobState,
    ) -> JobEvent {
        JobEvent {
            schema: SCHEMA_VERSION,
            job_id: job.map_or_else(|| job_id.to_string(), |j| j.id.clone()),
            job_name: job.map(|j| j.name.clone()).unwrap_or_default(),
            owner: job.map(|j| j.owner.clone()).unwrap_or_default(),
            pool: pool.into(),
            agent: agent.into(),
            submitter: submitter.map(str::to_string),
            at: unix_now(),
            attempt: 1,
            duplicate: None,
            submission: None,
            state,
        }
    }

    /// The `queued` event of `job`, whose message body is `body`, submitted
    /// by broker user `submitter` (the `user_id` the job was published
    /// with).
    pub fn queued(job: &Job, body: &[u8], submitter: &str) -> JobEvent {
        let mut e = JobEvent::about(
            Some(job),
            &job.id,
            &job.pool,
            "",
            Some(submitter),
            JobState::Queued {
                request: JobRequest::of(job),
            },
        )
        .of_submission(body);
        e.at = job.submitted_at as f64;
        e
    }

    /// The `held` event of `job` (a job with [`Job::depend`]), whose message
    /// body is `body`, submitted by broker user `submitter`: as
    /// [`JobEvent::queued`], for a job published to the held queue.
    pub fn held(job: &Job, body: &[u8], submitter: &str) -> JobEvent {
        let mut e = JobEvent::queued(job, body, submitter);
        e.state = JobState::Held {
            request: JobRequest::of(job),
        };
        e
    }

    /// Decodes a job event as the broker delivered it: with routing key
    /// `routing_key` and the broker-validated AMQP `user_id` of its
    /// publisher. The routing key must say what the body says
    /// (`job.<pool>.<word>`, see [`DecodeError::Misrouted`]): submitters
    /// can only route `job.*.queued` into the events exchange
    /// ([`crate::topology::SUBMITTED_BINDING`]), so a body claiming another
    /// state on such a key is refused. A `queued` event's
    /// [`JobEvent::submitter`] is its publisher's `user_id`, never what its
    /// body claims (`None` without one).
    ///
    /// # Errors
    /// [`DecodeError`].
    pub fn decode_delivered(
        body: &[u8],
        routing_key: &str,
        user_id: Option<&str>,
    ) -> Result<JobEvent, DecodeError> {
        let mut ev = JobEvent::decode(body)?;
        let says = crate::topology::job_event_key(&ev.pool, ev.state.routing_word());
        if says != routing_key {
            return Err(DecodeError::Misrouted {
                routing_key: routing_key.into(),
                says,
            });
        }
        if matches!(ev.state, JobState::Queued { .. } | JobState::Held { .. }) {
            ev.submitter = user_id.map(str::to_string);
        }
        Ok(ev)
    }

    /// This event, naming the submission whose job message has `body`
    /// ([`JobEvent::submission`]).
    #[must_use]
    pub fn of_submission(mut self, body: &[u8]) -> JobEvent {
        self.submission = Some(fingerprint(body));
        self
    }

    /// The event's stable AMQP `message_id`, the same for every
    /// retransmission of one state change, so consumers deduplicate on it
    /// (an unknown publish outcome is resolved by publishing again):
    ///
    /// * `<job_id>.<submission>.queued`, `<job_id>.<submission>.held`;
    /// * `<job_id>.<submission>.started.<attempt>`;
    /// * `<job_id>.<submission>.finished`, `….cancelled`, `….failed`: the
    ///   job's one final result;
    /// * `<job_id>.<submission>.withdrawn` for [`JobState::Withdrawn`];
    /// * `<job_id>.duplicate.<fingerprint>` for a [`JobEvent::duplicate`]
    ///   report;
    /// * without a [`JobEvent::submission`] (body unknown), the same
    ///   without `.<submission>`.
    pub fn message_id(&self) -> String {
        let word = match self.state {
            // Routed as `cancelled`, but not the running job's final result.
            JobState::Withdrawn { .. } => "withdrawn",
            _ => self.state.routing_word(),
        };
        let job = match &self.submission {
            Some(sub) => format!("{}.{sub}", self.job_id),
            None => self.job_id.clone(),
        };
        match (&self.duplicate, &self.state) {
            (Some(fp), _) => format!("{}.duplicate.{fp}", self.job_id),
            (None, JobState::Started) => format!("{job}.{word}.{}", self.attempt),
            (None, _) => format!("{job}.{word}"),
        }
    }
}

/// A 64-bit FNV-1a fingerprint of `bytes` in 16 hex digits: stable across
/// processes and versions (names a duplicate message in
/// [`JobEvent::duplicate`]).
pub fn fingerprint(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// State of an agent, as reported in its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentState {
    /// Pulling, no job running.
    Idle,
    /// Pulling or not, at least one job running.
    Busy,
    /// Not pulling, finishing running jobs.
    Draining,
    /// Not pulling, no job: may be deleted.
    Drained,
}

/// An agent heartbeat, published every `heartbeat_secs` on the events
/// exchange with routing key `agent.<pool>.heartbeat` (the seed's
/// `last_heartbeat`, `isPull`, `isDel`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Heartbeat {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Agent id (equals the server name the controller gave the VM).
    pub agent: String,
    /// Pool the agent serves.
    pub pool: String,
    /// Host name of the VM.
    #[serde(default)]
    pub host: String,
    /// Overall state.
    pub state: AgentState,
    /// Job slots (`basic.qos` prefetch when idle).
    pub slots: u32,
    /// Ids of jobs running now.
    #[serde(default)]
    pub running: Vec<String>,
    /// Whether the agent is consuming its pool queue (seed `isPull`).
    pub is_pull: bool,
    /// Whether the agent agreed to be deleted (seed `isDel`): it stopped
    /// pulling and holds no job.
    pub is_del: bool,
    /// Seconds since the later of the agent's last job's end and its start
    /// of pulling (its first consumer, or its last resume), measured by the
    /// agent's monotonic clock; 0 while a job is claimed.
    pub idle_secs: f64,
    /// Seconds between heartbeats.
    pub interval_secs: f64,
    /// Sender's wall-clock time, Unix seconds (informative only: receivers
    /// judge liveness by their own monotonic receive time).
    pub at: f64,
    /// Agent software version.
    #[serde(default)]
    pub version: String,
    /// The `--reason` of the drain the agent follows, while it is not
    /// pulling because of one (absent otherwise, and from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_reason: Option<String>,
}

/// Demand for a pool, published by bridges on the demand exchange
/// (routing key = pool).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Demand {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Pool.
    pub pool: String,
    /// Jobs waiting for a slot (held by the bridge, not yet in the pool queue).
    pub queued: u64,
    /// Jobs running.
    pub running: u64,
    /// When measured, Unix seconds.
    pub at: f64,
    /// Who measured, e.g. `torque-bridge@ce01`.
    pub source: String,
}

/// Longest accepted `--reason` of a drain or resume, in bytes (the agent
/// cuts longer ones at a character boundary).
pub const MAX_REASON_BYTES: usize = 256;

/// A control message to one agent, published on the control exchange with
/// routing key = agent id.
///
/// A sender that wants an answer sets the AMQP `reply_to` (its exclusive
/// `amq.gen-…` reply queue, bound on `<c>.replies`) and `correlation_id`;
/// the agent then answers drain, resume and cancel with a
/// [`ControlAnswer`] (ask-delete keeps its [`DeleteAnswer`]). Without
/// `reply_to` (older senders, the controller's drains) nothing is answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Control {
    /// "May I delete you?" An idle agent stops pulling and answers yes; a busy
    /// one answers no and keeps pulling.
    AskDelete {
        /// Correlates the [`DeleteAnswer`].
        request_id: String,
    },
    /// Stop pulling, finish running jobs, then report `drained`.
    Drain {
        /// Correlation id (the `correlation_id` of the request, when the
        /// sender asked for an answer).
        request_id: String,
        /// Why (operator text, at most [`MAX_REASON_BYTES`]): logged by the
        /// agent and carried in its heartbeats
        /// ([`Heartbeat::drain_reason`]) while it drains.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Undo a drain: a draining agent that has not yet agreed to be
    /// deleted (not `is_del`) pulls jobs again. Refused after it agreed to
    /// be deleted or while it shuts down.
    Resume {
        /// Correlation id, as for [`Control::Drain`].
        request_id: String,
        /// Why (operator text, at most [`MAX_REASON_BYTES`]): logged.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Cancel a running job (SIGTERM, then SIGKILL after the grace period).
    Cancel {
        /// Job id.
        job_id: String,
    },
}

/// What a [`ControlAnswer`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ControlRequest {
    /// [`Control::Drain`].
    Drain,
    /// [`Control::Resume`].
    Resume,
    /// [`Control::Cancel`].
    Cancel,
}

/// What the agent did with a control request ([`ControlAnswer::outcome`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ControlOutcome {
    /// Done now: the drain started, the agent pulls again, the job was
    /// told to stop.
    Done,
    /// Nothing to do: already draining (or drained), or not draining (a
    /// resume of a pulling agent).
    Already,
    /// Not done, for `reason` (e.g. the sender is not in
    /// `control_admins`, does not own the job, or the agent already agreed
    /// to be deleted).
    Refused {
        /// Why, for the operator.
        reason: String,
    },
    /// A cancel of a job that is not running on this agent.
    NotHere,
}

/// An agent's answer to a [`Control`] request that had a `reply_to`:
/// published on `<c>.replies` with routing key = the request's `reply_to`
/// and the same `correlation_id`, with a publisher confirm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ControlAnswer {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// The request's correlation id (`request_id` of a drain or resume;
    /// the AMQP `correlation_id` of a cancel).
    pub request_id: String,
    /// Agent id.
    pub agent: String,
    /// Pool the agent serves.
    pub pool: String,
    /// What was asked.
    pub request: ControlRequest,
    /// The job of a cancel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    /// What the agent did.
    pub outcome: ControlOutcome,
    /// The agent's state after the request.
    pub state: AgentState,
    /// Jobs claimed on the agent after the request.
    #[serde(default)]
    pub running: Vec<String>,
    /// When answered, Unix seconds (sender's wall clock).
    pub at: f64,
}

/// Answer to [`Control::AskDelete`], published on the events exchange with
/// routing key `agent.<pool>.answer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeleteAnswer {
    /// Schema version ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Agent id.
    pub agent: String,
    /// Pool.
    pub pool: String,
    /// The request this answers.
    pub request_id: String,
    /// `true`: the agent stopped pulling and holds no job (seed `isDel`).
    pub may_delete: bool,
    /// Jobs running when asked (non-empty exactly when `may_delete` is false
    /// because of work).
    #[serde(default)]
    pub running: Vec<String>,
    /// When answered, Unix seconds.
    pub at: f64,
}

/// Current Unix time in seconds (wall clock), for the informative `at`
/// fields.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Error decoding a message body.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// A job event whose routing key does not say what its body says
    /// (`job.<pool>.<word>` with the body's pool and
    /// [`JobState::routing_word`]): dropped, since a routing key is what
    /// the broker's permissions and bindings check and the body is not
    /// ([`JobEvent::decode_delivered`]).
    #[error("job event routed as {routing_key:?} says {says:?}")]
    Misrouted {
        /// The delivery's routing key.
        routing_key: String,
        /// `job.<pool>.<word>` of the body.
        says: String,
    },
    /// The body is not valid JSON for the type.
    #[error("malformed {kind} message")]
    Malformed {
        /// Which message type.
        kind: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The body declares a schema version this build does not know.
    #[error(
        "{kind} message has schema version {found}, this build understands up to {SCHEMA_VERSION}"
    )]
    UnknownVersion {
        /// Which message type.
        kind: &'static str,
        /// The version found.
        found: u32,
    },
    /// The job message is larger than [`MAX_JOB_MESSAGE_BYTES`].
    #[error("{kind} message is {size} bytes, larger than the limit of {limit} bytes")]
    TooLarge {
        /// Which message type.
        kind: &'static str,
        /// Body size, bytes.
        size: usize,
        /// Limit, bytes.
        limit: usize,
    },
}

/// A message type with a schema version.
pub trait Message: Serialize + for<'de> Deserialize<'de> {
    /// Name used in errors and schema file names, e.g. `job`.
    const KIND: &'static str;
    /// The body's schema version.
    fn schema(&self) -> u32;

    /// Decodes a body, checking size (jobs) and schema version.
    fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        if body.len() > MAX_JOB_MESSAGE_BYTES {
            return Err(DecodeError::TooLarge {
                kind: Self::KIND,
                size: body.len(),
                limit: MAX_JOB_MESSAGE_BYTES,
            });
        }
        let msg: Self = serde_json::from_slice(body).map_err(|source| DecodeError::Malformed {
            kind: Self::KIND,
            source,
        })?;
        if msg.schema() > SCHEMA_VERSION {
            return Err(DecodeError::UnknownVersion {
                kind: Self::KIND,
                found: msg.schema(),
            });
        }
        Ok(msg)
    }

    /// Encodes the body as JSON.
    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("message types serialize infallibly")
    }
}

macro_rules! message {
    ($t:ty, $kind:literal) => {
        impl Message for $t {
            const KIND: &'static str = $kind;
            fn schema(&self) -> u32 {
                self.schema
            }
        }
    };
}

message!(Job, "job");
message!(JobEvent, "job-event");
message!(Heartbeat, "heartbeat");
message!(Demand, "demand");
message!(DeleteAnswer, "delete-answer");
message!(ControlAnswer, "control-answer");

impl Message for Control {
    const KIND: &'static str = "control";
    fn schema(&self) -> u32 {
        SCHEMA_VERSION
    }
}

/// JSON Schemas of every message, as `(file name, pretty JSON)`, for
/// `schemas/` (bridges in other languages are written from these).
pub fn json_schemas() -> Vec<(&'static str, String)> {
    fn one<T: JsonSchema>(name: &'static str) -> (&'static str, String) {
        let schema = schemars::schema_for!(T);
        (
            name,
            serde_json::to_string_pretty(&schema).expect("schema serializes") + "\n",
        )
    }
    vec![
        one::<Job>("job.schema.json"),
        one::<JobEvent>("job-event.schema.json"),
        one::<Heartbeat>("heartbeat.schema.json"),
        one::<Demand>("demand.schema.json"),
        one::<Control>("control.schema.json"),
        one::<DeleteAnswer>("delete-answer.schema.json"),
        one::<ControlAnswer>("control-answer.schema.json"),
        one::<crate::jobs::JobQuery>("job-query.schema.json"),
        one::<crate::jobs::JobPage>("job-page.schema.json"),
        one::<crate::jobs::cancel::CancelRequest>("cancel-request.schema.json"),
        one::<crate::jobs::cancel::CancelAnswer>("cancel-answer.schema.json"),
        one::<crate::pools::PoolQuery>("pool-query.schema.json"),
        one::<crate::pools::PoolsPage>("pools-page.schema.json"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_output_names_follow_pbs() {
        let job: Job = serde_json::from_str(
            r#"{"id":"42a-b","name":"sim","owner":"u","pool":"p","script":"true"}"#,
        )
        .unwrap();
        assert_eq!(job.default_stdout("/home/u/"), "/home/u/sim.o42a");
        assert_eq!(job.default_stderr("/w"), "/w/sim.e42a");
        assert!(job.rerunnable, "PBS default is -r y");
        assert_eq!(job.schema, SCHEMA_VERSION);
    }

    #[test]
    fn unknown_schema_version_is_refused() {
        let err =
            Job::decode(br#"{"schema":99,"id":"1","name":"n","owner":"u","pool":"p","script":""}"#)
                .unwrap_err();
        assert!(matches!(err, DecodeError::UnknownVersion { found: 99, .. }));
    }

    #[test]
    fn unknown_fields_are_accepted() {
        let job =
            Job::decode(br#"{"id":"1","name":"n","owner":"u","pool":"p","script":"","future":1}"#)
                .unwrap();
        assert_eq!(job.id, "1");
    }

    #[test]
    fn cancelled_outcome_routes_as_cancelled() {
        let s = JobState::Finished {
            outcome: Outcome::Cancelled,
            usage: Usage::default(),
        };
        assert_eq!(s.routing_word(), "cancelled");
        assert_eq!(Outcome::Signaled { signal: 9 }.exit_status(), 265);
        // Torque's codes: qdel of a running job 271, walltime -11 (not
        // -12, which is Torque's CPU-time limit).
        assert_eq!(Outcome::Cancelled.exit_status(), 271);
        assert_eq!(Outcome::Walltime.exit_status(), -11);
        assert_eq!(Outcome::OutputLimit.exit_status(), 265);
        assert_eq!(
            Outcome::FailedToStart { reason: "x".into() }.exit_status(),
            -1
        );
    }
}
