//! `relay-ops queue`: the submit queue as the table holds it.

use relay_shared::store::TaskStore;
use relay_shared::submit::window::{Gate, Window, WindowSettings, WindowState};
use relay_shared::time::Timestamp;

/// What `relay-ops queue` prints: depth per lane and its oldest task's wait, the submitter's
/// lease, its learnt window, the inline permits and the release rate.
pub async fn report(store: &TaskStore, now: Timestamp) -> anyhow::Result<String> {
    let st = store.queue().submit_state().await?;
    let mut out = format!("queued: {} in {} lane(s)\n", st.queued, st.lanes.len());
    for (lane, n) in &st.lanes {
        let oldest = store.queue().queue_heads(lane, 1).await?.first().map(|h| now.since(h.queued_at).as_secs());
        let class = if lane.ends_with(".i") { "images" } else { "tokens" };
        match oldest {
            Some(secs) => out.push_str(&format!("  lane {lane} ({class}): {n} waiting, the oldest for {secs} s\n")),
            None => out
                .push_str(&format!("  lane {lane} ({class}): counted {n}, none listed (set right by the next run)\n")),
        }
    }
    match (&st.releaser, st.releaser_until) {
        (Some(who), Some(until)) if st.releaser_live(now) => {
            out.push_str(&format!("submitter: running ({who}, lease {} s left)\n", until.since(now).as_secs()))
        }
        _ => out.push_str("submitter: not running (woken when a task is queued, and every minute)\n"),
    }
    let saved: Option<WindowState> = st.window.as_deref().and_then(|w| serde_json::from_str(w).ok());
    match &saved {
        Some(state) => {
            let w = Window::restore(WindowSettings::default(), Some(state));
            let held = match w.gate(u32::MAX, now) {
                Gate::Hold(until) => format!(", sends held {} s more", until.since(now).as_secs()),
                _ => String::new(),
            };
            let full = match state.full_at {
                Some(level) => format!(
                    "full at {level} in work {} s ago",
                    now.since(Timestamp::from_millis(state.full_seen_ms)).as_secs()
                ),
                None => "no \"no slot\" answer seen: growing".to_owned(),
            };
            out.push_str(&format!(
                "window: {} tasks in work at once ({full}; {} \"no slot\" answer(s) in the last minute{held})\n",
                w.limit(now),
                w.no_slots_last_minute(now)
            ));
        }
        None => out.push_str("window: not learnt yet (no submitter has run)\n"),
    }
    out.push_str(&format!(
        "inline permits: {}\nreleased in the last minute: {}\ninline \"no slot\" answers: {} ({} taken into the window)\n",
        st.permits.map_or("none published yet".to_owned(), |p| p.max(0).to_string()),
        st.released_per_minute,
        st.api_no_slots,
        st.api_no_slots_seen
    ));
    if let Some(until) = st.breaker.open_for_submits_at(now) {
        out.push_str(&format!(
            "CaptchaAI traffic stopped until {until} ({}): nothing is released before (`relay-ops breaker show`)\n",
            st.breaker.reason.as_deref().unwrap_or("?")
        ));
    }
    Ok(out)
}
