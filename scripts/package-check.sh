#!/usr/bin/env bash
# `make packages-check`: inspects and exercises what `make packages` built in
# target/packages/, as root:
#   1. the packaged jobagent and vq binaries: static (file, ldd), stripped,
#      --version names the version and git commit;
#   2. .deb and .rpm contents: paths, modes, owners, conffiles /
#      %config(noreplace), dependencies (none for the agent and vq), scriptlets
#      that never enable or start the agent; vq ships no scriptlet, unit or
#      file in /etc, and vq-controller no longer ships vq (Recommends it);
#   3. a clean Debian root (debootstrap, cached in /var/cache/vq-debootstrap
#      by suite): the vq package alone (vq --version and --help run, no user,
#      group, unit or /etc file appears, purge leaves nothing); install
#      version N-1 of jobagent, --version, --check-config
#      (fails unconfigured, passes with the identity cloud-init writes from
#      packaging/cloud-init/jobagent-user-data.yaml), systemd-analyze verify,
#      not enabled; modify the config, upgrade to N, config kept; purge
#      removes /etc/vq and the state; the same for vq-controller (system
#      user, config readable by it), upgraded together with vq from a
#      vq-controller 0.1.0-1 that owned /usr/bin/vq; the .rpms of jobagent and
#      vq installed (and upgraded) and erased with rpm in the same root;
#   4. the OCI image: layout, config (user not root, entrypoint, port,
#      volumes, CA bundle env), unpacked with umoci; the controller run from
#      the unpacked rootfs (chroot, image user and env) with --check-config
#      and against vq-cloudsim + RabbitMQ until the packaged agent it booted
#      heartbeats;
#   5. the compose/Kubernetes/cloud-init examples parse.
# Every check prints "ok" or "FAIL"; the script exits 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/target/packages
SUITE=${VQ_DEBOOTSTRAP_SUITE:-bookworm}
MIRROR=${VQ_DEBOOTSTRAP_MIRROR:-http://deb.debian.org/debian}
CACHE=/var/cache/vq-debootstrap
STAMP="$SUITE minbase include=systemd"
MUSL=x86_64-unknown-linux-musl

FAILS=0
CHECKS=0
ok() { CHECKS=$((CHECKS + 1)); echo "ok   $*"; }
bad() { CHECKS=$((CHECKS + 1)); FAILS=$((FAILS + 1)); echo "FAIL $*" >&2; }
# check DESCRIPTION COMMAND...: runs COMMAND, records ok/FAIL.
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
die() { echo "package-check: $*" >&2; exit 1; }
say() { printf '\n== %s\n' "$*"; }
# has TEXT PATTERN: TEXT has a line matching the extended regex PATTERN.
has() { grep -Eq -- "$2" <<<"$1"; }
lacks() { ! grep -Eq -- "$2" <<<"$1"; }

[ "$(id -u)" = 0 ] || die "run as root (chroot, dpkg, umoci)"
scripts/package-tools.sh

one() { # the single file matching a glob
  local m=( $1 )
  [ ${#m[@]} = 1 ] && [ -f "${m[0]}" ] || die "expected exactly one $1 (run make packages)"
  echo "${m[0]}"
}
DEB_AGENT=$(one "$OUT/jobagent_*_amd64.deb")
DEB_CTRL=$(one "$OUT/vq-controller_*_amd64.deb")
DEB_CLI=$(one "$OUT/vq_*_amd64.deb")
RPM_AGENT=$(one "$OUT/jobagent-*.x86_64.rpm")
RPM_CTRL=$(one "$OUT/vq-controller-*.x86_64.rpm")
# vq-<version>…, not vq-controller-…
RPM_CLI=$(one "$OUT/vq-[0-9]*.x86_64.rpm")
IMAGE=$OUT/vq-controller-image
[ -f "$IMAGE/index.json" ] || die "no OCI layout in $IMAGE (run make packages)"
VERSION=$(dpkg-deb -f "$DEB_AGENT" Version)
UPSTREAM=${VERSION%-*}

WORK=$(mktemp -d /tmp/vq-package-check.XXXXXX)
PIDS=()
MOUNTS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  for m in "${MOUNTS[@]}"; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
# The Kubernetes example's Secret holds a controller.toml and a clouds.yaml
# (cloud "mycloud", as every example config names): used below wherever
# --check-config needs credentials it can resolve.
python3 - "$ROOT/packaging/container/kubernetes.yaml" "$WORK" <<'EOF' || die "cannot read the Secret of packaging/container/kubernetes.yaml"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
secret = next(d for d in docs if d["kind"] == "Secret")
for name in ("controller.toml", "clouds.yaml"):
    open(sys.argv[2] + "/k8s-" + name, "w").write(secret["stringData"][name])
EOF

say "1. the packaged jobagent binary"
dpkg-deb -x "$DEB_AGENT" "$WORK/agent-deb"
AGENT=$WORK/agent-deb/usr/sbin/jobagent
desc=$(file -b "$AGENT")
check "jobagent is statically linked ($desc)" has "$desc" 'statically linked|static-pie linked'
check "jobagent is stripped" eval 'has "$desc" ", stripped" && lacks "$desc" "not stripped"'
lddout=$(ldd "$AGENT" 2>&1 || true)
check "ldd jobagent: no dynamic dependencies ($lddout)" has "$lddout" 'not a dynamic executable|statically linked'
ver=$("$AGENT" --version)
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
check "jobagent --version names version and commit: $ver" \
  test "$ver" = "jobagent $UPSTREAM (git $commit)"

dpkg-deb -x "$DEB_CLI" "$WORK/cli-deb"
VQ=$WORK/cli-deb/usr/bin/vq
desc=$(file -b "$VQ")
check "vq is statically linked ($desc)" has "$desc" 'statically linked|static-pie linked'
check "vq is stripped" eval 'has "$desc" ", stripped" && lacks "$desc" "not stripped"'
lddout=$(ldd "$VQ" 2>&1 || true)
check "ldd vq: no dynamic dependencies ($lddout)" has "$lddout" 'not a dynamic executable|statically linked'
ver=$("$VQ" --version)
check "vq --version names version and commit: $ver" test "$ver" = "vq $UPSTREAM (git $commit)"

say "2. package contents"
info=$(dpkg-deb --info "$DEB_AGENT")
list=$(dpkg-deb -c "$DEB_AGENT")
check "jobagent.deb: Package jobagent, Architecture amd64" \
  eval 'has "$info" "^ Package: jobagent$" && has "$info" "^ Architecture: amd64$"'
check "jobagent.deb: no dependencies (static binary; empty Depends field)" lacks "$info" '^ (Pre-)?Depends: *[^ ]'
check "jobagent.deb: /usr/sbin/jobagent 0755 root" has "$list" '^-rwxr-xr-x (root/root|0/0) .* \./usr/sbin/jobagent$'
check "jobagent.deb: /etc/vq/jobagent.toml 0600 root" has "$list" '^-rw------- (root/root|0/0) .* \./etc/vq/jobagent\.toml$'
check "jobagent.deb: systemd unit" has "$list" '^-rw-r--r-- (root/root|0/0) .* \./(usr/)?lib/systemd/system/jobagent\.service$'
check "jobagent.deb: man page jobagent(8)" has "$list" ' \./usr/share/man/man8/jobagent\.8\.gz$'
check "jobagent.deb: changelog and copyright" \
  eval 'has "$list" "/usr/share/doc/jobagent/changelog\.Debian\.gz$" && has "$list" "/usr/share/doc/jobagent/copyright$"'
dpkg-deb -e "$DEB_AGENT" "$WORK/agent-ctrl"
check "jobagent.deb: /etc/vq/jobagent.toml is a conffile" grep -qx /etc/vq/jobagent.toml "$WORK/agent-ctrl/conffiles"
scripts_agent=$(cat "$WORK/agent-ctrl/postinst" "$WORK/agent-ctrl/prerm" "$WORK/agent-ctrl/postrm" 2>/dev/null)
check "jobagent.deb: maintainer scripts reload systemd" has "$scripts_agent" 'systemctl (--system )?daemon-reload'
# dh_installsystemd's no-enable snippet re-enables only a unit the admin had
# enabled (was-enabled); nothing starts or restarts the agent.
check "jobagent.deb: maintainer scripts never enable (unless it was enabled) or (re)start the agent" \
  eval 'test "$(grep -c "deb-systemd-helper enable" <<<"$scripts_agent")" = "$(grep -c "deb-systemd-helper --quiet was-enabled" <<<"$scripts_agent")" && lacks "$scripts_agent" "deb-systemd-invoke .*start|systemctl .*(start|enable)"'
gunzip -c <(dpkg-deb --fsys-tarfile "$DEB_AGENT" | tar -xO ./usr/share/man/man8/jobagent.8.gz) > "$WORK/jobagent.8"
check "jobagent(8) documents --check-config and --config" \
  eval 'grep -q -- "check\\\\-config" "$WORK/jobagent.8" && grep -q -- "\\\\-\\\\-config" "$WORK/jobagent.8"'

info=$(dpkg-deb --info "$DEB_CTRL")
list=$(dpkg-deb -c "$DEB_CTRL")
check "vq-controller.deb: Depends only passwd (useradd)" has "$info" '^ Depends: passwd$'
check "vq-controller.deb: Recommends vq (the CLI is its own package)" has "$info" '^ Recommends: vq$'
check "vq-controller.deb: /usr/bin/vq-controller 0755" has "$list" '^-rwxr-xr-x (root/root|0/0) .* \./usr/bin/vq-controller$'
check "vq-controller.deb: no vq binary, vq man pages or vq completions (package vq)" \
  eval 'lacks "$list" " \./usr/bin/vq$| \./usr/share/man/man1/vq| \./usr/share/(bash-completion/completions/vq|zsh/vendor-completions/_vq|fish/vendor_completions\.d/vq\.fish)$"'
dpkg-deb -e "$DEB_CTRL" "$WORK/ctrl-ctrl"
check "vq-controller.deb: /etc/vq/controller.toml conffile, 0600 in the archive" \
  eval 'has "$list" "^-rw------- (root/root|0/0) .* \./etc/vq/controller\.toml$" && grep -qx /etc/vq/controller.toml "$WORK/ctrl-ctrl/conffiles"'
for f in man/man8/vq-controller.8.gz bash-completion/completions/vq-controller \
         zsh/vendor-completions/_vq-controller fish/vendor_completions.d/vq-controller.fish; do
  check "vq-controller.deb: /usr/share/$f" has "$list" " \\./usr/share/$f\$"
done
check "vq-controller.deb: systemd unit" has "$list" ' \./(usr/)?lib/systemd/system/vq-controller\.service$'
check "vq-controller.deb: Grafana dashboard and Prometheus rules under /usr/share/vq/ (0644)" \
  eval 'has "$list" "^-rw-r--r-- (root/root|0/0) .* \./usr/share/vq/grafana/vq\.json$" && has "$list" "^-rw-r--r-- (root/root|0/0) .* \./usr/share/vq/prometheus/vq-rules\.yaml$"'
check "vq-controller.deb: does not enable or start the service on install (try-restart on upgrade)" \
  eval 'ctl=$(cat "$WORK/ctrl-ctrl/postinst"); test "$(grep -c "deb-systemd-helper enable" <<<"$ctl")" = "$(grep -c "deb-systemd-helper --quiet was-enabled" <<<"$ctl")" && lacks "$ctl" "deb-systemd-invoke (start|restart) "'

info=$(dpkg-deb --info "$DEB_CLI")
list=$(dpkg-deb -c "$DEB_CLI")
check "vq.deb: Package vq, Architecture amd64" \
  eval 'has "$info" "^ Package: vq$" && has "$info" "^ Architecture: amd64$"'
check "vq.deb: no dependencies (static binary; empty Depends field)" lacks "$info" '^ (Pre-)?Depends: *[^ ]'
check "vq.deb: Breaks and Replaces vq-controller (<< 0.1.0-2), which shipped /usr/bin/vq" \
  eval 'has "$info" "^ Breaks: vq-controller \(<< 0\.1\.0-2\)$" && has "$info" "^ Replaces: vq-controller \(<< 0\.1\.0-2\)$"'
check "vq.deb: /usr/bin/vq 0755 root" has "$list" '^-rwxr-xr-x (root/root|0/0) .* \./usr/bin/vq$'
for f in man/man1/vq.1.gz man/man1/vq-submit.1.gz man/man1/vq-stat.1.gz man/man1/vq-drain.1.gz man/man1/vq-nodes.1.gz \
         bash-completion/completions/vq zsh/vendor-completions/_vq fish/vendor_completions.d/vq.fish \
         doc/vq/examples/vq.toml doc/vq/changelog.Debian.gz doc/vq/copyright; do
  check "vq.deb: /usr/share/$f" has "$list" " \\./usr/share/$f\$"
done
check "vq.deb: nothing in /etc, no systemd unit, no other binary" \
  eval 'lacks "$list" " \./etc/| \./(usr/)?lib/systemd/" && test "$(grep -Ec "/s?bin/[^/]+$" <<<"$list")" = 1'
dpkg-deb -e "$DEB_CLI" "$WORK/cli-ctrl"
check "vq.deb: no maintainer scripts and no conffiles (no user, no unit)" \
  eval 'test -z "$(ls "$WORK/cli-ctrl" | grep -Ev "^(control|md5sums)$")"'
gunzip -c <(dpkg-deb --fsys-tarfile "$DEB_CLI" | tar -xO ./usr/share/man/man1/vq.1.gz) > "$WORK/vq.1"
# man_has FILE WORD...: every WORD (fixed text, roff escapes included) is in FILE.
man_has() { local f=$1 w; shift; for w in "$@"; do grep -qF -- "$w" "$f" || return 1; done; }
check "vq(1) documents the commands and the connection options" \
  man_has "$WORK/vq.1" submit stat cancel pools nodes drain '\-\-broker\-url' '\-\-cluster' '\-\-config'

rpminfo=$(rpm -qip "$RPM_AGENT" 2>/dev/null)
rpmfiles=$(rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} (%{FILEFLAGS:fflags}) %{FILENAMES}\n]' "$RPM_AGENT" 2>/dev/null)
rpmreq=$(rpm -qpR "$RPM_AGENT" 2>/dev/null)
rpmscripts=$(rpm -qp --scripts "$RPM_AGENT" 2>/dev/null)
check "jobagent.rpm: Name jobagent, License Apache-2.0" \
  eval 'has "$rpminfo" "^Name +: jobagent$" && has "$rpminfo" "^License +: Apache-2.0$"'
check "jobagent.rpm: requires no libraries (only /bin/sh for scriptlets, rpmlib features, its config)" \
  eval 'lacks "$rpmreq" "\.so|^lib" && lacks "$(grep -Ev "^(/bin/sh|rpmlib\(.*|config\(jobagent\) = .*)$" <<<"$rpmreq")" "."'
check "jobagent.rpm: /usr/sbin/jobagent 0755 root" has "$rpmfiles" '^-rwxr-xr-x root:root \(\) /usr/sbin/jobagent$'
check "jobagent.rpm: /etc/vq/jobagent.toml 0600 root %config(noreplace)" has "$rpmfiles" '^-rw------- root:root \(cn\) /etc/vq/jobagent\.toml$'
check "jobagent.rpm: unit in /usr/lib/systemd/system" has "$rpmfiles" ' /usr/lib/systemd/system/jobagent\.service$'
check "jobagent.rpm: man page" has "$rpmfiles" '\(d\) /usr/share/man/man8/jobagent\.8\.gz$'
check "jobagent.rpm: scriptlets reload systemd, never enable or start" \
  eval 'has "$rpmscripts" "daemon-reload" && lacks "$rpmscripts" "systemctl +(--[a-z-]+ +)*(enable|start|restart|preset) "'
rpmfiles=$(rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} (%{FILEFLAGS:fflags}) %{FILENAMES}\n]' "$RPM_CTRL" 2>/dev/null)
check "vq-controller.rpm: /etc/vq/controller.toml 0640 root:vq %config(noreplace)" has "$rpmfiles" '^-rw-r----- root:vq \(cn\) /etc/vq/controller\.toml$'
check "vq-controller.rpm: the vq-controller binary, not vq's files (package vq)" \
  eval 'has "$rpmfiles" "^-rwxr-xr-x root:root \(\) /usr/bin/vq-controller$" && lacks "$rpmfiles" " /usr/bin/vq$| /usr/share/man/man1/vq| /usr/share/(bash-completion/completions/vq|zsh/site-functions/_vq|fish/vendor_completions\.d/vq\.fish)$"'
check "vq-controller.rpm: creates the vq user before install" has "$(rpm -qp --scripts "$RPM_CTRL" 2>/dev/null)" 'useradd --system'
check "vq-controller.rpm: Grafana dashboard and Prometheus rules under /usr/share/vq/" \
  eval 'has "$rpmfiles" "^-rw-r--r-- root:root \(\) /usr/share/vq/grafana/vq\.json$" && has "$rpmfiles" "^-rw-r--r-- root:root \(\) /usr/share/vq/prometheus/vq-rules\.yaml$"'
check "vq-controller.rpm: Recommends vq" has "$(rpm -qp --recommends "$RPM_CTRL" 2>/dev/null)" '^vq$'

rpminfo=$(rpm -qip "$RPM_CLI" 2>/dev/null)
rpmfiles=$(rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} (%{FILEFLAGS:fflags}) %{FILENAMES}\n]' "$RPM_CLI" 2>/dev/null)
rpmreq=$(rpm -qpR "$RPM_CLI" 2>/dev/null)
check "vq.rpm: Name vq, License Apache-2.0" \
  eval 'has "$rpminfo" "^Name +: vq$" && has "$rpminfo" "^License +: Apache-2.0$"'
# cargo-generate-rpm always adds /bin/sh (the scriptlet interpreter) to
# Requires, even with auto-req off and no scriptlets: allowed, as for jobagent.
check "vq.rpm: requires no libraries (only /bin/sh, rpmlib features)" \
  eval 'lacks "$rpmreq" "\.so|^lib" && lacks "$(grep -Ev "^(/bin/sh|rpmlib\(.*)$" <<<"$rpmreq")" "."'
check "vq.rpm: /usr/bin/vq 0755 root" has "$rpmfiles" '^-rwxr-xr-x root:root \(\) /usr/bin/vq$'
check "vq.rpm: man pages, completions, example config" \
  eval 'has "$rpmfiles" "\(d\) /usr/share/man/man1/vq\.1\.gz$" && has "$rpmfiles" "\(d\) /usr/share/man/man1/vq-submit\.1\.gz$" && has "$rpmfiles" " /usr/share/bash-completion/completions/vq$" && has "$rpmfiles" " /usr/share/zsh/site-functions/_vq$" && has "$rpmfiles" " /usr/share/fish/vendor_completions\.d/vq\.fish$" && has "$rpmfiles" "\(d\) /usr/share/doc/vq/examples/vq\.toml$"'
check "vq.rpm: nothing in /etc, no systemd unit, no other binary" \
  eval 'lacks "$rpmfiles" " /etc/| /usr/lib/systemd/" && test "$(grep -Ec "/s?bin/[^/]+$" <<<"$rpmfiles")" = 1'
check "vq.rpm: no scriptlets" test -z "$(rpm -qp --scripts "$RPM_CLI" 2>/dev/null)"
check "vq.rpm: Conflicts vq-controller < 0.1.0-2 (which owned /usr/bin/vq)" \
  has "$(rpm -qp --conflicts "$RPM_CLI" 2>/dev/null)" '^vq-controller < 0\.1\.0-2$'

say "3. install, upgrade and purge in a clean Debian root ($SUITE)"
BASE=$CACHE/$SUITE
if [ "$(cat "$BASE/.vq-debootstrap-ok" 2>/dev/null)" != "$STAMP" ]; then
  echo "debootstrap $SUITE (minbase + systemd) into $BASE (cached for later runs)"
  rm -rf "$BASE" "$BASE.tmp"
  mkdir -p "$CACHE"
  debootstrap --variant=minbase --include=systemd "$SUITE" "$BASE.tmp" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log" >&2; die "debootstrap of $SUITE from $MIRROR failed: the install test cannot run"; }
  echo "$STAMP" > "$BASE.tmp/.vq-debootstrap-ok"
  mv "$BASE.tmp" "$BASE"
fi
R=$WORK/root
cp -a "$BASE" "$R"
mount -t proc proc "$R/proc" && MOUNTS+=("$R/proc")
in_root() { chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"; }
# snapshot: the root's users, groups, unit files and every file in /etc.
snapshot() {
  cat "$R/etc/passwd" "$R/etc/group"
  (cd "$R" && find etc lib/systemd usr/lib/systemd \( -type f -o -type l \) 2>/dev/null | LC_ALL=C sort)
}

# The vq package alone on the fresh root, as a login node installs it: no
# service user or group, no unit, nothing in /etc.
CLI_VERSION=$(dpkg-deb -f "$DEB_CLI" Version)
cp "$DEB_CLI" "$R/tmp/"
snapshot > "$WORK/before-vq"
in_root dpkg -i "/tmp/$(basename "$DEB_CLI")" < /dev/null > "$WORK/dpkg.log" 2>&1 \
  || { cat "$WORK/dpkg.log" >&2; bad "dpkg -i vq (alone)"; }
check "installed vq $CLI_VERSION alone" \
  test "$(in_root dpkg-query -W -f '${Version} ${Status}' vq)" = "$CLI_VERSION install ok installed"
check "vq --version names the commit (installed alone)" eval 'in_root vq --version | grep -qx "vq $UPSTREAM (git $commit)"'
# lists_commands: `vq --help` in the root exits 0 and lists every command.
lists_commands() {
  local h c
  h=$(in_root vq --help) || return 1
  for c in submit stat cancel pools nodes drain; do has "$h" "^  $c " || return 1; done
}
check "vq --help lists submit, stat, cancel, pools, nodes, drain" lists_commands
check "vq submit --help shows the qsub options" \
  eval 'h=$(in_root vq submit --help) && has "$h" "^  -N <NAME>" && has "$h" "--wait"'
set +e
msg=$(in_root vq --controller http://127.0.0.1:1 pools 2>&1); rc=$?; msg=${msg//$'\n'/ }
set -e
check "vq pools without a controller exits 69 and names it ($msg)" \
  eval 'test "$rc" = 69 && has "$msg" "127\.0\.0\.1:1"'
snapshot > "$WORK/after-vq"
check "installing vq created no user, group, unit or file in /etc" \
  diff -u "$WORK/before-vq" "$WORK/after-vq"
check "vq(1) and vq-submit(1) installed" \
  test -f "$R/usr/share/man/man1/vq.1.gz" -a -f "$R/usr/share/man/man1/vq-submit.1.gz"
in_root dpkg --purge vq > "$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log" >&2; bad "dpkg --purge vq"; }
snapshot > "$WORK/after-vq"
check "purge of vq removed /usr/bin/vq and left the root as it was" \
  eval '! test -e "$R/usr/bin/vq" && ! test -e "$R/usr/share/doc/vq" && diff -u "$WORK/before-vq" "$WORK/after-vq"'

# Version N-1 of the same package, built by cargo-deb with an older version.
PREV_VERSION="$UPSTREAM-0~prev1"
cargo deb --no-build --quiet -p vq-jobagent --target "$MUSL" --profile release-agent \
  --deb-version "$PREV_VERSION" -o "$WORK/jobagent_prev.deb" > /dev/null
cp "$DEB_AGENT" "$WORK/jobagent_prev.deb" "$DEB_CTRL" "$R/tmp/"
in_root dpkg -i /tmp/jobagent_prev.deb < /dev/null > "$WORK/dpkg.log" 2>&1 \
  || { cat "$WORK/dpkg.log" >&2; die "dpkg -i of version $PREV_VERSION failed"; }
check "installed jobagent $PREV_VERSION" test "$(in_root dpkg-query -W -f '${Version}' jobagent)" = "$PREV_VERSION"
check "jobagent --version runs in the root" eval 'in_root jobagent --version | grep -q "^jobagent $UPSTREAM (git "'
check "/etc/vq/jobagent.toml is 0600 root:root" test "$(stat -c '%a %U:%G' "$R/etc/vq/jobagent.toml")" = "600 root:root"
check "the unit is not enabled after install" \
  eval '! ls "$R"/etc/systemd/system/*.wants/jobagent.service >/dev/null 2>&1'
set +e
msg=$(in_root jobagent --check-config 2>&1); rc=$?; msg=${msg//$'\n'/ }
set -e
check "unconfigured (no identity): --check-config exits 64 ($msg)" test "$rc" = 64

# The identity exactly as packaging/cloud-init/jobagent-user-data.yaml makes
# cloud-init write it (the controller fills the placeholders).
python3 - "$ROOT/packaging/cloud-init/jobagent-user-data.yaml" "$R" <<'EOF' || bad "cloud-init template renders"
import os, sys, yaml
tpl, root = sys.argv[1], sys.argv[2]
text = open(tpl).read()
for k, v in {"cluster": "vq", "pool": "default", "agent_id": "vq-default-0001",
             "broker_url": "amqp://vq-agent:s3cret@rabbitmq.example.org:5672/%2f"}.items():
    text = text.replace("{{%s}}" % k, v)
assert text.startswith("#cloud-config\n"), "no #cloud-config header"
doc = yaml.safe_load(text)
files = {f["path"]: f for f in doc["write_files"]}
ident = files["/etc/vq/identity.toml"]
assert ident["permissions"] == "0600" and ident["owner"] == "root:root", ident
dest = root + "/etc/vq/identity.toml"
with open(dest, "w") as f:
    f.write(ident["content"])
os.chmod(dest, 0o600)
cmds = [c if isinstance(c, list) else [c] for c in doc["runcmd"]]
assert ["systemctl", "enable", "--now", "--no-block", "jobagent.service"] in cmds, cmds
assert any("169.254.169.254" in " ".join(c) for c in doc.get("bootcmd", [])), "metadata service not blocked"
assert ["/usr/sbin/jobagent", "--check-config"] in cmds, cmds
print("ok   cloud-init template renders to valid #cloud-config; identity 0600 written")
EOF
check "configured by the cloud-init identity: --check-config passes" \
  eval 'in_root jobagent --check-config | grep -q "pool default agent vq-default-0001"'
exec_start=$(sed -n 's/^ExecStart=//p' "$R"/usr/lib/systemd/system/jobagent.service "$R"/lib/systemd/system/jobagent.service 2>/dev/null | head -n1)
check "the unit's ExecStart ($exec_start) is accepted by the agent" \
  eval 'in_root $exec_start --check-config > /dev/null'
va=$(in_root systemd-analyze verify --man=no jobagent.service 2>&1) \
  && ok "systemd-analyze verify jobagent.service" \
  || bad "systemd-analyze verify jobagent.service: $va"
check "systemd-analyze: the unit drains (KillMode=mixed, TimeoutStopSec, Delegate, Restart)" eval \
  'props=$(grep -E "^(KillMode|TimeoutStopSec|Delegate|Restart)=" "$R"/lib/systemd/system/jobagent.service "$R"/usr/lib/systemd/system/jobagent.service 2>/dev/null | cut -d: -f2); has "$props" "^KillMode=mixed$" && has "$props" "^Delegate=yes$" && has "$props" "^Restart=on-failure$" && has "$props" "^TimeoutStopSec="'

# A site's change to the config, then the upgrade to N.
sed -i 's/^slots = .*/slots = 7/' "$R/etc/vq/jobagent.toml"
echo "# site change $$" >> "$R/etc/vq/jobagent.toml"
in_root dpkg -i "/tmp/$(basename "$DEB_AGENT")" < /dev/null > "$WORK/dpkg.log" 2>&1 \
  || { cat "$WORK/dpkg.log" >&2; bad "dpkg -i (upgrade to $VERSION)"; }
check "upgraded to jobagent $VERSION" test "$(in_root dpkg-query -W -f '${Version}' jobagent)" = "$VERSION"
check "upgrade kept the modified config" \
  eval 'grep -qx "slots = 7" "$R/etc/vq/jobagent.toml" && grep -qx "# site change $$" "$R/etc/vq/jobagent.toml"'
check "upgrade kept mode 0600 and left no .dpkg-* files" \
  eval 'test "$(stat -c %a "$R/etc/vq/jobagent.toml")" = 600 && ! ls "$R"/etc/vq/*.dpkg-* >/dev/null 2>&1'
check "the upgrade did not enable the unit" \
  eval '! ls "$R"/etc/systemd/system/*.wants/jobagent.service >/dev/null 2>&1'
mkdir -p "$R/var/lib/vq" && echo x > "$R/var/lib/vq/leftover"
in_root dpkg --purge jobagent > "$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log" >&2; bad "dpkg --purge jobagent"; }
check "purge removed /etc/vq, /var/lib/vq, the binary and the unit" \
  eval '! test -e "$R/etc/vq" && ! test -e "$R/var/lib/vq" && ! test -e "$R/usr/sbin/jobagent" && ! ls "$R"/{usr/,}lib/systemd/system/jobagent.service >/dev/null 2>&1'

# vq-controller 0.1.0-1 (as released) owned /usr/bin/vq: a stand-in with
# that file, then the new vq and vq-controller in one dpkg run, as apt does
# it (vq Breaks and Replaces vq-controller << 0.1.0-2).
OLD=$WORK/vq-controller-0.1.0-1
mkdir -p "$OLD/DEBIAN" "$OLD/usr/bin"
cp "$VQ" "$OLD/usr/bin/vq"
printf '%s\n' 'Package: vq-controller' 'Version: 0.1.0-1' 'Architecture: amd64' \
  'Maintainer: vq maintainers <vq@example.invalid>' \
  'Description: stand-in for vq-controller 0.1.0-1, which shipped /usr/bin/vq' > "$OLD/DEBIAN/control"
dpkg-deb --build --root-owner-group "$OLD" "$R/tmp/vq-controller_0.1.0-1_amd64.deb" > /dev/null
in_root dpkg -i /tmp/vq-controller_0.1.0-1_amd64.deb < /dev/null > "$WORK/dpkg.log" 2>&1 \
  || { cat "$WORK/dpkg.log" >&2; bad "dpkg -i vq-controller 0.1.0-1 (stand-in)"; }
CTRL_VERSION=$(dpkg-deb -f "$DEB_CTRL" Version)
in_root dpkg -i --auto-deconfigure "/tmp/$(basename "$DEB_CLI")" "/tmp/$(basename "$DEB_CTRL")" \
  < /dev/null > "$WORK/dpkg.log" 2>&1 \
  || { cat "$WORK/dpkg.log" >&2; bad "dpkg -i vq and vq-controller over vq-controller 0.1.0-1"; }
check "upgraded vq-controller 0.1.0-1 to $CTRL_VERSION with vq $CLI_VERSION; /usr/bin/vq now belongs to vq" \
  eval 'test "$(in_root dpkg-query -W -f "\${Version} \${Status}" vq-controller)" = "$CTRL_VERSION install ok installed" && test "$(in_root dpkg-query -W -f "\${Status}" vq)" = "install ok installed" && test "$(in_root dpkg -S /usr/bin/vq)" = "vq: /usr/bin/vq"'
check "vq-controller: system user vq created" eval 'in_root getent passwd vq | grep -q "^vq:x:[0-9]*:[0-9]*:.*:/nonexistent:/usr/sbin/nologin$"'
check "vq-controller: /etc/vq/controller.toml is 0640 root:vq" test "$(stat -c '%a %U' "$R/etc/vq/controller.toml"):$(in_root stat -c %G /etc/vq/controller.toml)" = "640 root:vq"
check "vq --version and vq-controller --version name the commit" \
  eval 'in_root vq --version | grep -q "(git $commit)" && in_root vq-controller --version | grep -q "(git $commit)"'
mkdir -p "$R/etc/openstack"
install -m 640 "$WORK/k8s-clouds.yaml" "$R/etc/openstack/clouds.yaml"
in_root chgrp vq /etc/openstack/clouds.yaml
check "vq-controller --check-config as user vq on the installed config (clouds.yaml of group vq)" \
  eval 'in_root setpriv --reuid=vq --regid=vq --clear-groups vq-controller --check-config > /dev/null'
va=$(in_root systemd-analyze verify --man=no vq-controller.service 2>&1) \
  && ok "systemd-analyze verify vq-controller.service" \
  || bad "systemd-analyze verify vq-controller.service: $va"
in_root dpkg --purge vq-controller > "$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log" >&2; bad "dpkg --purge vq-controller"; }
check "purge of vq-controller removed /etc/vq and its binary, left vq's" \
  eval '! test -e "$R/etc/vq" && ! test -e "$R/usr/bin/vq-controller" && in_root vq --version > /dev/null'
in_root dpkg --purge vq > "$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log" >&2; bad "dpkg --purge vq"; }

# The .rpm with rpm in the same root (scriptlets run chrooted there; the
# root has no rpm database of its libraries, hence --nodeps).
cargo generate-rpm -p jobagent --target "$MUSL" --profile release-agent \
  -s 'release = "0"' -o "$WORK/jobagent_prev.rpm" > /dev/null
RPM=(rpm --root "$R" --nodeps --quiet)
"${RPM[@]}" -i "$WORK/jobagent_prev.rpm" 2> "$WORK/rpm.log" || { cat "$WORK/rpm.log" >&2; bad "rpm -i jobagent (release 0)"; }
check "rpm: /usr/sbin/jobagent runs, config 0600" \
  eval 'in_root jobagent --version >/dev/null && test "$(stat -c %a "$R/etc/vq/jobagent.toml")" = 600'
echo "# site change rpm $$" >> "$R/etc/vq/jobagent.toml"
"${RPM[@]}" -U "$RPM_AGENT" 2> "$WORK/rpm.log" || { cat "$WORK/rpm.log" >&2; bad "rpm -U jobagent"; }
check "rpm: upgrade kept the modified config" grep -qx "# site change rpm $$" "$R/etc/vq/jobagent.toml"
"${RPM[@]}" -e jobagent 2> "$WORK/rpm.log" || { cat "$WORK/rpm.log" >&2; bad "rpm -e jobagent"; }
check "rpm: erase removed the binary and kept the modified config as .rpmsave" \
  eval '! test -e "$R/usr/sbin/jobagent" && test -f "$R/etc/vq/jobagent.toml.rpmsave"'
snapshot > "$WORK/before-vq"
"${RPM[@]}" -i "$RPM_CLI" 2> "$WORK/rpm.log" || { cat "$WORK/rpm.log" >&2; bad "rpm -i vq"; }
check "rpm: vq --version names the commit, vq --help runs" \
  eval 'in_root vq --version | grep -qx "vq $UPSTREAM (git $commit)" && in_root vq --help > /dev/null'
snapshot > "$WORK/after-vq"
check "rpm: installing vq created no user, group, unit or file in /etc" diff -u "$WORK/before-vq" "$WORK/after-vq"
"${RPM[@]}" -e vq 2> "$WORK/rpm.log" || { cat "$WORK/rpm.log" >&2; bad "rpm -e vq"; }
check "rpm: erase of vq removed /usr/bin/vq" eval '! test -e "$R/usr/bin/vq"'

say "4. the controller OCI image"
TAG=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])' "$IMAGE/index.json")
check "OCI layout: oci-layout 1.0.0, one manifest tagged $TAG" \
  eval 'grep -q "\"imageLayoutVersion\": *\"1.0.0\"" "$IMAGE/oci-layout" && test "$TAG" = "$UPSTREAM"'
skopeo inspect --config "oci:$IMAGE:$TAG" > "$WORK/image-config.json"
python3 - "$WORK/image-config.json" <<'EOF' && ok "image config: user 65532 (not root), entrypoint, port 9180, volumes, SSL_CERT_FILE, linux/amd64" || bad "image config"
import json, sys
c = json.load(open(sys.argv[1]))
cfg = c["config"]
user = cfg.get("User", "")
assert user and user.split(":")[0] not in ("", "0", "root"), f"User {user!r}"
assert cfg["Entrypoint"] == ["/usr/bin/vq-controller"], cfg.get("Entrypoint")
assert cfg["Cmd"] == ["--config", "/etc/vq/controller.toml"], cfg.get("Cmd")
assert "9180/tcp" in cfg.get("ExposedPorts", {}), cfg.get("ExposedPorts")
assert {"/etc/vq", "/etc/openstack"} <= set(cfg.get("Volumes", {})), cfg.get("Volumes")
assert "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in cfg["Env"], cfg["Env"]
assert c["os"] == "linux" and c["architecture"] == "amd64", (c["os"], c["architecture"])
assert len(c["rootfs"]["diff_ids"]) >= 1
EOF
umoci unpack --image "$IMAGE:$TAG" "$WORK/bundle" > /dev/null 2>&1 \
  && ok "umoci unpack (digests verified)" || bad "umoci unpack"
RF=$WORK/bundle/rootfs
check "rootfs: static vq-controller, CA bundle, user 65532, no shell" \
  eval 'file -b "$RF/usr/bin/vq-controller" | grep -Eq "statically linked|static-pie linked" && test -s "$RF/etc/ssl/certs/ca-certificates.crt" && grep -q "^vq:x:65532:65532:" "$RF/etc/passwd" && ! test -e "$RF/bin/sh"'
check "rootfs: Grafana dashboard and Prometheus rules under /usr/share/vq/, as in the source tree" \
  eval 'cmp -s "$RF/usr/share/vq/grafana/vq.json" packaging/grafana/vq.json && cmp -s "$RF/usr/share/vq/prometheus/vq-rules.yaml" packaging/prometheus/vq-rules.yaml'
# Run as a runtime would: chroot into the rootfs with the image's user and env.
IMG_USER=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["config"]["User"])' "$WORK/image-config.json")
mapfile -t IMG_ENV < <(python3 -c 'import json,sys; print("\n".join(json.load(open(sys.argv[1]))["config"]["Env"]))' "$WORK/image-config.json")
install -m 644 "$WORK/k8s-clouds.yaml" "$RF/etc/openstack/clouds.yaml"
check "image: vq-controller --check-config on the image's default config (clouds.yaml in the volume)" \
  eval 'env -i "${IMG_ENV[@]}" chroot --userspec="$IMG_USER" "$RF" /usr/bin/vq-controller --check-config > /dev/null'

scripts/ensure-rabbitmq.sh
SIM=$(realpath -m "${CARGO_TARGET_DIR:-target}")/debug/vq-cloudsim
[ -x "$SIM" ] || cargo build --locked -p vq-tests --bin vq-cloudsim
mkdir -p "$WORK/sim"
cat > "$WORK/agent.toml" <<EOF
cluster = "vqpkgcheck"
slots = 1
heartbeat_secs = 1.0
EOF
"$SIM" --listen 127.0.0.1:0 --state-dir "$WORK/sim" --agent-bin "$AGENT" --agent-config "$WORK/agent.toml" \
  --boot-delay-secs 0.5 > "$WORK/cloudsim.out" 2> "$WORK/cloudsim.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q '^READY ' "$WORK/cloudsim.out" 2>/dev/null && break; sleep 0.1; done
grep -q '^READY ' "$WORK/cloudsim.out" || { cat "$WORK/cloudsim.log" >&2; die "vq-cloudsim did not start"; }
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cp "$WORK/sim/clouds.yaml" "$RF/etc/openstack/clouds.yaml"
chmod 644 "$RF/etc/openstack/clouds.yaml"
cat > "$RF/etc/vq/controller.toml" <<EOF
cluster = "vqpkgcheck"
listen = "127.0.0.1:$PORT"
interval_secs = 1.0
heartbeat_timeout_secs = 30.0
[broker]
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[openstack]
cloud = "cloudsim"
[pools.default]
flavor = "m1.small"
image = "vq-worker"
agent_broker_url = "amqp://guest:guest@127.0.0.1:5672/%2f"
min = 1
max = 1
slots = 1
boot_timeout_secs = 60
idle_secs = 600
cooldown_secs = 1
EOF
env -i "${IMG_ENV[@]}" chroot --userspec="$IMG_USER" "$RF" /usr/bin/vq-controller \
  > "$WORK/controller.log" 2>&1 &
PIDS+=($!)
active=0
for _ in $(seq 1 60); do
  active=$(curl -fsS "http://127.0.0.1:$PORT/status" 2>/dev/null \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["pools"]["default"]["vms"]["active"])' 2>/dev/null || echo 0)
  [ "$active" -ge 1 ] && break
  sleep 1
done
check "image: controller from the rootfs serves /healthz" eval 'curl -fsS "http://127.0.0.1:$PORT/healthz" | grep -q ok'
check "image: controller booted a server on vq-cloudsim whose packaged agent heartbeats (active=$active)" test "$active" -ge 1
[ "$active" -ge 1 ] || { tail -n 20 "$WORK/controller.log" "$WORK/cloudsim.log" >&2; }

say "5. examples"
python3 - "$ROOT/packaging/container/compose.yaml" "$ROOT/packaging/container/kubernetes.yaml" <<'EOF' \
  && ok "compose.yaml and kubernetes.yaml parse; liveness on /healthz, readiness on /readyz" || bad "compose/kubernetes examples"
import sys, yaml
compose = yaml.safe_load(open(sys.argv[1]))
assert {"rabbitmq", "vq-controller"} <= set(compose["services"])
docs = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d]
kinds = {d["kind"] for d in docs}
assert {"Deployment", "Secret", "Service", "StatefulSet"} <= kinds, kinds
dep = next(d for d in docs if d["kind"] == "Deployment")
c = dep["spec"]["template"]["spec"]["containers"][0]
assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
EOF
check "kubernetes.yaml: its controller.toml and clouds.yaml pass vq-controller --check-config" \
  eval 'env -i OS_CLIENT_CONFIG_FILE="$WORK/k8s-clouds.yaml" "$RF/usr/bin/vq-controller" --check-config --config "$WORK/k8s-controller.toml" > /dev/null'

echo
if [ "$FAILS" = 0 ]; then
  echo "package-check ok: $CHECKS checks passed"
else
  echo "package-check FAILED: $FAILS of $CHECKS checks failed" >&2
  exit 1
fi
