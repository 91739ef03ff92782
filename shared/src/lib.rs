//! Shared by every function of the relay: the task domain, the adapters (DynamoDB store,
//! CaptchaAI client), configuration, secrets, HTTP helpers and telemetry.

pub mod captchaai;
pub mod codes;
pub mod config;
pub mod deadletter;
pub mod delivery;
pub mod domain;
pub mod http;
pub mod idempotency;
pub mod lambda;
pub mod retry;
pub mod secrets;
pub mod signing;
pub mod sqs;
pub mod store;
pub mod submit;
pub mod telemetry;
pub mod warm;
pub mod webhook;

/// Timestamps and clocks (the `relay-time` crate, so the fake CaptchaAI can share them).
pub use relay_time as time;

#[cfg(any(test, feature = "local"))]
pub mod local;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

/// Time until the invocation's deadline. Lambda sends an epoch-ms deadline; cargo lambda's
/// emulator sends the timeout itself (e.g. `600000`). A value too small to be an epoch (before
/// 2001) is taken as a duration from now.
pub fn time_left(deadline_ms: u64, now: time::Timestamp) -> std::time::Duration {
    const PLAUSIBLE_EPOCH_MS: u64 = 1_000_000_000_000;
    if deadline_ms < PLAUSIBLE_EPOCH_MS {
        std::time::Duration::from_millis(deadline_ms)
    } else {
        std::time::Duration::from_millis(deadline_ms.saturating_sub(now.as_millis()))
    }
}

/// Builds the AWS SDK configuration once, at cold start. `AWS_ENDPOINT_URL_DYNAMODB` and
/// friends point it at a local engine.
pub async fn aws_config() -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        // The SDK crates are built without a default client: this is the only one.
        .http_client(aws_http_client().expect("the embedded AWS roots parse (a unit test checks)"))
        .load()
        .await
}

/// The root certificates AWS service endpoints chain to (Amazon Trust Services).
pub const AWS_ROOTS_PEM: &[u8] = include_bytes!("../certs/aws-roots.pem");

/// The SDK's default HTTPS client (hyper, rustls on aws-lc, proxy settings from the environment)
/// trusting only the Amazon Trust Services roots: the default loads and parses the system's
/// whole certificate store (about 140 files) on the first request of every cold start. AWS
/// endpoints all present Amazon Trust Services chains.
pub fn aws_http_client()
-> Result<aws_smithy_runtime_api::client::http::SharedHttpClient, aws_smithy_http_client::HttpClientError> {
    use aws_smithy_http_client::{ConnectorBuilder, proxy::ProxyConfig, tls};
    let ctx = tls::TlsContext::builder()
        .with_trust_store(tls::TrustStore::empty().with_native_roots(false).with_pem_certificate(AWS_ROOTS_PEM))
        .build()?;
    Ok(aws_smithy_http_client::Builder::new().build_with_connector_fn(move |settings, components| {
        let mut b = ConnectorBuilder::default()
            .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::AwsLc))
            .tls_context(ctx.clone());
        b.set_connector_settings(settings.cloned());
        if let Some(c) = components {
            b.set_sleep_impl(c.sleep_impl());
        }
        b.set_proxy_config(Some(ProxyConfig::from_env()));
        b.build()
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_embedded_aws_roots_are_five_certificates_and_the_client_builds() {
        let pem = std::str::from_utf8(super::AWS_ROOTS_PEM).expect("ASCII");
        assert_eq!(pem.matches("-----BEGIN CERTIFICATE-----").count(), 5);
        for name in ["Amazon_Root_CA_1", "Amazon_Root_CA_4", "Starfield_Services_Root_Certificate_Authority_-_G2"] {
            assert!(pem.contains(name), "{name}");
        }
        assert!(super::aws_http_client().is_ok());
    }
}
