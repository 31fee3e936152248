//! The envelope of the job copies vq makes, and the job id of a delivery:
//! one format for both daemons (DESIGN.md, "Leases"; README.md, dead
//! letters), guarded by the golden fixture
//! `common/tests/fixtures/dead-letters.json`.
//!
//! **What a copy keeps.** A lease copy or a dead letter keeps, from the
//! message it copies: `content_type`, `content_encoding`, `headers` (but
//! see [`SUBMITTER_HEADER`]), `priority`, `correlation_id`, `reply_to`,
//! `message_id`, `timestamp`, `type` and `app_id`, so a bridge that set
//! them finds them again on the dead letter. It is always persistent
//! (`delivery_mode` 2: nothing vq moves may vanish with a broker restart).
//! It drops `user_id` (RabbitMQ refuses a `user_id` other than the
//! publisher's own login; the submitter moves to [`SUBMITTER_HEADER`]),
//! `expiration` (a copy must not expire on its way) and `cluster_id`. A
//! [`SUBMITTER_HEADER`] of the original is never copied: the caller names
//! the submitter it trusts (the broker-validated `user_id` of a pool
//! delivery, or the header an agent wrote on its own lease copy).
//!
//! A dead letter adds [`REASON_HEADER`] (why) and [`DEAD_BY_HEADER`] (the
//! agent id, or `vq-controller`); the controller's fence adds the loss
//! count ([`LOSSES_HEADER`](crate::topology::LOSSES_HEADER)) with
//! [`crate::amqp::with_header_u32`].

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

use crate::messages::{Job, Message, DEAD_BY_HEADER, REASON_HEADER, SUBMITTER_HEADER};

/// [`DEAD_BY_HEADER`] of the dead letters the controller makes (fencing a
/// lost agent's leases).
pub const CONTROLLER_DEAD_BY: &str = "vq-controller";

/// Properties of a dead letter of the message with properties `orig`:
/// the copied envelope (module doc), [`REASON_HEADER`] = `reason`,
/// [`DEAD_BY_HEADER`] = `dead_by`, and [`SUBMITTER_HEADER`] = `submitter`
/// when known.
pub fn dead_letter_properties(
    orig: &BasicProperties,
    reason: &str,
    dead_by: &str,
    submitter: Option<&str>,
) -> BasicProperties {
    let mut headers = orig.headers().clone().unwrap_or_default();
    headers.insert(
        REASON_HEADER.into(),
        AMQPValue::LongString(LongString::from(reason)),
    );
    headers.insert(
        DEAD_BY_HEADER.into(),
        AMQPValue::LongString(LongString::from(dead_by)),
    );
    copied_properties(orig, headers, submitter)
}

/// Properties of an agent's lease copy of a pool delivery with properties
/// `orig`: the copied envelope (module doc) with `message_id` = `job_id`
/// and [`SUBMITTER_HEADER`] = `submitter`, the submitter the job was
/// judged by.
pub fn lease_copy_properties(
    orig: &BasicProperties,
    job_id: &str,
    submitter: Option<&str>,
) -> BasicProperties {
    let headers = orig.headers().clone().unwrap_or_default();
    copied_properties(orig, headers, submitter).with_message_id(job_id.into())
}

fn copied_properties(
    orig: &BasicProperties,
    headers: FieldTable,
    submitter: Option<&str>,
) -> BasicProperties {
    let mut headers: FieldTable = headers
        .inner()
        .iter()
        .filter(|(k, _)| k.as_str() != SUBMITTER_HEADER)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into();
    if let Some(user) = submitter {
        headers.insert(
            SUBMITTER_HEADER.into(),
            AMQPValue::LongString(LongString::from(user)),
        );
    }
    let mut p = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    let copy = |v: &Option<ShortString>| v.clone();
    if let Some(v) = copy(orig.content_type()) {
        p = p.with_content_type(v);
    }
    if let Some(v) = copy(orig.content_encoding()) {
        p = p.with_content_encoding(v);
    }
    if let Some(v) = *orig.priority() {
        p = p.with_priority(v);
    }
    if let Some(v) = copy(orig.correlation_id()) {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = copy(orig.reply_to()) {
        p = p.with_reply_to(v);
    }
    if let Some(v) = copy(orig.message_id()) {
        p = p.with_message_id(v);
    }
    if let Some(v) = *orig.timestamp() {
        p = p.with_timestamp(v);
    }
    if let Some(v) = copy(orig.kind()) {
        p = p.with_type(v);
    }
    if let Some(v) = copy(orig.app_id()) {
        p = p.with_app_id(v);
    }
    p
}

/// The job id of a message whose body decoded as `job` (`None`: it did
/// not decode) and whose properties are `props`: the body's id, else a
/// non-empty AMQP `message_id` (lease copies and `vq submit` set it to
/// the job id), else `None`. The body comes first because it is what the
/// job is run as; a `message_id` that differs from it is the
/// publisher's, not vq's.
pub fn job_id(job: Option<&Job>, props: &BasicProperties) -> Option<String> {
    job.map(|j| j.id.clone()).or_else(|| {
        props
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_string())
            .filter(|m| !m.is_empty())
    })
}

/// [`job_id`] of a raw message (decodes `body`).
pub fn job_id_of(props: &BasicProperties, body: &[u8]) -> Option<String> {
    job_id(Job::decode(body).ok().as_ref(), props)
}

/// [`job_id`], or for a message with no id at all a fresh key
/// `undecodable-<32 hex digits>`, unique per delivery, so that such a
/// message can still be claimed, refused and dead-lettered under a name of
/// its own.
pub fn delivery_key(job: Option<&Job>, props: &BasicProperties) -> String {
    job_id(job, props).unwrap_or_else(|| format!("undecodable-{:032x}", rand::random::<u128>()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        serde_json::from_str(include_str!("../../tests/fixtures/job.json")).expect("fixture")
    }

    #[test]
    fn the_body_names_the_job_before_the_message_id() {
        let j = job();
        let props = BasicProperties::default().with_message_id("other".into());
        assert_eq!(job_id(Some(&j), &props), Some(j.id.clone()));
        assert_eq!(job_id_of(&props, &j.encode()), Some(j.id.clone()));
        assert_eq!(job_id_of(&props, b"junk").as_deref(), Some("other"));
        let empty = BasicProperties::default().with_message_id("".into());
        assert_eq!(job_id_of(&empty, b"junk"), None);
    }

    #[test]
    fn a_message_without_any_id_gets_a_unique_key() {
        let a = delivery_key(None, &BasicProperties::default());
        let b = delivery_key(None, &BasicProperties::default());
        assert!(a.starts_with("undecodable-") && a.len() == 12 + 32, "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn a_forged_submitter_header_is_replaced_in_dead_letters() {
        let p = crate::amqp::with_header_str(BasicProperties::default(), SUBMITTER_HEADER, "bob")
            .with_user_id("alice".into())
            .with_delivery_mode(1);
        let dead = dead_letter_properties(&p, "refused", "agent-1", Some("alice"));
        assert_eq!(
            crate::amqp::header_str(&dead, SUBMITTER_HEADER).as_deref(),
            Some("alice")
        );
        assert!(dead.user_id().is_none());
        assert_eq!(*dead.delivery_mode(), Some(2));
        let none = dead_letter_properties(&p, "refused", "agent-1", None);
        assert_eq!(crate::amqp::header_str(&none, SUBMITTER_HEADER), None);
    }

    #[test]
    fn lease_copies_drop_user_id_and_expiration_and_keep_the_loss_counter() {
        let p = crate::amqp::with_header_u32(BasicProperties::default(), "x-vq-losses", 2);
        let forged = crate::amqp::with_header_str(p, SUBMITTER_HEADER, "bob");
        let lease = lease_copy_properties(
            &forged
                .with_user_id("alice".into())
                .with_expiration("100".into()),
            "j1",
            Some("alice"),
        );
        assert!(lease.user_id().is_none());
        assert!(lease.expiration().is_none());
        assert_eq!(lease.message_id().as_ref().map(|m| m.as_str()), Some("j1"));
        assert_eq!(
            crate::amqp::header_str(&lease, SUBMITTER_HEADER).as_deref(),
            Some("alice")
        );
        assert_eq!(crate::amqp::header_u32(&lease, "x-vq-losses"), 2);
    }
}
