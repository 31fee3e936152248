//! Shared test harness: root checks, Unix test users, workspace binaries,
//! unique cluster names on the shared broker, child processes that die with
//! the test, and broker helpers (declare, publish jobs and control
//! messages, tap events, read dead letters).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::StreamExt;
use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};
use vq_common::amqp::{
    confirm_channel, declare_topology, inspect_queue, json_properties, publish_confirmed, subscribe,
};
use vq_common::config::BrokerConfig;
use vq_common::messages::{Control, Job, Message};
use vq_common::topology::{Role, Topology, ALL_AGENT_EVENTS, ALL_JOB_EVENTS};

use crate::accounts::{self, BrokerAt};

/// Whether the test process runs as root.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Returns `true` when running as root; otherwise prints
/// `skipped: needs root` and returns `false`. Root-only tests are also
/// `#[ignore = "needs root"]` and CI runs them as root with
/// `--include-ignored`.
pub fn require_root() -> bool {
    if is_root() {
        true
    } else {
        eprintln!("skipped: needs root");
        false
    }
}

/// A Unix user created for tests.
#[derive(Debug, Clone)]
pub struct TestUser {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory.
    pub home: PathBuf,
}

/// Creates Unix user `name` with `uid`, a home directory and `/bin/bash`
/// (`useradd -m -u UID -s /bin/bash NAME`) unless it exists. Use uids 2001
/// and up for ordinary owners and 500 for `min_uid` tests. Needs root.
///
/// # Errors
/// If `useradd` fails or the user exists with another uid.
pub fn ensure_test_user(name: &str, uid: u32) -> anyhow::Result<TestUser> {
    if nix::unistd::User::from_name(name)?.is_none() {
        let status = Command::new("useradd")
            .args(["-m", "-u", &uid.to_string(), "-s", "/bin/bash", name])
            .status()
            .context("run useradd")?;
        // Another test may have created it concurrently: re-check below.
        if !status.success() && nix::unistd::User::from_name(name)?.is_none() {
            bail!("useradd {name} failed: {status}");
        }
    }
    let u = nix::unistd::User::from_name(name)?.context("user vanished")?;
    if u.uid.as_raw() != uid {
        bail!("user {name} exists with uid {} instead of {uid}", u.uid);
    }
    std::fs::create_dir_all(&u.dir)?;
    nix::unistd::chown(&u.dir, Some(u.uid), Some(u.gid))?;
    Ok(TestUser {
        name: u.name,
        uid,
        gid: u.gid.as_raw(),
        home: u.dir,
    })
}

/// Creates group `name` with `gid` unless it exists and adds `members`
/// (`groupadd`, `usermod -aG`). Needs root.
///
/// # Errors
/// If a command fails.
pub fn ensure_group(name: &str, gid: u32, members: &[&str]) -> anyhow::Result<()> {
    if nix::unistd::Group::from_name(name)?.is_none() {
        let st = Command::new("groupadd")
            .args(["-g", &gid.to_string(), name])
            .status()?;
        if !st.success() && nix::unistd::Group::from_name(name)?.is_none() {
            bail!("groupadd {name} failed: {st}");
        }
    }
    for m in members {
        let st = Command::new("usermod").args(["-aG", name, m]).status()?;
        if !st.success() {
            bail!("usermod -aG {name} {m} failed: {st}");
        }
    }
    Ok(())
}

/// Path of workspace binary `name` (e.g. `jobagent`, `vq-cloudsim`): the
/// env var `VQ_<NAME>_BIN` (upper case, `-` → `_`) if set, else
/// `target/<profile>/<name>` found from the test executable's location.
pub fn bin_path(name: &str) -> PathBuf {
    let var = format!("VQ_{}_BIN", name.to_ascii_uppercase().replace('-', "_"));
    if let Ok(p) = std::env::var(&var) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/<test>-hash → target/debug/<name>
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// Builds workspace binary `bin` of package `package` with cargo (a no-op
/// when it is fresh; once per test process), so tests in another package
/// can run it. Cargo variables of the running test are removed from the
/// nested cargo's environment so it sees the same inputs as a plain
/// `cargo build` and does not rebuild dependencies.
///
/// # Errors
/// If cargo fails.
pub fn build_bin(package: &str, bin: &str) -> anyhow::Result<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let path = bin_path(bin);
    if std::env::var_os(format!(
        "VQ_{}_BIN",
        bin.to_ascii_uppercase().replace('-', "_")
    ))
    .is_some()
    {
        return Ok(path);
    }
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if built.iter().any(|b| b == bin) {
        return Ok(path);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "-p", package, "--bin", bin]);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if (k.starts_with("CARGO_") && k != "CARGO_HOME" && k != "CARGO_TARGET_DIR")
            || k == "OUT_DIR"
            || k.starts_with("RUSTC")
        {
            cmd.env_remove(k);
        }
    }
    let st = cmd.status().context("run cargo build")?;
    if !st.success() {
        bail!("cargo build -p {package} --bin {bin} failed: {st}");
    }
    built.push(bin.to_string());
    Ok(path)
}

/// A random cluster name like `t3f9a0c1d2e`, so tests on a shared broker do
/// not interfere.
pub fn unique_cluster() -> String {
    format!("t{:010x}", rand::random::<u64>() & 0xff_ffff_ffff)
}

/// The machine's shared broker, `VQ_TEST_BROKER_URL` (its address; a user
/// in it is ignored), default `amqp://127.0.0.1:5672/%2f`, with the suite's
/// accounts ([`accounts::suite`]) created on it by `rabbitmqctl
/// import_definitions` on the first call in this test process (root).
///
/// # Errors
/// If the accounts cannot be created (also on every later call).
pub fn shared_broker() -> anyhow::Result<BrokerAt> {
    static CREATED: OnceLock<Result<(), String>> = OnceLock::new();
    CREATED
        .get_or_init(|| {
            accounts::suite()
                .create(accounts::import_shared)
                .map_err(|e| format!("create the test suite's broker accounts: {e:#}"))
        })
        .clone()
        .map_err(anyhow::Error::msg)?;
    Ok(BrokerAt::new(
        std::env::var("VQ_TEST_BROKER_URL").unwrap_or_else(|_| "amqp://127.0.0.1:5672/%2f".into()),
    ))
}

/// The URL the suite's account of `role` logs in with on the
/// [`shared_broker`].
///
/// # Errors
/// As [`shared_broker`].
pub fn broker_url(role: Role) -> anyhow::Result<String> {
    Ok(shared_broker()?.url(role))
}

/// A connection to `broker` as the suite's account of `role`, named
/// `name`, and a confirm channel on it.
///
/// # Errors
/// Broker errors.
pub async fn connect_role(
    broker: &BrokerAt,
    role: Role,
    name: &str,
) -> anyhow::Result<(Connection, Channel)> {
    let cfg = BrokerConfig {
        url: broker.url(role),
        ..Default::default()
    };
    let conn = vq_common::amqp::connect(&cfg, name).await?;
    let ch = confirm_channel(&conn).await?;
    Ok((conn, ch))
}

/// A spawned process that is killed (with its process group when it leads
/// one) when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    group: bool,
}

impl ChildGuard {
    /// Spawns `cmd` in its own process group.
    ///
    /// # Errors
    /// If the spawn fails.
    pub fn spawn(mut cmd: Command) -> anyhow::Result<Self> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        let child = cmd.spawn().with_context(|| format!("spawn {cmd:?}"))?;
        Ok(ChildGuard {
            child: Some(child),
            group: true,
        })
    }

    /// Guards an already spawned child (killed alone, not its group).
    pub fn new(child: Child) -> Self {
        ChildGuard {
            child: Some(child),
            group: false,
        }
    }

    /// Process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends `sig` to the process.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.id() as i32), sig);
    }

    /// Exit status if the process has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits up to `timeout` for the process to end.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            if self.group {
                let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A test's broker connections for one test cluster, each as the suite
/// account of the role whose work it does ([`accounts::suite`]).
pub struct TestBroker {
    /// The controller's connection: it declares the topology (as the
    /// controller does), publishes control messages, taps events, inspects
    /// and cleans up queues.
    pub conn: Connection,
    /// A confirm channel on [`TestBroker::conn`].
    pub ch: Channel,
    /// Names of the test cluster.
    pub topo: Topology,
    pools: Vec<String>,
    /// The submitter's connection and confirm channel, and its user name:
    /// jobs are published there.
    jobs: Option<(Connection, Channel, String)>,
    /// The broker with the suite's accounts ([`TestBroker::connect_at`]).
    at: Option<BrokerAt>,
}

impl TestBroker {
    /// [`TestBroker::connect_at`] the [`shared_broker`].
    ///
    /// # Errors
    /// Broker errors.
    pub async fn connect(cluster: &str, pools: &[&str]) -> anyhow::Result<Self> {
        Self::connect_at(&shared_broker()?, cluster, pools).await
    }

    /// Connects to `broker` as the suite's controller and declares the
    /// whole topology of `cluster` with `pools`, and as the suite's trusted
    /// submitter, which publishes the jobs; dead letters are taken as the
    /// inspector.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn connect_at(
        broker: &BrokerAt,
        cluster: &str,
        pools: &[&str],
    ) -> anyhow::Result<Self> {
        let mut b = Self::connect_url(&broker.url(Role::Controller), cluster, pools).await?;
        let submitter = accounts::suite().of(Role::Submitter);
        let cfg = BrokerConfig {
            url: broker.url_of(submitter),
            ..Default::default()
        };
        let conn = vq_common::amqp::connect(&cfg, "vq-tests submitter").await?;
        let ch = confirm_channel(&conn).await?;
        b.jobs = Some((conn, ch, submitter.user.clone()));
        b.at = Some(broker.clone());
        Ok(b)
    }

    /// Connects with the one account of `url` (e.g. a controller account
    /// of a test's own) and declares the whole topology of `cluster` with
    /// `pools`. Such a broker has no submitter or inspector:
    /// [`TestBroker::publish_job`] and [`TestBroker::take_dead`] fail.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn connect_url(url: &str, cluster: &str, pools: &[&str]) -> anyhow::Result<Self> {
        let cfg = BrokerConfig {
            url: url.into(),
            ..Default::default()
        };
        let conn = vq_common::amqp::connect(&cfg, "vq-tests").await?;
        let ch = confirm_channel(&conn).await?;
        let topo = Topology::new(cluster);
        declare_topology(&ch, &topo, pools.iter().copied()).await?;
        Ok(TestBroker {
            conn,
            ch,
            topo,
            pools: pools.iter().map(|p| p.to_string()).collect(),
            jobs: None,
            at: None,
        })
    }

    /// The submitter's connection: (confirm channel, user name).
    fn submitter(&self) -> anyhow::Result<(&Channel, &str)> {
        self.jobs
            .as_ref()
            .map(|(_, ch, user)| (ch, user.as_str()))
            .context("this TestBroker has no submitter account (connected with connect_url)")
    }

    /// The user name jobs are published as ([`accounts::Suite::submitter`]).
    ///
    /// # Errors
    /// Without a submitter account ([`TestBroker::connect_url`]).
    pub fn submitter_user(&self) -> anyhow::Result<&str> {
        Ok(self.submitter()?.1)
    }

    /// Publishes raw `body` to the jobs exchange for `pool` on the
    /// submitter's connection, with AMQP `user_id` (RabbitMQ refuses any
    /// but the submitter's own, [`TestBroker::submitter_user`]; `None`
    /// sends none) and `message_id`.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn publish_raw_job(
        &self,
        pool: &str,
        body: &[u8],
        user_id: Option<&str>,
        message_id: &str,
    ) -> anyhow::Result<()> {
        let (ch, _) = self.submitter()?;
        let mut props = json_properties::<Job>().with_message_id(message_id.into());
        if let Some(u) = user_id {
            props = props.with_user_id(u.into());
        }
        publish_confirmed(
            ch,
            &self.topo.jobs_exchange(),
            pool,
            body,
            props,
            true,
            Duration::from_secs(10),
        )
        .await?;
        Ok(())
    }

    /// Publishes `job` to its pool as the suite's trusted submitter (AMQP
    /// `user_id` = [`TestBroker::submitter_user`]).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn publish_job(&self, job: &Job) -> anyhow::Result<()> {
        let user = self.submitter_user()?;
        self.publish_raw_job(&job.pool, &job.encode(), Some(user), &job.id)
            .await
    }

    /// Publishes a control message to `agent` as the controller (AMQP
    /// `user_id` = the controller account, which agents started by the
    /// harness list in `control_admins`).
    ///
    /// # Errors
    /// Broker errors (including "unroutable" when the agent has no control
    /// queue yet).
    pub async fn publish_control(&self, agent: &str, msg: &Control) -> anyhow::Result<()> {
        let user = self.conn.status().username();
        self.control_on(&self.ch, &user, agent, msg).await
    }

    /// Publishes `job` to its pool on a connection of its own as `account`
    /// (AMQP `user_id` = its user), e.g. the suite's untrusted submitter.
    ///
    /// # Errors
    /// Broker errors, or no suite broker ([`TestBroker::connect_url`]).
    pub async fn publish_job_as(
        &self,
        account: &accounts::Account,
        job: &Job,
    ) -> anyhow::Result<()> {
        let conn = self
            .connect_account(account, "vq-tests publish_job_as")
            .await?;
        let ch = confirm_channel(&conn).await?;
        let sent = publish_confirmed(
            &ch,
            &self.topo.jobs_exchange(),
            &job.pool,
            &job.encode(),
            json_properties::<Job>()
                .with_message_id(job.id.as_str().into())
                .with_user_id(account.user.as_str().into()),
            true,
            Duration::from_secs(10),
        )
        .await;
        let _ = conn.close(200, "done".into()).await;
        sent?;
        Ok(())
    }

    /// Publishes a control message to `agent` on a connection of its own
    /// as `account` (AMQP `user_id` = its user).
    ///
    /// # Errors
    /// Broker errors, or no suite broker ([`TestBroker::connect_url`]).
    pub async fn publish_control_as(
        &self,
        account: &accounts::Account,
        agent: &str,
        msg: &Control,
    ) -> anyhow::Result<()> {
        let conn = self
            .connect_account(account, "vq-tests publish_control_as")
            .await?;
        let ch = confirm_channel(&conn).await?;
        let sent = self.control_on(&ch, &account.user, agent, msg).await;
        let _ = conn.close(200, "done".into()).await;
        sent
    }

    /// A new connection to this broker as `account`.
    async fn connect_account(
        &self,
        account: &accounts::Account,
        name: &str,
    ) -> anyhow::Result<Connection> {
        let at = self
            .at
            .as_ref()
            .context("this TestBroker has no suite accounts (connected with connect_url)")?;
        let cfg = BrokerConfig {
            url: at.url_of(account),
            ..Default::default()
        };
        Ok(vq_common::amqp::connect(&cfg, name).await?)
    }

    async fn control_on(
        &self,
        ch: &Channel,
        user: &str,
        agent: &str,
        msg: &Control,
    ) -> anyhow::Result<()> {
        publish_confirmed(
            ch,
            &self.topo.control_exchange(),
            agent,
            &msg.encode(),
            // Agents authorise control messages by the broker-validated
            // user_id.
            json_properties::<Control>().with_user_id(user.into()),
            true,
            Duration::from_secs(10),
        )
        .await?;
        Ok(())
    }

    /// Binds an exclusive queue to the events exchange for `job.#` and
    /// `agent.#` ([`subscribe`]: server-named, auto-delete, no acks). Call it
    /// before publishing what you want to observe.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn tap_events(&self) -> anyhow::Result<EventTap> {
        let ch = self.conn.create_channel().await?;
        let consumer = subscribe(
            &ch,
            "",
            &self.topo.events_exchange(),
            &[ALL_JOB_EVENTS, ALL_AGENT_EVENTS],
            "",
        )
        .await?;
        Ok(EventTap {
            _ch: ch,
            consumer,
            seen: Vec::new(),
            message_ids: Vec::new(),
        })
    }

    /// Takes every message now in `<cluster>.jobs.dead` (acking them), as
    /// the suite's inspector (a connection of its own per call).
    ///
    /// # Errors
    /// Broker errors, or no suite broker ([`TestBroker::connect_url`]).
    pub async fn take_dead(&self) -> anyhow::Result<Vec<DeadLetter>> {
        let conn = self
            .connect_account(&accounts::suite().inspector, "vq-tests inspector")
            .await?;
        let got = take_dead_on(&conn, &self.topo).await;
        let _ = conn.close(200, "done".into()).await;
        got
    }

    /// Number of ready messages in `queue`.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn queue_len(&self, queue: &str) -> anyhow::Result<u32> {
        let ch = self.conn.create_channel().await?;
        let q = inspect_queue(&ch, queue, "inspect queue")
            .await?
            .with_context(|| format!("queue {queue} does not exist"))?;
        let n = q.message_count();
        let _ = ch.close(200, "done".into()).await;
        Ok(n)
    }

    /// Deletes the cluster's queues and exchanges (best effort) and closes
    /// the connection.
    pub async fn cleanup(self) {
        let ch = match self.conn.create_channel().await {
            Ok(c) => c,
            Err(_) => return,
        };
        let mut queues = vec![
            self.topo.dead_queue(),
            self.topo.event_log_queue(),
            self.topo.demand_queue(),
            self.topo.held_queue(),
        ];
        queues.extend(self.pools.iter().map(|p| self.topo.pool_queue(p)));
        for q in queues {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for x in [
            self.topo.jobs_exchange(),
            self.topo.dead_exchange(),
            self.topo.events_exchange(),
            self.topo.demand_exchange(),
            self.topo.control_exchange(),
            self.topo.held_exchange(),
        ] {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
        if let Some((conn, _, _)) = &self.jobs {
            let _ = conn.close(200, "test done".into()).await;
        }
        let _ = self.conn.close(200, "test done".into()).await;
    }
}

/// Takes every message now in the dead-letter queue of `topo` on `conn`.
async fn take_dead_on(conn: &Connection, topo: &Topology) -> anyhow::Result<Vec<DeadLetter>> {
    let ch = conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            topo.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let d = m.delivery;
        let mut headers = BTreeMap::new();
        if let Some(h) = d.properties.headers() {
            for (k, v) in h.inner() {
                let s = match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    AMQPValue::ShortString(s) => s.to_string(),
                    other => format!("{other:?}"),
                };
                headers.insert(k.to_string(), s);
            }
        }
        out.push(DeadLetter {
            body: d.data,
            headers,
            message_id: d.properties.message_id().as_ref().map(|m| m.to_string()),
        });
    }
    Ok(out)
}

/// A dead-lettered message.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Original body.
    pub body: Vec<u8>,
    /// Headers rendered as strings.
    pub headers: BTreeMap<String, String>,
    /// AMQP message id.
    pub message_id: Option<String>,
}

/// Events seen on the events exchange.
pub struct EventTap {
    _ch: Channel,
    consumer: Consumer,
    /// Every event received so far: (routing key, JSON body).
    pub seen: Vec<(String, serde_json::Value)>,
    /// The AMQP `message_id` of each event in `seen` (same index), if set.
    pub message_ids: Vec<Option<String>>,
}

impl EventTap {
    /// Waits up to `timeout` for an event whose routing key and body satisfy
    /// `pred` (events seen earlier count too) and returns it.
    ///
    /// # Errors
    /// On timeout, listing the routing keys seen.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&str, &serde_json::Value) -> bool,
    ) -> anyhow::Result<serde_json::Value> {
        if let Some((_, v)) = self.seen.iter().find(|(k, v)| pred(k, v)) {
            return Ok(v.clone());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.recv(deadline, what).await? {
                Some(i) => {
                    let (key, v) = &self.seen[i];
                    if pred(key, v) {
                        return Ok(v.clone());
                    }
                }
                None => {
                    let keys: Vec<String> = self
                        .seen
                        .iter()
                        .filter(|(k, _)| !k.ends_with(".heartbeat"))
                        .map(|(k, v)| {
                            format!(
                                "{k} {}",
                                v.get("job_id").unwrap_or(&serde_json::Value::Null)
                            )
                        })
                        .collect();
                    bail!("timed out after {timeout:?} waiting for {what}; saw (heartbeats omitted): {keys:#?}")
                }
            }
        }
    }

    /// Receives one event before `deadline` and records it: its index in
    /// `seen`, or `None` at the deadline.
    async fn recv(
        &mut self,
        deadline: tokio::time::Instant,
        what: &str,
    ) -> anyhow::Result<Option<usize>> {
        match tokio::time::timeout_at(deadline, self.consumer.next()).await {
            Ok(Some(Ok(d))) => {
                let key = d.routing_key.to_string();
                let v: serde_json::Value =
                    serde_json::from_slice(&d.data).unwrap_or(serde_json::Value::Null);
                self.seen.push((key, v));
                self.message_ids.push(
                    d.properties
                        .message_id()
                        .as_ref()
                        .map(|m| m.to_string())
                        .filter(|m| !m.is_empty()),
                );
                Ok(Some(self.seen.len() - 1))
            }
            Ok(Some(Err(e))) => Err(e.into()),
            Ok(None) => bail!("event consumer ended while waiting for {what}"),
            Err(_) => Ok(None),
        }
    }

    /// Waits up to `timeout` for the next event and records it in `seen`;
    /// returns whether one arrived.
    ///
    /// # Errors
    /// If the consumer fails or ends.
    pub async fn next_event(&mut self, timeout: Duration) -> anyhow::Result<bool> {
        let deadline = tokio::time::Instant::now() + timeout;
        Ok(self.recv(deadline, "the next event").await?.is_some())
    }

    /// Waits for the job event `job.<pool>.<word>` of `job_id`.
    ///
    /// # Errors
    /// On timeout.
    pub async fn job_event(
        &mut self,
        job_id: &str,
        word: &str,
        timeout: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let what = format!("job {job_id} {word}");
        self.wait_for(timeout, &what, |k, v| {
            k.starts_with("job.") && k.ends_with(&format!(".{word}")) && v["job_id"] == job_id
        })
        .await
    }
}

impl EventTap {
    /// Events `job.<pool>.<word>` of `job_id` seen so far.
    pub fn events(&self, job_id: &str, word: &str) -> Vec<&serde_json::Value> {
        job_events(&self.seen, job_id, word)
    }

    /// Final results (any job event but `started`) of `job_id` seen so far.
    pub fn finals(&self, job_id: &str) -> Vec<&serde_json::Value> {
        final_results(&self.seen, job_id)
    }

    /// Final results of `job_id` as a consumer that deduplicates on the
    /// AMQP `message_id` sees them: events with a `message_id` seen before
    /// are dropped, events without one all count.
    pub fn distinct_finals(&self, job_id: &str) -> Vec<&serde_json::Value> {
        let mut ids = std::collections::HashSet::new();
        self.seen
            .iter()
            .zip(&self.message_ids)
            .filter(|((k, v), _)| k.starts_with("job.") && is_final_key(k) && v["job_id"] == job_id)
            .filter(|(_, id)| id.as_ref().is_none_or(|id| ids.insert(id.clone())))
            .map(|((_, v), _)| v)
            .collect()
    }
}

/// Job events `job.<pool>.<word>` of `job_id` among `(routing key, body)`
/// pairs.
pub fn job_events<'a>(
    seen: &'a [(String, serde_json::Value)],
    job_id: &str,
    word: &str,
) -> Vec<&'a serde_json::Value> {
    seen.iter()
        .filter(|(k, v)| {
            k.starts_with("job.") && k.ends_with(&format!(".{word}")) && v["job_id"] == job_id
        })
        .map(|(_, v)| v)
        .collect()
}

/// Whether job-event routing key `key` is a final result's
/// (`finished`, `failed`, `cancelled`; not `queued` or `started`).
pub fn is_final_key(key: &str) -> bool {
    !key.ends_with(".started") && !key.ends_with(".queued")
}

/// Final results (any job event but `queued` and `started`) of `job_id` among
/// `(routing key, body)` pairs.
pub fn final_results<'a>(
    seen: &'a [(String, serde_json::Value)],
    job_id: &str,
) -> Vec<&'a serde_json::Value> {
    seen.iter()
        .filter(|(k, v)| k.starts_with("job.") && is_final_key(k) && v["job_id"] == job_id)
        .map(|(_, v)| v)
        .collect()
}

/// Events read from a durable tap queue ([`TestBroker::durable_tap`]) with
/// `basic.get`: survives broker restarts and never needs a publish, so it
/// also works on a connection the broker would block during an alarm.
#[derive(Debug, Default)]
pub struct DurableTap {
    /// The tap queue.
    pub queue: String,
    /// Every event read so far: (routing key, JSON body).
    pub seen: Vec<(String, serde_json::Value)>,
    /// The AMQP `message_id` of each event in [`DurableTap::seen`] (same
    /// index).
    pub message_ids: Vec<Option<String>>,
}

impl DurableTap {
    /// Reads the tap queue `queue` (declare it with
    /// [`TestBroker::durable_tap`]).
    pub fn new(queue: &str) -> Self {
        DurableTap {
            queue: queue.into(),
            ..Default::default()
        }
    }

    /// Takes what arrived through `b`.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn poll(&mut self, b: &TestBroker) -> anyhow::Result<()> {
        for (key, body, id) in b.drain_queue(&self.queue).await? {
            self.seen.push((key, body));
            self.message_ids.push(id);
        }
        Ok(())
    }

    /// Events of `job_id` matching `pred` (on the routing key) as a consumer
    /// that deduplicates on the AMQP `message_id` sees them (README, "Job
    /// events": an event whose publish outcome was unknown is published
    /// again with the same `message_id`): events with a `message_id` seen
    /// before are dropped, events without one all count.
    fn distinct(&self, job_id: &str, pred: impl Fn(&str) -> bool) -> Vec<&serde_json::Value> {
        let mut ids = std::collections::HashSet::new();
        self.seen
            .iter()
            .zip(&self.message_ids)
            .filter(|((k, v), _)| k.starts_with("job.") && pred(k) && v["job_id"] == job_id)
            .filter(|(_, id)| id.as_ref().is_none_or(|id| ids.insert(id.clone())))
            .map(|((_, v), _)| v)
            .collect()
    }

    /// Number of distinct events `job.<pool>.<word>` of `job_id`
    /// (deduplicated on `message_id`, see [`DurableTap::finals`]).
    pub fn count(&self, job_id: &str, word: &str) -> usize {
        let suffix = format!(".{word}");
        self.distinct(job_id, |k| k.ends_with(&suffix)).len()
    }

    /// Number of events `job.<pool>.<word>` of `job_id` as published,
    /// retransmissions included.
    pub fn count_published(&self, job_id: &str, word: &str) -> usize {
        job_events(&self.seen, job_id, word).len()
    }

    /// Distinct final results of `job_id` (any job event but `started`),
    /// deduplicated on `message_id` as consumers do.
    pub fn finals(&self, job_id: &str) -> Vec<&serde_json::Value> {
        self.distinct(job_id, is_final_key)
    }

    /// Number of events whose routing key ends with `suffix`.
    pub fn keys(&self, suffix: &str) -> usize {
        self.seen
            .iter()
            .filter(|(k, _)| k.ends_with(suffix))
            .count()
    }

    /// Polls through `b` every 200 ms until `pred` holds.
    ///
    /// # Errors
    /// On timeout (listing the job and drain events seen) or broker errors.
    pub async fn wait(
        &mut self,
        b: &TestBroker,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&DurableTap) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.poll(b).await?;
            if pred(self) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                let keys: Vec<String> = self
                    .seen
                    .iter()
                    .filter(|(k, _)| k.starts_with("job.") || k.ends_with(".drained"))
                    .map(|(k, v)| format!("{k} {}", v["job_id"]))
                    .collect();
                bail!("timed out waiting for {what}; events: {keys:#?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A `vq-controller` process against an empty `vq-cloudsim` (pool `max` =
/// 0: it boots nothing). Agents started by a test have no server there, so
/// the controller fences them once their heartbeats stop (heartbeat
/// timeout 2 s, cycle 0.5 s).
pub struct EmptyCloudController {
    /// The test cloud (call `shutdown` at the end).
    pub sim: crate::cloudsim::SimHandle,
    /// The controller process.
    pub guard: ChildGuard,
    _dir: tempfile::TempDir,
}

/// Starts an [`EmptyCloudController`] for `cluster`/`pool` logging in with
/// `url` (a controller account's; the pool's `agent_broker_url` is the same
/// broker with the suite's agent account); its log level is
/// `VQ_TEST_CONTROLLER_LOG` or `log`.
///
/// # Errors
/// If a binary cannot be built, the cloud or the process started.
pub async fn start_controller_on_empty_cloud(
    url: &str,
    cluster: &str,
    pool: &str,
    log: &str,
) -> anyhow::Result<EmptyCloudController> {
    start_controller_on_empty_cloud_at(url, cluster, pool, log, "127.0.0.1:0").await
}

/// [`start_controller_on_empty_cloud`] serving `/healthz` and `/status` on
/// `listen` (e.g. `127.0.0.1:<free port>`).
///
/// # Errors
/// If a binary cannot be built, the cloud or the process started.
pub async fn start_controller_on_empty_cloud_at(
    url: &str,
    cluster: &str,
    pool: &str,
    log: &str,
    listen: &str,
) -> anyhow::Result<EmptyCloudController> {
    start_controller_on_empty_cloud_with(url, cluster, pool, log, listen, "").await
}

/// [`start_controller_on_empty_cloud_at`] with `extra_toml` appended to the
/// controller's config (after the pool's table: start it with a table
/// header, e.g. `[jobs]`).
///
/// # Errors
/// If a binary cannot be built, the cloud or the process started.
pub async fn start_controller_on_empty_cloud_with(
    url: &str,
    cluster: &str,
    pool: &str,
    log: &str,
    listen: &str,
    extra_toml: &str,
) -> anyhow::Result<EmptyCloudController> {
    start_controller_on_cloud(url, cluster, pool, log, listen, extra_toml, |_| {}, |_| {}).await
}

/// [`start_controller_on_empty_cloud_with`] with the test cloud's
/// configuration changed by `sim` (e.g. served over TLS) and the
/// controller's command by `cmd` (more environment, stderr to a file)
/// before it is started.
///
/// # Errors
/// If a binary cannot be built, the cloud or the process started.
#[allow(clippy::too_many_arguments)]
pub async fn start_controller_on_cloud(
    url: &str,
    cluster: &str,
    pool: &str,
    log: &str,
    listen: &str,
    extra_toml: &str,
    sim: impl FnOnce(&mut crate::cloudsim::SimConfig),
    cmd: impl FnOnce(&mut Command),
) -> anyhow::Result<EmptyCloudController> {
    use crate::cloudsim::{Sim, SimConfig};
    let agent_bin = build_bin("vq-jobagent", "jobagent")?;
    let controller_bin = build_bin("vq-controller", "vq-controller")?;
    let dir = tempfile::tempdir()?;
    let agent_cfg = dir.path().join("jobagent.toml");
    std::fs::write(&agent_cfg, format!("cluster = \"{cluster}\"\n"))?;
    let mut sim_config = SimConfig::new(dir.path().join("sim"), &agent_bin, &agent_cfg);
    sim(&mut sim_config);
    let sim = Sim::start(sim_config).await?;
    let agent_url = accounts::suite().agent.url(url);
    let controller_cfg = dir.path().join("controller.toml");
    std::fs::write(
        &controller_cfg,
        format!(
            "cluster = \"{cluster}\"\nlisten = \"{listen}\"\ninterval_secs = 0.5\nheartbeat_timeout_secs = 2.0\n\
             [broker]\nurl = \"{url}\"\n[openstack]\ncloud = \"cloudsim\"\n\
             [pools.{pool}]\nflavor = \"m1.small\"\nimage = \"vq-worker\"\nagent_broker_url = \"{agent_url}\"\nmin = 0\nmax = 0\n{extra_toml}"
        ),
    )?;
    let mut command = Command::new(&controller_bin);
    command
        .arg("--config")
        .arg(&controller_cfg)
        .env("OS_CLIENT_CONFIG_FILE", sim.clouds_yaml())
        .env("OS_CLOUD", "cloudsim")
        .env(
            "RUST_LOG",
            std::env::var("VQ_TEST_CONTROLLER_LOG").unwrap_or_else(|_| log.into()),
        );
    cmd(&mut command);
    let guard = ChildGuard::spawn(command)?;
    Ok(EmptyCloudController {
        sim,
        guard,
        _dir: dir,
    })
}

/// A job for `owner` in `pool` running `script`, with a fresh id.
pub fn job(pool: &str, owner: &str, name: &str, script: &str) -> Job {
    Job {
        schema: vq_common::messages::SCHEMA_VERSION,
        id: format!("{}-{}", rand::random::<u32>(), name),
        name: name.into(),
        owner: owner.into(),
        group: None,
        pool: pool.into(),
        script: script.into(),
        shell: None,
        workdir: None,
        env: BTreeMap::new(),
        stdout: None,
        stderr: None,
        join: Default::default(),
        walltime: None,
        slots: 1,
        mem: None,
        rerunnable: true,
        umask: None,
        submit_host: "submit.test".into(),
        submitted_at: 0,
        depend: Vec::new(),
    }
}

/// The config file of an agent started by the harness: heartbeats every
/// 0.5 s, `extra_toml` (top-level keys), broker `url` with `broker_toml`
/// added to the `[broker]` table, and the suite's trust
/// ([`accounts::Suite::agent_admins_toml`] and
/// [`accounts::Suite::agent_submitters_toml`]: the controller is the admin
/// and requeuer, the suite's submitter a trusted bridge).
pub fn agent_config(url: &str, extra_toml: &str, broker_toml: &str) -> String {
    let suite = accounts::suite();
    format!(
        "heartbeat_secs = 0.5\n{}{extra_toml}\n[broker]\nurl = \"{url}\"\n{broker_toml}\n{}",
        suite.agent_admins_toml(),
        suite.agent_submitters_toml()
    )
}

/// A running jobagent with its config directory.
pub struct AgentProcess {
    /// The process.
    pub guard: ChildGuard,
    /// Agent id.
    pub agent_id: String,
    /// Temporary directory with the config and state dir.
    pub dir: tempfile::TempDir,
}

/// Trials of a randomised fault test: `VQ_FAULT_TRIALS` when set (to run
/// many by hand), else `default` (sized for CI's time budget).
pub fn fault_trials(default: usize) -> usize {
    std::env::var("VQ_FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Starts `jobagent` for `cluster`/`pool` as agent `agent_id` with the
/// config keys in `extra_toml` appended (e.g. `min_uid = 1000`; top-level
/// keys only, see [`agent_config`]), the suite's agent account on the
/// [`shared_broker`], and `env` added to its environment. Its log goes
/// to the test's stderr.
///
/// # Errors
/// If the binary cannot be built or started.
pub fn start_agent(
    cluster: &str,
    pool: &str,
    agent_id: &str,
    extra_toml: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<AgentProcess> {
    start_agent_wrapped(cluster, pool, agent_id, extra_toml, env, &[])
}

/// [`start_agent`] through `wrapper`: the agent's command line is appended
/// to `wrapper` (program first), e.g. `["sh", "-c", "trap '' HUP; exec \"$@\"",
/// "wrap"]`, so a test can start it the way `nohup` or `keyctl session`
/// would. The wrapper must `exec` the agent (the guard signals its pid).
/// An empty `wrapper` runs the agent directly.
///
/// # Errors
/// If the binary cannot be built or started.
pub fn start_agent_wrapped(
    cluster: &str,
    pool: &str,
    agent_id: &str,
    extra_toml: &str,
    env: &[(&str, &str)],
    wrapper: &[&str],
) -> anyhow::Result<AgentProcess> {
    let bin = build_bin("vq-jobagent", "jobagent")?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("jobagent.toml");
    std::fs::write(
        &config,
        agent_config(&broker_url(Role::Agent)?, extra_toml, ""),
    )?;
    // An explicit identity file, so a host's /etc/vq/identity.toml never
    // leaks into tests (and the identity path is exercised).
    let identity = dir.path().join("identity.toml");
    std::fs::write(
        &identity,
        format!("cluster = \"{cluster}\"\npool = \"{pool}\"\nagent_id = \"{agent_id}\"\n"),
    )?;
    let mut cmd = match wrapper.split_first() {
        None => Command::new(bin),
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(bin);
            cmd
        }
    };
    cmd.arg("--config")
        .arg(&config)
        .arg("--identity")
        .arg(&identity)
        .arg("--state-dir")
        .arg(dir.path().join("state"));
    // `VQ_*` variables are config overrides for the agent: the test's own
    // (e.g. VQ_JOBAGENT_BIN, VQ_TEST_BROKER_URL) must not reach it.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("VQ_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env(
        "RUST_LOG",
        std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
    );
    let guard = ChildGuard::spawn(cmd)?;
    Ok(AgentProcess {
        guard,
        agent_id: agent_id.into(),
        dir,
    })
}

/// One agent on a fresh test cluster of the shared broker, for tests of
/// what an agent does with jobs ([`one_agent`]).
pub struct OneAgent {
    /// The cluster's broker connections.
    pub broker: TestBroker,
    /// Events, tapped before the agent started.
    pub tap: EventTap,
    /// The agent, `<cluster>-a1`, up (it has heartbeated).
    pub agent: AgentProcess,
    /// The Unix user `vqt-alice` (uid 2001), to own jobs.
    pub alice: TestUser,
}

/// Declares a fresh cluster with `pool`, taps its events and starts an
/// agent on it with `extra_toml` and `env` ([`start_agent`]), and waits
/// for its first heartbeat. Root (creates `vqt-alice`).
///
/// # Errors
/// If a step fails.
pub async fn one_agent(
    pool: &str,
    extra_toml: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<OneAgent> {
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect(&cluster, &[pool]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-a1");
    let agent = start_agent(&cluster, pool, &agent_id, extra_toml, env)?;
    wait_agent_up(&mut tap, &agent_id).await?;
    Ok(OneAgent {
        broker,
        tap,
        agent,
        alice,
    })
}

/// Waits until `agent` heartbeats on `tap` (it is connected and consuming).
///
/// # Errors
/// On timeout.
pub async fn wait_agent_up(tap: &mut EventTap, agent: &str) -> anyhow::Result<serde_json::Value> {
    tap.wait_for(Duration::from_secs(20), "first heartbeat", |k, v| {
        k.ends_with(".heartbeat") && v["agent"] == agent
    })
    .await
}

/// Closes every broker connection whose client properties contain `needle`
/// (e.g. the connection name `jobagent <agent id>`), as a broker-side
/// failure would, with `rabbitmqctl close_connection`. Returns how many
/// were closed. Needs rabbitmqctl on the test host (root).
///
/// # Errors
/// If rabbitmqctl cannot be run.
pub fn close_broker_connections(needle: &str) -> anyhow::Result<usize> {
    let out = Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .context("run rabbitmqctl list_connections")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut closed = 0;
    for line in text.lines().filter(|l| l.contains(needle)) {
        let Some(pid) = line.split_whitespace().next() else {
            continue;
        };
        let st = Command::new("rabbitmqctl")
            .args(["close_connection", pid, "vq test: simulated broker failure"])
            .output()
            .context("run rabbitmqctl close_connection")?;
        if st.status.success() {
            closed += 1;
        }
    }
    Ok(closed)
}

/// Writes the config and identity files of an agent into `dir` (kept
/// across restarts: same state directory, same identity) with broker `url`,
/// and starts `jobagent` on them. See [`start_agent`].
///
/// # Errors
/// If the binary cannot be built or started.
pub fn start_agent_in(
    url: &str,
    cluster: &str,
    pool: &str,
    agent_id: &str,
    extra_toml: &str,
    dir: &Path,
) -> anyhow::Result<ChildGuard> {
    AgentLaunch {
        url,
        cluster,
        pool,
        agent_id,
        extra_toml,
        broker_toml: "",
        dir,
        stderr: None,
        args: &[],
        env: &[],
    }
    .spawn()
}

/// [`start_agent`] against the broker at `url` (e.g. a private
/// [`crate::rabbit_node::RabbitNode`]).
///
/// # Errors
/// If the binary cannot be built or started.
pub fn start_agent_url(
    url: &str,
    cluster: &str,
    pool: &str,
    agent_id: &str,
    extra_toml: &str,
) -> anyhow::Result<AgentProcess> {
    let dir = tempfile::tempdir()?;
    let guard = start_agent_in(url, cluster, pool, agent_id, extra_toml, dir.path())?;
    Ok(AgentProcess {
        guard,
        agent_id: agent_id.into(),
        dir,
    })
}

impl TestBroker {
    /// Declares the durable queue `name` bound to the events exchange for
    /// `job.#` and `agent.#` (unlike [`TestBroker::tap_events`] it keeps
    /// events across broker restarts and test reconnects); read it with
    /// [`TestBroker::drain_queue`].
    ///
    /// # Errors
    /// Broker errors.
    pub async fn durable_tap(&self, name: &str) -> anyhow::Result<()> {
        self.ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        for key in [ALL_JOB_EVENTS, ALL_AGENT_EVENTS] {
            self.ch
                .queue_bind(
                    name.into(),
                    self.topo.events_exchange().as_str().into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    /// Takes every message now in `queue` (acking them): (routing key, JSON
    /// body, AMQP `message_id`).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn drain_queue(
        &self,
        queue: &str,
    ) -> anyhow::Result<Vec<(String, serde_json::Value, Option<String>)>> {
        let mut out = Vec::new();
        while let Some(m) = self
            .ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await?
        {
            let d = m.delivery;
            let v = serde_json::from_slice(&d.data).unwrap_or(serde_json::Value::Null);
            let id = d.properties.message_id().as_ref().map(ToString::to_string);
            out.push((d.routing_key.to_string(), v, id));
        }
        Ok(out)
    }
}

/// A jobagent start with every knob: broker keys beyond the URL (e.g.
/// `ca_file = "/x/ca.pem"`) and its stderr sent to a file.
#[derive(Debug, Clone, Copy)]
pub struct AgentLaunch<'a> {
    /// Broker URL.
    pub url: &'a str,
    /// Cluster.
    pub cluster: &'a str,
    /// Pool.
    pub pool: &'a str,
    /// Agent id.
    pub agent_id: &'a str,
    /// Top-level config lines (as `extra_toml` of [`start_agent_in`]).
    pub extra_toml: &'a str,
    /// Lines added to the `[broker]` table.
    pub broker_toml: &'a str,
    /// Directory for the config, identity and state directory.
    pub dir: &'a Path,
    /// File the agent's stderr (its log) goes to (`None`: the test's).
    pub stderr: Option<&'a Path>,
    /// Extra command-line arguments (e.g. `--drain-grace-secs`).
    pub args: &'a [&'a str],
    /// Environment variables set for the agent (after the test's `VQ_*`,
    /// `SSL_CERT_FILE` and `SSL_CERT_DIR` are removed).
    pub env: &'a [(&'a str, &'a std::ffi::OsStr)],
}

impl AgentLaunch<'_> {
    /// Writes the config and identity into `dir` and starts `jobagent`.
    ///
    /// # Errors
    /// If the binary cannot be built, a file written, or the process
    /// started.
    pub fn spawn(&self) -> anyhow::Result<ChildGuard> {
        let bin = build_bin("vq-jobagent", "jobagent")?;
        let config = self.dir.join("jobagent.toml");
        std::fs::write(
            &config,
            agent_config(self.url, self.extra_toml, self.broker_toml),
        )?;
        let identity = self.dir.join("identity.toml");
        std::fs::write(
            &identity,
            format!(
                "cluster = \"{}\"\npool = \"{}\"\nagent_id = \"{}\"\n",
                self.cluster, self.pool, self.agent_id
            ),
        )?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(&config)
            .arg("--identity")
            .arg(&identity)
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .args(self.args);
        for (k, _) in std::env::vars_os() {
            let name = k.to_string_lossy();
            if name.starts_with("VQ_") || name == "SSL_CERT_FILE" || name == "SSL_CERT_DIR" {
                cmd.env_remove(k);
            }
        }
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        );
        for (k, v) in self.env {
            cmd.env(k, v);
        }
        if let Some(path) = self.stderr {
            cmd.stderr(std::fs::File::create(path)?);
        }
        ChildGuard::spawn(cmd)
    }
}
