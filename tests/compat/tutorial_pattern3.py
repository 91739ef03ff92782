"""The tutorial's Pattern 3 idempotent handler, in its Pattern 1 app (../shared/seed/, "Muster 1: Callback mit Fallback-Polling",
Python), as printed with one change: the host. `https://ocr.captchaai.com` is now the relay
(RELAY_SERVER, as the SDKs take it); CAPTCHAAI_API_KEY holds a relay key. Pattern 3's route takes
the result as CaptchaAI sends it (`GET /callback?id=…&code=…`); its fallback poller asks res.php
for tasks still pending after 120 s, every 30 s. Driven by tutorial_driver.py (local/tests/
tutorial.rs runs it against `relay-local`).
"""
import os as _os

RELAY_HOST = _os.environ["RELAY_SERVER"]

# ---- the tutorial's Pattern 1 (Python), as printed; the one change: the host -----------------
# Its callback route is left out: Pattern 3's idempotent handler (below) takes /callback instead.
import os
import time
import threading
import requests
from flask import Flask, request

app = Flask(__name__)
API_KEY = os.environ["CAPTCHAAI_API_KEY"]

# Track task state
pending_tasks = {}  # task_id -> {"submitted_at": timestamp, "status": "pending"}
results = {}
lock = threading.Lock()


def submit_captcha(sitekey, pageurl, callback_url):
    """Submit with callback, but track for fallback polling."""
    resp = requests.post("https://" + RELAY_HOST + "/in.php", data={
        "key": API_KEY,
        "method": "userrecaptcha",
        "googlekey": sitekey,
        "pageurl": pageurl,
        "pingback": callback_url,
        "json": 1
    })
    data = resp.json()

    if data.get("status") == 1:
        task_id = data["request"]
        with lock:
            pending_tasks[task_id] = {
                "submitted_at": time.time(),
                "status": "pending"
            }
        return task_id
    return None


def fallback_poller():
    """Poll for any tasks that missed their callback."""
    while True:
        time.sleep(30)  # Check every 30 seconds

        with lock:
            stale_tasks = [
                tid for tid, info in pending_tasks.items()
                if time.time() - info["submitted_at"] > 120  # 2 min callback timeout
                and info["status"] == "pending"
            ]

        for task_id in stale_tasks:
            resp = requests.get("https://" + RELAY_HOST + "/res.php", params={
                "key": API_KEY,
                "action": "get",
                "id": task_id,
                "json": 1
            })
            data = resp.json()

            if data.get("status") == 1:
                with lock:
                    results[task_id] = data["request"]
                    pending_tasks.pop(task_id, None)
                print(f"Fallback poll recovered: {task_id}")
            elif data.get("request") != "CAPCHA_NOT_READY":
                # Permanent error — remove from pending
                with lock:
                    pending_tasks.pop(task_id, None)
                print(f"Task failed: {task_id} — {data.get('request')}")


# Start fallback poller in background
poller_thread = threading.Thread(target=fallback_poller, daemon=True)
poller_thread.start()


# ---- the tutorial's Pattern 3 ("Muster 3: Idempotenter Callback-Handler"), as printed ----------
@app.route("/callback")
def idempotent_callback():
    task_id = request.args.get("id")
    solution = request.args.get("code")

    with lock:
        # Only process if not already handled
        if task_id in results:
            return "OK", 200  # Already processed — skip silently

        results[task_id] = solution
        pending_tasks.pop(task_id, None)

    return "OK", 200

# ---- the driver (not the tutorial's) ------------------------------------------------------------
if __name__ == "__main__":
    from tutorial_driver import drive

    drive(globals())
