//! The task's life: transitions, the first-received-wins rule, expiry and late results, and
//! what the owner is shown.

use super::*;
use crate::codes::ErrorCode;
use crate::time::Timestamp;

fn t(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn id(s: &str) -> CaptchaId {
    CaptchaId::parse(s).expect("valid id")
}

fn solved(s: &str, via: Via, at: u64) -> IncomingResult {
    IncomingResult {
        captcha_id: id("42"),
        outcome: Outcome::Solved(Solution::parse(s).expect("valid")),
        received_at: t(at),
        via,
        token_clock_start: t(at),
    }
}

fn pending_task(kind: CaptchaKind) -> Task {
    Task::new(TaskRef::generate(), kind, t(0)).submitted(id("42"), t(100)).expect("submitting -> pending")
}

#[test]
fn submit_moves_submitting_to_pending_once() {
    let task = pending_task(CaptchaKind::Turnstile);
    assert_eq!(task.state, TaskState::Pending { submitted_at: t(100) });
    assert_eq!(task.captcha_id, Some(id("42")));
    assert!(matches!(task.submitted(id("43"), t(200)), Err(TransitionError::NotAllowed { from: "pending", .. })));
}

#[test]
fn start_time_is_the_submit_once_known() {
    let fresh = Task::new(TaskRef::generate(), CaptchaKind::Image, t(7));
    assert_eq!(fresh.submitted_or_created_at(), t(7));
    assert_eq!(pending_task(CaptchaKind::Image).submitted_or_created_at(), t(100));
}

#[test]
fn submit_failure_is_only_possible_while_submitting() {
    let failed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
        .submit_failed(ErrorCode::parse("ERROR_ZERO_CAPTCHA_FILESIZE").expect("code"), None, t(5))
        .expect("submitting -> failed");
    assert!(matches!(failed.state, TaskState::Failed { via: Via::Submit, .. }));
    assert!(
        pending_task(CaptchaKind::Image).submit_failed(ErrorCode::parse("ERROR_X").expect("code"), None, t(5)).is_err()
    );
}

#[test]
fn first_result_is_recorded_then_duplicates_and_conflicts_change_nothing() {
    let Applied::Recorded(task) =
        pending_task(CaptchaKind::Turnstile).apply(solved("tok", Via::Callback, 500)).expect("ok")
    else {
        panic!("first result must be recorded");
    };
    assert!(matches!(task.state, TaskState::Solved { via: Via::Callback, .. }));
    assert_eq!(task.clone().apply(solved("tok", Via::Poll, 900)), Ok(Applied::Duplicate));
    assert_eq!(task.apply(solved("other", Via::Callback, 900)), Ok(Applied::Conflict));
}

#[test]
fn the_first_received_result_wins_until_the_owner_was_shown_one() {
    // B (received at 900) was stored first; A, received at 500, reaches the store later
    // (through the dead-letter queue): A replaces B.
    let Ok(Applied::Recorded(b)) = pending_task(CaptchaKind::Turnstile).apply(solved("b", Via::Callback, 900)) else {
        panic!("recorded")
    };
    let Ok(Applied::Replaced(a)) = b.clone().apply(solved("a", Via::Redrive, 500)) else { panic!("replaced") };
    assert!(matches!(&a.state, TaskState::Solved { solution, resolved_at, via: Via::Redrive, .. }
        if solution.expose() == "a" && *resolved_at == t(500)));
    // B again, or anything received later than A, changes nothing now.
    assert_eq!(a.clone().apply(solved("b", Via::Redrive, 900)), Ok(Applied::Conflict));
    assert_eq!(a.clone().apply(solved("a", Via::Poll, 700)), Ok(Applied::Duplicate));
    // An earlier receipt of the held result moves the receipt time back.
    let Ok(Applied::Earlier(a2)) = a.clone().apply(solved("a", Via::Callback, 300)) else { panic!("earlier") };
    assert!(matches!(&a2.state, TaskState::Solved { resolved_at, .. } if *resolved_at == t(300)));
    // Ties keep what is stored; a verdict received earlier replaces a solution too.
    assert_eq!(a2.clone().apply(solved("c", Via::Poll, 300)), Ok(Applied::Conflict));
    let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
    let verdict = IncomingResult { outcome: Outcome::Failed(code), ..solved("x", Via::Redrive, 200) };
    assert!(matches!(
        a2.clone().apply(verdict.clone()),
        Ok(Applied::Replaced(Task { state: TaskState::Failed { .. }, .. }))
    ));
    // Once shown, nothing replaces it.
    assert!(a2.needs_pin(t(301)));
    let shown = Task { handed_out_at: Some(t(301)), ..a2 };
    assert!(!shown.needs_pin(t(302)));
    assert_eq!(shown.clone().apply(verdict), Ok(Applied::Conflict));
    assert_eq!(shown.clone().apply(solved("a", Via::Callback, 100)), Ok(Applied::Duplicate));
    // A stale solution is not handed out, so not pinned; a submit failure never is.
    assert!(!Task { handed_out_at: None, ..shown }.needs_pin(t(1_000_000)));
    let refused = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
        .submit_failed(ErrorCode::parse("ERROR_ZERO_CAPTCHA_FILESIZE").expect("code"), None, t(5))
        .expect("failed");
    assert!(!refused.needs_pin(t(6)));
}

#[test]
fn error_code_result_fails_the_task_and_repeats_are_duplicates() {
    let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
    let d = IncomingResult { outcome: Outcome::Failed(code.clone()), ..solved("x", Via::Callback, 10) };
    let Ok(Applied::Recorded(task)) = pending_task(CaptchaKind::Hcaptcha).apply(d.clone()) else { panic!("recorded") };
    assert!(matches!(&task.state, TaskState::Failed { code: c, .. } if *c == code));
    assert_eq!(task.clone().apply(d), Ok(Applied::Duplicate));
    assert_eq!(task.apply(solved("tok", Via::Poll, 20)), Ok(Applied::Conflict));
}

#[test]
fn result_with_another_captcha_id_is_refused() {
    let d = IncomingResult { captcha_id: id("99"), ..solved("tok", Via::Callback, 10) };
    assert!(matches!(pending_task(CaptchaKind::Image).apply(d), Err(TransitionError::IdMismatch { .. })));
}

#[test]
fn callback_that_outruns_the_submit_is_recorded_with_its_id() {
    let task = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0));
    let Ok(Applied::Recorded(task)) = task.apply(solved("abc", Via::Callback, 10)) else { panic!("recorded") };
    assert_eq!(task.captcha_id, Some(id("42")));
    // The submit that finishes later cannot move it back to pending.
    assert!(task.submitted(id("42"), t(20)).is_err());
}

#[test]
fn expiry_applies_to_open_tasks_only() {
    let expired = pending_task(CaptchaKind::Image).expire("no answer in 10 min".into(), t(600_000)).expect("expire");
    assert_eq!(expired.state.name(), "expired");
    assert!(expired.expire("again".into(), t(1)).is_err());
}

#[test]
fn a_result_received_before_the_expiry_but_applied_after_it_is_the_result() {
    let expired = pending_task(CaptchaKind::Image).expire("deadline".into(), t(600_000)).expect("expire");
    let Ok(Applied::Recorded(task)) = expired.apply(solved("w68hp", Via::Redrive, 599_000)) else {
        panic!("a result received before the expiry is recorded")
    };
    assert!(matches!(task.state, TaskState::Solved { via: Via::Redrive, .. }));
}

#[test]
fn a_result_after_the_expiry_is_kept_as_a_late_result_and_shown_while_fresh() {
    let expired = pending_task(CaptchaKind::Turnstile).expire("deadline".into(), t(600_000)).expect("expire");
    let Ok(Applied::Late(task)) = expired.apply(solved("tok", Via::Callback, 700_000)) else {
        panic!("kept as a late result")
    };
    assert_eq!(task.state.name(), "expired", "the task stays expired");
    assert_eq!(task.clone().apply(solved("tok", Via::Poll, 710_000)), Ok(Applied::Duplicate));
    assert_eq!(task.clone().apply(solved("other", Via::Poll, 710_000)), Ok(Applied::Conflict));
    let v = task.view(t(760_000));
    let late = v.late_result.expect("late result shown");
    assert_eq!((late.status, late.solution.as_deref(), late.age_secs), ("solved", Some("tok"), 60));
    let stale = task.view(t(1_000_000)).late_result.expect("still shown");
    assert_eq!((stale.status, stale.solution), ("stale", None), "a stale late token is not handed out");
}

#[test]
fn a_result_for_a_task_whose_submit_failed_proves_it_was_accepted() {
    let failed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
        .submit_failed(ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").expect("code"), None, t(5))
        .expect("failed");
    let Ok(Applied::Recorded(task)) = failed.apply(solved("w68hp", Via::Callback, 30_000)) else { panic!("recorded") };
    assert!(matches!(task.state, TaskState::Solved { .. }));
    // A task that failed with CaptchaAI's own verdict keeps it.
    let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
    let d = IncomingResult { outcome: Outcome::Failed(code), ..solved("x", Via::Callback, 10) };
    let Ok(Applied::Recorded(unsolvable)) = pending_task(CaptchaKind::Image).apply(d) else { panic!() };
    assert_eq!(unsolvable.apply(solved("w68hp", Via::Poll, 20)), Ok(Applied::Conflict));
}

#[test]
fn stale_solution_is_reported_expired_and_not_handed_out() {
    let Ok(Applied::Recorded(task)) = pending_task(CaptchaKind::RecaptchaV2).apply(solved("tok", Via::Callback, 1_000))
    else {
        panic!("recorded")
    };
    let fresh = task.view(t(1_000 + 119_999));
    assert_eq!(fresh.status, "solved");
    assert_eq!(fresh.solution.as_deref(), Some("tok"));
    assert_eq!(fresh.expires_at.as_deref(), Some(t(121_000).to_rfc3339().as_str()));
    let stale = task.view(t(121_000));
    assert_eq!(stale.status, "expired");
    assert_eq!(stale.solution, None);
    assert_eq!(stale.error_code.as_deref(), Some("TOKEN_LIFETIME_ELAPSED"));
}

#[test]
fn image_answers_never_go_stale() {
    let Ok(Applied::Recorded(task)) = pending_task(CaptchaKind::Image).apply(solved("w68hp", Via::Poll, 1_000)) else {
        panic!("recorded")
    };
    let v = task.view(t(10_000_000_000));
    assert_eq!((v.status, v.solution.as_deref(), v.expires_at), ("solved", Some("w68hp"), None));
}
