//! vq system tests: the harness that starts RabbitMQ-backed components as
//! real processes, and `vq-cloudsim`, the embedded OpenStack-compatible test
//! cloud.

pub mod accounts;
pub mod amqp_proxy;
pub mod cloudsim;
pub mod harness;
pub mod rabbit_node;
pub mod tcp_proxy;
pub mod test_pki;
