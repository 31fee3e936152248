//! `jobagent`: args, config, root check, runtime, signals, exit codes. The
//! logic is in the `vq_jobagent` library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, warn};
use vq_common::config::EXIT_CONFIG;
use vq_common::error::chain;
use vq_common::logging::LogFormat;
use vq_jobagent::settings::{identity_path, load_settings, DEFAULT_CONFIG};
use vq_jobagent::{run, Ended, Shutdown, EXIT_NOPERM};

/// vq jobagent: pulls batch jobs of its pool from RabbitMQ and runs them as
/// their owners.
#[derive(Debug, Parser)]
#[command(name = "jobagent", version = VERSION)]
struct Args {
    /// Config file (TOML; `VQ_*` environment variables override keys).
    #[arg(long, default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// Identity file written by cloud-init (pool, agent_id, broker_url);
    /// default /etc/vq/identity.toml if it exists.
    #[arg(long)]
    identity: Option<PathBuf>,
    /// State directory (overrides `state_dir`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Validate the configuration and exit (0 valid, 64 invalid).
    #[arg(long)]
    check_config: bool,
    /// Seconds running jobs may take to finish after the first SIGTERM.
    #[arg(long, default_value_t = 60)]
    drain_grace_secs: u64,
    /// Log format on stderr: `text` (default) or `json` (one object per
    /// line; a job's lines carry pool, agent and job_id in `span`).
    #[arg(long, value_name = "FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Packaging: write the man page `jobagent.8` into DIR and exit.
    #[arg(long, hide = true, value_name = "DIR")]
    generate_man: Option<PathBuf>,
}

/// `--version`: the package version and the git commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("VQ_GIT_COMMIT"),
    ")"
);

/// Writes `jobagent.8` (from this CLI, so it never drifts) into `dir`.
fn generate_man(dir: &std::path::Path) -> ExitCode {
    use clap::CommandFactory;
    let path = dir.join("jobagent.8");
    let mut page = Vec::new();
    let written = clap_mangen::Man::new(Args::command())
        .section("8")
        .render(&mut page)
        .and_then(|()| std::fs::write(&path, page));
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("jobagent: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    vq_common::logging::init(args.log_format);
    let json = args.log_format == LogFormat::Json;
    if let Some(dir) = &args.generate_man {
        return generate_man(dir);
    }
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cfg = match load_settings(
        &args.config,
        identity_path(args.identity.clone()).as_deref(),
        args.state_dir.as_deref(),
        std::env::vars(),
        &hostname,
    ) {
        Ok(cfg) => cfg,
        Err(e) => {
            if json {
                // Every stderr line a log collector reads must be JSON.
                error!(error = %chain(&e), "invalid configuration");
            } else {
                eprintln!("jobagent: {}", chain(&e));
            }
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    if args.check_config {
        println!(
            "configuration OK: pool {} agent {} cluster {}",
            cfg.pool, cfg.agent_id, cfg.cluster
        );
        return ExitCode::SUCCESS;
    }
    if !nix::unistd::geteuid().is_root() {
        let uid = nix::unistd::geteuid();
        if json {
            error!(
                uid = uid.as_raw(),
                "must run as root (it switches to each job's owner)"
            );
        } else {
            eprintln!(
                "jobagent: must run as root (it switches to each job's owner); effective uid is {uid}"
            );
        }
        return ExitCode::from(EXIT_NOPERM as u8);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let shutdown = Shutdown::default();
        if let Err(e) = watch_signals(shutdown.clone()) {
            return Err(anyhow::anyhow!("cannot install signal handlers: {e}"));
        }
        run(cfg, shutdown, Duration::from_secs(args.drain_grace_secs))
            .await
            .map_err(anyhow::Error::from)
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(Ended::Drained) => ExitCode::SUCCESS,
        Ok(Ended::Forced) => ExitCode::from(1),
        Err(e) => {
            error!(error = format!("{e:#}"), "jobagent failed");
            ExitCode::FAILURE
        }
    }
}

/// First SIGTERM/SIGINT → drain; second → force.
fn watch_signals(shutdown: Shutdown) -> std::io::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let mut count = 0;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            count += 1;
            if count == 1 {
                warn!(signal = name, "shutdown requested: draining");
                shutdown.drain.cancel();
            } else {
                warn!(signal = name, "second signal: exiting now");
                shutdown.force.cancel();
            }
        }
    });
    Ok(())
}
