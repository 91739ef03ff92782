//! Tests of the operator functions the crate root holds.

#[test]
fn the_shards_report_says_when_the_previous_count_can_go() {
    let rows = [(0, 3, 1), (1, 0, 0), (5, 2, 0)];
    let r = super::shards_report(&rows, Some(4));
    assert!(r.contains("2 entries at or above shard 4"), "{r}");
    assert!(!r.contains("\n    1 "), "empty shards are left out: {r}");
    let r = super::shards_report(&rows[..2], Some(4));
    assert!(r.contains("can go back to 0"), "{r}");
}
