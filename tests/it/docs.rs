//! The documentation reaches everything a user can run or set: every
//! example program, every flag of the `decode` example, every environment
//! variable the crate reads, every guide page the README links to; and the
//! C example printed in the guide is the file the C tests build.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: impl AsRef<Path>) -> String {
    let path = root().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every guide page's text, with its name (`command_line` for
/// `src/guide/command_line.md`).
fn guide_pages() -> Vec<(String, String)> {
    let mut pages: Vec<(String, String)> = std::fs::read_dir(root().join("src/guide"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .map(|path| {
            (
                path.file_stem().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&path).unwrap(),
            )
        })
        .collect();
    pages.sort();
    pages
}

fn guide_text() -> String {
    guide_pages().into_iter().map(|(_, text)| text).collect::<Vec<_>>().join("\n")
}

/// The `--long` flags a clap `Parser` struct in `source` declares: each
/// `#[arg(long ...)]` field, named by its `long = "..."` or by the field.
fn clap_long_flags(source: &str) -> Vec<String> {
    let lines: Vec<&str> = source.lines().map(str::trim).collect();
    let mut flags = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(arg) = line.strip_prefix("#[arg(") else { continue };
        // `long` or `long = "..."`, not `long_help`.
        if !arg.starts_with("long") || arg.starts_with("long_") {
            continue;
        }
        let flag = match arg.strip_prefix("long = \"") {
            Some(rest) => rest[..rest.find('"').unwrap()].to_string(),
            None => {
                let field = lines[i + 1..].iter().find(|l| !l.starts_with("#[")).unwrap();
                field.split(':').next().unwrap().trim().replace('_', "-")
            }
        };
        flags.push(format!("--{flag}"));
    }
    flags
}

#[test]
fn every_decode_flag_is_documented() {
    let flags = clap_long_flags(&read("examples/decode.rs"));
    // The parser above must see the flags, or the test proves nothing.
    for known in ["--checkpoint", "--prompt-ids", "--stop", "--cooperative-matrices", "--logprobs"] {
        assert!(flags.iter().any(|f| f == known), "{known} not found among {flags:?}");
    }
    let page = read("src/guide/command_line.md");
    for flag in &flags {
        assert!(
            page.contains(&format!("`{flag}")),
            "src/guide/command_line.md does not document decode's {flag}"
        );
    }
}

#[test]
fn every_example_is_documented() {
    let guide = guide_text();
    let mut examples: Vec<String> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    examples.sort();
    assert!(examples.len() >= 10, "{examples:?}");
    let page = read("src/guide/command_line.md");
    for example in &examples {
        assert!(
            page.contains(&format!("`{example}`")),
            "src/guide/command_line.md does not list the {example} example"
        );
    }
    let capi_examples = ["c/chat.c", "c/greedy.c", "c/sessions.c", "c/batch.c", "cpp/greedy.cpp"];
    for example in capi_examples {
        assert!(root().join("capi/examples").join(example).is_file(), "capi/examples/{example}");
        assert!(
            guide.contains(&format!("capi/examples/{example}")),
            "the guide does not name capi/examples/{example}"
        );
    }
}

/// Every `*_ENV` constant in src/ names a variable the guide's
/// environment page documents.
#[test]
fn every_environment_variable_is_documented() {
    let page = read("src/guide/environment.md");
    let mut found = 0;
    let mut dirs = vec![root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let Some((name, value)) =
                    line.trim().strip_prefix("pub const ").and_then(|l| l.split_once(": &str = \""))
                else {
                    continue;
                };
                if !name.ends_with("_ENV") {
                    continue;
                }
                let variable = &value[..value.find('"').unwrap()];
                found += 1;
                assert!(
                    page.contains(&format!("`{variable}")),
                    "{} ({name} in {}) is not in src/guide/environment.md",
                    variable,
                    path.display()
                );
            }
        }
    }
    assert!(found >= 8, "only {found} *_ENV constants found in src/");
}

/// The README's links into the guide name pages that exist, and the guide
/// module declares every page.
#[test]
fn readme_links_reach_guide_pages() {
    let readme = read("README.md");
    let module = read("src/guide/mod.rs");
    let pages: Vec<String> = guide_pages().into_iter().map(|(name, _)| name).collect();
    for page in &pages {
        assert!(
            module.contains(&format!("include_str!(\"{page}.md\")]\npub mod {page} {{}}")),
            "src/guide/mod.rs does not declare {page}"
        );
    }
    let prefix = "https://docs.rs/qwen3-wgpu/latest/qwen3_wgpu/guide/";
    let mut links = 0;
    for (i, _) in readme.match_indices(prefix) {
        let rest = &readme[i + prefix.len()..];
        let target = &rest[..rest.find(|c: char| c.is_whitespace() || c == ')').unwrap_or(rest.len())];
        links += 1;
        if target == "index.html" {
            continue;
        }
        let page =
            target.strip_suffix("/index.html").unwrap_or_else(|| panic!("README links to {prefix}{target}"));
        assert!(pages.iter().any(|p| p == page), "README links to a guide page that does not exist: {page}");
    }
    assert!(links >= 10, "README has only {links} links into the guide");
}

/// The C example printed in the C and C++ page is `capi/examples/c/chat.c`
/// (less its opening comment), the file the C tests compile and run.
#[test]
fn the_guide_prints_the_c_chat_example_as_it_is() {
    let page = read("src/guide/c_api.md");
    let start = page.find("```c\n").expect("a C block") + "```c\n".len();
    let printed = &page[start..start + page[start..].find("```\n").unwrap()];
    let file = read("capi/examples/c/chat.c");
    let body = &file[file.find("*/\n").expect("an opening comment") + "*/\n".len()..];
    assert_eq!(printed, body, "src/guide/c_api.md's C example differs from capi/examples/c/chat.c");
}
