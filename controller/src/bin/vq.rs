//! `vq`: the user/admin CLI of a vq cluster (see `vq_controller::cli`).
//!
//! Thin: install the TLS provider, parse arguments, run the command on a
//! single-threaded runtime, print errors with their causes, map them to exit
//! codes (0 ok, 64 usage/bad input, 69 broker or controller unavailable,
//! 1 other; `submit --wait` exits with the job's status).

use std::process::ExitCode;

use clap::Parser;
use vq_controller::cli::{self, error::EXIT_OTHER, error::EXIT_USAGE, Cli};

fn main() -> ExitCode {
    // reqwest and lapin use rustls; select ring before any TLS is set up.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(EXIT_USAGE as u8)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VQ_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();

    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vq: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_OTHER as u8);
        }
    };
    let result = runtime.block_on(cli::run(cli));
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            let mut msg = format!("vq: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            eprintln!("{msg}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
