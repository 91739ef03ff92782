//! A model of DynamoDB's per-partition limits in front of the embedded engine.
//!
//! [`PartitionMeter`] is an HTTP proxy on loopback between the relay's DynamoDB clients and the
//! engine (as `FlakyDynamo` is): the relay's SDK calls reach it byte for byte. Keyed by the
//! **simulated** second, it counts what DynamoDB would bill and where:
//!
//! - write units per partition key: the table's `pk` for every write (1 WCU per started KB of
//!   the larger of the item's old and new image; a failed conditional write costs the same), and,
//!   for each global secondary index (read from `DescribeTable`), the index partition(s) the
//!   write touched: the old entry's key when the item leaves the index or changes key, the new
//!   entry's when it is in the index after the write (an entry that stays under the same key
//!   costs one write when a projected attribute changed, none otherwise). The images are
//!   learned, not guessed: after each successful write the meter reads the item back from the
//!   engine (a consistent `GetItem` it does not count) and keeps its size and index entries;
//! - read units per partition key: `GetItem` per `pk` (4 KB units, half for eventually
//!   consistent reads), `Query` per table or index hash key value, `Scan`s counted apart;
//! - DynamoDB's limits: 1,000 WCU/s and 3,000 RCU/s per partition key, the table's and each
//!   index's. A request that touches a key already at its limit in this simulated second is
//!   answered as DynamoDB answers it: HTTP 400 `ProvisionedThroughputExceededException` (in the
//!   SDK's list of throttling errors, so it backs off and retries), with the reason
//!   (`TableWriteKeyRangeThroughputExceeded`, `IndexWriteKeyRangeThroughputExceeded`…). A write
//!   whose index key is at its limit is refused too: GSI back-pressure.
//!
//! The admission check is made before the write against the keys it is known or seen to touch:
//! the item's `pk`, its current index entries, and the new index keys the request names (a
//! `PutItem`'s item, or an `UpdateItem`'s `SET <index hash> = :value`); the units are charged after
//! the write from the images. DynamoDB adapts partitions with a little burst capacity; this model
//! has none, so it is slightly stricter than the service.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use relay_time::Clock;
use serde_json::Value;

/// DynamoDB's write limit per partition key (table or index), units per second.
pub const WCU_PER_KEY: f64 = 1_000.0;
/// DynamoDB's read limit per partition key, units per second.
pub const RCU_PER_KEY: f64 = 3_000.0;

/// A partition key: the table's (`index` is `None`) or an index's hash key value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartKey {
    pub index: Option<String>,
    pub value: String,
}

impl fmt::Display for PartKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.index {
            None => write!(f, "table pk={}", self.value),
            Some(i) => write!(f, "{i} key={}", self.value),
        }
    }
}

impl PartKey {
    fn table(value: &str) -> Self {
        Self { index: None, value: value.to_owned() }
    }

    fn index(index: &str, value: &str) -> Self {
        Self { index: Some(index.to_owned()), value: value.to_owned() }
    }

    /// The key with item-specific parts folded, so a report can group "every task's item"
    /// apart from the hot singletons: `task#…` for task references, digits for the pacer's
    /// second.
    pub fn family(&self) -> String {
        let v = &self.value;
        let folded = match v.split_once('#') {
            Some((head, _)) => format!("{head}#…"),
            None if v.len() > 16 => "<task ref>".to_owned(),
            None => v.clone(),
        };
        match &self.index {
            None => format!("table pk={folded}"),
            Some(i) => format!("{i} key={}", self.value),
        }
    }
}

/// The peak use of one key in one simulated second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Peak {
    pub units: f64,
    /// The simulated second (ms since the epoch / 1000).
    pub second: u64,
}

/// What the meter counted.
#[derive(Debug, Clone, Default)]
pub struct MeterReport {
    /// Peak write units per key in one second.
    pub max_wcu: HashMap<PartKey, Peak>,
    /// Peak read units per key in one second.
    pub max_rcu: HashMap<PartKey, Peak>,
    /// Requests refused with a throttling error, by the key that was at its limit.
    pub throttled: HashMap<PartKey, u64>,
    /// Of those, the ones refused at DynamoDB's own limits (outside a cut): keys over their
    /// limit under the load itself.
    pub throttled_at_full_limits: HashMap<PartKey, u64>,
    /// Who writes the shared keys (every key but the tasks' own items): requests by operation
    /// and update expression (the code path), per key.
    pub writers: HashMap<PartKey, BTreeMap<String, u64>>,
    /// Requests by operation and target (`UpdateItem table`, `Query due-for-poll`…), throttled
    /// ones included (the SDK sends them again).
    pub ops: BTreeMap<String, u64>,
    /// Write and read units in all.
    pub wcu: f64,
    pub rcu: f64,
    /// Index write units in all (part of `wcu`).
    pub index_wcu: f64,
    pub scans: u64,
}

impl MeterReport {
    /// The key with the highest write units in one second.
    pub fn hottest_write(&self) -> Option<(&PartKey, Peak)> {
        self.max_wcu.iter().max_by(|a, b| a.1.units.total_cmp(&b.1.units)).map(|(k, p)| (k, *p))
    }

    pub fn hottest_read(&self) -> Option<(&PartKey, Peak)> {
        self.max_rcu.iter().max_by(|a, b| a.1.units.total_cmp(&b.1.units)).map(|(k, p)| (k, *p))
    }

    /// Keys whose use in some second exceeded the limit (only possible for units charged after
    /// admission, e.g. one request larger than what was left) or that were throttled.
    pub fn keys_over_limit(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (k, n) in &self.throttled_at_full_limits {
            out.push(format!("{k}: {n} requests throttled at DynamoDB's own limits"));
        }
        for (k, p) in &self.max_wcu {
            if p.units > WCU_PER_KEY {
                out.push(format!("{k}: {:.0} WCU in second {}", p.units, p.second));
            }
        }
        for (k, p) in &self.max_rcu {
            if p.units > RCU_PER_KEY {
                out.push(format!("{k}: {:.0} RCU in second {}", p.units, p.second));
            }
        }
        out.sort();
        out
    }

    pub fn throttled_total(&self) -> u64 {
        self.throttled.values().sum()
    }

    /// The `n` keys with the highest peak write units, with their family and second.
    pub fn top_writes(&self, n: usize) -> Vec<(PartKey, Peak)> {
        let mut v: Vec<(PartKey, Peak)> = self.max_wcu.iter().map(|(k, p)| (k.clone(), *p)).collect();
        v.sort_by(|a, b| b.1.units.total_cmp(&a.1.units).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }

    pub fn top_reads(&self, n: usize) -> Vec<(PartKey, Peak)> {
        let mut v: Vec<(PartKey, Peak)> = self.max_rcu.iter().map(|(k, p)| (k.clone(), *p)).collect();
        v.sort_by(|a, b| b.1.units.total_cmp(&a.1.units).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Projection {
    All,
    KeysOnly,
    Include(Vec<String>),
}

#[derive(Debug, Clone)]
struct IndexDef {
    name: String,
    hash: String,
    range: Option<String>,
    projection: Projection,
}

#[derive(Debug, Clone)]
struct Schema {
    hash: String,
    range: Option<String>,
    indexes: Vec<IndexDef>,
}

/// One item's index entry: its hash key value, a digest of its projected attributes, its size.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    key: String,
    range: String,
    digest: u64,
    size: u64,
}

/// What the meter knows of an item's current image.
#[derive(Debug, Clone, Default)]
struct Image {
    size: u64,
    entries: Vec<Option<Entry>>,
}

#[derive(Default)]
struct Counters {
    second: u64,
    wcu: HashMap<PartKey, f64>,
    rcu: HashMap<PartKey, f64>,
}

#[derive(Default)]
struct State {
    now: Counters,
    report: MeterReport,
    /// By table name, then item key (the table key's JSON).
    images: HashMap<String, HashMap<String, Image>>,
}

struct Shared {
    target: String,
    http: reqwest::Client,
    clock: Arc<dyn Clock>,
    counting: AtomicBool,
    /// Limits in thousandths of the standard ones (1000 = DynamoDB's).
    limit_permille: AtomicU64,
    schemas: Mutex<HashMap<String, Arc<Schema>>>,
    state: Mutex<State>,
    /// Requests whose body holds this answer HTTP 500 (a store fault for some writes).
    failing: Mutex<Option<String>>,
    faults: AtomicU64,
}

/// The proxy. Dropping it stops it.
pub struct PartitionMeter {
    pub endpoint: String,
    sh: Arc<Shared>,
    _server: relay_shared::local::StopOnDrop,
}

/// A handle that changes a meter's limits and faults (for actors on the clock).
#[derive(Clone)]
pub struct MeterControl(Arc<Shared>);

impl MeterControl {
    /// Scales every key's limits (1.0 = DynamoDB's): a throttling burst.
    pub fn set_limit_factor(&self, f: f64) {
        self.0.limit_permille.store((f.max(0.0) * 1000.0) as u64, Ordering::SeqCst);
    }

    /// Fails the calls whose body contains `needle` with HTTP 500 `InternalServerError` (e.g.
    /// `":solution"`: the writes of results), or stops with `None`. They are not counted.
    pub fn set_failing_matching(&self, needle: Option<&str>) {
        if let Ok(mut m) = self.0.failing.lock() {
            *m = needle.map(str::to_owned);
        }
    }
}

impl PartitionMeter {
    pub fn control(&self) -> MeterControl {
        MeterControl(self.sh.clone())
    }

    /// Fronts `target` (a [`relay_shared::testkit::LocalDynamo`] endpoint), counting by `clock`'s
    /// second.
    pub async fn start(target: &str, clock: Arc<dyn Clock>) -> anyhow::Result<Self> {
        let sh = Arc::new(Shared {
            target: target.trim_end_matches('/').to_owned(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build()?,
            clock,
            counting: AtomicBool::new(true),
            limit_permille: AtomicU64::new(1000),
            schemas: Mutex::default(),
            state: Mutex::default(),
            failing: Mutex::default(),
            faults: AtomicU64::new(0),
        });
        let app = axum::Router::new().fallback(forward).with_state(sh.clone());
        let (endpoint, server) = relay_shared::local::serve_on_loopback(app).await?;
        Ok(Self { endpoint, sh, _server: server })
    }

    /// Stops (or resumes) counting and limiting: the harness's own reads at the end of a run are
    /// not the relay's.
    pub fn set_counting(&self, on: bool) {
        self.sh.counting.store(on, Ordering::SeqCst);
    }

    /// Scales every key's limits (1.0 = DynamoDB's): a throttling burst.
    pub fn set_limit_factor(&self, f: f64) {
        self.control().set_limit_factor(f);
    }

    /// See [`MeterControl::set_failing_matching`].
    pub fn set_failing_matching(&self, needle: Option<&str>) {
        self.control().set_failing_matching(needle);
    }

    /// Calls failed by [`set_failing_matching`](Self::set_failing_matching).
    pub fn faults(&self) -> u64 {
        self.sh.faults.load(Ordering::SeqCst)
    }

    /// What was counted so far (the current second included).
    pub fn report(&self) -> MeterReport {
        let Ok(mut st) = self.sh.state.lock() else { return MeterReport::default() };
        fold(&mut st);
        st.report.clone()
    }
}

/// The SDK's sleeps (its retry back-off) on the simulated clock: a throttled request is sent
/// again after its back-off in simulated time, as on AWS, instead of in the same frozen second.
#[derive(Debug, Clone)]
struct SimSleep(Arc<dyn Clock>);

impl aws_sdk_dynamodb::config::AsyncSleep for SimSleep {
    fn sleep(&self, d: std::time::Duration) -> aws_sdk_dynamodb::config::Sleep {
        let until = self.0.now().plus(d);
        aws_sdk_dynamodb::config::Sleep::new(SyncSleep(Mutex::new(self.0.sleep_until(until))))
    }
}

/// The clock's sleep, made `Sync` as the SDK's sleeps must be.
struct SyncSleep(Mutex<relay_time::Sleep>);

impl std::future::Future for SyncSleep {
    type Output = ();

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.0.lock() {
            Ok(mut s) => s.as_mut().poll(cx),
            // Only a panic while polling poisons it; end the wait.
            Err(_) => std::task::Poll::Ready(()),
        }
    }
}

/// A DynamoDB client for `endpoint` as the relay's functions build one (the standard retry
/// policy: 3 attempts, exponential back-off with jitter, throttling errors retried), with its
/// back-off on `clock`. Stalled-stream protection, a timer of its own that would run beside the
/// request on the simulated clock, is off (DynamoDB's answers are small).
pub fn sim_client(endpoint: &str, clock: Arc<dyn Clock>) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region, StalledStreamProtectionConfig};
    let conf = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "relay-sim"))
        .endpoint_url(endpoint)
        .http_client(relay_shared::testkit::test_http_client())
        .sleep_impl(SimSleep(clock))
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
        .build();
    aws_sdk_dynamodb::Client::from_conf(conf)
}

/// Folds the current second's counters into the peaks.
fn fold(st: &mut State) {
    let State { now, report, .. } = st;
    for (k, u) in &now.wcu {
        let p = report.max_wcu.entry(k.clone()).or_default();
        if *u > p.units {
            *p = Peak { units: *u, second: now.second };
        }
    }
    for (k, u) in &now.rcu {
        let p = report.max_rcu.entry(k.clone()).or_default();
        if *u > p.units {
            *p = Peak { units: *u, second: now.second };
        }
    }
}

/// Moves the counters to `second`, folding the last one's into the peaks.
///
/// Only forwards: a request admitted in an earlier second and charged after the clock moved is
/// charged to the current one.
fn roll(st: &mut State, second: u64) {
    if second > st.now.second {
        fold(st);
        st.now.wcu.clear();
        st.now.rcu.clear();
        st.now.second = second;
    }
}

const JSON: &str = "application/x-amz-json-1.0";

fn throttled_response(reason: &str, key: &PartKey) -> axum::http::Response<axum::body::Body> {
    let body = serde_json::json!({
        "__type": "com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException",
        "message": format!("Throughput exceeds the current capacity for one or more partitions ({key})"),
        "ThrottlingReasons": [{ "reason": reason }],
    });
    axum::http::Response::builder()
        .status(400)
        .header("content-type", JSON)
        .body(axum::body::Body::from(body.to_string()))
        .unwrap_or_default()
}

fn engine_error() -> axum::http::Response<axum::body::Body> {
    axum::http::Response::builder()
        .status(500)
        .header("content-type", JSON)
        .body(axum::body::Body::from(
            r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"internal error"}"#,
        ))
        .unwrap_or_default()
}

/// A call the meter sends to the engine itself (schema, images): not counted.
/// `auth` is the relay's request's signature headers (the engine checks they are there).
async fn engine_call(sh: &Shared, auth: &Auth, op: &str, body: &Value) -> Option<Value> {
    let mut req = sh.http.post(format!("{}/", sh.target));
    for (k, v) in auth {
        req = req.header(k, v);
    }
    let resp = req
        .header("content-type", JSON)
        .header("x-amz-target", format!("DynamoDB_20120810.{op}"))
        .body(body.to_string())
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

/// A request's signature headers.
type Auth = Vec<(axum::http::HeaderName, axum::http::HeaderValue)>;

async fn schema_of(sh: &Shared, auth: &Auth, table: &str) -> Option<Arc<Schema>> {
    if let Some(s) = sh.schemas.lock().ok()?.get(table) {
        return Some(s.clone());
    }
    let d = engine_call(sh, auth, "DescribeTable", &serde_json::json!({ "TableName": table })).await?;
    let s = Arc::new(parse_schema(&d["Table"])?);
    sh.schemas.lock().ok()?.insert(table.to_owned(), s.clone());
    Some(s)
}

fn key_attr(schema: &Value, kind: &str) -> Option<String> {
    schema
        .as_array()?
        .iter()
        .find(|k| k["KeyType"] == kind)
        .and_then(|k| k["AttributeName"].as_str())
        .map(str::to_owned)
}

fn parse_schema(t: &Value) -> Option<Schema> {
    let indexes = t["GlobalSecondaryIndexes"]
        .as_array()
        .map(|v| v.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|i| {
            let projection = match i["Projection"]["ProjectionType"].as_str() {
                Some("KEYS_ONLY") => Projection::KeysOnly,
                Some("INCLUDE") => Projection::Include(
                    i["Projection"]["NonKeyAttributes"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
                        .unwrap_or_default(),
                ),
                _ => Projection::All,
            };
            Some(IndexDef {
                name: i["IndexName"].as_str()?.to_owned(),
                hash: key_attr(&i["KeySchema"], "HASH")?,
                range: key_attr(&i["KeySchema"], "RANGE"),
                projection,
            })
        })
        .collect();
    Some(Schema { hash: key_attr(&t["KeySchema"], "HASH")?, range: key_attr(&t["KeySchema"], "RANGE"), indexes })
}

/// DynamoDB's size of an attribute value (its documented rules; numbers approximately).
fn value_size(v: &Value) -> u64 {
    let Some((t, x)) = v.as_object().and_then(|o| o.iter().next()) else { return 0 };
    match t.as_str() {
        "S" => x.as_str().map_or(0, |s| s.len() as u64),
        "N" => x.as_str().map_or(0, |s| {
            let digits = s.chars().filter(char::is_ascii_digit).count() as u64;
            digits.div_ceil(2) + 1
        }),
        "B" => x.as_str().map_or(0, |s| (s.len() as u64 * 3) / 4),
        "BOOL" | "NULL" => 1,
        "SS" | "NS" | "BS" => {
            x.as_array().map_or(0, |a| a.iter().map(|e| e.as_str().map_or(0, |s| s.len() as u64)).sum())
        }
        "L" => 3 + x.as_array().map_or(0, |a| a.iter().map(|e| 1 + value_size(e)).sum()),
        "M" => 3 + x.as_object().map_or(0, |m| m.iter().map(|(k, e)| 1 + k.len() as u64 + value_size(e)).sum()),
        _ => 0,
    }
}

/// DynamoDB's size of an item: its attribute names and values.
fn item_size(item: &Value) -> u64 {
    item.as_object().map_or(0, |m| m.iter().map(|(k, v)| k.len() as u64 + value_size(v)).sum())
}

/// A key attribute's value as text (`S`, `N` or `B`).
fn scalar(v: &Value) -> Option<String> {
    let o = v.as_object()?;
    o.get("S").or_else(|| o.get("N")).or_else(|| o.get("B")).and_then(Value::as_str).map(str::to_owned)
}

fn digest(v: &Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // serde_json maps are ordered (BTreeMap) here, so equal items print equally.
    v.to_string().hash(&mut h);
    h.finish()
}

/// An item's image: its size and its entry in each index (sparse: only with both index keys).
fn image_of(schema: &Schema, item: &Value) -> Image {
    let entries = schema
        .indexes
        .iter()
        .map(|ix| {
            let key = scalar(&item[&ix.hash])?;
            let range = match &ix.range {
                Some(r) => Some(scalar(&item[r])?),
                None => None,
            };
            let mut keys: Vec<&str> = vec![&schema.hash, &ix.hash];
            keys.extend(schema.range.as_deref());
            keys.extend(ix.range.as_deref());
            let projected: serde_json::Map<String, Value> = match &ix.projection {
                Projection::All => item.as_object().cloned().unwrap_or_default(),
                Projection::KeysOnly | Projection::Include(_) => {
                    let extra: &[String] = match &ix.projection {
                        Projection::Include(a) => a,
                        _ => &[],
                    };
                    item.as_object()
                        .map(|m| {
                            m.iter()
                                .filter(|(k, _)| keys.contains(&k.as_str()) || extra.contains(k))
                                .map(|(k, v)| (k.clone(), v.clone()))
                                .collect()
                        })
                        .unwrap_or_default()
                }
            };
            let p = Value::Object(projected);
            // An index entry carries 100 bytes of overhead.
            Some(Entry { key, range: range.unwrap_or_default(), digest: digest(&p), size: item_size(&p) + 100 })
        })
        .collect();
    Image { size: item_size(item), entries }
}

fn kb_units(bytes: u64) -> f64 {
    bytes.div_ceil(1024).max(1) as f64
}

fn read_units(bytes: u64, consistent: bool) -> f64 {
    let u = bytes.div_ceil(4096).max(1) as f64;
    if consistent { u } else { u / 2.0 }
}

/// The index keys charged for one item's change from `old` to `new`, with units.
fn index_charges(schema: &Schema, old: Option<&Image>, new: Option<&Image>) -> Vec<(PartKey, f64)> {
    let mut out = Vec::new();
    for (i, ix) in schema.indexes.iter().enumerate() {
        let o = old.and_then(|m| m.entries.get(i).cloned().flatten());
        let n = new.and_then(|m| m.entries.get(i).cloned().flatten());
        match (o, n) {
            (Some(o), Some(n)) if o.key == n.key && o.range == n.range => {
                if o.digest != n.digest {
                    out.push((PartKey::index(&ix.name, &n.key), kb_units(o.size.max(n.size))));
                }
            }
            (o, n) => {
                if let Some(o) = o {
                    out.push((PartKey::index(&ix.name, &o.key), kb_units(o.size)));
                }
                if let Some(n) = n {
                    out.push((PartKey::index(&ix.name, &n.key), kb_units(n.size)));
                }
            }
        }
    }
    out
}

/// The hash key values a request names for `attr` in an `UpdateItem`'s `SET` (`attr = :v`, or
/// `#alias = :v`).
fn set_values(req: &Value, attr: &str) -> Vec<String> {
    let expr = req["UpdateExpression"].as_str().unwrap_or_default();
    let mut names = vec![attr.to_owned()];
    if let Some(m) = req["ExpressionAttributeNames"].as_object() {
        names.extend(m.iter().filter(|(_, v)| v.as_str() == Some(attr)).map(|(k, _)| k.clone()));
    }
    let mut out = Vec::new();
    for name in names {
        let mut rest = expr;
        while let Some(at) = rest.find(name.as_str()) {
            let before = rest[..at].chars().last();
            let after = &rest[at + name.len()..];
            rest = after;
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '#') {
                continue;
            }
            let Some(v) = after.trim_start().strip_prefix('=') else { continue };
            let token: String =
                v.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
            if token.starts_with(':')
                && let Some(val) = scalar(&req["ExpressionAttributeValues"][&token])
            {
                out.push(val);
            }
        }
    }
    out
}

/// The hash key value a `Query` names (`hash = :v`).
fn query_hash(req: &Value, attr: &str) -> Option<String> {
    let expr = req["KeyConditionExpression"].as_str()?;
    let mut names = vec![attr.to_owned()];
    if let Some(m) = req["ExpressionAttributeNames"].as_object() {
        names.extend(m.iter().filter(|(_, v)| v.as_str() == Some(attr)).map(|(k, _)| k.clone()));
    }
    for clause in expr.split(" AND ").chain(expr.split(" and ")) {
        let Some((l, r)) = clause.split_once('=') else { continue };
        if names.iter().any(|n| n == l.trim().trim_start_matches('(')) {
            let token = r.trim().trim_end_matches(')');
            return scalar(&req["ExpressionAttributeValues"][token]);
        }
    }
    None
}

/// One item a write request touches: its table, key, and (for a `PutItem`) its new image.
struct Touch {
    table: String,
    key: Value,
    put: Option<Value>,
    /// Index hash values the request sets, by index position.
    sets: Vec<Vec<String>>,
    delete: bool,
}

fn touches(op: &str, req: &Value, schema_for: &HashMap<String, Arc<Schema>>) -> Vec<Touch> {
    let key_of = |table: &str, item: &Value| -> Value {
        let Some(s) = schema_for.get(table) else { return Value::Null };
        let mut k = serde_json::Map::new();
        for a in std::iter::once(&s.hash).chain(s.range.as_ref()) {
            k.insert(a.clone(), item[a].clone());
        }
        Value::Object(k)
    };
    let one = |table: &str, body: &Value, kind: &str| -> Touch {
        let sets = schema_for
            .get(table)
            .map(|s| {
                s.indexes.iter().map(|ix| if kind == "Update" { set_values(body, &ix.hash) } else { vec![] }).collect()
            })
            .unwrap_or_default();
        match kind {
            "Put" => Touch {
                table: table.to_owned(),
                key: key_of(table, &body["Item"]),
                put: Some(body["Item"].clone()),
                sets,
                delete: false,
            },
            _ => Touch { table: table.to_owned(), key: body["Key"].clone(), put: None, sets, delete: kind == "Delete" },
        }
    };
    match op {
        "PutItem" | "UpdateItem" | "DeleteItem" => {
            let table = req["TableName"].as_str().unwrap_or_default();
            vec![one(table, req, op.trim_end_matches("Item"))]
        }
        "TransactWriteItems" => req["TransactItems"]
            .as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|t| {
                let (kind, body) = t.as_object()?.iter().next()?;
                let kind = match kind.as_str() {
                    "ConditionCheck" => return None,
                    k => k,
                };
                Some(one(body["TableName"].as_str().unwrap_or_default(), body, kind))
            })
            .collect(),
        "BatchWriteItem" => req["RequestItems"]
            .as_object()
            .map(|m| {
                m.iter()
                    .flat_map(|(table, reqs)| {
                        reqs.as_array().cloned().unwrap_or_default().into_iter().filter_map(move |r| {
                            if r["PutRequest"].is_object() {
                                Some(one(table, &r["PutRequest"], "Put"))
                            } else if r["DeleteRequest"].is_object() {
                                Some(one(table, &r["DeleteRequest"], "Delete"))
                            } else {
                                None
                            }
                        })
                    })
                    .collect()
            })
            .unwrap_or_default(),
        _ => vec![],
    }
}

fn limit(sh: &Shared, base: f64) -> f64 {
    base * sh.limit_permille.load(Ordering::SeqCst) as f64 / 1000.0
}

/// The first key among `keys` already at its limit in this second, if any.
fn at_limit<'a>(st: &State, keys: impl IntoIterator<Item = &'a PartKey>, write: bool, lim: f64) -> Option<PartKey> {
    let used = if write { &st.now.wcu } else { &st.now.rcu };
    keys.into_iter().find(|k| used.get(*k).copied().unwrap_or(0.0) >= lim).cloned()
}

/// Units held on keys from admission until the request's real cost is charged.
struct Held {
    second: u64,
    keys: Vec<PartKey>,
    unit: f64,
    write: bool,
}

/// Gives back what admission held, in the same lock as the real cost is charged.
fn release(st: &mut State, h: &Held) {
    if st.now.second != h.second {
        return;
    }
    let used = if h.write { &mut st.now.wcu } else { &mut st.now.rcu };
    for k in &h.keys {
        if let Some(u) = used.get_mut(k) {
            *u = (*u - h.unit).max(0.0);
        }
    }
}

fn reason(k: &PartKey, write: bool) -> &'static str {
    match (k.index.is_some(), write) {
        (false, true) => "TableWriteKeyRangeThroughputExceeded",
        (true, true) => "IndexWriteKeyRangeThroughputExceeded",
        (false, false) => "TableReadKeyRangeThroughputExceeded",
        (true, false) => "IndexReadKeyRangeThroughputExceeded",
    }
}

async fn forward(
    axum::extract::State(sh): axum::extract::State<Arc<Shared>>,
    req: axum::http::Request<axum::body::Body>,
) -> axum::http::Response<axum::body::Body> {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 16 * 1024 * 1024).await else { return engine_error() };
    let needle = sh.failing.lock().ok().and_then(|m| m.clone());
    if let Some(needle) = needle
        && String::from_utf8_lossy(&bytes).contains(&needle)
    {
        sh.faults.fetch_add(1, Ordering::SeqCst);
        return engine_error();
    }
    let target = parts.headers.get("x-amz-target").and_then(|v| v.to_str().ok()).unwrap_or("");
    let op = target.split_once('.').map_or("", |(_, op)| op).to_owned();
    let counting = sh.counting.load(Ordering::SeqCst);
    let request: Value = if counting { serde_json::from_slice(&bytes).unwrap_or(Value::Null) } else { Value::Null };
    let is_write =
        matches!(op.as_str(), "PutItem" | "UpdateItem" | "DeleteItem" | "TransactWriteItems" | "BatchWriteItem");
    let is_read = matches!(op.as_str(), "GetItem" | "Query" | "Scan" | "BatchGetItem");

    let auth: Auth = parts
        .headers
        .iter()
        .filter(|(k, _)| *k == "authorization" || *k == "x-amz-date")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // The tables the request names, and their schemas.
    let mut schemas: HashMap<String, Arc<Schema>> = HashMap::new();
    if counting && (is_write || is_read) {
        let mut tables: Vec<String> = request["TableName"].as_str().map(str::to_owned).into_iter().collect();
        for field in ["RequestItems"] {
            if let Some(m) = request[field].as_object() {
                tables.extend(m.keys().cloned());
            }
        }
        if let Some(a) = request["TransactItems"].as_array() {
            for t in a {
                if let Some((_, b)) = t.as_object().and_then(|o| o.iter().next())
                    && let Some(n) = b["TableName"].as_str()
                {
                    tables.push(n.to_owned());
                }
            }
        }
        for t in tables {
            if let Some(s) = schema_of(&sh, &auth, &t).await {
                schemas.insert(t, s);
            }
        }
    }
    let second = sh.clock.now().as_millis() / 1000;
    let writes = if counting && is_write { touches(&op, &request, &schemas) } else { vec![] };

    // Admission.
    let mut held: Option<Held> = None;
    if counting && (is_write || is_read) {
        let Ok(mut st) = sh.state.lock() else { return engine_error() };
        roll(&mut st, second);
        let index_name = request["IndexName"].as_str();
        let label = match (&op[..], index_name) {
            (_, Some(i)) => format!("{op} {i}"),
            _ => format!("{op} table"),
        };
        *st.report.ops.entry(label).or_default() += 1;
        let mut keys: Vec<PartKey> = Vec::new();
        if is_write {
            for t in &writes {
                let Some(schema) = schemas.get(&t.table) else { continue };
                keys.push(PartKey::table(&scalar(&t.key[&schema.hash]).unwrap_or_default()));
                let old = st.images.get(&t.table).and_then(|m| m.get(&t.key.to_string()));
                for (i, ix) in schema.indexes.iter().enumerate() {
                    if let Some(Some(e)) = old.map(|o| o.entries.get(i).cloned().flatten()) {
                        keys.push(PartKey::index(&ix.name, &e.key));
                    }
                    if let Some(item) = &t.put
                        && let Some(v) = scalar(&item[&ix.hash])
                    {
                        keys.push(PartKey::index(&ix.name, &v));
                    }
                    for v in t.sets.get(i).map(|v| v.as_slice()).unwrap_or_default() {
                        keys.push(PartKey::index(&ix.name, v));
                    }
                }
            }
        } else if op == "GetItem" {
            if let Some(s) = request["TableName"].as_str().and_then(|t| schemas.get(t)) {
                keys.push(PartKey::table(&scalar(&request["Key"][&s.hash]).unwrap_or_default()));
            }
        } else if op == "Query"
            && let Some(s) = request["TableName"].as_str().and_then(|t| schemas.get(t))
        {
            let (attr, ix) = match index_name.and_then(|n| s.indexes.iter().find(|i| i.name == n)) {
                Some(ix) => (ix.hash.clone(), Some(ix.name.clone())),
                None => (s.hash.clone(), None),
            };
            if let Some(v) = query_hash(&request, &attr) {
                keys.push(PartKey { index: ix, value: v });
            }
        }
        let lim = limit(&sh, if is_write { WCU_PER_KEY } else { RCU_PER_KEY });
        if is_write {
            let what = match request["UpdateExpression"].as_str() {
                Some(e) => format!("{op}: {}", e.chars().take(90).collect::<String>()),
                None => op.clone(),
            };
            for k in keys.iter().filter(|k| k.index.is_some() || !k.value.starts_with("tsk_")) {
                *st.report.writers.entry(k.clone()).or_default().entry(what.clone()).or_default() += 1;
            }
        }
        if let Some(k) = at_limit(&st, &keys, is_write, lim) {
            *st.report.throttled.entry(k.clone()).or_default() += 1;
            if sh.limit_permille.load(Ordering::SeqCst) >= 1000 {
                *st.report.throttled_at_full_limits.entry(k.clone()).or_default() += 1;
            }
            return throttled_response(reason(&k, is_write), &k);
        }
        // Admitted: the least it will cost is held on its keys at once, so requests in flight
        // together cannot all pass a key that only their sum takes over its limit.
        keys.sort();
        keys.dedup();
        let unit = if is_write { 1.0 } else { 0.5 };
        let used = if is_write { &mut st.now.wcu } else { &mut st.now.rcu };
        for k in &keys {
            *used.entry(k.clone()).or_default() += unit;
        }
        held = Some(Held { second: st.now.second, keys, unit, write: is_write });
    }

    // The engine.
    let mut fwd = sh.http.request(parts.method, format!("{}{}", sh.target, parts.uri));
    for (k, v) in &parts.headers {
        if k != axum::http::header::HOST && k != axum::http::header::CONTENT_LENGTH {
            fwd = fwd.header(k, v);
        }
    }
    let Ok(resp) = fwd.body(bytes).send().await else { return engine_error() };
    let status = resp.status().as_u16();
    let mut out = axum::http::Response::builder().status(status);
    for (k, v) in resp.headers() {
        if k != axum::http::header::CONTENT_LENGTH && k != axum::http::header::TRANSFER_ENCODING {
            out = out.header(k, v);
        }
    }
    let answer = resp.bytes().await.unwrap_or_default();

    if counting && is_write {
        charge_writes(&sh, &auth, second, &op, status, &answer, &writes, &schemas, held.as_ref()).await;
    } else if counting && is_read && status == 200 {
        charge_read(&sh, second, &op, &request, &answer, &schemas, held.as_ref());
    } else if let Some(h) = &held
        && let Ok(mut st) = sh.state.lock()
    {
        release(&mut st, h);
    }
    out.body(axum::body::Body::from(answer)).unwrap_or_default()
}

#[allow(clippy::too_many_arguments)]
async fn charge_writes(
    sh: &Shared,
    auth: &Auth,
    second: u64,
    op: &str,
    status: u16,
    answer: &[u8],
    writes: &[Touch],
    schemas: &HashMap<String, Arc<Schema>>,
    held: Option<&Held>,
) {
    let conditional_failed = status == 400 && String::from_utf8_lossy(answer).contains("ConditionalCheckFailed");
    if status != 200 && !conditional_failed {
        if let (Some(h), Ok(mut st)) = (held, sh.state.lock()) {
            release(&mut st, h);
        }
        return;
    }
    // A transaction costs two units per KB.
    let factor = if op == "TransactWriteItems" { 2.0 } else { 1.0 };
    let mut new_images: Vec<Option<Image>> = Vec::with_capacity(writes.len());
    for t in writes {
        let Some(schema) = schemas.get(&t.table) else {
            new_images.push(None);
            continue;
        };
        let image = if conditional_failed || t.delete {
            None
        } else if let Some(item) = &t.put {
            Some(image_of(schema, item))
        } else {
            let got = engine_call(
                sh,
                auth,
                "GetItem",
                &serde_json::json!({ "TableName": t.table, "Key": t.key, "ConsistentRead": true }),
            )
            .await;
            got.and_then(|g| g.get("Item").cloned()).map(|item| image_of(schema, &item))
        };
        new_images.push(image);
    }
    let Ok(mut st) = sh.state.lock() else { return };
    if let Some(h) = held {
        release(&mut st, h);
    }
    roll(&mut st, second);
    for (t, new) in writes.iter().zip(new_images) {
        let Some(schema) = schemas.get(&t.table) else { continue };
        let pk = PartKey::table(&scalar(&t.key[&schema.hash]).unwrap_or_default());
        let key = t.key.to_string();
        let old = st.images.get(&t.table).and_then(|m| m.get(&key)).cloned();
        if conditional_failed {
            // DynamoDB charges a failed conditional write for the item's size.
            let u = kb_units(old.as_ref().map_or(0, |o| o.size)) * factor;
            *st.now.wcu.entry(pk).or_default() += u;
            st.report.wcu += u;
            continue;
        }
        let table_units = kb_units(old.as_ref().map_or(0, |o| o.size).max(new.as_ref().map_or(0, |n| n.size))) * factor;
        *st.now.wcu.entry(pk).or_default() += table_units;
        st.report.wcu += table_units;
        for (k, u) in index_charges(schema, old.as_ref(), new.as_ref()) {
            *st.now.wcu.entry(k).or_default() += u;
            st.report.wcu += u;
            st.report.index_wcu += u;
        }
        let images = st.images.entry(t.table.clone()).or_default();
        match new {
            Some(n) => {
                images.insert(key, n);
            }
            None => {
                images.remove(&key);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn charge_read(
    sh: &Shared,
    second: u64,
    op: &str,
    request: &Value,
    answer: &[u8],
    schemas: &HashMap<String, Arc<Schema>>,
    held: Option<&Held>,
) {
    let v = serde_json::from_slice::<Value>(answer).unwrap_or(Value::Null);
    let consistent = request["ConsistentRead"] == true;
    let Ok(mut st) = sh.state.lock() else { return };
    if let Some(h) = held {
        release(&mut st, h);
    }
    roll(&mut st, second);
    let Some(schema) = request["TableName"].as_str().and_then(|t| schemas.get(t)) else {
        if op == "BatchGetItem" {
            // Per item, on its own key.
            if let Some(m) = v["Responses"].as_object() {
                for (table, items) in m {
                    let Some(s) = schemas.get(table) else { continue };
                    for item in items.as_array().map(|a| a.as_slice()).unwrap_or_default() {
                        let k = PartKey::table(&scalar(&item[&s.hash]).unwrap_or_default());
                        let u = read_units(item_size(item), consistent);
                        *st.now.rcu.entry(k).or_default() += u;
                        st.report.rcu += u;
                    }
                }
            }
        }
        return;
    };
    match op {
        "GetItem" => {
            let k = PartKey::table(&scalar(&request["Key"][&schema.hash]).unwrap_or_default());
            let u = read_units(item_size(&v["Item"]), consistent);
            *st.now.rcu.entry(k).or_default() += u;
            st.report.rcu += u;
        }
        "Query" => {
            let index = request["IndexName"].as_str().and_then(|n| schema.indexes.iter().find(|i| i.name == n));
            let attr = index.map_or(&schema.hash, |i| &i.hash);
            let Some(value) = query_hash(request, attr) else { return };
            let k = PartKey { index: index.map(|i| i.name.clone()), value };
            let bytes: u64 = v["Items"].as_array().map_or(0, |a| a.iter().map(item_size).sum());
            let u = read_units(bytes, consistent);
            *st.now.rcu.entry(k).or_default() += u;
            st.report.rcu += u;
        }
        "Scan" => {
            st.report.scans += 1;
            let bytes: u64 = v["Items"].as_array().map_or(0, |a| a.iter().map(item_size).sum());
            st.report.rcu += read_units(bytes, consistent);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_time::{ManualClock, Timestamp};

    fn schema() -> Schema {
        Schema {
            hash: "pk".into(),
            range: None,
            indexes: vec![IndexDef {
                name: "due-for-poll".into(),
                hash: "poll_shard".into(),
                range: Some("poll_due_at".into()),
                projection: Projection::All,
            }],
        }
    }

    #[test]
    fn an_item_moving_between_index_keys_charges_both() {
        let s = schema();
        let old = image_of(&s, &serde_json::json!({"pk":{"S":"t1"},"poll_shard":{"N":"1"},"poll_due_at":{"N":"5"}}));
        let moved = image_of(&s, &serde_json::json!({"pk":{"S":"t1"},"poll_shard":{"N":"2"},"poll_due_at":{"N":"5"}}));
        let gone = image_of(&s, &serde_json::json!({"pk":{"S":"t1"}}));
        let c = index_charges(&s, Some(&old), Some(&moved));
        assert_eq!(c, vec![(PartKey::index("due-for-poll", "1"), 1.0), (PartKey::index("due-for-poll", "2"), 1.0)]);
        assert_eq!(index_charges(&s, Some(&old), Some(&gone)), vec![(PartKey::index("due-for-poll", "1"), 1.0)]);
        assert_eq!(index_charges(&s, None, Some(&gone)), vec![], "not in the index: no index write");
        assert_eq!(index_charges(&s, Some(&old), Some(&old)), vec![], "nothing projected changed");
    }

    #[test]
    fn update_expressions_name_the_new_index_keys() {
        let req = serde_json::json!({
            "UpdateExpression": "SET #s = :shard, poll_due_at = :due, xpoll_shard = :no",
            "ExpressionAttributeNames": {"#s": "poll_shard"},
            "ExpressionAttributeValues": {":shard": {"N": "3"}, ":due": {"N": "9"}, ":no": {"N": "7"}},
        });
        assert_eq!(set_values(&req, "poll_shard"), vec!["3".to_owned()]);
        let q = serde_json::json!({
            "KeyConditionExpression": "poll_shard = :shard AND poll_due_at <= :now",
            "ExpressionAttributeValues": {":shard": {"N": "4"}, ":now": {"N": "1"}},
        });
        assert_eq!(query_hash(&q, "poll_shard").as_deref(), Some("4"));
    }

    #[test]
    fn sizes_follow_dynamodbs_rules() {
        let item = serde_json::json!({"pk": {"S": "abc"}, "n": {"N": "12345"}, "ok": {"BOOL": true}});
        // pk 2+3, n 1+(3+1), ok 2+1.
        assert_eq!(item_size(&item), 5 + 5 + 3);
        assert_eq!(kb_units(0), 1.0);
        assert_eq!(kb_units(1025), 2.0);
        assert_eq!(read_units(4097, true), 2.0);
        assert_eq!(read_units(10, false), 0.5);
    }

    /// Against the engine: a few writes are counted per key, a key over its limit is refused
    /// with the throttling error the SDK retries, and a new second admits it again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_meter_counts_and_throttles_a_hot_key() -> anyhow::Result<()> {
        let db = relay_shared::testkit::LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
        let meter = PartitionMeter::start(&db.endpoint, Arc::new(clock.clone())).await?;
        // Few retries, so a throttled call comes back as an error quickly.
        let conf = aws_sdk_dynamodb::Config::builder()
            .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
            .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
            .credentials_provider(aws_sdk_dynamodb::config::Credentials::new("t", "t", None, None, "t"))
            .endpoint_url(&meter.endpoint)
            .http_client(relay_shared::testkit::test_http_client())
            .retry_config(aws_sdk_dynamodb::config::retry::RetryConfig::disabled())
            .build();
        let client = aws_sdk_dynamodb::Client::from_conf(conf);
        let s = |v: &str| aws_sdk_dynamodb::types::AttributeValue::S(v.into());
        let n = |v: u64| aws_sdk_dynamodb::types::AttributeValue::N(v.to_string());
        let table = store.table();
        // An item enters the due-for-poll index under shard 1, then moves to shard 2.
        client
            .put_item()
            .table_name(table)
            .item("pk", s("task-a"))
            .item("poll_shard", n(1))
            .item("poll_due_at", n(5))
            .send()
            .await?;
        client
            .update_item()
            .table_name(table)
            .key("pk", s("task-a"))
            .update_expression("SET poll_shard = :s")
            .expression_attribute_values(":s", n(2))
            .send()
            .await?;
        let r = meter.report();
        let wcu = |k: PartKey| r.max_wcu.get(&k).map_or(0.0, |p| p.units);
        assert_eq!(wcu(PartKey::table("task-a")), 2.0);
        assert_eq!(wcu(PartKey::index("due-for-poll", "1")), 2.0, "entered, then left");
        assert_eq!(wcu(PartKey::index("due-for-poll", "2")), 1.0, "entered");
        assert_eq!(r.ops.get("UpdateItem table"), Some(&1));

        // A hot key: at a tenth of the limit (100 WCU/s), the 101st write in the second is refused.
        meter.set_limit_factor(0.1);
        let mut refused = None;
        for i in 0..101 {
            let out = client
                .update_item()
                .table_name(table)
                .key("pk", s("hot"))
                .update_expression("SET c = :c")
                .expression_attribute_values(":c", n(i))
                .send()
                .await;
            if let Err(e) = out {
                refused = Some((i, e));
                break;
            }
        }
        let (at, e) = refused.ok_or_else(|| anyhow::anyhow!("never throttled"))?;
        assert_eq!(at, 100);
        let e = e.into_service_error();
        assert!(e.is_provisioned_throughput_exceeded_exception(), "{e:?}");
        let r = meter.report();
        assert_eq!(r.throttled.get(&PartKey::table("hot")), Some(&1));
        assert_eq!(r.max_wcu.get(&PartKey::table("hot")).map(|p| p.units), Some(100.0));
        // Requests in flight together: no more than the limit pass, whatever their order.
        clock.advance(std::time::Duration::from_secs(1));
        let mut set = tokio::task::JoinSet::new();
        for i in 0..150 {
            let (client, table) = (client.clone(), table.to_owned());
            set.spawn(async move {
                client
                    .update_item()
                    .table_name(table)
                    .key("pk", aws_sdk_dynamodb::types::AttributeValue::S("together".into()))
                    .update_expression("SET c = :c")
                    .expression_attribute_values(":c", aws_sdk_dynamodb::types::AttributeValue::N(i.to_string()))
                    .send()
                    .await
                    .is_ok()
            });
        }
        let mut passed = 0;
        while let Some(ok) = set.join_next().await {
            passed += usize::from(ok?);
        }
        assert_eq!(passed, 100, "a tenth of 1,000 WCU/s");
        // The next simulated second admits it again.
        clock.advance(std::time::Duration::from_secs(1));
        client
            .update_item()
            .table_name(table)
            .key("pk", s("hot"))
            .update_expression("SET c = :c")
            .expression_attribute_values(":c", n(1))
            .send()
            .await?;
        // A read is counted on its key.
        client.get_item().table_name(table).key("pk", s("task-a")).send().await?;
        let r = meter.report();
        assert_eq!(r.max_rcu.get(&PartKey::table("task-a")).map(|p| p.units), Some(0.5));
        Ok(())
    }
}
