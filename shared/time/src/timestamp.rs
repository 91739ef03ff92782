//! [`Timestamp`]: a point in wall-clock time as milliseconds since the Unix epoch, its
//! saturating arithmetic and its RFC 3339 form.

use std::fmt;
use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A point in time, milliseconds since the Unix epoch.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub(crate) u64);

impl Timestamp {
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    pub const fn as_millis(self) -> u64 {
        self.0
    }

    pub const fn as_secs(self) -> u64 {
        self.0 / 1000
    }

    #[must_use]
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    #[must_use]
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// RFC 3339 in UTC with millisecond precision, e.g. `2026-12-02T11:15:46.123Z`.
    /// Parses what [`Self::to_rfc3339`] writes (any RFC 3339 time in UTC); `None` if it is not one.
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        let t = humantime::parse_rfc3339(text).ok()?;
        let ms = t.duration_since(UNIX_EPOCH).ok()?.as_millis();
        u64::try_from(ms).ok().map(Self)
    }

    pub fn to_rfc3339(self) -> String {
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(self.0)).to_string()
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_rfc3339())
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}
