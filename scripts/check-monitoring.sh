#!/usr/bin/env bash
# Checks the shipped Prometheus rules: `promtool check rules` (syntax,
# expressions) and `promtool test rules` (the unit tests in
# packaging/prometheus/vq-rules.test.yaml). Installs Debian's prometheus
# package for its promtool when absent (the service it ships is stopped
# and left disabled: only the binary is needed). That the rules and the
# Grafana dashboard name only served metrics is the Rust test
# controller/tests/monitoring_names.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null 2>&1; then
  echo "== apt-get install prometheus (for promtool)"
  apt-get update -qq
  # policy-rc.d 101: the package's service is not started on install.
  restore=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    restore=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  [ -z "$restore" ] || rm -f /usr/sbin/policy-rc.d
fi
promtool check rules packaging/prometheus/vq-rules.yaml
(cd packaging/prometheus && promtool test rules vq-rules.test.yaml)
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' packaging/grafana/vq.json
echo "== monitoring rules and dashboard OK"
