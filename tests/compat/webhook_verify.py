#!/usr/bin/env python3
"""An independent verifier of the relay's outgoing webhooks: the Standard Webhooks reference
library (standardwebhooks, pinned in infra/requirements-sdk.txt), unmodified.

Reads JSON lines on stdin, each {"secret": "whsec_...", "headers": {...}, "body": "<string>"},
and prints one line per input: `ok` when the library accepts the signature, else
`fail: <reason>`. The body is verified as its UTF-8 bytes and not parsed as JSON, so any body
can be checked. The library checks the timestamp against this machine's clock (5 minutes);
a message may carry `"now": <unix seconds>` to be checked at that time instead (the
simulations run on a simulated clock): the library's own clock is set, nothing else changes.
Used by the webhook tests in shared/src/webhook/signing/tests.rs.
"""

import json
import sys
from datetime import datetime as _real_datetime, timezone

import standardwebhooks.webhooks as _lib
from standardwebhooks.webhooks import Webhook


def _clock_at(now: float):
    class _At(_real_datetime):
        @classmethod
        def now(cls, tz=None):
            return _real_datetime.fromtimestamp(now, tz=tz or timezone.utc)

    return _At


def check(line: str) -> str:
    try:
        msg = json.loads(line)
        _lib.datetime = _clock_at(float(msg["now"])) if "now" in msg else _real_datetime
        Webhook(msg["secret"]).verify(msg["body"], msg["headers"], json_parse=False)
    except Exception as e:  # every failure is an answer, not a crash
        return f"fail: {type(e).__name__}: {e}"
    return "ok"


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            print(check(line), flush=True)


if __name__ == "__main__":
    main()
