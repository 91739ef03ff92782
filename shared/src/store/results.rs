//! Recording a result: one conditional write, duplicates and conflicts told apart from the
//! old item DynamoDB hands back; late results kept; a shown result pinned.

use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};

use super::{
    DELIVERY_CLEAR, DELIVERY_DUE, Results, StoreError, attr, decode, delivery_due, n, refused_item, s, sdk_error,
};
use crate::domain::{Applied, CaptchaId, IncomingResult, Outcome, Task, TaskRef, TaskState, TransitionError, Via};
use crate::time::Timestamp;

/// What happened to a delivered result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// This delivery is the task's result; the task as now stored.
    Recorded(Task),
    /// The task already had exactly this result. Nothing was written, unless this delivery
    /// received it earlier than the recorded one: then the receipt time moved back (the task as
    /// now stored).
    Duplicate(Task),
    /// The task already had a different result, which stays (received no later than this one, or
    /// already shown to the owner). Nothing was written.
    Conflict(Task),
    /// The task had a different result, received after this one and not yet shown to the owner:
    /// this delivery replaced it (first received wins). The task as now stored.
    Replaced(Task),
    /// The result names another CaptchaAI id than the task's. Nothing was written.
    IdMismatch { expected: CaptchaId },
    /// No task under that reference. Nothing was written.
    NotFound,
    /// The task had been expired before this result arrived; the result is kept on it as its
    /// late result (shown, never dropped; the task stays expired).
    Late(Task),
}

impl Results {
    /// Records a delivered result with ONE conditional write. Applied exactly once however
    /// many times, and by however many paths, it is delivered. A task takes a result while it is
    /// open, when its submit was reported failed (the result proves in.php accepted it), and when
    /// it was expired after the result was received. The first *received* result wins, not the
    /// first stored: until the owner has been shown a result, one received earlier replaces it
    /// (a pingback that failed to store and came back through the dead-letter queue after a
    /// conflicting one), and an earlier receipt of the same result moves its receipt time back.
    /// A result that arrives after the expiry is kept on the task as its late result (a second
    /// conditional write, only in that case). The rare transitions (a replacement, an earlier
    /// receipt, a result after a failed submit or for an expired task) also take a second write:
    /// the first, with a short condition, is for an open task, which nearly every result finds.
    pub async fn record_result(&self, task_ref: &TaskRef, d: &IncomingResult) -> Result<RecordOutcome, StoreError> {
        // The common case first: the task is open. Its condition is short, so the engine has
        // little to parse and evaluate. A refusal returns the item, and every other transition
        // the state machine allows (a replacement, an earlier receipt, a result after a failed
        // submit or for an expired task received before the expiry) is written again under the
        // full condition. Both are single conditional writes: exactly-once holds for each.
        let open = self
            .result_write(task_ref, d)
            .condition_expression(
                "#state IN (:submitting, :pending, :queued) AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at))",
            )
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":queued", s("queued"));
        match open.send().await {
            Ok(out) => self.written(task_ref, out, d),
            Err(e) => match refused_item(&e) {
                Some(None) => Ok(RecordOutcome::NotFound),
                Some(Some(old)) => {
                    let old = Task::try_from(old)?;
                    match old.clone().apply(d.clone()) {
                        Ok(Applied::Recorded(_) | Applied::Replaced(_) | Applied::Earlier(_)) => {
                            self.record_result_full(task_ref, d).await
                        }
                        _ => self.classify_refused(task_ref, old, d).await,
                    }
                }
                None => Err(sdk_error(e)),
            },
        }
    }

    /// The result write under the full condition: every transition the state machine allows.
    async fn record_result_full(&self, task_ref: &TaskRef, d: &IncomingResult) -> Result<RecordOutcome, StoreError> {
        let req = self
            .result_write(task_ref, d)
            .condition_expression(
                "attribute_exists(pk) AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at)) AND ( \
                 #state IN (:submitting, :pending, :queued) \
                 OR (#state = :failed AND resolved_via = :submit) \
                 OR (#state = :expired AND resolved_at >= :at) \
                 OR (#state IN (:solved, :failed) AND resolved_at > :at AND attribute_not_exists(handed_out_at)))",
            )
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":solved", s("solved"))
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":submit", s(Via::Submit.as_str()));
        match req.send().await {
            Ok(out) => self.written(task_ref, out, d),
            Err(e) => match refused_item(&e) {
                Some(None) => Ok(RecordOutcome::NotFound),
                Some(Some(old)) => self.classify_refused(task_ref, Task::try_from(old)?, d).await,
                None => Err(sdk_error(e)),
            },
        }
    }

    /// What a result write that went through amounted to, from the item it replaced.
    fn written(
        &self,
        task_ref: &TaskRef,
        out: aws_sdk_dynamodb::operation::update_item::UpdateItemOutput,
        d: &IncomingResult,
    ) -> Result<RecordOutcome, StoreError> {
        let applied = decode(out.attributes.as_ref())?.apply(d.clone());
        if let Ok(Applied::Recorded(task) | Applied::Replaced(task) | Applied::Earlier(task)) = &applied {
            self.push_due(task, d.received_at);
        }
        if let (Some(n), Ok(Applied::Recorded(_))) = (&self.results, &applied) {
            n.notify_one();
        }
        match applied {
            Ok(Applied::Recorded(task)) => Ok(RecordOutcome::Recorded(task)),
            Ok(Applied::Replaced(task)) => Ok(RecordOutcome::Replaced(task)),
            Ok(Applied::Earlier(task)) => Ok(RecordOutcome::Duplicate(task)),
            other => {
                Err(StoreError::Corrupt(format!("task {task_ref} took a result the state machine refuses ({other:?})")))
            }
        }
    }

    /// A result write without its condition: the update, its values (`:id` and `:at` included,
    /// which both conditions use), and the old item returned either way.
    fn result_write(&self, task_ref: &TaskRef, d: &IncomingResult) -> UpdateItemFluentBuilder {
        let mut req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":id", s(d.captcha_id.as_ref()))
            .expression_attribute_values(":at", n(d.received_at.as_millis()))
            .expression_attribute_values(":via", s(d.via.as_str()))
            .expression_attribute_values(":ttl", self.ttl(d.received_at))
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        req = delivery_due(req, d.received_at);
        const COMMON: &str = "captcha_id = :id, resolved_at = :at, resolved_via = :via, expires_ttl = :ttl";
        const CLEAR: &str = "REMOVE poll_due_at, poll_shard, lease_owner, error_detail, submit_unknown, sq_key, sq_at, \
                             sq_req, sq_pingback";
        match &d.outcome {
            Outcome::Solved(solution) => {
                // The user agent the answer names; without one, the one the task was submitted
                // with (kept on the item since) is the one the token was earned with.
                let ua_set = match solution.user_agent() {
                    Some(ua) => {
                        req = req.expression_attribute_values(":ua", s(ua));
                        ", user_agent = :ua"
                    }
                    None => "",
                };
                req.update_expression(format!(
                    "SET #state = :solvedstate, solution = :solution, token_clock_start = :clock{ua_set}, {COMMON}, \
                     {DELIVERY_DUE} {CLEAR}, {DELIVERY_CLEAR}, error_code"
                ))
                .expression_attribute_values(":solvedstate", s("solved"))
                .expression_attribute_values(":solution", s(solution.expose()))
                .expression_attribute_values(":clock", n(d.token_clock_start.as_millis()))
            }
            Outcome::Failed(code) => req
                // A verdict received earlier can replace a solution: no token stays on a failed task.
                .update_expression(format!(
                    "SET #state = :failedstate, error_code = :code, {COMMON}, {DELIVERY_DUE} \
                     {CLEAR}, {DELIVERY_CLEAR}, solution, token_clock_start"
                ))
                .expression_attribute_values(":failedstate", s("failed"))
                .expression_attribute_values(":code", s(code.as_ref())),
        }
    }

    /// Says why a result write was refused, from the old item; keeps a late result.
    async fn classify_refused(
        &self,
        task_ref: &TaskRef,
        old: Task,
        d: &IncomingResult,
    ) -> Result<RecordOutcome, StoreError> {
        match old.clone().apply(d.clone()) {
            Ok(Applied::Duplicate) => Ok(RecordOutcome::Duplicate(old)),
            Ok(Applied::Conflict) => Ok(RecordOutcome::Conflict(old)),
            Ok(Applied::Late(task)) => self.keep_late(task_ref, task, d).await,
            Err(TransitionError::IdMismatch { expected, .. }) => Ok(RecordOutcome::IdMismatch { expected }),
            // The condition and the state machine disagree: the item is not what this code
            // writes. Say so rather than guess.
            Ok(Applied::Recorded(_) | Applied::Replaced(_) | Applied::Earlier(_))
            | Err(TransitionError::NotAllowed { .. }) => Err(StoreError::Corrupt(format!(
                "task {task_ref} refused a result the state machine allows (state {})",
                old.state.name()
            ))),
        }
    }

    /// Keeps a result that came after the task was expired, once.
    async fn keep_late(&self, task_ref: &TaskRef, task: Task, d: &IncomingResult) -> Result<RecordOutcome, StoreError> {
        let code = match &d.outcome {
            Outcome::Solved(sol) => sol.expose().to_owned(),
            Outcome::Failed(c) => c.as_ref().to_owned(),
        };
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!(
                "SET late_code = :code, late_at = :at, late_via = :via, late_clock = :clock, \
                 captcha_id = :id, {DELIVERY_DUE} REMOVE {DELIVERY_CLEAR}"
            ))
            // The id, as the state machine keeps it: a task that expired before in.php's answer
            // came learns its id from the result (one it had is the same: a mismatch is refused
            // before this).
            .condition_expression(
                "#state = :expired AND attribute_not_exists(late_code) AND resolved_at < :at \
                 AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at))",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":code", s(&code))
            .expression_attribute_values(":at", n(d.received_at.as_millis()))
            .expression_attribute_values(":via", s(d.via.as_str()))
            .expression_attribute_values(":clock", n(d.token_clock_start.as_millis()))
            .expression_attribute_values(":id", s(d.captcha_id.as_ref()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        let res = delivery_due(res, d.received_at).send().await;
        match res {
            Ok(_) => {
                self.push_due(&task, d.received_at);
                Ok(RecordOutcome::Late(task))
            }
            // Another late result won the race: classify against it.
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => {
                    let old = Task::try_from(old)?;
                    match old.clone().apply(d.clone()) {
                        Ok(Applied::Duplicate) => Ok(RecordOutcome::Duplicate(old)),
                        _ => Ok(RecordOutcome::Conflict(old)),
                    }
                }
                Some(None) => Ok(RecordOutcome::NotFound),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Pins the result `shown` is about to show its owner: from then on it never changes. One
    /// conditional write, made once per task (by the first read that shows a result). `Ok(None)`:
    /// pinned as shown. `Ok(Some(task))`: the item changed since it was read (a replacement, an
    /// earlier receipt, or another read pinned it first); show that instead, pinning it if it
    /// still [`Task::needs_pin`].
    pub async fn mark_handed_out(&self, shown: &Task, now: Timestamp) -> Result<Option<Task>, StoreError> {
        let resolved_at = match &shown.state {
            TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } => *resolved_at,
            other => return Err(StoreError::Rejected(format!("a {} task has no result to pin", other.name()))),
        };
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(shown.task_ref.as_ref()))
            .update_expression("SET handed_out_at = :now")
            .condition_expression("#state = :state AND resolved_at = :at AND attribute_not_exists(handed_out_at)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":state", s(shown.state.name()))
            .expression_attribute_values(":at", n(resolved_at.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(_) => Ok(None),
            Err(e) => match refused_item(&e) {
                Some(Some(current)) => Ok(Some(Task::try_from(current)?)),
                Some(None) => Err(StoreError::Rejected(format!("task {} does not exist", shown.task_ref))),
                None => Err(sdk_error(e)),
            },
        }
    }
}
