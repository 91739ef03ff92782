//! Signing and verification: the spec's vector, secrets, rotation, and the reference library.

use super::*;
use std::time::{SystemTime, UNIX_EPOCH};

const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn secret(s: &str) -> WebhookSecret {
    WebhookSecret::parse(s).expect("a valid secret")
}

#[test]
fn the_standard_webhooks_spec_vector_signs_as_published() {
    let s = secret(SPEC_SECRET);
    let body = br#"{"test": 2432232314}"#;
    let sig = s.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
    assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    assert_eq!(verify(&s, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, body, 1614265330 + 60), Ok(()));
}

#[test]
fn secrets_parse_strictly_and_never_echo_the_value() {
    // Unpadded and padded forms of the same key sign the same.
    let padded = WebhookSecret::generate().1;
    let unpadded = padded.trim_end_matches('=');
    assert_ne!(padded, unpadded, "32 bytes encode with one `=`");
    assert_eq!(secret(&padded).sign("m", 1, b"x"), secret(unpadded).sign("m", 1, b"x"));
    for bad in [
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",               // no prefix
        "whsec_",                                         // empty
        "whsec_!!notbase64!!notbase64!!notbase64!!",      // not base64
        "whsec_c2hvcnQ=",                                 // 5 bytes
        &format!("whsec_{}", STANDARD.encode([7u8; 65])), // 65 bytes
    ] {
        let e = WebhookSecret::parse(bad).expect_err(bad);
        assert!(matches!(e, WebhookError::InvalidSecret(_)), "{bad}: {e:?}");
        let msg = e.to_string();
        let value = bad.trim_start_matches("whsec_");
        assert!(value.is_empty() || !msg.contains(value), "{msg} echoes the value");
    }
    assert!(WebhookSecret::parse(&format!("whsec_{}", STANDARD.encode([7u8; 24]))).is_ok());
    assert!(WebhookSecret::parse(&format!("whsec_{}", STANDARD.encode([7u8; 64]))).is_ok());
    let (_, a) = WebhookSecret::generate();
    let (_, b) = WebhookSecret::generate();
    assert_ne!(a, b);
    assert_eq!(STANDARD.decode(a.trim_start_matches("whsec_")).expect("base64").len(), 32);
    assert_eq!(format!("{:?}", secret(&a)), "WebhookSecret(<secret>)");
}

#[test]
fn signing_key_lists_take_one_or_two_current_first() {
    let (_, a) = WebhookSecret::generate();
    let (_, b) = WebhookSecret::generate();
    let (_, c) = WebhookSecret::generate();
    let one = SigningKeys::parse_list(&a).expect("one");
    assert!(one.previous().is_none());
    assert_eq!(one.signature_header("m", 5, b"x"), secret(&a).sign("m", 5, b"x"));
    for list in [format!("{a},{b}"), format!("{a} {b}"), format!(" {a} , {b}\n")] {
        let two = SigningKeys::parse_list(&list).expect("two");
        let want = format!("{} {}", secret(&a).sign("m", 5, b"x"), secret(&b).sign("m", 5, b"x"));
        assert_eq!(two.signature_header("m", 5, b"x"), want, "{list:?}");
    }
    assert_eq!(SigningKeys::parse_list("").expect_err("empty"), WebhookError::NoSecrets);
    assert_eq!(SigningKeys::parse_list(" , ").expect_err("empty"), WebhookError::NoSecrets);
    assert_eq!(SigningKeys::parse_list(&format!("{a},{b},{c}")).expect_err("three"), WebhookError::TooManySecrets(3));
    let e = SigningKeys::parse_list(&format!("{a},whsec_c2hvcnQ=")).expect_err("bad second");
    assert!(e.to_string().contains("secret 2 of 2"), "{e}");
    assert!(!e.to_string().contains("c2hvcnQ"), "{e}");
    let dbg = format!("{:?}", SigningKeys::parse_list(&format!("{a},{b}")).expect("two"));
    assert!(!dbg.contains(a.trim_start_matches("whsec_")) && dbg.contains("<secret>"), "{dbg}");
}

#[test]
fn rotation_both_secrets_verify_a_third_and_tampering_do_not() {
    let (cur, _) = WebhookSecret::generate();
    let (prev, _) = WebhookSecret::generate();
    let (other, _) = WebhookSecret::generate();
    let keys = SigningKeys::new(cur.clone(), Some(prev.clone()));
    let now = 1_700_000_000;
    let body = br#"{"id":"t1","code":"03AGdBq2"}"#;
    let header = keys.signature_header("msg_1", now, body);
    assert_eq!(header.split(' ').count(), 2);
    assert!(header.split(' ').all(|s| s.starts_with("v1,")));
    let ts = now.to_string();
    assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now), Ok(()));
    assert_eq!(verify(&prev, "msg_1", &ts, &header, body, now), Ok(()));
    assert_eq!(verify(&other, "msg_1", &ts, &header, body, now), Err(WebhookError::NoMatchingSignature));
    // Tampered body, id, timestamp.
    let mut tampered = body.to_vec();
    tampered[5] ^= 1;
    assert_eq!(verify(&cur, "msg_1", &ts, &header, &tampered, now), Err(WebhookError::NoMatchingSignature));
    assert_eq!(verify(&cur, "msg_2", &ts, &header, body, now), Err(WebhookError::NoMatchingSignature));
    let ts1 = (now + 1).to_string();
    assert_eq!(verify(&cur, "msg_1", &ts1, &header, body, now), Err(WebhookError::NoMatchingSignature));
    // A truncated or re-versioned signature does not pass.
    let only_cur = cur.sign("msg_1", now, body);
    assert!(verify(&cur, "msg_1", &ts, &only_cur[..only_cur.len() - 2], body, now).is_err());
    assert!(verify(&cur, "msg_1", &ts, &only_cur.replacen("v1,", "v2,", 1), body, now).is_err());
    // Timestamps: 5 minutes each way pass, more fails, junk fails.
    assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now + 300), Ok(()));
    assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now + 301), Err(WebhookError::TimestampTooOld));
    assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now - 301), Err(WebhookError::TimestampTooNew));
    assert_eq!(verify(&cur, "msg_1", "17e8", &header, body, now), Err(WebhookError::InvalidTimestamp));
    assert_eq!(verify(&cur, "", &ts, &header, body, now), Err(WebhookError::MissingHeader("webhook-id")));
    assert_eq!(verify(&cur, "msg_1", &ts, "", body, now), Err(WebhookError::MissingHeader("webhook-signature")));
}

// ---- An independent verifier: the Standard Webhooks Python library.

#[test]
fn the_standard_webhooks_python_library_verifies_our_signatures() {
    use std::io::Write;
    let python = crate::testkit::receiver::python_with_standardwebhooks().expect("the reference library");
    let (cur, cur_text) = WebhookSecret::generate();
    let (prev, prev_text) = WebhookSecret::generate();
    let (_, other_text) = WebhookSecret::generate();
    let rotating = SigningKeys::new(cur.clone(), Some(prev));
    let single = SigningKeys::parse_list(&cur_text).expect("one key");
    let now = now_secs();
    let bodies = [
        r#"{"id":"t1","status":"ready","code":"03AGdBq24PBCbwiDRaS_MJ7Z"}"#.to_owned(),
        r#"{"id":"t2","status":"failed","error":"ERROR_CAPTCHA_UNSOLVABLE"}"#.to_owned(),
        "{\"text\":\"résultat ✓ 文字\"}".to_owned(),
        String::new(),
        "line one\nline two\r\n\ttabbed".to_owned(),
        format!("{{\"big\":\"{}\"}}", "x".repeat(20_000)),
    ];
    let msg = |secret: &str, id: &str, ts: String, sig: String, body: &str| {
        serde_json::json!({
            "secret": secret,
            "headers": {"webhook-id": id, "webhook-timestamp": ts, "webhook-signature": sig},
            "body": body,
        })
    };
    // (input, expected ok)
    let mut cases: Vec<(serde_json::Value, bool)> = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        let id = format!("msg_{i}_{}", uuid::Uuid::new_v4().simple());
        let header = rotating.signature_header(&id, now, body.as_bytes());
        cases.push((msg(&cur_text, &id, now.to_string(), header.clone(), body), true));
        cases.push((msg(&prev_text, &id, now.to_string(), header.clone(), body), true));
        if i % 2 == 0 {
            cases.push((msg(&other_text, &id, now.to_string(), header, body), false));
        }
    }
    let body = &bodies[0];
    let sig = single.signature_header("msg_single", now, body.as_bytes());
    cases.push((msg(&cur_text, "msg_single", now.to_string(), sig.clone(), body), true));
    cases.push((msg(&prev_text, "msg_single", now.to_string(), sig.clone(), body), false));
    let tampered = body.replace("ready", "READY");
    cases.push((msg(&cur_text, "msg_single", now.to_string(), sig.clone(), &tampered), false));
    cases.push((msg(&cur_text, "msg_other", now.to_string(), sig.clone(), body), false));
    cases.push((msg(&cur_text, "msg_single", (now + 1).to_string(), sig, body), false));
    let old = now - 600;
    let old_sig = single.signature_header("msg_old", old, body.as_bytes());
    cases.push((msg(&cur_text, "msg_old", old.to_string(), old_sig, body), false));

    // Our own verify agrees with what the library must say.
    for (input, want) in &cases {
        let h = &input["headers"];
        let s = secret(input["secret"].as_str().expect("secret"));
        let got = verify(
            &s,
            h["webhook-id"].as_str().expect("id"),
            h["webhook-timestamp"].as_str().expect("ts"),
            h["webhook-signature"].as_str().expect("sig"),
            input["body"].as_str().expect("body").as_bytes(),
            now,
        );
        assert_eq!(got.is_ok(), *want, "our verify on {input}: {got:?}");
    }

    let mut child = std::process::Command::new(&python)
        .arg(crate::testkit::receiver::webhook_verify_script())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting tests/compat/webhook_verify.py");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        for (input, _) in &cases {
            writeln!(stdin, "{input}").expect("writing to the verifier");
        }
    }
    let out = child.wait_with_output().expect("the verifier's output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the verifier failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), cases.len(), "{stdout}");
    assert!(cases.len() >= 20, "{} cases", cases.len());
    for ((input, want), line) in cases.iter().zip(&lines) {
        if *want {
            assert_eq!(*line, "ok", "the library refused {input}");
        } else {
            assert!(line.starts_with("fail: "), "the library accepted {input}: {line}");
        }
    }
}
