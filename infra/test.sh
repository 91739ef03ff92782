#!/usr/bin/env bash
# THE test command: installs what the tests need (pinned) and runs every test and check.
#   infra/test.sh
# It starts a moto server (SQS, and DynamoDB for the second engine) on 127.0.0.1 for the tests and
# stops it on exit; the embedded DynamoDB engine runs inside the tests. Nothing listens beyond
# loopback, nothing is left running. Every test binary runs side by side under cargo-nextest
# (.config/nextest.toml: the simulations one at a time), or one after another under `cargo test`
# where cargo-nextest is not installed.
set -euo pipefail
export SAM_CLI_TELEMETRY=0  # no phoning home from the SAM CLI
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mkdir -p target  # nothing may assume an earlier build made it
started=$SECONDS
step() { echo "==> [$((SECONDS - started)) s] $*"; }

# The pinned Python and JavaScript tools install while the workspace compiles (one waits for the
# network, the other for the cores).
step "the house's shape: no product source file over 600 lines, no module cycle (infra/check_layout.py)"
python3 infra/check_layout.py --self-test
python3 infra/check_layout.py

step "installing the pinned tools (infra/tools.sh) while the workspace builds"
infra/tools.sh > target/tools.log 2>&1 &
tools_pid=$!
if cargo nextest --version >/dev/null 2>&1; then
  runner=(cargo nextest run --locked)
  cargo nextest run --workspace --all-targets --locked --no-run
else
  echo "note: cargo-nextest is not installed: the test binaries run one after another (cargo test)" >&2
  runner=(cargo test --locked)
  cargo test --workspace --all-targets --locked --no-run
fi
wait "$tools_pid" || { cat target/tools.log >&2; echo "infra/tools.sh failed" >&2; exit 1; }

source infra/moto.sh
start_moto
export RELAY_TEST_SQS_ENDPOINT="$MOTO_ENDPOINT"

step "the tests: unit, store on the embedded DynamoDB, handlers, poller, dead letters on moto's SQS, simulations, local mode, the SDKs and the tutorial's apps"
"${runner[@]}" --workspace --all-targets

step "store contract tests again, against moto's DynamoDB (the second engine), and the API's retention test"
# Not the race of 50 concurrent writes: moto evaluates a condition and then writes, without a
# lock between the two, so two conditional writes can both win there (measured: 2 winners of 50).
# DynamoDB and the embedded engine make the check and the write one step; the race runs on the
# embedded engine above. The retention test: moto keeps an item past its TTL, as DynamoDB does
# until its background deletion; the API must refuse it all the same.
export RELAY_TEST_DYNAMODB_ENDPOINT="$RELAY_TEST_SQS_ENDPOINT"
# The whole workspace, filtered: `-p` alone would resolve features anew and compile the SDK again.
if [ "${runner[1]}" = nextest ]; then
  "${runner[@]}" --workspace --all-targets -E \
    '(package(relay-shared) & kind(lib) & test(/^store::/) - test(=store::tests::fifty_concurrent_deliveries_write_exactly_once)) | (package(relay-api) & kind(lib) & test(/retention/))'
else
  "${runner[@]}" -p relay-shared --lib store:: -- --skip store::tests::fifty_concurrent_deliveries_write_exactly_once
  "${runner[@]}" -p relay-api --lib retention
fi
unset RELAY_TEST_DYNAMODB_ENDPOINT

step "end to end: the Lambda binaries under cargo lambda watch, moto, resources from template.yaml"
infra/e2e.sh

step "the performance bench's smoke version (every part runs on small numbers; timings not checked)"
infra/bench.sh --quick --out target/bench-smoke.md

step "template lint (cfn-lint, the project's own template checks, sam validate --lint)"
.venv/bin/cfn-lint template.yaml
.venv/bin/python infra/check_template.py --self-test
.venv/bin/python infra/check_template.py
.venv/bin/sam validate --lint --region us-east-1

# Not here: `infra/sam-build.sh` (the arm64 release build of every function, as a deploy
# makes it) takes longer than every test together on 2 cores; it is its own documented command.
step "all tests and checks passed"
