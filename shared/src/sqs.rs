//! An SQS queue by URL: what the dead-letter, poison and push-retry queues are on AWS (send,
//! receive, delete, visibility), with failures as [`QueueError`].

use std::fmt;

use aws_sdk_sqs::Client;

/// Why a queue call failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("queue unavailable: {0}")]
pub struct QueueError(pub String);

/// An SQS queue by URL.
#[derive(Debug, Clone)]
pub struct SqsQueue {
    client: Client,
    url: String,
}

/// A received message.
#[derive(Debug, Clone)]
pub struct Received {
    pub message_id: String,
    pub receipt_handle: String,
    pub body: String,
    pub receive_count: u32,
}

fn sqs_err<E: std::error::Error + 'static, R: fmt::Debug>(e: aws_sdk_sqs::error::SdkError<E, R>) -> QueueError {
    QueueError(aws_sdk_sqs::error::DisplayErrorContext(&e).to_string())
}

impl SqsQueue {
    pub fn new(client: Client, url: impl Into<String>) -> Self {
        Self { client, url: url.into() }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn send_body(&self, body: &str) -> Result<String, QueueError> {
        let out = self.client.send_message().queue_url(&self.url).message_body(body).send().await.map_err(sqs_err)?;
        Ok(out.message_id.unwrap_or_default())
    }

    /// Sends a message that becomes visible after `delay_secs` (at most 900, SQS's limit).
    pub async fn send_delayed(&self, body: &str, delay_secs: u32) -> Result<String, QueueError> {
        let out = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(body)
            .delay_seconds(i32::try_from(delay_secs.min(900)).unwrap_or(900))
            .send()
            .await
            .map_err(sqs_err)?;
        Ok(out.message_id.unwrap_or_default())
    }

    /// Receives up to `max` (≤ 10) messages, hidden for `visibility_secs`.
    pub async fn receive(&self, max: i32, visibility_secs: i32, wait_secs: i32) -> Result<Vec<Received>, QueueError> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, 10))
            .visibility_timeout(visibility_secs)
            .wait_time_seconds(wait_secs)
            .message_system_attribute_names(aws_sdk_sqs::types::MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map_err(sqs_err)?;
        Ok(out
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(|m| Received {
                receive_count: m
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(&aws_sdk_sqs::types::MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
                message_id: m.message_id.unwrap_or_default(),
                receipt_handle: m.receipt_handle.unwrap_or_default(),
                body: m.body.unwrap_or_default(),
            })
            .collect())
    }

    pub async fn delete(&self, receipt_handle: &str) -> Result<(), QueueError> {
        self.client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(receipt_handle)
            .send()
            .await
            .map_err(sqs_err)?;
        Ok(())
    }

    /// Hides a received message for `secs` from now (SQS's limit: 12 h), instead of the rest
    /// of the visibility timeout it was received with.
    pub async fn change_visibility(&self, receipt_handle: &str, secs: u32) -> Result<(), QueueError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt_handle)
            .visibility_timeout(i32::try_from(secs.min(43_200)).unwrap_or(43_200))
            .send()
            .await
            .map_err(sqs_err)?;
        Ok(())
    }

    /// Approximate number of visible messages.
    pub async fn depth(&self) -> Result<u64, QueueError> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages)
            .send()
            .await
            .map_err(sqs_err)?;
        Ok(out
            .attributes
            .and_then(|a| a.get(&aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages).cloned())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0))
    }
}
