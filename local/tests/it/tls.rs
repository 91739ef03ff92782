//! Local mode's HTTPS port: served with a certificate from a CA local mode makes on first start
//! and keeps in `<data_dir>/tls/`, so a client given `ca.pem` (and nothing else) is served, over
//! every name the certificate covers, across restarts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use relay_local::run::{LocalConfig, Options, Running, start};
use tokio::io::AsyncReadExt;

fn tmp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("relay-tls-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("tmp dir");
    d
}

fn config(data_dir: &Path) -> LocalConfig {
    LocalConfig {
        bind: "127.0.0.1:0".into(),
        tls_bind: Some("127.0.0.1:0".into()),
        data_dir: data_dir.to_owned(),
        ..LocalConfig::default()
    }
}

async fn start_tls(data_dir: &Path, opts: Options) -> anyhow::Result<Running> {
    start(&config(data_dir), opts).await
}

fn tls_addr(relay: &Running) -> anyhow::Result<SocketAddr> {
    let url = relay.tls_url.as_deref().context("an HTTPS URL")?;
    Ok(url.trim_start_matches("https://").parse()?)
}

/// A client that trusts `ca_pem` and no other root.
fn client_trusting(ca_pem: &[u8]) -> anyhow::Result<reqwest::ClientBuilder> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .tls_certs_only([reqwest::Certificate::from_pem(ca_pem)?]))
}

/// A CA nobody told the relay about.
fn another_ca() -> anyhow::Result<String> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::default();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
    Ok(params.self_signed(&key)?.pem())
}

async fn health(client: &reqwest::Client, url: &str) -> anyhow::Result<(u16, String)> {
    let resp = client.get(format!("{url}/health")).send().await?;
    Ok((resp.status().as_u16(), resp.text().await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_only_the_local_ca_is_served_the_same_routes_by_every_name() -> anyhow::Result<()> {
    let dir = tmp_dir();
    let cfg = LocalConfig { tls_hosts: vec!["relay.test".into()], ..config(&dir) };
    let relay = start(&cfg, Options::default()).await?;
    let (url, addr) = (relay.tls_url.clone().context("tls_url")?, tls_addr(&relay)?);
    let ca_path = relay.ca_path.clone().context("ca_path")?;
    assert_eq!(ca_path, dir.join("tls").join("ca.pem"));
    assert!(url.starts_with("https://127.0.0.1:") && addr.port() != 0, "{url}");
    let ca = std::fs::read(&ca_path)?;
    assert!(String::from_utf8_lossy(&ca).contains("BEGIN CERTIFICATE"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("tls").join("key.pem"))?.permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the server key is owner-only");
    }

    let client = client_trusting(&ca)?.resolve("localhost", addr).resolve("relay.test", addr).build()?;
    assert_eq!(health(&client, &url).await?, (200, "ok".into()));
    let by_name = format!("https://localhost:{}", addr.port());
    assert_eq!(health(&client, &by_name).await?, (200, "ok".into()));
    let extra = format!("https://relay.test:{}", addr.port());
    assert_eq!(health(&client, &extra).await?, (200, "ok".into()));

    // The same router as the plain port: the handlers answer, not just /health.
    let plain = reqwest::Client::builder().no_proxy().build()?;
    for path in ["/tasks/nope", "/res.php?action=get&id=1", "/in.php"] {
        let over_tls = client.get(format!("{url}{path}")).send().await?;
        let over_http = plain.get(format!("{}{path}", relay.base_url)).send().await?;
        assert_eq!(over_tls.status(), over_http.status(), "{path}");
        assert_eq!(over_tls.text().await?, over_http.text().await?, "{path}");
    }
    assert_eq!(health(&plain, &relay.base_url).await?, (200, "ok".into()));

    relay.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the HTTPS port is closed on shutdown");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_trust_the_ca_fails_the_handshake_and_the_server_goes_on() -> anyhow::Result<()> {
    let dir = tmp_dir();
    let relay = start_tls(&dir, Options::default()).await?;
    let url = relay.tls_url.clone().context("tls_url")?;

    let stranger = client_trusting(another_ca()?.as_bytes())?.build()?;
    let err = health(&stranger, &url).await.expect_err("a CA it does not know must not verify");
    let chain = format!("{err:#}");
    assert!(chain.to_lowercase().contains("certificate"), "a certificate error: {chain}");
    // The platform's roots do not include it either.
    let platform = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build()?;
    assert!(health(&platform, &url).await.is_err(), "the system roots must not verify it");
    // Plain HTTP on the TLS port gets no answer from the relay.
    let http_on_tls = format!("http://{}", tls_addr(&relay)?);
    assert!(health(&platform, &http_on_tls).await.is_err(), "plain HTTP on the HTTPS port");

    let trusted = client_trusting(&std::fs::read(relay.ca_path.as_ref().context("ca_path")?)?)?.build()?;
    assert_eq!(health(&trusted, &url).await?, (200, "ok".into()), "failed handshakes do not end the server");
    relay.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_the_same_data_dir_keeps_the_ca_and_a_client_given_it_keeps_working() -> anyhow::Result<()> {
    let dir = tmp_dir();
    let tls_dir = dir.join("tls");
    let read_all = || -> anyhow::Result<Vec<Vec<u8>>> {
        ["ca.pem", "cert.pem", "key.pem"].iter().map(|f| Ok(std::fs::read(tls_dir.join(f))?)).collect()
    };

    let first = start_tls(&dir, Options::default()).await?;
    let before = read_all()?;
    let client = client_trusting(&before[0])?.build()?;
    assert_eq!(health(&client, first.tls_url.as_deref().context("tls_url")?).await?.0, 200);
    first.shutdown().await;

    let second = start_tls(&dir, Options::default()).await?;
    assert_eq!(read_all()?, before, "the CA, certificate and key are reused, byte for byte");
    let url = second.tls_url.clone().context("tls_url")?;
    assert_eq!(health(&client, &url).await?, (200, "ok".into()), "the client made before the restart");
    second.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_incomplete_or_outgrown_tls_files_stop_the_start_naming_the_file() -> anyhow::Result<()> {
    let (dir, other) = (tmp_dir(), tmp_dir());
    relay_local::tls::load_or_create(&dir, &[])?;
    relay_local::tls::load_or_create(&other, &[])?;
    let (tls, other_tls) = (dir.join("tls"), other.join("tls"));
    let original = |name: &str| std::fs::read(tls.join(name)).expect("read");
    let (ca, cert, key) = (original("ca.pem"), original("cert.pem"), original("key.pem"));
    let restore = || {
        for (name, bytes) in [("ca.pem", &ca), ("cert.pem", &cert), ("key.pem", &key)] {
            std::fs::write(tls.join(name), bytes).expect("restore");
        }
    };
    let garbage = b"-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n".as_slice();
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("cert.pem", garbage.to_vec(), &["cert.pem"]),
        ("cert.pem", b"hello".to_vec(), &["cert.pem", "no PEM certificate"]),
        ("ca.pem", b"hello".to_vec(), &["ca.pem", "no PEM certificate"]),
        ("key.pem", b"hello".to_vec(), &["key.pem", "private key"]),
        // A set's parts mixed with another's.
        ("key.pem", std::fs::read(other_tls.join("key.pem"))?, &["key.pem", "does not belong to", "cert.pem"]),
        ("ca.pem", std::fs::read(other_tls.join("ca.pem"))?, &["cert.pem", "does not verify", "ca.pem"]),
    ];
    for (name, bytes, needles) in cases {
        std::fs::write(tls.join(name), &bytes)?;
        let err = match start_tls(&dir, Options::default()).await {
            Ok(r) => {
                r.shutdown().await;
                anyhow::bail!("started with a bad {name}");
            }
            Err(e) => format!("{e:#}"),
        };
        for needle in needles {
            assert!(err.contains(needle), "{name}: `{needle}` in: {err}");
        }
        assert!(err.contains(&format!("delete {}", tls.display())), "the remedy: {err}");
        restore();
    }

    // Unreadable (a directory where the file should be).
    std::fs::remove_file(tls.join("cert.pem"))?;
    std::fs::create_dir(tls.join("cert.pem"))?;
    let err = format!("{:#}", start_tls(&dir, Options::default()).await.err().context("unreadable cert.pem")?);
    assert!(err.contains("cannot read") && err.contains("cert.pem"), "{err}");
    std::fs::remove_dir(tls.join("cert.pem"))?;

    // Missing: not silently replaced (that would leave clients with a CA that no longer fits).
    let err = format!("{:#}", start_tls(&dir, Options::default()).await.err().context("missing cert.pem")?);
    assert!(err.contains("cert.pem") && err.contains("missing"), "{err}");
    restore();

    // A name the certificate was not made for.
    let cfg = LocalConfig { tls_hosts: vec!["relay.test".into()], ..config(&dir) };
    let err = format!("{:#}", start(&cfg, Options::default()).await.err().context("a new host")?);
    assert!(err.contains("cert.pem") && err.contains("relay.test"), "{err}");

    // The restored set still serves.
    let relay = start_tls(&dir, Options::default()).await?;
    let client = client_trusting(&ca)?.build()?;
    assert_eq!(health(&client, relay.tls_url.as_deref().context("tls_url")?).await?.0, 200);
    relay.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_connect_and_say_nothing_hold_up_no_one() -> anyhow::Result<()> {
    // The default handshake timeout (10 s): the served client must not wait for it.
    let dir = tmp_dir();
    let relay = start_tls(&dir, Options::default()).await?;
    let addr = tls_addr(&relay)?;
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(tokio::net::TcpStream::connect(addr).await?);
    }
    let client = client_trusting(&std::fs::read(relay.ca_path.as_ref().context("ca_path")?)?)?.build()?;
    let started = Instant::now();
    for _ in 0..3 {
        assert_eq!(health(&client, relay.tls_url.as_deref().context("tls_url")?).await?.0, 200);
    }
    assert!(started.elapsed() < Duration::from_secs(5), "served while others idle: {:?}", started.elapsed());
    drop(idle);
    relay.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_disconnected_when_its_handshake_time_is_up() -> anyhow::Result<()> {
    let dir = tmp_dir();
    let opts = Options { tls_handshake_timeout: Some(Duration::from_millis(300)), ..Options::default() };
    let relay = start_tls(&dir, opts).await?;
    let mut idle = tokio::net::TcpStream::connect(tls_addr(&relay)?).await?;
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf)).await.context("never disconnected")?;
    assert!(matches!(read, Ok(0) | Err(_)), "closed without a byte sent: {read:?}");
    assert!(started.elapsed() >= Duration::from_millis(250), "not before its time: {:?}", started.elapsed());
    let client = client_trusting(&std::fs::read(relay.ca_path.as_ref().context("ca_path")?)?)?.build()?;
    assert_eq!(health(&client, relay.tls_url.as_deref().context("tls_url")?).await?.0, 200);
    relay.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_settings_come_from_the_environment_and_bad_ones_are_named() -> anyhow::Result<()> {
    let load = |vars: &[(&str, &str)]| {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        LocalConfig::load(None, &move |k| vars.iter().find(|(name, _)| name == k).map(|(_, v)| v.clone()))
    };
    let c = load(&[("RELAY_TLS_BIND", "127.0.0.1:8443"), ("RELAY_TLS_HOSTS", " relay.lan, 10.0.0.7 ,,[fd00::1]")])?;
    assert_eq!(c.tls_bind.as_deref(), Some("127.0.0.1:8443"));
    assert_eq!(c.tls_hosts, ["relay.lan", "10.0.0.7", "[fd00::1]"]);
    assert_eq!(load(&[])?.tls_bind, None, "off by default");
    assert_eq!(load(&[("RELAY_TLS_BIND", "")])?.tls_bind, None, "empty: off");

    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[("RELAY_TLS_BIND", "localhost")], "tls_bind (RELAY_TLS_BIND) `localhost` is not an address"),
        (&[("RELAY_TLS_BIND", "127.0.0.1:8080")], "is also bind"),
        (&[("RELAY_TLS_HOSTS", "relay.lan")], "tls_bind (RELAY_TLS_BIND) is not"),
        (&[("RELAY_TLS_BIND", "127.0.0.1:8443"), ("RELAY_TLS_HOSTS", "not a host!")], "`not a host!`"),
    ];
    for (vars, needle) in cases {
        let err = format!("{:#}", load(vars).err().with_context(|| format!("{vars:?} accepted"))?);
        assert!(err.contains(needle), "{vars:?}: {err}");
    }
    // The JSON file takes the same settings.
    let file = tmp_dir().join("relay.json");
    std::fs::write(&file, r#"{"tls_bind":"127.0.0.1:8443","tls_hosts":["relay.lan"]}"#)?;
    let c = LocalConfig::load(Some(&file), &|_| None)?;
    assert_eq!(
        (c.tls_bind.as_deref(), c.tls_hosts.as_slice()),
        (Some("127.0.0.1:8443"), ["relay.lan".to_owned()].as_slice())
    );

    // A taken HTTPS port stops the start with a clear message.
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.to_string();
    let cfg = LocalConfig { tls_bind: Some(port.clone()), ..config(&tmp_dir()) };
    let err = format!("{:#}", start(&cfg, Options::default()).await.err().context("a taken port")?);
    assert!(err.contains(&format!("cannot listen on {port} for HTTPS")), "{err}");
    Ok(())
}

#[test]
fn serve_prints_the_https_url_the_ca_and_how_to_give_it_to_clients() -> anyhow::Result<()> {
    use std::io::BufRead;
    let dir = tmp_dir();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .arg("serve")
        .env("RELAY_BIND", "127.0.0.1:0")
        .env("RELAY_TLS_BIND", "127.0.0.1:0")
        .env("RELAY_DATA_DIR", &dir)
        .env_remove("CAPTCHAAI_API_KEY")
        .env_remove("RELAY_TLS_HOSTS")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut banner = String::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line?;
        banner.push_str(&line);
        banner.push('\n');
        if line.contains("2captcha SDKs") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let ca = dir.join("tls").join("ca.pem").display().to_string();
    for needle in [
        "https://127.0.0.1:".to_owned(),
        format!("REQUESTS_CA_BUNDLE={ca}"),
        format!("NODE_EXTRA_CA_CERTS={ca}"),
        "server=\"127.0.0.1:".to_owned(),
    ] {
        assert!(banner.contains(&needle), "`{needle}` in:\n{banner}");
    }
    Ok(())
}
