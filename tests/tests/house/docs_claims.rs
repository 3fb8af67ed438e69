//! Claims the docs make about the project, checked: README stays within its 250 lines, and every
//! measured figure README quotes is read from the benchmark report its paragraph names
//! (`bench/results/*.md`, `bench/README.md`), so a figure cannot outlive the measurement it came
//! from, nor be written without one.

use std::path::Path;
use std::sync::LazyLock;

use regex::Regex;

type TestResult = anyhow::Result<()>;

/// The front door's length: what does not fit goes to docs/.
const README_MAX_LINES: usize = 250;

#[test]
fn readme_stays_within_its_line_limit() -> TestResult {
    let readme = std::fs::read_to_string(testkit::repo_root().join("README.md"))?;
    let lines = readme.lines().count();
    anyhow::ensure!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, over {README_MAX_LINES}: move detail to docs/"
    );
    Ok(())
}

#[test]
fn every_figure_in_readme_is_in_the_bench_report_it_names() -> TestResult {
    let root = testkit::repo_root();
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let mut wrong = Vec::new();
    let mut checked = 0;
    for block in blocks_with_reports(&readme) {
        let figures = figures(&block.text);
        if figures.is_empty() {
            continue;
        }
        if block.reports.is_empty() {
            wrong.push(format!(
                "figures {figures:?} in a paragraph naming no bench report: {:?}",
                block.text
            ));
            continue;
        }
        let texts: Vec<String> = block
            .reports
            .iter()
            .map(|r| std::fs::read_to_string(root.join(r)).map(|t| normalize(&t)))
            .collect::<Result<_, _>>()?;
        for figure in figures {
            checked += 1;
            if !texts.iter().any(|t| holds_number(t, &figure)) {
                wrong.push(format!("{figure} is in none of {:?}", block.reports));
            }
        }
    }
    anyhow::ensure!(wrong.is_empty(), "README's figures:\n{}", wrong.join("\n"));
    anyhow::ensure!(
        checked >= 10,
        "only {checked} figures found in README: is the pattern stale?"
    );
    Ok(())
}

#[test]
fn a_figure_missing_from_its_report_is_found() {
    let readme = "## Performance\n\nPer token (bench/README.md): 12.5 µs, ×0.45.\n\n| a | 3.25 µs |\n";
    let blocks = blocks_with_reports(readme);
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        blocks[1].reports,
        vec!["bench/README.md".to_owned()],
        "a table takes its paragraph's report"
    );
    assert_eq!(figures(&blocks[0].text), vec!["12.5", "0.45"]);
    assert!(holds_number("cpu 12.5 µs", "12.5"));
    assert!(!holds_number("cpu 112.55 µs", "12.5"));
    assert_eq!(
        figures("agentic-api 0.9, SDK 0.24, --stream-interval 20ms, 2 cores"),
        vec!["20"]
    );
    assert_eq!(figures("above gRPC's 4 MiB, 23.4 KiB each"), vec!["23.4"]);
}

/// A paragraph or table of README and the reports it draws on: those it names, else those of
/// the paragraph before it in the same section.
struct Block {
    text: String,
    reports: Vec<String>,
}

fn blocks_with_reports(readme: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut carried: Vec<String> = Vec::new();
    let mut in_code = false;
    for chunk in readme.split("\n\n") {
        if chunk.trim_start().starts_with("```") || in_code {
            in_code ^= chunk.matches("```").count() % 2 == 1;
            continue;
        }
        if chunk.trim_start().starts_with('#') {
            carried.clear();
            continue;
        }
        let named = reports(chunk);
        if !named.is_empty() {
            carried = named;
        }
        blocks.push(Block {
            text: chunk.to_owned(),
            reports: carried.clone(),
        });
    }
    blocks
}

/// The bench reports a text names.
fn reports(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices("bench/") {
        let rest = &text[at..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | ',' | ';' | '`'))
            .unwrap_or(rest.len());
        let path = rest[..end].trim_end_matches('.');
        if path.ends_with(".md") && Path::new(path).components().count() >= 2 {
            found.push(path.to_owned());
        }
    }
    found
}

/// The measured figures of a text: a number with a unit of time or share, a size with a decimal
/// point (`23.4 KiB`; `4 MiB` is a limit), one after `×`, or a ratio written to three places
/// (`0.132`); versions and counts are not figures.
fn figures(text: &str) -> Vec<String> {
    static PATTERN: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?:×(?P<ratio>\d+(?:\.\d+)?))|(?P<num>-?\d+(?:\.\d+)?)\s?(?:µs|ms|%)|(?P<size>-?\d+\.\d+)\s?(?:KiB|MiB)|\b(?P<fine>0\.\d{3})\b")
            .unwrap_or_else(|e| panic!("the figure pattern: {e}"))
    });
    PATTERN
        .captures_iter(&normalize(text))
        .filter_map(|c| c.name("ratio").or(c.name("num")).or(c.name("size")).or(c.name("fine")))
        .map(|m| m.as_str().to_owned())
        .collect()
}

/// One minus sign, no thousands separators.
fn normalize(text: &str) -> String {
    static SEPARATOR: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"(\d),(\d{3})\b").unwrap_or_else(|e| panic!("the separator pattern: {e}")));
    SEPARATOR.replace_all(&text.replace('−', "-"), "$1$2").into_owned()
}

/// Whether `number` stands in `text` as a whole number (not inside a longer one).
fn holds_number(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + number.len()..].chars().next();
        let digit_or_point = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit() || c == '.');
        let after_is_decimal =
            after == Some('.') && text[at + number.len() + 1..].starts_with(|c: char| c.is_ascii_digit());
        !(digit_or_point(before) || after.is_some_and(|c| c.is_ascii_digit()) || after_is_decimal)
    })
}
