//! Where runs start: the Lambda handler, and local mode's loop that runs one whenever woken.

use std::sync::Arc;
use std::time::Duration;

use relay_shared::time::Clock;

use crate::deps::Deps;
use crate::report::RunReport;
use crate::run::run;

/// The Lambda entry point (a schedule, or a stream batch with the wake item: the payload says
/// nothing the run needs).
pub async fn handle(
    event: lambda_runtime::LambdaEvent<serde_json::Value>,
    deps: &Deps,
    clock: Arc<dyn Clock>,
) -> Result<RunReport, lambda_runtime::Error> {
    let now = clock.now();
    let left = relay_shared::time_left(event.context.deadline, now);
    Ok(run(deps, clock, now.plus(left), None).await)
}

/// Local mode's submitter: a run whenever `wake` is notified (a task was queued) and once a
/// minute (the schedule), until `stop`.
pub async fn serve_local(
    deps: &Deps,
    clock: Arc<dyn Clock>,
    wake: Arc<tokio::sync::Notify>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let _busy = clock.busy();
    loop {
        let deadline = clock.now().plus(deps.settings.period + Duration::from_secs(15));
        tokio::select! {
            report = run(deps, clock.clone(), deadline, Some(wake.clone())) => {
                tracing::debug!(?report, "local submitter run");
            }
            _ = stop.wait_for(|s| *s) => return,
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = clock.sleep_until(clock.now().plus(deps.settings.period)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
