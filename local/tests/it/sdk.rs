//! The official 2captcha clients, unmodified, against local mode over TLS: the Python SDK
//! (2captcha-python), the JavaScript SDK (@2captcha/captcha-solver, where node is on the
//! machine) on every kind CaptchaAI solves, and the JavaScript SDK again with a plan's worth of
//! tasks (200) in flight on one key, all at once, with the fake CaptchaAI at its worst
//! (realistic solve times, `ids=` not understood, bans enforced, a 200-thread plan, reports
//! answered with CaptchaAI's empty 200) dropping 30 % of the pingbacks. Every answer must be
//! what the fake produced, and no res.php request at the fake may come from a client's polling:
//! those are answered from the relay's table — over the relay's per-key read budget with
//! something both SDKs take as "not ready yet". (The tutorial's own apps: tutorial.rs beside this file.)
//!
//! The relay runs with local mode's defaults (poller every 10 s, per-kind callback grace); the
//! clients with theirs (the Python SDK polls every 10 s and gives up after 120 s, 600 s for
//! reCAPTCHA; the JavaScript SDK polls every 5 s). The pinned clients are installed by
//! `infra/tools.sh sdk` on first use.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use fake_captchaai::FakeConfig;
use relay_local::run::{LocalConfig, Options, Running, start};
use relay_shared::domain::TaskRef;
use relay_shared::time::{Clock, SystemClock};
use secrecy::ExposeSecret;
use serde_json::Value;

/// The user agent the SDK scripts send with their Enterprise task.
const SDK_UA: &str = "Mozilla/5.0 (X11; Linux x86_64) relay-sdk-test/1.0";

/// Tasks in flight at once on one key through the JavaScript SDK: a plan's worth.
const LOAD: usize = 200;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn data_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("relay-sdk-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A small PNG (a 1×1 image), as a client would upload.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52, 0x00, 0x00, 0x00,
    0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4, 0x89, 0x00, 0x00, 0x00, 0x0d, 0x49,
    0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xff, 0xff, 0x3f, 0x00, 0x05, 0xfe, 0x02, 0xfe, 0xa7, 0x35, 0x81, 0x84,
    0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

/// Runs a client to the end (or the deadline) and reads the one JSON object it prints.
async fn client(program: &str, script: &Path, env: &[(&str, String)], limit: Duration) -> anyhow::Result<Value> {
    let started = Instant::now();
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg(script).kill_on_drop(true).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().with_context(|| format!("starting {program} {}", script.display()))?;
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .with_context(|| format!("{} did not finish in {limit:?}", script.display()))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{} failed ({}):\n{}\n{}",
        script.display(),
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{} finished in {:.0} s", script.display(), started.elapsed().as_secs_f64());
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    let mut v: Value =
        serde_json::from_str(last.trim()).with_context(|| format!("{} printed no JSON: {stdout}", script.display()))?;
    // What the client printed before its JSON.
    v["printed"] = Value::String(stdout.lines().filter(|l| *l != last).collect::<Vec<_>>().join("\n"));
    Ok(v)
}

/// What the fake produced for the task behind a compat id.
async fn fake_answer(relay: &Running, compat_id: &str) -> anyhow::Result<String> {
    let task = relay
        .store
        .tasks()
        .get(&TaskRef::from_compat_id(compat_id)?)
        .await?
        .with_context(|| format!("no task {compat_id}"))?;
    let id = task.captcha_id.with_context(|| format!("task {compat_id} has no CaptchaAI id"))?;
    let fake = relay.fake.as_ref().context("the built-in fake")?;
    fake.task(id.as_ref()).and_then(|t| t.answer).with_context(|| format!("the fake has no answer for {id}"))
}

/// Checks every solved entry of a client's output against the fake; returns how many.
async fn check_solved(relay: &Running, who: &str, out: &Value, expected: usize) -> anyhow::Result<usize> {
    let errors = out["errors"].as_object().map(|e| e.len()).unwrap_or(0);
    ensure!(errors == 0, "{who}: errors {}", out["errors"]);
    let solved = out["solved"].as_object().context("solved")?;
    ensure!(solved.len() == expected, "{who}: {} of {expected} solved: {out}", solved.len());
    for (name, r) in solved {
        let id = r["id"].as_str().context("id")?;
        let code = r["code"].as_str().with_context(|| format!("{who} {name}: no code in {r}"))?;
        let want = fake_answer(relay, id).await?;
        ensure!(code == want, "{who} {name}: got a different answer than the fake produced");
    }
    Ok(solved.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_unmodified_solve_every_kind_through_the_relay_with_30_percent_of_callbacks_dropped()
-> anyhow::Result<()> {
    let tools = tokio::process::Command::new("bash").arg(root().join("infra/tools.sh")).arg("sdk").status().await?;
    ensure!(tools.success(), "infra/tools.sh sdk failed");
    let python = root().join(".venv/bin/python");
    let node_sdk = root().join("tests/compat/node_modules/@2captcha/captcha-solver");
    let node = std::process::Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success());

    let dir = data_dir();
    let cfg = LocalConfig {
        bind: "127.0.0.1:0".into(),
        data_dir: dir.clone(),
        tls_bind: Some("127.0.0.1:0".into()),
        ..LocalConfig::default()
    };
    let fake = FakeConfig {
        drop_callbacks: 0.3,
        seed: 23,
        balance: "7.25".into(),
        threads: Some(LOAD as u32),
        ..FakeConfig::captchaai_like()
    };
    let relay = start(&cfg, Options { fake: Some(fake), ..Options::default() }).await?;
    let tls = relay.tls_url.clone().context("the TLS port")?;
    let server = tls.trim_start_matches("https://").to_owned();
    let ca = relay.ca_path.clone().context("the CA path")?.display().to_string();
    // A key made as the operator command makes one, and local mode's own API key: both work.
    let made = relay.store.key_admin().create_relay_key("python-sdk", SystemClock.now()).await?;
    let image = dir.join("captcha.png");
    std::fs::write(&image, PNG)?;
    let image = image.display().to_string();

    let limit = Duration::from_secs(540);
    let py_env = vec![
        ("RELAY_SERVER", server.clone()),
        ("RELAY_KEY", made.expose_secret().to_owned()),
        ("RELAY_IMAGE", image.clone()),
        ("REQUESTS_CA_BUNDLE", ca.clone()),
    ];

    let js_env = vec![
        ("RELAY_BASE", tls.clone()),
        ("RELAY_KEY", relay.api_key.clone()),
        ("RELAY_IMAGE", image.clone()),
        ("NODE_EXTRA_CA_CERTS", ca.clone()),
    ];
    let load_env = vec![
        ("RELAY_BASE", tls.clone()),
        ("RELAY_KEY", relay.api_key.clone()),
        ("RELAY_TASKS", LOAD.to_string()),
        ("NODE_EXTRA_CA_CERTS", ca.clone()),
    ];
    let py_script = root().join("tests/compat/sdk_python.py");
    let js_script = root().join("tests/compat/sdk_node.js");
    let load_script = root().join("tests/compat/sdk_node_load.js");
    let program = python.display().to_string();
    let with_node = node && node_sdk.exists();
    let (py, js, load) = tokio::join!(
        client(&program, &py_script, &py_env, limit),
        async { if with_node { Some(client("node", &js_script, &js_env, limit).await) } else { None } },
        async { if with_node { Some(client("node", &load_script, &load_env, limit).await) } else { None } }
    );
    let py = py?;

    // The Python SDK: every kind, the answer the fake produced; the enterprise token's user
    // agent passed through its extended answer.
    let n_py = check_solved(&relay, "python", &py, 12).await?;
    let ua = py["solved"]["recaptcha_enterprise_extended"]["user_agent"].as_str().unwrap_or_default();
    ensure!(ua == SDK_UA, "python: not the user agent of the enterprise token: {py}");
    ensure!(py["balance"].as_f64() == Some(7.25), "python balance {}", py["balance"]);
    ensure!(
        py["report_good"] == "OK_REPORT_RECORDED" && py["report_bad"] == "OK_REPORT_RECORDED",
        "python reports {py}"
    );
    ensure!(py["wrong_key"].as_str().is_some_and(|e| e == "ApiException: ERROR_WRONG_USER_KEY"), "{}", py["wrong_key"]);
    ensure!(
        py["unknown_key"].as_str().is_some_and(|e| e == "ApiException: ERROR_KEY_DOES_NOT_EXIST"),
        "{}",
        py["unknown_key"]
    );
    // The JavaScript SDK, where node is here.
    let n_js = match js {
        Some(js) => {
            let js = js?;
            let n = check_solved(&relay, "node", &js, 6).await?;
            ensure!(js["balance"].as_f64() == Some(7.25), "node balance {}", js["balance"]);
            ensure!(js["report_good"] == "OK_REPORT_RECORDED", "node reports {js}");
            ensure!(js["wrong_key"] == "APIError: ERROR_WRONG_USER_KEY", "{}", js["wrong_key"]);
            ensure!(
                js["solved"]["recaptcha_enterprise"]["user_agent"] == SDK_UA,
                "node: no user agent with the enterprise token: {js}"
            );
            n
        }
        None => {
            eprintln!("node is not on this machine: the JavaScript SDK was not run");
            0
        }
    };
    // A plan's worth in flight on one key through the JavaScript SDK: every task finished.
    let (n_load, load_p50, load_max) = match load {
        Some(l) => {
            let l = l?;
            let n = check_solved(&relay, "node (200 in flight)", &l, LOAD).await?;
            let mut secs: Vec<f64> =
                l["seconds"].as_array().context("seconds")?.iter().filter_map(Value::as_f64).collect();
            secs.sort_by(f64::total_cmp);
            (n, secs.get(secs.len() / 2).copied().unwrap_or(0.0), secs.last().copied().unwrap_or(0.0))
        }
        None => (0, 0.0, 0.0),
    };
    // At the fake: pingbacks dropped (the relay's poller recovered those), and every res.php
    // request accounted for by the relay's own poller reads (of CaptchaAI ids, which no client
    // ever sees) and the passed-through balance and reports: none from the clients' polling.
    let fake = relay.fake.as_ref().context("fake")?;
    let counts = fake.counts();
    let tasks = fake.tasks();
    let poller_reads: u64 = tasks.iter().map(|t| u64::from(t.reads)).sum();
    let passed_through = counts.balance_reads + counts.reports_good + counts.reports_bad + counts.threads_info;
    let client_reads = counts.res_php - poller_reads - passed_through;
    let dropped = counts.callbacks_dropped;
    let total = n_py + n_js + n_load;
    eprintln!(
        "| solved through the relay: python SDK / node SDK / node SDK, {LOAD} in flight on one key | {n_py} / {n_js} / {n_load} |\n\
         | the {LOAD} in flight: seconds from submit to answer, p50 / max | {load_p50:.0} / {load_max:.0} |\n\
         | pingbacks dropped by the fake                             | {dropped} of {} |\n\
         | res.php at the fake: poller reads / balance+reports+threadsinfo / client polling | {poller_reads} / {passed_through} / {client_reads} |\n\
         | most res.php reads of one task                            | {} |\n\
         | \"no free thread\" answers / peak tasks in work (plan {LOAD}) | {} / {} |",
        counts.tasks_accepted,
        tasks.iter().map(|t| t.reads).max().unwrap_or(0),
        counts.no_slot,
        fake.peak_in_work(),
    );
    ensure!(counts.tasks_accepted as usize == total, "{} in.php tasks for {total} solves", counts.tasks_accepted);
    ensure!(dropped > 0, "no pingback was dropped: the fallback path was not walked");
    ensure!(client_reads == 0, "{client_reads} res.php requests at the fake came from the clients' polling");
    ensure!(counts.balance_reads <= 2, "the balance was not cached ({} reads)", counts.balance_reads);
    relay.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
