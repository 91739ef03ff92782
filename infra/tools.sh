#!/usr/bin/env bash
# Installs the tools the tests need into the repo (pinned, idempotent): a Python venv at .venv
# with infra/requirements-dev.txt. Rust crates come from Cargo.lock.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
req="$root/infra/requirements-dev.txt"
stamp="$venv/.installed-$(sha256sum "$req" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "==> installing pinned Python tools into .venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
  touch "$stamp"
fi
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }
