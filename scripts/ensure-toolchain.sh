#!/usr/bin/env bash
# Installs what building and testing vq needs besides cargo itself: the musl
# target and musl-tools (ring's C code for the static jobagent), and `file`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl; then
  echo "== rustup target add x86_64-unknown-linux-musl"
  rustup target add x86_64-unknown-linux-musl
fi
missing=()
command -v musl-gcc >/dev/null 2>&1 || missing+=(musl-tools)
command -v file >/dev/null 2>&1 || missing+=(file)
command -v useradd >/dev/null 2>&1 || missing+=(passwd)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v python3 >/dev/null 2>&1 || missing+=(python3)   # demo.sh reads JSON with it
command -v openssl >/dev/null 2>&1 || missing+=(openssl)   # the TLS fault test makes its certificates
command -v pgrep >/dev/null 2>&1 || missing+=(procps)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
