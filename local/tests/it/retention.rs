//! Retention kept in local mode (issue 37): tasks solved through a running relay, the relay
//! stopped and started again on the same data directory with its clock 8 days on (past the
//! default `RETENTION_DAYS`, 7). No read hands a result out — `GET /tasks/{ref}` 404, `res.php`
//! `ERROR_WRONG_CAPTCHA_ID`, the operator's listing empty — and within the sweep that runs at
//! start no byte of any solution is left in any file of the data directory. An erasure request
//! (`relay-local erase --key <name>`, the binary) deletes one owner's tasks at once, and their
//! bytes, while the other owner's stay.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use fake_captchaai::FakeConfig;
use relay_local::run::{LocalConfig, Options, Running, start};
use relay_shared::time::{Clock, Sleep, SystemClock, Timestamp};

/// The system's clock, `offset` ahead: a relay run 8 days after the last.
#[derive(Debug)]
struct Ahead(Duration);

impl Clock for Ahead {
    fn now(&self) -> Timestamp {
        SystemClock.now().plus(self.0)
    }

    fn sleep_until(&self, t: Timestamp) -> Sleep {
        Box::pin(tokio::time::sleep(t.since(self.now())))
    }
}

fn data_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("relay-retention-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Every byte of every file under `dir`.
fn all_bytes(dir: &Path) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if p.is_dir() {
            out.extend(all_bytes(&p)?);
        } else {
            out.extend(std::fs::read(&p)?);
        }
    }
    Ok(out)
}

fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Submits `n` Turnstile tasks through `/in.php` with `key`; their ids.
async fn submit(http: &reqwest::Client, relay: &Running, key: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let text = http
            .post(format!("{}/in.php", relay.base_url))
            .form(&[("key", key), ("method", "turnstile"), ("sitekey", "0x4AAA"), ("pageurl", "https://a.example/")])
            .send()
            .await?
            .text()
            .await?;
        ids.push(text.strip_prefix("OK|").with_context(|| format!("in.php answered {text}"))?.to_owned());
    }
    Ok(ids)
}

/// res.php's answer for `id`.
async fn res(http: &reqwest::Client, relay: &Running, key: &str, id: &str) -> anyhow::Result<String> {
    let url = format!("{}/res.php?key={key}&action=get&id={id}", relay.base_url);
    Ok(http.get(url).send().await?.text().await?)
}

/// Waits until every id is solved; their tokens.
async fn tokens(http: &reqwest::Client, relay: &Running, key: &str, ids: &[String]) -> anyhow::Result<Vec<String>> {
    let until = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    for id in ids {
        loop {
            let a = res(http, relay, key, id).await?;
            if let Some(t) = a.strip_prefix("OK|") {
                out.push(t.to_owned());
                break;
            }
            ensure!(Instant::now() < until, "{id} not solved: {a}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_retention_a_result_is_refused_and_gone_from_the_disk_and_erasure_is_at_once() -> anyhow::Result<()> {
    let dir = data_dir();
    let cfg = LocalConfig { bind: "127.0.0.1:0".into(), data_dir: dir.clone(), ..LocalConfig::default() };
    assert_eq!(cfg.retention_days, 7, "the default, as on AWS");
    let fake = || FakeConfig { solve_delay_ms: 50, ..FakeConfig::default() };
    let http = reqwest::Client::new();

    // Day 0: two owners' tasks solved — local mode's own key and a relay key.
    let relay = start(&cfg, Options { fake: Some(fake()), ..Options::default() }).await?;
    let key = relay.api_key.clone();
    let other = relay.store.key_admin().create_relay_key("leaver", SystemClock.now()).await?;
    let other = secrecy::ExposeSecret::expose_secret(&other).to_owned();
    let kept_ids = submit(&http, &relay, &key, 10).await?;
    let erased_ids = submit(&http, &relay, &other, 5).await?;
    let kept = tokens(&http, &relay, &key, &kept_ids).await?;
    let erased = tokens(&http, &relay, &other, &erased_ids).await?;
    let before = all_bytes(&dir)?;
    ensure!(kept.iter().chain(&erased).all(|t| holds(&before, t)), "the solutions are on disk while kept");

    // An erasure request for the relay key `leaver`, through the binary, the relay running.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .args(["erase", "--key", "leaver"])
        .env("RELAY_DATA_DIR", &dir)
        .output()?;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "erase failed: {said}{}", String::from_utf8_lossy(&out.stderr));
    ensure!(said.contains("erased 5 task(s) of `key:leaver`"), "{said}");
    let after_erase = all_bytes(&dir)?;
    for (id, t) in erased_ids.iter().zip(&erased) {
        ensure!(res(&http, &relay, &other, id).await? == "ERROR_WRONG_CAPTCHA_ID", "{id} still answered");
        ensure!(!holds(&after_erase, t), "an erased solution is still in the data directory");
    }
    ensure!(res(&http, &relay, &key, &kept_ids[0]).await?.starts_with("OK|"), "another owner's task stays");
    relay.shutdown().await;

    // Day 8: the same data, the relay's clock 8 days on.
    let ahead: Arc<dyn Clock> = Arc::new(Ahead(Duration::from_secs(8 * 86_400)));
    let relay = start(&cfg, Options { fake: Some(fake()), clock: Some(ahead), ..Options::default() }).await?;
    let started = Instant::now();
    for id in &kept_ids {
        ensure!(res(&http, &relay, &key, id).await? == "ERROR_WRONG_CAPTCHA_ID", "{id} handed out past retention");
        let r = relay_shared::domain::TaskRef::from_compat_id(id)?;
        let get = http.get(format!("{}/tasks/{r}", relay.base_url)).bearer_auth(&key).send().await?;
        ensure!(get.status() == 404, "GET /tasks/{r} answered {} past retention", get.status());
    }
    // The sweep at start deletes them, and their bytes leave the files.
    let mut gone = false;
    while started.elapsed() < Duration::from_secs(20) {
        let bytes = all_bytes(&dir)?;
        if kept.iter().all(|t| !holds(&bytes, t)) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = started.elapsed().as_secs_f64();
    ensure!(gone, "solutions still in the data directory 20 s after the restart");
    for id in &kept_ids {
        let r = relay_shared::domain::TaskRef::from_compat_id(id)?;
        ensure!(relay.store.tasks().get(&r).await?.is_none(), "{id} still in the table");
    }
    println!(
        "| solutions handed out past retention (of 10) | 0 |\n\
         | left in the data directory's files, {took:.1} s after the restart | 0 of 10 |\n\
         | erased at once by `relay-local erase --key leaver` | 5 of 5 (another owner's 10 kept) |"
    );
    relay.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
