#!/usr/bin/env bash
# Installs Debian's chromium when absent: tests/tests/status_page_browser.rs
# loads the controller's status page in headless Chromium (DOM dump and
# screenshots). VQ_TEST_CHROMIUM names another browser binary instead.
set -euo pipefail
if command -v "${VQ_TEST_CHROMIUM:-chromium}" >/dev/null 2>&1; then
  exit 0
fi
echo "== apt-get install chromium"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
