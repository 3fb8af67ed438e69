//! The crate's architecture, checked: its top-level modules form a graph without cycles, the
//! domain is a leaf, the loop and its adapters (store, signal topic, telemetry) depend on the
//! domain and its ports, never on each other or on the clap settings, and every edge between
//! modules is one the table in docs/architecture.md ("Inside the orchestrator") allows, each edge
//! the table allows existing (so the table cannot drift either way).
//!
//! Read from the source by `testkit::module_graph` (which also keeps every crate free of
//! file-level cycles, `tests/tests/house/layout.rs`): the file graph, folded to top-level modules.

use std::collections::{BTreeMap, BTreeSet};

use testkit::module_graph::{cycles, file_graph};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Where the table of allowed edges is, and the line that opens it.
const ARCHITECTURE: &str = "docs/architecture.md";
const TABLE_MARK: &str = "| module | depends on |";

/// Top-level module → the other top-level modules its non-test code names (from the file graph).
fn graph() -> anyhow::Result<Graph> {
    let files = file_graph(&testkit::repo_root().join("services/orchestrator/src"))?;
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

/// The table's edges: `| `module` | `a`, `b` |` rows under [`TABLE_MARK`] (`nothing` for none).
fn allowed_edges(doc: &str) -> anyhow::Result<Graph> {
    let start = doc
        .find(TABLE_MARK)
        .ok_or_else(|| anyhow::anyhow!("{ARCHITECTURE} has no {TABLE_MARK:?} table"))?;
    let mut allowed = Graph::new();
    for row in doc[start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let [module, uses] = cells[..] else {
            anyhow::bail!("a row of two cells: {row:?}");
        };
        let names = |cell: &str| -> BTreeSet<String> {
            cell.split(',')
                .map(|n| n.trim().trim_matches('`').to_owned())
                .filter(|n| !n.is_empty() && n != "nothing")
                .collect()
        };
        allowed.insert(module.trim_matches('`').to_owned(), names(uses));
    }
    Ok(allowed)
}

/// What differs between the code's edges and the table's: edges the table does not allow, and
/// edges it allows that the code does not have.
fn drift(graph: &Graph, allowed: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    for (module, uses) in graph {
        let Some(may) = allowed.get(module) else {
            found.push(format!("module `{module}` has no row"));
            continue;
        };
        found.extend(
            uses.difference(may)
                .map(|m| format!("`{module}` → `{m}` is not allowed")),
        );
        found.extend(
            may.difference(uses)
                .map(|m| format!("`{module}` → `{m}` is allowed but absent")),
        );
    }
    found.extend(
        allowed
            .keys()
            .filter(|m| !graph.contains_key(*m))
            .map(|m| format!("row `{m}` names no module")),
    );
    found
}

#[test]
fn every_edge_is_one_the_architecture_allows_and_every_allowed_edge_exists() -> anyhow::Result<()> {
    let doc = std::fs::read_to_string(testkit::repo_root().join(ARCHITECTURE))?;
    let found = drift(&graph()?, &allowed_edges(&doc)?);
    assert!(
        found.is_empty(),
        "{ARCHITECTURE}'s module table against the code:\n{}",
        found.join("\n")
    );
    Ok(())
}

#[test]
fn an_edge_the_table_does_not_allow_is_found() -> anyhow::Result<()> {
    let doc = format!("{TABLE_MARK}\n| --- | --- |\n| `domain` | nothing |\n| `run` | `domain` |\n");
    let allowed = allowed_edges(&doc)?;
    let mut graph = Graph::new();
    graph.insert("domain".into(), BTreeSet::new());
    graph.insert("run".into(), BTreeSet::from(["domain".to_owned(), "server".to_owned()]));
    assert_eq!(drift(&graph, &allowed), ["`run` → `server` is not allowed"]);
    graph.insert("run".into(), BTreeSet::new());
    assert_eq!(drift(&graph, &allowed), ["`run` → `domain` is allowed but absent"]);
    Ok(())
}
