"""muser against llama.cpp (llama-cpp-python) on the tiny Gemma 4 GGUF files of
tests/gemma4/gguf_file.py, one per variant: float32 logits at every position of a prompt past
the window, max |difference| and top-1 agreement, or how llama.cpp failed (each file runs in a child
process: llama.cpp aborts on a file it cannot run).

    PYTHONPATH=$PWD:/path/to/llama-cpp-python python bench/gemma4_llama_cpp.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from muser.loading import load_model
from tests.gemma4.checkpoints import VARIANTS, write_checkpoint
from tests.gemma4.gguf_file import F32, write_gguf
from tests.gemma4.test_parity import prompt, runner_of


def llama_cpp_logits(path: Path, ids: list[int], out: Path) -> None:
    """llama.cpp's logits of every position (float32 weights and KV cache, on the CPU), saved to
    `out` (.npy)."""
    from llama_cpp import Llama  # NOTE: the optional reference, imported where it is used

    f32 = 0  # GGML_TYPE_F32: a float32 KV cache, as muser's on the CPU (llama.cpp's default is F16)
    llm = Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=2, verbose=False,
                n_gpu_layers=0, type_k=f32, type_v=f32)
    llm.eval(ids)
    np.save(out, np.array(llm.scores[:len(ids)], dtype=np.float64))


def run_llama_cpp(path: Path, ids: list[int]) -> np.ndarray | str:
    """llama_cpp_logits in a child process (llama.cpp aborts the process on files it cannot
    run), or why it gave none."""
    out = path.with_suffix(".npy")
    child = multiprocessing.get_context("spawn").Process(target=llama_cpp_logits,
                                                         args=(path, ids, out))
    child.start()
    child.join()
    return np.load(out) if child.exitcode == 0 else f"llama.cpp exited with {child.exitcode}"


def compare(variant: str, directory: Path) -> dict:
    checkpoint = write_checkpoint(variant, directory / variant)
    path = write_gguf(checkpoint, directory / f"{variant}.gguf", F32)
    model = load_model(path, torch.float32, "cpu", progress=False, pack=True)
    runner, ids = runner_of(model), prompt(50, 7)
    ours = runner.forward([runner.allocate()], [ids], logit_rows=list(range(len(ids))))
    ours = ours.double().numpy()
    theirs = run_llama_cpp(path, ids)
    if isinstance(theirs, str):
        return {"variant": variant, "llama_cpp_runs": False, "error": theirs}
    return {"variant": variant, "llama_cpp_runs": True, "positions": len(ids),
            "max_abs_diff": float(np.abs(ours - theirs).max()),
            "max_abs_logit": float(np.abs(ours).max()),
            "top1_equal": int((ours.argmax(-1) == theirs.argmax(-1)).sum())}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's machine type."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [compare(v, Path(tmp)) for v in VARIANTS]
    import llama_cpp

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "machine": cpu_name(),
              "llama_cpp_python": llama_cpp.__version__, "rows": rows}
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
