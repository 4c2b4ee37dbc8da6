//! The safetensors file format, treated as hostile input: an 8-byte little-endian header
//! length N, N bytes of JSON header (`{name: {dtype, shape, data_offsets}, "__metadata__":
//! {str: str}}`), then the data buffer. Every size is computed with checked arithmetic and
//! every error names the file and, where there is one, the tensor.
//!
//! Also the writer the converter uses ([`write_header`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// Largest JSON header accepted (the same cap as the `safetensors` crate). A GLM-5 shard
/// with thousands of expert tensors has a header of a few hundred KB.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Element types of safetensors tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    /// FP8 e4m3fn (DeepSeek-V3 and GLM-5 source checkpoints).
    F8E4M3,
    /// FP8 e5m2.
    F8E5M2,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "U16" => Dtype::U16,
            "I16" => Dtype::I16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "U64" => Dtype::U64,
            "I64" => Dtype::I64,
            "F16" => Dtype::F16,
            "BF16" => Dtype::Bf16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "F8_E4M3" => Dtype::F8E4M3,
            "F8_E5M2" => Dtype::F8E5M2,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor entry of a parsed header. `start..end` are absolute byte offsets in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

impl RawTensor {
    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// A parsed header: tensors in file order and the `__metadata__` map.
#[derive(Debug, Clone, Default)]
pub struct Header {
    pub tensors: Vec<RawTensor>,
    pub metadata: BTreeMap<String, String>,
    /// Absolute offset of the data buffer (8 + N).
    pub data_start: usize,
}

/// Parse and validate the header of a safetensors file whose first bytes are `prefix`
/// (at least the 8-byte length plus the header, or the whole file) and whose total size is
/// `file_len`. Checks: header length within the file and under [`MAX_HEADER_BYTES`], UTF-8
/// JSON object, known dtypes, shape×dtype = byte length, offsets inside the data buffer and
/// not overlapping.
pub fn parse_header(file: &Path, prefix: &[u8], file_len: u64) -> Result<Header> {
    let (data_start, obj) = header_object(file, prefix, file_len)?;
    let data_len = file_len - data_start as u64;
    let mut header = Header {
        data_start,
        ..Header::default()
    };
    for (name, entry) in &obj {
        if name == "__metadata__" {
            read_metadata(file, entry, &mut header.metadata)?;
        } else {
            let t = tensor_entry(file, name, entry, data_start, data_len)?;
            header.tensors.push(t);
        }
    }
    check_no_overlap(file, &header.tensors)?;
    header.tensors.sort_by_key(|t| t.start);
    Ok(header)
}

/// The header's length (checked against the file and [`MAX_HEADER_BYTES`]) and its JSON
/// object: returns the data buffer's absolute offset and the object.
fn header_object(
    file: &Path,
    prefix: &[u8],
    file_len: u64,
) -> Result<(usize, serde_json::Map<String, Value>)> {
    let err = |msg: String| Error::container(file, None, msg);
    if file_len < 8 || prefix.len() < 8 {
        return Err(err(format!(
            "truncated: {file_len} bytes is too short for a safetensors header length"
        )));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&prefix[..8]);
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER_BYTES {
        return Err(err(format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap; not a safetensors file or corrupt"
        )));
    }
    let data_start = n.checked_add(8).filter(|&e| e <= file_len).ok_or_else(|| {
        err(format!(
            "truncated: header length {n} runs past the end of the {file_len}-byte file"
        ))
    })?;
    let data_start = usize::try_from(data_start)
        .map_err(|_| err("header offset does not fit in memory".into()))?;
    let json = prefix
        .get(8..data_start)
        .ok_or_else(|| err("header not fully read".into()))?;
    let text =
        std::str::from_utf8(json).map_err(|e| err(format!("header is not valid UTF-8: {e}")))?;
    let value: Value = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|e| err(format!("header is not valid JSON: {e}")))?;
    match value {
        Value::Object(obj) => Ok((data_start, obj)),
        _ => Err(err("header is not a JSON object".into())),
    }
}

/// Copy the `__metadata__` entry's string values into `metadata`.
fn read_metadata(
    file: &Path,
    entry: &Value,
    metadata: &mut BTreeMap<String, String>,
) -> Result<()> {
    let err = |msg: String| Error::container(file, None, msg);
    let m = entry
        .as_object()
        .ok_or_else(|| err("__metadata__ is not an object".into()))?;
    for (k, v) in m {
        let v = v
            .as_str()
            .ok_or_else(|| err(format!("__metadata__ value of '{k}' is not a string")))?;
        metadata.insert(k.clone(), v.to_owned());
    }
    Ok(())
}

/// One tensor's header entry: a known dtype, a shape whose bytes equal its `data_offsets`'
/// span, and offsets inside the `data_len`-byte buffer at `data_start`.
fn tensor_entry(
    file: &Path,
    name: &str,
    entry: &Value,
    data_start: usize,
    data_len: u64,
) -> Result<RawTensor> {
    let err = |msg: String| Error::container(file, Some(name), msg);
    let e = entry
        .as_object()
        .ok_or_else(|| err("header entry is not an object".into()))?;
    let dtype_s = e
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| err("missing 'dtype'".into()))?;
    let dtype = Dtype::parse(dtype_s).ok_or_else(|| err(format!("unknown dtype '{dtype_s}'")))?;
    let shape = e
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| err("missing 'shape'".into()))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| err("shape entries must be non-negative integers".into()))?;
    let offs = e
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or_else(|| err("'data_offsets' must be [begin, end]".into()))?;
    let (begin, end) = match (offs[0].as_u64(), offs[1].as_u64()) {
        (Some(b), Some(e)) if b <= e && e <= data_len => (b, e),
        _ => {
            return Err(err(format!(
                "data_offsets {} {} out of range of the {data_len}-byte data buffer",
                offs[0], offs[1]
            )))
        }
    };
    let nbytes = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| err(format!("shape {shape:?} overflows")))?;
    if nbytes as u64 != end - begin {
        return Err(err(format!(
            "shape {shape:?} of {dtype} needs {nbytes} bytes but data_offsets span {}",
            end - begin
        )));
    }
    // Both fit: end ≤ data_len and data_start + data_len = file_len.
    let start = data_start
        .checked_add(usize::try_from(begin).map_err(|_| err("offset too large".into()))?)
        .ok_or_else(|| err("offset overflows".into()))?;
    let stop = start
        .checked_add(nbytes)
        .ok_or_else(|| err("offset overflows".into()))?;
    Ok(RawTensor {
        name: name.to_owned(),
        dtype,
        shape,
        start,
        end: stop,
    })
}

/// No two tensors' bytes overlap (checked in offset order; zero-length tensors cannot
/// overlap anything).
fn check_no_overlap(file: &Path, tensors: &[RawTensor]) -> Result<()> {
    let mut order: Vec<&RawTensor> = tensors.iter().filter(|t| !t.is_empty()).collect();
    order.sort_by_key(|t| (t.start, t.end));
    for pair in order.windows(2) {
        if pair[1].start < pair[0].end {
            return Err(Error::container(
                file,
                Some(&pair[1].name),
                format!(
                    "data overlaps tensor '{}' (bytes {}..{} vs {}..{})",
                    pair[0].name, pair[1].start, pair[1].end, pair[0].start, pair[0].end
                ),
            ));
        }
    }
    Ok(())
}

/// One tensor to be written: name, dtype, shape and its byte length.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Serialise a header for `tensors` laid out back to back in the given order, padded with
/// spaces to a multiple of 8 bytes (as the reference writer does) so that data offsets keep
/// 8-byte alignment. Returns the full prefix: 8-byte length plus JSON.
pub fn write_header(tensors: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut obj = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        obj.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offset = 0usize;
    for t in tensors {
        let n = t.nbytes();
        obj.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype.name(),
                "shape": t.shape,
                "data_offsets": [offset, offset + n],
            }),
        );
        offset += n;
    }
    let mut json = Value::Object(obj).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    fn parse(bytes: &[u8]) -> Result<Header> {
        parse_header(Path::new("x.safetensors"), bytes, bytes.len() as u64)
    }

    #[test]
    fn round_trip_writer() {
        let specs = vec![
            TensorSpec {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![2, 3],
            },
            TensorSpec {
                name: "b".into(),
                dtype: Dtype::U8,
                shape: vec![5],
            },
        ];
        let mut meta = BTreeMap::new();
        meta.insert("a".into(), "f32".into());
        let mut bytes = write_header(&specs, &meta);
        assert_eq!((bytes.len() - 8) % 8, 0);
        bytes.extend(std::iter::repeat_n(1u8, 29));
        let h = parse(&bytes).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[0].len(), 24);
        assert_eq!(h.tensors[1].start, h.data_start + 24);
        assert_eq!(h.metadata.get("a").map(String::as_str), Some("f32"));
    }

    #[test]
    fn hostile_headers_are_errors_naming_the_tensor() {
        let cases = [
            (
                r#"{"w":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}}"#,
                2,
                "unknown dtype",
            ),
            (
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                8,
                "needs 8 bytes",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                2,
                "out of range",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}}"#,
                8,
                "out of range",
            ),
            (
                r#"{"v":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                8,
                "overlaps",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#,
                8,
                "overflows",
            ),
        ];
        for (h, n, want) in cases {
            let e = parse(&file_with(h, n)).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("x.safetensors"), "{h}: {e}");
            assert!(e.contains("'w'"), "{h}: {e}");
        }
    }

    #[test]
    fn hostile_framing_is_an_error() {
        assert!(parse(&[1, 2, 3])
            .unwrap_err()
            .to_string()
            .contains("truncated"));
        let mut v = 1000u64.to_le_bytes().to_vec();
        v.extend_from_slice(b"{}");
        assert!(parse(&v).unwrap_err().to_string().contains("past the end"));
        let v = u64::MAX.to_le_bytes().to_vec();
        assert!(parse(&v).unwrap_err().to_string().contains("cap"));
        let mut v = 4u64.to_le_bytes().to_vec();
        v.extend_from_slice(&[0xff, 0xfe, 0x7b, 0x7d]);
        assert!(parse(&v).unwrap_err().to_string().contains("UTF-8"));
        let e = parse(&file_with("{\"w\": [", 0)).unwrap_err().to_string();
        assert!(e.contains("JSON"), "{e}");
    }
}
