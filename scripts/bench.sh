#!/usr/bin/env bash
# The agent benchmark of issue 14 (tests/tests/bench_agent.rs): one static
# agent with 2 slots on a private RabbitMQ node beside the launch floor
# (tests/src/bin/launch-floor.rs) in interleaved rounds, then strace counts;
# prints a Markdown table of medians and ratios. Root (the agent and the
# floor switch users). Celery is measured beside them when BENCH_CELERY
# names a python that can import celery (e.g. a venv:
# `python3 -m venv /tmp/celvenv && /tmp/celvenv/bin/pip install celery`).
# Knobs: BENCH_ROUNDS (3), BENCH_JOBS (200), BENCH_LATENCY_JOBS (40),
# BENCH_STRACE_JOBS (40); NO_BUILD=1 reuses the static agent.
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-target}
[ -n "${NO_BUILD:-}" ] || scripts/build-static-agent.sh >/dev/null
export VQ_JOBAGENT_BIN=${VQ_JOBAGENT_BIN:-$T/x86_64-unknown-linux-musl/release-agent/jobagent}
cargo build -q -p vq-tests --bin launch-floor
export VQ_LAUNCH_FLOOR_BIN=$T/debug/launch-floor
echo "commit $(git rev-parse --short HEAD) $(date -u +%FT%TZ) agent $VQ_JOBAGENT_BIN ($(stat -c %s "$VQ_JOBAGENT_BIN") bytes)"
echo "host: $(nproc) cores, $(ls /proc | grep -c '^[0-9]') processes, load $(cut -d' ' -f1-3 /proc/loadavg)"
export VQ_BENCH=1
exec cargo test -q -p vq-tests --test bench_agent -- --ignored --nocapture --test-threads 1
