//! The crate's three rooms and the one rule between them: `infer` and `train` stand on
//! `model`, never on each other, and `model` stands on nothing of the crate but its root
//! (`NativeError`, `device`). Every `crate::` path in code (imports and inline paths alike,
//! tests included; comments are not code) is read from the sources and checked, so the rule
//! cannot rot.

use std::path::{Path, PathBuf};

const ROOMS: [&str; 3] = ["model", "infer", "train"];

/// What each room may name after `crate::`: its own room, the rooms below it, the root.
fn allowed(room: &str) -> &'static [&'static str] {
    match room {
        "model" => &["model", "NativeError", "device"],
        "infer" => &["infer", "model", "NativeError", "device"],
        "train" => &["train", "model", "NativeError", "device"],
        _ => unreachable!("a room of ROOMS"),
    }
}

/// The first segment after each `crate::` of `text`'s code lines, with its line number;
/// `crate::{a, b::c}` yields each of `a` and `b`.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut out = vec![];
    for (n, line) in text.lines().enumerate() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
            if let Some(group) = after.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or_default();
                out.extend(inner.split(',').map(|p| ident(p.trim())).filter(|s| !s.is_empty()).map(|s| (n + 1, s)));
            } else {
                out.push((n + 1, ident(after)));
            }
            rest = after;
        }
    }
    out
}

/// Each forbidden path of `text` (a file of `room`) as `line: crate::segment`.
fn violations(room: &str, text: &str) -> Vec<String> {
    crate_paths(text)
        .into_iter()
        .filter(|(_, seg)| !allowed(room).contains(&seg.as_str()))
        .map(|(n, seg)| format!("{n}: crate::{seg}"))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn infer_and_train_stand_on_model_and_never_on_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    let mut found = vec![];
    for room in ROOMS {
        let mut files = vec![];
        rust_files(&src.join(room), &mut files);
        assert!(!files.is_empty(), "src/{room}/ holds no Rust files");
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            checked += crate_paths(&text).len();
            for v in violations(room, &text) {
                found.push(format!("{} line {v} (room `{room}` may name {:?})", file.strip_prefix(&src).unwrap().display(), allowed(room)));
            }
        }
    }
    assert!(checked > 50, "the reader found the crate's paths ({checked})");
    assert!(found.is_empty(), "forbidden imports between the rooms:\n{}", found.join("\n"));
    // Nothing else lives beside the rooms but the root's shared pieces.
    let mut top: Vec<String> = std::fs::read_dir(&src).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    top.sort();
    assert_eq!(top, ["device.rs", "infer", "lib.rs", "model", "train"], "src/ holds the three rooms and the root only");
}

#[test]
fn the_reader_sees_every_form_of_a_forbidden_path() {
    let text = "use crate::model::Llama;\n\
                use crate::{infer::engine::Engine, model::Tokenizer};\n\
                // crate::infer in a comment is no import\n\
                let g = crate::infer::sampler::generate(&m, &p, &o, &[]); // inline\n\
                use crate::NativeError;";
    assert_eq!(violations("train", text), ["2: crate::infer", "4: crate::infer"]);
    assert_eq!(violations("infer", text), Vec::<String>::new());
    assert_eq!(violations("model", text), ["2: crate::infer", "4: crate::infer"]);
    assert_eq!(violations("model", "use crate::train::checkpoint;"), ["1: crate::train"]);
}
