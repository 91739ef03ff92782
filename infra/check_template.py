#!/usr/bin/env python3
"""Checks over template.yaml that a linter does not make: things that deploy but do not work.

    .venv/bin/python infra/check_template.py            # check template.yaml (exit 1 on a finding)
    .venv/bin/python infra/check_template.py --self-test # prove each check fails on a broken copy

Checks:
  alarm-topic     every alarm action's SNS topic can be published to by CloudWatch: unencrypted,
                  or encrypted with a KMS key of this template whose policy lets
                  cloudwatch.amazonaws.com Decrypt and GenerateDataKey* (never alias/aws/sns).
  sqs-visibility  a queue feeding a function has VisibilityTimeout >= 6 x the function's timeout
                  + the event source's MaximumBatchingWindowInSeconds (AWS's guidance).
  reserved        no function reserves concurrency unconditionally (new accounts cannot).
  secrets         a secret parameter that may name /aws/reference/secretsmanager/... comes with a
                  conditional secretsmanager:GetSecretValue grant in every function reading it.
  knobs           every environment variable and template parameter the README names exists:
                  variables are read somewhere in the Rust code, parameters are in the template.
  compat-routes   the 2captcha-compatible /in.php and /res.php exist on the function serving
                  /tasks, for GET and POST (Method ANY), with `Authorizer: NONE` (SDKs cannot
                  sign; the function checks the relay key); every /tasks route keeps AWS_IAM;
                  each compat route has its own throttling (stage RouteSettings, rate and burst,
                  keyed exactly by its route key); no RouteSettings key names a route that does
                  not exist (the stage would fail to deploy); the function may GetItem on the
                  table (relay keys are checked by one GetItem).
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
    return out


def check_reserved(t):
    out = []
    for name, r in t["Resources"].items():
        if r.get("Type") not in ("AWS::Serverless::Function", "AWS::Lambda::Function"):
            continue
        v = r.get("Properties", {}).get("ReservedConcurrentExecutions")
        if v is not None and not any(is_no_value(b) for b in branches(v)):
            out.append(f"{name}: ReservedConcurrentExecutions is always set; make it a parameter that can be off")
    return out


def check_secrets(t):
    out = []
    for name, r in t["Resources"].items():
        if r.get("Type") != "AWS::Serverless::Function":
            continue
        env = r.get("Properties", {}).get("Environment", {}).get("Variables", {})
        text = json.dumps(r.get("Properties", {}).get("Policies", []))
        for var, v in env.items():
            if not var.endswith("_PARAM"):
                continue
            param = ref_target(v)
            desc = t["Parameters"].get(param, {}).get("Description", "")
            if "secretsmanager" not in desc:
                continue
            if "secretsmanager:GetSecretValue" not in text or param not in text.split("GetSecretValue", 1)[1]:
                out.append(f"{name}: {param} may name a Secrets Manager secret but no GetSecretValue grant names it")
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
        ("reserved", broken(lambda c: c["Resources"][poller]["Properties"].__setitem__("ReservedConcurrentExecutions", 2))),
        ("secrets", broken(lambda c: c["Resources"][poller]["Properties"].__setitem__("Policies", [{"Statement": []}]))),
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
    for check, tpl, *needle in cases:
        found = run_checks(tpl, readme, sources)[check]
        if not found:
            failures.append(f"{check}: did not fail on a broken template")
        elif needle and not any(needle[0] in f for f in found):
            failures.append(f"{check}: failed on a broken template, but not with `{needle[0]}`: {found}")
    if not run_checks(t, readme + "\nset `NO_SUCH_SETTING` and `NoSuchParameterSeconds`\n", sources)["knobs"]:
        failures.append("knobs: did not fail on an unknown setting")
    return failures


def main():
    t = load(ROOT / "template.yaml")
    readme = (ROOT / "README.md").read_text()
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
