//! Addresses and URLs, allowed and refused under each policy.

use super::*;

#[test]
fn addresses_public_unicast_only() {
    use UrlPolicy::*;
    let cases: &[(&str, bool, bool)] = &[
        // (address, allowed under PublicHttps, allowed under AllowLoopback)
        ("93.184.215.14", true, true),
        ("8.8.8.8", true, true),
        ("1.1.1.1", true, true),
        ("127.0.0.1", false, true),
        ("127.255.0.9", false, true),
        ("0.0.0.0", false, false),
        ("0.1.2.3", false, false),
        ("10.0.0.1", false, false),
        ("172.16.0.1", false, false),
        ("172.31.255.255", false, false),
        ("172.32.0.1", true, true),
        ("192.168.1.1", false, false),
        ("100.64.0.1", false, false),
        ("100.127.255.254", false, false),
        ("100.128.0.1", true, true),
        ("169.254.169.254", false, false),
        ("169.254.0.1", false, false),
        ("192.0.0.170", false, false),
        ("192.0.2.1", false, false),
        ("198.18.0.1", false, false),
        ("198.19.255.1", false, false),
        ("198.51.100.7", false, false),
        ("203.0.113.9", false, false),
        ("224.0.0.1", false, false),
        ("239.255.255.250", false, false),
        ("240.0.0.1", false, false),
        ("255.255.255.255", false, false),
        ("2606:4700:4700::1111", true, true),
        ("2a00:1450:4001:81c::200e", true, true),
        ("::1", false, true),
        ("::", false, false),
        ("fc00::1", false, false),
        ("fd00:ec2::254", false, false),
        ("fe80::1", false, false),
        ("ff02::1", false, false),
        ("2001:db8::1", false, false),
        ("3fff::1", false, false),
        ("100::1", false, false),
        ("::ffff:127.0.0.1", false, true),
        ("::ffff:169.254.169.254", false, false),
        ("::ffff:10.1.2.3", false, false),
        ("::ffff:8.8.8.8", true, true),
        ("::127.0.0.1", false, true),
        ("::10.0.0.1", false, false),
        ("::ffff:0:a9fe:a9fe", false, false),
        ("64:ff9b::a9fe:a9fe", false, false),
        ("64:ff9b::7f00:1", false, true),
        ("64:ff9b::808:808", true, true),
        ("64:ff9b:1::1", false, false),
        ("2002:a9fe:a9fe::1", false, false),
        ("2002:0808:0808::1", true, true),
        ("2001::1", false, false),
    ];
    for (ip, public, lo) in cases {
        let addr: IpAddr = ip.parse().expect(ip);
        assert_eq!(addr_allowed(addr, PublicHttps), *public, "{ip} under PublicHttps");
        assert_eq!(addr_allowed(addr, AllowLoopback), *lo, "{ip} under AllowLoopback");
    }
}

#[test]
fn urls_checked_statically() {
    use UrlPolicy::*;
    let ok = |u: &str, p| check_url(u, p).map(|_| ()).map_err(|e| e.0);
    let cases: &[(&str, bool, bool)] = &[
        // (URL, accepted under PublicHttps, accepted under AllowLoopback)
        ("https://example.com/hook?token=abc", true, true),
        ("https://hooks.example.com:8443/a/b", true, true),
        ("https://93.184.215.14/hook", true, true),
        ("http://example.com/", false, true),
        ("ftp://example.com/", false, false),
        ("file:///etc/passwd", false, false),
        ("/relative/path", false, false),
        ("https://", false, false),
        ("https://user:pw@example.com/", false, false),
        ("https://user@example.com/", false, false),
        ("https://example.com/#frag", false, false),
        ("http://169.254.169.254/latest/meta-data", false, false),
        ("https://169.254.169.254/latest/meta-data", false, false),
        ("https://[::ffff:127.0.0.1]/", false, true),
        ("https://[::ffff:169.254.169.254]/", false, false),
        ("https://[fd00:ec2::254]/", false, false),
        ("https://[::1]:8080/", false, true),
        ("https://10.0.0.1/", false, false),
        ("https://192.168.0.10/", false, false),
        ("https://0x7f000001/", false, true),
        ("https://2130706433/", false, true),
        ("https://127.1/", false, true),
        ("https://0177.0.0.1/", false, true),
        ("https://0.0.0.0/", false, false),
        ("https://0/", false, false),
        ("https://localhost/", false, true),
        ("http://localhost:8080/hook", false, true),
        ("https://LOCALHOST./", false, true),
        ("https://app.localhost/", false, true),
        ("https://metadata.google.internal/computeMetadata/v1/", false, false),
        ("https://service.internal/", false, false),
        ("https://printer.local/", false, false),
        ("https://printer.local./", false, false),
    ];
    for (url, public, lo) in cases {
        assert_eq!(ok(url, PublicHttps).is_ok(), *public, "{url} under PublicHttps: {:?}", ok(url, PublicHttps));
        assert_eq!(ok(url, AllowLoopback).is_ok(), *lo, "{url} under AllowLoopback: {:?}", ok(url, AllowLoopback));
    }
    let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
    assert!(check_url(&long, PublicHttps).is_err());
    let just = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN - "https://example.com/".len()));
    assert!(check_url(&just, PublicHttps).is_ok());
    // The reason never carries credentials, the path or the query.
    for url in
        ["https://alice:hunter2@example.com/x", "http://example.com/p?token=s3cr3t", "https://10.0.0.1/p?token=s3cr3t"]
    {
        let why = check_url(url, PublicHttps).expect_err(url).0;
        for secret in ["alice", "hunter2", "s3cr3t", "/p"] {
            assert!(!why.contains(secret), "{why}");
        }
    }
    assert_eq!(check_url("https://0x7f000001/", AllowLoopback).expect("ok").host_str(), Some("127.0.0.1"));
}
