"""The direct-launch cache keys on what Triton's JIT specializes on: two arguments that share a
key must share the JIT's specialization, or a kernel compiled for one would run the other."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction

from muser.ops.triton import launch as launch_module
from muser.ops.triton.launch import _bind, cdiv, compile_only, launch, next_power_of_2

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
BACKEND = CUDABackend(GPUTarget("cuda", 90, 32))


def _spec(value):
    """The direct-launch key's part for one argument."""
    return _bind((value,), [])[1][0]


def jit_spec(value):
    return native(BACKEND, value, False, True, True)


def test_int_keys_are_at_least_as_fine_as_the_jit():
    values = [-(2**40), -(2**31) - 1, -(2**31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, 48,
              1000, 1024, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**40 + 1]
    for a, b in itertools.combinations(values, 2):
        if _spec(a) == _spec(b):
            assert jit_spec(a) == jit_spec(b), (a, b)
    assert len({_spec(v) for v in values}) >= len({jit_spec(v) for v in values})


def test_tensor_keys_follow_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base.view(torch.int32), base.to(torch.bfloat16),
               base.to(torch.bfloat16)[8:], base.to(torch.bfloat16)[3:]]
    for a, b in itertools.combinations(tensors, 2):
        if _spec(a) == _spec(b):
            assert jit_spec(a) == jit_spec(b)
    assert _spec(base) != _spec(base[1:])  # 4 bytes off a 16-byte boundary


def test_host_launch_arithmetic_matches_triton():
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
    for a, b in itertools.product(range(0, 300, 7), (1, 3, 16, 64, 128)):
        assert cdiv(a, b) == triton.cdiv(a, b)


def test_compile_only_hands_each_key_to_the_jit_once(monkeypatch):
    def body(x_ptr, n):
        pass

    kernel = JITFunction(body)
    warmed = []
    monkeypatch.setattr(kernel, "warmup", lambda *args, grid, **kw: warmed.append(args))
    monkeypatch.setattr(launch_module, "_INTERPRET", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    x = torch.zeros(8)
    token = compile_only.set(True)
    try:
        for n in (16, 32, 16, 17, 16, 17):
            launch(kernel, (1,), x, n)
    finally:
        compile_only.reset(token)
    assert [n for _, n in warmed] == [16, 17]  # 32 specializes as 16 does
