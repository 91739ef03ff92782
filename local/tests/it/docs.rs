//! The docs cannot drift from the code: every setting the code reads is documented, every
//! default the configuration reference states is the one the code uses, every template
//! parameter is named in the docs, and the README's commands work as written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use relay_shared::config::{CaptchaAiConfig, Settings, StoreConfig};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if p.is_dir() {
            if !matches!(name, "target" | "node_modules" | ".venv" | ".git" | "tests" | "benches") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The settings the relay's own code (not its tests) reads: names passed to `Settings`'
/// readers, or to local mode's `env(..)`.
fn settings_read_by_code() -> BTreeSet<String> {
    let mut files = Vec::new();
    for dir in ["shared/src", "functions", "local/src", "ops/src"] {
        rust_files(&root().join(dir), &mut files);
    }
    let readers = [
        ".parse_or(\"",
        ".required(\"",
        ".optional(\"",
        ".secret(\"",
        ".url_or(\"",
        ".url(\"",
        " env(\"",
        "(env(\"",
        "env::var(\"",
    ];
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        // Unit tests at the end of a file read made-up settings.
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for r in readers {
            for part in text.split(r).skip(1) {
                let name: String =
                    part.chars().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_').collect();
                if name.len() > 2 && part[name.len()..].starts_with('"') {
                    names.insert(name);
                }
            }
        }
    }
    names
}

/// Every `NAME` in backticks in the docs that describe settings.
fn documented_names() -> BTreeSet<String> {
    let mut text = String::new();
    for page in ["docs/reference.md", "docs/local-mode.md", "docs/operations.md", "docs/push-delivery.md"] {
        text.push_str(&read(page));
    }
    text.split('`')
        .skip(1)
        .step_by(2)
        .flat_map(|code| code.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')))
        .filter(|w| w.len() > 2 && w.contains('_'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_setting_the_code_reads_is_documented() {
    let documented = documented_names();
    let missing: Vec<_> = settings_read_by_code()
        .into_iter()
        .filter(|n| !n.starts_with("RELAY_TEST_") && !n.starts_with("AWS_") && n != "RUST_LOG")
        .filter(|n| !documented.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "read by the code, named nowhere in docs/reference.md, local-mode.md or operations.md: {missing:?}"
    );
}

/// The reference's configuration table: each setting named in a row's first cell, with the
/// default in the same position of its second cell (`A`, `B` | 1, 2).
fn documented_defaults() -> BTreeMap<String, String> {
    let text = read("docs/reference.md");
    let table = text.split("## Configuration").nth(1).expect("docs/reference.md has a Configuration section");
    let mut out = BTreeMap::new();
    for line in table.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let names: Vec<String> = cells[0]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|n| n.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .map(str::to_owned)
            .collect();
        let defaults: Vec<String> = cells
            .get(1)
            .unwrap_or(&"")
            .split(", ")
            .map(|d| d.split(" (").next().unwrap_or(d).trim().trim_matches('`').to_owned())
            .collect();
        if names.len() == defaults.len() {
            out.extend(names.into_iter().zip(defaults));
        } else if let Some(first) = names.first() {
            out.insert(first.clone(), cells.get(1).unwrap_or(&"").trim().to_owned());
        }
    }
    out
}

/// What the code uses when a setting is not given.
fn code_defaults() -> BTreeMap<&'static str, String> {
    let empty = Settings::default();
    let store = StoreConfig::from_settings(&Settings::from_pairs([("TABLE_NAME", "t")])).expect("store config");
    let captchaai =
        CaptchaAiConfig::from_settings(&Settings::from_pairs([("CAPTCHAAI_API_KEY", "k")])).expect("captchaai");
    let poller = relay_poller::PollerSettings::from_settings(&empty).expect("poller");
    let submitter = relay_submitter::SubmitterSettings::from_settings(&empty).expect("submitter");
    let queue = &submitter.queue;
    let delivery = relay_shared::delivery::DeliverySettings::from_settings(&empty).expect("delivery");
    let auth = relay_shared::config::AuthMode::from_settings(&Settings::from_pairs([("RELAY_API_KEY", "k")]));
    let mut m = BTreeMap::new();
    m.insert("RETENTION_DAYS", (store.retention.as_secs() / 86_400).to_string());
    m.insert("POLL_SHARDS", store.shards.write.to_string());
    m.insert("POLL_SHARDS_PREVIOUS", store.shards.previous.to_string());
    m.insert("CAPTCHAAI_BASE_URL", captchaai.base_url.clone());
    m.insert("CAPTCHAAI_TIMEOUT_MS", captchaai.timeout.as_millis().to_string());
    m.insert(
        "AUTH_MODE",
        if matches!(auth, Ok(relay_shared::config::AuthMode::ApiKey(_))) { "api_key" } else { "iam" }.into(),
    );
    m.insert("CALLBACK_RECENT_RESULTS", relay_callback::RECENT_RESULTS.to_string());
    m.insert("CAPTCHAAI_THREADS", queue.window.threads.unwrap_or(0).to_string());
    m.insert("SUBMITS_PER_SECOND", queue.submits_per_second.to_string());
    m.insert("SUBMIT_NO_SLOT_PER_MINUTE", queue.window.no_slot_per_minute.to_string());
    m.insert("QUEUE_MAX_PER_OWNER", queue.max_per_owner.to_string());
    m.insert("QUEUE_MAX_TOTAL", queue.max_total.to_string());
    m.insert("QUEUE_MAX_WAIT_SECS", queue.max_wait.as_secs().to_string());
    m.insert("SUBMIT_CONCURRENCY", submitter.concurrency.to_string());
    m.insert("SUBMIT_SCHEDULE_MINUTES", (submitter.period.as_secs() / 60).to_string());
    m.insert("POLL_REQUESTS_PER_SECOND", poller.requests_per_second.to_string());
    m.insert("POLL_CONCURRENCY", poller.concurrency.to_string());
    m.insert("POLL_MAX_READS_PER_INVOCATION", poller.max_reads_per_invocation.to_string());
    m.insert("POLL_SCHEDULE_MINUTES", (poller.window.as_secs() / 60).to_string());
    m.insert("POLL_BATCH", poller.batch.to_string());
    m.insert("POLL_READ_BUDGET", poller.read_budget.to_string());
    m.insert("TASK_DEADLINE_SECS", poller.task_deadline.as_secs().to_string());
    m.insert("POLL_READ_TIMEOUT_MS", poller.read_timeout.as_millis().to_string());
    m.insert("DELIVERY_TIMEOUT_SECS", delivery.timeout.as_secs().to_string());
    m.insert("DELIVERY_MAX_ATTEMPTS", delivery.max_attempts.to_string());
    m.insert("DELIVERY_PER_HOST_CONCURRENCY", delivery.per_host_concurrency.to_string());
    m.insert("DELIVERY_PER_HOST_PER_SECOND", delivery.per_host_per_second.to_string());
    m
}

#[test]
fn every_default_the_reference_states_is_the_codes() {
    let documented = documented_defaults();
    let mut wrong = Vec::new();
    for (name, actual) in code_defaults() {
        match documented.get(name) {
            None => {
                wrong.push(format!("{name}: not in the reference's configuration table (the code's default: {actual})"))
            }
            Some(doc) if doc != &actual => {
                wrong.push(format!("{name}: documented {doc}, the code's default is {actual}"))
            }
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "docs/reference.md's configuration table drifted:\n{}", wrong.join("\n"));
}

/// The template's parameters and their defaults, read from template.yaml.
fn template_parameters() -> BTreeMap<String, String> {
    let text = read("template.yaml");
    let section = text.split("\nParameters:\n").nth(1).expect("a Parameters section");
    let section = section.split("\nConditions:").next().unwrap_or(section);
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in section.lines() {
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(':')).filter(|n| !n.starts_with(' ')) {
            current = Some(name.to_owned());
            out.insert(name.to_owned(), String::new());
        } else if let (Some(c), Some(d)) = (&current, line.trim().strip_prefix("Default: ")) {
            out.insert(c.clone(), d.trim_matches('"').to_owned());
        }
    }
    out
}

#[test]
fn every_template_parameter_is_named_in_the_docs() {
    let mut docs = read("README.md");
    for e in std::fs::read_dir(root().join("docs")).expect("docs/").flatten() {
        docs.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
    }
    let params = template_parameters();
    assert!(params.len() > 40, "read the template's parameters: {params:?}");
    let missing: Vec<_> = params.keys().filter(|p| !docs.contains(&format!("`{p}`"))).collect();
    assert!(missing.is_empty(), "template parameters no page of docs/ (or the README) names: {missing:?}");
}

/// The README's commands, as a newcomer types them.
fn readme_commands() -> Vec<String> {
    let text = read("README.md");
    text.split("```")
        .skip(1)
        .step_by(2)
        .filter(|b| b.starts_with("sh\n"))
        .flat_map(|b| b.lines().skip(1).map(|l| l.split(" #").next().unwrap_or(l).trim().to_owned()))
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn the_readmes_commands_work_as_written() {
    let commands = readme_commands();
    assert!(commands.iter().any(|c| c == "infra/test.sh"), "the test command is in the README: {commands:?}");
    let first_40: String = read("README.md").lines().take(40).collect::<Vec<_>>().join("\n");
    for must in ["cargo run -p relay-local -- demo", "infra/test.sh"] {
        assert!(first_40.contains(must), "`{must}` is in the README's first 40 lines");
    }
    let ci = read(".ci/run");
    assert!(ci.lines().any(|l| l.trim() == "infra/test.sh"), ".ci/run runs the README's test command");
    let params = template_parameters();
    let bin = env!("CARGO_BIN_EXE_relay-local");
    for c in &commands {
        if let Some(rest) = c.strip_prefix("cargo run -p relay-local -- ") {
            // The subcommand exists with the options the README gives it.
            let args: Vec<&str> = rest.split_whitespace().collect();
            let out = Command::new(bin).args(&args[..1]).arg("--help").output().expect("relay-local runs");
            assert!(
                out.status.success(),
                "`{c}`: relay-local {} --help failed: {}",
                args[0],
                String::from_utf8_lossy(&out.stderr)
            );
            let help = String::from_utf8_lossy(&out.stdout);
            for opt in args.iter().filter(|a| a.starts_with("--")) {
                assert!(help.contains(opt), "`{c}`: relay-local {} has no {opt}", args[0]);
            }
        } else if c == "infra/test.sh" {
            let meta = std::fs::metadata(root().join(c)).expect("infra/test.sh exists");
            assert!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0, "{c} is executable");
        } else if c.starts_with("aws ssm put-parameter") {
            // The parameter names the template reads by default.
            let name = c.split("--name ").nth(1).and_then(|r| r.split_whitespace().next()).expect("a --name");
            assert!(params.values().any(|d| d == name), "`{c}`: no template parameter defaults to {name}");
        } else if c.starts_with("sam build") {
            assert!(
                read("samconfig.toml").contains("[default.deploy.parameters]"),
                "samconfig.toml has deploy defaults"
            );
            assert!(root().join("template.yaml").exists());
        } else {
            panic!("the README's command `{c}` is not checked here: add how to check it");
        }
    }
}
