//! A local relay's data directory as the relay and the operator commands share it: the store
//! endpoint a running relay writes there, the retention and dead-letter settings both open its
//! files with, and owner-only files.

use std::time::Duration;

use anyhow::{Context, bail};
use relay_shared::local::client_for;
use relay_shared::store::TaskStore;

/// The file in the data directory that names the running relay's store endpoint.
pub const ENDPOINT_FILE: &str = "dynamodb-endpoint";

/// How long a finished task is kept by default (`RETENTION_DAYS`, as on AWS).
pub const RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// The task store of the relay running on `data_dir`, through the endpoint it wrote there (for
/// the operator commands and tests; [`crate::ops::open_store`] also opens a stopped relay's).
pub async fn running_store(data_dir: &std::path::Path) -> anyhow::Result<TaskStore> {
    let path = data_dir.join(ENDPOINT_FILE);
    let endpoint = std::fs::read_to_string(&path)
        .with_context(|| format!("no relay has run on {} (start `relay-local serve` first)", data_dir.display()))?;
    let client = client_for(endpoint.trim());
    if let Err(e) = client.describe_table().table_name("tasks").send().await {
        bail!(
            "the relay on {} does not answer at {} ({}): is it still starting? Try again in a moment",
            data_dir.display(),
            endpoint.trim(),
            relay_shared::telemetry::error_chain(&e)
        );
    }
    Ok(TaskStore::new(client, "tasks", RETENTION))
}

/// Receives of a local dead letter before it is poisoned: the template's `MaxReceiveCount`
/// default (half of them fast, while its token may live).
pub const DEAD_LETTER_MAX_RECEIVES: u32 = 12;

/// Writes a file only its owner can read.
pub(crate) fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).with_context(|| format!("cannot write {}", path.display()))
}
