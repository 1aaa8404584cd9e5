#!/usr/bin/env bash
# docs/quantization.md's quality table for the default model: SmolLM2-135M-Instruct (shipped as
# Q4_1) decoded to an F32 base (scripts/dequant_gguf.py: exact), every format `atlas quantize`
# writes made from that base, plus llama-quantize's Q4_K_M (ggml's own search) and the types Atlas
# reads but does not write (IQ4_NL, IQ4_XS, Q4_1); then each file scored against the base on the
# same text by Atlas (`atlas kld`, CPU) and, where llama.cpp has the type (not ROCmFP4), by
# llama.cpp (`llama-perplexity --kl-divergence`): one markdown row per file and engine. Files that
# exist are kept, so a second run only scores.
#
# Usage: scripts/kld_table.sh ATLAS_BIN LLAMA_BIN_DIR SMOLLM2_Q4_1.gguf TEXT WORK_DIR [CHUNKS]
#   LLAMA_BIN_DIR holds llama-quantize and llama-perplexity (a CPU build is enough).
#   e.g. scripts/kld_table.sh target/release/atlas /tmp/llama-cpu/bin \
#        ~/.cache/atlas/SmolLM2-135M-Instruct.Q4_1.gguf LICENSE-APACHE /tmp/kld 8
set -euo pipefail
[[ $# -ge 5 ]] || { sed -n 2,13p "$0"; exit 2; }
atlas=$(realpath "$1") llama=$(realpath "$2") smol=$(realpath "$3") text=$(realpath "$4") work=$5 chunks=${6:-8}
ctx=128
mkdir -p "$work"
base=$work/smollm2-f32.gguf
[[ -f $base ]] || python3 "$(dirname "$0")/dequant_gguf.py" "$smol" "$base"

atlas_types=(Q8_0 Q6_K Q5_K Q4_K_M Q4_K Q4_0 Q4_0_ROCMFP4 Q4_0_ROCMFP4_LEAN Q4_0_ROCMFP4_COHERENT Q4_0_ROCMFP4_FAST
    Q4_0_ROCMFP4_FAST_COHERENT Q4_0_ROCMFP4_STRIX Q4_0_ROCMFP4_STRIX_LEAN Q4_0_ROCMFP4_EVEN Q4_0_ROCMFP4_FAST_EVEN)
llama_types=(Q4_K_M IQ4_NL IQ4_XS Q4_1)
files=()
for t in "${atlas_types[@]}"; do
    f=$work/atlas-$t.gguf
    [[ -f $f ]] || "$atlas" quantize -m "$base" --to "$t" -o "$f" >"$work/atlas-$t.log" 2>&1
    files+=("$f")
done
for t in "${llama_types[@]}"; do
    f=$work/llama-$t.gguf
    [[ -f $f ]] || "$llama/llama-quantize" "$base" "$f" "$t" >"$work/llama-$t.log" 2>&1
    files+=("$f")
done

# llama.cpp: the base's log-probabilities once, then each file against them.
logits=$work/base.kld
[[ -f $logits ]] || "$llama/llama-perplexity" -m "$base" -f "$text" -c "$ctx" --chunks "$chunks" -t "$(nproc)" \
    --kl-divergence-base "$logits" >"$work/base-llama.log" 2>&1

echo "| file | MiB | engine | PPL | mean KLD | median | 99 % | same top |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for f in "${files[@]}"; do
    name=$(basename "$f" .gguf) mib=$(( $(stat -c %s "$f") / 1048576 ))
    if "$atlas" kld --base "$base" -m "$f" -f "$text" --ctx "$ctx" --chunks "$chunks" --device cpu --json >"$work/$name.atlas.json" 2>"$work/$name.atlas.log"; then
        row_from=json
    else
        row_from=error
    fi
    python3 - "$work/$name.atlas.json" "$name" "$mib" "$row_from" "$work/$name.atlas.log" <<'PY'
import json, sys
if sys.argv[4] == "error":
    # A file Atlas refuses (say, a type it does not read): the row says why.
    why = [l for l in open(sys.argv[5]).read().splitlines() if l.startswith("error")][-1:] or ["failed"]
    print(f"| {sys.argv[2]} | {sys.argv[3]} | Atlas | – | {why[0].replace('|', '/')} | | | |")
    sys.exit(0)
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {sys.argv[3]} | Atlas | {r['model']['ppl']:.3f} | {r['kld_mean']:.5f} ± {r['kld_error']:.5f} | "
      f"{r['kld_median']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_agreement']:.1f} % |")
PY
    [[ $name == *ROCMFP4* ]] && continue  # types 100/101 exist only in the ROCmFPX fork
    "$llama/llama-perplexity" -m "$f" -f "$text" -c "$ctx" --chunks "$chunks" -t "$(nproc)" \
        --kl-divergence-base "$logits" --kl-divergence >"$work/$name.llama.log" 2>&1
    python3 - "$work/$name.llama.log" "$name" "$mib" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def grab(label):
    m = re.search(r"^" + re.escape(label) + r"\s*:\s*([-0-9.e+]+)(?:\s*±\s*([-0-9.e+]+))?", text, re.M)
    return (m.group(1), m.group(2)) if m else ("?", None)
def num(label, digits):
    v = grab(label)
    return (f"{float(v[0]):.{digits}f}" if v[0] != "?" else "?"), (f"{float(v[1]):.{digits}f}" if v[1] else "?")
mean, err = num("Mean    KLD", 5)
print(f"| {sys.argv[2]} | {sys.argv[3]} | llama.cpp | {num('Mean PPL(Q)', 3)[0]} | {mean} ± {err} | "
      f"{num('Median  KLD', 5)[0]} | {num('99.0%   KLD', 4)[0]} | {num('Same top p', 1)[0]} % |")
PY
done
