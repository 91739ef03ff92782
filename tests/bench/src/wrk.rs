//! Part `wrk` of the bench.

use crate::Opts;

pub async fn run(_opts: &Opts) -> anyhow::Result<String> {
    anyhow::bail!("part `wrk` is not written yet")
}
