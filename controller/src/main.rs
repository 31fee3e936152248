//! `vq-controller`: arguments, configuration, runtime, signals, exit codes.
//! The logic lives in the library (`vq_controller::run`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use vq_common::config::{load_checked, ControllerConfig, EXIT_CONFIG};
use vq_common::error::chain;
use vq_common::ConfigError;
use vq_controller::openstack::Credentials;
use vq_controller::reconcile::{run, RunOptions, SHUTDOWN_GRACE};

/// Reconciles RabbitMQ demand with OpenStack servers for vq pools.
#[derive(Debug, Parser)]
#[command(name = "vq-controller", version = VERSION, about)]
struct Args {
    /// Config file (TOML; `VQ_*` environment variables override keys).
    #[arg(long, default_value = "/etc/vq/controller.toml")]
    config: PathBuf,
    /// Validate the configuration and exit (0 if valid, 64 if not).
    #[arg(long)]
    check_config: bool,
    /// With --check-config: also check the configuration against the cloud
    /// and the broker (log in to Keystone, compute microversion, every
    /// pool's flavor, image, network, key pair and security groups, quota;
    /// the broker account's declares and publish), changing nothing. Every
    /// problem is printed on stderr with its config key (one JSON object
    /// per problem with --log-format json); exit 64 if there is any.
    #[arg(long, requires = "check_config")]
    online: bool,
    /// Run one reconcile cycle and exit.
    #[arg(long)]
    once: bool,
    /// Observe and plan, log what would be done (boots, drain asks,
    /// deletes, with their reasons: "dry run: would …"), and do nothing
    /// that changes the cloud or the agents (no create, delete, control
    /// message, fence). Combine with `--once` for a single plan.
    #[arg(long)]
    dry_run: bool,
    /// Seconds the controller may take to stop after the first SIGTERM or
    /// SIGINT (finish the cycle in flight without acting, close the broker
    /// connection); then it exits anyway. A second signal exits at once.
    #[arg(long, value_name = "SECS", default_value_t = SHUTDOWN_GRACE.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    shutdown_grace_secs: u64,
    /// Log format on stderr: `text` (default) or `json` (one object per
    /// line, fields such as pool and server ids as JSON keys).
    #[arg(long, value_name = "FORMAT", default_value_t = vq_common::logging::LogFormat::Text)]
    log_format: vq_common::logging::LogFormat,
    /// Packaging: write the man page `vq-controller.8` into DIR and exit.
    #[arg(long, hide = true, value_name = "DIR")]
    generate_man: Option<PathBuf>,
    /// Packaging: print the completion script for SHELL and exit.
    #[arg(long, hide = true, value_name = "SHELL")]
    completions: Option<clap_complete::Shell>,
    /// Setup: print the broker permissions of ROLE (submitter, controller,
    /// agent, inspector) in CLUSTER, one regex per line (configure, write,
    /// read), and exit. README.md, scripts/demo.sh and the tests use this
    /// one rule (`vq_common::topology::Permissions`).
    #[arg(long, hide = true, num_args = 2, value_names = ["ROLE", "CLUSTER"])]
    print_permissions: Option<Vec<String>>,
}

/// `--print-permissions ROLE CLUSTER`: the three regexes, one per line.
fn print_permissions(args: &[String]) -> ExitCode {
    use vq_common::topology::{valid_name, Permissions, Role};
    let [role, cluster] = args else {
        eprintln!("vq-controller: --print-permissions takes ROLE and CLUSTER");
        return ExitCode::from(EXIT_CONFIG as u8);
    };
    let role: Role = match role.parse() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vq-controller: --print-permissions: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    if !valid_name(cluster) {
        eprintln!("vq-controller: --print-permissions: invalid cluster name {cluster:?} (1-64 of a-z A-Z 0-9 _ -)");
        return ExitCode::from(EXIT_CONFIG as u8);
    }
    let p = Permissions::for_role(role, cluster);
    println!("{}\n{}\n{}", p.configure, p.write, p.read);
    ExitCode::SUCCESS
}

/// `--version`: the package version and the git commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("VQ_GIT_COMMIT"),
    ")"
);

/// `--generate-man DIR` / `--completions SHELL`, rendered from this CLI so
/// they never drift from it.
fn packaging_output(args: &Args) -> Option<ExitCode> {
    use clap::CommandFactory;
    if let Some(shell) = args.completions {
        clap_complete::generate(
            shell,
            &mut Args::command(),
            "vq-controller",
            &mut std::io::stdout(),
        );
        return Some(ExitCode::SUCCESS);
    }
    let dir = args.generate_man.as_ref()?;
    let path = dir.join("vq-controller.8");
    let mut page = Vec::new();
    let written = clap_mangen::Man::new(Args::command())
        .section("8")
        .render(&mut page)
        .and_then(|()| std::fs::write(&path, page));
    Some(match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vq-controller: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(code) = packaging_output(&args) {
        return code;
    }
    if let Some(pp) = &args.print_permissions {
        return print_permissions(pp);
    }
    vq_common::logging::init(args.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();

    let json = args.log_format == vq_common::logging::LogFormat::Json;
    let (cfg, creds) = match load_config(&args.config, &|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(ConfigError::Invalid { origin, problems }) if json && args.check_config => {
            for p in &problems {
                let (key, message) = p.split_once(": ").unwrap_or(("", p));
                print_problem(true, &origin, key, message);
            }
            return ExitCode::from(EXIT_CONFIG as u8);
        }
        Err(e) => {
            eprintln!("vq-controller: {}", chain(&e));
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    if args.online {
        return check_online(&args, &cfg, creds);
    }
    if args.check_config {
        println!(
            "{}: valid ({} pool(s): {}; OpenStack credentials from {})",
            args.config.display(),
            cfg.pools.len(),
            cfg.pools.keys().cloned().collect::<Vec<_>>().join(", "),
            creds.origin
        );
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vq-controller: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let opts = RunOptions {
        once: args.once,
        shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
        dry_run: args.dry_run,
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(watch_signals(shutdown.clone(), opts.shutdown_grace));
        run(cfg, creds, opts, shutdown).await
    });
    // `run` has kept the shutdown deadline; a blocking call still running
    // (a DNS lookup) must not hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => {
            tracing::info!("vq-controller stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %chain(&e), "vq-controller failed");
            ExitCode::FAILURE
        }
    }
}

/// One problem of `origin` on stderr: `vq-controller: <origin>: <key>:
/// <message>`, or with `json` one object `{"config", "key", "message"}`.
fn print_problem(json: bool, origin: &str, key: &str, message: &str) {
    if json {
        eprintln!(
            "{}",
            serde_json::json!({ "config": origin, "key": key, "message": message })
        );
    } else if key.is_empty() {
        eprintln!("vq-controller: {origin}: {message}");
    } else {
        eprintln!("vq-controller: {origin}: {key}: {message}");
    }
}

/// `--check-config --online`: [`vq_controller::preflight`] against the
/// cloud and the broker; every problem printed, exit 64 if any.
fn check_online(args: &Args, cfg: &ControllerConfig, creds: Credentials) -> ExitCode {
    use vq_controller::preflight::{check_broker, check_cloud, Problem};
    let json = args.log_format == vq_common::logging::LogFormat::Json;
    let origin = args.config.display().to_string();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vq-controller: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let problems: Vec<Problem> = runtime.block_on(async {
        let microversion = match cfg.openstack.compute_microversion.as_deref() {
            None => Ok(None),
            Some(s) => vq_common::config::Microversion::parse(s).map(Some).ok_or(s),
        };
        let mut problems = match microversion {
            Err(s) => vec![Problem {
                key: "openstack.compute_microversion".into(),
                message: format!("{s:?} is not a microversion"),
            }],
            Ok(mv) => match vq_controller::openstack::HttpCloud::new(creds, mv) {
                Ok(cloud) => check_cloud(cfg, &cloud).await,
                Err(e) => vec![Problem {
                    key: "openstack".into(),
                    message: chain(&e),
                }],
            },
        };
        problems.extend(check_broker(cfg).await);
        problems
    });
    for p in &problems {
        print_problem(json, &origin, &p.key, &p.message);
    }
    if problems.is_empty() {
        println!(
            "{origin}: valid and matches the cloud and the broker ({} pool(s): {})",
            cfg.pools.len(),
            cfg.pools.keys().cloned().collect::<Vec<_>>().join(", "),
        );
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CONFIG as u8)
    }
}

/// The configuration round, before anything connects: the config file at
/// `path` with its `VQ_CONTROLLER__*` overrides (every unknown key, value
/// of the wrong type and bad value, the broker's TLS files) and the
/// OpenStack credentials its `[openstack]` section names (clouds.yaml or
/// `OS_*` read through `env`, password or application credential, and
/// their TLS files `cacert`, `cert`, `key`, read and parsed), all checked
/// in one go.
///
/// # Errors
/// [`ConfigError::Invalid`] listing every problem; credentials problems
/// start with `openstack:`. Credentials are not looked for when the keys
/// that choose them (`openstack.cloud`, `openstack.clouds_yaml`) are
/// themselves wrong.
fn load_config(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(ControllerConfig, Credentials), ConfigError> {
    let origin = path.display().to_string();
    let (cfg, mut problems) = match load_checked::<ControllerConfig>(path) {
        Ok(c) => (c.config, c.problems),
        Err(ConfigError::Invalid { problems, .. }) => (ControllerConfig::default(), problems),
        Err(e) => (ControllerConfig::default(), vec![chain(&e)]),
    };
    let mut creds = None;
    if !problems.iter().any(|p| p.starts_with("openstack.cloud")) {
        match Credentials::discover(&cfg.openstack, env) {
            Ok(c) => {
                if let Err(tls) = c.tls.load() {
                    problems.extend(tls.into_iter().map(|p| format!("openstack: {p}")));
                }
                creds = Some(c);
            }
            Err(e) => problems.push(format!("openstack: no usable credentials: {}", chain(&e))),
        }
    }
    match creds {
        Some(c) if problems.is_empty() => Ok((cfg, c)),
        _ => Err(ConfigError::Invalid { origin, problems }),
    }
}

/// First SIGTERM/SIGINT: cancel `shutdown` (finish the current cycle, act
/// no more; [`run`] keeps the one deadline, `grace`). Second signal: exit at
/// once.
async fn watch_signals(shutdown: CancellationToken, grace: Duration) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    let first = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(
        signal = first,
        grace_secs = grace.as_secs_f64(),
        "shutting down gracefully: finishing the current cycle, acting no more; a second signal exits at once"
    );
    shutdown.cancel();
    let second = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::warn!(signal = second, "second signal: exiting at once");
    std::process::exit(130);
}
