//! Submitting: never pay twice, never lose a paid task. The fake CaptchaAI over HTTP accepts
//! tasks and then fails to say so (502, HTML, a cut connection, no answer in time), bans, and
//! counts every in.php call; each test checks the calls it received and that every task it
//! accepted ends solved — by its pingback, the poller, or a redriven dead letter.

use std::time::Duration;

use fake_captchaai::{AfterAccept, FakeConfig};
use relay_shared::domain::CaptchaKind;
use relay_shared::time::Clock;
use relay_sim::{EPOCH, Options, World, body_for};

const TURNSTILE: CaptchaKind = CaptchaKind::Turnstile;

fn opts() -> Options {
    // In.php answers in milliseconds; 2 s is plenty, and keeps the "no answer" case short.
    Options { submit_timeout: Duration::from_secs(2), ..Options::default() }
}

/// Runs the world long enough for every accepted task to be solved and delivered, then checks
/// that each task the fake accepted ends solved with the fake's answer, and returns how many
/// in.php calls the fake received.
async fn every_accepted_task_ends_solved(w: &World) -> anyhow::Result<u64> {
    w.run_for(Duration::from_secs(300)).await;
    let fake_tasks = w.fake.tasks();
    assert!(!fake_tasks.is_empty(), "the fake accepted something");
    for ft in fake_tasks {
        let Some(pingback) = &ft.pingback else { continue };
        // The signed pingback path names our task: /callback/{ref}/{sig}.
        let task_ref = relay_shared::domain::TaskRef::parse(pingback.split('/').rev().nth(1).unwrap_or_default())?;
        let t = w.store.tasks().get(&task_ref).await?.expect("the task exists");
        match &t.state {
            relay_shared::domain::TaskState::Solved { solution, .. } => {
                assert_eq!(Some(solution.expose().to_owned()), ft.answer, "{task_ref} holds the fake's answer")
            }
            other => panic!("accepted task {} ({task_ref}) ends solved, not {other:?}", ft.id),
        }
        assert_eq!(t.captcha_id.map(|i| i.to_string()), Some(ft.id.to_string()), "and its id");
    }
    Ok(w.fake.counts().in_php)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_php_failing_after_accepting_leaves_the_task_unknown_and_its_pingback_solves_it() -> anyhow::Result<()> {
    for after in [AfterAccept::Http502, AfterAccept::Html, AfterAccept::Cut, AfterAccept::Slow { ms: 3_000 }] {
        let w =
            World::start_with(FakeConfig { after_accept: vec![after], ..FakeConfig::captchaai_like() }, opts()).await?;
        w.schedule_poller(EPOCH);
        let (status, v, _) = w.post_task(body_for(TURNSTILE), Some("order-1")).await?;
        assert_eq!(status, 202, "{after:?}: {v}");
        assert_eq!(
            (v["status"].as_str(), v["submit_outcome"].as_str()),
            (Some("submitting"), Some("unknown")),
            "{after:?}: {v}"
        );
        assert_eq!(w.fake.counts().accepted_then_failed, 1, "{after:?}: the fake took the task, then failed to say so");
        // The owner retries with the same key: the same task, no second in.php call.
        let (again, v2, headers) = w.post_task(body_for(TURNSTILE), Some("order-1")).await?;
        assert_eq!((again, v2["task_ref"].clone()), (202, v["task_ref"].clone()), "{after:?}");
        assert_eq!(headers.get("idempotent-replayed").and_then(|h| h.to_str().ok()), Some("true"));
        let calls = every_accepted_task_ends_solved(&w).await?;
        assert_eq!((calls, w.fake.counts().tasks_accepted), (1, 1), "{after:?}: one in.php call, never paid twice");
        println!(
            "in.php {after:?} after accepting: in.php calls {calls}, accepted 1, final state solved (by its pingback)"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ban_answers_are_not_retried_they_stop_traffic_and_the_task_waits_in_the_queue_paid_once() -> anyhow::Result<()>
{
    // MAX_USER_TURN (a 10 s ban) from in.php itself.
    let w = World::start_with(
        FakeConfig { submit_errors: vec!["MAX_USER_TURN".into()], ..FakeConfig::captchaai_like() },
        opts(),
    )
    .await?;
    w.schedule_poller(EPOCH);
    let (status, v, _) = w.post_task(body_for(TURNSTILE), Some("order-2")).await?;
    assert_eq!((status, v["status"].as_str()), (202, Some("queued")), "accepted, waiting out the ban: {v}");
    assert_eq!(w.fake.counts().in_php, 1, "not retried inside the request");
    let (again, v2, _) = w.post_task(body_for(TURNSTILE), Some("order-2")).await?;
    assert_eq!((again, v2["task_ref"].clone()), (202, v["task_ref"].clone()), "the same task for the same key");
    let (other, _, _) = w.post_task(body_for(TURNSTILE), Some("order-2b")).await?;
    assert_eq!((other, w.fake.counts().in_php), (202, 1), "the breaker holds submits back during the ban");
    w.run_for(Duration::from_secs(9)).await;
    assert_eq!(w.fake.counts().in_php, 1, "nothing sent before the ban ends");
    let calls = every_accepted_task_ends_solved(&w).await?;
    assert_eq!((calls, w.fake.counts().tasks_accepted), (3, 2), "1 refused with the ban, then each task once");
    println!("MAX_USER_TURN: in.php calls {calls} (1 refused with the ban, 2 accepted after it), both solved");

    // IP_BANNED (5 min), for every request of the IP.
    let w = World::start_with(FakeConfig::captchaai_like(), opts()).await?;
    w.schedule_poller(EPOCH);
    w.fake.ban_ip(Duration::from_secs(300));
    let (status, v, _) = w.post_task(body_for(TURNSTILE), Some("order-3")).await?;
    assert_eq!((status, v["status"].as_str()), (202, Some("queued")), "{v}");
    for _ in 0..5 {
        assert_eq!(w.post_task(body_for(TURNSTILE), Some("order-3")).await?.0, 202);
    }
    w.run_for(Duration::from_secs(290)).await;
    assert_eq!(
        (w.fake.counts().in_php, w.fake.counts().requests_during_ban),
        (1, 1),
        "one request met the ban, no more"
    );
    let calls = every_accepted_task_ends_solved(&w).await?;
    assert_eq!((calls, w.fake.counts().tasks_accepted), (2, 1));
    println!(
        "IP_BANNED: in.php calls {calls} (1 met the ban, 1 accepted after it), requests during the ban 1, final state solved"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_submits_with_one_key_pay_once_another_body_is_refused_another_key_is_new() -> anyhow::Result<()>
{
    let w = World::start_with(FakeConfig::captchaai_like(), opts()).await?;
    w.schedule_poller(EPOCH);
    let sends = (0..10).map(|_| w.post_task(body_for(TURNSTILE), Some("order-4")));
    let mut answers = Vec::new();
    for f in sends.collect::<Vec<_>>() {
        answers.push(f);
    }
    let results = futures_join(answers).await;
    let refs: std::collections::HashSet<String> = results
        .iter()
        .map(|r| match r {
            Ok((202, v, _)) => v["task_ref"].as_str().unwrap_or_default().to_owned(),
            other => panic!("every one is 202: {other:?}"),
        })
        .collect();
    assert_eq!(refs.len(), 1, "one task for one key");
    assert_eq!(w.fake.counts().in_php, 1, "10 concurrent submits, one in.php call");
    // The same key with another request body: refused, nothing sent.
    let (status, v, _) = w.post_task(body_for(CaptchaKind::Image), Some("order-4")).await?;
    assert_eq!((status, v["error"]["code"].as_str()), (422, Some("idempotency_key_reused")));
    // Key order and whitespace do not make another request.
    let reordered = r#"{ "pageurl": "https://shop.example/login", "sitekey": "0x4AAA", "kind": "turnstile" }"#;
    assert_eq!(w.post_task(reordered, Some("order-4")).await?.0, 202);
    assert_eq!(w.fake.counts().in_php, 1);
    // Another key is another task.
    let (status, other, _) = w.post_task(body_for(TURNSTILE), Some("order-5")).await?;
    assert_eq!(status, 202);
    assert_ne!(other["task_ref"], serde_json::json!(refs.iter().next()));
    let calls = every_accepted_task_ends_solved(&w).await?;
    assert_eq!(calls, 2, "one call per key");
    println!(
        "idempotency: 10 concurrent submits with one key + 1 other body + 1 reordered body -> 1 in.php call; a second key -> 1 more; both solved"
    );
    Ok(())
}

async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    // Polled together, so the requests really are in flight at once.
    let mut set = Vec::new();
    for f in fs {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_cannot_be_stored_is_dead_lettered_redriven_and_the_poller_reads_it() -> anyhow::Result<()> {
    // Every pingback lost: only the id, once stored, lets the poller recover the result.
    let w = World::start_with(
        FakeConfig { drop_callbacks: 1.0, ..FakeConfig::captchaai_like() },
        Options { flaky_relay_store: true, ..opts() },
    )
    .await?;
    w.schedule_poller(EPOCH);
    let flaky = w.flaky.as_ref().expect("flaky store");
    // Storing in.php's answer (submitting -> pending) fails, every time.
    flaky.set_failing_matching(Some("submitted_at = :now"));
    let (status, v, _) = w.post_task(body_for(TURNSTILE), Some("order-6")).await?;
    assert_eq!(status, 202, "CaptchaAI has the task: {v}");
    flaky.set_failing_matching(None);
    let letters = w.dead_letters.taken();
    assert_eq!(letters.len(), 1, "the id went to the dead-letter queue");
    assert_eq!(
        (letters[0].kind.as_str(), letters[0].task_ref.as_str()),
        ("submitted", v["task_ref"].as_str().unwrap_or_default())
    );
    // The redrive function's logic stores it.
    let outcome = relay_redrive::redrive_one(&w.store.tasks(), &w.store.results(), &letters[0].to_json()).await;
    assert_eq!(outcome, relay_redrive::Redriven::Applied);
    let calls = every_accepted_task_ends_solved(&w).await?;
    let t =
        w.store.tasks().get(&relay_shared::domain::TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())?).await?;
    assert!(matches!(
        t.map(|t| t.state),
        Some(relay_shared::domain::TaskState::Solved { via: relay_shared::domain::Via::Poll, .. })
    ));
    assert_eq!(calls, 1);
    println!("id not storable: in.php calls 1, id dead-lettered, redriven, read by the poller: solved");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_refused_for_now_again_and_again_fails_after_five_refusals_not_for_ever() -> anyhow::Result<()> {
    // ERROR_SERVER_ERROR to every submit: what CaptchaAI answers a method it does not solve.
    let w = World::start_with(
        FakeConfig { submit_errors: vec!["ERROR_SERVER_ERROR".into(); 50], ..FakeConfig::captchaai_like() },
        opts(),
    )
    .await?;
    w.schedule_poller(EPOCH);
    let (status, v, _) = w.post_task(body_for(TURNSTILE), Some("order-refused")).await?;
    assert_eq!((status, v["status"].as_str()), (202, Some("queued")), "refused for now: queued, {v}");
    w.run_for(Duration::from_secs(300)).await;
    let t = w.get_task(v["task_ref"].as_str().unwrap_or_default()).await?;
    assert_eq!((t["status"].as_str(), t["error_code"].as_str()), (Some("failed"), Some("ERROR_SERVER_ERROR")), "{t}");
    let calls = w.fake.counts().in_php;
    // The inline try, then the queue's: failed at the fifth refusal of its own.
    assert_eq!((calls, w.fake.counts().tasks_accepted), (6, 0), "{t}");
    println!("ERROR_SERVER_ERROR to every submit: {calls} in.php calls, then failed with it (not retried for ever)");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_run_out_stops_submits_with_captchaais_code_until_it_is_renewed() -> anyhow::Result<()> {
    // The plan has expired: every submit is answered ERROR_ZERO_BALANCE while threadsinfo shows
    // every thread free (how CaptchaAI's own SDK tells it from a busy plan).
    let w = World::start_with(FakeConfig { plan_expired: true, ..FakeConfig::captchaai_like() }, opts()).await?;
    w.schedule_poller(EPOCH);
    let mut queued = Vec::new();
    for i in 0..3 {
        let (status, v, _) = w.post_task(body_for(TURNSTILE), Some(&format!("order-plan-{i}"))).await?;
        assert_eq!((status, v["status"].as_str()), (202, Some("queued")), "{v}");
        queued.push(v["task_ref"].as_str().unwrap_or_default().to_owned());
    }
    w.run_for(Duration::from_secs(60)).await;
    let b = w.store.account().breaker().await?;
    assert!(b.plan_out() && b.open_for_submits_at(w.clock.now()).is_some(), "submits stopped: {b:?}");
    assert!(b.open_at(w.clock.now()).is_none(), "reads go on: results of tasks taken still come");
    let calls = w.fake.counts().in_php;
    assert!(calls <= 6, "found out within a few calls, not by hammering: {calls}");
    // New submits are told why, in CaptchaAI's own code, and nothing is recorded.
    let (_, text) = w.post_in_php("method=turnstile&sitekey=0x4AAA&pageurl=https://shop.example/login").await?;
    assert_eq!(text, "ERROR_ZERO_BALANCE", "in.php");
    let (status, v, _) = w.post_task(body_for(TURNSTILE), None).await?;
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("captchaai_unavailable")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("expired or is out of balance")), "{v}");
    assert_eq!(w.fake.counts().in_php, calls, "no call while the plan is out");
    // The plan is renewed and the operator closes the breaker: the queued tasks go and are solved.
    w.fake.configure(|c| c.plan_expired = false);
    w.store.account().close_breaker().await?;
    w.run_for(Duration::from_secs(120)).await;
    for r in &queued {
        let t = w.store.tasks().get(&relay_shared::domain::TaskRef::parse(r)?).await?.expect("stored");
        assert!(matches!(t.state, relay_shared::domain::TaskState::Solved { .. }), "{r}: {:?}", t.state);
    }
    println!(
        "plan run out: found after {calls} in.php calls; submits refused with ERROR_ZERO_BALANCE; 3 of 3 queued solved after renewal"
    );
    Ok(())
}
