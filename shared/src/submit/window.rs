//! How many tasks CaptchaAI takes at once, learnt from what it answers.
//!
//! A CaptchaAI plan is a number of threads; a submit while they are all busy is answered
//! `ERROR_NO_SLOT_AVAILABLE` (or `ERROR_ZERO_BALANCE`, "no free thread"), and those answers,
//! repeated, earn bans (120 in a minute: `ERROR: 1001`; 3 × the captchas sent: `ERROR: 1003`).
//! The submit queue therefore sends a task only while fewer than [`Window::limit`] of its tasks
//! are in work, and learns the limit the way TCP learns a path's capacity:
//! - **slow start**: with no "no slot" answer seen, each task CaptchaAI takes widens the window
//!   by two (one for itself, one more: it doubles with every round of in.php answers), so the
//!   plan is found within a second;
//! - **a "no slot" answer** says the plan is full at the number of tasks in work when it was
//!   sent (`full_at`): the window drops to that level less one (less 10 % for a large one),
//!   nothing is sent for `hold`, and the window is held at that level;
//! - **congestion avoidance**: below `full_at` the window grows by 1/window per task taken, and
//!   it probes one task above `full_at` only after `probe_wait` (10 s, doubled by each probe
//!   that is refused, to 5 minutes): a stable plan costs one "no slot" answer per probe. A probe
//!   that is taken means the plan grew: slow start again;
//! - **a hard budget**: never more than `no_slot_per_minute` such answers in any 60 s, whatever
//!   the estimate says (the default 20 is far below both ban rules, and the target of 60), sends
//!   in flight counted against it, and a hold that doubles with each answer refused in a row (to
//!   8 s): a plan that takes nothing at all — another client on the account, no balance — is
//!   asked at most every 8 s;
//! - **time grows it too**: a full window with no progress for `stall_after` (no task taken, none
//!   finished; a third of it while the plan's size is still unknown) lets one task through — the tasks it counts may be done already, their pingbacks
//!   lost (the poller records them only after their grace): a probe, under the same rules (the
//!   hold, the budget, and above a known full level only when a probe is due);
//! - a configured thread count (`CAPTCHAAI_THREADS`) is where the window starts and a ceiling
//!   it never passes, so a known plan is used fully from the first second;
//! - without one, the plan CaptchaAI states (`res.php?action=threadsinfo`, read by the
//!   submitter at its start and every [`PLAN_REFRESH`]) is the same: where the window stands
//!   and its ceiling — read, not learnt from refusals.
//!
//! Pure: every method takes the time. The submit queue keeps one, persisted between runs.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// The window's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowSettings {
    /// The plan's thread count, if known (`CAPTCHAAI_THREADS`): the window starts there and
    /// never passes it.
    pub threads: Option<u32>,
    /// Where the window starts when the plan is not known.
    pub initial: u32,
    /// The largest window when the plan is not known.
    pub max: u32,
    /// Nothing is sent for this long after a "no slot" answer (doubled for each one refused in
    /// a row, up to `hold_max`).
    pub hold: Duration,
    pub hold_max: Duration,
    /// Most "no slot" answers in any 60 s (`SUBMIT_NO_SLOT_PER_MINUTE`).
    pub no_slot_per_minute: u32,
    /// First wait before probing above the level at which the plan was full.
    pub probe_wait: Duration,
    /// Longest such wait.
    pub probe_wait_max: Duration,
    /// A full level learnt this long ago is forgotten (plans change).
    pub forget_after: Duration,
    /// A full window with no progress this long lets one task through (see the module docs).
    pub stall_after: Duration,
}

impl Default for WindowSettings {
    fn default() -> Self {
        Self {
            threads: None,
            initial: 10,
            max: 1_000,
            hold: Duration::from_secs(1),
            hold_max: Duration::from_secs(8),
            no_slot_per_minute: 20,
            probe_wait: Duration::from_secs(10),
            probe_wait_max: Duration::from_secs(300),
            forget_after: Duration::from_secs(600),
            stall_after: Duration::from_secs(3),
        }
    }
}

/// Whether a task may be sent now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// This many more may be sent.
    Open(u32),
    /// The window is full: wait for a task to finish.
    Full,
    /// Nothing may be sent before this time (a "no slot" answer's hold, or the minute's budget
    /// of them is spent).
    Hold(Timestamp),
}

/// What is kept between runs (JSON in the table).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowState {
    pub size: f64,
    #[serde(default)]
    pub full_at: Option<u32>,
    #[serde(default)]
    pub full_seen_ms: u64,
    #[serde(default)]
    pub probe_after_ms: u64,
    #[serde(default)]
    pub probe_wait_ms: u64,
    #[serde(default)]
    pub hold_until_ms: u64,
    #[serde(default)]
    pub progress_ms: u64,
    #[serde(default)]
    pub refused_in_a_row: u32,
    /// "No slot" answers of the last minute (epoch ms).
    #[serde(default)]
    pub no_slots: Vec<u64>,
    /// The plan's threads as `threadsinfo` last stated them, and when (epoch ms).
    #[serde(default)]
    pub plan: Option<u32>,
    #[serde(default)]
    pub plan_read_ms: u64,
}

/// How often the plan is read again (`threadsinfo`): plans change when they are renewed.
pub const PLAN_REFRESH: Duration = Duration::from_secs(300);

/// The learnt window (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    s: WindowSettings,
    size: f64,
    full_at: Option<u32>,
    full_seen: Timestamp,
    probe_after: Timestamp,
    probe_wait: Duration,
    hold_until: Timestamp,
    no_slots: VecDeque<Timestamp>,
    /// The last sign of progress: a task taken, one finished, a "no slot" answer.
    progress: Timestamp,
    /// "No slot" answers since the last task taken, each after the hold of the one before.
    refused_in_a_row: u32,
    /// The plan's threads as CaptchaAI states them (`threadsinfo`), and when they were read.
    plan: Option<u32>,
    plan_read: Timestamp,
}

const MINUTE: Duration = Duration::from_secs(60);

impl Window {
    pub fn new(s: WindowSettings) -> Self {
        let size = f64::from(s.threads.unwrap_or(s.initial).max(1));
        let probe_wait = s.probe_wait;
        Self {
            s,
            size,
            full_at: None,
            full_seen: Timestamp::from_millis(0),
            probe_after: Timestamp::from_millis(0),
            probe_wait,
            hold_until: Timestamp::from_millis(0),
            no_slots: VecDeque::new(),
            progress: Timestamp::from_millis(0),
            refused_in_a_row: 0,
            plan: None,
            plan_read: Timestamp::from_millis(0),
        }
    }

    /// The plan's threads, as `threadsinfo` stated them at `now`: where the window stands and
    /// its ceiling (a configured `CAPTCHAAI_THREADS` still wins).
    pub fn set_plan(&mut self, threads: u32, now: Timestamp) {
        self.plan = Some(threads.max(1));
        self.plan_read = now;
        if self.s.threads.is_none() {
            self.size = self.cap();
        }
    }

    /// The plan as last read, if it was.
    pub fn plan(&self) -> Option<u32> {
        self.plan
    }

    /// Whether the plan should be read (again) at `now`.
    pub fn plan_due(&self, now: Timestamp) -> bool {
        self.plan.is_none() || now.since(self.plan_read) >= PLAN_REFRESH
    }

    /// A window as an earlier run left it (`None` or unreadable: a new one). A configured thread
    /// count that changed since wins.
    pub fn restore(s: WindowSettings, state: Option<&WindowState>) -> Self {
        let mut w = Self::new(s);
        let Some(st) = state.filter(|st| st.size.is_finite() && st.size >= 1.0) else { return w };
        w.plan = st.plan;
        w.size = st.size.min(w.cap());
        w.full_at = st.full_at;
        w.full_seen = Timestamp::from_millis(st.full_seen_ms);
        w.probe_after = Timestamp::from_millis(st.probe_after_ms);
        if st.probe_wait_ms > 0 {
            w.probe_wait = Duration::from_millis(st.probe_wait_ms).min(w.s.probe_wait_max);
        }
        w.hold_until = Timestamp::from_millis(st.hold_until_ms);
        w.progress = Timestamp::from_millis(st.progress_ms);
        w.refused_in_a_row = st.refused_in_a_row;
        w.no_slots = st.no_slots.iter().map(|ms| Timestamp::from_millis(*ms)).collect();
        w.plan = st.plan;
        w.plan_read = Timestamp::from_millis(st.plan_read_ms);
        w
    }

    pub fn state(&self) -> WindowState {
        WindowState {
            size: self.size,
            full_at: self.full_at,
            full_seen_ms: self.full_seen.as_millis(),
            probe_after_ms: self.probe_after.as_millis(),
            probe_wait_ms: u64::try_from(self.probe_wait.as_millis()).unwrap_or(u64::MAX),
            hold_until_ms: self.hold_until.as_millis(),
            progress_ms: self.progress.as_millis(),
            refused_in_a_row: self.refused_in_a_row,
            no_slots: self.no_slots.iter().map(|t| t.as_millis()).collect(),
            plan: self.plan,
            plan_read_ms: self.plan_read.as_millis(),
        }
    }

    fn cap(&self) -> f64 {
        f64::from(self.s.threads.or(self.plan).unwrap_or(self.s.max).max(1))
    }

    /// The level at which the plan was last full, unless that was too long ago.
    fn known_full(&self, now: Timestamp) -> Option<u32> {
        self.full_at.filter(|_| now.since(self.full_seen) < self.s.forget_after)
    }

    /// Most tasks in work at once now.
    pub fn limit(&self, now: Timestamp) -> u32 {
        let mut limit = self.size.floor().min(self.cap()) as u32;
        if let Some(full) = self.known_full(now) {
            // At the full level, one above it only when a probe is due.
            let ceiling = if now >= self.probe_after { full + 1 } else { full };
            limit = limit.min(ceiling);
        }
        limit.max(1)
    }

    /// How many more "no slot" answers the minute's budget allows at `now`.
    pub fn no_slot_budget_left(&self, now: Timestamp) -> u32 {
        self.s.no_slot_per_minute.saturating_sub(self.no_slots_last_minute(now))
    }

    /// "No slot" answers in the 60 s before `now`.
    pub fn no_slots_last_minute(&self, now: Timestamp) -> u32 {
        let from = now.minus(MINUTE);
        self.no_slots.iter().filter(|t| **t >= from).count() as u32
    }

    /// Whether a task may be sent now, with `in_flight` of ours in work.
    pub fn gate(&self, in_flight: u32, now: Timestamp) -> Gate {
        if now < self.hold_until {
            return Gate::Hold(self.hold_until);
        }
        // Any 60 s, both ends included, holds at most the budget.
        let from = now.minus(MINUTE);
        let recent: Vec<&Timestamp> = self.no_slots.iter().filter(|t| **t >= from).collect();
        if recent.len() as u32 >= self.s.no_slot_per_minute.max(1) {
            // The budget frees when the oldest of them is a minute old.
            let oldest = recent.first().map_or(now, |t| **t);
            return Gate::Hold(oldest.plus(MINUTE).plus(Duration::from_millis(1)));
        }
        let limit = self.limit(now);
        if in_flight < limit {
            return Gate::Open(limit - in_flight);
        }
        // Before the plan's size is known, a stall costs at most one "no slot" answer, which
        // ends the guessing: look sooner.
        let (probe_allowed, stall) = match self.known_full(now) {
            None => (true, self.s.stall_after / 3),
            Some(_) => (now >= self.probe_after, self.s.stall_after),
        };
        if now >= self.progress.plus(stall) && probe_allowed && in_flight < self.cap() as u32 {
            // Full, and nothing moved for a while: what it counts in work may be done already.
            return Gate::Open(1);
        }
        Gate::Full
    }

    /// A task in work finished (its result was recorded): progress, for the stall rule.
    pub fn finished(&mut self, now: Timestamp) {
        self.progress = self.progress.max(now);
    }

    /// CaptchaAI took a task sent while `in_flight` others were in work.
    pub fn accepted(&mut self, in_flight: u32, now: Timestamp) {
        self.progress = self.progress.max(now);
        self.refused_in_a_row = 0;
        if let Some(full) = self.known_full(now)
            && in_flight >= full
        {
            // A probe above the full level was taken: the plan grew. Find its new size fast.
            self.full_at = None;
            self.probe_wait = self.s.probe_wait;
        }
        // Only a window that is being used grows (one far above what is in work says nothing
        // about the plan: the pace or the queue limited what was sent, not the window).
        if f64::from(in_flight + 1) < self.size.floor() / 2.0 {
            return;
        }
        let step = match self.known_full(now) {
            // One for the task taken (it stays in work for its solve), one more.
            None => 2.0,
            Some(_) => 1.0 / self.size.max(1.0),
        };
        // A task taken above the window (a stall's probe) proves the window at least that big.
        self.size = (self.size.max(f64::from(in_flight) + 1.0) + step).min(self.cap());
        if let Some(full) = self.known_full(now) {
            // Below the full level it grows; above it only a probe passes (see `limit`).
            self.size = self.size.min(f64::from(full) + 1.0);
        }
    }

    /// CaptchaAI answered "no free thread" to a task sent while `in_flight` others were in
    /// work.
    pub fn no_slot(&mut self, in_flight: u32, now: Timestamp) {
        self.progress = self.progress.max(now);
        self.no_slots.push_back(now);
        let from = now.minus(MINUTE);
        while self.no_slots.front().is_some_and(|t| *t < from) {
            self.no_slots.pop_front();
        }
        // Answers to sends made together count once; each refused after the hold of the one
        // before doubles the hold (to `hold_max`): a plan that takes nothing — another client on
        // the account, no balance — is asked rarely, until a task is taken; a slow solve that
        // looks done (see `CaptchaKind::busy_for`) costs at most `hold_max` of its thread.
        // Answers to sends made together (within the hold of the first): the plan was full at
        // the lowest of their levels.
        let together = now < self.hold_until;
        if !together {
            self.refused_in_a_row = self.refused_in_a_row.saturating_add(1);
        }
        let hold =
            (self.s.hold * 2u32.saturating_pow(self.refused_in_a_row.saturating_sub(1).min(6))).min(self.s.hold_max);
        self.hold_until = self.hold_until.max(now.plus(hold));
        let known = self.known_full(now);
        let level = match (together, known) {
            (true, Some(full)) => in_flight.max(1).min(full),
            _ => in_flight.max(1),
        };
        match known {
            // A probe at or above the known level was refused: probe less often.
            Some(full) if level >= full && !together => {
                self.probe_wait = (self.probe_wait * 2).min(self.s.probe_wait_max);
            }
            _ => {}
        }
        self.full_at = Some(level);
        self.full_seen = now;
        self.probe_after = now.plus(self.probe_wait);
        let size = (f64::from(level) - 1.0).max((f64::from(level) * 0.9).floor()).max(1.0).min(self.cap());
        self.size = if together { self.size.min(size) } else { size };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_read_from_threadsinfo_is_where_the_window_stands_and_its_ceiling() {
        let mut w = Window::new(WindowSettings::default());
        assert!(w.plan_due(t(0.0)));
        w.set_plan(25, t(0.0));
        assert_eq!(w.limit(t(0.0)), 25, "used fully from the first second");
        for i in 0..40 {
            w.accepted(24 + i, t(1.0));
        }
        assert_eq!(w.limit(t(1.0)), 25, "never above the plan");
        assert!(!w.plan_due(t(299.0)) && w.plan_due(t(300.0)), "read again every 5 minutes");
        let again = Window::restore(WindowSettings::default(), Some(&w.state()));
        assert_eq!((again.plan(), again.limit(t(2.0))), (Some(25), 25), "kept between runs");
        // A configured thread count wins over what the plan says.
        let mut c = Window::new(WindowSettings { threads: Some(10), ..WindowSettings::default() });
        c.set_plan(25, t(0.0));
        assert_eq!(c.limit(t(0.0)), 10);
    }

    fn t(secs: f64) -> Timestamp {
        Timestamp::from_millis((secs * 1000.0) as u64)
    }

    /// A plan of `threads` solving each task in `solve` seconds, driven by the window with tasks
    /// always waiting: (tasks taken, "no slot" answers, most in work at once) over `secs`.
    fn simulate(w: &mut Window, threads: u32, solve: f64, secs: f64) -> (u32, u32, u32) {
        simulate_from(w, threads, solve, 0.0, secs)
    }

    #[test]
    fn an_unknown_plan_is_found_by_slow_start_and_used_at_its_size() {
        let mut w = Window::new(WindowSettings::default());
        let (taken, refused, peak) = simulate(&mut w, 20, 3.0, 600.0);
        // The plan allows 20 / 3 s = 6.67 a second: 4,000 in 600 s.
        let share = f64::from(taken) / 4_000.0;
        assert!(share > 0.93, "{taken} taken: {share:.3} of what the plan allows");
        assert_eq!(peak, 20, "never more than the plan");
        assert!(refused <= 30, "{refused} 'no slot' answers in 10 minutes");
        assert!(w.no_slots_last_minute(t(600.0)) <= 2, "a stable plan is probed rarely");
    }

    /// Asks a plan that takes nothing as eagerly as the window allows for 10 minutes: the times
    /// of the "no slot" answers (ms).
    fn refused_for_ten_minutes(w: &mut Window) -> Vec<u64> {
        let mut times = Vec::new();
        for i in 0..60_000u64 {
            let at = Timestamp::from_millis(i * 10);
            if let Gate::Open(_) = w.gate(0, at) {
                w.no_slot(0, at);
                times.push(i * 10);
            }
        }
        times
    }

    fn most_in_a_minute(times: &[u64]) -> usize {
        times.iter().map(|t| times.iter().filter(|u| **u >= *t && **u < t + 60_000).count()).max().unwrap_or(0)
    }

    #[test]
    fn no_slot_answers_stay_within_the_budget_whatever_happens() {
        // A plan that takes nothing (another client uses every thread, or the balance is gone):
        // each answer doubles the hold, to 8 s.
        let times = refused_for_ten_minutes(&mut Window::new(WindowSettings::default()));
        assert!(times.windows(2).skip(4).all(|p| p[1] - p[0] >= 8_000), "then every 8 s: {times:?}");
        assert!(most_in_a_minute(&times) <= 12, "{times:?}");
        // Without the hold, the budget alone bounds them, in any 60 s, both ends included.
        let bare =
            refused_for_ten_minutes(&mut Window::new(WindowSettings { hold: Duration::ZERO, ..Default::default() }));
        assert_eq!(most_in_a_minute(&bare), 20, "{} answers in 10 minutes", bare.len());
        assert!(bare.len() <= 10 * 20 + 1, "{}", bare.len());
    }

    #[test]
    fn a_configured_plan_is_used_from_the_start_and_never_passed() {
        let mut w = Window::new(WindowSettings { threads: Some(5), ..WindowSettings::default() });
        assert_eq!(w.gate(0, t(0.0)), Gate::Open(5));
        let (taken, refused, peak) = simulate(&mut w, 5, 3.0, 60.0);
        assert_eq!((refused, peak), (0, 5), "no probing above a configured plan");
        assert!(taken >= 95, "{taken}");
    }

    #[test]
    fn a_plan_that_grows_is_found_after_a_probe_and_one_that_shrinks_at_once() {
        let mut w = Window::new(WindowSettings::default());
        simulate(&mut w, 10, 3.0, 120.0);
        assert_eq!(w.limit(t(120.0)).min(10), 10);
        let (taken, _, peak) = simulate_from(&mut w, 30, 3.0, 120.0, 600.0);
        assert_eq!(peak, 30, "found the bigger plan");
        assert!(taken as f64 > 0.9 * 480.0 * 10.0, "{taken}");
        let (_, refused, peak) = simulate_from(&mut w, 5, 3.0, 600.0, 700.0);
        assert_eq!(peak, 30.min(peak));
        assert!(refused <= 20, "{refused}");
        assert!(w.limit(t(700.0)) <= 6, "shrunk to the smaller plan: {}", w.limit(t(700.0)));
    }

    fn simulate_from(w: &mut Window, threads: u32, solve: f64, from: f64, to: f64) -> (u32, u32, u32) {
        let mut in_work: Vec<f64> = Vec::new();
        let (mut taken, mut refused, mut peak) = (0, 0, 0);
        let mut now = from;
        while now < to {
            in_work.retain(|done| *done > now);
            let at = t(now);
            let ours = in_work.len() as u32;
            if let Gate::Open(_) = w.gate(ours, at) {
                if ours < threads {
                    w.accepted(ours, at);
                    in_work.push(now + solve);
                    taken += 1;
                    peak = peak.max(ours + 1);
                } else {
                    w.no_slot(ours, at);
                    refused += 1;
                }
                continue;
            }
            now += 0.05;
        }
        (taken, refused, peak)
    }

    #[test]
    fn tasks_counted_in_work_after_they_finished_do_not_stall_the_queue() {
        // 30 % of pingbacks lost: those tasks stay counted for 20 s (until the poller reads
        // them) although their thread is free after 3 s.
        let mut w = Window::new(WindowSettings::default());
        let (threads, solve, lost_for) = (10usize, 3.0, 20.0);
        // (thread free at, counted until)
        let mut tasks: Vec<(f64, f64)> = Vec::new();
        let (mut taken, mut refused) = (0u32, 0u32);
        let mut now = 0.0;
        let mut n = 0u64;
        while now < 600.0 {
            let before = tasks.iter().filter(|(_, counted)| *counted > now).count();
            tasks.retain(|(_, counted)| *counted > now);
            if tasks.len() < before {
                w.finished(t(now));
            }
            let counted = tasks.len() as u32;
            let busy = tasks.iter().filter(|(free, _)| *free > now).count();
            if let Gate::Open(_) = w.gate(counted, t(now)) {
                if busy < threads {
                    n += 1;
                    let lost = n % 10 < 3;
                    w.accepted(counted, t(now));
                    tasks.push((now + solve, now + if lost { lost_for } else { solve }));
                    taken += 1;
                } else {
                    w.no_slot(counted, t(now));
                    refused += 1;
                }
                continue;
            }
            now += 0.05;
        }
        let share = f64::from(taken) / (600.0 * threads as f64 / solve);
        println!(
            "30 % of pingbacks lost: {taken} taken ({share:.3} of the plan), {refused} 'no slot' answers in 10 min"
        );
        // The lost ones look busy for 17 s more than they are: the window follows the count up
        // (stalls, probes), at a cost of a few "no slot" answers a minute.
        assert!(share > 0.8, "{taken} taken: {share:.3} of the plan");
        assert!(f64::from(refused) <= 10.0 * 20.0, "{refused} 'no slot' answers in 10 minutes");
    }

    #[test]
    fn a_full_window_that_does_not_move_lets_a_probe_through() {
        let mut w = Window::new(WindowSettings { initial: 2, ..WindowSettings::default() });
        // Two counted in work that will not finish (their pingbacks lost): full.
        assert_eq!(w.gate(2, t(0.0)), Gate::Full);
        assert_eq!(w.gate(2, t(0.9)), Gate::Full);
        assert_eq!(w.gate(2, t(1.0)), Gate::Open(1), "no progress for 1 s, the plan unknown");
        w.accepted(2, t(1.1));
        assert!(w.limit(t(1.1)) >= 5, "taken above the window: slow start goes on from there");
        // Refused: the plan was full after all; probes then wait for the probe time.
        let mut w = Window::new(WindowSettings::default());
        w.no_slot(2, t(5.0));
        assert_eq!(w.gate(1, t(7.9)), Gate::Full, "the plan known full at 2: 3 s, and a probe due");
        assert_eq!(w.gate(2, t(11.0)), Gate::Full, "below the full level the window is 1");
        assert_eq!(w.gate(1, t(11.0)), Gate::Full);
        assert!(matches!(w.gate(0, t(11.0)), Gate::Open(1)));
        assert_eq!(w.gate(1, t(14.9)), Gate::Full, "probe not due before 10 s after the answer");
        assert_eq!(w.gate(1, t(15.0)), Gate::Open(1));
    }

    #[test]
    fn answers_to_sends_made_together_teach_the_lowest_level() {
        // Eight sent at once (in work 0..7 when each went), a plan of one: every one but the
        // first refused, answered in any order.
        let mut w = Window::new(WindowSettings::default());
        for level in [7, 3, 1, 5, 2, 6, 4] {
            w.no_slot(level, t(1.0));
        }
        assert_eq!(w.limit(t(2.0)), 1, "full at 1, not at the last answer's 7");
        assert_eq!(w.gate(1, t(2.0)), Gate::Full);
        assert_eq!(w.no_slots_last_minute(t(2.0)), 7);
    }

    #[test]
    fn a_no_slot_answer_holds_everything_for_a_second() {
        let mut w = Window::new(WindowSettings { threads: Some(8), ..WindowSettings::default() });
        w.no_slot(3, t(10.0));
        assert_eq!(w.gate(0, t(10.5)), Gate::Hold(t(11.0)));
        assert_eq!(w.gate(0, t(11.0)), Gate::Open(2), "90 % of the level it was full at, floored");
    }

    #[test]
    fn the_state_survives_a_restart() {
        let mut w = Window::new(WindowSettings::default());
        simulate(&mut w, 7, 2.0, 60.0);
        let saved = serde_json::to_string(&w.state()).expect("json");
        let back: WindowState = serde_json::from_str(&saved).expect("json");
        let restored = Window::restore(WindowSettings::default(), Some(&back));
        assert_eq!(restored, w);
        // A configured plan caps a restored window.
        let capped = Window::restore(WindowSettings { threads: Some(3), ..WindowSettings::default() }, Some(&back));
        assert!(capped.limit(t(60.0)) <= 3);
        // Unreadable state: a new window.
        let bad = WindowState { size: f64::NAN, ..WindowState::default() };
        assert_eq!(Window::restore(WindowSettings::default(), Some(&bad)), Window::new(WindowSettings::default()));
    }
}
