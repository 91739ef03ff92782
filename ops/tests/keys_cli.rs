//! The `relay-ops keys` commands as an operator runs them: the built binary, against the
//! embedded DynamoDB engine on loopback (`AWS_ENDPOINT_URL_DYNAMODB`), with dummy credentials.

use std::process::{Command, Output};

use relay_shared::testkit::LocalDynamo;

/// Runs `relay-ops <args>` against `endpoint` and `table`, with nothing from the caller's AWS
/// setup (profiles, SSO, real credentials, proxies) reaching it.
async fn relay_ops(endpoint: &str, table: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay-ops"));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("TABLE_NAME", table)
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_CONFIG_FILE", "/nonexistent/relay-ops-test/config")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/relay-ops-test/credentials")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("NO_PROXY", "127.0.0.1,localhost");
    // The engine runs on this test's runtime: wait for the child off its threads.
    Ok(tokio::task::spawn_blocking(move || cmd.output()).await??)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_create_list_revoke_through_the_binary() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let (ep, table) = (db.endpoint.as_str(), store.table());

    // create: stdout is the key alone (KEY=$(relay-ops keys create scraper)); the hint on stderr.
    let out = relay_ops(ep, table, &["keys", "create", "scraper"]).await?;
    assert!(out.status.success(), "create failed: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let key = stdout.strip_suffix('\n').unwrap_or(&stdout).to_owned();
    assert_eq!(key.len(), 32, "stdout is exactly the key and a newline: {stdout:?}");
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
    let hint = text(&out.stderr);
    assert!(hint.contains("shown only this once") && hint.contains("relay-ops keys revoke scraper --digest"), "{hint}");
    assert!(!hint.contains(&key), "the hint never repeats the key");
    let second = relay_ops(ep, table, &["keys", "create", "scraper"]).await?;
    assert!(second.status.success());
    let second_key = text(&second.stdout).trim().to_owned();

    // list (table and JSON): names and digest prefixes, never a key.
    let out = relay_ops(ep, table, &["keys", "list"]).await?;
    assert!(out.status.success(), "list failed: {}", text(&out.stderr));
    let listed = text(&out.stdout);
    assert!(listed.starts_with("NAME") && listed.lines().count() == 3, "{listed}");
    assert!(!listed.contains(&key) && !listed.contains(&second_key));
    let out = relay_ops(ep, table, &["keys", "list", "--json"]).await?;
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(rows.as_array().map(Vec::len), Some(2));
    assert!(!text(&out.stdout).contains(&key));
    let first_prefix = rows[0]["digest_prefix"].as_str().unwrap_or_default().to_owned();
    assert_eq!(first_prefix.len(), 12);

    // revoke by digest prefix: only the first key; prints the count and the cache delay.
    let out = relay_ops(ep, table, &["keys", "revoke", "scraper", "--digest", &first_prefix[..6]]).await?;
    assert!(out.status.success(), "revoke failed: {}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.contains("revoked 1 key(s)") && said.contains("within 60 s"), "{said}");
    let rows: serde_json::Value =
        serde_json::from_slice(&relay_ops(ep, table, &["keys", "list", "--json"]).await?.stdout)?;
    assert_eq!(rows[0]["live"], false);
    assert_eq!(rows[1]["live"], true);

    // revoke an unknown name: exit code 1 and a clear message.
    let out = relay_ops(ep, table, &["keys", "revoke", "nobody"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no relay key is named `nobody`"), "{}", text(&out.stderr));
    // A too-short prefix is refused before anything is written.
    let out = relay_ops(ep, table, &["keys", "revoke", "scraper", "--digest", "abc"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("6 to 64 hex digits"));

    // revoke by name: the remaining live one; then nothing is left to revoke.
    let out = relay_ops(ep, table, &["keys", "revoke", "scraper"]).await?;
    assert!(out.status.success() && text(&out.stdout).contains("revoked 1 key(s)"));
    let out = relay_ops(ep, table, &["keys", "revoke", "scraper"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("already revoked"));

    // No table: a clear message, not an AWS error.
    let out = relay_ops(ep, "", &["keys", "list"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("set --table-name or TABLE_NAME"), "{}", text(&out.stderr));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_shows_each_lane_its_oldest_wait_the_submitter_and_its_window() -> anyhow::Result<()> {
    use relay_shared::captchaai::SubmitRequest;
    use relay_shared::domain::{CaptchaKind, Task, TaskRef};
    use relay_shared::time::{Clock, SystemClock};
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let (ep, table) = (db.endpoint.as_str(), store.table());
    let out = relay_ops(ep, table, &["queue"]).await?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("queued: 0 in 0 lane(s)"), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("not learnt yet"), "{}", text(&out.stdout));

    let now = SystemClock.now();
    let lane = "0123456789abcdef.t";
    for _ in 0..3 {
        let task = Task::queued(
            TaskRef::generate(),
            CaptchaKind::Turnstile,
            now.minus(std::time::Duration::from_secs(42)),
            lane.into(),
        );
        store.queue().reserve_queue(lane, 0, 10, 10, false).await?;
        let req = SubmitRequest::Turnstile {
            sitekey: "s".into(),
            pageurl: "https://a.example/".into(),
            action: None,
            data: None,
        };
        store.queue().create_queued(&task, &req, "https://relay/cb", std::time::Duration::from_secs(110), None).await?;
    }
    let window = r#"{"size":5.0,"full_at":6,"full_seen_ms":0}"#;
    let publish = relay_shared::store::Publish {
        permits: 0,
        window: window.into(),
        released_per_minute: 120,
        api_no_slots_seen: 0,
    };
    store
        .queue()
        .releaser_lease("submitter-test", now, now.plus(std::time::Duration::from_secs(10)), Some(&publish))
        .await?;
    let out = relay_ops(ep, table, &["queue"]).await?;
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(shown.contains("queued: 3 in 1 lane(s)"), "{shown}");
    assert!(shown.contains(&format!("lane {lane} (tokens): 3 waiting, the oldest for 4")), "{shown}");
    assert!(shown.contains("submitter: running (submitter-test"), "{shown}");
    assert!(shown.contains("window: 5 tasks in work at once"), "{shown}");
    assert!(shown.contains("released in the last minute: 120"), "{shown}");
    Ok(())
}
