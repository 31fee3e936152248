#!/usr/bin/env bash
# vq demo on the embedded test cloud (vq-cloudsim), as README.md describes.
#
# Installs/starts RabbitMQ if absent, builds vq, creates the demo user
# `vqdemo` (Unix and submitter broker account) and the controller's and
# agents' broker accounts (README.md permissions, never guest), starts
# vq-cloudsim and vq-controller, submits examples/*.pbs as vqdemo, shows the pool scaling up, the jobs
# running and their output files, the pool scaling back to zero, and checks
# each of those facts before it prints its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

CLUSTER=${VQ_DEMO_CLUSTER:-demo}
POOL=default
DEMO_USER=vqdemo
DEMO_PASS=vqdemo-secret
WORK=${VQ_DEMO_DIR:-/tmp/vq-demo}
PORT=${VQ_DEMO_STATUS_PORT:-9180}
BROKER_HOST=127.0.0.1:5672
TIMEOUT=${VQ_DEMO_TIMEOUT:-180}

say() { printf '\n== %s\n' "$*"; }
fail() { printf '\ndemo FAILED: %s\n' "$*" >&2; exit 1; }

scripts/ensure-toolchain.sh
scripts/ensure-rabbitmq.sh

say "building vq (release) and the static jobagent"
cargo build --locked --release -p vq-controller -p vq-cli -p vq-tests --bins
scripts/build-static-agent.sh
TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-$ROOT/target}")
BIN=$TARGET_DIR/release
AGENT=$TARGET_DIR/x86_64-unknown-linux-musl/release-agent/jobagent

say "demo user $DEMO_USER (Unix account and submitter broker account); controller and agent broker accounts"
if ! id "$DEMO_USER" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$DEMO_USER"
fi
DEMO_UID=$(id -u "$DEMO_USER")
# One broker account per role, with exactly the permissions README.md
# documents ("Broker accounts and trust"), printed by the code that defines
# them; never guest.
broker_account() { # ROLE USER PASSWORD
  local role=$1 user=$2 pass=$3 perms
  if ! rabbitmqctl -q list_users | awk '{print $1}' | grep -qx "$user"; then
    rabbitmqctl -q add_user "$user" "$pass" >/dev/null
  fi
  rabbitmqctl -q change_password "$user" "$pass" >/dev/null
  mapfile -t perms < <("$BIN/vq-controller" --print-permissions "$role" "$CLUSTER")
  [ "${#perms[@]}" = 3 ] || fail "no permissions for role $role"
  rabbitmqctl -q set_permissions -p / "$user" "${perms[0]}" "${perms[1]}" "${perms[2]}" >/dev/null
  echo "broker account $user ($role): configure ${perms[0]}  write ${perms[1]}  read ${perms[2]}"
}
CTL_USER=vqdemo-controller
CTL_PASS=vqdemo-controller-secret
AGENT_USER=vqdemo-agent
AGENT_PASS=vqdemo-agent-secret
broker_account submitter "$DEMO_USER" "$DEMO_PASS"
broker_account controller "$CTL_USER" "$CTL_PASS"
broker_account agent "$AGENT_USER" "$AGENT_PASS"

rm -rf "$WORK"
mkdir -p "$WORK/sim"
chmod 700 "$WORK"
cat > "$WORK/jobagent.toml" <<EOF
# jobagent config of every demo VM; pool, agent id and broker URL come from
# the identity file that cloud-init (here: vq-cloudsim) writes from user-data.
cluster = "$CLUSTER"
slots = 2
min_uid = 1000
heartbeat_secs = 1.0
default_walltime_secs = 600
kill_grace_secs = 5
# broker users whose drain/ask-delete this agent obeys: the controller's
# account
control_admins = ["$CTL_USER"]
[submitters]
same_name = true
# the controller's account returns jobs of lost VMs
requeuers = ["$CTL_USER"]
EOF
cat > "$WORK/controller.toml" <<EOF
cluster = "$CLUSTER"
listen = "127.0.0.1:$PORT"
interval_secs = 1.0
heartbeat_timeout_secs = 15.0
[broker]
url = "amqp://$CTL_USER:$CTL_PASS@$BROKER_HOST/%2f"
[openstack]
cloud = "cloudsim"
[pools.$POOL]
flavor = "m1.small"
image = "vq-worker"
# the agents log in with the agent account, never the controller's: the
# identity file (user-data) is readable by jobs on the VM
agent_broker_url = "amqp://$AGENT_USER:$AGENT_PASS@$BROKER_HOST/%2f"
min = 0
max = 3
slots = 2
boot_timeout_secs = 60
idle_secs = 3
cooldown_secs = 2
# the demo returns to zero at once (production: keep VMs 300 s at least)
min_lifetime_secs = 0
EOF

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

say "starting vq-cloudsim (Keystone v3 + Nova + Glance subset; a server boot starts a jobagent)"
"$BIN/vq-cloudsim" --listen 127.0.0.1:0 --state-dir "$WORK/sim" --agent-bin "$AGENT" \
  --agent-config "$WORK/jobagent.toml" --boot-delay-secs 1 --quota-instances 10 \
  > "$WORK/cloudsim.out" 2> "$WORK/cloudsim.log" &
PIDS+=($!)
for _ in $(seq 1 50); do grep -q '^READY ' "$WORK/cloudsim.out" 2>/dev/null && break; sleep 0.2; done
SIM_URL=$(awk '/^READY /{print $2}' "$WORK/cloudsim.out")
[ -n "$SIM_URL" ] || fail "vq-cloudsim did not start (see $WORK/cloudsim.log)"
echo "cloud at $SIM_URL, clouds.yaml at $WORK/sim/clouds.yaml"

say "starting vq-controller (status on http://127.0.0.1:$PORT/status)"
OS_CLIENT_CONFIG_FILE="$WORK/sim/clouds.yaml" OS_CLOUD=cloudsim RUST_LOG=${RUST_LOG:-info} \
  "$BIN/vq-controller" --config "$WORK/controller.toml" > "$WORK/controller.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 0.2; done
curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null || fail "vq-controller did not start (see $WORK/controller.log)"

# vq runs as the demo user with a login-like clean environment (what a user
# on a submit host has), plus one variable that env.pbs passes with -v.
VQ=( env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/home/$DEMO_USER USER=$DEMO_USER LOGNAME=$DEMO_USER \
     SHELL=/bin/bash LANG=C.UTF-8 DEMO_FROM_SUBMIT=hello-from-the-submit-host \
     "VQ_BROKER_URL=amqp://$DEMO_USER:$DEMO_PASS@$BROKER_HOST/%2f" "VQ_CLUSTER=$CLUSTER" \
     "VQ_CONTROLLER_URL=http://127.0.0.1:$PORT" "$BIN/vq" )
JOBDIR=/home/$DEMO_USER/vq-demo
rm -rf "$JOBDIR"
runuser -u "$DEMO_USER" -- mkdir -p "$JOBDIR"
cp examples/*.pbs "$JOBDIR/" && chown "$DEMO_USER:" "$JOBDIR"/*.pbs

say "pool before submitting"
"${VQ[@]}" pools

say "submitting examples/*.pbs as $DEMO_USER"
declare -A JOB_OF WAITER
SCRIPTS=()
for f in "$JOBDIR"/*.pbs; do
  name=$(basename "$f")
  SCRIPTS+=("$name")
  # --wait prints the job id, then waits for the job's final event and exits
  # with its exit status.
  ( cd "$JOBDIR" && runuser -u "$DEMO_USER" -- "${VQ[@]}" submit --wait "$name" > "$WORK/submit-$name.out" 2> "$WORK/submit-$name.err" ) &
  WAITER[$name]=$!
done
for name in "${SCRIPTS[@]}"; do
  for _ in $(seq 1 50); do [ -s "$WORK/submit-$name.out" ] && break; sleep 0.2; done
  JOB_OF[$name]=$(head -n1 "$WORK/submit-$name.out")
  [ -n "${JOB_OF[$name]}" ] || fail "submitting $name printed no job id: $(cat "$WORK/submit-$name.err")"
  echo "$name -> job ${JOB_OF[$name]}"
done
N=${#SCRIPTS[@]}

say "the pool scales up and runs the jobs"
MAX_VMS=0
deadline=$((SECONDS + TIMEOUT))
while :; do
  vms=$(curl -fsS "$SIM_URL/_sim/servers" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["servers"]))' 2>/dev/null || echo 0)
  [ "$vms" -gt "$MAX_VMS" ] && MAX_VMS=$vms
  running=0
  for name in "${SCRIPTS[@]}"; do kill -0 "${WAITER[$name]}" 2>/dev/null && running=$((running + 1)); done
  [ "$running" = 0 ] && break
  [ $SECONDS -lt $deadline ] || fail "jobs still unfinished after ${TIMEOUT}s (see $WORK/*.log)"
  sleep 2
  "${VQ[@]}" pools | sed 's/^/   /'
done
[ "$MAX_VMS" -ge 1 ] || fail "the pool never scaled up"
# Every VM's identity file (what cloud-init wrote from user-data) names
# the agent account, and none carries the controller's password.
shopt -s nullglob
IDS=("$WORK"/sim/vms/*/identity.toml)
shopt -u nullglob
[ "${#IDS[@]}" -ge 1 ] || fail "no VM identity file under $WORK/sim/vms"
for f in "${IDS[@]}"; do
  grep -q "amqp://$AGENT_USER:" "$f" || fail "$f does not log the agent in as $AGENT_USER"
  if grep -q "$CTL_PASS" "$f"; then fail "$f carries the controller's password"; fi
done
echo "${#IDS[@]} VM identity file(s): agents log in as $AGENT_USER"
echo "pool peaked at $MAX_VMS VM(s)"

FINISHED=0
for name in "${SCRIPTS[@]}"; do
  if wait "${WAITER[$name]}"; then FINISHED=$((FINISHED + 1)); else
    echo "job of $name did not finish with exit status 0: $(cat "$WORK/submit-$name.err")" >&2
  fi
done

say "job states (vq stat -a)"
"${VQ[@]}" stat -a

say "output files"
VERIFIED=0
for name in "${SCRIPTS[@]}"; do
  id=${JOB_OF[$name]}
  jobname=$(sed -n 's/^#PBS -N \([^ ]*\).*/\1/p' "$JOBDIR/$name" | head -n1)
  outname=$(sed -n 's/^#PBS -o \([^ ]*\).*/\1/p' "$JOBDIR/$name" | head -n1)
  out=$JOBDIR/${outname:-$jobname.o${id%%[-.]*}}
  [ -f "$out" ] || out=
  if [ -z "$out" ]; then echo "no output file for $name (job $id)" >&2; continue; fi
  owner=$(stat -c %u "$out")
  echo "--- $out (owner uid $owner)"
  sed 's/^/   /' "$out"
  if [ "$owner" = "$DEMO_UID" ] && grep -q "^VQ-DEMO-OK $jobname uid=$DEMO_UID\$" "$out"; then
    VERIFIED=$((VERIFIED + 1))
  else
    echo "output of $name is not owned by $DEMO_USER or lacks its VQ-DEMO-OK line" >&2
  fi
done

say "the pool scales back to zero"
deadline=$((SECONDS + TIMEOUT))
while :; do
  vms=$(curl -fsS "$SIM_URL/_sim/servers" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["servers"]))' 2>/dev/null || echo unknown)
  "${VQ[@]}" pools | sed 's/^/   /'
  [ "$vms" = 0 ] && break
  [ $SECONDS -lt $deadline ] || fail "$vms VM(s) still there after ${TIMEOUT}s"
  sleep 2
done

say "controller decisions (from $WORK/controller.log)"
grep -E 'boot|ask|delete' "$WORK/controller.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 20 | sed 's/^/   /' || true

[ "$FINISHED" = "$N" ] || fail "$FINISHED/$N jobs finished"
[ "$VERIFIED" = "$N" ] || fail "$VERIFIED/$N outputs verified"
echo
echo "demo ok: $FINISHED/$N jobs finished, outputs verified, $vms VMs left"
