//! `vq`: the user/admin CLI of a vq cluster (see the `vq_cli` library).
//!
//! Thin: install the TLS provider, parse arguments, run the command on a
//! single-threaded runtime, print errors with their causes, map them to exit
//! codes (0 ok, 64 usage/bad input, 69 broker or controller unavailable,
//! 1 other; `submit --wait` exits with the job's status).

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use vq_cli::{self as cli, error::EXIT_OTHER, error::EXIT_USAGE, Cli};

/// `--version`: the package version and the git commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("VQ_GIT_COMMIT"),
    ")"
);

/// Packaging hooks, hidden and only as the first argument (the CLI requires
/// a subcommand, so they cannot be ordinary flags): `vq --completions SHELL`
/// prints a completion script, `vq --generate-man DIR` writes `vq.1` and a
/// `vq-<command>.1` per command. Both are rendered from the CLI definition.
fn packaging_output() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    let flag = args.next()?;
    let value = args.next();
    let cmd = || Cli::command().version(VERSION);
    let result = match (flag.to_str()?, value) {
        ("--completions", Some(shell)) => {
            let shell = shell
                .to_str()
                .and_then(|s| s.parse::<clap_complete::Shell>().ok());
            let Some(shell) = shell else {
                eprintln!("vq: --completions takes bash, elvish, fish, powershell or zsh");
                return Some(ExitCode::from(EXIT_USAGE as u8));
            };
            clap_complete::generate(shell, &mut cmd(), "vq", &mut std::io::stdout());
            Ok(())
        }
        ("--generate-man", Some(dir)) => clap_mangen::generate_to(cmd(), &dir),
        _ => return None,
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vq: cannot write the man pages: {e}");
            ExitCode::from(EXIT_OTHER as u8)
        }
    })
}

fn main() -> ExitCode {
    // reqwest and lapin use rustls; select ring before any TLS is set up.
    let _ = rustls::crypto::ring::default_provider().install_default();

    if let Some(code) = packaging_output() {
        return code;
    }
    let parsed = Cli::command()
        .version(VERSION)
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(cli) => cli,
        Err(e) => {
            match cli::usage::unknown_option_text(&e) {
                Some(text) => eprint!("{text}"),
                None => {
                    let _ = e.print();
                }
            }
            return if e.use_stderr() {
                ExitCode::from(EXIT_USAGE as u8)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal: journald and log files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VQ_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(cli::DEFAULT_LOG_FILTER)),
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
            eprintln!("vq: {}", vq_common::error::chain(&e));
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
