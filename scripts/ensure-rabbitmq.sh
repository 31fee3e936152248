#!/usr/bin/env bash
# Makes sure a RabbitMQ node answers on 127.0.0.1:5672: installs Debian's
# rabbitmq-server when absent and starts it detached when it is not running.
set -euo pipefail
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "== installing rabbitmq-server (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
fi
# RabbitMQ wants many file handles (each quorum queue, stream and classic
# queue holds some; vq makes a claim-marker queue per running job): with
# the default soft limit of 1024 a node with a few hundred queues runs out,
# still answers rabbitmqctl, and silently stops completing AMQP handshakes.
# RabbitMQ's production guide asks for at least 65536.
FD_LIMIT=65536
amqp_answers() {
  # The broker must send connection.start after the protocol header.
  timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672 && printf "AMQP\0\0\11\1" >&3 && head -c 4 <&3' 2>/dev/null | grep -q .
}
fd_limit_ok() {
  local n
  n=$(timeout 20 rabbitmqctl -q eval 'proplists:get_value(total_limit, file_handle_cache:info([total_limit])).' 2>/dev/null || echo 0)
  [ "${n:-0}" -ge 10000 ] 2>/dev/null
}
healthy() {
  timeout 20 rabbitmqctl -q status >/dev/null 2>&1 && amqp_answers && fd_limit_ok
}
if healthy; then
  exit 0
fi
# A node that runs but fails the checks three times in a row, a minute
# apart at most, is hung (seen once here after hundreds of leftover test
# queues); one failed check is not enough: on a loaded 2-core machine
# rabbitmqctl alone can take longer than its timeout. Stop a hung node
# hard before starting a fresh one, or the new node cannot take the name
# and the port.
pids=$(pgrep -u rabbitmq -f 'beam.smp.*rabbit' || true)
if [ -n "$pids" ]; then
  for _ in 1 2; do
    sleep 5
    if healthy; then exit 0; fi
  done
  pids=$(pgrep -u rabbitmq -f 'beam.smp.*rabbit' || true)
fi
if [ -n "$pids" ]; then
  echo "== RabbitMQ runs but does not answer AMQP or has too few file handles: restarting it (pids $pids)"
  pkill -u rabbitmq -f 'rabbitmqctl' 2>/dev/null || true
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 1 15); do pgrep -u rabbitmq -f 'beam.smp.*rabbit' >/dev/null || break; sleep 1; done
  pkill -KILL -u rabbitmq -f 'beam.smp.*rabbit' 2>/dev/null || true
  sleep 1
fi
hard=$(ulimit -Hn)
if [ "$hard" != unlimited ] && [ "$hard" -lt "$FD_LIMIT" ]; then FD_LIMIT=$hard; fi
ulimit -n "$FD_LIMIT"
echo "== starting rabbitmq-server (open files: $FD_LIMIT)"
# Debian's wrapper switches to the rabbitmq user with su, whose PAM session
# puts the soft limit back to 1024; setpriv keeps this shell's limits.
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1 && [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
  (cd /var/lib/rabbitmq && HOME=/var/lib/rabbitmq setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups \
    /usr/lib/rabbitmq/bin/rabbitmq-server -detached)
else
  rabbitmq-server -detached
fi
for _ in $(seq 1 60); do
  if timeout 20 rabbitmqctl -q await_startup >/dev/null 2>&1 && amqp_answers; then
    exit 0
  fi
  sleep 1
done
echo "RabbitMQ did not start within 60 s; see /var/log/rabbitmq/" >&2
exit 1
