//! The chaos run's short configuration (the full one is `cargo run --release -p relay-sim --bin
//! chaos`): every fault at once, the template's settings, checked against the fake — and every
//! log line and metric of the run searched for the keys, the signing secret and every token.

use relay_sim::chaos::{ChaosConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_short_chaos_run_keeps_every_guarantee_and_logs_no_secret() -> anyhow::Result<()> {
    let logs = relay_sim::logs::capture();
    let report = run(&ChaosConfig::short(7)).await?;
    println!("{}", report.table());
    assert!(report.violations().is_empty(), "{:?}\n{}", report.violations(), report.table());
    // Every fault really happened.
    let f = &report.figures;
    assert!(f.by_callback > 0 && f.by_poll > 0 && f.by_redrive > 0, "all three paths: {}", report.table());
    assert!(report.store_faults > 0 && report.dead_letters_written > 0 && report.conflicting_sent > 0);
    assert_eq!(report.fake_bans, 1, "the injected ban");
    // No secret, key or token in any log line or metric of the run.
    let text = logs.text();
    assert!(text.lines().count() > 1_000, "the relay logged its work ({} lines)", text.lines().count());
    assert!(report.secrets.len() > 100, "tokens to look for: {}", report.secrets.len());
    assert_eq!(report.leaks(&logs), Vec::<String>::new(), "secrets or tokens in the logs");
    Ok(())
}
