//! Exports trained weights as a GGUF that llama.cpp (and Ollama, LM Studio, ...) runs: the
//! tokenizer, chat template and hyper-parameters come from the GGUF the run started from,
//! the tensors from the model, under llama.cpp's names and with llama.cpp's q/k row order
//! (its converter's `permute`). Matrices go out in F32, F16 or Q8_0 ([`TensorType`]);
//! norms, biases and rows not a whole number of 32-value blocks stay F32, as llama.cpp's
//! converter keeps them. Pure: a GGUF in, bytes out.

use tch::{Kind, Tensor};

use crate::model::gguf::permute_qk;
use crate::model::gguf::{write_gguf, GgufFile, Value};
use crate::model::loader::hf_name;
use crate::model::Llama;
use crate::NativeError;

/// ggml's type id of F32 tensors.
const GGML_F32: u32 = 0;

/// The type of an export's matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    /// 4 bytes per weight: the checkpoint's values exactly.
    F32,
    /// 2 bytes per weight.
    F16,
    /// 1.06 bytes per weight: blocks of 32 int8 with an f16 scale (llama.cpp's Q8_0).
    Q8_0,
}

impl TensorType {
    /// `general.file_type` (llama.cpp's `LLAMA_FTYPE_ALL_F32`, `MOSTLY_F16`, `MOSTLY_Q8_0`).
    pub fn file_type(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q8_0 => 7,
        }
    }

    /// ggml's type id and bytes of a matrix row of `cols` values (`cols` a multiple of 32
    /// for Q8_0).
    pub fn encode(self, values: &[f32]) -> (u32, Vec<u8>) {
        match self {
            TensorType::F32 => (GGML_F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            TensorType::F16 => (1, values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect()),
            TensorType::Q8_0 => (8, q8_0(values)),
        }
    }
}

/// llama.cpp's Q8_0 (`quantize_row_q8_0_ref`): per block of 32, `d = amax / 127` as f16,
/// then `round(x / d)` as int8.
fn q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
    }
    out
}

/// A GGUF of `model`'s weights with `base`'s metadata: every tensor `base` has, in its
/// order; tensors without a model counterpart (e.g. `rope_freqs`) must be F32 in `base`
/// and are copied. Errors name the tensor that has no counterpart or the wrong shape.
pub fn gguf_bytes(base: &GgufFile, model: &Llama) -> Result<Vec<u8>, NativeError> {
    gguf_bytes_as(base, model, TensorType::F32)
}

/// [`gguf_bytes`] with matrices of `ty`.
pub fn gguf_bytes_as(base: &GgufFile, model: &Llama, ty: TensorType) -> Result<Vec<u8>, NativeError> {
    let cfg = &model.config;
    let weights: std::collections::BTreeMap<String, Tensor> = model.named_tensors().into_iter().collect();
    let format = |detail: String| NativeError::Format { path: base.path.clone(), detail };
    let mut metadata: Vec<(&str, Value)> = Vec::new();
    for (k, v) in &base.metadata {
        match k.as_str() {
            // Written anew below for the export's own types.
            "general.file_type" | "general.quantization_version" => {}
            // The writer aligns to 32 bytes.
            "general.alignment" => {}
            _ => metadata.push((k.as_str(), v.clone())),
        }
    }
    metadata.push(("general.file_type", Value::U32(ty.file_type())));
    if ty == TensorType::Q8_0 {
        metadata.push(("general.quantization_version", Value::U32(2)));
    }
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
        let matrix = info.shape.len() == 2 && info.shape[1] % 32 == 0;
        let (ggml_type, bytes) = if matrix { ty.encode(&values) } else { TensorType::F32.encode(&values) };
        names.push(info.name.clone());
        data.push((info.shape.clone(), ggml_type, bytes));
    }
    let tensors: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = names.iter().zip(data).map(|(n, (s, t, b))| (n.as_str(), s, t, b)).collect();
    Ok(write_gguf(&metadata, &tensors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{dequantize, GgmlType};

    #[test]
    fn q8_0_and_f16_rows_decode_within_their_precision() {
        let values: Vec<f32> = (0..96).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        // |values| ≤ 2.95: Q8_0 errs by half a step (amax / 254) plus its f16 scale's rounding
        for (ty, kind, tol) in [
            (TensorType::Q8_0, GgmlType::Q8_0, 2.95 * (0.5 / 127.0 + 1e-3)),
            (TensorType::F16, GgmlType::F16, 2.95 * 1e-3),
            (TensorType::F32, GgmlType::F32, 0.0),
        ] {
            let (id, bytes) = ty.encode(&values);
            assert_eq!(GgmlType::from_id(id), kind);
            let back = dequantize(kind, &bytes, values.len()).unwrap();
            let err = back.iter().zip(&values).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(err <= tol, "{ty:?}: max error {err} > {tol}");
        }
        // a zero block stays zero (no division by a zero scale)
        let (_, bytes) = TensorType::Q8_0.encode(&[0.0; 32]);
        assert_eq!(dequantize(GgmlType::Q8_0, &bytes, 32).unwrap(), vec![0.0; 32]);
        assert_eq!(bytes.len(), 34);
    }
}
