//! A model of any supported family, chosen by `config.json`'s `model_type`: what the
//! loader, the learner's checkpoints and the engine hold when they do not care which
//! architecture it is. Each variant is one architecture file ([`Llama`] for llama, qwen2 and
//! qwen3; [`Qwen35`] for Qwen3.5); this file only dispatches.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::model::config::LlamaConfig;
use crate::model::llama::{KvCache, Llama};
use crate::model::qwen3_5::{Qwen35, Qwen35Cache, Qwen35Config, CHUNK};
use crate::model::CausalLm;
use crate::NativeError;

/// The `model_type`s of Qwen3.5: a released checkpoint (text config under `text_config`) and
/// transformers' text-only model.
pub const QWEN3_5: [&str; 2] = ["qwen3_5", "qwen3_5_text"];

/// A loaded model of any supported family.
pub enum Model {
    Llama(Llama),
    Qwen35(Qwen35),
}

impl From<Llama> for Model {
    fn from(m: Llama) -> Self {
        Model::Llama(m)
    }
}

impl From<Qwen35> for Model {
    fn from(m: Qwen35) -> Self {
        Model::Qwen35(m)
    }
}

/// What one sequence carries between [`Model::logits_last`] calls.
pub enum Cache {
    Llama(KvCache),
    Qwen35(Qwen35Cache),
}

impl Model {
    /// This model's configuration (its sizes without its weights).
    pub fn model_config(&self) -> crate::model::shape::ModelConfig {
        match self {
            Model::Llama(m) => crate::model::shape::ModelConfig::Llama(m.config.clone()),
            Model::Qwen35(m) => crate::model::shape::ModelConfig::Qwen35(m.config.clone()),
        }
    }

    /// The model of `config.json`'s text (`config_path` names it in errors) with the
    /// parameters `tensors` (transformers' names, any float kind; `source` names them).
    pub fn from_hf(
        config_text: &str,
        config_path: &Path,
        tensors: &HashMap<String, Tensor>,
        device: Device,
        source: &Path,
    ) -> Result<Model, NativeError> {
        let v: serde_json::Value = serde_json::from_str(config_text)
            .map_err(|e| NativeError::Format { path: config_path.into(), detail: format!("not JSON: {e}") })?;
        let model_type = v.get("model_type").and_then(|t| t.as_str()).unwrap_or_default();
        if QWEN3_5.contains(&model_type) {
            let cfg = Qwen35Config::from_hf_json(config_path, config_text)?;
            return Ok(Model::Qwen35(Qwen35::from_tensors(cfg, tensors, device, source)?));
        }
        let cfg = LlamaConfig::from_hf_json(config_path, config_text)?;
        Ok(Model::Llama(Llama::from_tensors(cfg, tensors, device, source)?))
    }

    /// `config.json`'s `model_type`.
    pub fn architecture(&self) -> String {
        match self {
            Model::Llama(m) => m.config.model_type.clone(),
            Model::Qwen35(m) => m.config.hf.get("model_type").and_then(|t| t.as_str()).unwrap_or("qwen3_5_text").to_string(),
        }
    }

    /// The `config.json` a folder of this model's weights loads with (transformers, vLLM, SGLang).
    pub fn config_json(&self) -> serde_json::Value {
        match self {
            Model::Llama(m) => m.config.to_hf_json(),
            Model::Qwen35(m) => m.config.to_hf_json(),
        }
    }

    /// Positions the model takes (prompt and reply together).
    pub fn max_positions(&self) -> usize {
        match self {
            Model::Llama(m) => m.config.max_position_embeddings as usize,
            Model::Qwen35(m) => m.config.max_position_embeddings as usize,
        }
    }

    /// Decoder layers and the residual width.
    pub fn shape(&self) -> (i64, i64) {
        match self {
            Model::Llama(m) => (m.config.num_hidden_layers, m.config.hidden_size),
            Model::Qwen35(m) => (m.config.num_hidden_layers, m.config.hidden_size),
        }
    }

    pub fn vocab_size(&self) -> i64 {
        match self {
            Model::Llama(m) => m.config.vocab_size,
            Model::Qwen35(m) => m.config.vocab_size,
        }
    }

    /// The llama-family model, for what runs only those (the engine's own CPU kernels, GGUF
    /// export); `what` names that in the error.
    pub fn llama(&self, what: &str) -> Result<&Llama, NativeError> {
        match self {
            Model::Llama(m) => Ok(m),
            Model::Qwen35(_) => Err(NativeError::Config {
                field: "model_type".into(),
                detail: format!("{what} takes llama, qwen2 and qwen3 models; this one is `{}` (Qwen3.5)", self.architecture()),
            }),
        }
    }

    /// A copy with its own parameters.
    pub fn clone_weights(&self) -> Result<Model, NativeError> {
        let tensors: HashMap<String, Tensor> = self.named_tensors().into_iter().collect();
        let (text, source) = (self.config_json().to_string(), Path::new("(in memory)"));
        Model::from_hf(&text, source, &tensors, CausalLm::device(self), source)
    }

    /// An empty cache for [`Model::logits_last`].
    pub fn new_cache(&self) -> Cache {
        match self {
            Model::Llama(_) => Cache::Llama(KvCache::default()),
            Model::Qwen35(_) => Cache::Qwen35(Qwen35Cache::default()),
        }
    }

    /// Logits `[B, vocab]` of the last of `tokens` `[B, T]`, placed after the positions in
    /// `cache` (which is extended).
    pub fn logits_last(&self, tokens: &Tensor, cache: &mut Cache) -> Tensor {
        match (self, cache) {
            (Model::Llama(m), Cache::Llama(c)) => m.logits_last(tokens, Some(c)),
            (Model::Qwen35(m), Cache::Qwen35(c)) => {
                let t = tokens.size()[1];
                let h = m.hidden(tokens, Some(c), CHUNK);
                m.logits_of(&h.narrow(1, t - 1, 1).squeeze_dim(1))
            }
            _ => panic!("a cache of another model family"),
        }
    }
}

impl crate::model::lora::Adaptable for Model {
    fn linears(&self) -> Vec<(String, &crate::model::layers::Linear)> {
        match self {
            Model::Llama(m) => m.linears(),
            Model::Qwen35(m) => m.linears(),
        }
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut crate::model::layers::Linear)> {
        match self {
            Model::Llama(m) => m.linears_mut(),
            Model::Qwen35(m) => m.linears_mut(),
        }
    }

    fn base_vars(&self) -> &tch::nn::VarStore {
        match self {
            Model::Llama(m) => &m.vs,
            Model::Qwen35(m) => &m.vs,
        }
    }
}

impl CausalLm for Model {
    fn device(&self) -> Device {
        match self {
            Model::Llama(m) => m.device(),
            Model::Qwen35(m) => m.device(),
        }
    }

    fn set_compute(&mut self, kind: Kind) {
        match self {
            Model::Llama(m) => m.compute = kind,
            Model::Qwen35(m) => m.compute = kind,
        }
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        match self {
            Model::Llama(m) => m.named_tensors(),
            Model::Qwen35(m) => m.named_tensors(),
        }
    }

    fn pass<'a>(&'a self, prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> Box<dyn crate::model::Pass + 'a> {
        match self {
            Model::Llama(m) => CausalLm::pass(m, prefix, rows, flat),
            Model::Qwen35(m) => CausalLm::pass(m, prefix, rows, flat),
        }
    }
}
