//! Configuration of the jobagent and the controller: TOML files plus
//! `VQ_*` environment overrides, parsed completely and then validated once so
//! that an operator sees every problem in one run (exit code 64, `EX_USAGE`).
//!
//! Unknown keys are errors (a misspelt key must not silently fall back to a
//! default). They are collected with `serde_ignored`, together with the
//! problems found by `validate()`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::topology::{valid_name, DEFAULT_CLUSTER};

/// Exit code for a bad configuration (`EX_USAGE` from sysexits.h).
pub const EXIT_CONFIG: i32 = 64;

/// Connection to RabbitMQ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BrokerConfig {
    /// AMQP URI, `amqp://user:password@host:5672/vhost` or `amqps://…`
    /// (vhost `%2f` for `/`). A `frame_max` query parameter is added when
    /// absent (131072 bytes) because lapin allocates 8 MiB buffers otherwise.
    pub url: String,
    /// PEM file with the CA certificate(s) that sign the broker's
    /// certificate (amqps only; with an `amqp://` url it is a configuration
    /// error). It must hold at least one certificate. When set, these
    /// certificates are the ONLY trust anchors of the connection: the system
    /// roots are not consulted, so a broker certificate from a publicly
    /// trusted CA is refused unless that CA is in the file (vq builds its own
    /// rustls configuration for this; lapin's default would ADD the file to
    /// the system roots). `None` uses the system roots (`SSL_CERT_FILE` /
    /// `SSL_CERT_DIR` or the OS store), for a broker with a publicly trusted
    /// certificate.
    pub ca_file: Option<PathBuf>,
    /// PEM file with this component's client certificate, end-entity first,
    /// then any intermediates (amqps only; set together with `key_file`).
    /// Presented when the broker asks for a peer certificate
    /// (`ssl_options.verify = verify_peer`); the login stays user/password
    /// from `url`. `None`: no client certificate.
    pub cert_file: Option<PathBuf>,
    /// PEM file with the unencrypted private key of `cert_file` (PKCS#8
    /// `BEGIN PRIVATE KEY`; PKCS#1 RSA and SEC1 EC keys are accepted too).
    /// Must be mode 0600 (no group or other bits), owned by the user the
    /// daemon runs as: root for the jobagent, whose jobs run as other users
    /// on the same machine. A key with group or other permission bits is a
    /// configuration error.
    pub key_file: Option<PathBuf>,
    /// Seconds to wait for one connection attempt.
    pub connect_timeout_secs: u64,
    /// Seconds to wait for a publisher confirm before the publish counts as
    /// failed.
    pub confirm_timeout_secs: u64,
    /// AMQP heartbeat interval requested from the broker, seconds.
    pub heartbeat_secs: u16,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            connect_timeout_secs: 10,
            confirm_timeout_secs: 30,
            heartbeat_secs: 15,
        }
    }
}

impl BrokerConfig {
    fn problems(&self, prefix: &str, out: &mut Vec<String>) {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            out.push(format!(
                "{prefix}.url: {:?} is not an amqp:// or amqps:// URI",
                redact_url(&self.url)
            ));
        }
        if self.connect_timeout_secs == 0 {
            out.push(format!("{prefix}.connect_timeout_secs: must be at least 1"));
        }
        if self.confirm_timeout_secs == 0 {
            out.push(format!("{prefix}.confirm_timeout_secs: must be at least 1"));
        }
        let mut ca_ok = false;
        if let Some(ca) = &self.ca_file {
            if ca.as_os_str().is_empty() {
                out.push(format!(
                    "{prefix}.ca_file: is empty (remove the key to use the system roots)"
                ));
            } else if !ca.is_file() {
                out.push(format!(
                    "{prefix}.ca_file: {} does not exist or is not a file",
                    ca.display()
                ));
            } else {
                match std::fs::read(ca) {
                    Err(e) => out.push(format!(
                        "{prefix}.ca_file: cannot read {}: {e}",
                        ca.display()
                    )),
                    Ok(text) if !contains(&text, b"-----BEGIN CERTIFICATE-----") => {
                        out.push(format!(
                            "{prefix}.ca_file: {} holds no PEM certificate \
                             (-----BEGIN CERTIFICATE-----)",
                            ca.display()
                        ))
                    }
                    Ok(_) => ca_ok = true,
                }
            }
            if !self.url.starts_with("amqps://") {
                out.push(format!(
                    "{prefix}.ca_file: only used with an amqps:// url, not {:?} \
                     (use amqps:// or remove ca_file)",
                    redact_url(&self.url)
                ));
            }
        }
        let pair_ok = self.client_cert_problems(prefix, out);
        #[cfg(feature = "amqp")]
        crate::tls::material_problems(self, prefix, ca_ok, pair_ok, out);
        #[cfg(not(feature = "amqp"))]
        let _ = (ca_ok, pair_ok);
    }

    /// Problems of `cert_file`/`key_file`: both or neither, amqps only, and
    /// both readable PEM files, the key unencrypted and mode 0600. Returns
    /// whether both files passed these checks, so that (feature `amqp`)
    /// [`crate::tls::material_problems`] parses them and checks that they
    /// belong together, as [`crate::amqp::connect`] does.
    fn client_cert_problems(&self, prefix: &str, out: &mut Vec<String>) -> bool {
        match (&self.cert_file, &self.key_file) {
            (None, None) => return false,
            (Some(_), None) => out.push(format!(
                "{prefix}.key_file: missing (cert_file is set; set both or neither)"
            )),
            (None, Some(_)) => out.push(format!(
                "{prefix}.cert_file: missing (key_file is set; set both or neither)"
            )),
            (Some(_), Some(_)) => {}
        }
        if !self.url.starts_with("amqps://") {
            out.push(format!(
                "{prefix}.cert_file/key_file: client certificates need an amqps:// url, not {:?}",
                redact_url(&self.url)
            ));
        }
        let mut empty = false;
        for (key, path) in [("cert_file", &self.cert_file), ("key_file", &self.key_file)] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                out.push(format!("{prefix}.{key}: is empty"));
                empty = true;
            }
        }
        if empty {
            return false;
        }
        let both = self.cert_file.is_some() && self.key_file.is_some();
        let before = out.len();
        if let Some(cert) = &self.cert_file {
            match std::fs::read(cert) {
                Err(e) => out.push(format!(
                    "{prefix}.cert_file: cannot read {}: {e}",
                    cert.display()
                )),
                Ok(text) if !contains(&text, b"-----BEGIN CERTIFICATE-----") => out.push(format!(
                    "{prefix}.cert_file: {} holds no PEM certificate \
                         (-----BEGIN CERTIFICATE-----)",
                    cert.display()
                )),
                Ok(_) => {}
            }
        }
        if let Some(key) = &self.key_file {
            match std::fs::read(key) {
                Err(e) => out.push(format!(
                    "{prefix}.key_file: cannot read {}: {e}",
                    key.display()
                )),
                Ok(text)
                    if contains(&text, b"ENCRYPTED PRIVATE KEY")
                        || contains(&text, b"Proc-Type: 4,ENCRYPTED") =>
                {
                    out.push(format!(
                        "{prefix}.key_file: {} is encrypted; give an unencrypted PEM key \
                         (e.g. `openssl pkey -in old.key -out new.key`) protected by mode 0600",
                        key.display()
                    ))
                }
                Ok(text) if !contains(&text, b"PRIVATE KEY-----") => out.push(format!(
                    "{prefix}.key_file: {} holds no PEM private key (-----BEGIN PRIVATE KEY-----)",
                    key.display()
                )),
                Ok(_) => {
                    if let Some(mode) = loose_mode(key) {
                        out.push(format!(
                            "{prefix}.key_file: {} has mode {mode:04o}, readable or writable by \
                             group or others; make it 0600 (chmod 600) and owned by the user the \
                             daemon runs as (root for the jobagent)",
                            key.display()
                        ));
                    }
                }
            }
        }
        both && out.len() == before
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The permission bits of `path` if any group or other bit is set.
#[cfg(unix)]
fn loose_mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    (mode & 0o077 != 0).then_some(mode)
}

#[cfg(not(unix))]
fn loose_mode(_path: &Path) -> Option<u32> {
    None
}

pub use crate::amqp_url::redact_url;

/// Which submitters may run jobs as which owners (checked by the agent
/// against the broker-validated AMQP `user_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
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
}

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
            max_walltime_secs: 31 * 24 * 3600,
            loss_limit: crate::topology::DEFAULT_LOSS_LIMIT,
            control_admins: vec!["vq-controller".into()],
            kill_grace_secs: 10,
            default_umask: 0o022,
            job_path: "/usr/local/bin:/usr/bin:/bin".into(),
            state_dir: PathBuf::from("/var/lib/vq"),
            max_script_bytes: crate::messages::MAX_SCRIPT_BYTES,
            deny_groups: Vec::new(),
            allow_groups: Vec::new(),
            allow_group_zero: false,
            max_output_bytes: 10 * 1024 * 1024 * 1024,
            cgroups: true,
            job_memory_max_bytes: 0,
            job_cpu_max: 0.0,
            job_pids_max: 4096,
        }
    }
}

impl AgentConfig {
    /// Applies an identity file's values over this config.
    pub fn apply_identity(&mut self, id: &AgentIdentity) {
        if let Some(c) = &id.cluster {
            self.cluster = c.clone();
        }
        self.pool = id.pool.clone();
        self.agent_id = id.agent_id.clone();
        if let Some(url) = &id.broker_url {
            self.broker.url = url.clone();
        }
        if let Some(n) = id.loss_limit {
            self.loss_limit = n;
        }
    }

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
        if self.max_walltime_secs == 0 || self.max_walltime_secs > 10 * 366 * 24 * 3600 {
            p.push(format!(
                "max_walltime_secs: {} is out of range 1..=316224000 (10 years)",
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
}

/// One pool (VM type) managed by the controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolConfig {
    /// Flavor name or id.
    pub flavor: String,
    /// Image name or id (names are resolved through Glance).
    pub image: String,
    /// Network id; `None` boots servers with `networks: "none"` (microversion
    /// ≥ 2.37).
    pub network: Option<String>,
    /// Key pair name, if any.
    pub key_name: Option<String>,
    /// Security group names.
    pub security_groups: Vec<String>,
    /// Availability zone, if any.
    pub availability_zone: Option<String>,
    /// File with the user-data template; `None` uses the built-in cloud-init
    /// template. Placeholders: `{{identity_toml}}`, `{{pool}}`,
    /// `{{agent_id}}`, `{{cluster}}`, `{{broker_url}}`.
    pub user_data_template: Option<PathBuf>,
    /// Broker URL given to this pool's agents (with the agent account's
    /// credentials).
    pub agent_broker_url: String,
    /// VMs kept even without demand.
    pub min: u32,
    /// VMs never exceeded.
    pub max: u32,
    /// Job slots per VM (the agent's `slots`).
    pub slots: u32,
    /// Seconds a server may take from create to its agent's first heartbeat.
    pub boot_timeout_secs: u64,
    /// Seconds an agent must be idle before it is asked to go.
    pub idle_secs: u64,
    /// Seconds after a scale-down before the next one (and after a failed
    /// boot before the next boot).
    pub cooldown_secs: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            flavor: String::new(),
            image: String::new(),
            network: None,
            key_name: None,
            security_groups: Vec::new(),
            availability_zone: None,
            user_data_template: None,
            agent_broker_url: String::new(),
            min: 0,
            max: 10,
            slots: 1,
            boot_timeout_secs: 600,
            idle_secs: 300,
            cooldown_secs: 30,
        }
    }
}

/// Where the controller gets OpenStack credentials: `clouds.yaml` (the
/// usual search path or `clouds_yaml`) entry `cloud`, else the `OS_*`
/// variables, as every OpenStack client does.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OpenStackSection {
    /// Cloud name in clouds.yaml (like `OS_CLOUD`); `None` uses `OS_CLOUD`,
    /// then the `OS_*` variables.
    pub cloud: Option<String>,
    /// Explicit clouds.yaml path (like `OS_CLIENT_CONFIG_FILE`).
    pub clouds_yaml: Option<PathBuf>,
    /// Compute API microversion to request (`<major>.<minor>`, at least
    /// [`MIN_COMPUTE_MICROVERSION`]); `None` means 2.52.
    pub compute_microversion: Option<String>,
}

/// A compute API microversion, `<major>.<minor>` (e.g. `2.52`). Ordered
/// numerically: `2.100` is above `2.52`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Microversion {
    /// Major version (2 for Nova's v2.1 API).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Microversion {
    /// Parses `"<major>.<minor>"` (decimal numbers, nothing else; `latest`
    /// is not a version). `None` if `s` has another form.
    pub fn parse(s: &str) -> Option<Microversion> {
        let (major, minor) = s.trim().split_once('.')?;
        let num = |p: &str| {
            (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        };
        Some(Microversion {
            major: num(major)?,
            minor: num(minor)?,
        })
    }
}

impl std::fmt::Display for Microversion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The lowest compute microversion vq works with, and the one requested
/// when the config names none: 2.52 is the first that tags a server at
/// create time. Below it a created server carries no tag, while the list's
/// tag filter (applied from 2.26) would never show it: the controller would
/// boot without end.
pub const MIN_COMPUTE_MICROVERSION: Microversion = Microversion {
    major: 2,
    minor: 52,
};

/// Controller configuration (`/etc/vq/controller.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerConfig {
    /// Cluster name (prefix of every AMQP name and of server names).
    pub cluster: String,
    /// Broker connection of the controller.
    pub broker: BrokerConfig,
    /// OpenStack credentials.
    pub openstack: OpenStackSection,
    /// Address of the HTTP status and `/metrics` endpoint.
    pub listen: String,
    /// Seconds between reconcile cycles.
    pub interval_secs: f64,
    /// Seconds without a heartbeat after which an agent counts as dead
    /// (judged on the controller's monotonic clock).
    pub heartbeat_timeout_secs: f64,
    /// Losses after which a job is dead-lettered instead of returned to its
    /// pool when its agent is fenced (a poison job that kills its agent or
    /// VM again and again; counted in the job's `x-vq-losses` header).
    pub loss_limit: u32,
    /// Pools by name.
    pub pools: BTreeMap<String, PoolConfig>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            cluster: DEFAULT_CLUSTER.into(),
            broker: BrokerConfig::default(),
            openstack: OpenStackSection::default(),
            listen: "127.0.0.1:9180".into(),
            interval_secs: 10.0,
            heartbeat_timeout_secs: 60.0,
            loss_limit: crate::topology::DEFAULT_LOSS_LIMIT,
            pools: BTreeMap::new(),
        }
    }
}

impl ControllerConfig {
    /// Lists every problem with the values, including cross-field rules
    /// (`min <= max`, pool names, required fields).
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut p = Vec::new();
        if !valid_name(&self.cluster) {
            p.push(format!(
                "cluster: {:?} is not a valid name (1-64 of a-z A-Z 0-9 _ -)",
                self.cluster
            ));
        }
        self.broker.problems("broker", &mut p);
        if let Some(mv) = &self.openstack.compute_microversion {
            match Microversion::parse(mv) {
                None => p.push(format!(
                    "openstack.compute_microversion: {mv:?} is not a version like {MIN_COMPUTE_MICROVERSION} (<major>.<minor>)"
                )),
                Some(v) if v < MIN_COMPUTE_MICROVERSION => p.push(format!(
                    "openstack.compute_microversion: compute_microversion {v} is below {MIN_COMPUTE_MICROVERSION}, which vq needs for server tags"
                )),
                Some(_) => {}
            }
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            p.push(format!(
                "listen: {:?} is not an address like 127.0.0.1:9180",
                self.listen
            ));
        }
        if !(self.interval_secs.is_finite() && self.interval_secs >= 0.1) {
            p.push(format!(
                "interval_secs: {} must be at least 0.1",
                self.interval_secs
            ));
        }
        if !(self.heartbeat_timeout_secs.is_finite() && self.heartbeat_timeout_secs >= 1.0) {
            p.push(format!(
                "heartbeat_timeout_secs: {} must be at least 1",
                self.heartbeat_timeout_secs
            ));
        }
        if self.loss_limit == 0 {
            p.push("loss_limit: must be at least 1".into());
        }
        if self.pools.is_empty() {
            p.push("pools: no pool configured (add a [pools.<name>] table)".into());
        }
        for (name, pool) in &self.pools {
            let k = format!("pools.{name}");
            if !valid_name(name) {
                p.push(format!(
                    "{k}: {name:?} is not a valid pool name (1-64 of a-z A-Z 0-9 _ -)"
                ));
            }
            if pool.flavor.is_empty() {
                p.push(format!("{k}.flavor: missing"));
            }
            if pool.image.is_empty() {
                p.push(format!("{k}.image: missing"));
            }
            if pool.agent_broker_url.is_empty() {
                p.push(format!(
                    "{k}.agent_broker_url: missing (the broker URL the pool's agents use)"
                ));
            } else if !(pool.agent_broker_url.starts_with("amqp://")
                || pool.agent_broker_url.starts_with("amqps://"))
            {
                p.push(format!(
                    "{k}.agent_broker_url: {:?} is not an amqp:// or amqps:// URI",
                    redact_url(&pool.agent_broker_url)
                ));
            }
            if pool.min > pool.max {
                p.push(format!(
                    "{k}: min {} is greater than max {}",
                    pool.min, pool.max
                ));
            }
            if pool.slots == 0 || pool.slots > 1024 {
                p.push(format!(
                    "{k}.slots: {} is out of range 1..=1024",
                    pool.slots
                ));
            }
            if pool.boot_timeout_secs == 0 {
                p.push(format!("{k}.boot_timeout_secs: must be at least 1"));
            }
            if let Some(t) = &pool.user_data_template {
                if !t.is_file() {
                    p.push(format!(
                        "{k}.user_data_template: {} does not exist",
                        t.display()
                    ));
                }
            }
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(p)
        }
    }
}

/// Environment overrides for a config whose variables start with `prefix`
/// ([`Validate::ENV_PREFIX`]: `VQ_AGENT__` for the jobagent,
/// `VQ_CONTROLLER__` for the controller). After the prefix, `__` separates
/// nested keys: `VQ_AGENT__SLOTS=4`, `VQ_CONTROLLER__BROKER__URL=amqps://…`.
/// The prefix names the component so that the `vq` CLI's own variables
/// (`VQ_BROKER_URL`, `VQ_CLUSTER`, `VQ_CONTROLLER_URL`) and unrelated `VQ_*`
/// variables never leak into a daemon's config. Values are parsed as TOML
/// values when they parse (numbers, booleans, arrays), else taken as
/// strings; values of paths and URLs (keys ending in `_file`, `_dir`,
/// `_template`, `_yaml` or `url`) are always strings.
pub fn env_overrides(
    prefix: &str,
    vars: impl IntoIterator<Item = (String, String)>,
) -> toml::Table {
    let mut table = toml::Table::new();
    for (k, v) in vars {
        let Some(rest) = k.strip_prefix(prefix) else {
            continue;
        };
        let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
        if path.iter().any(|s| s.is_empty()) {
            continue;
        }
        let value = if path.last().is_some_and(|k| is_string_key(k)) {
            toml::Value::String(v)
        } else {
            parse_env_value(&v)
        };
        insert_path(&mut table, &path, value);
    }
    table
}

/// Whether an environment override of `key` is always a string, never
/// parsed as a TOML value: file and directory paths and URLs
/// (`VQ_CONTROLLER__BROKER__CERT_FILE=1234` is the file `1234`, not a
/// number).
fn is_string_key(key: &str) -> bool {
    ["_file", "_dir", "_template", "_yaml", "url"]
        .iter()
        .any(|suffix| key.ends_with(suffix))
}

fn parse_env_value(v: &str) -> toml::Value {
    let doc = format!("v = {v}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(v.into())),
        Err(_) => toml::Value::String(v.into()),
    }
}

fn insert_path(table: &mut toml::Table, path: &[String], value: toml::Value) {
    match path {
        [] => {}
        [last] => {
            table.insert(last.clone(), value);
        }
        [first, rest @ ..] => {
            let entry = table
                .entry(first.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            if let toml::Value::Table(t) = entry {
                insert_path(t, rest, value);
            }
        }
    }
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// A config type that can be loaded with [`load`].
pub trait Validate {
    /// Prefix of this config's environment overrides (see [`env_overrides`]).
    const ENV_PREFIX: &'static str;
    /// Lists every problem with the values.
    fn check(&self) -> Result<(), Vec<String>>;
}

impl Validate for AgentConfig {
    const ENV_PREFIX: &'static str = "VQ_AGENT__";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
}

impl Validate for ControllerConfig {
    const ENV_PREFIX: &'static str = "VQ_CONTROLLER__";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
}

/// Parses TOML `text` (from `origin`, for messages) with `overrides` merged
/// over it, reports every unknown key, then validates. Does no I/O.
///
/// # Errors
/// [`ConfigError::Invalid`] listing every unknown key, type error and value
/// problem.
pub fn parse<T: DeserializeOwned + Validate>(
    origin: &str,
    text: &str,
    overrides: toml::Table,
) -> Result<T, ConfigError> {
    let mut table: toml::Table =
        text.parse()
            .map_err(|e: toml::de::Error| ConfigError::Invalid {
                origin: origin.into(),
                problems: vec![e.to_string().trim().to_string()],
            })?;
    merge(&mut table, overrides);
    let mut unknown = Vec::new();
    let value = toml::Value::Table(table);
    let parsed: Result<T, _> = serde_ignored::deserialize(value, |path| {
        unknown.push(format!("{path}: unknown key"));
    });
    let cfg = match parsed {
        Ok(cfg) => cfg,
        Err(e) => {
            let mut problems = unknown;
            problems.push(e.to_string().trim().to_string());
            return Err(ConfigError::Invalid {
                origin: origin.into(),
                problems,
            });
        }
    };
    let mut problems = unknown;
    if let Err(p) = cfg.check() {
        problems.extend(p);
    }
    if problems.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError::Invalid {
            origin: origin.into(),
            problems,
        })
    }
}

/// Reads the TOML file at `path` (a missing file is an error), applies the
/// process's `VQ_*` overrides and validates.
///
/// # Errors
/// [`ConfigError::Read`] if the file cannot be read, else as [`parse`].
pub fn load<T: DeserializeOwned + Validate>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(
        &path.display().to_string(),
        &text,
        env_overrides(T::ENV_PREFIX, std::env::vars()),
    )
}

/// Reads an identity file (`/etc/vq/identity.toml`).
///
/// # Errors
/// [`ConfigError::Read`] or [`ConfigError::Invalid`].
pub fn load_identity(path: &Path) -> Result<AgentIdentity, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Invalid {
        origin: path.display().to_string(),
        problems: vec![e.to_string().trim().to_string()],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_is_listed_at_once() {
        let err = parse::<ControllerConfig>(
            "test",
            r#"
            cluster = "a.b"
            listen = "nowhere"
            colour = "blue"
            [pools.cms]
            flavor = "m1.small"
            min = 5
            max = 2
            slotz = 3
            "#,
            toml::Table::new(),
        )
        .unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "colour: unknown",
            "pools.cms.slotz: unknown",
            "cluster:",
            "listen:",
            "pools.cms.image: missing",
            "min 5 is greater than max 2",
            "agent_broker_url: missing",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
    }

    #[test]
    fn compute_microversions_below_what_vq_needs_are_refused() {
        let check = |mv: &str| {
            let text = format!(
                "[openstack]\ncompute_microversion = \"{mv}\"\n[pools.cms]\nflavor = \"f\"\nimage = \"i\"\nagent_broker_url = \"amqp://h\"\n"
            );
            match parse::<ControllerConfig>("test", &text, toml::Table::new()) {
                Ok(_) => None,
                Err(ConfigError::Invalid { problems, .. }) => Some(problems.join("\n")),
                Err(e) => panic!("{e}"),
            }
        };
        let err = check("2.37").expect("2.37 is refused");
        assert!(
            err.contains("compute_microversion 2.37 is below 2.52, which vq needs for server tags"),
            "{err}"
        );
        for bad in ["2.51", "2.1", "latest", "2", "two.52", "2.52.1"] {
            assert!(check(bad).is_some(), "{bad} is accepted");
        }
        for good in ["2.52", "2.60", "2.96", "2.100"] {
            assert_eq!(check(good), None, "{good} is refused");
        }
        assert!(Microversion::parse("2.100").unwrap() > Microversion::parse("2.52").unwrap());
        assert_eq!(MIN_COMPUTE_MICROVERSION.to_string(), "2.52");
    }

    #[test]
    fn env_overrides_reach_nested_keys() {
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                (
                    "VQ_AGENT__BROKER__URL".to_string(),
                    "amqp://x:y@h:1/v".to_string(),
                ),
                ("VQ_AGENT__SLOTS".to_string(), "4".to_string()),
                ("VQ_AGENT__POOL".to_string(), "cms".to_string()),
                (
                    "VQ_BROKER_URL".to_string(),
                    "amqp://cli:only@h:1/v".to_string(),
                ),
                ("VQ_JOBAGENT_BIN".to_string(), "/x".to_string()),
                ("HOME".to_string(), "/root".to_string()),
            ],
        );
        let cfg: AgentConfig = parse("t", "", over).unwrap();
        assert_eq!(cfg.broker.url, "amqp://x:y@h:1/v");
        assert_eq!(cfg.slots, 4);
        assert_eq!(cfg.pool, "cms");
    }

    /// A file in the temporary directory with `text` and `mode`, removed
    /// on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str, mode: u32) -> TempFile {
            use std::os::unix::fs::PermissionsExt;
            let path =
                std::env::temp_dir().join(format!("vq-config-{}-{name}", uuid::Uuid::new_v4()));
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    // A real pair (v3 certificate and its key): with feature `amqp` the
    // files are parsed and matched too.
    const CERT: &str = include_str!("../testdata/tls/client-v3.pem");
    const KEY: &str = include_str!("../testdata/tls/client.key");

    fn broker_problems(b: &BrokerConfig) -> String {
        let mut p = Vec::new();
        b.problems("broker", &mut p);
        p.join("\n")
    }

    #[test]
    fn client_cert_and_key_go_together_with_amqps_only() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let mut b = BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            cert_file: Some(cert.0.clone()),
            key_file: Some(key.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b), "");
        b.key_file = None;
        assert!(broker_problems(&b).contains("broker.key_file: missing (cert_file is set"));
        b.key_file = Some(key.0.clone());
        b.cert_file = None;
        assert!(broker_problems(&b).contains("broker.cert_file: missing (key_file is set"));
        b.cert_file = Some(cert.0.clone());
        b.url = "amqp://a:b@h:5672/%2f".into();
        let all = broker_problems(&b);
        assert!(all.contains("need an amqps:// url"), "{all}");
        assert!(!all.contains(":b@"), "password in {all}");
    }

    #[test]
    fn client_cert_files_are_read_and_checked_at_start() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let loose = TempFile::new("loose.pem", KEY, 0o640);
        let world = TempFile::new("world.pem", KEY, 0o604);
        let encrypted = TempFile::new(
            "enc.pem",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIE\n-----END ENCRYPTED PRIVATE KEY-----\n",
            0o600,
        );
        let url = "amqps://a:b@h:5671/%2f".to_string();
        let with = |c: &Path, k: &Path| BrokerConfig {
            url: url.clone(),
            cert_file: Some(c.to_path_buf()),
            key_file: Some(k.to_path_buf()),
            ..Default::default()
        };
        let missing = std::env::temp_dir().join("vq-config-no-such-file.pem");
        let all = broker_problems(&with(&missing, &missing));
        for needle in [
            format!("broker.cert_file: cannot read {}: ", missing.display()),
            format!("broker.key_file: cannot read {}: ", missing.display()),
        ] {
            assert!(all.contains(&needle), "{needle} not in:\n{all}");
        }
        // Swapped files.
        let all = broker_problems(&with(&key.0, &cert.0));
        assert!(all.contains("holds no PEM certificate"), "{all}");
        assert!(all.contains("holds no PEM private key"), "{all}");
        for (file, mode) in [(&loose, "0640"), (&world, "0604")] {
            let all = broker_problems(&with(&cert.0, &file.0));
            assert!(
                all.contains(&format!("{} has mode {mode}", file.0.display()))
                    && all.contains("chmod 600"),
                "{all}"
            );
        }
        let all = broker_problems(&with(&cert.0, &encrypted.0));
        assert!(all.contains("is encrypted"), "{all}");
    }

    #[test]
    fn client_cert_env_overrides() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                (
                    "VQ_AGENT__BROKER__URL".to_string(),
                    "amqps://x:y@h:5671/v".to_string(),
                ),
                (
                    "VQ_AGENT__BROKER__CERT_FILE".to_string(),
                    cert.0.display().to_string(),
                ),
                (
                    "VQ_AGENT__BROKER__KEY_FILE".to_string(),
                    key.0.display().to_string(),
                ),
                ("VQ_AGENT__POOL".to_string(), "cms".to_string()),
            ],
        );
        let cfg: AgentConfig = parse("t", "", over).unwrap();
        assert_eq!(cfg.broker.cert_file.as_deref(), Some(cert.0.as_path()));
        assert_eq!(cfg.broker.key_file.as_deref(), Some(key.0.as_path()));
        // The same keys in a file, with every problem listed at once.
        let err = parse::<AgentConfig>(
            "t",
            "pool = \"cms\"\n[broker]\nurl = \"amqp://x:y@h/v\"\ncert_file = \"/nonexistent/c.pem\"\n",
            toml::Table::new(),
        )
        .unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "broker.key_file: missing",
            "need an amqps:// url",
            "broker.cert_file: cannot read /nonexistent/c.pem",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
    }

    #[test]
    fn ca_file_must_hold_a_certificate_and_need_amqps() {
        let ca = TempFile::new("ca.pem", CERT, 0o644);
        let empty = TempFile::new("empty.pem", "", 0o644);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let mut b = BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            ca_file: Some(ca.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b), "");
        for file in [&empty, &key] {
            b.ca_file = Some(file.0.clone());
            let all = broker_problems(&b);
            assert!(
                all.contains(&format!(
                    "broker.ca_file: {} holds no PEM certificate",
                    file.0.display()
                )),
                "{all}"
            );
        }
        b.ca_file = Some(ca.0.clone());
        b.url = "amqp://a:b@h:5672/%2f".into();
        let all = broker_problems(&b);
        assert!(
            all.contains("broker.ca_file: only used with an amqps:// url"),
            "{all}"
        );
        assert!(!all.contains(":b@"), "password in {all}");
    }

    #[test]
    fn path_overrides_stay_strings_and_empty_paths_are_named() {
        let over = env_overrides(
            ControllerConfig::ENV_PREFIX,
            [
                (
                    "VQ_CONTROLLER__BROKER__URL".to_string(),
                    "amqps://x:y@h:5671/v".to_string(),
                ),
                (
                    "VQ_CONTROLLER__BROKER__CERT_FILE".to_string(),
                    "1234".to_string(),
                ),
                (
                    "VQ_CONTROLLER__BROKER__KEY_FILE".to_string(),
                    "true".to_string(),
                ),
                ("VQ_CONTROLLER__BROKER__CA_FILE".to_string(), String::new()),
                ("VQ_CONTROLLER__INTERVAL_SECS".to_string(), "5".to_string()),
            ],
        );
        let err = parse::<ControllerConfig>("t", "", over).unwrap_err();
        let ConfigError::Invalid { problems, .. } = err else {
            panic!()
        };
        let all = problems.join("\n");
        for needle in [
            "broker.cert_file: cannot read 1234",
            "broker.key_file: cannot read true",
            "broker.ca_file: is empty",
            // The listing goes on past the broker.
            "pools: no pool configured",
        ] {
            assert!(all.contains(needle), "{needle} not in:\n{all}");
        }
        assert!(!all.contains("invalid type"), "{all}");
        let over = env_overrides(
            AgentConfig::ENV_PREFIX,
            [
                ("VQ_AGENT__BROKER__CERT_FILE".to_string(), String::new()),
                ("VQ_AGENT__BROKER__KEY_FILE".to_string(), String::new()),
                ("VQ_AGENT__SLOTS".to_string(), "4".to_string()),
            ],
        );
        let mut p = Vec::new();
        let cfg: AgentConfig = {
            let mut t = toml::Table::new();
            merge(&mut t, over);
            toml::Value::Table(t).try_into().unwrap()
        };
        assert_eq!(cfg.slots, 4);
        cfg.broker.problems("broker", &mut p);
        let all = p.join("\n");
        assert!(
            all.contains("broker.cert_file: is empty") && all.contains("broker.key_file: is empty"),
            "{all}"
        );
        assert!(!all.contains("cannot read"), "{all}");
    }

    /// With feature `amqp`, validation parses the files as a connect does.
    #[cfg(feature = "amqp")]
    #[test]
    fn unusable_tls_material_is_a_config_problem() {
        let cert = TempFile::new("cert.pem", CERT, 0o644);
        let v1 = TempFile::new(
            "v1.pem",
            include_str!("../testdata/tls/client-v1.pem"),
            0o644,
        );
        let other = TempFile::new(
            "other.key",
            include_str!("../testdata/tls/other.key"),
            0o600,
        );
        let ec = TempFile::new("ec.key", include_str!("../testdata/tls/ec-sec1.key"), 0o600);
        let key = TempFile::new("key.pem", KEY, 0o600);
        let garbage = TempFile::new(
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\n%%%%\n-----END CERTIFICATE-----\n",
            0o644,
        );
        let b = |ca: Option<&TempFile>, c: &TempFile, k: &TempFile| BrokerConfig {
            url: "amqps://a:b@h:5671/%2f".into(),
            ca_file: ca.map(|f| f.0.clone()),
            cert_file: Some(c.0.clone()),
            key_file: Some(k.0.clone()),
            ..Default::default()
        };
        assert_eq!(broker_problems(&b(Some(&cert), &cert, &key)), "");
        for k in [&other, &ec] {
            let all = broker_problems(&b(None, &cert, k));
            assert!(
                all.contains(&format!(
                    "broker.key_file: {} does not match the certificate",
                    k.0.display()
                )),
                "{all}"
            );
        }
        let all = broker_problems(&b(None, &v1, &key));
        assert!(
            all.contains(&format!(
                "broker.cert_file: {} holds an X.509 version 1",
                v1.0.display()
            )),
            "{all}"
        );
        assert!(!all.contains("key_file"), "{all}");
        // Garbage in all three at once: every file named.
        let all = broker_problems(&b(Some(&garbage), &garbage, &key));
        for needle in [
            format!("broker.ca_file: {} is not valid PEM", garbage.0.display()),
            format!("broker.cert_file: {} is not valid PEM", garbage.0.display()),
        ] {
            assert!(all.contains(&needle), "{needle} not in:\n{all}");
        }
    }

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
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://agent:s3cret@h:5672/%2f"),
            "amqp://agent:***@h:5672/%2f"
        );
        assert_eq!(redact_url("amqp://h:5672"), "amqp://h:5672");
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
