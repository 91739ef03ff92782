"""The seed app: "Muster 3: Idempotenter Callback-Handler" of the callback tutorial, as written.

Flask, results in an in-memory dict guarded by one lock, "OK" for every delivery. Nothing is
durable: a restart forgets every result (the tutorial says so itself). The bench runs it twice:

    python seed_callback.py PORT          # Flask's development server, app.run(threaded=True)
    gunicorn -w N seed_callback:app       # the same app under gunicorn
"""

import sys
import threading

from flask import Flask, request

app = Flask(__name__)

# Track task state (as in the tutorial: task_id -> info, task_id -> solution).
pending_tasks = {}
results = {}
lock = threading.Lock()


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


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    # How the tutorial's reader runs it: Flask's built-in server, a thread per request.
    app.run(host="127.0.0.1", port=port, threaded=True)
