//! The relay on one machine: the API and callback handlers on one HTTP server, the poller on
//! a timer and the redrive loop draining a durable on-disk dead-letter queue — the same
//! handler code the Lambdas run — over an embedded DynamoDB engine persisted to a file.
//!
//! Split by responsibility: the settings and their checks ([`LocalConfig`]), the secrets (the
//! relay's own and the webhook signing secrets), start-up ([`start`], [`Running`]) and the
//! dead-letter queue's redrive loop and listing. What the operator commands share with the relay
//! lives in [`crate::data_dir`], so [`crate::ops`] does not depend on this module.

mod config;
mod dead_letters;
mod secrets;
mod startup;

pub use config::{LocalConfig, LogFormat, PUBLISHED_DEFAULTS};
pub use dead_letters::{DRAIN_BATCHES_PER_PASS, drain_dead_letters, list_poisoned};
pub use secrets::LocalSecrets;
pub use startup::{DELIVERY_CATCH_UP, Options, Running, delivery_settings, start};

pub use crate::data_dir::{DEAD_LETTER_MAX_RECEIVES, ENDPOINT_FILE, RETENTION, running_store};
