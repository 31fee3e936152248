//! Reconcile against a fake cloud and a fake broker: idempotency, backoff,
//! quota and fencing. The fake broker implements the whole `BrokerApi`
//! (the trait has no default bodies), leases included.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use vq_common::amqp::AmqpError;
use vq_common::config::{ControllerConfig, PoolConfig};
use vq_common::messages::Control;
use vq_controller::act::Messenger;
use vq_controller::broker::{EventSnapshot, FenceReport};
use vq_controller::error::CloudError;
use vq_controller::openstack::{CloudApi, CreateServer, Quota, Server};
use vq_controller::reconcile::{BrokerApi, Controller};

#[derive(Default)]
struct FakeCloud {
    servers: Mutex<Vec<Server>>,
    fail_creates: Mutex<u32>,
    max_instances: Option<u32>,
    creates: Mutex<u32>,
}

impl CloudApi for FakeCloud {
    async fn list_servers(&self, tag: &str) -> Result<Vec<Server>, CloudError> {
        Ok(self
            .servers
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.tags.iter().any(|t| t == tag))
            .cloned()
            .collect())
    }
    async fn create_server(&self, req: &CreateServer) -> Result<String, CloudError> {
        let mut fail = self.fail_creates.lock().unwrap();
        if *fail > 0 {
            *fail -= 1;
            return Err(CloudError::Status {
                op: "POST /servers".into(),
                status: 429,
                message: "slow down".into(),
                retry_after: None,
            });
        }
        *self.creates.lock().unwrap() += 1;
        let ud = String::from_utf8(req.user_data.clone()).unwrap();
        assert!(ud.contains(&req.name), "user-data names the agent");
        let id = format!("srv-{}", req.name);
        self.servers.lock().unwrap().push(Server {
            id: id.clone(),
            name: req.name.clone(),
            status: "BUILD".into(),
            task_state: None,
            created: Some(vq_common::messages::unix_now()),
            metadata: req.metadata.clone(),
            tags: req.tags.clone(),
            fault: None,
        });
        Ok(id)
    }
    async fn delete_server(&self, id: &str) -> Result<(), CloudError> {
        self.servers.lock().unwrap().retain(|s| s.id != id);
        Ok(())
    }
    async fn resolve_flavor(&self, name: &str) -> Result<String, CloudError> {
        Ok(format!("flavor-{name}"))
    }
    async fn resolve_image(&self, name: &str) -> Result<String, CloudError> {
        Ok(format!("image-{name}"))
    }
    async fn quota(&self) -> Result<Quota, CloudError> {
        Ok(Quota {
            max_instances: self.max_instances,
            used_instances: self.servers.lock().unwrap().len() as u32,
            ..Quota::default()
        })
    }
}

#[derive(Default)]
struct FakeBroker {
    depth: Mutex<BTreeMap<String, u64>>,
    sent: Mutex<Vec<(String, Control)>>,
    blocked: Mutex<Option<String>>,
    registry: Mutex<Vec<(String, String)>>,
    /// The fence queue: agents marked (in order, repeats kept).
    fences: Mutex<Vec<String>>,
    listening_secs: Mutex<f64>,
    /// Lease queues: agent id → job ids held.
    leases: Mutex<BTreeMap<String, Vec<String>>>,
    /// Every `fence` call: (agent, loss limit).
    fenced: Mutex<Vec<(String, u32)>>,
    /// Probes published.
    probes: Mutex<u32>,
    /// The event book's agent records.
    agents: Mutex<BTreeMap<String, vq_controller::events::AgentRecord>>,
}

impl Messenger for FakeBroker {
    async fn send_control(&self, agent: &str, msg: &Control) -> Result<(), AmqpError> {
        self.sent.lock().unwrap().push((agent.into(), msg.clone()));
        Ok(())
    }
    async fn mark_fence(&self, agent: &str) -> Result<(), AmqpError> {
        self.fences.lock().unwrap().push(agent.into());
        Ok(())
    }
}

impl BrokerApi for FakeBroker {
    async fn ensure_connected(&self) -> Result<(), AmqpError> {
        Ok(())
    }
    async fn queue_depth(&self, pool: &str) -> Result<u64, AmqpError> {
        Ok(*self.depth.lock().unwrap().get(pool).unwrap_or(&0))
    }
    fn snapshot(&self, _now: Instant) -> EventSnapshot {
        EventSnapshot {
            listening_secs: *self.listening_secs.lock().unwrap(),
            agents: self.agents.lock().unwrap().clone(),
            ..EventSnapshot::default()
        }
    }
    fn blocked(&self) -> Option<String> {
        self.blocked.lock().unwrap().clone()
    }
    async fn probe(&self) -> Result<(), AmqpError> {
        *self.probes.lock().unwrap() += 1;
        Ok(())
    }
    async fn pending_fences(&self) -> Result<Vec<String>, AmqpError> {
        let mut f = self.fences.lock().unwrap().clone();
        f.sort();
        f.dedup();
        Ok(f)
    }
    async fn registered_agents(&self) -> Result<Vec<(String, String)>, AmqpError> {
        Ok(self.registry.lock().unwrap().clone())
    }
    /// As the real one: every lease of `agent` back to its pool (this fake
    /// has no job bodies: all count as rerunnable), the lease queue, the
    /// registry entry and the fence entry gone.
    async fn take_demand(&self, _on: bool) {}
    async fn fence(&self, agent: &str, loss_limit: u32) -> Result<FenceReport, AmqpError> {
        self.fenced
            .lock()
            .unwrap()
            .push((agent.to_string(), loss_limit));
        // This fake knows no job bodies either: each job counts in pool "-".
        let requeued = self
            .leases
            .lock()
            .unwrap()
            .remove(agent)
            .unwrap_or_default()
            .into_iter()
            .map(|job| (job, "-".to_string()))
            .collect();
        self.registry.lock().unwrap().retain(|(a, _)| a != agent);
        self.fences.lock().unwrap().retain(|a| a != agent);
        Ok(FenceReport {
            requeued,
            failed: Vec::new(),
        })
    }
}

fn config(max: u32) -> ControllerConfig {
    let mut cfg = ControllerConfig::default();
    cfg.pools.insert(
        "cms".into(),
        PoolConfig {
            flavor: "m1.tiny".into(),
            image: "cirros".into(),
            agent_broker_url: "amqp://a:b@h/%2f".into(),
            max,
            ..PoolConfig::default()
        },
    );
    cfg
}

fn broker_with_depth(depth: u64) -> FakeBroker {
    let b = FakeBroker::default();
    b.depth.lock().unwrap().insert("cms".into(), depth);
    b
}

#[tokio::test]
async fn rerunning_a_cycle_creates_no_duplicates() {
    let mut ctl = Controller::new(config(10), FakeCloud::default(), broker_with_depth(3));
    let stop = CancellationToken::new();
    let s1 = ctl.cycle(&stop).await;
    assert_eq!(s1.created, 3);
    for _ in 0..3 {
        let s = ctl.cycle(&stop).await;
        assert_eq!(s.created, 0, "{s:?}");
        assert_eq!(s.ok, vec!["cms".to_string()]);
    }
    assert_eq!(*ctl.cloud().creates.lock().unwrap(), 3);
    let servers = ctl.cloud().servers.lock().unwrap().clone();
    assert!(servers.iter().all(|s| s.name.starts_with("vq-cms-")
        && s.metadata["vq-pool"] == "cms"
        && s.tags == vec!["vq-cluster-vq".to_string()]));
    let status = ctl.status.read().unwrap().clone();
    assert_eq!(status.pools["cms"].vms.booting, 3);
    assert_eq!(status.pools["cms"].target, 3);
    assert!(ctl
        .metrics
        .render()
        .contains("vq_servers_created_total{pool=\"cms\"} 3"));
}

#[tokio::test]
async fn a_transient_create_failure_backs_the_pool_off() {
    let cloud = FakeCloud::default();
    *cloud.fail_creates.lock().unwrap() = 1;
    let mut ctl = Controller::new(config(10), cloud, broker_with_depth(2));
    let stop = CancellationToken::new();
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.failed, vec!["cms".to_string()]);
    assert_eq!(s.created, 0, "the first failed boot stops the others");
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.skipped, vec!["cms".to_string()], "backing off: {s:?}");
    assert!(ctl.status.read().unwrap().pools["cms"]
        .last_error
        .as_deref()
        .unwrap()
        .contains("429"));
}

#[tokio::test]
async fn quota_and_max_bound_the_boots() {
    let cloud = FakeCloud {
        max_instances: Some(2),
        ..FakeCloud::default()
    };
    let mut ctl = Controller::new(config(10), cloud, broker_with_depth(50));
    let stop = CancellationToken::new();
    assert_eq!(ctl.cycle(&stop).await.created, 2);
    assert_eq!(ctl.cycle(&stop).await.created, 0);

    let mut ctl = Controller::new(config(4), FakeCloud::default(), broker_with_depth(50));
    assert_eq!(ctl.cycle(&stop).await.created, 4);
    assert_eq!(ctl.cycle(&stop).await.created, 0);
}

#[tokio::test]
async fn after_shutdown_nothing_is_acted_on() {
    let mut ctl = Controller::new(config(10), FakeCloud::default(), broker_with_depth(3));
    let stop = CancellationToken::new();
    stop.cancel();
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.created, 0);
    assert_eq!(ctl.status.read().unwrap().pools["cms"].target, 3);
}

#[tokio::test]
async fn a_broker_alarm_holds_every_pool_without_backoff() {
    let b = broker_with_depth(3);
    *b.blocked.lock().unwrap() = Some("memory".into());
    let mut ctl = Controller::new(config(10), FakeCloud::default(), b);
    let stop = CancellationToken::new();
    for _ in 0..3 {
        let s = ctl.cycle(&stop).await;
        assert_eq!(s.held, vec!["cms".to_string()], "{s:?}");
        assert!(s.failed.is_empty() && s.skipped.is_empty(), "{s:?}");
        assert_eq!(s.created + s.deleted, 0, "{s:?}");
    }
    assert_eq!(*ctl.cloud().creates.lock().unwrap(), 0);
    assert!(ctl.broker().sent.lock().unwrap().is_empty());
    // When the alarm ends the next cycle acts at once (no backoff).
    *ctl.broker().blocked.lock().unwrap() = None;
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.ok, vec!["cms".to_string()], "{s:?}");
    assert_eq!(s.created, 3);
}

#[tokio::test(start_paused = true)]
async fn the_registry_fences_only_unheard_agents_of_its_own_pools_without_a_server() {
    let b = broker_with_depth(0);
    *b.listening_secs.lock().unwrap() = 1e6;
    *b.registry.lock().unwrap() = vec![
        ("lost-mine".into(), "cms".into()),
        ("other-pool".into(), "other".into()),
        ("no-pool".into(), String::new()),
        ("has-server".into(), "cms".into()),
    ];
    let cloud = FakeCloud::default();
    cloud.servers.lock().unwrap().push(Server {
        id: "srv-has-server".into(),
        name: "has-server".into(),
        status: "ACTIVE".into(),
        task_state: None,
        created: Some(vq_common::messages::unix_now()),
        metadata: BTreeMap::new(),
        tags: vec![vq_controller::openstack::cluster_tag(
            &ControllerConfig::default().cluster,
        )],
        fault: None,
    });
    let mut ctl = Controller::new(config(0), cloud, b);
    let stop = CancellationToken::new();
    // Not in the first heartbeat timeout after the controller starts.
    let s = ctl.cycle(&stop).await;
    assert!(ctl.broker().fences.lock().unwrap().is_empty());
    assert!(s.fenced.is_empty(), "{s:?}");
    tokio::time::advance(std::time::Duration::from_secs(3600)).await;
    // Marked and, having no server, fenced in the same cycle: its registry
    // entry and fence mark are gone afterwards.
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.fenced, vec!["lost-mine".to_string()], "{s:?}");
    let limit = ControllerConfig::default().loss_limit;
    assert_eq!(
        *ctl.broker().fenced.lock().unwrap(),
        vec![("lost-mine".to_string(), limit)]
    );
    assert!(ctl.broker().fences.lock().unwrap().is_empty());
    assert!(!ctl
        .broker()
        .registry
        .lock()
        .unwrap()
        .iter()
        .any(|(a, _)| a == "lost-mine"));
}

fn server(name: &str) -> Server {
    Server {
        id: format!("srv-{name}"),
        name: name.into(),
        status: "ACTIVE".into(),
        task_state: None,
        created: Some(vq_common::messages::unix_now()),
        metadata: [
            ("vq-cluster".to_string(), "vq".to_string()),
            ("vq-pool".to_string(), "cms".to_string()),
        ]
        .into(),
        tags: vec![vq_controller::openstack::cluster_tag(
            &ControllerConfig::default().cluster,
        )],
        fault: None,
    }
}

#[tokio::test]
async fn a_fenced_agent_s_leases_are_returned_once_its_server_is_gone() {
    let b = broker_with_depth(0);
    *b.fences.lock().unwrap() = vec!["vq-cms-1".into()];
    b.leases
        .lock()
        .unwrap()
        .insert("vq-cms-1".into(), vec!["j1".into(), "j2".into()]);
    let cloud = FakeCloud::default();
    cloud.servers.lock().unwrap().push(server("vq-cms-1"));
    let mut cfg = config(0);
    cfg.loss_limit = 5;
    let mut ctl = Controller::new(cfg, cloud, b);
    let stop = CancellationToken::new();
    // The server still exists: its agent may still run the jobs.
    let s = ctl.cycle(&stop).await;
    assert!(s.fenced.is_empty(), "{s:?}");
    assert!(ctl.broker().fenced.lock().unwrap().is_empty());
    assert_eq!(ctl.broker().leases.lock().unwrap()["vq-cms-1"].len(), 2);
    // Gone from Nova: the leases go back, with the operator's loss limit.
    ctl.cloud().servers.lock().unwrap().clear();
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.fenced, vec!["vq-cms-1".to_string()], "{s:?}");
    assert_eq!(
        *ctl.broker().fenced.lock().unwrap(),
        vec![("vq-cms-1".to_string(), 5)]
    );
    assert!(ctl.broker().leases.lock().unwrap().is_empty());
    // Once: the fence entry is gone, nothing is fenced again.
    let s = ctl.cycle(&stop).await;
    assert!(s.fenced.is_empty(), "{s:?}");
    assert_eq!(ctl.broker().fenced.lock().unwrap().len(), 1);
    assert!(
        *ctl.broker().probes.lock().unwrap() >= 3,
        "every cycle probes"
    );
}

#[tokio::test]
async fn a_server_deleted_by_the_plan_is_marked_for_fencing_before_the_delete() {
    // An ERROR server is deleted at once; its agent is marked first.
    let b = broker_with_depth(0);
    let cloud = FakeCloud::default();
    let mut broken = server("vq-cms-2");
    broken.status = "ERROR".into();
    cloud.servers.lock().unwrap().push(broken);
    let mut ctl = Controller::new(config(0), cloud, b);
    let stop = CancellationToken::new();
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.deleted, 1, "{s:?}");
    assert_eq!(
        *ctl.broker().fences.lock().unwrap(),
        vec!["vq-cms-2".to_string()]
    );
    // The next cycle sees no server: the mark turns into a fence.
    let s = ctl.cycle(&stop).await;
    assert_eq!(s.fenced, vec!["vq-cms-2".to_string()], "{s:?}");
    assert!(ctl.broker().fences.lock().unwrap().is_empty());
}

/// A heartbeat of idle agent `agent` of pool `cms`, received now.
fn idle_heartbeat(b: &FakeBroker, agent: &str, idle_secs: f64) {
    let hb = serde_json::from_value(serde_json::json!({
        "agent": agent, "pool": "cms", "state": "idle", "slots": 1, "running": [],
        "is_pull": true, "is_del": false, "idle_secs": idle_secs, "interval_secs": 1, "at": 0
    }))
    .expect("a heartbeat");
    b.agents
        .lock()
        .unwrap()
        .entry(agent.into())
        .or_default()
        .heartbeat = Some((hb, Instant::now()));
}

fn asks(b: &FakeBroker) -> usize {
    b.sent
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, c)| matches!(c, Control::AskDelete { .. }))
        .count()
}

#[tokio::test(start_paused = true)]
async fn an_idle_agent_is_asked_only_once_the_pool_s_surplus_has_lasted_the_hysteresis() {
    let mut cfg = config(10);
    let pool = cfg.pools.get_mut("cms").unwrap();
    pool.idle_secs = 1;
    pool.cooldown_secs = 0;
    pool.scale_down_delay_secs = Some(20);
    pool.min_lifetime_secs = 0;
    let b = broker_with_depth(0);
    *b.listening_secs.lock().unwrap() = 1e6;
    idle_heartbeat(&b, "vq-cms-1", 500.0);
    let cloud = FakeCloud::default();
    cloud.servers.lock().unwrap().push(server("vq-cms-1"));
    let mut ctl = Controller::new(cfg, cloud, b);
    let stop = CancellationToken::new();
    let step = |secs: u64| tokio::time::advance(std::time::Duration::from_secs(secs));
    // The surplus starts with the first cycle that sees it.
    ctl.cycle(&stop).await;
    step(15).await;
    idle_heartbeat(ctl.broker(), "vq-cms-1", 515.0);
    ctl.cycle(&stop).await;
    assert_eq!(asks(ctl.broker()), 0, "15 s of surplus, 20 s needed");
    // Demand comes back for a cycle: the surplus ends, its clock restarts.
    ctl.broker().depth.lock().unwrap().insert("cms".into(), 1);
    step(1).await;
    idle_heartbeat(ctl.broker(), "vq-cms-1", 516.0);
    ctl.cycle(&stop).await;
    ctl.broker().depth.lock().unwrap().insert("cms".into(), 0);
    for (after, secs) in [(0, 0), (15, 15), (19, 4)] {
        step(secs).await;
        idle_heartbeat(ctl.broker(), "vq-cms-1", 520.0);
        ctl.cycle(&stop).await;
        assert_eq!(asks(ctl.broker()), 0, "{after} s after the demand went");
    }
    step(1).await;
    idle_heartbeat(ctl.broker(), "vq-cms-1", 521.0);
    ctl.cycle(&stop).await;
    assert_eq!(asks(ctl.broker()), 1, "20 s after the demand went");
}
