//! The report: markdown, one section per part, rewritten to its file after every part.

use std::path::PathBuf;
use std::time::Duration;

use crate::Opts;

pub struct Report {
    path: PathBuf,
    header: String,
    sections: Vec<String>,
}

impl Report {
    pub fn new(opts: &Opts) -> anyhow::Result<Self> {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let header = format!(
            "# Relay performance report\n\n{} run, {} binaries, {} × {cores} cores ({}), {}.\n",
            if opts.quick { "Smoke (`--quick`: small numbers, timings not meaningful)" } else { "Full" },
            if opts.bin_dir.ends_with("release") { "release" } else { "debug" },
            std::env::consts::ARCH,
            cpu,
            {
                use relay_shared::time::Clock;
                relay_shared::time::SystemClock.now().to_rfc3339()
            },
        );
        let r = Self { path: opts.out.clone(), header, sections: Vec::new() };
        r.save()?;
        Ok(r)
    }

    pub fn add(&mut self, part: &str, text: &str, took: Duration) -> anyhow::Result<()> {
        self.sections.push(format!("{}\n_(part `{part}` took {:.0} s)_\n", text.trim_end(), took.as_secs_f64()));
        self.save()
    }

    pub fn text(&self) -> String {
        let mut s = self.header.clone();
        for sec in &self.sections {
            s.push('\n');
            s.push_str(sec);
        }
        s
    }

    fn save(&self) -> anyhow::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&self.path, self.text())?;
        Ok(())
    }
}
