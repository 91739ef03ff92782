//! What a push carries: the JSON envelope of a task's view, or a compat task's pingback
//! (CaptchaAI's `GET`, 2captcha's `POST` form).

use serde::Serialize;

use crate::domain::{PingbackForm, Task, TaskView};
use crate::time::Timestamp;
use crate::webhook::PushMethod;

/// The JSON push of a task that was not submitted through `in.php`.
#[derive(Serialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    kind: String,
    timestamp: String,
    data: &'a TaskView,
}

/// One push as it leaves: where, how, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    pub method: PushMethod,
    pub url: String,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

/// The push of `task`'s result to `url` at `now`. A compat task (submitted through `in.php`
/// with a `pingback`) gets the pingback its handler already parses: CaptchaAI's
/// `GET <url>?id=<id>&code=<answer>` (appended to the URL's own query), or 2captcha's `POST`
/// form `id=<id>&code=<answer>` where its relay key says so. Other tasks get JSON. A token is in
/// it only while fresh, as in every other answer.
pub fn payload(task: &Task, url: &str, now: Timestamp) -> Push {
    if let Some(id) = task.task_ref.compat_id() {
        let (_, code) = task.compat_answer(now);
        let pairs = [("id", id.to_string()), ("code", code)];
        return match task.pingback_form {
            PingbackForm::Get => {
                let url = match url::Url::parse(url) {
                    Ok(mut u) => {
                        u.query_pairs_mut().extend_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())));
                        u.to_string()
                    }
                    // Checked at submit; an unparseable one is refused by the sender as it is.
                    Err(_) => url.to_owned(),
                };
                Push { method: PushMethod::Get, url, content_type: "", body: Vec::new() }
            }
            PingbackForm::Post => Push {
                method: PushMethod::Post,
                url: url.to_owned(),
                content_type: "application/x-www-form-urlencoded",
                body: serde_urlencoded::to_string(pairs).unwrap_or_default().into_bytes(),
            },
        };
    }
    let mut view = task.view(now);
    view.delivery = None;
    let env = Envelope { kind: format!("task.{}", view.status), timestamp: now.to_rfc3339(), data: &view };
    Push {
        method: PushMethod::Post,
        url: url.to_owned(),
        content_type: "application/json",
        body: serde_json::to_vec(&env).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{CaptchaKind, Solution, TaskRef, TaskState, Via};

    fn solved(task_ref: TaskRef, token: &str) -> Task {
        let at = Timestamp::from_millis(1_000_000);
        Task {
            state: TaskState::Solved {
                solution: Solution::parse(token).expect("token"),
                resolved_at: at,
                via: Via::Callback,
                token_clock_start: at,
            },
            owner_callback: Some("https://owner.example/cb".into()),
            ..Task::new(task_ref, CaptchaKind::RecaptchaV2, Timestamp::from_millis(900_000))
        }
    }

    #[test]
    fn a_compat_push_is_captchaais_get_pingback_and_never_carries_a_stale_token() {
        let (r, id) = TaskRef::generate_compat();
        let task = solved(r, "03AGdBq2-token");
        // Appended to the URL's own query, as CaptchaAI does: the owner's route reads `id` and `code`.
        let p = payload(&task, "https://owner.example/cb?src=relay", Timestamp::from_millis(1_010_000));
        assert_eq!(p.method, PushMethod::Get);
        assert_eq!(p.url, format!("https://owner.example/cb?src=relay&id={id}&code=03AGdBq2-token"));
        assert!(p.body.is_empty());
        // 120 s after the solve the token is past its lifetime: the push says so instead.
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_121_000));
        assert_eq!(p.url, format!("https://owner.example/cb?id={id}&code=ERROR_TOKEN_EXPIRED"));
    }

    #[test]
    fn a_compat_push_of_a_2captcha_key_is_the_post_form() {
        let (r, id) = TaskRef::generate_compat();
        let task = Task { pingback_form: PingbackForm::Post, ..solved(r, "03AGdBq2 token+/=") };
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_010_000));
        assert_eq!((p.method, p.content_type), (PushMethod::Post, "application/x-www-form-urlencoded"));
        assert_eq!(p.url, "https://owner.example/cb");
        assert_eq!(String::from_utf8(p.body).expect("utf8"), format!("id={id}&code=03AGdBq2+token%2B%2F%3D"));
    }

    #[test]
    fn a_json_push_is_the_task_view_typed_by_status_and_its_id_follows_the_result() {
        let task = solved(TaskRef::generate(), "03AGdBq2-token");
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_010_000));
        assert_eq!((p.method, p.content_type), (PushMethod::Post, "application/json"));
        let v: serde_json::Value = serde_json::from_slice(&p.body).expect("json");
        assert_eq!(v["type"], "task.solved");
        assert_eq!(v["data"]["solution"], "03AGdBq2-token");
        assert_eq!(v["data"]["task_ref"], task.task_ref.as_ref());
        assert!(v["data"].get("delivery").is_none(), "the push does not describe itself");
        let body = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_121_000)).body;
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["type"], "task.expired");
        assert!(v["data"].get("solution").is_none(), "a stale token is never pushed");
        // The webhook-id: the same for the same result whenever it is sent, another for another.
        let id = task.webhook_id().expect("terminal");
        assert!(id.starts_with("msg_") && id.len() == 36, "{id}");
        assert_eq!(solved(task.task_ref.clone(), "03AGdBq2-token").webhook_id(), Some(id.clone()));
        assert_ne!(solved(task.task_ref.clone(), "03AGdBq2-other").webhook_id(), Some(id));
        assert_eq!(Task::new(TaskRef::generate(), CaptchaKind::Image, Timestamp::from_millis(0)).webhook_id(), None);
    }
}
