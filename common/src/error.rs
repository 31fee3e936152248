//! Errors of the pure `common` layer.

use std::path::PathBuf;

/// A configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file was read but has problems; all of them are listed.
    #[error("invalid configuration in {origin}:\n  - {}", problems.join("\n  - "))]
    Invalid {
        /// File name or other origin.
        origin: String,
        /// Every problem found, one line each, starting with the key path.
        problems: Vec<String>,
    },
}
