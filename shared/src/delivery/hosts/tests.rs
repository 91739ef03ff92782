//! The per-host gate against the embedded store on a manual clock.

use super::*;
use crate::testkit::LocalDynamo;
use relay_time::ManualClock;

fn settings(ceiling: u32, rate: u32) -> DeliverySettings {
    DeliverySettings { per_host_concurrency: ceiling, per_host_per_second: rate, ..DeliverySettings::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_earliest_deadline_goes_first_and_slots_are_handed_over() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
    let s = DeliverySettings { per_host_concurrency: 1, ..settings(1, 50) };
    let gates = HostGates::default();
    let gate = gates.gate("owner.example");
    let c: &dyn Clock = &clock;
    let now = clock.now();
    let first = gate
        .acquire(&store.pushes(), now.plus(Duration::from_secs(100)), now.plus(Duration::from_secs(10)), c, &s)
        .await;
    let first = first.expect("a free host");
    // Three more wait; they were queued late-deadline first.
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waits = tokio::task::JoinSet::new();
    for (i, (name, deadline)) in [("late", 300u64), ("soon", 50), ("middle", 120)].into_iter().enumerate() {
        let (g, store, clock, s, order) = (gate.clone(), store.clone(), clock.clone(), s.clone(), order.clone());
        waits.spawn(async move {
            let gate = g;
            let c: &dyn Clock = &clock;
            let now = c.now();
            let p = gate
                .acquire(
                    &store.pushes(),
                    now.plus(Duration::from_secs(deadline)),
                    now.plus(Duration::from_secs(10)),
                    c,
                    &s,
                )
                .await;
            let p = p.expect("a turn in time");
            order.lock().expect("lock").push(name);
            gate.release(p, &store.pushes(), Signal::Ok, c, &s).await;
        });
        while gate.lock().waiting.len() < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    gate.release(first, &store.pushes(), Signal::Ok, c, &s).await;
    while waits.join_next().await.is_some() {}
    assert_eq!(*order.lock().expect("lock"), ["soon", "middle", "late"]);
    assert!(gate.lock().waiting.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_grows_under_demand_and_halves_on_overload_and_slow_requests_do_not_count() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
    let s = settings(64, 1_000);
    let gates = HostGates::default();
    let gate = gates.gate("owner.example");
    let c: &dyn Clock = &clock;
    let far = clock.now().plus(Duration::from_secs(60));
    // Eight slots at the initial limit; the ninth must wait.
    let mut held = Vec::new();
    for _ in 0..INITIAL_LIMIT {
        held.push(
            gate.acquire(&store.pushes(), far, clock.now().plus(Duration::from_secs(10)), c, &s).await.expect("slot"),
        );
    }
    let ninth = gate.acquire(&store.pushes(), far, clock.now(), c, &s).await;
    assert!(ninth.is_none(), "over the limit and out of time");
    // Two seconds on, the eight are slow: they no longer count, so more may start.
    clock.advance(Duration::from_secs(2));
    let p = gate.acquire(&store.pushes(), far, clock.now(), c, &s).await.expect("slow requests do not hold it up");
    // A success that waited raises the limit; an overload answer halves it.
    let mut p = p;
    p.waited = true;
    gate.release(p, &store.pushes(), Signal::Ok, c, &s).await;
    let raised = INITIAL_LIMIT + 1;
    assert_eq!(store.pushes().host_record("owner.example").await?.limit, Some(raised));
    let p = held.pop().expect("held");
    gate.release(p, &store.pushes(), Signal::Overloaded, c, &s).await;
    assert_eq!(store.pushes().host_record("owner.example").await?.limit, Some(raised / 2));
    // Not twice within a second.
    let p = held.pop().expect("held");
    gate.release(p, &store.pushes(), Signal::Overloaded, c, &s).await;
    assert_eq!(store.pushes().host_record("owner.example").await?.limit, Some(raised / 2));
    for p in held {
        gate.release(p, &store.pushes(), Signal::Neutral, c, &s).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_never_hold_more_than_the_ceiling_together() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
    let s = settings(3, 1_000);
    let (a, b) = (HostGates::default(), HostGates::default());
    let c: &dyn Clock = &clock;
    let far = clock.now().plus(Duration::from_secs(60));
    let mut held = Vec::new();
    for gates in [&a, &b, &a, &b, &a, &b] {
        // Each process would allow 8 (its initial limit) on its own view.
        if let Some(p) = gates.gate("h").acquire(&store.pushes(), far, clock.now(), c, &s).await {
            held.push(p);
        }
    }
    assert_eq!(held.len(), 3, "the shared record's ceiling holds across processes");
    Ok(())
}

/// The record is spread over items of 32 slots: a ceiling of 40 spans two, and two
/// processes together still hold exactly 40 (each process learns the other's slots only
/// from the answers of the items it writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ceiling_holds_across_the_records_items() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
    let s = settings(40, 1_000);
    let (a, b) = (HostGates::default(), HostGates::default());
    let c: &dyn Clock = &clock;
    let far = clock.now().plus(Duration::from_secs(60));
    let mut held = Vec::new();
    // Each round both processes ask 8 times; then the held requests turn slow and stop
    // counting against the limit (8), so the next round may start more, up to the ceiling.
    for _ in 0..6 {
        for gates in [&a, &b].repeat(8) {
            if let Some(p) = gates.gate("h").acquire(&store.pushes(), far, clock.now(), c, &s).await {
                held.push(p);
            }
        }
        clock.advance(SLOW_AFTER);
    }
    assert_eq!(held.len(), 40, "the ceiling holds across processes and items");
    let record = store.pushes().host_record("h").await?;
    let items: BTreeSet<u32> = record.held(clock.now()).map(|(i, _)| item_of(i)).collect();
    assert_eq!(items, BTreeSet::from([0, 1]), "both items hold slots");
    assert_eq!(record.held(clock.now()).count(), 40);
    Ok(())
}
