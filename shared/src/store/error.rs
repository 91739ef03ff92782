//! The store's one error type, and how an SDK failure maps to it (retryable or not).

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};

/// A store failure. Every variant says whether trying again may help.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Throttling, a network fault, a 5xx: the SDK's own retries ran out.
    #[error("task store unavailable: {0}")]
    Unavailable(String),
    /// The request itself was refused (validation, missing table): retrying will not help.
    #[error("task store refused the request: {0}")]
    Rejected(String),
    /// An item that does not decode into a task.
    #[error("stored task is malformed: {0}")]
    Corrupt(String),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

pub(crate) fn sdk_error<E, R>(err: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let text = aws_sdk_dynamodb::error::DisplayErrorContext(&err).to_string();
    match &err {
        SdkError::ServiceError(se) => match se.err().code() {
            Some(
                "ValidationException"
                | "ResourceNotFoundException"
                | "AccessDeniedException"
                | "UnrecognizedClientException"
                | "SerializationException",
            ) => StoreError::Rejected(text),
            _ => StoreError::Unavailable(text),
        },
        _ => StoreError::Unavailable(text),
    }
}
