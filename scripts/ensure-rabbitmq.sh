#!/usr/bin/env bash
# Makes sure a RabbitMQ node answers on 127.0.0.1:5672: installs Debian's
# rabbitmq-server when absent and starts it detached when it is not running.
set -euo pipefail
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "== installing rabbitmq-server (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
fi
if timeout 20 rabbitmqctl -q status >/dev/null 2>&1; then
  exit 0
fi
echo "== starting rabbitmq-server"
rabbitmq-server -detached
for _ in $(seq 1 60); do
  if timeout 20 rabbitmqctl -q await_startup >/dev/null 2>&1; then
    exit 0
  fi
  sleep 1
done
echo "RabbitMQ did not start within 60 s; see /var/log/rabbitmq/" >&2
exit 1
