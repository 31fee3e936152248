//! The jobagent's configuration (`/etc/vq/jobagent.toml`), the VM's
//! identity file and the submitter rules.

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::BrokerConfig;
use crate::topology::{valid_name, DEFAULT_CLUSTER};

/// Which submitters may run jobs as which owners (checked by the agent
/// against the broker-validated AMQP `user_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SubmitterRules {
    /// Broker users that may submit jobs for any (non-root, allowed) owner:
    /// bridges such as a Torque or HTCondor front end.
    pub trusted: Vec<String>,
    /// Whether a broker user may submit jobs for the Unix user of the same
    /// name (the `vq submit` case).
    pub same_name: bool,
    /// Extra grants: broker user → owners it may submit for.
    pub grants: BTreeMap<String, Vec<String>>,
    /// Broker users that return jobs of lost nodes to their pool (the
    /// controller's account, which fences dead agents). A job they publish is
    /// judged by the original submitter named in its
    /// [`crate::messages::SUBMITTER_HEADER`] header, never by the requeuer's
    /// own rights; one without that header is refused.
    pub requeuers: Vec<String>,
}

impl Default for SubmitterRules {
    fn default() -> Self {
        SubmitterRules {
            trusted: Vec::new(),
            same_name: true,
            grants: BTreeMap::new(),
            requeuers: Vec::new(),
        }
    }
}

impl SubmitterRules {
    /// The submitter a job is judged by: the broker-validated `user_id`, or,
    /// when that is a [`SubmitterRules::requeuers`] account, the original
    /// submitter it carries in `submitter_header`. `None` if there is no
    /// `user_id`, or a requeuer's job lacks the header.
    pub fn effective_submitter<'a>(
        &self,
        user_id: Option<&'a str>,
        submitter_header: Option<&'a str>,
    ) -> Option<&'a str> {
        let user = user_id?;
        if self.requeuers.iter().any(|r| r == user) {
            submitter_header
        } else {
            Some(user)
        }
    }

    /// Whether `submitter` (a broker user) may submit a job that runs as
    /// `owner`.
    pub fn allows(&self, submitter: &str, owner: &str) -> bool {
        (self.same_name && submitter == owner)
            || self.trusted.iter().any(|t| t == submitter)
            || self
                .grants
                .get(submitter)
                .is_some_and(|owners| owners.iter().any(|o| o == owner))
    }
}

/// Jobagent configuration (`/etc/vq/jobagent.toml`). Pool, agent id and
/// broker URL usually come from the VM's identity file written by cloud-init
/// from the user-data ([`AgentIdentity`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Cluster name (prefix of every AMQP name).
    pub cluster: String,
    /// Pool whose queue the agent consumes.
    pub pool: String,
    /// Agent id; empty means the host name.
    pub agent_id: String,
    /// Broker connection.
    pub broker: BrokerConfig,
    /// Jobs run at once (`basic.qos` prefetch = free slots).
    pub slots: u32,
    /// Lowest uid a job may run as (root is refused whatever this says).
    pub min_uid: u32,
    /// Owners that may never run jobs here (in addition to root).
    pub deny_owners: Vec<String>,
    /// If non-empty, only these owners may run jobs here.
    pub allow_owners: Vec<String>,
    /// Which submitters may submit for which owners.
    pub submitters: SubmitterRules,
    /// Seconds between heartbeats.
    pub heartbeat_secs: f64,
    /// Walltime of a job that gives none, seconds.
    pub default_walltime_secs: u64,
    /// Largest walltime a job may ask for, seconds (a job asking more is
    /// refused, as a PBS queue's `resources_max.walltime` does).
    pub max_walltime_secs: u64,
    /// Losses of a job to lost nodes (an agent restart on this VM counts)
    /// after which it is dead-lettered instead of run again
    /// ([`crate::lease::fate`]); the controller's `loss_limit`, which the
    /// identity file it writes carries, wins over this.
    pub loss_limit: u32,
    /// Broker users whose control messages (drain, ask-delete, cancel of any
    /// job) this agent obeys: the controller's account and operators. Anyone
    /// else may only cancel jobs they own or submitted.
    pub control_admins: Vec<String>,
    /// Seconds between SIGTERM and SIGKILL when a job is stopped.
    pub kill_grace_secs: u64,
    /// Umask of a job that gives none; write it as a TOML octal integer,
    /// e.g. `0o022`.
    pub default_umask: u32,
    /// `PATH` given to jobs.
    pub job_path: String,
    /// Directory for the agent's own state (root-only).
    pub state_dir: PathBuf,
    /// Directory of the jobs' `PBS_NODEFILE`s (one file per running job,
    /// `<nodefile_dir>/<job id>`, N lines of the host name): created by the
    /// agent, owned by root, mode 0711 (jobs open their file by name, list
    /// and create nothing). Its parents must let job owners through, so it
    /// is not under `state_dir` (0700). Absolute; default
    /// `/run/vq-jobagent/nodefiles`.
    pub nodefile_dir: PathBuf,
    /// Largest job script accepted, bytes.
    pub max_script_bytes: usize,
    /// Groups whose members may never run jobs here (by name; checked
    /// against the owner's full NSS group list and the job's group).
    pub deny_groups: Vec<String>,
    /// If non-empty, the owner must be a member of at least one of these
    /// groups (by name).
    pub allow_groups: Vec<String>,
    /// Whether a job may run with group 0 (`root`) as its primary or a
    /// supplementary group. When `false` (the default) an owner whose group
    /// list contains gid 0 is refused.
    pub allow_group_zero: bool,
    /// Cap on the size of each of a job's stdout/stderr files, bytes; a job
    /// whose output grows past it is stopped with outcome `output-limit`.
    /// The agent copies the job's output pipes into the files and never
    /// writes past the cap (no slack: a file holds at most this many bytes,
    /// the first ones). 0 disables the cap.
    pub max_output_bytes: u64,
    /// Whether to put every job into its own cgroup v2 (under the agent's
    /// own cgroup, e.g. a systemd unit with `Delegate=yes`) when the cgroup
    /// v2 hierarchy is writable. Without it, jobs are tracked by process
    /// group, session and the agent's child-subreaper role.
    pub cgroups: bool,
    /// `memory.max` of each job's cgroup, bytes; 0 means no limit. When set
    /// and the memory controller cannot be used, jobs fail to start.
    pub job_memory_max_bytes: u64,
    /// CPU limit of each job's cgroup (`cpu.max`), in CPUs (e.g. 2.0);
    /// 0 means no limit. When set and the cpu controller cannot be used,
    /// jobs fail to start.
    pub job_cpu_max: f64,
    /// Most processes (and threads) a job may have at once, so a fork bomb
    /// stops there and the VM keeps pids for the agent. Enforced with
    /// `pids.max` of the job's cgroup where the pids controller can be
    /// enabled, else with `RLIMIT_NPROC` for the owner, which the kernel
    /// counts over **all** processes of the owner's uid on the host (other
    /// jobs and logins of the same owner included). Range
    /// 1..=[`MAX_JOB_PIDS`]; default 4096.
    pub job_pids_max: u64,
    /// Address (`IP:port`) on which the agent serves its `/metrics`
    /// (OpenMetrics text: slots, jobs running, jobs by outcome, broker
    /// connected, heartbeats, output bytes), e.g. `127.0.0.1:9101`; empty
    /// (the default) serves nothing.
    pub metrics_listen: String,
}

/// Default `max_walltime_secs` of an agent and of a controller's pool:
/// 31 days.
pub const DEFAULT_MAX_WALLTIME_SECS: u64 = 31 * 24 * 3600;

/// Largest `max_walltime_secs` an agent or a pool may have: 10 years.
pub const MAX_WALLTIME_LIMIT_SECS: u64 = 10 * 366 * 24 * 3600;

/// Largest `job_pids_max`: the kernel's `PID_MAX_LIMIT` on 64-bit Linux.
pub const MAX_JOB_PIDS: u64 = 4_194_304;

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            cluster: DEFAULT_CLUSTER.into(),
            pool: String::new(),
            agent_id: String::new(),
            broker: BrokerConfig::default(),
            slots: 1,
            min_uid: 1000,
            deny_owners: Vec::new(),
            allow_owners: Vec::new(),
            submitters: SubmitterRules::default(),
            heartbeat_secs: 10.0,
            default_walltime_secs: 24 * 3600,
            max_walltime_secs: DEFAULT_MAX_WALLTIME_SECS,
            loss_limit: crate::topology::DEFAULT_LOSS_LIMIT,
            control_admins: vec!["vq-controller".into()],
            kill_grace_secs: 10,
            default_umask: 0o022,
            job_path: "/usr/local/bin:/usr/bin:/bin".into(),
            state_dir: PathBuf::from("/var/lib/vq"),
            nodefile_dir: PathBuf::from("/run/vq-jobagent/nodefiles"),
            max_script_bytes: crate::messages::MAX_SCRIPT_BYTES,
            deny_groups: Vec::new(),
            allow_groups: Vec::new(),
            allow_group_zero: false,
            max_output_bytes: 10 * 1024 * 1024 * 1024,
            cgroups: true,
            job_memory_max_bytes: 0,
            job_cpu_max: 0.0,
            job_pids_max: 4096,
            metrics_listen: String::new(),
        }
    }
}

impl AgentConfig {
    /// Lists every problem with the values.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut p = Vec::new();
        if !valid_name(&self.cluster) {
            p.push(format!(
                "cluster: {:?} is not a valid name (1-64 of a-z A-Z 0-9 _ -)",
                self.cluster
            ));
        }
        if self.pool.is_empty() {
            p.push("pool: missing (set it in the config or the identity file)".into());
        } else if !valid_name(&self.pool) {
            p.push(format!(
                "pool: {:?} is not a valid name (1-64 of a-z A-Z 0-9 _ -)",
                self.pool
            ));
        }
        if !self.agent_id.is_empty() && !valid_name(&self.agent_id) {
            p.push(format!(
                "agent_id: {:?} is not a valid name (1-64 of a-z A-Z 0-9 _ -)",
                self.agent_id
            ));
        }
        self.broker.problems("broker", &mut p);
        if self.slots == 0 || self.slots > 1024 {
            p.push(format!("slots: {} is out of range 1..=1024", self.slots));
        }
        if self.min_uid == 0 {
            p.push("min_uid: 0 would allow jobs as root; use 1 or more".into());
        }
        if self.loss_limit == 0 {
            p.push("loss_limit: must be at least 1".into());
        }
        if !(self.heartbeat_secs.is_finite()
            && self.heartbeat_secs >= 0.1
            && self.heartbeat_secs <= 3600.0)
        {
            p.push(format!(
                "heartbeat_secs: {} is out of range 0.1..=3600",
                self.heartbeat_secs
            ));
        }
        if self.default_walltime_secs == 0 {
            p.push("default_walltime_secs: must be at least 1".into());
        }
        if self.max_walltime_secs == 0 || self.max_walltime_secs > MAX_WALLTIME_LIMIT_SECS {
            p.push(format!(
                "max_walltime_secs: {} is out of range 1..={MAX_WALLTIME_LIMIT_SECS} (10 years)",
                self.max_walltime_secs
            ));
        } else if self.default_walltime_secs > self.max_walltime_secs {
            p.push(format!(
                "default_walltime_secs: {} is greater than max_walltime_secs {}",
                self.default_walltime_secs, self.max_walltime_secs
            ));
        }
        if self.default_umask > 0o777 {
            p.push(format!(
                "default_umask: {:o} is not a umask (0..=0o777)",
                self.default_umask
            ));
        }
        if !self.state_dir.is_absolute() {
            p.push(format!(
                "state_dir: {} is not absolute",
                self.state_dir.display()
            ));
        }
        if !self.nodefile_dir.is_absolute() {
            p.push(format!(
                "nodefile_dir: {} is not absolute",
                self.nodefile_dir.display()
            ));
        }
        if self.job_path.is_empty() {
            p.push("job_path: empty".into());
        }
        if !(self.job_cpu_max.is_finite() && self.job_cpu_max >= 0.0 && self.job_cpu_max <= 4096.0)
        {
            p.push(format!(
                "job_cpu_max: {} is out of range 0..=4096 (0 = no limit)",
                self.job_cpu_max
            ));
        }
        if self.job_memory_max_bytes != 0 && self.job_memory_max_bytes < 4096 {
            p.push(format!(
                "job_memory_max_bytes: {} is below one page (0 = no limit)",
                self.job_memory_max_bytes
            ));
        }
        if !(1..=MAX_JOB_PIDS).contains(&self.job_pids_max) {
            p.push(format!(
                "job_pids_max: {} is out of range 1..={MAX_JOB_PIDS}",
                self.job_pids_max
            ));
        }
        if !self.metrics_listen.is_empty()
            && self.metrics_listen.parse::<std::net::SocketAddr>().is_err()
        {
            p.push(format!(
                "metrics_listen: {:?} is not an address like 127.0.0.1:9101 (empty = off)",
                self.metrics_listen
            ));
        }
        if (self.job_memory_max_bytes != 0 || self.job_cpu_max != 0.0) && !self.cgroups {
            p.push("job_memory_max_bytes/job_cpu_max need cgroups = true".into());
        }
        for (key, list) in [
            ("deny_groups", &self.deny_groups),
            ("allow_groups", &self.allow_groups),
            ("deny_owners", &self.deny_owners),
            ("allow_owners", &self.allow_owners),
        ] {
            if let Some(bad) = list
                .iter()
                .find(|n| n.is_empty() || n.contains(['/', ':', '\0']))
            {
                p.push(format!("{key}: {bad:?} is not a user or group name"));
            }
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(p)
        }
    }
}

/// What a VM learns about itself at boot (from the user-data's
/// `/etc/vq/identity.toml`, written by cloud-init with mode 0600).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentIdentity {
    /// Cluster name, if not the config's.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Pool of this VM.
    pub pool: String,
    /// Agent id (the server name).
    pub agent_id: String,
    /// Broker URL with the agent's credentials, if not the config's.
    #[serde(default)]
    pub broker_url: Option<String>,
    /// The controller's `loss_limit`, so that agent and controller decide a
    /// lost job's fate alike; `None`: the config's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_limit: Option<u32>,
    /// The pool's `slots` (the controller plans VMs of this many slots):
    /// wins over the config's `slots`; `None`: the config's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    /// The pool's `max_walltime_secs` (what `vq submit` checks against):
    /// wins over the config's, and caps its `default_walltime_secs`;
    /// `None`: the config's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_walltime_secs: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_pids_max_defaults_to_4096_and_must_be_in_range() {
        let mut c = AgentConfig {
            pool: "p".into(),
            agent_id: "a".into(),
            ..AgentConfig::default()
        };
        assert_eq!(c.job_pids_max, 4096);
        for (v, ok) in [
            (0, false),
            (1, true),
            (MAX_JOB_PIDS, true),
            (MAX_JOB_PIDS + 1, false),
        ] {
            c.job_pids_max = v;
            let problems = c.validate().err().unwrap_or_default();
            assert_eq!(
                !problems.iter().any(|p| p.starts_with("job_pids_max")),
                ok,
                "{v}: {problems:?}"
            );
        }
    }

    #[test]
    fn metrics_listen_is_off_by_default_and_a_bad_address_is_a_key_problem() {
        let mut c = AgentConfig {
            pool: "p".into(),
            agent_id: "a".into(),
            ..AgentConfig::default()
        };
        assert_eq!(c.metrics_listen, "");
        assert_eq!(c.validate(), Ok(()));
        for (v, ok) in [
            ("127.0.0.1:9101", true),
            ("[::1]:9101", true),
            ("0.0.0.0:0", true),
            ("localhost:9101", false),
            ("127.0.0.1", false),
            ("9101", false),
        ] {
            c.metrics_listen = v.into();
            let problems = c.validate().err().unwrap_or_default();
            assert_eq!(
                !problems.iter().any(|p| p.starts_with("metrics_listen: ")),
                ok,
                "{v}: {problems:?}"
            );
        }
    }

    #[test]
    fn submitter_rules() {
        let mut r = SubmitterRules::default();
        assert!(r.allows("alice", "alice"));
        assert!(!r.allows("alice", "bob"));
        r.trusted.push("bridge".into());
        r.grants.insert("carol".into(), vec!["dave".into()]);
        assert!(r.allows("bridge", "bob"));
        assert!(r.allows("carol", "dave"));
        assert!(!r.allows("carol", "erin"));
        r.requeuers.push("vq-controller".into());
        assert_eq!(
            r.effective_submitter(Some("vq-controller"), Some("alice")),
            Some("alice")
        );
        assert_eq!(r.effective_submitter(Some("vq-controller"), None), None);
        assert_eq!(
            r.effective_submitter(Some("alice"), Some("bridge")),
            Some("alice")
        );
        assert_eq!(r.effective_submitter(None, Some("alice")), None);
    }
}
