//! The model families against transformers on the same weights: tiny random models made
//! by transformers with a fixed seed, and transformers' own outputs on them
//! (`tests/data/make_fixtures.py`; the versions it ran with are in `tests/data/versions.txt`).
//! A port is correct when it agrees with the reference, not when it runs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use native::infer::engine::{Engine, EngineConfig, Request};
use native::infer::packed::WeightFormat;
use native::infer::sampler::GenerateOptions;
use native::model::qwen3_5::{Qwen35, Qwen35Cache};
use native::model::{hf, CausalLm, KvCache, Llama, Model};
use tch::{Device, Kind, Tensor};

fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(format!("{family}-tiny"))
}

/// The model and transformers' outputs on it.
fn load(family: &str) -> (Llama, HashMap<String, Tensor>) {
    let dir = fixture(family);
    let Model::Llama(model) = hf::load_model(&dir, Device::Cpu).unwrap_or_else(|e| panic!("{e}")) else {
        panic!("{family} is a llama-family model")
    };
    let path = dir.join("reference.safetensors");
    let reference = hf::read_safetensors(&std::fs::read(&path).unwrap(), &path).unwrap();
    (model, reference)
}

fn ids(t: &Tensor) -> Vec<i64> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float)).unwrap().into_iter().map(|v| v as i64).collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn qwen3_logits_agree_with_transformers_over_a_prompt_and_every_cached_step() {
    let (model, r) = load("qwen3");
    assert!(model.config.qk_norm() && model.config.head_dim() == 16, "qwen3 with an explicit head width: {:?}", model.config);
    let prompt = ids(&r["prompt_ids"]);
    let p = prompt.len() as i64;
    let logits = model.forward(&Tensor::from_slice(&prompt).view([1, p]), None).squeeze_dim(0);
    let d = max_diff(&logits, &r["logits"]);
    assert!(d < 1e-4, "prompt logits differ by {d}");

    // One token per step on the cache: the cache and the per-head norms of every position.
    let decoded = ids(&r["decoded_ids"]);
    let mut cache = KvCache::default();
    let mut next = model.logits_last(&Tensor::from_slice(&prompt).view([1, p]), Some(&mut cache)).squeeze_dim(0);
    for (i, &t) in decoded.iter().enumerate() {
        assert_eq!(next.argmax(-1, false).int64_value(&[]), t, "greedy token {i}");
        next = model.forward(&Tensor::from_slice(&[t]).view([1, 1]), Some(&mut cache)).view([-1]);
        let d = max_diff(&next, &r["step_logits"].get(i as i64));
        assert!(d < 1e-4, "step {i}: logits differ by {d}");
    }
}

#[test]
fn qwen3_gradient_agrees_with_pytorch() {
    let (model, r) = load("qwen3");
    let row: Vec<i64> = ids(&r["prompt_ids"]).into_iter().chain(ids(&r["decoded_ids"])).collect();
    let p = r["prompt_ids"].size()[0];
    let n = row.len() as i64;
    // log π of each decoded token given what precedes it, teacher-forced on one row
    let positions = Tensor::arange_start(p - 1, n - 1, (Kind::Int64, Device::Cpu));
    let logits = model.logits_at(&Tensor::from_slice(&row).view([1, n]), &positions);
    let targets = Tensor::from_slice(&row[p as usize..]).view([-1, 1]);
    let sum = logits.log_softmax(-1, Kind::Float).gather(1, &targets, false).sum(Kind::Float);
    let want = r["logprob_sum"].double_value(&[0]);
    assert!((sum.double_value(&[]) - want).abs() < 1e-3, "log-probability sum {} against {want}", sum.double_value(&[]));
    sum.backward();
    let mut checked = 0;
    for (name, param) in model.named_tensors() {
        let Some(theirs) = r.get(&format!("grad.{name}")) else { panic!("transformers has no parameter `{name}`") };
        let ours = param.grad();
        let scale = 1.0 + theirs.abs().max().double_value(&[]);
        let d = max_diff(&ours, theirs);
        assert!(d < 1e-4 * scale, "gradient of `{name}` differs by {d} (scale {scale})");
        checked += 1;
    }
    assert_eq!(checked, r.keys().filter(|k| k.starts_with("grad.")).count(), "every parameter of transformers is ours");
}

/// The engine decodes the same tokens, with transformers' log-probabilities: on the CPU's own
/// kernels (f32) exactly, on libtorch in bf16 within bf16's rounding.
#[test]
fn qwen3_rolls_out_on_the_engine_as_transformers_decodes() {
    let (model, r) = load("qwen3");
    let prompt: Vec<u32> = ids(&r["prompt_ids"]).into_iter().map(|t| t as u32).collect();
    let decoded = ids(&r["decoded_ids"]);
    let p = prompt.len() as i64;
    // log q of each decoded token, from transformers' logits (the prompt's last, then each step's)
    let all = Tensor::cat(&[r["logits"].get(p - 1).unsqueeze(0), r["step_logits"].narrow(0, 0, 15)], 0).log_softmax(-1, Kind::Float);
    let want: Vec<f32> = decoded.iter().enumerate().map(|(i, &t)| all.double_value(&[i as i64, t]) as f32).collect();
    for (weights, tolerance) in [(WeightFormat::F32, 1e-4f32), (WeightFormat::Bf16, 5e-2)] {
        let engine =
            Engine::start(model.clone_weights().unwrap().into(), EngineConfig { weights, threads: Some(1), ..Default::default() }).unwrap();
        let g = engine.generate(Request::new(prompt.clone(), GenerateOptions::greedy(16))).unwrap();
        let worst = g.logprobs.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if weights == WeightFormat::F32 {
            assert_eq!(g.tokens.iter().map(|&t| t as i64).collect::<Vec<_>>(), decoded, "{weights:?} tokens");
            assert!(worst < tolerance, "{weights:?}: log q differs by {worst}");
        } else {
            // bf16 may flip a near-tie; until the first difference it follows transformers
            let same = g.tokens.iter().zip(&decoded).take_while(|(a, b)| **a as i64 == **b).count();
            assert!(same >= 1, "{weights:?}: the first token differs: {:?} against {decoded:?}", g.tokens);
            let worst = g.logprobs[..same].iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < tolerance, "{weights:?}: log q differs by {worst} over the first {same} tokens");
        }
    }
}

fn reference(family: &str) -> HashMap<String, Tensor> {
    let path = fixture(family).join("reference.safetensors");
    hf::read_safetensors(&std::fs::read(&path).unwrap(), &path).unwrap()
}

#[test]
fn qwen3_5_logits_agree_with_transformers_over_a_prompt_and_every_cached_step() {
    let model = Qwen35::load(&fixture("qwen3.5"), Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(model.config.full_attention, [false, false, false, true], "[GDN, GDN, GDN, full]");
    let r = reference("qwen3.5");
    let prompt = ids(&r["prompt_ids"]);
    let p = prompt.len() as i64;
    let tokens = Tensor::from_slice(&prompt).view([1, p]);
    // one chunk (transformers' 64), and chunks of 5 with a padded last one
    for chunk in [64, 5] {
        let logits = model.forward(&tokens, None, chunk).squeeze_dim(0);
        let d = max_diff(&logits, &r["logits"]);
        assert!(d < 1e-4, "chunk {chunk}: prompt logits differ by {d}");
    }
    // the prompt in two passes (the GDN state and the convolution carried over), then one
    // token per step on the recurrent form
    let decoded = ids(&r["decoded_ids"]);
    let mut cache = Qwen35Cache::default();
    let _ = model.forward(&tokens.narrow(1, 0, 7), Some(&mut cache), 4);
    let mut next = model.forward(&tokens.narrow(1, 7, p - 7), Some(&mut cache), 4).get(0).get(p - 8);
    assert!(max_diff(&next, &r["logits"].get(p - 1)) < 1e-4, "the prompt split in two passes");
    for (i, &t) in decoded.iter().enumerate() {
        assert_eq!(next.argmax(-1, false).int64_value(&[]), t, "greedy token {i}");
        next = model.forward(&Tensor::from_slice(&[t]).view([1, 1]), Some(&mut cache), 64).view([-1]);
        let d = max_diff(&next, &r["step_logits"].get(i as i64));
        assert!(d < 1e-4, "step {i}: logits differ by {d}");
    }
    assert_eq!(cache.len(), p + 16);
}

/// The engine's rollouts of Qwen3.5 (the model's own pass per sequence, prefill in chunks,
/// the GDN state carried from chunk to chunk and into decoding) decode transformers' tokens
/// with its log-probabilities; a second request with the same prompt continues from the
/// state kept at the prompt's last chunk boundary and gives the same result.
#[test]
fn qwen3_5_rolls_out_on_the_engine_as_transformers_decodes() {
    let dir = fixture("qwen3.5");
    let model = hf::load_model(&dir, Device::Cpu).unwrap();
    assert!(matches!(model, Model::Qwen35(_)), "the loader picks Qwen3.5 by model_type");
    let r = reference("qwen3.5");
    let prompt: Vec<u32> = ids(&r["prompt_ids"]).into_iter().map(|t| t as u32).collect();
    let decoded = ids(&r["decoded_ids"]);
    let p = prompt.len() as i64;
    let all = Tensor::cat(&[r["logits"].get(p - 1).unsqueeze(0), r["step_logits"].narrow(0, 0, 15)], 0).log_softmax(-1, Kind::Float);
    let want: Vec<f32> = decoded.iter().enumerate().map(|(i, &t)| all.double_value(&[i as i64, t]) as f32).collect();
    let engine = Engine::start(model, EngineConfig { chunk: 4, threads: Some(1), ..Default::default() }).unwrap();
    let g = engine.generate(Request::new(prompt.clone(), GenerateOptions::greedy(16))).unwrap();
    assert_eq!(g.tokens.iter().map(|&t| t as i64).collect::<Vec<_>>(), decoded, "greedy tokens");
    let worst = g.logprobs.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "log q differs by {worst}");
    let again = engine.generate(Request::new(prompt.clone(), GenerateOptions::greedy(16))).unwrap();
    assert!(engine.stats().reused_tokens > 0, "the second request reuses the first one's prefix");
    assert_eq!((again.tokens, again.logprobs), (g.tokens, g.logprobs));
    // bf16 and int4 copies of the weights are refused by name
    let err = Engine::start(hf::load_model(&dir, Device::Cpu).unwrap(), EngineConfig { weights: WeightFormat::Int4, ..Default::default() })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("engine.weights") && err.contains("f32"), "{err}");
}

/// A Qwen3.5 checkpoint written by the learn job's own code is the folder it came from: the
/// fixture's `config.json` unchanged, its tensor names, and it loads back as the same model
/// (transformers' logits within 1e-4). `HARNESS_S_KEEP_CHECKPOINT=DIR` keeps the store
/// there (the checkpoint is `DIR/runs/q/checkpoints/step=1`, for loading in transformers).
#[tokio::test]
async fn a_qwen3_5_checkpoint_is_a_folder_of_the_same_model() {
    use native::model::CausalLm;
    use native::train::checkpoint::{self, SaveInfo};
    use native::train::learner::{Learner, LearnerConfig};
    let fixture_dir = fixture("qwen3.5");
    let learner = Learner::new(hf::load_model(&fixture_dir, Device::Cpu).unwrap(), LearnerConfig::default());
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var("HARNESS_S_KEEP_CHECKPOINT").map(PathBuf::from).unwrap_or_else(|_| tmp.path().to_path_buf());
    let store = infra::store::LocalStore::new(&root).unwrap();
    checkpoint::save(&store, &learner, None, &SaveInfo { run_id: "q".into(), step: 1, ..Default::default() }).await.unwrap();
    let dir = root.join("runs/q/checkpoints/step=1");
    let json = |p: PathBuf| serde_json::from_slice::<serde_json::Value>(&std::fs::read(p).unwrap()).unwrap();
    assert_eq!(json(dir.join("config.json")), json(fixture_dir.join("config.json")));
    let names = |p: PathBuf| {
        let mut n: Vec<String> = hf::read_safetensors(&std::fs::read(&p).unwrap(), &p).unwrap().into_keys().collect();
        n.sort();
        n
    };
    assert_eq!(names(dir.join("model.safetensors")), names(fixture_dir.join("model.safetensors")));
    let (back, _, manifest) = checkpoint::load_model(&store, "q", 1, Device::Cpu).await.unwrap();
    assert_eq!(manifest.architecture, "qwen3_5_text");
    let r = reference("qwen3.5");
    let prompt = ids(&r["prompt_ids"]);
    let p = prompt.len() as i64;
    let flat = Tensor::arange(p, (Kind::Int64, Device::Cpu));
    let logits = back.logits_at(&Tensor::from_slice(&prompt).view([1, p]), &flat);
    let d = max_diff(&logits, &r["logits"]);
    assert!(d < 1e-4, "the reloaded checkpoint's logits differ from transformers' by {d}");
}

/// A released Qwen3.5 checkpoint's layout (`Qwen3_5ForConditionalGeneration`: the text
/// config under `text_config`, the text model's tensors under `model.language_model.`, a
/// vision tower beside them) loads as the same text model, and keeps its names.
#[test]
fn a_released_qwen3_5_layout_loads_as_the_same_text_model() {
    use native::model::CausalLm;
    let fixture_dir = fixture("qwen3.5");
    let text: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture_dir.join("config.json")).unwrap()).unwrap();
    let released = serde_json::json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": true,
    });
    let path = fixture_dir.join("model.safetensors");
    let mut tensors: Vec<(String, Tensor)> = hf::read_safetensors(&std::fs::read(&path).unwrap(), &path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n.replacen("model.", "model.language_model.", 1), t))
        .collect();
    tensors.push(("model.visual.patch_embed.proj.weight".into(), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu))));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), released.to_string()).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), hf::write_safetensors(&tensors).unwrap()).unwrap();
    let model = hf::load_model(dir.path(), Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(model.architecture(), "qwen3_5");
    assert!(model.named_tensors().iter().all(|(n, _)| n.starts_with("model.language_model.")), "the folder's own names");
    let r = reference("qwen3.5");
    let prompt = ids(&r["prompt_ids"]);
    let p = prompt.len() as i64;
    let logits = model.logits_at(&Tensor::from_slice(&prompt).view([1, p]), &Tensor::arange(p, (Kind::Int64, Device::Cpu)));
    let d = max_diff(&logits, &r["logits"]);
    assert!(d < 1e-4, "logits differ from transformers' by {d}");
    assert_eq!(model.config_json(), released, "a checkpoint writes the released config back");
}

#[test]
fn qwen3_5_gradient_agrees_with_pytorch() {
    let model = Qwen35::load(&fixture("qwen3.5"), Device::Cpu).unwrap();
    let r = reference("qwen3.5");
    let row: Vec<i64> = ids(&r["prompt_ids"]).into_iter().chain(ids(&r["decoded_ids"])).collect();
    let p = r["prompt_ids"].size()[0];
    let n = row.len() as i64;
    // chunks of 6: neither the key width (8) nor a divisor of the row's 28 tokens
    let logits = model.forward(&Tensor::from_slice(&row).view([1, n]), None, 6).squeeze_dim(0).narrow(0, p - 1, n - p);
    let targets = Tensor::from_slice(&row[p as usize..]).view([-1, 1]);
    let sum = logits.log_softmax(-1, Kind::Float).gather(1, &targets, false).sum(Kind::Float);
    let want = r["logprob_sum"].double_value(&[0]);
    assert!((sum.double_value(&[]) - want).abs() < 1e-3, "log-probability sum {} against {want}", sum.double_value(&[]));
    sum.backward();
    let named = model.named_tensors();
    for (name, param) in &named {
        let theirs = r.get(&format!("grad.{name}")).unwrap_or_else(|| panic!("transformers has no parameter `{name}`"));
        let scale = 1.0 + theirs.abs().max().double_value(&[]);
        let d = max_diff(&param.grad(), theirs);
        assert!(d < 1e-4 * scale, "gradient of `{name}` differs by {d} (scale {scale})");
    }
    assert_eq!(named.len(), r.keys().filter(|k| k.starts_with("grad.")).count(), "every parameter of transformers is ours");
}

/// What a checkpoint of a qwen3 run holds (`config.json` from the model's config,
/// `model.safetensors` under transformers' names) loads back into the same model.
/// `HARNESS_S_KEEP_CHECKPOINT=DIR` keeps the folder there (for loading it in transformers).
#[test]
fn a_qwen3_checkpoint_reads_back_as_the_same_model() {
    let (model, r) = load("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let dir = std::env::var("HARNESS_S_KEEP_CHECKPOINT").map(PathBuf::from).unwrap_or_else(|_| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&model.config.to_hf_json()).unwrap()).unwrap();
    std::fs::write(dir.join("model.safetensors"), hf::write_safetensors(&model.named_tensors()).unwrap()).unwrap();
    let Model::Llama(back) = hf::load_model(&dir, Device::Cpu).unwrap() else { panic!("reads back as qwen3") };
    assert_eq!(back.config, model.config);
    let prompt = ids(&r["prompt_ids"]);
    let tokens = Tensor::from_slice(&prompt).view([1, prompt.len() as i64]);
    assert!(max_diff(&back.forward(&tokens, None), &model.forward(&tokens, None)) == 0.0);
}

/// The learner trains Qwen3.5: its teacher-forced log-probabilities are transformers', and an
/// update over rows that share a prefix (the prefix run once, its GDN state and keys and
/// values continued by every row) has the loss and gradient norm of the same rows run
/// separately, on fewer tokens, and changes the weights.
#[test]
fn the_learner_trains_qwen3_5_with_shared_prefixes_as_with_separate_rows() {
    use native::train::learner::{AdamWConfig, Batch, Learner, LearnerConfig, Sample};
    let r = reference("qwen3.5");
    let prompt: Vec<u32> = ids(&r["prompt_ids"]).into_iter().map(|t| t as u32).collect();
    let decoded: Vec<u32> = ids(&r["decoded_ids"]).into_iter().map(|t| t as u32).collect();
    let cfg = LearnerConfig { optimizer: AdamWConfig { lr: 1e-2, ..Default::default() }, ..Default::default() };
    let learner = Learner::new(Qwen35::load(&fixture("qwen3.5"), Device::Cpu).unwrap(), cfg.clone());
    // sequence_logprob is the mean over the completion's tokens
    let want = r["logprob_sum"].double_value(&[0]) / decoded.len() as f64;
    let got = learner.sequence_logprob(&prompt, &decoded);
    assert!((got - want).abs() < 1e-4, "mean log π of the decoded tokens: {got} against transformers' {want}");

    // a preamble of 20 tokens (the learner shares prefixes of 16 and more): the prompt twice, cut
    let preamble: Vec<u32> = prompt.iter().chain(&prompt).take(20).copied().collect();
    let row = |task: usize, tail: &[u32], completion: &[u32], advantage: f64| Sample {
        task,
        context: preamble.iter().chain(tail).copied().collect(),
        mask: vec![true; completion.len()],
        logq: vec![],
        completion: completion.to_vec(),
        advantage,
        temperature: 1.0,
        scale: 1.0,
        shift: None,
    };
    let batch = Batch {
        tasks: vec!["a".into(), "b".into()],
        samples: vec![
            row(0, &[5, 6], &decoded[..4], 1.0),
            row(0, &[5, 6], &decoded[4..7], -1.0),
            row(0, &[5, 7, 3], &decoded[7..8], 0.5),
            Sample { context: vec![4, 4, 4], ..row(1, &[], &[1, 2], 1.0) },
        ],
        ..Default::default()
    };
    let model = || Qwen35::load(&fixture("qwen3.5"), Device::Cpu).unwrap();
    let mut shared = Learner::new(model(), cfg.clone());
    let mut separate = Learner::new(model(), LearnerConfig { share_prefixes: false, ..cfg });
    let a = shared.update(&batch).unwrap();
    let b = separate.update(&batch).unwrap();
    assert!(a.policy_tokens > 0 && a.forward_tokens < b.forward_tokens, "the prefix ran once: {a:?} vs {b:?}");
    assert!((a.loss - b.loss).abs() < 1e-6 && (a.grad_norm - b.grad_norm).abs() < 1e-4 * b.grad_norm.max(1.0), "{a:?} vs {b:?}");
    let start = model().named_tensors();
    let x = shared.model.named_tensors();
    assert!(x.iter().zip(&start).any(|((_, x), (_, s))| !x.equal(s)), "the update changed no weight");
}

/// A shared prefix run once, its state continuing every row, gives the logits and the
/// gradients of the rows run separately (what the learner's shared plan relies on).
#[test]
fn qwen3_5_shared_prefix_gives_the_logits_and_gradients_of_separate_rows() {
    use native::model::CausalLm;
    let model = Qwen35::load(&fixture("qwen3.5"), Device::Cpu).unwrap();
    let prefix: Vec<i64> = (0..19).map(|i| (i * 7 % 60 + 3) as i64).collect();
    let rest = [[5i64, 9, 2, 11, 30], [7, 6, 0, 0, 0]];
    let full: Vec<i64> = rest.iter().flat_map(|r| prefix.iter().chain(r).copied()).collect();
    let (p, t) = (prefix.len() as i64, 5i64);
    let flat_full = Tensor::from_slice(&(0..2 * t).map(|i| (i / t) * (p + t) + p + i % t).collect::<Vec<_>>());
    let flat_shared = Tensor::arange(2 * t, (Kind::Int64, Device::Cpu));
    let params = model.named_tensors();
    let grads = |logits: Tensor| -> Vec<Tensor> {
        for (_, x) in &params {
            let mut g = x.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        (&logits * &logits).sum(Kind::Float).backward();
        params.iter().map(|(_, x)| x.grad().copy()).collect()
    };
    let a = model.logits_at(&Tensor::from_slice(&full).view([2, p + t]), &flat_full);
    let b = model.logits_at_shared(&Tensor::from_slice(&prefix), &Tensor::from_slice(&rest.concat()).view([2, t]), &flat_shared);
    assert!(max_diff(&a, &b) < 1e-4, "logits differ by {}", max_diff(&a, &b));
    for ((n, _), (x, y)) in params.iter().zip(grads(a).iter().zip(grads(b))) {
        let d = max_diff(x, &y);
        assert!(d < 1e-4 * (1.0 + x.abs().max().double_value(&[])), "gradient of {n} differs by {d}");
    }
}
