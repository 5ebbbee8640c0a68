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
