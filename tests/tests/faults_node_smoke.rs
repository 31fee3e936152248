//! The private RabbitMQ node used by the fault tests starts, is killed and
//! restarts on the same data and port.

use vq_tests::harness::require_root;
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_private_node_survives_kill_and_restart() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let mut node = RabbitNode::start_new(NodeOptions {
        consumer_timeout_ms: Some(5000),
        ..Default::default()
    })
    .await?;
    let first = node.last_start;
    let out = node.ctl(&["eval", "application:get_env(rabbit, consumer_timeout)."])?;
    assert!(out.contains("5000"), "{out}");
    node.kill();
    assert!(!node.is_running());
    node.start().await?;
    eprintln!("first start {first:?}, restart after kill {:?}", node.last_start);
    node.stop();
    Ok(())
}
