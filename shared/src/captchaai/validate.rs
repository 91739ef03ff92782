//! Checking a [`SubmitRequest`] for what CaptchaAI would refuse anyway, so the caller hears it
//! at once.

use super::request::{BLS_CELLS, IMAGE_HINTS, MAX_BLS_CELL, MAX_IMAGE_BASE64, SubmitRequest};
use crate::domain::ParseError;

fn check_base64(field: &str, v: &str, max: usize) -> Result<(), ParseError> {
    check_text(field, v, max)?;
    // A data URI's prefix (`data:image/png;base64,`) is kept: CaptchaAI's BLS takes it.
    let data = v.split_once(";base64,").map_or(v, |(_, d)| d);
    if !data.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=' | b'\n' | b'\r')) {
        return Err(ParseError(format!("`{field}` must be base64")));
    }
    Ok(())
}

fn check_text(field: &str, v: &str, max: usize) -> Result<(), ParseError> {
    if v.trim().is_empty() {
        return Err(ParseError(format!("`{field}` must not be empty")));
    }
    if v.len() > max {
        return Err(ParseError(format!("`{field}` is longer than {max} bytes")));
    }
    if v.chars().any(char::is_control) {
        return Err(ParseError(format!("`{field}` contains control characters")));
    }
    Ok(())
}

fn check_pageurl(v: &str) -> Result<(), ParseError> {
    check_text("pageurl", v, 2048)?;
    if !(v.starts_with("https://") || v.starts_with("http://")) {
        return Err(ParseError("`pageurl` must be an http(s) URL".into()));
    }
    Ok(())
}

fn check_score(v: Option<f32>) -> Result<(), ParseError> {
    match v {
        Some(s) if !(0.1..=0.9).contains(&s) => Err(ParseError("`min_score` must be between 0.1 and 0.9".into())),
        _ => Ok(()),
    }
}

impl SubmitRequest {
    /// Checks what CaptchaAI would refuse anyway, so the caller hears it at once.
    pub fn validate(&self) -> Result<(), ParseError> {
        match self {
            Self::RecaptchaV2 { sitekey, pageurl, .. } | Self::Hcaptcha { sitekey, pageurl } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)
            }
            Self::RecaptchaV3 { sitekey, pageurl, min_score, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)?;
                check_score(*min_score)
            }
            Self::RecaptchaEnterprise { sitekey, pageurl, version, min_score, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)?;
                check_score(*min_score)?;
                match version.as_deref() {
                    None | Some("v2" | "v3") => Ok(()),
                    Some(_) => Err(ParseError("`version` must be `v2` or `v3`".into())),
                }
            }
            Self::Turnstile { sitekey, pageurl, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)
            }
            Self::Image { body, hints } => {
                for (k, v) in hints {
                    if !IMAGE_HINTS.contains(&k.as_str()) {
                        return Err(ParseError(format!("image hint `{k}` is not one of {}", IMAGE_HINTS.join(", "))));
                    }
                    check_text(k, v, 256)?;
                }
                check_base64("body", body, MAX_IMAGE_BASE64)
            }
            Self::Geetest { gt, challenge, pageurl, api_server, .. } => {
                check_text("gt", gt, 256)?;
                check_text("challenge", challenge, 256)?;
                if let Some(a) = api_server {
                    check_text("api_server", a, 256)?;
                }
                check_pageurl(pageurl)
            }
            Self::CloudflareChallenge { pageurl, browser } => {
                check_pageurl(pageurl)?;
                match (&browser.proxy, &browser.proxytype) {
                    (Some(p), Some(t)) => {
                        check_text("proxy", p, 512)?;
                        check_text("proxytype", t, 16)
                    }
                    _ => Err(ParseError(
                        "`proxy` and `proxytype` are required: CaptchaAI solves a Cloudflare challenge through your proxy"
                            .into(),
                    )),
                }
            }
            Self::Bls { instructions, images } => {
                check_text("instructions", instructions, 256)?;
                if images.len() != BLS_CELLS {
                    return Err(ParseError(format!(
                        "`images` must be the grid's {BLS_CELLS} cells, got {}",
                        images.len()
                    )));
                }
                images.iter().try_for_each(|i| check_base64("images", i, MAX_BLS_CELL))
            }
        }
    }
}
