//! `vq-cli`: the `vq` user/admin CLI: `submit`, `stat`, `cancel`, `pools`,
//! `nodes`, `drain`, `resume`.
//!
//! `vq submit` takes `qsub`'s options and `#PBS` directives, so Torque job
//! scripts run unchanged. Exit codes: 0 success, 64 bad usage or input, 69
//! broker, controller or an agent's answer unavailable, 77 refused by an
//! agent, 1 any other failure; `vq submit --wait` exits with the job's
//! status.
//!
//! The binary (`src/main.rs`) only parses arguments and maps errors to
//! exit codes; everything else is here so tests can call it: [`submit`]
//! (building and publishing a job), [`limits`] (checking it against its
//! pool's published limits first), [`events`] (reading and following job
//! events), [`stat`], [`control`] (cancel, drain, resume), [`pools`],
//! [`nodes`], [`settings`]
//! (where to connect), [`term`] (the invoking user, terminal-safe text),
//! [`usage`] (unknown options in words) and [`error`] (every error and its
//! exit code).

pub mod control;
pub mod error;
pub mod events;
pub mod limits;
pub mod nodes;
pub mod pools;
pub mod reply;
pub mod settings;
pub mod stat;
pub mod submit;
pub mod term;
pub mod usage;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use vq_common::pbs::{Directives, PbsError};

pub use error::CliError;
use settings::{Overrides, Settings};

/// The log filter of `vq` when `VQ_LOG` is unset (tracing-subscriber
/// `EnvFilter` syntax): warnings of vq's own crates only. Libraries' log
/// lines (lapin's "Server returned us a message …" with the whole job as a
/// byte array, its "Connection error … Closing" when a command closes its
/// connection) are not messages to a user: every failure they stand for
/// reaches `vq` as an error and is said once, in words. `VQ_LOG=lapin=debug`
/// (any `EnvFilter`) shows them again.
pub const DEFAULT_LOG_FILTER: &str = "off,vq=warn,vq_cli=warn,vq_common=warn";

/// `vq`: submit and inspect batch jobs on a vq cluster.
#[derive(Debug, Parser)]
#[command(name = "vq", version, about, long_about = None)]
pub struct Cli {
    /// Connection options.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// AMQP URI of the broker [default: amqp://guest:guest@127.0.0.1:5672/%2f].
    /// It holds a password: prefer VQ_BROKER_URL or the config file.
    #[arg(long, env = "VQ_BROKER_URL", global = true, hide_env_values = true)]
    pub broker_url: Option<String>,
    /// Cluster name, the prefix of every queue and exchange [default: vq].
    #[arg(long, env = "VQ_CLUSTER", global = true)]
    pub cluster: Option<String>,
    /// Base URL of the controller's HTTP server [default: http://127.0.0.1:9180].
    #[arg(long = "controller", env = "VQ_CONTROLLER_URL", global = true)]
    pub controller_url: Option<String>,
    /// TOML file with broker_url, cluster, controller_url, broker_ca_file
    /// [default: ~/.config/vq/vq.toml if it exists].
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
}

/// `vq` commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit a job script (qsub options and #PBS directives); prints the job id.
    /// A job asking more than its pool's limits (walltime, slots, memory per VM,
    /// as the controller publishes them) is refused, exit 64.
    Submit(Box<SubmitArgs>),
    /// Show jobs (from the controller's job table), like qstat.
    Stat(StatArgs),
    /// Cancel a queued or running job (its owner, its submitter or an operator), like qdel;
    /// prints the controller's or the agent's answer.
    Cancel {
        /// Job id, or a unique prefix of it.
        job_id: String,
        /// Seconds to wait for the controller's answer, and then for the agent's.
        #[arg(long, value_name = "SECS", default_value_t = 10.0)]
        timeout: f64,
    },
    /// Show pools: queued and running jobs, VMs and agents (from the controller).
    Pools {
        /// Also each pool's VMs (as vq nodes), its obstacle and drain reasons.
        #[arg(short = 'v', long = "verbose")]
        verbose: bool,
    },
    /// Show every VM of the cluster (like pbsnodes): pool, Nova status, agent
    /// state, jobs, age, last heartbeat, drain reason (from the controller).
    Nodes {
        /// Only this pool's VMs.
        pool: Option<String>,
        /// The servers as JSON (the controller's /status entries, with their pool).
        #[arg(long = "json")]
        json: bool,
    },
    /// Admin: ask an agent to stop taking jobs and finish the running ones
    /// (like pbsnodes -o); prints the agent's answer.
    Drain(ToggleArgs),
    /// Admin: a draining agent takes jobs again (like pbsnodes -c); refused
    /// once it agreed to be deleted.
    Resume(ToggleArgs),
}

/// `vq drain` and `vq resume` options.
#[derive(Debug, Clone, Args)]
pub struct ToggleArgs {
    /// Agent id (the VM's server name).
    pub agent: String,
    /// Why (at most 256 bytes, one line): logged by the agent and shown on
    /// the controller's /status while the agent drains.
    #[arg(long = "reason", value_name = "TEXT")]
    pub reason: Option<String>,
    /// Seconds to wait for the agent's answer.
    #[arg(long = "timeout", value_name = "SECS", default_value_t = control::ANSWER_TIMEOUT.as_secs_f64())]
    pub timeout: f64,
}

/// `vq submit` options; they override the script's `#PBS` directives.
#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    /// Job name.
    #[arg(short = 'N', value_name = "NAME")]
    pub name: Option<String>,
    /// Pool (queue) [default: the script's #PBS -q, else "default"].
    #[arg(short = 'q', value_name = "POOL")]
    pub queue: Option<String>,
    /// Stdout file (relative to the current directory).
    #[arg(short = 'o', value_name = "PATH")]
    pub stdout: Option<String>,
    /// Stderr file (relative to the current directory).
    #[arg(short = 'e', value_name = "PATH")]
    pub stderr: Option<String>,
    /// Join stdout and stderr: oe, eo or n.
    #[arg(short = 'j', value_name = "oe|eo|n")]
    pub join: Option<String>,
    /// Resources, e.g. walltime=01:00:00,nodes=1:ppn=4,mem=4gb (enforced: walltime,
    /// nodes=1:ppn, ncpus, mem, select=1:ncpus:mem; others are kept with a warning).
    #[arg(short = 'l', value_name = "RES=VAL[,..]")]
    pub resources: Vec<String>,
    /// Variables to export: VAR[=value][,..]; without a value, from this environment.
    #[arg(short = 'v', value_name = "VARS")]
    pub vars: Vec<String>,
    /// Export the whole current environment (except VQ_* and broker secrets).
    #[arg(short = 'V')]
    pub export_all: bool,
    /// Working directory of the job [default: the current directory].
    #[arg(short = 'd', value_name = "DIR")]
    pub workdir: Option<String>,
    /// Shell (absolute path) [default: the owner's login shell].
    #[arg(short = 'S', value_name = "SHELL")]
    pub shell: Option<String>,
    /// Rerunnable after a node loss: y or n [default: y].
    #[arg(short = 'r', value_name = "y|n")]
    pub rerunnable: Option<String>,
    /// Attributes: umask=022, group_list=GROUP, depend=afterok:ID[:ID...]
    /// (also afternotok, afterany; several types separated by commas).
    #[arg(short = 'W', value_name = "ATTR=VAL[,..]")]
    pub attributes: Vec<String>,
    /// Mail options (accepted and ignored: vq sends no mail).
    #[arg(short = 'm', value_name = "abe", hide = true)]
    pub mail_events: Option<String>,
    /// Mail users (accepted and ignored).
    #[arg(short = 'M', value_name = "USERS", hide = true)]
    pub mail_users: Option<String>,
    /// Account (accepted and ignored).
    #[arg(short = 'A', value_name = "ACCOUNT", hide = true)]
    pub account: Option<String>,
    /// Wait for the job to end and exit with its exit status.
    #[arg(long)]
    pub wait: bool,
    /// The job script, or - for stdin.
    pub script: String,
}

impl SubmitArgs {
    /// The options as [`Directives`], parsed with the same rules as `#PBS`
    /// lines.
    ///
    /// # Errors
    /// [`PbsError`] for an invalid value.
    pub fn directives(&self) -> Result<Directives, PbsError> {
        let mut d = Directives::default();
        let single = [
            ('N', &self.name),
            ('q', &self.queue),
            ('o', &self.stdout),
            ('e', &self.stderr),
            ('j', &self.join),
            ('d', &self.workdir),
            ('S', &self.shell),
            ('r', &self.rerunnable),
            ('m', &self.mail_events),
            ('M', &self.mail_users),
            ('A', &self.account),
        ];
        for (opt, value) in single {
            if let Some(v) = value {
                d.apply_option(opt, Some(v), None)?;
            }
        }
        for (opt, values) in [
            ('l', &self.resources),
            ('v', &self.vars),
            ('W', &self.attributes),
        ] {
            for v in values {
                d.apply_option(opt, Some(v), None)?;
            }
        }
        if self.export_all {
            d.apply_option('V', None, None)?;
        }
        Ok(d)
    }
}

/// `vq stat` options (Torque's `qstat`).
#[derive(Debug, Clone, Args)]
pub struct StatArgs {
    /// Show every user's jobs (those the controller lets you see: its
    /// `[jobs] query_other_jobs` or `operators`).
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// Only jobs owned by USER.
    #[arg(short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// Only jobs in these states: letters of Q R C F X, e.g. `Q,R`.
    #[arg(long = "state", value_name = "STATES")]
    pub state: Option<String>,
    /// Only jobs of this pool (Torque's queue, `vq submit -q`).
    #[arg(long = "pool", value_name = "POOL")]
    pub pool: Option<String>,
    /// Show each job's comment (why it failed) below its line, as `qstat -s`.
    #[arg(short = 's', conflicts_with_all = ["full", "json"])]
    pub comments: bool,
    /// Full records, as `qstat -f`.
    #[arg(short = 'f', long = "full", conflicts_with = "json")]
    pub full: bool,
    /// The records as JSON.
    #[arg(long = "json")]
    pub json: bool,
    /// Read the whole job-event stream instead of asking the controller
    /// (slow: seconds per 10,000 jobs).
    #[arg(long = "from-stream")]
    pub from_stream: bool,
    /// Seconds to wait for the controller's answer.
    #[arg(long = "timeout", value_name = "SECS", default_value_t = 10.0)]
    pub timeout: f64,
    /// Jobs to show (ids or unique prefixes).
    pub job_ids: Vec<String>,
}

/// Resolves settings from the flags/environment in `global`, the config
/// file, and the defaults.
///
/// # Errors
/// [`CliError::Config`] or [`CliError::Read`].
pub fn resolve_settings(global: &GlobalArgs) -> Result<Settings, CliError> {
    let xdg = std::env::var("XDG_CONFIG_HOME").ok();
    let home = std::env::var("HOME").ok();
    let default_path = settings::default_config_path(xdg.as_deref(), home.as_deref());
    let (file, origin) = settings::load_file(global.config.as_deref(), default_path)?;
    Settings::resolve(
        Overrides {
            broker_url: global.broker_url.clone(),
            cluster: global.cluster.clone(),
            controller_url: global.controller_url.clone(),
        },
        file,
        origin.as_deref(),
    )
}

/// Runs one `vq` command; returns the process exit code.
///
/// # Errors
/// [`CliError`]; its [`CliError::exit_code`] is the process exit code.
pub async fn run(cli: Cli) -> Result<i32, CliError> {
    let settings = resolve_settings(&cli.global)?;
    match cli.command {
        Command::Submit(args) => {
            let flags = args.directives().map_err(CliError::Option)?;
            submit::run(&settings, &args.script, flags, args.wait).await
        }
        Command::Stat(args) => {
            let states = match args.state.as_deref() {
                Some(s) => stat::parse_states(s)?,
                None => Vec::new(),
            };
            let timeout = control::check_timeout(args.timeout)?;
            let layout = if args.json {
                stat::Layout::Json
            } else if args.full {
                stat::Layout::Full
            } else if args.comments {
                stat::Layout::TableWithComments
            } else {
                stat::Layout::Table
            };
            let opts = stat::StatRun {
                request: stat::StatRequest {
                    all: args.all,
                    user: args.user,
                    states,
                    pool: args.pool,
                    job_ids: args.job_ids,
                },
                layout,
                from_stream: args.from_stream,
                timeout: Some(timeout),
            };
            stat::run(&settings, opts).await
        }
        Command::Cancel { job_id, timeout } => {
            control::run_cancel(&settings, &job_id, control::check_timeout(timeout)?).await
        }
        Command::Pools { verbose } => pools::run(&settings, verbose).await,
        Command::Nodes { pool, json } => nodes::run(&settings, pool.as_deref(), json).await,
        Command::Drain(a) => toggle(&settings, control::Toggle::Drain, a).await,
        Command::Resume(a) => toggle(&settings, control::Toggle::Resume, a).await,
    }
}

async fn toggle(
    settings: &Settings,
    which: control::Toggle,
    a: ToggleArgs,
) -> Result<i32, CliError> {
    let timeout = control::check_timeout(a.timeout)?;
    control::run_drain_or_resume(settings, which, &a.agent, a.reason.as_deref(), timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qsub_style_options_parse_into_directives() {
        let cli = Cli::try_parse_from([
            "vq",
            "--cluster",
            "c1",
            "submit",
            "-N",
            "x",
            "-q",
            "cms",
            "-l",
            "walltime=1:00",
            "-l",
            "mem=1gb",
            "-v",
            "A=1",
            "-V",
            "-j",
            "oe",
            "-r",
            "n",
            "-W",
            "umask=077",
            "--wait",
            "job.sh",
        ])
        .unwrap();
        assert_eq!(cli.global.cluster.as_deref(), Some("c1"));
        let Command::Submit(args) = cli.command else {
            panic!("not submit")
        };
        assert!(args.wait);
        assert_eq!(args.script, "job.sh");
        let d = args.directives().unwrap();
        assert_eq!(d.name.as_deref(), Some("x"));
        assert_eq!(d.walltime, Some(60));
        assert!(d.export_all);
        assert_eq!(d.rerunnable, Some(false));
        assert_eq!(d.umask, Some(0o77));
        assert_eq!(d.mem, Some(1 << 30));
    }

    #[test]
    fn bad_option_values_are_refused_like_directives() {
        let cli = Cli::try_parse_from(["vq", "submit", "-l", "walltime=xx", "-"]).unwrap();
        let Command::Submit(args) = cli.command else {
            panic!("not submit")
        };
        assert!(matches!(args.directives(), Err(PbsError::Walltime { .. })));
    }

    #[test]
    fn global_options_may_follow_the_command() {
        let cli = Cli::try_parse_from(["vq", "stat", "-a", "--cluster", "c2", "j1"]).unwrap();
        assert_eq!(cli.global.cluster.as_deref(), Some("c2"));
        let Command::Stat(a) = cli.command else {
            panic!("not stat")
        };
        assert!(a.all);
        assert_eq!(a.job_ids, ["j1"]);
    }
}
