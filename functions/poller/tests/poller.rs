//! The poller against the embedded DynamoDB engine and the fake CaptchaAI over HTTP, with the
//! API and callback handlers served locally so pingbacks really arrive (or really do not).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_local::{LocalParts, Relay};
use relay_poller::{Deps, PollerSettings, TickReport, poll_once};
use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::domain::{CaptchaId, CaptchaKind, Task, TaskRef, TaskState, Via};
use relay_shared::store::{RecordOutcome, SubmitRecorded, TaskStore};
use relay_shared::testkit::{FlakyDynamo, LocalDynamo, MemorySink, OperationCounter};
use relay_shared::time::{Clock, ManualClock, Timestamp};
use secrecy::SecretString;

const KEY: &str = "poller-test-key";

struct World {
    db: LocalDynamo,
    fake: FakeCaptchaAi,
    store: TaskStore,
    clock: ManualClock,
    base: String,
    http: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn settings() -> PollerSettings {
    PollerSettings { requests_per_second: 5_000, concurrency: 16, ..PollerSettings::default() }
}

async fn world(cfg: FakeConfig) -> anyhow::Result<World> {
    let db = LocalDynamo::start().await?;
    let fake = FakeCaptchaAi::start(cfg).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let store = db.fresh_store().await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
    let relay = Arc::new(Relay::new(LocalParts {
        store: store.clone(),
        captchaai: client_for_fake(&fake)?,
        api_key: SecretString::from(KEY.to_owned()),
        signing_secret: SecretString::from("poller-signing".to_owned()),
        callback_base_url: base.clone(),
        clock: Arc::new(clock.clone()),
        dead_letters: Arc::new(MemorySink::default()),
    }));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(relay_local::serve(listener, relay, async move {
        let _ = rx.await;
    }));
    Ok(World { db, fake, store, clock, base, http: reqwest::Client::new(), _stop: tx })
}

fn client_for_fake(fake: &FakeCaptchaAi) -> anyhow::Result<CaptchaAiClient> {
    Ok(CaptchaAiClient::new(&fake.base_url(), SecretString::from(fake.api_key()), Duration::from_secs(5), None)?)
}

impl World {
    fn poller(&self, s: PollerSettings, owner: &str) -> anyhow::Result<Deps> {
        Ok(Deps {
            store: self.store.clone(),
            captchaai: client_for_fake(&self.fake)?,
            settings: s,
            owner: owner.into(),
            dead_letters: Arc::new(MemorySink::default()),
        })
    }

    /// A poller whose DynamoDB client counts what it sends.
    fn counted_poller(&self, s: PollerSettings, owner: &str) -> anyhow::Result<(Deps, OperationCounter)> {
        let (client, counter) = self.db.counting_client();
        let store = TaskStore::new(client, self.store.table(), Duration::from_secs(86_400));
        Ok((Deps { store, ..self.poller(s, owner)? }, counter))
    }

    async fn tick(&self, d: &Deps) -> TickReport {
        poll_once(d, self.clock.now(), Instant::now() + Duration::from_secs(60)).await
    }

    /// Submits `n` Turnstile tasks through the API; returns (task ref, CaptchaAI id).
    async fn submit(&self, n: usize) -> anyhow::Result<Vec<(TaskRef, String)>> {
        self.submit_body(n, r#"{"kind":"turnstile","sitekey":"0x4","pageurl":"https://a.example"}"#).await
    }

    async fn submit_body(&self, n: usize, body: &str) -> anyhow::Result<Vec<(TaskRef, String)>> {
        let mut out = Vec::new();
        for _ in 0..n {
            let v: serde_json::Value = self
                .http
                .post(format!("{}/tasks", self.base))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body.to_owned())
                .send()
                .await?
                .json()
                .await?;
            out.push((
                TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())?,
                v["captcha_id"].as_str().unwrap_or_default().to_owned(),
            ));
        }
        Ok(out)
    }

    /// Submits `n` tasks, lets the fake finish with them, and moves past the callback grace:
    /// whatever did not arrive by callback is now due for a poll.
    async fn submit_past_grace(&self, n: usize) -> anyhow::Result<Vec<(TaskRef, String)>> {
        let tasks = self.submit(n).await?;
        self.settle().await;
        self.clock.advance(Duration::from_secs(121));
        Ok(tasks)
    }

    /// Waits until the fake has solved (and, where it will, delivered) everything.
    async fn settle(&self) {
        for _ in 0..300 {
            let c = self.fake.counts();
            let tasks = self.fake.tasks();
            if tasks.iter().all(|t| t.answer.is_some()) && c.callbacks_sent + c.callbacks_dropped >= c.tasks_accepted {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn state(&self, r: &TaskRef) -> TaskState {
        self.store.get(r).await.ok().flatten().map(|t| t.state).unwrap_or(TaskState::Submitting)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_dropped_callback_is_recovered_by_the_poller() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let tasks = w.submit(40).await?;
    w.settle().await;
    let p = w.poller(settings(), "p1")?;
    let early = w.tick(&p).await;
    assert_eq!((early.due, early.res_php_requests), (0, 0), "nothing is polled inside the callback grace");
    w.clock.advance(Duration::from_secs(121));
    let tick = w.tick(&p).await;
    assert_eq!(tick.recovered, 40, "{tick:?}");
    assert_eq!(tick.oldest_due_secs, 1, "due at submit + 120 s, read at + 121 s");
    for (r, id) in &tasks {
        let want = w.fake.task(id).and_then(|t| t.answer).expect("solved by the fake");
        match w.state(r).await {
            TaskState::Solved { solution, via: Via::Poll, .. } => assert_eq!(solution.expose(), want),
            other => panic!("{r}: {other:?}"),
        }
    }
    assert_eq!(w.tick(&p).await.due, 0, "recovered tasks leave the due list");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_whose_callback_came_are_never_polled() -> anyhow::Result<()> {
    let w = world(FakeConfig::default()).await?;
    let tasks = w.submit(30).await?;
    w.settle().await;
    w.clock.advance(Duration::from_secs(3_600));
    let tick = w.tick(&w.poller(settings(), "p1")?).await;
    assert_eq!((tick.due, tick.res_php_requests), (0, 0), "{tick:?}");
    assert_eq!(w.fake.counts().res_php, 0);
    for (r, _) in &tasks {
        assert!(matches!(w.state(r).await, TaskState::Solved { via: Via::Callback, .. }));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn callback_and_poll_racing_apply_each_result_exactly_once() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let tasks = w.submit_past_grace(30).await?;
    let p = w.poller(settings(), "racer")?;
    let pingbacks = tasks.iter().map(|(_, id)| {
        let answer = w.fake.task(id).and_then(|t| t.answer).unwrap_or_default();
        let fake = &w.fake;
        async move { fake.deliver(id, &answer).await }
    });
    let (tick, statuses) = tokio::join!(w.tick(&p), futures_join_all(pingbacks));
    assert!(statuses.iter().all(|s| matches!(s, Ok(200))), "{statuses:?}");
    assert_eq!(tick.errors, 0, "{tick:?}");
    let mut via_callback = 0;
    for (r, _) in &tasks {
        match w.state(r).await {
            TaskState::Solved { via: Via::Callback, .. } => via_callback += 1,
            TaskState::Solved { via: Via::Poll, .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(via_callback + tick.recovered, 30, "each task written once, by exactly one path");
    Ok(())
}

async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let handles: Vec<_> = fs.collect();
    for f in handles {
        out.push(f.await);
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_read_budget_keeps_res_php_far_below_the_ban_rule() -> anyhow::Result<()> {
    // Never solved, no callbacks: the worst case for res.php traffic.
    let w = world(FakeConfig { drop_callbacks: 1.0, solve_delay_ms: 86_400_000, ..FakeConfig::default() }).await?;
    let n = 200;
    let tasks = w.submit(n).await?;
    let p = w.poller(PollerSettings { batch: false, ..settings() }, "p1")?;
    for _ in 0..(700 / 5) {
        w.clock.advance(Duration::from_secs(5));
        w.tick(&p).await;
    }
    let c = w.fake.counts();
    let reads_per_task = c.res_php as f64 / n as f64;
    assert!(c.res_php <= 20 * n as u64, "per-task budget: {} reads for {n} tasks", c.res_php);
    assert!(c.res_php <= 20 * c.in_php + 1200, "ban rule R <= 20C + 1200: R={} C={}", c.res_php, c.in_php);
    for (r, _) in &tasks {
        let st = w.state(r).await;
        assert!(matches!(st, TaskState::Expired { .. }), "every task ends expired: {st:?}");
    }
    println!("budget: {} res.php requests for {n} unsolved tasks ({reads_per_task:.1} per task)", c.res_php);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn codes_are_classified_terminal_unknown_and_transient() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let p = w.poller(settings(), "p1")?;
    for (code, want) in [
        ("ERROR_CAPTCHA_UNSOLVABLE", "failed"),
        ("ERROR_SOMETHING_NEW", "failed"),
        ("ERROR_NO_SLOT_AVAILABLE", "pending"),
    ] {
        w.fake.configure(|c| c.result_code = Some(code.into()));
        let tasks = w.submit_past_grace(3).await?;
        let mut ticks = 0;
        for _ in 0..3 {
            w.tick(&p).await;
            ticks += 1;
            w.clock.advance(Duration::from_secs(30));
        }
        for (r, _) in &tasks {
            let s = w.state(r).await;
            assert_eq!(s.name(), want, "{code} after {ticks} ticks: {s:?}");
            if let TaskState::Failed { code: c, via, .. } = s {
                assert_eq!((c.as_ref(), via), (code, Via::Poll));
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_past_its_deadline_is_expired_with_a_reason() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, solve_delay_ms: 86_400_000, ..FakeConfig::default() }).await?;
    let tasks = w.submit(2).await?;
    w.clock.advance(Duration::from_secs(601));
    let tick = w.tick(&w.poller(settings(), "p1")?).await;
    assert_eq!(tick.expired, 2);
    assert_eq!(w.fake.counts().res_php, 0, "no read is spent on a task already past its deadline");
    assert!(matches!(w.state(&tasks[0].0).await, TaskState::Expired { reason, .. } if reason.contains("600 s")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn batching_reads_100_ids_per_request_and_falls_back_when_refused() -> anyhow::Result<()> {
    for supported in [true, false] {
        let w = world(FakeConfig { drop_callbacks: 1.0, batch_supported: supported, ..FakeConfig::default() }).await?;
        let tasks = w.submit_past_grace(150).await?;
        let tick = w.tick(&w.poller(settings(), "p1")?).await;
        assert_eq!(tick.recovered, 150, "{tick:?}");
        assert_eq!(tick.batch_rejected, !supported);
        let want = if supported { 2 } else { 1 + 150 };
        assert_eq!(w.fake.counts().res_php, want, "supported={supported}");
        assert!(matches!(w.state(&tasks[149].0).await, TaskState::Solved { .. }));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn overlapping_ticks_never_read_a_task_twice_and_crashed_claims_lapse() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let tasks = w.submit_past_grace(60).await?;
    let (a, b) = (
        w.poller(PollerSettings { batch: false, ..settings() }, "a")?,
        w.poller(PollerSettings { batch: false, ..settings() }, "b")?,
    );
    let (ra, rb) = tokio::join!(w.tick(&a), w.tick(&b));
    assert_eq!(ra.recovered + rb.recovered, 60, "{ra:?} {rb:?}");
    assert_eq!(w.fake.counts().res_php_ids, 60, "each task read once across both pollers");

    // A poller that claims and dies: its tasks come back once the lease lapses.
    let more = w.submit_past_grace(5).await?;
    let crashed = w.poller(settings(), "crashed")?;
    for shard in 0..relay_shared::store::POLL_SHARDS {
        for due in w.store.due_page(shard, w.clock.now(), 100, None).await?.tasks {
            assert!(w.store.claim(&due, &crashed.owner, w.clock.now().plus(crashed.settings.lease)).await?);
        }
    }
    let during = w.tick(&a).await;
    assert_eq!(during.due, 0, "claimed tasks are not listed while the lease holds");
    w.clock.advance(crashed.settings.lease + Duration::from_secs(1));
    let after = w.tick(&a).await;
    assert_eq!(after.recovered, 5, "{after:?}");
    for (r, _) in tasks.iter().chain(&more) {
        assert!(matches!(w.state(r).await, TaskState::Solved { .. }));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_due_tasks_are_all_processed_across_ticks_and_pages() -> anyhow::Result<()> {
    const N: usize = 10_000;
    let w = world(FakeConfig::default()).await?;
    let ids = w.fake.preload_solved(N);
    let now = w.clock.now();
    // Recorded and submitted 32 at a time, as many API calls would.
    let mut set = tokio::task::JoinSet::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(32));
    for id in ids {
        let (store, sem) = (w.store.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await?;
            let task = Task::new(TaskRef::generate(), CaptchaKind::Image, now);
            store.create(&task, now).await?;
            let SubmitRecorded::Pending(_) =
                store.mark_submitted(&task.task_ref, &CaptchaId::parse(&id)?, now, now).await?
            else {
                anyhow::bail!("not pending")
            };
            anyhow::Ok(task.task_ref)
        });
    }
    let mut refs = Vec::with_capacity(N);
    while let Some(r) = set.join_next().await {
        refs.push(r??);
    }
    let (p, ops) = w.counted_poller(PollerSettings { max_tasks_per_tick: 2_500, ..settings() }, "bulk")?;
    let mut recovered = 0;
    let mut ticks = 0;
    while recovered < N as u64 && ticks < 10 {
        let r = w.tick(&p).await;
        recovered += r.recovered;
        ticks += 1;
    }
    assert_eq!(recovered, N as u64);
    assert!(ticks >= 4, "bounded work per tick: {ticks} ticks");
    assert_eq!(ops.count("Scan"), 0, "the poller never scans the table");
    assert!(ops.count("Query") >= (N as u64) / 100, "paged through the index: {} queries", ops.count("Query"));
    let requests = w.fake.counts().res_php;
    assert!(
        requests <= (N as u64) / 100 + ticks,
        "batched, up to 100 ids per request: {requests} requests in {ticks} ticks"
    );
    assert_eq!(w.fake.counts().res_php_ids, N as u64, "every task read exactly once");
    let sample = &refs[N - 1];
    assert!(matches!(w.state(sample).await, TaskState::Solved { via: Via::Poll, .. }));
    // Nothing left due, and a duplicate of any result changes nothing.
    assert_eq!(w.tick(&p).await.due, 0);
    let t = w.store.get(sample).await?.expect("stored");
    if let TaskState::Solved { solution, .. } = &t.state {
        let d = relay_shared::domain::Delivery {
            captcha_id: t.captcha_id.clone().expect("id"),
            outcome: relay_shared::domain::Outcome::Solved(solution.clone()),
            received_at: now,
            via: Via::Callback,
            token_clock_start: now,
        };
        assert!(matches!(w.store.record_result(sample, &d).await?, RecordOutcome::Duplicate(_)));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tick_without_time_left_stops_cleanly_and_leaves_the_work() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let tasks = w.submit_past_grace(5).await?;
    let p = w.poller(settings(), "p1")?;
    // The Lambda deadline has come: nothing is claimed or read.
    let late = poll_once(&p, w.clock.now(), Instant::now()).await;
    assert!(late.stopped_early, "{late:?}");
    assert_eq!((late.claimed, late.res_php_requests), (0, 0));
    assert_eq!(w.tick(&p).await.recovered, 5, "the next tick does the work");
    assert!(matches!(w.state(&tasks[0].0).await, TaskState::Solved { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_solution_recovered_after_its_lifetime_is_stored_but_reported_expired() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let recaptcha = r#"{"kind":"recaptcha_v2","sitekey":"6Le","pageurl":"https://a.example"}"#;
    let tasks = w.submit_body(1, recaptcha).await?;
    w.settle().await;
    // reCAPTCHA tokens live 120 s and res.php cannot say when it was solved: by the first poll
    // (grace 120 s + 1 s) the token may be older than its lifetime.
    w.clock.advance(Duration::from_secs(121));
    assert_eq!(w.tick(&w.poller(settings(), "p1")?).await.recovered, 1);
    assert!(matches!(w.state(&tasks[0].0).await, TaskState::Solved { via: Via::Poll, .. }), "stored as solved");
    let seen: serde_json::Value =
        w.http.get(format!("{}/tasks/{}", w.base, tasks[0].0)).bearer_auth(KEY).send().await?.json().await?;
    assert_eq!(seen["status"], "expired", "{seen}");
    assert!(seen.get("solution").is_none(), "a stale token is not handed out: {seen}");
    assert_eq!(seen["resolved_via"], "poll");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_scheduler_invocation_runs_one_tick_within_its_deadline() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    w.submit_past_grace(3).await?;
    let p = w.poller(settings(), "lambda")?;
    let payload: serde_json::Value = serde_json::from_str(include_str!("fixtures/scheduler-event.json"))?;
    let mut ctx = lambda_runtime::Context::default();
    ctx.deadline = w.clock.now().as_millis() + 55_000;
    let report = relay_poller::handle(lambda_runtime::LambdaEvent::new(payload.clone(), ctx.clone()), &p, &w.clock)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!((report.recovered, report.stopped_early), (3, false), "{report:?}");
    // An invocation whose deadline has already passed does no work.
    w.submit_past_grace(2).await?;
    ctx.deadline = w.clock.now().as_millis();
    let late = relay_poller::handle(lambda_runtime::LambdaEvent::new(payload, ctx), &p, &w.clock)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert!(late.stopped_early && late.res_php_requests == 0, "{late:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_result_the_poller_cannot_store_becomes_a_dead_letter() -> anyhow::Result<()> {
    let w = world(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let tasks = w.submit_past_grace(3).await?;
    let flaky = FlakyDynamo::start(&w.db.endpoint).await?;
    let sink = MemorySink::default();
    let mut p = w.poller(settings(), "p1")?;
    p.store = flaky.store(w.store.table());
    p.dead_letters = Arc::new(sink.clone());
    // With the store down nothing can even be listed: the tick does nothing and says so.
    flaky.set_failing(true);
    let down = w.tick(&p).await;
    assert_eq!((down.claimed, down.dead_lettered, down.errors), (0, 0, 4), "{down:?}");
    flaky.set_failing(false);
    // Listing and claiming work, but every write of a result fails.
    flaky.set_failing_matching(Some(":solution"));
    let got = w.tick(&p).await;
    assert_eq!((got.claimed, got.dead_lettered, got.recovered), (3, 3, 0), "{got:?}");
    let letters = sink.taken();
    assert_eq!(letters.len(), 3);
    for (r, id) in &tasks {
        let l = letters.iter().find(|l| l.task_ref == r.as_ref()).expect("a letter per task");
        assert_eq!((l.captcha_id.as_str(), l.via.as_str()), (id.as_str(), "poll"));
        assert_eq!(Some(l.code.clone()), w.fake.task(id).and_then(|t| t.answer));
    }
    Ok(())
}
