//! A model's architecture hyper-parameters, in `config.json` terms: what the loaders read
//! and the checkpoints write.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::NativeError;

/// Architecture hyper-parameters, in `config.json` terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `qwen2` or `qwen3` (the families [`ARCHITECTURES`] lists).
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    /// The width of one attention head where it is not `hidden_size / num_attention_heads`
    /// (qwen3's `head_dim`).
    #[serde(default, rename = "head_dim", skip_serializing_if = "Option::is_none")]
    pub explicit_head_dim: Option<i64>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (qwen2).
    pub attention_bias: bool,
    /// RoPE rotates adjacent pairs (ggml's llama layout) instead of the two halves of each
    /// head (Hugging Face layout). Loaders convert weights to the HF layout, so this is
    /// false for every loaded model; it exists for weights kept in the ggml layout.
    #[serde(default)]
    pub rope_interleaved: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_id: Option<i64>,
}

/// The `model_type`s this decoder runs: llama; qwen2 (q/k/v bias); qwen3 (per-head q/k
/// RMSNorm before RoPE, an explicit head width).
pub const ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "qwen3"];

impl LlamaConfig {
    pub fn head_dim(&self) -> i64 {
        self.explicit_head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Each head's queries and keys pass an RMSNorm of their own before RoPE (qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    /// A small random-initialisable configuration for tests and benchmarks.
    pub fn tiny(vocab_size: i64, hidden_size: i64, layers: i64) -> Self {
        LlamaConfig {
            model_type: "llama".into(),
            vocab_size,
            hidden_size,
            intermediate_size: hidden_size * 2,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            explicit_head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 2048,
            tie_word_embeddings: true,
            attention_bias: false,
            rope_interleaved: false,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Checks the hyper-parameters fit together; errors name the field.
    pub fn validate(&self) -> Result<(), NativeError> {
        let bad = |field: &str, detail: String| Err(NativeError::Config { field: field.into(), detail });
        if !ARCHITECTURES.contains(&self.model_type.as_str()) {
            return bad("model_type", format!("`{}` is not supported ({})", self.model_type, ARCHITECTURES.join(", ")));
        }
        for (f, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ] {
            if v <= 0 {
                return bad(f, format!("must be positive, is {v}"));
            }
        }
        if let Some(hd) = self.explicit_head_dim {
            if hd <= 0 || hd % 2 != 0 {
                return bad("head_dim", format!("must be positive and even, is {hd}"));
            }
        } else if self.hidden_size % self.num_attention_heads != 0 || self.head_dim() % 2 != 0 {
            return bad("num_attention_heads", format!("hidden_size {} must split into heads of even size", self.hidden_size));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(
                "num_key_value_heads",
                format!("{} does not divide num_attention_heads {}", self.num_key_value_heads, self.num_attention_heads),
            );
        }
        Ok(())
    }

    /// The Hugging Face `config.json` of this model (float32 weights).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let arch = match self.model_type.as_str() {
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut v = serde_json::to_value(self).expect("config serialises");
        let o = v.as_object_mut().expect("object");
        o.remove("rope_interleaved");
        o.insert("architectures".into(), serde_json::json!([arch]));
        o.insert("hidden_act".into(), "silu".into());
        o.insert("torch_dtype".into(), "float32".into());
        o.insert("head_dim".into(), self.head_dim().into());
        if self.model_type == "qwen2" {
            o.remove("attention_bias");
        }
        v
    }

    /// Reads a Hugging Face `config.json` (llama, qwen2 or qwen3). What this decoder does not
    /// run (sliding-window attention, scaled RoPE, a MoE block) is refused with the field
    /// named.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self, NativeError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| NativeError::Format { path: path.into(), detail: format!("not JSON: {e}") })?;
        let field = |k: &str| v.get(k).ok_or_else(|| NativeError::MissingMetadata { path: path.into(), key: k.into() });
        let int = |k: &str| -> Result<i64, NativeError> {
            field(k)?.as_i64().ok_or_else(|| NativeError::Format { path: path.into(), detail: format!("`{k}` must be an integer") })
        };
        let model_type = field("model_type")?.as_str().unwrap_or_default().to_string();
        if matches!(model_type.as_str(), "qwen3_5" | "qwen3_5_text") {
            return Err(NativeError::Config {
                field: format!("{}: model_type", path.display()),
                detail: format!("`{model_type}` is Qwen3.5, not a llama-family model: load it as `native::model::Model` (qwen3_5.rs)"),
            });
        }
        if !ARCHITECTURES.contains(&model_type.as_str()) {
            return Err(NativeError::UnsupportedArchitecture { path: path.into(), arch: model_type });
        }
        let refuse = |field: &str, detail: String| Err(NativeError::Config { field: format!("{}: {field}", path.display()), detail });
        if v.get("use_sliding_window").and_then(|x| x.as_bool()) == Some(true) {
            return refuse("use_sliding_window", "sliding-window attention is not supported; set it to false".into());
        }
        if v.get("num_experts").and_then(|x| x.as_i64()).is_some_and(|n| n > 0) {
            return refuse("num_experts", "mixture-of-experts blocks are not supported".into());
        }
        // transformers 5 writes `rope_parameters`; older configs `rope_theta` and `rope_scaling`
        let rope = v.get("rope_parameters").filter(|r| r.is_object());
        let rope_type = rope
            .or_else(|| v.get("rope_scaling").filter(|r| r.is_object()))
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if rope_type != "default" {
            return refuse("rope_type", format!("`{rope_type}` RoPE scaling is not supported (default only)"));
        }
        let rope_theta = rope.and_then(|r| r.get("rope_theta")).or_else(|| v.get("rope_theta")).and_then(|x| x.as_f64()).unwrap_or(10000.0);
        let heads = int("num_attention_heads")?;
        let first_id =
            |k: &str| v.get(k).and_then(|x| x.as_i64().or_else(|| x.as_array().and_then(|a| a.first()).and_then(|y| y.as_i64())));
        let cfg = LlamaConfig {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: v.get("num_key_value_heads").and_then(|x| x.as_i64()).unwrap_or(heads),
            explicit_head_dim: v.get("head_dim").and_then(|x| x.as_i64()).filter(|&hd| hd * heads != int("hidden_size").unwrap_or(0)),
            rms_norm_eps: v.get("rms_norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-6),
            rope_theta,
            max_position_embeddings: v.get("max_position_embeddings").and_then(|x| x.as_i64()).unwrap_or(2048),
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            attention_bias: model_type == "qwen2" || v.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(false),
            rope_interleaved: false,
            bos_token_id: first_id("bos_token_id"),
            eos_token_id: first_id("eos_token_id"),
            model_type,
        };
        cfg.validate().map_err(|e| NativeError::Format { path: path.into(), detail: e.to_string() })?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_round_trips_through_hf_json() {
        let mut cfg = LlamaConfig::tiny(50, 32, 2);
        cfg.model_type = "qwen2".into();
        cfg.attention_bias = true;
        let text = cfg.to_hf_json().to_string();
        let back = LlamaConfig::from_hf_json(Path::new("config.json"), &text).unwrap();
        assert_eq!(back, cfg);
        let err = LlamaConfig::from_hf_json(Path::new("config.json"), r#"{"model_type":"gpt2"}"#).unwrap_err().to_string();
        assert!(err.contains("gpt2"), "{err}");
        let err = LlamaConfig::from_hf_json(Path::new("config.json"), r#"{"model_type":"qwen3_5"}"#).unwrap_err().to_string();
        assert!(err.contains("Qwen3.5") && err.contains("qwen3_5.rs"), "{err}");
        // qwen3: an explicit head width, the RoPE base under `rope_parameters`
        let mut q3 = LlamaConfig::tiny(50, 32, 2);
        q3.model_type = "qwen3".into();
        q3.explicit_head_dim = Some(16);
        q3.rope_theta = 1e6;
        let mut json = q3.to_hf_json();
        let theta = json.as_object_mut().unwrap().remove("rope_theta").unwrap();
        json["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
        let back = LlamaConfig::from_hf_json(Path::new("config.json"), &json.to_string()).unwrap();
        assert_eq!((back.head_dim(), back.rope_theta, back.qk_norm()), (16, 1e6, true));
        for (field, value) in [
            ("use_sliding_window", serde_json::json!(true)),
            ("rope_parameters", serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6})),
        ] {
            let mut bad = q3.to_hf_json();
            bad[field] = value;
            let err = LlamaConfig::from_hf_json(Path::new("config.json"), &bad.to_string()).unwrap_err().to_string();
            assert!(err.contains(if field == "use_sliding_window" { field } else { "rope_type" }), "{err}");
        }
    }
}
