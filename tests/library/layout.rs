//! The repository's shape, as the project's card and guide promise it:
//! checks that read the tree, no server needed.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn the_top_level_holds_what_the_card_names() {
    let missing: Vec<&str> = [
        "Cargo.toml",
        "src",
        "sql",
        "rabbit-definitions.json",
        "tests",
        "compose.yaml",
    ]
    .into_iter()
    .filter(|name| !root().join(name).exists())
    .collect();
    assert!(missing.is_empty(), "missing at the top level: {missing:?}");
}

/// The retry policy has one home: no other file defines delays or decides
/// how long a message waits.
#[test]
fn only_the_retry_policy_knows_the_delays_and_the_attempts() -> anyhow::Result<()> {
    let home = root().join("src/retry.rs");
    let mut elsewhere = Vec::new();
    for file in [root().join("src"), root().join("points/src")]
        .iter()
        .flat_map(|dir| sources(dir))
    {
        let text = std::fs::read_to_string(&file)?;
        for (number, line) in text.lines().enumerate() {
            let line = line.trim_start();
            let defines = (line.contains("const ") && line.contains("DELAYS: [Duration"))
                || line.contains("fn delay_after")
                || line.contains("const DEFAULT_MAX_ATTEMPTS: u32 = 5")
                || line.starts_with("pub retry_delays:")
                || line.starts_with("pub max_attempts:") && file.ends_with("worker/config.rs");
            if defines && file != home {
                elsewhere.push(format!("{}:{}: {line}", file.display(), number + 1));
            }
        }
    }
    assert!(
        elsewhere.is_empty(),
        "defined outside src/retry.rs:\n{}",
        elsewhere.join("\n")
    );
    Ok(())
}

/// What the crate root makes public is public to every service: a module
/// hidden from the docs is public only under the unstable `internals`
/// feature that idem's own tools turn on.
#[test]
fn no_module_of_the_root_is_public_but_hidden_unless_for_the_internals() -> anyhow::Result<()> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs"))?;
    let lines: Vec<&str> = lib.lines().map(str::trim).collect();
    let mut hidden = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        if !line.starts_with("pub mod ") {
            continue;
        }
        // The attributes right above the declaration.
        let first = lines[..index]
            .iter()
            .rposition(|line| !line.starts_with("#["))
            .map_or(0, |at| at + 1);
        let before = &lines[first..index];
        let is_hidden = before.contains(&"#[doc(hidden)]");
        let is_internal = before.contains(&"#[cfg(feature = \"internals\")]");
        if is_hidden && !is_internal {
            hidden.push(*line);
        }
    }
    assert!(hidden.is_empty(), "public and hidden: {hidden:?}");
    Ok(())
}

/// Each function of `text` with its length in lines, as rustfmt lays code
/// out: from its `fn` line to the `}` at the same indentation.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        let after = [
            "pub ",
            "pub(crate) ",
            "pub(super) ",
            "async ",
            "const ",
            "unsafe ",
        ]
        .iter()
        .fold(code, |rest, prefix| {
            rest.strip_prefix(prefix).unwrap_or(rest)
        });
        let Some(signature) = after.strip_prefix("fn ") else {
            continue;
        };
        // A body on the `fn` line itself: `fn none() {}`.
        if signature.contains('{') && signature.trim_end().ends_with('}') {
            continue;
        }
        let name: String = signature
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration without a body (a trait's) ends with `;` first.
        let Some(open) = lines[start..]
            .iter()
            .position(|l| l.trim_end().ends_with('{') || l.trim_end().ends_with(';'))
        else {
            continue;
        };
        if lines[start + open].trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[start + open..].iter().position(|l| *l == close) {
            found.push((name, start + 1, open + end + 1));
        }
    }
    found
}

/// A function is read at a glance: none of the library's is over 100
/// lines (the development chapter lists the longest, with why).
#[test]
fn no_function_of_the_library_is_over_a_hundred_lines() -> anyhow::Result<()> {
    let mut long = Vec::new();
    for file in sources(&root().join("src")) {
        let text = std::fs::read_to_string(&file)?;
        for (name, line, length) in functions(&text) {
            if length > 100 {
                long.push(format!("{}:{line} {name}: {length} lines", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "over 100 lines:\n{}", long.join("\n"));
    Ok(())
}

#[test]
fn a_function_is_measured_from_its_fn_line_to_its_closing_brace() {
    let text = "impl X {\n    pub(crate) async fn two(\n        a: u8,\n    ) -> u8 {\n        a\n    }\n\n    fn declared(&self);\n}\nfn one() {}\nfn three() {\n    x\n}\n";
    let found: Vec<(String, usize)> = functions(text)
        .into_iter()
        .map(|(name, _, length)| (name, length))
        .collect();
    assert_eq!(found, vec![("two".to_owned(), 5), ("three".to_owned(), 3)]);
}

/// A file split out of a bigger one imports what it names: a glob of its
/// parent is for test modules alone.
#[test]
fn no_file_of_the_library_but_a_test_module_imports_its_parent_whole() -> anyhow::Result<()> {
    let mut globbed = Vec::new();
    for file in sources(&root().join("src")) {
        let is_tests = file.file_name().is_some_and(|name| name == "tests.rs");
        let text = std::fs::read_to_string(&file)?;
        if !is_tests && text.lines().any(|line| line == "use super::*;") {
            globbed.push(file.display().to_string());
        }
    }
    assert!(
        globbed.is_empty(),
        "glob imports of the parent: {globbed:?}"
    );
    Ok(())
}

/// The names of the `fn`s of the block that starts at the first line
/// starting with `opening`, up to its closing `}` at the start of a line.
fn methods_of(text: &str, opening: &str) -> Vec<String> {
    let Some(start) = text.find(&format!("\n{opening}")) else {
        return Vec::new();
    };
    let block = &text[start + 1..];
    let end = block.find("\n}\n").unwrap_or(block.len());
    let mut names: Vec<String> = block[..end]
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let rest = line
                .strip_prefix("fn ")
                .or_else(|| line.strip_prefix("async fn "))?;
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            Some(name)
        })
        .collect();
    names.sort();
    names
}

#[test]
fn a_shared_handler_forwards_every_method_of_the_trait() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(root().join("src/handler/mod.rs"))?;
    let trait_methods = methods_of(&text, "pub trait Handler");
    let forwarded = methods_of(&text, "impl<H: Handler> Handler for std::sync::Arc<H>");
    assert!(
        trait_methods.contains(&"ordering_key".to_owned()),
        "{trait_methods:?}"
    );
    assert_eq!(
        forwarded, trait_methods,
        "Arc<H> must forward each method, or the handler's own is replaced by the default"
    );
    Ok(())
}
