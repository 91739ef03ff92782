//! How a task is kept as a DynamoDB item: the attribute names, the write fragments every
//! final write shares, and the decoding of an item back into a [`Task`].

use std::collections::HashMap;

use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::types::AttributeValue;

use super::{StoreError, deliveries};
use crate::codes::ErrorCode;
use crate::domain::{CaptchaId, CaptchaKind, Outcome, Task, TaskRef, TaskState, Via};
use crate::time::Timestamp;

pub(crate) mod attr {
    pub const PK: &str = "pk";
    pub const KIND: &str = "kind";
    pub const STATE: &str = "state";
    pub const CREATED_AT: &str = "created_at";
    pub const CAPTCHA_ID: &str = "captcha_id";
    pub const SUBMITTED_AT: &str = "submitted_at";
    pub const SOLUTION: &str = "solution";
    /// The user agent the solution was earned with: the one CaptchaAI named, else the one
    /// the task was submitted with (`userAgent`).
    pub const USER_AGENT: &str = "user_agent";
    pub const ERROR_CODE: &str = "error_code";
    pub const ERROR_DETAIL: &str = "error_detail";
    pub const RESOLVED_AT: &str = "resolved_at";
    pub const RESOLVED_VIA: &str = "resolved_via";
    pub const TOKEN_CLOCK_START: &str = "token_clock_start";
    pub const POLL_SHARD: &str = "poll_shard";
    pub const POLL_DUE_AT: &str = "poll_due_at";
    pub const EXPIRES_TTL: &str = "expires_ttl";
    pub const POLL_READS: &str = "poll_reads";
    pub const POLL_UNKNOWN: &str = "poll_unknown";
    pub const LAST_NOT_READY_AT: &str = "last_not_ready_at";
    pub const LATE_CODE: &str = "late_code";
    pub const SUBMIT_UNKNOWN: &str = "submit_unknown";
    pub const IDEM_FINGERPRINT: &str = "idem_fingerprint";
    pub const LATE_AT: &str = "late_at";
    pub const LATE_VIA: &str = "late_via";
    pub const LATE_CLOCK: &str = "late_clock";
    pub const HANDED_OUT_AT: &str = "handed_out_at";
    pub const OWNER_CALLBACK: &str = "owner_callback";
    pub const WEBHOOK_OWNER: &str = "webhook_owner";
    /// `post` on a compat task whose relay key pushes 2captcha's form (absent: CaptchaAI's GET).
    pub const PINGBACK_FORM: &str = "pingback_form";
    /// When the task was sent to in.php a second time (see `Task::resent_at`).
    pub const RESENT_AT: &str = "resent_at";
    /// Who submitted the task (see `Task::owner`): what an erasure names.
    pub const OWNER: &str = "owner";
    /// How many of a per-second slot's calls are taken (`pacer#<s>` for in.php, `respacer#<s>`
    /// for res.php reads). Stored as `submits`, its name from when in.php was the only pace:
    /// renaming it would let a deploy's old and new instances count apart for a second.
    pub const SLOT_TAKEN: &str = "submits";
    // The submit queue (see `queue`).
    pub const QUEUED_AT: &str = "queued_at";
    pub const Q_LANE: &str = "q_lane";
    pub const RELEASED_AT: &str = "released_at";
    pub const SQ_KEY: &str = "sq_key";
    pub const SQ_AT: &str = "sq_at";
    // The push of the result to the owner's callback (see `deliveries`).
    pub const DLV_SHARD: &str = "dlv_shard";
    pub const DLV_DUE: &str = "dlv_due";
    pub const DLV_STATUS: &str = "dlv_status";
    pub const DLV_ATTEMPTS: &str = "dlv_attempts";
    pub const DLV_LAST: &str = "dlv_last";
    pub const DLV_LAST_AT: &str = "dlv_last_at";
    pub const DLV_DONE_ID: &str = "dlv_done_id";
    pub const DLV_DONE_AT: &str = "dlv_done_at";
    pub const DLV_PARKED_AT: &str = "dlv_parked_at";
    /// Failed attempts recorded, per schedule (see `crate::domain::schedule`).
    pub const DLV_TOKEN_FAILS: &str = "dlv_tfails";
    pub const DLV_STANDARD_FAILS: &str = "dlv_sfails";
}

/// What every terminal write adds: the push of the result becomes due, in the same write (the
/// transactional outbox). Only items with `dlv_shard` (those with an owner callback) appear in
/// the due-for-delivery index; on the rest these attributes are inert.
pub(crate) const DELIVERY_DUE: &str =
    "dlv_due = :dnow, dlv_status = :dpending, dlv_attempts = :dzero, dlv_tfails = :dzero, dlv_sfails = :dzero";
/// ... and what it clears: a parked push of an earlier result, a lease on it.
pub(crate) const DELIVERY_CLEAR: &str = "dlv_parked_at, dlv_lease";
/// What every write that ends a task's open life removes: its place in the due-for-poll index,
/// in the submit queue's index (queued or in work), and what only in.php needed.
pub(crate) const UNSENT_CLEAR: &str =
    "poll_due_at, poll_shard, lease_owner, sq_key, sq_at, sq_req, sq_pingback, submit_unknown";

/// The values [`DELIVERY_DUE`] refers to.
pub(crate) fn delivery_due(req: UpdateItemFluentBuilder, now: Timestamp) -> UpdateItemFluentBuilder {
    req.expression_attribute_values(":dnow", n(now.as_millis()))
        .expression_attribute_values(":dpending", s(crate::domain::DeliveryStatus::Pending.as_str()))
        .expression_attribute_values(":dzero", n(0))
}

pub(crate) type Item = HashMap<String, AttributeValue>;

pub(crate) fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_owned())
}

pub(crate) fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn get_s<'a>(item: &'a Item, name: &str) -> Result<Option<&'a str>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::S(v)) => Ok(Some(v)),
        Some(_) => Err(StoreError::Corrupt(format!("`{name}` is not a string"))),
    }
}

pub(crate) fn req_s<'a>(item: &'a Item, name: &str) -> Result<&'a str, StoreError> {
    get_s(item, name)?.ok_or_else(|| StoreError::Corrupt(format!("`{name}` missing")))
}

pub(crate) fn get_ts(item: &Item, name: &str) -> Result<Option<Timestamp>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(v)) => v
            .parse()
            .map(|ms| Some(Timestamp::from_millis(ms)))
            .map_err(|_| StoreError::Corrupt(format!("`{name}` is not a whole number"))),
        Some(_) => Err(StoreError::Corrupt(format!("`{name}` is not a number"))),
    }
}

pub(crate) fn req_ts(item: &Item, name: &str) -> Result<Timestamp, StoreError> {
    get_ts(item, name)?.ok_or_else(|| StoreError::Corrupt(format!("`{name}` missing")))
}

pub(crate) fn corrupt<E: std::fmt::Display>(name: &'static str) -> impl Fn(E) -> StoreError {
    move |e| StoreError::Corrupt(format!("`{name}`: {e}"))
}

impl TryFrom<&Item> for Task {
    type Error = StoreError;

    fn try_from(item: &Item) -> Result<Self, StoreError> {
        use attr::*;
        let task_ref = TaskRef::parse(req_s(item, PK)?).map_err(corrupt(PK))?;
        let created_at = req_ts(item, CREATED_AT)?;
        // When a token can have been issued at the earliest: not before the task existed, nor
        // before res.php last said "not ready" — whatever the delivering path claimed.
        let issued_after = |claimed: Option<Timestamp>| -> Result<Timestamp, StoreError> {
            let not_ready = get_ts(item, LAST_NOT_READY_AT)?.unwrap_or(created_at);
            Ok(claimed.unwrap_or(created_at).max(created_at).max(not_ready))
        };
        let kind = CaptchaKind::parse(req_s(item, KIND)?).map_err(corrupt(KIND))?;
        let captcha_id = get_s(item, CAPTCHA_ID)?.map(CaptchaId::parse).transpose().map_err(corrupt(CAPTCHA_ID))?;
        let via =
            || -> Result<Via, StoreError> { Via::parse(req_s(item, RESOLVED_VIA)?).map_err(corrupt(RESOLVED_VIA)) };
        let state = match req_s(item, STATE)? {
            "queued" => TaskState::Queued {
                queued_at: get_ts(item, QUEUED_AT)?.unwrap_or(created_at),
                lane: get_s(item, Q_LANE)?.unwrap_or_default().to_owned(),
            },
            "submitting" => TaskState::Submitting { unknown: get_s(item, SUBMIT_UNKNOWN)?.map(str::to_owned) },
            "pending" => TaskState::Pending { submitted_at: req_ts(item, SUBMITTED_AT)? },
            "solved" => {
                let resolved_at = req_ts(item, RESOLVED_AT)?;
                TaskState::Solved {
                    solution: crate::domain::Solution::parse(req_s(item, SOLUTION)?)
                        .map_err(corrupt(SOLUTION))?
                        .with_user_agent(get_s(item, USER_AGENT)?),
                    resolved_at,
                    via: via()?,
                    token_clock_start: issued_after(get_ts(item, TOKEN_CLOCK_START)?)?,
                }
            }
            "failed" => TaskState::Failed {
                code: ErrorCode::parse(req_s(item, ERROR_CODE)?).map_err(corrupt(ERROR_CODE))?,
                detail: get_s(item, ERROR_DETAIL)?.map(str::to_owned),
                resolved_at: req_ts(item, RESOLVED_AT)?,
                via: via()?,
            },
            "expired" => TaskState::Expired {
                reason: get_s(item, ERROR_DETAIL)?.unwrap_or("deadline passed").to_owned(),
                resolved_at: req_ts(item, RESOLVED_AT)?,
                late: late_result(item)?
                    .map(|l| -> Result<_, StoreError> {
                        Ok(crate::domain::LateResult {
                            token_clock_start: issued_after(Some(l.token_clock_start))?,
                            ..l
                        })
                    })
                    .transpose()?,
            },
            other => return Err(StoreError::Corrupt(format!("unknown state `{other}`"))),
        };
        let handed_out_at = get_ts(item, HANDED_OUT_AT)?;
        let owner_callback = get_s(item, OWNER_CALLBACK)?.map(str::to_owned);
        let webhook_owner = get_s(item, WEBHOOK_OWNER)?.map(str::to_owned);
        let delivery = match owner_callback {
            Some(_) => Some(deliveries::state(item)?),
            None => None,
        };
        Ok(Task {
            task_ref,
            kind,
            created_at,
            captcha_id,
            state,
            handed_out_at,
            owner_callback,
            webhook_owner,
            delivery,
            released_at: get_ts(item, RELEASED_AT)?,
            resent_at: get_ts(item, RESENT_AT)?,
            owner: get_s(item, OWNER)?.map(str::to_owned),
            pingback_form: get_s(item, PINGBACK_FORM)?
                .map(crate::domain::PingbackForm::parse)
                .transpose()
                .map_err(corrupt(PINGBACK_FORM))?
                .unwrap_or_default(),
        })
    }
}

pub(crate) fn outcome_of(code: &str) -> Result<Outcome, crate::domain::ParseError> {
    if crate::codes::is_error_code(code) {
        ErrorCode::parse(code).map(Outcome::Failed)
    } else {
        crate::domain::Solution::parse(code).map(Outcome::Solved)
    }
}

pub(crate) fn late_result(item: &Item) -> Result<Option<crate::domain::LateResult>, StoreError> {
    use attr::*;
    let Some(code) = get_s(item, LATE_CODE)? else { return Ok(None) };
    let received_at = req_ts(item, LATE_AT)?;
    Ok(Some(crate::domain::LateResult {
        outcome: outcome_of(code).map_err(corrupt(LATE_CODE))?,
        received_at,
        via: Via::parse(req_s(item, LATE_VIA)?).map_err(corrupt(LATE_VIA))?,
        token_clock_start: get_ts(item, LATE_CLOCK)?.unwrap_or(received_at),
    }))
}

pub(crate) fn get_u32(item: &Item, name: &str) -> Result<u32, StoreError> {
    Ok(get_ts(item, name)?.map_or(0, |t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX)))
}
