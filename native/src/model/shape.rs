//! A model's sizes from its configuration alone (no weights read): the linear layers an
//! adapter can target and every parameter's count. What a memory plan and a spec check need
//! of a 9B model on a machine that could not hold it. `tests` hold them equal to the
//! built models' own.

use std::path::Path;

use crate::model::config::LlamaConfig;
use crate::model::family::QWEN3_5;
use crate::model::gguf::GgufFile;
use crate::model::qwen3_5::Qwen35Config;
use crate::NativeError;

/// The configuration of a model of any supported family.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Llama(LlamaConfig),
    Qwen35(Qwen35Config),
}

impl ModelConfig {
    /// The configuration of the model at `path`: an HF folder's `config.json` or a GGUF
    /// file's metadata.
    pub fn read(path: &Path) -> Result<ModelConfig, NativeError> {
        if path.is_dir() {
            let file = path.join("config.json");
            let text = std::fs::read_to_string(&file).map_err(|error| NativeError::Io { path: file.clone(), error })?;
            return Self::from_hf_json(&text, &file);
        }
        let f = GgufFile::open_header(path)?;
        Ok(ModelConfig::Llama(crate::model::loader::config_from_gguf(&f)?))
    }

    /// The configuration of `config.json`'s text (`path` names it in errors).
    pub fn from_hf_json(text: &str, path: &Path) -> Result<ModelConfig, NativeError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| NativeError::Format { path: path.into(), detail: format!("not JSON: {e}") })?;
        let model_type = v.get("model_type").and_then(|t| t.as_str()).unwrap_or_default();
        if QWEN3_5.contains(&model_type) {
            return Ok(ModelConfig::Qwen35(Qwen35Config::from_hf_json(path, text)?));
        }
        Ok(ModelConfig::Llama(LlamaConfig::from_hf_json(path, text)?))
    }

    pub fn layers(&self) -> i64 {
        match self {
            ModelConfig::Llama(c) => c.num_hidden_layers,
            ModelConfig::Qwen35(c) => c.num_hidden_layers,
        }
    }

    pub fn hidden(&self) -> i64 {
        match self {
            ModelConfig::Llama(c) => c.hidden_size,
            ModelConfig::Qwen35(c) => c.hidden_size,
        }
    }

    pub fn intermediate(&self) -> i64 {
        match self {
            ModelConfig::Llama(c) => c.intermediate_size,
            ModelConfig::Qwen35(c) => c.intermediate_size,
        }
    }

    pub fn vocab(&self) -> i64 {
        match self {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Qwen35(c) => c.vocab_size,
        }
    }

    /// Every linear layer of the decoder by module name, `(name, out, in)`, in the order
    /// [`crate::model::lora::Adaptable::linears`] lists a built model's.
    pub fn linears(&self) -> Vec<(String, i64, i64)> {
        let mut out = vec![];
        match self {
            ModelConfig::Llama(c) => {
                let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
                let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
                for l in 0..c.num_hidden_layers {
                    let n = |m: &str| format!("model.layers.{l}.{m}");
                    out.extend([
                        (n("self_attn.q_proj"), q, h),
                        (n("self_attn.k_proj"), kv, h),
                        (n("self_attn.v_proj"), kv, h),
                        (n("self_attn.o_proj"), h, q),
                        (n("mlp.gate_proj"), i, h),
                        (n("mlp.up_proj"), i, h),
                        (n("mlp.down_proj"), h, i),
                    ]);
                }
            }
            ModelConfig::Qwen35(c) => {
                let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
                let (kd, vd) = (c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim);
                let prefix = if c.language_model { "model.language_model.layers" } else { "model.layers" };
                for (l, &full) in c.full_attention.iter().enumerate() {
                    let n = |m: &str| format!("{prefix}.{l}.{m}");
                    if full {
                        out.extend([
                            (n("self_attn.q_proj"), c.num_attention_heads * hd * 2, h),
                            (n("self_attn.k_proj"), c.num_key_value_heads * hd, h),
                            (n("self_attn.v_proj"), c.num_key_value_heads * hd, h),
                            (n("self_attn.o_proj"), h, c.num_attention_heads * hd),
                        ]);
                    } else {
                        out.extend([
                            (n("linear_attn.in_proj_qkv"), 2 * kd + vd, h),
                            (n("linear_attn.in_proj_z"), vd, h),
                            (n("linear_attn.in_proj_b"), c.linear_num_value_heads, h),
                            (n("linear_attn.in_proj_a"), c.linear_num_value_heads, h),
                            (n("linear_attn.out_proj"), h, vd),
                        ]);
                    }
                    out.extend([(n("mlp.gate_proj"), i, h), (n("mlp.up_proj"), i, h), (n("mlp.down_proj"), h, i)]);
                }
            }
        }
        out
    }

    /// Every parameter of the model: the linear layers, the embedding (and an untied LM
    /// head), the norms, biases and the GDN layers' own vectors and convolution.
    pub fn parameters(&self) -> i64 {
        let linear: i64 = self.linears().iter().map(|(_, o, i)| o * i).sum();
        let (h, v) = (self.hidden(), self.vocab());
        let rest = match self {
            ModelConfig::Llama(c) => {
                let hd = c.head_dim();
                let per_layer = 2 * h
                    + if c.attention_bias { (c.num_attention_heads + 2 * c.num_key_value_heads) * hd } else { 0 }
                    + if c.qk_norm() { 2 * hd } else { 0 };
                per_layer * c.num_hidden_layers + h + v * h * if c.tie_word_embeddings { 1 } else { 2 }
            }
            ModelConfig::Qwen35(c) => {
                let (kd, vd) = (c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim);
                let mixer: i64 = c
                    .full_attention
                    .iter()
                    .map(|&full| {
                        if full {
                            2 * c.head_dim
                        } else {
                            (2 * kd + vd) * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads + c.linear_value_head_dim
                        }
                    })
                    .sum();
                mixer + 2 * h * c.num_hidden_layers + h + v * h * if c.tie_word_embeddings { 1 } else { 2 }
            }
        };
        linear + rest
    }

    /// The width of the engine's cache per token of a sequence, in elements: keys and values
    /// of every attention layer (Qwen3.5's GDN layers keep a state of fixed size instead).
    pub fn kv_elements_per_token(&self) -> i64 {
        match self {
            ModelConfig::Llama(c) => 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim(),
            ModelConfig::Qwen35(c) => 2 * c.full_attention.iter().filter(|f| **f).count() as i64 * c.num_key_value_heads * c.head_dim,
        }
    }

    /// The GDN layers' fixed state per sequence, in elements (0 for llama-family models).
    pub fn state_elements_per_sequence(&self) -> i64 {
        match self {
            ModelConfig::Llama(_) => 0,
            ModelConfig::Qwen35(c) => {
                let gdn = c.full_attention.iter().filter(|f| !**f).count() as i64;
                let conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
                let state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                gdn * (conv_dim * (c.linear_conv_kernel_dim - 1) + state)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::shapes;
    use crate::model::qwen3_5::Qwen35;
    use crate::model::{CausalLm, Llama, Model};
    use tch::Device;

    /// The sizes read from a configuration are the built model's own.
    #[test]
    fn a_configuration_gives_the_built_models_sizes() {
        let mut qwen2 = LlamaConfig::tiny(50, 32, 2);
        qwen2.attention_bias = true;
        qwen2.model_type = "qwen2".into();
        let mut qwen3 = LlamaConfig::tiny(50, 32, 3);
        qwen3.model_type = "qwen3".into();
        qwen3.explicit_head_dim = Some(16);
        qwen3.tie_word_embeddings = false;
        let models: Vec<Model> = vec![
            Llama::new(LlamaConfig::tiny(50, 32, 2), Device::Cpu, 1).unwrap().into(),
            Llama::new(qwen2, Device::Cpu, 1).unwrap().into(),
            Llama::new(qwen3, Device::Cpu, 1).unwrap().into(),
            Qwen35::new(Qwen35Config::shape("tiny", Some(40)).unwrap(), Device::Cpu, 1).unwrap().into(),
        ];
        for m in models {
            let c = m.model_config();
            assert_eq!(c.linears(), shapes(&m), "{}", m.architecture());
            let counted: i64 = m.named_tensors().iter().map(|(_, t)| t.numel() as i64).sum();
            assert_eq!(c.parameters(), counted, "{}", m.architecture());
        }
    }
}
