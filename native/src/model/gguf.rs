//! GGUF files: metadata, tensor directory and dequantisation of the block formats to f32.
//!
//! Format reference: the GGUF specification of ggml (version 2 and 3 headers: magic,
//! version, tensor count, metadata; tensor infos; aligned tensor data). Dimensions are
//! stored fastest-first, so a tensor's torch shape is the reversed list.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;
use tch::Tensor;

use crate::NativeError;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Integer value of any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// ggml tensor types this loader knows by name (dequantisable or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// Any other type id (Q2_K, Q3_K, IQ*, ...): listed, but not dequantised.
    Other(u32),
}

impl GgmlType {
    pub(crate) fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// Name as ggml spells it.
    pub fn name(self) -> String {
        match self {
            GgmlType::F32 => "F32".into(),
            GgmlType::F16 => "F16".into(),
            GgmlType::Q4_0 => "Q4_0".into(),
            GgmlType::Q4_1 => "Q4_1".into(),
            GgmlType::Q5_0 => "Q5_0".into(),
            GgmlType::Q5_1 => "Q5_1".into(),
            GgmlType::Q8_0 => "Q8_0".into(),
            GgmlType::Q4K => "Q4_K".into(),
            GgmlType::Q5K => "Q5_K".into(),
            GgmlType::Q6K => "Q6_K".into(),
            GgmlType::BF16 => "BF16".into(),
            GgmlType::Other(id) => {
                let known = [
                    (9, "Q8_1"),
                    (10, "Q2_K"),
                    (11, "Q3_K"),
                    (15, "Q8_K"),
                    (16, "IQ2_XXS"),
                    (17, "IQ2_XS"),
                    (18, "IQ3_XXS"),
                    (19, "IQ1_S"),
                    (20, "IQ4_NL"),
                    (21, "IQ3_S"),
                    (22, "IQ2_S"),
                    (23, "IQ4_XS"),
                    (29, "IQ1_M"),
                ];
                known.iter().find(|(i, _)| *i == id).map(|(_, n)| n.to_string()).unwrap_or_else(|| format!("type {id}"))
            }
        }
    }

    /// (elements per block, bytes per block) of the supported types.
    fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Other(_) => return None,
        })
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Torch order (slowest dimension first).
    pub shape: Vec<usize>,
    pub kind: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A GGUF file read into memory.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &str) -> NativeError {
        NativeError::Format { path: self.path.to_path_buf(), detail: format!("{what} at byte {}", self.pos) }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], NativeError> {
        if self.pos + n > self.bytes.len() {
            return Err(self.err("file ends early (truncated GGUF?)"));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, NativeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, NativeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, NativeError> {
        let n = self.u64()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }
    fn value(&mut self, ty: u32) -> Result<Value, NativeError> {
        Ok(match ty {
            0 => Value::U8(self.take(1)?[0]),
            1 => Value::I8(self.take(1)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.take(2)?.try_into().unwrap())),
            3 => Value::I16(i16::from_le_bytes(self.take(2)?.try_into().unwrap())),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.u64()? as usize;
                if n > self.bytes.len() {
                    return Err(self.err("array length larger than the file"));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(self.err(&format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Reads and indexes a GGUF file; tensors are dequantised on demand.
    pub fn open(path: &Path) -> Result<Self, NativeError> {
        let bytes = std::fs::read(path).map_err(|e| NativeError::io(path, e))?;
        Self::parse(path, bytes)
    }

    /// The metadata and tensor index of a GGUF file without its tensor data: what a
    /// configuration needs. Reads the file's first 4 MiB, then 64 MiB, then all of it, until
    /// the header parses (a vocabulary of 150k tokens fits in the first).
    pub fn open_header(path: &Path) -> Result<Self, NativeError> {
        use std::io::Read;
        for limit in [4u64 << 20, 64 << 20] {
            let mut head = vec![];
            let file = std::fs::File::open(path).map_err(|e| NativeError::io(path, e))?;
            file.take(limit).read_to_end(&mut head).map_err(|e| NativeError::io(path, e))?;
            let whole = (head.len() as u64) < limit;
            match Self::parse(path, head) {
                Ok(f) => return Ok(f),
                Err(e) if whole => return Err(e),
                Err(_) => {}
            }
        }
        Self::open(path)
    }

    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self, NativeError> {
        let mut r = Reader { bytes: &bytes, pos: 0, path };
        if r.take(4)? != b"GGUF" {
            return Err(NativeError::Format { path: path.to_path_buf(), detail: "not a GGUF file (magic bytes are not `GGUF`)".into() });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(NativeError::Format {
                path: path.to_path_buf(),
                detail: format!("GGUF version {version} is not supported (2 and 3 are)"),
            });
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty)?;
            metadata.insert(key, v);
        }
        let mut tensors = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims > 8 {
                return Err(r.err(&format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64()? as usize);
            }
            dims.reverse();
            let kind = GgmlType::from_id(r.u32()?);
            let offset = r.u64()?;
            tensors.insert(name.clone(), TensorInfo { name, shape: dims, kind, offset });
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
        let data_start = r.pos.div_ceil(align.max(1)) * align.max(1);
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, bytes, data_start })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value, or an error naming the key and the file.
    pub fn require(&self, key: &str) -> Result<&Value, NativeError> {
        self.metadata.get(key).ok_or_else(|| NativeError::MissingMetadata { path: self.path.clone(), key: key.to_string() })
    }

    /// Dequantises one tensor to f32 values in torch (row-major) order.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), NativeError> {
        let info =
            self.tensors.get(name).ok_or_else(|| NativeError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })?;
        let n = info.elements();
        let unsupported = || NativeError::UnsupportedQuant { path: self.path.clone(), tensor: name.to_string(), kind: info.kind.name() };
        let (per_block, block_bytes) = info.kind.block().ok_or_else(unsupported)?;
        if n % per_block != 0 {
            return Err(NativeError::Format {
                path: self.path.clone(),
                detail: format!("tensor `{name}` has {n} elements, not a multiple of the {} block size {per_block}", info.kind.name()),
            });
        }
        let start = self.data_start + info.offset as usize;
        let len = n / per_block * block_bytes;
        let raw = self.bytes.get(start..start + len).ok_or_else(|| NativeError::Format {
            path: self.path.clone(),
            detail: format!("tensor `{name}` data ({len} bytes at {start}) runs past the end of the file"),
        })?;
        Ok((info.shape.clone(), dequantize(info.kind, raw, n).ok_or_else(unsupported)?))
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `n` values of `kind` from `raw` (ggml's reference `dequantize_row_*`).
pub fn dequantize(kind: GgmlType, raw: &[u8], n: usize) -> Option<Vec<f32>> {
    let mut out = Vec::with_capacity(n);
    match kind {
        GgmlType::F32 => out.extend(raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()))),
        GgmlType::F16 => out.extend(raw.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
        GgmlType::BF16 => out.extend(raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        GgmlType::Q4_0 => {
            // block: f16 d, 16 bytes of nibbles; low nibbles are elements 0..16, high 16..32.
            for b in raw.chunks_exact(18) {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|q| ((q & 0x0F) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        GgmlType::Q4_1 => {
            // block: f16 d, f16 m, 16 bytes of nibbles; x = q·d + m.
            for b in raw.chunks_exact(20) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|q| (q & 0x0F) as f32 * d + m));
                out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // block: f16 d, (Q5_1: f16 m,) 32 high bits, 16 bytes of low nibbles; element j
            // of the first half is the low nibble of byte j with high bit j, element j + 16
            // the high nibble with high bit j + 16. Q5_0: x = (q − 16)·d; Q5_1: x = q·d + m.
            let (size, offset, head) = if kind == GgmlType::Q5_0 { (22, -16, 2) } else { (24, 0, 4) };
            for b in raw.chunks_exact(size) {
                let d = f16_at(b, 0);
                let m = if kind == GgmlType::Q5_1 { f16_at(b, 2) } else { 0.0 };
                let qh = u32::from_le_bytes(b[head..head + 4].try_into().unwrap());
                let qs = &b[head + 4..head + 20];
                let value = |q: u8, high: u32| ((q as u32 | (high & 1) << 4) as i32 + offset) as f32;
                let mut y = [0f32; 32];
                for (j, q) in qs.iter().enumerate() {
                    y[j] = value(q & 0x0F, qh >> j) * d + m;
                    y[j + 16] = value(q >> 4, qh >> (j + 16)) * d + m;
                }
                out.extend_from_slice(&y);
            }
        }
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&q| (q as i8) as f32 * d));
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // super-block: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, (Q5_K: 32
            // bytes of high bits,) 128 bytes of nibbles; 8 sub-blocks of 32 with
            // x = d·sc·q − dmin·m, where Q5_K's q gains 16 from bit 2j (low nibbles of pair j)
            // or 2j + 1 (high nibbles) of the element's byte of high bits.
            let (size, nibbles) = if kind == GgmlType::Q4K { (144, 16) } else { (176, 48) };
            for b in raw.chunks_exact(size) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qh = (kind == GgmlType::Q5K).then(|| &b[16..48]);
                let qs = &b[nibbles..nibbles + 128];
                let high = |l: usize, bit: usize| qh.map_or(0, |h| ((h[l] >> bit) & 1) << 4);
                for j in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let q = &qs[32 * j..32 * j + 32];
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                    out.extend(q.iter().enumerate().map(|(l, v)| d1 * ((v & 0x0F) + high(l, 2 * j)) as f32 - mm1));
                    out.extend(q.iter().enumerate().map(|(l, v)| d2 * ((v >> 4) + high(l, 2 * j + 1)) as f32 - mm2));
                }
            }
        }
        GgmlType::Q6K => {
            // super-block: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 i8 scales,
            // f16 d; two halves of 128 values, x = d·scale·(q − 32).
            for b in raw.chunks_exact(210) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let ql = &b[64 * half..64 * half + 64];
                    let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                    let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                    let mut y = [0f32; 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                    out.extend_from_slice(&y);
                }
            }
        }
        GgmlType::Other(_) => return None,
    }
    debug_assert_eq!(out.len(), n);
    Some(out)
}

/// Unpacks the 6-bit scale and min of sub-block `j` of a Q4_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Writes a minimal GGUF (version 3) file; used by tests to build bad or tiny inputs.
pub fn write_gguf(metadata: &[(&str, Value)], tensors: &[(&str, Vec<usize>, u32, Vec<u8>)]) -> Vec<u8> {
    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }
    fn ty(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    fn val(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend(x.to_le_bytes()),
            Value::I16(x) => out.extend(x.to_le_bytes()),
            Value::U32(x) => out.extend(x.to_le_bytes()),
            Value::I32(x) => out.extend(x.to_le_bytes()),
            Value::F32(x) => out.extend(x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(x) => s(out, x),
            Value::Array(items) => {
                out.extend(items.first().map(ty).unwrap_or(4).to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    val(out, i);
                }
            }
            Value::U64(x) => out.extend(x.to_le_bytes()),
            Value::I64(x) => out.extend(x.to_le_bytes()),
            Value::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        s(&mut out, k);
        out.extend(ty(v).to_le_bytes());
        val(&mut out, v);
    }
    let mut offset = 0u64;
    let mut offsets = vec![];
    for (name, shape, t, data) in tensors {
        s(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(t.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, _, data) in tensors {
        out.extend(data);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    out
}

/// ggml's llama q/k row order → HF's: ggml stores each head's rows as interleaved
/// (re, im) pairs, HF as two halves (the inverse of the converter's `permute`).
pub fn unpermute_qk(w: &Tensor, heads: i64) -> Tensor {
    let s = w.size();
    let rows = s[0];
    let rest: Vec<i64> = s[1..].to_vec();
    let mut shape = vec![heads, rows / heads / 2, 2];
    shape.extend(&rest);
    w.reshape(&shape).transpose(1, 2).reshape(&s)
}

/// HF's q/k row order → ggml's (the converter's `permute`).
pub fn permute_qk(w: &Tensor, heads: i64) -> Tensor {
    let s = w.size();
    let rows = s[0];
    let rest: Vec<i64> = s[1..].to_vec();
    let mut shape = vec![heads, 2, rows / heads / 2];
    shape.extend(&rest);
    w.reshape(&shape).transpose(1, 2).reshape(&s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_0_block_matches_hand_values() {
        let mut b = h(0.5).to_vec();
        // byte j holds element j (low nibble) and j+16 (high nibble)
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        assert_eq!(y[0], (0.0 - 8.0) * 0.5);
        assert_eq!(y[3], (3.0 - 8.0) * 0.5);
        assert_eq!(y[16], (15.0 - 8.0) * 0.5);
        assert_eq!(y[31], (0.0 - 8.0) * 0.5);
    }

    #[test]
    fn q4_1_block_adds_the_minimum() {
        let mut b = h(0.25).to_vec();
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | (2 << 4)));
        let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        assert_eq!(y[5], 5.0 * 0.25 - 1.0);
        assert_eq!(y[20], 2.0 * 0.25 - 1.0);
    }

    #[test]
    fn q8_0_block_is_signed() {
        let mut b = h(2.0).to_vec();
        b.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(y[0], -32.0);
        assert_eq!(y[31], 30.0);
    }

    #[test]
    fn q4_k_uses_packed_scales_and_mins() {
        let mut b = h(1.0).to_vec();
        b.extend(h(0.5));
        let mut scales = [0u8; 12];
        // sub-block 0: scale 3, min 2 (low 6 bits of bytes 0 and 4)
        scales[0] = 3;
        scales[4] = 2;
        // sub-block 5 (j = 5 >= 4): scale = (q[9] & 0xF) | ((q[1] >> 6) << 4) = 1 | (1 << 4) = 17;
        // min = (q[9] >> 4) | ((q[5] >> 6) << 4) = 2 | (2 << 4) = 34
        scales[9] = 0x21;
        scales[1] = 0b0100_0000;
        scales[5] = 0b1000_0000;
        b.extend(scales);
        let mut qs = [0u8; 128];
        qs[0] = 0x07; // element 0: q = 7 (sub-block 0)
        qs[64 + 1] = 0x90; // element 2·64 + 32 + 1 = 161: high nibble 9 (sub-block 5)
        b.extend(qs);
        let y = dequantize(GgmlType::Q4K, &b, 256).unwrap();
        assert_eq!(y[0], 1.0 * 3.0 * 7.0 - 0.5 * 2.0);
        assert_eq!(y[1], -0.5 * 2.0);
        assert_eq!(y[161], 1.0 * 17.0 * 9.0 - 0.5 * 34.0);
    }

    #[test]
    fn q6_k_combines_low_and_high_bits() {
        let mut b = vec![0u8; 210];
        b[0] = 0x35; // ql[0]: low nibble 5 (element 0), high nibble 3 (element 64)
        b[128] = 0b0000_0110; // qh[0]: bits 0-1 = 2 (element 0), bits 2-3 = 1 (element 32)
        for (i, s) in [1i8, -2, 3, 4, 5, 6, 7, 8].iter().enumerate() {
            b[192 + i] = *s as u8;
        }
        b[208..210].copy_from_slice(&h(0.5));
        let y = dequantize(GgmlType::Q6K, &b, 256).unwrap();
        assert_eq!(y[0], 0.5 * 1.0 * ((5 | (2 << 4)) - 32) as f32);
        assert_eq!(y[32], 0.5 * 3.0 * ((1 << 4) - 32) as f32);
        assert_eq!(y[64], 0.5 * 5.0 * (3 - 32) as f32);
        // element 16 uses scale index 1 (−2) and q = 0 − 32
        assert_eq!(y[16], 0.5 * -2.0 * -32.0);
    }

    #[test]
    fn parses_metadata_and_rejects_unknown_quant() {
        let bytes = write_gguf(
            &[("general.architecture", Value::String("llama".into())), ("llama.block_count", Value::U32(2))],
            &[("a", vec![2, 2], 0, [1f32, 2., 3., 4.].iter().flat_map(|x| x.to_le_bytes()).collect()), ("b", vec![256], 10, vec![0; 84])],
        );
        let f = GgufFile::parse(Path::new("t.gguf"), bytes).unwrap();
        assert_eq!(f.get("llama.block_count").unwrap().as_u64(), Some(2));
        let (shape, v) = f.dequantize("a").unwrap();
        assert_eq!(shape, vec![2, 2]);
        assert_eq!(v, vec![1., 2., 3., 4.]);
        let err = f.dequantize("b").unwrap_err().to_string();
        assert!(err.contains("Q2_K") && err.contains("`b`") && err.contains("t.gguf"), "{err}");
    }

    /// Q5_0 and Q5_1 by hand: the fifth bit of element j is bit j of `qh`, of element j + 16
    /// bit j + 16. (Agreement with llama.cpp on real tensors: native/tests/llama_cpp.rs.)
    #[test]
    fn q5_0_and_q5_1_blocks() {
        let h = |x: f32| f16::from_f32(x).to_le_bytes();
        let qh: u32 = 1 | (1 << 17); // element 0 and element 17 have the high bit
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&h(0.25));
        b[2..6].copy_from_slice(&qh.to_le_bytes());
        b[6] = 0x73; // element 0: low nibble 3, element 16: high nibble 7
        b[7] = 0x2F; // element 1: 15, element 17: 2
        let y = dequantize(GgmlType::Q5_0, &b, 32).unwrap();
        assert_eq!(y[0], (16 + 3 - 16) as f32 * 0.25);
        assert_eq!(y[16], (7 - 16) as f32 * 0.25);
        assert_eq!(y[1], (15 - 16) as f32 * 0.25);
        assert_eq!(y[17], (16 + 2 - 16) as f32 * 0.25);
        assert_eq!(y[2], -16.0 * 0.25);
        let mut b1 = vec![0u8; 24];
        b1[0..2].copy_from_slice(&h(0.5));
        b1[2..4].copy_from_slice(&h(-1.0));
        b1[4..8].copy_from_slice(&qh.to_le_bytes());
        b1[8] = 0x73;
        let y = dequantize(GgmlType::Q5_1, &b1, 32).unwrap();
        assert_eq!(y[0], 19.0 * 0.5 - 1.0);
        assert_eq!(y[16], 7.0 * 0.5 - 1.0);
        assert_eq!(y[2], -1.0);
    }

    /// Q5_K by hand: sub-block pairs j read bits 2j and 2j + 1 of each `qh` byte.
    #[test]
    fn q5_k_block() {
        let h = |x: f32| f16::from_f32(x).to_le_bytes();
        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(0.25));
        b[4] = 2; // scale of sub-block 0
        b[5] = 3; // scale of sub-block 1
        b[8] = 4; // min of sub-block 0
        b[6] = 5; // scale of sub-block 2
        b[16] = 0b0000_0110; // qh[0]: bit 1 (element 32) and bit 2 (element 64)
        b[48] = 0x9A; // element 0: 10, element 32: 9
        b[80] = 0x01; // element 64: 1
        let y = dequantize(GgmlType::Q5K, &b, 256).unwrap();
        assert_eq!(y[0], 0.5 * 2.0 * 10.0 - 0.25 * 4.0);
        assert_eq!(y[32], 0.5 * 3.0 * (9.0 + 16.0));
        assert_eq!(y[64], 0.5 * 5.0 * (1.0 + 16.0));
        assert_eq!(y[1], -0.25 * 4.0);
    }

    /// The header alone reads back the metadata and tensor index of a file whose data is
    /// beyond the first read; a header longer than it (a large vocabulary) is read whole.
    #[test]
    fn a_header_reads_without_the_tensor_data() {
        let dir = tempfile::tempdir().unwrap();
        let big = 6usize << 20; // data past the first 4 MiB
        let tokens = Value::Array((0..400_000).map(|i| Value::String(format!("token-{i}"))).collect());
        for (name, meta) in [("small.gguf", Value::U32(2)), ("long-header.gguf", tokens)] {
            let bytes = write_gguf(
                &[("general.architecture", Value::String("llama".into())), ("x.meta", meta)],
                &[("w", vec![big / 4], 0, vec![0; big])],
            );
            let path = dir.path().join(name);
            std::fs::write(&path, &bytes).unwrap();
            let head = GgufFile::open_header(&path).unwrap();
            let full = GgufFile::open(&path).unwrap();
            assert_eq!(head.metadata.keys().collect::<Vec<_>>(), full.metadata.keys().collect::<Vec<_>>(), "{name}");
            assert_eq!(head.tensors["w"].shape, full.tensors["w"].shape, "{name}");
        }
        let err = GgufFile::open_header(&dir.path().join("missing.gguf")).err().unwrap().to_string();
        assert!(err.contains("missing.gguf"), "{err}");
    }
}
