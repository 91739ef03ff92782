//! [`CaptchaAiClient`]: the HTTP client for one CaptchaAI account — submit (in.php), read one or
//! many results, balance, reports and `threadsinfo` (res.php).

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};

use super::answer::{
    RawAnswer, ResAnswer, answer_user_agent, code, parse_answer, report_answer, res_answer, split_batch,
};
use super::error::CaptchaAiError;
use super::request::SubmitRequest;
use super::threads::{ThreadsInfo, parse_threads_info};
use crate::domain::CaptchaId;

/// Client for one CaptchaAI account.
#[derive(Clone)]
pub struct CaptchaAiClient {
    http: reqwest::Client,
    base_url: String,
    key: SecretString,
    soft_id: Option<u32>,
}

impl std::fmt::Debug for CaptchaAiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptchaAiClient").field("base_url", &self.base_url).finish_non_exhaustive()
    }
}

impl CaptchaAiClient {
    pub fn new(
        base_url: &str,
        key: SecretString,
        timeout: Duration,
        soft_id: Option<u32>,
    ) -> Result<Self, CaptchaAiError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3).min(timeout))
            .timeout(timeout)
            .pool_idle_timeout(Duration::from_secs(50))
            .user_agent(concat!("captcha-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(CaptchaAiError::from_reqwest)?;
        Ok(Self { http, base_url: base_url.trim_end_matches('/').to_owned(), key, soft_id })
    }

    async fn read(&self, resp: reqwest::Response) -> Result<RawAnswer, CaptchaAiError> {
        Ok(self.read_with_agent(resp).await?.0)
    }

    /// The answer, and the user agent it names beside a token.
    async fn read_with_agent(&self, resp: reqwest::Response) -> Result<(RawAnswer, Option<String>), CaptchaAiError> {
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        Ok((parse_answer(status, &body)?, answer_user_agent(&body)))
    }

    /// Submits a captcha with a pingback URL (POST form, `json=1`). Returns CaptchaAI's id.
    pub async fn submit(&self, req: &SubmitRequest, pingback: &str) -> Result<CaptchaId, CaptchaAiError> {
        let mut form = req.form_fields();
        form.push(("key", self.key.expose_secret().to_owned()));
        form.push(("json", "1".into()));
        form.push(("pingback", pingback.to_owned()));
        if let Some(id) = self.soft_id {
            form.push(("soft_id", id.to_string()));
        }
        let resp = self
            .http
            .post(format!("{}/in.php", self.base_url))
            .form(&form)
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        match self.read(resp).await? {
            RawAnswer::Ok(id) => CaptchaId::parse(&id).map_err(|e| CaptchaAiError::NotAnAnswer(e.0)),
            RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        }
    }

    /// Reads several results in one request (`action=get&ids=…`, at most 100 ids).
    pub async fn get_results(&self, ids: &[CaptchaId]) -> Result<Vec<ResAnswer>, CaptchaAiError> {
        let joined = ids.iter().map(AsRef::as_ref).collect::<Vec<&str>>().join(",");
        split_batch(self.res_php_get("ids", &joined).await?, ids.len())
    }

    /// Reads one task's result (`action=get`), with the user agent its answer names.
    pub async fn get_result(&self, id: &CaptchaId) -> Result<ResAnswer, CaptchaAiError> {
        let (raw, ua) = self.res_php_answer(&[("action", "get"), ("id", id.as_ref())]).await?;
        Ok(match res_answer(raw)? {
            ResAnswer::Ready(s) => ResAnswer::Ready(s.with_user_agent(ua.as_deref())),
            other => other,
        })
    }

    /// `res.php?action=get&<name>=<value>&json=1`.
    async fn res_php_get(&self, name: &str, value: &str) -> Result<RawAnswer, CaptchaAiError> {
        self.res_php(&[("action", "get"), (name, value)]).await
    }

    /// `res.php?key=…&<params>&json=1`.
    async fn res_php(&self, params: &[(&str, &str)]) -> Result<RawAnswer, CaptchaAiError> {
        Ok(self.res_php_answer(params).await?.0)
    }

    /// `res.php?key=…&<params>&json=1`: the answer and the user agent it names.
    async fn res_php_answer(&self, params: &[(&str, &str)]) -> Result<(RawAnswer, Option<String>), CaptchaAiError> {
        let mut query: Vec<(&str, &str)> = vec![("key", self.key.expose_secret())];
        query.extend_from_slice(params);
        query.push(("json", "1"));
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&query)
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        self.read_with_agent(resp).await
    }

    /// The account balance (`action=getbalance`), as CaptchaAI states it: a decimal number.
    pub async fn balance(&self) -> Result<String, CaptchaAiError> {
        match self.res_php(&[("action", "getbalance")]).await? {
            RawAnswer::Ok(b) if b.trim().parse::<f64>().is_ok_and(f64::is_finite) => Ok(b.trim().to_owned()),
            RawAnswer::Ok(other) => {
                Err(CaptchaAiError::NotAnAnswer(format!("a balance that is not a number ({} bytes)", other.len())))
            }
            RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        }
    }

    /// Reports a solution good or bad (`action=reportgood` / `reportbad`). Returns the answer
    /// as 2captcha words it: `OK_REPORT_RECORDED`, or a code such as `ERROR_DUPLICATE_REPORT`.
    /// CaptchaAI answers a report with HTTP 200 and an empty body: that is a recorded report.
    pub async fn report(&self, id: &CaptchaId, good: bool) -> Result<String, CaptchaAiError> {
        let action = if good { "reportgood" } else { "reportbad" };
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&[("key", self.key.expose_secret()), ("action", action), ("id", id.as_ref()), ("json", "1")])
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        report_answer(status, &body)
    }

    /// The plan's threads (`action=threadsinfo`, CaptchaAI's): how many the plan has and how
    /// many are solving now.
    pub async fn threads_info(&self) -> Result<ThreadsInfo, CaptchaAiError> {
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&[("key", self.key.expose_secret()), ("action", "threadsinfo"), ("json", "1")])
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        parse_threads_info(status, &body)
    }
}
