//! "VMs": the boot timer, cloud-init's `write_files` for the agent identity,
//! the agent process in the VM's cgroup, and the power-off that kills
//! everything in that cgroup (see [`super::cgroup`]).

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use super::cgroup::{VmCgroup, VmCgroups};
use super::state::{Agent, Phase, SimState};
use super::SimConfig;

/// The file of the `#cloud-config` `write_files` list that carries the
/// agent's identity; it is written to `vms/<id>/identity.toml`.
pub const IDENTITY_PATH: &str = "/etc/vq/identity.toml";

/// The fault Nova records when scheduling fails.
const NO_VALID_HOST: &str = "No valid host was found. There are not enough hosts available.";

/// Why a VM booted without its agent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VmError {
    /// `user_data` is not valid base64 (Nova checks this; kept for safety).
    #[error("decode user_data of server {server_id}")]
    DecodeUserData {
        server_id: String,
        #[source]
        source: base64::DecodeError,
    },
    /// The `#cloud-config` document is not valid YAML.
    #[error("parse #cloud-config of server {server_id}")]
    ParseCloudConfig {
        server_id: String,
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// The identity entry uses an encoding this emulation does not decode.
    #[error(
        "decode write_files entry {path} of server {server_id}: unsupported encoding {encoding}"
    )]
    Encoding {
        server_id: String,
        path: String,
        encoding: String,
    },
    /// The identity entry's base64 content is invalid.
    #[error("decode write_files entry {path} of server {server_id}")]
    DecodeContent {
        server_id: String,
        path: String,
        #[source]
        source: base64::DecodeError,
    },
    /// A file of the VM directory could not be written.
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The agent binary could not be started.
    #[error("start agent {bin} for server {server_id}")]
    Spawn {
        server_id: String,
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// After the boot delay, move the server to ACTIVE (or ERROR) and boot it.
pub(crate) fn schedule_boot(state: Arc<SimState>, server_id: String) {
    tokio::spawn(async move {
        tokio::select! {
            _ = state.cancel.cancelled() => return,
            _ = tokio::time::sleep(state.config.boot_delay) => {}
        }
        let user_data = {
            let mut inner = state.lock();
            let Some(s) = inner.servers.get_mut(&server_id) else {
                return;
            };
            if s.deleting || s.stuck {
                if s.stuck {
                    tracing::info!(%server_id, "fault: server stays in BUILD");
                }
                return;
            }
            let now = SystemTime::now();
            s.updated = now;
            if s.doomed {
                s.phase = Phase::Error {
                    message: NO_VALID_HOST.into(),
                    at: now,
                };
                tracing::info!(%server_id, "fault: server went to ERROR");
                return;
            }
            s.phase = Phase::Active;
            s.launched = Some(now);
            s.user_data.clone()
        };
        tracing::info!(%server_id, "server ACTIVE; booting VM");
        let booted = boot_vm(
            &state.config,
            state.vm_cgroups.as_ref(),
            &server_id,
            user_data.as_deref(),
        );
        let (child, cgroup) = match booted {
            Ok(Some(booted)) => booted,
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(%server_id, error = %error_chain(&error), "VM booted without an agent");
                console_line(
                    &state.config,
                    &server_id,
                    &format!("cloudsim: {}", error_chain(&error)),
                );
                return;
            }
        };
        let Some(pid) = child.id() else {
            return;
        };
        let agent = Agent {
            pid,
            running: true,
            exit: None,
            cgroup,
        };
        let orphaned = {
            let mut inner = state.lock();
            match inner.servers.get_mut(&server_id) {
                Some(s) => {
                    s.agent = Some(agent.clone());
                    s.deleting
                }
                None => true,
            }
        };
        tracing::info!(%server_id, pid, "agent started");
        if orphaned {
            tracing::info!(%server_id, pid, "server deleted while booting; powering off");
            let _ = tokio::task::spawn_blocking(move || power_off(&agent)).await;
        }
        watch_agent(state, server_id, pid, child);
    });
}

/// Reap the agent and record how it ended; the server stays ACTIVE.
fn watch_agent(
    state: Arc<SimState>,
    server_id: String,
    pid: u32,
    mut child: tokio::process::Child,
) {
    tokio::spawn(async move {
        let exit = match child.wait().await {
            Ok(status) => status.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        tracing::info!(%server_id, pid, %exit, "agent exited; server stays ACTIVE");
        let mut inner = state.lock();
        if let Some(agent) = inner
            .servers
            .get_mut(&server_id)
            .and_then(|s| s.agent.as_mut())
            .filter(|a| a.pid == pid)
        {
            agent.running = false;
            agent.exit = Some(exit);
        }
    });
}

/// Power the VM off now and make the server disappear after the delete delay.
pub(crate) fn schedule_delete(state: Arc<SimState>, server_id: String, agent: Option<Agent>) {
    tokio::spawn(async move {
        if let Some(agent) = agent {
            let pid = agent.pid;
            let killed = tokio::task::spawn_blocking(move || power_off(&agent)).await;
            tracing::info!(%server_id, pid, killed = ?killed.ok(), "VM powered off");
        }
        tokio::select! {
            _ = state.cancel.cancelled() => {}
            _ = tokio::time::sleep(state.config.delete_delay) => {}
        }
        state.lock().servers.remove(&server_id);
        tracing::info!(%server_id, "server deleted");
    });
}

fn vm_dir(config: &SimConfig, server_id: &str) -> PathBuf {
    config.state_dir.join("vms").join(server_id)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn open_console(config: &SimConfig, server_id: &str) -> Result<std::fs::File, VmError> {
    let path = vm_dir(config, server_id).join("console.log");
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|source| VmError::Write { path, source })
}

fn console_line(config: &SimConfig, server_id: &str, line: &str) {
    if let Ok(mut f) = open_console(config, server_id) {
        // Best effort, like a console: a failed write loses a line only.
        let _ = writeln!(f, "{line}");
    }
}

/// The identity file's bytes and mode, if the user data is a
/// `#cloud-config` whose `write_files` has an entry for [`IDENTITY_PATH`].
fn identity_from_user_data(
    server_id: &str,
    user_data_b64: &str,
) -> Result<Option<(Vec<u8>, u32)>, VmError> {
    let raw = super::compute::decode_user_data(user_data_b64).map_err(|source| {
        VmError::DecodeUserData {
            server_id: server_id.into(),
            source,
        }
    })?;
    let text = String::from_utf8_lossy(&raw);
    if !text.starts_with("#cloud-config") {
        return Ok(None);
    }
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&text).map_err(|source| VmError::ParseCloudConfig {
            server_id: server_id.into(),
            source,
        })?;
    let Some(files) = doc.get("write_files").and_then(|w| w.as_sequence()) else {
        return Ok(None);
    };
    let Some(entry) = files
        .iter()
        .find(|f| f.get("path").and_then(|p| p.as_str()) == Some(IDENTITY_PATH))
    else {
        return Ok(None);
    };
    let content = entry.get("content").and_then(|c| c.as_str()).unwrap_or("");
    let encoding = entry
        .get("encoding")
        .and_then(|e| e.as_str())
        .unwrap_or("text/plain");
    let bytes = match encoding {
        "text/plain" => content.as_bytes().to_vec(),
        "b64" | "base64" => base64::engine::general_purpose::STANDARD
            .decode(content.replace(['\n', '\r', ' '], ""))
            .map_err(|source| VmError::DecodeContent {
                server_id: server_id.into(),
                path: IDENTITY_PATH.into(),
                source,
            })?,
        other => {
            return Err(VmError::Encoding {
                server_id: server_id.into(),
                path: IDENTITY_PATH.into(),
                encoding: other.into(),
            })
        }
    };
    let mode = entry
        .get("permissions")
        .and_then(|p| p.as_str())
        .and_then(|p| u32::from_str_radix(p.trim_start_matches("0o"), 8).ok())
        .unwrap_or(0o600);
    Ok(Some((bytes, mode)))
}

/// Power-off: SIGKILL everything that runs in the VM, i.e. in its cgroup
/// (then removed), or without one the agent's process tree. Returns how
/// many processes it held or were signalled.
pub(crate) fn power_off(agent: &Agent) -> usize {
    match &agent.cgroup {
        Some(cgroup) => cgroup.kill(),
        None => kill_process_tree(agent.pid),
    }
}

/// Emulate the guest's first boot: cloud-init writes the identity file, the
/// agent unit starts in the VM's cgroup (when `cgroups` are available).
/// `Ok(None)` is a VM without an agent (no user data, or no identity in
/// it): a black hole, as a broken image would be.
fn boot_vm(
    config: &SimConfig,
    cgroups: Option<&VmCgroups>,
    server_id: &str,
    user_data: Option<&str>,
) -> Result<Option<(tokio::process::Child, Option<VmCgroup>)>, VmError> {
    let dir = vm_dir(config, server_id);
    let agent_state = dir.join("state");
    std::fs::create_dir_all(&agent_state).map_err(|source| VmError::Write {
        path: agent_state.clone(),
        source,
    })?;
    console_line(
        config,
        server_id,
        &format!("cloudsim: server {server_id} powered on"),
    );
    let identity = match user_data {
        None => None,
        Some(ud) => identity_from_user_data(server_id, ud)?,
    };
    let Some((bytes, mode)) = identity else {
        tracing::warn!(
            server_id,
            "no {IDENTITY_PATH} in user data; VM runs no agent"
        );
        console_line(
            config,
            server_id,
            &format!("cloudsim: no {IDENTITY_PATH} in user data; no agent"),
        );
        return Ok(None);
    };
    let identity_path = dir.join("identity.toml");
    write_mode(&identity_path, &bytes, mode)?;
    let console = open_console(config, server_id)?;
    let console_err = console.try_clone().map_err(|source| VmError::Write {
        path: dir.join("console.log"),
        source,
    })?;
    let mut cmd = tokio::process::Command::new(&config.agent_bin);
    cmd.arg("--config")
        .arg(&config.agent_config)
        .arg("--identity")
        .arg(&identity_path)
        .arg("--state-dir")
        .arg(&agent_state)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| {
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
            }),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::from(console))
        .stderr(Stdio::from(console_err))
        .process_group(0)
        .kill_on_drop(false);
    if let Some(filter) = std::env::var_os("RUST_LOG") {
        cmd.env("RUST_LOG", filter);
    }
    let cgroup = cgroups.and_then(|c| contain(config, c, server_id, &mut cmd));
    console_line(
        config,
        server_id,
        &format!("cloudsim: starting {}", config.agent_bin.display()),
    );
    let child = cmd.spawn().map_err(|source| {
        if let Some(cgroup) = &cgroup {
            cgroup.kill();
        }
        VmError::Spawn {
            server_id: server_id.into(),
            bin: config.agent_bin.clone(),
            source,
        }
    })?;
    Ok(Some((child, cgroup)))
}

/// Make the VM's cgroup and have `cmd` start in it; on failure the VM runs
/// uncontained, with a warning (as when cgroup v2 is missing).
fn contain(
    config: &SimConfig,
    cgroups: &VmCgroups,
    server_id: &str,
    cmd: &mut tokio::process::Command,
) -> Option<VmCgroup> {
    let joined = cgroups.create(server_id).and_then(|cgroup| {
        cgroup
            .join_on_spawn(cmd)
            .map(|()| cgroup.clone())
            .inspect_err(|_| {
                cgroup.kill();
            })
    });
    match joined {
        Ok(cgroup) => Some(cgroup),
        Err(error) => {
            tracing::warn!(server_id, %error, "no cgroup for the VM; a power-off kills the agent's process tree only");
            console_line(
                config,
                server_id,
                &format!("cloudsim: no cgroup for the VM: {error}"),
            );
            None
        }
    }
}

fn write_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), VmError> {
    let err = |source| VmError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).map_err(err)
}

/// `(pid, ppid, pgid, sid)` of every live (non-zombie) process.
fn scan_proc() -> Vec<(u32, u32, u32, u32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 2..];
            let mut f = rest.split_whitespace();
            let state = f.next()?;
            let ppid = f.next()?.parse().ok()?;
            let pgid = f.next()?.parse().ok()?;
            let sid = f.next()?.parse().ok()?;
            (state != "Z" && state != "X").then_some((pid, ppid, pgid, sid))
        })
        .collect()
}

/// The process `root`, its process group and session, and every descendant
/// (by parent links, so jobs in their own sessions are included).
fn tree(root: u32, procs: &[(u32, u32, u32, u32)]) -> BTreeSet<u32> {
    let mut set: BTreeSet<u32> = procs
        .iter()
        .filter(|(pid, _, pgid, sid)| *pid == root || *pgid == root || *sid == root)
        .map(|p| p.0)
        .collect();
    loop {
        let before = set.len();
        for (pid, ppid, _, _) in procs {
            if set.contains(ppid) {
                set.insert(*pid);
            }
        }
        if set.len() == before {
            return set;
        }
    }
}

/// Power-off: SIGKILL the process tree rooted at `root` (see [`tree`]).
/// The tree is first frozen with SIGSTOP until no new member appears, so a
/// process forking meanwhile cannot escape; then every member is killed.
/// Returns how many processes were signalled.
pub fn kill_process_tree(root: u32) -> usize {
    let me = std::process::id();
    if root <= 1 || root == me {
        return 0;
    }
    let mut members = BTreeSet::new();
    for _ in 0..10 {
        let found: BTreeSet<u32> = tree(root, &scan_proc())
            .into_iter()
            .filter(|p| *p > 1 && *p != me)
            .collect();
        let new: Vec<u32> = found.difference(&members).copied().collect();
        if new.is_empty() {
            break;
        }
        for pid in new {
            if let Ok(p) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
            }
            members.insert(pid);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for pid in &members {
        if let Ok(p) = i32::try_from(*pid) {
            // ESRCH (already gone) is the expected race, not an error.
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
    }
    if let Ok(p) = i32::try_from(root) {
        let _ = killpg(Pid::from_raw(p), Signal::SIGKILL);
    }
    members.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn identity_is_taken_from_write_files() {
        let ud = "#cloud-config\nwrite_files:\n  - path: /etc/other\n    content: x\n  - path: /etc/vq/identity.toml\n    permissions: '0640'\n    content: |\n      pool = \"p\"\n";
        let (bytes, mode) = identity_from_user_data("s", &b64(ud))
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!(String::from_utf8_lossy(&bytes), "pool = \"p\"\n");
        assert_eq!(mode, 0o640);
        let encoded = format!(
            "#cloud-config\nwrite_files:\n- path: /etc/vq/identity.toml\n  encoding: b64\n  content: {}\n",
            b64("agent_id = \"a\"\n")
        );
        let (bytes, mode) = identity_from_user_data("s", &b64(&encoded))
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!(String::from_utf8_lossy(&bytes), "agent_id = \"a\"\n");
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn user_data_without_identity_boots_no_agent() {
        assert!(matches!(
            identity_from_user_data("s", &b64("#!/bin/sh\necho hi\n")),
            Ok(None)
        ));
        assert!(matches!(
            identity_from_user_data("s", &b64("#cloud-config\npackages: [vim]\n")),
            Ok(None)
        ));
        assert!(matches!(
            identity_from_user_data("s", &b64("#cloud-config\nwrite_files: [\n")),
            Err(VmError::ParseCloudConfig { .. })
        ));
    }

    #[test]
    fn tree_follows_parents_groups_and_sessions() {
        // (pid, ppid, pgid, sid): 10 is the agent; 11 its child; 12 a job in
        // its own session under 11; 13 a grandchild of 12; 20 unrelated.
        let procs = [
            (10, 1, 10, 5),
            (11, 10, 10, 5),
            (12, 11, 12, 12),
            (13, 12, 12, 12),
            (20, 1, 20, 20),
        ];
        assert_eq!(tree(10, &procs), BTreeSet::from([10, 11, 12, 13]));
    }
}
