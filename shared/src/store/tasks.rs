//! A task's life before its result: created (sent now or queued), submitted, refused,
//! forgotten when in.php never took it.

use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};

use aws_sdk_dynamodb::error::SdkError;

use super::{
    Item, StoreError, Table, Tasks, attr, condition_held, decode, deliveries, get_s, n, queue, refused_item, s,
    sdk_error,
};
use crate::domain::{CaptchaId, Task, TaskRef, Via};
use crate::time::Timestamp;

/// What [`TaskStore::create`] found. (Returned once per submit: its size does not matter.)
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum Created {
    /// The task is new.
    New,
    /// A task with that reference exists (the same idempotency key was used before); nothing
    /// was written. Its request's fingerprint, if it was created with one.
    Existing { task: Task, fingerprint: Option<String> },
}

/// What marking a task submitted amounted to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitRecorded {
    /// Now pending.
    Pending(Task),
    /// Its result had already arrived (the callback outran in.php's answer); left as it is.
    AlreadyResolved(Task),
}

impl Tasks {
    /// Reads a task (strongly consistent).
    pub async fn get(&self, task_ref: &TaskRef) -> Result<Option<Task>, StoreError> {
        self.get_item(task_ref).await?.as_ref().map(Task::try_from).transpose()
    }

    /// Records a new task (state submitting) before in.php is called. `deadline` is when the
    /// poller should look at it if in.php's answer never gets stored. With an idempotency key's
    /// `fingerprint` (of the request it came with), the reference was derived from the key: if a
    /// task already has it, nothing is written and that task and its fingerprint come back —
    /// one conditional put, no read first.
    /// The task is counted in work (see [`queue`]) from this moment (in.php may take it) for
    /// its kind's [`CaptchaKind::busy_for`], unless its result comes first.
    pub async fn create(
        &self,
        task: &Task,
        deadline: Timestamp,
        fingerprint: Option<&str>,
    ) -> Result<Created, StoreError> {
        self.create_sendable(task, deadline, fingerprint, None).await
    }

    /// [`Self::create`], keeping what in.php needs (the request and its pingback) until in.php's
    /// id is stored: a task whose submit's outcome is lost can then be sent again
    /// ([`Self::mark_resent`]).
    pub async fn create_sendable(
        &self,
        task: &Task,
        deadline: Timestamp,
        fingerprint: Option<&str>,
        sendable: Option<(&crate::captchaai::SubmitRequest, &str)>,
    ) -> Result<Created, StoreError> {
        let mut extra: Item = [
            (attr::SQ_KEY, s(&queue::in_work_key(&task.task_ref, self.shards))),
            (attr::SQ_AT, n(task.created_at.plus(task.kind.busy_for()).as_millis())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some((request, pingback)) = sendable {
            let json = serde_json::to_string(request).map_err(|e| StoreError::Rejected(e.to_string()))?;
            extra.insert("sq_req".to_owned(), s(&json));
            extra.insert("sq_pingback".to_owned(), s(pingback));
            // The user agent the owner asked CaptchaAI to solve with: its solution's, unless the
            // answer names another.
            if let Some(ua) = request.user_agent() {
                extra.insert(attr::USER_AGENT.to_owned(), s(ua));
            }
        }
        self.put_new(task, Some(deadline), fingerprint, extra).await
    }

    /// Deletes a task that in.php never accepted (still submitting, no id, no unknown outcome),
    /// freeing its idempotency key. `false` if it is no longer such a task.
    pub async fn forget_unsent(&self, task_ref: &TaskRef) -> Result<bool, StoreError> {
        let res = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
        match res {
            Ok(_) => Ok(true),
            Err(SdkError::ServiceError(se))
                if matches!(se.err(), DeleteItemError::ConditionalCheckFailedException(_)) =>
            {
                Ok(false)
            }
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// In.php was called but its answer does not say whether it took the task: the task stays
    /// submitting, marked unknown with the reason (never failed; sent again at most once, by the poller, when its result is overdue).
    pub async fn mark_submit_unknown(&self, task_ref: &TaskRef, detail: &str) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("SET submit_unknown = :d")
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":d", s(detail))
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        condition_held(res)
    }

    /// In.php accepted the task: submitting → pending, due for a poll at `poll_due_at`.
    pub async fn mark_submitted(
        &self,
        task_ref: &TaskRef,
        id: &CaptchaId,
        now: Timestamp,
        poll_due_at: Timestamp,
    ) -> Result<SubmitRecorded, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :pending, captcha_id = :id, submitted_at = :now, poll_due_at = :due \
                 REMOVE submit_unknown, sq_req, sq_pingback",
            )
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":id", s(id.as_ref()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":due", n(poll_due_at.as_millis()))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => Ok(SubmitRecorded::Pending(decode(out.attributes.as_ref())?)),
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => Ok(SubmitRecorded::AlreadyResolved(Task::try_from(old)?)),
                Some(None) => Err(StoreError::Rejected(format!("task {task_ref} does not exist"))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// In.php refused the task: submitting → failed. Returns the task as stored; if it had
    /// already left submitting (a callback came first), that state is kept and returned.
    pub async fn mark_submit_failed(
        &self,
        task_ref: &TaskRef,
        code: &str,
        detail: &str,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :failed, error_code = :code, error_detail = :detail, resolved_at = :now, \
                 resolved_via = :via, expires_ttl = :ttl REMOVE poll_due_at, poll_shard, sq_key, sq_at, sq_req, sq_pingback",
            )
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":code", s(code))
            .expression_attribute_values(":detail", s(detail))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":via", s(Via::Submit.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => decode(out.attributes.as_ref()),
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => Task::try_from(old),
                Some(None) => Err(StoreError::Rejected(format!("task {task_ref} does not exist"))),
                None => Err(sdk_error(e)),
            },
        }
    }
}

/// Shared by [`Tasks`] (a task sent now) and [`super::SubmitQueue`] (a task queued).
impl Table {
    /// The one conditional put of a new task (submitting with a `deadline` for the poller, or
    /// queued without one), with `extra` attributes.
    pub(super) async fn put_new(
        &self,
        task: &Task,
        deadline: Option<Timestamp>,
        fingerprint: Option<&str>,
        extra: Item,
    ) -> Result<Created, StoreError> {
        use attr::*;
        let mut item: Item = [
            (PK, s(task.task_ref.as_ref())),
            (KIND, s(task.kind.as_str())),
            (STATE, s(task.state.name())),
            (CREATED_AT, n(task.created_at.as_millis())),
            (EXPIRES_TTL, self.ttl(task.created_at)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some(deadline) = deadline {
            item.insert(POLL_SHARD.to_owned(), n(u64::from(self.shards.of(&task.task_ref))));
            item.insert(POLL_DUE_AT.to_owned(), n(deadline.as_millis()));
        }
        item.extend(extra);
        if let Some(owner) = &task.owner {
            item.insert(OWNER.to_owned(), s(owner));
        }
        if let Some(fp) = fingerprint {
            item.insert(IDEM_FINGERPRINT.to_owned(), s(fp));
        }
        if let Some(url) = &task.owner_callback {
            item.insert(OWNER_CALLBACK.to_owned(), s(url));
            item.insert(DLV_SHARD.to_owned(), n(u64::from(self.shards.of(&task.task_ref))));
            item.insert(
                WEBHOOK_OWNER.to_owned(),
                s(task.webhook_owner.as_deref().unwrap_or(deliveries::DEFAULT_OWNER)),
            );
            if task.pingback_form != crate::domain::PingbackForm::Get {
                item.insert(PINGBACK_FORM.to_owned(), s(task.pingback_form.as_str()));
            }
        }
        let res = self
            .client
            .put_item()
            .table_name(&*self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        use aws_sdk_dynamodb::operation::put_item::PutItemError;
        let e = match res {
            Ok(_) => return Ok(Created::New),
            Err(e) => e,
        };
        let refused = match &e {
            SdkError::ServiceError(se) => match se.err() {
                PutItemError::ConditionalCheckFailedException(c) => Some(c.item.clone().unwrap_or_default()),
                _ => None,
            },
            _ => None,
        };
        let Some(old) = refused else { return Err(sdk_error(e)) };
        if old.is_empty() {
            return Err(StoreError::Corrupt(format!("task {} exists but was not returned", task.task_ref)));
        }
        Ok(Created::Existing {
            task: Task::try_from(&old)?,
            fingerprint: get_s(&old, IDEM_FINGERPRINT)?.map(str::to_owned),
        })
    }
}
