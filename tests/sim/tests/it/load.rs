//! The load simulation's short version (issue 25): the whole path — submits through `POST /tasks`
//! and `/in.php`, the submitter's release, pingbacks with a share dropped, the poller, a
//! dead-letter → redrive episode, pushes to an owner receiver — at a steady rate on the simulated
//! clock, against the embedded engine behind the model of DynamoDB's per-partition limits, with a
//! throttling burst in the middle. The documented run is `cargo run --profile sim -p relay-sim --bin
//! load` (tests/sim/LOAD.md).

use relay_sim::load::{LoadConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_path_under_load_owes_nothing_and_keeps_every_key_under_its_limit() -> anyhow::Result<()> {
    let cfg = LoadConfig::short();
    let r = run(&cfg).await?;
    println!("load, {} tasks/s for {} s:\n{}", cfg.rate, cfg.duration.as_secs(), r.table());
    let expected = u64::from(cfg.rate) * cfg.duration.as_secs();
    assert_eq!(r.attempted, expected);
    assert_eq!(r.accepted as u64, expected, "every submit accepted");
    // Every episode happened and was measured.
    assert!(r.by_poll > 0, "the poller fetched the dropped pingbacks' results");
    assert!(r.dead_letter_faults > 0 && r.by_redrive > 0, "results dead-lettered and redriven");
    assert!(r.meter.throttled_total() > 0, "the burst throttled some keys");
    assert!(r.delivered > 0 && r.with_callback > 0);
    assert!(r.meter.wcu > 0.0 && r.meter.ops.contains_key("PutItem table"), "the meter saw the relay's writes");
    // The guarantees: owed 0, lost 0, paid once, no key above its limit at DynamoDB's limits.
    let broken = r.violations();
    assert!(broken.is_empty(), "{broken:#?}");
    Ok(())
}
