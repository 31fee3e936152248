#!/usr/bin/env bash
# Installs what `make packages` and `make packages-check` need, pinned:
# cargo-deb and cargo-generate-rpm (cargo install --locked, a few minutes
# each on 2 cores, once), and Debian's buildah, umoci, skopeo (OCI images
# without a daemon), rpm (inspecting .rpm), debootstrap (the clean Debian
# root of the install test), ca-certificates (the image's CA bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO_DEB_VERSION=3.8.0
CARGO_GENERATE_RPM_VERSION=0.21.0

installed_version() { # crate -> version installed by cargo install, or empty
  cargo install --list 2>/dev/null | sed -n "s/^$1 v\([0-9.]*\):\$/\1/p"
}
if [ "$(installed_version cargo-deb)" != "$CARGO_DEB_VERSION" ]; then
  echo "== cargo install --locked cargo-deb $CARGO_DEB_VERSION"
  cargo install --locked --quiet cargo-deb --version "$CARGO_DEB_VERSION"
fi
if [ "$(installed_version cargo-generate-rpm)" != "$CARGO_GENERATE_RPM_VERSION" ]; then
  echo "== cargo install --locked cargo-generate-rpm $CARGO_GENERATE_RPM_VERSION"
  cargo install --locked --quiet cargo-generate-rpm --version "$CARGO_GENERATE_RPM_VERSION"
fi

missing=()
for tool in buildah:buildah umoci:umoci skopeo:skopeo rpm:rpm debootstrap:debootstrap \
            python3:python3 systemd-analyze:systemd; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
[ -f /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
python3 -c 'import yaml' 2>/dev/null || missing+=(python3-yaml)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# A python3 that is not Debian's (pyenv, a venv) does not see python3-yaml.
if ! python3 -c 'import yaml' 2>/dev/null; then
  echo "== python3 -m pip install pyyaml (for $(command -v python3))"
  python3 -m pip install --quiet pyyaml
fi
