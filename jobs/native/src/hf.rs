//! Hugging Face model directories: `config.json` plus `model.safetensors` or the shards
//! listed by `model.safetensors.index.json` (F32, F16 or BF16 tensors).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tch::{Device, Kind, Tensor};

use crate::model::{Llama, LlamaConfig};
use crate::NativeError;

/// Reads every tensor of one safetensors buffer as float32 (`source` names it in errors).
pub fn read_safetensors(bytes: &[u8], source: &Path) -> Result<HashMap<String, Tensor>, NativeError> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| NativeError::Format { path: source.into(), detail: format!("not a safetensors file: {e:?}") })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let t = Tensor::try_from(view).map_err(|e| NativeError::Format { path: source.into(), detail: format!("tensor `{name}`: {e}") })?;
        out.insert(name, t.to_kind(Kind::Float));
    }
    Ok(out)
}

/// Serialises float32 tensors (HF names) to safetensors bytes.
pub fn write_safetensors(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, NativeError> {
    write_safetensors_with(tensors, None)
}

/// [`write_safetensors`] with header metadata (`__metadata__`). Each tensor is copied once
/// into its little-endian bytes, then once into the file buffer.
pub fn write_safetensors_with(
    tensors: &[(String, Tensor)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>, NativeError> {
    write_safetensors_as(tensors, crate::retention::Dtype::F32, metadata)
}

/// [`write_safetensors_with`] in `dtype` (float32, bfloat16 or float16, rounded to nearest).
pub fn write_safetensors_as(
    tensors: &[(String, Tensor)],
    dtype: crate::retention::Dtype,
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>, NativeError> {
    use crate::retention::Dtype;
    let (kind, st_dtype, size) = match dtype {
        Dtype::F32 => (Kind::Float, safetensors::Dtype::F32, 4),
        Dtype::Bf16 => (Kind::BFloat16, safetensors::Dtype::BF16, 2),
        Dtype::F16 => (Kind::Half, safetensors::Dtype::F16, 2),
    };
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let t = t.to_device(Device::Cpu).to_kind(kind).contiguous();
            let numel = t.numel();
            let mut bytes = vec![0u8; numel * size];
            // native byte order is little-endian on every platform libtorch runs on.
            t.copy_data_u8(&mut bytes, numel);
            (n.clone(), bytes, t.size().iter().map(|&d| d as usize).collect())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, b, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()
        .map_err(|e| NativeError::Format { path: PathBuf::from("<memory>"), detail: format!("{e:?}") })?;
    safetensors::tensor::serialize(views, &metadata)
        .map_err(|e| NativeError::Format { path: PathBuf::from("<memory>"), detail: format!("{e:?}") })
}

/// Safetensors files of a model directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, NativeError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index)
        .map_err(|_| NativeError::Format { path: dir.into(), detail: "no model.safetensors and no model.safetensors.index.json".into() })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| NativeError::Format { path: index.clone(), detail: e.to_string() })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| NativeError::MissingMetadata { path: index.clone(), key: "weight_map".into() })?;
    let mut files: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Loads a llama or qwen2 model from a Hugging Face directory.
pub fn load_model(dir: &Path, device: Device) -> Result<Llama, NativeError> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| NativeError::io(&cfg_path, e))?;
    let cfg = LlamaConfig::from_hf_json(&cfg_path, &text)?;
    let files = weight_files(dir)?;
    let mut tensors = HashMap::new();
    for file in &files {
        let bytes = std::fs::read(file).map_err(|e| NativeError::io(file, e))?;
        tensors.extend(read_safetensors(&bytes, file)?);
    }
    let source = if files.len() == 1 { files[0].clone() } else { dir.to_path_buf() };
    Llama::from_tensors(cfg, &tensors, device, &source)
}
