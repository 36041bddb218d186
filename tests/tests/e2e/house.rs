//! Rules of the repository that a test keeps: everything a test reads is inside the clone.

use harness_s_tests::repo_root;

/// Files whose text is code, scripts or configuration that tests and examples run.
fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" && name != "__pycache__" {
                sources(&path, out);
            }
        } else if ["rs", "py", "sh", "toml", "json"].iter().any(|e| name.ends_with(&format!(".{e}"))) {
            out.push(path);
        }
    }
}

#[test]
fn nothing_reads_outside_the_clone() {
    let mut files = vec![];
    sources(&repo_root(), &mut files);
    assert!(files.len() > 100, "the walk found the sources: {}", files.len());
    // A folder beside the repository, as the shared data once was (spelled in two parts so
    // that this file does not match itself).
    let beside = ["../", "shared/"].concat();
    let hits: Vec<String> = files
        .iter()
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|t| t.contains(&beside)))
        .map(|f| f.strip_prefix(repo_root()).unwrap().display().to_string())
        .collect();
    assert!(hits.is_empty(), "these files read from a folder beside the repository; keep test data under tests/data/: {hits:?}");
    assert!(harness_s_tests::dev_tasks().is_file());
}

/// The `cuda` feature changes what is linked (libtorch_cuda, by the build scripts of native
/// and of the binary) and no Rust code: so the test command's one build compiles every line
/// a CUDA build compiles, and needs no second build with the feature (docs/TESTING.md).
/// Code that wants a cfg on the feature must bring that build back into the test command.
#[test]
fn the_cuda_feature_changes_only_the_build_scripts() {
    let mut files = vec![];
    sources(&repo_root(), &mut files);
    let flag = ["feature = ", "\"cuda\""].concat();
    let hits: Vec<String> = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs") && f.file_name().is_some_and(|n| n != "build.rs"))
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|t| t.contains(&flag)))
        .map(|f| f.strip_prefix(repo_root()).unwrap().display().to_string())
        .collect();
    assert!(hits.is_empty(), "Rust code under the cuda feature; the test command builds without it, so check it there: {hits:?}");
    for script in ["native/build.rs", "scheduler/build.rs"] {
        let text = std::fs::read_to_string(repo_root().join(script)).unwrap();
        assert!(text.contains("CARGO_FEATURE_CUDA") && text.contains("-ltorch_cuda"), "{script} links libtorch_cuda under the feature");
    }
}

/// A dev-dependency that turns on a feature changes the feature set of a crate the binaries
/// use too, and then that crate and everything above it is compiled twice: once for
/// `cargo build --bins`, once for the test targets (tokio's `test-util` did this, and cost
/// the test command minutes). Dev-dependencies name crates, never features.
#[test]
fn dev_dependencies_add_no_features() {
    let root: toml::Value = toml::from_str(&std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap()).unwrap();
    let members: Vec<&str> = root["workspace"]["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap()).collect();
    let mut found = vec![];
    for member in members {
        let path = repo_root().join(member).join("Cargo.toml");
        let manifest: toml::Value = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let Some(dev) = manifest.get("dev-dependencies").and_then(|d| d.as_table()) else { continue };
        for (name, spec) in dev {
            if spec.get("features").is_some() || spec.get("default-features").is_some() {
                found.push(format!("{member}/Cargo.toml: {name}"));
            }
        }
    }
    assert!(found.is_empty(), "dev-dependencies with features (they split the build in two): {found:?}");
}
