//! Tasks in.php has not (knowingly) taken: the request kept to send again once, refusals
//! "for now" counted, a refused inline submit queued, a task that waited too long failed.

use aws_sdk_dynamodb::types::ReturnValue;

use super::*;

impl SubmitQueue {
    /// What in.php needs to send a task that is still submitting without a CaptchaAI id: its
    /// request and pingback, kept since it was created or queued. `None`: not such a task, or
    /// one created before they were kept.
    pub async fn unsent_request(&self, task_ref: &TaskRef) -> Result<Option<(SubmitRequest, String)>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .projection_expression("sq_req, sq_pingback, captcha_id")
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        let Some(item) = out.item else { return Ok(None) };
        if item.contains_key("captcha_id") {
            return Ok(None);
        }
        let (Some(req), Some(pingback)) = (super::get_s(&item, "sq_req")?, super::get_s(&item, "sq_pingback")?) else {
            return Ok(None);
        };
        let request =
            serde_json::from_str(req).map_err(|e| StoreError::Corrupt(format!("task {task_ref}: sq_req: {e}")))?;
        Ok(Some((request, pingback.to_owned())))
    }

    /// Marks a task about to be sent to in.php a second time: still submitting, no CaptchaAI id
    /// known, never resent before. The mark comes first, so a task is resent at most once
    /// whatever crashes; `false`: not such a task (its result came, or another poller resent it).
    pub async fn mark_resent(&self, task_ref: &TaskRef, now: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("SET resent_at = :now REMOVE submit_unknown")
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(resent_at)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":now", n(now.as_millis()))
            .send()
            .await;
        condition_held(res)
    }

    /// Takes the mark back: in.php refused the resend explicitly (nothing was taken), so it may
    /// be sent again later. `false`: the task is no longer such a task.
    pub async fn clear_resent(&self, task_ref: &TaskRef) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("REMOVE resent_at")
            .condition_expression("#state = :submitting AND attribute_not_exists(captcha_id)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        condition_held(res)
    }

    /// Counts one more "refused for now" answer (a server error code, a connection that never
    /// opened) for a released task still submitting; returns how many it has had. A method
    /// CaptchaAI answers `ERROR_SERVER_ERROR` again and again (one it does not solve) is failed
    /// by the caller after [`crate::submit::MAX_REFUSALS_FOR_NOW`] of them, not retried for ever.
    /// `None`: the task is no longer submitting.
    pub async fn count_refusal_for_now(&self, task_ref: &TaskRef) -> Result<Option<u32>, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("ADD sq_refused :one")
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":one", n(1))
            .return_values(ReturnValue::UpdatedNew)
            .send()
            .await;
        match res {
            Ok(out) => Ok(Some(
                out.attributes
                    .as_ref()
                    .and_then(|a| a.get("sq_refused"))
                    .and_then(|v| v.as_n().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
            )),
            Err(e) if refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// Turns an inline submit that was refused for now into a queued task (its reservation
    /// made): submitting → queued, with what in.php needs. Same conditions as
    /// [`TaskStore::requeue`].
    pub async fn queue_unsent(
        &self,
        task: &Task,
        lane: &str,
        queued_at: Timestamp,
        request: &SubmitRequest,
        pingback: &str,
        deadline_after: Duration,
    ) -> Result<bool, StoreError> {
        let task_ref = &task.task_ref;
        let json = serde_json::to_string(request).map_err(|e| StoreError::Rejected(e.to_string()))?;
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :queued, queued_at = :at, q_lane = :lane, sq_key = :q, sq_at = :at, sq_req = :req, \
                 sq_pingback = :pb, sq_busy = :busy, sq_deadline = :deadline REMOVE poll_shard, poll_due_at",
            )
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":at", n(queued_at.as_millis()))
            .expression_attribute_values(":lane", s(lane))
            .expression_attribute_values(":q", s(&queued_key(lane, self.queue_shard(task_ref))))
            .expression_attribute_values(":req", s(&json))
            .expression_attribute_values(":pb", s(pingback))
            .expression_attribute_values(":busy", n(ms(task.kind.busy_for())))
            .expression_attribute_values(":deadline", n(ms(deadline_after)))
            .send()
            .await;
        condition_held(res)
    }

    /// Fails a task that was never sent — it waited in the queue too long (`from_queue`), or
    /// in.php refused it for good when the queue released it — with `code`; its push (if any)
    /// becomes due: its owner heard nothing else. The task as stored, or `None` if it is no
    /// longer such a task.
    pub async fn fail_unsent(
        &self,
        task_ref: &TaskRef,
        from_queue: bool,
        code: &str,
        detail: &str,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let condition = if from_queue {
            "#state = :from"
        } else {
            "#state = :from AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)"
        };
        let req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!(
                "SET #state = :failed, error_code = :code, error_detail = :detail, resolved_at = :now, \
                 resolved_via = :via, expires_ttl = :ttl, {} REMOVE {}, {}",
                super::DELIVERY_DUE,
                super::UNSENT_CLEAR,
                super::DELIVERY_CLEAR
            ))
            .condition_expression(condition)
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":from", s(if from_queue { "queued" } else { "submitting" }))
            .expression_attribute_values(":code", s(code))
            .expression_attribute_values(":detail", s(detail))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":via", s(crate::domain::Via::Submit.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .return_values(ReturnValue::AllNew);
        match super::delivery_due(req, now).send().await {
            Ok(out) => {
                let task = decode(out.attributes.as_ref())?;
                self.push_due(&task, now);
                Ok(Some(task))
            }
            Err(e) if refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }
}
