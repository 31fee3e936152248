#!/usr/bin/env bash
# `make packages`: builds every artefact of a release from the checkout into
# target/packages/:
#   jobagent_<v>_amd64.deb, jobagent-<v>.x86_64.rpm         the static agent
#   vq-controller_<v>_amd64.deb, vq-controller-<v>.x86_64.rpm the controller
#   vq_<v>_amd64.deb, vq-<v>.x86_64.rpm                      the vq CLI
#   vq-controller-image/                                    OCI image layout
# Binaries are static musl builds (agent: profile release-agent, tuned for
# size; controller and CLI: release). Man pages and completions are rendered by the
# binaries themselves (hidden --generate-man / --completions flags).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/target/packages
GEN=$OUT/.gen
MUSL=x86_64-unknown-linux-musl
# Binaries where cargo puts them (CARGO_TARGET_DIR honoured); the packages
# and the generated man pages/completions always in ./target/packages/.
TARGET=$(realpath -m "${CARGO_TARGET_DIR:-target}")
AGENT=$TARGET/$MUSL/release-agent/jobagent
CTRL_DIR=$TARGET/$MUSL/release

say() { printf '== %s\n' "$*"; }
static_or_die() {
  local desc
  desc=$(file -b "$1")
  case "$desc" in
    *"statically linked"*|*"static-pie linked"*) echo "$(basename "$1"): $desc" ;;
    *) echo "$1 is not statically linked: $desc" >&2; exit 1 ;;
  esac
}

[ "$(id -u)" = 0 ] || { echo "make packages: run as root (buildah's vfs storage)" >&2; exit 1; }
scripts/ensure-toolchain.sh
scripts/package-tools.sh
# Reproducible timestamps in the .rpm files and the image: the commit time.
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)
export SOURCE_DATE_EPOCH

say "static jobagent (musl, profile release-agent)"
scripts/build-static-agent.sh
static_or_die "$AGENT"
say "static vq-controller and vq (musl, release)"
cargo build --locked -p vq-controller -p vq-cli --target "$MUSL" --release --bins
static_or_die "$CTRL_DIR/vq-controller"
static_or_die "$CTRL_DIR/vq"

say "man pages and completions (rendered by the binaries)"
rm -rf "$GEN" && mkdir -p "$GEN/man" "$GEN/completions"
"$AGENT" --generate-man "$GEN/man"
"$CTRL_DIR/vq-controller" --generate-man "$GEN/man"
"$CTRL_DIR/vq" --generate-man "$GEN/man"
gzip -9n "$GEN"/man/*
for bin in vq vq-controller; do
  "$CTRL_DIR/$bin" --completions bash > "$GEN/completions/$bin.bash"
  "$CTRL_DIR/$bin" --completions zsh > "$GEN/completions/_$bin"
  "$CTRL_DIR/$bin" --completions fish > "$GEN/completions/$bin.fish"
done

say ".deb and .rpm packages"
rm -f "$OUT"/*.deb "$OUT"/*.rpm
cargo deb --no-build --quiet -p vq-jobagent --target "$MUSL" --profile release-agent -o "$OUT/"
cargo deb --no-build --quiet -p vq-controller --target "$MUSL" --profile release -o "$OUT/"
cargo deb --no-build --quiet -p vq-cli --target "$MUSL" --profile release -o "$OUT/"
cargo generate-rpm -p jobagent --target "$MUSL" --profile release-agent -o "$OUT/"
cargo generate-rpm -p controller --target "$MUSL" --profile release -o "$OUT/"
cargo generate-rpm -p cli --target "$MUSL" --profile release -o "$OUT/"

say "controller OCI image (buildah, vfs storage, no daemon)"
scripts/package-image.sh

say "artefacts in target/packages/"
( cd "$OUT" && ls -l ./*.deb ./*.rpm && du -sh vq-controller-image )
