//! The one log set-up of both daemons (feature `logging`): `tracing` to
//! stderr, filtered by `RUST_LOG` (default `info`), as plain text or, with
//! `--log-format json`, one JSON object per line.
//!
//! A JSON line is tracing-subscriber's JSON format: `timestamp`, `level`,
//! `target`, the event's `fields` (`message` among them), the innermost
//! span with its fields as `span` and every enclosing span as `spans`, so
//! that a job's lines carry `span.pool`, `span.agent` and `span.job_id`
//! without each event repeating them.

use std::fmt;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How the daemons write their log (`--log-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines, coloured only on a terminal (the default).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl LogFormat {
    /// The accepted spellings, for help texts.
    pub const NAMES: [&'static str; 2] = ["text", "json"];
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// An unknown `--log-format` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown log format {0:?} (expected text or json)")]
pub struct UnknownLogFormat(pub String);

impl FromStr for LogFormat {
    type Err = UnknownLogFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(UnknownLogFormat(other.to_string())),
        }
    }
}

/// The filter: `RUST_LOG` if it parses, else `info`.
fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Installs the global subscriber writing `format` to stderr. Call it once,
/// first thing in `main`; a later call keeps the subscriber already
/// installed.
pub fn init(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter());
    // Errors only when a subscriber is installed already: keep that one.
    let _ = match format {
        LogFormat::Text => builder
            // Colour only on a terminal: journald and log files get plain text.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder
            .with_ansi(false)
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_formats_parse_from_their_names_and_print_back() {
        for name in LogFormat::NAMES {
            let f: LogFormat = name.parse().unwrap();
            assert_eq!(f.to_string(), name);
        }
        assert_eq!(LogFormat::default(), LogFormat::Text);
        let e = "xml".parse::<LogFormat>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown log format \"xml\" (expected text or json)"
        );
    }
}
