#!/bin/bash
# The weight formats' receipt for gemma3-27b in one run on one GPU (bench/results/quant_h200.json):
# the bf16 and FP8 cells while the synthetic Q4_K_M and Q8_0 files are written in the background
# (CPU only, niced), then the two files beside llama.cpp's llama-bench, then W1 (32 concurrent,
# 512 in / 128 out) through `muser serve --quantization fp8`, merged in as `w1_fp8`: the bars'
# cells first, where a device call's time is short.
#
#   bash bench/quant_receipt.sh LLAMA_BENCH TOKENIZER_GGUF OUT_DIR
#
# LLAMA_BENCH: a CUDA llama-bench (bench/llama_cpp_cuda.sh); TOKENIZER_GGUF: a GGUF holding Gemma 3's
# vocabulary (bench/tokenizer_gguf.py); the files go to /dev/shm (~46 GB of host memory).
set -euo pipefail
bench=$1 tokenizer=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$here"):${PYTHONPATH:-}"  # muser, for the scripts run by path
mkdir -p "$out"
start=$(date +%s)
(for t in q4_k_m q8_0; do
    nice -n 10 python3 "$here/synth_gguf.py" --model-config gemma3-27b --type $t \
        --tokenizer "$tokenizer" --out /dev/shm/gemma3-27b-$t.gguf
 done > "$out/synth.log" 2>&1) &
synth=$!
python3 "$here/quant_bench.py" --formats bf16,fp8 --reps 5 --out "$out/quant_h200.json" \
    2>&1 | grep -v '^{' | tail -n 10
echo "bf16 and FP8 done at $(( $(date +%s) - start )) s; waiting for the GGUF files"
wait $synth || { echo "synth_gguf.py failed: $out/synth.log"; exit 1; }
python3 "$here/quant_bench.py" --formats '' \
    --gguf q4_k_m=/dev/shm/gemma3-27b-q4_k_m.gguf,q8_0=/dev/shm/gemma3-27b-q8_0.gguf \
    --llama-bench "$bench" --reps 5 --out "$out/quant_h200.json" --plot "$out/quant_h200.png" \
    2>&1 | grep -v '^{' | tail -n 10
echo "GGUF cells done at $(( $(date +%s) - start )) s"
python3 "$here/serve_bench.py" --phases w1 --device cuda --load-format dummy \
    --model-config gemma3-27b --max-model-len 4096 --max-num-seqs 64 --quantization fp8 \
    --out "$out/w1_fp8.json" 2>&1 | tail -n 3
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
receipt = json.loads((out / "quant_h200.json").read_text())
w1 = json.loads((out / "w1_fp8.json").read_text())
receipt["w1_fp8"] = next(c for c in w1["cells"] if c.get("workload") == "W1") | {
    "gpu": w1.get("gpu"), "machine": w1.get("machine")}
(out / "quant_h200.json").write_text(json.dumps(receipt, indent=1) + "\n")
for c in receipt["cells"]:
    print(c["quantization"], {k: round(c[k], 3) for k in ("decode_ms", "decode_graph_ms",
          "decode_steady_ms", "floor_ms", "fraction_of_floor", "prefill_tok_s",
          "llama_cpp_decode_ms", "decode_sm_mhz_median", "decode_power_w_median") if k in c})
PY
echo "receipt in $out at $(( $(date +%s) - start )) s"
