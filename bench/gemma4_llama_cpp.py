"""muser against llama.cpp (llama-cpp-python) on the tiny Gemma 4 GGUF files of
tests/gemma4/gguf_file.py, one per variant: float32 logits at every position of a prompt past
the window, max |difference| and top-1 agreement, and whether llama.cpp loads the file at all.

    PYTHONPATH=$PWD:/path/to/llama-cpp-python python bench/gemma4_llama_cpp.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from muser.loading import load_model
from tests.gemma4.checkpoints import VARIANTS, write_checkpoint
from tests.gemma4.gguf_file import F32, write_gguf
from tests.gemma4.test_parity import prompt, runner_of


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits of every position, float32 on the CPU."""
    from llama_cpp import Llama  # NOTE: the optional reference, imported where it is used

    llm = Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=2, verbose=False,
                n_gpu_layers=0)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def compare(variant: str, directory: Path) -> dict:
    checkpoint = write_checkpoint(variant, directory / variant)
    path = write_gguf(checkpoint, directory / f"{variant}.gguf", F32)
    model = load_model(path, torch.float32, "cpu", progress=False, pack=True)
    runner, ids = runner_of(model), prompt(50, 7)
    ours = runner.forward([runner.allocate()], [ids], logit_rows=list(range(len(ids))))
    ours = ours.double().numpy()
    try:
        theirs = llama_cpp_logits(path, ids)
    except Exception as exc:  # noqa: BLE001 (llama.cpp reports a refused file as ValueError)
        return {"variant": variant, "llama_cpp_loads": False, "error": str(exc)[:200]}
    return {"variant": variant, "llama_cpp_loads": True, "positions": len(ids),
            "max_abs_diff": float(np.abs(ours - theirs).max()),
            "max_abs_logit": float(np.abs(ours).max()),
            "top1_equal": int((ours.argmax(-1) == theirs.argmax(-1)).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [compare(v, Path(tmp)) for v in VARIANTS]
    import llama_cpp

    result = {"llama_cpp_python": llama_cpp.__version__, "rows": rows}
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
