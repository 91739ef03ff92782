//! One run's working state: what it knows of the lanes, its own sends, the window, and the
//! count moves it has yet to write.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use relay_shared::captchaai::CaptchaAiError;
use relay_shared::domain::{CaptchaId, TaskRef};
use relay_shared::store::{QueuedRef, Released, SubmitState};
use relay_shared::submit::lanes::Fair;
use relay_shared::submit::window::{Window, WindowState};
use relay_shared::time::{Clock, Timestamp};

use crate::deps::Deps;

/// An in.php call that has answered.
pub(super) struct Sent {
    pub(super) released: Released,
    /// Tasks in work when it was sent (not counting it).
    pub(super) in_flight: u32,
    pub(super) answer: Result<CaptchaId, CaptchaAiError>,
}

/// A lane's view in this run.
#[derive(Default)]
pub(super) struct Lane {
    /// The next tasks, oldest first (read from the index).
    pub(super) heads: VecDeque<QueuedRef>,
    /// The index listed nothing at this time, while the lane's count was this.
    pub(super) empty: Option<(Timestamp, u64)>,
}

/// One run's working state.
pub(super) struct Run<'a> {
    pub(super) deps: &'a Deps,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) window: Window,
    /// `ERROR_ZERO_BALANCE` answers in a row that `threadsinfo` showed with threads free.
    pub(super) plan_out_seen: u32,
    /// When `threadsinfo` was last asked after such an answer.
    pub(super) plan_checked_at: Option<Timestamp>,
    /// The plan's `working_threads` as last read while the window was full, and when.
    pub(super) working: Option<(Timestamp, u32)>,
    /// Sends made since that read (they may be at work on top of what it counted).
    pub(super) sent_since_plan_read: u32,
    pub(super) lanes: HashMap<String, Lane>,
    pub(super) fair: Fair,
    /// Tasks this run released: when (counted in work for `index_lag`, whatever the index says).
    pub(super) mine: HashMap<TaskRef, Timestamp>,
    /// Tasks this run released that the index may still list (not inline submits).
    pub(super) released: BTreeSet<TaskRef>,
    /// What the index listed in work at the last look (`None` before the first).
    pub(super) seen: Option<BTreeSet<TaskRef>>,
    /// When each release of the last minute was made.
    pub(super) released_at: VecDeque<Timestamp>,
    /// The count of inline "no slot" answers already taken into the window.
    pub(super) api_no_slots: u64,
    /// No sends before this (a server error code).
    pub(super) pause_until: Timestamp,
    /// The in.php pace's second was full: no sends before this.
    pub(super) pace_until: Timestamp,
    /// Queue counts moved since the last write (releases, requeues, timeouts), per lane: one
    /// write a tick on the account's state item, not one per task.
    /// Count moves not written yet, by count item and lane.
    pub(super) moved: BTreeMap<(u8, String), i64>,
    /// When the in-work index was last read, and the lease last renewed (at most once a tick
    /// each, however many answers come in between).
    pub(super) looked_at: Option<Timestamp>,
    pub(super) renewed_at: Timestamp,
}

impl<'a> Run<'a> {
    /// The state of a run that took the lease at `start`, finding `state`: the window as the
    /// last run left it.
    pub(super) fn new(deps: &'a Deps, clock: Arc<dyn Clock>, state: &SubmitState, start: Timestamp) -> Self {
        let saved: Option<WindowState> = state.window.as_deref().and_then(|w| serde_json::from_str(w).ok());
        Run {
            plan_out_seen: 0,
            plan_checked_at: None,
            working: None,
            sent_since_plan_read: 0,
            deps,
            clock,
            window: Window::restore(deps.settings.queue.window.clone(), saved.as_ref()),
            lanes: HashMap::new(),
            fair: Fair::default(),
            mine: HashMap::new(),
            released: BTreeSet::new(),
            seen: None,
            released_at: VecDeque::new(),
            // Inline "no slot" answers no run took into the window yet (the first look applies them).
            api_no_slots: state.api_no_slots_seen,
            pause_until: start,
            pace_until: start,
            moved: BTreeMap::new(),
            looked_at: None,
            renewed_at: start,
        }
    }

    /// Puts `head` back at the front of `lane`'s buffer (not sent this time).
    pub(super) fn put_back(&mut self, lane: &str, head: QueuedRef) {
        self.lanes.entry(lane.to_owned()).or_default().heads.push_front(head);
    }
}
