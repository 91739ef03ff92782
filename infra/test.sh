#!/usr/bin/env bash
# THE test command: installs what the tests need (pinned) and runs every test and check.
#   infra/test.sh
# Everything it starts listens on 127.0.0.1 only; nothing is left running.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
infra/tools.sh

echo "==> cargo test (unit, store against embedded DynamoDB, handlers, end to end over HTTP)"
cargo test --workspace --all-targets --locked

echo "==> template lint"
.venv/bin/cfn-lint template.yaml
echo "==> all tests and checks passed"
