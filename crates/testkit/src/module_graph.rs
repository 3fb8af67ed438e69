//! A crate's source files as a graph of which file names which, read from the source text, and
//! the cycles in it: the check that keeps every crate free of file-level import cycles
//! (docs/architecture.md, "Layout").
//!
//! A file names another when its non-test code holds a path that resolves to the other's module:
//! `crate::a::b::Item`, `super::sibling::Item`, `self::child::Item`, groups (`crate::{a, b::{c,
//! d}}`) included, and paths that start with a child module's name (`child::Item`). A file using
//! an item of a module it is inside (`super::Item`, `crate::Error`) does not count: a child using
//! its parent's items is how Rust modules are built. Comments, `#[cfg(test)]` items, `tests.rs`
//! files and the files of a `tests/` folder do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path inside a crate: `[]` for the root, `["run", "live"]` for `crate::run::live`.
pub type ModulePath = Vec<String>;

/// File (relative to `src/`) → the files its code names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// Every file under `src`, as paths relative to it with `/` between folders, sorted.
pub fn source_files(src: &Path) -> anyhow::Result<Vec<String>> {
    let mut found = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                found.push(path.strip_prefix(src)?.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The files of a crate's library (or of its binary when it has no library), by module path.
pub fn modules(src: &Path) -> anyhow::Result<BTreeMap<ModulePath, PathBuf>> {
    let root = if src.join("lib.rs").exists() {
        "lib.rs"
    } else {
        "main.rs"
    };
    let mut found = BTreeMap::new();
    for relative in source_files(src)? {
        let Some(stem) = relative.strip_suffix(".rs") else {
            continue;
        };
        let in_a_tests_folder = relative.split('/').rev().skip(1).any(|folder| folder == "tests");
        if relative.ends_with("tests.rs") || in_a_tests_folder || relative.starts_with("bin/") {
            continue;
        }
        let mut module: ModulePath = stem.split('/').map(str::to_owned).collect();
        match module.last().map(String::as_str) {
            Some("mod") => {
                module.pop();
            }
            Some("lib" | "main") if module.len() == 1 => {
                if relative != root {
                    continue;
                }
                module.clear();
            }
            _ => {}
        }
        found.insert(module, src.join(&relative));
    }
    Ok(found)
}

/// The file-level graph of the crate whose sources are in `src`.
pub fn file_graph(src: &Path) -> anyhow::Result<Graph> {
    let modules = modules(src)?;
    let name = |module: &ModulePath| -> String {
        modules
            .get(module)
            .and_then(|p| p.strip_prefix(src).ok())
            .map(|p| p.to_string_lossy().replace('\\', "/"))
            .unwrap_or_default()
    };
    let mut codes = BTreeMap::new();
    let mut imports = BTreeMap::new();
    for (module, path) in &modules {
        let code = code_of(&std::fs::read_to_string(path)?);
        imports.insert(module.clone(), imported(&code, module, &modules));
        codes.insert(module.clone(), code);
    }
    let mut graph = Graph::new();
    for (module, code) in &codes {
        let mut uses = BTreeSet::new();
        for named in named_paths(code, module, &modules) {
            let target = resolve(&named, &modules, &imports);
            // The root (an empty path) and every other module this one is inside are its parents.
            if !module.starts_with(&target) {
                uses.insert(name(&target));
            }
        }
        graph.insert(name(module), uses);
    }
    Ok(graph)
}

/// The names a module's `use` items bring in, each with the absolute path it stands for (only
/// paths inside the crate): `super::Item` in a child then resolves to where `Item` comes from.
fn imported(code: &str, module: &ModulePath, modules: &BTreeMap<ModulePath, PathBuf>) -> BTreeMap<String, ModulePath> {
    let mut names = BTreeMap::new();
    for (at, _) in code.match_indices("use ") {
        let starts_item = at == 0 || code[..at].ends_with(|c: char| c.is_whitespace() || c == ')' || c == ';');
        if !starts_item {
            continue;
        }
        let tree = &code[at + 4..];
        let first = ident(tree.trim_start());
        let inside = matches!(first, "crate" | "super" | "self")
            || modules.contains_key(&[module.as_slice(), &[first.to_owned()]].concat());
        if !inside {
            continue;
        }
        for path in path_tree(tree.trim_start()) {
            if let (Some(last), Some(absolute)) = (path.last(), absolute(&path, module)) {
                names.insert(last.clone(), absolute);
            }
        }
    }
    names
}

/// The code of a file that counts: without `#[cfg(test)]` items and line comments.
pub fn code_of(text: &str) -> String {
    let code = without_test_items(text);
    code.lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("//") {
                return "";
            }
            match line.find(" //") {
                Some(at) => &line[..at],
                None => line,
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` without the items marked `#[cfg(test)]`: each runs to its first `;` outside braces, or
/// to the brace that closes its first `{`.
fn without_test_items(text: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut kept = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(MARK) {
        kept.push_str(&rest[..at]);
        let item = &rest[at + MARK.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (i, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth > 0 => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    kept.push_str(rest);
    kept
}

/// Every module-relative path `code` (in the file of `module`) names, made absolute: `crate::`,
/// `super::`, `self::` and child-module paths.
pub fn named_paths(code: &str, module: &ModulePath, modules: &BTreeMap<ModulePath, PathBuf>) -> Vec<ModulePath> {
    let children: BTreeSet<&str> = modules
        .keys()
        .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
        .filter_map(|m| m.last().map(String::as_str))
        .collect();
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let starts_word =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_' || bytes[at - 1] == b':');
        if !starts_word || !(bytes[at].is_ascii_alphabetic() || bytes[at] == b'_') {
            at += 1;
            continue;
        }
        let word = ident(&code[at..]);
        let after = &code[at + word.len()..];
        if !after.starts_with("::") || !(matches!(word, "crate" | "super" | "self") || children.contains(word)) {
            at += word.len().max(1);
            continue;
        }
        for path in path_tree(&code[at..]) {
            if let Some(absolute) = absolute(&path, module) {
                found.push(absolute);
            }
        }
        at += word.len();
    }
    found
}

/// The leading identifier of `text`.
fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The paths a use-tree at the start of `text` names: `a::b::{c, d::e}` → `a::b::c`, `a::b::d::e`.
fn path_tree(text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    tree_at(text, Vec::new(), &mut paths);
    paths
}

/// Reads one use-tree at the start of `text` under `prefix`; returns the length read.
fn tree_at(text: &str, mut prefix: Vec<String>, paths: &mut Vec<Vec<String>>) -> usize {
    let mut at = 0;
    loop {
        at += text[at..].len() - text[at..].trim_start().len();
        let rest = &text[at..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut inner = 0;
            at += 1;
            loop {
                inner += group[inner..].len() - group[inner..].trim_start().len();
                if group[inner..].starts_with('}') || inner >= group.len() {
                    return at + inner + 1;
                }
                inner += tree_at(&group[inner..], prefix.clone(), paths);
                inner += group[inner..].len() - group[inner..].trim_start().len();
                if group[inner..].starts_with(',') {
                    inner += 1;
                }
            }
        }
        let word = ident(rest);
        if word.is_empty() {
            paths.push(prefix);
            return at;
        }
        at += word.len();
        if word != "self" {
            prefix.push(word.to_owned());
        }
        match text[at..].strip_prefix("::") {
            Some(_) => at += 2,
            None => {
                paths.push(prefix);
                return at;
            }
        }
    }
}

/// `path` (as written in the file of `module`) from the crate root, or `None` when it leaves it.
fn absolute(path: &[String], module: &ModulePath) -> Option<ModulePath> {
    let mut base = module.clone();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &path[1..];
        }
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => {}
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The module `path` names: the longest module it starts with, or, when the segment after that
/// is a name the module imported, where that name comes from.
fn resolve(
    path: &ModulePath,
    modules: &BTreeMap<ModulePath, PathBuf>,
    imports: &BTreeMap<ModulePath, BTreeMap<String, ModulePath>>,
) -> ModulePath {
    let mut path = path.clone();
    // Re-exports of re-exports are followed a few steps, never round a circle of `use`s.
    for _ in 0..4 {
        let module = (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|prefix| modules.contains_key(prefix))
            .unwrap_or_default();
        let through = path
            .get(module.len())
            .and_then(|next| imports.get(&module)?.get(next))
            .filter(|target| **target != path[..=module.len()]);
        match through {
            Some(target) => path = [target.as_slice(), &path[module.len() + 1..]].concat(),
            None => return module,
        }
    }
    path
}

/// Every cycle of `graph`, each once, as the path that closes it (`a → b → a`), shortest first.
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    let mut found: Vec<Vec<String>> = Vec::new();
    let mut seen_sets = BTreeSet::new();
    for start in graph.keys() {
        if let Some(path) = cycle_through(graph, start) {
            let set: BTreeSet<String> = path.iter().cloned().collect();
            if seen_sets.insert(set) {
                found.push(path);
            }
        }
    }
    found.sort_by_key(Vec::len);
    found
}

/// The shortest cycle through `start`, if any (breadth first).
pub fn cycle_through(graph: &Graph, start: &str) -> Option<Vec<String>> {
    let mut queue = std::collections::VecDeque::from([vec![start.to_owned()]]);
    let mut seen = BTreeSet::new();
    while let Some(path) = queue.pop_front() {
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
                queue.push_back(longer);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let path = dir.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            std::fs::write(path, text).unwrap();
        }
    }

    #[test]
    fn use_trees_name_every_leaf() {
        assert_eq!(
            path_tree("crate::{a, b::{c, d::E}, self}; rest"),
            vec![
                vec!["crate".to_owned(), "a".into()],
                vec!["crate".into(), "b".into(), "c".into()],
                vec!["crate".into(), "b".into(), "d".into(), "E".into()],
                vec!["crate".into()],
            ]
        );
    }

    #[test]
    fn two_siblings_naming_each_other_are_a_cycle() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            &[
                ("lib.rs", "mod run; mod store; pub use run::Thing;"),
                ("run/mod.rs", "mod live; mod persist;\nuse crate::Error;"),
                ("run/live.rs", "use super::persist::Persister;\nuse super::Shared;"),
                (
                    "run/persist.rs",
                    "// crate::store::x in a comment\nuse crate::run::{live::Emitter};",
                ),
                (
                    "store/mod.rs",
                    "use crate::run::Thing; // a sibling top module, no cycle",
                ),
            ],
        );
        let graph = file_graph(dir.path()).unwrap();
        assert_eq!(graph["run/live.rs"], BTreeSet::from(["run/persist.rs".to_owned()]));
        assert_eq!(graph["run/mod.rs"], BTreeSet::new(), "the root is every file's parent");
        assert_eq!(
            cycles(&graph),
            vec![vec![
                "run/live.rs".to_owned(),
                "run/persist.rs".into(),
                "run/live.rs".into()
            ]]
        );
    }

    #[test]
    fn a_child_using_its_parent_and_test_code_are_no_cycle() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            &[
                ("lib.rs", "mod a;"),
                ("a/mod.rs", "mod b; mod tests;\nuse b::Thing;"),
                (
                    "a/b.rs",
                    "use super::Other;\n#[cfg(test)]\nmod t { use crate::a::tests::X; fn f() {} }\nfn g() {}",
                ),
                ("a/tests.rs", "use super::b::Thing; use crate::a::Other;"),
                ("c/tests/mod.rs", "mod rules; use crate::a::Other;"),
                ("c/tests/rules.rs", "use crate::a::Other;"),
            ],
        );
        let graph = file_graph(dir.path()).unwrap();
        assert_eq!(graph["a/mod.rs"], BTreeSet::from(["a/b.rs".to_owned()]));
        assert!(!graph.keys().any(|file| file.contains("tests")), "{graph:?}");
        assert!(cycles(&graph).is_empty(), "{graph:?}");
    }

    #[test]
    fn a_longer_cycle_is_found_once() {
        let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
            .into_iter()
            .map(|(from, to)| (from.to_owned(), BTreeSet::from([to.to_owned()])))
            .collect();
        assert_eq!(
            cycles(&graph),
            vec![vec!["a".to_owned(), "b".into(), "c".into(), "a".into()]]
        );
        assert_eq!(cycle_through(&graph, "d"), None);
    }
}
