#!/usr/bin/env python3
"""Checks over template.yaml that a linter does not make: things that deploy but do not work.

    .venv/bin/python infra/check_template.py            # check template.yaml (exit 1 on a finding)
    .venv/bin/python infra/check_template.py --self-test # prove each check fails on a broken copy

Checks:
  alarm-topic     every alarm action's SNS topic can be published to by CloudWatch: unencrypted,
                  or encrypted with a KMS key of this template whose policy lets
                  cloudwatch.amazonaws.com Decrypt and GenerateDataKey* (never alias/aws/sns).
  sqs-visibility  a queue feeding a function has VisibilityTimeout >= 6 x the function's timeout;
                  a function pacing its own retries names that queue, its visibility and maxReceiveCount
                  + the event source's MaximumBatchingWindowInSeconds (AWS's guidance).
  reserved        every function's reserved concurrency is a parameter that can be off (!If with
                  AWS::NoValue): never reserved unconditionally (new accounts cannot), never a
                  ceiling fixed in the template.
  secrets         every function reading a secret parameter (`*_PARAM`) may ssm:GetParameter it;
                  one that may name /aws/reference/secretsmanager/... comes with a
                  secretsmanager:GetSecretValue grant naming it, conditional on a condition that
                  tests that parameter for the prefix, in every function reading it (the
                  function's SAM `Policies` or, with `Role:`, that role's inline policies).
  knobs           every environment variable and template parameter the README and docs/ name exists:
                  variables are read somewhere in the Rust code, parameters are in the template.
  compat-routes   the 2captcha-compatible /in.php and /res.php exist on the function serving
                  /tasks, for GET and POST (Method ANY), with `Authorizer: NONE` (SDKs cannot
                  sign; the function checks the relay key); every /tasks route keeps AWS_IAM;
                  each compat route has its own throttling (stage RouteSettings, rate and burst,
                  keyed exactly by its route key); no RouteSettings key names a route that does
                  not exist (the stage would fail to deploy); the function may GetItem on the
                  table (relay keys are checked by one GetItem).
  delivery        push delivery (issue 15): the task table streams NEW_IMAGE and has the sparse
                  index due-for-delivery (dlv_shard/dlv_due, KEYS_ONLY; parked pushes
                  sit in it too); the delivery function - every function reading the stream but
                  the submitter (binary relay-submitter: `submit-queue` checks it) - reads it with an
                  OnFailure destination (an SQS queue of this template) and a FilterCriteria whose
                  every pattern requires dynamodb.NewImage dlv_shard and dlv_due to exist as N
                  (`exists` without the type never matches); it also has a schedule (the sweep);
                  it has its own role (SAM's would get the managed AWSLambdaDynamoDBExecutionRole:
                  every stream, every log group) with no managed policies, granting only
                  DELIVERY_ACTIONS, `*` only for ListStreams, SendMessage only to its OnFailure
                  queue or its retry queue; the stream's batching window is 0 (a result is pushed at
                  once); the retry queue (issue 23): DELIVERY_RETRY_QUEUE_URL names an SQS queue of
                  this template that feeds the same function with a batching window of 0, and
                  the role may receive/delete only on it; the delivery alarms exist (the
                  token-died alarm among them), watch their metric (`service` = delivery for the
                  relay's own) and notify an SNS topic of this template.
  submit-queue    the submit queue (issue 24): the task table has the sparse index submit-queue
                  (sq_key S, sq_at N, KEYS_ONLY); the submitter (the function built from
                  relay-submitter) reads the table's stream with a batching window of 0 and a
                  FilterCriteria whose every pattern is exactly the wake item's key (WAKE_PATTERN:
                  anything wider starts it on every write of the table), and has a schedule (the
                  backstop); the function serving /tasks and the submitter set each of QUEUE_VARS to
                  the same value (one queue, one CaptchaAI account), and the submitter sets the
                  API's CALLBACK_GRACE_SECS (it schedules the first poll of what it sends); the
                  submitter has its own role with no managed policies, granting only
                  SUBMITTER_GRANTS, each on its own resource (Get/UpdateItem on the table itself,
                  Query/Scan on submit-queue only, stream reads on the table's stream, `*` only for
                  ListStreams, SendMessage only to its DEAD_LETTER_QUEUE_URL queue, logs only to its
                  log group), and every one of those it needs (the secrets' grants: `secrets`); the
                  API may Query submit-queue (a queued task's position); SubmitQueueAgeAlarm
                  (threshold QueueAgeAlarmSeconds) and SubmitterErrorsAlarm exist, watch their
                  metrics (`service` = submitter for the relay's own, the submitter's Lambda Errors)
                  and notify an SNS topic of this template.
  capacity        every ceiling is a parameter (issue 25, docs/capacity.md): every throttle
                  (DefaultRouteSettings and RouteSettings of every HTTP API) is a Ref to a Number
                  parameter, never a literal; the pingback routes (/callback/...) have their own
                  throttle (reserved concurrency: `reserved`); every DynamoDB stream event of the delivery function sets
                  ParallelizationFactor from a parameter; POLL_SHARDS and POLL_SHARDS_PREVIOUS
                  reach every function (Globals). With the parameters' defaults, overridden by
                  samconfig.toml's parameter_overrides and any `--param Name=Value` given, the
                  ceilings hold ExpectedTasksPerSecond: the pingback throttle >= it, PollShards
                  keeps each index key at <= half of DynamoDB's 1,000 writes/s
                  (INDEX_WRITES_PER_TASK per task), burst limits <= the account's 5,000, the
                  steady throttles together <= the account's 10,000 req/s.
"""
import copy
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(path):
    from cfnlint.decode import cfn_yaml

    return json.loads(json.dumps(cfn_yaml.load(str(path)), default=str))


def branches(v):
    """The values an expression may take: both arms of an Fn::If, else itself."""
    if isinstance(v, dict) and "Fn::If" in v:
        _, a, b = v["Fn::If"]
        return branches(a) + branches(b)
    return [v]


def is_no_value(v):
    return isinstance(v, dict) and v.get("Ref") == "AWS::NoValue"


def listify(v):
    return v if isinstance(v, list) else [v]


def ref_target(v):
    if isinstance(v, dict):
        if "Ref" in v:
            return v["Ref"]
        if "Fn::GetAtt" in v:
            ga = v["Fn::GetAtt"]
            return ga[0] if isinstance(ga, list) else ga.split(".")[0]
    return None


def role_of(t, fn_resource):
    """The template role a function names with `Role:` (a Ref or GetAtt), else None."""
    role = fn_resource.get("Properties", {}).get("Role")
    target = ref_target(role) if role is not None else None
    return target if t["Resources"].get(target, {}).get("Type") == "AWS::IAM::Role" else None


def function_statements(t, fn_resource):
    """(statement, condition or None) for every statement a function's permissions are built from:
    its own SAM `Policies` (inline statements) or, with `Role:`, that role's inline policies. Both
    arms of an Fn::If are returned, an arm that is AWS::NoValue is dropped."""
    role = role_of(t, fn_resource)
    if role:
        docs = [p.get("PolicyDocument", {}) for p in listify(t["Resources"][role].get("Properties", {}).get("Policies", []))]
    else:
        docs = [p for p in listify(fn_resource.get("Properties", {}).get("Policies", [])) if isinstance(p, dict)]
    out = []
    for doc in docs:
        for st in listify(doc.get("Statement", [])):
            if isinstance(st, dict) and "Fn::If" in st:
                cond, a, b = st["Fn::If"]
                out += [(x, cond) for x in branches(a) + branches(b) if isinstance(x, dict) and not is_no_value(x)]
            elif isinstance(st, dict):
                out.append((st, None))
    return out


def key_lets_cloudwatch_publish(key):
    need = {"kms:decrypt", "kms:generatedatakey*"}
    for st in listify(key.get("Properties", {}).get("KeyPolicy", {}).get("Statement", [])):
        if st.get("Effect") != "Allow":
            continue
        services = listify(st.get("Principal", {}).get("Service", []))
        if "cloudwatch.amazonaws.com" not in services:
            continue
        actions = {a.lower() for a in listify(st.get("Action", []))}
        if "kms:*" in actions or need <= actions:
            return True
    return False


def check_alarm_topics(t):
    res = t["Resources"]
    out = []
    for name, r in res.items():
        if r.get("Type") != "AWS::CloudWatch::Alarm":
            continue
        p = r.get("Properties", {})
        for field in ("AlarmActions", "OKActions", "InsufficientDataActions"):
            for action in listify(p.get(field, [])):
                topic = ref_target(action)
                if topic is None or res.get(topic, {}).get("Type") != "AWS::SNS::Topic":
                    continue
                for key in branches(res[topic].get("Properties", {}).get("KmsMasterKeyId")):
                    if key is None or is_no_value(key):
                        continue
                    target = ref_target(key)
                    if target and res.get(target, {}).get("Type") == "AWS::KMS::Key":
                        if not key_lets_cloudwatch_publish(res[target]):
                            out.append(f"{name} -> {topic}: key {target}'s policy does not let cloudwatch.amazonaws.com use it")
                    else:
                        out.append(f"{name} -> {topic}: encrypted with {json.dumps(key)}, which CloudWatch cannot use to publish")
    return out


def function_timeout(t, fn):
    g = t.get("Globals", {}).get("Function", {}).get("Timeout", 3)
    return fn.get("Properties", {}).get("Timeout", g)


def check_sqs_visibility(t):
    res = t["Resources"]
    out = []
    for name, r in res.items():
        if r.get("Type") != "AWS::Serverless::Function":
            continue
        for ev_name, ev in r.get("Properties", {}).get("Events", {}).items():
            if ev.get("Type") != "SQS":
                continue
            q = ref_target(ev["Properties"]["Queue"])
            vis = res[q]["Properties"].get("VisibilityTimeout", 30)
            window = ev["Properties"].get("MaximumBatchingWindowInSeconds", 0)
            need = 6 * int(function_timeout(t, r)) + int(window)
            if int(vis) < need:
                out.append(f"{q}: VisibilityTimeout {vis} < 6 x {name} timeout + batching window = {need}")
            # A function that paces its own retries (the redrive function) must know the queue
            # it drains, its visibility and its maxReceiveCount as deployed.
            env = r.get("Properties", {}).get("Environment", {}).get("Variables", {})
            if "DEAD_LETTER_QUEUE_URL" in env:
                if ref_target(env["DEAD_LETTER_QUEUE_URL"]) != q:
                    out.append(f"{name}: DEAD_LETTER_QUEUE_URL is not {q}, the queue it drains")
                if str(env.get("DEAD_LETTER_VISIBILITY_SECONDS")) != str(vis):
                    out.append(f"{name}: DEAD_LETTER_VISIBILITY_SECONDS {env.get('DEAD_LETTER_VISIBILITY_SECONDS')} is not {q}'s VisibilityTimeout {vis}")
                policy = res[q]["Properties"].get("RedrivePolicy", {})
                if env.get("MAX_RECEIVE_COUNT") != policy.get("maxReceiveCount"):
                    out.append(f"{name}: MAX_RECEIVE_COUNT is not {q}'s maxReceiveCount")
    return out


def check_reserved(t):
    out = []
    for name, r in t["Resources"].items():
        if r.get("Type") not in ("AWS::Serverless::Function", "AWS::Lambda::Function"):
            continue
        v = r.get("Properties", {}).get("ReservedConcurrentExecutions")
        if v is None or not any(number_param(t, b) for b in branches(v)):
            out.append(f"{name}: ReservedConcurrentExecutions is not a parameter (!If [Has..., !Ref ..., !Ref AWS::NoValue])")
        elif not any(is_no_value(b) for b in branches(v)):
            out.append(f"{name}: ReservedConcurrentExecutions is always set; make it a parameter that can be off")
    return out


def names_param(v, param):
    """Whether an expression uses parameter `param` (`${Param}` in a Sub, or a Ref)."""
    text = json.dumps(v)
    return "${" + param + "}" in text or json.dumps({"Ref": param}) in text


def tests_secretsmanager_prefix(t, cond, param):
    """Whether condition `cond` is the template's test of `param` for /aws/reference/secretsmanager/."""
    text = json.dumps(t.get("Conditions", {}).get(cond, {}))
    return "/aws/reference/secretsmanager/" in text and json.dumps({"Ref": param}) in text


def check_secrets(t):
    out = []
    for name, r in t["Resources"].items():
        if r.get("Type") != "AWS::Serverless::Function":
            continue
        env = r.get("Properties", {}).get("Environment", {}).get("Variables", {})
        statements = [(st, cond) for st, cond in function_statements(t, r) if st.get("Effect") == "Allow"]

        def granting(action):
            return [(st, cond) for st, cond in statements if action in {a.lower() for a in listify(st.get("Action", []))}]

        for var, v in env.items():
            param = ref_target(v)
            if not var.endswith("_PARAM") or param not in t.get("Parameters", {}):
                continue
            if not any(names_param(st.get("Resource"), param) for st, _ in granting("ssm:getparameter")):
                out.append(f"{name}: reads {param} ({var}) but no ssm:GetParameter grant names it")
            desc = t["Parameters"][param].get("Description", "")
            if "secretsmanager" not in desc:
                continue
            mine = [(st, cond) for st, cond in granting("secretsmanager:getsecretvalue") if names_param(st.get("Resource"), param)]
            if not mine:
                out.append(f"{name}: {param} may name a Secrets Manager secret but no GetSecretValue grant names it")
            elif not any(cond and tests_secretsmanager_prefix(t, cond, param) for _, cond in mine):
                out.append(f"{name}: the GetSecretValue grant on {param} is not conditional on a test of {param} for /aws/reference/secretsmanager/")
    return out


def check_knobs(t, readme, sources):
    out = []
    names = set(re.findall(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)`", readme))
    # Per-kind overrides are documented as a pattern, read by a pattern.
    names -= {n for n in names if n.endswith("_<KIND>")}
    for n in sorted(names):
        if n.startswith(("AWS_", "ERROR_", "MAX_USER", "IP_", "CAPCHA_", "TOKEN_", "DEADLINE_")):
            continue
        if f'"{n}"' not in sources and f"'{n}'" not in sources and n not in t.get("Parameters", {}):
            out.append(f"README names `{n}`, which no code reads")
    for p in sorted(set(re.findall(r"`([A-Z][A-Za-z]+(?:Seconds|Days|Email|Schedule|Batching|Second|Count|Protection|Parameter|Stage|Encryption|Concurrency|Tick|Arn))`", readme))):
        if p not in t.get("Parameters", {}):
            out.append(f"README names template parameter `{p}`, which template.yaml does not have")
    for m in sorted(set(re.findall(r"`(max_tasks_per_tick|requests_per_second|concurrency)`", readme))):
        out.append(f"README tells operators to set `{m}`, a field name: name the setting (env var or parameter) instead")
    return out


COMPAT_PATHS = ("/in.php", "/res.php")
THROTTLE = ("ThrottlingRateLimit", "ThrottlingBurstLimit")


def http_routes(t):
    """Every HttpApi event: (function, event, api, METHOD, path, authorizer as written or None)."""
    out = []
    for fn, r in t["Resources"].items():
        if r.get("Type") != "AWS::Serverless::Function":
            continue
        for ev_name, ev in r.get("Properties", {}).get("Events", {}).items():
            if ev.get("Type") != "HttpApi":
                continue
            p = ev.get("Properties", {})
            api = ref_target(p.get("ApiId")) or "ServerlessHttpApi"
            auth = (p.get("Auth") or {}).get("Authorizer")
            out.append((fn, ev_name, api, str(p.get("Method", "ANY")).upper(), p.get("Path"), auth))
    return out


def effective_authorizer(t, api, auth):
    if auth is not None:
        return auth
    props = t["Resources"].get(api, {}).get("Properties", {})
    return (props.get("Auth") or {}).get("DefaultAuthorizer") or "NONE"


def route_settings(t, api):
    """The stage's RouteSettings as SAM builds them: the API's, merged with its events' own."""
    merged = copy.deepcopy(t["Resources"].get(api, {}).get("Properties", {}).get("RouteSettings") or {})
    for fn, ev_name, ev_api, method, path, _ in http_routes(t):
        if ev_api != api:
            continue
        ev = t["Resources"][fn]["Properties"]["Events"][ev_name]["Properties"]
        if ev.get("RouteSettings"):
            merged.setdefault(f"{method} {path}", {}).update(ev["RouteSettings"])
    return merged


def grants(fn_resource, action, resource_target):
    """Whether a function's inline policy statements allow `action` on `resource_target`."""
    for pol in listify(fn_resource.get("Properties", {}).get("Policies", [])):
        if not isinstance(pol, dict):
            continue
        for st in listify(pol.get("Statement", [])):
            for st in branches(st):
                if not isinstance(st, dict) or st.get("Effect") != "Allow":
                    continue
                actions = {a.lower() for a in listify(st.get("Action", []))}
                if action.lower() not in actions:
                    continue
                if any(ref_target(r) == resource_target for r in listify(st.get("Resource", []))):
                    return True
    return False


def check_compat_routes(t):
    out = []
    routes = http_routes(t)
    tasks = [r for r in routes if r[4] == "/tasks" or str(r[4]).startswith("/tasks/")]
    if not tasks:
        out.append("no /tasks routes at all")
    for fn, ev, api, method, path, auth in tasks:
        if effective_authorizer(t, api, auth) != "AWS_IAM":
            out.append(f"{fn}.{ev}: {method} {path} is not AWS_IAM authorised (authorizer {effective_authorizer(t, api, auth)})")
    api_fns = {r[0] for r in tasks}
    for path in COMPAT_PATHS:
        mine = [r for r in routes if r[4] == path]
        if not mine:
            out.append(f"{path}: no route (the 2captcha-compatible front needs it)")
            continue
        methods = {r[3] for r in mine}
        if "ANY" not in methods and not {"GET", "POST"} <= methods:
            out.append(f"{path}: methods {sorted(methods)}; the SDKs send both GET and POST (use ANY)")
        for fn, ev, api, method, _, auth in mine:
            if api_fns and fn not in api_fns:
                out.append(f"{fn}.{ev}: {path} is not served by the function serving /tasks ({', '.join(sorted(api_fns))})")
            if auth != "NONE":
                out.append(f"{fn}.{ev}: {method} {path} has authorizer {auth or 'the default (' + effective_authorizer(t, api, None) + ')'}; it must be NONE (the function checks the relay key)")
            settings = route_settings(t, api).get(f"{method} {path}")
            if not settings:
                out.append(f"{api}: no RouteSettings for `{method} {path}` (the compat routes need their own throttling)")
            else:
                for field in THROTTLE:
                    if settings.get(field) in (None, ""):
                        out.append(f"{api}: RouteSettings `{method} {path}` has no {field}")
            fn_res = t["Resources"][fn]
            if not grants(fn_res, "dynamodb:GetItem", "TasksTable"):
                out.append(f"{fn}: no dynamodb:GetItem on TasksTable (relay keys are checked by a GetItem)")
    keys_by_api = {}
    for _, _, api, method, path, _ in routes:
        keys_by_api.setdefault(api, set()).add(f"{method} {path}")
    for api, keys in keys_by_api.items():
        for key in route_settings(t, api):
            if key not in keys:
                out.append(f"{api}: RouteSettings names `{key}`, which is no route (routes: {', '.join(sorted(keys))}); the stage would fail to deploy")
    return sorted(set(out))


DELIVERY_INDEXES = {
    # name: (hash key, range key, projection)
    # Parked pushes live in it too, above a far-future base: one index, one deploy.
    "due-for-delivery": ("dlv_shard", "dlv_due", "KEYS_ONLY"),
}
DELIVERY_FILTER_ATTRS = ("dlv_shard", "dlv_due")
DELIVERY_ACTIONS = {
    "dynamodb:getitem", "dynamodb:updateitem", "dynamodb:query",
    "dynamodb:describestream", "dynamodb:getrecords", "dynamodb:getsharditerator", "dynamodb:liststreams",
    "sqs:sendmessage", "sqs:receivemessage", "sqs:deletemessage", "sqs:getqueueattributes",
    "ssm:getparameter", "secretsmanager:getsecretvalue", "kms:decrypt",
    "logs:createlogstream", "logs:putlogevents",
}
# Actions with no resource-level permission: `*` is their only resource.
STAR_OK = {"dynamodb:liststreams"}
# alarm: (namespace, metric) it must watch.
DELIVERY_ALARMS = {
    "DeliveryParkedAlarm": ("CaptchaRelay", "deliveries_parked"),
    "DeliveryTokenDiedAlarm": ("CaptchaRelay", "delivery_token_died"),
    "DeliveryAgeAlarm": ("CaptchaRelay", "oldest_delivery_due_seconds"),
    "DeliveryFailuresQueueAlarm": ("AWS/SQS", "ApproximateNumberOfMessagesVisible"),
    "DeliveryErrorsAlarm": ("AWS/Lambda", "Errors"),
    "DeliveryStreamIteratorAgeAlarm": ("AWS/Lambda", "IteratorAge"),
}


def alarm_metrics(props):
    """(namespace, metric name, {dimension: value}) for every metric an alarm reads."""
    if props.get("MetricName"):
        dims = {d.get("Name"): d.get("Value") for d in listify(props.get("Dimensions", []))}
        return [(props.get("Namespace"), props["MetricName"], dims)]
    out = []
    for m in listify(props.get("Metrics", [])):
        metric = (m.get("MetricStat") or {}).get("Metric")
        if metric:
            dims = {d.get("Name"): d.get("Value") for d in listify(metric.get("Dimensions", []))}
            out.append((metric.get("Namespace"), metric.get("MetricName"), dims))
    return out


def stream_events(t, table):
    """(function, event name, event properties) for every DynamoDB event on `table`'s stream."""
    out = []
    for fn, r in t["Resources"].items():
        if r.get("Type") != "AWS::Serverless::Function":
            continue
        for ev_name, ev in r.get("Properties", {}).get("Events", {}).items():
            if ev.get("Type") == "DynamoDB" and ref_target(ev.get("Properties", {}).get("Stream")) == table:
                out.append((fn, ev_name, ev.get("Properties", {})))
    return out


SUBMITTER_BINARY = "relay-submitter"


def binary_of(fn_resource):
    """The cargo binary a function is built from (Metadata.BuildProperties.Binary)."""
    return ((fn_resource.get("Metadata") or {}).get("BuildProperties") or {}).get("Binary")


def submitter_functions(t):
    """The functions built from relay-submitter (the submit queue's releaser)."""
    return [n for n, r in t["Resources"].items()
            if r.get("Type") == "AWS::Serverless::Function" and binary_of(r) == SUBMITTER_BINARY]


def delivery_stream_events(t, table):
    """The delivery function's events on `table`'s stream: every reader's but the submitter's (the
    stream wakes it for one item; `submit-queue` checks it)."""
    submitters = set(submitter_functions(t))
    return [e for e in stream_events(t, table) if e[0] not in submitters]


def index_findings(table, props, index, hash_key, range_key, projection):
    """A global secondary index of `table` with keys (name, type) and `projection`."""
    defs = {d.get("AttributeName"): d.get("AttributeType") for d in listify(props.get("AttributeDefinitions", []))}
    gsis = {g.get("IndexName"): g for g in listify(props.get("GlobalSecondaryIndexes", []))}
    g = gsis.get(index)
    if g is None:
        return [f"{table}: no index {index}"]
    out = []
    keys = {k.get("KeyType"): k.get("AttributeName") for k in listify(g.get("KeySchema", []))}
    if keys != {"HASH": hash_key[0], "RANGE": range_key[0]}:
        out.append(f"{table}: index {index} keys {keys}; want {hash_key[0]} (HASH), {range_key[0]} (RANGE)")
    if (g.get("Projection") or {}).get("ProjectionType") != projection:
        out.append(f"{table}: index {index} projection is not {projection}")
    for k, typ in (hash_key, range_key):
        if defs.get(k) != typ:
            out.append(f"{table}: attribute {k} is not defined as {typ}")
    return out


def filter_requires(pattern, attr):
    """Whether a filter pattern lets through only records whose NewImage has `attr` as a number."""
    leaf = ((pattern.get("dynamodb") or {}).get("NewImage") or {}).get(attr)
    return isinstance(leaf, dict) and leaf.get("N") == [{"exists": True}]


def check_delivery(t, table="TasksTable"):
    res = t["Resources"]
    out = []
    props = res.get(table, {}).get("Properties", {})
    if not props:
        return [f"no {table}"]
    view = (props.get("StreamSpecification") or {}).get("StreamViewType")
    if view != "NEW_IMAGE":
        out.append(f"{table}: StreamViewType is {view}; push delivery needs NEW_IMAGE")
    for index, (hash_key, range_key, projection) in DELIVERY_INDEXES.items():
        out += index_findings(table, props, index, (hash_key, "N"), (range_key, "N"), projection)

    events = delivery_stream_events(t, table)
    if not events:
        out.append(f"no function but the submitter reads {table}'s stream (push delivery is woken by it)")
    failure_queues = set()
    for fn, ev_name, ev in events:
        where = f"{fn}.{ev_name}"
        dest = ((ev.get("DestinationConfig") or {}).get("OnFailure") or {}).get("Destination")
        queue = ref_target(dest) if dest is not None else None
        failure_queues.add(queue)
        if queue is None or res.get(queue, {}).get("Type") != "AWS::SQS::Queue":
            out.append(f"{where}: no OnFailure destination (an SQS queue of this template)")
        for pattern in filter_patterns(where, ev, "invoke it", out):
            for attr in DELIVERY_FILTER_ATTRS:
                if not filter_requires(pattern, attr):
                    out.append(f"{where}: filter pattern does not require dynamodb.NewImage.{attr} to exist as N "
                               f'({{"{attr}": {{"N": [{{"exists": true}}]}}}}; `exists` without the type never matches)')
        if ev.get("MaximumBatchingWindowInSeconds", 0) != 0:
            out.append(f"{where}: MaximumBatchingWindowInSeconds is {ev.get('MaximumBatchingWindowInSeconds')}; "
                       "0 pushes a result the moment it is recorded")
        r = res[fn]
        env = ((r.get("Properties", {}).get("Environment") or {}).get("Variables") or {})
        retry_queue = ref_target(env.get("DELIVERY_RETRY_QUEUE_URL"))
        if retry_queue is None or res.get(retry_queue, {}).get("Type") != "AWS::SQS::Queue":
            out.append(f"{fn}: DELIVERY_RETRY_QUEUE_URL does not name an SQS queue of this template "
                       "(a retry on a token's fast schedule would wait for the minute's sweep)")
            retry_queue = None
        else:
            sqs_events = [e.get("Properties", {}) for e in r.get("Properties", {}).get("Events", {}).values()
                          if e.get("Type") == "SQS" and ref_target(e.get("Properties", {}).get("Queue")) == retry_queue]
            if not sqs_events:
                out.append(f"{fn}: no SQS event reads its retry queue {retry_queue}")
            for e in sqs_events:
                if e.get("MaximumBatchingWindowInSeconds", 0) != 0:
                    out.append(f"{fn}: the retry queue's MaximumBatchingWindowInSeconds is "
                               f"{e.get('MaximumBatchingWindowInSeconds')}; 0 delivers a retry when it falls due")
        if not any(e.get("Type") in ("ScheduleV2", "Schedule") for e in r.get("Properties", {}).get("Events", {}).values()):
            out.append(f"{fn}: no schedule (the sweep that retries what is due)")
        role = role_of(t, r)
        if role is None:
            out.append(f"{fn}: no Role of its own; SAM gives a DynamoDB event's function the managed AWSLambdaDynamoDBExecutionRole (stream reads on every stream, logs on every group)")
            continue
        role_props = res[role].get("Properties", {})
        if role_props.get("ManagedPolicyArns"):
            out.append(f"{role}: managed policies {role_props['ManagedPolicyArns']}; grant only DELIVERY_ACTIONS inline")
        for st, _ in function_statements(t, r):
            if st.get("Effect") != "Allow":
                continue
            if "NotAction" in st or "NotResource" in st:
                out.append(f"{role}: NotAction/NotResource grants more than it names")
            actions = {a.lower() for a in listify(st.get("Action", []))}
            resources = listify(st.get("Resource", []))
            for a in sorted(actions - DELIVERY_ACTIONS):
                out.append(f"{role}: grants {a}, beyond the delivery function's actions")
            if "*" in resources and actions - STAR_OK:
                out.append(f"{role}: grants {sorted(actions - STAR_OK)} on *")
            if "sqs:sendmessage" in actions and any(ref_target(x) not in (queue, retry_queue) for x in resources):
                out.append(f"{role}: sqs:SendMessage on {resources}; only the OnFailure queue {queue} or the retry queue")
            reads = actions & {"sqs:receivemessage", "sqs:deletemessage", "sqs:getqueueattributes"}
            if reads and any(ref_target(x) != retry_queue for x in resources):
                out.append(f"{role}: {sorted(reads)} on {resources}; only the retry queue {retry_queue}")
            item = actions & {"dynamodb:getitem", "dynamodb:updateitem", "dynamodb:query"}
            if item and not all(ref_target(x) == table or (isinstance(x, dict) and f"${{{table}.Arn}}/index/" in json.dumps(x)) for x in resources):
                out.append(f"{role}: {sorted(item)} on {resources}; only {table} and its indexes")

    for alarm, (namespace, metric) in DELIVERY_ALARMS.items():
        a = res.get(alarm)
        if not a or a.get("Type") != "AWS::CloudWatch::Alarm":
            out.append(f"no {alarm}")
            continue
        p = a.get("Properties", {})
        topics = [x for x in listify(p.get("AlarmActions", [])) if res.get(ref_target(x), {}).get("Type") == "AWS::SNS::Topic"]
        if not topics:
            out.append(f"{alarm}: its AlarmActions notify no SNS topic of this template (AlarmTopic)")
        metrics = alarm_metrics(p)
        if not any(ns == namespace and m == metric for ns, m, _ in metrics):
            out.append(f"{alarm}: does not watch {namespace} {metric}")
        for ns, m, dims in metrics:
            if ns == "CaptchaRelay" and dims.get("service") != "delivery":
                out.append(f"{alarm}: {m} without dimension service = delivery matches nothing the function emits")
            if ns == "AWS/Lambda" and ref_target(dims.get("FunctionName")) not in {e[0] for e in events}:
                out.append(f"{alarm}: {m} of FunctionName {dims.get('FunctionName')}, not the function reading the stream")
            if ns == "AWS/SQS" and ref_target(dims.get("QueueName")) not in failure_queues:
                out.append(f"{alarm}: {m} of QueueName {dims.get('QueueName')}, not the stream's OnFailure queue")
    return sorted(set(out))


SUBMIT_QUEUE_INDEX = "submit-queue"
# (name, attribute type): the queue's lanes and tasks in work (S), their time (N).
SUBMIT_QUEUE_KEYS = (("sq_key", "S"), ("sq_at", "N"))
# The one item whose writes start the submitter (the API writes it when it queues a task).
WAKE_PATTERN = {"dynamodb": {"Keys": {"pk": {"S": ["submitq#wake"]}}}}
# Settings the API (inline submits, queue bounds) and the submitter (releases) must share.
QUEUE_VARS = (
    "CAPTCHAAI_THREADS", "SUBMITS_PER_SECOND", "SUBMIT_NO_SLOT_PER_MINUTE",
    "QUEUE_MAX_PER_OWNER", "QUEUE_MAX_TOTAL", "QUEUE_MAX_WAIT_SECS",
)
# action: the only resource the submitter's role may grant it on (see `resource_kind`); None = any
# but `*` (the secrets' grants: the `secrets` check names them).
SUBMITTER_GRANTS = {
    "dynamodb:getitem": "table", "dynamodb:updateitem": "table",
    "dynamodb:query": "index", "dynamodb:scan": "index",
    "dynamodb:describestream": "stream", "dynamodb:getrecords": "stream", "dynamodb:getsharditerator": "stream",
    "dynamodb:liststreams": "*",
    "sqs:sendmessage": "dead-letter queue",
    "logs:createlogstream": "log group", "logs:putlogevents": "log group",
    "ssm:getparameter": None, "secretsmanager:getsecretvalue": None, "kms:decrypt": None,
}
# alarm: (namespace, metric) it must watch, each.
SUBMIT_ALARMS = {
    "SubmitQueueAgeAlarm": (("CaptchaRelay", "submit_queue_oldest_seconds"),),
    "SubmitterErrorsAlarm": (("AWS/Lambda", "Errors"), ("CaptchaRelay", "submitter_errors")),
}
SUBMIT_ALARM_THRESHOLDS = {"SubmitQueueAgeAlarm": {"Ref": "QueueAgeAlarmSeconds"}}


def tasks_functions(t):
    """The functions serving /tasks (the API)."""
    return sorted({fn for fn, _, _, _, path, _ in http_routes(t) if path == "/tasks" or str(path).startswith("/tasks/")})


def function_env(t, fn_resource):
    """A function's environment as SAM deploys it: Globals' variables, then its own."""
    env = dict(((t.get("Globals", {}).get("Function", {}).get("Environment") or {}).get("Variables") or {}))
    env.update(((fn_resource.get("Properties", {}).get("Environment") or {}).get("Variables") or {}))
    return env


def sub_text(x):
    """The template string of a Sub (or a plain string): how the template builds an ARN."""
    if isinstance(x, dict) and "Fn::Sub" in x:
        v = x["Fn::Sub"]
        return v[0] if isinstance(v, list) else v
    return x if isinstance(x, str) else None


def get_att(x):
    """(resource, attribute) of a GetAtt, else None."""
    if isinstance(x, dict) and "Fn::GetAtt" in x:
        ga = x["Fn::GetAtt"]
        return tuple(ga) if isinstance(ga, list) else tuple(ga.split(".", 1))
    return None


def resource_kind(x, table, queue, log_group):
    """What a statement's resource names, in SUBMITTER_GRANTS' terms (None: something else)."""
    text, att = sub_text(x), get_att(x)
    if x == "*":
        return "*"
    if att == (table, "Arn") or text == f"${{{table}.Arn}}":
        return "table"
    if text == f"${{{table}.Arn}}/index/{SUBMIT_QUEUE_INDEX}":
        return "index"
    if att == (table, "StreamArn") or text in (f"${{{table}.Arn}}/stream/*", f"${{{table}.StreamArn}}"):
        return "stream"
    if queue and att == (queue, "Arn"):
        return "dead-letter queue"
    if log_group and att == (log_group, "Arn"):
        return "log group"
    return None


def kind_text(kind, table, queue, log_group):
    return {
        "table": f"{table} itself", "index": f"{table}'s {SUBMIT_QUEUE_INDEX} index", "stream": f"{table}'s stream",
        "*": "*", "dead-letter queue": f"its DEAD_LETTER_QUEUE_URL queue {queue or '(none)'}",
        "log group": f"its log group {log_group or '(no LoggingConfig.LogGroup)'}",
    }[kind]


def filter_patterns(where, ev, what, out):
    """A stream event's FilterCriteria patterns, parsed; what is missing or not JSON goes to `out`
    (without a filter, every write of the table would `what`)."""
    filters = listify((ev.get("FilterCriteria") or {}).get("Filters", []))
    if not filters:
        out.append(f"{where}: no FilterCriteria (every write of the table would {what})")
    patterns = []
    for f in filters:
        try:
            patterns.append(json.loads(f.get("Pattern", "")))
        except (TypeError, ValueError):
            out.append(f"{where}: filter pattern is not JSON: {f.get('Pattern')!r}")
    return patterns


def wake_findings(where, ev):
    """The submitter's stream event: started by the wake item only, at once."""
    out = []
    for pattern in filter_patterns(where, ev, "start a run", out):
        dynamodb = pattern.get("dynamodb") if isinstance(pattern, dict) else None
        key = ((dynamodb or {}).get("Keys") or {}).get("pk") if isinstance(dynamodb, dict) else None
        if key != WAKE_PATTERN["dynamodb"]["Keys"]["pk"]:
            out.append(f"{where}: filter pattern {json.dumps(pattern)} lets through more than the wake item "
                       f"(every write of the table would start a run); use {json.dumps(WAKE_PATTERN)}")
        elif pattern != WAKE_PATTERN:
            out.append(f"{where}: filter pattern {json.dumps(pattern)} adds conditions to the wake item's key "
                       f"(a write of the wake item they drop starts no run); use {json.dumps(WAKE_PATTERN)}")
    if ev.get("MaximumBatchingWindowInSeconds", 0) != 0:
        out.append(f"{where}: MaximumBatchingWindowInSeconds is {ev.get('MaximumBatchingWindowInSeconds')}; "
                   "0 starts a run the moment a task is queued")
    return out


def submitter_trigger_findings(t, fn, table):
    """The submitter is woken by the table's stream (the wake item) and by a schedule."""
    out = []
    events = [e for e in stream_events(t, table) if e[0] == fn]
    if not events:
        out.append(f"{fn}: does not read {table}'s stream (the API's wake item would not start it; queued tasks would wait for the schedule)")
    for _, ev_name, ev in events:
        out += wake_findings(f"{fn}.{ev_name}", ev)
    if not any(e.get("Type") in ("ScheduleV2", "Schedule") for e in t["Resources"][fn].get("Properties", {}).get("Events", {}).values()):
        out.append(f"{fn}: no schedule (the backstop that releases the queue when a wake-up is lost)")
    return out


def queue_settings_findings(t, api, fn):
    """The API and the submitter share one queue and one CaptchaAI account: the same settings."""
    out = []
    api_env, env = function_env(t, t["Resources"][api]), function_env(t, t["Resources"][fn])
    for var in QUEUE_VARS:
        a, b = api_env.get(var), env.get(var)
        if a is None or b is None:
            unset = " and ".join(n for n, v in ((api, a), (fn, b)) if v is None)
            out.append(f"{unset}: {var} is not set; the API and the submitter must set it alike (one queue, one CaptchaAI account)")
        elif a != b:
            out.append(f"{var}: {api} sets {json.dumps(a)}, {fn} sets {json.dumps(b)}; they must agree (one queue, one CaptchaAI account)")
    a, b = api_env.get("CALLBACK_GRACE_SECS"), env.get("CALLBACK_GRACE_SECS")
    if b is None or a != b:
        out.append(f"{fn}: CALLBACK_GRACE_SECS is {json.dumps(b)}, {api}'s is {json.dumps(a)}; "
                   "it schedules the first poll of what it sends, as the API does")
    return out


def submitter_role_findings(t, fn, table):
    """The submitter's own role grants only SUBMITTER_GRANTS, each on its resource, and those it needs."""
    res = t["Resources"]
    r = res[fn]
    out = []
    queue = ref_target(function_env(t, r).get("DEAD_LETTER_QUEUE_URL"))
    if queue is None or res.get(queue, {}).get("Type") != "AWS::SQS::Queue":
        out.append(f"{fn}: DEAD_LETTER_QUEUE_URL does not name an SQS queue of this template (an id in.php gave that could not be stored is kept there)")
        queue = None
    log_group = ref_target((r.get("Properties", {}).get("LoggingConfig") or {}).get("LogGroup"))
    role = role_of(t, r)
    if role is None:
        out.append(f"{fn}: no Role of its own; SAM gives a DynamoDB event's function the managed AWSLambdaDynamoDBExecutionRole (stream reads on every stream, logs on every group)")
        return out
    if res[role].get("Properties", {}).get("ManagedPolicyArns"):
        out.append(f"{role}: managed policies {res[role]['Properties']['ManagedPolicyArns']}; grant only SUBMITTER_GRANTS inline")
    granted = set()
    for st, cond in function_statements(t, r):
        if st.get("Effect") != "Allow":
            continue
        if "NotAction" in st or "NotResource" in st:
            out.append(f"{role}: NotAction/NotResource grants more than it names")
        actions = {a.lower() for a in listify(st.get("Action", []))}
        resources = listify(st.get("Resource", []))
        kinds = [resource_kind(x, table, queue, log_group) for x in resources]
        if "*" in kinds and actions - STAR_OK:
            out.append(f"{role}: grants {sorted(actions - STAR_OK)} on *")
        for a in sorted(actions):
            if a not in SUBMITTER_GRANTS:
                out.append(f"{role}: grants {a}, beyond the submitter's actions")
                continue
            want = SUBMITTER_GRANTS[a]
            if want is None:
                continue
            bad = [x for x, k in zip(resources, kinds) if k != want]
            if bad:
                out.append(f"{role}: {a} on {bad}; only on {kind_text(want, table, queue, log_group)}")
            elif cond is None and resources:
                granted.add(a)
    for a, want in SUBMITTER_GRANTS.items():
        if want is not None and a not in granted:
            out.append(f"{role}: grants no {a} on {kind_text(want, table, queue, log_group)}; the submitter needs it")
    return out


def api_queue_findings(t, api, table):
    """The API reads a queued task's position in the submit-queue index."""
    for st, _ in function_statements(t, t["Resources"][api]):
        actions = {a.lower() for a in listify(st.get("Action", []))}
        if st.get("Effect") == "Allow" and "dynamodb:query" in actions and any(
                resource_kind(x, table, None, None) == "index" for x in listify(st.get("Resource", []))):
            return []
    return [f"{api}: no dynamodb:Query on {table}'s {SUBMIT_QUEUE_INDEX} index (GET /tasks/{{ref}} shows a queued task's position)"]


def submit_alarm_findings(t, submitters):
    res = t["Resources"]
    out = []
    for alarm, watches in SUBMIT_ALARMS.items():
        a = res.get(alarm)
        if not a or a.get("Type") != "AWS::CloudWatch::Alarm":
            out.append(f"no {alarm}")
            continue
        p = a.get("Properties", {})
        if not any(res.get(ref_target(x), {}).get("Type") == "AWS::SNS::Topic" for x in listify(p.get("AlarmActions", []))):
            out.append(f"{alarm}: its AlarmActions notify no SNS topic of this template (AlarmTopic)")
        metrics = alarm_metrics(p)
        for namespace, metric in watches:
            if not any(ns == namespace and m == metric for ns, m, _ in metrics):
                out.append(f"{alarm}: does not watch {namespace} {metric}")
        for ns, m, dims in metrics:
            if ns == "CaptchaRelay" and dims.get("service") != "submitter":
                out.append(f"{alarm}: {m} without dimension service = submitter matches nothing the submitter emits")
            if ns == "AWS/Lambda" and ref_target(dims.get("FunctionName")) not in submitters:
                out.append(f"{alarm}: {m} of FunctionName {dims.get('FunctionName')}, not the submitter")
        want = SUBMIT_ALARM_THRESHOLDS.get(alarm)
        if want is not None and p.get("Threshold") != want:
            out.append(f"{alarm}: Threshold is {json.dumps(p.get('Threshold'))}; want {json.dumps(want)} (the operator's setting)")
    return out


def check_submit_queue(t, table="TasksTable"):
    props = t["Resources"].get(table, {}).get("Properties", {})
    if not props:
        return [f"no {table}"]
    out = index_findings(table, props, SUBMIT_QUEUE_INDEX, *SUBMIT_QUEUE_KEYS, "KEYS_ONLY")
    submitters = submitter_functions(t)
    if not submitters:
        out.append(f"no function is built from {SUBMITTER_BINARY} (nothing would release the submit queue)")
    apis = tasks_functions(t)
    if not apis:
        out.append("no function serves /tasks (the API that queues tasks)")
    for fn in submitters:
        out += submitter_trigger_findings(t, fn, table)
        out += submitter_role_findings(t, fn, table)
        for api in apis:
            out += queue_settings_findings(t, api, fn)
    for api in apis:
        out += api_queue_findings(t, api, table)
    out += submit_alarm_findings(t, submitters)
    return sorted(set(out))


# Writes of one index key per task, counted by the load simulation (tests/sim/LOAD.md): the
# due-for-poll entry is written when the task is created, when in.php's answer is stored, and
# removed by the result; due-for-delivery likewise for a push.
INDEX_WRITES_PER_TASK = 3
PARTITION_WCU = 1000
ACCOUNT_RPS, ACCOUNT_BURST = 10000, 5000


def param_values(t, overrides):
    """Each parameter's value as deployed: its default, overridden."""
    vals = {n: p.get("Default") for n, p in t.get("Parameters", {}).items()}
    vals.update(overrides)
    return vals


def samconfig_overrides():
    """`parameter_overrides` of samconfig.toml's deploy command (Name=Value pairs)."""
    path = ROOT / "samconfig.toml"
    if not path.exists():
        return {}
    m = re.search(r'parameter_overrides\s*=\s*"([^"]*)"', path.read_text())
    return dict(kv.split("=", 1) for kv in (m.group(1).split() if m else []) if "=" in kv)


def cli_overrides(argv):
    out = {}
    for i, a in enumerate(argv):
        if a == "--param" and i + 1 < len(argv) and "=" in argv[i + 1]:
            k, v = argv[i + 1].split("=", 1)
            out[k] = v
    return out


def number_param(t, v):
    """The Number parameter `v` refers to, else None."""
    name = v.get("Ref") if isinstance(v, dict) else None
    p = t.get("Parameters", {}).get(name) if name else None
    return name if p is not None and p.get("Type") == "Number" else None


def check_capacity(t, overrides=None):
    out = []
    vals = param_values(t, overrides or {})
    num = lambda name: float(vals.get(name) or 0)
    apis = [n for n, r in t["Resources"].items() if r.get("Type") == "AWS::Serverless::HttpApi"]
    steady = 0.0
    for api in apis:
        props = t["Resources"][api].get("Properties", {})
        default = props.get("DefaultRouteSettings") or {}
        blocks = [("DefaultRouteSettings", default)] + [(f"RouteSettings[{k}]", v) for k, v in (props.get("RouteSettings") or {}).items()]
        if not default:
            out.append(f"{api}: no DefaultRouteSettings: routes without their own throttle have only the account's")
        for where, block in blocks:
            for key in THROTTLE:
                v = block.get(key)
                name = number_param(t, v)
                if name is None:
                    out.append(f"{api}.{where}.{key} is {v!r}, a literal: make it a Number parameter")
                elif key == "ThrottlingBurstLimit" and num(name) > ACCOUNT_BURST:
                    out.append(f"{api}.{where}: burst {name} = {vals.get(name)} is above the account's burst quota ({ACCOUNT_BURST})")
                elif key == "ThrottlingRateLimit":
                    steady += num(name)
        routes = [r for r in http_routes(t) if r[2] == api and str(r[4]).startswith("/callback/")]
        settings = route_settings(t, api)
        expected = num("ExpectedTasksPerSecond")
        if not routes:
            out.append(f"{api}: no pingback routes (/callback/...)")
        for fn, ev, _, method, path, _ in routes:
            block = settings.get(f"{method} {path}")
            if not block:
                out.append(f"{fn}.{ev}: {method} {path} has no throttle of its own (pingbacks are sized apart from the API)")
                continue
            name = number_param(t, block.get("ThrottlingRateLimit"))
            if name and num(name) < expected:
                out.append(f"{method} {path}: {name} = {vals.get(name)} is below ExpectedTasksPerSecond = {vals.get('ExpectedTasksPerSecond')} (a refused pingback is not retried)")
    if steady > ACCOUNT_RPS:
        out.append(f"the steady route throttles add up to {steady:g} req/s, above the account's {ACCOUNT_RPS} (ask for a quota increase and say so here)")
    env = t.get("Globals", {}).get("Function", {}).get("Environment", {}).get("Variables", {})
    for var, param in (("POLL_SHARDS", "PollShards"), ("POLL_SHARDS_PREVIOUS", "PollShardsPrevious"), ("QUEUE_SHARDS", "QueueShards")):
        if ref_target(env.get(var)) != param:
            out.append(f"Globals: {var} is not !Ref {param} (every function reads and writes the sharded indexes)")
    shards = num("PollShards")
    need = num("ExpectedTasksPerSecond") * INDEX_WRITES_PER_TASK / (PARTITION_WCU / 2)
    if shards < need:
        out.append(f"PollShards = {vals.get('PollShards')} is too few for ExpectedTasksPerSecond = {vals.get('ExpectedTasksPerSecond')}: each key would take {num('ExpectedTasksPerSecond') * INDEX_WRITES_PER_TASK / max(shards, 1):g} writes/s (half of {PARTITION_WCU} at most; need {need:g} shards)")
    queue = num("QueueShards")
    need = num("ExpectedTasksPerSecond") / (PARTITION_WCU / 2)
    if queue < need:
        out.append(f"QueueShards = {vals.get('QueueShards')} is too few for ExpectedTasksPerSecond = {vals.get('ExpectedTasksPerSecond')}: each queue count item would take {num('ExpectedTasksPerSecond') / max(queue, 1):g} admissions/s (half of {PARTITION_WCU} at most; need {need:g})")
    for fn, name, ev in delivery_stream_events(t, "TasksTable"):
        if number_param(t, ev.get("ParallelizationFactor")) is None:
            out.append(f"{fn}.{name}: the stream's ParallelizationFactor is not a parameter")
    return out


def check_retention(t, overrides=None):
    """No queue that can hold a result keeps it longer than RetentionDays, the table's TTL:
    the dead-letter and poison queues' MessageRetentionPeriod (an SQS message's age counts from
    its first enqueue, also in the poison queue) and the functions' RETENTION_DAYS."""
    out = []
    vals = param_values(t, overrides or {})
    days = float(vals.get("RetentionDays") or 0)
    res = t["Resources"]
    env = t.get("Globals", {}).get("Function", {}).get("Environment", {}).get("Variables", {})
    if ref_target(env.get("RETENTION_DAYS")) != "RetentionDays":
        out.append("Globals: RETENTION_DAYS is not !Ref RetentionDays (the reads refuse what is past it)")
    for name, r in res.items():
        if r.get("Type") != "AWS::SQS::Queue":
            continue
        period = r.get("Properties", {}).get("MessageRetentionPeriod", 345600)
        param = number_param(t, period)
        seconds = float(vals.get(param) or 0) if param else float(period)
        holds_results = name in {"DeadLetterQueue", "PoisonQueue"}
        if holds_results and seconds > days * 86400:
            out.append(f"{name}: keeps a dead letter (a solution) {seconds:g} s, longer than RetentionDays = {vals.get('RetentionDays')} ({days * 86400:g} s)")
    return out


def rust_sources():
    return "\n".join(p.read_text() for p in ROOT.rglob("*.rs") if "target" not in p.parts and ".venv" not in p.parts)


def run_checks(t, readme, sources):
    return {
        "alarm-topic": check_alarm_topics(t),
        "sqs-visibility": check_sqs_visibility(t),
        "reserved": check_reserved(t),
        "secrets": check_secrets(t),
        "knobs": check_knobs(t, readme, sources),
        "compat-routes": check_compat_routes(t),
        "delivery": check_delivery(t),
        "submit-queue": check_submit_queue(t),
        "capacity": check_capacity(t, OVERRIDES),
        "retention": check_retention(t, OVERRIDES),
    }


def self_test(t, readme, sources):
    """Each check must fail on a copy broken the way it guards against."""
    def broken(f):
        c = copy.deepcopy(t)
        f(c)
        return c

    r = t["Resources"]
    topic = next(n for n, v in r.items() if v["Type"] == "AWS::SNS::Topic")
    key = next(n for n, v in r.items() if v["Type"] == "AWS::KMS::Key")
    queue = next(n for n, v in r.items() if v["Type"] == "AWS::SQS::Queue" and v["Properties"].get("RedrivePolicy"))
    poller = "PollerFunction"
    cases = [
        ("alarm-topic", broken(lambda c: c["Resources"][topic]["Properties"].__setitem__("KmsMasterKeyId", "alias/aws/sns"))),
        ("alarm-topic", broken(lambda c: c["Resources"][key]["Properties"]["KeyPolicy"].__setitem__("Statement", c["Resources"][key]["Properties"]["KeyPolicy"]["Statement"][:1]))),
        ("sqs-visibility", broken(lambda c: c["Resources"][queue]["Properties"].__setitem__("VisibilityTimeout", 180))),
        ("sqs-visibility", broken(lambda c: c["Resources"]["RedriveFunction"]["Properties"]["Environment"]["Variables"].__setitem__("DEAD_LETTER_VISIBILITY_SECONDS", 30))),
        ("sqs-visibility", broken(lambda c: c["Resources"]["RedriveFunction"]["Properties"]["Environment"]["Variables"].__setitem__("MAX_RECEIVE_COUNT", 5))),
        ("reserved", broken(lambda c: c["Resources"][poller]["Properties"].__setitem__("ReservedConcurrentExecutions", 2))),
        ("secrets", broken(lambda c: c["Resources"][poller]["Properties"].__setitem__("Policies", [{"Statement": []}]))),
        ("retention", broken(lambda c: c["Parameters"]["PoisonRetentionSeconds"].__setitem__("Default", 1209600))),
        ("retention", broken(lambda c: c["Resources"]["DeadLetterQueue"]["Properties"].__setitem__("MessageRetentionPeriod", 1209600))),
    ]
    failures = []
    api_fn = "ApiFunction"
    events = lambda c: c["Resources"][api_fn]["Properties"]["Events"]
    compat = [n for n, e in events(t).items() if e["Properties"].get("Path") in COMPAT_PATHS]
    tasks = [n for n, e in events(t).items() if str(e["Properties"].get("Path")).startswith("/tasks")]
    http_api = ref_target(events(t)[tasks[0]]["Properties"].get("ApiId")) if tasks else "HttpApi"
    settings = lambda c: c["Resources"][http_api]["Properties"]["RouteSettings"]
    first_key = next(iter(t["Resources"].get(http_api, {}).get("Properties", {}).get("RouteSettings") or {}), None)
    if not (compat and tasks and first_key):
        failures.append("compat-routes: the template has no compat routes, /tasks routes or RouteSettings to break")
        compat, tasks, first_key = [], [], None

    def set_auth(ev, value):
        def f(c):
            if value is None:
                events(c)[ev]["Properties"].pop("Auth", None)
            else:
                events(c)[ev]["Properties"]["Auth"] = {"Authorizer": value}
        return f

    def drop_get_item(c):
        for pol in c["Resources"][api_fn]["Properties"]["Policies"]:
            for st in pol.get("Statement", []):
                if isinstance(st, dict) and isinstance(st.get("Action"), list):
                    st["Action"] = [a for a in st["Action"] if a != "dynamodb:GetItem"]

    def only_get(ev):
        def f(c):
            events(c)[ev]["Properties"]["Method"] = "GET"
            settings(c)[f"GET {events(c)[ev]['Properties']['Path']}"] = {"ThrottlingRateLimit": 1, "ThrottlingBurstLimit": 1}
        return f

    for ev in compat:
        cases += [
            ("compat-routes", broken(lambda c, ev=ev: events(c).pop(ev)), "no route"),
            ("compat-routes", broken(set_auth(ev, "AWS_IAM")), "must be NONE"),
            ("compat-routes", broken(set_auth(ev, None)), "must be NONE"),
            ("compat-routes", broken(only_get(ev)), "both GET and POST"),
        ]
    for ev in tasks:
        cases.append(("compat-routes", broken(set_auth(ev, "NONE")), "not AWS_IAM"))
    cases += [] if first_key is None else [
        ("compat-routes", broken(lambda c: events(c).__setitem__("Other", {"Type": "HttpApi", "Properties": {"ApiId": {"Ref": http_api}, "Method": "GET", "Path": "/tasks/x", "Auth": {"Authorizer": "NONE"}}})), "not AWS_IAM"),
        ("compat-routes", broken(lambda c: c["Resources"][http_api]["Properties"].pop("RouteSettings")), "no RouteSettings for"),
        ("compat-routes", broken(lambda c: settings(c)[first_key].pop("ThrottlingRateLimit")), "no ThrottlingRateLimit"),
        ("compat-routes", broken(lambda c: settings(c)[first_key].pop("ThrottlingBurstLimit")), "no ThrottlingBurstLimit"),
        # The route key of Method ANY is `ANY /path`: a `/path` or `GET /path` key names no route.
        ("compat-routes", broken(lambda c: settings(c).__setitem__(first_key.split(" ", 1)[1], settings(c).pop(first_key))), "which is no route"),
        ("compat-routes", broken(lambda c: settings(c).__setitem__("GET /nowhere", {"ThrottlingRateLimit": 1, "ThrottlingBurstLimit": 1})), "which is no route"),
        ("compat-routes", broken(drop_get_item), "dynamodb:GetItem"),
    ]
    cases += delivery_cases(t, broken, failures)
    cases += submit_queue_cases(t, broken, failures)
    cases += capacity_cases(t, broken)
    for check, tpl, *needle in cases:
        found = run_checks(tpl, readme, sources)[check]
        if not found:
            failures.append(f"{check}: did not fail on a broken template")
        elif needle and not any(needle[0] in f for f in found):
            failures.append(f"{check}: failed on a broken template, but not with `{needle[0]}`: {found}")
    if not run_checks(t, readme + "\nset `NO_SUCH_SETTING` and `NoSuchParameterSeconds`\n", sources)["knobs"]:
        failures.append("knobs: did not fail on an unknown setting")
    return failures


def capacity_cases(t, broken):
    api = "HttpApi"
    props = lambda c: c["Resources"][api]["Properties"]
    params = lambda c: c["Parameters"]
    cb_key = next((k for k in props(t).get("RouteSettings", {}) if "/callback/" in k), None)

    def set_default(name, value):
        return lambda c: params(c)[name].__setitem__("Default", value)

    cases = [
        ("capacity", broken(lambda c: props(c)["DefaultRouteSettings"].__setitem__("ThrottlingRateLimit", 100)), "a literal"),
        ("capacity", broken(set_default("CallbackRequestsPerSecond", 100)), "below ExpectedTasksPerSecond"),
        ("capacity", broken(set_default("ExpectedTasksPerSecond", 10000)), "too few"),
        ("capacity", broken(set_default("ApiBurst", 9000)), "burst quota"),
        ("capacity", broken(set_default("CompatReadsPerSecond", 9000)), "add up to"),
        ("capacity", broken(lambda c: c["Globals"]["Function"]["Environment"]["Variables"].pop("POLL_SHARDS")), "POLL_SHARDS"),
        ("capacity", broken(lambda c: c["Globals"]["Function"]["Environment"]["Variables"].pop("QUEUE_SHARDS")), "QUEUE_SHARDS"),
        ("capacity", broken(set_default("QueueShards", 1)), "QueueShards = 1 is too few"),
        ("reserved", broken(lambda c: c["Resources"]["DeliveryFunction"]["Properties"].pop("ReservedConcurrentExecutions")), "not a parameter"),
        ("capacity", broken(lambda c: c["Resources"]["DeliveryFunction"]["Properties"]["Events"]["TableStream"]["Properties"].__setitem__("ParallelizationFactor", 2)), "ParallelizationFactor"),
    ]
    if cb_key:
        cases.append(("capacity", broken(lambda c: props(c)["RouteSettings"].pop(cb_key)), "no throttle of its own"))
    # An override (samconfig.toml, --param) is checked like a default.
    saved = dict(OVERRIDES)
    OVERRIDES.update({"PollShards": "1"})
    found = check_capacity(t, OVERRIDES)
    OVERRIDES.clear()
    OVERRIDES.update(saved)
    cases.append(("capacity", t, "too few") if not found else ("capacity", broken(set_default("PollShards", 1)), "too few"))
    return cases


def delivery_cases(t, broken, failures):
    """Broken copies for the `delivery` check, and for `secrets` on a function with its own role."""
    table = "TasksTable"
    events = delivery_stream_events(t, table)
    if not events:
        failures.append("delivery: the template has no delivery function reading the table's stream to break")
        return []
    fn, ev_name, _ = events[0]
    role = role_of(t, t["Resources"][fn])
    if role is None:
        failures.append(f"delivery: {fn} has no role of its own to break")
        return []
    webhook = next((ref_target(v) for k, v in t["Resources"][fn]["Properties"]["Environment"]["Variables"].items() if k.endswith("_PARAM")), None)
    alarm = next((a for a in DELIVERY_ALARMS if a in t["Resources"]), None)
    if alarm is None:
        failures.append("delivery: the template has no delivery alarm to break")
        return []
    tbl = lambda c: c["Resources"][table]["Properties"]
    ev = lambda c: c["Resources"][fn]["Properties"]["Events"][ev_name]["Properties"]
    doc = lambda c: c["Resources"][role]["Properties"]["Policies"][0]["PolicyDocument"]

    def drop_index(name):
        return lambda c: tbl(c).__setitem__("GlobalSecondaryIndexes", [g for g in tbl(c)["GlobalSecondaryIndexes"] if g["IndexName"] != name])

    def set_pattern(pattern):
        return lambda c: ev(c).__setitem__("FilterCriteria", {"Filters": [{"Pattern": json.dumps(pattern)}]})

    def add_statement(st):
        return lambda c: doc(c)["Statement"].append(st)

    def only_sam_policies(c):
        c["Resources"][fn]["Properties"].pop("Role")
        c["Resources"][fn]["Properties"]["Policies"] = [{"Statement": copy.deepcopy(doc(c)["Statement"])}]
        c["Resources"].pop(role)

    def drop_statements(action, keep_if=False):
        """Remove the statements granting `action` (with keep_if: unwrap their Fn::If instead)."""
        def f(c):
            out = []
            for st in doc(c)["Statement"]:
                arms = branches(st)
                if not any(isinstance(a, dict) and action in listify(a.get("Action", [])) for a in arms):
                    out.append(st)
                elif keep_if and "Fn::If" in st:
                    out.append(st["Fn::If"][1])
            doc(c)["Statement"] = out
        return f

    table_arn = {"Fn::GetAtt": [table, "Arn"]}
    return [
        ("delivery", broken(lambda c: tbl(c).__setitem__("StreamSpecification", {"StreamViewType": "KEYS_ONLY"})), "NEW_IMAGE"),
        ("delivery", broken(lambda c: tbl(c).pop("StreamSpecification", None)), "NEW_IMAGE"),
        ("delivery", broken(drop_index("due-for-delivery")), "no index due-for-delivery"),
        ("delivery", broken(lambda c: next(g for g in tbl(c)["GlobalSecondaryIndexes"] if g["IndexName"] == "due-for-delivery").__setitem__("Projection", {"ProjectionType": "ALL"})), "projection is not KEYS_ONLY"),
        # The submitter reads the stream too: it is not the delivery function.
        ("delivery", broken(lambda c: c["Resources"][fn]["Properties"]["Events"].pop(ev_name)), "no function but the submitter reads"),
        ("delivery", broken(lambda c: ev(c).pop("DestinationConfig")), "no OnFailure"),
        ("delivery", broken(lambda c: ev(c).pop("FilterCriteria")), "no FilterCriteria"),
        # `exists` on the attribute itself (no type) never matches a stream record.
        ("delivery", broken(set_pattern({"dynamodb": {"NewImage": {"dlv_shard": [{"exists": True}], "dlv_due": [{"exists": True}]}}})), "to exist as N"),
        ("delivery", broken(set_pattern({"dynamodb": {"NewImage": {"dlv_shard": {"N": [{"exists": True}]}}}})), "dlv_due to exist"),
        ("delivery", broken(lambda c: [c["Resources"][fn]["Properties"]["Events"].pop(k) for k, e in list(c["Resources"][fn]["Properties"]["Events"].items()) if e["Type"] in ("ScheduleV2", "Schedule")]), "no schedule"),
        ("delivery", broken(only_sam_policies), "AWSLambdaDynamoDBExecutionRole"),
        ("delivery", broken(lambda c: c["Resources"][role]["Properties"].__setitem__("ManagedPolicyArns", ["arn:aws:iam::aws:policy/service-role/AWSLambdaDynamoDBExecutionRole"])), "managed policies"),
        ("delivery", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:Scan", "Resource": table_arn})), "beyond"),
        ("delivery", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:*", "Resource": table_arn})), "beyond"),
        ("delivery", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": "*"})), "on *"),
        ("delivery", broken(add_statement({"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]}})), "only the OnFailure queue"),
        ("delivery", broken(lambda c: ev(c).__setitem__("MaximumBatchingWindowInSeconds", 1)), "MaximumBatchingWindowInSeconds is 1"),
        ("delivery", broken(lambda c: c["Resources"][fn]["Properties"]["Environment"]["Variables"].pop("DELIVERY_RETRY_QUEUE_URL")), "DELIVERY_RETRY_QUEUE_URL"),
        ("delivery", broken(lambda c: [c["Resources"][fn]["Properties"]["Events"].pop(k) for k, e in list(c["Resources"][fn]["Properties"]["Events"].items()) if e["Type"] == "SQS"]), "no SQS event reads"),
        ("delivery", broken(lambda c: [e["Properties"].__setitem__("MaximumBatchingWindowInSeconds", 5) for e in c["Resources"][fn]["Properties"]["Events"].values() if e["Type"] == "SQS"]), "retry queue's MaximumBatchingWindowInSeconds"),
        ("delivery", broken(add_statement({"Effect": "Allow", "Action": "sqs:ReceiveMessage", "Resource": {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]}})), "only the retry queue"),
        ("delivery", broken(lambda c: c["Resources"].pop("DeliveryTokenDiedAlarm")), "no DeliveryTokenDiedAlarm"),
        ("delivery", broken(lambda c: c["Resources"].pop(alarm)), f"no {alarm}"),
        ("delivery", broken(lambda c: c["Resources"][alarm]["Properties"].pop("AlarmActions")), "AlarmTopic"),
        ("delivery", broken(lambda c: c["Resources"][alarm]["Properties"].__setitem__("Dimensions", [{"Name": "service", "Value": "poller"}])), "service = delivery"),
    ] + [
        ("delivery", broken(lambda c, a=a: c["Resources"][a]["Properties"].__setitem__("Dimensions", [{"Name": dim, "Value": value}])), needle)
        for a, dim, value, needle in (
            ("DeliveryStreamIteratorAgeAlarm", "FunctionName", {"Ref": "PollerFunction"}, "not the function reading the stream"),
            ("DeliveryFailuresQueueAlarm", "QueueName", {"Fn::GetAtt": ["PoisonQueue", "QueueName"]}, "not the stream's OnFailure queue"),
        )
        if "MetricName" in t["Resources"].get(a, {}).get("Properties", {})
    ] + ([] if webhook is None else [
        ("secrets", broken(drop_statements("secretsmanager:GetSecretValue")), f"{webhook} may name a Secrets Manager secret"),
        ("secrets", broken(drop_statements("secretsmanager:GetSecretValue", keep_if=True)), "is not conditional"),
        ("secrets", broken(drop_statements("ssm:GetParameter")), "no ssm:GetParameter"),
    ])


def submit_queue_cases(t, broken, failures):
    """Broken copies for the `submit-queue` check (and for `secrets` on the submitter's role)."""
    table = "TasksTable"
    res = t["Resources"]
    submitters, apis = submitter_functions(t), tasks_functions(t)
    if not (submitters and apis):
        failures.append("submit-queue: the template has no submitter or no function serving /tasks to break")
        return []
    fn, api = submitters[0], apis[0]
    role = role_of(t, res[fn])
    wake = next((e[1] for e in stream_events(t, table) if e[0] == fn), None)
    gsi = next((g for g in res[table]["Properties"].get("GlobalSecondaryIndexes", []) if g.get("IndexName") == SUBMIT_QUEUE_INDEX), None)
    if None in (role, wake, gsi) or api_queue_findings(t, api, table):
        failures.append(f"submit-queue: the template lacks the {SUBMIT_QUEUE_INDEX} index, {fn}'s role or stream event, or {api}'s Query on the index to break")
        return []
    props = lambda c, name: c["Resources"][name]["Properties"]
    env = lambda c, name: props(c, name)["Environment"]["Variables"]
    ev = lambda c: props(c, fn)["Events"][wake]["Properties"]
    statements = lambda c: props(c, role)["Policies"][0]["PolicyDocument"]["Statement"]
    api_statements = lambda c: props(c, api)["Policies"][0]["Statement"]
    index = lambda c: next(g for g in props(c, table)["GlobalSecondaryIndexes"] if g["IndexName"] == SUBMIT_QUEUE_INDEX)

    def define(attr, typ):
        return lambda c: props(c, table).__setitem__("AttributeDefinitions", [
            d for d in props(c, table)["AttributeDefinitions"] if d["AttributeName"] != attr] + ([{"AttributeName": attr, "AttributeType": typ}] if typ else []))

    def set_patterns(*patterns):
        return lambda c: ev(c).__setitem__("FilterCriteria", {"Filters": [{"Pattern": p if isinstance(p, str) else json.dumps(p)} for p in patterns]})

    def add_statement(st):
        return lambda c: statements(c).append(st)

    def drop_action(get, action):
        """Remove `action` from every statement `get` returns (a statement left with none, or an
        Fn::If naming it, goes)."""
        def f(c):
            out = []
            for st in get(c):
                if isinstance(st, dict) and "Fn::If" in st and action in json.dumps(st).lower():
                    continue
                if isinstance(st, dict) and "Action" in st:
                    st["Action"] = [a for a in listify(st["Action"]) if a.lower() != action]
                    if not st["Action"]:
                        continue
                out.append(st)
            get(c)[:] = out
        return f

    def unwrap_if(action):
        """Make the conditional grant of `action` unconditional (its true arm)."""
        return lambda c: statements(c).__setitem__(slice(None), [
            st["Fn::If"][1] if isinstance(st, dict) and "Fn::If" in st and action in json.dumps(st) else st for st in statements(c)])

    def only_sam_policies(c):
        props(c, fn).pop("Role")
        props(c, fn)["Policies"] = [{"Statement": copy.deepcopy(statements(c))}]
        c["Resources"].pop(role)

    wake_key = WAKE_PATTERN["dynamodb"]["Keys"]["pk"]["S"][0]
    table_arn = {"Fn::GetAtt": [table, "Arn"]}
    index_arn = {"Fn::Sub": f"${{{table}.Arn}}/index/{SUBMIT_QUEUE_INDEX}"}
    more = "lets through more than the wake item"
    cases = [
        ("submit-queue", broken(lambda c: props(c, table).__setitem__("GlobalSecondaryIndexes", [
            g for g in props(c, table)["GlobalSecondaryIndexes"] if g["IndexName"] != SUBMIT_QUEUE_INDEX])), f"no index {SUBMIT_QUEUE_INDEX}"),
        ("submit-queue", broken(lambda c: index(c).__setitem__("KeySchema", [
            {"AttributeName": "sq_at", "KeyType": "HASH"}, {"AttributeName": "sq_key", "KeyType": "RANGE"}])), f"index {SUBMIT_QUEUE_INDEX} keys"),
        ("submit-queue", broken(lambda c: index(c).__setitem__("Projection", {"ProjectionType": "ALL"})), "projection is not KEYS_ONLY"),
        ("submit-queue", broken(define("sq_key", "N")), "sq_key is not defined as S"),
        ("submit-queue", broken(define("sq_at", "S")), "sq_at is not defined as N"),
        ("submit-queue", broken(define("sq_at", None)), "sq_at is not defined as N"),
        ("submit-queue", broken(lambda c: c["Resources"][fn]["Metadata"]["BuildProperties"].__setitem__("Binary", "relay-other")), f"no function is built from {SUBMITTER_BINARY}"),
        ("submit-queue", broken(lambda c: props(c, fn)["Events"].pop(wake)), f"does not read {table}'s stream"),
        ("submit-queue", broken(lambda c: ev(c).pop("FilterCriteria")), "no FilterCriteria"),
        ("submit-queue", broken(set_patterns("{not json")), "not JSON"),
        ("submit-queue", broken(set_patterns({"dynamodb": {"Keys": {"pk": {"S": [{"prefix": "submitq#"}]}}}})), more),
        ("submit-queue", broken(set_patterns({"dynamodb": {"Keys": {"pk": {"S": [wake_key, "submitq#state"]}}}})), more),
        ("submit-queue", broken(set_patterns({"dynamodb": {"NewImage": {"sq_key": {"S": [{"exists": True}]}}}})), more),
        ("submit-queue", broken(set_patterns(WAKE_PATTERN, {"dynamodb": {"Keys": {"pk": {"S": [{"exists": True}]}}}})), more),
        # The API updates the wake item (MODIFY): an INSERT-only filter misses most wake-ups.
        ("submit-queue", broken(set_patterns({"eventName": ["INSERT"], **WAKE_PATTERN})), "adds conditions"),
        ("submit-queue", broken(lambda c: ev(c).__setitem__("MaximumBatchingWindowInSeconds", 1)), "MaximumBatchingWindowInSeconds is 1"),
        ("submit-queue", broken(lambda c: [props(c, fn)["Events"].pop(k) for k, e in list(props(c, fn)["Events"].items()) if e["Type"] in ("ScheduleV2", "Schedule")]), "no schedule"),
        ("submit-queue", broken(lambda c: env(c, fn).pop("CALLBACK_GRACE_SECS")), "CALLBACK_GRACE_SECS is null"),
        ("submit-queue", broken(lambda c: env(c, fn).__setitem__("CALLBACK_GRACE_SECS", "30")), 'CALLBACK_GRACE_SECS is "30"'),
        ("submit-queue", broken(only_sam_policies), "no Role of its own"),
        ("submit-queue", broken(lambda c: props(c, role).__setitem__("ManagedPolicyArns", ["arn:aws:iam::aws:policy/service-role/AWSLambdaDynamoDBExecutionRole"])), "managed policies"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:PutItem", "Resource": table_arn})), "dynamodb:putitem, beyond"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:*", "Resource": table_arn})), "dynamodb:*, beyond"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": "*"})), "on *"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*"})), "on *"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": index_arn})), f"only on {table} itself"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:UpdateItem", "Resource": {"Fn::Sub": f"${{{table}.Arn}}*"}})), f"only on {table} itself"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:Query", "Resource": table_arn})), f"only on {table}'s {SUBMIT_QUEUE_INDEX} index"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:Query", "Resource": {"Fn::Sub": f"${{{table}.Arn}}/index/due-for-delivery"}})), f"only on {table}'s {SUBMIT_QUEUE_INDEX} index"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:Scan", "Resource": {"Fn::Sub": f"${{{table}.Arn}}/index/*"}})), f"only on {table}'s {SUBMIT_QUEUE_INDEX} index"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:GetRecords", "Resource": table_arn})), f"only on {table}'s stream"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": {"Fn::GetAtt": ["PoisonQueue", "Arn"]}})), "only on its DEAD_LETTER_QUEUE_URL queue"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "logs:PutLogEvents", "Resource": {"Fn::GetAtt": ["DeliveryLogGroup", "Arn"]}})), "only on its log group"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "NotAction": "iam:*", "Resource": table_arn})), "NotAction/NotResource"),
        ("submit-queue", broken(add_statement({"Effect": "Allow", "Action": "dynamodb:GetItem", "NotResource": table_arn})), "NotAction/NotResource"),
        ("submit-queue", broken(lambda c: env(c, fn).pop("DEAD_LETTER_QUEUE_URL")), "DEAD_LETTER_QUEUE_URL does not name"),
        ("submit-queue", broken(drop_action(api_statements, "dynamodb:query")), f"{api}: no dynamodb:Query on {table}'s {SUBMIT_QUEUE_INDEX} index"),
        ("secrets", broken(drop_action(statements, "ssm:getparameter")), "no ssm:GetParameter"),
        ("secrets", broken(drop_action(statements, "secretsmanager:getsecretvalue")), "may name a Secrets Manager secret"),
        ("secrets", broken(unwrap_if("secretsmanager:GetSecretValue")), "is not conditional"),
    ]
    for var in QUEUE_VARS:
        cases += [
            ("submit-queue", broken(lambda c, var=var: env(c, fn).__setitem__(var, "1")), f"{var}: {api} sets"),
            ("submit-queue", broken(lambda c, var=var: env(c, api).pop(var, None)), f"{api}: {var} is not set"),
            ("submit-queue", broken(lambda c, var=var: env(c, fn).pop(var, None)), f"{fn}: {var} is not set"),
        ]
    for action, kind in SUBMITTER_GRANTS.items():
        if kind is not None:
            cases.append(("submit-queue", broken(drop_action(statements, action)), f"grants no {action}"))
    return cases + submit_alarm_cases(t, broken, failures, fn)


def alarm_metric(c, alarm, namespace, metric=None):
    """The metric dict (Namespace, MetricName, Dimensions) an alarm reads from `namespace`."""
    p = c["Resources"][alarm]["Properties"]
    found = [p] if p.get("MetricName") else [(m.get("MetricStat") or {}).get("Metric") or {} for m in p.get("Metrics", [])]
    return next(m for m in found if m.get("Namespace") == namespace and metric in (None, m.get("MetricName")))


def submit_alarm_cases(t, broken, failures, fn):
    cases = []
    for alarm, watches in SUBMIT_ALARMS.items():
        if alarm not in t["Resources"] or any(f.startswith(f"{alarm}:") for f in submit_alarm_findings(t, [fn])):
            failures.append(f"submit-queue: the template has no sound {alarm} to break")
            continue
        props = lambda c, alarm=alarm: c["Resources"][alarm]["Properties"]
        cases += [
            ("submit-queue", broken(lambda c, alarm=alarm: c["Resources"].pop(alarm)), f"no {alarm}"),
            ("submit-queue", broken(lambda c, alarm=alarm: props(c, alarm).pop("AlarmActions")), f"{alarm}: its AlarmActions notify no SNS topic"),
        ]
        for namespace, metric in watches:
            dim, value, needle = (("FunctionName", {"Ref": "DeliveryFunction"}, "of FunctionName") if namespace == "AWS/Lambda"
                                  else ("service", "api", "without dimension service = submitter"))
            cases += [
                ("submit-queue", broken(lambda c, a=alarm, n=namespace, m=metric: alarm_metric(c, a, n, m).__setitem__("MetricName", m + "_other")), f"{alarm}: does not watch {namespace} {metric}"),
                ("submit-queue", broken(lambda c, a=alarm, n=namespace, m=metric, d=dim, v=value: alarm_metric(c, a, n, m).__setitem__("Dimensions", [{"Name": d, "Value": v}])), f"{alarm}: {metric} {needle}"),
            ]
    for alarm, want in SUBMIT_ALARM_THRESHOLDS.items():
        if alarm in t["Resources"]:
            cases += [
                ("submit-queue", broken(lambda c, a=alarm: c["Resources"][a]["Properties"].__setitem__("Threshold", 300)), f"{alarm}: Threshold is 300"),
                ("submit-queue", broken(lambda c, a=alarm: c["Resources"][a]["Properties"].__setitem__("Threshold", {"Ref": "QueueMaxWaitSeconds"})), f"{alarm}: Threshold is"),
            ]
    return cases


OVERRIDES = {}


def main():
    OVERRIDES.update(samconfig_overrides())
    OVERRIDES.update(cli_overrides(sys.argv))
    t = load(ROOT / "template.yaml")
    # The README and the pages it links to in docs/: every setting they name must exist.
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    sources = rust_sources()
    if "--self-test" in sys.argv:
        failures = self_test(t, readme, sources)
        for f in failures:
            print(f"self-test: {f}", file=sys.stderr)
        print("template checks: self-test", "FAILED" if failures else "passed")
        return 1 if failures else 0
    findings = run_checks(t, readme, sources)
    bad = 0
    for check, items in findings.items():
        for item in items:
            bad += 1
            print(f"{check}: {item}", file=sys.stderr)
        print(f"  {check}: {'ok' if not items else f'{len(items)} finding(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
