//! The CaptchaAI (2captcha v1 protocol) client: in.php to submit, res.php to read.
//!
//! By responsibility: the request ([`SubmitRequest`]: its shape, checks and in.php form), the
//! errors ([`CaptchaAiError`]), the reading of answers ([`parse_answer`], [`ResAnswer`]), the
//! plan's size ([`ThreadsInfo`]) and the client ([`CaptchaAiClient`]).

mod answer;
mod client;
mod error;
mod form;
mod request;
mod threads;
mod validate;

pub use answer::{RawAnswer, ResAnswer, answer_user_agent, parse_answer, report_answer, split_batch};
pub use client::CaptchaAiClient;
pub use error::CaptchaAiError;
pub use request::{BLS_CELLS, BLS_FIELDS, Browser, IMAGE_HINTS, MAX_BLS_CELL, MAX_IMAGE_BASE64, SubmitRequest};
pub use threads::{ThreadsInfo, parse_threads_info};

#[cfg(test)]
mod tests;
