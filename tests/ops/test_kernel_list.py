"""A listed kernel comes back as Triton's compile path would bring it back from its cache: the
same binary, metadata, specialization and launcher source (so the launcher's build is found in
Triton's cache too); an entry whose files are gone, or that names a module outside muser's
Triton package, is skipped with a warning. Compiled for sm_90 in a fresh process without the
interpreter (no GPU needed), as in test_sm90_compile.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r'''
import importlib, json, os, sys, warnings
from pathlib import Path
from types import SimpleNamespace
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import make_launcher
from triton.compiler import ASTSource
from triton.runtime.jit import serialize_specialization_data
from muser.ops.triton import kernel_list
from muser.ops.tuning_cache import TuningCache

store_kv = importlib.import_module("muser.ops.triton.store_kv")
fn = store_kv._store_kv_kernel
signature = {"k_new": "*bf16", "v_new": "*bf16", "k_rows": "*bf16", "v_rows": "*bf16",
             "src_ptr": "*i32", "dst_ptr": "*i32", "stride_k": "i32", "stride_v": "i32",
             "ROW": "constexpr", "BLOCK": "constexpr"}
constexprs = {(8,): 256, (9,): 256}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
src = ASTSource(fn, signature, constexprs, attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
spec = serialize_specialization_data("muser.ops.triton.store_kv._store_kv_kernel", signature,
                                     constexprs, attrs, SimpleNamespace(num_warps=4), "KEY")
fn.device_caches[0] = ({"KEY": compiled}, {}, None, None, None)
store = TuningCache(Path(sys.argv[1]) / "kernels.json", {"gpu": "test"})
out = {"saved": kernel_list.save(store, [(fn, "KEY", spec)], 0)}
fn.device_caches[0][0].clear()
(rebuilt,) = kernel_list.load(store, 0)

def launcher(s):
    consts = {(s.fn.arg_names.index(k),) if isinstance(k, str) else k: v
              for k, v in s.constants.items()}
    return make_launcher(consts, dict(s.signature), None)

out["filed"] = fn.device_caches[0][0]["KEY"] is rebuilt
out["same_binary"] = rebuilt.asm["cubin"] == compiled.asm["cubin"]
out["same_metadata"] = rebuilt.metadata == compiled.metadata
out["same_constants"] = rebuilt.src.constants == src.constants
out["same_launcher"] = launcher(rebuilt.src) == launcher(src)
entry = next(iter(store.load().values()))
store.path.unlink()
store.save({"foreign": {**entry, "module": "os"}})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["foreign_loaded"] = len(kernel_list.load(store, 0))
    Path(entry["files"]["_store_kv_kernel.cubin"]).unlink()
    store.path.unlink()
    store.save({"stale": entry})
    out["stale_loaded"] = len(kernel_list.load(store, 0))
out["warnings"] = [str(w.message) for w in caught]
json.dump(out, sys.stdout)
'''


def test_a_listed_kernel_comes_back_as_compiled(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    warned = out.pop("warnings")
    assert len(warned) == 2 and all("not found or not rebuilt" in w for w in warned)
    assert out == {"saved": 1, "filed": True, "same_binary": True, "same_metadata": True,
                   "same_constants": True, "same_launcher": True, "foreign_loaded": 0,
                   "stale_loaded": 0}
