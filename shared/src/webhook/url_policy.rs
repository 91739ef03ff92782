//! The owner-URL policy: which URLs a push may go to, checked statically (scheme, host, no
//! credentials) and, for every address a host names, whether it is a public unicast one.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The longest owner URL accepted, in bytes.
pub const MAX_URL_LEN: usize = 2048;

/// Where deliveries may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlPolicy {
    /// AWS: https only; the host must resolve only to public unicast addresses.
    PublicHttps,
    /// Local mode with an explicit setting: http or https, loopback addresses allowed too (other
    /// private ranges and metadata addresses still refused).
    AllowLoopback,
}

/// Why an owner URL is refused: a short, clear, loggable sentence (never contains credentials of
/// the URL, nor its path or query).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UrlRefused(pub String);

fn refused(why: impl Into<String>) -> UrlRefused {
    UrlRefused(why.into())
}

/// Static checks at submit time and again at send time: an absolute http(s) URL (https only
/// under `PublicHttps`), at most 2,048 bytes, with a host, no userinfo (`user:pass@`) and no
/// fragment. An IP-literal host (in any form the URL standard reads as one: `0x7f000001`,
/// `2130706433`, `127.1` all become 127.0.0.1) must pass [`addr_allowed`]; the names
/// `localhost`, `*.localhost`, `*.internal`, `*.local` and `metadata.google.internal` are refused,
/// except `localhost` and `*.localhost` under `AllowLoopback`. Names are not resolved here: the
/// sender's resolver checks every address at connect time. Returns the parsed URL.
pub fn check_url(url: &str, policy: UrlPolicy) -> Result<url::Url, UrlRefused> {
    if url.len() > MAX_URL_LEN {
        return Err(refused(format!("the URL is {} bytes long, over the {MAX_URL_LEN}-byte limit", url.len())));
    }
    // The parser's messages are fixed texts ("invalid port number"), never the input.
    let parsed = url::Url::parse(url).map_err(|e| refused(format!("not a valid absolute URL ({e})")))?;
    match (parsed.scheme(), policy) {
        ("https", _) | ("http", UrlPolicy::AllowLoopback) => {}
        ("http", UrlPolicy::PublicHttps) => return Err(refused("the URL must use https")),
        _ => return Err(refused("the URL must be http or https")),
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(refused("the URL must not carry a user name or password (user:pass@)"));
    }
    if parsed.fragment().is_some() {
        return Err(refused("the URL must not have a #fragment"));
    }
    match parsed.host() {
        None => return Err(refused("the URL has no host")),
        Some(url::Host::Ipv4(ip)) => check_ip_host(IpAddr::V4(ip), policy)?,
        Some(url::Host::Ipv6(ip)) => check_ip_host(IpAddr::V6(ip), policy)?,
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if name.is_empty() {
                return Err(refused("the URL has no host"));
            }
            let under = |suffix: &str| name == suffix || name.ends_with(&format!(".{suffix}"));
            if under("localhost") {
                if policy != UrlPolicy::AllowLoopback {
                    return Err(refused(format!("the host {name} is a loopback name")));
                }
            } else if name == "metadata.google.internal" {
                return Err(refused("the host is a cloud metadata service"));
            } else if under("internal") || under("local") {
                return Err(refused(format!("the host {name} is a private (.internal / .local) name")));
            }
        }
    }
    Ok(parsed)
}

fn check_ip_host(ip: IpAddr, policy: UrlPolicy) -> Result<(), UrlRefused> {
    if addr_allowed(ip, policy) {
        Ok(())
    } else {
        Err(refused(format!("the address {ip} is not a public unicast address")))
    }
}

/// Is this address one deliveries may connect to. Refuses 0.0.0.0/8 (incl. unspecified),
/// loopback 127/8 (unless `AllowLoopback`), private 10/8 172.16/12 192.168/16, CGNAT 100.64/10,
/// link-local 169.254/16 (incl. 169.254.169.254, the metadata service), 192.0.0/24, the 6to4
/// relay 192.88.99/24, benchmarking 198.18/15, the documentation ranges, multicast 224/4, reserved
/// 240/4 and broadcast. IPv6: only global unicast 2000::/3 is allowed, less documentation
/// (2001:db8::/32, 3fff::/20), Teredo 2001::/32, benchmarking 2001:2::/48 and ORCHID
/// 2001:10::/28, 2001:20::/28 — so ::, fc00::/7 (incl. fd00:ec2::254), fe80::/10, ff00::/8 and
/// 64:ff9b:1::/48 are refused, ::1 too unless `AllowLoopback`. v4-mapped, v4-translated,
/// v4-compatible, NAT64 64:ff9b::/96 and 6to4 2002::/16 addresses are judged as their IPv4.
pub fn addr_allowed(ip: IpAddr, policy: UrlPolicy) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_allowed(v4, policy),
        IpAddr::V6(v6) => v6_allowed(v6, policy),
    }
}

fn v4_allowed(ip: Ipv4Addr, policy: UrlPolicy) -> bool {
    let [a, b, c, _] = ip.octets();
    if a == 127 {
        return policy == UrlPolicy::AllowLoopback;
    }
    let refused = a == 0
        || a == 10
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && (c == 0 || c == 2))
        || (a == 192 && b == 88 && c == 99)
        || (a == 192 && b == 168)
        || (a == 198 && (b == 18 || b == 19))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        // Multicast 224/4, reserved 240/4 and the broadcast address.
        || a >= 224;
    !refused
}

fn v6_allowed(ip: Ipv6Addr, policy: UrlPolicy) -> bool {
    if ip.is_unspecified() {
        return false;
    }
    if ip.is_loopback() {
        return policy == UrlPolicy::AllowLoopback;
    }
    if let Some(v4) = embedded_v4(ip) {
        return v4_allowed(v4, policy);
    }
    let s = ip.segments();
    let global_unicast = (s[0] & 0xe000) == 0x2000;
    let special = (s[0] == 0x2001 && s[1] == 0x0db8)
        || (s[0] == 0x3fff && s[1] < 0x1000)
        || (s[0] == 0x2001 && s[1] == 0)
        || (s[0] == 0x2001 && s[1] == 2 && s[2] == 0)
        || (s[0] == 0x2001 && (s[1] & 0xfff0) == 0x0010)
        || (s[0] == 0x2001 && (s[1] & 0xfff0) == 0x0020);
    global_unicast && !special
}

/// The IPv4 address an IPv6 address stands for, where it stands for one.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        // v4-mapped ::ffff:a.b.c.d and v4-compatible ::a.b.c.d (:: and ::1 are handled before).
        [0, 0, 0, 0, 0, 0xffff | 0, _, _] => Some(low),
        // v4-translated ::ffff:0:a.b.c.d (SIIT).
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some(low),
        // NAT64, the well-known prefix 64:ff9b::/96.
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low),
        // 6to4 2002:AABB:CCDD::/48.
        [0x2002, hi, lo, ..] => Some(Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
