//! LoRA adapters in PEFT's layout: a linear layer `W` `[out, in]` gains two factors
//! `A` `[r, in]` and `B` `[out, r]`, and computes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with s = alpha / r
//! (Hu et al. 2021, Eq. 3; PEFT's `LoraLayer`). `B` starts at zero, so a fresh adapter is the
//! base model; `A` starts as PEFT's (Kaiming-uniform, bound 1/√in).
//!
//! The files are PEFT's: `adapter_model.safetensors` holds
//! `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (float32), and
//! `adapter_config.json` PEFT's `LoraConfig` ([`peft_config`]), so that peft, vLLM and
//! SGLang load them as they are. [`merge`] folds an adapter into its base weights
//! (W ← W + s·B·A) for the engine and for export.
//!
//! This file knows only linear layers by name: each architecture lists its own
//! ([`Adaptable::linears`]) and the functions here attach, read, load and merge.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::model::layers::Linear;
use crate::NativeError;

/// `adapter_model.safetensors`: the adapter's weights under PEFT's names.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// `adapter_config.json`: PEFT's `LoraConfig`.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The target that means every linear layer of the decoder (PEFT's `all-linear`: the LM
/// head excluded).
pub const ALL_LINEAR: &str = "all-linear";

/// The factors of one adapted layer.
pub struct Lora {
    /// `[r, in]`
    pub a: Tensor,
    /// `[out, r]`
    pub b: Tensor,
    /// alpha / r
    pub scale: f64,
}

/// `[learner] adapter`: which layers get a LoRA adapter and of what rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterConfig {
    /// `lora` (the only kind).
    #[serde(default)]
    pub kind: AdapterKind,
    /// r: the rank of every adapted layer.
    pub rank: i64,
    /// alpha: the update is scaled by alpha / r (default: 2·r, PEFT's common choice).
    #[serde(default)]
    pub alpha: Option<f64>,
    /// The layers adapted, by name as PEFT's `target_modules` matches them: a name is a
    /// module's last segments (`q_proj`, `self_attn.q_proj`, `linear_attn.in_proj_qkv`), or
    /// `all-linear` for every linear layer of the decoder. Default: `all-linear`.
    #[serde(default = "all_linear")]
    pub targets: Vec<String>,
    /// Dropout on the adapter's input (PEFT's `lora_dropout`); only 0 is run.
    #[serde(default)]
    pub dropout: f64,
}

fn all_linear() -> Vec<String> {
    vec![ALL_LINEAR.to_string()]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdapterKind {
    #[default]
    Lora,
}

impl AdapterConfig {
    pub fn lora(rank: i64, alpha: f64, targets: &[&str]) -> Self {
        AdapterConfig {
            kind: AdapterKind::Lora,
            rank,
            alpha: Some(alpha),
            targets: targets.iter().map(|t| t.to_string()).collect(),
            dropout: 0.0,
        }
    }

    pub fn alpha(&self) -> f64 {
        self.alpha.unwrap_or(2.0 * self.rank as f64)
    }

    /// s = alpha / r.
    pub fn scale(&self) -> f64 {
        self.alpha() / self.rank as f64
    }

    /// The modules of `layers` (name, `[out, in]`) this adapter targets, checked: a rank of
    /// 0 or above a targeted layer's width, a target that names no module, or a
    /// dropout other than 0 is an error naming `field` and what exists.
    pub fn targeted(&self, field: &str, layers: &[(String, i64, i64)]) -> Result<Vec<String>, NativeError> {
        let bad = |key: &str, detail: String| NativeError::Config { field: format!("{field}.{key}"), detail };
        if self.rank < 1 {
            return Err(bad("rank", format!("{} is not a rank: use 1 or more (8 to 64 is common)", self.rank)));
        }
        if !(self.alpha() > 0.0 && self.alpha().is_finite()) {
            return Err(bad("alpha", format!("{} is not a positive scale", self.alpha())));
        }
        if self.dropout != 0.0 {
            return Err(bad(
                "dropout",
                format!(
                    "{} is not run: dropout would make the scored log-probabilities random, so the first pass would not be π_old; use 0",
                    self.dropout
                ),
            ));
        }
        if self.targets.is_empty() {
            return Err(bad("targets", format!("names no layer; use `{ALL_LINEAR}` or names such as `q_proj`")));
        }
        let mut out = vec![];
        for target in &self.targets {
            let hits: Vec<&(String, i64, i64)> = layers.iter().filter(|(name, _, _)| matches(target, name)).collect();
            if hits.is_empty() {
                let mut kinds: Vec<String> = layers.iter().map(|(n, _, _)| short_name(n)).collect();
                kinds.sort();
                kinds.dedup();
                return Err(bad(
                    "targets",
                    format!("`{target}` names no linear layer of this model; it has {} (or use `{ALL_LINEAR}`)", kinds.join(", ")),
                ));
            }
            for (name, rows, cols) in hits {
                // above both sides the factors are wider than the weight itself (between
                // them, as for the narrow GDN gates under `all-linear`, PEFT runs it too)
                if self.rank > (*rows).max(*cols) {
                    return Err(bad(
                        "rank",
                        format!("{} is above the width of `{name}` ([{rows}, {cols}]): a rank is at most {}", self.rank, rows.max(cols)),
                    ));
                }
                if !out.contains(name) {
                    out.push(name.clone());
                }
            }
        }
        Ok(out)
    }
}

/// Whether PEFT's `target_modules` entry `target` names `module`: `all-linear`, the whole
/// name, or its last dot-separated segments.
fn matches(target: &str, module: &str) -> bool {
    target == ALL_LINEAR || module == target || module.ends_with(&format!(".{target}"))
}

/// The kind of layer a module is, as a user names it (`self_attn.q_proj`).
fn short_name(module: &str) -> String {
    let parts: Vec<&str> = module.split('.').collect();
    parts[parts.len().saturating_sub(2)..].join(".")
}

/// An architecture's linear layers by module name (the weight's name without `.weight`), in
/// a fixed order: what an adapter can target.
pub trait Adaptable {
    fn linears(&self) -> Vec<(String, &Linear)>;
    fn linears_mut(&mut self) -> Vec<(String, &mut Linear)>;
    /// The base parameters (everything but the adapter), to freeze.
    fn base_vars(&self) -> &tch::nn::VarStore;
}

/// The name of a factor (`A` or `B`) of `module` in PEFT's files.
pub fn peft_key(module: &str, factor: char) -> String {
    format!("base_model.model.{module}.lora_{factor}.weight")
}

/// Whether any layer of `model` has an adapter.
pub fn is_adapted(model: &(impl Adaptable + ?Sized)) -> bool {
    model.linears().iter().any(|(_, l)| l.lora.is_some())
}

/// Runs `f` on `model` with every adapter's scale at 0, the base model alone (a LoRA run's
/// starting policy, the reference of its KL), then restores the scales.
pub fn without_adapters<M: Adaptable + ?Sized, R>(model: &mut M, f: impl FnOnce(&M) -> R) -> R {
    let saved: Vec<f64> =
        model.linears_mut().into_iter().filter_map(|(_, l)| l.lora.as_mut().map(|a| std::mem::replace(&mut a.scale, 0.0))).collect();
    let out = f(model);
    let mut saved = saved.into_iter();
    for (_, l) in model.linears_mut() {
        if let Some(a) = l.lora.as_mut() {
            a.scale = saved.next().expect("one scale per adapted layer");
        }
    }
    out
}

/// The (out, in) shape of every linear layer of `model`.
pub fn shapes(model: &(impl Adaptable + ?Sized)) -> Vec<(String, i64, i64)> {
    model
        .linears()
        .into_iter()
        .map(|(n, l)| {
            let s = l.weight.size();
            (n, s[0], s[1])
        })
        .collect()
}

/// Attaches a fresh adapter of `config` to `model` (A drawn from `seed` and the module's
/// name, B zero: the model's outputs are unchanged) and freezes the base, stored in
/// `base_kind` (float32, or bfloat16 where the products run in bf16). Errors name `field`.
pub fn attach(
    model: &mut (impl Adaptable + ?Sized),
    config: &AdapterConfig,
    seed: u64,
    base_kind: Kind,
    field: &str,
) -> Result<(), NativeError> {
    if is_adapted(model) {
        return Err(NativeError::Config { field: field.into(), detail: "the model already has an adapter".into() });
    }
    let targets = config.targeted(field, &shapes(model))?;
    freeze(model, base_kind);
    let scale = config.scale();
    for (name, layer) in model.linears_mut() {
        if !targets.contains(&name) {
            continue;
        }
        let size = layer.weight.size();
        let (out, inp) = (size[0], size[1]);
        let dev = layer.weight.device();
        let bound = 1.0 / (inp as f64).sqrt();
        let a = seeded_uniform(seed, &name, &[config.rank, inp], bound).to_device(dev).set_requires_grad(true);
        let b = Tensor::zeros([out, config.rank], (Kind::Float, dev)).set_requires_grad(true);
        layer.lora = Some(Lora { a, b, scale });
    }
    Ok(())
}

/// Freezes the base parameters (no gradient) and stores its matrices in `kind` (the
/// embedding and the linear layers; norms, biases and the GDN layers' vectors and
/// convolution stay float32, as transformers computes them).
fn freeze(model: &mut (impl Adaptable + ?Sized), kind: Kind) {
    let vs = model.base_vars();
    let _g = tch::no_grad_guard();
    for (_, mut v) in vs.variables() {
        if v.dim() == 2 && v.kind() != kind {
            v.set_data(&v.to_kind(kind));
        }
        let _ = v.set_requires_grad(false);
    }
}

/// Uniform on [−bound, bound], drawn from `seed` and `name` (not libtorch's global
/// generator), as [`crate::model::hf::randomize`] draws.
fn seeded_uniform(seed: u64, name: &str, shape: &[i64], bound: f64) -> Tensor {
    use rand::Rng;
    let mut rng = crate::model::hf::named_rng(seed, format!("lora_A:{name}").as_bytes());
    let n: i64 = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32).collect();
    Tensor::from_slice(&values).view(shape)
}

/// The adapter's factors under PEFT's names (shared storage, float32), sorted.
pub fn adapter_tensors(model: &(impl Adaptable + ?Sized)) -> Vec<(String, Tensor)> {
    let mut out = vec![];
    for (name, layer) in model.linears() {
        if let Some(l) = &layer.lora {
            out.push((peft_key(&name, 'A'), l.a.shallow_clone()));
            out.push((peft_key(&name, 'B'), l.b.shallow_clone()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// PEFT's `adapter_config.json` for `config`: the fields PEFT 0.x writes for a LoRA adapter
/// (`r`, `lora_alpha`, `target_modules` as the module kinds adapted, ...), with
/// `base_model_name_or_path` naming the base.
pub fn peft_config(config: &AdapterConfig, model: &(impl Adaptable + ?Sized), base_model: &str) -> serde_json::Value {
    let mut targets: Vec<String> =
        model.linears().iter().filter(|(_, l)| l.lora.is_some()).map(|(n, _)| n.rsplit('.').next().unwrap_or(n).to_string()).collect();
    targets.sort();
    targets.dedup();
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha(),
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": false,
        "use_dora": false,
        "revision": null,
    })
}

/// Reads PEFT's `adapter_config.json` (`path` names it in errors) back into an
/// [`AdapterConfig`] and the base it names. What this reader does not run (DoRA, rsLoRA,
/// per-layer ranks, trained biases, extra modules) is refused by field.
pub fn read_peft_config(text: &str, path: &Path) -> Result<(AdapterConfig, String), NativeError> {
    let bad = |detail: String| NativeError::Format { path: path.into(), detail };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v.get("peft_type").and_then(|t| t.as_str()) != Some("LORA") {
        return Err(bad(format!("`peft_type` is {}, not \"LORA\"", v.get("peft_type").unwrap_or(&serde_json::Value::Null))));
    }
    let truthy = |k: &str| v.get(k).is_some_and(|x| x.as_bool() == Some(true));
    let nonempty = |k: &str| v.get(k).is_some_and(|x| !x.is_null() && x.as_object().is_none_or(|o| !o.is_empty()));
    for key in ["use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora"] {
        if truthy(key) {
            return Err(bad(format!("`{key}: true` is not run by this loader")));
        }
    }
    for key in [
        "rank_pattern",
        "alpha_pattern",
        "modules_to_save",
        "layers_to_transform",
        "exclude_modules",
        "target_parameters",
        "trainable_token_indices",
        "layer_replication",
        "alora_invocation_tokens",
    ] {
        if nonempty(key) {
            return Err(bad(format!("`{key}` is not run by this loader (one rank and alpha for every adapted layer)")));
        }
    }
    if v.get("bias").and_then(|b| b.as_str()).is_some_and(|b| b != "none") {
        return Err(bad("`bias` other than \"none\" is not run by this loader".into()));
    }
    let rank = v.get("r").and_then(|r| r.as_i64()).ok_or_else(|| bad("`r` (the rank) is missing".into()))?;
    let alpha = v.get("lora_alpha").and_then(|a| a.as_f64()).ok_or_else(|| bad("`lora_alpha` is missing".into()))?;
    let targets: Vec<String> = match v.get("target_modules") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|t| t.as_str().map(String::from)).collect(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        _ => return Err(bad("`target_modules` is missing".into())),
    };
    let base = v.get("base_model_name_or_path").and_then(|b| b.as_str()).unwrap_or_default().to_string();
    let config = AdapterConfig {
        kind: AdapterKind::Lora,
        rank,
        alpha: Some(alpha),
        targets,
        dropout: v.get("lora_dropout").and_then(|d| d.as_f64()).unwrap_or(0.0),
    };
    Ok((config, base))
}

/// Attaches the adapter `tensors` (PEFT's names, any float kind) of `config` to `model`,
/// frozen base in `base_kind`. Every module `config` targets must have both factors of the
/// right shape, and every tensor must belong to one: errors name `source` and the tensor.
pub fn load(
    model: &mut (impl Adaptable + ?Sized),
    config: &AdapterConfig,
    tensors: &HashMap<String, Tensor>,
    base_kind: Kind,
    source: &Path,
) -> Result<(), NativeError> {
    let targets = config.targeted(&source.display().to_string(), &shapes(model))?;
    let mut unused: BTreeMap<&str, ()> = tensors.keys().map(|k| (k.as_str(), ())).collect();
    let mut found = vec![];
    for (name, layer) in model.linears() {
        if !targets.contains(&name) {
            continue;
        }
        let size = layer.weight.size();
        let mut factor = |f: char, shape: [i64; 2]| -> Result<Tensor, NativeError> {
            let key = peft_key(&name, f);
            let t = tensors.get(&key).ok_or_else(|| NativeError::MissingTensor { path: source.into(), tensor: key.clone() })?;
            if t.size() != shape {
                return Err(NativeError::Shape { path: source.into(), tensor: key, expected: shape.to_vec(), got: t.size() });
            }
            unused.remove(key.as_str());
            Ok(t.to_kind(Kind::Float).to_device(layer.weight.device()).detach().set_requires_grad(true))
        };
        let a = factor('A', [config.rank, size[1]])?;
        let b = factor('B', [size[0], config.rank])?;
        found.push((name, a, b));
    }
    if let Some((extra, _)) = unused.into_iter().next() {
        return Err(NativeError::Format {
            path: source.into(),
            detail: format!("`{extra}` belongs to no layer the adapter's config targets (a different base model or config?)"),
        });
    }
    freeze(model, base_kind);
    let scale = config.scale();
    let mut by_name: HashMap<String, (Tensor, Tensor)> = found.into_iter().map(|(n, a, b)| (n, (a, b))).collect();
    for (name, layer) in model.linears_mut() {
        if let Some((a, b)) = by_name.remove(&name) {
            layer.lora = Some(Lora { a, b, scale });
        }
    }
    Ok(())
}

/// Whether `dir` is an adapter folder (PEFT's `adapter_config.json` in it).
pub fn is_adapter_folder(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG_FILE).is_file()
}

/// Attaches the adapter of the PEFT folder `dir` (`adapter_config.json` and
/// `adapter_model.safetensors`; a `manifest.json` beside them is checked) to `model`, the
/// base frozen in float32; returns its configuration and the base it names.
pub fn load_folder(model: &mut (impl Adaptable + ?Sized), dir: &Path) -> Result<(AdapterConfig, String), NativeError> {
    let manifest = crate::model::hf::FolderManifest::read(dir)?;
    let read = |name: &str| -> Result<Vec<u8>, NativeError> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).map_err(|e| NativeError::io(&path, e))?;
        manifest.check(&path, &bytes)?;
        Ok(bytes)
    };
    let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
    let (config, base) = read_peft_config(&String::from_utf8_lossy(&read(ADAPTER_CONFIG_FILE)?), &cfg_path)?;
    let weights = dir.join(ADAPTER_FILE);
    let tensors = crate::model::hf::read_safetensors(&read(ADAPTER_FILE)?, &weights)?;
    load(model, &config, &tensors, Kind::Float, &weights)?;
    Ok((config, base))
}

/// Folds every adapter of `model` into its base weight (W ← W + s·B·A, in the weight's
/// kind) and removes it: the merged model computes what the adapted one did.
pub fn merge(model: &mut (impl Adaptable + ?Sized)) {
    let _g = tch::no_grad_guard();
    for (_, layer) in model.linears_mut() {
        if let Some(l) = layer.lora.take() {
            let delta = l.b.matmul(&l.a) * l.scale;
            let merged = layer.weight.to_kind(Kind::Float) + delta.to_device(layer.weight.device());
            layer.weight.copy_(&merged.to_kind(layer.weight.kind()));
        }
    }
}

/// Unfreezes the base (float32, trainable again): after [`merge`], to train every weight.
pub fn unfreeze(model: &mut (impl Adaptable + ?Sized)) {
    let _g = tch::no_grad_guard();
    for (_, mut v) in model.base_vars().variables() {
        if v.kind() != Kind::Float {
            v.set_data(&v.to_kind(Kind::Float));
        }
        let _ = v.set_requires_grad(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CausalLm, Llama, LlamaConfig};
    use tch::Device;

    fn tiny() -> Llama {
        Llama::new(LlamaConfig::tiny(40, 16, 2), Device::Cpu, 3).unwrap()
    }

    #[test]
    fn targets_match_like_peft_and_nonsense_is_refused_by_field() {
        let m = tiny();
        let layers = shapes(&m);
        let q = AdapterConfig::lora(4, 8.0, &["q_proj"]).targeted("learner.adapter", &layers).unwrap();
        assert_eq!(q, vec!["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]);
        let all = AdapterConfig::lora(4, 8.0, &[ALL_LINEAR]).targeted("learner.adapter", &layers).unwrap();
        assert_eq!(all.len(), 2 * 7, "q, k, v, o, gate, up, down of two layers");
        let err = AdapterConfig::lora(4, 8.0, &["in_proj_qkv"]).targeted("learner.adapter", &layers).unwrap_err().to_string();
        assert!(err.contains("learner.adapter.targets") && err.contains("in_proj_qkv") && err.contains("self_attn.q_proj"), "{err}");
        let err = AdapterConfig::lora(0, 8.0, &["q_proj"]).targeted("learner.adapter", &layers).unwrap_err().to_string();
        assert!(err.contains("learner.adapter.rank"), "{err}");
        let err = AdapterConfig::lora(33, 8.0, &["down_proj"]).targeted("learner.adapter", &layers).unwrap_err().to_string();
        assert!(err.contains("learner.adapter.rank") && err.contains("at most 32"), "{err}");
        let err = AdapterConfig { dropout: 0.1, ..AdapterConfig::lora(4, 8.0, &["q_proj"]) }
            .targeted("learner.adapter", &layers)
            .unwrap_err()
            .to_string();
        assert!(err.contains("learner.adapter.dropout"), "{err}");
    }

    /// A fresh adapter (B = 0) leaves the logits as they were; a trained one merges into
    /// weights that give the adapted model's logits.
    #[test]
    fn a_fresh_adapter_changes_nothing_and_a_merged_one_computes_the_same() {
        let mut m = tiny();
        let toks = Tensor::from_slice(&[1i64, 5, 9, 3, 7]).view([1, 5]);
        let base = m.forward(&toks, None);
        attach(&mut m, &AdapterConfig::lora(4, 8.0, &[ALL_LINEAR]), 1, Kind::Float, "learner.adapter").unwrap();
        assert!((m.forward(&toks, None) - &base).abs().max().double_value(&[]) == 0.0);
        {
            let _g = tch::no_grad_guard();
            for (_, mut b) in adapter_tensors(&m).into_iter().filter(|(n, _)| n.contains("lora_B")) {
                b.copy_(&(Tensor::randn(b.size(), (Kind::Float, Device::Cpu)) * 0.05));
            }
        }
        let adapted = m.forward(&toks, None).detach();
        assert!((&adapted - &base).abs().max().double_value(&[]) > 1e-3, "the adapter changed nothing");
        // only the adapter trains
        assert!(m.named_tensors().iter().all(|(_, t)| !t.requires_grad()));
        assert_eq!(m.trainable().len(), 2 * 14);
        merge(&mut m);
        assert!(!is_adapted(&m));
        let d = (m.forward(&toks, None) - adapted).abs().max().double_value(&[]);
        assert!(d < 1e-5, "merged logits differ by {d}");
    }

    #[test]
    fn peft_config_round_trips_and_what_is_not_run_is_refused() {
        let mut m = tiny();
        let cfg = AdapterConfig::lora(4, 16.0, &["q_proj", "v_proj"]);
        attach(&mut m, &cfg, 1, Kind::Float, "learner.adapter").unwrap();
        let json = peft_config(&cfg, &m, "/models/base");
        assert_eq!(json["target_modules"], serde_json::json!(["q_proj", "v_proj"]));
        let (back, base) = read_peft_config(&json.to_string(), Path::new("adapter_config.json")).unwrap();
        assert_eq!((back.rank, back.alpha(), base.as_str()), (4, 16.0, "/models/base"));
        let mut dora = json.clone();
        dora["use_dora"] = serde_json::json!(true);
        let err = read_peft_config(&dora.to_string(), Path::new("a/adapter_config.json")).unwrap_err().to_string();
        assert!(err.contains("a/adapter_config.json") && err.contains("use_dora"), "{err}");
    }
}
