//! The owner's API: `POST /tasks` submits a captcha, `GET /tasks/{ref}` reads it back.
//!
//! Every valid task is accepted (202): sent to in.php at once while CaptchaAI has a free thread
//! for it, queued otherwise and released by the submitter as threads free (see
//! [`relay_shared::submit`]). Every in.php call CaptchaAI accepts is money spent, so a submit:
//! - is idempotent with an `Idempotency-Key` header: the key (with the caller) names the task's
//!   reference, and creating the task is one conditional put — the same key and body return the
//!   same task without a second in.php call, a different body is a 422;
//! - goes inline only with a *permit* (one conditional write on the account's state item: the
//!   breaker lets submits through, nobody is queued, and the submitter's window has room) and a
//!   slot of the account-wide in.php pace; otherwise it is queued, within the queue's bounds;
//! - records the task before in.php hears of it (so a pingback that outruns the answer finds it);
//! - sends it once: an explicit refusal for now (no free thread, a ban, a server error code)
//!   puts it in the queue instead of a retry here; any answer that does not prove a refusal — a
//!   timeout, a cut connection, a 5xx, an HTML page — leaves the task `submitting` with
//!   "outcome unknown", never called failed (its pingback will say) and sent again at most once,
//!   by the poller, when its result is overdue (on CaptchaAI only, which bills threads);
//! - never loses CaptchaAI's id: storing it is retried, and if that keeps failing it goes to
//!   the dead-letter queue for the redrive function to store.

pub mod compat;
mod compat_state;
mod deps;
mod errors;
mod pin;
mod request;
mod submit;
mod tasks;

pub use deps::{Deps, Store};
pub use relay_shared::submit::SUBMITS_PER_SECOND;
pub use request::{MAX_BODY, MAX_IDEMPOTENCY_KEY};

use lambda_http::{Body, Request, Response};
use relay_shared::http::{path_segments, problem, with_header};

/// The Lambda entry point. Never fails: every outcome is an HTTP answer.
pub async fn handle(req: Request, deps: &Deps) -> Result<Response<Body>, lambda_http::Error> {
    Ok(respond(req, deps).await)
}

/// Routes and answers one request.
pub async fn respond(req: Request, deps: &Deps) -> Response<Body> {
    let segs = path_segments(&req);
    // The 2captcha-compatible front checks its own keys (SDKs cannot sign SigV4).
    match segs.as_slice() {
        [p] if p == "in.php" => return compat::in_php(&req, deps).await,
        [p] if p == "res.php" => return compat::res_php(&req, deps).await,
        _ => {}
    }
    let route = match segs.as_slice() {
        [t] if t == "tasks" => Route::Tasks,
        [t, r] if t == "tasks" => Route::Task(r.clone()),
        _ => return problem(404, "no_route", "no such route"),
    };
    if let Err(denied) = deps.auth.check(&req) {
        return *denied;
    }
    match (route, req.method().as_str()) {
        (Route::Tasks, "POST") => tasks::submit(&req, deps).await.unwrap_or_else(|r| r),
        (Route::Task(r), "GET") => tasks::get_task(&r, deps).await.unwrap_or_else(|r| r),
        (Route::Tasks, _) => with_header(problem(405, "method_not_allowed", "use POST"), "allow", "POST"),
        (Route::Task(_), _) => with_header(problem(405, "method_not_allowed", "use GET"), "allow", "GET"),
    }
}

enum Route {
    Tasks,
    Task(String),
}

#[cfg(test)]
mod tests;
