"""The callback as a Python Lambda would do it today: AWS Lambda Powertools' idempotency
utility (DynamoDB persistence layer) around a handler that records the result with one
conditional ``update_item`` on a tasks table, over boto3.

``handler(event, context)`` takes an API Gateway v2 (HTTP API) event for
``GET /callback?id=<captcha id>&code=<token>``. The idempotency key is the captcha id (as in the
tutorial's Muster 3: one result per task id); a repeated delivery is answered from the stored
idempotency record without running the handler body again.

Configuration (environment):
    IDEMPOTENCY_TABLE   the Powertools table, partition key ``id`` (S)       [idempotency]
    TASKS_TABLE         the tasks table, partition key ``task_id`` (S)       [tasks]
    AWS_ENDPOINT_URL_DYNAMODB, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, ...   as boto3 reads them
"""

import os
import time

import boto3
from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent,
)
from botocore.exceptions import ClientError

TASKS_TABLE = os.environ.get("TASKS_TABLE", "tasks")
IDEMPOTENCY_TABLE = os.environ.get("IDEMPOTENCY_TABLE", "idempotency")

# Built once per process (a Lambda's cold start), reused by every invocation.
dynamodb = boto3.client("dynamodb")
persistence_layer = DynamoDBPersistenceLayer(table_name=IDEMPOTENCY_TABLE, boto3_client=dynamodb)
config = IdempotencyConfig(event_key_jmespath="queryStringParameters.id")


def _response(status, body):
    return {"statusCode": status, "headers": {"content-type": "text/plain"}, "body": body}


@idempotent(config=config, persistence_store=persistence_layer)
def handler(event, context):
    params = event.get("queryStringParameters") or {}
    task_id = params.get("id")
    solution = params.get("code")
    if not task_id or not solution:
        return _response(400, "missing id or code")
    try:
        # One conditional write: the first result for a task wins, a later one changes nothing.
        dynamodb.update_item(
            TableName=TASKS_TABLE,
            Key={"task_id": {"S": task_id}},
            UpdateExpression="SET #st = :solved, solution = :code, solved_at = :now",
            ConditionExpression="attribute_not_exists(solution)",
            ExpressionAttributeNames={"#st": "status"},
            ExpressionAttributeValues={
                ":solved": {"S": "solved"},
                ":code": {"S": solution},
                ":now": {"N": str(int(time.time() * 1000))},
            },
        )
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
            raise
    return _response(200, "OK")
