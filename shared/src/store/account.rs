//! The account's shared pacing and breaker: the per-second submit and read slots, and the
//! circuit breaker that a ban, a silent res.php or a plan run out opens.

use aws_sdk_dynamodb::types::AttributeValue;

use super::{Account, Item, StoreError, attr, condition_held, get_s, get_ts, n, s, sdk_error};
use crate::time::Timestamp;

/// The account-wide circuit breaker for CaptchaAI traffic (and what was learnt of the service),
/// one item in the task table. While it is open no function sends CaptchaAI anything: a ban or a rejected key answered once stops
/// every poller and every submit, for the ban's documented duration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Breaker {
    pub open_until: Option<Timestamp>,
    /// The code (or failure) that opened it.
    pub reason: Option<String>,
    pub opened_at: Option<Timestamp>,
    /// A key or account problem: an operator must fix it (`relay-ops breaker close`).
    pub needs_operator: bool,
    /// Opened because res.php stopped answering (timeouts, 5xx, HTML), not by a ban: it holds
    /// reads back, not submits.
    pub res_php_only: bool,
    /// res.php answered a batch read in a way that says it does not take `ids=`.
    pub batch_unsupported: bool,
    /// Opened because the plan has run out (`ERROR_ZERO_BALANCE` with threads free): it holds
    /// submits back, not reads — results of tasks already taken still come.
    pub submits_only: bool,
}

/// Why the breaker opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A ban or a rejected key: every request to CaptchaAI stops.
    Ban { needs_operator: bool },
    /// res.php answers are missing (timeouts, 5xx, HTML): reads pause.
    NoAnswers,
    /// CaptchaAI's plan has expired or is out of balance: submits stop (an operator renews it),
    /// reads go on.
    PlanOut,
}

impl Breaker {
    /// Its key: not a task reference (those start `tsk_`), never in the due-for-poll index.
    /// The item also holds the submit queue's state (see [`queue::SubmitState`]).
    pub const KEY: &'static str = "breaker#captchaai";

    pub(super) fn from_item(item: &Item) -> Result<Self, StoreError> {
        Ok(Breaker {
            open_until: get_ts(item, "open_until")?,
            reason: get_s(item, "reason")?.map(str::to_owned),
            opened_at: get_ts(item, "opened_at")?,
            needs_operator: matches!(item.get("needs_operator"), Some(AttributeValue::Bool(true))),
            res_php_only: matches!(item.get("res_php_only"), Some(AttributeValue::Bool(true))),
            batch_unsupported: get_ts(item, "batch_unsupported_at")?.is_some(),
            submits_only: matches!(item.get("submits_only"), Some(AttributeValue::Bool(true))),
        })
    }

    /// Until when res.php reads are stopped, if they are at `now`.
    pub fn open_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.open_until.filter(|u| *u > now && !self.submits_only)
    }

    /// Until when submits (in.php) are stopped, if they are at `now`: by a ban or a plan run out.
    pub fn open_for_submits_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.open_until.filter(|u| *u > now && !self.res_php_only)
    }

    /// Whether it is open because the plan has run out.
    pub fn plan_out(&self) -> bool {
        self.submits_only
    }
}

impl Account {
    /// Takes one of the in.php submits allowed in the current second, account-wide: CaptchaAI
    /// bans more than 60 submits in 3 s (`MAX_USER_TURN`), and with at most `per_second` in each
    /// whole second, any 3 s (which touches at most 4 of them) holds at most 4 × `per_second`.
    /// One conditional counter per second (deleted by TTL a minute later). `false`: none left.
    pub async fn take_submit_slot(&self, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        self.take_slot("pacer", now, per_second).await
    }

    /// Takes one of the res.php reads allowed in the current second, account-wide: the poller's
    /// rate holds across every invocation (overlapping schedules, a manual run, Lambda's retry
    /// of one), as [`Self::take_submit_slot`] does for in.php.
    pub async fn take_read_slot(&self, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        self.take_slot("respacer", now, per_second).await
    }

    async fn take_slot(&self, prefix: &str, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        let second = now.as_secs();
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(&format!("{prefix}#{second}")))
            .update_expression("ADD #taken :one SET expires_ttl = :ttl")
            .condition_expression("attribute_not_exists(#taken) OR #taken < :limit")
            .expression_attribute_names("#taken", attr::SLOT_TAKEN)
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":limit", n(u64::from(per_second)))
            .expression_attribute_values(":ttl", n(second + 60))
            .send()
            .await;
        condition_held(res)
    }

    /// The account-wide CaptchaAI breaker, as every function sees it (strongly consistent).
    pub async fn breaker(&self) -> Result<Breaker, StoreError> {
        Ok(super::SubmitQueue(self.0.clone()).submit_state().await?.breaker)
    }

    /// Remembers that res.php does not take batch reads (`ids=`), for every poller from now on.
    pub async fn mark_batch_unsupported(&self, now: Timestamp) -> Result<(), StoreError> {
        self.client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("SET batch_unsupported_at = if_not_exists(batch_unsupported_at, :now)")
            .expression_attribute_values(":now", n(now.as_millis()))
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }

    /// Opens (or extends, never shortens) the breaker until `until`. `true` if this call opened
    /// or extended it, `false` if it was already open at least that long. A [`Stop::NoAnswers`]
    /// opening (res.php not answering) never replaces a ban in force.
    pub async fn open_breaker(
        &self,
        until: Timestamp,
        reason: &str,
        stop: Stop,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let (needs_operator, res_php_only, submits_only, condition) = match stop {
            Stop::Ban { needs_operator } => {
                // A ban replaces a pause for missing answers whatever its length: it also stops submits.
                (
                    needs_operator,
                    false,
                    false,
                    "attribute_not_exists(open_until) OR open_until < :until OR res_php_only = :t OR submits_only = :t",
                )
            }
            Stop::NoAnswers => (
                false,
                true,
                false,
                "attribute_not_exists(open_until) OR open_until <= :now OR (res_php_only = :t AND open_until < :until)",
            ),
            // Never over a ban (which stops reads too).
            Stop::PlanOut => (
                true,
                false,
                true,
                "attribute_not_exists(open_until) OR open_until <= :now OR res_php_only = :t \
                 OR (submits_only = :t AND open_until < :until)",
            ),
        };
        let req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression(
                "SET open_until = :until, reason = :reason, opened_at = :now, needs_operator = :op, \
                 res_php_only = :scope, submits_only = :so, opened_count = if_not_exists(opened_count, :zero) + :one",
            )
            .condition_expression(condition)
            .expression_attribute_values(":until", n(until.as_millis()))
            .expression_attribute_values(":reason", s(reason))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":op", AttributeValue::Bool(needs_operator))
            .expression_attribute_values(":scope", AttributeValue::Bool(res_php_only))
            .expression_attribute_values(":so", AttributeValue::Bool(submits_only))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":t", AttributeValue::Bool(true));
        condition_held(req.send().await)
    }

    /// Closes the breaker now (an operator fixed the key, or a ban is known to be over).
    pub async fn close_breaker(&self) -> Result<(), StoreError> {
        self.client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("REMOVE open_until, needs_operator")
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }
}
