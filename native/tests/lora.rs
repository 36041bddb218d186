//! LoRA adapters against peft on the same weights: adapters made by peft on the tiny
//! fixtures of the model families, and peft's own outputs with them
//! (`tests/data/make_lora_fixtures.py`; versions in `tests/data/versions.txt`). Then the
//! adapter's gradient against the full-weight gradient it projects, the files this project
//! writes against peft's, and activation recompute against the plain backward pass.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use native::model::lora::{self, AdapterConfig, ALL_LINEAR};
use native::model::qwen3_5::{Qwen35, Qwen35Config};
use native::model::{hf, CausalLm, Llama, LlamaConfig, Model};
use native::train::learner::{AdamWConfig, Batch, Learner, LearnerConfig, Recompute, Sample};
use tch::{Device, Kind, Tensor};

fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(format!("{family}-tiny"))
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    hf::read_safetensors(&std::fs::read(path).unwrap(), path).unwrap().into_iter().collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The family's base model with peft's adapter attached, and peft's outputs.
fn adapted(family: &str) -> (Model, HashMap<String, Tensor>) {
    let dir = fixture(family).join("lora");
    let cfg_path = dir.join(lora::ADAPTER_CONFIG_FILE);
    let (config, base) = lora::read_peft_config(&std::fs::read_to_string(&cfg_path).unwrap(), &cfg_path).unwrap();
    assert_eq!(base, format!("{family}-tiny"));
    let mut model = hf::load_model(&fixture(family), Device::Cpu).unwrap();
    let weights = dir.join(lora::ADAPTER_FILE);
    lora::load(&mut model, &config, &read(&weights), Kind::Float, &weights).unwrap_or_else(|e| panic!("{e}"));
    (model, read(&dir.join("reference.safetensors")))
}

/// The summed log-probabilities of the row's last 8 tokens, as the fixture computes them.
fn logprob_sum(model: &impl CausalLm, row: &Tensor) -> (Tensor, Tensor) {
    let t = row.size()[0];
    let flat = Tensor::arange(t, (Kind::Int64, Device::Cpu));
    let logits = model.logits_at(&row.view([1, t]), &flat);
    let lp = logits.log_softmax(-1, Kind::Float);
    let targets = row.narrow(0, 12, t - 12).unsqueeze(-1);
    (lp.narrow(0, 11, t - 12).gather(1, &targets, false).sum(Kind::Float), logits)
}

fn agrees_with_peft(family: &str) {
    let (mut model, r) = adapted(family);
    let row = r["row_ids"].to_kind(Kind::Int64);
    let (sum, logits) = logprob_sum(&model, &row);
    let d = max_diff(&logits, &r["logits"]);
    assert!(d < 1e-4, "{family}: adapted logits differ from peft's by {d}");
    assert!((sum.double_value(&[]) - r["logprob_sum"].double_value(&[0])).abs() < 1e-3);
    sum.backward();
    let trainable = model.trainable();
    assert_eq!(trainable.len(), r.keys().filter(|k| k.starts_with("grad.")).count(), "{family}: every factor peft trains");
    for (name, t) in &trainable {
        let want = r.get(&format!("grad.{name}")).unwrap_or_else(|| panic!("{family}: peft has no factor `{name}`"));
        let d = max_diff(&t.grad(), want);
        assert!(d < 1e-4 * (1.0 + want.abs().max().double_value(&[])), "{family}: gradient of {name} differs by {d}");
    }
    assert!(model.named_tensors().iter().all(|(_, t)| !t.requires_grad() && !t.grad().defined()), "the base is frozen");
    lora::merge(&mut model);
    let merged = tch::no_grad(|| logprob_sum(&model, &row).1);
    let d = max_diff(&merged, &r["merged_logits"]);
    assert!(d < 1e-4, "{family}: merged logits differ from peft's merge_and_unload by {d}");
}

#[test]
fn a_peft_adapter_gives_peft_logits_gradients_and_merge_on_qwen3() {
    agrees_with_peft("qwen3");
}

#[test]
fn a_peft_adapter_gives_peft_logits_gradients_and_merge_on_qwen3_5() {
    agrees_with_peft("qwen3.5");
}

/// What this project writes is what peft writes: the same tensor names and shapes for the
/// same targets, and an `adapter_config.json` whose every key is one of peft's with peft's
/// values where they mean the same; the folder reads back as the same adapter.
#[test]
fn the_adapter_files_written_here_are_peft_files() {
    for family in ["qwen3", "qwen3.5"] {
        let dir = fixture(family).join("lora");
        let peft_cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(lora::ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
        let peft_tensors = read(&dir.join(lora::ADAPTER_FILE));
        let mut ours = hf::load_model(&fixture(family), Device::Cpu).unwrap();
        let config = AdapterConfig::lora(4, 8.0, &[ALL_LINEAR]);
        lora::attach(&mut ours, &config, 3, Kind::Float, "learner.adapter").unwrap();
        let written = lora::adapter_tensors(&ours);
        let mut names: Vec<&String> = written.iter().map(|(n, _)| n).collect();
        let mut theirs: Vec<&String> = peft_tensors.keys().collect();
        names.sort();
        theirs.sort();
        assert_eq!(names, theirs, "{family}: tensor names");
        for (n, t) in &written {
            assert_eq!(t.size(), peft_tensors[n].size(), "{family}: {n}");
        }
        let cfg = lora::peft_config(&config, &ours, &format!("{family}-tiny"));
        for (key, value) in cfg.as_object().unwrap() {
            let theirs = peft_cfg.get(key).unwrap_or_else(|| panic!("{family}: `{key}` is not a key peft writes"));
            if !["target_modules", "init_lora_weights"].contains(&key.as_str()) {
                assert!(
                    value == theirs || value.as_f64() == theirs.as_f64() && value.is_number(),
                    "{family}: `{key}` is {value}, peft's {theirs}"
                );
            }
        }
        // the module kinds we write name exactly the modules peft's full names list
        let layers = lora::shapes(&ours);
        let ours_targeted = lora::read_peft_config(&cfg.to_string(), Path::new("ours")).unwrap().0.targeted("t", &layers).unwrap();
        let mut peft_targeted = lora::read_peft_config(&peft_cfg.to_string(), Path::new("peft")).unwrap().0.targeted("t", &layers).unwrap();
        let mut ours_targeted = ours_targeted;
        ours_targeted.sort();
        peft_targeted.sort();
        assert_eq!(ours_targeted, peft_targeted, "{family}: targeted modules");
    }
}

/// dL/dA = s·Bᵀ·G and dL/dB = s·G·Aᵀ, where G is the gradient of the loss with respect to
/// the merged weight W + s·B·A: the adapter trains the projection of the full-weight gradient.
#[test]
fn lora_gradients_are_the_full_gradient_projected_onto_the_factors() {
    for make in [llama as fn(u64) -> Model, qwen3_5] {
        let mut adapted = make(1);
        let shapes = lora::shapes(&adapted);
        let targets: Vec<&str> = ["q_proj", "down_proj", "in_proj_qkv", "out_proj"]
            .into_iter()
            .filter(|t| shapes.iter().any(|(n, _, _)| n.ends_with(&format!(".{t}"))))
            .collect();
        let config = AdapterConfig::lora(3, 6.0, &targets);
        lora::attach(&mut adapted, &config, 5, Kind::Float, "learner.adapter").unwrap();
        {
            let _g = tch::no_grad_guard();
            for (_, mut b) in lora::adapter_tensors(&adapted).into_iter().filter(|(n, _)| n.contains("lora_B")) {
                b.copy_(&(Tensor::randn(b.size(), (Kind::Float, Device::Cpu)) * 0.1));
            }
        }
        let factors: HashMap<String, Tensor> = lora::adapter_tensors(&adapted).into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
        let row = Tensor::from_slice(&[3i64, 9, 4, 17, 8, 2, 30, 11, 5, 6, 21, 7, 13, 1, 19, 25]);
        logprob_sum(&adapted, &row).0.backward();
        let grads: HashMap<String, Tensor> = adapted.trainable().into_iter().map(|(n, t)| (n, t.grad())).collect();

        // the same model with the merged weights W + s·B·A as ordinary trainable weights
        lora::merge(&mut adapted);
        let merged: HashMap<String, Tensor> = adapted.named_tensors().into_iter().collect();
        let full = make(1);
        {
            let _g = tch::no_grad_guard();
            for (n, mut t) in full.named_tensors() {
                t.copy_(&merged[&n]);
            }
        }
        logprob_sum(&full, &row).0.backward();
        let s = config.scale();
        let mut checked = 0;
        for (module, _, _) in lora::shapes(&full) {
            let Some(a) = factors.get(&lora::peft_key(&module, 'A')) else { continue };
            let b = &factors[&lora::peft_key(&module, 'B')];
            let g = full.named_tensors().into_iter().find(|(n, _)| *n == format!("{module}.weight")).unwrap().1.grad();
            let (want_a, want_b) = (b.tr().matmul(&g) * s, g.matmul(&a.tr()) * s);
            let (got_a, got_b) = (&grads[&lora::peft_key(&module, 'A')], &grads[&lora::peft_key(&module, 'B')]);
            let tol = |w: &Tensor| 1e-5 * (1.0 + w.abs().max().double_value(&[]));
            assert!(max_diff(got_a, &want_a) < tol(&want_a), "{module}: dA ≠ s·Bᵀ·dW by {}", max_diff(got_a, &want_a));
            assert!(max_diff(got_b, &want_b) < tol(&want_b), "{module}: dB ≠ s·dW·Aᵀ by {}", max_diff(got_b, &want_b));
            checked += 1;
        }
        assert!(checked >= 4, "only {checked} adapted layers checked");
    }
}

fn llama(seed: u64) -> Model {
    Llama::new(LlamaConfig::tiny(40, 32, 2), Device::Cpu, seed).unwrap().into()
}

fn qwen3_5(seed: u64) -> Model {
    Qwen35::new(Qwen35Config::shape("tiny", Some(40)).unwrap(), Device::Cpu, seed).unwrap().into()
}

/// Rows with a shared preamble (so that prefix sharing has something to share) and one alone.
fn batch() -> Batch {
    let pre: Vec<u32> = (0..9).map(|i| (i * 7 % 37 + 1) as u32).collect();
    let row = |task: usize, tail: &[u32], completion: &[u32], adv: f64| Sample {
        task,
        context: pre.iter().chain(tail).copied().collect(),
        completion: completion.to_vec(),
        mask: vec![true; completion.len()],
        logq: vec![],
        advantage: adv,
        temperature: 1.0,
        scale: 1.0,
        shift: None,
    };
    Batch {
        tasks: vec!["a".into(), "b".into()],
        samples: vec![
            row(0, &[5, 6], &[7, 8, 9], 1.0),
            row(0, &[5, 2], &[9, 8], -1.0),
            Sample { context: vec![4, 4, 4], ..row(1, &[], &[1, 2, 3, 4], 0.5) },
        ],
        ..Default::default()
    }
}

/// One update's gradient of every trainable parameter (after clipping): AdamW's first
/// moment after its first step is (1 − β1)·g, read back exactly; and the loss.
fn gradients(make: fn(u64) -> Model, config: LearnerConfig) -> (Vec<(String, Tensor)>, f64) {
    let optimizer = AdamWConfig { lr: 0.0, max_grad_norm: 1e9, ..Default::default() };
    let mut learner = Learner::from_base(make(2), LearnerConfig { optimizer, ..config }).unwrap();
    // a fresh B is zero, and so A's gradient: give B values, the same in every run
    let _g = tch::no_grad_guard();
    for (_, mut b) in lora::adapter_tensors(&learner.model).into_iter().filter(|(n, _)| n.contains("lora_B")) {
        b.copy_(&(Tensor::arange(b.numel() as i64, (Kind::Float, Device::Cpu)).sin().view(b.size().as_slice()) * 0.05));
    }
    drop(_g);
    let m = learner.update(&batch()).unwrap();
    assert!(m.policy_tokens > 0 && m.grad_norm > 0.0, "{m:?}");
    let beta1 = learner.optim.config.beta1;
    let names: Vec<String> = learner.model.trainable().into_iter().map(|(n, _)| n).collect();
    (names.into_iter().map(|n| (n.clone(), &learner.optim.exp_avg[&n] / (1.0 - beta1))).collect(), m.loss)
}

/// Recompute gives the gradient of the plain backward pass (≤ 1e-6 relative in float32),
/// full-weight and LoRA, with and without prefix sharing, on both families.
#[test]
fn recomputed_blocks_give_the_gradients_of_the_plain_backward_pass() {
    for make in [llama as fn(u64) -> Model, qwen3_5] {
        for adapter in [None, Some(AdapterConfig::lora(4, 8.0, &[ALL_LINEAR]))] {
            for share_prefixes in [true, false] {
                let cfg = LearnerConfig { adapter: adapter.clone(), share_prefixes, ..Default::default() };
                let (plain, loss_a) = gradients(make, cfg.clone());
                let (blocks, loss_b) = gradients(make, LearnerConfig { recompute: Recompute::Blocks, ..cfg });
                assert_eq!(plain.len(), blocks.len());
                assert!((loss_a - loss_b).abs() <= 1e-6 * loss_a.abs().max(1e-6), "loss {loss_a} vs {loss_b}");
                for ((n, a), (_, b)) in plain.iter().zip(&blocks) {
                    let scale = a.abs().max().double_value(&[]);
                    assert!(scale > 0.0, "{n} has no gradient");
                    let d = max_diff(a, b);
                    assert!(d <= 1e-6 * scale, "{n} (adapter {}, shared {share_prefixes}): {d} of {scale}", adapter.is_some());
                }
            }
        }
    }
}

/// An adapter trained and written here is a PEFT adapter folder: the learner's checkpoint of
/// a LoRA run over the qwen3 fixture holds PEFT's two files, which read back (this crate's
/// reader) to the trained model's logits. Where torch, transformers and peft are installed
/// (`HARNESS_S_PEFT_PYTHON` names that Python), peft loads the folder over the same base and
/// its logits, adapted and merged, are this crate's within 1e-4.
#[tokio::test]
async fn an_adapter_written_here_is_one_peft_loads() {
    use native::train::checkpoint::{self, SaveInfo};
    let base = fixture("qwen3");
    let config = LearnerConfig {
        adapter: Some(AdapterConfig::lora(4, 8.0, &[ALL_LINEAR])),
        optimizer: AdamWConfig { lr: 1e-2, ..Default::default() },
        ..Default::default()
    };
    let mut learner = Learner::from_base(hf::load_model(&base, Device::Cpu).unwrap(), config.clone()).unwrap();
    for _ in 0..3 {
        learner.update(&batch()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let store = infra::store::LocalStore::new(dir.path()).unwrap();
    let info = SaveInfo { run_id: "r".into(), step: 1, base_model: base.display().to_string(), ..Default::default() };
    checkpoint::save(&store, &learner, None, &info).await.unwrap();
    let folder = dir.path().join("runs/r/checkpoints/step=1");
    assert!(folder.join(lora::ADAPTER_FILE).is_file() && !folder.join("model.safetensors").exists());
    let row = Tensor::from_slice(&[3i64, 9, 4, 17, 8, 2, 30, 11, 5, 6, 21, 7, 13, 1, 19, 25, 40, 33, 12, 10]);
    let ours = tch::no_grad(|| logprob_sum(&learner.model, &row).1);
    let (reloaded, _, _) = checkpoint::load_model(&store, "r", 1, Device::Cpu).await.unwrap();
    let back = tch::no_grad(|| logprob_sum(&reloaded, &row).1);
    assert!(max_diff(&ours, &back) < 1e-5, "reloaded and merged: {}", max_diff(&ours, &back));
    let Ok(python) = std::env::var("HARNESS_S_PEFT_PYTHON") else {
        eprintln!("peft's side not run: set HARNESS_S_PEFT_PYTHON to a Python with torch, transformers and peft");
        return;
    };
    let reference = dir.path().join("reference.safetensors");
    std::fs::write(&reference, hf::write_safetensors(&[("row_ids".into(), row.shallow_clone()), ("logits".into(), ours)]).unwrap())
        .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/check_peft_loads.py");
    let out = std::process::Command::new(python).arg(script).arg(&folder).arg(&base).arg(&reference).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let diffs: Vec<f64> = text.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    eprintln!("peft: {text}");
    assert!(diffs.len() == 2 && diffs.iter().all(|d| *d < 1e-4), "peft's logits differ: {text}");
}

/// Under `precision = "bf16"` a LoRA learner keeps the frozen base's matrices in bf16 (2
/// bytes a parameter), its norms in float32, the adapter in float32, and trains: the loss
/// follows the float32 learner's within bf16's rounding and the adapter moves.
#[test]
fn a_bf16_lora_learner_keeps_the_base_in_bf16_and_trains_the_adapter() {
    use native::train::learner::Precision;
    for make in [llama as fn(u64) -> Model, qwen3_5] {
        let config = |precision| LearnerConfig {
            adapter: Some(AdapterConfig::lora(4, 8.0, &[ALL_LINEAR])),
            optimizer: AdamWConfig { lr: 1e-2, ..Default::default() },
            precision,
            ..Default::default()
        };
        let mut f32_learner = Learner::from_base(make(2), config(Precision::F32)).unwrap();
        let mut bf16 = Learner::from_base(make(2), config(Precision::Bf16)).unwrap();
        for (n, t) in bf16.model.named_tensors() {
            let want = if t.dim() == 2 { Kind::BFloat16 } else { Kind::Float };
            assert_eq!(t.kind(), want, "{n}");
        }
        let before: Vec<Tensor> = bf16.model.trainable().iter().map(|(_, t)| t.copy()).collect();
        assert!(bf16.model.trainable().iter().all(|(_, t)| t.kind() == Kind::Float));
        for _ in 0..2 {
            let (a, b) = (f32_learner.update(&batch()).unwrap(), bf16.update(&batch()).unwrap());
            assert!(b.policy_tokens > 0 && b.loss.is_finite() && b.grad_norm > 0.0, "{b:?}");
            assert!((a.loss - b.loss).abs() < 3e-2 * a.loss.abs().max(1e-2), "{} vs {}", a.loss, b.loss);
        }
        let moved = bf16.model.trainable().iter().zip(&before).filter(|((_, t), b)| !t.equal(b)).count();
        assert!(moved > 0, "the bf16 learner's adapter did not move");
    }
}
