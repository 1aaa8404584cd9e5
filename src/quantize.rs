//! `atlas quantize`: a GGUF file with float weights (F32, F16, BF16) re-encoded in a block format
//! Atlas writes (Q8_0, Q4_0, and the ROCmFPX fork's ROCmFP4 types 100 and 101): every weight
//! matrix (2-D, or 3-D stacked experts) whose rows are whole blocks, except the MoE routers and
//! the Gated DeltaNet convolution, which stay as they are, like every vector. The metadata is
//! copied with `general.file_type` set; the same input gives the same bytes.

use std::path::Path;

use crate::gguf::{dense_dtype, write_gguf, GgmlType, GgufFile, MetaValue, TensorInfo, TensorOut};
use crate::quant::{DenseMatrix, GgmlFormat, QuantMatrix};
use crate::{Error, Result};

/// What happened to one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorLine {
    pub name: String,
    pub dims: Vec<u64>,
    pub from: String,
    /// None: copied as it is.
    pub to: Option<String>,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// llama.cpp's `general.file_type` (llama_ftype) of a file that is mostly `to`.
fn file_type(to: GgmlFormat) -> u32 {
    match to {
        GgmlFormat::Q8_0 => 7,
        GgmlFormat::Q4_0 => 2,
        GgmlFormat::ROCMFP4 => 100,
        // The fork's ftype for "all FAST" is 103 (its tensor type is 101).
        _ => 103,
    }
}

/// The target format named on the command line (ggml's type names; case does not matter).
pub fn parse_target(name: &str) -> Result<GgmlFormat> {
    GgmlFormat::WRITABLE.into_iter().find(|f| f.name().eq_ignore_ascii_case(name)).ok_or_else(|| {
        let names: Vec<String> = GgmlFormat::WRITABLE.iter().map(|f| f.name().to_ascii_uppercase()).collect();
        Error::InvalidArgument(format!("cannot quantize to {name:?}: Atlas writes {}", names.join(", ")))
    })
}

/// Whether `t` is a weight matrix this writes in the block format.
fn quantizes(t: &TensorInfo, to: GgmlFormat) -> bool {
    let kept = ["ffn_gate_inp", "ssm_conv1d"];
    (t.dims.len() == 2 || t.dims.len() == 3)
        && t.name.ends_with(".weight")
        && !kept.iter().any(|k| t.name.contains(k))
        && dense_dtype(t.ggml_type).is_some()
        && t.dims[0] % to.block_size() as u64 == 0
}

/// Re-encodes `input` into `output`; `progress` sees each tensor as it is done (index, count).
pub fn quantize_gguf(input: &Path, output: &Path, to: GgmlFormat, progress: &mut dyn FnMut(usize, usize, &TensorLine)) -> Result<Vec<TensorLine>> {
    let file = GgufFile::open(input)?;
    let target = GgmlType::from_u32(to.ggml_type()).ok_or_else(|| Error::InvalidArgument(format!("no ggml type {}", to.ggml_type())))?;
    let mut tensors = Vec::with_capacity(file.tensors().len());
    let mut lines = Vec::with_capacity(file.tensors().len());
    for (i, t) in file.tensors().iter().enumerate() {
        let data = file.tensor_data(t);
        let (out, line_to) = match dense_dtype(t.ggml_type).filter(|_| quantizes(t, to)) {
            Some(dtype) => {
                let cols = t.dims[0] as usize;
                let rows = (t.n_elements() / t.dims[0]) as usize;
                let m = DenseMatrix::from_le_bytes(rows, cols, dtype, data);
                let mut row = vec![0f32; cols];
                let mut blocks = Vec::with_capacity(rows * cols / to.block_size() * to.block_bytes());
                for r in 0..rows {
                    m.dequant_row(r, &mut row);
                    blocks.extend(to.quantize_row(&row).ok_or_else(|| Error::bad_tensor(&t.name, format!("rows of {cols} are not whole {to} blocks")))?);
                }
                (TensorOut { name: t.name.clone(), dims: t.dims.clone(), ggml_type: target, data: blocks }, Some(to.name().to_string()))
            }
            None => (TensorOut { name: t.name.clone(), dims: t.dims.clone(), ggml_type: t.ggml_type, data: data.to_vec() }, None),
        };
        let line = TensorLine {
            name: t.name.clone(),
            dims: t.dims.clone(),
            from: t.ggml_type.name().to_ascii_lowercase(),
            to: line_to,
            bytes_before: data.len() as u64,
            bytes_after: out.data.len() as u64,
        };
        progress(i + 1, file.tensors().len(), &line);
        tensors.push(out);
        lines.push(line);
    }
    let mut metadata: Vec<(String, MetaValue)> = file.metadata().to_vec();
    for (key, v) in [("general.file_type", file_type(to)), ("general.quantization_version", 2)] {
        match metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = MetaValue::U32(v),
            None => metadata.push((key.to_string(), MetaValue::U32(v))),
        }
    }
    write_gguf(output, &metadata, &tensors)?;
    Ok(lines)
}
