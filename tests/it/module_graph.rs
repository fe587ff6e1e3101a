//! The crate's modules, and the C API's, import each other without a
//! circle: each top-level module of src/ (a file `src/x.rs` or a folder
//! `src/x/`) is a node, and every `crate::x` path in its files (comments
//! left out, test code included) an edge. A circle means two modules that
//! can only be read, and changed, together.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Pairs that still import each other, each with the change that removes
/// it. Nothing else may close a circle.
const TOLERATED: &[(&str, &str)] = &[];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text without `//` comments (doc links are no dependency).
fn without_comments(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The first segment of every `crate::` path: `crate::a::B` gives `a`,
/// `crate::{a::B, c}` gives `a` and `c`.
fn crate_paths(text: &str) -> Vec<String> {
    let ident =
        |s: &str| s.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: split at commas outside nested braces.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(ident(&item));
        } else {
            out.push(ident(rest));
        }
    }
    out
}

fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let module_of = |path: &Path| {
        let first = path.strip_prefix(src).unwrap().components().next().unwrap();
        let name = first.as_os_str().to_string_lossy().into_owned();
        name.strip_suffix(".rs").map(str::to_string).unwrap_or(name)
    };
    let modules: BTreeSet<String> =
        files.iter().map(|f| module_of(f)).filter(|m| m != "lib" && m != "main").collect();
    let mut graph: Graph = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for file in &files {
        let from = module_of(file);
        if !modules.contains(&from) {
            continue; // the crate root re-exports everything
        }
        let text = without_comments(&std::fs::read_to_string(file).unwrap());
        for to in crate_paths(&text) {
            if to != from && modules.contains(&to) {
                graph.get_mut(&from).unwrap().insert(to);
            }
        }
    }
    graph
}

/// A circle through the graph, as the modules along it, if there is one.
fn find_circle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_string());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in &graph[node] {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

/// Panics naming the first circle among the top-level modules under `src`
/// (at least `min_modules` of them), after dropping the [`TOLERATED`] pairs.
fn assert_no_circle(src: &Path, min_modules: usize) {
    let mut graph = module_graph(src);
    assert!(graph.len() >= min_modules, "found the modules: {graph:?}");
    for (a, b) in TOLERATED {
        if graph.get(*a).is_some_and(|to| to.contains(*b)) && graph.get(*b).is_some_and(|to| to.contains(*a))
        {
            graph.get_mut(*b).unwrap().remove(*a);
        }
    }
    if let Some(circle) = find_circle(&graph) {
        panic!("import circle in {}: {}", src.display(), circle.join(" -> "));
    }
}

#[test]
fn src_modules_import_without_a_circle() {
    assert_no_circle(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), 11);
}

/// The C API's modules (`capi/src`: engine, text, session, ...) likewise.
#[test]
fn capi_modules_import_without_a_circle() {
    assert_no_circle(&Path::new(env!("CARGO_MANIFEST_DIR")).join("capi/src"), 5);
}

/// The checker sees what it must: grouped and nested `use`, comments left
/// out, and a circle of three.
#[test]
fn the_checker_finds_paths_and_circles() {
    let text = "use crate::a::X;\nuse crate::{b::{Y, Z}, c};\n// crate::d\nlet v = crate::e::f();";
    assert_eq!(crate_paths(&without_comments(text)), ["a", "b", "c", "e"]);
    let graph: Graph =
        [("x", "y"), ("y", "z"), ("z", "x"), ("w", "x")].iter().fold(Graph::new(), |mut g, (from, to)| {
            g.entry(from.to_string()).or_default().insert(to.to_string());
            g.entry(to.to_string()).or_default();
            g
        });
    assert_eq!(find_circle(&graph).unwrap(), ["w", "x", "y", "z", "x"][1..]);
    let tree: Graph = [("x", vec!["y", "z"]), ("y", vec!["z"]), ("z", vec![])]
        .into_iter()
        .map(|(n, to)| (n.to_string(), to.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(find_circle(&tree), None);
}
