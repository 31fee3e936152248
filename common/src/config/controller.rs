//! The controller's configuration (`/etc/vq/controller.toml`): broker,
//! OpenStack section and pools.

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{redact_url, BrokerConfig};
use crate::topology::{valid_name, DEFAULT_CLUSTER};

/// One pool (VM type) managed by the controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
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
    /// Job slots per VM: the controller plans VMs of this many slots, gives
    /// it to the agents it boots (their identity file's `slots`, which wins
    /// over their config's) and publishes it to `vq submit`, which refuses
    /// a job asking more (`-l nodes=1:ppn=N`, `ncpus`).
    pub slots: u32,
    /// Largest walltime a job of this pool may ask for, seconds (a PBS
    /// queue's `resources_max.walltime`): published to `vq submit`, which
    /// refuses a job asking more, and given to the agents it boots (their
    /// identity file's `max_walltime_secs`, which wins over their config's
    /// and caps their `default_walltime_secs`). Default 31 days, the
    /// agents' own default; at most 10 years.
    pub max_walltime_secs: u64,
    /// Memory of each VM for jobs, MiB (at most the flavor's RAM): `vq
    /// submit` refuses a job whose `-l mem` is above it. `None` (the
    /// default): the flavor's RAM, as the controller reads it from Nova at
    /// start (not checked at submit if it cannot); the agent still refuses
    /// a job asking more memory than its VM has.
    pub memory_mb: Option<u64>,
    /// Seconds a server may take from create to its agent's first heartbeat.
    pub boot_timeout_secs: u64,
    /// Seconds an agent must be idle before it is asked to go: the
    /// agent's idle clock runs from the later of its start of pulling and
    /// its last job's end.
    pub idle_secs: u64,
    /// Seconds after a scale-down before the next one (and after a failed
    /// boot before the next boot).
    pub cooldown_secs: u64,
    /// Scale-down hysteresis, seconds: the pool must have had more VMs
    /// than its target without a break for this long before an idle agent
    /// is asked to go, so that a dip in the demand shorter than this
    /// deletes nothing. Unset: `idle_secs` (an agent's idle time then
    /// counts from the later of its last job's end and the moment the
    /// demand for its VM went away). 0: no hysteresis.
    pub scale_down_delay_secs: Option<u64>,
    /// Seconds a server lives at least (from Nova's `created`) before an
    /// idle agent on it is asked to go; 0: no minimum. Failed servers
    /// (ERROR, stuck in BUILD, black holes, dead agents) are deleted at
    /// any age.
    pub min_lifetime_secs: u64,
    /// First delay, seconds, before the next boot after a boot failure (a
    /// failed create, a server in ERROR or stuck in BUILD past
    /// `boot_timeout_secs`); it doubles with each consecutive failure, with
    /// jitter, up to `boot_backoff_cap_secs`.
    pub boot_backoff_base_secs: f64,
    /// Largest delay, seconds, between boots after consecutive boot
    /// failures.
    pub boot_backoff_cap_secs: f64,
    /// Consecutive boot failures that open the pool's circuit breaker: the
    /// pool boots nothing for `breaker_open_secs`, then tries one boot,
    /// whose success closes it.
    pub breaker_failures: u32,
    /// Seconds the open circuit breaker stops the pool's boots before it
    /// half-opens for one trial boot.
    pub breaker_open_secs: f64,
    /// Seconds after a `DELETE` that Nova accepted before the controller
    /// sends it again for a server that is still listed (Nova deletes
    /// asynchronously: meanwhile it polls the listing); the delay doubles
    /// with each re-send, jittered, up to 16 × this.
    pub delete_retry_secs: f64,
    /// Seconds after the first `DELETE` after which a server that is still
    /// listed is flagged as not going (log, `/status` `stuck_deletes`,
    /// `vq_pool_servers_stuck_deleting`).
    pub delete_timeout_secs: f64,
}

impl PoolConfig {
    /// The scale-down hysteresis in force, seconds:
    /// `scale_down_delay_secs`, or `idle_secs` when unset.
    pub fn scale_down_delay(&self) -> u64 {
        self.scale_down_delay_secs.unwrap_or(self.idle_secs)
    }
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
            max_walltime_secs: crate::config::DEFAULT_MAX_WALLTIME_SECS,
            memory_mb: None,
            boot_timeout_secs: 600,
            idle_secs: 300,
            cooldown_secs: 30,
            scale_down_delay_secs: None,
            min_lifetime_secs: 300,
            boot_backoff_base_secs: 30.0,
            boot_backoff_cap_secs: 600.0,
            breaker_failures: 5,
            breaker_open_secs: 1800.0,
            delete_retry_secs: 30.0,
            delete_timeout_secs: 600.0,
        }
    }
}

/// Where the controller gets OpenStack credentials: `clouds.yaml` (the
/// usual search path or `clouds_yaml`) entry `cloud`, else the `OS_*`
/// variables, as every OpenStack client does.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
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

/// Largest `min_lifetime_secs` and `scale_down_delay_secs`, seconds (30
/// days): more is refused as a unit mistake.
pub const MAX_SCALE_DOWN_HOLD_SECS: u64 = 30 * 86_400;

/// Longest cluster name: the controller tags its servers
/// `vq-cluster-<cluster>` and Nova's tags are at most 60 characters.
pub const MAX_CLUSTER_LEN: usize = 60 - "vq-cluster-".len();

/// Controller configuration (`/etc/vq/controller.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
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
    /// The job table (`[jobs]`).
    pub jobs: JobsSection,
}

/// `[jobs]`: the job table the controller builds from the event stream
/// and serves at `/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct JobsSection {
    /// Seconds an ended job stays in the table after its end (Torque's
    /// `keep_completed`; default 86400, one day). The event stream keeps
    /// events for its own retention (7 days) whatever this says.
    pub keep_completed_secs: f64,
    /// File holding the bearer token that `/jobs` requires (mode 0600, the
    /// token on its first line). Unset: `/jobs` is off (404).
    pub api_token_file: Option<String>,
    /// Torque's `query_other_jobs` for `vq stat` (queries over AMQP):
    /// `false` (Torque's default) shows a broker user only its own jobs
    /// (submitted by it, or owned by the Unix user of its name); `true`
    /// shows everybody every job. `/jobs` (token holders) always shows all.
    pub query_other_jobs: bool,
    /// Broker users that see every job in `vq stat` whatever
    /// `query_other_jobs` says (Torque's managers and operators).
    pub operators: Vec<String>,
    /// Seconds after its submission (`submitted_at`) that a held job may
    /// name a dependency the job table does not know before the controller
    /// cancels it (default 120): `vq submit` checks the ids when a
    /// controller answers, but a job submitted without that check, or
    /// whose dependency's own `queued` event has not reached the table
    /// yet, must not be cancelled at once.
    pub depend_grace_secs: u64,
}

impl Default for JobsSection {
    fn default() -> Self {
        JobsSection {
            keep_completed_secs: 86_400.0,
            api_token_file: None,
            query_other_jobs: false,
            operators: Vec::new(),
            depend_grace_secs: 120,
        }
    }
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
            jobs: JobsSection::default(),
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
        if self.cluster.len() > MAX_CLUSTER_LEN {
            p.push(format!(
                "cluster: {:?} is {} characters long, at most {MAX_CLUSTER_LEN}: the server tag vq-cluster-<cluster> must fit Nova's 60",
                self.cluster,
                self.cluster.len()
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
        if !(self.jobs.keep_completed_secs.is_finite() && self.jobs.keep_completed_secs >= 0.0) {
            p.push(format!(
                "jobs.keep_completed_secs: {} must be a number of seconds, 0 or more",
                self.jobs.keep_completed_secs
            ));
        }
        if self.jobs.api_token_file.as_deref() == Some("") {
            p.push("jobs.api_token_file: empty (leave it out to turn /jobs off)".into());
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
            if pool.max_walltime_secs == 0
                || pool.max_walltime_secs > crate::config::MAX_WALLTIME_LIMIT_SECS
            {
                p.push(format!(
                    "{k}.max_walltime_secs: {} is out of range 1..={} (10 years)",
                    pool.max_walltime_secs,
                    crate::config::MAX_WALLTIME_LIMIT_SECS
                ));
            }
            if pool.memory_mb == Some(0) {
                p.push(format!(
                    "{k}.memory_mb: 0 must be at least 1 (leave it out to check no memory at submit)"
                ));
            }
            if pool.boot_timeout_secs == 0 {
                p.push(format!("{k}.boot_timeout_secs: must be at least 1"));
            }
            let positive = |v: f64| v.is_finite() && v > 0.0;
            if !positive(pool.boot_backoff_base_secs)
                || !positive(pool.boot_backoff_cap_secs)
                || pool.boot_backoff_base_secs > pool.boot_backoff_cap_secs
            {
                p.push(format!(
                    "{k}: boot_backoff_base_secs {} and boot_backoff_cap_secs {} must be positive, the base at most the cap",
                    pool.boot_backoff_base_secs, pool.boot_backoff_cap_secs
                ));
            }
            // A scale-down hold of more than 30 days is a unit mistake
            // (milliseconds?): the pool would never shrink.
            for (key, v) in [
                ("min_lifetime_secs", Some(pool.min_lifetime_secs)),
                ("scale_down_delay_secs", pool.scale_down_delay_secs),
            ] {
                if let Some(v) = v.filter(|v| *v > MAX_SCALE_DOWN_HOLD_SECS) {
                    p.push(format!(
                        "{k}.{key}: {v} is more than 30 days ({MAX_SCALE_DOWN_HOLD_SECS} s): seconds, not milliseconds; 0 turns it off"
                    ));
                }
            }
            if pool.breaker_failures == 0 {
                p.push(format!("{k}.breaker_failures: must be at least 1"));
            }
            if !positive(pool.breaker_open_secs) {
                p.push(format!(
                    "{k}.breaker_open_secs: {} must be positive",
                    pool.breaker_open_secs
                ));
            }
            for (key, v) in [
                ("delete_retry_secs", pool.delete_retry_secs),
                ("delete_timeout_secs", pool.delete_timeout_secs),
            ] {
                if !positive(v) {
                    p.push(format!("{k}.{key}: {v} must be positive"));
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::*;

    #[test]
    fn a_cluster_name_whose_server_tag_exceeds_nova_s_60_is_refused() {
        let check = |cluster: &str| {
            let text = format!(
                "cluster = \"{cluster}\"\n[pools.cms]\nflavor = \"f\"\nimage = \"i\"\nagent_broker_url = \"amqp://h\"\n"
            );
            match parse::<ControllerConfig>("test", &text, toml::Table::new()) {
                Ok(_) => None,
                Err(ConfigError::Invalid { problems, .. }) => Some(problems.join("\n")),
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(check(&"c".repeat(49)), None, "49 characters fit");
        let err = check(&"c".repeat(50)).expect("50 characters are refused");
        assert!(err.contains("at most 49") && err.contains("60"), "{err}");
    }

    #[test]
    fn boot_breaker_settings_are_checked() {
        let check = |keys: &str| {
            let text = format!(
                "[pools.cms]\nflavor = \"f\"\nimage = \"i\"\nagent_broker_url = \"amqp://h\"\n{keys}\n"
            );
            match parse::<ControllerConfig>("test", &text, toml::Table::new()) {
                Ok(_) => None,
                Err(ConfigError::Invalid { problems, .. }) => Some(problems.join("\n")),
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(check(""), None);
        assert!(
            check("boot_backoff_base_secs = 700.0").is_some(),
            "base above the cap"
        );
        assert!(check("breaker_failures = 0").is_some());
        assert!(check("breaker_open_secs = 0.0").is_some());
        assert!(check("delete_retry_secs = 0.0").is_some());
        assert!(check("delete_timeout_secs = -1.0").is_some());
    }

    #[test]
    fn pool_limits_default_to_the_agents_and_bad_ones_are_all_listed() {
        let check = |keys: &str| {
            let text = format!(
                "[pools.cms]\nflavor = \"f\"\nimage = \"i\"\nagent_broker_url = \"amqp://h\"\n{keys}\n"
            );
            match parse::<ControllerConfig>("test", &text, toml::Table::new()) {
                Ok(c) => Ok(c.pools["cms"].clone()),
                Err(ConfigError::Invalid { problems, .. }) => Err(problems.join("\n")),
                Err(e) => panic!("{e}"),
            }
        };
        let pool = check("").unwrap();
        assert_eq!(
            (pool.max_walltime_secs, pool.memory_mb),
            (AgentConfig::default().max_walltime_secs, None),
            "the agents' default of 31 days, no memory check"
        );
        let pool = check("max_walltime_secs = 86400\nmemory_mb = 4096").unwrap();
        assert_eq!(
            (pool.max_walltime_secs, pool.memory_mb),
            (86_400, Some(4096))
        );
        let err = check("max_walltime_secs = 0\nmemory_mb = 0\nslots = 0").unwrap_err();
        for needle in [
            "pools.cms.max_walltime_secs: 0 is out of range 1..=316224000",
            "pools.cms.memory_mb: 0 must be at least 1",
            "pools.cms.slots: 0 is out of range",
        ] {
            assert!(err.contains(needle), "{needle} not in:\n{err}");
        }
        let err = check("max_walltime_secs = 316224001").unwrap_err();
        assert!(err.contains("max_walltime_secs: 316224001"), "{err}");
        let err = check("memory_mb = -1").unwrap_err();
        assert!(err.contains("pools.cms.memory_mb"), "{err}");
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
}
