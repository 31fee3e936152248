//! AMQP glue shared by the controller, the jobagent and the CLI (feature
//! `amqp`): connect with a timeout and TLS, declare the topology, publish
//! JSON with a publisher confirm, subscribe to an exchange; and
//! ([`envelope`]) the properties of the job copies vq makes (lease copies,
//! dead letters) and the job id of a delivery.
//!
//! Every broker operation here is bounded by a timeout: an await that can
//! wait forever on a half-dead connection is a bug.

use std::time::Duration;

use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub mod envelope;

pub use crate::amqp_url::{broker_user, parse_url, redact_url, DEFAULT_USER};
use crate::config::BrokerConfig;
use crate::messages::{Message, SCHEMA_HEADER, SCHEMA_VERSION};
use crate::topology::{ArgValue, ExchangeKind, QueueArgs, Topology, ALL_JOB_EVENTS};

/// `frame_max` added to URIs that do not set it, bytes. Without it lapin
/// allocates 8 MiB of buffers per connection (DESIGN.md, "lapin memory").
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

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

/// Runs `fut` with a timeout, mapping expiry to [`AmqpError::Timeout`].
pub async fn bounded<T>(
    what: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, AmqpError>>,
) -> Result<T, AmqpError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(AmqpError::Timeout {
            what: what.into(),
            secs: timeout.as_secs(),
        }),
    }
}

/// Adds `frame_max` and `heartbeat` query parameters to `url` when absent.
pub fn tuned_url(url: &str, heartbeat_secs: u16) -> String {
    let mut out = url.to_string();
    let mut sep = if url.contains('?') { '&' } else { '?' };
    if !url.contains("frame_max=") {
        out.push(sep);
        out.push_str(&format!("frame_max={DEFAULT_FRAME_MAX}"));
        sep = '&';
    }
    if !url.contains("heartbeat=") {
        out.push(sep);
        out.push_str(&format!("heartbeat={heartbeat_secs}"));
    }
    out
}

/// Opens a connection named `name` (shown in the management UI), bounded by
/// `connect_timeout_secs`, and presents the client certificate `cert_file`
/// with `key_file` when both are set. The TLS files are read and checked
/// here ([`crate::tls`]), before any network I/O, so a bad file fails at
/// once and by name.
///
/// Trust: with `ca_file` (amqps), its certificates are the only roots (a
/// broker certificate from a publicly trusted CA is refused unless that CA
/// is in `ca_file`); without it, lapin's default, the system roots.
///
/// # Errors
/// [`AmqpError::Connect`], [`AmqpError::Timeout`], [`AmqpError::CaFile`] or
/// [`AmqpError::ClientCert`].
pub async fn connect(cfg: &BrokerConfig, name: &str) -> Result<Connection, AmqpError> {
    let url = tuned_url(&cfg.url, cfg.heartbeat_secs);
    let redacted = redact_url(&cfg.url);
    let identity = match (&cfg.cert_file, &cfg.key_file) {
        (Some(cert), Some(key)) => Some((cert, key, client_identity(cert, key)?)),
        (None, None) => None,
        (Some(path), None) | (None, Some(path)) => {
            return Err(AmqpError::ClientCert {
                what: if cfg.cert_file.is_some() {
                    "certificate"
                } else {
                    "key"
                },
                path: path.display().to_string(),
                problem: "cert_file and key_file must be set together".into(),
            })
        }
    };
    // Plain AMQP with a CA file would send the password in clear while
    // the operator believes TLS is on (the CLI's URL and CA file can come
    // from different places).
    if let (Some(ca), false) = (&cfg.ca_file, url.starts_with("amqps://")) {
        return Err(AmqpError::CaFile {
            path: ca.display().to_string(),
            problem: format!(
                "set, but the broker URL {redacted} is not amqps:// (TLS would not be used)"
            ),
        });
    }
    let exclusive = match &cfg.ca_file {
        Some(ca) if url.starts_with("amqps://") => {
            let roots = crate::tls::load_ca(ca).map_err(tls_file_error)?;
            let identity = identity
                .as_ref()
                .map(|(cert, _, (chain, key))| (cert.as_path(), chain.clone(), key.clone_key()));
            Some(crate::tls::client_config(ca, roots, identity).map_err(tls_file_error)?)
        }
        _ => None,
    };
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = Duration::from_secs(cfg.connect_timeout_secs);
    let connect_err = |source| AmqpError::Connect {
        url: redacted.clone(),
        source,
    };
    bounded("connect", timeout, async {
        let runtime = lapin::runtime::default_runtime().map_err(connect_err)?;
        match exclusive {
            Some(config) => {
                let uri: AMQPUri = url
                    .parse()
                    .map_err(|e: String| connect_err(std::io::Error::other(e).into()))?;
                let connector = lapin::tcp::RustlsConnector::from(config);
                Connection::connector(
                    uri,
                    runtime,
                    async move |uri: AMQPUri, runtime| {
                        // TCP as lapin does it (the URI with the amqp
                        // scheme), then TLS with our own connector.
                        let mut plain = uri.clone();
                        plain.scheme = AMQPScheme::AMQP;
                        let tcp = plain.connect_async(&runtime).await?;
                        Ok(tcp.into_rustls(&connector, &uri.authority.host).await?)
                    },
                    props,
                )
                .await
                .map_err(connect_err)
            }
            None => {
                let identity = match identity {
                    // lapin parses the PEM files itself (checked above).
                    Some((cert, key, _)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                        pem: read_tls_file("certificate", cert)?,
                        key: read_tls_file("key", key)?,
                    }),
                    None => None,
                };
                let tls = OwnedTLSConfig {
                    identity,
                    cert_chain: None,
                };
                Connection::connect_with_config(&url, props, tls, runtime)
                    .await
                    .map_err(connect_err)
            }
        }
    })
    .await
}

fn read_tls_file(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, AmqpError> {
    std::fs::read(path).map_err(|e| AmqpError::ClientCert {
        what,
        path: path.display().to_string(),
        problem: format!("cannot be read: {e}"),
    })
}

fn tls_file_error(e: crate::tls::TlsFileError) -> AmqpError {
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

/// Reads and checks the client certificate chain and key of [`connect`]
/// ([`crate::tls::load_identity`]).
fn client_identity(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), AmqpError> {
    crate::tls::load_identity(cert, key).map_err(tls_file_error)
}

/// Opens a channel with publisher confirms enabled.
///
/// # Errors
/// [`AmqpError::Op`] or [`AmqpError::Timeout`] (10 s).
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, AmqpError> {
    bounded("open channel", Duration::from_secs(10), async {
        let ch = conn
            .create_channel()
            .await
            .map_err(AmqpError::op("channel.open"))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::op("confirm.select"))?;
        Ok(ch)
    })
    .await
}

/// Converts queue arguments to an AMQP field table.
pub fn field_table(args: &QueueArgs) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in args {
        let value = match v {
            ArgValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
            ArgValue::Int(i) => AMQPValue::LongLongInt(*i),
            ArgValue::Bool(b) => AMQPValue::Boolean(*b),
        };
        t.insert(ShortString::from(*k), value);
    }
    t
}

const DECLARE_TIMEOUT: Duration = Duration::from_secs(15);

/// Declares a durable exchange.
///
/// # Errors
/// [`AmqpError::Declare`] naming the exchange.
pub async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), AmqpError> {
    let kind = match kind {
        ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        ExchangeKind::Topic => lapin::ExchangeKind::Topic,
        ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
    };
    bounded(
        &format!("declare exchange {name}"),
        DECLARE_TIMEOUT,
        async {
            ch.exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| AmqpError::Declare {
                name: name.into(),
                source,
            })
        },
    )
    .await
}

/// Declares a durable queue with `args` and binds it to `exchange` with
/// `routing_key`. A queue that exists with other arguments fails with
/// PRECONDITION_FAILED, whose text names the argument and both values; the
/// broker then closes `ch`.
///
/// # Errors
/// [`AmqpError::Declare`] naming the queue.
pub async fn declare_bound_queue(
    ch: &Channel,
    queue: &str,
    args: &QueueArgs,
    exchange: &str,
    routing_key: &str,
) -> Result<(), AmqpError> {
    bounded(&format!("declare queue {queue}"), DECLARE_TIMEOUT, async {
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            field_table(args),
        )
        .await
        .map_err(|source| AmqpError::Declare {
            name: queue.into(),
            source,
        })?;
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|source| AmqpError::Declare {
            name: format!("binding {exchange} -> {queue} ({routing_key})"),
            source,
        })?;
        Ok(())
    })
    .await
}

/// Bound on the whole of [`subscribe`] (declare, bind, consume).
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(15);

/// Subscribes to `exchange` with each of `keys`: declares the exclusive,
/// auto-delete queue `queue` (`""`: a server-named `amq.gen-…` queue),
/// binds it with every key and consumes it without acks as the only
/// consumer, tag `consumer_tag` (`""`: server-chosen). The queue lives as
/// long as the connection: for listeners that must not leave a queue
/// behind (the controller's agent events, an agent's control queue, the
/// CLI's and the tests' event taps). The whole sequence is bounded by
/// [`SUBSCRIBE_TIMEOUT`].
///
/// # Errors
/// [`AmqpError::Declare`] naming the queue or the binding (403 when the
/// account may not declare or bind it, 405 RESOURCE_LOCKED when another
/// connection holds the exclusive queue), [`AmqpError::Op`] for the
/// consume, [`AmqpError::Timeout`].
pub async fn subscribe(
    ch: &Channel,
    queue: &str,
    exchange: &str,
    keys: &[&str],
    consumer_tag: &str,
) -> Result<lapin::Consumer, AmqpError> {
    let what = format!("subscribe to {exchange} ({})", keys.join(", "));
    bounded(&what, SUBSCRIBE_TIMEOUT, async {
        let declared = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| AmqpError::Declare {
                name: if queue.is_empty() {
                    format!("a server-named queue for {exchange}")
                } else {
                    queue.into()
                },
                source,
            })?;
        let name = declared.name().clone();
        for key in keys {
            ch.queue_bind(
                name.clone(),
                exchange.into(),
                (*key).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|source| AmqpError::Declare {
                name: format!("binding {exchange} -> {name} ({key})"),
                source,
            })?;
        }
        ch.basic_consume(
            name.clone(),
            consumer_tag.into(),
            BasicConsumeOptions {
                no_ack: true,
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::op(format!("consume {name}")))
    })
    .await
}

/// Declares `agent`'s lease queue `<c>.lease.<agent>` and binds it to
/// [`Topology::lease_exchange`] with its own name as the routing key (the
/// key lease copies are published with).
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_lease_queue(
    ch: &Channel,
    topo: &Topology,
    agent: &str,
) -> Result<(), AmqpError> {
    let queue = topo.lease_queue(agent);
    declare_bound_queue(
        ch,
        &queue,
        &topo.lease_queue_args(),
        &topo.lease_exchange(),
        &queue,
    )
    .await
}

/// Declares the agent registry `<c>.agents` and binds it to
/// [`Topology::agents_exchange`] with its own name as the routing key.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_agents_queue(ch: &Channel, topo: &Topology) -> Result<(), AmqpError> {
    let queue = topo.agents_queue();
    declare_bound_queue(
        ch,
        &queue,
        &topo.agents_queue_args(),
        &topo.agents_exchange(),
        &queue,
    )
    .await
}

/// Declares the exchanges that agents and the controller publish to or
/// bind to: jobs, dead, events, demand, control, lease, agents (not the
/// controller's own fence exchange, see [`declare_topology`]).
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_exchanges(ch: &Channel, topo: &Topology) -> Result<(), AmqpError> {
    declare_exchange(ch, &topo.jobs_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.dead_exchange(), ExchangeKind::Fanout).await?;
    declare_exchange(ch, &topo.events_exchange(), ExchangeKind::Topic).await?;
    declare_exchange(ch, &topo.demand_exchange(), ExchangeKind::Fanout).await?;
    declare_exchange(ch, &topo.control_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.lease_exchange(), ExchangeKind::Direct).await?;
    declare_exchange(ch, &topo.agents_exchange(), ExchangeKind::Direct).await?;
    Ok(())
}

/// Declares the whole topology (the controller's part): exchanges, the
/// dead-letter queue, the job-event stream, the demand queue, the fence
/// queue and its exchange, the agent registry and the pool queues of
/// `pools`. Idempotent.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_topology<'a>(
    ch: &Channel,
    topo: &Topology,
    pools: impl IntoIterator<Item = &'a str>,
) -> Result<(), AmqpError> {
    declare_exchanges(ch, topo).await?;
    declare_bound_queue(
        ch,
        &topo.dead_queue(),
        &topo.dead_queue_args(),
        &topo.dead_exchange(),
        "",
    )
    .await?;
    declare_bound_queue(
        ch,
        &topo.event_log_queue(),
        &topo.event_log_args(),
        &topo.events_exchange(),
        ALL_JOB_EVENTS,
    )
    .await?;
    declare_bound_queue(
        ch,
        &topo.demand_queue(),
        &topo.demand_queue_args(),
        &topo.demand_exchange(),
        "",
    )
    .await?;
    declare_exchange(ch, &topo.fence_exchange(), ExchangeKind::Direct).await?;
    let fence = topo.fence_queue();
    declare_bound_queue(
        ch,
        &fence,
        &topo.fence_queue_args(),
        &topo.fence_exchange(),
        &fence,
    )
    .await?;
    declare_agents_queue(ch, topo).await?;
    for pool in pools {
        declare_pool_queue(ch, topo, pool).await?;
    }
    Ok(())
}

/// Declares the job queue of `pool` and binds it to the jobs exchange.
///
/// # Errors
/// [`AmqpError::Declare`].
pub async fn declare_pool_queue(
    ch: &Channel,
    topo: &Topology,
    pool: &str,
) -> Result<(), AmqpError> {
    declare_bound_queue(
        ch,
        &topo.pool_queue(pool),
        &topo.pool_queue_args(),
        &topo.jobs_exchange(),
        pool,
    )
    .await
}

/// Properties of a job event: [`json_properties`] plus its stable
/// `message_id` ([`JobEvent::message_id`]), on which consumers deduplicate.
pub fn event_properties(event: &crate::messages::JobEvent) -> BasicProperties {
    json_properties::<crate::messages::JobEvent>().with_message_id(event.message_id().into())
}

/// Properties of a JSON message of type `M`: content type, schema header,
/// persistent delivery mode, current timestamp.
pub fn json_properties<M: Message>() -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(SCHEMA_HEADER.into(), AMQPValue::LongUInt(SCHEMA_VERSION));
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_type(M::KIND.into())
        .with_timestamp(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        )
        .with_headers(headers)
}

/// Publishes `body` with `props` and waits for the publisher confirm (the
/// channel must be in confirm mode). With `mandatory`, an unroutable message
/// is an error.
///
/// # Errors
/// [`AmqpError::Nacked`], [`AmqpError::Unroutable`], [`AmqpError::Publish`]
/// or [`AmqpError::Timeout`] after `timeout`.
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    mandatory: bool,
    timeout: Duration,
) -> Result<(), AmqpError> {
    let what = format!("publish to {exchange:?} key {routing_key:?}");
    let publish_err = |source| AmqpError::Publish {
        exchange: exchange.into(),
        routing_key: routing_key.into(),
        source: Box::new(source),
    };
    let confirmation = bounded(&what, timeout, async {
        let pending = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory,
                    ..Default::default()
                },
                body,
                props,
            )
            .await
            .map_err(publish_err)?;
        pending.await.map_err(publish_err)
    })
    .await?;
    match confirmation {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(AmqpError::Unroutable {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            reply: returned.reply_text.to_string(),
        }),
        Confirmation::Nack(_) => Err(AmqpError::Nacked {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }),
    }
}

/// How often [`publish_confirmed_patiently`] re-checks `blocked` and the
/// channel.
const BLOCKED_POLL: Duration = Duration::from_millis(250);

/// [`publish_confirmed`] on a connection the broker may block during a
/// memory or disk alarm (`connection.blocked`,
/// <https://www.rabbitmq.com/docs/connection-blocked>); `blocked()` says
/// whether it is blocked now.
///
/// Waits while blocked before publishing, and counts only unblocked time
/// towards `timeout` while waiting for the confirm: a message written into
/// a blocked connection is still read by the broker after the alarm (even
/// after the client has gone), so giving up and sending it again, or
/// treating it as not sent, would duplicate it. It therefore does not
/// return while `blocked()` stays true and the channel stays open: bound
/// it from outside where that matters (the controller gives a cycle
/// `SHUTDOWN_GRACE` after a shutdown request).
///
/// # Errors
/// As [`publish_confirmed`]; [`AmqpError::Timeout`] also when the channel
/// closes while waiting.
#[allow(clippy::too_many_arguments)]
pub async fn publish_confirmed_patiently(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    mandatory: bool,
    timeout: Duration,
    blocked: &(dyn Fn() -> bool + Send + Sync),
) -> Result<(), AmqpError> {
    let gone = || AmqpError::Timeout {
        what: format!("publish to {exchange:?} key {routing_key:?} (channel closed)"),
        secs: 0,
    };
    while blocked() {
        if !ch.status().connected() {
            return Err(gone());
        }
        tokio::time::sleep(BLOCKED_POLL).await;
    }
    // The real bound is counted below; this one only avoids an Instant
    // overflow.
    let no_bound = Duration::from_secs(365 * 24 * 3600);
    let publish = publish_confirmed(ch, exchange, routing_key, body, props, mandatory, no_bound);
    tokio::pin!(publish);
    let mut unblocked_wait = Duration::ZERO;
    loop {
        tokio::select! {
            r = &mut publish => return r,
            _ = tokio::time::sleep(BLOCKED_POLL) => {
                if !ch.status().connected() {
                    return Err(gone());
                }
                if !blocked() {
                    unblocked_wait += BLOCKED_POLL;
                }
                if unblocked_wait >= timeout {
                    return Err(AmqpError::Timeout {
                        what: format!("publish to {exchange:?} key {routing_key:?}"),
                        secs: timeout.as_secs(),
                    });
                }
            }
        }
    }
}

/// Publishes message `msg` as JSON (see [`json_properties`]) with a confirm.
/// Neither daemon uses it (they need `user_id`, `message_id` or alarm
/// awareness); it is the one-call publish for Rust bridges and for tests
/// (`common/tests/topology_broker.rs`, `controller/tests/cli_submit.rs`).
///
/// # Errors
/// As [`publish_confirmed`].
pub async fn publish_message<M: Message>(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    msg: &M,
    mandatory: bool,
    timeout: Duration,
) -> Result<(), AmqpError> {
    publish_confirmed(
        ch,
        exchange,
        routing_key,
        &msg.encode(),
        json_properties::<M>(),
        mandatory,
        timeout,
    )
    .await
}

/// The number in header `name` of `props` (any AMQP integer type, or a
/// decimal string; absent, negative or not a number gives 0, too large
/// gives `u32::MAX`). Used for loss counters (`x-vq-losses`).
pub fn header_u32(props: &BasicProperties, name: &str) -> u32 {
    let Some(v) = props.headers().as_ref().and_then(|h| h.inner().get(name)) else {
        return 0;
    };
    let n: i128 = match v {
        AMQPValue::ShortShortInt(n) => i128::from(*n),
        AMQPValue::ShortShortUInt(n) => i128::from(*n),
        AMQPValue::ShortInt(n) => i128::from(*n),
        AMQPValue::ShortUInt(n) => i128::from(*n),
        AMQPValue::LongInt(n) => i128::from(*n),
        AMQPValue::LongUInt(n) => i128::from(*n),
        AMQPValue::LongLongInt(n) => i128::from(*n),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes())
            .trim()
            .parse()
            .unwrap_or(0),
        _ => 0,
    };
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// The string in header `name` of `props` (long or short string), if any.
pub fn header_str(props: &BasicProperties, name: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// `props` with header `name` set to the integer `value`.
pub fn with_header_u32(props: BasicProperties, name: &str, value: u32) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), AMQPValue::LongLongInt(i64::from(value)));
    props.with_headers(headers)
}

/// Looks at or takes the claim marker of job `job_id` for claim `claim` of
/// agent `agent` (see [`crate::lease`]): declares it with that claim's
/// arguments, after a passive declaration when `create` is false (a
/// missing marker is then [`Marker::Absent`](crate::lease::Marker) and is
/// not created). A 404 or 406 reply closes `ch`: use a channel that holds
/// nothing else.
///
/// # Errors
/// [`AmqpError`] when the outcome is unknown (not connected, timeout,
/// connection lost): ask again.
pub async fn claim_marker(
    ch: &Channel,
    topo: &Topology,
    job_id: &str,
    agent: &str,
    claim: &str,
    create: bool,
) -> Result<crate::lease::Marker, AmqpError> {
    use crate::lease::Marker;
    let queue = topo.claim_queue(job_id);
    if !create {
        let r = bounded("look up claim marker", DECLARE_TIMEOUT, async {
            Ok(ch
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await)
        })
        .await?;
        match r {
            Ok(_) => {}
            Err(e) if lapin_reply_code(&e) == Some(NOT_FOUND) => return Ok(Marker::Absent),
            Err(e) => return Err(AmqpError::op("look up claim marker")(e)),
        }
    }
    let args = field_table(&topo.claim_queue_args(agent, claim));
    let r = bounded("declare claim marker", DECLARE_TIMEOUT, async {
        Ok(ch
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await)
    })
    .await?;
    match r {
        Ok(_) => Ok(Marker::Ours),
        Err(e) if lapin_reply_code(&e) == Some(PRECONDITION_FAILED) => Ok(Marker::Theirs),
        Err(e) => Err(AmqpError::op("declare claim marker")(e)),
    }
}

/// `props` with string header `name` set to `value` (replacing any).
pub fn with_header_str(props: BasicProperties, name: &str, value: &str) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), AMQPValue::LongString(value.into()));
    props.with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_frame_max_and_heartbeat_once() {
        assert_eq!(
            tuned_url("amqp://h/%2f", 15),
            "amqp://h/%2f?frame_max=131072&heartbeat=15"
        );
        assert_eq!(
            tuned_url("amqp://h/v?frame_max=4096", 5),
            "amqp://h/v?frame_max=4096&heartbeat=5"
        );
    }
}
