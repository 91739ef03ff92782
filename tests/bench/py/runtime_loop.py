"""A minimal custom runtime for the bench's cold-start part: what Lambda's Python runtime does
around a handler, reduced to the Runtime API loop (urllib only). It imports the handler module
(its init: boto3 client, Powertools persistence layer), then answers events one by one.

    AWS_LAMBDA_RUNTIME_API=127.0.0.1:9001 python runtime_loop.py [module.function]
"""

import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
target = sys.argv[1] if len(sys.argv) > 1 else "powertools_handler.handler"
module_name, function_name = target.rsplit(".", 1)
handler = getattr(__import__(module_name), function_name)

api = "http://" + os.environ["AWS_LAMBDA_RUNTIME_API"] + "/2018-06-01/runtime"


class Context:
    """The attributes of Lambda's context object that handlers and Powertools read."""

    def __init__(self, headers):
        self.aws_request_id = headers.get("Lambda-Runtime-Aws-Request-Id", "")
        self.invoked_function_arn = headers.get("Lambda-Runtime-Invoked-Function-Arn", "")
        self.function_name = os.environ.get("AWS_LAMBDA_FUNCTION_NAME", "bench")
        self.function_version = "$LATEST"
        self.memory_limit_in_mb = int(os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256"))
        self.log_group_name = "/aws/lambda/" + self.function_name
        self.log_stream_name = "bench"
        self._deadline_ms = int(headers.get("Lambda-Runtime-Deadline-Ms", "0"))

    def get_remaining_time_in_millis(self):
        return max(0, self._deadline_ms - int(time.time() * 1000))


while True:
    with urllib.request.urlopen(api + "/invocation/next") as resp:
        event = json.loads(resp.read())
        context = Context(resp.headers)
    try:
        body = json.dumps(handler(event, context)).encode()
        path = "/invocation/" + context.aws_request_id + "/response"
    except Exception as e:  # reported to the Runtime API, as Lambda's runtime does
        body = json.dumps({"errorMessage": str(e), "errorType": type(e).__name__}).encode()
        path = "/invocation/" + context.aws_request_id + "/error"
    urllib.request.urlopen(urllib.request.Request(api + path, data=body, method="POST")).read()
