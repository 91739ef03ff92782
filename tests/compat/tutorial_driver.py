"""Drives one of the tutorial's apps (tutorial_pattern1.py, tutorial_pattern3.py) without
changing a line of it: serves its Flask `app` on 127.0.0.1:$TUTORIAL_PORT, calls its
`submit_captcha` $TUTORIAL_TASKS times with `http://127.0.0.1:$TUTORIAL_PORT/callback` as the
pingback, and watches its own `results` and `pending_tasks` (under its own `lock`) until every
task it submitted has a result or nothing is pending (or $TUTORIAL_WAIT_SECS pass).

Prints the app's own lines, then one JSON object (the last line): the ids it submitted, its
`results`, when each first appeared there (unix seconds), what was still pending, and how many
requests its callback route received (by method and status), so the test can tell by which
path each result landed and how much of its token's life was left.
"""
import json
import logging
import os
import threading
import time


def drive(ns):
    app, submit_captcha, results, pending_tasks, lock = (
        ns["app"], ns["submit_captcha"], ns["results"], ns["pending_tasks"], ns["lock"])
    port = int(os.environ["TUTORIAL_PORT"])
    n = int(os.environ.get("TUTORIAL_TASKS", "20"))
    wait = float(os.environ.get("TUTORIAL_WAIT_SECS", "400"))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    hits = {}

    @app.after_request
    def _count(resp):  # observes the app's answers; changes none
        from flask import request
        key = f"{request.method} {resp.status_code}"
        hits[key] = hits.get(key, 0) + 1
        return resp

    server = threading.Thread(
        target=lambda: app.run(host="127.0.0.1", port=port, threaded=True, use_reloader=False), daemon=True)
    server.start()
    time.sleep(0.5)

    landed = {}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            with lock:
                for k in list(results):
                    landed.setdefault(k, time.time())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    ids = [submit_captcha("6LfD3PIbAAAAAJs_eEHvoOl75_83eXSqpPSRFJ_u", "https://shop.example/login",
                          f"http://127.0.0.1:{port}/callback") for _ in range(n)]
    print(f"submitted {len([i for i in ids if i])} of {n}", flush=True)
    deadline = time.time() + wait
    while time.time() < deadline:
        with lock:
            done = all(i in results for i in ids if i) or not pending_tasks
        if done:
            break
        time.sleep(0.2)
    time.sleep(0.2)
    stop.set()
    watcher.join()
    with lock:
        print(json.dumps({
            "submitted": ids,
            "results": dict(results),
            "landed_at": landed,
            "pending": list(pending_tasks),
            "callback_requests": hits,
        }), flush=True)
