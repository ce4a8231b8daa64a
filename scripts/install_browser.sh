#!/usr/bin/env bash
# Installs, from Debian's packages, what the browser and VAD tests need:
#   chromium   the headless browser Playwright drives through executable_path (Playwright's own
#              browser download cannot work without the internet)
#   espeak-ng  real speech for the VAD tests and the browser's fake microphone
# Does nothing when both are there (no apt-get update, so no minutes added). Under CI=true a
# failed install fails the run; elsewhere it warns and the tests that need them skip with a reason.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)
[ ${#need[@]} -eq 0 ] && exit 0

fail() {
  echo "install_browser.sh: $1; the browser/VAD tests will skip" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  exit 0
}
[ "$(id -u)" = 0 ] || fail "installing ${need[*]} needs root"
command -v apt-get >/dev/null 2>&1 || fail "no apt-get to install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
echo "install_browser.sh: installing ${need[*]}" >&2
apt-get update -qq || fail "apt-get update failed"
# No recommends: headless tests need no desktop integration, fonts beyond the default or docs.
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || fail "apt-get install ${need[*]} failed"
