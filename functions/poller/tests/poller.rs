//! The poller's behaviours one by one, with the template's settings, on the simulated clock of
//! `relay-sim`, against the fake CaptchaAI over HTTP and the embedded DynamoDB engine. (The
//! long runs — freshness, backlog, ban, budget — are in `tests/sim/tests/fallback.rs`.)

use std::sync::Arc;
use std::time::Duration;

use fake_captchaai::FakeConfig;
use relay_poller::{Deps, TickReport, run_invocation};
use relay_shared::domain::{CaptchaKind, TaskState, Via};
use relay_shared::testkit::{FlakyDynamo, MemorySink};
use relay_shared::time::{Clock, Timestamp};
use relay_sim::{EPOCH, World, steady};

const MIX: [CaptchaKind; 3] = [CaptchaKind::Turnstile, CaptchaKind::Image, CaptchaKind::RecaptchaV2];

/// One invocation started now, with the function's timeout, on the world's clock (which moves
/// while it runs).
async fn invoke(w: &World, deps: &Deps) -> TickReport {
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let deadline = clock.now().plus(w.deployed.poller_timeout);
    let busy = clock.busy();
    let (deps, c2) = (deps.clone(), clock.clone());
    let run = tokio::spawn(async move {
        let _busy = busy;
        run_invocation(&deps, c2, deadline).await
    });
    w.clock.run_until(deadline).await;
    run.await.unwrap_or_default()
}

/// Submits `n` tasks, 10 a second (CaptchaAI bans more than 60 in 3 s), and moves past every
/// first read.
async fn submitted_and_due(w: &World, n: usize, kinds: &[CaptchaKind]) {
    let over = Duration::from_millis(100 * n as u64);
    w.start_owner(steady(w.clock.now(), over, n, kinds), None);
    w.run_for(over + Duration::from_secs(70)).await;
    assert_eq!(w.owned().len(), n, "every submit was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_and_poll_racing_apply_each_result_exactly_once() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::captchaai_like() }).await?;
    submitted_and_due(&w, 30, &MIX).await;
    // The pingbacks that were lost arrive now, while an invocation reads the same tasks.
    let pingbacks = w.fake.tasks().into_iter().map(|t| {
        let fake = &w.fake;
        async move { fake.deliver(&t.id.to_string(), &t.answer.unwrap_or_default()).await }
    });
    let (report, statuses) = tokio::join!(invoke(&w, &w.poller), join_all(pingbacks));
    assert!(statuses.iter().all(|s| matches!(s, Ok(200))), "{statuses:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    let mut by_callback = 0;
    for o in w.owned() {
        match w.store.tasks().get(&o.task_ref).await?.map(|t| t.state) {
            Some(TaskState::Solved { via: Via::Callback, .. }) => by_callback += 1,
            Some(TaskState::Solved { via: Via::Poll, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(by_callback + report.recovered, 30, "each task written once, by exactly one path: {report:?}");
    Ok(())
}

async fn join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    for f in fs.collect::<Vec<_>>() {
        out.push(f.await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codes_are_classified_terminal_unknown_and_transient() -> anyhow::Result<()> {
    for (code, want) in [
        ("ERROR_CAPTCHA_UNSOLVABLE", "failed"),
        ("ERROR_SOMETHING_NEW", "failed"),
        ("ERROR_NO_SLOT_AVAILABLE", "pending"),
    ] {
        let w =
            World::start(FakeConfig { drop_callbacks: 1.0, result_code: Some(code.into()), ..FakeConfig::default() })
                .await?;
        // The schedule's phase is arbitrary; here its first tick comes after the three submits
        // (at 0, 0.33 and 0.67 s). A tick at the very moment of the first submit may find nothing
        // open and end (as a deployed one would): the next tick, at 61 s, is past this test.
        w.schedule_poller(EPOCH.plus(Duration::from_secs(1)));
        w.start_owner(steady(EPOCH, Duration::from_secs(1), 3, &[CaptchaKind::Image]), None);
        // First read at 25 s, then 5 s and 10 s later: three reads by 45 s.
        w.run_for(Duration::from_secs(50)).await;
        for o in w.owned() {
            let t = w.store.tasks().get(&o.task_ref).await?.expect("stored");
            assert_eq!(t.state.name(), want, "{code}: {:?}", t.state);
            if let TaskState::Failed { code: c, via, .. } = t.state {
                assert_eq!((c.as_ref(), via), (code, Via::Poll));
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_reads_100_ids_per_request_and_falls_back_only_when_the_form_is_refused() -> anyhow::Result<()> {
    for supported in [true, false] {
        let mut w =
            World::start(FakeConfig { drop_callbacks: 1.0, batch_supported: supported, ..FakeConfig::default() })
                .await?;
        w.poller.settings.batch = true;
        submitted_and_due(&w, 150, &[CaptchaKind::Image]).await;
        let first = invoke(&w, &w.poller).await;
        assert_eq!(first.batch_unsupported, !supported, "{first:?}");
        let counts = w.fake.counts();
        if supported {
            // (The submitter's one `threadsinfo` read, when its queue had work, is not a read.)
            assert_eq!(
                (first.recovered, counts.res_php - counts.threads_info),
                (150, 2),
                "two batch requests: {first:?}"
            );
        } else {
            // One refused batch, then single reads for the rest of the run: the refused batch's
            // tasks are given back (their read untaken) and read singly in the next pass.
            assert_eq!(first.recovered, 150, "{first:?}");
            // (The second batch may already be on its way when the first is refused.)
            let reads = counts.res_php - counts.threads_info;
            assert!((151..=152).contains(&reads), "refused batches, then 150 single reads: {counts:?}");
            assert!(w.store.account().breaker().await?.batch_unsupported, "remembered for every invocation");
            w.start_owner(steady(w.clock.now(), Duration::from_secs(1), 5, &[CaptchaKind::Image]), None);
            w.run_for(Duration::from_secs(70)).await;
            let before = w.fake.counts().res_php;
            let later = invoke(&w, &w.poller).await;
            assert_eq!((later.recovered, w.fake.counts().res_php - before), (5, 5), "singly from the start: {later:?}");
        }
        for o in w.owned() {
            assert!(matches!(w.store.tasks().get(&o.task_ref).await?.map(|t| t.state), Some(TaskState::Solved { .. })));
        }
    }
    // A transient failure of a batch is not a refusal: the batch form is kept.
    let mut w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    w.poller.settings.batch = true;
    submitted_and_due(&w, 10, &[CaptchaKind::Image]).await;
    let now = w.clock.now().as_millis();
    w.fake.configure(|c| {
        c.faults = vec![fake_captchaai::Fault {
            from_ms: now,
            until_ms: now + 1_000,
            endpoint: fake_captchaai::Endpoint::ResPhp,
            kind: fake_captchaai::FaultKind::Http5xx,
        }]
    });
    let r = invoke(&w, &w.poller).await;
    assert!(!r.batch_unsupported, "a 502 says nothing about the batch form: {r:?}");
    assert_eq!(r.recovered, 10, "read again (batched) after the 502: {r:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_invocations_never_read_a_task_twice_and_crashed_claims_lapse() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 60, &[CaptchaKind::Image]).await;
    let b = Deps { owner: "second".into(), ..w.poller.clone() };
    let (ra, rb) = tokio::join!(invoke(&w, &w.poller), async {
        // The second starts a moment later, as an overlapping schedule would.
        invoke(&w, &b).await
    });
    assert_eq!(ra.recovered + rb.recovered, 60, "{ra:?} {rb:?}");
    assert_eq!(w.fake.counts().res_php_ids, 60, "each task read once across both invocations");
    eprintln!("DEBUG {ra:?} {rb:?} max={}", w.fake.max_res_php_per_second());
    let rps = u64::from(w.poller.settings.requests_per_second);
    assert!(
        w.fake.max_res_php_per_second() <= rps,
        "the res.php rate holds across both invocations: {} in one second, the budget is {rps}",
        w.fake.max_res_php_per_second()
    );

    // An invocation that claims and dies: its tasks come back once the lease lapses.
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 5, &[CaptchaKind::Image]).await;
    for shard in 0..w.store.shards().read() {
        for due in w.store.poll().due_page(shard, w.clock.now(), 100, None).await?.tasks {
            assert!(w.store.poll().claim(&due, "crashed", w.clock.now().plus(w.poller.settings.lease), true).await?);
        }
    }
    let during = invoke(&w, &w.poller).await;
    assert_eq!((during.due, during.res_php_requests), (0, 0), "claimed tasks are not read while the lease holds");
    let after = invoke(&w, &w.poller).await;
    assert_eq!(after.recovered, 5, "the crashed claims lapsed: {after:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocation_without_time_left_does_nothing_and_leaves_the_work() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 5, &[CaptchaKind::Image]).await;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let late = run_invocation(&w.poller, clock.clone(), clock.now().plus(Duration::from_secs(5))).await;
    assert_eq!((late.claimed, late.res_php_requests, late.over_deadline), (0, 0, false), "{late:?}");
    assert_eq!(invoke(&w, &w.poller).await.recovered, 5, "the next invocation does the work");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_event_runs_one_invocation_within_its_deadline() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 3, &[CaptchaKind::Image]).await;
    let payload: serde_json::Value = serde_json::from_str(include_str!("fixtures/scheduler-event.json"))?;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let mut ctx = lambda_runtime::Context::default();
    ctx.deadline = clock.now().plus(w.deployed.poller_timeout).as_millis();
    let busy = clock.busy();
    let (deps, c2, p2, ctx2) = (w.poller.clone(), clock.clone(), payload.clone(), ctx.clone());
    let run = tokio::spawn(async move {
        let _busy = busy;
        relay_poller::handle(lambda_runtime::LambdaEvent::new(p2, ctx2), &deps, c2).await
    });
    w.clock.run_until(Timestamp::from_millis(ctx.deadline)).await;
    let report = run.await?.map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!((report.recovered, report.over_deadline), (3, false), "{report:?}");
    // An invocation whose deadline has already passed does no work.
    ctx.deadline = clock.now().as_millis();
    let late = relay_poller::handle(lambda_runtime::LambdaEvent::new(payload, ctx), &w.poller, clock)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(late.res_php_requests, 0, "{late:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_poller_cannot_store_becomes_a_dead_letter() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 3, &[CaptchaKind::Image]).await;
    let flaky = FlakyDynamo::start(&w.db.endpoint).await?;
    let sink = MemorySink::default();
    let p = Deps {
        store: relay_poller::Store::new(&flaky.store(w.store.table())),
        dead_letters: Arc::new(sink.clone()),
        ..w.poller.clone()
    };
    // With the store down nothing can even be listed: the invocation does nothing and says so.
    flaky.set_failing(true);
    let down = invoke(&w, &p).await;
    assert_eq!((down.claimed, down.dead_lettered, down.res_php_requests), (0, 0, 0), "{down:?}");
    assert!(down.errors > 0);
    flaky.set_failing(false);
    // Listing and claiming work, but every write of a result fails.
    flaky.set_failing_matching(Some(":solution"));
    let got = invoke(&w, &p).await;
    assert_eq!((got.claimed, got.dead_lettered, got.recovered), (3, 3, 0), "{got:?}");
    let letters = sink.taken();
    for o in w.owned() {
        let l = letters.iter().find(|l| l.task_ref == o.task_ref.as_ref()).expect("a letter per task");
        let id = o.captcha_id.clone().expect("id");
        assert_eq!((l.captcha_id.as_str(), l.via.as_str()), (id.as_str(), "poll"));
        assert_eq!(Some(l.code.clone()), w.fake.task(&id).and_then(|t| t.answer));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_key_stops_traffic_after_one_request_until_an_operator_acts() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    submitted_and_due(&w, 20, &[CaptchaKind::Image]).await;
    // The account key is revoked: res.php answers ERROR_KEY_DOES_NOT_EXIST.
    w.fake.configure(|c| c.api_key = "ffffffffffffffffffffffffffffffff".into());
    let r = invoke(&w, &w.poller).await;
    assert_eq!(r.res_php_requests, 1, "one request, then the breaker: {r:?}");
    assert_eq!(r.breaker_opened_by.as_deref(), Some("ERROR_KEY_DOES_NOT_EXIST"));
    // Five bad-key requests from one IP would earn ERROR: 1004: it never gets there.
    for _ in 0..10 {
        invoke(&w, &w.poller).await;
    }
    // (The submitter read the plan once, before the key was revoked.)
    let c = w.fake.counts();
    assert_eq!((c.res_php - c.threads_info, c.bans), (1, 0), "no further request, no ban");
    let b = w.store.account().breaker().await?;
    assert!(b.needs_operator && b.open_at(w.clock.now()).is_some(), "{b:?}");
    // The operator fixes the key and closes the breaker: reads resume, nothing was lost.
    w.fake.configure(|c| c.api_key = "0123456789abcdef0123456789abcdef".into());
    w.store.account().close_breaker().await?;
    let after = invoke(&w, &w.poller).await;
    assert_eq!(after.recovered, 20, "{after:?}");
    Ok(())
}
