//! Hugging Face model directories: `config.json` plus `model.safetensors` or the shards
//! listed by `model.safetensors.index.json` (F32, F16 or BF16 tensors).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::model::Model;
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
    write_safetensors_as(tensors, Dtype::F32, metadata)
}

/// [`write_safetensors_with`] in `dtype` (float32, bfloat16 or float16, rounded to nearest):
/// the parts of [`safetensors_parts`] in one buffer.
pub fn write_safetensors_as(
    tensors: &[(String, Tensor)],
    dtype: Dtype,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, NativeError> {
    Ok(safetensors_parts(tensors, dtype, metadata)?.concat())
}

/// A safetensors file of `tensors` in `dtype` as the parts a streaming upload writes: the
/// header (its 8-byte length first), then each tensor's bytes in file order, each a view of
/// a CPU tensor's memory, not a copy. Streamed, a checkpoint of 1.6 GB needs no second
/// copy of itself in memory (see `checkpoint::save`).
pub fn safetensors_parts(
    tensors: &[(String, Tensor)],
    dtype: Dtype,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<Bytes>, NativeError> {
    let (kind, st_dtype) = match dtype {
        Dtype::F32 => (Kind::Float, safetensors::Dtype::F32),
        Dtype::Bf16 => (Kind::BFloat16, safetensors::Dtype::BF16),
        Dtype::F16 => (Kind::Half, safetensors::Dtype::F16),
    };
    let format_err = |detail: String| NativeError::Format { path: PathBuf::from("<memory>"), detail };
    // Native byte order is little-endian on every platform libtorch runs on. The dtype
    // conversion runs where the tensor is (a GPU's bf16 checkpoint crosses to the host at half
    // the size); on the CPU both steps are no-ops for float32 and the parts view the weights.
    let data: Vec<(&str, Tensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t.to_kind(kind).to_device(Device::Cpu).contiguous())).collect();
    let shapes: Vec<(&str, Shape)> = data
        .iter()
        .map(|(n, t)| {
            let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
            (*n, Shape { dtype: st_dtype, len: t.numel() * st_dtype.size(), shape })
        })
        .collect();
    // The crate lays out the header from each view's length and then appends each view's
    // data, which a `Shape` leaves empty: what comes back is the header alone.
    let header =
        safetensors::tensor::serialize(shapes.iter().map(|(n, s)| (*n, s)), &metadata).map_err(|e| format_err(format!("{e:?}")))?;
    let layout: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&header[8..]).map_err(|e| format_err(format!("safetensors header: {e}")))?;
    let start = |name: &str| layout.get(name).and_then(|v| v["data_offsets"][0].as_u64());
    let mut ordered = data
        .into_iter()
        .map(|(n, t)| Ok((start(n).ok_or_else(|| format_err(format!("`{n}` is not in the header")))?, t)))
        .collect::<Result<Vec<_>, NativeError>>()?;
    ordered.sort_by_key(|(offset, _)| *offset);
    let mut parts = vec![Bytes::from(header)];
    parts.extend(ordered.into_iter().map(|(_, t)| TensorBytes::bytes(t)));
    Ok(parts)
}

/// A tensor's dtype and shape without its data (see [`safetensors_parts`]).
struct Shape {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    len: usize,
}

impl safetensors::View for &Shape {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// The memory of a contiguous CPU tensor as bytes, owning the tensor.
struct TensorBytes(Tensor, usize);

impl TensorBytes {
    fn bytes(t: Tensor) -> Bytes {
        let len = t.numel() * t.kind().elt_size_in_bytes();
        if len == 0 {
            return Bytes::new();
        }
        Bytes::from_owner(TensorBytes(t, len))
    }
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a contiguous CPU tensor of `self.1` bytes (checked non-empty), kept alive
        // by `self`; nothing writes it while the bytes are in use (a checkpoint's tensors
        // are not trained while they are written).
        unsafe { std::slice::from_raw_parts(self.0.data_ptr() as *const u8, self.1) }
    }
}

/// Safetensors files of a model directory.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, NativeError> {
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

/// `config.json`'s `model_type` of a Hugging Face folder (None: not a folder with a readable
/// config).
pub fn model_type_of(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(v.get("model_type")?.as_str()?.to_string())
}

/// The files a checkpoint folder's `manifest.json` lists (the learner writes one, last, with
/// each file's size and SHA-256; a folder from elsewhere has none): what a folder's loader
/// holds the files it reads to.
pub struct FolderManifest {
    dir: PathBuf,
    files: Option<HashMap<String, schemas::FileEntry>>,
}

/// A checkpoint folder's manifest: the files and their SHA-256, written last.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Float32 weights beside a `model.safetensors` of lower precision.
pub const MASTER_FILE: &str = "master.safetensors";
/// AdamW moments of a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Files a checkpoint lists that loading weights for sampling does not read (and that a
/// copy made for serving may leave out).
const NOT_READ_TO_SAMPLE: [&str; 2] = [OPTIMIZER_FILE, MASTER_FILE];

/// The hex SHA-256 of `bytes`, as manifests record it.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

impl FolderManifest {
    /// Reads `dir/manifest.json` if there is one; a manifest that does not parse is an error
    /// naming it (a damaged folder is not loaded as if it had none).
    pub fn read(dir: &Path) -> Result<Self, NativeError> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(FolderManifest { dir: dir.into(), files: None }),
            Err(e) => return Err(NativeError::io(&path, e)),
        };
        let m: schemas::CheckpointManifest = schemas::decode_document(&path.display().to_string(), &bytes)
            .map_err(|e| NativeError::Checkpoint { location: path.display().to_string(), detail: e.to_string() })?;
        let manifest = FolderManifest { dir: dir.into(), files: Some(m.files.into_iter().map(|f| (f.name.clone(), f)).collect()) };
        // a file the manifest lists must be there (weights deleted from a checkpoint are
        // not replaced by a stale copy or a different file)
        for name in manifest.files.iter().flat_map(|f| f.keys()) {
            if !NOT_READ_TO_SAMPLE.contains(&name.as_str()) && !dir.join(name).exists() {
                return Err(manifest.damaged(name, "listed in manifest.json but missing"));
            }
        }
        Ok(manifest)
    }

    /// Checks `bytes`, read from `file` in the folder, against the manifest's entry for it
    /// (nothing to check without a manifest, or for a file it does not list).
    pub fn check(&self, file: &Path, bytes: &[u8]) -> Result<(), NativeError> {
        let Some(name) = file.file_name().and_then(|n| n.to_str()) else { return Ok(()) };
        let Some(entry) = self.files.as_ref().and_then(|f| f.get(name)) else { return Ok(()) };
        if bytes.len() as u64 != entry.size {
            return Err(self.damaged(name, &format!("{} bytes, manifest.json says {}", bytes.len(), entry.size)));
        }
        let sha = sha256_hex(bytes);
        if sha != entry.sha256 {
            return Err(self.damaged(name, &format!("SHA-256 {sha}, manifest.json says {} (a corrupt or overwritten file)", entry.sha256)));
        }
        Ok(())
    }

    fn damaged(&self, name: &str, problem: &str) -> NativeError {
        NativeError::Checkpoint {
            location: self.dir.join(name).display().to_string(),
            detail: format!("{problem}; the checkpoint is damaged and is not loaded (`harness-s verify RUN` checks a run's checkpoints)"),
        }
    }
}

/// Loads a model of any supported family ([`Model`]) from a Hugging Face directory; a
/// checkpoint folder's files are checked against its `manifest.json` first.
pub fn load_model(dir: &Path, device: Device) -> Result<Model, NativeError> {
    let manifest = FolderManifest::read(dir)?;
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| NativeError::io(&cfg_path, e))?;
    manifest.check(&cfg_path, text.as_bytes())?;
    let files = weight_files(dir)?;
    let mut tensors = HashMap::new();
    for file in &files {
        let bytes = std::fs::read(file).map_err(|e| NativeError::io(file, e))?;
        manifest.check(file, &bytes)?;
        tensors.extend(read_safetensors(&bytes, file)?);
    }
    let source = if files.len() == 1 { files[0].clone() } else { dir.to_path_buf() };
    Model::from_hf(&text, &cfg_path, &tensors, device, &source)
}

/// Every variable of `vs` by its transformers name, sorted (shared storage, float32).
pub fn named(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Fills every variable of `vs` with random values: `fixed(name)` where it gives one, else
/// uniform with σ = 0.02, drawn from a generator seeded by `seed` and the variable's name
/// (not libtorch's global one), so the same seed gives the same model even while other
/// threads draw random numbers.
pub fn randomize(vs: &tch::nn::VarStore, seed: u64, fixed: impl Fn(&str) -> Option<f32>) {
    use rand::Rng;
    let _guard = tch::no_grad_guard();
    for (name, mut var) in named(vs) {
        if let Some(value) = fixed(&name) {
            let _ = var.fill_(value as f64);
            continue;
        }
        let mut rng = named_rng(seed, name.as_bytes());
        // uniform on [−a, a] has σ = a/√3
        let a = 0.02f32 * 3f32.sqrt();
        let values: Vec<f32> = (0..var.numel()).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * a).collect();
        var.copy_(&Tensor::from_slice(&values).view(var.size().as_slice()).to_device(var.device()));
    }
}

/// The generator of one named tensor's random values: seeded by `seed` and `name`, not by
/// libtorch's global generator, so a tensor's values do not depend on other threads' draws.
pub(crate) fn named_rng(seed: u64, name: &[u8]) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name);
    rand_chacha::ChaCha8Rng::from_seed(h.finalize().into())
}

/// Overwrites every variable of `vs` from `tensors` by name (any float kind, copied as
/// float32). A missing tensor or a shape mismatch is an error naming `source` and the
/// tensor; tensors no variable uses (a tied `lm_head.weight`) are ignored.
pub fn fill(vs: &tch::nn::VarStore, tensors: &HashMap<String, Tensor>, source: &Path) -> Result<(), NativeError> {
    let _guard = tch::no_grad_guard();
    for (name, mut var) in vs.variables() {
        let src = tensors.get(&name).ok_or_else(|| NativeError::MissingTensor { path: source.into(), tensor: name.clone() })?;
        if src.size() != var.size() {
            return Err(NativeError::Shape { path: source.into(), tensor: name, expected: var.size(), got: src.size() });
        }
        var.f_copy_(&src.to_kind(Kind::Float))?;
    }
    Ok(())
}

/// Element type of a checkpoint's `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed parts make a file the safetensors reader takes back tensor for tensor,
    /// in every dtype, with the tensors in the header's order.
    #[test]
    fn streamed_parts_read_back_as_the_tensors() {
        let tensors: Vec<(String, Tensor)> = ["b.weight", "a.weight", "c.bias"]
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), Tensor::randn([3 + i as i64, 5], (Kind::Float, Device::Cpu))))
            .collect();
        for (dtype, tol) in [(Dtype::F32, 0.0), (Dtype::Bf16, 1e-2), (Dtype::F16, 1e-3)] {
            let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
            let parts = safetensors_parts(&tensors, dtype, meta).unwrap();
            assert_eq!(parts.len(), 1 + tensors.len());
            assert_eq!(parts[0].len() % 8, 0, "the header is padded to 8 bytes");
            let file = parts.concat();
            let st = SafeTensors::deserialize(&file).unwrap();
            let mut names: Vec<(usize, String)> =
                st.tensors().into_iter().map(|(n, v)| (v.data().as_ptr() as usize - file.as_ptr() as usize, n)).collect();
            names.sort();
            for ((_, name), part) in names.iter().zip(&parts[1..]) {
                assert_eq!(st.tensor(name).unwrap().data(), &part[..], "{dtype:?}: `{name}` in file order");
            }
            let back = read_safetensors(&file, Path::new("<test>")).unwrap();
            for (n, t) in &tensors {
                let err = (&back[n] - t).abs().max().double_value(&[]);
                assert!(err <= tol * t.abs().max().double_value(&[]), "{dtype:?} `{n}`: {err}");
            }
        }
    }
}
