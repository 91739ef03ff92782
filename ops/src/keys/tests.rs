//! Tests of the relay-key commands against the embedded DynamoDB engine.

use std::time::Duration;

use relay_shared::testkit::LocalDynamo;
use relay_shared::time::Timestamp;
use secrecy::ExposeSecret;

use super::{self as keys, KeysError};

const T0: Timestamp = Timestamp::from_millis(1_796_210_146_000);

#[tokio::test]
async fn keys_are_created_listed_without_the_key_and_revoked() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    assert!(keys::list(&store).await?.is_empty());

    let get = relay_shared::domain::PingbackForm::Get;
    let a = keys::create(&store, "scraper", get, T0).await?;
    let b = keys::create(&store, "scraper", get, T0.plus(Duration::from_secs(1))).await?;
    let c =
        keys::create(&store, "ci", relay_shared::domain::PingbackForm::Post, T0.plus(Duration::from_secs(2))).await?;
    let key = a.key.expose_secret();
    assert_eq!(key.len(), 32);
    assert!(key.bytes().all(|x| x.is_ascii_hexdigit()));
    assert_eq!(a.digest.len(), 64);
    assert!(!a.hint("scraper").contains(key), "the hint never repeats the key");
    assert!(a.hint("scraper").contains(&a.digest[..keys::SHOWN_DIGITS]));

    let rows = keys::list(&store).await?;
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].name, "scraper");
    assert_eq!(rows[0].digest_prefix, a.digest[..keys::SHOWN_DIGITS]);
    assert_eq!(rows[0].created_at, Some(T0));
    assert!(rows.iter().all(|r| r.revoked_at.is_none()));
    let table = keys::render_table(&rows);
    let json = keys::render_json(&rows).to_string();
    for shown in [&table, &json] {
        for k in [&a, &b, &c] {
            assert!(!shown.contains(k.key.expose_secret()), "a key was shown: {shown}");
            assert!(!shown.contains(&k.digest), "a whole digest was shown: {shown}");
            assert!(shown.contains(&k.digest[..keys::SHOWN_DIGITS]));
        }
    }
    assert!(table.starts_with("NAME"));
    assert_eq!(table.lines().count(), 4);
    assert!(table.contains("2026-12-02T11:15:46.000Z"), "{table}");
    assert_eq!(keys::render_json(&rows)[2]["name"], "ci");
    assert_eq!(keys::render_json(&rows)[2]["pingback"], "post", "a key for 2captcha code");
    assert_eq!(keys::render_json(&rows)[0]["pingback"], "get", "CaptchaAI's form by default");
    assert_eq!(keys::render_json(&rows)[0]["live"], true);
    assert_eq!(keys::render_json(&rows)[0]["revoked_at"], serde_json::Value::Null);

    // Rotation: revoke only `a`, by its digest prefix (upper case is fine); `b` stays live.
    let t1 = T0.plus(Duration::from_secs(60));
    let prefix = a.digest[..keys::MIN_PREFIX].to_ascii_uppercase();
    assert_eq!(keys::revoke(&store, "scraper", Some(&prefix), t1).await?, 1);
    let rows = keys::list(&store).await?;
    assert_eq!(rows[0].revoked_at, Some(t1));
    assert_eq!(rows[1].revoked_at, None);
    assert_eq!(keys::render_json(&rows)[0]["live"], false);
    assert!(keys::render_table(&rows).contains("2026-12-02T11:16:46.000Z"));
    // Revoking it again: nothing live matches.
    let again = keys::revoke(&store, "scraper", Some(&prefix), t1).await;
    assert!(matches!(&again, Err(KeysError::NoneMatched(m)) if m.contains("digest starting with")), "{again:?}");

    // By name: the remaining live `scraper` key, not `ci`.
    assert_eq!(keys::revoke(&store, "scraper", None, t1).await?, 1);
    let all_revoked = keys::revoke(&store, "scraper", None, t1).await;
    assert!(matches!(&all_revoked, Err(KeysError::NoneMatched(m)) if m.contains("already revoked")));
    let rows = keys::list(&store).await?;
    assert!(rows.iter().filter(|r| r.name == "scraper").all(|r| r.revoked_at.is_some()));
    assert!(rows.iter().any(|r| r.name == "ci" && r.revoked_at.is_none()));

    // Unknown names and bad arguments are errors that revoke nothing.
    let unknown = keys::revoke(&store, "nobody", None, t1).await;
    assert!(matches!(&unknown, Err(KeysError::NoneMatched(m)) if m.contains("no relay key is named `nobody`")));
    let wrong_name = keys::revoke(&store, "scraper", Some(&c.digest[..8]), t1).await;
    assert!(matches!(wrong_name, Err(KeysError::NoneMatched(_))), "`ci`'s digest under another name");
    for bad in ["abc12", "not-hex", "", &"a".repeat(65)] {
        assert!(matches!(keys::revoke(&store, "ci", Some(bad), t1).await, Err(KeysError::BadPrefix(_))), "{bad}");
    }
    assert!(matches!(keys::create(&store, "bad name", get, T0).await, Err(KeysError::BadName(_))));
    assert!(matches!(keys::create(&store, "", get, T0).await, Err(KeysError::BadName(_))));
    assert_eq!(keys::set_pingback(&store, "ci", get).await?, 1);
    assert_eq!(keys::render_json(&keys::list(&store).await?)[2]["pingback"], "get");
    assert!(matches!(keys::set_pingback(&store, "scraper", get).await, Err(KeysError::NoneMatched(_))), "all revoked");
    assert!(keys::list(&store).await?.iter().any(|r| r.name == "ci" && r.revoked_at.is_none()), "ci untouched");
    Ok(())
}

#[tokio::test]
async fn a_prefix_shared_by_two_live_keys_revokes_neither() -> anyhow::Result<()> {
    use aws_sdk_dynamodb::types::AttributeValue;
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    // Two digests sharing their first 8 digits (random keys would almost never), stored the
    // way `create_relay_key` stores them.
    for (digest, at) in [("0123abcd".to_owned() + &"1".repeat(56), 1u64), ("0123abcd".to_owned() + &"2".repeat(56), 2)]
    {
        db.client()
            .put_item()
            .table_name(store.table())
            .item("pk", AttributeValue::S(format!("relaykey#{digest}")))
            .item("key_name", AttributeValue::S("fleet".into()))
            .item("created_at", AttributeValue::N(at.to_string()))
            .send()
            .await?;
    }
    let r = keys::revoke(&store, "fleet", Some("0123abcd"), T0).await;
    assert!(matches!(&r, Err(KeysError::Ambiguous { digests, .. }) if digests.len() == 2), "{r:?}");
    assert!(r.map_err(|e| e.to_string()).err().is_some_and(|m| m.contains("give more digits")));
    assert!(keys::list(&store).await?.iter().all(|k| k.revoked_at.is_none()), "neither was revoked");
    assert_eq!(keys::revoke(&store, "fleet", Some("0123ABCD1"), T0).await?, 1);
    let rows = keys::list(&store).await?;
    assert_eq!(rows.iter().filter(|k| k.revoked_at.is_some()).count(), 1);
    assert_eq!(rows[0].revoked_at, Some(T0), "the one whose digest starts 0123abcd1");
    Ok(())
}
