//! `vq nodes [POOL] [--json]`: every VM of the cluster, one line each, from
//! the controller's `GET /status` (like `pbsnodes` or `openstack server
//! list`): server name, pool, Nova status, agent state, jobs, age, last
//! heartbeat and the operator's drain reason.
//!
//! As `vq pools`, the document is read as untyped JSON: a missing value
//! prints as `-`. Each pool's `servers` entries are expected as
//! `{"name", "status", "agent_state", "running", "jobs": [ids],
//! "age_secs", "heartbeat_age_secs", "drain_reason"}` (see
//! `controller/src/status.rs`). `vq pools -v` prints the same server table
//! under each pool ([`server_table`]).

use serde_json::Value;

use crate::error::CliError;
use crate::settings::Settings;
use crate::term::printable;

/// At most this many job ids are printed in the Jobs column; more are
/// shown as their count ("5 jobs").
pub const JOB_IDS_SHOWN: usize = 2;

/// A duration of whole seconds, short: `42s`, `12m05s`, `3h07m`, `2d04h`.
pub fn short_duration(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s if s < 86_400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        s => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

fn text(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) if !s.is_empty() => printable(s),
        Some(Value::Number(n)) => n.to_string(),
        _ => "-".into(),
    }
}

fn secs(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_u64)
        .map(short_duration)
        .unwrap_or_else(|| "-".into())
}

/// The Jobs cell of a server: its job ids joined by `,` when at most
/// [`JOB_IDS_SHOWN`], else `"N jobs"`; from `running` (a count) when the
/// controller sends no `jobs`; `-` for none.
pub fn jobs_cell(server: &Value) -> String {
    let ids: Option<Vec<String>> = server.get("jobs").and_then(Value::as_array).map(|a| {
        a.iter()
            .map(|j| j.as_str().map(printable).unwrap_or_else(|| j.to_string()))
            .collect()
    });
    let count = ids
        .as_ref()
        .map(|i| i.len() as u64)
        .or_else(|| server.get("running").and_then(Value::as_u64))
        .unwrap_or(0);
    match ids {
        _ if count == 0 => "-".into(),
        Some(ids) if ids.len() <= JOB_IDS_SHOWN => ids.join(","),
        _ => format!("{count} jobs"),
    }
}

/// Headers of [`server_table`]'s columns after the optional Pool column.
const HEADER: [&str; 7] = [
    "Server",
    "Status",
    "Agent",
    "Jobs",
    "Age",
    "Heartbeat",
    "Drain reason",
];

/// One row of the server table: server name, Nova status, agent state,
/// jobs, age, heartbeat age, drain reason (every cell terminal-safe).
fn server_row(s: &Value) -> Vec<String> {
    vec![
        text(s, "name"),
        text(s, "status"),
        text(s, "agent_state"),
        jobs_cell(s),
        secs(s, "age_secs"),
        secs(s, "heartbeat_age_secs"),
        text(s, "drain_reason"),
    ]
}

/// The servers of `status`, as `(pool, server)` in pool then listing
/// order, of `only` pool if given.
pub fn servers<'a>(status: &'a Value, only: Option<&str>) -> Vec<(&'a str, &'a Value)> {
    let Some(pools) = status.get("pools").and_then(Value::as_object) else {
        return Vec::new();
    };
    pools
        .iter()
        .filter(|(name, _)| only.is_none_or(|o| o == name.as_str()))
        .flat_map(|(name, p)| {
            p.get("servers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(move |s| (name.as_str(), s))
        })
        .collect()
}

/// Lays out `rows` under `header` in columns two spaces apart, each line
/// prefixed by `indent`, trailing blanks trimmed.
fn columns(indent: &str, header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = indent.to_string();
        for (c, w) in cells.zip(&widths) {
            s.push_str(&format!("{c:<w$}  "));
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&mut header.iter().copied());
    for r in rows {
        out.push_str(&line(&mut r.iter().map(String::as_str)));
    }
    out
}

/// The server table of `vq nodes` and `vq pools -v`: a header and one line
/// per server, with a Pool column after the server name when `with_pool`,
/// each line after `indent`. `servers` as from [`servers`].
pub fn server_table(servers: &[(&str, &Value)], with_pool: bool, indent: &str) -> String {
    let mut header: Vec<&str> = HEADER.to_vec();
    if with_pool {
        header.insert(1, "Pool");
    }
    let rows: Vec<Vec<String>> = servers
        .iter()
        .map(|(pool, s)| {
            let mut r = server_row(s);
            if with_pool {
                r.insert(1, printable(pool));
            }
            r
        })
        .collect();
    columns(indent, &header, &rows)
}

/// The pool names of `status`, sorted; `None` without a `pools` object.
pub fn pool_names(status: &Value) -> Option<Vec<String>> {
    let mut names: Vec<String> = status.get("pools")?.as_object()?.keys().cloned().collect();
    names.sort();
    Some(names)
}

/// What `vq nodes` prints for `status`: the server table (or `no servers`),
/// or with `json` a JSON array of the servers as the controller sent them,
/// each with its `pool` added.
///
/// # Errors
/// [`CliError::UnknownPool`] when `pool` is not a pool of the document
/// (`cluster` for the message), [`CliError::ControllerAnswer`] (with
/// `url`) when the document has no `pools` object.
pub fn render(
    status: &Value,
    pool: Option<&str>,
    json: bool,
    cluster: &str,
    url: &str,
) -> Result<String, CliError> {
    let known = pool_names(status).ok_or_else(|| CliError::ControllerAnswer {
        url: url.to_string(),
        problem: "no \"pools\" object".into(),
    })?;
    if let Some(p) = pool.filter(|p| !known.iter().any(|k| k == p)) {
        return Err(CliError::UnknownPool {
            pool: p.to_string(),
            cluster: cluster.to_string(),
            known,
        });
    }
    let servers = servers(status, pool);
    if json {
        let list: Vec<Value> = servers
            .iter()
            .map(|(pool, s)| {
                let mut s = (*s).clone();
                if let Some(o) = s.as_object_mut() {
                    o.insert("pool".into(), Value::String(pool.to_string()));
                }
                s
            })
            .collect();
        let mut out = serde_json::to_string_pretty(&list).unwrap_or_else(|_| "[]".into());
        out.push('\n');
        return Ok(out);
    }
    if servers.is_empty() {
        return Ok("no servers\n".into());
    }
    Ok(server_table(&servers, true, ""))
}

/// What `vq nodes` does.
///
/// # Errors
/// [`CliError`]: the controller unreachable or its answer not a status
/// document, or an unknown `pool`.
pub async fn run(settings: &Settings, pool: Option<&str>, json: bool) -> Result<i32, CliError> {
    let status = crate::pools::fetch_status(settings).await?;
    let url = format!("{}/status", settings.controller_url);
    let out = render(&status, pool, json, &settings.cluster, &url)?;
    // Every cell is already terminal-safe; JSON escapes control characters.
    print!("{out}");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status() -> Value {
        json!({
            "cluster": "vq",
            "pools": {
                "cms": {"servers": [
                    {"id": "1", "name": "vq-cms-1a2b", "status": "ACTIVE",
                     "agent_state": "busy", "running": 1, "jobs": ["17-sim"],
                     "age_secs": 725, "heartbeat_age_secs": 4},
                    {"id": "2", "name": "vq-cms-3c4d", "status": "ACTIVE",
                     "agent_state": "draining", "running": 3,
                     "jobs": ["1-a", "2-b", "3-c"], "age_secs": 90061,
                     "heartbeat_age_secs": 2, "drain_reason": "kernel update"},
                    {"id": "3", "name": "vq-cms-5e6f", "status": "BUILD",
                     "agent_state": "booting", "running": 0, "jobs": [],
                     "age_secs": 12, "heartbeat_age_secs": null}
                ]},
                "atlas": {"servers": []},
                "old": {"servers": [
                    {"name": "vq-old-1", "status": "ACTIVE", "agent_state": "busy", "running": 2}
                ]}
            }
        })
    }

    #[test]
    fn durations_are_short_and_exact_to_their_unit() {
        assert_eq!(short_duration(0), "0s");
        assert_eq!(short_duration(59), "59s");
        assert_eq!(short_duration(725), "12m05s");
        assert_eq!(short_duration(3600 * 3 + 7 * 60 + 59), "3h07m");
        assert_eq!(short_duration(90061), "1d01h");
    }

    #[test]
    fn one_line_per_server_with_pool_status_agent_jobs_ages_and_drain_reason() {
        let text = render(&status(), None, false, "vq", "u").unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        let cells = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(
            cells(lines[0]),
            [
                "Server",
                "Pool",
                "Status",
                "Agent",
                "Jobs",
                "Age",
                "Heartbeat",
                "Drain",
                "reason"
            ]
        );
        assert_eq!(
            cells(lines[1]),
            [
                "vq-cms-1a2b",
                "cms",
                "ACTIVE",
                "busy",
                "17-sim",
                "12m05s",
                "4s",
                "-"
            ]
        );
        // More than JOB_IDS_SHOWN: a count.
        assert_eq!(
            cells(lines[2]),
            [
                "vq-cms-3c4d",
                "cms",
                "ACTIVE",
                "draining",
                "3",
                "jobs",
                "1d01h",
                "2s",
                "kernel",
                "update"
            ]
        );
        assert_eq!(
            cells(lines[3]),
            [
                "vq-cms-5e6f",
                "cms",
                "BUILD",
                "booting",
                "-",
                "12s",
                "-",
                "-"
            ]
        );
        // An older controller without `jobs`: the count of `running`.
        assert!(lines[4].starts_with("vq-old-1"), "{text}");
        assert!(lines[4].contains(" 2 jobs "), "{text}");
        // Columns line up: every Status cell starts where the header's does.
        let col = lines[0].find("Status").unwrap();
        for l in &lines[1..] {
            assert!(
                l[col..].starts_with("ACTIVE") || l[col..].starts_with("BUILD"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_pool_filters_and_json_lists_the_servers_with_their_pool() {
        let text = render(&status(), Some("cms"), false, "vq", "u").unwrap();
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(!text.contains("vq-old-1"));
        assert_eq!(
            render(&status(), Some("atlas"), false, "vq", "u").unwrap(),
            "no servers\n"
        );
        let j: Value =
            serde_json::from_str(&render(&status(), Some("cms"), true, "vq", "u").unwrap())
                .unwrap();
        let list = j.as_array().unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[0]["pool"], "cms");
        assert_eq!(list[0]["jobs"], json!(["17-sim"]));
        assert_eq!(list[1]["drain_reason"], "kernel update");
        let all: Value =
            serde_json::from_str(&render(&status(), None, true, "vq", "u").unwrap()).unwrap();
        assert_eq!(all.as_array().unwrap().len(), 4);
    }

    #[test]
    fn an_unknown_pool_is_a_usage_error_that_lists_the_pools() {
        let err = render(&status(), Some("nosuch"), false, "c1", "u").unwrap_err();
        assert_eq!(err.exit_code(), crate::error::EXIT_USAGE);
        assert_eq!(
            err.to_string(),
            "no pool named \"nosuch\" on cluster \"c1\"; pools: atlas, cms, old"
        );
        let err = render(&json!({"x": 1}), None, false, "c1", "http://c/status").unwrap_err();
        assert!(matches!(err, CliError::ControllerAnswer { .. }), "{err}");
    }

    #[test]
    fn control_characters_from_the_cloud_do_not_reach_the_terminal() {
        let st = json!({"pools": {"p": {"servers": [
            {"name": "evil\u{1b}[2J\nx", "status": "ACTIVE", "agent_state": "idle",
             "jobs": ["j\u{7}"], "drain_reason": "a\nb"}
        ]}}});
        let text = render(&st, None, false, "vq", "u").unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
    }
}
