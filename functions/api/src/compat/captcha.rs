//! The captcha a v1 `in.php` request describes, by its `method` and 2captcha's parameter names.

use base64::Engine;
use relay_shared::captchaai::{Browser, MAX_IMAGE_BASE64, SubmitRequest};

use super::params::Params;

/// Largest image CaptchaAI takes (bytes, before base64).
pub const MAX_IMAGE_BYTES: usize = 100 * 1024;

fn flag(p: &Params, name: &str) -> bool {
    p.get(name).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn owned(p: &Params, name: &str) -> Option<String> {
    p.get(name).map(str::to_owned)
}

/// The captcha a v1 request describes; `Err((code, text))` otherwise.
pub(super) fn captcha(p: &Params) -> Result<SubmitRequest, (&'static str, String)> {
    let need = |name: &str, code: &'static str| -> Result<String, (&'static str, String)> {
        owned(p, name).ok_or((code, format!("`{name}` is required for method={}", p.get("method").unwrap_or(""))))
    };
    let browser = || Browser {
        user_agent: owned(p, "userAgent").or_else(|| owned(p, "useragent")),
        cookies: owned(p, "cookies"),
        proxy: owned(p, "proxy"),
        proxytype: owned(p, "proxytype"),
    };
    let score = |p: &Params| -> Result<Option<f32>, (&'static str, String)> {
        match p.get("min_score") {
            None => Ok(None),
            Some(v) => v
                .parse::<f32>()
                .map(Some)
                .map_err(|_| ("ERROR_BAD_PARAMETERS", "`min_score` must be a number such as 0.3".to_owned())),
        }
    };
    let method = p.get("method").ok_or(("ERROR_BAD_PARAMETERS", "`method` is required".to_owned()))?;
    let req = match method {
        "userrecaptcha" => {
            let sitekey = need("googlekey", "ERROR_GOOGLEKEY")?;
            let pageurl = need("pageurl", "ERROR_PAGEURL")?;
            let v3 = p.get("version").is_some_and(|v| v.eq_ignore_ascii_case("v3"));
            if flag(p, "enterprise") {
                SubmitRequest::RecaptchaEnterprise {
                    sitekey,
                    pageurl,
                    version: v3.then(|| "v3".to_owned()),
                    action: owned(p, "action"),
                    min_score: score(p)?,
                    data_s: owned(p, "data-s"),
                    browser: browser(),
                }
            } else if v3 {
                SubmitRequest::RecaptchaV3 {
                    sitekey,
                    pageurl,
                    action: owned(p, "action"),
                    min_score: score(p)?,
                    browser: browser(),
                }
            } else {
                SubmitRequest::RecaptchaV2 {
                    sitekey,
                    pageurl,
                    invisible: flag(p, "invisible"),
                    data_s: owned(p, "data-s"),
                    browser: browser(),
                }
            }
        }
        "hcaptcha" => SubmitRequest::Hcaptcha {
            sitekey: need("sitekey", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
        },
        "turnstile" => SubmitRequest::Turnstile {
            sitekey: need("sitekey", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
            action: owned(p, "action"),
            data: owned(p, "data"),
        },
        "base64" | "post" => {
            let body = if method == "post" {
                let bytes = p.file.as_deref().unwrap_or_default();
                if bytes.is_empty() {
                    return Err(("ERROR_ZERO_CAPTCHA_FILESIZE", "the `file` part is missing or empty".into()));
                }
                if bytes.len() > MAX_IMAGE_BYTES {
                    return Err((
                        "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
                        format!("the image is over {MAX_IMAGE_BYTES} bytes"),
                    ));
                }
                base64::engine::general_purpose::STANDARD.encode(bytes)
            } else {
                // A `+` sent unescaped in a form arrives as a space.
                let b = p.get("body").unwrap_or("").replace(' ', "+");
                if b.is_empty() {
                    return Err((
                        "ERROR_ZERO_CAPTCHA_FILESIZE",
                        "`body` (the base64 image) is missing or empty".into(),
                    ));
                }
                if b.len() > MAX_IMAGE_BASE64 {
                    return Err((
                        "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
                        format!("the image is over {MAX_IMAGE_BYTES} bytes"),
                    ));
                }
                b
            };
            let hints = relay_shared::captchaai::IMAGE_HINTS
                .iter()
                .filter_map(|k| p.get(k).map(|v| ((*k).to_owned(), v.to_owned())))
                .collect();
            SubmitRequest::Image { body, hints }
        }
        "geetest" => SubmitRequest::Geetest {
            gt: need("gt", "ERROR_BAD_PARAMETERS")?,
            challenge: need("challenge", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
            api_server: owned(p, "api_server").or_else(|| owned(p, "apiServer")),
            browser: browser(),
        },
        "cloudflare_challenge" => {
            SubmitRequest::CloudflareChallenge { pageurl: need("pageurl", "ERROR_PAGEURL")?, browser: browser() }
        }
        "bls" => SubmitRequest::Bls {
            instructions: need("instructions", "ERROR_BAD_PARAMETERS")?,
            images: relay_shared::captchaai::BLS_FIELDS
                .iter()
                .map(|f| need(f, "ERROR_BAD_PARAMETERS").map(|v| v.replace(' ', "+")))
                .collect::<Result<_, _>>()?,
        },
        other => {
            return Err((
                "ERROR_BAD_PARAMETERS",
                format!(
                    "method `{other}` is not supported by the relay (userrecaptcha, turnstile, geetest, \
                     cloudflare_challenge, bls, base64, post; hcaptcha where the upstream solves it)"
                ),
            ));
        }
    };
    req.validate().map_err(|e| {
        let code = if e.0.contains("pageurl") { "ERROR_PAGEURL" } else { "ERROR_BAD_PARAMETERS" };
        (code, e.0)
    })?;
    Ok(req)
}
