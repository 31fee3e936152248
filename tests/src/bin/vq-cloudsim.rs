//! `vq-cloudsim`: the embedded OpenStack-compatible test cloud as a process.
//!
//! Prints `READY http://ADDR` (`https://` with `--tls-cert`) on stdout once it serves and `clouds.yaml` is
//! written; logs to stderr; SIGTERM or SIGINT stops every VM and exits 0.
//! Each VM runs in a cgroup v2 of its own, `vq-cloudsim/<server id>` below
//! the cgroup this process runs in (root needed), so deleting a server
//! kills every process of it; without one it warns and kills the agent's
//! process tree only.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use vq_tests::cloudsim::{Sim, SimConfig, SimTls};

/// An OpenStack-compatible test cloud (Keystone v3, Nova v2.1, Glance v2)
/// whose servers run a local jobagent.
#[derive(Debug, Parser)]
#[command(name = "vq-cloudsim", version)]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Directory for clouds.yaml and vms/<server-id>/.
    #[arg(long)]
    state_dir: PathBuf,
    /// The jobagent binary each booted server runs.
    #[arg(long)]
    agent_bin: PathBuf,
    /// Agent configuration file passed to the agent as --config.
    #[arg(long)]
    agent_config: PathBuf,
    /// Seconds a new server stays in BUILD.
    #[arg(long, default_value_t = 1.0)]
    boot_delay_secs: f64,
    /// Seconds a deleted server stays visible with task_state deleting.
    #[arg(long, default_value_t = 0.5)]
    delete_delay_secs: f64,
    /// Instance quota of the project.
    #[arg(long, default_value_t = 10)]
    quota_instances: u32,
    /// Core quota of the project.
    #[arg(long, default_value_t = 20)]
    quota_cores: u32,
    /// RAM quota of the project, MiB.
    #[arg(long, default_value_t = 51200)]
    quota_ram_mb: u32,
    /// Token lifetime in seconds.
    #[arg(long, default_value_t = 3600)]
    token_ttl_secs: u64,
    /// Keystone user (domain Default).
    #[arg(long, default_value = "demo")]
    user: String,
    /// The user's password.
    #[arg(long, default_value = "demo-secret")]
    password: String,
    /// The user's project (domain Default).
    #[arg(long, default_value = "demo")]
    project: String,
    /// Application credential id accepted for the project.
    #[arg(long, requires = "app_cred_secret")]
    app_cred_id: Option<String>,
    /// Secret of the application credential.
    #[arg(long, requires = "app_cred_id")]
    app_cred_secret: Option<String>,
    /// Highest compute microversion served is 2.<this> (an older Nova).
    #[arg(long, default_value_t = vq_tests::cloudsim::MAX_COMPUTE_MINOR)]
    compute_max_minor: u32,
    /// Serve HTTPS with this PEM certificate (chain), with --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

fn seconds(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .with_context(|| format!("--{name} must be a non-negative number of seconds"))
}

fn absolute(p: PathBuf) -> anyhow::Result<PathBuf> {
    std::path::absolute(&p).with_context(|| format!("cannot resolve {}", p.display()))
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "vq-cloudsim failed");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let config = SimConfig {
        listen: args.listen,
        state_dir: absolute(args.state_dir)?,
        agent_bin: absolute(args.agent_bin)?,
        agent_config: absolute(args.agent_config)?,
        boot_delay: seconds("boot-delay-secs", args.boot_delay_secs)?,
        delete_delay: seconds("delete-delay-secs", args.delete_delay_secs)?,
        quota_instances: args.quota_instances,
        quota_cores: args.quota_cores,
        quota_ram_mb: args.quota_ram_mb,
        token_ttl: Duration::from_secs(args.token_ttl_secs),
        user: args.user,
        password: args.password,
        project: args.project,
        app_cred: args.app_cred_id.zip(args.app_cred_secret),
        app_cred_expires_at: None,
        compute_max_minor: args.compute_max_minor,
        tls: args
            .tls_cert
            .zip(args.tls_key)
            .map(|(cert, key)| SimTls { cert, key }),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot build the tokio runtime")?;
    runtime.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot install the SIGTERM handler")?;
        let sim = Sim::start(config).await.context("cannot start the cloud")?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {}", sim.base_url()).context("cannot write to stdout")?;
            out.flush().context("cannot flush stdout")?;
        }
        let signal = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
        };
        tracing::info!(signal, "stopping: powering off every VM");
        sim.shutdown().await;
        Ok(())
    })
}
