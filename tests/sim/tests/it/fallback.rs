//! The fallback path under the template's own settings, on a simulated clock, against a fake
//! CaptchaAI with realistic solve times, no `ids=`, and its ban rules enforced.

use std::time::Duration;

use fake_captchaai::FakeConfig;
use relay_shared::domain::CaptchaKind;
use relay_shared::time::Clock;
use relay_sim::{EPOCH, World, steady};

const MIX: [CaptchaKind; 5] = [
    CaptchaKind::RecaptchaV2,
    CaptchaKind::RecaptchaEnterprise,
    CaptchaKind::Turnstile,
    CaptchaKind::Image,
    CaptchaKind::RecaptchaV2,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freshness_with_30_percent_of_callbacks_dropped() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 0.3, ..FakeConfig::captchaai_like() }).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(600), 600, &MIX), Duration::from_secs(2));
    w.run_for(Duration::from_secs(600 + 900)).await;
    let f = w.figures().await?;
    println!("{}", f.table("freshness: 600 tasks over 10 min, 30 % of callbacks dropped, template defaults"));
    assert_eq!((f.lost, f.stale_handed_out, f.open), (0, 0, 0), "{}", f.table("failed"));
    assert!(f.by_poll > 100, "the poller recovered the dropped ones");
    assert!(f.fresh_share() >= 0.95, "usable tokens: {}", f.table("failed"));
    assert_eq!(f.over_deadline, 0);
    assert_eq!(f.bans, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_callbacks_work_res_php_is_almost_never_read() -> anyhow::Result<()> {
    let w = World::start(FakeConfig::captchaai_like()).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(600), 500, &MIX), Duration::from_secs(5));
    w.run_for(Duration::from_secs(600 + 300)).await;
    let f = w.figures().await?;
    println!("{}", f.table("callbacks working: 500 tasks over 10 min, template defaults"));
    assert_eq!((f.lost, f.open, f.stale_handed_out), (0, 0, 0), "{}", f.table("failed"));
    assert!(f.reads_per_task() <= 0.2, "res.php reads per task while callbacks work: {:.2}", f.reads_per_task());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_after_a_ten_minute_callback_outage_is_drained_without_stalls_or_bans() -> anyhow::Result<()> {
    // 5,000 tasks during a 10-minute callback outage (every pingback lost), then callbacks work
    // again; batching off, 10 reads/s, first reads at the template's per-kind times.
    let mut w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::captchaai_like() }).await?;
    let (client, ops) = w.db.counting_client();
    w.poller.store = relay_poller::Store::new(&relay_shared::store::TaskStore::new(
        client,
        w.store.table(),
        Duration::from_secs(86_400),
    ));
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(600), 5_000, &MIX), None);
    w.run_for(Duration::from_secs(600)).await;
    w.fake.configure(|c| c.drop_callbacks = 0.0);
    w.run_for(Duration::from_secs(900)).await;
    let f = w.figures().await?;
    println!("{}", f.table("backlog: 5,000 tasks during a 10-minute callback outage, batching off"));
    assert_eq!((f.tasks, f.lost, f.open, f.expired), (5_000, 0, 0, 0), "{}", f.table("failed"));
    // Every lost pingback's result recovered by the poller; the few tasks solved after the
    // callbacks came back (submitted in the outage's last seconds) may arrive by pingback first.
    assert_eq!(f.by_poll + f.by_callback, 5_000, "every one recovered");
    assert!(f.by_callback <= 50, "only tasks solved after the outage come by pingback: {}", f.by_callback);
    assert_eq!(f.over_deadline, 0, "no invocation ran past its deadline");
    assert!(f.max_reads() <= 20, "per-task budget: {}", f.max_reads());
    assert_eq!((f.bans, f.requests_during_ban), (0, 0), "never banned");
    assert_eq!(ops.count("Scan"), 0, "the poller never scans");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_stops_all_traffic_within_one_request_and_nothing_is_lost() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 1.0, ..FakeConfig::captchaai_like() }).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(120), 200, &MIX), Duration::from_secs(5));
    // Mid-run, with tasks falling due every second, CaptchaAI bans the IP for 5 minutes.
    w.run_for(Duration::from_secs(150)).await;
    let before = w.fake.counts().res_php;
    w.fake.ban_ip(Duration::from_secs(300));
    let banned_at = w.clock.now();
    w.run_for(Duration::from_secs(300)).await;
    let during = w.fake.counts();
    assert_eq!(during.requests_during_ban, 1, "the first answer opened the breaker; nothing after it");
    assert_eq!(during.res_php, before + 1);
    let breaker = w.store.account().breaker().await?;
    assert_eq!(breaker.reason.as_deref(), Some("IP_BANNED"));
    assert!(breaker.open_until.is_some_and(|u| u >= banned_at.plus(Duration::from_secs(300))));
    w.run_for(Duration::from_secs(600)).await;
    let f = w.figures().await?;
    println!("{}", f.table("ban: IP_BANNED for 5 minutes mid-run"));
    println!("res.php requests sent after the breaker opened, during the ban: {}", during.requests_during_ban - 1);
    assert!(w.fake.counts().res_php > during.res_php, "traffic resumed after the ban");
    assert_eq!((f.lost, f.open, f.expired, f.requests_during_ban), (0, 0, 0, 1), "{}", f.table("failed"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_that_never_solve_cost_at_most_the_budget_and_end_after_a_last_read() -> anyhow::Result<()> {
    // The worst case for res.php traffic: nothing ever solves and no pingback comes.
    let w =
        World::start(FakeConfig { drop_callbacks: 1.0, solve_delay_ms: 86_400_000, ..FakeConfig::default() }).await?;
    w.schedule_poller(EPOCH);
    let n = 200;
    w.start_owner(steady(EPOCH, Duration::from_secs(60), n, &MIX), None);
    w.run_for(Duration::from_secs(60 + 700)).await;
    let f = w.figures().await?;
    let c = w.fake.counts();
    println!("{}", f.table("budget: 200 tasks that never solve"));
    println!("budget: {} res.php requests for {n} unsolved tasks ({:.1} per task)", c.res_php, f.reads_per_task());
    assert!(f.max_reads() <= 20, "per-task budget: {}", f.max_reads());
    assert!(c.res_php <= 20 * c.in_php + 1200, "ban rule R <= 20C + 1200: R={} C={}", c.res_php, c.in_php);
    assert_eq!((f.expired, f.open, c.bans), (n, 0, 0));
    let inv = w.invocations();
    assert!(inv.iter().map(|i| i.report.last_reads).sum::<u64>() > 0, "expired only after a last read");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn around_the_deadline_a_paid_result_is_recorded_or_kept_never_dropped() -> anyhow::Result<()> {
    // Solved 590 s after submit, pingback lost: only the last read at the deadline finds it.
    let w = World::start(FakeConfig { drop_callbacks: 1.0, solve_delay_ms: 590_000, ..FakeConfig::default() }).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(10), 5, &[CaptchaKind::Image]), Duration::from_secs(5));
    w.run_for(Duration::from_secs(900)).await;
    let f = w.figures().await?;
    println!("{}", f.table("deadline: solved at 590 s, pingback lost"));
    assert_eq!((f.lost, f.by_poll, f.expired), (0, 5, 0), "{}", f.table("failed"));

    // Solved 700 s after submit (after the deadline), pingback delivered: the task had expired,
    // and the result is kept on it and shown as its late result.
    let w = World::start(FakeConfig { solve_delay_ms: 700_000, ..FakeConfig::default() }).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(10), 5, &[CaptchaKind::Turnstile]), Duration::from_secs(5));
    // Looked at 60 s after the late pingbacks, while the tokens (300 s from the last "not ready")
    // still live.
    w.run_for(Duration::from_secs(770)).await;
    let f = w.figures().await?;
    println!("{}", f.table("deadline: solved at 700 s, pingback delivered after the expiry"));
    assert_eq!((f.lost, f.expired, f.stale_handed_out), (0, 5, 0), "{}", f.table("failed"));
    let http = reqwest::Client::new();
    for o in w.owned() {
        assert_eq!(o.status, "expired", "the owner was told it expired at the deadline");
        let v: serde_json::Value =
            http.get(format!("{}/tasks/{}", w.base, o.task_ref)).bearer_auth(&w.api_key).send().await?.json().await?;
        let id = o.captcha_id.expect("id");
        assert_eq!(v["status"], "expired", "{v}");
        assert_eq!(v["late_result"]["status"], "solved", "the late result is shown: {v}");
        assert_eq!(v["late_result"]["received_via"], "callback");
        assert_eq!(v["late_result"]["solution"].as_str().map(str::to_owned), w.fake.task(&id).and_then(|t| t.answer));
    }
    // Once past their lifetime the late tokens are kept (paid for) but no longer handed out.
    w.run_for(Duration::from_secs(300)).await;
    for o in w.owned() {
        let v: serde_json::Value =
            http.get(format!("{}/tasks/{}", w.base, o.task_ref)).bearer_auth(&w.api_key).send().await?.json().await?;
        assert_eq!(v["late_result"]["status"], "stale", "{v}");
        assert!(v["late_result"].get("solution").is_none(), "a stale late token is not handed out: {v}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_5xx_html_and_slow_answers_pause_reads_and_lose_nothing() -> anyhow::Result<()> {
    use fake_captchaai::{Endpoint, Fault, FaultKind};
    let at = |s: u64| EPOCH.as_millis() + s * 1000;
    let faults = vec![
        Fault { from_ms: at(90), until_ms: at(150), endpoint: Endpoint::ResPhp, kind: FaultKind::Http5xx },
        Fault { from_ms: at(200), until_ms: at(260), endpoint: Endpoint::ResPhp, kind: FaultKind::Html },
        // Slower than the poller's 5 s read timeout (real time, so short and rare).
        Fault { from_ms: at(300), until_ms: at(302), endpoint: Endpoint::ResPhp, kind: FaultKind::Slow { ms: 5_500 } },
    ];
    let w = World::start(FakeConfig { drop_callbacks: 1.0, faults, ..FakeConfig::captchaai_like() }).await?;
    w.schedule_poller(EPOCH);
    w.start_owner(steady(EPOCH, Duration::from_secs(300), 300, &MIX), Duration::from_secs(5));
    w.run_for(Duration::from_secs(300 + 700)).await;
    let f = w.figures().await?;
    let c = w.fake.counts();
    println!("{}", f.table("5xx burst (60 s), HTML burst (60 s), slow answers: every callback lost"));
    println!("answers from fault windows: {}", c.fault_answers);
    let opened: Vec<String> = w.invocations().iter().filter_map(|i| i.report.breaker_opened_by.clone()).collect();
    println!("breaker opened by: {opened:?}");
    assert_eq!((f.lost, f.open, f.stale_handed_out, f.over_deadline, f.bans), (0, 0, 0, 0, 0), "{}", f.table("failed"));
    assert_eq!(f.tasks, 300, "res.php trouble pauses reads, not submits");
    assert!(
        opened.iter().any(|o| o.contains("missing in a row")),
        "runs of missing answers open the breaker: {opened:?}"
    );
    // Each 60 s burst costs a handful of requests, not 600: the breaker pauses reads for a minute.
    assert!(c.fault_answers <= 40, "requests answered by the faults: {}", c.fault_answers);
    assert!(f.max_reads() <= 20);
    Ok(())
}
