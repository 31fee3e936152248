//! Errors of the pure `common` layer, and the one renderer of an error's
//! cause chain.

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

/// `err` with its whole `source` chain on one line, each cause after
/// `": "` (`cannot list the cluster's servers: HTTP 503 …: connection
/// reset`), for logs, event reasons, exit messages and the status page.
/// vq's errors name the failed action in their message and keep the cause
/// only in `source` (house style, practice 3), so printing only the top
/// error would drop the cause.
pub fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot do the outer thing")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("cannot do the middle thing")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn every_cause_is_rendered_in_order() {
        let e = Outer(Middle(std::io::Error::other("disk on fire")));
        assert_eq!(
            chain(&e),
            "cannot do the outer thing: cannot do the middle thing: disk on fire"
        );
        assert_eq!(chain(&std::io::Error::other("alone")), "alone");
    }
}
