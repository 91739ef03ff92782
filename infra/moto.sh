# Sourced by infra/test.sh and infra/bench.sh: `start_moto` starts a moto server (DynamoDB, SQS,
# SSM) on a free port of 127.0.0.1, waits until it answers, stops it when the shell exits, and
# sets MOTO_ENDPOINT. Its log goes to target/moto.log. Needs .venv (infra/tools.sh moto).
start_moto() {
  mkdir -p target
  local port
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
  echo "==> starting moto server on 127.0.0.1:$port"
  .venv/bin/moto_server -H 127.0.0.1 -p "$port" > target/moto.log 2>&1 &
  moto_pid=$!
  trap 'kill "$moto_pid" 2>/dev/null; wait "$moto_pid" 2>/dev/null || true' EXIT
  python3 - "$port" <<'PY' || { echo "moto server did not start (see target/moto.log)" >&2; return 1; }
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
  MOTO_ENDPOINT="http://127.0.0.1:$port"
}
