//! Shared by every function of the relay: the task domain, the adapters (DynamoDB store,
//! CaptchaAI client), configuration, secrets, HTTP helpers and telemetry.

pub mod captchaai;
pub mod codes;
pub mod config;
pub mod deadletter;
pub mod domain;
pub mod http;
pub mod retry;
pub mod secrets;
pub mod signing;
pub mod store;
pub mod telemetry;

/// Timestamps and clocks (the `relay-time` crate, so the fake CaptchaAI can share them).
pub use relay_time as time;

#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

/// Builds the AWS SDK configuration once, at cold start. `AWS_ENDPOINT_URL_DYNAMODB` and
/// friends point it at a local engine.
pub async fn aws_config() -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest()).load().await
}
