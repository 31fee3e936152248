//! `vq pools`: per-pool counts from the controller's `GET /status`.
//!
//! The document is read as untyped JSON on purpose: the CLI must keep
//! working with controllers that add or drop fields, so every missing value
//! prints as `-`. Expected shape (see `controller/src/status.rs`):
//! `{"cluster": …, "pools": {"<pool>": {"queued", "running", "target",
//! "vms": {"booting", "active", "draining", "error"},
//! "agents": {"idle", "busy", "draining"}, "last_error", "obstacle"}}}`.

use std::time::Duration;

use serde_json::Value;

use crate::error::CliError;
use crate::settings::Settings;

/// Timeout of the status request.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

fn num(v: &Value, path: &[&str]) -> String {
    let mut cur = v;
    for p in path {
        match cur.get(p) {
            Some(next) => cur = next,
            None => return "-".into(),
        }
    }
    match cur {
        Value::Number(n) => n.to_string(),
        _ => "-".into(),
    }
}

/// Renders the pools table from a status document; `None` if the document
/// has no `pools` object.
pub fn render(status: &Value) -> Option<String> {
    render_with(status, false)
}

/// [`render`], and with `verbose` (`vq pools -v`) each pool's line followed
/// by its servers as in `vq nodes` ([`crate::nodes::server_table`],
/// indented, with their drain reasons) and by the pool's last error and
/// obstacle, instead of those coming after the table.
pub fn render_with(status: &Value, verbose: bool) -> Option<String> {
    let pools = status.get("pools")?.as_object()?;
    if pools.is_empty() {
        return Some("no pools\n".into());
    }
    let header = [
        "Pool",
        "Queued",
        "Running",
        "Target",
        "VMs boot/act/drain/err",
        "Agents idle/busy/drain",
    ];
    let mut rows: Vec<[String; 6]> = Vec::new();
    let mut all_errors = Vec::new();
    // Per pool (verbose): its server table and its error lines.
    let mut details: Vec<String> = Vec::new();
    for (name, p) in pools {
        let mut errors_of_pool = Vec::new();
        let errors = &mut errors_of_pool;
        rows.push([
            name.clone(),
            num(p, &["queued"]),
            num(p, &["running"]),
            num(p, &["target"]),
            ["booting", "active", "draining", "error"]
                .map(|k| num(p, &["vms", k]))
                .join("/"),
            ["idle", "busy", "draining"]
                .map(|k| num(p, &["agents", k]))
                .join("/"),
        ]);
        if let Some(err) = p.get("last_error").and_then(Value::as_str) {
            errors.push(format!("{name}: last error: {err}\n"));
        }
        if let Some(why) = p.get("obstacle").and_then(Value::as_str) {
            // The controller's planner limits hold some boots back; every
            // other obstacle stops them (controller/src/status.rs).
            let heading = match p.get("obstacle_kind").and_then(Value::as_str) {
                Some("max" | "quota" | "boot-cooldown") => "boots held back",
                _ => "boots stopped",
            };
            errors.push(format!("{name}: {heading}: {why}\n"));
        }
        if verbose {
            let servers = crate::nodes::servers(status, Some(name));
            let mut d = if servers.is_empty() {
                "  no servers\n".to_string()
            } else {
                crate::nodes::server_table(&servers, false, "  ")
            };
            for e in &errors_of_pool {
                d.push_str("  ");
                d.push_str(e);
            }
            details.push(d);
        } else {
            all_errors.append(&mut errors_of_pool);
        }
    }
    let mut widths = header.map(str::len);
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
            // Left-align the pool name, right-align the numbers.
            if i == 0 {
                s.push_str(&format!("{c:<w$}  "));
            } else {
                s.push_str(&format!("{c:>w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&header);
    for (i, r) in rows.iter().enumerate() {
        out.push_str(&line(&r.iter().map(String::as_str).collect::<Vec<_>>()));
        if let Some(d) = details.get(i) {
            out.push_str(d);
        }
    }
    for e in all_errors {
        out.push_str(&e);
    }
    Some(out)
}

/// How long [`pool_names`] waits for the controller: it only improves an
/// error message.
pub const HINT_TIMEOUT: Duration = Duration::from_secs(3);

/// The pool names of the controller's `/status` (sorted), or `None` if the
/// controller does not answer within [`HINT_TIMEOUT`], serves another
/// cluster or names no `pools` object. For error messages ("no pool named …; pools: a, b").
pub async fn pool_names(settings: &Settings) -> Option<Vec<String>> {
    let status = tokio::time::timeout(HINT_TIMEOUT, fetch_status(settings))
        .await
        .ok()?
        .ok()?;
    // Another cluster's controller does not know this cluster's pools.
    if status.get("cluster").and_then(Value::as_str) != Some(settings.cluster.as_str()) {
        return None;
    }
    let mut names: Vec<String> = status.get("pools")?.as_object()?.keys().cloned().collect();
    names.sort();
    Some(names)
}

/// Fetches `{controller}/status`.
///
/// # Errors
/// [`CliError::Controller`] if unreachable or not 2xx,
/// [`CliError::ControllerAnswer`] if the body is not JSON.
pub async fn fetch_status(settings: &Settings) -> Result<Value, CliError> {
    let url = format!("{}/status", settings.controller_url);
    let err = |source| CliError::Controller {
        url: url.clone(),
        source,
    };
    let client = reqwest::Client::builder()
        .timeout(STATUS_TIMEOUT)
        .build()
        .map_err(err)?;
    let resp = client
        .get(&url)
        .header("accept", "application/json")
        .send()
        .await
        .map_err(err)?
        .error_for_status()
        .map_err(err)?;
    let body = resp.bytes().await.map_err(err)?;
    serde_json::from_slice(&body).map_err(|e| CliError::ControllerAnswer {
        url: url.clone(),
        problem: format!("not JSON: {e}"),
    })
}

/// What `vq pools` (`verbose`: `vq pools -v`) does.
///
/// # Errors
/// [`CliError`].
pub async fn run(settings: &Settings, verbose: bool) -> Result<i32, CliError> {
    let status = fetch_status(settings).await?;
    let table = render_with(&status, verbose).ok_or_else(|| CliError::ControllerAnswer {
        url: format!("{}/status", settings.controller_url),
        problem: "no \"pools\" object".into(),
    })?;
    print!("{}", crate::term::printable_lines(&table));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_render_with_missing_fields_as_dashes() {
        let status = serde_json::json!({
            "cluster": "vq",
            "pools": {
                "cms": {"queued": 12, "running": 4, "target": 4,
                        "vms": {"booting": 1, "active": 3, "draining": 0, "error": 0},
                        "agents": {"idle": 0, "busy": 3, "draining": 0},
                        "last_error": null},
                "atlas": {"queued": 0, "last_error": "quota exceeded",
                          "obstacle": "server x is missing from the listings"}
            }
        });
        let text = render(&status).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("Pool "));
        assert!(
            lines[1].starts_with("atlas") && lines[1].contains("-/-/-/-"),
            "{text}"
        );
        assert!(
            lines[2].contains("1/3/0/0") && lines[2].contains("0/3/0"),
            "{text}"
        );
        assert_eq!(lines[3], "atlas: last error: quota exceeded");
        assert_eq!(
            lines[4],
            "atlas: boots stopped: server x is missing from the listings"
        );
        assert!(render(&serde_json::json!({"x": 1})).is_none());
        assert_eq!(
            render(&serde_json::json!({"pools": {}})).unwrap(),
            "no pools\n"
        );
    }
    #[test]
    fn verbose_lists_each_pools_servers_obstacle_and_drain_reasons_under_its_line() {
        let status = serde_json::json!({
            "cluster": "vq",
            "pools": {
                "atlas": {"queued": 3, "running": 0, "target": 1,
                          "obstacle": "quota exhausted: 10/10 instances; 1 more VM(s) wanted, 0 allowed",
                          "obstacle_kind": "quota", "servers": []},
                "cms": {"queued": 0, "running": 1, "target": 2, "servers": [
                    {"name": "vq-cms-1a2b", "status": "ACTIVE", "agent_state": "busy",
                     "running": 1, "jobs": ["17-sim"], "age_secs": 61, "heartbeat_age_secs": 3},
                    {"name": "vq-cms-3c4d", "status": "ACTIVE", "agent_state": "draining",
                     "running": 0, "jobs": [], "age_secs": 70, "heartbeat_age_secs": 1,
                     "drain_reason": "kernel update"}
                ]}
            }
        });
        let text = render_with(&status, true).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("atlas "), "{text}");
        assert_eq!(lines[2], "  no servers", "{text}");
        assert_eq!(
            lines[3],
            "  atlas: boots held back: quota exhausted: 10/10 instances; 1 more VM(s) wanted, 0 allowed"
        );
        assert!(lines[4].starts_with("cms "), "{text}");
        assert!(
            lines[5].starts_with("  Server ") && !lines[5].contains("Pool"),
            "{text}"
        );
        let cells: Vec<&str> = lines[6].split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "vq-cms-1a2b",
                "ACTIVE",
                "busy",
                "17-sim",
                "1m01s",
                "3s",
                "-"
            ]
        );
        assert!(lines[7].ends_with("kernel update"), "{text}");
        assert_eq!(lines.len(), 8, "{text}");
        // Without -v: no server lines, the obstacle after the table.
        let short = render(&status).unwrap();
        assert_eq!(short.lines().count(), 4, "{short}");
        assert!(!short.contains("vq-cms-1a2b"));
    }

    #[test]
    fn the_controllers_own_status_document_renders() {
        use vq_controller::status::{AgentCounts, PoolStatus, StatusReport, VmCounts};
        let mut report = StatusReport::default();
        report.pools.insert(
            "default".into(),
            PoolStatus {
                queued: 5,
                running: 2,
                target: 3,
                vms: VmCounts {
                    booting: 1,
                    active: 2,
                    draining: 0,
                    error: 0,
                },
                agents: AgentCounts {
                    idle: 0,
                    busy: 2,
                    draining: 0,
                },
                ..Default::default()
            },
        );
        let text = render(&serde_json::to_value(&report).unwrap()).unwrap();
        let line = text.lines().nth(1).unwrap();
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cells,
            ["default", "5", "2", "3", "1/2/0/0", "0/2/0"],
            "{text}"
        );
    }
}
