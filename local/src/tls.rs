//! Local mode's HTTPS port. The official 2captcha SDKs build `https://<server>/in.php`: the host
//! is configurable, the scheme is not. So local mode serves the same routes over TLS too, with a
//! certificate from a CA of its own that it makes on first start and keeps in
//! `<data_dir>/tls/` (`ca.pem`, `cert.pem`, `key.pem`), so a client given `ca.pem` keeps working
//! across restarts.
//!
//! The CA's private key is not kept: once the server certificate is signed, the CA can sign
//! nothing else, so trusting `ca.pem` trusts this relay's certificate and nothing more. The price:
//! a certificate that no longer fits (new `tls_hosts`, or expired) is not reissued silently;
//! start fails naming the file, and deleting `tls/` makes a new CA and certificate.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, anyhow, bail};
use rustls::ServerConfig;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::Relay;

/// How long a client gets to complete its TLS handshake before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The names every certificate covers; `tls_hosts` adds to them.
pub const BUILT_IN_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// Common name of the CA local mode makes.
pub const CA_NAME: &str = "captcha-relay local CA";

/// Lifetime of the CA and the server certificate: 825 days, the most Apple's TLS stack accepts
/// for a server certificate, even from a private CA (.NET on macOS verifies with it).
const VALID_DAYS: u32 = 825;

const DAY: Duration = Duration::from_secs(86_400);

/// Where the TLS material of a data directory lives.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub dir: PathBuf,
    /// The CA certificate clients are given.
    pub ca: PathBuf,
    /// The server certificate.
    pub cert: PathBuf,
    /// The server certificate's private key (owner-only).
    pub key: PathBuf,
}

impl TlsFiles {
    pub fn in_data_dir(data_dir: &Path) -> Self {
        let dir = data_dir.join("tls");
        Self { ca: dir.join("ca.pem"), cert: dir.join("cert.pem"), key: dir.join("key.pem"), dir }
    }

    fn all(&self) -> [&Path; 3] {
        [&self.ca, &self.cert, &self.key]
    }

    /// What to do when the files no longer serve.
    fn remedy(&self) -> String {
        format!(
            "delete {} to make a new CA and certificate on the next start (clients must then be given the new ca.pem)",
            self.dir.display()
        )
    }
}

/// Checks one extra name for the certificate: a DNS name or an IP address.
pub fn check_host(host: &str) -> anyhow::Result<()> {
    let h = normalize_host(host);
    if h.is_empty() {
        bail!("an empty host name");
    }
    ServerName::try_from(h.as_str()).map_err(|_| anyhow!("`{host}` is not a DNS name or IP address"))?;
    // rcgen refuses what it cannot put in a certificate (e.g. non-ASCII).
    rcgen::CertificateParams::new(vec![h]).map_err(|e| anyhow!("`{host}` cannot be put in a certificate: {e}"))?;
    Ok(())
}

fn normalize_host(host: &str) -> String {
    let h = host.trim();
    let h = h.strip_prefix('[').and_then(|x| x.strip_suffix(']')).unwrap_or(h);
    h.to_ascii_lowercase()
}

/// The built-in names and the extra ones, normalized, without repeats.
fn all_hosts(extra: &[String]) -> Vec<String> {
    let mut hosts: Vec<String> = BUILT_IN_HOSTS.iter().map(|h| (*h).to_owned()).collect();
    for h in extra.iter().map(|h| normalize_host(h)) {
        if !h.is_empty() && !hosts.contains(&h) {
            hosts.push(h);
        }
    }
    hosts
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The server side of local mode's TLS: the config to serve with and where the CA is.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    pub config: Arc<ServerConfig>,
    pub files: TlsFiles,
}

/// Loads `<data_dir>/tls/{ca,cert,key}.pem`, making them the first time. Fails, naming the file,
/// when some are missing, unreadable or invalid, when the key is not the certificate's, or when
/// the certificate does not verify under the CA for every host (built-in and `extra_hosts`).
pub fn load_or_create(data_dir: &Path, extra_hosts: &[String]) -> anyhow::Result<TlsMaterial> {
    // Absolute: the CA path is handed to clients that may run elsewhere.
    let data_dir = &std::path::absolute(data_dir).with_context(|| format!("data dir {}", data_dir.display()))?;
    let files = TlsFiles::in_data_dir(data_dir);
    let hosts = all_hosts(extra_hosts);
    let present: Vec<&Path> = files.all().into_iter().filter(|p| p.exists()).collect();
    if present.is_empty() {
        create(data_dir, &files, &hosts)?;
    } else if present.len() < 3 {
        let missing: Vec<String> =
            files.all().into_iter().filter(|p| !p.exists()).map(|p| p.display().to_string()).collect();
        bail!("TLS files incomplete: {} missing; {}", missing.join(" and "), files.remedy());
    }
    let config = load(&files, &hosts)?;
    Ok(TlsMaterial { config, files })
}

/// A new CA and a server certificate it signed, as PEM.
struct Generated {
    ca: String,
    cert: String,
    key: String,
}

fn generate(hosts: &[String]) -> anyhow::Result<Generated> {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        KeyUsagePurpose,
    };
    let now = SystemTime::now();
    // A day of slack for clocks behind this one.
    let not_before = now.checked_sub(DAY).unwrap_or(now);
    let not_after = now + DAY * VALID_DAYS;

    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name = DistinguishedName::new();
    ca.distinguished_name.push(DnType::CommonName, CA_NAME);
    ca.distinguished_name.push(DnType::OrganizationName, "captcha-relay");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    ca.not_before = not_before.into();
    ca.not_after = not_after.into();
    let ca_cert = ca.self_signed(&ca_key).context("making the CA certificate")?;
    // The CA key goes out of scope with `issuer` below and is never written anywhere.
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().context("generating the server key")?;
    let mut leaf = CertificateParams::new(hosts.to_vec()).context("the certificate's host names")?;
    leaf.distinguished_name = DistinguishedName::new();
    leaf.distinguished_name.push(DnType::CommonName, "captcha-relay local");
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    // OpenSSL's strict verification (Python 3.13's default) wants it.
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = not_before.into();
    leaf.not_after = not_after.into();
    let cert = leaf.signed_by(&key, &issuer).context("signing the server certificate")?;
    Ok(Generated { ca: ca_cert.pem(), cert: cert.pem(), key: key.serialize_pem() })
}

/// Writes a fresh set into a new directory beside `tls/`, then moves it into place in one
/// rename, so a crash never leaves half a set and two relays starting together on one data dir
/// end up with the same one.
fn create(data_dir: &Path, files: &TlsFiles, hosts: &[String]) -> anyhow::Result<()> {
    let made = generate(hosts)?;
    let tmp = data_dir.join(format!(".tls-new-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let written = (|| -> anyhow::Result<()> {
        crate::data_dir::write_private(&tmp.join("key.pem"), &made.key)?;
        write_public(&tmp.join("cert.pem"), &made.cert)?;
        write_public(&tmp.join("ca.pem"), &made.ca)?;
        // An empty tls/ (made by hand) is replaced; one with files in it is not.
        let _ = std::fs::remove_dir(&files.dir);
        std::fs::rename(&tmp, &files.dir)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), files.dir.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another relay on this data dir made its set first: use that one.
        if files.all().iter().all(|p| p.exists()) {
            return Ok(());
        }
        return Err(e);
    }
    tracing::info!(event = "tls_created", dir = %files.dir.display(), hosts = ?hosts);
    Ok(())
}

fn write_public(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).with_context(|| format!("cannot write {}", path.display()))
}

fn read(path: &Path, files: &TlsFiles) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {} ({})", path.display(), files.remedy()))
}

fn certificates(path: &Path, pem: &[u8], files: &TlsFiles) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{} is not valid PEM: {e:?}; {}", path.display(), files.remedy()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate; {}", path.display(), files.remedy());
    }
    Ok(certs)
}

fn load(files: &TlsFiles, hosts: &[String]) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = provider();
    let remedy = files.remedy();

    let ca_pem = read(&files.ca, files)?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in certificates(&files.ca, &ca_pem, files)? {
        roots.add(ca).map_err(|e| anyhow!("{} is not a usable CA certificate: {e}; {remedy}", files.ca.display()))?;
    }

    let cert_pem = read(&files.cert, files)?;
    let chain = certificates(&files.cert, &cert_pem, files)?;

    let key_pem = read(&files.key, files)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| anyhow!("{} holds no usable PEM private key ({e:?}); {remedy}", files.key.display()))?;
    provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| anyhow!("{} is not a usable private key: {e}; {remedy}", files.key.display()))?;

    // What a client given ca.pem will check, for every name it may use.
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| anyhow!("{}: {e}; {remedy}", files.ca.display()))?;
    let (end_entity, intermediates) =
        chain.split_first().ok_or_else(|| anyhow!("{} is empty", files.cert.display()))?;
    for host in hosts {
        let name = ServerName::try_from(host.as_str()).map_err(|_| anyhow!("`{host}` is not a host name"))?;
        verifier.verify_server_cert(end_entity, intermediates, &name, &[], UnixTime::now()).map_err(|e| {
            anyhow!("{} does not verify for `{host}` under {}: {e}; {remedy}", files.cert.display(), files.ca.display())
        })?;
    }

    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| anyhow!("{} does not belong to {}: {e}; {remedy}", files.key.display(), files.cert.display()))?;
    // The server speaks HTTP/1.1 only.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A TCP listener that hands axum connections which completed their TLS handshake.
///
/// Handshakes run in tasks of their own, each bounded by a timeout, so a client that connects and
/// says nothing (or speaks something else) holds up no one; a failed handshake is logged at
/// debug and the connection dropped, and the server goes on.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>, handshake_timeout: Duration) -> io::Result<Self> {
        let local_addr = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let accepting = tokio::spawn(accept_loop(tcp, TlsAcceptor::from(config), handshake_timeout, tx));
        Ok(Self { ready, local_addr, accepting })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // Closes the port at once, as dropping a plain listener does.
        self.accepting.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    timeout: Duration,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let accepted = tokio::select! {
            r = tcp.accept() => r,
            () = tx.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            Err(e) => {
                // As axum does for plain TCP: most likely out of file descriptors; wait for some
                // to be closed.
                tracing::error!(event = "tls_accept_failed", error = relay_shared::telemetry::error_chain(&e));
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    // Fails only when the server has stopped accepting.
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Err(e)) => {
                    tracing::debug!(event = "tls_handshake_failed", %peer, error = relay_shared::telemetry::error_chain(&e))
                }
                Err(_) => tracing::debug!(event = "tls_handshake_timeout", %peer, ?timeout),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop ended, which it does only once this listener is dropped: never
            // while axum is still asking.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

/// Serves the relay over TLS on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TlsListener,
    relay: Arc<Relay>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, crate::router(relay)).with_graceful_shutdown(shutdown).await
}
