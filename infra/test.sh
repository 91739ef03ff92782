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

echo "==> cargo test (unit, store on embedded DynamoDB, handlers, poller, dead letters on moto SQS, end to end)"
cargo test --workspace --all-targets --locked

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
