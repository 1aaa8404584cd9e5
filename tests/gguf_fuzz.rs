//! The GGUF reader and store against a small valid file built here, and against every truncation and
//! many deterministic corruptions of it: each must give Ok or Err, never panic.

use std::panic::{catch_unwind, AssertUnwindSafe};

use atlas::gguf::{unpermute_rows, GgufFile, GgufStore, MetaValue};
use atlas::model::{Architecture, WeightSource};
use atlas::quant::{GgmlFormat, GgmlMatrix, QuantMatrix};

const HIDDEN: usize = 32;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 16;
const FFN: usize = 32;
const VOCAB: usize = 40;

/// SplitMix64, for deterministic bytes.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Default)]
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn key(&mut self, k: &str, ty: u32) -> &mut Vec<u8> {
        self.n_kv += 1;
        string(&mut self.kv, k);
        self.kv.extend(ty.to_le_bytes());
        &mut self.kv
    }
    fn str(&mut self, k: &str, v: &str) {
        let out = self.key(k, 8);
        string(out, v);
    }
    fn u32(&mut self, k: &str, v: u32) {
        self.key(k, 4).extend(v.to_le_bytes());
    }
    fn f32(&mut self, k: &str, v: f32) {
        self.key(k, 6).extend(v.to_le_bytes());
    }
    fn strs(&mut self, k: &str, v: &[&str]) {
        let out = self.key(k, 9);
        out.extend(8u32.to_le_bytes());
        out.extend((v.len() as u64).to_le_bytes());
        for s in v {
            string(out, s);
        }
    }
    fn i32s(&mut self, k: &str, v: &[i32]) {
        let out = self.key(k, 9);
        out.extend(5u32.to_le_bytes());
        out.extend((v.len() as u64).to_le_bytes());
        for x in v {
            out.extend(x.to_le_bytes());
        }
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
    }

    fn finish(&self, version: u32, alignment: usize) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(alignment as u64);
        }
        let data_start = b.len().next_multiple_of(alignment);
        b.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(data_start + off as usize, 0);
            b.extend(data);
        }
        b
    }
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// Random blocks of a GGML format with moderate f16 scales.
fn blocks(format: GgmlFormat, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols / format.block_size();
    let mut out = Vec::new();
    for _ in 0..n {
        let mut b: Vec<u8> = (0..format.block_bytes()).map(|_| rng.next() as u8).collect();
        let scale = half::f16::from_f32(((rng.next() % 1000) as f32 - 500.0) * 1e-4).to_le_bytes();
        b[0..2].copy_from_slice(&scale);
        if format == GgmlFormat::Q4_1 {
            b[2..4].copy_from_slice(&scale);
        }
        out.extend(b);
    }
    out
}

const TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "h",
    "e",
    "l",
    "o",
    "Ġ",
    "w",
    "r",
    "d",
    "he",
    "ll",
    "llo",
    "hello",
    "Ġw",
    "or",
    "Ġwor",
    "ld",
    "Ġworld",
    "a",
    "b",
    "c",
    "f",
    "g",
    "i",
    "j",
    "k",
    "m",
    "n",
    "p",
    "q",
    "s",
    "t",
    "u",
    "v",
    "x",
    "y",
    "z",
];
const MERGES: &[&str] = &["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"];

/// A one-layer model of `arch` ("llama" or "qwen3") with a byte-level BPE vocabulary.
fn model_file(arch: &str, version: u32) -> Vec<u8> {
    model_file_with_merges(arch, version, MERGES)
}

fn model_file_with_merges(arch: &str, version: u32, merges: &[&str]) -> Vec<u8> {
    assert_eq!(TOKENS.len(), VOCAB);
    let mut rng = Rng(42);
    let mut w = Writer::default();
    w.str("general.architecture", arch);
    w.str("general.name", "fuzz");
    w.u32("general.alignment", 32);
    w.u32(&format!("{arch}.block_count"), 1);
    w.u32(&format!("{arch}.context_length"), 128);
    w.u32(&format!("{arch}.embedding_length"), HIDDEN as u32);
    w.u32(&format!("{arch}.feed_forward_length"), FFN as u32);
    w.u32(&format!("{arch}.attention.head_count"), HEADS as u32);
    w.u32(&format!("{arch}.attention.head_count_kv"), KV_HEADS as u32);
    if arch == "qwen3" {
        w.u32(&format!("{arch}.attention.key_length"), HEAD_DIM as u32);
    }
    w.f32(&format!("{arch}.rope.freq_base"), 10000.0);
    w.f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6);
    // One of each remaining scalar type, and a nested array, to exercise the reader.
    w.key("test.u8", 0).push(7);
    w.key("test.i8", 1).push(0xF9);
    w.key("test.u16", 2).extend(513u16.to_le_bytes());
    w.key("test.i16", 3).extend((-2i16).to_le_bytes());
    w.key("test.bool", 7).push(1);
    w.key("test.u64", 10).extend(u64::MAX.to_le_bytes());
    w.key("test.i64", 11).extend((-5i64).to_le_bytes());
    w.key("test.f64", 12).extend(0.25f64.to_le_bytes());
    {
        let out = w.key("test.nested", 9);
        out.extend(9u32.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        for n in [1u64, 2] {
            out.extend(0u32.to_le_bytes());
            out.extend(n.to_le_bytes());
            out.extend((0..n).map(|i| i as u8));
        }
    }
    w.str("tokenizer.ggml.model", "gpt2");
    w.str("tokenizer.ggml.pre", if arch == "qwen3" { "qwen2" } else { "smollm" });
    w.strs("tokenizer.ggml.tokens", TOKENS);
    let types: Vec<i32> = (0..VOCAB)
        .map(|i| {
            if i < 3 {
                3
            } else if i == 3 {
                4
            } else {
                1
            }
        })
        .collect();
    w.i32s("tokenizer.ggml.token_type", &types);
    w.strs("tokenizer.ggml.merges", merges);
    w.u32("tokenizer.ggml.bos_token_id", 1);
    w.u32("tokenizer.ggml.eos_token_id", 2);
    w.str("tokenizer.chat_template", "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}");

    let (h, q, kv, f) = (HIDDEN as u64, (HEADS * HEAD_DIM) as u64, (KV_HEADS * HEAD_DIM) as u64, FFN as u64);
    w.tensor("token_embd.weight", &[h, VOCAB as u64], 8, blocks(GgmlFormat::Q8_0, VOCAB, HIDDEN, &mut rng));
    w.tensor("blk.0.attn_norm.weight", &[h], 0, f32_bytes((0..HIDDEN).map(|i| 1.0 + i as f32 / 64.0)));
    w.tensor("blk.0.attn_q.weight", &[h, q], 2, blocks(GgmlFormat::Q4_0, q as usize, HIDDEN, &mut rng));
    let k_f16: Vec<u8> =
        (0..kv * h).flat_map(|i| half::f16::from_f32((i as f32 * 0.37).sin() * 0.1).to_le_bytes()).collect();
    w.tensor("blk.0.attn_k.weight", &[h, kv], 1, k_f16);
    w.tensor("blk.0.attn_v.weight", &[h, kv], 3, blocks(GgmlFormat::Q4_1, kv as usize, HIDDEN, &mut rng));
    w.tensor("blk.0.attn_output.weight", &[q, h], 2, blocks(GgmlFormat::Q4_0, HIDDEN, q as usize, &mut rng));
    if arch == "qwen3" {
        w.tensor("blk.0.attn_q_norm.weight", &[HEAD_DIM as u64], 0, f32_bytes((0..HEAD_DIM).map(|_| 1.0)));
        w.tensor("blk.0.attn_k_norm.weight", &[HEAD_DIM as u64], 0, f32_bytes((0..HEAD_DIM).map(|_| 1.0)));
    }
    w.tensor("blk.0.ffn_norm.weight", &[h], 0, f32_bytes((0..HIDDEN).map(|_| 1.0)));
    w.tensor("blk.0.ffn_gate.weight", &[h, f], 3, blocks(GgmlFormat::Q4_1, FFN, HIDDEN, &mut rng));
    w.tensor("blk.0.ffn_up.weight", &[h, f], 8, blocks(GgmlFormat::Q8_0, FFN, HIDDEN, &mut rng));
    let down_bf16: Vec<u8> =
        (0..f * h).flat_map(|i| half::bf16::from_f32((i as f32 * 0.11).cos() * 0.1).to_le_bytes()).collect();
    w.tensor("blk.0.ffn_down.weight", &[f, h], 30, down_bf16);
    w.tensor("output_norm.weight", &[h], 0, f32_bytes((0..HIDDEN).map(|_| 1.0)));
    w.finish(version, 32)
}

/// Everything a loader would do with a file: parse, config, tokenizer, every tensor decoded.
fn exercise(bytes: Vec<u8>) -> Result<(), String> {
    let file = GgufFile::from_bytes("fuzz.gguf", bytes).map_err(|e| e.to_string())?;
    for (_, v) in file.metadata() {
        let _ = (v.type_name(), v.as_u64(), v.as_f64(), v.as_str());
    }
    let store = GgufStore::from_file(file).map_err(|e| e.to_string())?;
    let mut first_err = None;
    if let Err(e) = store.config() {
        first_err.get_or_insert(e.to_string());
    }
    match store.tokenizer() {
        Ok(tk) => {
            if let Ok(enc) = tk.encode("<|im_start|>hello world<think> 123", false) {
                let _ = tk.decode(enc.get_ids(), false);
            }
        }
        Err(e) => {
            first_err.get_or_insert(e.to_string());
        }
    }
    let _ = (store.chat_template(), store.special_tokens(), store.summary());
    for t in store.file().tensors() {
        let name = atlas::gguf::hf_name(&t.name).unwrap_or_else(|| t.name.clone());
        let name = name.as_str();
        let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
        let res = match shape.as_slice() {
            [len] => store.vector(name, *len).map(|_| ()),
            [rows, cols] => store.matrix(name, *rows, *cols).map(|m| {
                let mut row = vec![0f32; m.cols()];
                for r in 0..m.rows() {
                    m.dequant_row(r, &mut row);
                }
            }),
            _ => Ok(()),
        };
        if let Err(e) = res {
            first_err.get_or_insert(e.to_string());
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn no_panic(bytes: Vec<u8>, what: &str) -> Result<(), String> {
    match catch_unwind(AssertUnwindSafe(|| exercise(bytes))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            panic!("{what}: the reader panicked: {msg:?}");
        }
    }
}

#[test]
fn a_merge_whose_result_is_not_a_token_is_an_error_not_a_panic() {
    // Found by the gguf fuzz target: tokenizers 0.23 copies a merge's halves into a buffer as long
    // as the longest token and panicked when they were longer ("<|endoftext|>" twice is 26 bytes).
    for merges in [&["<|endoftext|> <|endoftext|>"][..], &["h e", "he z"], &["q x"]] {
        let err = no_panic(model_file_with_merges("qwen3", 3, merges), "a merge outside the vocabulary").unwrap_err();
        assert!(err.contains("not in the vocabulary"), "{merges:?}: {err}");
    }
}

#[test]
fn valid_files_load_completely() {
    for arch in ["llama", "qwen3"] {
        for version in [2, 3] {
            let bytes = model_file(arch, version);
            exercise(bytes.clone()).unwrap_or_else(|e| panic!("{arch} v{version}: {e}"));
            let store = GgufStore::from_file(GgufFile::from_bytes("m.gguf", bytes).unwrap()).unwrap();
            let c = store.config().unwrap();
            assert_eq!(c.arch, if arch == "llama" { Architecture::Llama } else { Architecture::Qwen3 });
            assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers), (VOCAB, HIDDEN, FFN, 1));
            assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (HEADS, KV_HEADS, HEAD_DIM));
            assert_eq!(c.qk_norm, arch == "qwen3");
            assert!(c.tie_word_embeddings);
            assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
            assert_eq!(store.file().version(), version);
            assert_eq!(store.file().get("test.i16"), Some(&MetaValue::I16(-2)));
            assert_eq!(store.file().get("test.u64").and_then(MetaValue::as_u64), Some(u64::MAX));
            assert_eq!(store.special_tokens().eos_token.as_deref(), Some("<|im_end|>"));

            let tk = store.tokenizer().unwrap();
            let ids = tk.encode("<|im_start|>hello world<think>", false).unwrap().get_ids().to_vec();
            assert_eq!(ids, vec![1, 15, 20, 3], "{arch}");
            assert_eq!(tk.decode(&ids, true).unwrap(), "hello world<think>");
        }
    }
}

#[test]
fn llama_q_and_k_rows_are_unpermuted_and_qwen3_rows_are_not() {
    for arch in ["llama", "qwen3"] {
        let file = GgufFile::from_bytes("m.gguf", model_file(arch, 3)).unwrap();
        let raw_q = file.tensor("blk.0.attn_q.weight").unwrap().clone();
        let raw =
            GgmlMatrix::new(GgmlFormat::Q4_0, HEADS * HEAD_DIM, HIDDEN, file.tensor_data(&raw_q).to_vec()).unwrap();
        let store = GgufStore::from_file(file).unwrap();
        let q = store.matrix("model.layers.0.self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN).unwrap();
        let src = if arch == "llama" {
            unpermute_rows(HEADS * HEAD_DIM, HEADS).unwrap()
        } else {
            (0..HEADS * HEAD_DIM).collect()
        };
        let (mut a, mut b) = (vec![0f32; HIDDEN], vec![0f32; HIDDEN]);
        for (r, &s) in src.iter().enumerate() {
            q.dequant_row(r, &mut a);
            raw.dequant_row(s, &mut b);
            assert_eq!(a, b, "{arch} row {r}");
        }
        // k (f16) with one kv head: HF row i*8 + j comes from GGUF row 2j + i.
        let k = store.matrix("model.layers.0.self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN).unwrap();
        k.dequant_row(1, &mut a);
        let gguf_row = if arch == "llama" { 2 } else { 1 };
        let want: Vec<f32> = (0..HIDDEN)
            .map(|c| half::f16::from_f32(((gguf_row * HIDDEN + c) as f32 * 0.37).sin() * 0.1).to_f32())
            .collect();
        assert_eq!(a, want, "{arch}");
    }
}

#[test]
fn errors_name_the_file_and_the_tensor() {
    let bytes = model_file("llama", 3);
    let dir = std::env::temp_dir().join(format!("atlas-gguf-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = GgufStore::open(&path).unwrap_err().to_string();
    assert!(err.contains("truncated.gguf") && err.contains("output_norm.weight") && err.contains("truncated"), "{err}");
    std::fs::write(&path, b"").unwrap();
    assert!(GgufStore::open(&path).unwrap_err().to_string().contains("empty"));
    std::fs::remove_dir_all(&dir).ok();

    let store = GgufStore::from_file(GgufFile::from_bytes("m.gguf", bytes).unwrap()).unwrap();
    let err = store.matrix("model.layers.0.mlp.up_proj.weight", 32, 64).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("m.gguf"), "{err}");
    let err = store.matrix("model.layers.7.mlp.up_proj.weight", 32, 32).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = model_file("llama", 3);
    for len in 0..bytes.len() {
        let r = no_panic(bytes[..len].to_vec(), &format!("truncated to {len}"));
        assert!(r.is_err(), "truncated to {len} bytes was accepted");
    }
}

#[test]
fn bit_flips_and_overwrites_never_panic() {
    let bytes = model_file("llama", 3);
    let header_len = GgufFile::from_bytes("m.gguf", bytes.clone()).unwrap().data_start() as usize;
    let (mut ok, mut err) = (0usize, 0usize);
    let mut count = |r: Result<(), String>| if r.is_ok() { ok += 1 } else { err += 1 };
    // Every bit of the header and tensor table.
    for pos in 0..header_len {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[pos] ^= 1 << bit;
            count(no_panic(b, &format!("bit {bit} of byte {pos} flipped")));
        }
    }
    // Extreme values (all ones, then a huge power of two) written over every 8-byte window of the header.
    for pos in 0..header_len.saturating_sub(8) {
        for word in [u64::MAX, 1u64 << 60, 0x8000_0000] {
            let mut b = bytes.clone();
            b[pos..pos + 8].copy_from_slice(&word.to_le_bytes());
            count(no_panic(b, &format!("{word:#x} written at {pos}")));
        }
    }
    // Random bytes anywhere, one to eight at a time.
    let mut rng = Rng(2024);
    for i in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + i % 8 {
            let pos = (rng.next() % b.len() as u64) as usize;
            b[pos] = rng.next() as u8;
        }
        count(no_panic(b, &format!("random corruption #{i}")));
    }
    println!("corrupted files: {ok} loaded, {err} rejected");
    assert!(err > 0 && ok > 0);
}
