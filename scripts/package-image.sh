#!/usr/bin/env bash
# Builds the vq-controller container image from packaging/container/Containerfile
# with buildah (vfs storage in a scratch directory, no daemon, no RUN steps)
# and writes it as an OCI image layout to target/packages/vq-controller-image/
# (tag = the package version). Needs the static musl binaries built by
# scripts/package-build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/target/packages
BIN=$(realpath -m "${CARGO_TARGET_DIR:-target}")/x86_64-unknown-linux-musl/release
VERSION=$(cargo metadata --no-deps --format-version 1 --locked \
  | python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="vq-controller"))')
CTX=$OUT/.image-context
STORE=$OUT/.buildah
IMAGE=$OUT/vq-controller-image
UID_VQ=65532

rm -rf "$CTX" "$STORE" "$IMAGE"
R=$CTX/rootfs
install -d -m 755 "$R/usr/bin" "$R/etc/ssl/certs" "$R/etc/vq" "$R/etc/openstack"
install -m 755 "$BIN/vq-controller" "$BIN/vq" "$R/usr/bin/"
install -m 644 /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/"
install -m 644 packaging/container/controller.toml "$R/etc/vq/controller.toml"
install -d -m 755 "$R/usr/share/vq/grafana" "$R/usr/share/vq/prometheus"
install -m 644 packaging/grafana/vq.json "$R/usr/share/vq/grafana/vq.json"
install -m 644 packaging/prometheus/vq-rules.yaml "$R/usr/share/vq/prometheus/vq-rules.yaml"
printf 'root:x:0:0:root:/root:/sbin/nologin\nvq:x:%s:%s:vq controller:/nonexistent:/sbin/nologin\n' \
  "$UID_VQ" "$UID_VQ" > "$R/etc/passwd"
printf 'root:x:0:\nvq:x:%s:\n' "$UID_VQ" > "$R/etc/group"
chmod 644 "$R/etc/passwd" "$R/etc/group"
cp packaging/container/Containerfile "$CTX/Containerfile"

B=(buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs)
cleanup() { "${B[@]}" rm --all >/dev/null 2>&1 || true; rm -rf "$STORE" "$CTX"; }
trap cleanup EXIT
"${B[@]}" bud --quiet --format oci --layers=false --timestamp "${SOURCE_DATE_EPOCH:-0}" \
  -f "$CTX/Containerfile" -t "localhost/vq-controller:$VERSION" "$CTX" >/dev/null
"${B[@]}" push --quiet "localhost/vq-controller:$VERSION" "oci:$IMAGE:$VERSION"
echo "image: $IMAGE (tag $VERSION)"
