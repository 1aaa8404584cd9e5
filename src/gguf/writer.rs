//! Writing GGUF v3 files: the metadata as given, then the tensor table, then each tensor's data at
//! the alignment. The same input gives the same bytes (no time, no host detail).

use std::io::Write;
use std::path::Path;

use super::reader::{GgmlType, MetaArray, MetaValue, DEFAULT_ALIGNMENT};
use crate::{Error, Result};

/// One tensor to write: its name, ggml dims (innermost first), type and data.
pub struct TensorOut {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    pub data: Vec<u8>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn array_type_id(a: &MetaArray) -> u32 {
    match a {
        MetaArray::U8(_) => 0,
        MetaArray::I8(_) => 1,
        MetaArray::U16(_) => 2,
        MetaArray::I16(_) => 3,
        MetaArray::U32(_) => 4,
        MetaArray::I32(_) => 5,
        MetaArray::F32(_) => 6,
        MetaArray::Bool(_) => 7,
        MetaArray::String(_) => 8,
        MetaArray::Array(_) => 9,
        MetaArray::U64(_) => 10,
        MetaArray::I64(_) => 11,
        MetaArray::F64(_) => 12,
    }
}

fn value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => string(out, s),
        MetaValue::Array(a) => array(out, a),
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

fn array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend(array_type_id(a).to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    match a {
        MetaArray::U8(v) => out.extend(v),
        MetaArray::I8(v) => out.extend(v.iter().map(|&x| x as u8)),
        MetaArray::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&x| x as u8)),
        MetaArray::String(v) => v.iter().for_each(|s| string(out, s)),
        MetaArray::Array(v) => v.iter().for_each(|a| array(out, a)),
        MetaArray::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
    }
}

/// Writes a GGUF v3 file. `general.alignment` in `metadata` (a u32) sets the alignment, else
/// DEFAULT_ALIGNMENT. Each tensor's data must be its dims' worth of its type.
pub fn write_gguf(path: &Path, metadata: &[(String, MetaValue)], tensors: &[TensorOut]) -> Result<()> {
    let alignment = metadata
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .and_then(|(_, v)| v.as_u64())
        .unwrap_or(DEFAULT_ALIGNMENT)
        .max(1);
    let mut head = Vec::new();
    head.extend(b"GGUF");
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend((metadata.len() as u64).to_le_bytes());
    for (key, v) in metadata {
        string(&mut head, key);
        head.extend(type_id(v).to_le_bytes());
        value(&mut head, v);
    }
    let mut offset = 0u64;
    for t in tensors {
        let elements: u64 = t.dims.iter().product();
        let expected = elements / t.ggml_type.block_size() * t.ggml_type.block_bytes();
        if !elements.is_multiple_of(t.ggml_type.block_size()) || t.data.len() as u64 != expected {
            return Err(Error::InvalidArgument(format!(
                "tensor {}: {} bytes of {} for dims {:?}",
                t.name,
                t.data.len(),
                t.ggml_type,
                t.dims
            )));
        }
        string(&mut head, &t.name);
        head.extend((t.dims.len() as u32).to_le_bytes());
        t.dims.iter().for_each(|d| head.extend(d.to_le_bytes()));
        head.extend(t.ggml_type.id().to_le_bytes());
        head.extend(offset.to_le_bytes());
        offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
    }
    head.resize(head.len().next_multiple_of(alignment as usize), 0);
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::new(file);
    let mut write = |bytes: &[u8]| w.write_all(bytes).map_err(|e| Error::io(path, e));
    write(&head)?;
    for t in tensors {
        write(&t.data)?;
        let pad = (t.data.len() as u64).next_multiple_of(alignment) - t.data.len() as u64;
        write(&vec![0u8; pad as usize])?;
    }
    w.flush().map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn written_files_read_back_as_written() {
        let metadata = vec![
            ("general.architecture".to_string(), MetaValue::String("llama".into())),
            ("general.alignment".to_string(), MetaValue::U32(64)),
            ("a.f".to_string(), MetaValue::F32(1.5)),
            ("a.tokens".to_string(), MetaValue::Array(MetaArray::String(vec!["x".into(), "yz".into()]))),
            ("a.nested".to_string(), MetaValue::Array(MetaArray::Array(vec![MetaArray::I32(vec![1, -2])]))),
        ];
        let q8 = GgmlType::from_u32(8).unwrap();
        let f32t = GgmlType::from_u32(0).unwrap();
        let tensors = vec![
            TensorOut { name: "w".into(), dims: vec![32, 2], ggml_type: q8, data: (0..68).map(|i| i as u8).collect() },
            TensorOut { name: "n".into(), dims: vec![3], ggml_type: f32t, data: [1f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect() },
        ];
        let path = std::env::temp_dir().join(format!("atlas-writer-{}.gguf", std::process::id()));
        write_gguf(&path, &metadata, &tensors).unwrap();
        let f = GgufFile::open(&path).unwrap();
        assert_eq!((f.version(), f.alignment()), (3, 64));
        assert_eq!(f.metadata(), metadata.as_slice());
        for t in &tensors {
            let info = f.tensor(&t.name).unwrap();
            assert_eq!((&info.dims, info.ggml_type, f.tensor_data(info)), (&t.dims, t.ggml_type, t.data.as_slice()));
            assert_eq!(info.offset % 64, 0);
        }
        let bad = [TensorOut { name: "w".into(), dims: vec![32, 2], ggml_type: q8, data: vec![0; 10] }];
        assert!(write_gguf(&path, &metadata, &bad).is_err());
        std::fs::remove_file(&path).unwrap();
    }
}
