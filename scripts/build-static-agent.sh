#!/usr/bin/env bash
# Builds the static musl jobagent (profile release-agent: lto, opt-level z,
# panic abort, stripped) and checks that it is statically linked.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked -p vq-jobagent --target x86_64-unknown-linux-musl --profile release-agent
bin=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/release-agent/jobagent
desc=$(file -b "$bin")
case "$desc" in
  *"statically linked"*|*"static-pie linked"*) echo "jobagent: $desc" ;;
  *) echo "jobagent is not static: $desc" >&2; exit 1 ;;
esac
