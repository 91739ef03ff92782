#!/usr/bin/env bash
# `sam build` as a deploy would run it: cargo-lambda (pinned in .venv, with zig) cross-compiles
# every function for arm64 in release mode. Output in .aws-sam/build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
infra/tools.sh   # the SAM CLI, cargo-lambda and zig, pinned in .venv
export PATH="$root/.venv/bin:$PATH" SAM_CLI_TELEMETRY=0
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu
# In source and uncached: copying or hashing target/ would cost more than the build.
sam build --build-in-source --no-cached
for f in ApiFunction CallbackFunction PollerFunction RedriveFunction DeliveryFunction SubmitterFunction; do
  # ELF e_machine 183 = AArch64.
  python3 -c 'import sys; b=open(sys.argv[1],"rb").read(20); sys.exit(0 if b[:4]==b"\x7fELF" and int.from_bytes(b[18:20],"little")==183 else 1)' \
    ".aws-sam/build/$f/bootstrap" || { echo "$f: no arm64 bootstrap" >&2; exit 1; }
done
echo "sam build: 6 arm64 bootstraps"
