#!/usr/bin/env bash
# Creates .venv and installs duplexcache (editable) with its test dependencies, saying what it does.
# torch is pinned first: the pin resolves to the CPU build on this machine's disk; an unpinned
# torch would pull a multi-GB CUDA build. A stamp in .venv remembers the hash of pyproject.toml and
# of this script: when neither changed, nothing is reinstalled (the install is editable, so source
# edits need none). Set DUPLEXCACHE_SETUP_FORCE=1 to reinstall anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.duplexcache-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && [ "${DUPLEXCACHE_SETUP_FORCE:-0}" != 1 ]; then
  echo "[setup] .venv is up to date (pyproject.toml and scripts/setup.sh unchanged); nothing to install"
  exit 0
fi

started=$SECONDS
step() { echo "[setup $1/4 +$((SECONDS - started))s] $2"; }
pip_install() {  # pip's own lines minus the hundreds of "already satisfied" and "Location ignored" ones; fails when pip does
  local rc=0
  python -m pip install --progress-bar off "$@" 2>&1 | { grep -v -e '^Requirement already satisfied' -e "^WARNING: Location '.*' is ignored" || true; } || rc=$?
  return "$rc"
}

rm -f "$stamp"
if [ ! -x .venv/bin/python ]; then
  step 1 "creating .venv (python3 -m venv)"
  python3 -m venv .venv
else
  step 1 "reusing .venv (pyproject.toml or scripts/setup.sh changed since the last install)"
fi
. .venv/bin/activate
step 2 "upgrading pip"
pip_install --upgrade pip
step 3 "installing torch==2.13.0 (CPU build; the first run unpacks about 1 GB)"
pip_install torch==2.13.0
step 4 "installing duplexcache (editable) with its test extras: transformers, minicpmo-utils, fastapi, ..."
pip_install -e ".[test]"
echo "$want" >"$stamp"
echo "[setup] done in $((SECONDS - started)) s; later runs skip this until pyproject.toml or scripts/setup.sh changes"
