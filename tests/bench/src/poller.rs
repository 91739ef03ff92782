//! Part `poller` of the bench.

use crate::Opts;

pub async fn run(_opts: &Opts) -> anyhow::Result<String> {
    anyhow::bail!("part `poller` is not written yet")
}
