//! Building in.php's form from a [`SubmitRequest`]: the method and the fields CaptchaAI reads
//! for each kind of captcha.

use super::request::{BLS_FIELDS, Browser, IMAGE_HINTS, SubmitRequest};

impl SubmitRequest {
    /// The in.php form fields for this captcha (without key, json and pingback).
    pub fn form_fields(&self) -> Vec<(&'static str, String)> {
        let mut f: Vec<(&'static str, String)> = Vec::new();
        let push_opt = |f: &mut Vec<(&'static str, String)>, k: &'static str, v: &Option<String>| {
            if let Some(v) = v {
                f.push((k, v.clone()));
            }
        };
        let browser = |f: &mut Vec<(&'static str, String)>, b: &Browser| {
            for (k, v) in [
                ("userAgent", &b.user_agent),
                ("cookies", &b.cookies),
                ("proxy", &b.proxy),
                ("proxytype", &b.proxytype),
            ] {
                if let Some(v) = v {
                    f.push((k, v.clone()));
                }
            }
        };
        match self {
            Self::RecaptchaV2 { sitekey, pageurl, invisible, data_s, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                if *invisible {
                    f.push(("invisible", "1".into()));
                }
                push_opt(&mut f, "data-s", data_s);
                browser(&mut f, b);
            }
            Self::RecaptchaV3 { sitekey, pageurl, action, min_score, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("version", "v3".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "min_score", &min_score.map(|s| s.to_string()));
                browser(&mut f, b);
            }
            Self::RecaptchaEnterprise { sitekey, pageurl, version, action, min_score, data_s, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("enterprise", "1".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "version", version);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "min_score", &min_score.map(|s| s.to_string()));
                push_opt(&mut f, "data-s", data_s);
                browser(&mut f, b);
            }
            Self::Hcaptcha { sitekey, pageurl } => {
                f.extend([("method", "hcaptcha".into()), ("sitekey", sitekey.clone()), ("pageurl", pageurl.clone())]);
            }
            Self::Turnstile { sitekey, pageurl, action, data } => {
                f.extend([("method", "turnstile".into()), ("sitekey", sitekey.clone()), ("pageurl", pageurl.clone())]);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "data", data);
            }
            Self::Image { body, hints } => {
                f.extend([("method", "base64".into()), ("body", body.clone())]);
                for (k, v) in hints {
                    if let Some(name) = IMAGE_HINTS.iter().find(|h| **h == k.as_str()) {
                        f.push((name, v.clone()));
                    }
                }
            }
            Self::Geetest { gt, challenge, pageurl, api_server, browser: b } => {
                f.extend([
                    ("method", "geetest".into()),
                    ("gt", gt.clone()),
                    ("challenge", challenge.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "api_server", api_server);
                browser(&mut f, b);
            }
            Self::CloudflareChallenge { pageurl, browser: b } => {
                f.extend([("method", "cloudflare_challenge".into()), ("pageurl", pageurl.clone())]);
                browser(&mut f, b);
            }
            Self::Bls { instructions, images } => {
                f.extend([("method", "bls".into()), ("instructions", instructions.clone())]);
                for (name, image) in BLS_FIELDS.iter().zip(images) {
                    f.push((name, image.clone()));
                }
            }
        }
        f
    }
}
