//! Dead letters end to end: SQS is a moto server on loopback (started by `infra/test.sh`),
//! DynamoDB the embedded engine behind a fault-injecting endpoint. The test plays Lambda's SQS
//! event source: receive → invoke the redrive handler with a real SQS event → delete all but
//! the reported failures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_lambda_events::sqs::SqsEvent;
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_redrive::{BatchReport, Deps, RetryPacing};
use relay_shared::deadletter::{DeadLetter, SqsQueue};
use relay_shared::domain::{CaptchaId, CaptchaKind, IncomingResult, Outcome, Solution, Task, TaskRef, TaskState, Via};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{RecordOutcome, SubmitRecorded, TaskStore};
use relay_shared::testkit::{ApiGatewayEvent, FlakyDynamo, LocalDynamo, LocalSqs, sqs_event};
use relay_shared::time::{Clock, ManualClock, SystemClock, Timestamp};
use secrecy::SecretString;

struct World {
    db: LocalDynamo,
    flaky: FlakyDynamo,
    /// The store as the functions see it (through the fault injector).
    store: TaskStore,
    dlq: SqsQueue,
    poison: SqsQueue,
    clock: ManualClock,
    signer: CallbackSigner,
}

async fn world(max_receive_count: u32) -> anyhow::Result<World> {
    world_with(max_receive_count, 1).await
}

async fn world_with(max_receive_count: u32, visibility_secs: u32) -> anyhow::Result<World> {
    let db = LocalDynamo::start().await?;
    let table = db.fresh_store().await?;
    let flaky = FlakyDynamo::start(&db.endpoint).await?;
    let store = flaky.store(table.table());
    let (dlq, poison) = LocalSqs::from_env()?.queue_pair(max_receive_count, visibility_secs).await?;
    Ok(World {
        db,
        flaky,
        store,
        dlq,
        poison,
        clock: ManualClock::at(Timestamp::from_millis(1_796_210_146_000)),
        signer: CallbackSigner::new(SecretString::from("redrive-signing".to_owned())),
    })
}

impl World {
    fn redrive(&self) -> Deps {
        Deps {
            tasks: self.store.tasks(),
            results: self.store.results(),
            poison: self.poison.clone(),
            concurrency: 4,
            pacing: None,
        }
    }

    fn callback(&self, dead_letters: Arc<dyn relay_shared::deadletter::DeadLetterSink>) -> relay_callback::Deps {
        relay_callback::Deps {
            results: self.store.results(),
            signer: self.signer.clone(),
            clock: Arc::new(self.clock.clone()),
            dead_letters,
            recent: relay_callback::RecentResults::default(),
        }
    }

    async fn pending(&self, captcha_id: &str) -> anyhow::Result<TaskRef> {
        let now = self.clock.now();
        let task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, now);
        self.store.tasks().create(&task, now, None).await?;
        let due = now.plus(Duration::from_secs(120));
        let SubmitRecorded::Pending(_) =
            self.store.tasks().mark_submitted(&task.task_ref, &CaptchaId::parse(captcha_id)?, now, due).await?
        else {
            anyhow::bail!("not pending")
        };
        Ok(task.task_ref)
    }

    async fn pingback(&self, deps: &relay_callback::Deps, r: &TaskRef, id: &str, code: &str) -> u16 {
        let path = format!("/callback/{r}/{}", self.signer.sign(r));
        let req = ApiGatewayEvent::new("GET", &path).query(&format!("id={id}&code={code}")).build();
        relay_callback::respond(req, deps).await.status().as_u16()
    }

    /// One poll of the event source: receive a batch, invoke, delete what succeeded.
    async fn drain_once(&self) -> anyhow::Result<(BatchReport, usize)> {
        let got = self.dlq.receive(10, 1, 0).await?;
        if got.is_empty() {
            return Ok((BatchReport::default(), 0));
        }
        let event: SqsEvent =
            serde_json::from_value(sqs_event("arn:aws:sqs:us-east-1:123456789012:dead-letters", &got))?;
        let (resp, report) = relay_redrive::process(event, &self.redrive()).await;
        let failed: Vec<&str> = resp.batch_item_failures.iter().map(|f| f.item_identifier.as_str()).collect();
        for m in &got {
            if !failed.contains(&m.message_id.as_str()) {
                self.dlq.delete(&m.receipt_handle).await?;
            }
        }
        Ok((report, got.len()))
    }

    async fn state(&self, r: &TaskRef) -> TaskState {
        // Read past the fault injector: the truth, whatever the injector is doing.
        let direct = TaskStore::new(self.db.client(), self.store.table(), Duration::from_secs(60));
        direct.tasks().get(r).await.ok().flatten().map(|t| t.state).unwrap_or(TaskState::Submitting { unknown: None })
    }
}

fn letter_for(r: &TaskRef, id: &str, token: &str, at: Timestamp) -> anyhow::Result<DeadLetter> {
    let d = IncomingResult {
        captcha_id: CaptchaId::parse(id)?,
        outcome: Outcome::Solved(Solution::parse(token)?),
        received_at: at,
        via: Via::Callback,
        token_clock_start: at,
    };
    Ok(DeadLetter::new(r, &d, "task store unavailable: injected", 1))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_failure_during_a_callback_is_dead_lettered_then_applied_once() -> anyhow::Result<()> {
    let w = world(5).await?;
    let r = w.pending("71000001").await?;
    let cb = w.callback(Arc::new(w.dlq.clone()));
    w.flaky.set_failing(true);
    assert_eq!(w.pingback(&cb, &r, "71000001", "tok-kept").await, 200, "CaptchaAI hears 200");
    assert_eq!(w.pingback(&cb, &r, "71000001", "tok-kept").await, 200, "a duplicate during the outage too");
    assert!(matches!(w.state(&r).await, TaskState::Pending { .. }));
    let held = w.dlq.receive(10, 0, 0).await?;
    assert_eq!(held.len(), 2);
    let letter = DeadLetter::parse(&held[0].body)?;
    assert_eq!(
        (letter.task_ref.as_str(), letter.code.as_str(), letter.via.as_str()),
        (r.as_ref(), "tok-kept", "callback")
    );

    w.flaky.set_failing(false);
    let mut total = BatchReport::default();
    for _ in 0..5 {
        let (rep, n) = w.drain_once().await?;
        total.applied += rep.applied;
        total.already_recorded += rep.already_recorded;
        if n == 0 {
            break;
        }
    }
    assert_eq!((total.applied, total.already_recorded), (1, 1), "applied exactly once: {total:?}");
    match w.state(&r).await {
        TaskState::Solved { solution, via, .. } => assert_eq!((solution.expose(), via), ("tok-kept", Via::Redrive)),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.dlq.depth().await?, 0, "drained");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mixed_batch_reports_only_its_failures() -> anyhow::Result<()> {
    let w = world(5).await?;
    let now = w.clock.now();
    let fresh = w.pending("71000010").await?;
    let done = w.pending("71000011").await?;
    let stuck = w.pending("71000012").await?;
    let letter_done = letter_for(&done, "71000011", "tok-done", now)?;
    let (_, d) = letter_done.delivery_via(Via::Callback)?;
    assert!(matches!(w.store.results().record_result(&done, &d).await?, RecordOutcome::Recorded(_)));
    let stuck_id = w.dlq.send_body(&letter_for(&stuck, "71000012", "tok-stuck", now)?.to_json()).await?;
    w.dlq.send_body(&letter_for(&fresh, "71000010", "tok-fresh", now)?.to_json()).await?;
    w.dlq.send_body(&letter_done.to_json()).await?;
    w.dlq.send_body("this is not a dead letter").await?;
    // Only writes for the stuck task fail.
    w.flaky.set_failing_matching(Some(stuck.as_ref()));

    let got = w.dlq.receive(10, 1, 0).await?;
    assert_eq!(got.len(), 4);
    let event: SqsEvent = serde_json::from_value(sqs_event("arn:aws:sqs:us-east-1:123456789012:dlq", &got))?;
    let (resp, report) = relay_redrive::process(event, &w.redrive()).await;
    let failed: Vec<String> = resp.batch_item_failures.iter().map(|f| f.item_identifier.clone()).collect();
    assert_eq!(failed, vec![stuck_id], "only the stuck letter is reported");
    assert_eq!((report.applied, report.already_recorded, report.poisoned, report.retried), (1, 1, 1, 1));
    for m in &got {
        if !failed.contains(&m.message_id) {
            w.dlq.delete(&m.receipt_handle).await?;
        }
    }
    assert!(matches!(w.state(&fresh).await, TaskState::Solved { .. }));
    assert!(matches!(w.state(&stuck).await, TaskState::Pending { .. }));
    let poisoned = relay_ops::list(&w.poison, 10).await?;
    assert_eq!(poisoned.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), vec!["this is not a dead letter"]);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let left = w.dlq.receive(10, 1, 0).await?;
    assert_eq!(left.iter().map(|m| m.message_id.clone()).collect::<Vec<_>>(), failed, "successes were deleted");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_letter_whose_token_may_live_comes_back_in_seconds_not_after_the_queues_visibility() -> anyhow::Result<()> {
    // The queue as deployed (template.yaml): 185 s visibility, 12 receives. Real time: SQS's
    // visibility runs on moto's clock, and the function's on the system clock.
    let (visibility, receives) = (185, 12);
    let w = world_with(receives, visibility).await?;
    let deps = Deps {
        pacing: Some(RetryPacing {
            queue: w.dlq.clone(),
            max_receives: receives,
            slow: Duration::from_secs(u64::from(visibility)),
        }),
        ..w.redrive()
    };
    let now = SystemClock.now();
    let fresh = w.pending("71000030").await?;
    let fresh_id = w.dlq.send_body(&letter_for(&fresh, "71000030", "tok-fresh", now)?.to_json()).await?;
    // A letter whose token died long ago keeps the queue's pace.
    let stale = w.pending("71000031").await?;
    let stale_letter = letter_for(&stale, "71000031", "tok-stale", now.minus(Duration::from_secs(600)))?;
    w.dlq.send_body(&stale_letter.to_json()).await?;

    // The event source receives both with the queue's visibility; the store is down.
    w.flaky.set_failing(true);
    let got = w.dlq.receive(10, i32::try_from(visibility)?, 0).await?;
    assert_eq!(got.len(), 2);
    let event: SqsEvent = serde_json::from_value(sqs_event("arn:aws:sqs:us-east-1:123456789012:dlq", &got))?;
    let failed_at = Instant::now();
    let (resp, report) = relay_redrive::process(event, &deps).await;
    assert_eq!((report.retried, resp.batch_item_failures.len()), (2, 2));
    w.flaky.set_failing(false);

    // The fresh letter is back after its 2 s, not 185 s; the stale one is still hidden.
    let back = loop {
        let got = w.dlq.receive(10, i32::try_from(visibility)?, 0).await?;
        if !got.is_empty() {
            break got;
        }
        anyhow::ensure!(failed_at.elapsed() < Duration::from_secs(15), "the fresh letter never came back");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let waited = failed_at.elapsed();
    assert!(waited >= Duration::from_millis(1_500), "not before its delay: {waited:?}");
    assert_eq!(back.iter().map(|m| m.message_id.clone()).collect::<Vec<_>>(), vec![fresh_id]);
    let event: SqsEvent = serde_json::from_value(sqs_event("arn:aws:sqs:us-east-1:123456789012:dlq", &back))?;
    let (_, report) = relay_redrive::process(event, &deps).await;
    assert_eq!(report.applied, 1);
    assert!(matches!(w.state(&fresh).await, TaskState::Solved { via: Via::Redrive, .. }));
    assert!(matches!(w.state(&stale).await, TaskState::Pending { .. }), "the stale letter waits for the queue");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_letter_failing_every_time_ends_poisoned_and_the_operator_moves_it_back() -> anyhow::Result<()> {
    let w = world(2).await?;
    let r = w.pending("71000020").await?;
    w.dlq.send_body(&letter_for(&r, "71000020", "tok-late", w.clock.now())?.to_json()).await?;
    w.flaky.set_failing(true);
    let started = Instant::now();
    while relay_ops::list(&w.poison, 10).await?.is_empty() {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(20), "never poisoned");
        let _ = w.drain_once().await?;
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    let poisoned = relay_ops::list(&w.poison, 10).await?;
    assert_eq!(poisoned.len(), 1);
    let shown = relay_ops::show(&poisoned[0], false);
    assert_eq!(shown.task_ref.as_deref(), Some(r.as_ref()));
    assert!(!shown.code.unwrap_or_default().contains("tok-late"), "redacted unless revealed");
    assert_eq!(relay_ops::show(&poisoned[0], true).code.as_deref(), Some("tok-late"));
    assert!(matches!(w.state(&r).await, TaskState::Pending { .. }));

    w.flaky.set_failing(false);
    let mut ticks = Vec::new();
    let only = |m: &relay_shared::deadletter::Received| relay_ops::is_for_task(m, r.as_ref());
    let moved = relay_ops::move_messages(&w.poison, &w.dlq, u64::MAX, Some(&only), |p| ticks.push(p.moved)).await?;
    assert_eq!((moved.moved, ticks), (1, vec![1]));
    assert!(relay_ops::list(&w.poison, 10).await?.is_empty(), "nothing left behind");
    let (rep, _) = w.drain_once().await?;
    assert_eq!(rep.applied, 1);
    assert!(matches!(w.state(&r).await, TaskState::Solved { via: Via::Redrive, .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_letter_for_an_already_solved_task_is_a_success_without_a_write() -> anyhow::Result<()> {
    let w = world(5).await?;
    let r = w.pending("71000030").await?;
    let letter = letter_for(&r, "71000030", "tok-first", w.clock.now())?;
    let (_, d) = letter.delivery_via(Via::Callback)?;
    w.store.results().record_result(&r, &d).await?;
    let before = w.store.tasks().get(&r).await?;
    w.dlq.send_body(&letter.to_json()).await?;
    let (rep, _) = w.drain_once().await?;
    assert_eq!((rep.applied, rep.already_recorded, rep.retried), (0, 1, 0));
    assert_eq!(w.store.tasks().get(&r).await?, before, "unchanged: still resolved by the callback");
    assert_eq!(w.dlq.depth().await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn queue_and_store_down_together_is_a_5xx_and_the_poller_still_recovers() -> anyhow::Result<()> {
    let w = world(5).await?;
    let fake = FakeCaptchaAi::start(FakeConfig::default()).await?;
    let id = fake.preload_solved(1).remove(0);
    let r = w.pending(&id).await?;
    // SQS unreachable (nothing listens on port 9), store failing.
    let nowhere = SqsQueue::new(relay_shared::testkit::sqs_client_for("http://127.0.0.1:9"), "http://127.0.0.1:9/q");
    let cb = w.callback(Arc::new(nowhere));
    w.flaky.set_failing(true);
    let answer = fake.task(&id).and_then(|t| t.answer).unwrap_or_default();
    assert_eq!(w.pingback(&cb, &r, &id, &answer).await, 503, "the sender is told to try again");

    w.flaky.set_failing(false);
    w.clock.advance(Duration::from_secs(121));
    let poller = relay_poller::Deps {
        store: relay_poller::Store::new(&w.store),
        captchaai: relay_shared::captchaai::CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            Duration::from_secs(5),
            None,
        )?,
        settings: relay_poller::PollerSettings::default(),
        owner: "net".into(),
        dead_letters: Arc::new(w.dlq.clone()),
    };
    // One poller invocation on the test's clock, driven as the simulation drives it.
    let clock: Arc<dyn relay_shared::time::Clock> = Arc::new(w.clock.clone());
    let deadline = w.clock.now().plus(Duration::from_secs(75));
    let busy = clock.busy();
    let run = tokio::spawn(async move {
        let _busy = busy;
        relay_poller::run_invocation(&poller, clock, deadline).await
    });
    w.clock.run_until(deadline).await;
    let tick = run.await?;
    assert_eq!(tick.recovered, 1, "{tick:?}");
    match w.state(&r).await {
        TaskState::Solved { solution, via, .. } => assert_eq!((solution.expose(), via), (answer.as_str(), Via::Poll)),
        other => panic!("{other:?}"),
    }
    Ok(())
}
