//! Every GPU op against the CPU reference on random inputs, and the fixture models end to end.
//! Tolerances (max abs difference over max abs reference): 1e-4 for f32 arithmetic over the same
//! bf16 weights, 1e-2 to 2e-2 where the GPU rounds to bf16 (prefill activations on the matrix
//! cores, the KV cache, weights converted from f32).
//! Skipped where no GPU is present, with a message and a line in `$ATLAS_SKIP_LOG` (see `skipped`).

use std::path::PathBuf;

use atlas::backend::cpu::{CpuBackend, CpuKvCache, CpuTensor};
use atlas::backend::gpu::{cuda, GpuBackend, GpuKvCache, GpuTensor};
use atlas::backend::kv_pool::KV_BLOCK;
use atlas::backend::{AttentionShape, Backend, KvRestore, Proj, QkNorms, Rope};
use atlas::quant::fp8::Fp8BlockMatrix;
use atlas::quant::{DenseData, DenseMatrix, QuantMatrix};
use atlas::sampling::{Adjustment, Rng};
use atlas::{CpuKernels, Device, Engine, EngineOptions, GenerateRequest};

fn gpu() -> Option<GpuBackend> {
    if !cuda::available() {
        skipped("no CUDA driver on this machine");
        return None;
    }
    match GpuBackend::cuda() {
        Ok(g) => Some(g),
        Err(e) => {
            skipped(&e.to_string());
            None
        }
    }
}

/// Cargo reports a test that returns early as `ok`, so each skip is also written to
/// `$ATLAS_SKIP_LOG` when set: scripts/test.sh counts those lines into its summary.
fn skipped(reason: &str) {
    let test = std::thread::current().name().unwrap_or("gpu_ops").to_string();
    println!("skipped: {test}: {reason}");
    if let Some(log) = std::env::var_os("ATLAS_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "tests/gpu_ops.rs {test}: {reason}");
        }
    }
}

fn cpu() -> CpuBackend {
    CpuBackend::new(0).unwrap()
}

/// A KV cache of a pool of its own whose free blocks come out of order (30, 28, ..., then the
/// odd ones): its positions land in scattered blocks, so the kernels' block tables are tested,
/// not an identity mapping.
fn gkv(g: &GpuBackend, width: usize) -> GpuKvCache {
    g.set_kv_pool(width, 256).unwrap();
    let taken: Vec<GpuKvCache> = (0..32)
        .map(|_| {
            let mut c = g.new_kv_cache(width, 0).unwrap();
            g.reserve_kv(&mut c, KV_BLOCK).unwrap();
            c
        })
        .collect();
    let (odd, even): (Vec<_>, Vec<_>) = taken.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
    drop(odd);
    drop(even);
    g.new_kv_cache(width, 0).unwrap()
}

/// A CPU cache, of a pool ample for every test here.
fn ckv(c: &CpuBackend, width: usize) -> CpuKvCache {
    c.set_kv_pool(width, 1024).unwrap();
    c.new_kv_cache(width, 0).unwrap()
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale).collect()
}

fn bf16_matrix(rng: &mut Rng, rows: usize, cols: usize) -> DenseMatrix {
    let data = random(rng, rows * cols, 1.0 / (cols as f32).sqrt());
    DenseMatrix::new(rows, cols, DenseData::BF16(data.iter().map(|v| half::bf16::from_f32(*v)).collect()))
}

/// Random E4M3 codes (every finite code, no NaN) with a random scale per 128x128 block.
fn fp8_matrix(rng: &mut Rng, rows: usize, cols: usize) -> Fp8BlockMatrix {
    let codes = (0..rows * cols)
        .map(|_| loop {
            let b = (rng.next_u64() >> 56) as u8;
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect();
    let grid = rows.div_ceil(128) * cols.div_ceil(128);
    let scales = (0..grid).map(|_| (0.5 + rng.next_f64() as f32) / (100.0 * (cols as f32).sqrt())).collect();
    Fp8BlockMatrix::new(rows, cols, codes, scales)
}

/// A bf16 or an fp8 matrix, boxed for upload.
fn matrix(rng: &mut Rng, fp8: bool, rows: usize, cols: usize) -> Box<dyn QuantMatrix> {
    if fp8 {
        Box::new(fp8_matrix(rng, rows, cols))
    } else {
        Box::new(bf16_matrix(rng, rows, cols))
    }
}

/// The same matrix twice: for the CPU and for the GPU.
fn matrix_pair(rng: &mut Rng, fp8: bool, rows: usize, cols: usize) -> (Box<dyn QuantMatrix>, Box<dyn QuantMatrix>) {
    let state = rng.clone();
    let a = matrix(rng, fp8, rows, cols);
    let b = matrix(&mut state.clone(), fp8, rows, cols);
    (a, b)
}

struct Pair {
    cpu: CpuTensor,
    gpu: GpuTensor,
}

fn pair(g: &GpuBackend, rows: usize, cols: usize, data: Vec<f32>) -> Pair {
    Pair { gpu: g.upload_f32(rows, cols, &data).unwrap(), cpu: CpuTensor::new(rows, cols, data) }
}

fn check(g: &GpuBackend, got: &GpuTensor, want: &CpuTensor, tol: f32, what: &str) {
    assert_eq!((got.rows, got.cols), (want.rows, want.cols), "{what}: shape");
    let got = g.to_host(got).unwrap();
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let max_ref = want.data.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let max_diff = got.iter().zip(&want.data).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("{what}: relative error {:.2e}", max_diff / max_ref);
    assert!(max_diff / max_ref <= tol, "{what}: relative error {} > {tol}", max_diff / max_ref);
}

#[test]
fn elementwise_norm_and_rope() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(1);
    for (rows, cols) in [(1, 4096), (7, 1000), (33, 64)] {
        let a = pair(&g, rows, cols, random(&mut rng, rows * cols, 3.0));
        let b = pair(&g, rows, cols, random(&mut rng, rows * cols, 3.0));
        check(&g, &g.silu_mul(&a.gpu, &b.gpu).unwrap(), &c.silu_mul(&a.cpu, &b.cpu).unwrap(), 1e-5, "silu_mul");
        let (mut x, mut y) = (pair(&g, rows, cols, a.cpu.data.clone()), a.cpu.clone());
        g.add_assign(&mut x.gpu, &b.gpu).unwrap();
        c.add_assign(&mut y, &b.cpu).unwrap();
        check(&g, &x.gpu, &y, 1e-6, "add");
        check(&g, &g.last_row(&a.gpu).unwrap(), &c.last_row(&a.cpu).unwrap(), 0.0, "last_row");
    }
    for (rows, cols, group) in [(3, 4096, 4096), (5, 1024, 128), (2, 512, 64), (4, 96, 32)] {
        let x = pair(&g, rows, cols, random(&mut rng, rows * cols, 2.0));
        let w = pair(&g, 1, group, random(&mut rng, group, 1.5));
        check(&g, &g.rms_norm(&x.gpu, &w.gpu, 1e-6).unwrap(), &c.rms_norm(&x.cpu, &w.cpu, 1e-6).unwrap(), 1e-5, "rms_norm");
    }
    for (rows, heads, d, start) in [(1, 32, 128, 4000), (9, 8, 64, 0), (3, 2, 96, 17)] {
        let inv_freq = (0..d / 2).map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / d as f32)).collect();
        let rope = Rope { head_dim: d, inv_freq };
        let mut x = pair(&g, rows, heads * d, random(&mut rng, rows * heads * d, 1.0));
        g.rope(&mut x.gpu, &rope, start).unwrap();
        c.rope(&mut x.cpu, &rope, start).unwrap();
        check(&g, &x.gpu, &x.cpu, 1e-4, "rope");
        // The fused q/k norm + rope, with and without the norm.
        let w = pair(&g, 1, d, random(&mut rng, d, 1.5));
        for norm in [Some(&w), None] {
            let mut y = pair(&g, rows, heads * d, random(&mut rng, rows * heads * d, 2.0));
            g.norm_rope(&mut y.gpu, norm.map(|n| &n.gpu), 1e-6, &rope, start).unwrap();
            c.norm_rope(&mut y.cpu, norm.map(|n| &n.cpu), 1e-6, &rope, start).unwrap();
            check(&g, &y.gpu, &y.cpu, 1e-4, "norm_rope");
        }
    }
}

#[test]
fn embedding_linear_and_argmax() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(2);
    let table = bf16_matrix(&mut rng, 300, 256);
    let tokens = [0u32, 299, 5, 5, 123];
    let want = c.embed(&(Box::new(table.clone()) as Box<dyn QuantMatrix>), &tokens).unwrap();
    let gw = g.upload_weight(Box::new(table)).unwrap();
    check(&g, &g.embed(&gw, &tokens).unwrap(), &want, 0.0, "embed");
    assert!(g.embed(&gw, &[300]).is_err(), "out-of-vocabulary id must be refused");

    // Each weight format through the one-token GEMV (T = 1), the few-token GEMV (T <= 8, bf16)
    // and the tiled GEMM (larger T, ragged K), with and without bias. K = 25600 (Qwen3-32B's down
    // projection) stages more than 48 KB of input in the fp8 GEMV. N % 128 == 0 and K % 64 == 0
    // take the wgmma GEMM on Hopper (T = 256, 200, 131, 32: whole and partial token tiles, K = 64
    // a single step; from 256 tokens an fp8 weight is decoded to bf16 first: T = 256, 300).
    let shapes = [(1, 4096, 4096, false), (3, 1000, 512, true), (8, 77, 64, false), (37, 300, 200, true), (130, 129, 520, false), (2, 10, 12, true), (256, 384, 1024, true), (1, 300, 1040, true), (300, 1000, 4096, false), (9, 64, 64, true), (1, 40, 25600, false), (200, 512, 640, true), (131, 1024, 2048, false), (300, 256, 576, true), (32, 256, 64, true)];
    for fp8 in [false, true] {
        for (t, n, k, with_bias) in shapes {
            let (cw, gw) = matrix_pair(&mut rng, fp8, n, k);
            let x = pair(&g, t, k, random(&mut rng, t * k, 1.0));
            let bias = with_bias.then(|| pair(&g, 1, n, random(&mut rng, n, 0.5)));
            let want = c.linear(&x.cpu, &cw, bias.as_ref().map(|b| &b.cpu)).unwrap();
            let gw = g.upload_weight(gw).unwrap();
            let got = g.linear(&x.gpu, &gw, bias.as_ref().map(|b| &b.gpu)).unwrap();
            // bf16 decode keeps activations in f32, fp8 decode feeds them to the matrix cores as
            // f16 (11-bit significands); prefill feeds them (and fp8 weights) as bf16.
            let decode = t == 1 && k % 16 == 0 || !fp8 && t <= 8 && k % 8 == 0;
            let tol = match (decode, fp8) {
                (true, false) => 1e-4,
                (true, true) => 2e-3,
                (false, _) => 1e-2,
            };
            let what = format!("linear {} T={t} N={n} K={k}", if fp8 { "fp8" } else { "bf16" });
            check(&g, &got, &want, tol, &what);
            // The same product added into a residual stream.
            let mut res = pair(&g, t, n, random(&mut rng, t * n, 1.0));
            g.linear_add(&x.gpu, &gw, bias.as_ref().map(|b| &b.gpu), &mut res.gpu).unwrap();
            c.add_assign(&mut res.cpu, &want).unwrap();
            check(&g, &res.gpu, &res.cpu, tol, &format!("{what} + residual"));
        }
    }

    // The norm fused into the products of q, k and v, and into the gated MLP's first half, against
    // the CPU's composition; decode (fused) and prefill shapes, both formats.
    for fp8 in [false, true] {
        for (t, n, k) in [(1, 1024, 4096), (1, 96, 64), (5, 64, 128), (20, 256, 256)] {
            let x = pair(&g, t, k, random(&mut rng, t * k, 2.0));
            let norm = pair(&g, 1, k, random(&mut rng, k, 1.5));
            let bias = pair(&g, 1, n, random(&mut rng, n, 0.5));
            let tol = match (t, fp8) {
                (1, false) => 1e-4,
                (1, true) => 2e-3,
                _ => 1e-2,
            };
            let what = format!("{} T={t} N={n} K={k}", if fp8 { "fp8" } else { "bf16" });

            // q, k, v; then four (one launch) and five (two launches) projections, the last two
            // of a DeltaNet layer's few rows (its b and a).
            let ws: Vec<_> = [n, n / 4, n / 4, 3, 5]
                .iter()
                .map(|&rows| {
                    let (cw, gw) = matrix_pair(&mut rng, fp8, rows, k);
                    (cw, g.upload_weight(gw).unwrap())
                })
                .collect();
            // A bias on the second projection only (Qwen2-style k bias).
            let kb = pair(&g, 1, n / 4, random(&mut rng, n / 4, 0.5));
            let cp = |i: usize| Proj::<CpuBackend> { weight: &ws[i].0, bias: (i == 1).then_some(&kb.cpu) };
            let gp = |i: usize| Proj::<GpuBackend> { weight: &ws[i].1, bias: (i == 1).then_some(&kb.gpu) };
            let want = c.norm_linears(&x.cpu, &norm.cpu, 1e-6, [cp(0), cp(1), cp(2)]).unwrap();
            let got = g.norm_linears(&x.gpu, &norm.gpu, 1e-6, [gp(0), gp(1), gp(2)]).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                check(&g, a, b, tol, &format!("norm_linears[{i}] {what}"));
            }
            let want = c.norm_linears(&x.cpu, &norm.cpu, 1e-6, [cp(0), cp(1), cp(2), cp(3)]).unwrap();
            let got = g.norm_linears(&x.gpu, &norm.gpu, 1e-6, [gp(0), gp(1), gp(2), gp(3)]).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                check(&g, a, b, tol, &format!("norm_linears of four [{i}] {what}"));
            }
            let want = c.norm_linears(&x.cpu, &norm.cpu, 1e-6, [cp(0), cp(1), cp(2), cp(3), cp(4)]).unwrap();
            let got = g.norm_linears(&x.gpu, &norm.gpu, 1e-6, [gp(0), gp(1), gp(2), gp(3), gp(4)]).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                check(&g, a, b, tol, &format!("norm_linears of five [{i}] {what}"));
            }

            let (gate, up) = (matrix_pair(&mut rng, fp8, n, k), matrix_pair(&mut rng, fp8, n, k));
            let (ggate, gup) = (g.upload_weight(gate.1).unwrap(), g.upload_weight(up.1).unwrap());
            let want = c
                .norm_silu_gate_up(&x.cpu, &norm.cpu, 1e-6, Proj { weight: &gate.0, bias: Some(&bias.cpu) }, Proj { weight: &up.0, bias: None })
                .unwrap();
            let got = g
                .norm_silu_gate_up(&x.gpu, &norm.gpu, 1e-6, Proj { weight: &ggate, bias: Some(&bias.gpu) }, Proj { weight: &gup, bias: None })
                .unwrap();
            check(&g, &got, &want, tol, &format!("norm_silu_gate_up {what}"));
        }
    }

    // Embedding rows of an fp8 table.
    let (ct, gt) = matrix_pair(&mut rng, true, 300, 256);
    let gt = g.upload_weight(gt).unwrap();
    check(&g, &g.embed(&gt, &tokens).unwrap(), &c.embed(&ct, &tokens).unwrap(), 1e-6, "embed fp8");

    let logits = random(&mut rng, 151_936, 5.0);
    let best = atlas::sampling::argmax(&logits);
    let t = g.upload_f32(1, logits.len(), &logits).unwrap();
    assert_eq!(g.argmax(&t, usize::MAX).unwrap(), best);
    let limited = atlas::sampling::argmax(&logits[..1000]);
    assert_eq!(g.argmax(&t, 1000).unwrap(), limited);
    // Rows of a batched step, more than one launch takes (8): each row its own choice, ties to
    // the lower id (rounded values repeat), with and without a limit.
    let (rows, vocab) = (11, 50_000);
    let mut batch = random(&mut rng, rows * vocab, 5.0);
    batch.iter_mut().step_by(3).for_each(|v| *v = v.round());
    let bt = g.upload_f32(rows, vocab, &batch).unwrap();
    for limit in [usize::MAX, 777] {
        let want: Vec<u32> = batch.chunks(vocab).map(|row| atlas::sampling::argmax(&row[..limit.min(vocab)])).collect();
        assert_eq!(g.argmax_rows(&bt, limit).unwrap(), want, "argmax_rows, limit {limit}");
    }

    // Top-k candidates for sampling: exact, ordered by value then id, with ties and a limit.
    let mut tied = random(&mut rng, 151_936, 5.0);
    tied.iter_mut().step_by(7).for_each(|v| *v = v.round());
    let tt = g.upload_f32(1, tied.len(), &tied).unwrap();
    for (values, t, k, limit) in [(&logits, &t, 64, usize::MAX), (&logits, &t, 20, 151_669), (&tied, &tt, 64, usize::MAX), (&tied, &tt, 1, 5000)] {
        let want = atlas::sampling::top_k(values, k, limit);
        for _ in 0..3 {
            assert_eq!(g.top_k(t, k, limit).unwrap(), want, "top_k k={k} limit={limit}");
        }
    }

    // The log-partition beside the candidates (top-p / min-p cuts and logprobs from them), against
    // the f64 reference; the same bits at every launch.
    for (values, t) in [(&logits, &t), (&tied, &tt)] {
        for (temperature, limit) in [(1.0, usize::MAX), (0.7, 151_669), (1.5, 5000)] {
            let want = atlas::sampling::LogPartition::of(values, limit, temperature);
            let got = g.log_partition(t, limit, temperature).unwrap();
            let close = |a: f32, b: f32| (a - b).abs() < 1e-4 * b.abs().max(1.0);
            assert!(close(got.at_temperature, want.at_temperature) && close(got.raw, want.raw), "log_partition T={temperature} limit={limit}: {got:?} vs {want:?}");
            assert_eq!(g.log_partition(t, limit, temperature).unwrap(), got);
        }
    }
}

/// A token's row of a prefill product does not depend on how many tokens share the launch. On
/// Hopper, 131 tokens of 12,288 rows take the square 128 x 128 wgmma tiles (96 of them, fewer than
/// the SMs), 300 tokens the wide 128 x 256 ones (gemm_wg_bf16_wide: 144 tiles; an FP8 weight is
/// decoded per tile below 256 tokens, widened to bf16 from there). Each row of the first 131 must
/// keep its bits, and both stay within bf16 rounding of the CPU.
#[test]
fn prefill_rows_keep_their_bits_whatever_the_tile() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(21);
    let (n, k) = (12_288, 512);
    for fp8 in [false, true] {
        let (cw, gw) = matrix_pair(&mut rng, fp8, n, k);
        let gw = g.upload_weight(gw).unwrap();
        let bias = pair(&g, 1, n, random(&mut rng, n, 0.5));
        let x = random(&mut rng, 300 * k, 1.0);
        let what = if fp8 { "fp8" } else { "bf16" };
        let mut outputs = Vec::new();
        for t in [131, 300] {
            let x = pair(&g, t, k, x[..t * k].to_vec());
            poison(&g, t, n);
            let got = g.linear(&x.gpu, &gw, Some(&bias.gpu)).unwrap();
            let want = c.linear(&x.cpu, &cw, Some(&bias.cpu)).unwrap();
            check(&g, &got, &want, 1e-2, &format!("linear {what} T={t} N={n} K={k}"));
            outputs.push(g.to_host(&got).unwrap());
        }
        let differ = differing_bits(&outputs[0], &outputs[1]);
        assert_eq!(differ, 0, "{what}: {differ} of the first 131 tokens' outputs changed with 300 tokens in the launch");

        // The MLP's first half: 100 tokens take two GEMMs (square tiles) and silu_mul, 300 one
        // GEMM whose tiles pair gate and up rows (gemm_wg_*_gate_up).
        let (gate, up) = (matrix_pair(&mut rng, fp8, n, k), matrix_pair(&mut rng, fp8, n, k));
        let (ggate, gup) = (g.upload_weight(gate.1).unwrap(), g.upload_weight(up.1).unwrap());
        let norm = pair(&g, 1, k, random(&mut rng, k, 1.5));
        let up_bias = pair(&g, 1, n, random(&mut rng, n, 0.5));
        let mut outputs = Vec::new();
        for t in [100, 300] {
            let x = pair(&g, t, k, x[..t * k].to_vec());
            poison(&g, t, n);
            let (gp, up_p) = (Proj { weight: &ggate, bias: None }, Proj { weight: &gup, bias: Some(&up_bias.gpu) });
            let got = g.norm_silu_gate_up(&x.gpu, &norm.gpu, 1e-6, gp, up_p).unwrap();
            let (gp, up_p) = (Proj { weight: &gate.0, bias: None }, Proj { weight: &up.0, bias: Some(&up_bias.cpu) });
            let want = c.norm_silu_gate_up(&x.cpu, &norm.cpu, 1e-6, gp, up_p).unwrap();
            check(&g, &got, &want, 1e-2, &format!("norm_silu_gate_up {what} T={t} N={n} K={k}"));
            outputs.push(g.to_host(&got).unwrap());
        }
        let differ = differing_bits(&outputs[0], &outputs[1]);
        assert_eq!(differ, 0, "{what}: {differ} of the first 100 tokens' gated products changed with 300 tokens in the launch");
    }
}

/// How many values of `fewer` (the outputs of the first tokens alone) differ in their bits from
/// the same positions of `more`.
fn differing_bits(fewer: &[f32], more: &[f32]) -> usize {
    fewer.iter().zip(more).filter(|(a, b)| a.to_bits() != b.to_bits()).count()
}

#[test]
fn attention_prefill_then_decode() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(3);
    // Group sizes 1 to 16, head sizes 16 to 256 (flash-attention prefill, grouped decode), a
    // group of 32 whose decode rows take the flash-attention kernel, and heads the kernels pad:
    // not a multiple of 16 (24, 40, 200), of 8 (20: no 16-byte loads) or of 4 (18: nor float4).
    let padded = [(4, 2, 24), (6, 3, 40), (8, 2, 200), (4, 1, 20), (2, 1, 18)];
    for (heads, kv_heads, d) in [(8, 2, 64), (32, 8, 128), (4, 4, 32), (16, 1, 128), (8, 1, 256), (4, 2, 16), (6, 3, 80), (4, 1, 144), (32, 1, 64)].into_iter().chain(padded) {
        let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d };
        let (mut gc, mut cc) = (gkv(&g, kv_heads * d), ckv(&c, kv_heads * d));
        let mut pos = 0;
        // A long prefill (several tiles and decode splits), a continuation after cached context,
        // then single-token decodes.
        for t in [600, 70, 1, 1, 1] {
            let q = pair(&g, t, heads * d, random(&mut rng, t * heads * d, 1.0));
            let k = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let v = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let got = g.attention(&q.gpu, &k.gpu, &v.gpu, &mut gc, pos, shape).unwrap();
            let want = c.attention(&q.cpu, &k.cpu, &v.cpu, &mut cc, pos, shape).unwrap();
            check(&g, &got, &want, 2e-2, &format!("attention heads {heads}/{kv_heads} d {d} T {t} at {pos}"));
            pos += t;
        }
    }
    // The fused q/k norm + rope + append before attention, against the CPU's separate steps.
    for (heads, kv_heads, d, with_norm) in [(32, 8, 128, true), (4, 1, 16, false), (6, 2, 24, true), (4, 2, 18, true)] {
        let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d };
        let inv_freq = (0..d / 2).map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / d as f32)).collect();
        let rope = Rope { head_dim: d, inv_freq };
        let qn = pair(&g, 1, d, random(&mut rng, d, 1.5));
        let kn = pair(&g, 1, d, random(&mut rng, d, 1.5));
        let (mut gc, mut cc) = (gkv(&g, kv_heads * d), ckv(&c, kv_heads * d));
        let mut pos = 0;
        for t in [300, 1, 1] {
            let q = pair(&g, t, heads * d, random(&mut rng, t * heads * d, 1.0));
            let k = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let v = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let gn = QkNorms { q: with_norm.then_some(&qn.gpu), k: with_norm.then_some(&kn.gpu), eps: 1e-6 };
            let cn = QkNorms { q: with_norm.then_some(&qn.cpu), k: with_norm.then_some(&kn.cpu), eps: 1e-6 };
            let got = g.rotary_attention(q.gpu, k.gpu, &v.gpu, gn, &rope, &mut gc, pos, shape).unwrap();
            let want = c.rotary_attention(q.cpu, k.cpu, &v.cpu, cn, &rope, &mut cc, pos, shape).unwrap();
            check(&g, &got, &want, 2e-2, &format!("rotary_attention heads {heads}/{kv_heads} d {d} T {t} at {pos}"));
            pos += t;
        }
    }
}

/// Saving pieces of several caches and restoring them all in one call (the prefix cache's path)
/// gives back the caches bit for bit: attention over the restored copies equals attention over
/// the originals exactly. One width's rows are 36 bytes, so its spans take the 2-byte copy.
#[test]
fn caches_saved_in_pieces_and_restored_together_are_the_same_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(12);
    let shapes = [AttentionShape { num_heads: 8, num_kv_heads: 2, head_dim: 64 }, AttentionShape { num_heads: 2, num_kv_heads: 1, head_dim: 18 }];
    let filled = 37;
    let mut live: Vec<_> = shapes.iter().map(|s| gkv(&g, s.num_kv_heads * s.head_dim)).collect();
    for (cache, s) in live.iter_mut().zip(&shapes) {
        let q = g.upload_f32(filled, s.num_heads * s.head_dim, &random(&mut rng, filled * s.num_heads * s.head_dim, 1.0)).unwrap();
        let k = g.upload_f32(filled, s.num_kv_heads * s.head_dim, &random(&mut rng, filled * s.num_kv_heads * s.head_dim, 1.0)).unwrap();
        let v = g.upload_f32(filled, s.num_kv_heads * s.head_dim, &random(&mut rng, filled * s.num_kv_heads * s.head_dim, 1.0)).unwrap();
        g.attention(&q, &k, &v, cache, 0, *s).unwrap();
    }
    let bounds = [(0, 16), (16, 16), (32, 5)];
    let pieces: Vec<Vec<_>> = bounds.iter().map(|&(start, len)| g.save_kv(&live.iter().collect::<Vec<_>>(), start, len).unwrap()).collect();
    let mut restored: Vec<_> = shapes.iter().map(|s| gkv(&g, s.num_kv_heads * s.head_dim)).collect();
    let mut restores: Vec<_> = restored
        .iter_mut()
        .enumerate()
        .map(|(layer, cache)| KvRestore { cache, pieces: pieces.iter().zip(&bounds).map(|(saved, &(start, _))| (&saved[layer], start)).collect() })
        .collect();
    g.restore_kv(&mut restores).unwrap();
    for ((a, b), s) in live.iter_mut().zip(&mut restored).zip(&shapes) {
        let q = g.upload_f32(1, s.num_heads * s.head_dim, &random(&mut rng, s.num_heads * s.head_dim, 1.0)).unwrap();
        let k = g.upload_f32(1, s.num_kv_heads * s.head_dim, &random(&mut rng, s.num_kv_heads * s.head_dim, 1.0)).unwrap();
        let v = g.upload_f32(1, s.num_kv_heads * s.head_dim, &random(&mut rng, s.num_kv_heads * s.head_dim, 1.0)).unwrap();
        let want = g.to_host(&g.attention(&q, &k, &v, a, filled, *s).unwrap()).unwrap();
        let got = g.to_host(&g.attention(&q, &k, &v, b, filled, *s).unwrap()).unwrap();
        assert_eq!(got, want, "head_dim {}", s.head_dim);
    }
}

#[test]
fn attention_of_several_sequences_in_one_pass_gives_each_its_own_bits() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(17);
    // Contexts from one position to several decode splits (256 positions each), every group
    // size the decode kernel takes, heads it pads (144).
    let contexts = [1usize, 40, 300, 777, 1100];
    for (heads, kv_heads, d) in [(32, 8, 128), (8, 2, 64), (16, 1, 256), (4, 1, 144), (40, 8, 128)] {
        let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d };
        let rope = Rope { head_dim: d, inv_freq: (0..d / 2).map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / d as f32)).collect() };
        let (qn, kn) = (pair(&g, 1, d, random(&mut rng, d, 1.5)), pair(&g, 1, d, random(&mut rng, d, 1.5)));
        let gn = QkNorms { q: Some(&qn.gpu), k: Some(&kn.gpu), eps: 1e-6 };
        let cn = QkNorms { q: Some(&qn.cpu), k: Some(&kn.cpu), eps: 1e-6 };
        // Each sequence's prompt into three caches: batched, alone (GPU) and the CPU's.
        let mut batched = Vec::new();
        let mut alone = Vec::new();
        let mut host = Vec::new();
        for &len in &contexts {
            let q = random(&mut rng, len * heads * d, 1.0);
            let k = random(&mut rng, len * kv_heads * d, 1.0);
            let v = random(&mut rng, len * kv_heads * d, 1.0);
            let mut caches = [gkv(&g, kv_heads * d), gkv(&g, kv_heads * d)];
            for cache in &mut caches {
                let (qg, kg, vg) = (g.upload_f32(len, heads * d, &q).unwrap(), g.upload_f32(len, kv_heads * d, &k).unwrap(), g.upload_f32(len, kv_heads * d, &v).unwrap());
                g.rotary_attention(qg, kg, &vg, gn, &rope, cache, 0, shape).unwrap();
            }
            let [b, a] = caches;
            batched.push(b);
            alone.push(a);
            let mut cc = ckv(&c, kv_heads * d);
            c.rotary_attention(CpuTensor::new(len, heads * d, q), CpuTensor::new(len, kv_heads * d, k), &CpuTensor::new(len, kv_heads * d, v), cn, &rope, &mut cc, 0, shape).unwrap();
            host.push(cc);
        }
        // Two steps, so that the second reads what the first appended to each cache.
        let n = contexts.len();
        for step in 0..2 {
            let positions: Vec<usize> = contexts.iter().map(|&len| len + step).collect();
            let q = pair(&g, n, heads * d, random(&mut rng, n * heads * d, 1.0));
            let k = pair(&g, n, kv_heads * d, random(&mut rng, n * kv_heads * d, 1.0));
            let v = pair(&g, n, kv_heads * d, random(&mut rng, n * kv_heads * d, 1.0));
            let what = format!("{n} sequences, heads {heads}/{kv_heads} d {d}, step {step}");
            poison(&g, n, heads * d);
            let mut refs: Vec<&mut _> = batched.iter_mut().collect();
            let q_copy = g.upload_f32(n, heads * d, &g.to_host(&q.gpu).unwrap()).unwrap();
            let k_copy = g.upload_f32(n, kv_heads * d, &g.to_host(&k.gpu).unwrap()).unwrap();
            let got = g.rotary_attention_rows(q_copy, k_copy, &v.gpu, gn, &rope, &mut refs, &positions, shape).unwrap();
            let got = g.to_host(&got).unwrap();
            for (i, ((cache, host_cache), &pos)) in alone.iter_mut().zip(host.iter_mut()).zip(&positions).enumerate() {
                let row = |t: &GpuTensor, cols| g.upload_f32(1, cols, &g.to_host(t).unwrap()[i * cols..(i + 1) * cols]).unwrap();
                let one = g.rotary_attention(row(&q.gpu, heads * d), row(&k.gpu, kv_heads * d), &row(&v.gpu, kv_heads * d), gn, &rope, cache, pos, shape).unwrap();
                let one = g.to_host(&one).unwrap();
                let mine = &got[i * heads * d..(i + 1) * heads * d];
                assert!(one.iter().zip(mine).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: sequence {i} (at {pos}) differs from its step alone");
                let want = c.rotary_attention(rows(&q.cpu, i, i + 1), rows(&k.cpu, i, i + 1), &rows(&v.cpu, i, i + 1), cn, &rope, host_cache, pos, shape).unwrap();
                let gpu_row = g.upload_f32(1, heads * d, mine).unwrap();
                check(&g, &gpu_row, &want, 2e-2, &format!("{what}: sequence {i} against the CPU"));
            }
        }
    }
}

/// Greedy generation of `max_tokens` tokens, end-of-sequence ignored.
fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens: Some(max_tokens), sampling: Default::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
}

fn fixture(name: &str) -> PathBuf {
    // The test binary may run on another machine, from the repository root.
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let root = if built.exists() { built } else { std::env::current_dir().unwrap() };
    root.join("tests/fixtures/models").join(name)
}

#[test]
fn fixture_models_match_the_cpu() {
    if gpu().is_none() {
        return;
    }
    // The FP8 fixture's greedy margins are below bf16 rounding (its weights are coarse): logits only.
    for (name, check_greedy) in [("qwen3_tied", true), ("qwen3_untied_gqa", true), ("llama", true), ("qwen3_fp8", false)] {
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap();
        let ids = |k: &str| -> Vec<u32> { golden[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
        let load = |device| Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
        let (mut on_gpu, mut on_cpu) = (load(Device::Cuda), load(Device::Cpu));
        assert!(on_gpu.report().device.starts_with("cuda"), "{}", on_gpu.report().device);
        let want = on_cpu.logits(&ids("tokens")).unwrap();
        let got = on_gpu.logits(&ids("tokens")).unwrap();
        let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref;
        println!("{name}: GPU vs CPU logits relative error {err:.2e}");
        assert!(err < 2e-2, "{name}: relative error {err}");
        let req = greedy(ids("tokens"), 16);
        // Decode steps after the first are replays of a recorded graph: same tokens as transformers.
        let gen = on_gpu.generate_raw(&req).unwrap();
        if check_greedy {
            assert_eq!(gen.tokens, ids("greedy"), "{name}: greedy tokens on the GPU");
        }
        // And a replayed step's logits match the CPU's at the same position.
        let mut history = ids("tokens");
        history.extend_from_slice(&gen.tokens[..15]);
        on_cpu.logits(&history).unwrap();
        let pos = history.len();
        let want = on_cpu.forward(&[gen.tokens[15]], pos).unwrap();
        let got = on_gpu.forward(&[gen.tokens[15]], pos).unwrap();
        let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref;
        assert!(err < 2e-2, "{name}: replayed decode step, relative error {err}");
    }
}

#[test]
fn every_positions_logits_in_one_pass_match_the_cpu() {
    if gpu().is_none() {
        return;
    }
    // atlas perplexity / kld score a chunk from one pass (StepOutput::AllLogits): the GPU's
    // [T, vocab] logits against the CPU's, and the perplexity from them, for a dense and a hybrid
    // fixture (bf16 weights on the GPU: 2e-2 of the largest logit, 1 % of the perplexity; 4e-2
    // for the hybrid fixture, whose logits move that much with its GEMM inputs rounded to bf16:
    // see hybrid_fixture_models_match_the_goldens_and_the_cpu. Measured with the wgmma GEMM on
    // the H200: 2.6e-2).
    for (name, bound) in [("qwen3_tied", 2e-2), ("qwen3_5_tiny", 4e-2)] {
        let tokens: Vec<u32> = (0..32u32).map(|i| (i * 37 + 11) % 256).collect();
        let mut scores = Vec::new();
        let mut all = Vec::new();
        for device in [Device::Cpu, Device::Cuda] {
            let mut engine = Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
            all.push(engine.logits_all(&tokens).unwrap());
            scores.push(atlas::eval::perplexity(&mut engine, &tokens, 16, 2, &mut |_, _| {}).unwrap().value());
        }
        let max_ref = all[0].iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = all[1].iter().zip(&all[0]).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref;
        println!("{name}: every position's logits, relative error {err:.2e}; perplexity {} on the GPU, {} on the CPU", scores[1], scores[0]);
        assert!(all[0].len() == all[1].len() && err < bound, "{name}: every position's logits, relative error {err}");
        assert!((scores[1] - scores[0]).abs() < 0.01 * scores[0], "{name}: perplexity {} on the GPU, {} on the CPU", scores[1], scores[0]);
    }
}

#[test]
fn top_k_sampling_on_the_device_is_reproducible() {
    if gpu().is_none() {
        return;
    }
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_tied").join("golden.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = golden["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let mut engine = Engine::load(&EngineOptions { device: Device::Cuda, ..EngineOptions::new(fixture("qwen3_tied")) }, &mut |_| {}).unwrap();
    let sampling = atlas::sampling::SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.95, seed: Some(7), ..Default::default() };
    let req = GenerateRequest { prompt, max_tokens: Some(24), sampling, stop: vec![], ignore_eos: true, grammar: None, logprobs: None };
    // Steps after the first replay the recorded graph, then select the candidates on the device.
    let first = engine.generate_raw(&req).unwrap().tokens;
    assert_eq!(first.len(), 24);
    assert_eq!(engine.generate_raw(&req).unwrap().tokens, first, "same seed, same tokens");
    let other = GenerateRequest { sampling: atlas::sampling::SamplingParams { seed: Some(8), ..req.sampling.clone() }, ..req.clone() };
    assert_ne!(engine.generate_raw(&other).unwrap().tokens, first, "another seed draws differently");
    // Top-p or min-p without top-k: the 64 best and the log-partition come back (every logit only
    // when the cut falls past them); greedy with logprobs: the candidates and the log-partition.
    for sampling in [
        atlas::sampling::SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(7), ..Default::default() },
        atlas::sampling::SamplingParams { temperature: 1.0, min_p: 0.1, seed: Some(7), ..Default::default() },
    ] {
        let req = GenerateRequest { sampling, ..req.clone() };
        let first = engine.generate_raw(&req).unwrap().tokens;
        assert_eq!(engine.generate_raw(&req).unwrap().tokens, first, "{:?}: same seed, same tokens", req.sampling);
    }
    // Plain temperature (a draw over every logit on the device) and penalties (the adjustments
    // sent to the device as the output grows): seeded, reproducible; recorded steps and the
    // first (prefill) step take the same path.
    for sampling in [
        atlas::sampling::SamplingParams { temperature: 0.9, seed: Some(7), ..Default::default() },
        atlas::sampling::SamplingParams { temperature: 0.9, repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.3, seed: Some(7), ..Default::default() },
        atlas::sampling::SamplingParams { temperature: 0.0, repetition_penalty: 1.5, frequency_penalty: 0.5, ..Default::default() },
    ] {
        let req = GenerateRequest { sampling, ..req.clone() };
        let first = engine.generate_raw(&req).unwrap().tokens;
        assert_eq!(engine.generate_raw(&req).unwrap().tokens, first, "{:?}: same seed, same tokens", req.sampling);
    }
    // Greedy with strong penalties repeats no token where plain greedy repeats.
    let penalised = GenerateRequest { sampling: atlas::sampling::SamplingParams { repetition_penalty: 100.0, ..Default::default() }, ..req.clone() };
    let tokens = engine.generate_raw(&penalised).unwrap().tokens;
    let distinct: std::collections::HashSet<_> = tokens.iter().collect();
    assert_eq!(distinct.len(), tokens.len(), "repetition penalty 100 on the device: {tokens:?}");
    let greedy = GenerateRequest { sampling: Default::default(), logprobs: Some(5), ..req.clone() };
    let plain = engine.generate_raw(&GenerateRequest { logprobs: None, ..greedy.clone() }).unwrap();
    let with_logprobs = engine.generate_raw(&greedy).unwrap();
    assert_eq!(with_logprobs.tokens, plain.tokens, "logprobs leave the greedy choice alone");
    for (lp, &token) in with_logprobs.logprobs.iter().zip(&with_logprobs.tokens) {
        assert!(lp.token == token && lp.top.len() == 5 && lp.top[0].0 == token && lp.logprob <= 0.0, "{lp:?}");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1) && (lp.top[0].1 - lp.logprob).abs() < 1e-6);
    }
}

#[test]
fn token_masks_restrict_argmax_and_top_k_as_on_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(40);
    let n = 5000;
    let logits = pair(&g, 1, n, random(&mut rng, n, 4.0));
    // Masks of a few, many and one allowed id; the last word covers ids past n (never chosen).
    for allowed in [0.01, 0.5, 0.0] {
        let mut mask = vec![0u32; n.div_ceil(32) + 1];
        for i in 0..n {
            if rng.next_f64() < allowed {
                mask[i / 32] |= 1 << (i % 32);
            }
        }
        mask[4000 / 32] |= 1 << (4000 % 32);
        g.set_token_mask(Some(&mask)).unwrap();
        c.set_token_mask(Some(&mask)).unwrap();
        for limit in [n, 4500] {
            let want = c.argmax(&logits.cpu, limit).unwrap();
            assert_eq!(g.argmax(&logits.gpu, limit).unwrap(), want, "argmax, {allowed} allowed, limit {limit}");
            assert!(mask[want as usize / 32] >> (want % 32) & 1 == 1);
            let top_c: Vec<_> = c.top_k(&logits.cpu, 20, limit).unwrap().into_iter().filter(|t| t.1.is_finite()).collect();
            assert_eq!(g.top_k(&logits.gpu, 20, limit).unwrap(), top_c, "top_k, {allowed} allowed, limit {limit}");
            let (zc, zg) = (c.log_partition(&logits.cpu, limit, 0.8).unwrap(), g.log_partition(&logits.gpu, limit, 0.8).unwrap());
            assert!((zc.at_temperature - zg.at_temperature).abs() < 1e-4 && (zc.raw - zg.raw).abs() < 1e-4, "log_partition, {allowed} allowed: {zg:?} vs {zc:?}");
        }
    }
    // No mask: the plain argmax again.
    g.set_token_mask(None).unwrap();
    c.set_token_mask(None).unwrap();
    assert_eq!(g.argmax(&logits.gpu, n).unwrap(), c.argmax(&logits.cpu, n).unwrap());
    assert!(g.set_token_mask(Some(&[])).is_err(), "an empty mask allows nothing");
    // Logit adjustments (a request's logit_bias and penalties), with and without a mask: the
    // same f32 operations, so the same bits; a longer list regrows the device's; none again
    // restores the plain choice.
    let plain = c.argmax(&logits.cpu, n).unwrap();
    let adjust = |id: u32, bias: f32, repetition: f32, subtract: f32| Adjustment { id, bias, repetition, subtract };
    let long: Vec<Adjustment> = (0..300).map(|i| adjust(i * 13, if i % 2 == 0 { 9.0 } else { -9.0 }, 1.0 + (i % 3) as f32 * 0.3, (i % 5) as f32 * 0.7)).collect();
    for list in [vec![adjust(plain, -100.0, 1.0, 0.0), adjust(17, 30.0, 1.0, 0.0)], vec![adjust(plain, 0.0, 1.3, 0.4), adjust(5, 0.0, 1.3, 0.0)], long] {
        g.set_logit_adjustments(&list).unwrap();
        c.set_logit_adjustments(&list).unwrap();
        let fresh = pair(&g, 1, n, logits.cpu.data.clone());
        let want = c.argmax(&fresh.cpu, n).unwrap();
        assert_eq!(g.argmax(&fresh.gpu, n).unwrap(), want, "argmax with {} adjustments", list.len());
        assert_eq!(g.chosen_logits(&fresh.gpu).unwrap(), c.chosen_logits(&fresh.cpu).unwrap(), "adjusted logits, {} entries", list.len());
        let fresh = pair(&g, 1, n, logits.cpu.data.clone());
        assert_eq!(g.top_k(&fresh.gpu, 20, n).unwrap(), c.top_k(&fresh.cpu, 20, n).unwrap(), "top_k with {} adjustments", list.len());
    }
    g.set_logit_adjustments(&[]).unwrap();
    c.set_logit_adjustments(&[]).unwrap();
    let fresh = pair(&g, 1, n, logits.cpu.data.clone());
    assert_eq!(g.argmax(&fresh.gpu, n).unwrap(), plain);
}

/// Each id's interval [lo, hi) of the in-order cumulative distribution (softmax at `temperature`
/// of the first `limit` values, f64): u in [0, 1) picks the id whose interval holds it.
fn cdf_intervals(values: &[f32], limit: usize, temperature: f32) -> Vec<(f64, f64)> {
    let v = &values[..limit];
    let max = v.iter().filter(|x| x.is_finite()).fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let w: Vec<f64> = v.iter().map(|&x| if x.is_finite() { ((x as f64 - max) / temperature as f64).exp() } else { 0.0 }).collect();
    let total: f64 = w.iter().sum();
    let mut cum = 0.0;
    w.iter().map(|x| {
        let lo = cum;
        cum += x / total;
        (lo, cum)
    }).collect()
}

#[test]
fn plain_temperature_draws_on_the_device_follow_the_reference() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(41);
    // A vocabulary of Qwen3's size and a small one (fewer ids than threads), masked and not.
    for (n, limit) in [(151_936, 151_665), (300, 300), (5000, 4500)] {
        let mut values = random(&mut rng, n, 6.0);
        values[n / 3] = f32::NEG_INFINITY;
        let logits = pair(&g, 1, n, values.clone());
        let mut mask = vec![0u32; n.div_ceil(32)];
        for i in 0..n {
            if rng.next_f64() < 0.3 {
                mask[i / 32] |= 1 << (i % 32);
            }
        }
        for masked in [false, true] {
            let m = masked.then_some(mask.as_slice());
            g.set_token_mask(m).unwrap();
            c.set_token_mask(m).unwrap();
            let seen = c.chosen_logits(&logits.cpu).unwrap();
            for temperature in [0.7f32, 1.0, 1.6] {
                let intervals = cdf_intervals(&seen, limit, temperature);
                // Where u falls within f32 rounding of a boundary, the device's sums may pick the
                // neighbour: its id must then still hold u within that rounding.
                let margin = 1e-5;
                let mut exact = 0;
                for _ in 0..200 {
                    let u = rng.next_f32();
                    let got = g.draw(&logits.gpu, limit, temperature, u).unwrap();
                    assert_eq!(g.draw(&logits.gpu, limit, temperature, u).unwrap(), got, "the same draw twice");
                    assert!((got as usize) < limit && seen[got as usize].is_finite(), "drew {got}, which is not allowed");
                    let (lo, hi) = intervals[got as usize];
                    let u64 = u as f64;
                    assert!(u64 >= lo - margin && u64 < hi + margin, "n {n} masked {masked} T {temperature} u {u}: drew {got} of [{lo}, {hi})");
                    let want = c.draw(&logits.cpu, limit, temperature, u).unwrap();
                    if u64 - lo > margin && hi - u64 > margin {
                        assert_eq!(got, want, "n {n} masked {masked} T {temperature} u {u}");
                        exact += 1;
                    }
                }
                // Small vocabularies have wide intervals: most draws are far from a boundary.
                assert!(n > 5000 || exact > 150, "{exact} draws away from a boundary");
            }
        }
    }
    g.set_token_mask(None).unwrap();
    // Nothing allowed: id 0, as the reference.
    let none = pair(&g, 1, 64, vec![f32::NEG_INFINITY; 64]);
    assert_eq!(g.draw(&none.gpu, 64, 1.0, 0.5).unwrap(), 0);
}

#[test]
fn constrained_greedy_answers_match_on_cpu_and_gpu() {
    if gpu().is_none() {
        return;
    }
    // chat_tiny (head_dim 8, padded by the attention kernels) with a JSON schema, greedy: the
    // recorded decode steps take the mask on the device and only the chosen id comes back. The
    // random weights are f32 on the CPU and bf16 on the GPU, so free text may part ways at a near
    // tie; a schema whose every step chooses among a few tokens (compact JSON, enums, a digit)
    // leaves the choices to the mask and to clear margins.
    let schema = serde_json::json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "ok", "n"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}});
    let request = serde_json::json!({"messages": [{"role": "user", "content": "JSON please"}], "temperature": 0, "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}});
    let answer = |device| {
        let mut engine = Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture("chat_tiny")) }, &mut |_| {}).unwrap();
        let req = atlas::api::ChatRequest::from_json(&request).unwrap();
        let r = atlas::api::chat_completion(&mut engine, &req, &mut |_| true).unwrap();
        let again = atlas::api::chat_completion(&mut engine, &req, &mut |_| true).unwrap();
        assert_eq!(r["choices"], again["choices"], "{device:?}: a second run differs");
        r["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let (cpu_text, gpu_text) = (answer(Device::Cpu), answer(Device::Cuda));
    // logit_bias on the device (recorded steps add it): the first greedy token banned, another pushed.
    let biased = |device| {
        let mut engine = Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture("chat_tiny")) }, &mut |_| {}).unwrap();
        let prompt = engine.tokenizer().unwrap().encode("hello").unwrap();
        let mut req = greedy(prompt, 6);
        let plain = engine.generate(&req, &mut |_| true).unwrap().tokens;
        req.sampling.logit_bias = vec![(plain[0], -100.0), (plain[0] + 1, 50.0)];
        let banned = engine.generate(&req, &mut |_| true).unwrap().tokens;
        assert!(!banned.contains(&plain[0]) && banned.iter().all(|&t| t == plain[0] + 1), "{device:?}: {plain:?} then {banned:?}");
        req.sampling.logit_bias.clear();
        assert_eq!(engine.generate(&req, &mut |_| true).unwrap().tokens, plain, "{device:?}: the biases outlived their request");
        banned
    };
    assert_eq!(biased(Device::Cuda), biased(Device::Cpu));
    let v: serde_json::Value = serde_json::from_str(&gpu_text).unwrap_or_else(|e| panic!("{gpu_text:?}: {e}"));
    assert!(v["color"].is_string() && v["ok"].is_boolean() && v["n"].is_u64(), "{v}");
    assert_eq!(gpu_text, cpu_text, "constrained greedy answers: GPU {gpu_text:?}, CPU {cpu_text:?}");
}

#[test]
fn constrained_sampling_on_the_device_validates() {
    if gpu().is_none() {
        return;
    }
    // Top-p without top-k and top-k with logprobs, under a schema: the mask is computed while the
    // device runs each step and set before the candidates are taken there.
    let schema = serde_json::json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["color", "n"], "additionalProperties": false});
    let mut engine = Engine::load(&EngineOptions { device: Device::Cuda, ..EngineOptions::new(fixture("chat_tiny")) }, &mut |_| {}).unwrap();
    for extra in [serde_json::json!({"top_p": 0.9, "top_k": 0}), serde_json::json!({"top_k": 20, "logprobs": true, "top_logprobs": 3})] {
        let mut request = serde_json::json!({"messages": [{"role": "user", "content": "JSON please"}], "temperature": 0.9, "seed": 3,
            "max_tokens": 200, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}});
        request.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let req = atlas::api::ChatRequest::from_json(&request).unwrap();
        let r = atlas::api::chat_completion(&mut engine, &req, &mut |_| true).unwrap();
        assert_eq!(atlas::api::chat_completion(&mut engine, &req, &mut |_| true).unwrap()["choices"], r["choices"], "{extra}: seeded, reproducible");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{extra}: {text:?}: {e}"));
        assert!(v["color"].is_string() && v["n"].as_u64().is_some_and(|n| n < 100), "{extra}: {v}");
    }
}

// ---- Qwen3.5 hybrid ops: conv1d with state, the gated delta rule, gated RMSNorm, sigmoid gates,
// partial rotary. Tolerances (max abs difference over max abs reference): 1e-5 for the
// elementwise ops, norms and the convolution (a few f32 roundings each), 1e-4 for rotary
// embedding (sincosf of large angles) and for the delta rule (f32 recurrences over up to 115
// tokens, summed in another order), 2e-2 where attention reads the bf16 KV cache; the fixture
// models' bounds are explained at their test.

use atlas::backend::DeltaShape;

/// Fills `rows * cols` floats of freshly freed device memory with NaN. The stream's memory pool
/// normally hands that block to the next allocation of the same size (the op's output), so an
/// element the kernel leaves unwritten reads NaN and `check` fails on it.
fn poison(g: &GpuBackend, rows: usize, cols: usize) {
    drop(g.upload_f32(rows, cols, &vec![f32::NAN; rows * cols]).unwrap());
}

/// Rows `from..to` of a `[T, cols]` CPU tensor.
fn rows(t: &CpuTensor, from: usize, to: usize) -> CpuTensor {
    CpuTensor::new(to - from, t.cols, t.data[from * t.cols..to * t.cols].to_vec())
}

/// Both states: the GPU's downloaded against the CPU's.
fn check_state(g: &GpuBackend, got: &GpuTensor, want: &CpuTensor, tol: f32, what: &str) {
    check(g, got, want, tol, &format!("{what}: state"));
}

#[test]
fn conv1d_silu_matches_the_cpu_and_carries_its_state() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(21);
    // (channels, taps): Qwen3.5's K = 4 (the fixtures' 2·2·16 + 4·32 = 192 channels, Qwen3.6's
    // 2·16·128 + 32·128 = 8192), and other kernel sizes up to the limit of 8.
    for (ch, k) in [(192, 4), (8192, 4), (1000, 2), (77, 8), (33, 3)] {
        let weight = pair(&g, 1, ch * k, random(&mut rng, ch * k, 0.6));
        let state0 = random(&mut rng, (k - 1) * ch, 1.0);
        let what = |t: usize| format!("conv1d C={ch} K={k} T={t}");

        // 6 tokens at once equal 5 then 1.
        let x6 = random(&mut rng, 6 * ch, 2.0);
        let mut cs = CpuTensor::new(1, (k - 1) * ch, state0.clone());
        let want = c.conv1d_silu(&CpuTensor::new(6, ch, x6.clone()), &weight.cpu, &mut cs).unwrap();
        let mut gs = g.upload_f32(1, (k - 1) * ch, &state0).unwrap();
        for (from, to) in [(0, 5), (5, 6)] {
            let x = g.upload_f32(to - from, ch, &x6[from * ch..to * ch]).unwrap();
            poison(&g, to - from, ch);
            let got = g.conv1d_silu(&x, &weight.gpu, &mut gs).unwrap();
            check(&g, &got, &rows(&want, from, to), 1e-5, &format!("{} (tokens {from}..{to} of 6)", what(to - from)));
        }
        check_state(&g, &gs, &cs, 1e-5, &what(6));

        // Then calls of every kind from that state: decode (T = 1, and T = 2 < K - 1 where the new
        // state keeps old rows), prefill over several chunks of 64 tokens.
        for t in [1, 2, 37, 1, 200, 1] {
            let x = pair(&g, t, ch, random(&mut rng, t * ch, 2.0));
            poison(&g, t, ch);
            let got = g.conv1d_silu(&x.gpu, &weight.gpu, &mut gs).unwrap();
            let want = c.conv1d_silu(&x.cpu, &weight.cpu, &mut cs).unwrap();
            check(&g, &got, &want, 1e-5, &what(t));
            check_state(&g, &gs, &cs, 1e-5, &what(t));
        }
    }
}

struct DeltaCase {
    shape: DeltaShape,
    a_log: Pair,
    dt_bias: Pair,
}

impl DeltaCase {
    /// Random inputs for `t` tokens: qkv, a, b.
    fn inputs(&self, rng: &mut Rng, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let hv = self.shape.value_heads;
        (random(rng, t * self.shape.qkv_width(), 2.0), random(rng, t * hv, 4.0), random(rng, t * hv, 4.0))
    }

    /// The rule on both backends from their states; returns (GPU output, CPU output).
    fn run(&self, g: &GpuBackend, c: &CpuBackend, inputs: &(Vec<f32>, Vec<f32>, Vec<f32>), states: (&mut GpuTensor, &mut CpuTensor)) -> (GpuTensor, CpuTensor) {
        let (qkv, a, b) = inputs;
        let (hv, dv) = (self.shape.value_heads, self.shape.value_dim);
        let t = a.len() / hv;
        let qkv = pair(g, t, self.shape.qkv_width(), qkv.clone());
        let (a, b) = (pair(g, t, hv, a.clone()), pair(g, t, hv, b.clone()));
        poison(g, t, hv * dv);
        let got = g.gated_delta_rule(&qkv.gpu, &a.gpu, &b.gpu, &self.a_log.gpu, &self.dt_bias.gpu, states.0, self.shape).unwrap();
        let want = c.gated_delta_rule(&qkv.cpu, &a.cpu, &b.cpu, &self.a_log.cpu, &self.dt_bias.cpu, states.1, self.shape).unwrap();
        (got, want)
    }
}

#[test]
fn gated_delta_rule_matches_the_cpu_and_carries_its_state() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(22);
    // (Hk, Hv, dk, dv): Qwen3.6's heads (with Hk = 2, Hv = 4), the fixtures', the largest heads,
    // odd ones (dk not a multiple of the 8 threads per column, dv not of the 16 columns per
    // block of the recurrent kernel or the 32 of the chunked scan, fewer columns than a block),
    // and one value head per key head.
    for (hk, hv, dk, dv) in [(2, 4, 128, 128), (2, 4, 16, 32), (1, 2, 256, 256), (2, 6, 20, 24), (3, 3, 64, 8), (1, 3, 48, 200)] {
        let shape = DeltaShape { key_heads: hk, value_heads: hv, key_dim: dk, value_dim: dv };
        // A = exp(A_log) in [0.05, 2] as the fixtures: per-token decays from about 0.97 to 0.25.
        let a_log = (0..hv).map(|_| (0.05 + 1.95 * rng.next_f64() as f32).ln()).collect();
        let case = DeltaCase { shape, a_log: pair(&g, 1, hv, a_log), dt_bias: pair(&g, 1, hv, random(&mut rng, hv, 1.0)) };
        let state0 = random(&mut rng, shape.state_len(), 0.5);
        let what = |t: usize| format!("gated_delta_rule Hk={hk} Hv={hv} dk={dk} dv={dv} T={t}");

        // 6 tokens at once equal 5 then 1.
        let six = case.inputs(&mut rng, 6);
        let mut gs = g.upload_f32(1, shape.state_len(), &state0).unwrap();
        let mut cs = CpuTensor::new(1, shape.state_len(), state0.clone());
        let (_, want) = case.run(&g, &c, &six, (&mut g.upload_f32(1, shape.state_len(), &state0).unwrap(), &mut cs));
        let w = shape.qkv_width();
        for (from, to) in [(0, 5), (5, 6)] {
            let part = (six.0[from * w..to * w].to_vec(), six.1[from * hv..to * hv].to_vec(), six.2[from * hv..to * hv].to_vec());
            let mut scratch = CpuTensor::new(1, shape.state_len(), state0.clone());
            let (got, _) = case.run(&g, &c, &part, (&mut gs, &mut scratch));
            check(&g, &got, &rows(&want, from, to), 1e-4, &format!("{} (tokens {from}..{to} of 6)", what(to - from)));
        }
        check_state(&g, &gs, &cs, 1e-4, &what(6));

        // Then prefill and decode calls from that state; one token's a + dt_bias above 20 takes
        // softplus's linear branch (and all but wipes that head's state). From 64 tokens on, the
        // chunked form (dk <= 128): one chunk and a part (70), whole chunks (64), several (200),
        // and two slices of its scratch (1100 > 1024), each followed by a recurrent step.
        for t in [37, 1, 70, 1, 64, 200, 1, 1100, 1] {
            let mut inputs = case.inputs(&mut rng, t);
            if t == 37 {
                inputs.1[3 * hv] = 25.0;
            }
            let (got, want) = case.run(&g, &c, &inputs, (&mut gs, &mut cs));
            check(&g, &got, &want, 1e-4, &what(t));
            check_state(&g, &gs, &cs, 1e-4, &what(t));
        }
    }

    // Key heads past the kernel's registers are refused with the limit.
    let shape = DeltaShape { key_heads: 1, value_heads: 1, key_dim: 264, value_dim: 16 };
    let case = DeltaCase { shape, a_log: pair(&g, 1, 1, vec![0.0]), dt_bias: pair(&g, 1, 1, vec![0.0]) };
    let (qkv, a, b) = case.inputs(&mut rng, 1);
    let (qkv, a, b) = (g.upload_f32(1, shape.qkv_width(), &qkv).unwrap(), g.upload_f32(1, 1, &a).unwrap(), g.upload_f32(1, 1, &b).unwrap());
    let mut state = g.upload_f32(1, shape.state_len(), &vec![0.0; shape.state_len()]).unwrap();
    let err = g.gated_delta_rule(&qkv, &a, &b, &case.a_log.gpu, &case.dt_bias.gpu, &mut state, shape).err().expect("dk 264 refused");
    assert!(matches!(err, atlas::Error::Unsupported(_)) && err.to_string().contains("256"), "{err}");
}

/// The recurrence of a batched decode step (`delta_net_rows`: one token of each of several
/// sequences, their states scattered) gives each sequence the bits of its own conv1d and delta
/// rule launched alone, outputs and states, and matches the CPU's rows; 11 sequences take two
/// launches of at most 8.
#[test]
fn delta_net_rows_give_each_sequence_its_own_bits() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(24);
    let bits = |x: &GpuTensor| g.to_host(x).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for ((hk, hv, dk, dv), n) in [((2, 4, 128, 128), 8), ((2, 4, 16, 32), 3), ((1, 3, 48, 200), 11), ((2, 6, 20, 24), 1)] {
        let shape = DeltaShape { key_heads: hk, value_heads: hv, key_dim: dk, value_dim: dv };
        let (ch, k) = (shape.qkv_width(), 4);
        let a_log = pair(&g, 1, hv, (0..hv).map(|_| (0.05 + 1.95 * rng.next_f64() as f32).ln()).collect());
        let dt_bias = pair(&g, 1, hv, random(&mut rng, hv, 1.0));
        let conv1d = pair(&g, 1, ch * k, random(&mut rng, ch * k, 0.6));
        let what = format!("delta_net_rows Hk={hk} Hv={hv} dk={dk} dv={dv}, {n} sequences");
        let qkv = pair(&g, n, ch, random(&mut rng, n * ch, 2.0));
        let (a, b) = (pair(&g, n, hv, random(&mut rng, n * hv, 4.0)), pair(&g, n, hv, random(&mut rng, n * hv, 4.0)));
        let conv0: Vec<Vec<f32>> = (0..n).map(|_| random(&mut rng, (k - 1) * ch, 1.0)).collect();
        let delta0: Vec<Vec<f32>> = (0..n).map(|_| random(&mut rng, shape.state_len(), 0.5)).collect();

        // Each sequence alone: the single-sequence launches, from its own copy of the states.
        let mut alone = Vec::new();
        for i in 0..n {
            let mut conv = g.upload_f32(1, (k - 1) * ch, &conv0[i]).unwrap();
            let mut delta = g.upload_f32(1, shape.state_len(), &delta0[i]).unwrap();
            let row = |x: &Pair| g.rows(&x.gpu, i, 1).unwrap();
            let x = g.conv1d_silu(&row(&qkv), &conv1d.gpu, &mut conv).unwrap();
            let o = g.gated_delta_rule(&x, &row(&a), &row(&b), &a_log.gpu, &dt_bias.gpu, &mut delta, shape).unwrap();
            alone.push((bits(&o), bits(&conv), bits(&delta)));
        }

        let mut gpu_states: Vec<(GpuTensor, GpuTensor)> = (0..n)
            .map(|i| (g.upload_f32(1, (k - 1) * ch, &conv0[i]).unwrap(), g.upload_f32(1, shape.state_len(), &delta0[i]).unwrap()))
            .collect();
        let mut cpu_states: Vec<(CpuTensor, CpuTensor)> =
            (0..n).map(|i| (CpuTensor::new(1, (k - 1) * ch, conv0[i].clone()), CpuTensor::new(1, shape.state_len(), delta0[i].clone()))).collect();
        poison(&g, n, hv * dv);
        let weights = atlas::backend::DeltaWeights { conv1d: &conv1d.gpu, a_log: &a_log.gpu, dt_bias: &dt_bias.gpu };
        let mut refs: Vec<(&mut GpuTensor, &mut GpuTensor)> = gpu_states.iter_mut().map(|(c, d)| (c, d)).collect();
        let got = g.delta_net_rows(&qkv.gpu, &a.gpu, &b.gpu, weights, &mut refs, shape).unwrap();
        let weights = atlas::backend::DeltaWeights { conv1d: &conv1d.cpu, a_log: &a_log.cpu, dt_bias: &dt_bias.cpu };
        let mut refs: Vec<(&mut CpuTensor, &mut CpuTensor)> = cpu_states.iter_mut().map(|(c, d)| (c, d)).collect();
        let want = c.delta_net_rows(&qkv.cpu, &a.cpu, &b.cpu, weights, &mut refs, shape).unwrap();
        check(&g, &got, &want, 1e-4, &what);

        let out = bits(&got);
        for (i, (o, conv, delta)) in alone.iter().enumerate() {
            assert_eq!(&out[i * hv * dv..(i + 1) * hv * dv], &o[..], "{what}: sequence {i}'s output differs from its launch alone");
            assert_eq!(&bits(&gpu_states[i].0), conv, "{what}: sequence {i}'s conv state");
            assert_eq!(&bits(&gpu_states[i].1), delta, "{what}: sequence {i}'s delta state");
            check_state(&g, &gpu_states[i].1, &cpu_states[i].1, 1e-4, &format!("{what}, sequence {i}"));
        }
    }
}

#[test]
fn gated_rms_norm_and_sigmoid_gates_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(23);
    // (T, width, group): Qwen3.6's value heads of 128, the fixtures' of 32, an odd group (no
    // float4 loads) and a whole wide row.
    for (t, width, group) in [(1, 32 * 128, 128), (37, 4 * 128, 128), (37, 4 * 32, 32), (3, 5 * 30, 30), (2, 4096, 4096)] {
        let x = pair(&g, t, width, random(&mut rng, t * width, 2.0));
        let z = pair(&g, t, width, random(&mut rng, t * width, 6.0));
        let w = pair(&g, 1, group, random(&mut rng, group, 1.5));
        poison(&g, t, width);
        let got = g.gated_rms_norm(&x.gpu, &z.gpu, &w.gpu, 1e-6).unwrap();
        let want = c.gated_rms_norm(&x.cpu, &z.cpu, &w.cpu, 1e-6).unwrap();
        check(&g, &got, &want, 1e-5, &format!("gated_rms_norm T={t} width={width} group={group}"));
    }
    // A gate per value, and one per row.
    for (t, width, gate_cols) in [(1, 4096, 4096), (37, 128, 128), (37, 128, 1), (5, 7, 1), (1, 64, 1)] {
        let mut x = pair(&g, t, width, random(&mut rng, t * width, 2.0));
        let gate = pair(&g, t, gate_cols, random(&mut rng, t * gate_cols, 8.0));
        g.sigmoid_gate(&mut x.gpu, &gate.gpu).unwrap();
        c.sigmoid_gate(&mut x.cpu, &gate.cpu).unwrap();
        check(&g, &x.gpu, &x.cpu, 1e-5, &format!("sigmoid_gate T={t} width={width} gate width {gate_cols}"));
    }
    let mut x = g.upload_f32(2, 8, &[0.0; 16]).unwrap();
    assert!(g.sigmoid_gate(&mut x, &g.upload_f32(2, 4, &[0.0; 8]).unwrap()).is_err(), "a gate of another width is refused");
}

#[test]
fn partial_rotary_turns_only_the_leading_dimensions() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(24);
    // (T, heads, head_dim, rotary dims, start): Qwen3.5's 64 of 256, the fixtures' 8 of 32, a
    // quarter and a half of other heads, and all but the last two dimensions.
    for (t, heads, d, rot, start) in [(1, 16, 256, 64, 4000), (9, 4, 32, 8, 0), (3, 2, 128, 32, 17), (5, 3, 96, 48, 5), (2, 2, 64, 62, 300)] {
        let inv_freq = (0..rot / 2).map(|i| 1.0 / 1e7f32.powf(2.0 * i as f32 / rot as f32)).collect();
        let rope = Rope { head_dim: d, inv_freq };
        let what = format!("T={t} heads={heads} d={d} rotary {rot} at {start}");
        let input = random(&mut rng, t * heads * d, 1.0);
        let mut x = pair(&g, t, heads * d, input.clone());
        g.rope(&mut x.gpu, &rope, start).unwrap();
        c.rope(&mut x.cpu, &rope, start).unwrap();
        check(&g, &x.gpu, &x.cpu, 1e-4, &format!("rope {what}"));
        let got = g.to_host(&x.gpu).unwrap();
        let passed = (0..t * heads * d).filter(|i| i % d >= rot).all(|i| got[i].to_bits() == input[i].to_bits());
        assert!(passed, "rope {what}: the dimensions past the rotary ones changed");
        // The fused q/k norm + rope, with and without the norm.
        let w = pair(&g, 1, d, random(&mut rng, d, 1.5));
        for norm in [Some(&w), None] {
            let mut y = pair(&g, t, heads * d, random(&mut rng, t * heads * d, 2.0));
            g.norm_rope(&mut y.gpu, norm.map(|n| &n.gpu), 1e-6, &rope, start).unwrap();
            c.norm_rope(&mut y.cpu, norm.map(|n| &n.cpu), 1e-6, &rope, start).unwrap();
            check(&g, &y.gpu, &y.cpu, 1e-4, &format!("norm_rope {what} norm {}", norm.is_some()));
        }
    }
    // The fused q/k norm + partial rope + append before attention, against the CPU's steps.
    for (heads, kv_heads, d, rot) in [(4, 1, 32, 8), (16, 4, 256, 64), (8, 2, 128, 32)] {
        let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d };
        let inv_freq = (0..rot / 2).map(|i| 1.0 / 1e7f32.powf(2.0 * i as f32 / rot as f32)).collect();
        let rope = Rope { head_dim: d, inv_freq };
        let qn = pair(&g, 1, d, random(&mut rng, d, 1.5));
        let kn = pair(&g, 1, d, random(&mut rng, d, 1.5));
        let (mut gc, mut cc) = (gkv(&g, kv_heads * d), ckv(&c, kv_heads * d));
        let mut pos = 0;
        for t in [37, 1, 1] {
            let q = pair(&g, t, heads * d, random(&mut rng, t * heads * d, 1.0));
            let k = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let v = pair(&g, t, kv_heads * d, random(&mut rng, t * kv_heads * d, 1.0));
            let gn = QkNorms { q: Some(&qn.gpu), k: Some(&kn.gpu), eps: 1e-6 };
            let cn = QkNorms { q: Some(&qn.cpu), k: Some(&kn.cpu), eps: 1e-6 };
            let got = g.rotary_attention(q.gpu, k.gpu, &v.gpu, gn, &rope, &mut gc, pos, shape).unwrap();
            let want = c.rotary_attention(q.cpu, k.cpu, &v.cpu, cn, &rope, &mut cc, pos, shape).unwrap();
            check(&g, &got, &want, 2e-2, &format!("partial rotary_attention heads {heads}/{kv_heads} d {d} rotary {rot} T {t} at {pos}"));
            pos += t;
        }
    }
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits");
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref
}

#[test]
fn hybrid_fixture_models_match_the_goldens_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    for name in ["qwen3_5_tiny", "qwen3_5_vl_tiny"] {
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap();
        let ids = |g: &serde_json::Value, k: &str| -> Vec<u32> { g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
        let floats = |g: &serde_json::Value| -> Vec<f32> { g["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect() };
        let load = |device| Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
        let (mut on_gpu, mut on_cpu) = (load(Device::Cuda), load(Device::Cpu));
        assert!(on_gpu.report().device.starts_with("cuda"), "{name}: {}", on_gpu.report().device);
        let (short, long) = (ids(&golden, "tokens"), ids(&golden["long"], "tokens"));
        let (short_logits, long_logits) = (floats(&golden), floats(&golden["long"]));
        let expect = |what: &str, got: Vec<f32>, want: &[f32], tol: f32| {
            let err = relative_error(&got, want);
            println!("{name}: {what}: GPU vs transformers logits relative error {err:.2e}");
            assert!(err < tol, "{name}: {what}: relative error {err} > {tol}");
        };

        // Transformers' logits for the whole prompts (prefill: the delta rule over every token,
        // flash attention with partial rotary). Prompts of more than 8 tokens run the projections
        // as GEMMs on the matrix cores, whose inputs are rounded to bf16: this tiny random model
        // is sensitive to that, the CPU with only its GEMM inputs rounded to bf16 is 2.2e-2 from
        // transformers on the 12-token prompt (8.5e-3 on the 300-token one); the GPU measured
        // 2.5e-2 (9.3e-3).
        expect("12-token prompt", on_gpu.logits(&short).unwrap(), &short_logits, 4e-2);
        expect("300-token prompt", on_gpu.logits(&long).unwrap(), &long_logits, 2e-2);
        // The same prompts in calls of at most 8 tokens (f32 inputs to the projections, every
        // hybrid kernel in its prefill form) and one token at a time (the decode kernels, all
        // steps but the first replayed from a recorded graph): measured 1.1e-3 and 5.0e-4.
        on_gpu.forward(&short[..8], 0).unwrap();
        expect("12-token prompt as 8 + 4", on_gpu.forward(&short[8..], 8).unwrap(), &short_logits, 1e-2);
        let mut logits = Vec::new();
        for (pos, &token) in long.iter().enumerate() {
            logits = on_gpu.forward(&[token], pos).unwrap();
        }
        expect("300-token prompt one token at a time", logits, &long_logits, 1e-2);

        // Greedy decoding (steps after the first replay a recorded graph): the CPU's tokens.
        for prompt in [&short, &long] {
            let req = greedy(prompt.clone(), 16);
            let want = on_cpu.generate_raw(&req).unwrap().tokens;
            assert_eq!(on_gpu.generate_raw(&req).unwrap().tokens, want, "{name}: greedy tokens on the GPU, {} prompt tokens", prompt.len());
        }
        let req = greedy(short.clone(), 16);
        let gen = on_gpu.generate_raw(&req).unwrap();
        assert_eq!(gen.tokens, ids(&golden, "greedy"), "{name}: greedy tokens on the GPU");
        // The same prompt again starts the recurrent states afresh (new caches, so a new recording).
        assert_eq!(on_gpu.generate_raw(&req).unwrap().tokens, gen.tokens, "{name}: greedy tokens, second request");

        // A replayed step's logits match the CPU's at the same position.
        let mut history = short.clone();
        history.extend_from_slice(&gen.tokens[..15]);
        on_cpu.logits(&history).unwrap();
        let pos = history.len();
        let want = on_cpu.forward(&[gen.tokens[15]], pos).unwrap();
        let got = on_gpu.forward(&[gen.tokens[15]], pos).unwrap();
        let err = relative_error(&got, &want);
        println!("{name}: replayed decode step, GPU vs CPU logits relative error {err:.2e}");
        assert!(err < 2e-2, "{name}: replayed decode step, relative error {err}");
    }
}

// ---- Mixture of experts: routing on the device, the one-token expert GEMVs and the grouped
// prefill GEMMs against the CPU. Tolerances (max abs difference over max abs reference): 1e-4 for
// one token over bf16 experts (f32 activations throughout), 2e-3 over FP8 experts (inputs as f16
// on the matrix cores, as the FP8 GEMVs), 2e-2 for several tokens (the grouped GEMMs round
// activations to bf16, twice: the input and the SiLU·up product). A routing that chose another
// expert would be off by O(1).

use atlas::backend::{GatedMlp, HostMlp, Routing, SharedExpert};

/// NaN in device memory of these sizes (floats), freed again: the stream's pool hands such blocks
/// to the next allocations of the same sizes (the op's output and temporaries), so a value a
/// kernel leaves unwritten reads NaN and `check` fails on it.
fn moe_poison(g: &GpuBackend, sizes: &[usize]) {
    let held: Vec<GpuTensor> = sizes.iter().map(|&n| g.upload_f32(1, n, &vec![f32::NAN; n]).unwrap()).collect();
    drop(held);
}

/// `count` random experts (gate, up `[inter, hidden]`, down `[hidden, inter]`), the same ones twice:
/// for the CPU and for the GPU.
fn expert_pairs(rng: &mut Rng, fp8: bool, count: usize, hidden: usize, inter: usize) -> (Vec<HostMlp>, Vec<HostMlp>) {
    (0..count)
        .map(|_| {
            let (g1, g2) = matrix_pair(rng, fp8, inter, hidden);
            let (u1, u2) = matrix_pair(rng, fp8, inter, hidden);
            let (d1, d2) = matrix_pair(rng, fp8, hidden, inter);
            (GatedMlp { gate: g1, up: u1, down: d1 }, GatedMlp { gate: g2, up: u2, down: d2 })
        })
        .unzip()
}

fn upload_experts_to<B: Backend>(b: &B, experts: Vec<HostMlp>) -> B::Experts {
    let count = experts.len();
    let mut it = experts.into_iter();
    b.upload_experts(count, &mut |_| Ok(it.next().unwrap())).unwrap()
}

/// One MoE call on both backends, added to a random residual: the GPU's sum against the CPU's,
/// twice (the same bits both times: no atomics decide an order).
#[allow(clippy::too_many_arguments)]
fn moe_case(g: &GpuBackend, c: &CpuBackend, experts: (&Vec<GatedMlp<CpuBackend>>, &atlas::backend::gpu::GpuExperts), hidden: usize, inter: usize, logits: Vec<f32>, xn: Vec<f32>, routing: Routing, tol: f32, what: &str) {
    let (e, k) = (experts.0.len(), routing.top_k);
    let t = xn.len() / hidden;
    let xn = pair(g, t, hidden, xn);
    let logits = pair(g, t, e, logits);
    let residual = (0..t * hidden).map(|i| ((i * 7919) % 13) as f32 * 0.02 - 0.12).collect::<Vec<_>>();
    let mut want = CpuTensor::new(t, hidden, residual.clone());
    c.moe_add(&xn.cpu, &logits.cpu, experts.0, routing, &mut want).unwrap();
    let run = || {
        moe_poison(g, &[t * hidden, k * inter, k * hidden, t * k * hidden, t * k * inter]);
        let mut got = g.upload_f32(t, hidden, &residual).unwrap();
        g.moe_add(&xn.gpu, &logits.gpu, experts.1, routing, &mut got).unwrap();
        got
    };
    let got = run();
    check(g, &got, &want, tol, what);
    let bits = |x: &GpuTensor| g.to_host(x).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(bits(&got) == bits(&run()), "{what}: two runs differ");
}

fn moe_tolerance(t: usize, fp8: bool) -> f32 {
    match (t, fp8) {
        (1, false) => 1e-4,
        (1, true) => 2e-3,
        _ => 2e-2,
    }
}

#[test]
fn moe_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(31);
    let (hidden, inter) = (256, 128);
    for fp8 in [false, true] {
        for (e, k) in [(8, 2), (64, 8)] {
            let (ce, ge) = expert_pairs(&mut rng, fp8, e, hidden, inter);
            let (ce, ge) = (upload_experts_to(&c, ce), upload_experts_to(&g, ge));
            for normalize in [true, false] {
                let routing = Routing { top_k: k, normalize };
                for t in [1, 37] {
                    let what = format!("moe {} E={e} k={k} normalize={normalize} T={t}", if fp8 { "fp8" } else { "bf16" });
                    let (logits, xn) = (random(&mut rng, t * e, 3.0), random(&mut rng, t * hidden, 1.0));
                    moe_case(&g, &c, (&ce, &ge), hidden, inter, logits, xn, routing, moe_tolerance(t, fp8), &what);
                }
            }
        }
    }
}

#[test]
fn moe_routing_ties_go_to_the_lower_expert() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(32);
    let (hidden, inter) = (256, 128);
    for (e, k) in [(8, 2), (64, 8)] {
        let (ce, ge) = expert_pairs(&mut rng, false, e, hidden, inter);
        let (ce, ge) = (upload_experts_to(&c, ce), upload_experts_to(&g, ge));
        for t in [1, 37] {
            // Token 0: every expert tied (the first k win); the others: three values, many ties
            // at and across the k-th place; the last token of several: ties at -inf too.
            let mut logits: Vec<f32> = (0..t * e).map(|_| (rng.next_u64() % 3) as f32).collect();
            logits[..e].fill(0.0);
            if t > 1 {
                logits[(t - 1) * e..].iter_mut().step_by(2).for_each(|v| *v = f32::NEG_INFINITY);
            }
            for normalize in [true, false] {
                let what = format!("moe ties E={e} k={k} normalize={normalize} T={t}");
                let xn = random(&mut rng, t * hidden, 1.0);
                moe_case(&g, &c, (&ce, &ge), hidden, inter, logits.clone(), xn, Routing { top_k: k, normalize }, moe_tolerance(t, false), &what);
            }
        }
    }
}

#[test]
fn moe_odd_shapes_and_long_prompts() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(33);
    // Widths the GEMVs do not take (bf16: not whole 8-value chunks; fp8: not whole 16-value
    // chunks): one token goes through the grouped GEMMs too. Then more tokens than one chunk of
    // the grouped path (4096), top-1 routing, and 600 experts.
    for (fp8, e, k, hidden, inter, tokens) in [
        (false, 8, 2, 100, 36, &[1, 5][..]),
        (true, 8, 2, 264, 48, &[1, 5][..]),
        (false, 6, 3, 64, 32, &[4100][..]),
        (false, 16, 1, 128, 64, &[1, 300][..]),
        // Many experts: the routing warp takes 19 logits a lane.
        (false, 600, 3, 64, 32, &[1][..]),
    ] {
        let (ce, ge) = expert_pairs(&mut rng, fp8, e, hidden, inter);
        let (ce, ge) = (upload_experts_to(&c, ce), upload_experts_to(&g, ge));
        for &t in tokens {
            let what = format!("moe {} E={e} k={k} H={hidden} I={inter} T={t}", if fp8 { "fp8" } else { "bf16" });
            let (logits, xn) = (random(&mut rng, t * e, 3.0), random(&mut rng, t * hidden, 1.0));
            let chunks = if fp8 { 16 } else { 8 };
            let gemv = t == 1 && hidden % chunks == 0 && inter % chunks == 0;
            let tol = moe_tolerance(if gemv { 1 } else { 2 }, fp8);
            moe_case(&g, &c, (&ce, &ge), hidden, inter, logits, xn, Routing { top_k: k, normalize: true }, tol, &what);
        }
    }
    // Experts of mixed shapes are refused at upload.
    let (mut mixed, _) = expert_pairs(&mut rng, false, 2, 64, 32);
    mixed[1].down = Box::new(bf16_matrix(&mut rng, 64, 48));
    let mut it = mixed.into_iter();
    assert!(g.upload_experts(2, &mut |_| Ok(it.next().unwrap())).is_err(), "experts of mixed shapes");
}

/// A shared expert uploaded to both backends.
fn shared_pair(g: &GpuBackend, c: &CpuBackend, rng: &mut Rng, fp8: bool, hidden: usize, inter: usize) -> (GatedMlp<CpuBackend>, GatedMlp<GpuBackend>) {
    let (mut host_c, mut host_g) = expert_pairs(rng, fp8, 1, hidden, inter);
    let (hc, hg) = (host_c.remove(0), host_g.remove(0));
    let on_cpu = GatedMlp { gate: c.upload_weight(hc.gate).unwrap(), up: c.upload_weight(hc.up).unwrap(), down: c.upload_weight(hc.down).unwrap() };
    let on_gpu = GatedMlp { gate: g.upload_weight(hg.gate).unwrap(), up: g.upload_weight(hg.up).unwrap(), down: g.upload_weight(hg.down).unwrap() };
    (on_cpu, on_gpu)
}

#[test]
fn moe_block_with_a_shared_expert_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(34);
    // One token takes the fused four-launch block (the norm inside gate/up, the shared expert as
    // one more slot); several tokens, a shared expert of another width or none take the composed
    // ops. bf16 and fp8.
    for (fp8, e, k, hidden, inter, shared_inter, t) in [
        (false, 16, 4, 256, 128, Some(128), 1),
        (true, 16, 4, 256, 128, Some(128), 1),
        (true, 64, 8, 512, 256, Some(256), 1),
        (true, 16, 4, 256, 128, Some(256), 1),
        (false, 16, 4, 256, 128, None, 1),
        (true, 16, 4, 256, 128, Some(128), 7),
    ] {
        let what = format!("moe block {} E={e} k={k} H={hidden} I={inter} shared {shared_inter:?} T={t}", if fp8 { "fp8" } else { "bf16" });
        let (ce, ge) = expert_pairs(&mut rng, fp8, e, hidden, inter);
        let (ce, ge) = (upload_experts_to(&c, ce), upload_experts_to(&g, ge));
        let shared = shared_inter.map(|si| shared_pair(&g, &c, &mut rng, fp8, hidden, si));
        let x = pair(&g, t, hidden, random(&mut rng, t * hidden, 2.0));
        let norm = pair(&g, 1, hidden, random(&mut rng, hidden, 1.5));
        let logits = pair(&g, t, e, random(&mut rng, t * e, 3.0));
        let gate_logits = pair(&g, t, 1, random(&mut rng, t, 2.0));
        let routing = Routing { top_k: k, normalize: true };
        let mut want = CpuTensor::new(t, hidden, x.cpu.data.clone());
        let cs = shared.as_ref().map(|(sc, _)| SharedExpert { mlp: sc, gate_logits: &gate_logits.cpu });
        c.moe_block_add(&mut want, &norm.cpu, 1e-6, &logits.cpu, &ce, cs, routing).unwrap();
        let run = || {
            moe_poison(&g, &[t * hidden, (k + 1) * inter, (k + 1) * hidden, t * k * hidden]);
            let mut got = g.upload_f32(t, hidden, &x.cpu.data).unwrap();
            let gs = shared.as_ref().map(|(_, sg)| SharedExpert { mlp: sg, gate_logits: &gate_logits.gpu });
            g.moe_block_add(&mut got, &norm.gpu, 1e-6, &logits.gpu, &ge, gs, routing).unwrap();
            got
        };
        let got = run();
        check(&g, &got, &want, moe_tolerance(t, fp8), &what);
        let bits = |x: &GpuTensor| g.to_host(x).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(&got) == bits(&run()), "{what}: two runs differ");
    }
}

/// Experts in a block format stay packed on the device (gate/up in one format, down in the same or,
/// as Q4_K_M files have it, another) and match the CPU: one token through the packed expert GEMVs
/// (4e-3, as the packed GEMVs), several through the grouped GEMMs, which decode each run to the bf16
/// that widened experts hold and so give their bits exactly. The fused block takes a shared expert
/// of the same formats as one more slot.
#[test]
fn moe_packed_experts_stay_packed_and_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(35);
    let (e, k, hidden, inter) = (16, 4, 512, 256);
    let mut cases: Vec<(Option<GgmlFormat>, Option<GgmlFormat>)> = GgmlFormat::ALL.iter().map(|&f| (Some(f), Some(f))).collect();
    cases.push((None, None));
    cases.push((Some(GgmlFormat::Q4_K), Some(GgmlFormat::Q6_K)));
    for (n, (gate_up, down)) in cases.into_iter().enumerate() {
        let name = |f: Option<GgmlFormat>| f.map_or("nvfp4 (safetensors)".to_string(), |f| f.to_string());
        let what = format!("moe packed {}/{}", name(gate_up), name(down));
        let seed = 1000 + 10 * n as u64;
        let host = |f, rows, cols, seed| {
            let (m, wide) = block_matrix(f, rows, cols, seed);
            (m, block_matrix(f, rows, cols, seed).0, wide)
        };
        let (mut on_cpu, mut packed, mut widened) = (Vec::new(), Vec::new(), Vec::new());
        for x in 0..e as u64 {
            let (g1, g2, g3) = host(gate_up, inter, hidden, seed + 3 * x);
            let (u1, u2, u3) = host(gate_up, inter, hidden, seed + 3 * x + 1);
            let (d1, d2, d3) = host(down, hidden, inter, seed + 3 * x + 2);
            on_cpu.push(GatedMlp { gate: g1, up: u1, down: d1 });
            packed.push(GatedMlp { gate: g2, up: u2, down: d2 });
            let boxed = |m: DenseMatrix| -> Box<dyn QuantMatrix> { Box::new(m) };
            widened.push(GatedMlp { gate: boxed(g3), up: boxed(u3), down: boxed(d3) });
        }
        let file_bytes: usize = on_cpu.iter().map(|m: &HostMlp| m.gate.storage_bytes() + m.up.storage_bytes() + m.down.storage_bytes()).sum();
        // Inputs sized to the format's weights, so that SiLU(gate)·up stays where f16 holds it (the
        // GEMVs stage inputs as f16, saturating past 2^20: random Q6_K rows have values to 200).
        let mut row = vec![0f32; hidden];
        on_cpu[0].gate.dequant_row(0, &mut row);
        let x_scale = 3.0 / (row.iter().map(|v| v * v).sum::<f32>().sqrt() + 1e-6);
        let (ce, ge, gw) = (upload_experts_to(&c, on_cpu), upload_experts_to(&g, packed), upload_experts_to(&g, widened));
        // Each expert's planes are padded to 256 bytes (and NVFP4's factor rides with them).
        assert!(ge.device_bytes() <= file_bytes + 3 * e * 260, "{what}: {} device bytes for {file_bytes} in the file", ge.device_bytes());
        let routing = Routing { top_k: k, normalize: true };
        for t in [1, 37] {
            let (logits, xn) = (random(&mut rng, t * e, 3.0), random(&mut rng, t * hidden, x_scale));
            let tol = if t == 1 { 4e-3 } else { 2e-2 };
            moe_case(&g, &c, (&ce, &ge), hidden, inter, logits.clone(), xn.clone(), routing, tol, &format!("{what} T={t}"));
            if t > 1 {
                let run = |experts| {
                    let (xn, logits) = (g.upload_f32(t, hidden, &xn).unwrap(), g.upload_f32(t, e, &logits).unwrap());
                    let mut out = g.upload_f32(t, hidden, &vec![0.5; t * hidden]).unwrap();
                    g.moe_add(&xn, &logits, experts, routing, &mut out).unwrap();
                    g.to_host(&out).unwrap()
                };
                assert!(run(&ge) == run(&gw), "{what} T={t}: packed and widened experts differ");
            }
        }
        // The fused block, with a shared expert of the same formats.
        let (sg, su, sd) = (host(gate_up, inter, hidden, seed + 900), host(gate_up, inter, hidden, seed + 901), host(down, hidden, inter, seed + 902));
        let shared_c = GatedMlp { gate: c.upload_weight(sg.0).unwrap(), up: c.upload_weight(su.0).unwrap(), down: c.upload_weight(sd.0).unwrap() };
        let shared_g = GatedMlp { gate: g.upload_weight(sg.1).unwrap(), up: g.upload_weight(su.1).unwrap(), down: g.upload_weight(sd.1).unwrap() };
        let x = pair(&g, 1, hidden, random(&mut rng, hidden, 2.0));
        let norm = pair(&g, 1, hidden, random(&mut rng, hidden, 1.5 * x_scale));
        let logits = pair(&g, 1, e, random(&mut rng, e, 3.0));
        let gate_logits = pair(&g, 1, 1, random(&mut rng, 1, 2.0));
        let mut want = CpuTensor::new(1, hidden, x.cpu.data.clone());
        c.moe_block_add(&mut want, &norm.cpu, 1e-6, &logits.cpu, &ce, Some(SharedExpert { mlp: &shared_c, gate_logits: &gate_logits.cpu }), routing).unwrap();
        moe_poison(&g, &[hidden, (k + 1) * inter, (k + 1) * hidden]);
        let mut got = g.upload_f32(1, hidden, &x.cpu.data).unwrap();
        g.moe_block_add(&mut got, &norm.gpu, 1e-6, &logits.gpu, &ge, Some(SharedExpert { mlp: &shared_g, gate_logits: &gate_logits.gpu }), routing).unwrap();
        check(&g, &got, &want, 4e-3, &format!("{what} block with a shared expert"));
    }
}

fn moe_logits_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits");
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref
}

#[test]
fn moe_fixture_models_match_the_golden_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    // Qwen3-MoE (f32 weights, bf16 on the GPU: E 8, top 2, renormalised; layers MoE, dense, MoE)
    // through prefill (grouped GEMMs) and decode; Qwen3.5-MoE (bf16; Gated DeltaNet layers, a shared
    // expert behind a sigmoid gate), fused and per-expert tensors, through decode only: its routers
    // have near ties (HYBRID_NOTES.md: gaps of 4e-5) that the bf16 activations of a prefill flip (up
    // to 0.3 relative error in the last logits, printed below), where one token at a time (f32
    // activations, the one-token expert GEMVs) stays within 1e-3 of the goldens.
    let ids = |g: &serde_json::Value, k: &str| -> Vec<u32> { g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let floats = |g: &serde_json::Value| -> Vec<f32> { g["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect() };
    for (name, prefill) in [("qwen3_moe_tiny", true), ("qwen3_5_moe_tiny", false), ("qwen3_5_moe_tiny_per_expert", false)] {
        let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap();
        let load = |device| Engine::load(&EngineOptions { device, ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
        let (mut on_gpu, mut on_cpu) = (load(Device::Cuda), load(Device::Cpu));
        assert!(on_gpu.report().device.starts_with("cuda"), "{name}: {}", on_gpu.report().device);

        // Transformers' logits for the 12-token and the 300-token prompts: as one prefill, and one
        // token at a time (all but the first step replayed from a recorded graph).
        for g in [&golden, &golden["long"]] {
            let tokens = ids(g, "tokens");
            let err = moe_logits_error(&on_gpu.logits(&tokens).unwrap(), &floats(g));
            println!("{name}: {} tokens as one prefill, GPU vs transformers logits relative error {err:.2e}", tokens.len());
            assert!(!prefill || err < 2e-2, "{name}, {} tokens: relative error {err}", tokens.len());
            let mut logits = Vec::new();
            for (pos, &token) in tokens.iter().enumerate() {
                logits = on_gpu.forward(&[token], pos).unwrap();
            }
            let err = moe_logits_error(&logits, &floats(g));
            println!("{name}: {} tokens one at a time, GPU vs transformers logits relative error {err:.2e}", tokens.len());
            assert!(err < 2e-2, "{name}: relative error {err} after {} single steps", tokens.len());
        }

        // Greedy decoding (one-token expert GEMVs, the experts chosen on the device in replayed
        // steps): the CPU's tokens, from a prefilled prompt or one fed token by token.
        let prompt = ids(&golden, "tokens");
        let req = greedy(prompt.clone(), 16);
        let want = on_cpu.generate_raw(&req).unwrap().tokens;
        let got = if prefill {
            on_gpu.generate_raw(&req).unwrap().tokens
        } else {
            let mut history = prompt.clone();
            let mut logits = Vec::new();
            for (pos, &token) in prompt.iter().enumerate() {
                logits = on_gpu.forward(&[token], pos).unwrap();
            }
            for _ in 0..16 {
                let next = atlas::sampling::argmax(&logits);
                history.push(next);
                logits = on_gpu.forward(&[next], history.len() - 1).unwrap();
            }
            history[prompt.len()..].to_vec()
        };
        assert_eq!(got, want, "{name}: greedy tokens on the GPU");
        assert_eq!(got, ids(&golden, "greedy"), "{name}: greedy tokens on the GPU against transformers'");

        // A replayed step's logits match the CPU's at the same position.
        let mut history = prompt.clone();
        history.extend_from_slice(&got[..15]);
        on_cpu.logits(&history).unwrap();
        let want = on_cpu.forward(&[got[15]], history.len()).unwrap();
        if prefill {
            on_gpu.logits(&history).unwrap();
        } else {
            for (pos, &token) in history.iter().enumerate() {
                on_gpu.forward(&[token], pos).unwrap();
            }
        }
        let err = moe_logits_error(&on_gpu.forward(&[got[15]], history.len()).unwrap(), &want);
        println!("{name}: a replayed decode step, GPU vs CPU logits relative error {err:.2e}");
        assert!(err < 2e-2, "{name}: replayed decode step, relative error {err}");
    }
}

use atlas::quant::{GgmlFormat, GgmlMatrix};

/// A random matrix of a block format (None: NVFP4 as safetensors hold it), and its dequantised
/// values rounded to bf16, as a dense matrix (what the widened path uploaded before).
fn block_matrix(format: Option<GgmlFormat>, rows: usize, cols: usize, seed: u64) -> (Box<dyn QuantMatrix>, DenseMatrix) {
    let m: Box<dyn QuantMatrix> = match format {
        Some(f) => {
            let blocks = atlas::quant::synthetic::random_ggml_blocks(f, rows * cols / f.block_size(), seed);
            Box::new(GgmlMatrix::new(f, rows, cols, blocks).unwrap())
        }
        None => {
            let mut rng = Rng::new(seed);
            let codes = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
            let scales = (0..rows * cols / 16).map(|_| 0x20 + (rng.next_u64() % 0x28) as u8).collect();
            Box::new(atlas::quant::fp4::Nvfp4Matrix::new(rows, cols, codes, scales, 0.013).unwrap())
        }
    };
    let mut row = vec![0f32; cols];
    let mut wide = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        m.dequant_row(r, &mut row);
        wide.extend(row.iter().map(|v| half::bf16::from_f32(*v)));
    }
    (m, DenseMatrix::new(rows, cols, DenseData::BF16(wide)))
}

fn block_matrix_twice(format: Option<GgmlFormat>, rows: usize, cols: usize, seed: u64) -> (Box<dyn QuantMatrix>, Box<dyn QuantMatrix>) {
    (block_matrix(format, rows, cols, seed).0, block_matrix(format, rows, cols, seed).0)
}

#[test]
fn block_formats_stay_packed_and_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(12);
    let formats: Vec<Option<GgmlFormat>> = GgmlFormat::ALL.iter().copied().map(Some).chain([None]).collect();
    for (i, format) in formats.into_iter().enumerate() {
        let name = format.map_or("nvfp4 (safetensors)".to_string(), |f| f.to_string());
        let seed = 100 + i as u64;
        // Embedding rows: decoded on the device exactly as on the CPU.
        let (table, _) = block_matrix(format, 40, 512, seed);
        let tokens = [0u32, 39, 7, 7, 21];
        let want = c.embed(&table, &tokens).unwrap();
        let bytes = table.storage_bytes();
        let gt = g.upload_weight(table).unwrap();
        assert!(format!("{:?}", gt).contains("Packed"), "{name}: kept packed on the device");
        assert!(gt.device_bytes() <= bytes + 4, "{name}: {} bytes on the device for {bytes} in the file", gt.device_bytes());
        check(&g, &g.embed(&gt, &tokens).unwrap(), &want, 0.0, &format!("embed {name}"));

        // One-token products on the matrix cores: weights and inputs meet as f16.
        for (n, k) in [(48, 512), (20, 1536), (3, 256)] {
            let (cw, gw) = block_matrix_twice(format, n, k, seed + n as u64);
            let gw = g.upload_weight(gw).unwrap();
            let x = pair(&g, 1, k, random(&mut rng, k, 1.0));
            let bias = pair(&g, 1, n, random(&mut rng, n, 0.5));
            let want = c.linear(&x.cpu, &cw, Some(&bias.cpu)).unwrap();
            check(&g, &g.linear(&x.gpu, &gw, Some(&bias.gpu)).unwrap(), &want, 4e-3, &format!("gemv {name} N={n} K={k}"));
            let mut res = pair(&g, 1, n, random(&mut rng, n, 1.0));
            g.linear_add(&x.gpu, &gw, None, &mut res.gpu).unwrap();
            c.add_assign(&mut res.cpu, &c.linear(&x.cpu, &cw, None).unwrap()).unwrap();
            check(&g, &res.gpu, &res.cpu, 4e-3, &format!("gemv {name} + residual"));
        }

        // The norm fused into several projections (rows of one tile in different matrices) and
        // into the gated MLP's first half.
        let k = 768;
        let x = pair(&g, 1, k, random(&mut rng, k, 2.0));
        let norm = pair(&g, 1, k, random(&mut rng, k, 1.5));
        let ws: Vec<_> = [40, 24, 5, 3]
            .iter()
            .map(|&rows| {
                let (cw, gw) = block_matrix_twice(format, rows, k, seed + 7 * rows as u64);
                (cw, g.upload_weight(gw).unwrap())
            })
            .collect();
        let cp = |i: usize| Proj::<CpuBackend> { weight: &ws[i].0, bias: None };
        let gp = |i: usize| Proj::<GpuBackend> { weight: &ws[i].1, bias: None };
        let want = c.norm_linears(&x.cpu, &norm.cpu, 1e-6, [cp(0), cp(1), cp(2), cp(3)]).unwrap();
        let got = g.norm_linears(&x.gpu, &norm.gpu, 1e-6, [gp(0), gp(1), gp(2), gp(3)]).unwrap();
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            check(&g, a, b, 4e-3, &format!("norm_linears[{j}] {name}"));
        }
        let (gate, up) = (block_matrix_twice(format, 72, k, seed + 1), block_matrix_twice(format, 72, k, seed + 2));
        let (ggate, gup) = (g.upload_weight(gate.1).unwrap(), g.upload_weight(up.1).unwrap());
        let want = c.norm_silu_gate_up(&x.cpu, &norm.cpu, 1e-6, Proj { weight: &gate.0, bias: None }, Proj { weight: &up.0, bias: None }).unwrap();
        let got = g.norm_silu_gate_up(&x.gpu, &norm.gpu, 1e-6, Proj { weight: &ggate, bias: None }, Proj { weight: &gup, bias: None }).unwrap();
        check(&g, &got, &want, 4e-3, &format!("norm_silu_gate_up {name}"));

        // Prefill (past the few-token GEMV): the GEMM decodes each step's run in registers to the
        // bf16 the widened path uploaded, so it gives the widened GEMM's bits exactly; from 256
        // tokens on Hopper, the whole weight is decoded to that bf16 first (T = 300).
        for (t, n, k) in [(9, 130, 512), (131, 256, 1024), (300, 384, 512)] {
            let (m, wide) = block_matrix(format, n, k, seed + 3);
            let (gp, gw) = (g.upload_weight(m).unwrap(), g.upload_weight(Box::new(wide)).unwrap());
            let x = g.upload_f32(t, k, &random(&mut rng, t * k, 1.0)).unwrap();
            let (a, b) = (g.linear(&x, &gp, None).unwrap(), g.linear(&x, &gw, None).unwrap());
            assert_eq!(g.to_host(&a).unwrap(), g.to_host(&b).unwrap(), "gemm {name} T={t} N={n} K={k}: packed and widened differ");
        }
    }
}

/// A model's greedy continuation on the GPU, checked against the CPU: prompt logits close, and at
/// every generated position the GPU's token is the CPU's argmax or within rounding of it (a random
/// fixture's top two logits can be closer than f16 weights resolve).
fn check_quantized_greedy(name: &str, path: &std::path::Path, prompt: &[u32]) {
    // The CPU's f32 reference, not its integer kernels (which round the input to 8 bits).
    let load = |device| {
        let opts = EngineOptions { device, ctx_size: Some(128), cpu_kernels: CpuKernels::Reference, ..EngineOptions::new(path) };
        Engine::load(&opts, &mut |_| {}).unwrap()
    };
    let (mut on_cpu, mut on_gpu) = (load(Device::Cpu), load(Device::Cuda));
    assert!(on_gpu.report().device.starts_with("cuda"), "{}", on_gpu.report().device);
    let err = relative_error(&on_gpu.logits(prompt).unwrap(), &on_cpu.logits(prompt).unwrap());
    assert!(err < 2e-2, "{name}: prompt logits relative error {err}");
    let tokens = on_gpu.generate_raw(&greedy(prompt.to_vec(), 16)).unwrap().tokens;
    let mut history = prompt.to_vec();
    history.extend_from_slice(&tokens[..tokens.len() - 1]);
    let all = on_cpu.logits_all(&history).unwrap();
    let vocab = all.len() / history.len();
    let (mut exact, mut worst) = (0, 0f32);
    for (i, &t) in tokens.iter().enumerate() {
        let row = &all[(prompt.len() - 1 + i) * vocab..(prompt.len() + i) * vocab];
        let (max, scale) = (row.iter().fold(f32::MIN, |m, &v| m.max(v)), row.iter().fold(0f32, |m, v| m.max(v.abs())));
        exact += usize::from(row[t as usize] == max);
        worst = worst.max((max - row[t as usize]) / scale);
    }
    println!("{name}: prompt logits relative error {err:.2e}; {exact}/{} GPU greedy tokens are the CPU's argmax, worst gap {worst:.1e}", tokens.len());
    assert!(worst < 1e-2, "{name}: a GPU greedy token is {worst} (of the largest logit) below the CPU's best");
    assert!(exact * 4 >= tokens.len() * 3, "{name}: only {exact} of {} greedy tokens agree", tokens.len());
}

#[test]
fn quantized_fixture_models_decode_alike_on_cpu_and_gpu() {
    if gpu().is_none() {
        return;
    }
    let prompt: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 250).collect();
    let scratch = |name: &str| std::env::temp_dir().join(format!("atlas-gpu-quant-{}-{name}", std::process::id()));
    let mut cases: Vec<(String, PathBuf)> = Vec::new();
    // The fixtures are 64 wide: whole runs of 32, not whole k-quant super-blocks (Q4_K_M falls
    // back to Q8_0 there; the k-quant kernels are checked on random blocks above).
    for base in ["qwen3_5_tiny.gguf", "qwen3_moe_tiny.gguf"] {
        for target in ["Q8_0", "Q4_0", "Q4_0_ROCMFP4_EVEN", "Q4_0_ROCMFP4_FAST_EVEN"] {
            let out = scratch(&format!("{target}-{base}"));
            atlas::quantize::quantize_gguf(&fixture(base), &out, atlas::quantize::parse_target(target).unwrap(), &mut |_, _, _| {}).unwrap();
            cases.push((format!("{base} {target}"), out));
        }
    }
    let nvfp4 = scratch("nvfp4");
    atlas::quantize::quantize_nvfp4(&fixture("chat_tiny"), &nvfp4, &mut |_, _, _| {}).unwrap();
    cases.push(("chat_tiny NVFP4".into(), nvfp4));
    for (name, path) in &cases {
        check_quantized_greedy(name, path, &prompt);
    }
    for (_, path) in cases {
        if path.is_dir() {
            std::fs::remove_dir_all(path).unwrap();
        } else {
            std::fs::remove_file(path).unwrap();
        }
    }
}

/// A conversation resumed from the prefix cache after another took the live cache continues
/// exactly as it would have from the live cache: the saved keys, values and recurrent states are
/// copies, bit for bit. (Dense models keep full blocks only, and recompute the rest in another
/// split, so they are held to the CPU tolerance instead.)
#[test]
fn a_restored_prefix_continues_as_the_live_cache_would() {
    if gpu().is_none() {
        return;
    }
    let mut rng = Rng::new(7);
    let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % 256) as u32).collect() };
    for name in ["qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_untied_gqa"] {
        let load = || Engine::load(&EngineOptions { device: Device::Cuda, ctx_size: Some(512), ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
        let (first, other, extra) = (tokens(300), tokens(290), tokens(40));
        let request = |prompt: Vec<u32>| GenerateRequest { logprobs: Some(4), ..greedy(prompt, 12) };
        let (mut live, mut resumed) = (load(), load());
        let answer = live.generate_raw(&request(first.clone())).unwrap();
        assert_eq!(resumed.generate_raw(&request(first.clone())).unwrap().tokens, answer.tokens, "{name}");
        resumed.generate_raw(&request(other)).unwrap();
        let follow_up = [first, answer.tokens, extra].concat();
        let want = live.generate_raw(&request(follow_up.clone())).unwrap();
        let got = resumed.generate_raw(&request(follow_up)).unwrap();
        if name == "qwen3_untied_gqa" {
            assert_eq!(got.cached_tokens, 256, "{name}");
            let worst = got.logprobs.iter().zip(&want.logprobs).map(|(g, w)| (g.logprob - w.logprob).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-2, "{name}: log-probabilities differ by {worst}");
        } else {
            assert_eq!(got.cached_tokens, want.cached_tokens, "{name}");
            assert_eq!((got.tokens, got.logprobs), (want.tokens, want.logprobs), "{name}");
        }
    }
}

/// Speculative decoding on the GPU: greedy answers with drafts equal those without on the
/// fixtures (the dense one drafts by prompt lookup and has drafts rejected; the hybrid ones, whose
/// random weights never repeat a passage, draft with their multi-token-prediction heads, nearly
/// always wrongly, so their rollback runs too). A checked step gives every position the logits
/// of single steps (tested above), so this holds bit for bit, not only where the margins are wide.
#[test]
fn drafting_on_the_gpu_changes_no_greedy_answer() {
    if gpu().is_none() {
        return;
    }
    let (mut drafted, mut accepted) = (0, 0);
    for name in ["qwen3_untied_gqa", "qwen3_5_tiny", "qwen3_5_moe_tiny"] {
        let load = |draft_max| {
            let opts = EngineOptions { device: Device::Cuda, ctx_size: Some(512), draft_max, draft_p_min: 0.0, ..EngineOptions::new(fixture(name)) };
            Engine::load(&opts, &mut |_| {}).unwrap()
        };
        let (mut plain, mut spec) = (load(0), load(4));
        for seed in 0..3u32 {
            let passage: Vec<u32> = (0..24).map(|i| (i * 37 + seed * 11) % 256).collect();
            let prompt = [passage.clone(), passage.clone(), passage[..10].to_vec()].concat();
            let want = plain.generate_raw(&greedy(prompt.clone(), 60)).unwrap();
            let got = spec.generate_raw(&greedy(prompt, 60)).unwrap();
            let same = got.tokens.iter().zip(&want.tokens).take_while(|(a, b)| a == b).count();
            println!("{name} seed {seed}: {same} of 60 tokens agree, {} of {} drafts confirmed", got.draft_accepted, got.draft_tokens);
            assert_eq!(got.tokens, want.tokens, "{name} seed {seed}");
            drafted += got.draft_tokens;
            accepted += got.draft_accepted;
        }
    }
    assert!(accepted > 0 && drafted > accepted, "{accepted} of {drafted}");
}

/// A seeded request gives the same tokens and log-probabilities whether its prompt was computed or
/// came from the cache: run again (all but the last prompt token cached), and after a prompt that
/// shares only its first 60 tokens (the cache reused that far). The GPU's prefill rounds otherwise
/// than its decode step, so a dense model's last prompt token always runs alone; a hybrid one
/// resumes only at saved states and repeats its pieces from there (`Engine::prefill_in_pieces`).
#[test]
fn a_cached_prompt_gives_the_bits_of_an_uncached_one() {
    if gpu().is_none() {
        return;
    }
    for name in ["qwen3_untied_gqa", "qwen3_fp8", "qwen3_5_tiny", "qwen3_5_moe_tiny"] {
        let load = || {
            let opts = EngineOptions { device: Device::Cuda, ctx_size: Some(512), ..EngineOptions::new(fixture(name)) };
            Engine::load(&opts, &mut |_| {}).unwrap()
        };
        let prompt: Vec<u32> = (0..100u32).map(|i| (i * 53 + 7) % 256).collect();
        let sampling = atlas::sampling::SamplingParams { temperature: 0.9, seed: Some(3), ..Default::default() };
        let req = GenerateRequest { prompt: prompt.clone(), max_tokens: Some(16), sampling, stop: vec![], ignore_eos: true, grammar: None, logprobs: Some(3) };
        let mut engine = load();
        let alone = engine.generate_raw(&req).unwrap();
        let again = engine.generate_raw(&req).unwrap();
        let mut other = prompt[..60].to_vec();
        other.extend((0..40u32).map(|i| (i * 29 + 11) % 256));
        let mut shared = load();
        shared.generate_raw(&greedy(other, 1)).unwrap();
        let after_other = shared.generate_raw(&req).unwrap();
        if name.starts_with("qwen3_5") {
            // Recurrent layers resume only from a saved state, none of which lies in this prompt.
            assert_eq!((again.cached_tokens, after_other.cached_tokens), (0, 0), "{name}");
        } else {
            assert_eq!((again.cached_tokens, after_other.cached_tokens), (prompt.len() - 1, 60), "{name}");
        }
        for (got, what) in [(&again, "run again"), (&after_other, "after a prompt sharing 60 tokens")] {
            assert_eq!(got.tokens, alone.tokens, "{name}, {what}: tokens");
            assert_eq!(got.logprobs, alone.logprobs, "{name}, {what}: log-probabilities");
        }
    }
}

/// The multi-token-prediction head on the GPU drafts what the numpy reference drafts
/// (tests/fixtures/hybrid_reference.py; golden.json "mtp"), as the CPU does (engine::draft).
#[test]
fn the_drafting_head_on_the_gpu_guesses_as_the_reference() {
    use atlas::model::safetensors::SafetensorsStore;
    use atlas::model::{Bound, LanguageModel, ModelConfig};
    for name in ["qwen3_5_tiny", "qwen3_5_vl_tiny", "qwen3_5_moe_tiny"] {
        let Some(g) = gpu() else { return };
        let dir = fixture(name);
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let store = SafetensorsStore::open_dir(&dir).unwrap();
        let mut model = Bound::load(g, config, &store, 256, &mut |_| {}).unwrap();
        let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let ids = |key: &str| -> Vec<u32> { golden["mtp"][key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
        let prompt = ids("tokens");
        assert!(model.can_draft(), "{name}");
        model.set_drafting(true);
        let next = model.forward_greedy(&prompt, 0, usize::MAX).unwrap();
        assert_eq!(next as u64, golden["mtp"]["next"].as_u64().unwrap(), "{name}");
        let drafts = model.draft(next, prompt.len(), 3, usize::MAX, 0.0).unwrap();
        // The MoE head's later guesses hang on its router's choice of experts, which the GPU's
        // bf16 prefill activations can turn where the reference's margins are ~0.1: its first.
        let checked = if name.contains("moe") { 1 } else { 3 };
        assert_eq!(drafts[..checked], ids("drafts")[..checked], "{name}: {drafts:?}");
    }
}

/// The bf16 and FP8 one-token kernels take up to 8 tokens at once (FP8: one per column of their
/// mma): each token's output has exactly the bits it gets alone, through a plain projection with a
/// residual, the fused RMSNorm + projections and the fused norm + gated MLP half (inputs larger
/// than the shared memory stages at once go in several launches); and matches the CPU.
#[test]
fn decode_kernels_give_each_of_several_tokens_its_own_bits() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(23);
    // bf16 twice: its single-sequence kernels, then the matrix-core ones of a model that decodes
    // several sequences side by side.
    // [4800, 12288] takes the FP8 one-token kernel's two-slot form on an H200 (a grid of 300 blocks:
    // 1.1 waves of the three-slot blocks, 0.76 of the two-slot ones).
    // [20, 1024]: FP8's one-token gate/up pairs 8 gate rows with their up rows a block; a partial pair.
    // FP8's several tokens take the split kernels on NVIDIA sm_80+ (a block per unit's share of K).
    let kinds = [(true, false), (false, false), (false, true)];
    for ((n, k), (fp8, several)) in [(256, 512), (640, 2048), (20, 1024), (96, 5120), (48, 17408), (4800, 12288)].into_iter().flat_map(|s| kinds.map(|kind| (s, kind))) {
        g.plan_sequences(if several { 8 } else { 1 });
        let format = match (fp8, several) {
            (true, _) => "fp8",
            (false, false) => "bf16",
            (false, true) => "bf16 (several sequences)",
        };
        // bf16 decode keeps 16 or more significant bits of the input, fp8 11.
        let tol = if fp8 { 2e-2 } else { 1e-4 };
        let (wc, wg) = matrix_pair(&mut rng, fp8, n, k);
        let (uc, ug) = matrix_pair(&mut rng, fp8, n, k);
        let (wc, wg, uc, ug) = (c.upload_weight(wc).unwrap(), g.upload_weight(wg).unwrap(), c.upload_weight(uc).unwrap(), g.upload_weight(ug).unwrap());
        several_tokens_get_their_own_bits(&g, &c, &mut rng, [(&wc, &wg), (&uc, &ug)], 1..=8, tol, format);
    }
}

/// For each token count of `counts`: `t` tokens through a plain projection with a residual, the
/// fused RMSNorm + projection and the fused norm + gated MLP half (weights W and U, each on the
/// CPU and the GPU with the same values) give each token the bits it gets alone, and match the CPU
/// within `tol`.
fn several_tokens_get_their_own_bits(
    g: &GpuBackend,
    c: &CpuBackend,
    rng: &mut Rng,
    [(wc, wg), (uc, ug)]: [(&<CpuBackend as Backend>::Weight, &<GpuBackend as Backend>::Weight); 2],
    counts: impl IntoIterator<Item = usize>,
    tol: f32,
    format: &str,
) {
    let (n, k) = (wc.rows(), wc.cols());
    let norm = pair(g, 1, k, random(rng, k, 1.0));
    for t in counts {
        let x = pair(g, t, k, random(rng, t * k, 2.0));
        let res = pair(g, t, n, random(rng, t * n, 1.0));
        let proj = |w| Proj { weight: w, bias: None };
        // [T, n] each: x·Wᵀ + residual, norm(x)·Wᵀ, silu(norm(x)·Gᵀ) * norm(x)·Uᵀ.
        let run = |x: &GpuTensor, res: &GpuTensor| -> [Vec<f32>; 3] {
            let mut y = g.save_tensor(res).unwrap();
            g.linear_add(x, wg, None, &mut y).unwrap();
            let [normed] = g.norm_linears(x, &norm.gpu, 1e-6, [proj(wg)]).unwrap();
            let gated = g.norm_silu_gate_up(x, &norm.gpu, 1e-6, proj(wg), proj(ug)).unwrap();
            [g.to_host(&y).unwrap(), g.to_host(&normed).unwrap(), g.to_host(&gated).unwrap()]
        };
        let all = run(&x.gpu, &res.gpu);
        for row in 0..t {
            let one_x = g.upload_f32(1, k, &x.cpu.data[row * k..(row + 1) * k]).unwrap();
            let one_res = g.upload_f32(1, n, &res.cpu.data[row * n..(row + 1) * n]).unwrap();
            let alone = run(&one_x, &one_res);
            for (what, (a, b)) in ["linear + residual", "norm + linear", "norm + gate/up"].iter().zip(all.iter().zip(&alone)) {
                assert_eq!(&a[row * n..(row + 1) * n], &b[..], "{format} {what}: [{n}, {k}], token {row} of {t}");
            }
        }
        let mut want = res.cpu.clone();
        c.linear_add(&x.cpu, wc, None, &mut want).unwrap();
        let got = g.upload_f32(t, n, &all[0]).unwrap();
        check(g, &got, &want, tol, &format!("{format} linear [{n}, {k}] x {t} tokens"));
        let want = c.norm_silu_gate_up(&x.cpu, &norm.cpu, 1e-6, Proj { weight: wc, bias: None }, Proj { weight: uc, bias: None }).unwrap();
        let got = g.upload_f32(t, n, &all[2]).unwrap();
        check(g, &got, &want, tol, &format!("{format} norm + gate/up [{n}, {k}] x {t} tokens"));
    }
}

/// Block formats (GGUF, NVFP4) too: their one-token kernels' `_tokens` forms take up to 8 tokens
/// (on matrix cores one per column of the mma; several inputs without a norm read in place), each
/// token with the bits it gets alone, within the packed GEMVs' 4e-3 of the CPU; and a one-token
/// block that takes several tiles gives each the bits a block of one would.
#[test]
fn packed_decode_kernels_give_each_of_several_tokens_its_own_bits() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(26);
    g.plan_sequences(8);
    let formats: Vec<Option<GgmlFormat>> = GgmlFormat::ALL.iter().copied().map(Some).chain([None]).collect();
    for (i, format) in formats.into_iter().enumerate() {
        let name = format.map_or("nvfp4 (safetensors)".to_string(), |f| f.to_string());
        // Rows of three runs leave the meta bytes of 2-byte and 1-byte formats unaligned for the
        // weight slots: one token takes the several-token kernel there.
        let short = format.is_none_or(|f| f.block_size() <= 32).then_some((12, 96));
        // More tiles than an H100's or H200's SMs hold blocks (132 × 3): the one-token kernels'
        // blocks take several tiles each, one or two slot-loads a tile.
        let tall = [(6_600, 512), (3_400, 2304)];
        // The tall shapes draw their inputs from their own generator, so that the others' inputs
        // do not depend on them (K = 96 leaves a 12-output gate/up little averaging: its error
        // against the CPU swings with the draw).
        for (n, k) in [(40, 512), (24, 2304)].into_iter().chain(short).chain(tall) {
            let seed = 500 + 10 * i as u64 + n as u64;
            let (wc, wg) = block_matrix_twice(format, n, k, seed);
            let (uc, ug) = block_matrix_twice(format, n, k, seed + 1);
            let (wc, wg, uc, ug) = (c.upload_weight(wc).unwrap(), g.upload_weight(wg).unwrap(), c.upload_weight(uc).unwrap(), g.upload_weight(ug).unwrap());
            let mut own = Rng::new(seed + 2);
            let rng = if tall.contains(&(n, k)) { &mut own } else { &mut rng };
            several_tokens_get_their_own_bits(&g, &c, rng, [(&wc, &wg), (&uc, &ug)], [1, 2, 5, 8], 4e-3, &name);
        }
    }
}

/// A step of a few tokens (checking drafts) gives every position exactly the logits single decode
/// steps give it, on dense, FP8, MoE and hybrid fixtures: the one-token kernels take the few
/// tokens together (bf16, FP8), attention and experts take them one by one. So speculative
/// decoding on the GPU chooses what plain decoding chooses, bit for bit.
#[test]
fn a_step_of_a_few_tokens_gives_each_the_logits_of_single_steps() {
    if gpu().is_none() {
        return;
    }
    let mut rng = Rng::new(31);
    for name in ["qwen3_untied_gqa", "qwen3_tied", "qwen3_fp8", "qwen3_moe_tiny", "qwen3_5_tiny", "qwen3_5_moe_tiny"] {
        let load = || Engine::load(&EngineOptions { device: Device::Cuda, ctx_size: Some(256), ..EngineOptions::new(fixture(name)) }, &mut |_| {}).unwrap();
        let (mut single, mut together) = (load(), load());
        let prefix: Vec<u32> = (0..20).map(|_| (rng.next_u64() % 256) as u32).collect();
        for t in [2, 5, 8] {
            let run: Vec<u32> = (0..t).map(|_| (rng.next_u64() % 256) as u32).collect();
            single.forward(&prefix, 0).unwrap();
            together.forward(&prefix, 0).unwrap();
            let want: Vec<f32> = run.iter().enumerate().flat_map(|(i, &tok)| single.forward(&[tok], prefix.len() + i).unwrap()).collect();
            let got = together.forward_all(&run, prefix.len()).unwrap();
            assert!(got == want, "{name}: {t} tokens together differ from single steps");
        }
    }
}

/// Several engines of one model on as many threads, their decode steps batched on the GPU: every
/// request (greedy, sampled on the device, top-k) answers token for token as it does alone, on the fixtures (dense, FP8, hybrid, hybrid MoE, a Q8_0 GGUF) and on real-sized bf16,
/// FP8 and Q4_K weights (Qwen3-0.6B's shape, random), where the decode kernels take several
/// tokens per launch (packed formats too).
#[test]
fn batched_decoding_on_the_gpu_answers_as_alone() {
    if gpu().is_none() {
        return;
    }
    let request = |agent: usize, turn: usize| {
        let sampling = match (agent + turn) % 3 {
            0 => atlas::sampling::SamplingParams::default(),
            1 => atlas::sampling::SamplingParams { temperature: 0.9, seed: Some(agent as u64 * 31 + turn as u64), ..Default::default() },
            _ => atlas::sampling::SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.9, seed: Some(7 + agent as u64), ..Default::default() },
        };
        let prompt: Vec<u32> = (0..(6 + 5 * agent + turn) as u32).map(|i| (i * 7 + agent as u32 * 13 + turn as u32 + 1) % 200 + 3).collect();
        GenerateRequest { prompt, max_tokens: Some(40), sampling, stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
    };
    let run = |engine: &mut Engine, agent: usize| -> Vec<Vec<u32>> {
        (0..3).map(|turn| engine.generate_raw(&request(agent, turn)).unwrap().tokens).collect()
    };
    let agents = 6;
    let cases: [(&str, Option<&str>); 8] = [
        ("qwen3_untied_gqa", None),
        ("qwen3_fp8", None),
        ("qwen3_5_tiny", None),
        ("qwen3_5_moe_tiny", None),
        ("qwen3_5_moe_tiny.q8_0.gguf", None),
        ("qwen3-0.6b", Some("bf16")),
        ("qwen3-0.6b", Some("fp8")),
        ("qwen3-0.6b", Some("q4_k")),
    ];
    for (name, synthetic) in cases {
        let load = |parallel| {
            let opts = EngineOptions { device: Device::Cuda, ctx_size: Some(256), parallel, ..EngineOptions::new(fixture(name)) };
            match synthetic {
                Some(format) => Engine::load_synthetic(name, format, &opts, &mut |_| {}).unwrap(),
                None => Engine::load(&opts, &mut |_| {}).unwrap(),
            }
        };
        // Each agent alone first (no other sequence decoding), on the engines that then run them
        // all at once: a model that decodes several sequences may pick other kernels (bf16 on
        // matrix cores) than a single-sequence one, with each token's bits independent of the batch.
        let mut engines = load(agents).split().unwrap();
        assert_eq!(engines.len(), agents);
        let expected: Vec<Vec<Vec<u32>>> = engines.iter_mut().enumerate().map(|(a, e)| run(e, a)).collect();
        let stats = std::thread::scope(|s| {
            let threads: Vec<_> = engines
                .into_iter()
                .enumerate()
                .map(|(agent, mut engine)| {
                    let expected = &expected[agent];
                    let run = &run;
                    s.spawn(move || {
                        let got = run(&mut engine, agent);
                        assert_eq!(&got, expected, "{name} {synthetic:?}: agent {agent}");
                        engine.batch_stats()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).last().unwrap()
        });
        println!("{name} {synthetic:?}: {stats:?}");
        assert!(stats.widest >= 2 && stats.rows > stats.steps, "{name}: {stats:?}");
    }
}
