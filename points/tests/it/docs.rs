//! The README and the guide (docs/guide, an mdBook): every relative link
//! leads to a file of the repository, every `#anchor` to a heading of its
//! page, and every chapter is in the book's table of contents.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::Context;

fn root() -> PathBuf {
    crate::support::repository()
}

fn guide() -> PathBuf {
    root().join("docs/guide")
}

/// The pages: the README and every chapter.
fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let mut pages = vec![root().join("README.md")];
    for entry in std::fs::read_dir(guide())? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    Ok(pages)
}

/// The targets of `[text](target)` in `text`, outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("](") {
            let after = &rest[start + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    found
}

/// The anchors of a page's headings, as mdBook and GitHub make them:
/// lower case, spaces as `-`, other punctuation dropped.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut anchors = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let anchor: String = heading
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        anchors.insert(anchor);
    }
    anchors
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[test]
fn every_relative_link_of_the_readme_and_the_guide_leads_somewhere() -> anyhow::Result<()> {
    let mut broken = Vec::new();
    for page in pages()? {
        let text = read(&page)?;
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap_or(&root()).join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", page.display()));
                continue;
            }
            if !anchor.is_empty() && !anchors(&read(&target)?).contains(anchor) {
                broken.push(format!("{}: {link}: no such heading", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
    Ok(())
}

#[test]
fn every_chapter_is_in_the_table_of_contents() -> anyhow::Result<()> {
    let summary = read(&guide().join("SUMMARY.md"))?;
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    let chapters: BTreeSet<String> = pages()?
        .iter()
        .filter(|page| page.starts_with(guide()))
        .filter_map(|page| page.file_name()?.to_str().map(str::to_owned))
        .filter(|name| name != "SUMMARY.md")
        .collect();
    assert_eq!(listed, chapters);
    Ok(())
}

#[test]
fn the_anchors_are_made_as_the_book_makes_them() {
    let made = anchors("# Why this design: `idem lab`\n## Metrics and health: `--http-addr`\n");
    assert!(made.contains("why-this-design-idem-lab"), "{made:?}");
    assert!(made.contains("metrics-and-health---http-addr"), "{made:?}");
    assert!(links("see [a](b.md#c) and [d](#e)\n```\n[x](y)\n```") == ["b.md#c", "#e"]);
}

/// Every page with a Rust block is compiled by `cargo test`: listed in the
/// crate's `pages` module, whose doctests they become.
#[test]
fn every_page_with_rust_is_compiled_as_doctests() -> anyhow::Result<()> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs"))?;
    for page in pages()? {
        let text = std::fs::read_to_string(&page)?;
        if !text.lines().any(|line| line.starts_with("```rust")) {
            continue;
        }
        let relative = page
            .strip_prefix(root())
            .context("a page outside the repository")?
            .display()
            .to_string();
        anyhow::ensure!(
            lib.contains(&format!("include_str!(\"../{relative}\")")),
            "{relative} has Rust blocks that src/lib.rs does not compile (mod pages)"
        );
    }
    Ok(())
}
