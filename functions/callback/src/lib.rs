//! The callback function: CaptchaAI's pingback lands here, at `/callback/{ref}/{signature}`.
//!
//! What happens when a callback arrives: the path's signature is checked, the `id` and `code`
//! are read (GET query or POST form), and [`TaskStore::record_result`] applies the result with
//! one conditional write — exactly once, however often it is delivered.

use std::sync::Arc;

use tracing::Instrument;

use lambda_http::{Body, Request, Response};
use relay_shared::codes::{CodeClass, ErrorCode, classify, is_error_code};
use relay_shared::deadletter::{DeadLetter, DeadLetterSink, SqsQueue};
use relay_shared::domain::{CaptchaId, IncomingResult, Outcome, Solution, TaskRef, Via};
use relay_shared::http::{json, parse_form, path_segments, problem, query_string, with_header};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{RecordOutcome, Results, TaskStore};
use relay_shared::time::{Clock, Timestamp};

/// Largest pingback body accepted. Real ones are an id and a token of a few KiB.
pub const MAX_BODY: usize = 16 * 1024;

/// What the handler needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    /// Its one write (UpdateItem: the role's only action on the table).
    pub results: Results,
    pub signer: CallbackSigner,
    pub clock: Arc<dyn Clock>,
    /// Where a result goes when it cannot be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
    /// Results this process saw stored: repeats of them are answered without the store.
    pub recent: RecentResults,
}

/// The results this process has seen the store hold, so a repeated delivery of one is answered
/// `duplicate` without a store round trip (CaptchaAI and proxies repeat pingbacks; a repeat
/// costs a refused conditional write otherwise).
///
/// Why a hit is safe: an entry is added only after the store answered that the task holds this
/// very result (recorded, replaced, or a duplicate — whose receipt time is then at most this
/// delivery's). A later delivery of the same result was received later still, so the store would
/// write nothing for it either: the first-received rule cannot prefer it, and a result once held
/// can only be replaced by one received *earlier*. The one difference: if such a replacement
/// happened since, the store would have said `conflict` where the cache says `duplicate` — a
/// label, not a change to what is stored. Only a SHA-256 of (task, id, result) is kept, never
/// the token; the set is bounded, oldest out first.
#[derive(Clone)]
pub struct RecentResults {
    inner: Arc<std::sync::Mutex<Recent>>,
    capacity: usize,
}

#[derive(Default)]
struct Recent {
    set: std::collections::HashSet<[u8; 32]>,
    order: std::collections::VecDeque<[u8; 32]>,
}

impl std::fmt::Debug for RecentResults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentResults").field("capacity", &self.capacity).finish_non_exhaustive()
    }
}

/// The default size of [`RecentResults`] (`CALLBACK_RECENT_RESULTS`): 4,096 entries, about 300 KB.
pub const RECENT_RESULTS: usize = 4_096;

impl Default for RecentResults {
    fn default() -> Self {
        Self::new(RECENT_RESULTS)
    }
}

impl RecentResults {
    pub fn new(capacity: usize) -> Self {
        Self { inner: Arc::default(), capacity }
    }

    /// No cache: every delivery goes to the store.
    pub fn disabled() -> Self {
        Self::new(0)
    }

    fn key(task_ref: &TaskRef, d: &IncomingResult) -> [u8; 32] {
        use sha2::Digest;
        let (kind, code) = match &d.outcome {
            Outcome::Solved(s) => ("solved", s.expose()),
            Outcome::Failed(c) => ("failed", c.as_ref()),
        };
        let mut h = sha2::Sha256::new();
        for part in [task_ref.as_ref(), d.captcha_id.as_ref(), kind, code] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().into()
    }

    fn holds(&self, key: &[u8; 32]) -> bool {
        self.capacity > 0 && self.inner.lock().is_ok_and(|r| r.set.contains(key))
    }

    fn remember(&self, key: [u8; 32]) {
        if self.capacity == 0 {
            return;
        }
        if let Ok(mut r) = self.inner.lock()
            && r.set.insert(key)
        {
            r.order.push_back(key);
            while r.order.len() > self.capacity {
                if let Some(old) = r.order.pop_front() {
                    r.set.remove(&old);
                }
            }
        }
    }
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        let settings = relay_shared::config::Settings::from_env();
        let cfg = relay_shared::config::CallbackConfig::from_settings(&settings)?;
        let recent = RecentResults::new(settings.parse_or("CALLBACK_RECENT_RESULTS", RECENT_RESULTS)?);
        let aws = relay_shared::aws_config().await;
        let secret = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cfg.signing_secret)
            .await
            .context("loading the callback signing secret")?;
        Ok(Self {
            results: TaskStore::from_config(&aws, &cfg.store).results(),
            signer: CallbackSigner::new(secret),
            clock: Arc::new(relay_shared::time::SystemClock),
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), cfg.dead_letter_queue_url)),
            recent,
        })
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Params {
    id: Option<String>,
    code: Option<String>,
    /// The user agent a token was earned with, should the pingback name it (not confirmed for
    /// CaptchaAI; res.php's answer does, and the poller keeps it).
    user_agent: Option<String>,
}

/// `id` and `code` from a query string or form body: strictly decoded, each at most once.
fn fields(raw: &[u8], what: &str) -> Result<Params, Response<Body>> {
    let pairs = parse_form(raw).map_err(|e| {
        problem(400, &format!("malformed_{what}"), format!("the {what} is not valid URL encoding: {e}"))
    })?;
    let mut p = Params::default();
    for (k, v) in pairs {
        let slot = match k.as_str() {
            "id" => &mut p.id,
            "code" => &mut p.code,
            "user_agent" | "useragent" | "userAgent" => &mut p.user_agent,
            _ => continue,
        };
        if slot.replace(v).is_some() {
            return Err(problem(400, "repeated_parameter", format!("`{k}` is given more than once")));
        }
    }
    Ok(p)
}

/// Reads `id` and `code` from the query (GET) or the form body (POST).
fn read_params(req: &Request) -> Result<Params, Response<Body>> {
    let query = || fields(query_string(req).as_bytes(), "query");
    match req.method().as_str() {
        "GET" => query(),
        "POST" => {
            let body: &[u8] = req.body().as_ref();
            if body.len() > MAX_BODY {
                return Err(problem(413, "body_too_large", format!("the body is over {MAX_BODY} bytes")));
            }
            if body.is_empty() {
                // Some senders POST with the fields in the query string.
                return query();
            }
            let ctype = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
            if !ctype.to_ascii_lowercase().starts_with("application/x-www-form-urlencoded") {
                return Err(problem(
                    415,
                    "unsupported_media_type",
                    "a POST pingback must be application/x-www-form-urlencoded",
                ));
            }
            let p = fields(body, "body")?;
            // A field in the query too must say the same: which one would be the delivery?
            let q = query()?;
            let disagree = |a: &Option<String>, b: &Option<String>| a.is_some() && a != b;
            if disagree(&q.id, &p.id) || disagree(&q.code, &p.code) {
                return Err(problem(
                    400,
                    "query_and_body_disagree",
                    "the query and the body give different `id` or `code`",
                ));
            }
            Ok(p)
        }
        _ => Err(with_header(problem(405, "method_not_allowed", "use GET or POST"), "allow", "GET, POST")),
    }
}

/// Turns the pingback's fields into a delivery, or says which field is wrong.
fn read_delivery(p: Params, now: relay_shared::time::Timestamp) -> Result<IncomingResult, Response<Body>> {
    let id = p.id.filter(|v| !v.is_empty()).ok_or_else(|| problem(400, "missing_id", "the pingback has no `id`"))?;
    let code =
        p.code.filter(|v| !v.is_empty()).ok_or_else(|| problem(400, "missing_code", "the pingback has no `code`"))?;
    let captcha_id = CaptchaId::parse(&id).map_err(|e| problem(400, "invalid_id", e.0))?;
    let outcome = if is_error_code(&code) {
        if classify(&code) == CodeClass::NotReady {
            return Err(problem(422, "not_a_result", "`CAPCHA_NOT_READY` is not a result"));
        }
        Outcome::Failed(ErrorCode::parse(&code).map_err(|e| problem(400, "invalid_code", e.0))?)
    } else {
        Outcome::Solved(
            Solution::parse(&code)
                .map_err(|e| problem(400, "invalid_code", e.0))?
                .with_user_agent(p.user_agent.as_deref()),
        )
    };
    // A pingback says nothing of when the token was issued (it may have been delayed): the
    // freshness clock starts at the task's creation (the store bounds it there).
    Ok(IncomingResult {
        captcha_id,
        outcome,
        received_at: now,
        via: Via::Callback,
        token_clock_start: Timestamp::from_millis(0),
    })
}

fn outcome_label(o: &Outcome) -> String {
    match o {
        Outcome::Solved(s) => format!("solved ({})", relay_shared::telemetry::redact(s.expose())),
        Outcome::Failed(c) => format!("failed ({c})"),
    }
}

/// The Lambda entry point. Never fails: every outcome is an HTTP answer.
pub async fn handle(req: Request, deps: &Deps) -> Result<Response<Body>, lambda_http::Error> {
    Ok(respond(req, deps).await)
}

/// Handles one pingback.
pub async fn respond(req: Request, deps: &Deps) -> Response<Body> {
    let resp = handle_inner(req, deps).await.unwrap_or_else(|resp| resp);
    if !resp.status().is_success() {
        let status = resp.status().as_u16();
        let outcome = if status >= 500 { "not_stored" } else { "rejected" };
        metrics::counter!("callbacks", "outcome" => outcome).increment(1);
    }
    resp
}

async fn handle_inner(req: Request, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let segs = path_segments(&req);
    let (raw_ref, sig) = match segs.as_slice() {
        [c, r, s] if c == "callback" => (r.as_str(), s.as_str()),
        [c, _] | [c] if c == "callback" => {
            return Err(problem(403, "bad_signature", "the callback path has no signature"));
        }
        _ => return Err(problem(404, "no_route", "no such route")),
    };
    // A malformed reference cannot carry a valid signature: same answer, nothing revealed.
    let task_ref = TaskRef::parse(raw_ref).ok().filter(|r| deps.signer.verify(r, sig)).ok_or_else(|| {
        tracing::warn!(event = "callback_rejected", reason = "bad_signature", "callback with a bad signature");
        problem(403, "bad_signature", "the callback signature is not valid")
    })?;
    let delivery = read_delivery(read_params(&req)?, deps.clock.now()).inspect_err(|r| {
        tracing::warn!(event = "callback_rejected", task_ref = %task_ref, status = r.status().as_u16(), "malformed callback");
    })?;
    let span = tracing::info_span!("callback", task_ref = %task_ref, captcha_id = %delivery.captcha_id);
    async move {
        let outcome = outcome_label(&delivery.outcome);
        let key = RecentResults::key(&task_ref, &delivery);
        if deps.recent.holds(&key) {
            tracing::info!(event = "callback_duplicate", cached = true, "duplicate delivery absorbed");
            metrics::counter!("callbacks", "outcome" => "duplicate").increment(1);
            return Ok(json(200, &serde_json::json!({ "outcome": "duplicate" })));
        }
        let result = deps.results.record_result(&task_ref, &delivery).await;
        if let Ok(RecordOutcome::Recorded(_) | RecordOutcome::Duplicate(_) | RecordOutcome::Replaced(_)) = &result {
            deps.recent.remember(key);
        }
        match result {
            Ok(RecordOutcome::Recorded(_)) => {
                tracing::info!(event = "callback_recorded", outcome, "result recorded");
                metrics::counter!("callbacks", "outcome" => "recorded").increment(1);
                Ok(json(200, &serde_json::json!({ "outcome": "recorded" })))
            }
            Ok(RecordOutcome::Duplicate(_)) => {
                tracing::info!(event = "callback_duplicate", "duplicate delivery absorbed");
                metrics::counter!("callbacks", "outcome" => "duplicate").increment(1);
                Ok(json(200, &serde_json::json!({ "outcome": "duplicate" })))
            }
            Ok(RecordOutcome::Conflict(existing)) => {
                tracing::warn!(
                    event = "callback_conflict",
                    existing = existing.state.name(),
                    outcome,
                    "a different result was already recorded; the first one stays"
                );
                metrics::counter!("callbacks", "outcome" => "conflict").increment(1);
                Ok(json(200, &serde_json::json!({ "outcome": "conflict" })))
            }
            Ok(RecordOutcome::Replaced(_)) => {
                // Received before the result that was stored first (which came later but was stored
                // while this one was failing): the first received wins until the owner saw one.
                tracing::warn!(
                    event = "result_replaced",
                    via = "callback",
                    outcome,
                    "earlier-received result replaced a later one"
                );
                metrics::counter!("results_replaced", "via" => "callback").increment(1);
                metrics::counter!("callbacks", "outcome" => "recorded").increment(1);
                Ok(json(200, &serde_json::json!({ "outcome": "recorded" })))
            }
            Ok(RecordOutcome::Late(_)) => {
                // Paid for, so never dropped: kept on the expired task and shown to its owner.
                tracing::warn!(
                    event = "late_result_kept",
                    outcome,
                    "result after the task expired; kept as its late result"
                );
                metrics::counter!("callbacks", "outcome" => "late").increment(1);
                metrics::counter!("late_results_kept", "via" => "callback").increment(1);
                Ok(json(200, &serde_json::json!({ "outcome": "late" })))
            }
            Ok(RecordOutcome::IdMismatch { expected }) => {
                tracing::warn!(event = "callback_rejected", reason = "id_mismatch", %expected, "callback for another CaptchaAI id");
                Err(problem(409, "id_mismatch", "the `id` is not this task's CaptchaAI id"))
            }
            Ok(RecordOutcome::NotFound) => {
                tracing::warn!(event = "callback_rejected", reason = "unknown_task", "callback for an unknown task");
                Err(problem(404, "unknown_task", "no such task"))
            }
            Err(e) => {
                // Our failure, not the delivery's: keep the whole delivery on the dead-letter queue
                // and tell CaptchaAI it arrived. Only if that fails too does the sender hear 5xx.
                let letter = DeadLetter::new(&task_ref, &delivery, &e.to_string(), 1);
                match deps.dead_letters.send(&letter).await {
                    Ok(()) => {
                        tracing::warn!(event = "callback_dead_lettered", error = %e, "store failed; result kept as a dead letter");
                        metrics::counter!("dead_lettered").increment(1);
                        metrics::counter!("callbacks", "outcome" => "dead_lettered").increment(1);
                        Ok(json(200, &serde_json::json!({ "outcome": "dead_lettered" })))
                    }
                    Err(q) => {
                        tracing::error!(event = "callback_not_stored", store_error = %e, queue_error = %q, "store and dead-letter queue both failed; the poller will recover the result");
                        Err(problem(503, "store_unavailable", "the result could not be stored; deliver it again later"))
                    }
                }
            }
        }
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_shared::domain::{CaptchaKind, Task, TaskState};
    use relay_shared::store::SubmitRecorded;
    use relay_shared::testkit::{ApiGatewayEvent, FlakyDynamo, LocalDynamo, MemorySink};
    use relay_shared::time::{ManualClock, Timestamp};
    use secrecy::SecretString;

    struct World {
        _db: LocalDynamo,
        deps: Deps,
        /// The table the deps write to, for arranging and reading back.
        store: TaskStore,
    }

    async fn world() -> anyhow::Result<World> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let deps = Deps {
            results: store.results(),
            signer: CallbackSigner::new(SecretString::from("test-signing-secret".to_owned())),
            clock: Arc::new(ManualClock::at(Timestamp::from_millis(1_796_210_146_000))),
            dead_letters: Arc::new(MemorySink::default()),
            recent: RecentResults::default(),
        };
        Ok(World { _db: db, deps, store })
    }

    impl World {
        async fn pending_task(&self) -> anyhow::Result<TaskRef> {
            let now = self.deps.clock.now();
            let task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, now);
            self.store.tasks().create(&task, now, None).await?;
            let id = CaptchaId::parse("777")?;
            let SubmitRecorded::Pending(_) = self.store.tasks().mark_submitted(&task.task_ref, &id, now, now).await?
            else {
                anyhow::bail!("not pending")
            };
            Ok(task.task_ref)
        }

        fn path(&self, r: &TaskRef) -> String {
            format!("/callback/{r}/{}", self.deps.signer.sign(r))
        }

        async fn get(&self, path: &str, query: &str) -> Response<Body> {
            respond(ApiGatewayEvent::new("GET", path).query(query).build(), &self.deps).await
        }

        async fn post(&self, path: &str, body: &str) -> Response<Body> {
            let ev = ApiGatewayEvent::new("POST", path)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body);
            respond(ev.build(), &self.deps).await
        }

        async fn state(&self, r: &TaskRef) -> TaskState {
            self.store.tasks().get(r).await.expect("get").expect("exists").state
        }
    }

    fn text(r: &Response<Body>) -> String {
        String::from_utf8_lossy(r.body().as_ref()).into_owned()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn get_and_post_pingbacks_solve_the_task_once() -> anyhow::Result<()> {
        let w = world().await?;
        for post in [false, true] {
            let r = w.pending_task().await?;
            let path = w.path(&r);
            let first =
                if post { w.post(&path, "id=777&code=tok-A").await } else { w.get(&path, "id=777&code=tok-A").await };
            assert_eq!(first.status(), 200, "{}", text(&first));
            assert!(text(&first).contains("recorded"));
            assert!(
                matches!(w.state(&r).await, TaskState::Solved { solution, via: Via::Callback, .. } if solution.expose() == "tok-A")
            );
            let again =
                if post { w.post(&path, "id=777&code=tok-A").await } else { w.get(&path, "id=777&code=tok-A").await };
            assert_eq!((again.status().as_u16(), text(&again).contains("duplicate")), (200, true));
            let other = w.get(&path, "id=777&code=tok-B").await;
            assert_eq!((other.status().as_u16(), text(&other).contains("conflict")), (200, true));
            assert!(
                matches!(w.state(&r).await, TaskState::Solved { solution, .. } if solution.expose() == "tok-A"),
                "first result stays"
            );
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn repeats_of_a_stored_result_are_answered_without_the_store() -> anyhow::Result<()> {
        let w = world().await?;
        let (client, counter) = w._db.counting_client();
        let counted = Deps {
            results: TaskStore::new(client, w.store.table(), std::time::Duration::from_secs(60)).results(),
            ..w.deps.clone()
        };
        let (r, other) = (w.pending_task().await?, w.pending_task().await?);
        let req = |r: &TaskRef, code: &str| {
            ApiGatewayEvent::new("GET", &w.path(r)).query(&format!("id=777&code={code}")).build()
        };
        assert!(text(&respond(req(&r, "tok-A"), &counted).await).contains("recorded"));
        let writes = counter.count("UpdateItem");
        assert_eq!(writes, 1);
        for _ in 0..5 {
            let again = respond(req(&r, "tok-A"), &counted).await;
            assert_eq!((again.status().as_u16(), text(&again).contains("duplicate")), (200, true));
        }
        assert_eq!(counter.count("UpdateItem"), writes, "repeats answered from memory");
        // A different result, or the same token for another task, is not a repeat: the store decides.
        assert!(text(&respond(req(&r, "tok-B"), &counted).await).contains("conflict"));
        assert!(text(&respond(req(&other, "tok-A"), &counted).await).contains("recorded"));
        assert_eq!(counter.count("UpdateItem"), writes + 2);
        assert!(matches!(w.state(&r).await, TaskState::Solved { solution, .. } if solution.expose() == "tok-A"));
        // Off: every repeat is a refused write.
        let off = Deps { recent: RecentResults::disabled(), ..counted.clone() };
        assert!(text(&respond(req(&r, "tok-A"), &off).await).contains("duplicate"));
        assert_eq!(counter.count("UpdateItem"), writes + 3);
        Ok(())
    }

    /// Counts `callback` spans created inside another `callback` span.
    struct NestedSpans(Arc<std::sync::atomic::AtomicUsize>);

    impl<S> tracing_subscriber::Layer<S> for NestedSpans
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _id: &tracing::span::Id,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let parent = if attrs.is_contextual() {
                ctx.lookup_current().map(|s| s.name())
            } else {
                attrs.parent().and_then(|p| ctx.span(p)).map(|s| s.name())
            };
            if attrs.metadata().name() == "callback" && parent == Some("callback") {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }

    #[tokio::test]
    async fn concurrent_pingbacks_do_not_nest_their_spans() -> anyhow::Result<()> {
        // A span entered across an await stays entered on the thread while the request waits, so
        // every other request's span becomes its child: in a warm process the chain grows with
        // each request until closing it overflows the stack (found by the bench under load).
        use tracing_subscriber::layer::SubscriberExt;
        let nested = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let _guard = tracing::subscriber::set_default(
            tracing_subscriber::registry::Registry::default().with(NestedSpans(nested.clone())),
        );
        let w = Arc::new(world().await?);
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let w = w.clone();
            set.spawn(async move {
                let r = w.pending_task().await?;
                let resp = w.get(&w.path(&r), "id=777&code=tok-A").await;
                anyhow::ensure!(resp.status() == 200, "{}", text(&resp));
                anyhow::Ok(())
            });
        }
        while let Some(r) = set.join_next().await {
            r??;
        }
        assert_eq!(nested.load(std::sync::atomic::Ordering::SeqCst), 0, "a request's span leaked into another's");
        Ok(())
    }

    #[test]
    fn the_recent_results_set_is_bounded_and_keeps_no_token() {
        let recent = RecentResults::new(2);
        let d = |code: &str| IncomingResult {
            captcha_id: CaptchaId::parse("777").expect("id"),
            outcome: Outcome::Solved(Solution::parse(code).expect("token")),
            received_at: Timestamp::from_millis(1),
            via: Via::Callback,
            token_clock_start: Timestamp::from_millis(0),
        };
        let r = TaskRef::generate();
        let keys: Vec<_> = ["tok-1", "tok-2", "tok-3"].iter().map(|c| RecentResults::key(&r, &d(c))).collect();
        keys.iter().for_each(|k| recent.remember(*k));
        assert_eq!([0, 1, 2].map(|i| recent.holds(&keys[i])), [false, true, true], "oldest out first");
        assert!(!format!("{recent:?}").contains("tok-"));
        let off = RecentResults::disabled();
        off.remember(keys[0]);
        assert!(!off.holds(&keys[0]));
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn an_error_code_fails_the_task_with_that_code() -> anyhow::Result<()> {
        let w = world().await?;
        let r = w.pending_task().await?;
        let resp = w.post(&w.path(&r), "id=777&code=ERROR_CAPTCHA_UNSOLVABLE").await;
        assert_eq!(resp.status(), 200);
        assert!(
            matches!(w.state(&r).await, TaskState::Failed { code, .. } if code.as_ref() == "ERROR_CAPTCHA_UNSOLVABLE")
        );
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn forged_unknown_and_wrong_id_callbacks_write_nothing() -> anyhow::Result<()> {
        let w = world().await?;
        let r = w.pending_task().await?;
        let other = TaskRef::generate();
        let forged = [
            format!("/callback/{r}/{}", w.deps.signer.sign(&other)),
            format!("/callback/{r}/{}", "0".repeat(64)),
            format!("/callback/{r}"),
            format!("/callback/not-a-ref/{}", w.deps.signer.sign(&r)),
        ];
        for path in &forged {
            assert_eq!(w.get(path, "id=777&code=tok").await.status(), 403, "GET {path}");
            assert_eq!(w.post(path, "id=777&code=tok").await.status(), 403, "POST {path}");
        }
        assert_eq!(w.get(&w.path(&other), "id=777&code=tok").await.status(), 404, "signed but unknown");
        assert_eq!(w.post(&w.path(&other), "id=777&code=tok").await.status(), 404);
        assert_eq!(w.get(&w.path(&r), "id=778&code=tok").await.status(), 409, "wrong CaptchaAI id");
        assert_eq!(w.post(&w.path(&r), "id=778&code=tok").await.status(), 409);
        assert!(matches!(w.state(&r).await, TaskState::Pending { .. }), "still pending after all that");
        assert_eq!(w.store.tasks().get(&other).await?, None);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn malformed_callbacks_get_a_clear_4xx() -> anyhow::Result<()> {
        let w = world().await?;
        let r = w.pending_task().await?;
        let p = w.path(&r);
        let cases: Vec<(Response<Body>, u16, &str)> = vec![
            (w.get(&p, "code=tok").await, 400, "missing_id"),
            (w.get(&p, "id=777").await, 400, "missing_code"),
            (w.post(&p, "id=777").await, 400, "missing_code"),
            (w.post(&p, "code=tok").await, 400, "missing_id"),
            (w.get(&p, "id=7%207&code=tok").await, 400, "invalid_id"),
            (w.get(&p, "id=777&code=CAPCHA_NOT_READY").await, 422, "not_a_result"),
            (w.post(&p, &format!("id=777&code={}", "x".repeat(MAX_BODY))).await, 413, "body_too_large"),
            (
                respond(
                    ApiGatewayEvent::new("POST", &p)
                        .header("content-type", "application/json")
                        .body("{\"id\":1}")
                        .build(),
                    &w.deps,
                )
                .await,
                415,
                "unsupported_media_type",
            ),
            (respond(ApiGatewayEvent::new("PUT", &p).build(), &w.deps).await, 405, "method_not_allowed"),
            (w.get("/elsewhere", "").await, 404, "no_route"),
        ];
        for (resp, status, code) in cases {
            assert_eq!(resp.status().as_u16(), status, "{code}: {}", text(&resp));
            assert!(text(&resp).contains(code), "{code}: {}", text(&resp));
        }
        assert!(matches!(w.state(&r).await, TaskState::Pending { .. }));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn fifty_concurrent_pingbacks_all_get_200_and_one_write_wins() -> anyhow::Result<()> {
        let w = Arc::new(world().await?);
        for tokens in [["same", "same"], ["one", "two"]] {
            let r = w.pending_task().await?;
            let mut handles = Vec::new();
            for i in 0..50 {
                let (w, path, tok) = (w.clone(), w.path(&r), tokens[i % 2]);
                handles.push(tokio::spawn(async move {
                    let resp = if i % 3 == 0 {
                        w.post(&path, &format!("id=777&code={tok}")).await
                    } else {
                        w.get(&path, &format!("id=777&code={tok}")).await
                    };
                    (resp.status().as_u16(), text(&resp))
                }));
            }
            let mut recorded = 0;
            for h in handles {
                let (status, body) = h.await?;
                assert_eq!(status, 200, "{body}");
                recorded += usize::from(body.contains("recorded"));
            }
            assert_eq!(recorded, 1, "{tokens:?}: exactly one write");
            assert!(matches!(w.state(&r).await, TaskState::Solved { .. }));
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_store_failure_becomes_a_dead_letter_and_a_200() -> anyhow::Result<()> {
        let w = world().await?;
        let r = w.pending_task().await?;
        let flaky = FlakyDynamo::start(&w._db.endpoint).await?;
        let sink = MemorySink::default();
        let deps = Deps {
            results: flaky.store(w.store.table()).results(),
            dead_letters: Arc::new(sink.clone()),
            ..w.deps.clone()
        };
        flaky.set_failing(true);
        let resp = respond(ApiGatewayEvent::new("GET", &w.path(&r)).query("id=777&code=tok-dl").build(), &deps).await;
        assert_eq!((resp.status().as_u16(), text(&resp).contains("dead_lettered")), (200, true), "{}", text(&resp));
        assert!(flaky.calls_failed() >= 1, "the store really failed");
        let letters = sink.taken();
        assert_eq!(letters.len(), 1);
        assert_eq!(
            (letters[0].task_ref.as_str(), letters[0].captcha_id.as_str(), letters[0].code.as_str()),
            (r.as_ref(), "777", "tok-dl")
        );
        assert!(letters[0].error.contains("unavailable"), "{}", letters[0].error);
        assert!(matches!(w.state(&r).await, TaskState::Pending { .. }), "nothing written yet");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn store_and_queue_failing_together_is_a_5xx() -> anyhow::Result<()> {
        let w = world().await?;
        let r = w.pending_task().await?;
        let sink = MemorySink::default();
        sink.fail.store(true, std::sync::atomic::Ordering::SeqCst);
        // Nothing listens on port 9 of loopback: every store call fails at the transport.
        let broken = Deps {
            results: TaskStore::new(
                relay_shared::testkit::client_for("http://127.0.0.1:9"),
                "tasks",
                std::time::Duration::from_secs(60),
            )
            .results(),
            dead_letters: Arc::new(sink.clone()),
            ..w.deps.clone()
        };
        let resp = respond(ApiGatewayEvent::new("GET", &w.path(&r)).query("id=777&code=tok").build(), &broken).await;
        assert_eq!(resp.status(), 503);
        assert!(sink.taken().is_empty());
        Ok(())
    }
}
