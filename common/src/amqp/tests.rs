//! Unit tests of [`super`].

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
