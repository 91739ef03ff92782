//! Every line the relay logs and every metric it emits, captured in memory — in the production
//! format (`relay_shared::telemetry`) — so a test can prove no secret or token reaches them.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// The captured output of this process.
#[derive(Clone)]
pub struct Captured {
    buf: Arc<Mutex<Vec<u8>>>,
    metrics: Option<&'static metrics_cloudwatch_embedded::Collector>,
}

#[derive(Clone)]
struct SharedBuf(Arc<Mutex<Vec<u8>>>);

impl Write for SharedBuf {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(data);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

static CAPTURED: OnceLock<Captured> = OnceLock::new();

/// Installs the capture (once per process): the relay's JSON log subscriber writing here, and
/// the CloudWatch EMF metrics recorder.
pub fn capture() -> Captured {
    CAPTURED
        .get_or_init(|| {
            let buf = Arc::new(Mutex::new(Vec::new()));
            let w = SharedBuf(buf.clone());
            relay_shared::telemetry::init_with_writer(move || w.clone());
            Captured { buf, metrics: relay_shared::telemetry::metrics_init("sim").ok() }
        })
        .clone()
}

impl Captured {
    /// Every log line so far, and the metrics flushed as EMF documents.
    pub fn text(&self) -> String {
        let mut out = self.buf.lock().map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        if let Some(c) = self.metrics {
            let mut m = Vec::new();
            let _ = c.flush(&mut m);
            out.push_str(&String::from_utf8_lossy(&m));
        }
        out
    }

    /// The secrets (or tokens) from `needles` that appear anywhere in the output.
    pub fn leaks<'a>(&self, needles: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let text = self.text();
        needles.into_iter().filter(|n| n.len() >= 8 && text.contains(*n)).map(str::to_owned).collect()
    }
}
