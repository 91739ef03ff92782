//! Fuzzing (proptest-based: cargo-fuzz needs a nightly compiler, which this toolchain is not) of
//! everything that parses outside input: in.php/res.php answers, dead-letter messages, the
//! submit body, the callback request (path, query, form body, headers, method), and the local
//! config file. Inputs are the seed corpus in `tests/fuzz/corpus/<target>/`, mutations of it, and
//! arbitrary text. Nothing may panic; bad input never gets a 5xx.
//!
//! The test command runs a few thousand inputs per target; the documented run a million:
//!
//!   FUZZ_CASES=1000000 cargo test --release -p relay-fuzz --test it fuzz:: -- --test-threads 1

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use proptest::prelude::*;
use relay_fuzz::{config, inputs, rt};
use relay_shared::captchaai::{RawAnswer, parse_answer, split_batch};
use relay_shared::deadletter::DeadLetter;
use relay_shared::domain::{CaptchaId, CaptchaKind, Task, TaskRef};
use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo, MemorySink};
use relay_shared::time::{ManualClock, Timestamp};
use secrecy::SecretString;

proptest! {
    #![proptest_config(config("answers", 20_000))]

    #[test]
    fn answers_of_in_php_and_res_php_parse_without_panicking(body in inputs("answers"), status in prop::sample::select(vec![200u16, 403, 500, 502, 520])) {
        match parse_answer(status, &body) {
            Ok(RawAnswer::Ok(text)) => {
                // An HTML page is never taken for an answer, nor is an HTTP error without a
                // protocol body.
                prop_assert!(!body.trim_start().starts_with('<'), "HTML read as OK: {body:?}");
                let ids = text.split('|').count();
                let _ = split_batch(RawAnswer::Ok(text), ids);
            }
            Ok(RawAnswer::Code(c)) => prop_assert!(!c.is_empty()),
            Err(e) => prop_assert!(e.outcome_unknown() || matches!(e, relay_shared::captchaai::CaptchaAiError::Code(_))),
        }
        for n in [1usize, 2, 100] {
            let _ = split_batch(RawAnswer::Ok(body.clone()), n);
        }
    }
}

proptest! {
    #![proptest_config(config("dead_letters", 20_000))]

    #[test]
    fn dead_letters_parse_or_are_refused_and_round_trip(body in inputs("dead_letters")) {
        if let Ok(letter) = DeadLetter::parse(&body) {
            let again = DeadLetter::parse(&letter.to_json());
            prop_assert_eq!(again.as_ref().ok(), Some(&letter), "a parsed letter round-trips");
            prop_assert!(letter.letter(relay_shared::domain::Via::Redrive).is_ok());
        }
    }
}

proptest! {
    #![proptest_config(config("local_config", 5_000))]

    #[test]
    fn the_local_config_file_loads_or_says_why(file in inputs("local_config"), bind in inputs("local_env")) {
        let dir = std::env::temp_dir().join(format!("relay-fuzz-config-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("relay.json");
        prop_assert!(std::fs::write(&path, &file).is_ok());
        let env = |k: &str| (k == "RELAY_BIND").then(|| bind.clone());
        match relay_local::run::LocalConfig::load(Some(&path), &env) {
            Ok(c) => prop_assert!(c.bind.parse::<std::net::SocketAddr>().is_ok()),
            Err(e) => {
                let said = format!("{e:#}");
                prop_assert!(!said.is_empty());
            }
        }
    }
}

/// The API handler with a store, the fake, and every limit out of the way.
struct ApiWorld {
    _db: LocalDynamo,
    _fake: fake_captchaai::FakeCaptchaAi,
    deps: relay_api::Deps,
}

fn api() -> &'static ApiWorld {
    static W: OnceLock<ApiWorld> = OnceLock::new();
    W.get_or_init(|| {
        rt().block_on(async {
            let db = LocalDynamo::start().await.unwrap_or_else(|e| panic!("{e}"));
            let fake = fake_captchaai::FakeCaptchaAi::start(fake_captchaai::FakeConfig {
                solve_delay_ms: 3_600_000,
                enforce_bans: false,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let deps = relay_api::Deps {
                store: relay_api::Store::new(&db.fresh_store().await.unwrap_or_else(|e| panic!("{e}"))),
                captchaai: relay_shared::captchaai::CaptchaAiClient::new(
                    &fake.base_url(),
                    SecretString::from(fake.api_key()),
                    Duration::from_secs(5),
                    None,
                )
                .unwrap_or_else(|e| panic!("{e}")),
                signer: relay_shared::signing::CallbackSigner::new(SecretString::from(
                    "fuzz-signing-secret".to_owned(),
                )),
                idempotency: relay_shared::idempotency::IdempotencyKeys::new(SecretString::from(
                    "fuzz-signing-secret".to_owned(),
                )),
                auth: relay_shared::http::Authorizer::api_key(&SecretString::from("fuzz-api-key".to_owned())),
                clock: Arc::new(ManualClock::at(Timestamp::from_millis(1_796_210_146_000))),
                callback_base_url: Some("http://127.0.0.1:9".into()),
                callback_grace: Default::default(),
                dead_letters: Arc::new(MemorySink::default()),
                // No pace and a plan no burst fills: every submit is sent inline.
                queue: relay_shared::submit::QueueSettings {
                    submits_per_second: 1_000_000,
                    window: relay_shared::submit::window::WindowSettings {
                        threads: Some(1_000_000),
                        ..Default::default()
                    },
                    ..Default::default()
                },
                waker: Arc::new(relay_shared::submit::NotifyWaker::default()),
                relay_keys: relay_shared::store::RelayKeys::new(None)
                    .with_fixed("fuzz".into(), &SecretString::from(COMPAT_KEY.to_owned())),
                compat: relay_api::compat::CompatState::default(),
                admission: Default::default(),
                delivery_policy: relay_shared::webhook::UrlPolicy::PublicHttps,
            };
            ApiWorld { _db: db, _fake: fake, deps }
        })
    })
}

proptest! {
    #![proptest_config(config("submit_body", 3_000))]

    #[test]
    fn any_submit_body_gets_a_clear_answer_never_a_5xx(
        body in inputs("submit_body"),
        ctype in prop::sample::select(vec!["application/json", "application/json; charset=utf-8", "text/plain", ""]),
        key in prop::option::of(inputs("idempotency_key")),
    ) {
        let w = api();
        let mut ev = ApiGatewayEvent::new("POST", "/tasks").header("authorization", "Bearer fuzz-api-key").body(&body);
        if !ctype.is_empty() {
            ev = ev.header("content-type", ctype);
        }
        if let Some(k) = &key {
            ev = ev.header("idempotency-key", k);
        }
        let resp = rt().block_on(relay_api::respond(ev.build(), &w.deps));
        let status = resp.status().as_u16();
        prop_assert!(status < 500, "{status} for {body:?}: {:?}", resp.body());
        let v: serde_json::Value = serde_json::from_slice(resp.body().as_ref()).unwrap_or_default();
        if status >= 400 {
            prop_assert!(v["error"]["code"].is_string() && v["error"]["message"].is_string(), "a clear error: {v}");
        }
    }
}

/// The relay key the compat seeds carry.
const COMPAT_KEY: &str = "fuzzcompatkey0123456789abcdef0123";

proptest! {
    #![proptest_config(config("compat", 3_000))]

    /// `/in.php` and `/res.php` as any client (or attacker) may call them: a request line, a
    /// content type and a body (seeds in `corpus/compat/`). Never a panic, never a 5xx; every
    /// answer is one of the protocol's forms.
    #[test]
    fn any_2captcha_compatible_request_gets_a_protocol_answer_never_a_5xx(raw in inputs("compat")) {
        let w = api();
        let mut lines = raw.splitn(3, '\n');
        let line = lines.next().unwrap_or_default();
        let ctype = lines.next().unwrap_or_default();
        let body = lines.next().unwrap_or_default();
        let (method, target) = line.split_once(' ').unwrap_or(("POST", line));
        let method = if method == "GET" { "GET" } else { "POST" };
        let target = uri_safe(target);
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let path = if path.contains("res") { "/res.php" } else { "/in.php" };
        let mut ev = ApiGatewayEvent::new(method, path).query(query).body(body);
        if !ctype.is_empty() && ctype.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            ev = ev.header("content-type", ctype);
        }
        let resp = rt().block_on(relay_api::respond(ev.build(), &w.deps));
        let status = resp.status().as_u16();
        prop_assert!(status < 500, "{status} for {raw:?}: {:?}", resp.body());
        let text = String::from_utf8_lossy(resp.body().as_ref()).into_owned();
        let form = |t: &str| {
            t.starts_with("OK|")
                || t.starts_with("ERROR")
                || t == "CAPCHA_NOT_READY"
                || t.split('|').all(|p| !p.is_empty())
        };
        let ok = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) if v.is_object() => v["status"].is_u64() && v["request"].is_string(),
            _ => form(&text),
        };
        prop_assert!(ok, "not a protocol answer ({status}): {text:?} for {raw:?}");
        if status >= 400 {
            prop_assert!(text.contains("ERROR"), "an error names its code: {text:?}");
        }
    }
}

/// What API Gateway (or any HTTP server) can deliver: characters a URI may not hold arrive
/// percent-encoded (a raw request with them is refused before any handler runs).
fn uri_safe(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b);
        if keep {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The callback handler with a store holding one pending task.
struct CallbackWorld {
    _db: LocalDynamo,
    deps: relay_callback::Deps,
    task: TaskRef,
    sig: String,
}

fn callback() -> &'static CallbackWorld {
    static W: OnceLock<CallbackWorld> = OnceLock::new();
    W.get_or_init(|| {
        rt().block_on(async {
            let db = LocalDynamo::start().await.unwrap_or_else(|e| panic!("{e}"));
            let store = db.fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
            let now = Timestamp::from_millis(1_796_210_146_000);
            let task = Task::new(TaskRef::generate(), CaptchaKind::Image, now);
            let _ = store.tasks().create(&task, now, None).await;
            let id = CaptchaId::parse("71000001").unwrap_or_else(|e| panic!("{e}"));
            let _ = store.tasks().mark_submitted(&task.task_ref, &id, now, now).await;
            let signer =
                relay_shared::signing::CallbackSigner::new(SecretString::from("fuzz-signing-secret".to_owned()));
            let sig = signer.sign(&task.task_ref);
            let deps = relay_callback::Deps {
                results: store.results(),
                signer,
                clock: Arc::new(ManualClock::at(now)),
                dead_letters: Arc::new(MemorySink::default()),
                recent: relay_callback::RecentResults::default(),
            };
            CallbackWorld { _db: db, deps, task: task.task_ref, sig }
        })
    })
}

proptest! {
    #![proptest_config(config("callback_request", 3_000))]

    #[test]
    fn any_callback_request_gets_a_clear_answer_never_a_5xx(
        method in prop::sample::select(vec!["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE"]),
        path_kind in 0..4u8,
        path in inputs("callback_path"),
        query in inputs("callback_query"),
        body in inputs("callback_query"),
        ctype in prop::sample::select(vec!["application/x-www-form-urlencoded", "application/json", "multipart/form-data", ""]),
    ) {
        let w = callback();
        // Mostly the task's own signed path (so inputs reach the store), else anything.
        let path = match path_kind {
            0 => format!("/callback/{}/{}", w.task, w.sig),
            1 => format!("/callback/{}/{}", w.task, path),
            2 => format!("/callback/{path}"),
            _ => path,
        };
        let path = uri_safe(&if path.starts_with('/') { path } else { format!("/{path}") });
        let query = uri_safe(&query);
        let mut ev = ApiGatewayEvent::new(method, &path).query(&query);
        if method == "POST" {
            ev = ev.body(&body);
        }
        if !ctype.is_empty() {
            ev = ev.header("content-type", ctype);
        }
        let req = ev.build();
        let resp = rt().block_on(relay_callback::respond(req, &w.deps));
        let status = resp.status().as_u16();
        prop_assert!(status < 500, "{status} for {method} {path}?{query} {body:?}");
        if status >= 400 {
            let v: serde_json::Value = serde_json::from_slice(resp.body().as_ref()).unwrap_or_default();
            prop_assert!(v["error"]["code"].is_string(), "a clear error: {v}");
        }
    }
}
