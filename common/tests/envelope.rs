//! Golden fixture of the dead-letter envelope (`fixtures/dead-letters.json`):
//! the properties and headers of the dead letters vq makes, as bridges and
//! operators reading `<c>.jobs.dead` see them. One entry per maker: an
//! agent refusing a pool delivery, an agent recovering its own lease copy,
//! the controller fencing a lost agent's lease copy.
//!
//! Regenerate with `VQ_BLESS=1 cargo test -p vq-common --features amqp --test envelope`.

#![cfg(feature = "amqp")]

use std::path::PathBuf;

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde_json::{json, Map, Value};
use vq_common::amqp::envelope::{
    dead_letter_properties, lease_copy_properties, CONTROLLER_DEAD_BY,
};
use vq_common::amqp::{header_str, with_header_str, with_header_u32};
use vq_common::messages::{SCHEMA_HEADER, SUBMITTER_HEADER};
use vq_common::topology::{CLAIM_HEADER, LOSSES_HEADER};

/// A pool delivery as `vq submit` publishes it, plus what a bridge may add
/// and a forged submitter header.
fn pool_delivery() -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(SCHEMA_HEADER.into(), AMQPValue::LongUInt(1));
    h.insert(
        SUBMITTER_HEADER.into(),
        AMQPValue::LongString("mallory".into()),
    );
    h.insert(
        "x-bridge-ref".into(),
        AMQPValue::LongString("pbs:4711".into()),
    );
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("identity".into())
        .with_delivery_mode(1)
        .with_priority(3)
        .with_correlation_id("corr-1".into())
        .with_reply_to("reply-q".into())
        .with_expiration("600000".into())
        .with_message_id("4711.login1".into())
        .with_timestamp(1_767_225_600)
        .with_type("job".into())
        .with_user_id("alice".into())
        .with_app_id("vq-submit".into())
        .with_cluster_id("old".into())
        .with_headers(h)
}

fn render_value(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::LongString(s) => json!({ "longstr": String::from_utf8_lossy(s.as_bytes()) }),
        AMQPValue::ShortString(s) => json!({ "shortstr": s.as_str() }),
        AMQPValue::LongUInt(n) => json!({ "long_uint": n }),
        AMQPValue::LongLongInt(n) => json!({ "long_long_int": n }),
        other => json!({ "other": format!("{other:?}") }),
    }
}

/// Every property, `null` when unset, and the headers by name with their
/// AMQP types.
fn render(p: &BasicProperties) -> Value {
    let s = |v: &Option<lapin::types::ShortString>| v.as_ref().map(|v| v.as_str().to_string());
    let headers: Map<String, Value> = p
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), render_value(v)))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "content_type": s(p.content_type()),
        "content_encoding": s(p.content_encoding()),
        "delivery_mode": p.delivery_mode(),
        "priority": p.priority(),
        "correlation_id": s(p.correlation_id()),
        "reply_to": s(p.reply_to()),
        "expiration": s(p.expiration()),
        "message_id": s(p.message_id()),
        "timestamp": p.timestamp(),
        "type": s(p.kind()),
        "user_id": s(p.user_id()),
        "app_id": s(p.app_id()),
        "cluster_id": s(p.cluster_id()),
        "headers": headers,
    })
}

fn dead_letters() -> Value {
    let pool = pool_delivery();
    let submitter = pool.user_id().as_ref().map(|u| u.to_string());
    let refused = dead_letter_properties(
        &pool,
        "owner nobody is not allowed",
        "vq-cms-1",
        submitter.as_deref(),
    );
    let lease = with_header_str(
        lease_copy_properties(&pool, "4711.login1", Some("alice")),
        CLAIM_HEADER,
        "claim-1",
    );
    let recovered = dead_letter_properties(
        &with_header_u32(lease.clone(), LOSSES_HEADER, 1),
        "node lost: agent vq-cms-1 died, restarted or lost its VM while the job ran; the job is not rerunnable (-r n)",
        "vq-cms-1",
        header_str(&lease, SUBMITTER_HEADER).as_deref(),
    );
    let fenced = with_header_u32(
        dead_letter_properties(
            &lease,
            "node lost 3 times while running the job (last: agent vq-cms-1; limit 3): not run again",
            CONTROLLER_DEAD_BY,
            header_str(&lease, SUBMITTER_HEADER).as_deref(),
        ),
        LOSSES_HEADER,
        3,
    );
    json!({
        "pool_delivery": render(&pool),
        "lease_copy": render(&lease),
        "refused_by_agent": render(&refused),
        "recovered_by_agent": render(&recovered),
        "fenced_by_controller": render(&fenced),
    })
}

#[test]
fn dead_letters_keep_the_documented_envelope() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dead-letters.json");
    let got = dead_letters();
    if std::env::var_os("VQ_BLESS").is_some() {
        let text = serde_json::to_string_pretty(&got).unwrap() + "\n";
        std::fs::write(&path, text).unwrap();
    }
    let want: Value = serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap();
    assert_eq!(
        got,
        want,
        "the dead-letter envelope changed; if on purpose, bless the fixture and update README.md:\n{}",
        serde_json::to_string_pretty(&got).unwrap()
    );
}

#[test]
fn every_dead_letter_names_its_submitter_reason_and_maker_and_drops_user_id() {
    let all = dead_letters();
    for (maker, by) in [
        ("refused_by_agent", "vq-cms-1"),
        ("recovered_by_agent", "vq-cms-1"),
        ("fenced_by_controller", "vq-controller"),
    ] {
        let d = &all[maker];
        assert_eq!(
            d["headers"]["x-vq-submitter"]["longstr"], "alice",
            "{maker}"
        );
        assert_eq!(d["headers"]["x-vq-dead-by"]["longstr"], by, "{maker}");
        assert!(
            d["headers"]["x-vq-reason"]["longstr"].is_string(),
            "{maker}"
        );
        assert_eq!(d["user_id"], Value::Null, "{maker}");
        assert_eq!(d["expiration"], Value::Null, "{maker}");
        assert_eq!(d["delivery_mode"], 2, "{maker}");
        assert_eq!(d["message_id"], "4711.login1", "{maker}");
        assert_eq!(
            d["headers"]["x-bridge-ref"]["longstr"], "pbs:4711",
            "{maker}"
        );
    }
}
