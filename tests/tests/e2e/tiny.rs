//! The committed tiny policies the machinery tests run on (`tests/data/tiny/`, made by
//! `tests/examples/make_tiny_policies.rs`) are what those tests assume: each loads, keeps
//! SmolLM2's tokenizer and chat template, answers a chat prompt with `Final Answer: [n]`, and
//! the GGUF is one llama.cpp loads as well.

use harness_s_tests::{harness_s, tiny_policy, tiny_qwen3_5};

#[test]
fn the_tiny_policies_load_and_answer_in_the_guessers_format() {
    for (model, arch) in [(tiny_policy(), "llama"), (tiny_qwen3_5(), "qwen3.5")] {
        let (m, tok) = native::model::loader::load(&model, tch::Device::Cpu).unwrap();
        assert_eq!(tok.vocab_size(), 49152, "{}: SmolLM2's tokenizer", model.display());
        let params: i64 = native::model::CausalLm::named_tensors(&m).iter().map(|(_, t)| t.numel() as i64).sum();
        assert!(params < 5_000_000, "{}: {params} parameters is not tiny", model.display());
        use native::model::shape::ModelConfig;
        match (ModelConfig::read(&model).unwrap(), arch) {
            (ModelConfig::Llama(c), "llama") => assert_eq!(c.model_type, "llama"),
            (ModelConfig::Qwen35(_), "qwen3.5") => {}
            (c, _) => panic!("{}: expected a {arch}, read {c:?}", model.display()),
        }
        for seed in ["1", "2", "3"] {
            let (code, out, err) = harness_s(&[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "How many rows are there?",
                "--chat",
                "--seed",
                seed,
                "--max-tokens",
                "12",
            ]);
            assert!(code == 0 && out.contains("Final Answer: ["), "{}: generate (seed {seed}): exit {code}\n{out}\n{err}", model.display());
        }
    }
    // llama.cpp reads the GGUF: its vocabulary and a completion
    let script = "import sys; from llama_cpp import Llama\n\
                  m = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)\n\
                  r = m.create_chat_completion(messages=[{'role': 'user', 'content': 'How many?'}], max_tokens=12, temperature=0)\n\
                  print(m.n_vocab(), r['choices'][0]['message']['content'])";
    let out = std::process::Command::new(harness_s_tests::python()).args(["-c", script]).arg(tiny_policy()).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.starts_with("49152 "), "llama.cpp: {said}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("Final Answer: ["), "llama.cpp's greedy answer is the guesser's: {said}");
}
