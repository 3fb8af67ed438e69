//! The crate's architecture, checked: its top-level modules form a graph without cycles, the
//! domain is a leaf, and the loop and its adapters (store, signal topic, telemetry) depend on the
//! domain and its ports, never on each other or on the clap settings (docs/architecture.md,
//! "Layout").
//!
//! Read from the source by `testkit::module_graph` (which also keeps every crate free of
//! file-level cycles, `tests/tests/layout.rs`): the file graph, folded to top-level modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use testkit::module_graph::{cycles, file_graph};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Top-level module → the other top-level modules its non-test code names (from the file graph).
fn graph() -> anyhow::Result<Graph> {
    let files = file_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))?;
    let top = |file: &str| -> String {
        file.split('/')
            .next()
            .unwrap_or_default()
            .trim_end_matches(".rs")
            .to_owned()
    };
    let mut graph = Graph::new();
    for (file, uses) in &files {
        let module = top(file);
        if module == "lib" || module == "main" {
            continue;
        }
        let entry = graph.entry(module.clone()).or_default();
        entry.extend(uses.iter().map(|f| top(f)).filter(|m| *m != module && m != "lib"));
    }
    Ok(graph)
}

#[test]
fn the_modules_form_no_cycle() -> anyhow::Result<()> {
    let graph = graph()?;
    assert!(graph.len() > 10, "the modules were not found: {graph:?}");
    let found = cycles(&graph);
    assert!(found.is_empty(), "module cycles: {found:?}");
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
