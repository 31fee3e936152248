//! `vq-cloudsim`: an embedded OpenStack-compatible test cloud.
//!
//! It serves the subset of Keystone v3, Nova v2.1 (microversions 2.1 to
//! 2.96, or a lower maximum set by [`SimConfig::compute_max_minor`]), Glance v2
//! and (read-only: one network, one security group, one key pair) Neutron
//! v2.0 that vq uses, over HTTP or, with [`SimConfig::tls`], HTTPS, with the same paths, headers, status
//! codes and JSON shapes as the real services, so the controller's production
//! OpenStack client runs unchanged against it. A server "boots" by running the
//! identity file of its `#cloud-config` user data through cloud-init's
//! `write_files` and starting a local jobagent process in a cgroup of its
//! own; deleting the server kills everything in that cgroup like a
//! power-off (without cgroup v2: the agent's process tree only).
//!
//! Faults a real cloud produces can be injected through the non-OpenStack
//! admin API under `/_sim` (see [`Faults`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), vq_tests::cloudsim::SimError> {
//! use vq_tests::cloudsim::{Sim, SimConfig};
//! let config = SimConfig::new("/tmp/sim", "/usr/bin/jobagent", "/etc/vq/agent.toml");
//! let sim = Sim::start(config).await?;
//! println!("cloud at {}", sim.base_url());
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

mod admin;
mod cgroup;
mod compute;
mod identity;
mod image;
mod network;
mod state;
mod timefmt;
mod tls;
mod vm;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use admin::{FailRule, Faults};
pub use compute::MAX_COMPUTE_MINOR;
pub use image::{CIRROS_IMAGE_ID, WORKER_IMAGE_ID};
pub use network::{KEYPAIR_NAME, NETWORK_ID, NETWORK_NAME};
pub use tls::SimTls;
pub use vm::{kill_process_tree, IDENTITY_PATH};

use state::SimState;

/// Name of the cloud written into `clouds.yaml`.
pub const CLOUD_NAME: &str = "cloudsim";
/// Name of the application-credential cloud written into `clouds.yaml` when
/// an application credential is configured.
pub const APP_CRED_CLOUD_NAME: &str = "cloudsim-appcred";
/// Region of every catalog endpoint.
pub const REGION: &str = "RegionOne";

/// Everything the test cloud needs to start.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Directory for `clouds.yaml` and the per-VM directories `vms/<id>/`.
    pub state_dir: PathBuf,
    /// The jobagent binary started in each booted "VM".
    pub agent_bin: PathBuf,
    /// The agent configuration file passed as `--config`.
    pub agent_config: PathBuf,
    /// How long a new server stays in BUILD before it becomes ACTIVE.
    pub boot_delay: Duration,
    /// How long a deleted server stays visible (task_state `deleting`).
    pub delete_delay: Duration,
    /// Instance quota of the project (Nova's `instances`, default 10).
    pub quota_instances: u32,
    /// Core quota of the project (Nova's `cores`, default 20).
    pub quota_cores: u32,
    /// RAM quota of the project in MiB (Nova's `ram`, default 51200).
    pub quota_ram_mb: u32,
    /// Lifetime of issued tokens.
    pub token_ttl: Duration,
    /// Keystone user name (domain `Default`).
    pub user: String,
    /// The user's password.
    pub password: String,
    /// The user's project (domain `Default`).
    pub project: String,
    /// Application credential `(id, secret)` accepted for the user's project.
    pub app_cred: Option<(String, String)>,
    /// When the application credential expires (Keystone's `expires_at`;
    /// `None`: never). Tokens it gets expire no later, as Keystone caps
    /// them.
    pub app_cred_expires_at: Option<std::time::SystemTime>,
    /// Highest compute microversion served is `2.<compute_max_minor>`
    /// (default [`MAX_COMPUTE_MINOR`], 96). The version document says so and
    /// a request for a higher one is answered 406, as an older Nova does.
    pub compute_max_minor: u32,
    /// Serve HTTPS with this certificate instead of HTTP (`None`: HTTP).
    /// Every URL it hands out (auth_url, catalog, links) is then
    /// `https://`.
    pub tls: Option<SimTls>,
}

impl SimConfig {
    /// A configuration with the defaults of the `vq-cloudsim` binary: listen
    /// on a free loopback port, boot in 1 s, quota of 10 instances, tokens
    /// valid for an hour, user `demo` / `demo-secret` in project `demo`.
    pub fn new(
        state_dir: impl Into<PathBuf>,
        agent_bin: impl Into<PathBuf>,
        agent_config: impl Into<PathBuf>,
    ) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            state_dir: state_dir.into(),
            agent_bin: agent_bin.into(),
            agent_config: agent_config.into(),
            boot_delay: Duration::from_secs(1),
            delete_delay: Duration::from_millis(500),
            quota_instances: 10,
            quota_cores: 20,
            quota_ram_mb: 51200,
            token_ttl: Duration::from_secs(3600),
            user: "demo".into(),
            password: "demo-secret".into(),
            project: "demo".into(),
            app_cred: None,
            app_cred_expires_at: None,
            compute_max_minor: MAX_COMPUTE_MINOR,
            tls: None,
        }
    }
}

/// Why the test cloud could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The state directory could not be created.
    #[error("cannot create state directory {path}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TLS certificate or key of [`SimConfig::tls`] is unusable.
    #[error("cannot use the TLS certificate {cert} and key {key}: {problem}")]
    Tls {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// `clouds.yaml` could not be written.
    #[error("cannot write {path}")]
    CloudsYaml {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Entry point of the test cloud.
pub struct Sim;

impl Sim {
    /// Bind, write `clouds.yaml` into the state directory and serve in the
    /// background until [`SimHandle::shutdown`] (or drop of the handle).
    ///
    /// Errors: [`SimError`] if the state directory, the socket or
    /// `clouds.yaml` cannot be set up.
    pub async fn start(config: SimConfig) -> Result<SimHandle, SimError> {
        std::fs::create_dir_all(config.state_dir.join("vms")).map_err(|source| {
            SimError::StateDir {
                path: config.state_dir.clone(),
                source,
            }
        })?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| SimError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| SimError::Bind {
            addr: config.listen,
            source,
        })?;
        let acceptor = match &config.tls {
            None => None,
            Some(t) => Some(t.acceptor()?),
        };
        let clouds_yaml = config.state_dir.join("clouds.yaml");
        std::fs::write(&clouds_yaml, clouds_yaml_text(&config, addr)).map_err(|source| {
            SimError::CloudsYaml {
                path: clouds_yaml.clone(),
                source,
            }
        })?;

        let cancel = CancellationToken::new();
        let state = Arc::new(SimState::new(config, addr, cancel.clone()));
        let app = router(state.clone());
        let stop = cancel.clone();
        let server = tokio::spawn(async move {
            let result = match acceptor {
                None => {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move { stop.cancelled().await })
                        .await
                }
                Some(acceptor) => {
                    axum::serve(tls::TlsListener::new(listener, acceptor), app)
                        .with_graceful_shutdown(async move { stop.cancelled().await })
                        .await
                }
            };
            if let Err(error) = result {
                tracing::error!(%error, "cloudsim HTTP server failed");
            }
        });
        tracing::info!(%addr, "cloudsim listening");
        Ok(SimHandle {
            addr,
            clouds_yaml,
            state,
            cancel,
            server: Some(server),
        })
    }
}

/// A running test cloud. Dropping it kills every VM's agent and stops the
/// server; [`SimHandle::shutdown`] does the same and waits for the server.
pub struct SimHandle {
    addr: SocketAddr,
    clouds_yaml: PathBuf,
    state: Arc<SimState>,
    cancel: CancellationToken,
    server: Option<JoinHandle<()>>,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR` (`https://` with [`SimConfig::tls`]), the root of
    /// every endpoint.
    pub fn base_url(&self) -> String {
        self.state.base()
    }

    /// Keystone's URL, `http://ADDR/identity/v3` (the `auth_url`).
    pub fn auth_url(&self) -> String {
        format!("{}/identity/v3", self.base_url())
    }

    /// The `clouds.yaml` written at start.
    pub fn clouds_yaml(&self) -> &Path {
        &self.clouds_yaml
    }

    /// Stop every VM (SIGKILL of everything in its cgroup, or of its
    /// agent's process tree), then stop serving and wait for the server
    /// task.
    pub async fn shutdown(mut self) {
        self.state.stop_all_vms();
        self.cancel.cancel();
        if let Some(server) = self.server.take() {
            if let Err(error) = server.await {
                tracing::warn!(%error, "cloudsim server task ended abnormally");
            }
        }
        tracing::info!("cloudsim stopped");
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.state.stop_all_vms();
            self.cancel.cancel();
        }
    }
}

fn router(state: Arc<SimState>) -> Router {
    let openstack = Router::new()
        .merge(identity::router(state.clone()))
        .merge(compute::router(state.clone()))
        .merge(image::router(state.clone()))
        .merge(network::router(state.clone()))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admin::inject_faults,
        ));
    openstack
        .merge(admin::router(state.clone()))
        .fallback(not_found)
}

async fn not_found(uri: axum::http::Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    compute::NovaFault::new(
        axum::http::StatusCode::NOT_FOUND,
        format!("The resource could not be found: {}", uri.path()),
    )
    .into_response()
}

fn clouds_yaml_text(config: &SimConfig, addr: SocketAddr) -> String {
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let auth_url = format!("{scheme}://{addr}/identity/v3");
    let mut clouds = serde_json::Map::new();
    clouds.insert(
        CLOUD_NAME.into(),
        serde_json::json!({
            "auth": {
                "auth_url": auth_url,
                "username": config.user,
                "password": config.password,
                "project_name": config.project,
                "user_domain_name": "Default",
                "project_domain_name": "Default",
            },
            "region_name": REGION,
            "interface": "public",
            "identity_api_version": 3,
        }),
    );
    if let Some((id, secret)) = &config.app_cred {
        clouds.insert(
            APP_CRED_CLOUD_NAME.into(),
            serde_json::json!({
                "auth_type": "v3applicationcredential",
                "auth": {
                    "auth_url": auth_url,
                    "application_credential_id": id,
                    "application_credential_secret": secret,
                },
                "region_name": REGION,
                "interface": "public",
                "identity_api_version": 3,
            }),
        );
    }
    let doc = serde_json::json!({ "clouds": clouds });
    serde_yaml_ng::to_string(&doc).unwrap_or_else(|_| doc.to_string())
}
