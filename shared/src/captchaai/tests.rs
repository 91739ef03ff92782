//! Tests of the answers' reading, the errors' classes, `threadsinfo`, and the submit requests.

use super::answer::res_answer;
use super::*;
use crate::codes::{CodeClass, ErrorCode};
use crate::domain::CaptchaKind;

#[test]
fn batch_answers_split_in_order() {
    let got = split_batch(RawAnswer::Ok("tok1|CAPCHA_NOT_READY|ERROR_CAPTCHA_UNSOLVABLE".into()), 3).expect("split");
    assert!(matches!(&got[0], ResAnswer::Ready(s) if s.expose() == "tok1"));
    assert_eq!(got[1], ResAnswer::NotReady);
    assert!(matches!(&got[2], ResAnswer::Code(c) if c.as_ref() == "ERROR_CAPTCHA_UNSOLVABLE"));
    assert!(split_batch(RawAnswer::Ok("a|b".into()), 3).is_err(), "a short answer is not trusted");
    assert!(split_batch(RawAnswer::Code("ERROR_WRONG_ID_FORMAT".into()), 1).is_err());
}

#[test]
fn every_submit_answer_shape_is_read() {
    assert_eq!(parse_answer(200, r#"{"status":1,"request":"2122988149"}"#), Ok(RawAnswer::Ok("2122988149".into())));
    assert_eq!(parse_answer(200, r#"{"status":1,"request":2122988149}"#), Ok(RawAnswer::Ok("2122988149".into())));
    assert_eq!(parse_answer(200, r#"{"status":"1","request":"7"}"#), Ok(RawAnswer::Ok("7".into())));
    assert_eq!(parse_answer(200, "OK|2122988149"), Ok(RawAnswer::Ok("2122988149".into())));
    assert_eq!(
        parse_answer(200, r#"{"status":0,"request":"ERROR_WRONG_USER_KEY"}"#),
        Ok(RawAnswer::Code("ERROR_WRONG_USER_KEY".into()))
    );
    assert_eq!(parse_answer(200, "ERROR_NO_SLOT_AVAILABLE"), Ok(RawAnswer::Code("ERROR_NO_SLOT_AVAILABLE".into())));
    assert_eq!(parse_answer(200, "CAPCHA_NOT_READY"), Ok(RawAnswer::Code("CAPCHA_NOT_READY".into())));
    assert_eq!(parse_answer(200, "ERROR: 1005"), Ok(RawAnswer::Code("ERROR: 1005".into())));
    // A refusal without a code proves nothing: outcome unknown, not a code "" (fuzzing).
    for empty in [r#"{"status":0,"request":""}"#, r#"{"status":0,"request":"  "}"#] {
        let e = parse_answer(200, empty).expect_err(empty);
        assert!(e.outcome_unknown(), "{empty}: {e}");
    }
}

#[test]
fn http_errors_and_html_are_transient_errors() {
    assert_eq!(parse_answer(502, "<html>Bad gateway</html>"), Err(CaptchaAiError::Http(502)));
    let html = parse_answer(200, "<!DOCTYPE html><p>maintenance</p>").expect_err("html");
    assert!(matches!(html, CaptchaAiError::NotAnAnswer(_)));
    assert_eq!(html.class(), CodeClass::Transient);
    assert_eq!(CaptchaAiError::Http(503).class(), CodeClass::Transient);
    assert_eq!(CaptchaAiError::Timeout.class(), CodeClass::Transient);
    for unknown in [
        CaptchaAiError::Timeout,
        CaptchaAiError::Transport("connection closed before message completed".into()),
        CaptchaAiError::Http(502),
        CaptchaAiError::Http(520),
        CaptchaAiError::NotAnAnswer("an HTML page (120 bytes)".into()),
    ] {
        assert!(unknown.outcome_unknown(), "{unknown}: proves nothing about the submit");
    }
    assert!(!CaptchaAiError::Connect("refused".into()).outcome_unknown(), "never sent");
    let refused = CaptchaAiError::Code(ErrorCode::parse("ERROR_PAGEURL").expect("code"));
    assert!(!refused.outcome_unknown(), "an explicit answer");
}

#[test]
fn structured_answers_and_user_agents_are_read_in_every_shape_seen() {
    // 2captcha's GeeTest answer: an object in `request`.
    let obj = r#"{"status":1,"request":{"geetest_challenge":"c","geetest_validate":"v","geetest_seccode":"s"}}"#;
    let RawAnswer::Ok(text) = parse_answer(200, obj).expect("read") else { panic!("not ok") };
    let v: serde_json::Value = serde_json::from_str(&text).expect("json text");
    assert_eq!(v["geetest_validate"], "v");
    // CaptchaAI's SDK: the JSON as a string; BLS's cells as a list.
    let string = r#"{"status":1,"request":"{\"challenge\":\"c\",\"validate\":\"v\",\"seccode\":\"s\"}"}"#;
    assert!(matches!(parse_answer(200, string), Ok(RawAnswer::Ok(t)) if t.contains("validate")));
    assert_eq!(parse_answer(200, r#"{"status":1,"request":[1,4,7]}"#), Ok(RawAnswer::Ok("[1,4,7]".into())));
    // Enterprise / Cloudflare in CaptchaAI's SDK: the token in `result`, the user agent beside it.
    let ent = r#"{"status":1,"result":"ent-token","user_agent":"UA/1.0"}"#;
    assert_eq!(parse_answer(200, ent), Ok(RawAnswer::Ok("ent-token".into())));
    assert_eq!(answer_user_agent(ent).as_deref(), Some("UA/1.0"));
    assert_eq!(answer_user_agent(r#"{"status":1,"request":"t","useragent":"UA/2"}"#).as_deref(), Some("UA/2"));
    assert_eq!(answer_user_agent(r#"{"status":1,"request":"t"}"#), None);
    assert_eq!(answer_user_agent("OK|t"), None);
}

#[test]
fn an_empty_report_answer_is_a_recorded_report_and_threadsinfo_is_read() {
    assert_eq!(report_answer(200, ""), Ok("OK_REPORT_RECORDED".into()), "CaptchaAI's empty 200");
    assert_eq!(report_answer(200, r#"{"status":1,"request":"OK_REPORT_RECORDED"}"#), Ok("OK_REPORT_RECORDED".into()));
    assert_eq!(report_answer(200, "ERROR_DUPLICATE_REPORT"), Ok("ERROR_DUPLICATE_REPORT".into()));
    assert!(report_answer(502, "").is_err(), "an empty 502 is trouble, not a report");
    let info = parse_threads_info(200, r#"{"threads":10,"working_threads":"3"}"#).expect("read");
    assert_eq!((info.threads, info.working_threads, info.free()), (10, 3, 7));
    assert_eq!(
        parse_threads_info(200, r#"{"status":0,"request":"ERROR_KEY_DOES_NOT_EXIST"}"#),
        Err(CaptchaAiError::Code(ErrorCode::parse("ERROR_KEY_DOES_NOT_EXIST").expect("code")))
    );
    assert!(parse_threads_info(200, r#"{"status":1,"request":"10"}"#).is_err());
}

#[test]
fn res_php_answers_become_ready_not_ready_or_code() {
    let ready = res_answer(parse_answer(200, r#"{"status":1,"request":"03AGdBq2"}"#).expect("ok")).expect("ready");
    assert!(matches!(ready, ResAnswer::Ready(s) if s.expose() == "03AGdBq2"));
    assert_eq!(res_answer(RawAnswer::Code("CAPCHA_NOT_READY".into())), Ok(ResAnswer::NotReady));
    assert!(
        matches!(res_answer(RawAnswer::Code("ERROR_CAPTCHA_UNSOLVABLE".into())), Ok(ResAnswer::Code(c)) if c.class() == CodeClass::TerminalForTask)
    );
    // A plain-mode solution containing `|` keeps everything after the first one.
    assert_eq!(parse_answer(200, "OK|a|b"), Ok(RawAnswer::Ok("a|b".into())));
}

#[test]
fn submit_requests_parse_validate_and_map_to_in_php_fields() {
    let r: SubmitRequest = serde_json::from_str(
        r#"{"kind":"recaptcha_v3","sitekey":"6Le","pageurl":"https://shop.example/login","action":"login","min_score":0.3}"#,
    )
    .expect("parses");
    assert_eq!(r.kind(), CaptchaKind::RecaptchaV3);
    r.validate().expect("valid");
    let f = r.form_fields();
    for want in [
        ("method", "userrecaptcha"),
        ("version", "v3"),
        ("googlekey", "6Le"),
        ("action", "login"),
        ("min_score", "0.3"),
    ] {
        assert!(f.iter().any(|(k, v)| *k == want.0 && v == want.1), "missing {want:?} in {f:?}");
    }
    let e: SubmitRequest =
        serde_json::from_str(r#"{"kind":"recaptcha_enterprise","sitekey":"k","pageurl":"https://a.example"}"#)
            .expect("parses");
    assert!(e.form_fields().contains(&("enterprise", "1".into())));
    let t: SubmitRequest =
        serde_json::from_str(r#"{"kind":"turnstile","sitekey":"0x4","pageurl":"https://a.example","data":"d"}"#)
            .expect("parses");
    assert!(t.form_fields().contains(&("method", "turnstile".into())));
    let h: SubmitRequest =
        serde_json::from_str(r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"https://a.example"}"#).expect("parses");
    assert!(h.form_fields().contains(&("method", "hcaptcha".into())));
    let i: SubmitRequest = serde_json::from_str(r#"{"kind":"image","body":"iVBORw0KGgo="}"#).expect("parses");
    i.validate().expect("valid");
    assert!(i.form_fields().contains(&("method", "base64".into())));
}

#[test]
fn bad_submit_requests_are_refused_with_the_field_named() {
    assert!(serde_json::from_str::<SubmitRequest>(r#"{"kind":"funcaptcha","sitekey":"s"}"#).is_err());
    assert!(serde_json::from_str::<SubmitRequest>(r#"{"kind":"hcaptcha","sitekey":"s"}"#).is_err());
    let cases = [
        (r#"{"kind":"hcaptcha","sitekey":"","pageurl":"https://a.example"}"#, "sitekey"),
        (r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"javascript:x"}"#, "pageurl"),
        (r#"{"kind":"recaptcha_v3","sitekey":"s","pageurl":"https://a.example","min_score":3}"#, "min_score"),
        (r#"{"kind":"image","body":"not base64!"}"#, "body"),
    ];
    for (json, field) in cases {
        let r: SubmitRequest = serde_json::from_str(json).expect("shape parses");
        let err = r.validate().expect_err(json);
        assert!(err.0.contains(field), "{json}: {err}");
    }
}
