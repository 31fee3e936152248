#!/usr/bin/env bash
# Measures the static jobagent: stripped binary size (bytes) and idle RSS
# (KiB, connected to the local RabbitMQ, consuming, heartbeating) over RUNS
# starts; prints each run and the median. Root (the agent refuses otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
[ -n "${NO_BUILD:-}" ] || scripts/build-static-agent.sh >/dev/null
BIN=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/release-agent/jobagent
echo "binary: $BIN"
echo "size_bytes $(stat -c %s "$BIN")"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/agent.toml" <<CFG
cluster = "bench$$"
pool = "idle"
agent_id = "bench-agent"
heartbeat_secs = 1.0
state_dir = "$DIR/state"
CFG
rss=()
for i in $(seq 1 "$RUNS"); do
  "$BIN" --config "$DIR/agent.toml" --state-dir "$DIR/state" 2>"$DIR/agent.log" &
  pid=$!
  sleep 5   # connected, topology declared, a few heartbeats sent
  kb=$(awk '/^VmRSS:/{print $2}' "/proc/$pid/status")
  kill -TERM "$pid"; wait "$pid" || true
  echo "run $i idle_rss_kib $kb"
  rss+=("$kb")
done
median=$(printf '%s\n' "${rss[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "idle_rss_kib_median $median"
# The bench cluster's queues are left empty; remove them.
for q in "bench$$.jobs.idle" "bench$$.jobs.dead" "bench$$.events.log" "bench$$.demand"; do
  rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
done
