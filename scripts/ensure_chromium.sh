#!/usr/bin/env bash
# Makes sure the browser test's headless Chromium is here (Debian's chromium and chromium-driver):
# installs them where missing when run as root (CI, a container); otherwise says in one line how.
# Called by `make test` and `.ci/run`.
set -euo pipefail
if command -v chromedriver >/dev/null 2>&1 &&
  { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "The browser test needs chromium and chromedriver: sudo apt-get install chromium chromium-driver" \
    "(Debian/Ubuntu), or run scripts/ensure_chromium.sh as root." >&2
  exit 1
fi
echo "Installing Chromium for the browser test (Debian's chromium and chromium-driver)..."
# The package lists may be missing or stale on a fresh machine: refresh them once if needed.
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver \
  >/dev/null 2>&1 || {
  apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
}
