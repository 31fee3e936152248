//! What `vq submit`'s check against the pools' published limits costs
//! (issue 11): the wall time of `vq submit` of a one-line job to a pool
//! whose controller answers the limits question, beside the same command
//! on a cluster where no controller listens (the question is unroutable
//! and answered at once by the broker; the job goes out unchecked). It
//! asserts nothing about speed and does nothing unless `VQ_BENCH=1`.
//!
//! `VQ_BENCH=1 cargo test -p vq-tests --test bench_submit -- --ignored
//! --nocapture` (root; the `vq` of the dev profile, as the harness builds
//! it). Knob: `BENCH_SUBMITS` (20 per side).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vq_common::topology::Role;
use vq_tests::harness::{
    broker_url, build_bin, require_root, shared_broker, start_controller_on_empty_cloud_with,
    unique_cluster, TestBroker,
};

const POOL: &str = "bsub";

/// Seconds of one `vq submit -q POOL -` on `cluster`, and its stderr.
fn submit_once(vq: &std::path::Path, cluster: &str) -> (f64, String) {
    let t = Instant::now();
    let out = Command::new(vq)
        .args(["submit", "-q", POOL, "-l", "walltime=60", "-"])
        .env("VQ_BROKER_URL", broker_url(Role::Submitter).unwrap())
        .env("VQ_CLUSTER", cluster)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env_remove("VQ_CONTROLLER_URL")
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"true\n")?;
            c.wait_with_output()
        })
        .unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (secs, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark (VQ_BENCH=1), needs root"]
async fn bench_submit_with_and_without_the_limits_check() {
    if std::env::var_os("VQ_BENCH").is_none() {
        eprintln!("bench_submit: a benchmark, skipped (set VQ_BENCH=1)");
        return;
    }
    if !require_root() {
        return;
    }
    let n: usize = std::env::var("BENCH_SUBMITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let vq = build_bin("vq-cli", "vq").unwrap();
    let checked = unique_cluster();
    let unchecked = unique_cluster();
    let b1 = TestBroker::connect(&checked, &[POOL]).await.unwrap();
    let b2 = TestBroker::connect(&unchecked, &[POOL]).await.unwrap();
    let suite = vq_tests::accounts::suite();
    let url = shared_broker().unwrap().url_of(&suite.controller);
    let _ctl =
        start_controller_on_empty_cloud_with(&url, &checked, POOL, "warn", "127.0.0.1:0", "")
            .await
            .unwrap();
    // Until the controller answers (its broker session is up).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !submit_once(&vq, &checked).1.is_empty() {
        assert!(Instant::now() < deadline, "the controller never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (s, err) = submit_once(&vq, &checked);
        assert!(err.is_empty(), "{err}");
        with.push(s * 1000.0);
        let (s, err) = submit_once(&vq, &unchecked);
        assert!(err.contains("was not checked"), "{err}");
        without.push(s * 1000.0);
    }
    let (w, wo) = (median(&mut with), median(&mut without));
    println!(
        "\n## vq submit with the pools' limits check ({n} submits each, interleaved; medians)"
    );
    println!("| figure | value |");
    println!("|---|---|");
    println!("| `vq submit`, a controller answers the limits question | {w:.1} ms |");
    println!("| `vq submit`, no controller (question unroutable, job unchecked) | {wo:.1} ms |");
    println!("| cost of the check | {:.1} ms |", w - wo);
    b1.cleanup().await;
    b2.cleanup().await;
}
