//! Every metric name that the shipped Grafana dashboard
//! (`packaging/grafana/vq.json`) and Prometheus rules
//! (`packaging/prometheus/vq-rules.yaml`) use exists in the controller's
//! registry: the families are read from `# TYPE` lines of the
//! [`Metrics`] registry's OpenMetrics text, with the sample suffixes each
//! type adds (`_total` for counters; `_bucket`, `_sum`, `_count` for
//! histograms), not from a list of names kept here. A family prints only
//! once it has a series, so [`served_names`] gives every public family of
//! [`Metrics`] one series first (a family added later and not given one
//! here makes the check fail for a name it does serve, never pass for one
//! it does not).

use std::collections::BTreeSet;
use std::path::Path;

use vq_controller::metrics::Metrics;

/// Every sample name the registry can serve.
fn served_names() -> BTreeSet<String> {
    let m = Metrics::new();
    let cms = Metrics::pool("cms");
    let cms_and = |k, v| Metrics::pool_and("cms", k, v);
    m.pool_observed_at("cms", 1.0);
    m.cloud_request("GET /servers/detail", Some(200));
    m.quota("instances", 1, Some(2));
    for h in [
        &m.reconcile_duration,
        &m.boot_active,
        &m.boot_heartbeat,
        &m.drain_handshake,
        &m.job_run,
        &m.job_wait,
    ] {
        h.get_or_create(&cms).observe(1.0);
    }
    for g in [
        &m.pool_queued,
        &m.pool_running,
        &m.pool_held,
        &m.pool_target,
        &m.pool_servers_stuck_deleting,
        &m.pool_breaker_open,
        &m.pool_boot_failures,
    ] {
        g.get_or_create(&cms).set(1);
    }
    m.pool_obstacle_kind("cms", Some("quota"));
    for g in [&m.pool_vms, &m.pool_agents, &m.pool_slots] {
        g.get_or_create(&cms_and("state", "x")).set(1);
    }
    m.created.get_or_create(&cms).inc();
    for c in [
        &m.deleted,
        &m.boot_failures,
        &m.jobs_dead_lettered,
        &m.jobs_ended,
        &m.jobs_requeued,
    ] {
        c.get_or_create(&cms_and("reason", "x")).inc();
    }
    m.cloud_errors.inc();
    m.cloud_token_expiry.set(1.0);
    m.set_credential_expiry(Some(1.0));
    m.broker_reconnects.inc();
    let text = m.render();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            "info" => &["_info"],
            _ => &[""],
        };
        for s in suffixes {
            names.insert(format!("{name}{s}"));
        }
    }
    names
}

/// The `vq_…` identifiers in `text` (metric names: `vq_` then lowercase
/// letters, digits and underscores).
fn vq_names(text: &str) -> BTreeSet<String> {
    let b = text.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while let Some(off) = text[i..].find("vq_") {
        let start = i + off;
        let preceded = start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start + 3;
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_')
        {
            end += 1;
        }
        if !preceded && end > start + 3 {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn the_registry_serves_the_suffixed_names_of_its_families() {
    let served = served_names();
    for name in [
        "vq_pool_queued",
        "vq_servers_created_total",
        "vq_boot_active_duration_seconds_bucket",
    ] {
        assert!(served.contains(name), "{name} not in {served:?}");
    }
    assert!(!served.contains("vq_pool_queued_total"), "{served:?}");
}

#[test]
fn the_dashboard_and_the_alert_rules_name_only_served_metrics() {
    let served = served_names();
    assert!(served.len() > 20, "too few families read: {served:?}");
    for file in [
        "packaging/grafana/vq.json",
        "packaging/prometheus/vq-rules.yaml",
    ] {
        let used = vq_names(&read(file));
        assert!(used.len() >= 10, "{file}: only {used:?}");
        let unknown: Vec<_> = used.difference(&served).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the controller does not serve: {unknown:?}\nserved: {served:?}"
        );
    }
}

#[test]
fn an_unknown_name_is_found() {
    let served = served_names();
    let used = vq_names(r#"{"expr": "rate(vq_pool_queud[5m]) + vq_pool_queued"}"#);
    assert_eq!(
        used.difference(&served).collect::<Vec<_>>(),
        [&"vq_pool_queud".to_string()]
    );
}

/// Every family the registry serves is shown by some panel of the
/// dashboard (a family counts as shown when a query names it or one of
/// its sample names).
#[test]
fn every_family_has_a_dashboard_panel() {
    let used = vq_names(&read("packaging/grafana/vq.json"));
    let served = served_names();
    let mut missing = Vec::new();
    for name in &served {
        // A family counts as shown when any of its sample names is used.
        let family = ["_total", "_created", "_bucket", "_sum", "_count", "_info"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        let shown = used
            .iter()
            .any(|u| u == family || u.strip_prefix(family).is_some_and(|r| r.starts_with('_')));
        if !shown && !missing.contains(&family.to_string()) {
            missing.push(family.to_string());
        }
    }
    assert!(missing.is_empty(), "families without a panel: {missing:?}");
}
