//! Pinning a result before it is shown: once an owner has seen a token, it never changes.

use relay_shared::domain::Task;

use crate::deps::Deps;

/// Why a result could not be pinned.
pub(crate) enum Pin {
    Store(relay_shared::store::StoreError),
    /// It kept changing (a result received earlier replacing it): the task as last read.
    Changing,
}

/// The task to show its owner, its result pinned first if showing it hands one out: a result,
/// once shown, never changes (before, one received earlier may still replace it). If the item
/// changed since it was read, what it holds now is shown (and pinned) instead.
pub(crate) async fn pin(mut task: Task, deps: &Deps) -> Result<Task, Pin> {
    // Each refusal means the item changed: a strictly earlier-received result, an earlier
    // receipt, or another read's pin. A few rounds settle it in practice.
    for _ in 0..5 {
        let now = deps.clock.now();
        if !task.needs_pin(now) {
            return Ok(task);
        }
        match deps.store.results.mark_handed_out(&task, now).await {
            Ok(None) => return Ok(Task { handed_out_at: Some(now), ..task }),
            Ok(Some(current)) => task = current,
            Err(e) => return Err(Pin::Store(e)),
        }
    }
    Err(Pin::Changing)
}
