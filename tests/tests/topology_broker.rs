//! `vq_common::amqp` declares the topology on the shared RabbitMQ under a
//! random cluster name, as the controller does: with the suite's
//! controller account and its documented permissions.
//!
//! Root (rabbitmqctl creates the broker accounts): `cargo test -p vq-tests
//! --test topology_broker -- --include-ignored`.

use std::time::Duration;

use vq_common::amqp::{self, AmqpError};
use vq_common::config::BrokerConfig;
use vq_common::messages::{Demand, Message};
use vq_common::topology::{ArgValue, Role, Topology};
use vq_tests::harness::{broker_url, require_root, unique_cluster};

fn broker() -> BrokerConfig {
    BrokerConfig {
        url: broker_url(Role::Controller).unwrap(),
        ..BrokerConfig::default()
    }
}

fn cluster() -> String {
    unique_cluster()
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn topology_is_declared_idempotently_and_routes_demand() {
    if !require_root() {
        return;
    }
    let conn = amqp::connect(&broker(), "vq-common-test").await.unwrap();
    let ch = amqp::confirm_channel(&conn).await.unwrap();
    let topo = Topology::new(cluster());
    amqp::declare_topology(&ch, &topo, ["a", "b"])
        .await
        .unwrap();
    amqp::declare_topology(&ch, &topo, ["a", "b"])
        .await
        .unwrap();

    let demand = Demand {
        schema: 1,
        pool: "a".into(),
        queued: 3,
        running: 1,
        at: 0.0,
        source: "test".into(),
    };
    amqp::publish_message(
        &ch,
        &topo.demand_exchange(),
        "a",
        &demand,
        true,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let got = ch
        .basic_get(topo.demand_queue().as_str().into(), Default::default())
        .await
        .unwrap()
        .expect("demand routed to the demand queue");
    assert_eq!(Demand::decode(&got.delivery.data).unwrap(), demand);

    // A job for a pool that does not exist is refused, not dropped.
    let err = amqp::publish_confirmed(
        &ch,
        &topo.jobs_exchange(),
        "nosuchpool",
        b"{}",
        Default::default(),
        true,
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, AmqpError::Unroutable { .. }), "{err}");

    // Held jobs: routed by pool into the one held queue, refused for a
    // pool the controller does not serve.
    for pool in ["a", "b"] {
        amqp::publish_confirmed(
            &ch,
            &topo.held_exchange(),
            pool,
            pool.as_bytes(),
            Default::default(),
            true,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    }
    // (A single-active-consumer quorum queue refuses basic.get: count.)
    let held = amqp::inspect_queue(&ch, &topo.held_queue(), "inspect the held queue")
        .await
        .unwrap()
        .expect("the held queue exists");
    assert_eq!(held.message_count(), 2, "both held jobs routed");
    let err = amqp::publish_confirmed(
        &ch,
        &topo.held_exchange(),
        "nosuchpool",
        b"{}",
        Default::default(),
        true,
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, AmqpError::Unroutable { .. }), "{err}");

    for q in [
        topo.held_queue(),
        topo.pool_queue("a"),
        topo.pool_queue("b"),
        topo.dead_queue(),
        topo.event_log_queue(),
        topo.demand_queue(),
    ] {
        ch.queue_delete(q.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    conn.close(200, "done".into()).await.ok();
}

#[tokio::test]
#[ignore = "needs root (rabbitmqctl creates the broker accounts)"]
async fn a_queue_declared_with_other_arguments_names_the_argument() {
    if !require_root() {
        return;
    }
    let conn = amqp::connect(&broker(), "vq-common-test").await.unwrap();
    let ch = amqp::confirm_channel(&conn).await.unwrap();
    let topo = Topology::new(cluster());
    amqp::declare_exchanges(&ch, &topo).await.unwrap();
    let q = topo.pool_queue("x");
    let classic = vec![("x-max-length", ArgValue::Int(5))];
    amqp::declare_bound_queue(&ch, &q, &classic, &topo.jobs_exchange(), "x")
        .await
        .unwrap();
    let ch2 = amqp::confirm_channel(&conn).await.unwrap();
    let err = amqp::declare_pool_queue(&ch2, &topo, "x")
        .await
        .unwrap_err();
    let text = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    eprintln!("{text}");
    assert!(text.contains(&q), "{text}");
    assert!(text.contains("PRECONDITION_FAILED"), "{text}");
    assert!(!err.is_transient());
    let ch3 = amqp::confirm_channel(&conn).await.unwrap();
    ch3.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    conn.close(200, "done".into()).await.ok();
}
