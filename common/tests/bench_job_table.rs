//! Benchmark of the job table (issue 11's targets): memory per job and
//! rebuild rate at 1,000,000 jobs, and the time of one user's `vq stat`
//! query among them. Runs only with `VQ_BENCH=1` (figures, not timed
//! assertions, see BENCHMARKS.md):
//!
//! `VQ_BENCH=1 cargo test --release -p vq-common --test bench_job_table -- --nocapture`
//!
//! `VQ_BENCH_JOBS` changes the number of jobs (default 1,000,000).

use std::time::Instant;

use vq_common::jobs::{answer, JobQuery, JobTable, Visibility};
use vq_common::messages::{JobEvent, JobRequest, JobState, Message, Outcome, Usage};

/// Resident set size of this process, KiB (`VmRSS` of /proc/self/status).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// The three events of job `i` (queued, started, finished) as delivered:
/// (body, routing key, user_id, message_id).
fn events(i: u64) -> [(Vec<u8>, String, Option<String>, String); 3] {
    let id = format!("{i:08x}-5b7d-4e1a-9c0b-2d6f8e4a1b3c");
    let owner = format!("user{:03}", i % 500);
    let pool = ["cms", "atlas", "lhcb", "alice"][(i % 4) as usize];
    let sub = Some(format!("{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let mk = |state: JobState, agent: &str, at: f64| {
        let mut e = JobEvent::about(None, &id, pool, agent, Some(&owner), state);
        e.owner = owner.clone();
        e.job_name = format!("sim-{}", i % 1000);
        e.submission = sub.clone();
        e.at = at;
        e
    };
    let queued = mk(
        JobState::Queued {
            request: JobRequest {
                walltime: Some(3600),
                submit_host: "ui1.example.org".into(),
                workdir: Some(format!("/home/{owner}/run")),
                submitted_at: 1_700_000_000,
                ..Default::default()
            },
        },
        "",
        1.7e9,
    );
    let agent = format!("vq-{pool}-{}", i % 200);
    let started = mk(JobState::Started, &agent, 1.7e9 + 10.0);
    let finished = mk(
        JobState::Finished {
            outcome: Outcome::Exited { code: 0 },
            usage: Usage {
                wall_secs: 60.0,
                user_cpu_secs: 58.0,
                system_cpu_secs: 1.0,
                max_rss_bytes: 100 << 20,
            },
        },
        &agent,
        1.7e9 + 70.0,
    );
    [queued, started, finished].map(|e| {
        let key = format!("job.{}.{}", e.pool, e.state.routing_word());
        let user = matches!(e.state, JobState::Queued { .. }).then(|| e.owner.clone());
        (e.encode(), key, user, e.message_id())
    })
}

#[test]
fn job_table_at_a_million_jobs() {
    if std::env::var_os("VQ_BENCH").is_none() {
        eprintln!("skipped: set VQ_BENCH=1 (and use --release) to run the benchmark");
        return;
    }
    let jobs: u64 = std::env::var("VQ_BENCH_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let mut table = JobTable::new();
    let before = rss_kib();
    let mut busy = std::time::Duration::ZERO;
    let mut body_bytes = 0usize;
    const BATCH: u64 = 10_000;
    let mut start = 0;
    while start < jobs {
        let end = (start + BATCH).min(jobs);
        // Encoding is the publishers' work: not timed.
        let batch: Vec<_> = (start..end).flat_map(events).collect();
        body_bytes += batch.iter().map(|b| b.0.len()).sum::<usize>();
        let t = Instant::now();
        for (body, key, user, mid) in &batch {
            // As the controller's feed does: decode as delivered, apply.
            let ev = JobEvent::decode_delivered(body, key, user.as_deref()).unwrap();
            table.apply(&ev, Some(mid));
        }
        busy += t.elapsed();
        drop(batch);
        start = end;
    }
    let after = rss_kib();
    let n_events = table.events_applied;
    assert_eq!(table.len() as u64, jobs);
    assert_eq!(n_events, 3 * jobs);
    let per_job = (after.saturating_sub(before) * 1024) as f64 / jobs as f64;
    let rate = n_events as f64 / busy.as_secs_f64();

    // One user's vq stat among them (`user007`: jobs / 500 jobs), all pages.
    let vis = Visibility::default();
    let t = Instant::now();
    let mut rows = 0;
    let mut q = JobQuery {
        limit: Some(1000),
        ..Default::default()
    };
    loop {
        let page = answer(&table, true, &vis, Some("user007"), &q.encode());
        rows += page.jobs.len();
        let bytes = page.encode().len();
        std::hint::black_box(bytes);
        match page.next {
            Some(n) => q.after = Some(n),
            None => break,
        }
    }
    let one_user = t.elapsed();
    // vq stat ID of one job.
    let t = Instant::now();
    let one = JobQuery {
        ids: vec![format!("{:08x}", jobs / 2)],
        ..Default::default()
    };
    let page = answer(&table, true, &vis, Some("root-op"), &one.encode());
    let by_id = t.elapsed();
    std::hint::black_box(page);
    println!(
        "job table: {jobs} jobs, {n_events} events ({:.0} bytes of bodies per event)",
        body_bytes as f64 / n_events as f64
    );
    println!(
        "memory: {:.0} bytes per job (VmRSS {before} KiB -> {after} KiB)",
        per_job
    );
    println!(
        "rebuild: {:.0} events/s ({:.2} s decoding and applying)",
        rate,
        busy.as_secs_f64()
    );
    println!(
        "one user's query (all pages, {rows} rows): {:.1} ms; one job by id prefix: {:.1} ms",
        one_user.as_secs_f64() * 1e3,
        by_id.as_secs_f64() * 1e3
    );
}
