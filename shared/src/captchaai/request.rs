//! What a captcha to solve is: [`SubmitRequest`] as the owner describes it in `POST /tasks`,
//! its browser context, and the limits its fields are held to.

use serde::{Deserialize, Serialize};

use crate::domain::CaptchaKind;

/// A captcha to solve, as the owner describes it in `POST /tasks`. Serialised as the same JSON
/// when it waits in the submit queue.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SubmitRequest {
    RecaptchaV2 {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        invisible: bool,
        #[serde(default)]
        data_s: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    RecaptchaV3 {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        min_score: Option<f32>,
        #[serde(default)]
        browser: Browser,
    },
    RecaptchaEnterprise {
        sitekey: String,
        pageurl: String,
        /// `v3` for an Enterprise v3 key; v2 otherwise.
        #[serde(default)]
        version: Option<String>,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        min_score: Option<f32>,
        #[serde(default)]
        data_s: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    Hcaptcha {
        sitekey: String,
        pageurl: String,
    },
    Turnstile {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        data: Option<String>,
    },
    /// A base64-encoded image, with optional hints for the solver (`numeric`, `min_len`, …:
    /// [`IMAGE_HINTS`]), forwarded as they are.
    Image {
        body: String,
        #[serde(default)]
        hints: std::collections::BTreeMap<String, String>,
    },
    /// GeeTest v3 (`method=geetest`): the page's `gt` and a fresh `challenge`.
    Geetest {
        gt: String,
        challenge: String,
        pageurl: String,
        #[serde(default)]
        api_server: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    /// Cloudflare's challenge page (`method=cloudflare_challenge`): solved through the owner's
    /// proxy (`browser.proxy` and `browser.proxytype` are required); the clearance comes with
    /// the user agent it was earned with.
    CloudflareChallenge {
        pageurl: String,
        #[serde(default)]
        browser: Browser,
    },
    /// BLS (`method=bls`): the instruction's code and the grid's nine images (base64, or
    /// `data:image/…;base64,` URIs), in reading order.
    Bls {
        instructions: String,
        images: Vec<String>,
    },
}

/// Optional browser context for reCAPTCHA (`"browser": {...}` in the request).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Browser {
    #[serde(default)]
    pub user_agent: Option<String>,
    #[serde(default)]
    pub cookies: Option<String>,
    #[serde(default)]
    pub proxy: Option<String>,
    #[serde(default)]
    pub proxytype: Option<String>,
}

/// The in.php hints an image task may carry.
pub const IMAGE_HINTS: [&str; 10] =
    ["phrase", "regsense", "numeric", "calc", "min_len", "max_len", "language", "lang", "textinstructions", "case"];

/// Largest base64 image accepted (CaptchaAI refuses images over 100 KiB; base64 adds a third).
pub const MAX_IMAGE_BASE64: usize = 140 * 1024;
/// A BLS grid's cells: nine images.
pub const BLS_CELLS: usize = 9;
/// The in.php fields of a BLS grid's cells, in reading order.
pub const BLS_FIELDS: [&str; BLS_CELLS] = [
    "image_base64_1",
    "image_base64_2",
    "image_base64_3",
    "image_base64_4",
    "image_base64_5",
    "image_base64_6",
    "image_base64_7",
    "image_base64_8",
    "image_base64_9",
];
/// Largest BLS cell accepted (its tiles are a few KiB; nine must fit a task item's 400 KB).
pub const MAX_BLS_CELL: usize = 32 * 1024;

impl SubmitRequest {
    pub fn kind(&self) -> CaptchaKind {
        match self {
            Self::RecaptchaV2 { .. } => CaptchaKind::RecaptchaV2,
            Self::RecaptchaV3 { .. } => CaptchaKind::RecaptchaV3,
            Self::RecaptchaEnterprise { .. } => CaptchaKind::RecaptchaEnterprise,
            Self::Hcaptcha { .. } => CaptchaKind::Hcaptcha,
            Self::Turnstile { .. } => CaptchaKind::Turnstile,
            Self::Image { .. } => CaptchaKind::Image,
            Self::Geetest { .. } => CaptchaKind::Geetest,
            Self::CloudflareChallenge { .. } => CaptchaKind::CloudflareChallenge,
            Self::Bls { .. } => CaptchaKind::Bls,
        }
    }

    /// The user agent the owner asked CaptchaAI to solve with, if any: the one a solution that
    /// names none was earned with.
    pub fn user_agent(&self) -> Option<&str> {
        match self {
            Self::RecaptchaV2 { browser, .. }
            | Self::RecaptchaV3 { browser, .. }
            | Self::RecaptchaEnterprise { browser, .. }
            | Self::Geetest { browser, .. }
            | Self::CloudflareChallenge { browser, .. } => browser.user_agent.as_deref(),
            _ => None,
        }
    }
}
