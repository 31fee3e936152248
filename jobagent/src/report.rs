//! Publishing: job events, dead letters, heartbeats and answers, each with a
//! publisher confirm. Results that must not be lost are retried across
//! reconnects until the broker confirms them, and are kept on local disk
//! ([`Outbox`]) until their lease is released, so an agent restart
//! republishes them instead of losing them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use lapin::{BasicProperties, Channel};
use tokio::sync::watch;
use tracing::{debug, warn};
use vq_common::amqp::{
    envelope, event_properties, json_properties, publish_confirmed_patiently, AmqpError,
};
use vq_common::messages::{JobEvent, Message};
use vq_common::topology::{job_event_key, Topology};

pub use vq_common::messages::SUBMITTER_HEADER;

/// Pause between attempts of a publish that must not be lost.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Publishes on the current session's confirm channel.
///
/// The channel lives on the agent's publishing connection, which RabbitMQ
/// blocks during a memory or disk alarm (`connection.blocked`, see
/// <https://www.rabbitmq.com/docs/connection-blocked>): while it is
/// blocked, publishes wait for `connection.unblocked` instead of timing out
/// and being sent again (a message written into a blocked connection is
/// still read by the broker later, so a retry would duplicate it). The
/// confirm timeout counts unblocked time only.
#[derive(Debug, Clone)]
pub struct Publisher {
    channel: watch::Receiver<Option<Channel>>,
    blocked: watch::Receiver<bool>,
    timeout: Duration,
}

impl Publisher {
    /// A publisher following `channel` (set by the session loop, `None`
    /// while disconnected) and `blocked` (true while the broker blocks the
    /// publishing connection), waiting `timeout` of unblocked time for each
    /// confirm.
    pub fn new(
        channel: watch::Receiver<Option<Channel>>,
        blocked: watch::Receiver<bool>,
        timeout: Duration,
    ) -> Self {
        Publisher {
            channel,
            blocked,
            timeout,
        }
    }

    /// True while the publishing channel to the broker is open.
    pub fn is_connected(&self) -> bool {
        self.channel
            .borrow()
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    /// True while the broker blocks the publishing connection (resource
    /// alarm).
    pub fn is_blocked(&self) -> bool {
        *self.blocked.borrow()
    }

    /// Publishes on `ch` once the connection is not blocked and waits for
    /// the confirm; `timeout` runs only while the connection is unblocked
    /// ([`publish_confirmed_patiently`]).
    async fn confirmed(
        &self,
        ch: &Channel,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
        mandatory: bool,
    ) -> Result<(), AmqpError> {
        let blocked = self.blocked.clone();
        publish_confirmed_patiently(
            ch,
            exchange,
            key,
            body,
            props,
            mandatory,
            self.timeout,
            &move || *blocked.borrow(),
        )
        .await
    }

    /// Publishes once; fails at once when not connected, waits while the
    /// broker blocks publishing.
    ///
    /// # Errors
    /// [`AmqpError`] from the publish, or `Timeout` when not connected.
    pub async fn publish_once(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), AmqpError> {
        self.publish_once_mandatory(exchange, key, body, props, false)
            .await
    }

    /// Publishes once, optionally `mandatory` (an unroutable message is
    /// then an error); fails at once when not connected, waits while the
    /// broker blocks publishing.
    ///
    /// # Errors
    /// [`AmqpError`] from the publish, or `Timeout` when not connected.
    pub async fn publish_once_mandatory(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
        mandatory: bool,
    ) -> Result<(), AmqpError> {
        let ch = self.channel.borrow().clone();
        let Some(ch) = ch else {
            return Err(AmqpError::Timeout {
                what: "waiting for a broker connection".into(),
                secs: 0,
            });
        };
        self.confirmed(&ch, exchange, key, body, props, mandatory)
            .await
    }

    /// Publishes until the broker confirms, waiting for reconnects. Never
    /// gives up: the caller's task is dropped on a forced exit.
    pub async fn publish_reliably(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) {
        let mut rx = self.channel.clone();
        loop {
            let ch = match rx.wait_for(|c| c.is_some()).await {
                Ok(c) => c.clone(),
                Err(_) => return, // the session loop is gone: shutting down
            };
            let Some(ch) = ch else { continue };
            match self
                .confirmed(&ch, exchange, key, body, props.clone(), false)
                .await
            {
                Ok(()) => return,
                Err(e) => {
                    warn!(exchange, key, error = %crate::error::chain(&e), "publish failed; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Publishes message `msg` until confirmed (see
    /// [`Publisher::publish_reliably`]).
    pub async fn publish_message_reliably<M: Message>(&self, exchange: &str, key: &str, msg: &M) {
        self.publish_reliably(exchange, key, &msg.encode(), json_properties::<M>())
            .await;
    }
}

/// A job message to dead-letter, with the reason.
#[derive(Debug, Clone, Copy)]
pub struct DeadLetter<'a> {
    /// The message body as delivered.
    pub body: &'a [u8],
    /// Its properties as delivered ([`envelope::dead_letter_properties`]
    /// adapts them).
    pub props: &'a BasicProperties,
    /// Why it is dead-lettered (the `x-vq-reason` header).
    pub reason: &'a str,
}

/// Reports a job's transitions, each as one call that owns its whole
/// sequence (DESIGN.md, "Unknown outcomes"): a final result is stored in
/// the [`Outbox`], published until the broker confirms it (with its stable
/// `message_id`), then marked sent; a restarted agent republishes what is
/// not marked. The stored result is removed when the job's lease is
/// released (by the caller), not here.
#[derive(Debug, Clone)]
pub struct Reporter {
    publisher: Publisher,
    outbox: Outbox,
    topo: Topology,
    pool: String,
    agent: String,
}

impl Reporter {
    /// A reporter for the jobs of `pool` run by `agent`.
    pub fn new(
        publisher: Publisher,
        outbox: Outbox,
        topo: Topology,
        pool: String,
        agent: String,
    ) -> Self {
        Reporter {
            publisher,
            outbox,
            topo,
            pool,
            agent,
        }
    }

    /// Publishes `job.<pool>.started` until confirmed.
    pub async fn started(&self, event: &JobEvent) {
        self.notice(event).await;
    }

    /// The final result of job `key` (stored, published until confirmed,
    /// marked sent).
    pub async fn finished(&self, key: &str, event: &JobEvent) {
        let rk = job_event_key(&self.pool, event.state.routing_word());
        let body = event.encode();
        if let Err(e) = self.outbox.store(key, &rk, &body) {
            warn!(error = %e, "cannot keep the result on disk; publishing it from memory only");
        }
        self.publisher
            .publish_reliably(
                &self.topo.events_exchange(),
                &rk,
                &body,
                event_properties(event),
            )
            .await;
        if let Err(e) = self.outbox.mark_sent(key) {
            debug!(error = %e, "cannot mark the stored result as sent");
        }
    }

    /// Job `key` ends failed: its message is dead-lettered with the reason
    /// (confirmed), then `event` is its final result as in
    /// [`Reporter::finished`].
    pub async fn failed(&self, key: &str, dead: DeadLetter<'_>, event: &JobEvent) {
        self.dead_letter(dead).await;
        self.finished(key, event).await;
    }

    /// Dead-letters a delivered message (`<c>.dead`, routing key = pool)
    /// until confirmed; its submitter is the broker-validated `user_id` (a
    /// forged [`SUBMITTER_HEADER`] is dropped, see [`envelope`]).
    pub async fn dead_letter(&self, dead: DeadLetter<'_>) {
        let submitter = dead
            .props
            .user_id()
            .as_ref()
            .map(|u| u.as_str().to_string());
        let props = envelope::dead_letter_properties(
            dead.props,
            dead.reason,
            &self.agent,
            submitter.as_deref(),
        );
        self.publisher
            .publish_reliably(&self.topo.dead_exchange(), &self.pool, dead.body, props)
            .await;
    }

    /// Publishes an event that is no result of a job run here (a start, or
    /// the notice to the submitter of a duplicate) until confirmed.
    pub async fn notice(&self, event: &JobEvent) {
        self.publisher
            .publish_reliably(
                &self.topo.events_exchange(),
                &job_event_key(&self.pool, event.state.routing_word()),
                &event.encode(),
                event_properties(event),
            )
            .await;
    }
}

pub use vq_common::amqp::{header_str, header_u32, with_header_str, with_header_u32};

/// Results waiting for their confirm and their lease release, one file per
/// job in `<state_dir>/outbox`: `<id>.result` (not yet confirmed) or
/// `<id>.sent` (confirmed, lease not yet released), `<id>` being the job id
/// in unpadded base64url (RFC 4648 §5), which keeps every accepted id (at
/// most 128 bytes: 171 characters) within the 255-byte file-name limit. The
/// first line is the routing key, the rest the event body.
#[derive(Debug, Clone)]
pub struct Outbox {
    dir: PathBuf,
}

/// One stored result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Routing key of the event.
    pub routing_key: String,
    /// Event body (JSON).
    pub body: Vec<u8>,
    /// Whether the broker confirmed it already.
    pub sent: bool,
}

fn file_stem(job_id: &str) -> String {
    data_encoding::BASE64URL_NOPAD.encode(job_id.as_bytes())
}

fn job_id_of(stem: &str) -> Option<String> {
    let bytes = data_encoding::BASE64URL_NOPAD
        .decode(stem.as_bytes())
        .ok()?;
    String::from_utf8(bytes).ok()
}

impl Outbox {
    /// The outbox under `state_dir` (created, mode 0700).
    ///
    /// # Errors
    /// If the directory cannot be created.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = state_dir.join("outbox");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        Ok(Outbox { dir })
    }

    fn path(&self, job_id: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{}.{ext}", file_stem(job_id)))
    }

    /// Stores the result of `job_id` durably (write, fsync, rename).
    ///
    /// # Errors
    /// I/O errors.
    pub fn store(&self, job_id: &str, routing_key: &str, body: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = self.path(job_id, "tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(routing_key.as_bytes())?;
        f.write_all(b"\n")?;
        f.write_all(body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.path(job_id, "result"))?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Marks the result of `job_id` as confirmed by the broker.
    ///
    /// # Errors
    /// I/O errors.
    pub fn mark_sent(&self, job_id: &str) -> std::io::Result<()> {
        std::fs::rename(self.path(job_id, "result"), self.path(job_id, "sent"))
    }

    /// The stored result of `job_id`, if any.
    pub fn load(&self, job_id: &str) -> Option<Stored> {
        for (ext, sent) in [("sent", true), ("result", false)] {
            if let Ok(data) = std::fs::read(self.path(job_id, ext)) {
                let nl = data.iter().position(|b| *b == b'\n')?;
                return Some(Stored {
                    routing_key: String::from_utf8_lossy(&data[..nl]).into_owned(),
                    body: data[nl + 1..].to_vec(),
                    sent,
                });
            }
        }
        None
    }

    /// Removes every file of `job_id`.
    pub fn remove(&self, job_id: &str) {
        for ext in ["sent", "result", "tmp"] {
            let _ = std::fs::remove_file(self.path(job_id, ext));
        }
    }

    /// Job ids with a stored result.
    pub fn job_ids(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some((stem, ext)) = name.rsplit_once('.') {
                    if ext == "sent" || ext == "result" {
                        if let Some(id) = job_id_of(stem) {
                            out.push(id);
                        }
                    }
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outbox_keeps_a_result_until_removed() {
        let dir = tempfile::tempdir().unwrap();
        let ob = Outbox::open(dir.path()).unwrap();
        ob.store("12.a/b", "job.p.finished", b"{\"x\":1}").unwrap();
        let got = ob.load("12.a/b").unwrap();
        assert_eq!(got.routing_key, "job.p.finished");
        assert_eq!(got.body, b"{\"x\":1}");
        assert!(!got.sent);
        ob.mark_sent("12.a/b").unwrap();
        assert!(ob.load("12.a/b").unwrap().sent);
        assert_eq!(ob.job_ids(), vec!["12.a/b".to_string()]);
        ob.remove("12.a/b");
        assert!(ob.load("12.a/b").is_none());
        assert!(ob.job_ids().is_empty());
    }

    #[test]
    fn the_outbox_keeps_the_result_of_the_longest_accepted_job_id() {
        let dir = tempfile::tempdir().unwrap();
        let ob = Outbox::open(dir.path()).unwrap();
        let id = "j".repeat(vq_common::messages::MAX_JOB_ID_BYTES);
        ob.store(&id, "job.p.finished", b"{}").unwrap();
        assert!(ob.load(&id).is_some());
        ob.mark_sent(&id).unwrap();
        assert_eq!(ob.job_ids(), vec![id]);
    }

    #[test]
    fn loss_counters_are_read_from_any_integer_header() {
        let p = with_header_u32(BasicProperties::default(), "x-vq-losses", 2);
        assert_eq!(header_u32(&p, "x-vq-losses"), 2);
        assert_eq!(header_u32(&BasicProperties::default(), "x-vq-losses"), 0);
        let s = with_header_str(BasicProperties::default(), "x-vq-losses", " 7 ");
        assert_eq!(header_u32(&s, "x-vq-losses"), 7);
    }
}
