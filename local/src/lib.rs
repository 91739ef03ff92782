//! The relay on one machine: a thin HTTP server that turns each request into the very
//! `lambda_http::Request` API Gateway would deliver and hands it to the same handler functions
//! the Lambdas run. Routes are API Gateway's: `/tasks`, `/tasks/{ref}`, `/callback/{ref}/{sig}`.

pub mod data_dir;
pub mod demo;
pub mod ops;
pub mod queue;
pub mod retention;
pub mod run;
pub mod tls;

use std::sync::Arc;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::State;
use axum::response::Response as AxumResponse;
use lambda_http::Body;

/// Largest request body the local server reads (API Gateway's own limit is 10 MB; the handlers
/// enforce their smaller limits themselves).
const MAX_REQUEST: usize = 1024 * 1024;

/// The handlers' dependencies.
#[derive(Debug, Clone)]
pub struct Relay {
    /// The one table, whose handles every component holds.
    pub store: relay_shared::store::TaskStore,
    pub api: relay_api::Deps,
    pub callback: relay_callback::Deps,
    /// Notified when the API queues a task: wakes the submitter ([`Relay::submitter`]).
    pub submit_wake: Arc<tokio::sync::Notify>,
}

/// What a relay on one machine is made of; everything else takes the Lambda defaults.
pub struct LocalParts {
    pub store: relay_shared::store::TaskStore,
    pub captchaai: relay_shared::captchaai::CaptchaAiClient,
    /// Bearer key for `/tasks` (there is no IAM locally).
    pub api_key: secrecy::SecretString,
    pub signing_secret: secrecy::SecretString,
    /// Where CaptchaAI reaches this relay's `/callback/…`.
    pub callback_base_url: String,
    pub clock: Arc<dyn relay_shared::time::Clock>,
    /// Where results that cannot be stored go.
    pub dead_letters: Arc<dyn relay_shared::deadletter::DeadLetterSink>,
    /// Which owner callback URLs tasks may carry.
    pub delivery_policy: relay_shared::webhook::UrlPolicy,
}

impl Relay {
    pub fn new(p: LocalParts) -> Self {
        let idempotency = relay_shared::idempotency::IdempotencyKeys::new(p.signing_secret.clone());
        let signer = relay_shared::signing::CallbackSigner::new(p.signing_secret);
        let submit_wake = Arc::new(tokio::sync::Notify::new());
        // Every result recorded frees a CaptchaAI thread: the submitter hears of it at once.
        let store = p.store.with_result_notifier(submit_wake.clone());
        Self {
            submit_wake: submit_wake.clone(),
            api: relay_api::Deps {
                store: relay_api::Store::new(&store),
                captchaai: p.captchaai,
                signer: signer.clone(),
                idempotency,
                auth: relay_shared::http::Authorizer::api_key(&p.api_key),
                clock: p.clock.clone(),
                callback_base_url: Some(p.callback_base_url),
                callback_grace: relay_shared::config::CallbackGrace::default(),
                dead_letters: p.dead_letters.clone(),
                queue: relay_shared::submit::QueueSettings::default(),
                waker: Arc::new(relay_shared::submit::NotifyWaker(submit_wake)),
                // Local mode's API key is also a relay key for the 2captcha-compatible routes,
                // beside any made with the operator command.
                relay_keys: relay_shared::store::RelayKeys::new(Some(store.clone()))
                    .with_fixed("local".into(), &p.api_key),
                compat: relay_api::compat::CompatState::default(),
                admission: Default::default(),
                delivery_policy: p.delivery_policy,
            },
            callback: relay_callback::Deps {
                results: store.results(),
                signer,
                clock: p.clock,
                dead_letters: p.dead_letters,
                recent: relay_callback::RecentResults::default(),
            },
            store,
        }
    }
}

impl Relay {
    /// The submitter of this relay: the API's CaptchaAI account, queue settings and grace; run
    /// it with [`relay_submitter::serve_local`] and [`Relay::submit_wake`].
    pub fn submitter(&self, owner: &str) -> relay_submitter::Deps {
        relay_submitter::Deps {
            store: relay_submitter::Store::new(&self.store),
            captchaai: self.api.captchaai.clone(),
            dead_letters: self.api.dead_letters.clone(),
            grace: self.api.callback_grace.clone(),
            settings: relay_submitter::SubmitterSettings::for_queue(self.api.queue.clone()),
            owner: owner.to_owned(),
            waker: self.api.waker.clone(),
        }
    }
}

/// The routes, as API Gateway serves them.
pub fn router(relay: Arc<Relay>) -> Router {
    Router::new().route("/health", axum::routing::get(|| async { "ok" })).fallback(dispatch).with_state(relay)
}

async fn dispatch(State(relay): State<Arc<Relay>>, req: http::Request<AxumBody>) -> AxumResponse {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_REQUEST).await {
        Ok(b) => b,
        Err(_) => return into_axum(relay_shared::http::problem(413, "body_too_large", "request body too large")),
    };
    let body = if bytes.is_empty() { Body::Empty } else { Body::Binary(bytes.to_vec()) };
    let lambda_req = lambda_http::Request::from_parts(parts, body);
    let first = lambda_req.uri().path().split('/').find(|s| !s.is_empty()).unwrap_or("");
    let resp = match first {
        "callback" => relay_callback::respond(lambda_req, &relay.callback).await,
        _ => relay_api::respond(lambda_req, &relay.api).await,
    };
    into_axum(resp)
}

fn into_axum(resp: http::Response<Body>) -> AxumResponse {
    let (parts, body) = resp.into_parts();
    let bytes: Vec<u8> = match body {
        Body::Empty => Vec::new(),
        Body::Text(t) => t.into_bytes(),
        Body::Binary(b) => b,
        _ => Vec::new(),
    };
    AxumResponse::from_parts(parts, AxumBody::from(bytes))
}

/// Serves the relay on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    relay: Arc<Relay>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(relay)).with_graceful_shutdown(shutdown).await
}
