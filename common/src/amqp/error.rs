//! [`AmqpError`], the one error type of broker operations, and the AMQP
//! reply codes vq tells apart.

/// Errors of broker operations.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    /// Connecting failed.
    #[error("cannot connect to the broker at {url}")]
    Connect {
        /// Redacted URL.
        url: String,
        /// Cause.
        #[source]
        source: lapin::Error,
    },
    /// The CA file (`ca_file`) cannot be read or used.
    #[error("cannot use broker CA file {path}: {problem}")]
    CaFile {
        /// Path.
        path: String,
        /// What is wrong, e.g. the read error or "holds no PEM
        /// certificate".
        problem: String,
    },
    /// The client certificate or its private key (`cert_file`,
    /// `key_file`) cannot be read or used.
    #[error("cannot use broker client {what} {path}: {problem}")]
    ClientCert {
        /// `"certificate"` or `"key"`.
        what: &'static str,
        /// Path of the file at fault.
        path: String,
        /// What is wrong, e.g. the read error or "does not match the
        /// certificate in …".
        problem: String,
    },
    /// An operation did not finish in time.
    #[error("broker operation {what} timed out after {secs} s")]
    Timeout {
        /// Which operation.
        what: String,
        /// Timeout, seconds.
        secs: u64,
    },
    /// Declaring an exchange, queue or binding failed.
    #[error("cannot declare {name}")]
    Declare {
        /// Exchange or queue name.
        name: String,
        /// Cause (for PRECONDITION_FAILED the broker's text names the
        /// argument and both values).
        #[source]
        source: lapin::Error,
    },
    /// Another channel-level operation failed.
    #[error("broker operation {what} failed")]
    Op {
        /// Which operation.
        what: String,
        /// Cause.
        #[source]
        source: lapin::Error,
    },
    /// Publishing (`basic.publish`, or waiting for its confirm) failed.
    #[error("cannot publish to exchange {exchange:?} with routing key {routing_key:?}")]
    Publish {
        /// Exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// Cause (403 ACCESS_REFUSED: the account lacks write permission on
        /// the exchange); boxed, lapin errors are large.
        #[source]
        source: Box<lapin::Error>,
    },
    /// The broker refused (nacked) a published message.
    #[error("broker refused message for exchange {exchange:?} routing key {routing_key:?}")]
    Nacked {
        /// Exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
    /// A mandatory message could not be routed to any queue.
    #[error("no queue for exchange {exchange:?} routing key {routing_key:?} ({reply})")]
    Unroutable {
        /// Exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// Broker's reply text, e.g. `NO_ROUTE`.
        reply: String,
    },
}

impl AmqpError {
    /// The `map_err` adapter of a channel-level operation `what` (e.g.
    /// `"basic.get lease"`): `.map_err(AmqpError::op("basic.get lease"))`
    /// gives [`AmqpError::Op`] naming it, with lapin's error as the cause.
    pub fn op<S: Into<String>>(what: S) -> impl FnOnce(lapin::Error) -> AmqpError {
        move |source| AmqpError::Op {
            what: what.into(),
            source,
        }
    }

    /// Whether retrying later (after reconnecting) may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            AmqpError::Connect { .. } | AmqpError::Timeout { .. } | AmqpError::Nacked { .. } => {
                true
            }
            AmqpError::Op { source, .. } => refused_text(source).is_none(),
            AmqpError::Publish { source, .. } => refused_text(source).is_none(),
            AmqpError::Declare { source, .. } => {
                refused_text(source).is_none()
                    && lapin_reply_code(source) != Some(PRECONDITION_FAILED)
            }
            AmqpError::CaFile { .. }
            | AmqpError::ClientCert { .. }
            | AmqpError::Unroutable { .. } => false,
        }
    }
}

impl AmqpError {
    /// What the broker refused when it refused this operation because the
    /// account lacks a permission, or refused the login (reply code 403
    /// ACCESS_REFUSED): the broker's reply text, which names the resource
    /// and the user (`ACCESS_REFUSED - access to exchange 'vq.control' in
    /// vhost '/' refused for user 'ctl'`), preceded by the permission when
    /// the operation tells it (a publish needs `write` on the exchange):
    /// `write permission on exchange 'vq.control' (publish) refused:
    /// ACCESS_REFUSED - …`. `None` for every other error.
    pub fn access_refused(&self) -> Option<String> {
        match self {
            AmqpError::Publish {
                exchange, source, ..
            } => refused_text(source).map(|reply| {
                format!("write permission on exchange '{exchange}' (publish) refused: {reply}")
            }),
            AmqpError::Connect { source, .. }
            | AmqpError::Declare { source, .. }
            | AmqpError::Op { source, .. } => refused_text(source),
            _ => None,
        }
    }
}

/// A TLS file [`crate::tls`] refused when connecting: `ca_file` is
/// [`AmqpError::CaFile`], the client pair [`AmqpError::ClientCert`].
impl From<crate::tls::TlsFileError> for AmqpError {
    fn from(e: crate::tls::TlsFileError) -> Self {
        match e.key {
            "ca_file" => AmqpError::CaFile {
                path: e.path.display().to_string(),
                problem: e.problem,
            },
            key => AmqpError::ClientCert {
                what: if key == "key_file" {
                    "key"
                } else {
                    "certificate"
                },
                path: e.path.display().to_string(),
                problem: e.problem,
            },
        }
    }
}

/// AMQP reply code NOT_FOUND (a missing queue or exchange).
pub const NOT_FOUND: u16 = 404;

/// AMQP reply code ACCESS_REFUSED (a permission the account lacks, or a
/// refused login).
pub const ACCESS_REFUSED: u16 = 403;

/// AMQP reply code PRECONDITION_FAILED (e.g. a queue declared again with
/// other arguments).
pub const PRECONDITION_FAILED: u16 = 406;

/// The AMQP reply code of a lapin error (e.g. 404 NOT_FOUND, 403
/// ACCESS_REFUSED), if the broker sent one.
pub fn lapin_reply_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// The broker's reply text of a 403 ACCESS_REFUSED error.
fn refused_text(e: &lapin::Error) -> Option<String> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) if p.get_id() == ACCESS_REFUSED => {
            Some(p.get_message().to_string())
        }
        _ => None,
    }
}
