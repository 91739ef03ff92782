//! Part `callback` of the bench.

use crate::Opts;

pub async fn run(_opts: &Opts) -> anyhow::Result<String> {
    anyhow::bail!("part `callback` is not written yet")
}
