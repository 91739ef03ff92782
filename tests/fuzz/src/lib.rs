//! Helpers for the property tests and the fuzz targets: how many cases to run, and the seed
//! corpus kept in the repo (`tests/fuzz/corpus/<target>/`), which every run replays and which
//! the generators mutate.
//!
//! `FUZZ_CASES` sets the number of generated inputs per target (the documented run uses
//! 1,000,000; the test command a few thousand). Failures are kept by proptest next to the
//! corpus (`corpus/<target>.regressions`) and replayed first on every run.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

/// Generated inputs per target: `FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A proptest config for `target`: its case count, its failures kept in the corpus directory.
pub fn config(target: &'static str, default_cases: u32) -> Config {
    let path: &'static str =
        Box::leak(format!("{}/corpus/{target}.regressions", env!("CARGO_MANIFEST_DIR")).into_boxed_str());
    Config {
        cases: cases(default_cases),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(path))),
        max_shrink_iters: 2_000,
        ..Config::default()
    }
}

/// The seed inputs of a target (one file each).
pub fn corpus(target: &str) -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    let mut files: Vec<_> =
        std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    files.sort();
    files.into_iter().filter_map(|p| std::fs::read(p).ok()).map(|b| String::from_utf8_lossy(&b).into_owned()).collect()
}

/// Inputs: seeds from the corpus, seeds with random edits (bytes flipped, cut, spliced with
/// noise), and arbitrary text — so most inputs are near-valid and reach deep into the parser.
pub fn inputs(target: &str) -> BoxedStrategy<String> {
    let seeds = corpus(target);
    let arbitrary = any::<String>().boxed();
    if seeds.is_empty() {
        return arbitrary;
    }
    let pick = proptest::sample::select(seeds);
    let mutated = (pick.clone(), any::<u64>(), proptest::collection::vec(any::<char>(), 0..8))
        .prop_map(|(seed, r, noise)| mutate(&seed, r, &noise));
    prop_oneof![2 => pick, 5 => mutated, 3 => arbitrary].boxed()
}

/// One random edit of `seed`, chosen by `r`.
pub fn mutate(seed: &str, r: u64, noise: &[char]) -> String {
    let chars: Vec<char> = seed.chars().collect();
    if chars.is_empty() {
        return noise.iter().collect();
    }
    let at = (r as usize >> 3) % chars.len();
    let noise: String = noise.iter().collect();
    let (head, tail): (String, String) = (chars[..at].iter().collect(), chars[at..].iter().collect());
    match r % 6 {
        0 => format!("{head}{noise}{tail}"), // insert
        1 => format!("{head}{}", tail.chars().skip(noise.len().max(1)).collect::<String>()), // delete
        2 => head,                           // truncate
        3 => format!("{head}{noise}"),       // replace the tail
        4 => format!("{seed}{seed}"),        // repeat
        _ => seed.to_uppercase(),            // change case
    }
}

/// One runtime for a test binary's properties (proptest bodies are synchronous).
pub fn rt() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"))
    })
}
