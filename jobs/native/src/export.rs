//! Exports trained weights as a GGUF that llama.cpp (and Ollama, LM Studio, ...) runs: the
//! tokenizer, chat template and hyper-parameters come from the GGUF the run started from,
//! the tensors from the model, in F32, under llama.cpp's names and with llama.cpp's q/k row
//! order (its converter's `permute`). Pure: a GGUF in, bytes out.

use tch::{Kind, Tensor};

use crate::gguf::{write_gguf, GgufFile, Value};
use crate::loader::hf_name;
use crate::model::{permute_qk, Llama};
use crate::NativeError;

/// `general.file_type` of a GGUF whose tensors are all F32 (llama.cpp's `LLAMA_FTYPE_ALL_F32`).
const FILE_TYPE_ALL_F32: u32 = 0;
/// ggml's type id of F32 tensors.
const GGML_F32: u32 = 0;

/// A GGUF of `model`'s weights with `base`'s metadata: every tensor `base` has, in its
/// order; tensors without a model counterpart (e.g. `rope_freqs`) must be F32 in `base`
/// and are copied. Errors name the tensor that has no counterpart or the wrong shape.
pub fn gguf_bytes(base: &GgufFile, model: &Llama) -> Result<Vec<u8>, NativeError> {
    let cfg = &model.config;
    let weights: std::collections::BTreeMap<String, Tensor> = model.named_tensors().into_iter().collect();
    let format = |detail: String| NativeError::Format { path: base.path.clone(), detail };
    let mut metadata: Vec<(&str, Value)> = Vec::new();
    for (k, v) in &base.metadata {
        match k.as_str() {
            // The tensors are F32 now: no quantization left to describe.
            "general.file_type" | "general.quantization_version" => {}
            // The writer aligns to 32 bytes.
            "general.alignment" => {}
            _ => metadata.push((k.as_str(), v.clone())),
        }
    }
    metadata.push(("general.file_type", Value::U32(FILE_TYPE_ALL_F32)));
    let mut infos: Vec<_> = base.tensors.values().collect();
    infos.sort_by_key(|t| t.offset);
    let mut names: Vec<String> = Vec::with_capacity(infos.len());
    let mut data: Vec<(Vec<usize>, u32, Vec<u8>)> = Vec::with_capacity(infos.len());
    for info in infos {
        let values: Vec<f32> = match hf_name(&info.name) {
            Some(hf) => {
                let mut t = weights
                    .get(&hf)
                    .ok_or_else(|| format(format!("the model has no tensor `{hf}` for the GGUF's `{}`", info.name)))?
                    .to_kind(Kind::Float)
                    .to_device(tch::Device::Cpu);
                if cfg.model_type == "llama" {
                    if hf.ends_with("q_proj.weight") || hf.ends_with("q_proj.bias") {
                        t = permute_qk(&t, cfg.num_attention_heads);
                    } else if hf.ends_with("k_proj.weight") || hf.ends_with("k_proj.bias") {
                        t = permute_qk(&t, cfg.num_key_value_heads);
                    }
                }
                let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
                if shape != info.shape {
                    return Err(format(format!("tensor `{}`: the model's is {shape:?}, the GGUF's {:?}", info.name, info.shape)));
                }
                let t = t.contiguous().view([-1]);
                Vec::<f32>::try_from(&t).map_err(|e| format(format!("tensor `{hf}`: {e}")))?
            }
            None => base.dequantize(&info.name)?.1,
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        names.push(info.name.clone());
        data.push((info.shape.clone(), GGML_F32, bytes));
    }
    let tensors: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = names.iter().zip(data).map(|(n, (s, t, b))| (n.as_str(), s, t, b)).collect();
    Ok(write_gguf(&metadata, &tensors))
}
