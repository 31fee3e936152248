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
# A node that runs but does not answer within 20 s is hung (seen once here
# after hundreds of leftover test queues): stop it hard before starting a
# fresh one, or the new node cannot take the name and the port.
pids=$(pgrep -u rabbitmq -f 'beam.smp.*rabbit' || true)
if [ -n "$pids" ]; then
  echo "== RabbitMQ runs but does not answer: restarting it (pids $pids)"
  pkill -u rabbitmq -f 'rabbitmqctl' 2>/dev/null || true
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 1 15); do pgrep -u rabbitmq -f 'beam.smp.*rabbit' >/dev/null || break; sleep 1; done
  pkill -KILL -u rabbitmq -f 'beam.smp.*rabbit' 2>/dev/null || true
  sleep 1
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
