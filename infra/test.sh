#!/usr/bin/env bash
# THE test command: installs what the tests need (pinned) and runs every test and check.
#   infra/test.sh
# It starts a moto server (SQS) on 127.0.0.1 for the tests and stops it on exit; DynamoDB is
# embedded in the tests themselves. Nothing listens beyond loopback, nothing is left running.
set -euo pipefail
export SAM_CLI_TELEMETRY=0  # no phoning home from the SAM CLI
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
infra/tools.sh
mkdir -p target  # nothing may assume an earlier build made it

source infra/moto.sh
start_moto
export RELAY_TEST_SQS_ENDPOINT="$MOTO_ENDPOINT"

echo "==> cargo test: building every test target"
cargo test --workspace --all-targets --locked --no-run

# The simulations (tests/sim) wait for their simulated clock's quiet points more than they
# compute (the short chaos run used 60 % of one core for its 8 minutes), so they run beside the
# other tests, in three processes: the chaos run, the push-delivery runs, and the rest. Each
# one's output is printed when it ends; any failure fails the command.
logs=target/test-logs
rm -rf "$logs" && mkdir -p "$logs"
sim_rest=()
for f in tests/sim/tests/*.rs; do
  t="$(basename "$f" .rs)"
  case "$t" in chaos | delivery) ;; *) sim_rest+=(--test "$t") ;; esac
done
beside=()
run_beside() {  # name, command...: runs it in the background, its output to $logs/name.log
  local name="$1"
  shift
  (
    set +e
    "$@" >"$logs/$name.log" 2>&1
    echo $? >"$logs/$name.rc"
  ) &
  beside+=("$name")
}
run_beside sim-chaos cargo test -p relay-sim --locked --test chaos
run_beside sim-delivery cargo test -p relay-sim --locked --test delivery
run_beside sim-rest cargo test -p relay-sim --locked --lib --bins "${sim_rest[@]}"

echo "==> cargo test (unit, store on embedded DynamoDB, handlers, poller, dead letters on moto SQS, end to end)"
echo "    (the simulations run beside it: $logs/sim-*.log)"
status=0
cargo test --workspace --all-targets --locked --exclude relay-sim || status=$?
wait
for name in "${beside[@]}"; do
  echo "==> cargo test: $name"
  cat "$logs/$name.log"
  rc="$(cat "$logs/$name.rc" 2>/dev/null || echo 1)"
  if [ "$rc" != 0 ]; then
    echo "FAILED: $name (exit $rc)" >&2
    status=1
  fi
done
if [ "$status" != 0 ]; then
  echo "cargo test failed" >&2
  exit 1
fi

echo "==> store contract tests again, against moto's DynamoDB (the second engine)"
# Not the race of 50 concurrent writes: moto evaluates a condition and then writes, without a
# lock between the two, so two conditional writes can both win there (measured: 2 winners of 50).
# DynamoDB and the embedded engine make the check and the write one step; the race runs on the
# embedded engine above.
RELAY_TEST_DYNAMODB_ENDPOINT="$RELAY_TEST_SQS_ENDPOINT" cargo test -p relay-shared --lib --locked store:: -- \
  --skip store::tests::fifty_concurrent_deliveries_write_exactly_once

echo "==> end to end: the real Lambda binaries under cargo lambda watch, moto, resources from template.yaml"
infra/e2e.sh

echo "==> the performance bench's smoke version (every part runs on small numbers; timings not checked)"
infra/bench.sh --quick --out target/bench-smoke.md

echo "==> template lint (cfn-lint, the project's own template checks, sam validate --lint)"
.venv/bin/cfn-lint template.yaml
.venv/bin/python infra/check_template.py --self-test
.venv/bin/python infra/check_template.py
.venv/bin/sam validate --lint --region us-east-1

# Not here: `infra/sam-build.sh` (the arm64 release build of all four functions, as a deploy
# makes it) takes longer than every test together on 2 cores; it is its own documented command.
echo "==> all tests and checks passed"
