"""The official 2captcha Python client (2captcha-python, pinned in infra/requirements-sdk.txt),
unmodified, against the relay: the only change from code written for 2captcha or CaptchaAI is
`server=`. Driven by local/tests/it/sdk.rs, which checks every answer against the fake CaptchaAI.

Environment: RELAY_SERVER (host:port of the relay's TLS port), RELAY_KEY (a relay key),
RELAY_IMAGE (an image file), REQUESTS_CA_BUNDLE (the relay's local CA). Prints one JSON object.
"""
import base64
import concurrent.futures
import json
import os
import sys

from twocaptcha import TwoCaptcha
from twocaptcha.api import ApiException

SERVER = os.environ["RELAY_SERVER"]
KEY = os.environ["RELAY_KEY"]
IMAGE = os.environ["RELAY_IMAGE"]
PAGE = "https://shop.example/login"
# The user agent an Enterprise token is to be used with: sent, and handed back beside the token.
UA = "Mozilla/5.0 (X11; Linux x86_64) relay-sdk-test/1.0"

# The one line that changes: the SDK's own defaults otherwise (poll every 10 s, give up after
# 120 s, 600 s for reCAPTCHA).
solver = TwoCaptcha(KEY, server=SERVER)
extended = TwoCaptcha(KEY, server=SERVER, extendedResponse=True)

with open(IMAGE, "rb") as f:
    IMAGE_B64 = base64.b64encode(f.read()).decode()

JOBS = {
    "recaptcha_v2": lambda: solver.recaptcha(sitekey="6LfD3PIbAAAAAJs_eEHvoOl75_83eXSqpPSRFJ_u", url=PAGE),
    "recaptcha_v2_invisible": lambda: solver.recaptcha(sitekey="6LdO5_IbAAAAAAeVBL9TClS19NUTt5wswEb3Q7C5", url=PAGE, invisible=1),
    "recaptcha_v3": lambda: solver.recaptcha(sitekey="6LfB5_IbAAAAAMCtsjEHEHKqcB9iQocwwxTiihJu", url=PAGE, version="v3", action="verify", score=0.7),
    "recaptcha_enterprise": lambda: solver.recaptcha(sitekey="6Lf26sUnAAAAAIKLuWNYgRsFUfmI-3Lex3xT5N-s", url=PAGE, enterprise=1),
    "recaptcha_enterprise_extended": lambda: extended.recaptcha(sitekey="6Lf26sUnAAAAAIKLuWNYgRsFUfmI-3Lex3xT5N-s", url=PAGE, enterprise=1, userAgent=UA),
    "geetest": lambda: solver.geetest(gt="81388ea1fc187e0c335c0a8907ff2625", challenge="2e2f0f65240058b683cb6ea21c303eea", url=PAGE, apiServer="api.geetest.com"),
    "turnstile_1": lambda: solver.turnstile(sitekey="0x4AAAAAAAVrOwQWPlm3Bnr5", url=PAGE),
    "turnstile_2": lambda: solver.turnstile(sitekey="0x4AAAAAAAVrOwQWPlm3Bnr5", url=PAGE, action="login"),
    "turnstile_extended": lambda: extended.turnstile(sitekey="0x4AAAAAAAVrOwQWPlm3Bnr5", url=PAGE),
    "image_file": lambda: solver.normal(IMAGE),
    "image_file_hints": lambda: solver.normal(IMAGE, numeric=1, minLen=4, maxLen=6),
    "image_base64": lambda: solver.normal(IMAGE_B64),
}

out = {"solved": {}, "errors": {}}
with concurrent.futures.ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
    futures = {pool.submit(job): name for name, job in JOBS.items()}
    for fut in concurrent.futures.as_completed(futures):
        name = futures[fut]
        try:
            r = fut.result()
            out["solved"][name] = {"id": r["captchaId"], "code": r["code"]}
            if "user_agent" in r:  # extendedResponse passes the answer's other keys through
                out["solved"][name]["user_agent"] = r["user_agent"]
        except Exception as e:  # reported, and the Rust test fails on any
            out["errors"][name] = f"{type(e).__name__}: {e}"

out["balance"] = solver.balance()
some = out["solved"].get("turnstile_1") or next(iter(out["solved"].values()), None)
if some:
    out["report_good"] = solver.report(some["id"], True)
    out["report_bad"] = solver.report(some["id"], False)

# A wrong key gets the SDK's own exceptions, with 2captcha's codes.
for name, key in {"wrong_key": "not-a-relay-key", "unknown_key": "ffffffffffffffffffffffffffffffff"}.items():
    try:
        TwoCaptcha(key, server=SERVER).turnstile(sitekey="0x4AAAAAAAVrOwQWPlm3Bnr5", url=PAGE)
        out[name] = "no exception"
    except ApiException as e:
        out[name] = f"ApiException: {e}"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"

json.dump(out, sys.stdout)
