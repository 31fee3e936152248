//! The status page served at `GET /`: one server-rendered HTML document
//! built from the same [`StatusReport`] as `GET /status`, for a person in a
//! browser (laptop or phone: viewport meta, CSS that reflows the pool
//! cards and scrolls wide tables). No JavaScript: a
//! `<meta http-equiv="refresh">` reloads it every [`REFRESH_SECS`] seconds.
//!
//! It shows the controller's connections and readiness, then per pool the
//! demand (queued, running), the target, the VM and agent counts, the
//! pool's state in words ([`pool_state`]: observation failed, the
//! obstacle, paused, booting N, …), every server (Nova status, agent
//! state, jobs (their ids), age, last heartbeat), and finally the recent decisions
//! with their reasons and the current errors.
//!
//! Every text taken from the report (pool and server names, error texts,
//! reasons: they come from the cloud, the broker and the configuration)
//! goes through [`escape`]. Fields are rendered defensively: an absent
//! optional field is shown as `–`, never assumed.
//!
//! Plain string building (no template crate): the page is one function of
//! a few sections, and a single escaping helper keeps the one rule that
//! matters (nothing from the report is written unescaped) visible.

use std::fmt::Write as _;

use crate::status::{readiness, PoolStatus, StatusReport};

/// Seconds between reloads of the page (`<meta http-equiv="refresh">`).
pub const REFRESH_SECS: u32 = 10;

/// Decisions shown on the page (newest first, all pools together).
pub const DECISIONS_SHOWN: usize = 30;

/// Escapes `s` for HTML text and double- or single-quoted attribute
/// values: `&`, `<`, `>`, `"` and `'` become character references, and
/// control characters other than tab and newline, and bidirectional
/// overrides ([`vq_common::text::must_escape`]), are shown as `\u{..}`
/// (a page fetched with `curl` in a terminal must not drive it, and one
/// user's server name or drain reason must not reorder the row).
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\t' | '\n' => out.push(c),
            c if vq_common::text::must_escape(c) => out.push_str(&c.escape_unicode().to_string()),
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A duration of `secs` seconds in words an operator reads at a glance:
/// `45s`, `3m 12s`, `2h 5m`, `3d 4h`.
pub fn duration(secs: u64) -> String {
    let (d, h, m, s) = (
        secs / 86_400,
        secs % 86_400 / 3600,
        secs % 3600 / 60,
        secs % 60,
    );
    if d > 0 {
        format!("{d}d {h}h")
    } else if h > 0 {
        format!("{h}h {m}m")
    } else if m > 0 {
        format!("{m}m {s}s")
    } else {
        format!("{s}s")
    }
}

/// How long before `now` (Unix seconds) the moment `at` (Unix seconds) was,
/// in words (`12s ago`); `never` for `at` ≤ 0.
fn ago(now: f64, at: f64) -> String {
    if at <= 0.0 {
        "never".into()
    } else {
        format!("{} ago", duration((now - at).max(0.0) as u64))
    }
}

/// The severity of a pool's state, its CSS class on the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// Nothing in the way.
    Ok,
    /// Working on it (booting, draining).
    Busy,
    /// Boots stopped or held, the pool waits for something outside.
    Warn,
    /// The pool's cycle fails.
    Error,
}

impl Severity {
    fn class(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Busy => "busy",
            Severity::Warn => "warn",
            Severity::Error => "err",
        }
    }
}

/// The state of pool `p` in words, most pressing first, and its severity:
/// the observation failed (counts not current), the cycle failed, the
/// pool's obstacle (boots stopped), the broker holds every pool
/// (`blocked`: paused), VMs booting or draining, jobs waiting with no VM
/// to come, else idle or running.
pub fn pool_state(p: &PoolStatus, blocked: Option<&str>) -> (Severity, String) {
    if !p.observed && p.observed_at <= 0.0 && p.last_error.is_none() {
        return (Severity::Busy, "not observed yet".into());
    }
    if !p.observed {
        let why = p.last_error.as_deref().unwrap_or("no reason recorded");
        return (
            Severity::Error,
            format!("observation failed, counts not current: {why}"),
        );
    }
    if let Some(e) = &p.last_error {
        let n = p.failures.max(1);
        let kind = if p.failure_permanent {
            "permanent error"
        } else {
            "retrying"
        };
        return (
            Severity::Error,
            format!("last cycle failed ({n} in a row, {kind}): {e}"),
        );
    }
    if let Some(o) = &p.obstacle {
        let heading = crate::status::obstacle_heading(p.obstacle_kind.as_deref());
        return (Severity::Warn, format!("{heading}: {o}"));
    }
    if let Some(b) = blocked {
        return (
            Severity::Warn,
            format!("paused: the broker blocks publishing ({b})"),
        );
    }
    let mut busy = Vec::new();
    if p.vms.booting > 0 {
        busy.push(format!("booting {}", p.vms.booting));
    }
    if p.vms.draining > 0 {
        busy.push(format!("draining {}", p.vms.draining));
    }
    if p.vms.error > 0 {
        busy.push(format!("{} broken VM(s) to delete", p.vms.error));
    }
    if !busy.is_empty() {
        return (Severity::Busy, busy.join(", "));
    }
    let vms = p.vms.active + p.vms.booting + p.vms.draining;
    if p.queued > 0 && p.target as u64 <= u64::from(vms) && p.running == 0 {
        return (
            Severity::Warn,
            format!(
                "{} job(s) waiting, target {} VM(s) reached: nothing more to boot",
                p.queued, p.target
            ),
        );
    }
    if p.queued == 0 && p.running == 0 {
        (Severity::Ok, "idle".into())
    } else {
        (Severity::Ok, "running".into())
    }
}

const STYLE: &str = "\
*{box-sizing:border-box}\
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;padding:1rem;background:#f5f6f8;color:#1d2330;line-height:1.4}\
h1{font-size:1.4rem;margin:0 0 .5rem}h2{font-size:1.15rem;margin:1.2rem 0 .5rem}h3{font-size:1.05rem;margin:0}\
header p{margin:.2rem 0;color:#4a5468}\
.pools{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,34rem),1fr));gap:1rem}\
.pool{background:#fff;border-radius:.5rem;padding:.8rem 1rem;box-shadow:0 1px 3px rgba(0,0,0,.12);min-width:0}\
.state{margin:.4rem 0;padding:.3rem .6rem;border-radius:.3rem;overflow-wrap:anywhere}\
.ok{background:#e3f4e8}.busy{background:#e4ecfb}.warn{background:#fff1d6}.err{background:#fde2e1}\
dl.counts{display:grid;grid-template-columns:repeat(auto-fill,minmax(6.5rem,1fr));gap:.3rem;margin:.5rem 0}\
dl.counts div{background:#f0f2f6;border-radius:.3rem;padding:.2rem .5rem}\
dt{font-size:.75rem;color:#4a5468}dd{margin:0;font-size:1.2rem;font-weight:600}\
.scroll{overflow-x:auto}\
table{border-collapse:collapse;width:100%;font-size:.9rem}\
th,td{text-align:left;padding:.25rem .5rem;border-bottom:1px solid #e1e4ea;white-space:nowrap}\
td.wrap{white-space:normal;overflow-wrap:anywhere;min-width:14rem}\
.muted{color:#6b7487}\
ul.errors li{overflow-wrap:anywhere;margin:.2rem 0}\
@media (max-width:40rem){body{padding:.5rem}th,td{padding:.2rem .3rem;font-size:.85rem}}";

/// Renders the whole page for `report` (the `/status` document).
pub fn render(report: &StatusReport) -> String {
    let now = report.generated_at;
    let mut h = String::with_capacity(8192);
    let cluster = escape(&report.cluster);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
         <title>vq {cluster}: status</title><style>{STYLE}</style></head><body>\n"
    );
    header(&mut h, report);
    h.push_str("<section><h2>Pools</h2>\n");
    if report.pools.is_empty() {
        h.push_str("<p class=\"muted\">No pool reported yet.</p>\n");
    } else {
        h.push_str("<div class=\"pools\">\n");
        for (name, p) in &report.pools {
            pool(&mut h, name, p, report.broker_blocked.as_deref(), now);
        }
        h.push_str("</div>\n");
    }
    h.push_str("</section>\n");
    decisions(&mut h, report, now);
    errors(&mut h, report);
    let _ = write!(
        h,
        "<footer class=\"muted\"><p>Generated at Unix time {now:.0} (reloads every {REFRESH_SECS}s). \
         Also: <a href=\"/status\">/status</a> (JSON), <a href=\"/metrics\">/metrics</a>, \
         <a href=\"/readyz\">/readyz</a>.</p></footer>\n</body></html>\n"
    );
    h
}

fn header(h: &mut String, r: &StatusReport) {
    let _ = write!(h, "<header><h1>vq cluster {}</h1>", escape(&r.cluster));
    let reasons = readiness(r);
    if reasons.is_empty() {
        h.push_str("<p class=\"state ok\" id=\"ready\">Ready</p>");
    } else {
        h.push_str("<div class=\"state err\" id=\"ready\">Not ready:<ul>");
        for reason in &reasons {
            let _ = write!(h, "<li>{}</li>", escape(reason));
        }
        h.push_str("</ul></div>");
    }
    match r.role {
        crate::leader::Role::Leader => {
            h.push_str("<p class=\"state ok\" id=\"role\">Role: leader (this controller acts)</p>")
        }
        crate::leader::Role::Standby => {
            let _ = write!(
                h,
                "<p class=\"state err\" id=\"role\">Role: standby (read-only: another controller acts or none can){}</p>",
                r.standby_reason
                    .as_deref()
                    .map(|w| format!(": {}", escape(w)))
                    .unwrap_or_default()
            );
        }
    }
    if r.dry_run {
        h.push_str(
            "<p class=\"state err\" id=\"dry-run\">Dry run: plans are logged, nothing is done</p>",
        );
    }
    if r.cloud_tls_insecure {
        h.push_str(
            "<p class=\"state err\" id=\"cloud-tls-insecure\">Cloud TLS certificates are not verified (verify: false / OS_INSECURE)</p>",
        );
    }
    let broker = if r.broker_connected {
        "connected"
    } else {
        "not connected"
    };
    let _ = writeln!(
        h,
        "<p>Broker: {broker}{}. Cloud: {}. Last cycle: {}. Up {}.</p></header>",
        match &r.broker_blocked {
            Some(b) => format!(", blocking publishing ({})", escape(b)),
            None => String::new(),
        },
        if r.cloud_error.is_some() {
            "server list unreadable"
        } else {
            "reachable"
        },
        ago(r.generated_at, r.last_cycle_at),
        duration(r.uptime_secs.max(0.0) as u64),
    );
}

fn opt_secs(v: Option<u64>) -> String {
    v.map_or_else(|| "–".into(), duration)
}

fn pool(h: &mut String, name: &str, p: &PoolStatus, blocked: Option<&str>, now: f64) {
    let (sev, words) = pool_state(p, blocked);
    let name = escape(name);
    let _ = write!(
        h,
        "<article class=\"pool\" id=\"pool-{name}\"><h3>Pool {name}</h3>\
         <p class=\"state {}\">{}</p><dl class=\"counts\">",
        sev.class(),
        escape(&words)
    );
    for (label, v) in [
        ("queued", p.queued),
        ("running", p.running),
        ("target VMs", u64::from(p.target)),
        ("booting", u64::from(p.vms.booting)),
        ("active", u64::from(p.vms.active)),
        ("draining", u64::from(p.vms.draining)),
        ("error", u64::from(p.vms.error)),
    ] {
        let _ = write!(h, "<div><dt>{label}</dt><dd>{v}</dd></div>");
    }
    let _ = write!(
        h,
        "</dl><p class=\"muted\">Agents: {} idle, {} busy, {} draining. Observed {}.</p>",
        p.agents.idle,
        p.agents.busy,
        p.agents.draining,
        ago(now, p.observed_at)
    );
    if p.servers.is_empty() {
        h.push_str("<p class=\"muted\">No server.</p>");
    } else {
        h.push_str(
            "<div class=\"scroll\"><table><thead><tr><th>Server</th><th>Nova</th>\
             <th>Agent</th><th>Jobs</th><th>Age</th><th>Last heartbeat</th></tr></thead><tbody>",
        );
        for s in &p.servers {
            let _ = write!(
                h,
                "<tr><td title=\"{}\">{}</td><td>{}</td><td>{}</td>{}<td>{}</td><td>{}</td></tr>",
                escape(&s.id),
                escape(&s.name),
                escape(&s.status),
                match &s.drain_reason {
                    Some(r) => format!("{} ({})", escape(&s.agent_state), escape(r)),
                    None => escape(&s.agent_state),
                },
                jobs_cell(s),
                opt_secs(s.age_secs),
                s.heartbeat_age_secs
                    .map_or_else(|| "–".into(), |a| format!("{} ago", duration(a))),
            );
        }
        h.push_str("</tbody></table></div>");
    }
    h.push_str("</article>\n");
}

/// At most this many job ids are written in a server's Jobs cell; more
/// are shown as their count, with the ids in the cell's `title`.
const JOB_IDS_SHOWN: usize = 2;

/// A server's Jobs cell (`<td>…</td>`, escaped): its agent's job ids, or
/// their count when more than [`JOB_IDS_SHOWN`], or the `running` count
/// when the heartbeat named none.
fn jobs_cell(s: &crate::status::ServerStatus) -> String {
    let ids = s
        .jobs
        .iter()
        .map(|j| escape(j))
        .collect::<Vec<_>>()
        .join(", ");
    match s.jobs.len() {
        0 => format!("<td>{}</td>", s.running),
        n if n <= JOB_IDS_SHOWN => format!("<td>{ids}</td>"),
        n => format!("<td title=\"{ids}\">{n} jobs</td>"),
    }
}

fn decisions(h: &mut String, r: &StatusReport, now: f64) {
    let mut all: Vec<(&str, &crate::status::Decision)> = r
        .pools
        .iter()
        .flat_map(|(n, p)| p.last_decisions.iter().map(move |d| (n.as_str(), d)))
        .collect();
    all.sort_by_key(|d| std::cmp::Reverse(d.1.at));
    all.truncate(DECISIONS_SHOWN);
    h.push_str("<section><h2>Recent decisions</h2>\n");
    if all.is_empty() {
        h.push_str("<p class=\"muted\">No decision yet.</p>\n");
    } else {
        h.push_str(
            "<div class=\"scroll\"><table id=\"decisions\"><thead><tr><th>When</th><th>Pool</th>\
             <th>Action</th><th>Server</th><th>Reason</th></tr></thead><tbody>",
        );
        for (pool, d) in all {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"wrap\">{}</td></tr>",
                ago(now, d.at as f64),
                escape(pool),
                escape(&d.action),
                d.server.as_deref().map_or_else(|| "–".into(), escape),
                escape(&d.reason),
            );
        }
        h.push_str("</tbody></table></div>\n");
    }
    h.push_str("</section>\n");
}

fn errors(h: &mut String, r: &StatusReport) {
    let mut list: Vec<String> = Vec::new();
    if let Some(e) = &r.cloud_error {
        list.push(format!("cloud: {e}"));
    }
    if let Some(e) = &r.broker_access_refused {
        list.push(format!("broker refused: {e}"));
    }
    if let Some(e) = &r.broker_blocked {
        list.push(format!("broker blocks publishing: {e}"));
    }
    for (n, p) in &r.pools {
        if let Some(e) = &p.last_error {
            list.push(format!("pool {n}: {e}"));
        }
    }
    h.push_str("<section><h2>Errors</h2>\n");
    if list.is_empty() {
        h.push_str("<p class=\"muted\" id=\"errors\">None.</p>\n");
    } else {
        h.push_str("<ul class=\"errors\" id=\"errors\">");
        for e in list {
            let _ = write!(h, "<li>{}</li>", escape(&e));
        }
        h.push_str("</ul>\n");
    }
    h.push_str("</section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{AgentCounts, Decision, ServerStatus, VmCounts};

    fn report() -> StatusReport {
        let mut r = StatusReport {
            cluster: "vq".into(),
            generated_at: 1000.0,
            uptime_secs: 90.0,
            broker_connected: true,
            last_cycle_at: 995.0,
            ..Default::default()
        };
        r.pools.insert(
            "cms".into(),
            PoolStatus {
                queued: 12,
                running: 4,
                target: 5,
                vms: VmCounts {
                    booting: 2,
                    active: 3,
                    draining: 0,
                    error: 0,
                },
                agents: AgentCounts {
                    idle: 0,
                    busy: 3,
                    draining: 0,
                },
                servers: vec![ServerStatus {
                    id: "0b1e".into(),
                    name: "vq-cms-1a2b3c4d".into(),
                    status: "ACTIVE".into(),
                    agent_state: "busy".into(),
                    running: 2,
                    jobs: vec!["17-a".into(), "18-b".into()],
                    slots: Some(2),
                    slots_mismatch: false,
                    age_secs: Some(192),
                    heartbeat_age_secs: Some(4),
                    drain_reason: Some("kernel <update>".into()),
                }],
                last_decisions: vec![Decision {
                    at: 990,
                    action: "boot".into(),
                    server: None,
                    reason: "target 5 VMs for 12 queued".into(),
                }],
                observed_at: 999.0,
                observed: true,
                ..Default::default()
            },
        );
        r
    }

    #[test]
    fn escape_replaces_every_markup_character() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(escape("plain ü"), "plain ü");
        assert_eq!(
            escape("a\u{1b}[2J\u{7}b\u{202e}c"),
            "a\\u{1b}[2J\\u{7}b\\u{202e}c"
        );
        assert_eq!(escape("line\nnext"), "line\nnext");
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(45), "45s");
        assert_eq!(duration(192), "3m 12s");
        assert_eq!(duration(7500), "2h 5m");
        assert_eq!(duration(3 * 86_400 + 4 * 3600 + 5), "3d 4h");
    }

    #[test]
    fn the_page_shows_demand_target_vms_servers_and_decisions() {
        let page = render(&report());
        assert!(page.starts_with("<!DOCTYPE html>"));
        assert!(page.contains("name=\"viewport\""), "responsive");
        assert!(page.contains("http-equiv=\"refresh\""));
        assert!(page.contains("id=\"ready\">Ready"), "{page}");
        assert!(page.contains("<h3>Pool cms</h3>"), "{page}");
        for (label, v) in [
            ("queued", 12),
            ("running", 4),
            ("target VMs", 5),
            ("booting", 2),
            ("active", 3),
        ] {
            assert!(
                page.contains(&format!("<dt>{label}</dt><dd>{v}</dd>")),
                "{label}: {page}"
            );
        }
        assert!(page.contains(">booting 2</p>"), "state in words: {page}");
        assert!(
            page.contains(
                "<td title=\"0b1e\">vq-cms-1a2b3c4d</td><td>ACTIVE</td>\
                 <td>busy (kernel &lt;update&gt;)</td><td>17-a, 18-b</td><td>3m 12s</td><td>4s ago</td>"
            ),
            "{page}"
        );
        // More jobs than shown: their count, the ids in the title.
        let mut r = report();
        let s = &mut r.pools.get_mut("cms").unwrap().servers[0];
        s.jobs = vec!["1-a".into(), "2-<b>".into(), "3-c".into()];
        s.running = 3;
        let page = render(&r);
        assert!(
            page.contains("<td title=\"1-a, 2-&lt;b&gt;, 3-c\">3 jobs</td>"),
            "{page}"
        );
        // A heartbeat that named no ids: the count.
        r.pools.get_mut("cms").unwrap().servers[0].jobs.clear();
        assert!(render(&r).contains("</td><td>3</td><td>3m 12s</td>"));
        assert!(
            page.contains("<td>10s ago</td><td>cms</td><td>boot</td><td>–</td>"),
            "{page}"
        );
        assert!(page.contains("target 5 VMs for 12 queued"));
        assert!(page.contains("id=\"errors\">None."), "{page}");
    }

    #[test]
    fn texts_from_outside_are_escaped() {
        let mut r = report();
        let mut p = r.pools.remove("cms").unwrap();
        p.last_error = Some("HTTP 500: <script>alert(1)</script>".into());
        p.servers[0].name = "<img src=x onerror=alert(2)>".into();
        p.last_decisions[0].reason = "a & b <i>".into();
        r.pools.insert("<b>evil\"</b>".into(), p);
        r.cloud_error = Some("cannot list: <html>".into());
        let page = render(&r);
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(!page.contains("<img"), "{page}");
        assert!(!page.contains("<b>evil"), "{page}");
        assert!(!page.contains("<i>"), "{page}");
        assert!(!page.contains("<html>"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(page.contains("id=\"pool-&lt;b&gt;evil&quot;&lt;/b&gt;\""));
        assert!(page.contains("a &amp; b &lt;i&gt;"));
    }

    #[test]
    fn the_state_in_words_names_the_most_pressing_problem() {
        let base = report().pools["cms"].clone();
        let mut p = base.clone();
        p.observed = false;
        p.last_error = Some("no broker connection".into());
        let (sev, w) = pool_state(&p, None);
        assert_eq!(sev, Severity::Error);
        assert!(w.starts_with("observation failed") && w.contains("no broker connection"));

        let mut p = base.clone();
        p.last_error = Some("cannot create: quota exceeded".into());
        p.failures = 2;
        let (sev, w) = pool_state(&p, None);
        assert_eq!(sev, Severity::Error);
        assert!(
            w.contains("2 in a row, retrying") && w.contains("quota"),
            "{w}"
        );

        let mut p = base.clone();
        p.obstacle = Some("quota exhausted: 10/10 instances".into());
        let (sev, w) = pool_state(&p, Some("memory alarm"));
        assert_eq!(sev, Severity::Warn);
        assert_eq!(w, "boots stopped: quota exhausted: 10/10 instances");

        let (sev, w) = pool_state(&base, Some("memory alarm"));
        assert_eq!(sev, Severity::Warn);
        assert!(w.starts_with("paused") && w.contains("memory alarm"), "{w}");

        assert_eq!(
            pool_state(&base, None),
            (Severity::Busy, "booting 2".into())
        );

        let idle = PoolStatus {
            observed: true,
            observed_at: 1.0,
            ..Default::default()
        };
        assert_eq!(pool_state(&idle, None), (Severity::Ok, "idle".into()));
        assert_eq!(
            pool_state(&PoolStatus::default(), None).1,
            "not observed yet"
        );
        let mut r = report();
        r.pools.insert("new".into(), PoolStatus::default());
        r.broker_connected = false;
        let page = render(&r);
        assert!(
            page.contains("Not ready:<ul><li>not connected to the broker"),
            "{page}"
        );
    }
}
