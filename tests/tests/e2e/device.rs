//! The machine a run lands on: `harness-s doctor`, and the device-dependent benches as the
//! GPU probe (infra/deploy/device/probe.sh) runs them, here on the CPU: one `--device`
//! flag, bf16 mixed precision, the exact-resume check, the PyTorch peer, and references
//! that name their interpreter.

use harness_s_tests::harness_s;

#[test]
fn doctor_checks_the_machine_and_names_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let store = store.to_str().unwrap();
    let (code, out, err) = harness_s(&["doctor", "--store", store]);
    for what in ["libtorch", "cpu", "model", "memory", "disk", "store", "queue", "llama.cpp"] {
        assert!(out.lines().any(|l| l.split_whitespace().nth(1) == Some(what)), "no `{what}` line:\n{out}\n{err}");
    }
    assert!(out.contains("writes, reads and deletes"), "{out}");
    assert_eq!(code, 0, "this machine runs the tests, so it is ready:\n{out}\n{err}");
    assert!(out.trim_end().ends_with("ready"), "{out}");
    let left: Vec<_> = std::fs::read_dir(dir.path().join("store")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "the probe left {left:?} in the store");

    // A queue that does not answer and a model that is not there are named, with the fix.
    let (code, out, err) = harness_s(&[
        "doctor",
        "--store",
        store,
        "--queue",
        "amqp://guest:guest@127.0.0.1:1/%2f?connect_timeout_s=1",
        "--model",
        "/no/such/model.gguf",
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    let line = |what: &str| out.lines().find(|l| l.split_whitespace().nth(1) == Some(what)).unwrap_or_default().to_string();
    assert!(line("queue").starts_with("FIX") && line("queue").contains("127.0.0.1:1"), "{out}");
    assert!(line("model").starts_with("FIX") && line("model").contains("/no/such/model.gguf"), "{out}");
    assert!(out.contains("2 check(s) to fix"), "{out}");
}

const TINY: [&str; 10] = ["--seq-lens", "24", "--groups", "2", "--width", "64", "--layers", "2", "--vocab", "256"];

#[test]
fn the_learner_bench_runs_on_the_named_device_in_each_precision() {
    for precision in ["f32", "bf16"] {
        let mut args = vec!["bench", "learner", "--precision", precision, "--device", "cpu"];
        args.extend(TINY);
        let (code, out, err) = harness_s(&args);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(&format!("device: cpu  precision: {precision}")), "{out}");
        let row = out.lines().find(|l| l.split_whitespace().next() == Some("24")).unwrap_or_else(|| panic!("{out}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        let tokens: u64 = cells[3].parse().unwrap();
        let rate: f64 = cells[5].parse().unwrap();
        assert!(tokens == 24 && rate > 0.0, "2 rows x 12 completion tokens trained: {row}");
    }

    // Resuming from a checkpoint on this device repeats the update bit for bit.
    let mut args = vec!["bench", "learner", "--resume-check"];
    args.extend(TINY);
    let (code, out, err) = harness_s(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resume on cpu: largest weight difference after the resumed update 0e0 (bit-identical)"), "{out}");

    // A device or precision this machine lacks is refused by its flag.
    for (flag, value, needle) in [("--device", "cuda:0", "CUDA is not available"), ("--precision", "fp8", "`fp8` is not `f32` or `bf16`")] {
        let mut args = vec!["bench", "learner", flag, value];
        args.extend(TINY);
        let (code, _, err) = harness_s(&args);
        assert_eq!(code, 1, "{flag} {value}: {err}");
        assert!(err.contains(flag) && err.contains(needle), "{err}");
    }
}

#[test]
fn the_pytorch_peer_runs_beside_the_learner_or_says_why_not() {
    let python = harness_s_tests::python();
    let mut args = vec!["bench", "learner", "--peer", "torch", "--python", &python];
    args.extend(TINY);
    let (code, out, err) = harness_s(&args);
    let has_torch = std::process::Command::new(&python)
        .args(["-c", "import torch"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_torch {
        assert_eq!(code, 0, "{err}");
        let row = out.lines().find(|l| l.split_whitespace().next() == Some("24")).unwrap_or_else(|| panic!("{out}"));
        let ratio: f64 = row.split_whitespace().last().unwrap().parse().unwrap();
        assert!(out.contains("× torch") && ratio > 0.0, "{out}");
    } else {
        assert_eq!(code, 1, "{out}");
        assert!(err.contains(&format!("the PyTorch peer ({python}) exited with status 1")) && err.contains("no module 'torch'"), "{err}");
    }
    let (code, _, err) = harness_s(&["bench", "sampler", "--python", "/no/such/python", "--no-server"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("/no/such/python"), "the interpreter is named: {err}");
}

#[test]
fn the_sampler_bench_runs_on_its_own_without_the_llama_cpp_references() {
    let (code, out, err) = harness_s(&[
        "bench",
        "sampler",
        "--no-reference",
        "--device",
        "cpu",
        "--streams",
        "1",
        "--weights",
        "f32",
        "--max-tokens",
        "4",
        "--prompt-tokens",
        "16",
        "--group",
        "0",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("device: cpu") && out.contains("native sampler") && out.contains("native engine f32"), "{out}");
    assert!(!out.contains("llama.cpp in process"), "--no-reference still ran llama.cpp:\n{out}");
}
