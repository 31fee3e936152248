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
    let mut errors = Vec::new();
    for (name, p) in pools {
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
            errors.push(format!("{name}: boots stopped: {why}\n"));
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
    for r in &rows {
        out.push_str(&line(&r.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    for e in errors {
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

/// What `vq pools` does.
///
/// # Errors
/// [`CliError`].
pub async fn run(settings: &Settings) -> Result<i32, CliError> {
    let status = fetch_status(settings).await?;
    let table = render(&status).ok_or_else(|| CliError::ControllerAnswer {
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
