//! Docs that cannot drift, checked as tests (in the spirit of rust-analyzer's `tidy`):
//! ARCHITECTURE.md's code map names every crate of the workspace and every top-level module of
//! each, and every path that ARCHITECTURE.md or README.md names exists. They run in
//! `cargo test --workspace` (so in `cargo xtask test`) and need nothing but the checkout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every file of the checkout, relative to `root`, `/`-separated; build output, VCS data and
/// dot-directories left out.
fn files(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// The crates of the workspace: `crates/*`, `testing/*` and `xtask` (directories holding a
/// `Cargo.toml`).
fn crate_dirs(root: &Path) -> Vec<String> {
    let mut out = vec!["xtask".to_owned()];
    for parent in ["crates", "testing"] {
        let Ok(entries) = std::fs::read_dir(root.join(parent)) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.path().join("Cargo.toml").is_file() {
                out.push(format!("{parent}/{}", entry.file_name().to_string_lossy()));
            }
        }
    }
    out.sort();
    out
}

/// The inline code spans (`…`) of one line of Markdown.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// Whether a code span is meant as a path of this checkout: a relative path without spaces or
/// placeholders that starts at a top-level directory, names a Rust file, or is a multi-part
/// path naming a file by a known extension or a directory by a trailing `/`. (Bare names such
/// as `AGENTS.md`, `memory/` or `big.txt` are files inside boxes in these docs, not paths here.)
fn looks_like_path(span: &str) -> bool {
    const EXTENSIONS: [&str; 8] = [
        ".toml", ".md", ".py", ".txt", ".json", ".proto", ".sh", ".yaml",
    ];
    const TOP: [&str; 6] = [
        "crates/",
        "testing/",
        "xtask/",
        "examples/",
        "fuzz/",
        ".ci/",
    ];
    if span.is_empty()
        || span.starts_with('/')
        || span.starts_with('.') && !span.starts_with(".ci/")
        || span.starts_with("target/")
        || span.starts_with("http")
        || span
            .chars()
            .any(|c| c.is_whitespace() || "<>*{}$%:=()[],;|\"'#~?".contains(c))
    {
        return false;
    }
    let inner = span.trim_end_matches('/');
    TOP.iter().any(|t| span.starts_with(t))
        || span.ends_with(".rs")
        || (inner.contains('/')
            && (span.ends_with('/') || EXTENSIONS.iter().any(|e| span.ends_with(e))))
}

/// Whether `span` names something that exists: from the root, from one of the crates the
/// section is about, or as the tail of a file's path anywhere in the checkout (a section may
/// name another crate's file, e.g. "core's `posix.rs`").
fn exists(root: &Path, files: &[String], section: &[String], span: &str) -> bool {
    let span = span.trim_end_matches('/');
    root.join(span).exists()
        || section
            .iter()
            .any(|scope| root.join(scope).join(span).exists())
        || files
            .iter()
            .any(|f| f.ends_with(&format!("/{span}")) || f.contains(&format!("/{span}/")))
}

/// The crates a `###` heading is about (the code spans naming a crate directory).
fn heading_crates(line: &str, crates: &[String]) -> Vec<String> {
    code_spans(line)
        .into_iter()
        .filter(|s| crates.iter().any(|c| c == s))
        .map(str::to_owned)
        .collect()
}

/// Paths named in `doc` (ARCHITECTURE.md or README.md) that do not exist, as `file:line: span`.
fn missing_paths(root: &Path, doc: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root.join(doc)).unwrap_or_default();
    let files = files(root);
    let crates = crate_dirs(root);
    let mut section: Vec<String> = Vec::new();
    let mut in_fence = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        if line.starts_with('#') {
            section = heading_crates(line, &crates);
        }
        for span in code_spans(line) {
            if looks_like_path(span) && !exists(root, &files, &section, span) {
                out.push(format!("{doc}:{}: `{span}`", n + 1));
            }
        }
    }
    out
}

/// The top-level modules of a crate: `src/NAME.rs` and `src/NAME/` (lib.rs, main.rs and a
/// unit-test `tests.rs` aside).
fn top_modules(root: &Path, krate: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(root.join(krate).join("src")) else {
        return out;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if path.is_dir() {
            if name != "bin" {
                out.insert(name);
            }
        } else if let Some(stem) = name.strip_suffix(".rs")
            && !["lib", "main", "tests"].contains(&stem)
        {
            out.insert(stem.to_owned());
        }
    }
    out
}

/// The text of each crate's section(s) of the code map, by crate directory.
fn sections(text: &str, crates: &[String]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut current: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            current = heading_crates(line, crates);
            for c in &current {
                out.push((c.clone(), String::new()));
            }
            continue;
        }
        for c in &current {
            if let Some((_, body)) = out.iter_mut().rev().find(|(k, _)| k == c) {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    out
}

/// Whether a crate's section mentions module `m` (as `m`, `m.rs`, `m/`, a `src/m` path or a
/// `…::m` path).
fn mentions(body: &str, m: &str) -> bool {
    code_spans_all(body).any(|s| {
        s == m
            || s == format!("{m}.rs")
            || s == format!("{m}/")
            || s.starts_with(&format!("{m}/"))
            || s.starts_with(&format!("{m}::"))
            || s.contains(&format!("src/{m}"))
            || s.contains(&format!("::{m}::"))
            || s.ends_with(&format!("::{m}"))
            || s.contains(&format!("/{m}.rs"))
            || s.contains(&format!("/{m}/"))
    })
}

fn code_spans_all(body: &str) -> impl Iterator<Item = &str> {
    body.lines().flat_map(code_spans)
}

fn root() -> PathBuf {
    crate::workspace_root()
}

#[test]
fn architecture_names_only_paths_that_exist() {
    let missing = missing_paths(&root(), "ARCHITECTURE.md");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist (fix the doc or the path):\n{}",
        missing.join("\n")
    );
}

#[test]
fn readme_names_only_paths_that_exist() {
    let missing = missing_paths(&root(), "README.md");
    assert!(
        missing.is_empty(),
        "README.md names paths that do not exist (fix the doc or the path):\n{}",
        missing.join("\n")
    );
}

#[test]
fn architecture_maps_every_crate_and_top_level_module() {
    let root = root();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let crates = crate_dirs(&root);
    let sections = sections(&text, &crates);
    let mut gaps = Vec::new();
    for krate in &crates {
        let bodies: Vec<&str> = sections
            .iter()
            .filter(|(k, _)| k == krate)
            .map(|(_, b)| b.as_str())
            .collect();
        if bodies.is_empty() {
            gaps.push(format!(
                "crate `{krate}` has no `### ` section in the code map"
            ));
            continue;
        }
        let body = bodies.join("\n");
        for m in top_modules(&root, krate) {
            if !mentions(&body, &m) {
                gaps.push(format!(
                    "`{krate}`: module `{m}` is not named in its section"
                ));
            }
        }
    }
    assert!(
        gaps.is_empty(),
        "ARCHITECTURE.md's code map is behind the code:\n{}",
        gaps.join("\n")
    );
}

#[test]
fn every_library_opens_with_its_role() {
    let root = root();
    let mut missing = Vec::new();
    for krate in crate_dirs(&root) {
        let lib = root.join(&krate).join("src/lib.rs");
        let Ok(text) = std::fs::read_to_string(&lib) else {
            continue;
        };
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        if !(first.starts_with("//!") || first.starts_with("#![doc = include_str!")) {
            missing.push(krate);
        }
    }
    assert!(
        missing.is_empty(),
        "these crates' lib.rs do not open with a `//!` paragraph on their role: {missing:?}"
    );
}

#[test]
fn the_checks_catch_what_they_claim() {
    // The checks themselves, on a made-up tree: a stale path and an unnamed module are found.
    let dir = std::env::temp_dir().join(format!("tidy-self-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("crates/a/src")).unwrap();
    std::fs::write(dir.join("crates/a/Cargo.toml"), "").unwrap();
    std::fs::write(dir.join("crates/a/src/lib.rs"), "//! a\n").unwrap();
    std::fs::write(dir.join("crates/a/src/kept.rs"), "").unwrap();
    std::fs::write(dir.join("crates/a/src/unnamed.rs"), "").unwrap();
    std::fs::write(
        dir.join("ARCHITECTURE.md"),
        "### `crates/a`\nThe `kept.rs` module and `gone.rs`; `src/lib.rs`, `AGENTS.md` in a box.\n",
    )
    .unwrap();
    let missing = missing_paths(&dir, "ARCHITECTURE.md");
    assert_eq!(missing, vec!["ARCHITECTURE.md:2: `gone.rs`".to_owned()]);
    let text = std::fs::read_to_string(dir.join("ARCHITECTURE.md")).unwrap();
    let crates = crate_dirs(&dir);
    let sections = sections(&text, &crates);
    let body = &sections.iter().find(|(k, _)| k == "crates/a").unwrap().1;
    assert!(mentions(body, "kept"));
    assert!(!mentions(body, "unnamed"));
    std::fs::remove_dir_all(&dir).unwrap();
}
