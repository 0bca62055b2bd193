"""Kernels compiled for sm_90 on a machine without a GPU, with the ptxas Triton ships, in a fresh
process (the kernel tests import the kernels under TRITON_INTERPRET=1): where a PTX error shows
before a device run, and what the compiled code rests on can be read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The compiling process's first lines: `compiled(fn, types, constexprs, sixteen=None, **options)`
# compiles one specialization (`ptx(...)`: its PTX); `sixteen` (names) marks those arguments and
# every pointer divisible by 16, as the launcher specializes them.
PRELUDE = r'''
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compiled(fn, types, constexprs, sixteen=None, **options):
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in fn.arg_names}
    attrs = {} if sixteen is None else {
        (i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names)
        if p.endswith("_ptr") or p in sixteen}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v
                                               for k, v in constexprs.items()}, attrs=attrs)
    opts = {"num_warps": 4, "launch_pdl": constexprs.get("PDL", False)} | options
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

def ptx(fn, types, constexprs, sixteen=None, **options):
    return compiled(fn, types, constexprs, sixteen, **options).asm["ptx"]
'''
GDC = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")  # PDL's wait and release


def compile_ptx(script: str) -> dict[str, str]:
    """Run PRELUDE + `script` (which prints a JSON object of name -> PTX) -> that object."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)
