//! What the tests that run the `relay-local` binary share: starting it against a fake that
//! lives in the test process (so the fake outlives a killed relay), and waiting for it.

#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fake_captchaai::FakeCaptchaAi;

/// A running `relay-local serve`; killed when dropped.
pub struct Relay(pub std::process::Child);

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn tmp_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("relay-local-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("tmp dir");
    d
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// `relay-local serve` on `port` and `data`, with `fake` as CaptchaAI, the poller every second
/// and a 5 s callback grace (local mode's test settings), `api_key`, and `extra` settings (an
/// empty value unsets the setting: `("CALLBACK_GRACE_SECS", "")` keeps the per-kind default).
pub fn spawn_relay(
    port: u16,
    data: &std::path::Path,
    fake: &FakeCaptchaAi,
    api_key: &str,
    extra: &[(&str, &str)],
) -> Relay {
    let child = Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .arg("serve")
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", data)
        .env("RELAY_API_KEY", api_key)
        .env("CALLBACK_SIGNING_SECRET", "local-test-signing-secret")
        .env("CAPTCHAAI_API_KEY", fake.api_key())
        .env("CAPTCHAAI_BASE_URL", fake.base_url())
        .env("RELAY_PUBLIC_URL", format!("http://127.0.0.1:{port}"))
        .env("POLL_INTERVAL_SECS", "1")
        .env("CALLBACK_GRACE_SECS", "5")
        .envs(extra.iter().copied().filter(|(_, v)| !v.is_empty()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_unset(extra)
        .expect("spawn relay-local");
    Relay(child)
}

trait SpawnUnset {
    fn spawn_unset(&mut self, extra: &[(&str, &str)]) -> std::io::Result<std::process::Child>;
}

impl SpawnUnset for Command {
    fn spawn_unset(&mut self, extra: &[(&str, &str)]) -> std::io::Result<std::process::Child> {
        for (k, _) in extra.iter().filter(|(_, v)| v.is_empty()) {
            self.env_remove(k);
        }
        self.spawn()
    }
}

pub async fn wait_healthy(http: &reqwest::Client, port: u16) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if http.get(format!("http://127.0.0.1:{port}/health")).send().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("relay never became healthy")
}
