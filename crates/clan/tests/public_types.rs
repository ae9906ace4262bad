//! The compile-time `Send + Sync` checks in `clan` and `clan-proto` (`const _` blocks in
//! their `lib.rs`) name every public struct and enum of the crate: a type added without
//! being listed fails here, so the promise "every public type is Send and Sync" cannot go
//! stale silently.

use std::path::{Path, PathBuf};

/// Types that are deliberately neither, with the reason documented at the check.
const EXEMPT: &[&str] = &["EventLoop"];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Names of `pub struct` / `pub enum` items (not `pub(crate)`) in a crate's sources.
fn public_types(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut names = Vec::new();
    for f in files {
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            let t = line.trim_start();
            let rest = t.strip_prefix("pub struct ").or_else(|| t.strip_prefix("pub enum "));
            if let Some(rest) = rest {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if name.starts_with(|c: char| c.is_ascii_uppercase()) {
                    names.push(name);
                }
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

fn check(krate: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join(krate);
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let types = public_types(&root.join("src"));
    assert!(types.len() > 10, "{krate}: found only {types:?}");
    let listed = |name: &str| {
        lib.match_indices("send_sync::<").any(|(at, _)| {
            let path: String =
                lib[at + 12..].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
            path.rsplit("::").next() == Some(name)
        })
    };
    let missing: Vec<_> = types.iter().filter(|t| !EXEMPT.contains(&t.as_str()) && !listed(t)).collect();
    assert!(missing.is_empty(), "{krate}: public types not checked for Send + Sync in lib.rs: {missing:?}");
}

#[test]
fn every_public_type_of_clan_is_checked_send_and_sync() {
    check("clan");
}

#[test]
fn every_public_type_of_clan_proto_is_checked_send_and_sync() {
    check("clan-proto");
}
