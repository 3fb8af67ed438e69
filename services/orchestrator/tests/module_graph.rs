//! The crate's architecture, checked: its top-level modules form a graph without cycles, the
//! domain is a leaf, and the loop and its adapters (store, signal topic, telemetry) depend on the
//! domain and its ports, never on each other or on the clap settings (docs/architecture.md,
//! "Layout").
//!
//! Read from the source: every `crate::<module>` path outside `#[cfg(test)]` code (and outside
//! `tests.rs` files, which are test modules) counts, as do
//! `crate::Error` (the `error` module) and `crate::Config` (the `config` module).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Module → the other modules its non-test code names.
fn graph() -> anyhow::Result<Graph> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeSet::new();
    for entry in std::fs::read_dir(&src)? {
        let name = entry?.file_name().to_string_lossy().trim_end_matches(".rs").to_owned();
        if name != "lib" && name != "main" {
            modules.insert(name);
        }
    }
    let mut graph = Graph::new();
    for module in &modules {
        let mut uses = BTreeSet::new();
        for file in files(&src, module)? {
            let text = std::fs::read_to_string(&file)?;
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for name in named_modules(code) {
                let target = match name.as_str() {
                    "Error" => "error".to_owned(),
                    "Config" => "config".to_owned(),
                    other => other.to_owned(),
                };
                if modules.contains(&target) && target != *module {
                    uses.insert(target);
                }
            }
        }
        graph.insert(module.clone(), uses);
    }
    Ok(graph)
}

/// The first segment of every `crate::` path in `code`, `crate::{a, b::c}` included.
fn named_modules(code: &str) -> Vec<String> {
    let ident = |text: &str| -> String {
        text.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + 7..];
        match rest.strip_prefix('{') {
            Some(group) => {
                let group = group.split('}').next().unwrap_or_default();
                names.extend(group.split(',').map(ident));
            }
            None => names.push(ident(rest)),
        }
    }
    names
}

/// The source files of a top-level module: `name.rs`, or everything under `name/`.
fn files(src: &Path, module: &str) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let file = src.join(format!("{module}.rs"));
    if file.exists() {
        return Ok(vec![file]);
    }
    let mut found = Vec::new();
    let mut dirs = vec![src.join(module)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("tests.rs") {
                found.push(path);
            }
        }
    }
    Ok(found)
}

/// A cycle through `start`, if any, as the path that closes it.
fn cycle(graph: &Graph, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_owned()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last()?;
        for next in graph.get(last).into_iter().flatten() {
            if next == start {
                let mut closed = path.clone();
                closed.push(next.clone());
                return Some(closed);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn the_modules_form_no_cycle() -> anyhow::Result<()> {
    let graph = graph()?;
    assert!(graph.len() > 10, "the modules were not found: {graph:?}");
    for module in graph.keys() {
        if let Some(path) = cycle(&graph, module) {
            panic!("module cycle: {}", path.join(" → "));
        }
    }
    Ok(())
}

#[test]
fn the_domain_is_a_leaf() -> anyhow::Result<()> {
    let graph = graph()?;
    assert_eq!(
        graph.get("domain"),
        Some(&BTreeSet::new()),
        "domain must depend on nothing"
    );
    Ok(())
}

#[test]
fn the_loop_and_its_adapters_depend_on_the_domain_not_on_each_other_or_the_settings() -> anyhow::Result<()> {
    let graph = graph()?;
    let core = ["run", "store", "signals", "telemetry"];
    for module in core {
        let uses = graph.get(module).cloned().unwrap_or_default();
        assert!(!uses.contains("config"), "{module} uses the clap settings: {uses:?}");
        for other in core.iter().filter(|o| **o != module && **o != "telemetry") {
            assert!(!uses.contains(*other), "{module} depends on {other}: {uses:?}");
        }
    }
    assert_eq!(
        graph.get("telemetry").cloned().unwrap_or_default(),
        BTreeSet::from(["domain".to_owned()])
    );
    Ok(())
}

#[test]
fn paths_and_groups_name_their_modules() {
    assert_eq!(
        named_modules("use crate::run::X; use crate::{Config, store::memory};"),
        ["run", "Config", "store"]
    );
}

#[test]
fn a_cycle_is_found_when_there_is_one() {
    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .into_iter()
        .map(|(from, to)| (from.to_owned(), BTreeSet::from([to.to_owned()])))
        .collect();
    assert_eq!(
        cycle(&graph, "a"),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(cycle(&graph, "d"), None);
}
