//! `fake-captchaai [--bind 127.0.0.1:8089]`: the fake CaptchaAI as a standalone server.
//! Knobs: `POST /_fake/config` with a JSON `FakeConfig` (fields left out take their defaults;
//! e.g. `{"threads": 5}` for a 5-thread plan answering `ERROR_NO_SLOT_AVAILABLE` when full);
//! counters, tasks in work, their peak and the most NO_SLOT answers in a minute at
//! `GET /_fake/stats`.

use fake_captchaai::{FakeCaptchaAi, FakeConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut bind = "127.0.0.1:8089".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bind" => bind = args.next().ok_or_else(|| anyhow::anyhow!("--bind needs an address"))?,
            other => anyhow::bail!("unknown argument `{other}` (usage: fake-captchaai [--bind ADDR])"),
        }
    }
    let fake = FakeCaptchaAi::start_on(&bind, FakeConfig::default()).await?;
    println!("fake CaptchaAI listening on {} (key {})", fake.base_url(), fake.api_key());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
