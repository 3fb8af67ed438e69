//! Every recorded stream in `tests/fixtures/llm-streams/` must parse to exactly the `expected`
//! block of its `.json`: outcome, tool calls (names and arguments as JSON values) and text
//! (compared after trimming trailing whitespace). Fixtures are discovered when the tests run, so
//! a new recording is tested without code changes. For each fixture a property test also checks
//! that any re-chunking of the same bytes gives the same calls and text, and byte-at-a-time
//! feeding is checked explicitly.
//!
//! The bytes go through the same path as in a run: the SSE decoder, then the turn collector
//! (assembly, fallback hold-back).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use libtest_mimic::{Arguments, Failed, Trial};
use orchestrator::domain::model::LlmError;
use orchestrator::llm::sse::{DecodeLimits, decode};
use orchestrator::run::fallback::Resolution;
use orchestrator::run::turn::TurnCollector;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::Value;

/// What one stream produced.
#[derive(Debug, Clone, PartialEq)]
struct Parsed {
    outcome: &'static str,
    error: Option<String>,
    calls: Vec<(String, Value)>,
    text: String,
}

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm-streams")
}

/// Feeds `chunks` through the decoder and a turn collector.
fn parse(chunks: Vec<Vec<u8>>) -> Result<Parsed, Failed> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    Ok(runtime.block_on(async move {
        let stream = futures::stream::iter(chunks.into_iter().map(|c| Ok::<_, std::io::Error>(Bytes::from(c))));
        let limits = DecodeLimits {
            idle_timeout: std::time::Duration::from_secs(10),
            max_line_bytes: 1 << 20,
            max_event_bytes: 4 << 20,
        };
        let mut events = decode(stream, limits);
        let mut collector = TurnCollector::default();
        let mut text = String::new();
        let mut error: Option<LlmError> = None;
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => text.extend(collector.push(event)),
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = error {
            text.push_str(collector.held_text());
            return Parsed {
                outcome: "llm_error",
                error: Some(e.to_string()),
                calls: Vec::new(),
                text,
            };
        }
        let output = collector.finish();
        let as_json = |s: &str| serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_owned()));
        let mut calls: Vec<(String, Value)> = output
            .structured
            .iter()
            .map(|c| (c.name.clone(), as_json(&c.arguments)))
            .collect();
        match output.resolution {
            Resolution::Text(t) => text.push_str(&t),
            Resolution::Calls {
                calls: found, stripped, ..
            } => {
                text.push_str(&stripped);
                calls.extend(found.into_iter().map(|c| (c.name, as_json(&c.arguments))));
            }
            Resolution::Malformed { raw, .. } => text.push_str(&raw),
        }
        Parsed {
            outcome: "ok",
            error: None,
            calls,
            text,
        }
    }))
}

fn read(path: &Path) -> Result<Vec<u8>, Failed> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

fn check(path: &Path) -> Result<(), Failed> {
    let sse = read(path)?;
    let meta_path = path.with_extension("json");
    let meta: Value =
        serde_json::from_slice(&read(&meta_path)?).map_err(|e| format!("{}: {e}", meta_path.display()))?;
    let expected = &meta["expected"];
    let parsed = parse(vec![sse])?;

    let want_outcome = expected["outcome"].as_str().unwrap_or("ok");
    if parsed.outcome != want_outcome {
        return Err(format!(
            "outcome {:?}, expected {want_outcome:?} (error: {:?})",
            parsed.outcome, parsed.error
        )
        .into());
    }
    if let Some(fragment) = expected["error_contains"].as_str() {
        let error = parsed.error.clone().unwrap_or_default();
        if !error.contains(fragment) {
            return Err(format!("error {error:?} should contain {fragment:?}").into());
        }
    }
    let want_calls: Vec<(String, Value)> = expected["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_owned(),
                c["arguments"].clone(),
            )
        })
        .collect();
    if parsed.calls != want_calls {
        return Err(format!("tool calls\n  got      {:?}\n  expected {want_calls:?}", parsed.calls).into());
    }
    let want_text = expected["text"].as_str().unwrap_or_default().trim_end();
    if parsed.text.trim_end() != want_text {
        return Err(format!(
            "text\n  got      {:?}\n  expected {want_text:?}",
            parsed.text.trim_end()
        )
        .into());
    }
    Ok(())
}

/// Any split of the bytes into chunks gives what the unsplit bytes give.
fn rechunking(path: &Path) -> Result<(), Failed> {
    let sse = read(path)?;
    let whole = parse(vec![sse.clone()])?;
    let len = sse.len();
    let config = ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    runner
        .run(&proptest::collection::vec(0..=len, 0..24), |mut cuts| {
            cuts.sort_unstable();
            cuts.dedup();
            let mut chunks = Vec::with_capacity(cuts.len() + 1);
            let mut start = 0;
            for cut in cuts.into_iter().chain([len]) {
                chunks.push(sse[start..cut].to_vec());
                start = cut;
            }
            let split = parse(chunks).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
            prop_assert_eq!(&split.outcome, &whole.outcome);
            prop_assert_eq!(&split.calls, &whole.calls);
            prop_assert_eq!(&split.text, &whole.text);
            Ok(())
        })
        .map_err(|e| Failed::from(format!("re-chunking changed the result: {e}")))
}

/// Byte-at-a-time is the most extreme chunking; checked explicitly on every fixture.
fn byte_by_byte(path: &Path) -> Result<(), Failed> {
    let sse = read(path)?;
    let whole = parse(vec![sse.clone()])?;
    let split = parse(sse.iter().map(|b| vec![*b]).collect())?;
    if split != whole {
        return Err(format!("byte-by-byte\n  got      {split:?}\n  expected {whole:?}").into());
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let mut fixtures: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "sse"))
                .collect()
        })
        .unwrap_or_default();
    fixtures.sort();
    let mut trials = Vec::new();
    if fixtures.is_empty() {
        let dir = fixtures_dir();
        trials.push(Trial::test("fixtures_present", move || {
            Err(format!("no .sse fixtures in {}", dir.display()).into())
        }));
    }
    for path in fixtures {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (a, b, c) = (path.clone(), path.clone(), path);
        trials.push(Trial::test(format!("fixture::{name}"), move || check(&a)));
        trials.push(Trial::test(format!("rechunk::{name}"), move || rechunking(&b)));
        trials.push(Trial::test(format!("byte_by_byte::{name}"), move || byte_by_byte(&c)));
    }
    libtest_mimic::run(&args, trials).exit();
}
