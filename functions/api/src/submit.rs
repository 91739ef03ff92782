//! The submit path both fronts share (`POST /tasks` and the 2captcha-compatible `in.php`): a
//! permit or the queue, the pace, one conditional put, in.php once, the id never lost.

mod bookkeeping;
mod outcome;
mod queue;

pub(crate) use outcome::{SubmitInput, Submitted};

use lambda_http::Request;
use relay_shared::captchaai::CaptchaAiError;
use relay_shared::domain::Task;
use relay_shared::store::{Created, Permit, SubmitState};
use relay_shared::submit::{InPhp, Recorder, lanes::lane_id};
use tracing::Instrument;

use crate::deps::Deps;
use bookkeeping::{deadline_after, give_back_permit, refused};
use outcome::{key_rejected, replayed};
use queue::{enqueue, queue_unsent};

/// Why a submit waits in the queue instead of going to in.php now.
enum HeldBack {
    /// Others were just seen waiting: a permit would be refused, so none is asked for.
    OthersWaiting,
    /// The permit write was refused; the account's state item as it was says why.
    Refused(Box<SubmitState>),
}

/// The submit itself: a permit (or the queue), the pace, one conditional put, in.php once, then
/// the id stored or dead-lettered, or the task queued after an explicit refusal for now.
pub(crate) async fn submit_task(req: &Request, deps: &Deps, input: SubmitInput) -> Submitted {
    let SubmitInput { submit, fingerprint, keyed, task_ref, owner_callback, webhook_owner, pingback_form, owner } =
        input;
    let kind = submit.kind();
    let now = deps.clock.now();
    let lane = lane_id(&owner, kind);
    let span = tracing::info_span!("submit", task_ref = %task_ref, kind = %kind, idempotent = keyed);
    async move {
        let Some(base) = callback_base(req, deps) else {
            tracing::error!(event = "config_error", "no CALLBACK_BASE_URL and no API domain in the request");
            return Submitted::Misconfigured;
        };
        let pingback = deps.signer.callback_url(&base, &task_ref);
        let fp = keyed.then_some(fingerprint.as_str());
        let initial = deps.queue.window.threads.unwrap_or(deps.queue.window.initial);
        // One write: a permit to send it now, or the state that says why not — unless others
        // were just seen waiting, when the permit would be refused (queued at once).
        let held = if deps.admission.queue_waiting(now) {
            Some(HeldBack::OthersWaiting)
        } else {
            match deps.store.queue.take_permit(now, initial).await {
                Ok(Permit::Taken) => None,
                Ok(Permit::Refused(state)) => {
                    deps.admission.saw(&state, now);
                    Some(HeldBack::Refused(state))
                }
                Err(e) => return Submitted::Store(e),
            }
        };
        if let Some(held) = held {
            let state = match held {
                HeldBack::OthersWaiting => None,
                HeldBack::Refused(state) => Some(*state),
            };
            if let Some(open) = state.as_ref().and_then(|st| key_rejected(st, now)) {
                return open;
            }
            let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::queued(task_ref, kind, now, lane) };
            return enqueue(deps, task, &submit, &pingback, fp, &fingerprint, state).await;
        }
        // Paced account-wide, so a burst of submits never earns MAX_USER_TURN; over the pace,
        // the task waits in the queue instead.
        match deps.store.account.take_submit_slot(now, deps.queue.submits_per_second).await {
            Ok(true) => {}
            Ok(false) => {
                give_back_permit(deps).await;
                let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::queued(task_ref, kind, now, lane) };
                return enqueue(deps, task, &submit, &pingback, fp, &fingerprint, None).await;
            }
            Err(e) => {
                give_back_permit(deps).await;
                return Submitted::Store(e);
            }
        }
        let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::new(task_ref.clone(), kind, now) };
        // Recorded before in.php hears of it, with what a second in.php needs: if in.php's
        // answer is never stored, the poller looks at the task at this deadline (and sends it
        // again, once, or expires it).
        let grace = deps.callback_grace.for_kind(kind);
        let deadline = now.plus(deadline_after(deps, kind));
        match deps.store.tasks.create_sendable(&task, deadline, fp, Some((&submit, &pingback))).await {
            Ok(Created::New) => {}
            Ok(Created::Existing { task, fingerprint: stored }) => {
                give_back_permit(deps).await;
                return replayed(deps, task, stored, fingerprint).await;
            }
            Err(e) => {
                give_back_permit(deps).await;
                return Submitted::Store(e);
            }
        }
        let recorder = Recorder { tasks: &deps.store.tasks, dead_letters: deps.dead_letters.as_ref(), clock: deps.clock.as_ref() };
        match InPhp::of(deps.captchaai.submit(&submit, &pingback).await) {
            InPhp::Accepted(id) => Submitted::Accepted(recorder.accepted(&task, &id, grace).await),
            InPhp::Unknown(err) => Submitted::Accepted(recorder.unknown(&task, &err).await),
            InPhp::NoSlot(code) => {
                tracing::info!(event = "submit_no_slot", code = %code, "no free CaptchaAI thread: queued");
                metrics::counter!("submit_no_slot", "path" => "inline").increment(1);
                queue_unsent(deps, task, &submit, &pingback, lane, true, keyed).await
            }
            InPhp::Banned(code, b) => {
                // A ban is never retried here: that would extend it.
                let at = deps.clock.now();
                let until = at.plus(b.duration);
                let stop = relay_shared::store::Stop::Ban { needs_operator: b.needs_operator };
                if let Err(e) = deps.store.account.open_breaker(until, &code, stop, at).await {
                    tracing::error!(event = "breaker_store_failed", error = %e);
                }
                metrics::counter!("breaker_opened", "reason" => if b.needs_operator { "key_rejected" } else { "ban" })
                    .increment(1);
                tracing::warn!(event = "breaker_opened", code = %code, until = %until, "in.php answered a ban; CaptchaAI traffic stopped");
                if b.needs_operator {
                    let err = CaptchaAiError::Code(relay_shared::codes::ErrorCode::parse(&code).unwrap_or_else(|_| {
                        relay_shared::codes::ErrorCode::parse("ERROR_WRONG_USER_KEY").expect("a valid code")
                    }));
                    refused(deps, &task_ref, &err, keyed).await;
                    return Submitted::Banned { code, until, duration: b.duration };
                }
                // A ban ends by itself: the task waits in the queue for it.
                queue_unsent(deps, task, &submit, &pingback, lane, false, keyed).await
            }
            InPhp::Transient(err) => {
                tracing::warn!(event = "submit_transient", error = %err, "in.php refused for now: queued");
                queue_unsent(deps, task, &submit, &pingback, lane, false, keyed).await
            }
            InPhp::Refused(err) => {
                refused(deps, &task_ref, &err, keyed).await;
                metrics::counter!("submits", "outcome" => "refused").increment(1);
                Submitted::Refused {
                    code: err.code(),
                    class: err.class(),
                    message: format!("in.php refused the task: {err}"),
                    task_ref,
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// The configured callback base, or this API's own URL as API Gateway reports it.
fn callback_base(req: &Request, deps: &Deps) -> Option<String> {
    use lambda_http::RequestExt;
    use lambda_http::request::RequestContext;
    if let Some(b) = &deps.callback_base_url {
        return Some(b.clone());
    }
    match req.request_context_ref() {
        Some(RequestContext::ApiGatewayV2(ctx)) => {
            let domain = ctx.domain_name.as_deref()?;
            match ctx.stage.as_deref() {
                None | Some("$default") => Some(format!("https://{domain}")),
                Some(stage) => Some(format!("https://{domain}/{stage}")),
            }
        }
        _ => None,
    }
}
