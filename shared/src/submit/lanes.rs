//! The submit queue's lanes and the order they are served in.
//!
//! Every owner (a relay key for the 2captcha-compatible routes, the caller of `POST /tasks`) has
//! two lanes: one for the captchas that give a token (reCAPTCHA, hCaptcha, Turnstile, GeeTest, a
//! Cloudflare challenge) and one for images (BLS's grids too). Within a lane, oldest first. Across lanes:
//! - owners take turns, one task each (round robin in a stable order), so one owner's burst
//!   cannot starve another's: each gets an equal share of the threads while both wait;
//! - within an owner, while both of its lanes wait, two of every three of its turns go to the
//!   token lane: a token task never waits behind more than one image of its owner per release
//!   of its own, however long the image backlog, and images still move at a third of the
//!   owner's share (never starved).

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

use crate::domain::CaptchaKind;

/// The class of lane a kind waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LaneClass {
    /// Captchas answered with a token.
    Token,
    Image,
}

impl LaneClass {
    pub fn of(kind: CaptchaKind) -> Self {
        match kind {
            CaptchaKind::Image | CaptchaKind::Bls => Self::Image,
            _ => Self::Token,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Self::Token => "t",
            Self::Image => "i",
        }
    }
}

/// A lane's name: `<owner digest>.<t|i>` (16 hex digits of the owner's SHA-256: owners are IAM
/// ARNs or key names, and the name is an attribute name in the table).
pub fn lane_id(owner: &str, kind: CaptchaKind) -> String {
    let digest = hex::encode(Sha256::digest(owner.as_bytes()));
    format!("{}.{}", &digest[..16], LaneClass::of(kind).suffix())
}

/// The owner part and the class of a lane's name; `None` if it is not one.
pub fn parse_lane(lane: &str) -> Option<(&str, LaneClass)> {
    let (owner, class) = lane.split_once('.')?;
    if owner.len() != 16 || !owner.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match class {
        "t" => Some((owner, LaneClass::Token)),
        "i" => Some((owner, LaneClass::Image)),
        _ => None,
    }
}

/// Picks the lane the next release comes from (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Fair {
    /// The owner served last.
    last: Option<String>,
    /// Turns each owner has had while both its lanes waited.
    turns: BTreeMap<String, u32>,
}

impl Fair {
    /// The lane to serve next among `waiting` (lanes with tasks); `None` if none waits.
    pub fn next(&mut self, waiting: &BTreeSet<String>) -> Option<String> {
        let mut owners: BTreeMap<&str, (bool, bool)> = BTreeMap::new();
        for lane in waiting {
            if let Some((owner, class)) = parse_lane(lane) {
                let e = owners.entry(owner).or_default();
                match class {
                    LaneClass::Token => e.0 = true,
                    LaneClass::Image => e.1 = true,
                }
            }
        }
        // The first owner after the last one served, in a stable order.
        let owner = match &self.last {
            Some(last) => owners
                .range::<str, _>((std::ops::Bound::Excluded(last.as_str()), std::ops::Bound::Unbounded))
                .next()
                .or_else(|| owners.iter().next()),
            None => owners.iter().next(),
        };
        let (owner, (token, image)) = owner.map(|(o, c)| ((*o).to_owned(), *c))?;
        let class = match (token, image) {
            (true, true) => {
                let turn = self.turns.entry(owner.clone()).or_default();
                *turn += 1;
                if turn.is_multiple_of(3) { LaneClass::Image } else { LaneClass::Token }
            }
            (true, false) => LaneClass::Token,
            _ => LaneClass::Image,
        };
        self.last = Some(owner.clone());
        if self.turns.len() > 10_000 {
            self.turns.retain(|o, _| owners.contains_key(o.as_str()));
        }
        Some(format!("{owner}.{}", class.suffix()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_per_owner_and_class_and_parse_back() {
        let a = lane_id("alice", CaptchaKind::Turnstile);
        assert_eq!(a, lane_id("alice", CaptchaKind::RecaptchaV2), "every token kind shares one lane");
        assert_ne!(a, lane_id("alice", CaptchaKind::Image));
        assert_ne!(a, lane_id("bob", CaptchaKind::Turnstile));
        assert_eq!(parse_lane(&a).map(|(_, c)| c), Some(LaneClass::Token));
        for bad in ["", "abc.t", "0123456789abcdef.x", "0123456789abcdeg.t", "0123456789abcdef"] {
            assert_eq!(parse_lane(bad), None, "{bad}");
        }
    }

    /// Serves `n` releases from `depths` (lane → tasks waiting); how many each lane got.
    fn serve(depths: &[(String, u32)], n: u32) -> BTreeMap<String, u32> {
        let mut left: BTreeMap<String, u32> = depths.iter().cloned().collect();
        let mut got = BTreeMap::new();
        let mut fair = Fair::default();
        for _ in 0..n {
            let waiting: BTreeSet<String> = left.iter().filter(|(_, d)| **d > 0).map(|(l, _)| l.clone()).collect();
            let Some(lane) = fair.next(&waiting) else { break };
            *left.get_mut(&lane).expect("a waiting lane") -= 1;
            *got.entry(lane).or_default() += 1;
        }
        got
    }

    #[test]
    fn owners_share_the_releases_equally_whatever_their_backlog() {
        let (a, b, c) = (
            lane_id("burst", CaptchaKind::Turnstile),
            lane_id("steady", CaptchaKind::Turnstile),
            lane_id("small", CaptchaKind::Turnstile),
        );
        let got = serve(&[(a.clone(), 10_000), (b.clone(), 500), (c.clone(), 5)], 300);
        assert_eq!(got[&c], 5, "the small owner is served within its first turns");
        assert!(got[&a].abs_diff(got[&b]) <= 1, "{got:?}");
    }

    #[test]
    fn tokens_are_not_held_behind_an_image_backlog_and_images_still_move() {
        let (t, i) = (lane_id("o", CaptchaKind::RecaptchaV2), lane_id("o", CaptchaKind::Image));
        let got = serve(&[(i.clone(), 10_000), (t.clone(), 100)], 150);
        assert_eq!(got[&t], 100, "{got:?}");
        assert_eq!(got[&i], 50, "a third while tokens wait, then all: {got:?}");
        let got = serve(&[(i.clone(), 10_000), (t.clone(), 10_000)], 300);
        assert_eq!((got[&t], got[&i]), (200, 100));
    }
}
