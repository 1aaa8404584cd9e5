//! GGML block decoding against the `gguf` Python package's dequantisation
//! (fixture: tests/fixtures/quant_goldens.json, made by tests/fixtures/make_quant_goldens.py).

use atlas::quant::{dot, GgmlFormat, GgmlMatrix, QuantMatrix};
use serde_json::Value;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn dequantisation_matches_gguf_py() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/quant_goldens.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = json["cases"].as_array().unwrap();
    let mut seen = Vec::new();
    for case in cases {
        let name = case["type"].as_str().unwrap();
        let format = GgmlFormat::from_ggml_type(case["ggml_type"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(format.name(), name.to_ascii_lowercase());
        let (rows, cols) = (case["rows"].as_u64().unwrap() as usize, case["cols"].as_u64().unwrap() as usize);
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let m = GgmlMatrix::new(format, rows, cols, hex(case["blocks_hex"].as_str().unwrap())).unwrap();
        let mut row = vec![0f32; cols];
        let mut worst = 0f32;
        for r in 0..rows {
            m.dequant_row(r, &mut row);
            for (c, (got, want)) in row.iter().zip(&want[r * cols..(r + 1) * cols]).enumerate() {
                let diff = (got - want).abs();
                assert!(diff <= 1e-6, "{name} [{r}, {c}]: {got} vs gguf-py {want}");
                worst = worst.max(diff);
            }
            // The CPU product (dequant_row + dot) against the reference values.
            let x: Vec<f32> = (0..cols).map(|i| ((i * 7 + r) % 13) as f32 / 13.0 - 0.5).collect();
            let exact: f64 = want[r * cols..(r + 1) * cols].iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 =
                want[r * cols..(r + 1) * cols].iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            assert!((dot(&row, &x) as f64 - exact).abs() <= 1e-5 * mag.max(1.0), "{name} row {r} product");
        }
        println!("{name}: {rows}x{cols}, max abs diff {worst:e}");
        seen.push(format);
    }
    // gguf-py has every format but the ROCmFPX fork's (checked by hand-computed blocks in quant::fp4).
    for f in GgmlFormat::ALL.into_iter().filter(|f| !matches!(f, GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST)) {
        assert!(seen.contains(&f), "no golden for {f}");
    }
}
