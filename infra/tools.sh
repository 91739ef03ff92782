#!/usr/bin/env bash
# Installs the tools the tests need into the repo (pinned, idempotent, safe to run from several
# processes at once): a Python venv at .venv with infra/requirements-dev.txt, or with only moto
# (`infra/tools.sh moto`, what plain `cargo test` needs). Rust crates come from Cargo.lock.
# `infra/tools.sh bench`: what the performance bench needs on top — the `wrk` load generator
# and valgrind (apt-get, as root on Debian) and a venv at .venv-bench with the comparison apps' packages
# (tests/bench/py/requirements.txt).
# `infra/tools.sh sdk`: the official 2captcha clients the compatibility tests drive, unmodified —
# 2captcha-python into .venv (infra/requirements-sdk.txt) and, where node is on the machine,
# @2captcha/captcha-solver into tests/compat/node_modules (npm ci, tests/compat/package-lock.json).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
# What the stamp is a hash of: a change to any of them reinstalls.
stamped=("$root/infra/requirements-moto.txt")
case "${1:-all}" in
  all) req="$root/infra/requirements-dev.txt" ;;
  moto) req="$root/infra/requirements-moto.txt" ;;
  sdk) req="$root/infra/requirements-sdk.txt"; stamped=() ;;
  bench)
    if ! command -v wrk >/dev/null; then
      if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "wrk is not installed: install it (Debian/Ubuntu: apt-get install wrk) and run this again" >&2
        exit 1
      fi
      echo "==> installing wrk (apt-get)" >&2
      apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
      command -v wrk >/dev/null || { echo "apt-get did not install wrk" >&2; exit 1; }
    fi
    # valgrind (callgrind) for part 1's instruction counts: the full bench only, so not having
    # it is a note in the report, not a failure.
    if ! command -v valgrind >/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "==> installing valgrind (apt-get)" >&2
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null ||
          echo "valgrind could not be installed: the bench's instruction counts will be missing" >&2
      else
        echo "valgrind is not installed (apt-get install valgrind): the bench's instruction counts will be missing" >&2
      fi
    fi
    venv="$root/.venv-bench"
    req="$root/tests/bench/py/requirements.txt"
    stamped=()
    ;;
  *) echo "usage: infra/tools.sh [all|moto|sdk|bench]" >&2; exit 2 ;;
esac
command -v python3 >/dev/null || { echo "python3 (3.9 or later) is required" >&2; exit 1; }
stamp="$venv/.installed-$(cat "$req" ${stamped[@]+"${stamped[@]}"} | sha256sum | cut -c1-16)-$(basename "$req" .txt)"
if [ ! -f "$stamp" ]; then
  mkdir -p "$venv"
  # One installer at a time: test processes may all ask for moto at once.
  exec 9>"$venv/.lock"
  flock 9
  if [ ! -f "$stamp" ]; then
    echo "==> installing pinned Python tools ($(basename "$req")) into $(basename "$venv")" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
    touch "$stamp"
  fi
fi
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }
if [ "${1:-all}" = sdk ] || [ "${1:-all}" = all ]; then
  compat="$root/tests/compat"
  if command -v npm >/dev/null; then
    nstamp="$compat/node_modules/.installed-$(sha256sum "$compat/package-lock.json" | cut -c1-16)"
    if [ ! -f "$nstamp" ]; then
      mkdir -p "$compat/node_modules"
      exec 8>"$compat/node_modules/.lock"
      flock 8
      if [ ! -f "$nstamp" ]; then
        echo "==> installing the pinned JavaScript 2captcha client (npm ci) into tests/compat" >&2
        (cd "$compat" && npm ci --silent --no-audit --no-fund >&2)
        mkdir -p "$compat/node_modules" && touch "$nstamp"
      fi
    fi
  fi
fi
