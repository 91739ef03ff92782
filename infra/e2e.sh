#!/usr/bin/env bash
# End to end with the real Lambda binaries under `cargo lambda watch` (no Docker), moto for
# DynamoDB and SQS, resources from template.yaml. Called by infra/test.sh (which starts moto);
# runnable alone (it then starts its own moto). Arguments go to relay-e2e:
#   infra/e2e.sh                               200 tasks, the test command's run
#   infra/e2e.sh --tasks 1000 --chaos --ban    the documented chaos run on this stack
#   --threads N                                the fake CaptchaAI's thread plan (default 18,
#                                              0 = unlimited): a burst above it is queued
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
infra/tools.sh   # cargo-lambda (and zig) pinned in .venv
export PATH="$root/.venv/bin:$PATH"   # cargo-lambda and zig, pinned in infra/requirements-dev.txt
mkdir -p target
.venv/bin/python - <<'PY'
import json
from cfnlint.decode import cfn_yaml
json.dump(cfn_yaml.load("template.yaml"), open("target/template.json", "w"), default=str)
PY
export RELAY_TEMPLATE_JSON="$root/target/template.json"
# The workspace's one build (the test command's: every target, features unified the same), so
# after `cargo nextest run --workspace --all-targets` this compiles only the binaries no test
# runs; a build of a few packages alone would compile their dependencies again.
cargo build --locked --workspace --all-targets
target/debug/relay-e2e "$@"
