//! Hugging Face safetensors checkpoints (`model.safetensors`, or shards listed in
//! `model.safetensors.index.json`), read over memory maps.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::weights::WeightSource;
use crate::quant::fp4::Nvfp4Matrix;
use crate::quant::fp8::{Fp8BlockMatrix, FP8_BLOCK};
use crate::quant::{DType, DenseMatrix, QuantMatrix};
use crate::{Error, Result};

struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the shard's whole file.
    start: usize,
    end: usize,
}

pub struct SafetensorsStore {
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorEntry>,
}

impl SafetensorsStore {
    /// Opens the checkpoint in `dir`: the index file when present, else `model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files = if index.exists() {
            shard_files(&index)?.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(Error::bad_file(
                    dir,
                    "no model.safetensors or model.safetensors.index.json in this directory",
                ));
            }
            vec![single]
        };
        Self::open_files(&files)
    }

    pub fn open_files(files: &[PathBuf]) -> Result<Self> {
        let mut store = SafetensorsStore { shards: Vec::new(), tensors: HashMap::new() };
        for path in files {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the file is opened read-only; like every mmap-based loader we rely on nobody
            // truncating the checkpoint while it is loaded.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| Error::bad_file(path, format!("not a valid safetensors file: {e}")))?;
            let data_start = 8 + header_len;
            let shard = store.shards.len();
            for (name, info) in metadata.tensors() {
                let (begin, end) = info.data_offsets;
                store.tensors.insert(
                    name,
                    TensorEntry {
                        shard,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: data_start + begin,
                        end: data_start + end,
                    },
                );
            }
            store.shards.push((path.clone(), mmap));
        }
        store.unwrap_language_model();
        Ok(store)
    }

    /// Multimodal checkpoints (Qwen3_5ForConditionalGeneration) keep the text model under
    /// `model.language_model.*`: it is read under the names of a text-only checkpoint, so the
    /// model code sees one layout. The vision tower (`model.visual.*`) is left unused (the load
    /// report says so).
    fn unwrap_language_model(&mut self) {
        const WRAPPED: &str = "model.language_model.";
        if !self.tensors.keys().any(|n| n.starts_with(WRAPPED)) {
            return;
        }
        let names: Vec<String> = self.tensors.keys().filter(|n| n.starts_with(WRAPPED)).cloned().collect();
        for name in names {
            if let Some(entry) = self.tensors.remove(&name) {
                self.tensors.insert(format!("model.{}", &name[WRAPPED.len()..]), entry);
            }
        }
    }

    /// How many tensors have names starting with `prefix`.
    pub fn count_prefixed(&self, prefix: &str) -> usize {
        self.tensors.keys().filter(|n| n.starts_with(prefix)).count()
    }

    /// (name, dtype, element count, bytes) of every tensor, for `atlas info`.
    pub fn summary(&self) -> Vec<(&str, String, usize, usize)> {
        self.tensors
            .iter()
            .map(|(name, e)| (name.as_str(), format!("{:?}", e.dtype), e.shape.iter().product(), e.end - e.start))
            .collect()
    }

    /// A tensor as stored: dtype, shape and bytes (for tools that rewrite checkpoints).
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8])> {
        let entry = self.entry(name)?;
        Ok((entry.dtype, &entry.shape, self.bytes(entry)))
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| Error::bad_tensor(name, "missing from the checkpoint"))
    }

    fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.shards[entry.shard].1[entry.start..entry.end]
    }

    fn checked(&self, name: &str, shape: &[usize]) -> Result<(&TensorEntry, DType)> {
        let entry = self.entry(name)?;
        if entry.shape != shape {
            return Err(Error::bad_tensor(
                name,
                format!("shape {:?} in {}, expected {:?}", entry.shape, self.shards[entry.shard].0.display(), shape),
            ));
        }
        let dtype = match entry.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(Error::bad_tensor(name, format!("dtype {other:?} is not supported (f32, f16, bf16; F8_E4M3 for block-scaled weights)")))
            }
        };
        Ok((entry, dtype))
    }
}

impl SafetensorsStore {
    /// An FP8 block-scaled weight: E4M3 values and `<name>_scale_inv` of one f32/bf16 scale per
    /// 128×128 block.
    fn fp8_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        let entry = self.entry(name)?;
        if entry.shape != [rows, cols] {
            return Err(Error::bad_tensor(name, format!("shape {:?}, expected {:?}", entry.shape, [rows, cols])));
        }
        let scale_name = format!("{name}_scale_inv");
        let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
        let (scale_entry, scale_dtype) = self.checked(&scale_name, &grid)?;
        let scales = DenseMatrix::from_le_bytes(1, grid[0] * grid[1], scale_dtype, self.bytes(scale_entry));
        let mut scale_values = vec![0f32; grid[0] * grid[1]];
        scales.dequant_row(0, &mut scale_values);
        Ok(Box::new(Fp8BlockMatrix::new(rows, cols, self.bytes(entry).to_vec(), scale_values)))
    }
}

impl SafetensorsStore {
    /// An NVFP4 weight from either producer, recognised by its tensors: NVIDIA ModelOpt's U8
    /// `<base>.weight` beside `weight_scale` (E4M3, one per 16 values) and `weight_scale_2` (f32),
    /// or compressed-tensors' `<base>.weight_packed` beside `weight_scale` and
    /// `weight_global_scale` (f32, a divisor). None when `name` is not such a weight: which layers
    /// a checkpoint keeps in high precision is read from what it holds.
    fn nvfp4_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Box<dyn QuantMatrix>>> {
        let Some(base) = name.strip_suffix(".weight") else { return Ok(None) };
        let modelopt = self.tensors.get(name).is_some_and(|e| e.dtype == Dtype::U8) && self.contains(&format!("{base}.weight_scale_2"));
        let packed = format!("{base}.weight_packed");
        let (codes_name, factor) = if modelopt {
            (name.to_string(), self.scalar(&format!("{base}.weight_scale_2"))?)
        } else if !self.contains(name) && self.contains(&packed) {
            let global_name = format!("{base}.weight_global_scale");
            let global = self.scalar(&global_name)?;
            if !(global.is_finite() && global > 0.0) {
                return Err(Error::bad_tensor(&global_name, format!("{global} is not a positive scale")));
            }
            (packed, 1.0 / global)
        } else {
            return Ok(None);
        };
        if !cols.is_multiple_of(16) {
            return Err(Error::bad_tensor(name, format!("NVFP4 rows of {cols} values are not whole groups of 16")));
        }
        let bytes_of = |tensor: &str, dtype: Dtype, shape: [usize; 2]| -> Result<Vec<u8>> {
            let e = self.entry(tensor)?;
            if e.dtype != dtype || e.shape != shape {
                return Err(Error::bad_tensor(tensor, format!("{:?} {:?}, expected {dtype:?} {shape:?} for NVFP4", e.dtype, e.shape)));
            }
            Ok(self.bytes(e).to_vec())
        };
        let codes = bytes_of(&codes_name, Dtype::U8, [rows, cols / 2])?;
        let scales = bytes_of(&format!("{base}.weight_scale"), Dtype::F8_E4M3, [rows, cols / 16])?;
        let m = Nvfp4Matrix::new(rows, cols, codes, scales, factor).map_err(|e| Error::bad_tensor(name, e))?;
        Ok(Some(Box::new(m)))
    }

    /// A one-element tensor (shape [] or [1]) as f32.
    fn scalar(&self, name: &str) -> Result<f32> {
        let shape = self.entry(name)?.shape.clone();
        if shape.iter().product::<usize>() != 1 {
            return Err(Error::bad_tensor(name, format!("shape {shape:?}, expected one value")));
        }
        Ok(self.array(name, &shape)?[0])
    }
}

impl WeightSource for SafetensorsStore {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        if let Some(m) = self.nvfp4_matrix(name, rows, cols)? {
            return Ok(m);
        }
        if self.entry(name)?.dtype == Dtype::F8_E4M3 {
            return self.fp8_matrix(name, rows, cols);
        }
        let (entry, dtype) = self.checked(name, &[rows, cols])?;
        Ok(Box::new(DenseMatrix::from_le_bytes(rows, cols, dtype, self.bytes(entry))))
    }

    fn stacked_matrix(&self, name: &str, shape: [usize; 3], index: usize, rows: Range<usize>) -> Result<Box<dyn QuantMatrix>> {
        let [count, total_rows, cols] = shape;
        if index >= count || rows.start > rows.end || rows.end > total_rows {
            return Err(Error::bad_tensor(name, format!("slice {index}, rows {rows:?} of a {shape:?} tensor")));
        }
        let (entry, dtype) = self.checked(name, &shape)?;
        let elem = dtype_bytes(dtype);
        let start = (index * total_rows + rows.start) * cols * elem;
        let bytes = &self.bytes(entry)[start..start + rows.len() * cols * elem];
        Ok(Box::new(DenseMatrix::from_le_bytes(rows.len(), cols, dtype, bytes)))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.array(name, &[len])
    }

    fn array(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (entry, dtype) = self.checked(name, shape)?;
        let len = shape.iter().product();
        let m = DenseMatrix::from_le_bytes(1, len, dtype, self.bytes(entry));
        let mut out = vec![0f32; len];
        m.dequant_row(0, &mut out);
        Ok(out)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor_count(&self) -> usize {
        self.tensors.len()
    }
}

fn dtype_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        _ => 2,
    }
}

/// The distinct shard file names of an index, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::bad_file(index, format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::bad_file(index, "no weight_map object"))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| Error::bad_file(index, format!("weight_map entry {tensor} is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file.contains("..") {
            return Err(Error::bad_file(index, format!("shard name {file:?} leaves the model directory")));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// Writes `tensors` (name, dtype, shape, bytes) as one safetensors file in a fresh directory.
    fn checkpoint(tag: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("atlas-nvfp4-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let views: Vec<(String, TensorView)> =
            tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        dir
    }

    #[test]
    fn nvfp4_weights_of_both_producers_are_read_from_their_tensors() {
        // Two rows of 32: codes 0x7A in every byte (elements -1, 6), scales 1.5 (0x3C) and 2 (0x40).
        let (codes, scales) = (vec![0x7Au8; 32], vec![0x3C, 0x40, 0x3C, 0x40]);
        let f32_bytes = |v: f32| v.to_le_bytes().to_vec();
        let modelopt = checkpoint(
            "modelopt",
            &[
                ("l.weight", Dtype::U8, vec![2, 16], codes.clone()),
                ("l.weight_scale", Dtype::F8_E4M3, vec![2, 2], scales.clone()),
                ("l.weight_scale_2", Dtype::F32, vec![], f32_bytes(0.25)),
                ("l.input_scale", Dtype::F32, vec![], f32_bytes(1.0)),
                ("norm.weight", Dtype::F32, vec![2], [f32_bytes(1.0), f32_bytes(2.0)].concat()),
            ],
        );
        let compressed = checkpoint(
            "compressed",
            &[
                ("l.weight_packed", Dtype::U8, vec![2, 16], codes),
                ("l.weight_scale", Dtype::F8_E4M3, vec![2, 2], scales),
                ("l.weight_global_scale", Dtype::F32, vec![1], f32_bytes(4.0)),
            ],
        );
        for dir in [&modelopt, &compressed] {
            let store = SafetensorsStore::open_dir(dir).unwrap();
            let m = store.matrix("l.weight", 2, 32).unwrap();
            assert_eq!(m.dtype(), DType::NVFP4);
            let mut row = [0f32; 32];
            m.dequant_row(1, &mut row);
            // Row 1, group 0 at 1.5 · 0.25, group 1 at 2 · 0.25.
            assert_eq!((row[0], row[1], row[16], row[17]), (-0.375, 2.25, -0.5, 3.0), "{}", dir.display());
            assert!(store.matrix("l.weight", 2, 48).is_err(), "a shape the tensors do not have");
        }
        assert_eq!(SafetensorsStore::open_dir(&modelopt).unwrap().vector("norm.weight", 2).unwrap(), [1.0, 2.0]);
        for dir in [modelopt, compressed] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
