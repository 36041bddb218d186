//! The README's commands, run as written: every line of its `sh` blocks and every `python`
//! block, in order, in one shell, from a folder that sees the repository's `examples/` and
//! `infra/` (so what the commands write stays out of the checkout). `cargo run -p harness-s
//! --` is the built binary; the quickstart runs with fewer tasks and one update (the only
//! change to the text), so the README cannot name a command, flag or file that does not
//! work.

use harness_s_tests::{harness_s_bin, repo_root};

/// What the quickstart runs with here: one update on fewer tasks.
const QUICK: &str = "--set algorithm.updates=1 --set tasks.generate.train=5 --set evaluation.k=1";

/// The fenced blocks of `text` whose info string is `lang`, in order.
fn blocks<'a>(text: &'a str, lang: &str) -> Vec<(usize, Vec<&'a str>)> {
    let mut out = vec![];
    let mut current: Option<(usize, &str, Vec<&str>)> = None;
    for (n, line) in text.lines().enumerate() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) => current = Some((n + 1, info.trim(), vec![])),
            (Some((start, info, body)), Some(_)) => {
                if *info == lang {
                    out.push((*start, std::mem::take(body)));
                }
                current = None;
            }
            (Some((_, _, body)), None) => body.push(line),
            (None, None) => {}
        }
    }
    out
}

#[test]
fn every_readme_command_runs() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    for shared in ["examples", "infra"] {
        std::os::unix::fs::symlink(root.join(shared), work.join(shared)).unwrap();
    }
    let bin = work.join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(harness_s_bin(), bin.join("harness-s")).unwrap();

    // One script: the sh lines and python blocks in document order, each line followed by a
    // marker with its exit status.
    let mut script = String::from("export PATH=\"$PWD/bin:$PATH\"\n");
    let mut lines = vec![];
    let mut all: Vec<(usize, &str, Vec<&str>)> = blocks(&readme, "sh").into_iter().map(|(n, b)| (n, "sh", b)).collect();
    all.extend(blocks(&readme, "python").into_iter().map(|(n, b)| (n, "python", b)));
    all.sort_by_key(|(n, _, _)| *n);
    assert!(all.iter().any(|(_, l, _)| *l == "sh") && all.iter().any(|(_, l, _)| *l == "python"), "no commands found in README.md");
    for (start, lang, body) in &all {
        if *lang == "python" {
            let file = work.join(format!("block-{start}.py"));
            std::fs::write(&file, body.join("\n")).unwrap();
            lines.push(format!("python block at line {start}"));
            script.push_str(&format!("python3 {}\necho \"README-LINE {} rc=$?\" >&2\n", file.display(), lines.len() - 1));
            continue;
        }
        for line in body.iter().map(|l| l.trim()).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let command = line
                .replace("cargo run -p harness-s -- ", "harness-s ")
                .replace("examples/quickstart.toml", &format!("examples/quickstart.toml {QUICK}"));
            lines.push(line.to_string());
            script.push_str(&format!("{command}\necho \"README-LINE {} rc=$?\" >&2\n", lines.len() - 1));
        }
    }
    let out = std::process::Command::new("bash").arg("-c").arg(&script).current_dir(work).env_remove("HARNESS_S_STORE").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail = |s: &str| s.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    let mut seen = vec![None; lines.len()];
    for l in stderr.lines().filter_map(|l| l.strip_prefix("README-LINE ")) {
        let (i, rc) = l.split_once(" rc=").unwrap();
        seen[i.parse::<usize>().unwrap()] = Some(rc.parse::<i32>().unwrap());
    }
    for (line, rc) in lines.iter().zip(&seen) {
        // A run or resume may finish degraded (exit 3: some rollouts failed within budget).
        let runs = line.contains(" run ") || line.contains(" resume ");
        let ok = matches!(rc, Some(0)) || (runs && matches!(rc, Some(3)));
        assert!(ok, "README command `{line}` exited {rc:?}\nstdout:\n{}\nstderr:\n{}", tail(&stdout), tail(&stderr));
    }

    // What the commands say they make is there.
    let run = work.join("harness-s-data/runs/quickstart");
    assert!(run.join("reports/report.md").is_file(), "no report of the quickstart");
    assert!(work.join("harness-s-data/runs/nightly/state.json").is_file(), "the cron line started no run");
    let csv = std::fs::read_to_string(work.join("quickstart.csv")).unwrap();
    assert!(csv.lines().count() >= 2, "metrics CSV without rows:\n{csv}");
    assert!(std::fs::metadata(work.join("quickstart.gguf")).unwrap().len() > 1_000_000, "no exported GGUF");
    assert!(stdout.contains("\"choices\""), "the served model did not answer:\n{}", tail(&stdout));
    assert!(stdout.contains("retained_kind") && stdout.contains("harness_id"), "the python block printed no tables:\n{}", tail(&stdout));
}
