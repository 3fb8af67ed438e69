//! The workspace's layout, checked: no crate has a file-level import cycle, and every fixed
//! sleep in an integration test says why it stays (a test waits for a condition with a deadline,
//! `testkit::wait::until`, unless time itself is what it tests).

use std::path::Path;

use testkit::module_graph::{cycles, file_graph};

#[test]
fn no_crate_has_a_file_level_import_cycle() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for krate in workspace_members(&root)? {
        let krate = krate.as_str();
        if !root.join(krate).join("src").is_dir() {
            continue;
        }
        let graph = file_graph(&root.join(krate).join("src"))?;
        assert!(!graph.is_empty(), "{krate}: no source files found");
        for cycle in cycles(&graph) {
            found.push(format!("{krate}: {}", cycle.join(" → ")));
        }
    }
    assert!(found.is_empty(), "file-level import cycles:\n{}", found.join("\n"));
    Ok(())
}

/// Where the integration tests are: each package's `tests/` folder.
const TEST_HOMES: &[&str] = &[
    "services/orchestrator/tests",
    "services/tool-runner/tests",
    "tests/tests",
    "bench/tests",
    "crates/client/tests",
    "crates/demo/tests",
    "crates/mock-llm/tests",
    "crates/sim/tests",
    "crates/testkit/tests",
];

/// How far above a sleep its reason may be, in lines.
const REASON_WITHIN: usize = 4;

/// The most fixed sleeps the integration tests may have, their test subfolders included: each
/// one left is time as the subject (an outage, a pace), not a wait for a condition.
const MAX_SLEEPS: usize = 20;

/// The most integration-test binaries a package may build: each links the whole crate and its
/// dependencies again, so a package groups its tests by behaviour into a few (a folder with a
/// `main.rs` naming one module per behaviour), not a binary per file.
const MAX_TEST_BINARIES: usize = 4;

/// The test binaries cargo builds from `home`: each `.rs` file in it, and each folder holding a
/// `main.rs`.
fn test_binaries(home: &Path) -> anyhow::Result<Vec<String>> {
    let mut binaries = Vec::new();
    for entry in std::fs::read_dir(home)? {
        let path = entry?.path();
        let is_binary = if path.is_dir() {
            path.join("main.rs").is_file()
        } else {
            path.extension().is_some_and(|e| e == "rs")
        };
        if is_binary && let Some(name) = path.file_stem() {
            binaries.push(name.to_string_lossy().into_owned());
        }
    }
    binaries.sort();
    Ok(binaries)
}

#[test]
fn each_package_builds_a_few_test_binaries_grouped_by_behaviour() -> anyhow::Result<()> {
    let root = testkit::repo_root();
    let mut over = Vec::new();
    for home in TEST_HOMES {
        let binaries = test_binaries(&root.join(home))?;
        if binaries.len() > MAX_TEST_BINARIES {
            over.push(format!("{home}: {} ({})", binaries.len(), binaries.join(", ")));
        }
    }
    assert!(
        over.is_empty(),
        "more than {MAX_TEST_BINARIES} test binaries in a package: group the files by behaviour \
         into a folder with a main.rs\n{}",
        over.join("\n")
    );
    Ok(())
}

/// The `.rs` files under `dir`, its subfolders included (not `node_modules`).
fn rust_files(dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() && !path.ends_with("node_modules") {
            files.extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    Ok(files)
}

#[test]
fn every_fixed_sleep_in_an_integration_test_says_why_it_stays() -> anyhow::Result<()> {
    let root = testkit::repo_root();
    let mut unexplained = Vec::new();
    let mut sleeps = 0;
    for home in TEST_HOMES {
        for path in rust_files(&root.join(home))? {
            let text = std::fs::read_to_string(&path)?;
            let (found, missing) = unexplained_sleeps(&text);
            sleeps += found;
            unexplained.extend(missing.into_iter().map(|line| format!("{}:{line}", path.display())));
        }
    }
    assert!(sleeps > 0, "no sleep found at all: is the pattern stale?");
    assert!(
        sleeps <= MAX_SLEEPS,
        "{sleeps} fixed sleeps in the integration tests, at most {MAX_SLEEPS}: wait for a \
         condition (testkit::wait::until, until_paced) instead"
    );
    assert!(
        unexplained.is_empty(),
        "fixed sleeps without a `Stays:` reason within {REASON_WITHIN} lines above (wait for the \
         condition instead, testkit::wait::until):\n{}",
        unexplained.join("\n")
    );
    Ok(())
}

#[test]
fn a_sleep_without_its_reason_is_found() {
    let text = "fn a() {\n    // Stays: time is the subject.\n    tokio::time::sleep(d).await;\n    a();\n    b();\n    c();\n    let sleep = || Step::call(\"sleep\", x);\n    std::thread::sleep(d);\n    // std::thread::sleep(d);\n    let s = \"tokio::time::sleep(d)\";\n}\n";
    assert_eq!(unexplained_sleeps(text), (2, vec![8]));
}

/// How many `time::sleep(` / `thread::sleep(` calls `text` has (in code, not in a comment or
/// after a quote), and the lines (from 1) of those with no comment saying `Stays` just above.
fn unexplained_sleeps(text: &str) -> (usize, Vec<usize>) {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = 0;
    let mut missing = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        let called = ["time::sleep(", "thread::sleep("]
            .iter()
            .filter_map(|call| code.find(call))
            .any(|at| !code[..at].contains('"'));
        if !called {
            continue;
        }
        found += 1;
        let above = &lines[i.saturating_sub(REASON_WITHIN)..i];
        if !above
            .iter()
            .any(|l| l.trim_start().starts_with("//") && l.contains("Stays"))
        {
            missing.push(i + 1);
        }
    }
    (found, missing)
}

/// The workspace's crates as the root `Cargo.toml` lists them (`members = [...]`), so a new crate
/// is checked without being named here.
fn workspace_members(root: &Path) -> anyhow::Result<Vec<String>> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let start = manifest
        .find("members = [")
        .ok_or_else(|| anyhow::anyhow!("no `members = [` in the workspace's Cargo.toml"))?;
    let list = &manifest[start + "members = [".len()..];
    let list = &list[..list.find(']').unwrap_or(list.len())];
    let members: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect();
    anyhow::ensure!(members.len() >= 10, "too few workspace members read: {members:?}");
    Ok(members)
}

/// The child modules `text` (a `mod.rs` or `lib.rs`) declares, `tests` aside.
fn declared_children(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub ")
                .or_else(|| line.strip_prefix("pub(crate) "))
                .unwrap_or(line);
            rest.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .filter(|name| name != "tests")
        .collect()
}

/// Whether the module doc (`//!` lines) of `text` names `child`: `` `child` ``, [`child`],
/// `child.rs` or `child/`.
fn doc_names(text: &str, child: &str) -> bool {
    let doc: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    [
        format!("`{child}`"),
        format!("`{child}.rs`"),
        format!("`{child}/`"),
        format!("[`{child}`]"),
        format!("{child}.rs"),
    ]
    .iter()
    .any(|form| doc.contains(form.as_str()))
}

#[test]
fn every_module_map_names_every_child_module() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut missing = Vec::new();
    for krate in ["services/orchestrator", "services/tool-runner"] {
        let src = root.join(krate).join("src");
        for (module, path) in testkit::module_graph::modules(&src)? {
            let text = std::fs::read_to_string(&path)?;
            let is_map = path.ends_with("mod.rs") || path.ends_with("lib.rs");
            if !is_map {
                continue;
            }
            for child in declared_children(&text) {
                if !doc_names(&text, &child) {
                    missing.push(format!(
                        "{krate}/src/{}: its module doc does not name `{child}`",
                        module.join("/")
                    ));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "module maps that miss files:\n{}",
        missing.join("\n")
    );
    Ok(())
}

/// The text of docs/architecture.md.
fn architecture() -> anyhow::Result<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    Ok(std::fs::read_to_string(root.join("docs/architecture.md"))?)
}

/// The rows' first cells (`` `Name` ``) of the table under `heading` in `doc`.
fn table_names(doc: &str, heading: &str) -> std::collections::BTreeSet<String> {
    let section = doc.split(heading).nth(1).unwrap_or_default();
    section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .filter_map(|l| l.split('|').nth(1))
        .map(|cell| cell.trim().trim_matches('`').to_owned())
        .collect()
}

#[test]
fn the_architecture_map_lists_every_source_file() -> anyhow::Result<()> {
    let doc = architecture()?;
    let map = doc
        .split("## The map")
        .nth(1)
        .and_then(|m| m.split("### The RPCs").next())
        .unwrap_or_default();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut missing = Vec::new();
    for (krate, block) in [("services/orchestrator", 0), ("services/tool-runner", 1)] {
        let tree = map
            .split("```text")
            .nth(block + 1)
            .and_then(|b| b.split("```").next())
            .unwrap_or_default();
        let src = root.join(krate).join("src");
        for relative in testkit::module_graph::source_files(&src)? {
            if !in_tree(tree, &relative) {
                missing.push(format!("{krate}/src/{relative}"));
            }
        }
    }
    missing.sort();
    assert!(
        missing.is_empty(),
        "files docs/architecture.md's map does not list:\n{}",
        missing.join("\n")
    );
    Ok(())
}

/// Whether the indented tree lists `relative` (`a/b/c.rs`): its folders, each indented under the
/// one before, then the file's name on a line under the last folder.
fn in_tree(tree: &str, relative: &str) -> bool {
    let parts: Vec<&str> = relative.split('/').collect();
    let (file, folders) = parts.split_last().map_or(("", &[][..]), |(f, d)| (*f, d));
    let mut depth = 0;
    let mut lines = tree.lines();
    for folder in folders {
        let wanted = format!("{folder}/");
        let found = lines.by_ref().any(|l| {
            let indent = (l.len() - l.trim_start().len()) / 2;
            indent == depth && l.split_whitespace().next() == Some(wanted.as_str())
        });
        if !found {
            return false;
        }
        depth += 1;
    }
    lines
        .take_while(|l| (l.len() - l.trim_start().len()) / 2 >= depth || l.trim().is_empty())
        .filter(|l| (l.len() - l.trim_start().len()) / 2 == depth)
        .any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            // A line lists file names until its description starts.
            words.iter().take_while(|w| w.ends_with(".rs")).any(|w| *w == file)
        })
}

#[test]
fn the_architecture_rpc_table_lists_the_protos_rpcs() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut rpcs = std::collections::BTreeSet::new();
    for proto in [
        "proto/orchestrator/v1/orchestrator.proto",
        "proto/toolrunner/v1/tool_runner.proto",
    ] {
        for line in std::fs::read_to_string(root.join(proto))?.lines() {
            if let Some(rest) = line.trim().strip_prefix("rpc ") {
                rpcs.insert(rest.split('(').next().unwrap_or_default().trim().to_owned());
            }
        }
    }
    assert!(rpcs.len() >= 9, "{rpcs:?}");
    assert_eq!(table_names(&architecture()?, "### The RPCs"), rpcs);
    Ok(())
}

#[test]
fn the_architecture_ports_table_lists_the_ports() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let domain = root.join("services/orchestrator/src/domain");
    let ports = std::fs::read_to_string(domain.join("ports.rs"))? + &std::fs::read_to_string(domain.join("model.rs"))?;
    let traits: std::collections::BTreeSet<String> = ports
        .lines()
        .filter_map(|l| l.strip_prefix("pub trait "))
        .map(|rest| {
            rest.split(|c: char| !c.is_alphanumeric())
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(traits.len() >= 7, "{traits:?}");
    assert_eq!(table_names(&architecture()?, "### The ports"), traits);
    Ok(())
}

#[test]
fn the_tree_reader_finds_files_by_their_folders() {
    let tree = "main.rs lib.rs\nrun/    the loop\n  mod.rs  its map\n  tool_loop/   x\n    rules.rs  rules\n  live.rs   live\nstore/\n  mod.rs\n";
    assert!(in_tree(tree, "main.rs"));
    assert!(in_tree(tree, "run/tool_loop/rules.rs"));
    assert!(in_tree(tree, "run/live.rs"));
    assert!(in_tree(tree, "store/mod.rs"));
    assert!(
        !in_tree(tree, "run/rules.rs"),
        "a file in a sub-folder is not its parent's"
    );
    assert!(!in_tree(tree, "store/live.rs"));
    assert!(!in_tree(tree, "error.rs"));
}

/// The lines of `text` outside its tests that name one of `adapters` (`crate::llm`, …).
fn adapter_imports(text: &str, adapters: &[&str]) -> Vec<usize> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    code.lines()
        .enumerate()
        .filter(|(_, line)| {
            let line = line.split("//").next().unwrap_or_default();
            adapters.iter().any(|adapter| line.contains(adapter))
        })
        .map(|(n, _)| n + 1)
        .collect()
}

/// The loop (`run/`) sees the outside through the domain's ports alone: it names no adapter
/// (the model's HTTP, the stores, the signal topics, the runners' client, the server) and no
/// network library, so it is unit-tested without a network and an adapter changes alone.
#[test]
fn the_loop_imports_the_domain_and_no_adapter() -> anyhow::Result<()> {
    let adapters = [
        "crate::llm",
        "crate::store",
        "crate::signals",
        "crate::tool_runners",
        "crate::server",
        "crate::wire",
        "tonic::",
        "reqwest::",
        "async_nats::",
    ];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/orchestrator/src");
    let mut found = Vec::new();
    for relative in testkit::module_graph::source_files(&src.join("run"))? {
        if relative.ends_with("tests.rs") || relative.contains("tests/") {
            continue;
        }
        let text = std::fs::read_to_string(src.join("run").join(&relative))?;
        let lines = adapter_imports(&text, &adapters);
        found.extend(lines.into_iter().map(|line| format!("run/{relative}:{line}")));
    }
    assert!(found.is_empty(), "the loop names an adapter:\n{}", found.join("\n"));
    Ok(())
}

#[test]
fn an_adapter_import_is_found_outside_tests_only() {
    let text = "use crate::domain::model::ChatModel;\nuse crate::llm::body;\n// crate::store\n#[cfg(test)]\nmod tests { use crate::store::memory; }\n";
    assert_eq!(adapter_imports(text, &["crate::llm", "crate::store"]), vec![2]);
}

/// The spawns in `text` made with Tokio's own `spawn` rather than `shared::tasks::spawn`, by line
/// (comments and strings aside).
fn raw_spawns(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or_default();
            let code = code.split('"').step_by(2).collect::<String>();
            code.contains("tokio::spawn(") || code.contains("task::spawn(") || code.contains("runtime.spawn(")
        })
        .map(|(n, _)| n + 1)
        .collect()
}

/// Every task the orchestrator spawns belongs to the process that spawned it: the simulation
/// stops (SIGSTOP) and kills (SIGKILL) a replica's tasks through `shared::tasks`, so a task
/// spawned around it would go on running in a stopped or killed replica.
#[test]
fn every_task_the_orchestrator_spawns_is_its_replicas() -> anyhow::Result<()> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/orchestrator/src");
    let mut raw = Vec::new();
    for relative in testkit::module_graph::source_files(&src)? {
        let is_test = relative.ends_with("tests.rs") || relative.contains("/tests/");
        if is_test {
            continue;
        }
        let text = std::fs::read_to_string(src.join(&relative))?;
        raw.extend(raw_spawns(&text).into_iter().map(|line| format!("{relative}:{line}")));
    }
    assert!(
        raw.is_empty(),
        "tasks spawned with tokio's own spawn (use shared::tasks::spawn):\n{}",
        raw.join("\n")
    );
    Ok(())
}

#[test]
fn a_raw_spawn_is_found() {
    let text = "let a = shared::tasks::spawn(x);\nlet b = tokio::spawn(y);\n// tokio::spawn(z)\nlet c = \"tokio::spawn(\";\nhandle.runtime.spawn(w);\n";
    assert_eq!(raw_spawns(text), vec![2, 5]);
}
