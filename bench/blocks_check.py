"""GGUF blocks kept on the GPU against the same file dequantized to bf16: weight bytes and decode
TPOT after 2,048 tokens, greedy tokens compared.

    python3 bench/blocks_check.py /dev/shm/gemma3-1b-q4_k_m.gguf $OUT/gguf_blocks.json
"""

import json
import os
import sys
from pathlib import Path

import torch

from muser import LLM, SamplingParams


def main() -> None:
    path, out = sys.argv[1], Path(sys.argv[2])
    ids = torch.randint(10, 200000, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
    res = {"gpu": torch.cuda.get_device_name(), "file_bytes": os.path.getsize(path)}
    tokens = {}
    for mode in ("blocks", "dequantize"):
        llm = LLM(path, device="cuda", gguf_weights=mode, max_num_seqs=1, max_model_len=4096,
                  progress=False)
        params = SamplingParams(max_tokens=65, ignore_eos=True)
        llm.generate(ids[:512], params)
        runs = [llm.generate(ids, params) for _ in range(3)]
        tokens[mode] = runs[-1].token_ids
        res[mode] = {"weight_bytes": llm.runner.model.weights.nbytes(),
                     "tpot_ms": sorted(r.tpot_s for r in runs)[1] * 1e3,
                     "ttft_s": sorted(r.ttft_s for r in runs)[1]}
        print(mode, res[mode], flush=True)
        del llm
        torch.cuda.empty_cache()
    res["greedy_tokens_equal"] = sum(a == b for a, b in zip(tokens["blocks"], tokens["dequantize"]))
    res["greedy_tokens"] = len(tokens["blocks"])
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
