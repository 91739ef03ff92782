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

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
echo "==> starting moto server (SQS, and DynamoDB for the contract tests) on 127.0.0.1:$port"
.venv/bin/moto_server -H 127.0.0.1 -p "$port" > target/moto.log 2>&1 &
moto_pid=$!
trap 'kill "$moto_pid" 2>/dev/null; wait "$moto_pid" 2>/dev/null || true' EXIT
python3 - "$port" <<'PY' || { echo "moto server did not start (see target/moto.log)" >&2; exit 1; }
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/moto-api/"
for _ in range(300):
    try:
        urllib.request.urlopen(url, timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)
PY
export RELAY_TEST_SQS_ENDPOINT="http://127.0.0.1:$port"

echo "==> cargo test (unit, store on embedded DynamoDB, handlers, poller, dead letters on moto SQS, end to end)"
cargo test --workspace --all-targets --locked

echo "==> store contract tests again, against moto's DynamoDB (the second engine)"
RELAY_TEST_DYNAMODB_ENDPOINT="$RELAY_TEST_SQS_ENDPOINT" cargo test -p relay-shared --lib --locked store::

echo "==> end to end: the real Lambda binaries under cargo lambda watch, moto, resources from template.yaml"
infra/e2e.sh

echo "==> template lint (cfn-lint, sam validate --lint)"
.venv/bin/cfn-lint template.yaml
.venv/bin/sam validate --lint --region us-east-1

echo "==> sam build (cargo-lambda, arm64, release)"
infra/sam-build.sh
echo "==> all tests and checks passed"
