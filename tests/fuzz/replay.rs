//! Shared by every fuzz target (docs/fuzzing.md), included with `#[path]` so the three crates that
//! own a parser replay one corpus folder the same way: the committed seeds first, then generated
//! cases, as many as `PROPTEST_CASES` says.

use std::path::PathBuf;

use proptest::test_runner::{Config, FileFailurePersistence};

/// What a seed's file name promises: `ok-*` must be accepted, `bad-*` refused, anything else only
/// has to keep the target's properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Accept,
    Refuse,
    Either,
}

pub struct Seed {
    pub name: String,
    pub bytes: Vec<u8>,
    pub expect: Expect,
}

/// The seeds of `tests/fuzz/corpus/<target>/`, sorted by name. Panics (failing the test) when the
/// folder is missing or empty, so a moved corpus cannot silently replay nothing.
pub fn seeds(workspace_root: &str, target: &str) -> Vec<Seed> {
    let dir: PathBuf = [workspace_root, "tests", "fuzz", "corpus", target]
        .iter()
        .collect();
    let mut seeds: Vec<Seed> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("corpus file names are UTF-8")
                .to_owned();
            let bytes = std::fs::read(&path).expect("corpus file");
            let expect = if name.starts_with("ok-") {
                Expect::Accept
            } else if name.starts_with("bad-") {
                Expect::Refuse
            } else {
                Expect::Either
            };
            Seed {
                name,
                bytes,
                expect,
            }
        })
        .collect();
    assert!(!seeds.is_empty(), "corpus {} is empty", dir.display());
    seeds.sort_by(|a, b| a.name.cmp(&b.name));
    seeds
}

/// `default` generated cases, or `PROPTEST_CASES` when set (the long runs in docs/fuzzing.md).
/// Failures are not persisted beside the sources: a case worth keeping goes into the corpus.
pub fn config(default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..Config::default()
    }
}
