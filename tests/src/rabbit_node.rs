//! A private RabbitMQ node for fault-injection tests: its own node name,
//! epmd, distribution and AMQP ports and data directory, so a test can
//! stop, SIGKILL and restart "the broker" without touching the machine's
//! shared node (DESIGN.md, /work/shared/openstack-fixture/NOTES.md
//! obstacle 8).
//!
//! A start takes about 5-10 s on 2 cores: keep node starts per test small.
//! Needs root (the Debian scripts run the node as the invoking user; the
//! data directory is a private temporary directory).
//!
//! Every node has the test suite's broker accounts
//! ([`crate::accounts::suite`], imported once right after the first start;
//! they live in the node's data directory across restarts): tests log in
//! with [`RabbitNode::role_url`], never as `guest`, which only the harness
//! uses to see that the node is up.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vq_common::topology::Role;

use crate::accounts::{self, BrokerAt};

/// The RabbitMQ server script run in the foreground (avoids the Debian su
/// wrapper).
pub const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// `rabbitmqctl` next to it.
pub const RABBITMQCTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";

/// Settings of a private node.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Global `consumer_timeout`, milliseconds (`None`: RabbitMQ's default
    /// of 30 minutes).
    pub consumer_timeout_ms: Option<u64>,
    /// How often a channel checks its consumer timeouts, milliseconds
    /// (RabbitMQ's `channel_tick_interval`, 60000 by default, so a shorter
    /// `consumer_timeout` needs a shorter tick).
    pub channel_tick_ms: Option<u64>,
    /// How long a start may take before it counts as failed.
    pub start_timeout: Duration,
    /// An AMQPS listener too (`None`: plain AMQP only).
    pub tls: Option<TlsListener>,
}

/// PEM files of an AMQPS listener on 127.0.0.1 (a free port is picked; see
/// [`RabbitNode::tls_port`]). Peers are not asked for certificates
/// (`verify_none`) unless [`TlsListener::require_peer_cert`] is set.
#[derive(Debug, Clone)]
pub struct TlsListener {
    /// CA certificate(s); with `require_peer_cert`, also the CAs a client
    /// certificate must chain to.
    pub cacertfile: PathBuf,
    /// Server certificate.
    pub certfile: PathBuf,
    /// Server private key.
    pub keyfile: PathBuf,
    /// Ask every client for a certificate signed by `cacertfile` and refuse
    /// the TLS handshake without one (`verify_peer` with
    /// `fail_if_no_peer_cert = true`). `false`: `verify_none`.
    pub require_peer_cert: bool,
}

impl TlsListener {
    /// A `verify_none` listener with these PEM files.
    pub fn new(cacertfile: PathBuf, certfile: PathBuf, keyfile: PathBuf) -> Self {
        TlsListener {
            cacertfile,
            certfile,
            keyfile,
            require_peer_cert: false,
        }
    }
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            consumer_timeout_ms: None,
            channel_tick_ms: None,
            start_timeout: Duration::from_secs(60),
            tls: None,
        }
    }
}

/// A private RabbitMQ node. Killed (with its process group and epmd) when
/// dropped.
#[derive(Debug)]
pub struct RabbitNode {
    dir: tempfile::TempDir,
    node: String,
    amqp_port: u16,
    dist_port: u16,
    epmd_port: u16,
    epmd: Option<Child>,
    server: Option<Child>,
    opts: NodeOptions,
    tls_port: Option<u16>,
    /// Duration of the last successful start.
    pub last_start: Duration,
}

/// A TCP port that was free a moment ago on 127.0.0.1.
///
/// # Errors
/// If no port can be bound.
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("bind an ephemeral port")?;
    Ok(l.local_addr()?.port())
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

impl RabbitNode {
    /// Creates the node's directory and configuration, starts its epmd and
    /// the node, and waits until an AMQP client can connect.
    ///
    /// # Errors
    /// If the node does not come up within `opts.start_timeout`.
    pub async fn start_new(opts: NodeOptions) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("vq-rabbit-").tempdir()?;
        let node = format!("vqt{:08x}@localhost", rand::random::<u32>());
        let (amqp_port, dist_port, epmd_port) = (free_port()?, free_port()?, free_port()?);
        for sub in ["mnesia", "log", "home"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let mut conf = format!(
            "listeners.tcp.default = 127.0.0.1:{amqp_port}\n\
             loopback_users.guest = true\n\
             log.console = false\n\
             log.file.level = warning\n\
             vm_memory_high_watermark.relative = 0.2\n\
             disk_free_limit.absolute = 50MB\n"
        );
        if let Some(ms) = opts.consumer_timeout_ms {
            conf.push_str(&format!("consumer_timeout = {ms}\n"));
        }
        let tls_port = match &opts.tls {
            Some(t) => {
                let port = free_port()?;
                let (verify, fail_if_no_peer_cert) = if t.require_peer_cert {
                    ("verify_peer", true)
                } else {
                    ("verify_none", false)
                };
                conf.push_str(&format!(
                    "listeners.ssl.default = 127.0.0.1:{port}\n\
                     ssl_options.cacertfile = {}\n\
                     ssl_options.certfile = {}\n\
                     ssl_options.keyfile = {}\n\
                     ssl_options.verify = {verify}\n\
                     ssl_options.fail_if_no_peer_cert = {fail_if_no_peer_cert}\n",
                    t.cacertfile.display(),
                    t.certfile.display(),
                    t.keyfile.display()
                ));
                Some(port)
            }
            None => None,
        };
        std::fs::write(dir.path().join("rabbitmq.conf"), conf)?;
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n")?;
        let cookie = dir.path().join("home/.erlang.cookie");
        std::fs::write(&cookie, format!("{:016x}", rand::random::<u64>()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400))?;
        }
        let mut n = RabbitNode {
            dir,
            node,
            amqp_port,
            dist_port,
            epmd_port,
            epmd: None,
            server: None,
            opts,
            tls_port,
            last_start: Duration::ZERO,
        };
        n.start_epmd()?;
        n.start().await?;
        accounts::suite()
            .create(|defs| {
                let defs = defs.to_str().context("definitions path is not UTF-8")?;
                n.ctl(&["-q", "import_definitions", defs]).map(drop)
            })
            .context("create the test suite's broker accounts on the private node")?;
        Ok(n)
    }

    /// The node's data directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The node name (`vqt<8 hex>@localhost`).
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// The AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.amqp_port
    }

    /// The AMQPS port on 127.0.0.1, if [`NodeOptions::tls`] was set.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The node's plain AMQP listener with the suite's accounts on it.
    pub fn broker(&self) -> BrokerAt {
        BrokerAt::new(format!("amqp://127.0.0.1:{}/%2f", self.amqp_port))
    }

    /// `amqp://<account>:<password>@127.0.0.1:<port>/%2f` of the suite's
    /// account of `role`.
    pub fn role_url(&self, role: Role) -> String {
        self.broker().url(role)
    }

    /// The node's own administrator (`guest`, loopback only), used only to
    /// see that the node accepts AMQP before the suite's accounts exist.
    fn admin_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    fn start_epmd(&mut self) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("epmd");
        cmd.args([
            "-address",
            "127.0.0.1",
            "-port",
            &self.epmd_port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
        self.epmd = Some(cmd.spawn().context("start epmd")?);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !port_open(self.epmd_port) {
            if Instant::now() > deadline {
                bail!("epmd did not listen on port {}", self.epmd_port);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn env(&self, cmd: &mut Command) {
        let d = self.dir.path();
        let mut erl = String::from("-kernel inet_dist_use_interface {127,0,0,1}");
        if let Some(ms) = self.opts.channel_tick_ms {
            erl.push_str(&format!(" -rabbit channel_tick_interval {ms}"));
        }
        cmd.env("HOME", d.join("home"))
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_CONF_ENV_FILE", "/dev/null")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("rabbit.pid"))
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", erl);
    }

    /// Starts the node (again, on the same data directory and ports) and
    /// waits until an AMQP connection succeeds.
    ///
    /// # Errors
    /// If it is already running or does not come up in time.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt;
        if self.server.is_some() {
            bail!("node {} is already running", self.node);
        }
        let t0 = Instant::now();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("log/console.log"))?;
        let mut cmd = Command::new(RABBITMQ_SERVER);
        self.env(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        self.server = Some(cmd.spawn().context("start rabbitmq-server")?);
        let deadline = t0 + self.opts.start_timeout;
        loop {
            if let Some(st) = self
                .server
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.server = None;
                bail!(
                    "rabbitmq-server exited with {st} during start; see {}",
                    self.dir.path().join("log").display()
                );
            }
            if port_open(self.amqp_port) && self.amqp_ready().await {
                break;
            }
            if Instant::now() > deadline {
                self.kill();
                bail!(
                    "node {} did not accept AMQP within {:?}",
                    self.node,
                    self.opts.start_timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.last_start = t0.elapsed();
        eprintln!(
            "rabbit_node: {} up on port {} in {:.1} s",
            self.node,
            self.amqp_port,
            self.last_start.as_secs_f64()
        );
        Ok(())
    }

    async fn amqp_ready(&self) -> bool {
        let cfg = vq_common::config::BrokerConfig {
            url: self.admin_url(),
            connect_timeout_secs: 2,
            ..Default::default()
        };
        match vq_common::amqp::connect(&cfg, "vq-tests readiness").await {
            Ok(c) => {
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), c.close(200, "ok".into())).await;
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the node process runs.
    pub fn is_running(&mut self) -> bool {
        match self.server.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_none(),
            None => false,
        }
    }

    /// Stops the node cleanly (SIGTERM to the server script's group, then
    /// waits up to 60 s, then SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.server.take() {
            let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pgid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            // Erlang helpers (inet_gethost, erl_child_setup) die with it.
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        }
    }

    /// Kills the node at once: SIGKILL to its whole process group (the
    /// broker crashes; nothing is flushed).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.server.take() {
            let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Runs `rabbitmqctl -n <node> args…` with the node's environment and
    /// returns its stdout.
    ///
    /// # Errors
    /// If it cannot run or exits non-zero.
    pub fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(RABBITMQCTL);
        self.env(&mut cmd);
        cmd.arg("-n").arg(&self.node).args(args);
        let out = cmd.output().context("run rabbitmqctl")?;
        if !out.status.success() {
            bail!(
                "rabbitmqctl {args:?} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Path of the node's log directory.
    pub fn log_dir(&self) -> PathBuf {
        self.dir.path().join("log")
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.kill();
        if let Some(mut e) = self.epmd.take() {
            let pgid = nix::unistd::Pid::from_raw(e.id() as i32);
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
            let _ = e.wait();
        }
    }
}
