#!/usr/bin/env bash
# The performance bench: one command, one report, printed and written to target/bench-report.md.
#   infra/bench.sh                      every part, release builds (about 25 min on 2 cores)
#   infra/bench.sh --quick              the smoke version the test command runs: debug builds,
#                                       small numbers; checks that every part works, not timings
#   infra/bench.sh --parts callback,cost   some parts only (any relay-bench option passes through)
# Installs what it needs (pinned): moto in .venv, wrk and the comparison apps' .venv-bench
# (infra/tools.sh bench). Starts a moto server on loopback and stops it on exit.
set -euo pipefail
export SAM_CLI_TELEMETRY=0
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
profile=release
for a in "$@"; do [ "$a" = "--quick" ] && profile=debug; done
[ -x .venv/bin/moto_server ] || infra/tools.sh moto
infra/tools.sh bench
if [ "$profile" = release ]; then
  echo "==> building the bench and local mode (release)"
  cargo build --release --locked -p relay-bench -p relay-local
  # The functions (and the hello yardstick) on their own, as a deploy builds them: without the
  # bench's test features.
  echo "==> building the functions (release)"
  cargo build --release --locked -p relay-api -p relay-callback -p relay-poller -p relay-redrive -p relay-delivery \
    -p relay-submitter -p relay-bench-hello
else
  # The smoke version checks that every part works, not timings: the workspace's one debug build
  # (the test command's), which a build of a few packages alone would compile again.
  echo "==> building (debug, the workspace's build)"
  cargo build --locked --workspace --all-targets
fi
if [ "$profile" = release ] && command -v valgrind >/dev/null; then
  # The release build's twin with its symbols kept: part 1 counts instructions on it
  # (callgrind) and splits them into engine, SDK client and the relay's own work.
  echo "==> building the bench with symbols (profile profiling)"
  cargo build --profile profiling --locked -p relay-bench
fi
source infra/moto.sh
start_moto
echo "==> relay-bench $*"
"target/$profile/relay-bench" --bin-dir "target/$profile" --moto "$MOTO_ENDPOINT" "$@"
