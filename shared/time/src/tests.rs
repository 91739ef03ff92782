//! Tests of the timestamps, the system and simulated clocks, and the parked waiter.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_waiting_on_a_sleeping_child_is_nudged_past_not_stuck_forever() {
    let clock = ManualClock::at(Timestamp::from_millis(0));
    clock.set_stuck_after(Duration::from_millis(200));
    // The parent holds a guard while it waits for its child (not on the clock); the child
    // holds its own and sleeps 5 s: busy 2, asleep 1 — the gap that stalls a simulation.
    let parent_busy = clock.busy();
    let (c, child_busy) = (clock.clone(), clock.busy());
    let parent = tokio::spawn(async move {
        let _busy = parent_busy;
        tokio::spawn(async move {
            let _busy = child_busy;
            c.sleep_until(Timestamp::from_millis(5_000)).await;
        })
        .await
        .ok();
    });
    tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(10_000)))
        .await
        .expect("the simulation ends instead of standing still");
    assert!(parent.await.is_ok());
    assert_eq!(clock.nudges(), 1, "moved on once, past the stall");
    assert_eq!(clock.now(), Timestamp::from_millis(10_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_lets_the_clock_move_for_its_children_and_acts_on_each_end_before_it_moves_on() {
    let clock = ManualClock::at(Timestamp::from_millis(0));
    clock.set_stuck_after(Duration::from_secs(5));
    // Another actor sleeps until 60 s: the clock must not jump there between a child's end
    // and the parent's turn.
    let (c, other) = (clock.clone(), clock.busy());
    tokio::spawn(async move {
        let _busy = other;
        c.sleep_until(Timestamp::from_millis(60_000)).await;
    });
    let (c, parent_busy) = (clock.clone(), clock.busy());
    let parent = tokio::spawn(async move {
        let _busy = parent_busy;
        let waiter = c.waiter();
        let mut children = tokio::task::JoinSet::new();
        for s in [5u64, 10, 15] {
            let (c, busy) = (c.clone(), waiter.busy());
            children.spawn(async move {
                let _busy = busy;
                c.sleep_until(Timestamp::from_millis(s * 1_000)).await;
            });
        }
        let mut seen = Vec::new();
        while waiter.wait(children.join_next()).await.is_some() {
            seen.push(c.now().as_millis());
            // The parent's own work after each end: the clock waits for it.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen
    });
    tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(90_000)))
        .await
        .expect("the simulation runs to its end");
    assert_eq!(parent.await.ok(), Some(vec![5_000, 10_000, 15_000]), "each end seen at its own time");
    assert_eq!(clock.nudges(), 0, "no stall to move past");
}

#[test]
fn formats_rfc3339_in_utc_with_millis() {
    assert_eq!(Timestamp::from_millis(1_796_210_146_123).to_rfc3339(), "2026-12-02T11:15:46.123Z");
    assert_eq!(Timestamp::parse_rfc3339("2026-12-02T11:15:46.123Z"), Some(Timestamp::from_millis(1_796_210_146_123)));
    assert_eq!(Timestamp::parse_rfc3339("yesterday"), None);
}

#[test]
fn arithmetic_saturates_instead_of_panicking() {
    let t = Timestamp::from_millis(1_000);
    assert_eq!(t.since(Timestamp::from_millis(5_000)), Duration::ZERO);
    assert_eq!(Timestamp::from_millis(u64::MAX).plus(Duration::from_secs(1)).as_millis(), u64::MAX);
    assert_eq!(t.minus(Duration::from_secs(5)).as_millis(), 0);
}

#[test]
fn manual_clock_moves_only_when_told() {
    let clock = ManualClock::at(Timestamp::from_millis(10));
    clock.advance(Duration::from_millis(5));
    assert_eq!(clock.now(), Timestamp::from_millis(15));
}

#[tokio::test]
async fn a_sleep_ends_when_the_clock_reaches_it_not_before() {
    let clock = ManualClock::at(Timestamp::from_millis(0));
    let (c, done) = (clock.clone(), Arc::new(AtomicBool::new(false)));
    let d = done.clone();
    let h = tokio::spawn(async move {
        c.sleep_until(Timestamp::from_millis(1_000)).await;
        d.store(true, Ordering::SeqCst);
    });
    tokio::task::yield_now().await;
    while clock.next_wake().is_none() {
        tokio::task::yield_now().await;
    }
    clock.set(Timestamp::from_millis(999));
    tokio::task::yield_now().await;
    assert!(!done.load(Ordering::SeqCst), "not yet");
    clock.set(Timestamp::from_millis(1_000));
    h.await.expect("sleeper");
    assert!(done.load(Ordering::SeqCst));
    assert_eq!(clock.next_wake(), None, "a finished sleep is deregistered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulation_jumps_between_wakes_and_waits_for_work() {
    // Two actors tick every 10 s and 15 s of simulated time for a simulated hour; each tick
    // does a little real work. The run takes far less than a second of real time.
    let clock = ManualClock::at(Timestamp::from_millis(0));
    let ticks = Arc::new(Mutex::new(Vec::new()));
    for every in [10_000u64, 15_000] {
        let (c, ticks) = (clock.clone(), ticks.clone());
        let busy = c.busy();
        tokio::spawn(async move {
            let _busy = busy;
            let mut next = every;
            while next <= 3_600_000 {
                c.sleep_until(Timestamp::from_millis(next)).await;
                tokio::time::sleep(Duration::from_micros(50)).await; // real work, no sim time
                ticks.lock().expect("lock").push((every, c.now().as_millis()));
                next += every;
            }
        });
    }
    let started = std::time::Instant::now();
    clock.run_until(Timestamp::from_millis(3_600_000)).await;
    let got = ticks.lock().expect("lock").clone();
    assert_eq!(got.len(), 360 + 240, "every tick ran");
    assert!(got.iter().all(|(every, at)| at % every == 0), "each ran exactly at its time");
    assert!(started.elapsed() < Duration::from_secs(20), "an hour simulated in {:?}", started.elapsed());
    assert_eq!(clock.now(), Timestamp::from_millis(3_600_000));
}
