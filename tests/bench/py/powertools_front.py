"""A thin HTTP front for ``powertools_handler.handler``: each request becomes the API Gateway v2
(HTTP API, payload 2.0) event API Gateway would deliver, with a Lambda-like context, and the
handler's answer becomes the HTTP response. Run under gunicorn:

    gunicorn -w N powertools_front:app

An exception from the handler (e.g. Powertools' IdempotencyAlreadyInProgressError) is a 500,
as API Gateway answers a failed invocation.
"""

import time
import uuid

from flask import Flask, Response, request

from powertools_handler import handler

app = Flask(__name__)


class LambdaContext:
    """The attributes of a Lambda context that Powertools reads."""

    function_name = "powertools-callback"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:powertools-callback"
    memory_limit_in_mb = 128
    log_group_name = "/aws/lambda/powertools-callback"
    log_stream_name = "local"

    def __init__(self, timeout_ms=30_000):
        self.aws_request_id = str(uuid.uuid4())
        self._deadline = time.monotonic() * 1000 + timeout_ms

    def get_remaining_time_in_millis(self):
        return max(0, int(self._deadline - time.monotonic() * 1000))


def to_event():
    now = time.time()
    query = {k: ",".join(request.args.getlist(k)) for k in request.args}
    body = request.get_data(as_text=True)
    event = {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": request.path,
        "rawQueryString": request.query_string.decode("latin-1"),
        "headers": {k.lower(): v for k, v in request.headers.items()},
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "local",
            "domainName": request.host,
            "domainPrefix": request.host.split(".")[0],
            "http": {
                "method": request.method,
                "path": request.path,
                "protocol": request.environ.get("SERVER_PROTOCOL", "HTTP/1.1"),
                "sourceIp": request.remote_addr or "127.0.0.1",
                "userAgent": request.headers.get("user-agent", ""),
            },
            "requestId": str(uuid.uuid4()),
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "isBase64Encoded": False,
    }
    if query:
        event["queryStringParameters"] = query
    if body:
        event["body"] = body
    return event


@app.route("/health")
def health():
    """Readiness probe of the front itself (no invocation)."""
    return "ok"


@app.route("/", defaults={"path": ""}, methods=["GET", "POST"])
@app.route("/<path:path>", methods=["GET", "POST"])
def invoke(path):
    try:
        result = handler(to_event(), LambdaContext())
    except Exception as e:  # a failed invocation: API Gateway answers 500
        app.logger.warning("invocation failed: %s: %s", type(e).__name__, e)
        return Response(f"{type(e).__name__}\n", status=500, content_type="text/plain")
    return Response(
        result.get("body", ""),
        status=result.get("statusCode", 200),
        headers=result.get("headers") or {},
    )
